-- Idempotent acquire: a worker whose answer was lost in the network repeats its acquire with the
-- same Idempotency-Key and gets the same lock and token back, instead of locking itself out
-- until the lease lapses. The key is kept on the lock row, so it is scoped to that organization
-- and job type and ends with the lock; a repeat must also name the same holder (and the service
-- prefixes the key with the caller's API key id), so that nobody else can replay a grant.
ALTER TABLE helix_job_locks ADD COLUMN idempotency_key text;

CREATE FUNCTION helix_acquire_job_lock(
    p_organization_id text,
    p_job_type text,
    p_holder text,
    p_ttl_ms bigint,
    p_metadata jsonb,
    p_idempotency_key text
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
    token text,
    reclaimed_lock_id bigint,
    reclaimed_holder text,
    reclaimed_expired_at timestamptz
)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    v_lease interval := helix_lease(p_ttl_ms);
    v_token text := replace(gen_random_uuid()::text, '-', '');
    v_fencing_token bigint;
    v_live helix_job_locks%ROWTYPE;
    v_now timestamptz;
    v_id bigint;
BEGIN
    -- A repeat of a grant that is still live answers as the first time did.
    IF p_idempotency_key IS NOT NULL THEN
        SELECT * INTO v_live
        FROM helix_job_locks AS l
        WHERE l.organization_id = p_organization_id
          AND l.job_type = p_job_type
          AND l.released_at IS NULL
          AND l.idempotency_key = p_idempotency_key
          AND l.holder = p_holder
          AND l.expires_at > clock_timestamp();
        IF v_live.id IS NOT NULL THEN
            RETURN QUERY
                SELECT v.*, v_live.token, r.id, r.holder, r.expires_at
                FROM helix_job_lock_views AS v
                LEFT JOIN helix_job_locks AS r
                    ON r.organization_id = p_organization_id
                   AND r.job_type = p_job_type
                   AND r.release_reason = 'reclaimed'
                   AND r.released_at = v_live.acquired_at
                WHERE v.id = v_live.id;
            RETURN;
        END IF;
    END IF;

    -- From here as in 0003: the key's row lock serialises every grant for this key until commit,
    -- so fencing tokens increase in commit order. A conflict below rolls the increment back.
    INSERT INTO helix_lock_keys AS k (organization_id, job_type, last_fencing_token)
    VALUES (p_organization_id, p_job_type, 1)
    ON CONFLICT (organization_id, job_type)
        DO UPDATE SET last_fencing_token = k.last_fencing_token + 1
    RETURNING k.last_fencing_token INTO v_fencing_token;

    SELECT * INTO v_live
    FROM helix_job_locks AS l
    WHERE l.organization_id = p_organization_id
      AND l.job_type = p_job_type
      AND l.released_at IS NULL
    FOR UPDATE;

    v_now := clock_timestamp();

    IF v_live.id IS NOT NULL THEN
        IF v_live.expires_at > v_now THEN
            RAISE EXCEPTION 'lock % is held', v_live.id
                USING ERRCODE = 'unique_violation',
                      CONSTRAINT = 'helix_job_locks_one_live',
                      DETAIL = json_build_object(
                          'lock_id', v_live.id,
                          'holder', v_live.holder,
                          'expires_at', v_live.expires_at,
                          'retry_after_seconds',
                              greatest(1, ceil(extract(epoch FROM v_live.expires_at - v_now)))
                      )::text;
        END IF;
        UPDATE helix_job_locks
        SET released_at = v_now, release_reason = 'reclaimed'
        WHERE id = v_live.id;
    END IF;

    INSERT INTO helix_job_locks (
        organization_id, job_type, holder, token, metadata, fencing_token, acquired_at, expires_at,
        idempotency_key
    )
    VALUES (
        p_organization_id, p_job_type, p_holder, v_token, p_metadata, v_fencing_token,
        v_now, v_now + v_lease, p_idempotency_key
    )
    RETURNING id INTO v_id;

    RETURN QUERY
        SELECT v.*, v_token, v_live.id, v_live.holder, v_live.expires_at
        FROM helix_job_lock_views AS v
        WHERE v.id = v_id;
END $$;

-- The five-argument form of 0003 (for replicas still running the code before this migration)
-- becomes the same function without a key.
CREATE OR REPLACE FUNCTION helix_acquire_job_lock(
    p_organization_id text,
    p_job_type text,
    p_holder text,
    p_ttl_ms bigint,
    p_metadata jsonb DEFAULT NULL
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
    token text,
    reclaimed_lock_id bigint,
    reclaimed_holder text,
    reclaimed_expired_at timestamptz
)
LANGUAGE sql VOLATILE AS $$
    SELECT * FROM helix_acquire_job_lock(
        p_organization_id, p_job_type, p_holder, p_ttl_ms, p_metadata, NULL::text
    )
$$;
