"""One LISTEN connection per service process, turning PostgreSQL notifications into callbacks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import psycopg

from helix_locks.server import queries
from helix_locks.server.db import CONNECTION_KWARGS, configure_session
from helix_locks.server.errors import LockError

logger = logging.getLogger("helix_locks")
# Called with the listening connection (free to run statements on it) and the payloads heard;
# after a (re)connect, with no payloads: anything may have changed meanwhile.
Callback = Callable[[psycopg.AsyncConnection[Any], list[str]], Awaitable[None]]
# How often an idle listener checks that its connection still works.
PING_SECONDS = 5.0
RECONNECT_SECONDS = 1.0
# How long the self-test waits for its own notification; after a failed one, how long until the next.
PROBE_SECONDS = 3.0
PROBE_RETRY_SECONDS = 30.0
# Sends a notification on queries.PROBE_CHANNEL with this payload, the way the lock functions do.
Probe = Callable[[str], Awaitable[None]]
NOT_HEARD = (
    "notifications sent through the database URL do not reach the listening connection: it goes "
    "through a transaction pooler. Set HELIX_LOCKS_DIRECT_DATABASE_URL to a direct, "
    "session-capable connection to the same database"
)


class NotHeard(Exception):
    """The self-test's notification did not arrive: LISTEN goes through a transaction pooler."""


async def self_test(conn: psycopg.AsyncConnection[Any], probe: Probe) -> None:
    """Send a notification through `probe` and hear it on `conn`, already listening on
    queries.PROBE_CHANNEL; NotHeard if it does not arrive within PROBE_SECONDS."""
    payload = secrets.token_hex(8)
    await probe(payload)
    async for notify in conn.notifies(timeout=PROBE_SECONDS):
        if notify.channel == queries.PROBE_CHANNEL and notify.payload == payload:
            return
    raise NotHeard(NOT_HEARD)


async def check_notifications(listen_url: str, send_url: str) -> None:
    """The self-test on connections of its own: NotHeard if a notification sent through
    send_url (the database URL) does not reach a connection listening on listen_url."""
    connect = psycopg.AsyncConnection.connect
    async with (
        await connect(listen_url, **CONNECTION_KWARGS) as listening,
        await connect(send_url, **CONNECTION_KWARGS, prepare_threshold=None) as sending,
    ):
        await listening.execute(queries.LISTEN.format(psycopg.sql.Identifier(queries.PROBE_CHANNEL)))

        async def probe(payload: str) -> None:
            await sending.execute(queries.PROBE, {"payload": payload})

        await self_test(listening, probe)


class Listener:
    """Calls a channel's callback on each notification, and every callback after each (re)connect,
    since notifications sent while disconnected are lost; `connected` says whether to trust it.
    Its connection carries `application_name`: while it is open, the database counts the places
    this process holds in the pairs' queues as live (migration 0029)."""

    def __init__(
        self,
        conninfo: str,
        channels: Mapping[str, Callback],
        probe: Probe,
        statement_timeout_ms: int,
        application_name: str = CONNECTION_KWARGS["application_name"],
    ) -> None:
        self.conninfo = conninfo
        self.application_name = application_name
        self.channels = dict(channels)
        self.probe = probe
        self.statement_timeout_ms = statement_timeout_ms
        self.connected = False
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="helix-locks-listener")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            pause = RECONNECT_SECONDS
            try:
                await self._listen()
            except NotHeard as exc:
                # Unsafe to trust: keys are checked against the database, and waiters wake by
                # their timers, until a connection passes the test.
                logger.error("%s; checking again in %.0f s", exc, PROBE_RETRY_SECONDS)
                pause = PROBE_RETRY_SECONDS
            except (psycopg.Error, OSError, LockError) as exc:
                if self.connected:
                    logger.warning("notification listener lost its connection: %s", type(exc).__name__)
            finally:
                self.connected = False
            await asyncio.sleep(pause)

    async def _listen(self) -> None:
        kwargs = {**CONNECTION_KWARGS, "application_name": self.application_name}
        async with await psycopg.AsyncConnection.connect(self.conninfo, **kwargs) as conn:
            await configure_session(conn, self.statement_timeout_ms)
            await conn.execute(queries.LISTENER_KEEPALIVES)
            for channel in (*self.channels, queries.PROBE_CHANNEL):
                await conn.execute(queries.LISTEN.format(psycopg.sql.Identifier(channel)))
            await self_test(conn, self.probe)
            for callback in self.channels.values():
                await callback(conn, [])
            self.connected = True
            while True:
                # Callbacks run after the generator ends: it holds the connection's lock, and a
                # callback may want to run a statement on the same connection.
                heard: dict[str, list[str]] = {}
                async for notify in conn.notifies(timeout=PING_SECONDS, stop_after=1):
                    heard.setdefault(notify.channel, []).append(notify.payload)
                for channel, payloads in heard.items():
                    if channel in self.channels:  # not a late probe
                        await self.channels[channel](conn, payloads)
                if not heard:
                    async with asyncio.timeout(PING_SECONDS):  # not wait_for: see Database.fetch_all
                        await conn.execute(queries.PING)
