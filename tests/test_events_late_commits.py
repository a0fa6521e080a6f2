"""GET /v1/events when transactions commit late (a synchronous standby's acknowledgement, a slow
disk, a caller's own transaction): every change once, live or resumed on any replica, and no
expiry the database's history denies (issue 34, findings 1 to 4)."""

from __future__ import annotations

import asyncio
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.support import Watch
from tests.test_events import acquire, replicas

pytestmark = pytest.mark.anyio

GRANT = "SELECT id, token, expires_at FROM helix_acquire_job_lock(%s, %s, 'w', %s, NULL, NULL)"
RENEW = "SELECT expires_at, lapsed FROM helix_renew_job_lock(%s, %s, %s, NULL)"


def moment(text: str) -> datetime:
    return datetime.fromisoformat(text)


def expiries(watch: Watch) -> list[tuple[int, datetime]]:
    return [(e.data["lock"]["id"], moment(e.data["at"])) for e in watch.events if e.type == "expired"]


async def test_a_lease_granted_by_a_late_commit_and_renewed_at_once_gets_its_expired_event(
    db_url: str, tmp_path: Path
) -> None:
    """Finding 1: the grant commits 1.5 s after its clock reading, so its lease ran out before any
    window could see it, and the holder renews at once (here in the same transaction, as a caller
    running the SQL functions in a transaction of its own may: the commit carries both). The
    history holds the expiry (lapses), and the stream must too: acquired, expired, renewed."""
    with replicas(db_url, tmp_path) as [url]:
        async with Watch(url) as watch:
            with psycopg.connect(db_url) as conn:
                row = conn.execute(GRANT, ("acme", "report", 1000)).fetchone()
                assert row is not None
                lock_id, token, expires_at = row
                await asyncio.sleep(1.5)
                renewed = conn.execute(RENEW, (lock_id, token, 30_000)).fetchone()
                assert renewed is not None and renewed[1] is True, renewed
                conn.commit()
            await watch.until(3, within=5)
            await watch.quiet(0.5)
        with psycopg.connect(db_url) as conn:
            lapses = conn.execute("SELECT lapses FROM helix_job_locks WHERE id = %s", (lock_id,)).fetchone()
    assert lapses == ([expires_at],)
    assert watch.kinds() == [("acquired", lock_id), ("expired", lock_id), ("renewed", lock_id)]
    assert expiries(watch) == [(lock_id, expires_at)]


async def test_a_resume_on_another_replica_keeps_the_expiry_of_a_late_commit(
    db_url: str, tmp_path: Path
) -> None:
    """Finding 2: a late grant G's lease runs out while it is uncommitted; another change E comes
    after that, then G commits. The live stream gives `E, acquired G, expired G`; a stream resumed
    from E (whose window closed after G's lease ran out, but could not see G), or from G, on the
    other replica, must give the rest of it. (Windows of a second, so that E's most likely opened
    before G's lease ran out: the build before 0019 took the expiry for sent with E.)"""
    with replicas(db_url, tmp_path, count=2, HELIX_LOCKS_EVENTS_POLL_MS="1000") as [one, two]:
        async with httpx.AsyncClient(base_url=one) as http, Watch(one) as live:
            with psycopg.connect(db_url) as conn:
                row = conn.execute(GRANT, ("acme", "late", 1000)).fetchone()
                assert row is not None
                lock_id, _, expires_at = row
                await asyncio.sleep(1.05)
                before = await acquire(http, job="before")
                await live.until(1)
                await asyncio.sleep(0.3)
                conn.commit()
            await live.until(3, within=5)
            await live.quiet(0.5)
            assert live.kinds() == [("acquired", before["id"]), ("acquired", lock_id), ("expired", lock_id)]
            for n, wanted in ((0, live.kinds()[1:]), (1, live.kinds()[2:])):
                async with Watch(two, last_event_id=live.events[n].id) as resumed:
                    await resumed.until(len(wanted), within=5)
                    await resumed.quiet(0.5)
                assert resumed.kinds() == wanted, f"resumed from event #{n}"
                assert expiries(resumed) == [(lock_id, expires_at)]


async def test_resuming_twice_from_a_replayed_event_repeats_nothing(db_url: str, tmp_path: Path) -> None:
    """Finding 3: T1 is granted first, in a transaction that stays open; T2 is granted after it and
    commits first, and the stream sends T2, then T1. Resumed on B from T2's id, the stream replays
    T1; resumed on A from that replayed T1's id, it must not send T2 again."""
    with replicas(db_url, tmp_path, count=2) as [one, two]:
        async with httpx.AsyncClient(base_url=one) as http, Watch(one) as live:
            with psycopg.connect(db_url) as conn:
                first = conn.execute(GRANT, ("acme", "t1", 30_000)).fetchone()
                assert first is not None
                second = await acquire(http, job="t2")
                await live.until(1)
                conn.commit()
            await live.until(2)
            assert live.kinds() == [("acquired", second["id"]), ("acquired", first[0])]
            async with Watch(two, last_event_id=live.events[0].id) as again:
                await again.until(1)
                await again.quiet(0.5)
            assert again.kinds() == [("acquired", first[0])]
            async with Watch(one, last_event_id=again.events[0].id) as twice:
                later = await acquire(http, job="later")
                await twice.until(1)
                await twice.quiet(0.5)
            assert twice.kinds() == [("acquired", later["id"])], "T2 came again"


async def test_a_renewal_that_read_the_clock_before_the_lease_ran_out_leaves_no_expiry(
    db_url: str, tmp_path: Path
) -> None:
    """Finding 4: a renewal reads the clock before the lease runs out and commits well after:
    the history says the lease never ran out (no lapse), so no stream may report it expired."""
    with replicas(db_url, tmp_path, count=2) as [one, two]:
        async with httpx.AsyncClient(base_url=one) as http, Watch(one) as first, Watch(two) as second:
            lock: dict[str, Any] = await acquire(http, job="renewed", ttl=1)
            with psycopg.connect(db_url) as conn:
                renewed = conn.execute(RENEW, (lock["id"], lock["token"], 30_000)).fetchone()
                assert renewed is not None and renewed[1] is False
                await asyncio.sleep(1.5)  # the old lease runs out meanwhile
                conn.commit()
            for watch in (first, second):
                await watch.until(2, within=5)
                await watch.quiet(1.0)
            with psycopg.connect(db_url) as conn:
                row = conn.execute(
                    "SELECT lapses, renewed_at, %s::timestamptz FROM helix_job_locks WHERE id = %s",
                    (lock["expires_at"], lock["id"]),
                ).fetchone()
    assert row is not None
    lapses, renewed_at, ran_out = row
    assert lapses is None and renewed_at < ran_out, row
    for watch in (first, second):
        assert watch.kinds() == [("acquired", lock["id"]), ("renewed", lock["id"])]
