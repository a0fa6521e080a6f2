"""The report of a run of bench/run.py: the table of medians, every run's figures, CPU, the hot key,
the wrk cross-check and the failures."""

from __future__ import annotations

import argparse

from bench.results import CPUS, Result, percentile
from bench.wrk import WrkResult

SIDES = ("helix", "bare", "etcd", "pgbench")
BASE_SIDES = ("helix-A", "pgbench-A")  # --base: the service and schema of another commit


def median(results: list[Result]) -> Result:
    """The run with the median cycles/s (the upper one of an even count)."""
    return sorted(results, key=lambda result: result.cycles_per_second)[len(results) // 2]


def table(levels: list[int], medians: dict[str, list[Result]]) -> str:
    """Per level: helix's cycles/s and latencies, each other side's, and helix's ratio to each."""
    others = SIDES[1:]
    header = (
        f"{'clients':>7} | {'helix cycles/s':>14} {'p50 ms':>7} {'p99 ms':>7} {'acquire p50':>11} {'p99':>6}"
        + "".join(f" | {side + ' cycles/s':>16} {'p50 ms':>7} {'p99 ms':>7}" for side in others)
        + "".join(f" | {'helix/' + side:>13}" for side in others)
    )
    lines = [header, "-" * len(header)]
    for index, clients in enumerate(levels):
        h = medians["helix"][index]
        line = (
            f"{clients:>7} | {h.cycles_per_second:>14,.0f} {h.p50_ms:>7.2f} {h.p99_ms:>7.2f}"
            f" {h.acquire_p50_ms:>11.2f} {h.acquire_p99_ms:>6.2f}"
        )
        for side in others:
            o = medians[side][index]
            line += f" | {o.cycles_per_second:>16,.0f} {o.p50_ms:>7.2f} {o.p99_ms:>7.2f}"
        for side in others:
            line += f" | {h.cycles_per_second / medians[side][index].cycles_per_second:>13.2f}"
        lines.append(line)
    return "\n".join(lines)


def base_table(levels: list[int], runs: dict[str, list[list[Result]]]) -> str:
    """Per level, this tree (B) beside the base commit (A): helix's and pgbench's cycles/s, B over
    A, and each helix over etcd."""
    medians = {side: [median(level) for level in levels] for side, levels in runs.items()}
    header = (
        f"{'clients':>7} | {'helix-A cycles/s':>16} {'p99 ms':>7} | {'helix cycles/s':>14} {'p99 ms':>7}"
        f" | {'helix/helix-A':>13} | {'helix-A/etcd':>12} | {'helix/etcd':>10}"
        f" | {'pgbench-A':>9} | {'pgbench':>7} | {'pgbench/pgbench-A':>17}"
    )
    lines = [header, "-" * len(header)]
    for index, clients in enumerate(levels):
        a, b, etcd = (medians[side][index] for side in ("helix-A", "helix", "etcd"))
        pa, pb = medians["pgbench-A"][index], medians["pgbench"][index]
        lines.append(
            f"{clients:>7} | {a.cycles_per_second:>16,.0f} {a.p99_ms:>7.2f}"
            f" | {b.cycles_per_second:>14,.0f} {b.p99_ms:>7.2f}"
            f" | {b.cycles_per_second / a.cycles_per_second:>13.2f}"
            f" | {a.cycles_per_second / etcd.cycles_per_second:>12.2f}"
            f" | {b.cycles_per_second / etcd.cycles_per_second:>10.2f}"
            f" | {pa.cycles_per_second:>9,.0f} | {pb.cycles_per_second:>7,.0f}"
            f" | {pb.cycles_per_second / pa.cycles_per_second:>17.2f}"
        )
    return "\n".join(lines)


def wrk_table(levels: list[int], checked: dict[str, list[WrkResult]]) -> str:
    """Per level and side: cycles/s, request latency, wrk's CPU and the service's CPU per cycle
    (where measured); then helix's ratio to each other side."""
    sides = list(checked)
    header = f"{'clients':>7}" + "".join(
        f" | {side + ' cycles/s':>14} {'request p50':>11} {'p99 ms':>7} {'wrk cores':>9} {'CPU ms/cycle':>12}"
        for side in sides
    )
    header += "".join(f" | {'helix/' + side:>11}" for side in sides[1:])
    lines = [header, "-" * len(header)]
    for index, clients in enumerate(levels):
        line = f"{clients:>7}"
        for side in sides:
            r = checked[side][index]
            line += (
                f" | {r.cycles_per_second:>14,.0f} {r.p50_ms:>11.2f} {r.p99_ms:>7.2f} {r.load_cpu:>9.2f}"
                f" {r.cpu_ms_per_cycle:>12.2f}"
            )
        helix = checked["helix"][index].cycles_per_second
        line += "".join(f" | {helix / checked[side][index].cycles_per_second:>11.2f}" for side in sides[1:])
        lines.append(line)
    return "\n".join(lines)


def report(
    args: argparse.Namespace,
    setup: list[str],
    runs: dict[str, list[list[Result]]],
    hot: Result,
    rss: list[float],
    checked: dict[str, list[WrkResult]],
) -> str:
    medians = {side: [median(level) for level in runs[side]] for side in SIDES}
    lines = [
        "Helix Locks beside the bare app, etcd and pgbench: acquire+release cycles/s and latency,"
        " each client on its own key",
        f"  {args.runs} run(s) of {args.warmup} s warm-up + {args.duration} s measured per level and side,"
        f" sides in turn; the median run is shown; {CPUS} CPUs shared by everything",
        *(f"  {line}" for line in setup),
        "",
        table(args.levels, medians),
    ]
    if "helix-A" in runs:
        lines += [
            "",
            "this tree (helix, pgbench) beside the base commit (helix-A, pgbench-A), medians:",
            base_table(args.levels, runs),
        ]
    lines += [
        "",
        "cycles/s of every run, in order:",
    ]
    for side, levels in runs.items():
        for clients, results in zip(args.levels, levels, strict=True):
            figures = ", ".join(f"{result.cycles_per_second:,.0f}" for result in results)
            lines.append(f"  {side:>7} at {clients:>3} clients: {figures}")
    lines += ["", f"CPU busy in the measured windows (median run), in cores of {CPUS}:"]
    for index, clients in enumerate(args.levels):
        cpu = [
            f"{side} {medians[side][index].busy_cpu:.2f}"
            f" ({'pgbench itself' if side == 'pgbench' else 'load generator'}"
            f" {medians[side][index].load_cpu:.2f})"
            for side in SIDES
        ]
        lines.append(f"{clients:>7} clients: " + ", ".join(cpu))
    conflict_p50, conflict_p99 = (percentile(hot.conflicts, pct) * 1000 for pct in (50, 99))
    lines += [
        "",
        f"hot key: {max(args.levels)} clients fighting over one key for {args.duration} s:"
        f" {hot.cycles_per_second:,.0f} grants/s, acquire answered 201 p50/p99"
        f" {hot.acquire_p50_ms:.2f}/{hot.acquire_p99_ms:.2f} ms; {len(hot.conflicts) / args.duration:,.0f}"
        f" answers 409/s, p50/p99 {conflict_p50:.2f}/{conflict_p99:.2f} ms;"
        f" 409 p50 / 201 p50 = {conflict_p50 / hot.acquire_p50_ms:.2f}",
        "service worker RSS after the runs: " + ", ".join(f"{mb:.1f} MB" for mb in rss),
    ]
    if checked["helix"]:
        lines += [
            "",
            "cross-check: the same cycles from wrk (-t N -c N, one run; wrk times requests, not cycles;"
            " CPU ms/cycle: the service workers' CPU time per cycle, from /proc):",
            wrk_table(args.levels, checked),
        ]
    else:
        lines += ["", "cross-check with wrk skipped: wrk is not installed (apt-get install wrk)"]
    failures = {side: sum(r.failures for level in levels for r in level) for side, levels in runs.items()}
    failures |= {f"{side} (wrk)": sum(r.failures for r in results) for side, results in checked.items()}
    lines += [
        "",
        "failed cycles (unexpected answer or none): " + ", ".join(f"{k} {v}" for k, v in failures.items()),
    ]
    errors = [
        error for levels in runs.values() for level in levels for result in level for error in result.errors
    ]
    lines += [f"  e.g. {error}" for error in errors[:5]]
    return "\n".join(lines)
