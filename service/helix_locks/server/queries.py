"""Every SQL statement the service sends, as constants with named parameters.

Schema and functions live in migrations/; these statements only call them or read the tables
and views: helix_holds (live locks) and helix_lock_history (ended ones), and the views over them
(helix_held_locks, helix_ended_locks, helix_job_lock_views, whose state and ttl_remaining_ms come
from the database clock; helix_job_locks, every column of both). Migration 0023 says why two
tables.
Columns are named, never `*`: statements are prepared, and a prepared `SELECT *` fails once a
later migration adds a column ("cached plan must not change result type").
"""

from psycopg import sql

# What the lock functions rely on, whatever the server, database or role sets by default:
# - READ COMMITTED: a FOR UPDATE that waited sees the row as its holder committed it, and the
#   wake-up argument of migration 0008 needs each statement's fresh snapshot (REPEATABLE READ
#   and SERIALIZABLE answer a contended acquire with a serialization failure instead);
# - the service's own statement_timeout, and no lock_timeout, idle_in_transaction_session_timeout,
#   idle_session_timeout or transaction_timeout: waiting on a key's row lock is how contention
#   is ordered, and the statement deadline alone bounds it;
# - times in UTC (the JSON our functions put in DETAIL), written as ISO 8601 (psycopg reads no
#   other DateStyle).
# Per connection, once, on a direct connection; only the settings this server knows.
CONFIGURE_SESSION = """
SELECT set_config(wanted.name, wanted.value, false)
FROM (VALUES
    ('TimeZone', 'UTC'),
    ('DateStyle', 'ISO'),
    ('default_transaction_isolation', 'read committed'),
    ('statement_timeout', %(statement_timeout_ms)s),
    ('lock_timeout', '0'),
    ('idle_in_transaction_session_timeout', '0'),
    ('idle_session_timeout', '0'),
    ('transaction_timeout', '0')
) AS wanted (name, value)
WHERE wanted.name IN (SELECT s.name FROM pg_catalog.pg_settings AS s)
"""

# Through a pooler, per connection: the two settings a pooler keeps for each client whatever
# server connection it lends (PgBouncer tracks DateStyle and TimeZone), since psycopg reads times
# by the DateStyle of the session, not of one transaction.
CONFIGURE_POOLED_SESSION = "SET DateStyle TO 'ISO'; SET TimeZone TO 'UTC'"

# Through a transaction pooler, where session settings do not last: the same settings for one
# transaction, sent before each statement in the same simple query (one round trip; a statement
# that fails rolls the whole transaction back, so nothing is left to clean up). SET TRANSACTION
# must come first, before anything takes a snapshot.
_IN_TRANSACTION = """SET TRANSACTION ISOLATION LEVEL READ COMMITTED;
SELECT set_config('TimeZone', 'UTC', true),
       set_config('statement_timeout', %(helix_statement_timeout_ms)s, true),
       set_config('lock_timeout', '0', true),
       set_config('idle_in_transaction_session_timeout', '0', true)"""
IN_TRANSACTION = _IN_TRANSACTION + ";\n"
# transaction_timeout exists from PostgreSQL 17 on.
IN_TRANSACTION_17 = _IN_TRANSACTION + ",\n       set_config('transaction_timeout', '0', true);\n"

LOCK = """
id, organization_id, job_type, holder, fencing_token, acquired_at, expires_at, released_at,
release_reason, state, ttl_remaining_ms, metadata, max_holders, slot
"""

ACQUIRE = (
    "SELECT "
    + LOCK
    + """, token, reclaimed_lock_id, reclaimed_holder, reclaimed_expired_at
FROM helix_acquire_job_lock(
    %(organization_id)s, %(job_type)s, %(holder)s, %(ttl_ms)s, %(metadata)s, %(idempotency_key)s,
    %(max_holders)s
)
"""
)

# %(scope)s is the caller's organization, or NULL for an admin: another organization's lock is
# not found.
RELEASE = "SELECT " + LOCK + " FROM helix_release_job_lock(%(lock_id)s, %(token)s, %(scope)s)"

# A lock's mode (migration 0030) is not in the views the functions answer: read from the hold, as
# this statement's snapshot shows it, from before the function changed it.
_HOLD_SHARED = "(SELECT h.shared FROM helix_holds AS h WHERE h.id = %(lock_id)s) AS shared"
# A lock's hold limit (migration 0033), the time until which its grant closed its pair (0034) and a
# request that its holder let go (0035), the same way; the first two never change, and no lock
# function but helix_request_revocation changes the last.
_HOLD_BOUNDS = (
    "(SELECT h.hold_limit_at FROM helix_holds AS h WHERE h.id = %(lock_id)s) AS hold_limit_at, "
    "(SELECT h.closed_until FROM helix_holds AS h WHERE h.id = %(lock_id)s) AS closed_until, "
    "(SELECT h.revocation FROM helix_holds AS h WHERE h.id = %(lock_id)s) AS revocation"
)

FORCE_RELEASE = (
    "SELECT "
    + LOCK
    + ", "
    + _HOLD_SHARED
    + ", "
    + _HOLD_BOUNDS
    + " FROM helix_force_release_job_lock(%(lock_id)s, %(key_id)s)"
)

# A waiting acquire's grant whose client left: released unless a replay claimed it (0010).
RELEASE_UNCLAIMED = "SELECT helix_release_unclaimed(%(lock_id)s, %(token)s, %(scope)s) AS released"

RENEW = (
    "SELECT "
    + LOCK
    + ", lapsed, limited, "
    + _HOLD_SHARED
    + ", "
    + _HOLD_BOUNDS
    + " FROM helix_renew_job_lock(%(lock_id)s, %(token)s, %(ttl_ms)s, %(scope)s)"
)

# PATCH: the holder replaces the metadata; the lease is unchanged (migration 0015).
UPDATE = (
    "SELECT "
    + LOCK
    + """, (SELECT h.session_id FROM helix_holds AS h WHERE h.id = %(lock_id)s) AS session_id, """
    + _HOLD_SHARED
    + ", "
    + _HOLD_BOUNDS
    + """
FROM helix_update_job_lock(%(lock_id)s, %(token)s, %(metadata)s, %(scope)s)"""
)

GET = (
    "SELECT "
    + LOCK
    + """, (SELECT k.forced_by FROM helix_lock_history AS k WHERE k.id = %(lock_id)s) AS forced_by,
       coalesce((SELECT h.session_id FROM helix_holds AS h WHERE h.id = %(lock_id)s),
                (SELECT k.session_id FROM helix_lock_history AS k WHERE k.id = %(lock_id)s)) AS session_id,
       coalesce((SELECT h.shared FROM helix_holds AS h WHERE h.id = %(lock_id)s),
                (SELECT k.shared FROM helix_lock_history AS k WHERE k.id = %(lock_id)s)) AS shared,
       coalesce((SELECT h.hold_limit_at FROM helix_holds AS h WHERE h.id = %(lock_id)s),
                (SELECT k.hold_limit_at FROM helix_lock_history AS k WHERE k.id = %(lock_id)s))
           AS hold_limit_at,
       coalesce((SELECT h.closed_until FROM helix_holds AS h WHERE h.id = %(lock_id)s),
                (SELECT k.closed_until FROM helix_lock_history AS k WHERE k.id = %(lock_id)s))
           AS closed_until,
       coalesce((SELECT h.revocation FROM helix_holds AS h WHERE h.id = %(lock_id)s),
                (SELECT k.revocation FROM helix_lock_history AS k WHERE k.id = %(lock_id)s))
           AS revocation
FROM helix_job_lock_views
WHERE id = %(lock_id)s AND (%(scope)s::text IS NULL OR organization_id = %(scope)s)
"""
)

# POST /v1/locks/{id}/revocation (migration 0035): the request recorded (the first one only), and
# the lock as it left it.
REQUEST_REVOCATION = (
    "SELECT "
    + LOCK
    + """, session_id, shared, hold_limit_at, closed_until, revocation
FROM helix_request_revocation(
    %(lock_id)s, %(scope)s, %(reason)s, %(deadline_ms)s, %(by)s, %(preferred_holder)s
)"""
)

# Sessions (migration 0027): each call answers helix_session_answer rows, the session and one of
# its unreleased locks each (one row with NULL lock columns when it has none).
_SESSION = (
    """session_id, session_token, session_organization_id, session_holder, session_expires_at,
session_ttl_remaining_ms, session_state, session_ended_at, session_end_reason, lapsed, replayed, shared,
hold_limit_at, """
    + LOCK
    # Each lock's revocation request (migration 0035), as the statement's snapshot shows it: no
    # session call changes one.
    + ", (SELECT h.revocation FROM helix_holds AS h WHERE h.id = a.id) AS revocation"
)
OPEN_SESSION = (
    "SELECT "
    + _SESSION
    + """ FROM helix_open_session(
    %(organization_id)s, %(holder)s, %(ttl_ms)s, %(metadata)s, %(idempotency_key)s, %(job_types)s,
    %(max_holders)s, %(quota)s, %(share)s, %(sessions_limit)s, %(locks_limit)s, %(place)s, %(shared)s,
    %(max_hold_ms)s
) AS a"""
)
ADD_SESSION_LOCKS = (
    "SELECT "
    + _SESSION
    + """ FROM helix_add_session_locks(
    %(session_id)s, %(token)s, %(scope)s, %(job_types)s, %(max_holders)s, %(quota)s, %(share)s,
    %(locks_limit)s, %(idempotency_key)s, %(place)s, %(shared)s
) AS a"""
)
RENEW_SESSION = (
    "SELECT "
    + _SESSION
    + " FROM helix_renew_session(%(session_id)s, %(token)s, %(ttl_ms)s, %(scope)s, %(sessions_limit)s) AS a"
)
CLOSE_SESSION = (
    "SELECT organization_id, end_reason, ended_at"
    " FROM helix_close_session(%(session_id)s, %(token)s, %(scope)s)"
)
# GET /v1/sessions/{id}: no token, and none in the answer.
GET_SESSION = (
    "SELECT " + _SESSION + """ FROM helix_session_answer(%(session_id)s, %(scope)s, false, false) AS a"""
)
PRUNE_SESSIONS = "SELECT helix_prune_sessions(%(older_than)s, %(batch)s) AS deleted"

# A waiting request's places, one in the queue of each of its pairs with one order number
# (migration 0029), which also have the pairs' ends announced; places that leave without a grant
# wake their pairs' other waiters.
TAKE_PLACES = """
SELECT helix_take_places(
    %(organization_id)s, %(job_types)s, %(holder)s, %(max_holders)s, %(seconds)s, %(replica)s, %(owner)s,
    %(idempotency_key)s, %(shared)s
) AS seq
"""
LEAVE_QUEUE = "SELECT helix_leave_queue(%(seq)s, %(organization_id)s, %(owner)s, %(keep)s) AS places"
# One page of a pair's queue: its live places in order, each with its position from 1.
QUEUE = """
SELECT q.seq, q.holder, q.max_holders, coalesce(q.shared, false) AS shared, q.waiting_since, q.until,
       q.position
FROM (
    SELECT p.*, row_number() OVER (ORDER BY p.seq) AS position
    FROM helix_live_places(%(organization_id)s, %(job_type)s, NULL, NULL) AS p
) AS q
WHERE q.seq > %(after)s
ORDER BY q.seq
LIMIT %(limit)s
"""

# After the listener reconnects (waiting.py): releases announced while it was away were lost.
# Of the keys this process waits for, each with the lock its first waiter sleeps on (NULL: none)
# and how many held the key's slots then, those whose live lock is not that one (released,
# replaced or unknown), or, of a semaphore, that has fewer unreleased locks than that (another
# slot ended). One statement for every key, each key's live locks read on the live locks' primary
# key (a LATERAL count per key: a NOT EXISTS here may become one hash of every live lock):
# never the history's rows.
MISSED_RELEASES = """
SELECT k.organization_id, k.job_type
FROM unnest(
    %(organization_ids)s::text[], %(job_types)s::text[], %(lock_ids)s::bigint[], %(holders)s::integer[]
) AS k (organization_id, job_type, lock_id, holders)
CROSS JOIN LATERAL (
    SELECT count(*) AS live, count(*) FILTER (WHERE h.id = k.lock_id) AS slept_on
    FROM helix_holds AS h
    WHERE h.organization_id = k.organization_id AND h.job_type = k.job_type
) AS c
WHERE c.slept_on = 0 OR k.holders > 1 AND k.holders > c.live
"""


# How long until a held lock's lease runs out, by the database clock (a waiter's timer).
REMAINING = "SELECT ttl_remaining_ms FROM helix_held_locks WHERE id = %(lock_id)s"

# The held lock with the highest fencing token, or (slot) the held lock in that slot.
CURRENT = (
    "SELECT "
    + LOCK
    + """, (SELECT h.session_id FROM helix_holds AS h WHERE h.id = v.id) AS session_id,
       (SELECT h.shared FROM helix_holds AS h WHERE h.id = v.id) AS shared,
       (SELECT h.hold_limit_at FROM helix_holds AS h WHERE h.id = v.id) AS hold_limit_at,
       (SELECT h.closed_until FROM helix_holds AS h WHERE h.id = v.id) AS closed_until,
       (SELECT h.revocation FROM helix_holds AS h WHERE h.id = v.id) AS revocation
FROM helix_held_locks AS v
WHERE organization_id = %(organization_id)s
  AND job_type = %(job_type)s
  AND state = 'held'
  AND (%(slot)s::integer IS NULL OR slot = %(slot)s)
ORDER BY fencing_token DESC
LIMIT 1
"""
)

# The live-lock quota (locks.py, LiveLockQuota; migrations 0013 and 0020). Far from the quota: an
# acquire let through on a share of the room, under the share's advisory lock in shared mode
# (HL005 once the share is gone or past its time), and the count that hands a process its share.
# Near it: the same acquire, counted and granted one at a time per organization; HL004 beyond the
# quota. Both answer the grant's hold limit (0033) and closing (0034) as the function read them.
ACQUIRE_ON_SHARE = (
    "SELECT "
    + LOCK
    + """, token, reclaimed_lock_id, reclaimed_holder, reclaimed_expired_at, %(mode)s = 'shared' AS shared,
       hold_limit_at, closed_until
FROM helix_acquire_job_lock_on_share(
    %(organization_id)s, %(job_type)s, %(holder)s, %(ttl_ms)s, %(metadata)s, %(idempotency_key)s,
    %(max_holders)s, %(share)s, %(place)s, %(mode)s, %(max_hold_ms)s, %(hold_at_least_ms)s
) AS g
"""
)
SHARE_QUOTA = """
SELECT live, share_id, share_room
FROM helix_share_quota(%(organization_id)s, %(limit)s, %(parts)s, %(seconds)s, %(previous)s)
"""
ACQUIRE_WITHIN_QUOTA = (
    "SELECT "
    + LOCK
    + """, token, reclaimed_lock_id, reclaimed_holder, reclaimed_expired_at, %(mode)s = 'shared' AS shared,
       hold_limit_at, closed_until
FROM helix_acquire_job_lock_within_quota(
    %(organization_id)s, %(job_type)s, %(holder)s, %(ttl_ms)s, %(metadata)s, %(idempotency_key)s, %(quota)s,
    %(max_holders)s, %(place)s, %(mode)s, %(max_hold_ms)s, %(hold_at_least_ms)s
) AS g
"""
)

# Whether an acquire of one key would add no live lock: every slot has a live lock (the acquire
# reclaims one, or is refused), or one of another max_holders does (migration 0017) or of another
# mode (0030: a reader has up to 1000 slots), or it repeats a grant still live (migration 0018),
# or, of a reader, a lock of the pair has expired (0032: a reader's grant reclaims every one).
ADDS_NO_LIVE_LOCK = """
SELECT count(*) >= CASE WHEN %(mode)s = 'shared' THEN 1000 ELSE %(max_holders)s END
       OR coalesce(bool_or(max_holders <> %(max_holders)s OR shared <> (%(mode)s = 'shared')
                           OR idempotency_key = %(idempotency_key)s AND holder = %(holder)s
                              AND expires_at > clock_timestamp()
                           OR %(mode)s = 'shared' AND lease_ends <= clock_timestamp()), false) AS adds_none
FROM helix_holds AS h
CROSS JOIN LATERAL (
    SELECT coalesce((SELECT s.expires_at FROM helix_sessions AS s WHERE s.id = h.session_id), h.expires_at)
        AS lease_ends
) AS l
WHERE organization_id = %(organization_id)s AND job_type = %(job_type)s
"""

# Listings read the tables, helix_holds and helix_lock_history, not the views: the views' columns call
# clock_timestamp(), so PostgreSQL never merges the view into a query, and an ORDER BY over it
# sorts every row that matches rather than reading an index in order up to LIMIT. The columns are
# the view's (migration 0003) for the rows each listing lists. One statement per kind of listing
# (locks.py picks it), and none tests `%(x)s IS NULL OR` on the organization or job
# type: a generic plan (a prepared statement after a few executions) cannot bound an index scan
# by such a test, and would read every organization's rows. An organization's listing is one
# range of an index that starts with organization_id (the live locks' primary key, the history's
# by_organization or by_job_type index) and stops
# at LIMIT; an admin's across organizations reads the global index in order and filters (admins
# are trusted).

# Locks not yet released (held, expired or both), in key and slot order; the cursor is the last
# (key, slot) seen.
# The state is computed once per row (LATERAL), so a row kept by a state filter says that state. A
# lock of a session has the session's lease (migration 0028), read by the session's primary key
# for such a lock alone (a join would be free to read every session).
_LIVE = """
SELECT l.id, l.organization_id, l.job_type, l.holder, l.fencing_token, l.acquired_at, s.expires_at,
       NULL::timestamptz AS released_at, NULL::text AS release_reason, s.state,
       greatest(0, floor(extract(epoch FROM s.expires_at - clock_timestamp()) * 1000))::bigint
           AS ttl_remaining_ms,
       l.metadata, l.max_holders, l.slot, l.session_id, l.shared, l.hold_limit_at, l.closed_until,
       l.revocation
FROM helix_holds AS l
CROSS JOIN LATERAL (
    SELECT CASE WHEN l.session_id IS NULL THEN l.expires_at
                ELSE coalesce((SELECT se.expires_at FROM helix_sessions AS se WHERE se.id = l.session_id),
                              l.expires_at)
           END AS expires_at
) AS e
CROSS JOIN LATERAL (
    SELECT e.expires_at, CASE WHEN e.expires_at <= clock_timestamp() THEN 'expired' ELSE 'held' END AS state
) AS s
WHERE (%(state)s::text IS NULL OR s.state = %(state)s)
  AND (%(after_organization_id)s::text IS NULL
       OR (l.organization_id, l.job_type, l.slot)
          > (%(after_organization_id)s, %(after_job_type)s, %(after_slot)s::integer))
"""
_IN_KEY_ORDER = """ORDER BY l.organization_id, l.job_type, l.slot
LIMIT %(limit)s
"""
# Each scan starts at the cursor's key (for an organization's listing, its job type when the
# cursor is of this organization), else at the first: '' sorts before any text. The cursor test
# above keeps the answer exact.
LIST_LIVE = (
    _LIVE
    + """  AND l.organization_id = %(organization_id)s
  AND l.job_type >= CASE WHEN %(after_organization_id)s::text = %(organization_id)s
                         THEN %(after_job_type)s::text ELSE '' END
"""
    + _IN_KEY_ORDER
)
LIST_LIVE_OF_JOB_TYPE = (
    _LIVE + "  AND l.organization_id = %(organization_id)s AND l.job_type = %(job_type)s\n" + _IN_KEY_ORDER
)
LIST_LIVE_ALL_ORGANIZATIONS = (
    _LIVE
    + """  AND (%(job_type)s::text IS NULL OR l.job_type = %(job_type)s)
  AND (l.organization_id, l.job_type)
      >= (coalesce(%(after_organization_id)s::text, ''), coalesce(%(after_job_type)s::text, ''))
"""
    + _IN_KEY_ORDER
)

# Ended locks, newest end first; the cursor is the last (released_at, id) seen, and the first
# page starts above every row (released_at is a clock reading, never 'infinity'). A state is one
# value of the indexes' `release_reason IS DISTINCT FROM 'reclaimed'` (migration 0011 says why
# that form).
_HISTORY = """
SELECT l.id, l.organization_id, l.job_type, l.holder, l.fencing_token, l.acquired_at, l.expires_at,
       l.released_at, l.release_reason,
       CASE WHEN l.release_reason = 'reclaimed' THEN 'reclaimed' ELSE 'released' END AS state,
       0::bigint AS ttl_remaining_ms, l.metadata, l.max_holders, l.slot, l.forced_by, l.session_id, l.shared,
       l.hold_limit_at, l.closed_until, l.revocation
FROM helix_lock_history AS l
WHERE (l.release_reason IS DISTINCT FROM 'reclaimed') = (%(state)s::text = 'released')
  AND (l.released_at, l.id) < (coalesce(%(after_released_at)s::timestamptz, 'infinity'),
                               coalesce(%(after_id)s::bigint, 9223372036854775807))
"""
_NEWEST_FIRST = """ORDER BY l.released_at DESC, l.id DESC
LIMIT %(limit)s
"""
LIST_HISTORY = _HISTORY + "  AND l.organization_id = %(organization_id)s\n" + _NEWEST_FIRST
LIST_HISTORY_OF_JOB_TYPE = (
    _HISTORY + "  AND l.organization_id = %(organization_id)s AND l.job_type = %(job_type)s\n" + _NEWEST_FIRST
)
LIST_HISTORY_ALL_ORGANIZATIONS = (
    _HISTORY + "  AND (%(job_type)s::text IS NULL OR l.job_type = %(job_type)s)\n" + _NEWEST_FIRST
)


# API keys (keys.py). Changing the table notifies every service process (a trigger).
KEYS_CHANNEL = "helix_api_keys"
# Ends of locks (waiting.py); payload "organization_id/job_type".
RELEASED_CHANNEL = "helix_lock_released"
ALL_KEYS = "SELECT id, organization_id, key_hash, revoked_at IS NOT NULL AS revoked FROM helix_api_keys"
KEY_BY_ID = (
    "SELECT id, organization_id, key_hash, revoked_at IS NOT NULL AS revoked FROM helix_api_keys"
    " WHERE id = %(id)s"
)
CREATE_KEY = """
INSERT INTO helix_api_keys (id, organization_id, key_hash) VALUES (%(id)s, %(organization_id)s, %(key_hash)s)
"""
LIST_KEYS = """
SELECT id, organization_id, created_at, last_used_at, revoked_at FROM helix_api_keys ORDER BY created_at, id
"""
REVOKE_KEY = """
UPDATE helix_api_keys SET revoked_at = coalesce(revoked_at, clock_timestamp()) WHERE id = %(id)s RETURNING id
"""
KEYS_EXIST = "SELECT EXISTS (SELECT 1 FROM helix_api_keys) AS exists"
# A bootstrap that stores a key only while none exists: one at a time.
LOCK_KEYS = "LOCK TABLE helix_api_keys IN SHARE ROW EXCLUSIVE MODE"
# Last use is recorded in batches, to the nearest few seconds, not as a write per request.
TOUCH_KEYS = "SELECT helix_touch_api_keys(%(ids)s) AS touched"

# Notifications (listener.py); the channel is an identifier, composed safely.
LISTEN = sql.SQL("LISTEN {}")
# The server's side of the listener's connection probes it every second after 5 idle: while it is
# open, the places of this process count as live (migration 0029), so a process whose host
# vanished (no FIN reaches the server) stops holding the queues within about 8 s, not PostgreSQL's
# default two hours. Over TCP only; a Unix socket needs none.
LISTENER_KEEPALIVES = """
SELECT set_config('tcp_keepalives_idle', '5', false), set_config('tcp_keepalives_interval', '1', false),
       set_config('tcp_keepalives_count', '3', false)
"""
PING = "SELECT 1"
# The listener's self-test: a notification sent the way the lock functions send theirs (through
# database_url) must reach the listening connection, which a transaction pooler would not do.
PROBE_CHANNEL = "helix_listener_probe"
PROBE = "SELECT pg_notify('helix_listener_probe', %(payload)s) AS sent"

# History retention (retention.py): one batch of ended rows older than the window.
PRUNE = "SELECT helix_prune_history(%(older_than)s, %(batch)s) AS deleted"

# The held/expired gauges (telemetry.py): a scan of the live locks alone.
COUNT_LIVE = (
    "SELECT count(*) FILTER (WHERE state = 'held') AS held,"
    " count(*) FILTER (WHERE state = 'expired') AS expired"
    " FROM helix_held_locks"
)

# Migration bookkeeping (migrate.py).
MIGRATION_LOCK = "SELECT pg_advisory_lock(%(key)s)"
MIGRATION_UNLOCK = "SELECT pg_advisory_unlock(%(key)s)"
CREATE_MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS helix_schema_migrations (
    name       text        PRIMARY KEY,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""
# The schema migrations go into: the first schema on the role's search_path that exists.
# Where an installation's migrations table is, if the search_path reaches one; else the first
# schema on the search_path that exists.
MIGRATION_SCHEMA = """
SELECT s.name, has_schema_privilege(s.name, 'CREATE')
FROM (
    SELECT coalesce(
        (SELECT n.nspname
         FROM pg_catalog.pg_class AS c JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
         WHERE c.oid = to_regclass('helix_schema_migrations')),
        current_schema()
    ) AS name
) AS s
"""
PIN_SEARCH_PATH = "SELECT set_config('search_path', quote_ident(%(schema)s) || ', pg_temp', false)"
MIGRATIONS_TABLE_EXISTS = "SELECT to_regclass('helix_schema_migrations') IS NOT NULL AS exists"
APPLIED_MIGRATIONS = "SELECT name, checksum FROM helix_schema_migrations"
RECORD_MIGRATION = """
INSERT INTO helix_schema_migrations (name, checksum) VALUES (%(name)s, %(checksum)s)
"""

# GET /v1/events (migration 0016): where the event reader starts, the database's snapshot and time.
EVENTS_START = "SELECT pg_current_snapshot()::text AS snapshot, clock_timestamp() AS until_at"

# The key that signs event ids (migration 0019).
EVENT_ID_KEY = "SELECT key FROM helix_event_id_key"

# The expiries due, announced by this reader's transaction (0019): at most this many at once, by
# one reader at a time, at most once a second (0023).
ANNOUNCE_EXPIRIES = "SELECT helix_announce_expiries(%(limit)s) AS announced"

# What an event sends of its lock: the lock as it is now, and what only the row says.
_EVENT_LOCK = """v.id, v.organization_id, v.job_type, v.holder, v.fencing_token, v.acquired_at,
       v.expires_at, v.released_at, v.release_reason, v.state, v.ttl_remaining_ms, v.metadata,
       v.max_holders, v.slot, CASE WHEN v.release_reason = 'forced' THEN k.forced_by END AS forced_by,
       k.reclaimed_lock_id, k.reclaimed_holder, k.reclaimed_expired_at,
       coalesce((SELECT h.session_id FROM helix_holds AS h WHERE h.id = v.id),
                (SELECT e.session_id FROM helix_lock_history AS e WHERE e.id = v.id)) AS session_id,
       coalesce((SELECT h.shared FROM helix_holds AS h WHERE h.id = v.id),
                (SELECT e.shared FROM helix_lock_history AS e WHERE e.id = v.id)) AS shared,
       coalesce((SELECT h.hold_limit_at FROM helix_holds AS h WHERE h.id = v.id),
                (SELECT e.hold_limit_at FROM helix_lock_history AS e WHERE e.id = v.id)) AS hold_limit_at,
       coalesce((SELECT h.closed_until FROM helix_holds AS h WHERE h.id = v.id),
                (SELECT e.closed_until FROM helix_lock_history AS e WHERE e.id = v.id)) AS closed_until,
       coalesce((SELECT h.revocation FROM helix_holds AS h WHERE h.id = v.id),
                (SELECT e.revocation FROM helix_lock_history AS e WHERE e.id = v.id)) AS revocation"""

# The reader's poll: its own window from the snapshot it read last to this statement's, and a
# window for each resumed watcher from where its catch-up ended (its bridge); one statement, so
# one snapshot closes them all, and a start with no events still gives a row (n, nulls). Each
# start reads at most its limit (plus one, which tells that the limit was passed). due: a sweep
# for expiries to announce (helix_announce_expiries) may run, a second after the last one.
EVENTS = (
    """
WITH now AS (
    SELECT pg_current_snapshot() AS snapshot, clock_timestamp() AS until_at,
           helix_expiries_due() AS due
),
starts AS (
    SELECT * FROM unnest(
        %(after)s::text[], %(organization_id)s::text[], %(job_type)s::text[], %(limit)s::integer[]
    ) WITH ORDINALITY AS a (after, organization_id, job_type, lim, n)
),
events AS MATERIALIZED (
    SELECT s.n, e.at, e.id, e.rank
    FROM starts AS s CROSS JOIN now
    CROSS JOIN LATERAL (
        SELECT w.at, w.id, w.rank
        FROM helix_window_events(s.after::pg_snapshot, now.snapshot, s.organization_id, s.job_type, 5) AS w
        ORDER BY w.at, w.id, w.rank
        LIMIT s.lim + 1
    ) AS e
),
-- The view reads the clock, so it is not merged into a join: it is asked for these ids alone
-- (joined by id, it would be read whole).
locks AS (
    SELECT * FROM helix_job_lock_views AS l WHERE l.id = ANY (ARRAY(SELECT DISTINCT e.id FROM events AS e))
)
SELECT now.snapshot::text AS snapshot, now.until_at, now.due, s.n, e.at, e.rank, """
    + _EVENT_LOCK
    + """
FROM now CROSS JOIN starts AS s
LEFT JOIN events AS e ON e.n = s.n
LEFT JOIN locks AS v ON v.id = e.id
LEFT JOIN helix_job_locks AS k ON k.id = e.id
-- By time, then lock id and kind: a key's events in commit order (0017, 0019).
ORDER BY s.n, e.at, e.id, e.rank
"""
)

# A catch-up's windows, each (after, until] with until NULL for this statement's own snapshot,
# from a place on (the events after it, in the order above): at most `limit` of each, as (time,
# lock id, kind) alone, and how many there are in all (total); a catch-up sends their locks a
# page at a time (EVENT_LOCKS). One statement, so that the last window ends at the snapshot it
# returns.
CATCH_UP = """
SELECT now.snapshot::text AS snapshot, now.until_at, a.n, e.at, e.id, e.rank, e.total
FROM (SELECT pg_current_snapshot() AS snapshot, clock_timestamp() AS until_at) AS now
CROSS JOIN unnest(
    %(after)s::text[], %(until)s::text[], %(from_at)s::timestamptz[], %(from_id)s::bigint[],
    %(from_rank)s::integer[]
) WITH ORDINALITY AS a (after, until, from_at, from_id, from_rank, n)
LEFT JOIN LATERAL (
    SELECT w.at, w.id, w.rank, count(*) OVER () AS total
    FROM helix_window_events(
        a.after::pg_snapshot, coalesce(a.until::pg_snapshot, now.snapshot),
        %(organization_id)s, %(job_type)s, 5
    ) AS w
    WHERE a.from_at IS NULL OR (w.at, w.id, w.rank) > (a.from_at, a.from_id, a.from_rank)
    ORDER BY w.at, w.id, w.rank
    LIMIT %(limit)s
) AS e ON true
ORDER BY a.n, e.at, e.id, e.rank
"""

# A page of a catch-up: the locks its events are about.
EVENT_LOCKS = (
    "SELECT "
    + _EVENT_LOCK
    + """
FROM helix_job_lock_views AS v
JOIN helix_job_locks AS k ON k.id = v.id
WHERE v.id = ANY (%(ids)s::bigint[])
"""
)
