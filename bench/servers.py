"""The servers under test, as real processes: `helix-locks serve`, the bare app and a single-node etcd."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx

from bench import BenchError, bare
from bench.http_client import REQUEST_TIMEOUT
from harness.processes import ROOT, NotReady, children, free_port, tail, wait_ready
from helix_locks.server import keys


@contextmanager
def service_process(
    url: str,
    workers: int,
    log_path: Path,
    env: dict[str, str] | None = None,
    launcher: list[str] | None = None,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`helix-locks serve` on a free port, ready; stopped with SIGTERM on exit. Yields its URL and
    its process (with --workers 1 it is the one serving requests); `env` is laid over
    DATABASE_URL=url. `launcher` runs `serve ...` instead of the installed helix-locks."""
    port = free_port()
    if launcher is None:
        installed = Path(sys.executable).with_name("helix-locks")
        launcher = [str(installed)] if installed.exists() else [sys.executable, "-m", "helix_locks.cli"]
    command = [*launcher, "serve", "--port", str(port), "--workers", str(workers)]
    with server_process(command, port, {"DATABASE_URL": url, **(env or {})}, log_path) as served:
        yield served


@contextmanager
def bare_process(url: str, workers: int, log_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The bare app (bench/bare.py) under uvicorn, with the flags `helix-locks serve` gives it
    (server/commands.py): httptools, `workers`, no access log, no server header. Helix's protocol is a
    subclass of uvicorn's httptools one, with bounds on what a client sends."""
    port = free_port()
    command = [sys.executable, "-m", "uvicorn", "bench.bare:app", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--workers", str(workers), "--http", "httptools", "--no-access-log", "--no-server-header"]
    with server_process(command, port, {bare.DATABASE_URL: url}, log_path) as served:
        yield served


@contextmanager
def server_process(
    command: list[str], port: int, env: dict[str, str], log_path: Path
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`command`, listening on `port` of 127.0.0.1, run from the repository root with `env` laid
    over ours, until it answers /readyz; stopped on exit. Yields its URL and its process."""
    with log_path.open("wb") as log:
        # Its own session: Ctrl-C reaches only us, and we stop it in order.
        process = subprocess.Popen(
            command,
            env={**os.environ, **env},
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        base_url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(base_url, process, log_path)
        except NotReady as exc:
            raise BenchError(str(exc)) from None
        yield base_url, process
    finally:
        stop(process)


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            print("bench: the service ignored SIGTERM for 20 s; killing it", file=sys.stderr)
    # Its session is its process group: this reaches any worker left behind, and only those.
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def create_key(url: str, base_url: str, timeout: float = 10) -> str:
    """A new API key for organization "bench", once the service refuses anonymous requests."""
    key = keys.create(url, "bench")
    deadline = time.monotonic() + timeout
    while True:
        status = httpx.get(f"{base_url}/v1/locks", timeout=REQUEST_TIMEOUT).status_code
        if status == 401:
            return key
        if time.monotonic() > deadline:
            raise BenchError(
                f"{timeout:.0f} s after a key was made, an anonymous request got {status}, not 401"
            )
        time.sleep(0.1)


@contextmanager
def etcd_server(workdir: Path) -> Iterator[str]:
    """A single-node etcd (Debian's etcd-server) on free ports, data in workdir; yields its URL.
    It syncs its log to disk on every commit, as PostgreSQL does: both sides are durable."""
    binary = shutil.which("etcd")
    if binary is None:
        raise BenchError("etcd is not installed: apt-get install -y etcd-server")
    client_url, peer_url = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
    command = [binary, "--name", "bench", "--data-dir", str(workdir / "etcd")]
    command += ["--listen-client-urls", client_url, "--advertise-client-urls", client_url]
    command += ["--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url]
    command += ["--initial-cluster", f"bench={peer_url}"]
    log_path = workdir / "etcd.log"
    with log_path.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            if process.poll() is not None:
                raise BenchError(f"etcd exited with {process.returncode}:\n{tail(log_path)}")
            with suppress(httpx.HTTPError):
                if httpx.get(f"{client_url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise BenchError(f"etcd was not healthy after 30 s:\n{tail(log_path)}")
            time.sleep(0.2)
        yield client_url
    finally:
        stop(process)


def worker_pids(pid: int) -> list[int]:
    """uvicorn's worker processes under `helix-locks serve` or uvicorn (itself, with --workers 1)."""
    found = []
    for child in children(pid):
        with suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
    return sorted(found) or [pid]
