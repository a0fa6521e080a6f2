"""GET /v1/events against careless and hostile clients: forged event ids, resumes that would
replay a lot or delay others, readers that fall behind, and commits slower than a lease."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import h11
import httpx
import psycopg
import pytest

from harness.processes import running_service
from harness.watch import Watch
from helix_locks.server import keys, queries, schemas
from helix_locks.server.db import Database, create_pool
from helix_locks.server.errors import OrganizationWatchersFull
from helix_locks.server.events import KEY_BYTES, EventHub, EventIds, Position, Window
from helix_locks.server.keys import ANONYMOUS, Caller, KeyRing
from tests.support import FAST, ROUTE, insert_ended, replicas
from tests.system.test_events import acquire, event_hub, event_ids, release

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


# A forged Last-Event-ID whose snapshot PostgreSQL refuses is refused (422) for that request
# alone: it neither ends, stalls nor fails the streams of other watchers in the same process.


async def _first_event_id(url: str, http: httpx.AsyncClient, key: str, org: str) -> str:
    async with Watch(url, key=key) as own:
        lock = await acquire(http, key, org=org, job="first")
        [event] = await own.until(1)
        await release(http, lock, key)
        await own.until(2)
    return event.id


def forged(db_url: str, after: str, until: str) -> str:
    """An id this service could have signed (the key is in its database) naming a window that
    PostgreSQL's pg_snapshot input refuses: what a leaked key would let a client send."""
    now = datetime.now(UTC)
    return event_ids(db_url).encode(Position(Window(after, now, until, now), (now, 1, 0)))


# Each passes EventIds.decode (the signature, the regular expression, xmax(after) <= xmax(until)),
# and each is refused by PostgreSQL's pg_snapshot input: xmin after xmax; an in-progress xid out
# of range; in-progress xids out of order; xmin 0.
POISONS = [("10:5:", "1:5:"), ("1:5:7", "1:5:"), ("1:9:5,3", "1:9:"), ("0:0:", "0:0:")]


@pytest.mark.parametrize("poison", POISONS, ids=["xmin>xmax", "xip-range", "xip-order", "zero"])
async def test_a_poisoned_resume_fails_alone_and_other_organizations_streams_go_on(
    db_url: str, tmp_path: Path, poison: tuple[str, str]
) -> None:
    acme, mallory = keys.create(db_url, "acme"), keys.create(db_url, "mallory")
    with replicas(db_url, tmp_path) as [url]:
        async with httpx.AsyncClient(base_url=url) as http, Watch(url, key=acme) as victim:
            await acquire(http, acme, job="before")
            await victim.until(1)
            async with Watch(url, key=mallory, last_event_id=forged(db_url, *poison)) as attack:
                pass
            # A made-up id is the client's mistake: 422, never a 500.
            assert attack.status in (400, 422), (attack.status, attack.problem)
            # Acme's next change is read after the forged id was: once it has come, whatever the
            # forged id did to the reader is done.
            await acquire(http, acme, job="after")
            await victim.until(2, within=5)
            assert not victim.ended.is_set(), "another organization's forged id ended this stream"
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
            attack = Watch(url, key=mallory, last_event_id=forged(db_url, *POISONS[0]))
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
    written in bulk: each organization's granted and ended by one transaction."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        for org in range(organizations):
            insert_ended(
                conn,
                "SELECT %s, 'job-' || g, 'w', md5(g::text), NULL::jsonb, 1, clock_timestamp(),"
                " clock_timestamp() + interval '30 s', clock_timestamp(), 'released'"
                " FROM generate_series(1, %s) g",
                (f"{prefix}{org}" if organizations > 1 else prefix, locks),
            )
        conn.execute("VACUUM ANALYZE helix_lock_history")


# Timed against each other, so run alone: in the fault stage (serial), not beside other tests.
@pytest.mark.fault
async def test_resumes_of_one_organization_do_not_delay_another_organizations_live_events(
    db_url: str, tmp_path: Path
) -> None:
    acme, mallory = keys.create(db_url, "acme"), keys.create(db_url, "mallory")
    with replicas(db_url, tmp_path) as [url]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            mallory_id = await _first_event_id(url, http, mallory, "mallory")
            # An hour of a busy service's history (other organizations), after mallory's id, and
            # 2,000 events of mallory's own: each of its resumes takes many statements, so that
            # a hundred of them, one at a time, take far longer than one of acme's.
            history(db_url, organizations=20, locks=10_000)
            padded_history(db_url, "mallory", 1000, pad=10)
            async with Watch(url, key=acme) as victim:
                # Mallory resumes from its (genuine, recent) id, a hundred times at once, which its
                # watcher limit (1,000) allows: each replays 2,000 events, after reading the history.
                resumes = [Watch(url, key=mallory, last_event_id=mallory_id) for _ in range(100)]
                opening = asyncio.gather(*(resume.__aenter__() for resume in resumes))
                await asyncio.sleep(0.3)
                started = time.monotonic()
                await acquire(http, acme)
                await victim.until(1, within=30)
                late = victim.events[0].arrived - (time.time() - (time.monotonic() - started))
                await opening
                theirs = time.monotonic() - started
                statuses = sorted({resume.status for resume in resumes})
                await asyncio.gather(*(resume.__aexit__(None, None, None) for resume in resumes))
            print(f"acme's event came {late:.2f} s late; mallory's 100 resumes took {theirs:.2f} s")
            # Behind mallory's resumes, acme's event would come about when the last of them opened.
            assert late < max(0.5, theirs / 3), (
                f"acme's event came {late:.1f} s late, of mallory's resumes' {theirs:.1f} s {statuses}"
            )
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


# What a stream holds is bounded in bytes: a catch-up is read and sent a page at a time, each once
# the client took the one before; a live stream that falls behind is ended with `retry:` and
# resumes; an organization past its share of the process gets 429 (issue 34, finding 8).


def padded_history(db_url: str, organization: str, locks: int, pad: int = 8000) -> None:
    """`locks` grants and releases of one organization, each lock with `pad` bytes of metadata as
    stored: two events each, written in bulk (one window for the grants, one for the releases)."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO helix_job_locks (organization_id, job_type, holder, token, acquired_at,"
            " expires_at, fencing_token, metadata) SELECT %s, 'job-' || g, 'w', md5(g::text),"
            " clock_timestamp(), clock_timestamp() + interval '30 s', 1,"
            " jsonb_build_object('pad', repeat('x', %s)) FROM generate_series(1, %s) g",
            (organization, pad, locks),
        )
        conn.execute(
            "UPDATE helix_job_locks SET released_at = clock_timestamp(), release_reason = 'released'"
            " WHERE organization_id = %s AND released_at IS NULL",
            (organization,),
        )


async def open_slowly(port: int, key: str, last_event_id: str | None = None) -> tuple[Any, Any, bytes]:
    """GET /v1/events from a raw socket that reads the answer's head and then nothing more (a
    refusal's body too, after its head)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    resume = f"Last-Event-ID: {last_event_id}\r\n" if last_event_id else ""
    writer.write(
        f"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n{resume}\r\n".encode()
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    if not head.startswith(b"HTTP/1.1 200"):
        head += await asyncio.wait_for(reader.read(65536), 30)
    return reader, writer, head


def dechunked(body: bytes) -> bytes:
    """A chunked HTTP/1.1 body, whole, as its chunks carried it."""
    out, rest = [], body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        out.append(rest[:size])
        rest = rest[size + 2 :]
        if size == 0:
            break
    return b"".join(out)


async def test_a_catch_up_longer_than_a_stream_may_hold_is_sent_whole_a_page_at_a_time(
    db_url: str, tmp_path: Path
) -> None:
    acme = keys.create(db_url, "acme")
    with replicas(
        db_url, tmp_path, HELIX_LOCKS_EVENTS_STREAM_BYTES="65536", HELIX_LOCKS_EVENTS_REPLAY_LIMIT="1000"
    ) as [url]:
        async with httpx.AsyncClient(base_url=url) as http:
            event_id = await _first_event_id(url, http, acme, "acme")
        padded_history(db_url, "acme", 300, pad=1000)  # 600 events, about 0.8 MB
        async with Watch(url, key=acme, last_event_id=event_id) as resumed:
            await resumed.until(601, within=30)
            await resumed.quiet(0.5)
            assert resumed.status == 200 and not resumed.ended.is_set()
    # The first lock's release, then the 600.
    assert resumed.events[0].type == "released"
    assert len(resumed.events) == 601 == len({event.id for event in resumed.events})


async def test_a_burst_larger_than_a_stream_may_hold_does_not_cut_a_prompt_reader(
    db_url: str, tmp_path: Path
) -> None:
    """A read's events always reach a watcher that took everything before them, however many."""
    acme = keys.create(db_url, "acme")
    with replicas(db_url, tmp_path, HELIX_LOCKS_EVENTS_STREAM_BYTES="65536") as [url]:
        async with Watch(url, key=acme) as watch:
            padded_history(db_url, "acme", 300, pad=1000)
            await watch.until(600, within=30)
            await watch.quiet(0.5)
            assert not watch.ended.is_set()
    assert len(watch.events) == 600


async def test_slow_resumes_of_a_large_backlog_hold_a_page_each_not_the_backlog(
    db_url: str, tmp_path: Path
) -> None:
    """20 resumes of a 3,200-event backlog whose locks hold 8 KiB of metadata each (27 MB of
    events), from clients that read nothing after the answer's head: the process grows by a page
    and a socket's buffers per stream, not by their replays."""
    mallory = keys.create(db_url, "mallory")
    env = ROUTE.env(db_url, **FAST)
    with running_service(env=env, log=tmp_path / "s.log") as (url, process):
        port = int(url.rsplit(":", 1)[1])
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            event_id = await _first_event_id(url, http, mallory, "mallory")
        padded_history(db_url, "mallory", 1600)
        before = peak_rss_mb(process.pid)
        slow = [await open_slowly(port, mallory, event_id) for _ in range(20)]
        await asyncio.sleep(5)  # the service sends what the sockets take, and holds the rest
        grown = peak_rss_mb(process.pid) - before
        for _, writer, _ in slow:
            writer.close()
    print(f"20 slow resumes of 3,200 events of 8 KiB: the process grew by {grown:.1f} MB at its peak")
    assert all(head.startswith(b"HTTP/1.1 200") for _, _, head in slow), [h[:40] for _, _, h in slow]
    assert grown < 150, f"20 slow resumes grew the process by {grown:.0f} MB"


def granted(db_url: str, organization: str, locks: int, pad: int = 8000) -> None:
    """`locks` grants of one organization in one transaction (one read's window), each lock with
    `pad` bytes of metadata as stored."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO helix_job_locks (organization_id, job_type, holder, token, acquired_at,"
            " expires_at, fencing_token, metadata) SELECT %s, 'job-' || md5(random()::text), 'w',"
            " md5(g::text), clock_timestamp(), clock_timestamp() + interval '30 s', 1,"
            " jsonb_build_object('pad', repeat('x', %s)) FROM generate_series(1, %s) g",
            (organization, pad, locks),
        )


async def test_an_organization_past_its_share_of_event_memory_gets_429_and_another_does_not(
    db_url: str,
) -> None:
    """Resumes of a large backlog whose clients read nothing hold keys and a page each, until
    their organization holds its share: its next stream gets 429, another organization's is
    admitted, and once its streams are gone it is admitted again."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        [(start,)] = conn.execute("SELECT pg_current_snapshot()::text").fetchall()
    padded_history(db_url, "mallory", 1600)
    now = datetime.now(UTC)
    resume = event_ids(db_url).encode(Position(Window(start, now, start, now), (now, 0, 0)))
    mallory, acme = Caller("key-mallory", "mallory"), Caller("key-acme", "acme")
    async with event_hub(
        db_url, max_per_organization=100, replay_limit=10_000, organization_bytes=512 * 1024
    ) as hub:
        streams = []
        refused = None
        for _ in range(50):  # never read: what each catch-up holds stays
            try:
                streams.append(await hub.watch(mallory, None, "mallory", None, resume))
            except OrganizationWatchersFull as exc:
                refused = exc
                break
            await asyncio.sleep(0.2)  # its first page is read and queued
        held = hub._held_by_organization["mallory"]
        theirs = await hub.watch(acme, None, "acme", None, None)
        for watcher in streams:
            hub.leave(watcher)
        again = await hub.watch(mallory, None, "mallory", None, None)
        hub.leave(theirs)
        hub.leave(again)
    assert 0 < len(streams) < 50, len(streams)
    assert refused is not None and refused.what == "bytes of events held"
    # Over by a page's one event a stream at most (8 KiB here).
    assert 512 * 1024 - 64 * KEY_BYTES <= held <= 512 * 1024 + len(streams) * 9 * 1024, held
    assert hub.held == 0


async def test_a_live_stream_that_falls_behind_is_ended_with_retry_and_its_resume_misses_nothing(
    db_url: str,
) -> None:
    """A live stream whose client left a read's events unread, and that the next read's would take
    past its bound (64 KiB here), is ended with `retry:`; resumed from the last event its client
    took, it misses nothing. One that took everything gets a read's events whatever their size
    (a page at a time if they pass its bound)."""
    async with event_hub(db_url, stream_bytes=64 * 1024) as hub:
        watcher = await hub.watch(ANONYMOUS, None, None, None, None)
        stream = hub.stream(watcher)
        taken = [await stream.__anext__(), await stream.__anext__()]  # the keep-alive, the join id
        granted(db_url, "acme", 5)  # 40 KiB: within its bound
        taken.append(await asyncio.wait_for(stream.__anext__(), 10))  # its client takes them
        granted(db_url, "acme", 5)  # queued: its client reads no more
        await until_true(lambda: watcher.queued > 0)
        granted(db_url, "acme", 5)  # would take it past 64 KiB with the 5 unread
        await until_true(lambda: watcher.ended)
        rest = [chunk async for chunk in stream]
        ids = [line[4:].decode() for line in b"".join(taken).split(b"\n") if line.startswith(b"id: ")]
        resumed = await hub.watch(ANONYMOUS, None, None, None, ids[-1])
        again = hub.stream(resumed)
        got = [await again.__anext__()]
        while b"".join(got).count(b"\nevent: ") < 10:
            got.append(await asyncio.wait_for(again.__anext__(), 10))
        hub.leave(resumed)
    assert rest == [b"retry: 1000\n\n"], rest
    assert b"".join(taken).count(b"\nevent: acquired") == 5
    assert b"".join(got).count(b"\nevent: acquired") == 10
    assert hub.held == 0


async def until_true(condition: Any, within: float = 10) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.01)


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
# bounds (it cannot read before it joins): neither ends it, nor the reader, nor another
# organization's streams.


async def test_a_resume_whose_bridge_carries_much_does_not_end_other_organizations_streams(
    db_url: str, tmp_path: Path
) -> None:
    acme, mallory = keys.create(db_url, "acme"), keys.create(db_url, "mallory")
    with replicas(
        db_url,
        tmp_path,
        HELIX_LOCKS_EVENTS_REPLAY_LIMIT="100",
        HELIX_LOCKS_EVENTS_POLL_MS="1000",
    ) as [url]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            event_id = await _first_event_id(url, http, mallory, "mallory")
            # Four events after it: a replay well within the replay limit.
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


@pytest.mark.fault  # timed against mallory's, so run alone (the fault stage is serial)
async def test_one_organization_s_resumes_do_not_starve_another_organization_s_resume(
    db_url: str, tmp_path: Path
) -> None:
    acme, mallory = keys.create(db_url, "acme"), keys.create(db_url, "mallory")
    with replicas(db_url, tmp_path) as [url]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            acme_id = await _first_event_id(url, http, acme, "acme")
            mallory_id = await _first_event_id(url, http, mallory, "mallory")
            # A busy service's history after both ids (other organizations), and 2,000 events of
            # mallory's own, so that each of its resumes takes many statements.
            history(db_url, organizations=20, locks=10_000)
            padded_history(db_url, "mallory", 1000, pad=10)
            resumes = [Watch(url, key=mallory, last_event_id=mallory_id) for _ in range(100)]
            opening = asyncio.gather(*(resume.open() for resume in resumes))
            await asyncio.sleep(0.3)
            started = time.monotonic()
            async with Watch(url, key=acme, last_event_id=acme_id) as honest:
                took = time.monotonic() - started
                status, problem = honest.status, honest.problem
            await opening
            theirs = time.monotonic() - started
            await asyncio.gather(*(resume.close() for resume in resumes))
    print(f"acme's resume took {took:.2f} s, mallory's 100 resumes {theirs:.2f} s")
    assert status == 200, (status, problem, f"after {took:.1f} s")
    # Behind mallory's resumes, acme's would take about as long as they do.
    assert took < max(0.5, theirs / 3), f"acme's resume took {took:.1f} s of mallory's {theirs:.1f} s"


# Event ids are signed with a key kept in the database (issue 34, finding 10): a resume starts only
# where a stream of this service was, and reads its own organization's changes alone.


async def test_an_altered_or_foreign_event_id_is_422_and_one_of_an_earlier_version_is_410(
    db_url: str, tmp_path: Path
) -> None:
    acme = keys.create(db_url, "acme")
    with replicas(db_url, tmp_path) as [url]:
        async with httpx.AsyncClient(base_url=url) as http:
            genuine = await _first_event_id(url, http, acme, "acme")
        payload, _, mac = genuine.partition(".")
        raw = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        # The whole history: a window opened at the first transaction, in 1970.
        raw[0], raw[1] = "1:1:", "1970-01-01T00:00:00+00:00"
        altered = base64.urlsafe_b64encode(json.dumps(raw).encode()).decode().rstrip("=") + "." + mac
        position = event_ids(db_url).decode(genuine)
        foreign = EventIds(b"another deployment's key").encode(position)
        # What the builds before signed ids sent: the same fields, unsigned.
        earlier = base64.urlsafe_b64encode(json.dumps(raw).encode()).decode().rstrip("=")
        answers = {}
        for name, event_id in (("altered", altered), ("foreign", foreign), ("earlier", earlier)):
            async with Watch(url, key=acme, last_event_id=event_id) as refused:
                answers[name] = (refused.status, (refused.problem or {}).get("detail", ""))
        async with Watch(url, key=acme, last_event_id=genuine) as honest:
            status = honest.status
    assert answers["altered"][0] == answers["foreign"][0] == 422, answers
    assert answers["earlier"][0] == 410 and "earlier version" in answers["earlier"][1], answers
    assert status == 200


def test_a_resume_reads_the_changes_of_its_own_organization_alone(db_url: str) -> None:
    """With a busy organization's history after the id, a resume of another organization reads
    its window on the organization's indexes (the plan, as auto_explain reports it)."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        start = conn.execute("SELECT pg_current_snapshot()::text").fetchone()
        assert start is not None
        history(db_url, organizations=1, locks=20_000, prefix="busy")
        plans: list[str] = []
        conn.add_notice_handler(lambda notice: plans.append(notice.message_primary or ""))
        conn.execute("LOAD 'auto_explain'")
        for name, value in (
            ("log_min_duration", "0"),
            ("log_nested_statements", "on"),
            ("log_analyze", "on"),
            ("log_level", "notice"),
        ):
            conn.execute("SELECT set_config(%s, %s, false)", (f"auto_explain.{name}", value))
        rows = conn.execute(
            "SELECT count(*) FROM helix_window_events(%s::pg_snapshot, pg_current_snapshot(), 'acme', NULL)",
            (start[0],),
        ).fetchone()
    window = next(plan for plan in plans if "WITH changed AS" in plan)
    assert rows == (0,)
    # The history by the end's transaction within the organization; the live locks by its own range.
    assert "Index Cond: ((organization_id = 'acme'::text) AND (ended_xid >=" in window, window
    assert "on helix_holds" in window and "Index Cond: (organization_id = 'acme'::text)" in window, window
    assert "rows=20000" not in window and "Rows Removed by Filter" not in window, window


# A reader's window with more changes than one read may hold (some organization's burst, or a
# reader away for long) is not read: its watchers catch up on their own, each on its own
# organization's changes, and no stream ends for it. A stream is sent an id when it joins, so that
# one cut before its first event resumes from there. (Found by review: every organization's
# streams were ended, and one with no event yet lost its own change.)

GRANT = "SELECT id FROM helix_acquire_job_lock(%s, %s, 'w', 30000, NULL, NULL)"


async def test_one_organizations_burst_does_not_end_another_organizations_stream(
    db_url: str, tmp_path: Path
) -> None:
    acme = keys.create(db_url, "acme")  # mallory's burst is written by its own worker (SQL)
    env = ROUTE.env(db_url, **FAST, HELIX_LOCKS_EVENTS_REPLAY_LIMIT="5")
    with running_service(env=env, log=tmp_path / "s.log") as (url, _):
        async with httpx.AsyncClient(base_url=url) as http, Watch(url, key=acme) as theirs:
            first = await acquire(http, acme, org="acme", job="before")
            await theirs.until(1)
            # Mallory's six grants commit together (its own transaction; or six requests that
            # land in one read).
            with psycopg.connect(db_url) as conn:
                for n in range(6):
                    conn.execute(GRANT, ("mallory", f"burst-{n}"))
            # Acme's next grant commits after the burst: once it has come, the burst's window has
            # been read, and whatever it did to acme's stream is done.
            later = await acquire(http, acme, org="acme", job="after")
            await theirs.until(2, within=10)
            ended, outcome, kinds = theirs.ended.is_set(), theirs.outcome, theirs.kinds()
    assert not ended, f"acme's stream was ended ({outcome}) by mallory's burst of 6 grants"
    assert kinds == [("acquired", first["id"]), ("acquired", later["id"])], kinds


async def test_a_stream_ended_for_another_organizations_burst_loses_its_own_change(
    db_url: str, tmp_path: Path
) -> None:
    """Acme's stream has had no event yet (so no id); acme's own grant commits in the window that
    mallory's burst overflows. The stream ends with `retry:` and no id, so the client reconnects
    afresh (what EventSource and the SDKs do), and acme's grant never reaches it."""
    acme = keys.create(db_url, "acme")
    slow = {**FAST, "HELIX_LOCKS_EVENTS_POLL_MS": "500"}
    env = ROUTE.env(db_url, **slow, HELIX_LOCKS_EVENTS_REPLAY_LIMIT="5")
    with running_service(env=env, log=tmp_path / "s.log") as (url, _):
        async with Watch(url, key=acme) as theirs:
            # Acme's worker and mallory's burst commit within a millisecond (one window).
            with psycopg.connect(db_url) as ours, psycopg.connect(db_url) as burst:
                [(granted,)] = ours.execute(GRANT, ("acme", "report")).fetchall()
                for n in range(6):
                    burst.execute(GRANT, ("mallory", f"burst-{n}"))
                ours.commit()
                burst.commit()
            await theirs.quiet(1.5)
            ended, got = theirs.ended.is_set(), theirs.kinds()
        # What a client does next: resume with the last id it has, or, having none, watch afresh.
        last = theirs.events[-1].id if theirs.events else None
        async with Watch(url, key=acme, last_event_id=last) as again:
            await again.quiet(1.5)
            got_again = again.kinds()
    assert ("acquired", granted) in got + got_again, (
        f"acme's grant of lock {granted} never reached acme's watcher: its stream ended={ended} "
        f"with events {got} (no id to resume from), and the next stream got {got_again}"
    )


# A window that takes longer to read than a statement may (statement timeout) is given up the same
# way, rather than read again and again while it grows; and a catch-up reads again from where it
# ended until little is left, so that the bridge the reader's one statement reads for it holds a
# poll's changes, however slowly its client reads. (Found by review: one organization's slowly
# read resume stopped the reader of every organization for good.)


async def _arrived(watch: Watch, lock_id: int, within: float) -> bool:
    """Whether the lock's `acquired` reaches the open stream within that many seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and not watch.ended.is_set():
        if ("acquired", lock_id) in watch.kinds():
            return True
        await asyncio.sleep(0.05)
    return ("acquired", lock_id) in watch.kinds()


async def _trickle(port: int, key: str, last_event_id: str, fast: asyncio.Event) -> None:
    """A resume read slowly (about 100 KiB a second: more than the edge's write rate asks, 64 KiB)
    until `fast` is set, then as fast as it comes; resumed from its last event, as a client does,
    whenever the service ends it (a stream that holds too much is ended with `retry:`), until
    cancelled."""
    while True:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
        http = h11.Connection(h11.CLIENT)
        headers = [("Host", "127.0.0.1"), ("Authorization", f"Bearer {key}")]
        headers.append(("Last-Event-ID", last_event_id))
        writer.write(http.send(h11.Request(method="GET", target="/v1/events", headers=headers)) or b"")
        writer.write(http.send(h11.EndOfMessage()) or b"")
        text, ended = b"", False
        try:
            while not ended:
                raw = await reader.read(16 * 1024 if not fast.is_set() else 1 << 20)
                http.receive_data(raw)
                while (event := http.next_event()) is not h11.NEED_DATA:
                    if isinstance(event, h11.Data):
                        *lines, text = (text + bytes(event.data)).split(b"\n")
                        last_event_id = next(
                            (line[4:].decode() for line in reversed(lines) if line.startswith(b"id: ")),
                            last_event_id,
                        )
                    elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                        ended = True
                        break
                if not fast.is_set():
                    await asyncio.sleep(0.15)
        except h11.RemoteProtocolError:  # cut off within an answer
            pass
        finally:
            writer.close()
        await asyncio.sleep(0.1)


@pytest.mark.fault  # 200,000 writes timed against a reader: run alone (the fault stage is serial)
async def test_a_slowly_read_resume_of_one_organization_does_not_stop_every_stream_of_the_process(
    db_url: str, tmp_path: Path
) -> None:
    acme, mallory = keys.create(db_url, "acme"), keys.create(db_url, "mallory")
    # (A replay limit above the test's bursts: in the test, mallory's changes of a long catch-up
    # come within seconds, and the reader's own windows must not overflow; see finding 1. And a
    # write timeout and stream bounds well above the defaults: on a loaded machine mallory's stream
    # was ended for what it held, by design and sooner than the test meant; the trickle resumes
    # then, but the subject here is a stream that stays slow. The tests above drive those bounds.)
    env = ROUTE.env(
        db_url, **FAST, HELIX_LOCKS_STATEMENT_TIMEOUT_MS="1000", HELIX_LOCKS_EVENTS_REPLAY_LIMIT="100000",
        HELIX_LOCKS_WRITE_TIMEOUT_SECONDS="120", HELIX_LOCKS_EVENTS_STREAM_BYTES=str(256 * 2**20),
        HELIX_LOCKS_EVENTS_MEMORY_BYTES=str(1024 * 2**20),
    )  # fmt: skip
    log = tmp_path / "s.log"
    with running_service(env=env, log=log) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            mallory_id = await _first_event_id(url, http, mallory, "mallory")
            padded_history(db_url, "mallory", 150)  # 300 events of 8 KiB to catch up on
            async with Watch(url, key=acme) as theirs:
                fast = asyncio.Event()
                reading = asyncio.create_task(_trickle(port, mallory, mallory_id, fast))
                await asyncio.sleep(1.0)
                # Mallory's workers go on meanwhile: 200,000 small changes, 250 a transaction (into
                # helix_holds itself: the helix_job_locks view's trigger takes them one row at a time).
                started = time.monotonic()

                def write() -> None:
                    with psycopg.connect(db_url, autocommit=True) as conn:
                        for batch in range(800):
                            conn.execute(
                                "INSERT INTO helix_holds (organization_id, job_type, holder, token,"
                                " acquired_at, expires_at, fencing_token) SELECT 'mallory', %s || g, 'w',"
                                " md5(g::text), clock_timestamp(), clock_timestamp() + interval '1 h', 1"
                                " FROM generate_series(1, 250) g",
                                (f"b{batch}-",),
                            )

                await asyncio.to_thread(write)
                wrote = time.monotonic() - started
                assert not reading.done(), f"the trickle failed: {reading}"
                # (Recorded, not asserted: in this compressed run the reader may already be stuck on
                # its own window of mallory's changes, the same failure by another road.)
                control = await acquire(http, acme, org="acme", job="control")
                control_came = await _arrived(theirs, control["id"], 5)
                fast.set()  # mallory reads the rest of its catch-up now: its watcher bridges
                await asyncio.sleep(3)
                lock = await acquire(http, acme, org="acme", job="report")
                came = await _arrived(theirs, lock["id"], 10)
                reading.cancel()
    assert came, (
        f"acme's grant of lock {lock['id']} did not reach acme's live stream in 10 s after a resume "
        f"of mallory's bridged (writes took {wrote:.1f} s; acme's stream ended: {theirs.outcome}; "
        f"acme's grant before the bridge arrived: {control_came})\n"
        + "\n".join(line for line in log.read_text().splitlines() if "reader" in line)[-2000:]
    )


# The process's memory for events is shared among the organizations streaming: when another starts,
# the streams of those past their smaller share are ended (most holding first), and a catch-up's
# page holds what the shares leave room for (at least one event). (Found by review: the first
# organization could fill the process, the second half of it again, and so on.)


async def test_slow_resumes_of_several_organizations_stay_within_the_process_bound(db_url: str) -> None:
    organizations = [f"org-{n}" for n in range(4)]
    with psycopg.connect(db_url, autocommit=True) as conn:
        [(start,)] = conn.execute("SELECT pg_current_snapshot()::text").fetchall()
    for organization in organizations:
        padded_history(db_url, organization, 100)  # 200 events of 8 KiB to catch up on, each
    now = datetime.now(UTC)
    resume = event_ids(db_url).encode(Position(Window(start, now, start, now), (now, 0, 0)))

    memory = 4 * 1024 * 1024
    settings = ROUTE.settings(db_url, allow_anonymous=True)
    pool = create_pool(settings)
    await pool.open()
    db = Database(pool, settings)
    hub = EventHub(
        db, KeyRing(db, allow_anonymous=True), schemas.event_data, poll_seconds=0.02, max_watchers=1000,
        max_per_organization=1000, replay_limit=1000, stream_bytes=1024 * 1024, memory_bytes=memory,
        organization_bytes=0, keep=None, keepalive_seconds=1,
    )  # fmt: skip
    admitted: dict[str, int] = {}
    try:
        for organization in organizations:
            caller = Caller(f"key-{organization}", organization)
            admitted[organization] = 0
            while True:  # slow readers: each stream is never read after its head
                try:
                    await hub.watch(caller, None, organization, None, resume)
                except OrganizationWatchersFull:
                    break
                admitted[organization] += 1
                await asyncio.sleep(0.3)  # its first page is read and queued
        held = hub.held
    finally:
        hub.close()
        await db.close()
    # A catch-up's page takes at least one event (8 KiB here) whatever the room: one per stream over.
    assert held <= memory + sum(admitted.values()) * 9 * 1024, (
        f"the process holds {held / 2**20:.1f} MiB of events for slow streams, past its bound of "
        f"{memory / 2**20:.0f} MiB (HELIX_LOCKS_EVENTS_MEMORY_BYTES); streams admitted: {admitted}"
    )


def test_the_reader_s_statement_reads_the_locks_of_its_events_alone(db_url: str) -> None:
    """The reader's one statement looks up the lock of each event it read by id: joined to the
    view, which reads the clock, PostgreSQL read the whole table (130 ms a poll under bench.events'
    load, found by the bench)."""
    history(db_url, organizations=1, locks=20_000, prefix="busy")
    with psycopg.connect(db_url, autocommit=True) as conn:
        start = conn.execute("SELECT pg_current_snapshot()::text").fetchone()
        assert start is not None
        for n in range(5):
            conn.execute(
                "SELECT id FROM helix_acquire_job_lock('acme', %s, 'w', 30000, NULL, NULL)", (f"job-{n}",)
            )
        conn.execute("ANALYZE helix_job_locks")
        params = {"after": [start[0]], "organization_id": [None], "job_type": [None], "limit": [100]}
        plan = "\n".join(row[0] for row in conn.execute("EXPLAIN ANALYZE " + queries.EVENTS, params))
        rows = conn.execute(queries.EVENTS, params).fetchall()
    assert len(rows) == 5
    assert "Seq Scan on helix_job_locks" not in plan, plan


# Review, second round: what a live read or a bridge sends to a watcher is bounded too, a resume
# reads its keys a chunk at a time, and a fallback ends no stream. Each test failed before its fix.


async def _prompt(hub: EventHub, caller: Caller, count: int) -> tuple[list[Any], list[Any]]:
    """Streams of the caller's organization whose clients took everything (the join's lines)."""
    assert caller.organization_id is not None
    watchers = [await hub.watch(caller, None, caller.organization_id, None, None) for _ in range(count)]
    streams = [hub.stream(watcher) for watcher in watchers]
    for stream in streams:
        assert await anext(stream)  # the keep-alive: joined
        assert b"id:" in await anext(stream)  # the join id
    return watchers, streams


async def test_one_organizations_burst_to_prompt_readers_stays_within_the_process_bound(db_url: str) -> None:
    """A read's events reach a watcher that took everything only within its stream's bound and its
    organization's share; beyond, it catches up a page at a time (a live read was queued whole)."""
    memory = 1024 * 1024
    async with event_hub(db_url, memory_bytes=memory, stream_bytes=256 * 1024, replay_limit=1000) as hub:
        prompt, streams = await _prompt(hub, Caller("key-mallory", "mallory"), 4)
        granted(db_url, "mallory", 100)  # 100 of its workers at once, 8 KiB of metadata each
        await until_true(lambda: all(watcher.queued or not watcher.live for watcher in prompt))
        await asyncio.sleep(0.3)
        held = hub.held
        for stream in streams:
            await stream.aclose()
    # A catch-up's page takes at least one event (8 KiB here) whatever the room.
    assert held <= memory + len(prompt) * 9 * 1024, f"{held / 2**20:.1f} MiB held"


async def test_one_organizations_burst_to_prompt_readers_does_not_end_another_organizations_stream(
    db_url: str,
) -> None:
    memory = 1024 * 1024
    async with event_hub(db_url, memory_bytes=memory, stream_bytes=256 * 1024, replay_limit=1000) as hub:
        theirs = await hub.watch(Caller("key-acme", "acme"), None, "acme", None, None)
        granted(db_url, "acme", 1, pad=10)  # one small event its client has yet to read
        await until_true(lambda: len(theirs.events) >= 2)
        prompt, streams = await _prompt(hub, Caller("key-mallory", "mallory"), 2)
        granted(db_url, "mallory", 100)
        await until_true(lambda: all(watcher.queued or not watcher.live for watcher in prompt))
        granted(db_url, "acme", 1, pad=10)  # acme's next change
        await until_true(lambda: len(theirs.events) >= 3 or theirs.ended)
        ended = theirs.ended
        for stream in streams:
            await stream.aclose()
    assert not ended, "acme's stream was ended for what mallory's streams hold"


async def test_a_resume_within_the_replay_limit_is_not_refused_while_its_organization_holds_nothing(
    db_url: str,
) -> None:
    """A resume reads its keys a chunk at a time, as much as half its organization's room
    holds: 8,000 events behind, with 1 MiB for every stream, it is admitted."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        [(start,)] = conn.execute("SELECT pg_current_snapshot()::text").fetchall()
    now = datetime.now(UTC)
    resume = event_ids(db_url).encode(Position(Window(start, now, start, now), (now, 0, 0)))
    history(db_url, organizations=1, locks=4000, prefix="acme")
    async with event_hub(db_url, memory_bytes=1024 * 1024, replay_limit=10_000) as hub:
        watcher = await hub.watch(Caller("key-acme", "acme"), None, "acme", None, resume)
        stream = hub.stream(watcher)
        got = 0
        async for chunk in stream:
            got += chunk.count(b"\nevent: ")
            if got >= 8000:
                break
        held = hub._held_by_organization["acme"]
        await stream.aclose()  # type: ignore[attr-defined]
    assert got == 8000
    assert held <= 1024 * 1024 + 9 * 1024


async def test_another_organizations_burst_does_not_end_an_organizations_streams(db_url: str) -> None:
    """A read of more changes than one may hold (mallory's burst, with a replay limit of 10) sends
    every live stream through a catch-up of its own: acme's 800 wait their turns, however long
    (a turn's deadline ended them with retry:), and each gets acme's next event."""
    async with event_hub(db_url, statement_timeout_ms=100, replay_limit=10, max_watchers=1000,
                         max_per_organization=1000) as hub:  # fmt: skip
        watchers = [await hub.watch(Caller("key-acme", "acme"), None, "acme", None, None) for _ in range(800)]
        got: dict[int, int] = {}

        async def read(watcher: Any) -> None:
            async for chunk in hub.stream(watcher):
                got[id(watcher)] = got.get(id(watcher), 0) + chunk.count(b'"organization_id":"acme"')

        readers = [asyncio.create_task(read(watcher)) for watcher in watchers]
        await asyncio.sleep(0.5)
        granted(db_url, "mallory", 20, pad=10)  # more than a read may hold
        granted(db_url, "acme", 1, pad=10)

        def heard() -> int:
            return sum(got.get(id(w), 0) >= 1 or w.ended for w in watchers)

        await until_true(lambda: heard() >= len(watchers), within=60)
        ended = sum(watcher.ended for watcher in watchers)
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    assert ended == 0, f"{ended} of acme's 800 streams ended for mallory's burst"
    assert set(got.values()) == {1}


async def test_bridges_to_clients_that_read_nothing_stay_within_the_process_bound(db_url: str) -> None:
    """A bridge reaches a resumed watcher only within its bounds; else it catches up again, a page
    at a time once its client takes the one before (a bridge was queued whole, 64 events)."""
    memory = 1024 * 1024
    with psycopg.connect(db_url, autocommit=True) as conn:
        [(start,)] = conn.execute("SELECT pg_current_snapshot()::text").fetchall()
    now = datetime.now(UTC)
    resume = event_ids(db_url).encode(Position(Window(start, now, start, now), (now, 0, 0)))
    async with event_hub(db_url, memory_bytes=memory, stream_bytes=256 * 1024, replay_limit=1000) as hub:
        original = hub._next
        burst: list[bool] = []

        async def bridging_after_a_burst(window: Any) -> Any:
            if not burst and any(w.at_bridge for w in hub._watchers):
                burst.append(True)
                await until_true(lambda: sum(w.at_bridge for w in hub._watchers) == 4)
                await asyncio.to_thread(granted, db_url, "mallory", 60)  # 60 changes within a poll
            return await original(window)

        hub._next = bridging_after_a_burst  # type: ignore[method-assign]
        mallory = Caller("key-mallory", "mallory")
        slow = [await hub.watch(mallory, None, "mallory", None, resume) for _ in range(4)]
        await until_true(lambda: bool(burst))
        await asyncio.sleep(0.5)  # the reader's bridging read and a few more polls
        held = hub.held
    assert held <= memory + len(slow) * 9 * 1024, f"{held / 2**20:.1f} MiB held"
