-- A grant of a semaphore's free slot announces the expiries it found among the pair's other
-- leases (migration 0019's events).
--
-- An acquire locks every unreleased lock of its pair and reads the clock. A lease that ran out and
-- that the grant reclaims is announced by the reclaim (0019's trigger); one it leaves to its
-- holder, because it took a free slot, was announced later by an event reader, in a later window:
-- a live stream then sent the grant before that expiry, and a resume, reading both in one window
-- sorted by time, sent them the other way round. Announced by the grant, the expiry comes before
-- it in every stream. It costs a write only when such a lease exists.
--
-- The acquire of 0021, with that UPDATE after the reclaim.
CREATE OR REPLACE FUNCTION helix_acquire_job_lock(
    p_organization_id text,
    p_job_type text,
    p_holder text,
    p_ttl_ms bigint,
    p_metadata jsonb,
    p_idempotency_key text,
    p_max_holders integer DEFAULT 1
)
RETURNS TABLE (
    id bigint,
    organization_id text,
    job_type text,
    holder text,
    fencing_token bigint,
    acquired_at timestamptz,
    expires_at timestamptz,
    released_at timestamptz,
    release_reason text,
    state text,
    ttl_remaining_ms bigint,
    metadata jsonb,
    max_holders integer,
    slot integer,
    token text,
    reclaimed_lock_id bigint,
    reclaimed_holder text,
    reclaimed_expired_at timestamptz
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
    v_lease interval := helix_lease(p_ttl_ms);
    v_token text := helix_new_token();
    v_fencing_token bigint;
    v_lock helix_job_locks%ROWTYPE;
    v_live helix_job_locks[] := '{}';  -- the pair's unreleased locks, by slot
    v_held integer := 0;
    v_in_force integer;  -- the held locks' max_holders
    v_first helix_job_locks%ROWTYPE;  -- the held lock whose lease runs out first
    v_reclaim bigint[] := '{}';
    v_lapsed bigint[];  -- the pair's leases that ran out, unannounced, left to their holders
    v_reclaimed helix_job_locks%ROWTYPE;  -- the one the answer names
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
        -- tokens increase in commit order across slots. A conflict below rolls it back.
        INSERT INTO helix_lock_keys AS k (organization_id, job_type, last_fencing_token)
        VALUES (p_organization_id, p_job_type, 1)
        ON CONFLICT (organization_id, job_type)
            DO UPDATE SET last_fencing_token = k.last_fencing_token + 1
        RETURNING k.last_fencing_token INTO v_fencing_token;

        -- FOR UPDATE waits out a renewal or release in flight and then sees its outcome.
        FOR v_lock IN
            SELECT * FROM helix_job_locks AS l
            WHERE l.organization_id = p_organization_id
              AND l.job_type = p_job_type
              AND l.released_at IS NULL
            ORDER BY l.slot
            FOR UPDATE
        LOOP
            v_live := v_live || v_lock;
        END LOOP;

        -- The clock is read after every wait: any release seen above committed before this
        -- moment, so a grant never starts before its predecessor ended.
        v_now := clock_timestamp();

        FOREACH v_lock IN ARRAY v_live LOOP
            IF v_lock.expires_at > v_now THEN
                v_held := v_held + 1;
                v_in_force := v_lock.max_holders;
                IF v_first.id IS NULL OR v_lock.expires_at < v_first.expires_at THEN
                    v_first := v_lock;
                END IF;
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
            UPDATE helix_job_locks AS l SET replayed = true WHERE l.id = v_id;
        ELSIF v_held > 0 AND (v_held >= p_max_holders OR v_in_force <> p_max_holders) THEN
            RAISE EXCEPTION 'lock % is held', v_first.id
                USING ERRCODE = 'unique_violation',
                      CONSTRAINT = 'helix_job_locks_one_live',
                      DETAIL = json_build_object(
                          'lock_id', v_first.id,
                          'holder', v_first.holder,
                          'expires_at', v_first.expires_at,
                          'retry_after_seconds',
                              greatest(1, ceil(extract(epoch FROM v_first.expires_at - v_now))),
                          'max_holders', v_in_force,
                          'max_holders_in_force',
                              CASE WHEN v_in_force <> p_max_holders THEN v_in_force END,
                          -- At most 20, those whose leases run out first, and how many (0021).
                          'holders', (
                              SELECT json_agg(json_build_object(
                                  'lock_id', h.id, 'holder', h.holder, 'slot', h.slot,
                                  'expires_at', h.expires_at
                              ) ORDER BY h.expires_at, h.slot)
                              FROM (
                                  SELECT * FROM unnest(v_live) AS u
                                  WHERE u.expires_at > v_now
                                  ORDER BY u.expires_at, u.slot
                                  LIMIT 20
                              ) AS h
                          ),
                          'holders_total', v_held
                      )::text;
        ELSE
            -- The lowest slot that no unreleased lock of this value holds; else the slot of the
            -- lock that expired first, reclaimed.
            SELECT s INTO v_slot
            FROM generate_series(0, p_max_holders - 1) AS s
            WHERE s NOT IN (SELECT h.slot FROM unnest(v_live) AS h WHERE h.id <> ALL (v_reclaim))
            ORDER BY s
            LIMIT 1;
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
                UPDATE helix_job_locks AS l
                SET released_at = v_now, release_reason = 'reclaimed'
                WHERE l.id = ANY (v_reclaim);
            END IF;
            -- The pair's other leases that ran out, which this grant leaves to their holders (it
            -- took a free slot): announced here, under the row locks taken above, so that every
            -- stream sends each expiry before this grant, live or resumed (0019, 0022).
            v_lapsed := ARRAY(
                SELECT h.id FROM unnest(v_live) AS h
                WHERE h.expires_at <= v_now AND h.expired_xid IS NULL AND h.id <> ALL (v_reclaim)
            );
            IF cardinality(v_lapsed) > 0 THEN  -- rarely: no statement otherwise
                UPDATE helix_job_locks AS l SET expired_xid = pg_current_xact_id()
                WHERE l.id = ANY (v_lapsed);
            END IF;
            INSERT INTO helix_job_locks (
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
        SELECT v.*, l.token, l.reclaimed_lock_id, l.reclaimed_holder, l.reclaimed_expired_at
        FROM helix_job_lock_views AS v
        JOIN helix_job_locks AS l ON l.id = v.id
        WHERE v.id = v_id;
END $$;

COMMENT ON FUNCTION helix_acquire_job_lock(text, text, text, bigint, jsonb, text, integer) IS
    'Grants a free slot of the pair, reclaiming expired locks and announcing the expiries of the '
    'others it leaves (0022), in one statement; or raises 23505 whose DETAIL names the lock whose '
    'lease runs out first and lists at most 20 holders, those whose leases run out first, with '
    'holders_total (0021): an answer bounded whatever max_holders.';
