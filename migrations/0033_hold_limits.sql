-- Hold limits (issue 41, its first part): "max_hold_seconds" on an acquire, and on a session.
--
-- A holder that hangs while its heartbeat thread goes on renews for ever. With a hold limit, the
-- grant records hold_limit_at (acquired_at + max_hold_seconds, by the database clock), and no
-- lease ever passes it: the grant's first lease and every renewal end at hold_limit_at at the
-- latest (a renewal cut short says limited), and once it has come a renewal is refused (HL012,
-- 410 hold-limit-reached). The lock then lapses as any lock whose lease ran out, and the next
-- acquire of its pair reclaims it. The last line of defence is a CHECK: whatever writes
-- helix_holds, expires_at never passes hold_limit_at.
--
-- A new column, NULL for every lock granted before (a lock of a session takes its session's
-- limit, below), in helix_holds and, copied at the end, in helix_lock_history. Rolling
-- upgrade: the functions keep their arguments and add p_max_hold_ms last with a default, so the
-- previous build's calls resolve to them; the renewal answers one column more (limited), which
-- the previous build does not read. Its renewal of a lock past its limit answers 503, not 410,
-- since it does not know HL012 (docs/deployment.md); only this build grants limits.

CREATE FUNCTION helix_max_hold(p_max_hold_ms bigint)
 RETURNS interval
 LANGUAGE plpgsql
 IMMUTABLE
AS $function$
BEGIN
    IF p_max_hold_ms IS NULL THEN
        RETURN NULL;
    END IF;
    IF p_max_hold_ms < 1000 OR p_max_hold_ms > 604800000 THEN
        RAISE EXCEPTION 'max_hold must be between 1000 and 604800000 ms, got %', p_max_hold_ms
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'max_hold_seconds';
    END IF;
    RETURN p_max_hold_ms * interval '1 millisecond';
END $function$;
COMMENT ON FUNCTION helix_max_hold(bigint) IS 'A hold limit in milliseconds as an interval (NULL: none); 22023 (naming max_hold_seconds) outside 1 s to 7 days (0033).';

ALTER TABLE helix_holds ADD COLUMN hold_limit_at timestamptz;
COMMENT ON COLUMN helix_holds.hold_limit_at IS 'The lock''s hold limit: acquired_at + max_hold_seconds, past which no lease of it runs (helix_holds_within_hold_limit) and no renewal is granted (0033). NULL: none.';
ALTER TABLE helix_holds ADD CONSTRAINT helix_holds_within_hold_limit CHECK (expires_at <= hold_limit_at);

ALTER TABLE helix_lock_history ADD COLUMN hold_limit_at timestamptz;
COMMENT ON COLUMN helix_lock_history.hold_limit_at IS 'As in helix_holds, copied at the end.';

CREATE FUNCTION helix_hold_limit_of(p_lock_id bigint, p_organization_id text)
 RETURNS timestamptz
 LANGUAGE plpgsql
 VOLATILE
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
BEGIN
    -- VOLATILE: read with a snapshot of its own, which shows the hold as the calling statement's
    -- acquire left it (inserted by it, or committed by a first call that a repeat waited for).
    RETURN (
        SELECT h.hold_limit_at FROM helix_holds AS h
        WHERE h.id = p_lock_id AND h.organization_id = p_organization_id
    );
END $function$;
REVOKE EXECUTE ON FUNCTION helix_hold_limit_of(bigint,text) FROM PUBLIC;
COMMENT ON FUNCTION helix_hold_limit_of(bigint,text) IS 'A live lock''s hold limit, as the statement that acquired it answers it: its own snapshot sees the hold that statement''s acquire inserted or a repeat was answered with (the statement''s snapshot may not), so a repeat is told the first grant''s limit (0033).';

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
            expired_xid, lapse_xids, session_id, shared, hold_limit_at
        )
        SELECT e.id, e.organization_id, e.job_type, e.slot, e.max_holders, e.holder, e.token,
               e.metadata, e.fencing_token, e.acquired_at, l.expires_at, e.ended_at, p_reason,
               p_forced_by, e.idempotency_key, e.reclaimed_lock_id, e.reclaimed_holder,
               e.reclaimed_expired_at, e.replayed, e.acquired_xid, l.renewed_xid, l.renewed_at,
               e.updated_xid, e.updated_at, pg_current_xact_id(), l.lapses,
               -- An end after the lease ran out announces the expiry, if no one did.
               CASE WHEN l.expired_xid IS NULL AND l.expires_at <= e.ended_at
                    THEN pg_current_xact_id() ELSE l.expired_xid END,
               l.lapse_xids, e.session_id, e.shared, e.hold_limit_at
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
COMMENT ON FUNCTION helix_end_holds(bigint[],timestamp with time zone,text,text,text,text,boolean) IS 'Ends live locks (release, force, reclaim): deletes their holds and inserts their history rows, with the lease in force (helix_hold_lease: a session''s, 0028) and session_id, dated p_at (NULL: the clock as each is deleted), in one statement; returns how many. Either the caller has locked the holds FOR UPDATE, or it gives the token (and organization) that a hold must have to end. p_alone: locks on their own only. The hold limit goes with the lock into its history (0033).';

DROP FUNCTION helix_acquire_job_lock(text,text,text,bigint,jsonb,text,integer,bigint,text);
CREATE FUNCTION helix_acquire_job_lock(p_organization_id text, p_job_type text, p_holder text, p_ttl_ms bigint, p_metadata jsonb, p_idempotency_key text, p_max_holders integer DEFAULT 1, p_place bigint DEFAULT NULL::bigint, p_mode text DEFAULT 'exclusive'::text, p_max_hold_ms bigint DEFAULT NULL::bigint)
 RETURNS TABLE(id bigint, organization_id text, job_type text, holder text, fencing_token bigint, acquired_at timestamp with time zone, expires_at timestamp with time zone, released_at timestamp with time zone, release_reason text, state text, ttl_remaining_ms bigint, metadata jsonb, max_holders integer, slot integer, token text, reclaimed_lock_id bigint, reclaimed_holder text, reclaimed_expired_at timestamp with time zone)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
#variable_conflict use_column
DECLARE
    v_lease interval := helix_lease(p_ttl_ms);
    v_max_hold interval := helix_max_hold(p_max_hold_ms);  -- NULL: no hold limit
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

        v_full := v_held > 0 AND (
            v_held >= v_room OR v_in_force <> p_max_holders OR v_in_force_shared <> v_shared
        );
        -- The pair's queue (0029), read under the pair's row lock, so that grants and the places
        -- they consume are judged one after the other: the live places before the caller's, as
        -- many as there are free slots at most (one when none is free). An index probe when nobody
        -- waits, and none read at all for the first place.
        IF v_id IS NULL AND EXISTS (
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
            INSERT INTO helix_holds (
                organization_id, job_type, holder, token, metadata, fencing_token, acquired_at,
                expires_at, idempotency_key, reclaimed_lock_id, reclaimed_holder, reclaimed_expired_at,
                max_holders, slot, shared, hold_limit_at
            )
            VALUES (
                p_organization_id, p_job_type, p_holder, v_token, p_metadata, v_fencing_token,
                -- The first lease ends at the hold limit at the latest (0033).
                v_now, v_now + least(v_lease, coalesce(v_max_hold, v_lease)), p_idempotency_key,
                v_reclaimed.id, v_reclaimed.holder, v_reclaimed.expires_at, p_max_holders, v_slot,
                v_shared, v_now + v_max_hold
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
        SELECT v.*, h.token, h.reclaimed_lock_id, h.reclaimed_holder, h.reclaimed_expired_at
        FROM helix_held_locks AS v
        JOIN helix_holds AS h ON h.id = v.id
        WHERE v.id = v_id;
END $function$;
REVOKE EXECUTE ON FUNCTION helix_acquire_job_lock(text,text,text,bigint,jsonb,text,integer,bigint,text,bigint) FROM PUBLIC;
COMMENT ON FUNCTION helix_acquire_job_lock(text,text,text,bigint,jsonb,text,integer,bigint,text,bigint) IS 'Grants a free slot of the pair, reclaiming expired locks and announcing the expiries of the others it leaves (0022), in one statement; or raises 23505 whose DETAIL names the lock whose lease runs out first and lists at most 20 holders, those whose leases run out first, with holders_total (0021): an answer bounded whatever max_holders. A lock of a session with the session''s lease, judged with the session''s row locked when it ran out (0028). Live places of the pair''s queue before p_place (every one, without p_place) take the free slots first: 23505 with DETAIL waiting and ahead (0029); a grant consumes its place. p_mode (0030): exclusive, or shared (max_holders 1, up to 1000 held together); a pair''s locks share one mode, and a place of the other mode ahead goes first. A reader''s grant reclaims every expired lock of the pair (0032). p_max_hold_ms: the hold limit, hold_limit_at = acquired_at + that, which no lease passes; NULL for none (0033).';

DROP FUNCTION helix_acquire_job_lock_on_share(text,text,text,bigint,jsonb,text,integer,bigint,bigint,text);
CREATE FUNCTION helix_acquire_job_lock_on_share(p_organization_id text, p_job_type text, p_holder text, p_ttl_ms bigint, p_metadata jsonb, p_idempotency_key text, p_max_holders integer, p_share bigint, p_place bigint DEFAULT NULL::bigint, p_mode text DEFAULT 'exclusive'::text, p_max_hold_ms bigint DEFAULT NULL::bigint)
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
        p_organization_id, p_job_type, p_holder, p_ttl_ms, p_metadata, p_idempotency_key, p_max_holders, p_place, p_mode,
        p_max_hold_ms
    );
    IF p_idempotency_key IS NOT NULL THEN  -- no call at all for an acquire without a key (0032)
        PERFORM helix_refuse_replay_of_another_mode(p_organization_id, p_job_type, p_holder, p_idempotency_key, p_mode);
    END IF;
END $function$;
REVOKE EXECUTE ON FUNCTION helix_acquire_job_lock_on_share(text,text,text,bigint,jsonb,text,integer,bigint,bigint,text,bigint) FROM PUBLIC;
COMMENT ON FUNCTION helix_acquire_job_lock_on_share(text,text,text,bigint,jsonb,text,integer,bigint,bigint,text,bigint) IS 'helix_acquire_job_lock, let through on a share of the quota: under the share''s advisory lock in shared mode to its commit, so that the share stays until it has committed; HL005 once the share is gone or past its time (migration 0020). p_place: the waiter''s place (0029). p_mode: exclusive or shared; a repeat of another mode is refused (0031). p_max_hold_ms: the hold limit (0033).';

DROP FUNCTION helix_acquire_job_lock_within_quota(text,text,text,bigint,jsonb,text,integer,integer,bigint,text);
CREATE FUNCTION helix_acquire_job_lock_within_quota(p_organization_id text, p_job_type text, p_holder text, p_ttl_ms bigint, p_metadata jsonb, p_idempotency_key text, p_quota integer, p_max_holders integer DEFAULT 1, p_place bigint DEFAULT NULL::bigint, p_mode text DEFAULT 'exclusive'::text, p_max_hold_ms bigint DEFAULT NULL::bigint)
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
    -- A shared acquire beside the pair's readers adds a lock too, up to 1000 of them (0031),
    -- unless a lock of the pair has expired: a reader's grant reclaims every one (0032). A lock
    -- of a session has the session's lease.
    SELECT count(*) FILTER (WHERE h.max_holders = p_max_holders AND h.shared = v_mode_shared) = count(*)
           AND count(*) < CASE WHEN v_mode_shared THEN 1000 ELSE p_max_holders END
           AND NOT (v_mode_shared AND coalesce(bool_or(
               CASE WHEN h.session_id IS NULL THEN h.expires_at
                    ELSE coalesce((SELECT s.expires_at FROM helix_sessions AS s WHERE s.id = h.session_id),
                                  h.expires_at)
               END <= clock_timestamp()), false)),
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
        p_organization_id, p_job_type, p_holder, p_ttl_ms, p_metadata, p_idempotency_key, p_max_holders, p_place, p_mode,
        p_max_hold_ms
    );
    IF p_idempotency_key IS NOT NULL THEN  -- no call at all for an acquire without a key (0032)
        PERFORM helix_refuse_replay_of_another_mode(p_organization_id, p_job_type, p_holder, p_idempotency_key, p_mode);
    END IF;
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
REVOKE EXECUTE ON FUNCTION helix_acquire_job_lock_within_quota(text,text,text,bigint,jsonb,text,integer,integer,bigint,text,bigint) FROM PUBLIC;
COMMENT ON FUNCTION helix_acquire_job_lock_within_quota(text,text,text,bigint,jsonb,text,integer,integer,bigint,text,bigint) IS 'helix_acquire_job_lock near the quota: counted and granted under the quota''s advisory lock held exclusively, holding back the room of the shares, or taking them back (waiting for the acquires in flight on them) when it needs it; HL004 beyond the quota. A repeat is judged by what the call itself did (migration 0020). p_place: the waiter''s place (0029). p_mode: exclusive or shared, a reader beside readers counted as a lock it adds; a repeat of another mode is refused (0031). p_max_hold_ms: the hold limit (0033).';

DROP FUNCTION helix_renew_job_lock(bigint,text,bigint,text);
CREATE FUNCTION helix_renew_job_lock(p_lock_id bigint, p_token text, p_ttl_ms bigint, p_organization_id text)
 RETURNS TABLE(id bigint, organization_id text, job_type text, holder text, fencing_token bigint, acquired_at timestamp with time zone, expires_at timestamp with time zone, released_at timestamp with time zone, release_reason text, state text, ttl_remaining_ms bigint, metadata jsonb, max_holders integer, slot integer, lapsed boolean, limited boolean)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
 SET plan_cache_mode TO 'force_generic_plan'
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
    -- A lock with a hold limit (0033) is renewed up to it, never past it (limited), and not at all
    -- once it has come: the lease ran out then, for good.
    IF v_lock.hold_limit_at <= v_now THEN
        RAISE EXCEPTION 'lock % reached its hold limit at %', p_lock_id, v_lock.hold_limit_at
            USING ERRCODE = 'HL012', DETAIL = json_build_object('hold_limit_at', v_lock.hold_limit_at)::text;
    END IF;
    UPDATE helix_holds AS h
    SET expires_at = least(v_now + v_lease, coalesce(v_lock.hold_limit_at, v_now + v_lease)), renewed_at = v_now
    WHERE h.organization_id = v_lock.organization_id AND h.job_type = v_lock.job_type
      AND h.slot = v_lock.slot;
    RETURN QUERY
        SELECT v.id, v.organization_id, v.job_type, v.holder, v.fencing_token, v.acquired_at,
               v.expires_at, v.released_at, v.release_reason, v.state, v.ttl_remaining_ms,
               v.metadata, v.max_holders, v.slot, v_lock.expires_at <= v_now,
               coalesce(v_now + v_lease > v_lock.hold_limit_at, false)
        FROM helix_held_locks AS v
        WHERE v.id = p_lock_id;
END $function$;
REVOKE EXECUTE ON FUNCTION helix_renew_job_lock(bigint,text,bigint,text) FROM PUBLIC;
COMMENT ON FUNCTION helix_renew_job_lock(bigint,text,bigint,text) IS 'A holder''s renewal: a new lease of p_ttl_ms from the database clock, a HOT update of the hold. Also renews a lease that ran out if nobody reclaimed it, and says so (lapsed). HL001, HL002 or HL003 otherwise; HL006 for a lock of a session, which is renewed with its session (0027). A lock with a hold limit is renewed up to hold_limit_at at most (limited: cut short by it), and after it not at all: HL012 (0033).';

-- A session's hold limit: max_hold_seconds at its opening, counted from its creation, bounds its
-- lease and so every one of its locks (each hold records it too, so that a lock of a session shows
-- it wherever a lock is shown). The last line of defence is the same CHECK on helix_sessions.

ALTER TABLE helix_sessions ADD COLUMN hold_limit_at timestamptz;
COMMENT ON COLUMN helix_sessions.hold_limit_at IS 'The session''s hold limit: created_at + max_hold_seconds, past which no lease of it runs (helix_sessions_within_hold_limit) and no renewal is granted; each of its locks has it too (0033). NULL: none.';
ALTER TABLE helix_sessions ADD CONSTRAINT helix_sessions_within_hold_limit CHECK (expires_at <= hold_limit_at);

ALTER TYPE helix_session_answer ADD ATTRIBUTE hold_limit_at timestamptz;
COMMENT ON TYPE helix_session_answer IS 'A session call''s answer, one row per unreleased lock of the session: the session (state held, expired or ended), lapsed (a renewal found its lease run out), replayed (an Idempotency-Key repeat), and the lock as helix_held_locks shows it, with its mode (shared, 0031), and the session''s hold limit, which is each of its locks'' (0033).';

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
           h.metadata, h.max_holders, h.slot, h.shared, s.hold_limit_at
    FROM helix_sessions AS s
    LEFT JOIN helix_holds AS h ON h.organization_id = s.organization_id AND h.session_id = s.id
    WHERE s.id = p_session_id AND (p_organization_id IS NULL OR s.organization_id = p_organization_id)
    ORDER BY h.job_type COLLATE "C", h.slot;
END $function$;
REVOKE EXECUTE ON FUNCTION helix_session_answer(bigint,text,boolean,boolean) FROM PUBLIC;
COMMENT ON FUNCTION helix_session_answer(bigint,text,boolean,boolean) IS 'A session (of the organization, unless NULL) and its unreleased locks, each with the session''s lease, one row per lock (one with NULL lock columns when it has none), with the session''s hold limit, which is each lock''s (0033).';

CREATE OR REPLACE FUNCTION helix_grant_session_locks(p_session helix_sessions, p_job_types text[], p_max_holders integer[], p_ttl_ms bigint, p_quota integer, p_share bigint, p_locks_limit integer, p_lengthen boolean, p_place bigint DEFAULT NULL::bigint, p_shared boolean[] DEFAULT NULL::boolean[])
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
                v_expires := least(greatest(v_expires, v_grant.expires_at), p_session.hold_limit_at);  -- (0033)
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

    -- A lock of a session has the session's hold limit (0033).
    UPDATE helix_holds AS h
    SET session_id = p_session.id, token = p_session.token, expires_at = v_expires,
        hold_limit_at = p_session.hold_limit_at
    WHERE h.id = ANY (v_ids);
    IF v_expires IS DISTINCT FROM p_session.expires_at THEN
        UPDATE helix_sessions AS s SET expires_at = v_expires WHERE s.id = p_session.id;
    END IF;
    RETURN v_ids;
END $function$;
REVOKE EXECUTE ON FUNCTION helix_grant_session_locks(helix_sessions,text[],integer[],bigint,integer,bigint,integer,boolean,bigint,boolean[]) FROM PUBLIC;
COMMENT ON FUNCTION helix_grant_session_locks(helix_sessions,text[],integer[],bigint,integer,bigint,integer,boolean,bigint,boolean[]) IS 'Grants pairs to a session all or none, each by helix_acquire_job_lock in job type order (a refusal raised with its job_type in DETAIL), on a share of the quota (HL005 once gone) or the exact way under the organization''s quota lock (HL004), within the bound on a session''s locks (HL008); the holds take the session''s token and lease (HL010 if an added lock''s ran out meanwhile). p_place: the waiting session''s order number in its pairs'' queues (0029). p_shared: each pair''s mode, NULL for all exclusive (0031). Returns the locks'' ids. Each lock takes the session''s hold limit, and an opening''s lease ends at it at the latest (0033).';

DROP FUNCTION helix_open_session(text,text,bigint,jsonb,text,text[],integer[],integer,bigint,integer,integer,bigint,boolean[]);
CREATE FUNCTION helix_open_session(p_organization_id text, p_holder text, p_ttl_ms bigint, p_metadata jsonb, p_idempotency_key text, p_job_types text[], p_max_holders integer[], p_quota integer, p_share bigint, p_sessions_limit integer, p_locks_limit integer, p_place bigint DEFAULT NULL::bigint, p_shared boolean[] DEFAULT NULL::boolean[], p_max_hold_ms bigint DEFAULT NULL::bigint)
 RETURNS SETOF helix_session_answer
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
DECLARE
    v_lease interval := helix_lease(p_ttl_ms);
    v_max_hold interval := helix_max_hold(p_max_hold_ms);  -- NULL: no hold limit (0033)
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
    INSERT INTO helix_sessions AS s (
        organization_id, holder, token, metadata, idempotency_key, created_at, expires_at, hold_limit_at
    )
    VALUES (
        p_organization_id, p_holder, helix_new_token(), p_metadata, p_idempotency_key, v_now,
        v_now + least(v_lease, coalesce(v_max_hold, v_lease)), v_now + v_max_hold
    )
    RETURNING s.* INTO v_session;
    PERFORM helix_grant_session_locks(
        v_session, p_job_types, p_max_holders, p_ttl_ms, p_quota, p_share, p_locks_limit, true, p_place, p_shared
    );
    PERFORM helix_session_count_lock(v_session, p_sessions_limit);
    RETURN QUERY SELECT * FROM helix_session_answer(v_session.id, p_organization_id, false, false);
END $function$;
REVOKE EXECUTE ON FUNCTION helix_open_session(text,text,bigint,jsonb,text,text[],integer[],integer,bigint,integer,integer,bigint,boolean[],bigint) FROM PUBLIC;
COMMENT ON FUNCTION helix_open_session(text,text,bigint,jsonb,text,text[],integer[],integer,bigint,integer,integer,bigint,boolean[],bigint) IS 'POST /v1/sessions: opens a session and grants its locks in one statement, all or none, or answers the open session of a repeat (same organization, holder and Idempotency-Key) unless it lost a lock; HL009 past the bound on open sessions. p_place: a waiting opening''s order number in its pairs'' queues (0029). p_shared: each lock''s mode, NULL for all exclusive (0031). p_max_hold_ms: the session''s hold limit, hold_limit_at = created_at + that, which no lease of it or of its locks passes (0033).';

CREATE OR REPLACE FUNCTION helix_renew_session(p_session_id bigint, p_token text, p_ttl_ms bigint, p_organization_id text, p_sessions_limit integer)
 RETURNS SETOF helix_session_answer
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
 SET plan_cache_mode TO 'force_generic_plan'
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
    -- A session with a hold limit (0033) is renewed up to it, never past it, and not at all once
    -- it has come: its lease ran out then, for good, and its locks are reclaimed as any.
    IF v_session.hold_limit_at <= v_now THEN
        RAISE EXCEPTION 'session % reached its hold limit at %', p_session_id, v_session.hold_limit_at
            USING ERRCODE = 'HL012', DETAIL = json_build_object('hold_limit_at', v_session.hold_limit_at)::text;
    END IF;
    v_lapsed := v_session.expires_at <= v_now;
    IF v_lapsed THEN
        PERFORM helix_session_count_lock(v_session, p_sessions_limit);
    END IF;
    -- A HOT update: nothing it changes is indexed. A lease that ran out (announced or not) is a
    -- lapse of every lock of the session, as a lock's renewal records its own.
    UPDATE helix_sessions AS s
    SET expires_at = least(v_now + v_lease, coalesce(v_session.hold_limit_at, v_now + v_lease)), renewed_at = v_now, renewed_xid = v_xid, changed_xid = v_xid,
        lapses = CASE WHEN v_lapsed OR s.expired_xid IS NOT NULL
                      THEN array_append(s.lapses, s.expires_at) ELSE s.lapses END,
        lapse_xids = CASE WHEN v_lapsed OR s.expired_xid IS NOT NULL
                          THEN array_append(s.lapse_xids, coalesce(s.expired_xid, v_xid)) ELSE s.lapse_xids END,
        expired_xid = NULL
    WHERE s.id = p_session_id;
    RETURN QUERY SELECT * FROM helix_session_answer(p_session_id, p_organization_id, v_lapsed, false);
END $function$;
REVOKE EXECUTE ON FUNCTION helix_renew_session(bigint,text,bigint,text,integer) FROM PUBLIC;
COMMENT ON FUNCTION helix_renew_session(bigint,text,bigint,text,integer) IS 'POST /v1/sessions/{id}/renew: a new lease for the session, and so for each of its locks, by an update of its row alone (0028); lapsed: it had run out, and it counts against the bound on open sessions again (HL009). A session that lost a lock ends instead, its other locks released (session_state ended, end_reason lost). Up to the session''s hold limit at most, and after it not at all: HL012 (0033).';
