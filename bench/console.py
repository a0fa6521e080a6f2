"""Benchmark: does an open console slow the service down (issue 23)? In one run:

    python -m bench.console            # 3 rounds of 3 s warm-up + 10 s per side
    python -m bench.console --quick    # smoke run: 1 round of 1 s + 4 s

(from the repository root). 32 clients on one busy key, each acquiring (again after every 409)
and releasing at once, through `serve --workers 2` with an organization API key: grants/s and
409s/s, first with no console open ("closed"), then with a headless chromium showing /console,
signed in with the same organization's key, following the event stream, with the busy key's
timeline open ("open"). The sides take turns, reversed every other round; medians are reported,
with open/closed. The database and the cleanup are bench/run.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from bench import BenchError, interrupted, load_average, log, said_and_stopped, settle_turns, turn_arguments
from bench.database import bench_database
from bench.http_load import run_http
from bench.results import CPUS, Result, percentile
from bench.servers import create_key, service_process
from harness.browser import CHROMEDRIVER, CHROMIUM, offline_chromium
from helix_locks.server.migrate import migrate

SIDES = ("closed", "watcher", "open")
BUSY_KEY = "hot-key"  # the job type bench.http_load's "hot" side cycles, in organization "bench"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.console",
        description="Grants/s on a busy key with the console closed, and open on that key's timeline.",
    )
    turn_arguments(parser)
    args = parser.parse_args(argv)
    settle_turns(parser, args)
    return args


@contextlib.contextmanager
def console_open(base_url: str, key: str) -> Iterator[Any]:
    """A headless chromium on /console, signed in with `key`, following the event stream, with the
    busy key's timeline open; closed on exit."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    if not (CHROMIUM and CHROMEDRIVER):
        raise BenchError("needs Debian's chromium and chromium-driver (apt-get install)")
    browser = offline_chromium()
    # The operator's browser runs on the operator's machine, not the service's: here it shares the
    # 2 cores, so it runs at the lowest priority, and what is measured is the service's share.
    for pid in browser_processes(browser.service.process.pid):
        os.setpriority(os.PRIO_PROCESS, pid, 19)
    try:
        browser.set_window_size(1280, 800)
        browser.get(f"{base_url}/console")
        wait = WebDriverWait(browser, 30, 0.05)
        field = wait.until(lambda b: b.find_element(By.ID, "api-key"))
        wait.until(lambda b: field.is_displayed())
        field.send_keys(key)
        browser.find_element(By.CSS_SELECTOR, "#sign-in-form button[type=submit]").click()
        wait.until(lambda b: b.find_element(By.ID, "stream-state").text.startswith("Live"))
        # The busy key's row is there while a lock of it is held: hold one to open its timeline.
        auth = {"Authorization": f"Bearer {key}"}
        body = {"organization_id": "bench", "job_type": BUSY_KEY, "holder": "console", "ttl_seconds": 30}
        held = httpx.post(f"{base_url}/v1/locks", json=body, headers=auth, timeout=10).json()
        try:
            opener = "#lock-rows tr button.key"
            wait.until(lambda b: b.find_element(By.CSS_SELECTOR, opener).click() or True)
            wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#timeline-chart svg"))
        finally:
            headers = {**auth, "Lock-Token": held["token"]}
            httpx.delete(f"{base_url}/v1/locks/{held['id']}", headers=headers, timeout=10)
        yield browser
    finally:
        browser.quit()


def browser_processes(driver: int) -> list[int]:
    """chromedriver and every process under it (chromium's), by their parents in /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_bytes()
                parents[int(entry.name)] = int(stat[stat.rindex(b")") + 2 :].split()[1])
    found, frontier = [driver], [driver]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        found += frontier
    return found


@contextlib.contextmanager
def watching(base_url: str, key: str) -> Iterator[None]:
    """A plain watcher of the organization's events (curl), what the console's stream costs alone."""
    url = f"{base_url}/v1/events?organization_id=bench"
    command = ["curl", "-sN", "-H", f"Authorization: Bearer {key}", url]
    curl = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    try:
        yield
    finally:
        curl.kill()
        curl.wait()


def run_side(args: argparse.Namespace, base_url: str, key: str, side: str, round_: int) -> Result:
    opened = {"open": console_open, "watcher": watching}.get(side)
    with opened(base_url, key) if opened else contextlib.nullcontext() as browser:
        result = run_http(
            base_url, "hot", key, args.clients, args.processes, args.warmup, args.duration, False, round_
        )
        if browser is not None:
            # It did follow: the timeline drew the grants the stream brought (a few seconds' worth
            # are in view at once, as they end and begin).
            bars = "return document.querySelectorAll('#timeline-chart svg g.lock').length"
            drawn = browser.execute_script(bars)
            if not drawn:
                raise BenchError("the open console drew no lock of the busy key: it did not follow")
            log(f"  the open console's timeline shows {drawn} locks of the busy key")
        return result


def line(name: str, results: list[Result], duration: int) -> str:
    grants = statistics.median(r.cycles_per_second for r in results)
    conflicts = statistics.median(len(r.conflicts) / duration for r in results)
    every = ", ".join(f"{r.cycles_per_second:,.0f}" for r in results)
    p99 = statistics.median(r.acquire_p99_ms for r in results)
    conflict_p99 = statistics.median(percentile(r.conflicts, 99) * 1000 for r in results)
    return (
        f"  {name:>6}: {grants:,.0f} grants/s ({every}), acquire p99 {p99:.1f} ms;"
        f" {conflicts:,.0f} answers 409/s, p99 {conflict_p99:.1f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupted)
    setup = load_average()
    rounds: dict[str, list[Result]] = {side: [] for side in SIDES}
    with said_and_stopped(), ExitStack() as cleanup:
        workdir = Path(tempfile.mkdtemp(prefix="helix-bench-console-"))
        cleanup.callback(shutil.rmtree, workdir, ignore_errors=True)
        url, where = cleanup.enter_context(bench_database(workdir))
        migrate(url)
        base_url, _ = cleanup.enter_context(service_process(url, args.workers, workdir / "serve.log"))
        key = create_key(url, base_url)
        for round_ in range(args.rounds):
            log(f"round {round_ + 1}/{args.rounds}: {args.warmup} s warm-up + {args.duration} s a side ...")
            for side in SIDES if round_ % 2 == 0 else SIDES[::-1]:
                result = run_side(args, base_url, key, side, round_)
                rounds[side].append(result)
                log(f"  {side}: {result.cycles_per_second:,.0f} grants/s")
    medians = {side: statistics.median(r.cycles_per_second for r in rounds[side]) for side in SIDES}
    conflicts = {side: statistics.median(len(r.conflicts) for r in rounds[side]) for side in SIDES}
    print(
        "\n".join(
            [
                f"The console on a busy key: {args.clients} clients on one key ('{BUSY_KEY}'), acquire (again"
                f" after a 409) then release; {args.rounds} round(s) of {args.warmup} s warm-up +"
                f" {args.duration} s per side, sides in turn; {CPUS} CPUs shared by everything",
                f"  {setup}",
                f"  database: {where}; serve --workers {args.workers}, an organization API key",
                "  closed: no console; watcher: curl on /v1/events; open: headless chromium at nice 19 on"
                " /console with the key's timeline, following the events",
                *(line(side, rounds[side], args.duration) for side in SIDES),
                f"  open/closed grants/s: {medians['open'] / medians['closed']:.3f}; 409s/s:"
                f" {conflicts['open'] / conflicts['closed']:.3f}; a plain watcher (curl) instead of the"
                f" console: {medians['watcher'] / medians['closed']:.3f},"
                f" {conflicts['watcher'] / conflicts['closed']:.3f}",
            ]
        )
    )
    failures = sum(r.failures for results in rounds.values() for r in results)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
