"""Benchmark: the ceiling of one PostgreSQL primary (issue 25), with no HTTP in between.

    python -m bench.ceiling            # 1 to 64 clients, 3 s warm-up + 10 s per level and call
    python -m bench.ceiling --quick    # smoke run: 1, 8 and 32 clients, 1 s + 3 s

(from the repository root). pgbench drives the real functions, prepared, each call its own
transaction as the service sends it (autocommit), at each level of clients, each client on a key of
its own in organization "bench":

1. the cycle: `helix_acquire_job_lock` then `helix_release_job_lock`, with the organization, as an
   organization's API key sends them;
2. the renewal alone: `helix_renew_job_lock` of a lock each client holds (acquired beforehand, with
   a lease of a day so that none lapses).

For each, around the measured window only: the WAL written (pg_current_wal_lsn() before and after;
records, full-page images and bytes from pg_stat_wal on PostgreSQL 14 and later), and the commits of
the bench's database (pg_stat_database.xact_commit), each divided by the calls pgbench counted; and
the machine's busy CPU time per call, pgbench's own left out. WAL and CPU are the whole server's and
machine's: on a server or machine that others use meanwhile (a CI run), they count theirs too.
Nothing trades durability: the run says synchronous_commit, fsync and full_page_writes as it found
them, and changes none.

From the best cycles/s and renewals/s it derives what one primary carries: how many service
replicas it feeds at --replica-cycles each (docs/performance.md: `serve --workers 2` on 2 cores),
and, for the lease pattern of a job (acquire, a renewal every ttl/3, release), how many jobs per
second and how many workers busy at once.

The database is bench/database.py's: a throwaway database on DATABASE_URL's server, or an embedded
PostgreSQL; seeded with history and live locks of other organizations, as bench/run.py seeds it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import psycopg

from bench import BenchError, interrupted, load_average, log, said_and_stopped, tool_output
from bench.database import bench_database, seed
from bench.pgbench import pgbench_path
from bench.results import CPUS, busy_cores, busy_cpu_ticks
from helix_locks.server.migrate import migrate

ORGANIZATION = "bench"
LEVELS = (1, 2, 4, 8, 16, 32, 64)
QUICK_LEVELS = (1, 8, 32)
# A day, the longest lease there is: no renewal lock lapses between levels.
RENEW_TTL_MS = 86_400_000

# One pgbench transaction: one cycle, two statements, each committed on its own.
CYCLE_SCRIPT = f"""\
SELECT id, token
  FROM helix_acquire_job_lock('{ORGANIZATION}', 'ceiling-' || :client_id, 'pgbench', 30000, NULL, NULL) \\gset
SELECT 1 FROM helix_release_job_lock(:id, :token, '{ORGANIZATION}');
"""
# One pgbench transaction: one renewal of the client's own lock; ids are first_id + client_id
# (hold_renewal_locks checks it), tokens are set by the bench.
RENEW_SCRIPT = f"""\
\\set id :first_id + :client_id
SELECT 1 FROM helix_renew_job_lock(:id, 'ceiling-renew-' || :client_id, {RENEW_TTL_MS}, '{ORGANIZATION}');
"""

# Jobs of a lease pattern: (duration in seconds, ttl in seconds).
JOBS = ((10, 30), (60, 30), (600, 60), (3600, 300))

_WAL = """
SELECT pg_current_wal_lsn()::text AS lsn,
       (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()) AS commits,
       (SELECT xact_rollback FROM pg_stat_database WHERE datname = current_database()) AS rollbacks
"""
_STAT_WAL = "SELECT wal_records, wal_fpi FROM pg_stat_wal"


@dataclass(frozen=True)
class Counters:
    lsn: str
    commits: int
    rollbacks: int
    records: int | None  # pg_stat_wal, PostgreSQL 14 and later
    fpi: int | None


@dataclass(frozen=True)
class Measured:
    """One pgbench run of one script at one level: calls (cycles or renewals) and what they cost."""

    clients: int
    calls: int
    per_second: float
    latency_ms: float  # pgbench's average, per transaction
    failed: int
    commits: float  # per call
    rollbacks: float
    wal_bytes: float  # per call, from the LSN
    wal_records: float | None
    wal_fpi: float | None
    busy_cores: float  # machine-wide
    pgbench_cores: float

    @property
    def cpu_ms(self) -> float:
        """The machine's busy CPU time per call, pgbench's own left out: PostgreSQL's, on a machine
        that runs nothing else."""
        return (self.busy_cores - self.pgbench_cores) / self.per_second * 1000


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ceiling",
        description="The ceiling of one PostgreSQL primary: acquire+release cycles/s and renewals/s with"
        " pgbench, WAL and commits per call, and what that carries in replicas, jobs/s and workers.",
    )
    parser.add_argument("--quick", action="store_true", help="1, 8 and 32 clients, 1 s warm-up + 3 s")
    parser.add_argument("--clients", help="levels, comma-separated (default: 1,2,4,8,16,32,64)")
    parser.add_argument("--duration", type=int, help="seconds measured per level and call (default: 10)")
    parser.add_argument("--warmup", type=int, help="seconds of warm-up per level and call (default: 3)")
    parser.add_argument("--history", type=int, help="ended locks seeded (default: 200000; quick: 20000)")
    parser.add_argument("--live", type=int, default=10_000, help="live locks seeded (default: 10000)")
    parser.add_argument(
        "--replica-cycles",
        type=float,
        default=1032.0,
        help="cycles/s one service replica serves (default: 1032, docs/performance.md: serve --workers 2"
        " on 2 cores, 32 clients)",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    try:
        levels = [int(value) for value in args.clients.split(",")] if args.clients else None
    except ValueError:
        parser.error("--clients: comma-separated numbers")
    args.levels = levels or list(QUICK_LEVELS if quick else LEVELS)
    args.duration = args.duration or (3 if quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
    args.history = args.history if args.history is not None else (20_000 if quick else 200_000)
    if min([args.duration, *args.levels]) < 1 or args.warmup < 0 or args.replica_cycles <= 0:
        parser.error("--duration and --clients must be >= 1, --warmup >= 0, --replica-cycles > 0")
    return args


def counters(conn: psycopg.Connection[tuple[object, ...]], stat_wal: bool) -> Counters:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(_WAL).fetchone()
    assert row is not None
    records = fpi = None
    if stat_wal:
        wal = conn.execute(_STAT_WAL).fetchone()
        assert wal is not None
        records, fpi = int(str(wal[0])), int(str(wal[1]))
    return Counters(str(row[0]), int(str(row[1])), int(str(row[2])), records, fpi)


def wal_between(conn: psycopg.Connection[tuple[object, ...]], before: str, after: str) -> int:
    row = conn.execute("SELECT pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)", (after, before)).fetchone()
    assert row is not None
    return int(str(row[0]))


def wait_for_stats(conn: psycopg.Connection[tuple[object, ...]], commits_at_least: int) -> None:
    """pgbench's backends report their commits as they exit: wait (a few seconds at most) until the
    database's count has them."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        if row is not None and int(str(row[0])) >= commits_at_least:
            return
        time.sleep(0.1)


def run_script(
    url: str,
    conn: psycopg.Connection[tuple[object, ...]],
    script: Path,
    clients: int,
    args: argparse.Namespace,
) -> Measured:
    stat_wal = args.stat_wal
    command = [str(pgbench_path()), "-n", "-M", "prepared", "-f", str(script)]
    command += ["-c", str(clients), "-j", str(min(clients, CPUS)), "-D", f"first_id={args.first_id}"]
    if args.warmup > 0:
        tool_output([*command, "-T", str(args.warmup), url])
    before = counters(conn, stat_wal)
    ticks = busy_cpu_ticks()
    children = os.times()
    output = tool_output([*command, "-T", str(args.duration), url])
    children_after = os.times()
    ticks_after = busy_cpu_ticks()

    found = {
        name: re.search(pattern, output, re.MULTILINE)
        for name, pattern in {
            "calls": r"^number of transactions actually processed: (\d+)",
            "tps": r"^tps = ([0-9.]+)",
            "latency": r"^latency average = ([0-9.]+) ms",
            "failed": r"^number of failed transactions: (\d+)",
        }.items()
    }
    calls_found, tps, latency = found["calls"], found["tps"], found["latency"]
    if calls_found is None or tps is None or latency is None:
        raise BenchError(f"pgbench's output lacks what the bench reads:\n{output}")
    calls = int(calls_found.group(1))
    if calls == 0:
        raise BenchError(f"pgbench completed no transaction:\n{output}")
    # Every statement of a transaction is a commit of its own: two for a cycle, one for a renewal.
    statements = sum(1 for line in script.read_text().splitlines() if line.startswith("SELECT"))
    wait_for_stats(conn, before.commits + calls * statements)
    after = counters(conn, stat_wal)

    def per_call(first: int | None, last: int | None) -> float | None:
        return None if first is None or last is None else (last - first) / calls

    load = (children_after.children_user - children.children_user) + (
        children_after.children_system - children.children_system
    )
    failed = found["failed"]
    return Measured(
        clients=clients,
        calls=calls,
        per_second=float(tps.group(1)),
        latency_ms=float(latency.group(1)),
        failed=int(failed.group(1)) if failed else 0,
        commits=(after.commits - before.commits) / calls,
        rollbacks=(after.rollbacks - before.rollbacks) / calls,
        wal_bytes=wal_between(conn, before.lsn, after.lsn) / calls,
        wal_records=per_call(before.records, after.records),
        wal_fpi=per_call(before.fpi, after.fpi),
        busy_cores=busy_cores(ticks, ticks_after),
        pgbench_cores=load / args.duration,
    )


def hold_renewal_locks(conn: psycopg.Connection[tuple[object, ...]], clients: int) -> int:
    """One lock for each pgbench client (client_id 0 to clients - 1) with a known token; the first
    lock's id: the others follow it one by one."""
    ids = []
    for client in range(clients):
        row = conn.execute(
            "SELECT id FROM helix_acquire_job_lock(%s, %s, 'pgbench', %s, NULL, NULL)",
            (ORGANIZATION, f"ceiling-renew-{client}", RENEW_TTL_MS),
        ).fetchone()
        assert row is not None
        ids.append(int(str(row[0])))
        conn.execute(
            "UPDATE helix_job_locks SET token = %s WHERE id = %s", (f"ceiling-renew-{client}", ids[-1])
        )
    if ids != list(range(ids[0], ids[0] + clients)):
        raise BenchError("the renewal locks' ids are not consecutive: something else acquires meanwhile")
    return ids[0]


def server_settings(conn: psycopg.Connection[tuple[object, ...]]) -> dict[str, str]:
    names = ["server_version", "synchronous_commit", "fsync", "full_page_writes", "wal_level"]
    names += ["max_wal_size", "checkpoint_timeout", "shared_buffers"]
    return {name: str(conn.execute(f"SHOW {name}").fetchone()[0]) for name in names}  # type: ignore[index]


def measure(args: argparse.Namespace, url: str, workdir: Path) -> tuple[list[Measured], list[Measured]]:
    cycle_script, renew_script = workdir / "cycle.sql", workdir / "renew.sql"
    cycle_script.write_text(CYCLE_SCRIPT)
    renew_script.write_text(RENEW_SCRIPT)
    cycles: list[Measured] = []
    renewals: list[Measured] = []
    with psycopg.connect(url, autocommit=True) as conn:
        has_stat_wal = "SELECT to_regclass('pg_catalog.pg_stat_wal') IS NOT NULL"
        args.stat_wal = conn.execute(has_stat_wal).fetchone() == (True,)
        args.first_id = hold_renewal_locks(conn, max(args.levels))
        conn.execute("VACUUM (ANALYZE) helix_job_locks, helix_lock_keys")
        for clients in args.levels:
            for script, into, name in (
                (cycle_script, cycles, "cycles"),
                (renew_script, renewals, "renewals"),
            ):
                log(f"{clients} client(s), {name}: {args.warmup} s warm-up + {args.duration} s ...")
                result = run_script(url, conn, script, clients, args)
                into.append(result)
                log(f"  {result.per_second:,.0f} {name}/s, {result.wal_bytes:,.0f} WAL bytes each")
    return cycles, renewals


def _opt(value: float | None, form: Callable[[float], str]) -> str:
    return "-" if value is None else form(value)


def table(title: str, rows: list[Measured], unit: str) -> list[str]:
    lines = [
        title,
        "",
        f"| clients | {unit}/s | latency avg ms | commits / call | WAL bytes / call | WAL records / call"
        " | full-page images / call | busy cores (pgbench's) | CPU ms / call, but pgbench's | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in rows:
        lines.append(
            f"| {m.clients} | {m.per_second:,.0f} | {m.latency_ms:.2f} | {m.commits:.2f} | {m.wal_bytes:,.0f}"
            f" | {_opt(m.wal_records, lambda v: f'{v:.1f}')} | {_opt(m.wal_fpi, lambda v: f'{v:.2f}')}"
            f" | {m.busy_cores:.2f} ({m.pgbench_cores:.2f}) | {m.cpu_ms:.3f} | {m.failed} |"
        )
    return lines


def lease_jobs(best_cycle: float, best_renew: float) -> list[str]:
    """Jobs/s and workers busy at once that one primary carries, for each (duration, ttl) of JOBS:
    a job costs one cycle and 3·D/T renewals of the primary's time, at the best rates measured."""
    lines = [
        "| job duration D | ttl T | renewals per job (3 * D / T) | statements per job | jobs/s"
        " | workers busy at once (jobs/s * D) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for duration, ttl in JOBS:
        renewals = 3 * duration / ttl
        seconds_per_job = 1 / best_cycle + renewals / best_renew
        jobs = 1 / seconds_per_job
        lines.append(
            f"| {duration:,} s | {ttl} s | {renewals:g} | {2 + renewals:g} | {jobs:,.0f}"
            f" | {jobs * duration:,.0f} |"
        )
    return lines


def report(
    args: argparse.Namespace, setup: list[str], cycles: list[Measured], renewals: list[Measured]
) -> str:
    best_cycle = max(cycles, key=lambda m: m.per_second)
    best_renew = max(renewals, key=lambda m: m.per_second)
    lines = [
        f"The ceiling of one primary: pgbench, {args.warmup} s warm-up + {args.duration} s per level and"
        f" call; {CPUS} CPUs shared by pgbench and PostgreSQL",
        *(f"  {line}" for line in setup),
        "",
        *table("1. acquire + release, each client on a key of its own (a call: a cycle):", cycles, "cycles"),
        "",
        *table("2. renewal alone, each client renewing a lock of its own:", renewals, "renewals"),
        "",
        f"3. What the best rates carry: {best_cycle.per_second:,.0f} cycles/s (at {best_cycle.clients}"
        f" clients), {best_renew.per_second:,.0f} renewals/s (at {best_renew.clients} clients).",
        f"  Service replicas fed at {args.replica_cycles:,.0f} cycles/s each:"
        f" {best_cycle.per_second / args.replica_cycles:.1f}",
        f"  A renewal costs {best_cycle.per_second / best_renew.per_second:.2f} cycles of the primary's"
        " time.",
        "",
        *lease_jobs(best_cycle.per_second, best_renew.per_second),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupted)
    setup = [load_average()]
    with said_and_stopped(), ExitStack() as cleanup:
        workdir = Path(tempfile.mkdtemp(prefix="helix-bench-ceiling-"))
        cleanup.callback(shutil.rmtree, workdir, ignore_errors=True)
        url, where = cleanup.enter_context(bench_database(workdir))
        migrate(url)
        with psycopg.connect(url) as conn:
            settings = server_settings(conn)
        setup.append(f"database: {where}")
        setup.append(", ".join(f"{name} {value}" for name, value in settings.items()))
        if settings["synchronous_commit"] != "on" or settings["fsync"] != "on":
            log("warning: synchronous_commit or fsync is not on: these figures trade durability")
        setup.append(f"seeded: {seed(url, args.history, args.live)}")
        log(setup[-1])
        cycles, renewals = measure(args, url, workdir)
    print(report(args, setup, cycles, renewals))
    failures = sum(m.failed for m in cycles + renewals)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
