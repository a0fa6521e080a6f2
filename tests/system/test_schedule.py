"""One schedule fired by many machines runs once per interval (issue 41): each machine's clock is
late by its own 0 to 2 s, so its firing of each interval comes 0 to 2 s after the others'; each
takes the lock with `hold_at_least_seconds` and works 200 ms. The grant closes the key for 10 s,
longer than the machines are apart and shorter than the interval (12 s) less that, so each
interval's first firing runs the job and every later firing of it is refused. Judged by the
database's own times and the history checker."""

from __future__ import annotations

import itertools
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from harness.history import Told, check, database_history
from harness.processes import running_service
from helix_locks.client import ClosedUntil, LockClient, LockHeld

pytestmark = pytest.mark.slow

MACHINES = 10
INTERVALS = 5  # a minute of a 12 s schedule
PERIOD, HOLD, SKEW, WORK = 12.0, 10.0, 2.0, 0.2
KEY = ("acme", "nightly-report")


def test_ten_machines_firing_one_schedule_run_the_job_once_per_interval(db_url: str, tmp_path: Path) -> None:
    runs: list[tuple[int, int, dict[str, object]]] = []  # (interval, machine, grant's body)
    skipped: list[tuple[int, str]] = []  # (interval, why)
    guard = threading.Lock()
    with running_service(env={"DATABASE_URL": db_url}, log=tmp_path / "s.log") as (url, _):
        start = time.monotonic() + 1.0

        def machine(n: int) -> None:
            late_by = random.Random(n).uniform(0, SKEW)  # this machine's clock
            with LockClient(url) as client:
                for interval in range(INTERVALS):
                    time.sleep(max(0.0, start + interval * PERIOD + late_by - time.monotonic()))
                    try:
                        with client.lock(*KEY, ttl=5, holder=f"machine-{n}", hold_at_least=HOLD) as lease:
                            with guard:
                                runs.append((interval, n, dict(lease.grant.body)))
                            time.sleep(WORK)
                    except LockHeld as held:
                        with guard:
                            skipped.append((interval, type(held).__name__))

        with ThreadPoolExecutor(MACHINES) as pool:
            list(pool.map(machine, range(MACHINES)))

    assert sorted(interval for interval, _, _ in runs) == list(range(INTERVALS)), runs
    assert len(skipped) == INTERVALS * (MACHINES - 1)
    assert {why for _, why in skipped} == {ClosedUntil.__name__}, "closed, whether held or released"
    starts = sorted(datetime.fromisoformat(str(body["acquired_at"])) for _, _, body in runs)
    for before, after in itertools.pairwise(starts):
        assert after - before >= timedelta(seconds=HOLD), f"a run at {before}, then at {after}"
    told = [
        Told(
            int(str(body["id"])),
            KEY,
            int(str(body["fencing_token"])),
            datetime.fromisoformat(str(body["acquired_at"])),
        )
        for _, _, body in runs
    ]
    history = database_history(db_url)
    assert len(history) == INTERVALS and all(grant.closed_until is not None for grant in history)
    assert check(history, told, []) == []
