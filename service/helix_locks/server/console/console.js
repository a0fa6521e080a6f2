// The Helix Locks console: live locks, a timeline per key, and force release.
//
// Everything the API answers is user data (holders and metadata most of all), so it reaches the
// page only as text: through createElement, createElementNS, setAttribute and textContent, never
// as HTML. The page's policy allows no inline script or style, and nothing from another origin.
'use strict';

const KEY_STORAGE = 'helix-locks.console.api-key';
const PAGE_SIZE = 50;
const LIST_LIMIT = 500;
const POLL_MS = 5000;
const HOUR = 3600 * 1000;
const LONG_HELD_MS = HOUR;
const SVG_NS = 'http://www.w3.org/2000/svg';
const ENDED = new Set(['released', 'forced', 'reclaimed']);
const TIMELINE_PAGES = 20; // the timeline reads at most this many pages of history per state
const RETRY_FIRST_MS = 1000;
const RETRY_MOST_MS = 10000;
// A key travels in a header: printable ASCII without spaces, of a sane length.
const KEY_PATTERN = /^[\x21-\x7e]{1,512}$/;

// --- State ----------------------------------------------------------------------------------

let apiKey = sessionStorage.getItem(KEY_STORAGE) || '';
let generation = 0; // bumped on sign-out and restart, so that stale work stops
let canForce = false;
// Live locks by id, each with the page's monotonic time at which its ttl_remaining_ms was read.
const live = new Map();
// Every lock this page has seen, live or ended: the one store behind the timeline and the charts.
const known = new Map();
let loading = false;
const listedDuringLoad = new Set(); // ids changed by an event while the listing was being read
let lastEventId = null;
let streamAbort = null;
let pollTimer = null;
let startFailures = 0; // failed first listings in a row, for the backoff of start()
let metricsTimer = null;
const view = { filter: '', sortKey: 'organization_id', sortDir: 1, page: 0 };
let renderedRows = []; // [{entry, ttlCell, ageCell, stateCell}] of the page on screen
let timeline = null; // {org, job, windowMs, start, end, follow}
let forceTarget = null;
let timelineAbort = null; // stops the open timeline's history reading

// The database's clock, estimated: a lock's expires_at minus its ttl_remaining_ms is the database's
// time when it answered; from then on it advances with performance.now(), never the wall clock.
const clock = { server: Date.now(), perf: performance.now() };

function serverNow() {
  return clock.server + (performance.now() - clock.perf);
}

function noteClock(items, perfAt) {
  for (const lock of items) {
    if (lock.ttl_remaining_ms > 0 && !lock.released_at) {
      clock.server = Date.parse(lock.expires_at) - lock.ttl_remaining_ms;
      clock.perf = perfAt;
      return;
    }
  }
}

// --- DOM helpers: text only ----------------------------------------------------------------

function $(id) {
  return document.getElementById(id);
}

function el(tag, attributes, ...children) {
  const element = document.createElement(tag);
  setAttributes(element, attributes);
  for (const child of children) {
    element.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return element;
}

function svgEl(tag, attributes, text) {
  const element = document.createElementNS(SVG_NS, tag);
  setAttributes(element, attributes);
  if (text !== undefined) element.textContent = text;
  return element;
}

function setAttributes(element, attributes) {
  for (const [name, value] of Object.entries(attributes || {})) {
    if (value === null || value === undefined || value === false) continue;
    element.setAttribute(name, value === true ? '' : String(value));
  }
}

function setStatus(text) {
  $('status').textContent = text;
}

// --- Formatting ----------------------------------------------------------------------------

function duration(ms) {
  if (!Number.isFinite(ms)) return '';
  const seconds = Math.max(0, Math.floor(ms / 1000));
  if (seconds < 60) return `${seconds} s`;
  const minutes = Math.floor(seconds / 60);
  if (minutes < 60) return `${minutes} min ${String(seconds % 60).padStart(2, '0')} s`;
  const hours = Math.floor(minutes / 60);
  if (hours < 48) return `${hours} h ${String(minutes % 60).padStart(2, '0')} min`;
  return `${Math.floor(hours / 24)} d ${hours % 24} h`;
}

function utc(ms, withDate) {
  const iso = new Date(ms).toISOString();
  return withDate ? `${iso.slice(5, 10)} ${iso.slice(11, 16)}` : iso.slice(11, 16);
}

function ttlLeft(entry) {
  return Math.max(0, entry.lock.ttl_remaining_ms - (performance.now() - entry.seen));
}

function age(lock) {
  return serverNow() - Date.parse(lock.acquired_at);
}

function awaitingReclaim(entry) {
  return entry.lock.state === 'expired' || ttlLeft(entry) === 0;
}

// --- The API -------------------------------------------------------------------------------

function authHeaders(extra) {
  const headers = Object.assign({}, extra);
  if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
  return headers;
}

class Refused extends Error {}

async function problemText(response) {
  try {
    const body = await response.json();
    const parts = [body.title, body.detail].filter((part) => typeof part === 'string' && part);
    if (parts.length) return `${response.status} ${parts.join(': ')}`;
  } catch (error) {
    // not a problem document: say the status alone
  }
  return `HTTP ${response.status}`;
}

async function call(path, options) {
  const response = await fetch(path, Object.assign({ cache: 'no-store' }, options, {
    headers: authHeaders((options || {}).headers),
  }));
  if (response.status === 401) {
    signOut('The service refused this key (401): sign in again.');
    throw new Refused('unauthenticated');
  }
  return response;
}

// Every page of a listing, by cursor; stopWhen(lastItem) ends the paging early. With options.pages,
// it reads at most that many pages and sets options.cut when more followed; options.signal aborts it.
async function listAll(params, stopWhen, onPage, options) {
  const gen = generation;
  const items = [];
  const limits = options || {};
  let cursor = null;
  let pages = 0;
  do {
    if (limits.pages !== undefined && pages >= limits.pages) {
      limits.cut = true;
      break;
    }
    pages++;
    const query = new URLSearchParams(params);
    query.set('limit', String(LIST_LIMIT));
    if (cursor) query.set('cursor', cursor);
    const response = await call(`/v1/locks?${query}`, { signal: limits.signal });
    if (gen !== generation) throw new Refused('signed out');
    if (!response.ok) throw new Error(await problemText(response));
    const page = await response.json();
    const perfAt = performance.now();
    noteClock(page.items, perfAt);
    for (const lock of page.items) remember(lock);
    items.push(...page.items);
    if (onPage) onPage(page.items, perfAt);
    cursor = page.next_cursor;
    if (stopWhen && page.items.length && stopWhen(page.items[page.items.length - 1])) break;
  } while (cursor);
  return items;
}

function remember(lock) {
  known.set(lock.id, lock);
}

// Ended locks that no view needs any more are dropped: the charts need the last hour, and the open
// timeline its key's window.
function forgetOld() {
  const now = serverNow();
  const hourAgo = now - HOUR;
  for (const [id, lock] of known) {
    if (!lock.released_at || live.has(id)) continue;
    const ended = Date.parse(lock.released_at);
    if (ended >= hourAgo) continue;
    const t = timeline;
    if (t && t.org === lock.organization_id && t.job === lock.job_type && ended >= now - t.windowMs) continue;
    known.delete(id);
  }
}

// --- Start, sign in, sign out --------------------------------------------------------------

// The wait before the next try: 1 s, doubling up to 10 s.
function backoff(failures) {
  return Math.min(RETRY_MOST_MS, RETRY_FIRST_MS * 2 ** Math.max(0, failures - 1));
}

async function start() {
  const gen = ++generation;
  if (apiKey && !KEY_PATTERN.test(apiKey)) {
    forgetKey();
    showSignIn('That key cannot be right: a key is printable ASCII without spaces, at most 512 characters.');
    return;
  }
  $('sign-out').hidden = !apiKey; // a stored key can always be signed out, even while retrying
  setStatus('Connecting…');
  let response = null;
  let problem;
  try {
    response = await fetch('/v1/locks?limit=1', { headers: authHeaders(), cache: 'no-store' });
  } catch (error) {
    problem = 'The service cannot be reached';
  }
  if (gen !== generation) return;
  if (response && response.status === 401) {
    startFailures = 0;
    showSignIn(apiKey ? 'The service refused this key (401).' : '');
    return;
  }
  if (response && !response.ok) {
    problem = `The service refused the listing (${await problemText(response)})`;
    if (response.status < 500) {
      setStatus(`${problem}.`);
      return;
    }
  }
  if (problem) {
    // A network error or a 5xx may pass: try again, later each time.
    const wait = backoff(++startFailures);
    setStatus(`${problem}; trying again in ${wait / 1000} s.`);
    setTimeout(() => gen === generation && start(), wait);
    return;
  }
  startFailures = 0;
  $('sign-in').hidden = true;
  $('sign-out').hidden = !apiKey;
  $('overview').hidden = false;
  $('locks').hidden = false;
  setStatus(apiKey ? 'Signed in with an API key.' : 'No API key: the service answers without one (anonymous mode, loopback only).');
  buildHead();
  checkMetrics(gen, 0);
  // The stream lists the locks each time it joins without a Last-Event-ID, the first time too:
  // joining before listing means that no change falls between the listing and the stream.
  const joined = watch(gen);
  const first = await Promise.race([joined.then(() => 'joined'), sleep(3000)]);
  if (gen !== generation) return;
  if (first !== 'joined') await loadLive(gen); // slow to join: show the locks now, and again once joined
  loadRecentHistory(gen);
}

function showSignIn(message) {
  $('sign-in').hidden = false;
  $('overview').hidden = true;
  $('locks').hidden = true;
  $('timeline').hidden = true;
  $('sign-out').hidden = true;
  $('sign-in-error').textContent = message || '';
  setStatus('Sign in with an API key.');
  $('api-key').focus();
}

function forgetKey() {
  apiKey = '';
  sessionStorage.removeItem(KEY_STORAGE);
}

function signOut(message) {
  generation++;
  forgetKey();
  // An open dialog would keep the sign-in form out of reach, and its action needs the key.
  for (const dialog of document.querySelectorAll('dialog[open]')) dialog.close();
  forceTarget = null;
  closeTimeline();
  if (metricsTimer !== null) clearTimeout(metricsTimer);
  metricsTimer = null;
  stopStream();
  stopPolling();
  live.clear();
  known.clear();
  lastEventId = null;
  canForce = false;
  renderedRows = [];
  $('lock-rows').replaceChildren();
  $('charts').replaceChildren();
  showSignIn(message);
}

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

// --- Loading -------------------------------------------------------------------------------

// Listings run one after another: a listing asked for while one runs starts when it ends, so that
// it reads the service after whatever made it wanted (joining the stream, say).
let listing = Promise.resolve();
function loadLive(gen) {
  listing = listing.then(() => (gen === generation ? listLive(gen) : undefined));
  return listing;
}

async function listLive(gen) {
  loading = true;
  listedDuringLoad.clear();
  const fresh = new Set();
  try {
    await listAll({}, null, (items, perfAt) => {
      for (const lock of items) {
        fresh.add(lock.id);
        if (listedDuringLoad.has(lock.id)) continue; // an event since is newer than this page
        live.set(lock.id, { lock, seen: perfAt });
      }
      scheduleRender();
    });
    for (const id of live.keys()) {
      if (!fresh.has(id) && !listedDuringLoad.has(id)) live.delete(id);
    }
  } catch (error) {
    if (!(error instanceof Refused) && gen === generation) setStatus(`Listing failed: ${error.message}`);
  } finally {
    loading = false;
    scheduleRender();
  }
}

// Ended locks of the last hour, for the charts (an admin's or anonymous listing covers every
// organization; an organization's key, its own).
async function loadRecentHistory(gen) {
  const since = serverNow() - HOUR;
  try {
    for (const state of ['released', 'reclaimed']) {
      await listAll({ state }, (last) => Date.parse(last.released_at) < since);
    }
  } catch (error) {
    if (!(error instanceof Refused) && gen === generation) setStatus(`History failed: ${error.message}`);
  }
  scheduleRender();
}

// Only a 403 (or 401) says that this key may not read /metrics; any other failure may pass, so
// it is tried again, later each time.
async function checkMetrics(gen, failures) {
  metricsTimer = null;
  let text = null;
  let refused = false;
  try {
    const response = await call('/metrics');
    if (response.ok) text = await response.text();
    else refused = response.status === 401 || response.status === 403;
  } catch (error) {
    if (error instanceof Refused) return;
  }
  if (gen !== generation) return;
  // Only an admin key may read /metrics once keys exist, and only an admin key may force; without
  // any key (anonymous mode) /metrics answers but force is refused.
  canForce = Boolean(apiKey) && text !== null;
  const conflicts = $('conflicts');
  if (refused) {
    conflicts.textContent = 'Conflicts: needs a key that may read /metrics.';
  } else if (text === null) {
    const wait = backoff(failures + 1);
    conflicts.textContent = `Conflicts: unknown for now (/metrics failed); trying again in ${wait / 1000} s.`;
    metricsTimer = setTimeout(() => gen === generation && checkMetrics(gen, failures + 1), wait);
  } else {
    const counts = conflictCounts(text);
    conflicts.textContent =
      `Conflicts (409) since the service started: ${counts.conflict} on plain locks, ` +
      `${counts.full} on full semaphores (from /metrics).`;
  }
  scheduleRender();
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

// --- The event stream ----------------------------------------------------------------------

// Reads GET /v1/events with fetch (EventSource cannot send Authorization) until signed out.
// Resolves the returned promise once the stream is joined, or has failed to open.
function watch(gen) {
  let joinedResolve;
  const joined = new Promise((resolve) => {
    joinedResolve = resolve;
  });
  (async () => {
    let failures = 0;
    while (gen === generation) {
      const controller = new AbortController();
      streamAbort = controller;
      let response = null;
      const resumeFrom = lastEventId;
      try {
        const headers = { Accept: 'text/event-stream' };
        if (resumeFrom) headers['Last-Event-ID'] = resumeFrom;
        response = await call('/v1/events', { headers, signal: controller.signal });
      } catch (error) {
        if (error instanceof Refused) return;
        response = null;
      }
      if (gen !== generation) return;
      if (response && response.status === 410) {
        // Too far behind to replay: join from now, then list everything again (once joined, below).
        lastEventId = null;
        setStreamState('Resuming was refused (410): joining again, then listing.');
        continue;
      }
      if (!response || !response.ok || !response.body) {
        failures++;
        setStreamState(`Live updates unavailable${response ? ` (${await problemText(response)})` : ''}: polling every 5 s.`);
        startPolling(gen);
        joinedResolve();
        await sleep(failures > 3 ? 30000 : POLL_MS);
        continue;
      }
      try {
        await readStream(response.body, gen, () => {
          failures = 0;
          const polling = pollTimer !== null;
          stopPolling();
          // A stream joined without Last-Event-ID replays nothing, and polling may have missed a
          // change since its last round: list again, now that every later change reaches the stream.
          if (!resumeFrom || polling) loadLive(gen);
          if (metricsTimer !== null) {
            clearTimeout(metricsTimer);
            checkMetrics(gen, 1);
          }
          setStreamState('Live: following the event stream.');
          joinedResolve();
        });
      } catch (error) {
        // the connection broke: resume below
      }
      if (gen !== generation) return;
      setStreamState('The event stream was cut: resuming…');
      await sleep(1000);
    }
  })();
  return joined;
}

function stopStream() {
  if (streamAbort) streamAbort.abort();
  streamAbort = null;
}

function setStreamState(text) {
  $('stream-state').textContent = text;
}

// Server-Sent Events, parsed by hand: "field: value" lines, an event ends at a blank line, lines
// starting with ":" are comments (keep-alives).
async function readStream(body, gen, onJoined) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let rest = '';
  let joined = false;
  let event = { type: '', data: [], id: null };
  for (;;) {
    const { value, done } = await reader.read();
    if (done || gen !== generation) return;
    if (!joined) {
      joined = true;
      onJoined();
    }
    let text = rest + value;
    let held = '';
    if (text.endsWith('\r')) {
      held = '\r'; // perhaps the first half of a CRLF
      text = text.slice(0, -1);
    }
    const lines = text.split(/\r\n|\r|\n/);
    rest = lines.pop() + held;
    for (const line of lines) {
      if (line === '') {
        if (event.id !== null) lastEventId = event.id;
        if (event.data.length) dispatch(event.type || 'message', event.data.join('\n'));
        event = { type: '', data: [], id: null };
        continue;
      }
      if (line.startsWith(':')) continue;
      const colon = line.indexOf(':');
      const field = colon < 0 ? line : line.slice(0, colon);
      let fieldValue = colon < 0 ? '' : line.slice(colon + 1);
      if (fieldValue.startsWith(' ')) fieldValue = fieldValue.slice(1);
      if (field === 'event') event.type = fieldValue;
      else if (field === 'data') event.data.push(fieldValue);
      else if (field === 'id' && !fieldValue.includes('\0')) event.id = fieldValue;
    }
  }
}

function dispatch(type, data) {
  let payload;
  try {
    payload = JSON.parse(data);
  } catch (error) {
    return;
  }
  const lock = payload && payload.lock;
  if (!lock || typeof lock.id !== 'number') return;
  const seen = performance.now();
  remember(lock);
  if (loading) listedDuringLoad.add(lock.id);
  if (type === 'acquired' && payload.reclaimed) live.delete(payload.reclaimed.lock_id);
  if (ENDED.has(type) || lock.released_at) {
    live.delete(lock.id);
  } else if (['acquired', 'renewed', 'updated', 'expired'].includes(type)) {
    live.set(lock.id, { lock, seen });
  }
  scheduleRender();
  if (timeline && timeline.org === lock.organization_id && timeline.job === lock.job_type) {
    scheduleTimeline();
  }
}

function startPolling(gen) {
  if (pollTimer !== null) return;
  const round = async () => {
    if (gen !== generation) return;
    await loadLive(gen);
    if (gen === generation && pollTimer !== null) pollTimer = setTimeout(round, POLL_MS);
  };
  pollTimer = setTimeout(round, 0);
}

function stopPolling() {
  if (pollTimer !== null) clearTimeout(pollTimer);
  pollTimer = null;
}

// --- The table -----------------------------------------------------------------------------

const COLUMNS = [
  { key: 'organization_id', label: 'Organization', value: (e) => e.lock.organization_id },
  { key: 'job_type', label: 'Job type', value: (e) => e.lock.job_type },
  { key: 'holder', label: 'Holder', value: (e) => e.lock.holder },
  { key: 'state', label: 'State', value: (e) => (awaitingReclaim(e) ? 'expired' : e.lock.state) },
  { key: 'slot', label: 'Slot / max', value: (e) => e.lock.slot },
  { key: 'fencing_token', label: 'Fencing token', value: (e) => e.lock.fencing_token },
  { key: 'ttl', label: 'TTL left', value: (e) => ttlLeft(e) },
  { key: 'age', label: 'Age', value: (e) => -Date.parse(e.lock.acquired_at) },
  { key: 'metadata', label: 'Metadata', value: (e) => metadataText(e.lock) },
  { key: null, label: 'Action' },
];

// Each lock's metadata as text, made once per lock object: sorting must not stringify every lock.
const metadataTexts = new WeakMap();
function metadataText(lock) {
  let text = metadataTexts.get(lock);
  if (text === undefined) {
    text = lock.metadata === null || lock.metadata === undefined ? '' : JSON.stringify(lock.metadata);
    metadataTexts.set(lock, text);
  }
  return text;
}

function buildHead() {
  const row = $('lock-head');
  row.replaceChildren();
  for (const column of COLUMNS) {
    const th = el('th', { scope: 'col' });
    if (column.key) {
      const sorted = view.sortKey === column.key;
      th.setAttribute('aria-sort', sorted ? (view.sortDir > 0 ? 'ascending' : 'descending') : 'none');
      const button = el('button', { type: 'button', class: 'sort', 'data-sort': column.key }, column.label);
      if (sorted) button.append(el('span', { 'aria-hidden': 'true' }, view.sortDir > 0 ? ' ▲' : ' ▼'));
      button.addEventListener('click', () => {
        view.sortDir = view.sortKey === column.key ? -view.sortDir : 1;
        view.sortKey = column.key;
        view.page = 0;
        buildHead();
        render();
        row.querySelector(`button[data-sort="${column.key}"]`).focus();
      });
      th.append(button);
    } else {
      th.append(column.label);
    }
    row.append(th);
  }
}

function visibleEntries() {
  const needle = view.filter.trim().toLowerCase();
  let entries = Array.from(live.values());
  if (needle) {
    entries = entries.filter((entry) => {
      const lock = entry.lock;
      if (entry.text === undefined || entry.textOf !== lock) {
        entry.text = [lock.organization_id, lock.job_type, lock.holder, lock.state, metadataText(lock)]
          .join('\n')
          .toLowerCase();
        entry.textOf = lock;
      }
      return entry.text.includes(needle) || (needle === 'expired' && awaitingReclaim(entry));
    });
  }
  const column = COLUMNS.find((c) => c.key === view.sortKey) || COLUMNS[0];
  const keyed = entries.map((entry) => [column.value(entry), entry]);
  keyed.sort((a, b) => {
    const order = a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : a[1].lock.id - b[1].lock.id;
    return order * view.sortDir;
  });
  return keyed.map((pair) => pair[1]);
}

let renderPending = false;
function scheduleRender() {
  if (renderPending) return;
  renderPending = true;
  setTimeout(() => {
    renderPending = false;
    render();
  }, 100);
}

function render() {
  if ($('locks').hidden) return;
  const entries = visibleEntries();
  const pages = Math.max(1, Math.ceil(entries.length / PAGE_SIZE));
  view.page = Math.min(view.page, pages - 1);
  const shown = entries.slice(view.page * PAGE_SIZE, (view.page + 1) * PAGE_SIZE);
  const body = $('lock-rows');
  const focused = document.activeElement && body.contains(document.activeElement)
    ? document.activeElement.getAttribute('data-focus') : null;
  renderedRows = [];
  const rows = shown.map((entry) => row(entry));
  body.replaceChildren(...rows);
  if (!rows.length) {
    const text = loading ? 'Loading…' : live.size ? 'No live lock matches the filter.' : 'No live locks.';
    body.append(el('tr', {}, el('td', { colspan: COLUMNS.length, class: 'empty' }, text)));
  }
  if (focused) {
    const again = body.querySelector(`[data-focus="${CSS.escape(focused)}"]`);
    if (again) again.focus();
  }
  $('lock-count').textContent = `(${live.size.toLocaleString('en')}${loading ? ', loading…' : ''})`;
  $('page-info').textContent =
    `Page ${view.page + 1} of ${pages}: ${entries.length.toLocaleString('en')} shown of ${live.size.toLocaleString('en')}`;
  $('previous-page').disabled = view.page === 0;
  $('next-page').disabled = view.page >= pages - 1;
  renderCharts();
}

function row(entry) {
  const lock = entry.lock;
  const keyButton = el('button', {
    type: 'button', class: 'key',
    'data-focus': `key-${lock.id}`,
    title: 'Open the timeline of this organization and job type',
  }, el('bdi', {}, lock.job_type));
  keyButton.addEventListener('click', () => openTimeline(lock.organization_id, lock.job_type));
  const stateCell = el('td', { class: 'state' });
  const ttlCell = el('td', { class: 'number ttl' });
  const ageCell = el('td', { class: 'number age' });
  const action = el('td', {});
  if (canForce) {
    const force = el('button', {
      type: 'button', class: 'danger force', 'data-focus': `force-${lock.id}`,
      'aria-label': `Force release lock ${lock.id}`,
    }, 'Force…');
    force.addEventListener('click', () => askForce(lock.id));
    action.append(force);
  }
  const tr = el('tr', { 'data-lock-id': lock.id },
    el('td', { class: 'org' }, el('bdi', {}, lock.organization_id)),
    el('td', {}, keyButton),
    el('td', { class: 'holder' }, el('bdi', {}, lock.holder)),
    stateCell,
    el('td', { class: 'number' }, `${lock.slot} / ${lock.max_holders}`),
    el('td', { class: 'number' }, String(lock.fencing_token)),
    ttlCell,
    ageCell,
    el('td', { class: 'metadata' }, el('code', {}, el('bdi', {}, metadataText(lock)))),
    action);
  const rendered = { entry, stateCell, ttlCell, ageCell };
  tick(rendered);
  renderedRows.push(rendered);
  return tr;
}

// The cells that move with time: the lease left, the age and the marks they lead to.
function tick(rendered) {
  const entry = rendered.entry;
  const left = ttlLeft(entry);
  rendered.ttlCell.textContent = left > 0 ? `${(left / 1000).toFixed(1)} s` : '0 s';
  const held = age(entry.lock);
  rendered.ageCell.textContent = duration(held);
  const marks = [];
  if (awaitingReclaim(entry)) marks.push(['expired', 'expired: awaiting reclaim']);
  if (held > LONG_HELD_MS) marks.push(['long', 'held over 1 h']);
  const signature = marks.map((mark) => mark[0]).join(' ');
  if (rendered.signature === signature) return;
  rendered.signature = signature;
  const state = marks.length && marks[0][0] === 'expired' ? 'expired' : entry.lock.state;
  rendered.stateCell.replaceChildren(state);
  for (const [kind, text] of marks) {
    rendered.stateCell.append(' ', el('span', { class: `badge ${kind}`, 'data-mark': kind }, text));
  }
}

setInterval(() => {
  for (const rendered of renderedRows) tick(rendered);
}, 250);

// --- Charts: the last hour, per 5 minutes, from the locks already fetched --------------------

// At most one drawing every 2 s, however many events come; the last change is always drawn.
let chartsAt = -Infinity;
let chartsTimer = null;
function renderCharts() {
  const wait = chartsAt + 2000 - performance.now();
  if (wait > 0) {
    if (chartsTimer === null) {
      chartsTimer = setTimeout(() => {
        chartsTimer = null;
        renderCharts();
      }, wait);
    }
    return;
  }
  chartsAt = performance.now();
  forgetOld();
  const now = serverNow();
  const buckets = 12;
  const width = 5 * 60 * 1000;
  const start = now - buckets * width;
  const series = {
    grants: new Array(buckets).fill(0),
    reclaims: new Array(buckets).fill(0),
    forced: new Array(buckets).fill(0),
  };
  const bucket = (time) => Math.floor((time - start) / width);
  for (const lock of known.values()) {
    const granted = bucket(Date.parse(lock.acquired_at));
    if (granted >= 0 && granted < buckets) series.grants[granted]++;
    if (lock.released_at) {
      const ended = bucket(Date.parse(lock.released_at));
      if (ended >= 0 && ended < buckets) {
        if (lock.release_reason === 'reclaimed') series.reclaims[ended]++;
        if (lock.release_reason === 'forced') series.forced[ended]++;
      }
    }
  }
  const charts = [
    ['Grants', series.grants],
    ['Reclaims (crashes)', series.reclaims],
    ['Forced releases', series.forced],
  ].map(([name, values]) => barChart(name, values, start, width));
  $('charts').replaceChildren(...charts);
}

// The buckets move with time even when nothing changes.
setInterval(() => {
  if (!$('overview').hidden) renderCharts();
}, 30000);

function barChart(name, values, start, width) {
  const total = values.reduce((a, b) => a + b, 0);
  const figure = el('figure', { class: 'chart' });
  const w = 180;
  const h = 48;
  const most = Math.max(1, ...values);
  const svg = svgEl('svg', {
    viewBox: `0 0 ${w} ${h + 12}`, width: w, height: h + 12, role: 'img',
    'aria-label': `${name} per 5 minutes over the last hour: ${values.join(', ')}`,
  });
  const barWidth = w / values.length;
  values.forEach((value, i) => {
    const barHeight = value ? Math.max(2, (value / most) * h) : 0;
    const bar = svgEl('rect', {
      x: i * barWidth + 1, y: h - barHeight, width: barWidth - 2, height: barHeight, class: 'chart-bar',
    });
    const g = svgEl('g', {});
    g.append(svgEl('title', {}, `${utc(start + i * width)}–${utc(start + (i + 1) * width)} UTC: ${value}`));
    g.append(svgEl('rect', { x: i * barWidth, y: 0, width: barWidth, height: h, class: 'chart-hit' }), bar);
    svg.append(g);
  });
  svg.append(svgEl('line', { x1: 0, x2: w, y1: h + 0.5, y2: h + 0.5, class: 'axis' }));
  svg.append(svgEl('text', { x: 0, y: h + 11, class: 'tick' }, '−1 h'));
  svg.append(svgEl('text', { x: w, y: h + 11, class: 'tick end' }, 'now'));
  figure.append(el('figcaption', {}, `${name}: ${total}`), svg);
  return figure;
}

// --- Force release -------------------------------------------------------------------------

function askForce(id) {
  const entry = live.get(id);
  if (!entry) return;
  const lock = entry.lock;
  forceTarget = lock;
  // Each value sits in its own <bdi>, so that a direction mark in it cannot reorder the sentence.
  $('force-text').replaceChildren(
    `Break lock ${lock.id} of `, el('bdi', {}, lock.organization_id), ' / ', el('bdi', {}, lock.job_type),
    ` (slot ${lock.slot}), held by “`, el('bdi', { class: 'holder' }, lock.holder),
    `” for ${duration(age(lock))}? Its holder is not told until its next renewal or release, which `,
    'will answer 410.');
  $('force-error').textContent = '';
  $('force-confirm').disabled = false;
  $('force-dialog').showModal();
  $('force-cancel').focus();
}

async function confirmForce() {
  const lock = forceTarget;
  if (!lock || !apiKey) return; // only an admin key may force: never send it without one
  $('force-confirm').disabled = true;
  let response;
  try {
    response = await call(`/v1/locks/${encodeURIComponent(lock.id)}?force=true`, { method: 'DELETE' });
  } catch (error) {
    if (!(error instanceof Refused)) $('force-error').textContent = `The request failed: ${error.message}`;
    $('force-confirm').disabled = false;
    return;
  }
  if (response.status === 204) {
    live.delete(lock.id);
    scheduleRender();
    $('force-dialog').close();
    setStatus(`Lock ${lock.id} (holder “${lock.holder}”) was released by force.`);
    return;
  }
  $('force-error').textContent = await problemText(response);
  $('force-confirm').disabled = false;
}

// --- The timeline --------------------------------------------------------------------------

function closeTimeline() {
  if (timelineAbort) timelineAbort.abort();
  timelineAbort = null;
  timeline = null;
  $('timeline').hidden = true;
}

function openTimeline(org, job) {
  closeTimeline();
  const now = serverNow();
  timeline = { org, job, windowMs: HOUR, start: now - HOUR, end: now, follow: true };
  $('timeline').hidden = false;
  $('timeline-heading').replaceChildren('Timeline of ', el('bdi', {}, org), ' / ', el('bdi', {}, job));
  setWindowButtons();
  drawTimeline();
  loadTimeline();
  $('timeline-heading').focus();
}

function setWindowButtons() {
  for (const button of document.querySelectorAll('button.window')) {
    button.setAttribute('aria-pressed', String(Number(button.dataset.window) === timeline.windowMs));
  }
}

// Reads the key's history for the window, newest first, at most TIMELINE_PAGES pages per state; a
// new window, another timeline or closing it stops the reading.
async function loadTimeline() {
  const target = timeline;
  if (!target) return;
  if (timelineAbort) timelineAbort.abort();
  const controller = new AbortController();
  timelineAbort = controller;
  const since = serverNow() - target.windowMs;
  const filter = { organization_id: target.org, job_type: target.job };
  target.message = 'Loading the history…';
  $('timeline-state').textContent = target.message;
  let oldest = null; // the oldest release read, when a state had more pages than were read
  try {
    for (const state of ['released', 'reclaimed']) {
      const options = { pages: TIMELINE_PAGES, signal: controller.signal };
      const items = await listAll(Object.assign({ state }, filter), (last) => Date.parse(last.released_at) < since,
        null, options);
      if (options.cut && items.length) {
        const last = Date.parse(items[items.length - 1].released_at);
        oldest = oldest === null ? last : Math.max(oldest, last);
      }
    }
    await listAll(filter, null, (items, perfAt) => {
      for (const lock of items) live.set(lock.id, { lock, seen: perfAt });
    }, { signal: controller.signal });
    target.message = oldest === null ? '' :
      `Showing the newest ${(TIMELINE_PAGES * LIST_LIMIT).toLocaleString('en')} ended locks of each kind, ` +
      `back to ${new Date(oldest).toISOString()}; older ones were not loaded.`;
  } catch (error) {
    if (controller.signal.aborted) return;
    target.message = error instanceof Refused ? '' : `The history could not be read: ${error.message}`;
  }
  if (timelineAbort === controller) timelineAbort = null;
  if (timeline === target) drawTimeline();
}

let timelinePending = false;
function scheduleTimeline() {
  if (timelinePending) return;
  timelinePending = true;
  setTimeout(() => {
    timelinePending = false;
    if (timeline) drawTimeline();
  }, 200);
}

// While the view follows now, it is drawn again every 5 s; but not when it would move by less than
// a pixel (a week's view moves a pixel in some 14 minutes), unless a minute has passed. Every
// change of the view or of its locks draws it at once anyway.
setInterval(() => {
  const t = timeline;
  if (!t || !t.follow) return;
  const moved = ((serverNow() - t.end) / (t.end - t.start)) * t.plot;
  if (moved < 1 && performance.now() - t.drawnAt < 60000) return;
  drawTimeline();
}, 5000);

// The bar of each lock: [start, end of its lease or release, the reclaim gap's end or null, kind].
// An ended lock's bar never changes: it is worked out once per lock object.
const endedSpans = new WeakMap();
function lockSpan(lock, now) {
  if (!lock.released_at) return spanOf(lock, now);
  let span = endedSpans.get(lock);
  if (span === undefined) {
    span = spanOf(lock, now);
    endedSpans.set(lock, span);
  }
  return span;
}

function spanOf(lock, now) {
  const start = Date.parse(lock.acquired_at);
  const expires = Date.parse(lock.expires_at);
  if (lock.release_reason === 'reclaimed') {
    return [start, Math.min(expires, Date.parse(lock.released_at)), Date.parse(lock.released_at), 'reclaimed'];
  }
  if (lock.released_at) return [start, Date.parse(lock.released_at), null, lock.release_reason || 'released'];
  if (lock.state === 'expired' || expires < now) return [start, expires, now, 'expired'];
  return [start, now, null, 'held'];
}

function lockTitle(lock, kind, gapMs) {
  const lines = [
    `lock ${lock.id}: ${kind}`,
    `holder: ${lock.holder}`,
    `slot ${lock.slot} of ${lock.max_holders}, fencing token ${lock.fencing_token}`,
    `acquired ${lock.acquired_at}`,
    `expires ${lock.expires_at}`,
  ];
  if (lock.released_at) lines.push(`released ${lock.released_at} (${lock.release_reason})`);
  if (lock.forced_by) lines.push(`forced by the admin key ${lock.forced_by}`);
  if (kind === 'reclaimed') lines.push(`crash: ${duration(gapMs)} from the lease's end to the reclaim`);
  if (kind === 'expired') lines.push(`lease ran out ${duration(gapMs)} ago: awaiting reclaim`);
  if (lock.metadata !== null && lock.metadata !== undefined) lines.push(`metadata ${metadataText(lock)}`);
  return lines.join('\n');
}

function tickStep(span) {
  const minute = 60 * 1000;
  const steps = [minute, 5 * minute, 10 * minute, 15 * minute, 30 * minute, HOUR, 3 * HOUR, 6 * HOUR,
    12 * HOUR, 24 * HOUR, 48 * HOUR];
  return steps.find((step) => span / step <= 8) || 7 * 24 * HOUR;
}

function drawTimeline() {
  if (!timeline) return;
  const t = timeline;
  const now = serverNow();
  if (t.follow) {
    const span = t.end - t.start;
    t.end = now;
    t.start = now - span;
  }
  const locks = Array.from(known.values()).filter(
    (lock) => lock.organization_id === t.org && lock.job_type === t.job,
  );
  const inView = locks
    .map((lock) => [lock, lockSpan(lock, now)])
    .filter(([, span]) => (span[2] ?? span[1]) >= t.start && span[0] <= t.end);
  const lanes = inView.reduce((most, [lock]) => Math.max(most, lock.slot + 1), 1);
  const box = $('timeline-chart');
  const width = Math.max(320, Math.floor(box.clientWidth || 800));
  const left = 60;
  const right = 12;
  const top = 22;
  const laneHeight = 30;
  const height = top + lanes * laneHeight + 8;
  const plot = width - left - right;
  t.plot = plot;
  t.drawnAt = performance.now();
  const x = (time) => left + ((time - t.start) / (t.end - t.start)) * plot;
  const clamp = (value) => Math.max(left, Math.min(left + plot, value));

  const svg = svgEl('svg', {
    width, height, viewBox: `0 0 ${width} ${height}`, class: 'timeline-svg', role: 'group',
    'aria-label': `Locks of ${t.org} / ${t.job} from ${new Date(t.start).toISOString()} to ${new Date(t.end).toISOString()}`,
  });
  const defs = svgEl('defs', {});
  const hatch = svgEl('pattern', {
    id: 'hatch', width: 6, height: 6, patternUnits: 'userSpaceOnUse', patternTransform: 'rotate(45)',
  });
  hatch.append(svgEl('rect', { width: 6, height: 6, class: 'hatch-ground' }));
  hatch.append(svgEl('line', { x1: 0, y1: 0, x2: 0, y2: 6, class: 'hatch-line' }));
  const clip = svgEl('clipPath', { id: 'plot' });
  clip.append(svgEl('rect', { x: left, y: 0, width: plot, height }));
  defs.append(hatch, clip);
  svg.append(defs);

  const step = tickStep(t.end - t.start);
  const withDate = t.end - t.start > 24 * HOUR;
  for (let time = Math.ceil(t.start / step) * step; time <= t.end; time += step) {
    const at = x(time);
    svg.append(svgEl('line', { x1: at, x2: at, y1: top - 4, y2: height - 8, class: 'grid' }));
    svg.append(svgEl('text', { x: at, y: 12, class: 'tick middle' }, utc(time, withDate)));
  }
  for (let lane = 0; lane < lanes; lane++) {
    const y = top + lane * laneHeight;
    svg.append(svgEl('text', { x: 4, y: y + laneHeight / 2 + 4, class: 'lane-label' }, `slot ${lane}`));
    svg.append(svgEl('line', { x1: left, x2: left + plot, y1: y + laneHeight, y2: y + laneHeight, class: 'lane' }));
  }
  const bars = svgEl('g', { 'clip-path': 'url(#plot)' });
  // Ended locks narrower than a pixel, when several share a pixel of a lane, are drawn as one bar
  // there, so that a busy week
  // costs a few thousand bars at most, however many locks it had. The bar takes the kind that
  // matters most among its locks: a forced release, else a crash, else a release.
  const rank = { released: 0, reclaimed: 1, forced: 2 };
  const merged = new Map();
  for (const [lock, [start, end, gapEnd, kind]] of inView) {
    if (!lock.released_at || x(gapEnd ?? end) - x(start) >= 1) continue;
    const pixel = Math.floor(clamp(x(start)));
    const name = lock.slot * 100000 + pixel;
    let bucket = merged.get(name);
    if (bucket === undefined) {
      bucket = { slot: lock.slot, pixel, kind, counts: {}, first: start, last: end, locks: [] };
      merged.set(name, bucket);
    }
    bucket.locks.push(lock);
    bucket.counts[kind] = (bucket.counts[kind] || 0) + 1;
    if ((rank[kind] || 0) > (rank[bucket.kind] || 0)) bucket.kind = kind;
    bucket.first = Math.min(bucket.first, start);
    bucket.last = Math.max(bucket.last, gapEnd ?? end);
  }
  const drawnMerged = new Set();
  for (const bucket of merged.values()) {
    if (bucket.locks.length === 1) continue; // a lock alone in its pixel is drawn as itself, below
    for (const lock of bucket.locks) drawnMerged.add(lock);
    const counts = Object.entries(bucket.counts).map(([kind, count]) => `${count} ${kind}`).join(', ');
    const text = `${counts} in slot ${bucket.slot}, from ${new Date(bucket.first).toISOString()} to ` +
      `${new Date(bucket.last).toISOString()}: zoom in for each lock`;
    const group = svgEl('g', {
      class: `lock merged ${bucket.kind}`, 'data-kind': 'merged', tabindex: 0, role: 'img', 'aria-label': text,
    });
    group.append(svgEl('title', {}, text));
    group.append(svgEl('rect', {
      x: bucket.pixel, y: top + bucket.slot * laneHeight + 5, width: 1, height: laneHeight - 10, class: 'bar',
    }));
    bars.append(group);
  }
  for (const [lock, [start, end, gapEnd, kind]] of inView) {
    if (drawnMerged.has(lock)) continue;
    const y = top + lock.slot * laneHeight + 5;
    const h = laneHeight - 10;
    const gapMs = gapEnd === null ? 0 : gapEnd - end;
    const title = lockTitle(lock, kind, gapMs);
    // Focusable, and named as its tooltip, so that its facts are reachable by keyboard too.
    const group = svgEl('g', {
      class: `lock ${kind}`, 'data-kind': kind, 'data-lock-id': lock.id, tabindex: 0, role: 'img',
      'aria-label': title,
    });
    group.append(svgEl('title', {}, title));
    const x0 = clamp(x(start));
    const x1 = clamp(x(end));
    group.append(svgEl('rect', { x: x0, y, width: Math.max(2, x1 - x0), height: h, class: 'bar' }));
    if (gapEnd !== null) {
      const g1 = clamp(x(gapEnd));
      group.append(svgEl('rect', {
        x: x1, y, width: Math.max(2, g1 - x1), height: h,
        class: kind === 'reclaimed' ? 'gap reclaim' : 'gap awaiting', fill: 'url(#hatch)',
        'data-mark': kind === 'reclaimed' ? 'reclaim' : 'awaiting-reclaim',
      }));
      if (kind === 'reclaimed') {
        group.append(svgEl('line', { x1: g1, x2: g1, y1: y - 3, y2: y + h + 3, class: 'reclaim-mark' }));
        if (g1 - x1 > 50) {
          group.append(svgEl('text', { x: x1 + 3, y: y + h - 5, class: 'gap-label' }, 'reclaim'));
        }
      }
    }
    if (kind === 'forced') {
      group.append(svgEl('text', { x: x1, y: y + h / 2 + 5, class: 'forced-mark middle', 'data-mark': 'forced' }, '✕'));
      if (lock.forced_by) group.setAttribute('data-forced-by', lock.forced_by);
    }
    if (x1 - x0 > 70) {
      group.append(svgEl('text', { x: x0 + 4, y: y + h - 5, class: 'bar-label' }, lock.holder.slice(0, 40)));
    }
    bars.append(group);
  }
  svg.append(bars);
  if (now >= t.start && now <= t.end) {
    svg.append(svgEl('line', { x1: x(now), x2: x(now), y1: top - 4, y2: height - 4, class: 'now' }));
  }
  svg.addEventListener('wheel', (event) => {
    event.preventDefault();
    const rect = svg.getBoundingClientRect();
    const at = t.start + ((event.clientX - rect.left - left) / plot) * (t.end - t.start);
    if (event.shiftKey || Math.abs(event.deltaX) > Math.abs(event.deltaY)) {
      pan(((event.deltaX || event.deltaY) / plot) * (t.end - t.start));
    } else {
      zoom(event.deltaY > 0 ? 1.25 : 0.8, at);
    }
  }, { passive: false });
  box.replaceChildren(svg);
  $('timeline-state').textContent = t.message || (inView.length ? '' : 'No lock of this key in this view.');
}

function clampView(span) {
  const t = timeline;
  const now = serverNow();
  span = Math.max(10 * 1000, Math.min(t.windowMs, span));
  let start = t.start;
  start = Math.max(now - t.windowMs, Math.min(now - span, start));
  t.start = start;
  t.end = start + span;
  t.follow = t.end >= now - 1000;
}

function zoom(factor, at) {
  if (!timeline) return;
  const t = timeline;
  const center = at ?? (t.start + t.end) / 2;
  const span = (t.end - t.start) * factor;
  t.start = center - (center - t.start) * factor;
  clampView(span);
  drawTimeline();
}

function pan(ms) {
  if (!timeline) return;
  const span = timeline.end - timeline.start;
  timeline.start += ms;
  clampView(span);
  drawTimeline();
}

// --- Wiring --------------------------------------------------------------------------------

document.addEventListener('DOMContentLoaded', () => {
  $('sign-in-form').addEventListener('submit', (event) => {
    event.preventDefault();
    const key = $('api-key').value.trim();
    if (!key) return;
    if (!KEY_PATTERN.test(key)) {
      // fetch cannot send such a key in a header at all: say so, and keep it nowhere.
      $('api-key').value = '';
      $('sign-in-error').textContent =
        'That key cannot be right: a key is printable ASCII without spaces, at most 512 characters. ' +
        'Copy it again (a pasted key may carry an invisible character).';
      $('api-key').focus();
      return;
    }
    apiKey = key;
    sessionStorage.setItem(KEY_STORAGE, key);
    $('api-key').value = '';
    start();
  });
  $('sign-out').addEventListener('click', () => signOut('Signed out: the key is gone from this tab.'));
  $('filter').addEventListener('input', (event) => {
    view.filter = event.target.value;
    view.page = 0;
    render();
  });
  $('previous-page').addEventListener('click', () => {
    view.page = Math.max(0, view.page - 1);
    render();
  });
  $('next-page').addEventListener('click', () => {
    view.page += 1;
    render();
  });
  for (const button of document.querySelectorAll('button.window')) {
    button.addEventListener('click', () => {
      if (!timeline) return;
      const now = serverNow();
      timeline.windowMs = Number(button.dataset.window);
      timeline.start = now - timeline.windowMs;
      timeline.end = now;
      timeline.follow = true;
      setWindowButtons();
      drawTimeline();
      loadTimeline();
    });
  }
  $('zoom-in').addEventListener('click', () => zoom(0.5));
  $('zoom-out').addEventListener('click', () => zoom(2));
  $('earlier').addEventListener('click', () => timeline && pan(-(timeline.end - timeline.start) / 2));
  $('later').addEventListener('click', () => timeline && pan((timeline.end - timeline.start) / 2));
  $('close-timeline').addEventListener('click', () => {
    closeTimeline();
    forgetOld();
    $('filter').focus();
  });
  $('force-confirm').addEventListener('click', confirmForce);
  $('force-cancel').addEventListener('click', () => $('force-dialog').close());
  $('force-dialog').addEventListener('close', () => {
    const lock = forceTarget;
    forceTarget = null;
    if ($('locks').hidden) return; // signed out: the sign-in form has the focus
    // The rows may have been drawn again meanwhile: find the lock's button again by its id, else
    // fall back to the filter, which is always there.
    const again = lock && live.has(lock.id) && $('lock-rows').querySelector(`[data-focus="force-${lock.id}"]`);
    (again || $('filter')).focus();
  });
  start();
});
