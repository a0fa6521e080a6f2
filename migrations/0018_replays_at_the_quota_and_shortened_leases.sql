-- Two fixes found by attacking semaphores (issue 21).
--
-- 1. A repeat of an acquire (the same Idempotency-Key and holder, its lock still live) adds no
--    live lock: it answers the grant it repeats. The quota's acquire of 0017 counted it as adding
--    one whenever the pair had a free slot, which a semaphore's often has, so at the quota the
--    worker whose answer was lost was refused (HL004) the token of the lock it holds. It now goes
--    on to the acquire when such a lock exists; helix_claim_replay (0010) reads it the same way.
--    Same signature, so replicas of the previous build call it unchanged.
--
-- 2. A waiter sleeps until the lease that runs out first among those that refused it, and wakes
--    early only when a lock of its pair ends (0006, 0008). A renewal that shortens a lease
--    (ttl_seconds less than what was left) moved that moment earlier, unannounced: the waiter
--    slept past it. Such a renewal is now announced like a release, to the waited pairs only, by
--    a trigger, so renewals of every build announce it; a renewal that lengthens a lease, the
--    usual heartbeat, is not announced and costs only the trigger's WHEN.
CREATE OR REPLACE FUNCTION helix_acquire_job_lock_within_quota(
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
               AND NOT coalesce(bool_or(l.idempotency_key = p_idempotency_key
                                        AND l.holder = p_holder
                                        AND l.expires_at > clock_timestamp()), false)
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

CREATE TRIGGER helix_lease_shortened AFTER UPDATE OF expires_at ON helix_job_locks
FOR EACH ROW WHEN (new.released_at IS NULL AND new.expires_at < old.expires_at)
EXECUTE FUNCTION helix_lock_released();
