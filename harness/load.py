"""Racing lock clients that record what they were told, for the checker in harness/history.py.

Each client loops: acquire a random key (a lock, or a semaphore of the max_holders given for the
key); on a grant, sometimes die holding it (the lease must run out and be reclaimed), else work a
little, maybe renew, and release. An answer that never came (timeout, reset) is unknown, as Jepsen
has it: the client gives up that lock and goes on.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import anyio
import httpx

from harness.history import Renewed, Told

KEYS = [(org, job) for org in ("acme", "globex") for job in ("billing", "reindex", "export")]


@dataclass
class Run:
    """What the clients saw."""

    told: list[Told] = field(default_factory=list)
    renewed: list[Renewed] = field(default_factory=list)
    released: list[int] = field(default_factory=list)  # lock ids a 204 answered
    release_attempts: list[int] = field(default_factory=list)  # lock ids a release was sent for
    answers: Counter[str] = field(default_factory=Counter)  # "acquire 201", "release 410", ...
    crashes: int = 0
    unknown: int = 0
    slowest: float = 0.0  # seconds, the longest any request took to answer
    granted_at: list[float] = field(default_factory=list)  # time.monotonic() of each 201
    latencies: list[float] = field(default_factory=list)  # seconds, of every answered acquire

    def count(self, operation: str, status: int) -> None:
        self.answers[f"{operation} {status}"] += 1

    def snapshot(self) -> dict[str, int]:
        """The answers so far, read safely while the clients' thread may add to them."""
        while True:
            try:
                return dict(self.answers)
            except RuntimeError:  # changed size during the copy
                continue

    def errors(self) -> dict[str, int]:
        """Answers no client should ever get: any 5xx but 503, any 4xx the run cannot cause."""
        expected = {"acquire 201", "acquire 409", "acquire 503", "renew 200", "renew 410", "renew 503"}
        expected |= {"release 204", "release 410", "release 503"}
        return {answer: n for answer, n in self.snapshot().items() if answer not in expected}

    def unavailable(self) -> int:
        """503 answers, to any request."""
        return sum(n for answer, n in self.snapshot().items() if answer.endswith(" 503"))

    def first_grant_after(self, moment: float) -> float | None:
        return min((t for t in self.granted_at if t > moment), default=None)

    def longest_gap(self, start: float, until: float) -> float:
        """The longest wait between consecutive grants, from the last grant before `start` to the
        first grant after `until`; AssertionError if no grant came after `until`."""
        after = self.first_grant_after(until)
        assert after is not None, "no grant came after the fault"
        times = sorted(t for t in self.granted_at if t <= after)
        before = max((t for t in times if t <= start), default=start)
        window = [before, *(t for t in times if t > before)]
        return max(later - earlier for earlier, later in itertools.pairwise(window))


@dataclass
class Load:
    """Clients racing over `urls` (one picked at random per request) until stopped."""

    urls: list[str]
    clients: int = 12
    ttl: float = 1.0
    crash_rate: float = 0.15
    timeout: float = 15.0
    api_key: str | None = None
    name: str = "worker"  # clients are NAME-0, NAME-1...; each seeds its random choices by number
    # The keys raced, each with its max_holders (1: an ordinary lock).
    keys: Mapping[tuple[str, str], int] = field(default_factory=lambda: dict.fromkeys(KEYS, 1))
    run: Run = field(default_factory=Run)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _failure: BaseException | None = None

    def start(self) -> Load:
        self._thread = threading.Thread(target=self._main, name=f"load-{self.name}")
        self._thread.start()
        return self

    def stop(self) -> Run:
        """Stop the clients; re-raises whatever stopped them early."""
        self._stop.set()
        assert self._thread is not None
        # A client may be in a cycle's last three requests, each allowed `timeout`.
        self._thread.join(timeout=3 * self.timeout + 10)
        assert not self._thread.is_alive(), "a client hung"
        if self._failure is not None:
            raise self._failure
        return self.run

    def _main(self) -> None:
        try:
            anyio.run(self._clients)
        except BaseException as exc:  # for stop() to raise in the test's thread
            self._failure = exc

    def __enter__(self) -> Load:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _clients(self) -> None:
        async with anyio.create_task_group() as group:
            for n in range(self.clients):
                group.start_soon(self._client, f"{self.name}-{n}", random.Random(f"{self.name}-{n}"))

    async def _call(
        self, http: httpx.AsyncClient, operation: str, method: str, url: str, **kwargs: object
    ) -> httpx.Response | None:
        """The answer, or None when it never came (unknown)."""
        started = time.monotonic()
        try:
            answer = await http.request(method, url, **kwargs)  # type: ignore[arg-type]
        except httpx.TransportError:
            self.run.unknown += 1
            return None
        finally:
            self.run.slowest = max(self.run.slowest, time.monotonic() - started)
        self.run.count(operation, answer.status_code)
        if operation == "acquire":
            self.run.latencies.append(time.monotonic() - started)
        return answer

    async def _client(self, name: str, rng: random.Random) -> None:
        run = self.run
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with httpx.AsyncClient(timeout=self.timeout, headers=headers) as http:
            keys = list(self.keys)
            while not self._stop.is_set():
                org, job = rng.choice(keys)
                body: dict[str, object] = {
                    "organization_id": org,
                    "job_type": job,
                    "holder": name,
                    "ttl_seconds": self.ttl,
                }
                if self.keys[org, job] != 1:
                    body["max_holders"] = self.keys[org, job]
                answer = await self._call(
                    http, "acquire", "POST", f"{rng.choice(self.urls)}/v1/locks", json=body
                )
                if answer is None or answer.status_code != 201:
                    await anyio.sleep(rng.uniform(0.005, 0.05))
                    continue
                grant = answer.json()
                run.granted_at.append(time.monotonic())
                acquired_at = datetime.fromisoformat(grant["acquired_at"])
                told = Told(grant["id"], (org, job), grant["fencing_token"], acquired_at, grant.get("slot"))
                run.told.append(told)
                if rng.random() < self.crash_rate:
                    run.crashes += 1  # dies holding it: never releases, the lease must run out
                    continue
                headers = {"Lock-Token": grant["token"]}
                await anyio.sleep(rng.uniform(0, 0.03))  # work
                if rng.random() < 0.5:
                    lock_url = f"{rng.choice(self.urls)}/v1/locks/{grant['id']}"
                    renewal = await self._call(
                        http,
                        "renew",
                        "POST",
                        f"{lock_url}/renew",
                        headers=headers,
                        json={"ttl_seconds": self.ttl},
                    )
                    if renewal is None or renewal.status_code != 200:
                        continue  # lost, or unknown: give the lock up
                    expires_at = datetime.fromisoformat(renewal.json()["expires_at"])
                    renewed_at = expires_at - timedelta(seconds=self.ttl)
                    run.renewed.append(Renewed(grant["id"], renewed_at, expires_at))
                    await anyio.sleep(rng.uniform(0, 0.03))
                lock_url = f"{rng.choice(self.urls)}/v1/locks/{grant['id']}"
                run.release_attempts.append(grant["id"])
                release = await self._call(http, "release", "DELETE", lock_url, headers=headers)
                if release is not None and release.status_code == 204:
                    run.released.append(grant["id"])
