"""GET /v1/events: one reader per process turns the database's windows of changes into events for
every live watcher; a resumed watcher catches up on windows of its own, a page at a time, then
joins it (migration 0019 says why no event is lost, repeated or made up)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import logging
import re
from collections import Counter, defaultdict, deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import psycopg
from psycopg.rows import DictRow

from helix_locks.server import queries
from helix_locks.server.db import Database
from helix_locks.server.errors import (
    DatabaseUnavailable,
    EventsExpired,
    InternalError,
    InvalidArgument,
    InvalidRequest,
    LockError,
    OrganizationWatchersFull,
    ShuttingDown,
    TooManyWatchers,
    Unauthenticated,
)
from helix_locks.server.keys import Caller, KeyRing
from helix_locks.server.locks import Lock, Reclaimed, utc

logger = logging.getLogger(__name__)

# xmin:xmax:xip,... as PostgreSQL writes a pg_snapshot.
_SNAPSHOT = re.compile(r"([0-9]{1,20}):([0-9]{1,20}):((?:[0-9]{1,20}(?:,[0-9]{1,20})*)?)")
KEEP_ALIVE = b": keep-alive\n\n"
# What a stream ended for the memory it held sends last: resume after this many milliseconds.
RETRY = b"retry: 1000\n\n"
# The kinds of helix_window_events (0019); 4 is the lock's end, named by its release_reason; 5 a
# request that the holder let go (0035).
KINDS = ("acquired", "expired", "renewed", "updated")
END = 4
REVOCATION = 5
# Statements that read for catch-ups at once in one process (each on a pooled connection).
REPLAYS_AT_ONCE = 2
# Events whose locks one catch-up statement reads, and the most a bridge may carry (more, and the
# watcher catches up again): with the 8 KiB of metadata a lock may hold, under 1 MiB a page.
PAGE = 64
# Bytes of events handed to the connection at once.
CHUNK = 64 * 1024
# What a catch-up holds per event it has yet to send (time, lock id and kind, in a list), about.
KEY_BYTES = 150
# Expiries one announcement marks; the rest at the next poll.
ANNOUNCE_AT_ONCE = 1000
# The place before every event of a window.
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# How often the reader checks that each watcher's API key still works.
_KEY_CHECK_SECONDS = 1.0


def _xmax(snapshot: str) -> int:
    found = _SNAPSHOT.fullmatch(snapshot)
    assert found is not None
    return int(found.group(2))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class Window:
    """The changes committed between two snapshots (after, until], and when each was taken."""

    after: str
    after_at: datetime
    until: str
    until_at: datetime


@dataclass(frozen=True)
class Position:
    """What an event id says: the window it was sent in, and its place there (time, lock id and
    kind), the order a window is sent in."""

    window: Window
    place: tuple[datetime, int, int]


class EventIds:
    """Event ids: a position, signed with the database's key (helix_event_id_key), so that every
    replica reads them and a resume starts only where a stream really was."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def _mac(self, payload: bytes) -> bytes:
        return hmac.new(self._key, payload, hashlib.sha256).digest()[:16]

    def encode(self, position: Position) -> str:
        window, (at, lock_id, rank) = position.window, position.place
        raw = [window.after, window.after_at, window.until, window.until_at, at, lock_id, rank]
        payload = json.dumps(
            [value.isoformat() if isinstance(value, datetime) else value for value in raw],
            separators=(",", ":"),
        ).encode()
        return f"{_b64(payload)}.{_b64(self._mac(payload))}"

    def decode(self, text: str) -> Position:
        """The position an event id names; InvalidArgument unless this service signed it, and
        EventsExpired for an id of the builds before ids were signed."""
        payload_text, dot, mac_text = text.partition(".")
        try:
            if not dot:
                earlier = json.loads(_unb64(text))
                if (
                    isinstance(earlier, list)
                    and len(earlier) == 7
                    and all(isinstance(earlier[n], str) and _SNAPSHOT.fullmatch(earlier[n]) for n in (0, 2))
                ):
                    raise EventsExpired("it was made by an earlier version of the service")
                raise ValueError("not an event id")
            payload = _unb64(payload_text)
            if not hmac.compare_digest(_unb64(mac_text), self._mac(payload)):
                raise ValueError("not signed by this service")
            after, after_at, until, until_at, at, lock_id, rank = json.loads(payload)
            if not (_SNAPSHOT.fullmatch(after) and _SNAPSHOT.fullmatch(until)) or _xmax(after) > _xmax(until):
                raise ValueError("not an event id")
            if not isinstance(lock_id, int) or not isinstance(rank, int) or not 0 <= rank <= REVOCATION:
                raise ValueError("not an event id")
            times = [utc(datetime.fromisoformat(value)) for value in (after_at, until_at, at)]
            if any(moment.tzinfo is None for moment in times):
                raise ValueError("time without a time zone")
            return Position(Window(after, times[0], until, times[1]), (times[2], lock_id, rank))
        except (ValueError, TypeError, binascii.Error, RecursionError, OverflowError) as exc:
            raise InvalidArgument("Last-Event-ID", "not an event id of this service") from exc


@dataclass(frozen=True)
class Event:
    organization_id: str
    job_type: str
    wire: bytes  # id, event and data lines, and the blank line


# An event's place in its window (time, lock id, kind), the order a window is sent in.
Place = tuple[datetime, int, int]
# An event a catch-up has yet to send: its window, time, lock id and kind.
Key = tuple[Window, datetime, int, int]


# An event's data line: the JSON of its body, given what happened, when, to which lock, and for an
# acquire the stale lock it took over. The edge supplies it (schemas.event_data, through app.py).
EventData = Callable[[str, datetime, Lock, Reclaimed | None], str]


def _event(ids: EventIds, data: EventData, window: Window, at: datetime, rank: int, row: DictRow) -> Event:
    """The event of kind `rank` at `at` in `window`, about the lock `row` reads."""
    lock = Lock.from_row(row)
    kind: str = (
        KINDS[rank] if rank < END else row["release_reason"] if rank == END else "revocation-requested"
    )
    position = Position(window, (at, lock.id, rank))
    reclaimed = None
    if kind == "acquired" and row["reclaimed_lock_id"] is not None:
        reclaimed = Reclaimed(
            row["reclaimed_lock_id"], row["reclaimed_holder"], utc(row["reclaimed_expired_at"])
        )
    body = data(kind, at, lock, reclaimed)
    wire = f"id: {ids.encode(position)}\nevent: {kind}\ndata: {body}\n\n".encode()
    return Event(lock.organization_id, lock.job_type, wire)


@dataclass
class Watcher:
    """One open stream: what it may see, where it is, and what it has yet to send.

    A fresh watcher joins at the reader's next window. A resumed one catches up (its `keys`, sent a
    page at a time as the client takes them), then waits at its `bridge` for the reader's next
    statement to read from there to the reader's window, and from then on is live."""

    caller: Caller
    authorization: str | None
    organization_id: str | None  # None: every organization (an admin key)
    job_type: str | None
    resumed: bool = False
    events: deque[Event] = field(default_factory=deque)
    queued: int = 0  # bytes of `events`
    keys: deque[Key] = field(default_factory=deque)  # a catch-up's events to send, in order
    # What a catch-up has yet to read after its keys: windows, each from a place in it, or whole.
    sources: deque[tuple[Window, Place | None]] = field(default_factory=deque)
    bridge: tuple[str, datetime] | None = None  # where its catch-up ended: snapshot and time
    live: bool = False
    joined: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # something to send, or the end
    drained: asyncio.Event = field(default_factory=asyncio.Event)  # the client took every event
    catching_up: asyncio.Task[None] | None = None
    ended: bool = False
    retry: bool = False  # ended for the memory it held: the client resumes

    @property
    def held(self) -> int:
        """Bytes this stream holds in memory, about."""
        return self.queued + len(self.keys) * KEY_BYTES

    @property
    def at_bridge(self) -> bool:
        """Whether it caught up and waits for the reader's next statement to join it."""
        done = self.catching_up is None or self.catching_up.done()
        caught_up = not self.keys and not self.sources
        return not self.live and not self.ended and self.bridge is not None and caught_up and done


class EventHub:
    """This process's event reader and its watchers. The reader runs only while someone watches,
    and costs one statement per poll whatever their number. What the watchers hold is counted in
    bytes: a stream may hold `stream_bytes`, the process `memory_bytes`, of which an organization
    its share (`organization_bytes`, or the memory divided among the organizations streaming)."""

    def __init__(
        self,
        db: Database,
        keys: KeyRing,
        data: EventData,
        *,
        poll_seconds: float,
        max_watchers: int,
        max_per_organization: int,
        replay_limit: int,
        stream_bytes: int,
        memory_bytes: int,
        organization_bytes: int,
        keep: timedelta | None,
        keepalive_seconds: float,
    ) -> None:
        self.db = db
        self.keys = keys
        self.data = data
        self.poll_seconds = poll_seconds
        self.max_watchers = max_watchers
        self.max_per_organization = max_per_organization
        self.replay_limit = replay_limit
        self.stream_bytes = stream_bytes
        self.memory_bytes = memory_bytes
        self.organization_bytes = organization_bytes
        self.keep = keep
        self.keepalive_seconds = keepalive_seconds
        self._ids: EventIds | None = None
        self._watchers: list[Watcher] = []
        self._per_organization: Counter[str | None] = Counter()
        self._held = 0
        self._held_by_organization: Counter[str | None] = Counter()
        self._reader: asyncio.Task[None] | None = None
        # Catch-ups read on pooled connections: a few at once, so that requests keep theirs.
        self._replays = asyncio.Semaphore(REPLAYS_AT_ONCE)
        # One catch-up statement per organization at once: an organization's many resumes queue
        # behind each other, not in front of another organization's.
        self._replaying: defaultdict[str | None, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._closed = False

    @property
    def watching(self) -> int:
        return len(self._watchers)

    @property
    def held(self) -> int:
        """Bytes every stream of this process holds, about."""
        return self._held

    async def watch(
        self,
        caller: Caller,
        authorization: str | None,
        organization_id: str | None,
        job_type: str | None,
        last_event_id: str | None,
    ) -> Watcher:
        """A watcher, joined: every change that commits from now on (or after last_event_id) will
        reach it. Raises the limits' errors, EventsExpired, or InvalidArgument for a bad id."""
        if organization_id is not None:
            caller.may_act_in(organization_id)
        scope = organization_id if organization_id is not None else caller.scope
        ids = await self._event_ids()
        resume = None if last_event_id is None else ids.decode(last_event_id)
        # Retention deletes what ended before now - keep: a window that opened before then may
        # have lost events. A minute's margin for the clocks of other machines.
        horizon = None if self.keep is None else datetime.now(UTC) - self.keep + timedelta(minutes=1)
        if resume is not None and horizon is not None and resume.window.after_at < horizon:
            raise EventsExpired("it is older than what the database keeps")
        if self._closed:
            raise ShuttingDown()
        if len(self._watchers) >= self.max_watchers:
            raise TooManyWatchers(self.max_watchers)
        if self._per_organization[caller.organization_id] >= self.max_per_organization:
            raise OrganizationWatchersFull(self.max_per_organization)
        watcher = Watcher(caller, authorization, scope, job_type, resumed=resume is not None)
        watcher.drained.set()
        self._watchers.append(watcher)
        self._per_organization[caller.organization_id] += 1
        try:
            if self._per_organization[caller.organization_id] == 1:
                self._rebalance()  # one more organization: every share is smaller
            if self._held_by_organization[caller.organization_id] >= self._share(caller.organization_id):
                raise OrganizationWatchersFull(self._share(caller.organization_id), "bytes of events held")
            if resume is not None:
                await self._resume(watcher, resume)
            self._start_reader()
            if resume is None:
                await watcher.joined
        except BaseException:
            self.leave(watcher)
            raise
        return watcher

    async def stream(self, watcher: Watcher) -> AsyncIterator[bytes]:
        """The watcher's stream: its events as the client takes them, a comment whenever it is
        quiet, and `retry:` last if it was ended for what it held."""
        try:
            yield KEEP_ALIVE  # joined: the client may count on every change from here on
            while True:
                chunk = self._take(watcher)
                if chunk:
                    yield chunk
                    continue
                if watcher.ended:
                    if watcher.retry:
                        yield RETRY
                    return
                watcher.drained.set()
                try:
                    async with asyncio.timeout(self.keepalive_seconds):
                        await watcher.wake.wait()
                except TimeoutError:
                    yield KEEP_ALIVE
                    continue
                watcher.wake.clear()
        finally:
            self.leave(watcher)

    def leave(self, watcher: Watcher, why: LockError | None = None, *, retry: bool = False) -> None:
        """End the watcher's stream (with `retry:` if asked); one still joining is answered `why`
        (by default 503)."""
        if not watcher.joined.done():
            watcher.joined.set_exception(why or DatabaseUnavailable("the stream ended as it began"))
            watcher.joined.exception()  # retrieved: its request may have gone already
        if watcher in self._watchers:
            self._watchers.remove(watcher)
            self._per_organization[watcher.caller.organization_id] -= 1
            if not self._per_organization[watcher.caller.organization_id]:
                del self._per_organization[watcher.caller.organization_id]
        if watcher.catching_up is not None and watcher.catching_up is not asyncio.current_task():
            watcher.catching_up.cancel()
        if not watcher.ended:
            watcher.ended, watcher.retry = True, retry
            self._hold(watcher, -watcher.held)
            watcher.events.clear()
            watcher.keys.clear()
            watcher.queued = 0
            watcher.wake.set()

    def close(self) -> None:
        """End every stream (the service is stopping) and the reader."""
        self._closed = True
        for watcher in list(self._watchers):
            self.leave(watcher, ShuttingDown())
        if self._reader is not None:
            self._reader.cancel()

    # What the streams hold.

    def _hold(self, watcher: Watcher, size: int) -> None:
        self._held += size
        self._held_by_organization[watcher.caller.organization_id] += size
        if not self._held_by_organization[watcher.caller.organization_id]:
            del self._held_by_organization[watcher.caller.organization_id]

    def _share(self, organization_id: str | None) -> int:
        """What the organization's streams may hold in this process: the memory divided among the
        organizations streaming, or less if a setting says so."""
        fair = self.memory_bytes // max(1, len(self._per_organization))
        return min(fair, self.organization_bytes) if self.organization_bytes else fair

    def _rebalance(self) -> None:
        """End the streams, most holding first, of each organization past its share (as shares
        shrink when another organization starts streaming), so that together they stay within
        the process's memory."""
        for organization_id in list(self._held_by_organization):
            share = self._share(organization_id)
            if self._held_by_organization[organization_id] <= share:
                continue
            theirs = [w for w in self._watchers if w.caller.organization_id == organization_id and w.held]
            for watcher in sorted(theirs, key=lambda w: w.held, reverse=True):
                if self._held_by_organization[organization_id] <= share:
                    break
                self.leave(watcher, retry=True)

    def _over(self, watcher: Watcher, size: int, *, stream: bool = True) -> bool:
        """Whether `size` more bytes would pass the stream's bound (unless not asked) or its
        organization's share (the shares together are the process's memory)."""
        organization_id = watcher.caller.organization_id
        return (stream and watcher.queued + size > self.stream_bytes) or self._held_by_organization[
            organization_id
        ] + size > self._share(organization_id)

    def _deliver(self, watcher: Watcher, events: Sequence[Event], start: tuple[str, datetime]) -> None:
        """Send a live read's events (of the window that opened at `start`) to the watcher, if
        they keep it within its stream's bound and its organization's share. Else one that left
        events unread is ended with `retry:` (it resumes from the last event it took); one that
        took everything catches up from `start` instead, a page at a time."""
        size = sum(len(event.wire) for event in events)
        if events and self._over(watcher, size):
            if watcher.queued:
                self.leave(watcher, retry=True)
            else:
                self._begin_catch_up(watcher, start)
            return
        self._queue(watcher, events)

    def _queue(self, watcher: Watcher, events: Sequence[Event]) -> None:
        """Queue events for the watcher, counted in what it holds."""
        if not events or watcher.ended:
            return
        size = sum(len(event.wire) for event in events)
        watcher.events.extend(events)
        watcher.queued += size
        self._hold(watcher, size)
        watcher.drained.clear()
        watcher.wake.set()

    def _take(self, watcher: Watcher) -> bytes:
        """Up to CHUNK bytes of the watcher's events (at least one), or nothing."""
        taken: list[bytes] = []
        size = 0
        while watcher.events and (not taken or size + len(watcher.events[0].wire) <= CHUNK):
            wire = watcher.events.popleft().wire
            taken.append(wire)
            size += len(wire)
        watcher.queued -= size
        self._hold(watcher, -size)
        return b"".join(taken)

    # Catching up.

    async def _event_ids(self) -> EventIds:
        if self._ids is None:
            row = await self.db.fetch_first(queries.EVENT_ID_KEY, {})
            self._ids = EventIds(bytes(row["key"]))
        return self._ids

    async def _resume(self, watcher: Watcher, resume: Position) -> None:
        """Read what followed the resume's event, as keys to send: the rest of its window, then
        from the window's end to now. Refused here, before the stream is answered: an id the
        database has not reached, more events than a replay may send, or an organization whose
        streams hold its share of memory."""
        window = resume.window
        rows = await self._catch_up_keys(
            watcher, [(window.after, window.until, resume.place), (window.until, None, None)]
        )
        until, until_at = rows[0]["snapshot"], rows[0]["until_at"]
        if _xmax(window.until) > _xmax(until):
            # A window this database has not reached: read before a failover to a standby that
            # lacked the last transactions (asynchronous replication).
            raise EventsExpired("the database has no such point in its history")
        totals = {row["n"]: row["total"] for row in rows if row["id"] is not None}
        if sum(totals.values()) > self.replay_limit:
            raise EventsExpired(
                f"more than {self.replay_limit} events followed it (HELIX_LOCKS_EVENTS_REPLAY_LIMIT)"
            )
        if watcher.ended:  # meanwhile the service began to stop, or made room for others
            organization_id = watcher.caller.organization_id
            raise (
                ShuttingDown()
                if self._closed
                else OrganizationWatchersFull(self._share(organization_id), "bytes of events held")
            )
        watcher.bridge = (until, until_at)
        self._hold_keys(watcher, [window, Window(window.until, window.until_at, until, until_at)], rows)
        self._begin_catch_up(watcher, watcher.bridge)

    def _chunk(self, watcher: Watcher) -> int:
        """How many keys a catch-up reads at once: what half the room left in its
        organization's share holds (the other half for the pages), at least a page, at most a
        replay."""
        organization_id = watcher.caller.organization_id
        room = self._share(organization_id) - self._held_by_organization[organization_id]
        return max(PAGE, min(self.replay_limit, room // 2 // KEY_BYTES))

    async def _catch_up_keys(
        self, watcher: Watcher, windows: list[tuple[str, str | None, Place | None]]
    ) -> list[DictRow]:
        """queries.CATCH_UP for the windows (after, until or None for now, from a place or None):
        at most a chunk of keys from each, and how many there are in all."""
        params = {
            "after": [after for after, _, _ in windows],
            "until": [until for _, until, _ in windows],
            "from_at": [None if place is None else place[0] for _, _, place in windows],
            "from_id": [None if place is None else place[1] for _, _, place in windows],
            "from_rank": [None if place is None else place[2] for _, _, place in windows],
            "organization_id": watcher.organization_id,
            "job_type": watcher.job_type,
            "limit": self._chunk(watcher),
        }
        async with self._turn(watcher, waiting=watcher.catching_up is None):
            try:
                return await self.db.fetch_all(queries.CATCH_UP, params)
            except InvalidRequest as exc:  # PostgreSQL refused a snapshot
                raise InvalidArgument("Last-Event-ID", "not an event id of this service") from exc
            except DatabaseUnavailable as exc:
                if isinstance(exc.__cause__, psycopg.errors.QueryCanceled):
                    raise EventsExpired("reading what followed it takes longer than a statement may") from exc
                raise

    def _hold_keys(self, watcher: Watcher, windows: list[Window], rows: list[DictRow]) -> int:
        """Hold a catch-up read's keys (row n is of windows[n - 1]) for the watcher to send, in
        order: a window read only in part goes back to its sources, from its last key on, and
        those after it with it. How many keys it holds now; OrganizationWatchersFull if even a
        page of them would take its organization past its share."""
        if watcher.ended:
            return 0
        organization_id = watcher.caller.organization_id
        if self._held_by_organization[organization_id] + PAGE * KEY_BYTES > self._share(organization_id):
            raise OrganizationWatchersFull(self._share(organization_id), "bytes of events held")
        keys: list[Key] = []
        for n, window in enumerate(windows, start=1):
            found = [row for row in rows if row["n"] == n and row["id"] is not None]
            keys += [(window, utc(row["at"]), row["id"], row["rank"]) for row in found]
            if found and found[0]["total"] > len(found):  # the rest of it, and what follows, later
                watcher.sources.extend((w, keys[-1][1:] if w is window else None) for w in windows[n - 1 :])
                break
        watcher.keys.extend(keys)
        self._hold(watcher, len(keys) * KEY_BYTES)
        return len(keys)

    def _begin_catch_up(self, watcher: Watcher, start: tuple[str, datetime]) -> None:
        """Catch the watcher up from `start` (a snapshot and its time), on statements of its own."""
        watcher.live, watcher.bridge = False, start
        task = self._catch_up(watcher)
        watcher.catching_up = asyncio.create_task(task, name="helix-locks-catch-up")

    async def _catch_up(self, watcher: Watcher) -> None:
        """Send the watcher's keys a page at a time, each once the client took the one before,
        reading its sources a chunk at a time; then read from where they end to now, and again,
        until a read holds no more than a page. The watcher then waits at that point (its
        bridge) for the reader's next statement, which reads from there to the reader's own
        window: what came within a poll or so.

        Ends the stream with `retry:` (the client resumes from what it took) when the database is
        away, when its organization's streams hold its share, or when a lock went with retention
        (its resume is then refused as older than what the database keeps)."""
        try:
            ids = await self._event_ids()
            while True:
                if not await self._send_keys(watcher, ids):
                    return
                if watcher.sources:
                    window, place = watcher.sources.popleft()
                    rows = await self._catch_up_keys(watcher, [(window.after, window.until, place)])
                    self._hold_keys(watcher, [window], rows)
                    continue
                assert watcher.bridge is not None
                start = watcher.bridge
                rows = await self._catch_up_keys(watcher, [(start[0], None, None)])
                watcher.bridge = (rows[0]["snapshot"], rows[0]["until_at"])
                held = self._hold_keys(watcher, [Window(*start, *watcher.bridge)], rows)
                if held <= PAGE and not watcher.sources:
                    if await self._send_keys(watcher, ids):
                        self._start_reader()
                    return
        except LockError:
            self.leave(watcher, retry=True)
        except Exception:  # a bug: end the stream (it resumes) rather than leave it silent
            logger.exception("event catch-up failed")
            self.leave(watcher, retry=True)

    async def _send_keys(self, watcher: Watcher, ids: EventIds) -> bool:
        """Send the watcher's keys, a page once the client took the one before: as much of the
        page as its organization's share and the process's memory leave room for, and at least
        one event. False if a lock was gone (the stream is then ended)."""
        while watcher.keys:
            await watcher.drained.wait()
            page = [watcher.keys[n] for n in range(min(PAGE, len(watcher.keys)))]
            async with self._turn(watcher):
                rows = await self.db.fetch_all(queries.EVENT_LOCKS, {"ids": [key[2] for key in page]})
            found = {row["id"]: row for row in rows}
            if any(key[2] not in found for key in page):
                self.leave(watcher, retry=True)
                return False
            events: list[Event] = []
            grown = 0  # what the events add, less what their keys held
            for window, at, lock_id, rank in page:
                event = _event(ids, self.data, window, at, rank, found[lock_id])
                if events and self._over(watcher, grown + len(event.wire) - KEY_BYTES, stream=False):
                    break
                events.append(event)
                grown += len(event.wire) - KEY_BYTES
            for _ in events:
                watcher.keys.popleft()
            self._hold(watcher, -len(events) * KEY_BYTES)
            self._queue(watcher, events)
        return True

    @asynccontextmanager
    async def _turn(self, watcher: Watcher, *, waiting: bool = False) -> AsyncIterator[None]:
        """A catch-up statement's turn: one of the organization's at once, REPLAYS_AT_ONCE in all.
        A resume `waiting` to be answered gets TooManyWatchers if the turns ahead take longer than
        a statement's deadline; an open stream's catch-up waits for its turn, however long."""
        turn = self._replaying[watcher.caller.organization_id]
        try:
            async with asyncio.timeout(self.db.deadline_seconds if waiting else None):
                await turn.acquire()
                try:
                    await self._replays.acquire()
                except BaseException:
                    turn.release()
                    raise
        except TimeoutError as exc:
            raise TooManyWatchers(REPLAYS_AT_ONCE, "resumes being read") from exc
        try:
            yield
        finally:
            self._replays.release()
            turn.release()

    # The reader.

    def _start_reader(self) -> None:
        if self._watchers and (self._reader is None or self._reader.done()):
            self._reader = asyncio.create_task(self._read(), name="helix-locks-events")

    async def _read(self) -> None:
        try:
            await self._read_windows()
        except Exception:  # a bug: end every stream (each resumes) rather than leave them silent
            logger.exception("event reader failed")
            for watcher in list(self._watchers):
                self.leave(watcher, InternalError(), retry=True)

    async def _read_windows(self) -> None:
        """Read window after window while anyone watches, announcing the expiries a read found
        due; a failed read is tried again, and the watchers wait meanwhile (their keep-alives go
        on)."""
        window: tuple[str, datetime] | None = None
        due = False
        checked = asyncio.get_running_loop().time()
        failures = 0
        while self._watchers:
            try:
                if due:
                    await self.db.fetch_first(queries.ANNOUNCE_EXPIRIES, {"limit": ANNOUNCE_AT_ONCE})
                if window is None:
                    row = await self.db.fetch_first(queries.EVENTS_START, {})
                    window, due = (row["snapshot"], row["until_at"]), False
                    self._join_fresh(await self._event_ids(), window)
                else:
                    window, due = await self._next(window)
                failures = 0
            except LockError as exc:  # the database is away, or slow: try again
                if window is not None and isinstance(exc.__cause__, psycopg.errors.QueryCanceled):
                    # The window takes longer to read than a statement may (it grew while the
                    # reader was away): the watchers catch up on their own; this starts afresh.
                    self._fall_back(window)
                    window = None
                failures += 1
                for watcher in [w for w in self._watchers if not w.joined.done() and not w.resumed]:
                    self.leave(watcher, exc)
                if failures == 1:
                    logger.warning("event reader could not read: %s", type(exc).__name__)
                await asyncio.sleep(min(5.0, self.poll_seconds * 2**failures))
                continue
            now = asyncio.get_running_loop().time()
            if now - checked >= _KEY_CHECK_SECONDS:
                checked = now
                await self._end_revoked()
            await asyncio.sleep(self.poll_seconds)

    def _join_fresh(self, ids: EventIds, start: tuple[str, datetime]) -> None:
        """Join the fresh watchers at the window that starts at `start`. Each is sent an id
        naming that point before any event, so that a stream cut before its first event resumes
        from where it joined."""
        joining = [w for w in self._watchers if not w.resumed and not w.joined.done()]
        if not joining:
            return
        at = Window(start[0], start[1], start[0], start[1])
        mark = Event("", "", f"id: {ids.encode(Position(at, (EPOCH, 0, 0)))}\n\n".encode())
        for watcher in joining:
            watcher.live = True
            self._queue(watcher, [mark])
            watcher.joined.set_result(None)

    async def _next(self, window: tuple[str, datetime]) -> tuple[tuple[str, datetime] | None, bool]:
        """Read the next window, send its events, and bridge the catch-ups that ended; the new
        window (None: start afresh) and whether expiries are due."""
        bridging = [w for w in self._watchers if w.at_bridge]
        starts: list[tuple[str, str | None, str | None, int]] = [(window[0], None, None, self.replay_limit)]
        starts += [(w.bridge[0], w.organization_id, w.job_type, PAGE) for w in bridging if w.bridge]
        params = {
            name: [start[n] for start in starts]
            for n, name in enumerate(("after", "organization_id", "job_type", "limit"))
        }
        rows = await self.db.fetch_all(queries.EVENTS, params)
        ids = await self._event_ids()
        until, until_at, due = rows[0]["snapshot"], rows[0]["until_at"], rows[0]["due"]
        if _xmax(until) < _xmax(window[0]):
            # The database's history went back (a failover to a standby that lacked the last
            # transactions): windows of the old one would take new changes for seen. Every stream
            # ends, and starts again from here.
            logger.warning("event reader: the database's transaction ids went back; streams end")
            for watcher in list(self._watchers):
                self.leave(watcher, DatabaseUnavailable("the database's history went back"))
            return (until, until_at), due
        by_start: dict[int, list[DictRow]] = {}
        for row in rows:
            if row["id"] is not None:
                by_start.setdefault(row["n"], []).append(row)
        if len(by_start.get(1, [])) > self.replay_limit:
            # More changes than one read may hold (the reader was away a long time, or some
            # organization's burst): the watchers catch up on their own; this starts afresh.
            self._fall_back(window)
            return None, due
        read = Window(window[0], window[1], until, until_at)
        live = [_event(ids, self.data, read, utc(row["at"]), row["rank"], row) for row in by_start.get(1, [])]
        # Sorted once by organization and by key, so that each watcher takes its share at the cost
        # of a lookup, however many watch.
        scopes: dict[tuple[str | None, str | None], list[Event]] = {(None, None): live}
        for event in live:
            for scope in ((event.organization_id, None), (None, event.job_type)):
                scopes.setdefault(scope, []).append(event)
            scopes.setdefault((event.organization_id, event.job_type), []).append(event)
        for watcher in list(self._watchers):
            if watcher.live:
                self._deliver(watcher, scopes.get((watcher.organization_id, watcher.job_type), []), window)
        for n, watcher in enumerate(bridging, start=2):
            assert watcher.bridge is not None
            found = by_start.get(n, [])
            if watcher.ended:
                continue
            bridge = Window(watcher.bridge[0], watcher.bridge[1], until, until_at)
            events = [
                _event(ids, self.data, bridge, utc(row["at"]), row["rank"], row) for row in found[:PAGE]
            ]
            if len(found) > PAGE or self._over(watcher, sum(len(event.wire) for event in events)):
                # Too much came while it caught up, or its client has yet to take what it has: it
                # catches up again from its bridge, a page at a time.
                self._begin_catch_up(watcher, watcher.bridge)
                continue
            self._queue(watcher, events)
            watcher.live, watcher.bridge = True, None
            if not watcher.joined.done():
                watcher.joined.set_result(None)
        self._join_fresh(ids, (until, until_at))
        return (until, until_at), due

    def _fall_back(self, window: tuple[str, datetime]) -> None:
        """The reader cannot read its window (more changes than one read may hold, or longer to
        read than a statement may take): each live watcher catches up from that window's start,
        and each one at its bridge from there, each on statements of its own that read its own
        organization's changes alone, and joins the reader's next windows again."""
        logger.warning("event reader: a window too large to read; its watchers catch up on their own")
        for watcher in list(self._watchers):
            if watcher.live:
                self._begin_catch_up(watcher, window)
            elif watcher.at_bridge:
                assert watcher.bridge is not None
                self._begin_catch_up(watcher, watcher.bridge)

    async def _end_revoked(self) -> None:
        verdicts: dict[str | None, bool] = {}
        for watcher in list(self._watchers):
            if watcher.authorization not in verdicts:
                try:
                    await self.keys.authenticate(watcher.authorization)
                    verdicts[watcher.authorization] = True
                except Unauthenticated:
                    verdicts[watcher.authorization] = False
                except LockError:  # the database is away: decide on a later round
                    verdicts[watcher.authorization] = True
            if not verdicts[watcher.authorization]:
                self.leave(watcher, Unauthenticated("The API key is unknown or revoked."))
