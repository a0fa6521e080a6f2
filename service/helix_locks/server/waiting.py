"""Acquire requests that wait for a held lock: woken by NOTIFY on release, or by a timer at expiry.

A waiting acquire first tries once, as one that does not wait would. Refused, it takes a place in
the key's queue in the database (migration 0029), whose order is first come, first served across
every replica: the database grants a free slot to a place only when no live place comes before
it, and refuses an acquire without a place while any place is live (WaitersAhead). A place also
has the key's ends announced (NOTIFY), and it is left when the wait ends without a grant, which
wakes the key's other waiters.

Nothing polls the database while waiting. Within one process only the waiter with the first place
of a key tries (the others could only be refused): it sleeps until the key's lock ends (NOTIFY) or
its lease runs out, and when it goes, the next place of this process takes its turn. Refused
because a place of another replica comes first, it tries again soon, backing off, until that
place's grant holds the key and it can sleep on the new lease.

A session's call that waits for a set of keys (sessions.py) is granted all of them at once or
none: it holds none while it waits. It takes a place in the queue of each of its keys, all with one
order number, so that it has the same turn in each; it sleeps until a key that refused it ends
(NOTIFY) or the lease that refused it runs out, then tries the whole set again, and is granted
once it heads every one of those queues.

Releases announced while the listener was disconnected are lost. After it reconnects, one
statement on its connection finds the keys whose lock is no longer the one their first waiter
sleeps on (of a semaphore: or that has fewer unreleased locks than the holders that refused it),
and only those wake, spread over a moment: the others sleep on until a release is announced or
the lease slept on runs out, as before the disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

import psycopg

from helix_locks.server import queries
from helix_locks.server.errors import (
    ClosedUntil,
    LockHeld,
    OrganizationWaitersFull,
    Reserved,
    TooManyWaiters,
    WaitInterrupted,
)
from helix_locks.server.locks import Grant, Place

logger = logging.getLogger("helix_locks")
Key = tuple[str, str]
T = TypeVar("T")
# A timer at the holder's expiry fires this much later, so that the lease has surely run out.
EXPIRY_SLACK_SECONDS = 0.002
# A lease that has run out yet still refuses (a renewal or an end of its session in flight: the
# acquire counts the lock as held until it commits, migration 0028) is asked again after twice the
# slack each time in a row, up to about a second (2 ms * 2**9), not every few milliseconds.
MOST_DOUBLINGS = 9

# After a reconnect, the heads woken try again at about this rate (10 keys: within 10 ms).
RECONNECT_WAKES_PER_SECOND = 1000.0


def sleep_for(expiry_ms: int | None, left: float, again: int) -> float:
    """How long a refused waiter sleeps before its next attempt, unless woken: until the lease that
    refused it runs out (`expiry_ms` from now; None: that lock has just ended, so no time), plus
    the slack, doubled `again` times (the times in a row a lease already run out refused it), and
    never past the wait (`left` seconds)."""
    if expiry_ms is None:
        return 0.0
    backoff: float = EXPIRY_SLACK_SECONDS * 2 ** min(again, MOST_DOUBLINGS)
    return min(left, expiry_ms / 1000 + backoff)


def closed_past(held: LockHeld, left: float) -> bool:
    """A closed pair (hold_at_least_seconds) that opens only after the wait's end (`left` seconds):
    its refusal is the answer at once, since no attempt can be granted before then."""
    return isinstance(held, ClosedUntil) and held.closed_ms / 1000 > left


async def _expiry_ms(held: LockHeld, remaining_ms: Callable[[int], Awaitable[int | None]]) -> int | None:
    """How long until the refusal may be over: a closed pair's opening; a held pair's lease that
    refused (None: it has just ended); 0 for a place of another replica first (no lock_id), whose
    grant is on the way, so soon."""
    if isinstance(held, ClosedUntil):
        return held.closed_ms
    if isinstance(held, Reserved):  # until its deadline, unless a release wakes it sooner
        return held.reserved_ms
    return await remaining_ms(held.lock_id) if held.lock_id is not None else 0


class _Queue:
    """The waiters of one key in this process."""

    def __init__(self) -> None:
        # The places this process holds in the key's queue, each with the event that tells its
        # waiter its turn has come (the first place is the one that tries; a retry that took a
        # place over may hold it beside the try it repeats).
        self.places: dict[Place, asyncio.Event] = {}
        self.wake = asyncio.Event()
        self.waiters = 0
        # The refusal the head sleeps on (its lock_id: the lease it sleeps until; its holders_total:
        # how many held the key's slots then); None while it is not asleep.
        self.sleeping_on: LockHeld | None = None
        # Until then (the loop's clock) the key is reserved for a revocation's preferred holder:
        # every place of this process tries on its own, since the head cannot be granted and the
        # preferred holder's place may be any of them.
        self.reserved_until = 0.0


def _first(queue: _Queue) -> Place:
    """The first of this process's places in the key's queue."""
    return min(queue.places, key=lambda place: place.id)


class Waiters:
    """Every waiting acquire of this process, by key."""

    def __init__(self, limit: int, per_organization: int) -> None:
        # This process's name in the database: its places in the queues live while a connection
        # of this name (the listener's) is open.
        self.replica = f"helix-locks/{secrets.token_hex(8)}"
        self.limit = limit
        self.per_organization = per_organization
        self.count = 0
        self.closing = False
        self._queues: dict[Key, _Queue] = {}
        self._by_organization: Counter[str] = Counter()  # waiting acquires, organizations with any
        # The waiting sets' wake-ups, by each key that has refused them.
        self._sets: dict[Key, set[asyncio.Event]] = {}

    async def released(self, conn: psycopg.AsyncConnection[Any], payloads: list[str]) -> None:
        """Listener callback: wake the waiters of each key that ended (after a reconnect, of each
        key whose end may have been missed)."""
        if not payloads:
            for events in self._sets.values():  # a set waits on few keys: each tries again
                for event in events:
                    event.set()
            await self._reconnected(conn)
        for payload in payloads:
            organization_id, _, job_type = payload.partition("/")
            queue = self._queues.get((organization_id, job_type))
            if queue is not None:
                queue.wake.set()
            for event in self._sets.get((organization_id, job_type), ()):
                event.set()

    async def _reconnected(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Wake the head of each key whose lock is not the one it sleeps on (that lock ended
        while nobody listened), or that is not asleep on one, or (a semaphore) whose unreleased
        locks are fewer than the holders that refused it (another slot ended); not every head at
        once.

        The listener runs this after LISTEN: a release committed before the statement's snapshot
        is seen by it, any later one is announced. A head left asleep still wakes at its timer,
        the holder's expiry, and a head woken needlessly only tries once more. Should the
        statement fail, every head wakes, as a missed release must not wait for a timer.
        """
        queues = list(self._queues.items())
        if not queues:
            return
        params = {
            "organization_ids": [key[0] for key, _ in queues],
            "job_types": [key[1] for key, _ in queues],
            "lock_ids": [queue.sleeping_on and queue.sleeping_on.lock_id for _, queue in queues],
            # Every holder, not only those the refusal lists (at most 20 of them).
            "holders": [queue.sleeping_on and queue.sleeping_on.holders_total for _, queue in queues],
        }
        try:
            cursor = await conn.execute(queries.MISSED_RELEASES, params)
            missed = {(organization_id, job_type) for organization_id, job_type in await cursor.fetchall()}
        except psycopg.Error as exc:
            logger.warning(
                "could not tell which waited keys ended, waking every waiter: %s", type(exc).__name__
            )
            missed = {key for key, _ in queues}
        # Spread at random over len/RECONNECT_WAKES_PER_SECOND seconds: every one is worth trying,
        # but not all in the same instant on the pool and the database.
        woken = [queue for key, queue in queues if key in missed]
        spread = len(woken) / RECONNECT_WAKES_PER_SECOND
        loop = asyncio.get_running_loop()
        for queue in woken:
            loop.call_later(random.uniform(0, spread), queue.wake.set)

    def close(self) -> None:
        """Shutting down: every waiter answers now."""
        self.closing = True
        for queue in self._queues.values():
            queue.wake.set()
            for turn in queue.places.values():
                turn.set()
        for events in self._sets.values():
            for event in events:
                event.set()

    async def acquire(
        self,
        key: Key,
        wait_seconds: float,
        attempt: Callable[[Place | None], Awaitable[Grant]],
        remaining_ms: Callable[[int], Awaitable[int | None]],
        release: Callable[[Grant], Awaitable[None]],
        gone: asyncio.Future[None],
        queued: Callable[[], AbstractAsyncContextManager[Place]],
    ) -> Grant:
        """attempt(None) once; refused, attempt(place) from a place in the key's queue (inside
        `queued()`) whenever its turn may have come, for up to wait_seconds; LockHeld (or
        WaitersAhead) when the time is up.

        `gone` is done when the client went away: then a grant that came anyway is released at
        once, through `release`, and WaitInterrupted is raised. MaxHoldersMismatch is never
        waited for.
        """
        organization = key[0]
        if self._by_organization[organization] >= self.per_organization:
            raise OrganizationWaitersFull(self.per_organization)  # checked first: its own fault
        if self.count >= self.limit:
            raise TooManyWaiters(self.limit)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_seconds
        queue = self._queues.setdefault(key, _Queue())
        self.count += 1
        self._by_organization[organization] += 1
        queue.waiters += 1
        try:
            try:
                return await self._granted(await attempt(None), release, gone)
            except LockHeld as held:
                left = deadline - loop.time()
                if self.closing or gone.done() or left <= 0 or closed_past(held, left):
                    raise
            async with queued() as place:
                turn = queue.places[place] = asyncio.Event()
                try:
                    return await self._wait_in_turn(
                        queue, place, turn, deadline, attempt, remaining_ms, release, gone
                    )
                finally:
                    # Its client left: a retry with its Idempotency-Key may come for the place.
                    place.keep = gone.done()
                    del queue.places[place]
                    if queue.places:
                        queue.places[_first(queue)].set()  # the next of this process tries
        finally:
            self.count -= 1
            self._by_organization[organization] -= 1
            if not self._by_organization[organization]:
                del self._by_organization[organization]
            queue.waiters -= 1
            if queue.waiters == 0:
                del self._queues[key]

    async def acquire_all(
        self,
        organization: str,
        wait_seconds: float,
        attempt: Callable[[Place | None], Awaitable[T]],
        remaining_ms: Callable[[int], Awaitable[int | None]],
        release: Callable[[T], Awaitable[None]],
        gone: asyncio.Future[None],
        queued: Callable[[], AbstractAsyncContextManager[Place]],
    ) -> T:
        """attempt() a whole set (a session's locks) once; refused, attempt(place) from a place in
        the queue of each of its keys, taken at once with one order number (inside `queued()`),
        until it grants, for up to wait_seconds; LockHeld, naming the job type that refused, when
        the time is up. Between attempts it sleeps until a key that refused it ends or the lease
        that refused it last runs out. `gone` and `release` as for acquire()."""
        if self._by_organization[organization] >= self.per_organization:
            raise OrganizationWaitersFull(self.per_organization)
        if self.count >= self.limit:
            raise TooManyWaiters(self.limit)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_seconds
        wake = asyncio.Event()
        watched: list[Key] = []
        again, run_out = 0, None  # as in _wait_in_turn
        self.count += 1
        self._by_organization[organization] += 1
        try:
            try:
                return await self._granted(await attempt(None), release, gone)
            except LockHeld as held:
                left = deadline - loop.time()
                if self.closing or gone.done() or left <= 0 or closed_past(held, left):
                    raise
            async with queued() as place:
                try:
                    while True:
                        if gone.done():
                            raise WaitInterrupted("the client went away")
                        wake.clear()  # before the attempt: an end during it must not be missed
                        try:
                            return await self._granted(await attempt(place), release, gone)
                        except LockHeld as held:
                            if self.closing:
                                raise WaitInterrupted("the service is stopping") from held
                            left = deadline - loop.time()
                            if left <= 0 or closed_past(held, left):
                                raise
                            key = (organization, held.job_type or "")
                            if key not in watched:  # its ends wake this set from now on
                                watched.append(key)
                                self._sets.setdefault(key, set()).add(wake)
                            expiry = await _expiry_ms(held, remaining_ms)
                            again = again + 1 if expiry == 0 and held.lock_id == run_out else 0
                            run_out = held.lock_id if expiry == 0 else None
                            timer = sleep_for(expiry, left, again)
                            with contextlib.suppress(TimeoutError):
                                await self._until(wake.wait(), loop.time() + timer, gone)
                finally:
                    place.keep = gone.done()  # its client left: a retry may come for the places
        finally:
            self.count -= 1
            self._by_organization[organization] -= 1
            if not self._by_organization[organization]:
                del self._by_organization[organization]
            for key in watched:
                events = self._sets[key]
                events.discard(wake)
                if not events:
                    del self._sets[key]

    async def _wait_in_turn(
        self,
        queue: _Queue,
        place: Place,
        turn: asyncio.Event,
        deadline: float,
        attempt: Callable[[Place | None], Awaitable[Grant]],
        remaining_ms: Callable[[int], Awaitable[int | None]],
        release: Callable[[Grant], Awaitable[None]],
        gone: asyncio.Future[None],
    ) -> Grant:
        loop = asyncio.get_running_loop()
        again, run_out = 0, None  # refusals in a row by a lease already run out, and its lock
        while True:
            if gone.done():
                raise WaitInterrupted("the client went away")
            if self.closing:
                raise WaitInterrupted("the service is stopping")
            if _first(queue).id < place.id and queue.reserved_until <= loop.time() < deadline:
                # A place of this process comes first: it tries, and hands the turn on when it goes.
                turn.clear()
                with contextlib.suppress(TimeoutError):
                    await self._until(turn.wait(), deadline, gone)
                continue
            queue.wake.clear()  # before the attempt: a release during it must not be missed
            try:
                return await self._granted(await attempt(place), release, gone)
            except LockHeld as held:
                if self.closing:
                    raise WaitInterrupted("the service is stopping") from held
                left = deadline - loop.time()
                if left <= 0 or closed_past(held, left):
                    raise  # the wait is over, or will be before the pair opens: this refusal is the answer
                expiry = await _expiry_ms(held, remaining_ms)
                if not isinstance(held, Reserved):
                    queue.reserved_until = 0.0  # no longer reserved (its grant used it up): turns again
                elif queue.reserved_until <= loop.time():
                    queue.reserved_until = loop.time() + held.reserved_ms / 1000
                    for other in queue.places.values():  # each tries: one may be the preferred holder's
                        other.set()
                again = again + 1 if expiry == 0 and held.lock_id == run_out else 0
                run_out = held.lock_id if expiry == 0 else None
                timer = sleep_for(expiry, left, again)
                queue.sleeping_on = held
                try:
                    # At the timer (the lease slept on ran out, or the wait did), one more attempt:
                    # a grant, or a 409 with the holders as they are now.
                    with contextlib.suppress(TimeoutError):
                        await self._until(queue.wake.wait(), loop.time() + timer, gone)
                finally:
                    queue.sleeping_on = None

    @staticmethod
    async def _granted(grant: T, release: Callable[[T], Awaitable[None]], gone: asyncio.Future[None]) -> T:
        if gone.done():
            await release(grant)
            raise WaitInterrupted("the client went away; its grant was released")
        return grant

    async def _until(
        self,
        waiting: Awaitable[Any],
        deadline: float,
        gone: asyncio.Future[None],
    ) -> None:
        """Await `waiting` until the deadline (TimeoutError) or until the client is gone."""
        task = asyncio.ensure_future(waiting)
        timeout = max(0.0, deadline - asyncio.get_running_loop().time())
        try:
            # `gone` is a plain future, not a task: a thousand waiters cost a thousand fewer tasks.
            done, _ = await asyncio.wait({task, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()  # the request itself is being cancelled: nothing may wait on in its name
            raise
        if task in done:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if not task.cancelled():
            return  # it completed as the time ran out: it counts (a turn taken is a turn held)
        if gone.done():
            raise WaitInterrupted("the client went away")
        raise TimeoutError
