"""The connection pool, and the one place where PostgreSQL errors become domain errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any, LiteralString

import psycopg
from psycopg.rows import DictRow, dict_row
from psycopg_pool import AsyncConnectionPool

from helix_locks.server import queries
from helix_locks.server.errors import (
    ClosedUntil,
    DatabaseUnavailable,
    EmptyResult,
    Holder,
    HoldLimitReached,
    InvalidArgument,
    LockEnded,
    LockError,
    LockHeld,
    LockNotFound,
    MaxHoldersMismatch,
    QuotaExceeded,
    RenewTheSession,
    Reserved,
    SessionEnded,
    SessionFull,
    SessionLapsed,
    SessionNotFound,
    ShareEnded,
    TokenMismatch,
    TooManySessions,
    WaitersAhead,
)
from helix_locks.server.settings import Settings

Pool = AsyncConnectionPool[psycopg.AsyncConnection[DictRow]]


def _detail(exc: psycopg.Error) -> dict[str, Any]:
    """The JSON our functions put in DETAIL; {} for anything else (e.g. the index itself)."""
    try:
        detail = json.loads(exc.diag.message_detail or "")
    except ValueError:
        return {}
    return detail if isinstance(detail, dict) else {}


def _time(value: Any) -> datetime | None:
    return datetime.fromisoformat(value) if isinstance(value, str) else None


def _lock_held(exc: psycopg.Error) -> LockError:
    """A full pair, or (migration 0017) held locks of another max_holders, or (0029) places of the
    pair's queue before the acquire."""
    detail = _detail(exc)
    if detail.get("max_holders_in_force") is not None:
        return MaxHoldersMismatch(int(detail["max_holders_in_force"]), detail.get("job_type"))
    if detail.get("waiting") is not None:  # the pair's queue is in the way (0029)
        return WaitersAhead(
            detail.get("lock_id"),  # of a held pair: the lease that ends first
            detail.get("holder"),
            _time(detail.get("expires_at")),
            int(detail.get("retry_after_seconds", 1)),
            job_type=detail.get("job_type"),
            waiting=int(detail["waiting"]),
            ahead=int(detail.get("ahead") or 0),
            mode=detail.get("mode"),  # of a held pair (0032)
        )
    holders = [
        Holder(h["lock_id"], h["holder"], h["slot"], datetime.fromisoformat(h["expires_at"]))
        for h in detail.get("holders") or ()
    ]
    return LockHeld(
        lock_id=detail.get("lock_id"),
        holder=detail.get("holder"),
        expires_at=_time(detail.get("expires_at")),
        retry_after_seconds=int(detail.get("retry_after_seconds", 1)),
        holders=holders,
        max_holders=int(detail.get("max_holders") or 1),
        # Listed only in part since 0021; before it, every holder was listed.
        holders_total=int(detail.get("holders_total") or len(holders)),
        job_type=detail.get("job_type"),
        mode=detail.get("mode"),
    )


def _lock_ended(exc: psycopg.Error) -> LockError:
    detail = _detail(exc)
    released_at = _time(detail.get("released_at"))
    assert released_at is not None, "HL003 always carries released_at"
    return LockEnded(
        detail["lock_id"],
        detail["release_reason"],
        released_at,
        detail.get("forced_by"),
        detail.get("organization_id"),
        detail.get("job_type"),
    )


def _session_ended(exc: psycopg.Error) -> LockError:
    detail = _detail(exc)
    ended_at = _time(detail.get("ended_at"))
    assert ended_at is not None, "HL007 always carries ended_at"
    return SessionEnded(detail["session_id"], detail["end_reason"], ended_at)


def _session_lapsed(exc: psycopg.Error) -> LockError:
    expires_at = _time(_detail(exc).get("expires_at"))
    assert expires_at is not None, "HL010 always carries expires_at"
    return SessionLapsed(expires_at)


def _hold_limit_reached(exc: psycopg.Error) -> LockError:
    hold_limit_at = _time(_detail(exc).get("hold_limit_at"))
    assert hold_limit_at is not None, "HL012 always carries hold_limit_at"
    return HoldLimitReached(hold_limit_at)


def _closed_until(exc: psycopg.Error) -> LockError:
    detail = _detail(exc)
    return ClosedUntil(
        lock_id=None,
        holder=None,
        expires_at=None,
        retry_after_seconds=int(detail.get("retry_after_seconds", 1)),
        job_type=detail.get("job_type"),
        closed_until=_time(detail.get("closed_until")),
        closed_ms=int(detail.get("closed_ms") or 0),
    )


def _reserved(exc: psycopg.Error) -> LockError:
    detail = _detail(exc)
    return Reserved(
        lock_id=None,
        holder=None,
        expires_at=None,
        retry_after_seconds=int(detail.get("retry_after_seconds", 1)),
        job_type=detail.get("job_type"),
        preferred_holder=detail.get("preferred_holder"),
        deadline=_time(detail.get("deadline")),
        reserved_ms=int(detail.get("reserved_ms") or 0),
    )


def _token_mismatch(exc: psycopg.Error) -> LockError:
    detail = _detail(exc)
    return TokenMismatch(detail.get("organization_id"), detail.get("job_type"))


def _invalid(exc: psycopg.Error) -> LockError:
    return InvalidArgument(exc.diag.column_name or "body", exc.diag.message_primary or "invalid")


POOLER_WITHOUT_DIRECT_URL = (
    "a prepared statement was lost: DATABASE_URL goes through a transaction pooler, so set "
    "HELIX_LOCKS_DIRECT_DATABASE_URL to a direct connection"
)

# SQLSTATE -> domain error. The codes are raised by the functions in migrations/.
SQLSTATES: Mapping[str, Callable[[psycopg.Error], LockError]] = {
    "23505": _lock_held,
    "22023": _invalid,  # a value out of range, its COLUMN the field: ttl, max_holders, metadata (0021)
    "22P02": _invalid,  # a value PostgreSQL cannot read as its type (an event id's snapshot)
    "HL001": lambda exc: LockNotFound(),
    "HL002": _token_mismatch,
    "HL003": _lock_ended,
    "HL004": lambda exc: QuotaExceeded(int(exc.diag.message_detail or 0)),
    "HL005": lambda exc: ShareEnded(),
    # Sessions (migration 0027).
    "HL006": lambda exc: RenewTheSession(int(_detail(exc)["session_id"])),
    "HL007": _session_ended,
    "HL008": lambda exc: SessionFull(int(exc.diag.message_detail or 0)),
    "HL009": lambda exc: TooManySessions(int(exc.diag.message_detail or 0)),
    "HL010": _session_lapsed,
    "HL011": lambda exc: SessionNotFound(),
    # Hold limits (migration 0033).
    "HL012": _hold_limit_reached,
    # A closed pair (migration 0034).
    "HL013": _closed_until,
    # A pair reserved for a revocation's preferred holder (0035).
    "HL014": _reserved,
    # A primary that just became a standby (failover): it will not take writes, try again.
    "25006": lambda exc: DatabaseUnavailable("read-only transaction"),
    # Prepared statements lost or doubled: DATABASE_URL goes through a transaction pooler, but no
    # direct URL says so (`serve` refuses to start so; an app built otherwise answers 503).
    "26000": lambda exc: DatabaseUnavailable(POOLER_WITHOUT_DIRECT_URL),
    "42P05": lambda exc: DatabaseUnavailable(POOLER_WITHOUT_DIRECT_URL),
}


@asynccontextmanager
async def translated() -> AsyncIterator[None]:
    """Re-raise PostgreSQL errors as domain errors, chained to the original."""
    try:
        yield
    except psycopg.Error as exc:
        make = SQLSTATES.get(exc.sqlstate or "")
        if make is not None:
            raise make(exc) from exc
        if isinstance(exc, psycopg.OperationalError):
            # Connection lost, pool wait over, statement_timeout, shutdown. (psycopg also files
            # unknown SQLSTATE classes such as our HL here, hence the table first.)
            raise DatabaseUnavailable(type(exc).__name__) from exc
        raise


def _too_late(answer: asyncio.Future[Any]) -> None:
    """The deadline passed without an answer: the caller hears 503, the statement runs on."""
    if not answer.done():
        answer.set_exception(DatabaseUnavailable("no answer before the deadline"))


# How every connection of a service process is made (the pool's and the listener's).
CONNECTION_KWARGS: dict[str, Any] = {
    "autocommit": True,
    "application_name": "helix-locks",
    # Text is UTF-8 even in a SQL_ASCII database, where psycopg would otherwise give bytes.
    "client_encoding": "utf8",
    # A server that stops answering (host gone, network cut) must not hold a connection
    # forever: give up on connecting, and on unacknowledged data, within seconds.
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 2,
    "tcp_user_timeout": 10_000,
}


RECONNECT_GIVE_UP_SECONDS = 5.0


async def configure_session(conn: psycopg.AsyncConnection[Any], statement_timeout_ms: int) -> None:
    """Apply what the lock functions rely on to a direct connection (queries.CONFIGURE_SESSION)."""
    await conn.execute(queries.CONFIGURE_SESSION, {"statement_timeout_ms": str(statement_timeout_ms)})


def create_pool(settings: Settings) -> Pool:
    """A closed pool; the app's lifespan opens it.

    Direct (no direct_database_url): statements are prepared, and the session is configured once
    per connection. Through a transaction pooler: nothing is prepared, and the session gets only
    what the pooler keeps per client (DateStyle, TimeZone), since the next transaction may run on
    another server connection; Database sends the other settings with every statement.
    """

    async def configure(conn: psycopg.AsyncConnection[DictRow]) -> None:
        await configure_session(conn, settings.statement_timeout_ms)

    async def configure_pooled(conn: psycopg.AsyncConnection[DictRow]) -> None:
        await conn.execute(queries.CONFIGURE_POOLED_SESSION)

    pooled: dict[str, Any] = {"prepare_threshold": None, "cursor_factory": psycopg.AsyncClientCursor}
    return Pool(
        settings.database_url,
        min_size=settings.pool_min_size,
        max_size=settings.pool_max_size,
        timeout=settings.pool_timeout_seconds,
        open=False,
        name="helix-locks",
        # A connection attempt that keeps failing backs off exponentially (1, 2, 4, 8... s), so
        # after a long outage the pool could take half a minute to notice the database is back.
        # Give up on an attempt after a few seconds instead: the next request that finds the
        # pool empty starts a fresh one at once.
        reconnect_timeout=RECONNECT_GIVE_UP_SECONDS,
        configure=configure_pooled if settings.through_pooler else configure,
        kwargs={
            **CONNECTION_KWARGS,
            "row_factory": dict_row,
            # Prepare every statement on first use: one round trip per request after that.
            **(pooled if settings.through_pooler else {"prepare_threshold": 0}),
        },
    )


class Database:
    """Runs one statement on a pooled connection, with errors translated and a deadline."""

    def __init__(self, pool: Pool, settings: Settings) -> None:
        self.pool = pool
        self.deadline_seconds = settings.query_deadline_seconds
        self.through_pooler = settings.through_pooler
        self._statement_timeout_ms = str(settings.statement_timeout_ms)
        self._statements: set[asyncio.Task[None]] = set()

    async def _fetch_all(self, query: LiteralString, params: Mapping[str, Any]) -> list[DictRow]:
        async with translated():
            # A session the server ended while it sat idle in a pool (a pooler's server
            # connection, under a role's idle_session_timeout) never ran the statement: it is
            # sent again on another connection. Each such session fails at once, and there are
            # no more of them than connections in the pool.
            for _ in range(self.pool.max_size):
                with contextlib.suppress(psycopg.errors.IdleSessionTimeout):
                    return await self._run(query, params)
            return await self._run(query, params)

    async def _run(self, query: LiteralString, params: Mapping[str, Any]) -> list[DictRow]:
        async with self.pool.connection() as conn:
            if not self.through_pooler:
                cursor = await conn.execute(query, params)
                return await cursor.fetchall()
            # One simple query: the transaction's settings, then the statement (its rows last).
            modern = conn.info.server_version >= 170000
            prefix = queries.IN_TRANSACTION_17 if modern else queries.IN_TRANSACTION
            params = {**params, "helix_statement_timeout_ms": self._statement_timeout_ms}
            cursor = await conn.execute(prefix + query, params)
            while cursor.nextset():
                pass
            return await cursor.fetchall()

    async def fetch_all(self, query: LiteralString, params: Mapping[str, Any]) -> list[DictRow]:
        """All rows; DatabaseUnavailable once the deadline passes without an answer.

        statement_timeout stops a slow statement only while the server still answers; the
        deadline also covers a server gone silent. A statement is never interrupted: it is left
        to finish (or to fail, when TCP gives up on a silent server) in the background, also when
        our caller is cancelled. Interrupting psycopg mid-query makes it spend seconds trying to
        cancel the query on a silent server, and a connection taken back mid-query can make the
        pool's close() hang; close() below waits for these statements instead.
        """
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[list[DictRow]] = loop.create_future()
        statement = loop.create_task(self._answer(answer, query, params))
        self._statements.add(statement)
        statement.add_done_callback(self._statements.discard)
        # A timer on the answer itself, not asyncio.timeout around a shield: the same deadline,
        # and the caller woken as the rows arrive, not after the task's end and then the shield's
        # (each a turn of the event loop, which a busy worker pays on every statement:
        # docs/performance.md).
        deadline = loop.call_later(self.deadline_seconds, _too_late, answer)
        try:
            return await answer  # cancelling the caller cancels this future, not the statement
        finally:
            deadline.cancel()

    async def _answer(
        self, answer: asyncio.Future[list[DictRow]], query: LiteralString, params: Mapping[str, Any]
    ) -> None:
        """Run the statement to its end, whether or not anyone still waits, and hand over its rows
        or its error the moment it has them."""
        try:
            rows = await self._fetch_all(query, params)
        except asyncio.CancelledError:  # only when the loop itself is being torn down
            answer.cancel()
            raise
        except Exception as exc:
            if not answer.done():  # else its caller is gone: the error is nobody's to hear
                answer.set_exception(exc)
            return
        if not answer.done():
            answer.set_result(rows)

    async def close(self) -> None:
        """Wait (up to the deadline) for the statements still running, then close the pool."""
        if self._statements:
            await asyncio.wait(set(self._statements), timeout=self.deadline_seconds)
        await self.pool.close()

    async def fetch_optional(self, query: LiteralString, params: Mapping[str, Any]) -> DictRow | None:
        rows = await self.fetch_all(query, params)
        return rows[0] if rows else None

    async def fetch_first(self, query: LiteralString, params: Mapping[str, Any]) -> DictRow:
        """The first row of a function's set; an empty set is an error, never a success."""
        row = await self.fetch_optional(query, params)
        if row is None:
            raise EmptyResult(query.split("(")[0].strip())
        return row
