"""Semaphores (max_holders) attacked, and then their fixes: what broke API.md, one test per bug,
over real PostgreSQL and real HTTP (in process, or `helix-locks serve` processes on real sockets)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from harness.watch import Watch
from helix_locks.server import keys
from helix_locks.server.app import create_app
from tests.support import ROUTE, acquire, assert_problem, in_process, live_locks, lock_body, replicas

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
        assert took < 6, f"answered after {took:.1f} s, not at once (it may wait 8 s)"
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
    assert time.monotonic() - renewed_at < 10, "woken as the shortened lease ran out, not at its wait's end"


async def test_a_repeat_whose_lock_runs_out_as_it_is_claimed_is_not_a_new_grant_past_the_quota(
    db_url: str,
) -> None:
    """docs/api.md: an acquire "that would give an organization more than its quota of live locks
    (held, or lapsed and not yet reclaimed) gets 429"; with up to four processes "an organization
    never goes over its quota". Migration 0018 lets a repeat (same Idempotency-Key and holder, its
    lock live) through the quota's check, but the check and the repeat's claim read the clock
    apart: a lock that runs out between them (here: its holder's PATCH commits just then, which
    the claim waits for) makes the "repeat" a NEW grant in a free slot, while the lapsed lock
    stays unreleased: 3 live locks with a quota of 2. It must be the replay, or 429 (migration 0018
    refuses such a new grant after it, rolling it back)."""
    app = create_app(ROUTE.settings(db_url, allow_anonymous=True, max_live_locks_per_organization=2))
    async with in_process(app) as client:
        body = lock_body(holder="w1", max_holders=3, ttl_seconds=2)
        retry = {"Idempotency-Key": "lost-answer-1"}
        first = await client.post("/v1/locks", json=body, headers=retry)
        assert first.status_code == 201, first.text
        lock: dict[str, Any] = first.json()
        await acquire(client, job_type="other", holder="w2")  # the organization's quota is reached
        assert live_locks(db_url, "acme") == 2
        with psycopg.connect(db_url) as patching:
            # The holder's PATCH of its metadata, in flight while the lease runs out.
            patching.execute(
                "SELECT id FROM helix_update_job_lock(%s, %s, %s::jsonb, %s)",
                (lock["id"], lock["token"], '{"done": 1}', "acme"),
            )
            repeat = asyncio.create_task(client.post("/v1/locks", json=body, headers=retry))
            await asyncio.sleep(lock["ttl_remaining_ms"] / 1000 + 0.3)
            assert not repeat.done()
            patching.commit()
        again = await asyncio.wait_for(repeat, 10)
        live = live_locks(db_url, "acme")
        assert live <= 2, f"{live} live locks with a quota of 2; the repeat was answered {again.text}"
        assert again.status_code in (201, 429), again.text
        if again.status_code == 201:
            assert again.json()["id"] == lock["id"], f"a new grant, not the replay: {again.text}"


async def test_a_repeat_waiting_for_another_acquire_is_not_answered_with_a_lease_that_ran_out(
    client: httpx.AsyncClient, db_url: str
) -> None:
    """docs/api.md: a repeat with the same Idempotency-Key answers the first grant "while the lock
    it got is live (not ended, lease not run out)"; "once the first lease has run out, a repeat is
    a new grant". The repeat's claim (helix_claim_replay, which 0018's quota relies on) tests the
    lease, then waits for the row lock of another worker's acquire of the key in flight, and
    claimed the lock after it ran out meanwhile: 201 with state "expired" and no lease left. It now
    waits for the pair's counter row first, then tests the lease (migration 0018)."""
    body = lock_body(holder="w1", max_holders=2, ttl_seconds=2)
    retry = {"Idempotency-Key": "lost-answer-2"}
    first = await client.post("/v1/locks", json=body, headers=retry)
    assert first.status_code == 201, first.text
    lock: dict[str, Any] = first.json()
    with psycopg.connect(db_url) as other:
        # Another worker's acquire of the key's other slot, its commit in flight.
        other.execute(
            "SELECT id FROM helix_acquire_job_lock('acme', 'nightly-report', 'w2', 60000, NULL, NULL, 2)"
        )
        repeat = asyncio.create_task(client.post("/v1/locks", json=body, headers=retry))
        await asyncio.sleep(lock["ttl_remaining_ms"] / 1000 + 0.3)
        assert not repeat.done()
        other.commit()
    again = await asyncio.wait_for(repeat, 10)
    assert again.status_code in (201, 409), again.text
    if again.status_code == 201:
        granted = again.json()
        assert granted["state"] == "held" and granted["ttl_remaining_ms"] > 0, again.text
