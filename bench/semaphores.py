"""Benchmark: what semaphores cost (issue 21), in one run.

    python -m bench.semaphores            # 3 rounds of 3 s warm-up + 10 s per side
    python -m bench.semaphores --quick    # smoke run: 1 round of 1 s + 4 s

(from the repository root). Two figures:

1. max_holders 1, before migration 0017 (A) and with it (B): acquire+release cycles/s at 32
   clients, each on a key of its own, through `serve --workers 2` with an organization API key;
   then pgbench's same two function calls on each database. A is the code of the commit before
   migrations/0017_semaphores.sql (--base to choose), exported with `git archive` and served from
   there, on a database of its own migrated by that code; B is this tree. Both are seeded alike.
   The sides take turns, reversed every other round; medians are reported.
2. Hot keys on B: 32 clients on one key, each acquiring (again after every 409) and releasing at
   once; first a plain lock, then a semaphore of max_holders 4, then shared locks (every client a
   reader, issue 40): grants/s and 409s/s, with the p50 and p99 of each.

The database and the cleanup are bench/run.py's.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from bench import interrupted, load_average, log, said_and_stopped, settle_turns, turn_arguments
from bench.database import before_and_after, bench_database
from bench.http_load import SEMAPHORE_HOLDERS, run_http
from bench.pgbench import run_pgbench
from bench.results import CPUS, Result, percentile
from bench.servers import create_key, service_process

MIGRATION = "migrations/0017_semaphores.sql"
SIDES = ("A", "B", "pgbench A", "pgbench B")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.semaphores",
        description="What semaphores cost: cycles/s before migration 0017 and with it, and hot keys of"
        " max_holders 1 and 4.",
    )
    turn_arguments(parser)
    parser.add_argument("--history", type=int, help="ended locks seeded (default: 200000; quick: 50000)")
    parser.add_argument("--live", type=int, default=10_000, help="live locks seeded (default: 10000)")
    parser.add_argument("--base", help="the commit measured as before (default: the one before 0017's)")
    args = parser.parse_args(argv)
    settle_turns(parser, args)
    args.history = args.history if args.history is not None else (50_000 if args.quick else 200_000)
    return args


def run_rounds(
    args: argparse.Namespace, sides: dict[str, tuple[str, str]], databases: dict[str, str], workdir: Path
) -> dict[str, list[Result]]:
    rounds: dict[str, list[Result]] = {name: [] for name in SIDES}
    for round_ in range(args.rounds):
        log(f"round {round_ + 1}/{args.rounds}: each side {args.warmup} s warm-up + {args.duration} s ...")
        for name in SIDES if round_ % 2 == 0 else SIDES[::-1]:
            if name.startswith("pgbench"):
                url = databases[name.removeprefix("pgbench ")]
                result = run_pgbench(url, args.clients, args.warmup, args.duration, workdir)
            else:
                base_url, key = sides[name]
                result = run_http(
                    base_url,
                    "helix",
                    key,
                    args.clients,
                    args.processes,
                    args.warmup,
                    args.duration,
                    False,
                    round_,
                )
            rounds[name].append(result)
            log(f"  {name}: {result.cycles_per_second:,.0f} cycles/s")
    return rounds


def hot_line(name: str, result: Result, duration: int) -> str:
    conflicts = [percentile(result.conflicts, pct) * 1000 for pct in (50, 99)]
    return (
        f"  {name}: {result.cycles_per_second:,.0f} grants/s, p50/p99 {result.acquire_p50_ms:.2f}/"
        f"{result.acquire_p99_ms:.2f} ms; {len(result.conflicts) / duration:,.0f} answers 409/s, p50/p99"
        f" {conflicts[0]:.2f}/{conflicts[1]:.2f} ms"
    )


def report(
    args: argparse.Namespace, setup: list[str], rounds: dict[str, list[Result]], hot: dict[str, Result]
) -> str:
    medians = {
        name: statistics.median(r.cycles_per_second for r in results) for name, results in rounds.items()
    }
    lines = [
        f"What semaphores cost: {args.clients} clients, {args.rounds} round(s) of {args.warmup} s warm-up +"
        f" {args.duration} s per side, sides in turn; {CPUS} CPUs shared by everything",
        *(f"  {line}" for line in setup),
        "",
        "1. max_holders 1, each client on a key of its own (median cycles/s; every round in brackets):",
    ]
    for name in SIDES:
        every = ", ".join(f"{r.cycles_per_second:,.0f}" for r in rounds[name])
        lines.append(f"  {name:>9}: {medians[name]:>7,.0f}  ({every})")
    lines += [
        f"  B/A over HTTP: {medians['B'] / medians['A']:.3f}; B/A in pgbench:"
        f" {medians['pgbench B'] / medians['pgbench A']:.3f}",
        f"  HTTP p50/p99 ms (median run): A {statistics.median(r.p50_ms for r in rounds['A']):.1f}/"
        f"{statistics.median(r.p99_ms for r in rounds['A']):.1f},"
        f" B {statistics.median(r.p50_ms for r in rounds['B']):.1f}/"
        f"{statistics.median(r.p99_ms for r in rounds['B']):.1f}",
        "",
        f"2. Hot keys on B: {args.clients} clients on one key for {args.duration} s, acquire (again after a"
        " 409) then release:",
        hot_line("max_holders 1", hot["plain"], args.duration),
        hot_line(f"max_holders {SEMAPHORE_HOLDERS}", hot["semaphore"], args.duration),
        hot_line("shared (readers)", hot["shared"], args.duration),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupted)
    setup = [load_average()]
    with said_and_stopped(), ExitStack() as cleanup:
        workdir = Path(tempfile.mkdtemp(prefix="helix-bench-semaphores-"))
        cleanup.callback(shutil.rmtree, workdir, ignore_errors=True)
        database = cleanup.enter_context(bench_database(workdir))
        url = database[0]
        before = before_and_after(database, workdir, args.base, MIGRATION, (args.history, args.live), cleanup)
        base_db_url, base_env = before.url, before.env
        setup += before.setup
        log(setup[-1])
        a_url, _ = cleanup.enter_context(
            service_process(base_db_url, args.workers, workdir / "a.log", base_env)
        )
        b_url, _ = cleanup.enter_context(service_process(url, args.workers, workdir / "b.log"))
        sides = {"A": (a_url, create_key(base_db_url, a_url)), "B": (b_url, create_key(url, b_url))}
        setup.append(f"A and B: helix-locks serve --workers {args.workers}, an organization API key")
        rounds = run_rounds(args, sides, {"A": base_db_url, "B": url}, workdir)
        hot: dict[str, Result] = {}
        for side in ("hot", "semaphore", "shared"):
            log(f"hot key ({side}): {args.warmup} s warm-up + {args.duration} s ...")
            hot["plain" if side == "hot" else side] = run_http(
                b_url, side, sides["B"][1], args.clients, args.processes, args.warmup, args.duration, False
            )
    print(report(args, setup, rounds, hot))
    failures = sum(r.failures for results in rounds.values() for r in results)
    failures += sum(r.failures for r in hot.values())
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
