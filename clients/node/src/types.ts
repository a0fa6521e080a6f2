// What the service sends, as it sends it (snake_case, as in docs/api.md), and the options of the
// client's calls (camelCase).

/** A JSON value, as lock metadata holds. */
export type Json = string | number | boolean | null | Json[] | { [key: string]: Json };

/** A lock's metadata: a JSON object (at most 8 KiB serialized), or null. */
export type Metadata = { [key: string]: Json } | null;

/** `held`: live; `expired`: its lease ran out, not yet reclaimed; `released` (by its holder or by
 * force); `reclaimed`: taken over by a later grant. */
export type LockState = "held" | "expired" | "released" | "reclaimed";

/** `exclusive`: no other lock of the key is held beside it; `shared`: a reader, held beside the
 * key's other shared locks (up to 1000, each with a lease of its own), never beside an exclusive one. */
export type LockMode = "exclusive" | "shared";

/** The lock object every endpoint that returns a lock returns (never with its token). */
export interface Lock {
  id: number;
  organization_id: string;
  job_type: string;
  holder: string;
  /** Strictly increases with every grant of the key (across all the slots of a semaphore). */
  fencing_token: number;
  acquired_at: string;
  expires_at: string;
  released_at: string | null;
  release_reason: "released" | "reclaimed" | "forced" | null;
  state: LockState;
  /** Milliseconds of lease left when the database answered. */
  ttl_remaining_ms: number;
  metadata: Metadata;
  /** How many locks may hold the key at once: 1 for a plain lock. */
  max_holders: number;
  /** Which of those places this lock holds, from 0 to max_holders - 1. */
  slot: number;
  /** The id of the admin key that released it by force; null otherwise (absent from older services). */
  forced_by?: string | null;
  /** The session it belongs to, whose token and lease it shares; null for a lock on its own (absent from older services). */
  session_id?: number | null;
  /** exclusive, or shared (a reader, held beside the key's other readers); absent from a service older than modes. */
  mode?: LockMode;
  /** acquired_at + the acquire's max_hold_seconds, by the database's clock: no lease of the lock runs
   * past it, however it is renewed; null without a hold limit (absent from a service older than them). */
  hold_limit_at?: string | null;
  /** acquired_at + the acquire's hold_at_least_seconds, by the database's clock: no other lock of
   * the key is granted before it, whatever becomes of this one; null when the acquire closed none
   * (absent from a service older than closed keys). */
  closed_until?: string | null;
}

/** A session: one lease that its locks share. */
export interface SessionBody {
  id: number;
  organization_id: string;
  holder: string;
  expires_at: string;
  ttl_remaining_ms: number;
  state: "held" | "expired" | "ended";
  /** Its unreleased locks, in job type order. */
  locks: Lock[];
  /** Its creation + max_hold_seconds: no lease of it runs past it, nor so of any of its locks;
   * null without a hold limit (absent from a service older than them). */
  hold_limit_at?: string | null;
}

/** A session's opening answer: with its token. */
export interface OpenedSession extends SessionBody {
  token: string;
}

/** A session's renewal answer: whether its lease had run out before it, and whether the
 * session's hold limit cut the new lease short. */
export interface SessionRenewed extends SessionBody {
  lapsed: boolean;
  /** The new lease ends at hold_limit_at: no renewal takes it further (absent from older services). */
  limited?: boolean;
}

/** The stale lock an acquire took over. */
export interface Reclaimed {
  lock_id: number;
  holder: string;
  expired_at: string;
}

/** An acquire's answer: the lock object, its token, and the lock it reclaimed. */
export interface Acquired extends Lock {
  token: string;
  reclaimed: Reclaimed | null;
}

/** A renewal's answer: the lock object, whether the lease had run out before it, and whether the
 * lock's hold limit cut the new lease short. */
export interface Renewed extends Lock {
  lapsed: boolean;
  /** The new lease ends at hold_limit_at, sooner than the ttl asked: no renewal takes it further
   * (absent from a service older than hold limits). */
  limited?: boolean;
}

/** One held lock of a key, as a 409 `lock-held` lists them. */
export interface Holder {
  lock_id: number;
  holder: string;
  slot: number;
  expires_at: string;
}

/** An RFC 9457 problem as the service sends it: these fields, plus those of its kind. */
export interface Problem {
  type?: string;
  title?: string;
  status?: number;
  detail?: string;
  errors?: Array<{ field: string; message: string }>;
  [field: string]: any;
}

/** One event of `GET /v1/events`: its data, with the stream's `id` added. */
export interface LockEvent {
  /** The event's id: what a watch resumes from. */
  id: string;
  type: "acquired" | "renewed" | "updated" | "released" | "forced" | "expired" | "reclaimed";
  /** When it happened, by the database's clock. */
  at: string;
  /** The lock as it is when the event is read. */
  lock: Lock;
  /** Of an `acquired` event: the stale lock the grant took over, or null. */
  reclaimed?: Reclaimed | null;
}

/** One page of a listing. */
export interface Page {
  items: Lock[];
  /** The cursor of the next page; null when nothing follows. */
  next_cursor: string | null;
}

/** One place in a key's queue (GET /v1/locks/queue): a waiting acquire. */
export interface Place {
  holder: string;
  /** The lock the place waits for; a run of shared places is granted together. */
  mode: LockMode;
  max_holders: number;
  /** When the place was taken (the queue's order), and when it leaves at the latest. */
  waiting_since: string;
  wait_until: string;
  /** From 1: the next to be granted. */
  position: number;
}

/** One page of a key's queue, first place first. */
export interface QueuePage {
  items: Place[];
  /** The cursor of the next page; null when nothing follows. */
  next_cursor: string | null;
}

/** The lock's key: one live lock per key at a time, or up to `maxHolders`. */
export interface LockKey {
  organizationId: string;
  jobType: string;
}

export interface AcquireOptions extends LockKey {
  /** The lease in seconds (1 to 86400); renewed every ttl/3 by withLock. Default 30. */
  ttl?: number;
  /** Seconds to wait for a held lock (any number; in rounds of at most 60). Default 0: LockHeldError at once. */
  wait?: number;
  /** A semaphore: up to this many hold the key at once, each in a slot of its own (1 to 1000). Default 1. */
  maxHolders?: number;
  /** `shared`: a reader, held beside the key's other readers and never beside an exclusive lock,
   * which waits for every reader; a new reader waits behind a waiting writer. Not with `maxHolders`.
   * Default `exclusive`. */
  mode?: LockMode;
  /** A hold limit in seconds (1 to 604800): no lease of the lock runs past its grant plus this
   * (`hold_limit_at`, by the database's clock), however it is renewed, so a holder that hangs while
   * its renewals go on loses the lock then. withLock's signal aborts before it, as before a lease's
   * end. Default: none. */
  maxHoldSeconds?: number;
  /** Closes the key for this many seconds (1 to 604800) from the grant (`closed_until`, by the
   * database's clock): no other lock of the key is granted before then, whatever becomes of this
   * one, released at once included; acquires meanwhile get ClosedUntilError. So a schedule that
   * many machines fire runs once per interval. Exclusive locks with `maxHolders` 1 only.
   * Default: none. */
  holdAtLeastSeconds?: number;
  /** Who holds it, for humans. Default user@host:pid. */
  holder?: string;
  /** The lock's metadata at grant. */
  metadata?: Metadata;
  /** Stops the acquire (its wait and its retries): it rejects with the signal's reason. */
  signal?: AbortSignal;
}

export interface SessionOptions {
  organizationId: string;
  /** The job types whose locks the session holds: 0 to 32, distinct, all granted at once or none. */
  jobTypes: string[];
  /** The job types of `jobTypes` taken as shared locks (readers); the others are exclusive. Default none. */
  shared?: string[];
  /** The session's lease in seconds (1 to 86400), every lock's; renewed every ttl/3 by withSession. Default 30. */
  ttl?: number;
  /** Seconds to wait until all of them are free at once (none is held meanwhile). Default 0. */
  wait?: number;
  /** A hold limit in seconds (1 to 604800) from the session's opening: no lease of the session runs
   * past it, nor so of any of its locks (added ones too). withSession's signal aborts before it.
   * Default: none. */
  maxHoldSeconds?: number;
  holder?: string;
  /** The metadata each lock gets at its grant. */
  metadata?: Metadata;
  signal?: AbortSignal;
}

export interface ListOptions {
  organizationId?: string;
  jobType?: string;
  /** `held` or `expired` (default: both) list live locks; `released` or `reclaimed` read the history. */
  state?: LockState;
  /** Locks per page, 1 to 500; default 100. */
  limit?: number;
  /** Start from this cursor (a page's `next_cursor`). */
  cursor?: string;
  signal?: AbortSignal;
}

export interface WatchOptions {
  /** Only this organization's locks (an organization's key: only its own; omitted, its own, or every one for an admin key). */
  organizationId?: string;
  jobType?: string;
  /** Resume after this event id (an event's `id`). */
  lastEventId?: string;
  /** Ends the watch: the iteration simply stops. */
  signal?: AbortSignal;
  /** Seconds after which a watch that cannot open a stream gives up (UnavailableError); null: never. Default 60. */
  within?: number | null;
}
