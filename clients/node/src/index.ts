/**
 * Helix Locks for Node: a lock that renews itself, an AbortSignal that aborts the moment the lock
 * may be lost, waiting, idempotent retries, typed errors and the event stream.
 *
 *     import { LockClient } from "helix-locks";
 *     const client = new LockClient(); // HELIX_LOCKS_URL, HELIX_LOCKS_API_KEY
 *     await client.withLock({ organizationId: "acme", jobType: "nightly-report", ttl: 30 }, async (lease) => {
 *       await work({ signal: lease.signal, fence: lease.fencingToken });
 *     });
 */

export { defaultHolder, Grant, Lease, LockClient, LockList, SessionGrant, SessionLease } from "./client.js";
export type { LockClientOptions, LockRef } from "./client.js";
export {
  ApiError,
  ClosedUntilError,
  HelixLocksError,
  HoldLimitError,
  LockHeldError,
  LockLostError,
  MaxHoldersMismatchError,
  UnavailableError,
} from "./errors.js";
export { EventStreamDecoder } from "./sse.js";
export type { ServerEvent } from "./sse.js";
export type {
  AcquireOptions,
  Acquired,
  Holder,
  Json,
  ListOptions,
  Lock,
  LockEvent,
  LockKey,
  LockMode,
  LockState,
  Metadata,
  Page,
  Place,
  Problem,
  QueuePage,
  Reclaimed,
  OpenedSession,
  Renewed,
  SessionBody,
  SessionOptions,
  SessionRenewed,
  WatchOptions,
} from "./types.js";
