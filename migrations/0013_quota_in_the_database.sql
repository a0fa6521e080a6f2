-- The live-lock quota, exact where it matters (issue 16; service/helix_locks/locks.py,
-- LiveLockQuota). Each service process counts an organization's live locks now and then and
-- lets acquires through on that count while it is well below the quota. Within the last twentieth
-- of the quota that is not enough: several processes, each trusting its own count, together
-- granted twice the quota. There the acquire goes through this function instead: it takes a
-- transaction-scoped advisory lock of the organization, so that the acquires of one organization
-- near its quota (only those) run one at a time; counts the live locks with a fresh snapshot,
-- which holds every grant committed before the lock was ours; and grants only within the quota.
-- An acquire of a key that has a live lock adds none (it reclaims it, or answers 409 or a replay)
-- and always goes on. Beyond the quota: SQLSTATE HL004, its DETAIL the quota.

CREATE FUNCTION helix_acquire_job_lock_within_quota(
    p_organization_id text,
    p_job_type text,
    p_holder text,
    p_ttl_ms bigint,
    p_metadata jsonb,
    p_idempotency_key text,
    p_quota integer
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
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('helix_live_lock_quota'), hashtext(p_organization_id));
    IF NOT EXISTS (
        SELECT FROM helix_job_locks AS l
        WHERE l.organization_id = p_organization_id AND l.job_type = p_job_type AND l.released_at IS NULL
    ) AND (
        SELECT count(*) FROM helix_job_locks AS l
        WHERE l.organization_id = p_organization_id AND l.released_at IS NULL
    ) >= p_quota THEN
        RAISE EXCEPTION 'organization % has its quota of live locks', p_organization_id
            USING ERRCODE = 'HL004', DETAIL = p_quota::text;
    END IF;
    RETURN QUERY SELECT * FROM helix_acquire_job_lock(
        p_organization_id, p_job_type, p_holder, p_ttl_ms, p_metadata, p_idempotency_key
    );
END $$;

REVOKE EXECUTE ON FUNCTION
    helix_acquire_job_lock_within_quota(text, text, text, bigint, jsonb, text, integer)
FROM PUBLIC;
