"""Sessions (migration 0027): one lease that many locks share, renewed and ended by one statement,
and several locks granted by one statement, all or none. Each call is one SQL function."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, LiteralString

from psycopg.rows import DictRow
from psycopg.types.json import Jsonb

from helix_locks.server import queries
from helix_locks.server.db import Database
from helix_locks.server.errors import (
    EmptyResult,
    LockError,
    QuotaExceeded,
    SessionEnded,
    SessionNotFound,
    ShareEnded,
)
from helix_locks.server.keys import Caller
from helix_locks.server.locks import LiveLockQuota, Lock, Place, Wanted, utc, wanted_columns

SessionState = Literal["held", "expired", "ended"]


@dataclass(frozen=True)
class Session:
    """A session and its unreleased locks (in job type order), as the database reported them."""

    id: int
    organization_id: str
    holder: str
    expires_at: datetime
    ttl_remaining_ms: int
    state: SessionState
    locks: list[Lock]
    token: str  # shown only to whoever opened it
    lapsed: bool  # a renewal found its lease run out (nobody having reclaimed a lock of it)
    replayed: bool  # an Idempotency-Key repeat answered with the open session
    # No lease of it (nor of its locks) runs past it (max_hold_seconds, migration 0033); None: none.
    hold_limit_at: datetime | None = None

    @property
    def limited(self) -> bool:
        """Whether its lease ends at its hold limit: no renewal takes it further."""
        return self.hold_limit_at is not None and self.expires_at >= self.hold_limit_at

    @classmethod
    def from_rows(cls, rows: list[DictRow]) -> Session:
        """From helix_session_answer's rows (one per lock, each carrying the session): an empty set
        is an error, never a session."""
        if not rows:
            raise EmptyResult("helix_session_answer")
        first = rows[0]
        # A row's session_id is the session's and its lock's alike.
        locks = [Lock.from_row(row) for row in rows if row["id"] is not None]
        return cls(
            id=first["session_id"],
            organization_id=first["session_organization_id"],
            holder=first["session_holder"],
            expires_at=utc(first["session_expires_at"]),
            ttl_remaining_ms=first["session_ttl_remaining_ms"],
            state=first["session_state"],
            locks=locks,
            token=first["session_token"],
            lapsed=first["lapsed"],
            replayed=first["replayed"],
            hold_limit_at=utc(first["hold_limit_at"]),
        )


class Sessions:
    """The session operations of one service process."""

    def __init__(self, db: Database, quota: LiveLockQuota, sessions_limit: int, locks_limit: int) -> None:
        self.db = db
        self.quota = quota
        self.sessions_limit = sessions_limit
        self.locks_limit = locks_limit

    def _wanted(self, locks: Wanted) -> dict[str, Any]:
        return {
            **wanted_columns(locks),
            "quota": self.quota.limit,
            "locks_limit": self.locks_limit,
        }

    async def _granting(
        self, organization_id: str, statement: LiteralString, params: dict[str, Any]
    ) -> list[DictRow]:
        """A statement that grants a session's locks: far from the quota on a share of its room,
        as acquires go (locks.LiveLockQuota), else the exact way; the rows it answers."""
        count = len(params["job_types"])
        share = await self.quota.admit_many(organization_id, count) if count else None
        try:
            if share is not None:
                try:
                    return await self.db.fetch_all(statement, {**params, "share": share})
                except ShareEnded:
                    self.quota.ended(organization_id, share, again=False)
                except LockError:
                    for _ in range(count):
                        self.quota.unused(organization_id, share)
                    raise
            return await self.db.fetch_all(statement, {**params, "share": None})
        except QuotaExceeded:
            self.quota.refused(organization_id)
            raise

    async def open(
        self,
        caller: Caller,
        organization_id: str,
        holder: str,
        ttl_ms: int,
        metadata: dict[str, Any] | None,
        idempotency_key: str | None,
        locks: Wanted,
        place: Place | None = None,
        max_hold_ms: int | None = None,
    ) -> Session:
        """Open a session with its locks, all granted or none (LockHeld, WaitersAhead,
        MaxHoldersMismatch naming the first pair in job type order that cannot be granted,
        QuotaExceeded, TooManySessions). `place`: a waiting opening's places in the pairs' queues,
        which the grant consumes."""
        caller.may_act_in(organization_id)
        params = {
            "organization_id": organization_id,
            "holder": holder,
            "ttl_ms": ttl_ms,
            "metadata": None if metadata is None else Jsonb(metadata),
            "idempotency_key": idempotency_key,
            "sessions_limit": self.sessions_limit,
            "place": None if place is None else place.id,
            "max_hold_ms": max_hold_ms,
            **self._wanted(locks),
        }
        opened = Session.from_rows(await self._granting(organization_id, queries.OPEN_SESSION, params))
        if place is not None:
            place.granted = True
        return opened

    async def add(
        self,
        caller: Caller,
        session_id: int,
        token: str,
        organization_id: str,
        locks: Wanted,
        idempotency_key: str | None = None,
        place: Place | None = None,
    ) -> Session:
        """Grant more locks to the open session of `organization_id`, all or none; the answer
        lists those added (a repeat of `idempotency_key`: those its first call added, replayed).
        SessionEnded (lost) when it had lost a lock: it has ended."""
        params = {
            "session_id": session_id,
            "token": token,
            "scope": caller.scope,
            "idempotency_key": idempotency_key,
            "place": None if place is None else place.id,
            **self._wanted(locks),
        }
        rows = await self._granting(organization_id, queries.ADD_SESSION_LOCKS, params)
        if place is not None:
            place.granted = True
        return self._unless_lost(session_id, rows)

    async def renew(self, caller: Caller, session_id: int, token: str, ttl_ms: int) -> Session:
        """A new lease for the session and all its locks. SessionEnded (lost) when a lock of it was
        reclaimed or forced: the rest are released, and the session has ended."""
        params = {
            "session_id": session_id,
            "token": token,
            "ttl_ms": ttl_ms,
            "scope": caller.scope,
            "sessions_limit": self.sessions_limit,
        }
        return self._unless_lost(session_id, await self.db.fetch_all(queries.RENEW_SESSION, params))

    def _unless_lost(self, session_id: int, rows: list[DictRow]) -> Session:
        """The session answered, or SessionEnded when the call found it had lost a lock and ended it."""
        session = Session.from_rows(rows)
        if session.state == "ended":
            self.quota.released(session.organization_id)
            first = rows[0]
            raise SessionEnded(session_id, first["session_end_reason"], utc(first["session_ended_at"]))
        return session

    async def close(self, caller: Caller, session_id: int, token: str) -> None:
        """End the session and release its locks. SessionEnded (lost) when it had lost a lock."""
        params = {"session_id": session_id, "token": token, "scope": caller.scope}
        row = await self.db.fetch_first(queries.CLOSE_SESSION, params)
        self.quota.released(row["organization_id"])
        if row["end_reason"] != "released":
            raise SessionEnded(session_id, row["end_reason"], utc(row["ended_at"]))

    async def get(self, caller: Caller, session_id: int) -> Session:
        rows = await self.db.fetch_all(queries.GET_SESSION, {"session_id": session_id, "scope": caller.scope})
        if not rows:
            raise SessionNotFound()
        return Session.from_rows(rows)
