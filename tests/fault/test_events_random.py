"""The event stream's promise, checked at random against the database's history: writers whose
transactions commit late (some after their own lease ran out), renewals and releases racing
expiries, an operator forcing locks; watchers that stay live on two replicas, and watchers cut
every few seconds that resume alternately on the replicas and on one restarted meanwhile.

Every watcher must deliver each state change exactly once, in commit order per pair; an
`expired` exactly for each lease that the history shows ran out (the renewal or release after it
came later, or none came), never for one renewed or released before its end; a `renewed` only
for a renewal that committed, never twice. The history is the database's rows and what the
writers' committed statements answered (issue 34)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from harness.history import database_history
from harness.processes import running_service
from harness.watch import Event, Watch
from tests.fault.test_events_stress import STATE_CHANGES, changes, differences, history, no_errors_logged
from tests.support import FAST, ROUTE, replicas

# A fault test: run by `scripts/test -m fault`, after the default suite (docs/development.md).
pytestmark = [pytest.mark.anyio, pytest.mark.fault]

PAIRS = [("acme", f"job-{n}") for n in range(10)]
WRITERS = 6
SECONDS = 15.0
GRANT = "SELECT id, token, expires_at FROM helix_acquire_job_lock(%s, %s, 'w', %s, NULL, NULL)"
RENEW = "SELECT expires_at, lapsed FROM helix_renew_job_lock(%s, %s, %s, NULL)"
RELEASE = "SELECT released_at FROM helix_release_job_lock(%s, %s, NULL)"
FORCE = "SELECT released_at FROM helix_force_release_job_lock(%s, 'operator')"
# What a writer's statement may be refused with: the pair held (23505), the lock ended (HL003).
REFUSED = ("23505", "HL003")


class Abort(Exception):
    """A writer rolls its transaction back on purpose."""


@dataclass
class Lease:
    """A lock as its writer knows it: the ends of its leases in order, and its committed renewals
    (the time each was made, the new end, and whether the lease before had run out)."""

    lock_id: int
    token: str
    ends: list[datetime]
    renewals: list[tuple[datetime, datetime, bool]] = field(default_factory=list)


@dataclass
class Writers:
    """What the writers committed, for the checker."""

    leases: dict[int, Lease] = field(default_factory=dict)
    commits: Counter[str] = field(default_factory=Counter)


def lateness(rng: random.Random) -> float:
    """How long a transaction stays open after its statement: mostly not at all, sometimes longer
    than a lease."""
    roll = rng.random()
    if roll < 0.6:
        return 0.0
    if roll < 0.85:
        return rng.uniform(0.02, 0.3)
    return rng.uniform(1.05, 1.6)


async def write(db_url: str, rng: random.Random, writers: Writers, stop: asyncio.Event) -> None:
    """One worker: takes a pair, renews (sometimes after the lease ran out), releases or abandons
    it; every statement in a transaction that may commit late, or be rolled back."""
    held: Lease | None = None
    async with await psycopg.AsyncConnection.connect(db_url) as conn:
        while not stop.is_set():
            await asyncio.sleep(rng.uniform(0.0, 0.3))
            roll = rng.random()
            try:
                async with conn.transaction():
                    if held is None:
                        org, job = rng.choice(PAIRS)
                        cursor = await conn.execute(GRANT, (org, job, rng.choice((1000, 1500, 2000))))
                        row = await cursor.fetchone()
                        assert row is not None
                        done: Any = ("grant", Lease(row[0], row[1], [row[2]]))
                    elif roll < 0.55:
                        ttl = rng.choice((1000, 1500, 2000))
                        cursor = await conn.execute(RENEW, (held.lock_id, held.token, ttl))
                        row = await cursor.fetchone()
                        assert row is not None
                        done = ("renew", (row[0] - timedelta(milliseconds=ttl), row[0], row[1]))
                    elif roll < 0.85:
                        await conn.execute(RELEASE, (held.lock_id, held.token))
                        done = ("release", None)
                    else:
                        done = ("abandon", None)
                    await asyncio.sleep(lateness(rng))
                    if rng.random() < 0.05:
                        raise Abort()
            except Abort:
                continue
            except psycopg.Error as exc:
                if exc.sqlstate not in REFUSED:
                    raise
                if held is not None and exc.sqlstate == "HL003":
                    held = None  # it ended: reclaimed or forced meanwhile
                continue
            kind, what = done
            writers.commits[kind] += 1
            if kind == "grant":
                held = what
                writers.leases[held.lock_id] = held
            elif kind == "renew":
                assert held is not None
                held.renewals.append(what)
                held.ends.append(what[1])
            else:
                held = None
            if held is not None and rng.random() < 0.4:
                await asyncio.sleep(rng.uniform(0.9, 2.1))  # late for its next renewal, often


async def operate(db_url: str, rng: random.Random, stop: asyncio.Event) -> int:
    """An operator forcing a random live lock now and then; how many it forced."""
    forced = 0
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        while not stop.is_set():
            await asyncio.sleep(rng.uniform(0.5, 1.5))
            cursor = await conn.execute("SELECT id FROM helix_job_locks WHERE released_at IS NULL")
            live = [row[0] for row in await cursor.fetchall()]
            if live:
                try:
                    await conn.execute(FORCE, (rng.choice(live),))
                    forced += 1
                except psycopg.Error as exc:
                    if exc.sqlstate != "HL003":  # else it ended meanwhile
                        raise
    return forced


@dataclass
class Hopper:
    """A watcher that is cut and resumes again and again, each time on the next replica; its
    events are those of all its connections."""

    name: str
    by_count: bool
    events: list[Event] = field(default_factory=list)
    connections: int = 0
    refusals: list[str] = field(default_factory=list)

    async def hop(self, urls: Callable[[], list[str]], rng: random.Random, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._leg(urls, rng, stop)

    async def _leg(
        self, urls: Callable[[], list[str]], rng: random.Random, stop: asyncio.Event | None
    ) -> None:
        """One connection: until cut (by time or by a count of events), or, without `stop`, until
        the stream is quiet."""
        targets = urls()
        url = targets[self.connections % len(targets)]
        self.connections += 1
        last = self.events[-1].id if self.events else None
        count = rng.randint(1, 25) if self.by_count and stop is not None else None
        watch = Watch(url, last_event_id=last, stop_after=count)
        try:
            await watch.open()
        except Exception as exc:  # a replica being restarted: the next one
            self.refusals.append(f"{url}: {exc!r}")
            await watch.close()
            return
        try:
            if watch.status != 200:
                self.refusals.append(f"{url}: {watch.status} {watch.problem}")
                assert watch.status in (0, 503), (watch.status, watch.problem)
                return
            if stop is None:
                await watch.quiet(1.0, within=60)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(watch.ended.wait(), rng.uniform(0.5, 2.5))
        finally:
            await watch.close()
            self.events.extend(watch.events)


Expiries = Counter[tuple[int, datetime]]


def expected_expiries(writers: Writers, db_url: str, until: datetime) -> tuple[Expiries, list[str]]:
    """The expiries the history holds, per lock and time, and where the writers' record and the
    database's disagree (a fault of the harness, not of the stream)."""
    with psycopg.connect(db_url) as conn:
        rows = {
            row[0]: row[1:]
            for row in conn.execute("SELECT id, released_at, coalesce(lapses, '{}') FROM helix_job_locks")
        }
    wanted: Expiries = Counter()
    harness = []
    for lease in writers.leases.values():
        released_at, lapses = rows[lease.lock_id]
        lapsed = [lease.ends[n] for n, (_, _, ran_out) in enumerate(lease.renewals) if ran_out]
        if lapsed != list(lapses):
            harness.append(f"lock {lease.lock_id}: renewals after lapses {lapsed}, the database's {lapses}")
        last = lease.ends[-1]
        if (released_at is None and last <= until) or (released_at is not None and last <= released_at):
            lapsed.append(last)
        wanted.update((lease.lock_id, end) for end in lapsed)
    return wanted, harness


def judge(events: list[Event], writers: Writers, db_url: str, until: datetime) -> list[str]:
    """Every way a watcher's events break the promise, against the history."""
    grants = database_history(db_url)
    found = differences(changes(events), history(grants))
    wanted, _ = expected_expiries(writers, db_url, until)
    got = Counter(
        (e.data["lock"]["id"], datetime.fromisoformat(e.data["at"])) for e in events if e.type == "expired"
    )
    for key in sorted((got | wanted).keys()):
        if got[key] != wanted[key]:
            what = "made up" if not wanted[key] else "missing" if not got[key] else "repeated"
            found.append(f"expired of lock {key[0]} at {key[1].isoformat()}: {what} ({got[key]} sent)")
    renewals = {(lease.lock_id, made) for lease in writers.leases.values() for made, _, _ in lease.renewals}
    seen: Counter[tuple[str, int, str]] = Counter()
    last_at: dict[int, datetime] = {}
    for n, event in enumerate(events):
        lock_id, at = event.data["lock"]["id"], datetime.fromisoformat(event.data["at"])
        seen[(event.type, lock_id, event.data["at"])] += 1
        if seen[(event.type, lock_id, event.data["at"])] == 2:
            found.append(f"event #{n}: {event.type} of lock {lock_id} at {event.data['at']} a second time")
        if event.type == "renewed" and (lock_id, at) not in renewals:
            found.append(f"event #{n}: renewed of lock {lock_id} at {at}, which no committed renewal made")
        if lock_id in last_at and at < last_at[lock_id]:
            found.append(f"event #{n}: {event.type} of lock {lock_id} at {at}, before its previous event")
        last_at[lock_id] = max(at, last_at.get(lock_id, at))
    return found


def mutants(events: list[Event], writers: Writers) -> Iterator[tuple[str, list[Event]]]:
    """Copies of a stream, each wrong in one way the checker must see: a state change lost or
    repeated, an expiry lost or repeated, an expiry made up for a lease renewed before its end,
    and a renewal that never committed."""
    changed = [n for n, event in enumerate(events) if event.type in STATE_CHANGES]
    middle = changed[len(changed) // 2]
    yield "change lost", events[:middle] + events[middle + 1 :]
    yield "change repeated", events[: middle + 1] + events[middle:]
    expiry = next(n for n, event in enumerate(events) if event.type == "expired")
    yield "expiry lost", events[:expiry] + events[expiry + 1 :]
    yield "expiry repeated", events[: expiry + 1] + events[expiry:]
    renewed = next(
        (lease, n)
        for lease in writers.leases.values()
        for n, (_, _, ran_out) in enumerate(lease.renewals)
        if not ran_out
    )
    lease, n = renewed
    at = next(n for n, event in enumerate(events) if event.data["lock"]["id"] == lease.lock_id)
    phantom = replace(events[at], type="expired", data={**events[at].data, "at": lease.ends[n].isoformat()})
    yield "expiry made up", [*events, phantom]
    renewal = next(n for n, event in enumerate(events) if event.type == "renewed")
    moved = (datetime.fromisoformat(events[renewal].data["at"]) + timedelta(microseconds=1)).isoformat()
    yield "renewal made up", [*events, replace(events[renewal], data={**events[renewal].data, "at": moved})]


@contextlib.contextmanager
def restartable(db_url: str, tmp_path: Path) -> Iterator[Callable[[], str]]:
    """A replica that each call stops (SIGTERM), if it runs, and starts again on a new port."""
    with contextlib.ExitStack() as running:
        starts = 0

        def restart() -> str:
            nonlocal starts
            running.close()
            starts += 1
            service = running_service(env=ROUTE.env(db_url, **FAST), log=tmp_path / f"r{starts}.log")
            url, _ = running.enter_context(service)
            return url

        yield restart


async def test_every_watcher_live_cut_or_restarted_delivers_the_history_exactly_once(
    db_url: str, tmp_path: Path
) -> None:
    rng = random.Random(34)
    with replicas(db_url, tmp_path, count=2) as [one, two], restartable(db_url, tmp_path) as restart:
        third = [await asyncio.to_thread(restart)]
        async with Watch(one) as live_one, Watch(two) as live_two:
            stop, writers = asyncio.Event(), Writers()
            hoppers = [Hopper("by time", by_count=False), Hopper("by count", by_count=True)]
            tasks = [
                asyncio.create_task(write(db_url, random.Random(rng.random()), writers, stop))
                for _ in range(WRITERS)
            ]
            operator = asyncio.create_task(operate(db_url, random.Random(rng.random()), stop))

            def urls() -> list[str]:
                return [two, third[0], one]

            hops = [asyncio.create_task(h.hop(urls, random.Random(rng.random()), stop)) for h in hoppers]
            await asyncio.sleep(SECONDS / 2)
            third[0] = await asyncio.to_thread(restart)  # a stream there is cut; resumes go on
            await asyncio.sleep(SECONDS / 2)
            stop.set()
            await asyncio.gather(*tasks, *hops)
            forced = await operator
            # Every lease ends, and every watcher has had the time to hear it.
            with psycopg.connect(db_url) as conn:
                row = conn.execute(
                    "SELECT max(expires_at) - clock_timestamp() FROM helix_job_locks"
                ).fetchone()
            assert row is not None
            await asyncio.sleep(max(0.0, row[0].total_seconds()) + 1.5)
            for hopper in hoppers:  # the rest of the stream, to the end
                await hopper._leg(urls, rng, None)
            await live_one.quiet(1.0)
            await live_two.quiet(1.0)
            with psycopg.connect(db_url) as conn:
                now = conn.execute("SELECT clock_timestamp() - interval '1 s'").fetchone()
            assert now is not None
            assert live_one.outcome is None and live_two.outcome is None
    until = now[0]
    wanted, harness = expected_expiries(writers, db_url, until)
    assert harness == []
    watchers = {"live on one": live_one.events, "live on two": live_two.events}
    watchers |= {f"cut {h.name}": h.events for h in hoppers}
    found = {name: judge(events, writers, db_url, until) for name, events in watchers.items()}
    assert found == {name: [] for name in watchers}, found
    # The checker can fail: each way of breaking a stream is caught.
    for mutation, wrong in mutants(live_one.events, writers):
        assert judge(wrong, writers, db_url, until), f"the checker missed: {mutation}"
    lates = sum(1 for lease in writers.leases.values() for _, _, ran_out in lease.renewals if ran_out)
    no_errors_logged(tmp_path)
    print(
        f"{len(live_one.events)} events; commits {dict(writers.commits)}, {forced} forced;"
        f" {sum(wanted.values())} expiries ({lates} renewed after they ran out);"
        f" hoppers {[(h.connections, len(h.events)) for h in hoppers]}"
    )
    assert sum(wanted.values()) > 5 and lates > 2 and writers.commits["release"] > 5
