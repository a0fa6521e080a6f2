"""Benchmark: what GET /v1/events costs (issue 20), in one run.

    python -m bench.events            # 3 rounds of 3 s warm-up + 10 s per side, 1,000,000 ended locks
    python -m bench.events --quick    # smoke run, about 3 minutes: 1 round of 1 s + 5 s, 100,000

(from the repository root). Four figures:

1. No watcher: acquire+release cycles/s at 32 clients, before a migration (A) and with it (B):
   by default 0016, which made the stream (issue 20); `--since 0019` for its remaking (issue 34).
   A is the code of the newest commit without that migration (HEAD while it is uncommitted;
   --base to choose), exported with `git archive` into the run's directory
   and served from there (PYTHONPATH ahead of the editable install), on a database of its own
   migrated by that code, so up to 0015. B is this tree. Both `serve --workers 2` on one server,
   seeded alike; pgbench runs the same two function calls on each database, since the HTTP path may
   hide what the database pays (the trigger, two more index entries per grant and release).
2. 100 watchers: organization-wide streams of the load's own organization, open on B and read
   continuously, beside B with none. The rounds take turns: A, B, B with watchers, then pgbench on
   A and on B (reversed every other round).
3. 1,000 watchers on one process: a third server, `serve --workers 1` on B's database, gets 10,
   then 100, then 1,000 watchers (each on a job type of its own that nothing touches: organization-
   wide streams of a saturating load would measure the fan-out, which is figure 2's), and at each
   step the database statements/s while idle and while 32 clients cycle through that process,
   and the process's RSS. Statements are pg_stat_statements' calls (the embedded server is
   restarted to load it, as bench/waiters.py does), split into the event reader's and the rest;
   without it, pg_stat_database's transactions.
4. Latency to another replica: cycles through B (paced, one at a time), a watcher on the third
   server; per event, its arrival at the watcher (wall clock) minus its `at` (the database's clock
   at the change, a moment before its commit; one machine, one clock).

The watchers of 2 and 3 run in a process of their own (asyncio, one HTTP/1.1 connection each),
counting events in what they read without parsing it. The database and the cleanup are
bench/run.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from multiprocessing import get_context
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

import psycopg

from bench import BenchError, interrupted, load_average, log, said_and_stopped
from bench.database import before_and_after, bench_database, database_name
from bench.http_client import RawConnection, run_loop
from bench.http_load import Sample, helix_cycle, run_http
from bench.pgbench import run_pgbench
from bench.results import CPUS, Result, percentile
from bench.servers import create_key, service_process
from bench.waiters import Counts, counts, meter_database
from harness.processes import rss_mb
from harness.watch import Watch

MIGRATIONS = {"0016": "migrations/0016_lock_events.sql", "0019": "migrations/0019_expiries_announced.sql"}
# The event reader's statements (queries.EVENTS_START, queries.EVENTS): their calls and time.
READER_TIME = """SELECT coalesce(sum(s.calls), 0), coalesce(sum(s.total_exec_time), 0)
FROM pg_stat_statements AS s JOIN pg_database AS d ON d.oid = s.dbid
WHERE d.datname = %s AND s.query LIKE '%%pg_current_snapshot%%'"""
EVENT_MARK = b"\nevent: "  # each event's second line; keep-alives are comments
CROWD_STEPS = (0, 10, 100, 1000)


@dataclass
class Crowd:
    """What a process of watchers saw, filled when it ends."""

    count: int
    events: int = 0
    ended: int = 0  # streams the server ended
    cpu_seconds: float = 0.0
    seconds: float = 0.0


@dataclass
class Tally:
    """The watchers' process's counts, shared by its streams."""

    streams: int
    joined: int = 0
    refused: int = 0
    events: int = 0
    ended: int = 0  # by the server
    settled: asyncio.Event = field(default_factory=asyncio.Event)

    def settle(self) -> None:
        if self.joined + self.refused == self.streams:
            self.settled.set()


async def _watch_one(host: str, port: int, request: bytes, tally: Tally) -> None:
    """One stream: joined (its first keep-alive) or refused, then its events counted until it is
    cancelled or the server ends it."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        tally.refused += 1
        tally.settle()
        return
    try:
        writer.write(request)
        status = int((await reader.readuntil(b"\r\n")).split(b" ", 2)[1])
        if status != 200:
            tally.refused += 1
            tally.settle()
            return
        tail = b""
        first = True
        while chunk := await reader.read(1 << 16):
            if first:  # every change from now on reaches it
                first = False
                tally.joined += 1
                tally.settle()
            read = tail + chunk
            tally.events += read.count(EVENT_MARK)
            tail = read[-(len(EVENT_MARK) - 1) :]
        tally.ended += 1
    finally:
        writer.close()


async def _crowd(
    base_url: str, key: str, job_types: list[str | None], ready: Queue[Any], stop: MpEvent
) -> None:
    host, port = base_url.removeprefix("http://").split(":")
    tally = Tally(len(job_types))
    began = time.perf_counter()
    tasks = []
    for job_type in job_types:
        query = "" if job_type is None else f"?job_type={job_type}"
        request = f"GET /v1/events{query} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n\r\n"
        tasks.append(asyncio.create_task(_watch_one(host, int(port), request.encode(), tally)))
        await asyncio.sleep(0)
    try:
        async with asyncio.timeout(120):
            await tally.settled.wait()
        ready.put(("joined", tally.joined, tally.refused))
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    times = os.times()
    ready.put(("done", tally.events, tally.ended, times.user + times.system, time.perf_counter() - began))


def crowd_process(
    base_url: str, key: str, job_types: list[str | None], ready: Queue[Any], stop: MpEvent
) -> None:
    """Entry point of the watchers' process: open them all, say so, read until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and ends us
    try:
        run_loop(_crowd(base_url, key, job_types, ready, stop))
    except BaseException as exc:
        ready.put(("failed", repr(exc)))


@contextmanager
def watching(base_url: str, key: str, job_types: list[str | None]) -> Iterator[Crowd]:
    """len(job_types) streams open (None: the key's whole organization) and joined, in a process
    of their own, until the block ends; then the Crowd says what they saw."""
    crowd = Crowd(len(job_types))
    if not job_types:
        yield crowd
        return
    ctx = get_context("spawn")
    ready: Queue[Any] = ctx.Queue()
    stop = ctx.Event()
    process = ctx.Process(target=crowd_process, args=(base_url, key, job_types, ready, stop), daemon=True)
    process.start()
    try:
        said = ready.get(timeout=180)
        if said[0] != "joined" or said[2]:
            raise BenchError(f"{len(job_types)} watchers did not all join: {said}")
        yield crowd
        stop.set()
        said = ready.get(timeout=60)
        if said[0] != "done":
            raise BenchError(f"the watchers' process failed: {said}")
        _, crowd.events, crowd.ended, crowd.cpu_seconds, crowd.seconds = said
    finally:
        stop.set()
        process.join(timeout=10)
        if process.is_alive():
            process.terminate()
            process.join()


@dataclass
class Statements:
    """Statements between two readings: all, the event reader's, and the cycles' releases
    (None without pg_stat_statements: then `all` is transactions)."""

    seconds: float
    all: int
    reader: int | None
    cycles: int | None
    reader_ms: float = float("nan")  # the reader's statements' execution time, in all

    @property
    def per_second(self) -> float:
        return self.all / self.seconds

    @property
    def reader_per_second(self) -> float:
        return float("nan") if self.reader is None else self.reader / self.seconds

    @property
    def reader_mean_ms(self) -> float:
        return self.reader_ms / self.reader if self.reader else float("nan")

    @property
    def per_cycle(self) -> float:
        """Statements per cycle besides the reader's."""
        if self.reader is None or not self.cycles:
            return float("nan")
        return (self.all - self.reader) / self.cycles


def statements(before: Counts, after: Counts, seconds: float) -> Statements:
    if before[1] is None or after[1] is None:
        return Statements(seconds, after[0] - before[0], None, None)
    earlier = before[1]
    total = reader = cycles = 0
    for queryid, (text, calls) in after[1].items():
        made = calls - earlier.get(queryid, ("", 0))[1]
        total += made
        if "pg_current_snapshot" in text:
            reader += made
        elif "helix_release_job_lock" in text:
            cycles += made
    return Statements(seconds, total, reader, cycles)


async def _reader_ms(conn: psycopg.AsyncConnection[Any], db: str) -> float:
    try:
        row = await (await conn.execute(READER_TIME, (db,))).fetchone()
    except psycopg.Error:
        return float("nan")
    return float(row[1]) if row else float("nan")


async def _meter(meter_url: str, db: str, delay: float, seconds: float) -> Statements:
    async with await psycopg.AsyncConnection.connect(meter_url, autocommit=True) as conn:
        await asyncio.sleep(delay)
        before, began, ms_before = await counts(conn, db), time.perf_counter(), await _reader_ms(conn, db)
        await asyncio.sleep(seconds)
        after, ms_after = await counts(conn, db), await _reader_ms(conn, db)
        counted = statements(before, after, time.perf_counter() - began)
        counted.reader_ms = ms_after - ms_before
        return counted


def meter(meter_url: str, db: str, seconds: float, delay: float = 0.0) -> Statements:
    return asyncio.run(_meter(meter_url, db, delay, seconds))


@dataclass
class Step:
    """One step of figure 3: `watchers` open on the one process."""

    watchers: int
    rss_idle_mb: float = 0.0
    idle: Statements | None = None
    load: Result | None = None
    loaded: Statements | None = None
    rss_loaded_mb: float = 0.0


@dataclass
class Figures:
    rounds: dict[str, list[Result]] = field(default_factory=dict)
    crowds: list[Crowd] = field(default_factory=list)
    watched: list[Statements] = field(default_factory=list)  # during figure 2's turns
    steps: list[Step] = field(default_factory=list)
    rss_start_mb: float = 0.0
    latencies: list[float] = field(default_factory=list)
    expected_events: int = 0


def loaded_step(
    args: argparse.Namespace, base_url: str, key: str, meter_url: str, db: str, name: str
) -> tuple[Result, Statements]:
    """32 clients through base_url, with the statements counted inside the measured window (the
    load processes take a second or two to start)."""
    seconds = max(2.0, args.duration - 3.0)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(cycling, args, base_url, key)
        counted = meter(meter_url, db, seconds, delay=args.warmup + 2.0)
        result = running.result()
    log(f"  {name}: {result.cycles_per_second:,.0f} cycles/s, {counted.per_second:,.1f} statements/s")
    return result, counted


async def latency_run(write_url: str, watch_url: str, key: str, cycles: int, gap: float) -> list[float]:
    """`cycles` cycles through write_url, one at a time, `gap` s apart, watched on watch_url: per
    event, arrival minus its `at`, in seconds."""
    host, port = write_url.removeprefix("http://").split(":")
    conn = RawConnection(host, int(port))
    cycle = helix_cycle(f"Authorization: Bearer {key}\r\n", "latency")
    sample = Sample()
    async with Watch(watch_url, key=key) as watch:
        if watch.status != 200:
            raise BenchError(f"the watcher got {watch.status}: {watch.problem}")
        for _ in range(cycles):
            await cycle(conn, sample)
            await asyncio.sleep(gap)
        await conn.close()
        if sample.failures:
            raise BenchError(f"cycles failed: {sample.errors}")
        events = await watch.until(2 * cycles, within=30)
    return sorted(event.arrived - datetime.fromisoformat(event.data["at"]).timestamp() for event in events)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.events",
        description="What GET /v1/events costs: cycles/s before a migration (--since) and with it, with 100"
        " watchers, statements/s and RSS with up to 1,000 watchers on one process, and the latency"
        " from a change to a watcher on another replica.",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run of about 3 minutes")
    parser.add_argument("--rounds", type=int, help="turns of every side (default: 3; --quick 1)")
    parser.add_argument("--duration", type=int, help="seconds measured per turn (default: 10; --quick 5)")
    parser.add_argument("--warmup", type=int, help="seconds of warm-up per turn (default: 3; --quick 1)")
    parser.add_argument("--clients", type=int, default=32, help="clients cycling (default: 32)")
    parser.add_argument("--watchers", type=int, default=100, help="watchers of figure 2 (default: 100)")
    parser.add_argument("--workers", type=int, default=2, help="workers of A and B (default: 2)")
    parser.add_argument("--processes", type=int, default=CPUS, help=f"load processes (default: {CPUS})")
    parser.add_argument("--history", type=int, help="ended locks seeded (default: 1000000; --quick 100000)")
    parser.add_argument("--live", type=int, default=10_000, help="live locks seeded (default: 10000)")
    parser.add_argument("--idle", type=float, help="seconds counted idle per step (default: 10; --quick 4)")
    parser.add_argument("--events", type=int, help="cycles timed for latency (default: 300; --quick 100)")
    parser.add_argument(
        "--since", choices=sorted(MIGRATIONS), default="0016", help="the migration B has and A lacks"
    )
    parser.add_argument("--base", help="the commit measured as before (default: the one before --since's)")
    args = parser.parse_args(argv)
    quick = args.quick
    args.rounds = args.rounds or (1 if quick else 3)
    args.duration = args.duration or (5 if quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
    args.history = args.history if args.history is not None else (100_000 if quick else 1_000_000)
    args.idle = args.idle or (4.0 if quick else 10.0)
    args.events = args.events or (100 if quick else 300)
    if min(args.rounds, args.duration, args.clients, args.workers, args.processes, args.events) < 1:
        parser.error("--rounds, --duration, --clients, --workers, --processes and --events must be >= 1")
    return args


def cycling(args: argparse.Namespace, base_url: str, key: str, warmup: int | None = None) -> Result:
    """args.clients clients cycling through base_url, each on a key of its own."""
    warmup = args.warmup if warmup is None else warmup
    return run_http(base_url, "helix", key, args.clients, args.processes, warmup, args.duration, False)


def run_rounds(
    args: argparse.Namespace,
    sides: dict[str, tuple[str, str]],
    databases: dict[str, str],
    meter_url: str,
    workdir: Path,
    out: Figures,
) -> None:
    """Figures 1 and 2: the sides in turn, reversed every other round."""
    timing = f"{args.warmup} s warm-up + {args.duration} s"
    order = ["A", "B", "B+watchers", "pgbench A", "pgbench B"]
    out.rounds = {name: [] for name in order}
    for round_ in range(args.rounds):
        log(f"round {round_ + 1}/{args.rounds}: each side {timing} ...")
        for name in order if round_ % 2 == 0 else order[::-1]:
            if name.startswith("pgbench"):
                url = databases[name.removeprefix("pgbench ")]
                result = run_pgbench(url, args.clients, args.warmup, args.duration, workdir)
            elif name == "B+watchers":
                base_url, key = sides["B"]
                db = database_name(databases["B"])
                with watching(base_url, key, [None] * args.watchers) as crowd:
                    result, counted = loaded_step(args, base_url, key, meter_url, db, name)
                out.crowds.append(crowd)
                out.watched.append(counted)
            else:
                base_url, key = sides[name]
                result = cycling(args, base_url, key)
            out.rounds[name].append(result)
            log(f"  {name}: {result.cycles_per_second:,.0f} cycles/s")


def run_crowd(
    args: argparse.Namespace, base_url: str, pid: int, key: str, meter_url: str, db: str, out: Figures
) -> None:
    """Figure 3: watchers added step by step to one process, each step idle, then under load."""
    log("figure 3: a warm-up load through the one process ...")
    cycling(args, base_url, key, warmup=0)
    out.rss_start_mb = rss_mb(pid)
    with ExitStack() as crowds:
        for before, watchers in zip((0, *CROWD_STEPS), CROWD_STEPS, strict=False):
            log(f"figure 3: {watchers} watcher(s) on the one process ...")
            job_types: list[str | None] = [f"watch-{n}" for n in range(before, watchers)]
            crowds.enter_context(watching(base_url, key, job_types))
            step = Step(watchers)
            step.idle = meter(meter_url, db, args.idle, delay=1.0)
            step.rss_idle_mb = rss_mb(pid)
            step.load, step.loaded = loaded_step(args, base_url, key, meter_url, db, f"{watchers} watchers")
            step.rss_loaded_mb = rss_mb(pid)
            out.steps.append(step)


def _median(results: list[Result]) -> float:
    return statistics.median(result.cycles_per_second for result in results)


def _met(ok: bool) -> str:
    return "yes" if ok else "NO"


def report(args: argparse.Namespace, setup: list[str], out: Figures) -> str:
    rates = {name: _median(results) for name, results in out.rounds.items()}
    a, b, watched = rates["A"], rates["B"], rates["B+watchers"]
    pg_ratio = rates["pgbench B"] / rates["pgbench A"]
    p50s = {name: statistics.median(r.p50_ms for r in results) for name, results in out.rounds.items()}
    p99s = {name: statistics.median(r.p99_ms for r in results) for name, results in out.rounds.items()}
    first, last = out.steps[0], out.steps[-1]
    growth = last.rss_loaded_mb - out.rss_start_mb
    growth_idle = last.rss_idle_mb - first.rss_idle_mb
    p50, p99 = (percentile(out.latencies, pct) * 1000 for pct in (50, 99))
    summary = [
        ("1. 0 watchers: B / A cycles/s (HTTP)", f"{b / a:.3f}", ">= 0.95", _met(b / a >= 0.95)),
        ("   0 watchers: B / A cycles/s (pgbench)", f"{pg_ratio:.3f}", "(>= 0.95)", _met(pg_ratio >= 0.95)),
        (
            f"2. {args.watchers} watchers / 0 watchers cycles/s (B)",
            f"{watched / b:.3f}",
            ">= 0.80",
            _met(watched / b >= 0.80),
        ),
        (
            f"3. RSS growth, 0 -> {last.watchers:,} watchers, MB",
            f"{growth:.1f}",
            "<= 50",
            _met(growth <= 50),
        ),
        (
            f"   reader statements/s idle, {CROWD_STEPS[1]} -> {last.watchers:,} watchers",
            f"{out.steps[1].idle.reader_per_second if out.steps[1].idle else 0:.1f} -> "
            f"{last.idle.reader_per_second if last.idle else 0:.1f}",
            "flat",
            "",
        ),
        (
            f"4. commit -> watcher on another replica, p50 / p99 ms ({len(out.latencies)} events)",
            f"{p50:.1f} / {p99:.1f}",
            "p99 <= 100",
            _met(p99 <= 100),
        ),
    ]
    lines = [
        f"Event stream cost (issue 20): {args.clients} clients cycling acquire+release, each on a key of"
        f" its own; {args.rounds} round(s) of {args.warmup} s warm-up + {args.duration} s per side,"
        " sides in turn; medians of the rounds",
        *(f"  {line}" for line in setup),
        "",
        f"{'figure':<62} | {'measured':>13} | {'target':>10} | met",
        "-" * 96,
        *(f"{name:<62} | {value:>13} | {goal:>10} | {met}" for name, value, goal, met in summary),
        "",
        f"{'side (1, 2)':<40} | {'cycles/s':>8} | {'/ B':>5} | {'p50 ms':>6} | {'p99 ms':>6} | every round",
    ]
    for name, results in out.rounds.items():
        other = rates["pgbench B"] if name.startswith("pgbench") else b
        label = {
            "A": f"A: before {args.since} (HTTP)",
            "B": f"B: with {args.since}, 0 watchers (HTTP)",
            "B+watchers": f"B: with {args.since}, {args.watchers} watchers (HTTP)",
            "pgbench A": "pgbench on A's database",
            "pgbench B": "pgbench on B's database",
        }[name]
        lines.append(
            f"{label:<40} | {rates[name]:>8,.0f} | {rates[name] / other:>5.3f} | {p50s[name]:>6.2f}"
            f" | {p99s[name]:>6.2f} | " + ", ".join(f"{r.cycles_per_second:,.0f}" for r in results)
        )
    for counted in out.watched:
        lines.append(
            f"  with {args.watchers} watchers on B: {counted.reader_per_second:.1f} reader statements/s,"
            f" {counted.reader_mean_ms:.1f} ms each: {counted.reader_ms / counted.seconds / 1000:.2f}"
            " s of reader statement running per s (one reader per worker)"
        )
    for crowd in out.crowds:
        per_watcher = crowd.events / crowd.count / crowd.seconds if crowd.seconds else float("nan")
        lines.append(
            f"  {crowd.count} watchers: {per_watcher:,.0f} events/s each over {crowd.seconds:.0f} s,"
            f" {crowd.ended} stream(s) ended by the server, their process used"
            f" {crowd.cpu_seconds / crowd.seconds if crowd.seconds else 0:.2f} cores"
        )
    lines += [
        "",
        "3. one process (serve --workers 1), watchers on quiet job types; statements/s: all (of them"
        " the event reader's); per cycle: the rest / cycles; reader ms: mean execution time of one"
        " reader statement (pg_stat_statements)",
        f"{'watchers':>8} | {'RSS idle MB':>11} | {'idle stmts/s':>16} | {'load cycles/s':>13}"
        f" | {'load stmts/s':>18} | {'per cycle':>9} | {'RSS load MB':>11} | reader ms idle / load",
    ]
    for step in out.steps:
        idle, loaded, load = step.idle, step.loaded, step.load
        assert idle is not None and loaded is not None and load is not None
        lines.append(
            f"{step.watchers:>8,} | {step.rss_idle_mb:>11.1f}"
            f" | {f'{idle.per_second:.1f} ({idle.reader_per_second:.1f})':>16}"
            f" | {load.cycles_per_second:>13,.0f}"
            f" | {f'{loaded.per_second:,.1f} ({loaded.reader_per_second:.1f})':>18}"
            f" | {loaded.per_cycle:>9.2f} | {step.rss_loaded_mb:>11.1f}"
            f" | {idle.reader_mean_ms:.1f} / {loaded.reader_mean_ms:.1f}"
        )
    lines += [
        f"  RSS after a warm-up load, no watcher: {out.rss_start_mb:.1f} MB; growth to {last.watchers:,}"
        f" watchers: {growth:.1f} MB after their load, {growth_idle:.1f} MB idle (from the 0 step)",
        "",
        f"4. {len(out.latencies)} events of {args.events} cycles through B, one at a time, watched on the"
        f" third server: p50 {p50:.1f} ms, p99 {p99:.1f} ms,"
        f" max {max(out.latencies, default=float('nan')) * 1000:.1f} ms"
        f" (expected {out.expected_events})",
    ]
    failures = [
        f"{name} {sum(r.failures for r in results)}"
        for name, results in [*out.rounds.items(), ("figure 3", [s.load for s in out.steps if s.load])]
    ]
    lines.append("failed cycles: " + ", ".join(failures))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupted)
    setup = [load_average()]
    out = Figures()
    with said_and_stopped(), ExitStack() as cleanup:
        workdir = Path(tempfile.mkdtemp(prefix="helix-bench-events-"))
        cleanup.callback(shutil.rmtree, workdir, ignore_errors=True)
        database = cleanup.enter_context(bench_database(workdir))
        url = database[0]
        meter_url = meter_database(url, workdir / "pgdata", cleanup)
        before = before_and_after(
            database, workdir, args.base, MIGRATIONS[args.since], (args.history, args.live), cleanup
        )
        base_db_url, base_env = before.url, before.env
        setup += before.setup
        log(setup[-1])
        a_url, _ = cleanup.enter_context(
            service_process(base_db_url, args.workers, workdir / "a.log", base_env)
        )
        b_url, _ = cleanup.enter_context(service_process(url, args.workers, workdir / "b.log"))
        w_url, w_process = cleanup.enter_context(service_process(url, 1, workdir / "w.log"))
        with psycopg.connect(base_db_url) as conn:
            applied_after = conn.execute("SELECT count(*) FROM helix_schema_migrations").fetchone()
        if applied_after != (before.migrations,):
            raise BenchError("serving A migrated its database further: it runs this tree's code")
        key_a = create_key(base_db_url, a_url)
        key_b = create_key(url, b_url)
        setup.append(
            f"A and B: helix-locks serve --workers {args.workers}, an organization API key;"
            f" figures 3 and 4 add serve --workers 1 on B's database; load: {args.processes} process(es)"
        )
        sides = {"A": (a_url, key_a), "B": (b_url, key_b)}
        run_rounds(args, sides, {"A": base_db_url, "B": url}, meter_url, workdir, out)
        db = database_name(url)
        run_crowd(args, w_url, w_process.pid, key_b, meter_url, db, out)
        log(f"figure 4: {args.events} cycles through B, watched on the third server ...")
        out.expected_events = 2 * args.events
        out.latencies = run_loop(latency_run(b_url, w_url, key_b, args.events, 0.02))
    print(report(args, setup, out))
    failures = sum(r.failures for results in out.rounds.values() for r in results)
    failures += sum(step.load.failures for step in out.steps if step.load)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
