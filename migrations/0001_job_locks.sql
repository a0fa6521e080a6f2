-- The original, insert-based design: every grant is one row, and the partial unique index makes
-- two live locks for one (organization, job type) impossible whatever the code above it does.
-- Acquire was a plain INSERT, so a worker that crashed while holding a lock blocked its job until
-- someone deleted the row by hand; 0003 fixes that.
CREATE TABLE helix_job_locks (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    organization_id text        NOT NULL,
    job_type        text        NOT NULL,
    holder          text        NOT NULL,
    token           text        NOT NULL,
    metadata        jsonb,
    acquired_at     timestamptz NOT NULL,
    expires_at      timestamptz NOT NULL,
    released_at     timestamptz,
    release_reason  text,
    CONSTRAINT helix_job_locks_release_reason
        CHECK (release_reason IN ('released', 'reclaimed', 'forced')),
    CONSTRAINT helix_job_locks_released_with_reason
        CHECK ((released_at IS NULL) = (release_reason IS NULL)),
    CONSTRAINT helix_job_locks_expires_after_acquired
        CHECK (expires_at > acquired_at)
);

CREATE UNIQUE INDEX helix_job_locks_one_live
    ON helix_job_locks (organization_id, job_type)
    WHERE released_at IS NULL;
