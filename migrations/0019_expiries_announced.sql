-- GET /v1/events, again: every event is placed by the transaction that wrote it, expiries too.
--
-- Migration 0016 placed an expiry by time: the window (P, S] reported an expiry e when e fell
-- between the clock readings that closed P and S. Time and visibility disagree when a transaction
-- commits late (synchronous replication, a slow disk, a caller's own long transaction), and three
-- holes followed: a lease granted or renewed by a commit slower than itself was reported by no
-- window, or by a live stream and not by a resume; and a renewal or release that read the clock
-- before e but committed after the window holding e left an `expired` in the stream that the
-- history denies (the lease never ran out).
--
-- Now an expiry is a change like any other, written by a transaction, and placed in exactly one
-- window by that transaction's id:
-- - expired_xid: the transaction that announced the current lease's expiry. A reader announces
--   the expiries that are due (helix_announce_expiries, below), or, if the lease ran out before
--   anyone did, the change that found it so announces it: the release, force, reclaim or update
--   that came after it (the trigger), the renewal that revived it, or a grant of another slot of
--   the pair that locked it (migration 0022).
-- - lapse_xids: beside lapses (0016), the transaction that announced each expiry a renewal
--   revived: the announcer, if one came before the renewal, else the renewal itself.
--
-- Why no expiry is made up: every change of a lock locks its row before it reads the clock that
-- dates it (renewals and updates in helix_lock_for_holder, releases and forces with FOR UPDATE,
-- a reclaim in the acquire's FOR UPDATE of the pair's live locks, the announcer with SKIP
-- LOCKED). The announcer reads the clock (at or after e), then locks the row, skipping one that
-- another transaction holds: so a renewal or release it raced either holds the row and the
-- announcer passes it by (the renewal, if it came before e, leaves no lapse and no expiry), or
-- locks the row after the announcement commits and reads a clock past e, so the history says the
-- lease ran out before it. The same holds of a release or renewal that announces an expiry
-- itself: it compares e with its own clock reading, taken under the row lock.
--
-- Why none is lost or repeated: a window (P, U] holds the changes whose transaction is not
-- visible in snapshot P and visible in snapshot U (helix_window_events). Each change has one
-- transaction, so it falls in exactly one of a stream's consecutive windows, whenever it commits
-- and however long it took. A row's visible version keeps the id of every change a resumed
-- stream may need: acquired_xid and the release's changed_xid never change again; lapses keep
-- their announcer; expired_xid moves to lapse_xids when a renewal revives the lease. Only a
-- renewal or update overwritten by a later one is folded into it, as the API allows a replay.
--
-- Order: a window's events are sorted by time, lock id and kind. A key's grants and releases come
-- in commit order (0017's argument). An expiry comes at its time e, after the lock's earlier
-- events and before the renewal or release that announced it (the same window, later in time);
-- announced by a reader, it comes in the window of the announcement.
ALTER TABLE helix_job_locks
    ADD COLUMN expired_xid xid8,
    ADD COLUMN lapse_xids xid8[];

COMMENT ON COLUMN helix_job_locks.expired_xid IS
    'The transaction that announced that the current lease (expires_at) ran out: a reader of '
    'GET /v1/events, or the release, force or reclaim that came after it. NULL: not announced.';
COMMENT ON COLUMN helix_job_locks.lapse_xids IS
    'Beside lapses, the transaction that announced each of those expiries (GET /v1/events).';

-- The lapses recorded before this migration were reported by streams of the builds before it,
-- whose event ids this build does not resume: the renewal that recorded each stands for it.
UPDATE helix_job_locks
SET lapse_xids = array_fill(coalesce(renewed_xid, acquired_xid), ARRAY[cardinality(lapses)])
WHERE lapses IS NOT NULL;

-- The expiries still to announce: the announcer reads them from here, and a poll that finds
-- none costs one index probe, however many lapsed locks are never reclaimed. (0016's index of
-- every live lease is no longer read.)
DROP INDEX helix_job_locks_live_expiry;
CREATE INDEX helix_job_locks_unannounced_expiry ON helix_job_locks (expires_at)
WHERE released_at IS NULL AND expired_xid IS NULL;

-- A resume of one organization reads the changes of that organization alone, however busy the
-- others are.
CREATE INDEX helix_job_locks_changed_by_organization ON helix_job_locks (organization_id, changed_xid);

CREATE OR REPLACE FUNCTION helix_lock_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_xid xid8 := pg_current_xact_id();
BEGIN
    IF TG_OP = 'INSERT' THEN
        NEW.acquired_xid := v_xid;
    ELSIF NEW.released_at IS DISTINCT FROM OLD.released_at THEN
        -- A release, force or reclaim after the lease ran out announces the expiry, if no one did.
        IF OLD.expired_xid IS NULL AND OLD.expires_at <= NEW.released_at THEN
            NEW.expired_xid := v_xid;
        END IF;
    ELSIF NEW.expires_at IS DISTINCT FROM OLD.expires_at THEN
        NEW.renewed_xid := v_xid;
        -- The renewal's own clock reading, when it gives one (helix_renew_job_lock does, the one
        -- its new lease and its `lapsed` answer count from).
        IF NEW.renewed_at IS NOT DISTINCT FROM OLD.renewed_at THEN
            NEW.renewed_at := clock_timestamp();
        END IF;
        IF OLD.expired_xid IS NOT NULL OR OLD.expires_at <= NEW.renewed_at THEN
            NEW.lapses := array_append(OLD.lapses, OLD.expires_at);
            NEW.lapse_xids := array_append(OLD.lapse_xids, coalesce(OLD.expired_xid, v_xid));
        END IF;
        NEW.expired_xid := NULL;
    ELSIF NEW.metadata IS DISTINCT FROM OLD.metadata THEN
        NEW.updated_xid := v_xid;
        NEW.updated_at := clock_timestamp();
        -- An update of a lease that ran out announces the expiry, if no one did: the stream sends
        -- it before the update, as a renewal's or a release's.
        IF OLD.expired_xid IS NULL AND OLD.expires_at <= NEW.updated_at THEN
            NEW.expired_xid := v_xid;
        END IF;
    ELSIF NEW.expired_xid IS DISTINCT FROM OLD.expired_xid THEN
        NULL;  -- an announcement: changed_xid below
    ELSE
        RETURN NEW;  -- no change anyone watches (an idempotent repeat's claim)
    END IF;
    NEW.changed_xid := v_xid;
    RETURN NEW;
END $$;

CREATE OR REPLACE FUNCTION helix_renew_job_lock(p_lock_id bigint, p_token text, p_ttl_ms bigint, p_organization_id text)
RETURNS TABLE (
    id bigint, organization_id text, job_type text, holder text, fencing_token bigint,
    acquired_at timestamptz, expires_at timestamptz, released_at timestamptz,
    release_reason text, state text, ttl_remaining_ms bigint, metadata jsonb,
    max_holders integer, slot integer, lapsed boolean
)
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
    v_lease interval := helix_lease(p_ttl_ms);
    v_lock helix_job_locks%ROWTYPE := helix_lock_for_holder(p_lock_id, p_token, p_organization_id, true);
    v_now timestamptz := clock_timestamp();  -- under the row lock
BEGIN
    -- A lapsed lease nobody reclaimed may be renewed: no one else can have held the lock. The
    -- renewal is dated by the clock its lease counts from, so that the history (lapses) and the
    -- answer (lapsed) agree on whether the lease had run out.
    UPDATE helix_job_locks SET expires_at = v_now + v_lease, renewed_at = v_now WHERE id = p_lock_id;
    RETURN QUERY
        SELECT v.*, v_lock.expires_at <= v_now
        FROM helix_job_lock_views AS v
        WHERE v.id = p_lock_id;
END $$;

-- A reader's announcement of the expiries that are due, up to p_limit of them (the longest due
-- first); the rest at its next poll. A lock another transaction holds is passed by (see above).
CREATE FUNCTION helix_announce_expiries(p_limit integer) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    -- A value, not clock_timestamp() in the WHERE clause, which could not bound the index scan.
    v_now timestamptz := clock_timestamp();
    v_announced integer;
BEGIN
    WITH due AS (
        SELECT l.id FROM helix_job_locks AS l
        WHERE l.released_at IS NULL AND l.expired_xid IS NULL AND l.expires_at <= v_now
        ORDER BY l.expires_at
        LIMIT p_limit
        FOR NO KEY UPDATE SKIP LOCKED
    )
    UPDATE helix_job_locks AS l SET expired_xid = pg_current_xact_id()
    FROM due WHERE l.id = due.id;
    GET DIAGNOSTICS v_announced = ROW_COUNT;
    RETURN v_announced;
END $$;
REVOKE EXECUTE ON FUNCTION helix_announce_expiries(integer) FROM PUBLIC;

COMMENT ON FUNCTION helix_announce_expiries(integer) IS
    'GET /v1/events: marks the due expiries (lease run out, not released, not announced) as '
    'announced by this transaction, passing by the locks another transaction holds.';

-- The events of the window (p_after, p_until] of one organization and job type, or (NULL) all:
-- the changes whose transaction is visible in p_until and not in p_after, each as its time, its
-- lock and its kind (0 acquired, 1 expired, 2 renewed, 3 updated, 4 the end: released, forced or
-- reclaimed, as the row's release_reason says). p_until may be the caller's own snapshot (a live
-- window) or an earlier one (a window that a resumed stream reads again).
CREATE FUNCTION helix_window_events(
    p_after pg_snapshot, p_until pg_snapshot, p_organization_id text, p_job_type text
)
RETURNS TABLE (at timestamptz, id bigint, rank integer)
-- STABLE: it reads with the snapshot of the statement that calls it. Planned for the values it is
-- given (force_custom_plan): a window holds few rows, an organization's on its own index, where a
-- plan for any values would read the whole table.
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path FROM CURRENT
SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    -- A value, not a subquery, so that the plan knows how few they are.
    v_in_progress xid8[] := ARRAY(SELECT pg_snapshot_xip(p_after));
    v_from xid8 := pg_snapshot_xmax(p_after);
BEGIN
    RETURN QUERY
    WITH changed AS (
        -- A row's visible version carries the transaction of its latest change; a row none of
        -- whose changes is visible in p_after has that one from p_after's xmax on, or among its
        -- in-progress transactions. Two index scans, however old p_after's xmin is; the columns
        -- the events need, not the metadata.
        SELECT l.id, l.acquired_at, l.acquired_xid, l.lapses, l.lapse_xids, l.expires_at,
               l.expired_xid, l.renewed_at, l.renewed_xid, l.updated_at, l.updated_xid,
               l.released_at, l.changed_xid
        FROM helix_job_locks AS l
        WHERE l.changed_xid >= v_from
          AND (p_organization_id IS NULL OR l.organization_id = p_organization_id)
          AND (p_job_type IS NULL OR l.job_type = p_job_type)
        UNION ALL
        SELECT l.id, l.acquired_at, l.acquired_xid, l.lapses, l.lapse_xids, l.expires_at,
               l.expired_xid, l.renewed_at, l.renewed_xid, l.updated_at, l.updated_xid,
               l.released_at, l.changed_xid
        FROM helix_job_locks AS l
        WHERE l.changed_xid = ANY (v_in_progress)
          AND (p_organization_id IS NULL OR l.organization_id = p_organization_id)
          AND (p_job_type IS NULL OR l.job_type = p_job_type)
    ),
    events (at, id, rank, xid) AS (
        SELECT c.acquired_at, c.id, 0, c.acquired_xid FROM changed AS c
        UNION ALL
        SELECT lapse.at, c.id, 1, lapse.xid
        FROM changed AS c, unnest(c.lapses, c.lapse_xids) AS lapse (at, xid)
        UNION ALL
        SELECT c.expires_at, c.id, 1, c.expired_xid FROM changed AS c
        UNION ALL
        SELECT c.renewed_at, c.id, 2, c.renewed_xid FROM changed AS c
        UNION ALL
        SELECT c.updated_at, c.id, 3, c.updated_xid FROM changed AS c
        UNION ALL
        -- A release is a lock's last change: its transaction is the row's changed_xid.
        SELECT c.released_at, c.id, 4, c.changed_xid FROM changed AS c WHERE c.released_at IS NOT NULL
    )
    SELECT e.at, e.id, e.rank FROM events AS e
    WHERE e.xid IS NOT NULL
      AND NOT pg_visible_in_snapshot(e.xid, p_after)
      AND pg_visible_in_snapshot(e.xid, p_until);
END $$;
REVOKE EXECUTE ON FUNCTION helix_window_events(pg_snapshot, pg_snapshot, text, text) FROM PUBLIC;

COMMENT ON FUNCTION helix_window_events(pg_snapshot, pg_snapshot, text, text) IS
    'GET /v1/events: the changes committed between two snapshots (time, lock id, kind), each in '
    'exactly one window of a stream: see migration 0019.';

-- The key that signs event ids, so that a resume starts only where this service said a stream
-- was: one for the database, so that every replica reads the same ids.
CREATE TABLE helix_event_id_key (
    one boolean PRIMARY KEY DEFAULT true CHECK (one),
    key bytea NOT NULL
);
INSERT INTO helix_event_id_key (key)
SELECT decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex');

COMMENT ON TABLE helix_event_id_key IS
    'The HMAC key of GET /v1/events ids (one row): ids resume on any replica, and a made-up one '
    'is refused. Replace it to invalidate every id.';

-- helix_lock_events (0016) stays for the replicas of the build before this one during a rolling
-- upgrade; a later migration drops it.
