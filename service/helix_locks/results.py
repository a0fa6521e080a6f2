"""What the service answers, typed for the SDK's users: the JSON objects of docs/api.md as
TypedDicts (the Node client's types.ts declares the same). They are the dicts the SDK has always
returned, so `lock["state"]` keeps working, and a type checker now knows every field."""

# No `from __future__ import annotations` here: TypedDict reads NotRequired off the annotations
# themselves, and in Python 3.11 it cannot see it inside a string.
from typing import Any, Literal, NotRequired, TypedDict

# `held`: live; `expired`: its lease ran out, not yet reclaimed; `released` (by its holder or by
# force); `reclaimed`: taken over by a later grant.
LockState = Literal["held", "expired", "released", "reclaimed"]
EventType = Literal["acquired", "renewed", "updated", "released", "forced", "expired", "reclaimed"]


class Revocation(TypedDict):
    """A request that a lock's holder let go (POST /v1/locks/{id}/revocation): nothing is forced."""

    requested_at: str
    reason: str
    # By when the asker would like the lock released; after it an admin may force it.
    deadline: str
    # The id of the API key that asked; None for an anonymous request.
    by: str | None
    # The holder the key is reserved for, once released, until the deadline; None for none.
    preferred_holder: str | None


class Lock(TypedDict):
    """The lock object every endpoint that returns a lock returns (never with its token). Times
    are RFC 3339 strings, by the database's clock."""

    id: int
    organization_id: str
    job_type: str
    holder: str
    # Strictly increases with every grant of the key (across all the slots of a semaphore).
    fencing_token: int
    acquired_at: str
    expires_at: str
    released_at: str | None
    release_reason: Literal["released", "reclaimed", "forced"] | None
    state: LockState
    # Milliseconds of lease left when the database answered.
    ttl_remaining_ms: int
    metadata: dict[str, Any] | None
    # How many locks may hold the key at once (1: a plain lock), and which place this one holds.
    max_holders: int
    slot: int
    # The id of the admin key that released it by force; None otherwise.
    forced_by: NotRequired[str | None]
    # The session it belongs to, whose token and lease it shares; None for a lock on its own.
    session_id: NotRequired[int | None]
    # exclusive, or shared (a reader, held beside the key's other readers); absent from a service
    # older than modes.
    mode: NotRequired[Literal["exclusive", "shared"]]
    # acquired_at + max_hold_seconds: no lease of the lock runs past it; None without a hold
    # limit; absent from a service older than hold limits.
    hold_limit_at: NotRequired[str | None]
    # acquired_at + hold_at_least_seconds: no other lock of the key is granted before it; None
    # when the acquire closed nothing; absent from a service older than closed keys.
    closed_until: NotRequired[str | None]
    # A request that the holder let go, the first one made; None: none; absent from a service
    # older than revocation requests.
    revocation: NotRequired[Revocation | None]


class Reclaimed(TypedDict):
    """The stale lock an acquire took over: its lease had run out."""

    lock_id: int
    holder: str
    expired_at: str


class Acquired(Lock):
    """An acquire's answer (Grant.body): the lock, its secret token, and the lock it reclaimed."""

    token: str
    reclaimed: Reclaimed | None


class Renewed(Lock):
    """A renewal's answer: the lock, and whether the lease had run out, unreclaimed, before it."""

    lapsed: bool
    # The lease was cut short by the lock's hold limit (absent from a service older than them).
    limited: NotRequired[bool]


SessionState = Literal["held", "expired", "ended"]


class SessionBody(TypedDict):
    """A session (POST /v1/sessions and below): one lease that its locks share."""

    id: int
    organization_id: str
    holder: str
    expires_at: str
    ttl_remaining_ms: int
    state: SessionState
    # Its unreleased locks, in job type order.
    locks: list[Lock]
    # Creation + max_hold_seconds: no lease of it or of its locks runs past it; None without a
    # hold limit; absent from a service older than hold limits.
    hold_limit_at: NotRequired[str | None]


class OpenedSession(SessionBody):
    """A session's opening answer (Grant.body of a session): with its secret token."""

    token: str


class Page(TypedDict):
    """One page of a listing, and the cursor of the next (None when nothing follows)."""

    items: list[Lock]
    next_cursor: str | None


class Place(TypedDict):
    """One place in a key's queue (GET /v1/locks/queue): a waiting acquire."""

    holder: str
    mode: Literal["exclusive", "shared"]
    max_holders: int
    # When the place was taken (the queue's order) and when it leaves at the latest: RFC 3339.
    waiting_since: str
    wait_until: str
    # From 1: the next to be granted.
    position: int


class QueuePage(TypedDict):
    """One page of a key's queue, first place first, and the cursor of the next (None at the end)."""

    items: list[Place]
    next_cursor: str | None


class LockEvent(TypedDict):
    """One event of GET /v1/events: its data, with the stream's `id` added (what a watch resumes
    from)."""

    id: str
    type: EventType
    at: str
    # The lock as it was when the event was read.
    lock: Lock
    # Of an `acquired` event: the stale lock the grant took over, or None.
    reclaimed: NotRequired[Reclaimed | None]
