-- GET /v1/events: every change of a lock, read back from the lock rows themselves.
--
-- Nothing is written for a watcher, and nothing is sent: the rows already hold the history, so
-- each change only stamps its row, in the same row version it writes anyway (a BEFORE trigger,
-- so also for replicas of an older build during a rolling upgrade):
-- - acquired_xid: the transaction that granted the lock;
-- - renewed_xid and renewed_at, updated_xid and updated_at: its latest renewal and update;
-- - changed_xid: the transaction of its latest change of any kind (a release is the last);
-- - lapses: each expires_at a renewal revived after it had passed.
-- An expiry itself writes nothing: it is read from expires_at and the database clock.
--
-- A reader (one task per service process, whatever the number of watchers) asks, over and over,
-- "what changed between snapshot P and now?" in ONE statement, whose snapshot S and clock reading
-- T close the window (P, S] and open the next one. pg_current_snapshot() is the statement's own
-- snapshot, and helix_lock_events is STABLE, so it reads the rows with that same snapshot.
--
-- No event is lost or reported twice:
-- - A change is in the window of exactly one pair of consecutive snapshots: its transaction is
--   not visible in P and visible in S. A row's visible version carries the xid of its latest
--   change, and the rows not visible in P are those whose xid is at least P's xmax or among
--   P's in-progress xids: two index lookups, however long another transaction stays open.
-- - A grant's acquired_xid, and a release's changed_xid (a release is a lock's last change),
--   place them in one window each.
-- - A lock's renewals are reported by its renewed_xid, its updates by its updated_xid: several
--   renewals (or updates) of one lock in one window are reported as the latest of them, with
--   the lock's latest state, as the API allows.
-- - An expiry at e is reported by the window whose times (T of P, T of S] hold e, if the row
--   that window reads still ends at e and was not released before e. Otherwise a renewal
--   revived the lease after e, at time r >= e (the trigger records e in lapses then). Such a
--   renewal committed after P (else the window before would have read the renewed row), so its
--   change is in this window or a later one, and the window holding it reports e from lapses
--   when e lies after that window's T of P; when e lies before it, the window holding e read the
--   row before the renewal and reported e there. A renewal that committed before P took its clock
--   reading r before T of P, so no lapse it recorded can fall into a later window.
-- - A grant or renewal whose commit came after its own lease had run out (a commit slower than
--   the lease) was read by no window before its expiry: the window that holds its commit
--   reports the expiry.
-- - Order: every grant of a key waits for the key's row lock (0003), so a key's lock ids, like
--   its fencing tokens, increase in commit order, and a lock's changes are serialised by its row
--   lock. Sorting a window by (lock id, time, kind) puts each key's events in commit order.
--
-- Resuming from any replica: an event id names its window (P, S], the two times and the event's
-- place in the window. A reader asked to resume reads the window (P, now] in the same statement
-- as its own next window, and leaves out what (P, S] held up to that place; from then on the
-- stream follows the process's own windows. What retention deleted cannot be read back: an id
-- older than it is refused (410).
--
-- Cost when nobody watches: the trigger, and two index entries a grant and a release write
-- (changed_xid; expires_at of live locks). A renewal is no longer a HOT update.
ALTER TABLE helix_job_locks
    ADD COLUMN acquired_xid xid8,
    ADD COLUMN renewed_xid xid8,
    ADD COLUMN renewed_at timestamptz,
    ADD COLUMN updated_xid xid8,
    ADD COLUMN updated_at timestamptz,
    ADD COLUMN changed_xid xid8,
    ADD COLUMN lapses timestamptz[];

CREATE INDEX helix_job_locks_changed ON helix_job_locks (changed_xid);
-- "expires_at IS NOT NULL" (always true) keeps this index to statements that compare expires_at:
-- without it, a lookup of a key's live lock (org, job type, released_at IS NULL) on a small table
-- may read this index whole rather than helix_job_locks_one_live.
CREATE INDEX helix_job_locks_live_expiry ON helix_job_locks (expires_at)
WHERE released_at IS NULL AND expires_at IS NOT NULL;

CREATE FUNCTION helix_lock_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        NEW.acquired_xid := pg_current_xact_id();
    ELSIF NEW.released_at IS DISTINCT FROM OLD.released_at THEN
        NULL;  -- the release: changed_xid below
    ELSIF NEW.expires_at IS DISTINCT FROM OLD.expires_at THEN
        NEW.renewed_xid := pg_current_xact_id();
        NEW.renewed_at := clock_timestamp();
        IF OLD.expires_at <= NEW.renewed_at THEN
            NEW.lapses := array_append(OLD.lapses, OLD.expires_at);
        END IF;
    ELSIF NEW.metadata IS DISTINCT FROM OLD.metadata THEN
        NEW.updated_xid := pg_current_xact_id();
        NEW.updated_at := clock_timestamp();
    ELSE
        RETURN NEW;  -- no change anyone watches (an idempotent repeat's claim)
    END IF;
    NEW.changed_xid := pg_current_xact_id();
    RETURN NEW;
END $$;

CREATE TRIGGER helix_lock_changed BEFORE INSERT OR UPDATE ON helix_job_locks
FOR EACH ROW EXECUTE FUNCTION helix_lock_changed();

-- The events of the window (p_after, the caller's snapshot], expiries at times in
-- (p_after_at, p_until_at], for one organization and job type or (NULL) all. seen: whether the
-- event was already in the window that closed at p_seen (and p_seen_at), for a resume.
CREATE FUNCTION helix_lock_events(
    p_after pg_snapshot, p_after_at timestamptz, p_until_at timestamptz,
    p_organization_id text, p_job_type text, p_seen pg_snapshot, p_seen_at timestamptz
)
RETURNS TABLE (
    event text, at timestamptz, rank integer, seen boolean,
    id bigint, organization_id text, job_type text, holder text, fencing_token bigint,
    acquired_at timestamptz, expires_at timestamptz, released_at timestamptz,
    release_reason text, state text, ttl_remaining_ms bigint, metadata jsonb,
    reclaimed_lock_id bigint, reclaimed_holder text, reclaimed_expired_at timestamptz
)
-- STABLE: it reads with the snapshot of the statement that calls it (no snapshot of its own).
-- PL/pgSQL: its statement is planned for the values it is given (a window holds few rows), where
-- a plan for any values would read the whole table.
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
    -- A value, not a subquery, so that the plan knows how few they are.
    v_in_progress xid8[] := ARRAY(SELECT pg_snapshot_xip(p_after));
BEGIN
    RETURN QUERY
    WITH changed AS (
        -- Not visible in p_after: from its xmax on, or among its in-progress transactions. Two
        -- index scans, however old p_after's xmin is.
        SELECT l.* FROM helix_job_locks AS l
        WHERE l.changed_xid >= pg_snapshot_xmax(p_after)
        UNION ALL
        SELECT l.* FROM helix_job_locks AS l
        WHERE l.changed_xid = ANY (v_in_progress)
    ),
    scoped AS (
        SELECT c.* FROM changed AS c
        WHERE (p_organization_id IS NULL OR c.organization_id = p_organization_id)
          AND (p_job_type IS NULL OR c.job_type = p_job_type)
    ),
    ran_out AS (
        SELECT l.id, l.expires_at FROM helix_job_locks AS l
        WHERE l.released_at IS NULL
          AND l.expires_at > p_after_at AND l.expires_at <= p_until_at
          AND (p_organization_id IS NULL OR l.organization_id = p_organization_id)
          AND (p_job_type IS NULL OR l.job_type = p_job_type)
        UNION ALL
        SELECT l.id, l.expires_at FROM helix_job_locks AS l
        WHERE l.released_at IS NOT NULL AND l.released_at > p_after_at
          AND l.released_at > l.expires_at
          AND l.expires_at > p_after_at AND l.expires_at <= p_until_at
          AND (p_organization_id IS NULL OR l.organization_id = p_organization_id)
          AND (p_job_type IS NULL OR l.job_type = p_job_type)
    ),
    events (event, at, rank, seen, id) AS (
        SELECT 'acquired', c.acquired_at, 0, pg_visible_in_snapshot(c.acquired_xid, p_seen), c.id
        FROM scoped AS c
        WHERE NOT pg_visible_in_snapshot(c.acquired_xid, p_after)
        UNION ALL
        SELECT 'expired', lapse, 1, lapse <= p_seen_at, c.id
        FROM scoped AS c, unnest(c.lapses) AS lapse
        WHERE lapse > p_after_at AND lapse <= p_until_at
        UNION ALL
        SELECT 'renewed', c.renewed_at, 2, pg_visible_in_snapshot(c.renewed_xid, p_seen), c.id
        FROM scoped AS c
        WHERE NOT pg_visible_in_snapshot(c.renewed_xid, p_after)
        UNION ALL
        SELECT 'updated', c.updated_at, 2, pg_visible_in_snapshot(c.updated_xid, p_seen), c.id
        FROM scoped AS c
        WHERE NOT pg_visible_in_snapshot(c.updated_xid, p_after)
        UNION ALL
        SELECT c.release_reason, c.released_at, 3, pg_visible_in_snapshot(c.changed_xid, p_seen), c.id
        FROM scoped AS c
        WHERE c.released_at IS NOT NULL
        UNION ALL
        SELECT 'expired', r.expires_at, 1, r.expires_at <= p_seen_at, r.id
        FROM ran_out AS r
        UNION ALL
        -- A grant or renewal that committed only after its own lease had run out (a commit slower
        -- than the lease): no window read the row before its expiry, so this one reports it.
        SELECT 'expired', c.expires_at, 1,
               pg_visible_in_snapshot(
                   CASE WHEN NOT pg_visible_in_snapshot(c.renewed_xid, p_after)
                        THEN c.renewed_xid ELSE c.acquired_xid END,
                   p_seen
               ),
               c.id
        FROM scoped AS c
        WHERE c.expires_at <= p_after_at
          AND (c.released_at IS NULL OR c.released_at > c.expires_at)
          AND (NOT pg_visible_in_snapshot(c.acquired_xid, p_after)
               OR NOT pg_visible_in_snapshot(c.renewed_xid, p_after))
    ),
    -- The view reads the clock, so it is not merged into a join: it is asked for these ids alone
    -- (joined by id, it would be read whole).
    locks AS (
        SELECT w.* FROM helix_job_lock_views AS w
        WHERE w.id = ANY (ARRAY(SELECT DISTINCT e.id FROM events AS e))
    )
    SELECT e.event, e.at, e.rank, e.seen,
           v.id, v.organization_id, v.job_type, v.holder, v.fencing_token, v.acquired_at,
           v.expires_at, v.released_at, v.release_reason, v.state, v.ttl_remaining_ms, v.metadata,
           c.reclaimed_lock_id, c.reclaimed_holder, c.reclaimed_expired_at
    FROM events AS e
    JOIN locks AS v ON v.id = e.id
    LEFT JOIN scoped AS c ON c.id = e.id AND e.event = 'acquired'
    ORDER BY e.id, e.at, e.rank;
END $$;

REVOKE EXECUTE ON FUNCTION helix_lock_events(
    pg_snapshot, timestamptz, timestamptz, text, text, pg_snapshot, timestamptz
) FROM PUBLIC;
