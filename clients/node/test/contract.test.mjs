// The Node client keeps clients/contract.json, which the Python SDK's tests read too: which answers
// a request retries and how long it pauses, which end a held lock, how Retry-After reads, what an
// ApiError carries, and every text/event-stream case through the client's parser. Against a small
// real HTTP server that answers what each test scripts; no service needed.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import http from "node:http";
import { test } from "node:test";

import {
  ApiError,
  EventStreamDecoder,
  LockClient,
  LockHeldError,
  LockLostError,
  UnavailableError,
} from "../dist/index.js";
import { backoffMs, GONE, RETRIED, retryAfterSeconds, UNKNOWN_OUTCOME, WATCH_RETRIED } from "../dist/retry.js";

const contract = JSON.parse(readFileSync(new URL("../../contract.json", import.meta.url), "utf8"));
const requests = contract.requests;
const retried = new Set(requests.retry_statuses);
const unknownOutcome = new Set(requests.unknown_outcome_statuses);
const gone = new Set(requests.lock_gone_statuses);
// Every status the contract names, and others a service or a proxy may answer that it does not.
const statuses = [...new Set([...retried, ...unknownOutcome, ...gone, 400, 401, 408, 409, 413, 422, 500, 501, 505])].sort();
// A 409 lock-held's body, and a grant's.
const held = { type: "urn:helix-locks:problem:lock-held", holder: "w", expires_at: "soon" };
const granted = { id: 7, organization_id: "acme", job_type: "report", holder: "w", fencing_token: 3, token: "t" };

/**
 * An HTTP server that answers each request with the next of `answers` ({ status, headers, body },
 * body a problem's fields; or { status, headers, text }, sent as it is), and with `then` once they
 * have run out; `seen` records every request.
 */
async function scripted(answers, then = { status: 200, body: { id: 1, ok: true } }) {
  const script = { answers: [...answers], seen: [] };
  const server = http.createServer((request, response) => {
    request.resume();
    request.on("end", () => {
      script.seen.push({ method: request.method, path: request.url, headers: request.headers, at: performance.now() });
      const answer = script.answers.shift() ?? then;
      const body = answer.text ?? JSON.stringify({ status: answer.status, ...answer.body });
      response.writeHead(answer.status, {
        "content-type": "application/problem+json",
        "content-length": Buffer.byteLength(body),
        ...answer.headers,
      });
      response.end(body);
    });
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  script.url = `http://127.0.0.1:${server.address().port}`;
  script.client = new LockClient({ url: script.url });
  script.gaps = () => script.seen.slice(1).map((later, i) => (later.at - script.seen[i].at) / 1000);
  script.close = async () => {
    script.client.close?.();
    server.closeAllConnections();
    await new Promise((resolve) => server.close(resolve));
  };
  return script;
}

async function raised(promise) {
  try {
    await promise;
  } catch (error) {
    return error;
  }
  return null;
}

// --- requests ------------------------------------------------------------------------------------

test("a request is sent again after the retried statuses and no others", async () => {
  for (const status of statuses) {
    const server = await scripted([{ status, headers: { "retry-after": "0" } }]);
    try {
      const error = await raised(server.client.get(1));
      if (retried.has(status)) {
        assert.equal(error, null, `${status} was not retried: ${error}`);
        assert.equal(server.seen.length, 2);
      } else {
        assert.ok(error !== null, `${status} was taken for a success`);
        assert.equal(server.seen.length, 1, `${status} was retried`);
      }
    } finally {
      await server.close();
    }
  }
});

test("a request that is not idempotent is sent again only when the service surely did nothing", async () => {
  // No request the client sends is of this kind (an acquire carries an Idempotency-Key): the rule
  // is checked on the method that sends them all, with a POST that carries none.
  for (const status of retried) {
    const server = await scripted([{ status, headers: { "retry-after": "0" } }]);
    try {
      const error = await raised(server.client._send("POST", "/v1/anything", { body: () => ({}), withinMs: 1000 }));
      if (unknownOutcome.has(status)) {
        assert.ok(error instanceof UnavailableError, String(error));
        assert.equal(server.seen.length, 1, `a POST that may have taken effect was sent again after ${status}`);
      } else {
        assert.equal(error, null, String(error));
        assert.equal(server.seen.length, 2);
      }
    } finally {
      await server.close();
    }
  }
});

test("an acquire carries one Idempotency-Key and so is retried", async () => {
  const answers = [...retried].map((status) => ({ status, headers: { "retry-after": "0" } }));
  const server = await scripted(answers, { status: 201, body: granted });
  try {
    const grant = await server.client.acquire({ organizationId: "acme", jobType: "report", ttl: 30 });
    assert.equal(grant.id, 7);
    assert.equal(server.seen.length, retried.size + 1);
    const keys = new Set(server.seen.map((seen) => seen.headers["idempotency-key"]));
    assert.ok(keys.size === 1 && !keys.has(undefined), "every attempt carries the same Idempotency-Key");
  } finally {
    await server.close();
  }
});

test("a waiting acquire asks again after the backoff, at most Retry-After", async () => {
  const waiting = requests.waiting_acquire;
  assert.ok(waiting.pause === "backoff" && waiting.at_most_retry_after);
  const server = await scripted(Array(4).fill({ status: 409, headers: { "retry-after": "0.1" }, body: held }), {
    status: 201,
    body: granted,
  });
  try {
    const grant = await server.client.acquire({ organizationId: "acme", jobType: "report", ttl: 30, wait: 10 });
    assert.equal(grant.id, 7);
    server.gaps().forEach((gap, attempt) => {
      const expected = Math.min(backoffMs(attempt) / 1000, 0.1);
      assert.ok(gap >= expected - 0.002 && gap < expected * 1.5 + 0.25, `pause ${attempt}: ${gap} s, not ${expected} s`);
    });
  } finally {
    await server.close();
  }
});

test("a waiting acquire asks again no later than its wait ends", async () => {
  assert.ok(requests.waiting_acquire.at_most_wait_left);
  const server = await scripted([], { status: 409, headers: { "retry-after": "5" }, body: held });
  try {
    const started = performance.now();
    const error = await raised(server.client.acquire({ organizationId: "acme", jobType: "report", ttl: 30, wait: 0.3 }));
    const took = (performance.now() - started) / 1000;
    assert.ok(error instanceof LockHeldError, String(error));
    assert.ok(took >= 0.3 - 0.002 && took < 0.8, `gave up after ${took} s of a 0.3 s wait`);
    assert.ok(server.seen.length >= 3, "asked again within the wait");
  } finally {
    await server.close();
  }
});

test("the lock-gone statuses lose a held lock, and 410 any request", async () => {
  for (const status of [...new Set([...gone, 400, 409, 422])]) {
    const server = await scripted([{ status }, { status }]);
    try {
      const renewal = await raised(server.client.renew({ id: 1, token: "t", ttl: 30 }, { within: 1 }));
      const read = await raised(server.client.get(1));
      assert.equal(renewal instanceof LockLostError, gone.has(status), `${status}: ${renewal}`);
      assert.equal(read instanceof LockLostError, status === 410, `${status}: ${read}`);
      assert.equal(server.seen.length, 2);
    } finally {
      await server.close();
    }
  }
});

const expectedPause = (attempt) => {
  const { initial_s: initial, max_s: max, multiplier } = requests.backoff;
  return Math.min(max, initial * multiplier ** attempt);
};

test("the backoff is the contract's", () => {
  assert.equal(requests.backoff.jitter, 0, "the client does not jitter: a contract that does needs it here too");
  for (let attempt = 0; attempt < 12; attempt++) {
    assert.ok(Math.abs(backoffMs(attempt) / 1000 - expectedPause(attempt)) < 1e-9, `attempt ${attempt}`);
  }
});

test("a request pauses as the backoff says between attempts", async () => {
  const failures = 4;
  const server = await scripted(Array(failures).fill({ status: 503 }));
  try {
    await server.client.get(1);
    assert.equal(server.seen.length, failures + 1);
    server.gaps().forEach((gap, attempt) => {
      const expected = expectedPause(attempt);
      // A timer may fire a millisecond early by the wall clock: the lower bound allows that much.
      assert.ok(gap >= expected - 0.002 && gap < expected * 1.5 + 0.25, `pause ${attempt}: ${gap} s, not ${expected} s`);
    });
  } finally {
    await server.close();
  }
});

test("Retry-After is honoured in place of the backoff", async () => {
  assert.equal(requests.honours_retry_after, true);
  for (const [status, seconds] of [
    [503, "1"],
    [429, "0.5"],
  ]) {
    const server = await scripted([{ status, headers: { "retry-after": seconds } }]);
    try {
      await server.client.get(1);
      const [gap] = server.gaps();
      assert.ok(gap >= Number(seconds) - 0.002 && gap < Number(seconds) + 0.5, `${status}: ${gap} s`);
    } finally {
      await server.close();
    }
  }
});

test("Retry-After reads as the contract says, and an ApiError carries it with the request id", async () => {
  const server = await scripted([]);
  try {
    for (const { header, seconds } of requests.retry_after.cases) {
      assert.equal(retryAfterSeconds(header), seconds, JSON.stringify(header));
      server.answers.push({ status: 422, headers: { "retry-after": header, "x-request-id": "r-1" } });
      const error = await raised(server.client.get(1));
      assert.ok(error instanceof ApiError, String(error));
      assert.deepEqual([error.status, error.requestId, error.retryAfter], [422, "r-1", seconds], JSON.stringify(header));
    }
  } finally {
    await server.close();
  }
});

test("once the time runs out a 429 is its ApiError, and the others UnavailableError", async () => {
  for (const status of retried) {
    const refusal = { status, headers: { "retry-after": "0.1", "x-request-id": "r-2" }, body: { detail: "busy" } };
    const server = await scripted([], refusal);
    try {
      const started = performance.now();
      const error = await raised(server.client.renew({ id: 1, token: "t", ttl: 30 }, { within: 0.5 }));
      assert.ok(server.seen.length > 2, "retried until the time ran out");
      assert.ok(performance.now() - started < 2000);
      if (unknownOutcome.has(status)) {
        assert.ok(error instanceof UnavailableError && error.message.includes(`answered ${status}`), String(error));
        assert.deepEqual([error.status, error.problem], [status, { status, detail: "busy" }]);
      } else {
        assert.ok(error instanceof ApiError, String(error));
        assert.deepEqual([error.status, error.requestId, error.retryAfter], [status, "r-2", 0.1]);
      }
    } finally {
      await server.close();
    }
  }
});

test("an ApiError and a LockHeldError carry the request id", async () => {
  const server = await scripted([
    { status: 401, headers: { "x-request-id": "r-3" }, body: { detail: "no key" } },
    { status: 409, headers: { "x-request-id": "r-4", "retry-after": "3" }, body: held },
  ]);
  try {
    const refused = await raised(server.client.get(1));
    const busy = await raised(server.client.acquire({ organizationId: "acme", jobType: "report" }));
    assert.ok(refused instanceof ApiError);
    assert.deepEqual([refused.status, refused.requestId, refused.retryAfter], [401, "r-3", null]);
    assert.equal(refused.problem.detail, "no key");
    assert.ok(busy instanceof LockHeldError);
    assert.deepEqual([busy.requestId, busy.retryAfter], ["r-4", 3]);
  } finally {
    await server.close();
  }
});

test("a watch opens its stream again after the contract's statuses and no others", async () => {
  for (const status of [...new Set([...contract.events.retry_statuses, 400, 401, 403, 404, 409, 410, 422, 500, 501])]) {
    const server = await scripted([
      { status, headers: { "retry-after": "0", "x-request-id": "r-1" } },
      { status: 401, body: { type: "urn:helix-locks:problem:unauthenticated" } },
    ]);
    try {
      const events = [];
      const error = await raised(
        (async () => {
          for await (const event of server.client.watch({ within: 5 })) events.push(event);
        })(),
      );
      assert.deepEqual(events, []);
      assert.ok(error instanceof ApiError, `${status}: ${error}`);
      if (contract.events.retry_statuses.includes(status)) {
        assert.deepEqual([error.status, server.seen.length], [401, 2], `${status} did not open the stream again`);
      } else {
        assert.deepEqual([error.status, server.seen.length], [status, 1], `${status} opened the stream again`);
        assert.deepEqual([error.requestId, error.retryAfter], ["r-1", 0]);
      }
    } finally {
      await server.close();
    }
  }
});

test("an empty last event id is not sent", async () => {
  assert.equal(contract.events.sends_empty_last_event_id, false);
  const stream = { "content-type": "text/event-stream", "retry-after": "0" };
  const server = await scripted([
    { status: 200, headers: stream, text: 'id: 5\ndata: {"type": "acquired"}\n\nid\n\n' },
    { status: 401, body: { type: "urn:helix-locks:problem:unauthenticated" } },
  ]);
  try {
    const events = [];
    const error = await raised(
      (async () => {
        for await (const event of server.client.watch({ lastEventId: "4", within: 5 })) events.push(event);
      })(),
    );
    assert.deepEqual(
      events.map((event) => event.id),
      ["5"],
    );
    assert.ok(error instanceof ApiError && error.status === 401, String(error));
    assert.deepEqual(
      server.seen.map((seen) => seen.headers["last-event-id"]),
      ["4", undefined],
    );
  } finally {
    await server.close();
  }
});

test("the client's sets are the contract's", () => {
  // What the tests above cannot tell apart from the sets themselves.
  assert.deepEqual([...RETRIED].sort(), [...retried].sort());
  assert.deepEqual([...UNKNOWN_OUTCOME].sort(), [...unknownOutcome].sort());
  assert.deepEqual([...GONE].sort(), [...gone].sort());
  assert.deepEqual([...WATCH_RETRIED].sort(), [...contract.events.retry_statuses].sort());
});

// --- text/event-stream ---------------------------------------------------------------------------

/** Each piece fed as it comes; every event with the reconnection time in force once it was fed. */
function parse(pieces) {
  const decoder = new EventStreamDecoder();
  const events = [];
  for (const piece of pieces) {
    for (const sent of decoder.feed(piece)) {
      events.push({ id: sent.id, event: sent.event, data: sent.data, retry: decoder.retry });
    }
  }
  return { events, decoder };
}

for (const testCase of contract.sse) {
  test(`event stream: ${testCase.name}`, () => {
    // The chunks as text, as bytes, and the whole stream a byte at a time: a piece may complete an
    // event and then set a retry, so an event's own reconnection time is checked on the last.
    const whole = Buffer.from(testCase.chunks.join(""), "utf8");
    const passes = [
      [testCase.chunks, false],
      [testCase.chunks.map((chunk) => Buffer.from(chunk, "utf8")), false],
      [[...whole].map((byte) => Uint8Array.of(byte)), true],
    ];
    for (const [pieces, bytewise] of passes) {
      const { events, decoder } = parse(pieces);
      const unretried = (list) => list.map((event) => ({ ...event, retry: null }));
      assert.deepEqual(
        bytewise ? events : unretried(events),
        bytewise ? testCase.events : unretried(testCase.events),
        `${testCase.name}, in pieces ${JSON.stringify(pieces.map(String))}`,
      );
      assert.deepEqual([decoder.retry, decoder.lastEventId], [testCase.retry, testCase.last_event_id]);
    }
  });
}
