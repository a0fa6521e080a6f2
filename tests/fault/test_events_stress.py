"""GET /v1/events under stress on real replicas: racing and crashing clients, streams cut and
resumed on other replicas, a database outage; every stream is judged against the database's rows."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import AsyncExitStack, ExitStack
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.history import Grant, Renewed, check, database_history
from harness.load import KEYS, Load
from harness.processes import logged_requests, running_service, tail
from harness.proxies import TcpProxy
from harness.watch import Event, Watch
from helix_locks.server import keys
from helix_locks.server.embedded import DIRECT_DATABASE_URL
from tests.support import FAST, replicas

# A fault test: run by `scripts/test -m fault`, after the default suite (docs/development.md).
pytestmark = [pytest.mark.anyio, pytest.mark.fault]

# The changes every stream, live or replayed, must hold exactly once and in order, per key.
STATE_CHANGES = ("acquired", "released", "forced", "reclaimed")
TTL = 1.0  # the load's leases, the shortest the API takes
Key = tuple[str, str]
Change = tuple[str, int]  # (event type, lock id)


def lock_key(event: Event) -> Key:
    lock = event.data["lock"]
    return (lock["organization_id"], lock["job_type"])


def moment(text: str) -> datetime:
    return datetime.fromisoformat(text)


def changes(events: Iterable[Event], kinds: Iterable[str] = STATE_CHANGES) -> dict[Key, list[Change]]:
    """The events of those kinds, per key, in the order they came."""
    wanted, keyed = set(kinds), defaultdict(list)
    for event in events:
        if event.type in wanted:
            keyed[lock_key(event)].append((event.type, event.data["lock"]["id"]))
    return dict(keyed)


def history(grants: Iterable[Grant], organization: str | None = None) -> dict[Key, list[Change]]:
    """The state changes the database's rows say happened, per key: each grant in fencing-token
    order, then how it ended (a reclaim comes before the grant that made it)."""
    keyed: dict[Key, list[Change]] = defaultdict(list)
    for grant in sorted(grants, key=lambda g: (g.key, g.fencing_token)):
        if organization in (None, grant.key[0]):
            keyed[grant.key].append(("acquired", grant.lock_id))
            if grant.release_reason is not None:
                keyed[grant.key].append((grant.release_reason, grant.lock_id))
    return dict(keyed)


def differences(watched: dict[Key, list[Change]], expected: dict[Key, list[Change]]) -> list[str]:
    """Where two per-key sequences part: a change missing, repeated, out of order or made up."""
    found = []
    for key in sorted(watched.keys() | expected.keys()):
        got, want = watched.get(key, []), expected.get(key, [])
        if got != want:
            at = next((n for n, pair in enumerate(zip(got, want, strict=False)) if pair[0] != pair[1]), None)
            at = min(len(got), len(want)) if at is None else at
            found.append(
                f"{key}: {len(got)} changes, expected {len(want)}; from #{at}:"
                f" got {got[at : at + 4]}, expected {want[at : at + 4]}"
            )
    return found


def judge(
    events: list[Event],
    grants: list[Grant],
    *,
    renewed: Iterable[Renewed] = (),
    ttl: float | None = None,
    organization: str | None = None,
    ran_out_by: datetime | None = None,
) -> list[str]:
    """Every way a stream's events disagree with the database's rows: its state changes against
    `history`; each lock's events between its acquired and its end; an acquired's fencing token
    and reclaimed lock; a renewed only for a lock a renewal answered (with the expiry announced);
    an expired at an expiry the lock had, never received before it, once, and, for every lease
    that ran out before `ran_out_by` without being reclaimed, present."""
    found = differences(changes(events), history(grants, organization))
    stored = {grant.lock_id: grant for grant in grants}
    reclaimer = {}  # lock id -> the lock whose grant reclaimed it
    by_key: dict[Key, list[Grant]] = defaultdict(list)
    for grant in grants:
        by_key[grant.key].append(grant)
    for line in by_key.values():
        line.sort(key=lambda g: g.fencing_token)
        for before, after in itertools.pairwise(line):
            if before.release_reason == "reclaimed":
                reclaimer[after.lock_id] = before.lock_id
    announced: dict[int, set[datetime]] = defaultdict(set)
    for renewal in renewed:
        announced[renewal.lock_id].add(renewal.expires_at)
    stage: dict[int, str] = {}
    expired: set[tuple[int, datetime]] = set()
    for n, event in enumerate(events):
        lock, at = event.data["lock"], moment(event.data["at"])
        where = f"event #{n} {event.type} of lock {lock['id']}"
        kept = stored.get(lock["id"])
        if kept is None:
            found.append(f"{where}: no such lock in the database")
            continue
        if "token" in lock:
            found.append(f"{where}: carries the lock's token")
        if event.type == "acquired":
            stage[kept.lock_id] = "held"
            if lock["fencing_token"] != kept.fencing_token:
                found.append(f"{where}: fencing token {lock['fencing_token']}, stored {kept.fencing_token}")
            told = (event.data["reclaimed"] or {}).get("lock_id")
            if told != reclaimer.get(kept.lock_id):
                found.append(f"{where}: says it reclaimed {told}, not {reclaimer.get(kept.lock_id)}")
        elif event.type in STATE_CHANGES:
            stage[kept.lock_id] = "ended"
        elif stage.get(kept.lock_id) != "held":
            found.append(f"{where}: outside its lock's life ({stage.get(kept.lock_id, 'not acquired')})")
        if (
            event.type == "renewed"
            and lock["expires_at"]
            and moment(lock["expires_at"]) not in announced.get(kept.lock_id, set())
        ):
            found.append(f"{where}: no renewal to {lock['expires_at']} was answered")
        if event.type == "expired":
            expiries = announced.get(kept.lock_id, set()) | {kept.expires_at}
            if ttl is not None:
                expiries.add(kept.acquired_at + timedelta(seconds=ttl))
            if at not in expiries:
                found.append(f"{where}: at {at}, which was never its expiry")
            if event.arrived < at.timestamp():
                found.append(f"{where}: received {at.timestamp() - event.arrived:.3f} s before it expired")
            if (kept.lock_id, at) in expired:
                found.append(f"{where}: a second time")
            expired.add((kept.lock_id, at))
    for grant in grants:
        if organization not in (None, grant.key[0]) or ran_out_by is None or grant.expires_at >= ran_out_by:
            continue
        ran_out = grant.released_at is None or (
            grant.release_reason != "reclaimed" and grant.released_at > grant.expires_at
        )
        if ran_out and (grant.lock_id, grant.expires_at) not in expired:
            found.append(f"lock {grant.lock_id}: its lease ran out at {grant.expires_at}, no expired came")
    return found


def lateness(events: Iterable[Event]) -> float:
    """The longest an expired event came after its lease ran out, in seconds."""
    return max(
        (e.arrived - moment(e.data["at"]).timestamp() for e in events if e.type == "expired"), default=0
    )


def mutants(events: list[Event]) -> Iterator[tuple[str, list[Event]]]:
    """Copies of a stream, each wrong in one way: a state change lost, repeated, or swapped with a
    later one of its key; an expiry repeated, moved, or received before the lease ran out."""
    picks = [n for n, event in enumerate(events) if event.type in STATE_CHANGES]
    middle = picks[len(picks) // 2]
    yield "lost", events[:middle] + events[middle + 1 :]
    yield "repeated", events[: middle + 1] + events[middle:]
    later = next(n for n in picks if n > middle and lock_key(events[n]) == lock_key(events[middle]))
    swapped = list(events)
    swapped[middle], swapped[later] = swapped[later], swapped[middle]
    yield "swapped", swapped
    expiry = next(n for n, event in enumerate(events) if event.type == "expired")
    yield "expiry repeated", events[: expiry + 1] + events[expiry:]
    at = moment(events[expiry].data["at"])
    for mutation, changed in (
        (
            "expiry moved",
            {"data": {**events[expiry].data, "at": (at + timedelta(milliseconds=1)).isoformat()}},
        ),
        ("expiry early", {"arrived": at.timestamp() - 0.01}),
    ):
        wrong = list(events)
        wrong[expiry] = replace(events[expiry], **changed)
        yield mutation, wrong


async def break_locks(urls: list[str], admin: str, seconds: float, rng: random.Random) -> list[int]:
    """An operator forcing the current lock of a random key every so often; the ids it broke."""
    broken = []
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {admin}"}, timeout=15) as http:
        while time.monotonic() < deadline:
            await asyncio.sleep(rng.uniform(0.1, 0.3))
            org, job = rng.choice(KEYS)
            url = rng.choice(urls)
            held = await http.get(f"{url}/v1/locks/current", params={"organization_id": org, "job_type": job})
            assert held.status_code in (200, 404), held.text
            if held.status_code == 200:
                lock_id = held.json()["id"]
                forced = await http.delete(f"{url}/v1/locks/{lock_id}", params={"force": "true"})
                assert forced.status_code in (204, 410), forced.text
                if forced.status_code == 204:
                    broken.append(lock_id)
    return broken


def no_errors_logged(tmp_path: Path) -> None:
    """No service logged a stack trace, or answered any 5xx but 503 (a stream's status is its log's)."""
    for log in tmp_path.glob("*.log"):
        assert "Traceback" not in log.read_text(errors="replace"), tail(log, 60)
        statuses = {line["status"] for line in logged_requests(log)}
        assert {status for status in statuses if status >= 500} <= {503}, tail(log, 60)


STRESS_SECONDS = 10.0


async def test_every_watcher_on_every_replica_sees_the_database_s_history_under_racing_and_crashing_clients(
    db_url: str, tmp_path: Path
) -> None:
    admin = keys.create(db_url, None)
    started = time.monotonic()
    with replicas(db_url, tmp_path, count=3) as urls:
        async with AsyncExitStack() as stack:
            everything = [await stack.enter_async_context(Watch(url, admin)) for url in urls]
            acme = [
                await stack.enter_async_context(Watch(url, admin, organization_id="acme")) for url in urls
            ]
            load = Load(urls, clients=18, ttl=TTL, api_key=admin, name="racer").start()
            try:
                forced = await break_locks(urls, admin, STRESS_SECONDS, random.Random(7))
            finally:
                run = await asyncio.to_thread(load.stop)
            await asyncio.sleep(TTL + 1.5)  # every lease left has run out, and its expiry was sent
            ran_out_by = datetime.now(UTC) - timedelta(seconds=1)
            for stream in everything + acme:
                await stream.quiet(0.3)
                assert stream.outcome is None, f"a stream ended: {stream.outcome}"
    grants = database_history(db_url)
    assert check(grants, run.told, run.renewed, run.released) == []
    assert run.errors() == {} and run.unknown == 0, "every renewal that took effect was answered"
    for stream in everything + acme:
        organization = stream.params.get("organization_id")
        violations = judge(
            stream.events,
            grants,
            renewed=run.renewed,
            ttl=TTL,
            organization=organization,
            ran_out_by=ran_out_by,
        )
        assert violations == [], f"{stream.base_url} {stream.params}:\n" + "\n".join(violations[:20])
    # The checker is not blind: each copy of a stream made wrong in one way fails it.
    for mutation, copy in mutants(everything[0].events):
        assert judge(copy, grants, renewed=run.renewed, ttl=TTL, ran_out_by=ran_out_by), mutation
    # The run did what it claims: contention, crashes, reclaims, forced breaks, renewals, expiries.
    reasons = [grant.release_reason for grant in grants]
    kinds = [event.type for event in everything[0].events]
    assert reasons.count("reclaimed") > 3 and len(forced) > 3 and run.crashes > 3
    assert kinds.count("renewed") > 10 and kinds.count("expired") > 3 and run.answers["acquire 409"] > 50
    assert sum(len(stream.events) for stream in acme) < sum(len(stream.events) for stream in everything)
    no_errors_logged(tmp_path)
    late = max(lateness(stream.events) for stream in everything)
    print(
        f"{len(grants)} grants, {len(everything[0].events)} events per watcher, {kinds.count('expired')}"
        f" expired (latest {late:.3f} s after expiry), {len(forced)} forced;"
        f" {time.monotonic() - started:.1f} s"
    )
    # One reader in the deployment sweeps for run-out leases at most once a second (migration 0023),
    # then each reader's next poll sends it: about two seconds at most, three on a loaded machine.
    assert late < 3.0, f"an expired event came {late:.3f} s after the lease ran out"


CUTS = (1, 6, 13, 29, 30, 57, 90, 140)  # events each leg of a watch reads before it drops


async def burst(urls: list[str], rng: random.Random) -> None:
    """Many changes at once, again and again: concurrent acquires of distinct keys, then releases."""
    async with httpx.AsyncClient(timeout=15) as http:
        while True:
            url = rng.choice(urls)
            bodies = [
                {"organization_id": "burst", "job_type": f"b{n}", "holder": "b", "ttl_seconds": 30}
                for n in range(12)
            ]
            granted = await asyncio.gather(*(http.post(f"{url}/v1/locks", json=body) for body in bodies))
            assert all(answer.status_code == 201 for answer in granted), [a.text for a in granted]
            await asyncio.sleep(rng.uniform(0, 0.05))
            released = await asyncio.gather(
                *(
                    http.delete(f"{url}/v1/locks/{a.json()['id']}", headers={"Lock-Token": a.json()["token"]})
                    for a in granted
                )
            )
            assert all(answer.status_code == 204 for answer in released)
            await asyncio.sleep(rng.uniform(0.1, 0.4))


async def test_a_watch_cut_again_and_again_and_resumed_on_other_replicas_misses_and_repeats_nothing(
    db_url: str, tmp_path: Path
) -> None:
    rng = random.Random(11)
    started = time.monotonic()
    with replicas(db_url, tmp_path, count=3) as urls:
        async with Watch(urls[0]) as whole:
            leg = await Watch(urls[0], stop_after=CUTS[0]).open()
            legs: list[Watch] = []
            load = Load(urls, clients=8, ttl=TTL, name="cutter").start()
            bursts = asyncio.create_task(burst(urls, rng))
            try:
                for n in range(len(CUTS)):
                    await asyncio.wait_for(leg.ended.wait(), timeout=20)
                    await leg.close()
                    assert leg.outcome == "cut", leg.outcome
                    legs.append(leg)
                    await asyncio.sleep(rng.uniform(0, 0.3))  # changes go on while it is away
                    # Each time on the next replica: never the one it was cut from.
                    url = urls[(n + 1) % len(urls)]
                    stop_after = CUTS[n + 1] if n + 1 < len(CUTS) else None
                    leg = await Watch(url, last_event_id=leg.events[-1].id, stop_after=stop_after).open()
                    assert leg.status == 200, leg.problem
            finally:
                bursts.cancel()
                await asyncio.gather(bursts, return_exceptions=True)
                run = await asyncio.to_thread(load.stop)
            assert bursts.cancelled(), bursts.exception()
            await asyncio.sleep(TTL + 1.5)
            ran_out_by = datetime.now(UTC) - timedelta(seconds=1)
            await whole.quiet()
            await leg.quiet()
            await leg.close()
            assert whole.outcome is None and leg.outcome is None
    grants = database_history(db_url)
    chain = [event for cut in legs for event in cut.events] + leg.events
    # A replay may fold renewals into the latest state: compare everything else, in order.
    kinds = (*STATE_CHANGES, "expired")
    assert differences(changes(chain, kinds), changes(whole.events, kinds)) == []
    assert judge(whole.events, grants, renewed=run.renewed, ttl=TTL, ran_out_by=ran_out_by) == []
    assert judge(chain, grants, renewed=run.renewed, ttl=TTL, ran_out_by=ran_out_by) == []
    mid_window = sum(cut.mid_window for cut in legs)
    assert mid_window >= 2, "no cut fell in the middle of what the server sent at once"
    assert sum(event.type == "expired" for event in chain) > 0
    no_errors_logged(tmp_path)
    print(
        f"{len(whole.events)} events, {len(CUTS)} cuts ({mid_window} in the middle of a window);"
        f" {time.monotonic() - started:.1f} s"
    )


@dataclass
class Writer:
    """Makes changes through a replica and keeps what it was granted."""

    url: str
    held: dict[str, dict[str, Any]] = field(default_factory=dict)  # job type -> the grant

    async def acquire(self, http: httpx.AsyncClient, job: str, ttl: float = 30) -> httpx.Response:
        body = {"organization_id": "acme", "job_type": job, "holder": "w", "ttl_seconds": ttl}
        answer = await http.post(f"{self.url}/v1/locks", json=body)
        if answer.status_code == 201:
            self.held[job] = answer.json()
        return answer

    async def release(self, http: httpx.AsyncClient, job: str) -> None:
        lock = self.held.pop(job)
        answer = await http.delete(f"{self.url}/v1/locks/{lock['id']}", headers={"Lock-Token": lock["token"]})
        assert answer.status_code == 204, answer.text


OUTAGE_SECONDS = 4.0
# A 503 while the database is away comes this fast: refused connections at once (as in
# test_outage), a silent server once the statement timeout (0.5 s here) has passed (as in test_api).
QUICKLY = {"cut": 2.5, "freeze": 5.0}
OUTAGE_ENV = {"HELIX_LOCKS_STATEMENT_TIMEOUT_MS": "500", "HELIX_LOCKS_POOL_TIMEOUT_SECONDS": "1"}


@pytest.mark.parametrize("outage", ["cut", "freeze"])
async def test_watchers_ride_out_a_database_outage_and_a_resume_afterwards_misses_nothing(
    db_url: str, tmp_path: Path, outage: str
) -> None:
    """`cut`: the database refuses and resets connections; `freeze`: it keeps them open, silent."""
    proxies = [TcpProxy(db_url)]
    await proxies[0].start()
    env: dict[str, str | None] = {"DATABASE_URL": proxies[0].url(db_url), DIRECT_DATABASE_URL: None}
    env |= {**FAST, **OUTAGE_ENV}
    services = ExitStack()
    try:
        # Started off the event loop: the proxy, on it, must carry their readiness checks.
        urls = []
        for n in range(2):
            serving = running_service(env=env, log=tmp_path / f"s{n}.log")
            urls.append((await asyncio.to_thread(services.enter_context, serving))[0])
        missed = await outage_under_watchers(db_url, proxies, urls, outage)
    finally:
        await asyncio.to_thread(services.close)
        for proxy in proxies:
            await proxy.cut()
    no_errors_logged(tmp_path)
    # At least what came after the outage: two expiries, the reclaim, a grant and its release, and
    # the reclaiming grant (the release just before the outage may have reached it before it left).
    assert len(missed) >= 6, f"the resume brought back what was missed: {missed}"


async def refused_quickly(url: str, quickly: float, last_event_id: str | None = None) -> None:
    began = time.monotonic()
    async with Watch(url, last_event_id=last_event_id) as refused:
        took = time.monotonic() - began
        assert refused.status == 503 and refused.problem is not None, refused.outcome
        assert refused.problem["type"] == "urn:helix-locks:problem:database-unavailable"
    assert took < quickly, f"a watch was refused after {took:.1f} s"


async def outage_under_watchers(
    db_url: str, proxies: list[TcpProxy], urls: list[str], outage: str
) -> list[tuple[str, int]]:
    """Watchers on both replicas, and one that leaves during the outage and comes back after it;
    changes right before and right after; the database away meanwhile (the proxy in front of it
    cut, then put back on the same port). Returns what the one that left got back on resuming."""
    one, two = urls
    proxy = proxies[0]
    writer = Writer(one)
    async with (
        httpx.AsyncClient(timeout=30) as http,
        Watch(one) as on_one,
        Watch(two) as on_two,
        Watch(one) as dropped,
    ):
        for job, ttl in (("kept", 30.0), ("released", 30.0), ("lapses", 2.0)):
            assert (await writer.acquire(http, job, ttl)).status_code == 201
        await writer.release(http, "released")
        await dropped.quiet(0.3)
        # Right before the outage, and not yet seen by anyone: a release and a short lease.
        await writer.release(http, "kept")
        assert (await writer.acquire(http, "reclaimed", ttl=1)).status_code == 201
        if outage == "cut":
            await proxy.cut()
        else:
            proxy.freeze()
        cut_at = time.monotonic()
        await dropped.close()  # its client goes away during the outage, to come back later
        assert dropped.outcome is None, dropped.outcome
        last_seen = dropped.events[-1].id

        while time.monotonic() - cut_at < OUTAGE_SECONDS:
            began = time.monotonic()
            answer = await writer.acquire(http, "during")
            assert answer.status_code == 503, answer.text
            assert time.monotonic() - began < QUICKLY[outage], f"503 after {time.monotonic() - began:.1f} s"
            await refused_quickly(two, QUICKLY[outage])
            await refused_quickly(two, QUICKLY[outage], last_seen)
            await asyncio.sleep(0.2)
        for stream in (on_one, on_two):
            # Alive all along (a comment every second) or ended cleanly; never an abort, never silent.
            if stream.outcome is None:
                during = [t for t in stream.comments if t > cut_at]
                gaps = [later - earlier for earlier, later in itertools.pairwise([cut_at, *during])]
                assert len(during) >= OUTAGE_SECONDS - 1 and max(gaps) < 2.5, gaps
            else:
                assert stream.outcome == "clean", stream.outcome

        await proxy.cut()  # a frozen proxy's connections are reset: the server is back, they are not
        restored = TcpProxy(db_url)
        restored.port = proxy.port
        proxies.append(restored)
        await restored.start()
        back_at = time.monotonic()
        # Right after: the first grant the database takes again, a release, the lapsed lease reclaimed.
        while (answer := await writer.acquire(http, "after")).status_code != 201:
            assert answer.status_code == 503, answer.text
            assert time.monotonic() - back_at < 15, "not serving again 15 s after the database came back"
            await asyncio.sleep(0.1)
        await writer.release(http, "after")
        reclaim = await writer.acquire(http, "reclaimed")
        assert reclaim.status_code == 201 and reclaim.json()["reclaimed"] is not None, reclaim.text
        await asyncio.sleep(1.5)  # "lapses" ran out during the outage: its expiry is sent by now
        ran_out_by = datetime.now(UTC) - timedelta(seconds=1)

        async with Watch(two, last_event_id=last_seen) as resumed:
            assert resumed.status == 200, resumed.problem
            await resumed.quiet()
        judged = {"dropped and resumed": dropped.events + resumed.events}
        for name, stream in (("on one", on_one), ("on two", on_two)):
            if stream.outcome is None:
                judged[name] = await stream.quiet()
            else:  # ended: it resumes, on the other replica, from its last event
                other = two if stream is on_one else one
                last = stream.events[-1].id if stream.events else None
                async with Watch(other, last_event_id=last) as again:
                    judged[name] = stream.events + await again.quiet()
    grants = database_history(db_url)
    [lapsed] = [grant.lock_id for grant in grants if grant.key == ("acme", "lapses")]
    for name, events in judged.items():
        violations = judge(events, grants, ran_out_by=ran_out_by)
        assert violations == [], f"{name}:\n" + "\n".join(violations)
        assert ("expired", lapsed) in [(event.type, event.data["lock"]["id"]) for event in events], name
    missed = [(event.type, event.data["lock"]["id"]) for event in resumed.events]
    print(f"through the outage: {on_one.outcome or 'open'}, {on_two.outcome or 'open'}; resumed: {missed}")
    return missed
