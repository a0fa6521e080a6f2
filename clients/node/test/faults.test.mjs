// Answers that are lost or refused on the way back: a proxy between the client and the real service.
import assert from "node:assert/strict";
import { test } from "node:test";

import { FaultyProxy, ORG, client, jobType, service } from "./helpers.mjs";

const acquires = (proxy) => proxy.seen.filter((r) => r.method === "POST" && r.path === "/v1/locks");

test("an acquire whose answer was lost is retried and gets the same lock and token", async (t) => {
  const proxy = await new FaultyProxy(service.url, [{ method: "POST", path: "/v1/locks", drop: true }]).start();
  try {
    const locks = client(proxy.url);
    const job = jobType("lost-answer");
    const held = await locks.withLock({ organizationId: ORG, jobType: job, ttl: 30 }, async (lease) => {
      const current = await client().current({ organizationId: ORG, jobType: job });
      return { id: lease.id, token: lease.grant.token, fencingToken: lease.fencingToken, current };
    });
    const tries = acquires(proxy);
    assert.deepEqual(
      tries.map((r) => r.told),
      ["dropped", 201],
    );
    // The service granted the first try; its client never heard. The retry carried the same
    // Idempotency-Key and was answered that same grant, not 409 from its own lock.
    const first = JSON.parse(tries[0].answered.body);
    assert.equal(tries[0].answered.status, 201);
    assert.ok(tries[0].headers["idempotency-key"]);
    assert.equal(tries[1].headers["idempotency-key"], tries[0].headers["idempotency-key"]);
    assert.deepEqual(
      { id: held.id, token: held.token, fencingToken: held.fencingToken },
      { id: first.id, token: first.token, fencingToken: first.fencing_token },
    );
    assert.equal(held.current.id, first.id, "one lock for the key: the first try's");
    const released = proxy.seen.filter((r) => r.method === "DELETE");
    assert.deepEqual(
      released.map((r) => [r.path, r.told]),
      [[`/v1/locks/${first.id}`, 204]],
    );
    t.diagnostic(`retried ${(tries[1].at - tries[0].at).toFixed(0)} ms after the first try`);
  } finally {
    await proxy.close();
  }
});

test("a 503 with Retry-After is honoured: the retry waits that long, and gets the grant", async (t) => {
  const proxy = await new FaultyProxy(service.url, [{ method: "POST", path: "/v1/locks", status: 503, retryAfter: 2 }]).start();
  try {
    const locks = client(proxy.url);
    const job = jobType("retry-after");
    const grant = await locks.acquire({ organizationId: ORG, jobType: job, ttl: 30 });
    const tries = acquires(proxy);
    assert.deepEqual(
      tries.map((r) => r.told),
      [503, 201],
    );
    const gap = tries[1].at - tries[0].at;
    t.diagnostic(`503 Retry-After: 2 -> next attempt ${gap.toFixed(0)} ms later`);
    assert.ok(gap >= 2000, `retried after ${gap} ms, before the 2 s Retry-After`);
    assert.ok(gap < 3500, `retried after ${gap} ms: Retry-After is not a reason to wait longer`);
    // The 503 stood in for a grant the service did make: the retry got it back.
    assert.equal(grant.id, JSON.parse(tries[0].answered.body).id);
    await locks.release(grant);
  } finally {
    await proxy.close();
  }
});

test("a lease keeps its lock through a renewal answered 503, and a release answered 503 counts", async () => {
  const proxy = await new FaultyProxy(service.url, [
    { method: "POST", path: "/v1/locks/", status: 503, retryAfter: 1 },
    { method: "DELETE", path: "/v1/locks/", status: 503, retryAfter: 1 },
  ]).start();
  try {
    const locks = client(proxy.url);
    const job = jobType("renew-503");
    const id = await locks.withLock({ organizationId: ORG, jobType: job, ttl: 3 }, async (lease) => {
      // Renewals every second; the first is answered 503 (the service renewed it all the same).
      const deadline = performance.now() + 10_000;
      while (proxy.seen.filter((r) => r.path.endsWith("/renew") && r.told === 200).length < 2) {
        assert.ok(performance.now() < deadline, "renewed twice within 10 s");
        lease.check();
        await new Promise((resolve) => setTimeout(resolve, 50));
      }
      return lease.id;
    });
    const renewals = proxy.seen.filter((r) => r.path.endsWith("/renew"));
    assert.equal(renewals[0].told, 503);
    assert.ok(renewals[1].at - renewals[0].at >= 1000, "the renewal's retry waited Retry-After");
    const releases = proxy.seen.filter((r) => r.method === "DELETE").map((r) => r.told);
    assert.deepEqual(releases, [503, 410], "the retry found the lock released by the first try");
    const ended = await client().get(id);
    assert.equal(ended.release_reason, "released");
  } finally {
    await proxy.close();
  }
});
