// What the page reads besides the event stream: the live locks, the last hour's history for the
// charts, and the conflict counts in /metrics (which also say whether this key may force).

import { Refused, backoff, call, listAll } from './api.js';
import { $, setStatus } from './dom.js';
import { HOUR, serverNow, state } from './state.js';
import { scheduleRender, showForce } from './table.js';

// Listings run one after another: a listing asked for while one runs starts when it ends, so that
// it reads the service after whatever made it wanted (joining the stream, say).
export function loadLive(gen) {
  state.listing = state.listing.then(() => (gen === state.generation ? listLive(gen) : undefined));
  return state.listing;
}

async function listLive(gen) {
  state.loading = true;
  state.listedDuringLoad.clear();
  const fresh = new Set();
  try {
    await listAll({}, null, (items, perfAt) => {
      for (const lock of items) {
        fresh.add(lock.id);
        if (state.listedDuringLoad.has(lock.id)) continue; // an event since is newer than this page
        state.live.set(lock.id, { lock, seen: perfAt });
      }
      scheduleRender();
    });
    for (const id of state.live.keys()) {
      if (!fresh.has(id) && !state.listedDuringLoad.has(id)) state.live.delete(id);
    }
  } catch (error) {
    if (!(error instanceof Refused) && gen === state.generation) setStatus(`Listing failed: ${error.message}`);
  } finally {
    state.loading = false;
    scheduleRender();
  }
}

// Ended locks of the last hour, for the charts (an admin's or anonymous listing covers every
// organization; an organization's key, its own).
export async function loadRecentHistory(gen) {
  const since = serverNow() - HOUR;
  try {
    for (const kind of ['released', 'reclaimed']) {
      await listAll({ state: kind }, (last) => Date.parse(last.released_at) < since);
    }
  } catch (error) {
    if (!(error instanceof Refused) && gen === state.generation) setStatus(`History failed: ${error.message}`);
  }
  scheduleRender();
}

// Only a 403 (or 401) says that this key may not read /metrics; any other failure may pass, so
// it is tried again, later each time.
export async function checkMetrics(gen, failures) {
  state.metricsTimer = null;
  let text = null;
  let refused = false;
  try {
    const response = await call('/metrics');
    if (response.ok) text = await response.text();
    else refused = response.status === 401 || response.status === 403;
  } catch (error) {
    if (error instanceof Refused) return;
  }
  if (gen !== state.generation) return;
  // Only an admin key may read /metrics once keys exist, and only an admin key may force; without
  // any key (anonymous mode) /metrics answers but force is refused.
  state.canForce = Boolean(state.apiKey) && text !== null;
  state.forceKnown = state.forceKnown || refused || text !== null;
  const conflicts = $('conflicts');
  if (refused) {
    conflicts.textContent = 'Conflicts: needs a key that may read /metrics.';
  } else if (text === null) {
    const wait = backoff(failures + 1);
    conflicts.textContent = `Conflicts: unknown for now (/metrics failed); trying again in ${wait / 1000} s.`;
    state.metricsTimer = setTimeout(() => gen === state.generation && checkMetrics(gen, failures + 1), wait);
  } else {
    const counts = conflictCounts(text);
    conflicts.textContent =
      `Conflicts (409) since the service started: ${counts.conflict} on plain locks, ` +
      `${counts.full} on full semaphores (from /metrics).`;
  }
  showForce();
}

// Sums helix_locks_acquisitions_total by result over every organization label.
function conflictCounts(text) {
  const counts = { conflict: 0, full: 0 };
  for (const line of text.split('\n')) {
    if (!line.startsWith('helix_locks_acquisitions_total{')) continue;
    const result = /result="([^"]*)"/.exec(line);
    const value = Number(line.slice(line.lastIndexOf(' ') + 1));
    if (result && result[1] in counts && Number.isFinite(value)) counts[result[1]] += value;
  }
  return counts;
}
