"""The bare app: the least a FastAPI + psycopg service does to run Helix's cycle, as the bench's
measure of what the stack itself costs (the "bare" side of `python -m bench.run`, and the floor of
`python -m bench.layers`).

The same statements as Helix (helix_locks.server.queries.ACQUIRE and RELEASE) on a database that
`helix-locks migrate` made, a psycopg pool of Helix's default sizes with statements prepared on
first use as Helix's are, pydantic bodies and pydantic-serialized answers (FastAPI's own path for
a response model; its ORJSONResponse is deprecated), 409 on 23505. No keys, logs, metrics, request
ids, body limit, deadlines or problem bodies; FastAPI's OpenTelemetry hooks off, as in Helix.
bench/servers.py starts it with the uvicorn flags that `helix-locks serve` uses:

    BARE_DATABASE_URL=... uvicorn bench.bare:app --workers 2 --http httptools \
        --no-access-log --no-server-header
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Annotated, Any

import psycopg
from fastapi import FastAPI, Header, HTTPException, Response
from psycopg.rows import DictRow, dict_row
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel, Field

from helix_locks.server import queries
from helix_locks.server.settings import Settings

DATABASE_URL = "BARE_DATABASE_URL"


class AcquireBody(BaseModel):
    organization_id: str = Field(min_length=1, max_length=128)
    job_type: str = Field(min_length=1, max_length=128)
    holder: str = Field(min_length=1, max_length=256)
    ttl_seconds: float = Field(gt=0, le=86_400)


class Granted(BaseModel):
    id: int
    token: str
    organization_id: str
    job_type: str
    holder: str
    fencing_token: int
    acquired_at: datetime
    expires_at: datetime


Pool = AsyncConnectionPool[psycopg.AsyncConnection[DictRow]]
pools: list[Pool] = []  # this worker process's one pool, while the app runs


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    sizes = Settings.model_fields  # Helix's defaults: HELIX_LOCKS_POOL_MIN_SIZE and _MAX_SIZE
    pool = Pool(
        os.environ[DATABASE_URL],
        min_size=sizes["pool_min_size"].default,
        max_size=sizes["pool_max_size"].default,
        kwargs={"autocommit": True, "row_factory": dict_row, "prepare_threshold": 0},
        open=False,
    )
    await pool.open(wait=True)
    pools.append(pool)
    try:
        yield
    finally:
        pools.remove(pool)
        await pool.close()


app = FastAPI(lifespan=lifespan, telemetry={"tracing": False, "metrics": False, "logs": False})


@app.post("/v1/locks", status_code=201)
async def acquire(body: AcquireBody) -> Granted:
    params: dict[str, Any] = {
        "organization_id": body.organization_id,
        "job_type": body.job_type,
        "holder": body.holder,
        "ttl_ms": round(body.ttl_seconds * 1000),
        "metadata": None,
        "idempotency_key": None,
        "max_holders": 1,
    }
    async with pools[0].connection() as conn:
        try:
            row = await (await conn.execute(queries.ACQUIRE, params)).fetchone()
        except psycopg.errors.UniqueViolation:
            raise HTTPException(409, "held") from None
    assert row is not None, "helix_acquire_job_lock returns a row or raises"
    return Granted.model_validate(row)


@app.delete("/v1/locks/{lock_id}", status_code=204)
async def release(lock_id: int, token: Annotated[str, Header(alias="Lock-Token")]) -> Response:
    """Any error of the function (a wrong token, a lock already ended) is a 500 here: the bench
    sends none."""
    async with pools[0].connection() as conn:
        await conn.execute(queries.RELEASE, {"lock_id": lock_id, "token": token, "scope": None})
    return Response(status_code=204)


@app.get("/readyz")
async def readyz() -> dict[str, str]:
    return {"status": "ready"}
