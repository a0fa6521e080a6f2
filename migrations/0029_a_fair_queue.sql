-- A fair queue per pair (issue 39): first come, first served across every replica.
--
-- Until now a waiting acquire registered its pair here (0008) only so that the pair's ends were
-- announced (NOTIFY), and whichever statement reached the database first after a release won.
-- From here on every waiting acquire takes a place: a row of helix_lock_waiters that names the
-- replica holding its request, and whose id orders the pair's queue.
-- - A place is live while its request is open: until its wait runs out (until), and while its
--   replica is alive, which the replica says by keeping a connection open under its own
--   application_name (its LISTEN connection). A replica that dies loses its connections, and its
--   places stop counting as soon as PostgreSQL sees them gone: no write per waiter or per replica
--   while nothing changes (helix_live_places).
-- - helix_acquire_job_lock takes p_place, the caller's place, if it has one. Under the pair's row
--   lock, which serialises the pair's grants, it counts the live places before it (every live
--   place, without one), in order and only as far as the free slots: none for the first place. A
--   free slot goes to the acquire only when fewer places come before it than there are free
--   slots; otherwise it raises 23505 with DETAIL {"waiting", "ahead", "retry_after_seconds": 1}
--   and constraint helix_lock_waiters_pkey: a conflict, as the one rule says, with the queue, not
--   a holder, in the way. A waiter's grant deletes its place in the same statement.
-- - A place that leaves without a grant (its client left, its wait ran out) is deleted by
--   helix_leave_queue, which announces the pair when others wait, so that the next is granted
--   without waiting for a timer. A wait that ran out with an Idempotency-Key keeps its place a
--   second longer, for the retry with that key that takes it over (helix_take_place): a worker
--   whose waits go in rounds keeps its place from one round to the next.
-- Rows without a replica are registrations of an earlier build (0008), which still announce ends
-- but hold no place, so that replicas of that build keep answering during a rolling upgrade.

ALTER TABLE helix_lock_waiters
    ADD COLUMN replica text,
    ADD COLUMN holder text,
    ADD COLUMN max_holders integer,
    ADD COLUMN waiting_since timestamptz,
    ADD COLUMN owner text,
    ADD COLUMN idempotency_key text;
COMMENT ON TABLE helix_lock_waiters IS 'The queue of each pair (0029): a place per waiting acquire, in id order; an end or a shortened lease notifies helix_lock_released only while a row for the pair is here (0008). A row without a replica is an earlier build''s registration, which holds no place.';
COMMENT ON COLUMN helix_lock_waiters.id IS 'The place''s order in its pair''s queue (first come, first served); deleted by the waiter''s grant or by helix_leave_queue.';
COMMENT ON COLUMN helix_lock_waiters.until IS 'When the wait ends at the latest: a place whose waiter died counts no longer, and the next place taken deletes it.';
COMMENT ON COLUMN helix_lock_waiters.replica IS 'The application_name of the replica holding the waiting request: the place is live only while a connection of that name is open (helix_live_places). NULL: a registration of a build before 0029.';
COMMENT ON COLUMN helix_lock_waiters.holder IS 'The holder the waiting acquire names.';
COMMENT ON COLUMN helix_lock_waiters.max_holders IS 'The max_holders the waiting acquire names.';
COMMENT ON COLUMN helix_lock_waiters.waiting_since IS 'When the place was taken, by the database clock.';
COMMENT ON COLUMN helix_lock_waiters.owner IS 'The waiting request that holds the place (random, per request): only it leaves the place. NULL: kept for a retry after its request ended.';
COMMENT ON COLUMN helix_lock_waiters.idempotency_key IS 'The waiting acquire''s Idempotency-Key (scoped to its API key): a retry with it takes the place over.';
-- The queue in order within its pair; it serves the pair's lookups of 0008 too.
CREATE INDEX helix_lock_waiters_queue ON helix_lock_waiters (organization_id, job_type, id);
DROP INDEX helix_lock_waiters_key;

CREATE FUNCTION helix_live_places(p_organization_id text, p_job_type text, p_before bigint DEFAULT NULL, p_limit integer DEFAULT NULL)
 RETURNS SETOF helix_lock_waiters
 LANGUAGE sql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
    SELECT w.* FROM helix_lock_waiters AS w
    WHERE w.organization_id = p_organization_id AND w.job_type = p_job_type
      AND (p_before IS NULL OR w.id < p_before)
      AND w.replica IS NOT NULL
      AND w.until > clock_timestamp()
      AND w.replica IN (SELECT a.application_name FROM pg_stat_get_activity(NULL) AS a)
    ORDER BY w.id
    LIMIT p_limit
$function$;
REVOKE EXECUTE ON FUNCTION helix_live_places(text,text,bigint,integer) FROM PUBLIC;
COMMENT ON FUNCTION helix_live_places(text,text,bigint,integer) IS 'The live places of a pair''s queue in order, before p_before if given, at most p_limit of them (NULL: all): a wait that has not run out, held by a replica that has a connection open under its name (every role sees every backend''s application_name). An index range scan within the pair, read in order up to the limit.';

CREATE FUNCTION helix_take_place(p_organization_id text, p_job_type text, p_holder text, p_max_holders integer, p_seconds double precision, p_replica text, p_owner text, p_idempotency_key text)
 RETURNS bigint
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
DECLARE
    v_id bigint;
BEGIN
    DELETE FROM helix_lock_waiters
    WHERE id IN (
        SELECT w.id FROM helix_lock_waiters AS w
        WHERE w.until < clock_timestamp()
        FOR UPDATE SKIP LOCKED  -- places never wait for each other
    );
    -- A retry with the same Idempotency-Key keeps the place of the try it repeats, while that
    -- place lives: it becomes this request's.
    IF p_idempotency_key IS NOT NULL THEN
        UPDATE helix_lock_waiters AS w
        SET owner = p_owner, replica = p_replica,
            until = greatest(w.until, clock_timestamp() + make_interval(secs => p_seconds))
        WHERE w.id = (
            SELECT q.id FROM helix_lock_waiters AS q
            WHERE q.organization_id = p_organization_id AND q.job_type = p_job_type
              AND q.idempotency_key = p_idempotency_key AND q.holder = p_holder
              AND q.until > clock_timestamp()
            ORDER BY q.id
            LIMIT 1
        )
        RETURNING w.id INTO v_id;
        IF FOUND THEN
            RETURN v_id;
        END IF;
    END IF;
    INSERT INTO helix_lock_waiters (
        organization_id, job_type, until, replica, holder, max_holders, waiting_since, owner, idempotency_key
    )
    VALUES (
        p_organization_id, p_job_type, clock_timestamp() + make_interval(secs => p_seconds), p_replica,
        p_holder, p_max_holders, clock_timestamp(), p_owner, p_idempotency_key
    )
    RETURNING id INTO v_id;
    RETURN v_id;
END $function$;
REVOKE EXECUTE ON FUNCTION helix_take_place(text,text,text,integer,double precision,text,text,text) FROM PUBLIC;
COMMENT ON FUNCTION helix_take_place(text,text,text,integer,double precision,text,text,text) IS 'A waiting acquire''s place at the end of the pair''s queue for p_seconds, held by replica p_replica for request p_owner; or, for a retry with the same Idempotency-Key and holder, the live place of the try it repeats, handed to it. Deletes the places that ran out on the way; returns the place''s id. The place commits before the waiter''s next attempt, so no end after that attempt goes unannounced.';

CREATE FUNCTION helix_leave_queue(p_id bigint, p_organization_id text, p_owner text, p_keep_seconds double precision DEFAULT 0)
 RETURNS bigint
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
DECLARE
    v_place helix_lock_waiters%ROWTYPE;
BEGIN
    IF p_keep_seconds > 0 THEN
        -- Kept for a retry with its Idempotency-Key, which takes it over, for that long at most.
        UPDATE helix_lock_waiters AS w
        SET owner = NULL, until = least(w.until, clock_timestamp() + make_interval(secs => p_keep_seconds))
        WHERE w.id = p_id AND w.organization_id = p_organization_id AND w.owner = p_owner
          AND w.idempotency_key IS NOT NULL
        RETURNING w.id INTO v_place.id;
        IF FOUND THEN
            RETURN v_place.id;
        END IF;
    END IF;
    DELETE FROM helix_lock_waiters AS w
    WHERE w.id = p_id AND w.organization_id = p_organization_id AND w.owner = p_owner
    RETURNING * INTO v_place;
    IF FOUND AND EXISTS (
        SELECT FROM helix_lock_waiters AS w
        WHERE w.organization_id = v_place.organization_id AND w.job_type = v_place.job_type
    ) THEN
        -- The next in the queue may be free to go: wake the pair's waiters.
        PERFORM pg_notify('helix_lock_released', v_place.organization_id || '/' || v_place.job_type);
    END IF;
    RETURN v_place.id;
END $function$;
REVOKE EXECUTE ON FUNCTION helix_leave_queue(bigint,text,text,double precision) FROM PUBLIC;
COMMENT ON FUNCTION helix_leave_queue(bigint,text,text,double precision) IS 'A place that leaves the queue without a grant (its client left, its wait ran out), if request p_owner still holds it: deleted, and the pair announced on helix_lock_released while others wait there; or, with p_keep_seconds and an Idempotency-Key, kept that long for a retry to take over. Returns its id, NULL when it was gone or another request''s.';

-- The acquire and its two doors (on a share of the quota, and near it) take the caller's place.
DROP FUNCTION helix_acquire_job_lock_on_share(text,text,text,bigint,jsonb,text,integer,bigint);
DROP FUNCTION helix_acquire_job_lock_within_quota(text,text,text,bigint,jsonb,text,integer,integer);
DROP FUNCTION helix_acquire_job_lock(text,text,text,bigint,jsonb,text,integer);

CREATE FUNCTION helix_acquire_job_lock(p_organization_id text, p_job_type text, p_holder text, p_ttl_ms bigint, p_metadata jsonb, p_idempotency_key text, p_max_holders integer DEFAULT 1, p_place bigint DEFAULT NULL)
 RETURNS TABLE(id bigint, organization_id text, job_type text, holder text, fencing_token bigint, acquired_at timestamp with time zone, expires_at timestamp with time zone, released_at timestamp with time zone, release_reason text, state text, ttl_remaining_ms bigint, metadata jsonb, max_holders integer, slot integer, token text, reclaimed_lock_id bigint, reclaimed_holder text, reclaimed_expired_at timestamp with time zone)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
 SET plan_cache_mode = force_generic_plan
AS $function$
#variable_conflict use_column
DECLARE
    v_lease interval := helix_lease(p_ttl_ms);
    v_token text := helix_new_token();
    v_fencing_token bigint;
    v_lock helix_holds%ROWTYPE;
    v_live helix_holds[] := '{}';  -- the pair's live locks, by slot
    v_held integer := 0;
    v_in_force integer;  -- the held locks' max_holders
    v_reclaim bigint[] := '{}';
    v_lapsed bigint[] := '{}';  -- the pair's leases that ran out, unannounced, left to their holders
    v_reclaimed helix_holds%ROWTYPE;  -- the one the answer names
    v_slot integer;
    v_now timestamptz;
    v_id bigint;
    v_sessions boolean := false;  -- a live lock of the pair is a session's
    v_session_expires timestamptz;
    v_session_expired xid8;
    v_i integer;
    v_full boolean;  -- live locks leave this acquire no slot
    v_ahead integer := 0;  -- live places before p_place (any, without one), counted up to the room
    v_waiting integer;  -- live places in the pair's queue, counted for a refusal
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
        -- tokens increase in commit order across slots. A conflict below rolls it back. An
        -- UPDATE first: the INSERT is for a pair's first grant only.
        UPDATE helix_lock_keys AS k SET last_fencing_token = k.last_fencing_token + 1
        WHERE k.organization_id = p_organization_id AND k.job_type = p_job_type
        RETURNING k.last_fencing_token INTO v_fencing_token;
        IF NOT FOUND THEN
            INSERT INTO helix_lock_keys AS k (organization_id, job_type, last_fencing_token)
            VALUES (p_organization_id, p_job_type, 1)
            ON CONFLICT (organization_id, job_type)
                DO UPDATE SET last_fencing_token = k.last_fencing_token + 1
            RETURNING k.last_fencing_token INTO v_fencing_token;
        END IF;

        -- FOR UPDATE waits out a renewal or end in flight and then sees its outcome.
        FOR v_lock IN
            SELECT * FROM helix_holds AS h
            WHERE h.organization_id = p_organization_id AND h.job_type = p_job_type
            ORDER BY h.slot
            FOR UPDATE
        LOOP
            v_live := v_live || v_lock;
            v_sessions := v_sessions OR v_lock.session_id IS NOT NULL;
        END LOOP;

        -- The clock is read after every wait: any end seen above committed before this moment,
        -- so a grant never starts before its predecessor ended.
        v_now := clock_timestamp();

        -- A lock of a session has the session's lease (0028). One that ran out is judged with the
        -- session's row locked, so that a renewal of the session after this grant finds the lock
        -- lost; taken without waiting (these holds are locked, and a session's row comes before
        -- its holds in the order of locks). A row locked by a renewal or an end of the session in
        -- flight: the lock is held for now, and the 409 says to try again in a second.
        IF v_sessions THEN
            FOR v_i IN 1 .. cardinality(v_live) LOOP
                v_lock := v_live[v_i];
                CONTINUE WHEN v_lock.session_id IS NULL;
                SELECT s.expires_at, s.expired_xid INTO v_session_expires, v_session_expired
                FROM helix_sessions AS s WHERE s.id = v_lock.session_id;
                CONTINUE WHEN NOT FOUND;
                IF v_session_expires <= v_now THEN
                    SELECT s.expires_at, s.expired_xid INTO v_session_expires, v_session_expired
                    FROM helix_sessions AS s WHERE s.id = v_lock.session_id
                    FOR NO KEY UPDATE SKIP LOCKED;
                    IF NOT FOUND THEN
                        v_session_expires := v_now + interval '1 millisecond';
                        v_session_expired := NULL;
                    END IF;
                END IF;
                v_lock.expires_at := v_session_expires;
                v_lock.expired_xid := v_session_expired;
                v_live[v_i] := v_lock;
            END LOOP;
        END IF;

        FOREACH v_lock IN ARRAY v_live LOOP
            IF v_lock.expires_at > v_now THEN
                v_held := v_held + 1;
                v_in_force := v_lock.max_holders;
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

        v_full := v_held > 0 AND (v_held >= p_max_holders OR v_in_force <> p_max_holders);
        -- The pair's queue (0029), read under the pair's row lock, so that grants and the places
        -- they consume are judged one after the other: the live places before the caller's, as
        -- many as there are free slots at most (one when none is free). An index probe when nobody
        -- waits, and none read at all for the first place.
        IF v_id IS NULL AND EXISTS (
            SELECT FROM helix_lock_waiters AS w
            WHERE w.organization_id = p_organization_id AND w.job_type = p_job_type
              AND w.replica IS NOT NULL
        ) THEN
            SELECT count(*) INTO v_ahead
            FROM helix_live_places(
                p_organization_id, p_job_type, p_place,
                CASE WHEN v_full THEN 1 ELSE p_max_holders - v_held END
            ) AS q;
        END IF;

        IF v_id IS NOT NULL THEN
            UPDATE helix_lock_keys AS k
            SET last_fencing_token = k.last_fencing_token - 1
            WHERE k.organization_id = p_organization_id AND k.job_type = p_job_type;
            UPDATE helix_holds AS h SET replayed = true WHERE h.id = v_id;
        ELSIF v_full AND (p_place IS NOT NULL OR v_ahead = 0 OR v_in_force <> p_max_holders) THEN
            -- A waiter in the queue is told of the holder, whose lease it sleeps on; another
            -- max_holders than the one in force is refused as such, never waited for.
            PERFORM helix_raise_held(v_live, v_now, p_max_holders);
        ELSIF v_ahead > 0 AND (v_full OR v_ahead >= p_max_holders - v_held) THEN
            -- Places before this acquire's (any, for an acquire that does not wait) take the
            -- slots there are: it does not jump the queue.
            SELECT count(*) INTO v_waiting FROM helix_live_places(p_organization_id, p_job_type) AS q;
            RAISE EXCEPTION 'places are waiting for % / %', p_organization_id, p_job_type
                USING ERRCODE = 'unique_violation',
                      CONSTRAINT = 'helix_lock_waiters_pkey',
                      DETAIL = json_build_object(
                          'waiting', v_waiting, 'ahead', v_ahead, 'retry_after_seconds', 1
                      )::text;
        ELSE
            -- The lowest slot that no live lock of this value holds; else the slot of the lock
            -- that expired first, reclaimed.
            IF cardinality(v_live) = 0 THEN
                v_slot := 0;  -- the common case: no statement
            ELSE
                SELECT s INTO v_slot
                FROM generate_series(0, p_max_holders - 1) AS s
                WHERE s NOT IN (SELECT h.slot FROM unnest(v_live) AS h WHERE h.id <> ALL (v_reclaim))
                ORDER BY s
                LIMIT 1;
            END IF;
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
                PERFORM helix_end_holds(v_reclaim, v_now, 'reclaimed', NULL);
            END IF;
            -- The pair's other leases that ran out, which this grant leaves to their holders (it
            -- took a free slot): announced here, under the row locks taken above, so that every
            -- stream sends each expiry before this grant, live or resumed (0019, 0022).
            IF cardinality(v_live) > cardinality(v_reclaim) THEN
                v_lapsed := ARRAY(
                    SELECT h.id FROM unnest(v_live) AS h
                    WHERE h.expires_at <= v_now AND h.expired_xid IS NULL AND h.id <> ALL (v_reclaim)
                );
            END IF;
            IF cardinality(v_lapsed) > 0 THEN  -- rarely: no statement otherwise
                UPDATE helix_holds AS h SET expired_xid = pg_current_xact_id()
                WHERE h.organization_id = p_organization_id AND h.job_type = p_job_type
                  AND h.id = ANY (v_lapsed) AND h.session_id IS NULL;
                -- A session's expiry, on its row (locked above).
                UPDATE helix_sessions AS s
                SET expired_xid = pg_current_xact_id(), changed_xid = pg_current_xact_id()
                WHERE s.id IN (SELECT h.session_id FROM unnest(v_live) AS h WHERE h.id = ANY (v_lapsed))
                  AND s.expired_xid IS NULL;
            END IF;
            INSERT INTO helix_holds (
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

    -- A waiter's place is consumed by its grant (or by the repeat of its grant).
    IF p_place IS NOT NULL THEN
        DELETE FROM helix_lock_waiters AS w
        WHERE w.id = p_place AND w.organization_id = p_organization_id;
    END IF;

    RETURN QUERY
        SELECT v.*, h.token, h.reclaimed_lock_id, h.reclaimed_holder, h.reclaimed_expired_at
        FROM helix_held_locks AS v
        JOIN helix_holds AS h ON h.id = v.id
        WHERE v.id = v_id;
END $function$;

REVOKE EXECUTE ON FUNCTION helix_acquire_job_lock(text,text,text,bigint,jsonb,text,integer,bigint) FROM PUBLIC;
COMMENT ON FUNCTION helix_acquire_job_lock(text,text,text,bigint,jsonb,text,integer,bigint) IS 'Grants a free slot of the pair, reclaiming expired locks and announcing the expiries of the others it leaves (0022), in one statement; or raises 23505 whose DETAIL names the lock whose lease runs out first and lists at most 20 holders, those whose leases run out first, with holders_total (0021): an answer bounded whatever max_holders. A lock of a session with the session''s lease, judged with the session''s row locked when it ran out (0028). Live places of the pair''s queue before p_place (every one, without p_place) take the free slots first: 23505 with DETAIL waiting and ahead (0029); a grant consumes its place.';

CREATE FUNCTION helix_acquire_job_lock_on_share(p_organization_id text, p_job_type text, p_holder text, p_ttl_ms bigint, p_metadata jsonb, p_idempotency_key text, p_max_holders integer, p_share bigint, p_place bigint DEFAULT NULL)
 RETURNS TABLE(id bigint, organization_id text, job_type text, holder text, fencing_token bigint, acquired_at timestamp with time zone, expires_at timestamp with time zone, released_at timestamp with time zone, release_reason text, state text, ttl_remaining_ms bigint, metadata jsonb, max_holders integer, slot integer, token text, reclaimed_lock_id bigint, reclaimed_holder text, reclaimed_expired_at timestamp with time zone)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
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
        p_organization_id, p_job_type, p_holder, p_ttl_ms, p_metadata, p_idempotency_key, p_max_holders, p_place
    );
END $function$;
REVOKE EXECUTE ON FUNCTION helix_acquire_job_lock_on_share(text,text,text,bigint,jsonb,text,integer,bigint,bigint) FROM PUBLIC;
COMMENT ON FUNCTION helix_acquire_job_lock_on_share(text,text,text,bigint,jsonb,text,integer,bigint,bigint) IS 'helix_acquire_job_lock, let through on a share of the quota: under the share''s advisory lock in shared mode to its commit, so that the share stays until it has committed; HL005 once the share is gone or past its time (migration 0020). p_place: the waiter''s place (0029).';

CREATE FUNCTION helix_acquire_job_lock_within_quota(p_organization_id text, p_job_type text, p_holder text, p_ttl_ms bigint, p_metadata jsonb, p_idempotency_key text, p_quota integer, p_max_holders integer DEFAULT 1, p_place bigint DEFAULT NULL)
 RETURNS TABLE(id bigint, organization_id text, job_type text, holder text, fencing_token bigint, acquired_at timestamp with time zone, expires_at timestamp with time zone, released_at timestamp with time zone, release_reason text, state text, ttl_remaining_ms bigint, metadata jsonb, max_holders integer, slot integer, token text, reclaimed_lock_id bigint, reclaimed_holder text, reclaimed_expired_at timestamp with time zone)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
#variable_conflict use_column
DECLARE
    v_adds boolean;  -- the acquire takes a free slot, unless it is a repeat
    v_repeat boolean;
    v_live bigint;  -- the organization's live locks
    v_shared bigint;  -- the room its shares hold back
    v_share bigint;
BEGIN
    PERFORM pg_advisory_xact_lock(helix_quota_lock_key(p_organization_id));
    SELECT count(*) FILTER (WHERE h.max_holders = p_max_holders) = count(*) AND count(*) < p_max_holders,
           coalesce(bool_or(h.idempotency_key = p_idempotency_key
                            AND h.holder = p_holder
                            AND h.expires_at > clock_timestamp()), false)
    INTO v_adds, v_repeat
    FROM helix_holds AS h
    WHERE h.organization_id = p_organization_id AND h.job_type = p_job_type;
    IF v_adds THEN
        SELECT count(*) INTO v_live FROM helix_holds AS h
        WHERE h.organization_id = p_organization_id;
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
            SELECT count(*) INTO v_live FROM helix_holds AS h
            WHERE h.organization_id = p_organization_id;
        END IF;
        IF v_live >= p_quota AND NOT v_repeat THEN
            RAISE EXCEPTION 'organization % has its quota of live locks', p_organization_id
                USING ERRCODE = 'HL004', DETAIL = p_quota::text;
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM helix_acquire_job_lock(
        p_organization_id, p_job_type, p_holder, p_ttl_ms, p_metadata, p_idempotency_key, p_max_holders, p_place
    );
    -- A repeat let through at the quota whose lease ran out before the acquire claimed it, and so
    -- granted anew, is refused after all (the grant rolls back with the statement). Judged by
    -- what this call did: it inserted a live lock, reclaiming none.
    IF v_adds AND v_live >= p_quota AND EXISTS (
        SELECT FROM helix_holds AS h
        WHERE h.organization_id = p_organization_id
          AND h.job_type = p_job_type
          AND h.acquired_xid = pg_current_xact_id()
          AND h.reclaimed_lock_id IS NULL
    ) THEN
        RAISE EXCEPTION 'organization % has its quota of live locks', p_organization_id
            USING ERRCODE = 'HL004', DETAIL = p_quota::text;
    END IF;
END $function$;
REVOKE EXECUTE ON FUNCTION helix_acquire_job_lock_within_quota(text,text,text,bigint,jsonb,text,integer,integer,bigint) FROM PUBLIC;
COMMENT ON FUNCTION helix_acquire_job_lock_within_quota(text,text,text,bigint,jsonb,text,integer,integer,bigint) IS 'helix_acquire_job_lock near the quota: counted and granted under the quota''s advisory lock held exclusively, holding back the room of the shares, or taking them back (waiting for the acquires in flight on them) when it needs it; HL004 beyond the quota. A repeat is judged by what the call itself did (migration 0020). p_place: the waiter''s place (0029).';
