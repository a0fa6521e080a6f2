"""Listings read one range of an index within the caller's organization and stop at LIMIT,
however much history other organizations hold (issue 16, item 5): their plans, custom and
generic, beside 200,000 ended locks of another organization and 200,000 ended and 20,000 live
ones of a third; and their answers, the view's."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import psycopg
import pytest
from psycopg import sql

from harness.plans import LISTINGS, PLAN_MODES, explain, lookup_problems, problems
from harness.processes import url_for
from helix_locks.server import keys, queries
from helix_locks.server.app import create_app
from helix_locks.server.db import Database
from tests.support import ROUTE, in_process

pytestmark = pytest.mark.anyio

BIG, SMALL = "big", "small"  # 200,000 ended locks and 100 live ones; 36 ended and 6 live
BUSY = "busy"  # 20,000 live locks and 200,000 ended ones

SEED = [
    # BIG: 100 job types; per 10 grants 1 reclaimed, 1 released by force, 8 released; one every
    # 400 ms over the last day, so that SMALL's history sits in the middle of BIG's.
    """
    INSERT INTO helix_lock_history (id, organization_id, job_type, slot, max_holders, holder, token,
                                    fencing_token, acquired_at, expires_at, released_at,
                                    release_reason, forced_by)
    SELECT nextval('helix_lock_ids'), 'big', 'job-' || n % 100, 0, 1, 'w', md5(n::text), n / 100 + 1,
           t, t + interval '30 s',
           t + interval '1 s', reason, CASE WHEN reason = 'forced' THEN 'admin-key' END
    FROM generate_series(1, 200000) AS n,
         LATERAL (SELECT now() - interval '1 day' + n * interval '400 ms' AS t,
                         CASE n % 10 WHEN 0 THEN 'reclaimed' WHEN 5 THEN 'forced'
                              ELSE 'released' END AS reason) AS r
    """,
    """
    INSERT INTO helix_holds (organization_id, job_type, holder, token, fencing_token, acquired_at,
                             expires_at)
    SELECT 'big', 'live-' || n, 'w', md5(n::text), 1, now(), now() + interval '1 hour'
    FROM generate_series(1, 100) AS n
    """,
    # SMALL: job-1 to job-3, each with 4 reclaimed, 4 released and 4 released by force.
    """
    INSERT INTO helix_lock_history (id, organization_id, job_type, slot, max_holders, holder, token,
                                    fencing_token, acquired_at, expires_at, released_at,
                                    release_reason)
    SELECT nextval('helix_lock_ids'), 'small', 'job-' || j, 0, 1, 'w', md5(j || '-' || k), k,
           t, t + interval '30 s',
           t + interval '1 s', (ARRAY['reclaimed', 'released', 'forced'])[k % 3 + 1]
    FROM generate_series(1, 3) AS j, generate_series(1, 12) AS k,
         LATERAL (SELECT now() - interval '12 hours' + (j * 12 + k) * interval '1 min' AS t) AS r
    """,
    # SMALL's live locks: job-1, -3 and -5 held, job-2, -4 and -6 expired.
    """
    INSERT INTO helix_holds (organization_id, job_type, holder, token, fencing_token, acquired_at,
                             expires_at)
    SELECT 'small', 'job-' || j, 'w', md5(j::text), 13,
           now() - interval '2 hours', now() + CASE WHEN j % 2 = 1 THEN 1 ELSE -1 END * interval '1 hour'
    FROM generate_series(1, 6) AS j
    """,
    # BUSY: 20,000 live locks and 200,000 ended ones, so that each listing is judged beside
    # another organization's rows as many as its own.
    """
    INSERT INTO helix_lock_history (id, organization_id, job_type, slot, max_holders, holder, token,
                                    fencing_token, acquired_at, expires_at, released_at,
                                    release_reason)
    SELECT nextval('helix_lock_ids'), 'busy', 'job-' || n % 100, 0, 1, 'w', md5(n::text), n / 100 + 1,
           t, t + interval '30 s', t + interval '1 s', 'released'
    FROM generate_series(1, 200000) AS n,
         LATERAL (SELECT now() - interval '1 day' + n * interval '400 ms' + interval '200 ms' AS t) AS r
    """,
    """
    INSERT INTO helix_holds (organization_id, job_type, holder, token, fencing_token, acquired_at,
                             expires_at)
    SELECT 'busy', 'job-' || n, 'w', md5(n::text), 1, now(), now() + interval '1 hour'
    FROM generate_series(1, 20000) AS n
    """,
    "ANALYZE helix_holds, helix_lock_history",
]

ACROSS_ORGANIZATIONS = {queries.LIST_LIVE_ALL_ORGANIZATIONS, queries.LIST_HISTORY_ALL_ORGANIZATIONS}
Sent = list[tuple[str, dict[str, Any]]]


@pytest.fixture(scope="module")
def seeded(server_url: str, template_name: str) -> Iterator[str]:
    """One migrated, seeded database for the module (seeding takes a few seconds)."""
    name = f"helix_listing_{template_name.rsplit('_', 1)[-1]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template_name)
            )
        )
    url = url_for(server_url, name)
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            for statement in SEED:
                conn.execute(statement)
        yield url
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Sent:
    """The listing statements the service sends, with their parameters."""
    statements: Sent = []
    fetch_all = Database.fetch_all

    async def recording(self: Database, query: Any, params: Any) -> Any:
        if query in LISTINGS or query in ACROSS_ORGANIZATIONS:
            statements.append((query, dict(params)))
        return await fetch_all(self, query, params)

    monkeypatch.setattr(Database, "fetch_all", recording)
    return statements


@pytest.fixture
async def service(seeded: str) -> AsyncIterator[tuple[httpx.AsyncClient, str, str]]:
    """The app on the seeded database, with SMALL's key and an admin key."""
    small, admin = keys.create(seeded, SMALL), keys.create(seeded, None)
    app = create_app(ROUTE.settings(seeded, pool_timeout_seconds=1.0))
    async with in_process(app, base_url="http://helix.test") as http:
        yield http, small, admin


async def pages(client: httpx.AsyncClient, key: str, most: int = 1000, **params: Any) -> list[dict[str, Any]]:
    """The locks of a listing's pages in order: all of them, or of its first `most` pages."""
    items: list[dict[str, Any]] = []
    cursor = None
    for _ in range(most):
        query = {k: v for k, v in params.items() if v is not None} | ({"cursor": cursor} if cursor else {})
        response = await client.get("/v1/locks", params=query, headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
        page = response.json()
        items += page["items"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    return items


async def test_an_organizations_listings_read_its_own_range_and_stop_at_limit(
    seeded: str, service: tuple[httpx.AsyncClient, str, str], sent: Sent
) -> None:
    client, small, admin = service
    # SMALL's own key, every kind of listing, page by page (two rows a page: cursors too).
    for state in ("released", "reclaimed", None, "held", "expired"):
        for job_type in (None, "job-1", "nope"):
            await pages(client, small, state=state, job_type=job_type, limit=2)
    await pages(client, small, state="reclaimed", job_type="nope", limit=500)  # as in the issue
    # BIG's own listings (an admin's, naming the organization): two pages of 100 each.
    for state, job_type in (("released", None), ("reclaimed", "job-10"), ("released", "nope")):
        await pages(client, admin, organization_id=BIG, state=state, job_type=job_type, limit=100, most=2)
    assert len(sent) > 40
    assert not {statement for statement, _ in sent} & ACROSS_ORGANIZATIONS
    found = []
    with psycopg.connect(seeded, autocommit=True, prepare_threshold=None) as conn:
        for statement, params in sent:
            for mode in PLAN_MODES:
                root = explain(conn, statement, params, mode)
                found += [
                    f"{what}: {json.dumps(params, default=str)} ({mode}); plan: {json.dumps(root)}"
                    for what in problems(statement, root, mode, params["limit"])
                ]
    assert not found, "\n".join(found)


def test_the_lock_calls_look_rows_up_by_their_indexes(seeded: str) -> None:
    """Every row look-up of acquire, renew, update and release reads its index in the generic plan
    the calls keep (migration 0024), for BUSY's pair (20,000 live locks and 200,000 ended ones) and
    for a pair that the statistics have never seen (whose custom plans read other indexes)."""
    with psycopg.connect(seeded, autocommit=True, prepare_threshold=None) as conn:
        one = "SELECT id FROM {} WHERE organization_id = %s LIMIT 1"
        live = conn.execute(one.format("helix_holds"), (BUSY,)).fetchone()
        ended = conn.execute(one.format("helix_lock_history"), (BUSY,)).fetchone()
        assert live and ended
        found = lookup_problems(conn, BUSY, "job-7", live[0]) + lookup_problems(conn, "new", "new", ended[0])
    assert not found, "\n".join(found)


async def test_listings_answer_as_the_view_does(
    seeded: str, service: tuple[httpx.AsyncClient, str, str]
) -> None:
    """The listings read the table, not helix_job_lock_views: the same locks, in the same order,
    as GET /v1/locks/{id} shows them (ttl_remaining_ms of live locks aside: the clock runs)."""
    client, small, admin = service
    with psycopg.connect(seeded, autocommit=True) as conn:

        def ids(where: str, *args: Any, order: str = "ORDER BY released_at DESC, id DESC") -> list[int]:
            rows = conn.execute(f"SELECT id FROM helix_job_lock_views WHERE {where} {order}", args)
            return [lock_id for (lock_id,) in rows]

        shown: dict[int, dict[str, Any]] = {}
        for lock_id in ids("organization_id = 'small'"):
            response = await client.get(f"/v1/locks/{lock_id}", headers={"Authorization": f"Bearer {small}"})
            assert response.status_code == 200, response.text
            shown[lock_id] = response.json()

        for state in ("released", "reclaimed"):
            for job_type in (None, "job-2", "nope"):
                where = "organization_id = 'small' AND state = %s AND (%s::text IS NULL OR job_type = %s)"
                expected = [shown[lock_id] for lock_id in ids(where, state, job_type, job_type)]
                assert await pages(client, small, state=state, job_type=job_type, limit=3) == expected
        for live_state in (None, "held", "expired"):
            for job_type in (None, "job-2", "job-3"):
                where = (
                    "organization_id = 'small' AND released_at IS NULL AND (%s::text IS NULL OR state = %s)"
                    " AND (%s::text IS NULL OR job_type = %s)"
                )
                found = ids(where, live_state, live_state, job_type, job_type, order="ORDER BY job_type")
                listed = await pages(client, small, state=live_state, job_type=job_type, limit=2)
                assert [lock["id"] for lock in listed] == found
                for lock in listed:
                    want = dict(shown[lock["id"]])
                    assert abs(lock.pop("ttl_remaining_ms") - want.pop("ttl_remaining_ms")) < 60_000
                    assert lock == want

        # An admin's, across organizations: the first three pages, in the view's order.
        listing: str | None
        for listing in ("reclaimed", "released", None):
            if listing is None:
                expected_ids = ids("released_at IS NULL", order="ORDER BY organization_id, job_type LIMIT 9")
            else:
                expected_ids = ids("state = %s", listing, order="ORDER BY released_at DESC, id DESC LIMIT 9")
            listed = await pages(client, admin, state=listing, limit=3, most=3)
            assert [lock["id"] for lock in listed] == expected_ids, listing
