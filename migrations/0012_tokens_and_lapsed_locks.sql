-- Abuse resistance (issue 16): lock tokens of 128 random bits, compared in constant time, and
-- retention that also removes locks whose lease ended long ago; and (issue 18) a holder's 403 and
-- 410 name the lock's organization and job type.
--
-- 1. A token was a UUIDv4 without dashes: 122 random bits, where 128 were documented. PostgreSQL
--    has no built-in source of random bytes (pgcrypto's gen_random_bytes is an extension, which
--    the least-privilege setup of 0009 does not ask for), but gen_random_uuid() draws from the
--    same strong source, and 30 of a UUIDv4's 32 hex digits are entirely random: 16 of them from
--    each of two UUIDs make 128 bits. Still 32 hex digits, so nothing a client sees changes;
--    stored tokens stay as they are, since a replay must hand the same token back.
--
-- 2. A token was compared with `=`, which stops at the first differing byte: how long a wrong
--    guess took said how much of it was right. Now the SHA-256 digests of both are compared: the
--    time still depends on a common prefix, but of digests, which a guesser cannot steer toward
--    the secret (the double-hash comparison of Python's hmac.compare_digest discussions).
--
-- 3. Retention deleted ended rows only. A lock whose holder vanished and whose key nobody
--    acquired again stayed, with its metadata, for ever. Now a lock whose lease ended longer ago
--    than the retention window goes too (its fencing counter in helix_lock_keys stays, so tokens
--    still only increase). A holder back after that long gets 404, as for any pruned lock. The
--    live rows are read through the live-lock index: there is no index on expires_at, which would
--    cost every renewal its HOT update, and live rows are few next to history (each organization
--    has a quota of them, HELIX_LOCKS_MAX_LIVE_LOCKS_PER_ORGANIZATION).

-- 4. A 403 (HL002) or 410 (HL003) to a holder now names the lock's organization and job type in
--    its DETAIL, as 23505's names the live lock: the service labels its log line and the
--    lost-lock metric with them, where it used to read the lock again.
CREATE OR REPLACE FUNCTION helix_raise_if_ended(p_lock helix_job_locks) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF p_lock.released_at IS NOT NULL THEN
        RAISE EXCEPTION 'lock % has ended', p_lock.id
            USING ERRCODE = 'HL003',
                  DETAIL = json_build_object(
                      'lock_id', p_lock.id,
                      'release_reason', p_lock.release_reason,
                      'released_at', p_lock.released_at,
                      'forced_by', p_lock.forced_by,
                      'organization_id', p_lock.organization_id,
                      'job_type', p_lock.job_type
                  )::text;
    END IF;
END $$;

-- 128 random bits as 32 hex digits: from each of two UUIDv4s (xxxxxxxx-xxxx-4xxx-Vxxx-xxxxxxxxxxxx
-- without dashes), digits 1-12, 14-16 and 18, leaving out the version digit (13) and the variant
-- digit (17), which has only two random bits.
CREATE FUNCTION helix_new_token() RETURNS text
LANGUAGE sql VOLATILE AS $$
    SELECT string_agg(substr(u, 1, 12) || substr(u, 14, 3) || substr(u, 18, 1), '')
    FROM (SELECT replace(gen_random_uuid()::text, '-', '') AS u FROM generate_series(1, 2)) AS uuids
$$;

-- What a token comparison compares (2 above).
CREATE FUNCTION helix_digest(p_text text) RETURNS bytea
LANGUAGE sql IMMUTABLE AS $$
    SELECT sha256(convert_to(p_text, 'UTF8'))
$$;

-- The acquire of 0010, its token from helix_new_token() (1 above).
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
    v_token text := helix_new_token();
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

-- The holder's check of 0010, comparing digests (2 above).
CREATE OR REPLACE FUNCTION helix_lock_for_holder(
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
    IF helix_digest(v_lock.token) IS DISTINCT FROM helix_digest(p_token) THEN
        RAISE EXCEPTION 'token does not match lock %', p_lock_id
            USING ERRCODE = 'HL002',
                  DETAIL = json_build_object(
                      'organization_id', v_lock.organization_id, 'job_type', v_lock.job_type
                  )::text;
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

CREATE OR REPLACE FUNCTION helix_prune_history(p_older_than interval, p_batch integer) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    -- A value, not clock_timestamp() in the WHERE clause: a volatile expression cannot bound the
    -- index scan, and a batch that finds nothing old would read the whole retained history.
    v_cutoff timestamptz := clock_timestamp() - p_older_than;
    v_ended integer;
    v_lapsed integer;
BEGIN
    IF NOT pg_try_advisory_xact_lock(hashtext('helix_prune_history')) THEN
        RETURN 0;  -- another replica is pruning
    END IF;
    WITH doomed AS (
        SELECT l.id
        FROM helix_job_locks AS l
        WHERE l.released_at < v_cutoff
        ORDER BY l.released_at
        LIMIT p_batch
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM helix_job_locks AS l USING doomed WHERE l.id = doomed.id;
    GET DIAGNOSTICS v_ended = ROW_COUNT;
    -- Locks nobody released or reclaimed, whose lease ended before the window (3 above). SKIP
    -- LOCKED leaves one that an acquire is reclaiming at this moment to that acquire; one deleted
    -- here is simply absent for the next acquire of its key.
    WITH doomed AS (
        SELECT l.id
        FROM helix_job_locks AS l
        WHERE l.released_at IS NULL AND l.expires_at < v_cutoff
        LIMIT p_batch
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM helix_job_locks AS l USING doomed WHERE l.id = doomed.id;
    GET DIAGNOSTICS v_lapsed = ROW_COUNT;
    RETURN v_ended + v_lapsed;
END $$;

REVOKE EXECUTE ON FUNCTION helix_new_token(), helix_digest(text) FROM PUBLIC;
