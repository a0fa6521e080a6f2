"""Clients that send too much, or too slowly, against a real `serve`, from raw sockets: they are
cut off, and a normal client beside them gets every answer in time."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from harness.processes import rss_mb, running_service
from helix_locks.server import keys
from helix_locks.server.app import create_app
from helix_locks.server.locks import LiveLockQuota
from tests.support import ROUTE, Conn, in_process, live_locks, lock_body
from tests.system.test_exactly_once import Background, lock_waiters, until

# Short deadlines, so that the tests wait seconds, not the defaults' ten.
TIMEOUTS = {"HELIX_LOCKS_HEAD_TIMEOUT_SECONDS": "1", "HELIX_LOCKS_BODY_TIMEOUT_SECONDS": "1"}


@pytest.fixture
def service(db_url: str, tmp_path: Path) -> Iterator[tuple[str, int, int]]:
    """A real `serve` (one worker: the process itself serves), its URL, port and pid."""
    with running_service(env=ROUTE.env(db_url, **TIMEOUTS), log=tmp_path / "s.log") as (url, process):
        yield url, int(url.rsplit(":", 1)[1]), process.pid


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def answer(sock: socket.socket, within: float = 5) -> bytes:
    """What the server sends until it closes the connection (b"" if it closes without a word)."""
    sock.settimeout(within)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def test_a_head_over_the_limit_gets_431_at_once(service: tuple[str, int, int]) -> None:
    url, port, _ = service
    with connect(port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40_000)
        started = time.monotonic()
        got = answer(sock)
    assert got.startswith(b"HTTP/1.1 431"), got[:100]
    assert time.monotonic() - started < 3, "refused at once, not when the client stops (5 s)"
    assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200


def test_a_head_within_the_limit_and_a_large_body_in_one_write_are_served(
    service: tuple[str, int, int],
) -> None:
    """The head is counted exactly: a body of 60 KiB sent in the same write is no head."""
    _, port, _ = service
    body = (
        b'{"organization_id": "acme", "job_type": "big", "holder": "' + b"h" * 200 + b'", "ttl_seconds": 30}'
    )
    padded = body + b" " * (60_000 - len(body))
    with connect(port) as sock:
        sock.sendall(
            b"POST /v1/locks HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\n" + f"Content-Length: {len(padded)}\r\n\r\n".encode() + padded
        )
        assert answer(sock).startswith(b"HTTP/1.1 201")


def test_a_streamed_endless_header_is_cut_off_and_costs_no_memory(service: tuple[str, int, int]) -> None:
    """64 MiB streamed into one header: the server stops reading after its limit."""
    url, port, pid = service
    before = rss_mb(pid)
    sent = 0
    with connect(port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
        try:
            for _ in range(64 * 16):
                sock.sendall(b"a" * 65536)
                sent += 65536
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass
    assert sent < 16 * 1024 * 1024, f"the server kept reading: {sent} bytes"
    assert rss_mb(pid) - before < 10, "the header was not held in memory"
    assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200


@pytest.mark.parametrize(
    ("case", "sent", "expected"),
    [
        ("an idle socket", b"", b""),
        ("a partial request line", b"GET /hea", b"HTTP/1.1 408"),
        ("partial headers", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: 1", b"HTTP/1.1 408"),
        (
            "a short body under a larger Content-Length",
            b"POST /v1/locks HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"organization_id": ',
            b"HTTP/1.1 408",
        ),
        (
            "an unfinished chunked body",
            b"POST /v1/locks HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b'Transfer-Encoding: chunked\r\n\r\n20\r\n{"organization_id',
            b"HTTP/1.1 408",
        ),
    ],
)
def test_what_does_not_arrive_in_time_is_cut_off(
    service: tuple[str, int, int], case: str, sent: bytes, expected: bytes
) -> None:
    _, port, _ = service
    with connect(port) as sock:
        sock.sendall(sent)
        started = time.monotonic()
        got = answer(sock, within=10)
        waited = time.monotonic() - started
    assert got.startswith(expected), (case, got[:100])
    assert 0.5 < waited < 5, f"{case}: closed after {waited:.1f} s (the deadline is 1 s)"


def test_a_head_begun_after_an_answer_and_never_finished_gets_408_too(service: tuple[str, int, int]) -> None:
    """On a keep-alive connection, the next request's head is timed from the last answer on, and
    one that begins but never ends is told so (408), as on a fresh connection."""
    _, port, _ = service
    with connect(port) as sock:
        for _ in range(3):  # the timer is set once and its deadline moves on with every request
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
            sock.settimeout(5)
            first = b""
            while not first.endswith(b'{"status":"ok"}'):  # the head and the body may come apart
                first += sock.recv(65536) or b"(closed)"
            assert first.startswith(b"HTTP/1.1 200"), first
            time.sleep(0.6)  # more than half the 1 s deadline, each time
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-A: 1")
        started = time.monotonic()
        got = answer(sock, within=10)
        waited = time.monotonic() - started
    assert got.startswith(b"HTTP/1.1 408"), got[:100]
    # 1 s from the last answer, 0.6 s of which had passed before the head began.
    assert 0.2 < waited < 4, f"closed after {waited:.1f} s (0.4 s were left)"


def test_a_normal_client_is_served_beside_a_thousand_slow_connections(db_url: str, tmp_path: Path) -> None:
    """1,000 connections that send half a head and then nothing, for the whole of the default
    head deadline: a normal client beside them gets every answer, none slower than 1 s."""
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _):
        port = int(url.rsplit(":", 1)[1])
        slow: list[socket.socket] = []
        try:
            for _ in range(1000):
                sock = connect(port)
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
                slow.append(sock)
            latencies: list[float] = []
            statuses: list[int] = []
            with httpx.Client(base_url=url, timeout=5) as http:
                body = {"organization_id": "acme", "job_type": "victim", "holder": "v", "ttl_seconds": 30}
                for _ in range(100):
                    started = time.monotonic()
                    grant = http.post("/v1/locks", json=body)
                    statuses.append(grant.status_code)
                    if grant.status_code == 201:
                        gone = http.delete(
                            f"/v1/locks/{grant.json()['id']}", headers={"Lock-Token": grant.json()["token"]}
                        )
                        statuses.append(gone.status_code)
                    latencies.append(time.monotonic() - started)
        finally:
            for sock in slow:
                sock.close()
    latencies.sort()
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(
        f"victim cycles beside 1,000 slow connections: p50 {statistics.median(latencies) * 1000:.1f} ms,"
        f" p99 {p99 * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms"
    )
    assert set(statuses) == {201, 204}, statuses
    assert latencies[-1] < 5, "a cycle waited behind the slow connections' 10 s head deadline"


def test_connections_beyond_the_cap_are_closed_at_once(db_url: str, tmp_path: Path) -> None:
    env = ROUTE.env(db_url, HELIX_LOCKS_MAX_CONNECTIONS="20")
    with running_service(env=env, log=tmp_path / "s.log") as (url, _):
        port = int(url.rsplit(":", 1)[1])
        held = [connect(port) for _ in range(20)]
        try:
            time.sleep(0.2)
            with connect(port) as extra:
                assert answer(extra, within=3) == b"", "closed at once, without a word"
        finally:
            for sock in held:
                sock.close()
        time.sleep(0.2)
        assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200


def _acquire(http: httpx.Client, key: str, organization_id: str, job_type: str) -> httpx.Response:
    body = {"organization_id": organization_id, "job_type": job_type, "holder": "w", "ttl_seconds": 300}
    return http.post("/v1/locks", json=body, headers={"Authorization": f"Bearer {key}"})


def test_an_organization_past_its_live_lock_quota_gets_429_and_another_is_unaffected(
    db_url: str, tmp_path: Path
) -> None:
    acme, globex = keys.create(db_url, "acme"), keys.create(db_url, "globex")
    env = ROUTE.env(db_url, HELIX_LOCKS_MAX_LIVE_LOCKS_PER_ORGANIZATION="20")
    with (
        running_service(env=env, log=tmp_path / "s.log") as (url, _),
        httpx.Client(base_url=url, timeout=10) as http,
    ):
        granted = [_acquire(http, acme, "acme", f"job-{n}") for n in range(20)]
        assert [grant.status_code for grant in granted] == [201] * 20
        refused = _acquire(http, acme, "acme", "job-20")
        assert refused.status_code == 429, refused.text
        assert refused.json()["type"] == "urn:helix-locks:problem:quota-exceeded"
        assert refused.headers["retry-after"] == "1"
        assert _acquire(http, acme, "acme", "job-0").status_code == 409, "its key has a live lock: no quota"
        assert _acquire(http, globex, "globex", "job-0").status_code == 201, (
            "another organization is unaffected"
        )

        # At the limit, a lapsed lock is still reclaimed: that adds no live lock.
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute(
                "UPDATE helix_job_locks SET acquired_at = acquired_at - interval '1 hour',"
                " expires_at = clock_timestamp() - interval '1 second'"
                " WHERE organization_id = 'acme' AND job_type = 'job-1' AND released_at IS NULL"
            )
        reclaim = _acquire(http, acme, "acme", "job-1")
        assert reclaim.status_code == 201, reclaim.text

        # A release makes room for one, and only one.
        lock = granted[2].json()
        auth = {"Authorization": f"Bearer {acme}", "Lock-Token": lock["token"]}
        assert http.delete(f"/v1/locks/{lock['id']}", headers=auth).status_code == 204
        assert _acquire(http, acme, "acme", "job-20").status_code == 201
        assert _acquire(http, acme, "acme", "job-21").status_code == 429


def test_the_live_lock_quota_holds_exactly_under_a_burst_across_two_replicas(
    db_url: str, tmp_path: Path
) -> None:
    """700 acquires of new keys at once, on 128 connections, into two replicas that each count for
    themselves: the organization ends with its quota of 500 live locks, not one more (each
    replica lets through at most a quarter of the room on one count, and the last twentieth is
    granted under the organization's advisory lock), and every other acquire was refused with
    429, none with anything else."""
    acme = keys.create(db_url, "acme")
    # The client opens its 128 connections before it sends on them; on a loaded machine the last
    # head came more than the default 10 s after its connection opened, and the edge closed that
    # connection as too slow (a ReadError in a fresh-clone run). The quota is what is tested here.
    env = ROUTE.env(
        db_url, HELIX_LOCKS_MAX_LIVE_LOCKS_PER_ORGANIZATION="500", HELIX_LOCKS_HEAD_TIMEOUT_SECONDS="120"
    )

    async def burst(urls: list[str]) -> list[int | str]:
        # Each request on a connection of its own: a kept connection that waited more than uvicorn's
        # 5 s keep-alive for its next request (on a loaded machine) could be closed by the service
        # as the request went out on it (a ReadError in a landing run), and a request may not be
        # retried here, since a lost 201 would spoil the count.
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with (
            httpx.AsyncClient(timeout=30, limits=limits) as a,
            httpx.AsyncClient(timeout=30, limits=limits) as b,
        ):
            body = {"organization_id": "acme", "holder": "w", "ttl_seconds": 300}
            answers = await asyncio.gather(
                *(
                    (a, b)[n % 2].post(
                        f"{urls[n % 2]}/v1/locks",
                        json={**body, "job_type": f"job-{n}"},
                        headers={"Authorization": f"Bearer {acme}"},
                    )
                    for n in range(700)
                ),
                # Every request ends before the clients close, whatever one of them met: a failure is
                # reported below, and leaves no socket behind to fail the worker's next test.
                return_exceptions=True,
            )
        return [
            answer.status_code if isinstance(answer, httpx.Response) else repr(answer) for answer in answers
        ]

    with (
        running_service(env=env, log=tmp_path / "a.log") as (first, _),
        running_service(env=env, log=tmp_path / "b.log") as (second, _),
    ):
        statuses = asyncio.run(burst([first, second]))
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT count(*) FROM helix_job_locks WHERE released_at IS NULL").fetchone()
    live = row[0] if row else 0
    print(f"quota 500, burst of 700 into two replicas: {live} live, {statuses.count(429)} refused")
    assert set(statuses) <= {201, 429}, statuses
    assert statuses.count(201) == live == 500


def test_a_waiter_woken_by_a_release_at_the_quota_gets_the_lock(db_url: str, tmp_path: Path) -> None:
    """At its quota, an organization's waiting acquire (through one replica) for a key whose
    holder releases it (through another) gets the lock the release made room for, not 429."""
    acme = keys.create(db_url, "acme")
    env = ROUTE.env(db_url, HELIX_LOCKS_MAX_LIVE_LOCKS_PER_ORGANIZATION="5")
    auth = {"Authorization": f"Bearer {acme}"}
    with (
        running_service(env=env, log=tmp_path / "a.log") as (first, _),
        running_service(env=env, log=tmp_path / "b.log") as (second, _),
        httpx.Client(timeout=30, headers=auth) as http,
    ):
        body = {"organization_id": "acme", "holder": "w", "ttl_seconds": 300}
        held = [http.post(f"{second}/v1/locks", json={**body, "job_type": f"k{n}"}).json() for n in range(5)]
        assert http.post(f"{first}/v1/locks", json={**body, "job_type": "k5"}).status_code == 429
        # Released a few hundredths of a second after the waiter's own look: what it knew then
        # (the quota full) is out of date, and the release is what woke it.
        for n, delay in enumerate((0.02, 0.04, 0.06)):
            answers: list[httpx.Response] = []
            waiter = threading.Thread(
                target=lambda n=n, answers=answers: answers.append(
                    http.post(f"{first}/v1/locks", json={**body, "job_type": f"k{n}", "wait_seconds": 10})
                )
            )
            waiter.start()
            time.sleep(delay)
            lock = held[n]
            gone = http.delete(f"{second}/v1/locks/{lock['id']}", headers={"Lock-Token": lock["token"]})
            assert gone.status_code == 204
            waiter.join(timeout=20)
            assert answers and answers[0].status_code == 201, answers[0].text if answers else "no answer"


# Issue 34, items 5 and 6: the quota at its edge, with an acquire held up in the database. The
# acquire let through on a count waits for its key's row, which a transaction of the test holds
# (the row is inserted there, not committed: the acquire's INSERT ... ON CONFLICT waits for it);
# the test waits for the backends it expects to wait, never for a time.
SLOW_KEY = (
    "INSERT INTO helix_lock_keys (organization_id, job_type, last_fencing_token) VALUES ('acme', 'slow', 0)"
)


def test_an_acquire_let_through_on_the_count_and_held_up_in_the_database_is_counted_at_the_quota(
    db_url: str, tmp_path: Path, conn: Conn
) -> None:
    """Quota 20, 18 live: the process counts 18 and lets one acquire through on that count, which
    then waits in the database for its key's row. The next three go the exact way (the count says
    19, within the quota's last 5%). That way counted committed rows only: it granted two and
    refused the third while the slow one was in flight, and its commit made 21 live locks. The
    room the slow one was let through on is now a share that the exact way holds back, and takes
    back, when it needs it, only once the acquires in flight on it have committed (migration
    0020): 20 live, not one more."""
    acme = keys.create(db_url, "acme")
    env = ROUTE.env(db_url, HELIX_LOCKS_MAX_LIVE_LOCKS_PER_ORGANIZATION="20")
    with (
        running_service(env=env, log=tmp_path / "s.log") as (url, _),
        httpx.Client(base_url=url, timeout=30) as http,
    ):
        assert [_acquire(http, acme, "acme", f"job-{n}").status_code for n in range(18)] == [201] * 18
        exact: list[httpx.Response] = []
        with psycopg.connect(db_url) as blocker:
            blocker.execute(SLOW_KEY)
            slow = Background(lambda: _acquire(http, acme, "acme", "slow"))
            until(lambda: lock_waiters(conn) == 1, "the slow acquire waits for its key's row")

            def the_other_three() -> None:
                for n in range(18, 21):
                    exact.append(_acquire(http, acme, "acme", f"job-{n}"))

            rest = Background(the_other_three)
            # Answered while the slow one is in flight, or waiting in the database for it.
            until(lambda: len(exact) == 3 or lock_waiters(conn) == 2, "the other three are done or wait")
            answered_meanwhile = [answer.status_code for answer in exact]
            blocker.rollback()
            first = slow.result()
            rest.result()
    live = live_locks(db_url, "acme")
    statuses = [first.status_code] + [answer.status_code for answer in exact]
    assert live <= 20, (
        f"{live} live locks with a quota of 20: the slow acquire answered {first.status_code}, the"
        f" other three {statuses[1:]}, of which {answered_meanwhile} while it was in flight"
    )
    assert set(statuses) <= {201, 429}, statuses
    assert live == 20 and statuses.count(201) == 2, f"{live} live, {statuses}: the quota is reached"


def test_an_acquire_held_up_in_the_database_far_from_the_quota_holds_up_no_other(
    db_url: str, tmp_path: Path, conn: Conn
) -> None:
    """Far from the quota, acquires are not serialised: with one acquire of the organization held
    up in the database (its key's row held), 60 others of it are granted meanwhile, through the
    counts that the process takes as its shares run out (quota 100: shares of 23 and less). Only
    the exact way, near the quota, waits for an acquire in flight."""
    acme = keys.create(db_url, "acme")
    # The held-up acquire must outlast the others, however slow the machine.
    env = ROUTE.env(
        db_url, HELIX_LOCKS_MAX_LIVE_LOCKS_PER_ORGANIZATION="100", HELIX_LOCKS_STATEMENT_TIMEOUT_MS="60000"
    )
    with (
        running_service(env=env, log=tmp_path / "s.log") as (url, _),
        httpx.Client(base_url=url, timeout=30) as http,
        psycopg.connect(db_url) as blocker,
    ):
        blocker.execute(SLOW_KEY)
        slow = Background(lambda: _acquire(http, acme, "acme", "slow"))
        until(lambda: lock_waiters(conn) == 1, "the slow acquire waits for its key's row")
        statuses = [_acquire(http, acme, "acme", f"job-{n}").status_code for n in range(60)]
        assert lock_waiters(conn) == 1, "the slow acquire is still held up"
        blocker.rollback()
        assert slow.result().status_code == 201
    assert statuses == [201] * 60, statuses
    assert live_locks(db_url, "acme") == 61


def test_a_replay_at_the_quota_is_judged_by_its_own_effect_while_another_acquire_commits(
    db_url: str, tmp_path: Path, conn: Conn
) -> None:
    """A semaphore's grant, with an Idempotency-Key, and the organization at its quota of 20 (18
    live, one acquire let through on the count and held up in the database, two granted the exact
    way). The repeat of that grant, through another replica, adds no live lock and must be
    answered the same lock and token (migration 0018). Migration 0018 judged it by counting the
    organization's live locks after the acquire, and counted the held-up acquire, committed
    meanwhile, as the repeat's own: 429. It is now judged by what this call did (migration 0020)."""
    acme = keys.create(db_url, "acme")
    env = ROUTE.env(db_url, HELIX_LOCKS_MAX_LIVE_LOCKS_PER_ORGANIZATION="20")
    auth = {"Authorization": f"Bearer {acme}"}
    body = {
        "organization_id": "acme",
        "job_type": "pool",
        "holder": "w",
        "ttl_seconds": 300,
        "max_holders": 2,
    }
    repeat = {**auth, "Idempotency-Key": "lost-answer"}
    with (
        running_service(env=env, log=tmp_path / "a.log") as (one, _),
        running_service(env=env, log=tmp_path / "b.log") as (two, _),
        httpx.Client(base_url=one, timeout=30) as http,
    ):
        grant = http.post("/v1/locks", json=body, headers=repeat)
        assert grant.status_code == 201, grant.text
        assert [_acquire(http, acme, "acme", f"job-{n}").status_code for n in range(17)] == [201] * 17
        filled: list[httpx.Response] = []
        with psycopg.connect(db_url) as slow_key, psycopg.connect(db_url) as pool_key:
            slow_key.execute(SLOW_KEY)
            slow = Background(lambda: _acquire(http, acme, "acme", "slow"))
            until(lambda: lock_waiters(conn) == 1, "the slow acquire waits for its key's row")

            def the_two() -> None:
                for n in (17, 18):
                    filled.append(_acquire(http, acme, "acme", f"job-{n}"))

            fill = Background(the_two)
            until(lambda: len(filled) == 2 or lock_waiters(conn) == 2, "the two are done or wait")
            # The repeat waits for the pair's counter row, or (behind the slow acquire) to count.
            pool_key.execute(
                "SELECT FROM helix_lock_keys WHERE organization_id = 'acme' AND job_type = 'pool' FOR UPDATE"
            )
            replay = Background(lambda: httpx.post(f"{two}/v1/locks", json=body, headers=repeat, timeout=30))
            until(lambda: lock_waiters(conn) == 2 + (len(filled) < 2), "the repeat waits")
            slow_key.rollback()
            held_up = slow.result()  # committed while the repeat is in flight
            pool_key.rollback()
            again = replay.result()
            fill.result()
    assert held_up.status_code in (201, 429), held_up.text
    assert again.status_code == 201, (
        f"the repeat of a live grant was answered {again.status_code}: {again.text}"
    )
    assert (again.json()["id"], again.json()["token"]) == (grant.json()["id"], grant.json()["token"])
    statuses = [held_up.status_code] + [answer.status_code for answer in filled]
    assert live_locks(db_url, "acme") == 18 + statuses.count(201) <= 20, statuses


@pytest.mark.anyio
async def test_a_count_another_process_took_a_moment_ago_does_not_take_the_organization_past_its_quota(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes, quota 20. Process A counts 0 and may let 4 acquires through on that count;
    it lets one through. Process B then takes the organization to 19 live, counting as it goes (it
    counts A's grant, not what A may still let through). A's count is still fresh (here it stays
    fresh: a second, the real freshness, is a long time for a burst), and A let its three others
    through on it: 22 live. The room a count hands out is now a share, held back by every other
    count and taken back by the exact way when it needs it (migration 0020): one more for A, then
    429."""
    monkeypatch.setattr(LiveLockQuota, "FRESH_SECONDS", 3600.0)
    settings = ROUTE.settings(db_url, allow_anonymous=True, max_live_locks_per_organization=20)
    async with in_process(create_app(settings)) as a, in_process(create_app(settings)) as b:
        assert (await a.post("/v1/locks", json=lock_body(job_type="a-0"))).status_code == 201
        for n in range(18):
            assert (await b.post("/v1/locks", json=lock_body(job_type=f"b-{n}"))).status_code == 201
        late = [
            (await a.post("/v1/locks", json=lock_body(job_type=f"a-{n}"))).status_code for n in range(1, 4)
        ]
    live = live_locks(db_url, "acme")
    assert live <= 20, f"{live} live locks with a quota of 20: A's acquires on its earlier count got {late}"
    assert live == 20 and late == [201, 429, 429], (live, late)


def _raw(port: int, request: str, body: bytes = b"") -> tuple[int, bytes]:
    """One request, written as a browser would send it; the status and the whole answer."""
    with connect(port) as sock:
        sock.sendall(request.replace("\n", "\r\n").encode() + b"\r\n" + body)
        got = b""
        sock.settimeout(5)
        while b"\r\n\r\n" not in got or len(got.split(b"\r\n\r\n", 1)[1]) < _length(got):
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
    return int(got.split(b" ", 2)[1]), got


def _length(answer: bytes) -> int:
    for line in answer.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


LOCK = b'{"organization_id": "acme", "job_type": "rebind", "holder": "page", "ttl_seconds": 60}'


def _post(port: int, host: str, *headers: str) -> tuple[int, bytes]:
    lines = ["POST /v1/locks HTTP/1.1", f"Host: {host}", f"Content-Length: {len(LOCK)}", *headers]
    return _raw(port, "\n".join(lines) + "\n", LOCK)


def test_without_keys_only_requests_from_this_machine_are_answered(service: tuple[str, int, int]) -> None:
    """DNS rebinding: a page at attacker.example whose name now resolves to 127.0.0.1 sends
    exactly this. Without keys, the Host must be a loopback name, an Origin a loopback one, and a
    body declared JSON (which a page cannot send without a preflight, which is never granted)."""
    url, port, _ = service
    attacker = f"rebind.attacker.example:{port}"
    status, answer_ = _post(port, attacker, f"Origin: http://{attacker}")
    assert status == 403 and b"loopback" in answer_, answer_
    assert _raw(port, f"GET /v1/locks HTTP/1.1\nHost: {attacker}\n")[0] == 403
    assert _raw(port, f"GET /metrics HTTP/1.1\nHost: {attacker}\n")[0] == 403
    json_ = "Content-Type: application/json"
    # Another site's page, straight at 127.0.0.1: its Origin gives it away.
    assert _post(port, f"127.0.0.1:{port}", json_, "Origin: https://evil.example")[0] == 403
    assert _post(port, f"127.0.0.1:{port}", json_, "Origin: null")[0] == 403
    # A body a page could send without asking: text/plain, or no type at all.
    assert _post(port, f"localhost:{port}", "Content-Type: text/plain")[0] == 415
    assert _post(port, f"localhost:{port}")[0] == 415
    assert _post(port, f"[::1]:{port}", "Content-Type: application/x-www-form-urlencoded")[0] == 415
    assert _post(port, "[::1", json_)[0] in (400, 403), "a malformed Host is no loopback name"
    assert _post(port, "evil.example@localhost", json_)[0] == 403, "a Host is host[:port], no user"
    assert _post(port, "localhost/evil", json_)[0] == 403
    assert _post(port, "localhost", json_, "Origin: http://evil.example@localhost")[0] == 403
    with httpx.Client(base_url=url, timeout=5) as http:
        assert http.get("/v1/locks").json()["items"] == [], "nothing above was granted"
    # What a worker or curl on this machine sends is served.
    assert _post(port, f"localhost:{port}", json_, "Origin: http://localhost:3000")[0] == 201
    assert _raw(port, f"GET /v1/locks HTTP/1.1\nHost: 127.0.0.1:{port}\n")[0] == 200


def test_with_keys_the_key_is_the_barrier_and_metrics_need_an_admin_key(db_url: str, tmp_path: Path) -> None:
    acme, admin = keys.create(db_url, "acme"), keys.create(db_url, None)
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _):
        port = int(url.rsplit(":", 1)[1])
        status, _answer = _post(
            port, "helix.internal", "Content-Type: application/json", f"Authorization: Bearer {acme}"
        )
        assert status == 201, "a key holder may name the service as it likes"
        assert _raw(port, f"GET /metrics HTTP/1.1\nHost: localhost:{port}\n")[0] == 401
        org = _raw(port, f"GET /metrics HTTP/1.1\nHost: localhost\nAuthorization: Bearer {acme}\n")
        assert org[0] == 403, "metrics labelled by organization name them all: not for one organization's key"
        status, metrics = _raw(
            port, f"GET /metrics HTTP/1.1\nHost: localhost\nAuthorization: Bearer {admin}\n"
        )
        assert status == 200 and b"helix_locks_" in metrics


def _seed_a_4_mb_page(db_url: str) -> None:
    """500 live locks with 8 KiB of metadata each: GET /v1/locks?limit=500 answers 4 MB."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO helix_job_locks (organization_id, job_type, holder, token, metadata,"
            " fencing_token, acquired_at, expires_at)"
            " SELECT 'acme', 'job-' || n, 'w', md5(n::text), jsonb_build_object('pad', repeat('x', 8000)),"
            "  1, now(), now() + interval '1 hour' FROM generate_series(1, 500) AS n"
        )


def _answers(got: bytes) -> list[tuple[int, int, int]]:
    """The answers in what a connection received: status, Content-Length and body bytes received."""
    answers = []
    while got:
        head, _, rest = got.partition(b"\r\n\r\n")
        length = _length(head + b"\r\n\r\n")
        answers.append((int(head.split(b" ", 2)[1]), length, min(len(rest), length)))
        got = rest[length:]
    return answers


def test_answers_that_are_never_read_are_cut_off_and_free_what_they_held(db_url: str, tmp_path: Path) -> None:
    """30 clients ask for a page of 500 locks with 8 KiB of metadata each (4 MB) and read none of
    it: within the write timeout (1 s here) each connection is aborted, rather than holding its
    page in the server's memory for as long as the client likes."""
    _seed_a_4_mb_page(db_url)
    env = ROUTE.env(db_url, HELIX_LOCKS_WRITE_TIMEOUT_SECONDS="1")
    with running_service(env=env, log=tmp_path / "s.log") as (url, _):
        port = int(url.rsplit(":", 1)[1])
        readers = []
        for _ in range(30):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            # Two pages pipelined: 8 MB, more than the kernel's buffers on both sides can take in.
            sock.sendall(b"GET /v1/locks?limit=500 HTTP/1.1\r\nHost: localhost\r\n\r\n" * 2)
            readers.append(sock)
        try:
            # The server makes 60 pages of 4 MB on a loaded machine, then the write timeout: a
            # reader that read earlier would let its pages through.
            time.sleep(10)
            with httpx.Client(base_url=url, timeout=5) as http:
                assert http.get("/healthz").status_code == 200
            pages = 0
            for sock in readers:
                # (On a loaded machine a request may wait past the pool's timeout and get 503 in
                # full: shed, which is right; a page of 4 MB must never arrive whole.)
                for status, length, received in _answers(answer(sock, within=5)):
                    assert status in (200, 503), status
                    if status == 200:
                        assert length > 4_000_000
                        assert received < length, "a page no one read was sent in full"
                        pages += 1
            assert pages >= len(readers) // 2, f"only {pages} pages were begun for 30 readers"
        finally:
            for sock in readers:
                sock.close()


def test_an_answer_read_too_slowly_is_cut_off_too(db_url: str, tmp_path: Path) -> None:
    """A client that reads a 4 MB page at 48 KB/s, below the 64 KiB/s an answer must move at, is
    cut off after a write timeout or two (2 s here), not after the minute and a half it would
    take: a trickling reader holds its page no longer than one that reads nothing."""
    _seed_a_4_mb_page(db_url)
    env = ROUTE.env(db_url, HELIX_LOCKS_WRITE_TIMEOUT_SECONDS="2")
    with running_service(env=env, log=tmp_path / "s.log") as (url, _):
        port = int(url.rsplit(":", 1)[1])
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET /v1/locks?limit=500 HTTP/1.1\r\nHost: localhost\r\n\r\n")
            sock.settimeout(5)
            started, received, closed = time.monotonic(), 0, False
            while time.monotonic() - started < 15:
                try:
                    chunk = sock.recv(12_000)
                except ConnectionResetError:
                    chunk = b""
                if not chunk:
                    closed = True
                    break
                received += len(chunk)
                time.sleep(0.25)
            took = time.monotonic() - started
    assert closed, f"still served after {took:.0f} s, {received} bytes read"
    assert received < 4_000_000 and took < 10, (received, took)


def _post_json(port: int, body: bytes) -> tuple[int, dict[str, Any], int]:
    """A JSON body posted to /v1/locks: the status, the answer's body, and its size in bytes."""
    head = "POST /v1/locks HTTP/1.1\nHost: localhost\nContent-Type: application/json\n"
    head += f"Content-Length: {len(body)}\n"
    status, got = _raw(port, head, body)
    payload = got.split(b"\r\n\r\n", 1)[1]
    return status, json.loads(payload), len(payload)


def test_metadata_that_swells_as_stored_is_refused_so_no_answer_carries_it(
    service: tuple[str, int, int],
) -> None:
    """Issue 34, item 7: `{"a": [1e308, ... 1160 times]}` is 8,127 bytes as sent, but jsonb stores each
    number as numeric and writes it back whole (309 digits), so the lock's every answer (the
    grant, GET, a page of 150 of them: 54 MB) was 44 times larger. Bounded as stored, it is a small
    422 naming metadata, and nothing is stored to be answered later; 1e-300 alike."""
    url, port, _ = service
    for number in ("1e308", "1e-300"):
        numbers = ",".join([number] * 1160)
        body = (
            '{"organization_id": "acme", "job_type": "swollen", "holder": "w", "ttl_seconds": 60,'
            f' "metadata": {{"a": [{numbers}]}}}}'
        ).encode()
        status, problem, size = _post_json(port, body)
        assert status == 422, problem
        assert [error["field"] for error in problem["errors"]] == ["metadata"]
        assert size < 1000
    with httpx.Client(base_url=url, timeout=5) as http:
        assert http.get("/v1/locks").json()["items"] == [], "nothing was stored"


def test_a_full_semaphores_409_lists_the_20_holders_expiring_first(service: tuple[str, int, int]) -> None:
    """Issue 34, item 11: an acquire of about a hundred bytes, of a semaphore whose 190 slots are
    held, drew a 211,879-byte 409 listing every holder (about 1 MB at 1,000). It lists the 20 whose
    leases run out first, in that order, and counts them all in holders_total."""
    url, port, _ = service
    slots = 190
    # Slot n's lease is 600 + 10 (37 n mod 190) s: they run out in another order than the slots.
    ttls = [600 + 10 * ((37 * n) % slots) for n in range(slots)]
    grants = []
    with httpx.Client(base_url=url, timeout=10) as http:
        for n, ttl in enumerate(ttls):
            holder = f"worker-{n:03}@" + "h" * 200
            lock = {"organization_id": "acme", "job_type": "export", "holder": holder, "ttl_seconds": ttl}
            granted = http.post("/v1/locks", json={**lock, "max_holders": slots})
            assert granted.status_code == 201, granted.text
            grants.append(granted.json())
    body = b'{"organization_id": "acme", "job_type": "export", "holder": "late", "ttl_seconds": 60,'
    body += b' "max_holders": 190}'
    status, problem, size = _post_json(port, body)
    assert status == 409 and problem["type"] == "urn:helix-locks:problem:lock-held"
    first = sorted(grants, key=lambda grant: (grant["expires_at"], grant["slot"]))[:20]
    assert [holder["lock_id"] for holder in problem["holders"]] == [grant["id"] for grant in first]
    assert [grant["slot"] for grant in first] != list(range(20))
    assert problem["holders_total"] == slots and problem["max_holders"] == slots
    assert problem["lock_id"] == problem["holders"][0]["lock_id"]
    assert problem["expires_at"] == problem["holders"][0]["expires_at"]
    # 20 holders of 211 characters each, and the rest of the problem: not 190 of them (50 KB).
    assert size < 6500, size


# The quota's advisory locks are of one organization, and of one share, each: found by review,
# organizations whose ids hash alike in 32 bits (any deployment with ~77,000 organizations has a
# pair by chance) shared the organization's lock, and shares 2^31 - 1 ids apart shared theirs, so
# that one organization's acquire held up at its quota held up another's. Two organization ids
# whose hashtext() is the same (-271856899), found among 'org-1'..'org-300000' in half a second:
COLLIDING = ("org-104232", "org-1245")


@pytest.mark.anyio
async def test_an_organization_whose_id_hashes_alike_does_not_wait_for_anothers_acquire_at_its_quota(
    db_url: str, conn: Conn
) -> None:
    """One organization near its quota has an acquire going the exact way, which holds its
    organization's lock while it waits in the database (here for its key's row, held by this test;
    in production for the acquires in flight on its shares, or a slow statement). Another
    organization, whose id hashes alike in 32 bits, has no lock at all: its first acquire needs a
    count (helix_share_quota), which must not wait for that lock."""
    victim, noisy = COLLIDING[1], COLLIDING[0]
    assert conn.execute("SELECT hashtext(%s) = hashtext(%s)", (victim, noisy)).fetchone() == (True,)
    settings = ROUTE.settings(
        db_url, allow_anonymous=True, max_live_locks_per_organization=100, statement_timeout_ms=60_000
    )
    # The noisy organization at 96 live locks of 100: within the quota's last 5%.
    for n in range(96):
        conn.execute(
            "SELECT id FROM helix_acquire_job_lock(%s, %s, 'w', 300000, NULL, NULL, 1)", (noisy, f"k-{n}")
        )
    async with in_process(create_app(settings)) as one, in_process(create_app(settings)) as two:
        with psycopg.connect(db_url) as blocker:
            blocker.execute(
                "INSERT INTO helix_lock_keys (organization_id, job_type, last_fencing_token)"
                " VALUES (%s, 'slow', 0)",
                (noisy,),
            )
            slow = asyncio.ensure_future(
                one.post("/v1/locks", json=lock_body(organization_id=noisy, job_type="slow"))
            )
            for _ in range(500):
                await asyncio.sleep(0.02)
                if lock_waiters(conn) == 1:
                    break
            assert lock_waiters(conn) == 1, "the noisy organization's exact acquire waits for its key"
            other = asyncio.ensure_future(
                two.post("/v1/locks", json=lock_body(organization_id=victim, job_type="anything"))
            )
            await asyncio.wait([other], timeout=3)
            answered = other.done()
            waiting = lock_waiters(conn)
            blocker.rollback()
            await slow
            victims = await other
    assert victims.status_code == 201, victims.text
    assert answered, (
        f"{victim}, with no lock at all, waited over 3 s for its first acquire while {noisy} (whose"
        f" id hashes alike) had one acquire going the exact way at its quota held up in the"
        f" database ({waiting} backends waiting for locks)"
    )


def test_a_share_of_another_organization_2_31_ids_later_does_not_hold_up_the_exact_way(
    db_url: str, conn: Conn
) -> None:
    """Share ids are spent at every count, by every organization (2^31 of them is weeks of a busy
    deployment): taking its own share back near its quota, acme must not wait for an acquire of
    globex in flight on globex's share 2^31 - 1 ids later (held up for its key's row by this test;
    the identity is moved on rather than spent)."""
    share = conn.execute("SELECT share_id FROM helix_share_quota('acme', 95, 4, 3600, NULL)").fetchone()
    assert share is not None
    conn.execute(
        "SELECT setval(pg_get_serial_sequence('helix_quota_shares', 'id'), %s)", (share[0] + 2147483646,)
    )
    theirs = conn.execute("SELECT share_id FROM helix_share_quota('globex', 95, 4, 3600, NULL)").fetchone()
    assert theirs is not None and theirs[0] % 2147483647 == share[0] % 2147483647
    # acme at 90 live of a quota of 100: with its share's 23 held back, its next acquire the exact
    # way needs that room and takes the share back.
    for n in range(90):
        conn.execute(
            "SELECT id FROM helix_acquire_job_lock('acme', %s, 'w', 300000, NULL, NULL, 1)", (f"k-{n}",)
        )
    outcome: dict[str, Any] = {}

    def run(name: str, statement: str, params: tuple[Any, ...]) -> None:
        with psycopg.connect(db_url, autocommit=True) as c:
            try:
                outcome[name] = c.execute(statement, params).fetchone()
            except psycopg.Error as exc:
                outcome[name] = exc

    with psycopg.connect(db_url) as blocker:
        blocker.execute(
            "INSERT INTO helix_lock_keys (organization_id, job_type, last_fencing_token)"
            " VALUES ('globex', 'slow', 0)"
        )
        held_up = threading.Thread(
            target=run,
            args=(
                "globex",
                "SELECT id FROM helix_acquire_job_lock_on_share("
                "'globex', 'slow', 'w', 300000, NULL, NULL, 1, %s)",
                (theirs[0],),
            ),
        )
        held_up.start()
        until(lambda: lock_waiters(conn) == 1, "globex's acquire waits for its key's row")
        exact = threading.Thread(
            target=run,
            args=(
                "acme",
                "SELECT id FROM helix_acquire_job_lock_within_quota("
                "'acme', 'x', 'w', 300000, NULL, NULL, 100, 1)",
                (),
            ),
        )
        exact.start()
        exact.join(timeout=3)
        answered = "acme" in outcome
        blocker.rollback()
        held_up.join()
        exact.join()
    assert answered, (
        f"acme's acquire (90 live of 100) waited over 3 s for globex's acquire held up on globex's"
        f" share {theirs[0]}, whose advisory key is that of acme's share {share[0]}: {outcome}"
    )
