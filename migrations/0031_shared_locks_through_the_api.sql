-- Shared locks through the API (issue 40, after 0030's database part): the mode reaches every
-- way a lock is granted, and the guarantee holds for every writer.
--
-- - helix_acquire_job_lock_on_share and helix_acquire_job_lock_within_quota take p_mode and pass
--   it on. Near the quota, a shared acquire beside the pair's readers adds a live lock (up to
--   1000 of them), so it is counted as one; before, the count took a held pair for one with no
--   free slot and let such an acquire through uncounted.
-- - A repeat of an acquire (its Idempotency-Key and holder) that names another mode than the lock
--   the key got is refused (22023, column mode): the answer states the mode asked, so a repeat
--   never hands a writer a reader's lock or the other way round.
-- - A session's locks each take a mode (p_shared, one per pair, NULL: all exclusive) through
--   helix_open_session, helix_add_session_locks and helix_grant_session_locks; a repeat of an
--   add is the same call only with the same modes. helix_session_answer gives each lock's mode.
-- - helix_holds_modes_apart fires whatever session_replication_role says (ENABLE ALWAYS): a
--   session set to replica, which skips ordinary triggers, no longer writes past it.
-- Every function keeps its earlier arguments, the new one last with a default, so a replica of
-- the build before this one goes on calling them during a rolling upgrade.

ALTER TABLE helix_holds ENABLE ALWAYS TRIGGER helix_holds_modes_apart;

CREATE FUNCTION helix_refuse_replay_of_another_mode(p_organization_id text, p_job_type text, p_holder text, p_idempotency_key text, p_mode text)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path FROM CURRENT
AS $function$
BEGIN
    -- The live lock of this key and holder is the one the acquire answered: a repeat's (an
    -- acquire with a key that has a live lock is a repeat) or the grant it just made.
    IF p_idempotency_key IS NOT NULL AND EXISTS (
        SELECT FROM helix_holds AS h
        WHERE h.organization_id = p_organization_id AND h.job_type = p_job_type
          AND h.idempotency_key = p_idempotency_key AND h.holder = p_holder
          AND h.shared <> (p_mode = 'shared') AND h.expires_at > clock_timestamp()
    ) THEN
        RAISE EXCEPTION 'this Idempotency-Key got a lock of the other mode: a repeat names the mode of the first call'
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'mode';
    END IF;
END $function$;
REVOKE EXECUTE ON FUNCTION helix_refuse_replay_of_another_mode(text,text,text,text,text) FROM PUBLIC;
COMMENT ON FUNCTION helix_refuse_replay_of_another_mode(text,text,text,text,text) IS 'After an acquire with an Idempotency-Key: 22023 (column mode) when the live lock of that key and holder is of another mode than p_mode, that is, when the acquire was a repeat of a call that asked the other mode (0031).';

DROP FUNCTION helix_acquire_job_lock_on_share(text,text,text,bigint,jsonb,text,integer,bigint,bigint);
CREATE FUNCTION helix_acquire_job_lock_on_share(p_organization_id text, p_job_type text, p_holder text, p_ttl_ms bigint, p_metadata jsonb, p_idempotency_key text, p_max_holders integer, p_share bigint, p_place bigint DEFAULT NULL::bigint, p_mode text DEFAULT 'exclusive')
 RETURNS TABLE(id bigint, organization_id text, job_type text, holder text, fencing_token bigint, acquired_at timestamp with time zone, expires_at timestamp with time zone, released_at timestamp with time zone, release_reason text, state text, ttl_remaining_ms bigint, metadata jsonb, max_holders integer, slot integer, token text, reclaimed_lock_id bigint, reclaimed_holder text, reclaimed_expired_at timestamp with time zone)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock_shared(helix_quota_share_class(p_share), helix_quota_share_key(p_share));
    IF NOT EXISTS (
        SELECT FROM helix_quota_shares AS s
        WHERE s.id = p_share AND s.organization_id = p_organization_id AND s.until > clock_timestamp()
    ) THEN
        RAISE EXCEPTION 'the share % of organization %''s quota has ended', p_share, p_organization_id
            USING ERRCODE = 'HL005';
    END IF;
    RETURN QUERY SELECT * FROM helix_acquire_job_lock(
        p_organization_id, p_job_type, p_holder, p_ttl_ms, p_metadata, p_idempotency_key, p_max_holders, p_place, p_mode
    );
    PERFORM helix_refuse_replay_of_another_mode(p_organization_id, p_job_type, p_holder, p_idempotency_key, p_mode);
END $function$;
REVOKE EXECUTE ON FUNCTION helix_acquire_job_lock_on_share(text,text,text,bigint,jsonb,text,integer,bigint,bigint,text) FROM PUBLIC;
COMMENT ON FUNCTION helix_acquire_job_lock_on_share(text,text,text,bigint,jsonb,text,integer,bigint,bigint,text) IS 'helix_acquire_job_lock, let through on a share of the quota: under the share''s advisory lock in shared mode to its commit, so that the share stays until it has committed; HL005 once the share is gone or past its time (migration 0020). p_place: the waiter''s place (0029). p_mode: exclusive or shared; a repeat of another mode is refused (0031).';

DROP FUNCTION helix_acquire_job_lock_within_quota(text,text,text,bigint,jsonb,text,integer,integer,bigint);
CREATE FUNCTION helix_acquire_job_lock_within_quota(p_organization_id text, p_job_type text, p_holder text, p_ttl_ms bigint, p_metadata jsonb, p_idempotency_key text, p_quota integer, p_max_holders integer DEFAULT 1, p_place bigint DEFAULT NULL::bigint, p_mode text DEFAULT 'exclusive')
 RETURNS TABLE(id bigint, organization_id text, job_type text, holder text, fencing_token bigint, acquired_at timestamp with time zone, expires_at timestamp with time zone, released_at timestamp with time zone, release_reason text, state text, ttl_remaining_ms bigint, metadata jsonb, max_holders integer, slot integer, token text, reclaimed_lock_id bigint, reclaimed_holder text, reclaimed_expired_at timestamp with time zone)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
#variable_conflict use_column
DECLARE
    v_adds boolean;  -- the acquire takes a free slot, unless it is a repeat
    v_repeat boolean;
    v_live bigint;  -- the organization's live locks
    v_shared bigint;  -- the room its shares hold back
    v_share bigint;
    v_mode_shared boolean := p_mode = 'shared';
BEGIN
    PERFORM pg_advisory_xact_lock(helix_quota_lock_key(p_organization_id));
    -- A shared acquire beside the pair's readers adds a lock too, up to 1000 of them (0031).
    SELECT count(*) FILTER (WHERE h.max_holders = p_max_holders AND h.shared = v_mode_shared) = count(*)
           AND count(*) < CASE WHEN v_mode_shared THEN 1000 ELSE p_max_holders END,
           coalesce(bool_or(h.idempotency_key = p_idempotency_key
                            AND h.holder = p_holder
                            AND h.expires_at > clock_timestamp()), false)
    INTO v_adds, v_repeat
    FROM helix_holds AS h
    WHERE h.organization_id = p_organization_id AND h.job_type = p_job_type;
    IF v_adds THEN
        SELECT count(*) INTO v_live FROM helix_holds AS h
        WHERE h.organization_id = p_organization_id;
        SELECT coalesce(sum(s.room), 0) INTO v_shared FROM helix_quota_shares AS s
        WHERE s.organization_id = p_organization_id;
        IF v_live + v_shared >= p_quota THEN
            -- The room the shares hold back is needed: take each back once the acquires in
            -- flight on it have committed, and count again, with nothing in flight.
            FOR v_share IN
                SELECT s.id FROM helix_quota_shares AS s
                WHERE s.organization_id = p_organization_id
                ORDER BY s.id
            LOOP
                PERFORM pg_advisory_xact_lock(helix_quota_share_class(v_share), helix_quota_share_key(v_share));
                DELETE FROM helix_quota_shares AS s
                WHERE s.organization_id = p_organization_id AND s.id = v_share;
            END LOOP;
            SELECT count(*) INTO v_live FROM helix_holds AS h
            WHERE h.organization_id = p_organization_id;
        END IF;
        IF v_live >= p_quota AND NOT v_repeat THEN
            RAISE EXCEPTION 'organization % has its quota of live locks', p_organization_id
                USING ERRCODE = 'HL004', DETAIL = p_quota::text;
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM helix_acquire_job_lock(
        p_organization_id, p_job_type, p_holder, p_ttl_ms, p_metadata, p_idempotency_key, p_max_holders, p_place, p_mode
    );
    PERFORM helix_refuse_replay_of_another_mode(p_organization_id, p_job_type, p_holder, p_idempotency_key, p_mode);
    -- A repeat let through at the quota whose lease ran out before the acquire claimed it, and so
    -- granted anew, is refused after all (the grant rolls back with the statement). Judged by
    -- what this call did: it inserted a live lock, reclaiming none.
    IF v_adds AND v_live >= p_quota AND EXISTS (
        SELECT FROM helix_holds AS h
        WHERE h.organization_id = p_organization_id
          AND h.job_type = p_job_type
          AND h.acquired_xid = pg_current_xact_id()
          AND h.reclaimed_lock_id IS NULL
    ) THEN
        RAISE EXCEPTION 'organization % has its quota of live locks', p_organization_id
            USING ERRCODE = 'HL004', DETAIL = p_quota::text;
    END IF;
END $function$;
REVOKE EXECUTE ON FUNCTION helix_acquire_job_lock_within_quota(text,text,text,bigint,jsonb,text,integer,integer,bigint,text) FROM PUBLIC;
COMMENT ON FUNCTION helix_acquire_job_lock_within_quota(text,text,text,bigint,jsonb,text,integer,integer,bigint,text) IS 'helix_acquire_job_lock near the quota: counted and granted under the quota''s advisory lock held exclusively, holding back the room of the shares, or taking them back (waiting for the acquires in flight on them) when it needs it; HL004 beyond the quota. A repeat is judged by what the call itself did (migration 0020). p_place: the waiter''s place (0029). p_mode: exclusive or shared, a reader beside readers counted as a lock it adds; a repeat of another mode is refused (0031).';

DROP FUNCTION helix_grant_session_locks(helix_sessions,text[],integer[],bigint,integer,bigint,integer,boolean,bigint);
CREATE FUNCTION helix_grant_session_locks(p_session helix_sessions, p_job_types text[], p_max_holders integer[], p_ttl_ms bigint, p_quota integer, p_share bigint, p_locks_limit integer, p_lengthen boolean, p_place bigint DEFAULT NULL::bigint, p_shared boolean[] DEFAULT NULL)
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
    v_shared_pair boolean;
    -- Each pair's mode (0031): shared or not; without p_shared (a build before 0031), exclusive.
    v_modes boolean[] := coalesce(p_shared, array_fill(false, ARRAY[v_pairs]));
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
    IF cardinality(p_max_holders) <> v_pairs OR cardinality(v_modes) <> v_pairs
       OR (SELECT count(DISTINCT j) FROM unnest(p_job_types) AS j) <> v_pairs THEN
        RAISE EXCEPTION 'a session''s locks name distinct job types, each with its max_holders and mode'
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
        FOR v_job_type, v_max_holders, v_shared_pair IN
            SELECT j.job_type, j.max_holders, coalesce(j.shared, false)
            FROM unnest(p_job_types, p_max_holders, v_modes) AS j (job_type, max_holders, shared)
            ORDER BY j.job_type COLLATE "C"
        LOOP
            SELECT a.id, a.expires_at INTO v_grant
            FROM helix_acquire_job_lock(
                v_org, v_job_type, p_session.holder, p_ttl_ms, p_session.metadata, NULL, v_max_holders, p_place,
                CASE WHEN v_shared_pair THEN 'shared' ELSE 'exclusive' END
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
REVOKE EXECUTE ON FUNCTION helix_grant_session_locks(helix_sessions,text[],integer[],bigint,integer,bigint,integer,boolean,bigint,boolean[]) FROM PUBLIC;
COMMENT ON FUNCTION helix_grant_session_locks(helix_sessions,text[],integer[],bigint,integer,bigint,integer,boolean,bigint,boolean[]) IS 'Grants pairs to a session all or none, each by helix_acquire_job_lock in job type order (a refusal raised with its job_type in DETAIL), on a share of the quota (HL005 once gone) or the exact way under the organization''s quota lock (HL004), within the bound on a session''s locks (HL008); the holds take the session''s token and lease (HL010 if an added lock''s ran out meanwhile). p_place: the waiting session''s order number in its pairs'' queues (0029). p_shared: each pair''s mode, NULL for all exclusive (0031). Returns the locks'' ids.';

DROP FUNCTION helix_open_session(text,text,bigint,jsonb,text,text[],integer[],integer,bigint,integer,integer,bigint);
CREATE FUNCTION helix_open_session(p_organization_id text, p_holder text, p_ttl_ms bigint, p_metadata jsonb, p_idempotency_key text, p_job_types text[], p_max_holders integer[], p_quota integer, p_share bigint, p_sessions_limit integer, p_locks_limit integer, p_place bigint DEFAULT NULL::bigint, p_shared boolean[] DEFAULT NULL)
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
        v_session, p_job_types, p_max_holders, p_ttl_ms, p_quota, p_share, p_locks_limit, true, p_place, p_shared
    );
    PERFORM helix_session_count_lock(v_session, p_sessions_limit);
    RETURN QUERY SELECT * FROM helix_session_answer(v_session.id, p_organization_id, false, false);
END $function$;
REVOKE EXECUTE ON FUNCTION helix_open_session(text,text,bigint,jsonb,text,text[],integer[],integer,bigint,integer,integer,bigint,boolean[]) FROM PUBLIC;
COMMENT ON FUNCTION helix_open_session(text,text,bigint,jsonb,text,text[],integer[],integer,bigint,integer,integer,bigint,boolean[]) IS 'POST /v1/sessions: opens a session and grants its locks in one statement, all or none, or answers the open session of a repeat (same organization, holder and Idempotency-Key) unless it lost a lock; HL009 past the bound on open sessions. p_place: a waiting opening''s order number in its pairs'' queues (0029). p_shared: each lock''s mode, NULL for all exclusive (0031).';

DROP FUNCTION helix_add_session_locks(bigint,text,text,text[],integer[],integer,bigint,integer,text,bigint);
CREATE FUNCTION helix_add_session_locks(p_session_id bigint, p_token text, p_organization_id text, p_job_types text[], p_max_holders integer[], p_quota integer, p_share bigint, p_locks_limit integer, p_idempotency_key text, p_place bigint DEFAULT NULL::bigint, p_shared boolean[] DEFAULT NULL)
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
        -- The same call: the same job types, each with the same max_holders and mode (0031).
        IF cardinality(v_ids) > 0 AND (
            SELECT array_agg((h.job_type, h.max_holders, h.shared) ORDER BY h.job_type COLLATE "C")
            FROM helix_holds AS h WHERE h.id = ANY (v_ids)
        ) = (
            SELECT array_agg((j.job_type, j.max_holders, coalesce(j.shared, false)) ORDER BY j.job_type COLLATE "C")
            FROM unnest(p_job_types, p_max_holders, p_shared) AS j (job_type, max_holders, shared)
        ) THEN
            RETURN QUERY
                SELECT * FROM helix_session_answer(p_session_id, p_organization_id, false, true) AS a
                WHERE a.id = ANY (v_ids);
            RETURN;
        END IF;
    END IF;
    v_ids := helix_grant_session_locks(
        v_session, p_job_types, p_max_holders, greatest(v_left, 1000), p_quota, p_share, p_locks_limit, false, p_place, p_shared
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
REVOKE EXECUTE ON FUNCTION helix_add_session_locks(bigint,text,text,text[],integer[],integer,bigint,integer,text,bigint,boolean[]) FROM PUBLIC;
COMMENT ON FUNCTION helix_add_session_locks(bigint,text,text,text[],integer[],integer,bigint,integer,text,bigint,boolean[]) IS 'POST /v1/sessions/{id}/locks: grants more locks to an open session, all or none, with its lease (the answer lists them); a repeat with the same Idempotency-Key while the session holds exactly the locks that call added, with the same max_holders and modes, answers them (replayed); HL010 when its lease has run out; a session that lost a lock ends instead (session_state ended). Migration 0028; p_place: a waiting call''s order number in its pairs'' queues (0029); p_shared: each lock''s mode, NULL for all exclusive (0031).';

ALTER TYPE helix_session_answer ADD ATTRIBUTE shared boolean;
COMMENT ON TYPE helix_session_answer IS 'A session call''s answer, one row per unreleased lock of the session: the session (state held, expired or ended), lapsed (a renewal found its lease run out), replayed (an Idempotency-Key repeat), and the lock as helix_held_locks shows it, with its mode (shared, 0031).';
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
           h.metadata, h.max_holders, h.slot, h.shared
    FROM helix_sessions AS s
    LEFT JOIN helix_holds AS h ON h.organization_id = s.organization_id AND h.session_id = s.id
    WHERE s.id = p_session_id AND (p_organization_id IS NULL OR s.organization_id = p_organization_id)
    ORDER BY h.job_type COLLATE "C", h.slot;
END $function$;
