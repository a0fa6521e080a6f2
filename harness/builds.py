"""A previous build of the service: its code and migrations exported from git, for the benches'
A/B runs and for the rolling upgrade's test (a replica of the previous build serving while this
build migrates)."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

from harness.processes import ROOT


def git(*args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    """git ARGS in the repository, its output captured."""
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, check=check)


def served_from(base: Path) -> dict[str, str]:
    """What runs a build exported by previous_build() rather than this tree: its package ahead of
    the editable install."""
    return {"PYTHONPATH": str(base / "service")}


def previous_build(workdir: Path, rev: str | None, migration: str | None) -> tuple[Path, str]:
    """The code before `migration` (service/ and migrations/ of `rev`, by default of the commit
    before the one that added it, or HEAD while it is uncommitted), exported into workdir/base with
    `git archive`; and which commit it is. Without a migration, `rev`'s code, whatever it has."""
    if rev is None:
        if migration is None:
            raise ValueError("the base needs a commit or a migration it lacks")
        added = git("log", "-1", "--format=%H", "--diff-filter=A", "--", migration).stdout.decode().strip()
        rev = f"{added}^" if added else "HEAD"
    commit = git("rev-parse", "--short", rev).stdout.decode().strip()
    archive = git("archive", "--format=tar", commit, "service", "migrations").stdout
    base = workdir / "base"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(base, filter="data")
    if migration is not None and (base / migration).exists():
        raise ValueError(f"{rev} ({commit}) already has {migration}: choose an older commit")
    return base, commit
