"""How the lock calls' statements must be planned, judged by EXPLAIN: each row look-up of a lock
call by its index (LOOKUPS), and an organization's listings as one Index Scan of one range of the
listing's index, in order, stopping at LIMIT. tests/api/test_listing_plans.py judges them beside
other organizations' rows; the bench (bench/plans.py) judges them on its seeded database."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import sql

from helix_locks.server import queries

# The listings of one organization, as service/helix_locks/server/locks.py sends them, and the index
# whose one range each must read in order, up to LIMIT.
LISTINGS = {
    queries.LIST_LIVE: "helix_holds_pkey",
    queries.LIST_LIVE_OF_JOB_TYPE: "helix_holds_pkey",
    queries.LIST_HISTORY: "helix_lock_history_by_organization",
    queries.LIST_HISTORY_OF_JOB_TYPE: "helix_lock_history_by_job_type",
}

# The types psycopg gives the parameters (a None is sent untyped; the statement casts it).
TYPES = {
    "organization_id": "text",
    "job_type": "text",
    "state": "text",
    "limit": "bigint",
    "after_organization_id": "text",
    "after_job_type": "text",
    "after_slot": "integer",
    "after_released_at": "timestamptz",
    "after_id": "bigint",
    "id": "bigint",
    "ids": "bigint[]",
    "slot": "integer",
    "token": "text",
    "holder": "text",
    "idempotency_key": "text",
}

Conn = psycopg.Connection[Any]
PLAN_MODES = ("force_custom_plan", "force_generic_plan")

# The row look-ups of the lock calls (migrations/schema.sql), as PL/pgSQL prepares them, with the
# index each must use in the generic plan, the one the calls keep (migration 0024). (Custom plans,
# made for the values at hand, may take another index for an organization the statistics do not
# know: its range of helix_holds_pkey, say, for a lock's id.)
# (what, statement, its parameters' names (types in TYPES), the index.)
LOOKUPS = [
    (
        "acquire: the pair's fencing counter",
        "UPDATE helix_lock_keys AS k SET last_fencing_token = k.last_fencing_token + 1"
        " WHERE k.organization_id = $1 AND k.job_type = $2 RETURNING k.last_fencing_token",
        ("organization_id", "job_type"),
        "helix_lock_keys_pkey",
    ),
    (
        "acquire: an idempotent repeat's live grant",
        "SELECT FROM helix_holds AS h WHERE h.organization_id = $1 AND h.job_type = $2"
        " AND h.idempotency_key = $3 AND h.holder = $4 AND h.expires_at > clock_timestamp()",
        ("organization_id", "job_type", "idempotency_key", "holder"),
        "helix_holds_pkey",
    ),
    (
        "acquire: the pair's live locks FOR UPDATE",
        "SELECT * FROM helix_holds AS h WHERE h.organization_id = $1 AND h.job_type = $2"
        " ORDER BY h.slot FOR UPDATE",
        ("organization_id", "job_type"),
        "helix_holds_pkey",
    ),
    (
        "acquire: the leases that lapsed, announced",
        "UPDATE helix_holds AS h SET expired_xid = pg_current_xact_id()"
        " WHERE h.organization_id = $1 AND h.job_type = $2 AND h.id = ANY ($3)",
        ("organization_id", "job_type", "ids"),
        "helix_holds_pkey",
    ),
    (
        "acquire/release: end locks (helix_end_holds; a release gives the token and organization)",
        "DELETE FROM helix_holds AS h WHERE h.id = ANY ($1)"
        " AND ($2::text IS NULL OR h.organization_id = $2)"
        " AND ($3::text IS NULL OR helix_digest(h.token) = helix_digest($3)) RETURNING h.*",
        ("ids", "organization_id", "token"),
        "helix_holds_id",
    ),
    (
        "acquire, renew, update: the answer row",
        "SELECT * FROM helix_held_locks AS v JOIN helix_holds AS h ON h.id = v.id WHERE v.id = $1",
        ("id",),
        "helix_holds_id",
    ),
    (
        "renew, update, a release whose token was not the hold's: the lock, row-locked",
        "SELECT * FROM helix_holds AS h WHERE h.id = $1"
        " AND ($2::text IS NULL OR h.organization_id = $2) FOR UPDATE",
        ("id", "organization_id"),
        "helix_holds_id",
    ),
    (
        "renew, update: the hold, updated in place",
        "UPDATE helix_holds AS h SET expires_at = clock_timestamp()"
        " WHERE h.organization_id = $1 AND h.job_type = $2 AND h.slot = $3",
        ("organization_id", "job_type", "slot"),
        "helix_holds_pkey",
    ),
    (
        "release: the answer row",
        "SELECT * FROM helix_ended_locks AS v WHERE v.id = $1",
        ("id",),
        "helix_lock_history_pkey",
    ),
    (
        "a call on an ended lock: its end (helix_raise_ended)",
        "SELECT * FROM helix_lock_history AS e WHERE e.id = $1"
        " AND ($2::text IS NULL OR e.organization_id = $2)",
        ("id", "organization_id"),
        "helix_lock_history_pkey",
    ),
    (
        "events: the locks' every column, joined by id (helix_job_locks, a session's lease included: 0028)",
        "SELECT k.reclaimed_lock_id, k.forced_by, k.expires_at, k.lapses"
        " FROM unnest($2::bigint[]) AS e (id) JOIN helix_job_locks AS k ON k.id = e.id"
        " WHERE k.organization_id = $1",
        ("organization_id", "ids"),
        "helix_holds_id",
    ),
    (
        "a session's call: its locks (helix_session_answer)",
        "SELECT h.id FROM helix_sessions AS s"
        " LEFT JOIN helix_holds AS h ON h.organization_id = s.organization_id AND h.session_id = s.id"
        " WHERE s.id = $1 AND ($2::text IS NULL OR s.organization_id = $2)",
        ("id", "organization_id"),
        "helix_holds_session",
    ),
    (
        "an end: anyone waiting for the pair (helix_lock_released)",
        "SELECT 1 FROM helix_lock_waiters AS w WHERE w.organization_id = $1 AND w.job_type = $2"
        " AND w.until > clock_timestamp()",
        ("organization_id", "job_type"),
        "helix_lock_waiters_queue",
    ),
]


def parameters(statement: str) -> list[str]:
    """The names of a statement's %(name)s parameters, in order of first use."""
    return list(dict.fromkeys(re.findall(r"%\((\w+)\)s", statement)))


def explain(conn: Conn, statement: str, params: dict[str, Any], mode: str) -> dict[str, Any]:
    """EXPLAIN ANALYZE of the statement, prepared as the service's are, in a plan mode: SQL's
    PREPARE and EXECUTE, since an EXPLAIN sent with parameters is always planned for their values.
    `conn`: autocommit, with prepare_threshold=None (this deallocates every prepared statement)."""
    names = parameters(statement)
    body = re.sub(r"%\((\w+)\)s", lambda match: f"${names.index(match[1]) + 1}", statement)
    conn.execute("DEALLOCATE ALL")
    conn.execute(f"PREPARE listing ({', '.join(TYPES[name] for name in names)}) AS {body}")
    conn.execute(sql.SQL("SET plan_cache_mode = {}").format(sql.Literal(mode)))
    values = sql.SQL(", ").join(sql.Literal(params[name]) for name in names)
    row = conn.execute(
        sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE listing ({})").format(values)
    ).fetchone()
    assert row is not None
    root: dict[str, Any] = row[0][0]
    return root


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def problems(statement: str, root: dict[str, Any], mode: str, limit: int | None) -> list[str]:
    """What is wrong with the plan (EXPLAIN's root) of an organization's listing; [] when nothing is.

    Its shape: generic when asked to be, one Index Scan of the listing's index, no Seq Scan, no Sort.
    With the page's `limit`, also what EXPLAIN ANALYZE counted: no rows read past LIMIT, none
    filtered out, a few buffers a row. (The bench leaves the counts out: its seeded live locks are
    all held, so a listing of expired ones filters out every one it reads.)"""
    everything = list(nodes(root["Plan"]))
    scans = [n for n in everything if n.get("Index Name") == LISTINGS[statement]]
    found = []
    if mode == "force_generic_plan" and "$1" not in json.dumps(root):
        found.append("not a generic plan")
    if any("Seq Scan" in n["Node Type"] for n in everything):
        found.append("a Seq Scan")
    if [n["Node Type"] for n in scans] != ["Index Scan"]:
        found.append(f"not one Index Scan of {LISTINGS[statement]}")
    if any(n["Node Type"] in ("Sort", "Incremental Sort") for n in everything):
        found.append("a Sort: every matching row was read")
    if limit is None:
        return found
    removed = sum(n.get("Rows Removed by Filter", 0) for n in everything)
    buffers = root["Plan"].get("Shared Hit Blocks", 0) + root["Plan"].get("Shared Read Blocks", 0)
    if any(n["Actual Rows"] > limit + 5 for n in scans):
        found.append("the index scan went on past LIMIT")
    if removed > 5:
        found.append(f"{removed} rows removed by filters")
    if buffers > 3 * limit + 20:
        found.append(f"{buffers} buffers for at most {limit} rows")
    return found


def outline(plan: dict[str, Any]) -> str:
    """A plan in one line: each node's type, with the index it reads."""
    return " / ".join(
        n["Node Type"] + (f" using {n['Index Name']}" if "Index Name" in n else "") for n in nodes(plan)
    )


def lookup_problems(conn: Conn, organization_id: str, job_type: str, lock_id: int) -> list[str]:
    """What is wrong with the generic plans of LOOKUPS for a pair and a lock id: each must read its
    index and no table whole. Plain EXPLAIN: nothing is run. `conn`: autocommit, with
    prepare_threshold=None."""
    params = {
        "organization_id": organization_id,
        "job_type": job_type,
        "id": lock_id,
        "ids": [lock_id],
        "slot": 0,
        "token": "t",
        "holder": "w",
        "idempotency_key": "k",
    }
    found = []
    conn.execute("SET plan_cache_mode = force_generic_plan")
    for what, statement, names, index in LOOKUPS:
        conn.execute("DEALLOCATE ALL")
        conn.execute(f"PREPARE lookup ({', '.join(TYPES[name] for name in names)}) AS {statement}")
        values = sql.SQL(", ").join(sql.Literal(params[name]) for name in names)
        row = conn.execute(sql.SQL("EXPLAIN (FORMAT JSON) EXECUTE lookup ({})").format(values)).fetchone()
        assert row is not None
        root = row[0][0]
        everything = list(nodes(root["Plan"]))
        if "$1" not in json.dumps(root):
            found.append(f"{what}: not a generic plan: {outline(root['Plan'])}")
        if any("Seq Scan" in n["Node Type"] for n in everything):
            found.append(f"{what}: a Seq Scan: {outline(root['Plan'])}")
        elif not any(n.get("Index Name") == index for n in everything):
            found.append(f"{what}: not by {index}: {outline(root['Plan'])}")
    conn.execute("RESET plan_cache_mode")
    return found
