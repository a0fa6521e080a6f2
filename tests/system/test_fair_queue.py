"""Fair waiting across replicas (migration 0029): real service processes on one database. Waiters
spread over two replicas are granted in the order they took their places; a head of the queue
whose client left, or whose replica was killed, holds nobody back: the next is granted on the
release, not at a timer."""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg

from harness.processes import running_service
from tests.support import ROUTE

KEY = {"organization_id": "acme", "job_type": "report"}


def body(holder: str, wait: float = 0) -> dict[str, Any]:
    return {**KEY, "holder": holder, "ttl_seconds": 60, "wait_seconds": wait}


def grant(url: str, holder: str) -> dict[str, Any]:
    answer = httpx.post(f"{url}/v1/locks", json=body(holder), timeout=10)
    assert answer.status_code == 201, answer.text
    lock: dict[str, Any] = answer.json()
    return lock


def release(url: str, lock: dict[str, Any]) -> None:
    answer = httpx.delete(f"{url}/v1/locks/{lock['id']}", headers={"Lock-Token": lock["token"]}, timeout=10)
    assert answer.status_code == 204, answer.text


def queue(url: str, count: int) -> list[str]:
    """The queue's holders in order, once it has `count` places."""
    deadline = time.monotonic() + 30
    while True:
        items = httpx.get(f"{url}/v1/locks/queue", params={**KEY, "limit": 500}, timeout=10).json()["items"]
        if len(items) == count:
            return [item["holder"] for item in items]
        assert time.monotonic() < deadline, f"the queue has {len(items)} places, not {count}"
        time.sleep(0.02)


def test_twenty_waiters_over_two_replicas_are_granted_in_the_order_they_came(
    db_url: str, tmp_path: Path
) -> None:
    env = ROUTE.env(db_url)
    with (
        running_service(env=env, log=tmp_path / "a.log") as (one, _),
        running_service(env=env, log=tmp_path / "b.log") as (two, _),
    ):
        holder = grant(one, "holder")
        granted: list[dict[str, Any]] = []
        failed: list[str] = []

        def wait(n: int) -> None:
            url = (one, two)[n % 2]
            answer = httpx.post(f"{url}/v1/locks", json=body(f"w{n:02}", wait=60), timeout=90)
            if answer.status_code != 201:
                failed.append(answer.text)
                return
            granted.append(answer.json())
            release(url, answer.json())  # the next one's turn

        threads = [threading.Thread(target=wait, args=(n,)) for n in range(20)]
        for n, thread in enumerate(threads):
            thread.start()  # once the one before has its place: the order they came in is known
            queue(one, n + 1)
            time.sleep(0.02)
        placed = queue(one, 20)
        assert placed == [f"w{n:02}" for n in range(20)], "places in the order the waiters came"
        release(one, holder)
        for thread in threads:
            thread.join(timeout=60)
        assert failed == []
        assert [lock["holder"] for lock in granted] == placed, "granted in the queue's order"
        tokens = [lock["fencing_token"] for lock in granted]
        assert tokens == list(range(holder["fencing_token"] + 1, holder["fencing_token"] + 21)), tokens
    with psycopg.connect(db_url) as conn:
        # The database's own clock: each grant after the end of the one before.
        rows = conn.execute(
            "SELECT holder, acquired_at, released_at FROM helix_job_locks"
            " WHERE organization_id = 'acme' AND job_type = 'report' AND holder <> 'holder'"
            " ORDER BY fencing_token"
        ).fetchall()
    assert [row[0] for row in rows] == placed
    for before, after in itertools.pairwise(rows):
        assert after[1] >= before[2], (before, after)


def _raw_wait(port: int, holder: str, key: str | None = None) -> socket.socket:
    """A waiting acquire sent on a raw socket, left unanswered; closing the socket leaves."""
    payload = json.dumps(body(holder, wait=60)).encode()
    raw = socket.create_connection(("127.0.0.1", port))
    raw.sendall(
        b"POST /v1/locks HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        + (f"Idempotency-Key: {key}\r\n" if key else "").encode()
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return raw


def _wait_after_release(url: str, holder: dict[str, Any], waiter: threading.Thread) -> float:
    released = time.monotonic()
    release(url, holder)
    waiter.join(timeout=30)
    return time.monotonic() - released


def test_a_head_whose_client_left_or_whose_replica_died_holds_nobody_back(
    db_url: str, tmp_path: Path
) -> None:
    env = ROUTE.env(db_url)
    with (
        running_service(env=env, log=tmp_path / "a.log") as (one, _),
        running_service(env=env, log=tmp_path / "b.log") as (two, doomed),
    ):
        answers: list[httpx.Response] = []

        def wait_on_one(holder: str) -> threading.Thread:
            thread = threading.Thread(
                target=lambda: answers.append(
                    httpx.post(f"{one}/v1/locks", json=body(holder, wait=60), timeout=90)
                )
            )
            thread.start()
            return thread

        # The head's client leaves: its place goes with it.
        holder = grant(one, "holder")
        leaver = _raw_wait(int(two.rsplit(":", 1)[1]), "leaver")
        queue(one, 1)
        second = wait_on_one("second")
        assert queue(one, 2) == ["leaver", "second"]
        leaver.close()
        assert queue(one, 1) == ["second"], "the place left with its client"
        took = _wait_after_release(one, holder, second)
        assert answers[-1].status_code == 201 and answers[-1].json()["holder"] == "second"
        assert took < 10, f"granted {took:.1f} s after the release: by the release, not the 60 s lease"
        release(one, answers[-1].json())

        # The head's replica is killed: its place stops counting with its connections.
        holder = grant(one, "holder-2")
        dying = _raw_wait(int(two.rsplit(":", 1)[1]), "on-a-dying-replica")
        queue(one, 1)
        third = wait_on_one("third")
        assert queue(one, 2) == ["on-a-dying-replica", "third"]
        doomed.kill()
        doomed.wait(timeout=10)
        assert queue(one, 1) == ["third"], "the dead replica's place lapsed with it"
        took = _wait_after_release(one, holder, third)
        assert answers[-1].status_code == 201 and answers[-1].json()["holder"] == "third"
        assert took < 10, f"granted {took:.1f} s after the release: by the release, not the 60 s lease"
        dying.close()


def test_a_retry_with_the_idempotency_key_of_a_waiter_whose_connection_broke_keeps_its_place(
    db_url: str, tmp_path: Path
) -> None:
    """The connection of the first waiter breaks; its retry, with the same Idempotency-Key and
    through the other replica, comes a moment later and is still first in the queue."""
    env = ROUTE.env(db_url)
    with (
        running_service(env=env, log=tmp_path / "a.log") as (one, _),
        running_service(env=env, log=tmp_path / "b.log") as (two, _),
    ):
        holder = grant(one, "holder")
        broken = _raw_wait(int(one.rsplit(":", 1)[1]), "patient", key="retry-me")
        queue(one, 1)
        later: list[httpx.Response] = []
        thread = threading.Thread(
            target=lambda: later.append(
                httpx.post(f"{one}/v1/locks", json=body("later", wait=60), timeout=90)
            )
        )
        thread.start()
        assert queue(one, 2) == ["patient", "later"]
        broken.close()
        time.sleep(0.2)
        retried: list[httpx.Response] = []
        retry = threading.Thread(
            target=lambda: retried.append(
                httpx.post(
                    f"{two}/v1/locks",
                    json=body("patient", wait=60),
                    headers={"Idempotency-Key": "retry-me"},
                    timeout=90,
                )
            )
        )
        retry.start()
        time.sleep(0.3)
        assert queue(one, 2) == ["patient", "later"], "the retry kept the place"
        release(one, holder)
        retry.join(timeout=30)
        assert retried[0].status_code == 201 and retried[0].json()["holder"] == "patient"
        assert thread.is_alive(), "later is still waiting: it came after"
        release(two, retried[0].json())
        thread.join(timeout=30)
        assert later[0].status_code == 201
        assert later[0].json()["fencing_token"] == retried[0].json()["fencing_token"] + 1
