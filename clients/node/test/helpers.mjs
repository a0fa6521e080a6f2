// What the tests share: the service under test (named by environment variables), and proxies in
// front of it that lose an answer, answer 503, record what passed, or cut connections.
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import http from "node:http";
import net from "node:net";

import { LockClient } from "../dist/index.js";

/** The service the tests run against, as tests/system/test_node_client.py starts it. */
export const service = {
  url: required("HELIX_LOCKS_TEST_URL"),
  // An organization's key for "acme" (the tests' organization), and an admin key.
  apiKey: process.env.HELIX_LOCKS_TEST_API_KEY,
  adminKey: process.env.HELIX_LOCKS_TEST_ADMIN_KEY,
};

function required(name) {
  const value = process.env[name];
  if (!value) {
    throw new Error(
      `${name} is not set: run these tests with \`pytest tests/system/test_node_client.py\`, which starts` +
        " helix-locks serve, or see clients/node/README.md",
    );
  }
  return value;
}

export const ORG = "acme";

/** A job type of its own for each test, so that tests never meet on a key. */
export const jobType = (name) => `${name}-${randomUUID().slice(0, 8)}`;

export const client = (url = service.url, options = {}) => new LockClient({ url, apiKey: service.apiKey, ...options });

/** The service as an admin calls it, without the client: force, and a look at a lock. */
export async function admin(method, path) {
  const headers = service.adminKey ? { authorization: `Bearer ${service.adminKey}` } : {};
  const answer = await fetch(`${service.url}${path}`, { method, headers, signal: AbortSignal.timeout(10_000) });
  const text = await answer.text();
  return { status: answer.status, body: text ? JSON.parse(text) : null };
}

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** Milliseconds since the epoch of a time the service sent, to its microsecond (Date.parse keeps
 * milliseconds only). */
export function dbTime(text) {
  const [, whole, fraction = "", zone] = /^(.+T\d{2}:\d{2}:\d{2})(\.\d+)?(Z|[+-]\d{2}:\d{2})$/i.exec(text);
  return Date.parse(`${whole}${zone}`) + Number(`0${fraction}`) * 1000;
}

/**
 * The database's clock as the service reads it, from a held lock (`probe`, of a long lease): its
 * expires_at less its ttl_remaining_ms is the database's time when it answered, which came between
 * `sentAt` and `readAt` (performance.now()). `at(t)` bounds the database's time at an earlier
 * moment t of this process: no later than `db - (sentAt - t)`.
 */
export async function dbClock(locks, probe) {
  const sentAt = performance.now();
  const lock = await locks.get(probe.id);
  const readAt = performance.now();
  assert.ok(lock.state === "held" && lock.ttl_remaining_ms > 0, `the probe lock is held: ${JSON.stringify(lock)}`);
  const db = dbTime(lock.expires_at) - lock.ttl_remaining_ms;
  return { db, sentAt, readAt, atMost: (t) => db - (sentAt - t) };
}

/** Wall-clock milliseconds, with the monotonic clock's precision. */
export const wallNow = () => performance.timeOrigin + performance.now();

/**
 * An HTTP proxy in front of the service that forwards every request and relays its answer, but
 * plays a fault on the first request matching each of `faults`:
 * - `{ method, path, drop: true }`: forwards it, reads the service's answer, then closes the
 *   connection without answering (the request took effect; its answer was lost);
 * - `{ method, path, status: 503, retryAfter }`: forwards it, then answers 503 with that
 *   Retry-After in place of the service's answer;
 * - `{ method, path, delayMs }`: forwards it, and relays the service's answer that much later;
 * - `{ method, path, answer: { status, type, body } }`: forwards it, then answers that instead.
 * `seen` records every request: method, path, headers, arrival (performance.now()), and what its
 * client was told (a status, or "dropped"), with the service's own answer.
 */
export class FaultyProxy {
  constructor(target, faults = []) {
    this.target = new URL(target);
    this.faults = [...faults];
    this.seen = [];
    this.server = http.createServer((request, response) => this.#forward(request, response));
  }

  async start() {
    await new Promise((resolve) => this.server.listen(0, "127.0.0.1", resolve));
    this.url = `http://127.0.0.1:${this.server.address().port}`;
    return this;
  }

  async close() {
    this.server.closeAllConnections();
    await new Promise((resolve) => this.server.close(resolve));
  }

  async #forward(request, response) {
    const record = { method: request.method, path: request.url, headers: request.headers, at: performance.now() };
    this.seen.push(record);
    const chunks = [];
    for await (const chunk of request) chunks.push(chunk);
    const body = Buffer.concat(chunks);
    const answer = await new Promise((resolve, reject) => {
      const out = http.request(
        {
          host: this.target.hostname,
          port: this.target.port,
          method: request.method,
          path: request.url,
          headers: { ...request.headers, host: this.target.host },
        },
        (back) => {
          const parts = [];
          back.on("data", (part) => parts.push(part));
          back.on("end", () => resolve({ status: back.statusCode, headers: back.headers, body: Buffer.concat(parts) }));
          back.on("error", reject);
        },
      );
      out.on("error", reject);
      out.end(body);
    }).catch((error) => ({ status: 502, headers: {}, body: Buffer.from(String(error)) }));
    record.answered = { status: answer.status, body: answer.body.toString() };
    const index = this.faults.findIndex(
      (fault) => fault.method === request.method && request.url.startsWith(fault.path),
    );
    const fault = index === -1 ? null : this.faults.splice(index, 1)[0];
    if (fault?.drop) {
      record.told = "dropped";
      request.socket.destroy();
      return;
    }
    if (fault?.delayMs) {
      await sleep(fault.delayMs);
    } else if (fault?.answer) {
      record.told = fault.answer.status;
      response.writeHead(fault.answer.status, { "content-type": fault.answer.type });
      response.end(fault.answer.body);
      return;
    } else if (fault) {
      record.told = fault.status;
      const problem = JSON.stringify({ type: "urn:helix-locks:problem:database-unavailable", status: fault.status });
      response.writeHead(fault.status, {
        "content-type": "application/problem+json",
        "retry-after": String(fault.retryAfter),
      });
      response.end(problem);
      return;
    }
    record.told = answer.status;
    record.relayedAt = performance.now();
    const headers = {};
    for (const name of ["content-type", "retry-after", "location", "x-request-id"]) {
      if (answer.headers[name] !== undefined) headers[name] = answer.headers[name];
    }
    response.writeHead(answer.status, headers);
    response.end(answer.body);
  }
}

/** A TCP proxy in front of the service that a test can cut (every open connection dropped) and
 * shut (new connections closed at once). */
export class CuttableProxy {
  constructor(target) {
    this.target = new URL(target);
    this.shut = false;
    this.open = new Set();
    this.connections = 0;
    this.server = net.createServer((socket) => {
      if (this.shut) {
        socket.destroy();
        return;
      }
      this.connections += 1;
      const upstream = net.connect(Number(this.target.port), this.target.hostname);
      for (const [a, b] of [[socket, upstream], [upstream, socket]]) {
        this.open.add(a);
        a.on("error", () => b.destroy());
        a.on("close", () => {
          this.open.delete(a);
          b.destroy();
        });
      }
      socket.pipe(upstream);
      upstream.pipe(socket);
    });
  }

  async start() {
    await new Promise((resolve) => this.server.listen(0, "127.0.0.1", resolve));
    this.url = `http://127.0.0.1:${this.server.address().port}`;
    return this;
  }

  cut() {
    for (const socket of this.open) socket.destroy();
  }

  async close() {
    this.cut();
    await new Promise((resolve) => this.server.close(resolve));
  }
}

/** A port on which nothing listens (it did a moment ago). */
export async function freePort() {
  const server = net.createServer();
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  const { port } = server.address();
  await new Promise((resolve) => server.close(resolve));
  return port;
}

/** An HTTP server on its own that answers every request with `handler(request, response)`; `count`
 * is how many it got. */
export async function fakeServer(handler) {
  const server = http.createServer((request, response) => {
    fake.count += 1;
    request.resume();
    handler(request, response);
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  const fake = {
    count: 0,
    url: `http://127.0.0.1:${server.address().port}`,
    close: async () => {
      server.closeAllConnections();
      await new Promise((resolve) => server.close(resolve));
    },
  };
  return fake;
}

/** An HTTP server that takes requests and never answers them. */
export async function silentServer() {
  const sockets = new Set();
  const server = http.createServer(() => {});
  server.on("connection", (socket) => {
    sockets.add(socket);
    socket.on("close", () => sockets.delete(socket));
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  return {
    url: `http://127.0.0.1:${server.address().port}`,
    close: async () => {
      for (const socket of sockets) socket.destroy();
      await new Promise((resolve) => server.close(resolve));
    },
  };
}

/** Resolves with the promise's rejection; fails if it resolves, or does not settle within `ms`. */
export async function rejection(promise, ms = 20_000) {
  const outcome = await within(
    promise.then((value) => ({ value }), (error) => ({ error })),
    ms,
  );
  if (!("error" in outcome)) throw new Error(`resolved with ${JSON.stringify(outcome.value)}, not rejected`);
  return outcome.error;
}

/** Resolves with the promise's value, or fails after `ms`. */
export async function within(promise, ms = 20_000, what = "the promise") {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what} did not settle within ${ms} ms`)), ms);
  });
  try {
    return await Promise.race([promise, timeout]);
  } finally {
    clearTimeout(timer);
  }
}
