"""GET /v1/events against careless and hostile clients: forged event ids, resumes that would
replay a lot or delay others, readers that fall behind, and commits slower than a lease."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psycopg
import pytest

from helix_locks import keys
from tests.support import ROUTE, Watch, running_service
from tests.test_events import FAST, acquire, release, replicas

pytestmark = pytest.mark.anyio


# A forged Last-Event-ID whose snapshot PostgreSQL refuses is refused (422) for that request
# alone: it neither ends, stalls nor fails the streams of other watchers in the same process.


async def _first_event_id(url: str, http: httpx.AsyncClient, key: str, org: str) -> str:
    async with Watch(url, key=key) as own:
        lock = await acquire(http, key, org=org, job="first")
        [event] = await own.until(1)
        await release(http, lock, key)
        await own.until(2)
    return event.id


def forged(after: str, until: str) -> str:
    now = datetime.now(UTC).isoformat()
    raw = [after, now, until, now, 1, now, 0]
    return base64.urlsafe_b64encode(json.dumps(raw).encode()).decode().rstrip("=")


# Each passes Position.decode (the regular expression, xmax(after) <= xmax(until)), and each is
# refused by PostgreSQL's pg_snapshot input: xmin after xmax; an in-progress xid out of range;
# in-progress xids out of order; xmin 0.
POISONS = [
    forged("10:5:", "1:5:"),
    forged("1:5:7", "1:5:"),
    forged("1:9:5,3", "1:9:"),
    forged("0:0:", "0:0:"),
]


@pytest.mark.parametrize("poison", POISONS, ids=["xmin>xmax", "xip-range", "xip-order", "zero"])
async def test_a_poisoned_resume_fails_alone_and_other_organizations_streams_go_on(
    db_url: str, tmp_path: Path, poison: str
) -> None:
    acme, mallory = keys.create(db_url, "acme"), keys.create(db_url, "mallory")
    with replicas(db_url, tmp_path) as [url]:
        async with httpx.AsyncClient(base_url=url) as http, Watch(url, key=acme) as victim:
            await acquire(http, acme, job="before")
            await victim.until(1)
            async with Watch(url, key=mallory, last_event_id=poison) as attack:
                pass
            await asyncio.sleep(0.5)
            assert not victim.ended.is_set(), "another organization's forged id ended this stream"
            # A made-up id is the client's mistake: 422, never a 500.
            assert attack.status in (400, 422), (attack.status, attack.problem)
            await acquire(http, acme, job="after")
            await victim.until(2, within=5)
        log = (tmp_path / "s0.log").read_text()
        assert "event reader failed" not in log


async def test_an_honest_resume_read_in_the_same_poll_as_a_poisoned_one_succeeds(
    db_url: str, tmp_path: Path
) -> None:
    """Every resume waiting is read in ONE statement with the reader's own window: one bad start
    point must not fail the others (nor, mapped to a domain error, 'retry' them into a refusal)."""
    acme, mallory = keys.create(db_url, "acme"), keys.create(db_url, "mallory")
    # A slow poll, so that both resumes wait for the same read.
    with replicas(db_url, tmp_path, HELIX_LOCKS_EVENTS_POLL_MS="1500") as [url]:
        async with httpx.AsyncClient(base_url=url) as http, Watch(url, key=acme) as first:
            lock = await acquire(http, acme)
            [event] = await first.until(1)
            await http.delete(
                f"/v1/locks/{lock['id']}",
                headers={"Authorization": f"Bearer {acme}", "Lock-Token": lock["token"]},
            )
            await first.until(2)
            honest = Watch(url, key=acme, last_event_id=event.id)
            attack = Watch(url, key=mallory, last_event_id=POISONS[0])
            await asyncio.gather(honest.__aenter__(), attack.__aenter__())
            try:
                assert honest.status == 200, (honest.status, honest.problem)
                await honest.until(1, within=5)
                assert honest.kinds() == [("released", lock["id"])]
                assert not first.ended.is_set()
            finally:
                await asyncio.gather(honest.__aexit__(None, None, None), attack.__aexit__(None, None, None))


# A resume's replay is read by a statement of its own: what one organization's resumes cost, no
# other watcher waits for (the reader's own statement only bridges from each replay's end).


def history(db_url: str, organizations: int, locks: int, prefix: str = "busy-") -> None:
    """Ended locks of other organizations, as their workers would leave them (two events each),
    written in bulk: the service's trigger stamps them as it stamps every grant and release."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        for org in range(organizations):
            with conn.transaction():
                conn.execute(
                    "INSERT INTO helix_job_locks (organization_id, job_type, holder, token, acquired_at,"
                    " expires_at, fencing_token) SELECT %s, 'job-' || g, 'w', md5(g::text),"
                    " clock_timestamp(), clock_timestamp() + interval '30 s', 1"
                    " FROM generate_series(1, %s) g",
                    (f"{prefix}{org}" if organizations > 1 else prefix, locks),
                )
                conn.execute(
                    "UPDATE helix_job_locks SET released_at = clock_timestamp(), release_reason = 'released'"
                    " WHERE organization_id = %s AND released_at IS NULL",
                    (f"{prefix}{org}" if organizations > 1 else prefix,),
                )
        conn.execute("VACUUM ANALYZE helix_job_locks")


async def test_resumes_of_one_organization_do_not_delay_another_organizations_live_events(
    db_url: str, tmp_path: Path
) -> None:
    acme, mallory = keys.create(db_url, "acme"), keys.create(db_url, "mallory")
    with replicas(db_url, tmp_path) as [url]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            mallory_id = await _first_event_id(url, http, mallory, "mallory")
            # An hour of a busy service's history (other organizations), after mallory's id.
            history(db_url, organizations=20, locks=10_000)
            async with Watch(url, key=acme) as victim:
                # Mallory resumes from its (genuine, recent) id, a hundred times at once, which its
                # watcher limit (1,000) allows: each replays one event, after reading the history.
                resumes = [Watch(url, key=mallory, last_event_id=mallory_id) for _ in range(100)]
                opening = asyncio.gather(*(resume.__aenter__() for resume in resumes))
                await asyncio.sleep(0.3)
                started = time.monotonic()
                await acquire(http, acme)
                await victim.until(1, within=30)
                late = victim.events[0].arrived - (time.time() - (time.monotonic() - started))
                await opening
                statuses = sorted({resume.status for resume in resumes})
                await asyncio.gather(*(resume.__aexit__(None, None, None) for resume in resumes))
            assert late < 1.0, f"acme's event came {late:.1f} s late, behind mallory's resumes {statuses}"
            assert statuses == [200], statuses


# A resume past the replay limit is refused with 410 promptly, without holding its replay in the
# process (the statement reads one row more than the limit).


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


async def test_resumes_refused_for_their_length_do_not_hold_their_replays_in_memory(
    db_url: str, tmp_path: Path
) -> None:
    mallory = keys.create(db_url, "mallory")
    env = ROUTE.env(db_url, **FAST)
    with running_service(env=env, log=tmp_path / "s.log") as (url, process):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            async with Watch(url, key=mallory) as own:
                lock = await acquire(http, mallory, org="mallory")
                [event] = await own.until(1)
                await release(http, lock, mallory)
            # Mallory's own history: 50,000 grants and releases (its workers, or a loop of
            # acquire and release, within any quota), written in bulk for speed.
            history(db_url, organizations=1, locks=50_000, prefix="mallory")
            before = peak_rss_mb(process.pid)
            resumes = [Watch(url, key=mallory, last_event_id=event.id) for _ in range(4)]
            started = time.monotonic()
            await asyncio.gather(*(resume.__aenter__() for resume in resumes))
            took = time.monotonic() - started
            statuses = sorted({resume.status for resume in resumes})
            await asyncio.gather(*(resume.__aexit__(None, None, None) for resume in resumes))
            grown = peak_rss_mb(process.pid) - before
    assert statuses == [410], (statuses, f"after {took:.1f} s")
    assert took < 5, f"refused after {took:.1f} s"
    assert grown < 300, f"8 refused resumes of one organization grew the replica by {grown:.0f} MB"


# A replay is sent whole to a watcher that has read everything before it, and a read's events
# likewise: the backlog ends only a watcher that leaves events unread.


async def test_a_replay_longer_than_the_backlog_but_within_the_replay_limit_is_delivered_or_refused(
    db_url: str, tmp_path: Path
) -> None:
    with replicas(
        db_url, tmp_path, HELIX_LOCKS_EVENTS_BACKLOG="5", HELIX_LOCKS_EVENTS_REPLAY_LIMIT="100"
    ) as [url]:
        async with httpx.AsyncClient(base_url=url) as http, Watch(url) as watch:
            await acquire(http, job="first")
            [event] = await watch.until(1)
            for n in range(4):  # 8 events after it, each read alone: the live stream keeps up
                await release(http, await acquire(http, job=f"more-{n}"))
                await asyncio.sleep(0.1)
            await watch.until(9)
            assert not watch.ended.is_set()
            async with Watch(url, last_event_id=event.id) as resumed:
                await asyncio.sleep(1.0)
                if resumed.status == 200:
                    assert not resumed.ended.is_set() or len(resumed.events) == 8, (
                        f"accepted, then ended after {len(resumed.events)} of 8 events: the client"
                        " resumes from the same id and loops"
                    )
                    await resumed.until(8, within=5)
                else:
                    assert resumed.status == 410, resumed.problem


async def test_a_burst_larger_than_the_backlog_does_not_cut_a_prompt_reader_for_ever(
    db_url: str, tmp_path: Path
) -> None:
    """One window's events are measured against the backlog all at once, so a burst of more
    changes than the backlog within one poll cuts even a reader that takes every event at once;
    its resume then replays the same burst, and is cut again, for ever."""
    with replicas(db_url, tmp_path, HELIX_LOCKS_EVENTS_BACKLOG="5", HELIX_LOCKS_EVENTS_POLL_MS="1000") as [
        url
    ]:
        async with httpx.AsyncClient(base_url=url) as http, Watch(url) as watch:
            await acquire(http, job="first")
            [event] = await watch.until(1, within=5)
            await asyncio.gather(*(acquire(http, job=f"burst-{n}") for n in range(6)))
            await asyncio.sleep(2.5)
            cut = watch.ended.is_set()
            async with Watch(url, last_event_id=event.id) as resumed:
                await asyncio.sleep(1.5)
                assert resumed.status == 200
                progressed = len(resumed.events)
        assert not cut or progressed > 0, "cut by a burst, and its resume makes no progress"


# An expiry is reported by the window whose times hold expires_at; a grant or renewal that became
# visible only after its own lease had run out (a slow commit: a synchronous standby's
# acknowledgement, an fsync stall) gets its `expired` from the window that reads its commit.


async def test_a_lease_granted_by_a_slow_commit_still_gets_its_expired_event(
    db_url: str, tmp_path: Path
) -> None:
    with replicas(db_url, tmp_path) as [url]:
        async with Watch(url) as watch:
            with psycopg.connect(db_url) as conn:  # the grant's commit comes 1.5 s after its clock
                [lock_id, expires_at] = conn.execute(
                    "SELECT id, expires_at FROM helix_acquire_job_lock("
                    "'acme', 'report', 'w', 1000, NULL, NULL)"
                ).fetchone() or (None, None)
                await asyncio.sleep(1.5)
                conn.commit()
            await watch.until(1, within=5)
            await asyncio.sleep(1.5)
    assert watch.kinds() == [("acquired", lock_id), ("expired", lock_id)], (watch.kinds(), expires_at)


# A resume's replay and its bridge to the reader's windows reach the watcher whole, whatever the
# backlog (it cannot read before it joins): neither ends it, nor the reader, nor another
# organization's streams.


async def test_a_resume_whose_bridge_overflows_the_backlog_does_not_end_other_organizations_streams(
    db_url: str, tmp_path: Path
) -> None:
    acme, mallory = keys.create(db_url, "acme"), keys.create(db_url, "mallory")
    with replicas(
        db_url,
        tmp_path,
        HELIX_LOCKS_EVENTS_BACKLOG="5",
        HELIX_LOCKS_EVENTS_REPLAY_LIMIT="100",
        HELIX_LOCKS_EVENTS_POLL_MS="1000",
    ) as [url]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            event_id = await _first_event_id(url, http, mallory, "mallory")
            # Four events after it: a replay well within the backlog and the replay limit.
            await release(http, await acquire(http, mallory, org="mallory", job="a"), mallory)
            await release(http, await acquire(http, mallory, org="mallory", job="b"), mallory)
            async with Watch(url, key=acme) as victim:
                # Mallory's workers go on while it resumes: its bridge holds what they did between
                # the replay's snapshot and the reader's next read (up to a poll, a second).
                resume = Watch(url, key=mallory, last_event_id=event_id)
                opening = asyncio.create_task(resume.open())
                n = 0
                while not opening.done():
                    await release(http, await acquire(http, mallory, org="mallory", job=f"w{n}"), mallory)
                    n += 1
                await opening
                await asyncio.sleep(1.5)
                victim_ended = victim.ended.is_set()
                await acquire(http, acme, job="after")
                got = await victim.quiet(0.5, within=5)
                await resume.close()
        log = (tmp_path / "s0.log").read_text()
    assert "event reader failed" not in log, log[log.find("event reader failed") :][:1500]
    assert not victim_ended, "mallory's resume ended acme's stream"
    assert [e.type for e in got] == ["acquired"], [e.type for e in got]
    # A replay within the limits reaches a watcher that could not take anything yet.
    assert resume.status == 200, (resume.status, resume.problem)


# One replay of an organization at a time: its many resumes queue behind each other, and another
# organization's resume waits for at most the replays already being read.


async def test_one_organization_s_resumes_do_not_starve_another_organization_s_resume(
    db_url: str, tmp_path: Path
) -> None:
    acme, mallory = keys.create(db_url, "acme"), keys.create(db_url, "mallory")
    with replicas(db_url, tmp_path) as [url]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            acme_id = await _first_event_id(url, http, acme, "acme")
            mallory_id = await _first_event_id(url, http, mallory, "mallory")
            # A busy service's history after both ids (other organizations).
            history(db_url, organizations=20, locks=10_000)
            resumes = [Watch(url, key=mallory, last_event_id=mallory_id) for _ in range(100)]
            opening = asyncio.gather(*(resume.open() for resume in resumes))
            await asyncio.sleep(0.3)
            started = time.monotonic()
            async with Watch(url, key=acme, last_event_id=acme_id) as honest:
                took = time.monotonic() - started
                status, problem = honest.status, honest.problem
            await opening
            await asyncio.gather(*(resume.close() for resume in resumes))
    assert status == 200, (status, problem, f"after {took:.1f} s")
    assert took < 1.0, f"acme's resume waited {took:.1f} s behind mallory's resumes"
