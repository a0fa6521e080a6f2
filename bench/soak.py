"""Soak: a steady load of racing lock clients for a long time, some dying with their locks.

    python -m bench.soak                  # 30 minutes, from the repository root
    python -m bench.soak --minutes 10 --clients 16 --report-every 60

The service (`helix-locks serve`, keys required) runs on a throwaway database (DATABASE_URL's
server, else an embedded PostgreSQL). The clients are tests/load.py's: each takes a random one of
six keys, works, sometimes renews, releases; a share of them die holding the lock (--crash-rate),
which the next acquire must reclaim. Every --report-every seconds it prints grants/s, acquire
answers/s, acquire p99, unexpected answers, and the service's RSS; at the end, the checker of
tests/history.py judges the whole history, and the RSS at start and end.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench import interrupted, log
from bench.database import bench_database
from bench.results import percentile
from bench.servers import service_process
from helix_locks import keys
from helix_locks.migrate import migrate
from tests.history import check, database_history
from tests.load import Load
from tests.support import rss_mb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--crash-rate", type=float, default=0.1, help="share of grants whose holder dies")
    parser.add_argument("--ttl", type=float, default=2.0, help="lease of each grant, seconds")
    parser.add_argument("--report-every", type=float, default=60.0, help="seconds")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, interrupted)
    with tempfile.TemporaryDirectory(prefix="helix-soak-") as tmp, bench_database(Path(tmp)) as (url, where):
        migrate(url)
        api_key = keys.create(url, None)  # an admin key: the clients work in two organizations
        with service_process(url, 1, Path(tmp) / "serve.log") as (base_url, process):
            log(f"{where}; service at {base_url}; {args.clients} clients for {args.minutes} min")
            rss_start = rss_mb(process.pid)
            load = Load(
                [base_url], clients=args.clients, ttl=args.ttl, crash_rate=args.crash_rate, api_key=api_key
            )
            started = time.monotonic()
            with load:
                report_over_time(load, args, started, process.pid)
            rss_end = rss_mb(process.pid)
        seconds = time.monotonic() - started
        run = load.run
        history = database_history(url)
        violations = check(history, run.told, run.renewed, run.released)
    latencies = sorted(run.latencies)
    p50, p99 = (percentile(latencies, pct) * 1000 for pct in (50, 99))
    reclaims = sum(grant.release_reason == "reclaimed" for grant in history)
    print(
        f"\n{seconds / 60:.1f} min, {args.clients} clients: {len(run.told)} grants"
        f" ({len(run.told) / seconds:.1f}/s), {len(latencies)} acquires ({len(latencies) / seconds:.1f}/s),"
        f" acquire p50/p99 {p50:.1f}/{p99:.1f} ms, {len(run.released)} releases,"
        f" {len(run.renewed)} renewals, {run.crashes} holders died, {reclaims} reclaims;"
        f" unexpected answers {run.errors()}, unknown {run.unknown};"
        f" RSS {rss_start:.1f} MB at start, {rss_end:.1f} MB at end; checker: {len(violations)} violations",
        flush=True,
    )
    for violation in violations[:20]:
        print(f"  {violation}")
    return 1 if violations or run.errors() or run.unknown else 0


def report_over_time(load: Load, args: argparse.Namespace, started: float, pid: int) -> None:
    """A line per --report-every seconds until --minutes have passed."""
    columns = ("minute", "grants/s", "acquires/s", "p99 ms", "died", "unexpected", "RSS MB")
    print(" ".join(f"{name:>10}" for name in columns), flush=True)
    seen_grants = seen_acquires = 0
    while (elapsed := time.monotonic() - started) < args.minutes * 60:
        interval = min(args.report_every, args.minutes * 60 - elapsed)
        time.sleep(interval)
        run = load.run
        grants, acquires = len(run.granted_at), len(run.latencies)
        window = sorted(run.latencies[seen_acquires:acquires])
        values = (
            f"{(time.monotonic() - started) / 60:.1f}",
            f"{(grants - seen_grants) / interval:.1f}",
            f"{(acquires - seen_acquires) / interval:.1f}",
            f"{percentile(window, 99) * 1000:.1f}",
            str(run.crashes),
            str(sum(run.errors().values()) + run.unknown),
            f"{rss_mb(pid):.1f}",
        )
        print(" ".join(f"{value:>10}" for value in values), flush=True)
        seen_grants, seen_acquires = grants, acquires


if __name__ == "__main__":
    sys.exit(main())
