"""Every problem type, declared once: from a domain error to its RFC 9457 answer, and what the
OpenAPI document says of it.

An error's kind is found along its class hierarchy (EmptyResult answers as InternalError). Each
answer records its kind in the request's outcome when it is sent, wherever it was built (an
error handler, a middleware), so that the log line and the metrics read it from there.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from helix_locks.server.errors import (
    HOLDERS_LISTED,
    BodyTooLarge,
    ClosedUntil,
    DatabaseUnavailable,
    EventsExpired,
    Forbidden,
    Holder,
    HoldLimitReached,
    InternalError,
    InvalidRequest,
    LockEnded,
    LockError,
    LockHeld,
    LockNotFound,
    MaxHoldersMismatch,
    OrganizationWaitersFull,
    OrganizationWatchersFull,
    QuotaExceeded,
    RenewTheSession,
    Reserved,
    SchemaNotReady,
    SessionEnded,
    SessionFull,
    SessionLapsed,
    SessionNotFound,
    ShuttingDown,
    TokenMismatch,
    TooManySessions,
    TooManyWaiters,
    TooManyWatchers,
    Unauthenticated,
    UnsupportedMediaType,
    WaitersAhead,
    WaitInterrupted,
)
from helix_locks.server.outcome import outcome
from helix_locks.server.schemas import Problem

MEDIA_TYPE = "application/problem+json"
URN = "urn:helix-locks:problem:"
# Seconds a client should wait before trying again while the database is unreachable.
UNAVAILABLE_RETRY_AFTER = 2
# The headers a problem may carry, as the OpenAPI document describes them.
HEADERS = {
    "Retry-After": ("Whole seconds to wait before trying again.", "integer"),
    "WWW-Authenticate": ("Bearer: send an API key.", "string"),
}
_SOON = {"Retry-After": "1"}
_EXPIRES, _ENDED = (
    datetime(2026, 11, 30, 2, 44, 52, 375915, UTC),
    datetime(2026, 11, 30, 2, 45, 3, 512204, UTC),
)


class ProblemResponse(JSONResponse):
    """A problem+json answer, which records its kind in the request's outcome as it is sent."""

    media_type = MEDIA_TYPE

    def __init__(self, kind: str, body: dict[str, Any], headers: Mapping[str, str]) -> None:
        super().__init__(body, status_code=body["status"], headers=dict(headers))
        self.kind = kind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome(scope).problem = self.kind
        await super().__call__(scope, receive, send)


def problem(
    status: int, kind: str, title: str, detail: str, headers: Mapping[str, str] | None = None, **fields: Any
) -> ProblemResponse:
    """A problem answer; `kind` names its type (urn:helix-locks:problem:KIND). Only for the HTTP
    errors of the framework (http-<status>): every other kind is declared in KINDS."""
    body = {"type": f"{URN}{kind}", "title": title, "status": status, "detail": detail}
    body.update({name: _json(value) for name, value in fields.items()})
    return ProblemResponse(kind, body, headers or {})


def rfc3339(value: datetime) -> str:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _json(value: Any) -> Any:
    return rfc3339(value) if isinstance(value, datetime) else value


@dataclass(frozen=True)
class Kind:
    """One problem type: its answer to an error, and its entry in the OpenAPI document."""

    status: int
    name: str  # urn:helix-locks:problem:NAME
    title: str
    when: str  # when it is answered, for the OpenAPI document
    example: LockError  # answered as the document's example
    detail: str | Callable[[Any], str]
    # Constant headers, or a function of the error when their values vary.
    headers: Mapping[str, str] | Callable[[Any], Mapping[str, str]] = field(default_factory=dict)
    fields: Callable[[Any], Mapping[str, Any]] = lambda exc: {}

    def answer(self, exc: LockError) -> ProblemResponse:
        detail = self.detail(exc) if callable(self.detail) else self.detail
        headers = self.headers(exc) if callable(self.headers) else self.headers
        return problem(self.status, self.name, self.title, detail, headers, **self.fields(exc))


def _ended(exc: LockEnded) -> str:
    how = {
        "released": "was released",
        "reclaimed": "expired and was reclaimed by another worker",
        "forced": "was broken by an administrator",
    }.get(exc.release_reason, "ended")
    return f"The lock {how}; its holder no longer owns it."


def _pair(job_type: str | None) -> dict[str, str]:
    """A session's refusal names the pair that could not be granted; an acquire's does not."""
    return {} if job_type is None else {"job_type": job_type}


KINDS: Mapping[type[LockError], Kind] = {
    InvalidRequest: Kind(
        422,
        "invalid-request",
        "Invalid request",
        "A parameter, header or body field is invalid, a query parameter or body field is unknown, or"
        " the body is not JSON; errors names each.",
        InvalidRequest([{"field": "ttl_seconds", "message": "Input should be less than or equal to 86400"}]),
        lambda exc: f"Invalid: {', '.join(error['field'] for error in exc.errors)}.",
        fields=lambda exc: {"errors": exc.errors},
    ),
    Unauthenticated: Kind(
        401,
        "unauthenticated",
        "Unauthenticated",
        "The API key is missing, unknown or revoked.",
        Unauthenticated("The API key is unknown or revoked."),
        lambda exc: exc.reason,
        headers={"WWW-Authenticate": "Bearer"},
    ),
    Forbidden: Kind(
        403,
        "forbidden",
        "Forbidden",
        "The API key may not do this: another organization, force or the metrics without an admin key;"
        " or, with no API keys at all, a request a web page could have sent (a Host or Origin that is"
        " not a loopback name).",
        Forbidden("This API key acts only in organization acme."),
        lambda exc: exc.reason,
    ),
    TokenMismatch: Kind(
        403,
        "token-mismatch",
        "Token mismatch",
        "The Lock-Token does not match this lock (or session), whatever its state.",
        TokenMismatch(),
        "The Lock-Token does not match.",
    ),
    LockNotFound: Kind(
        404,
        "lock-not-found",
        "Lock not found",
        "No such lock for this caller.",
        LockNotFound(),
        "No such lock.",
    ),
    LockHeld: Kind(
        409,
        "lock-held",
        "Lock held",
        "Live locks hold every slot of this organization and job type (one slot, unless max_holders is"
        " more); lock_id, holder and expires_at name the one whose lease runs out first, holders lists"
        f" at most {HOLDERS_LISTED} of them, those whose leases run out first, and holders_total counts"
        " them all; mode is theirs (exclusive, or shared: readers, which an exclusive acquire waits"
        " for). Retry-After: whole seconds until the first lease runs out.",
        LockHeld(
            1,
            "worker-7@host-3",
            _EXPIRES,
            30,
            [Holder(1, "worker-7@host-3", 0, _EXPIRES)],
            1,
            1,
            mode="exclusive",
        ),
        lambda exc: (
            f"{exc.holders_total} shared lock(s) hold this organization and job type."
            if exc.mode == "shared"
            else "A live lock holds this organization and job type."
            if exc.max_holders == 1
            else f"Live locks hold all {exc.max_holders} slots of this organization and job type."
        ),
        headers=lambda exc: {"Retry-After": str(exc.retry_after_seconds)},
        fields=lambda exc: {
            "lock_id": exc.lock_id,
            "holder": exc.holder,
            "expires_at": exc.expires_at,
            "max_holders": exc.max_holders,
            "holders": [
                {
                    "lock_id": h.lock_id,
                    "holder": h.holder,
                    "slot": h.slot,
                    "expires_at": rfc3339(h.expires_at),
                }
                for h in exc.holders
            ],
            "holders_total": exc.holders_total,
            **({"mode": exc.mode} if exc.mode else {}),
            **_pair(exc.job_type),
        },
    ),
    WaitersAhead: Kind(
        409,
        "waiters-ahead",
        "Waiters ahead",
        "Acquires waiting in this organization and job type's queue come first (first come, first"
        " served): an acquire that does not wait does not pass them. waiting counts them; while the"
        " key is held, lock_id, holder and expires_at name the lease that ends first, which"
        " Retry-After counts down to (else 1), and mode the held locks' mode. Try again then, or wait"
        " (wait_seconds) to take a place.",
        WaitersAhead(None, None, None, 1, waiting=3, ahead=3),
        lambda exc: f"{exc.waiting} acquires wait for this organization and job type, and come first.",
        headers=lambda exc: {"Retry-After": str(exc.retry_after_seconds)},
        fields=lambda exc: {
            "waiting": exc.waiting,
            **(
                {}
                if exc.lock_id is None
                else {
                    "lock_id": exc.lock_id,
                    "holder": exc.holder,
                    "expires_at": exc.expires_at,
                    **({"mode": exc.mode} if exc.mode else {}),
                }
            ),
            **_pair(exc.job_type),
        },
    ),
    ClosedUntil: Kind(
        409,
        "closed-until",
        "Closed until",
        "A grant with hold_at_least_seconds closed this organization and job type: no lock of it is"
        " granted before closed_until, whatever became of that grant (released early included)."
        " Retry-After: whole seconds until then. A waiting acquire waits for it, or is told this at"
        " once when its wait would end first.",
        ClosedUntil(None, None, None, 30, closed_until=_EXPIRES, closed_ms=30000),
        lambda exc: f"This organization and job type is closed until {rfc3339(exc.closed_until)}.",
        headers=lambda exc: {"Retry-After": str(exc.retry_after_seconds)},
        fields=lambda exc: {"closed_until": exc.closed_until, **_pair(exc.job_type)},
    ),
    Reserved: Kind(
        409,
        "reserved",
        "Reserved",
        "A request that the holder let go named a preferred holder: the organization and job type is"
        " granted to it alone until deadline, which Retry-After counts down to; queued waiters keep"
        " their places. The body names preferred_holder.",
        Reserved(
            None, None, None, 30, preferred_holder="worker-9@host-1", deadline=_EXPIRES, reserved_ms=30000
        ),
        lambda exc: f"Reserved for {exc.preferred_holder} until {rfc3339(exc.deadline)}.",
        headers=lambda exc: {"Retry-After": str(exc.retry_after_seconds)},
        fields=lambda exc: {
            "preferred_holder": exc.preferred_holder,
            "deadline": exc.deadline,
            **_pair(exc.job_type),
        },
    ),
    MaxHoldersMismatch: Kind(
        409,
        "max-holders-mismatch",
        "max_holders mismatch",
        "The held locks of this organization and job type share another max_holders, given as"
        " max_holders: acquire with that value, or wait until none is held.",
        MaxHoldersMismatch(3),
        lambda exc: (
            f"The locks held for this organization and job type allow {exc.max_holders} holders at once;"
            " acquire with that max_holders, or once none is held."
        ),
        fields=lambda exc: {"max_holders": exc.max_holders, **_pair(exc.job_type)},
    ),
    LockEnded: Kind(
        410,
        "lock-ended",
        "Lock ended",
        "The lock had already ended (released, reclaimed or forced): its holder no longer owns it.",
        LockEnded(1, "reclaimed", _ENDED),
        _ended,
        fields=lambda exc: {
            "lock_id": exc.lock_id,
            "release_reason": exc.release_reason,
            "released_at": exc.released_at,
            "forced_by": exc.forced_by,
        },
    ),
    HoldLimitReached: Kind(
        410,
        "hold-limit-reached",
        "Hold limit reached",
        "The hold limit (max_hold_seconds) of the lock, or of the session, has come: its lease ended"
        " then, and it is renewed no more. The next acquire of each key reclaims its lock.",
        HoldLimitReached(_EXPIRES),
        lambda exc: f"The hold limit came at {exc.hold_limit_at.isoformat()}.",
        fields=lambda exc: {"hold_limit_at": exc.hold_limit_at},
    ),
    SessionNotFound: Kind(
        404,
        "session-not-found",
        "Session not found",
        "No such session for this caller.",
        SessionNotFound(),
        "No such session.",
    ),
    RenewTheSession: Kind(
        409,
        "renew-the-session",
        "Renew the session",
        "The lock belongs to a session, whose locks share its lease: renew the session"
        " (POST /v1/sessions/{session_id}/renew), not the lock.",
        RenewTheSession(1),
        lambda exc: f"This lock shares the lease of session {exc.session_id}: renew the session.",
        fields=lambda exc: {"session_id": exc.session_id},
    ),
    SessionLapsed: Kind(
        409,
        "session-lapsed",
        "Session lapsed",
        "The session's lease has run out: renew it before adding locks to it.",
        SessionLapsed(_EXPIRES),
        "The session's lease has run out; renew it first.",
        fields=lambda exc: {"expires_at": exc.expires_at},
    ),
    SessionFull: Kind(
        409,
        "session-full",
        "Session full",
        "The session would hold more locks than one may hold (HELIX_LOCKS_MAX_LOCKS_PER_SESSION).",
        SessionFull(1000),
        lambda exc: f"A session may hold at most {exc.limit} locks.",
        fields=lambda exc: {"max_locks": exc.limit},
    ),
    SessionEnded: Kind(
        410,
        "session-ended",
        "Session ended",
        "The session had ended: its holder ended it, or it lost a lock (reclaimed after its lease ran"
        " out, or forced) and the rest of its locks were released. Its holder no longer owns any of them.",
        SessionEnded(1, "lost", _ENDED),
        lambda exc: (
            "The session lost a lock, and its other locks were released; its holder owns none of them."
            if exc.end_reason == "lost"
            else "The session had ended."
        ),
        fields=lambda exc: {
            "session_id": exc.session_id,
            "end_reason": exc.end_reason,
            "ended_at": exc.ended_at,
        },
    ),
    TooManySessions: Kind(
        429,
        "too-many-sessions",
        "Too many sessions",
        "This organization already has as many open sessions (not ended, lease not run out) as one may"
        " have (HELIX_LOCKS_MAX_SESSIONS_PER_ORGANIZATION).",
        TooManySessions(1000),
        lambda exc: f"This organization already has {exc.limit} open sessions; end some first.",
        headers=_SOON,
    ),
    BodyTooLarge: Kind(
        413,
        "body-too-large",
        "Request body too large",
        "The request body is over 64 KiB.",
        BodyTooLarge(65536),
        lambda exc: f"A request body may be at most {exc.max_bytes} bytes.",
    ),
    UnsupportedMediaType: Kind(
        415,
        "unsupported-media-type",
        "Unsupported media type",
        "The body is not declared as JSON: send Content-Type: application/json.",
        UnsupportedMediaType(),
        "Send the body as JSON with Content-Type: application/json.",
    ),
    OrganizationWaitersFull: Kind(
        429,
        "too-many-waiters-in-organization",
        "Too many waiters in this organization",
        "wait_seconds: this organization already has as many acquires waiting in this service process as"
        " one may have (HELIX_LOCKS_MAX_WAITERS_PER_ORGANIZATION); try again after Retry-After.",
        OrganizationWaitersFull(1000),
        lambda exc: (
            f"This organization already has {exc.limit} acquires waiting in this service process; try again."
        ),
        headers=_SOON,
    ),
    OrganizationWatchersFull: Kind(
        429,
        "too-many-watchers-in-organization",
        "Too many watchers in this organization",
        "This organization already has as many event streams open in this service process as one may"
        " have (HELIX_LOCKS_MAX_WATCHERS_PER_ORGANIZATION), or its streams there hold as many bytes of"
        " events as its share (HELIX_LOCKS_EVENTS_ORGANIZATION_BYTES, by default"
        " HELIX_LOCKS_EVENTS_MEMORY_BYTES divided among the organizations streaming); try again after"
        " Retry-After.",
        OrganizationWatchersFull(100),
        lambda exc: (
            f"This organization already has {exc.limit} {exc.what} in this service process; try again."
        ),
        headers=_SOON,
    ),
    EventsExpired: Kind(
        410,
        "events-expired",
        "Events expired",
        "Last-Event-ID names a point the stream can no longer replay from: older than what the"
        " database keeps (HELIX_LOCKS_RETENTION_DAYS), or followed by more events than one replay"
        " sends (HELIX_LOCKS_EVENTS_REPLAY_LIMIT). Read the current state (GET /v1/locks) and watch"
        " again without it.",
        EventsExpired("older than what the database keeps"),
        lambda exc: (
            f"The stream cannot resume from that event: {exc.reason}. Watch again without Last-Event-ID."
        ),
    ),
    QuotaExceeded: Kind(
        429,
        "quota-exceeded",
        "Live-lock quota exceeded",
        "This organization already has as many live locks (held, or lapsed and not yet reclaimed) as"
        " one may have (HELIX_LOCKS_MAX_LIVE_LOCKS_PER_ORGANIZATION); an acquire of a key that has a live"
        " lock still goes on.",
        QuotaExceeded(10_000),
        lambda exc: (
            f"This organization already has about {exc.limit} live locks, as many as one may have:"
            " release some, or let them expire and be reclaimed."
        ),
        headers=_SOON,
    ),
    InternalError: Kind(
        500,
        "internal-error",
        "Internal error",
        "Any other error, such as a failure of the service.",
        InternalError(),
        "The service failed; the error is logged.",
    ),
    DatabaseUnavailable: Kind(
        503,
        "database-unavailable",
        "Database unavailable",
        "The database cannot be reached; try again after Retry-After.",
        DatabaseUnavailable("connection refused"),
        "The lock database cannot be reached right now; try again.",
        headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER)},
    ),
    TooManyWaiters: Kind(
        503,
        "too-many-waiters",
        "Too many waiters",
        "wait_seconds: this service process already has as many acquires waiting as it allows"
        " (HELIX_LOCKS_MAX_WAITERS); try again after Retry-After.",
        TooManyWaiters(10_000),
        lambda exc: f"This service process already has {exc.limit} acquires waiting; try again.",
        headers=_SOON,
    ),
    TooManyWatchers: Kind(
        503,
        "too-many-watchers",
        "Too many watchers",
        "This service process already streams events to as many watchers as it allows"
        " (HELIX_LOCKS_MAX_WATCHERS), or reads as many resumes (Last-Event-ID) at once; try again"
        " after Retry-After, perhaps on another replica.",
        TooManyWatchers(10_000),
        lambda exc: f"This service process already has {exc.limit} {exc.what}; try again.",
        headers=_SOON,
    ),
    WaitInterrupted: Kind(
        503,
        "wait-interrupted",
        "Wait interrupted",
        "wait_seconds: the wait ended without a grant because the service is stopping.",
        WaitInterrupted("the service is stopping"),
        lambda exc: f"The wait ended early: {exc.reason}.",
        headers=_SOON,
    ),
    SchemaNotReady: Kind(
        503,
        "not-migrated",
        "Not ready",
        "The database schema lacks this build's migrations.",
        SchemaNotReady("migrations not applied: 0004_api_keys"),
        lambda exc: f"The database schema is not ready: {exc.reason}.",
        headers={"Retry-After": "5"},
    ),
    ShuttingDown: Kind(
        503,
        "service-stopping",
        "Service stopping",
        "The service was told to stop, and this request did not finish within the grace time.",
        ShuttingDown(),
        "The service stopped before this request finished, so its outcome is unknown: try again "
        "(an acquire with the same Idempotency-Key).",
        headers=_SOON,
    ),
}


def kind_of(error: type[LockError]) -> Kind:
    """The kind an error answers as: its own class's, or the nearest ancestor's."""
    for cls in error.__mro__:
        if cls in KINDS:
            return KINDS[cls]
    raise LookupError(f"no problem kind for {error.__name__}")


def from_error(exc: LockError) -> ProblemResponse:
    return kind_of(type(exc)).answer(exc)


def internal() -> ProblemResponse:
    return from_error(InternalError())


def responses(*errors: type[LockError]) -> dict[int | str, dict[str, Any]]:
    """A route's problem responses for the OpenAPI document, with an example of each kind; any
    route may also answer invalid-request (a query parameter it does not declare), body-too-large
    (before it is routed) and service-stopping, and `default` stands for internal-error."""
    found: dict[int | str, dict[str, Any]] = {}
    for error in dict.fromkeys((*errors, InvalidRequest, BodyTooLarge, ShuttingDown, InternalError)):
        kind = kind_of(error)
        key = "default" if error is InternalError else kind.status
        content = {"schema": {"$ref": "#/components/schemas/Problem"}, "examples": {}}
        response = found.setdefault(key, {"model": Problem, "content": {MEDIA_TYPE: content}})
        response["description"] = f"{response.get('description', '')} {kind.when}".strip()
        example = kind.answer(kind.example)
        body = json.loads(bytes(example.body))
        response["content"][MEDIA_TYPE]["examples"][kind.name] = {"summary": kind.title, "value": body}
        for name, (about, type_) in HEADERS.items():
            if name.lower() in example.headers:
                response.setdefault("headers", {})[name] = {"description": about, "schema": {"type": type_}}
    return found
