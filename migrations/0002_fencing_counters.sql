-- Fencing tokens: one row per (organization, job type) carries the last token handed out. The
-- counter lives apart from the lock rows so that pruning history can never make a token come
-- round again, and its row lock is what serialises concurrent grants for one key, so tokens
-- increase in the order the grants commit.
CREATE TABLE helix_lock_keys (
    organization_id    text   NOT NULL,
    job_type           text   NOT NULL,
    last_fencing_token bigint NOT NULL,
    PRIMARY KEY (organization_id, job_type)
);

ALTER TABLE helix_job_locks ADD COLUMN fencing_token bigint;

-- Grants made under 0001 get tokens in the order they were made.
UPDATE helix_job_locks AS l
SET fencing_token = numbered.n
FROM (
    SELECT id, row_number() OVER (PARTITION BY organization_id, job_type ORDER BY id) AS n
    FROM helix_job_locks
) AS numbered
WHERE l.id = numbered.id;

INSERT INTO helix_lock_keys (organization_id, job_type, last_fencing_token)
SELECT organization_id, job_type, max(fencing_token)
FROM helix_job_locks
GROUP BY organization_id, job_type;

ALTER TABLE helix_job_locks ALTER COLUMN fencing_token SET NOT NULL;

-- History pages ("released", "reclaimed") are read newest first.
CREATE INDEX helix_job_locks_history
    ON helix_job_locks (released_at DESC, id DESC)
    WHERE released_at IS NOT NULL;
