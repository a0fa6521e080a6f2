"""The README's command blocks run as written, in order, the way a newcomer runs them: the server's
quickstart in one copy of the repository, the worker's in another (each installs into its own
fresh .venv), the curl session, the Python worker, and the keys. A block marked
`<!-- not run: … -->` is skipped (the foreground `serve`, which the test starts in the background,
and Docker). Only the port differs: the service listens on a free one, not 8080."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from harness.processes import ROOT, free_port, wait_ready

BLOCK = re.compile(
    r"(?:<!-- not run: (?P<skip>[^>]*) -->\n)?```(?P<language>sh|python)\n(?P<code>.*?)```", re.S
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("jq") is None, reason="the curl session needs jq"),
]


def blocks() -> list[tuple[str, str, str | None]]:
    text = (ROOT / "README.md").read_text()
    return [(m["language"], m["code"], m["skip"]) for m in BLOCK.finditer(text)]


def copy_of_the_repository(where: Path) -> Path:
    ignore = shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", "*.egg-info", ".mypy_cache", ".ruff_cache"
    )
    shutil.copytree(ROOT, where, ignore=ignore)
    return where


def test_every_command_block_of_the_readme_runs_as_written(tmp_path: Path) -> None:
    server_dir = copy_of_the_repository(tmp_path / "server")
    worker_dir = copy_of_the_repository(tmp_path / "worker")
    port = free_port()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path / "home"),
        "XDG_DATA_HOME": str(tmp_path / "data"),  # the embedded PostgreSQL's data, as a user's
        "HELIX_LOCKS_URL": f"http://127.0.0.1:{port}",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    found = blocks()
    assert len(found) >= 7, "the quickstarts, curl, Python and keys blocks"
    run_blocks, skipped = [b for b in found if b[2] is None], [b for b in found if b[2] is not None]
    assert any("helix-locks serve" in code for _, code, _ in skipped), "the foreground serve is marked"

    server: subprocess.Popen[bytes] | None = None
    try:
        for language, code, _ in run_blocks:
            code = code.replace("localhost:8080", f"localhost:{port}")
            if language == "python":
                script = worker_dir / "worker.py"
                script.write_text(code)
                result = subprocess.run(
                    [worker_dir / ".venv/bin/python", script],
                    cwd=worker_dir,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                assert result.returncode == 0, result.stderr
                assert "fencing token" in result.stdout
                continue
            # The server's install, its keys and the curl session in the server's copy; the
            # worker's install and `run` in the worker's.
            where = worker_dir if ("pip install ." in code or "helix-locks run" in code) else server_dir
            result = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", code],
                cwd=where,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            served = tmp_path / "serve.log"
            tail = served.read_text(errors="replace")[-4000:] if served.exists() else "(not started)"
            said = f"{result.stdout}\n{result.stderr}\n--- serve:\n{tail}"
            assert result.returncode == 0, f"{code}\n---\n{said}"
            if "pip install -e '.[server]'" in code:
                with (tmp_path / "serve.log").open("wb") as log:
                    server = subprocess.Popen(
                        [server_dir / ".venv/bin/helix-locks", "serve", "--port", str(port)],
                        cwd=server_dir,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                wait_ready(env["HELIX_LOCKS_URL"], server, timeout=120)
            if "helix-locks run" in code:
                assert "fenced with token 1" in result.stdout, result.stdout
            if code.lstrip().startswith("# Acquire"):
                assert '"state":"held"' in result.stdout and "410 Gone" in result.stdout, result.stdout
            if "keys create --admin" in code:
                assert re.search(r"^hlk_[0-9a-f]{12}_", result.stdout, re.M), result.stdout
        assert server is not None, "the server's quickstart ran"
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
