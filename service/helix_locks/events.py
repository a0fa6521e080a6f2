"""GET /v1/events: one reader per process turns the database's windows of changes into events
for every watcher (migration 0016 says why none is lost, repeated or reordered)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import re
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg.rows import DictRow

from helix_locks import queries
from helix_locks.db import Database
from helix_locks.errors import (
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
from helix_locks.keys import Caller, KeyRing
from helix_locks.locks import Lock, Reclaimed, utc
from helix_locks.schemas import AcquiredEventBody, EventBody, LockBody, ReclaimedBody

logger = logging.getLogger(__name__)

# xmin:xmax:xip,... as PostgreSQL writes a pg_snapshot.
_SNAPSHOT = re.compile(r"([0-9]{1,20}):([0-9]{1,20}):((?:[0-9]{1,20}(?:,[0-9]{1,20})*)?)")
KEEP_ALIVE = b": keep-alive\n\n"
# Resumes whose replays one process reads at once (each on a pooled connection).
REPLAYS_AT_ONCE = 2
# How often the reader checks that each watcher's API key still works.
_KEY_CHECK_SECONDS = 1.0


def _xmax(snapshot: str) -> int:
    found = _SNAPSHOT.fullmatch(snapshot)
    assert found is not None
    return int(found.group(2))


@dataclass(frozen=True)
class Position:
    """What an event id says: the window (after, until] it was read in, the window's times, and
    the event's place in it (lock id, time, kind).

    This build sends a window by time, then lock id and kind (queries.EVENTS), and writes the
    place's time with "Z". Ids of the builds before it, which sent a window by lock id, time and
    kind, write "+00:00" there: such an id, resumed here during a rolling upgrade, leaves out what
    its window held up to its place in that order (`sent`), so nothing is repeated or lost. (The
    builds before read this build's ids too, in their own order: see docs/deployment.md.)"""

    after: str
    after_at: datetime
    until: str
    until_at: datetime
    place: tuple[int, datetime, int]
    by_time: bool = True

    def sent(self, lock_id: int, at: datetime, rank: int) -> bool:
        """Whether the event at this place in the id's window came before the id's, or is it."""
        if self.by_time:
            return (at, lock_id, rank) <= (self.place[1], self.place[0], self.place[2])
        return (lock_id, at, rank) <= self.place

    def encode(self) -> str:
        lock_id, at, rank = self.place
        raw: list[str | int] = [self.after, self.after_at.isoformat(), self.until, self.until_at.isoformat()]
        raw += [lock_id, at.isoformat().replace("+00:00", "Z") if self.by_time else at.isoformat(), rank]
        return base64.urlsafe_b64encode(json.dumps(raw, separators=(",", ":")).encode()).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> Position:
        """The position an event id names; InvalidArgument unless this service made it."""
        try:
            raw = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
            after, after_at, until, until_at, lock_id, at, rank = raw
            snapshots = [_SNAPSHOT.fullmatch(after), _SNAPSHOT.fullmatch(until)]
            if not all(snapshots) or not isinstance(lock_id, int) or not isinstance(rank, int):
                raise ValueError("not an event id")
            if not (0 < lock_id < 2**63 and 0 <= rank <= 3) or _xmax(after) > _xmax(until):
                raise ValueError("not an event id")
            times = [datetime.fromisoformat(value) for value in (after_at, until_at, at)]
            if any(moment.tzinfo is None for moment in times):
                raise ValueError("time without a time zone")
            return cls(after, times[0], until, times[1], (lock_id, times[2], rank), at.endswith("Z"))
        except (ValueError, TypeError, binascii.Error, RecursionError, OverflowError) as exc:
            raise InvalidArgument("Last-Event-ID", "not an event id of this service") from exc


@dataclass
class Watcher:
    """One open stream: what it may see, and the events it has yet to send (None ends it)."""

    caller: Caller
    authorization: str | None
    organization_id: str | None  # None: every organization (an admin key)
    job_type: str | None
    resume: Position | None
    # Each read's events for this watcher; the events themselves are shared by every watcher.
    queue: asyncio.Queue[list[Event] | None] = field(default_factory=asyncio.Queue)
    joined: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    bridge: tuple[str, datetime] | None = None  # where its replay ended (snapshot, time)
    backlog: int = 0  # events queued and not yet taken
    ended: bool = False

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.queue.put_nowait(None)

    async def next(self) -> bytes | None:
        """The next chunk of the stream, None at its end."""
        events = await self.queue.get()
        if events is None:
            return None
        self.backlog -= len(events)
        return b"".join(event.wire for event in events)


@dataclass(frozen=True)
class Event:
    organization_id: str
    job_type: str
    wire: bytes  # id, event and data lines, and the blank line


def _event(row: DictRow, window: tuple[str, datetime, str, datetime]) -> Event:
    lock = Lock.from_row(row)
    kind, at = row["event"], utc(row["at"])
    position = Position(*window, (lock.id, at, row["rank"]))
    body: EventBody
    if kind == "acquired":
        reclaimed = None
        if row["reclaimed_lock_id"] is not None:
            stale = Reclaimed(
                row["reclaimed_lock_id"], row["reclaimed_holder"], utc(row["reclaimed_expired_at"])
            )
            reclaimed = ReclaimedBody.model_validate(stale, from_attributes=True)
        body = AcquiredEventBody(type=kind, at=at, lock=LockBody.of(lock), reclaimed=reclaimed)
    else:
        body = EventBody(type=kind, at=at, lock=LockBody.of(lock))
    wire = f"id: {position.encode()}\nevent: {kind}\ndata: {body.model_dump_json()}\n\n".encode()
    return Event(lock.organization_id, lock.job_type, wire)


def _starts(
    starts: list[tuple[str, datetime, str | None, str | None]],
    seen: tuple[str, datetime] | None = None,
    limit: int | None = None,
) -> dict[str, list[Any]]:
    """queries.EVENTS's parameters: for each start, its window's beginning and scope; seen and
    limit for a replay (one more row than the limit tells that it was passed)."""
    after, after_at, organization_id, job_type = (list(column) for column in zip(*starts, strict=True))
    return {
        "after": after,
        "after_at": after_at,
        "organization_id": organization_id,
        "job_type": job_type,
        "seen": [None if seen is None else seen[0]] * len(starts),
        "seen_at": [None if seen is None else seen[1]] * len(starts),
        "limit": [None if limit is None else limit + 1] * len(starts),
    }


class EventHub:
    """This process's event reader and its watchers. The reader runs only while someone watches,
    and costs one statement per poll whatever their number."""

    def __init__(
        self,
        db: Database,
        keys: KeyRing,
        *,
        poll_seconds: float,
        max_watchers: int,
        max_per_organization: int,
        replay_limit: int,
        backlog: int,
        keep: timedelta | None,
        keepalive_seconds: float,
    ) -> None:
        self.db = db
        self.keys = keys
        self.poll_seconds = poll_seconds
        self.max_watchers = max_watchers
        self.max_per_organization = max_per_organization
        self.replay_limit = replay_limit
        self.backlog = backlog
        self.keep = keep
        self.keepalive_seconds = keepalive_seconds
        self._watchers: list[Watcher] = []
        self._per_organization: Counter[str | None] = Counter()
        self._reader: asyncio.Task[None] | None = None
        # Replays run on pooled connections: at most a few at once, so that requests keep theirs.
        self._replays = asyncio.Semaphore(REPLAYS_AT_ONCE)
        # One replay per organization at once (a lock for each organization that resumed).
        self._replaying: defaultdict[str | None, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._closed = False

    @property
    def watching(self) -> int:
        return len(self._watchers)

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
        resume = None if last_event_id is None else Position.decode(last_event_id)
        # Retention deletes what ended before now - keep: a window that opened before then may
        # have lost events. A minute's margin for the clocks of other machines.
        horizon = None if self.keep is None else datetime.now(UTC) - self.keep + timedelta(minutes=1)
        if resume is not None and horizon is not None and resume.after_at < horizon:
            raise EventsExpired("it is older than what the database keeps")
        if self._closed:
            raise ShuttingDown()
        if len(self._watchers) >= self.max_watchers:
            raise TooManyWatchers(self.max_watchers)
        if self._per_organization[caller.organization_id] >= self.max_per_organization:
            raise OrganizationWatchersFull(self.max_per_organization)
        watcher = Watcher(caller, authorization, scope, job_type, resume)
        self._watchers.append(watcher)
        self._per_organization[caller.organization_id] += 1
        try:
            if resume is not None:
                await self._replay(watcher, resume)
            if self._reader is None or self._reader.done():
                self._reader = asyncio.create_task(self._read(), name="helix-locks-events")
            await watcher.joined
        except BaseException:
            self.leave(watcher)
            raise
        return watcher

    async def stream(self, watcher: Watcher) -> AsyncIterator[bytes]:
        """The watcher's stream: its events as they come, a comment whenever it is quiet."""
        try:
            yield KEEP_ALIVE  # joined: the client may count on every change from here on
            while True:
                try:
                    async with asyncio.timeout(self.keepalive_seconds):
                        chunk = await watcher.next()
                except TimeoutError:
                    yield KEEP_ALIVE
                    continue
                if chunk is None:
                    return
                yield chunk
        finally:
            self.leave(watcher)

    def leave(self, watcher: Watcher, why: LockError | None = None) -> None:
        """End the watcher's stream; one still joining is answered `why` (by default 503)."""
        if not watcher.joined.done():
            watcher.joined.set_exception(why or DatabaseUnavailable("the stream ended as it began"))
            watcher.joined.exception()  # retrieved: its request may have gone already
        if watcher in self._watchers:
            self._watchers.remove(watcher)
            self._per_organization[watcher.caller.organization_id] -= 1
        watcher.end()

    def close(self) -> None:
        """End every stream (the service is stopping) and the reader."""
        self._closed = True
        for watcher in list(self._watchers):
            self.leave(watcher, ShuttingDown())
        if self._reader is not None:
            self._reader.cancel()

    async def _read(self) -> None:
        try:
            await self._read_windows()
        except Exception:  # a bug: end every stream (each resumes) rather than leave them silent
            logger.exception("event reader failed")
            for watcher in list(self._watchers):
                self.leave(watcher, InternalError())

    async def _read_windows(self) -> None:
        """Read window after window while anyone watches; a failed read is tried again, and the
        watchers wait meanwhile (their keep-alives go on)."""
        window: tuple[str, datetime] | None = None
        checked = asyncio.get_running_loop().time()
        failures = 0
        while self._watchers:
            try:
                if window is None:
                    row = await self.db.fetch_first(queries.EVENTS_START, {})
                    window = (row["snapshot"], row["until_at"])
                    self._join_fresh()
                else:
                    window = await self._next(window)
                failures = 0
            except LockError as exc:  # the database is away, or slow: try again
                failures += 1
                for watcher in [w for w in self._watchers if not w.joined.done()]:
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

    def _join_fresh(self) -> None:
        for watcher in self._watchers:
            if watcher.resume is None and not watcher.joined.done():
                watcher.joined.set_result(None)

    async def _replay(self, watcher: Watcher, resume: Position) -> None:
        """What followed the resume's event, read by a statement of its own: a long replay delays
        no one else's events, and a refused one fails alone. The watcher then waits for the
        reader's next window to bridge from the replay's end."""
        start = (resume.after, resume.after_at, watcher.organization_id, watcher.job_type)
        params = _starts([start], seen=(resume.until, resume.until_at), limit=self.replay_limit)
        # One replay of an organization at a time, and REPLAYS_AT_ONCE in all: an organization's
        # many resumes queue behind each other, not in front of another organization's.
        turn = self._replaying[watcher.caller.organization_id]
        try:
            async with asyncio.timeout(self.db.deadline_seconds):  # the replays ahead of it
                await turn.acquire()
                try:
                    await self._replays.acquire()
                except BaseException:
                    turn.release()
                    raise
        except TimeoutError as exc:
            raise TooManyWatchers(REPLAYS_AT_ONCE, "resumes being read") from exc
        try:
            rows = await self._replay_rows(params)
        finally:
            self._replays.release()
            turn.release()
        until, until_at = rows[0]["snapshot"], rows[0]["until_at"]
        if _xmax(resume.until) > _xmax(until):
            # A window this database has not reached: made up, or read before a failover to a
            # standby that lacked the last transactions (asynchronous replication).
            raise EventsExpired("the database has no such point in its history")
        found = [row for row in rows if row["event"] is not None]
        if len(found) > self.replay_limit:
            raise EventsExpired(
                f"more than {self.replay_limit} events followed it (HELIX_LOCKS_EVENTS_REPLAY_LIMIT)"
            )
        # Leave out what the stream had sent: the events of the window the id was read in, up to
        # the id's own.
        window = (resume.after, resume.after_at, until, until_at)
        replayed = [
            _event(row, window)
            for row in found
            if not (row["seen"] and resume.sent(row["id"], utc(row["at"]), row["rank"]))
        ]
        self._send(watcher, replayed, joining=True)
        watcher.bridge = (until, until_at)

    async def _replay_rows(self, params: dict[str, list[Any]]) -> list[DictRow]:
        try:
            return await self.db.fetch_all(queries.EVENTS, params)
        except InvalidRequest as exc:  # PostgreSQL refused a snapshot
            raise InvalidArgument("Last-Event-ID", "not an event id of this service") from exc
        except DatabaseUnavailable as exc:
            if isinstance(exc.__cause__, psycopg.errors.QueryCanceled):
                raise EventsExpired("replaying what followed it takes longer than a statement may") from exc
            raise

    async def _next(self, window: tuple[str, datetime]) -> tuple[str, datetime]:
        """Read the next window, send its events, and answer the resumes waiting; the new window."""
        # A resumed watcher's replay ended at a snapshot of its own: the window from there to this
        # read's joins it to the reader's windows (a few changes, read in the same statement).
        bridging = [w for w in self._watchers if w.bridge is not None and not w.joined.done()]
        starts: list[tuple[str, datetime, str | None, str | None]] = [(*window, None, None)]
        for watcher in bridging:
            assert watcher.bridge is not None
            starts.append((*watcher.bridge, watcher.organization_id, watcher.job_type))
        rows = await self.db.fetch_all(queries.EVENTS, _starts(starts))
        until, until_at = rows[0]["snapshot"], rows[0]["until_at"]
        if _xmax(until) < _xmax(window[0]):
            # The database's history went back (a failover to a standby that lacked the last
            # transactions): windows of the old one would take new changes for seen. Every stream
            # ends, and starts again from here.
            logger.warning("event reader: the database's transaction ids went back; streams end")
            for watcher in list(self._watchers):
                self.leave(watcher, DatabaseUnavailable("the database's history went back"))
            return until, until_at
        by_start: dict[int, list[DictRow]] = {}
        for row in rows:
            by_start.setdefault(row["n"], []).append(row)
        read = (window[0], window[1], until, until_at)
        live = [_event(row, read) for row in by_start[1] if row["event"] is not None]
        # Sorted once by organization and by key, so that each watcher takes its share at the cost
        # of a lookup, however many watch.
        scopes: dict[tuple[str | None, str | None], list[Event]] = {(None, None): live}
        for event in live:
            for scope in ((event.organization_id, None), (None, event.job_type)):
                scopes.setdefault(scope, []).append(event)
            scopes.setdefault((event.organization_id, event.job_type), []).append(event)
        for watcher in list(self._watchers):
            if watcher.joined.done():
                self._send(watcher, scopes.get((watcher.organization_id, watcher.job_type), []))
        for n, watcher in enumerate(bridging, start=2):
            assert watcher.bridge is not None
            bridge = (*watcher.bridge, until, until_at)
            found = [row for row in by_start.get(n, []) if row["event"] is not None]
            self._send(watcher, [_event(row, bridge) for row in found], joining=True)
            if not watcher.joined.done():
                watcher.joined.set_result(None)
        self._join_fresh()
        return until, until_at

    def _send(self, watcher: Watcher, events: list[Event], *, joining: bool = False) -> None:
        """Queue the events for the watcher; one that has left more than the backlog unread is
        ended (it resumes from the last event it took). A read's events always reach a watcher
        that has taken everything before them, and a replay and its bridge (joining, before the
        watcher can read; bounded by the replay limit and one read) always reach it."""
        if not events or watcher.ended:
            return
        if not joining and watcher.backlog and watcher.backlog + len(events) > self.backlog:
            self.leave(watcher)
            return
        watcher.backlog += len(events)
        watcher.queue.put_nowait(events)

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
