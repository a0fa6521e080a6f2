"""Closed pairs over HTTP (migration 0034): `hold_at_least_seconds` on an acquire closes its pair
until `closed_until` (acquired_at + that, by the database clock). No other lock of the pair is
granted before it, whatever becomes of the lock that closed it (released early, lapsed and
reclaimable, forced); an acquire meanwhile gets 409 closed-until with `closed_until` and
Retry-After; a waiting acquire waits for it, or is told at once when its wait ends first."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timedelta
from typing import Any

import httpx
import psycopg
import pytest

from tests.support import acquire, assert_problem, expire, lock_body

pytestmark = pytest.mark.anyio
BOTH_PATHS = True
CLOSED = "urn:helix-locks:problem:closed-until"


def at(value: str) -> datetime:
    return datetime.fromisoformat(value)


async def release(client: httpx.AsyncClient, lock: dict[str, Any]) -> None:
    answer = await client.delete(f"/v1/locks/{lock['id']}", headers={"Lock-Token": lock["token"]})
    assert answer.status_code == 204, answer.text


def database_now(db_url: str) -> datetime:
    with psycopg.connect(db_url, autocommit=True) as conn:
        [(now,)] = conn.execute("SELECT clock_timestamp()").fetchall()
    assert isinstance(now, datetime)
    return now


async def granted_after_closing(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    """Acquire until granted: refused only as closed-until meanwhile, never past 30 s."""
    deadline = time.monotonic() + 30
    while (answer := await client.post("/v1/locks", json=lock_body(**body))).status_code == 409:
        assert answer.json()["type"] == CLOSED, answer.text
        assert time.monotonic() < deadline, "the pair never opened"
        await asyncio.sleep(0.1)
    assert answer.status_code == 201, answer.text
    grant: dict[str, Any] = answer.json()
    return grant


async def test_a_pair_released_early_stays_closed_until_closed_until(
    client: httpx.AsyncClient, db_url: str
) -> None:
    lock = await acquire(client, hold_at_least_seconds=3)
    closed_until = at(lock["closed_until"])
    assert closed_until - at(lock["acquired_at"]) == timedelta(seconds=3)
    await release(client, lock)  # the job took a moment; the pair stays closed

    refused = await client.post("/v1/locks", json=lock_body(holder="late-clock"))
    problem = assert_problem(refused, 409)
    assert problem["type"] == CLOSED and problem["closed_until"] == lock["closed_until"]
    assert 1 <= int(refused.headers["Retry-After"]) <= 3
    assert database_now(db_url) < closed_until, "refused while closed, by the database's clock"

    taken = await granted_after_closing(client, holder="next-interval")
    assert at(taken["acquired_at"]) >= closed_until
    assert taken["closed_until"] is None and taken["fencing_token"] == lock["fencing_token"] + 1, (
        "a refusal hands out no fencing token"
    )
    ended = (await client.get(f"/v1/locks/{lock['id']}")).json()
    assert ended["state"] == "released" and ended["closed_until"] == lock["closed_until"]


async def test_a_lapsed_or_forced_lock_leaves_its_pair_closed(client: httpx.AsyncClient, db_url: str) -> None:
    lapsed = await acquire(client, job_type="lapses", hold_at_least_seconds=600)
    with psycopg.connect(db_url, autocommit=True) as conn:
        expire(conn, lapsed["id"])
    refused = await client.post("/v1/locks", json=lock_body(job_type="lapses"))
    assert assert_problem(refused, 409)["type"] == CLOSED, "a lapsed lock is not reclaimed while closed"

    forced = await acquire(client, job_type="forced", hold_at_least_seconds=600)
    with psycopg.connect(db_url, autocommit=True) as conn:  # as an admin's DELETE ?force=true does
        conn.execute("SELECT FROM helix_force_release_job_lock(%s, 'admin-1')", (forced["id"],))
    assert (await client.get(f"/v1/locks/{forced['id']}")).json()["release_reason"] == "forced"
    refused = await client.post("/v1/locks", json=lock_body(job_type="forced"))
    assert assert_problem(refused, 409)["closed_until"] == forced["closed_until"]


async def test_the_closing_shows_wherever_the_lock_does(client: httpx.AsyncClient) -> None:
    lock = await acquire(client, hold_at_least_seconds=600)
    key = {"organization_id": "acme", "job_type": "nightly-report"}
    got = (await client.get(f"/v1/locks/{lock['id']}")).json()
    current = (await client.get("/v1/locks/current", params=key)).json()
    [listed] = (await client.get("/v1/locks", params=key)).json()["items"]
    token = {"Lock-Token": lock["token"]}
    patched = (await client.patch(f"/v1/locks/{lock['id']}", json={"metadata": None}, headers=token)).json()
    renewed = (
        await client.post(f"/v1/locks/{lock['id']}/renew", json={"ttl_seconds": 30}, headers=token)
    ).json()
    assert {got["closed_until"], current["closed_until"], listed["closed_until"]} == {lock["closed_until"]}
    assert patched["closed_until"] == renewed["closed_until"] == lock["closed_until"]
    await release(client, lock)
    [ended] = (await client.get("/v1/locks", params={**key, "state": "released"})).json()["items"]
    assert ended["closed_until"] == lock["closed_until"]
    assert (await acquire(client, job_type="open"))["closed_until"] is None


async def test_a_repeat_is_answered_its_grant_and_other_pairs_stay_open(client: httpx.AsyncClient) -> None:
    headers = {"Idempotency-Key": "cron-1"}
    body = lock_body(hold_at_least_seconds=600)
    first = await client.post("/v1/locks", json=body, headers=headers)
    again = await client.post("/v1/locks", json=body, headers=headers)
    assert first.status_code == again.status_code == 201, again.text
    assert (
        again.json()["id"] == first.json()["id"]
        and again.json()["closed_until"] == first.json()["closed_until"]
    )
    # The closing is the pair's: another job type, or another organization's pair, is open.
    await acquire(client, job_type="weekly-report")
    await acquire(client, organization_id="globex")


async def test_a_waiting_acquire_waits_for_the_opening_or_is_told_at_once(
    client: httpx.AsyncClient,
) -> None:
    lock = await acquire(client, hold_at_least_seconds=2)
    await release(client, lock)
    waited = await client.post("/v1/locks", json=lock_body(holder="waiter", wait_seconds=30), timeout=40)
    assert waited.status_code == 201, waited.text
    assert at(waited.json()["acquired_at"]) >= at(lock["closed_until"]), "granted only once open"

    closing = await acquire(client, job_type="long", hold_at_least_seconds=600)
    started = time.monotonic()
    refused = await client.post("/v1/locks", json=lock_body(job_type="long", wait_seconds=20), timeout=40)
    assert assert_problem(refused, 409)["closed_until"] == closing["closed_until"]
    assert time.monotonic() - started < 20, "a wait that ends before the opening does not wait in vain"


async def test_a_session_is_refused_a_closed_pair_naming_it(client: httpx.AsyncClient) -> None:
    await release(client, await acquire(client, job_type="b", hold_at_least_seconds=600))
    body = {
        "organization_id": "acme", "holder": "w", "ttl_seconds": 30,
        "locks": [{"job_type": "a"}, {"job_type": "b"}],
    }  # fmt: skip
    problem = assert_problem(await client.post("/v1/sessions", json=body), 409)
    assert problem["type"] == CLOSED and problem["job_type"] == "b"
    assert (await acquire(client, job_type="a"))["fencing_token"] == 1, "the session took none"


@pytest.mark.parametrize(
    "body",
    [
        {"hold_at_least_seconds": 0},
        {"hold_at_least_seconds": 604801},
        {"hold_at_least_seconds": "60"},
        {"hold_at_least_seconds": float("inf")},
        {"hold_at_least_seconds": 60, "max_holders": 2},
        {"hold_at_least_seconds": 60, "mode": "shared"},
    ],
)
async def test_a_closing_out_of_bounds_or_of_several_holders_is_refused(
    client: httpx.AsyncClient, body: dict[str, Any]
) -> None:
    sent = json.dumps({**lock_body(), **body}).encode()  # as a client may send it, Infinity included
    answer = await client.post("/v1/locks", content=sent, headers={"Content-Type": "application/json"})
    assert "hold_at_least_seconds" in str(assert_problem(answer, 422))
