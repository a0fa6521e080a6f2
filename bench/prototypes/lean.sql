-- The lean data model's hot path: a prototype to measure its WAL per cycle and renewal by
-- (bench/prototypes/lean.sh), not the service's schema. Two tables: lean_slots, a row per live
-- (pair, slot) updated in place (the fencing counter in it); lean_history, one insert per ended
-- lock; no event, quota, idempotency or semaphore logic yet.
CREATE TABLE lean_slots (
    organization_id text NOT NULL,
    job_type text NOT NULL,
    slot integer NOT NULL,
    lock_id bigint,             -- NULL: free
    holder text,
    token text,
    fencing_token bigint NOT NULL DEFAULT 0,
    acquired_at timestamptz,
    expires_at timestamptz,
    changed_xid xid8,
    metadata jsonb,
    max_holders integer NOT NULL DEFAULT 1,
    PRIMARY KEY (organization_id, job_type, slot)
) WITH (fillfactor = 70);
CREATE TABLE lean_history (
    id bigint NOT NULL,
    organization_id text NOT NULL,
    job_type text NOT NULL,
    slot integer NOT NULL,
    holder text NOT NULL,
    fencing_token bigint NOT NULL,
    acquired_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    released_at timestamptz NOT NULL,
    release_reason text NOT NULL,
    ended_xid bigint NOT NULL DEFAULT pg_current_xact_id()::text::bigint,
    metadata jsonb
);
CREATE INDEX lean_history_by_job_type ON lean_history (organization_id, job_type, released_at DESC, id DESC);
CREATE INDEX lean_history_by_organization ON lean_history (organization_id, released_at DESC, id DESC);
CREATE INDEX lean_history_ended ON lean_history USING brin (ended_xid, released_at);
CREATE UNIQUE INDEX lean_history_id ON lean_history (id);
CREATE SEQUENCE lean_ids START 10000000;

CREATE OR REPLACE FUNCTION lean_acquire(p_org text, p_job text, p_holder text, p_ttl_ms bigint)
RETURNS TABLE (id bigint, fencing_token bigint, token text) LANGUAGE plpgsql AS $$
DECLARE v_now timestamptz; v_row lean_slots;
BEGIN
    INSERT INTO lean_slots (organization_id, job_type, slot) VALUES (p_org, p_job, 0)
    ON CONFLICT DO NOTHING;
    SELECT * INTO v_row FROM lean_slots s WHERE s.organization_id = p_org AND s.job_type = p_job AND s.slot = 0 FOR UPDATE;
    v_now := clock_timestamp();
    IF v_row.lock_id IS NOT NULL AND v_row.expires_at > v_now THEN
        RAISE EXCEPTION 'held' USING ERRCODE = 'unique_violation';
    END IF;
    IF v_row.lock_id IS NOT NULL THEN  -- reclaim
        INSERT INTO lean_history (id, organization_id, job_type, slot, holder, fencing_token, acquired_at, expires_at, released_at, release_reason, metadata) VALUES (v_row.lock_id, p_org, p_job, 0, v_row.holder, v_row.fencing_token,
            v_row.acquired_at, v_row.expires_at, v_now, 'reclaimed', v_row.metadata);
    END IF;
    RETURN QUERY UPDATE lean_slots s SET lock_id = nextval('lean_ids'), holder = p_holder, token = md5(random()::text),
        fencing_token = s.fencing_token + 1, acquired_at = v_now, expires_at = v_now + p_ttl_ms * interval '1 ms',
        changed_xid = pg_current_xact_id(), metadata = NULL
    WHERE s.organization_id = p_org AND s.job_type = p_job AND s.slot = 0
    RETURNING s.lock_id, s.fencing_token, s.token;
END $$;

CREATE OR REPLACE FUNCTION lean_release(p_id bigint, p_org text, p_job text) RETURNS void LANGUAGE plpgsql AS $$
DECLARE v_row lean_slots; v_now timestamptz := clock_timestamp();
BEGIN
    UPDATE lean_slots s SET lock_id = NULL, changed_xid = pg_current_xact_id()
    FROM (SELECT * FROM lean_slots WHERE organization_id = p_org AND job_type = p_job AND slot = 0 FOR UPDATE) AS o
    WHERE s.organization_id = p_org AND s.job_type = p_job AND s.slot = 0 AND o.lock_id = p_id
    RETURNING o.* INTO v_row;
    INSERT INTO lean_history (id, organization_id, job_type, slot, holder, fencing_token, acquired_at, expires_at, released_at, release_reason, metadata) VALUES (v_row.lock_id, p_org, p_job, 0, v_row.holder, v_row.fencing_token,
        v_row.acquired_at, v_row.expires_at, v_now, 'released', v_row.metadata);
END $$;

CREATE OR REPLACE FUNCTION lean_renew(p_org text, p_job text, p_ttl_ms bigint) RETURNS void LANGUAGE sql AS $$
    UPDATE lean_slots s SET expires_at = clock_timestamp() + p_ttl_ms * interval '1 ms', changed_xid = pg_current_xact_id()
    WHERE s.organization_id = p_org AND s.job_type = p_job AND s.slot = 0;
$$;
