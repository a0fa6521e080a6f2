// The client: Helix Locks over HTTP with Node's own http module, AbortSignal and timers.

import { randomUUID } from "node:crypto";
import http, { type IncomingMessage } from "node:http";
import https from "node:https";
import { hostname, userInfo } from "node:os";

import {
  ApiError,
  ClosedUntilError,
  HelixLocksError,
  HoldLimitError,
  LockHeldError,
  LockLostError,
  MaxHoldersMismatchError,
  UnavailableError,
} from "./errors.js";
import { backoffMs as pauseMs, GONE, RETRIED, retryAfterSeconds, UNKNOWN_OUTCOME, WATCH_RETRIED } from "./retry.js";
import { EventStreamDecoder, type ServerEvent } from "./sse.js";
import type {
  AcquireOptions,
  Acquired,
  OpenedSession,
  SessionBody,
  SessionOptions,
  SessionRenewed,
  ListOptions,
  Lock,
  LockEvent,
  LockKey,
  LockMode,
  Metadata,
  Page,
  Problem,
  QueuePage,
  Reclaimed,
  Renewed,
  WatchOptions,
} from "./types.js";

const DEFAULT_URL = "http://127.0.0.1:8080";
/** A lease is given up this long before it would lapse by our clock (network and clock skew). */
const SAFETY_FRACTION = 0.1;
const MIN_SAFETY_MS = 100;
/** The largest answer read: a full listing page is far smaller. Larger is an ApiError. */
const MAX_ANSWER_BYTES = 32 * 1024 * 1024;
/** setTimeout's limit, in seconds: a longer `timeout` would fire at once. */
const MAX_TIMEOUT_SECONDS = 2_147_483;
/** How long an acquire retries a refused connection: a restarting service takes longer, but a
 * worker pointed at the wrong address should hear so at once. */
const REFUSED_WITHIN_MS = 1000;
/** The service sends a keep-alive at least every 15 s: a watch that hears nothing for three of
 * them takes its stream for dead and opens another. */
const WATCH_SILENCE_MS = 45_000;
const PROBLEM = "urn:helix-locks:problem:";

const now = (): number => performance.now();

/** What an answer about a held lease says of its end: a lock's, or a session's. */
interface LeaseAnswer {
  expires_at: string;
  ttl_remaining_ms: number;
  hold_limit_at?: string | null;
  acquired_at?: string;
}

/** Milliseconds since the epoch of a time the service sent (RFC 3339), to the microsecond it
 * gives (Date.parse alone keeps milliseconds); NaN for anything else. */
function serviceTime(text: unknown): number {
  const match = typeof text === "string" ? /^(.+T\d{2}:\d{2}:\d{2})(\.\d+)?(Z|[+-]\d{2}:\d{2})$/i.exec(text) : null;
  if (match === null) return Number.NaN;
  return Date.parse(`${match[1]}${match[3]}`) + Number(`0${match[2] ?? ""}`) * 1000;
}

/**
 * performance.now() by which the hold limit the answer names has surely come, or null when it
 * names none. Counted from `sentAt`, the send of the request it answers, by the answer's own times
 * (database times, never this machine's wall clock): the limit is (hold_limit_at - expires_at) +
 * ttl_remaining_ms after the moment the database answered, which came after the send. A lock's
 * grant (`granted`) puts it no more than its hold (hold_limit_at - acquired_at) after the send. A
 * limit that cannot be read counts as come at the send.
 */
function heldUntil(answer: LeaseAnswer, sentAt: number, granted = false): number | null {
  const limit = answer.hold_limit_at;
  if (limit === undefined || limit === null) return null;
  const at = serviceTime(limit);
  let left = at - serviceTime(answer.expires_at) + answer.ttl_remaining_ms;
  if (granted && answer.acquired_at !== undefined) left = Math.min(left, at - serviceTime(answer.acquired_at));
  return sentAt + (Number.isFinite(left) ? Math.max(left, 0) : 0);
}

/** What renew, update and release need of a held lock: a Grant, or `{ id, token }`. */
export interface LockRef {
  readonly id: number;
  readonly token: string;
  /** The lease in seconds that renew asks for when it is not given. */
  readonly ttl?: number;
}

/** What a lease keeps alive: a lock's grant, or a session's. */
interface Renewable extends LockRef {
  readonly ttl: number;
  /** performance.now() from which the lease is counted. */
  readonly sentAt: number;
  /** performance.now() by which its hold limit has surely come, or null: none. */
  readonly heldUntil: number | null;
}

export interface LockClientOptions {
  /** The service's address. Default: HELIX_LOCKS_URL, else http://127.0.0.1:8080. */
  url?: string;
  /** An API key (hlk_…), sent as a Bearer token. Default: HELIX_LOCKS_API_KEY. */
  apiKey?: string;
  /** Seconds one request may take (a waiting acquire: plus its wait). Default 10. */
  timeout?: number;
}

/** An answer's headers, looked up by name (any case). */
class AnswerHeaders {
  readonly #raw: IncomingMessage["headers"];

  constructor(raw: IncomingMessage["headers"]) {
    this.#raw = raw;
  }

  get(name: string): string | null {
    const value = this.#raw[name.toLowerCase()];
    if (value === undefined) return null;
    return Array.isArray(value) ? value.join(", ") : value;
  }

  has(name: string): boolean {
    return this.#raw[name.toLowerCase()] !== undefined;
  }
}

interface Answer {
  status: number;
  headers: AnswerHeaders;
  body: any;
}

interface SendOptions {
  query?: Record<string, string | number | undefined> | undefined;
  headers?: Record<string, string>;
  /** The request's body, computed again before each attempt. */
  body?: () => unknown;
  /** Extra milliseconds an attempt may take (a waiting acquire's wait). */
  extraTimeoutMs?: () => number;
  /** How long to go on retrying, from the first failed attempt, in milliseconds. */
  withinMs: number;
  /** How long to go on retrying a refused connection, from the first attempt. */
  refusedWithinMs?: number;
  /** The request acts on a lock we hold: 403 and 404 mean it is lost too. */
  holding?: boolean;
  signal?: AbortSignal | undefined;
}

let holderName: string | undefined;

/** user@host:pid, so that a human can tell whose worker holds a lock. */
export function defaultHolder(): string {
  if (holderName === undefined) {
    let user = "node";
    try {
      user = userInfo().username || user;
    } catch {
      // no passwd entry for this uid (a container): keep "node"
    }
    holderName = `${user}@${hostname()}:${process.pid}`;
  }
  return holderName;
}

/** Several signals as one; `dispose` removes its listeners from long-lived signals. */
function anySignal(signals: Array<AbortSignal | undefined>): { signal: AbortSignal; dispose: () => void } {
  const present = signals.filter((s): s is AbortSignal => s !== undefined);
  if (present.length === 1) return { signal: present[0]!, dispose: () => {} };
  const controller = new AbortController();
  const listeners: Array<[AbortSignal, () => void]> = [];
  const dispose = (): void => {
    for (const [signal, listener] of listeners) signal.removeEventListener("abort", listener);
    listeners.length = 0;
  };
  for (const signal of present) {
    if (signal.aborted) {
      controller.abort(signal.reason);
      dispose();
      break;
    }
    const listener = (): void => {
      controller.abort(signal.reason);
      dispose();
    };
    signal.addEventListener("abort", listener, { once: true });
    listeners.push([signal, listener]);
  }
  return { signal: controller.signal, dispose };
}

/** Resolves once any of the signals has aborted. */
function aborted(signals: AbortSignal[]): Promise<void> {
  const any = anySignal(signals);
  return new Promise((resolve) => {
    if (any.signal.aborted) {
      any.dispose();
      resolve();
      return;
    }
    const listener = (): void => {
      any.dispose();
      resolve();
    };
    any.signal.addEventListener("abort", listener, { once: true });
  });
}

/** Resolves after `ms`, or rejects with the signal's reason when it aborts first. */
function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) {
      reject(signal.reason);
      return;
    }
    const onAbort = (): void => {
      clearTimeout(timer);
      reject(signal?.reason);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, Math.max(0, ms));
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

/** Whether a connection was refused: nothing listens at the address (not a slow answer). */
function refused(error: unknown): boolean {
  const seen = new Set<unknown>();
  const pending = [error];
  while (pending.length > 0) {
    const next = pending.pop();
    if (next === null || typeof next !== "object" || seen.has(next)) continue;
    seen.add(next);
    const found = next as { code?: unknown; cause?: unknown; errors?: unknown };
    if (found.code === "ECONNREFUSED") return true;
    pending.push(found.cause);
    if (Array.isArray(found.errors)) pending.push(...found.errors);
  }
  return false;
}

/** A network failure worth retrying: a system error (ECONNREFUSED, ECONNRESET, EPIPE, …), an
 * answer that is not HTTP (HPE_…), a connection closed early, or no answer in time. Node's own
 * ERR_… codes otherwise name a mistake in the request (a header with a newline, a bad URL), which
 * no retry mends. */
function transient(error: unknown): boolean {
  const seen = new Set<unknown>();
  let next = error;
  while (next !== null && typeof next === "object" && !seen.has(next)) {
    seen.add(next);
    const found = next as { code?: unknown; name?: unknown; cause?: unknown; errors?: unknown };
    const code = found.code;
    if (typeof code === "string" && (!code.startsWith("ERR_") || code === "ERR_STREAM_PREMATURE_CLOSE")) return true;
    if (found.name === "TimeoutError") return true;
    if (Array.isArray(found.errors) && found.errors.some(transient)) return true;
    next = found.cause;
  }
  return false;
}

function timeoutError(message: string): Error {
  const error = new Error(message);
  error.name = "TimeoutError";
  return error;
}

function retryAfterMs(headers: AnswerHeaders | undefined, fallbackMs: number): number {
  const seconds = retryAfterSeconds(headers?.get("retry-after"));
  return seconds === null ? fallbackMs : seconds * 1000;
}

function backoffMs(attempt: number, answer: Answer | null): number {
  const pause = pauseMs(attempt);
  return answer === null ? pause : retryAfterMs(answer.headers, pause);
}

function problemOf(body: unknown, text: string): Problem {
  if (body !== null && typeof body === "object" && !Array.isArray(body)) return body as Problem;
  return { detail: text.slice(0, 200) };
}

/** Problems as errors; `holding`: the request acts on a lock we hold (renew, update, release). */
function raiseFor(answer: Answer, holding: boolean): void {
  if (answer.status >= 200 && answer.status < 300) {
    // Every success but a release's 204 is a JSON object: anything else is not the service.
    const body = answer.body;
    if (answer.status === 204 || (body !== null && typeof body === "object" && !Array.isArray(body))) return;
    throw new ApiError(answer.status, { detail: `a ${answer.status} answer that is not a JSON object` });
  }
  const problem = answer.body as Problem;
  const requestId = answer.headers.get("x-request-id");
  if (answer.status === 409 && problem.type === `${PROBLEM}max-holders-mismatch`) {
    throw new MaxHoldersMismatchError(problem, requestId);
  }
  if (answer.status === 409 && problem.type === `${PROBLEM}closed-until`) {
    throw new ClosedUntilError(problem, retryAfterMs(answer.headers, 1000) / 1000, requestId);
  }
  if (answer.status === 409) {
    throw new LockHeldError(problem, retryAfterMs(answer.headers, 1000) / 1000, requestId);
  }
  if (answer.status === 410 || (holding && GONE.has(answer.status))) {
    const detail = problem.detail ?? problem.title ?? "";
    if (answer.status === 410 && problem.type === `${PROBLEM}hold-limit-reached`) {
      throw new HoldLimitError(`410: ${detail || "the lock's hold limit has come"}`, { problem });
    }
    throw new LockLostError(`${answer.status}: ${detail}`.trim(), { problem });
  }
  throw apiError(answer);
}

/** The answer as an ApiError, whatever its status. */
function apiError(answer: Answer): ApiError {
  const requestId = answer.headers.get("x-request-id");
  const retryAfter = retryAfterSeconds(answer.headers.get("retry-after"));
  return new ApiError(answer.status, answer.body as Problem, { requestId, retryAfter });
}

/**
 * A session call's locks: each job type, shared if `shared` names it (the default, exclusive, is
 * not sent). A TypeError for a `shared` that is not a list of job types the call asks for. Job
 * types that are not a list go as they are: the service says what is wrong with them.
 */
function sessionLocks(jobTypes: unknown, shared: unknown): unknown {
  if (shared !== undefined && !(Array.isArray(shared) && shared.every((name) => typeof name === "string"))) {
    throw new TypeError(`shared is a list of job types: ${String(shared)}`);
  }
  const readers = new Set<string>(shared ?? []);
  if (!Array.isArray(jobTypes)) {
    if (readers.size > 0) throw new TypeError("shared names job types, and jobTypes is not a list of them");
    return jobTypes;
  }
  const unknown = [...readers].filter((name) => !jobTypes.includes(name));
  if (unknown.length > 0) {
    throw new TypeError(`shared names job types the call does not ask for: ${unknown.sort().join(", ")}`);
  }
  return jobTypes.map((jobType) =>
    readers.has(jobType) ? { job_type: jobType, mode: "shared" } : { job_type: jobType },
  );
}

/** An acquired lock: what the service granted, and the token that proves ownership. */
export class Grant implements LockRef {
  readonly id: number;
  readonly organizationId: string;
  readonly jobType: string;
  readonly holder: string;
  /** Strictly increases with every grant of the key: hand it to the storage the work writes to. */
  readonly fencingToken: number;
  /** The lease asked for, in seconds. */
  readonly ttl: number;
  /** Of a semaphore: how many may hold the key at once, and which place (from 0) this one holds. */
  readonly maxHolders: number;
  readonly slot: number;
  /** exclusive, or shared: held beside the key's other shared locks, never beside an exclusive one. */
  readonly mode: LockMode;
  /** The stale lock this acquire took over, or null. */
  readonly reclaimed: Reclaimed | null;
  /** The lock object the service answered (without the token). */
  readonly lock: Lock;
  /** performance.now() from which the lease is counted: when the acquire was sent. */
  readonly sentAt: number;
  /** The lock's hold limit (`maxHoldSeconds`), as the service sent it (hold_limit_at), or null:
   * none. No lease of the lock runs past it, however it is renewed. */
  readonly holdLimitAt: string | null;
  /** performance.now() by which the hold limit has surely come, counted from the acquire's send
   * by the answer's database times; null without one. */
  readonly heldUntil: number | null;
  /** Until when the grant closed its key (`holdAtLeastSeconds`), as the service sent it
   * (closed_until), or null: none. No other lock of the key is granted before it. */
  readonly closedUntil: string | null;
  readonly #token: string;

  constructor(answer: Acquired, ttl: number, sentAt: number) {
    const { token, reclaimed, ...lock } = answer;
    this.#token = token;
    this.id = answer.id;
    this.organizationId = answer.organization_id;
    this.jobType = answer.job_type;
    this.holder = answer.holder;
    this.fencingToken = answer.fencing_token;
    this.ttl = ttl;
    this.maxHolders = answer.max_holders ?? 1; // absent from a service older than semaphores
    this.slot = answer.slot ?? 0;
    this.mode = answer.mode ?? "exclusive"; // absent from a service older than modes
    this.reclaimed = reclaimed ?? null;
    this.lock = lock;
    // The grant was made after the request was sent, so a lease counted from the send never ends
    // after the service's. (Not from the answer's ttl_remaining_ms: the answer may be read late.)
    this.sentAt = sentAt;
    this.holdLimitAt = answer.hold_limit_at ?? null; // absent from a service older than hold limits
    this.heldUntil = heldUntil(answer, sentAt, true);
    this.closedUntil = answer.closed_until ?? null; // absent from a service older than closed keys
  }

  /** The secret that proves ownership (Lock-Token). Not an own property: a logged or
   * JSON-serialized grant does not show it. */
  get token(): string {
    return this.#token;
  }
}

/** An opened session: what the service granted (its locks, each with its own fencing token), and
 * the token of the session and of all its locks. */
export class SessionGrant implements Renewable {
  readonly id: number;
  readonly organizationId: string;
  readonly holder: string;
  /** The lease asked for, in seconds. */
  readonly ttl: number;
  /** Its locks by job type. */
  readonly locks: Record<string, Lock>;
  /** The fencing token of each lock, by job type: hand it to the storage each one guards. */
  readonly fencingTokens: Record<string, number>;
  /** The session object the service answered (without the token). */
  readonly session: SessionBody;
  /** performance.now() from which the lease is counted: when the session was asked for. */
  readonly sentAt: number;
  /** The session's hold limit (`maxHoldSeconds`), as the service sent it (hold_limit_at), or null:
   * none. No lease of the session runs past it, nor so of any of its locks. */
  readonly holdLimitAt: string | null;
  /** performance.now() by which the hold limit has surely come, counted from the opening's send
   * by the answer's database times; null without one. */
  readonly heldUntil: number | null;
  readonly #token: string;

  constructor(answer: OpenedSession, ttl: number, sentAt: number) {
    const { token, ...session } = answer;
    this.#token = token;
    this.id = answer.id;
    this.organizationId = answer.organization_id;
    this.holder = answer.holder;
    this.ttl = ttl;
    this.session = session;
    this.locks = Object.fromEntries(answer.locks.map((lock) => [lock.job_type, lock]));
    this.fencingTokens = Object.fromEntries(answer.locks.map((lock) => [lock.job_type, lock.fencing_token]));
    this.sentAt = sentAt;
    this.holdLimitAt = answer.hold_limit_at ?? null; // absent from a service older than hold limits
    this.heldUntil = heldUntil(answer, sentAt);
  }

  /** The secret of the session and of each of its locks (Lock-Token); not an own property. */
  get token(): string {
    return this.#token;
  }
}

/**
 * A held lock or session, renewed in the background every ttl/3: its signal, its clock and its
 * renewals. `A` is what the service answers about it (a lock, a session).
 *
 * A hold limit is the end of every lease: the lease ends at the earlier of a ttl after the latest
 * successful renewal's send and the limit (`heldUntil`, counted from the send of the latest answer
 * that named it), and the signal aborts a safety margin before that. A lease the limit makes
 * shorter than its ttl has the margin of a lease that long.
 */
abstract class Held<G extends Renewable, A extends LeaseAnswer> {
  readonly grant: G;
  protected readonly client: LockClient;
  protected readonly controller = new AbortController();
  readonly #stop = new AbortController();
  readonly #safetyMs: number;
  #renewedAt: number; // performance.now() when the latest successful renewal (or the grant) was sent
  #limitAt: number | null; // performance.now() by which the hold limit has surely come; null: none
  #timer: ReturnType<typeof setTimeout> | undefined;
  protected answer: A;

  constructor(grant: G, client: LockClient, first: A, renewed?: { sentAt: number; answer: A }) {
    this.grant = grant;
    this.client = client;
    this.answer = renewed?.answer ?? first;
    const ttlMs = grant.ttl * 1000;
    const leaseMs = grant.heldUntil === null ? ttlMs : Math.min(ttlMs, grant.heldUntil - grant.sentAt);
    this.#safetyMs = Math.max(MIN_SAFETY_MS, leaseMs * SAFETY_FRACTION);
    this.#renewedAt = renewed?.sentAt ?? grant.sentAt;
    this.#limitAt = (renewed && heldUntil(renewed.answer, renewed.sentAt)) ?? grant.heldUntil;
    this.#arm();
  }

  /** One renewal, as the service answers it. */
  protected abstract renewOnce(options: { within: number; signal: AbortSignal }): Promise<A>;

  /** Aborts the moment the lock may be lost; pass it to fetch, streams and child processes. */
  get signal(): AbortSignal {
    this.#checkClock();
    return this.controller.signal;
  }

  /** Whether the lock may be lost (or was released at the end of withLock). */
  get lost(): boolean {
    return this.signal.aborted;
  }

  /** Why the lock is lost, or null while it is held. */
  get lostReason(): LockLostError | null {
    const signal = this.signal;
    return signal.aborted ? (signal.reason as LockLostError) : null;
  }

  /** Seconds until the lease could lapse (or its hold limit come) by this process's clock, less
   * the safety margin. */
  get remaining(): number {
    return (this.#deadline() - this.#safetyMs - now()) / 1000;
  }

  /** Whether the lease ends at the hold limit: no renewal takes it further, so none is sent. */
  protected get limited(): boolean {
    return this.#limitAt !== null && this.#limitAt <= this.#renewedAt + this.grant.ttl * 1000;
  }

  /** The hold limit as the service sent it, or null. */
  protected get limit(): string | null {
    return this.answer.hold_limit_at ?? null;
  }

  /** Throws the LockLostError unless the lock is surely still held. */
  check(): void {
    const reason = this.lostReason;
    if (reason !== null) throw reason;
  }

  /** @internal Renew every ttl/3 until stopped or lost. Never rejects. */
  async _keepAlive(): Promise<void> {
    const period = (this.grant.ttl * 1000) / 3;
    const stop = this.#stop.signal;
    let sent = this.#renewedAt;
    for (;;) {
      if (this.limited) {
        // The lease ends at the hold limit, and no renewal takes it past: the clock ends it.
        await aborted([stop, this.controller.signal]);
        return;
      }
      try {
        // Every ttl/3 from the previous renewal's send, however long its answer took.
        await sleep(Math.max(sent + period - now(), 0), stop);
      } catch {
        return;
      }
      if (this.lost) return;
      const started = now();
      sent = started;
      const during = anySignal([stop, this.controller.signal]);
      try {
        const renewed = await this.renewOnce({ within: Math.max(this.remaining, 0.1), signal: during.signal });
        this.#renewed(started, renewed);
      } catch (error) {
        if (stop.aborted || this.lost) return; // stopped, or lost meanwhile by the clock
        if (error instanceof LockLostError) {
          this._lose(error);
          return;
        }
        // Anything else (the service out of reach until the lease nearly ran out, a key revoked):
        // try again next period; the clock says when the lease may be gone.
      } finally {
        during.dispose();
      }
    }
  }

  /** @internal Stop renewing (an in-flight renewal is abandoned). */
  _stop(): void {
    this.#stop.abort();
  }

  /** @internal The lock is lost, or no longer held: abort the signal with this reason. */
  _lose(reason: LockLostError): void {
    if (this.controller.signal.aborted) return;
    clearTimeout(this.#timer);
    this.#timer = undefined;
    this.controller.abort(reason);
  }

  #renewed(started: number, answer: A): void {
    if (this.lost) return; // a lease counted lost stays lost
    this.answer = answer;
    if (started >= this.#renewedAt) {
      this.#renewedAt = started;
      // The latest answer's count of the hold limit: from the latest send, the least clock drift.
      this.#limitAt = heldUntil(answer, started) ?? this.#limitAt;
    }
    this.#arm();
  }

  /** performance.now() when the lease could lapse: a ttl after the latest successful renewal's
   * send, or the hold limit if that comes first. */
  #deadline(): number {
    const end = this.#renewedAt + this.grant.ttl * 1000;
    return this.#limitAt === null ? end : Math.min(end, this.#limitAt);
  }

  #checkClock(): void {
    if (this.controller.signal.aborted || now() < this.#deadline() - this.#safetyMs) return;
    if (this.limited) {
      const at = this.limit ?? "the time the service named";
      this._lose(new HoldLimitError(`the hold limit comes at ${at}: no lease runs past it`, { holdLimitAt: this.limit }));
    } else {
      this._lose(new LockLostError("the lease may have lapsed: renewals did not succeed in time"));
    }
  }

  /** A timer for the moment the safety margin is reached, so that the signal aborts by itself. */
  #arm(): void {
    clearTimeout(this.#timer);
    this.#timer = undefined;
    this.#checkClock();
    if (this.controller.signal.aborted) return;
    const wait = this.#deadline() - this.#safetyMs - now();
    this.#timer = setTimeout(() => this.#arm(), Math.max(1, Math.ceil(wait)));
  }
}

/**
 * A held lock, renewed in the background every ttl/3 while withLock's callback runs.
 *
 * `signal` aborts, with a LockLostError as its reason, the moment the lock may be lost: a renewal
 * refused (410, 403, 404), or the lease's safety margin (a tenth of the ttl, at least 100 ms)
 * reached on this process's monotonic clock because renewals did not succeed in time. With a hold
 * limit (`maxHoldSeconds`), the limit is the end of the lease, however renewals go: the signal
 * aborts a safety margin before it (a tenth of the shorter of the ttl and the hold), with a
 * HoldLimitError. It also aborts once withLock has released the lock.
 */
export class Lease extends Held<Grant, Lock> {
  /** Made by LockClient.withLock; use `client.withLock`, not this. */
  constructor(grant: Grant, client: LockClient, renewed?: { sentAt: number; lock: Lock }) {
    super(grant, client, grant.lock, renewed && { sentAt: renewed.sentAt, answer: renewed.lock });
  }

  get id(): number {
    return this.grant.id;
  }

  get fencingToken(): number {
    return this.grant.fencingToken;
  }

  get slot(): number {
    return this.grant.slot;
  }

  get maxHolders(): number {
    return this.grant.maxHolders;
  }

  /** exclusive, or shared (a reader, held beside the key's other readers). */
  get mode(): LockMode {
    return this.grant.mode;
  }

  /** The lock's hold limit (hold_limit_at, as the service sent it), or null: none. */
  get holdLimitAt(): string | null {
    return this.grant.holdLimitAt;
  }

  /** Whether the lease ends at the hold limit: no renewal takes it further (none is sent), and the
   * signal aborts the safety margin before it. */
  get atHoldLimit(): boolean {
    return this.limited;
  }

  /** Until when the grant closed the key (closed_until, as the service sent it), or null: none. */
  get closedUntil(): string | null {
    return this.grant.closedUntil;
  }

  /** The latest lock object the service answered: at the grant, or at the latest renewal or update. */
  get lock(): Lock {
    return this.answer;
  }

  /**
   * Replace the lock's metadata (progress, a leader's address) and return the lock. LockLostError,
   * without a request, if the lease is lost already, or when the service says it is (which loses
   * the lease).
   */
  async update(metadata: Metadata): Promise<Lock> {
    this.check();
    try {
      const lock = await this.client.update(this.grant, metadata, {
        within: Math.max(this.remaining, 0.1),
        signal: this.controller.signal,
      });
      if (!this.lost) this.answer = lock;
      return lock;
    } catch (error) {
      if (error instanceof LockLostError) this._lose(error);
      throw error;
    }
  }

  protected renewOnce(options: { within: number; signal: AbortSignal }): Promise<Lock> {
    return this.client.renew(this.grant, options);
  }
}

/**
 * A held session (all its locks), renewed in the background every ttl/3 with one request while
 * withSession's callback runs; `signal` aborts as a Lease's does, the moment any of its locks may
 * be lost (the service ends a session that lost one, releasing the rest), and before the session's
 * hold limit (`maxHoldSeconds`), with a HoldLimitError.
 */
export class SessionLease extends Held<SessionGrant, SessionBody> {
  /** Made by LockClient.withSession; use `client.withSession`, not this. */
  constructor(grant: SessionGrant, client: LockClient, renewed?: { sentAt: number; session: SessionBody }) {
    super(grant, client, grant.session, renewed && { sentAt: renewed.sentAt, answer: renewed.session });
  }

  get id(): number {
    return this.grant.id;
  }

  /** Its locks by job type, as granted. */
  get locks(): Record<string, Lock> {
    return this.grant.locks;
  }

  /** The fencing token of each of its locks, by job type. */
  get fencingTokens(): Record<string, number> {
    return this.grant.fencingTokens;
  }

  /** The latest session object the service answered. */
  get session(): SessionBody {
    return this.answer;
  }

  /** The session's hold limit (hold_limit_at, as the service sent it), or null: none. */
  get holdLimitAt(): string | null {
    return this.grant.holdLimitAt;
  }

  /** Whether the lease ends at the hold limit: no renewal takes it further (none is sent), and the
   * signal aborts the safety margin before it. */
  get atHoldLimit(): boolean {
    return this.limited;
  }

  protected renewOnce(options: { within: number; signal: AbortSignal }): Promise<SessionBody> {
    return this.client.renewSession(this.grant, options);
  }
}

/** The pages of a listing, or its locks one by one: `for await (const lock of client.list(…))`. */
export class LockList implements AsyncIterable<Lock> {
  readonly #client: LockClient;
  readonly #options: ListOptions;

  constructor(client: LockClient, options: ListOptions) {
    this.#client = client;
    this.#options = options;
  }

  /** Each page as the service answers it, following `next_cursor` until it is null. */
  async *pages(): AsyncGenerator<Page, void, undefined> {
    let cursor = this.#options.cursor;
    for (;;) {
      const { organizationId, jobType, state, limit, signal } = this.#options;
      const page = (await this.#client._get("/v1/locks", {
        query: { organization_id: organizationId, job_type: jobType, state, limit, cursor },
        signal,
      })) as Page;
      yield page;
      if (page.next_cursor === null || page.next_cursor === undefined) return;
      cursor = page.next_cursor;
    }
  }

  async *[Symbol.asyncIterator](): AsyncGenerator<Lock, void, undefined> {
    for await (const page of this.pages()) yield* page.items;
  }
}

/**
 * A client of a Helix Locks service. URL and key default to HELIX_LOCKS_URL and
 * HELIX_LOCKS_API_KEY. Times (ttl, wait) are in seconds, as in the HTTP API.
 */
export class LockClient {
  readonly url: string;
  /** Seconds one request may take (a waiting acquire: plus its wait). */
  readonly timeout: number;
  readonly #headers: Record<string, string>;
  readonly #transport: typeof http | typeof https;
  // Connections kept open between requests; an idle one does not keep the process alive.
  readonly #agent: http.Agent;

  constructor(options: LockClientOptions = {}) {
    const url = options.url ?? process.env.HELIX_LOCKS_URL ?? DEFAULT_URL;
    this.url = (url || DEFAULT_URL).replace(/\/+$/, "");
    const parsed = new URL(this.url); // a TypeError, at once, for an address that is not one
    if (parsed.protocol !== "http:" && parsed.protocol !== "https:") {
      throw new TypeError(`${this.url}: the service's address is http:// or https://`);
    }
    this.#transport = parsed.protocol === "https:" ? https : http;
    this.#agent = new this.#transport.Agent({ keepAlive: true });
    this.timeout = options.timeout ?? 10;
    if (typeof this.timeout !== "number" || !(this.timeout > 0 && this.timeout <= MAX_TIMEOUT_SECONDS)) {
      throw new TypeError(`timeout is seconds, more than 0 and at most ${MAX_TIMEOUT_SECONDS}: ${String(options.timeout)}`);
    }
    const apiKey = options.apiKey ?? process.env.HELIX_LOCKS_API_KEY;
    this.#headers = apiKey ? { authorization: `Bearer ${apiKey}` } : {};
  }

  /**
   * Hold the lock while `fn` runs: acquire (waiting up to `wait` seconds), renew every ttl/3,
   * and release when `fn` settles, unless the lock was lost. Resolves with what `fn` resolves
   * with. Rejects with LockLostError when the lock was lost meanwhile (its `cause` is `fn`'s own
   * error, if `fn` failed otherwise), with `fn`'s error otherwise, and with the acquire's error
   * (LockHeldError, MaxHoldersMismatchError, UnavailableError, ApiError) without calling `fn`.
   * A release that fails otherwise than by the lock being lost leaves the lease to lapse. With
   * `maxHoldSeconds`, the lease's signal aborts before the lock's hold limit, as before a lease's
   * end, and withLock rejects with a HoldLimitError (a LockLostError) however the renewals went.
   */
  async withLock<T>(options: AcquireOptions, fn: (lease: Lease) => T | Promise<T>): Promise<T> {
    if (typeof fn !== "function") throw new TypeError("withLock needs a function to run while holding the lock");
    const grant = await this.acquire(options);
    const renewed = await this.#confirmed(grant, "locks");
    const lease = new Lease(grant, this, renewed && { sentAt: renewed.sentAt, lock: renewed.answer as Lock });
    return this.#holding(lease, fn, (within) => this.release(grant, { within }), "withLock");
  }

  /**
   * Hold all the locks of `jobTypes` while `fn` runs, in one session: opened with all of them
   * granted at once or none (LockHeldError, whose `jobType` names the first pair held; with
   * `wait`, it waits until all are free), renewed every ttl/3 with one request for all of them,
   * and ended (every lock released) when `fn` settles, unless lost. Settles as withLock does. The
   * job types named in `shared` are held as shared locks (readers), the others as exclusive ones.
   * With `maxHoldSeconds`, the signal aborts before the session's hold limit, as withLock's does.
   */
  async withSession<T>(options: SessionOptions, fn: (session: SessionLease) => T | Promise<T>): Promise<T> {
    if (typeof fn !== "function") throw new TypeError("withSession needs a function to run while holding the locks");
    const grant = await this.openSession(options);
    const renewed = await this.#confirmed(grant, "sessions");
    const lease = new SessionLease(
      grant,
      this,
      renewed && { sentAt: renewed.sentAt, session: renewed.answer as SessionBody },
    );
    return this.#holding(lease, fn, (within) => this.endSession(grant, { within }), "withSession");
  }

  async #holding<L extends Held<Renewable, LeaseAnswer>, T>(
    lease: L,
    fn: (lease: L) => T | Promise<T>,
    release: (within: number) => Promise<void>,
    name: string,
  ): Promise<T> {
    const renewing = lease._keepAlive();
    let result: T | undefined;
    let failed = false;
    let failure: unknown;
    try {
      result = await fn(lease);
    } catch (error) {
      failed = true;
      failure = error;
    }
    lease._stop();
    await renewing; // before releasing, so that no renewal crosses the release
    const lost = (): LockLostError | null => {
      const reason = lease.lostReason;
      if (reason === null) return null;
      if (!failed || failure === reason) return reason;
      const options = { problem: reason.problem, cause: failure };
      return reason instanceof HoldLimitError
        ? new HoldLimitError(reason.message, { ...options, holdLimitAt: reason.holdLimitAt })
        : new LockLostError(reason.message, options);
    };
    const before = lost();
    if (before !== null) throw before; // a lost lock is not released: it may be another's now
    try {
      await release(Math.min(10, Math.max(lease.remaining, 1)));
      lease._lose(new LockLostError(`released: ${name}'s callback ended`));
    } catch (error) {
      if (!(error instanceof LockLostError)) {
        lease._lose(new LockLostError(`${name}'s callback ended; the release failed, the lease lapses`, { cause: error }));
      } else {
        lease._lose(error);
        throw lost();
      }
    }
    if (failed) throw failure;
    return result as T;
  }

  /**
   * A grant counts its lease from when the acquire was sent. After a wait longer than a renewal
   * period that leaves too little, so renew once before the work starts, and count from that
   * renewal's send instead. Undefined when no renewal is needed. A failure releases what it can
   * and throws: the work never starts on a lease that may be over.
   */
  async #confirmed(grant: Renewable, kind: "locks" | "sessions"): Promise<{ sentAt: number; answer: unknown } | undefined> {
    if (now() - grant.sentAt < (grant.ttl * 1000) / 3) return undefined;
    const sentAt = now();
    const within = Math.max(grant.ttl / 3, 1);
    try {
      const answer = kind === "locks" ? await this.renew(grant, { within }) : await this.renewSession(grant, { within });
      return { sentAt, answer };
    } catch (error) {
      if (!(error instanceof LockLostError)) {
        const release = kind === "locks" ? this.release(grant, { within: 1 }) : this.endSession(grant, { within: 1 });
        await release.catch(() => undefined);
      }
      throw error;
    }
  }

  /**
   * Acquire, or LockHeldError. With `wait`, the service waits for a held lock for up to that many
   * seconds (in rounds of at most 60). Every attempt carries one Idempotency-Key, so that a retry
   * after a lost answer or a 503 (honouring Retry-After, for at most half the lease) gets the same
   * grant. MaxHoldersMismatchError at once when the key's held locks share another `maxHolders`.
   * `mode: "shared"`: a reader, held beside the key's other readers (each with a lease of its own)
   * and never beside an exclusive lock, which waits for every reader; a reader waits behind a
   * waiting writer (LockHeldError `waiters-ahead` without `wait`). With `maxHoldSeconds`, a hold
   * limit: no lease of the lock runs past `grant.holdLimitAt`, however it is renewed. With
   * `holdAtLeastSeconds`, the grant closes the key until `grant.closedUntil`, whatever becomes of
   * the lock: every acquire meanwhile gets ClosedUntilError (a LockHeldError), and a waiting one
   * waits for the opening, or gets it at once when its wait would end first.
   */
  async acquire(options: AcquireOptions): Promise<Grant> {
    const { organizationId, jobType, holder, metadata, mode, maxHoldSeconds, holdAtLeastSeconds } = options;
    const ttl = options.ttl ?? 30;
    const maxHolders = options.maxHolders ?? 1;
    const body: Record<string, unknown> = {
      organization_id: organizationId,
      job_type: jobType,
      holder: holder ?? defaultHolder(),
      ttl_seconds: ttl,
    };
    if (metadata !== undefined) body.metadata = metadata;
    if (maxHolders !== 1) body.max_holders = maxHolders; // an older service gets the same body
    if (mode !== undefined && mode !== "exclusive") body.mode = mode; // likewise: the default is not sent
    if (maxHoldSeconds !== undefined && maxHoldSeconds !== null) body.max_hold_seconds = maxHoldSeconds; // likewise
    if (holdAtLeastSeconds !== undefined && holdAtLeastSeconds !== null) body.hold_at_least_seconds = holdAtLeastSeconds;
    const { answer, started } = await this.#granted("/v1/locks", body, ttl, options.wait ?? 0, options.signal);
    return new Grant(answer as Acquired, ttl, started);
  }

  /**
   * Open a session holding the locks of `jobTypes`, all granted at once or none (LockHeldError
   * names the first pair held as `jobType`); with `wait`, wait until all are free. The grant's id
   * and token are the session's: renew it with renewSession, end it with endSession. The job types
   * named in `shared` are taken as shared locks (readers), the others as exclusive ones. With
   * `maxHoldSeconds`, a hold limit from the opening: no lease of the session runs past
   * `grant.holdLimitAt`, nor so of any of its locks.
   */
  async openSession(options: SessionOptions): Promise<SessionGrant> {
    const { organizationId, jobTypes, holder, metadata, maxHoldSeconds } = options;
    const ttl = options.ttl ?? 30;
    const body: Record<string, unknown> = {
      organization_id: organizationId,
      holder: holder ?? defaultHolder(),
      ttl_seconds: ttl,
      locks: sessionLocks(jobTypes, options.shared),
    };
    if (metadata !== undefined) body.metadata = metadata;
    if (maxHoldSeconds !== undefined && maxHoldSeconds !== null) body.max_hold_seconds = maxHoldSeconds;
    const { answer, started } = await this.#granted("/v1/sessions", body, ttl, options.wait ?? 0, options.signal);
    return new SessionGrant(answer as OpenedSession, ttl, started);
  }

  /**
   * Add the locks of `jobTypes` to a held session (its SessionGrant, or the SessionLease of
   * withSession), all granted at once or none (LockHeldError names the first pair held as
   * `jobType`); with `wait`, wait until all are free. They share the session's lease, and the
   * grant lists them in `locks` and `fencingTokens` from then on. A retry after a lost answer
   * gets the same locks (one Idempotency-Key for every attempt). The job types named in `shared`
   * are taken as shared locks (readers).
   */
  async addSessionLocks(
    session: SessionGrant | SessionLease,
    options: { jobTypes: string[]; shared?: string[]; wait?: number; signal?: AbortSignal },
  ): Promise<Lock[]> {
    const grant = session instanceof SessionLease ? session.grant : session;
    const body: Record<string, unknown> = { locks: sessionLocks(options.jobTypes, options.shared) };
    const { answer } = await this.#granted(`/v1/sessions/${grant.id}/locks`, body, 20, options.wait ?? 0, options.signal, {
      "lock-token": grant.token,
    });
    const added = (answer as SessionBody).locks;
    for (const lock of added) {
      grant.locks[lock.job_type] = lock;
      grant.fencingTokens[lock.job_type] = lock.fencing_token;
    }
    return added;
  }

  /** A grant's answer (a lock's, a session's), asked again after each 409 until `wait` is over. */
  async #granted(
    path: string,
    body: Record<string, unknown>,
    ttl: unknown,
    wait: unknown,
    signal: AbortSignal | undefined,
    extra: Record<string, string> = {},
  ): Promise<{ answer: unknown; started: number }> {
    const waitable = typeof wait === "number" && Number.isFinite(wait) && wait >= 0;
    if (!waitable) body.wait_seconds = wait; // the service says what is wrong with it
    const headers = { ...extra, "idempotency-key": randomUUID() }; // so that a retry never locks us out
    const giveUp = now() + (waitable ? wait * 1000 : 0);
    let round = 0;
    const withinMs = typeof ttl === "number" && Number.isFinite(ttl) ? Math.max(ttl * 500, 1000) : 1000;
    for (;;) {
      let waiting = 0;
      const started = now();
      try {
        const answer = await this._send("POST", path, {
          headers,
          body: () => {
            if (!waitable) return body;
            // Each attempt waits what is left of the wait, at most the service's 60 s.
            waiting = Math.round(Math.min(Math.max(giveUp - now(), 0), 60_000)) / 1000;
            return waiting > 0 ? { ...body, wait_seconds: waiting } : body;
          },
          extraTimeoutMs: () => waiting * 1000,
          withinMs,
          refusedWithinMs: REFUSED_WITHIN_MS,
          signal,
        });
        return { answer: answer.body, started };
      } catch (error) {
        if (!(error instanceof LockHeldError) || now() >= giveUp) throw error;
        // A closed key opens no sooner than Retry-After: asking again before the wait ends cannot help.
        if (error instanceof ClosedUntilError && error.retryAfter * 1000 > giveUp - now()) throw error;
        // The service waited as long as it would (a round ends at its 60 s): ask again soon, but
        // never in a tight loop against one that answers 409 at once, and never past the wait.
        const pause = Math.min(pauseMs(round), error.retryAfter * 1000, giveUp - now());
        round += 1;
        await sleep(Math.max(pause, 0), signal);
      }
    }
  }

  /** A new lease for the session and every one of its locks (default: the grant's ttl), in one
   * request. LockLostError once it ended, or lost a lock (the service then released the rest). */
  async renewSession(
    session: LockRef,
    options: { ttl?: number; within?: number; signal?: AbortSignal } = {},
  ): Promise<SessionRenewed> {
    const ttl = options.ttl ?? session.ttl ?? 30;
    const answer = await this._send("POST", `/v1/sessions/${session.id}/renew`, {
      headers: { "lock-token": session.token },
      body: () => ({ ttl_seconds: ttl }),
      withinMs: (options.within ?? 10) * 1000,
      holding: true,
      signal: options.signal,
    });
    return answer.body as SessionRenewed;
  }

  /** End the session, releasing every lock of it; LockLostError if it had ended otherwise or lost a lock. */
  async endSession(session: LockRef, options: { within?: number; signal?: AbortSignal } = {}): Promise<void> {
    try {
      await this._send("DELETE", `/v1/sessions/${session.id}`, {
        headers: { "lock-token": session.token },
        withinMs: (options.within ?? 10) * 1000,
        holding: true,
        signal: options.signal,
      });
    } catch (error) {
      if (!(error instanceof LockLostError && error.releasedByItsToken)) throw error;
    }
  }

  /** A session and its unreleased locks. ApiError 404 for none (or another organization's). */
  async getSession(id: number, options: { signal?: AbortSignal } = {}): Promise<SessionBody> {
    return (await this._get(`/v1/sessions/${id}`, { signal: options.signal })) as SessionBody;
  }

  /** Renew a held lock for `ttl` seconds (default: the grant's). LockLostError if it is not ours any more. */
  async renew(
    lock: LockRef,
    options: { ttl?: number; within?: number; signal?: AbortSignal } = {},
  ): Promise<Renewed> {
    const ttl = options.ttl ?? lock.ttl ?? 30;
    const answer = await this._send("POST", `/v1/locks/${lock.id}/renew`, {
      headers: { "lock-token": lock.token },
      body: () => ({ ttl_seconds: ttl }),
      withinMs: (options.within ?? 10) * 1000,
      holding: true,
      signal: options.signal,
    });
    return answer.body as Renewed;
  }

  /** Replace a held lock's metadata; LockLostError if it is not ours any more. */
  async update(
    lock: LockRef,
    metadata: Metadata,
    options: { within?: number; signal?: AbortSignal } = {},
  ): Promise<Lock> {
    const answer = await this._send("PATCH", `/v1/locks/${lock.id}`, {
      headers: { "lock-token": lock.token },
      body: () => ({ metadata: metadata ?? null }),
      withinMs: (options.within ?? 10) * 1000,
      holding: true,
      signal: options.signal,
    });
    return answer.body as Lock;
  }

  /**
   * Release; LockLostError if the lock had already ended otherwise (it was not ours any more).
   * A retry after an answer that never came (or a 503) may find the lock released by the first
   * attempt: that is this release's own success, not a loss.
   */
  async release(lock: LockRef, options: { within?: number; signal?: AbortSignal } = {}): Promise<void> {
    try {
      await this._send("DELETE", `/v1/locks/${lock.id}`, {
        headers: { "lock-token": lock.token },
        withinMs: (options.within ?? 10) * 1000,
        holding: true,
        signal: options.signal,
      });
    } catch (error) {
      if (!(error instanceof LockLostError && error.releasedByItsToken)) throw error;
    }
  }

  /** One lock, in any state. ApiError 404 for none (or another organization's). */
  async get(id: number, options: { signal?: AbortSignal } = {}): Promise<Lock> {
    return (await this._get(`/v1/locks/${id}`, { signal: options.signal })) as Lock;
  }

  /** The locks, page by page or one by one: `for await (const lock of client.list({ state: "held" }))`. */
  list(options: ListOptions = {}): LockList {
    return new LockList(this, options);
  }

  /** The lock held now for the key, or null: of a semaphore, the one with the highest fencing
   * token, or with `slot`, the one in that slot. */
  async current(options: LockKey & { slot?: number; signal?: AbortSignal }): Promise<Lock | null> {
    try {
      return (await this._get("/v1/locks/current", {
        query: { organization_id: options.organizationId, job_type: options.jobType, slot: options.slot },
        signal: options.signal,
      })) as Lock;
    } catch (error) {
      if (error instanceof ApiError && error.status === 404 && error.kind === "lock-not-found") return null;
      throw error;
    }
  }

  /** One page of the key's queue: the acquires waiting for it, in the order they will be granted;
   * pass the page's `next_cursor` as `cursor` for the next. */
  async queue(
    options: LockKey & { limit?: number; cursor?: string; signal?: AbortSignal },
  ): Promise<QueuePage> {
    return (await this._get("/v1/locks/queue", {
      query: {
        organization_id: options.organizationId,
        job_type: options.jobType,
        limit: options.limit,
        cursor: options.cursor,
      },
      signal: options.signal,
    })) as QueuePage;
  }

  /**
   * The events of GET /v1/events as they come, each its data with its `id` added, opened again
   * after every cut or end with Last-Event-ID, so that no event is missed or repeated. Ends when
   * `signal` aborts (or the loop is left). UnavailableError once no stream could be opened for
   * `within` seconds (a refused first connection at once); ApiError on any other refusal (401,
   * 403, 410 `events-expired`, 422).
   */
  async *watch(options: WatchOptions = {}): AsyncGenerator<LockEvent, void, undefined> {
    const { signal } = options;
    const within = options.within === undefined ? 60 : options.within;
    const limitMs = within === null ? Number.POSITIVE_INFINITY : within * 1000;
    const query = new URLSearchParams();
    if (options.organizationId !== undefined) query.set("organization_id", options.organizationId);
    if (options.jobType !== undefined) query.set("job_type", options.jobType);
    const target = `${this.url}/v1/events${query.size > 0 ? `?${query}` : ""}`;
    let resume = options.lastEventId ?? null;
    let retryMs = 0;
    let attempt = 0;
    let heard = false;
    let since = now();
    for (;;) {
      if (signal?.aborted) return;
      const silence = new AbortController();
      const opened = anySignal([signal, silence.signal]);
      let timer: ReturnType<typeof setTimeout> | undefined;
      const watchSilence = (ms = WATCH_SILENCE_MS): void => {
        clearTimeout(timer);
        timer = setTimeout(() => silence.abort(timeoutError("the stream went silent")), ms);
      };
      let refusal: Answer | null = null;
      let error: unknown = null;
      try {
        const headers: Record<string, string> = {
          ...this.#headers,
          accept: "text/event-stream",
          "cache-control": "no-cache",
        };
        // An empty id (a stream's bare `id:`) means none, as EventSource has it.
        if (resume !== null && resume !== "") headers["last-event-id"] = resume;
        // Opening waits no longer than what is left of `within`, nor than a silence.
        watchSilence(Math.max(Math.min(WATCH_SILENCE_MS, since + limitMs - now()), 1));
        const response = await this.#open("GET", target, headers, undefined, opened.signal);
        if (response.statusCode !== 200) {
          refusal = await this.#read(response);
          // A refusal of the stream is an ApiError: its 410 is events-expired, not a lost lock.
          if (!WATCH_RETRIED.has(refusal.status)) throw apiError(refusal);
        } else {
          const kind = response.headers["content-type"] ?? "";
          if (!kind.startsWith("text/event-stream")) {
            response.destroy();
            throw new ApiError(200, { detail: `${target} answered ${kind || "no"} type, not text/event-stream` });
          }
          const decoder = new EventStreamDecoder(resume);
          const chunks: AsyncIterator<Buffer> = response[Symbol.asyncIterator]();
          try {
            for (;;) {
              watchSilence();
              const { value, done } = await chunks.next();
              clearTimeout(timer);
              if (done) break;
              // Anything heard, a keep-alive included, says the service is there again.
              attempt = 0;
              heard = true;
              since = now();
              for (const sent of decoder.feed(value)) yield toEvent(sent);
            }
          } finally {
            resume = decoder.lastEventId;
            if (decoder.retry !== null) retryMs = decoder.retry;
            response.destroy(); // closes the connection, if the stream did not end by itself
          }
        }
      } catch (caught) {
        if (signal?.aborted) return;
        if (caught instanceof HelixLocksError) throw caught;
        error = caught; // a cut, a refused connection, or silence
      } finally {
        clearTimeout(timer);
        opened.dispose();
      }
      if (error !== null && !transient(error)) throw error; // a mistake in the request
      const pause = Math.max(backoffMs(attempt, refusal), retryMs);
      const gaveUpAt = since + (heard || !refused(error) ? limitMs : REFUSED_WITHIN_MS);
      if (now() + pause > gaveUpAt) throw this.#gaveUp((now() - since) / 1000, error, refusal);
      try {
        await sleep(pause, signal);
      } catch {
        return;
      }
      attempt += 1;
    }
  }

  /** @internal GET a JSON answer. */
  async _get(path: string, options: { query?: SendOptions["query"]; signal?: AbortSignal | undefined }): Promise<unknown> {
    const answer = await this._send("GET", path, { query: options.query, withinMs: 10_000, signal: options.signal });
    return answer.body;
  }

  /**
   * @internal One request, retried on network trouble and the statuses of RETRIED (after
   * Retry-After when given) for at most `withinMs` from the first failure, a refused connection for
   * at most `refusedWithinMs` from the start. Every request this client sends may be repeated: an
   * acquire carries its Idempotency-Key, and the rest act on one lock or read; a POST without an
   * Idempotency-Key would be retried only after a 429, which says the service did nothing.
   */
  async _send(method: string, path: string, options: SendOptions): Promise<Answer> {
    const started = now();
    const idempotent =
      method !== "POST" ||
      (options.holding ?? false) ||
      Object.keys(options.headers ?? {}).some((name) => name.toLowerCase() === "idempotency-key");
    const refusedUntil = started + (options.refusedWithinMs ?? options.withinMs);
    let until: number | null = null;
    let attempt = 0;
    let url = `${this.url}${path}`;
    if (options.query !== undefined) {
      const query = new URLSearchParams();
      for (const [name, value] of Object.entries(options.query)) {
        if (value !== undefined) query.set(name, String(value));
      }
      if (query.size > 0) url += `?${query}`;
    }
    for (;;) {
      let answer: Answer | null = null;
      let error: unknown = null;
      try {
        answer = await this.#attempt(method, url, options);
      } catch (caught) {
        if (options.signal?.aborted) throw options.signal.reason;
        error = caught;
      }
      if (answer !== null && !RETRIED.has(answer.status)) {
        raiseFor(answer, options.holding ?? false);
        return answer;
      }
      if (answer !== null && !idempotent && UNKNOWN_OUTCOME.has(answer.status)) {
        throw this.#gaveUp((now() - started) / 1000, null, answer); // it may have taken effect
      }
      if (answer === null && !transient(error)) throw error; // a mistake in the request, or ours
      if (answer === null && !idempotent && !refused(error)) throw this.#gaveUp((now() - started) / 1000, error, null);
      until ??= now() + options.withinMs;
      const pause = backoffMs(attempt, answer);
      const limit = refused(error) ? Math.min(until, refusedUntil) : until;
      if (now() + pause > limit) {
        // A 429 that lasts is its own refusal; the others leave the outcome unknown.
        if (answer !== null && !UNKNOWN_OUTCOME.has(answer.status)) raiseFor(answer, options.holding ?? false);
        throw this.#gaveUp((now() - started) / 1000, error, answer);
      }
      await sleep(pause, options.signal);
      attempt += 1;
    }
  }

  async #attempt(method: string, url: string, options: SendOptions): Promise<Answer> {
    const body = options.body?.();
    const headers: Record<string, string> = { ...this.#headers, accept: "application/json", ...options.headers };
    if (body !== undefined) headers["content-type"] = "application/json";
    const timeoutMs = this.timeout * 1000 + (options.extraTimeoutMs?.() ?? 0);
    const timeout = new AbortController();
    const timer = setTimeout(
      () => timeout.abort(timeoutError(`no answer within ${(timeoutMs / 1000).toFixed(1)} s`)),
      timeoutMs,
    );
    const signal = anySignal([options.signal, timeout.signal]);
    try {
      const sent = body === undefined ? undefined : JSON.stringify(body);
      return await this.#read(await this.#open(method, url, headers, sent, signal.signal));
    } catch (error) {
      if (timeout.signal.aborted && !options.signal?.aborted) throw timeout.signal.reason;
      throw error;
    } finally {
      clearTimeout(timer);
      signal.dispose();
    }
  }

  /** Send a request; resolves with the answer once its head has come (its body still to read). */
  #open(
    method: string,
    url: string,
    headers: Record<string, string>,
    body: string | undefined,
    signal: AbortSignal,
  ): Promise<IncomingMessage> {
    return new Promise((resolve, reject) => {
      if (body !== undefined) headers["content-length"] = String(Buffer.byteLength(body));
      const request = this.#transport.request(url, { method, headers, agent: this.#agent, signal }, resolve);
      request.on("error", reject);
      request.end(body);
    });
  }

  /** Read an answer's body: JSON when it says so, a problem object for an error status. */
  async #read(response: IncomingMessage): Promise<Answer> {
    const parts: Buffer[] = [];
    let size = 0;
    for await (const part of response) {
      size += (part as Buffer).length;
      if (size > MAX_ANSWER_BYTES) {
        response.destroy();
        throw new ApiError(response.statusCode ?? 0, { detail: `an answer larger than ${MAX_ANSWER_BYTES} bytes` });
      }
      parts.push(part as Buffer);
    }
    const text = Buffer.concat(parts).toString("utf8");
    const status = response.statusCode ?? 0;
    let body: unknown = null;
    if (text !== "" && (response.headers["content-type"] ?? "").includes("json")) {
      try {
        body = JSON.parse(text);
      } catch {
        body = null;
      }
    }
    if (status < 200 || status >= 300) body = problemOf(body, text);
    return { status, headers: new AnswerHeaders(response.headers), body };
  }

  #gaveUp(seconds: number, error: unknown, answer: Answer | null): UnavailableError {
    if (refused(error)) {
      return new UnavailableError(`${this.url} refused the connection: is the service running there?`, { cause: error });
    }
    if (answer !== null) {
      const problem = answer.body as Problem;
      const said = problem.detail ?? problem.title ?? "";
      return new UnavailableError(`${this.url} answered ${answer.status} for ${seconds.toFixed(1)} s: ${said}`, {
        status: answer.status,
        problem,
      });
    }
    const why = error instanceof Error ? `: ${error.message}${causeOf(error)}` : "";
    return new UnavailableError(`no answer from ${this.url} within ${seconds.toFixed(1)} s${why}`, { cause: error });
  }
}

function causeOf(error: Error): string {
  return error.cause instanceof Error ? `: ${error.cause.message}` : "";
}

/** An event's data as the client hands it over: the JSON object, with its id added. */
function toEvent(sent: ServerEvent): LockEvent {
  let event: unknown;
  try {
    event = JSON.parse(sent.data);
  } catch {
    event = null;
  }
  if (event === null || typeof event !== "object" || Array.isArray(event)) {
    throw new ApiError(200, { detail: `an event whose data is not a JSON object: ${sent.data.slice(0, 200)}` });
  }
  const data = event as Record<string, unknown>;
  data.type ??= sent.event;
  data.id = sent.id;
  return data as unknown as LockEvent;
}
