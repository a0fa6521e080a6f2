-- A grant on a pair with no live lock, the common case, runs no statement to choose its slot or
-- to find the pair's lapsed leases (issue 37).
--
-- The acquire chose the lowest free slot with a query over generate_series and the pair's live
-- locks, and gathered the leases that lapsed with another over the live locks: two statements a
-- grant, each an executor started and ended, even when the pair had no live lock at all, where
-- the slot is 0 and nothing lapsed. Now they run only when there are live locks to read (the
-- lapsed ones: when some live lock is not being reclaimed). The rest is as 0023 wrote it.
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
        END LOOP;

        -- The clock is read after every wait: any end seen above committed before this moment,
        -- so a grant never starts before its predecessor ended.
        v_now := clock_timestamp();

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
                  AND h.id = ANY (v_lapsed);
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
