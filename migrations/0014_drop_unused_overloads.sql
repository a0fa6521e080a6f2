-- The acquire of before idempotency keys (0003, 0005), and the release and renew of before API
-- keys (0003), which took no organization, kept as overloads when later migrations added the
-- current ones, and the holder check they went through. Neither this build nor the previous
-- release sends them (both call helix_acquire_job_lock with six arguments,
-- helix_release_job_lock(bigint, text, text) and helix_renew_job_lock(bigint, text, bigint,
-- text)), and no remaining function calls them. A signature goes only once no build of the previous release calls it (docs/deployment.md).
-- Their EXECUTE grants (0009) go with them.

DROP FUNCTION helix_acquire_job_lock(text, text, text, bigint, jsonb);
DROP FUNCTION helix_release_job_lock(bigint, text);
DROP FUNCTION helix_renew_job_lock(bigint, text, bigint);
DROP FUNCTION helix_lock_for_holder(bigint, text);
