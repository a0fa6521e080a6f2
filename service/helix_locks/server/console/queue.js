// The queue of the open timeline's key: the acquires waiting for it, first come first, read from
// GET /v1/locks/queue when the timeline opens and every 2 s while it stays open (the event stream
// tells of grants, not of places taken or left).

import { Refused, call, problemText } from './api.js';
import { $, el } from './dom.js';
import { MODE_TITLES, duration, modeOf, unbroken } from './format.js';
import { serverNow, state } from './state.js';

const QUEUE_MS = 2000;
const QUEUE_SHOWN = 50; // the first places; the rest are counted as "more"

export function stopQueue() {
  clearTimeout(state.queueTimer);
  state.queueTimer = null;
}

// Reads the queue of the open timeline's key now, then again every QUEUE_MS until it closes.
export function watchQueue() {
  stopQueue();
  const target = state.timeline;
  $('queue-rows').replaceChildren();
  drawQueue(null, false, 'Loading the queue…');
  const round = async () => {
    await loadQueue(target);
    if (state.timeline === target) state.queueTimer = setTimeout(round, QUEUE_MS);
  };
  round();
}

async function loadQueue(target) {
  const query = new URLSearchParams({
    organization_id: target.org, job_type: target.job, limit: String(QUEUE_SHOWN),
  });
  try {
    const response = await call(`/v1/locks/queue?${query}`);
    if (state.timeline !== target) return;
    if (!response.ok) throw new Error(await problemText(response));
    const page = await response.json();
    if (state.timeline === target) drawQueue(page.items, page.next_cursor !== null, '');
  } catch (error) {
    if (error instanceof Refused || state.timeline !== target) return;
    drawQueue(null, false, `The queue could not be read: ${error.message}`);
  }
}

// Each place: its position, holder, mode (the lock it waits for: shared, a reader, or exclusive),
// max_holders, how long it has waited and how long its wait has left.
function drawQueue(places, more, message) {
  $('queue-state').textContent = message || (more ? `More are waiting than the first ${QUEUE_SHOWN} shown.` : '');
  if (places === null) return; // a failed read keeps the last places drawn
  const now = serverNow();
  const rows = places.map((place) => {
    const mode = modeOf(place);
    return el('tr', { 'data-position': place.position },
      el('td', { class: 'number' }, String(place.position)),
      el('td', { class: `holder${unbroken(place.holder)}` }, el('bdi', {}, place.holder)),
      el('td', { class: `mode ${mode}`, 'data-mode': mode, title: MODE_TITLES[mode] }, mode),
      el('td', { class: 'number' }, String(place.max_holders)),
      el('td', { class: 'number' }, duration(now - Date.parse(place.waiting_since))),
      el('td', { class: 'number' }, duration(Date.parse(place.wait_until) - now, true)));
  });
  if (!rows.length) {
    rows.push(el('tr', {}, el('td', { colspan: 6, class: 'empty' }, 'Nobody is waiting for this key.')));
  }
  $('queue-rows').replaceChildren(...rows);
  $('queue-heading').textContent = places.length
    ? `Waiting for this key (${more ? `${places.length}+` : places.length})` : 'Waiting for this key';
}
