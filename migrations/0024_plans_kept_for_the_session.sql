-- The lock calls keep one plan of each statement for the session (issue 37).
--
-- PL/pgSQL prepares each statement of a function once per session, and its plan cache then picks,
-- at every execution, between a generic plan, made once, and a custom plan, made anew for the
-- values at hand: after five custom plans it keeps the generic one only if its estimated cost is
-- no higher than theirs. For several statements of a cycle it is higher, for values the planner
-- cannot tell apart, so they were planned at every call. The end of a lock above all: its one
-- statement, a DELETE from helix_holds feeding an INSERT into helix_lock_history, spent about half
-- of its time in the planner, and for an organization that the statistics think small, a custom
-- plan could even read the organization's range of the primary key instead of the hold's id.
--
-- Every statement these functions run looks rows up by a key: the lock's id, or its organization
-- and job type (the plans are checked in both modes: tests/api/test_listing_plans.py). So the
-- calls of a lock, and whatever they run (helix_end_holds, the triggers), take the generic plan.
-- Measured with bench.ceiling on PostgreSQL 15, 2 cores: see docs/data-model.md.
--
-- Left as they were: the quota (its counts of an organization's live locks are judged per
-- organization), and the event window, which plans for its values alone (0019).
ALTER FUNCTION helix_end_holds(bigint[], timestamptz, text, text, text, text)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION helix_acquire_job_lock(text, text, text, bigint, jsonb, text, integer)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION helix_release_job_lock(bigint, text, text)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION helix_release_unclaimed(bigint, text, text)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION helix_force_release_job_lock(bigint, text)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION helix_renew_job_lock(bigint, text, bigint, text)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION helix_update_job_lock(bigint, text, jsonb, text)
    SET plan_cache_mode = force_generic_plan;
