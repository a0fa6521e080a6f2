"""A checker for lock histories: from the database's own rows and what clients were told.

The guarantees it checks, per (organization_id, job_type):
- fencing tokens are unique and strictly increase in the order grants were made, across all the
  slots of a semaphore;
- within one slot, no grant began (database time) before its predecessor in that slot ended, and
  a reclaim happened only after the reclaimed lease ran out;
- for a semaphore (a pair with a grant of max_holders above 1, or outside slot 0; issue 21): at
  no database instant more live grants than max_holders, the live grants all of one max_holders,
  each in a slot below it, and each reclaim at the moment of a grant, after the reclaimed lease
  ran out (also when that grant took another slot: starting a pair afresh with another
  max_holders reclaims every expired lock of it). A grant is live from its acquired_at until its
  released_at, which for a reclaimed lock is the reclaiming grant's acquired_at; both the
  database's own times. With max_holders 1 throughout (every grant in slot 0) these add nothing
  to the checks above, and the checker reports exactly what it reported before semaphores;
- shared locks (issue 40): at no database instant a shared and an exclusive grant live at once,
  at most 1000 shared grants live, each with max_holders 1 and a slot below 1000 (a pair with a
  shared grant is checked as a semaphore is, its readers' room 1000);
- hold limits and closed pairs (issue 41): no lease of a lock ran past its hold_limit_at, as the
  database kept it or as a renewal announced it; no grant of a pair began before the closed_until
  of an earlier grant of it (hold_at_least_seconds), whatever became of that grant; after a
  grant whose revocation request named a preferred holder, the pair's next grant before the
  request's deadline is that holder's;
- no renewal of a lock succeeded after that lock had ended, and none was lost: the database keeps
  at least the latest expiry a renewal announced (renewals in a run never shorten a lease), and a
  reclaim came only after that expiry;
- every grant a client was told about exists in the database, as told (its slot too, if told);
- every release a client was told about (204) is in the database as released;
- a lock a client was told it holds ends only by that client's release, by force, or by a reclaim
  after its lease ran out: never released by the service on its own (given the release attempts);
- sessions (check_sessions): the locks a session's opening granted are exactly the set it asked
  for, all granted by one statement (one transaction), and a refused opening made no session:
  nobody holds a subset of a set it asked for at once;
- the fair queue (check_queue, from the places recorded by record_places): no grant of a plain
  pair (max_holders 1) while a place before the grant's own (any place, for a grant that took
  none) was in the pair's queue, its wait not over: first come, first served; of a shared grant,
  such a place of an exclusive acquire (writers first: readers may be granted together past
  each other's places, never past a writer's).
An answer that never came is unknown, as Jepsen has it: it may or may not have taken effect, so
the database may hold grants no client was told about (left to expire) but never fewer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

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
    max_holders: int = 1
    slot: int = 0
    session_id: int | None = None
    acquired_xid: int | None = None  # the granting transaction
    shared: bool = False  # its mode: a reader's lock (issue 40), else exclusive
    hold_limit_at: datetime | None = None  # no lease past it (max_hold_seconds, issue 41)
    closed_until: datetime | None = None  # no other grant of the pair before it (hold_at_least_seconds)
    holder: str | None = None
    # A revocation request that named a preferred holder: (that holder, the request's deadline).
    reserved_for: tuple[str, datetime] | None = None


# How many shared locks a pair may hold at once.
READERS_ROOM = 1000


def _room(grant: Grant) -> int:
    return READERS_ROOM if grant.shared else grant.max_holders


@dataclass(frozen=True)
class Told:
    """A 201 a client received: the grant as the service reported it (its slot, when recorded)."""

    lock_id: int
    key: tuple[str, str]
    fencing_token: int
    acquired_at: datetime
    slot: int | None = None


@dataclass(frozen=True)
class Renewed:
    """A 200 answer to a renewal: when it was made (database time) and the expiry it announced."""

    lock_id: int
    renewed_at: datetime
    expires_at: datetime


def database_history(db_url: str) -> list[Grant]:
    """Every grant the database holds, as the checker reads it."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("SET DateStyle = ISO")  # psycopg reads no other, whatever the database's default
        # Nor the timeouts a DBA may set on the database (tests/system/test_postgres.py sets 20 ms):
        # the checker's read must not fail on a slow day.
        conn.execute(
            "SELECT set_config(s.name, '0', false) FROM pg_catalog.pg_settings AS s WHERE s.name IN ("
            "'statement_timeout', 'lock_timeout', 'transaction_timeout',"
            " 'idle_in_transaction_session_timeout')"
        )
        rows = conn.execute(
            "SELECT h.id, h.organization_id, h.job_type, h.fencing_token, h.acquired_at, v.expires_at,"
            " NULL::timestamptz, NULL::text, h.max_holders, h.slot, h.session_id,"
            " h.acquired_xid::text::bigint, h.shared, h.hold_limit_at, h.closed_until, h.holder,"
            " h.revocation ->> 'preferred_holder', (h.revocation ->> 'deadline')::timestamptz"
            " FROM helix_holds AS h JOIN helix_held_locks AS v ON v.id = h.id"
            " UNION ALL SELECT id, organization_id, job_type, fencing_token, acquired_at, expires_at,"
            " released_at, release_reason, max_holders, slot, session_id, acquired_xid::text::bigint,"
            " shared, hold_limit_at, closed_until, holder, revocation ->> 'preferred_holder',"
            " (revocation ->> 'deadline')::timestamptz FROM helix_lock_history"
        ).fetchall()
    return [
        replace(Grant(r[0], (r[1], r[2]), *r[3:16]), reserved_for=None if r[16] is None else (r[16], r[17]))
        for r in rows
    ]


@dataclass(frozen=True)
class AskedSet:
    """A session's opening a client sent: its Idempotency-Key (as the service stores it, scoped
    to the API key), the set of job types, and the status answered (None: no answer came)."""

    idempotency_key: str
    organization_id: str
    job_types: frozenset[str]
    status: int | None


def session_openings(db_url: str) -> dict[str, int]:
    """The sessions the database holds, by the Idempotency-Key each was opened with: their ids."""
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            "SELECT idempotency_key, id FROM helix_sessions WHERE idempotency_key IS NOT NULL"
        ).fetchall()
    return {str(key): int(session_id) for key, session_id in rows}


def check_sessions(grants: list[Grant], asked: list[AskedSet], openings: dict[str, int]) -> list[str]:
    """Every violation of a session's all-or-none: an opening answered 201 made a session whose
    first grants (one transaction) are exactly the set asked for; one answered otherwise made no
    session; one never answered made either."""
    violations = []
    first_grants: dict[int, list[Grant]] = defaultdict(list)
    for grant in grants:
        if grant.session_id is not None:
            first_grants[grant.session_id].append(grant)
    for opened, granted in first_grants.items():
        first_xid = min(grant.acquired_xid or 0 for grant in granted)
        first_grants[opened] = [grant for grant in granted if grant.acquired_xid == first_xid]
    for request in asked:
        session_id = openings.get(request.idempotency_key)
        where = (
            f"opening {request.idempotency_key} of {sorted(request.job_types)} (answered {request.status})"
        )
        if session_id is None:
            if request.status == 201:
                violations.append(f"{where}: the client was told of a session the database does not hold")
            continue
        if request.status not in (201, None):
            violations.append(f"{where}: refused, yet it made session {session_id}")
            continue
        granted = first_grants.get(session_id, [])
        pairs = {grant.key for grant in granted}
        wanted = {(request.organization_id, job_type) for job_type in request.job_types}
        if pairs != wanted or len(granted) != len(wanted):
            violations.append(f"{where}: session {session_id} was granted {sorted(pairs)} by its opening")
    return violations


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
        semaphore = any((grant.max_holders, grant.slot, grant.shared) != (1, 0, False) for grant in history)
        in_slot: dict[int, Grant] = {}  # the latest grant so far, per slot
        closer: Grant | None = None  # of the grants so far, the one that closed the pair the longest
        for n, after in enumerate(history):
            if (
                closer is not None
                and closer.closed_until is not None
                and after.acquired_at < closer.closed_until
            ):
                violations.append(
                    f"{key}: lock {after.lock_id} granted at {after.acquired_at}, while lock"
                    f" {closer.lock_id} closed the pair until {closer.closed_until}"
                )
            if after.closed_until is not None and (
                closer is None or closer.closed_until is None or after.closed_until > closer.closed_until
            ):
                closer = after
            if n:
                before = history[n - 1]
                where = f"{key}: lock {before.lock_id} (token {before.fencing_token}) then {after.lock_id}"
                if before.reserved_for is not None:
                    heir, deadline = before.reserved_for
                    if after.acquired_at < deadline and after.holder != heir:
                        violations.append(
                            f"{where}: granted to {after.holder}, reserved for {heir} until {deadline}"
                        )
                if after.fencing_token == before.fencing_token:
                    violations.append(f"{where}: fencing token {after.fencing_token} granted twice")
                if after.acquired_at <= before.acquired_at:
                    violations.append(f"{where}: fencing tokens do not follow grant order")
            before_in_slot = in_slot.get(after.slot)
            in_slot[after.slot] = after
            if before_in_slot is not None:
                violations.extend(_slot_violations(key, before_in_slot, after, promised, semaphore))
        if semaphore:
            violations.extend(_semaphore_violations(key, history, promised))
    for grant in grants:
        if grant.hold_limit_at is not None and _lease_end(grant, promised) > grant.hold_limit_at:
            violations.append(
                f"lock {grant.lock_id}: a lease ran to {_lease_end(grant, promised)},"
                f" past its hold limit {grant.hold_limit_at}"
            )
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
        ) or answer.slot not in (None, kept.slot):
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


def _lease_end(grant: Grant, promised: dict[int, datetime]) -> datetime:
    """When the grant's lease ran out: its expiry, or the latest a renewal announced."""
    return max(grant.expires_at, promised.get(grant.lock_id, grant.expires_at))


def _slot_violations(
    key: tuple[str, str], before: Grant, after: Grant, promised: dict[int, datetime], semaphore: bool
) -> list[str]:
    """One slot held by two grants at once: `after` the next grant in `before`'s slot."""
    slot = f" in slot {after.slot}" if semaphore else ""
    where = f"{key}: lock {before.lock_id} (token {before.fencing_token}) then {after.lock_id}{slot}"
    violations = []
    if before.released_at is None:
        violations.append(f"{where}: granted while its predecessor was never released")
    elif after.acquired_at < before.released_at:
        violations.append(f"{where}: overlap, granted {before.released_at - after.acquired_at} early")
    if before.release_reason == "reclaimed" and after.acquired_at < _lease_end(before, promised):
        violations.append(f"{where}: reclaimed before its lease expired")
    return violations


def _semaphore_violations(
    key: tuple[str, str], history: list[Grant], promised: dict[int, datetime]
) -> list[str]:
    """What only a pair with several slots can break: the count of live grants, their shared
    max_holders and mode, their slots' range, and a reclaim made by a grant in another slot."""
    violations = []
    granted_at = {grant.acquired_at for grant in history}
    next_in_slot: dict[int, Grant] = {}  # per lock, the next grant in its slot
    latest: dict[int, Grant] = {}
    for grant in history:
        if grant.slot in latest:
            next_in_slot[latest[grant.slot].lock_id] = grant
        latest[grant.slot] = grant
    for grant in history:
        if not 0 <= grant.slot < _room(grant) or (grant.shared and grant.max_holders != 1):
            violations.append(
                f"{key}: lock {grant.lock_id} in slot {grant.slot},"
                f" outside its max_holders {grant.max_holders}{' (shared)' if grant.shared else ''}"
            )
        successor = next_in_slot.get(grant.lock_id)
        if grant.release_reason != "reclaimed" or grant.released_at is None:
            continue
        if successor is not None and successor.acquired_at == grant.released_at:
            continue  # reclaimed by the next grant in its slot, checked with the slot
        # Reclaimed by a grant in another slot, as one that starts the pair afresh does.
        lease_end = _lease_end(grant, promised)
        if grant.released_at not in granted_at:
            violations.append(
                f"{key}: lock {grant.lock_id} reclaimed at {grant.released_at}, when no grant was made"
            )
        elif grant.released_at < lease_end:
            violations.append(
                f"{key}: lock {grant.lock_id} reclaimed at {grant.released_at},"
                f" before its lease expired at {lease_end}"
            )
    # The live grants at each instant a grant was made (the only instants their number grows):
    # ends before starts at one instant, since a reclaim ends a lease at its successor's grant.
    moments = [(grant.acquired_at, 1, grant) for grant in history]
    moments += [(grant.released_at, 0, grant) for grant in history if grant.released_at is not None]
    moments.sort(key=lambda moment: (moment[0], moment[1], moment[2].fencing_token))
    live: dict[int, Grant] = {}
    for at, starts, grant in moments:
        if not starts:
            live.pop(grant.lock_id, None)
            continue
        if grant.released_at is not None and grant.released_at <= grant.acquired_at:
            continue  # live for no instant at all
        live[grant.lock_id] = grant
        ids = sorted(live)
        in_force = {other.max_holders for other in live.values()}
        if len(in_force) > 1:
            violations.append(
                f"{key}: lock {grant.lock_id} (max_holders {grant.max_holders}) granted at {at}"
                f" while locks of max_holders {sorted(in_force)} were live: {ids}"
            )
        modes = {other.shared for other in live.values()}
        if len(modes) > 1:
            readers = sorted(other.lock_id for other in live.values() if other.shared)
            writers = sorted(other.lock_id for other in live.values() if not other.shared)
            violations.append(
                f"{key}: at {at} shared locks {readers} and exclusive locks {writers} were live at once"
            )
        room = min(_room(other) for other in live.values())
        if len(live) > room:
            violations.append(
                f"{key}: {len(live)} grants live at once at {at}, more than"
                f" {'the readers room' if modes == {True} else 'max_holders'} {room}: locks {ids}"
            )
    return violations


@dataclass(frozen=True)
class Place:
    """A place in a pair's queue, as record_places saw it: taken (inserted) at taken_at by the
    database's clock, until its wait's end; left (deleted, by its grant or otherwise) at left_at by
    transaction left_xid, or still there (None)."""

    seq: int
    key: tuple[str, str]
    taken_at: datetime
    until: datetime
    left_at: datetime | None = None
    left_xid: int | None = None
    shared: bool = False  # a shared acquire's place


# The audit of the queue a checked run keeps, in its test database only.
RECORD_PLACES = """
CREATE TABLE helix_test_places (
    op text NOT NULL, seq bigint, organization_id text, job_type text, until timestamptz, shared boolean,
    at timestamptz NOT NULL DEFAULT clock_timestamp(), xid bigint NOT NULL DEFAULT txid_current()
);
CREATE FUNCTION helix_test_place_seen() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        INSERT INTO helix_test_places (op, seq, organization_id, job_type, until, shared)
        VALUES ('left', OLD.seq, OLD.organization_id, OLD.job_type, OLD.until, OLD.shared);
    ELSE
        INSERT INTO helix_test_places (op, seq, organization_id, job_type, until, shared)
        VALUES (lower(TG_OP), NEW.seq, NEW.organization_id, NEW.job_type, NEW.until, NEW.shared);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER helix_test_place_seen AFTER INSERT OR UPDATE OR DELETE ON helix_lock_waiters
    FOR EACH ROW EXECUTE FUNCTION helix_test_place_seen();
"""


def record_places(db_url: str) -> None:
    """From now on, every place taken, changed and left in the database is recorded (a test's own
    database: it adds a table and a trigger)."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(RECORD_PLACES)


def database_places(db_url: str) -> list[Place]:
    """The places record_places saw, each with its latest wait's end."""
    with psycopg.connect(db_url) as conn:
        conn.execute("SET DateStyle = ISO")
        rows = conn.execute(
            "SELECT op, seq, organization_id, job_type, until, at, xid, coalesce(shared, false)"
            " FROM helix_test_places WHERE seq IS NOT NULL ORDER BY at, xid"
        ).fetchall()
    places: dict[tuple[int, tuple[str, str]], Place] = {}
    for op, seq, organization_id, job_type, until, at, xid, shared in rows:
        key = (int(seq), (str(organization_id), str(job_type)))
        if op == "insert":
            places[key] = Place(key[0], key[1], at, until, shared=shared)
        elif key in places and op == "update":
            places[key] = Place(key[0], key[1], places[key].taken_at, until, shared=shared)
        elif key in places and op == "left":
            places[key] = Place(key[0], key[1], places[key].taken_at, places[key].until, at, int(xid), shared)
    return list(places.values())


def check_queue(
    grants: Sequence[Grant], places: Sequence[Place], slack: timedelta = timedelta(milliseconds=200)
) -> list[str]:
    """Every grant of a pair of max_holders 1 (plain or shared locks) made while a place before its
    own was waiting (of a shared grant: a place of an exclusive acquire):
    taken more than `slack` before the grant, left (and its wait over) more than `slack` after it.
    A grant's own place is the one its transaction left; a grant that left none had none, and
    every waiting place comes before it. The slack covers the commit of a place after its clock
    was read: it may judge a pass within it fair, never the reverse. Places of a process that died
    count as waiting until they are left or their wait is over: check runs without deaths."""
    violations = []
    by_key: dict[tuple[str, str], list[Place]] = defaultdict(list)
    for place in places:
        by_key[place.key].append(place)
    plain = {g.key for g in grants} - {g.key for g in grants if g.max_holders != 1}
    for grant in grants:
        if grant.key not in plain:
            continue
        queue = by_key.get(grant.key, [])
        own = next((p for p in queue if p.left_xid is not None and p.left_xid == grant.acquired_xid), None)
        at = grant.acquired_at
        for place in queue:
            if place is own or (own is not None and place.seq > own.seq):
                continue
            if grant.shared and place.shared:
                continue  # readers are granted together, past each other's places
            ended = min(place.until, place.left_at or place.until)
            if place.taken_at + slack < at and ended > at + slack:
                violations.append(
                    f"lock {grant.lock_id} of {grant.key} granted at {at.isoformat()}"
                    f" (place {own and own.seq}) passed place {place.seq}, waiting since"
                    f" {place.taken_at.isoformat()} until {ended.isoformat()}"
                )
    return violations
