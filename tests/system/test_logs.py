"""Logs: one JSON line per event with the request's id and fields, never a key or a lock token."""

from __future__ import annotations

import io
import json
import logging
import logging.config
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from harness.processes import logged_requests, running_service
from helix_locks.server import keys, logs
from helix_locks.server.app import create_app
from tests.support import ROUTE, in_process, lock_body


def test_each_request_is_one_json_line_with_its_id_and_no_secret(db_url: str, tmp_path: Path) -> None:
    key = keys.create(db_url, "acme")
    log = tmp_path / "s.log"
    env = {"DATABASE_URL": db_url, "HELIX_LOCKS_LOG_FORMAT": "json"}
    with running_service(env=env, log=log) as (url, server):
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as http:
            granted = http.post("/v1/locks", json=lock_body(), headers={"X-Request-Id": "job-42.try-1"})
            assert granted.status_code == 201
            assert granted.headers["X-Request-Id"] == "job-42.try-1"
            lock = granted.json()
            conflict = http.post("/v1/locks", json=lock_body(holder="w2"))
            assert conflict.status_code == 409
            assert len(conflict.headers["X-Request-Id"]) == 32  # made up for a request without one
            bad_id = http.get("/v1/locks", headers={"X-Request-Id": "no spaces or {braces}"})
            assert bad_id.headers["X-Request-Id"] != "no spaces or {braces}"
            token = {"Lock-Token": lock["token"]}
            assert http.delete(f"/v1/locks/{lock['id']}", headers=token).status_code == 204
        server.terminate()
        assert server.wait(timeout=20) == 0

    text = log.read_text()
    for secret in (key, lock["token"]):
        assert secret not in text
    lines = logged_requests(log)
    by_id = {line["request_id"]: line for line in lines}
    acquire = by_id["job-42.try-1"]
    assert acquire["status"] == 201
    assert acquire["path"] == "/v1/locks" and acquire["method"] == "POST"
    assert (acquire["organization_id"], acquire["job_type"]) == ("acme", "nightly-report")
    assert (acquire["lock_id"], acquire["outcome"]) == (lock["id"], "granted")
    assert acquire["key_id"] == keys.key_id(key)
    assert acquire["duration_ms"] > 0
    refused = by_id[conflict.headers["X-Request-Id"]]
    assert (refused["status"], refused["problem"], refused["job_type"]) == (
        409,
        "lock-held",
        "nightly-report",
    )
    assert bad_id.headers["X-Request-Id"] in by_id
    release = [line for line in lines if line["method"] == "DELETE"]
    assert [(r["lock_id"], r["outcome"], r["organization_id"]) for r in release] == [
        (lock["id"], "released", "acme")
    ]
    assert len(lines) == 4, "one line per request"


def test_text_for_a_terminal_and_a_level_to_quiet_it(db_url: str, tmp_path: Path) -> None:
    log = tmp_path / "s.log"
    env = {"DATABASE_URL": db_url, "HELIX_LOCKS_LOG_FORMAT": "text", "HELIX_LOCKS_LOG_LEVEL": "WARNING"}
    with running_service(env=env, log=log) as (url, _):
        assert httpx.post(f"{url}/v1/locks", json=lock_body()).status_code == 201
        assert httpx.post(f"{url}/v1/locks", json=lock_body(ttl_seconds="x")).status_code == 422
    text = log.read_text()
    assert "request" not in text, "info lines are below WARNING"

    log = tmp_path / "text.log"
    env = {"DATABASE_URL": db_url, "HELIX_LOCKS_LOG_FORMAT": "text"}
    with running_service(env=env, log=log) as (url, _):
        response = httpx.post(f"{url}/v1/locks", json=lock_body(job_type="other"))
        assert response.status_code == 201
    lines = [line for line in log.read_text().splitlines() if " request " in line]
    assert len(lines) == 1
    assert f"request_id={response.headers['X-Request-Id']}" in lines[0]
    assert not lines[0].startswith("{")


def test_a_failure_is_logged_once_with_its_request_id_and_no_secret(
    db_url: str, tmp_path: Path, conn: psycopg.Connection[Any]
) -> None:
    key = keys.create(db_url, "acme")
    log = tmp_path / "s.log"
    with (
        running_service(env={"DATABASE_URL": db_url, "HELIX_LOCKS_LOG_FORMAT": "json"}, log=log) as (url, _),
        httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as http,
    ):
        lock = http.post("/v1/locks", json=lock_body()).json()
        conn.execute("ALTER TABLE helix_holds RENAME TO helix_holds_gone")  # every call fails now
        failed = [
            http.post("/v1/locks", json=lock_body(job_type="b"), headers={"Idempotency-Key": "idem-7f3a9c"}),
            http.delete(f"/v1/locks/{lock['id']}", headers={"Lock-Token": lock["token"]}),
        ]
    text = log.read_text()
    for secret in (key, lock["token"], "idem-7f3a9c"):
        assert secret not in text
    lines = [json.loads(line) for line in text.splitlines()]
    for answer in failed:
        assert answer.status_code == 500
        assert answer.json()["type"] == "urn:helix-locks:problem:internal-error"
        request_id = answer.headers["X-Request-Id"]
        assert request_id
        logged = [line for line in lines if line.get("request_id") == request_id]
        assert [line["event"] for line in logged] == [
            f"unhandled error on {answer.request.method} {answer.request.url.path}",
            "request",
        ]
        assert "UndefinedTable" in json.dumps(logged[0]["exception"])
    assert not any("Exception in ASGI application" in line["event"] for line in lines)


def test_the_request_line_is_what_the_standard_librarys_path_writes(tmp_path: Path) -> None:
    """logs.line writes the request's line without a LogRecord: the same JSON, field for field and
    in the same order, as logger.log through the configured handler; with any other handler set
    up, it takes that path itself."""
    stream = io.StringIO()
    config = logs.config(logs.LogSettings(format="json"))
    config["handlers"]["stderr"]["stream"] = stream
    logger = logging.getLogger("helix_locks.requests")
    fields = {"method": "POST", "path": "/v1/locks", "status": 201, "duration_ms": 1.5, "outcome": "granted"}
    try:
        logging.config.dictConfig(config)
        with logs.request(request_id="r1"):
            logs.bind(organization_id="acme", lock_id=7, holder="w\u00e9")
            logs.line(logger, logging.INFO, "request", dict(fields))
            logger.log(logging.INFO, "request", extra=dict(fields))
            logs.line(logger, logging.ERROR, "request", {**fields, "status": 500})
            logger.log(logging.ERROR, "request", extra={**fields, "status": 500})
            logs.line(logger, logging.DEBUG, "request", dict(fields))  # below the level: nothing
        fast, slow, fast_error, slow_error = (json.loads(line) for line in stream.getvalue().splitlines())
        for one, other in ((fast, slow), (fast_error, slow_error)):
            assert list(one) == list(other) and one.pop("time") <= other.pop("time") and one == other
        assert fast["request_id"] == "r1" and fast["holder"] == "w\u00e9" and fast_error["level"] == "error"

        # A second handler (a test's, say): the standard library's path, which reaches both.
        second = io.StringIO()
        logging.getLogger().addHandler(logging.StreamHandler(second))
        logs.line(logger, logging.INFO, "request", dict(fields))
        assert second.getvalue() == "request\n" and len(stream.getvalue().splitlines()) == 5
    finally:
        logging.config.dictConfig(logs.config())


class _Broken(io.StringIO):
    """A stream whose reader is gone (a closed pipe)."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.anyio
async def test_a_log_stream_that_fails_does_not_fail_the_request(db_url: str) -> None:
    """Writing the line fails (the log shipper died, the disk is full): the handler reports it
    its own way, as the standard library's path does, and the request is answered."""
    config = logs.config(logs.LogSettings(format="json"))
    config["handlers"]["stderr"]["stream"] = _Broken()
    try:
        logging.config.dictConfig(config)
        app = create_app(ROUTE.settings(db_url, allow_anonymous=True))
        async with in_process(app) as http:
            granted = await http.post("/v1/locks", json=lock_body())
            assert granted.status_code == 201, granted.text
            token = {"Lock-Token": granted.json()["token"]}
            assert (await http.delete(f"/v1/locks/{granted.json()['id']}", headers=token)).status_code == 204
    finally:
        logging.config.dictConfig(logs.config())
