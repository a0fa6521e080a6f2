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
