-- Waiting without polling: every end of a lock (release, forced release, reclaim) is announced
-- on the channel helix_lock_released with "organization_id/job_type" as payload ('/' cannot
-- appear in either), so that requests waiting for that key in any service process wake at once.
CREATE FUNCTION helix_lock_released() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('helix_lock_released', NEW.organization_id || '/' || NEW.job_type);
    RETURN NULL;
END $$;

CREATE TRIGGER helix_lock_released
    AFTER UPDATE OF released_at ON helix_job_locks
    FOR EACH ROW
    WHEN (OLD.released_at IS NULL AND NEW.released_at IS NOT NULL)
    EXECUTE FUNCTION helix_lock_released();
