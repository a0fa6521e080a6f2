"""Semaphores (max_holders) attacked: what broke API.md, one test per bug, over real PostgreSQL and
real HTTP (in process, or `helix-locks serve` processes on real sockets)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from helix_locks import keys
from helix_locks.app import create_app
from tests.support import ROUTE, Watch, in_process
from tests.test_api import acquire, assert_problem, lock_body
from tests.test_events import replicas

pytestmark = pytest.mark.anyio


async def test_a_resumed_stream_gives_a_semaphores_events_in_commit_order(
    db_url: str, tmp_path: Path
) -> None:
    """API.md: "Per (organization_id, job_type) events come in commit order", and a resume
    "replays what came after it from the database". The two slots of a semaphore overlap in time,
    but a window's events are sorted by lock id (migration 0016 assumed a key's locks never
    overlap): the replay gives A acquired, A released, B acquired, B released, although B was
    acquired before A was released, and B released before A."""
    admin = keys.create(db_url, None)
    headers = {"Authorization": f"Bearer {admin}"}
    with replicas(db_url, tmp_path) as [url]:
        async with httpx.AsyncClient(base_url=url, headers=headers) as http:
            async with Watch(url, key=admin, organization_id="acme", job_type="seed") as live:
                await acquire(http, job_type="seed", holder="seed")
                [seed] = await live.until(1, within=10)
            a = await acquire(http, job_type="exports", holder="A", max_holders=2)
            b = await acquire(http, job_type="exports", holder="B", max_holders=2)
            for lock in (b, a):
                released = await http.delete(f"/v1/locks/{lock['id']}", headers={"Lock-Token": lock["token"]})
                assert released.status_code == 204
            async with Watch(
                url, key=admin, last_event_id=seed.id, organization_id="acme", job_type="exports"
            ) as resumed:
                replayed = await resumed.until(4, within=10)
    order = [(e.type, e.data["lock"]["holder"]) for e in replayed[:4]]
    assert order == [("acquired", "A"), ("acquired", "B"), ("released", "B"), ("released", "A")], order


async def test_a_mismatched_max_holders_is_refused_at_once_even_behind_another_waiter(
    client: httpx.AsyncClient,
) -> None:
    """docs/api.md: an acquire naming another max_holders while any is held "gets 409
    max-holders-mismatch at once, even with wait_seconds". Queued behind a waiter of the same key
    in the same process, it waits for that waiter's turn, up to its whole wait_seconds, instead."""
    grants = [await acquire(client, holder=f"w{n}", max_holders=2, ttl_seconds=120) for n in range(2)]
    first = asyncio.create_task(
        client.post("/v1/locks", json=lock_body(holder="waiter", max_holders=2, wait_seconds=30))
    )
    await asyncio.sleep(0.5)
    assert not first.done()
    started = time.monotonic()
    mismatched = await client.post("/v1/locks", json=lock_body(holder="other", max_holders=3, wait_seconds=8))
    took = time.monotonic() - started
    try:
        assert assert_problem(mismatched, 409)["type"].endswith("max-holders-mismatch")
        assert took < 3, f"answered after {took:.1f} s, not at once"
    finally:
        done = await client.delete(f"/v1/locks/{grants[0]['id']}", headers={"Lock-Token": grants[0]["token"]})
        assert done.status_code == 204
        assert (await asyncio.wait_for(first, 20)).status_code == 201


async def test_an_idempotent_repeat_of_a_semaphore_grant_is_answered_at_the_quota(db_url: str) -> None:
    """API.md: a repeat with the same Idempotency-Key while the lock is live "answers exactly as
    the first time (201, the same lock and token)"; docs/api.md: an acquire that can add no live
    lock (a replay) still goes on at the quota. A plain lock's repeat does; a semaphore's, whose
    key has a free slot, is refused 429 quota-exceeded, so the worker whose answer was lost
    cannot learn the token of the lock it holds."""
    app = create_app(ROUTE.settings(db_url, allow_anonymous=True, max_live_locks_per_organization=2))
    async with in_process(app) as client:
        body = lock_body(holder="w1", max_holders=3)
        retry = {"Idempotency-Key": "lost-answer-1"}
        first = await client.post("/v1/locks", json=body, headers=retry)
        assert first.status_code == 201, first.text
        await acquire(client, holder="w2", max_holders=3)  # the organization's quota is reached
        again = await client.post("/v1/locks", json=body, headers=retry)
        assert again.status_code == 201, again.text
        assert again.json()["id"] == first.json()["id"] and again.json()["token"] == first.json()["token"]
        # Once the organization was refused, the process asks the database before each acquire
        # whether it adds a live lock: the repeat still adds none, another acquire of the key does.
        assert_problem(await client.post("/v1/locks", json=lock_body(job_type="other")), 429)
        assert_problem(await client.post("/v1/locks", json=lock_body(holder="w3", max_holders=3)), 429)
        third = await client.post("/v1/locks", json=body, headers=retry)
        assert third.status_code == 201, third.text
        assert third.json()["token"] == first.json()["token"]


async def test_a_waiter_is_woken_when_another_slots_lease_runs_out(client: httpx.AsyncClient) -> None:
    """API.md: a waiter "is granted as soon as the holder releases it or its lease expires", and
    "a lease's own expiry time wakes them too". The waiter sleeps until the lease that ran out
    first when it was refused; the holder of the other slot then renews for 1 s, its lease runs
    out, and nothing wakes the waiter: 409 when its wait ends, with a slot free to reclaim.
    (A plain lock whose holder renews for less after the waiter fell asleep shows it too.)"""
    grants = [await acquire(client, holder=f"w{n}", max_holders=2, ttl_seconds=60 + 30 * n) for n in range(2)]
    waiter = asyncio.create_task(
        client.post("/v1/locks", json=lock_body(holder="waiter", max_holders=2, wait_seconds=10))
    )
    await asyncio.sleep(1)
    assert not waiter.done()
    shortened = await client.post(
        f"/v1/locks/{grants[1]['id']}/renew",
        json={"ttl_seconds": 1},
        headers={"Lock-Token": grants[1]["token"]},
    )
    assert shortened.status_code == 200, shortened.text
    renewed_at = time.monotonic()
    response = await asyncio.wait_for(waiter, 20)
    assert response.status_code == 201, response.text
    granted: dict[str, Any] = response.json()
    assert granted["slot"] == 1 and granted["reclaimed"]["lock_id"] == grants[1]["id"]
    assert time.monotonic() - renewed_at < 4
