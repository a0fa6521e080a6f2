-- The lean data model (docs/data-model.md): live locks and ended ones in tables of their own,
-- each written the way it is read, so that a lock cycle, a renewal and a read cost the primary
-- as little as the guarantees allow.
--
-- Until now every lock was a row of helix_job_locks from its grant to the end of its retention,
-- with seven indexes; a release and every renewal changed indexed columns, so none was a HOT
-- update and each wrote an entry into most indexes. Now:
--
-- - helix_holds: one row per live lock, keyed by (organization_id, job_type, slot), inserted by
--   the grant and deleted at the lock's end. Two indexes: the primary key, which with the slot's
--   CHECK is the last line of defence (a pair cannot have two locks in one slot), and the lock id.
--   No other column is indexed, so a renewal, an update of metadata, an announced expiry and a
--   replay's claim are HOT updates that write no index entry (fillfactor 50 leaves them room).
-- - helix_lock_history: one row per ended lock, inserted once by the lock's end (release, force,
--   reclaim) in the same statement that deletes the hold, never updated by the functions. Its
--   indexes are those its readers need: the id, the listings' two (as migration 0011's), the
--   admin listing's and retention's (newest first), and the event stream's (the transaction of
--   the end: a B-tree within an organization, BRIN across them).
-- - helix_lock_keys keeps the fencing counter of each pair, as before.
--
-- helix_job_locks becomes a view of both tables with the old columns, so that readers of it (a
-- replica of the previous build during a rolling upgrade, an operator's query) go on working. It
-- takes writes too (helix_job_locks_written): an INSERT goes to the table its released_at says,
-- an UPDATE changes the columns it changes, and a released_at set ends the lock as a release
-- does. helix_job_lock_views keeps its columns over the same two tables.
--
-- An expiry is no longer announced on every poll of every event reader: with no index on
-- expires_at, finding the due ones reads the live holds, so one reader at a time does it, at
-- most once a second (helix_expiry_sweep), and an expiry's event comes up to a second later.
--
-- The copy runs under an ACCESS EXCLUSIVE lock of the old table: about 7 s per million locks on
-- this project's test machine (docs/operations.md).

LOCK TABLE helix_job_locks, helix_lock_keys IN ACCESS EXCLUSIVE MODE;

-- Functions typed by the old table's rows, or reading it in ways a view cannot serve (FOR UPDATE).
DROP FUNCTION helix_lock_for_holder(bigint, text, text);
DROP FUNCTION helix_lock_for_holder(bigint, text, text, boolean);
DROP FUNCTION helix_raise_if_ended(helix_job_locks);
DROP FUNCTION helix_lock_events(pg_snapshot, timestamptz, timestamptz, text, text, pg_snapshot, timestamptz);

ALTER TABLE helix_job_locks RENAME TO helix_job_locks_retired;

CREATE SEQUENCE helix_lock_ids AS bigint;
SELECT setval(
    'helix_lock_ids',
    greatest(last, 1),
    last >= 1
)
FROM (
    SELECT greatest(
        coalesce(pg_sequence_last_value(pg_get_serial_sequence('helix_job_locks_retired', 'id')), 0),
        coalesce((SELECT max(id) FROM helix_job_locks_retired), 0)
    ) AS last
) AS ids;
COMMENT ON SEQUENCE helix_lock_ids IS 'Lock ids, live and ended: continues the identity of the table helix_job_locks that migration 0023 replaced.';

CREATE TABLE helix_holds (
    organization_id text NOT NULL,
    job_type text NOT NULL,
    slot integer NOT NULL DEFAULT 0,
    max_holders integer NOT NULL DEFAULT 1,
    id bigint NOT NULL DEFAULT nextval('helix_lock_ids'),
    holder text NOT NULL,
    token text NOT NULL,
    metadata jsonb,
    fencing_token bigint NOT NULL,
    acquired_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    idempotency_key text,
    reclaimed_lock_id bigint,
    reclaimed_holder text,
    reclaimed_expired_at timestamptz,
    replayed boolean NOT NULL DEFAULT false,
    acquired_xid xid8,
    renewed_xid xid8,
    renewed_at timestamptz,
    updated_xid xid8,
    updated_at timestamptz,
    changed_xid xid8,
    lapses timestamptz[],
    expired_xid xid8,
    lapse_xids xid8[],
    CONSTRAINT helix_holds_pkey PRIMARY KEY (organization_id, job_type, slot),
    CONSTRAINT helix_holds_slot_within
        CHECK (max_holders >= 1 AND max_holders <= 1000 AND slot >= 0 AND slot < max_holders),
    CONSTRAINT helix_holds_expires_after_acquired CHECK (expires_at > acquired_at)
) WITH (fillfactor = 50);
COMMENT ON TABLE helix_holds IS 'One row per live lock (held, or its lease run out and nobody reclaimed it), from its grant to its end, when helix_end_holds moves it into helix_lock_history. Only the primary key and the lock id are indexed, so that renewals, updates and announced expiries are HOT updates (migration 0023).';
COMMENT ON COLUMN helix_holds.changed_xid IS 'The transaction of the row''s latest change that GET /v1/events reports (grant, renewal, update, announced expiry).';
COMMENT ON COLUMN helix_holds.expired_xid IS 'The transaction that announced that the current lease (expires_at) ran out: an event reader''s sweep (helix_announce_expiries), or the grant, update or end that came after it. NULL: not announced.';
COMMENT ON COLUMN helix_holds.lapse_xids IS 'Beside lapses, the transaction that announced each of those expiries (GET /v1/events).';

-- Its CHECK (released_at IS NOT NULL) says again what NOT NULL says, on purpose: with it the
-- planner leaves this table out of a query of the view helix_job_locks for released_at IS NULL
-- (constraint exclusion of a UNION ALL branch).
CREATE TABLE helix_lock_history (
    id bigint NOT NULL,
    organization_id text NOT NULL,
    job_type text NOT NULL,
    slot integer NOT NULL,
    max_holders integer NOT NULL,
    holder text NOT NULL,
    token text NOT NULL,
    metadata jsonb,
    fencing_token bigint NOT NULL,
    acquired_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    released_at timestamptz NOT NULL,
    release_reason text NOT NULL,
    forced_by text,
    idempotency_key text,
    reclaimed_lock_id bigint,
    reclaimed_holder text,
    reclaimed_expired_at timestamptz,
    replayed boolean NOT NULL DEFAULT false,
    acquired_xid xid8,
    renewed_xid xid8,
    renewed_at timestamptz,
    updated_xid xid8,
    updated_at timestamptz,
    changed_xid xid8,
    lapses timestamptz[],
    expired_xid xid8,
    lapse_xids xid8[],
    -- The event stream reads ended locks by the transaction of their end: a number, so that a
    -- BRIN index can hold it (xid8 has no BRIN operator class). Computed as the copy below
    -- inserts, rather than added after it, which would write the table a second time.
    ended_xid bigint GENERATED ALWAYS AS ((changed_xid::text)::bigint) STORED,
    CONSTRAINT helix_lock_history_release_reason
        CHECK (release_reason = ANY (ARRAY['released', 'reclaimed', 'forced'])),
    CONSTRAINT helix_lock_history_ended CHECK (released_at IS NOT NULL)
);
COMMENT ON TABLE helix_lock_history IS 'One row per ended lock (released, forced or reclaimed), inserted by its end and kept for the retention window (helix_prune_history). Insert-only: its order of insertion is the order of ends, which its BRIN index relies on (migration 0023).';
COMMENT ON COLUMN helix_lock_history.changed_xid IS 'The transaction that ended the lock: its last change.';
COMMENT ON COLUMN helix_lock_history.ended_xid IS 'changed_xid as a number, which the event stream reads by (a B-tree within an organization, BRIN across them).';

-- The copy, keeping ids, tokens, fencing tokens and every transaction id the events read.
INSERT INTO helix_holds (
    organization_id, job_type, slot, max_holders, id, holder, token, metadata, fencing_token,
    acquired_at, expires_at, idempotency_key, reclaimed_lock_id, reclaimed_holder,
    reclaimed_expired_at, replayed, acquired_xid, renewed_xid, renewed_at, updated_xid,
    updated_at, changed_xid, lapses, expired_xid, lapse_xids
)
SELECT organization_id, job_type, slot, max_holders, id, holder, token, metadata, fencing_token,
       acquired_at, expires_at, idempotency_key, reclaimed_lock_id, reclaimed_holder,
       reclaimed_expired_at, replayed, acquired_xid, renewed_xid, renewed_at, updated_xid,
       updated_at, changed_xid, lapses, expired_xid, lapse_xids
FROM helix_job_locks_retired
WHERE released_at IS NULL;

INSERT INTO helix_lock_history (
    id, organization_id, job_type, slot, max_holders, holder, token, metadata, fencing_token,
    acquired_at, expires_at, released_at, release_reason, forced_by, idempotency_key,
    reclaimed_lock_id, reclaimed_holder, reclaimed_expired_at, replayed, acquired_xid, renewed_xid,
    renewed_at, updated_xid, updated_at, changed_xid, lapses, expired_xid, lapse_xids
)
SELECT id, organization_id, job_type, slot, max_holders, holder, token, metadata, fencing_token,
       acquired_at, expires_at, released_at, release_reason, forced_by, idempotency_key,
       reclaimed_lock_id, reclaimed_holder, reclaimed_expired_at, replayed, acquired_xid, renewed_xid,
       renewed_at, updated_xid, updated_at, changed_xid, lapses, expired_xid, lapse_xids
FROM helix_job_locks_retired
WHERE released_at IS NOT NULL
ORDER BY changed_xid, id;

ALTER TABLE helix_lock_history ADD CONSTRAINT helix_lock_history_pkey PRIMARY KEY (id);
CREATE UNIQUE INDEX helix_holds_id ON helix_holds (id);
CREATE INDEX helix_lock_history_newest ON helix_lock_history (released_at DESC, id DESC);
CREATE INDEX helix_lock_history_by_organization ON helix_lock_history
    (organization_id, (release_reason IS DISTINCT FROM 'reclaimed'), released_at DESC, id DESC);
CREATE INDEX helix_lock_history_by_job_type ON helix_lock_history
    (organization_id, job_type, (release_reason IS DISTINCT FROM 'reclaimed'), released_at DESC, id DESC);
CREATE INDEX helix_lock_history_ended_by_organization ON helix_lock_history (organization_id, ended_xid);
CREATE INDEX helix_lock_history_ended ON helix_lock_history USING brin (ended_xid)
    WITH (pages_per_range = 4, autosummarize = on);

-- The event readers' sweep of due expiries: when one last ran (helix_announce_expiries).
CREATE TABLE helix_expiry_sweep (
    one boolean NOT NULL DEFAULT true,
    swept_at timestamptz NOT NULL,
    CONSTRAINT helix_expiry_sweep_one CHECK (one),
    CONSTRAINT helix_expiry_sweep_pkey PRIMARY KEY (one)
);
INSERT INTO helix_expiry_sweep (swept_at) VALUES ('-infinity');
COMMENT ON TABLE helix_expiry_sweep IS 'When an event reader last looked for due expiries (one row): one reader at a time does it, at most once a second (helix_announce_expiries, migration 0023).';

-- The readers' views: each lock as the API shows it, state and time left by the database clock.
CREATE VIEW helix_held_locks AS
SELECT h.id, h.organization_id, h.job_type, h.holder, h.fencing_token, h.acquired_at, h.expires_at,
       NULL::timestamptz AS released_at, NULL::text AS release_reason,
       CASE WHEN h.expires_at <= clock_timestamp() THEN 'expired' ELSE 'held' END AS state,
       greatest(0::numeric, floor(extract(epoch FROM h.expires_at - clock_timestamp()) * 1000))::bigint
           AS ttl_remaining_ms,
       h.metadata, h.max_holders, h.slot
FROM helix_holds AS h;
COMMENT ON VIEW helix_held_locks IS 'The live locks as the API shows them: state and ttl_remaining_ms by the database clock.';

CREATE VIEW helix_ended_locks AS
SELECT e.id, e.organization_id, e.job_type, e.holder, e.fencing_token, e.acquired_at, e.expires_at,
       e.released_at, e.release_reason,
       CASE WHEN e.release_reason = 'reclaimed' THEN 'reclaimed' ELSE 'released' END AS state,
       0::bigint AS ttl_remaining_ms,
       e.metadata, e.max_holders, e.slot
FROM helix_lock_history AS e;
COMMENT ON VIEW helix_ended_locks IS 'The ended locks as the API shows them.';

CREATE OR REPLACE VIEW helix_job_lock_views AS
SELECT h.* FROM helix_held_locks AS h
UNION ALL
SELECT e.* FROM helix_ended_locks AS e;
COMMENT ON VIEW helix_job_lock_views IS 'Every lock as the API shows it, live or ended (migration 0003''s columns).';

DROP TABLE helix_job_locks_retired;
DROP FUNCTION helix_lock_changed();

-- Every lock with every column, as the table of that name had them.
CREATE VIEW helix_job_locks AS
SELECT h.id, h.organization_id, h.job_type, h.holder, h.token, h.metadata, h.acquired_at,
       h.expires_at, NULL::timestamptz AS released_at, NULL::text AS release_reason,
       h.fencing_token, NULL::text AS forced_by, h.idempotency_key, h.reclaimed_lock_id,
       h.reclaimed_holder, h.reclaimed_expired_at, h.replayed, h.acquired_xid, h.renewed_xid,
       h.renewed_at, h.updated_xid, h.updated_at, h.changed_xid, h.lapses, h.max_holders, h.slot,
       h.expired_xid, h.lapse_xids
FROM helix_holds AS h
UNION ALL
SELECT e.id, e.organization_id, e.job_type, e.holder, e.token, e.metadata, e.acquired_at,
       e.expires_at, e.released_at, e.release_reason, e.fencing_token, e.forced_by,
       e.idempotency_key, e.reclaimed_lock_id, e.reclaimed_holder, e.reclaimed_expired_at,
       e.replayed, e.acquired_xid, e.renewed_xid, e.renewed_at, e.updated_xid, e.updated_at,
       e.changed_xid, e.lapses, e.max_holders, e.slot, e.expired_xid, e.lapse_xids
FROM helix_lock_history AS e;
ALTER VIEW helix_job_locks ALTER COLUMN id SET DEFAULT nextval('helix_lock_ids');
ALTER VIEW helix_job_locks ALTER COLUMN replayed SET DEFAULT false;
ALTER VIEW helix_job_locks ALTER COLUMN max_holders SET DEFAULT 1;
ALTER VIEW helix_job_locks ALTER COLUMN slot SET DEFAULT 0;
COMMENT ON VIEW helix_job_locks IS 'Every lock with every column, live (helix_holds) or ended (helix_lock_history): the table of this name until migration 0023. Takes writes (helix_job_locks_written). FOR UPDATE cannot go through it: lock the rows of the tables.';

-- Writes through the view: what an operator or a test did to the table, done to the tables.
CREATE FUNCTION helix_job_locks_written() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_set text;  -- the columns the UPDATE changes, as a SET list reading the new row ($1)
BEGIN
    IF TG_OP = 'DELETE' THEN
        DELETE FROM helix_holds AS h WHERE h.id = OLD.id;
        DELETE FROM helix_lock_history AS e WHERE e.id = OLD.id;
        RETURN OLD;
    END IF;
    IF TG_OP = 'INSERT' AND NEW.released_at IS NULL THEN
        INSERT INTO helix_holds (
            organization_id, job_type, slot, max_holders, id, holder, token, metadata,
            fencing_token, acquired_at, expires_at, idempotency_key, reclaimed_lock_id,
            reclaimed_holder, reclaimed_expired_at, replayed, renewed_at, updated_at, lapses,
            lapse_xids
        ) VALUES (
            NEW.organization_id, NEW.job_type, NEW.slot, NEW.max_holders, NEW.id, NEW.holder,
            NEW.token, NEW.metadata, NEW.fencing_token, NEW.acquired_at, NEW.expires_at,
            NEW.idempotency_key, NEW.reclaimed_lock_id, NEW.reclaimed_holder,
            NEW.reclaimed_expired_at, NEW.replayed, NEW.renewed_at, NEW.updated_at, NEW.lapses,
            NEW.lapse_xids
        );
        RETURN NEW;
    ELSIF TG_OP = 'INSERT' THEN  -- an ended lock: granted and ended by this transaction
        INSERT INTO helix_lock_history (
            id, organization_id, job_type, slot, max_holders, holder, token, metadata,
            fencing_token, acquired_at, expires_at, released_at, release_reason, forced_by,
            idempotency_key, reclaimed_lock_id, reclaimed_holder, reclaimed_expired_at, replayed,
            acquired_xid, renewed_at, updated_at, changed_xid, lapses, lapse_xids
        ) VALUES (
            NEW.id, NEW.organization_id, NEW.job_type, NEW.slot, NEW.max_holders, NEW.holder,
            NEW.token, NEW.metadata, NEW.fencing_token, NEW.acquired_at, NEW.expires_at,
            NEW.released_at, NEW.release_reason, NEW.forced_by, NEW.idempotency_key,
            NEW.reclaimed_lock_id, NEW.reclaimed_holder, NEW.reclaimed_expired_at, NEW.replayed,
            pg_current_xact_id(), NEW.renewed_at, NEW.updated_at, pg_current_xact_id(), NEW.lapses,
            NEW.lapse_xids
        );
        RETURN NEW;
    END IF;

    IF NEW.id IS DISTINCT FROM OLD.id OR NEW.organization_id IS DISTINCT FROM OLD.organization_id
       OR NEW.job_type IS DISTINCT FROM OLD.job_type OR NEW.slot IS DISTINCT FROM OLD.slot THEN
        RAISE EXCEPTION 'a lock keeps its id, organization, job type and slot'
            USING ERRCODE = 'feature_not_supported';
    END IF;
    IF OLD.released_at IS NOT NULL AND NEW.released_at IS NULL THEN
        RAISE EXCEPTION 'lock % has ended, and an ended lock does not come back', OLD.id
            USING ERRCODE = 'check_violation';
    END IF;
    IF OLD.released_at IS NULL AND NEW.released_at IS NOT NULL AND NEW.release_reason IS NULL THEN
        RAISE EXCEPTION 'lock % cannot end without a release_reason', OLD.id
            USING ERRCODE = 'check_violation';
    END IF;
    SELECT string_agg(format('%I = ($1).%I', n.key, n.key), ', ')
    INTO v_set
    FROM jsonb_each(to_jsonb(NEW)) AS n
    JOIN jsonb_each(to_jsonb(OLD)) AS o ON o.key = n.key
    WHERE n.value IS DISTINCT FROM o.value
      AND (OLD.released_at IS NOT NULL OR n.key NOT IN ('released_at', 'release_reason', 'forced_by'));
    IF OLD.released_at IS NOT NULL THEN
        IF v_set IS NOT NULL THEN
            EXECUTE format('UPDATE helix_lock_history AS e SET %s WHERE e.id = $2', v_set) USING NEW, OLD.id;
        END IF;
        RETURN NEW;
    END IF;
    IF v_set IS NOT NULL THEN
        EXECUTE format('UPDATE helix_holds AS h SET %s WHERE h.id = $2', v_set) USING NEW, OLD.id;
    END IF;
    IF NEW.released_at IS NOT NULL THEN
        PERFORM helix_end_holds(ARRAY[OLD.id], NEW.released_at, NEW.release_reason, NEW.forced_by);
    END IF;
    RETURN NEW;
END $$;
COMMENT ON FUNCTION helix_job_locks_written() IS 'Writes through the view helix_job_locks (migration 0023): an INSERT into the table its released_at says; an UPDATE of the columns it changes, and a released_at set ends the lock as helix_end_holds does; a DELETE from either table. Refuses, with 23514, an end without a reason and an ended lock coming back; with 0A000, a lock moved to another key, slot or id.';
CREATE TRIGGER helix_job_locks_written INSTEAD OF INSERT OR UPDATE OR DELETE ON helix_job_locks
    FOR EACH ROW EXECUTE FUNCTION helix_job_locks_written();

-- What a change of a hold records for the event stream (migration 0019's helix_lock_changed,
-- without the end, which helix_end_holds records in the history row).
CREATE FUNCTION helix_hold_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_xid xid8 := pg_current_xact_id();
BEGIN
    IF TG_OP = 'INSERT' THEN
        NEW.acquired_xid := v_xid;
    ELSIF NEW.expires_at IS DISTINCT FROM OLD.expires_at THEN
        NEW.renewed_xid := v_xid;
        -- The renewal's own clock reading, when it gives one (helix_renew_job_lock does, the one
        -- its new lease and its `lapsed` answer count from).
        IF NEW.renewed_at IS NOT DISTINCT FROM OLD.renewed_at THEN
            NEW.renewed_at := clock_timestamp();
        END IF;
        IF OLD.expired_xid IS NOT NULL OR OLD.expires_at <= NEW.renewed_at THEN
            NEW.lapses := array_append(OLD.lapses, OLD.expires_at);
            NEW.lapse_xids := array_append(OLD.lapse_xids, coalesce(OLD.expired_xid, v_xid));
        END IF;
        NEW.expired_xid := NULL;
    ELSIF NEW.metadata IS DISTINCT FROM OLD.metadata THEN
        NEW.updated_xid := v_xid;
        NEW.updated_at := clock_timestamp();
        -- An update of a lease that ran out announces the expiry, if no one did: the stream sends
        -- it before the update, as a renewal's or an end's.
        IF OLD.expired_xid IS NULL AND OLD.expires_at <= NEW.updated_at THEN
            NEW.expired_xid := v_xid;
        END IF;
    ELSIF NEW.expired_xid IS DISTINCT FROM OLD.expired_xid THEN
        NULL;  -- an announcement: changed_xid below
    ELSE
        RETURN NEW;  -- no change anyone watches (an idempotent repeat's claim)
    END IF;
    NEW.changed_xid := v_xid;
    RETURN NEW;
END $$;
COMMENT ON FUNCTION helix_hold_changed() IS 'Records in a hold the transaction (and time) of each change GET /v1/events reports: grant, renewal (with the lapse it ends), update, announced expiry (migrations 0016, 0019, 0023).';
CREATE TRIGGER helix_hold_changed BEFORE INSERT OR UPDATE ON helix_holds
    FOR EACH ROW EXECUTE FUNCTION helix_hold_changed();
CREATE TRIGGER helix_metadata_bounded BEFORE INSERT OR UPDATE OF metadata ON helix_holds
    FOR EACH ROW WHEN (NEW.metadata IS NOT NULL) EXECUTE FUNCTION helix_metadata_bounded();
COMMENT ON TRIGGER helix_metadata_bounded ON helix_holds IS 'Bounds metadata whoever writes it, testing only the rows whose metadata a statement writes: renewals and releases do not pay for it, and a row stored over the bound before migration 0021 still renews, ends and is reclaimed, all of which a CHECK constraint would refuse.';
-- Waiters are woken by every end, and by a lease made shorter (a test's, an operator's).
CREATE TRIGGER helix_lock_released AFTER INSERT ON helix_lock_history
    FOR EACH ROW EXECUTE FUNCTION helix_lock_released();
CREATE TRIGGER helix_lease_shortened AFTER UPDATE OF expires_at ON helix_holds
    FOR EACH ROW WHEN (NEW.expires_at < OLD.expires_at) EXECUTE FUNCTION helix_lock_released();

-- The end of live locks: each hold deleted and its history row inserted, in one statement
-- (in PL/pgSQL, whose plan is kept for the session: a SQL function is planned at every call).
CREATE FUNCTION helix_end_holds(
    p_ids bigint[], p_at timestamptz, p_reason text, p_forced_by text,
    p_token text DEFAULT NULL, p_organization_id text DEFAULT NULL
)
RETURNS integer
LANGUAGE plpgsql AS $$
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
        RETURNING h.*, coalesce(p_at, clock_timestamp()) AS ended_at
    ),
    inserted AS (
        INSERT INTO helix_lock_history (
            id, organization_id, job_type, slot, max_holders, holder, token, metadata,
            fencing_token, acquired_at, expires_at, released_at, release_reason, forced_by,
            idempotency_key, reclaimed_lock_id, reclaimed_holder, reclaimed_expired_at, replayed,
            acquired_xid, renewed_xid, renewed_at, updated_xid, updated_at, changed_xid, lapses,
            expired_xid, lapse_xids
        )
        SELECT e.id, e.organization_id, e.job_type, e.slot, e.max_holders, e.holder, e.token,
               e.metadata, e.fencing_token, e.acquired_at, e.expires_at, e.ended_at, p_reason,
               p_forced_by, e.idempotency_key, e.reclaimed_lock_id, e.reclaimed_holder,
               e.reclaimed_expired_at, e.replayed, e.acquired_xid, e.renewed_xid, e.renewed_at,
               e.updated_xid, e.updated_at, pg_current_xact_id(), e.lapses,
               -- An end after the lease ran out announces the expiry, if no one did.
               CASE WHEN e.expired_xid IS NULL AND e.expires_at <= e.ended_at
                    THEN pg_current_xact_id() ELSE e.expired_xid END,
               e.lapse_xids
        FROM ended AS e
        ORDER BY e.id
        RETURNING 1
    )
    SELECT count(*)::integer INTO v_count FROM inserted;
    RETURN v_count;
END $$;
COMMENT ON FUNCTION helix_end_holds(bigint[], timestamptz, text, text, text, text) IS 'Ends live locks (release, force, reclaim): deletes their holds and inserts their history rows, dated p_at (NULL: the clock as each is deleted), in one statement; returns how many. Either the caller has locked the holds FOR UPDATE, or it gives the token (and organization) that a hold must have to end.';

-- HL001 when no lock has the id (in the organization, when one is given); HL002 when a token is
-- checked and the ended lock's is another; else HL003, the lock has ended.
CREATE FUNCTION helix_raise_ended(p_lock_id bigint, p_organization_id text, p_token text, p_check_token boolean)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_lock helix_lock_history%ROWTYPE;
BEGIN
    SELECT * INTO v_lock FROM helix_lock_history AS e
    WHERE e.id = p_lock_id
      AND (p_organization_id IS NULL OR e.organization_id = p_organization_id);
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no lock %', p_lock_id USING ERRCODE = 'HL001';
    END IF;
    IF p_check_token AND helix_digest(v_lock.token) IS DISTINCT FROM helix_digest(p_token) THEN
        RAISE EXCEPTION 'token does not match lock %', p_lock_id
            USING ERRCODE = 'HL002',
                  DETAIL = json_build_object(
                      'organization_id', v_lock.organization_id, 'job_type', v_lock.job_type
                  )::text;
    END IF;
    RAISE EXCEPTION 'lock % has ended', p_lock_id
        USING ERRCODE = 'HL003',
              DETAIL = json_build_object(
                  'lock_id', v_lock.id,
                  'release_reason', v_lock.release_reason,
                  'released_at', v_lock.released_at,
                  'forced_by', v_lock.forced_by,
                  'organization_id', v_lock.organization_id,
                  'job_type', v_lock.job_type
              )::text;
END $$;
COMMENT ON FUNCTION helix_raise_ended(bigint, text, text, boolean) IS 'For a lock id that has no hold: HL001 (no such lock in the organization), HL002 (the token checked is not its), or HL003 with the end in DETAIL.';

-- The live lock of a holder, locked for a change: FOR NO KEY UPDATE for a renewal or an update
-- (a fencing check's KEY SHARE does not wait for it), FOR UPDATE for an end.
CREATE FUNCTION helix_lock_for_holder(p_lock_id bigint, p_token text, p_organization_id text, p_renewal boolean)
RETURNS helix_holds
LANGUAGE plpgsql AS $$
DECLARE
    v_lock helix_holds%ROWTYPE;
BEGIN
    IF p_renewal THEN
        SELECT * INTO v_lock FROM helix_holds AS h
        WHERE h.id = p_lock_id AND (p_organization_id IS NULL OR h.organization_id = p_organization_id)
        FOR NO KEY UPDATE;
    ELSE
        SELECT * INTO v_lock FROM helix_holds AS h
        WHERE h.id = p_lock_id AND (p_organization_id IS NULL OR h.organization_id = p_organization_id)
        FOR UPDATE;
    END IF;
    IF NOT FOUND THEN  -- ended (before, or while this call waited for it), or never there
        PERFORM helix_raise_ended(p_lock_id, p_organization_id, p_token, true);
    END IF;
    IF helix_digest(v_lock.token) IS DISTINCT FROM helix_digest(p_token) THEN
        RAISE EXCEPTION 'token does not match lock %', p_lock_id
            USING ERRCODE = 'HL002',
                  DETAIL = json_build_object(
                      'organization_id', v_lock.organization_id, 'job_type', v_lock.job_type
                  )::text;
    END IF;
    RETURN v_lock;
END $$;
COMMENT ON FUNCTION helix_lock_for_holder(bigint, text, text, boolean) IS 'The hold of lock p_lock_id if p_token is its token, row-locked (NO KEY UPDATE for a renewal or update, UPDATE for an end); else HL001, HL002 or HL003 (helix_raise_ended).';

CREATE OR REPLACE FUNCTION helix_claim_replay(
    p_organization_id text, p_job_type text, p_holder text, p_idempotency_key text
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_id bigint;
BEGIN
    IF NOT EXISTS (
        SELECT FROM helix_holds AS h
        WHERE h.organization_id = p_organization_id
          AND h.job_type = p_job_type
          AND h.idempotency_key = p_idempotency_key
          AND h.holder = p_holder
          AND h.expires_at > clock_timestamp()
    ) THEN
        RETURN NULL;
    END IF;
    PERFORM FROM helix_lock_keys AS k
    WHERE k.organization_id = p_organization_id AND k.job_type = p_job_type
    FOR UPDATE;
    WITH claimed AS (
        UPDATE helix_holds AS h
        SET replayed = true
        WHERE h.organization_id = p_organization_id
          AND h.job_type = p_job_type
          AND h.idempotency_key = p_idempotency_key
          AND h.holder = p_holder
          AND h.expires_at > clock_timestamp()
        RETURNING h.id, h.expires_at
    )
    -- Tested again after the UPDATE: one that waited for a row only locked by a renewal that then
    -- failed (a wrong token) claims it without testing it anew.
    SELECT min(c.id) INTO v_id FROM claimed AS c WHERE c.expires_at > clock_timestamp();
    RETURN v_id;
END $$;
COMMENT ON FUNCTION helix_claim_replay(text, text, text, text) IS 'An idempotent repeat of a grant still live: marks it replayed (so that a waiting acquire whose client left does not release it) and returns its id; NULL when there is none (migrations 0010, 0018).';

-- The acquire of 0022 on the new tables: the same steps, the same answers.
-- The token of 0012, the same digits, in PL/pgSQL: as a SQL function with a subquery it was
-- planned at every grant (a tenth of a millisecond of a cycle's half).
CREATE OR REPLACE FUNCTION helix_new_token() RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_first text := replace(gen_random_uuid()::text, '-', '');
    v_second text := replace(gen_random_uuid()::text, '-', '');
BEGIN
    RETURN substr(v_first, 1, 12) || substr(v_first, 14, 3) || substr(v_first, 18, 1)
        || substr(v_second, 1, 12) || substr(v_second, 14, 3) || substr(v_second, 18, 1);
END $$;

-- The digest of 0012, in PL/pgSQL: as a SQL function it was never inlined (convert_to is only
-- stable) and so planned at every call, two a release.
CREATE OR REPLACE FUNCTION helix_digest(p_text text) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    RETURN sha256(convert_to(p_text, 'UTF8'));
END $$;

-- The conflict: 23505, whose DETAIL names the held lock whose lease runs out first and lists at
-- most 20 holders, those whose leases run out first, with their number (0021): an answer bounded
-- whatever max_holders. p_live is the pair's holds in slot order, as the acquire read them.
CREATE FUNCTION helix_raise_held(p_live helix_holds[], p_now timestamptz, p_max_holders integer)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_first helix_holds%ROWTYPE;
    v_held integer;
BEGIN
    SELECT * INTO v_first FROM unnest(p_live) AS u
    WHERE u.expires_at > p_now
    ORDER BY u.expires_at, u.slot
    LIMIT 1;
    SELECT count(*) INTO v_held FROM unnest(p_live) AS u WHERE u.expires_at > p_now;
    RAISE EXCEPTION 'lock % is held', v_first.id
        USING ERRCODE = 'unique_violation',
              CONSTRAINT = 'helix_holds_pkey',
              DETAIL = json_build_object(
                  'lock_id', v_first.id,
                  'holder', v_first.holder,
                  'expires_at', v_first.expires_at,
                  'retry_after_seconds',
                      greatest(1, ceil(extract(epoch FROM v_first.expires_at - p_now))),
                  -- The held locks share one max_holders: a grant of another waits for them all.
                  'max_holders', v_first.max_holders,
                  'max_holders_in_force',
                      CASE WHEN v_first.max_holders <> p_max_holders THEN v_first.max_holders END,
                  'holders', (
                      SELECT json_agg(json_build_object(
                          'lock_id', h.id, 'holder', h.holder, 'slot', h.slot,
                          'expires_at', h.expires_at
                      ) ORDER BY h.expires_at, h.slot)
                      FROM (
                          SELECT * FROM unnest(p_live) AS u
                          WHERE u.expires_at > p_now
                          ORDER BY u.expires_at, u.slot
                          LIMIT 20
                      ) AS h
                  ),
                  'holders_total', v_held
              )::text;
END $$;
COMMENT ON FUNCTION helix_raise_held(helix_holds[], timestamptz, integer) IS 'The acquire''s conflict: raises 23505 (constraint helix_holds_pkey) whose DETAIL names the held lock whose lease runs out first, with at most 20 holders and holders_total.';

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
    v_lock helix_holds%ROWTYPE;
    v_live helix_holds[] := '{}';  -- the pair's live locks, by slot
    v_held integer := 0;
    v_in_force integer;  -- the held locks' max_holders
    v_reclaim bigint[] := '{}';
    v_lapsed bigint[];  -- the pair's leases that ran out, unannounced, left to their holders
    v_reclaimed helix_holds%ROWTYPE;  -- the one the answer names
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
        END LOOP;

        -- The clock is read after every wait: any end seen above committed before this moment,
        -- so a grant never starts before its predecessor ended.
        v_now := clock_timestamp();

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

        IF v_id IS NOT NULL THEN
            UPDATE helix_lock_keys AS k
            SET last_fencing_token = k.last_fencing_token - 1
            WHERE k.organization_id = p_organization_id AND k.job_type = p_job_type;
            UPDATE helix_holds AS h SET replayed = true WHERE h.id = v_id;
        ELSIF v_held > 0 AND (v_held >= p_max_holders OR v_in_force <> p_max_holders) THEN
            PERFORM helix_raise_held(v_live, v_now, p_max_holders);
        ELSE
            -- The lowest slot that no live lock of this value holds; else the slot of the lock
            -- that expired first, reclaimed.
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
                PERFORM helix_end_holds(v_reclaim, v_now, 'reclaimed', NULL);
            END IF;
            -- The pair's other leases that ran out, which this grant leaves to their holders (it
            -- took a free slot): announced here, under the row locks taken above, so that every
            -- stream sends each expiry before this grant, live or resumed (0019, 0022).
            v_lapsed := ARRAY(
                SELECT h.id FROM unnest(v_live) AS h
                WHERE h.expires_at <= v_now AND h.expired_xid IS NULL AND h.id <> ALL (v_reclaim)
            );
            IF cardinality(v_lapsed) > 0 THEN  -- rarely: no statement otherwise
                UPDATE helix_holds AS h SET expired_xid = pg_current_xact_id()
                WHERE h.organization_id = p_organization_id AND h.job_type = p_job_type
                  AND h.id = ANY (v_lapsed);
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

    RETURN QUERY
        SELECT v.*, h.token, h.reclaimed_lock_id, h.reclaimed_holder, h.reclaimed_expired_at
        FROM helix_held_locks AS v
        JOIN helix_holds AS h ON h.id = v.id
        WHERE v.id = v_id;
END $$;
COMMENT ON FUNCTION helix_acquire_job_lock(text,text,text,bigint,jsonb,text,integer) IS 'Grants a free slot of the pair, reclaiming expired locks and announcing the expiries of the others it leaves (0022), in one statement; or raises 23505 whose DETAIL names the lock whose lease runs out first and lists at most 20 holders, those whose leases run out first, with holders_total (0021): an answer bounded whatever max_holders. On the tables of migration 0023.';

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
        p_organization_id, p_job_type, p_holder, p_ttl_ms, p_metadata, p_idempotency_key, p_max_holders
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
END $$;

CREATE OR REPLACE FUNCTION helix_share_quota(
    p_organization_id text, p_limit integer, p_parts integer, p_seconds double precision, p_previous bigint
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
    SELECT count(*) INTO live FROM helix_holds AS h WHERE h.organization_id = p_organization_id;
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

CREATE OR REPLACE FUNCTION helix_release_job_lock(p_lock_id bigint, p_token text, p_organization_id text)
RETURNS SETOF helix_job_lock_views
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    -- The hold ends in one statement when the token is its: no row lock first, no record of one
    -- in the WAL (4% of a cycle's bytes). Else the reason: HL001, HL002 or HL003.
    IF helix_end_holds(ARRAY[p_lock_id], NULL, 'released', NULL, p_token, p_organization_id) = 0 THEN
        PERFORM helix_lock_for_holder(p_lock_id, p_token, p_organization_id, false);
        -- Not reached while a lock's id and token never change; should it be, the lock ends.
        PERFORM helix_end_holds(ARRAY[p_lock_id], clock_timestamp(), 'released', NULL);
    END IF;
    RETURN QUERY SELECT * FROM helix_ended_locks AS v WHERE v.id = p_lock_id;
END $$;

CREATE OR REPLACE FUNCTION helix_release_unclaimed(p_lock_id bigint, p_token text, p_organization_id text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    v_lock helix_holds%ROWTYPE := helix_lock_for_holder(p_lock_id, p_token, p_organization_id, false);
BEGIN
    IF v_lock.replayed THEN
        RETURN false;
    END IF;
    PERFORM helix_end_holds(ARRAY[p_lock_id], clock_timestamp(), 'released', NULL);
    RETURN true;
END $$;

CREATE OR REPLACE FUNCTION helix_force_release_job_lock(p_lock_id bigint, p_key_id text)
RETURNS SETOF helix_job_lock_views
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    PERFORM FROM helix_holds AS h WHERE h.id = p_lock_id FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM helix_raise_ended(p_lock_id, NULL, NULL, false);
    END IF;
    PERFORM helix_end_holds(ARRAY[p_lock_id], clock_timestamp(), 'forced', p_key_id);
    RETURN QUERY SELECT * FROM helix_ended_locks AS v WHERE v.id = p_lock_id;
END $$;

CREATE OR REPLACE FUNCTION helix_renew_job_lock(p_lock_id bigint, p_token text, p_ttl_ms bigint, p_organization_id text)
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
    lapsed boolean
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
    v_lease interval := helix_lease(p_ttl_ms);
    v_lock helix_holds%ROWTYPE := helix_lock_for_holder(p_lock_id, p_token, p_organization_id, true);
    v_now timestamptz := clock_timestamp();  -- under the row lock
BEGIN
    -- A lapsed lease nobody reclaimed may be renewed: no one else can have held the lock. The
    -- renewal is dated by the clock its lease counts from, so that the history (lapses) and the
    -- answer (lapsed) agree on whether the lease had run out. A HOT update: nothing it changes
    -- is indexed.
    UPDATE helix_holds AS h SET expires_at = v_now + v_lease, renewed_at = v_now
    WHERE h.organization_id = v_lock.organization_id AND h.job_type = v_lock.job_type
      AND h.slot = v_lock.slot;
    RETURN QUERY
        SELECT v.*, v_lock.expires_at <= v_now
        FROM helix_held_locks AS v
        WHERE v.id = p_lock_id;
END $$;

CREATE OR REPLACE FUNCTION helix_update_job_lock(p_lock_id bigint, p_token text, p_metadata jsonb, p_organization_id text)
RETURNS SETOF helix_job_lock_views
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    v_lock helix_holds%ROWTYPE := helix_lock_for_holder(p_lock_id, p_token, p_organization_id, true);
BEGIN
    UPDATE helix_holds AS h SET metadata = p_metadata
    WHERE h.organization_id = v_lock.organization_id AND h.job_type = v_lock.job_type
      AND h.slot = v_lock.slot;
    RETURN QUERY SELECT * FROM helix_held_locks AS v WHERE v.id = p_lock_id;
END $$;

CREATE OR REPLACE FUNCTION helix_fencing_token_is_current(
    p_organization_id text, p_job_type text, p_fencing_token bigint
) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    PERFORM 1
    FROM helix_holds AS h
    WHERE h.organization_id = p_organization_id
      AND h.job_type = p_job_type
      AND h.expires_at > clock_timestamp()
      AND h.fencing_token = p_fencing_token
    FOR KEY SHARE;
    RETURN FOUND;
END $$;

-- The event readers' question on each poll: whether a sweep for due expiries may run (at most
-- once a second); a read of one row.
CREATE FUNCTION helix_expiries_due() RETURNS boolean
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path FROM CURRENT AS $$
    SELECT coalesce(
        (SELECT s.swept_at <= clock_timestamp() - interval '1 second' FROM helix_expiry_sweep AS s),
        true
    )
$$;
REVOKE EXECUTE ON FUNCTION helix_expiries_due() FROM PUBLIC;
COMMENT ON FUNCTION helix_expiries_due() IS 'Whether the last sweep for due expiries (helix_announce_expiries) was a second ago or more.';

CREATE OR REPLACE FUNCTION helix_announce_expiries(p_limit integer)
RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    -- A value, not clock_timestamp() in the WHERE clause.
    v_now timestamptz := clock_timestamp();
    v_announced integer;
BEGIN
    -- One reader at a time, at most once a second: finding the due ones reads every live hold.
    IF NOT pg_try_advisory_xact_lock(hashtext('helix_announce_expiries')) THEN
        RETURN 0;
    END IF;
    UPDATE helix_expiry_sweep AS s SET swept_at = v_now WHERE s.swept_at <= v_now - interval '1 second';
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    WITH due AS (
        SELECT h.organization_id, h.job_type, h.slot FROM helix_holds AS h
        WHERE h.expired_xid IS NULL AND h.expires_at <= v_now
        ORDER BY h.expires_at
        LIMIT p_limit
        FOR NO KEY UPDATE SKIP LOCKED
    )
    UPDATE helix_holds AS h SET expired_xid = pg_current_xact_id()
    FROM due
    WHERE (h.organization_id, h.job_type, h.slot) = (due.organization_id, due.job_type, due.slot);
    GET DIAGNOSTICS v_announced = ROW_COUNT;
    IF v_announced >= p_limit THEN  -- more may be due: the next poll sweeps again
        UPDATE helix_expiry_sweep AS s SET swept_at = '-infinity';
    END IF;
    RETURN v_announced;
END $$;
COMMENT ON FUNCTION helix_announce_expiries(integer) IS 'GET /v1/events: marks at most p_limit due expiries (lease run out, not ended, not announced) as announced by this transaction, passing by the holds another transaction has locked; one reader at a time, at most once a second (helix_expiry_sweep), so an expiry''s event comes up to a second after it (migration 0023).';

CREATE OR REPLACE FUNCTION helix_window_events(
    p_after pg_snapshot, p_until pg_snapshot, p_organization_id text, p_job_type text
)
RETURNS TABLE (at timestamptz, id bigint, rank integer)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path FROM CURRENT
SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    -- Values, not subqueries, so that the plan knows how few they are.
    v_in_progress bigint[] := ARRAY(SELECT pg_snapshot_xip(p_after)::text::bigint);
    v_from bigint := pg_snapshot_xmax(p_after)::text::bigint;
BEGIN
    RETURN QUERY
    WITH changed AS (
        -- A row's visible version carries the transaction of its latest change, and a lock's
        -- last change is its end, in its history row. The live holds of the organization (its
        -- primary key's range: bounded by its quota) whose latest change p_after does not see;
        -- the history rows whose end p_after does not see, which ended from its xmax on or among
        -- its in-progress transactions: two index scans, however old p_after's xmin is. The
        -- columns the events need, not the metadata.
        SELECT h.id, h.acquired_at, h.acquired_xid, h.lapses, h.lapse_xids, h.expires_at,
               h.expired_xid, h.renewed_at, h.renewed_xid, h.updated_at, h.updated_xid,
               NULL::timestamptz AS released_at, h.changed_xid
        FROM helix_holds AS h
        WHERE (p_organization_id IS NULL OR h.organization_id = p_organization_id)
          AND (p_job_type IS NULL OR h.job_type = p_job_type)
          AND NOT pg_visible_in_snapshot(h.changed_xid, p_after)
        UNION ALL
        SELECT e.id, e.acquired_at, e.acquired_xid, e.lapses, e.lapse_xids, e.expires_at,
               e.expired_xid, e.renewed_at, e.renewed_xid, e.updated_at, e.updated_xid,
               e.released_at, e.changed_xid
        FROM helix_lock_history AS e
        WHERE e.ended_xid >= v_from
          AND (p_organization_id IS NULL OR e.organization_id = p_organization_id)
          AND (p_job_type IS NULL OR e.job_type = p_job_type)
        UNION ALL
        SELECT e.id, e.acquired_at, e.acquired_xid, e.lapses, e.lapse_xids, e.expires_at,
               e.expired_xid, e.renewed_at, e.renewed_xid, e.updated_at, e.updated_xid,
               e.released_at, e.changed_xid
        FROM helix_lock_history AS e
        WHERE e.ended_xid = ANY (v_in_progress)
          AND (p_organization_id IS NULL OR e.organization_id = p_organization_id)
          AND (p_job_type IS NULL OR e.job_type = p_job_type)
    ),
    events (at, id, rank, xid) AS (
        SELECT c.acquired_at, c.id, 0, c.acquired_xid FROM changed AS c
        UNION ALL
        SELECT lapse.at, c.id, 1, lapse.xid
        FROM changed AS c, unnest(c.lapses, c.lapse_xids) AS lapse (at, xid)
        UNION ALL
        SELECT c.expires_at, c.id, 1, c.expired_xid FROM changed AS c
        UNION ALL
        SELECT c.renewed_at, c.id, 2, c.renewed_xid FROM changed AS c
        UNION ALL
        SELECT c.updated_at, c.id, 3, c.updated_xid FROM changed AS c
        UNION ALL
        -- An end is a lock's last change: its transaction is the history row's changed_xid.
        SELECT c.released_at, c.id, 4, c.changed_xid FROM changed AS c WHERE c.released_at IS NOT NULL
    )
    SELECT e.at, e.id, e.rank FROM events AS e
    WHERE e.xid IS NOT NULL
      AND NOT pg_visible_in_snapshot(e.xid, p_after)
      AND pg_visible_in_snapshot(e.xid, p_until);
END $$;
COMMENT ON FUNCTION helix_window_events(pg_snapshot,pg_snapshot,text,text) IS 'GET /v1/events: the changes committed between two snapshots (time, lock id, kind), each in exactly one window of a stream: see migration 0019; read from the holds and the history (0023).';

CREATE OR REPLACE FUNCTION helix_prune_history(p_older_than interval, p_batch integer)
RETURNS integer
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
        SELECT e.id
        FROM helix_lock_history AS e
        WHERE e.released_at < v_cutoff
        ORDER BY e.released_at
        LIMIT p_batch
    )
    DELETE FROM helix_lock_history AS e USING doomed WHERE e.id = doomed.id;
    GET DIAGNOSTICS v_ended = ROW_COUNT;
    -- Locks nobody released or reclaimed, whose lease ended before the window. SKIP LOCKED
    -- leaves one that an acquire is reclaiming at this moment to that acquire; one deleted here
    -- is simply absent for the next acquire of its key.
    WITH doomed AS (
        SELECT h.organization_id, h.job_type, h.slot
        FROM helix_holds AS h
        WHERE h.expires_at < v_cutoff
        LIMIT p_batch
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM helix_holds AS h USING doomed
    WHERE (h.organization_id, h.job_type, h.slot) = (doomed.organization_id, doomed.job_type, doomed.slot);
    GET DIAGNOSTICS v_lapsed = ROW_COUNT;
    RETURN v_ended + v_lapsed;
END $$;
COMMENT ON FUNCTION helix_prune_history(interval, integer) IS 'Retention: deletes a batch of history rows that ended before the window, and a batch of live locks whose lease ended before it and that nobody ended (migrations 0007, 0023).';

REVOKE EXECUTE ON FUNCTION helix_job_locks_written(), helix_hold_changed(),
    helix_end_holds(bigint[], timestamptz, text, text, text, text),
    helix_raise_ended(bigint, text, text, boolean),
    helix_lock_for_holder(bigint, text, text, boolean),
    helix_raise_held(helix_holds[], timestamptz, integer)
FROM PUBLIC;
