"""One LISTEN connection per service process, turning PostgreSQL notifications into callbacks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import psycopg

from service import queries
from service.db import CONNECTION_KWARGS

logger = logging.getLogger("helix_locks")
# Called with the listening connection (free to run statements on it) and the payloads heard;
# after a (re)connect, with no payloads: anything may have changed meanwhile.
Callback = Callable[[psycopg.AsyncConnection[Any], list[str]], Awaitable[None]]
# How often an idle listener checks that its connection still works.
PING_SECONDS = 5.0
RECONNECT_SECONDS = 1.0


class Listener:
    """Calls a channel's callback on each notification, and every callback after each (re)connect,
    since notifications sent while disconnected are lost; `connected` says whether to trust it."""

    def __init__(self, conninfo: str, channels: Mapping[str, Callback]) -> None:
        self.conninfo = conninfo
        self.channels = dict(channels)
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
            try:
                await self._listen()
            except (psycopg.Error, OSError) as exc:
                if self.connected:
                    logger.warning("notification listener lost its connection: %s", type(exc).__name__)
            finally:
                self.connected = False
            await asyncio.sleep(RECONNECT_SECONDS)

    async def _listen(self) -> None:
        async with await psycopg.AsyncConnection.connect(self.conninfo, **CONNECTION_KWARGS) as conn:
            for channel in self.channels:
                await conn.execute(queries.LISTEN.format(psycopg.sql.Identifier(channel)))
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
                    await self.channels[channel](conn, payloads)
                if not heard:
                    async with asyncio.timeout(PING_SECONDS):  # not wait_for: see Database.fetch_all
                        await conn.execute(queries.PING)
