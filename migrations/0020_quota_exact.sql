-- The live-lock quota, exact for any number of processes (issue 34, items 5 and 6;
-- service/helix_locks/locks.py, LiveLockQuota). Every signature of 0018 stays, so replicas of the
-- previous build call these functions unchanged during a rolling upgrade.
--
-- Far from the quota a process lets acquires through on a count it took, without counting each,
-- and near it they go through helix_acquire_job_lock_within_quota, which counts and grants under
-- the organization's advisory lock (0013). Two ways past the quota were left:
--
-- 1. An acquire let through on a count, still in flight (waiting for its key's row, say), was in
--    no count: the exact way counted committed rows only, granted up to the quota beside it, and
--    its commit made one more. Such an acquire now holds the same advisory lock in shared mode
--    from before anything else it does to its commit (helix_acquire_job_lock_on_share): these never
--    wait for each other, and every count and every acquire the exact way holds it exclusively,
--    so it waits for those in flight and then sees them, and none starts while it counts.
--
-- 2. What a process may still let through on its count was known to that process alone: another
--    process, counting as it went, took the organization up to the quota, and the first one's
--    count, still fresh, let its rest through after that. The room a count hands out is now a row
--    of helix_quota_shares, "this process may grant up to `room` live locks of the organization
--    without counting, until `until`", and every count holds back the room of every other share
--    still in force: live locks plus every share's room stay within what the counts hand out
--    below (the quota's last 5% are never shared). An acquire let through on a share checks,
--    under the shared lock, that the share is still in force. The exact way takes every share of
--    the organization back whenever the room they hold back is what its grant needs; an acquire
--    on a share taken back is refused HL005 and goes the exact way. A share's room is counted in
--    full for as long as it lasts, also the part already granted (which the count sees as live
--    locks too): held back twice, never too little. A process that dies frees its shares when
--    they end (seconds).
--
-- So, at every commit, the organization's live locks plus the room of its shares still in force
-- are at most the quota: the exact way grants only below the quota, and only while that holds
-- or after taking the shares back; a count hands out only room below its limit; an acquire on a
-- share turns room into one live lock at most. Every count and every acquire the exact way reads
-- with a fresh snapshot after the exclusive lock is its own (READ COMMITTED, which the service
-- sets for every transaction: queries.py). A replica of the previous build lets acquires through
-- on its count with neither a share nor the lock: the bound holds once none serves any more.
--
-- 3. (Item 6) A repeat of a live grant at the quota adds no live lock and is answered (0018).
--    0018 told whether the call had after all made a new grant (the lease ran out before its
--    claim) by counting the organization's live locks again, which another acquire's commit had
--    changed meanwhile: a repeat of a live grant was refused HL004. The call is now judged by
--    what it did itself: whether it inserted a live lock that reclaimed none.

-- Keyed by organization first: every look-up is within one (and the table is ready to be
-- distributed by it: docs/scaling.md).
CREATE TABLE helix_quota_shares (
    organization_id text NOT NULL,
    id bigint GENERATED ALWAYS AS IDENTITY,
    room integer NOT NULL,
    until timestamptz NOT NULL,
    CONSTRAINT helix_quota_shares_pkey PRIMARY KEY (organization_id, id),
    CONSTRAINT helix_quota_shares_room_positive CHECK (room > 0)
);

-- The organization's live locks, counted with nothing of its own in flight, and a share of the
-- room left below p_limit once every other share in force is held back: a p_parts-th of it, at
-- least 1 while there is any; no share (NULL, room 0) when there is none. p_previous, this
-- process's share before, ends: its acquires in the database have committed and are counted;
-- one not yet sent meets HL005 and may take the new share's room instead (locks.py).
CREATE FUNCTION helix_share_quota(
    p_organization_id text,
    p_limit integer,
    p_parts integer,
    p_seconds double precision,
    p_previous bigint
)
RETURNS TABLE (live bigint, share_id bigint, share_room integer)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    v_left bigint;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('helix_live_lock_quota'), hashtext(p_organization_id));
    DELETE FROM helix_quota_shares AS s
    WHERE s.organization_id = p_organization_id
      AND (s.id = p_previous OR s.until <= clock_timestamp());
    SELECT count(*) INTO live
    FROM helix_job_locks AS l
    WHERE l.organization_id = p_organization_id AND l.released_at IS NULL;
    SELECT p_limit - live - coalesce(sum(s.room), 0) INTO v_left
    FROM helix_quota_shares AS s
    WHERE s.organization_id = p_organization_id;
    share_room := 0;
    IF v_left > 0 THEN
        share_room := greatest(1, v_left / p_parts);
        INSERT INTO helix_quota_shares AS s (organization_id, room, until)
        VALUES (p_organization_id, share_room, clock_timestamp() + p_seconds * interval '1 second')
        RETURNING s.id INTO share_id;
    END IF;
    RETURN NEXT;
END $$;

-- An acquire let through on a share: under the organization's advisory lock in shared mode, to
-- its commit, and only while the share is in force (else HL005: the exact way).
CREATE FUNCTION helix_acquire_job_lock_on_share(
    p_organization_id text,
    p_job_type text,
    p_holder text,
    p_ttl_ms bigint,
    p_metadata jsonb,
    p_idempotency_key text,
    p_max_holders integer,
    p_share bigint
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
    PERFORM pg_advisory_xact_lock_shared(hashtext('helix_live_lock_quota'), hashtext(p_organization_id));
    IF NOT EXISTS (
        SELECT FROM helix_quota_shares AS s
        WHERE s.id = p_share AND s.organization_id = p_organization_id AND s.until > clock_timestamp()
    ) THEN
        RAISE EXCEPTION 'the share % of organization %''s quota has ended', p_share, p_organization_id
            USING ERRCODE = 'HL005';
    END IF;
    RETURN QUERY SELECT * FROM helix_acquire_job_lock(
        p_organization_id, p_job_type, p_holder, p_ttl_ms, p_metadata, p_idempotency_key, p_max_holders
    );
END $$;

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
    v_shared bigint;  -- the room its shares in force hold back
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
    -- Whether this call added a live lock: one it inserted, reclaiming none. (Only an acquire that
    -- found a free slot can; nothing else grants in the organization while the lock is ours.)
    IF v_adds AND EXISTS (
        SELECT FROM helix_job_locks AS l
        WHERE l.organization_id = p_organization_id
          AND l.job_type = p_job_type
          AND l.released_at IS NULL
          AND l.acquired_xid = pg_current_xact_id()
          AND l.reclaimed_lock_id IS NULL
    ) THEN
        -- A repeat let through at the quota whose lease ran out before the acquire claimed it,
        -- and so granted anew: refused after all (the grant rolls back with the statement).
        IF v_live >= p_quota THEN
            RAISE EXCEPTION 'organization % has its quota of live locks', p_organization_id
                USING ERRCODE = 'HL004', DETAIL = p_quota::text;
        END IF;
        -- The room the shares hold back, if this grant took it, is taken back with them.
        SELECT coalesce(sum(s.room), 0) INTO v_shared
        FROM helix_quota_shares AS s
        WHERE s.organization_id = p_organization_id AND s.until > clock_timestamp();
        IF v_live + v_shared >= p_quota THEN
            DELETE FROM helix_quota_shares AS s WHERE s.organization_id = p_organization_id;
        END IF;
    END IF;
END $$;

REVOKE EXECUTE ON FUNCTION
    helix_share_quota(text, integer, integer, double precision, bigint),
    helix_acquire_job_lock_on_share(text, text, text, bigint, jsonb, text, integer, bigint)
FROM PUBLIC;

COMMENT ON FUNCTION helix_share_quota(text, integer, integer, double precision, bigint) IS
'A count of an organization''s live locks, under its quota''s advisory lock held exclusively (it '
'waits for the acquires on shares in flight, and sees them), and a share of the room left below '
'p_limit once every other share in force is held back (helix_quota_shares, migration 0020).';
COMMENT ON FUNCTION helix_acquire_job_lock_on_share(text, text, text, bigint, jsonb, text, integer, bigint) IS
'helix_acquire_job_lock, let through on a share of the quota: under the quota''s advisory lock in '
'shared mode to its commit, so that every count waits for it; HL005 once the share has ended or '
'was taken back (migration 0020).';
COMMENT ON FUNCTION helix_acquire_job_lock_within_quota(text, text, text, bigint, jsonb, text, integer, integer) IS
'helix_acquire_job_lock near the quota: counted and granted under the quota''s advisory lock held '
'exclusively, so that no acquire is in flight beside it; HL004 beyond the quota. A grant that needs '
'the room the shares hold back takes them back (migration 0020); a repeat is judged by what the '
'call itself did.';
