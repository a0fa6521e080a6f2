"""The benchmarks, run from the repository root: `python -m bench.run` (beside etcd and pgbench),
`python -m bench.layers` (the cost of each layer), `python -m bench.micro` (two layers timed alone),
`python -m bench.soak` and
`python -m bench.waiters`. What all of them share is here."""

from __future__ import annotations

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


def log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def tool_output(command: list[str]) -> str:
    """What a command (pgbench, wrk) printed; BenchError, with all it said, if it failed."""
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        name = Path(command[0]).name
        raise BenchError(f"{name} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout
