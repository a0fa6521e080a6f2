"""The benchmarks, run from the repository root: `python -m bench.run` (beside etcd and pgbench),
`python -m bench.layers` (the cost of each layer), `python -m bench.micro` (two layers timed alone),
`python -m bench.events`, `python -m bench.semaphores` and `python -m bench.console` (what a
feature costs, in turns), `python -m bench.ceiling` (one primary's ceiling), `python -m bench.soak`
and `python -m bench.waiters`. What all of them share is here."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import psycopg


class BenchError(Exception):
    """Something the benchmark needs did not work; the message says what."""


def interrupted(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM cleans up exactly like Ctrl-C


@contextmanager
def said_and_stopped() -> Iterator[None]:
    """A run's end by Ctrl-C or SIGTERM (exit status 130), or by a failure it expects (1), said in
    a line, as SystemExit; what the block started it stops and removes on its way out."""
    try:
        yield
    except KeyboardInterrupt:
        log("interrupted; everything it started is stopped and removed")
        raise SystemExit(130) from None
    except BenchError as exc:
        log(f"error: {exc}")
        raise SystemExit(1) from None
    except psycopg.Error as exc:
        log(f"database error: {exc}")
        raise SystemExit(1) from None


def turn_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a bench whose sides take turns over rounds, at a number of clients through
    `serve --workers N`; settle_turns() fills in their defaults."""
    parser.add_argument("--quick", action="store_true", help="one round of 1 s warm-up + 4 s")
    parser.add_argument("--rounds", type=int, help="rounds of every side (default: 3)")
    parser.add_argument("--duration", type=int, help="seconds measured per side (default: 10)")
    parser.add_argument("--warmup", type=int, help="seconds of warm-up per side (default: 3)")
    parser.add_argument("--clients", type=int, default=32, help="clients (default: 32)")
    parser.add_argument("--workers", type=int, default=2, help="service worker processes (default: 2)")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1, help="load generator processes")


def settle_turns(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """turn_arguments' defaults, --quick's or a full run's; an error for a count below 1."""
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.duration = args.duration or (4 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    if min(args.rounds, args.duration, args.clients, args.workers, args.processes) < 1:
        parser.error("--rounds, --duration, --clients, --workers and --processes must be >= 1")


def load_average() -> str:
    """A report's first setup line: how busy the machine was before the run."""
    return f"load average before the run: {' '.join(f'{value:.2f}' for value in os.getloadavg())}"


def log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def tool_output(command: list[str]) -> str:
    """What a command (pgbench, wrk) printed; BenchError, with all it said, if it failed."""
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        name = Path(command[0]).name
        raise BenchError(f"{name} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout
