"""The one table from domain errors to RFC 9457 problem responses, and the response builder."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from fastapi.responses import JSONResponse

from helix_locks import logs
from helix_locks.errors import (
    DatabaseUnavailable,
    EmptyResult,
    Forbidden,
    InvalidArgument,
    LockEnded,
    LockError,
    LockHeld,
    LockNotFound,
    OrganizationWaitersFull,
    QuotaExceeded,
    SchemaNotReady,
    ShuttingDown,
    TokenMismatch,
    TooManyWaiters,
    Unauthenticated,
    UnsupportedMediaType,
    WaitInterrupted,
)

MEDIA_TYPE = "application/problem+json"
# Seconds a client should wait before trying again while the database is unreachable.
UNAVAILABLE_RETRY_AFTER = 2


def problem(
    status: int,
    kind: str,
    title: str,
    detail: str,
    *,
    headers: Mapping[str, str] | None = None,
    **fields: Any,
) -> JSONResponse:
    """A problem+json response; `kind` names the problem type (urn:helix-locks:problem:KIND),
    which the request's log line and metrics carry."""
    logs.bind(problem=kind)
    body = {"type": f"urn:helix-locks:problem:{kind}", "title": title, "status": status, "detail": detail}
    body.update({name: _json(value) for name, value in fields.items()})
    return JSONResponse(body, status_code=status, headers=dict(headers or {}), media_type=MEDIA_TYPE)


def rfc3339(value: datetime) -> str:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _json(value: Any) -> Any:
    return rfc3339(value) if isinstance(value, datetime) else value


def _held(exc: LockHeld) -> JSONResponse:
    return problem(
        409,
        "lock-held",
        "Lock held",
        "A live lock holds this organization and job type.",
        headers={"Retry-After": str(exc.retry_after_seconds)},
        lock_id=exc.lock_id,
        holder=exc.holder,
        expires_at=exc.expires_at,
    )


def _ended(exc: LockEnded) -> JSONResponse:
    how = {
        "released": "was released",
        "reclaimed": "expired and was reclaimed by another worker",
        "forced": "was broken by an administrator",
    }.get(exc.release_reason, "ended")
    return problem(
        410,
        "lock-ended",
        "Lock ended",
        f"The lock {how}; its holder no longer owns it.",
        lock_id=exc.lock_id,
        release_reason=exc.release_reason,
        released_at=exc.released_at,
        forced_by=exc.forced_by,
    )


def _invalid(exc: InvalidArgument) -> JSONResponse:
    return invalid([{"field": exc.field, "message": exc.message}])


def invalid(errors: list[dict[str, str]]) -> JSONResponse:
    names = ", ".join(error["field"] for error in errors)
    return problem(422, "invalid-request", "Invalid request", f"Invalid: {names}.", errors=errors)


def _unavailable(exc: DatabaseUnavailable) -> JSONResponse:
    return problem(
        503,
        "database-unavailable",
        "Database unavailable",
        "The lock database cannot be reached right now; try again.",
        headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER)},
    )


def internal() -> JSONResponse:
    return problem(500, "internal-error", "Internal error", "The service failed; the error is logged.")


PROBLEMS: Mapping[type[LockError], Callable[[Any], JSONResponse]] = {
    LockHeld: _held,
    LockNotFound: lambda exc: problem(404, "lock-not-found", "Lock not found", "No such lock."),
    TokenMismatch: lambda exc: problem(
        403, "token-mismatch", "Token mismatch", "The Lock-Token does not match this lock."
    ),
    LockEnded: _ended,
    InvalidArgument: _invalid,
    DatabaseUnavailable: _unavailable,
    Unauthenticated: lambda exc: problem(
        401, "unauthenticated", "Unauthenticated", exc.reason, headers={"WWW-Authenticate": "Bearer"}
    ),
    Forbidden: lambda exc: problem(403, "forbidden", "Forbidden", exc.reason),
    UnsupportedMediaType: lambda exc: problem(
        415,
        "unsupported-media-type",
        "Unsupported media type",
        "Send the body as JSON with Content-Type: application/json.",
    ),
    TooManyWaiters: lambda exc: problem(
        503,
        "too-many-waiters",
        "Too many waiters",
        f"This service process already has {exc.limit} acquires waiting; try again.",
        headers={"Retry-After": "1"},
    ),
    OrganizationWaitersFull: lambda exc: problem(
        429,
        "too-many-waiters-in-organization",
        "Too many waiters in this organization",
        f"This organization already has {exc.limit} acquires waiting in this service process; try again.",
        headers={"Retry-After": "1"},
    ),
    QuotaExceeded: lambda exc: problem(
        429,
        "quota-exceeded",
        "Live-lock quota exceeded",
        f"This organization already has about {exc.limit} live locks, as many as one may have: release"
        " some, or let them expire and be reclaimed.",
        headers={"Retry-After": "1"},
    ),
    WaitInterrupted: lambda exc: problem(
        503,
        "wait-interrupted",
        "Wait interrupted",
        f"The wait ended early: {exc.reason}.",
        headers={"Retry-After": "1"},
    ),
    SchemaNotReady: lambda exc: problem(
        503,
        "not-migrated",
        "Not ready",
        f"The database schema is not ready: {exc.reason}.",
        headers={"Retry-After": "5"},
    ),
    ShuttingDown: lambda exc: problem(
        503,
        "service-stopping",
        "Service stopping",
        "The service stopped before this request finished, so its outcome is unknown: try again "
        "(an acquire with the same Idempotency-Key).",
        headers={"Retry-After": "1"},
    ),
    EmptyResult: lambda exc: internal(),
}


def from_error(exc: LockError) -> JSONResponse:
    return PROBLEMS[type(exc)](exc)
