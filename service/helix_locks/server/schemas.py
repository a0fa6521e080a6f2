"""The HTTP edge's request and response bodies (pydantic); the domain uses plain dataclasses."""

from __future__ import annotations

import json
import math
from datetime import datetime
from typing import Annotated, Any, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
)

from helix_locks.server.errors import HOLDERS_LISTED
from helix_locks.server.locks import Grant, Lock, Mode, Reclaimed, Renewal, State, storable_text
from helix_locks.server.sessions import Session

# Metadata as stored (stored_bytes), which is what every answer carries back; migration 0021
# holds the database to the same bound.
METADATA_MAX_BYTES = 8 * 1024
# Deeper JSON than this is refused: it could be stored but not serialized back (pydantic stops
# at a depth of a few hundred), and no worker needs it.
METADATA_MAX_DEPTH = 32
IDENTIFIER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"

Identifier = Annotated[
    str,
    StringConstraints(strict=True, pattern=IDENTIFIER_PATTERN),
    Field(description="1 to 128 characters of A-Z a-z 0-9 . _ : -, starting with a letter or digit."),
]


def _storable(value: str) -> str:
    if not storable_text(value):
        raise ValueError("must be valid Unicode text without the NUL character")
    return value


class _Measure:
    """One walk of metadata: refuses what PostgreSQL cannot store or pydantic cannot write back,
    and adds up how many more bytes its numbers take as stored than as json.dumps writes them.
    Given a bound, it refuses as soon as the numbers that grow have grown past it alone: a body
    may hold ten thousand of them, and each costs a few microseconds."""

    def __init__(self, bound: int | None = None) -> None:
        self.bound = bound
        self.swell = 0  # as stored less as written, of the numbers walked
        self.grown = 0  # the same, of those that grow only: the stored size is more

    def walk(self, value: Any, depth: int = 1) -> None:
        if depth > METADATA_MAX_DEPTH:
            raise ValueError(f"must be nested at most {METADATA_MAX_DEPTH} levels deep")
        if isinstance(value, str):
            _storable(value)
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError("numbers must be finite")
            text = repr(value)  # as json.dumps writes it
            if "e" in text:
                grown = _numeric_length(text) - len(text)
                self.swell += grown
                self.grown += grown
                if self.bound is not None and self.grown > self.bound:
                    raise ValueError(
                        f"must be at most {self.bound} bytes as stored; its numbers alone take more"
                    )
            elif text == "-0.0":
                self.swell -= 1
        elif isinstance(value, dict):
            for key, item in value.items():
                self.walk(key, depth + 1)
                self.walk(item, depth + 1)
        elif isinstance(value, list):
            for item in value:
                self.walk(item, depth + 1)


def _numeric_length(text: str) -> int:
    """How many characters PostgreSQL's numeric writes a float in, given as repr writes it (as
    json.dumps sends it, in psycopg's Jsonb): numeric keeps every digit, and as many decimals as
    the exponent implies, and writes them without one (1e308: 309 digits; 1.5e-07: 0.00000015);
    zero has no sign."""
    if "e" not in text:  # already as numeric writes it, but for the sign of -0.0
        return len(text) - (text == "-0.0")
    mantissa, _, power = text.partition("e")
    whole, _, fraction = mantissa.removeprefix("-").partition(".")
    digits, exponent = len(whole) + len(fraction), int(power) - len(fraction)
    if exponent >= 0:
        length = digits + exponent  # the digits, then zeros
    elif digits > -exponent:
        length = digits + 1  # a point among the digits
    else:
        length = 2 - exponent  # "0.", zeros, the digits
    return length + mantissa.startswith("-")


def stored_bytes(metadata: dict[str, Any], bound: int | None = None) -> int:
    """The size of metadata as PostgreSQL stores it, and every answer carries it back: jsonb::text,
    which puts ", " and ": " between items and writes every number in full (migration 0021 holds
    the database to the same bound). ValueError for what cannot be stored at all, and, given a
    bound, for what its numbers alone take more than."""
    measure = _Measure(bound)
    measure.walk(metadata)
    return len(json.dumps(metadata, ensure_ascii=False).encode()) + measure.swell


def _metadata(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is None:
        return None
    size = stored_bytes(value, METADATA_MAX_BYTES)
    if size > METADATA_MAX_BYTES:
        raise ValueError(f"must be at most {METADATA_MAX_BYTES} bytes as stored, is {size}")
    return value


Holder = Annotated[
    str,
    StringConstraints(strict=True, min_length=1, max_length=256),
    AfterValidator(_storable),
    Field(
        description="Free text naming the worker for humans, e.g. worker-7@host-3.",
        examples=["worker-7@host-3"],
    ),
]
TtlSeconds = Annotated[
    float,
    Field(
        strict=True,
        ge=1,
        le=86400,
        allow_inf_nan=False,
        description="Lease length in seconds, 1 to 86400; fractions are kept to the millisecond.",
        examples=[30, 2.5],
    ),
]
MaxHoldSeconds = Annotated[
    float | None,
    Field(
        strict=True,
        ge=1,
        le=604800,
        allow_inf_nan=False,
        description="A hold limit in seconds, 1 to 604800 (7 days): no lease of the lock runs past"
        " acquired_at + this (hold_limit_at), however it is renewed, so a holder that hangs while its"
        " heartbeat goes on loses the lock then. Default: none.",
        examples=[3600],
    ),
]
HoldAtLeastSeconds = Annotated[
    float | None,
    Field(
        strict=True,
        ge=1,
        le=604800,
        allow_inf_nan=False,
        description="Close the organization and job type for this many seconds, 1 to 604800 (7 days):"
        " no other lock of the pair is granted before acquired_at + this (closed_until), whatever"
        " becomes of this lock, released early included; acquires meanwhile get 409 closed-until."
        " For a job that many machines schedule, to run at most once per interval. Exclusive locks"
        " with max_holders 1 only. Default: none.",
        examples=[3600],
    ),
]
WaitSeconds = Annotated[
    float,
    Field(
        strict=True,
        ge=0,
        le=60,
        allow_inf_nan=False,
        description="Wait up to this many seconds for a held lock (0 to 60; default 0: answer 409 at "
        "once). Granted as soon as the holder releases it or its lease expires; 409 when the wait "
        "runs out.",
        examples=[0, 10],
    ),
]
MaxHolders = Annotated[
    int,
    Field(
        strict=True,
        ge=1,
        le=1000,
        description="How many locks may hold this organization and job type at once, 1 to 1000 (default"
        " 1: mutual exclusion). Each is a lock of its own in a slot from 0 to max_holders - 1; the held"
        " locks of a pair share one value (409 max-holders-mismatch otherwise).",
        examples=[1, 3],
    ),
]
ModeField = Annotated[
    Mode,
    Field(
        description="exclusive (the default): the lock excludes every other lock of the organization and"
        " job type; shared: held beside the pair's other shared locks, up to 1000, each with a lease of"
        " its own, and never beside an exclusive one. A shared lock has max_holders 1.",
        examples=["exclusive", "shared"],
    ),
]


def _one_holder_if_shared(mode: Mode, info: ValidationInfo) -> Mode:
    """mode shared with max_holders above 1: refused (a semaphore's locks are exclusive)."""
    if mode == "shared" and info.data.get("max_holders", 1) != 1:
        raise ValueError("a shared lock has max_holders 1: a semaphore's locks are exclusive")
    return mode


Metadata = Annotated[
    dict[str, Any] | None,
    AfterValidator(_metadata),
    Field(
        description="Any JSON object, at most 8 KiB (8192 bytes) as stored, whatever its size as sent:"
        " as PostgreSQL's jsonb writes it, with ', ' and ': ' between items and every number in full"
        " (1e308 is 309 digits). Returned as stored.",
        examples=[{"run": "2026-11-30", "attempt": 1}],
    ),
]


def ttl_ms(ttl_seconds: float) -> int:
    """The lease in whole milliseconds, as the database takes it."""
    return round(ttl_seconds * 1000)


# Realistic values for the examples below, the README's quickstart lock. FastAPI drops null values
# from objects in the OpenAPI document (fastapi#5559), so an object example has none: a body that
# must hold a null (a fresh grant's released_at) gets no whole-body example, only field examples.
_AT = "2026-11-30T02:44:22.375915Z"
_EXPIRES = "2026-11-30T02:44:52.375915Z"
_RELEASED_AT = "2026-11-30T02:44:41.020311Z"
_RECLAIMED_AT = "2026-11-30T02:45:03.512204Z"
# The cursor after _RELEASED_LOCK in a listing of state=released.
_CURSOR = "eyJzIjoicmVsZWFzZWQiLCJrIjpbIjIwMjYtMTEtMzBUMDI6NDQ6NDEuMDIwMzExKzAwOjAwIiwxXX0"
_RELEASED_LOCK: dict[str, Any] = {
    "id": 1,
    "organization_id": "acme",
    "job_type": "nightly-report",
    "holder": "worker-7@host-3",
    "fencing_token": 1,
    "acquired_at": _AT,
    "expires_at": _EXPIRES,
    "released_at": _RELEASED_AT,
    "release_reason": "released",
    "state": "released",
    "ttl_remaining_ms": 0,
    "metadata": {"run": "2026-11-30"},
    "max_holders": 1,
    "slot": 0,
    "forced_by": None,
    "session_id": None,
}


class AcquireRequest(BaseModel):
    """Ask for the lock of one (organization_id, job_type)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "organization_id": "acme",
                    "job_type": "nightly-report",
                    "holder": "worker-7@host-3",
                    "ttl_seconds": 30,
                    "metadata": {"run": "2026-11-30"},
                }
            ]
        },
    )

    organization_id: Annotated[
        Identifier,
        Field(
            description="The organization the job runs for; an organization's API key acts only in its own."
            " 1 to 128 characters of A-Z a-z 0-9 . _ : -, starting with a letter or digit.",
            examples=["acme"],
        ),
    ]
    job_type: Annotated[
        Identifier,
        Field(
            description="The kind of job; one lock per organization and job type at a time."
            " 1 to 128 characters of A-Z a-z 0-9 . _ : -, starting with a letter or digit.",
            examples=["nightly-report"],
        ),
    ]
    holder: Holder
    ttl_seconds: TtlSeconds
    metadata: Metadata = None
    wait_seconds: WaitSeconds = 0
    max_holders: MaxHolders = 1
    mode: ModeField = "exclusive"
    max_hold_seconds: MaxHoldSeconds = None
    hold_at_least_seconds: HoldAtLeastSeconds = None

    _shared_alone = field_validator("mode")(_one_holder_if_shared)

    @field_validator("hold_at_least_seconds")
    @classmethod
    def _closes_for_one_holder(cls, seconds: float | None, info: ValidationInfo) -> float | None:
        """A pair closes behind one holder: of a plain exclusive lock only."""
        if seconds is not None and (
            info.data.get("mode") == "shared" or info.data.get("max_holders", 1) != 1
        ):
            raise ValueError("hold_at_least_seconds is for exclusive locks with max_holders 1")
        return seconds


class RevocationRequest(BaseModel):
    """Ask the holder of a lock to let go: recorded in the lock, sent as an event, and answered to
    the holder's next renewal. Nothing is forced."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "reason": "deploying a new version",
                    "deadline_seconds": 60,
                    "preferred_holder": "worker-9@host-1",
                }
            ]
        },
    )

    reason: Annotated[
        str,
        StringConstraints(strict=True, min_length=1, max_length=1024),
        AfterValidator(_storable),
        Field(description="Why, for the holder and for humans: 1 to 1024 characters."),
    ]
    deadline_seconds: Annotated[
        float,
        Field(
            strict=True,
            ge=1,
            le=86400,
            allow_inf_nan=False,
            description="By when, in seconds from now, the lock should be released (1 to 86400; default 60)."
            " After it, an admin may force the release.",
        ),
    ] = 60
    preferred_holder: Annotated[
        Holder | None,
        Field(
            description="Reserve the organization and job type, once released, for this holder until the"
            " deadline (exclusive locks with max_holders 1 only): others get 409 reserved meanwhile,"
            " and queued waiters keep their places. Holder names are not authenticated: this orders"
            " honest workers, it is not access control.",
        ),
    ] = None


class RenewRequest(BaseModel):
    """Extend a lease: the new expires_at is database-now + ttl_seconds."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"ttl_seconds": 30}]})

    ttl_seconds: TtlSeconds


class UpdateRequest(BaseModel):
    """Replace a held lock's metadata (null clears it); the lease is not changed."""

    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"metadata": {"done": 40, "of": 100}}]}
    )

    metadata: Metadata = Field(...)


class LockBody(BaseModel):
    """A lock in any state; times are RFC 3339 UTC, ttl_remaining_ms is the database's."""

    model_config = ConfigDict(json_schema_extra={"examples": [_RELEASED_LOCK]})

    id: int = Field(description="The lock's id; opaque to clients, use it as given.", examples=[1])
    organization_id: str = Field(description="The organization the lock belongs to.", examples=["acme"])
    job_type: str = Field(description="The job type the lock is for.", examples=["nightly-report"])
    holder: str = Field(description="The worker that acquired the lock.", examples=["worker-7@host-3"])
    fencing_token: int = Field(
        description="Strictly increases with every grant for this organization and job type, never"
        " reused; pass it to storage so it can refuse a write from a holder that lost the lock.",
        examples=[1],
    )
    acquired_at: datetime = Field(description="When the lock was granted (database clock).", examples=[_AT])
    expires_at: datetime = Field(
        description="When the lease runs out unless renewed (database clock); unchanged by a reclaim.",
        examples=[_EXPIRES],
    )
    released_at: datetime | None = Field(
        description="When the lock ended (released, forced, or reclaimed by the next grant); null while"
        " it has not.",
        examples=[None, _RELEASED_AT],
    )
    release_reason: str | None = Field(
        description="How the lock ended: released, reclaimed or forced; null while it has not.",
        examples=[None, "released", "reclaimed", "forced"],
    )
    state: State = Field(
        description="held: live; expired: lease ran out, the next acquire reclaims it; released or"
        " reclaimed: ended.",
        examples=["held"],
    )
    ttl_remaining_ms: int = Field(
        description="Milliseconds of lease left at answer time, by the database clock; 0 once it ran out.",
        examples=[29998],
    )
    metadata: dict[str, Any] | None = Field(
        description="The metadata given at acquire, or null.", examples=[{"run": "2026-11-30"}]
    )
    max_holders: int = Field(
        description="How many locks may hold this organization and job type at once (1: a plain lock).",
        examples=[1],
    )
    slot: int = Field(
        description="Which of the max_holders places this lock holds, from 0; storage that fences the"
        " holders of a semaphore keeps one fence per slot.",
        examples=[0],
    )
    mode: Mode = Field(
        default="exclusive",
        description="exclusive: no other lock of the pair is held beside it; shared: held beside the"
        " pair's other shared locks only (a shared lock has max_holders 1 and a slot of its own).",
        examples=["exclusive"],
    )
    forced_by: str | None = Field(
        default=None,
        description="The id of the admin API key that released the lock by force; null unless"
        " release_reason is forced.",
        examples=[None],
    )
    session_id: int | None = Field(
        default=None,
        description="The session the lock belongs to, whose token and lease it shares (renewed with"
        " the session, never alone); null for a lock on its own.",
        examples=[None],
    )
    hold_limit_at: datetime | None = Field(
        default=None,
        description="acquired_at + max_hold_seconds: no lease of the lock runs past it, and after it no"
        " renewal is granted (410 hold-limit-reached); null when the acquire set no hold limit.",
        examples=[None],
    )
    closed_until: datetime | None = Field(
        default=None,
        description="acquired_at + hold_at_least_seconds: no other lock of the organization and job"
        " type is granted before it, whatever becomes of this one; null when the acquire set none.",
        examples=[None],
    )
    revocation: RevocationBody | None = Field(
        default=None,
        description="A request that the holder let go (POST /v1/locks/{id}/revocation), the first one"
        " made; null when none was. The holder's renewals answer it too.",
        examples=[None],
    )

    @classmethod
    def of(cls, lock: Lock) -> LockBody:
        return cls.model_validate(lock, from_attributes=True)


class RevocationBody(BaseModel):
    """A request that the holder let go, as recorded: the first one made while the lock lived."""

    requested_at: datetime = Field(
        description="When it was made, by the database's clock.", examples=[_EXPIRES]
    )
    reason: str = Field(description="Why, as the asker wrote it.", examples=["deploying a new version"])
    deadline: datetime = Field(
        description="By when the asker would like the lock released; after it an admin may force it."
        " With preferred_holder, the pair is reserved for that holder until then.",
        examples=[_EXPIRES],
    )
    by: str | None = Field(
        description="The id of the API key that asked; null for an anonymous request.",
        examples=["3f9a0c1b2d4e"],
    )
    preferred_holder: str | None = Field(
        description="The holder the pair is reserved for once released, until the deadline; null for none.",
        examples=["worker-9@host-1"],
    )


class ReclaimedBody(BaseModel):
    """The stale lock that this acquire took over: its lease had run out."""

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"lock_id": 1, "holder": "worker-7@host-3", "expired_at": _EXPIRES}]}
    )

    lock_id: int = Field(description="The id of the lock that was reclaimed.", examples=[1])
    holder: str = Field(description="Who held the reclaimed lock.", examples=["worker-7@host-3"])
    expired_at: datetime = Field(description="When the reclaimed lock's lease ran out.", examples=[_EXPIRES])


class GrantBody(LockBody):
    """A granted lock, with the secret token that proves ownership."""

    model_config = ConfigDict(json_schema_extra=None)  # a fresh grant has nulls: see _RELEASED_LOCK

    token: str = Field(
        description="The secret that proves ownership; shown only here. Send it as the Lock-Token"
        " header to renew and release.",
        examples=["d060e87f866045a4bfda05db1917e1c5"],
    )
    reclaimed: ReclaimedBody | None = Field(
        description="The stale lock this acquire took over, or null when there was none."
    )

    @classmethod
    def of_grant(cls, grant: Grant) -> GrantBody:
        fields = {**vars(grant.lock), "token": grant.token, "reclaimed": grant.reclaimed}
        return cls.model_validate(fields, from_attributes=True)


EventType = Literal[
    "acquired", "renewed", "updated", "released", "forced", "expired", "reclaimed", "revocation-requested"
]


class EventBody(BaseModel):
    """One change of a lock, as GET /v1/events sends it in an event's data."""

    type: EventType = Field(description="What happened; also the event's name.")
    at: datetime = Field(description="When it happened, by the database's clock.")
    lock: LockBody = Field(description="The lock (never its token), as it is when the event is read.")


class AcquiredEventBody(EventBody):
    """An acquired event: the grant, and the stale lock it took over if any."""

    reclaimed: ReclaimedBody | None = Field(
        description="The stale lock this grant took over, or null when there was none."
    )


def event_data(kind: str, at: datetime, lock: Lock, reclaimed: Reclaimed | None) -> str:
    """An event's data line as GET /v1/events sends it: the JSON of its body. The event hub (the
    domain) is handed this by app.py, and so never builds an HTTP body itself."""
    body: EventBody
    if kind == "acquired":
        stale = None if reclaimed is None else ReclaimedBody.model_validate(reclaimed, from_attributes=True)
        body = AcquiredEventBody(type="acquired", at=at, lock=LockBody.of(lock), reclaimed=stale)
    else:
        body = EventBody.model_validate({"type": kind, "at": at, "lock": LockBody.of(lock)})
    return body.model_dump_json()


class RenewalBody(LockBody):
    """A renewed lock."""

    model_config = ConfigDict(json_schema_extra=None)  # a live lock has nulls: see _RELEASED_LOCK

    lapsed: bool = Field(
        description="The lease had run out, unreclaimed, before this renewal.", examples=[False]
    )
    limited: bool = Field(
        default=False,
        description="The new lease was cut short by the lock's hold limit: it ends at hold_limit_at,"
        " sooner than ttl_seconds asked, and no renewal takes it further.",
        examples=[False],
    )

    @classmethod
    def of_renewal(cls, renewal: Renewal) -> RenewalBody:
        return cls.model_validate(
            {**vars(renewal.lock), "lapsed": renewal.lapsed, "limited": renewal.limited}
        )


class PageBody(BaseModel):
    """One page of a listing."""

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"items": [_RELEASED_LOCK], "next_cursor": _CURSOR}]}
    )

    items: list[LockBody] = Field(description="The locks of this page; tokens never appear here.")
    next_cursor: str | None = Field(
        description="Pass as cursor for the next page; null when nothing follows (a non-null cursor"
        " may still lead to an empty last page).",
        examples=[None, _CURSOR],
    )


class FieldError(BaseModel):
    """One invalid field of a request."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"field": "ttl_seconds", "message": "Input should be less than or equal to 86400"}]
        }
    )

    field: str = Field(
        description="The field: a body field (dotted when nested), query parameter or header;"
        " 'body' for a body that is not readable JSON.",
        examples=["ttl_seconds", "Lock-Token"],
    )
    message: str = Field(
        description="What is wrong with it.", examples=["Input should be less than or equal to 86400"]
    )


class PlaceBody(BaseModel):
    """One place in a pair's queue: a waiting acquire, in the order of the queue."""

    holder: str = Field(description="The holder the waiting acquire names.", examples=["worker-9@host-1"])
    mode: Mode = Field(
        default="exclusive",
        description="The lock the place waits for: exclusive (one holder per slot) or shared (held"
        " together with the other shared locks; a run of shared places is granted together).",
        examples=["exclusive"],
    )
    max_holders: int = Field(description="The max_holders the waiting acquire names.", examples=[1])
    waiting_since: datetime = Field(
        description="When the place was taken (database clock): the queue's order.", examples=[_AT]
    )
    wait_until: datetime = Field(
        description="When the place leaves the queue at the latest, its wait over.", examples=[_EXPIRES]
    )
    position: int = Field(description="Its place in the queue, from 1 (next to be granted).", examples=[1])


class QueuePageBody(BaseModel):
    """One page of a pair's queue, first place first."""

    items: list[PlaceBody] = Field(description="The places of this page, in the queue's order.")
    next_cursor: str | None = Field(
        description="Pass as cursor for the next page; null when nothing follows.", examples=[None]
    )


class HolderBody(BaseModel):
    """One held lock of a key whose every slot is held, as a 409 lock-held lists it."""

    lock_id: int = Field(description="The held lock's id.", examples=[1])
    holder: str = Field(description="Who holds it.", examples=["worker-7@host-3"])
    slot: int = Field(description="Its slot.", examples=[0])
    expires_at: datetime = Field(description="When its lease runs out unless renewed.", examples=[_EXPIRES])


class Problem(BaseModel):
    """An RFC 9457 problem (application/problem+json); some problems add the fields below."""

    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "examples": [
                {
                    "type": "urn:helix-locks:problem:lock-held",
                    "title": "Lock held",
                    "status": 409,
                    "detail": "A live lock holds this organization and job type.",
                    "lock_id": 1,
                    "holder": "worker-7@host-3",
                    "expires_at": _EXPIRES,
                    "max_holders": 1,
                    "holders": [
                        {"lock_id": 1, "holder": "worker-7@host-3", "slot": 0, "expires_at": _EXPIRES}
                    ],
                    "holders_total": 1,
                },
                {
                    "type": "urn:helix-locks:problem:invalid-request",
                    "title": "Invalid request",
                    "status": 422,
                    "detail": "Invalid: job_type, ttl_seconds.",
                    "errors": [
                        {"field": "job_type", "message": "Field required"},
                        {"field": "ttl_seconds", "message": "Input should be less than or equal to 86400"},
                    ],
                },
            ]
        },
    )

    type: str = Field(
        description="The kind of problem, urn:helix-locks:problem:KIND; match on this, not on title.",
        examples=["urn:helix-locks:problem:lock-held"],
    )
    title: str = Field(description="A short summary of the problem kind.", examples=["Lock held"])
    status: int = Field(description="The HTTP status code.", examples=[409])
    detail: str = Field(
        description="What happened, for humans.",
        examples=["A live lock holds this organization and job type."],
    )
    errors: list[FieldError] | None = Field(
        default=None, description="422 only: each invalid field and what is wrong with it."
    )
    lock_id: int | None = Field(
        default=None, description="409 and 410: the lock concerned (for 409, the live one).", examples=[1]
    )
    holder: str | None = Field(
        default=None,
        description="409 only: who holds the live lock (of a semaphore, the one whose lease runs out first).",
        examples=["worker-7@host-3"],
    )
    holders: list[HolderBody] | None = Field(
        default=None,
        description=f"409 lock-held only: at most {HOLDERS_LISTED} held locks of the key, those whose"
        " leases run out first (by expires_at, then slot).",
    )
    holders_total: int | None = Field(
        default=None,
        description="409 lock-held only: how many locks hold the key, all of them, listed in holders or not.",
        examples=[3],
    )
    mode: Mode | None = Field(
        default=None,
        description="409 lock-held, and waiters-ahead of a held key: the mode of the held locks it met (a"
        " pair's live locks share one mode): exclusive, or shared (readers, which a writer waits for).",
        examples=["exclusive"],
    )
    max_holders: int | None = Field(
        default=None,
        description="409 only: the max_holders the key's held locks share (for max-holders-mismatch, the"
        " value in force).",
        examples=[3],
    )
    expires_at: datetime | None = Field(
        default=None,
        description="409 only: when the live lock's lease runs out unless renewed; Retry-After counts"
        " the whole seconds until then.",
        examples=[_EXPIRES],
    )
    release_reason: str | None = Field(
        default=None,
        description="410 only: how the lock ended: released, reclaimed or forced.",
        examples=["reclaimed"],
    )
    released_at: datetime | None = Field(
        default=None, description="410 only: when the lock ended.", examples=[_RECLAIMED_AT]
    )
    hold_limit_at: datetime | None = Field(
        default=None,
        description="410 hold-limit-reached only: the lock's hold limit, which has come.",
        examples=[_EXPIRES],
    )
    closed_until: datetime | None = Field(
        default=None,
        description="409 closed-until only: no lock of the organization and job type is granted before"
        " this time; Retry-After counts the whole seconds until then.",
        examples=[_EXPIRES],
    )
    preferred_holder: str | None = Field(
        default=None,
        description="409 reserved only: the holder the organization and job type is reserved for.",
        examples=["worker-9@host-1"],
    )
    deadline: datetime | None = Field(
        default=None,
        description="409 reserved only: the reservation's end; Retry-After counts the whole seconds"
        " until then.",
        examples=[_EXPIRES],
    )
    forced_by: str | None = Field(
        default=None,
        description="410 only: the id of the admin API key that broke the lock by force, else null.",
        examples=["3f9a0c1b2d4e"],
    )
    job_type: str | None = Field(
        default=None,
        description="409 to a session's call only: the job type of the first lock, in job type order,"
        " that could not be granted (none of the call's locks was).",
        examples=["nightly-report"],
    )
    session_id: int | None = Field(
        default=None,
        description="409 renew-the-session and 410 session-ended: the session concerned.",
        examples=[1],
    )
    end_reason: str | None = Field(
        default=None,
        description="410 session-ended only: released (by its holder) or lost (a lock of it was"
        " reclaimed or forced, and the rest were released).",
        examples=["lost"],
    )
    ended_at: datetime | None = Field(
        default=None, description="410 session-ended only: when the session ended.", examples=[_RECLAIMED_AT]
    )
    max_locks: int | None = Field(
        default=None, description="409 session-full only: how many locks a session may hold.", examples=[1000]
    )
    waiting: int | None = Field(
        default=None,
        description="409 waiters-ahead only: how many acquires wait in the pair's queue, and come first.",
        examples=[3],
    )


# Sessions (POST /v1/sessions and below): one lease that many locks share.
SESSION_LOCKS_PER_CALL = 32


class SessionLockRequest(BaseModel):
    """One lock a session asks for: its job type (in the session's organization)."""

    model_config = ConfigDict(extra="forbid")

    job_type: Annotated[
        Identifier,
        Field(description="The kind of job, as for an acquire.", examples=["partition-7"]),
    ]
    max_holders: MaxHolders = 1
    mode: ModeField = "exclusive"

    _shared_alone = field_validator("mode")(_one_holder_if_shared)


def _distinct_job_types(locks: list[SessionLockRequest]) -> list[SessionLockRequest]:
    if len({lock.job_type for lock in locks}) != len(locks):
        raise ValueError("each job type may be named once")
    return locks


SessionLocks = Annotated[
    list[SessionLockRequest],
    Field(
        max_length=SESSION_LOCKS_PER_CALL,
        description=f"0 to {SESSION_LOCKS_PER_CALL} locks of distinct job types, granted all together in"
        " one statement or none of them.",
    ),
    AfterValidator(_distinct_job_types),
]


class OpenSessionRequest(BaseModel):
    """Open a session: a lease that many locks share, with the locks named granted all or none."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "organization_id": "acme",
                    "holder": "worker-7@host-3",
                    "ttl_seconds": 30,
                    "locks": [{"job_type": "partition-1"}, {"job_type": "partition-2"}],
                }
            ]
        },
    )

    organization_id: Annotated[
        Identifier,
        Field(description="The organization of the session and all its locks.", examples=["acme"]),
    ]
    holder: Holder
    ttl_seconds: TtlSeconds
    metadata: Metadata = None
    locks: SessionLocks = Field(default_factory=list)
    wait_seconds: Annotated[
        WaitSeconds,
        Field(
            description="Wait up to this many seconds until all the locks can be granted at once"
            " (none is held meanwhile); 409 when the wait runs out."
        ),
    ] = 0
    max_hold_seconds: Annotated[
        MaxHoldSeconds,
        Field(
            description="A hold limit in seconds, 1 to 604800, counted from the session's creation:"
            " no lease of the session, nor of any of its locks (those added later too), runs past"
            " hold_limit_at. Default: none."
        ),
    ] = None


class AddSessionLocksRequest(BaseModel):
    """Add locks to an open session, all or none, with the session's lease."""

    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"locks": [{"job_type": "partition-3"}]}]}
    )

    locks: Annotated[SessionLocks, Field(min_length=1)]
    wait_seconds: Annotated[
        WaitSeconds,
        Field(description="Wait up to this many seconds until all the locks can be granted at once."),
    ] = 0


class SessionBody(BaseModel):
    """A session and its unreleased locks (in job type order)."""

    id: int = Field(description="The session's id; opaque to clients, use it as given.", examples=[1])
    organization_id: str = Field(description="The organization of the session.", examples=["acme"])
    holder: str = Field(description="Who holds it, and each of its locks.", examples=["worker-7@host-3"])
    expires_at: datetime = Field(
        description="When the lease of the session, and of each of its locks, runs out unless renewed.",
        examples=[_EXPIRES],
    )
    ttl_remaining_ms: int = Field(
        description="Milliseconds of lease left at answer time, by the database clock; 0 once it ran out.",
        examples=[29998],
    )
    state: Literal["held", "expired", "ended"] = Field(
        description="held: its lease runs; expired: it ran out (its locks may be reclaimed); ended.",
        examples=["held"],
    )
    locks: list[LockBody] = Field(description="Its unreleased locks, in job type order.")
    hold_limit_at: datetime | None = Field(
        default=None,
        description="Creation + max_hold_seconds: no lease of the session or of its locks runs past"
        " it, and after it no renewal is granted (410 hold-limit-reached); null without a hold limit.",
        examples=[None],
    )

    @classmethod
    def of(cls, session: Session) -> Self:
        return cls.model_validate(
            {
                **vars(session),
                "limited": session.limited,
                "locks": [LockBody.of(lock) for lock in session.locks],
            },
            from_attributes=True,
        )


class OpenedSessionBody(SessionBody):
    """An opened session, with the secret token that proves ownership of it and of its locks."""

    token: str = Field(
        description="The secret of the session and of each of its locks; shown only here. Send it as"
        " the Lock-Token header to renew or end the session, and to release or update one of its locks.",
        examples=["d060e87f866045a4bfda05db1917e1c5"],
    )


class SessionRenewalBody(SessionBody):
    """A renewed session: every lock of it now expires with it."""

    lapsed: bool = Field(
        description="Whether the session's lease had run out before this renewal (nobody had reclaimed"
        " a lock of it).",
        examples=[False],
    )
    limited: bool = Field(
        default=False,
        description="The new lease ends at the session's hold limit (hold_limit_at), sooner than"
        " ttl_seconds asked or just as it asked: no renewal takes it further.",
        examples=[False],
    )
