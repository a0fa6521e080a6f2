"""PostgreSQL as users run it: a database's own defaults (isolation, a DBA's timeouts), poolers,
least-privilege roles in a schema of their own.

Each default below is set on the test's database (ALTER DATABASE ... SET), as a provider or a DBA
would, and must change nothing a client sees.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from harness.history import Told, check, database_history
from harness.processes import free_port, helix_command, running_service
from harness.proxies import PGBOUNCER, pgbouncer, through
from helix_locks.server import queries
from helix_locks.server.app import create_app
from helix_locks.server.embedded import DIRECT_DATABASE_URL
from helix_locks.server.settings import Settings
from tests.support import ROUTE, Conn, in_process

KEY = {"organization_id": "acme", "job_type": "hot"}

# What a provider or a DBA may set on a database; {} is PostgreSQL's own defaults.
DEFAULTS = {
    "repeatable-read": {"default_transaction_isolation": "repeatable read"},
    "serializable": {"default_transaction_isolation": "serializable"},
    # Times written otherwise: the answers still carry RFC 3339 UTC times.
    "formats": {"DateStyle": "SQL, DMY", "TimeZone": "Asia/Kathmandu", "IntervalStyle": "sql_standard"},
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
    """The test's database, with the defaults of request.param set on it for new sessions.

    Through PgBouncer, transaction_timeout and statement_timeout are 1 s, not 20 ms: PgBouncer's
    own transaction that sets a new server connection's DateStyle and TimeZone runs under the
    first, and the two statements that begin each of the service's transactions (SET TRANSACTION,
    then set_config of its own settings) run under the second before they replace it, out of the
    service's reach (docs/operations.md, "Behind a transaction pooler"). 20 ms canceled one of a
    thousand on a busy machine: a 503. The service's statements set both off either way."""
    known = {name for (name,) in conn.execute("SELECT name FROM pg_settings")}
    name = conninfo_to_dict(db_url)["dbname"]
    for setting, value in DEFAULTS[request.param].items():
        if setting in ("transaction_timeout", "statement_timeout") and ROUTE.pooler_port is not None:
            value = "1s"
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
    async with in_process(app, timeout=30) as http:
        yield http


async def race(
    http: httpx.AsyncClient, clients: int, grants: int, within: float = 60
) -> tuple[Counter[str], list[Told]]:
    """`clients` tasks acquire and release one key until there have been `grants` grants and as
    many conflicts (or `within` seconds pass): the answers, and the grants."""
    answers: Counter[str] = Counter()
    told: list[Told] = []
    stop = time.monotonic() + within

    def enough() -> bool:
        return answers["acquire 201"] >= grants and answers["acquire 409"] >= grants

    async def client(n: int) -> None:
        while time.monotonic() < stop and not enough():
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


def _at(lock: dict[str, Any]) -> datetime:
    assert lock["acquired_at"].endswith("Z") and lock["expires_at"].endswith("Z"), lock
    return datetime.fromisoformat(lock["acquired_at"])


@pytest.mark.anyio
async def test_a_hot_key_race_gets_only_grants_and_conflicts_whatever_the_databases_defaults(
    defaults_db_url: str,
) -> None:
    async with service(defaults_db_url) as http:
        answers, told = await race(http, clients=24, grants=40)
        # Idle pooled connections outlive a DBA's idle_session_timeout.
        await asyncio.sleep(1)
        after = await http.post("/v1/locks", json={**KEY, "holder": "late", "ttl_seconds": 30})
        assert after.status_code == 201, after.text
    assert set(answers) <= {"acquire 201", "acquire 409", "release 204"}, answers
    assert answers["acquire 201"] >= 40 and answers["acquire 409"] >= 40, answers
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
            assert time.monotonic() - released < 5, (
                f"round {round_}: woken by its 10 s timer, not the release"
            )
            lock = granted.json()
            assert (
                await http.delete(f"/v1/locks/{lock['id']}", headers={"Lock-Token": lock["token"]})
            ).status_code == 204


# In CI PgBouncer is installed (.ci/run), so these run there; elsewhere they need `apt-get install pgbouncer`.
needs_pgbouncer = pytest.mark.skipif(
    not Path(PGBOUNCER).exists() and not os.environ.get("CI"), reason="needs Debian's pgbouncer"
)


@pytest.fixture
def transaction_pooler(server_url: str) -> Iterator[int]:
    """A PgBouncer of this test's own, in transaction mode; its port."""
    with pgbouncer(server_url) as running:
        yield running.port


def serve(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`helix-locks serve ...` to its end (it refuses to start, in these tests)."""
    environment = {k: v for k, v in os.environ.items() if k != DIRECT_DATABASE_URL} | env
    return subprocess.run(
        helix_command("serve", "--port", str(free_port()), *args),
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@needs_pgbouncer
def test_behind_a_transaction_pooler_without_a_direct_url_serve_refuses_to_start(
    transaction_pooler: int, db_url: str
) -> None:
    """LISTEN through a transaction pooler hears nothing: revoked keys would live on in the cache
    and waiters would sleep until the holder's expiry. The self-test finds it out."""
    result = serve(env={"DATABASE_URL": through(transaction_pooler, db_url)})
    assert result.returncode == 2, result.stderr
    assert "HELIX_LOCKS_DIRECT_DATABASE_URL" in result.stderr
    assert "Traceback" not in result.stderr


@needs_pgbouncer
@pytest.mark.anyio
async def test_an_app_built_behind_a_pooler_without_a_direct_url_answers_503_not_500(
    transaction_pooler: int, db_url: str, conn: Conn
) -> None:
    """An app not started by `serve` (no self-test) and told nothing of the pooler prepares its
    statements, which a transaction pooler loses: 503 naming the setting in the log, never 500."""
    settings = Settings(
        database_url=through(transaction_pooler, db_url),
        allow_anonymous=True,
        pool_min_size=2,
        pool_max_size=2,
    )
    app = create_app(settings)
    statuses: Counter[int] = Counter()
    async with in_process(app) as http:
        for batch in range(10):  # two connections at once, each with its own _pg3_0, _pg3_1...
            if batch == 5:  # new server connections behind the pooler: what was prepared is gone
                conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            answers = await asyncio.gather(
                *(
                    http.post(
                        "/v1/locks",
                        json={**KEY, "job_type": f"job-{batch}-{n}", "holder": "h", "ttl_seconds": 30},
                    )
                    for n in range(4)
                )
            )
            statuses.update(answer.status_code for answer in answers)
    assert 500 not in statuses, statuses
    assert statuses[503] > 0, "the pooler lost prepared statements, and said so"


@needs_pgbouncer
def test_behind_a_transaction_pooler_with_a_direct_url_the_listener_hears_releases(
    transaction_pooler: int, db_url: str, tmp_path: Path
) -> None:
    """The pool goes through PgBouncer, LISTEN goes direct: a waiter in another process is woken
    by the release, and nothing is prepared (PgBouncer 1.18 would refuse a prepared statement)."""
    env = {"DATABASE_URL": through(transaction_pooler, db_url), DIRECT_DATABASE_URL: db_url}
    with (
        running_service(env=env, log=tmp_path / "a.log") as (one, _),
        running_service(env=env, log=tmp_path / "b.log") as (two, _),
    ):
        held = httpx.post(
            f"{one}/v1/locks", json={**KEY, "holder": "h", "ttl_seconds": 30}, timeout=10
        ).json()
        waiting = {**KEY, "holder": "w", "ttl_seconds": 30, "wait_seconds": 20}

        async def scenario() -> tuple[httpx.Response, float]:
            waiter = asyncio.create_task(
                asyncio.to_thread(httpx.post, f"{two}/v1/locks", json=waiting, timeout=30)
            )
            await asyncio.sleep(0.5)
            released = time.monotonic()
            answer = await asyncio.to_thread(
                httpx.delete,
                f"{one}/v1/locks/{held['id']}",
                headers={"Lock-Token": held["token"]},
                timeout=10,
            )
            assert answer.status_code == 204
            return await waiter, time.monotonic() - released

        granted, latency = asyncio.run(scenario())
        assert granted.status_code == 201, granted.text
        assert latency < 10, "woken by the release's NOTIFY, not by the holder's expiry in 30 s"
    for log in ("a.log", "b.log"):
        text = (tmp_path / log).read_text()
        assert "prepared statement" not in text and '"level": "error"' not in text, text


# ---------------------------------------------------------------------------------------------
# Least privilege: a role that owns only the schema migrates; a role with no DDL serves.


@pytest.fixture
def roles(server_url: str, empty_db_url: str) -> Iterator[tuple[str, str]]:
    """An owner role (the schema helix is its) and a serving role, as the README's grants make
    them, in this test's database only; both dropped afterwards."""
    suffix = uuid.uuid4().hex[:8]
    owner, app = f"helix_owner_{suffix}", f"helix_app_{suffix}"
    database = sql.Identifier(str(conninfo_to_dict(empty_db_url)["dbname"]))
    with psycopg.connect(server_url, autocommit=True) as server:
        for role in (owner, app):
            server.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        with psycopg.connect(empty_db_url, autocommit=True) as db:
            o, a = sql.Identifier(owner), sql.Identifier(app)
            for statement in (
                "REVOKE CREATE ON SCHEMA public FROM PUBLIC",  # PostgreSQL 15's default, on any version
                "CREATE SCHEMA helix AUTHORIZATION {o}",
                "ALTER ROLE {o} IN DATABASE {d} SET search_path = helix",
                "ALTER ROLE {a} IN DATABASE {d} SET search_path = helix",
                "GRANT USAGE ON SCHEMA helix TO {a}",
                "ALTER DEFAULT PRIVILEGES FOR ROLE {o} IN SCHEMA helix GRANT SELECT ON TABLES TO {a}",
                "ALTER DEFAULT PRIVILEGES FOR ROLE {o} IN SCHEMA helix GRANT EXECUTE ON FUNCTIONS TO {a}",
            ):
                db.execute(sql.SQL(statement).format(o=o, a=a, d=database))
        yield owner, app
    finally:
        with psycopg.connect(empty_db_url, autocommit=True) as db:
            for role in (app, owner):  # one at a time: both at once trips over the default ACLs
                db.execute(sql.SQL("DROP OWNED BY {} CASCADE").format(sql.Identifier(role)))
        with psycopg.connect(server_url, autocommit=True) as server:
            for role in (owner, app):
                server.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_an_owner_migrates_and_a_role_without_ddl_serves(
    roles: tuple[str, str], empty_db_url: str, tmp_path: Path
) -> None:
    owner, app = roles
    owner_url, app_url = make_conninfo(empty_db_url, user=owner), make_conninfo(empty_db_url, user=app)

    refused = serve(env={"DATABASE_URL": app_url})
    assert refused.returncode == 1, refused.stderr
    assert "helix-locks migrate" in refused.stderr and "Traceback" not in refused.stderr

    environment = {k: v for k, v in os.environ.items() if k != DIRECT_DATABASE_URL}
    migrated = subprocess.run(
        helix_command("migrate"),
        env={**environment, "DATABASE_URL": owner_url},
        capture_output=True,
        text=True,
    )
    assert migrated.returncode == 0, migrated.stderr
    with psycopg.connect(empty_db_url, autocommit=True) as db:
        where = db.execute(
            "SELECT DISTINCT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE c.relname LIKE 'helix%'"
        ).fetchall()
        assert where == [("helix",)]
    admin = subprocess.run(
        helix_command("keys", "create", "--admin"),
        env={**environment, "DATABASE_URL": owner_url},
        capture_output=True,
        text=True,
    )
    assert admin.returncode == 0, admin.stderr
    headers = {"Authorization": f"Bearer {admin.stdout.strip()}"}

    env = {"DATABASE_URL": app_url, "HELIX_LOCKS_RETENTION_INTERVAL_SECONDS": "0.2"}
    with (
        running_service(env=env, log=tmp_path / "s.log") as (url, _),
        httpx.Client(base_url=url, headers=headers) as http,
    ):
        body = {**KEY, "holder": "w1", "ttl_seconds": 30}
        first = http.post("/v1/locks", json=body)
        assert first.status_code == 201, first.text
        lock = first.json()
        assert http.post("/v1/locks", json=body).status_code == 409
        token = {"Lock-Token": lock["token"]}
        assert (
            http.post(f"/v1/locks/{lock['id']}/renew", json={"ttl_seconds": 30}, headers=token).status_code
            == 200
        )
        updated = http.patch(f"/v1/locks/{lock['id']}", json={"metadata": {"done": 1}}, headers=token)
        assert updated.status_code == 200, updated.text
        assert http.get("/v1/locks/current", params=KEY).json()["id"] == lock["id"]
        assert http.get("/v1/locks").json()["items"][0]["id"] == lock["id"]
        waiter = http.post("/v1/locks", json={**body, "holder": "w2", "wait_seconds": 0.5})
        assert waiter.status_code == 409  # registered, woken by its timer, unregistered
        assert http.delete(f"/v1/locks/{lock['id']}", headers=token).status_code == 204
        second = http.post("/v1/locks", json=body).json()
        assert http.delete(f"/v1/locks/{second['id']}", params={"force": "true"}).status_code == 204
        assert len(http.get("/v1/locks", params={"state": "released"}).json()["items"]) == 2
        assert http.get("/metrics").status_code == 200
        time.sleep(0.5)  # retention ran, as that role
    log = (tmp_path / "s.log").read_text()
    assert "permission denied" not in log and "retention failed" not in log, log


def test_every_function_a_service_calls_runs_as_its_owner_with_a_pinned_search_path(conn: Conn) -> None:
    """SECURITY DEFINER with the migrated search_path, and no EXECUTE for PUBLIC: a serving role
    needs no rights on the tables, and nobody else may act through the owner's."""
    called = set(
        re.findall(r"\b(helix_\w+)\(", " ".join(v for v in vars(queries).values() if isinstance(v, str)))
    )
    assert {"helix_acquire_job_lock", "helix_release_job_lock", "helix_leave_queue"} <= called
    rows = conn.execute(
        "SELECT p.proname, p.prosecdef, coalesce(array_to_string(p.proconfig, ','), ''),"
        " has_function_privilege('public', p.oid, 'EXECUTE')"
        " FROM pg_proc p WHERE p.proname LIKE 'helix%%' AND p.prosecdef"
    ).fetchall()
    definers = {name for name, *_ in rows}
    assert called <= definers, f"called without SECURITY DEFINER: {called - definers}"
    for name, _, config, public in rows:
        # Each setting the function runs with (0019's window also plans for its values alone).
        settings = dict(entry.split("=", 1) for entry in re.split(r",(?=\w+=)", config) if entry)
        assert settings.keys() <= {"search_path", "plan_cache_mode"}, f"{name}: {config}"
        assert settings.get("search_path", "").endswith("pg_temp"), f"{name}: {config}"
        assert not public, f"{name}: PUBLIC may execute it"
