-- Announce the end of a lock only while someone waits for its key. A NOTIFY takes a lock that
-- every notifying transaction in the cluster queues for until it has committed, so announcing
-- every release serialised all releases behind each other's commits: at 32 clients, pgbench ran
-- half as many cycles of acquire + release as without it.
--
-- A waiting acquire registers its key here, and that row is committed, before its next attempt.
-- The trigger below looks for a registration after the release has changed the lock row, with a
-- fresh snapshot (under READ COMMITTED, which the service sets on its connections). Either the
-- waiter's attempt saw the release (it waited for the releasing transaction's row lock, or came
-- after its commit), or the release changed the row after that attempt, hence after the
-- registration, and the trigger sees the registration: no wakeup is lost.
--
-- A registration is deleted when its wait ends. One whose delete never ran (its process died,
-- or the database was away) stops counting at `until`, and a later registration deletes it.
--
-- Replicas still running the code before this migration do not register: while they run on,
-- their waiters wake only when the holder's lease runs out (or their wait ends). The README's
-- upgrade note says to stop them before this migration is applied.
CREATE TABLE helix_lock_waiters (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    organization_id text        NOT NULL,
    job_type        text        NOT NULL,
    until           timestamptz NOT NULL
);

CREATE INDEX helix_lock_waiters_key ON helix_lock_waiters (organization_id, job_type);
CREATE INDEX helix_lock_waiters_until ON helix_lock_waiters (until);

-- Register a wait of up to p_seconds for the key; returns the id to end it with.
CREATE FUNCTION helix_wait_for_release(p_organization_id text, p_job_type text, p_seconds double precision)
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_id bigint;
BEGIN
    DELETE FROM helix_lock_waiters
    WHERE id IN (
        SELECT w.id FROM helix_lock_waiters AS w
        WHERE w.until < clock_timestamp()
        FOR UPDATE SKIP LOCKED  -- registrations never wait for each other
    );
    INSERT INTO helix_lock_waiters (organization_id, job_type, until)
    VALUES (p_organization_id, p_job_type, clock_timestamp() + make_interval(secs => p_seconds))
    RETURNING id INTO v_id;
    RETURN v_id;
END $$;

CREATE OR REPLACE FUNCTION helix_lock_released() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (
        SELECT 1 FROM helix_lock_waiters AS w
        WHERE w.organization_id = NEW.organization_id
          AND w.job_type = NEW.job_type
          AND w.until > clock_timestamp()
    ) THEN
        PERFORM pg_notify('helix_lock_released', NEW.organization_id || '/' || NEW.job_type);
    END IF;
    RETURN NULL;
END $$;
