-- Shared locks, reviewed (issue 40, after 0030 and 0031; an adversary's findings):
--
-- - A reader's grant reclaims every expired lock of its pair, readers' included. Before, an
--   expired reader was reclaimed only by a writer, or by a reader once all 1000 slots had rows, so
--   dead readers piled up as live locks against the organization's quota (200 of them shut an
--   organization with a quota of 200 out of every key). The quota's exact count knows it: a
--   reader beside an expired lock of its pair adds none.
-- - A repeat of an acquire (Idempotency-Key and holder) is refused when the lock it was answered
--   with is of the other mode, judged by the row the call itself claimed (written by this
--   transaction), not by a lease still running: a repeat racing the first lease's end was handed
--   the reader's lock as an exclusive one.
-- - A retry taking over the places of the try it repeats (helix_take_places) does so only when
--   they name the same pairs with the same max_holders and mode: a writer's retry no longer holds
--   a reader's place, which readers pass.
-- - A semaphore's acquire that meets readers is a conflict (lock-held, mode shared), not a
--   max-holders-mismatch asking for max_holders 1; waiters-ahead names the held locks' mode too.
-- - The quota's two ways call that check only for an acquire with an Idempotency-Key.

CREATE OR REPLACE FUNCTION helix_refuse_replay_of_another_mode(p_organization_id text, p_job_type text, p_holder text, p_idempotency_key text, p_mode text)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path FROM CURRENT
AS $function$
BEGIN
    -- The lock a repeat answers is the one its call claimed (helix_claim_replay, or the original
    -- found under the pair's lock), marking it replayed: a row this transaction wrote. A fresh
    -- grant has the mode asked. (xmin compared as text, as helix_holds_modes_apart does.)
    IF p_idempotency_key IS NOT NULL AND EXISTS (
        SELECT FROM helix_holds AS h
        WHERE h.organization_id = p_organization_id AND h.job_type = p_job_type
          AND h.idempotency_key = p_idempotency_key AND h.holder = p_holder
          AND h.shared <> (p_mode = 'shared')
          AND h.xmin::text = (pg_current_xact_id()::text::bigint % 4294967296)::text
    ) THEN
        RAISE EXCEPTION 'this Idempotency-Key got a lock of the other mode: a repeat names the mode of the first call'
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'mode';
    END IF;
END $function$;
COMMENT ON FUNCTION helix_refuse_replay_of_another_mode(text,text,text,text,text) IS 'After an acquire with an Idempotency-Key: 22023 (column mode) when the lock of that key and holder that this transaction wrote (a repeat claims its grant so) is of another mode than p_mode: the acquire repeated a call that asked the other mode (0031; judged by the row written, not by its lease, since 0032).';

CREATE OR REPLACE FUNCTION helix_acquire_job_lock_on_share(p_organization_id text, p_job_type text, p_holder text, p_ttl_ms bigint, p_metadata jsonb, p_idempotency_key text, p_max_holders integer, p_share bigint, p_place bigint DEFAULT NULL::bigint, p_mode text DEFAULT 'exclusive')
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
    IF p_idempotency_key IS NOT NULL THEN  -- no call at all for an acquire without a key (0032)
        PERFORM helix_refuse_replay_of_another_mode(p_organization_id, p_job_type, p_holder, p_idempotency_key, p_mode);
    END IF;
END $function$;

CREATE OR REPLACE FUNCTION helix_acquire_job_lock_within_quota(p_organization_id text, p_job_type text, p_holder text, p_ttl_ms bigint, p_metadata jsonb, p_idempotency_key text, p_quota integer, p_max_holders integer DEFAULT 1, p_place bigint DEFAULT NULL::bigint, p_mode text DEFAULT 'exclusive')
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
        p_organization_id, p_job_type, p_holder, p_ttl_ms, p_metadata, p_idempotency_key, p_max_holders, p_place, p_mode
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

CREATE OR REPLACE FUNCTION helix_acquire_job_lock(p_organization_id text, p_job_type text, p_holder text, p_ttl_ms bigint, p_metadata jsonb, p_idempotency_key text, p_max_holders integer DEFAULT 1, p_place bigint DEFAULT NULL, p_mode text DEFAULT 'exclusive')
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
                max_holders, slot, shared
            )
            VALUES (
                p_organization_id, p_job_type, p_holder, v_token, p_metadata, v_fencing_token,
                v_now, v_now + v_lease, p_idempotency_key, v_reclaimed.id, v_reclaimed.holder,
                v_reclaimed.expires_at, p_max_holders, v_slot, v_shared
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
COMMENT ON FUNCTION helix_acquire_job_lock(text,text,text,bigint,jsonb,text,integer,bigint,text) IS 'Grants a free slot of the pair, reclaiming expired locks and announcing the expiries of the others it leaves (0022), in one statement; or raises 23505 whose DETAIL names the lock whose lease runs out first and lists at most 20 holders, those whose leases run out first, with holders_total (0021): an answer bounded whatever max_holders. A lock of a session with the session''s lease, judged with the session''s row locked when it ran out (0028). Live places of the pair''s queue before p_place (every one, without p_place) take the free slots first: 23505 with DETAIL waiting and ahead (0029); a grant consumes its place. p_mode (0030): exclusive, or shared (max_holders 1, up to 1000 held together); a pair''s locks share one mode, and a place of the other mode ahead goes first. A reader''s grant reclaims every expired lock of the pair (0032).';

CREATE OR REPLACE FUNCTION helix_take_places(p_organization_id text, p_job_types text[], p_holder text, p_max_holders integer[], p_seconds double precision, p_replica text, p_owner text, p_idempotency_key text, p_shared boolean[] DEFAULT NULL)
 RETURNS bigint
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
DECLARE
    v_seq bigint;
BEGIN
    DELETE FROM helix_lock_waiters
    WHERE id IN (
        SELECT w.id FROM helix_lock_waiters AS w
        WHERE w.until < clock_timestamp()
        FOR UPDATE SKIP LOCKED  -- places never wait for each other
    );
    -- A retry with the same Idempotency-Key and holder keeps the places of the try it repeats,
    -- while they live: they become this request's.
    IF p_idempotency_key IS NOT NULL THEN
        -- The same request: places in exactly the pairs it asks for (not a session's, for an
        -- acquire of one of its pairs with the same key), so that its grant consumes them all;
        -- each with the max_holders and mode it asks for (0032: a writer's retry does not take
        -- over a reader's place, which readers may pass, nor the other way round).
        SELECT q.seq INTO v_seq FROM helix_lock_waiters AS q
        WHERE q.organization_id = p_organization_id AND q.job_type = p_job_types[1]
          AND q.idempotency_key = p_idempotency_key AND q.holder = p_holder
          AND q.until > clock_timestamp()
          AND (
              SELECT array_agg((w.job_type, w.max_holders, coalesce(w.shared, false)) ORDER BY w.job_type COLLATE "C")
              FROM helix_lock_waiters AS w
              WHERE w.organization_id = p_organization_id AND w.seq = q.seq
          ) IS NOT DISTINCT FROM (
              SELECT array_agg((j.job_type, j.max_holders, coalesce(j.shared, false)) ORDER BY j.job_type COLLATE "C")
              FROM unnest(p_job_types, p_max_holders, coalesce(p_shared, '{}')) AS j (job_type, max_holders, shared)
          )
        ORDER BY q.seq
        LIMIT 1;
        IF v_seq IS NOT NULL THEN
            UPDATE helix_lock_waiters AS w
            SET owner = p_owner, replica = p_replica,
                until = greatest(w.until, clock_timestamp() + make_interval(secs => p_seconds))
            WHERE w.organization_id = p_organization_id AND w.seq = v_seq;
            RETURN v_seq;
        END IF;
    END IF;
    v_seq := nextval('helix_lock_waiters_seq');
    INSERT INTO helix_lock_waiters (
        organization_id, job_type, until, replica, holder, max_holders, waiting_since, owner, idempotency_key, seq,
        shared
    )
    SELECT p_organization_id, j.job_type, clock_timestamp() + make_interval(secs => p_seconds), p_replica,
           p_holder, j.max_holders, clock_timestamp(), p_owner, p_idempotency_key, v_seq,
           coalesce(j.shared, false)
    FROM unnest(p_job_types, p_max_holders, coalesce(p_shared, '{}')) AS j (job_type, max_holders, shared);
    RETURN v_seq;
END $function$;

CREATE OR REPLACE FUNCTION helix_raise_held(p_live helix_holds[], p_now timestamp with time zone, p_max_holders integer)
 RETURNS void
 LANGUAGE plpgsql
AS $function$
DECLARE
    v_first helix_holds%ROWTYPE;
    v_held integer;
BEGIN
    SELECT * INTO v_first FROM unnest(p_live) AS u
    WHERE u.expires_at > p_now
    ORDER BY u.expires_at, u.slot
    LIMIT 1;
    SELECT count(*) INTO v_held FROM unnest(p_live) AS u WHERE u.expires_at > p_now;
    RAISE EXCEPTION 'lock % is held', v_first.id
        USING ERRCODE = 'unique_violation',
              CONSTRAINT = 'helix_holds_pkey',
              DETAIL = json_build_object(
                  'lock_id', v_first.id,
                  'holder', v_first.holder,
                  'expires_at', v_first.expires_at,
                  'retry_after_seconds',
                      greatest(1, ceil(extract(epoch FROM v_first.expires_at - p_now))),
                  -- The held locks share one max_holders: a grant of another waits for them all.
                  'max_holders', v_first.max_holders,
                  -- Readers (max_holders 1) met by a semaphore's acquire: a conflict of modes,
                  -- lock-held, not a value to agree on (0032).
                  'max_holders_in_force',
                      CASE WHEN v_first.max_holders <> p_max_holders AND NOT v_first.shared
                           THEN v_first.max_holders END,
                  'holders', (
                      SELECT json_agg(json_build_object(
                          'lock_id', h.id, 'holder', h.holder, 'slot', h.slot,
                          'expires_at', h.expires_at
                      ) ORDER BY h.expires_at, h.slot)
                      FROM (
                          SELECT * FROM unnest(p_live) AS u
                          WHERE u.expires_at > p_now
                          ORDER BY u.expires_at, u.slot
                          LIMIT 20
                      ) AS h
                  ),
                  'holders_total', v_held,
                  -- The mode of the held locks (0030): one mode at a time.
                  'mode', CASE WHEN v_first.shared THEN 'shared' ELSE 'exclusive' END
              )::text;
END $function$;
