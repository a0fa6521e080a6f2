"""The two install profiles: a worker's (the SDK and the client commands, httpx its only
dependency) and the server's (the `server` extra). Built as a wheel and installed into a fresh
venv, as a worker author would."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from harness.processes import ROOT, running_service
from helix_locks.cli import SERVER_MODULES
from tests.support import ROUTE

# What only the server needs: none of it may load with the SDK.
SERVER_ONLY = ("fastapi", "starlette", "psycopg", "pydantic", "uvicorn")
SDK = ROOT / "service" / "helix_locks"
# Imports the module named in argv[1] and prints the names of every module then loaded.
LOADED = (
    "import importlib, json, sys; importlib.import_module(sys.argv[1]); print(json.dumps([*sys.modules]))"
)
TYPED_PROJECT = """\
from helix_locks import LockClient, LockHeld


def fence(url: str) -> int:
    with LockClient(url) as client:
        try:
            with client.lock("acme", "typed", ttl=30) as lease:
                return lease.fencing_token
        except LockHeld as held:
            return len(held.holder or "")
"""


def sdk_modules() -> list[str]:
    """helix_locks and every module beside its __init__ (the server's subpackage aside)."""
    return ["helix_locks", *sorted(f"helix_locks.{p.stem}" for p in SDK.glob("*.py") if p.stem != "__init__")]


def _size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 1e6


@pytest.fixture(scope="module")
def worker_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed without its extra."""
    where = tmp_path_factory.mktemp("worker")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            where,
            ROOT,
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = where.glob("helix_locks-*.whl")
    venv = where / "venv"
    # Without a pip of its own: this interpreter's pip installs into it.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", venv / "bin/python", "install", "--quiet",
         "--disable-pip-version-check", "--no-compile", wheel],
        check=True,
        timeout=300,
    )  # fmt: skip
    return venv


def test_a_worker_install_holds_the_sdk_and_no_server(worker_venv: Path) -> None:
    (site,) = worker_venv.glob("lib/python*/site-packages")
    installed = {path.name.split("-")[0].lower() for path in site.iterdir()}
    assert "helix_locks" in installed and "httpx" in installed
    assert not installed & SERVER_MODULES, installed & SERVER_MODULES
    assert not (site / "service").exists(), "no top-level `service` package is installed"
    server_venv = ROOT / ".venv"
    print(f"worker venv {_size_mb(worker_venv):.0f} MB; server (dev) venv {_size_mb(server_venv):.0f} MB")


def test_a_worker_install_says_what_to_install_for_the_server(worker_venv: Path) -> None:
    for command in (["serve"], ["migrate"], ["keys", "list"]):
        result = subprocess.run(
            [worker_venv / "bin/helix-locks", *command], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1 and "pip install '.[server]'" in result.stderr, result
        assert "Traceback" not in result.stderr


def test_the_sdk_imports_in_a_project_with_its_own_service_package_and_runs_a_job(
    worker_venv: Path, db_url: str, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    (project / "service").mkdir(parents=True)
    (project / "service" / "__init__.py").write_text("")
    (project / "service" / "client.py").write_text("raise ImportError('the project's own module')\n")
    (project / "job.py").write_text(
        "import service\n"
        "from helix_locks import LockClient\n"
        "with LockClient() as client, client.lock('acme', 'from-a-project', ttl=10) as lease:\n"
        "    print('held', lease.fencing_token)\n"
    )
    with running_service(env=ROUTE.env(db_url), log=tmp_path / "s.log") as (url, _):
        env = {"HELIX_LOCKS_URL": url, "PATH": "/usr/bin:/bin"}
        job = subprocess.run(
            [worker_venv / "bin/python", "job.py"],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert job.returncode == 0, job.stderr
        assert job.stdout.startswith("held ")
        run = subprocess.run(
            [
                worker_venv / "bin/helix-locks",
                "run",
                "--org",
                "acme",
                "--job-type",
                "nightly",
                "--",
                "echo",
                "ran",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0, run.stderr
        assert run.stdout == "ran\n"


def test_the_sdk_modules_are_found_where_expected() -> None:
    assert {"helix_locks.client", "helix_locks.runner", "helix_locks.cli"} <= set(sdk_modules())


@pytest.mark.parametrize("python", ["worker", "server"])
@pytest.mark.parametrize("module", sdk_modules())
def test_every_sdk_module_imports_without_loading_the_server(
    module: str, python: str, worker_venv: Path, tmp_path: Path
) -> None:
    # In the worker's venv the server's packages are not installed, so an import of them fails;
    # in the server's (this one), where they are, loading one would pass unseen but for this check.
    interpreter = worker_venv / "bin/python" if python == "worker" else Path(sys.executable)
    done = subprocess.run(
        [interpreter, "-c", LOADED, module], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    loaded = {name.split(".")[0] for name in json.loads(done.stdout)}
    assert not loaded & set(SERVER_ONLY), f"{module} loads {sorted(loaded & set(SERVER_ONLY))}"
    assert "helix_locks.server" not in json.loads(done.stdout)


def test_the_wheel_carries_py_typed_and_a_project_type_checks_against_the_sdk(
    worker_venv: Path, tmp_path: Path
) -> None:
    (wheel,) = worker_venv.parent.glob("helix_locks-*.whl")
    assert "helix_locks/py.typed" in zipfile.ZipFile(wheel).namelist()
    # mypy finds the SDK installed in the worker's venv, as a project's mypy would: only through
    # py.typed (without it: "missing library stubs or py.typed marker").
    (tmp_path / "job.py").write_text(TYPED_PROJECT)
    checked = subprocess.run(
        [
            *(sys.executable, "-m", "mypy", "--strict", "--no-incremental"),
            *("--python-executable", worker_venv / "bin/python", "job.py"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
