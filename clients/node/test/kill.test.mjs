// The service is SIGKILLed while a lease is held: the lease's own clock must say the lock may be
// lost before it could have lapsed. This kills the service it runs against: it needs one of its
// own (tests/system/test_node_client.py starts it), named with its process id.
import assert from "node:assert/strict";
import { test } from "node:test";

import { LockLostError } from "../dist/index.js";
import { ORG, client, jobType, rejection, silentServer, sleep, wallNow } from "./helpers.mjs";

test("the service killed while a 2 s lease is held: the signal aborts before the lease could lapse", async (t) => {
  const pid = Number(process.env.HELIX_LOCKS_TEST_SERVER_PID);
  assert.ok(pid > 0, "HELIX_LOCKS_TEST_SERVER_PID: the service's process, to kill");
  const silent = await silentServer(); // what the work waits on: it never answers
  try {
    const locks = client();
    let killedAt = 0;
    let aborted = null;
    let work = null;
    const outcome = locks.withLock({ organizationId: ORG, jobType: jobType("killed"), ttl: 2 }, async (lease) => {
      lease.signal.addEventListener("abort", () => {
        // The lease as the service last confirmed it: its expiry by the database's clock.
        aborted = { at: performance.now(), wall: wallNow(), expiresAt: Date.parse(lease.lock.expires_at) };
      });
      await sleep(800); // renewed once (every 667 ms): the expiry then is the service's answer
      assert.ok(lease.lock.expires_at > lease.grant.lock.expires_at, "renewed before the kill");
      process.kill(pid, "SIGKILL");
      killedAt = performance.now();
      // The work: a request that never gets its answer, given the lease's signal.
      work = await rejection(fetch(silent.url, { signal: lease.signal }), 5000);
      return "finished";
    });
    const error = await rejection(outcome, 10_000);
    assert.ok(error instanceof LockLostError, `withLock rejected with ${error}`);
    assert.match(error.message, /may have lapsed/);
    assert.ok(aborted !== null, "the signal aborted");
    // Before the lease could have lapsed: the expiry the service last announced (the database's
    // clock and this process's wall clock are one host's), and by this process's own count.
    const margin = aborted.expiresAt - aborted.wall;
    t.diagnostic(
      `killed -> aborted after ${(aborted.at - killedAt).toFixed(0)} ms, ${margin.toFixed(0)} ms before the lease's expiry`,
    );
    assert.ok(margin > 0, `aborted ${-margin} ms after the lease's expiry`);
    assert.ok(aborted.at > killedAt && aborted.at - killedAt < 2000, "aborted within one lease of the kill");
    // The fetch given the signal was cancelled, with the loss as its reason.
    assert.ok(work instanceof LockLostError, `the fetch rejected with ${work}`);
  } finally {
    await silent.close();
  }
});
