"""/metrics: the lock counters, latency histograms, pool and lock gauges, one process or several."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from harness.processes import running_service
from helix_locks.server import keys, openapi, telemetry
from helix_locks.server.app import create_app
from helix_locks.server.locks import Locks
from helix_locks.server.settings import Settings
from tests.support import Conn, expire, in_process, lock_body, samples, value

pytestmark = pytest.mark.anyio


@pytest.fixture
def admin(db_url: str) -> str:
    return keys.create(db_url, None)


async def app_client(db_url: str, admin: str, **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(Settings(database_url=db_url, **settings))
    headers = {"Authorization": f"Bearer {admin}"}
    async with in_process(app, headers=headers) as http:
        yield http


@pytest.fixture
async def client(db_url: str, admin: str) -> AsyncIterator[httpx.AsyncClient]:
    async for http in app_client(db_url, admin):
        yield http


async def test_every_outcome_is_counted(client: httpx.AsyncClient, conn: Conn) -> None:
    first = (await client.post("/v1/locks", json=lock_body(job_type="a"))).json()
    assert (await client.post("/v1/locks", json=lock_body(job_type="a"))).status_code == 409
    assert (await client.post("/v1/locks", json=lock_body(job_type="a", ttl_seconds=-1))).status_code == 422
    expire(conn, first["id"])
    second = (await client.post("/v1/locks", json=lock_body(job_type="a"))).json()
    assert second["fencing_token"] == first["fencing_token"] + 1  # a reclaim
    # The first holder learns it lost the lock: twice, renewing and releasing.
    token = {"Lock-Token": first["token"]}
    assert (
        await client.post(f"/v1/locks/{first['id']}/renew", json={"ttl_seconds": 30}, headers=token)
    ).status_code == 410
    assert (await client.delete(f"/v1/locks/{first['id']}", headers=token)).status_code == 410
    token = {"Lock-Token": second["token"]}
    assert (
        await client.post(f"/v1/locks/{second['id']}/renew", json={"ttl_seconds": 30}, headers=token)
    ).status_code == 200
    assert (await client.delete(f"/v1/locks/{second['id']}", headers=token)).status_code == 204
    third = (await client.post("/v1/locks", json=lock_body(job_type="b"))).json()
    assert (await client.delete(f"/v1/locks/{third['id']}", params={"force": "true"})).status_code == 204
    held = (await client.post("/v1/locks", json=lock_body(job_type="c"))).json()
    stale = (await client.post("/v1/locks", json=lock_body(job_type="d"))).json()
    expire(conn, stale["id"])

    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    found = samples(response.text)
    acquisitions = "helix_locks_acquisitions_total"
    assert value(found, acquisitions, organization="", result="granted") == 4
    assert value(found, acquisitions, organization="", result="reclaimed") == 1
    assert value(found, acquisitions, organization="", result="conflict") == 1
    assert value(found, acquisitions, organization="", result="invalid-request") == 1
    assert value(found, "helix_locks_releases_total", organization="", result="released") == 1
    assert value(found, "helix_locks_releases_total", organization="", result="forced") == 1
    assert value(found, "helix_locks_releases_total", organization="", result="gone") == 1
    assert value(found, "helix_locks_renewals_total", organization="", result="renewed") == 1
    assert value(found, "helix_locks_renewals_total", organization="", result="gone") == 1
    assert value(found, "helix_locks_lost_total", organization="") == 2
    latency = "helix_locks_http_request_duration_seconds_count"
    assert value(found, latency, method="POST", route="/v1/locks", status="201") == 5
    assert value(found, latency, method="DELETE", route="/v1/locks/{lock_id}", status="410") == 1
    # In process, every request takes well under a second: each falls in the 1 s bucket.
    bucket = "helix_locks_http_request_duration_seconds_bucket"
    assert value(found, bucket, method="POST", route="/v1/locks", status="201", le="1.0") == 5
    assert value(found, "helix_locks_locks", state="held") == 1, held
    assert value(found, "helix_locks_locks", state="expired") == 1
    assert value(found, "helix_locks_pool_connections") >= 1


# The bodies of the routes that take one other than an acquire's.
BODIES: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", "/v1/locks/{lock_id}/renew"): {"ttl_seconds": 30},
    ("POST", "/v1/locks/{lock_id}/revocation"): {"reason": "deploy"},
    ("PATCH", "/v1/locks/{lock_id}"): {"metadata": {"done": 1}},
    ("POST", "/v1/sessions"): {"organization_id": "acme", "holder": "w1", "ttl_seconds": 30},
    ("POST", "/v1/sessions/{session_id}/locks"): {"locks": [{"job_type": "in-a-session"}]},
    ("POST", "/v1/sessions/{session_id}/renew"): {"ttl_seconds": 30},
}


async def test_every_route_is_counted_under_its_path(client: httpx.AsyncClient) -> None:
    """Each route of the API's document counts its requests under its path; the three lock
    operations count each answer in their own counter too, found by the route's method and path."""
    lock = (await client.post("/v1/locks", json=lock_body(job_type="routes"))).json()
    session = (await client.post("/v1/sessions", json=BODIES["POST", "/v1/sessions"])).json()
    sent: Counter[tuple[str, str]] = Counter({("POST", "/v1/locks"): 1, ("POST", "/v1/sessions"): 1})
    document = json.loads(openapi.document())["paths"]
    routes = [(method.upper(), path) for path, operations in document.items() for method in operations]
    assert set(telemetry.OPERATIONS) <= set(routes)
    key = {"organization_id": lock["organization_id"], "job_type": "routes"}
    for method, path in sorted(routes, key=lambda route: route[0] == "DELETE"):  # the release last
        # The key, to the routes that take it (any other query parameter is refused).
        parameters = document[path][method.lower()].get("parameters", [])
        declared = {parameter["name"] for parameter in parameters if parameter["in"] == "query"}
        # The event stream never ends by itself (and the in-process transport reads answers whole):
        # it is asked to resume from an id it refuses, and counted by that answer.
        stream = (method, path) == ("GET", "/v1/events")
        token = session["token"] if "{session_id}" in path else lock["token"]
        response = await client.request(
            method,
            path.replace("{lock_id}", str(lock["id"])).replace("{session_id}", str(session["id"])),
            headers={"Lock-Token": token} | ({"Last-Event-ID": "made-up"} if stream else {}),
            params={name: value for name, value in key.items() if name in declared},
            json=BODIES.get((method, path), lock_body(job_type="other") if method == "POST" else None),
        )
        assert response.status_code == 422 if stream else response.status_code < 300, (
            method,
            path,
            response.text,
        )
        sent[method, path] += 1
    found = samples((await client.get("/metrics")).text)
    for (method, path), count in sent.items():
        counted = sum(
            seen
            for (name, labels), seen in found.items()
            if name == "helix_locks_http_request_duration_seconds_count"
            and {("method", method), ("route", path)} <= labels
        )
        assert counted >= count, (method, path)  # /metrics counts itself once it has answered
        if (method, path) in telemetry.OPERATIONS:
            counter = f"helix_locks_{telemetry.OPERATIONS[method, path]}_total"
            assert sum(seen for (name, _), seen in found.items() if name == counter) == count, counter


async def test_the_lock_gauges_are_read_at_most_every_few_seconds(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(telemetry, "LOCK_GAUGE_SECONDS", 0.5)
    await client.post("/v1/locks", json=lock_body(job_type="a"))
    assert value(samples((await client.get("/metrics")).text), "helix_locks_locks", state="held") == 1
    await client.post("/v1/locks", json=lock_body(job_type="b"))
    # Scrapes within the window answer from the last reading, without a query each.
    assert value(samples((await client.get("/metrics")).text), "helix_locks_locks", state="held") == 1
    await anyio.sleep(0.6)
    assert value(samples((await client.get("/metrics")).text), "helix_locks_locks", state="held") == 2


async def test_organizations_are_labels_only_when_asked(
    db_url: str, admin: str, conn: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def no_second_read(*args: object) -> None:
        raise AssertionError("the 410 and 403 carry the lock's organization: no second read")

    async for client in app_client(db_url, admin, metrics_organization_label=True):
        lost = (await client.post("/v1/locks", json=lock_body(organization_id="globex"))).json()
        expire(conn, lost["id"])
        held = await client.post("/v1/locks", json=lock_body(organization_id="globex"))  # reclaims it
        monkeypatch.setattr(Locks, "get", no_second_read)
        gone = await client.delete(f"/v1/locks/{lost['id']}", headers={"Lock-Token": lost["token"]})
        assert gone.status_code == 410
        wrong = {"Lock-Token": "0" * 32}
        assert (await client.delete(f"/v1/locks/{held.json()['id']}", headers=wrong)).status_code == 403
        monkeypatch.undo()
        found = samples((await client.get("/metrics")).text)
        assert value(found, "helix_locks_acquisitions_total", organization="globex", result="granted") == 1
        assert value(found, "helix_locks_acquisitions_total", organization="globex", result="reclaimed") == 1
        # The 410 is counted against the lock's organization, though the request named none.
        assert value(found, "helix_locks_releases_total", organization="globex", result="gone") == 1
        assert value(found, "helix_locks_lost_total", organization="globex") == 1
        assert value(found, "helix_locks_releases_total", organization="globex", result="token-mismatch") == 1


def test_every_worker_is_counted_whichever_answers_the_scrape(db_url: str, tmp_path: Path) -> None:
    """Two worker processes: each scrape, answered by either, counts both workers' requests."""
    # Two connections per worker, exactly.
    env = {"DATABASE_URL": db_url, "HELIX_LOCKS_POOL_MIN_SIZE": "2", "HELIX_LOCKS_POOL_MAX_SIZE": "2"}
    with (
        running_service("--workers", "2", env=env, log=tmp_path / "s.log") as (url, _),
        httpx.Client(base_url=url) as http,
    ):
        for n in range(30):
            # A new connection each time, so that both workers take some.
            response = httpx.post(f"{url}/v1/locks", json=lock_body(job_type=f"job-{n}"))
            assert response.status_code == 201
        deadline = time.monotonic() + 10
        while True:
            found = samples(http.get("/metrics").text)
            # Each worker's pool keeps 2 connections: 4 means both workers' figures are here.
            if value(found, "helix_locks_pool_connections") == 4 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert value(found, "helix_locks_pool_connections") == 4
        for _ in range(10):
            found = samples(httpx.get(f"{url}/metrics").text)
            assert value(found, "helix_locks_acquisitions_total", organization="", result="granted") == 30
            assert value(found, "helix_locks_locks", state="held") == 30


async def test_made_up_methods_share_one_series_and_long_paths_are_cut_in_the_log(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="helix_locks.requests")
    for n in range(35):  # as many methods as HTTP parsers know (PROPFIND, MKCOL, ...), made up here
        await client.request(f"BREW{n}", "/v1/locks")
    await client.get("/v1/locks/" + "x" * 60_000)
    found = samples((await client.get("/metrics")).text)
    methods = {
        dict(labels)["method"] for name, labels in found if name.startswith("helix_locks_http_request")
    }
    assert methods <= {"GET", "POST", "DELETE", "other"}, methods
    other = sum(
        v
        for (name, labels), v in found.items()
        if name.endswith("_count") and dict(labels).get("method") == "other"
    )
    assert other == 35
    logged = [record for record in caplog.records if record.getMessage() == "request"]
    assert logged and max(len(str(getattr(record, "path", ""))) for record in logged) < 1024
