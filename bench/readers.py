"""Benchmark: what a reader's lock costs the database as its pair's readers grow (issue 40).

    python -m bench.readers            # 200 cycles at each count of readers held
    python -m bench.readers --held 0,10,100,990 --cycles 500

(from the repository root; DATABASE_URL's server in a throwaway database, else an embedded
PostgreSQL). On one connection, straight in SQL: with N other readers holding one pair, a reader's
acquire and release (helix_acquire_job_lock, helix_release_job_lock), its WAL bytes
(pg_current_wal_lsn) and cycles/s; and a plain exclusive lock's cycle for comparison. A grant locks
every lock of its pair (FOR UPDATE: it waits out a renewal or end in flight), each a WAL record.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psycopg

from bench import load_average
from bench.database import bench_database
from helix_locks.server.migrate import migrate

ACQUIRE = (
    "SELECT id, token FROM helix_acquire_job_lock('bench', %s, 'reader', 600000, NULL, NULL, 1, NULL, %s)"
)
RELEASE = "SELECT 1 FROM helix_release_job_lock(%s, %s, 'bench')"


def cycles(
    conn: psycopg.Connection[tuple[object, ...]], job_type: str, mode: str, count: int
) -> tuple[float, float]:
    """WAL bytes a cycle and cycles/s of `count` acquire+release cycles."""
    before = conn.execute("SELECT pg_current_wal_lsn()").fetchone()
    assert before is not None
    started = time.perf_counter()
    for _ in range(count):
        granted = conn.execute(ACQUIRE, (job_type, mode)).fetchone()
        assert granted is not None
        conn.execute(RELEASE, granted)
    took = time.perf_counter() - started
    wal = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", before).fetchone()
    assert wal is not None
    return float(wal[0]) / count, count / took  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.readers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--held", default="0,10,100,990", help="readers held beside, comma-separated")
    parser.add_argument("--cycles", type=int, default=200, help="measured cycles at each count (default 200)")
    args = parser.parse_args(argv)
    held = [int(n) for n in args.held.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="helix-bench-readers-"))
    lines = [f"A reader's cycle beside N readers of its pair, {args.cycles} cycles each, one connection"]
    try:
        with bench_database(workdir) as (url, where), psycopg.connect(url, autocommit=True) as conn:
            migrate(url)
            version = conn.execute("SHOW server_version").fetchone()
            lines.append(f"  {load_average()}; {where}, PostgreSQL {version and version[0]}")
            for n in held:
                job_type = f"pair-{n}"
                for _ in range(n):
                    conn.execute(ACQUIRE, (job_type, "shared"))
                cycles(conn, job_type, "shared", 20)  # warm-up
                wal, rate = cycles(conn, job_type, "shared", args.cycles)
                lines.append(f"  readers held {n:>4}: {wal:>8,.0f} WAL bytes a cycle, {rate:>6,.0f} cycles/s")
            cycles(conn, "plain", "exclusive", 20)
            wal, rate = cycles(conn, "plain", "exclusive", args.cycles)
            lines.append(f"  a plain exclusive lock: {wal:>4,.0f} WAL bytes a cycle, {rate:>6,.0f} cycles/s")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
