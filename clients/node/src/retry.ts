// When a request is sent again, and after how long: clients/contract.json's policy, which the
// Python SDK follows too (docs/workers.md says why). No I/O here.

/** Statuses that mean the lock is no longer ours, whatever we do (410: for any request). */
export const GONE: ReadonlySet<number> = new Set([403, 404, 410]);
/** Statuses after which a request is sent again, after Retry-After when given, within its time
 * limit: the service did nothing (429), or a proxy or a restarting replica answered (502, 503, 504). */
export const RETRIED: ReadonlySet<number> = new Set([429, 502, 503, 504]);
/** Of those, the ones that may come after the service acted: sent again only if the request is
 * idempotent (every request this client sends is; a POST without an Idempotency-Key would not be),
 * and once the time limit is reached, UnavailableError. A 429 that lasts is thrown as ApiError. */
export const UNKNOWN_OUTCOME: ReadonlySet<number> = new Set([502, 503, 504]);
/** Statuses after which a watch opens its stream again; any other refusal ends it. */
export const WATCH_RETRIED: ReadonlySet<number> = new Set([429, 502, 503, 504]);
export const FIRST_BACKOFF_MS = 50;
export const MAX_BACKOFF_MS = 2000;

/** The pause before retry `attempt` (from 0) when the answer gave no Retry-After, in milliseconds. */
export function backoffMs(attempt: number): number {
  return Math.min(MAX_BACKOFF_MS, FIRST_BACKOFF_MS * 2 ** attempt);
}

/** A Retry-After header's seconds, or null when it has none that reads as a number: delay-seconds,
 * with a fraction allowed; an HTTP date, a sign, hex, an exponent or Infinity is not read (Number()
 * would take the last three), as in the Python SDK. */
export function retryAfterSeconds(value: string | null | undefined): number | null {
  const found = /^[ \t]*([0-9]+(?:\.[0-9]+)?)[ \t]*$/.exec(value ?? "");
  return found === null ? null : Number(found[1]);
}
