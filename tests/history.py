"""A checker for lock histories: from the database's own rows and what clients were told.

The guarantees it checks, per (organization_id, job_type):
- fencing tokens are unique and strictly increase in the order grants were made;
- no grant began (database time) before its predecessor ended, and a reclaim happened only after
  the reclaimed lease ran out;
- no renewal of a lock succeeded after that lock had ended, and none was lost: the database keeps
  at least the latest expiry a renewal announced (renewals in a run never shorten a lease), and a
  reclaim came only after that expiry;
- every grant a client was told about exists in the database, as told;
- every release a client was told about (204) is in the database as released;
- a lock a client was told it holds ends only by that client's release, by force, or by a reclaim
  after its lease ran out: never released by the service on its own (given the release attempts).
An answer that never came is unknown, as Jepsen has it: it may or may not have taken effect, so
the database may hold grants no client was told about (left to expire) but never fewer.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import psycopg


@dataclass(frozen=True)
class Grant:
    """A lock row as the database holds it after the run."""

    lock_id: int
    key: tuple[str, str]
    fencing_token: int
    acquired_at: datetime
    expires_at: datetime
    released_at: datetime | None
    release_reason: str | None


@dataclass(frozen=True)
class Told:
    """A 201 a client received: the grant as the service reported it."""

    lock_id: int
    key: tuple[str, str]
    fencing_token: int
    acquired_at: datetime


@dataclass(frozen=True)
class Renewed:
    """A 200 answer to a renewal: when it was made (database time) and the expiry it announced."""

    lock_id: int
    renewed_at: datetime
    expires_at: datetime


def database_history(db_url: str) -> list[Grant]:
    """Every grant the database holds, as the checker reads it."""
    with psycopg.connect(db_url) as conn:
        conn.execute("SET DateStyle = ISO")  # psycopg reads no other, whatever the database's default
        rows = conn.execute(
            "SELECT id, organization_id, job_type, fencing_token, acquired_at, expires_at,"
            " released_at, release_reason FROM helix_job_locks"
        ).fetchall()
    return [Grant(r[0], (r[1], r[2]), r[3], r[4], r[5], r[6], r[7]) for r in rows]


def check(
    grants: list[Grant],
    told: list[Told],
    renewed: list[Renewed],
    released: Sequence[int] = (),
    release_attempts: Sequence[int] | None = None,
) -> list[str]:
    """Every violation found; an empty list means the history is linearizable as a lock.

    `release_attempts` are the locks whose holders sent a release, answered or not; given, a told
    lock that ended "released" without one is a violation."""
    violations: list[str] = []
    promised: dict[int, datetime] = {}  # the latest expiry a renewal announced, per lock
    for renewal in renewed:
        promised[renewal.lock_id] = max(renewal.expires_at, promised.get(renewal.lock_id, renewal.expires_at))
    by_key: dict[tuple[str, str], list[Grant]] = defaultdict(list)
    for grant in grants:
        by_key[grant.key].append(grant)
    for key, history in by_key.items():
        history.sort(key=lambda g: g.fencing_token)
        for before, after in itertools.pairwise(history):
            where = f"{key}: lock {before.lock_id} (token {before.fencing_token}) then {after.lock_id}"
            if after.fencing_token == before.fencing_token:
                violations.append(f"{where}: fencing token {after.fencing_token} granted twice")
            if after.acquired_at <= before.acquired_at:
                violations.append(f"{where}: fencing tokens do not follow grant order")
            if before.released_at is None:
                violations.append(f"{where}: granted while its predecessor was never released")
            elif after.acquired_at < before.released_at:
                violations.append(f"{where}: overlap, granted {before.released_at - after.acquired_at} early")
            lease_end = max(before.expires_at, promised.get(before.lock_id, before.expires_at))
            if before.release_reason == "reclaimed" and after.acquired_at < lease_end:
                violations.append(f"{where}: reclaimed before its lease expired")
    kept_until = {grant.lock_id: grant.expires_at for grant in grants}
    for lock_id, expiry in promised.items():
        if lock_id in kept_until and kept_until[lock_id] < expiry:
            kept_expiry = kept_until[lock_id]
            violations.append(
                f"lock {lock_id}: a renewal announced expiry {expiry}, the database kept {kept_expiry}"
            )
    ended = {grant.lock_id: grant.released_at for grant in grants}
    for renewal in renewed:
        end = ended.get(renewal.lock_id)
        if end is not None and renewal.renewed_at >= end:
            violations.append(
                f"lock {renewal.lock_id}: renewed at {renewal.renewed_at}, after it ended at {end}"
            )
    stored = {grant.lock_id: grant for grant in grants}
    for answer in told:
        kept = stored.get(answer.lock_id)
        if kept is None:
            violations.append(f"lock {answer.lock_id}: a client was granted it but the database lost it")
        elif (kept.key, kept.fencing_token, kept.acquired_at) != (
            answer.key,
            answer.fencing_token,
            answer.acquired_at,
        ):
            violations.append(f"lock {answer.lock_id}: the client was told {answer}, the database has {kept}")
    if release_attempts is not None:
        attempted = set(release_attempts)
        for answer in told:
            kept = stored.get(answer.lock_id)
            if kept is not None and kept.release_reason == "released" and answer.lock_id not in attempted:
                violations.append(
                    f"lock {answer.lock_id}: released while its holder, told it held the lock,"
                    " never released it"
                )
    for lock_id in released:
        reason = (stored[lock_id].release_reason or "not released") if lock_id in stored else "lost"
        if reason != "released":
            violations.append(
                f"lock {lock_id}: a client was told it was released, the database says {reason}"
            )
    return violations
