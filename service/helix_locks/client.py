"""The worker SDK: Helix Locks over HTTP, with a lease that renews itself. Needs httpx only.

    client = LockClient("http://127.0.0.1:8080", api_key="hlk_...")
    with client.lock("acme", "nightly-report", ttl=30) as lease:
        for chunk in work():
            lease.check()                       # raises LockLost once the lock may be gone
            store(chunk, fence=lease.fencing_token)

    with client.lock("acme", "export", max_holders=3) as lease:   # a semaphore: 3 at once
        export(fence=(lease.slot, lease.fencing_token))         # fence per slot

A lease counts as lost as soon as a renewal is refused (410, 403, 404), and also when it could
have lapsed by this process's own monotonic clock: renewals that keep failing never go unnoticed.

    with client.session("acme", ["partition-1", "partition-2"], ttl=30) as session:
        work(fences=session.fencing_tokens)  # all at once or none; one renewal for all of them

    for event in client.watch("acme"):      # GET /v1/events, resumed by itself after a cut
        print(event["id"], event["type"], event["lock"]["holder"])
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import getpass
import json
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection, Generator, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, TypeVar, cast

import httpx

from helix_locks.results import (
    Acquired,
    Lock,
    LockEvent,
    LockState,
    OpenedSession,
    Page,
    QueuePage,
    Renewed,
    Revocation,
)

logger = logging.getLogger(__name__)
# What a lease calls, once, when it learns that someone asked its holder to let go.
OnRevocation = Callable[[Revocation], object] | None

DEFAULT_URL = "http://127.0.0.1:8080"
# The retry policy is clients/contract.json's, which the Node client follows too (docs/workers.md).
# Statuses that mean the lock is no longer ours, whatever we do.
GONE = (403, 404, 410)
# Statuses after which a request is sent again, after Retry-After when given, within its time
# limit: the service did nothing (429), or a proxy or a restarting replica answered (502, 503, 504).
RETRIED = (429, 502, 503, 504)
# Of those, the ones that may come after the service acted: sent again only if the request is
# idempotent (every request this SDK sends is; a POST without an Idempotency-Key would not be),
# and once the time limit is reached, Unavailable. A 429 that lasts is raised as ApiError.
UNKNOWN_OUTCOME = (502, 503, 504)
# A lease is given up this long before it would lapse by our clock (network and clock skew).
SAFETY_FRACTION = 0.1
FIRST_BACKOFF_SECONDS = 0.05
MAX_BACKOFF_SECONDS = 2.0
# The service sends a keep-alive comment at least every 15 s: a watch that hears nothing for three
# of them takes its stream for dead and opens another.
WATCH_READ_SECONDS = 45.0
# Statuses after which a watch opens its stream again, after Retry-After when given: too many
# watchers (429, 503), the database out of reach (503), a proxy's 502 or 504 while a replica
# restarts. Any other refusal ends it.
WATCH_RETRIED = (429, 502, 503, 504)
URN = "urn:helix-locks:problem:"
MISMATCH = f"{URN}max-holders-mismatch"
CLOSED = f"{URN}closed-until"
RESERVED = f"{URN}reserved"
# The longest a service waits in one acquire (wait_seconds), less a margin: a key closed for longer
# is asked for again once its opening is within one such round.
ROUND_SECONDS = 50.0
# What the service answers to a path it has no route for, or a method it does not take there:
# not something the SDK ever asks for, so the URL is not the service's root.
NO_ROUTE = (f"{URN}http-404", f"{URN}http-405")
# Statuses that another server (or a wrong path) answers to the SDK's requests: unless a problem
# of the service's own explains them (lock-not-found), the URL is not a Helix Locks service's.
NOT_HERE = (404, 405, 501)


class HelixError(Exception):
    """Base of the SDK's errors."""


class ApiError(HelixError):
    """The service answered with a problem the SDK does not turn into something more specific.

    Its message is the problem's detail, then each entry of its `errors` (a refused field and
    the rule it broke) on a line of its own. `request_id` is the answer's X-Request-Id, which the
    service's log line carries too; `retry_after` its Retry-After in seconds, when it had one that
    reads as a number."""

    def __init__(
        self,
        status: int,
        problem: Mapping[str, Any],
        request_id: str | None = None,
        retry_after: float | None = None,
        message: str | None = None,
    ) -> None:
        super().__init__(message or _describe(status, problem))
        self.status = status
        self.problem = dict(problem)
        self.request_id = request_id
        self.retry_after = retry_after


class NotHelixLocks(ApiError):
    """The URL does not look like a Helix Locks service's: a request of the API found no route
    there (a path under the root, such as .../v1), or another server answered it."""


def _describe(status: int, problem: Mapping[str, Any]) -> str:
    said = f"{status}: {problem.get('detail') or problem.get('title') or 'error'}"
    errors = problem.get("errors")
    for error in errors if isinstance(errors, list) else []:
        if isinstance(error, Mapping):
            said += f"\n  {error.get('field', '?')}: {error.get('message', '?')}"
    return said


class Unavailable(HelixError):
    """The service could not be reached, or answered 502, 503 or 504, until the retries ran out.
    The message says why: the connection was refused, the host's name does not resolve, or no
    answer came, or which answer.

    `status` is the last answer's status (0 when none came), `problem` its problem, if any."""

    def __init__(self, message: str, status: int = 0, problem: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.problem = None if problem is None else dict(problem)


class InvalidURL(HelixError, ValueError):
    """The service's URL cannot be one: it needs http:// or https:// and a host. Raised when a
    client is made, before any request."""


class LockHeld(HelixError):
    """Another holder has the lock; of a semaphore, live locks hold every slot.

    `lock_id`, `holder` and `expires_at` name the held lock whose lease runs out first; `holders`
    lists at most 20 held locks (`lock_id`, `holder`, `slot`, `expires_at`), those whose leases run
    out first; `holders_total` counts them all; `max_holders` is their number of slots; to a
    session's call, `job_type` names the pair; `mode` is the held locks' (exclusive, or shared:
    readers, which an exclusive acquire waits for)."""

    def __init__(self, problem: Mapping[str, Any], retry_after: float, request_id: str | None = None) -> None:
        super().__init__(f"held by {problem.get('holder')} until {problem.get('expires_at')}")
        self.request_id = request_id
        self.lock_id: int | None = problem.get("lock_id")
        self.holder: str | None = problem.get("holder")
        self.expires_at: str | None = problem.get("expires_at")
        self.max_holders: int = problem.get("max_holders") or 1
        # The held locks' mode; "exclusive" where the body names none (a service older than modes,
        # or a waiters-ahead of a key nobody holds).
        self.mode: str = problem.get("mode") or "exclusive"
        holders = problem.get("holders")
        if holders is None and self.lock_id is not None:  # an older service names the one holder
            holders = [
                {"lock_id": self.lock_id, "holder": self.holder, "slot": 0, "expires_at": self.expires_at}
            ]
        self.holders: list[dict[str, Any]] = list(holders or [])
        self.holders_total: int = problem.get("holders_total") or len(self.holders)
        self.retry_after = retry_after
        # Of a session's locks, all refused: the job type of the first (in job type order) held.
        self.job_type: str | None = problem.get("job_type")
        # 409 waiters-ahead: acquires wait in the key's queue and come first; how many (else None).
        self.waiting: int | None = problem.get("waiting")


class ClosedUntil(LockHeld):
    """An acquire with hold_at_least closed the key (409 closed-until): no lock of it is granted
    before `closed_until` (RFC 3339, the database's time), whoever holds it now, if anyone.
    `retry_after` counts the seconds until then."""

    def __init__(self, problem: Mapping[str, Any], retry_after: float, request_id: str | None = None) -> None:
        super().__init__(problem, retry_after, request_id)
        self.closed_until: str | None = problem.get("closed_until")
        self.args = (f"closed until {self.closed_until}",)


class Reserved(LockHeld):
    """A request that the holder let go reserved the free key for its `preferred_holder` until
    `deadline` (409 reserved); `retry_after` counts the seconds until then."""

    def __init__(self, problem: Mapping[str, Any], retry_after: float, request_id: str | None = None) -> None:
        super().__init__(problem, retry_after, request_id)
        self.preferred_holder: str | None = problem.get("preferred_holder")
        self.deadline: str | None = problem.get("deadline")
        self.args = (f"reserved for {self.preferred_holder} until {self.deadline}",)


class MaxHoldersMismatch(ApiError):
    """The key's held locks share another max_holders than the acquire named (409
    max-holders-mismatch): a configuration error, which waiting does not cure. `max_holders` is
    the value in force."""

    def __init__(self, problem: Mapping[str, Any], request_id: str | None = None) -> None:
        super().__init__(409, problem, request_id)
        self.max_holders: int | None = problem.get("max_holders")


class LockLost(HelixError):
    """The lock is no longer held: it ended, was reclaimed or forced, or may have lapsed.

    `problem` is the service's answer when it said so (410, 403, 404), else empty."""

    def __init__(self, reason: str, problem: Mapping[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.problem = dict(problem or {})

    @property
    def released_by_its_token(self) -> bool:
        """A 410 answers a request whose Lock-Token matched (a wrong one is 403 whatever the
        state), and release_reason "released" says the lock was released with that token:
        by this holder, through an earlier attempt whose answer was lost (of a session, its
        end_reason "released")."""
        released = "released" in (self.problem.get("release_reason"), self.problem.get("end_reason"))
        return self.problem.get("status") == 410 and released


@dataclass(frozen=True)
class Grant:
    """An acquired lock: the service's lock object, plus the token that proves ownership."""

    id: int
    organization_id: str
    job_type: str
    fencing_token: int
    token: str = field(repr=False)  # a secret: a logged grant must not show it
    ttl: float
    # This process's monotonic clock when the acquire was sent (or, in lock(), the renewal that
    # confirmed a long acquire): the lease is counted from there.
    sent_at: float = field(repr=False)
    body: Acquired = field(repr=False)
    # Of a semaphore: how many may hold the key at once, and which place, from 0, this one holds.
    max_holders: int = 1
    slot: int = 0
    # exclusive, or shared: held beside the key's other shared locks, never beside an exclusive one.
    mode: str = "exclusive"
    # The lock's hold limit (max_hold), as the service said it (hold_limit_at), or None; and when
    # it surely has come by this process's monotonic clock: as long after the acquire's send as
    # the service put it after the grant (database times both, never this machine's wall clock).
    hold_limit_at: str | None = None
    held_until: float | None = field(default=None, repr=False)
    # Until when the grant closed its key (hold_at_least), as the service said it, or None.
    closed_until: str | None = None
    kind = "locks"  # the path its renewal and release go to


@dataclass(frozen=True)
class SessionGrant:
    """An opened session: the service's session object (its locks in body["locks"], each with its
    own fencing token), plus the token of the session and of all its locks."""

    id: int
    organization_id: str
    token: str = field(repr=False)
    ttl: float
    sent_at: float = field(repr=False)  # as Grant's
    body: OpenedSession = field(repr=False)
    hold_limit_at: str | None = None  # as Grant's, the session's and each of its locks'
    held_until: float | None = field(default=None, repr=False)
    kind = "sessions"


Granted = TypeVar("Granted", Grant, SessionGrant)


def default_holder() -> str:
    """user@host:pid, so that a human can tell whose worker holds a lock."""
    return f"{getpass.getuser()}@{socket.gethostname()}:{os.getpid()}"


# Retry-After as delay-seconds, with a fraction allowed; an HTTP date, a sign, hex, an exponent or
# infinity is not read (float() would take the last three), as in the Node client.
_DELAY_SECONDS = re.compile(r"[ \t]*([0-9]+(?:\.[0-9]+)?)[ \t]*")


def retry_after_seconds(value: str | None) -> float | None:
    """A Retry-After header's seconds, or None when it has none that reads as a number."""
    found = _DELAY_SECONDS.fullmatch(value) if value is not None else None
    return float(found.group(1)) if found else None


def _retry_after(response: httpx.Response, fallback: float) -> float:
    given = retry_after_seconds(response.headers.get("retry-after"))
    return fallback if given is None else given


def _problem(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {"detail": response.text[:200]}
    return body if isinstance(body, dict) else {"detail": str(body)}


def _not_helix_locks(base_url: str, response: httpx.Response, problem: Mapping[str, Any]) -> NotHelixLocks:
    request, url = response.request, httpx.URL(base_url)
    root = f"{url.scheme}://{url.netloc.decode()}"
    hint = f" (give the service's root URL, such as {root})" if url.path not in ("", "/") else ""
    answered = f"{response.status_code} {response.reason_phrase}".strip()
    return NotHelixLocks(
        response.status_code,
        problem,
        response.headers.get("x-request-id"),
        retry_after_seconds(response.headers.get("retry-after")),
        f"{base_url} does not look like a Helix Locks service: {request.method} {request.url.path}"
        f" answered {answered}{hint}",
    )


def _not_here(response: httpx.Response, problem: Mapping[str, Any]) -> bool:
    """Whether an answer says that the URL is not the service's: a 404, 405 or 501 that no
    problem of the service's own explains."""
    kind = problem.get("type")
    return response.status_code in NOT_HERE and (not str(kind).startswith(URN) or kind in NO_ROUTE)


def _raise_for(response: httpx.Response, holding: bool, base_url: str) -> None:
    """Problems as exceptions; `holding`: the request acts on a lock we hold (renew, release)."""
    if response.status_code >= 400:
        raise _error_for(response, holding, base_url)


def _error_for(response: httpx.Response, holding: bool, base_url: str) -> HelixError:
    problem = _problem(response)
    # Before the 404 of a held lock: the service's own answer to a path it has no route for is
    # never a lock's. Any other 404 to a held lock's request ends it, as clients/contract.json has
    # it: stopping the work is the side to err on.
    if _not_here(response, problem) and (not holding or problem.get("type") in NO_ROUTE):
        return _not_helix_locks(base_url, response, problem)
    request_id = response.headers.get("x-request-id")
    if response.status_code == 409 and problem.get("type") == MISMATCH:
        return MaxHoldersMismatch(problem, request_id)
    if response.status_code == 409 and problem.get("type") == CLOSED:
        return ClosedUntil(problem, _retry_after(response, 1.0), request_id)
    if response.status_code == 409 and problem.get("type") == RESERVED:
        return Reserved(problem, _retry_after(response, 1.0), request_id)
    if response.status_code == 409:
        return LockHeld(problem, _retry_after(response, 1.0), request_id)
    if response.status_code == 410 or (holding and response.status_code in GONE):
        return LockLost(f"{response.status_code}: {problem.get('detail', '')}".strip(), problem)
    return _api_error(response, base_url, problem)


def _api_error(response: httpx.Response, base_url: str, problem: Mapping[str, Any] | None = None) -> ApiError:
    """A refusal the SDK gives no meaning of its own (a watch's, say): NotHelixLocks, or ApiError."""
    problem = _problem(response) if problem is None else problem
    if _not_here(response, problem):
        return _not_helix_locks(base_url, response, problem)
    retry_after = retry_after_seconds(response.headers.get("retry-after"))
    request_id = response.headers.get("x-request-id")
    return ApiError(response.status_code, problem, request_id, retry_after)


def _is_retryable(error: BaseException | None, response: httpx.Response | None, idempotent: bool) -> bool:
    """Network trouble or a status of RETRIED. A request that is not idempotent (a POST without
    an Idempotency-Key) is re-sent only if it surely did nothing: a refused connection, or 429."""
    if response is not None:
        return response.status_code in RETRIED and (idempotent or response.status_code not in UNKNOWN_OUTCOME)
    if isinstance(error, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        return True
    return idempotent and isinstance(error, httpx.TransportError)


# How long an acquire retries a refused connection: a service restarting behind its address
# takes longer, but a worker pointed at the wrong one should hear so at once.
REFUSED_WITHIN_SECONDS = 1.0


def _base_url(given: str) -> str:
    """The service's URL, without a trailing slash; InvalidURL unless it is http(s) with a host
    (`localhost:8080` would otherwise read as the scheme `localhost`, and fail at every request)."""
    try:
        url = httpx.URL(given)
    except httpx.InvalidURL as exc:
        raise InvalidURL(f"not a URL: {given!r} ({exc})") from exc
    if url.scheme not in ("http", "https") or not url.host:
        such_as = "" if "://" in given else f", such as 'http://{given}'"
        raise InvalidURL(f"not a service URL: {given!r}: it needs http:// or https:// and a host{such_as}")
    return given.rstrip("/")


E = TypeVar("E", bound=BaseException)


def _cause(error: BaseException | None, kind: type[E]) -> E | None:
    """The first exception of `kind` along an error's causes (httpx wraps the socket's)."""
    while error is not None:
        if isinstance(error, kind):
            return error
        error = error.__cause__ or error.__context__
    return None


def _refused(error: BaseException | None) -> bool:
    """Whether a connection was refused: nothing listens at the address (not a slow answer)."""
    return _cause(error, ConnectionRefusedError) is not None


def _nothing_there(error: BaseException | None) -> bool:
    """Whether the address has no service: the connection was refused, or the host's name does
    not resolve (not a slow answer, which retrying may cure)."""
    return _refused(error) or _cause(error, socket.gaierror) is not None


def _gave_up(base_url: str, within: float, error: BaseException | None) -> Unavailable:
    """Why a request found no service: refused, a name that does not resolve, or no answer."""
    if _refused(error):
        return Unavailable(f"connection refused by {base_url}: is the service running there?")
    if (unresolved := _cause(error, socket.gaierror)) is not None:
        host = httpx.URL(base_url).host
        return Unavailable(f"{base_url}: the host name {host!r} does not resolve ({unresolved.strerror})")
    if isinstance(error, httpx.TimeoutException):
        return Unavailable(f"no answer from {base_url} within {within:.1f} s (timed out)")
    last = f" (the last try: {str(error) or type(error).__name__})" if error is not None else ""
    return Unavailable(f"no answer from {base_url} within {within:.1f} s{last}")


def _gave_up_on(base_url: str, took: float | None, response: httpx.Response, holding: bool) -> HelixError:
    """The error for an answer of RETRIED not retried (any more), after `took` seconds of
    retries: a 429's own ApiError (the refusal stands), else Unavailable (the outcome is unknown)."""
    if response.status_code not in UNKNOWN_OUTCOME:
        return _error_for(response, holding, base_url)
    problem = _problem(response)
    said = problem.get("detail") or problem.get("title")
    answered = f"{base_url} answered {response.status_code}"
    if took is not None:
        answered += f" for {took:.1f} s"
    return Unavailable(f"{answered}: {said}" if said else answered, response.status_code, problem)


def backoff_seconds(attempt: int) -> float:
    """The pause before retry `attempt` (from 0) when the answer gave no Retry-After."""
    return min(MAX_BACKOFF_SECONDS, FIRST_BACKOFF_SECONDS * 2.0**attempt)


def _backoff(attempt: int, response: httpx.Response | None) -> float:
    pause = backoff_seconds(attempt)
    return _retry_after(response, pause) if response is not None else pause


def _acquire_body(
    organization_id: str,
    job_type: str,
    ttl: float,
    holder: str | None,
    metadata: Mapping[str, Any] | None,
    max_holders: int = 1,
    mode: str = "exclusive",
    max_hold: float | None = None,
    hold_at_least: float | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "organization_id": organization_id,
        "job_type": job_type,
        "holder": holder or default_holder(),
        "ttl_seconds": ttl,
    }
    if metadata is not None:
        body["metadata"] = dict(metadata)
    if max_holders != 1:  # 1 is the default: a service older than semaphores gets the same body
        body["max_holders"] = max_holders
    if mode != "exclusive":  # likewise: the default is not sent
        body["mode"] = mode
    if max_hold is not None:
        body["max_hold_seconds"] = max_hold
    if hold_at_least is not None:
        body["hold_at_least_seconds"] = hold_at_least
    return body


def _session_locks(job_types: list[str], shared: Collection[str]) -> list[dict[str, Any]]:
    """A session call's locks: each job type, shared if named in `shared`."""
    unknown = set(shared) - set(job_types)
    if unknown:
        raise ValueError(f"shared names job types the call does not ask for: {sorted(unknown)}")
    return [
        {"job_type": job_type, **({"mode": "shared"} if job_type in shared else {})} for job_type in job_types
    ]


def _wait_round(body: dict[str, Any], give_up: float) -> float:
    """Set this request's wait_seconds (at most the service's 60) and return it."""
    left = round(min(max(give_up - time.monotonic(), 0.0), 60.0), 3)
    if left > 0:
        body["wait_seconds"] = left
    else:
        body.pop("wait_seconds", None)
    return left


def _grant(body: Acquired, ttl: float, sent_at: float) -> Grant:
    # The grant was made after the request was sent, so a lease counted from the send never ends
    # after the service's. (Not from the answer's ttl_remaining_ms: the answer may be read late.)
    return Grant(
        id=body["id"],
        organization_id=body["organization_id"],
        job_type=body["job_type"],
        fencing_token=body["fencing_token"],
        token=body["token"],
        ttl=ttl,
        sent_at=sent_at,
        body=body,
        max_holders=body.get("max_holders", 1),  # absent from a service older than semaphores
        slot=body.get("slot", 0),
        mode=body.get("mode", "exclusive"),  # absent from a service older than modes
        hold_limit_at=body.get("hold_limit_at"),  # absent from a service older than hold limits
        held_until=_held_until(body, sent_at),
        closed_until=body.get("closed_until"),  # absent from a service older than closed keys
    )


def _later(one: float | None, other: float | None) -> float | None:
    """The later of two bounds of a hold limit, either of which may be unknown (None)."""
    return other if one is None else one if other is None else max(one, other)


def _held_until(body: Acquired | OpenedSession | Renewed, sent_at: float) -> float | None:
    """By this process's monotonic clock, when the hold limit of a lock (or session) has surely
    come: as long after the request's send as the answer put it after the answer's moment (its
    lease's end and what was left of it, database times both), so no later than the service's."""
    hold_limit_at = body.get("hold_limit_at")
    if hold_limit_at is None:
        return None
    beyond_lease = datetime.fromisoformat(hold_limit_at) - datetime.fromisoformat(body["expires_at"])
    return sent_at + beyond_lease.total_seconds() + body["ttl_remaining_ms"] / 1000


def _session_grant(body: OpenedSession, ttl: float, sent_at: float) -> SessionGrant:
    return SessionGrant(
        body["id"], body["organization_id"], body["token"], ttl, sent_at, body,
        hold_limit_at=body.get("hold_limit_at"), held_until=_held_until(body, sent_at),
    )  # fmt: skip


def _given(**params: Any) -> dict[str, Any]:
    """A query's parameters: those given (None: not sent)."""
    return {name: value for name, value in params.items() if value is not None}


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass(frozen=True)
class ServerEvent:
    """One event of a text/event-stream: its type, its data, and the last event id at its dispatch."""

    event: str
    data: str
    id: str | None


# Only CRLF, LF and CR end a line of an event stream (str.splitlines would split at U+2028 too).
_LINE_END = re.compile(r"\r\n|\r|\n")


class EventDecoder:
    """Server-Sent Events, as the WHATWG HTML standard parses them (sans I/O): the body's chunks
    in (feed_chunk), or its lines (feed), events out.

    An id counts once its event is dispatched: a stream cut in the middle of an event resumes from
    the event before it, so that the cut one is sent again."""

    def __init__(self, last_event_id: str | None = None) -> None:
        self.last_event_id = last_event_id  # what a reconnection sends as Last-Event-ID
        self.retry: float | None = None  # the server's reconnection time, in seconds
        self._id = last_event_id
        self._event = ""
        self._data: list[str] = []
        self._first = True
        # UTF-8 whatever the charset says; a BOM is kept here and dropped once, as text.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buffer = ""
        self._skip_line_feed = False  # the previous piece ended with a CR

    def feed_chunk(self, chunk: bytes | str) -> list[ServerEvent]:
        """Take a piece of the body as it arrived; return the events it completes."""
        text = self._utf8.decode(chunk) if isinstance(chunk, bytes) else chunk
        if not text:
            return []  # bytes that decoded to nothing yet: a CR before them still waits for its LF
        if self._first:
            self._first = False
            text = text.removeprefix("\ufeff")
        if self._skip_line_feed:
            self._skip_line_feed = False
            text = text.removeprefix("\n")  # the second half of a CRLF that a piece ended inside
        self._buffer += text
        events = []
        start = 0
        for end in _LINE_END.finditer(self._buffer):
            if (sent := self._line(self._buffer[start : end.start()])) is not None:
                events.append(sent)
            start = end.end()
        self._skip_line_feed = self._buffer.endswith("\r")
        self._buffer = self._buffer[start:]
        return events

    def feed(self, line: str) -> ServerEvent | None:
        """Take one line (without its end); return the event that a blank line completes."""
        if self._first:
            self._first = False
            line = line.removeprefix("\ufeff")
        return self._line(line)

    def _line(self, line: str) -> ServerEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None  # a comment: the keep-alive
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            if "\0" not in value:
                self._id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            self.retry = int(value) / 1000
        return None

    def _dispatch(self) -> ServerEvent | None:
        self.last_event_id = self._id
        data, event = self._data, self._event
        self._data, self._event = [], ""
        if not data:
            return None
        return ServerEvent(event or "message", "\n".join(data), self._id)


def _watch_event(sent: ServerEvent) -> LockEvent:
    """An event's data as the SDK hands it over: the JSON object, with its id added."""
    try:
        event = json.loads(sent.data)
    except ValueError:
        event = None
    if not isinstance(event, dict):
        raise ApiError(200, {"detail": f"an event whose data is not a JSON object: {sent.data[:200]!r}"})
    event.setdefault("type", sent.event)
    event["id"] = sent.id
    return cast(LockEvent, event)


class _Held:
    """A held lock or session, renewed in the background, counted on our monotonic clock."""

    grant: Grant | SessionGrant

    def __init__(self, grant: Grant | SessionGrant, on_revocation: OnRevocation = None) -> None:
        # No lease runs past the hold limit, if the lock has one.
        self._limit = getattr(grant, "held_until", None)
        self._deadline = self._bounded(grant.sent_at + grant.ttl)  # by our monotonic clock, from the send
        self._lost_reason: str | None = None
        self._sent = grant.sent_at  # when the latest renewal (or the acquire) was sent
        # A request that the holder let go, the first one the service answered, or None.
        self.revocation: Revocation | None = None
        self._on_revocation = on_revocation
        self._asked(grant.body)

    @property
    def revocation_requested(self) -> bool:
        """Whether someone asked the holder to let go (self.revocation says who, why and by when):
        finish cleanly and leave the block. Nothing is forced; the lease is still held."""
        return self.revocation is not None

    def _asked(self, answer: Mapping[str, Any]) -> None:
        """Note the revocation an answer carries (of a session's, any of its locks'), once, and call
        on_revocation with it; an error in the callback is logged, never stops the renewals."""
        found = answer.get("revocation") or next(
            (lock["revocation"] for lock in answer.get("locks") or () if lock.get("revocation")), None
        )
        if found is None or self.revocation is not None:
            return
        self.revocation = found
        if self._on_revocation is not None:
            try:
                self._on_revocation(found)
            except Exception:
                logger.exception("on_revocation raised; the lease is renewed on")

    def _until_renewal(self) -> float:
        """Seconds to the next renewal: ttl/3 after the previous one's send, however long its
        answer took."""
        return max(self._sent + self.grant.ttl / 3 - time.monotonic(), 0.0)

    @property
    def safety(self) -> float:
        """Seconds before the lease's end by our clock at which it counts as lost: a tenth of
        the lease, at least 0.1 s (network delay and clock drift)."""
        return max(0.1, self.grant.ttl * SAFETY_FRACTION)

    @property
    def remaining(self) -> float:
        """Seconds until the lease could lapse by our clock, less the safety margin."""
        return self._deadline - self.safety - time.monotonic()

    @property
    def lost(self) -> bool:
        """True once a renewal was refused or the lease could have lapsed by our clock: stop
        the work, the lock may be another's."""
        return self._lost_reason is not None or self.remaining <= 0

    def check(self) -> None:
        """Raise LockLost unless the lock is surely still ours."""
        reason = self.lost_reason
        if reason is not None:
            raise LockLost(reason)

    @property
    def lost_reason(self) -> str | None:
        """Why the lease counts as lost, or None while it is held."""
        if self._lost_reason is None and self.remaining <= 0:
            if self.at_hold_limit:
                return f"the lock's hold limit comes at {getattr(self.grant, 'hold_limit_at', None)}"
            return "the lease may have lapsed: renewals did not succeed in time"
        return self._lost_reason

    def _renewed(self, started: float, held_until: float | None = None) -> None:
        # Each answer bounds the hold limit from below (counted from its request's send): the
        # latest bound is the tightest.
        self._limit = _later(self._limit, held_until)
        self._deadline = self._bounded(started + self.grant.ttl)

    def _bounded(self, deadline: float) -> float:
        return deadline if self._limit is None else min(deadline, self._limit)

    @property
    def at_hold_limit(self) -> bool:
        """Whether the lease ends at the lock's hold limit: no renewal takes it further."""
        return self._limit is not None and self._deadline >= self._limit

    def _lose(self, reason: str) -> None:
        if self._lost_reason is None:
            self._lost_reason = reason


class Lease(_Held):
    """A held lock, renewed in the background; shared by the sync and async clients."""

    def __init__(self, grant: Grant, on_revocation: OnRevocation = None) -> None:
        super().__init__(grant, on_revocation)
        self.grant = grant
        self.fencing_token = grant.fencing_token
        # Of a semaphore: the place this lease holds (0 to max_holders - 1). Fence per slot.
        self.slot = grant.slot
        self.max_holders = grant.max_holders
        self.mode = grant.mode
        # When no lease of the lock runs past (max_hold), as the service said it; None: no limit.
        self.hold_limit_at = grant.hold_limit_at


class SessionLease(_Held):
    """A held session, renewed in the background (one renewal for all its locks): `locks` are its
    locks by job type, `fencing_tokens` the fencing token of each, to pass to what it writes."""

    def __init__(self, grant: SessionGrant, on_revocation: OnRevocation = None) -> None:
        super().__init__(grant, on_revocation)
        self.grant = grant
        self.id = grant.id
        self.locks: dict[str, Lock] = {}
        self.fencing_tokens: dict[str, int] = {}
        self._added(grant.body["locks"])

    def _added(self, locks: list[Lock]) -> None:
        for lock in locks:
            self.locks[lock["job_type"]] = lock
            self.fencing_tokens[lock["job_type"]] = lock["fencing_token"]


class SyncLease(Lease):
    """The lease that LockClient.lock yields: it can also publish the lock's metadata."""

    def __init__(self, grant: Grant, client: LockClient, on_revocation: OnRevocation = None) -> None:
        super().__init__(grant, on_revocation)
        self._client = client

    def update(self, metadata: Mapping[str, Any] | None) -> Lock:
        """Replace the lock's metadata (progress, a leader's address) and return the lock; LockLost,
        without a request, if the lease is lost already, or when the service says it is."""
        return self._client._run(self._client._lease_update(self, metadata))


class AsyncLease(Lease):
    """The lease that AsyncLockClient.lock yields: as SyncLease, with a coroutine."""

    def __init__(
        self,
        grant: Grant,
        client: AsyncLockClient,
        on_revocation: OnRevocation = None,
    ) -> None:
        super().__init__(grant, on_revocation)
        self._client = client

    async def update(self, metadata: Mapping[str, Any] | None) -> Lock:
        """As SyncLease.update."""
        return await self._client._run(self._client._lease_update(self, metadata))


@dataclass(frozen=True)
class _Call:
    """A request for the driver to send; the flow is sent its response, or its TransportError."""

    method: str
    path: str
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class _Pause:
    """A pause for the driver to make: time.sleep, or asyncio.sleep."""

    seconds: float


@dataclass(frozen=True)
class _Open:
    """A streamed request for the driver to open (its earlier one closed): the flow is sent the
    response, with the body read unless it is 200, or the TransportError."""

    path: str
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class _ReadChunk:
    """The open stream's next piece, for the driver to read: the flow is sent the bytes as they
    came, None when the stream ended, or the TransportError that cut it."""


@dataclass(frozen=True)
class _Emit:
    """An event for the driver to hand to its caller; the flow is sent None once it is taken."""

    event: LockEvent


T = TypeVar("T")
_Outcome = httpx.Response | httpx.TransportError | None
# What the two clients share is written once, as flows: generators that yield the requests to
# send and the pauses to make, and are sent each request's outcome (httpx's Auth.auth_flow works
# the same way). LockClient drives them with httpx.Client and time.sleep, AsyncLockClient with
# httpx.AsyncClient and asyncio.sleep; neither decides anything.
Flow = Generator[_Call | _Pause, _Outcome, T]
# A watch is a flow too, one that never returns: it opens a stream, reads its pieces, hands out
# its events, and opens it again after a cut.
WatchFlow = Generator[_Open | _ReadChunk | _Pause | _Emit, _Outcome | bytes, None]


class _Core:
    """Settings, requests, retries and backoff, the acquire's wait and a lease's renewal."""

    def __init__(self, base_url: str | None, api_key: str | None, timeout: float) -> None:
        self.base_url = _base_url(base_url or os.environ.get("HELIX_LOCKS_URL") or DEFAULT_URL)
        self.headers = _headers(api_key or os.environ.get("HELIX_LOCKS_API_KEY"))
        self.timeout = timeout
        self._heard = False  # whether the service has answered this client yet

    def _send(
        self,
        method: str,
        path: str,
        *,
        within: float = 10.0,
        refused_within: float | None = None,
        holding: bool = False,
        idempotent: bool = False,
        **kwargs: Any,
    ) -> Flow[httpx.Response]:
        """One request, retried on network trouble and the statuses of RETRIED for at most
        `within` seconds; a refused connection or a name that does not resolve for at most
        `refused_within` (by default, until the service has answered this client once,
        REFUSED_WITHIN_SECONDS: a wrong address is said at once, a service that answered before
        and refuses now is restarting). `idempotent`: a POST that may be sent twice (else only one
        with an Idempotency-Key, or a holder's)."""
        if refused_within is None:
            refused_within = within if self._heard else REFUSED_WITHIN_SECONDS
        started = time.monotonic()
        deadline = started + within
        refused_deadline = min(deadline, started + refused_within)
        idempotent = (
            idempotent or method != "POST" or holding or "Idempotency-Key" in kwargs.get("headers", {})
        )
        attempt = 0
        while True:
            outcome = yield _Call(method, path, kwargs)
            response = outcome if isinstance(outcome, httpx.Response) else None
            error = outcome if isinstance(outcome, httpx.TransportError) else None
            self._heard = self._heard or response is not None
            if not _is_retryable(error, response, idempotent):
                if error is not None:
                    raise Unavailable(str(error)) from error
                assert response is not None
                if response.status_code in UNKNOWN_OUTCOME:  # of a request that is not idempotent
                    raise _gave_up_on(self.base_url, None, response, holding)
                _raise_for(response, holding, self.base_url)
                return response
            pause = _backoff(attempt, response)
            if time.monotonic() + pause > (refused_deadline if _nothing_there(error) else deadline):
                if response is not None:
                    raise _gave_up_on(self.base_url, time.monotonic() - started, response, holding)
                raise _gave_up(self.base_url, within, error) from error
            yield _Pause(pause)
            attempt += 1

    def _acquire(
        self,
        organization_id: str,
        job_type: str,
        ttl: float,
        holder: str | None,
        metadata: Mapping[str, Any] | None,
        wait: float,
        max_holders: int = 1,
        mode: str = "exclusive",
        max_hold: float | None = None,
        hold_at_least: float | None = None,
    ) -> Flow[Grant]:
        body = _acquire_body(
            organization_id, job_type, ttl, holder, metadata, max_holders, mode, max_hold, hold_at_least
        )
        return (yield from self._granted("/v1/locks", body, ttl, wait, _grant))

    def _open_session(
        self,
        organization_id: str,
        job_types: list[str],
        ttl: float,
        holder: str | None,
        metadata: Mapping[str, Any] | None,
        wait: float,
        shared: Collection[str] = (),
        max_hold: float | None = None,
    ) -> Flow[SessionGrant]:
        body: dict[str, Any] = {
            "organization_id": organization_id,
            "holder": holder or default_holder(),
            "ttl_seconds": ttl,
            "locks": _session_locks(job_types, shared),
        }
        if metadata is not None:
            body["metadata"] = dict(metadata)
        if max_hold is not None:
            body["max_hold_seconds"] = max_hold
        return (yield from self._granted("/v1/sessions", body, ttl, wait, _session_grant))

    def _granted(
        self,
        path: str,
        body: dict[str, Any],
        ttl: float,
        wait: float,
        grant: Callable[[Any, float, float], Granted],
    ) -> Flow[Granted]:
        """An acquire's (or a session's) grant, asked again after each 409 until `wait` is over."""
        headers = {"Idempotency-Key": uuid.uuid4().hex}  # so that a retry never locks us out
        answer, started = yield from self._asked(path, body, headers, wait, max(ttl * 0.5, 1.0))
        return (yield from self._confirmed(grant(answer, ttl, started)))

    def _add_session_locks(
        self, session_id: int, token: str, job_types: list[str], wait: float, shared: Collection[str] = ()
    ) -> Flow[list[Lock]]:
        body: dict[str, Any] = {"locks": _session_locks(job_types, shared)}
        headers = {"Idempotency-Key": uuid.uuid4().hex, "Lock-Token": token}
        answer, _ = yield from self._asked(f"/v1/sessions/{session_id}/locks", body, headers, wait, 10.0)
        added: list[Lock] = answer["locks"]
        return added

    def _asked(
        self, path: str, body: dict[str, Any], headers: dict[str, str], wait: float, within: float
    ) -> Flow[tuple[Any, float]]:
        """A POST that grants (its body, and when the request that got it was sent), asked again
        after each 409 until `wait` is over, with the same Idempotency-Key."""
        give_up = time.monotonic() + wait
        rounds = 0
        while True:
            waiting = _wait_round(body, give_up)
            started = time.monotonic()
            try:
                response = yield from self._send(
                    "POST",
                    path,
                    json=body,
                    headers=headers,
                    within=within,
                    # Nothing listening is said at once: a worker's first contact, not a blip.
                    refused_within=REFUSED_WITHIN_SECONDS,
                    timeout=self.timeout + waiting if self.timeout else None,
                )
                return response.json(), started
            except LockHeld as held:
                left = give_up - time.monotonic()
                closed = isinstance(held, ClosedUntil)
                # Retry-After is whole seconds, rounded up: the key surely opens after the wait's
                # end only when it is a second more than what is left.
                if left <= 0 or (closed and held.retry_after - 1 >= left):
                    raise  # the wait is over, or will be before the key opens
                # The service waited as long as it would (a round ends at its 60 s): ask again
                # soon, but never in a tight loop against one that answers 409 at once (a service
                # without waiting, a proxy), and never past the wait. A key closed for longer
                # than a round is asked for again once its opening is within one.
                pause = min(backoff_seconds(rounds), held.retry_after)
                if closed:
                    pause = max(pause, held.retry_after - ROUND_SECONDS)
                yield _Pause(min(pause, left))
                rounds += 1

    def _renew(
        self, lock_id: int, token: str, ttl: float, within: float, kind: str = "locks"
    ) -> Flow[Renewed]:
        response = yield from self._send(
            "POST",
            f"/v1/{kind}/{lock_id}/renew",
            json={"ttl_seconds": ttl},
            headers={"Lock-Token": token},
            within=within,
            holding=True,
        )
        renewed: Renewed = response.json()
        return renewed

    def _update(
        self, lock_id: int, token: str, metadata: Mapping[str, Any] | None, within: float = 10.0
    ) -> Flow[Lock]:
        response = yield from self._send(
            "PATCH",
            f"/v1/locks/{lock_id}",
            json={"metadata": None if metadata is None else dict(metadata)},
            headers={"Lock-Token": token},
            within=within,
            holding=True,
        )
        updated: Lock = response.json()
        return updated

    def _lease_update(self, lease: Lease, metadata: Mapping[str, Any] | None) -> Flow[Lock]:
        """A held lease's update, retried while the lease lasts; a refusal loses the lease."""
        lease.check()  # a lease lost by our clock proclaims nothing
        grant = lease.grant
        try:
            return (yield from self._update(grant.id, grant.token, metadata, max(lease.remaining, 0.1)))
        except LockLost as exc:
            lease._lose(str(exc))
            raise

    def _release(self, lock_id: int, token: str, kind: str = "locks") -> Flow[None]:
        try:
            path, headers = f"/v1/{kind}/{lock_id}", {"Lock-Token": token}
            yield from self._send("DELETE", path, headers=headers, holding=True)
        except LockLost as lost:
            if not lost.released_by_its_token:
                raise

    def _request_revocation(
        self, lock_id: int, reason: str, deadline: float, preferred_holder: str | None
    ) -> Flow[Lock]:
        body: dict[str, Any] = {"reason": reason, "deadline_seconds": deadline}
        if preferred_holder is not None:
            body["preferred_holder"] = preferred_holder
        # A repeat leaves the first request as it was: safe to send again after an unknown outcome.
        path = f"/v1/locks/{lock_id}/revocation"
        response = yield from self._send("POST", path, json=body, idempotent=True)
        asked: Lock = response.json()
        return asked

    def _get(self, path: str, params: Mapping[str, Any] | None = None) -> Flow[Any]:
        """The JSON the service answers; the caller says which of results.py's types it is."""
        return (yield from self._send("GET", path, params=params)).json()

    def _current(self, organization_id: str, job_type: str, slot: int | None) -> Flow[Lock | None]:
        params: dict[str, Any] = {"organization_id": organization_id, "job_type": job_type}
        if slot is not None:
            params["slot"] = slot
        try:
            held: Lock = yield from self._get("/v1/locks/current", params)
            return held
        except ApiError as exc:
            if exc.status == 404 and not isinstance(exc, NotHelixLocks):  # none is held
                return None
            raise

    def _watch(
        self,
        organization_id: str | None,
        job_type: str | None,
        last_event_id: str | None,
        within: float | None,
    ) -> WatchFlow:
        """GET /v1/events for as long as the caller reads, opened again after every cut or end
        with Last-Event-ID, so that no event is missed or repeated. Unavailable once no stream
        could be opened for `within` seconds (a refused first connection at once); ApiError on
        any refusal but those of WATCH_RETRIED (401, 403, 410 events-expired, 422)."""
        query = {"organization_id": organization_id, "job_type": job_type}
        params = {name: value for name, value in query.items() if value is not None}
        timeout = httpx.Timeout(self.timeout, read=max(WATCH_READ_SECONDS, self.timeout or 0))
        limit = math.inf if within is None else within
        resume, retry = last_event_id, 0.0  # retry: the reconnection time the streams set
        attempt, heard, since = 0, False, time.monotonic()
        while True:
            headers = {"Accept": "text/event-stream", "Cache-Control": "no-cache"}
            if resume:  # an empty id (a stream's bare id:) means none, as EventSource has it
                headers["Last-Event-ID"] = resume
            outcome = yield _Open("/v1/events", {"params": params, "headers": headers, "timeout": timeout})
            response = outcome if isinstance(outcome, httpx.Response) else None
            error = outcome if isinstance(outcome, httpx.TransportError) else None
            if response is not None and response.status_code == 200:
                kind = response.headers.get("content-type", "")
                if not kind.startswith("text/event-stream"):
                    said = (
                        f"{self.base_url} does not look like a Helix Locks service: GET /v1/events"
                        f" answered {kind or 'no'} type, not text/event-stream"
                    )
                    raise NotHelixLocks(200, {"detail": said}, message=said)
                decoder = EventDecoder(resume)
                while isinstance(chunk := (yield _ReadChunk()), bytes):
                    # Anything heard, a keep-alive included, says the service is there again.
                    attempt, heard, since = 0, True, time.monotonic()
                    for sent in decoder.feed_chunk(chunk):
                        yield _Emit(_watch_event(sent))
                resume = decoder.last_event_id
                retry = retry if decoder.retry is None else decoder.retry
                error = chunk if isinstance(chunk, httpx.TransportError) else None
            elif response is not None and response.status_code not in WATCH_RETRIED:
                raise _api_error(response, self.base_url)
            pause = max(_backoff(attempt, response), retry)
            gave_up_at = since + (limit if heard or not _nothing_there(error) else REFUSED_WITHIN_SECONDS)
            if time.monotonic() + pause > gave_up_at:
                raise _gave_up(self.base_url, time.monotonic() - since, error) from error
            yield _Pause(pause)
            attempt += 1

    def _confirmed(self, grant: Granted) -> Flow[Granted]:
        """A lease counts from when its acquire was sent. After a wait longer than a renewal
        period that leaves too little, so renew once before the grant is handed over, and count
        from that renewal's send. A failure releases what it can and raises: no work starts on a
        lease that may be over."""
        if time.monotonic() - grant.sent_at < grant.ttl / 3:
            return grant
        started = time.monotonic()
        try:
            renewed = yield from self._renew(
                grant.id, grant.token, grant.ttl, max(grant.ttl / 3, 1.0), grant.kind
            )
        except LockLost:
            raise
        except HelixError:
            with contextlib.suppress(HelixError):
                yield from self._release(grant.id, grant.token, grant.kind)
            raise
        # The hold limit too, counted from this renewal's send: the wait is not taken from it.
        return replace(
            grant, sent_at=started, held_until=_later(grant.held_until, _held_until(renewed, started))
        )

    def _renewal(self, lease: Lease | SessionLease) -> Flow[bool]:
        """One renewal of a held lease; False once the lease is lost (it says why)."""
        started = lease._sent = time.monotonic()
        grant = lease.grant
        try:
            renewed = yield from self._renew(
                grant.id, grant.token, grant.ttl, max(lease.remaining, 0.1), grant.kind
            )
            lease._renewed(started, _held_until(renewed, started))
            lease._asked(renewed)
        except LockLost as exc:
            lease._lose(str(exc))
            return False
        except HelixError:
            if lease.lost:  # retried until the lease could lapse: it is lost
                lease._lose("renewals failed until the lease could lapse")
                return False
        return True


class LockClient(_Core):
    """A synchronous client. URL and key default to HELIX_LOCKS_URL and HELIX_LOCKS_API_KEY."""

    def __init__(
        self, base_url: str | None = None, api_key: str | None = None, timeout: float = 10.0
    ) -> None:
        super().__init__(base_url, api_key, timeout)
        self.http = httpx.Client(base_url=self.base_url, headers=self.headers, timeout=timeout)

    def close(self) -> None:
        """Close the client's connections (as leaving its `with` block does)."""
        self.http.close()

    def __enter__(self) -> LockClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, flow: Flow[T]) -> T:
        try:
            step = next(flow)
            while True:
                if isinstance(step, _Pause):
                    time.sleep(step.seconds)
                    step = flow.send(None)
                    continue
                outcome: _Outcome
                try:
                    outcome = self.http.request(step.method, step.path, **step.kwargs)
                except httpx.TransportError as exc:
                    outcome = exc
                step = flow.send(outcome)
        except StopIteration as done:
            result: T = done.value
            return result

    def acquire(
        self,
        organization_id: str,
        job_type: str,
        ttl: float = 30,
        holder: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        wait: float = 0,
        max_holders: int = 1,
        mode: str = "exclusive",
        max_hold: float | None = None,
        hold_at_least: float | None = None,
    ) -> Grant:
        """Acquire, or LockHeld. With `wait`, the service waits for a held lock for up to that
        many seconds (in rounds of at most 60) before answering. With `max_holders` N, up to N
        hold the key at once, each in a slot of its own (grant.slot); MaxHoldersMismatch, at
        once, when the held locks of the key share another value. `mode="shared"`: a reader,
        held beside the key's other readers (each with a lease of its own) and never beside an
        exclusive lock, which waits for every reader; a reader waits behind a waiting writer.
        With `max_hold` seconds, a hold limit: no lease of the lock runs past grant.hold_limit_at,
        however it is renewed. With `hold_at_least` seconds, the grant closes the key until
        grant.closed_until, whatever becomes of the lock: every acquire meanwhile gets ClosedUntil
        (a LockHeld), at once when its wait would end before then."""
        return self._run(
            self._acquire(
                organization_id,
                job_type,
                ttl,
                holder,
                metadata,
                wait,
                max_holders,
                mode,
                max_hold,
                hold_at_least,
            )
        )

    def renew(self, lock_id: int, token: str, ttl: float, within: float = 10.0) -> Renewed:
        """Extend a held lock's lease to `ttl` seconds from now, retrying for up to `within`
        seconds while the service is unreachable; LockLost if the lock is not ours any more.
        Renewed["lapsed"] says the lease had run out (unreclaimed) before this renewal."""
        return self._run(self._renew(lock_id, token, ttl, within))

    def update(self, lock_id: int, token: str, metadata: Mapping[str, Any] | None) -> Lock:
        """Replace a held lock's metadata (progress, an address); LockLost if it is not ours."""
        return self._run(self._update(lock_id, token, metadata))

    def release(self, lock_id: int, token: str) -> None:
        """Release; LockLost if the lock had already ended otherwise (it was not ours any more).

        A retry after an answer that never came (or a 503) may find the lock released by the
        first attempt: that is this release's own success, not a loss."""
        self._run(self._release(lock_id, token))

    def open_session(
        self,
        organization_id: str,
        job_types: list[str],
        ttl: float = 30,
        holder: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        wait: float = 0,
        shared: Collection[str] = (),
        max_hold: float | None = None,
    ) -> SessionGrant:
        """Open a session holding the locks of `job_types`, all granted at once or none
        (LockHeld names the first that is held, as its `problem["job_type"]`); with `wait`, wait
        until all are free. The grant's id and token are the session's; renew it with
        renew_session, end it with end_session. The job types named in `shared` are taken as
        shared locks (readers), the others as exclusive ones."""
        return self._run(
            self._open_session(organization_id, job_types, ttl, holder, metadata, wait, shared, max_hold)
        )

    def add_session_locks(
        self,
        session: SessionGrant | SessionLease,
        job_types: list[str],
        wait: float = 0,
        shared: Collection[str] = (),
    ) -> list[Lock]:
        """Add the locks of `job_types` to a held session, all at once or none (LockHeld names the
        first held, as open_session's does), waiting up to `wait` for all to be free; they share
        its lease. A SessionLease lists them in `locks` and `fencing_tokens` from then on. A retry
        after a lost answer gets the same locks (one Idempotency-Key for every attempt)."""
        grant = session.grant if isinstance(session, SessionLease) else session
        added = self._run(self._add_session_locks(grant.id, grant.token, job_types, wait, shared))
        if isinstance(session, SessionLease):
            session._added(added)
        return added

    def renew_session(self, session_id: int, token: str, ttl: float, within: float = 10.0) -> Renewed:
        """A new lease for the session and all its locks; LockLost once it ended or lost a lock."""
        return self._run(self._renew(session_id, token, ttl, within, "sessions"))

    def end_session(self, session_id: int, token: str) -> None:
        """Release every lock of the session and end it; LockLost if it had lost a lock."""
        self._run(self._release(session_id, token, "sessions"))

    @contextlib.contextmanager
    def session(
        self,
        organization_id: str,
        job_types: list[str],
        ttl: float = 30,
        holder: str | None = None,
        wait: float = 0,
        metadata: Mapping[str, Any] | None = None,
        shared: Collection[str] = (),
        max_hold: float | None = None,
        on_revocation: OnRevocation = None,
    ) -> Iterator[SessionLease]:
        """Hold all the locks of `job_types` for the block, in one session: renewed every ttl/3
        in a thread with one request for all of them, ended at the end. Its loss (a refused
        renewal, or renewals failing until it could lapse) shows as the lease's. A request that the
        holder of any of its locks let go shows as in lock()."""
        grant = self.open_session(organization_id, job_types, ttl, holder, metadata, wait, shared, max_hold)
        lease = SessionLease(grant, on_revocation)
        stop = threading.Event()
        renewer = threading.Thread(
            target=self.keep_alive, args=(lease, stop), daemon=True, name="helix-renew"
        )
        renewer.start()
        try:
            yield lease
        finally:
            stop.set()
            renewer.join()
            if not lease.lost:
                with contextlib.suppress(HelixError):
                    self.end_session(grant.id, grant.token)

    def request_revocation(
        self, lock_id: int, reason: str, deadline: float = 60, preferred_holder: str | None = None
    ) -> Lock:
        """Ask the holder of a live lock to let go by `deadline` seconds from now, saying why; the
        lock with the request (the first one made: a repeat changes nothing). Nothing is forced.
        With `preferred_holder`, the key is reserved for that holder, once released, until the
        deadline. LockLost if the lock has ended; ApiError 404 if the key may see no such lock."""
        return self._run(self._request_revocation(lock_id, reason, deadline, preferred_holder))

    def get(self, lock_id: int) -> Lock:
        """The lock with this id, live or ended (never its token); ApiError 404 if there is none
        the key may see."""
        found: Lock = self._run(self._get(f"/v1/locks/{lock_id}"))
        return found

    def list(
        self,
        organization_id: str | None = None,
        job_type: str | None = None,
        state: LockState | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> Page:
        """One page of locks, newest first: live ones (state None, "held" or "expired") or the
        history ("released", "reclaimed"). Pass the page's next_cursor as `cursor` for the next."""
        found: Page = self._run(
            self._get(
                "/v1/locks",
                _given(
                    organization_id=organization_id,
                    job_type=job_type,
                    state=state,
                    limit=limit,
                    cursor=cursor,
                ),
            )
        )
        return found

    def current(self, organization_id: str, job_type: str, slot: int | None = None) -> Lock | None:
        """The lock held now for the key, or None: the one with the highest fencing token, or
        with `slot`, the one in that slot of a semaphore."""
        return self._run(self._current(organization_id, job_type, slot))

    def queue(
        self, organization_id: str, job_type: str, limit: int | None = None, cursor: str | None = None
    ) -> QueuePage:
        """One page of the key's queue: the acquires waiting for it, in the order they will be
        granted. Pass the page's next_cursor as `cursor` for the next."""
        found: QueuePage = self._run(
            self._get(
                "/v1/locks/queue",
                _given(organization_id=organization_id, job_type=job_type, limit=limit, cursor=cursor),
            )
        )
        return found

    def watch(
        self,
        organization_id: str | None = None,
        job_type: str | None = None,
        last_event_id: str | None = None,
        within: float | None = 60.0,
    ) -> Generator[LockEvent, None, None]:
        """The events of GET /v1/events as they come, each its data with its `id` added; resumed
        after a cut or an end from the last event handed out. Unavailable when no stream could
        be opened for `within` seconds (None: never give up); ApiError on a refusal."""
        flow = self._watch(organization_id, job_type, last_event_id, within)
        with contextlib.ExitStack() as stream:
            chunks: Iterator[bytes] | None = None
            sent: _Outcome | bytes = None
            while True:
                step = flow.send(sent)
                sent = None
                if isinstance(step, _Emit):
                    yield step.event
                elif isinstance(step, _Pause):
                    time.sleep(step.seconds)
                elif isinstance(step, _Open):
                    stream.close()
                    try:
                        response = stream.enter_context(self.http.stream("GET", step.path, **step.kwargs))
                        if response.status_code != 200:
                            response.read()
                        chunks, sent = response.iter_bytes(), response
                    except httpx.TransportError as exc:
                        sent = exc
                else:
                    assert chunks is not None  # a piece is asked for only from an open stream
                    try:
                        sent = next(chunks)
                    except StopIteration:
                        sent = None
                    except httpx.TransportError as exc:
                        sent = exc
                    if not isinstance(sent, bytes):
                        stream.close()

    @contextlib.contextmanager
    def lock(
        self,
        organization_id: str,
        job_type: str,
        ttl: float = 30,
        holder: str | None = None,
        wait: float = 0,
        metadata: Mapping[str, Any] | None = None,
        max_holders: int = 1,
        mode: str = "exclusive",
        max_hold: float | None = None,
        hold_at_least: float | None = None,
        on_revocation: OnRevocation = None,
    ) -> Iterator[SyncLease]:
        """Hold the lock for the block: renewed every ttl/3 in a thread, released at the end.
        With `max_holders` N, a semaphore: up to N blocks hold the key at once (lease.slot).
        `mode="shared"`: a reader, held beside other readers, never beside an exclusive lock.
        With `max_hold` seconds, the lease counts as lost before its hold limit, as before its end.
        With `hold_at_least` seconds, the key stays closed until grant.closed_until after the block.
        Someone asking the holder to let go sets lease.revocation_requested (and lease.revocation),
        learnt from a renewal's answer, and calls `on_revocation` with it in the renewing thread:
        finish cleanly and leave the block."""
        grant = self.acquire(
            organization_id, job_type, ttl, holder, metadata, wait, max_holders, mode, max_hold, hold_at_least
        )
        lease = SyncLease(grant, self, on_revocation)
        stop = threading.Event()
        renewer = threading.Thread(
            target=self.keep_alive, args=(lease, stop), daemon=True, name="helix-renew"
        )
        renewer.start()
        try:
            yield lease
        finally:
            stop.set()
            renewer.join()
            if not lease.lost:
                with contextlib.suppress(HelixError):
                    self.release(grant.id, grant.token)

    def keep_alive(self, lease: Lease | SessionLease, stop: threading.Event) -> None:
        """Renew every ttl/3 until `stop` is set or the lease is lost (it says which)."""
        while not stop.wait(lease._until_renewal()):
            if not self._run(self._renewal(lease)):
                return


class AsyncLockClient(_Core):
    """LockClient for asyncio: the same flows, driven with httpx.AsyncClient."""

    def __init__(
        self, base_url: str | None = None, api_key: str | None = None, timeout: float = 10.0
    ) -> None:
        super().__init__(base_url, api_key, timeout)
        self.http = httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=timeout)

    async def aclose(self) -> None:
        """Close the client's connections (as leaving its `async with` block does)."""
        await self.http.aclose()

    async def __aenter__(self) -> AsyncLockClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _run(self, flow: Flow[T]) -> T:
        try:
            step = next(flow)
            while True:
                if isinstance(step, _Pause):
                    await asyncio.sleep(step.seconds)
                    step = flow.send(None)
                    continue
                outcome: _Outcome
                try:
                    outcome = await self.http.request(step.method, step.path, **step.kwargs)
                except httpx.TransportError as exc:
                    outcome = exc
                step = flow.send(outcome)
        except StopIteration as done:
            result: T = done.value
            return result

    async def acquire(
        self,
        organization_id: str,
        job_type: str,
        ttl: float = 30,
        holder: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        wait: float = 0,
        max_holders: int = 1,
        mode: str = "exclusive",
        max_hold: float | None = None,
        hold_at_least: float | None = None,
    ) -> Grant:
        """As LockClient.acquire."""
        return await self._run(
            self._acquire(
                organization_id,
                job_type,
                ttl,
                holder,
                metadata,
                wait,
                max_holders,
                mode,
                max_hold,
                hold_at_least,
            )
        )

    async def renew(self, lock_id: int, token: str, ttl: float, within: float = 10.0) -> Renewed:
        """As LockClient.renew."""
        return await self._run(self._renew(lock_id, token, ttl, within))

    async def update(self, lock_id: int, token: str, metadata: Mapping[str, Any] | None) -> Lock:
        """Replace a held lock's metadata (progress, an address); LockLost if it is not ours."""
        return await self._run(self._update(lock_id, token, metadata))

    async def release(self, lock_id: int, token: str) -> None:
        """As LockClient.release."""
        await self._run(self._release(lock_id, token))

    async def open_session(
        self,
        organization_id: str,
        job_types: list[str],
        ttl: float = 30,
        holder: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        wait: float = 0,
        shared: Collection[str] = (),
        max_hold: float | None = None,
    ) -> SessionGrant:
        """As LockClient.open_session."""
        return await self._run(
            self._open_session(organization_id, job_types, ttl, holder, metadata, wait, shared, max_hold)
        )

    async def add_session_locks(
        self,
        session: SessionGrant | SessionLease,
        job_types: list[str],
        wait: float = 0,
        shared: Collection[str] = (),
    ) -> list[Lock]:
        """As LockClient.add_session_locks."""
        grant = session.grant if isinstance(session, SessionLease) else session
        added = await self._run(self._add_session_locks(grant.id, grant.token, job_types, wait, shared))
        if isinstance(session, SessionLease):
            session._added(added)
        return added

    async def renew_session(self, session_id: int, token: str, ttl: float, within: float = 10.0) -> Renewed:
        """As LockClient.renew_session."""
        return await self._run(self._renew(session_id, token, ttl, within, "sessions"))

    async def end_session(self, session_id: int, token: str) -> None:
        """As LockClient.end_session."""
        await self._run(self._release(session_id, token, "sessions"))

    @contextlib.asynccontextmanager
    async def session(
        self,
        organization_id: str,
        job_types: list[str],
        ttl: float = 30,
        holder: str | None = None,
        wait: float = 0,
        metadata: Mapping[str, Any] | None = None,
        shared: Collection[str] = (),
        max_hold: float | None = None,
        on_revocation: OnRevocation = None,
    ) -> AsyncIterator[SessionLease]:
        """As LockClient.session, renewed by a task."""
        grant = await self.open_session(
            organization_id, job_types, ttl, holder, metadata, wait, shared, max_hold
        )
        lease = SessionLease(grant, on_revocation)
        renewer = asyncio.create_task(self.keep_alive(lease), name="helix-renew")
        try:
            yield lease
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
            if not lease.lost:
                with contextlib.suppress(HelixError):
                    await self.end_session(grant.id, grant.token)

    async def request_revocation(
        self, lock_id: int, reason: str, deadline: float = 60, preferred_holder: str | None = None
    ) -> Lock:
        """As LockClient.request_revocation."""
        return await self._run(self._request_revocation(lock_id, reason, deadline, preferred_holder))

    async def get(self, lock_id: int) -> Lock:
        """As LockClient.get."""
        found: Lock = await self._run(self._get(f"/v1/locks/{lock_id}"))
        return found

    async def list(
        self,
        organization_id: str | None = None,
        job_type: str | None = None,
        state: LockState | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> Page:
        """As LockClient.list."""
        found: Page = await self._run(
            self._get(
                "/v1/locks",
                _given(
                    organization_id=organization_id,
                    job_type=job_type,
                    state=state,
                    limit=limit,
                    cursor=cursor,
                ),
            )
        )
        return found

    async def current(self, organization_id: str, job_type: str, slot: int | None = None) -> Lock | None:
        """As LockClient.current."""
        return await self._run(self._current(organization_id, job_type, slot))

    async def queue(
        self, organization_id: str, job_type: str, limit: int | None = None, cursor: str | None = None
    ) -> QueuePage:
        """As LockClient.queue."""
        found: QueuePage = await self._run(
            self._get(
                "/v1/locks/queue",
                _given(organization_id=organization_id, job_type=job_type, limit=limit, cursor=cursor),
            )
        )
        return found

    async def watch(
        self,
        organization_id: str | None = None,
        job_type: str | None = None,
        last_event_id: str | None = None,
        within: float | None = 60.0,
    ) -> AsyncGenerator[LockEvent, None]:
        """As LockClient.watch. Leaving the loop early closes the stream when the generator is
        finalized; `contextlib.aclosing(client.watch(...))` closes it at once."""
        flow = self._watch(organization_id, job_type, last_event_id, within)
        async with contextlib.AsyncExitStack() as stream:
            chunks: AsyncIterator[bytes] | None = None
            sent: _Outcome | bytes = None
            while True:
                step = flow.send(sent)
                sent = None
                if isinstance(step, _Emit):
                    yield step.event
                elif isinstance(step, _Pause):
                    await asyncio.sleep(step.seconds)
                elif isinstance(step, _Open):
                    await stream.aclose()
                    try:
                        response = await stream.enter_async_context(
                            self.http.stream("GET", step.path, **step.kwargs)
                        )
                        if response.status_code != 200:
                            await response.aread()
                        chunks, sent = response.aiter_bytes(), response
                    except httpx.TransportError as exc:
                        sent = exc
                else:
                    assert chunks is not None  # a piece is asked for only from an open stream
                    try:
                        sent = await anext(chunks)
                    except StopAsyncIteration:
                        sent = None
                    except httpx.TransportError as exc:
                        sent = exc
                    if not isinstance(sent, bytes):
                        await stream.aclose()

    @contextlib.asynccontextmanager
    async def lock(
        self,
        organization_id: str,
        job_type: str,
        ttl: float = 30,
        holder: str | None = None,
        wait: float = 0,
        metadata: Mapping[str, Any] | None = None,
        max_holders: int = 1,
        mode: str = "exclusive",
        max_hold: float | None = None,
        hold_at_least: float | None = None,
        on_revocation: OnRevocation = None,
    ) -> AsyncIterator[AsyncLease]:
        """As LockClient.lock, renewed by a task."""
        grant = await self.acquire(
            organization_id, job_type, ttl, holder, metadata, wait, max_holders, mode, max_hold, hold_at_least
        )
        lease = AsyncLease(grant, self, on_revocation)
        renewer = asyncio.create_task(self.keep_alive(lease), name="helix-renew")
        try:
            yield lease
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
            if not lease.lost:
                with contextlib.suppress(HelixError):
                    await self.release(grant.id, grant.token)

    async def keep_alive(self, lease: Lease | SessionLease) -> None:
        """Renew every ttl/3 until cancelled or the lease is lost (it says which)."""
        while True:
            await asyncio.sleep(lease._until_renewal())
            if not await self._run(self._renewal(lease)):
                return
