-- Bounds on what a small request can make the service store and answer (issue 34, items 7 and
-- 11). Every signature stays, so replicas of the previous build call these functions unchanged
-- during a rolling upgrade.
--
-- 1. Metadata is at most 8 KiB (8192 bytes) as stored: as jsonb::text writes it, whatever its
--    size as sent. jsonb keeps a number as numeric and writes it back in full, so
--    {"a": [1e308, ... 1160 times]} is 8,127 bytes as sent and 360,767 as stored, and every
--    answer that carries the lock (the grant, GET, a listing, events) carried all of it: a page of
--    150 such locks was 54 MB. The service refuses such metadata at the edge (schemas.py predicts
--    the stored size), and the database refuses to store it whoever writes it:
--    helix_metadata_bounded, a trigger on helix_job_locks, raises 22023 (invalid_parameter_value)
--    with COLUMN metadata, which the service answers 422 naming metadata (db.py), like a ttl out of
--    range. It fires on every INSERT, and on an UPDATE only when the statement sets metadata: the
--    acquires (plain, within the quota, each attempt of a waiting one) and PATCH, and any function
--    a later migration adds that writes metadata.
--    Why a trigger rather than a CHECK constraint: a CHECK is tested on every UPDATE of a row, so
--    each renewal, release and claim would pay for writing the metadata out, and a row stored
--    before this migration (NOT VALID would leave it) over the bound could then no longer be
--    renewed, released, forced or reclaimed by the next acquire: its key would be stuck until
--    retention took it. Its error also carries the failing row, lock token included, into the
--    server's log. The trigger tests only what is being written, and says only the size.
--    Why not a check in each function: the table is where every writer meets, those of later
--    migrations included.
--    Rows stored before this migration are left as they were; they end and are pruned as ever.
--
-- 2. A full pair's refusal (23505, DETAIL) lists at most 20 holders, those whose leases run out
--    first (then by slot), and counts them all in holders_total: the holders of a semaphore of
--    1,000 slots made a 409 of about 1 MB for an acquire of about a hundred bytes. lock_id,
--    holder and expires_at still name the first to run out, which Retry-After counts down to. A
--    replica of the previous build reads holders as before (now at most 20 of them); its waiters
--    on a semaphore of more than 20 slots, should its release listener reconnect, miss a slot's
--    end that came while it was away and wake at their timer instead, until it is replaced.

CREATE FUNCTION helix_metadata_bounded() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_bytes integer := octet_length(NEW.metadata::text);
BEGIN
    IF v_bytes > 8192 THEN
        RAISE EXCEPTION 'metadata must be at most 8192 bytes as stored, is %', v_bytes
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'metadata';
    END IF;
    RETURN NEW;
END $$;

COMMENT ON FUNCTION helix_metadata_bounded() IS
    'Refuses metadata over 8192 bytes as stored (jsonb::text: numbers in full, 1e308 as 309 digits),'
    ' with 22023 naming the column metadata: what is stored is what every answer carries back.'
    ' Migration 0021.';

CREATE TRIGGER helix_metadata_bounded
    BEFORE INSERT OR UPDATE OF metadata ON helix_job_locks
    FOR EACH ROW WHEN (NEW.metadata IS NOT NULL)
    EXECUTE FUNCTION helix_metadata_bounded();

COMMENT ON TRIGGER helix_metadata_bounded ON helix_job_locks IS
    'Bounds metadata whoever writes it, testing only the rows whose metadata a statement writes:'
    ' renewals and releases do not pay for it, and a row stored over the bound before migration'
    ' 0021 still renews, ends and is reclaimed, all of which a CHECK constraint would refuse.';
