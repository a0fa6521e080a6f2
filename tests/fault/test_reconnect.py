"""The release listener reconnecting with a thousand waited keys: releases announced while it was
away were lost, so the process asks PostgreSQL which keys ended meanwhile and wakes those waiters
only, not the first waiter of every key at once."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import psycopg
import pytest
from psycopg import sql

from harness.plans import PLAN_MODES, nodes
from helix_locks.server import listener, queries
from helix_locks.server.app import create_app
from helix_locks.server.keys import Caller
from helix_locks.server.locks import Grant, Locks
from helix_locks.server.waiting import Waiters
from tests.support import ROUTE, Conn, in_process

# A fault test: run by `scripts/test -m fault`, after the default suite (docs/development.md).
pytestmark = [pytest.mark.anyio, pytest.mark.fault]
Key = tuple[str, str]

# 1,000 keys in 10 organizations (an organization may have 1,000 waiters in one process).
KEYS = [(f"org-{n % 10}", f"job-{n}") for n in range(1000)]
# Every waiter's timer is at the end of its wait, not at its holder's expiry (its last attempt
# comes WAIT_SECONDS in, after every check here): a 201 comes only from a waiter woken.
HOLDER_TTL_MS = 600_000
WAIT_SECONDS = 60
# Long enough to release locks with the listener down, and find it still down afterwards.
RECONNECT_SECONDS = 3.0
# A lock granted anew while the listener is away: still held when it is back.
REPLACED_TTL_MS = 8000


class Watch:
    """What the service does, counted where it does it: each acquire attempt by key, each waiter
    going to sleep (it asks how long the holder's lease has left just before), and the backend of
    each connection the release listener made (its callback hears of each with no payloads)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.attempts: Counter[Key] = Counter()
        self.attempted_at: list[float] = []  # the event loop's time of each attempt
        self.sleeps = 0
        self.listeners: list[int] = []
        acquire, remaining_ms, released = Locks.acquire, Locks.remaining_ms, Waiters.released

        async def counted_acquire(
            locks: Locks, caller: Caller, organization_id: str, job_type: str, *args: Any, **kwargs: Any
        ) -> Grant:
            self.attempts[(organization_id, job_type)] += 1
            self.attempted_at.append(asyncio.get_running_loop().time())
            return await acquire(locks, caller, organization_id, job_type, *args, **kwargs)

        async def counted_remaining_ms(locks: Locks, lock_id: int) -> int | None:
            remaining = await remaining_ms(locks, lock_id)
            self.sleeps += 1
            return remaining

        async def recorded_released(
            waiters: Waiters, conn: psycopg.AsyncConnection[Any], payloads: list[str]
        ) -> None:
            if not payloads:
                self.listeners.append(conn.info.backend_pid)
            await released(waiters, conn, payloads)

        monkeypatch.setattr(Locks, "acquire", counted_acquire)
        monkeypatch.setattr(Locks, "remaining_ms", counted_remaining_ms)
        monkeypatch.setattr(Waiters, "released", recorded_released)


async def until(condition: Callable[[], bool], what: str) -> None:
    """Return once `condition` holds; fail after a minute."""
    for _ in range(1200):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not so after 60 s: {what}")


async def answered(requests: list[asyncio.Task[httpx.Response]]) -> list[httpx.Response]:
    """The answers to waiting requests, once all came; fail if any has not after 30 s (a timer
    is no explanation: each is at the end of its wait, and would answer 409)."""
    _, pending = await asyncio.wait(requests, timeout=30)
    assert not pending, f"{len(pending)} of {len(requests)} waiting requests still unanswered after 30 s"
    return [request.result() for request in requests]


class Service:
    """The app in this process, a waiting acquire for each of `keys` (held in the database), each
    asleep; the listener reconnects RECONNECT_SECONDS after losing its connection."""

    def __init__(self, conn: Conn, watch: Watch, held: dict[Key, tuple[int, str]]) -> None:
        self.conn = conn
        self.watch = watch
        self.held = held
        self.waiting: dict[Key, asyncio.Task[httpx.Response]] = {}
        # Of semaphores: the locks in their other slots, with longer leases than those in `held`.
        self.others: list[dict[Key, tuple[int, str]]] = []

    async def disconnected(
        self,
        release: list[Key],
        replace: list[Key] | None = None,
        held: dict[Key, tuple[int, str]] | None = None,
    ) -> None:
        """End the listener's connection; while it is away, release the locks of `release` (those
        in `held`, by default the ones the waiters sleep on; and grant those of `replace` anew);
        return once it has reconnected."""
        connects = len(self.watch.listeners)
        row = self.conn.execute("SELECT pg_terminate_backend(%s)", (self.watch.listeners[-1],)).fetchone()
        assert row == (True,)
        locks = [(self.held if held is None else held).pop(key) for key in release]
        released = self.conn.execute(
            "SELECT count(r.id) FROM unnest(%s::bigint[], %s::text[]) AS k (id, token)"
            " CROSS JOIN LATERAL helix_release_job_lock(k.id, k.token, NULL) AS r",
            ([lock[0] for lock in locks], [lock[1] for lock in locks]),
        ).fetchone()
        assert released == (len(locks),)
        if replace:
            self.held.update(hold(self.conn, replace, "other", ttl_ms=REPLACED_TTL_MS))
        assert len(self.watch.listeners) == connects, "all done before the listener reconnected"
        assert not any(self.waiting[key].done() for key in release)
        await until(lambda: len(self.watch.listeners) == connects + 1, "the listener reconnected")


def hold(
    conn: Conn, keys: list[Key], holder: str = "holder", ttl_ms: int = HOLDER_TTL_MS, max_holders: int = 1
) -> dict[Key, tuple[int, str]]:
    """Grant each key's lock (a slot of it) in the database: its id and token, by key."""
    rows = conn.execute(
        "SELECT k.organization_id, k.job_type, l.id, l.token"
        " FROM unnest(%s::text[], %s::text[]) AS k (organization_id, job_type)"
        " CROSS JOIN LATERAL"
        " helix_acquire_job_lock(k.organization_id, k.job_type, %s, %s, NULL, NULL, %s) AS l",
        ([key[0] for key in keys], [key[1] for key in keys], holder, ttl_ms, max_holders),
    ).fetchall()
    return {(row[0], row[1]): (row[2], row[3]) for row in rows}


@asynccontextmanager
async def serving(
    db_url: str, conn: Conn, monkeypatch: pytest.MonkeyPatch, keys: list[Key], max_holders: int = 1
) -> AsyncIterator[Service]:
    """Every slot of each key held; the waiters sleep on the locks in `service.held`, which run
    out first."""
    watch = Watch(monkeypatch)
    monkeypatch.setattr(listener, "RECONNECT_SECONDS", RECONNECT_SECONDS)
    service = Service(conn, watch, hold(conn, keys, max_holders=max_holders))
    service.others = [
        hold(conn, keys, "other", 2 * HOLDER_TTL_MS, max_holders) for _ in range(max_holders - 1)
    ]
    app = create_app(ROUTE.settings(db_url, allow_anonymous=True))
    async with in_process(app, timeout=WAIT_SECONDS + 30) as client:
        await until(lambda: len(watch.listeners) == 1, "the listener connected")

        async def wait_for(key: Key) -> httpx.Response:
            lock = {"organization_id": key[0], "job_type": key[1], "holder": "waiter", "ttl_seconds": 30}
            lock["max_holders"] = max_holders
            return await client.post("/v1/locks", json={**lock, "wait_seconds": WAIT_SECONDS})

        service.waiting = {key: asyncio.create_task(wait_for(key)) for key in keys}
        await until(lambda: watch.sleeps == len(keys), "every waiter asleep")
        # Each tried twice: once, then again once its key was registered.
        assert watch.attempts == Counter(dict.fromkeys(keys, 2))
        registered = conn.execute("SELECT count(*) FROM helix_lock_waiters").fetchone()
        assert registered == (len(keys),)
        yield service


async def test_a_reconnect_wakes_only_the_waiters_of_keys_released_meanwhile(
    db_url: str, conn: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with serving(db_url, conn, monkeypatch, KEYS) as service:
        watch, waiting = service.watch, service.waiting
        # Ten locks end while the listener is away: their announcements reach nobody.
        freed = KEYS[::100]
        before = watch.attempts.copy()
        await service.disconnected(release=freed)
        granted = await answered([waiting[key] for key in freed])
        assert [answer.status_code for answer in granted] == [201] * len(freed)
        await asyncio.sleep(1)  # room for any other waiter woken to try
        assert watch.attempts - before == Counter(dict.fromkeys(freed, 1)), (
            f"{len(watch.attempts - before)} keys tried again after the reconnect, not {len(freed)}"
        )
        assert not any(task.done() for key, task in waiting.items() if key not in freed)

        # All the others end during a second disconnect: 990 waiters wake, spread over about a
        # second (RECONNECT_WAKES_PER_SECOND), not in one instant, and every one is granted.
        rest = [key for key in KEYS if key not in freed]
        since = len(watch.attempted_at)
        await service.disconnected(release=rest)
        answers = await answered([waiting[key] for key in rest])
        assert Counter(answer.status_code for answer in answers) == {201: len(rest)}
        woken = watch.attempted_at[since:]
        assert len(woken) == len(rest)
        assert max(woken) - min(woken) > 0.5, "the wake-ups came in one burst"
    live = conn.execute(
        "SELECT count(*) FROM helix_job_locks WHERE released_at IS NULL AND holder = 'waiter'"
    ).fetchone()
    assert live == (len(KEYS),)


async def test_a_waiter_whose_holder_changed_meanwhile_sleeps_on_the_new_one(
    db_url: str, conn: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Released and granted to another while the listener was away: the waiter tries again at
    the reconnect and sleeps until the new holder's lease runs out (8 s), not the old one's."""
    changed, kept = ("acme", "changed"), ("acme", "kept")
    async with serving(db_url, conn, monkeypatch, [changed, kept]) as service:
        before = service.watch.attempts.copy()
        await service.disconnected(release=[changed], replace=[changed])
        [granted] = await answered([service.waiting[changed]])
        assert granted.status_code == 201, granted.text
        assert granted.json()["reclaimed"]["lock_id"] == service.held[changed][0]
        # Once woken by the reconnect (409, the new holder), once at its lease's end.
        assert service.watch.attempts - before == Counter({changed: 2})
        assert not service.waiting[kept].done()


@pytest.mark.parametrize("slots", [2, 25])
async def test_a_semaphore_waiter_wakes_when_another_slot_ended_meanwhile(
    db_url: str, conn: Conn, monkeypatch: pytest.MonkeyPatch, slots: int
) -> None:
    """Refused by every holder of a semaphore, the waiter sleeps until the first lease runs out;
    the lock in another slot, released while the listener was away, wakes it at the reconnect
    (its own lock is still held), and the waiter of a key that stayed full sleeps on. With 25
    slots, the refusal lists only 20 holders: the check counts them all (holders_total)."""
    ended, full = ("acme", "exports"), ("acme", "reports")
    async with serving(db_url, conn, monkeypatch, [ended, full], max_holders=slots) as service:
        other = service.others[0][ended][0]
        [(slot,)] = conn.execute("SELECT slot FROM helix_job_locks WHERE id = %s", (other,)).fetchall()
        before = service.watch.attempts.copy()
        await service.disconnected(release=[ended], held=service.others[0])
        [granted] = await answered([service.waiting[ended]])
        assert granted.status_code == 201, granted.text
        assert granted.json()["slot"] == slot and granted.json()["reclaimed"] is None
        await asyncio.sleep(1)  # room for the other waiter to try, were it woken
        assert service.watch.attempts - before == Counter({ended: 1})
        assert not service.waiting[full].done()


async def test_when_the_keys_cannot_be_checked_every_waiter_wakes(
    db_url: str, conn: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The statement failing must not leave a waiter asleep past a release it missed: every
    first waiter tries again, as when nothing was known."""
    monkeypatch.setattr(queries, "MISSED_RELEASES", "SELECT 1 / 0")
    keys = [("acme", f"job-{n}") for n in range(3)]
    async with serving(db_url, conn, monkeypatch, keys) as service:
        before = service.watch.attempts.copy()
        await service.disconnected(release=keys[:1])
        [granted] = await answered([service.waiting[keys[0]]])
        assert granted.status_code == 201, granted.text
        await asyncio.sleep(1)  # room for the others to try
        assert service.watch.attempts - before == Counter(dict.fromkeys(keys, 1))
        assert not any(service.waiting[key].done() for key in keys[1:])


def test_the_check_reads_only_the_live_lock_index(conn: Conn) -> None:
    """The statement finds the keys whose lock is not the one given (released, replaced, or
    none given), and whichever plan PostgreSQL picks for it (custom, for these 1,000 keys, or
    generic), it reads the live locks through their primary key alone, never the history, beside
    50,000 ended locks of these keys and 50,000 live ones of other organizations."""
    held = hold(conn, KEYS)
    conn.execute(
        "INSERT INTO helix_lock_history (id, organization_id, job_type, slot, max_holders, holder, token,"
        " acquired_at, expires_at, released_at, release_reason, fencing_token)"
        " SELECT nextval('helix_lock_ids'), 'org-' || g % 10, 'job-' || g % 1000, 0, 1, 'old', 'x',"
        " now() - interval '2 hours', now() - interval '1 hour', now() - interval '90 minutes', 'released', g"
        " FROM generate_series(1, 50000) AS g"
    )
    conn.execute(
        "INSERT INTO helix_holds (organization_id, job_type, holder, token, acquired_at, expires_at,"
        " fencing_token) SELECT 'other-' || g % 100, 'job-' || g, 'w', 'x', now(),"
        " now() + interval '1 hour', 1"
        " FROM generate_series(1, 50000) AS g"
    )
    conn.execute("ANALYZE helix_holds, helix_lock_history")
    # Five semaphores of 3, every slot held; then semaphore 1's third lock ends.
    semaphores = [("org-0", f"sem-{n}") for n in range(5)]
    first, _, third = (hold(conn, semaphores, max_holders=3) for _ in range(3))
    conn.execute("SELECT helix_release_job_lock(%s, %s, NULL)", third[semaphores[1]])
    unknown, ended = KEYS[:5], KEYS[5:10]
    conn.execute(
        "SELECT helix_release_job_lock(k.id, k.token, NULL)"
        " FROM unnest(%s::bigint[], %s::text[]) AS k (id, token)",
        ([held[key][0] for key in ended], [held[key][1] for key in ended]),
    )
    params = {
        "organization_ids": [key[0] for key in KEYS + semaphores],
        "job_types": [key[1] for key in KEYS + semaphores],
        # Each semaphore's waiter sleeps on its first lock; 2 on a lock that is not one of its,
        # 4 on none.
        "lock_ids": [None if key in unknown else held[key][0] for key in KEYS]
        + [first[key][0] for key in semaphores[:2]]
        + [-1, first[semaphores[3]][0], None],
        "holders": [1] * len(KEYS) + [3] * 5,
    }
    missed = conn.execute(queries.MISSED_RELEASES, params).fetchall()
    # Semaphores 0 and 3 are whole; 1 lost a slot (its lock slept on is still held).
    assert sorted(missed) == sorted(unknown + ended + semaphores[1:3] + semaphores[4:])

    names = list(params)
    body = re.sub(r"%\((\w+)\)s", lambda match: f"${names.index(match[1]) + 1}", queries.MISSED_RELEASES)
    conn.execute(f"PREPARE missed (text[], text[], bigint[], integer[]) AS {body}")
    explaining = psycopg.ClientCursor(conn)
    for mode in PLAN_MODES:
        conn.execute(sql.SQL("SET plan_cache_mode = {}").format(sql.Literal(mode)))
        row = explaining.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE missed (%s, %s, %s, %s)", [params[name] for name in names]
        ).fetchone()
        assert row is not None
        plan = list(nodes(row[0][0]["Plan"]))
        assert plan[0]["Actual Rows"] == len(missed), mode
        assert not [node for node in plan if "Seq Scan" in node["Node Type"]], (mode, plan)
        indexes = {node["Index Name"] for node in plan if "Index Name" in node}
        assert indexes == {"helix_holds_pkey"}, (mode, indexes)
