"""A previous build of the service: its code and migrations exported from git, for the benches'
A/B runs and for the rolling upgrade's test (a replica of the previous build serving while this
build migrates)."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

from harness.processes import ROOT


def previous_build(workdir: Path, rev: str | None, migration: str | None) -> tuple[Path, str]:
    """The code before `migration` (service/ and migrations/ of `rev`, by default of the commit
    before the one that added it, or HEAD while it is uncommitted), exported into workdir/base with
    `git archive`; and which commit it is. Without a migration, `rev`'s code, whatever it has."""
    if rev is None:
        if migration is None:
            raise ValueError("the base needs a commit or a migration it lacks")
        added = subprocess.run(
            ["git", "-C", str(ROOT), "log", "-1", "--format=%H", "--diff-filter=A", "--", migration],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        rev = f"{added}^" if added else "HEAD"
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", rev], capture_output=True, text=True, check=True
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit, "service", "migrations"],
        capture_output=True,
        check=True,
    ).stdout
    base = workdir / "base"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(base, filter="data")
    if migration is not None and (base / migration).exists():
        raise ValueError(f"{rev} ({commit}) already has {migration}: choose an older commit")
    return base, commit
