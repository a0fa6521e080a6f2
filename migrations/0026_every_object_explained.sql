-- Every table, column and function says what it is (issue 37, "readable where it runs").
--
-- migrations/schema.sql is the schema in one file, generated from the catalog, so the only
-- explanation it can carry is the catalog's own: COMMENT ON. Until now the reasoning lived in the
-- migrations' headers, and the tables of the key, the waiters, the quota and the migrations, most
-- columns and seventeen functions said nothing. tests/sql/test_migrate.py now fails for a table,
-- a column of a table or a function of the schema without a comment.

-- Tables and their columns.
COMMENT ON TABLE helix_api_keys IS 'API keys (hlk_<id>_<secret>): an organization''s, or an admin''s when organization_id is NULL. Only a digest of each key is stored (migration 0004).';
COMMENT ON COLUMN helix_api_keys.id IS 'The key''s public id, 12 hex digits, also in the key itself: listed, and named to revoke it.';
COMMENT ON COLUMN helix_api_keys.organization_id IS 'The organization whose locks the key reaches; NULL: an admin key, which reaches every organization''s.';
COMMENT ON COLUMN helix_api_keys.key_hash IS 'SHA-256 of the whole key. The key itself is shown once, when it is made, and stored nowhere.';
COMMENT ON COLUMN helix_api_keys.created_at IS 'When the key was made.';
COMMENT ON COLUMN helix_api_keys.last_used_at IS 'When the key was last used, as each process writes it in a batch every 10 s (helix_touch_api_keys): up to that much late.';
COMMENT ON COLUMN helix_api_keys.revoked_at IS 'When the key was revoked; NULL while it works. A revoked key is refused by every replica once its key cache hears of the change (helix_api_keys_changed).';

COMMENT ON COLUMN helix_event_id_key.one IS 'Always true: the table holds one row.';
COMMENT ON COLUMN helix_event_id_key.key IS 'The HMAC key: 32 random bytes, made by migration 0019.';

COMMENT ON COLUMN helix_expiry_sweep.one IS 'Always true: the table holds one row.';
COMMENT ON COLUMN helix_expiry_sweep.swept_at IS 'When the last sweep for due expiries began; -infinity: never, or the last one found more than it announced, so the next poll sweeps again.';

COMMENT ON COLUMN helix_holds.organization_id IS 'The organization the lock belongs to.';
COMMENT ON COLUMN helix_holds.job_type IS 'The job type: with the organization, the pair whose holders the lock limits.';
COMMENT ON COLUMN helix_holds.slot IS 'Which of the pair''s max_holders places the lock takes, from 0: the primary key (organization_id, job_type, slot) makes a second live lock in one place impossible.';
COMMENT ON COLUMN helix_holds.max_holders IS 'How many may hold the pair at once (1: a mutex; more: a semaphore), as the grant asked. The live locks of a pair that are held share one value.';
COMMENT ON COLUMN helix_holds.id IS 'The lock''s id, from helix_lock_ids; it keeps it in helix_lock_history after its end.';
COMMENT ON COLUMN helix_holds.holder IS 'Who holds it, as the holder named itself: shown, never trusted (the token proves the holder).';
COMMENT ON COLUMN helix_holds.token IS 'The holder''s secret (helix_new_token), which release, renewal and update must give; compared by digest (helix_digest).';
COMMENT ON COLUMN helix_holds.metadata IS 'The holder''s JSON, at most 8192 bytes as stored (helix_metadata_bounded).';
COMMENT ON COLUMN helix_holds.fencing_token IS 'The pair''s counter (helix_lock_keys) at the grant: larger for every later grant of the pair, in commit order, never reused.';
COMMENT ON COLUMN helix_holds.acquired_at IS 'The grant, by the database clock read after every wait of the acquire.';
COMMENT ON COLUMN helix_holds.expires_at IS 'When the current lease runs out; from then on a grant may reclaim the lock.';
COMMENT ON COLUMN helix_holds.idempotency_key IS 'The Idempotency-Key the grant came with: a repeat with the same key and holder gets this lock back while it is live.';
COMMENT ON COLUMN helix_holds.reclaimed_lock_id IS 'The lock whose run-out lease this grant reclaimed, if it reclaimed one (with its holder and expiry beside it): the answer and the events name it.';
COMMENT ON COLUMN helix_holds.reclaimed_holder IS 'The holder of reclaimed_lock_id.';
COMMENT ON COLUMN helix_holds.reclaimed_expired_at IS 'When the lease of reclaimed_lock_id ran out.';
COMMENT ON COLUMN helix_holds.replayed IS 'An idempotent repeat has answered with this lock (helix_claim_replay): a waiting acquire whose client left then does not release it (helix_release_unclaimed).';
COMMENT ON COLUMN helix_holds.acquired_xid IS 'The grant''s transaction (GET /v1/events).';
COMMENT ON COLUMN helix_holds.renewed_xid IS 'The latest renewal''s transaction (GET /v1/events); NULL: never renewed.';
COMMENT ON COLUMN helix_holds.renewed_at IS 'The latest renewal, by the clock its lease counts from.';
COMMENT ON COLUMN helix_holds.updated_xid IS 'The latest update of metadata''s transaction (GET /v1/events); NULL: never updated.';
COMMENT ON COLUMN helix_holds.updated_at IS 'The latest update of metadata.';
COMMENT ON COLUMN helix_holds.lapses IS 'When each earlier lease of the lock ran out before a renewal took it up again, nobody having reclaimed it: the lock''s gaps, oldest first.';

COMMENT ON COLUMN helix_lock_history.id IS 'The lock''s id, as it was while live (helix_holds.id).';
COMMENT ON COLUMN helix_lock_history.organization_id IS 'As in helix_holds, copied at the end.';
COMMENT ON COLUMN helix_lock_history.job_type IS 'As in helix_holds, copied at the end.';
COMMENT ON COLUMN helix_lock_history.slot IS 'As in helix_holds, copied at the end.';
COMMENT ON COLUMN helix_lock_history.max_holders IS 'As in helix_holds, copied at the end.';
COMMENT ON COLUMN helix_lock_history.holder IS 'As in helix_holds, copied at the end.';
COMMENT ON COLUMN helix_lock_history.token IS 'As in helix_holds: a call with the lock''s own token is told that the lock ended (HL003), with another that the token is wrong (HL002).';
COMMENT ON COLUMN helix_lock_history.metadata IS 'As in helix_holds, copied at the end.';
COMMENT ON COLUMN helix_lock_history.fencing_token IS 'As in helix_holds, copied at the end. The pair''s counter stays in helix_lock_keys when retention deletes the row.';
COMMENT ON COLUMN helix_lock_history.acquired_at IS 'As in helix_holds, copied at the end.';
COMMENT ON COLUMN helix_lock_history.expires_at IS 'The last lease''s end, as it was when the lock ended.';
COMMENT ON COLUMN helix_lock_history.released_at IS 'When the lock ended, by the database clock: the release, the forced release, or the grant that reclaimed it.';
COMMENT ON COLUMN helix_lock_history.release_reason IS 'How it ended: released (by its holder), forced (by an admin key: forced_by), reclaimed (by a grant, its lease having run out).';
COMMENT ON COLUMN helix_lock_history.forced_by IS 'The id of the admin key that forced the release; NULL otherwise.';
COMMENT ON COLUMN helix_lock_history.idempotency_key IS 'As in helix_holds, copied at the end.';
COMMENT ON COLUMN helix_lock_history.reclaimed_lock_id IS 'As in helix_holds, copied at the end.';
COMMENT ON COLUMN helix_lock_history.reclaimed_holder IS 'As in helix_holds, copied at the end.';
COMMENT ON COLUMN helix_lock_history.reclaimed_expired_at IS 'As in helix_holds, copied at the end.';
COMMENT ON COLUMN helix_lock_history.replayed IS 'As in helix_holds, copied at the end.';
COMMENT ON COLUMN helix_lock_history.acquired_xid IS 'As in helix_holds, copied at the end.';
COMMENT ON COLUMN helix_lock_history.renewed_xid IS 'As in helix_holds, copied at the end.';
COMMENT ON COLUMN helix_lock_history.renewed_at IS 'As in helix_holds, copied at the end.';
COMMENT ON COLUMN helix_lock_history.updated_xid IS 'As in helix_holds, copied at the end.';
COMMENT ON COLUMN helix_lock_history.updated_at IS 'As in helix_holds, copied at the end.';
COMMENT ON COLUMN helix_lock_history.lapses IS 'As in helix_holds, copied at the end.';
COMMENT ON COLUMN helix_lock_history.expired_xid IS 'The transaction that announced the last lease''s expiry: as in helix_holds, or the end''s own when the lease had run out unannounced.';
COMMENT ON COLUMN helix_lock_history.lapse_xids IS 'As in helix_holds, copied at the end.';

COMMENT ON TABLE helix_lock_keys IS 'One row per pair ever granted, with its fencing counter. Never deleted, also after retention prunes the pair''s history, so that a fencing token is never handed out twice; the grant''s update of the row also serialises the pair''s grants until commit.';
COMMENT ON COLUMN helix_lock_keys.organization_id IS 'The pair''s organization.';
COMMENT ON COLUMN helix_lock_keys.job_type IS 'The pair''s job type.';
COMMENT ON COLUMN helix_lock_keys.last_fencing_token IS 'The fencing token of the pair''s latest grant.';

COMMENT ON TABLE helix_lock_waiters IS 'Acquires waiting for a pair (wait_seconds): an end or a shortened lease notifies helix_lock_released only while a registration for the pair is here (migration 0008).';
COMMENT ON COLUMN helix_lock_waiters.id IS 'The registration, which its waiter deletes when its wait ends (helix_stop_waiting).';
COMMENT ON COLUMN helix_lock_waiters.organization_id IS 'The organization of the pair waited for.';
COMMENT ON COLUMN helix_lock_waiters.job_type IS 'The job type of the pair waited for.';
COMMENT ON COLUMN helix_lock_waiters.until IS 'When the wait ends at the latest: a registration whose waiter died counts no longer, and the next registration deletes it.';

COMMENT ON TABLE helix_quota_shares IS 'Room under an organization''s live-lock quota handed to one process: it may grant that many without counting each, and every count holds the room of every share back (migration 0020).';
COMMENT ON COLUMN helix_quota_shares.organization_id IS 'The organization whose quota the share is of.';
COMMENT ON COLUMN helix_quota_shares.id IS 'The share, named by the acquires made on it; also the key of its advisory lock (helix_quota_share_class, helix_quota_share_key).';
COMMENT ON COLUMN helix_quota_shares.room IS 'How many live locks the process may add on the share.';
COMMENT ON COLUMN helix_quota_shares.until IS 'When the share ends: acquires on it are refused from then on (HL005), and a later count deletes it.';

COMMENT ON TABLE helix_schema_migrations IS 'The migrations applied, one row each (helix-locks migrate): a file is applied once, and a changed applied file stops the runner.';
COMMENT ON COLUMN helix_schema_migrations.name IS 'The migration''s file name, as migrations/NNNN_name.sql.';
COMMENT ON COLUMN helix_schema_migrations.checksum IS 'SHA-256 of the file as applied, in hex.';
COMMENT ON COLUMN helix_schema_migrations.applied_at IS 'When it was applied.';

-- Functions.
COMMENT ON FUNCTION helix_api_keys_changed() IS 'Trigger on helix_api_keys: a NOTIFY on helix_api_keys, upon which every process drops its cache of keys, so that a revocation holds at once.';
COMMENT ON FUNCTION helix_digest(text) IS 'SHA-256 of the text as UTF-8: tokens are compared by digest, so that a comparison''s time depends on nothing a guesser can steer (migration 0012).';
COMMENT ON FUNCTION helix_fencing_token_is_current(text,text,bigint) IS 'Whether a held lock of the pair (its lease not run out) has this fencing token. When it has, its row stays locked (KEY SHARE) to the end of the caller''s transaction: checked in the transaction that writes, no release or reclaim of the lock commits before that write does.';
COMMENT ON FUNCTION helix_force_release_job_lock(bigint,text) IS 'An admin''s release of a live lock, without its token: ends it as forced, with the admin key''s id in forced_by; HL001 or HL003 when there is no live lock of that id.';
COMMENT ON FUNCTION helix_lease(bigint) IS 'A ttl in milliseconds as an interval; 22023 (naming ttl_seconds) outside 1 s to 1 day.';
COMMENT ON FUNCTION helix_lock_released() IS 'Trigger on the end of a lock (a history row inserted) and on a shortened lease: a NOTIFY on helix_lock_released with organization/job_type, only while an acquire waits for that pair (helix_lock_waiters), since every NOTIFY queues its transaction behind the others'' commits (migration 0008).';
COMMENT ON FUNCTION helix_new_token() IS 'A new lock token: 32 hex digits, the random ones of two version-4 UUIDs (128 random bits).';
COMMENT ON FUNCTION helix_quota_lock_key(text) IS 'The key of an organization''s quota advisory lock, which counts and the exact way of the quota take exclusively.';
COMMENT ON FUNCTION helix_quota_share_class(bigint) IS 'The first key of a quota share''s advisory lock (with helix_quota_share_key): held shared by the acquires on the share, exclusively by whoever deletes it.';
COMMENT ON FUNCTION helix_quota_share_key(bigint) IS 'The second key of a quota share''s advisory lock (see helix_quota_share_class).';
COMMENT ON FUNCTION helix_release_job_lock(bigint,text,text) IS 'A holder''s release: ends the lock as released when the token is its (and it is of the organization, when one is given), in one statement; else HL001, HL002 or HL003. Returns the ended lock.';
COMMENT ON FUNCTION helix_release_unclaimed(bigint,text,text) IS 'Releases a grant whose waiting client left before the answer, unless an idempotent repeat has claimed it since (replayed): then it stays with the repeat''s caller. True when released.';
COMMENT ON FUNCTION helix_renew_job_lock(bigint,text,bigint,text) IS 'A holder''s renewal: a new lease of p_ttl_ms from the database clock, a HOT update of the hold. Also renews a lease that ran out if nobody reclaimed it, and says so (lapsed). HL001, HL002 or HL003 otherwise.';
COMMENT ON FUNCTION helix_stop_waiting(bigint) IS 'Ends a wait''s registration (helix_lock_waiters); returns its id, NULL when it was gone.';
COMMENT ON FUNCTION helix_touch_api_keys(text[]) IS 'Sets last_used_at of the keys a process used since its last batch; returns how many it found.';
COMMENT ON FUNCTION helix_update_job_lock(bigint,text,jsonb,text) IS 'A holder''s update of its lock''s metadata, a HOT update of the hold; HL001, HL002 or HL003 otherwise. Returns the lock.';
COMMENT ON FUNCTION helix_wait_for_release(text,text,double precision) IS 'Registers an acquire''s wait for the pair for p_seconds (helix_lock_waiters), deleting the registrations that ran out on the way; returns its id. The registration commits before the next attempt, so no end after that attempt goes unannounced.';
