"""Many racing clients spread over three service replicas on one database; a checker judges it."""

from __future__ import annotations

import time
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import pytest

from harness.history import Grant, check, database_history
from harness.load import KEYS, Load, Run
from harness.processes import running_service
from tests.support import ROUTE

# A fault test: run by `scripts/test -m fault`, after the default suite (docs/development.md).
pytestmark = pytest.mark.fault

SECONDS = 8.0
REPLICAS = 3
SEMAPHORE = ("acme", "exports")


def race(
    db_url: str,
    tmp_path: Path,
    keys: Mapping[tuple[str, str], int],
    seconds: float = SECONDS,
    crash_rate: float = 0.15,
) -> tuple[list[Grant], Run]:
    """24 clients racing on `keys` over the replicas; the database's history and what the clients
    saw, once the checker passed them."""
    with ExitStack() as stack:
        urls = [
            stack.enter_context(running_service(env=ROUTE.env(db_url), log=tmp_path / f"serve-{n}.log"))[0]
            for n in range(REPLICAS)
        ]
        with Load(urls, clients=24, keys=keys, crash_rate=crash_rate) as load:
            time.sleep(seconds)
        run = load.run

    grants = database_history(db_url)
    violations = check(grants, run.told, run.renewed, run.released, run.release_attempts)
    assert violations == [], "\n".join(violations[:20])
    assert run.errors() == {}
    assert run.unknown == 0 and run.unavailable() == 0
    assert len(grants) == len(run.told), "the database holds grants no client was told about"
    return grants, run


def test_no_two_grants_of_one_key_overlap_under_racing_clients(db_url: str, tmp_path: Path) -> None:
    grants, run = race(db_url, tmp_path, dict.fromkeys(KEYS, 1))
    # The run exercised what it claims to: contention, crashes and reclaims, across the replicas.
    reclaims = sum(grant.release_reason == "reclaimed" for grant in grants)
    assert run.answers["acquire 409"] > 50
    assert run.crashes > 3
    assert reclaims > 3
    assert len(run.told) > 60


def test_a_semaphore_of_3_never_has_4_holders_under_racing_clients(db_url: str, tmp_path: Path) -> None:
    """Issue 21: 24 clients over the replicas race for the 3 slots of one semaphore, some dying
    while they hold a slot, whose lease must run out before the slot is reclaimed."""
    grants, run = race(db_url, tmp_path, {SEMAPHORE: 3}, seconds=12, crash_rate=0.25)
    assert {(grant.key, grant.max_holders) for grant in grants} == {(SEMAPHORE, 3)}
    assert {grant.slot for grant in grants} == {0, 1, 2}, "every slot was granted"
    assert {told.slot for told in run.told} == {0, 1, 2}
    reclaims = [grant for grant in grants if grant.release_reason == "reclaimed"]
    assert run.answers["acquire 409"] > 50, "the semaphore was full, often"
    assert run.crashes > 3
    assert len(reclaims) > 3
    assert len(run.told) > 30

    # One early lock that never ended, in this same history, makes 4 live at once: caught.
    first = min((g for g in grants if g.release_reason == "released"), key=lambda g: g.fencing_token)
    unended = [replace(g, released_at=None, release_reason=None) if g == first else g for g in grants]
    violations = check(unended, run.told, run.renewed)
    four = [v for v in violations if "4 grants live at once" in v and "more than max_holders 3" in v]
    assert four, violations[:20]
