"""History retention: ended locks older than the window, and locks whose lease ended before it,
are deleted, in small batches."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import timedelta

from helix_locks.server import queries
from helix_locks.server.db import Database
from helix_locks.server.errors import LockError

logger = logging.getLogger("helix_locks")


class Pruner:
    """Deletes lock rows that ended, or whose lease ended, longer than `keep` ago; one replica at a
    time (an advisory lock)."""

    def __init__(self, db: Database, keep: timedelta, batch: int, interval: float) -> None:
        self.db = db
        self.keep = keep
        self.batch = batch
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    async def prune(self) -> int:
        """Delete batches until a short one; returns the rows deleted."""
        total = 0
        while True:
            params = {"older_than": self.keep, "batch": self.batch}
            row = await self.db.fetch_first(queries.PRUNE, params)
            deleted = int(row["deleted"])
            # Sessions that ended, or lapsed, before the window, with no live lock left (0027).
            deleted += int((await self.db.fetch_first(queries.PRUNE_SESSIONS, params))["deleted"])
            total += deleted
            if deleted < self.batch:
                return total
            await asyncio.sleep(0)  # let requests through between batches

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="helix-locks-retention")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            try:
                deleted = await self.prune()
                if deleted:
                    logger.info("retention: deleted %d locks that ended more than %s ago", deleted, self.keep)
            except LockError as exc:  # the database is away: try again next time
                logger.warning("retention: %s", type(exc).__name__)
            except Exception:  # e.g. not migrated yet; retention must outlive it
                logger.exception("retention failed; trying again in %s s", self.interval)
            await asyncio.sleep(self.interval)
