// Hold limits (maxHoldSeconds): the limit is the end of every lease, so the lease's signal aborts
// before it by the database's clock, however renewals go; counted from the acquire's send by the
// answer's own database times, never by this machine's wall clock. And closed keys
// (holdAtLeastSeconds): no other grant of the key before closed_until, by the database's clock.
import assert from "node:assert/strict";
import { test } from "node:test";
import { setTimeout as pause } from "node:timers/promises";

import { ApiError, ClosedUntilError, HoldLimitError, LockClient, LockHeldError, LockLostError } from "../dist/index.js";
import { FaultyProxy, ORG, client, dbClock, dbTime, fakeServer, jobType, rejection, service, within } from "./helpers.mjs";

const renewals = (proxy) => proxy.seen.filter((r) => r.method === "POST" && r.path.endsWith("/renew"));

/** Each renewal the proxy saw: its status, `limited`, how long before the hold limit its lease
 * ended, and how long the service took to answer it (ms). */
const renewedUntil = (proxy) =>
  renewals(proxy).map((r) => {
    const body = JSON.parse(r.answered.body);
    return [r.told, body.limited, dbTime(body.hold_limit_at) - dbTime(body.expires_at), r.relayedAt - r.at];
  });

/**
 * Renewals every third of the ttl were granted, each a lease that ended before the hold limit,
 * until one reached it: cut short by it (limited), or ending so near it that the client, which
 * counts the lease from the renewal's send, could not tell it from the limit (within the time its
 * answer took, and a little); and none after it.
 */
function stoppedAtTheLimit(proxy) {
  const seen = renewedUntil(proxy);
  assert.ok(seen.length >= 3, `${seen.length} renewals, every 0.5 s until the limit`);
  const [status, limited, short, took] = seen.at(-1);
  assert.ok(status === 200 && (limited || short < took + 20), `the last renewal reached the limit: ${seen.at(-1)}`);
  for (const [status, limited] of seen.slice(0, -1)) {
    assert.deepEqual([status, limited], [200, false], `renewed only until the limit: ${JSON.stringify(seen)}`);
  }
}

test("withLock with maxHoldSeconds 2 and ttl 30: the signal aborts before the hold limit, and the next acquire reclaims the lock right after it", async (t) => {
  const proxy = await new FaultyProxy(service.url).start(); // records what the client sends
  try {
    const locks = client(proxy.url);
    const probe = await client().acquire({ organizationId: ORG, jobType: jobType("clock"), ttl: 120 });
    const job = jobType("hold-limit");
    let lease;
    let abortedAt = 0;
    let told = null;
    const outcome = locks.withLock({ organizationId: ORG, jobType: job, ttl: 30, maxHoldSeconds: 2 }, async (held) => {
      lease = held;
      held.signal.addEventListener("abort", () => {
        abortedAt = performance.now();
        told = held.signal.reason;
      });
      // The work hangs: only the signal stops it.
      await pause(60_000, undefined, { signal: held.signal });
      return "worked past the hold limit";
    });
    // withLock settles by the limit (2 s), not at the first renewal (10 s), nor after the ttl.
    const error = await rejection(outcome, 8_000);
    const clock = await dbClock(client(), probe);

    const limit = lease.holdLimitAt;
    assert.equal(typeof limit, "string");
    assert.equal(limit, lease.lock.hold_limit_at);
    assert.equal(dbTime(limit) - dbTime(lease.lock.acquired_at), 2000, "acquired_at + max_hold_seconds");
    assert.equal(dbTime(lease.lock.expires_at), dbTime(limit), "the first lease ends at the limit, not after 30 s");
    assert.equal(lease.atHoldLimit, true);

    // Told why: the callback's signal, and withLock's rejection (its cause, the callback's abort).
    assert.ok(told instanceof HoldLimitError && told instanceof LockLostError, String(told));
    assert.match(told.message, /hold limit/);
    assert.equal(told.holdLimitAt, limit);
    assert.ok(error instanceof HoldLimitError, `rejected with ${error}`);
    assert.equal(error.holdLimitAt, limit);
    assert.equal(error.cause?.name, "AbortError");

    // Before the limit by the database's clock; and not at once (the margin is a tenth of the
    // 2 s the lease can run, not of its 30 s ttl).
    const dbAtAbort = clock.atMost(abortedAt);
    t.diagnostic(`aborted ${(dbTime(limit) - dbAtAbort).toFixed(0)} ms or more before hold_limit_at`);
    assert.ok(dbAtAbort < dbTime(limit), `aborted ${dbAtAbort - dbTime(limit)} ms after the limit`);
    const held = abortedAt - lease.grant.sentAt;
    assert.ok(held > 1500 && held < 2000, `aborted ${held.toFixed(0)} ms after the acquire's send`);

    // No renewal was sent (none takes the lease past the limit), and the lost lock was not released.
    assert.deepEqual(renewals(proxy), []);
    assert.deepEqual(proxy.seen.filter((r) => r.method === "DELETE"), []);

    // Reclaimable right after the limit: a waiter gets it once the limit has come.
    const next = await locks.acquire({ organizationId: ORG, jobType: job, ttl: 30, wait: 20, holder: "next" });
    assert.equal(next.reclaimed?.lock_id, lease.id);
    const after = dbTime(next.lock.acquired_at) - dbTime(limit);
    t.diagnostic(`reclaimed ${after.toFixed(0)} ms after hold_limit_at`);
    assert.ok(after >= 0 && after < 3000, `granted ${after} ms after the limit`);
    assert.equal(next.holdLimitAt, null);
    await locks.release(next);
    await client().release(probe);
  } finally {
    await proxy.close();
  }
});

test("renewals go on until one is cut short by the hold limit (limited), then stop; the signal aborts before the limit", async (t) => {
  const proxy = await new FaultyProxy(service.url).start();
  try {
    const locks = client(proxy.url);
    const probe = await client().acquire({ organizationId: ORG, jobType: jobType("clock"), ttl: 120 });
    const job = jobType("limited");
    let lease;
    let abortedAt = 0;
    const error = await rejection(
      locks.withLock({ organizationId: ORG, jobType: job, ttl: 1.5, maxHoldSeconds: 3 }, async (held) => {
        lease = held;
        assert.equal(held.atHoldLimit, false, "the first lease ends before the limit");
        await new Promise((resolve) => held.signal.addEventListener("abort", resolve));
        abortedAt = performance.now();
      }),
      10_000,
    );
    const clock = await dbClock(client(), probe);
    assert.ok(error instanceof HoldLimitError, `rejected with ${error}`);
    assert.ok(clock.atMost(abortedAt) < dbTime(lease.holdLimitAt), "aborted before the limit by the database's clock");

    t.diagnostic(`renewals: ${JSON.stringify(renewedUntil(proxy))}`);
    stoppedAtTheLimit(proxy);
    assert.equal(lease.lock.expires_at, JSON.parse(renewals(proxy).at(-1).answered.body).expires_at);
    assert.equal(lease.atHoldLimit, true);
    await client().release(probe);
  } finally {
    await proxy.close();
  }
});

test("withSession with maxHoldSeconds: renewed until the limit cuts a lease short, the signal aborts before it, and each key is reclaimed after it", async (t) => {
  const proxy = await new FaultyProxy(service.url).start();
  try {
    const locks = client(proxy.url);
    const probe = await client().acquire({ organizationId: ORG, jobType: jobType("clock"), ttl: 120 });
    const [a, b] = [jobType("session-limit-a"), jobType("session-limit-b")];
    let session;
    let abortedAt = 0;
    const error = await rejection(
      locks.withSession({ organizationId: ORG, jobTypes: [a, b], ttl: 1.5, maxHoldSeconds: 3 }, async (held) => {
        session = held;
        assert.equal(held.atHoldLimit, false, "the first lease ends before the limit");
        await new Promise((resolve) => held.signal.addEventListener("abort", resolve));
        abortedAt = performance.now();
      }),
      10_000,
    );
    const clock = await dbClock(client(), probe);
    const limit = session.holdLimitAt;
    assert.ok(limit && limit === session.session.hold_limit_at, `the session's hold limit: ${limit}`);
    assert.deepEqual(Object.values(session.locks).map((lock) => lock.hold_limit_at), [limit, limit]);
    assert.ok(error instanceof HoldLimitError && error === session.lostReason, `rejected with ${error}`);
    assert.equal(error.holdLimitAt, limit);
    t.diagnostic(`aborted ${(dbTime(limit) - clock.atMost(abortedAt)).toFixed(0)} ms or more before hold_limit_at`);
    assert.ok(clock.atMost(abortedAt) < dbTime(limit), "aborted before the limit by the database's clock");

    t.diagnostic(`session renewals: ${JSON.stringify(renewedUntil(proxy))}`);
    stoppedAtTheLimit(proxy);
    assert.equal(session.atHoldLimit, true);
    assert.deepEqual(proxy.seen.filter((r) => r.method === "DELETE"), [], "a lost session is not ended");

    // Each key is reclaimed once the limit has come.
    for (const [jobType, lock] of Object.entries(session.locks)) {
      const next = await client().acquire({ organizationId: ORG, jobType, ttl: 30, wait: 20, holder: "next" });
      assert.equal(next.reclaimed?.lock_id, lock.id);
      assert.ok(dbTime(next.lock.acquired_at) >= dbTime(limit));
      await client().release(next);
    }
    await client().release(probe);
  } finally {
    await proxy.close();
  }
});

test("holdLimitAt on the grant and every lock object; a renewal once the limit has come is a HoldLimitError (410)", async () => {
  const locks = client();
  const job = jobType("limit-calls");
  const grant = await locks.acquire({ organizationId: ORG, jobType: job, ttl: 30, maxHoldSeconds: 1 });
  assert.ok(grant.holdLimitAt, "a hold limit");
  assert.equal(grant.holdLimitAt, grant.lock.hold_limit_at);
  assert.equal(dbTime(grant.holdLimitAt) - dbTime(grant.lock.acquired_at), 1000);
  assert.ok(grant.heldUntil > grant.sentAt && grant.heldUntil <= grant.sentAt + 1000, "counted from the send");
  assert.equal((await locks.get(grant.id)).hold_limit_at, grant.holdLimitAt);
  assert.equal((await locks.current({ organizationId: ORG, jobType: job })).hold_limit_at, grant.holdLimitAt);
  const cut = await locks.renew(grant, { ttl: 30 });
  assert.equal(cut.limited, true);
  assert.equal(dbTime(cut.expires_at), dbTime(grant.holdLimitAt));

  // The limit comes, by the database's clock: the lock is expired, and renewed no more.
  const deadline = performance.now() + 10_000;
  while ((await locks.get(grant.id)).state === "held") {
    assert.ok(performance.now() < deadline, "the lock outlived its hold limit");
    await pause(50);
  }
  const refused = await rejection(locks.renew(grant, { ttl: 30 }));
  assert.ok(refused instanceof HoldLimitError && refused instanceof LockLostError, String(refused));
  assert.equal(refused.status, 410);
  assert.equal(refused.problem.type, "urn:helix-locks:problem:hold-limit-reached");
  assert.equal(refused.holdLimitAt, grant.holdLimitAt);
  assert.match(refused.message, /hold limit/);

  // Without maxHoldSeconds, none: and a hold limit out of bounds is the service's 422.
  const plain = await locks.acquire({ organizationId: ORG, jobType: jobType("no-limit"), ttl: 30 });
  assert.equal(plain.holdLimitAt, null);
  assert.equal(plain.heldUntil, null);
  const renewed = await locks.renew(plain);
  assert.equal(renewed.limited, false);
  assert.equal(renewed.hold_limit_at, null);
  await locks.release(plain);
  const bad = await rejection(locks.acquire({ organizationId: ORG, jobType: job, maxHoldSeconds: 0 }));
  assert.ok(bad instanceof ApiError && bad.status === 422, String(bad));
  assert.ok(bad.errors.some((e) => e.field.includes("max_hold_seconds")), JSON.stringify(bad.errors));
});

/** A service of its own that grants one lock with these times (of 2001: far from this machine's
 * wall clock), answers renewals with `renewal`, and releases. */
async function scripted(times, renewal = null) {
  const seen = [];
  const fake = await fakeServer((request, response) => {
    seen.push(`${request.method} ${request.url}`);
    const json = (status, body, type = "application/json") => {
      response.writeHead(status, { "content-type": type });
      response.end(body === null ? undefined : JSON.stringify(body));
    };
    const lock = {
      id: 7, organization_id: ORG, job_type: "scripted", holder: "h", fencing_token: 1, released_at: null,
      release_reason: null, state: "held", metadata: null, max_holders: 1, slot: 0, mode: "exclusive", ...times,
    };
    if (request.method === "POST" && request.url === "/v1/locks") return json(201, { ...lock, token: "t".repeat(32), reclaimed: null });
    if (request.url.endsWith("/renew") && renewal) return json(renewal.status, renewal.body, renewal.type);
    if (request.method === "DELETE") return json(204, null);
    return json(500, { detail: "not scripted" });
  });
  fake.seen = seen;
  return fake;
}

test("the limit is counted from the acquire's send by the answer's database times (the limit less expires_at, plus ttl_remaining_ms), never the wall clock", async () => {
  // An answer read 20 s after its grant (a repeat): the limit is 5.5005 s after the database's
  // answer, though 25.5 s after acquired_at, and 25 years before this machine's wall clock.
  const fake = await scripted({
    acquired_at: "2001-01-01T00:00:00.000250Z",
    expires_at: "2001-01-01T00:00:30.000250Z",
    hold_limit_at: "2001-01-01T00:00:25.500750Z",
    ttl_remaining_ms: 10_000,
  });
  try {
    const locks = new LockClient({ url: fake.url });
    const result = await locks.withLock({ organizationId: ORG, jobType: "scripted", ttl: 30, maxHoldSeconds: 60 }, (lease) => {
      const grant = lease.grant;
      assert.ok(Math.abs(grant.heldUntil - grant.sentAt - 5500.5) < 1e-6, `${grant.heldUntil - grant.sentAt} ms`);
      assert.equal(lease.atHoldLimit, true);
      assert.equal(lease.lost, false, "not lost by the wall clock");
      // The margin: a tenth of the 5.5 s the lease can run.
      const endsIn = lease.remaining * 1000 + (performance.now() - grant.sentAt);
      assert.ok(Math.abs(endsIn - (5500.5 - 550.05)) < 5, `the signal aborts ${endsIn} ms after the send`);
      return grant.holdLimitAt;
    });
    assert.equal(result, "2001-01-01T00:00:25.500750Z");
    assert.deepEqual(fake.seen, ["POST /v1/locks", "DELETE /v1/locks/7"]);
  } finally {
    await fake.close();
  }
});

test("a renewal answered 410 hold-limit-reached loses the lease with a HoldLimitError", async () => {
  const problem = {
    type: "urn:helix-locks:problem:hold-limit-reached", title: "Hold limit reached", status: 410,
    detail: "The lock reached its hold limit at 2001-01-01T00:00:02Z.", hold_limit_at: "2001-01-01T00:00:02Z",
  };
  const fake = await scripted(
    { acquired_at: "2001-01-01T00:00:00Z", expires_at: "2001-01-01T00:00:01.5Z", hold_limit_at: null, ttl_remaining_ms: 1500 },
    { status: 410, body: problem, type: "application/problem+json" },
  );
  try {
    const locks = new LockClient({ url: fake.url });
    let told = null;
    const error = await rejection(
      locks.withLock({ organizationId: ORG, jobType: "scripted", ttl: 1.5 }, async (lease) => {
        await new Promise((resolve) => lease.signal.addEventListener("abort", resolve));
        told = lease.lostReason;
      }),
      5_000,
    );
    assert.ok(error instanceof HoldLimitError && error === told, String(error));
    assert.equal(error.status, 410);
    assert.equal(error.holdLimitAt, "2001-01-01T00:00:02Z");
    assert.match(error.message, /hold limit/);
    assert.deepEqual(fake.seen, ["POST /v1/locks", "POST /v1/locks/7/renew"], "a lost lock is not released");
  } finally {
    await within(fake.close(), 5_000);
  }
});

test("holdAtLeastSeconds: closedUntil on the grant and the lock object; after a release, the next acquire is a ClosedUntilError naming it", async () => {
  const locks = client();
  const job = jobType("closed");
  const grant = await locks.acquire({ organizationId: ORG, jobType: job, ttl: 30, holdAtLeastSeconds: 60 });
  assert.ok(grant.closedUntil, "the key is closed");
  assert.equal(grant.closedUntil, grant.lock.closed_until);
  assert.equal(dbTime(grant.closedUntil) - dbTime(grant.lock.acquired_at), 60_000, "acquired_at + hold_at_least_seconds");
  assert.equal(grant.holdLimitAt, null, "a closing is no hold limit");
  await locks.release(grant);
  assert.equal((await locks.get(grant.id)).closed_until, grant.closedUntil, "the released lock keeps it");

  // Released at once, the key stays closed: a LockHeldError still, for code that knows no more.
  const refused = await rejection(locks.acquire({ organizationId: ORG, jobType: job, ttl: 30, holder: "late" }));
  assert.ok(refused instanceof ClosedUntilError && refused instanceof LockHeldError, String(refused));
  assert.equal(refused.kind, "closed-until");
  assert.equal(refused.closedUntil, grant.closedUntil);
  assert.ok(refused.retryAfter > 1 && refused.retryAfter <= 60, `Retry-After ${refused.retryAfter}`);
  assert.match(refused.message, /closed until/);

  // Without it, none; and only an exclusive lock with maxHolders 1 closes its key (else 422).
  const plain = await locks.acquire({ organizationId: ORG, jobType: jobType("open"), ttl: 30 });
  assert.equal(plain.closedUntil, null);
  await locks.release(plain);
  for (const options of [{ mode: "shared" }, { maxHolders: 2 }]) {
    const bad = await rejection(locks.acquire({ organizationId: ORG, jobType: jobType("no-close"), holdAtLeastSeconds: 5, ...options }));
    assert.ok(bad instanceof ApiError && bad.status === 422, `${JSON.stringify(options)}: ${bad}`);
  }
});

test("a wait that would end before closed_until is a ClosedUntilError at once, asked once, not waited out", async (t) => {
  const proxy = await new FaultyProxy(service.url).start(); // counts the acquires the client sends
  try {
    const job = jobType("closed-wait");
    const first = await client().acquire({ organizationId: ORG, jobType: job, ttl: 30, holdAtLeastSeconds: 30 });
    await client().release(first);
    const started = performance.now();
    const refused = await rejection(client(proxy.url).acquire({ organizationId: ORG, jobType: job, ttl: 30, wait: 10 }));
    const took = performance.now() - started;
    t.diagnostic(`refused after ${took.toFixed(0)} ms of a 10 s wait`);
    assert.ok(refused instanceof ClosedUntilError, String(refused));
    assert.equal(refused.closedUntil, first.closedUntil);
    assert.ok(took < 3000, `refused after ${took.toFixed(0)} ms, not at once`);
    // Told by the service at once, the client does not pause and ask again: waiting cannot help.
    const asked = proxy.seen.filter((r) => r.method === "POST" && r.path === "/v1/locks");
    assert.deepEqual(asked.map((r) => r.told), [409]);
  } finally {
    await proxy.close();
  }
});

test("withLock with holdAtLeastSeconds 2, released at once: a wait of 20 s is granted at or after closed_until", async (t) => {
  const locks = client();
  const job = jobType("closed-open");
  let closedUntil = null;
  await locks.withLock({ organizationId: ORG, jobType: job, ttl: 30, holdAtLeastSeconds: 2 }, (lease) => {
    closedUntil = lease.closedUntil;
    assert.equal(closedUntil, lease.grant.closedUntil);
    assert.equal(dbTime(closedUntil) - dbTime(lease.lock.acquired_at), 2000);
  });
  const next = await locks.acquire({ organizationId: ORG, jobType: job, ttl: 30, wait: 20, holder: "next" });
  const after = dbTime(next.lock.acquired_at) - dbTime(closedUntil);
  t.diagnostic(`granted ${after.toFixed(0)} ms after closed_until`);
  // By the database's clock, both times from its own answers.
  assert.ok(after >= 0 && after < 3000, `granted ${after} ms after closed_until`);
  assert.equal(next.closedUntil, null);
  await locks.release(next);
});
