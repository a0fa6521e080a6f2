"""What the tests alone share (the benchmarks share harness/ with them), so that no test file
imports another: how a test's service reaches its database (directly or through PgBouncer), the
app in process, the thin path taken out, the mark of the browser tests, metadata sized as stored,
the API's bodies and problems, /metrics read back, services with a fast event stream, and the
SDK's two clients called alike."""

from __future__ import annotations

import asyncio
import fcntl
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from concurrent.futures import Future
from contextlib import ExitStack, asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, TypeVar, cast

import httpx
import psycopg
import pytest
from asgi_lifespan import LifespanManager
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from psycopg.types.json import Jsonb

from harness.browser import CHROMEDRIVER, CHROMIUM
from harness.processes import running_service
from harness.proxies import through
from helix_locks import AsyncLockClient, Lease, LockClient, SessionLease
from helix_locks.server import hot
from helix_locks.server.embedded import DIRECT_DATABASE_URL
from helix_locks.server.settings import Settings

T = TypeVar("T")
Conn = psycopg.Connection[Any]
PROBLEM = "application/problem+json"


def needs_chromium(test: T) -> T:
    """A test that drives Debian's chromium: a stage of its own (`scripts/test -m browser`), and
    skipped on a machine without it."""
    missing = not (CHROMIUM and CHROMEDRIVER)
    skip = pytest.mark.skipif(missing, reason="needs Debian's chromium and chromium-driver (apt-get)")
    return cast(T, pytest.mark.browser(skip(test)))


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


# --- metadata sized as stored ------------------------------------------------------------------

# jsonb keeps a number as numeric and writes it back whole: 1e308 as 309 digits, 1e-300 as 302
# characters. Each of these is 8,127 bytes as the service sends it, and over 350,000 as stored.
SWOLLEN = [{"a": [1e308] * 1160}, {"a": [1e-300] * 1160}]


def stored_bytes(conn: Conn, metadata: Any) -> int:
    """What metadata is as PostgreSQL stores it: jsonb::text, in bytes."""
    found = conn.execute("SELECT octet_length(%s::jsonb::text)", (Jsonb(metadata),)).fetchone()
    assert found is not None
    return int(found[0])


def exactly(conn: Conn, size: int) -> dict[str, Any]:
    """Metadata of `size` bytes as stored, its numbers far longer stored than sent."""
    metadata: dict[str, Any] = {"n": [1e16] * 100, "pad": ""}
    metadata["pad"] = "x" * (size - stored_bytes(conn, metadata))
    assert stored_bytes(conn, metadata) == size
    return metadata


# --- the API's bodies and problems --------------------------------------------------------------


def lock_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "organization_id": "acme",
        "job_type": "nightly-report",
        "holder": "w1",
        "ttl_seconds": 30,
    }
    body.update(overrides)
    return {key: value for key, value in body.items() if value is not None}


async def acquire(client: httpx.AsyncClient, **overrides: Any) -> dict[str, Any]:
    response = await client.post("/v1/locks", json=lock_body(**overrides))
    assert response.status_code == 201, response.text
    grant: dict[str, Any] = response.json()
    return grant


def expire(conn: Conn, lock_id: int) -> None:
    """Move a lease into the past on the database clock (no sleeping)."""
    conn.execute(
        "UPDATE helix_job_locks SET acquired_at = acquired_at - interval '1 hour',"
        " expires_at = clock_timestamp() - interval '1 millisecond' WHERE id = %s",
        (lock_id,),
    )


ENDED_COLUMNS = (
    "organization_id, job_type, holder, token, metadata, fencing_token, acquired_at, expires_at,"
    " released_at, release_reason"
)


def insert_ended(conn: Conn, rows: str, params: tuple[object, ...] | None = None) -> None:
    """Ended locks in bulk, straight into helix_lock_history: `rows` is a SELECT of ENDED_COLUMNS'
    values, one row per lock. Each gets an id and slot 0 of 1, and is stamped as the view's trigger
    (helix_job_locks_written) stamps a lock granted and ended by one transaction; a tenth of the
    time that trigger takes row by row."""
    conn.execute(
        "INSERT INTO helix_lock_history (id, slot, max_holders, acquired_xid, changed_xid,"
        f" {ENDED_COLUMNS}) SELECT nextval('helix_lock_ids'), 0, 1, pg_current_xact_id(),"
        f" pg_current_xact_id(), r.* FROM ({rows}) AS r({ENDED_COLUMNS})",
        params,
    )


def assert_problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    problem: dict[str, Any] = response.json()
    assert problem["status"] == status
    assert {"type", "title", "detail"} <= problem.keys()
    assert "Traceback" not in response.text and "SELECT" not in response.text
    return problem


def live_locks(db_url: str, organization_id: str) -> int:
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM helix_job_locks WHERE organization_id = %s AND released_at IS NULL",
            (organization_id,),
        ).fetchone()
    assert row is not None
    return int(row[0])


# --- /metrics read back ------------------------------------------------------------------------

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    """Every sample by (name, labels)."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(found: Samples, name: str, **labels: str) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


# --- the SDK's two clients, called alike -------------------------------------------------------


class Either:
    """A LockClient, or an AsyncLockClient on an event loop of its own thread, called the same way
    (tests are written once): every method and `lock` block as if synchronous."""

    def __init__(self, kind: str, url: str, **options: Any) -> None:
        self.kind = kind
        self._loop: asyncio.AbstractEventLoop | None = None
        if kind == "sync":
            self.client: Any = LockClient(url, **options)
            return
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.client = self._await(_make_async(url, **options))

    def _await(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        assert self._loop is not None
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        return future.result(timeout=120)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.client, name)
        if self.kind == "sync":
            return method  # type: ignore[no-any-return]
        return lambda *args, **kwargs: self._await(method(*args, **kwargs))

    @contextmanager
    def lock(self, *args: Any, **kwargs: Any) -> Iterator[Lease]:
        with self._block("lock", *args, **kwargs) as lease:
            yield lease

    @contextmanager
    def session(self, *args: Any, **kwargs: Any) -> Iterator[SessionLease]:
        with self._block("session", *args, **kwargs) as lease:
            yield lease

    @contextmanager
    def _block(self, name: str, *args: Any, **kwargs: Any) -> Iterator[Any]:
        if self.kind == "sync":
            with getattr(self.client, name)(*args, **kwargs) as lease:
                yield lease
            return
        block = getattr(self.client, name)(*args, **kwargs)
        lease = self._await(block.__aenter__())
        try:
            yield lease
        finally:
            self._await(block.__aexit__(None, None, None))

    def close(self) -> None:
        if self.kind == "sync":
            self.client.close()
            return
        assert self._loop is not None
        self._await(self.client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


async def _make_async(url: str, **options: Any) -> AsyncLockClient:
    return AsyncLockClient(url, **options)


@contextmanager
def either(kind: str, url: str, **options: Any) -> Iterator[Either]:
    client = Either(kind, url, **options)
    try:
        yield client
    finally:
        client.close()


# --- real services with a fast event stream ----------------------------------------------------

FAST = {"HELIX_LOCKS_EVENTS_POLL_MS": "20", "HELIX_LOCKS_EVENTS_KEEPALIVE_SECONDS": "1"}


@contextmanager
def replicas(db_url: str, tmp_path: Path, count: int = 1, **env: str) -> Iterator[list[str]]:
    with ExitStack() as stack:
        yield [
            stack.enter_context(
                running_service(env=ROUTE.env(db_url, **{**FAST, **env}), log=tmp_path / f"s{n}.log")
            )[0]
            for n in range(count)
        ]
