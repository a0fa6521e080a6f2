"""Exactly once at the edges, over HTTP: retries get their own grant back, a grant a retry was
handed is never released behind its back, and a release that took effect is reported released.

The races run against real `serve` processes on one database, squeezed by row locks that the test
holds (the key's fencing row, a lock's row), so that they run the same way every time.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from harness.node import node_example
from harness.processes import ROOT, helix_command, logged_requests, running_service
from harness.proxies import LyingProxy
from helix_locks.client import LockClient
from tests.support import ROUTE, Conn

KEY = {"organization_id": "acme", "job_type": "report"}


def lock_waiters(conn: Conn) -> int:
    """Backends of this database waiting for a row lock."""
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
    ).fetchone()
    return int(row[0]) if row else 0


def until(condition: Callable[[], bool], what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


class Background:
    """Run a call in a thread; result() joins it."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self._outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                self._outcome["result"] = call()
            except BaseException as exc:
                self._outcome["error"] = exc

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def result(self, timeout: float = 30) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the call did not end"
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome["result"]


@contextmanager
def holding_the_key(db_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A transaction holding the key's fencing row: every acquire of the key waits behind it."""
    with psycopg.connect(db_url) as blocker:
        blocker.execute(
            "SELECT 1 FROM helix_lock_keys WHERE organization_id = %s AND job_type = %s FOR UPDATE",
            (KEY["organization_id"], KEY["job_type"]),
        )
        yield blocker


def acquire(url: str, holder: str, key: str | None = None, **extra: Any) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key else {}
    body = {**KEY, "holder": holder, "ttl_seconds": 30, **extra}
    return httpx.post(f"{url}/v1/locks", json=body, headers=headers, timeout=60)


def release(url: str, lock: dict[str, Any]) -> httpx.Response:
    return httpx.delete(f"{url}/v1/locks/{lock['id']}", headers={"Lock-Token": lock["token"]}, timeout=60)


@pytest.fixture
def replicas(db_url: str, tmp_path: Path) -> Iterator[tuple[str, str]]:
    with (
        running_service(env=ROUTE.env(db_url), log=tmp_path / "one.log") as (one, _),
        running_service(env=ROUTE.env(db_url), log=tmp_path / "two.log") as (two, _),
    ):
        # The key's fencing row exists from the first grant on.
        first = acquire(one, "warm-up").json()
        assert release(one, first).status_code == 204
        yield one, two


def test_a_retry_racing_its_original_through_another_replica_gets_the_same_grant(
    replicas: tuple[str, str], db_url: str, conn: Conn
) -> None:
    """Finding 1: the original's statement runs on (its client gave up) when the retry arrives
    at another replica; the retry must be answered the original's grant, not 409 naming itself."""
    one, two = replicas
    with holding_the_key(db_url) as blocker:
        original = Background(lambda: acquire(one, "w1", "k1"))
        until(lambda: lock_waiters(conn) == 1, "the original waits for the key")
        retry = Background(lambda: acquire(two, "w1", "k1"))
        until(lambda: lock_waiters(conn) == 2, "the retry waits behind it")
        blocker.commit()
    first, again = original.result(), retry.result()
    assert first.status_code == 201, first.text
    assert again.status_code == 201, again.text
    assert (again.json()["id"], again.json()["token"]) == (first.json()["id"], first.json()["token"])
    assert again.json()["fencing_token"] == first.json()["fencing_token"]


def test_a_waiter_that_left_does_not_release_the_grant_its_retry_was_handed(
    replicas: tuple[str, str], db_url: str, conn: Conn
) -> None:
    """Finding 2: client C's waiting acquire is granted on replica one just as C leaves; C's retry
    through replica two is handed that grant. Replica one's clean-up must leave it to C."""
    one, two = replicas
    holder = acquire(one, "holder").json()
    payload = json.dumps({**KEY, "holder": "c", "ttl_seconds": 30, "wait_seconds": 20}).encode()
    host, port = one.removeprefix("http://").split(":")
    leaver = socket.create_connection((host, int(port)))
    head = (
        f"POST /v1/locks HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Idempotency-Key: k-c\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    leaver.sendall(head.encode() + payload)
    until(lambda: conn.execute("SELECT count(*) FROM helix_lock_waiters").fetchone() == (1,), "C registers")
    with holding_the_key(db_url) as blocker:
        assert release(one, holder).status_code == 204  # wakes C's waiter, which meets the held key
        until(lambda: lock_waiters(conn) == 1, "C's attempt waits for the key")
        leaver.close()  # C leaves while its grant is on its way
        time.sleep(0.2)
        retry = Background(lambda: acquire(two, "c", "k-c"))
        until(lambda: lock_waiters(conn) == 2, "C's retry waits behind it")
        blocker.commit()
    again = retry.result()
    assert again.status_code == 201, again.text
    time.sleep(0.5)  # replica one has found C gone and cleaned up by now
    lock = httpx.get(f"{one}/v1/locks/{again.json()['id']}", timeout=10).json()
    assert lock["state"] == "held", f"the grant C's retry holds was released behind its back: {lock}"
    other = acquire(two, "d")
    assert other.status_code == 409 and other.json()["holder"] == "c"


def test_a_release_that_answered_503_and_committed_is_a_release_to_the_sdk(
    db_url: str, tmp_path: Path
) -> None:
    """Finding 4: with one pooled connection, a pool wait plus a lock wait pass the deadline: the
    release answers 503 and commits afterwards. The SDK's retry finds 410 released, by its own
    token: that is its success, not LockLost."""
    env = ROUTE.env(db_url, HELIX_LOCKS_POOL_MAX_SIZE="1", HELIX_LOCKS_POOL_MIN_SIZE="1")
    env["HELIX_LOCKS_STATEMENT_TIMEOUT_MS"] = "3000"
    env["HELIX_LOCKS_POOL_TIMEOUT_SECONDS"] = "5"  # the release waits for the connection, not 503 at once
    with running_service(env=env, log=tmp_path / "s.log") as (url, _), LockClient(url) as client:
        other = client.acquire("acme", "other", ttl=30)
        client.release(other.id, other.token)  # the other key's fencing row exists
        grant = client.acquire("acme", "report", ttl=30)
        with psycopg.connect(db_url) as keys, psycopg.connect(db_url) as row:
            keys.execute("SELECT 1 FROM helix_lock_keys WHERE job_type = 'other' FOR UPDATE")
            row.execute("SELECT 1 FROM helix_holds WHERE id = %s FOR KEY SHARE", (grant.id,))
            # The one connection waits for the other key, the release waits for the connection.
            busy = Background(
                lambda: httpx.post(
                    f"{url}/v1/locks",
                    json={**KEY, "job_type": "other", "holder": "x", "ttl_seconds": 30},
                    timeout=30,
                )
            )
            time.sleep(0.3)
            released = Background(lambda: client.release(grant.id, grant.token))
            time.sleep(2)
            keys.commit()  # the connection is free: the release's statement meets the row lock
            time.sleep(2.5)  # past the release's deadline (3 s + 1 s from its arrival): 503
            row.commit()  # the release commits now
        assert busy.result().status_code == 201
        released.result()  # no LockLost
    answers = [(line["method"], line["status"]) for line in logged_requests(tmp_path / "s.log")]
    assert answers[-2:] == [("DELETE", 503), ("DELETE", 410)], "answered 503 while it ran on, then 410"


def worker(
    example: str, base_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HELIX_LOCKS_", "WORKER_"))}
    env |= {
        "HELIX_LOCKS_URL": base_url,
        "WORKER_ORG": KEY["organization_id"],
        "WORKER_JOB_TYPE": KEY["job_type"],
        "WORKER_TTL": "5",
        "WORKER_WORK_SECONDS": "0.2",
        "WORKER_WAIT_SECONDS": "3",
    }
    command = {
        "curl": [str(ROOT / "examples" / "curl-worker.sh")],
        "node": ["node", str(tmp_path / "node-worker.mjs")],
        "run": helix_command(
            "run",
            "--org",
            KEY["organization_id"],
            "--job-type",
            KEY["job_type"],
            "--ttl",
            "5",
            "--",
            "sh",
            "-c",
            f"echo done >> {tmp_path / 'out'}",
        ),
    }[example]
    if example == "node":  # run as a user runs it, beside a node_modules that holds the client
        node_example(request.getfixturevalue("node_client"), tmp_path)
    return subprocess.run(
        [*command, str(tmp_path / "out")] if example != "run" else command,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("example", ["curl", "node", "run"])
def test_workers_get_through_503s_that_took_effect(
    example: str, db_url: str, tmp_path: Path, conn: Conn, request: pytest.FixtureRequest
) -> None:
    """The acquire and the release each take effect and answer 503: the retry with the same
    Idempotency-Key gets the same grant (not 409 from its own lock), and the retried release
    finds its own release (410 released): done, exit 0, one grant."""
    with (
        running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _),
        LyingProxy(url, [("POST", "/v1/locks"), ("DELETE", "/v1/locks/")]) as proxy,
    ):
        result = worker(example, proxy.url, tmp_path, request)
    assert result.returncode == 0, result.stderr
    statuses = [status for _method, _path, status in proxy.told]
    assert statuses.count(503) == 2, proxy.told
    grants = conn.execute(
        "SELECT id, release_reason FROM helix_job_locks WHERE job_type = %s", (KEY["job_type"],)
    ).fetchall()
    assert len(grants) == 1, f"one grant, taken once and released once: {grants}"
    assert grants[0][1] == "released"
