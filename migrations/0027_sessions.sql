-- Sessions: one lease that many locks share, and several locks granted at once, all or none
-- (issue 38).
--
-- A session is a row of helix_sessions: its organization, holder, token and lease. Its locks are
-- ordinary holds with session_id set: each has its own grant, slot and fencing token, and to
-- everyone else (lists, events, /current, the acquire that reclaims it) it is a lock like any
-- other. What a session changes is who renews and ends them:
-- - its locks share the session's token (the Lock-Token for the release or the update of each)
--   and its lease: every hold of a session expires when the session does;
-- - a session's renewal is one statement, which renews the session and every one of its holds
--   (an UPDATE of each, HOT like a lock's renewal). A renewal of a lock alone is refused (HL006),
--   so that the holds never disagree with their session;
-- - the locks of one call are granted by one statement, each by helix_acquire_job_lock (the one
--   rule, per pair), in the order of their job types: two calls wanting overlapping pairs lock
--   them in the same order, so neither waits for a pair the other holds while holding one it
--   wants. A pair that cannot be granted raises its error with its job type added to DETAIL,
--   and the statement's rollback leaves none of the call's locks granted.
--
-- The order of locks, which keeps every path free of deadlocks: a session's row first, then
-- holds in (organization, job type, slot) order, then the organization's session count
-- (helix_session_count_lock), which nobody holds while waiting for anything. The acquire and a
-- lock's own release lock holds alone and never a session's row, so a session that lost a lock
-- learns it from the history (a lock of it ended otherwise than released by its holder), not
-- from a flag the reclaiming acquire would have to write. A renewal locks its holds FOR NO KEY
-- UPDATE, as a lock's renewal does, so that a writer's fencing check (FOR KEY SHARE) never makes
-- it wait.
--
-- The quota as for an acquire (migration 0020): far from it, the service lets a session's locks
-- through on a share of the room (held in shared mode, like an acquire on a share), and the
-- organization's quota lock is taken only near it, the exact way.

CREATE SEQUENCE helix_session_ids;

CREATE TABLE helix_sessions (
    id              bigint      NOT NULL DEFAULT nextval('helix_session_ids'),
    organization_id text        NOT NULL,
    holder          text        NOT NULL,
    token           text        NOT NULL,
    metadata        jsonb,
    idempotency_key text,
    created_at      timestamptz NOT NULL,
    expires_at      timestamptz NOT NULL,
    renewed_at      timestamptz,
    ended_at        timestamptz,
    end_reason      text,
    CONSTRAINT helix_sessions_pkey PRIMARY KEY (id),
    CONSTRAINT helix_sessions_end_reason CHECK (end_reason IN ('released', 'lost')),
    CONSTRAINT helix_sessions_ended CHECK ((ended_at IS NULL) = (end_reason IS NULL))
) WITH (fillfactor = 50);
ALTER SEQUENCE helix_session_ids OWNED BY helix_sessions.id;
-- The organization's open sessions (its bound), and a repeat's session by its key.
CREATE INDEX helix_sessions_open ON helix_sessions (organization_id, idempotency_key)
    WHERE ended_at IS NULL;

ALTER TABLE helix_holds ADD COLUMN session_id bigint;
ALTER TABLE helix_lock_history ADD COLUMN session_id bigint;
-- A session's holds (its renewal and end), and its locks that ended (whether it lost one): by the
-- organization and the session, so that a generic plan for a statement naming both reads the
-- session's rows, never the organization's.
CREATE INDEX helix_holds_session ON helix_holds (organization_id, session_id) WHERE session_id IS NOT NULL;
CREATE INDEX helix_lock_history_session ON helix_lock_history (organization_id, session_id)
    WHERE session_id IS NOT NULL;

COMMENT ON SEQUENCE helix_session_ids IS 'Session ids.';
COMMENT ON TABLE helix_sessions IS 'One row per session: a lease that many locks share (helix_holds.session_id), renewed and ended by one statement for all of them (migration 0027). Kept after its end, so that a late call is told it ended, until retention (helix_prune_sessions).';
COMMENT ON COLUMN helix_sessions.id IS 'The session''s id, from helix_session_ids.';
COMMENT ON COLUMN helix_sessions.organization_id IS 'The organization the session and all its locks belong to.';
COMMENT ON COLUMN helix_sessions.holder IS 'Who holds it, as the holder named itself; each of its locks has this holder.';
COMMENT ON COLUMN helix_sessions.token IS 'The session''s secret (helix_new_token): the token of every one of its locks too, compared by digest.';
COMMENT ON COLUMN helix_sessions.metadata IS 'The holder''s JSON, given to each lock at its grant.';
COMMENT ON COLUMN helix_sessions.idempotency_key IS 'The Idempotency-Key the session was opened with: a repeat with the same key, in the organization, while the session is open, gets this session back.';
COMMENT ON COLUMN helix_sessions.created_at IS 'When the session was opened, by the database clock.';
COMMENT ON COLUMN helix_sessions.expires_at IS 'When its lease runs out: every hold of the session has this expires_at.';
COMMENT ON COLUMN helix_sessions.renewed_at IS 'The latest renewal; NULL: never renewed.';
COMMENT ON COLUMN helix_sessions.ended_at IS 'When its holder ended it, or when a call learned that it had lost a lock; NULL while open.';
COMMENT ON COLUMN helix_sessions.end_reason IS 'released: its holder ended it; lost: a lock of it was reclaimed or forced, and the call that found out released the rest.';
COMMENT ON COLUMN helix_holds.session_id IS 'The session the lock belongs to (helix_sessions), whose token and lease it shares; NULL: a lock on its own.';
COMMENT ON COLUMN helix_lock_history.session_id IS 'As in helix_holds, copied at the end.';

-- The end copies session_id into the history; the rest is as 0023 wrote it.
CREATE OR REPLACE FUNCTION helix_end_holds(p_ids bigint[], p_at timestamp with time zone, p_reason text, p_forced_by text, p_token text DEFAULT NULL::text, p_organization_id text DEFAULT NULL::text)
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
               e.metadata, e.fencing_token, e.acquired_at, e.expires_at, e.ended_at, p_reason,
               p_forced_by, e.idempotency_key, e.reclaimed_lock_id, e.reclaimed_holder,
               e.reclaimed_expired_at, e.replayed, e.acquired_xid, e.renewed_xid, e.renewed_at,
               e.updated_xid, e.updated_at, pg_current_xact_id(), e.lapses,
               -- An end after the lease ran out announces the expiry, if no one did.
               CASE WHEN e.expired_xid IS NULL AND e.expires_at <= e.ended_at
                    THEN pg_current_xact_id() ELSE e.expired_xid END,
               e.lapse_xids, e.session_id
        FROM ended AS e
        ORDER BY e.id
        RETURNING 1
    )
    SELECT count(*)::integer INTO v_count FROM inserted;
    RETURN v_count;
END $function$;

-- A hold joining its session in its grant's own transaction is part of the grant, not a renewal
-- or an update: no event of its own. The rest is as 0023 wrote it.
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
        -- it before the update, as a renewal's or an end's.
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
END $function$;

-- A lock of a session is renewed with its session (HL006); the rest is as 0023 wrote it.
CREATE OR REPLACE FUNCTION helix_renew_job_lock(p_lock_id bigint, p_token text, p_ttl_ms bigint, p_organization_id text)
 RETURNS TABLE(id bigint, organization_id text, job_type text, holder text, fencing_token bigint, acquired_at timestamp with time zone, expires_at timestamp with time zone, released_at timestamp with time zone, release_reason text, state text, ttl_remaining_ms bigint, metadata jsonb, max_holders integer, slot integer, lapsed boolean)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
 SET plan_cache_mode = force_generic_plan
AS $function$
#variable_conflict use_column
DECLARE
    v_lease interval := helix_lease(p_ttl_ms);
    v_lock helix_holds%ROWTYPE := helix_lock_for_holder(p_lock_id, p_token, p_organization_id, true);
    v_now timestamptz := clock_timestamp();  -- under the row lock
BEGIN
    IF v_lock.session_id IS NOT NULL THEN
        RAISE EXCEPTION 'lock % is renewed with its session %', p_lock_id, v_lock.session_id
            USING ERRCODE = 'HL006', DETAIL = json_build_object('session_id', v_lock.session_id)::text;
    END IF;
    -- A lapsed lease nobody reclaimed may be renewed: no one else can have held the lock. The
    -- renewal is dated by the clock its lease counts from, so that the history (lapses) and the
    -- answer (lapsed) agree on whether the lease had run out. A HOT update: nothing it changes
    -- is indexed.
    UPDATE helix_holds AS h SET expires_at = v_now + v_lease, renewed_at = v_now
    WHERE h.organization_id = v_lock.organization_id AND h.job_type = v_lock.job_type
      AND h.slot = v_lock.slot;
    RETURN QUERY
        SELECT v.id, v.organization_id, v.job_type, v.holder, v.fencing_token, v.acquired_at,
               v.expires_at, v.released_at, v.release_reason, v.state, v.ttl_remaining_ms,
               v.metadata, v.max_holders, v.slot, v_lock.expires_at <= v_now
        FROM helix_held_locks AS v
        WHERE v.id = p_lock_id;
END $function$;

-- The session of p_session_id if p_token is its token, row-locked; else HL011 (none in the
-- organization), HL002 (another token) or HL007 (ended, with when and why in DETAIL).
CREATE FUNCTION helix_session_for_holder(p_session_id bigint, p_token text, p_organization_id text)
 RETURNS helix_sessions
 LANGUAGE plpgsql
AS $function$
DECLARE
    v_session helix_sessions%ROWTYPE;
BEGIN
    SELECT * INTO v_session FROM helix_sessions AS s
    WHERE s.id = p_session_id AND (p_organization_id IS NULL OR s.organization_id = p_organization_id)
    FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no session %', p_session_id USING ERRCODE = 'HL011';
    END IF;
    IF helix_digest(v_session.token) IS DISTINCT FROM helix_digest(p_token) THEN
        RAISE EXCEPTION 'token does not match session %', p_session_id
            USING ERRCODE = 'HL002',
                  DETAIL = json_build_object('organization_id', v_session.organization_id)::text;
    END IF;
    IF v_session.ended_at IS NOT NULL THEN
        RAISE EXCEPTION 'session % has ended', p_session_id
            USING ERRCODE = 'HL007',
                  DETAIL = json_build_object(
                      'session_id', v_session.id, 'end_reason', v_session.end_reason,
                      'ended_at', v_session.ended_at
                  )::text;
    END IF;
    RETURN v_session;
END $function$;

-- Whether a lock of the session ended otherwise than by its holder's release (reclaimed after
-- its lease ran out, or forced): the session lost it. Asked after the session's holds are
-- row-locked, so a reclaim in flight has committed (and is seen) or waits for this transaction.
CREATE FUNCTION helix_session_lost(p_session helix_sessions)
 RETURNS boolean
 LANGUAGE sql
AS $function$
    SELECT EXISTS (
        SELECT FROM helix_lock_history AS e
        WHERE e.session_id = p_session.id AND e.organization_id = p_session.organization_id
          AND e.release_reason <> 'released'
    )
$function$;

-- Ends a session: its holds that are left end as released, in one statement, and the session
-- ends as p_reason at p_at.
CREATE FUNCTION helix_end_session(p_session helix_sessions, p_at timestamptz, p_reason text)
 RETURNS void
 LANGUAGE plpgsql
AS $function$
BEGIN
    PERFORM helix_lock_session_holds(p_session, true);
    PERFORM helix_end_holds(
        ARRAY(
            SELECT h.id FROM helix_holds AS h
            WHERE h.session_id = p_session.id AND h.organization_id = p_session.organization_id
        ),
        p_at, 'released', NULL
    );
    UPDATE helix_sessions AS s SET ended_at = p_at, end_reason = p_reason WHERE s.id = p_session.id;
END $function$;

-- Row-locks a session's holds, in the order every path takes them (FOR UPDATE to end them, else
-- FOR NO KEY UPDATE), and returns how many.
CREATE FUNCTION helix_lock_session_holds(p_session helix_sessions, p_to_end boolean)
 RETURNS integer
 LANGUAGE plpgsql
AS $function$
DECLARE
    v_count integer;
BEGIN
    IF p_to_end THEN
        SELECT count(*) INTO v_count FROM (
            SELECT FROM helix_holds AS h
            WHERE h.session_id = p_session.id AND h.organization_id = p_session.organization_id
            ORDER BY h.organization_id, h.job_type COLLATE "C", h.slot
            FOR UPDATE
        ) AS locked;
    ELSE
        SELECT count(*) INTO v_count FROM (
            SELECT FROM helix_holds AS h
            WHERE h.session_id = p_session.id AND h.organization_id = p_session.organization_id
            ORDER BY h.organization_id, h.job_type COLLATE "C", h.slot
            FOR NO KEY UPDATE
        ) AS locked;
    END IF;
    RETURN v_count;
END $function$;

-- Raises HL009 when the organization already has p_limit open sessions (not ended, lease
-- running) besides p_session: under the organization's session count lock, taken last.
CREATE FUNCTION helix_session_count_lock(p_session helix_sessions, p_limit integer)
 RETURNS void
 LANGUAGE plpgsql
AS $function$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('helix_sessions/' || p_session.organization_id, 0));
    IF (SELECT count(*) FROM helix_sessions AS s
        WHERE s.organization_id = p_session.organization_id AND s.ended_at IS NULL
          AND s.expires_at > clock_timestamp() AND s.id <> p_session.id) >= p_limit THEN
        RAISE EXCEPTION 'organization % has its bound of open sessions', p_session.organization_id
            USING ERRCODE = 'HL009', DETAIL = p_limit::text;
    END IF;
END $function$;

-- Grants the pairs p_job_types (with p_max_holders each) to the session, all or none: each by
-- helix_acquire_job_lock, in job type order, then joins them to the session (its token, its
-- lease: the latest of theirs when p_lengthen, so that no hold's lease shortens; else the
-- session's, HL010 if it ran out meanwhile). On the share p_share of the quota (HL005 once it is
-- gone), or, without one, the exact way under the organization's quota lock (HL004); HL008 past
-- the bound on a session's locks. Returns the locks' ids.
CREATE FUNCTION helix_grant_session_locks(
    p_session helix_sessions, p_job_types text[], p_max_holders integer[], p_ttl_ms bigint,
    p_quota integer, p_share bigint, p_locks_limit integer, p_lengthen boolean
)
 RETURNS bigint[]
 LANGUAGE plpgsql
AS $function$
DECLARE
    v_org text := p_session.organization_id;
    v_pairs integer := coalesce(cardinality(p_job_types), 0);
    v_live bigint;  -- the organization's live locks before the grants (the exact way)
    v_shared bigint;
    v_share bigint;
    v_job_type text;
    v_max_holders integer;
    v_ids bigint[] := '{}';
    v_grant record;
    v_expires timestamptz := p_session.expires_at;
    v_state text;
    v_message text;
    v_detail text;
    v_constraint text;
BEGIN
    IF v_pairs = 0 THEN
        RETURN v_ids;
    END IF;
    IF cardinality(p_max_holders) <> v_pairs
       OR (SELECT count(DISTINCT j) FROM unnest(p_job_types) AS j) <> v_pairs THEN
        RAISE EXCEPTION 'a session''s locks name distinct job types, each with its max_holders'
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'locks';
    END IF;
    IF p_share IS NOT NULL THEN
        -- As helix_acquire_job_lock_on_share: the share stays until this transaction commits.
        PERFORM pg_advisory_xact_lock_shared(helix_quota_share_class(p_share), helix_quota_share_key(p_share));
        IF NOT EXISTS (
            SELECT FROM helix_quota_shares AS s
            WHERE s.id = p_share AND s.organization_id = v_org AND s.until > clock_timestamp()
        ) THEN
            RAISE EXCEPTION 'the share % of organization %''s quota has ended', p_share, v_org
                USING ERRCODE = 'HL005';
        END IF;
    ELSE
        -- As helix_acquire_job_lock_within_quota: counted under the organization's quota lock,
        -- the room its shares hold back taken back when it is needed, before any pair is locked.
        PERFORM pg_advisory_xact_lock(helix_quota_lock_key(v_org));
        SELECT count(*) INTO v_live FROM helix_holds AS h WHERE h.organization_id = v_org;
        SELECT coalesce(sum(s.room), 0) INTO v_shared FROM helix_quota_shares AS s
        WHERE s.organization_id = v_org;
        IF v_live + v_shared + v_pairs > p_quota THEN
            FOR v_share IN
                SELECT s.id FROM helix_quota_shares AS s WHERE s.organization_id = v_org ORDER BY s.id
            LOOP
                PERFORM pg_advisory_xact_lock(helix_quota_share_class(v_share), helix_quota_share_key(v_share));
                DELETE FROM helix_quota_shares AS s WHERE s.organization_id = v_org AND s.id = v_share;
            END LOOP;
            SELECT count(*) INTO v_live FROM helix_holds AS h WHERE h.organization_id = v_org;
        END IF;
    END IF;
    IF (SELECT count(*) FROM helix_holds AS h
        WHERE h.session_id = p_session.id AND h.organization_id = v_org) + v_pairs > p_locks_limit THEN
        RAISE EXCEPTION 'a session may hold at most % locks', p_locks_limit
            USING ERRCODE = 'HL008', DETAIL = p_locks_limit::text;
    END IF;

    BEGIN
        FOR v_job_type, v_max_holders IN
            SELECT j.job_type, j.max_holders
            FROM unnest(p_job_types, p_max_holders) AS j (job_type, max_holders)
            ORDER BY j.job_type COLLATE "C"
        LOOP
            SELECT a.id, a.expires_at INTO v_grant
            FROM helix_acquire_job_lock(
                v_org, v_job_type, p_session.holder, p_ttl_ms, p_session.metadata, NULL, v_max_holders
            ) AS a;
            IF NOT FOUND THEN
                RAISE EXCEPTION 'helix_acquire_job_lock returned no row for %', v_job_type;
            END IF;
            v_ids := v_ids || v_grant.id;
            IF p_lengthen THEN
                v_expires := greatest(v_expires, v_grant.expires_at);
            END IF;
        END LOOP;
    EXCEPTION WHEN unique_violation THEN
        -- The pair's refusal, naming the pair.
        GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_message = MESSAGE_TEXT,
            v_detail = PG_EXCEPTION_DETAIL, v_constraint = CONSTRAINT_NAME;
        RAISE EXCEPTION USING ERRCODE = v_state, MESSAGE = v_message, CONSTRAINT = v_constraint,
            DETAIL = (coalesce(nullif(v_detail, '')::jsonb, '{}') || jsonb_build_object('job_type', v_job_type))::text;
    END;

    -- The session's lease ran out while the grants waited: nothing is added to it.
    IF NOT p_lengthen AND v_expires <= clock_timestamp() THEN
        RAISE EXCEPTION 'the lease of session % has run out: renew it first', p_session.id
            USING ERRCODE = 'HL010', DETAIL = json_build_object('expires_at', v_expires)::text;
    END IF;
    IF v_live IS NOT NULL THEN
        IF (SELECT count(*) FROM helix_holds AS h WHERE h.organization_id = v_org) > greatest(v_live, p_quota) THEN
            RAISE EXCEPTION 'organization % has its quota of live locks', v_org
                USING ERRCODE = 'HL004', DETAIL = p_quota::text;
        END IF;
    END IF;

    UPDATE helix_holds AS h SET session_id = p_session.id, token = p_session.token, expires_at = v_expires
    WHERE h.id = ANY (v_ids);
    IF v_expires IS DISTINCT FROM p_session.expires_at THEN
        UPDATE helix_sessions AS s SET expires_at = v_expires WHERE s.id = p_session.id;
    END IF;
    RETURN v_ids;
END $function$;

-- What every session call answers: the session, and its unreleased locks, one row each (one row
-- with NULL lock columns when it has none).
CREATE TYPE helix_session_answer AS (
    session_id bigint, session_token text, session_organization_id text, session_holder text,
    session_expires_at timestamptz, session_ttl_remaining_ms bigint, session_state text,
    session_ended_at timestamptz, session_end_reason text, lapsed boolean, replayed boolean,
    id bigint, organization_id text, job_type text, holder text, fencing_token bigint,
    acquired_at timestamptz, expires_at timestamptz, released_at timestamptz, release_reason text,
    state text, ttl_remaining_ms bigint, metadata jsonb, max_holders integer, slot integer
);
COMMENT ON TYPE helix_session_answer IS 'A session call''s answer, one row per unreleased lock of the session: the session (state held, expired or ended), lapsed (a renewal found its lease run out), replayed (an Idempotency-Key repeat), and the lock as helix_held_locks shows it.';

CREATE FUNCTION helix_session_answer(p_session_id bigint, p_organization_id text, p_lapsed boolean, p_replayed boolean)
 RETURNS SETOF helix_session_answer
 LANGUAGE sql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
    SELECT s.id, s.token, s.organization_id, s.holder, s.expires_at,
           CASE WHEN s.ended_at IS NULL
                THEN greatest(0, floor(extract(epoch FROM s.expires_at - clock_timestamp()) * 1000))::bigint
                ELSE 0 END,
           CASE WHEN s.ended_at IS NOT NULL THEN 'ended'
                WHEN s.expires_at <= clock_timestamp() THEN 'expired' ELSE 'held' END,
           s.ended_at, s.end_reason, p_lapsed, p_replayed,
           l.id, l.organization_id, l.job_type, l.holder, l.fencing_token, l.acquired_at,
           l.expires_at, l.released_at, l.release_reason, l.state, l.ttl_remaining_ms, l.metadata,
           l.max_holders, l.slot
    FROM helix_sessions AS s
    LEFT JOIN helix_holds AS h ON h.session_id = s.id AND h.organization_id = s.organization_id
    LEFT JOIN helix_held_locks AS l ON l.id = h.id
    WHERE s.id = p_session_id AND (p_organization_id IS NULL OR s.organization_id = p_organization_id)
    ORDER BY l.job_type COLLATE "C", l.slot
$function$;

-- POST /v1/sessions: opens a session and grants its locks in one statement, all or none; a
-- repeat (same organization, holder and Idempotency-Key, the session open and whole) answers the
-- open session. HL009 past the organization's bound on open sessions.
CREATE FUNCTION helix_open_session(
    p_organization_id text, p_holder text, p_ttl_ms bigint, p_metadata jsonb, p_idempotency_key text,
    p_job_types text[], p_max_holders integer[], p_quota integer, p_share bigint,
    p_sessions_limit integer, p_locks_limit integer
)
 RETURNS SETOF helix_session_answer
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
DECLARE
    v_lease interval := helix_lease(p_ttl_ms);
    v_session helix_sessions%ROWTYPE;
    v_now timestamptz;
BEGIN
    IF p_idempotency_key IS NOT NULL THEN
        -- One call of a key at a time: a repeat finds the session its first call made.
        PERFORM pg_advisory_xact_lock(
            hashtextextended('helix_session_key/' || p_organization_id || '/' || p_idempotency_key, 0)
        );
        SELECT * INTO v_session FROM helix_sessions AS s
        WHERE s.organization_id = p_organization_id AND s.idempotency_key = p_idempotency_key
          AND s.ended_at IS NULL AND s.holder = p_holder AND s.expires_at > clock_timestamp()
        FOR UPDATE;
        IF FOUND THEN
            PERFORM helix_lock_session_holds(v_session, false);
            IF NOT helix_session_lost(v_session) THEN
                RETURN QUERY SELECT * FROM helix_session_answer(v_session.id, p_organization_id, false, true);
                RETURN;
            END IF;
            -- It lost a lock: no longer the set asked for, so no answer to repeat. It ends, and
            -- this call opens a session anew.
            PERFORM helix_end_session(v_session, clock_timestamp(), 'lost');
        END IF;
    END IF;
    v_now := clock_timestamp();
    INSERT INTO helix_sessions AS s (organization_id, holder, token, metadata, idempotency_key, created_at, expires_at)
    VALUES (p_organization_id, p_holder, helix_new_token(), p_metadata, p_idempotency_key, v_now, v_now + v_lease)
    RETURNING s.* INTO v_session;
    PERFORM helix_grant_session_locks(
        v_session, p_job_types, p_max_holders, p_ttl_ms, p_quota, p_share, p_locks_limit, true
    );
    PERFORM helix_session_count_lock(v_session, p_sessions_limit);
    RETURN QUERY SELECT * FROM helix_session_answer(v_session.id, p_organization_id, false, false);
END $function$;

-- POST /v1/sessions/{id}/locks: grants more locks to an open session whose lease has not run
-- out (HL010 when it has, or runs out while the grants wait: renew it first), all or none, with
-- the session's lease; the answer lists those added. A session that had lost a lock ends
-- instead, as at its renewal (session_state ended, end_reason lost).
CREATE FUNCTION helix_add_session_locks(
    p_session_id bigint, p_token text, p_organization_id text, p_job_types text[],
    p_max_holders integer[], p_quota integer, p_share bigint, p_locks_limit integer
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
    PERFORM helix_lock_session_holds(v_session, false);
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
    v_ids := helix_grant_session_locks(
        v_session, p_job_types, p_max_holders, greatest(v_left, 1000), p_quota, p_share, p_locks_limit, false
    );
    RETURN QUERY
        SELECT * FROM helix_session_answer(p_session_id, p_organization_id, false, false) AS a
        WHERE a.id = ANY (v_ids);
END $function$;

-- POST /v1/sessions/{id}/renew: one new lease from the database clock for the session and every
-- one of its holds; a session whose lease ran out is renewed too (lapsed) if it lost no lock,
-- and counts as open again (HL009 past the organization's bound). One that lost a lock (reclaimed
-- or forced) ends instead, its other locks released: the answer's session_state says 'ended',
-- end_reason 'lost'.
CREATE FUNCTION helix_renew_session(
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
    v_now timestamptz;
BEGIN
    PERFORM helix_lock_session_holds(v_session, false);
    v_now := clock_timestamp();  -- under the row locks
    IF helix_session_lost(v_session) THEN
        PERFORM helix_end_session(v_session, v_now, 'lost');
        RETURN QUERY SELECT * FROM helix_session_answer(p_session_id, p_organization_id, false, false);
        RETURN;
    END IF;
    IF v_session.expires_at <= v_now THEN
        PERFORM helix_session_count_lock(v_session, p_sessions_limit);
    END IF;
    -- HOT updates: nothing they change is indexed.
    UPDATE helix_holds AS h SET expires_at = v_now + v_lease, renewed_at = v_now
    WHERE h.session_id = p_session_id AND h.organization_id = v_session.organization_id;
    UPDATE helix_sessions AS s SET expires_at = v_now + v_lease, renewed_at = v_now
    WHERE s.id = p_session_id;
    RETURN QUERY SELECT * FROM helix_session_answer(p_session_id, p_organization_id, v_session.expires_at <= v_now, false);
END $function$;

-- DELETE /v1/sessions/{id}: ends the session and releases its locks in one statement. A session
-- that had lost a lock ends as lost (the answer says so).
CREATE FUNCTION helix_close_session(p_session_id bigint, p_token text, p_organization_id text)
 RETURNS TABLE(organization_id text, end_reason text, ended_at timestamptz)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
DECLARE
    v_session helix_sessions%ROWTYPE := helix_session_for_holder(p_session_id, p_token, p_organization_id);
    v_now timestamptz;
    v_reason text;
BEGIN
    PERFORM helix_lock_session_holds(v_session, true);
    v_now := clock_timestamp();
    v_reason := CASE WHEN helix_session_lost(v_session) THEN 'lost' ELSE 'released' END;
    PERFORM helix_end_session(v_session, v_now, v_reason);
    RETURN QUERY SELECT v_session.organization_id, v_reason, v_now;
END $function$;

-- Retention of sessions. A session whose lease ran out before the window is lost: its holds go,
-- without history, as a lapsed lock's do in helix_prune_history (which leaves a session's holds
-- to this function), and it ends as lost, so that its holder, should it come back, is told so
-- (410) rather than renewing a set that is no longer whole. A session that ended before the
-- window, with no live lock left, is deleted. One replica at a time; a session another call has
-- row-locked is left for the next run.
CREATE FUNCTION helix_prune_sessions(p_older_than interval, p_batch integer)
 RETURNS integer
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
DECLARE
    v_cutoff timestamptz := clock_timestamp() - p_older_than;
    v_session helix_sessions%ROWTYPE;
    v_lost integer := 0;
    v_deleted integer;
BEGIN
    IF NOT pg_try_advisory_xact_lock(hashtext('helix_prune_sessions')) THEN
        RETURN 0;
    END IF;
    FOR v_session IN
        SELECT * FROM helix_sessions AS s
        WHERE s.ended_at IS NULL AND s.expires_at < v_cutoff
        LIMIT p_batch
        FOR UPDATE SKIP LOCKED
    LOOP
        PERFORM helix_lock_session_holds(v_session, true);
        DELETE FROM helix_holds AS h
        WHERE h.session_id = v_session.id AND h.organization_id = v_session.organization_id;
        UPDATE helix_sessions AS s SET ended_at = clock_timestamp(), end_reason = 'lost'
        WHERE s.id = v_session.id;
        v_lost := v_lost + 1;
    END LOOP;
    WITH doomed AS (
        SELECT s.id FROM helix_sessions AS s
        WHERE s.ended_at < v_cutoff
          AND NOT EXISTS (
              SELECT FROM helix_holds AS h
              WHERE h.session_id = s.id AND h.organization_id = s.organization_id
          )
        LIMIT p_batch
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM helix_sessions AS s USING doomed WHERE s.id = doomed.id;
    GET DIAGNOSTICS v_deleted = ROW_COUNT;
    RETURN v_lost + v_deleted;
END $function$;

-- A lapsed lock of a session is left to helix_prune_sessions, which ends its session with it;
-- the rest is as 0023 wrote it.
CREATE OR REPLACE FUNCTION helix_prune_history(p_older_than interval, p_batch integer)
 RETURNS integer
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
DECLARE
    -- A value, not clock_timestamp() in the WHERE clause: a volatile expression cannot bound the
    -- index scan, and a batch that finds nothing old would read the whole retained history.
    v_cutoff timestamptz := clock_timestamp() - p_older_than;
    v_ended integer;
    v_lapsed integer;
BEGIN
    IF NOT pg_try_advisory_xact_lock(hashtext('helix_prune_history')) THEN
        RETURN 0;  -- another replica is pruning
    END IF;
    WITH doomed AS (
        SELECT e.id
        FROM helix_lock_history AS e
        WHERE e.released_at < v_cutoff
        ORDER BY e.released_at
        LIMIT p_batch
    )
    DELETE FROM helix_lock_history AS e USING doomed WHERE e.id = doomed.id;
    GET DIAGNOSTICS v_ended = ROW_COUNT;
    -- Locks nobody released or reclaimed, whose lease ended before the window. SKIP LOCKED
    -- leaves one that an acquire is reclaiming at this moment to that acquire; one deleted here
    -- is simply absent for the next acquire of its key.
    WITH doomed AS (
        SELECT h.organization_id, h.job_type, h.slot
        FROM helix_holds AS h
        WHERE h.expires_at < v_cutoff AND h.session_id IS NULL
        LIMIT p_batch
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM helix_holds AS h USING doomed
    WHERE (h.organization_id, h.job_type, h.slot) = (doomed.organization_id, doomed.job_type, doomed.slot);
    GET DIAGNOSTICS v_lapsed = ROW_COUNT;
    RETURN v_ended + v_lapsed;
END $function$;

REVOKE EXECUTE ON FUNCTION helix_session_for_holder(bigint,text,text), helix_session_lost(helix_sessions),
    helix_end_session(helix_sessions,timestamptz,text), helix_lock_session_holds(helix_sessions,boolean),
    helix_session_count_lock(helix_sessions,integer),
    helix_grant_session_locks(helix_sessions,text[],integer[],bigint,integer,bigint,integer,boolean),
    helix_session_answer(bigint,text,boolean,boolean),
    helix_open_session(text,text,bigint,jsonb,text,text[],integer[],integer,bigint,integer,integer),
    helix_add_session_locks(bigint,text,text,text[],integer[],integer,bigint,integer),
    helix_renew_session(bigint,text,bigint,text,integer), helix_close_session(bigint,text,text),
    helix_prune_sessions(interval,integer)
FROM PUBLIC;

COMMENT ON FUNCTION helix_end_holds(bigint[],timestamp with time zone,text,text,text,text) IS 'Ends live locks (release, force, reclaim): deletes their holds and inserts their history rows (session_id too, 0027), dated p_at (NULL: the clock as each is deleted), in one statement; returns how many. Either the caller has locked the holds FOR UPDATE, or it gives the token (and organization) that a hold must have to end.';
COMMENT ON FUNCTION helix_hold_changed() IS 'Records in a hold the transaction (and time) of each change GET /v1/events reports: grant, renewal (with the lapse it ends), update, announced expiry (migrations 0016, 0019, 0023); a hold joining its session in its grant''s transaction is part of the grant (0027).';
COMMENT ON FUNCTION helix_renew_job_lock(bigint,text,bigint,text) IS 'A holder''s renewal: a new lease of p_ttl_ms from the database clock, a HOT update of the hold. Also renews a lease that ran out if nobody reclaimed it, and says so (lapsed). HL001, HL002 or HL003 otherwise; HL006 for a lock of a session, which is renewed with its session (0027).';
COMMENT ON FUNCTION helix_session_for_holder(bigint,text,text) IS 'The session if p_token is its token and it is open, row-locked; else HL011 (none in the organization), HL002 (another token) or HL007 (ended: when and why in DETAIL).';
COMMENT ON FUNCTION helix_session_lost(helix_sessions) IS 'Whether a lock of the session ended otherwise than by its holder''s release (reclaimed or forced): asked with the session''s holds row-locked.';
COMMENT ON FUNCTION helix_end_session(helix_sessions,timestamptz,text) IS 'Releases the session''s holds that are left, in one statement, and ends the session as p_reason.';
COMMENT ON FUNCTION helix_lock_session_holds(helix_sessions,boolean) IS 'Row-locks a session''s holds in (organization, job type, slot) order, the order every path takes them: FOR UPDATE to end them, else FOR NO KEY UPDATE (a writer''s fencing check never makes a renewal wait); returns how many.';
COMMENT ON FUNCTION helix_session_count_lock(helix_sessions,integer) IS 'HL009 when the organization has p_limit open sessions (not ended, lease running) besides this one: under its session count advisory lock, which every path takes last.';
COMMENT ON FUNCTION helix_grant_session_locks(helix_sessions,text[],integer[],bigint,integer,bigint,integer,boolean) IS 'Grants pairs to a session all or none, each by helix_acquire_job_lock in job type order (a refusal raised with its job_type in DETAIL), on a share of the quota (HL005 once gone) or the exact way under the organization''s quota lock (HL004), within the bound on a session''s locks (HL008); the holds take the session''s token and lease (HL010 if an added lock''s ran out meanwhile). Returns the locks'' ids.';
COMMENT ON FUNCTION helix_session_answer(bigint,text,boolean,boolean) IS 'A session (of the organization, unless NULL) and its unreleased locks, one row per lock (one with NULL lock columns when it has none).';
COMMENT ON FUNCTION helix_open_session(text,text,bigint,jsonb,text,text[],integer[],integer,bigint,integer,integer) IS 'POST /v1/sessions: opens a session and grants its locks in one statement, all or none, or answers the open session of a repeat (same organization, holder and Idempotency-Key) unless it lost a lock; HL009 past the bound on open sessions.';
COMMENT ON FUNCTION helix_add_session_locks(bigint,text,text,text[],integer[],integer,bigint,integer) IS 'POST /v1/sessions/{id}/locks: grants more locks to an open session, all or none, with its lease (the answer lists them); HL010 when its lease has run out; a session that lost a lock ends instead (session_state ended).';
COMMENT ON FUNCTION helix_renew_session(bigint,text,bigint,text,integer) IS 'POST /v1/sessions/{id}/renew: a new lease for the session and each of its holds in one statement (lapsed: it had run out, and it counts against the bound on open sessions again: HL009); a session that lost a lock ends instead, its other locks released (session_state ended, end_reason lost).';
COMMENT ON FUNCTION helix_close_session(bigint,text,text) IS 'DELETE /v1/sessions/{id}: releases the session''s locks and ends it in one statement; end_reason lost when it had lost a lock.';
COMMENT ON FUNCTION helix_prune_sessions(interval,integer) IS 'Retention of sessions, one replica at a time: a session whose lease ran out before the window ends as lost, its holds deleted without history (as a lapsed lock''s); one that ended before the window, with no live lock left, is deleted.';
COMMENT ON FUNCTION helix_prune_history(interval,integer) IS 'Retention: deletes a batch of history rows that ended before the window, and a batch of live locks on their own whose lease ended before it and that nobody ended (migrations 0007, 0023); a session''s are helix_prune_sessions'' (0027).';
