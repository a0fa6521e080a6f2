"""Soak: a steady load of racing lock clients for a long time, some dying with their locks.

    python -m bench.soak                  # 30 minutes, from the repository root
    python -m bench.soak --minutes 10 --clients 16 --report-every 60
    python -m bench.soak --kill-every 60  # two replicas, one SIGKILLed and restarted every 60 s,
                                          # and workers under `helix-locks run` SIGKILLed too

The service (`helix-locks serve`, keys required) runs on a throwaway database (DATABASE_URL's
server, else an embedded PostgreSQL). The clients are harness/load.py's: each takes a random one of
six keys, works, sometimes renews, releases; a share of them die holding the lock (--crash-rate),
which the next acquire must reclaim. Every --report-every seconds it prints grants/s, acquire
answers/s, acquire p99, unexpected and unknown answers, the checker's verdict on the history so
far, and the service's RSS; at the end, the checker of harness/history.py judges the whole
history, and the RSS at start and end.

With --kill-every S the service runs as two replicas, and every S seconds one of them, at random,
is SIGKILLed and started again; the clients use both. Beside the clients, --runners worker
processes run `helix-locks run ... -- sleep` on the same keys, started again as they end, and
one of them is SIGKILLed (with its command) at each kill too: its lock must be reclaimed, never
granted twice. Answers lost with a killed replica count as unknown, not as failures; a violation
of the checker's always counts.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from bench import interrupted, log
from bench.database import bench_database
from bench.results import percentile
from bench.servers import service_process
from harness.history import check, database_history
from harness.load import KEYS, Load
from harness.processes import helix_command, rss_mb
from helix_locks.server import keys
from helix_locks.server.migrate import migrate


class Replicas:
    """The service's replicas on one database. `urls` is the list the clients pick from, kept
    current as replicas are killed and started again."""

    def __init__(self, url: str, count: int, workdir: Path, stack: ExitStack) -> None:
        self.url, self.workdir, self.stack = url, workdir, stack
        self.started = 0
        self.urls: list[str] = []
        self.processes: list[subprocess.Popen[bytes]] = []
        for _ in range(count):
            base_url, process = self._start()
            self.urls.append(base_url)
            self.processes.append(process)

    def _start(self) -> tuple[str, subprocess.Popen[bytes]]:
        self.started += 1
        log_path = self.workdir / f"serve-{self.started}.log"
        return self.stack.enter_context(service_process(self.url, 1, log_path))

    @property
    def killed(self) -> int:
        return self.started - len(self.processes)

    def kill_one(self, rng: random.Random) -> None:
        """SIGKILL a replica at random, and start another in its place."""
        n = rng.randrange(len(self.processes))
        self.processes[n].kill()
        self.processes[n].wait()
        self.urls[n], self.processes[n] = self._start()

    def rss(self) -> float:
        return sum(rss_mb(process.pid) for process in self.processes)


class Runners:
    """Workers under `helix-locks run` on the load's keys, each holding its lock a moment, started
    again as they end until stopped; kill_one() SIGKILLs one of them with its command."""

    def __init__(self, count: int, replicas: Replicas, api_key: str, ttl: float, rng: random.Random) -> None:
        self.count, self.replicas, self.api_key, self.ttl, self.rng = count, replicas, api_key, ttl, rng
        self.running: list[subprocess.Popen[bytes]] = []
        self.killed = 0
        self.exits: dict[int, int] = {}  # how many ended with each exit status
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._keep_running, daemon=True)

    def __enter__(self) -> Runners:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for process in self.running:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def _spawn(self) -> subprocess.Popen[bytes]:
        organization_id, job_type = self.rng.choice(KEYS)
        work = ["sleep", f"{self.rng.uniform(0.1, 0.5):.2f}"]
        lock = ["--org", organization_id, "--job-type", job_type, "--ttl", str(self.ttl), "--wait", "5"]
        env = {**os.environ, "HELIX_LOCKS_API_KEY": self.api_key}
        env["HELIX_LOCKS_URL"] = self.rng.choice(self.replicas.urls)
        return subprocess.Popen(
            helix_command("run", *lock, "--", *work),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: killed with its command
        )

    def _keep_running(self) -> None:
        while not self._stop.wait(0.05):
            with self._lock:
                for process in [p for p in self.running if p.poll() is not None]:
                    self.running.remove(process)
                    self.exits[process.returncode] = self.exits.get(process.returncode, 0) + 1
                while len(self.running) < self.count:
                    self.running.append(self._spawn())

    def kill_one(self) -> None:
        with self._lock:
            alive = [p for p in self.running if p.poll() is None]
            if alive:
                os.killpg(self.rng.choice(alive).pid, signal.SIGKILL)
                self.killed += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--crash-rate", type=float, default=0.1, help="share of grants whose holder dies")
    parser.add_argument("--ttl", type=float, default=2.0, help="lease of each grant, seconds")
    parser.add_argument("--report-every", type=float, default=60.0, help="seconds")
    parser.add_argument("--kill-every", type=float, default=0.0, help="seconds between kills (0: none)")
    parser.add_argument("--runners", type=int, default=4, help="`helix-locks run` workers, with --kill-every")
    parser.add_argument("--seed", type=int, default=1, help="of which replica and runner are killed")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, interrupted)
    killing = args.kill_every > 0
    rng = random.Random(args.seed)
    with (
        tempfile.TemporaryDirectory(prefix="helix-soak-") as tmp,
        bench_database(Path(tmp)) as (url, where),
        ExitStack() as stack,
    ):
        migrate(url)
        api_key = keys.create(url, None)  # an admin key: the clients work in two organizations
        replicas = Replicas(url, 2 if killing else 1, Path(tmp), stack)
        runners = Runners(args.runners if killing else 0, replicas, api_key, args.ttl, rng)
        kills = f"; a replica and a runner SIGKILLed every {args.kill_every:g} s" if killing else ""
        log(f"{where}; replicas {' '.join(replicas.urls)}; {args.clients} clients, {args.minutes} min{kills}")
        rss_start = replicas.rss()
        load = Load(
            replicas.urls, clients=args.clients, ttl=args.ttl, crash_rate=args.crash_rate, api_key=api_key
        )
        started = time.monotonic()
        with load, runners:
            report_over_time(load, args, started, replicas, runners, rng, url)
        rss_end = replicas.rss()
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
        f" {len(history)} grants in the database, the runners' included;"
        f" {replicas.killed} replicas and {runners.killed} runners SIGKILLed, runners' exits {runners.exits};"
        f" unexpected answers {run.errors()}, unknown {run.unknown};"
        f" RSS {rss_start:.1f} MB at start, {rss_end:.1f} MB at end; checker: {len(violations)} violations",
        flush=True,
    )
    for violation in violations[:20]:
        print(f"  {violation}")
    # Answers lost with a killed replica are unknown, as they should be; without kills none may be.
    return 1 if violations or run.errors() or (run.unknown and not killing) else 0


def report_over_time(
    load: Load,
    args: argparse.Namespace,
    started: float,
    replicas: Replicas,
    runners: Runners,
    rng: random.Random,
    url: str,
) -> None:
    """A line per --report-every seconds until --minutes have passed, with the checker's verdict on
    the history so far; and the kills, every --kill-every seconds."""
    columns = ("minute", "grants/s", "acquires/s", "p99 ms", "died", "unexpected", "unknown", "killed")
    print(" ".join(f"{name:>10}" for name in (*columns, "checker", "RSS MB")), flush=True)
    seen_grants = seen_acquires = 0
    end = started + args.minutes * 60
    last_report = started
    next_kill = started + args.kill_every if args.kill_every > 0 else float("inf")
    while (now := time.monotonic()) < end:
        time.sleep(max(min(last_report + args.report_every, next_kill, end) - now, 0))
        if time.monotonic() >= next_kill:
            replicas.kill_one(rng)
            runners.kill_one()
            next_kill += args.kill_every
        now = time.monotonic()
        if now < min(last_report + args.report_every, end):
            continue
        interval, last_report = now - last_report, now
        run = load.run
        grants, acquires = len(run.granted_at), len(run.latencies)
        window = sorted(run.latencies[seen_acquires:acquires])
        # What clients were told first, then the database: every answer told so far had committed
        # before it was told, while the rows read may be newer than any answer (never the reverse).
        told, renewed, released = list(run.told), list(run.renewed), list(run.released)
        violations = check(database_history(url), told, renewed, released)
        values = (
            f"{(now - started) / 60:.1f}",
            f"{(grants - seen_grants) / interval:.1f}",
            f"{(acquires - seen_acquires) / interval:.1f}",
            f"{percentile(window, 99) * 1000:.1f}",
            str(run.crashes),
            str(sum(run.errors().values())),
            str(run.unknown),
            str(replicas.killed + runners.killed),
            f"{len(violations)} bad" if violations else "ok",
            f"{replicas.rss():.1f}",
        )
        print(" ".join(f"{value:>10}" for value in values), flush=True)
        seen_grants, seen_acquires = grants, acquires


if __name__ == "__main__":
    sys.exit(main())
