"""The command line: protected mode, `migrate` reaching the database as `serve` does, and what
`serve` says at startup of where to look, and --help and --version, with the server installed or
not."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import psycopg
import pytest

from harness.processes import ROOT, helix_command, running_service
from helix_locks.server import migrate
from helix_locks.server.commands import is_loopback


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        helix_command(*args),
        env={**os.environ, **(env or {})},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_serve_refuses_a_public_address_while_no_key_exists(empty_db_url: str) -> None:
    result = run("serve", "--host", "0.0.0.0", env={"DATABASE_URL": empty_db_url})
    assert result.returncode == 2
    assert "refusing to listen on 0.0.0.0" in result.stderr
    assert "helix-locks keys create --admin" in result.stderr
    assert "--insecure" in result.stderr


def test_loopback_detection() -> None:
    assert is_loopback("127.0.0.1")
    assert is_loopback("localhost")
    assert is_loopback("::1")
    assert not is_loopback("0.0.0.0")
    assert not is_loopback("::")


def test_migrate_command_uses_database_url(empty_db_url: str) -> None:
    first = run("migrate", env={"DATABASE_URL": empty_db_url})
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == [m.name for m in migrate.load()]
    again = run("migrate", env={"DATABASE_URL": empty_db_url})
    assert again.stdout.strip() == "no migrations pending"


def test_three_migrate_processes_at_once_apply_each_migration_exactly_once(empty_db_url: str) -> None:
    env = {**os.environ, "DATABASE_URL": empty_db_url}
    processes = [
        subprocess.Popen(helix_command("migrate"), env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outputs = [process.communicate(timeout=60)[0].split() for process in processes]
    assert [process.returncode for process in processes] == [0, 0, 0]
    applied = sorted(name for output in outputs for name in output if name.endswith(".sql"))
    assert applied == [m.name for m in migrate.load()]
    with psycopg.connect(empty_db_url) as conn:
        recorded = conn.execute(
            "SELECT count(*), count(DISTINCT name) FROM helix_schema_migrations"
        ).fetchone()
    assert recorded == (len(applied), len(applied))


def test_serve_names_the_console_and_the_docs_at_startup(db_url: str, tmp_path: Path) -> None:
    log = tmp_path / "s.log"
    with running_service(env={"DATABASE_URL": db_url}, log=log) as (url, _):
        said = log.read_text()
        assert f"the console: {url}/console; the API's reference: {url}/docs" in said, said
        assert "the database: DATABASE_URL" in said, said
        page = httpx.get(f"{url}/", follow_redirects=True, timeout=10)
        assert page.status_code == 200 and page.url.path == "/console", "the root leads to the console"


@pytest.mark.skipif(os.geteuid() != 0, reason="the embedded PostgreSQL runs as its own OS user, made by root")
def test_serve_on_the_embedded_database_names_where_it_keeps_its_data(tmp_path: Path) -> None:
    data_dir, log = tmp_path / "data", tmp_path / "s.log"
    with running_service("--data-dir", str(data_dir), env={"DATABASE_URL": None}, log=log):
        said = log.read_text()
    assert f"the embedded PostgreSQL keeps its data in {data_dir / 'pgdata'}" in said, said


def test_help_lists_the_client_commands_and_then_the_server_s_apart() -> None:
    result = run("--help")
    assert result.returncode == 0, result.stderr
    client, _, server = result.stdout.partition(
        "server commands (they need the server extra, installed here):"
    )
    assert server, result.stdout
    listed = [found[1] for line in client.splitlines() if (found := re.match(r"    (\w+)", line))]
    assert listed == ["run", "acquire", "renew", "release", "current", "list", "watch"], result.stdout
    assert [line.split()[0] for line in server.splitlines() if line.strip()] == ["serve", "migrate", "keys"]
    for command in ("run", "serve"):
        alone = run(command, "--help")
        assert alone.returncode == 0 and "server commands" not in alone.stdout, alone.stdout


# Makes the server's modules unfindable, as in a worker's install, then runs the command line.
WITHOUT_THE_SERVER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'fastapi', 'uvicorn', 'psycopg'}:
            raise ModuleNotFoundError(f'No module named {name!r}', name=name)
sys.meta_path.insert(0, Block())
from helix_locks.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_without_the_server_help_and_its_commands_say_how_to_install_it_from_a_clone() -> None:
    def without(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-c", WITHOUT_THE_SERVER, *args]
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)

    install = "pip install '.[server]' in a clone of the repository"
    helped = without("--help")
    assert helped.returncode == 0, helped.stderr
    assert "server commands (they need the server extra, which is not installed here):" in helped.stdout
    assert install in helped.stdout, helped.stdout
    served = without("serve")
    assert served.returncode == 2
    assert served.stderr == f"helix-locks serve: the server is not installed here: {install}\n"


def test_version_prints_the_installed_distribution_s() -> None:
    result = run("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"helix-locks {importlib.metadata.version('helix-locks')}\n"
