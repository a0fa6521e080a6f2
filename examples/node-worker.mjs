#!/usr/bin/env node
// A Helix Locks worker in Node 20.3+ (built-in fetch, no packages). Each iteration takes the lock for
// one organization and job type (retrying while it is held), renews it in the background while it
// works, hands the fencing token to what it writes, and releases it.
// Usage: examples/node-worker.mjs [OUTPUT_FILE]
//   HELIX_LOCKS_URL (default http://127.0.0.1:8080), HELIX_LOCKS_API_KEY (sent as a Bearer token)
//   WORKER_ORG, WORKER_JOB_TYPE  the lock's key (default acme, nightly-report)
//   WORKER_TTL           lease in seconds, renewed every TTL/3 (default 30)
//   WORKER_ITERATIONS    how many times to take the lock and work (default 1)
//   WORKER_WORK_SECONDS  how long one piece of work takes (default 1)
//   WORKER_WAIT_SECONDS  how long to retry a held lock before giving up (default 60)
//   WORKER_MAX_HOLDERS   a semaphore: up to this many workers hold the key at once, each in a slot
//                        of its own (default 1: one at a time); all of them must give the same value
//   WORKER_HOLDER        holder name (default node-worker@HOSTNAME-PID)
//   OUTPUT_FILE or WORKER_OUTPUT  gets a line "fencing_token holder lock_id acquired_at slot" per
//                        piece of work, as a storage layer would (default worker-output.txt)
// Exit status, as `helix-locks run`'s: 0 done; 75 the lock stayed held past WORKER_WAIT_SECONDS;
// 69 the service could not be reached until then; 76 the lock was lost (410, or renewals failed until
// the lease was nearly over): the work was stopped at once and the lock not released; 1 unexpected
// answer; 2 bad configuration (max-holders-mismatch included: the key's holders share another
// WORKER_MAX_HOLDERS). SIGTERM/Ctrl-C stop the work and release the lock.
import { randomUUID } from "node:crypto";
import { appendFile } from "node:fs/promises";
import { hostname } from "node:os";
import { setTimeout as sleep } from "node:timers/promises";

const env = process.env;
const url = env.HELIX_LOCKS_URL ?? "http://127.0.0.1:8080";
const org = env.WORKER_ORG ?? "acme";
const jobType = env.WORKER_JOB_TYPE ?? "nightly-report";
const ttlMs = Number(env.WORKER_TTL ?? 30) * 1000;
const iterations = Number(env.WORKER_ITERATIONS ?? 1);
const workMs = Number(env.WORKER_WORK_SECONDS ?? 1) * 1000;
const waitMs = Number(env.WORKER_WAIT_SECONDS ?? 60) * 1000;
const maxHolders = Number(env.WORKER_MAX_HOLDERS ?? 1);
const holder = env.WORKER_HOLDER ?? `node-worker@${hostname()}-${process.pid}`;
const output = process.argv[2] ?? env.WORKER_OUTPUT ?? "worker-output.txt";
const renewEveryMs = Math.floor(ttlMs / 3);

const log = (message) => console.error(`${holder}: ${message}`);
class Exit extends Error { constructor(status, message) { super(message); this.status = status; } }

// One HTTP call. It never throws: no answer in time is status 0, worth retrying like a 503.
async function call(method, path, { token, idempotencyKey, body, timeoutMs = 10_000 } = {}) {
  const headers = { "content-type": "application/json" };
  if (env.HELIX_LOCKS_API_KEY) headers.authorization = `Bearer ${env.HELIX_LOCKS_API_KEY}`;
  if (token) headers["lock-token"] = token;
  if (idempotencyKey) headers["idempotency-key"] = idempotencyKey;
  try {
    const answer = await fetch(url + path, {
      method, headers, body: body && JSON.stringify(body), signal: AbortSignal.timeout(timeoutMs),
    });
    const text = await answer.text();
    const json = answer.headers.get("content-type")?.includes("json") ? JSON.parse(text) : {};
    return { status: answer.status, retryAfter: Number(answer.headers.get("retry-after")) || 1, text, json };
  } catch (error) {
    return { status: 0, retryAfter: 1, text: String(error), json: {} };
  }
}

async function acquire() {
  const body = {
    organization_id: org, job_type: jobType, holder, ttl_seconds: ttlMs / 1000, max_holders: maxHolders,
  };
  // One key for every try: a try whose answer was lost (or was 503) may have been granted, and
  // repeating the key gets that grant back instead of a 409 from our own lock.
  const idempotencyKey = randomUUID();
  const deadline = performance.now() + waitMs;
  for (let backoffMs = 100; ; backoffMs = Math.min(backoffMs * 2, 2000)) {
    const sent = performance.now();
    const answer = await call("POST", "/v1/locks", { body, idempotencyKey });
    // The lease counted from when we asked: it never ends later than the service's.
    if (answer.status === 201) return { ...answer.json, leaseEnd: sent + ttlMs };
    if (answer.status === 409 && answer.json.type?.endsWith(":max-holders-mismatch")) {
      // The key's holders share another max_holders: the setting is wrong, waiting will not help.
      throw new Exit(2, `WORKER_MAX_HOLDERS is ${maxHolders}, the key's is ${answer.json.max_holders}`);
    }
    if (answer.status === 409) {
      // Every slot is held (one, unless a semaphore): holders names them all.
      log(`lock held by ${(answer.json.holders ?? [answer.json]).map((held) => held.holder).join(", ")}`);
    } else if (answer.status === 0 || answer.status === 503) log(`service unavailable (${answer.status})`);
    else throw new Exit(1, `acquire answered ${answer.status}: ${answer.text}`);
    if (performance.now() >= deadline) {
      throw new Exit(answer.status === 409 ? 75 : 69, `gave up after ${waitMs / 1000}s`);
    }
    // Retry-After is when the holder's lease ends, but a holder that finishes early releases
    // sooner: poll with a growing, jittered backoff, never waiting longer than Retry-After.
    await sleep(Math.min(backoffMs * (1 + Math.random()), answer.retryAfter * 1000));
  }
}

// Renews every TTL/3 until `stopped` aborts. Aborts `lost` on a 410 (another worker holds the lock
// now), or when renewals fail until at most TTL/3 of the lease may be left: the work must stop
// before the lease ends and someone else can take over. A renewal slower than TTL/6 has failed.
async function renewLoop(lock, stopped, lost) {
  let leaseEnd = lock.leaseEnd;
  while (!stopped.signal.aborted) {
    await sleep(renewEveryMs, undefined, { signal: stopped.signal }).catch(() => {});
    if (stopped.signal.aborted) return;
    const sent = performance.now();
    const answer = await call("POST", `/v1/locks/${lock.id}/renew`, {
      token: lock.token, body: { ttl_seconds: ttlMs / 1000 }, timeoutMs: Math.floor(renewEveryMs / 2),
    });
    const why = `renewal answered ${answer.status}: ${answer.text}`;
    if (answer.status === 200) leaseEnd = sent + ttlMs;
    else if ([403, 404, 410].includes(answer.status)) return lost.abort(why);
    else if (performance.now() + renewEveryMs >= leaseEnd) return lost.abort(`lease nearly over, ${why}`);
  }
}

// Release, retrying while no answer comes (or 503), for at most TTL/3: the renewer had renewed
// within TTL/3, or it would have stopped the work. A 410 answers only the right Lock-Token (a wrong
// one is 403), so release_reason "released" there means an earlier try of ours took effect and its
// answer was lost: released all the same.
async function release(lock) {
  const until = performance.now() + renewEveryMs;
  for (;;) {
    const answer = await call("DELETE", `/v1/locks/${lock.id}`, { token: lock.token });
    const why = `release answered ${answer.status}: ${answer.text}`;
    if (answer.status === 204) return;
    if (answer.status === 410 && answer.json.release_reason === "released") return;
    if (answer.status === 410) throw new Exit(76, `lock ${lock.id} was lost before its release: ${why}`);
    if (answer.status !== 0 && answer.status < 500) throw new Exit(1, why);
    if (performance.now() + answer.retryAfter * 1000 >= until) {
      return log(`${why}; the lease runs out by itself`);
    }
    await sleep(answer.retryAfter * 1000);
  }
}

let holding = false; // SIGTERM/Ctrl-C while holding the lock: stop the work and release it first
const interrupted = new AbortController();
for (const [name, status] of [["SIGINT", 130], ["SIGTERM", 143]]) {
  process.once(name, () => (holding ? interrupted.abort(new Exit(status, name)) : process.exit(status)));
}

async function main() {
  if (![ttlMs, workMs, waitMs].every((n) => n >= 0) || !Number.isInteger(iterations) ||
      !(Number.isInteger(maxHolders) && maxHolders >= 1)) {
    const names = "WORKER_TTL, WORKER_WORK_SECONDS, WORKER_ITERATIONS, "
      + "WORKER_WAIT_SECONDS, WORKER_MAX_HOLDERS";
    throw new Exit(2, `${names} must be numbers`);
  }
  for (let i = 1; i <= iterations; i++) {
    const lock = await acquire();
    holding = true;
    const [stopped, lost] = [new AbortController(), new AbortController()];
    const renewer = renewLoop(lock, stopped, lost);
    let failure = null;
    try {
      // The work. Real work passes this signal on to what it awaits (fetch, streams) to stop at once.
      await sleep(workMs, undefined, { signal: AbortSignal.any([lost.signal, interrupted.signal]) });
      lost.signal.throwIfAborted();
      // What the work writes carries the fencing token, so storage can refuse a stale holder; and the
      // slot, by which storage keys its fence when several hold the key at once (a semaphore).
      const line = `${lock.fencing_token} ${holder} ${lock.id} ${lock.acquired_at} ${lock.slot ?? 0}`;
      await appendFile(output, `${line}\n`);
    } catch (error) {
      failure = interrupted.signal.reason ?? error;
    }
    stopped.abort();
    await renewer; // before releasing, so that no renewal crosses the release
    if (lost.signal.aborted) throw new Exit(76, `stopping: lock ${lock.id} lost: ${lost.signal.reason}`);
    await release(lock);
    holding = false;
    interrupted.signal.throwIfAborted();
    if (failure) throw failure;
  }
  log(`done: ${iterations} iterations`);
}

main().then(
  () => process.exit(0),
  (error) => {
    log(error instanceof Exit ? error.message : (error?.stack ?? error));
    process.exit(error instanceof Exit ? error.status : 1);
  },
);
