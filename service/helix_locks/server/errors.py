"""Domain errors: what can go wrong with a lock, in the lock's own terms (no HTTP, no SQL)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime


class LockError(Exception):
    """Base of every error the domain reports to its callers."""


# A full pair's refusal lists at most this many holders (migration 0021), so that its size does not
# grow with max_holders (up to 1,000).
HOLDERS_LISTED = 20


@dataclass(frozen=True)
class Holder:
    """One held lock of a full pair: its id, holder, slot and lease's end."""

    lock_id: int
    holder: str
    slot: int
    expires_at: datetime


@dataclass
class LockHeld(LockError):
    """Live, unexpired locks hold every slot of the key (one, unless it is a semaphore); lock_id,
    holder and expires_at name the one whose lease runs out first. `holders` lists at most
    HOLDERS_LISTED of them, those whose leases run out first; `holders_total` counts them all."""

    lock_id: int | None
    holder: str | None
    expires_at: datetime | None
    retry_after_seconds: int
    holders: list[Holder] = field(default_factory=list)
    max_holders: int = 1
    holders_total: int = 0
    # Of a session's locks, the pair that could not be granted.
    job_type: str | None = None
    # The held locks' mode (migration 0030): exclusive or shared; None where the refusal has none.
    mode: str | None = None


@dataclass
class WaitersAhead(LockHeld):
    """Places in the pair's queue come before this acquire (any place, for an acquire that does not
    wait) and take the free slots there are: `waiting` places in all, `ahead` of them first."""

    waiting: int = 0
    ahead: int = 0


@dataclass
class ClosedUntil(LockHeld):
    """A grant with hold_at_least_seconds closed the pair: no lock of it is granted before
    `closed_until` (`closed_ms` from the refusal, by the database clock), whoever holds it now."""

    closed_until: datetime | None = None
    closed_ms: int = 0


@dataclass
class Reserved(LockHeld):
    """A revocation request reserved the pair for its preferred holder until `deadline`
    (`reserved_ms` from the refusal, by the database clock): nobody else is granted it meanwhile."""

    preferred_holder: str | None = None
    deadline: datetime | None = None
    reserved_ms: int = 0


@dataclass
class MaxHoldersMismatch(LockError):
    """The key's held locks share another max_holders than the acquire named."""

    max_holders: int
    job_type: str | None = None  # of a session's locks, the pair


@dataclass
class LockNotFound(LockError):
    """No lock with this id exists (for this caller)."""


@dataclass
class TokenMismatch(LockError):
    """The token presented does not prove ownership of the lock."""

    # The lock's, for the log line and the lost-lock metric (never told to the caller).
    organization_id: str | None = None
    job_type: str | None = None


@dataclass
class LockEnded(LockError):
    """The lock ended earlier: released by its holder, reclaimed by another worker, or forced."""

    lock_id: int
    release_reason: str
    released_at: datetime
    forced_by: str | None = None
    organization_id: str | None = None
    job_type: str | None = None


@dataclass
class HoldLimitReached(LockError):
    """The lock's hold limit (max_hold_seconds) has come: it is renewed no more, and its lease ran
    out with it."""

    hold_limit_at: datetime


@dataclass
class SessionNotFound(LockError):
    """No session with this id exists (for this caller)."""


@dataclass
class RenewTheSession(LockError):
    """The lock belongs to a session, which is renewed as a whole."""

    session_id: int


@dataclass
class SessionEnded(LockError):
    """The session ended earlier: its holder ended it, or it lost a lock (reclaimed or forced)
    and a call that found out released the rest."""

    session_id: int
    end_reason: str
    ended_at: datetime


@dataclass
class SessionLapsed(LockError):
    """The session's lease has run out: renew it before adding locks to it."""

    expires_at: datetime


@dataclass
class TooManySessions(LockError):
    """The organization already has as many open sessions as it may have."""

    limit: int


@dataclass
class SessionFull(LockError):
    """The session would hold more locks than one may hold."""

    limit: int


@dataclass
class InvalidRequest(LockError):
    """Values the caller sent are out of range or unreadable: {"field", "message"} for each."""

    errors: list[dict[str, str]]


class InvalidArgument(InvalidRequest):
    """One value the caller sent is out of range or unreadable."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__([{"field": field, "message": message}])


@dataclass
class BodyTooLarge(LockError):
    """A request body over the limit, declared or streamed."""

    max_bytes: int


@dataclass
class DatabaseUnavailable(LockError):
    """PostgreSQL could not be reached or did not answer in time."""

    reason: str


@dataclass
class SchemaNotReady(LockError):
    """The database lacks migrations this build needs, or holds changed ones."""

    reason: str


@dataclass
class Unauthenticated(LockError):
    """No API key, or one that is unknown or revoked, where a key is required."""

    reason: str


@dataclass
class Forbidden(LockError):
    """The caller's key may not do this (another organization, or force without admin)."""

    reason: str


@dataclass
class UnsupportedMediaType(LockError):
    """A body that is not declared as JSON, where that is required."""


@dataclass
class TooManyWaiters(LockError):
    """This process already has as many waiting acquires as it allows."""

    limit: int


@dataclass
class OrganizationWaitersFull(LockError):
    """This process already has as many waiting acquires of the organization as one may have."""

    limit: int


@dataclass
class TooManyWatchers(LockError):
    """This process already streams as many event watchers as it allows, or reads as many
    resumes at once."""

    limit: int
    what: str = "event streams open"


@dataclass
class OrganizationWatchersFull(LockError):
    """This process already streams as many of the organization's watchers as one may have, or
    its streams hold as many bytes of events as its share."""

    limit: int
    what: str = "event streams open"


@dataclass
class EventsExpired(LockError):
    """A resume from an event the stream can no longer replay from."""

    reason: str


@dataclass
class QuotaExceeded(LockError):
    """The organization already has as many live locks as it may have."""

    limit: int


@dataclass
class WaitInterrupted(LockError):
    """A waiting acquire ended without an answer: the client left, or the service is stopping."""

    reason: str


@dataclass
class ShuttingDown(LockError):
    """The service stopped before the request finished (SIGTERM, and the grace time ran out)."""


class InternalError(LockError):
    """The service failed: a bug, logged where it happened."""


class EmptyResult(InternalError):
    """A function that must return a row returned none: a bug, never a success."""


class ShareEnded(InternalError):
    """The share of the quota an acquire was let through on has ended, or was taken back near the
    quota (migration 0020): Locks.acquire sends it the exact way; answered, it would be a bug."""
