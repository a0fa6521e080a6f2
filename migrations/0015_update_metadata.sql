-- PATCH /v1/locks/{id}: a holder replaces its lock's metadata (progress, a leader's address).
-- The same holder check as renew (helix_lock_for_holder: HL001 no such lock in the caller's
-- organization, HL002 wrong token, HL003 ended), and like renew it works on a lapsed lease that
-- nobody reclaimed; the lease itself is not changed. It locks the row FOR NO KEY UPDATE, as renew
-- does: a competing acquire (which reads the live row FOR UPDATE), renew or release waits for it,
-- and that is what orders an update against a reclaim.
CREATE FUNCTION helix_update_job_lock(
    p_lock_id bigint, p_token text, p_metadata jsonb, p_organization_id text
)
RETURNS SETOF helix_job_lock_views
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    PERFORM helix_lock_for_holder(p_lock_id, p_token, p_organization_id, true);
    UPDATE helix_job_locks SET metadata = p_metadata WHERE id = p_lock_id;
    RETURN QUERY SELECT * FROM helix_job_lock_views AS v WHERE v.id = p_lock_id;
END $$;

REVOKE EXECUTE ON FUNCTION helix_update_job_lock(bigint, text, jsonb, text) FROM PUBLIC;
