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
    ADD COLUMN idempotency_key text,
    ADD COLUMN seq bigint;
CREATE SEQUENCE helix_lock_waiters_seq OWNED BY helix_lock_waiters.seq;
ALTER TABLE helix_lock_waiters ALTER COLUMN seq SET DEFAULT nextval('helix_lock_waiters_seq');
COMMENT ON SEQUENCE helix_lock_waiters_seq IS 'The order of the places in the queues: one number per waiting request, shared by the places of a waiting session in each of its pairs.';
COMMENT ON TABLE helix_lock_waiters IS 'The queue of each pair (0029): a place per waiting acquire, in id order; an end or a shortened lease notifies helix_lock_released only while a row for the pair is here (0008). A row without a replica is an earlier build''s registration, which holds no place.';
COMMENT ON COLUMN helix_lock_waiters.id IS 'The row: a place, or a registration of a build before 0029.';
COMMENT ON COLUMN helix_lock_waiters.seq IS 'The place''s order in its pair''s queue (first come, first served), one number for a waiting request''s places in all its pairs (a session''s); deleted by the request''s grant or by helix_leave_queue. NULL: a registration of a build before 0029.';
COMMENT ON COLUMN helix_lock_waiters.until IS 'When the wait ends at the latest: a place whose waiter died counts no longer, and the next place taken deletes it.';
COMMENT ON COLUMN helix_lock_waiters.replica IS 'The application_name of the replica holding the waiting request: the place is live only while a connection of that name is open (helix_live_places). NULL: a registration of a build before 0029.';
COMMENT ON COLUMN helix_lock_waiters.holder IS 'The holder the waiting acquire names.';
COMMENT ON COLUMN helix_lock_waiters.max_holders IS 'The max_holders the waiting acquire names.';
COMMENT ON COLUMN helix_lock_waiters.waiting_since IS 'When the place was taken, by the database clock.';
COMMENT ON COLUMN helix_lock_waiters.owner IS 'The waiting request that holds the place (random, per request): only it leaves the place. NULL: kept for a retry after its request ended.';
COMMENT ON COLUMN helix_lock_waiters.idempotency_key IS 'The waiting acquire''s Idempotency-Key (scoped to its API key): a retry with it takes the place over.';
-- The queue in order within its pair; it serves the pair's lookups of 0008 too.
CREATE INDEX helix_lock_waiters_queue ON helix_lock_waiters (organization_id, job_type, seq);
DROP INDEX helix_lock_waiters_key;

CREATE FUNCTION helix_live_places(p_organization_id text, p_job_type text, p_before bigint DEFAULT NULL, p_limit integer DEFAULT NULL)
 RETURNS SETOF helix_lock_waiters
 LANGUAGE sql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
    SELECT w.* FROM helix_lock_waiters AS w
    WHERE w.organization_id = p_organization_id AND w.job_type = p_job_type
      AND (p_before IS NULL OR w.seq < p_before)
      AND w.replica IS NOT NULL
      AND w.until > clock_timestamp()
      AND w.replica IN (SELECT a.application_name FROM pg_stat_get_activity(NULL) AS a)
    ORDER BY w.seq
    LIMIT p_limit
$function$;
REVOKE EXECUTE ON FUNCTION helix_live_places(text,text,bigint,integer) FROM PUBLIC;
COMMENT ON FUNCTION helix_live_places(text,text,bigint,integer) IS 'The live places of a pair''s queue in order, before p_before if given, at most p_limit of them (NULL: all): a wait that has not run out, held by a replica that has a connection open under its name (every role sees every backend''s application_name). An index range scan within the pair, read in order up to the limit.';

CREATE FUNCTION helix_take_places(p_organization_id text, p_job_types text[], p_holder text, p_max_holders integer[], p_seconds double precision, p_replica text, p_owner text, p_idempotency_key text)
 RETURNS bigint
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
DECLARE
    v_seq bigint;
BEGIN
    DELETE FROM helix_lock_waiters
    WHERE id IN (
        SELECT w.id FROM helix_lock_waiters AS w
        WHERE w.until < clock_timestamp()
        FOR UPDATE SKIP LOCKED  -- places never wait for each other
    );
    -- A retry with the same Idempotency-Key and holder keeps the places of the try it repeats,
    -- while they live: they become this request's.
    IF p_idempotency_key IS NOT NULL THEN
        SELECT q.seq INTO v_seq FROM helix_lock_waiters AS q
        WHERE q.organization_id = p_organization_id AND q.job_type = p_job_types[1]
          AND q.idempotency_key = p_idempotency_key AND q.holder = p_holder
          AND q.until > clock_timestamp()
        ORDER BY q.seq
        LIMIT 1;
        -- The same request: places in exactly the pairs it asks for (not a session's, for an
        -- acquire of one of its pairs with the same key), so that its grant consumes them all.
        IF v_seq IS NOT NULL AND (
            SELECT array_agg(w.job_type ORDER BY w.job_type COLLATE "C")
            FROM helix_lock_waiters AS w
            WHERE w.organization_id = p_organization_id AND w.seq = v_seq
        ) IS DISTINCT FROM (
            SELECT array_agg(j ORDER BY j COLLATE "C") FROM unnest(p_job_types) AS j
        ) THEN
            v_seq := NULL;
        END IF;
        IF v_seq IS NOT NULL THEN
            UPDATE helix_lock_waiters AS w
            SET owner = p_owner, replica = p_replica,
                until = greatest(w.until, clock_timestamp() + make_interval(secs => p_seconds))
            WHERE w.organization_id = p_organization_id AND w.seq = v_seq;
            RETURN v_seq;
        END IF;
    END IF;
    v_seq := nextval('helix_lock_waiters_seq');
    INSERT INTO helix_lock_waiters (
        organization_id, job_type, until, replica, holder, max_holders, waiting_since, owner, idempotency_key, seq
    )
    SELECT p_organization_id, j.job_type, clock_timestamp() + make_interval(secs => p_seconds), p_replica,
           p_holder, j.max_holders, clock_timestamp(), p_owner, p_idempotency_key, v_seq
    FROM unnest(p_job_types, p_max_holders) AS j (job_type, max_holders);
    RETURN v_seq;
END $function$;
REVOKE EXECUTE ON FUNCTION helix_take_places(text,text[],text,integer[],double precision,text,text,text) FROM PUBLIC;
COMMENT ON FUNCTION helix_take_places(text,text[],text,integer[],double precision,text,text,text) IS 'A waiting request''s places at the end of the queue of each of its pairs (one for an acquire, one per pair for a session), with one order number, for p_seconds, held by replica p_replica for request p_owner; or, for a retry with the same Idempotency-Key and holder, the live places of the try it repeats, handed to it. Deletes the places that ran out on the way; returns the order number. The places commit before the waiter''s next attempt, so no end after that attempt goes unannounced.';

CREATE FUNCTION helix_leave_queue(p_seq bigint, p_organization_id text, p_owner text, p_keep_seconds double precision DEFAULT 0)
 RETURNS integer
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
DECLARE
    v_left integer;
    v_job_type text;
BEGIN
    IF p_keep_seconds > 0 THEN
        -- Kept for a retry with its Idempotency-Key, which takes them over, for that long at most.
        UPDATE helix_lock_waiters AS w
        SET owner = NULL, until = least(w.until, clock_timestamp() + make_interval(secs => p_keep_seconds))
        WHERE w.organization_id = p_organization_id AND w.seq = p_seq AND w.owner = p_owner
          AND w.idempotency_key IS NOT NULL;
        GET DIAGNOSTICS v_left = ROW_COUNT;
        IF v_left > 0 THEN
            RETURN v_left;
        END IF;
    END IF;
    v_left := 0;
    FOR v_job_type IN
        DELETE FROM helix_lock_waiters AS w
        WHERE w.organization_id = p_organization_id AND w.seq = p_seq AND w.owner = p_owner
        RETURNING w.job_type
    LOOP
        v_left := v_left + 1;
        IF EXISTS (
            SELECT FROM helix_lock_waiters AS w
            WHERE w.organization_id = p_organization_id AND w.job_type = v_job_type
        ) THEN
            -- The next in that queue may be free to go: wake the pair's waiters.
            PERFORM pg_notify('helix_lock_released', p_organization_id || '/' || v_job_type);
        END IF;
    END LOOP;
    RETURN v_left;
END $function$;
REVOKE EXECUTE ON FUNCTION helix_leave_queue(bigint,text,text,double precision) FROM PUBLIC;
COMMENT ON FUNCTION helix_leave_queue(bigint,text,text,double precision) IS 'A request''s places that leave the queues without a grant (its client left, its wait ran out), if request p_owner still holds them: deleted, and each pair announced on helix_lock_released while others wait there; or, with p_keep_seconds and an Idempotency-Key, kept that long for a retry to take over. Returns how many places it left or kept (0: gone, or another request''s).';

-- The acquire and its two doors (on a share of the quota, and near it) take the caller's place:
-- its order number (helix_lock_waiters.seq).
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
    v_other boolean := false;  -- a place counted in v_ahead names another max_holders
    v_first helix_holds%ROWTYPE;  -- of a refusal by the queue of a held pair: the first lease to end
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
            SELECT count(*), coalesce(bool_or(q.max_holders <> p_max_holders), false)
            INTO v_ahead, v_other
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
        ELSIF v_ahead > 0 AND (v_full OR v_other OR v_ahead >= p_max_holders - v_held) THEN
            -- Places before this acquire's (any, for an acquire that does not wait) take the
            -- slots there are, and a place before it that names another max_holders goes first
            -- whatever the slots: it does not jump the queue. Of a held pair, the refusal names
            -- the lease that ends first, as lock-held does, and counts down to it.
            SELECT count(*) INTO v_waiting  -- the others: a waiter's own place does not come first
            FROM helix_live_places(p_organization_id, p_job_type) AS q
            WHERE p_place IS NULL OR q.seq <> p_place;
            IF v_full THEN
                SELECT * INTO v_first FROM unnest(v_live) AS u
                WHERE u.expires_at > v_now
                ORDER BY u.expires_at, u.slot
                LIMIT 1;
            END IF;
            RAISE EXCEPTION 'places are waiting for % / %', p_organization_id, p_job_type
                USING ERRCODE = 'unique_violation',
                      CONSTRAINT = 'helix_lock_waiters_pkey',
                      DETAIL = json_build_object(
                          'waiting', v_waiting, 'ahead', v_ahead,
                          'lock_id', v_first.id, 'holder', v_first.holder, 'expires_at', v_first.expires_at,
                          'retry_after_seconds', CASE
                              WHEN v_first.id IS NULL THEN 1
                              ELSE greatest(1, ceil(extract(epoch FROM v_first.expires_at - v_now)))
                          END
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

    -- A waiter's place is consumed by its grant (or by the repeat of its grant); p_place is its
    -- order number (a session's places in other pairs go with those pairs' grants).
    IF p_place IS NOT NULL THEN
        DELETE FROM helix_lock_waiters AS w
        WHERE w.organization_id = p_organization_id AND w.job_type = p_job_type AND w.seq = p_place;
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

-- A waiting session takes a place in the queue of each of its pairs, with one order number
-- (helix_take_places), and is granted when it heads every one of them: its opening and its added
-- locks pass that number to each pair's acquire.
DROP FUNCTION helix_grant_session_locks(helix_sessions,text[],integer[],bigint,integer,bigint,integer,boolean);
DROP FUNCTION helix_open_session(text,text,bigint,jsonb,text,text[],integer[],integer,bigint,integer,integer);
DROP FUNCTION helix_add_session_locks(bigint,text,text,text[],integer[],integer,bigint,integer,text);

CREATE FUNCTION helix_grant_session_locks(p_session helix_sessions, p_job_types text[], p_max_holders integer[], p_ttl_ms bigint, p_quota integer, p_share bigint, p_locks_limit integer, p_lengthen boolean, p_place bigint DEFAULT NULL)
 RETURNS bigint[]
 LANGUAGE plpgsql
AS $function$
DECLARE
    v_org text := p_session.organization_id;
    v_pairs integer := coalesce(cardinality(p_job_types), 0);
    v_live bigint;  -- the organization's live locks before the grants (the exact way)
    v_shared bigint;
    v_share bigint;
    v_job_type text;
    v_max_holders integer;
    v_ids bigint[] := '{}';
    v_grant record;
    v_expires timestamptz := p_session.expires_at;
    v_state text;
    v_message text;
    v_detail text;
    v_constraint text;
BEGIN
    IF v_pairs = 0 THEN
        RETURN v_ids;
    END IF;
    IF cardinality(p_max_holders) <> v_pairs
       OR (SELECT count(DISTINCT j) FROM unnest(p_job_types) AS j) <> v_pairs THEN
        RAISE EXCEPTION 'a session''s locks name distinct job types, each with its max_holders'
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'locks';
    END IF;
    IF p_share IS NOT NULL THEN
        -- As helix_acquire_job_lock_on_share: the share stays until this transaction commits.
        PERFORM pg_advisory_xact_lock_shared(helix_quota_share_class(p_share), helix_quota_share_key(p_share));
        IF NOT EXISTS (
            SELECT FROM helix_quota_shares AS s
            WHERE s.id = p_share AND s.organization_id = v_org AND s.until > clock_timestamp()
        ) THEN
            RAISE EXCEPTION 'the share % of organization %''s quota has ended', p_share, v_org
                USING ERRCODE = 'HL005';
        END IF;
    ELSE
        -- As helix_acquire_job_lock_within_quota: counted under the organization's quota lock,
        -- the room its shares hold back taken back when it is needed, before any pair is locked.
        PERFORM pg_advisory_xact_lock(helix_quota_lock_key(v_org));
        SELECT count(*) INTO v_live FROM helix_holds AS h WHERE h.organization_id = v_org;
        SELECT coalesce(sum(s.room), 0) INTO v_shared FROM helix_quota_shares AS s
        WHERE s.organization_id = v_org;
        IF v_live + v_shared + v_pairs > p_quota THEN
            FOR v_share IN
                SELECT s.id FROM helix_quota_shares AS s WHERE s.organization_id = v_org ORDER BY s.id
            LOOP
                PERFORM pg_advisory_xact_lock(helix_quota_share_class(v_share), helix_quota_share_key(v_share));
                DELETE FROM helix_quota_shares AS s WHERE s.organization_id = v_org AND s.id = v_share;
            END LOOP;
            SELECT count(*) INTO v_live FROM helix_holds AS h WHERE h.organization_id = v_org;
        END IF;
    END IF;
    IF (SELECT count(*) FROM helix_holds AS h
        WHERE h.session_id = p_session.id AND h.organization_id = v_org) + v_pairs > p_locks_limit THEN
        RAISE EXCEPTION 'a session may hold at most % locks', p_locks_limit
            USING ERRCODE = 'HL008', DETAIL = p_locks_limit::text;
    END IF;

    BEGIN
        FOR v_job_type, v_max_holders IN
            SELECT j.job_type, j.max_holders
            FROM unnest(p_job_types, p_max_holders) AS j (job_type, max_holders)
            ORDER BY j.job_type COLLATE "C"
        LOOP
            SELECT a.id, a.expires_at INTO v_grant
            FROM helix_acquire_job_lock(
                v_org, v_job_type, p_session.holder, p_ttl_ms, p_session.metadata, NULL, v_max_holders, p_place
            ) AS a;
            IF NOT FOUND THEN
                RAISE EXCEPTION 'helix_acquire_job_lock returned no row for %', v_job_type;
            END IF;
            v_ids := v_ids || v_grant.id;
            IF p_lengthen THEN
                v_expires := greatest(v_expires, v_grant.expires_at);
            END IF;
        END LOOP;
    EXCEPTION WHEN unique_violation THEN
        -- The pair's refusal, naming the pair.
        GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_message = MESSAGE_TEXT,
            v_detail = PG_EXCEPTION_DETAIL, v_constraint = CONSTRAINT_NAME;
        RAISE EXCEPTION USING ERRCODE = v_state, MESSAGE = v_message, CONSTRAINT = v_constraint,
            DETAIL = (coalesce(nullif(v_detail, '')::jsonb, '{}') || jsonb_build_object('job_type', v_job_type))::text;
    END;

    -- The session's lease ran out while the grants waited: nothing is added to it.
    IF NOT p_lengthen AND v_expires <= clock_timestamp() THEN
        RAISE EXCEPTION 'the lease of session % has run out: renew it first', p_session.id
            USING ERRCODE = 'HL010', DETAIL = json_build_object('expires_at', v_expires)::text;
    END IF;
    IF v_live IS NOT NULL THEN
        IF (SELECT count(*) FROM helix_holds AS h WHERE h.organization_id = v_org) > greatest(v_live, p_quota) THEN
            RAISE EXCEPTION 'organization % has its quota of live locks', v_org
                USING ERRCODE = 'HL004', DETAIL = p_quota::text;
        END IF;
    END IF;

    UPDATE helix_holds AS h SET session_id = p_session.id, token = p_session.token, expires_at = v_expires
    WHERE h.id = ANY (v_ids);
    IF v_expires IS DISTINCT FROM p_session.expires_at THEN
        UPDATE helix_sessions AS s SET expires_at = v_expires WHERE s.id = p_session.id;
    END IF;
    RETURN v_ids;
END $function$;
REVOKE EXECUTE ON FUNCTION helix_grant_session_locks(helix_sessions,text[],integer[],bigint,integer,bigint,integer,boolean,bigint) FROM PUBLIC;
COMMENT ON FUNCTION helix_grant_session_locks(helix_sessions,text[],integer[],bigint,integer,bigint,integer,boolean,bigint) IS 'Grants pairs to a session all or none, each by helix_acquire_job_lock in job type order (a refusal raised with its job_type in DETAIL), on a share of the quota (HL005 once gone) or the exact way under the organization''s quota lock (HL004), within the bound on a session''s locks (HL008); the holds take the session''s token and lease (HL010 if an added lock''s ran out meanwhile). p_place: the waiting session''s order number in its pairs'' queues (0029). Returns the locks'' ids.';

CREATE FUNCTION helix_open_session(p_organization_id text, p_holder text, p_ttl_ms bigint, p_metadata jsonb, p_idempotency_key text, p_job_types text[], p_max_holders integer[], p_quota integer, p_share bigint, p_sessions_limit integer, p_locks_limit integer, p_place bigint DEFAULT NULL)
 RETURNS SETOF helix_session_answer
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
DECLARE
    v_lease interval := helix_lease(p_ttl_ms);
    v_session helix_sessions%ROWTYPE;
    v_now timestamptz;
BEGIN
    IF p_idempotency_key IS NOT NULL THEN
        -- One call of a key at a time: a repeat finds the session its first call made.
        PERFORM pg_advisory_xact_lock(
            hashtextextended('helix_session_key/' || p_organization_id || '/' || p_idempotency_key, 0)
        );
        SELECT * INTO v_session FROM helix_sessions AS s
        WHERE s.organization_id = p_organization_id AND s.idempotency_key = p_idempotency_key
          AND s.ended_at IS NULL AND s.holder = p_holder AND s.expires_at > clock_timestamp()
        FOR UPDATE;
        IF FOUND THEN
            PERFORM helix_lock_session_holds(v_session, false);
            IF NOT helix_session_lost(v_session) THEN
                RETURN QUERY SELECT * FROM helix_session_answer(v_session.id, p_organization_id, false, true);
                RETURN;
            END IF;
            -- It lost a lock: no longer the set asked for, so no answer to repeat. It ends, and
            -- this call opens a session anew.
            PERFORM helix_end_session(v_session, clock_timestamp(), 'lost');
        END IF;
    END IF;
    v_now := clock_timestamp();
    INSERT INTO helix_sessions AS s (organization_id, holder, token, metadata, idempotency_key, created_at, expires_at)
    VALUES (p_organization_id, p_holder, helix_new_token(), p_metadata, p_idempotency_key, v_now, v_now + v_lease)
    RETURNING s.* INTO v_session;
    PERFORM helix_grant_session_locks(
        v_session, p_job_types, p_max_holders, p_ttl_ms, p_quota, p_share, p_locks_limit, true, p_place
    );
    PERFORM helix_session_count_lock(v_session, p_sessions_limit);
    RETURN QUERY SELECT * FROM helix_session_answer(v_session.id, p_organization_id, false, false);
END $function$;
REVOKE EXECUTE ON FUNCTION helix_open_session(text,text,bigint,jsonb,text,text[],integer[],integer,bigint,integer,integer,bigint) FROM PUBLIC;
COMMENT ON FUNCTION helix_open_session(text,text,bigint,jsonb,text,text[],integer[],integer,bigint,integer,integer,bigint) IS 'POST /v1/sessions: opens a session and grants its locks in one statement, all or none, or answers the open session of a repeat (same organization, holder and Idempotency-Key) unless it lost a lock; HL009 past the bound on open sessions. p_place: a waiting opening''s order number in its pairs'' queues (0029).';

CREATE FUNCTION helix_add_session_locks(p_session_id bigint, p_token text, p_organization_id text, p_job_types text[], p_max_holders integer[], p_quota integer, p_share bigint, p_locks_limit integer, p_idempotency_key text, p_place bigint DEFAULT NULL)
 RETURNS SETOF helix_session_answer
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
AS $function$
DECLARE
    v_session helix_sessions%ROWTYPE := helix_session_for_holder(p_session_id, p_token, p_organization_id);
    v_left bigint;
    v_ids bigint[];
BEGIN
    -- Its holds are not locked (0028): an acquire that reclaims one, or a force, takes the
    -- session's row first, so the history shows either before this call goes on.
    IF helix_session_lost(v_session) THEN
        PERFORM helix_end_session(v_session, clock_timestamp(), 'lost');
        RETURN QUERY SELECT * FROM helix_session_answer(p_session_id, p_organization_id, false, false);
        RETURN;
    END IF;
    v_left := floor(extract(epoch FROM v_session.expires_at - clock_timestamp()) * 1000);
    IF v_left <= 0 THEN
        RAISE EXCEPTION 'the lease of session % has run out: renew it first', p_session_id
            USING ERRCODE = 'HL010', DETAIL = json_build_object('expires_at', v_session.expires_at)::text;
    END IF;
    IF p_idempotency_key IS NOT NULL THEN
        v_ids := ARRAY(
            SELECT h.id FROM helix_holds AS h
            WHERE h.organization_id = v_session.organization_id AND h.session_id = p_session_id
              AND h.added_key = p_idempotency_key
        );
        -- The same call: the same job types, each with the same max_holders.
        IF cardinality(v_ids) > 0 AND (
            SELECT array_agg((h.job_type, h.max_holders) ORDER BY h.job_type COLLATE "C")
            FROM helix_holds AS h WHERE h.id = ANY (v_ids)
        ) = (
            SELECT array_agg((j.job_type, j.max_holders) ORDER BY j.job_type COLLATE "C")
            FROM unnest(p_job_types, p_max_holders) AS j (job_type, max_holders)
        ) THEN
            RETURN QUERY
                SELECT * FROM helix_session_answer(p_session_id, p_organization_id, false, true) AS a
                WHERE a.id = ANY (v_ids);
            RETURN;
        END IF;
    END IF;
    v_ids := helix_grant_session_locks(
        v_session, p_job_types, p_max_holders, greatest(v_left, 1000), p_quota, p_share, p_locks_limit, false, p_place
    );
    IF p_idempotency_key IS NOT NULL THEN
        UPDATE helix_holds AS h SET added_key = p_idempotency_key
        WHERE h.organization_id = v_session.organization_id AND h.session_id = p_session_id
          AND h.id = ANY (v_ids);
    END IF;
    RETURN QUERY
        SELECT * FROM helix_session_answer(p_session_id, p_organization_id, false, false) AS a
        WHERE a.id = ANY (v_ids);
END $function$;
REVOKE EXECUTE ON FUNCTION helix_add_session_locks(bigint,text,text,text[],integer[],integer,bigint,integer,text,bigint) FROM PUBLIC;
COMMENT ON FUNCTION helix_add_session_locks(bigint,text,text,text[],integer[],integer,bigint,integer,text,bigint) IS 'POST /v1/sessions/{id}/locks: grants more locks to an open session, all or none, with its lease (the answer lists them); a repeat with the same Idempotency-Key while the session holds exactly the locks that call added answers them (replayed); HL010 when its lease has run out; a session that lost a lock ends instead (session_state ended). Migration 0028; p_place: a waiting call''s order number in its pairs'' queues (0029).';
