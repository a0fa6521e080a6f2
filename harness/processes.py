"""Service processes and what the tests and benchmarks read of them: the repository's root,
connection strings, free ports, `helix-locks serve` started and awaited, a process's children and
memory, its JSON log."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
from psycopg.conninfo import make_conninfo

ROOT = Path(__file__).resolve().parent.parent


def url_for(server_url: str, dbname: str) -> str:
    """The server's connection string, pointed at another database."""
    return make_conninfo(server_url, dbname=dbname)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def helix_command(*args: str) -> list[str]:
    """`helix-locks ARGS` run by this interpreter, so the tests need nothing on PATH."""
    return [sys.executable, "-m", "helix_locks.cli", *args]


def environment(env: Mapping[str, str | None]) -> dict[str, str]:
    """`env` laid over this process's environment; a None value removes the variable."""
    return {key: value for key, value in {**os.environ, **env}.items() if value is not None}


def run_helix(
    *args: str, env: Mapping[str, str | None], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`helix-locks ARGS` run to its end in the repository's root, with `env` (see environment()),
    its output captured."""
    return subprocess.run(
        helix_command(*args), env=environment(env), cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


class NotReady(RuntimeError):
    """A service process exited, or was not ready in time."""


def wait_ready(
    base_url: str, process: subprocess.Popen[bytes], log: Path | None = None, timeout: float = 60
) -> None:
    """Return once the service at base_url answers /readyz with 200; NotReady, with the tail of its
    output in `log` when given, if its process exits first or `timeout` s pass."""

    def said() -> str:  # read when it is raised: what the process wrote by then
        return f":\n{tail(log)}" if log else ""

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise NotReady(f"the service exited with {process.returncode} before it was ready{said()}")
        with suppress(httpx.TransportError):
            if httpx.get(f"{base_url}/readyz", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise NotReady(f"{base_url} was not ready after {timeout:.0f} s{said()}")


def tail(path: Path, lines: int = 30) -> str:
    """The last lines of a log file."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextmanager
def running_service(
    *args: str, env: Mapping[str, str | None], log: Path, timeout: float = 60
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`helix-locks serve ARGS` on a free port, ready; SIGTERMed (then killed) on exit.

    `env` is laid over this process's environment; a None value removes the variable.
    """
    port = free_port()
    with log.open("wb") as out:
        process = subprocess.Popen(
            helix_command("serve", "--port", str(port), *args),
            env=environment(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url, process, log, timeout)
        yield base_url, process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def children(pid: int) -> set[int]:
    """The processes whose parent is pid (read from /proc: Linux)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after it.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def rss_mb(pid: int) -> float:
    """A process's resident memory (VmRSS), in MB; NaN when it is gone (read from /proc: Linux)."""
    with suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def logged_requests(log: Path) -> list[dict[str, Any]]:
    """The request lines of a service's JSON log (HELIX_LOCKS_LOG_FORMAT=json, or not a terminal)."""
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    for line in lines:
        assert {"time", "level", "event", "logger"} <= line.keys(), line
    return [line for line in lines if line["event"] == "request"]
