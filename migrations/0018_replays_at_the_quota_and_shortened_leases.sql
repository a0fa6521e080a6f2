-- Three fixes found by attacking semaphores (issue 21). Every signature stays, so replicas of the
-- previous build call these functions unchanged during a rolling upgrade.
--
-- 1. A repeat of an acquire (the same Idempotency-Key and holder, its lock still live) adds no
--    live lock: it answers the grant it repeats. The quota's acquire of 0017 counted it as adding
--    one whenever the pair had a free slot, which a semaphore's often has, so at the quota the
--    worker whose answer was lost was refused (HL004) the token of the lock it holds. It now goes
--    on to the acquire when such a lock exists. Its lease can run out before the acquire claims
--    it (the claim waits for the row's lock): then the acquire is a new grant, and if that added
--    a live lock past the quota, HL004 after all, which rolls the grant back with the statement.
--
-- 1b. helix_claim_replay (0010) tested the lease before waiting for the row's lock, and a
--    transaction that only locked the row (another acquire of the pair, FOR UPDATE) makes
--    PostgreSQL claim it without testing again: a repeat was answered with a lease that had run
--    out meanwhile. It now first takes the pair's counter row, as every acquire does before it
--    locks the pair's locks (the same order, so no deadlock), which waits out any acquire of the
--    pair in flight; a renewal, update or release changes the row, and PostgreSQL tests a changed
--    row again, reading the clock anew.
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
DECLARE
    v_adds boolean;  -- the acquire takes a free slot, unless it is a repeat
    v_repeat boolean;
    v_live bigint;  -- the organization's live locks
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('helix_live_lock_quota'), hashtext(p_organization_id));
    SELECT count(*) FILTER (WHERE l.max_holders = p_max_holders) = count(*) AND count(*) < p_max_holders,
           coalesce(bool_or(l.idempotency_key = p_idempotency_key
                            AND l.holder = p_holder
                            AND l.expires_at > clock_timestamp()), false)
    INTO v_adds, v_repeat
    FROM helix_job_locks AS l
    WHERE l.organization_id = p_organization_id AND l.job_type = p_job_type AND l.released_at IS NULL;
    IF v_adds THEN
        SELECT count(*) INTO v_live FROM helix_job_locks AS l
        WHERE l.organization_id = p_organization_id AND l.released_at IS NULL;
        IF v_live >= p_quota AND NOT v_repeat THEN
            RAISE EXCEPTION 'organization % has its quota of live locks', p_organization_id
                USING ERRCODE = 'HL004', DETAIL = p_quota::text;
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM helix_acquire_job_lock(
        p_organization_id, p_job_type, p_holder, p_ttl_ms, p_metadata, p_idempotency_key, p_max_holders
    );
    -- A repeat let through at the quota whose lease ran out before the acquire claimed it was
    -- granted anew: refused after all if that added a live lock past the quota.
    IF v_adds AND v_repeat AND v_live >= p_quota AND (
        SELECT count(*) FROM helix_job_locks AS l
        WHERE l.organization_id = p_organization_id AND l.released_at IS NULL
    ) > v_live THEN
        RAISE EXCEPTION 'organization % has its quota of live locks', p_organization_id
            USING ERRCODE = 'HL004', DETAIL = p_quota::text;
    END IF;
END $$;

-- The grant this call repeats, claimed; NULL when there is none (no live, unexpired lock of the
-- key with this idempotency key and holder). Only when there may be one does it wait for the
-- pair's counter row (1b above).
CREATE OR REPLACE FUNCTION helix_claim_replay(
    p_organization_id text, p_job_type text, p_holder text, p_idempotency_key text
) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_id bigint;
BEGIN
    IF NOT EXISTS (
        SELECT FROM helix_job_locks AS l
        WHERE l.organization_id = p_organization_id
          AND l.job_type = p_job_type
          AND l.released_at IS NULL
          AND l.idempotency_key = p_idempotency_key
          AND l.holder = p_holder
          AND l.expires_at > clock_timestamp()
    ) THEN
        RETURN NULL;
    END IF;
    PERFORM FROM helix_lock_keys AS k
    WHERE k.organization_id = p_organization_id AND k.job_type = p_job_type
    FOR UPDATE;
    WITH claimed AS (
        UPDATE helix_job_locks AS l
        SET replayed = true
        WHERE l.organization_id = p_organization_id
          AND l.job_type = p_job_type
          AND l.released_at IS NULL
          AND l.idempotency_key = p_idempotency_key
          AND l.holder = p_holder
          AND l.expires_at > clock_timestamp()
        RETURNING l.id, l.expires_at
    )
    -- Tested again after the UPDATE: one that waited for a row only locked by a renewal that then
    -- failed (a wrong token) claims it without testing it anew.
    SELECT min(c.id) INTO v_id FROM claimed AS c WHERE c.expires_at > clock_timestamp();
    RETURN v_id;
END $$;

CREATE TRIGGER helix_lease_shortened AFTER UPDATE OF expires_at ON helix_job_locks
FOR EACH ROW WHEN (new.released_at IS NULL AND new.expires_at < old.expires_at)
EXECUTE FUNCTION helix_lock_released();
