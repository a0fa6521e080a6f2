"""Benchmark: the ceiling of one PostgreSQL primary (issue 25), with no HTTP in between.

    python -m bench.ceiling            # 1 to 64 clients, 3 s warm-up + 10 s per level and call
    python -m bench.ceiling --quick    # smoke run: 1, 8 and 32 clients, 1 s + 3 s
    python -m bench.ceiling --base REV # the same, A/B: the schema of commit REV (A) and this tree's (B)

(from the repository root). pgbench drives the real functions, prepared, each call its own
transaction as the service sends it (autocommit), at each level of clients, each client on a key of
its own in organization "bench":

1. the cycle: `helix_acquire_job_lock` then `helix_release_job_lock`, with the organization, as an
   organization's API key sends them;
2. the renewal alone: `helix_renew_job_lock` of a lock each client holds (acquired beforehand, with
   a lease of a day so that none lapses).

For each, around the measured window only: the WAL written (pg_current_wal_lsn() before and after;
records, full-page images and bytes from pg_stat_wal on PostgreSQL 14 and later), the commits of
the bench's database (pg_stat_database.xact_commit), and the rows its tables took
(pg_stat_user_tables: inserts, updates, and how many of those were HOT, that is wrote no index
entry), each divided by the calls pgbench counted; and the machine's busy CPU time per call,
pgbench's own left out. WAL and CPU are the whole server's and
machine's: on a server or machine that others use meanwhile (a CI run), they count theirs too.
Nothing trades durability: the run says synchronous_commit, fsync and full_page_writes as it found
them, and changes none.

From the best cycles/s and renewals/s it derives what one primary carries: how many service
replicas it feeds at --replica-cycles each (docs/performance.md: `serve --workers 2` on 2 cores),
and, for the lease pattern of a job (acquire, a renewal every ttl/3, release), how many jobs per
second and how many workers busy at once.

The database is bench/database.py's: a throwaway database on DATABASE_URL's server, or an embedded
PostgreSQL; seeded with history and live locks of other organizations, as bench/run.py seeds it.

With --base REV (or --since NNNN: the commit before the one that added migration NNNN), the run is
an A/B of two schemas: A, a second database on the same server migrated by REV's code (exported
with `git archive`, bench/database.py's before_and_after), and B, this tree's; seeded alike. The
sides take turns at every level and call (A first, then B first at the next level), so that both
see the same server, and the report adds B's figures over A's.
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
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from bench import BenchError, interrupted, load_average, log, said_and_stopped, tool_output
from bench.database import before_and_after, bench_database, migration_named, seed
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

# A session's renewal (--sessions N,...): one renewal of the client's own session of N locks;
# session ids are first_session + client_id (hold_sessions checks it), tokens set by the bench.
SESSION_SCRIPT = f"""\
\\set sid :first_session + :client_id
SELECT 1 FROM helix_renew_session(
    :sid, 'ceiling-session-' || :client_id, {RENEW_TTL_MS}, '{ORGANIZATION}', 2000000000);
"""

# Coalescing (--coalesce K): what the service would send if it gathered K acquires that arrive at
# once into one statement, and then K releases: one round trip and one commit for K calls, each
# call in a subtransaction of its own, so that one call's error (23505 on a live conflict) is that
# call's answer and leaves the others' effects in place. Bench-only functions, created in the
# bench's database.
COALESCING_FUNCTIONS = f"""
CREATE FUNCTION bench_acquire_each(p_job_types text[])
RETURNS TABLE (id bigint, token text, failed text) LANGUAGE plpgsql AS $$
DECLARE
    v_job_type text;
BEGIN
    FOREACH v_job_type IN ARRAY p_job_types LOOP
        BEGIN
            RETURN QUERY SELECT l.id, l.token, NULL::text
                FROM helix_acquire_job_lock('{ORGANIZATION}', v_job_type, 'pgbench', 30000, NULL, NULL) AS l;
        EXCEPTION WHEN OTHERS THEN
            RETURN QUERY SELECT NULL::bigint, NULL::text, SQLSTATE;
        END;
    END LOOP;
END $$;
CREATE FUNCTION bench_release_each(p_ids bigint[], p_tokens text[])
RETURNS TABLE (id bigint, failed text) LANGUAGE plpgsql AS $$
BEGIN
    FOR i IN 1 .. coalesce(cardinality(p_ids), 0) LOOP
        BEGIN
            PERFORM helix_release_job_lock(p_ids[i], p_tokens[i], '{ORGANIZATION}');
            RETURN QUERY SELECT p_ids[i], NULL::text;
        EXCEPTION WHEN OTHERS THEN
            RETURN QUERY SELECT p_ids[i], SQLSTATE;
        END;
    END LOOP;
END $$;
"""


def coalesced_script(k: int) -> str:
    """One pgbench transaction: K cycles of the client's K keys, coalesced into two statements. A
    call that failed (none should: each client has keys of its own) divides by zero, which stops
    pgbench and the bench with it."""
    job_types = ", ".join(f"'ceiling-' || :client_id || '-{i}'" for i in range(k))
    return (
        "SELECT array_agg(id) AS ids, array_agg(token) AS tokens, count(failed) AS failed"
        f" FROM bench_acquire_each(ARRAY[{job_types}]) \\gset\n"
        f"SELECT 1 / (count(*) FILTER (WHERE failed IS NULL) = {k} AND :failed = 0)::int"
        " FROM bench_release_each(:ids::bigint[], :tokens::text[]);\n"
    )


# Jobs of a lease pattern: (duration in seconds, ttl in seconds).
JOBS = ((10, 30), (60, 30), (600, 60), (3600, 300))

_WAL = """
SELECT pg_current_wal_lsn()::text AS lsn,
       (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()) AS commits,
       (SELECT xact_rollback FROM pg_stat_database WHERE datname = current_database()) AS rollbacks
"""
_STAT_WAL = "SELECT wal_records, wal_fpi FROM pg_stat_wal"
TRANSACTIONS = r"^number of transactions actually processed: (\d+)"
# Rows the database's tables took, HOT updates (no index entry written) among the updates.
_ROWS = """
SELECT coalesce(sum(n_tup_ins), 0), coalesce(sum(n_tup_upd), 0), coalesce(sum(n_tup_hot_upd), 0)
FROM pg_stat_user_tables
"""


@dataclass(frozen=True)
class Counters:
    lsn: str
    commits: int
    rollbacks: int
    records: int | None  # pg_stat_wal, PostgreSQL 14 and later
    fpi: int | None
    inserts: int  # pg_stat_user_tables, the database's
    updates: int
    hot_updates: int


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
    inserts: float  # rows, per call
    updates: float
    hot_updates: float  # of the updates, those that wrote no index entry
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
    parser.add_argument("--base", help="A/B: A is the schema of this commit, B this tree's")
    parser.add_argument(
        "--coalesce", type=int, default=0, help="also cycles coalesced K to a transaction (default: 0, not)"
    )
    parser.add_argument("--since", help="A/B: A is the commit before the one that added migration NNNN")
    parser.add_argument(
        "--sessions",
        help="also a session's renewal, each client renewing a session of its own of N locks, for each N"
        " given (comma-separated, such as 1,10,100); not with --base or --since",
    )
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
    args.duration = args.duration if args.duration is not None else (3 if quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
    args.history = args.history if args.history is not None else (20_000 if quick else 200_000)
    if min([args.duration, *args.levels]) < 1 or args.warmup < 0 or args.replica_cycles <= 0:
        parser.error("--duration and --clients must be >= 1, --warmup >= 0, --replica-cycles > 0")
    if args.history < 0 or args.live < 0:
        parser.error("--history and --live must be >= 0")
    if not 0 <= args.coalesce <= 100:
        parser.error("--coalesce: 0 (not) to 100")
    try:
        args.session_sizes = [int(value) for value in args.sessions.split(",")] if args.sessions else []
    except ValueError:
        parser.error("--sessions: comma-separated numbers")
    if args.session_sizes and (args.base or args.since):
        parser.error("--sessions measures this tree's schema alone: not with --base or --since")
    if not all(1 <= size <= 1000 for size in args.session_sizes):
        parser.error("--sessions: sizes from 1 to 1000 locks")
    try:
        args.migration = migration_named(args.since) if args.since else None
    except ValueError as exc:
        parser.error(f"--since: {exc}")
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
    rows = conn.execute(_ROWS).fetchone()
    assert rows is not None
    inserts, updates, hot = (int(str(value)) for value in rows)
    return Counters(str(row[0]), int(str(row[1])), int(str(row[2])), records, fpi, inserts, updates, hot)


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
    side: Side,
    conn: psycopg.Connection[tuple[object, ...]],
    script: Path,
    clients: int,
    args: argparse.Namespace,
    per_transaction: int = 1,
    first_session: int = 0,
) -> Measured:
    """pgbench running `script` at `clients`, and what it cost per call; a pgbench transaction is
    `per_transaction` calls."""
    stat_wal, url = args.stat_wal, side.url
    command = [str(pgbench_path()), "-n", "-M", "prepared", "-f", str(script)]
    command += ["-c", str(clients), "-j", str(min(clients, CPUS)), "-D", f"first_id={side.first_id}"]
    command += ["-D", f"first_session={first_session}"]
    # Every statement of a transaction is a commit of its own: two for a cycle, one for a renewal.
    statements = sum(1 for line in script.read_text().splitlines() if line.startswith("SELECT"))
    if args.warmup > 0:
        start = counters(conn, stat_wal)
        warm = re.search(TRANSACTIONS, tool_output([*command, "-T", str(args.warmup), url]), re.MULTILINE)
        # pgbench's backends report their counts as they exit, which may be after this returns:
        # counted in the measured window, they would add to its commits and rows.
        wait_for_stats(conn, start.commits + (int(warm.group(1)) if warm else 0) * statements)
    before = counters(conn, stat_wal)
    ticks = busy_cpu_ticks()
    children = os.times()
    output = tool_output([*command, "-T", str(args.duration), url])
    children_after = os.times()
    ticks_after = busy_cpu_ticks()

    found = {
        name: re.search(pattern, output, re.MULTILINE)
        for name, pattern in {
            "calls": TRANSACTIONS,
            "tps": r"^tps = ([0-9.]+)",
            "latency": r"^latency average = ([0-9.]+) ms",
            "failed": r"^number of failed transactions: (\d+)",
        }.items()
    }
    calls_found, tps, latency = found["calls"], found["tps"], found["latency"]
    if calls_found is None or tps is None or latency is None:
        raise BenchError(f"pgbench's output lacks what the bench reads:\n{output}")
    transactions = int(calls_found.group(1))
    if transactions == 0:
        raise BenchError(f"pgbench completed no transaction:\n{output}")
    wait_for_stats(conn, before.commits + transactions * statements)
    calls = transactions * per_transaction
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
        per_second=float(tps.group(1)) * per_transaction,
        latency_ms=float(latency.group(1)),
        failed=int(failed.group(1)) if failed else 0,
        commits=(after.commits - before.commits) / calls,
        rollbacks=(after.rollbacks - before.rollbacks) / calls,
        wal_bytes=wal_between(conn, before.lsn, after.lsn) / calls,
        wal_records=per_call(before.records, after.records),
        wal_fpi=per_call(before.fpi, after.fpi),
        inserts=(after.inserts - before.inserts) / calls,
        updates=(after.updates - before.updates) / calls,
        hot_updates=(after.hot_updates - before.hot_updates) / calls,
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


def hold_sessions(conn: psycopg.Connection[tuple[object, ...]], clients: int, size: int) -> int:
    """A session of `size` locks for each pgbench client, with a known token; the first session's
    id: the others follow it one by one."""
    ids = []
    for client in range(clients):
        job_types = [f"ceiling-s{size}-{client}-{n}" for n in range(size)]
        row = conn.execute(
            "SELECT session_id FROM helix_open_session(%s, 'pgbench', %s, NULL, NULL, %s::text[],"
            " %s::integer[], 2000000000, NULL, 2000000000, 1000)",
            (ORGANIZATION, RENEW_TTL_MS, job_types, [1] * size),
        ).fetchone()
        assert row is not None
        ids.append(int(str(row[0])))
        conn.execute(
            "UPDATE helix_sessions SET token = %s WHERE id = %s", (f"ceiling-session-{client}", ids[-1])
        )
    if ids != list(range(ids[0], ids[0] + clients)):
        raise BenchError("the sessions' ids are not consecutive: something else opens sessions meanwhile")
    return ids[0]


def server_settings(conn: psycopg.Connection[tuple[object, ...]]) -> dict[str, str]:
    names = ["server_version", "synchronous_commit", "fsync", "full_page_writes", "wal_level"]
    names += ["max_wal_size", "checkpoint_timeout", "shared_buffers"]
    return {name: str(conn.execute(f"SHOW {name}").fetchone()[0]) for name in names}  # type: ignore[index]


@dataclass
class Side:
    """A schema measured: its database and what was measured on it."""

    name: str  # "A" or "B" of an A/B run, else ""
    url: str
    first_id: int = 0  # of its renewal locks (hold_renewal_locks)
    cycles: list[Measured] = field(default_factory=list)
    renewals: list[Measured] = field(default_factory=list)
    coalesced: list[Measured] = field(default_factory=list)  # cycles, --coalesce K to a transaction
    sessions: dict[int, list[Measured]] = field(default_factory=dict)  # renewals, by locks a session


def measure(args: argparse.Namespace, sides: list[Side], workdir: Path) -> None:
    """Every level and call on every side, the sides taking turns: in the order given at the
    first level, reversed at the next, and so on."""
    cycle_script, renew_script = workdir / "cycle.sql", workdir / "renew.sql"
    cycle_script.write_text(CYCLE_SCRIPT)
    renew_script.write_text(RENEW_SCRIPT)
    # (script, what a call is, calls per pgbench transaction, the Side list that takes the result)
    scripts = [(cycle_script, "cycles", 1, "cycles"), (renew_script, "renewals", 1, "renewals")]
    if args.coalesce:
        coalesced_path = workdir / "coalesced.sql"
        coalesced_path.write_text(coalesced_script(args.coalesce))
        scripts.append((coalesced_path, "coalesced cycles", args.coalesce, "coalesced"))
    with ExitStack() as connections:
        conns = {}
        for side in sides:
            conn = connections.enter_context(psycopg.connect(side.url, autocommit=True))
            has_stat_wal = "SELECT to_regclass('pg_catalog.pg_stat_wal') IS NOT NULL"
            args.stat_wal = conn.execute(has_stat_wal).fetchone() == (True,)
            side.first_id = hold_renewal_locks(conn, max(args.levels))
            if args.coalesce:
                conn.execute(COALESCING_FUNCTIONS)
            conn.execute("VACUUM (ANALYZE)")
            conns[side.name] = conn
        first_sessions = {
            size: hold_sessions(conns[sides[0].name], max(args.levels), size) for size in args.session_sizes
        }
        if first_sessions:
            conns[sides[0].name].execute("VACUUM (ANALYZE)")
            session_script = workdir / "session.sql"
            session_script.write_text(SESSION_SCRIPT)
        for level, clients in enumerate(args.levels):
            for size, first in first_sessions.items():
                side = sides[0]
                log(f"{clients} client(s), a session's renewal of {size} locks ...")
                result = run_script(side, conns[side.name], session_script, clients, args, 1, first)
                side.sessions.setdefault(size, []).append(result)
                log(f"  {result.per_second:,.0f} renewals/s, {result.wal_bytes:,.0f} WAL bytes each")
            for script, name, per_transaction, into in scripts:
                for side in sides if level % 2 == 0 else sides[::-1]:
                    log(
                        f"{side.name or 'the schema'}, {clients} client(s), {name}: {args.warmup} s"
                        f" warm-up + {args.duration} s ..."
                    )
                    result = run_script(side, conns[side.name], script, clients, args, per_transaction)
                    getattr(side, into).append(result)
                    log(f"  {result.per_second:,.0f} {name}/s, {result.wal_bytes:,.0f} WAL bytes each")


def _opt(value: float | None, form: Callable[[float], str]) -> str:
    return "-" if value is None else form(value)


def table(title: str, rows: list[Measured], unit: str) -> list[str]:
    lines = [
        title,
        "",
        f"| clients | {unit}/s | latency avg ms | commits / call | WAL bytes / call | WAL records / call"
        " | full-page images / call | rows inserted / call | rows updated / call (HOT of them)"
        " | busy cores (pgbench's) | CPU ms / call, but pgbench's | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in rows:
        lines.append(
            f"| {m.clients} | {m.per_second:,.0f} | {m.latency_ms:.2f} | {m.commits:.2f} | {m.wal_bytes:,.0f}"
            f" | {_opt(m.wal_records, lambda v: f'{v:.1f}')} | {_opt(m.wal_fpi, lambda v: f'{v:.2f}')}"
            f" | {m.inserts:.2f} | {m.updates:.2f} ({m.hot_updates:.2f})"
            f" | {m.busy_cores:.2f} ({m.pgbench_cores:.2f}) | {m.cpu_ms:.3f} | {m.failed} |"
        )
    return lines


def _ratio(b: float | None, a: float | None) -> str:
    return "-" if a is None or b is None or a == 0 else f"{b / a:.2f}"


def not_hot(m: Measured) -> float:
    """Updates per call that wrote index entries."""
    return m.updates - m.hot_updates


def compared(a: Side, b: Side) -> list[str]:
    """B's figures over A's, level by level."""
    lines = [
        "4. B over A, at each level (taken in turns on one server):",
        "",
        "| clients | cycles/s | cycle WAL bytes | cycle WAL records | renewals/s | renewal WAL bytes"
        " | renewal WAL records | renewal updates not HOT, A / B |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    pairs = zip(a.cycles, b.cycles, a.renewals, b.renewals, strict=True)
    for a_cycle, b_cycle, a_renewal, b_renewal in pairs:
        lines.append(
            f"| {a_cycle.clients} | {_ratio(b_cycle.per_second, a_cycle.per_second)}"
            f" | {_ratio(b_cycle.wal_bytes, a_cycle.wal_bytes)}"
            f" | {_ratio(b_cycle.wal_records, a_cycle.wal_records)}"
            f" | {_ratio(b_renewal.per_second, a_renewal.per_second)}"
            f" | {_ratio(b_renewal.wal_bytes, a_renewal.wal_bytes)}"
            f" | {_ratio(b_renewal.wal_records, a_renewal.wal_records)}"
            f" | {not_hot(a_renewal):.2f} / {not_hot(b_renewal):.2f} |"
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


def report(args: argparse.Namespace, setup: list[str], sides: list[Side]) -> str:
    lines = [
        f"The ceiling of one primary: pgbench, {args.warmup} s warm-up + {args.duration} s per level and"
        f" call; {CPUS} CPUs shared by pgbench and PostgreSQL",
        *(f"  {line}" for line in setup),
    ]
    for side in sides:
        title = [f"## {side.name}", ""] if side.name else []
        lines += ["", *title, *section(args, side)]
    if len(sides) == 2:
        lines += ["", *compared(*sides)]
    return "\n".join(lines)


def section(args: argparse.Namespace, side: Side) -> list[str]:
    """The tables of one side, and what its best rates carry."""
    cycles, renewals = side.cycles, side.renewals
    best_cycle = max(cycles, key=lambda m: m.per_second)
    best_renew = max(renewals, key=lambda m: m.per_second)
    return [
        *table("1. acquire + release, each client on a key of its own (a call: a cycle):", cycles, "cycles"),
        "",
        *table("2. renewal alone, each client renewing a lock of its own:", renewals, "renewals"),
        "",
        *(
            [
                *table(
                    f"2b. acquire + release coalesced, {args.coalesce} cycles to a statement, each call in a"
                    " subtransaction of its own (a call: a cycle; latency: of a transaction, all"
                    f" {args.coalesce}):",
                    side.coalesced,
                    "cycles",
                ),
                "",
            ]
            if side.coalesced
            else []
        ),
        *(
            line
            for size, rows in side.sessions.items()
            for line in [
                *table(
                    f"2c. a session's renewal, each client renewing a session of its own of {size} locks:",
                    rows,
                    "renewals",
                ),
                "",
            ]
        ),
        f"3. What the best rates carry: {best_cycle.per_second:,.0f} cycles/s (at {best_cycle.clients}"
        f" clients), {best_renew.per_second:,.0f} renewals/s (at {best_renew.clients} clients).",
        f"  Service replicas fed at {args.replica_cycles:,.0f} cycles/s each:"
        f" {best_cycle.per_second / args.replica_cycles:.1f}",
        f"  A renewal costs {best_cycle.per_second / best_renew.per_second:.2f} cycles of the primary's"
        " time.",
        "",
        *lease_jobs(best_cycle.per_second, best_renew.per_second),
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupted)
    setup = [load_average()]
    with said_and_stopped(), ExitStack() as cleanup:
        workdir = Path(tempfile.mkdtemp(prefix="helix-bench-ceiling-"))
        cleanup.callback(shutil.rmtree, workdir, ignore_errors=True)
        database = cleanup.enter_context(bench_database(workdir))
        url, where = database
        if args.base or args.migration:
            before = before_and_after(
                database, workdir, args.base, args.migration, (args.history, args.live), cleanup
            )
            setup += before.setup
            sides = [Side("A", before.url), Side("B", url)]
        else:
            migrate(url)
            setup.append(f"database: {where}")
            setup.append(f"seeded: {seed(url, args.history, args.live)}")
            sides = [Side("", url)]
        with psycopg.connect(url) as conn:
            settings = server_settings(conn)
        setup.append(", ".join(f"{name} {value}" for name, value in settings.items()))
        if settings["synchronous_commit"] != "on" or settings["fsync"] != "on":
            log("warning: synchronous_commit or fsync is not on: these figures trade durability")
        log("; ".join(setup[1:]))
        measure(args, sides, workdir)
    print(report(args, setup, sides))
    failures = sum(m.failed for side in sides for m in side.cycles + side.renewals + side.coalesced)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
