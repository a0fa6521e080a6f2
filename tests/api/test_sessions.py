"""Sessions over HTTP (issue 38): one lease that many locks share, several locks granted all or
none, the session's renewal and end, its lapse and loss, replays, limits and tenancy."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import httpx
import psycopg
import pytest

from helix_locks.server import keys
from helix_locks.server.app import create_app
from tests.support import ROUTE, Conn, acquire, assert_problem, in_process, lock_body

pytestmark = pytest.mark.anyio


def session_body(*job_types: str, **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "organization_id": "acme",
        "holder": "w1",
        "ttl_seconds": 30,
        "locks": [{"job_type": job_type} for job_type in job_types],
    }
    body.update(overrides)
    return body


async def open_session(client: httpx.AsyncClient, *job_types: str, **overrides: Any) -> dict[str, Any]:
    response = await client.post("/v1/sessions", json=session_body(*job_types, **overrides))
    assert response.status_code == 201, response.text
    opened: dict[str, Any] = response.json()
    assert response.headers["location"] == f"/v1/sessions/{opened['id']}"
    return opened


def expire_session(conn: Conn, session_id: int) -> None:
    """Move a session's lease, and its holds', into the past on the database clock."""
    conn.execute(
        "UPDATE helix_sessions SET created_at = created_at - interval '1 hour',"
        " expires_at = clock_timestamp() - interval '1 millisecond' WHERE id = %s",
        (session_id,),
    )
    conn.execute(
        "UPDATE helix_holds SET acquired_at = acquired_at - interval '1 hour',"
        " expires_at = (SELECT expires_at FROM helix_sessions WHERE id = %s) WHERE session_id = %s",
        (session_id, session_id),
    )


async def test_a_session_grants_its_locks_together_each_with_its_own_fencing_token(
    client: httpx.AsyncClient,
) -> None:
    await acquire(client, job_type="b")  # a lock on its own, beside the session's
    opened = await open_session(client, "c", "a", metadata={"run": 1})
    assert opened["state"] == "held" and opened["holder"] == "w1" and opened["token"]
    assert [lock["job_type"] for lock in opened["locks"]] == ["a", "c"]  # in job type order
    for lock in opened["locks"]:
        assert lock["session_id"] == opened["id"]
        assert lock["expires_at"] == opened["expires_at"]  # the session's lease
        assert lock["state"] == "held" and lock["holder"] == "w1" and lock["metadata"] == {"run": 1}
        assert lock["fencing_token"] == 1
        # Every answer that shows the lock names its session.
        assert (await client.get(f"/v1/locks/{lock['id']}")).json()["session_id"] == opened["id"]
    listed = (await client.get("/v1/locks", params={"organization_id": "acme"})).json()["items"]
    assert {lock["job_type"]: lock["session_id"] for lock in listed} == {
        "a": opened["id"],
        "b": None,
        "c": opened["id"],
    }
    current = (
        await client.get("/v1/locks/current", params={"organization_id": "acme", "job_type": "a"})
    ).json()
    assert current["session_id"] == opened["id"]
    got = (await client.get(f"/v1/sessions/{opened['id']}")).json()
    assert "token" not in got
    assert [lock["id"] for lock in got["locks"]] == [lock["id"] for lock in opened["locks"]]

    # A session with no locks yet, and locks added to it later, all or none.
    empty = await open_session(client)
    assert empty["locks"] == []
    token = {"Lock-Token": empty["token"]}
    added = await client.post(
        f"/v1/sessions/{empty['id']}/locks", headers=token, json={"locks": [{"job_type": "d"}]}
    )
    assert added.status_code == 201, added.text
    assert [(lock["job_type"], lock["session_id"]) for lock in added.json()["locks"]] == [("d", empty["id"])]
    assert added.json()["locks"][0]["expires_at"] == empty["expires_at"]


async def test_a_held_pair_refuses_the_whole_set_naming_the_first_in_job_type_order(
    client: httpx.AsyncClient, conn: Conn
) -> None:
    held_b = await acquire(client, job_type="b")
    held_d = await acquire(client, job_type="d")
    response = await client.post("/v1/sessions", json=session_body("e", "d", "b", "a"))
    problem = assert_problem(response, 409)
    assert problem["type"] == "urn:helix-locks:problem:lock-held"
    assert problem["job_type"] == "b" and problem["lock_id"] == held_b["id"]
    assert int(response.headers["retry-after"]) >= 1
    # None of the set was granted: a and e are free, and no session was made.
    assert conn.execute("SELECT count(*) FROM helix_sessions").fetchone() == (0,)
    assert {row[0] for row in conn.execute("SELECT job_type FROM helix_holds")} == {"b", "d"}
    # Their counters did not move either: a and e are granted token 1.
    assert (await acquire(client, job_type="a"))["fencing_token"] == 1
    assert (await acquire(client, job_type="e"))["fencing_token"] == 1
    # A pair held with another max_holders refuses the set so, naming it too.
    await client.delete(f"/v1/locks/{held_d['id']}", headers={"Lock-Token": held_d["token"]})
    await acquire(client, job_type="f", max_holders=3)
    response = await client.post(
        "/v1/sessions", json=session_body(locks=[{"job_type": "f", "max_holders": 2}, {"job_type": "g"}])
    )
    problem = assert_problem(response, 409)
    assert problem["type"] == "urn:helix-locks:problem:max-holders-mismatch"
    assert problem["job_type"] == "f" and problem["max_holders"] == 3


async def test_a_session_is_renewed_as_one_and_its_locks_are_released_or_updated_with_its_token(
    client: httpx.AsyncClient, conn: Conn
) -> None:
    opened = await open_session(client, "a", "b", "c", ttl_seconds=5)
    token = {"Lock-Token": opened["token"]}
    a, b, c = opened["locks"]
    versions = "SELECT id, ctid::text, xmin::text FROM helix_holds ORDER BY id"
    holds = conn.execute(versions).fetchall()
    session = conn.execute("SELECT ctid::text, xmin::text FROM helix_sessions").fetchall()
    renewed = await client.post(f"/v1/sessions/{opened['id']}/renew", headers=token, json={"ttl_seconds": 60})
    assert renewed.status_code == 200, renewed.text
    body = renewed.json()
    assert body["lapsed"] is False and body["expires_at"] > opened["expires_at"]
    assert {lock["expires_at"] for lock in body["locks"]} == {body["expires_at"]}
    # The renewal wrote the session's row alone: every hold is the row version its grant wrote,
    # and the locks show the session's new lease wherever they are read.
    assert conn.execute(versions).fetchall() == holds
    assert conn.execute("SELECT ctid::text, xmin::text FROM helix_sessions").fetchall() != session
    listed = (await client.get("/v1/locks", params={"organization_id": "acme"})).json()["items"]
    assert {lock["expires_at"] for lock in listed} == {body["expires_at"]}
    current = await client.get("/v1/locks/current", params={"organization_id": "acme", "job_type": "b"})
    assert current.json()["expires_at"] == body["expires_at"]

    # A lock of a session is renewed with its session, never alone.
    problem = assert_problem(
        await client.post(f"/v1/locks/{a['id']}/renew", headers=token, json={"ttl_seconds": 30}), 409
    )
    assert problem["type"] == "urn:helix-locks:problem:renew-the-session"
    assert problem["session_id"] == opened["id"]
    # Its holder updates and releases one with the session's token; a wrong token is refused.
    patched = await client.patch(f"/v1/locks/{b['id']}", headers=token, json={"metadata": {"done": 1}})
    assert patched.status_code == 200 and patched.json()["session_id"] == opened["id"]
    assert assert_problem(await client.delete(f"/v1/locks/{c['id']}", headers={"Lock-Token": "nope"}), 403)
    assert (await client.delete(f"/v1/locks/{c['id']}", headers=token)).status_code == 204
    got = (await client.get(f"/v1/sessions/{opened['id']}")).json()
    assert [lock["job_type"] for lock in got["locks"]] == ["a", "b"]
    # A lock released by its holder is no loss: the session renews on.
    renewed = await client.post(f"/v1/sessions/{opened['id']}/renew", headers=token, json={"ttl_seconds": 60})
    assert renewed.status_code == 200 and len(renewed.json()["locks"]) == 2

    # Ending the session releases the rest in one statement; a second end is told it ended.
    assert (await client.delete(f"/v1/sessions/{opened['id']}", headers=token)).status_code == 204
    assert conn.execute("SELECT count(*) FROM helix_holds").fetchone() == (0,)
    reasons = conn.execute(
        "SELECT release_reason, count(*) FROM helix_lock_history WHERE session_id = %s GROUP BY 1",
        (opened["id"],),
    ).fetchall()
    assert reasons == [("released", 3)]
    problem = assert_problem(await client.delete(f"/v1/sessions/{opened['id']}", headers=token), 410)
    assert problem["type"] == "urn:helix-locks:problem:session-ended"
    assert problem["end_reason"] == "released"
    assert (await client.get(f"/v1/sessions/{opened['id']}")).json()["state"] == "ended"


async def test_a_lapsed_session_renews_unless_a_lock_of_it_was_reclaimed_then_it_ends_releasing_the_rest(
    client: httpx.AsyncClient, conn: Conn
) -> None:
    opened = await open_session(client, "a", "b")
    token = {"Lock-Token": opened["token"]}
    expire_session(conn, opened["id"])
    assert (await client.get(f"/v1/sessions/{opened['id']}")).json()["state"] == "expired"
    renewed = await client.post(f"/v1/sessions/{opened['id']}/renew", headers=token, json={"ttl_seconds": 30})
    assert renewed.status_code == 200 and renewed.json()["lapsed"] is True

    expire_session(conn, opened["id"])
    # Its locks lapsed with it: the next acquire of a pair reclaims that lock, as any lock's.
    taken = await acquire(client, job_type="b", holder="w2")
    assert taken["reclaimed"]["lock_id"] == opened["locks"][1]["id"]
    assert taken["fencing_token"] == opened["locks"][1]["fencing_token"] + 1
    response = await client.post(
        f"/v1/sessions/{opened['id']}/renew", headers=token, json={"ttl_seconds": 30}
    )
    problem = assert_problem(response, 410)
    assert problem["type"] == "urn:helix-locks:problem:session-ended"
    assert problem["end_reason"] == "lost" and problem["session_id"] == opened["id"]
    # The rest was released by that renewal, and the session has ended.
    a = (await client.get(f"/v1/locks/{opened['locks'][0]['id']}")).json()
    assert a["state"] == "released"
    assert (await client.get(f"/v1/sessions/{opened['id']}")).json()["state"] == "ended"
    assert_problem(await client.delete(f"/v1/sessions/{opened['id']}", headers=token), 410)

    # Locks cannot be added to a session whose lease ran out: renew it first.
    other = await open_session(client, "c")
    expire_session(conn, other["id"])
    problem = assert_problem(
        await client.post(
            f"/v1/sessions/{other['id']}/locks",
            headers={"Lock-Token": other["token"]},
            json={"locks": [{"job_type": "d"}]},
        ),
        409,
    )
    assert problem["type"] == "urn:helix-locks:problem:session-lapsed"


async def test_a_forced_lock_is_a_loss_to_its_session_and_ending_it_answers_410_releasing_the_rest(
    db_url: str, conn: Conn
) -> None:
    admin = keys.create(db_url, None)
    acme = keys.create(db_url, "acme")
    app = create_app(ROUTE.settings(db_url))
    async with in_process(app) as client:
        as_acme = {"Authorization": f"Bearer {acme}"}
        response = await client.post("/v1/sessions", json=session_body("a", "b"), headers=as_acme)
        opened = response.json()
        forced = await client.delete(
            f"/v1/locks/{opened['locks'][0]['id']}?force=true", headers={"Authorization": f"Bearer {admin}"}
        )
        assert forced.status_code == 204
        response = await client.delete(
            f"/v1/sessions/{opened['id']}", headers={**as_acme, "Lock-Token": opened["token"]}
        )
        assert assert_problem(response, 410)["end_reason"] == "lost"
        assert conn.execute("SELECT count(*) FROM helix_holds").fetchone() == (0,)


async def test_a_repeat_with_the_same_idempotency_key_gets_the_same_session(
    client: httpx.AsyncClient,
) -> None:
    first = await client.post("/v1/sessions", json=session_body("a", "b"), headers={"Idempotency-Key": "k1"})
    again = await client.post("/v1/sessions", json=session_body("a", "b"), headers={"Idempotency-Key": "k1"})
    assert first.status_code == again.status_code == 201

    def timeless(body: dict[str, Any]) -> dict[str, Any]:
        locks = [lock | {"ttl_remaining_ms": 0} for lock in body["locks"]]
        return body | {"ttl_remaining_ms": 0, "locks": locks}

    assert timeless(again.json()) == timeless(first.json())
    other = await client.post("/v1/sessions", json=session_body("a", "b"), headers={"Idempotency-Key": "k2"})
    assert assert_problem(other, 409)["job_type"] == "a"


@pytest.fixture
async def small(db_url: str) -> AsyncIterator[httpx.AsyncClient]:
    settings = ROUTE.settings(
        db_url,
        allow_anonymous=True,
        max_sessions_per_organization=2,
        max_locks_per_session=3,
        max_live_locks_per_organization=4,
    )
    async with in_process(create_app(settings)) as http:
        yield http


async def test_sessions_are_bounded_per_organization_and_in_locks_and_count_against_the_quota(
    small: httpx.AsyncClient, conn: Conn
) -> None:
    one = await open_session(small, "a", "b")
    await open_session(small)
    response = await small.post("/v1/sessions", json=session_body())
    assert assert_problem(response, 429)["type"] == "urn:helix-locks:problem:too-many-sessions"
    # Another organization's sessions are its own.
    await open_session(small, "a", organization_id="globex")
    # A session's bound: three locks at most, all or none.
    token = {"Lock-Token": one["token"]}
    response = await small.post(
        f"/v1/sessions/{one['id']}/locks",
        headers=token,
        json={"locks": [{"job_type": "c"}, {"job_type": "d"}]},
    )
    assert assert_problem(response, 409)["type"] == "urn:helix-locks:problem:session-full"
    # The quota (four live locks): acme holds two; a plain lock makes three, so two more are refused
    # together, and not one of them is granted.
    await acquire(small, job_type="x")
    response = await small.post(
        f"/v1/sessions/{one['id']}/locks", headers=token, json={"locks": [{"job_type": "c"}]}
    )
    assert response.status_code == 201
    assert assert_problem(await small.post("/v1/locks", json=lock_body(job_type="y")), 429)
    assert conn.execute("SELECT count(*) FROM helix_holds WHERE organization_id = 'acme'").fetchone() == (4,)
    # Ending the session makes room again.
    assert (await small.delete(f"/v1/sessions/{one['id']}", headers=token)).status_code == 204
    await acquire(small, job_type="y")


async def test_bad_session_requests_are_422_and_unknown_sessions_404(client: httpx.AsyncClient) -> None:
    too_many = session_body(*[f"p{n}" for n in range(33)])
    assert assert_problem(await client.post("/v1/sessions", json=too_many), 422)
    twice = session_body("a", "a")
    assert assert_problem(await client.post("/v1/sessions", json=twice), 422)
    bad = session_body(locks=[{"job_type": "a", "mode": "read"}])
    assert assert_problem(await client.post("/v1/sessions", json=bad), 422)
    bad = session_body(locks=[{"job_type": "a", "max_holders": 0}])
    assert assert_problem(await client.post("/v1/sessions", json=bad), 422)
    for path in ("/v1/sessions/0", "/v1/sessions/nope", "/v1/sessions/99999"):
        assert (
            assert_problem(await client.get(path), 404)["type"] == "urn:helix-locks:problem:session-not-found"
        )
    token = {"Lock-Token": "t"}
    assert assert_problem(await client.delete("/v1/sessions/99999", headers=token), 404)
    renew = await client.post("/v1/sessions/99999/renew", headers=token, json={"ttl_seconds": 30})
    assert assert_problem(renew, 404)
    assert assert_problem(await client.delete("/v1/sessions/1"), 422)  # no Lock-Token


async def test_another_organizations_key_cannot_see_or_touch_a_session(db_url: str) -> None:
    acme, globex = keys.create(db_url, "acme"), keys.create(db_url, "globex")
    async with in_process(create_app(ROUTE.settings(db_url))) as client:
        as_acme, as_globex = ({"Authorization": f"Bearer {key}"} for key in (acme, globex))
        opened = (await client.post("/v1/sessions", json=session_body("a"), headers=as_acme)).json()
        path = f"/v1/sessions/{opened['id']}"
        with_token = {**as_globex, "Lock-Token": opened["token"]}
        assert assert_problem(await client.get(path, headers=as_globex), 404)
        assert assert_problem(await client.delete(path, headers=with_token), 404)
        renewed = await client.post(f"{path}/renew", headers=with_token, json={"ttl_seconds": 30})
        assert assert_problem(renewed, 404)
        added = await client.post(f"{path}/locks", headers=with_token, json={"locks": [{"job_type": "b"}]})
        assert assert_problem(added, 404)
        # Nor open one in another organization.
        assert assert_problem(
            await client.post("/v1/sessions", json=session_body("a"), headers=as_globex), 403
        )
        assert (await client.get(path, headers=as_acme)).status_code == 200


def test_two_calls_wanting_overlapping_pairs_in_opposite_orders_never_deadlock(db_url: str) -> None:
    """Held open statement by statement, on a share of the quota (no lock of the organization's):
    the first call holds a; the second, asking for b and a, locks a first (job type order) and
    waits there, holding nothing the first needs; the first then takes b without waiting. Had the
    second locked b first, each would wait for the other."""
    open_on_share = "SELECT * FROM helix_open_session('acme', %s, 30000, NULL, NULL, %s, %s, 100, %s, 10, 10)"
    with (
        psycopg.connect(db_url, autocommit=False) as first,
        psycopg.connect(db_url, autocommit=False) as second,
    ):
        with psycopg.connect(db_url, autocommit=True) as setup:
            row = setup.execute(
                "INSERT INTO helix_quota_shares (organization_id, room, until)"
                " VALUES ('acme', 10, clock_timestamp() + interval '1 hour') RETURNING id"
            ).fetchone()
            assert row is not None
            share = row[0]
        first.execute("SET lock_timeout = '5s'")
        second.execute("SET lock_timeout = '5s'")
        first.execute(open_on_share, ("w1", ["a"], [1], share))
        outcome: list[Any] = []

        def second_call() -> None:
            try:
                second.execute(open_on_share, ("w2", ["b", "a"], [1, 1], share))
                outcome.append("granted")
            except psycopg.Error as exc:
                outcome.append(exc.sqlstate)
                second.rollback()

        thread = threading.Thread(target=second_call)
        thread.start()
        thread.join(0.5)
        assert thread.is_alive()  # it waits for a's row
        first.execute(open_on_share, ("w1", ["b"], [1], share))  # b is free: no wait
        first.commit()
        thread.join(10)
        assert outcome == ["23505"]  # a was held; nothing of it granted, and no deadlock (40P01)
        held = second.execute("SELECT job_type, holder FROM helix_holds ORDER BY job_type").fetchall()
        assert held == [("a", "w1"), ("b", "w1")]


async def test_a_renewal_never_waits_for_a_writers_fencing_check(
    client: httpx.AsyncClient, db_url: str
) -> None:
    """A storage layer's check (helix_fencing_token_is_current, FOR KEY SHARE) held open while it
    writes: the session's renewal goes on at once, as a lock's does."""
    opened = await open_session(client, "a", "b")
    with psycopg.connect(db_url, autocommit=False) as writer:
        current = writer.execute(
            "SELECT helix_fencing_token_is_current('acme', 'a', %s)", (opened["locks"][0]["fencing_token"],)
        ).fetchone()
        assert current == (True,)
        renewed = await asyncio.wait_for(
            client.post(
                f"/v1/sessions/{opened['id']}/renew",
                headers={"Lock-Token": opened["token"]},
                json={"ttl_seconds": 30},
            ),
            2,
        )
        assert renewed.status_code == 200, renewed.text
        writer.rollback()


async def test_an_opening_waiting_for_a_pair_holds_up_no_other_opening_of_its_organization(
    client: httpx.AsyncClient, db_url: str
) -> None:
    """A session's locks go through on a share of the quota, as acquires do: one opening that
    waits for a pair's row (here, behind a writer's open fencing check) holds no lock of the whole
    organization, so another opening of other pairs is answered at once."""
    await open_session(client, "warm-up")  # the organization's share of the quota is counted
    held = await acquire(client, job_type="x", ttl_seconds=1)
    with psycopg.connect(db_url, autocommit=False) as writer:
        writer.execute("SELECT helix_fencing_token_is_current('acme', 'x', %s)", (held["fencing_token"],))
        await asyncio.sleep(1.1)  # x's lease runs out: an opening would reclaim it, after the writer
        waiting = asyncio.create_task(client.post("/v1/sessions", json=session_body("x", "y", holder="w2")))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        other = await asyncio.wait_for(client.post("/v1/sessions", json=session_body("z", holder="w3")), 2)
        assert other.status_code == 201, other.text
        writer.rollback()
    assert (await asyncio.wait_for(waiting, 10)).status_code == 201


async def test_a_session_that_lost_a_lock_adds_none_and_is_no_answer_to_repeat(
    client: httpx.AsyncClient, conn: Conn
) -> None:
    def force(lock_id: int) -> None:
        conn.execute(
            "SELECT helix_end_holds(ARRAY[%s]::bigint[], clock_timestamp(), 'forced', 'admin')", (lock_id,)
        )

    opened = await open_session(client, "a", "b")
    force(opened["locks"][0]["id"])
    token = {"Lock-Token": opened["token"]}
    added = await client.post(
        f"/v1/sessions/{opened['id']}/locks", headers=token, json={"locks": [{"job_type": "c"}]}
    )
    assert assert_problem(added, 410)["end_reason"] == "lost"
    assert conn.execute("SELECT count(*) FROM helix_holds").fetchone() == (0,)  # b released, c never

    # A repeat of an opening whose session lost a lock is no repeat: the set is not whole.
    first = await client.post("/v1/sessions", json=session_body("p", "q"), headers={"Idempotency-Key": "k"})
    force(first.json()["locks"][0]["id"])
    again = await client.post("/v1/sessions", json=session_body("p", "q"), headers={"Idempotency-Key": "k"})
    assert again.status_code == 201, again.text
    assert again.json()["id"] != first.json()["id"]
    assert [lock["job_type"] for lock in again.json()["locks"]] == ["p", "q"]

    # Adding nothing is refused, and adding a second slot of a pair lists the new lock alone.
    fresh = await open_session(client, locks=[{"job_type": "s", "max_holders": 2}])
    token = {"Lock-Token": fresh["token"]}
    assert_problem(
        await client.post(f"/v1/sessions/{fresh['id']}/locks", headers=token, json={"locks": []}), 422
    )
    second = await client.post(
        f"/v1/sessions/{fresh['id']}/locks",
        headers=token,
        json={"locks": [{"job_type": "s", "max_holders": 2}]},
    )
    assert second.status_code == 201, second.text
    assert [lock["slot"] for lock in second.json()["locks"]] == [1]


async def test_renewing_lapsed_sessions_cannot_pass_the_bound_on_open_sessions(
    small: httpx.AsyncClient, conn: Conn
) -> None:
    lapsed = [await open_session(small) for _ in range(2)]
    for session in lapsed:
        expire_session(conn, session["id"])
    await open_session(small)
    await open_session(small)
    response = await small.post(
        f"/v1/sessions/{lapsed[0]['id']}/renew",
        headers={"Lock-Token": lapsed[0]["token"]},
        json={"ttl_seconds": 30},
    )
    assert assert_problem(response, 429)["type"] == "urn:helix-locks:problem:too-many-sessions"


async def test_a_waiting_session_holds_none_of_its_set_and_is_granted_once_all_are_free(
    client: httpx.AsyncClient, conn: Conn
) -> None:
    """wait_seconds: while a and b are held the session waits holding nothing, its place in each
    queue keeping a freed pair for it (another acquire gets waiters-ahead); it is woken by the
    releases, not by a timer (the leases run 60 s), and granted both at once."""
    held_a = await acquire(client, job_type="a", ttl_seconds=60)
    held_b = await acquire(client, job_type="b", ttl_seconds=60)
    waiting = asyncio.create_task(
        client.post("/v1/sessions", json=session_body("a", "b", wait_seconds=20, holder="w2"))
    )
    await asyncio.sleep(0.3)
    assert not waiting.done()
    await client.delete(f"/v1/locks/{held_b['id']}", headers={"Lock-Token": held_b["token"]})
    await asyncio.sleep(0.3)
    assert not waiting.done()  # b is free, a is not: still nothing granted
    assert conn.execute("SELECT count(*) FROM helix_holds WHERE holder = 'w2'").fetchone() == (0,)
    kept = await client.post("/v1/locks", json=lock_body(job_type="b", holder="passer-by"))
    assert assert_problem(kept, 409)["type"].endswith("waiters-ahead"), "b is kept for the session"
    await client.delete(f"/v1/locks/{held_a['id']}", headers={"Lock-Token": held_a["token"]})
    response = await asyncio.wait_for(waiting, 10)
    assert response.status_code == 201, response.text
    opened = response.json()
    assert [lock["job_type"] for lock in opened["locks"]] == ["a", "b"]
    # Each grant came after its predecessor's end, by the database's clock.
    ends = dict(
        conn.execute(
            "SELECT job_type, released_at FROM helix_lock_history WHERE id = ANY(%s)",
            ([held_a["id"], held_b["id"]],),
        ).fetchall()
    )
    for lock in opened["locks"]:
        assert datetime.fromisoformat(lock["acquired_at"]) >= ends[lock["job_type"]]


async def test_a_sessions_wait_runs_out_with_the_409_of_the_pair_still_held(
    client: httpx.AsyncClient,
) -> None:
    held = await acquire(client, job_type="b", ttl_seconds=60)
    response = await client.post("/v1/sessions", json=session_body("a", "b", wait_seconds=0.5))
    problem = assert_problem(response, 409)
    assert problem["job_type"] == "b" and problem["lock_id"] == held["id"]


async def test_sessions_waiting_for_overlapping_sets_in_opposite_orders_are_granted_one_after_the_other(
    client: httpx.AsyncClient,
) -> None:
    first = await open_session(client, "a", "b", ttl_seconds=60)
    one = asyncio.create_task(
        client.post("/v1/sessions", json=session_body("b", "a", holder="w2", ttl_seconds=60, wait_seconds=20))
    )
    two = asyncio.create_task(
        client.post("/v1/sessions", json=session_body("a", "b", holder="w3", ttl_seconds=60, wait_seconds=20))
    )
    await asyncio.sleep(0.3)
    assert not one.done() and not two.done()
    assert (
        await client.delete(f"/v1/sessions/{first['id']}", headers={"Lock-Token": first["token"]})
    ).status_code == 204
    done, pending = await asyncio.wait({one, two}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1 and len(pending) == 1
    winner = done.pop().result().json()
    assert (
        await client.delete(f"/v1/sessions/{winner['id']}", headers={"Lock-Token": winner["token"]})
    ).status_code == 204
    other = await asyncio.wait_for(pending.pop(), 10)
    assert other.status_code == 201 and len(other.json()["locks"]) == 2


async def test_locks_added_while_the_session_lapses_are_refused_as_lapsed_not_a_500(
    client: httpx.AsyncClient, db_url: str
) -> None:
    """An add that starts with lease left but waits (here for a pair's row, behind a writer's
    fencing check) until the session's lease has run out adds nothing: 409 session-lapsed."""
    session = await open_session(client, ttl_seconds=1)
    held = await acquire(client, job_type="z", ttl_seconds=1)
    with psycopg.connect(db_url, autocommit=False) as writer:
        writer.execute("SELECT helix_fencing_token_is_current('acme', 'z', %s)", (held["fencing_token"],))
        adding = asyncio.create_task(
            client.post(
                f"/v1/sessions/{session['id']}/locks",
                headers={"Lock-Token": session["token"]},
                json={"locks": [{"job_type": "z"}]},
            )
        )
        await asyncio.sleep(1.3)  # the session's lease runs out while the add waits
        writer.rollback()
    problem = assert_problem(await asyncio.wait_for(adding, 10), 409)
    assert problem["type"] == "urn:helix-locks:problem:session-lapsed"


async def test_a_session_lapsed_longer_than_retention_keeps_is_lost_not_renewed_empty(
    client: httpx.AsyncClient, conn: Conn
) -> None:
    """Retention deletes a lapsed lock without history; of a session, it ends the session as lost
    with it, so that its holder coming back is told so rather than renewing a set no longer whole."""
    opened = await open_session(client, "a", "b")
    plain = await acquire(client, job_type="c")
    conn.execute(
        "UPDATE helix_sessions"
        " SET created_at = now() - interval '9 days', expires_at = now() - interval '8 days'"
    )
    conn.execute(
        "UPDATE helix_holds"
        " SET acquired_at = now() - interval '9 days', expires_at = now() - interval '8 days'"
    )
    assert conn.execute("SELECT helix_prune_history('7 days', 100)").fetchone() == (1,)  # c alone
    assert conn.execute("SELECT helix_prune_sessions('7 days', 100)").fetchone() == (1,)
    assert conn.execute("SELECT count(*) FROM helix_holds").fetchone() == (0,)
    renewed = await client.post(
        f"/v1/sessions/{opened['id']}/renew",
        headers={"Lock-Token": opened["token"]},
        json={"ttl_seconds": 30},
    )
    assert assert_problem(renewed, 410)["end_reason"] == "lost"
    assert (await client.get(f"/v1/locks/{plain['id']}")).status_code == 404


async def test_a_lapsed_sessions_lock_is_not_reclaimed_while_its_renewal_is_in_flight(
    client: httpx.AsyncClient, conn: Conn, db_url: str
) -> None:
    """A session's renewal writes its row alone (migration 0028), so the acquire that finds a lock
    of a lapsed session judges it with the session's row locked: while a renewal of that session
    is in flight the lock is held (409, try again in a second), and once the renewal commits it
    is the session's again, nothing reclaimed."""
    opened = await open_session(client, "a", "b", ttl_seconds=1)
    expire_session(conn, opened["id"])
    with psycopg.connect(db_url, autocommit=False) as renewer:
        renewed = renewer.execute(
            "SELECT lapsed FROM helix_renew_session(%s, %s, 30000, 'acme', 1000)",
            (opened["id"], opened["token"]),
        ).fetchall()
        assert renewed == [(True,), (True,)]
        response = await asyncio.wait_for(
            client.post("/v1/locks", json=lock_body(job_type="a", holder="w2")), 5
        )
        problem = assert_problem(response, 409)
        assert problem["lock_id"] == opened["locks"][0]["id"] and response.headers["retry-after"] == "1"
        renewer.commit()
    assert assert_problem(await client.post("/v1/locks", json=lock_body(job_type="a", holder="w2")), 409)
    session = (await client.get(f"/v1/sessions/{opened['id']}")).json()
    assert session["state"] == "held"
    assert [lock["id"] for lock in session["locks"]] == [lock["id"] for lock in opened["locks"]]
    assert {lock["state"] for lock in session["locks"]} == {"held"}


async def test_a_renewal_after_a_reclaim_in_flight_waits_for_it_and_finds_the_session_lost(
    client: httpx.AsyncClient, conn: Conn, db_url: str
) -> None:
    """The converse: an acquire that reclaims a lock of a lapsed session holds the session's row
    until it commits, so a renewal of the session meanwhile waits, then ends it as lost (410),
    never renewing a session that no longer has all its locks."""
    opened = await open_session(client, "a", "b", ttl_seconds=1)
    expire_session(conn, opened["id"])
    with psycopg.connect(db_url, autocommit=False) as thief:
        taken = thief.execute(
            "SELECT reclaimed_lock_id FROM helix_acquire_job_lock('acme', 'b', 'w2', 30000, NULL, NULL)"
        ).fetchall()
        assert taken == [(opened["locks"][1]["id"],)]
        renewal = asyncio.create_task(
            client.post(
                f"/v1/sessions/{opened['id']}/renew",
                headers={"Lock-Token": opened["token"]},
                json={"ttl_seconds": 30},
            )
        )
        await asyncio.sleep(0.5)
        assert not renewal.done()  # waiting for the reclaim's row lock on the session
        thief.commit()
    problem = assert_problem(await asyncio.wait_for(renewal, 5), 410)
    assert problem["end_reason"] == "lost"
    a = (await client.get(f"/v1/locks/{opened['locks'][0]['id']}")).json()
    assert a["state"] == "released"
    history = conn.execute(
        "SELECT release_reason, expires_at = (SELECT expires_at FROM helix_sessions WHERE id = %s)"
        " FROM helix_lock_history WHERE id = %s",
        (opened["id"], opened["locks"][1]["id"]),
    ).fetchone()
    assert history == ("reclaimed", True)  # the lease its history keeps is the session's


async def test_adding_locks_again_with_the_same_idempotency_key_answers_the_same_locks(
    client: httpx.AsyncClient,
) -> None:
    """A retry after a lost answer: the locks its first call added, not a 409 for pairs the session
    itself holds; another key, or none, is a new call."""
    opened = await open_session(client, "a")
    add = f"/v1/sessions/{opened['id']}/locks"
    token = {"Lock-Token": opened["token"]}
    body = {"locks": [{"job_type": "c"}, {"job_type": "b"}]}
    first = await client.post(add, headers={**token, "Idempotency-Key": "k1"}, json=body)
    assert first.status_code == 201, first.text
    again = await client.post(add, headers={**token, "Idempotency-Key": "k1"}, json=body)
    assert again.status_code == 201, again.text

    def granted(response: httpx.Response) -> list[tuple[int, int, str]]:
        return [(lock["id"], lock["fencing_token"], lock["job_type"]) for lock in response.json()["locks"]]

    assert granted(again) == granted(first)
    assert [lock["job_type"] for lock in again.json()["locks"]] == ["b", "c"]
    for headers in ({**token, "Idempotency-Key": "k2"}, token):
        problem = assert_problem(await client.post(add, headers=headers, json=body), 409)
        assert problem["job_type"] == "b"
    # The same key naming other job types is a new call.
    other = await client.post(
        add, headers={**token, "Idempotency-Key": "k1"}, json={"locks": [{"job_type": "d"}]}
    )
    assert other.status_code == 201 and [lock["job_type"] for lock in other.json()["locks"]] == ["d"]
    session = (await client.get(f"/v1/sessions/{opened['id']}")).json()
    assert [lock["job_type"] for lock in session["locks"]] == ["a", "b", "c", "d"]
