"""The HTTP routes: thin adapters from requests to lock operations and back."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service import migrate
from service.errors import InvalidArgument, LockNotFound
from service.keys import Caller, KeyRing
from service.locks import Locks, State
from service.schemas import (
    AcquireRequest,
    GrantBody,
    Identifier,
    LockBody,
    PageBody,
    Problem,
    RenewalBody,
    RenewRequest,
    ttl_ms,
)

BIGINT_MAX = 2**63 - 1


# Dependencies are async: FastAPI runs plain `def` ones in a thread pool, a hop per request.
async def get_locks(request: Request) -> Locks:
    locks: Locks = request.app.state.locks
    return locks


async def lock_id(lock_id: Annotated[str, Path(description="The id an acquire returned.")]) -> int:
    """Ids are opaque to clients: anything that is not one of ours is simply not found."""
    if (
        not (lock_id.isascii() and lock_id.isdigit() and len(lock_id) <= 19)
        or not 0 < int(lock_id) <= BIGINT_MAX
    ):
        raise LockNotFound()
    return int(lock_id)


bearer = HTTPBearer(auto_error=False, description="An API key: Authorization: Bearer hlk_...")


async def authenticate(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]
) -> Caller:
    """Who is asking (the key ring reads the header itself; `bearer` documents it in OpenAPI)."""
    keys: KeyRing = request.app.state.keys
    return await keys.authenticate(request.headers.get("authorization"))


LocksDep = Annotated[Locks, Depends(get_locks)]
CallerDep = Annotated[Caller, Depends(authenticate)]
LockId = Annotated[int, Depends(lock_id)]
LockToken = Annotated[str, Header(alias="Lock-Token", description="The token the acquire returned.")]


def _problems(*statuses: int) -> dict[int | str, dict[str, object]]:
    return {status: {"model": Problem, "content": {"application/problem+json": {}}} for status in statuses}


router = APIRouter(prefix="/v1", tags=["locks"])


@router.post("/locks", status_code=201, responses=_problems(401, 403, 409, 413, 422, 503))
async def acquire(body: AcquireRequest, locks: LocksDep, caller: CallerDep, response: Response) -> GrantBody:
    """Acquire the lock for (organization_id, job_type), reclaiming it if its lease ran out."""
    grant = await locks.acquire(
        caller, body.organization_id, body.job_type, body.holder, ttl_ms(body.ttl_seconds), body.metadata
    )
    response.headers["Location"] = f"/v1/locks/{grant.lock.id}"
    return GrantBody.of_grant(grant)


@router.get("/locks", responses=_problems(401, 422, 503))
async def list_locks(
    locks: LocksDep,
    caller: CallerDep,
    organization_id: Identifier | None = None,
    job_type: Identifier | None = None,
    state: Annotated[
        State | None,
        Query(description="held or expired (default: both); released or reclaimed read history."),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
    cursor: Annotated[str | None, Query(max_length=2048)] = None,
) -> PageBody:
    """Locks not yet released in key order, or ended locks newest first."""
    page = await locks.list(
        caller, organization_id=organization_id, job_type=job_type, state=state, limit=limit, cursor=cursor
    )
    return PageBody(items=[LockBody.of(lock) for lock in page.items], next_cursor=page.next_cursor)


@router.get("/locks/current", responses=_problems(401, 404, 422, 503))
async def current(
    locks: LocksDep, caller: CallerDep, organization_id: Identifier, job_type: Identifier
) -> LockBody:
    """The lock held now for the key (404 when none is, a lapsed lease included)."""
    return LockBody.of(await locks.current(caller, organization_id, job_type))


@router.get("/locks/{lock_id}", responses=_problems(401, 404, 503))
async def get_lock(locks: LocksDep, caller: CallerDep, lock_id: LockId) -> LockBody:
    """One lock, in any state."""
    return LockBody.of(await locks.get(caller, lock_id))


@router.delete("/locks/{lock_id}", status_code=204, responses=_problems(401, 403, 404, 410, 422, 503))
async def release(
    locks: LocksDep,
    caller: CallerDep,
    lock_id: LockId,
    token: Annotated[
        str | None, Header(alias="Lock-Token", description="The token the acquire returned.")
    ] = None,
    force: Annotated[bool, Query(description="Break the lock without its token (admin keys).")] = False,
) -> Response:
    """Release a lock you hold; 410 tells you it had already ended."""
    if force:
        await locks.force_release(caller, lock_id)
    elif token is None:
        raise InvalidArgument("Lock-Token", "Field required")
    else:
        await locks.release(caller, lock_id, token)
    return Response(status_code=204)


@router.post("/locks/{lock_id}/renew", responses=_problems(401, 403, 404, 410, 422, 503))
async def renew(
    locks: LocksDep, caller: CallerDep, lock_id: LockId, token: LockToken, body: RenewRequest
) -> RenewalBody:
    """Extend the lease to database-now + ttl_seconds; works on a lapsed lease nobody reclaimed."""
    return RenewalBody.of_renewal(await locks.renew(caller, lock_id, token, ttl_ms(body.ttl_seconds)))


health = APIRouter(tags=["service"])


@health.get("/healthz")
async def healthz() -> dict[str, Literal["ok"]]:
    """The process is alive."""
    return {"status": "ok"}


@health.get("/readyz", responses=_problems(503))
async def readyz(locks: LocksDep) -> dict[str, Literal["ready"]]:
    """The database answers and every migration of this build is applied."""
    await migrate.check_ready(locks.db)
    return {"status": "ready"}
