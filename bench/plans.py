"""Plan checks on the seeded database: the row look-ups of acquire and release, and the listings
of one organization (judged as tests/api/test_listing_plans.py judges them: harness/plans.py)."""

from __future__ import annotations

import itertools
from typing import Any

import psycopg

from harness import plans

# A seeded pair (organization k % 100, job type k) and one of the bench's own, for the look-ups.
SAMPLES = (("seed-org-1", "seed-job-1"), ("bench", "bench-job"))


def check_plans(url: str) -> str:
    """EXPLAIN the lock calls' row look-ups (harness/plans.py LOOKUPS) on the seeded tables, in the
    generic plans the calls keep."""
    bad: list[str] = []
    with psycopg.connect(url, autocommit=True, prepare_threshold=None) as conn:
        for organization_id, job_type in SAMPLES:
            bad += plans.lookup_problems(conn, organization_id, job_type, 1)
    if bad:
        return "plan check: WARNING, not by the expected index: " + "; ".join(bad)
    return (
        f"plan check: OK, the {len(plans.LOOKUPS)} row look-ups of the lock calls use their indexes "
        "on the seeded tables (generic plans, as the calls keep them)"
    )


def check_listing_plans(url: str) -> str:
    """EXPLAIN the listings of one organization on the seeded tables, custom and generic plans:
    each must be an index scan of one range within the organization that stops at LIMIT (no Sort
    of every match, no other organization's rows), with or without job type and cursor, of every
    state, for seeded organizations (a hundredth of the history each) and the bench's (none).
    The plans are judged by their shape, as tests/api/test_listing_plans.py judges them."""
    bad: list[str] = []
    checked = 0
    # With 100 organizations and a key in ten reclaimed, seed-org-1's history is all released,
    # seed-org-10's all reclaimed.
    organizations = ("seed-org-1", "seed-org-10", "bench")
    states = {True: (None, "held", "expired"), False: ("released", "reclaimed")}
    with psycopg.connect(url, autocommit=True, prepare_threshold=None) as conn:
        # Each organization's cursors: a key and a history row of its own (of seed-org-1's for
        # "bench", which has none), some way down.
        cursors: dict[str, tuple[Any, ...]] = {}
        for org in organizations:
            found = conn.execute(
                "SELECT job_type, released_at, id FROM helix_lock_history"
                " WHERE organization_id = %s"
                " ORDER BY released_at DESC, id DESC LIMIT 1 OFFSET 20",
                (org,),
            ).fetchone()
            cursors[org] = found or cursors.get("seed-org-1", ("seed-job-1", None, None))
        for statement in plans.LISTINGS:
            names = plans.parameters(statement)
            live, of_job_type = "after_job_type" in names, "job_type" in names
            for org, state, cursor, mode in itertools.product(
                organizations, states[live], (False, True), plans.PLAN_MODES
            ):
                job_type, released_at, lock_id = cursors[org]
                params: dict[str, Any] = {
                    "organization_id": org,
                    "job_type": job_type,
                    "state": state,
                    # A page of 50: fewer than a seeded organization's live locks (100), so the
                    # plan to expect reads in order and stops; fewer rows than a page are read
                    # whole and sorted, as cheap as any order.
                    "limit": 51,
                    "after_organization_id": org if cursor else None,
                    "after_job_type": job_type if cursor else None,
                    "after_slot": 0 if cursor else None,
                    "after_released_at": released_at if cursor else None,
                    "after_id": lock_id if cursor else None,
                }
                root = plans.explain(conn, statement, params, mode)
                checked += 1
                if wrong := plans.problems(statement, root, mode, limit=None):
                    kind = ("live locks" if live else "history") + (" of a job type" if of_job_type else "")
                    where = f"{kind} of {org}, state {state}, cursor {cursor} ({mode})"
                    bad.append(f"{where}: {', '.join(wrong)}: {plans.outline(root['Plan'])}")
    if bad:
        return "listing plan check: WARNING, not one ordered index range: " + "; ".join(bad)
    return (
        f"listing plan check: OK, {checked} plans of organizations' listings (history and live, with"
        " and without job type and cursor, custom and generic) read one range of an index in order"
    )
