// The console's one mutable state, and the database's clock as the page estimates it.
//
// Everything that changes while the page runs lives in `state`, owned here; the other modules
// import it by name and keep no mutable state of their own that another module reads.

export const HOUR = 3600 * 1000;

export const state = {
  apiKey: '', // set by the session module from the tab's sessionStorage
  generation: 0, // bumped on sign-out and restart, so that stale work stops
  canForce: false,
  forceKnown: false, // whether /metrics has said yet if this key may force
  // Live locks by id, each with the page's monotonic time at which its ttl_remaining_ms was read.
  live: new Map(),
  // Every lock this page has seen, live or ended: the one store behind the timeline and the charts.
  known: new Map(),
  loading: false,
  listedDuringLoad: new Set(), // ids changed by an event while the listing was being read
  listing: Promise.resolve(), // the listing under way, so that the next one starts after it
  lastEventId: null,
  streamAbort: null,
  pollTimer: null,
  startFailures: 0, // failed first listings in a row, for the backoff of start()
  metricsTimer: null,
  view: { filter: '', sortKey: 'organization_id', sortDir: 1, page: 0 },
  renderedRows: [], // [{entry, ttlText, holdCell, closedCell, ageCell, stateCell}] of the page on screen
  timeline: null, // {org, job, windowMs, start, end, follow, chosen}
  timelineAbort: null, // stops the open timeline's history reading
  queueTimer: null, // the next reading of the open timeline's queue
  forceTarget: null,
  // The database's clock, estimated: a lock's expires_at minus its ttl_remaining_ms is the
  // database's time when it answered; from then on it advances with performance.now(), never the
  // wall clock.
  clock: { server: Date.now(), perf: performance.now() },
};

export function serverNow() {
  return state.clock.server + (performance.now() - state.clock.perf);
}

export function noteClock(items, perfAt) {
  for (const lock of items) {
    if (lock.ttl_remaining_ms > 0 && !lock.released_at) {
      state.clock.server = Date.parse(lock.expires_at) - lock.ttl_remaining_ms;
      state.clock.perf = perfAt;
      return;
    }
  }
}

export function ttlLeft(entry) {
  return Math.max(0, entry.lock.ttl_remaining_ms - (performance.now() - entry.seen));
}

// The time left until a lock's hold limit (hold_limit_at), or null when it has none: by the
// database's clock as the lock's own answer gave it (the limit less its expires_at, plus the lease
// left), and by the page's estimate of that clock once its lease has run out.
export function holdLeft(entry) {
  return leftUntil(entry, entry.lock.hold_limit_at);
}

// The time left until the key opens again (closed_until, set by hold_at_least_seconds), or null
// when the lock's grant closed none: counted as holdLeft counts.
export function closedLeft(entry) {
  return leftUntil(entry, entry.lock.closed_until);
}

function leftUntil(entry, at) {
  const lock = entry.lock;
  if (!at) return null;
  const until = Date.parse(at);
  const left = lock.ttl_remaining_ms > 0
    ? until - Date.parse(lock.expires_at) + lock.ttl_remaining_ms - (performance.now() - entry.seen)
    : until - serverNow();
  return Math.max(0, left);
}

export function age(lock) {
  return serverNow() - Date.parse(lock.acquired_at);
}

export function awaitingReclaim(entry) {
  return entry.lock.state === 'expired' || ttlLeft(entry) === 0;
}

export function remember(lock) {
  state.known.set(lock.id, lock);
}

// Ended locks that no view needs any more are dropped: the charts need the last hour, and the open
// timeline its key's window.
export function forgetOld() {
  const now = serverNow();
  const hourAgo = now - HOUR;
  for (const [id, lock] of state.known) {
    if (!lock.released_at || state.live.has(id)) continue;
    const ended = Date.parse(lock.released_at);
    if (ended >= hourAgo) continue;
    const t = state.timeline;
    if (t && t.org === lock.organization_id && t.job === lock.job_type && ended >= now - t.windowMs) continue;
    state.known.delete(id);
  }
}
