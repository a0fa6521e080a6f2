#!/usr/bin/env node
// A Helix Locks worker in Node 20+, on the helix-locks client (clients/node). Each iteration takes
// the lock for one organization and job type (waiting while it is held), works while the client
// renews it, hands the fencing token to what it writes, and releases it.
// To run it from the repository's top folder (tests/system/test_packages.py runs these lines):
//   npm ci --prefix clients/node                # the client's dev dependencies, then its build
//   npm ci --prefix examples --ignore-scripts   # examples/node_modules/helix-locks: a link to it
//   examples/node-worker.mjs [OUTPUT_FILE]
// In a project of your own, install the client's tarball instead: `npm ci && npm pack` in
// clients/node, then `npm install <that folder>/helix-locks-<version>.tgz` in your project.
//   HELIX_LOCKS_URL (default http://127.0.0.1:8080), HELIX_LOCKS_API_KEY (sent as a Bearer token)
//   WORKER_ORG, WORKER_JOB_TYPE  the lock's key (default acme, nightly-report)
//   WORKER_TTL           lease in seconds, renewed every TTL/3 (default 30)
//   WORKER_ITERATIONS    how many times to take the lock and work (default 1)
//   WORKER_WORK_SECONDS  how long one piece of work takes (default 1)
//   WORKER_WAIT_SECONDS  how long to wait for a held lock before giving up (default 60)
//   WORKER_MAX_HOLDERS   a semaphore: up to this many workers hold the key at once, each in a slot
//                        of its own (default 1: one at a time); all of them must give the same value
//   WORKER_HOLDER        holder name (default the client's, user@host:pid)
//   OUTPUT_FILE or WORKER_OUTPUT  gets a line "fencing_token holder lock_id acquired_at slot" per
//                        piece of work, as a storage layer would (default worker-output.txt)
// Exit status, as `helix-locks run`'s: 0 done; 75 the lock stayed held past WORKER_WAIT_SECONDS;
// 69 the service could not be reached; 76 the lock was lost (a refused renewal, or renewals failing
// until the lease was nearly over): the work was stopped at once and the lock not released; 1
// unexpected; 2 bad configuration (max-holders-mismatch included). SIGTERM/Ctrl-C stop the work
// and release the lock.
import { appendFile } from "node:fs/promises";
import { setTimeout as sleep } from "node:timers/promises";
import { LockClient, LockHeldError, LockLostError, MaxHoldersMismatchError, UnavailableError } from "helix-locks";

const env = process.env;
const options = {
  organizationId: env.WORKER_ORG ?? "acme",
  jobType: env.WORKER_JOB_TYPE ?? "nightly-report",
  ttl: Number(env.WORKER_TTL ?? 30),
  wait: Number(env.WORKER_WAIT_SECONDS ?? 60),
  maxHolders: Number(env.WORKER_MAX_HOLDERS ?? 1),
  holder: env.WORKER_HOLDER,
};
const iterations = Number(env.WORKER_ITERATIONS ?? 1);
const workMs = Number(env.WORKER_WORK_SECONDS ?? 1) * 1000;
const output = process.argv[2] ?? env.WORKER_OUTPUT ?? "worker-output.txt";
const STATUS = [[LockHeldError, 75], [UnavailableError, 69], [LockLostError, 76], [MaxHoldersMismatchError, 2]];

const interrupted = new AbortController(); // SIGTERM/Ctrl-C: stop the work; withLock releases
for (const [name, status] of [["SIGINT", 130], ["SIGTERM", 143]]) {
  process.once(name, () => { process.exitCode = status; interrupted.abort(new Error(name)); });
}

const client = new LockClient(); // HELIX_LOCKS_URL, HELIX_LOCKS_API_KEY
try {
  if (!(Number.isInteger(iterations) && workMs >= 0)) {
    throw Object.assign(new Error("WORKER_ITERATIONS and WORKER_WORK_SECONDS must be numbers"), { status: 422 });
  }
  for (let i = 1; i <= iterations && !interrupted.signal.aborted; i++) {
    await client.withLock({ ...options, signal: interrupted.signal }, async (lease) => {
      // The work. Real work passes this signal on to what it awaits (fetch, streams) to stop at
      // once: it aborts the moment the lock may be lost.
      await sleep(workMs, undefined, { signal: AbortSignal.any([lease.signal, interrupted.signal]) });
      // What the work writes carries the fencing token, so storage can refuse a stale holder; and
      // the slot, by which storage keys its fence when several hold the key at once (a semaphore).
      const { fencing_token, holder, id, acquired_at, slot } = lease.lock;
      await appendFile(output, `${fencing_token} ${holder} ${id} ${acquired_at} ${slot ?? 0}\n`);
    });
  }
  console.error(`${options.holder ?? "node-worker"}: done`);
} catch (error) {
  console.error(`${options.holder ?? "node-worker"}: ${error.name}: ${error.message}`);
  process.exitCode ||= STATUS.find(([type]) => error instanceof type)?.[1] ?? (error.status === 422 ? 2 : 1);
}
