"""Acquire requests that wait for a held lock: woken by NOTIFY on release, or by a timer at expiry.

Releases are announced only for keys that someone waits for: the head of a key's queue
registers the key in the database (migration 0008) before it waits.

Nothing polls the database while waiting. Within one process the waiters of a key queue in
arrival order: only the first of them waits for the lock; the others wait for it (an asyncio
lock, which is fair). Across replicas the order is best effort: whoever retries first wins.

A session's call that waits for a set of keys (sessions.py) is granted all of them at once or
none: it holds none while it waits, and sleeps until a key that refused it ends (NOTIFY) or the
lease that refused it runs out, then tries the whole set again. It waits beside the queues of
single keys, not in them: a set has no turn of its own.

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
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

import psycopg

from helix_locks.server import queries
from helix_locks.server.errors import (
    DatabaseUnavailable,
    LockHeld,
    OrganizationWaitersFull,
    TooManyWaiters,
    WaitInterrupted,
)
from helix_locks.server.locks import Grant

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


class _Queue:
    """The waiters of one key in this process."""

    def __init__(self) -> None:
        self.turn = asyncio.Lock()  # FIFO: the head of the queue holds it
        self.wake = asyncio.Event()
        self.waiters = 0
        # The refusal the head sleeps on (its lock_id: the lease it sleeps until; its holders_total:
        # how many held the key's slots then); None while it is not asleep.
        self.sleeping_on: LockHeld | None = None
        # The max_holders the key was last found held with (None: not known).
        self.held_with: int | None = None


class Waiters:
    """Every waiting acquire of this process, by key."""

    def __init__(self, limit: int, per_organization: int) -> None:
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
        for events in self._sets.values():
            for event in events:
                event.set()

    async def acquire(
        self,
        key: Key,
        wait_seconds: float,
        attempt: Callable[[], Awaitable[Grant]],
        remaining_ms: Callable[[int], Awaitable[int | None]],
        release: Callable[[Grant], Awaitable[None]],
        gone: asyncio.Future[None],
        announced: Callable[[], AbstractAsyncContextManager[None]],
        max_holders: int = 1,
    ) -> Grant:
        """attempt() until it grants, for up to wait_seconds; LockHeld when the time is up.

        `gone` is done when the client went away: then a grant that came anyway is released at
        once, through `release`, and WaitInterrupted is raised. Inside `announced()` the end of
        the key's lock is announced, which releases are not otherwise. An acquire naming another
        max_holders than the key was found held with attempts at once, rather than queueing
        behind the waiters of that value: MaxHoldersMismatch is never waited for.
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
            if queue.held_with not in (None, max_holders):
                with contextlib.suppress(LockHeld):  # held with this value after all: queue
                    return await self._granted(await attempt(), release, gone)
            # If this request is cancelled just as its turn comes, the turn is handed on.
            await self._until(queue.turn.acquire(), deadline, gone, on_abandon=queue.turn.release)
            try:
                async with contextlib.AsyncExitStack() as announcing:
                    return await self._wait_in_turn(
                        queue, deadline, attempt, remaining_ms, release, gone, announcing, announced
                    )
            finally:
                queue.turn.release()
        except TimeoutError:
            return await self._last_try(attempt, release, gone)
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
        attempt: Callable[[], Awaitable[T]],
        remaining_ms: Callable[[int], Awaitable[int | None]],
        release: Callable[[T], Awaitable[None]],
        gone: asyncio.Future[None],
        announced: Callable[[str], AbstractAsyncContextManager[None]],
    ) -> T:
        """attempt() a whole set (a session's locks) until it grants, for up to wait_seconds;
        LockHeld, naming the job type that refused, when the time is up. Between attempts it
        sleeps until a key that refused it ends or the lease that refused it last runs out;
        inside `announced(job_type)` the ends of that key are announced. `gone` and `release` as
        for acquire()."""
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
            async with contextlib.AsyncExitStack() as announcing:
                while True:
                    if gone.done():
                        raise WaitInterrupted("the client went away")
                    wake.clear()  # before the attempt: an end during it must not be missed
                    try:
                        return await self._granted(await attempt(), release, gone)
                    except LockHeld as held:
                        if self.closing:
                            raise WaitInterrupted("the service is stopping") from held
                        left = deadline - loop.time()
                        if left <= 0:
                            raise
                        key = (organization, held.job_type or "")
                        if key not in watched:
                            # Its ends wake this set from now on, and are announced once the key
                            # is registered; one may have come since the attempt: attempt again.
                            watched.append(key)
                            self._sets.setdefault(key, set()).add(wake)
                            with contextlib.suppress(DatabaseUnavailable):
                                await announcing.enter_async_context(announced(key[1]))
                                continue
                        expiry = await remaining_ms(held.lock_id) if held.lock_id is not None else 0
                        again = again + 1 if expiry == 0 and held.lock_id == run_out else 0
                        run_out = held.lock_id if expiry == 0 else None
                        timer = sleep_for(expiry, left, again)
                        with contextlib.suppress(TimeoutError):
                            await self._until(wake.wait(), loop.time() + timer, gone)
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
        deadline: float,
        attempt: Callable[[], Awaitable[Grant]],
        remaining_ms: Callable[[int], Awaitable[int | None]],
        release: Callable[[Grant], Awaitable[None]],
        gone: asyncio.Future[None],
        announcing: contextlib.AsyncExitStack,
        announced: Callable[[], AbstractAsyncContextManager[None]],
    ) -> Grant:
        loop = asyncio.get_running_loop()
        registered = False
        again, run_out = 0, None  # refusals in a row by a lease already run out, and its lock
        while True:
            if gone.done():
                raise WaitInterrupted("the client went away")
            queue.wake.clear()  # before the attempt: a release during it must not be missed
            try:
                return await self._granted(await attempt(), release, gone)
            except LockHeld as held:
                queue.held_with = held.max_holders
                if self.closing:
                    raise WaitInterrupted("the service is stopping") from held
                left = deadline - loop.time()
                if left <= 0:
                    raise
                if not registered:
                    # Releases of this key are announced from now on; one may have come since
                    # the attempt, so attempt again before waiting. If the registration fails,
                    # wait for the holder's expiry this round, and try again on the next.
                    with contextlib.suppress(DatabaseUnavailable):
                        await announcing.enter_async_context(announced())
                        registered = True
                        continue
                # Until the holder's lease runs out; None: it just ended, so try again now.
                expiry = await remaining_ms(held.lock_id) if held.lock_id is not None else 0
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

    async def _last_try(
        self,
        attempt: Callable[[], Awaitable[Grant]],
        release: Callable[[Grant], Awaitable[None]],
        gone: asyncio.Future[None],
    ) -> Grant:
        """The wait ran out before this request's turn came: one attempt, for a current 409."""
        return await self._granted(await attempt(), release, gone)

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
        on_abandon: Callable[[], None] | None = None,
    ) -> None:
        """Await `waiting` until the deadline (TimeoutError) or until the client is gone."""
        task = asyncio.ensure_future(waiting)
        timeout = max(0.0, deadline - asyncio.get_running_loop().time())
        try:
            # `gone` is a plain future, not a task: a thousand waiters cost a thousand fewer tasks.
            done, _ = await asyncio.wait({task, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()  # the request itself is being cancelled: nothing may wait on in its name
            if on_abandon is not None:
                task.add_done_callback(lambda t: t.cancelled() or t.exception() or on_abandon())
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
