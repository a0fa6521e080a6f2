"""What the tests alone share (the benchmarks share harness/ with them): how a test's service
reaches its database (directly or through PgBouncer), the app in process, the thin path taken
out, and the mark of the browser tests."""

from __future__ import annotations

import fcntl
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psycopg
import pytest
from asgi_lifespan import LifespanManager
from fastapi import FastAPI
from psycopg.types.json import Jsonb

from harness.browser import CHROMEDRIVER, CHROMIUM
from harness.proxies import through
from helix_locks.server import hot
from helix_locks.server.embedded import DIRECT_DATABASE_URL
from helix_locks.server.settings import Settings

T = TypeVar("T")


def needs_chromium(test: T) -> T:
    """A test that drives Debian's chromium: a stage of its own (`scripts/test -m browser`), and
    skipped on a machine without it."""
    missing = not (CHROMIUM and CHROMEDRIVER)
    skip = pytest.mark.skipif(missing, reason="needs Debian's chromium and chromium-driver (apt-get)")
    return pytest.mark.browser(skip(test))


class Route:
    """How a service under test reaches its database: directly, or, when the session runs with
    HELIX_TEST_POOLER=pgbouncer, through PgBouncer in transaction mode, with the direct URL
    beside it (conftest sets pooler_port)."""

    pooler_port: int | None = None

    def database(self, db_url: str) -> dict[str, str]:
        if self.pooler_port is None:
            return {"database_url": db_url}
        return {"database_url": through(self.pooler_port, db_url), "direct_database_url": db_url}

    def settings(self, db_url: str, **overrides: Any) -> Settings:
        """The service's settings for a test's database."""
        return Settings(**{**self.database(db_url), **overrides})

    def env(self, db_url: str, **more: str) -> dict[str, str | None]:
        """The environment of a `serve` process for a test's database."""
        database = self.database(db_url)
        return {
            "DATABASE_URL": database["database_url"],
            DIRECT_DATABASE_URL: database.get("direct_database_url"),
            **more,
        }


ROUTE = Route()


@asynccontextmanager
async def in_process(app: FastAPI, **client: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the app in this process, inside its lifespan (whose state every request gets,
    as under uvicorn); base_url http://localhost unless given."""
    async with LifespanManager(app, startup_timeout=None, shutdown_timeout=None) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        client.setdefault("base_url", "http://localhost")
        async with httpx.AsyncClient(transport=transport, **client) as http:
            yield http


def without_thin_path(app: FastAPI) -> FastAPI:
    """`app` with the thin path of acquire, release and renew (server/hot.py) taken out of its
    middleware, so that FastAPI's routes answer those too. Before the app first starts."""
    thin: object = hot.HotRoutes
    app.user_middleware = [middleware for middleware in app.user_middleware if middleware.cls is not thin]
    return app


@contextmanager
def one_at_a_time(name: str) -> Iterator[None]:
    """Hold a lock of this machine named `name` (a file under the temporary directory), so that the
    workers of a parallel run do one at a time what cannot be done twice at once."""
    path = Path(tempfile.gettempdir()) / f"helix-tests-{name}.lock"
    with path.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


# jsonb keeps a number as numeric and writes it back whole: 1e308 as 309 digits, 1e-300 as 302
# characters. Each of these is 8,127 bytes as the service sends it, and over 350,000 as stored.
SWOLLEN = [{"a": [1e308] * 1160}, {"a": [1e-300] * 1160}]


def stored_bytes(conn: psycopg.Connection[Any], metadata: Any) -> int:
    """What metadata is as PostgreSQL stores it: jsonb::text, in bytes."""
    found = conn.execute("SELECT octet_length(%s::jsonb::text)", (Jsonb(metadata),)).fetchone()
    assert found is not None
    return int(found[0])


def exactly(conn: psycopg.Connection[Any], size: int) -> dict[str, Any]:
    """Metadata of `size` bytes as stored, its numbers far longer stored than sent."""
    metadata: dict[str, Any] = {"n": [1e16] * 100, "pad": ""}
    metadata["pad"] = "x" * (size - stored_bytes(conn, metadata))
    assert stored_bytes(conn, metadata) == size
    return metadata
