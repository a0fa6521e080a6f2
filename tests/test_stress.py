"""Many racing clients spread over three service replicas on one database; a checker judges it."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

from tests.history import check, database_history
from tests.load import Load
from tests.support import ROUTE, running_service

SECONDS = 8.0
REPLICAS = 3


def test_no_two_grants_of_one_key_overlap_under_racing_clients(db_url: str, tmp_path: Path) -> None:
    with ExitStack() as stack:
        urls = [
            stack.enter_context(running_service(env=ROUTE.env(db_url), log=tmp_path / f"serve-{n}.log"))[0]
            for n in range(REPLICAS)
        ]
        with Load(urls, clients=24) as load:
            time.sleep(SECONDS)
        run = load.run

    grants = database_history(db_url)
    violations = check(grants, run.told, run.renewed, run.released, run.release_attempts)
    assert violations == [], "\n".join(violations[:20])
    assert run.errors() == {}
    # The run exercised what it claims to: contention, crashes and reclaims, across the replicas.
    reclaims = sum(grant.release_reason == "reclaimed" for grant in grants)
    assert run.answers["acquire 409"] > 50
    assert run.crashes > 3
    assert reclaims > 3
    assert len(run.told) > 60
    assert run.unknown == 0 and run.unavailable() == 0
    assert len(grants) == len(run.told), "the database holds grants no client was told about"
