"""Fair waiting over HTTP (migration 0029): waiters are granted in the order of their places, an
acquire that does not wait gets `409 waiters-ahead` while any waits, and GET /v1/locks/queue lists
the places in order, paged, within the caller's organization."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from helix_locks.server import keys
from tests.support import assert_problem, lock_body

pytestmark = pytest.mark.anyio
QUEUE = "/v1/locks/queue?organization_id=acme&job_type=nightly-report"
KEY = {"organization_id": "acme", "job_type": "nightly-report"}


async def grant(client: httpx.AsyncClient, holder: str, **more: Any) -> dict[str, Any]:
    answer = await client.post("/v1/locks", json=lock_body(holder=holder, **more))
    assert answer.status_code == 201, answer.text
    lock: dict[str, Any] = answer.json()
    return lock


async def release(client: httpx.AsyncClient, lock: dict[str, Any]) -> None:
    answer = await client.delete(f"/v1/locks/{lock['id']}", headers={"Lock-Token": lock["token"]})
    assert answer.status_code == 204, answer.text


async def queued(client: httpx.AsyncClient, count: int, **headers: str) -> list[dict[str, Any]]:
    """The queue's places once it has `count` (the waiters' places taken, and live)."""
    deadline = time.monotonic() + 20
    while True:
        answer = await client.get(f"{QUEUE}&limit=500", headers=headers)
        assert answer.status_code == 200, answer.text
        items: list[dict[str, Any]] = answer.json()["items"]
        if len(items) == count:
            return items
        assert time.monotonic() < deadline, f"the queue has {len(items)} places, not {count}"
        await asyncio.sleep(0.02)


async def test_waiters_are_granted_in_the_order_of_their_places_and_nobody_passes_them(
    client: httpx.AsyncClient,
) -> None:
    holder = await grant(client, "holder")
    granted: list[dict[str, Any]] = []

    async def wait(n: int) -> None:
        lock = await grant(client, f"w{n}", wait_seconds=30)
        granted.append(lock)
        await release(client, lock)

    waiters = []
    for n in range(5):
        waiters.append(asyncio.create_task(wait(n)))
        await queued(client, n + 1)  # the one before has its place: the order they came in is known
    places = await queued(client, 5)
    assert [p["holder"] for p in places] == [f"w{n}" for n in range(5)], "first come, first placed"
    assert [p["position"] for p in places] == [1, 2, 3, 4, 5]

    for _ in range(20):
        refused = await client.post("/v1/locks", json=lock_body(holder="jumper"))
        problem = assert_problem(refused, 409)
        assert problem["type"] == "urn:helix-locks:problem:waiters-ahead", problem
        assert problem["waiting"] == 5 and refused.headers["retry-after"] == "1"
    await release(client, holder)
    await asyncio.wait_for(asyncio.gather(*waiters), 30)
    assert [lock["holder"] for lock in granted] == [f"w{n}" for n in range(5)]
    tokens = [lock["fencing_token"] for lock in granted]
    assert tokens == sorted(tokens) and tokens[0] == holder["fencing_token"] + 1, tokens
    assert (await client.get(QUEUE)).json() == {"items": [], "next_cursor": None}
    assert (await client.post("/v1/locks", json=lock_body(holder="after"))).status_code == 201


async def test_the_queue_is_paged_and_read_only_within_the_callers_organization(
    client: httpx.AsyncClient, db_url: str
) -> None:
    globex = {"Authorization": f"Bearer {keys.create(db_url, 'globex')}"}
    client.headers["Authorization"] = f"Bearer {keys.create(db_url, 'acme')}"
    deadline = time.monotonic() + 10
    while (await client.get(QUEUE, headers=globex)).status_code == 401:  # the keys' NOTIFY
        assert time.monotonic() < deadline, "the new keys never reached the service"
        await asyncio.sleep(0.01)
    holder = await grant(client, "holder")

    async def wait(n: int) -> None:
        await release(client, await grant(client, f"w{n}", wait_seconds=30))

    waiters = []
    for n in range(5):
        waiters.append(asyncio.create_task(wait(n)))
        await queued(client, n + 1)
    everything = await queued(client, 5)
    first = everything[0]
    assert first["mode"] == "exclusive" and first["max_holders"] == 1
    assert first["waiting_since"].endswith("Z") and first["wait_until"] > first["waiting_since"]

    seen: list[dict[str, Any]] = []
    cursor = None
    while True:
        params = KEY | {"limit": "2"} | ({"cursor": cursor} if cursor else {})
        page = (await client.get("/v1/locks/queue", params=params)).json()
        assert len(page["items"]) <= 2
        seen += page["items"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == everything
    assert_problem(await client.get(f"{QUEUE}&cursor=bm90LWEtY3Vyc29y"), 422)
    assert_problem(await client.get("/v1/locks/queue?organization_id=acme"), 422)

    answer = await client.get(QUEUE, headers=globex)
    assert answer.status_code == 200 and answer.json() == {"items": [], "next_cursor": None}, (
        "another organization's queue is not seen"
    )

    await release(client, holder)
    await asyncio.wait_for(asyncio.gather(*waiters), 30)


async def test_a_wait_that_runs_out_leaves_the_queue_and_the_next_keeps_its_place(
    client: httpx.AsyncClient,
) -> None:
    holder = await grant(client, "holder")
    short = asyncio.create_task(client.post("/v1/locks", json=lock_body(holder="short", wait_seconds=0.5)))
    await queued(client, 1)
    long = asyncio.create_task(client.post("/v1/locks", json=lock_body(holder="long", wait_seconds=30)))
    assert [p["holder"] for p in await queued(client, 2)] == ["short", "long"]
    assert_problem(await short, 409)
    assert [(p["holder"], p["position"]) for p in await queued(client, 1)] == [("long", 1)]
    await release(client, holder)
    answer = await asyncio.wait_for(long, 10)
    assert answer.status_code == 201 and answer.json()["holder"] == "long"


async def test_a_retry_with_the_same_idempotency_key_keeps_its_place(client: httpx.AsyncClient) -> None:
    """A worker whose wait goes in rounds (the SDKs' waits longer than 60 s do) asks again with the
    same Idempotency-Key when a round runs out: it keeps its place ahead of those who came after."""
    holder = await grant(client, "holder")
    round_one = asyncio.create_task(
        client.post(
            "/v1/locks", json=lock_body(holder="patient", wait_seconds=1), headers={"Idempotency-Key": "k"}
        )
    )
    await queued(client, 1)
    later = asyncio.create_task(client.post("/v1/locks", json=lock_body(holder="later", wait_seconds=30)))
    assert [p["holder"] for p in await queued(client, 2)] == ["patient", "later"]
    assert_problem(await round_one, 409)
    round_two = asyncio.create_task(
        client.post(
            "/v1/locks", json=lock_body(holder="patient", wait_seconds=30), headers={"Idempotency-Key": "k"}
        )
    )
    await asyncio.sleep(0.2)
    assert [p["holder"] for p in await queued(client, 2)] == ["patient", "later"], "its place, not a new one"
    await release(client, holder)
    first = await asyncio.wait_for(round_two, 10)
    assert first.status_code == 201 and first.json()["holder"] == "patient"
    assert not later.done()
    await release(client, first.json())
    second = await asyncio.wait_for(later, 10)
    assert second.status_code == 201 and second.json()["fencing_token"] == first.json()["fencing_token"] + 1
