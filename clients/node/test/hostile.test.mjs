// Answers that come late, are not the service's, or never end; and mistakes in the request. Each
// test here failed against an earlier build of the client.
import assert from "node:assert/strict";
import { test } from "node:test";

import { ApiError, LockClient, LockHeldError, LockLostError, UnavailableError } from "../dist/index.js";
import { FaultyProxy, ORG, client, fakeServer, jobType, rejection, service, silentServer, within } from "./helpers.mjs";

const SAFETY_MS = 300; // a tenth of a 3 s ttl
const seen = (proxy, method, suffix) => proxy.seen.filter((r) => r.method === method && r.path.endsWith(suffix));

test("a lease counts from when the acquire was sent, not from when its late answer was read", async () => {
  const proxy = await new FaultyProxy(service.url, [{ method: "POST", path: "/v1/locks", delayMs: 600 }]).start();
  try {
    const job = jobType("late-answer");
    await client(proxy.url).withLock({ organizationId: ORG, jobType: job, ttl: 3 }, async (lease) => {
      const [acquire] = seen(proxy, "POST", "/v1/locks");
      // The request reached the proxy after it was sent: the lease may last no longer from there.
      const endsAt = performance.now() + lease.remaining * 1000;
      assert.ok(endsAt <= acquire.at + 3000 - SAFETY_MS + 1, `ends ${endsAt - acquire.at} ms after the send`);
      assert.equal(seen(proxy, "POST", "/renew").length, 0, "no renewal was needed before the work");
    });
  } finally {
    await proxy.close();
  }
});

test("after an acquire that took longer than a renewal period, the work starts on a renewal's lease", async () => {
  const proxy = await new FaultyProxy(service.url, [{ method: "POST", path: "/v1/locks", delayMs: 1500 }]).start();
  try {
    const job = jobType("long-acquire");
    await client(proxy.url).withLock({ organizationId: ORG, jobType: job, ttl: 3 }, async (lease) => {
      const renewals = seen(proxy, "POST", "/renew");
      assert.equal(renewals.length, 1, "renewed once before the work started");
      const endsAt = performance.now() + lease.remaining * 1000;
      assert.ok(endsAt <= renewals[0].at + 3000 - SAFETY_MS + 1, `ends ${endsAt - renewals[0].at} ms after the renewal`);
      assert.ok(!lease.lost);
    });
  } finally {
    await proxy.close();
  }
});

test("renewals answered 200 with something that is not the service's lose the lease at its margin", async () => {
  const garbage = { status: 200, type: "text/html", body: "<html>a captive portal</html>" };
  const faults = Array.from({ length: 6 }, () => ({ method: "POST", path: "/v1/locks/", answer: garbage }));
  const proxy = await new FaultyProxy(service.url, faults).start();
  try {
    const job = jobType("garbage-renewal");
    let sent;
    const lost = await rejection(
      client(proxy.url).withLock({ organizationId: ORG, jobType: job, ttl: 3 }, async (lease) => {
        sent = seen(proxy, "POST", "/v1/locks")[0].at;
        await new Promise((resolve) => lease.signal.addEventListener("abort", resolve));
        return performance.now();
      }),
      10_000,
    );
    assert.ok(lost instanceof LockLostError, String(lost));
    assert.match(lost.message, /lapsed/);
    assert.ok(seen(proxy, "POST", "/renew").length >= 1, "it did try to renew");
    assert.ok(performance.now() - sent < 3000 + 500, "lost by the clock, at the lease's margin");
  } finally {
    await proxy.close();
  }
});

test("an acquire answered with a redirect or a page that is not JSON is an ApiError", async () => {
  for (const [status, type, body] of [
    [301, "text/html", "moved"],
    [200, "text/html", "<html></html>"],
    [201, "application/json", "null"],
  ]) {
    const fake = await fakeServer((_, response) => {
      response.writeHead(status, { "content-type": type, location: "http://127.0.0.1:1/" });
      response.end(body);
    });
    try {
      const error = await rejection(new LockClient({ url: fake.url }).acquire({ organizationId: ORG, jobType: "x" }));
      assert.ok(error instanceof ApiError && !(error instanceof LockHeldError), `${status}: ${error}`);
      assert.equal(error.status, status);
      assert.equal(fake.count, 1, "not retried");
    } finally {
      await fake.close();
    }
  }
});

test("a mistake in the request is thrown at once, not retried as if the service were away", async () => {
  const started = performance.now();
  const badKey = new LockClient({ url: service.url, apiKey: "hlk_x\nInjected: yes" });
  const error = await rejection(badKey.get(1), 5_000);
  assert.ok(error instanceof TypeError && !(error instanceof UnavailableError), String(error));
  const circular = {};
  circular.self = circular;
  const body = await rejection(client().acquire({ organizationId: ORG, jobType: "x", metadata: circular }), 5_000);
  assert.ok(body instanceof TypeError, String(body));
  assert.ok(performance.now() - started < 2_000, "at once");
  for (const timeout of [Number.NaN, 0, -5, Number.POSITIVE_INFINITY, "10"]) {
    assert.throws(() => new LockClient({ url: service.url, timeout }), TypeError, String(timeout));
  }
});

test("a waiting acquire that is answered 409 at once asks again with a pause, not in a tight loop", async () => {
  const fake = await fakeServer((_, response) => {
    response.writeHead(409, { "content-type": "application/problem+json", "retry-after": "1" });
    response.end(JSON.stringify({ type: "urn:helix-locks:problem:lock-held", status: 409, holder: "other" }));
  });
  try {
    const error = await rejection(new LockClient({ url: fake.url }).acquire({ organizationId: ORG, jobType: "x", wait: 2 }));
    assert.ok(error instanceof LockHeldError, String(error));
    assert.ok(fake.count >= 2 && fake.count <= 12, `${fake.count} requests in 2 s`);
  } finally {
    await fake.close();
  }
});

test("renewals go every ttl/3 from the previous send, even when their answers are slow", async () => {
  const faults = Array.from({ length: 4 }, () => ({ method: "POST", path: "/v1/locks/", delayMs: 700 }));
  const proxy = await new FaultyProxy(service.url, faults).start();
  try {
    const job = jobType("slow-renewals");
    await client(proxy.url).withLock({ organizationId: ORG, jobType: job, ttl: 3 }, async (lease) => {
      await new Promise((resolve) => setTimeout(resolve, 2_600));
      assert.ok(!lease.lost, String(lease.lostReason));
    });
    const at = seen(proxy, "POST", "/renew").map((r) => r.at);
    assert.ok(at.length >= 2, `${at.length} renewals`);
    // Answered after 0.7 s each: a period counted from the answer would put 1.7 s between them.
    assert.ok(at[1] - at[0] < 1_300, `${Math.round(at[1] - at[0])} ms between the first two renewals`);
  } finally {
    await proxy.close();
  }
});

test("a watch that cannot open gives up within `within`, not after the silence limit", async () => {
  const silent = await silentServer();
  try {
    const started = performance.now();
    const events = new LockClient({ url: silent.url }).watch({ within: 2 });
    const error = await rejection(events.next(), 15_000);
    assert.ok(error instanceof UnavailableError, String(error));
    assert.ok(performance.now() - started < 5_000, `${Math.round(performance.now() - started)} ms`);
  } finally {
    await silent.close();
  }
});

test("an answer larger than the client reads is an ApiError, read once", async () => {
  const fake = await fakeServer((_, response) => {
    response.writeHead(200, { "content-type": "application/json" });
    const chunk = Buffer.alloc(1024 * 1024, 0x20);
    let left = 40;
    const more = () => {
      while (left > 0) {
        left -= 1;
        if (!response.write(chunk)) return response.once("drain", more);
      }
      response.end("{}");
    };
    response.on("error", () => {});
    more();
  });
  try {
    const error = await within(rejection(new LockClient({ url: fake.url }).get(1)), 15_000);
    assert.ok(error instanceof ApiError, String(error));
    assert.match(error.message, /larger than/);
    assert.equal(fake.count, 1);
  } finally {
    await fake.close();
  }
});
