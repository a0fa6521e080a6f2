"""PostgreSQL as users run it: a database's own defaults (isolation, a DBA's timeouts), poolers,
least-privilege roles in a schema of their own.

Each default below is set on the test's database (ALTER DATABASE ... SET), as a provider or a DBA
would, and must change nothing a client sees.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from service.app import create_app
from tests.history import Told, check, database_history
from tests.support import PGBOUNCER, ROUTE, helix_command, pgbouncer, running_service, through

Conn = psycopg.Connection[Any]
KEY = {"organization_id": "acme", "job_type": "hot"}

# What a provider or a DBA may set on a database; {} is PostgreSQL's own defaults.
DEFAULTS = {
    "repeatable-read": {"default_transaction_isolation": "repeatable read"},
    "serializable": {"default_transaction_isolation": "serializable"},
    # A DBA's guard rails, far below how long a contended acquire waits for the key's row lock.
    "dba-timeouts": {
        "lock_timeout": "20ms",
        "statement_timeout": "20ms",
        "idle_in_transaction_session_timeout": "20ms",
        "idle_session_timeout": "500ms",  # PostgreSQL 14 on
        "transaction_timeout": "20ms",  # PostgreSQL 17 on
    },
}


@pytest.fixture(params=sorted(DEFAULTS))
def defaults_db_url(request: pytest.FixtureRequest, db_url: str, conn: Conn) -> str:
    """The test's database, with the defaults of request.param set on it for new sessions."""
    known = {name for (name,) in conn.execute("SELECT name FROM pg_settings")}
    name = conninfo_to_dict(db_url)["dbname"]
    for setting, value in DEFAULTS[request.param].items():
        if setting in known:
            conn.execute(
                sql.SQL("ALTER DATABASE {} SET {} = {}").format(
                    sql.Identifier(str(name)), sql.Identifier(setting), sql.Literal(value)
                )
            )
    return db_url


@asynccontextmanager
async def service(db_url: str, **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(ROUTE.settings(db_url, allow_anonymous=True, **settings))
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://helix.test", timeout=30) as http,
    ):
        yield http


async def race(http: httpx.AsyncClient, clients: int, seconds: float) -> tuple[Counter[str], list[Told]]:
    """`clients` tasks acquire and release one key until `seconds` pass: the answers, and the grants."""
    answers: Counter[str] = Counter()
    told: list[Told] = []
    stop = time.monotonic() + seconds

    async def client(n: int) -> None:
        while time.monotonic() < stop:
            body = {**KEY, "holder": f"racer-{n}", "ttl_seconds": 30}
            acquired = await http.post("/v1/locks", json=body)
            answers[f"acquire {acquired.status_code}"] += 1
            if acquired.status_code != 201:
                continue
            lock = acquired.json()
            told.append(
                Told(lock["id"], (KEY["organization_id"], KEY["job_type"]), lock["fencing_token"], _at(lock))
            )
            released = await http.delete(f"/v1/locks/{lock['id']}", headers={"Lock-Token": lock["token"]})
            answers[f"release {released.status_code}"] += 1

    await asyncio.gather(*(client(n) for n in range(clients)))
    return answers, told


def _at(lock: dict[str, Any]) -> Any:
    from datetime import datetime

    return datetime.fromisoformat(lock["acquired_at"])


@pytest.mark.anyio
async def test_a_hot_key_race_gets_only_grants_and_conflicts_whatever_the_databases_defaults(
    defaults_db_url: str,
) -> None:
    async with service(defaults_db_url) as http:
        answers, told = await race(http, clients=24, seconds=3)
        # Idle pooled connections outlive a DBA's idle_session_timeout.
        await asyncio.sleep(1)
        after = await http.post("/v1/locks", json={**KEY, "holder": "late", "ttl_seconds": 30})
        assert after.status_code == 201, after.text
    assert set(answers) <= {"acquire 201", "acquire 409", "release 204"}, answers
    assert answers["acquire 201"] > 20 and answers["acquire 409"] > 20, answers
    assert check(database_history(defaults_db_url), told, []) == []


@pytest.mark.anyio
async def test_a_waiter_is_woken_by_the_release_whatever_the_databases_defaults(defaults_db_url: str) -> None:
    """A release just as the waiter registers must not be missed: under REPEATABLE READ the
    release's check for a registration would use a snapshot from before it (migration 0008)."""
    async with service(defaults_db_url) as http:
        for round_ in range(15):
            held = await http.post("/v1/locks", json={**KEY, "holder": f"holder-{round_}", "ttl_seconds": 30})
            assert held.status_code == 201, held.text
            body = {**KEY, "holder": f"waiter-{round_}", "ttl_seconds": 30, "wait_seconds": 10}
            waiter = asyncio.create_task(http.post("/v1/locks", json=body))
            await asyncio.sleep(round_ * 0.002)
            released = time.monotonic()
            gone = await http.delete(
                f"/v1/locks/{held.json()['id']}", headers={"Lock-Token": held.json()["token"]}
            )
            assert gone.status_code == 204, gone.text
            granted = await waiter
            assert granted.status_code == 201, granted.text
            assert time.monotonic() - released < 2, f"round {round_}: woken by its timer, not the release"
            lock = granted.json()
            assert (
                await http.delete(f"/v1/locks/{lock['id']}", headers={"Lock-Token": lock["token"]})
            ).status_code == 204
