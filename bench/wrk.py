"""wrk: the same HTTP cycles from Debian's C load generator, as a cross-check of our own client."""

from __future__ import annotations

import base64
import json
import resource
from dataclasses import dataclass
from pathlib import Path

from bench import BenchError, tool_output
from bench.results import busy_cores, busy_cpu_ticks, process_cpu_seconds

WRK_SCRIPT = Path(__file__).resolve().parent / "wrk" / "cycles.lua"


@dataclass
class WrkResult:
    """One wrk run: cycles/s, and latency per request (wrk times requests, not cycles)."""

    cycles_per_second: float
    p50_ms: float
    p99_ms: float
    failures: int
    load_cpu: float
    busy_cpu: float
    service_cpu: float  # cores used by the processes given to run_wrk (NaN when none)

    @property
    def cpu_ms_per_cycle(self) -> float:
        """Those processes' CPU time per cycle, in ms."""
        return self.service_cpu / self.cycles_per_second * 1000 if self.cycles_per_second else float("nan")


def wrk_args(side: str, key: str | None, clients: int, phase: str) -> list[str]:
    """The script's arguments: the side, then the API key (helix, bare: "" for none) and key prefix,
    or etcd's keys (base64), one per thread. Fresh keys for each side (`side` may say more, as
    "helix-auth-2") and phase: a cycle cut off leaves its key taken."""
    if side != "etcd":
        return [side, key or "", f"wrk-{side}-{phase}-{clients}"]
    names = [f"wrk-{side}-{phase}-{clients}-{n}" for n in range(clients)]
    return [side, *(base64.b64encode(f"helix-bench/{name}".encode()).decode() for name in names)]


def run_wrk(
    url: str,
    side: str,
    key: str | None,
    clients: int,
    warmup: int,
    duration: int,
    service: list[int] | None = None,
) -> WrkResult:
    """`wrk -t N -c N`: a thread per connection, so that each runs whole cycles on its own key.
    `service`: the pids of the processes whose CPU time to measure (the server's workers)."""
    command = ["wrk", "-t", str(clients), "-c", str(clients), "-s", str(WRK_SCRIPT)]
    if warmup > 0:
        tool_output([*command, "-d", f"{warmup}s", url, "--", *wrk_args(side, key, clients, "warm-up")])
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    before = busy_cpu_ticks()
    service_before = process_cpu_seconds(service or [])
    measured = wrk_args(side, key, clients, "measured")
    output = tool_output([*command, "-d", f"{duration}s", url, "--", *measured])
    service_after = process_cpu_seconds(service or [])
    after = busy_cpu_ticks()
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = next((line for line in output.splitlines() if line.startswith("RESULT ")), None)
    if line is None:
        raise BenchError(f"no RESULT line in wrk's output:\n{output}")
    result = json.loads(line.removeprefix("RESULT "))
    cpu = (children_after.ru_utime - children_before.ru_utime) + (
        children_after.ru_stime - children_before.ru_stime
    )
    return WrkResult(
        cycles_per_second=result["cycles"] / result["seconds"],
        p50_ms=result["p50_ms"],
        p99_ms=result["p99_ms"],
        failures=result["failures"],
        load_cpu=cpu / duration,
        busy_cpu=busy_cores(before, after),
        service_cpu=(service_after - service_before) / result["seconds"] if service else float("nan"),
    )
