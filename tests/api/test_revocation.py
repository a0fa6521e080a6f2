"""Revocation requests over HTTP (migration 0035): anyone of the lock's organization may ask its
holder to let go. The first request is recorded in the lock (who, why, by when), sent as an event
and answered to the holder's renewals; nothing is forced. A request that names a preferred holder
reserves the pair, once released, for that holder until the deadline (409 reserved to others),
while queued waiters keep their places."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest

from tests.support import acquire, assert_problem, lock_body

pytestmark = pytest.mark.anyio
BOTH_PATHS = True
RESERVED = "urn:helix-locks:problem:reserved"


def at(value: str) -> datetime:
    return datetime.fromisoformat(value)


async def revoke(client: httpx.AsyncClient, lock: dict[str, Any], **body: Any) -> httpx.Response:
    return await client.post(f"/v1/locks/{lock['id']}/revocation", json={"reason": "deploy", **body})


async def release(client: httpx.AsyncClient, lock: dict[str, Any]) -> None:
    answer = await client.delete(f"/v1/locks/{lock['id']}", headers={"Lock-Token": lock["token"]})
    assert answer.status_code == 204, answer.text


async def test_a_request_is_recorded_once_shown_everywhere_and_answered_to_the_holder(
    client: httpx.AsyncClient,
) -> None:
    lock = await acquire(client)
    asked = await revoke(client, lock, reason="deploying v2", deadline_seconds=90)
    assert asked.status_code == 202, asked.text
    revocation = asked.json()["revocation"]
    assert revocation["reason"] == "deploying v2" and revocation["by"] is None  # anonymous
    assert revocation["preferred_holder"] is None
    assert at(revocation["deadline"]) - at(revocation["requested_at"]) == timedelta(seconds=90)
    assert asked.json()["state"] == "held", "nothing is forced"

    again = await revoke(client, lock, reason="another", deadline_seconds=5)
    assert again.status_code == 202 and again.json()["revocation"] == revocation, "the first stays"
    key = {"organization_id": "acme", "job_type": "nightly-report"}
    renewed = await client.post(
        f"/v1/locks/{lock['id']}/renew", json={"ttl_seconds": 30}, headers={"Lock-Token": lock["token"]}
    )
    assert renewed.status_code == 200 and renewed.json()["revocation"] == revocation
    shown = [
        (await client.get(f"/v1/locks/{lock['id']}")).json(),
        (await client.get("/v1/locks/current", params=key)).json(),
        (await client.get("/v1/locks", params=key)).json()["items"][0],
    ]
    assert [lock_shown["revocation"] for lock_shown in shown] == [revocation] * 3
    await release(client, lock)
    ended = (await client.get(f"/v1/locks/{lock['id']}")).json()
    assert ended["state"] == "released" and ended["revocation"] == revocation, "the history keeps it"
    gone = await revoke(client, lock)
    assert assert_problem(gone, 410)["type"] == "urn:helix-locks:problem:lock-ended"
    assert assert_problem(await client.post("/v1/locks/999999/revocation", json={"reason": "x"}), 404)


async def test_a_preferred_holder_takes_over_while_others_are_told_reserved(
    client: httpx.AsyncClient,
) -> None:
    lock = await acquire(client, holder="leader-1")
    asked = await revoke(client, lock, deadline_seconds=30, preferred_holder="leader-2")
    assert asked.json()["revocation"]["preferred_holder"] == "leader-2"
    held = await client.post("/v1/locks", json=lock_body(holder="bystander"))
    assert assert_problem(held, 409)["type"] == "urn:helix-locks:problem:lock-held", "held, then reserved"
    await release(client, lock)

    refused = await client.post("/v1/locks", json=lock_body(holder="bystander"))
    problem = assert_problem(refused, 409)
    assert problem["type"] == RESERVED and problem["preferred_holder"] == "leader-2"
    assert problem["deadline"] == asked.json()["revocation"]["deadline"]
    assert 1 <= int(refused.headers["Retry-After"]) <= 30
    heir = await acquire(client, holder="leader-2")
    assert heir["fencing_token"] == lock["fencing_token"] + 1
    await release(client, heir)
    after = await acquire(client, holder="bystander")  # the reservation was used up by the heir's grant
    assert after["fencing_token"] == heir["fencing_token"] + 1


async def test_a_preferred_holder_passes_the_queue_whose_waiters_keep_their_places(
    client: httpx.AsyncClient,
) -> None:
    lock = await acquire(client, holder="leader-1")
    waiter = asyncio.create_task(
        client.post("/v1/locks", json=lock_body(holder="waiter", wait_seconds=30), timeout=40)
    )
    deadline = time.monotonic() + 20
    while not (
        await client.get("/v1/locks/queue", params={"organization_id": "acme", "job_type": "nightly-report"})
    ).json()["items"]:
        assert time.monotonic() < deadline, "the waiter never queued"
        await asyncio.sleep(0.05)
    await revoke(client, lock, deadline_seconds=30, preferred_holder="leader-2")
    await release(client, lock)
    heir = await acquire(client, holder="leader-2")  # not waiting, past the waiter's place
    assert not waiter.done()
    await release(client, heir)
    granted = await asyncio.wait_for(waiter, 40)
    assert granted.status_code == 201, granted.text
    assert (
        granted.json()["holder"] == "waiter" and granted.json()["fencing_token"] == heir["fencing_token"] + 1
    )


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"reason": ""},
        {"reason": "x" * 1025},
        {"reason": "a\u0000b"},
        {"reason": "x", "deadline_seconds": 0},
        {"reason": "x", "deadline_seconds": 86401},
        {"reason": "x", "deadline_seconds": float("inf")},
        {"reason": "x", "deadline_seconds": "60"},
        {"reason": "x", "preferred_holder": ""},
        {"reason": "x", "force": True},
    ],
)
async def test_a_bad_request_is_refused_naming_its_field(
    client: httpx.AsyncClient, body: dict[str, Any]
) -> None:
    lock = await acquire(client)
    sent = json.dumps(body).encode()
    answer = await client.post(
        f"/v1/locks/{lock['id']}/revocation", content=sent, headers={"Content-Type": "application/json"}
    )
    assert_problem(answer, 422)


async def test_a_preferred_holder_is_for_a_plain_exclusive_lock(client: httpx.AsyncClient) -> None:
    semaphore = await acquire(client, job_type="pool", max_holders=2)
    answer = await revoke(client, semaphore, preferred_holder="heir")
    assert "preferred_holder" in str(assert_problem(answer, 422))
    assert (await revoke(client, semaphore)).status_code == 202, "a request without one is fine"
