"""Fair waiting over HTTP (migration 0029): waiters are granted in the order of their places, an
acquire that does not wait gets `409 waiters-ahead` while any waits, and GET /v1/locks/queue lists
the places in order, paged, within the caller's organization."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import psycopg
import pytest

from harness.proxies import TcpProxy
from helix_locks.server import keys
from helix_locks.server.app import create_app
from helix_locks.server.settings import Settings
from tests.support import assert_problem, in_process, lock_body

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
        assert problem["waiting"] == 5
        # The key is held: the holder's lease is named, and Retry-After counts down to its end.
        assert (problem["lock_id"], problem["holder"]) == (holder["id"], "holder")
        assert int(refused.headers["retry-after"]) > 1
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


async def test_sessions_take_one_turn_in_each_of_their_queues_and_are_granted_in_order(
    client: httpx.AsyncClient,
) -> None:
    """Two sessions wanting {A, B} and {B, C}, then a plain waiter on B, queued in that order, are
    granted in that order; a pair a session heads is kept for it while it waits for its others."""

    def places(job_type: str) -> str:
        return f"/v1/locks/queue?organization_id=acme&job_type={job_type}"

    async def queue_of(job_type: str, count: int) -> list[str]:
        deadline = time.monotonic() + 20
        while len(items := (await client.get(places(job_type))).json()["items"]) != count:
            assert time.monotonic() < deadline, f"{job_type}'s queue has {len(items)}, not {count}"
            await asyncio.sleep(0.02)
        return [item["holder"] for item in items]

    def session(holder: str, *job_types: str) -> dict[str, Any]:
        return {
            "organization_id": "acme",
            "holder": holder,
            "ttl_seconds": 30,
            "wait_seconds": 30,
            "locks": [{"job_type": job_type} for job_type in job_types],
        }

    held = {job_type: await grant(client, "holder", job_type=job_type) for job_type in ("a", "b", "c")}
    first = asyncio.create_task(client.post("/v1/sessions", json=session("s1", "a", "b")))
    await queue_of("a", 1)
    second = asyncio.create_task(client.post("/v1/sessions", json=session("s2", "b", "c")))
    await queue_of("c", 1)
    plain = asyncio.create_task(
        client.post("/v1/locks", json=lock_body(holder="w", job_type="b", wait_seconds=30))
    )
    assert await queue_of("b", 3) == ["s1", "s2", "w"]

    await release(client, held["c"])  # s2 heads c, not b: c is kept for it
    kept = await client.post("/v1/locks", json=lock_body(holder="passer-by", job_type="c"))
    assert assert_problem(kept, 409)["type"].endswith("waiters-ahead")
    await release(client, held["a"])  # s1 heads a, but b is held
    await asyncio.sleep(0.2)
    assert not (first.done() or second.done() or plain.done())
    await release(client, held["b"])  # s1 heads a and b
    one = (await asyncio.wait_for(first, 10)).json()
    assert [lock["job_type"] for lock in one["locks"]] == ["a", "b"]
    assert not second.done() and not plain.done(), "s2 and w come after s1"
    ended = await client.delete(f"/v1/sessions/{one['id']}", headers={"Lock-Token": one["token"]})
    assert ended.status_code == 204
    two = (await asyncio.wait_for(second, 10)).json()
    assert [lock["job_type"] for lock in two["locks"]] == ["b", "c"]
    assert not plain.done(), "w comes after s2"
    ended = await client.delete(f"/v1/sessions/{two['id']}", headers={"Lock-Token": two["token"]})
    assert ended.status_code == 204
    last = (await asyncio.wait_for(plain, 10)).json()
    tokens = [one["locks"][1]["fencing_token"], two["locks"][0]["fencing_token"], last["fencing_token"]]
    assert tokens == [held["b"]["fencing_token"] + n for n in (1, 2, 3)], tokens


async def test_a_place_its_request_could_not_leave_is_left_once_the_database_is_back(db_url: str) -> None:
    """The waiter's request ends while the pool cannot reach the database, so its place could not
    be deleted then; the process's listener (direct) stays, so the place would count as live until
    its wait ran out. It is left again as soon as the database answers."""
    proxy = TcpProxy(db_url)
    await proxy.start()
    settings = Settings(
        database_url=proxy.url(db_url),
        direct_database_url=db_url,
        pool_timeout_seconds=1.0,
        statement_timeout_ms=500,
        allow_anonymous=True,
    )
    with psycopg.connect(db_url, autocommit=True) as conn:
        held = conn.execute(
            "SELECT id, token FROM helix_acquire_job_lock("
            "'acme', 'nightly-report', 'holder', 60000, NULL, NULL)"
        ).fetchone()
        assert held is not None
        async with in_process(create_app(settings)) as client:
            waiter = asyncio.create_task(
                client.post("/v1/locks", json=lock_body(holder="w", wait_seconds=30))
            )
            await queued(client, 1)
            # The place's row locked meanwhile as well: twice in landing runs under load the place
            # was gone by the 503, through a path to the database that the cut had not closed (not
            # found); a leave (or any delete) would now wait for this lock and time out instead.
            with psycopg.connect(db_url) as blocker:
                blocker.execute("SELECT FROM helix_lock_waiters FOR UPDATE")
                await proxy.cut()  # the pool's connections are gone; the listener's are not
                conn.execute("SELECT helix_release_job_lock(%s, %s, NULL)", held)  # wakes the waiter
                assert_problem(await asyncio.wait_for(waiter, 10), 503)
                count = conn.execute("SELECT count(*) FROM helix_lock_waiters").fetchone()
                assert count == (1,), "not left yet"
                blocker.rollback()
            restored = TcpProxy(db_url)
            restored.port = proxy.port
            await restored.start()
            try:
                deadline = time.monotonic() + 10
                while conn.execute("SELECT count(*) FROM helix_lock_waiters").fetchone() != (0,):
                    assert time.monotonic() < deadline, "the place was never left"
                    await asyncio.sleep(0.05)
                # The pool refills its other connections with its own backoff: a request may still
                # find none for a while (503), but one is granted before the deadline.
                while (await client.post("/v1/locks", json=lock_body(holder="after"))).status_code != 201:
                    assert time.monotonic() < deadline + 20, "the service never granted again"
                    await asyncio.sleep(0.2)
            finally:
                await restored.cut()
