-- The fix for crashed holders: acquisition becomes ONE call of helix_acquire_job_lock, which in
-- the same statement reclaims a lock whose own lease has run out and grants the new one. Release
-- and renewal are single function calls too. Every time here is the database clock.
--
-- Errors are SQLSTATEs, so callers branch on codes rather than message text:
--   23505 unique_violation         a live lock holds the key (DETAIL: JSON naming it)
--   22023 invalid_parameter_value  a TTL out of range
--   HL001                          no such lock
--   HL002                          the token does not match the lock
--   HL003                          the lock has already ended (DETAIL: JSON saying how and when)

-- Lock rows as clients see them: state and remaining lease on the database clock, no token.
CREATE VIEW helix_job_lock_views AS
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
    l.metadata
FROM helix_job_locks AS l;

-- A lease length, checked: 1 s to 24 h, in milliseconds.
CREATE FUNCTION helix_lease(p_ttl_ms bigint) RETURNS interval
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF p_ttl_ms IS NULL OR p_ttl_ms < 1000 OR p_ttl_ms > 86400000 THEN
        RAISE EXCEPTION 'ttl must be between 1000 and 86400000 ms, got %', p_ttl_ms
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'ttl_seconds';
    END IF;
    RETURN p_ttl_ms * interval '1 millisecond';
END $$;

CREATE FUNCTION helix_acquire_job_lock(
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
    -- The key's row lock serialises every grant for this key until commit, so fencing tokens
    -- increase in commit order. A conflict below rolls the increment back.
    INSERT INTO helix_lock_keys AS k (organization_id, job_type, last_fencing_token)
    VALUES (p_organization_id, p_job_type, 1)
    ON CONFLICT (organization_id, job_type)
        DO UPDATE SET last_fencing_token = k.last_fencing_token + 1
    RETURNING k.last_fencing_token INTO v_fencing_token;

    -- FOR UPDATE waits out a renewal or release in flight and then sees its outcome.
    SELECT * INTO v_live
    FROM helix_job_locks AS l
    WHERE l.organization_id = p_organization_id
      AND l.job_type = p_job_type
      AND l.released_at IS NULL
    FOR UPDATE;

    -- The clock is read after every wait: any release seen above committed before this moment,
    -- so a grant never starts before its predecessor ended.
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
        organization_id, job_type, holder, token, metadata, fencing_token, acquired_at, expires_at
    )
    VALUES (
        p_organization_id, p_job_type, p_holder, v_token, p_metadata, v_fencing_token,
        v_now, v_now + v_lease
    )
    RETURNING id INTO v_id;

    RETURN QUERY
        SELECT v.*, v_token, v_live.id, v_live.holder, v_live.expires_at
        FROM helix_job_lock_views AS v
        WHERE v.id = v_id;
END $$;

-- The lock row a token holder may change, locked FOR UPDATE; raises HL001, HL002 or HL003.
CREATE FUNCTION helix_lock_for_holder(p_lock_id bigint, p_token text) RETURNS helix_job_locks
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_lock helix_job_locks%ROWTYPE;
BEGIN
    SELECT * INTO v_lock FROM helix_job_locks AS l WHERE l.id = p_lock_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no lock %', p_lock_id USING ERRCODE = 'HL001';
    END IF;
    IF v_lock.token IS DISTINCT FROM p_token THEN
        RAISE EXCEPTION 'token does not match lock %', p_lock_id USING ERRCODE = 'HL002';
    END IF;
    IF v_lock.released_at IS NOT NULL THEN
        RAISE EXCEPTION 'lock % has ended', p_lock_id
            USING ERRCODE = 'HL003',
                  DETAIL = json_build_object(
                      'lock_id', v_lock.id,
                      'release_reason', v_lock.release_reason,
                      'released_at', v_lock.released_at
                  )::text;
    END IF;
    RETURN v_lock;
END $$;

CREATE FUNCTION helix_release_job_lock(p_lock_id bigint, p_token text)
RETURNS SETOF helix_job_lock_views
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM helix_lock_for_holder(p_lock_id, p_token);
    UPDATE helix_job_locks AS l
    SET released_at = clock_timestamp(), release_reason = 'released'
    WHERE l.id = p_lock_id;
    RETURN QUERY SELECT * FROM helix_job_lock_views AS v WHERE v.id = p_lock_id;
END $$;

CREATE FUNCTION helix_renew_job_lock(p_lock_id bigint, p_token text, p_ttl_ms bigint)
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
    lapsed boolean
)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    v_lease interval := helix_lease(p_ttl_ms);
    v_lock helix_job_locks%ROWTYPE := helix_lock_for_holder(p_lock_id, p_token);
    v_now timestamptz := clock_timestamp();
BEGIN
    -- A lapsed lease nobody reclaimed may be renewed: no one else can have held the lock.
    UPDATE helix_job_locks SET expires_at = v_now + v_lease WHERE id = p_lock_id;
    RETURN QUERY
        SELECT v.*, v_lock.expires_at <= v_now
        FROM helix_job_lock_views AS v
        WHERE v.id = p_lock_id;
END $$;

-- For storage layers that share the database: is this the token of the lock held right now?
-- A lapsed lease is not current, even before anyone reclaims it.
CREATE FUNCTION helix_fencing_token_is_current(
    p_organization_id text,
    p_job_type text,
    p_fencing_token bigint
) RETURNS boolean
LANGUAGE sql VOLATILE AS $$
    SELECT EXISTS (
        SELECT 1
        FROM helix_job_locks AS l
        WHERE l.organization_id = p_organization_id
          AND l.job_type = p_job_type
          AND l.released_at IS NULL
          AND l.expires_at > clock_timestamp()
          AND l.fencing_token = p_fencing_token
    )
$$;
