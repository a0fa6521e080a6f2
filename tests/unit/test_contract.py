"""The Python SDK keeps clients/contract.json, which the Node client's tests read too: which answers
a request retries and how long it pauses, which end a held lock, how Retry-After reads, what an
ApiError carries, and every text/event-stream case through the SDK's parser. Both clients, against
a small real HTTP server that answers what each test scripts."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from harness.processes import ROOT
from harness.proxies import LocalServer, QuietHandler
from helix_locks import client
from helix_locks.client import (
    ApiError,
    EventDecoder,
    LockHeld,
    LockLost,
    Unavailable,
    backoff_seconds,
    retry_after_seconds,
)
from tests.support import Either, either

CONTRACT = json.loads((ROOT / "clients" / "contract.json").read_text(encoding="utf-8"))
REQUESTS = CONTRACT["requests"]
RETRIED = set(REQUESTS["retry_statuses"])
UNKNOWN_OUTCOME = set(REQUESTS["unknown_outcome_statuses"])
GONE = set(REQUESTS["lock_gone_statuses"])
# Every status the contract names, and others a service or a proxy may answer that it does not.
STATUSES = sorted(RETRIED | UNKNOWN_OUTCOME | GONE | {400, 401, 408, 409, 413, 422, 500, 501, 505})
# A 409 lock-held's body, and a grant's.
HELD = {"type": "urn:helix-locks:problem:lock-held", "holder": "w", "expires_at": "soon"}
GRANTED = {"id": 7, "organization_id": "acme", "job_type": "report", "fencing_token": 3, "token": "t"}


@dataclass
class Answer:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: dict[str, Any] = field(default_factory=dict)


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    at: float


class Scripted(LocalServer):
    """An HTTP server on a real socket that answers each request with the next of `answers`, and
    200 with `then` once they have run out; `seen` records every request."""

    def __init__(self, answers: list[Answer], then: Answer | None = None) -> None:
        self.answers = list(answers)
        self.then = then or Answer(200, body={"id": 1, "ok": True})
        self.seen: list[Seen] = []
        script = self

        class Handler(QuietHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                if length := int(self.headers.get("content-length") or 0):
                    self.rfile.read(length)
                seen = Seen(
                    self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, time.monotonic()
                )
                script.seen.append(seen)
                answer = script.answers.pop(0) if script.answers else script.then
                body = json.dumps({"status": answer.status, **answer.body}).encode()
                self.send_response(answer.status)
                self.send_header("Content-Type", "application/problem+json")
                self.send_header("Content-Length", str(len(body)))
                for name, value in answer.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PATCH = do_DELETE = _answer

        super().__init__(Handler)

    def gaps(self) -> list[float]:
        return [later.at - earlier.at for earlier, later in zip(self.seen, self.seen[1:], strict=False)]


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@contextlib.contextmanager
def scripted(
    kind: str, answers: list[Answer], then: Answer | None = None
) -> Iterator[tuple[Scripted, Either]]:
    with Scripted(answers, then) as server, either(kind, server.url) as client:
        yield server, client


def raised(call: Any, *args: Any, **kwargs: Any) -> BaseException | None:
    try:
        call(*args, **kwargs)
    except Exception as exc:
        return exc
    return None


# --- requests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", STATUSES)
def test_a_request_is_sent_again_after_the_retried_statuses_and_no_others(kind: str, status: int) -> None:
    with scripted(kind, [Answer(status, {"Retry-After": "0"})]) as (server, client):
        error = raised(client.get, 1)
    if status in RETRIED:
        assert error is None, f"{status} was not retried: {error!r}"
        assert len(server.seen) == 2
    else:
        assert error is not None, f"{status} was taken for a success"
        assert len(server.seen) == 1, f"{status} was retried"


@pytest.mark.parametrize("status", sorted(RETRIED))
def test_a_request_that_is_not_idempotent_is_sent_again_only_when_the_service_surely_did_nothing(
    kind: str, status: int
) -> None:
    """No request the SDK sends is of this kind (an acquire carries an Idempotency-Key): the
    rule is checked on the flow that sends them all, with a POST that carries none."""
    with scripted(kind, [Answer(status, {"Retry-After": "0"})]) as (server, client):
        error = raised(client._run, client.client._send("POST", "/v1/anything", json={}, within=1.0))
    if status in UNKNOWN_OUTCOME:
        assert isinstance(error, Unavailable), repr(error)
        assert len(server.seen) == 1, "a POST that may have taken effect was sent again"
    else:
        assert error is None, repr(error)
        assert len(server.seen) == 2


def test_an_acquire_carries_one_idempotency_key_and_so_is_retried(kind: str) -> None:
    answers = [Answer(status, {"Retry-After": "0"}) for status in sorted(RETRIED)]
    with scripted(kind, answers, Answer(201, body=GRANTED)) as (server, client):
        grant = client.acquire("acme", "report", ttl=30)
    assert grant.id == 7
    assert len(server.seen) == len(RETRIED) + 1
    keys = {seen.headers.get("idempotency-key") for seen in server.seen}
    assert len(keys) == 1 and None not in keys, "every attempt carries the same Idempotency-Key"


def test_a_waiting_acquire_asks_again_after_the_backoff_at_most_retry_after(kind: str) -> None:
    waiting = REQUESTS["waiting_acquire"]
    assert waiting["pause"] == "backoff" and waiting["at_most_retry_after"]
    held = Answer(409, {"Retry-After": "0.1"}, HELD)
    with scripted(kind, [held] * 4, Answer(201, body=GRANTED)) as (server, client):
        assert client.acquire("acme", "report", ttl=30, wait=10).id == 7
    for attempt, gap in enumerate(server.gaps()):
        expected = min(backoff_seconds(attempt), 0.1)
        assert expected <= gap < expected * 1.5 + 0.25, f"pause {attempt}: {gap:.3f} s, not {expected} s"


def test_a_waiting_acquire_asks_again_no_later_than_its_wait_ends(kind: str) -> None:
    assert REQUESTS["waiting_acquire"]["at_most_wait_left"]
    with scripted(kind, [], then=Answer(409, {"Retry-After": "5"}, HELD)) as (server, client):
        started = time.monotonic()
        error = raised(client.acquire, "acme", "report", ttl=30, wait=0.3)
        took = time.monotonic() - started
    assert isinstance(error, LockHeld)
    assert 0.3 <= took < 3, f"gave up after {took:.2f} s of a 0.3 s wait, not after Retry-After's 5 s"
    assert len(server.seen) >= 3, "asked again within the wait"


@pytest.mark.parametrize("status", sorted(GONE | {400, 409, 422}))
def test_the_lock_gone_statuses_lose_a_held_lock_and_410_any_request(kind: str, status: int) -> None:
    with scripted(kind, [Answer(status), Answer(status)]) as (server, client):
        renewal = raised(client.renew, 1, "token", 30, within=1.0)
        read = raised(client.get, 1)
    assert isinstance(renewal, LockLost) == (status in GONE), repr(renewal)
    assert isinstance(read, LockLost) == (status == 410), repr(read)
    assert len(server.seen) == 2


def test_the_backoff_is_the_contract_s() -> None:
    backoff = REQUESTS["backoff"]
    assert backoff["jitter"] == 0, "the SDK does not jitter: a contract that does needs it here too"
    for attempt in range(12):
        expected = min(backoff["max_s"], backoff["initial_s"] * backoff["multiplier"] ** attempt)
        assert backoff_seconds(attempt) == pytest.approx(expected)


def test_a_request_pauses_as_the_backoff_says_between_attempts(kind: str) -> None:
    backoff = REQUESTS["backoff"]
    failures = 4
    with scripted(kind, [Answer(503)] * failures) as (server, client):
        client.get(1)
    assert len(server.seen) == failures + 1
    for attempt, gap in enumerate(server.gaps()):
        expected = min(backoff["max_s"], backoff["initial_s"] * backoff["multiplier"] ** attempt)
        assert expected <= gap < expected * 1.5 + 0.25, f"pause {attempt}: {gap:.3f} s, not {expected} s"


@pytest.mark.parametrize(("status", "seconds"), [(503, "1"), (429, "0.5")])
def test_retry_after_is_honoured_in_place_of_the_backoff(kind: str, status: int, seconds: str) -> None:
    assert REQUESTS["honours_retry_after"]
    with scripted(kind, [Answer(status, {"Retry-After": seconds})]) as (server, client):
        client.get(1)
    [gap] = server.gaps()
    assert float(seconds) <= gap < float(seconds) + 0.5


@pytest.mark.parametrize("case", REQUESTS["retry_after"]["cases"], ids=lambda case: repr(case["header"]))
def test_retry_after_reads_as_the_contract_says(kind: str, case: dict[str, Any]) -> None:
    assert retry_after_seconds(case["header"]) == case["seconds"]
    with scripted(kind, [Answer(422, {"Retry-After": case["header"], "X-Request-Id": "r-1"})]) as (_, client):
        error = raised(client.get, 1)
    assert isinstance(error, ApiError)
    assert (error.status, error.request_id, error.retry_after) == (422, "r-1", case["seconds"])


@pytest.mark.parametrize("status", sorted(RETRIED))
def test_once_the_time_runs_out_a_429_is_its_api_error_and_the_others_unavailable(
    kind: str, status: int
) -> None:
    refusal = Answer(status, {"Retry-After": "0.1", "X-Request-Id": "r-2"}, {"detail": "busy"})
    with scripted(kind, [], then=refusal) as (server, client):
        started = time.monotonic()
        error = raised(client.renew, 1, "token", 30, within=0.5)
        took = time.monotonic() - started
    assert len(server.seen) > 2, "retried until the time ran out"
    assert took < 5, f"gave up {took:.1f} s after a 0.5 s limit"
    if status in UNKNOWN_OUTCOME:
        assert isinstance(error, Unavailable) and f"answered {status}" in str(error), repr(error)
        assert (error.status, error.problem) == (status, {"status": status, "detail": "busy"})
    else:
        assert isinstance(error, ApiError), repr(error)
        assert (error.status, error.request_id, error.retry_after) == (status, "r-2", 0.1)


def test_an_api_error_and_a_lock_held_carry_the_request_id(kind: str) -> None:
    answers = [
        Answer(401, {"X-Request-Id": "r-3"}, {"detail": "no key"}),
        Answer(409, {"X-Request-Id": "r-4", "Retry-After": "3"}, HELD),
    ]
    with scripted(kind, answers) as (_, client):
        refused = raised(client.get, 1)
        busy = raised(client.acquire, "acme", "report")
    assert isinstance(refused, ApiError)
    assert (refused.status, refused.request_id, refused.retry_after) == (401, "r-3", None)
    assert refused.problem["detail"] == "no key"
    assert isinstance(busy, LockHeld)
    assert (busy.request_id, busy.retry_after) == ("r-4", 3)


# --- text/event-stream ---------------------------------------------------------------------------


def _parse(pieces: list[bytes] | list[str]) -> tuple[list[dict[str, Any]], EventDecoder]:
    """Each piece fed as it comes; every event with the reconnection time in force once it was fed."""
    decoder = EventDecoder()
    events = []
    for piece in pieces:
        for sent in decoder.feed_chunk(piece):
            retry = None if decoder.retry is None else round(decoder.retry * 1000)
            events.append({"id": sent.id, "event": sent.event, "data": sent.data, "retry": retry})
    return events, decoder


@pytest.mark.parametrize("case", CONTRACT["sse"], ids=lambda case: case["name"])
def test_every_event_stream_case_parses_as_the_contract_says(case: dict[str, Any]) -> None:
    """The chunks as text, as bytes, and the whole stream a byte at a time: a piece may complete
    an event and then set a retry, so an event's own reconnection time is checked on the last."""
    whole = "".join(case["chunks"]).encode()
    passes: list[tuple[list[bytes] | list[str], bool]] = [
        (case["chunks"], False),
        ([chunk.encode() for chunk in case["chunks"]], False),
        ([bytes([byte]) for byte in whole], True),
    ]
    for pieces, bytewise in passes:
        events, decoder = _parse(pieces)
        expected = case["events"]
        if not bytewise:
            events = [{**event, "retry": None} for event in events]
            expected = [{**event, "retry": None} for event in expected]
        assert events == expected, f"{case['name']}, in pieces {pieces!r}"
        retry = None if decoder.retry is None else round(decoder.retry * 1000)
        assert (retry, decoder.last_event_id) == (case["retry"], case["last_event_id"])


def test_the_sdk_s_constants_are_the_contract_s() -> None:
    """What the tests above cannot reach in a second: a watch's statuses (test_watch_clients.py
    drives them) and silence, and how long a refused connection is retried."""
    assert set(client.WATCH_RETRIED) == set(CONTRACT["events"]["retry_statuses"])
    assert CONTRACT["events"]["silence_s"] == client.WATCH_READ_SECONDS
    assert set(client.RETRIED) == RETRIED and set(client.UNKNOWN_OUTCOME) == UNKNOWN_OUTCOME
    assert set(client.GONE) == GONE
    assert REQUESTS["refused_within_s"] == client.REFUSED_WITHIN_SECONDS
