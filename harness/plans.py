"""How an organization's listings must be planned, judged by EXPLAIN: one Index Scan of one range
of the listing's index, in order, stopping at LIMIT. tests/api/test_listing_plans.py judges the
statements the service sends; the bench (bench/plans.py) judges them on its seeded database."""

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
}

Conn = psycopg.Connection[Any]
PLAN_MODES = ("force_custom_plan", "force_generic_plan")


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
