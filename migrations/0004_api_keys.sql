-- API keys and tenancy. A key belongs to one organization, or to none (an admin key). Only a
-- SHA-256 of the key is stored. Every change that matters (not last_used_at) is announced on the
-- channel helix_api_keys, so each service process drops a revoked key from its cache at once.
CREATE TABLE helix_api_keys (
    id              text        PRIMARY KEY,
    organization_id text,
    key_hash        bytea       NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    last_used_at    timestamptz,
    revoked_at      timestamptz
);

CREATE FUNCTION helix_api_keys_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('helix_api_keys', '');
    RETURN NULL;
END $$;

CREATE TRIGGER helix_api_keys_changed
    AFTER INSERT OR UPDATE OF organization_id, key_hash, revoked_at OR DELETE OR TRUNCATE
    ON helix_api_keys
    FOR EACH STATEMENT EXECUTE FUNCTION helix_api_keys_changed();

-- Which admin key broke a lock by force.
ALTER TABLE helix_job_locks ADD COLUMN forced_by text;

-- The lock row a token holder may change, seen from a caller scoped to p_organization_id (NULL:
-- every organization); another organization's lock is "no such lock" (HL001).
CREATE FUNCTION helix_lock_for_holder(p_lock_id bigint, p_token text, p_organization_id text)
RETURNS helix_job_locks
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_lock helix_job_locks%ROWTYPE;
BEGIN
    SELECT * INTO v_lock FROM helix_job_locks AS l
    WHERE l.id = p_lock_id
      AND (p_organization_id IS NULL OR l.organization_id = p_organization_id)
    FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no lock %', p_lock_id USING ERRCODE = 'HL001';
    END IF;
    IF v_lock.token IS DISTINCT FROM p_token THEN
        RAISE EXCEPTION 'token does not match lock %', p_lock_id USING ERRCODE = 'HL002';
    END IF;
    PERFORM helix_raise_if_ended(v_lock);
    RETURN v_lock;
END $$;

-- HL003, saying how and when, if the lock has ended.
CREATE FUNCTION helix_raise_if_ended(p_lock helix_job_locks) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF p_lock.released_at IS NOT NULL THEN
        RAISE EXCEPTION 'lock % has ended', p_lock.id
            USING ERRCODE = 'HL003',
                  DETAIL = json_build_object(
                      'lock_id', p_lock.id,
                      'release_reason', p_lock.release_reason,
                      'released_at', p_lock.released_at,
                      'forced_by', p_lock.forced_by
                  )::text;
    END IF;
END $$;

-- The two-argument forms of 0003 stay, for replicas still running the code before this
-- migration; they act for a caller scoped to every organization.
CREATE OR REPLACE FUNCTION helix_lock_for_holder(p_lock_id bigint, p_token text)
RETURNS helix_job_locks
LANGUAGE sql VOLATILE AS $$
    SELECT helix_lock_for_holder(p_lock_id, p_token, NULL)
$$;

CREATE FUNCTION helix_release_job_lock(p_lock_id bigint, p_token text, p_organization_id text)
RETURNS SETOF helix_job_lock_views
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM helix_lock_for_holder(p_lock_id, p_token, p_organization_id);
    UPDATE helix_job_locks AS l
    SET released_at = clock_timestamp(), release_reason = 'released'
    WHERE l.id = p_lock_id;
    RETURN QUERY SELECT * FROM helix_job_lock_views AS v WHERE v.id = p_lock_id;
END $$;

CREATE FUNCTION helix_renew_job_lock(
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
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    v_lease interval := helix_lease(p_ttl_ms);
    v_lock helix_job_locks%ROWTYPE := helix_lock_for_holder(p_lock_id, p_token, p_organization_id);
    v_now timestamptz := clock_timestamp();
BEGIN
    -- A lapsed lease nobody reclaimed may be renewed: no one else can have held the lock.
    UPDATE helix_job_locks SET expires_at = v_now + v_lease WHERE id = p_lock_id;
    RETURN QUERY
        SELECT v.*, v_lock.expires_at <= v_now
        FROM helix_job_lock_views AS v
        WHERE v.id = p_lock_id;
END $$;

-- An administrator breaks a lock without its token; recorded as 'forced', with the key's id.
CREATE FUNCTION helix_force_release_job_lock(p_lock_id bigint, p_key_id text)
RETURNS SETOF helix_job_lock_views
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_lock helix_job_locks%ROWTYPE;
BEGIN
    SELECT * INTO v_lock FROM helix_job_locks AS l WHERE l.id = p_lock_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no lock %', p_lock_id USING ERRCODE = 'HL001';
    END IF;
    PERFORM helix_raise_if_ended(v_lock);
    UPDATE helix_job_locks AS l
    SET released_at = clock_timestamp(), release_reason = 'forced', forced_by = p_key_id
    WHERE l.id = p_lock_id;
    RETURN QUERY SELECT * FROM helix_job_lock_views AS v WHERE v.id = p_lock_id;
END $$;
