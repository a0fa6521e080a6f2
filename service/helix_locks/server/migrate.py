"""The migration runner: applies migrations/NNNN_*.sql in order, each once, checksummed."""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from helix_locks.server import queries
from helix_locks.server.db import Database
from helix_locks.server.errors import SchemaNotReady

# pg_advisory_lock key held while migrating, so replicas starting together apply each file once.
ADVISORY_LOCK_KEY = 0x48454C49584C4B  # "HELIXLK"
_NAME = re.compile(r"^\d{4}_[a-z0-9_]+\.sql$")


class MigrationError(Exception):
    """The database's schema history does not agree with this build's migrations."""


@dataclass(frozen=True)
class Migration:
    name: str
    sql: bytes

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql).hexdigest()


def migrations_dir() -> Path:
    """Inside the installed package (the wheel copies them there), else the source tree's."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "migrations", here.parents[2] / "migrations"):
        if candidate.is_dir():
            return candidate
    raise MigrationError(f"no migrations directory beside {here}")


def migrations_in(directory: Path) -> tuple[Migration, ...]:
    """The migrations of a directory (this build's, or an earlier build's exported), in order."""
    files = sorted(p for p in directory.iterdir() if _NAME.match(p.name))
    return tuple(Migration(p.name, p.read_bytes()) for p in files)


@functools.cache
def load() -> tuple[Migration, ...]:
    """This build's migrations in order (read once: /readyz asks on every probe)."""
    return migrations_in(migrations_dir())


# Files whose bytes changed, in comments only, after a build of main had applied them: the
# checksums of those versions, accepted as this file applied. (A path in 0013's and 0020's header
# comments followed the server's move to helix_locks/server/; the move landed, and then the files
# were put back as every earlier build had them. 0015's comment was reworded at c0dc7bb's next
# commit.) tests/system/test_upgrade.py migrates databases that such builds made and checks that
# each version here differs in comments alone. Never add a version whose SQL differs: a database
# that applied it has other functions than this file makes (docs/operations.md, "Upgrading").
EARLIER_CHECKSUMS = {
    "0013_quota_in_the_database.sql": {"511b42800085f53c667521420a1b5593abf0441c575101dc0b60eb68bafcfc42"},
    "0015_update_metadata.sql": {"765bb0ede2543f313c4f22ffd3a4a0ea812444d782430df4eb828f38dbee6502"},
    "0020_quota_exact.sql": {"601dcabbb46c3fa5f19ab02d89cb42d695aa8ce3b473bb6ccb4f9bf640bd3e27"},
}


def _check(migration: Migration, applied: dict[str, str]) -> bool:
    """True if already applied; MigrationError if applied with other content."""
    checksum = applied.get(migration.name)
    if checksum is None:
        return False
    if checksum != migration.checksum and checksum not in EARLIER_CHECKSUMS.get(migration.name, ()):
        raise MigrationError(
            f"{migration.name} was applied with checksum {checksum} but the file now has "
            f"{migration.checksum}; applied migrations must never change: add a new file instead"
        )
    return True


def migrate(conninfo: str) -> list[str]:
    """Apply what is pending; returns the names applied. Safe to run from many processes at once.

    A database that is current is only read, so a role without the right to create anything
    (the one that serves, say) may call this; one that is not current needs the schema's owner,
    and MigrationError says so.
    """
    done: list[str] = []
    with psycopg.connect(conninfo, autocommit=True, client_encoding="utf8") as conn:
        # No statement_timeout: a migration of a large table may take long.
        conn.execute(queries.CONFIGURE_SESSION, {"statement_timeout_ms": "0"})
        pending = _pending(conn)
        if not pending:
            return done
        _pin_schema(conn, pending)
        conn.execute(queries.MIGRATION_LOCK, {"key": ADVISORY_LOCK_KEY})
        try:
            conn.execute(queries.CREATE_MIGRATIONS_TABLE)
            rows = conn.execute(queries.APPLIED_MIGRATIONS).fetchall()
            applied = {name: checksum for name, checksum in rows}
            for migration in load():
                if _check(migration, applied):
                    continue
                with conn.transaction():
                    conn.execute(migration.sql)
                    conn.execute(
                        queries.RECORD_MIGRATION,
                        {"name": migration.name, "checksum": migration.checksum},
                    )
                done.append(migration.name)
        except psycopg.errors.InsufficientPrivilege as exc:
            raise MigrationError(f"{_who(conn)} may not apply the migrations: {exc}") from exc
        finally:
            if not conn.broken:  # a lost connection has dropped the lock with it
                conn.execute(queries.MIGRATION_UNLOCK, {"key": ADVISORY_LOCK_KEY})
    return done


def _missing(applied: dict[str, str]) -> list[str]:
    """This build's migrations not among those applied; MigrationError if one was changed."""
    return [m.name for m in load() if not _check(m, applied)]


def _pending(conn: psycopg.Connection[Any]) -> list[str]:
    """This build's migrations that the database lacks; MigrationError if one was changed."""
    applied: dict[str, str] = {}
    if conn.execute(queries.MIGRATIONS_TABLE_EXISTS).fetchone() == (True,):
        applied = {name: checksum for name, checksum in conn.execute(queries.APPLIED_MIGRATIONS)}
    return _missing(applied)


def _who(conn: psycopg.Connection[Any]) -> str:
    return f"role {conn.info.user!r}"


def _pin_schema(conn: psycopg.Connection[Any], pending: list[str]) -> None:
    """Migrate into the schema that holds the installation (its migrations table), or, for a new
    one, the first schema of the role's search_path; and nowhere else. The functions keep this
    search_path (migration 0009), so that a caller's cannot change what they use. (A schema that
    appears ahead of the installation on the search_path, one named after the role say, must not
    get a second, empty copy of it.)"""
    row = conn.execute(queries.MIGRATION_SCHEMA).fetchone()
    assert row is not None
    schema, can_create = row
    if schema is None:
        raise MigrationError(
            f"no schema to migrate into: none of the schemas on the search_path of {_who(conn)} "
            "exists (create one, or ALTER ROLE ... SET search_path)"
        )
    if not can_create:
        raise MigrationError(
            f"the database lacks migrations {', '.join(pending)}, and {_who(conn)} may not create "
            f"objects in schema {schema!r}: run `helix-locks migrate` as the schema's owner"
        )
    conn.execute(queries.PIN_SEARCH_PATH, {"schema": schema})


async def check_ready(db: Database) -> None:
    """SchemaNotReady unless every migration of this build is applied, unchanged."""
    present = await db.fetch_first(queries.MIGRATIONS_TABLE_EXISTS, {})
    applied: dict[str, str] = {}
    if present["exists"]:
        rows = await db.fetch_all(queries.APPLIED_MIGRATIONS, {})
        applied = {row["name"]: row["checksum"] for row in rows}
    try:
        missing = _missing(applied)
    except MigrationError as exc:
        raise SchemaNotReady(str(exc)) from exc
    if missing:
        raise SchemaNotReady(f"migrations not applied: {', '.join(missing)}")
