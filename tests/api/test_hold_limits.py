"""Hold limits over HTTP (migration 0033): `max_hold_seconds` on an acquire bounds every lease of
the lock by `hold_limit_at` (acquired_at + that, by the database clock); a renewal is cut short by
it (`limited`), and refused once it has come (410 hold-limit-reached); the lock then lapses and
the next acquire of its pair reclaims it."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timedelta
from typing import Any

import httpx
import psycopg
import pytest

from tests.support import acquire, assert_problem, lock_body

pytestmark = pytest.mark.anyio
BOTH_PATHS = True


def at(value: str) -> datetime:
    return datetime.fromisoformat(value)


async def renew(client: httpx.AsyncClient, lock: dict[str, Any], ttl: float) -> httpx.Response:
    return await client.post(
        f"/v1/locks/{lock['id']}/renew", json={"ttl_seconds": ttl}, headers={"Lock-Token": lock["token"]}
    )


async def test_no_lease_passes_the_hold_limit_and_after_it_the_lock_is_renewed_no_more(
    client: httpx.AsyncClient, db_url: str
) -> None:
    lock = await acquire(client, max_hold_seconds=3, ttl_seconds=30)
    limit = at(lock["hold_limit_at"])
    assert limit - at(lock["acquired_at"]) == timedelta(seconds=3)
    assert at(lock["expires_at"]) == limit, "the first lease ends at the limit, not after 30 s"

    short = await renew(client, lock, 1)
    assert short.status_code == 200, short.text
    assert short.json()["limited"] is False and at(short.json()["expires_at"]) < limit

    cut = await renew(client, lock, 30)
    assert cut.status_code == 200, cut.text
    assert cut.json()["limited"] is True and at(cut.json()["expires_at"]) == limit
    assert cut.json()["hold_limit_at"] == lock["hold_limit_at"]

    # A hung holder renewing on: every renewal is cut to the limit, until the limit comes.
    deadline = time.monotonic() + 30
    while (answer := await renew(client, lock, 30)).status_code == 200:
        assert at(answer.json()["expires_at"]) == limit
        assert time.monotonic() < deadline, "renewals were granted past the hold limit"
        await asyncio.sleep(0.2)
    problem = assert_problem(answer, 410)
    assert problem["type"] == "urn:helix-locks:problem:hold-limit-reached"
    assert problem["hold_limit_at"] == lock["hold_limit_at"]
    with psycopg.connect(db_url, autocommit=True) as conn:
        [(now,)] = conn.execute("SELECT clock_timestamp()").fetchall()
    assert now >= limit, "refused before the limit, by the database's clock"

    # Lapsed: the next acquire reclaims it, and the history keeps the limit.
    taken = await acquire(client, holder="next")
    assert taken["reclaimed"]["lock_id"] == lock["id"] and taken["hold_limit_at"] is None
    assert at(taken["acquired_at"]) >= limit
    ended = (await client.get(f"/v1/locks/{lock['id']}")).json()
    assert ended["state"] == "reclaimed" and ended["hold_limit_at"] == lock["hold_limit_at"]


async def test_the_hold_limit_shows_wherever_the_lock_does(client: httpx.AsyncClient) -> None:
    lock = await acquire(client, max_hold_seconds=600)
    key = {"organization_id": "acme", "job_type": "nightly-report"}
    got = (await client.get(f"/v1/locks/{lock['id']}")).json()
    current = (await client.get("/v1/locks/current", params=key)).json()
    [listed] = (await client.get("/v1/locks", params=key)).json()["items"]
    patched = await client.patch(
        f"/v1/locks/{lock['id']}", json={"metadata": {"a": 1}}, headers={"Lock-Token": lock["token"]}
    )
    assert {got["hold_limit_at"], current["hold_limit_at"], listed["hold_limit_at"]} == {
        lock["hold_limit_at"]
    }
    assert patched.json()["hold_limit_at"] == lock["hold_limit_at"]
    released = await client.delete(f"/v1/locks/{lock['id']}", headers={"Lock-Token": lock["token"]})
    assert released.status_code == 204
    [ended] = (await client.get("/v1/locks", params={**key, "state": "released"})).json()["items"]
    assert ended["hold_limit_at"] == lock["hold_limit_at"]

    plain = await acquire(client, job_type="other")
    assert plain["hold_limit_at"] is None
    renewed = await renew(client, plain, 30)
    assert renewed.json()["limited"] is False and renewed.json()["hold_limit_at"] is None


async def test_a_repeat_answers_the_first_grant_s_hold_limit(client: httpx.AsyncClient) -> None:
    headers = {"Idempotency-Key": "hold-1"}
    first = await client.post("/v1/locks", json=lock_body(max_hold_seconds=120), headers=headers)
    again = await client.post("/v1/locks", json=lock_body(max_hold_seconds=120), headers=headers)
    assert first.status_code == again.status_code == 201, again.text
    assert again.json()["id"] == first.json()["id"]
    assert again.json()["hold_limit_at"] == first.json()["hold_limit_at"] is not None


@pytest.mark.parametrize("value", [0, 0.5, 604801, "60", None, float("inf")])
async def test_a_hold_limit_out_of_bounds_is_refused(client: httpx.AsyncClient, value: Any) -> None:
    body = {**lock_body(), "max_hold_seconds": value}
    if value is None:  # null: no hold limit, as when it is left out
        answer = await client.post("/v1/locks", json=body)
        assert answer.status_code == 201 and answer.json()["hold_limit_at"] is None
        return
    sent = json.dumps(body).encode()  # as a client may send it, Infinity included
    answer = await client.post("/v1/locks", content=sent, headers={"Content-Type": "application/json"})
    problem = assert_problem(answer, 422)
    assert "max_hold_seconds" in str(problem)


async def test_a_session_s_hold_limit_bounds_it_and_every_lock_of_it(
    client: httpx.AsyncClient, db_url: str
) -> None:
    body = {
        "organization_id": "acme", "holder": "w", "ttl_seconds": 30, "max_hold_seconds": 3,
        "locks": [{"job_type": "a"}],
    }  # fmt: skip
    opened = await client.post("/v1/sessions", json=body)
    assert opened.status_code == 201, opened.text
    session = opened.json()
    limit = at(session["hold_limit_at"])
    assert at(session["expires_at"]) == limit, "the first lease ends at the limit, not after 30 s"
    token = {"Lock-Token": session["token"]}
    added = await client.post(
        f"/v1/sessions/{session['id']}/locks", json={"locks": [{"job_type": "b"}]}, headers=token
    )
    assert added.status_code == 201, added.text
    locks = session["locks"] + added.json()["locks"]
    assert {lock["hold_limit_at"] for lock in locks} == {session["hold_limit_at"]}
    for lock in locks:
        got = (await client.get(f"/v1/locks/{lock['id']}")).json()
        assert got["hold_limit_at"] == session["hold_limit_at"] and at(got["expires_at"]) <= limit

    deadline = time.monotonic() + 30
    while (
        answer := await client.post(
            f"/v1/sessions/{session['id']}/renew", json={"ttl_seconds": 30}, headers=token
        )
    ).status_code == 200:
        assert answer.json()["limited"] is True and at(answer.json()["expires_at"]) == limit
        assert time.monotonic() < deadline, "renewals were granted past the hold limit"
        await asyncio.sleep(0.2)
    problem = assert_problem(answer, 410)
    assert problem["type"] == "urn:helix-locks:problem:hold-limit-reached"
    with psycopg.connect(db_url, autocommit=True) as conn:
        [(now,)] = conn.execute("SELECT clock_timestamp()").fetchall()
    assert now >= limit, "refused before the limit, by the database's clock"
    taken = await acquire(client, job_type="b", holder="next")
    assert taken["reclaimed"]["lock_id"] == locks[1]["id"] and at(taken["acquired_at"]) >= limit


async def test_a_session_without_a_hold_limit_says_none(client: httpx.AsyncClient) -> None:
    body = {"organization_id": "acme", "holder": "w", "ttl_seconds": 30, "locks": [{"job_type": "a"}]}
    session = (await client.post("/v1/sessions", json=body)).json()
    assert session["hold_limit_at"] is None and session["locks"][0]["hold_limit_at"] is None
    renewed = await client.post(
        f"/v1/sessions/{session['id']}/renew",
        json={"ttl_seconds": 30},
        headers={"Lock-Token": session["token"]},
    )
    assert renewed.json()["limited"] is False
    refused = await client.post("/v1/sessions", json={**body, "max_hold_seconds": 0})
    assert "max_hold_seconds" in str(assert_problem(refused, 422))


async def test_a_repeat_that_waited_for_the_first_grant_is_told_its_hold_limit(
    client: httpx.AsyncClient, db_url: str
) -> None:
    """The first call and its repeat (another max_hold_seconds, or none) wait on the pair's row;
    the repeat's statement began before the first grant committed, and is still told that grant's
    hold limit, not one of its own. (Found by review: it computed its own, or said null.)"""
    await release_it(client, await acquire(client))  # the pair's row exists
    headers = {"Idempotency-Key": "raced"}
    with psycopg.connect(db_url) as blocker:
        blocker.execute(
            "SELECT FROM helix_lock_keys WHERE organization_id = 'acme' AND job_type = 'nightly-report'"
            " FOR UPDATE"
        )
        first = asyncio.create_task(
            client.post("/v1/locks", json=lock_body(max_hold_seconds=100), headers=headers)
        )
        await asyncio.sleep(0.3)  # (order only: either may come first, both must agree)
        repeat = asyncio.create_task(client.post("/v1/locks", json=lock_body(), headers=headers))
        await asyncio.sleep(0.3)
        blocker.commit()
    answers = [(await asyncio.wait_for(task, 20)) for task in (first, repeat)]
    assert [a.status_code for a in answers] == [201, 201], [a.text for a in answers]
    assert answers[0].json()["id"] == answers[1].json()["id"]
    got = (await client.get(f"/v1/locks/{answers[0].json()['id']}")).json()
    assert {a.json()["hold_limit_at"] for a in answers} == {got["hold_limit_at"]}


async def release_it(client: httpx.AsyncClient, lock: dict[str, Any]) -> None:
    answer = await client.delete(f"/v1/locks/{lock['id']}", headers={"Lock-Token": lock["token"]})
    assert answer.status_code == 204, answer.text
