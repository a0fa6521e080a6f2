"""wait_seconds: woken by release (NOTIFY, across processes too) or by expiry, never by polling."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from asgi_lifespan import LifespanManager

from harness.processes import running_service
from helix_locks.server.app import create_app
from helix_locks.server.errors import DatabaseUnavailable, LockHeld
from helix_locks.server.locks import Grant, Place
from helix_locks.server.waiting import Waiters
from tests.support import ROUTE, Conn, in_process

pytestmark = pytest.mark.anyio


def body(holder: str, wait: float = 0, ttl: float = 30, job_type: str = "report") -> dict[str, Any]:
    return {
        "organization_id": "acme",
        "job_type": job_type,
        "holder": holder,
        "ttl_seconds": ttl,
        "wait_seconds": wait,
    }


async def grant(client: httpx.AsyncClient, holder: str, **kw: Any) -> dict[str, Any]:
    response = await client.post("/v1/locks", json=body(holder, **kw))
    assert response.status_code == 201, response.text
    granted: dict[str, Any] = response.json()
    return granted


async def release(client: httpx.AsyncClient, lock: dict[str, Any]) -> None:
    response = await client.delete(f"/v1/locks/{lock['id']}", headers={"Lock-Token": lock["token"]})
    assert response.status_code == 204


async def test_a_waiter_is_granted_as_soon_as_the_holder_releases(client: httpx.AsyncClient) -> None:
    held = await grant(client, "first")
    waiter = asyncio.create_task(client.post("/v1/locks", json=body("second", wait=10)))
    await asyncio.sleep(0.3)
    assert not waiter.done()
    released_at = time.monotonic()
    await release(client, held)
    response = await waiter
    assert response.status_code == 201
    assert time.monotonic() - released_at < 5, "woken by the release, not by its 10 s wait"
    gone = (await client.get(f"/v1/locks/{held['id']}")).json()
    assert datetime.fromisoformat(response.json()["acquired_at"]) >= datetime.fromisoformat(
        gone["released_at"]
    )
    assert response.json()["fencing_token"] == held["fencing_token"] + 1


async def test_a_waiter_is_granted_when_the_lease_expires(client: httpx.AsyncClient) -> None:
    held = await grant(client, "crashed", ttl=1)
    started = time.monotonic()
    response = await client.post("/v1/locks", json=body("next", wait=10))
    assert response.status_code == 201
    assert response.json()["reclaimed"]["lock_id"] == held["id"]
    assert time.monotonic() - started < 2


async def test_a_waiter_is_woken_when_a_renewal_shortens_the_lease_it_sleeps_on(
    client: httpx.AsyncClient,
) -> None:
    """Asleep until a 60 s lease runs out, the waiter is woken by the renewal that cuts it to 1 s
    (announced, migration 0018), and reclaims the lock when that second is up, not at its wait's end."""
    held = await grant(client, "holder", ttl=60)
    waiter = asyncio.create_task(client.post("/v1/locks", json=body("next", wait=20)))
    await asyncio.sleep(0.5)
    assert not waiter.done()
    renewed = await client.post(
        f"/v1/locks/{held['id']}/renew", json={"ttl_seconds": 1}, headers={"Lock-Token": held["token"]}
    )
    assert renewed.status_code == 200, renewed.text
    renewed_at = time.monotonic()
    response = await asyncio.wait_for(waiter, 30)
    assert response.status_code == 201, response.text
    assert response.json()["reclaimed"]["lock_id"] == held["id"]
    assert time.monotonic() - renewed_at < 5, "woken by the renewal, not at the end of its wait"


async def test_a_wait_that_runs_out_is_409_with_the_holder_as_it_is_then(client: httpx.AsyncClient) -> None:
    """The last answer comes from one more attempt: a renewal during the wait is in it."""
    held = await grant(client, "holder")
    started = time.monotonic()
    impatient = asyncio.create_task(client.post("/v1/locks", json=body("impatient", wait=1)))
    await asyncio.sleep(0.3)
    renewed = await client.post(
        f"/v1/locks/{held['id']}/renew", json={"ttl_seconds": 45}, headers={"Lock-Token": held["token"]}
    )
    assert renewed.status_code == 200, renewed.text
    response = await impatient
    assert response.status_code == 409
    assert response.json()["holder"] == "holder"
    assert response.json()["lock_id"] == held["id"]
    assert response.json()["expires_at"] == renewed.json()["expires_at"]
    assert 1 <= time.monotonic() - started < 3


async def test_waiters_in_one_process_are_served_in_arrival_order(client: httpx.AsyncClient) -> None:
    held = await grant(client, "holder")
    first = asyncio.create_task(client.post("/v1/locks", json=body("first", wait=10)))
    await asyncio.sleep(0.2)
    second = asyncio.create_task(client.post("/v1/locks", json=body("second", wait=10)))
    await asyncio.sleep(0.2)
    await release(client, held)
    got = (await first).json()
    assert got["holder"] == "first"
    assert not second.done()
    await release(client, got)
    assert (await second).json()["holder"] == "second"


async def test_beyond_the_waiter_cap_the_answer_is_503(db_url: str) -> None:
    app = create_app(ROUTE.settings(db_url, allow_anonymous=True, max_waiters=1))
    async with in_process(app) as c:
        await grant(c, "holder")
        waiting = asyncio.create_task(c.post("/v1/locks", json=body("one", wait=1)))
        await asyncio.sleep(0.2)
        refused = await c.post("/v1/locks", json=body("two", wait=1))
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert (await waiting).status_code == 409


def test_a_release_in_one_process_wakes_a_waiter_in_another(db_url: str, tmp_path: Path) -> None:
    env = ROUTE.env(db_url)
    with (
        running_service(env=env, log=tmp_path / "a.log") as (one, _),
        running_service(env=env, log=tmp_path / "b.log") as (two, _),
    ):
        held = httpx.post(f"{one}/v1/locks", json=body("holder"), timeout=10).json()

        def wait_on_two() -> httpx.Response:
            return httpx.post(f"{two}/v1/locks", json=body("waiter", wait=20), timeout=30)

        async def scenario() -> tuple[httpx.Response, float]:
            waiter = asyncio.create_task(asyncio.to_thread(wait_on_two))
            await asyncio.sleep(0.5)
            released = time.monotonic()
            url = f"{one}/v1/locks/{held['id']}"
            await asyncio.to_thread(httpx.delete, url, headers={"Lock-Token": held["token"]}, timeout=10)
            response = await waiter
            return response, time.monotonic() - released

        response, latency = asyncio.run(scenario())
        assert response.status_code == 201
        assert latency < 10, "woken by NOTIFY from the other process, not by the lease's 30 s"


def test_a_waiter_whose_client_left_does_not_keep_the_lock(db_url: str, tmp_path: Path, conn: Conn) -> None:
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _):
        held = httpx.post(f"{url}/v1/locks", json=body("holder"), timeout=10).json()
        port = int(url.rsplit(":", 1)[1])
        payload = json.dumps(body("leaver", wait=20)).encode()
        with socket.create_connection(("127.0.0.1", port)) as raw:
            raw.sendall(
                b"POST /v1/locks HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            time.sleep(0.3)
        time.sleep(0.3)  # the client is gone
        httpx.delete(f"{url}/v1/locks/{held['id']}", headers={"Lock-Token": held["token"]}, timeout=10)
        time.sleep(0.5)
        after = httpx.post(f"{url}/v1/locks", json=body("next"), timeout=10)
        assert after.status_code == 201, "nobody may hold the lock for a client that left"
    leaver = conn.execute(
        "SELECT count(*) FROM helix_job_locks WHERE holder = 'leaver' AND released_at IS NULL"
    )
    assert leaver.fetchone() == (0,)


async def test_stopping_the_service_answers_waiting_requests(db_url: str) -> None:
    lifespan = LifespanManager(create_app(ROUTE.settings(db_url, allow_anonymous=True)))
    transport = httpx.ASGITransport(app=lifespan.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
        async with lifespan:
            await grant(c, "holder")
            waiting = asyncio.create_task(c.post("/v1/locks", json=body("waiter", wait=30)))
            await asyncio.sleep(0.2)
            started = time.monotonic()
        response = await waiting
        assert response.status_code == 503
        assert time.monotonic() - started < 2


def test_sigterm_answers_waiting_requests_at_once(db_url: str, tmp_path: Path) -> None:
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, server):
        httpx.post(f"{url}/v1/locks", json=body("holder"), timeout=10)

        async def scenario() -> tuple[httpx.Response, float]:
            waiter = asyncio.create_task(
                asyncio.to_thread(httpx.post, f"{url}/v1/locks", json=body("waiter", wait=30), timeout=40)
            )
            await asyncio.sleep(0.5)
            stopped = time.monotonic()
            server.terminate()
            response = await waiter
            return response, time.monotonic() - stopped

        response, elapsed = asyncio.run(scenario())
        assert response.status_code == 503
        assert elapsed < 10, "answered by the shutdown, not at the end of its 30 s wait"
        assert server.wait(timeout=10) == 0


async def _announcements(listening: psycopg.AsyncConnection[Any], seconds: float) -> list[str]:
    heard = []
    async for notify in listening.notifies(timeout=seconds):
        heard.append(notify.payload)
    return heard


async def test_releases_are_announced_only_while_someone_waits_for_the_key(
    client: httpx.AsyncClient, db_url: str, conn: Conn
) -> None:
    """A NOTIFY serialises committing transactions cluster-wide: releases nobody waits for
    must not send one."""
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as listening:
        await listening.execute("LISTEN helix_lock_released")
        await release(client, await grant(client, "alone"))
        assert await _announcements(listening, 0.5) == []

        held = await grant(client, "holder")
        waiter = asyncio.create_task(client.post("/v1/locks", json=body("waiter", wait=10)))
        for _ in range(100):
            if conn.execute("SELECT count(*) FROM helix_lock_waiters").fetchone() == (1,):
                break
            await asyncio.sleep(0.02)
        assert not waiter.done()
        await release(client, held)
        assert await _announcements(listening, 0.5) == ["acme/report"]
        granted = await waiter
        assert granted.status_code == 201
        assert conn.execute("SELECT count(*) FROM helix_lock_waiters").fetchone() == (0,)

        await release(client, granted.json())
        assert await _announcements(listening, 0.5) == []


async def test_a_release_just_as_a_waiter_registers_is_not_missed(client: httpx.AsyncClient) -> None:
    """The waiter registers between its first attempt and its wait: releases landing around that
    moment, at varied offsets, must each wake it at once (the holder's lease is 30 s)."""
    for round_ in range(30):
        held = await grant(client, f"holder-{round_}")
        waiter = asyncio.create_task(client.post("/v1/locks", json=body(f"waiter-{round_}", wait=5)))
        await asyncio.sleep(round_ * 0.0005)
        released = time.monotonic()
        await release(client, held)
        response = await waiter
        assert response.status_code == 201, response.text
        assert time.monotonic() - released < 1, f"round {round_}: the release was missed"
        await release(client, response.json())


async def test_a_lapsed_registration_announces_nothing(
    client: httpx.AsyncClient, db_url: str, conn: Conn
) -> None:
    """A registration whose delete never ran (its process died) stops counting at `until`, and
    the next registration deletes it."""
    conn.execute(
        "INSERT INTO helix_lock_waiters (organization_id, job_type, until)"
        " VALUES ('acme', 'report', clock_timestamp() - interval '1 second')"
    )
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as listening:
        await listening.execute("LISTEN helix_lock_released")
        await release(client, await grant(client, "alone"))
        assert await _announcements(listening, 0.5) == []
    conn.execute("SELECT helix_wait_for_release('acme', 'other', 10)")
    rows = conn.execute("SELECT job_type FROM helix_lock_waiters").fetchall()
    assert rows == [("other",)]


async def test_a_place_the_database_refuses_ends_the_wait_with_503() -> None:
    """A waiter that cannot take its place in the queue (the database is away) cannot wait its
    turn: it answers DatabaseUnavailable (503, try again) after its one attempt, and holds nothing
    (no database here at all: every call is a stand-in)."""
    attempts: list[Place | None] = []

    async def attempt(place: Place | None) -> Grant:
        attempts.append(place)
        raise LockHeld(7, "holder", None, 1)

    async def remaining_ms(lock_id: int) -> int:
        return 200

    async def release(grant: Grant) -> None:
        raise AssertionError("nothing to release")

    @asynccontextmanager
    async def queued() -> AsyncIterator[Place]:
        raise DatabaseUnavailable("connection refused")
        yield Place(1, "owner")

    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiters = Waiters(10, 10)
    with pytest.raises(DatabaseUnavailable):
        await waiters.acquire(("acme", "report"), 5, attempt, remaining_ms, release, gone, queued)
    assert attempts == [None], "one attempt without a place, none after"
    assert waiters.count == 0


async def test_one_organization_filling_its_waiting_share_leaves_the_others_theirs(db_url: str) -> None:
    """With room for 50 waiters in the process and 10 per organization, acme's 11th waiter gets
    429 with Retry-After, and globex still waits as usual."""
    settings = ROUTE.settings(db_url, allow_anonymous=True, max_waiters=50, max_waiters_per_organization=10)
    app = create_app(settings)
    async with in_process(app, timeout=30) as c:
        for org in ("acme", "globex"):
            held = await c.post("/v1/locks", json={**body("holder"), "organization_id": org})
            assert held.status_code == 201
        waiting = [asyncio.create_task(c.post("/v1/locks", json=body(f"w{n}", wait=2))) for n in range(10)]
        await asyncio.sleep(0.3)
        refused = await c.post("/v1/locks", json=body("w11", wait=2))
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["type"] == "urn:helix-locks:problem:too-many-waiters-in-organization"
        other = await c.post("/v1/locks", json={**body("g1", wait=0.5), "organization_id": "globex"})
        assert other.status_code == 409, "globex waited its half second, as any waiter"
        assert [answer.status_code for answer in await asyncio.gather(*waiting)] == [409] * 10
