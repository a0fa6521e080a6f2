"""The migration runner: ordered, once each, checksummed, safe for replicas starting together."""

from __future__ import annotations

import re
import threading

import psycopg
import pytest

from helix_locks.server import migrate, queries
from tests import schema

NAMES = [m.name for m in migrate.load()]


def test_applies_every_file_once_in_order(empty_db_url: str) -> None:
    assert sorted(NAMES) == NAMES
    assert NAMES[0] == "0001_job_locks.sql"
    assert (migrate.migrations_dir() / "schema.sql").is_file() and "schema.sql" not in NAMES
    assert migrate.migrate(empty_db_url) == NAMES
    assert migrate.migrate(empty_db_url) == []
    with psycopg.connect(empty_db_url) as conn:
        recorded = conn.execute("SELECT name FROM helix_schema_migrations ORDER BY name").fetchall()
    assert [name for (name,) in recorded] == NAMES


def test_replicas_migrating_together_apply_each_file_once(empty_db_url: str) -> None:
    results: list[list[str]] = []
    failures: list[BaseException] = []

    def replica() -> None:
        try:
            results.append(migrate.migrate(empty_db_url))
        except BaseException as exc:  # surfaced by the assertion below
            failures.append(exc)

    threads = [threading.Thread(target=replica) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert failures == []
    assert sorted(name for result in results for name in result) == NAMES


def test_a_changed_applied_file_stops_the_runner(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE helix_schema_migrations SET checksum = 'edited' WHERE name = %s", (NAMES[0],))
    with pytest.raises(migrate.MigrationError, match=NAMES[0]):
        migrate.migrate(db_url)


def test_grants_made_before_fencing_get_tokens_in_grant_order(empty_db_url: str) -> None:
    first = migrate.load()[0]
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        conn.execute(first.sql)
        conn.execute(
            "INSERT INTO helix_job_locks (organization_id, job_type, holder, token, acquired_at,"
            " expires_at, released_at, release_reason) VALUES"
            " ('o', 'j', 'a', 't1', now(), now() + interval '1 s', now(), 'released'),"
            " ('o', 'k', 'b', 't2', now(), now() + interval '1 s', NULL, NULL),"
            " ('o', 'j', 'c', 't3', now(), now() + interval '1 s', NULL, NULL)"
        )
        conn.execute(queries.CREATE_MIGRATIONS_TABLE)
        conn.execute(queries.RECORD_MIGRATION, {"name": first.name, "checksum": first.checksum})
    assert migrate.migrate(empty_db_url) == NAMES[1:]
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        tokens = conn.execute("SELECT holder, fencing_token FROM helix_job_locks ORDER BY id").fetchall()
        assert tokens == [("a", 1), ("b", 1), ("c", 2)]
        conn.execute(
            "UPDATE helix_job_locks SET expires_at = acquired_at + interval '1 ms' WHERE holder = 'c'"
        )
        next_grant = conn.execute(
            "SELECT fencing_token FROM helix_acquire_job_lock('o', 'j', 'd', 1000, NULL, NULL)"
        )
        assert next_grant.fetchone() == (3,), "the counter carries on from the backfilled tokens"


def test_a_schema_ahead_of_the_installation_on_the_search_path_gets_no_second_copy(
    empty_db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Installed in public; later a schema named after the role appears, first on the default
    search_path ("$user", public). The next migrations go where the installation is."""
    everything = migrate.load()
    monkeypatch.setattr(migrate, "load", lambda: everything[:-2])
    migrate.migrate(empty_db_url)
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        conn.execute("SELECT set_config('search_path', '\"$user\", public', false)")
        conn.execute(psycopg.sql.SQL("CREATE SCHEMA {}").format(psycopg.sql.Identifier(conn.info.user)))
    monkeypatch.setattr(migrate, "load", lambda: everything)
    assert migrate.migrate(empty_db_url) == [m.name for m in everything[-2:]]
    with psycopg.connect(empty_db_url) as conn:
        where = conn.execute(
            "SELECT DISTINCT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE c.relname LIKE 'helix%'"
        ).fetchall()
    assert where == [("public",)]


def test_the_checked_in_schema_is_the_one_the_migrations_make(db_url: str) -> None:
    """migrations/schema.sql, the current schema in one file, read from this server's catalog:
    the same text on PostgreSQL 14 to 18 (tests/schema.py normalises what differs)."""
    checked_in, made = schema.PATH.read_text(encoding="utf-8"), schema.document(db_url)
    with psycopg.connect(db_url) as conn:
        if conn.info.server_version < 140000:
            # PostgreSQL 13 keeps a view's EXTRACT as date_part(), of double precision (numeric
            # from 14 on): views are compared from 14 on, everything else on 13 too.
            checked_in, made = (
                re.sub(r"^CREATE VIEW .*?;$", "", text, flags=re.DOTALL | re.MULTILINE)
                for text in (checked_in, made)
            )
    assert checked_in == made, (
        "migrations/schema.sql is out of date with the migrations: run `python -m tests.schema`"
    )


def test_every_table_column_view_and_function_says_what_it_is(db_url: str) -> None:
    """The schema explains itself where it runs (issue 37): migrations/schema.sql is read from
    the catalog, so what it says of each object is the object's COMMENT."""
    with psycopg.connect(db_url) as conn:
        silent = conn.execute(
            """
            SELECT 'table ' || c.relname FROM pg_class AS c
            WHERE c.relname LIKE 'helix%' AND c.relkind IN ('r', 'v', 'S')
              AND c.relnamespace = 'public'::regnamespace
              AND obj_description(c.oid, 'pg_class') IS NULL
              -- not an identity column's sequence, which is part of its column
              AND NOT EXISTS (SELECT FROM pg_depend AS d WHERE d.objid = c.oid AND d.deptype = 'i')
            UNION ALL
            SELECT 'column ' || c.relname || '.' || a.attname
            FROM pg_class AS c JOIN pg_attribute AS a ON a.attrelid = c.oid
            WHERE c.relname LIKE 'helix%' AND c.relkind = 'r' AND a.attnum > 0 AND NOT a.attisdropped
              AND c.relnamespace = 'public'::regnamespace
              AND col_description(c.oid, a.attnum) IS NULL
            UNION ALL
            SELECT 'function ' || p.oid::regprocedure FROM pg_proc AS p
            WHERE p.proname LIKE 'helix%' AND p.pronamespace = 'public'::regnamespace
              AND obj_description(p.oid, 'pg_proc') IS NULL
            ORDER BY 1
            """
        ).fetchall()
    assert [what for (what,) in silent] == []
