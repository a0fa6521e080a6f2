"""What the event reader's question "has any lease run out unannounced?" costs with and without an
index on expires_at (docs/data-model.md, "Announcing expiries"): a prototype measurement for the
lean model's open trade-off, not a benchmark of the service.

    python -m bench.prototypes.due [--live 10000,100000] [--history 200000] [--runs 200]

(from the repository root; DATABASE_URL's server, else an embedded PostgreSQL). For each number
of live locks, on a database migrated and seeded as bench.ceiling's: the reader's due check (the
`due` column of queries.EVENTS) and the announcer's scan (helix_announce_expiries' CTE, nothing
due), each run --runs times, timed in the server (EXPLAIN ANALYZE's execution time, median):

1. today's schema, with the index `helix_job_locks_unannounced_expiry`;
2. today's schema without it (the planner's best other path);
3. the lean model's compact table of live holds alone (a copy of the live rows), without it.

One process's reader asks once per poll (HELIX_LOCKS_EVENTS_POLL_MS, 50 ms: 20 times a second)
while it has watchers; the report gives the share of one core that costs.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import psycopg

from bench import load_average, log
from bench.database import bench_database, other_database, seed
from helix_locks.server.migrate import migrate

DUE = """
SELECT coalesce((SELECT min(d.expires_at) FROM {table} AS d
                 WHERE d.released_at IS NULL AND d.expired_xid IS NULL) <= clock_timestamp(), false)
"""
ANNOUNCER = """
SELECT l.id FROM {table} AS l
WHERE l.released_at IS NULL AND l.expired_xid IS NULL AND l.expires_at <= now()
ORDER BY l.expires_at LIMIT 1000
"""
# now(), not clock_timestamp(): a volatile call cannot bound an index scan (the function itself
# passes a value read once, for the same reason).
POLLS_PER_SECOND = 20


def server_ms(conn: psycopg.Connection[tuple[object, ...]], query: str, runs: int) -> float:
    """The median execution time the server reports for `query`, over `runs` runs."""
    times = []
    for _ in range(runs):
        plan = "\n".join(str(row[0]) for row in conn.execute(f"EXPLAIN (ANALYZE, TIMING OFF) {query}"))
        found = re.search(r"Execution Time: ([0-9.]+) ms", plan)
        assert found, plan
        times.append(float(found.group(1)))
    return statistics.median(times)


def measure(url: str, runs: int) -> list[tuple[str, float, float]]:
    """(case, due check ms, announcer scan ms) for the three cases."""
    results = []
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE lean_holds AS SELECT * FROM helix_job_locks WHERE released_at IS NULL")
        conn.execute("VACUUM (ANALYZE)")
        for case, table in (
            ("today's table, with the index", "helix_job_locks"),
            ("today's table, without it", "helix_job_locks"),
            ("live holds alone, no index", "lean_holds"),
        ):
            if case == "today's table, without it":
                conn.execute("DROP INDEX helix_job_locks_unannounced_expiry")
                conn.execute("ANALYZE helix_job_locks")
            due = server_ms(conn, DUE.format(table=table), runs)
            announcer = server_ms(conn, ANNOUNCER.format(table=table), runs)
            results.append((case, due, announcer))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prototypes.due", description=__doc__)
    parser.add_argument("--live", default="10000,100000", help="live locks, comma-separated")
    parser.add_argument("--history", type=int, default=200_000, help="ended locks seeded")
    parser.add_argument("--runs", type=int, default=200, help="runs of each query")
    args = parser.parse_args(argv)
    lines = [
        "The reader's due check and the announcer's scan, server time per run (median of"
        f" {args.runs}); one reader asks {POLLS_PER_SECOND} times a second",
        f"  {load_average()}",
        "",
        "| live locks | case | due check ms | announcer scan ms | share of a core, due check at"
        f" {POLLS_PER_SECOND}/s |",
        "| --- | --- | --- | --- | --- |",
    ]
    with ExitStack() as cleanup:
        workdir = Path(tempfile.mkdtemp(prefix="helix-bench-due-"))
        cleanup.callback(shutil.rmtree, workdir, ignore_errors=True)
        url, where = cleanup.enter_context(bench_database(workdir))
        lines.insert(2, f"  database: {where}")
        for n, live in enumerate(int(value) for value in args.live.split(",")):
            db = other_database(url, f"due_{n}", cleanup)
            migrate(db)
            log(f"{live:,} live locks: {seed(db, args.history, live)}")
            for case, due, announcer in measure(db, args.runs):
                share = due * POLLS_PER_SECOND / 1000
                lines.append(f"| {live:,} | {case} | {due:.3f} | {announcer:.3f} | {share:.1%} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
