-- Bounds on what a small request can make the service store and answer (issue 34, items 7 and
-- 11). Every signature stays, so replicas of the previous build call these functions unchanged
-- during a rolling upgrade.
--
-- 1. Metadata is at most 8 KiB (8192 bytes) as stored: as jsonb::text writes it, whatever its
--    size as sent. jsonb keeps a number as numeric and writes it back in full, so
--    {"a": [1e308, ... 1160 times]} is 8,127 bytes as sent and 360,767 as stored, and every
--    answer that carries the lock (the grant, GET, a listing, events) carried all of it: a page of
--    150 such locks was 54 MB. The service refuses such metadata at the edge (schemas.py predicts
--    the stored size), and the database refuses to store it whoever writes it:
--    helix_metadata_bounded, a trigger on helix_job_locks, raises 22023 (invalid_parameter_value)
--    with COLUMN metadata, which the service answers 422 naming metadata (db.py), like a ttl out of
--    range. It fires on every INSERT, and on an UPDATE only when the statement sets metadata: the
--    acquires (plain, within the quota, each attempt of a waiting one) and PATCH, and any function
--    a later migration adds that writes metadata.
--    Why a trigger rather than a CHECK constraint: a CHECK is tested on every UPDATE of a row, so
--    each renewal, release and claim would pay for writing the metadata out, and a row stored
--    before this migration (NOT VALID would leave it) over the bound could then no longer be
--    renewed, released, forced or reclaimed by the next acquire: its key would be stuck until
--    retention took it. Its error also carries the failing row, lock token included, into the
--    server's log. The trigger tests only what is being written, and says only the size.
--    Why not a check in each function: the table is where every writer meets, those of later
--    migrations included.
--    Rows stored before this migration are left as they were; they end and are pruned as ever.
--
-- 2. A full pair's refusal (23505, DETAIL) lists at most 20 holders, those whose leases run out
--    first (then by slot), and counts them all in holders_total: the holders of a semaphore of
--    1,000 slots made a 409 of about 1 MB for an acquire of about a hundred bytes. lock_id,
--    holder and expires_at still name the first to run out, which Retry-After counts down to. A
--    replica of the previous build reads holders as before (now at most 20 of them); its waiters
--    on a semaphore of more than 20 slots, should its release listener reconnect, miss a slot's
--    end that came while it was away and wake at their timer instead, until it is replaced.

CREATE FUNCTION helix_metadata_bounded() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_bytes integer := octet_length(NEW.metadata::text);
BEGIN
    IF v_bytes > 8192 THEN
        RAISE EXCEPTION 'metadata must be at most 8192 bytes as stored, is %', v_bytes
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'metadata';
    END IF;
    RETURN NEW;
END $$;

COMMENT ON FUNCTION helix_metadata_bounded() IS
    'Refuses metadata over 8192 bytes as stored (jsonb::text: numbers in full, 1e308 as 309 digits),'
    ' with 22023 naming the column metadata: what is stored is what every answer carries back.'
    ' Migration 0021.';

CREATE TRIGGER helix_metadata_bounded
    BEFORE INSERT OR UPDATE OF metadata ON helix_job_locks
    FOR EACH ROW WHEN (NEW.metadata IS NOT NULL)
    EXECUTE FUNCTION helix_metadata_bounded();

COMMENT ON TRIGGER helix_metadata_bounded ON helix_job_locks IS
    'Bounds metadata whoever writes it, testing only the rows whose metadata a statement writes:'
    ' renewals and releases do not pay for it, and a row stored over the bound before migration'
    ' 0021 still renews, ends and is reclaimed, all of which a CHECK constraint would refuse.';

-- 2. The acquire of 0017, but for the holders its refusal lists.
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
    'Grants a free slot of the pair, reclaiming expired locks, in one statement; or raises 23505'
    ' whose DETAIL names the lock whose lease runs out first and lists at most 20 holders, those'
    ' whose leases run out first, with holders_total (0021): an answer bounded whatever max_holders.';
