#!/usr/bin/env node
// One racer of tests/system/test_node_client.py's race: for SECONDS it takes one key's lock with
// withLock (ttl 1.5 s, so that each piece of work is renewed once), works 0.6 s, and records what it
// was told as JSON lines in OUTPUT, for the project's history checker.
// Usage: race-worker.mjs NAME SECONDS OUTPUT ORGANIZATION JOB_TYPE
//   (HELIX_LOCKS_URL, HELIX_LOCKS_API_KEY: the service)
import { appendFileSync } from "node:fs";
import { setTimeout as pause } from "node:timers/promises";

import { LockClient, LockHeldError, LockLostError } from "../dist/index.js";

const [name, seconds, output, organizationId, jobType] = process.argv.slice(2);
const record = (line) => appendFileSync(output, `${JSON.stringify({ worker: name, ...line })}\n`);
// The host's wall clock, as the other racers (Python's time.time(), Go's time.Now()) read it:
// performance.timeOrigin + performance.now() runs on from the process's start on the monotonic
// clock and drifts from it by milliseconds, which made work look overlapped. Whole milliseconds.
const wallNow = () => Date.now();
const client = new LockClient();
const ttl = 1.5;
const deadline = performance.now() + Number(seconds) * 1000;

while (performance.now() < deadline) {
  let lockId = null;
  try {
    const lease = await client.withLock({ organizationId, jobType, ttl, wait: 10, holder: name }, async (lease) => {
      lockId = lease.id;
      const { lock } = lease.grant;
      record({ kind: "told", lock_id: lock.id, fencing_token: lock.fencing_token, acquired_at: lock.acquired_at, slot: lock.slot });
      const start = wallNow();
      await pause(600, undefined, { signal: lease.signal });
      lease.check();
      record({ kind: "work", lock_id: lock.id, start: start / 1000, end: wallNow() / 1000 });
      return lease;
    });
    if (lease.lock.expires_at !== lease.grant.lock.expires_at) {
      record({ kind: "renewed", lock_id: lease.id, expires_at: lease.lock.expires_at, ttl });
    }
    record({ kind: "release_attempt", lock_id: lease.id });
  } catch (error) {
    if (error instanceof LockHeldError) record({ kind: "held" });
    else if (error instanceof LockLostError) record({ kind: "lost", lock_id: lockId, message: error.message });
    else throw error;
  }
}
