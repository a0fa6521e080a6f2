"""Semaphores over HTTP (max_holders): slots, the full pair's 409, max-holders-mismatch, waiting,
replays, listings, /current, the quota, the metrics, and a rolling upgrade from the build before."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg.rows import dict_row

from harness.watch import Watch
from helix_locks.server import keys, migrate, queries
from helix_locks.server.app import create_app
from tests.support import (
    ROUTE,
    Conn,
    acquire,
    assert_problem,
    expire,
    in_process,
    lock_body,
    replicas,
    samples,
    value,
)

pytestmark = pytest.mark.anyio
# Every test of `client` runs on the thin path of acquire, release and renew and on FastAPI's
# routes (conftest.py): the two must answer alike.
BOTH_PATHS = True


async def test_a_semaphore_grants_one_lock_per_slot_then_409_names_every_holder(
    client: httpx.AsyncClient,
) -> None:
    grants = [await acquire(client, holder=f"w{n}", max_holders=3, ttl_seconds=30 + n) for n in range(3)]
    assert [g["slot"] for g in grants] == [0, 1, 2]
    assert [g["fencing_token"] for g in grants] == [1, 2, 3]
    assert {g["max_holders"] for g in grants} == {3}
    assert len({g["token"] for g in grants}) == 3

    response = await client.post("/v1/locks", json=lock_body(holder="w3", max_holders=3))
    problem = assert_problem(response, 409)
    assert problem["type"] == "urn:helix-locks:problem:lock-held"
    assert problem["max_holders"] == 3
    assert [(h["lock_id"], h["holder"], h["slot"]) for h in problem["holders"]] == [
        (g["id"], g["holder"], g["slot"]) for g in grants
    ]
    assert [h["expires_at"] for h in problem["holders"]] == [g["expires_at"] for g in grants]
    # The one named, and counted down to by Retry-After, is the first to expire.
    assert problem["lock_id"] == grants[0]["id"] and problem["expires_at"] == grants[0]["expires_at"]
    assert 29 <= int(response.headers["retry-after"]) <= 30

    # A plain lock's 409 lists its one holder too.
    plain = await acquire(client, job_type="plain")
    problem = assert_problem(await client.post("/v1/locks", json=lock_body(job_type="plain")), 409)
    assert problem["holders"] == [
        {"lock_id": plain["id"], "holder": "w1", "slot": 0, "expires_at": plain["expires_at"]}
    ]
    assert problem["max_holders"] == 1


async def test_a_full_semaphores_409_lists_the_20_holders_expiring_first_and_counts_them_all(
    client: httpx.AsyncClient,
) -> None:
    """Issue 34, item 11: the 409 of a full semaphore listed every holder, by slot, so that an
    acquire of about a hundred bytes drew about 1 KB per slot held. It lists the 20 whose leases
    run out first, in that order, and counts them all; so does the 409 after a wait runs out."""
    slots = 45
    # Slot n's lease is 60 + (7 n mod 45) s: leases run out in another order than the slots.
    ttls = [60 + (7 * n) % slots for n in range(slots)]
    grants = [
        await acquire(client, holder=f"w{n}", max_holders=slots, ttl_seconds=ttl)
        for n, ttl in enumerate(ttls)
    ]
    first = sorted(grants, key=lambda grant: (grant["expires_at"], grant["slot"]))[:20]
    assert [grant["slot"] for grant in first] != list(range(20))
    for wait in (0, 0.2):
        response = await client.post(
            "/v1/locks", json=lock_body(holder="late", max_holders=slots, wait_seconds=wait)
        )
        problem = assert_problem(response, 409)
        assert problem["holders"] == [
            {key: grant[key] for key in ("holder", "slot", "expires_at")} | {"lock_id": grant["id"]}
            for grant in first
        ]
        assert problem["holders_total"] == slots and problem["max_holders"] == slots
        assert (problem["lock_id"], problem["expires_at"]) == (first[0]["id"], first[0]["expires_at"])
        assert 50 <= int(response.headers["retry-after"]) <= 60
        assert len(response.content) < 3000, len(response.content)

    # A plain lock's 409 lists its one holder, and counts it.
    plain = await acquire(client, job_type="plain")
    problem = assert_problem(await client.post("/v1/locks", json=lock_body(job_type="plain")), 409)
    assert [holder["lock_id"] for holder in problem["holders"]] == [plain["id"]]
    assert problem["holders_total"] == 1


async def test_a_released_slot_is_taken_before_an_expired_one_is_reclaimed(
    client: httpx.AsyncClient, conn: Conn
) -> None:
    grants = [await acquire(client, holder=f"w{n}", max_holders=3) for n in range(3)]
    expire(conn, grants[0]["id"])
    released = await client.delete(f"/v1/locks/{grants[1]['id']}", headers={"Lock-Token": grants[1]["token"]})
    assert released.status_code == 204
    free = await acquire(client, holder="next", max_holders=3)
    assert free["slot"] == 1 and free["reclaimed"] is None
    # Every slot taken again: the expired lock is reclaimed, and its slot reused.
    reclaiming = await acquire(client, holder="after", max_holders=3)
    assert reclaiming["slot"] == 0
    assert reclaiming["reclaimed"]["lock_id"] == grants[0]["id"]
    old = (await client.get(f"/v1/locks/{grants[0]['id']}")).json()
    assert old["state"] == "reclaimed" and old["released_at"] == reclaiming["acquired_at"]
    assert reclaiming["fencing_token"] == 5


async def test_another_max_holders_while_held_is_409_mismatch_and_starts_afresh_once_none_is(
    client: httpx.AsyncClient, conn: Conn
) -> None:
    first = await acquire(client, holder="a", max_holders=3)
    second = await acquire(client, holder="b", max_holders=3)
    for other in (1, 2, 5):
        response = await client.post("/v1/locks", json=lock_body(holder="c", max_holders=other))
        problem = assert_problem(response, 409)
        assert problem["type"] == "urn:helix-locks:problem:max-holders-mismatch"
        assert problem["max_holders"] == 3
        assert "retry-after" not in response.headers
    # A wait does not help a mismatch: it is answered at once.
    started = time.monotonic()
    waited = await client.post("/v1/locks", json=lock_body(holder="c", max_holders=2, wait_seconds=10))
    assert assert_problem(waited, 409)["type"].endswith("max-holders-mismatch")
    assert time.monotonic() - started < 5

    expire(conn, first["id"])
    expire(conn, second["id"])
    conn.execute(
        "UPDATE helix_job_locks SET expires_at = expires_at - interval '1 second' WHERE id = %s",
        (second["id"],),
    )
    fresh = await acquire(client, holder="c", max_holders=2)
    assert fresh["max_holders"] == 2 and fresh["slot"] == 0
    assert fresh["reclaimed"]["lock_id"] == second["id"]  # the one that expired first
    for old in (first, second):
        assert (await client.get(f"/v1/locks/{old['id']}")).json()["state"] == "reclaimed"
    assert (await acquire(client, holder="d", max_holders=2))["slot"] == 1


async def test_a_waiter_on_a_full_semaphore_is_woken_by_any_slots_release(client: httpx.AsyncClient) -> None:
    grants = [await acquire(client, holder=f"w{n}", max_holders=2, ttl_seconds=120) for n in range(2)]
    waiter = asyncio.create_task(
        client.post("/v1/locks", json=lock_body(holder="waiter", max_holders=2, wait_seconds=30))
    )
    await asyncio.sleep(0.5)
    assert not waiter.done()
    released_at = time.monotonic()
    headers = {"Lock-Token": grants[1]["token"]}
    assert (await client.delete(f"/v1/locks/{grants[1]['id']}", headers=headers)).status_code == 204
    response = await asyncio.wait_for(waiter, 20)
    assert response.status_code == 201, response.text
    assert response.json()["slot"] == 1 and response.json()["reclaimed"] is None
    # Woken by the release, not by a lease (120 s) or the wait (30 s) running out.
    assert time.monotonic() - released_at < 10


async def test_an_idempotency_key_replays_the_grant_of_its_own_slot(client: httpx.AsyncClient) -> None:
    other = await acquire(client, holder="w0", max_holders=3)
    headers = {"Idempotency-Key": "retry-1"}
    body = lock_body(holder="w1", max_holders=3)
    first = await client.post("/v1/locks", json=body, headers=headers)
    again = await client.post("/v1/locks", json=body, headers=headers)
    assert first.status_code == again.status_code == 201
    assert again.json() == {**first.json(), "ttl_remaining_ms": again.json()["ttl_remaining_ms"]}
    assert first.json()["slot"] == 1 and other["slot"] == 0
    fresh = await client.post("/v1/locks", json=body, headers={"Idempotency-Key": "retry-2"})
    assert fresh.json()["slot"] == 2


async def test_a_listing_pages_through_every_slot_once(client: httpx.AsyncClient) -> None:
    grants = [await acquire(client, holder=f"w{n}", max_holders=5) for n in range(5)]
    seen: list[int] = []
    cursor = None
    while True:
        params: dict[str, str | int] = {"organization_id": "acme", "limit": 2}
        if cursor:
            params["cursor"] = cursor
        page = (await client.get("/v1/locks", params=params)).json()
        seen += [lock["slot"] for lock in page["items"]]
        assert all(lock["max_holders"] == 5 for lock in page["items"])
        if (cursor := page["next_cursor"]) is None:
            break
    assert seen == [0, 1, 2, 3, 4] and len(grants) == 5
    # A cursor of the build before semaphores named a key only: it goes on after all its slots.
    older = json.dumps({"s": None, "k": ["acme", "nightly-report"]}, separators=(",", ":")).encode()
    after = base64.urlsafe_b64encode(older).decode().rstrip("=")
    page = (await client.get("/v1/locks", params={"cursor": after})).json()
    assert page["items"] == []
    for bad in (["acme", "nightly-report", "1"], ["acme", "nightly-report", 1000], ["a", "b", 1, 2]):
        raw = json.dumps({"s": None, "k": bad}).encode()
        response = await client.get("/v1/locks", params={"cursor": base64.urlsafe_b64encode(raw).decode()})
        assert_problem(response, 422)


async def test_current_answers_the_highest_token_or_one_slot(client: httpx.AsyncClient, conn: Conn) -> None:
    grants = [await acquire(client, holder=f"w{n}", max_holders=3) for n in range(3)]
    key = {"organization_id": "acme", "job_type": "nightly-report"}
    newest = (await client.get("/v1/locks/current", params=key)).json()
    assert newest["id"] == grants[2]["id"]
    for grant in grants:
        one = (await client.get("/v1/locks/current", params={**key, "slot": grant["slot"]})).json()
        assert one["id"] == grant["id"] and one["slot"] == grant["slot"]
    expire(conn, grants[2]["id"])  # a lapsed lease is not held
    assert (await client.get("/v1/locks/current", params=key)).json()["id"] == grants[1]["id"]
    assert_problem(await client.get("/v1/locks/current", params={**key, "slot": 2}), 404)
    for bad in ("-1", "1000", "x", "1.5"):
        assert_problem(await client.get("/v1/locks/current", params={**key, "slot": bad}), 422)


@pytest.mark.parametrize("value", ["3", 0, 1001, True, 2.5, None, -1])
async def test_max_holders_must_be_a_json_integer_from_1_to_1000(
    client: httpx.AsyncClient, value: Any
) -> None:
    body = {**lock_body(), "max_holders": value}
    problem = assert_problem(await client.post("/v1/locks", json=body), 422)
    assert [error["field"] for error in problem["errors"]] == ["max_holders"]


async def test_the_quota_counts_each_slot_and_lets_a_full_pair_go_on(db_url: str, conn: Conn) -> None:
    app = create_app(ROUTE.settings(db_url, allow_anonymous=True, max_live_locks_per_organization=2))
    async with in_process(app) as client:
        grants = [await acquire(client, holder=f"w{n}", max_holders=2) for n in range(2)]
        other_pair = await client.post("/v1/locks", json=lock_body(job_type="other"))
        assert assert_problem(other_pair, 429)["type"].endswith("quota-exceeded")
        # At the quota, an acquire that can add no live lock goes on: every slot held (409), held
        # with another max_holders (409), or every slot taken and one expired (reclaimed).
        for attempt in range(2):  # the second right after a refusal, which the quota remembers
            full = await client.post("/v1/locks", json=lock_body(holder="w2", max_holders=2))
            assert assert_problem(full, 409)["type"].endswith("lock-held"), attempt
            mismatch = await client.post("/v1/locks", json=lock_body(holder="w2", max_holders=3))
            assert assert_problem(mismatch, 409)["type"].endswith("max-holders-mismatch"), attempt
            assert (await client.post("/v1/locks", json=lock_body(job_type="other"))).status_code == 429
        expire(conn, grants[0]["id"])
        reclaiming = await acquire(client, holder="w2", max_holders=2)
        assert reclaiming["reclaimed"]["lock_id"] == grants[0]["id"] and reclaiming["slot"] == 0
        # A semaphore of more slots adds one with each grant: refused at the quota.
        more = await client.post("/v1/locks", json=lock_body(job_type="wide", max_holders=5))
        assert more.status_code == 429
    live = conn.execute("SELECT count(*) FROM helix_job_locks WHERE released_at IS NULL").fetchone()
    assert live == (2,)


async def test_a_full_semaphore_is_counted_apart_from_a_conflict(db_url: str) -> None:
    admin = keys.create(db_url, None)
    app = create_app(ROUTE.settings(db_url))
    async with in_process(app, headers={"Authorization": f"Bearer {admin}"}) as client:
        await acquire(client, max_holders=2)
        await acquire(client, max_holders=2)
        await acquire(client, job_type="plain")
        assert (await client.post("/v1/locks", json=lock_body(max_holders=2))).status_code == 409
        assert (await client.post("/v1/locks", json=lock_body(max_holders=2))).status_code == 409
        assert (await client.post("/v1/locks", json=lock_body(job_type="plain"))).status_code == 409
        assert (await client.post("/v1/locks", json=lock_body(max_holders=3))).status_code == 409
        found = samples((await client.get("/metrics")).text)
    counted = "helix_locks_acquisitions_total"
    assert value(found, counted, organization="", result="full") == 2
    assert value(found, counted, organization="", result="conflict") == 1
    assert value(found, counted, organization="", result="max-holders-mismatch") == 1


async def test_events_say_each_locks_slot_live_and_replayed(db_url: str, tmp_path: Path) -> None:
    admin = keys.create(db_url, None)
    headers = {"Authorization": f"Bearer {admin}"}
    with replicas(db_url, tmp_path) as [url]:
        async with httpx.AsyncClient(base_url=url, headers=headers) as http, Watch(url, key=admin) as live:
            grants = [await acquire(http, holder=f"w{n}", max_holders=2) for n in range(2)]
            first = await live.until(2, within=10)
            assert [(e.type, e.data["lock"]["slot"], e.data["lock"]["max_holders"]) for e in first] == [
                ("acquired", 0, 2),
                ("acquired", 1, 2),
            ]
            assert [e.data["lock"]["id"] for e in first] == [g["id"] for g in grants]
        async with Watch(url, key=admin, last_event_id=first[0].id) as resumed:
            replayed = await resumed.until(1, within=10)
        assert (replayed[0].data["lock"]["id"], replayed[0].data["lock"]["slot"]) == (grants[1]["id"], 1)


# The statements of the build before semaphores, exactly as it sends them (queries.py at 408e920).
_PREVIOUS_LOCK = """
id, organization_id, job_type, holder, fencing_token, acquired_at, expires_at, released_at,
release_reason, state, ttl_remaining_ms, metadata
"""
PREVIOUS_ACQUIRE = (
    "SELECT "
    + _PREVIOUS_LOCK
    + """, token, reclaimed_lock_id, reclaimed_holder, reclaimed_expired_at
FROM helix_acquire_job_lock(
    %(organization_id)s, %(job_type)s, %(holder)s, %(ttl_ms)s, %(metadata)s, %(idempotency_key)s
)
"""
)
PREVIOUS_ACQUIRE_WITHIN_QUOTA = (
    "SELECT "
    + _PREVIOUS_LOCK
    + """, token, reclaimed_lock_id, reclaimed_holder, reclaimed_expired_at
FROM helix_acquire_job_lock_within_quota(
    %(organization_id)s, %(job_type)s, %(holder)s, %(ttl_ms)s, %(metadata)s, %(idempotency_key)s, %(quota)s
)
"""
)
PREVIOUS_RENEW = (
    "SELECT "
    + _PREVIOUS_LOCK
    + ", lapsed FROM helix_renew_job_lock(%(lock_id)s, %(token)s, %(ttl_ms)s, %(scope)s)"
)
PREVIOUS_RELEASE = (
    "SELECT " + _PREVIOUS_LOCK + " FROM helix_release_job_lock(%(lock_id)s, %(token)s, %(scope)s)"
)
PREVIOUS_CURRENT = (
    "SELECT "
    + _PREVIOUS_LOCK
    + """ FROM helix_job_lock_views
WHERE organization_id = %(organization_id)s
  AND job_type = %(job_type)s
  AND released_at IS NULL
  AND state = 'held'
"""
)


def test_a_replica_of_the_previous_build_keeps_working_through_the_migration(
    empty_db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    every = migrate.load()
    before = [m.name for m in every].index("0017_semaphores.sql")
    monkeypatch.setattr(migrate, "load", lambda: every[:before])
    migrate.migrate(empty_db_url)
    monkeypatch.undo()

    def grant(job_type: str, holder: str) -> dict[str, Any]:
        return {
            "organization_id": "acme",
            "job_type": job_type,
            "holder": holder,
            "ttl_ms": 30_000,
            "metadata": None,
            "idempotency_key": None,
        }

    # The previous build's connection, its statements prepared at their first use, as a
    # service process holds them through the upgrade.
    with (
        psycopg.connect(empty_db_url, autocommit=True, row_factory=dict_row, prepare_threshold=0) as previous,
        psycopg.connect(empty_db_url, autocommit=True, row_factory=dict_row) as current,
    ):
        previous.execute(queries.CONFIGURE_SESSION, {"statement_timeout_ms": "10000"})
        first = previous.execute(PREVIOUS_ACQUIRE, grant("report", "old-1")).fetchone()
        assert first is not None
        holder = {"lock_id": first["id"], "token": first["token"], "scope": None}
        previous.execute(PREVIOUS_RENEW, {**holder, "ttl_ms": 30_000}).fetchone()
        previous.execute(PREVIOUS_CURRENT, {"organization_id": "acme", "job_type": "report"}).fetchone()

        assert migrate.migrate(empty_db_url) == [m.name for m in every[before:]]

        # The same prepared statements go on working on the migrated schema.
        renewed = previous.execute(PREVIOUS_RENEW, {**holder, "ttl_ms": 30_000}).fetchone()
        assert renewed is not None and renewed["id"] == first["id"] and renewed["lapsed"] is False
        now = previous.execute(PREVIOUS_CURRENT, {"organization_id": "acme", "job_type": "report"}).fetchall()
        assert [row["id"] for row in now] == [first["id"]]
        with pytest.raises(psycopg.errors.UniqueViolation) as held:
            previous.execute(PREVIOUS_ACQUIRE, grant("report", "old-2"))
        assert json.loads(held.value.diag.message_detail or "")["lock_id"] == first["id"]
        released = previous.execute(PREVIOUS_RELEASE, holder).fetchone()
        assert released is not None and released["state"] == "released"
        second = previous.execute(PREVIOUS_ACQUIRE, grant("report", "old-2")).fetchone()
        assert second is not None and second["fencing_token"] == 2  # the refusal took none
        quota = {**grant("quota", "old-3"), "quota": 10}
        assert previous.execute(PREVIOUS_ACQUIRE_WITHIN_QUOTA, quota).fetchone() is not None

        # What the previous build granted is a lock of one slot to the new build.
        row = current.execute(queries.GET, {"lock_id": second["id"], "scope": None}).fetchone()
        assert row is not None and (row["max_holders"], row["slot"]) == (1, 0)
        # The new build's semaphore beside it; the previous build's acquire of that key is refused
        # with the fields it reads (a 409 lock-held there).
        for n in range(2):
            params = {**grant("export", f"new-{n}"), "max_holders": 2}
            assert current.execute(queries.ACQUIRE, params).fetchone()["slot"] == n  # type: ignore[index]
        with pytest.raises(psycopg.errors.UniqueViolation) as refused:
            previous.execute(PREVIOUS_ACQUIRE, grant("export", "old-4"))
        detail = json.loads(refused.value.diag.message_detail or "")
        assert {"lock_id", "holder", "expires_at", "retry_after_seconds"} <= detail.keys()
