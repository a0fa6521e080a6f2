"""The Node client, built with npm for the tests and benchmarks that run it, and the Node example."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from harness.processes import ROOT

NODE_CLIENT = ROOT / "clients" / "node"


def npm(*args: str, cwd: Path, timeout: float = 300) -> str:
    """Run npm (without this process's HELIX_LOCKS_ variables); its output, or a failure that shows it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HELIX_LOCKS_")}
    done = subprocess.run(["npm", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    said = f"npm {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, said
    return done.stdout


def build_node_client() -> Path:
    """clients/node, built: `npm ci` when its dev dependencies are missing (CI runs it first), the
    TypeScript compiled when dist/ is older than its sources."""
    if not (NODE_CLIENT / "node_modules" / "typescript").is_dir():
        npm("ci", "--no-audit", "--no-fund", cwd=NODE_CLIENT)
    sources = [*NODE_CLIENT.glob("src/*.ts"), NODE_CLIENT / "tsconfig.json", NODE_CLIENT / "package.json"]
    built = NODE_CLIENT / "dist" / "index.js"
    if not built.exists() or built.stat().st_mtime < max(path.stat().st_mtime for path in sources):
        npm("run", "build", cwd=NODE_CLIENT)
    return NODE_CLIENT


def node_example(node_client: Path, into: Path) -> Path:
    """examples/node-worker.mjs as a user runs it: copied into `into`, beside a node_modules that
    holds the built client (build_node_client). The copy's path."""
    (into / "node_modules").mkdir(exist_ok=True)
    (into / "node_modules" / "helix-locks").symlink_to(node_client, target_is_directory=True)
    return Path(shutil.copy(ROOT / "examples" / "node-worker.mjs", into / "node-worker.mjs"))
