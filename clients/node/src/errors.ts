// The client's errors. Every error it throws is a HelixLocksError; match on the class, never on
// the message.

import type { Holder, LockMode, Problem } from "./types.js";

/** The base of every error this client throws. */
export class HelixLocksError extends Error {
  override name = "HelixLocksError";
}

/**
 * The service answered with a problem (RFC 9457) that no more specific error stands for: a bad
 * request (422, with `problem.errors` naming each field), a missing or revoked key (401), another
 * organization (403), a quota (429), and so on.
 */
export class ApiError extends HelixLocksError {
  override name = "ApiError";
  /** The HTTP status. */
  readonly status: number;
  /** The problem object as the service sent it: `type`, `title`, `status`, `detail` and its own fields. */
  readonly problem: Problem;
  /** The problem's kind: `invalid-request`, `unauthenticated`, `lock-held`, … (`type` without its URN prefix). */
  readonly kind: string;
  /** The answer's `X-Request-Id`, which the service's log line carries too. */
  readonly requestId: string | null;
  /** The answer's `Retry-After`, in seconds, when it had one. */
  readonly retryAfter: number | null;

  constructor(
    status: number,
    problem: Problem,
    options: { requestId?: string | null; retryAfter?: number | null; cause?: unknown } = {},
  ) {
    const said = problem.detail ?? problem.title ?? "error";
    super(`${status}: ${said}`, options.cause === undefined ? undefined : { cause: options.cause });
    this.status = status;
    this.problem = problem;
    this.kind = typeof problem.type === "string" ? problem.type.replace(/^urn:helix-locks:problem:/, "") : "";
    this.requestId = options.requestId ?? null;
    this.retryAfter = options.retryAfter ?? null;
  }

  /** The invalid fields of a 422: `[{ field, message }…]`; empty for any other problem. */
  get errors(): Array<{ field: string; message: string }> {
    return Array.isArray(this.problem.errors) ? this.problem.errors : [];
  }
}

/**
 * Another holder has the lock (409 `lock-held`); of a semaphore, live locks hold every slot.
 * `lockId`, `holder` and `expiresAt` name the held lock whose lease runs out first; `holders`
 * lists at most 20 held locks, those whose leases run out first, and `holdersTotal` counts them
 * all; `retryAfter` is the seconds until that first lease ends (at least 1); `mode` is the held
 * locks' (exclusive, or shared: readers, which an exclusive acquire waits for).
 */
export class LockHeldError extends ApiError {
  override name = "LockHeldError";
  readonly lockId: number | null;
  readonly holder: string | null;
  readonly expiresAt: string | null;
  readonly maxHolders: number;
  readonly holders: Holder[];
  readonly holdersTotal: number;
  /** The mode of the held locks it met: `shared` when readers hold the key. `exclusive` when the
   * body does not say (a service older than modes, a `waiters-ahead`). */
  readonly mode: LockMode;
  /** Of a session's locks, all refused: the job type of the first (in job type order) held. */
  readonly jobType: string | null;
  /** 409 `waiters-ahead`: acquires wait in the key's queue and come first; how many (else null). */
  readonly waiting: number | null;
  declare readonly retryAfter: number;

  constructor(problem: Problem, retryAfter: number, requestId: string | null = null) {
    super(409, problem, { requestId, retryAfter });
    this.message = `held by ${String(problem.holder)} until ${String(problem.expires_at)}`;
    this.lockId = typeof problem.lock_id === "number" ? problem.lock_id : null;
    this.holder = typeof problem.holder === "string" ? problem.holder : null;
    this.expiresAt = typeof problem.expires_at === "string" ? problem.expires_at : null;
    this.maxHolders = typeof problem.max_holders === "number" ? problem.max_holders : 1;
    if (Array.isArray(problem.holders)) {
      this.holders = problem.holders;
    } else if (this.lockId !== null) {
      // A service older than semaphores names its one holder only.
      this.holders = [{ lock_id: this.lockId, holder: this.holder ?? "", slot: 0, expires_at: this.expiresAt ?? "" }];
    } else {
      this.holders = [];
    }
    // A service older than 0021 lists every holder, and does not count them.
    this.holdersTotal = typeof problem.holders_total === "number" ? problem.holders_total : this.holders.length;
    this.mode = problem.mode === "shared" ? "shared" : "exclusive";
    if (this.mode === "shared") {
      this.message = `held by ${this.holdersTotal} shared lock(s), the first until ${String(problem.expires_at)}`;
    }
    this.jobType = typeof problem.job_type === "string" ? problem.job_type : null;
    this.waiting = typeof problem.waiting === "number" ? problem.waiting : null;
    if (this.waiting !== null) this.message = `${this.waiting} acquires wait in the queue, and come first`;
  }
}

/**
 * A grant with `holdAtLeastSeconds` closed the key (409 `closed-until`): no lock of it is granted
 * before `closedUntil` (RFC 3339, the database's time), whoever holds it now, if anyone.
 * `retryAfter` counts the whole seconds until then. A LockHeldError, so that code that treats
 * "someone else has it" alike keeps working; of a session's call, `jobType` names the closed key.
 */
export class ClosedUntilError extends LockHeldError {
  override name = "ClosedUntilError";
  readonly closedUntil: string | null;

  constructor(problem: Problem, retryAfter: number, requestId: string | null = null) {
    super(problem, retryAfter, requestId);
    this.closedUntil = typeof problem.closed_until === "string" ? problem.closed_until : null;
    this.message = `closed until ${String(this.closedUntil)}`;
  }
}

/**
 * The key's held locks share another `max_holders` than the acquire named (409
 * `max-holders-mismatch`): a configuration error, which waiting does not cure. `maxHolders` is
 * the value in force.
 */
export class MaxHoldersMismatchError extends ApiError {
  override name = "MaxHoldersMismatchError";
  readonly maxHolders: number | null;

  constructor(problem: Problem, requestId: string | null = null) {
    super(409, problem, { requestId });
    this.maxHolders = typeof problem.max_holders === "number" ? problem.max_holders : null;
  }
}

/**
 * The lock is not held any more: it ended (released, reclaimed, forced), its token does not match,
 * it is gone, or it may have lapsed by this process's own clock because renewals did not succeed
 * in time. `problem` is the service's answer when it said so (410, 403, 404), else null.
 */
export class LockLostError extends HelixLocksError {
  override name = "LockLostError";
  readonly problem: Problem | null;
  readonly status: number | null;

  constructor(message: string, options: { problem?: Problem | null; cause?: unknown } = {}) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.problem = options.problem ?? null;
    this.status = typeof this.problem?.status === "number" ? this.problem.status : null;
  }

  /**
   * A 410 answers only a request whose Lock-Token matched (a wrong one is 403 whatever the
   * state), so `release_reason` "released" means the lock was released with this token: by this
   * holder, through an earlier attempt whose answer was lost.
   */
  get releasedByItsToken(): boolean {
    return (
      this.status === 410 && (this.problem?.release_reason === "released" || this.problem?.end_reason === "released")
    );
  }
}

/**
 * The lock's hold limit (`maxHoldSeconds` at its acquire; `holdLimitAt`) has come, or is about to:
 * a renewal answered `410` `hold-limit-reached`, or the lease's safety margin before the limit was
 * reached on this process's monotonic clock. No renewal takes a lease past the limit, however the
 * holder is doing: the lock is lost as any LockLostError says, and the next acquire of the key
 * reclaims it once the limit has come.
 */
export class HoldLimitError extends LockLostError {
  override name = "HoldLimitError";
  /** The lock's hold limit, as the service sent it (`hold_limit_at`), or null if it did not say. */
  readonly holdLimitAt: string | null;

  constructor(
    message: string,
    options: { problem?: Problem | null; holdLimitAt?: string | null; cause?: unknown } = {},
  ) {
    super(message, options);
    const said = this.problem?.hold_limit_at;
    this.holdLimitAt = options.holdLimitAt ?? (typeof said === "string" ? said : null);
  }
}

/**
 * The service could not be reached, or kept answering 503, until the retries ran out. `status`
 * is the last answer's status (0 when none came), `problem` its problem, if any.
 */
export class UnavailableError extends HelixLocksError {
  override name = "UnavailableError";
  readonly status: number;
  readonly problem: Problem | null;

  constructor(message: string, options: { status?: number; problem?: Problem | null; cause?: unknown } = {}) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.status = options.status ?? 0;
    this.problem = options.problem ?? null;
  }
}
