"""Clients that send too much, or too slowly, against a real `serve`, from raw sockets: they are
cut off, and a normal client beside them gets every answer in time."""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import ROUTE, running_service

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
    assert time.monotonic() - started < 1, "refused at once, not when the client stops"
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
            b"POST /v1/locks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            + f"Content-Length: {len(padded)}\r\n\r\n".encode()
            + padded
        )
        assert answer(sock).startswith(b"HTTP/1.1 201")


def test_a_streamed_endless_header_is_cut_off_and_costs_no_memory(service: tuple[str, int, int]) -> None:
    """64 MiB streamed into one header: the server stops reading after its limit."""
    url, port, pid = service
    before = _rss_mb(pid)
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
    assert _rss_mb(pid) - before < 10, "the header was not held in memory"
    assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize(
    ("case", "sent", "expected"),
    [
        ("an idle socket", b"", b""),
        ("a partial request line", b"GET /hea", b"HTTP/1.1 408"),
        ("partial headers", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: 1", b"HTTP/1.1 408"),
        (
            "a short body under a larger Content-Length",
            b"POST /v1/locks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"organization_id": ',
            b"HTTP/1.1 408",
        ),
        (
            "an unfinished chunked body",
            b"POST /v1/locks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
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
    assert latencies[-1] < 1.0


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
