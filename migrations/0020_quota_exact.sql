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
--    its commit made one more.
-- 2. What a process may still let through on its count was known to that process alone: another
--    process, counting as it went, took the organization up to the quota, and the first one's
--    count, still fresh, let the rest through after that.
--
-- The room a count hands out is now a row of helix_quota_shares, a share: "this process may add
-- up to `room` live locks of the organization without counting them". Every count and every
-- acquire the exact way holds back the room of every share there is, in full (also the part
-- already granted, which the count sees as live locks too: held back twice, never too little).
-- An acquire let through on a share (helix_acquire_job_lock_on_share) holds the share's own
-- advisory lock in shared mode to its commit, having checked that the share is still there and
-- within its time: such acquires never wait for each other, nor for a count. A share row is
-- deleted only by whoever holds its lock exclusively, so never under an acquire in flight on it:
-- a count ends this process's previous share and those past their time when nobody is using
-- them (pg_try_advisory_xact_lock), and the exact way, when the room they hold back is what its
-- grant needs, takes every share back, waiting for the acquires in flight on each, and counts
-- again. An acquire on a share that has gone is refused HL005 and goes the exact way.
--
-- So the organization's live locks, plus those in flight, plus the room still unused on its
-- shares, stay at most the quota at every moment: a count hands out room only below its limit
-- (the quota's last 5% are never shared), and counts what is in flight at most once, as room;
-- an acquire on a share turns room into one live lock at most; the exact way grants only below
-- the quota, and only while that holds or once nothing is in flight. Counts and the exact way take
-- the organization's advisory lock exclusively, one at a time, and read with a fresh snapshot
-- after each lock they wait for (READ COMMITTED, which the service sets for every transaction:
-- queries.py). A replica of the previous build lets acquires through on its count with no share:
-- the bound holds once none serves any more.
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

-- The organization's advisory lock, taken by counts and by the exact way: 64 bits of a hash of the
-- organization id, in the single-key space of advisory locks, so that no two organizations meet on
-- it (32 bits, as 0013 had it, let organizations whose ids hash alike wait for each other; found by
-- review). The one other key of that space this schema takes is the migration runner's constant.
CREATE FUNCTION helix_quota_lock_key(p_organization_id text) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
    SELECT hashtextextended('helix_live_lock_quota/' || p_organization_id, 0)
$$;

-- A share's advisory lock: held in shared mode by each acquire on the share, exclusively by
-- whoever deletes the share. Two int4 keys, the share's id whole (its high bits folded into a
-- class of its own): no two shares meet on a key, whatever their organizations.
CREATE FUNCTION helix_quota_share_class(p_share bigint) RETURNS integer
LANGUAGE sql IMMUTABLE AS $$
    SELECT hashtext('helix_quota_share') # (p_share >> 31)::integer
$$;
CREATE FUNCTION helix_quota_share_key(p_share bigint) RETURNS integer
LANGUAGE sql IMMUTABLE AS $$
    SELECT (p_share & 2147483647)::integer
$$;

-- The organization's live locks (acquires in flight on shares not among them), and a share of the
-- room left below p_limit once the room of every share there is held back: a p_parts-th of it,
-- at least 1 while there is any; no share (NULL, room 0) when there is none. Before counting, it
-- ends p_previous, this process's share before, and the shares past their time, those of them
-- that no acquire is using (their acquires have committed, and are counted); one of this process
-- not yet sent meets HL005 and may take the new share's room instead (locks.py).
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
    v_share bigint;
    v_left bigint;
BEGIN
    PERFORM pg_advisory_xact_lock(helix_quota_lock_key(p_organization_id));
    FOR v_share IN
        SELECT s.id FROM helix_quota_shares AS s
        WHERE s.organization_id = p_organization_id
          AND (s.id = p_previous OR s.until <= clock_timestamp())
        ORDER BY s.id
    LOOP
        IF pg_try_advisory_xact_lock(helix_quota_share_class(v_share), helix_quota_share_key(v_share)) THEN
            DELETE FROM helix_quota_shares AS s
            WHERE s.organization_id = p_organization_id AND s.id = v_share;
        END IF;
    END LOOP;
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

-- An acquire let through on a share: under the share's advisory lock in shared mode, to its
-- commit, and only while the share is there and within its time (else HL005: the exact way).
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
    PERFORM pg_advisory_xact_lock_shared(helix_quota_share_class(p_share), helix_quota_share_key(p_share));
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
    v_shared bigint;  -- the room its shares hold back
    v_share bigint;
BEGIN
    PERFORM pg_advisory_xact_lock(helix_quota_lock_key(p_organization_id));
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
        SELECT coalesce(sum(s.room), 0) INTO v_shared FROM helix_quota_shares AS s
        WHERE s.organization_id = p_organization_id;
        IF v_live + v_shared >= p_quota THEN
            -- The room the shares hold back is needed: take each back once the acquires in
            -- flight on it have committed, and count again, with nothing in flight.
            FOR v_share IN
                SELECT s.id FROM helix_quota_shares AS s
                WHERE s.organization_id = p_organization_id
                ORDER BY s.id
            LOOP
                PERFORM pg_advisory_xact_lock(helix_quota_share_class(v_share), helix_quota_share_key(v_share));
                DELETE FROM helix_quota_shares AS s
                WHERE s.organization_id = p_organization_id AND s.id = v_share;
            END LOOP;
            SELECT count(*) INTO v_live FROM helix_job_locks AS l
            WHERE l.organization_id = p_organization_id AND l.released_at IS NULL;
        END IF;
        IF v_live >= p_quota AND NOT v_repeat THEN
            RAISE EXCEPTION 'organization % has its quota of live locks', p_organization_id
                USING ERRCODE = 'HL004', DETAIL = p_quota::text;
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM helix_acquire_job_lock(
        p_organization_id, p_job_type, p_holder, p_ttl_ms, p_metadata, p_idempotency_key, p_max_holders
    );
    -- A repeat let through at the quota whose lease ran out before the acquire claimed it, and so
    -- granted anew, is refused after all (the grant rolls back with the statement). Judged by
    -- what this call did: it inserted a live lock, reclaiming none.
    IF v_adds AND v_live >= p_quota AND EXISTS (
        SELECT FROM helix_job_locks AS l
        WHERE l.organization_id = p_organization_id
          AND l.job_type = p_job_type
          AND l.released_at IS NULL
          AND l.acquired_xid = pg_current_xact_id()
          AND l.reclaimed_lock_id IS NULL
    ) THEN
        RAISE EXCEPTION 'organization % has its quota of live locks', p_organization_id
            USING ERRCODE = 'HL004', DETAIL = p_quota::text;
    END IF;
END $$;

REVOKE EXECUTE ON FUNCTION
    helix_share_quota(text, integer, integer, double precision, bigint),
    helix_acquire_job_lock_on_share(text, text, text, bigint, jsonb, text, integer, bigint)
FROM PUBLIC;

COMMENT ON FUNCTION helix_share_quota(text, integer, integer, double precision, bigint) IS
'A count of an organization''s live locks, and a share of the room left below p_limit once the '
'room of every share there is held back (helix_quota_shares, migration 0020). Under the quota''s '
'advisory lock held exclusively; acquires on shares never wait for it.';
COMMENT ON FUNCTION helix_acquire_job_lock_on_share(text, text, text, bigint, jsonb, text, integer, bigint) IS
'helix_acquire_job_lock, let through on a share of the quota: under the share''s advisory lock in '
'shared mode to its commit, so that the share stays until it has committed; HL005 once the share '
'is gone or past its time (migration 0020).';
COMMENT ON FUNCTION helix_acquire_job_lock_within_quota(text, text, text, bigint, jsonb, text, integer, integer) IS
'helix_acquire_job_lock near the quota: counted and granted under the quota''s advisory lock held '
'exclusively, holding back the room of the shares, or taking them back (waiting for the acquires '
'in flight on them) when it needs it; HL004 beyond the quota. A repeat is judged by what the call '
'itself did (migration 0020).';
