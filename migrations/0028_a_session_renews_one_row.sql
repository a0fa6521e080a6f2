-- A session's renewal writes one row, whatever its number of locks (issue 38).
--
-- Until now a session's renewal row-locked and rewrote every hold of the session: 100 locks cost
-- a hundred renewals' WAL. From here on the lease of a session's locks is the session's row:
-- - a lock of a session keeps in its hold the expiry it was granted with, and nothing renews it
--   there; its lease is the session's expires_at, and the history of that lease (its renewals,
--   lapses and announced expiry, which GET /v1/events reports for each of the session's locks)
--   is in the session's row, from the lock's grant on (helix_hold_lease says what each reader
--   takes). Its end copies that lease into the lock's history row, as a lock on its own's end
--   copies its own;
-- - a session's renewal updates its row alone (a HOT update: nothing it changes is indexed);
-- - whoever reads a lock's lease reads the session's for a lock of a session: the views, the
--   acquire that may reclaim it, the fencing check, the sweep that announces expiries, the end.
--
-- The order of locks (0027) stays: a session's row first, then holds. The renewal no longer
-- locks the holds, so what it must not miss takes the session's row:
-- - an acquire that finds a lock of a session whose lease ran out locks the session's row before
--   it reclaims the lock (or announces its expiry), without waiting (SKIP LOCKED: it holds the
--   pair's holds, and waiting for a row that comes first in the order could deadlock). A row it
--   cannot lock is a renewal or an end of that session in flight: the lock counts as held for
--   now, and the 409 says to try again in a second. The renewal that comes after the reclaim
--   waits for it and finds the lock lost, as before;
-- - a holder's release of one lock of a session, an admin's force and an update (PATCH) take the
--   session's row FOR NO KEY UPDATE, then the hold (helix_lock_session_and_hold: a busy hold is
--   waited for holding nothing, so that the renewal never waits for a writer's fencing check).
--   The lease they copy into the history is the one in force, and the sweep and acquires pass the
--   row by meanwhile, so a lapse is announced once: by the end itself, or in the update's
--   transaction (judged by the update's own clock), as an update of a lock alone does on its hold;
-- - locks of sessions granted before this migration keep the lapses and expiries announced for
--   them one by one (0027 announced holds one at a time), which helix_hold_lease reads first.

-- Everything this migration changes, locked at once and first, in the order the statements of the
-- previous builds take them (a session's row before its holds; a view before its tables), so that
-- a replica serving meanwhile waits for the migration rather than deadlocking with it.
LOCK TABLE helix_sessions, helix_job_locks, helix_held_locks IN ACCESS EXCLUSIVE MODE;

ALTER TABLE helix_sessions
    ADD COLUMN renewed_xid xid8,
    ADD COLUMN lapses timestamptz[],
    ADD COLUMN lapse_xids xid8[],
    ADD COLUMN expired_xid xid8,
    ADD COLUMN changed_xid xid8;
COMMENT ON COLUMN helix_sessions.expires_at IS 'When its lease runs out, the lease of every one of its locks (helix_hold_lease, migration 0028).';
COMMENT ON COLUMN helix_sessions.renewed_at IS 'The latest renewal, by the clock its lease counts from; NULL: never renewed.';
COMMENT ON COLUMN helix_sessions.renewed_xid IS 'The latest renewal''s transaction: a renewed event of each lock of the session granted before it (GET /v1/events).';
COMMENT ON COLUMN helix_sessions.lapses IS 'When each earlier lease of the session ran out before a renewal took it up again, oldest first: the lapses of each of its locks granted before them.';
COMMENT ON COLUMN helix_sessions.lapse_xids IS 'Beside lapses, the transaction that announced each of those expiries.';
COMMENT ON COLUMN helix_sessions.expired_xid IS 'The transaction that announced that the current lease ran out (the sweep, an acquire, an update or an end of one of its locks); NULL: not announced.';
COMMENT ON COLUMN helix_sessions.changed_xid IS 'The transaction of the latest change of its lease that GET /v1/events reports for its locks (renewal, announced expiry).';
COMMENT ON COLUMN helix_holds.expires_at IS 'When the current lease runs out; from then on a grant may reclaim the lock. For a lock of a session: the expiry it was granted with; its lease is the session''s (helix_hold_lease, migration 0028).';

-- The sessions open now: their last renewal's transaction, which every hold the renewal renewed
-- carries (each reader keeps it for the locks granted before it). Lapses and announced expiries
-- stay in each hold, as they were announced lock by lock (helix_hold_lease reads them there).
UPDATE helix_sessions AS s
SET renewed_xid = h.renewed_xid
FROM (
    SELECT DISTINCT ON (h.session_id) h.session_id, h.renewed_xid
    FROM helix_holds AS h
    WHERE h.session_id IS NOT NULL
    ORDER BY h.session_id, h.acquired_at
) AS h
WHERE s.id = h.session_id;

-- A lock's lease as every reader takes it: a lock on its own, its hold's columns; a lock of a
-- session, its session's, from its grant on (a renewal or lapse of the session before the grant
-- is not the lock's). A hold's own lapses, and its own announced expiry while the session's lease
-- is still the one it had, come first: a lock of a session granted before this migration had
-- them announced lock by lock, each in its own transaction, and keeps them. changed_xid: the
-- latest change of the lease that GET /v1/events reports.
CREATE FUNCTION helix_hold_lease(
    p_session_id bigint, p_acquired_at timestamptz, p_expires_at timestamptz, p_renewed_at timestamptz,
    p_renewed_xid xid8, p_lapses timestamptz[], p_lapse_xids xid8[], p_expired_xid xid8, p_changed_xid xid8
)
 RETURNS TABLE (
    expires_at timestamptz, renewed_at timestamptz, renewed_xid xid8, lapses timestamptz[],
    lapse_xids xid8[], expired_xid xid8, changed_xid xid8
 )
 LANGUAGE sql
 STABLE
AS $function$
    -- A session's row missing (never while one of its locks is live): the hold's own columns.
    SELECT coalesce(s.expires_at, p_expires_at),
           CASE WHEN s.id IS NULL THEN p_renewed_at WHEN s.renewed_at > p_acquired_at THEN s.renewed_at END,
           CASE WHEN s.id IS NULL THEN p_renewed_xid WHEN s.renewed_at > p_acquired_at THEN s.renewed_xid END,
           CASE WHEN s.id IS NULL THEN p_lapses
                ELSE p_lapses || (SELECT array_agg(l.at ORDER BY l.n)
                                  FROM unnest(s.lapses, s.lapse_xids) WITH ORDINALITY AS l (at, xid, n)
                                  WHERE l.at > p_acquired_at) END,
           CASE WHEN s.id IS NULL THEN p_lapse_xids
                ELSE p_lapse_xids || (SELECT array_agg(CASE WHEN l.at = p_expires_at AND p_expired_xid IS NOT NULL
                                                            THEN p_expired_xid ELSE l.xid END ORDER BY l.n)
                                      FROM unnest(s.lapses, s.lapse_xids) WITH ORDINALITY AS l (at, xid, n)
                                      WHERE l.at > p_acquired_at) END,
           CASE WHEN s.id IS NULL THEN p_expired_xid
                WHEN s.expires_at = p_expires_at AND p_expired_xid IS NOT NULL THEN p_expired_xid
                ELSE s.expired_xid END,
           CASE WHEN s.id IS NULL THEN p_changed_xid ELSE s.changed_xid END
    FROM (SELECT) AS one
    LEFT JOIN LATERAL (
        SELECT * FROM helix_sessions AS s WHERE p_session_id IS NOT NULL AND s.id = p_session_id
    ) AS s ON true
$function$;
REVOKE EXECUTE ON FUNCTION helix_hold_lease(bigint,timestamptz,timestamptz,timestamptz,xid8,timestamptz[],xid8[],xid8,xid8) FROM PUBLIC;
COMMENT ON FUNCTION helix_hold_lease(bigint,timestamptz,timestamptz,timestamptz,xid8,timestamptz[],xid8[],xid8,xid8) IS 'A lock''s lease from its hold''s columns: its own for a lock on its own, its session''s from its grant on for a lock of a session (migration 0028). One row.';

-- The live locks as the API shows them: a lock of a session expires with it. Its session's row is
-- read by its primary key, for such a lock alone (a join would be free to read every session).
CREATE OR REPLACE VIEW helix_held_locks AS
SELECT h.id, h.organization_id, h.job_type, h.holder, h.fencing_token, h.acquired_at,
       l.expires_at, NULL::timestamptz AS released_at, NULL::text AS release_reason,
       CASE WHEN l.expires_at <= clock_timestamp() THEN 'expired' ELSE 'held' END AS state,
       greatest(0::numeric, floor(extract(epoch FROM l.expires_at - clock_timestamp()) * 1000))::bigint
           AS ttl_remaining_ms,
       h.metadata, h.max_holders, h.slot
FROM helix_holds AS h
CROSS JOIN LATERAL (
    SELECT CASE WHEN h.session_id IS NULL THEN h.expires_at
                ELSE coalesce((SELECT s.expires_at FROM helix_sessions AS s WHERE s.id = h.session_id), h.expires_at)
           END AS expires_at
) AS l;
COMMENT ON VIEW helix_held_locks IS 'The live locks as the API shows them: state and ttl_remaining_ms by the database clock, a lock of a session with the session''s lease (0028).';

-- The history row takes the lease in force (its session's, for a lock of a session). p_alone: only
-- a lock on its own ends, so that a holder's release ends one in one statement, as before, and
-- leaves a lock of a session to the path that takes the session's row first
-- (helix_release_job_lock).
DROP FUNCTION helix_end_holds(bigint[],timestamp with time zone,text,text,text,text);
CREATE FUNCTION helix_end_holds(p_ids bigint[], p_at timestamp with time zone, p_reason text, p_forced_by text, p_token text DEFAULT NULL::text, p_organization_id text DEFAULT NULL::text, p_alone boolean DEFAULT false)
 RETURNS integer
 LANGUAGE plpgsql
 SET plan_cache_mode = force_generic_plan
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
            expired_xid, lapse_xids, session_id
        )
        SELECT e.id, e.organization_id, e.job_type, e.slot, e.max_holders, e.holder, e.token,
               e.metadata, e.fencing_token, e.acquired_at, l.expires_at, e.ended_at, p_reason,
               p_forced_by, e.idempotency_key, e.reclaimed_lock_id, e.reclaimed_holder,
               e.reclaimed_expired_at, e.replayed, e.acquired_xid, l.renewed_xid, l.renewed_at,
               e.updated_xid, e.updated_at, pg_current_xact_id(), l.lapses,
               -- An end after the lease ran out announces the expiry, if no one did.
               CASE WHEN l.expired_xid IS NULL AND l.expires_at <= e.ended_at
                    THEN pg_current_xact_id() ELSE l.expired_xid END,
               l.lapse_xids, e.session_id
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
COMMENT ON FUNCTION helix_end_holds(bigint[],timestamp with time zone,text,text,text,text,boolean) IS 'Ends live locks (release, force, reclaim): deletes their holds and inserts their history rows, with the lease in force (helix_hold_lease: a session''s, 0028) and session_id, dated p_at (NULL: the clock as each is deleted), in one statement; returns how many. Either the caller has locked the holds FOR UPDATE, or it gives the token (and organization) that a hold must have to end. p_alone: locks on their own only.';

-- A change of a hold: a lock of a session has no lease of its own to renew or announce (0028).
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
    ELSE
        RETURN NEW;  -- no change anyone watches (an idempotent repeat's claim)
    END IF;
    NEW.changed_xid := v_xid;
    RETURN NEW;
END $function$;
COMMENT ON FUNCTION helix_hold_changed() IS 'Records in a hold the transaction (and time) of each change GET /v1/events reports: grant, renewal (with the lapse it ends), update, announced expiry (migrations 0016, 0019, 0023); a hold joining its session in its grant''s transaction is part of the grant (0027); a lock of a session''s lease is its session''s (0028).';

-- A session's renewal: its row alone.
CREATE OR REPLACE FUNCTION helix_renew_session(
    p_session_id bigint, p_token text, p_ttl_ms bigint, p_organization_id text, p_sessions_limit integer
)
 RETURNS SETOF helix_session_answer
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
 SET plan_cache_mode = force_generic_plan
AS $function$
DECLARE
    v_lease interval := helix_lease(p_ttl_ms);
    v_session helix_sessions%ROWTYPE := helix_session_for_holder(p_session_id, p_token, p_organization_id);
    v_now timestamptz := clock_timestamp();  -- under the session's row lock
    v_xid xid8 := pg_current_xact_id();
    v_lapsed boolean;
BEGIN
    -- An acquire that reclaimed a lock of it, or a force, committed before the row lock above
    -- was granted (each takes the row first): the history shows it.
    IF helix_session_lost(v_session) THEN
        PERFORM helix_end_session(v_session, v_now, 'lost');
        RETURN QUERY SELECT * FROM helix_session_answer(p_session_id, p_organization_id, false, false);
        RETURN;
    END IF;
    v_lapsed := v_session.expires_at <= v_now;
    IF v_lapsed THEN
        PERFORM helix_session_count_lock(v_session, p_sessions_limit);
    END IF;
    -- A HOT update: nothing it changes is indexed. A lease that ran out (announced or not) is a
    -- lapse of every lock of the session, as a lock's renewal records its own.
    UPDATE helix_sessions AS s
    SET expires_at = v_now + v_lease, renewed_at = v_now, renewed_xid = v_xid, changed_xid = v_xid,
        lapses = CASE WHEN v_lapsed OR s.expired_xid IS NOT NULL
                      THEN array_append(s.lapses, s.expires_at) ELSE s.lapses END,
        lapse_xids = CASE WHEN v_lapsed OR s.expired_xid IS NOT NULL
                          THEN array_append(s.lapse_xids, coalesce(s.expired_xid, v_xid)) ELSE s.lapse_xids END,
        expired_xid = NULL
    WHERE s.id = p_session_id;
    RETURN QUERY SELECT * FROM helix_session_answer(p_session_id, p_organization_id, v_lapsed, false);
END $function$;
COMMENT ON FUNCTION helix_renew_session(bigint,text,bigint,text,integer) IS 'POST /v1/sessions/{id}/renew: a new lease for the session, and so for each of its locks, by an update of its row alone (0028); lapsed: it had run out, and it counts against the bound on open sessions again (HL009). A session that lost a lock ends instead, its other locks released (session_state ended, end_reason lost).';

-- A session's lease made shorter wakes the waiters of its locks' pairs, as a lock's does.
CREATE FUNCTION helix_session_lease_shortened()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    PERFORM pg_notify('helix_lock_released', h.organization_id || '/' || h.job_type)
    FROM helix_holds AS h
    WHERE h.organization_id = NEW.organization_id AND h.session_id = NEW.id
      AND EXISTS (
          SELECT 1 FROM helix_lock_waiters AS w
          WHERE w.organization_id = h.organization_id AND w.job_type = h.job_type
            AND w.until > clock_timestamp()
      );
    RETURN NULL;
END $function$;
REVOKE EXECUTE ON FUNCTION helix_session_lease_shortened() FROM PUBLIC;
COMMENT ON FUNCTION helix_session_lease_shortened() IS 'Trigger on a session''s lease made shorter: a NOTIFY on helix_lock_released for each pair of its locks that an acquire waits for, as helix_lock_released does for a lock''s (migration 0028).';
CREATE TRIGGER helix_session_lease_shortened AFTER UPDATE OF expires_at ON helix_sessions
    FOR EACH ROW WHEN (NEW.expires_at < OLD.expires_at) EXECUTE FUNCTION helix_session_lease_shortened();

-- The sweep announces a session's expiry once, on its row, for all its locks.
CREATE OR REPLACE FUNCTION helix_announce_expiries(p_limit integer)
 RETURNS integer
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
DECLARE
    -- A value, not clock_timestamp() in the WHERE clause.
    v_now timestamptz := clock_timestamp();
    v_announced integer;
    v_sessions integer;
BEGIN
    -- One reader at a time, at most once a second: finding the due ones reads every live hold.
    IF NOT pg_try_advisory_xact_lock(hashtext('helix_announce_expiries')) THEN
        RETURN 0;
    END IF;
    UPDATE helix_expiry_sweep AS s SET swept_at = v_now WHERE s.swept_at <= v_now - interval '1 second';
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    WITH due AS (
        SELECT h.organization_id, h.job_type, h.slot FROM helix_holds AS h
        WHERE h.expired_xid IS NULL AND h.expires_at <= v_now AND h.session_id IS NULL
        ORDER BY h.expires_at
        LIMIT p_limit
        FOR NO KEY UPDATE SKIP LOCKED
    )
    UPDATE helix_holds AS h SET expired_xid = pg_current_xact_id()
    FROM due
    WHERE (h.organization_id, h.job_type, h.slot) = (due.organization_id, due.job_type, due.slot);
    GET DIAGNOSTICS v_announced = ROW_COUNT;
    -- The sessions with locks whose lease ran out, found from their holds (not every session
    -- retention keeps); one a renewal or an end holds is passed by, as a hold is.
    WITH due AS (
        SELECT s.id FROM helix_sessions AS s
        WHERE s.id IN (SELECT h.session_id FROM helix_holds AS h WHERE h.session_id IS NOT NULL)
          AND s.expired_xid IS NULL AND s.expires_at <= v_now AND s.ended_at IS NULL
        ORDER BY s.expires_at
        LIMIT p_limit
        FOR NO KEY UPDATE SKIP LOCKED
    )
    UPDATE helix_sessions AS s SET expired_xid = pg_current_xact_id(), changed_xid = pg_current_xact_id()
    FROM due
    WHERE s.id = due.id;
    GET DIAGNOSTICS v_sessions = ROW_COUNT;
    IF v_announced >= p_limit OR v_sessions >= p_limit THEN  -- more may be due: the next poll sweeps again
        UPDATE helix_expiry_sweep AS s SET swept_at = '-infinity';
    END IF;
    RETURN v_announced + v_sessions;
END $function$;
COMMENT ON FUNCTION helix_announce_expiries(integer) IS 'GET /v1/events: marks at most p_limit due expiries of locks on their own, and of p_limit sessions with locks (on the session''s row, for all of them: 0028), as announced by this transaction, passing by the rows another transaction has locked; one reader at a time, at most once a second (helix_expiry_sweep), so an expiry''s event comes up to a second after it (migration 0023). Returns how many rows it marked.';

CREATE OR REPLACE FUNCTION helix_fencing_token_is_current(p_organization_id text, p_job_type text, p_fencing_token bigint)
 RETURNS boolean
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
BEGIN
    PERFORM 1
    FROM helix_holds AS h
    LEFT JOIN helix_sessions AS s ON s.id = h.session_id
    WHERE h.organization_id = p_organization_id
      AND h.job_type = p_job_type
      AND coalesce(s.expires_at, h.expires_at) > clock_timestamp()
      AND h.fencing_token = p_fencing_token
    FOR KEY SHARE OF h;
    RETURN FOUND;
END $function$;
COMMENT ON FUNCTION helix_fencing_token_is_current(text,text,bigint) IS 'Whether a held lock of the pair (its lease, or its session''s, not run out) has this fencing token. When it has, its row stays locked (KEY SHARE) to the end of the caller''s transaction: checked in the transaction that writes, no release or reclaim of the lock commits before that write does.';
CREATE OR REPLACE FUNCTION helix_acquire_job_lock(p_organization_id text, p_job_type text, p_holder text, p_ttl_ms bigint, p_metadata jsonb, p_idempotency_key text, p_max_holders integer DEFAULT 1)
 RETURNS TABLE(id bigint, organization_id text, job_type text, holder text, fencing_token bigint, acquired_at timestamp with time zone, expires_at timestamp with time zone, released_at timestamp with time zone, release_reason text, state text, ttl_remaining_ms bigint, metadata jsonb, max_holders integer, slot integer, token text, reclaimed_lock_id bigint, reclaimed_holder text, reclaimed_expired_at timestamp with time zone)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
 SET plan_cache_mode = force_generic_plan
AS $function$
#variable_conflict use_column
DECLARE
    v_lease interval := helix_lease(p_ttl_ms);
    v_token text := helix_new_token();
    v_fencing_token bigint;
    v_lock helix_holds%ROWTYPE;
    v_live helix_holds[] := '{}';  -- the pair's live locks, by slot
    v_held integer := 0;
    v_in_force integer;  -- the held locks' max_holders
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
BEGIN
    IF p_max_holders IS NULL OR p_max_holders < 1 OR p_max_holders > 1000 THEN
        RAISE EXCEPTION 'max_holders must be between 1 and 1000, got %', p_max_holders
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'max_holders';
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
        RETURNING k.last_fencing_token INTO v_fencing_token;
        IF NOT FOUND THEN
            INSERT INTO helix_lock_keys AS k (organization_id, job_type, last_fencing_token)
            VALUES (p_organization_id, p_job_type, 1)
            ON CONFLICT (organization_id, job_type)
                DO UPDATE SET last_fencing_token = k.last_fencing_token + 1
            RETURNING k.last_fencing_token INTO v_fencing_token;
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
                IF p_idempotency_key IS NOT NULL
                   AND v_lock.idempotency_key = p_idempotency_key
                   AND v_lock.holder = p_holder THEN
                    v_id := v_lock.id;  -- the original committed while this repeat waited (0010)
                END IF;
            ELSIF v_lock.max_holders <> p_max_holders THEN
                v_reclaim := v_reclaim || v_lock.id;  -- expired, of another value: always reclaimed
                IF v_reclaimed.id IS NULL OR v_lock.expires_at < v_reclaimed.expires_at THEN
                    v_reclaimed := v_lock;
                END IF;
            END IF;
        END LOOP;

        IF v_id IS NOT NULL THEN
            UPDATE helix_lock_keys AS k
            SET last_fencing_token = k.last_fencing_token - 1
            WHERE k.organization_id = p_organization_id AND k.job_type = p_job_type;
            UPDATE helix_holds AS h SET replayed = true WHERE h.id = v_id;
        ELSIF v_held > 0 AND (v_held >= p_max_holders OR v_in_force <> p_max_holders) THEN
            PERFORM helix_raise_held(v_live, v_now, p_max_holders);
        ELSE
            -- The lowest slot that no live lock of this value holds; else the slot of the lock
            -- that expired first, reclaimed.
            IF cardinality(v_live) = 0 THEN
                v_slot := 0;  -- the common case: no statement
            ELSE
                SELECT s INTO v_slot
                FROM generate_series(0, p_max_holders - 1) AS s
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
            INSERT INTO helix_holds (
                organization_id, job_type, holder, token, metadata, fencing_token, acquired_at,
                expires_at, idempotency_key, reclaimed_lock_id, reclaimed_holder, reclaimed_expired_at,
                max_holders, slot
            )
            VALUES (
                p_organization_id, p_job_type, p_holder, v_token, p_metadata, v_fencing_token,
                v_now, v_now + v_lease, p_idempotency_key, v_reclaimed.id, v_reclaimed.holder,
                v_reclaimed.expires_at, p_max_holders, v_slot
            )
            RETURNING id INTO v_id;
        END IF;
    END IF;

    RETURN QUERY
        SELECT v.*, h.token, h.reclaimed_lock_id, h.reclaimed_holder, h.reclaimed_expired_at
        FROM helix_held_locks AS v
        JOIN helix_holds AS h ON h.id = v.id
        WHERE v.id = v_id;
END $function$;
COMMENT ON FUNCTION helix_acquire_job_lock(text,text,text,bigint,jsonb,text,integer) IS 'Grants a free slot of the pair, reclaiming expired locks and announcing the expiries of the others it leaves (0022), in one statement; or raises 23505 whose DETAIL names the lock whose lease runs out first and lists at most 20 holders, those whose leases run out first, with holders_total (0021): an answer bounded whatever max_holders. On the tables of migration 0023; a lock of a session with the session''s lease, judged with the session''s row locked when it ran out (0028).';

-- A session's row, then one of its holds (the order of locks), never waiting for the hold while
-- holding the row: a busy hold (a writer's open fencing check keeps it KEY SHARE as long as the
-- writer's transaction lasts; an acquire of its pair, FOR UPDATE) is waited for holding nothing,
-- in a subtransaction that lets it go, and both are asked for again. So a renewal, which takes the
-- session's row alone, never waits for a writer, as with 0027. p_to_end: the hold FOR UPDATE (to
-- end it), else FOR NO KEY UPDATE (to update it).
CREATE FUNCTION helix_lock_session_and_hold(
    p_session_id bigint, p_lock_id bigint, p_organization_id text, p_to_end boolean
)
 RETURNS void
 LANGUAGE plpgsql
AS $function$
BEGIN
    LOOP
        BEGIN
            PERFORM FROM helix_sessions AS s WHERE s.id = p_session_id FOR NO KEY UPDATE;
            IF p_to_end THEN
                PERFORM FROM helix_holds AS h
                WHERE h.id = p_lock_id AND (p_organization_id IS NULL OR h.organization_id = p_organization_id)
                FOR UPDATE NOWAIT;
            ELSE
                PERFORM FROM helix_holds AS h
                WHERE h.id = p_lock_id AND (p_organization_id IS NULL OR h.organization_id = p_organization_id)
                FOR NO KEY UPDATE NOWAIT;
            END IF;
            RETURN;  -- both kept to the end of the transaction
        EXCEPTION WHEN lock_not_available THEN
            NULL;  -- the block's subtransaction let both go
        END;
        BEGIN
            IF p_to_end THEN
                PERFORM FROM helix_holds AS h
                WHERE h.id = p_lock_id AND (p_organization_id IS NULL OR h.organization_id = p_organization_id)
                FOR UPDATE;
            ELSE
                PERFORM FROM helix_holds AS h
                WHERE h.id = p_lock_id AND (p_organization_id IS NULL OR h.organization_id = p_organization_id)
                FOR NO KEY UPDATE;
            END IF;
            RAISE EXCEPTION 'the hold is free: let it go' USING ERRCODE = 'HL099';
        EXCEPTION WHEN SQLSTATE 'HL099' THEN
            NULL;
        END;
    END LOOP;
END $function$;
REVOKE EXECUTE ON FUNCTION helix_lock_session_and_hold(bigint,bigint,text,boolean) FROM PUBLIC;
COMMENT ON FUNCTION helix_lock_session_and_hold(bigint,bigint,text,boolean) IS 'Row-locks a session and then one of its holds (FOR UPDATE to end it, else FOR NO KEY UPDATE), waiting for a busy hold without holding the session''s row, so that the session''s renewal never waits for whoever holds the hold (a writer''s fencing check). Migration 0028.';

CREATE OR REPLACE FUNCTION helix_release_job_lock(p_lock_id bigint, p_token text, p_organization_id text)
 RETURNS SETOF helix_job_lock_views
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
 SET plan_cache_mode = force_generic_plan
AS $function$
DECLARE
    v_session_id bigint;
BEGIN
    -- A lock on its own ends in one statement when the token is its: no row lock first, no record
    -- of one in the WAL (4% of a cycle's bytes), no other read.
    IF helix_end_holds(ARRAY[p_lock_id], NULL, 'released', NULL, p_token, p_organization_id, true) = 0 THEN
        -- A lock of a session, of this token and organization: the session's row first, so that
        -- the lease copied into the history is the one in force at the end, and no other
        -- transaction announces that lease's expiry meanwhile (the sweep and acquires pass a
        -- locked row by, an update waits): the end announces it itself, once (0028).
        SELECT h.session_id INTO v_session_id FROM helix_holds AS h
        WHERE h.id = p_lock_id
          AND (p_organization_id IS NULL OR h.organization_id = p_organization_id)
          AND helix_digest(h.token) = helix_digest(p_token);
        IF v_session_id IS NOT NULL THEN
            PERFORM helix_lock_session_and_hold(v_session_id, p_lock_id, p_organization_id, true);
        END IF;
        -- Else the reason: HL001, HL002 or HL003.
        IF helix_end_holds(ARRAY[p_lock_id], NULL, 'released', NULL, p_token, p_organization_id) = 0 THEN
            PERFORM helix_lock_for_holder(p_lock_id, p_token, p_organization_id, false);
            -- Not reached while a lock's id and token never change; should it be, the lock ends.
            PERFORM helix_end_holds(ARRAY[p_lock_id], clock_timestamp(), 'released', NULL);
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM helix_ended_locks AS v WHERE v.id = p_lock_id;
END $function$;

CREATE OR REPLACE FUNCTION helix_force_release_job_lock(p_lock_id bigint, p_key_id text)
 RETURNS SETOF helix_job_lock_views
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
 SET plan_cache_mode = force_generic_plan
AS $function$
DECLARE
    v_session_id bigint;
BEGIN
    -- A lock of a session: the session's row first, as a release takes it (0028).
    SELECT h.session_id INTO v_session_id FROM helix_holds AS h WHERE h.id = p_lock_id;
    IF v_session_id IS NOT NULL THEN
        PERFORM helix_lock_session_and_hold(v_session_id, p_lock_id, NULL, true);
    END IF;
    PERFORM FROM helix_holds AS h WHERE h.id = p_lock_id FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM helix_raise_ended(p_lock_id, NULL, NULL, false);
    END IF;
    PERFORM helix_end_holds(ARRAY[p_lock_id], clock_timestamp(), 'forced', p_key_id);
    RETURN QUERY SELECT * FROM helix_ended_locks AS v WHERE v.id = p_lock_id;
END $function$;

CREATE OR REPLACE FUNCTION helix_update_job_lock(p_lock_id bigint, p_token text, p_metadata jsonb, p_organization_id text)
 RETURNS SETOF helix_job_lock_views
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
 SET plan_cache_mode = force_generic_plan
AS $function$
DECLARE
    v_lock helix_holds%ROWTYPE;
    v_session_id bigint;
BEGIN
    -- A lock of a session, of this token and organization: the session's row first (the order
    -- of locks: a session's row, then holds), as a release takes it.
    SELECT h.session_id INTO v_session_id FROM helix_holds AS h
    WHERE h.id = p_lock_id
      AND (p_organization_id IS NULL OR h.organization_id = p_organization_id)
      AND helix_digest(h.token) = helix_digest(p_token);
    IF v_session_id IS NOT NULL THEN
        PERFORM helix_lock_session_and_hold(v_session_id, p_lock_id, p_organization_id, false);
    END IF;
    v_lock := helix_lock_for_holder(p_lock_id, p_token, p_organization_id, true);
    UPDATE helix_holds AS h SET metadata = p_metadata
    WHERE h.organization_id = v_lock.organization_id AND h.job_type = v_lock.job_type
      AND h.slot = v_lock.slot;
    -- An update of a lock whose session's lease had run out by the update's own clock announces
    -- that expiry, if no one did, in its transaction: the stream sends it before the update, as
    -- for a lock alone (helix_hold_changed).
    IF v_session_id IS NOT NULL THEN
        UPDATE helix_sessions AS s SET expired_xid = pg_current_xact_id(), changed_xid = pg_current_xact_id()
        WHERE s.id = v_session_id AND s.expired_xid IS NULL AND s.ended_at IS NULL
          AND s.expires_at <= (SELECT h.updated_at FROM helix_holds AS h WHERE h.id = p_lock_id);
    END IF;
    RETURN QUERY SELECT * FROM helix_held_locks AS v WHERE v.id = p_lock_id;
END $function$;

CREATE OR REPLACE FUNCTION helix_window_events(p_after pg_snapshot, p_until pg_snapshot, p_organization_id text, p_job_type text)
 RETURNS TABLE(at timestamp with time zone, id bigint, rank integer)
 LANGUAGE plpgsql
 STABLE SECURITY DEFINER
 SET search_path FROM CURRENT
 SET plan_cache_mode = force_custom_plan
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
               NULL::timestamptz AS released_at, h.changed_xid
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
               e.released_at, e.changed_xid
        FROM helix_lock_history AS e
        WHERE e.ended_xid >= v_from
          AND (p_organization_id IS NULL OR e.organization_id = p_organization_id)
          AND (p_job_type IS NULL OR e.job_type = p_job_type)
        UNION ALL
        SELECT e.id, e.acquired_at, e.acquired_xid, e.lapses, e.lapse_xids, e.expires_at,
               e.expired_xid, e.renewed_at, e.renewed_xid, e.updated_at, e.updated_xid,
               e.released_at, e.changed_xid
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
        -- An end is a lock's last change: its transaction is the history row's changed_xid.
        SELECT c.released_at, c.id, 4, c.changed_xid FROM changed AS c WHERE c.released_at IS NOT NULL
    )
    SELECT e.at, e.id, e.rank FROM events AS e
    WHERE e.xid IS NOT NULL
      AND NOT pg_visible_in_snapshot(e.xid, p_after)
      AND pg_visible_in_snapshot(e.xid, p_until);
END $function$;

-- POST /v1/sessions/{id}/locks with an Idempotency-Key: each lock it adds keeps the key
-- (added_key), and a repeat while the session still holds every lock of that call, and only
-- those, answers them again (replayed) rather than asking for pairs the session holds.
ALTER TABLE helix_holds ADD COLUMN added_key text;
COMMENT ON COLUMN helix_holds.added_key IS 'For a lock of a session added by POST /v1/sessions/{id}/locks with an Idempotency-Key: that key, so that a repeat of the call answers the locks it added (migration 0028). NULL otherwise.';

CREATE FUNCTION helix_add_session_locks(
    p_session_id bigint, p_token text, p_organization_id text, p_job_types text[],
    p_max_holders integer[], p_quota integer, p_share bigint, p_locks_limit integer, p_idempotency_key text
)
 RETURNS SETOF helix_session_answer
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
DECLARE
    v_session helix_sessions%ROWTYPE := helix_session_for_holder(p_session_id, p_token, p_organization_id);
    v_left bigint;
    v_ids bigint[];
BEGIN
    -- Its holds are not locked (0028): an acquire that reclaims one, or a force, takes the
    -- session's row first, so the history shows either before this call goes on.
    IF helix_session_lost(v_session) THEN
        PERFORM helix_end_session(v_session, clock_timestamp(), 'lost');
        RETURN QUERY SELECT * FROM helix_session_answer(p_session_id, p_organization_id, false, false);
        RETURN;
    END IF;
    v_left := floor(extract(epoch FROM v_session.expires_at - clock_timestamp()) * 1000);
    IF v_left <= 0 THEN
        RAISE EXCEPTION 'the lease of session % has run out: renew it first', p_session_id
            USING ERRCODE = 'HL010', DETAIL = json_build_object('expires_at', v_session.expires_at)::text;
    END IF;
    IF p_idempotency_key IS NOT NULL THEN
        v_ids := ARRAY(
            SELECT h.id FROM helix_holds AS h
            WHERE h.organization_id = v_session.organization_id AND h.session_id = p_session_id
              AND h.added_key = p_idempotency_key
        );
        -- The same call: the same job types, each with the same max_holders.
        IF cardinality(v_ids) > 0 AND (
            SELECT array_agg((h.job_type, h.max_holders) ORDER BY h.job_type COLLATE "C")
            FROM helix_holds AS h WHERE h.id = ANY (v_ids)
        ) = (
            SELECT array_agg((j.job_type, j.max_holders) ORDER BY j.job_type COLLATE "C")
            FROM unnest(p_job_types, p_max_holders) AS j (job_type, max_holders)
        ) THEN
            RETURN QUERY
                SELECT * FROM helix_session_answer(p_session_id, p_organization_id, false, true) AS a
                WHERE a.id = ANY (v_ids);
            RETURN;
        END IF;
    END IF;
    v_ids := helix_grant_session_locks(
        v_session, p_job_types, p_max_holders, greatest(v_left, 1000), p_quota, p_share, p_locks_limit, false
    );
    IF p_idempotency_key IS NOT NULL THEN
        UPDATE helix_holds AS h SET added_key = p_idempotency_key
        WHERE h.organization_id = v_session.organization_id AND h.session_id = p_session_id
          AND h.id = ANY (v_ids);
    END IF;
    RETURN QUERY
        SELECT * FROM helix_session_answer(p_session_id, p_organization_id, false, false) AS a
        WHERE a.id = ANY (v_ids);
END $function$;
REVOKE EXECUTE ON FUNCTION helix_add_session_locks(bigint,text,text,text[],integer[],integer,bigint,integer,text) FROM PUBLIC;
COMMENT ON FUNCTION helix_add_session_locks(bigint,text,text,text[],integer[],integer,bigint,integer,text) IS 'POST /v1/sessions/{id}/locks: grants more locks to an open session, all or none, with its lease (the answer lists them); a repeat with the same Idempotency-Key while the session holds exactly the locks that call added answers them (replayed); HL010 when its lease has run out; a session that lost a lock ends instead (session_state ended). Migration 0028.';

-- The call of the previous build (no Idempotency-Key), kept for its replicas during an upgrade.
CREATE OR REPLACE FUNCTION helix_add_session_locks(p_session_id bigint, p_token text, p_organization_id text, p_job_types text[], p_max_holders integer[], p_quota integer, p_share bigint, p_locks_limit integer)
 RETURNS SETOF helix_session_answer
 LANGUAGE sql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
    SELECT * FROM helix_add_session_locks(
        p_session_id, p_token, p_organization_id, p_job_types, p_max_holders, p_quota, p_share, p_locks_limit, NULL
    )
$function$;
COMMENT ON FUNCTION helix_add_session_locks(bigint,text,text,text[],integer[],integer,bigint,integer) IS 'helix_add_session_locks without an Idempotency-Key: the call of the build before migration 0028.';

-- Every column of every lock (migration 0023's view), a lock of a session with its session's lease.
-- Each column of a lease is a scalar subquery, asked for a lock of a session alone, so that the
-- view's live branch stays one table that PostgreSQL merges into a query: a join on the lock's id
-- reads the hold by its index (a lateral join here would read every hold).
CREATE OR REPLACE VIEW helix_job_locks AS
SELECT h.id, h.organization_id, h.job_type, h.holder, h.token, h.metadata, h.acquired_at,
       CASE WHEN h.session_id IS NULL THEN h.expires_at
            ELSE (SELECT l.expires_at FROM helix_hold_lease(h.session_id, h.acquired_at, h.expires_at,
                  h.renewed_at, h.renewed_xid, h.lapses, h.lapse_xids, h.expired_xid, h.changed_xid) AS l) END
           AS expires_at,
       NULL::timestamptz AS released_at, NULL::text AS release_reason,
       h.fencing_token, NULL::text AS forced_by, h.idempotency_key, h.reclaimed_lock_id,
       h.reclaimed_holder, h.reclaimed_expired_at, h.replayed, h.acquired_xid,
       CASE WHEN h.session_id IS NULL THEN h.renewed_xid
            ELSE (SELECT l.renewed_xid FROM helix_hold_lease(h.session_id, h.acquired_at, h.expires_at,
                  h.renewed_at, h.renewed_xid, h.lapses, h.lapse_xids, h.expired_xid, h.changed_xid) AS l) END
           AS renewed_xid,
       CASE WHEN h.session_id IS NULL THEN h.renewed_at
            ELSE (SELECT l.renewed_at FROM helix_hold_lease(h.session_id, h.acquired_at, h.expires_at,
                  h.renewed_at, h.renewed_xid, h.lapses, h.lapse_xids, h.expired_xid, h.changed_xid) AS l) END
           AS renewed_at,
       h.updated_xid, h.updated_at, h.changed_xid,
       CASE WHEN h.session_id IS NULL THEN h.lapses
            ELSE (SELECT l.lapses FROM helix_hold_lease(h.session_id, h.acquired_at, h.expires_at,
                  h.renewed_at, h.renewed_xid, h.lapses, h.lapse_xids, h.expired_xid, h.changed_xid) AS l) END
           AS lapses,
       h.max_holders, h.slot,
       CASE WHEN h.session_id IS NULL THEN h.expired_xid
            ELSE (SELECT l.expired_xid FROM helix_hold_lease(h.session_id, h.acquired_at, h.expires_at,
                  h.renewed_at, h.renewed_xid, h.lapses, h.lapse_xids, h.expired_xid, h.changed_xid) AS l) END
           AS expired_xid,
       CASE WHEN h.session_id IS NULL THEN h.lapse_xids
            ELSE (SELECT l.lapse_xids FROM helix_hold_lease(h.session_id, h.acquired_at, h.expires_at,
                  h.renewed_at, h.renewed_xid, h.lapses, h.lapse_xids, h.expired_xid, h.changed_xid) AS l) END
           AS lapse_xids
FROM helix_holds AS h
UNION ALL
SELECT e.id, e.organization_id, e.job_type, e.holder, e.token, e.metadata, e.acquired_at,
       e.expires_at, e.released_at, e.release_reason, e.fencing_token, e.forced_by,
       e.idempotency_key, e.reclaimed_lock_id, e.reclaimed_holder, e.reclaimed_expired_at,
       e.replayed, e.acquired_xid, e.renewed_xid, e.renewed_at, e.updated_xid, e.updated_at,
       e.changed_xid, e.lapses, e.max_holders, e.slot, e.expired_xid, e.lapse_xids
FROM helix_lock_history AS e;
COMMENT ON VIEW helix_job_locks IS 'Every lock with every column, live (helix_holds) or ended (helix_lock_history): the table of this name until migration 0023; a lock of a session with its session''s lease (helix_hold_lease, 0028). Takes writes (helix_job_locks_written). FOR UPDATE cannot go through it: lock the rows of the tables.';

-- What every session call answers, read from the session's row and its holds (by the index on
-- (organization_id, session_id)), not through helix_held_locks: each of its locks has the
-- session's lease. PL/pgSQL, so that its plan is kept for the connection.
CREATE OR REPLACE FUNCTION helix_session_answer(p_session_id bigint, p_organization_id text, p_lapsed boolean, p_replayed boolean)
 RETURNS SETOF helix_session_answer
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
DECLARE
    v_now timestamptz := clock_timestamp();
BEGIN
    RETURN QUERY
    SELECT s.id, s.token, s.organization_id, s.holder, s.expires_at,
           CASE WHEN s.ended_at IS NULL
                THEN greatest(0, floor(extract(epoch FROM s.expires_at - v_now) * 1000))::bigint
                ELSE 0::bigint END,
           CASE WHEN s.ended_at IS NOT NULL THEN 'ended'
                WHEN s.expires_at <= v_now THEN 'expired' ELSE 'held' END,
           s.ended_at, s.end_reason, p_lapsed, p_replayed,
           h.id, h.organization_id, h.job_type, h.holder, h.fencing_token, h.acquired_at,
           CASE WHEN h.id IS NOT NULL THEN s.expires_at END,
           NULL::timestamptz, NULL::text,
           CASE WHEN h.id IS NULL THEN NULL WHEN s.expires_at <= v_now THEN 'expired' ELSE 'held' END,
           CASE WHEN h.id IS NOT NULL
                THEN greatest(0, floor(extract(epoch FROM s.expires_at - v_now) * 1000))::bigint END,
           h.metadata, h.max_holders, h.slot
    FROM helix_sessions AS s
    LEFT JOIN helix_holds AS h ON h.organization_id = s.organization_id AND h.session_id = s.id
    WHERE s.id = p_session_id AND (p_organization_id IS NULL OR s.organization_id = p_organization_id)
    ORDER BY h.job_type COLLATE "C", h.slot;
END $function$;
COMMENT ON FUNCTION helix_session_answer(bigint,text,boolean,boolean) IS 'A session (of the organization, unless NULL) and its unreleased locks, each with the session''s lease, one row per lock (one with NULL lock columns when it has none).';
