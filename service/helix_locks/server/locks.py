"""Lock operations: each one is a single SQL statement, its row turned into plain data."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from psycopg.rows import DictRow
from psycopg.types.json import Jsonb

from helix_locks.server import queries
from helix_locks.server.db import Database
from helix_locks.server.errors import (
    Forbidden,
    InvalidArgument,
    LockError,
    LockHeld,
    LockNotFound,
    MaxHoldersMismatch,
    QuotaExceeded,
    ShareEnded,
)
from helix_locks.server.keys import Caller

State = Literal["held", "expired", "released", "reclaimed"]
Mode = Literal["exclusive", "shared"]
LIVE_STATES: tuple[State, ...] = ("held", "expired")


@dataclass(frozen=True)
class Lock:
    """One grant, in any state, as the database reported it at answer time."""

    id: int
    organization_id: str
    job_type: str
    holder: str
    fencing_token: int
    acquired_at: datetime
    expires_at: datetime
    released_at: datetime | None
    release_reason: str | None
    state: State
    ttl_remaining_ms: int
    metadata: dict[str, Any] | None
    max_holders: int
    slot: int
    # The admin key that forced the release; None unless release_reason is 'forced'. Read by the
    # statements that can meet a forced lock (one lock, the history, events), absent elsewhere.
    forced_by: str | None = None
    # The session the lock belongs to (migration 0027); None for a lock on its own. Read by the
    # statements that can meet a lock of a session.
    session_id: int | None = None
    # exclusive, or shared (migration 0030): the statements read it as helix_holds.shared.
    mode: Mode = "exclusive"
    # No lease of the lock runs past it (max_hold_seconds, migration 0033); None: no hold limit.
    hold_limit_at: datetime | None = None
    # No other lock of the pair is granted before it (hold_at_least_seconds, migration 0034).
    closed_until: datetime | None = None
    # A request that the holder let go (migration 0035), as recorded: requested_at, reason,
    # deadline, by, preferred_holder; None: none.
    revocation: dict[str, Any] | None = None

    @classmethod
    def from_row(cls, row: DictRow) -> Lock:
        fields = {name: utc(row[name]) for name in cls.__dataclass_fields__ if name in row}
        if row.get("shared"):
            fields["mode"] = "shared"
        return cls(**fields)


def utc(value: Any) -> Any:
    """A time in UTC, whatever the connection's TimeZone (a transaction pooler may hand us a
    session whose TimeZone is not ours); anything else as it is."""
    return value.astimezone(UTC) if isinstance(value, datetime) else value


@dataclass(frozen=True)
class Reclaimed:
    """The stale lock that a grant took over."""

    lock_id: int
    holder: str
    expired_at: datetime


@dataclass(frozen=True)
class Grant:
    """A successful acquire: the lock, its secret token, and what it reclaimed if anything."""

    lock: Lock
    token: str
    reclaimed: Reclaimed | None


@dataclass(frozen=True)
class Renewal:
    """A renewed lock; lapsed says its lease had run out (unreclaimed) before the renewal."""

    lock: Lock
    lapsed: bool
    limited: bool = False  # the lease was cut short by the lock's hold limit


@dataclass(frozen=True)
class Page:
    """One page of a listing; next_cursor is None when nothing follows."""

    items: list[Lock]
    next_cursor: str | None


def _encode_cursor(state: str | None, key: list[Any]) -> str:
    raw = json.dumps({"s": state, "k": key}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _cursor_data(cursor: str) -> Any:
    """What _encode_cursor wrote; ValueError (binascii.Error) when it is no such text."""
    return json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))


def _decode_queue_cursor(cursor: str) -> int:
    """The place a queue's cursor carries; InvalidArgument unless a queue's listing made it."""
    try:
        match _cursor_data(cursor):
            case {"s": "queue", "k": [int() as after]} if not isinstance(after, bool) and 0 < after < 2**63:
                return after
        raise ValueError("not a queue's cursor")
    except (ValueError, TypeError, RecursionError, binascii.Error) as exc:
        raise InvalidArgument("cursor", "not a cursor of this queue") from exc


# Above every slot: a cursor of a build before semaphores named a key, all of whose locks were seen.
_AFTER_EVERY_SLOT = 1000


def _decode_cursor(cursor: str, state: State | None, live: bool) -> list[Any]:
    """The key a cursor carries, typed; InvalidArgument unless this kind of listing made it."""
    try:
        data = _cursor_data(cursor)
        first, second, *rest = data["k"]
        if data["s"] != state:
            raise ValueError("cursor of another state")
        if live and _is_text(first) and _is_text(second):
            match rest:
                case []:
                    return [first, second, _AFTER_EVERY_SLOT]
                case [int() as slot] if not isinstance(slot, bool) and 0 <= slot < _AFTER_EVERY_SLOT:
                    return [first, second, slot]
            raise ValueError("cursor slot out of range")
        if rest:
            raise ValueError("cursor key of the wrong shape")
        if not live and isinstance(second, int) and not isinstance(second, bool) and 0 < second < 2**63:
            moment = datetime.fromisoformat(first)
            if moment.tzinfo is None:
                raise ValueError("cursor time without a time zone")
            return [moment.astimezone(UTC), second]
        raise ValueError("cursor key of the wrong shape")
    except (ValueError, KeyError, TypeError, RecursionError, OverflowError, binascii.Error) as exc:
        raise InvalidArgument("cursor", "not a cursor of this listing") from exc


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and storable_text(value)


def storable_text(value: str) -> bool:
    """PostgreSQL text holds any Unicode but NUL; lone surrogates are not Unicode at all."""
    if "\x00" in value:
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


# How long the place of a waiter whose client left is kept for a retry with its Idempotency-Key.
KEEP_SECONDS = 1.0
# A place that could not be left (the database away) is left again after this long, doubling,
# until it is gone or its wait would have run out: a place whose request ended holds nobody back
# for longer than the database is away.
LEAVE_AGAIN_SECONDS = 0.5

# (job_type, max_holders, mode) of each lock a call asks for.
Wanted = list[tuple[str, int, Mode]]


def wanted_columns(wanted: Wanted) -> dict[str, list[Any]]:
    """The statements' parameters of the locks a call asks for: one array per column."""
    return {
        "job_types": [job_type for job_type, _, _ in wanted],
        "max_holders": [max_holders for _, max_holders, _ in wanted],
        "shared": [mode == "shared" for _, _, mode in wanted],
    }


# An acquire's statement parameters (queries.ACQUIRE_WITHIN_QUOTA's, without the quota): the
# quota reads the organization, and asks with them whether the acquire would add a live lock.
Acquiring = dict[str, Any]


@dataclass(eq=False)
class Place:
    """A waiting request's place in its pair's queue, or in each of its pairs' (a session's),
    held by this request (migration 0029)."""

    id: int  # its order number in the queues (helix_lock_waiters.seq)
    owner: str  # this request, in the database (helix_lock_waiters.owner)
    granted: bool = False  # consumed by the acquire's grant: nothing left to leave
    # Its client left: kept a moment for a retry with the same Idempotency-Key, which takes it over.
    keep: bool = False


@dataclass
class _Share:
    """The room this process may grant in one organization without counting each acquire: a row
    of helix_quota_shares (migration 0020), or none when its count left no room to share."""

    id: int | None  # the row; None: no room was shared, acquires go the exact way
    room: int  # acquires this process may let through on it, at most
    at: float  # time.monotonic() when the count began
    used: int = 0  # acquires let through on it, finished or not
    full_until: float = 0.0  # the database refused an acquire for the quota: refuse until then

    def free(self) -> bool:
        return self.id is not None and self.used < self.room


class LiveLockQuota:
    """At most `limit` live locks (held, or lapsed and not yet reclaimed) per organization, for
    any number of processes.

    Far from the limit, acquires are not counted one by one (an exact count would have to lock
    something that every acquire of the organization shares). This process counts the
    organization's live locks at most once every FRESH_SECONDS (helix_share_quota, migration
    0020), and with the count the database hands it a share of the room below BAND of the limit:
    a SHARE-th of what is left once the room of every share there is held back. It lets at most
    that many acquires through on the share (helix_acquire_job_lock_on_share), each holding the
    share's advisory lock in shared mode to its commit: they wait neither for each other nor for
    a count. With no room to share, an acquire goes through helix_acquire_job_lock_within_quota
    (migration 0013), which counts and grants one at a time per organization, holding the room of
    the shares back, or, when it needs that room, taking the shares back once the acquires in
    flight on them have committed. An acquire on a share that is gone (ShareEnded) goes the exact
    way, or, if this process's own count replaced the share, once more on the new one. The live
    locks, those in flight and the room left on the shares never exceed the limit together.

    A refusal from there is remembered for FULL_SECONDS, so that a stream of acquires at the
    limit costs one count each tenth of a second, not one each; an acquire of a key that has a
    live lock (it adds none), a waiting acquire's attempts and a release by this process skip
    that memory.
    """

    FRESH_SECONDS = 1.0
    # How long the database holds a share's room back: past FRESH_SECONDS, when this process no
    # longer uses it, and no longer, should the process die with it.
    HOLD_SECONDS = 2.0
    FULL_SECONDS = 0.1
    BAND = 0.05  # of the limit
    SHARE = 4  # a share is at most 1/SHARE of the room left below the band
    # Organizations remembered at once; past it, the shares gone stale are forgotten.
    REMEMBERED = 10_000

    def __init__(self, db: Database, limit: int) -> None:
        self.db = db
        self.limit = limit
        self.near = limit - max(1, int(limit * self.BAND))
        self._shares: dict[str, _Share] = {}
        # One at a time per organization in this process, and how many use each: the counts; the
        # acquires the exact way.
        self._counting: dict[str, tuple[asyncio.Lock, int]] = {}
        self._gates: dict[str, tuple[asyncio.Lock, int]] = {}

    async def admit(self, acquiring: Acquiring, *, waiting: bool = False) -> int | None:
        """The share the acquire may go through on (one of its room taken), or None if it must go
        the exact way. QuotaExceeded if the database refused this organization an acquire a
        moment ago and this one could add a live lock."""
        organization_id = acquiring["organization_id"]
        if self._full(organization_id, waiting):
            await self.refuse_if_it_adds(acquiring)
            return None
        return self._take(await self._counted(organization_id), 1)

    async def admit_many(self, organization_id: str, count: int) -> int | None:
        """The share that `count` grants at once (a session's locks) may go through on, its room
        taken for all of them, or None if they must go the exact way."""
        if self._full(organization_id, False):
            return None
        return self._take(await self._counted(organization_id), count)

    async def _counted(self, organization_id: str) -> _Share:
        """The organization's share, counted again first if it is spent."""
        share = self._shares.get(organization_id)
        if self._spent(share):
            async with _one_at_a_time(self._counting, organization_id):
                share = self._shares.get(organization_id)
                if self._spent(share):  # nobody counted while this one waited for its turn
                    share = await self._count(organization_id, share)
        assert share is not None
        return share

    @staticmethod
    def _take(share: _Share, count: int) -> int | None:
        """The share's id, `count` of its room taken, if it has that much room; else None."""
        if share.id is not None and share.used + count <= share.room:
            share.used += count
            return share.id
        return None

    def _spent(self, share: _Share | None) -> bool:
        """Whether the organization must be counted again: never counted, counted too long ago,
        or its share's room all let through (with no room shared, it is not counted again
        before FRESH_SECONDS: the exact way counts anyway)."""
        return (
            share is None
            or time.monotonic() - share.at > self.FRESH_SECONDS
            or (share.id is not None and not share.free())
        )

    async def _count(self, organization_id: str, previous: _Share | None) -> _Share:
        at = time.monotonic()
        row = await self.db.fetch_first(
            queries.SHARE_QUOTA,
            {
                "organization_id": organization_id,
                "limit": self.near,
                "parts": self.SHARE,
                "seconds": self.HOLD_SECONDS,
                "previous": None if previous is None else previous.id,
            },
        )
        share = _Share(row["share_id"], int(row["share_room"]), at)
        if previous is not None:
            share.full_until = previous.full_until
        if organization_id not in self._shares and len(self._shares) >= self.REMEMBERED:
            fresh = time.monotonic() - self.FRESH_SECONDS
            self._shares = {org: s for org, s in self._shares.items() if s.at > fresh}
        self._shares[organization_id] = share
        return share

    def _full(self, organization_id: str, waiting: bool) -> bool:
        """Whether the database refused the organization an acquire a moment ago (a waiting
        acquire's attempt, woken by a release, goes by what it finds instead)."""
        share = self._shares.get(organization_id)
        return share is not None and time.monotonic() < share.full_until and not waiting

    async def refuse_if_it_adds(self, acquiring: Acquiring) -> None:
        """QuotaExceeded unless the acquire would add no live lock."""
        row = await self.db.fetch_first(queries.ADDS_NO_LIVE_LOCK, acquiring)
        if not row["adds_none"]:
            raise QuotaExceeded(self.limit)

    @asynccontextmanager
    async def exactly(self, acquiring: Acquiring, *, waiting: bool) -> AsyncIterator[None]:
        """Around an acquire the exact way: one at a time per organization in this process, so
        that those waiting for their turn hold no pooled connection (a burst at one
        organization's quota must not take the pool from the others), and each one whose turn
        comes after a refusal is refused without counting again."""
        organization_id = acquiring["organization_id"]
        async with _one_at_a_time(self._gates, organization_id):
            if self._full(organization_id, waiting):
                await self.refuse_if_it_adds(acquiring)
            yield

    def ended(self, organization_id: str, share_id: int, *, again: bool) -> int | None:
        """The database no longer holds the share's room (ShareEnded). Taken back near the quota,
        most likely: the organization goes the exact way until it is counted again, and so does
        the acquire (None). Replaced by this process's own count since the acquire was let
        through on it: if `again`, the share that replaced it, with room taken from it, if it has
        room."""
        share = self._shares.get(organization_id)
        if share is None:
            return None
        if share.id == share_id:
            share.id, share.room = None, 0
        elif again and share.free():
            share.used += 1
            return share.id
        return None

    def unused(self, organization_id: str, share_id: int) -> None:
        """An acquire let through on the share is known to have added no live lock (409, or it
        reclaimed one): its room is the share's again."""
        share = self._shares.get(organization_id)
        if share is not None and share.id == share_id:
            share.used = max(0, share.used - 1)

    def refused(self, organization_id: str) -> None:
        """The database refused an acquire of the organization for its quota."""
        if (share := self._shares.get(organization_id)) is not None:
            share.full_until = time.monotonic() + self.FULL_SECONDS

    def released(self, organization_id: str) -> None:
        """This process ended one of the organization's live locks: there is room again."""
        if (share := self._shares.get(organization_id)) is not None:
            share.full_until = 0.0


@asynccontextmanager
async def _one_at_a_time(
    gates: dict[str, tuple[asyncio.Lock, int]], organization_id: str
) -> AsyncIterator[None]:
    """Inside, no other holder of the organization's gate of `gates` is; a gate lasts while anyone
    uses it or waits for it."""
    gate, users = gates.get(organization_id, (asyncio.Lock(), 0))
    gates[organization_id] = (gate, users + 1)
    try:
        async with gate:
            yield
    finally:
        gate, users = gates[organization_id]
        if users == 1:
            del gates[organization_id]
        else:
            gates[organization_id] = (gate, users - 1)


class Locks:
    """The lock operations of one service process."""

    def __init__(self, db: Database, quota: LiveLockQuota) -> None:
        self.db = db
        self.quota = quota
        self._leaving: set[asyncio.Task[None]] = set()  # places to leave once the database is back

    async def acquire(
        self,
        caller: Caller,
        organization_id: str,
        job_type: str,
        holder: str,
        ttl_ms: int,
        metadata: dict[str, Any] | None,
        idempotency_key: str | None = None,
        waiting: bool = False,
        max_holders: int = 1,
        place: Place | None = None,
        mode: Mode = "exclusive",
        max_hold_ms: int | None = None,
        hold_at_least_ms: int | None = None,
    ) -> Grant:
        """Grant the lock (a free slot of up to max_holders), or raise LockHeld (every slot held),
        WaitersAhead (places of the pair's queue come first) or MaxHoldersMismatch (held with
        another max_holders). A repeat with the same idempotency key, while the lock it got is
        live, answers that same grant. `waiting`: an attempt of a waiting acquire, woken by a
        release (no refusal for the quota on what was known before it); `place`: its place in the
        queue, which its grant consumes."""
        caller.may_act_in(organization_id)
        params: Acquiring = {
            "organization_id": organization_id,
            "job_type": job_type,
            "holder": holder,
            "ttl_ms": ttl_ms,
            "metadata": None if metadata is None else Jsonb(metadata),
            "idempotency_key": idempotency_key,
            "max_holders": max_holders,
            "place": None if place is None else place.id,
            "mode": mode,
            "max_hold_ms": max_hold_ms,
            "hold_at_least_ms": hold_at_least_ms,
        }
        share = await self.quota.admit(params, waiting=waiting)
        row: DictRow | None = None
        try:
            tries = 2  # on the share it was let through on, then on the one that replaced it
            while share is not None and row is None:
                tries -= 1
                try:
                    row = await self.db.fetch_first(queries.ACQUIRE_ON_SHARE, {**params, "share": share})
                except ShareEnded:
                    share = self.quota.ended(organization_id, share, again=tries > 0)
                except (LockHeld, MaxHoldersMismatch):
                    self.quota.unused(organization_id, share)
                    raise
            if row is None:  # near the quota: counted and granted under the organization's lock
                params["quota"] = self.quota.limit
                async with self.quota.exactly(params, waiting=waiting):
                    row = await self.db.fetch_first(queries.ACQUIRE_WITHIN_QUOTA, params)
            elif share is not None and row["reclaimed_lock_id"] is not None:
                self.quota.unused(organization_id, share)
        except QuotaExceeded:
            self.quota.refused(organization_id)
            raise
        if place is not None:
            place.granted = True
        reclaimed = None
        if row["reclaimed_lock_id"] is not None:
            reclaimed = Reclaimed(
                row["reclaimed_lock_id"], row["reclaimed_holder"], utc(row["reclaimed_expired_at"])
            )
        return Grant(Lock.from_row(row), row["token"], reclaimed)

    async def remaining_ms(self, lock_id: int) -> int | None:
        """Milliseconds until an unreleased lock's lease runs out, by the database clock."""
        row = await self.db.fetch_optional(queries.REMAINING, {"lock_id": lock_id})
        return None if row is None else int(row["ttl_remaining_ms"])

    @asynccontextmanager
    async def queued(
        self,
        organization_id: str,
        wanted: Wanted,
        holder: str,
        seconds: float,
        replica: str,
        idempotency_key: str | None,
    ) -> AsyncIterator[Place]:
        """While inside, a place in the queue of each wanted pair ((job type, max_holders, mode)), all
        with one order number, held by this replica (with an idempotency key: the places of the
        try this one repeats, while they live), which also have the pairs' ends announced
        (NOTIFY); they expire by themselves after `seconds`, should this process die meanwhile.
        Left on the way out unless a grant consumed them: at once, or, if the waiter says `keep`,
        after KEEP_SECONDS unless a retry takes them over."""
        owner = secrets.token_hex(8)
        params = {
            "organization_id": organization_id,
            "holder": holder,
            **wanted_columns(wanted),
            "seconds": seconds,
            "replica": replica,
            "owner": owner,
            "idempotency_key": idempotency_key,
        }
        place = Place((await self.db.fetch_first(queries.TAKE_PLACES, params))["seq"], owner)
        until = time.monotonic() + seconds
        try:
            yield place
        finally:
            if not place.granted:
                leaving = {
                    "seq": place.id,
                    "organization_id": organization_id,
                    "owner": owner,
                    "keep": KEEP_SECONDS if place.keep else 0,
                }
                try:
                    await self.db.fetch_all(queries.LEAVE_QUEUE, leaving)
                except LockError:  # the database is away: leave once it is back
                    self._leaving.add(asyncio.create_task(self._leave_again(leaving, until)))

    async def _leave_again(self, leaving: dict[str, Any], until: float) -> None:
        pause = LEAVE_AGAIN_SECONDS
        try:
            while time.monotonic() < until:
                await asyncio.sleep(pause)
                with contextlib.suppress(LockError):
                    await self.db.fetch_all(queries.LEAVE_QUEUE, {**leaving, "keep": 0})
                    return
                pause = min(pause * 2, 8)
        finally:
            self._leaving.discard(asyncio.current_task())

    async def queue(
        self, caller: Caller, organization_id: str, job_type: str, limit: int, cursor: str | None
    ) -> tuple[list[DictRow], str | None]:
        """One page of the pair's queue: its live places in order, each with its position."""
        if caller.scope not in (None, organization_id):
            return [], None  # another organization's queue does not exist for this caller
        after = _decode_queue_cursor(cursor) if cursor else 0
        params = {
            "organization_id": organization_id,
            "job_type": job_type,
            "after": after,
            "limit": limit + 1,
        }
        rows = await self.db.fetch_all(queries.QUEUE, params)
        next_cursor = _encode_cursor("queue", [rows[limit - 1]["seq"]]) if len(rows) > limit else None
        return rows[:limit], next_cursor

    async def release(self, caller: Caller, lock_id: int, token: str) -> Lock:
        params = {"lock_id": lock_id, "token": token, "scope": caller.scope}
        lock = Lock.from_row(await self.db.fetch_first(queries.RELEASE, params))
        self.quota.released(lock.organization_id)
        return lock

    async def release_unclaimed(self, caller: Caller, lock_id: int, token: str) -> bool:
        """Release a grant nobody was told of (its waiting client left), unless a retry with its
        Idempotency-Key claimed it meanwhile; True if released."""
        params = {"lock_id": lock_id, "token": token, "scope": caller.scope}
        return bool((await self.db.fetch_first(queries.RELEASE_UNCLAIMED, params))["released"])

    async def force_release(self, caller: Caller, lock_id: int) -> Lock:
        """Break a lock without its token: admin keys only, recorded with the key's id."""
        if not caller.admin:
            raise Forbidden("Only an admin API key may release a lock by force.")
        params = {"lock_id": lock_id, "key_id": caller.key_id}
        lock = Lock.from_row(await self.db.fetch_first(queries.FORCE_RELEASE, params))
        self.quota.released(lock.organization_id)
        return lock

    async def renew(self, caller: Caller, lock_id: int, token: str, ttl_ms: int) -> Renewal:
        params = {"lock_id": lock_id, "token": token, "ttl_ms": ttl_ms, "scope": caller.scope}
        row = await self.db.fetch_first(queries.RENEW, params)
        return Renewal(Lock.from_row(row), row["lapsed"], row["limited"])

    async def update(self, caller: Caller, lock_id: int, token: str, metadata: dict[str, Any] | None) -> Lock:
        """Replace a held lock's metadata; its lease stays as it is."""
        params = {
            "lock_id": lock_id,
            "token": token,
            "metadata": None if metadata is None else Jsonb(metadata),
            "scope": caller.scope,
        }
        return Lock.from_row(await self.db.fetch_first(queries.UPDATE, params))

    async def request_revocation(
        self, caller: Caller, lock_id: int, reason: str, deadline_ms: int, preferred_holder: str | None
    ) -> Lock:
        """Ask the holder to let go: the first request is recorded, a repeat changes nothing."""
        params = {
            "lock_id": lock_id,
            "scope": caller.scope,
            "reason": reason,
            "deadline_ms": deadline_ms,
            "by": caller.key_id,
            "preferred_holder": preferred_holder,
        }
        return Lock.from_row(await self.db.fetch_first(queries.REQUEST_REVOCATION, params))

    async def get(self, caller: Caller, lock_id: int) -> Lock:
        row = await self.db.fetch_optional(queries.GET, {"lock_id": lock_id, "scope": caller.scope})
        if row is None:
            raise LockNotFound()
        return Lock.from_row(row)

    async def current(
        self, caller: Caller, organization_id: str, job_type: str, slot: int | None = None
    ) -> Lock:
        """The lock held right now for the key with the highest fencing token, or the one held in
        `slot`; a lapsed lease is not held."""
        if caller.scope not in (None, organization_id):
            raise LockNotFound()
        row = await self.db.fetch_optional(
            queries.CURRENT, {"organization_id": organization_id, "job_type": job_type, "slot": slot}
        )
        if row is None:
            raise LockNotFound()
        return Lock.from_row(row)

    async def list(
        self,
        caller: Caller,
        *,
        organization_id: str | None,
        job_type: str | None,
        state: State | None,
        limit: int,
        cursor: str | None,
    ) -> Page:
        """Live locks (held, expired or both) in key order, or history newest first."""
        if caller.scope is not None:
            if organization_id not in (None, caller.scope):
                return Page([], None)  # another organization's locks do not exist for this caller
            organization_id = caller.scope
        live = state is None or state in LIVE_STATES
        after = _decode_cursor(cursor, state, live) if cursor else [None, None, None]
        params: dict[str, Any] = {
            "organization_id": organization_id,
            "job_type": job_type,
            "state": state,
            "limit": limit + 1,
        }
        if live:
            params.update(after_organization_id=after[0], after_job_type=after[1], after_slot=after[2])
        else:
            params.update(after_released_at=after[0], after_id=after[1])
        # A statement of its own for each kind, so that its plan, generic too, scans one range of
        # an index within the organization (queries.py).
        if organization_id is None:  # an admin's, across organizations
            statement = (
                queries.LIST_LIVE_ALL_ORGANIZATIONS if live else queries.LIST_HISTORY_ALL_ORGANIZATIONS
            )
        elif job_type is None:
            statement = queries.LIST_LIVE if live else queries.LIST_HISTORY
        else:
            statement = queries.LIST_LIVE_OF_JOB_TYPE if live else queries.LIST_HISTORY_OF_JOB_TYPE
        rows = await self.db.fetch_all(statement, params)
        items = [Lock.from_row(row) for row in rows[:limit]]
        next_cursor = None
        if len(rows) > limit:
            last = items[-1]
            if live:
                key: list[Any] = [last.organization_id, last.job_type, last.slot]
            else:
                assert last.released_at is not None
                key = [last.released_at.isoformat(), last.id]
            next_cursor = _encode_cursor(state, key)
        return Page(items, next_cursor)
