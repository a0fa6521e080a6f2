"""Leader election with the SDK, as docs/workers.md tells it: three candidate processes campaign
for one key against a real service; the leader is killed, and another is elected within the lease
and a second, by the database's clock; an observer follows the leaders through the event stream."""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from harness.processes import ROOT, running_service
from helix_locks import ApiError, Lock, LockClient, Unavailable

TTL = 2.0
JOB = "scheduler-leader"
# campaign: acquire with wait_seconds, over and over; proclaim: the address in the lock's metadata;
# resign: the block's end releases (here only death ends a term).
CANDIDATE = f"""
import json, sys, time
from helix_locks import LockClient, LockHeld

url, name = sys.argv[1], sys.argv[2]
with LockClient(url) as client:
    while True:
        try:
            with client.lock("acme", "{JOB}", ttl={TTL}, wait=30, holder=name) as lease:
                lease.update({{"address": name}})
                print(json.dumps({{"leader": name, "lock_id": lease.grant.id,
                                  "fencing_token": lease.fencing_token}}), flush=True)
                while not lease.lost:
                    time.sleep(0.05)
                print(json.dumps({{"lost": name, "lock_id": lease.grant.id}}), flush=True)
        except LockHeld:
            continue
"""


class Candidates:
    """The candidate processes, and every line they print, in the order it came."""

    def __init__(self, url: str, names: list[str]) -> None:
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.processes = {
            name: subprocess.Popen(
                [sys.executable, "-c", CANDIDATE, url, name], cwd=ROOT, stdout=subprocess.PIPE, text=True
            )
            for name in names
        }
        for process in self.processes.values():
            threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.lines.put(json.loads(line))

    def next_leader(self, timeout: float) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no leader within {timeout} s") from None
        assert "leader" in line, f"a leader lost its lease: {line}"
        return line

    def quiet_for(self, seconds: float) -> None:
        with contextlib.suppress(queue.Empty):
            line = self.lines.get(timeout=seconds)
            raise AssertionError(f"a second leader while the first lives: {line}")

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)
            assert process.stdout is not None
            process.stdout.close()


class Observer:
    """The leader as a follower learns it from the key's events: the held lock that proclaims an
    address; nobody once that lock ends."""

    ENDED = ("released", "forced", "expired", "reclaimed")

    def __init__(self, url: str) -> None:
        self.leaders: list[tuple[str, int]] = []  # (address, fencing token), each change once
        self.current: Lock | None = None
        self.error: BaseException | None = None
        self._url = url
        self._thread = threading.Thread(target=self._observe, daemon=True)
        self._thread.start()

    def _observe(self) -> None:
        with LockClient(self._url) as client:
            try:
                for event in client.watch("acme", JOB, within=2):
                    lock = event["lock"]
                    address = (lock["metadata"] or {}).get("address")
                    if lock["state"] == "held" and address and event["type"] not in self.ENDED:
                        if self.current is None or self.current["id"] != lock["id"]:
                            self.leaders.append((address, lock["fencing_token"]))
                        self.current = lock
                    elif self.current is not None and lock["id"] == self.current["id"]:
                        self.current = None  # its lock ended (or lapsed)
            except (Unavailable, ApiError) as exc:  # the service stopped at the test's end
                self.error = exc

    def wait_for(self, count: int, timeout: float = 10) -> list[tuple[str, int]]:
        deadline = time.monotonic() + timeout
        while len(self.leaders) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        return list(self.leaders)


@pytest.fixture
def service(db_url: str, tmp_path: Path) -> Iterator[str]:
    with running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "service.log") as (url, _):
        yield url


def db_now(conn: psycopg.Connection[tuple[object, ...]]) -> datetime:
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None and isinstance(row[0], datetime)
    return row[0]


def moment(text: str) -> datetime:
    return datetime.fromisoformat(text)


def test_one_leader_at_a_time_and_a_new_one_within_the_lease_after_a_kill(
    service: str, conn: psycopg.Connection[tuple[object, ...]]
) -> None:
    observer = Observer(service)
    time.sleep(0.5)  # the observer's stream opens before the first term (the stream starts live)
    candidates = Candidates(service, ["c1", "c2", "c3"])
    terms: list[dict[str, Any]] = []
    try:
        with LockClient(service) as client:
            terms.append(candidates.next_leader(timeout=30))
            for _ in range(2):
                leader = terms[-1]
                candidates.quiet_for(TTL + 0.5)  # the others wait: the leader renews past its lease
                held = client.list(organization_id="acme", job_type=JOB, state="held")["items"]
                assert [(lock["id"], lock["holder"]) for lock in held] == [
                    (leader["lock_id"], leader["leader"])
                ], "exactly one leader"
                assert held[0]["metadata"] == {"address": leader["leader"]}, "proclaimed"

                killed_at = db_now(conn)
                candidates.processes[leader["leader"]].send_signal(signal.SIGKILL)
                terms.append(candidates.next_leader(timeout=TTL + 10))

                old, new = client.get(leader["lock_id"]), client.get(terms[-1]["lock_id"])
                assert terms[-1]["leader"] != leader["leader"]
                assert old["state"] == "reclaimed" and old["released_at"] == new["acquired_at"]
                gap = moment(new["acquired_at"]) - moment(old["expires_at"])
                assert timedelta(0) <= gap <= timedelta(seconds=1), f"elected {gap} after the lease ran out"
                assert moment(new["acquired_at"]) - killed_at <= timedelta(seconds=TTL + 1)
            observed = observer.wait_for(len(terms))
    finally:
        candidates.stop()
    tokens = [term["fencing_token"] for term in terms]
    assert tokens == sorted(set(tokens)), f"fencing tokens must strictly increase: {tokens}"
    assert observed == [(term["leader"], term["fencing_token"]) for term in terms]
    assert observer.error is None, observer.error
