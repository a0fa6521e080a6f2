// A lock taken away by an admin, and a waiter woken by a release.
import assert from "node:assert/strict";
import { test } from "node:test";
import { setTimeout as pause } from "node:timers/promises";

import { LockHeldError, LockLostError } from "../dist/index.js";
import { FaultyProxy, ORG, admin, client, jobType, rejection, service, within } from "./helpers.mjs";

test("a lock forced by an admin: the signal aborts at the next renewal, withLock rejects with LockLostError", async (t) => {
  assert.ok(service.adminKey, "HELIX_LOCKS_TEST_ADMIN_KEY: an admin key, to force the release");
  const proxy = await new FaultyProxy(service.url).start(); // records what the client sends
  try {
    const locks = client(proxy.url);
    const job = jobType("forced");
    const ttl = 1.5; // renewed every 0.5 s
    let forcedAt = 0;
    let abortedAt = 0;
    let lockId = 0;
    const outcome = locks.withLock({ organizationId: ORG, jobType: job, ttl }, async (lease) => {
      lockId = lease.id;
      lease.signal.addEventListener("abort", () => {
        abortedAt = performance.now();
      });
      forcedAt = performance.now();
      const forced = await admin("DELETE", `/v1/locks/${lease.id}?force=true`);
      assert.equal(forced.status, 204);
      // The work: it waits on the lease's signal, as a fetch or a child process would.
      await pause(30_000, undefined, { signal: lease.signal });
      return "finished the work of a lock it had lost";
    });
    const error = await rejection(outcome, 10_000);
    assert.ok(error instanceof LockLostError, `rejected with ${error}`);
    assert.equal(error.status, 410);
    assert.equal(error.problem.type, "urn:helix-locks:problem:lock-ended");
    assert.equal(error.problem.release_reason, "forced");
    assert.ok(error.problem.forced_by, "the admin key that broke it");
    assert.equal(error.cause?.name, "AbortError", "the callback's own error, as its cause");
    const took = abortedAt - forcedAt;
    t.diagnostic(`forced -> signal aborted in ${took.toFixed(0)} ms (renewal every ${(ttl / 3) * 1000} ms)`);
    assert.ok(abortedAt > forcedAt && took < (ttl / 3) * 1000 + 700, `aborted ${took} ms after the force`);
    // The renewal that learned it was answered 410, and the lost lock was not released.
    const sent = proxy.seen.map((r) => [r.method, r.path.replace(/locks\/\d+/, "locks/ID"), r.told]);
    assert.deepEqual(sent.at(-1), ["POST", "/v1/locks/ID/renew", 410]);
    assert.equal(sent.filter(([method]) => method === "DELETE").length, 0, `sent: ${JSON.stringify(sent)}`);
    const lock = await admin("GET", `/v1/locks/${lockId}`);
    assert.equal(lock.body.release_reason, "forced");
  } finally {
    await proxy.close();
  }
});

test("a waiter is granted the lock because of the release, well before its own wait runs out", async (t) => {
  const locks = client();
  const job = jobType("waiting");
  const held = await locks.acquire({ organizationId: ORG, jobType: job, ttl: 60, holder: "first" });
  let grantedAt = 0;
  const waiter = locks.withLock({ organizationId: ORG, jobType: job, ttl: 10, wait: 30, holder: "waiter" }, async (lease) => {
    grantedAt = performance.now();
    return lease.fencingToken;
  });
  const held2 = await rejection(locks.acquire({ organizationId: ORG, jobType: job }));
  assert.ok(held2 instanceof LockHeldError, "held while the waiter waits");
  await pause(1000);
  assert.equal(grantedAt, 0, "waits while the lock is held");
  const releasedAt = performance.now();
  await locks.release(held);
  const token = await within(waiter, 10_000, "the waiter");
  const latency = grantedAt - releasedAt;
  t.diagnostic(`wait 30 s, released after 1 s: granted ${latency.toFixed(1)} ms after the release was sent`);
  assert.equal(token, held.fencingToken + 1);
  assert.ok(latency < 2000, `granted ${latency} ms after the release: woken by it, not by its 30 s wait`);
});

test("a session that lost a lock to an admin's force: the signal aborts at its next renewal, withSession rejects", async (t) => {
  assert.ok(service.adminKey, "HELIX_LOCKS_TEST_ADMIN_KEY: an admin key, to force the release");
  const locks = client();
  const [a, b] = [jobType("session-a"), jobType("session-b")];
  const ttl = 1.5; // renewed every 0.5 s
  let forcedAt = 0;
  let abortedAt = 0;
  let kept = 0;
  const outcome = locks.withSession({ organizationId: ORG, jobTypes: [a, b], ttl }, async (session) => {
    assert.deepEqual(Object.keys(session.fencingTokens).sort(), [a, b].sort());
    kept = session.locks[a].id;
    session.signal.addEventListener("abort", () => {
      abortedAt = performance.now();
    });
    forcedAt = performance.now();
    const forced = await admin("DELETE", `/v1/locks/${session.locks[b].id}?force=true`);
    assert.equal(forced.status, 204);
    await pause(30_000, undefined, { signal: session.signal });
    return "finished the work of a set it had lost";
  });
  const error = await rejection(outcome, 10_000);
  assert.ok(error instanceof LockLostError, `rejected with ${error}`);
  assert.equal(error.status, 410);
  assert.equal(error.problem.type, "urn:helix-locks:problem:session-ended");
  assert.equal(error.problem.end_reason, "lost");
  const took = abortedAt - forcedAt;
  t.diagnostic(`forced -> signal aborted in ${took.toFixed(0)} ms (renewal every ${(ttl / 3) * 1000} ms)`);
  assert.ok(abortedAt > forcedAt && took < (ttl / 3) * 1000 + 700, `aborted ${took} ms after the force`);
  // The renewal that found the loss released the session's other lock.
  const other = await admin("GET", `/v1/locks/${kept}`);
  assert.equal(other.body.state, "released");
});

test("a session takes its locks all at once or none, renews them with one request, and ends them", async () => {
  const locks = client();
  const [a, b, c] = [jobType("set-a"), jobType("set-b"), jobType("set-c")];
  const held = await locks.acquire({ organizationId: ORG, jobType: b, ttl: 30 });
  const refused = await rejection(locks.openSession({ organizationId: ORG, jobTypes: [c, b, a], ttl: 30 }), 10_000);
  assert.ok(refused instanceof LockHeldError);
  assert.equal(refused.jobType, b);
  assert.equal(await locks.current({ organizationId: ORG, jobType: a }), null, "none of the set was granted");
  await locks.release(held);
  const result = await locks.withSession({ organizationId: ORG, jobTypes: [a, b], ttl: 1.5 }, async (session) => {
    for (let i = 0; i < 20; i++) {
      await pause(100); // 2 s: longer than the lease, renewed every third of one
      session.check();
    }
    const current = await locks.current({ organizationId: ORG, jobType: a });
    assert.equal(current.session_id, session.id);
    return session.id;
  });
  const ended = await locks.getSession(result);
  assert.equal(ended.state, "ended");
  assert.deepEqual(ended.locks, []);
});

test("locks added to a held session all at once or none, renewed with it", async () => {
  const locks = client();
  const [a, b, c] = [jobType("added-a"), jobType("added-b"), jobType("added-c")];
  const held = await locks.acquire({ organizationId: ORG, jobType: b, ttl: 30 });
  await locks.withSession({ organizationId: ORG, jobTypes: [a], ttl: 1.5 }, async (session) => {
    const refused = await rejection(locks.addSessionLocks(session, { jobTypes: [c, b] }), 10_000);
    assert.ok(refused instanceof LockHeldError);
    assert.equal(refused.jobType, b);
    assert.equal(await locks.current({ organizationId: ORG, jobType: c }), null); // none of them
    await locks.release(held);
    const added = await locks.addSessionLocks(session, { jobTypes: [c, b], wait: 5 });
    assert.deepEqual(added.map((lock) => lock.job_type).sort(), [b, c].sort());
    assert.deepEqual(Object.keys(session.fencingTokens).sort(), [a, b, c].sort());
    for (let i = 0; i < 20; i++) {
      await pause(100); // 2 s: longer than the lease, all three renewed with the session
      session.check();
    }
    const current = await locks.current({ organizationId: ORG, jobType: c });
    assert.equal(current.session_id, session.id);
  });
  assert.equal(await locks.current({ organizationId: ORG, jobType: c }), null);
});
