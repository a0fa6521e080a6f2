"""HTTP load: a few processes, each an asyncio loop running its share of the clients, each client
cycling a lock of helix or etcd over a connection of its own (bench/http_client.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import queue
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from multiprocessing import get_context
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier

import httpx

from bench import BenchError
from bench.http_client import REQUEST_TIMEOUT, Connection, HttpxConnection, RawConnection, run_loop
from bench.results import Result, busy_cores, busy_cpu_ticks


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


# The hot semaphore's max_holders.
SEMAPHORE_HOLDERS = 4

# One lock cycle of a side: acquire then release, on the client's own key. It returns how long
# the acquire took, or None (counted in the sample) unless both answered as a free lock should.
Cycle = Callable[[Connection, Sample], Awaitable[float | None]]


def helix_cycle(
    auth: str, job_type: str, hot: bool = False, max_holders: int = 1, shared: bool = False
) -> Cycle:
    """POST /v1/locks, DELETE /v1/locks/{id}; `auth` is the Authorization header line, or "".

    `hot`: every client is on this one key, so a 409 is expected: it is timed (in the window) and
    the acquire is sent again until it is granted. `max_holders` above 1: the key is a semaphore;
    `shared`: a reader's lock, held beside the key's other readers."""
    request: dict[str, object] = {
        "organization_id": "bench",
        "job_type": job_type,
        "holder": "bench",
        "ttl_seconds": 30,
    }
    if max_holders > 1:
        request["max_holders"] = max_holders
    if shared:
        request["mode"] = "shared"
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
    """The clients' cycles of a side: "helix" or "etcd" (one key each), or "hot" (one key for all),
    or "semaphore" (one key for all, SEMAPHORE_HOLDERS of them at once), or "shared" (one key for
    all, every client a reader)."""
    if side == "etcd":
        return [etcd_cycle(name) for name in names]
    if side == "hot":
        return [helix_cycle(auth, "hot-key", hot=True) for _ in names]
    if side == "semaphore":
        return [helix_cycle(auth, "semaphore-key", hot=True, max_holders=SEMAPHORE_HOLDERS) for _ in names]
    if side == "shared":
        return [helix_cycle(auth, "readers-key", hot=True, shared=True) for _ in names]
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
