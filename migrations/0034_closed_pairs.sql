-- Hold limits, second part (issue 41): "hold_at_least_seconds" on an acquire closes its pair.
--
-- Many machines run one schedule: the first takes the lock, finishes in a moment and releases, and
-- a machine whose clock is a second late takes it again and runs the job twice. With
-- hold_at_least_seconds the grant closes its pair until closed_until (acquired_at + that, by the
-- database clock): no other lock of the pair is granted before it, whatever becomes of this one
-- (released early, lapsed and reclaimed, forced). An acquire meanwhile is refused with HL013 (409
-- closed-until), whose DETAIL says until when.
--
-- The closing is the pair's, so it lives on the pair's row of helix_lock_keys, which every grant
-- already updates first (its fencing counter) and so reads at no cost: one more column, and one
-- more UPDATE of the row for a grant that closes. Each lock records its own closed_until too, in
-- helix_holds and, copied at the end, in helix_lock_history, so that the lock object and the
-- history show it. Only plain exclusive locks close a pair (max_holders 1).
--
-- The acquire functions now answer the lock's hold_limit_at and closed_until themselves, read by
-- the statement that returns the grant (its own snapshot sees the hold, as helix_hold_limit_of's
-- does), so the service no longer calls helix_hold_limit_of, which stays for the build before.
--
-- Rolling upgrade: the acquire functions keep their arguments and add p_hold_at_least_ms last
-- with a default, and their answer gains two columns at the end, which the previous build does
-- not read; its calls resolve to them. The previous build does not know HL013, so while it runs
-- beside this one its acquire of a closed pair answers 503 (docs/deployment.md); only this build
-- closes pairs.

CREATE FUNCTION helix_hold_at_least(p_ms bigint)
 RETURNS interval
 LANGUAGE plpgsql
 IMMUTABLE
AS $function$
BEGIN
    IF p_ms IS NULL THEN
        RETURN NULL;
    END IF;
    IF p_ms < 1000 OR p_ms > 604800000 THEN
        RAISE EXCEPTION 'hold_at_least must be between 1000 and 604800000 ms, got %', p_ms
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'hold_at_least_seconds';
    END IF;
    RETURN p_ms * interval '1 millisecond';
END $function$;
COMMENT ON FUNCTION helix_hold_at_least(bigint) IS 'How long a grant closes its pair, in milliseconds, as an interval (NULL: it does not); 22023 (naming hold_at_least_seconds) outside 1 s to 7 days (0034).';

ALTER TABLE helix_lock_keys ADD COLUMN closed_until timestamptz;
COMMENT ON COLUMN helix_lock_keys.closed_until IS 'No grant of the pair before this time: set by a grant with hold_at_least_seconds (0034). NULL, or past: open.';

ALTER TABLE helix_holds ADD COLUMN closed_until timestamptz;
COMMENT ON COLUMN helix_holds.closed_until IS 'The time until which this lock''s grant closed its pair: acquired_at + hold_at_least_seconds (0034). NULL: it did not.';
ALTER TABLE helix_lock_history ADD COLUMN closed_until timestamptz;
COMMENT ON COLUMN helix_lock_history.closed_until IS 'As in helix_holds, copied at the end.';

CREATE OR REPLACE FUNCTION helix_end_holds(p_ids bigint[], p_at timestamp with time zone, p_reason text, p_forced_by text, p_token text DEFAULT NULL::text, p_organization_id text DEFAULT NULL::text, p_alone boolean DEFAULT false)
 RETURNS integer
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    v_count integer;
BEGIN
    WITH ended AS (
        -- With a token (a holder's release): only a hold of it, in the organization when one is
        -- given, and without a row lock taken first. A NULL p_at is the clock read as each hold
        -- is deleted, after any wait for a change in flight.
        DELETE FROM helix_holds AS h
        WHERE h.id = ANY (p_ids)
          AND (p_organization_id IS NULL OR h.organization_id = p_organization_id)
          AND (p_token IS NULL OR helix_digest(h.token) = helix_digest(p_token))
          AND (NOT p_alone OR h.session_id IS NULL)
        RETURNING h.*, coalesce(p_at, clock_timestamp()) AS ended_at
    ),
    inserted AS (
        INSERT INTO helix_lock_history (
            id, organization_id, job_type, slot, max_holders, holder, token, metadata,
            fencing_token, acquired_at, expires_at, released_at, release_reason, forced_by,
            idempotency_key, reclaimed_lock_id, reclaimed_holder, reclaimed_expired_at, replayed,
            acquired_xid, renewed_xid, renewed_at, updated_xid, updated_at, changed_xid, lapses,
            expired_xid, lapse_xids, session_id, shared, hold_limit_at, closed_until
        )
        SELECT e.id, e.organization_id, e.job_type, e.slot, e.max_holders, e.holder, e.token,
               e.metadata, e.fencing_token, e.acquired_at, l.expires_at, e.ended_at, p_reason,
               p_forced_by, e.idempotency_key, e.reclaimed_lock_id, e.reclaimed_holder,
               e.reclaimed_expired_at, e.replayed, e.acquired_xid, l.renewed_xid, l.renewed_at,
               e.updated_xid, e.updated_at, pg_current_xact_id(), l.lapses,
               -- An end after the lease ran out announces the expiry, if no one did.
               CASE WHEN l.expired_xid IS NULL AND l.expires_at <= e.ended_at
                    THEN pg_current_xact_id() ELSE l.expired_xid END,
               l.lapse_xids, e.session_id, e.shared, e.hold_limit_at, e.closed_until
        FROM ended AS e
        CROSS JOIN LATERAL helix_hold_lease(
            e.session_id, e.acquired_at, e.expires_at, e.renewed_at, e.renewed_xid, e.lapses,
            e.lapse_xids, e.expired_xid, e.changed_xid
        ) AS l
        ORDER BY e.id
        RETURNING 1
    )
    SELECT count(*)::integer INTO v_count FROM inserted;
    RETURN v_count;
END $function$;
REVOKE EXECUTE ON FUNCTION helix_end_holds(bigint[],timestamp with time zone,text,text,text,text,boolean) FROM PUBLIC;
COMMENT ON FUNCTION helix_end_holds(bigint[],timestamp with time zone,text,text,text,text,boolean) IS 'Ends live locks (release, force, reclaim): deletes their holds and inserts their history rows, with the lease in force (helix_hold_lease: a session''s, 0028) and session_id, dated p_at (NULL: the clock as each is deleted), in one statement; returns how many. Either the caller has locked the holds FOR UPDATE, or it gives the token (and organization) that a hold must have to end. p_alone: locks on their own only. The hold limit (0033) and the pair''s closing (0034) go with the lock into its history.';

DROP FUNCTION helix_acquire_job_lock(text,text,text,bigint,jsonb,text,integer,bigint,text,bigint);
CREATE FUNCTION helix_acquire_job_lock(p_organization_id text, p_job_type text, p_holder text, p_ttl_ms bigint, p_metadata jsonb, p_idempotency_key text, p_max_holders integer DEFAULT 1, p_place bigint DEFAULT NULL::bigint, p_mode text DEFAULT 'exclusive'::text, p_max_hold_ms bigint DEFAULT NULL::bigint, p_hold_at_least_ms bigint DEFAULT NULL::bigint)
 RETURNS TABLE(id bigint, organization_id text, job_type text, holder text, fencing_token bigint, acquired_at timestamp with time zone, expires_at timestamp with time zone, released_at timestamp with time zone, release_reason text, state text, ttl_remaining_ms bigint, metadata jsonb, max_holders integer, slot integer, token text, reclaimed_lock_id bigint, reclaimed_holder text, reclaimed_expired_at timestamp with time zone, hold_limit_at timestamp with time zone, closed_until timestamp with time zone)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path FROM CURRENT
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
#variable_conflict use_column
DECLARE
    v_lease interval := helix_lease(p_ttl_ms);
    v_max_hold interval := helix_max_hold(p_max_hold_ms);  -- NULL: no hold limit
    v_at_least interval := helix_hold_at_least(p_hold_at_least_ms);  -- NULL: the pair stays open (0034)
    v_closed_until timestamptz;  -- the pair's: no grant before it (0034)
    v_token text := helix_new_token();
    v_fencing_token bigint;
    v_lock helix_holds%ROWTYPE;
    v_live helix_holds[] := '{}';  -- the pair's live locks, by slot
    v_held integer := 0;
    v_in_force integer;  -- the held locks' max_holders
    v_shared boolean := p_mode = 'shared';
    v_in_force_shared boolean;  -- the held locks' mode: shared or not
    v_room integer;  -- the locks the pair may hold at once in this acquire's mode and max_holders
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
    v_other boolean := false;  -- a place counted in v_ahead names another max_holders or mode
    v_first helix_holds%ROWTYPE;  -- of a refusal by the queue of a held pair: the first lease to end
BEGIN
    IF p_max_holders IS NULL OR p_max_holders < 1 OR p_max_holders > 1000 THEN
        RAISE EXCEPTION 'max_holders must be between 1 and 1000, got %', p_max_holders
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'max_holders';
    END IF;
    IF p_mode IS NULL OR p_mode NOT IN ('exclusive', 'shared') THEN
        RAISE EXCEPTION 'mode must be exclusive or shared, got %', p_mode
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'mode';
    END IF;
    -- Shared locks are held together, each of its own, up to 1000 (0030); a semaphore's locks are
    -- exclusive, one per slot.
    IF v_shared AND p_max_holders <> 1 THEN
        RAISE EXCEPTION 'a shared lock has max_holders 1, got %', p_max_holders
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'max_holders';
    END IF;
    v_room := CASE WHEN v_shared THEN 1000 ELSE p_max_holders END;
    -- A pair closes for one holder at a time: of a plain exclusive lock only (0034).
    IF v_at_least IS NOT NULL AND (v_shared OR p_max_holders <> 1) THEN
        RAISE EXCEPTION 'hold_at_least is for exclusive locks with max_holders 1'
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'hold_at_least_seconds';
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
        RETURNING k.last_fencing_token, k.closed_until INTO v_fencing_token, v_closed_until;
        IF NOT FOUND THEN
            INSERT INTO helix_lock_keys AS k (organization_id, job_type, last_fencing_token)
            VALUES (p_organization_id, p_job_type, 1)
            ON CONFLICT (organization_id, job_type)
                DO UPDATE SET last_fencing_token = k.last_fencing_token + 1
            RETURNING k.last_fencing_token, k.closed_until INTO v_fencing_token, v_closed_until;
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
                v_in_force_shared := v_lock.shared;
                IF p_idempotency_key IS NOT NULL
                   AND v_lock.idempotency_key = p_idempotency_key
                   AND v_lock.holder = p_holder THEN
                    v_id := v_lock.id;  -- the original committed while this repeat waited (0010)
                END IF;
            ELSIF v_lock.max_holders <> p_max_holders OR v_lock.shared <> v_shared OR v_shared THEN
                -- Expired, of another value or mode: always reclaimed (no live lock of another
                -- mode may stay beside the grant: helix_holds_modes_apart). A reader's grant
                -- reclaims every expired lock of the pair, readers' too (0032), as the next
                -- acquire of a plain lock does: dead readers do not pile up, each a live lock
                -- against the quota, until a writer comes or the 1000 slots are taken.
                v_reclaim := v_reclaim || v_lock.id;
                IF v_reclaimed.id IS NULL OR v_lock.expires_at < v_reclaimed.expires_at THEN
                    v_reclaimed := v_lock;
                END IF;
            END IF;
        END LOOP;

        -- A closed pair (0034) grants nobody before closed_until, whatever became of the lock
        -- that closed it: HL013, before any other refusal, since nothing else can open it sooner.
        -- A repeat of a live grant is answered as before.
        IF v_id IS NULL AND v_closed_until > v_now THEN
            RAISE EXCEPTION '% / % is closed until %', p_organization_id, p_job_type, v_closed_until
                USING ERRCODE = 'HL013',
                      DETAIL = json_build_object(
                          'closed_until', v_closed_until,
                          'closed_ms', ceil(extract(epoch FROM v_closed_until - v_now) * 1000)::bigint,
                          'retry_after_seconds', greatest(1, ceil(extract(epoch FROM v_closed_until - v_now))),
                          'job_type', p_job_type
                      )::text;
        END IF;

        v_full := v_held > 0 AND (
            v_held >= v_room OR v_in_force <> p_max_holders OR v_in_force_shared <> v_shared
        );
        -- The pair's queue (0029), read under the pair's row lock, so that grants and the places
        -- they consume are judged one after the other: the live places before the caller's, as
        -- many as there are free slots at most (one when none is free). An index probe when nobody
        -- waits, and none read at all for the first place.
        IF v_id IS NULL AND EXISTS (
            SELECT FROM helix_lock_waiters AS w
            WHERE w.organization_id = p_organization_id AND w.job_type = p_job_type
              AND w.replica IS NOT NULL
        ) THEN
            -- A place of another mode ahead goes first too: a shared acquire does not pass a
            -- waiting exclusive one (writers first), nor the other way round.
            SELECT count(*),
                   coalesce(bool_or(q.max_holders <> p_max_holders OR coalesce(q.shared, false) <> v_shared), false)
            INTO v_ahead, v_other
            FROM helix_live_places(
                p_organization_id, p_job_type, p_place,
                CASE WHEN v_full THEN 1 ELSE v_room - v_held END
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
        ELSIF v_ahead > 0 AND (v_full OR v_other OR v_ahead >= v_room - v_held) THEN
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
                          -- The held locks' mode, as lock-held's (0032).
                          'mode', CASE WHEN v_first.id IS NULL THEN NULL
                                       WHEN v_first.shared THEN 'shared' ELSE 'exclusive' END,
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
                FROM generate_series(0, v_room - 1) AS s
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
            IF v_at_least IS NOT NULL THEN  -- the pair closes until closed_until (0034)
                UPDATE helix_lock_keys AS k SET closed_until = v_now + v_at_least
                WHERE k.organization_id = p_organization_id AND k.job_type = p_job_type;
            END IF;
            INSERT INTO helix_holds (
                organization_id, job_type, holder, token, metadata, fencing_token, acquired_at,
                expires_at, idempotency_key, reclaimed_lock_id, reclaimed_holder, reclaimed_expired_at,
                max_holders, slot, shared, hold_limit_at, closed_until
            )
            VALUES (
                p_organization_id, p_job_type, p_holder, v_token, p_metadata, v_fencing_token,
                -- The first lease ends at the hold limit at the latest (0033).
                v_now, v_now + least(v_lease, coalesce(v_max_hold, v_lease)), p_idempotency_key,
                v_reclaimed.id, v_reclaimed.holder, v_reclaimed.expires_at, p_max_holders, v_slot,
                v_shared, v_now + v_max_hold, v_now + v_at_least
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
        SELECT v.*, h.token, h.reclaimed_lock_id, h.reclaimed_holder, h.reclaimed_expired_at,
               h.hold_limit_at, h.closed_until
        FROM helix_held_locks AS v
        JOIN helix_holds AS h ON h.id = v.id
        WHERE v.id = v_id;
END $function$;
REVOKE EXECUTE ON FUNCTION helix_acquire_job_lock(text,text,text,bigint,jsonb,text,integer,bigint,text,bigint,bigint) FROM PUBLIC;
COMMENT ON FUNCTION helix_acquire_job_lock(text,text,text,bigint,jsonb,text,integer,bigint,text,bigint,bigint) IS 'Grants a free slot of the pair, reclaiming expired locks and announcing the expiries of the others it leaves (0022), in one statement; or raises 23505 whose DETAIL names the lock whose lease runs out first and lists at most 20 holders, those whose leases run out first, with holders_total (0021): an answer bounded whatever max_holders. A lock of a session with the session''s lease, judged with the session''s row locked when it ran out (0028). Live places of the pair''s queue before p_place (every one, without p_place) take the free slots first: 23505 with DETAIL waiting and ahead (0029); a grant consumes its place. p_mode (0030): exclusive, or shared (max_holders 1, up to 1000 held together); a pair''s locks share one mode, and a place of the other mode ahead goes first. A reader''s grant reclaims every expired lock of the pair (0032). p_max_hold_ms: the hold limit, hold_limit_at = acquired_at + that, which no lease passes; NULL for none (0033). p_hold_at_least_ms: closes the pair until closed_until = acquired_at + that, before which no grant of it is made (HL013, with closed_until, closed_ms and retry_after_seconds in DETAIL); the answer has the lock''s hold_limit_at and closed_until (0034).';

DROP FUNCTION helix_acquire_job_lock_on_share(text,text,text,bigint,jsonb,text,integer,bigint,bigint,text,bigint);
CREATE FUNCTION helix_acquire_job_lock_on_share(p_organization_id text, p_job_type text, p_holder text, p_ttl_ms bigint, p_metadata jsonb, p_idempotency_key text, p_max_holders integer, p_share bigint, p_place bigint DEFAULT NULL::bigint, p_mode text DEFAULT 'exclusive'::text, p_max_hold_ms bigint DEFAULT NULL::bigint, p_hold_at_least_ms bigint DEFAULT NULL::bigint)
 RETURNS TABLE(id bigint, organization_id text, job_type text, holder text, fencing_token bigint, acquired_at timestamp with time zone, expires_at timestamp with time zone, released_at timestamp with time zone, release_reason text, state text, ttl_remaining_ms bigint, metadata jsonb, max_holders integer, slot integer, token text, reclaimed_lock_id bigint, reclaimed_holder text, reclaimed_expired_at timestamp with time zone, hold_limit_at timestamp with time zone, closed_until timestamp with time zone)
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
        p_organization_id, p_job_type, p_holder, p_ttl_ms, p_metadata, p_idempotency_key, p_max_holders, p_place, p_mode,
        p_max_hold_ms, p_hold_at_least_ms
    );
    IF p_idempotency_key IS NOT NULL THEN  -- no call at all for an acquire without a key (0032)
        PERFORM helix_refuse_replay_of_another_mode(p_organization_id, p_job_type, p_holder, p_idempotency_key, p_mode);
    END IF;
END $function$;
REVOKE EXECUTE ON FUNCTION helix_acquire_job_lock_on_share(text,text,text,bigint,jsonb,text,integer,bigint,bigint,text,bigint,bigint) FROM PUBLIC;
COMMENT ON FUNCTION helix_acquire_job_lock_on_share(text,text,text,bigint,jsonb,text,integer,bigint,bigint,text,bigint,bigint) IS 'helix_acquire_job_lock, let through on a share of the quota: under the share''s advisory lock in shared mode to its commit, so that the share stays until it has committed; HL005 once the share is gone or past its time (migration 0020). p_place: the waiter''s place (0029). p_mode: exclusive or shared; a repeat of another mode is refused (0031). p_max_hold_ms: the hold limit (0033). p_hold_at_least_ms: the pair''s closing (0034).';

DROP FUNCTION helix_acquire_job_lock_within_quota(text,text,text,bigint,jsonb,text,integer,integer,bigint,text,bigint);
CREATE FUNCTION helix_acquire_job_lock_within_quota(p_organization_id text, p_job_type text, p_holder text, p_ttl_ms bigint, p_metadata jsonb, p_idempotency_key text, p_quota integer, p_max_holders integer DEFAULT 1, p_place bigint DEFAULT NULL::bigint, p_mode text DEFAULT 'exclusive'::text, p_max_hold_ms bigint DEFAULT NULL::bigint, p_hold_at_least_ms bigint DEFAULT NULL::bigint)
 RETURNS TABLE(id bigint, organization_id text, job_type text, holder text, fencing_token bigint, acquired_at timestamp with time zone, expires_at timestamp with time zone, released_at timestamp with time zone, release_reason text, state text, ttl_remaining_ms bigint, metadata jsonb, max_holders integer, slot integer, token text, reclaimed_lock_id bigint, reclaimed_holder text, reclaimed_expired_at timestamp with time zone, hold_limit_at timestamp with time zone, closed_until timestamp with time zone)
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
    v_mode_shared boolean := p_mode = 'shared';
BEGIN
    PERFORM pg_advisory_xact_lock(helix_quota_lock_key(p_organization_id));
    -- A shared acquire beside the pair's readers adds a lock too, up to 1000 of them (0031),
    -- unless a lock of the pair has expired: a reader's grant reclaims every one (0032). A lock
    -- of a session has the session's lease.
    SELECT count(*) FILTER (WHERE h.max_holders = p_max_holders AND h.shared = v_mode_shared) = count(*)
           AND count(*) < CASE WHEN v_mode_shared THEN 1000 ELSE p_max_holders END
           AND NOT (v_mode_shared AND coalesce(bool_or(
               CASE WHEN h.session_id IS NULL THEN h.expires_at
                    ELSE coalesce((SELECT s.expires_at FROM helix_sessions AS s WHERE s.id = h.session_id),
                                  h.expires_at)
               END <= clock_timestamp()), false)),
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
        p_organization_id, p_job_type, p_holder, p_ttl_ms, p_metadata, p_idempotency_key, p_max_holders, p_place, p_mode,
        p_max_hold_ms, p_hold_at_least_ms
    );
    IF p_idempotency_key IS NOT NULL THEN  -- no call at all for an acquire without a key (0032)
        PERFORM helix_refuse_replay_of_another_mode(p_organization_id, p_job_type, p_holder, p_idempotency_key, p_mode);
    END IF;
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
REVOKE EXECUTE ON FUNCTION helix_acquire_job_lock_within_quota(text,text,text,bigint,jsonb,text,integer,integer,bigint,text,bigint,bigint) FROM PUBLIC;
COMMENT ON FUNCTION helix_acquire_job_lock_within_quota(text,text,text,bigint,jsonb,text,integer,integer,bigint,text,bigint,bigint) IS 'helix_acquire_job_lock near the quota: counted and granted under the quota''s advisory lock held exclusively, holding back the room of the shares, or taking them back (waiting for the acquires in flight on them) when it needs it; HL004 beyond the quota. A repeat is judged by what the call itself did (migration 0020). p_place: the waiter''s place (0029). p_mode: exclusive or shared, a reader beside readers counted as a lock it adds; a repeat of another mode is refused (0031). p_max_hold_ms: the hold limit (0033). p_hold_at_least_ms: the pair''s closing (0034).';
