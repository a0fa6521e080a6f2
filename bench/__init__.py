"""The benchmarks, run from the repository root: `python -m bench.run` (beside etcd and pgbench),
`python -m bench.soak` and `python -m bench.waiters`. What all of them share is here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import FrameType


class BenchError(Exception):
    """Something the benchmark needs did not work; the message says what."""


def interrupted(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM cleans up exactly like Ctrl-C


def log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def tool_output(command: list[str]) -> str:
    """What a command (pgbench, wrk) printed; BenchError, with all it said, if it failed."""
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        name = Path(command[0]).name
        raise BenchError(f"{name} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout
