"""bench/run.py --chart: cycles/s and cycle p99 against clients, a line per side, as a PNG."""

from __future__ import annotations

from pathlib import Path

from bench.results import Result


def draw(path: Path, levels: list[int], medians: dict[str, list[Result]]) -> None:
    """Two panels side by side, from each side's median run at each level."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file only
    from matplotlib import pyplot

    figure, (throughput, latency) = pyplot.subplots(1, 2, figsize=(11, 4.5), layout="constrained")
    for side, results in medians.items():
        throughput.plot(levels, [r.cycles_per_second for r in results], marker="o", label=side)
        latency.plot(levels, [r.p99_ms for r in results], marker="o", label=side)
    for axes, title in ((throughput, "acquire + release cycles/s"), (latency, "cycle p99, ms")):
        axes.set_title(title)
        axes.set_xlabel("concurrent clients")
        axes.set_xscale("log", base=2)
        axes.set_xticks(levels, [str(level) for level in levels])
        axes.set_ylim(bottom=0)
        axes.grid(True, alpha=0.3)
    throughput.legend()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
