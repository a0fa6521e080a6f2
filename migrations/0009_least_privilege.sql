-- Least privilege: the role that serves needs no rights on the tables but SELECT. Every function
-- the service (or a storage layer) calls runs with its owner's rights (SECURITY DEFINER), the
-- owner being the role that migrates, and with the search_path it was migrated with, which the
-- migration runner pins to the schema it migrates into followed by pg_temp: nothing that a
-- caller puts on its own search_path can stand in for a table or function of ours.
--
-- Since they act with the owner's rights, only those it grants EXECUTE to may call them: not
-- PUBLIC, which PostgreSQL grants a new function to by default. The README lists the grants a
-- serving role needs. Every later migration that adds a function does the same (a test checks).
--
-- The two statements the service still sent as plain writes become functions too.

-- The end of a wait (service/locks.py): its registration is deleted.
CREATE FUNCTION helix_stop_waiting(p_id bigint) RETURNS bigint
LANGUAGE sql VOLATILE AS $$
    DELETE FROM helix_lock_waiters WHERE id = p_id RETURNING id
$$;

-- Last use of API keys, recorded in batches (service/keys.py).
CREATE FUNCTION helix_touch_api_keys(p_ids text[]) RETURNS integer
LANGUAGE sql VOLATILE AS $$
    WITH touched AS (
        UPDATE helix_api_keys SET last_used_at = clock_timestamp() WHERE id = ANY(p_ids) RETURNING id
    )
    SELECT count(*)::integer FROM touched
$$;

ALTER FUNCTION helix_acquire_job_lock(text, text, text, bigint, jsonb, text)
    SECURITY DEFINER SET search_path FROM CURRENT;
ALTER FUNCTION helix_acquire_job_lock(text, text, text, bigint, jsonb)
    SECURITY DEFINER SET search_path FROM CURRENT;
ALTER FUNCTION helix_release_job_lock(bigint, text, text)
    SECURITY DEFINER SET search_path FROM CURRENT;
ALTER FUNCTION helix_release_job_lock(bigint, text)
    SECURITY DEFINER SET search_path FROM CURRENT;
ALTER FUNCTION helix_renew_job_lock(bigint, text, bigint, text)
    SECURITY DEFINER SET search_path FROM CURRENT;
ALTER FUNCTION helix_renew_job_lock(bigint, text, bigint)
    SECURITY DEFINER SET search_path FROM CURRENT;
ALTER FUNCTION helix_force_release_job_lock(bigint, text)
    SECURITY DEFINER SET search_path FROM CURRENT;
ALTER FUNCTION helix_fencing_token_is_current(text, text, bigint)
    SECURITY DEFINER SET search_path FROM CURRENT;
ALTER FUNCTION helix_wait_for_release(text, text, double precision)
    SECURITY DEFINER SET search_path FROM CURRENT;
ALTER FUNCTION helix_prune_history(interval, integer)
    SECURITY DEFINER SET search_path FROM CURRENT;
ALTER FUNCTION helix_stop_waiting(bigint)
    SECURITY DEFINER SET search_path FROM CURRENT;
ALTER FUNCTION helix_touch_api_keys(text[])
    SECURITY DEFINER SET search_path FROM CURRENT;

-- The helpers they call (helix_lease, helix_lock_for_holder, helix_raise_if_ended) and the
-- triggers keep the caller's rights and search_path: inside the functions above, those are the
-- owner's and the pinned one. Called directly, they can do nothing the caller could not.

REVOKE EXECUTE ON FUNCTION
    helix_acquire_job_lock(text, text, text, bigint, jsonb, text),
    helix_acquire_job_lock(text, text, text, bigint, jsonb),
    helix_release_job_lock(bigint, text, text),
    helix_release_job_lock(bigint, text),
    helix_renew_job_lock(bigint, text, bigint, text),
    helix_renew_job_lock(bigint, text, bigint),
    helix_force_release_job_lock(bigint, text),
    helix_fencing_token_is_current(text, text, bigint),
    helix_wait_for_release(text, text, double precision),
    helix_prune_history(interval, integer),
    helix_stop_waiting(bigint),
    helix_touch_api_keys(text[])
FROM PUBLIC;
