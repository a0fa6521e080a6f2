"""The HTTP edge's request and response bodies (pydantic); the domain uses plain dataclasses."""

from __future__ import annotations

import json
import math
from datetime import datetime
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from service.locks import Grant, Lock, Renewal, State, storable_text

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


def _check_json(value: Any, depth: int = 1) -> None:
    if depth > METADATA_MAX_DEPTH:
        raise ValueError(f"must be nested at most {METADATA_MAX_DEPTH} levels deep")
    if isinstance(value, str):
        _storable(value)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError("numbers must be finite")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_json(key, depth + 1)
            _check_json(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_json(item, depth + 1)


def _metadata(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is None:
        return None
    _check_json(value)
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    if size > METADATA_MAX_BYTES:
        raise ValueError(f"must be at most {METADATA_MAX_BYTES} bytes serialized, is {size}")
    return value


Holder = Annotated[
    str,
    StringConstraints(strict=True, min_length=1, max_length=256),
    AfterValidator(_storable),
    Field(description="Free text naming the worker for humans, e.g. worker-7@host-3."),
]
TtlSeconds = Annotated[
    float,
    Field(
        strict=True,
        ge=1,
        le=86400,
        allow_inf_nan=False,
        description="Lease length in seconds, 1 to 86400; fractions are kept to the millisecond.",
    ),
]
Metadata = Annotated[
    dict[str, Any] | None,
    AfterValidator(_metadata),
    Field(description="Any JSON object, at most 8 KiB serialized."),
]


def ttl_ms(ttl_seconds: float) -> int:
    """The lease in whole milliseconds, as the database takes it."""
    return round(ttl_seconds * 1000)


class AcquireRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    organization_id: Identifier
    job_type: Identifier
    holder: Holder
    ttl_seconds: TtlSeconds
    metadata: Metadata = None


class RenewRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ttl_seconds: TtlSeconds


class LockBody(BaseModel):
    """A lock in any state; times are RFC 3339 UTC, ttl_remaining_ms is the database's."""

    id: int
    organization_id: str
    job_type: str
    holder: str
    fencing_token: int
    acquired_at: datetime
    expires_at: datetime
    released_at: datetime | None
    release_reason: str | None
    state: State
    ttl_remaining_ms: int
    metadata: dict[str, Any] | None

    @classmethod
    def of(cls, lock: Lock) -> LockBody:
        return cls.model_validate(lock, from_attributes=True)


class ReclaimedBody(BaseModel):
    lock_id: int
    holder: str
    expired_at: datetime


class GrantBody(LockBody):
    token: str = Field(description="The secret that proves ownership; shown only here.")
    reclaimed: ReclaimedBody | None

    @classmethod
    def of_grant(cls, grant: Grant) -> GrantBody:
        fields = {**vars(grant.lock), "token": grant.token, "reclaimed": grant.reclaimed}
        return cls.model_validate(fields, from_attributes=True)


class RenewalBody(LockBody):
    lapsed: bool = Field(description="The lease had run out, unreclaimed, before this renewal.")

    @classmethod
    def of_renewal(cls, renewal: Renewal) -> RenewalBody:
        return cls.model_validate({**vars(renewal.lock), "lapsed": renewal.lapsed})


class PageBody(BaseModel):
    items: list[LockBody]
    next_cursor: str | None


class FieldError(BaseModel):
    field: str
    message: str


class Problem(BaseModel):
    """An RFC 9457 problem; some problems add fields (lock_id, holder, expires_at, errors…)."""

    model_config = ConfigDict(extra="allow")

    type: str
    title: str
    status: int
    detail: str
    errors: list[FieldError] | None = None
