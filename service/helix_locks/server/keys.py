"""API keys: minting and hashing them, and each process's cache of who holds which key.

A key reads `hlk_<id>_<secret>`: the 12-hex-digit id is public (listed, revoked by), the secret
is 256 random bits. Only SHA-256 of the whole key is stored; a slow hash would add nothing to
secrets that cannot be guessed, and would cost every request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from helix_locks.server import queries
from helix_locks.server.db import Database
from helix_locks.server.errors import Forbidden, Unauthenticated
from helix_locks.server.listener import Listener

PREFIX = "hlk_"
_KEY = re.compile(r"^hlk_([0-9a-f]{12})_[A-Za-z0-9_-]{43}$")
# Last-use times are written in one batch this often, not once per request.
USAGE_FLUSH_SECONDS = 10.0


@dataclass(frozen=True)
class Caller:
    """Who is asking: an organization's key, an admin key (organization None), or anonymous."""

    key_id: str | None
    organization_id: str | None

    @property
    def admin(self) -> bool:
        return self.key_id is not None and self.organization_id is None

    @property
    def scope(self) -> str | None:
        """The one organization this caller may act in; None for every organization."""
        return self.organization_id

    def may_act_in(self, organization_id: str) -> None:
        """Forbidden unless this caller may take locks in the organization."""
        if self.scope not in (None, organization_id):
            raise Forbidden(f"This API key acts only in organization {self.scope}.")


ANONYMOUS = Caller(None, None)


@dataclass(frozen=True)
class StoredKey:
    id: str
    organization_id: str | None
    key_hash: bytes
    revoked: bool


@dataclass(frozen=True)
class KeyInfo:
    """A key as `keys list` shows it: never the key itself."""

    id: str
    organization_id: str | None
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def key_id(key: str) -> str | None:
    match = _KEY.match(key)
    return match.group(1) if match else None


def new_key() -> str:
    """A fresh key, stored nowhere (yet)."""
    return f"{PREFIX}{secrets.token_hex(6)}_{secrets.token_urlsafe(32)}"


def create(conninfo: str, organization_id: str | None) -> str:
    """Store a new key for the organization (None: an admin key) and return it, once."""
    key = new_key()
    store(conninfo, key, organization_id)
    return key


def store(conninfo: str, key: str, organization_id: str | None, *, unless_any: bool = False) -> bool:
    """Store a given, well-formed key; with unless_any, only while no key exists at all (revoked
    ones included). True if it was stored. A key whose id is taken raises UniqueViolation."""
    stored_id = key_id(key)
    if stored_id is None:
        raise ValueError("not a well-formed API key")
    with psycopg.connect(conninfo, autocommit=True) as conn, conn.transaction():
        if unless_any:
            # Two bootstraps at once must not both find the table empty: the second waits here
            # until the first has committed its key.
            conn.execute(queries.LOCK_KEYS)
            row = conn.execute(queries.KEYS_EXIST).fetchone()
            if row and row[0]:
                return False
        conn.execute(
            queries.CREATE_KEY, {"id": stored_id, "organization_id": organization_id, "key_hash": digest(key)}
        )
    return True


def listing(conninfo: str) -> list[KeyInfo]:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        return [KeyInfo(*row) for row in conn.execute(queries.LIST_KEYS).fetchall()]


def revoke(conninfo: str, revoked_id: str) -> bool:
    """Revoke a key by id; False if there is no such key. Every service process hears of it."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        return conn.execute(queries.REVOKE_KEY, {"id": revoked_id}).fetchone() is not None


def any_keys(conninfo: str) -> bool:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        row = conn.execute(queries.KEYS_EXIST).fetchone()
        return bool(row and row[0])


class KeyRing:
    """This process's view of the API keys: all of them in memory, reloaded whenever the table
    changes (the listener calls reload), and read from the database while that is not assured."""

    def __init__(self, db: Database, allow_anonymous: bool) -> None:
        self.db = db
        self.allow_anonymous = allow_anonymous
        self.listener: Listener | None = None  # set by the app; reloads us on every change
        self._keys: dict[str, StoredKey] = {}
        # Keys whose hash matched a row of _keys: a key sent again skips the hash while that row
        # is still the one in _keys (a reload makes new rows). Only keys that matched are kept, so
        # there are no more of them than rows.
        self._verified: dict[str, StoredKey] = {}
        self._used: set[str] = set()
        self._flusher: asyncio.Task[None] | None = None

    @property
    def current(self) -> bool:
        """Whether the cache may be trusted: not while notifications could be missed."""
        return self.listener is not None and self.listener.connected

    async def reload(self, conn: psycopg.AsyncConnection[Any], payloads: list[str]) -> None:
        """Re-read every key, on the listener's own connection (the pool stays for requests)."""
        cursor = await conn.execute(queries.ALL_KEYS)
        self._keys = {row[0]: StoredKey(*row) for row in await cursor.fetchall()}
        self._verified = {}

    async def authenticate(self, authorization: str | None) -> Caller:
        """The caller an Authorization header names; Unauthenticated if it names nobody."""
        if authorization is None:
            if self.allow_anonymous and not await self._any_keys():
                return ANONYMOUS
            raise Unauthenticated("An API key is required: send Authorization: Bearer <key>.")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            raise Unauthenticated("Send the API key as Authorization: Bearer <key>.")
        key = key.strip()
        stored = self._verified.get(key) if self.current else None
        if stored is None or self._keys.get(stored.id) is not stored:  # else: this very row matched before
            stored = await self._find(key_id(key))
            if stored is None or stored.revoked or not hmac.compare_digest(stored.key_hash, digest(key)):
                raise Unauthenticated("The API key is unknown or revoked.")
            if self.current and self._keys.get(stored.id) is stored:
                self._verified[key] = stored
        self._used.add(stored.id)
        return Caller(stored.id, stored.organization_id)

    async def _find(self, wanted: str | None) -> StoredKey | None:
        if wanted is None:
            return None
        if self.current:
            # Authoritative: a new key arrives by NOTIFY within milliseconds of its commit, and
            # made-up keys must not cost a database query each.
            return self._keys.get(wanted)
        row = await self.db.fetch_optional(queries.KEY_BY_ID, {"id": wanted})
        return StoredKey(**row) if row else None

    async def _any_keys(self) -> bool:
        if self.current:
            return bool(self._keys)
        row = await self.db.fetch_first(queries.KEYS_EXIST, {})
        return bool(row["exists"])

    async def start(self) -> None:
        self._flusher = asyncio.create_task(self._flush_usage(), name="helix-locks-key-usage")

    async def stop(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        await self._touch()

    async def _flush_usage(self) -> None:
        while True:
            await asyncio.sleep(USAGE_FLUSH_SECONDS)
            await self._touch()

    async def _touch(self) -> None:
        used, self._used = self._used, set()
        if used:
            with contextlib.suppress(Exception):  # a missed last-use time is not worth a crash
                await self.db.fetch_all(queries.TOUCH_KEYS, {"ids": sorted(used)})
