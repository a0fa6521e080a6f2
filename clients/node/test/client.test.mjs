// The client's calls, its errors, semaphores and the event stream, against a real service.
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  ApiError,
  EventStreamDecoder,
  Grant,
  HelixLocksError,
  LockClient,
  LockHeldError,
  LockLostError,
  MaxHoldersMismatchError,
  UnavailableError,
} from "../dist/index.js";
import { CuttableProxy, ORG, client, freePort, jobType, rejection, service, sleep, within } from "./helpers.mjs";

test("withLock renews past its ttl, hands over the lease, and releases at the end", async () => {
  const locks = client();
  const job = jobType("renews");
  let seen;
  const result = await locks.withLock({ organizationId: ORG, jobType: job, ttl: 1.5, metadata: { run: 1 } }, async (lease) => {
    seen = lease;
    const first = lease.lock.expires_at;
    for (let i = 0; i < 20; i++) {
      // 2 s: longer than the lease, renewed every third of one
      await sleep(100);
      lease.check();
      assert.equal(lease.signal.aborted, false);
    }
    assert.ok(lease.lock.expires_at > first, "renewed: the latest lock object has a later expiry");
    const current = await locks.current({ organizationId: ORG, jobType: job });
    assert.equal(current.id, lease.id);
    assert.equal(current.fencing_token, lease.fencingToken);
    assert.deepEqual(current.metadata, { run: 1 });
    assert.deepEqual((await lease.update({ done: 40, of: 100 })).metadata, { done: 40, of: 100 });
    assert.deepEqual(lease.lock.metadata, { done: 40, of: 100 });
    assert.equal(lease.slot, 0);
    assert.equal(lease.maxHolders, 1);
    return "done";
  });
  assert.equal(result, "done");
  assert.equal(await locks.current({ organizationId: ORG, jobType: job }), null, "released at the end");
  const ended = await locks.get(seen.id);
  assert.equal(ended.release_reason, "released");
  // The lease's signal tells a task that outlived the callback that the lock is no longer held.
  assert.equal(seen.signal.aborted, true);
  assert.ok(seen.signal.reason instanceof LockLostError);
});

test("withLock passes the callback's own error through, after releasing", async () => {
  const locks = client();
  const job = jobType("fails");
  const error = await rejection(
    locks.withLock({ organizationId: ORG, jobType: job, ttl: 5 }, async () => {
      throw new RangeError("the work failed");
    }),
  );
  assert.ok(error instanceof RangeError);
  assert.equal(await locks.current({ organizationId: ORG, jobType: job }), null);
  // A callback that is not async, throwing at once: a rejection all the same, after the release.
  const thrown = await rejection(
    locks.withLock({ organizationId: ORG, jobType: job, ttl: 5 }, () => {
      throw new SyntaxError("at once");
    }),
  );
  assert.ok(thrown instanceof SyntaxError);
  assert.equal(await locks.current({ organizationId: ORG, jobType: job }), null);
  assert.equal(await locks.withLock({ organizationId: ORG, jobType: job, ttl: 5 }, (lease) => lease.slot + 7), 7);
});

test("acquire, renew, update, get, current, list and release", async () => {
  const locks = client();
  const job = jobType("calls");
  const grant = await locks.acquire({ organizationId: ORG, jobType: job, ttl: 30, holder: "calls-test" });
  assert.ok(grant instanceof Grant);
  assert.equal(grant.holder, "calls-test");
  assert.match(grant.token, /^[0-9a-f]{32}$/);
  assert.equal(JSON.stringify(grant).includes(grant.token), false, "a serialized grant hides its token");
  assert.equal(grant.reclaimed, null);
  const renewed = await locks.renew(grant, { ttl: 60 });
  assert.equal(renewed.lapsed, false);
  assert.ok(renewed.ttl_remaining_ms > 30_000);
  assert.deepEqual((await locks.update(grant, { step: 2 })).metadata, { step: 2 });
  assert.deepEqual((await locks.get(grant.id)).metadata, { step: 2 });
  assert.equal((await locks.current({ organizationId: ORG, jobType: job })).id, grant.id);
  assert.equal((await locks.current({ organizationId: ORG, jobType: job, slot: 0 })).id, grant.id);
  await locks.release(grant);
  // A release repeated (as after a lost answer) finds the lock released by its own token: done.
  await locks.release(grant);
  const late = await rejection(locks.renew(grant));
  assert.ok(late instanceof LockLostError && late.status === 410 && late.releasedByItsToken, String(late));
  assert.equal(await locks.current({ organizationId: ORG, jobType: job }), null);

  // A listing, followed page by page and lock by lock.
  const listed = jobType("listed");
  const ids = [];
  for (let n = 0; n < 5; n++) {
    const held = await locks.acquire({ organizationId: ORG, jobType: `${listed}-${n}`, ttl: 30 });
    ids.push(held.id);
  }
  const pages = [];
  for await (const page of locks.list({ organizationId: ORG, state: "held", limit: 2 }).pages()) pages.push(page);
  assert.ok(pages.length >= 3, `${pages.length} pages of at most 2`);
  assert.ok(pages.every((page) => page.items.length <= 2));
  const items = [];
  for await (const lock of locks.list({ organizationId: ORG, state: "held", limit: 2 })) items.push(lock.id);
  assert.deepEqual(
    items.filter((id) => ids.includes(id)).sort((a, b) => a - b),
    [...ids].sort((a, b) => a - b),
  );
  assert.deepEqual(pages.flatMap((page) => page.items.map((lock) => lock.id)), items);
});

test("queue lists the waiters in order, and an acquire that does not wait is told they come first", async () => {
  const locks = client();
  const job = jobType("queued");
  const held = await locks.acquire({ organizationId: ORG, jobType: job, ttl: 60, holder: "holder" });
  const waiting = locks.acquire({ organizationId: ORG, jobType: job, ttl: 30, holder: "node-waiter", wait: 30 });
  for (let tries = 0; (await locks.queue({ organizationId: ORG, jobType: job })).items.length === 0; tries++) {
    assert.ok(tries < 1000, "the waiter never took its place");
    await sleep(20);
  }
  const page = await locks.queue({ organizationId: ORG, jobType: job, limit: 10 });
  assert.deepEqual(page.items.map((place) => [place.holder, place.position, place.mode]), [["node-waiter", 1, "exclusive"]]);
  assert.equal(page.next_cursor, null);
  const jumper = await rejection(locks.acquire({ organizationId: ORG, jobType: job, ttl: 30 }));
  assert.ok(jumper instanceof LockHeldError && jumper.kind === "waiters-ahead", String(jumper));
  assert.equal(jumper.waiting, 1);
  assert.ok(jumper.retryAfter > 1, "the key is held: Retry-After counts down to its lease");
  await locks.release(held);
  const granted = await waiting;
  assert.equal(granted.holder, "node-waiter");
  assert.equal(granted.fencingToken, held.fencingToken + 1);
  await locks.release(granted);
  assert.deepEqual(await locks.queue({ organizationId: ORG, jobType: job }), { items: [], next_cursor: null });
});

test("a semaphore of two: two withLock at once get slots 0 and 1, a third is told both holders", async () => {
  const locks = client();
  const job = jobType("semaphore");
  const inside = [];
  let release;
  const bothIn = new Promise((resolve) => {
    release = resolve;
  });
  // Neither holder lets go before both third acquires are answered: on a loaded machine one
  // holder's release came before the other's third acquire, which was then granted the free slot.
  let tried = 0;
  let bothTriedResolve;
  const bothTried = new Promise((resolve) => {
    bothTriedResolve = resolve;
  });
  const hold = (holder) =>
    locks.withLock({ organizationId: ORG, jobType: job, ttl: 10, maxHolders: 2, holder }, async (lease) => {
      inside.push(lease);
      if (inside.length === 2) release();
      await within(bothIn, 10_000, "the other holder");
      const third = await rejection(locks.acquire({ organizationId: ORG, jobType: job, maxHolders: 2 }));
      if (++tried === 2) bothTriedResolve();
      await within(bothTried, 10_000, "the other holder's third acquire");
      assert.ok(third instanceof LockHeldError, String(third));
      return { slot: lease.slot, token: lease.fencingToken, third };
    });
  const [a, b] = await within(Promise.all([hold("sem-a"), hold("sem-b")]), 20_000, "both holders");
  assert.deepEqual([a.slot, b.slot].sort(), [0, 1]);
  assert.notEqual(a.token, b.token);
  const third = a.third;
  assert.equal(third.maxHolders, 2);
  assert.equal(third.holders.length, 2);
  assert.deepEqual(third.holders.map((h) => h.slot).sort(), [0, 1]);
  assert.deepEqual(third.holders.map((h) => h.holder).sort(), ["sem-a", "sem-b"]);
  assert.ok(third.retryAfter >= 1);
  assert.equal(await locks.current({ organizationId: ORG, jobType: job }), null, "both slots released");

  // Another max_holders while the key is held: a configuration error, not waited for.
  const held = await locks.acquire({ organizationId: ORG, jobType: job, maxHolders: 3, ttl: 30 });
  const started = performance.now();
  const mismatch = await rejection(locks.acquire({ organizationId: ORG, jobType: job, maxHolders: 2, wait: 20 }));
  assert.ok(mismatch instanceof MaxHoldersMismatchError && mismatch instanceof ApiError, String(mismatch));
  assert.equal(mismatch.maxHolders, 3);
  assert.equal(mismatch.status, 409);
  assert.ok(performance.now() - started < 5000, "not waited for");
  await locks.release(held);
});

test("shared locks: two readers hold the key together, a writer is told so, and readers queue behind a waiting writer", async () => {
  const locks = client();
  const job = jobType("shared");
  const key = { organizationId: ORG, jobType: job };
  const first = await locks.acquire({ ...key, ttl: 30, mode: "shared", holder: "reader-1" });
  const second = await locks.acquire({ ...key, ttl: 30, mode: "shared", holder: "reader-2" });
  for (const reader of [first, second]) {
    assert.equal(reader.mode, "shared");
    assert.equal(reader.lock.mode, "shared");
    assert.equal(reader.maxHolders, 1);
  }
  assert.notEqual(first.id, second.id);
  assert.notEqual(first.token, second.token, "each reader has a lock of its own");
  assert.ok(second.fencingToken > first.fencingToken);
  assert.equal((await locks.get(first.id)).mode, "shared");
  assert.equal((await locks.renew(second, { ttl: 40 })).mode, "shared");
  // A third reader, through withLock: held beside the other two.
  const third = await locks.withLock({ ...key, ttl: 5, mode: "shared" }, (lease) => [lease.mode, lease.lock.mode]);
  assert.deepEqual(third, ["shared", "shared"]);

  // A writer meets the readers: LockHeldError with their mode, and both of them.
  const writer = await rejection(locks.acquire({ ...key, ttl: 30, holder: "writer" }));
  assert.ok(writer instanceof LockHeldError && writer.kind === "lock-held", String(writer));
  assert.equal(writer.mode, "shared");
  assert.equal(writer.holdersTotal, 2);
  assert.deepEqual(writer.holders.map((h) => h.holder).sort(), ["reader-1", "reader-2"]);
  assert.equal(writer.lockId, first.id, "the lease that ends first");
  // A reader never has more than one holder per lock: a semaphore of readers is bad input.
  const semaphore = await rejection(locks.acquire({ ...key, mode: "shared", maxHolders: 2 }));
  assert.ok(semaphore instanceof ApiError && semaphore.status === 422, String(semaphore));
  assert.ok(semaphore.errors.some((e) => e.field === "mode"), JSON.stringify(semaphore.errors));

  // Writers first: while a writer waits, a new reader does not pass it.
  const waitingWriter = locks.acquire({ ...key, ttl: 30, holder: "writer", wait: 30 });
  for (let tries = 0; (await locks.queue(key)).items.length === 0; tries++) {
    assert.ok(tries < 1000, "the writer never took its place");
    await sleep(20);
  }
  const late = await rejection(locks.acquire({ ...key, ttl: 30, mode: "shared" }));
  assert.ok(late instanceof LockHeldError && late.kind === "waiters-ahead", String(late));
  const lateReader = locks.acquire({ ...key, ttl: 30, mode: "shared", holder: "late-reader", wait: 30 });
  for (let tries = 0; (await locks.queue(key)).items.length < 2; tries++) {
    assert.ok(tries < 1000, "the late reader never took its place");
    await sleep(20);
  }
  const places = (await locks.queue(key)).items;
  assert.deepEqual(places.map((place) => [place.holder, place.position, place.mode]), [
    ["writer", 1, "exclusive"],
    ["late-reader", 2, "shared"],
  ]);
  await locks.release(first);
  await locks.release(second);
  const written = await within(waitingWriter, 20_000, "the writer, once the readers were gone");
  assert.equal(written.mode, "exclusive");
  assert.equal(written.lock.mode, "exclusive");
  assert.equal((await locks.current(key)).mode, "exclusive");
  await locks.release(written);
  const read = await within(lateReader, 20_000, "the late reader, once the writer was done");
  assert.equal(read.mode, "shared");
  assert.ok(read.fencingToken > written.fencingToken);
  await locks.release(read);
  assert.equal(await locks.current(key), null);
});

test("a session holds the job types named in shared as shared locks, and the others exclusive", async () => {
  const locks = client();
  const dataset = jobType("dataset");
  const log = jobType("log");
  const index = jobType("index");
  const reader = await locks.acquire({ organizationId: ORG, jobType: dataset, ttl: 30, mode: "shared" });
  // shared names only job types the call asks for: a TypeError, before any request.
  const stray = await rejection(locks.openSession({ organizationId: ORG, jobTypes: [log], shared: [dataset] }));
  assert.ok(stray instanceof TypeError, String(stray));
  const seen = await locks.withSession(
    { organizationId: ORG, jobTypes: [dataset, log], shared: [dataset], ttl: 10, holder: "session" },
    async (session) => {
      assert.equal(session.locks[dataset].mode, "shared");
      assert.equal(session.locks[log].mode, "exclusive");
      assert.deepEqual(
        session.session.locks.map((lock) => [lock.job_type, lock.mode]).sort(),
        [
          [dataset, "shared"],
          [log, "exclusive"],
        ].sort(),
      );
      // Beside the reader from before, and beside another one.
      const another = await locks.acquire({ organizationId: ORG, jobType: dataset, ttl: 30, mode: "shared" });
      assert.equal(another.mode, "shared");
      await locks.release(another);
      const writer = await rejection(locks.acquire({ organizationId: ORG, jobType: dataset }));
      assert.ok(writer instanceof LockHeldError, String(writer));
      assert.equal(writer.mode, "shared");
      assert.equal(writer.holdersTotal, 2, "the reader and the session's lock");
      const logged = await rejection(locks.acquire({ organizationId: ORG, jobType: log, mode: "shared" }));
      assert.ok(logged instanceof LockHeldError, String(logged));
      assert.equal(logged.mode, "exclusive");
      // Another session that wants the dataset exclusively: told the readers' mode and the pair.
      const rival = await rejection(locks.openSession({ organizationId: ORG, jobTypes: [dataset] }));
      assert.ok(rival instanceof LockHeldError, String(rival));
      assert.equal(rival.mode, "shared");
      assert.equal(rival.jobType, dataset);
      const added = await locks.addSessionLocks(session, { jobTypes: [index], shared: [index] });
      assert.deepEqual(
        added.map((lock) => [lock.job_type, lock.mode]),
        [[index, "shared"]],
      );
      assert.equal(session.locks[index].mode, "shared");
      return (await locks.getSession(session.id)).locks.map((lock) => lock.mode).sort();
    },
  );
  assert.deepEqual(seen, ["exclusive", "shared", "shared"]);
  for (const job of [log, index]) assert.equal(await locks.current({ organizationId: ORG, jobType: job }), null);
  assert.equal((await locks.current({ organizationId: ORG, jobType: dataset })).id, reader.id, "the reader stays");
  await locks.release(reader);
});

test("bad input gets typed errors with the problem's fields, never an unhandled rejection", async () => {
  const unhandled = [];
  const onUnhandled = (reason) => unhandled.push(reason);
  process.on("unhandledRejection", onUnhandled);
  try {
    const locks = client();
    const job = jobType("bad");
    const invalid = async (promise, field) => {
      const error = await rejection(promise);
      assert.ok(error instanceof ApiError, `${field}: ${error}`);
      assert.equal(error.status, 422);
      assert.equal(error.kind, "invalid-request");
      assert.equal(error.problem.type, "urn:helix-locks:problem:invalid-request");
      assert.ok(
        error.errors.some((e) => e.field === field),
        `${field} not among ${JSON.stringify(error.errors)}`,
      );
      assert.ok(error.requestId, "the answer's X-Request-Id");
      return error;
    };
    await invalid(locks.acquire({ organizationId: "not an id", jobType: job }), "organization_id");
    await invalid(locks.acquire({ organizationId: ORG, jobType: job, ttl: 0 }), "ttl_seconds");
    await invalid(locks.acquire({ organizationId: ORG, jobType: job, ttl: "30" }), "ttl_seconds");
    await invalid(locks.acquire({ organizationId: ORG, jobType: job, wait: -1 }), "wait_seconds");
    await invalid(locks.acquire({ organizationId: ORG, jobType: job, maxHolders: 1001 }), "max_holders");
    await invalid(locks.acquire({ organizationId: ORG, jobType: job, metadata: { big: "x".repeat(9000) } }), "metadata");
    await invalid(locks.acquire({ organizationId: ORG }), "job_type");
    await invalid(locks.current({ organizationId: ORG, jobType: job, slot: 1000 }), "slot");
    await invalid(locks.list({ limit: 501 }).pages().next(), "limit");
    let called = false;
    await invalid(
      locks.withLock({ organizationId: ORG, jobType: job, ttl: -1 }, async () => {
        called = true;
      }),
      "ttl_seconds",
    );
    assert.equal(called, false, "the callback never runs without the lock");

    // A lock that is not there, or not ours.
    const missing = await rejection(locks.get(0));
    assert.ok(missing instanceof ApiError && missing.status === 404 && missing.kind === "lock-not-found");
    const grant = await locks.acquire({ organizationId: ORG, jobType: job, ttl: 30 });
    const wrongToken = await rejection(locks.renew({ id: grant.id, token: "0".repeat(32) }));
    assert.ok(wrongToken instanceof LockLostError && wrongToken.status === 403, String(wrongToken));
    assert.equal(wrongToken.problem.type, "urn:helix-locks:problem:token-mismatch");

    // Held: LockHeldError names the holder, when it expires and when to try again.
    const held = await rejection(locks.acquire({ organizationId: ORG, jobType: job, holder: "rival" }));
    assert.ok(held instanceof LockHeldError && held instanceof ApiError && held instanceof HelixLocksError);
    assert.equal(held.lockId, grant.id);
    assert.equal(held.holder, grant.holder);
    assert.equal(held.expiresAt, grant.lock.expires_at);
    assert.ok(held.retryAfter >= 1 && held.retryAfter <= 30, String(held.retryAfter));
    assert.deepEqual(held.holders, [{ lock_id: grant.id, holder: grant.holder, slot: 0, expires_at: grant.lock.expires_at }]);
    await locks.release(grant);
    const ended = await rejection(locks.update(grant, { late: true }));
    assert.ok(ended instanceof LockLostError && ended.status === 410);
    assert.equal(ended.problem.release_reason, "released");

    if (service.apiKey) {
      // Another organization, and a key the service does not know.
      const elsewhere = await rejection(locks.acquire({ organizationId: "globex", jobType: job }));
      assert.ok(elsewhere instanceof ApiError && elsewhere.status === 403 && elsewhere.kind === "forbidden");
      const stranger = new LockClient({ url: service.url, apiKey: "hlk_not-a-key" });
      const unknown = await rejection(stranger.acquire({ organizationId: ORG, jobType: job }));
      assert.ok(unknown instanceof ApiError && unknown.status === 401 && unknown.kind === "unauthenticated");
    }

    // Nothing listens there: said at once.
    const nowhere = new LockClient({ url: `http://127.0.0.1:${await freePort()}`, apiKey: "hlk_x" });
    const started = performance.now();
    const unreachable = await rejection(nowhere.acquire({ organizationId: ORG, jobType: job }));
    assert.ok(unreachable instanceof UnavailableError, String(unreachable));
    assert.match(unreachable.message, /refused the connection/);
    assert.ok(performance.now() - started < 3000, "a refused connection is said within about a second");
    const watched = await rejection(nowhere.watch({ organizationId: ORG }).next());
    assert.ok(watched instanceof UnavailableError, String(watched));

    await sleep(50);
  } finally {
    process.off("unhandledRejection", onUnhandled);
  }
  assert.deepEqual(unhandled, []);
});

test("the event decoder follows the standard", () => {
  const decoder = new EventStreamDecoder();
  const encoder = new TextEncoder();
  const events = [
    ...decoder.feed(encoder.encode("\ufeff: keep-alive\r\nid: 1\r")),
    ...decoder.feed(encoder.encode("\nevent: acquired\ndata: {\"a\":\ndata:1}\n\n")),
    ...decoder.feed("id: 2\0x\nretry: 1500\nretry: soon\ndata: x\r\n\r\n"),
    ...decoder.feed("data: \u00e9"),
  ];
  assert.deepEqual(events, [
    { event: "acquired", data: '{"a":\n1}', id: "1" },
    { event: "message", data: "x", id: "1" }, // an id holding NUL is ignored
  ]);
  assert.equal(decoder.retry, 1500);
  assert.equal(decoder.lastEventId, "1", "the unfinished event does not count");
  const split = new EventStreamDecoder("0");
  const bytes = encoder.encode("id: 7\ndata: \u00e9t\u00e9\n\n");
  const got = [...split.feed(bytes.slice(0, 13)), ...split.feed(bytes.slice(13))]; // é cut in two
  assert.deepEqual(got, [{ event: "message", data: "\u00e9t\u00e9", id: "7" }]);
});

test("watch hands over the events in order and resumes after a cut with Last-Event-ID", async () => {
  const locks = client();
  const job = jobType("watched");
  const proxy = await new CuttableProxy(service.url).start();
  const stop = new AbortController();
  const events = [];
  let wake = () => {};
  const watcher = (async () => {
    const watching = new LockClient({ url: proxy.url, apiKey: service.apiKey });
    for await (const event of watching.watch({ organizationId: ORG, jobType: job, signal: stop.signal, within: 10 })) {
      events.push(event);
      wake();
    }
  })();
  const until = async (predicate, what) => {
    const deadline = performance.now() + 10_000;
    while (!events.some(predicate)) {
      assert.ok(performance.now() < deadline, `no ${what} within 10 s: ${JSON.stringify(events.map((e) => e.type))}`);
      await Promise.race([new Promise((resolve) => (wake = resolve)), sleep(100)]);
    }
  };
  try {
    // The stream is surely open once a marker lock's release comes through.
    for (let tries = 0; ; tries++) {
      const marker = await locks.acquire({ organizationId: ORG, jobType: job, ttl: 5 });
      await locks.release(marker);
      try {
        await within(until((e) => e.type === "released" && e.lock.id === marker.id, "marker"), 1500);
        break;
      } catch (error) {
        if (tries > 10) throw error;
      }
    }
    const before = events.length;
    const grant = await locks.acquire({ organizationId: ORG, jobType: job, ttl: 30 });
    await until((e) => e.type === "acquired" && e.lock.id === grant.id, "acquired");
    proxy.shut = true;
    proxy.cut();
    // While the watcher is away: a change of a lock it has seen, and a new lock.
    await locks.release(grant);
    const second = await locks.acquire({ organizationId: ORG, jobType: job, ttl: 30 });
    await sleep(300);
    proxy.shut = false;
    await until((e) => e.type === "acquired" && e.lock.id === second.id, "the second acquired");
    await locks.release(second);
    await until((e) => e.type === "released" && e.lock.id === second.id, "the second released");
    // The release made while the watcher was away came: only a resume (Last-Event-ID) sends it.
    const kinds = events.slice(before).map((e) => [e.type, e.lock.id]);
    assert.deepEqual(kinds, [
      ["acquired", grant.id],
      ["released", grant.id],
      ["acquired", second.id],
      ["released", second.id],
    ]);
    const ids = events.map((e) => e.id);
    assert.equal(new Set(ids).size, ids.length, "nothing repeated");
    assert.ok(proxy.connections >= 2, "opened again after the cut");
    assert.ok(events.every((e) => !("token" in e.lock)));
  } finally {
    stop.abort();
    await within(watcher, 5000, "the watch, once its signal aborted");
    await proxy.close();
  }
});

test("a watch refused ends at once with the problem", async () => {
  const locks = client();
  const error = await rejection(locks.watch({ organizationId: ORG, lastEventId: "not-an-event-id" }).next(), 10_000);
  assert.ok(error instanceof ApiError, String(error));
  assert.equal(error.status, 422);
});
