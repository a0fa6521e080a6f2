-- History listings within one organization (issue 16, item 5). An organization's listing used to
-- read every organization's history (a sequential scan, or the index of 0002 in order) and filter
-- it: one that matched nothing read all of it, so one key listing `?state=reclaimed&job_type=nope`
-- slowed every organization down, and more so in parallel. Here every history listing of one
-- organization (service/queries.py, LIST_HISTORY*) becomes a range of one index that holds that
-- organization's rows of one state, newest first, from the cursor on: it reads the rows it
-- returns and stops at LIMIT, whatever other organizations and states hold.
--
-- The state column is `release_reason IS DISTINCT FROM 'reclaimed'`: true for 'released' (a
-- release, or one by force), false for 'reclaimed', so each state is one range ordered by
-- (released_at, id). Its form matters to the planner: a listing of reclaimed locks compares it
-- with false, which PostgreSQL rewrites as NOT (...); NOT (a = b) would become a <> b, which no
-- longer matches the index, while NOT (a IS DISTINCT FROM b) stays as it is. And it is estimated
-- from release_reason's statistics; a CASE expression would get a fixed guess (a partial index's
-- expressions get no statistics, and CREATE STATISTICS on an expression needs PostgreSQL 14),
-- and on that guess the planner read every row of the organization's state and sorted them.
--
-- Both are partial, like the index of 0002: an acquire adds nothing to them. Every end of a lock
-- (release, release by force, reclaim) adds an entry to each; that update is not HOT anyway,
-- since it changes released_at, which the index of 0002 holds. The index of 0002 stays: retention
-- deletes oldest first through it, and an admin's listing across organizations reads it.
--
-- Plain CREATE INDEX, since migrations run in a transaction (CONCURRENTLY cannot): each build
-- blocks writes to helix_job_locks (every acquire, renewal and release waits; reads do not) until
-- the migration commits, about 1 to 1.5 s per million history rows each on PostgreSQL 15 here.
-- For a big history, build both beforehand with CREATE INDEX CONCURRENTLY, exactly as below:
-- IF NOT EXISTS then leaves them be (it compares names only, not definitions).

-- An organization's listing of one state, any job type.
CREATE INDEX IF NOT EXISTS helix_job_locks_history_by_organization
    ON helix_job_locks (
        organization_id, (release_reason IS DISTINCT FROM 'reclaimed'), released_at DESC, id DESC
    )
    WHERE released_at IS NOT NULL;

-- An organization's listing of one state and one job type. The index above would find the job
-- type's rows only by reading all of the state's rows, newest first, until LIMIT of them match:
-- for a job type with no history, all of them.
CREATE INDEX IF NOT EXISTS helix_job_locks_history_by_job_type
    ON helix_job_locks (
        organization_id, job_type, (release_reason IS DISTINCT FROM 'reclaimed'), released_at DESC,
        id DESC
    )
    WHERE released_at IS NOT NULL;
