-- Asking a holder to let go (issue 41, its third part): revocation requests.
--
-- Until now the only way to take a lock from its holder was an admin's force, which gives the
-- holder no chance to stop cleanly. A revocation request asks: it is recorded in the lock
-- (helix_holds.revocation, and with the lock in its history: who asked, why, and by when), the
-- event stream reports it (rank 5 of helix_window_events, in the transaction of revocation_xid),
-- and the holder's next renewal answers it. Nothing is forced: after the deadline an admin may
-- force the release as before.
--
-- A request may name a preferred holder (exclusive locks with max_holders 1): the pair is then
-- reserved for it until the deadline, on the pair's row of helix_lock_keys, which every grant
-- locks and reads first. Its acquire passes the pair's queue, whose waiters keep their places,
-- and anyone else's acquire that would be granted is refused (HL014). The reservation orders
-- honest workers; holder names are not authenticated.
--
-- Rolling upgrade: the previous build calls the same functions with the same arguments, and its
-- statements name the columns they read, so the new ones pass it by. It does not know HL014: its
-- acquire of a reserved pair answers 503 while the reservation lasts (docs/deployment.md), and it
-- has no revocation endpoint; only this build makes requests.

-- Every table this migration alters, locked at once and first, in the order the statements of the
-- previous builds take them (a pair's row before its holds, a hold before its history), so that a
-- replica serving meanwhile waits for the migration rather than deadlocking with it.
LOCK TABLE helix_lock_keys, helix_holds, helix_lock_history IN ACCESS EXCLUSIVE MODE;

ALTER TABLE helix_holds ADD COLUMN revocation jsonb, ADD COLUMN revocation_xid xid8;
COMMENT ON COLUMN helix_holds.revocation IS 'A request that the holder let go (0035): {requested_at, reason, deadline, by, preferred_holder}, the first one only; NULL: none.';
COMMENT ON COLUMN helix_holds.revocation_xid IS 'The transaction that recorded the revocation request: its event''s place in the stream (0035).';
ALTER TABLE helix_lock_history ADD COLUMN revocation jsonb, ADD COLUMN revocation_xid xid8;
COMMENT ON COLUMN helix_lock_history.revocation IS 'As in helix_holds, copied at the end: who asked the holder to let go, and why.';
COMMENT ON COLUMN helix_lock_history.revocation_xid IS 'As in helix_holds, copied at the end.';

ALTER TABLE helix_lock_keys ADD COLUMN reserved_for text, ADD COLUMN reserved_until timestamptz;
COMMENT ON COLUMN helix_lock_keys.reserved_for IS 'The holder a revocation request preferred: until reserved_until, the pair is granted to it alone (0035).';
COMMENT ON COLUMN helix_lock_keys.reserved_until IS 'The end of the reservation for reserved_for: the request''s deadline; cleared by the preferred holder''s grant (0035). NULL, or past: none.';

CREATE FUNCTION helix_request_revocation(p_lock_id bigint, p_organization_id text, p_reason text, p_deadline_ms bigint, p_by text, p_preferred_holder text)
 RETURNS TABLE(id bigint, organization_id text, job_type text, holder text, fencing_token bigint, acquired_at timestamp with time zone, expires_at timestamp with time zone, released_at timestamp with time zone, release_reason text, state text, ttl_remaining_ms bigint, metadata jsonb, max_holders integer, slot integer, session_id bigint, shared boolean, hold_limit_at timestamp with time zone, closed_until timestamp with time zone, revocation jsonb)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
#variable_conflict use_column
DECLARE
    v_lock helix_holds%ROWTYPE;
    v_now timestamptz;
BEGIN
    IF p_reason IS NULL OR length(p_reason) NOT BETWEEN 1 AND 1024 THEN
        RAISE EXCEPTION 'a revocation''s reason has 1 to 1024 characters'
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'reason';
    END IF;
    IF p_deadline_ms IS NULL OR p_deadline_ms NOT BETWEEN 1000 AND 86400000 THEN
        RAISE EXCEPTION 'a revocation''s deadline is 1 s to 1 day away, got % ms', p_deadline_ms
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'deadline_seconds';
    END IF;
    SELECT * INTO v_lock FROM helix_holds AS h
    WHERE h.id = p_lock_id AND (p_organization_id IS NULL OR h.organization_id = p_organization_id);
    IF NOT FOUND THEN
        PERFORM helix_raise_ended(p_lock_id, p_organization_id, NULL, false);  -- HL001 or HL003
    END IF;
    IF p_preferred_holder IS NOT NULL THEN
        IF v_lock.shared OR v_lock.max_holders <> 1 THEN
            RAISE EXCEPTION 'a preferred holder is for exclusive locks with max_holders 1'
                USING ERRCODE = 'invalid_parameter_value', COLUMN = 'preferred_holder';
        END IF;
        -- The pair's row first, as a grant takes it before the holds: the reservation is made
        -- with the request, or not at all.
        PERFORM FROM helix_lock_keys AS k
        WHERE k.organization_id = v_lock.organization_id AND k.job_type = v_lock.job_type
        FOR UPDATE;
    END IF;
    -- The hold's row, waiting out a renewal or an end in flight: the clock is read after every
    -- wait, so that the request comes after what committed before it, in time and in the stream.
    PERFORM FROM helix_holds AS h
    WHERE h.organization_id = v_lock.organization_id AND h.job_type = v_lock.job_type
      AND h.slot = v_lock.slot AND h.id = p_lock_id
    FOR UPDATE;
    v_now := clock_timestamp();
    -- A lock of a session whose lease ran out: its expiry is announced on the session's row, in
    -- this transaction, so the stream sends it before the request (as for a lock alone:
    -- helix_hold_changed). Without waiting: a renewal or an end of the session in flight
    -- announces it otherwise.
    IF v_lock.session_id IS NOT NULL THEN
        UPDATE helix_sessions AS s SET expired_xid = pg_current_xact_id(), changed_xid = pg_current_xact_id()
        WHERE s.id = (
            SELECT s2.id FROM helix_sessions AS s2
            WHERE s2.id = v_lock.session_id AND s2.expired_xid IS NULL AND s2.ended_at IS NULL
              AND s2.expires_at <= v_now
            FOR NO KEY UPDATE SKIP LOCKED
        );
    END IF;
    -- The first request stays as it was: a repeat (or a request racing it) changes nothing.
    UPDATE helix_holds AS h
    SET revocation = jsonb_build_object(
        'requested_at', v_now, 'reason', p_reason, 'deadline', v_now + p_deadline_ms * interval '1 millisecond',
        'by', p_by, 'preferred_holder', p_preferred_holder
    )
    WHERE h.organization_id = v_lock.organization_id AND h.job_type = v_lock.job_type
      AND h.slot = v_lock.slot AND h.id = p_lock_id AND h.revocation IS NULL;
    IF FOUND AND p_preferred_holder IS NOT NULL THEN
        UPDATE helix_lock_keys AS k
        SET reserved_for = p_preferred_holder, reserved_until = v_now + p_deadline_ms * interval '1 millisecond'
        WHERE k.organization_id = v_lock.organization_id AND k.job_type = v_lock.job_type;
    ELSIF NOT FOUND AND NOT EXISTS (SELECT FROM helix_holds AS h WHERE h.id = p_lock_id) THEN
        PERFORM helix_raise_ended(p_lock_id, p_organization_id, NULL, false);  -- it ended meanwhile
    END IF;
    -- The lock as the request left it (this statement sees the update above).
    RETURN QUERY
        SELECT v.*, h.session_id, h.shared, h.hold_limit_at, h.closed_until, h.revocation
        FROM helix_held_locks AS v
        JOIN helix_holds AS h ON h.id = v.id
        WHERE v.id = p_lock_id;
END $function$;
REVOKE EXECUTE ON FUNCTION helix_request_revocation(bigint,text,text,bigint,text,text) FROM PUBLIC;
COMMENT ON FUNCTION helix_request_revocation(bigint,text,text,bigint,text,text) IS 'POST /v1/locks/{id}/revocation (0035): records a request that the holder let go (reason, deadline, by, preferred holder) in a live lock of the organization (any, for NULL), the first request only; with a preferred holder (exclusive, max_holders 1), reserves the pair for it until the deadline. HL001 or HL003 for no such live lock; 22023 naming the field for a bad value. Returns the lock, with its mode, session, hold limit, closing and revocation.';

CREATE OR REPLACE FUNCTION helix_hold_changed()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
DECLARE
    v_xid xid8 := pg_current_xact_id();
BEGIN
    IF TG_OP = 'INSERT' THEN
        NEW.acquired_xid := v_xid;
    ELSIF NEW.session_id IS DISTINCT FROM OLD.session_id AND OLD.acquired_xid = v_xid THEN
        RETURN NEW;
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
        -- it before the update, as a renewal's or an end's. A session's lease: its row
        -- (helix_update_job_lock).
        IF OLD.expired_xid IS NULL AND OLD.expires_at <= NEW.updated_at AND NEW.session_id IS NULL THEN
            NEW.expired_xid := v_xid;
        END IF;
    ELSIF NEW.expired_xid IS DISTINCT FROM OLD.expired_xid THEN
        NULL;  -- an announcement: changed_xid below
    ELSIF NEW.revocation IS DISTINCT FROM OLD.revocation THEN
        NEW.revocation_xid := v_xid;  -- a revocation request (0035)
        -- A request on a lease that ran out announces the expiry, if no one did: the stream sends
        -- it before the request, as an update's. A session's lease: its row
        -- (helix_request_revocation).
        IF OLD.expired_xid IS NULL AND NEW.session_id IS NULL
           AND OLD.expires_at <= (NEW.revocation ->> 'requested_at')::timestamptz THEN
            NEW.expired_xid := v_xid;
        END IF;
    ELSE
        RETURN NEW;  -- no change anyone watches (an idempotent repeat's claim)
    END IF;
    NEW.changed_xid := v_xid;
    RETURN NEW;
END $function$;
REVOKE EXECUTE ON FUNCTION helix_hold_changed() FROM PUBLIC;
COMMENT ON FUNCTION helix_hold_changed() IS 'Records in a hold the transaction (and time) of each change GET /v1/events reports: grant, renewal (with the lapse it ends), update, announced expiry (migrations 0016, 0019, 0023); a hold joining its session in its grant''s transaction is part of the grant (0027); a lock of a session''s lease is its session''s (0028); a revocation request (0035).';

CREATE OR REPLACE FUNCTION helix_end_holds(p_ids bigint[], p_at timestamp with time zone, p_reason text, p_forced_by text, p_token text DEFAULT NULL::text, p_organization_id text DEFAULT NULL::text, p_alone boolean DEFAULT false)
 RETURNS integer
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    v_count integer;
BEGIN
    WITH ended AS (
        -- With a token (a holder's release): only a hold of it, in the organization when one is
        -- given, and without a row lock taken first. A NULL p_at is the clock read as each hold
        -- is deleted, after any wait for a change in flight.
        DELETE FROM helix_holds AS h
        WHERE h.id = ANY (p_ids)
          AND (p_organization_id IS NULL OR h.organization_id = p_organization_id)
          AND (p_token IS NULL OR helix_digest(h.token) = helix_digest(p_token))
          AND (NOT p_alone OR h.session_id IS NULL)
        RETURNING h.*, coalesce(p_at, clock_timestamp()) AS ended_at
    ),
    inserted AS (
        INSERT INTO helix_lock_history (
            id, organization_id, job_type, slot, max_holders, holder, token, metadata,
            fencing_token, acquired_at, expires_at, released_at, release_reason, forced_by,
            idempotency_key, reclaimed_lock_id, reclaimed_holder, reclaimed_expired_at, replayed,
            acquired_xid, renewed_xid, renewed_at, updated_xid, updated_at, changed_xid, lapses,
            expired_xid, lapse_xids, session_id, shared, hold_limit_at, closed_until, revocation,
            revocation_xid
        )
        SELECT e.id, e.organization_id, e.job_type, e.slot, e.max_holders, e.holder, e.token,
               e.metadata, e.fencing_token, e.acquired_at, l.expires_at, e.ended_at, p_reason,
               p_forced_by, e.idempotency_key, e.reclaimed_lock_id, e.reclaimed_holder,
               e.reclaimed_expired_at, e.replayed, e.acquired_xid, l.renewed_xid, l.renewed_at,
               e.updated_xid, e.updated_at, pg_current_xact_id(), l.lapses,
               -- An end after the lease ran out announces the expiry, if no one did.
               CASE WHEN l.expired_xid IS NULL AND l.expires_at <= e.ended_at
                    THEN pg_current_xact_id() ELSE l.expired_xid END,
               l.lapse_xids, e.session_id, e.shared, e.hold_limit_at, e.closed_until, e.revocation,
               e.revocation_xid
        FROM ended AS e
        CROSS JOIN LATERAL helix_hold_lease(
            e.session_id, e.acquired_at, e.expires_at, e.renewed_at, e.renewed_xid, e.lapses,
            e.lapse_xids, e.expired_xid, e.changed_xid
        ) AS l
        ORDER BY e.id
        RETURNING 1
    )
    SELECT count(*)::integer INTO v_count FROM inserted;
    RETURN v_count;
END $function$;
REVOKE EXECUTE ON FUNCTION helix_end_holds(bigint[],timestamp with time zone,text,text,text,text,boolean) FROM PUBLIC;
COMMENT ON FUNCTION helix_end_holds(bigint[],timestamp with time zone,text,text,text,text,boolean) IS 'Ends live locks (release, force, reclaim): deletes their holds and inserts their history rows, with the lease in force (helix_hold_lease: a session''s, 0028) and session_id, dated p_at (NULL: the clock as each is deleted), in one statement; returns how many. Either the caller has locked the holds FOR UPDATE, or it gives the token (and organization) that a hold must have to end. p_alone: locks on their own only. The hold limit (0033), the pair''s closing (0034) and a revocation request (0035) go with the lock into its history.';

CREATE FUNCTION helix_window_events(p_after pg_snapshot, p_until pg_snapshot, p_organization_id text, p_job_type text, p_kinds integer)
 RETURNS TABLE(at timestamp with time zone, id bigint, rank integer)
 LANGUAGE plpgsql
 STABLE SECURITY DEFINER
 SET search_path FROM CURRENT
 SET plan_cache_mode TO 'force_custom_plan'
AS $function$
#variable_conflict use_column
DECLARE
    -- Values, not subqueries, so that the plan knows how few they are.
    v_in_progress bigint[] := ARRAY(SELECT pg_snapshot_xip(p_after)::text::bigint);
    v_from bigint := pg_snapshot_xmax(p_after)::text::bigint;
BEGIN
    RETURN QUERY
    WITH changed AS (
        -- A row's visible version carries the transaction of its latest change, and a lock's
        -- last change is its end, in its history row. The live holds of the organization (its
        -- primary key's range: bounded by its quota) whose latest change p_after does not see;
        -- the history rows whose end p_after does not see, which ended from its xmax on or among
        -- its in-progress transactions: two index scans, however old p_after's xmin is. The
        -- columns the events need, not the metadata.
        -- A lock of a session has its session's lease (0028): its renewals and expiries are
        -- the session row's, which it joins (by its primary key).
        SELECT h.id, h.acquired_at, h.acquired_xid, l.lapses, l.lapse_xids, l.expires_at,
               l.expired_xid, l.renewed_at, l.renewed_xid, h.updated_at, h.updated_xid,
               NULL::timestamptz AS released_at, h.changed_xid,
               (h.revocation ->> 'requested_at')::timestamptz AS revoked_at, h.revocation_xid
        FROM (
            -- The holds that changed, and those whose session's lease changed (the open sessions
            -- of the organization, by the index of open sessions, then their holds by theirs):
            -- the lease is read for them alone.
            SELECT h.* FROM helix_holds AS h
            WHERE (p_organization_id IS NULL OR h.organization_id = p_organization_id)
              AND (p_job_type IS NULL OR h.job_type = p_job_type)
              AND NOT pg_visible_in_snapshot(h.changed_xid, p_after)
            UNION ALL
            SELECT h.* FROM helix_sessions AS s
            JOIN helix_holds AS h ON h.organization_id = s.organization_id AND h.session_id = s.id
            WHERE s.ended_at IS NULL
              AND (p_organization_id IS NULL OR s.organization_id = p_organization_id)
              AND NOT pg_visible_in_snapshot(s.changed_xid, p_after)
              AND (p_job_type IS NULL OR h.job_type = p_job_type)
              AND pg_visible_in_snapshot(h.changed_xid, p_after)  -- not in the branch above
        ) AS h
        CROSS JOIN LATERAL helix_hold_lease(
            h.session_id, h.acquired_at, h.expires_at, h.renewed_at, h.renewed_xid, h.lapses,
            h.lapse_xids, h.expired_xid, h.changed_xid
        ) AS l
        UNION ALL
        SELECT e.id, e.acquired_at, e.acquired_xid, e.lapses, e.lapse_xids, e.expires_at,
               e.expired_xid, e.renewed_at, e.renewed_xid, e.updated_at, e.updated_xid,
               e.released_at, e.changed_xid,
               (e.revocation ->> 'requested_at')::timestamptz, e.revocation_xid
        FROM helix_lock_history AS e
        WHERE e.ended_xid >= v_from
          AND (p_organization_id IS NULL OR e.organization_id = p_organization_id)
          AND (p_job_type IS NULL OR e.job_type = p_job_type)
        UNION ALL
        SELECT e.id, e.acquired_at, e.acquired_xid, e.lapses, e.lapse_xids, e.expires_at,
               e.expired_xid, e.renewed_at, e.renewed_xid, e.updated_at, e.updated_xid,
               e.released_at, e.changed_xid,
               (e.revocation ->> 'requested_at')::timestamptz, e.revocation_xid
        FROM helix_lock_history AS e
        WHERE e.ended_xid = ANY (v_in_progress)
          AND (p_organization_id IS NULL OR e.organization_id = p_organization_id)
          AND (p_job_type IS NULL OR e.job_type = p_job_type)
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
        -- A revocation request (0035): rank 5, after the end's 4, which it never follows.
        SELECT c.revoked_at, c.id, 5, c.revocation_xid FROM changed AS c
        UNION ALL
        -- An end is a lock's last change: its transaction is the history row's changed_xid.
        SELECT c.released_at, c.id, 4, c.changed_xid FROM changed AS c WHERE c.released_at IS NOT NULL
    )
    SELECT e.at, e.id, e.rank FROM events AS e
    WHERE e.xid IS NOT NULL AND e.rank <= p_kinds
      AND NOT pg_visible_in_snapshot(e.xid, p_after)
      AND pg_visible_in_snapshot(e.xid, p_until);
END $function$;
REVOKE EXECUTE ON FUNCTION helix_window_events(pg_snapshot,pg_snapshot,text,text,integer) FROM PUBLIC;
COMMENT ON FUNCTION helix_window_events(pg_snapshot,pg_snapshot,text,text,integer) IS 'GET /v1/events: the changes committed between two snapshots (time, lock id, kind), each in exactly one window of a stream: see migration 0019; read from the holds and the history (0023). p_kinds: the highest kind the caller knows, 5 for a revocation request (0035).';

-- The previous build's reader calls the function without p_kinds, and knows kinds 0 to 4 only: it
-- is given those (a kind it does not know would end its streams).
CREATE OR REPLACE FUNCTION helix_window_events(p_after pg_snapshot, p_until pg_snapshot, p_organization_id text, p_job_type text)
 RETURNS TABLE(at timestamp with time zone, id bigint, rank integer)
 LANGUAGE sql
 STABLE SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
    SELECT * FROM helix_window_events(p_after, p_until, p_organization_id, p_job_type, 4)
$function$;
COMMENT ON FUNCTION helix_window_events(pg_snapshot,pg_snapshot,text,text) IS 'The build before 0035''s GET /v1/events: helix_window_events with the kinds it knows, 0 to 4.';

CREATE OR REPLACE FUNCTION helix_acquire_job_lock(p_organization_id text, p_job_type text, p_holder text, p_ttl_ms bigint, p_metadata jsonb, p_idempotency_key text, p_max_holders integer DEFAULT 1, p_place bigint DEFAULT NULL::bigint, p_mode text DEFAULT 'exclusive'::text, p_max_hold_ms bigint DEFAULT NULL::bigint, p_hold_at_least_ms bigint DEFAULT NULL::bigint)
 RETURNS TABLE(id bigint, organization_id text, job_type text, holder text, fencing_token bigint, acquired_at timestamp with time zone, expires_at timestamp with time zone, released_at timestamp with time zone, release_reason text, state text, ttl_remaining_ms bigint, metadata jsonb, max_holders integer, slot integer, token text, reclaimed_lock_id bigint, reclaimed_holder text, reclaimed_expired_at timestamp with time zone, hold_limit_at timestamp with time zone, closed_until timestamp with time zone)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
#variable_conflict use_column
DECLARE
    v_lease interval := helix_lease(p_ttl_ms);
    v_max_hold interval := helix_max_hold(p_max_hold_ms);  -- NULL: no hold limit
    v_at_least interval := helix_hold_at_least(p_hold_at_least_ms);  -- NULL: the pair stays open (0034)
    v_closed_until timestamptz;  -- the pair's: no grant before it (0034)
    v_reserved_for text;  -- the pair's preferred holder, until v_reserved_until (0035)
    v_reserved_until timestamptz;
    v_preferred boolean := false;  -- this acquire is the preferred holder's, while it is reserved
    v_token text := helix_new_token();
    v_fencing_token bigint;
    v_lock helix_holds%ROWTYPE;
    v_live helix_holds[] := '{}';  -- the pair's live locks, by slot
    v_held integer := 0;
    v_in_force integer;  -- the held locks' max_holders
    v_shared boolean := p_mode = 'shared';
    v_in_force_shared boolean;  -- the held locks' mode: shared or not
    v_room integer;  -- the locks the pair may hold at once in this acquire's mode and max_holders
    v_reclaim bigint[] := '{}';
    v_lapsed bigint[] := '{}';  -- the pair's leases that ran out, unannounced, left to their holders
    v_reclaimed helix_holds%ROWTYPE;  -- the one the answer names
    v_slot integer;
    v_now timestamptz;
    v_id bigint;
    v_sessions boolean := false;  -- a live lock of the pair is a session's
    v_session_expires timestamptz;
    v_session_expired xid8;
    v_i integer;
    v_full boolean;  -- live locks leave this acquire no slot
    v_ahead integer := 0;  -- live places before p_place (any, without one), counted up to the room
    v_waiting integer;  -- live places in the pair's queue, counted for a refusal
    v_other boolean := false;  -- a place counted in v_ahead names another max_holders or mode
    v_first helix_holds%ROWTYPE;  -- of a refusal by the queue of a held pair: the first lease to end
BEGIN
    IF p_max_holders IS NULL OR p_max_holders < 1 OR p_max_holders > 1000 THEN
        RAISE EXCEPTION 'max_holders must be between 1 and 1000, got %', p_max_holders
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'max_holders';
    END IF;
    IF p_mode IS NULL OR p_mode NOT IN ('exclusive', 'shared') THEN
        RAISE EXCEPTION 'mode must be exclusive or shared, got %', p_mode
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'mode';
    END IF;
    -- Shared locks are held together, each of its own, up to 1000 (0030); a semaphore's locks are
    -- exclusive, one per slot.
    IF v_shared AND p_max_holders <> 1 THEN
        RAISE EXCEPTION 'a shared lock has max_holders 1, got %', p_max_holders
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'max_holders';
    END IF;
    v_room := CASE WHEN v_shared THEN 1000 ELSE p_max_holders END;
    -- A pair closes for one holder at a time: of a plain exclusive lock only (0034).
    IF v_at_least IS NOT NULL AND (v_shared OR p_max_holders <> 1) THEN
        RAISE EXCEPTION 'hold_at_least is for exclusive locks with max_holders 1'
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'hold_at_least_seconds';
    END IF;

    -- A repeat of a grant that is still live answers as the first time did, and claims it.
    IF p_idempotency_key IS NOT NULL THEN
        v_id := helix_claim_replay(p_organization_id, p_job_type, p_holder, p_idempotency_key);
    END IF;

    IF v_id IS NULL THEN
        -- The pair's row lock serialises every grant for the pair until commit, so fencing
        -- tokens increase in commit order across slots. A conflict below rolls it back. An
        -- UPDATE first: the INSERT is for a pair's first grant only.
        UPDATE helix_lock_keys AS k SET last_fencing_token = k.last_fencing_token + 1
        WHERE k.organization_id = p_organization_id AND k.job_type = p_job_type
        RETURNING k.last_fencing_token, k.closed_until, k.reserved_for, k.reserved_until
            INTO v_fencing_token, v_closed_until, v_reserved_for, v_reserved_until;
        IF NOT FOUND THEN
            INSERT INTO helix_lock_keys AS k (organization_id, job_type, last_fencing_token)
            VALUES (p_organization_id, p_job_type, 1)
            ON CONFLICT (organization_id, job_type)
                DO UPDATE SET last_fencing_token = k.last_fencing_token + 1
            RETURNING k.last_fencing_token, k.closed_until, k.reserved_for, k.reserved_until
            INTO v_fencing_token, v_closed_until, v_reserved_for, v_reserved_until;
        END IF;

        -- FOR UPDATE waits out a renewal or end in flight and then sees its outcome.
        FOR v_lock IN
            SELECT * FROM helix_holds AS h
            WHERE h.organization_id = p_organization_id AND h.job_type = p_job_type
            ORDER BY h.slot
            FOR UPDATE
        LOOP
            v_live := v_live || v_lock;
            v_sessions := v_sessions OR v_lock.session_id IS NOT NULL;
        END LOOP;

        -- The clock is read after every wait: any end seen above committed before this moment,
        -- so a grant never starts before its predecessor ended.
        v_now := clock_timestamp();

        -- A lock of a session has the session's lease (0028). One that ran out is judged with the
        -- session's row locked, so that a renewal of the session after this grant finds the lock
        -- lost; taken without waiting (these holds are locked, and a session's row comes before
        -- its holds in the order of locks). A row locked by a renewal or an end of the session in
        -- flight: the lock is held for now, and the 409 says to try again in a second.
        IF v_sessions THEN
            FOR v_i IN 1 .. cardinality(v_live) LOOP
                v_lock := v_live[v_i];
                CONTINUE WHEN v_lock.session_id IS NULL;
                SELECT s.expires_at, s.expired_xid INTO v_session_expires, v_session_expired
                FROM helix_sessions AS s WHERE s.id = v_lock.session_id;
                CONTINUE WHEN NOT FOUND;
                IF v_session_expires <= v_now THEN
                    SELECT s.expires_at, s.expired_xid INTO v_session_expires, v_session_expired
                    FROM helix_sessions AS s WHERE s.id = v_lock.session_id
                    FOR NO KEY UPDATE SKIP LOCKED;
                    IF NOT FOUND THEN
                        v_session_expires := v_now + interval '1 millisecond';
                        v_session_expired := NULL;
                    END IF;
                END IF;
                v_lock.expires_at := v_session_expires;
                v_lock.expired_xid := v_session_expired;
                v_live[v_i] := v_lock;
            END LOOP;
        END IF;

        FOREACH v_lock IN ARRAY v_live LOOP
            IF v_lock.expires_at > v_now THEN
                v_held := v_held + 1;
                v_in_force := v_lock.max_holders;
                v_in_force_shared := v_lock.shared;
                IF p_idempotency_key IS NOT NULL
                   AND v_lock.idempotency_key = p_idempotency_key
                   AND v_lock.holder = p_holder THEN
                    v_id := v_lock.id;  -- the original committed while this repeat waited (0010)
                END IF;
            ELSIF v_lock.max_holders <> p_max_holders OR v_lock.shared <> v_shared OR v_shared THEN
                -- Expired, of another value or mode: always reclaimed (no live lock of another
                -- mode may stay beside the grant: helix_holds_modes_apart). A reader's grant
                -- reclaims every expired lock of the pair, readers' too (0032), as the next
                -- acquire of a plain lock does: dead readers do not pile up, each a live lock
                -- against the quota, until a writer comes or the 1000 slots are taken.
                v_reclaim := v_reclaim || v_lock.id;
                IF v_reclaimed.id IS NULL OR v_lock.expires_at < v_reclaimed.expires_at THEN
                    v_reclaimed := v_lock;
                END IF;
            END IF;
        END LOOP;

        -- A closed pair (0034) grants nobody before closed_until, whatever became of the lock
        -- that closed it: HL013, before any other refusal, since nothing else can open it sooner.
        -- A repeat of a live grant is answered as before.
        IF v_id IS NULL AND v_closed_until > v_now THEN
            RAISE EXCEPTION '% / % is closed until %', p_organization_id, p_job_type, v_closed_until
                USING ERRCODE = 'HL013',
                      DETAIL = json_build_object(
                          'closed_until', v_closed_until,
                          'closed_ms', ceil(extract(epoch FROM v_closed_until - v_now) * 1000)::bigint,
                          'retry_after_seconds', greatest(1, ceil(extract(epoch FROM v_closed_until - v_now))),
                          'job_type', p_job_type
                      )::text;
        END IF;

        -- A pair reserved for a preferred holder (0035): its acquire passes the queue, whose
        -- waiters keep their places; anyone else's that would be granted is refused (HL014).
        v_preferred := coalesce(v_reserved_until > v_now AND p_holder = v_reserved_for, false);

        v_full := v_held > 0 AND (
            v_held >= v_room OR v_in_force <> p_max_holders OR v_in_force_shared <> v_shared
        );
        -- The pair's queue (0029), read under the pair's row lock, so that grants and the places
        -- they consume are judged one after the other: the live places before the caller's, as
        -- many as there are free slots at most (one when none is free). An index probe when nobody
        -- waits, and none read at all for the first place.
        IF v_id IS NULL AND NOT v_preferred AND EXISTS (
            SELECT FROM helix_lock_waiters AS w
            WHERE w.organization_id = p_organization_id AND w.job_type = p_job_type
              AND w.replica IS NOT NULL
        ) THEN
            -- A place of another mode ahead goes first too: a shared acquire does not pass a
            -- waiting exclusive one (writers first), nor the other way round.
            SELECT count(*),
                   coalesce(bool_or(q.max_holders <> p_max_holders OR coalesce(q.shared, false) <> v_shared), false)
            INTO v_ahead, v_other
            FROM helix_live_places(
                p_organization_id, p_job_type, p_place,
                CASE WHEN v_full THEN 1 ELSE v_room - v_held END
            ) AS q;
        END IF;

        IF v_id IS NOT NULL THEN
            UPDATE helix_lock_keys AS k
            SET last_fencing_token = k.last_fencing_token - 1
            WHERE k.organization_id = p_organization_id AND k.job_type = p_job_type;
            UPDATE helix_holds AS h SET replayed = true WHERE h.id = v_id;
        ELSIF v_full AND (p_place IS NOT NULL OR v_ahead = 0 OR v_in_force <> p_max_holders) THEN
            -- A waiter in the queue is told of the holder, whose lease it sleeps on; another
            -- max_holders than the one in force is refused as such, never waited for.
            PERFORM helix_raise_held(v_live, v_now, p_max_holders);
        ELSIF v_ahead > 0 AND (v_full OR v_other OR v_ahead >= v_room - v_held) THEN
            -- Places before this acquire's (any, for an acquire that does not wait) take the
            -- slots there are, and a place before it that names another max_holders goes first
            -- whatever the slots: it does not jump the queue. Of a held pair, the refusal names
            -- the lease that ends first, as lock-held does, and counts down to it.
            SELECT count(*) INTO v_waiting  -- the others: a waiter's own place does not come first
            FROM helix_live_places(p_organization_id, p_job_type) AS q
            WHERE p_place IS NULL OR q.seq <> p_place;
            IF v_full THEN
                SELECT * INTO v_first FROM unnest(v_live) AS u
                WHERE u.expires_at > v_now
                ORDER BY u.expires_at, u.slot
                LIMIT 1;
            END IF;
            RAISE EXCEPTION 'places are waiting for % / %', p_organization_id, p_job_type
                USING ERRCODE = 'unique_violation',
                      CONSTRAINT = 'helix_lock_waiters_pkey',
                      DETAIL = json_build_object(
                          'waiting', v_waiting, 'ahead', v_ahead,
                          'lock_id', v_first.id, 'holder', v_first.holder, 'expires_at', v_first.expires_at,
                          -- The held locks' mode, as lock-held's (0032).
                          'mode', CASE WHEN v_first.id IS NULL THEN NULL
                                       WHEN v_first.shared THEN 'shared' ELSE 'exclusive' END,
                          'retry_after_seconds', CASE
                              WHEN v_first.id IS NULL THEN 1
                              ELSE greatest(1, ceil(extract(epoch FROM v_first.expires_at - v_now)))
                          END
                      )::text;
        ELSIF coalesce(v_reserved_until > v_now, false) AND NOT v_preferred THEN
            RAISE EXCEPTION '% / % is reserved for % until %', p_organization_id, p_job_type, v_reserved_for,
                    v_reserved_until
                USING ERRCODE = 'HL014',
                      DETAIL = json_build_object(
                          'preferred_holder', v_reserved_for,
                          'deadline', v_reserved_until,
                          'reserved_ms', ceil(extract(epoch FROM v_reserved_until - v_now) * 1000)::bigint,
                          'retry_after_seconds', greatest(1, ceil(extract(epoch FROM v_reserved_until - v_now))),
                          'job_type', p_job_type
                      )::text;
        ELSE
            -- The lowest slot that no live lock of this value holds; else the slot of the lock
            -- that expired first, reclaimed.
            IF cardinality(v_live) = 0 THEN
                v_slot := 0;  -- the common case: no statement
            ELSE
                SELECT s INTO v_slot
                FROM generate_series(0, v_room - 1) AS s
                WHERE s NOT IN (SELECT h.slot FROM unnest(v_live) AS h WHERE h.id <> ALL (v_reclaim))
                ORDER BY s
                LIMIT 1;
            END IF;
            IF v_slot IS NULL THEN
                SELECT * INTO v_reclaimed
                FROM unnest(v_live) AS h
                WHERE h.expires_at <= v_now
                ORDER BY h.expires_at, h.slot
                LIMIT 1;
                v_reclaim := v_reclaim || v_reclaimed.id;
                v_slot := v_reclaimed.slot;
            END IF;
            IF cardinality(v_reclaim) > 0 THEN
                PERFORM helix_end_holds(v_reclaim, v_now, 'reclaimed', NULL);
            END IF;
            -- The pair's other leases that ran out, which this grant leaves to their holders (it
            -- took a free slot): announced here, under the row locks taken above, so that every
            -- stream sends each expiry before this grant, live or resumed (0019, 0022).
            IF cardinality(v_live) > cardinality(v_reclaim) THEN
                v_lapsed := ARRAY(
                    SELECT h.id FROM unnest(v_live) AS h
                    WHERE h.expires_at <= v_now AND h.expired_xid IS NULL AND h.id <> ALL (v_reclaim)
                );
            END IF;
            IF cardinality(v_lapsed) > 0 THEN  -- rarely: no statement otherwise
                UPDATE helix_holds AS h SET expired_xid = pg_current_xact_id()
                WHERE h.organization_id = p_organization_id AND h.job_type = p_job_type
                  AND h.id = ANY (v_lapsed) AND h.session_id IS NULL;
                -- A session's expiry, on its row (locked above).
                UPDATE helix_sessions AS s
                SET expired_xid = pg_current_xact_id(), changed_xid = pg_current_xact_id()
                WHERE s.id IN (SELECT h.session_id FROM unnest(v_live) AS h WHERE h.id = ANY (v_lapsed))
                  AND s.expired_xid IS NULL;
            END IF;
            IF v_preferred THEN  -- the reservation is used up by its grant (0035)
                UPDATE helix_lock_keys AS k SET reserved_for = NULL, reserved_until = NULL
                WHERE k.organization_id = p_organization_id AND k.job_type = p_job_type;
            END IF;
            IF v_at_least IS NOT NULL THEN  -- the pair closes until closed_until (0034)
                UPDATE helix_lock_keys AS k SET closed_until = v_now + v_at_least
                WHERE k.organization_id = p_organization_id AND k.job_type = p_job_type;
            END IF;
            INSERT INTO helix_holds (
                organization_id, job_type, holder, token, metadata, fencing_token, acquired_at,
                expires_at, idempotency_key, reclaimed_lock_id, reclaimed_holder, reclaimed_expired_at,
                max_holders, slot, shared, hold_limit_at, closed_until
            )
            VALUES (
                p_organization_id, p_job_type, p_holder, v_token, p_metadata, v_fencing_token,
                -- The first lease ends at the hold limit at the latest (0033).
                v_now, v_now + least(v_lease, coalesce(v_max_hold, v_lease)), p_idempotency_key,
                v_reclaimed.id, v_reclaimed.holder, v_reclaimed.expires_at, p_max_holders, v_slot,
                v_shared, v_now + v_max_hold, v_now + v_at_least
            )
            RETURNING id INTO v_id;
        END IF;
    END IF;

    -- A waiter's place is consumed by its grant (or by the repeat of its grant); p_place is its
    -- order number (a session's places in other pairs go with those pairs' grants).
    IF p_place IS NOT NULL THEN
        DELETE FROM helix_lock_waiters AS w
        WHERE w.organization_id = p_organization_id AND w.job_type = p_job_type AND w.seq = p_place;
    END IF;

    RETURN QUERY
        SELECT v.*, h.token, h.reclaimed_lock_id, h.reclaimed_holder, h.reclaimed_expired_at,
               h.hold_limit_at, h.closed_until
        FROM helix_held_locks AS v
        JOIN helix_holds AS h ON h.id = v.id
        WHERE v.id = v_id;
END $function$;
REVOKE EXECUTE ON FUNCTION helix_acquire_job_lock(text,text,text,bigint,jsonb,text,integer,bigint,text,bigint,bigint) FROM PUBLIC;
COMMENT ON FUNCTION helix_acquire_job_lock(text,text,text,bigint,jsonb,text,integer,bigint,text,bigint,bigint) IS 'Grants a free slot of the pair, reclaiming expired locks and announcing the expiries of the others it leaves (0022), in one statement; or raises 23505 whose DETAIL names the lock whose lease runs out first and lists at most 20 holders, those whose leases run out first, with holders_total (0021): an answer bounded whatever max_holders. A lock of a session with the session''s lease, judged with the session''s row locked when it ran out (0028). Live places of the pair''s queue before p_place (every one, without p_place) take the free slots first: 23505 with DETAIL waiting and ahead (0029); a grant consumes its place. p_mode (0030): exclusive, or shared (max_holders 1, up to 1000 held together); a pair''s locks share one mode, and a place of the other mode ahead goes first. A reader''s grant reclaims every expired lock of the pair (0032). p_max_hold_ms: the hold limit, hold_limit_at = acquired_at + that, which no lease passes; NULL for none (0033). p_hold_at_least_ms: closes the pair until closed_until = acquired_at + that, before which no grant of it is made (HL013, with closed_until, closed_ms and retry_after_seconds in DETAIL); the answer has the lock''s hold_limit_at and closed_until (0034). A pair reserved for a preferred holder (a revocation request''s, until its deadline) is granted to it alone, past the queue; anyone else''s grant is refused with HL014 (0035).';
