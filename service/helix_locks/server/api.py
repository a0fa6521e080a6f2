"""The HTTP routes: thin adapters from requests to lock operations and back."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal, ParamSpec, TypedDict, TypeVar
from urllib.parse import SplitResult, urlsplit

from fastapi import APIRouter, Header, Path, Query, Request, Response
from fastapi.responses import PlainTextResponse, StreamingResponse
from fastapi.security import HTTPBearer
from pydantic import BaseModel

from helix_locks.server import logs, problems, query
from helix_locks.server.errors import (
    ClosedUntil,
    DatabaseUnavailable,
    EventsExpired,
    Forbidden,
    HoldLimitReached,
    InvalidArgument,
    InvalidRequest,
    LockEnded,
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
    TokenMismatch,
    TooManySessions,
    TooManyWaiters,
    TooManyWatchers,
    Unauthenticated,
    UnsupportedMediaType,
    WaitersAhead,
    WaitInterrupted,
)
from helix_locks.server.events import EventHub
from helix_locks.server.keys import ANONYMOUS, Caller, KeyRing
from helix_locks.server.locks import Grant, Locks, Place, State, Wanted
from helix_locks.server.outcome import Outcome, outcome
from helix_locks.server.schemas import (
    AcquireRequest,
    AddSessionLocksRequest,
    GrantBody,
    Identifier,
    LockBody,
    OpenedSessionBody,
    OpenSessionRequest,
    PageBody,
    PlaceBody,
    QueuePageBody,
    RenewalBody,
    RenewRequest,
    RevocationRequest,
    SessionBody,
    SessionLockRequest,
    SessionRenewalBody,
    UpdateRequest,
    ttl_ms,
)
from helix_locks.server.sessions import Session, Sessions
from helix_locks.server.telemetry import Metrics
from helix_locks.server.waiting import Waiters

BIGINT_MAX = 2**63 - 1
T = TypeVar("T")
P = ParamSpec("P")
IDEMPOTENCY_KEY_PATTERN = r"^[\x21-\x7e]{1,255}$"


@dataclass(frozen=True)
class Services:
    """What the routes work with: made by the app's lifespan, handed to every request in its state."""

    locks: Locks
    sessions: Sessions
    keys: KeyRing
    waiters: Waiters
    events: EventHub
    metrics: Metrics
    # The database answers and this build's migrations are applied; else DatabaseUnavailable or
    # SchemaNotReady (app.py composes it from migrate.py: routes reach the database only through
    # the services above).
    ready: Callable[[], Awaitable[None]]
    # Refresh the metrics read from the database and the pool before a scrape.
    sample: Callable[[], Awaitable[None]]
    anonymous_any_host: bool  # without keys, answer requests addressed to any host name


class LifespanState(TypedDict):
    """The lifespan's state (starlette copies it into every request's)."""

    services: Services


def services(request: Request) -> Services:
    found: Services = request.state.services
    return found


@dataclass(frozen=True)
class Authorized:
    """An authenticated request: who is asking, and this process's lock operations."""

    caller: Caller
    locks: Locks


bearer = HTTPBearer(auto_error=False, description="An API key: Authorization: Bearer hlk_...")
# The lock routes call authorized() themselves rather than declare Security(bearer): FastAPI
# solves a dependency anew on every request, which costs CPU on every request (docs/performance.md).
# So the document gets the scheme from here (app.py adds it).
BEARER_REQUIRED: dict[str, Any] = {"security": [{bearer.scheme_name: []}]}
SECURITY_SCHEMES = {
    bearer.scheme_name: bearer.model.model_dump(mode="json", by_alias=True, exclude_none=True)
}


async def authorized(request: Request) -> Authorized:
    """The caller the request's API key names (Unauthenticated if none), and the lock operations."""
    found = services(request)
    caller = await found.keys.authenticate(request.headers.get("authorization"))
    if caller is ANONYMOUS:
        _from_this_machine(request, found.anonymous_any_host)
    logs.bind(key_id=caller.key_id)
    return Authorized(caller, found.locks)


def _from_this_machine(request: Request, any_host: bool) -> None:
    """Without API keys, the port is the only barrier, and a web page in a browser on this
    machine can reach it: refuse what only such a page would send.
    - A Host other than a loopback name: DNS rebinding (attacker.example resolved to 127.0.0.1
      after the page loaded, so the page reads our answers as its own origin's).
    - An Origin other than a loopback one: another site's page, sending without reading.
    - A body not declared JSON: a page may send text/plain or a form without asking first,
      while application/json needs a CORS preflight, which this service never grants.
    """
    headers = request.headers
    host = _authority(headers.get("host", ""))
    if host is None or not (any_host or host.hostname is None or _loopback_name(host.hostname)):
        raise Forbidden(
            "Without API keys this service answers only requests addressed to a loopback name "
            f"(localhost, 127.0.0.1, [::1]), not to {headers.get('host', '')[:100]!r}: create an API key "
            "to serve others."
        )
    origin = headers.get("origin")
    if origin is not None:
        source = _authority(origin, url=True)
        same = any_host and source is not None and source.netloc == headers.get("host")
        if not (same or (source is not None and source.hostname and _loopback_name(source.hostname))):
            raise Forbidden(
                "Without API keys this service answers no requests from web pages of another origin "
                f"({origin[:100]!r})."
            )
    if request.method in ("POST", "PUT", "PATCH") and not declared_json(headers.get("content-type")):
        raise UnsupportedMediaType()


# host[:port] and nothing else: no user (evil.example@localhost), no path, no spaces.
_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]*)(:[0-9]{1,5})?")


def _authority(value: str, url: bool = False) -> SplitResult | None:
    """A Host header (or, with url, an Origin) taken apart; None unless it is host[:port] alone."""
    try:
        parts = urlsplit(value if url else f"//{value}")
    except ValueError:  # such as an unclosed [
        return None
    if not _HOST.fullmatch(parts.netloc) or parts.path or parts.query or parts.fragment:
        return None
    return parts


def _loopback_name(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def declared_json(content_type: str | None) -> bool:
    """Whether a Content-Type says JSON (application/json, or a +json type)."""
    media_type = (content_type or "").split(";")[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")


LockIdPath = Annotated[str, Path(description="The id an acquire returned.")]
LockToken = Annotated[str, Header(alias="Lock-Token", description="The token the acquire returned.")]


def known_lock_id(lock_id: str) -> int:
    """Ids are opaque to clients: anything that is not one of ours is simply not found."""
    if (
        not (lock_id.isascii() and lock_id.isdigit() and len(lock_id) <= 19)
        or not 0 < int(lock_id) <= BIGINT_MAX
    ):
        raise LockNotFound()
    logs.bind(lock_id=int(lock_id))
    return int(lock_id)


def json_body(body: BaseModel, status_code: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    """The body serialized once, by pydantic; the route's response_model documents it."""
    return Response(body.model_dump_json(), status_code, headers, media_type="application/json")


router = APIRouter(prefix="/v1", tags=["locks"], route_class=query.Route)


def scoped_key(caller: Caller, idempotency_key: str | None) -> str | None:
    """An Idempotency-Key as the database keeps it: scoped to the caller's API key, so that another
    key's repeat is a different request."""
    return None if idempotency_key is None else f"{caller.key_id or 'anonymous'}/{idempotency_key}"


@router.post(
    "/locks",
    status_code=201,
    response_model=GrantBody,
    summary="Acquire a lock",
    operation_id="acquireLock",
    openapi_extra=BEARER_REQUIRED,
    response_description="The lock, granted to you; Location names it.",
    responses={
        201: {"headers": {"Location": {"description": "/v1/locks/{id}", "schema": {"type": "string"}}}},
        **problems.responses(
            Unauthenticated,
            Forbidden,
            LockHeld,
            WaitersAhead,
            ClosedUntil,
            Reserved,
            MaxHoldersMismatch,
            UnsupportedMediaType,
            InvalidRequest,
            OrganizationWaitersFull,
            QuotaExceeded,
            DatabaseUnavailable,
            TooManyWaiters,
            WaitInterrupted,
        ),
    },
)
async def acquire(
    body: AcquireRequest,
    request: Request,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            pattern=IDEMPOTENCY_KEY_PATTERN,
            description="Repeat an acquire with the same key while its lock is live, and get the same "
            "lock and token back (201), not 409: for retries after a lost answer. 1 to 255 visible "
            "ASCII characters; scoped to the organization and job type, ending with the lock.",
        ),
    ] = None,
) -> Response:
    """Acquire the lock for (organization_id, job_type), reclaiming it if its lease ran out."""
    session = await authorized(request)
    answered = outcome(request.scope)
    answered.about(body.organization_id, body.job_type)
    logs.bind(holder=body.holder)
    locks, caller = session.locks, session.caller

    async def attempt(place: Place | None = None) -> Grant:
        return await locks.acquire(
            caller,
            body.organization_id,
            body.job_type,
            body.holder,
            ttl_ms(body.ttl_seconds),
            body.metadata,
            scoped_key(caller, idempotency_key),
            waiting=body.wait_seconds > 0,
            max_holders=body.max_holders,
            place=place,
            mode=body.mode,
            max_hold_ms=None if body.max_hold_seconds is None else ttl_ms(body.max_hold_seconds),
            hold_at_least_ms=None
            if body.hold_at_least_seconds is None
            else ttl_ms(body.hold_at_least_seconds),
        )

    try:
        if body.wait_seconds > 0:
            # Before queueing: another organization's waiting slots and line are not this key's to take.
            caller.may_act_in(body.organization_id)
            grant = await _wait_for(
                request, body, attempt, locks, caller, scoped_key(caller, idempotency_key)
            )
        else:
            grant = await attempt()
    except LockHeld as held:
        if held.max_holders > 1:  # every slot of a semaphore held: counted apart from a conflict
            answered.result = "full"
        raise
    logs.bind(lock_id=grant.lock.id, fencing_token=grant.lock.fencing_token)
    answered.result = "reclaimed" if grant.reclaimed else "granted"
    if grant.reclaimed:  # its worker died holding it, or stalled past its lease
        logs.bind(reclaimed_lock_id=grant.reclaimed.lock_id, reclaimed_holder=grant.reclaimed.holder)
    return json_body(GrantBody.of_grant(grant), 201, {"Location": f"/v1/locks/{grant.lock.id}"})


async def _wait_for(
    request: Request,
    body: AcquireRequest,
    attempt: Callable[[Place | None], Awaitable[Grant]],
    locks: Locks,
    caller: Caller,
    idempotency_key: str | None,
) -> Grant:
    """Acquire, waiting up to wait_seconds; a client that leaves is dropped, any grant it got
    released. A retry with the same (scoped) idempotency key takes over the place of the try it
    repeats."""

    async def release(grant: Grant) -> None:
        # Unless the client's retry (same Idempotency-Key, maybe through another replica) was
        # handed this grant meanwhile: then it is the retry's to keep.
        await locks.release_unclaimed(caller, grant.lock.id, grant.token)

    found = services(request)
    async with _client_gone(request) as gone:
        return await found.waiters.acquire(
            (body.organization_id, body.job_type),
            body.wait_seconds,
            _still_allowed(request, attempt),
            locks.remaining_ms,
            release,
            gone,
            # A place for as long as this request may wait, and a second: it is left when the
            # wait ends, and lapses sooner if this process dies first.
            lambda: locks.queued(
                body.organization_id,
                [(body.job_type, body.max_holders, body.mode)],
                body.holder,
                body.wait_seconds + 1,
                found.waiters.replica,
                idempotency_key,
            ),
        )


@asynccontextmanager
async def _client_gone(request: Request) -> AsyncIterator[asyncio.Future[None]]:
    """A future done once the client of this (waiting) request has gone away."""
    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone.set_result(None)

    watcher = asyncio.create_task(watch())
    try:
        yield gone
    finally:
        watcher.cancel()


def _still_allowed(request: Request, attempt: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """attempt, each time after checking the request's key again: a key revoked while its request
    waits is refused before the next attempt, not granted."""
    keys, authorization = services(request).keys, request.headers.get("authorization")

    async def attempt_if_still_allowed(*args: P.args, **kwargs: P.kwargs) -> T:
        await keys.authenticate(authorization)
        return await attempt(*args, **kwargs)

    return attempt_if_still_allowed


@router.get(
    "/locks",
    response_model=PageBody,
    summary="List locks",
    operation_id="listLocks",
    openapi_extra=BEARER_REQUIRED,
    response_description="One page of locks.",
    responses=problems.responses(Unauthenticated, Forbidden, InvalidRequest, DatabaseUnavailable),
)
async def list_locks(
    request: Request,
    organization_id: Identifier | None = None,
    job_type: Identifier | None = None,
    state: Annotated[
        State | None,
        Query(description="held or expired (default: both); released or reclaimed read history."),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=500, description="At most this many locks, 1 to 500.")] = 100,
    cursor: Annotated[
        str | None,
        Query(max_length=2048, description="The next_cursor of the previous page, with the same filters."),
    ] = None,
) -> Response:
    """Locks not yet released in key order, or ended locks newest first."""
    session = await authorized(request)
    page = await session.locks.list(
        session.caller,
        organization_id=organization_id,
        job_type=job_type,
        state=state,
        limit=limit,
        cursor=cursor,
    )
    return json_body(PageBody(items=[LockBody.of(lock) for lock in page.items], next_cursor=page.next_cursor))


@router.get(
    "/locks/current",
    response_model=LockBody,
    summary="The lock held now for a key",
    operation_id="currentLock",
    openapi_extra=BEARER_REQUIRED,
    response_description="The held lock; check its fencing_token.",
    responses=problems.responses(
        Unauthenticated, Forbidden, LockNotFound, InvalidRequest, DatabaseUnavailable
    ),
)
async def current(
    request: Request,
    organization_id: Identifier,
    job_type: Identifier,
    slot: Annotated[
        int | None,
        Query(
            ge=0,
            le=999,
            description="Of a semaphore (max_holders > 1): the lock held in this slot. Without it: the"
            " held lock with the highest fencing token.",
        ),
    ] = None,
) -> Response:
    """The lock held now for the key (404 when none is, a lapsed lease included)."""
    session = await authorized(request)
    lock = await session.locks.current(session.caller, organization_id, job_type, slot)
    return json_body(LockBody.of(lock))


@router.get(
    "/locks/queue",
    response_model=QueuePageBody,
    summary="The queue of a key",
    operation_id="lockQueue",
    openapi_extra=BEARER_REQUIRED,
    response_description="One page of the acquires waiting for the key, first come first.",
    responses=problems.responses(Unauthenticated, Forbidden, InvalidRequest, DatabaseUnavailable),
)
async def lock_queue(
    request: Request,
    organization_id: Identifier,
    job_type: Identifier,
    limit: Annotated[int, Query(ge=1, le=500, description="At most this many places, 1 to 500.")] = 100,
    cursor: Annotated[
        str | None,
        Query(max_length=2048, description="The next_cursor of the previous page, with the same key."),
    ] = None,
) -> Response:
    """The acquires waiting for the key (wait_seconds), in the order they will be granted."""
    session = await authorized(request)
    rows, next_cursor = await session.locks.queue(session.caller, organization_id, job_type, limit, cursor)
    items = [
        PlaceBody(
            holder=row["holder"],
            max_holders=row["max_holders"],
            mode="shared" if row["shared"] else "exclusive",
            waiting_since=row["waiting_since"],
            wait_until=row["until"],
            position=row["position"],
        )
        for row in rows
    ]
    return json_body(QueuePageBody(items=items, next_cursor=next_cursor))


@router.get(
    "/locks/{lock_id}",
    response_model=LockBody,
    summary="Get one lock",
    operation_id="getLock",
    openapi_extra=BEARER_REQUIRED,
    response_description="The lock.",
    responses=problems.responses(Unauthenticated, Forbidden, LockNotFound, DatabaseUnavailable),
)
async def get_lock(request: Request, lock_id: LockIdPath) -> Response:
    """One lock, in any state."""
    session = await authorized(request)
    return json_body(LockBody.of(await session.locks.get(session.caller, known_lock_id(lock_id))))


@router.delete(
    "/locks/{lock_id}",
    status_code=204,
    summary="Release a lock",
    operation_id="releaseLock",
    openapi_extra=BEARER_REQUIRED,
    response_description="Released (also when its lease had lapsed but nobody had reclaimed it).",
    responses=problems.responses(
        Unauthenticated,
        Forbidden,
        TokenMismatch,
        LockNotFound,
        LockEnded,
        InvalidRequest,
        DatabaseUnavailable,
    ),
)
async def release(
    request: Request,
    lock_id: LockIdPath,
    token: Annotated[
        str | None, Header(alias="Lock-Token", description="The token the acquire returned.")
    ] = None,
    force: Annotated[bool, Query(description="Break the lock without its token (admin keys).")] = False,
) -> Response:
    """Release a lock you hold; 410 tells you it had already ended."""
    session = await authorized(request)
    answered = outcome(request.scope)
    locks, caller, id_ = session.locks, session.caller, known_lock_id(lock_id)
    if force:
        lock = await locks.force_release(caller, id_)
    elif token is None:
        raise InvalidArgument("Lock-Token", "Field required")
    else:
        async with _naming_the_lock(answered):
            lock = await locks.release(caller, id_, token)
    answered.about(lock.organization_id, lock.job_type)
    answered.result = "forced" if force else "released"
    return Response(status_code=204)


# What a holder's renew and update may answer (release, which takes no body, lists its own).
HOLDER_PROBLEMS = problems.responses(
    Unauthenticated,
    Forbidden,
    TokenMismatch,
    LockNotFound,
    LockEnded,
    UnsupportedMediaType,
    InvalidRequest,
    DatabaseUnavailable,
)


@router.post(
    "/locks/{lock_id}/renew",
    response_model=RenewalBody,
    summary="Renew a lease (heartbeat)",
    operation_id="renewLock",
    openapi_extra=BEARER_REQUIRED,
    response_description="The lock with its new expires_at; lapsed says whether the lease had run out.",
    responses={**HOLDER_PROBLEMS, **problems.responses(RenewTheSession, HoldLimitReached)},
)
async def renew(request: Request, lock_id: LockIdPath, token: LockToken, body: RenewRequest) -> Response:
    """Extend the lease to database-now + ttl_seconds; works on a lapsed lease nobody reclaimed. A
    lock of a session is renewed with its session (409 renew-the-session)."""
    session = await authorized(request)
    answered = outcome(request.scope)
    id_ = known_lock_id(lock_id)
    async with _naming_the_lock(answered):
        renewal = await session.locks.renew(session.caller, id_, token, ttl_ms(body.ttl_seconds))
    answered.about(renewal.lock.organization_id, renewal.lock.job_type)
    answered.result = "renewed"
    logs.bind(lapsed=renewal.lapsed, limited=renewal.limited)
    return json_body(RenewalBody.of_renewal(renewal))


@router.patch(
    "/locks/{lock_id}",
    response_model=LockBody,
    summary="Update a held lock's metadata",
    operation_id="updateLock",
    openapi_extra=BEARER_REQUIRED,
    response_description="The lock with its new metadata; the lease is as it was.",
    responses=HOLDER_PROBLEMS,
)
async def update(request: Request, lock_id: LockIdPath, token: LockToken, body: UpdateRequest) -> Response:
    """Replace the metadata of a lock you hold, to publish progress or an address; works on a
    lapsed lease nobody reclaimed, and does not renew it."""
    session = await authorized(request)
    answered = outcome(request.scope)
    id_ = known_lock_id(lock_id)
    async with _naming_the_lock(answered):
        lock = await session.locks.update(session.caller, id_, token, body.metadata)
    answered.about(lock.organization_id, lock.job_type)
    answered.result = "updated"
    return json_body(LockBody.of(lock))


@router.post(
    "/locks/{lock_id}/revocation",
    status_code=202,
    response_model=LockBody,
    summary="Ask a lock's holder to let go",
    operation_id="requestRevocation",
    openapi_extra=BEARER_REQUIRED,
    response_description="The request is recorded in the lock (the first one only: a repeat changes"
    " nothing), sent as a revocation-requested event, and answered to the holder's next renewal.",
    responses=problems.responses(
        Unauthenticated,
        Forbidden,
        LockNotFound,
        LockEnded,
        UnsupportedMediaType,
        InvalidRequest,
        DatabaseUnavailable,
    ),
)
async def request_revocation(request: Request, lock_id: LockIdPath, body: RevocationRequest) -> Response:
    """Ask the holder of a live lock of your organization (any, for an admin key) to release it by
    the deadline. Nothing is forced: after the deadline an admin may force the release. With
    preferred_holder, the pair is reserved for that holder once released, until the deadline."""
    session = await authorized(request)
    answered = outcome(request.scope)
    lock = await session.locks.request_revocation(
        session.caller,
        known_lock_id(lock_id),
        body.reason,
        ttl_ms(body.deadline_seconds),
        body.preferred_holder,
    )
    answered.about(lock.organization_id, lock.job_type)
    answered.result = "revocation-requested"
    return json_body(LockBody.of(lock), 202)


SessionIdPath = Annotated[str, Path(description="The id POST /v1/sessions returned.")]
SessionToken = Annotated[str, Header(alias="Lock-Token", description="The session's token.")]


def known_session_id(session_id: str) -> int:
    """As lock ids: anything that is not one of ours is simply not found."""
    try:
        found = known_lock_id(session_id)
    except LockNotFound:
        raise SessionNotFound() from None
    logs.bind(session_id=found)
    return found


def _wanted(locks: list[SessionLockRequest]) -> Wanted:
    return [(lock.job_type, lock.max_holders, lock.mode) for lock in locks]


# What a session's grant may answer besides its own problems: the refusals of its pairs.
SESSION_GRANT_PROBLEMS = (
    LockHeld,
    WaitersAhead,
    ClosedUntil,
    Reserved,
    MaxHoldersMismatch,
    QuotaExceeded,
    SessionFull,
)


@router.post(
    "/sessions",
    status_code=201,
    response_model=OpenedSessionBody,
    summary="Open a session",
    operation_id="openSession",
    openapi_extra=BEARER_REQUIRED,
    response_description="The session, its token and its locks; Location names it.",
    responses={
        201: {"headers": {"Location": {"description": "/v1/sessions/{id}", "schema": {"type": "string"}}}},
        **problems.responses(
            Unauthenticated,
            Forbidden,
            *SESSION_GRANT_PROBLEMS,
            TooManySessions,
            UnsupportedMediaType,
            InvalidRequest,
            DatabaseUnavailable,
        ),
    },
)
async def open_session(
    body: OpenSessionRequest,
    request: Request,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            pattern=IDEMPOTENCY_KEY_PATTERN,
            description="Repeat an open with the same key while its session is open, and get the same"
            " session, token and locks back (201): for retries after a lost answer.",
        ),
    ] = None,
) -> Response:
    """Open a session: one lease that many locks share. The locks named are granted all together
    in one statement, each reclaiming an expired predecessor, or none is (409 naming the first job
    type, in job type order, that could not be granted)."""
    session = await authorized(request)
    answered = outcome(request.scope)
    answered.about(body.organization_id, None)
    logs.bind(holder=body.holder)
    caller, sessions = session.caller, services(request).sessions
    key = scoped_key(caller, idempotency_key)

    async def attempt(place: Place | None = None) -> Session:
        return await sessions.open(
            caller,
            body.organization_id,
            body.holder,
            ttl_ms(body.ttl_seconds),
            body.metadata,
            key,
            _wanted(body.locks),
            place,
            None if body.max_hold_seconds is None else ttl_ms(body.max_hold_seconds),
        )

    async def release(opened: Session) -> None:
        # Unless a retry with its Idempotency-Key may come for it: then it lapses, unclaimed.
        if key is None:
            with contextlib.suppress(SessionEnded):
                await sessions.close(caller, opened.id, opened.token)

    if body.wait_seconds > 0 and body.locks:
        caller.may_act_in(body.organization_id)
        opened = await _wait_for_set(
            request, body.organization_id, body.wait_seconds, attempt, release, body.locks, body.holder, key
        )
    else:
        opened = await attempt()
    logs.bind(session_id=opened.id)
    answered.result = "opened"
    return json_body(OpenedSessionBody.of(opened), 201, {"Location": f"/v1/sessions/{opened.id}"})


# What a session's holder's calls may answer.
SESSION_HOLDER_PROBLEMS = (
    Unauthenticated,
    Forbidden,
    TokenMismatch,
    SessionNotFound,
    SessionEnded,
    InvalidRequest,
    DatabaseUnavailable,
)


@router.post(
    "/sessions/{session_id}/locks",
    status_code=201,
    response_model=SessionBody,
    summary="Add locks to a session",
    operation_id="addSessionLocks",
    openapi_extra=BEARER_REQUIRED,
    response_description="The session, with the locks this call added.",
    responses=problems.responses(
        *SESSION_HOLDER_PROBLEMS, *SESSION_GRANT_PROBLEMS, SessionLapsed, UnsupportedMediaType
    ),
)
async def add_session_locks(
    request: Request,
    session_id: SessionIdPath,
    token: SessionToken,
    body: AddSessionLocksRequest,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            pattern=IDEMPOTENCY_KEY_PATTERN,
            description="Repeat the call with the same key while the session holds the locks it added,"
            " and get those locks back (201): for retries after a lost answer.",
        ),
    ] = None,
) -> Response:
    """Grant more locks to an open session, all together or none, with the session's lease."""
    session = await authorized(request)
    id_ = known_session_id(session_id)
    caller, found = session.caller, services(request)
    key = scoped_key(caller, idempotency_key)

    # The session's organization: the quota the grants count against, and where a wait listens.
    # An organization's key names it (a session of another one is not found all the same).
    organization_id = caller.scope or (await found.sessions.get(caller, id_)).organization_id

    async def attempt(place: Place | None = None) -> Session:
        return await found.sessions.add(caller, id_, token, organization_id, _wanted(body.locks), key, place)

    async def release(added: Session) -> None:
        if key is not None:  # a retry with its Idempotency-Key may come for them: they stay
            return
        for lock in added.locks:  # the client left: the locks it will never hear of go back
            with contextlib.suppress(LockEnded):
                await found.locks.release(caller, lock.id, token)

    if body.wait_seconds > 0:
        holder = (await found.sessions.get(caller, id_)).holder  # whom the queues show waiting
        added = await _wait_for_set(
            request, organization_id, body.wait_seconds, attempt, release, body.locks, holder, key
        )
    else:
        added = await attempt()
    outcome(request.scope).result = "added"
    return json_body(SessionBody.of(added), 201)


async def _wait_for_set(
    request: Request,
    organization_id: str,
    wait_seconds: float,
    attempt: Callable[[Place | None], Awaitable[Session]],
    release: Callable[[Session], Awaitable[None]],
    locks: list[SessionLockRequest],
    holder: str,
    idempotency_key: str | None,
) -> Session:
    """A session's locks, waiting up to wait_seconds until all of them can be granted at once,
    from a place in each of their queues; none is held meanwhile. A grant whose client left is
    released."""
    found = services(request)
    async with _client_gone(request) as gone:
        return await found.waiters.acquire_all(
            organization_id,
            wait_seconds,
            _still_allowed(request, attempt),
            found.locks.remaining_ms,
            release,
            gone,
            lambda: found.locks.queued(
                organization_id,
                _wanted(locks),
                holder,
                wait_seconds + 1,
                found.waiters.replica,
                idempotency_key,
            ),
        )


@router.post(
    "/sessions/{session_id}/renew",
    response_model=SessionRenewalBody,
    summary="Renew a session (one heartbeat for all its locks)",
    operation_id="renewSession",
    openapi_extra=BEARER_REQUIRED,
    response_description="The session with its new expires_at, which each of its locks shares.",
    responses=problems.responses(*SESSION_HOLDER_PROBLEMS, UnsupportedMediaType, HoldLimitReached),
)
async def renew_session(
    request: Request, session_id: SessionIdPath, token: SessionToken, body: RenewRequest
) -> Response:
    """Extend the lease of the session and of every lock of it to database-now + ttl_seconds, in
    one statement; works on a lapsed session none of whose locks was reclaimed. One that lost a
    lock ends instead, its other locks released: 410 session-ended, end_reason lost."""
    session = await authorized(request)
    id_ = known_session_id(session_id)
    renewed = await services(request).sessions.renew(session.caller, id_, token, ttl_ms(body.ttl_seconds))
    outcome(request.scope).result = "renewed"
    logs.bind(lapsed=renewed.lapsed, limited=renewed.limited)
    return json_body(SessionRenewalBody.of(renewed))


@router.delete(
    "/sessions/{session_id}",
    status_code=204,
    summary="End a session",
    operation_id="endSession",
    openapi_extra=BEARER_REQUIRED,
    response_description="Ended, its locks released (also when its lease had run out and nobody had"
    " reclaimed a lock of it).",
    responses=problems.responses(*SESSION_HOLDER_PROBLEMS),
)
async def end_session(request: Request, session_id: SessionIdPath, token: SessionToken) -> Response:
    """Release every lock of the session and end it, in one statement; 410 when it had ended, or
    had lost a lock (its other locks are released all the same)."""
    session = await authorized(request)
    id_ = known_session_id(session_id)
    await services(request).sessions.close(session.caller, id_, token)
    outcome(request.scope).result = "ended"
    return Response(status_code=204)


@router.get(
    "/sessions/{session_id}",
    response_model=SessionBody,
    summary="Get a session",
    operation_id="getSession",
    openapi_extra=BEARER_REQUIRED,
    response_description="The session and its unreleased locks.",
    responses=problems.responses(Unauthenticated, Forbidden, SessionNotFound, DatabaseUnavailable),
)
async def get_session(request: Request, session_id: SessionIdPath) -> Response:
    """A session, in any state, with its unreleased locks."""
    session = await authorized(request)
    found = await services(request).sessions.get(session.caller, known_session_id(session_id))
    return json_body(SessionBody.of(found))


EventId = Annotated[
    str | None, Query(max_length=4096, description="Resume after this event id (as Last-Event-ID).")
]


@router.get(
    "/events",
    summary="Watch locks as they change (Server-Sent Events)",
    operation_id="watchEvents",
    openapi_extra=BEARER_REQUIRED,
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "A text/event-stream: one event per change (acquired, renewed, updated,"
            " released, forced, expired, reclaimed), each with an id to resume from, its type as the"
            " event name, and data holding an EventBody (an AcquiredEventBody for acquired); a"
            " `: keep-alive` comment whenever the stream is quiet.",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        },
        **problems.responses(
            Unauthenticated,
            Forbidden,
            InvalidRequest,
            EventsExpired,
            OrganizationWatchersFull,
            TooManyWatchers,
            DatabaseUnavailable,
        ),
    },
)
async def watch_events(
    request: Request,
    organization_id: Identifier | None = None,
    job_type: Identifier | None = None,
    last_event_id: EventId = None,
    last_event_id_header: Annotated[
        str | None,
        Header(alias="Last-Event-ID", max_length=4096, description="Resume after this event id."),
    ] = None,
) -> StreamingResponse:
    """Every change of the locks the key may see, as it commits; resume from an event id on any
    replica. An organization key sees its own organization; an admin key every one."""
    session = await authorized(request)
    found = services(request)
    if organization_id is not None:
        outcome(request.scope).about(organization_id, job_type)
    watcher = await found.events.watch(
        session.caller,
        request.headers.get("authorization"),
        organization_id,
        job_type,
        last_event_id_header if last_event_id_header is not None else last_event_id,
    )
    outcome(request.scope).result = "watched"
    return StreamingResponse(
        found.events.stream(watcher),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@asynccontextmanager
async def _naming_the_lock(answered: Outcome) -> AsyncIterator[None]:
    """A holder told its lock ended (410) or given the wrong token (403): its log line and the
    lost-lock metric name the organization and job type too, which the database's answer carries."""
    try:
        yield
    except (LockEnded, TokenMismatch) as exc:
        if exc.organization_id is not None:
            answered.about(exc.organization_id, exc.job_type)
        raise


health = APIRouter(tags=["service"], route_class=query.Route)


@health.get("/healthz", summary="Liveness", operation_id="healthz", responses=problems.responses())
async def healthz() -> dict[str, Literal["ok"]]:
    """The process is alive."""
    return {"status": "ok"}


@health.get(
    "/readyz",
    summary="Readiness",
    operation_id="readyz",
    responses=problems.responses(DatabaseUnavailable, SchemaNotReady),
)
async def readyz(request: Request) -> dict[str, Literal["ready"]]:
    """The database answers and every migration of this build is applied."""
    await services(request).ready()
    return {"status": "ready"}


@health.get(
    "/metrics",
    summary="Metrics",
    operation_id="metrics",
    response_class=PlainTextResponse,
    openapi_extra=BEARER_REQUIRED,
    responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
        **problems.responses(Unauthenticated, Forbidden, DatabaseUnavailable),
    },
)
async def metrics(request: Request) -> PlainTextResponse:
    """Prometheus text format, for every worker process of this service. Once API keys exist,
    only with an admin key: labelled by organization, it names every one."""
    caller = (await authorized(request)).caller
    if not (caller.admin or caller is ANONYMOUS):
        raise Forbidden("Only an admin API key may read the metrics.")
    found = services(request)
    await found.sample()
    body, media_type = found.metrics.render()
    return PlainTextResponse(body, media_type=media_type)
