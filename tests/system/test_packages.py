"""Both packages as they are published: `python -m build` gives an sdist and a wheel (built from
that sdist) that install into fresh venvs and work; `npm ci && npm pack` in a fresh copy of
clients/node gives a tarball; examples/node-worker.mjs runs from the repository as its header
says; and every place that states the version states pyproject.toml's."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from collections.abc import Mapping
from pathlib import Path

import httpx
import pytest

import helix_locks
from harness.node import NODE_CLIENT
from harness.processes import ROOT, free_port, running_service, wait_ready

pytestmark = pytest.mark.slow

PACKAGE = ROOT / "service" / "helix_locks"
EXAMPLE = ROOT / "examples" / "node-worker.mjs"
# What a published sdist holds beside the package and the migrations (hatchling adds the last three).
SDIST_FILES = {"README.md", "CHANGELOG.md", "pyproject.toml", "PKG-INFO", ".gitignore"}
SMOKE = """\
import sys

import helix_locks
from helix_locks import LockClient

with LockClient(sys.argv[1]) as client, client.lock("acme", "packaged", ttl=10) as lease:
    print(helix_locks.__version__, lease.fencing_token)
"""


def _run(*command: str | Path, cwd: Path = ROOT, env: Mapping[str, str] | None = None) -> str:
    """Run a command; its output, or a failure that shows it."""
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _venv(where: Path) -> Path:
    """A fresh venv without a pip of its own: this interpreter's pip installs into it
    (`_pip_install`), which spares each venv a copy of pip and its bytecode."""
    _run(sys.executable, "-m", "venv", "--without-pip", where)
    return where


def _pip_install(venv: Path, *args: str | Path) -> None:
    _run(
        sys.executable, "-m", "pip", "--python", venv / "bin/python", "install", "--quiet",
        "--disable-pip-version-check", "--no-compile", *args,
    )  # fmt: skip


def _package_files() -> set[str]:
    """The package's files as the repository has them (service/helix_locks/…), caches aside."""
    return {
        path.relative_to(ROOT).as_posix()
        for path in PACKAGE.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


def _migrations() -> set[str]:
    return {path.name for path in (ROOT / "migrations").iterdir() if path.suffix == ".sql"}


def _pyproject_version() -> str:
    version: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return version


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The sdist and the wheel, as `python -m build` makes them: the wheel is built from the
    unpacked sdist, so it proves the sdist holds what a build needs. Without isolation, so that
    nothing is downloaded: hatchling and build are in the dev extra."""
    out = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", out, ROOT)
    (sdist,) = out.glob("helix_locks-*.tar.gz")
    (wheel,) = out.glob("helix_locks-*.whl")
    print(f"sdist {sdist.stat().st_size / 1e3:.0f} kB, wheel {wheel.stat().st_size / 1e3:.0f} kB")
    return sdist, wheel


def test_the_sdist_holds_the_package_the_migrations_and_the_readme_and_no_more(
    built: tuple[Path, Path],
) -> None:
    sdist, _ = built
    with tarfile.open(sdist) as archive:
        top = f"helix_locks-{_pyproject_version()}/"
        names = {member.name.removeprefix(top) for member in archive.getmembers() if member.isfile()}
    wanted = _package_files() | {f"migrations/{name}" for name in _migrations()} | SDIST_FILES
    assert names == wanted, {"missing": wanted - names, "unexpected": names - wanted}


def test_the_wheel_holds_the_sdk_the_server_its_migrations_and_its_console(built: tuple[Path, Path]) -> None:
    _, wheel = built
    names = set(zipfile.ZipFile(wheel).namelist())
    package = {name.removeprefix("service/") for name in _package_files()}
    assert package <= names, package - names
    migrations = {name for name in names if name.startswith("helix_locks/server/migrations/")}
    assert migrations == {f"helix_locks/server/migrations/{name}" for name in _migrations()}
    console = {"index.html", "console.css", "console.js"}
    assert {f"helix_locks/server/console/{name}" for name in console} <= names
    assert "helix_locks/py.typed" in names
    assert not [name for name in names if name.startswith(("service/", "tests/", "migrations/"))]


def test_the_wheel_with_the_server_extra_migrates_an_empty_database_and_serves(
    built: tuple[Path, Path], empty_db_url: str, tmp_path: Path
) -> None:
    _, wheel = built
    venv = _venv(tmp_path / "venv")
    _pip_install(venv, f"{wheel}[server]")
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "DATABASE_URL": empty_db_url}
    _run(venv / "bin/helix-locks", "migrate", cwd=tmp_path, env=env)  # from the wheel's own copy
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (tmp_path / "serve.log").open("wb") as log:
        server = subprocess.Popen(
            [venv / "bin/helix-locks", "serve", "--port", str(port)],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_ready(url, server, tmp_path / "serve.log")  # /readyz: every migration of this build applied
        for page, said in (("/console", "<html"), ("/console/assets/console.js", "import")):
            answer = httpx.get(f"{url}{page}", timeout=10)
            assert answer.status_code == 200 and said in answer.text.lower(), (page, answer.text[:200])
        said = _run(venv / "bin/python", "-c", SMOKE, url, cwd=tmp_path, env=env)
        assert said == f"{_pyproject_version()} 1\n"
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_sdist_installs_into_a_fresh_venv_and_acquires(
    built: tuple[Path, Path], db_url: str, tmp_path: Path
) -> None:
    sdist, _ = built
    venv = _venv(tmp_path / "venv")
    # The build backend from the registry, then a build from the sdist without isolation.
    _pip_install(venv, "hatchling>=1.25")
    _pip_install(venv, "--no-build-isolation", sdist)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    with running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "serve.log") as (url, _):
        said = _run(venv / "bin/python", "-c", SMOKE, url, cwd=tmp_path, env=env)
    assert said == f"{_pyproject_version()} 1\n"
    usage = _run(venv / "bin/helix-locks", "--help", cwd=tmp_path, env=env)
    assert "run" in usage


def _fresh_copy(where: Path) -> Path:
    """clients/node and examples as a fresh clone has them: nothing installed or built."""
    ignore = shutil.ignore_patterns("node_modules", "dist", "*.tgz")
    for folder in ("clients/node", "examples"):
        shutil.copytree(ROOT / folder, where / folder, ignore=ignore)
    return where


def _npm_env() -> dict[str, str]:
    # From the npm cache when it can (the registry otherwise); none of this process's variables.
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("HELIX_LOCKS_", "WORKER_"))}
    return inherited | {"npm_config_prefer_offline": "true", "npm_config_audit": "false"}


def test_npm_ci_then_npm_pack_in_a_fresh_copy_gives_the_tarball(node_client: Path, tmp_path: Path) -> None:
    client = _fresh_copy(tmp_path / "clone") / "clients/node"
    _run("npm", "ci", cwd=client, env=_npm_env())
    assert (client / "dist/index.js").exists(), "npm ci builds the client (prepare)"
    (packed,) = json.loads(_run("npm", "pack", "--json", cwd=client, env=_npm_env()))
    files = {entry["path"] for entry in packed["files"]}
    assert {"package.json", "README.md", "dist/index.js", "dist/index.d.ts"} <= files
    tarball = client / packed["filename"]
    assert packed["filename"] == f"helix-locks-{_pyproject_version()}.tgz"
    print(f"{tarball.name}: {tarball.stat().st_size / 1e3:.0f} kB, {len(files)} files")


def test_the_node_example_runs_from_the_repository_as_its_header_says(
    node_client: Path, db_url: str, tmp_path: Path
) -> None:
    header = EXAMPLE.read_text().split("To run it from the repository", 1)[1].split("\n// In ", 1)[0]
    commands = [line.split("#")[0].strip() for line in re.findall(r"^//   (\S.*)$", header, re.M)]
    assert commands[-1] == "examples/node-worker.mjs [OUTPUT_FILE]", commands
    clone = _fresh_copy(tmp_path / "clone")
    for command in commands[:-1]:
        _run("bash", "-c", command, cwd=clone, env=_npm_env())
    output = tmp_path / "out.txt"
    with running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "serve.log") as (url, _):
        env = _npm_env() | {"HELIX_LOCKS_URL": url, "WORKER_WORK_SECONDS": "0"}
        _run("examples/node-worker.mjs", output, cwd=clone, env=env)
    token, _holder, _lock_id, _acquired_at, slot = output.read_text().split()
    assert (token, slot) == ("1", "0")


def test_every_version_is_pyprojects() -> None:
    version = _pyproject_version()
    assert helix_locks.__version__ == version
    package = json.loads((NODE_CLIENT / "package.json").read_text())
    lock = json.loads((NODE_CLIENT / "package-lock.json").read_text())
    assert package["version"] == lock["version"] == lock["packages"][""]["version"] == version
    # examples/ links the client: its lock records the version, as `npm install` there writes it.
    linked = json.loads((ROOT / "examples" / "package-lock.json").read_text())["packages"]["../clients/node"]
    assert linked["version"] == version
    assert json.loads((ROOT / "openapi.json").read_text())["info"]["version"] == version
    assert re.search(rf"^## \[{re.escape(version)}\]", (ROOT / "CHANGELOG.md").read_text(), re.M)
