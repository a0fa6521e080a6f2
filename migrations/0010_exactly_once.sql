-- Exactly once at the edges: what a client was told about a lock stays true through retries.
--
-- 1. A replay racing its original. The original's statement holds the key's row lock, uncommitted
--    (its client gave up, got 503, and retried with the same Idempotency-Key). The replay waits
--    for the key, then finds the original's grant live: it is the caller's own, so it is answered
--    as the first time, and the fencing increment this call made is given back (nobody else can
--    have seen it: the key's row is still locked by this transaction).
--
-- 2. A replay claims the grant (replayed = true), under the grant row's lock. A waiting acquire
--    whose client left releases its grant only while it is unclaimed, in the statement that
--    checks (helix_release_unclaimed): whichever comes first, the claim or the release, the other
--    sees it. Either the retry got the lock and keeps it, or the lock was released and the retry
--    got a fresh grant.
--
-- 3. helix_fencing_token_is_current takes FOR KEY SHARE on the live row: called inside the
--    storage layer's writing transaction, it holds off a reclaim (the next acquire's FOR UPDATE
--    of the live row) and the holder's own release (FOR UPDATE too) until that transaction ends,
--    so a stale holder's write cannot land after the next holder's. A renewal locks the row
--    FOR NO KEY UPDATE, which a key share does not block: a long writing transaction does not
--    cost its holder its heartbeat.
--
-- 4. A grant keeps what it reclaimed (lock id, holder, expiry) on its own row, so that a replay
--    says so even after retention deleted the reclaimed row.
--
-- 5. Renewal and release read the lock before they lock it: an ended lock never changes again, so
--    410 needs no row lock, and a release that met retention deleting that very row answered 404.

ALTER TABLE helix_job_locks
    ADD COLUMN reclaimed_lock_id bigint,
    ADD COLUMN reclaimed_holder text,
    ADD COLUMN reclaimed_expired_at timestamptz,
    ADD COLUMN replayed boolean NOT NULL DEFAULT false;

-- The grant this call repeats, claimed; NULL when there is none (no live, unexpired lock of the
-- key with this idempotency key and holder).
CREATE FUNCTION helix_claim_replay(
    p_organization_id text, p_job_type text, p_holder text, p_idempotency_key text
) RETURNS bigint
LANGUAGE sql VOLATILE AS $$
    UPDATE helix_job_locks AS l
    SET replayed = true
    WHERE l.organization_id = p_organization_id
      AND l.job_type = p_job_type
      AND l.released_at IS NULL
      AND l.idempotency_key = p_idempotency_key
      AND l.holder = p_holder
      AND l.expires_at > clock_timestamp()
    RETURNING l.id
$$;

CREATE OR REPLACE FUNCTION helix_acquire_job_lock(
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
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
    v_lease interval := helix_lease(p_ttl_ms);
    v_token text := replace(gen_random_uuid()::text, '-', '');
    v_fencing_token bigint;
    v_live helix_job_locks%ROWTYPE;
    v_now timestamptz;
    v_id bigint;
BEGIN
    -- A repeat of a grant that is still live answers as the first time did, and claims it.
    IF p_idempotency_key IS NOT NULL THEN
        v_id := helix_claim_replay(p_organization_id, p_job_type, p_holder, p_idempotency_key);
    END IF;

    IF v_id IS NULL THEN
        -- The key's row lock serialises every grant for this key until commit, so fencing
        -- tokens increase in commit order. A conflict below rolls the increment back.
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

        -- The clock is read after every wait: any release seen above committed before this
        -- moment, so a grant never starts before its predecessor ended.
        v_now := clock_timestamp();

        IF v_live.id IS NOT NULL AND v_live.expires_at > v_now THEN
            IF p_idempotency_key IS NOT NULL
               AND v_live.idempotency_key = p_idempotency_key
               AND v_live.holder = p_holder THEN
                -- The original committed while this repeat waited for the key (1 above).
                UPDATE helix_lock_keys AS k
                SET last_fencing_token = k.last_fencing_token - 1
                WHERE k.organization_id = p_organization_id AND k.job_type = p_job_type;
                UPDATE helix_job_locks AS l SET replayed = true WHERE l.id = v_live.id;
                v_id := v_live.id;
            ELSE
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
        ELSE
            IF v_live.id IS NOT NULL THEN
                UPDATE helix_job_locks
                SET released_at = v_now, release_reason = 'reclaimed'
                WHERE id = v_live.id;
            END IF;
            INSERT INTO helix_job_locks (
                organization_id, job_type, holder, token, metadata, fencing_token, acquired_at,
                expires_at, idempotency_key, reclaimed_lock_id, reclaimed_holder, reclaimed_expired_at
            )
            VALUES (
                p_organization_id, p_job_type, p_holder, v_token, p_metadata, v_fencing_token,
                v_now, v_now + v_lease, p_idempotency_key, v_live.id, v_live.holder, v_live.expires_at
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

-- The lock row a token holder may change, locked FOR UPDATE (to end it) or, for a renewal, FOR NO
-- KEY UPDATE (3 above); raises HL001, HL002 or HL003. Read first without the lock: an ended lock
-- never changes again (5 above).
CREATE FUNCTION helix_lock_for_holder(
    p_lock_id bigint, p_token text, p_organization_id text, p_renewal boolean
)
RETURNS helix_job_locks
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_lock helix_job_locks%ROWTYPE;
BEGIN
    SELECT * INTO v_lock FROM helix_job_locks AS l
    WHERE l.id = p_lock_id
      AND (p_organization_id IS NULL OR l.organization_id = p_organization_id);
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no lock %', p_lock_id USING ERRCODE = 'HL001';
    END IF;
    IF v_lock.token IS DISTINCT FROM p_token THEN
        RAISE EXCEPTION 'token does not match lock %', p_lock_id USING ERRCODE = 'HL002';
    END IF;
    PERFORM helix_raise_if_ended(v_lock);
    IF p_renewal THEN
        SELECT * INTO v_lock FROM helix_job_locks AS l WHERE l.id = p_lock_id FOR NO KEY UPDATE;
    ELSE
        SELECT * INTO v_lock FROM helix_job_locks AS l WHERE l.id = p_lock_id FOR UPDATE;
    END IF;
    IF NOT FOUND THEN  -- only an ended lock is ever deleted: it ended, and retention took it
        RAISE EXCEPTION 'no lock %', p_lock_id USING ERRCODE = 'HL001';
    END IF;
    PERFORM helix_raise_if_ended(v_lock);  -- it ended while this call waited for it
    RETURN v_lock;
END $$;

CREATE OR REPLACE FUNCTION helix_lock_for_holder(p_lock_id bigint, p_token text, p_organization_id text)
RETURNS helix_job_locks
LANGUAGE sql VOLATILE AS $$
    SELECT helix_lock_for_holder(p_lock_id, p_token, p_organization_id, false)
$$;

CREATE OR REPLACE FUNCTION helix_renew_job_lock(
    p_lock_id bigint,
    p_token text,
    p_ttl_ms bigint,
    p_organization_id text
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

-- A waiting acquire's grant, released because its client left, unless a replay claimed it first
-- (2 above). Returns whether it released it.
CREATE FUNCTION helix_release_unclaimed(p_lock_id bigint, p_token text, p_organization_id text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    v_lock helix_job_locks%ROWTYPE := helix_lock_for_holder(p_lock_id, p_token, p_organization_id);
BEGIN
    IF v_lock.replayed THEN
        RETURN false;
    END IF;
    UPDATE helix_job_locks AS l
    SET released_at = clock_timestamp(), release_reason = 'released'
    WHERE l.id = p_lock_id;
    RETURN true;
END $$;

-- Inside the storage layer's transaction: holds the live row (FOR KEY SHARE) until it ends (3 above).
CREATE OR REPLACE FUNCTION helix_fencing_token_is_current(
    p_organization_id text,
    p_job_type text,
    p_fencing_token bigint
) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    PERFORM 1
    FROM helix_job_locks AS l
    WHERE l.organization_id = p_organization_id
      AND l.job_type = p_job_type
      AND l.released_at IS NULL
      AND l.expires_at > clock_timestamp()
      AND l.fencing_token = p_fencing_token
    FOR KEY SHARE;
    RETURN FOUND;
END $$;

REVOKE EXECUTE ON FUNCTION helix_release_unclaimed(bigint, text, text) FROM PUBLIC;
