"""Watching: the SDK's watch (both clients) and `helix-locks watch`, against a stand-in event
stream on a real socket that cuts, refuses and stalls on cue, and against the real service, cut
in the middle of its stream by a proxy and resumed on another replica."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import psycopg
import pytest

from harness.processes import ROOT, free_port, helix_command, running_service
from helix_locks import LockEvent
from helix_locks import client as sdk
from helix_locks.client import (
    ApiError,
    AsyncLockClient,
    EventDecoder,
    LockClient,
    LockLost,
    ServerEvent,
    Unavailable,
)

# --- the parser ----------------------------------------------------------------------------------


def decode(text: str, last_event_id: str | None = None) -> tuple[list[ServerEvent], EventDecoder]:
    decoder = EventDecoder(last_event_id)
    events = [sent for line in text.splitlines() if (sent := decoder.feed(line)) is not None]
    return events, decoder


def test_the_parser_follows_the_standard() -> None:
    events, decoder = decode(
        "\ufeff: keep-alive\n"
        'id: 1\nevent: acquired\ndata: {"a":\ndata:  1}\n\n'  # two data lines; one space taken
        "data\n\n"  # a field without a colon: an empty value
        "id: 2\nretry: 1500\nunknown: ignored\nevent: released\ndata:x\n\n"  # no space after the colon
        "id\n\n"  # an id alone: no event, but it counts (here: back to no id)
        "id: 3\ndata: kept\n"  # cut before its blank line: never dispatched
    )
    assert events == [
        ServerEvent("acquired", '{"a":\n 1}', "1"),
        ServerEvent("message", "", "1"),  # no id field: the last one stays
        ServerEvent("released", "x", "2"),
    ]
    assert decoder.last_event_id == "", "the id of an event cut before its end does not count"
    assert decoder.retry == 1.5


def test_an_id_holding_nul_is_ignored_and_a_bad_retry_too() -> None:
    events, decoder = decode("id: 7\n\nid: 8\0\nretry: 1s\ndata: d\n\n", last_event_id="6")
    assert events == [ServerEvent("message", "d", "7")]
    assert decoder.last_event_id == "7"
    assert decoder.retry is None


# --- a stand-in event stream ---------------------------------------------------------------------


def frame(event_id: int, kind: str = "acquired", **data: Any) -> bytes:
    body = json.dumps({"type": kind, "at": "2026-01-01T00:00:00Z", "lock": {"id": event_id}, **data})
    return f"id: {event_id}\nevent: {kind}\ndata: {body}\n\n".encode()


@dataclass
class Stream:
    """A 200 event stream: its pieces (bytes, sent as chunks; a number, a pause in seconds), then
    `end`: "close" (a clean end), "cut" (the connection dropped mid-body) or "hang" (silence)."""

    pieces: Sequence[bytes | float]
    end: str = "close"


@dataclass
class Refuse:
    """A problem answer."""

    status: int
    kind: str = "refused"
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Seen:
    """A request the stand-in received."""

    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    at: float


class StandIn:
    """GET /v1/events on a real socket, each connection answered by the next of `answers`."""

    def __init__(self, answers: Sequence[Stream | Refuse]) -> None:
        self.answers = list(answers)
        self.seen: list[Seen] = []
        self.closed_by_peer = 0  # streams left "hanging" that the client closed
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._lock = threading.Lock()

    def __enter__(self) -> StandIn:
        self._threads[0].start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._listener.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._answer, args=(connection,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _answer(self, connection: socket.socket) -> None:
        with connection:
            head = b""
            while b"\r\n\r\n" not in head:
                data = connection.recv(65536)
                if not data:
                    return
                head += data
            request_line, *lines = head.split(b"\r\n\r\n")[0].decode().split("\r\n")
            target = urlsplit(request_line.split()[1])
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
            with self._lock:
                self.seen.append(Seen(target.path, parse_qs(target.query), headers, time.monotonic()))
                answer = self.answers.pop(0) if self.answers else Refuse(500, "script-ran-out")
            with contextlib.suppress(OSError):
                self._play(connection, answer)

    def _play(self, connection: socket.socket, answer: Stream | Refuse) -> None:
        if isinstance(answer, Refuse):
            body = json.dumps({"type": f"urn:helix-locks:problem:{answer.kind}", "status": answer.status})
            head = [
                f"HTTP/1.1 {answer.status} Refused",
                "Content-Type: application/problem+json",
                f"Content-Length: {len(body)}",
                "Connection: close",
                *(f"{k}: {v}" for k, v in answer.headers.items()),
            ]
            connection.sendall(("\r\n".join(head) + "\r\n\r\n" + body).encode())
            return
        connection.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
            b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        for piece in answer.pieces:
            if isinstance(piece, float | int):
                time.sleep(piece)
            else:
                connection.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        if answer.end == "close":
            connection.sendall(b"0\r\n\r\n")
        elif answer.end == "hang":
            connection.settimeout(0.05)
            while not self._stop.is_set():
                try:
                    if not connection.recv(1):
                        self.closed_by_peer += 1
                        return
                except TimeoutError:
                    continue
                except ConnectionResetError:
                    # The client closed while a frame was in flight: the kernel answered it with a
                    # reset rather than an end of file. Closed all the same.
                    self.closed_by_peer += 1
                    return
        # "cut": the connection closes with the body unfinished.


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def watch_until_error(
    kind: str,
    url: str,
    *,
    timeout: float = 10.0,
    sink: Callable[[LockEvent], None] | None = None,
    **options: Any,
) -> tuple[list[LockEvent], BaseException]:
    """Every event the client's watch hands out (to `sink` too, as it comes), and the error that
    ends it."""
    events: list[LockEvent] = []

    def take(event: LockEvent) -> None:
        events.append(event)
        if sink is not None:
            sink(event)

    if kind == "sync":
        with LockClient(url, timeout=timeout) as client:
            try:
                for event in client.watch(**options):
                    take(event)
            except Exception as exc:
                return events, exc
        raise AssertionError("a watch ended without an error")

    async def watch() -> BaseException:
        async with AsyncLockClient(url, timeout=timeout) as client:
            try:
                async with contextlib.aclosing(client.watch(**options)) as stream:
                    async for event in stream:
                        take(event)
            except Exception as exc:
                return exc
        raise AssertionError("a watch ended without an error")

    return events, asyncio.run(watch())


def test_a_watch_resumes_after_a_cut_a_503_and_an_end_missing_and_repeating_nothing(kind: str) -> None:
    cut_event = b'id: 3\nevent: renewed\ndata: {"type": "renewed"'  # the rest never comes
    answers: list[Stream | Refuse] = [
        Stream([frame(1), frame(2, "renewed")[:10], frame(2, "renewed")[10:], cut_event], end="cut"),
        Refuse(503, "database-unavailable", {"Retry-After": "1"}),
        Stream(
            [
                b": keep-alive\r\n\r\n",
                frame(3, "renewed").replace(b"\n", b"\r\n"),
                b'id: 4\rdata: {"type": "released",\rdata: "lock": {"id": 4}}\r\r',
            ]
        ),
        Refuse(410, "events-expired"),
    ]
    with StandIn(answers) as stand_in:
        events, error = watch_until_error(kind, stand_in.url, organization_id="acme", job_type="report")
    assert [(e["id"], e["type"], e["lock"]["id"]) for e in events] == [
        ("1", "acquired", 1),
        ("2", "renewed", 2),
        ("3", "renewed", 3),
        ("4", "released", 4),
    ]
    assert isinstance(error, ApiError) and error.status == 410
    assert error.problem["type"].endswith("events-expired")
    assert [seen.headers.get("last-event-id") for seen in stand_in.seen] == [None, "2", "2", "4"]
    assert {seen.path for seen in stand_in.seen} == {"/v1/events"}
    assert all(seen.query == {"organization_id": ["acme"], "job_type": ["report"]} for seen in stand_in.seen)
    assert all(seen.headers["accept"] == "text/event-stream" for seen in stand_in.seen)
    waited = stand_in.seen[2].at - stand_in.seen[1].at
    assert waited >= 0.95, f"Retry-After: 1 was not honoured ({waited:.2f} s)"


EVENTS = json.loads((ROOT / "clients" / "contract.json").read_text(encoding="utf-8"))["events"]
WATCH_RETRIED = EVENTS["retry_statuses"]


@pytest.mark.parametrize("status", sorted({*WATCH_RETRIED, 400, 401, 403, 404, 409, 410, 422, 500, 501}))
def test_a_watch_opens_its_stream_again_after_the_contract_s_statuses_and_no_others(
    kind: str, status: int
) -> None:
    answers = [
        Refuse(status, "refused", {"Retry-After": "0", "X-Request-Id": "r-1"}),
        Refuse(401, "unauthenticated"),
    ]
    with StandIn(answers) as stand_in:
        events, error = watch_until_error(kind, stand_in.url)
    assert events == []
    assert isinstance(error, ApiError)
    if status in WATCH_RETRIED:
        assert (error.status, len(stand_in.seen)) == (401, 2), f"{status} did not open the stream again"
    else:
        assert (error.status, len(stand_in.seen)) == (status, 1), f"{status} opened the stream again"
        assert (error.request_id, error.retry_after) == ("r-1", 0)


def test_an_empty_last_event_id_is_not_sent(kind: str) -> None:
    assert EVENTS["sends_empty_last_event_id"] is False
    answers: list[Stream | Refuse] = [
        Stream([frame(5), b"id\n\n"], end="cut"),
        Refuse(401, "unauthenticated"),
    ]
    with StandIn(answers) as stand_in:
        events, error = watch_until_error(kind, stand_in.url, last_event_id="4")
    assert [event["id"] for event in events] == ["5"]
    assert isinstance(error, ApiError) and error.status == 401
    assert [seen.headers.get("last-event-id") for seen in stand_in.seen] == ["4", None]


@pytest.mark.parametrize("status", [401, 403, 422])
def test_a_refusal_ends_the_watch_at_once(kind: str, status: int) -> None:
    with StandIn([Refuse(status, "unauthenticated")]) as stand_in:
        events, error = watch_until_error(kind, stand_in.url, last_event_id="41")
    assert events == []
    assert isinstance(error, ApiError) and error.status == status
    assert len(stand_in.seen) == 1
    assert stand_in.seen[0].headers["last-event-id"] == "41"
    assert stand_in.seen[0].query == {}


def test_a_silent_stream_is_taken_for_dead_and_opened_again(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sdk, "WATCH_READ_SECONDS", 0.5)
    answers: list[Stream | Refuse] = [
        Stream([frame(10), b": keep-alive\n", 0.3, b": keep-alive\n", 0.3, frame(11)], end="hang"),
        Stream([frame(12)], end="hang"),
        Refuse(401, "unauthenticated"),
    ]
    with StandIn(answers) as stand_in:
        events, error = watch_until_error(kind, stand_in.url, timeout=0.5)
    assert [e["id"] for e in events] == ["10", "11", "12"], "keep-alives kept the first stream open"
    assert isinstance(error, ApiError) and error.status == 401
    assert [seen.headers.get("last-event-id") for seen in stand_in.seen] == [None, "11", "12"]


def test_nothing_listening_is_said_at_once(kind: str) -> None:
    started = time.monotonic()
    events, error = watch_until_error(kind, f"http://127.0.0.1:{free_port()}")
    assert events == []
    assert isinstance(error, Unavailable) and "connection refused" in str(error)
    assert time.monotonic() - started < 5, "said at once, not after retrying"


def test_a_service_that_keeps_answering_503_is_given_up_after_within(kind: str) -> None:
    with StandIn([Refuse(503, "database-unavailable")] * 100) as stand_in:
        started = time.monotonic()
        events, error = watch_until_error(kind, stand_in.url, within=1.0)
        took = time.monotonic() - started
    assert events == []
    assert isinstance(error, Unavailable)
    assert 0.5 < took < 5, f"gave up after {took:.1f} s of a 1 s limit"
    assert len(stand_in.seen) > 3, "retried with backoff"


def test_a_stream_that_is_not_an_event_stream_is_refused(kind: str) -> None:
    class NotAStream(StandIn):
        def _play(self, connection: socket.socket, answer: Stream | Refuse) -> None:
            body = b'{"items": []}'
            connection.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )

    with NotAStream([]) as stand_in:
        events, error = watch_until_error(kind, stand_in.url)
    assert events == [] and isinstance(error, ApiError) and "application/json" in str(error.problem)


def test_an_event_whose_data_is_not_a_json_object_is_refused(kind: str) -> None:
    with StandIn([Stream([frame(1), b"id: 2\ndata: [1, 2]\n\n"])]) as stand_in:
        events, error = watch_until_error(kind, stand_in.url)
    assert [e["id"] for e in events] == ["1"]
    assert isinstance(error, ApiError) and "not a JSON object" in str(error)


def test_leaving_the_loop_closes_the_stream(kind: str) -> None:
    with StandIn([Stream([frame(1), frame(2)], end="hang")]) as stand_in:
        if kind == "sync":
            with LockClient(stand_in.url) as client, contextlib.closing(client.watch()) as events:
                assert next(events)["id"] == "1"
        else:

            async def first() -> None:
                async with (
                    AsyncLockClient(stand_in.url) as client,
                    contextlib.aclosing(client.watch()) as events,
                ):
                    async for event in events:
                        assert event["id"] == "1"
                        break

            asyncio.run(first())
        deadline = time.monotonic() + 5
        while not stand_in.closed_by_peer and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stand_in.closed_by_peer == 1


# --- helix-locks watch ---------------------------------------------------------------------------


def helix_watch(url: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        helix_command("watch", "--url", url, *args),
        env={**os.environ, "HELIX_LOCKS_API_KEY": "hlk_test"},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_the_command_prints_json_lines_resumes_after_a_cut_and_exits_64_on_a_refusal() -> None:
    answers: list[Stream | Refuse] = [
        Stream([frame(1), frame(2, "released")], end="cut"),
        Stream([frame(3)]),
        Refuse(410, "events-expired"),
    ]
    with StandIn(answers) as stand_in:
        watcher = helix_watch(stand_in.url, "--org", "acme", "--last-event-id", "0")
        out, err = watcher.communicate(timeout=30)
    assert watcher.returncode == 64, err
    assert [json.loads(line)["id"] for line in out.splitlines()] == ["1", "2", "3"]
    assert json.loads(out.splitlines()[1]) == {
        "id": "2",
        "type": "released",
        "at": "2026-01-01T00:00:00Z",
        "lock": {"id": 2},
    }
    assert err.startswith("helix-locks watch: 410"), err
    assert "Traceback" not in err
    assert [seen.headers.get("last-event-id") for seen in stand_in.seen] == ["0", "2", "3"]
    assert stand_in.seen[0].query == {"organization_id": ["acme"]}
    assert stand_in.seen[0].headers["authorization"] == "Bearer hlk_test"


def test_the_command_flushes_each_line_and_stops_quietly_on_ctrl_c() -> None:
    with StandIn([Stream([frame(1)], end="hang")]) as stand_in:
        watcher = helix_watch(stand_in.url, "--job-type", "report")
        assert watcher.stdout is not None
        line = read_line(watcher, timeout=20)
        assert json.loads(line)["id"] == "1"
        watcher.send_signal(signal.SIGINT)
        out, err = watcher.communicate(timeout=20)
    assert watcher.returncode == 0
    assert (out, err) == ("", "")


def test_the_command_ends_when_its_reader_goes_away() -> None:
    answers = [Stream([frame(1), 0.5, *(frame(n) for n in range(2, 200))], end="hang")]
    with StandIn(answers) as stand_in, helix_watch(stand_in.url) as watcher:
        assert watcher.stdout is not None and watcher.stderr is not None
        assert json.loads(read_line(watcher, timeout=20))["id"] == "1"
        watcher.stdout.close()  # as `helix-locks watch | head -n 1` does
        assert watcher.wait(timeout=20) == 128 + signal.SIGPIPE
        assert watcher.stderr.read() == ""


def test_the_command_says_at_once_that_nothing_listens() -> None:
    watcher = helix_watch(f"http://127.0.0.1:{free_port()}")
    _, err = watcher.communicate(timeout=20)
    assert watcher.returncode == 69
    assert "connection refused" in err


def read_line(process: subprocess.Popen[str], timeout: float) -> str:
    """The process's next line of standard output, or a failure after `timeout` seconds."""
    lines: queue.Queue[str] = queue.Queue()
    assert process.stdout is not None
    stdout = process.stdout
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        process.kill()
        raise AssertionError(f"no line within {timeout} s") from None


# --- against the real service --------------------------------------------------------------------


class CuttableProxy:
    """A TCP front for an HTTP service that a test can cut (every open connection dropped), shut
    (new connections closed at once) and point at another replica."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.shut = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.shut:
                client.close()
                continue
            parts = urlsplit(self.target)
            try:
                server = socket.create_connection((parts.hostname, parts.port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open.update((client, server))
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_RDWR)  # ends the other direction's pipe, which closes it
        source.close()

    def cut(self) -> None:
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            self._open.clear()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._listener.close()
        self.cut()


class Watcher:
    """A client's watch read in a thread of its own into a queue, until it fails."""

    def __init__(self, kind: str, url: str, **options: Any) -> None:
        self.events: queue.Queue[LockEvent] = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._watch, args=(kind, url, options), daemon=True)
        self.thread.start()

    def _watch(self, kind: str, url: str, options: dict[str, Any]) -> None:
        try:
            _, self.error = watch_until_error(kind, url, within=3.0, sink=self.events.put, **options)
        except BaseException as exc:
            self.error = exc
            raise

    def next(self, timeout: float = 10.0) -> LockEvent:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no event within {timeout} s (watch error: {self.error!r})") from None

    def until(self, predicate: Callable[[LockEvent], bool], timeout: float = 10.0) -> list[LockEvent]:
        """Events up to and including the first one that satisfies the predicate."""
        seen = []
        deadline = time.monotonic() + timeout
        while True:
            event = self.next(max(deadline - time.monotonic(), 0.01))
            seen.append(event)
            if predicate(event):
                return seen


@pytest.fixture
def replicas(db_url: str, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """Two service processes on one database."""
    env = {"DATABASE_URL": db_url}
    with (
        running_service(env=env, log=tmp_path / "a.log") as (a, _),
        running_service(env=env, log=tmp_path / "b.log") as (b, _),
    ):
        yield a, b


def released_event(lock_id: int) -> Callable[[LockEvent], bool]:
    return lambda event: event["type"] == "released" and event["lock"]["id"] == lock_id


def start_watching(kind: str, url: str, client: LockClient, job_type: str | None = None) -> Watcher:
    """A Watcher of acme's locks (of one job type, if given) whose stream is surely open: it has
    seen a marker lock come and go."""
    watcher = Watcher(kind, url, organization_id="acme", job_type=job_type)
    deadline = time.monotonic() + 20
    while True:
        grant = client.acquire("acme", job_type or "marker", ttl=5, holder="marker")
        client.release(grant.id, grant.token)
        with contextlib.suppress(AssertionError):
            watcher.until(released_event(grant.id), timeout=0.5)
            return watcher
        assert time.monotonic() < deadline, f"the watch never opened: {watcher.error!r}"


def test_a_holder_s_changes_are_watched_in_order(kind: str, replicas: tuple[str, str]) -> None:
    url, _ = replicas
    with LockClient(url) as client:
        watcher = start_watching(kind, url, client)
        with client.lock("acme", "report", ttl=30, holder="w1") as lease:
            client.renew(lease.grant.id, lease.grant.token, ttl=30)
            updated = lease.update({"done": 40, "of": 100})
            assert updated["metadata"] == {"done": 40, "of": 100}
        lock_id = lease.grant.id
        events = watcher.until(released_event(lock_id))
    mine = [e for e in events if e["lock"]["id"] == lock_id]
    assert [e["type"] for e in mine] == ["acquired", "renewed", "updated", "released"]
    acquired, _, update, released = mine
    assert acquired["reclaimed"] is None
    assert acquired["lock"]["fencing_token"] == lease.fencing_token
    assert update["lock"]["metadata"] == {"done": 40, "of": 100}
    assert released["lock"]["state"] == "released"
    assert all("token" not in e["lock"] for e in mine)
    ids = [e["id"] for e in events]
    assert len(set(ids)) == len(ids)


def test_a_cut_stream_resumes_on_another_replica_missing_and_repeating_nothing(
    kind: str, replicas: tuple[str, str]
) -> None:
    a, b = replicas
    proxy = CuttableProxy(a)
    try:
        with LockClient(a) as client:
            watcher = start_watching(kind, proxy.url, client, job_type="report")
            first = client.acquire("acme", "report", ttl=30, holder="w1")
            before = watcher.until(lambda e: e["lock"]["id"] == first.id)
            assert before[-1]["type"] == "acquired"
            proxy.shut = True
            proxy.cut()
            # While the watcher is away: every change of a lock it has seen, and a new lock.
            client.renew(first.id, first.token, ttl=30)
            client.update(first.id, first.token, {"done": 1})
            client.release(first.id, first.token)
            second = client.acquire("acme", "report", ttl=30, holder="w2")
            proxy.target, proxy.shut = b, False
            after = watcher.until(lambda e: e["lock"]["id"] == second.id)
            client.release(second.id, second.token)
            after += watcher.until(lambda e: e["lock"]["id"] == second.id)
    finally:
        proxy.close()
    assert watcher.events.empty()
    kinds = [(e["type"], e["lock"]["id"]) for e in after]
    assert ("acquired", first.id) not in kinds, "the acquire before the cut came again"
    assert kinds[-3:] == [("released", first.id), ("acquired", second.id), ("released", second.id)]
    # Renewed and updated may be folded into the lock's latest state in a replay: at most once each.
    assert {k for k, lock in kinds[:-3]} <= {"renewed", "updated"} and len(kinds) <= 5
    released = next(e for e in after if e["type"] == "released")
    assert released["lock"]["metadata"] == {"done": 1}
    ids = [e["id"] for e in before + after]
    assert len(set(ids)) == len(ids)


@pytest.fixture
def service(db_url: str, tmp_path: Path) -> Iterator[str]:
    with running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "service.log") as (url, _):
        yield url


def test_a_lease_that_publishes_after_its_lock_was_taken_learns_it_lost_the_lock(
    kind: str, service: str, conn: psycopg.Connection[tuple[object, ...]]
) -> None:
    def steal() -> None:
        conn.execute("UPDATE helix_job_locks SET expires_at = clock_timestamp() WHERE released_at IS NULL")
        with LockClient(service) as thief:
            thief.acquire("acme", "leader", ttl=30, holder="thief")

    if kind == "sync":
        with LockClient(service) as client, client.lock("acme", "leader", ttl=30) as lease:
            assert lease.update({"address": "10.0.0.7:8080"})["metadata"] == {"address": "10.0.0.7:8080"}
            steal()
            with pytest.raises(LockLost) as lost:
                lease.update({"address": "10.0.0.7:8080"})
            assert lease.lost and lost.value.problem["release_reason"] == "reclaimed"
            with pytest.raises(LockLost):
                lease.update({})  # refused without a request: the lease is lost already
    else:

        async def publish() -> None:
            async with AsyncLockClient(service) as client, client.lock("acme", "leader", ttl=30) as lease:
                published = await lease.update({"address": "10.0.0.7:8080"})
                assert published["metadata"] == {"address": "10.0.0.7:8080"}
                await asyncio.to_thread(steal)
                with pytest.raises(LockLost) as lost:
                    await lease.update({"address": "10.0.0.7:8080"})
                assert lease.lost and lost.value.problem["release_reason"] == "reclaimed"

        asyncio.run(publish())
