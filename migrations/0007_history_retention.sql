-- History retention: every grant is a row, so ended rows are pruned after a while. One batch per
-- call, oldest first, rows locked by someone else skipped; the transaction-scoped advisory lock
-- lets one replica prune at a time. Fencing counters live in helix_lock_keys and are untouched.
CREATE FUNCTION helix_prune_history(p_older_than interval, p_batch integer) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    -- A value, not clock_timestamp() in the WHERE clause: a volatile expression cannot bound the
    -- index scan, and a batch that finds nothing old would read the whole retained history.
    v_cutoff timestamptz := clock_timestamp() - p_older_than;
    v_deleted integer;
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
    GET DIAGNOSTICS v_deleted = ROW_COUNT;
    RETURN v_deleted;
END $$;
