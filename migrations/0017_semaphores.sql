-- Semaphores (issue 21): up to max_holders live locks for one (organization, job type) at once,
-- each a lock of its own (id, token, lease, renewal, release) in a slot from 0 to max_holders - 1.
--
-- The one rule still holds: helix_acquire_job_lock reclaims an expired lock of the pair and grants
-- a free slot in ONE statement, and a full pair raises 23505.
-- - Every acquire of a pair still begins with the pair's fencing counter (0003): its row lock
--   serialises the pair's grants until commit, so tokens still increase in commit order, now
--   across all slots, and no two acquires choose a slot at once.
-- - The acquire then locks every unreleased lock of the pair (FOR UPDATE, which waits out a
--   renewal or release in flight and sees its outcome), reads the clock, and counts those held.
-- - The partial unique index, kept under its name, now includes slot, and a CHECK keeps the slot
--   below max_holders: the database itself refuses two live locks in one slot, or a slot the
--   semaphore does not have.
-- - The held locks of a pair share one max_holders. An acquire naming another value while any is
--   held raises 23505 too, its DETAIL naming the value in force (max_holders_in_force): the service
--   answers 409 max-holders-mismatch, and a replica of the previous build, which does not know
--   that field, answers 409 lock-held, still a refusal. An expired lock of another value is always
--   reclaimed along, so that when none is held, such an acquire starts the pair afresh.
-- - A free slot is taken first (the lowest); else the lock that expired first is reclaimed and its
--   slot taken. max_holders 1 is exactly the acquire of before: slot 0, free or reclaimed.
--
-- Rolling upgrade: the previous build calls helix_acquire_job_lock with six arguments and the
-- quota's acquire with seven; both now take max_holders last, default 1, so those calls still
-- resolve, and the previous build reads the columns it names (it never selects `*`). Every lock it
-- grants has max_holders 1, slot 0, as every row has from this migration on.
--
-- helix_job_lock_views gains max_holders and slot. The functions that return a view row plus
-- columns of their own (acquire, the quota's acquire, renew) return a new row type, so they are
-- dropped and created again: EXECUTE comes back to a serving role by the default privileges of
-- docs/operations.md (or its GRANT ... ON ALL FUNCTIONS after the upgrade).

ALTER TABLE helix_job_locks
    ADD COLUMN max_holders integer NOT NULL DEFAULT 1,
    ADD COLUMN slot integer NOT NULL DEFAULT 0,
    ADD CONSTRAINT helix_job_locks_slot_within
        CHECK (max_holders BETWEEN 1 AND 1000 AND slot >= 0 AND slot < max_holders);

DROP INDEX helix_job_locks_one_live;
CREATE UNIQUE INDEX helix_job_locks_one_live
    ON helix_job_locks (organization_id, job_type, slot)
    WHERE released_at IS NULL;

CREATE OR REPLACE VIEW helix_job_lock_views AS
SELECT
    l.id,
    l.organization_id,
    l.job_type,
    l.holder,
    l.fencing_token,
    l.acquired_at,
    l.expires_at,
    l.released_at,
    l.release_reason,
    CASE
        WHEN l.release_reason = 'reclaimed' THEN 'reclaimed'
        WHEN l.released_at IS NOT NULL THEN 'released'
        WHEN l.expires_at <= clock_timestamp() THEN 'expired'
        ELSE 'held'
    END AS state,
    CASE
        WHEN l.released_at IS NULL
            THEN greatest(0, floor(extract(epoch FROM l.expires_at - clock_timestamp()) * 1000))::bigint
        ELSE 0::bigint
    END AS ttl_remaining_ms,
    l.metadata,
    l.max_holders,
    l.slot
FROM helix_job_locks AS l;

DROP FUNCTION helix_acquire_job_lock_within_quota(text, text, text, bigint, jsonb, text, integer);
DROP FUNCTION helix_acquire_job_lock(text, text, text, bigint, jsonb, text);

CREATE FUNCTION helix_acquire_job_lock(
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
                          'holders', (
                              SELECT json_agg(json_build_object(
                                  'lock_id', h.id, 'holder', h.holder, 'slot', h.slot,
                                  'expires_at', h.expires_at
                              ) ORDER BY h.slot)
                              FROM unnest(v_live) AS h
                              WHERE h.expires_at > v_now
                          )
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

-- The quota's acquire of 0013: an acquire adds a live lock when it takes a free slot, which it
-- does when the pair's unreleased locks are all of its max_holders and fewer than it (with
-- max_holders 1: when the pair has none, as before).
CREATE FUNCTION helix_acquire_job_lock_within_quota(
    p_organization_id text,
    p_job_type text,
    p_holder text,
    p_ttl_ms bigint,
    p_metadata jsonb,
    p_idempotency_key text,
    p_quota integer,
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
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('helix_live_lock_quota'), hashtext(p_organization_id));
    IF (
        SELECT count(*) FILTER (WHERE l.max_holders = p_max_holders) = count(*)
               AND count(*) < p_max_holders
        FROM helix_job_locks AS l
        WHERE l.organization_id = p_organization_id AND l.job_type = p_job_type AND l.released_at IS NULL
    ) AND (
        SELECT count(*) FROM helix_job_locks AS l
        WHERE l.organization_id = p_organization_id AND l.released_at IS NULL
    ) >= p_quota THEN
        RAISE EXCEPTION 'organization % has its quota of live locks', p_organization_id
            USING ERRCODE = 'HL004', DETAIL = p_quota::text;
    END IF;
    RETURN QUERY SELECT * FROM helix_acquire_job_lock(
        p_organization_id, p_job_type, p_holder, p_ttl_ms, p_metadata, p_idempotency_key, p_max_holders
    );
END $$;

-- Renew of 0012, returning the view's new columns too.
DROP FUNCTION helix_renew_job_lock(bigint, text, bigint, text);
CREATE FUNCTION helix_renew_job_lock(p_lock_id bigint, p_token text, p_ttl_ms bigint, p_organization_id text)
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
    lapsed boolean
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
    v_lease interval := helix_lease(p_ttl_ms);
    v_lock helix_job_locks%ROWTYPE := helix_lock_for_holder(p_lock_id, p_token, p_organization_id, true);
    v_now timestamptz := clock_timestamp();
BEGIN
    -- A lapsed lease nobody reclaimed may be renewed: no one else can have held the lock.
    UPDATE helix_job_locks SET expires_at = v_now + v_lease WHERE id = p_lock_id;
    RETURN QUERY
        SELECT v.*, v_lock.expires_at <= v_now
        FROM helix_job_lock_views AS v
        WHERE v.id = p_lock_id;
END $$;

REVOKE EXECUTE ON FUNCTION
    helix_acquire_job_lock(text, text, text, bigint, jsonb, text, integer),
    helix_acquire_job_lock_within_quota(text, text, text, bigint, jsonb, text, integer, integer),
    helix_renew_job_lock(bigint, text, bigint, text)
FROM PUBLIC;
