"""Shared and exclusive locks over HTTP (issue 40, migrations 0030 and 0031): readers held
together, each with its own lock, token and lease; a writer alone; writers first in the queue; the
mode in every answer; the 422s; the quota; sessions' locks of either mode."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from helix_locks.server.app import create_app
from tests.support import ROUTE, Conn, acquire, assert_problem, expire, in_process, lock_body

pytestmark = pytest.mark.anyio
BOTH_PATHS = True
QUEUE = "/v1/locks/queue?organization_id=acme&job_type=nightly-report"


async def release(client: httpx.AsyncClient, lock: dict[str, Any]) -> None:
    answer = await client.delete(f"/v1/locks/{lock['id']}", headers={"Lock-Token": lock["token"]})
    assert answer.status_code == 204, answer.text


async def queued(client: httpx.AsyncClient, count: int) -> list[dict[str, Any]]:
    """The pair's queue once it has `count` places."""
    deadline = time.monotonic() + 20
    while True:
        items: list[dict[str, Any]] = (await client.get(QUEUE)).json()["items"]
        if len(items) == count:
            return items
        assert time.monotonic() < deadline, f"the queue has {len(items)} places, not {count}"
        await asyncio.sleep(0.02)


async def live(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    page = await client.get("/v1/locks", params={"organization_id": "acme", "job_type": "nightly-report"})
    assert page.status_code == 200, page.text
    items: list[dict[str, Any]] = page.json()["items"]
    return items


async def test_readers_hold_a_pair_together_and_a_writer_holds_it_alone(client: httpx.AsyncClient) -> None:
    readers = [await acquire(client, holder=f"r{n}", mode="shared", ttl_seconds=30 + n) for n in range(3)]
    assert [r["mode"] for r in readers] == ["shared"] * 3
    assert [r["fencing_token"] for r in readers] == [1, 2, 3]
    assert len({r["slot"] for r in readers}) == 3 and {r["max_holders"] for r in readers} == {1}
    assert len({r["token"] for r in readers}) == 3, "each reader has a lock of its own"

    refused = await client.post("/v1/locks", json=lock_body(holder="writer"))
    problem = assert_problem(refused, 409)
    assert problem["type"] == "urn:helix-locks:problem:lock-held"
    assert problem["mode"] == "shared" and problem["holders_total"] == 3
    assert [h["lock_id"] for h in problem["holders"]] == [r["id"] for r in readers]
    assert problem["lock_id"] == readers[0]["id"], "the lease that ends first"

    # /current: of readers alone, the one with the highest token; the lock object says its mode.
    current = await client.get(
        "/v1/locks/current", params={"organization_id": "acme", "job_type": "nightly-report"}
    )
    assert current.json()["id"] == readers[2]["id"] and current.json()["mode"] == "shared"
    got = (await client.get(f"/v1/locks/{readers[1]['id']}")).json()
    assert got["mode"] == "shared" and "token" not in got
    assert {lock["mode"] for lock in await live(client)} == {"shared"}
    renewed = await client.post(
        f"/v1/locks/{readers[1]['id']}/renew",
        json={"ttl_seconds": 60},
        headers={"Lock-Token": readers[1]["token"]},
    )
    assert renewed.status_code == 200 and renewed.json()["mode"] == "shared"
    patched = await client.patch(
        f"/v1/locks/{readers[1]['id']}",
        json={"metadata": {"at": 1}},
        headers={"Lock-Token": readers[1]["token"]},
    )
    assert patched.status_code == 200 and patched.json()["mode"] == "shared"

    for reader in readers:
        await release(client, reader)
    writer = await acquire(client, holder="writer")
    assert writer["mode"] == "exclusive" and writer["fencing_token"] == 4, "above every reader's token"
    shut_out = assert_problem(await client.post("/v1/locks", json=lock_body(holder="r9", mode="shared")), 409)
    assert shut_out["type"].endswith("lock-held") and shut_out["mode"] == "exclusive"
    assert shut_out["lock_id"] == writer["id"]
    await release(client, writer)
    history = await client.get("/v1/locks", params={"organization_id": "acme", "state": "released"})
    assert [lock["mode"] for lock in history.json()["items"]] == ["exclusive", "shared", "shared", "shared"]


async def test_a_readers_lease_is_its_own_and_a_writer_waits_for_the_last_reader(
    client: httpx.AsyncClient, conn: Conn
) -> None:
    first = await acquire(client, holder="r1", mode="shared")
    second = await acquire(client, holder="r2", mode="shared")
    expire(conn, first["id"])  # the first reader stopped renewing: its lease ran out
    got = (await client.get(f"/v1/locks/{second['id']}")).json()
    assert got["state"] == "held", "another reader's lapse does not end this one"
    assert_problem(await client.post("/v1/locks", json=lock_body(holder="writer")), 409)
    waiting = asyncio.create_task(client.post("/v1/locks", json=lock_body(holder="writer", wait_seconds=30)))
    await queued(client, 1)
    assert not waiting.done()
    await release(client, second)
    granted = await asyncio.wait_for(waiting, 30)
    assert granted.status_code == 201, granted.text
    writer = granted.json()
    assert writer["reclaimed"]["lock_id"] == first["id"], "the lapsed reader is reclaimed by the writer"
    assert writer["fencing_token"] > second["fencing_token"]


async def test_writers_first_a_reader_does_not_pass_a_waiting_writer(client: httpx.AsyncClient) -> None:
    reader = await acquire(client, holder="r1", mode="shared")
    writer_task = asyncio.create_task(
        client.post("/v1/locks", json=lock_body(holder="writer", wait_seconds=30))
    )
    await queued(client, 1)
    for _ in range(5):
        late = await client.post("/v1/locks", json=lock_body(holder="r2", mode="shared"))
        problem = assert_problem(late, 409)
        assert problem["type"] == "urn:helix-locks:problem:waiters-ahead", problem
    late_task = asyncio.create_task(
        client.post("/v1/locks", json=lock_body(holder="r2", mode="shared", wait_seconds=30))
    )
    places = await queued(client, 2)
    assert [(p["holder"], p["mode"]) for p in places] == [("writer", "exclusive"), ("r2", "shared")]
    await release(client, reader)
    writer = (await asyncio.wait_for(writer_task, 30)).json()
    assert writer["holder"] == "writer"
    assert not late_task.done(), "the reader waits for the writer it queued behind"
    await release(client, writer)
    late = (await asyncio.wait_for(late_task, 30)).json()
    assert late["mode"] == "shared" and late["fencing_token"] > writer["fencing_token"]


async def test_readers_queued_together_are_granted_together_when_the_writer_is_done(
    client: httpx.AsyncClient,
) -> None:
    writer = await acquire(client, holder="writer")
    tasks = []
    for n in range(4):
        tasks.append(
            asyncio.create_task(
                client.post("/v1/locks", json=lock_body(holder=f"r{n}", mode="shared", wait_seconds=30))
            )
        )
        await queued(client, n + 1)
    await release(client, writer)
    answers = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert [a.status_code for a in answers] == [201] * 4
    readers = [a.json() for a in answers]
    assert [r["holder"] for r in readers] == ["r0", "r1", "r2", "r3"]
    held = await live(client)
    assert sorted(lock["id"] for lock in held) == sorted(r["id"] for r in readers), "all four at once"
    assert {lock["state"] for lock in held} == {"held"}


async def test_a_shared_lock_has_one_holder_per_lock_and_meets_a_semaphore_as_a_mismatch(
    client: httpx.AsyncClient,
) -> None:
    for body in (lock_body(mode="shared", max_holders=3), lock_body(mode="read"), lock_body(mode=1)):
        problem = assert_problem(await client.post("/v1/locks", json=body), 422)
        assert problem["errors"][0]["field"] == "mode", problem
    sessions = await client.post(
        "/v1/sessions",
        json={
            "organization_id": "acme",
            "holder": "s",
            "ttl_seconds": 30,
            "locks": [{"job_type": "a", "mode": "shared", "max_holders": 2}],
        },
    )
    assert assert_problem(sessions, 422)["errors"][0]["field"].endswith("mode")
    await acquire(client, holder="s1", max_holders=3)
    mismatch = assert_problem(await client.post("/v1/locks", json=lock_body(holder="r", mode="shared")), 409)
    assert mismatch["type"].endswith("max-holders-mismatch") and mismatch["max_holders"] == 3


async def test_a_repeat_that_names_another_mode_is_refused_not_answered_with_the_other_lock(
    client: httpx.AsyncClient,
) -> None:
    headers = {"Idempotency-Key": "run-1"}
    first = await client.post("/v1/locks", json=lock_body(mode="shared"), headers=headers)
    assert first.status_code == 201
    again = await client.post("/v1/locks", json=lock_body(mode="shared"), headers=headers)
    assert again.status_code == 201 and again.json()["id"] == first.json()["id"]
    other = await client.post("/v1/locks", json=lock_body(), headers=headers)
    assert assert_problem(other, 422)["errors"][0]["field"] == "mode"
    assert [lock["id"] for lock in await live(client)] == [first.json()["id"]], "nothing else granted"


async def test_readers_count_against_the_quota(db_url: str) -> None:
    """Near the quota, a reader beside readers adds a live lock: before migration 0031 the count
    took a held pair for a full one and let it through."""
    app = create_app(ROUTE.settings(db_url, allow_anonymous=True, max_live_locks_per_organization=3))
    async with in_process(app) as client:
        for n in range(3):
            await acquire(client, holder=f"r{n}", mode="shared")
        for _ in range(3):
            over = await client.post("/v1/locks", json=lock_body(holder="r9", mode="shared"))
            assert assert_problem(over, 429)["type"].endswith("quota-exceeded")
        assert len(await live(client)) == 3


async def test_a_sessions_locks_take_a_mode_each(client: httpx.AsyncClient) -> None:
    def opening(holder: str, mode: str) -> dict[str, Any]:
        return {
            "organization_id": "acme",
            "holder": holder,
            "ttl_seconds": 30,
            "locks": [{"job_type": "dataset", "mode": mode}, {"job_type": "log"}],
        }

    first = await client.post("/v1/sessions", json=opening("s1", "shared"))
    assert first.status_code == 201, first.text
    assert [(lock["job_type"], lock["mode"]) for lock in first.json()["locks"]] == [
        ("dataset", "shared"),
        ("log", "exclusive"),
    ]
    reader = await acquire(client, job_type="dataset", holder="r", mode="shared")
    assert reader["mode"] == "shared"
    writer = await client.post(
        "/v1/sessions", json=opening("s2", "exclusive") | {"locks": [{"job_type": "dataset"}]}
    )
    problem = assert_problem(writer, 409)
    assert problem["mode"] == "shared" and problem["job_type"] == "dataset" and problem["holders_total"] == 2
    session = first.json()
    got = (await client.get(f"/v1/sessions/{session['id']}")).json()
    assert [lock["mode"] for lock in got["locks"]] == ["shared", "exclusive"]
    added = await client.post(
        f"/v1/sessions/{session['id']}/locks",
        json={"locks": [{"job_type": "index", "mode": "shared"}]},
        headers={"Lock-Token": session["token"]},
    )
    assert added.status_code == 201 and added.json()["locks"][0]["mode"] == "shared"


async def test_dead_readers_do_not_hold_the_quota_once_another_reader_comes(db_url: str, conn: Conn) -> None:
    """An adversary's finding (fixed by migration 0032): readers that stopped renewing stayed live
    locks against the quota until a writer came, and the organization got 429 for every key."""
    app = create_app(ROUTE.settings(db_url, allow_anonymous=True, max_live_locks_per_organization=3))
    async with in_process(app) as client:
        dead = [await acquire(client, holder=f"r{n}", mode="shared") for n in range(3)]
        assert_problem(await client.post("/v1/locks", json=lock_body(job_type="other")), 429)
        for reader in dead:
            expire(conn, reader["id"])
        fresh = await acquire(client, holder="fresh", mode="shared")
        assert fresh["reclaimed"]["lock_id"] in {r["id"] for r in dead}
        assert [lock["id"] for lock in await live(client)] == [fresh["id"]], "every dead reader reclaimed"
        # The quota remembers its last refusal a tenth of a second (guarantees.md): asked again
        # until then, the room the reclaims freed is granted.
        deadline = time.monotonic() + 10
        while (other := await client.post("/v1/locks", json=lock_body(job_type="other"))).status_code == 429:
            assert time.monotonic() < deadline, other.text
            await asyncio.sleep(0.05)
        assert other.status_code == 201, other.text
