"""What a measured run yields: cycles/s, latencies and their percentiles, and the CPU it took."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

CPUS = os.cpu_count() or 1


def percentile(sorted_values: list[float], pct: float) -> float:
    """Nearest-rank percentile of an ascending list (NaN when empty)."""
    if not sorted_values:
        return float("nan")
    rank = round(pct / 100 * (len(sorted_values) - 1))
    return sorted_values[rank]


@dataclass
class Result:
    """One measured run at one concurrency: cycles in the window and their latencies (seconds)."""

    cycles_per_second: float
    latencies: list[float]
    failures: int
    errors: list[str]  # the first few failures, to show what went wrong
    load_cpu: float  # cores used by the load generator (or pgbench) during the window
    busy_cpu: float  # cores busy machine-wide during the window
    acquires: list[float] = field(default_factory=list)  # the acquire alone (HTTP sides only)
    conflicts: list[float] = field(default_factory=list)  # 409 answers (the hot key only)

    @property
    def p50_ms(self) -> float:
        return percentile(self.latencies, 50) * 1000

    @property
    def p99_ms(self) -> float:
        return percentile(self.latencies, 99) * 1000

    @property
    def acquire_p50_ms(self) -> float:
        return percentile(self.acquires, 50) * 1000

    @property
    def acquire_p99_ms(self) -> float:
        return percentile(self.acquires, 99) * 1000


def busy_cpu_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot, from /proc/stat; (0, 0) where absent."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
    except OSError:
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is in user)
    return total - idle, total


def busy_cores(before: tuple[int, int], after: tuple[int, int]) -> float:
    busy, total = after[0] - before[0], after[1] - before[1]
    return busy / total * CPUS if total > 0 else float("nan")


TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time the processes have used, in seconds, from /proc/<pid>/stat."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as stat:
            # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after it.
            fields = stat.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat
    return total / TICKS_PER_SECOND
