"""Benchmark: Helix Locks beside the bare app, etcd and pgbench, acquire+release cycles, in one run.

    python -m bench.run            # 1, 8 and 32 clients; 3 runs of 3 s warm-up + 10 s per level and side
    python -m bench.run --quick    # smoke run: 1 run of 1 s warm-up + 3 s
    python -m bench.run --chart chart.png   # also draw cycles/s and p99 against clients (matplotlib)
    python -m bench.run --base REV # also "helix-A": the service and schema of commit REV, in turns

(from the repository root). The parts are modules beside this one: the servers, the HTTP client
and load, pgbench, wrk, the plan checks and the report; this one is the command.

One cycle takes a lock and gives it back, each client on a key of its own, so nothing conflicts:
- helix: POST /v1/locks then DELETE /v1/locks/{id} to `helix-locks serve --workers 2`, with an
  organization API key sent as Authorization: Bearer (keys required, as deployed);
- bare: the same two requests to bench/bare.py, a minimal FastAPI + psycopg app running the same
  statements under uvicorn with the same flags and workers, without keys, logs or metrics: what
  the stack itself costs;
- etcd: a single-node etcd (Debian's etcd-server) through its JSON gateway, a put-if-absent
  transaction then a compare-and-delete on the put's revision;
- pgbench: helix_acquire_job_lock + helix_release_job_lock, prepared: as fast as these cycles can
  go on this database.
The sides take turns within each run; the median run is reported, with the ratios Helix/bare,
Helix/etcd and Helix/pgbench. Then 32 clients fight over one key (the hot key): the 409 answers
beside the grants.
Last, where Debian's wrk is installed, wrk drives the same helix, bare and etcd cycles once per
level (bench/wrk/cycles.lua, a thread per connection) as a cross-check of the Python load
generator, with the service workers' CPU time per cycle for helix and bare.

With --base REV (or --since NNNN: the commit before the one that added migration NNNN), a fifth
and sixth side take their turns too: "helix-A", the service of commit REV (exported with `git
archive`, served from there) on a database of its own beside this one's, migrated by REV's code
and seeded alike, and "pgbench-A", pgbench on it; the report adds this tree's figures over A's and
both beside etcd's.

The database is a throwaway one: `helix_bench_<random>` on DATABASE_URL's server when that is set,
else an embedded PostgreSQL in a temporary directory. It is seeded (released history of 100
organizations and live locks, then ANALYZE) before anything is measured, and everything is removed
at the end, on error and on Ctrl-C too.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import signal
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import psycopg

from bench import BenchError, interrupted, load_average, log, said_and_stopped
from bench.chart import draw
from bench.database import before_and_after, bench_database, migration_named, seed
from bench.http_load import run_http
from bench.pgbench import run_pgbench
from bench.plans import check_listing_plans, check_plans
from bench.report import BASE_SIDES, SIDES, median, report
from bench.results import CPUS, Result
from bench.servers import bare_process, create_key, etcd_server, service_process, worker_pids
from bench.wrk import WrkResult, run_wrk
from harness.processes import rss_mb
from harness.proxies import pgbouncer, through
from helix_locks.server.embedded import DIRECT_DATABASE_URL
from helix_locks.server.migrate import migrate


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run",
        description="Measure acquire+release cycles/s and latency (p50, p99) over HTTP at several "
        "concurrencies, and the same SQL driven directly by pgbench as the limit. Uses DATABASE_URL's "
        "server (in a throwaway database) when set, else an embedded PostgreSQL.",
    )
    parser.add_argument(
        "--clients",
        default="1,8,32",
        help="concurrency levels, comma-separated (default: 1,8,32)",
    )
    parser.add_argument("--duration", type=int, help="seconds measured per level and side (default: 10)")
    parser.add_argument("--warmup", type=int, help="seconds of warm-up before each measurement (default: 3)")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: one run, 3 s per level after 1 s of warm-up"
    )
    parser.add_argument(
        "--runs", type=int, help="runs of every level and side; medians are reported (default: 3)"
    )
    parser.add_argument("--workers", type=int, default=2, help="service worker processes (default: 2)")
    parser.add_argument(
        "--processes",
        type=int,
        default=CPUS,
        help=f"load-generator processes sharing the HTTP clients (default: {CPUS}, the CPU count)",
    )
    parser.add_argument(
        "--httpx",
        action="store_true",
        help="send the HTTP load through httpx.AsyncClient instead of the minimal built-in HTTP/1.1 "
        "client (same requests, several times the CPU per request)",
    )
    parser.add_argument(
        "--history",
        type=int,
        default=1_000_000,
        help="ended locks seeded before measuring, across 100 organizations (default: 1000000)",
    )
    parser.add_argument("--live", type=int, default=10_000, help="live locks seeded (default: 10000)")
    parser.add_argument(
        "--pgbouncer",
        action="store_true",
        help="put Debian's PgBouncer (transaction mode) between the service and PostgreSQL, with the"
        " direct URL set: the cost of the pooler mode",
    )
    parser.add_argument(
        "--chart",
        type=Path,
        metavar="PATH",
        help="also draw cycles/s and p99 against clients, every side's median run, as a PNG"
        " (needs matplotlib)",
    )
    parser.add_argument("--base", help="also serve commit REV's service and schema, as side A")
    parser.add_argument("--since", help="A is the commit before the one that added migration NNNN")
    args = parser.parse_args(argv)
    try:
        args.migration = migration_named(args.since) if args.since else None
    except ValueError as exc:
        parser.error(f"--since: {exc}")
    args.ab = bool(args.base or args.migration)
    if args.ab and args.pgbouncer:
        parser.error("--pgbouncer measures one side: not with --base or --since")
    if args.chart and importlib.util.find_spec("matplotlib") is None:
        parser.error("--chart needs matplotlib: pip install matplotlib (it is in the dev extra)")
    try:
        args.levels = [int(level) for level in args.clients.split(",")]
    except ValueError:
        parser.error("--clients takes integers separated by commas, e.g. 1,8,32")
    if not args.levels or min(args.levels) < 1:
        parser.error("--clients takes positive integers")
    if args.history < 0 or args.live < 0:
        parser.error("--history and --live must be >= 0")
    args.duration = args.duration if args.duration is not None else (3 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.runs = args.runs if args.runs is not None else (1 if args.quick else 3)
    if min(args.duration, args.workers, args.processes, args.runs) < 1 or args.warmup < 0:
        parser.error("--duration, --workers, --processes and --runs must be at least 1, --warmup at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupted)
    # Anything else running skews the numbers on a small machine: say how busy it was.
    setup = [load_average()]
    sides = SIDES + (BASE_SIDES if args.ab else ())
    runs: dict[str, list[list[Result]]] = {side: [[] for _ in args.levels] for side in sides}
    with said_and_stopped(), ExitStack() as cleanup:
        workdir = Path(tempfile.mkdtemp(prefix="helix-bench-"))
        cleanup.callback(shutil.rmtree, workdir, ignore_errors=True)
        database = cleanup.enter_context(bench_database(workdir))
        url, where = database
        if args.ab:
            before = before_and_after(
                database, workdir, args.base, args.migration, (args.history, args.live), cleanup
            )
            setup += before.setup
        else:
            with psycopg.connect(url) as conn:
                version = conn.execute("SHOW server_version").fetchone()
            setup.append(f"database: {where}, PostgreSQL {version[0] if version else '?'}")
            log(setup[-1])
            migrate(url)
            setup.append(f"seeded: {seed(url, args.history, args.live)}")
        log(setup[-1])
        setup.append(check_plans(url))
        log(setup[-1])
        setup.append(check_listing_plans(url))
        log(setup[-1])
        service_env = None
        if args.pgbouncer:
            pooler = cleanup.enter_context(pgbouncer(url))
            service_env = {"DATABASE_URL": through(pooler.port, url), DIRECT_DATABASE_URL: url}
            setup.append(
                "helix reaches PostgreSQL through PgBouncer (Debian's), pool_mode = transaction, with"
                " HELIX_LOCKS_DIRECT_DATABASE_URL for LISTEN; pgbench goes direct"
            )
        base_url, process = cleanup.enter_context(
            service_process(url, args.workers, workdir / "service.log", service_env)
        )
        key = create_key(url, base_url)
        bare_url, bare_app = cleanup.enter_context(bare_process(url, args.workers, workdir / "bare.log"))
        etcd_url = cleanup.enter_context(etcd_server(workdir))
        client = "httpx.AsyncClient" if args.httpx else "a minimal HTTP/1.1 client"
        processes = min(args.processes, max(args.levels))
        setup.append(
            "helix: POST /v1/locks + DELETE /v1/locks/{id} to helix-locks serve"
            f" --workers {args.workers}, with an organization API key (keys required, as deployed)"
        )
        setup.append(
            f"bare: bench/bare.py, FastAPI + psycopg_pool running the same two statements, uvicorn"
            f" --workers {args.workers} (httptools, no access log), no key, logs or metrics"
        )
        setup.append(
            "etcd: a single node (Debian's etcd-server), its JSON gateway: a put-if-absent transaction,"
            " then a compare-and-delete transaction on the put's revision"
        )
        setup.append(f"HTTP load: {processes} load process(es) running {client}, keep-alive connections")
        setup.append("pgbench: the same two SQL function calls, -M prepared, one transaction per cycle")
        timing = f"{args.warmup} s warm-up + {args.duration} s"
        http_sides = {"helix": (base_url, key), "bare": (bare_url, None), "etcd": (etcd_url, None)}
        databases = {"pgbench": url}
        if args.ab:
            a_url, _ = cleanup.enter_context(
                service_process(before.url, args.workers, workdir / "a.log", before.env)
            )
            with psycopg.connect(before.url) as conn:
                applied = conn.execute("SELECT count(*) FROM helix_schema_migrations").fetchone()
            if applied != (before.migrations,):
                raise BenchError("serving A migrated its database further: it runs this tree's code")
            http_sides["helix-A"] = (a_url, create_key(before.url, a_url))
            databases["pgbench-A"] = before.url
            setup.append("helix-A and pgbench-A: the same, on A's service and database")
        for run in range(args.runs):
            for index, clients in enumerate(args.levels):
                log(f"run {run + 1}/{args.runs}, {clients} client(s): each side {timing} ...")
                # A and B take turns: helix-A goes last in one run, first in the next.
                order = list(http_sides)
                if args.ab and run % 2 == 1:
                    order = ["helix-A", *order[:-1]]
                for side in order:
                    side_url, side_key = http_sides[side]
                    runs[side][index].append(
                        run_http(
                            side_url,
                            side,
                            side_key,
                            clients,
                            args.processes,
                            args.warmup,
                            args.duration,
                            args.httpx,
                            run,
                        )
                    )
                for side in databases if run % 2 == 0 else list(databases)[::-1]:
                    measured = run_pgbench(databases[side], clients, args.warmup, args.duration, workdir)
                    runs[side][index].append(measured)
        log(f"hot key: {max(args.levels)} clients on one key, {timing} ...")
        hot = run_http(
            base_url, "hot", key, max(args.levels), args.processes, args.warmup, args.duration, args.httpx
        )
        rss = [rss_mb(pid) for pid in worker_pids(process.pid)]
        checked: dict[str, list[WrkResult]] = {side: [] for side in SIDES[:3]}
        served = {"helix": worker_pids(process.pid), "bare": worker_pids(bare_app.pid), "etcd": []}
        if shutil.which("wrk"):
            for clients in args.levels:
                log(f"wrk cross-check, {clients} client(s): each side {timing} ...")
                for side in checked:
                    side_url, side_key = http_sides[side]
                    checked[side].append(
                        run_wrk(side_url, side, side_key, clients, args.warmup, args.duration, served[side])
                    )
    print(report(args, setup, runs, hot, rss, checked))
    if args.chart:
        draw(args.chart, args.levels, {side: [median(level) for level in runs[side]] for side in SIDES})
        log(f"chart: {args.chart}")
    failures = sum(result.failures for levels in runs.values() for level in levels for result in level)
    failures += sum(result.failures for results in checked.values() for result in results)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
