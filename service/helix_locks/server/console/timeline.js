// The timeline of one key: its history read for a window, drawn as lanes of bars (crashes,
// forced releases, merged bars for busy pixels; writers' lanes, then readers'), zoomed and panned
// within the window.

import { LIST_LIMIT, Refused, listAll } from './api.js';
import { $, el, svgEl } from './dom.js';
import { duration, metadataText, modeOf, utc } from './format.js';
import { stopQueue, watchQueue } from './queue.js';
import { HOUR, forgetOld, serverNow, state } from './state.js';

const TIMELINE_PAGES = 20; // the timeline reads at most this many pages of history per state

export function closeTimeline() {
  if (state.timelineAbort) state.timelineAbort.abort();
  state.timelineAbort = null;
  state.timeline = null;
  stopQueue();
  $('timeline').hidden = true;
}

export function openTimeline(org, job) {
  closeTimeline();
  const now = serverNow();
  state.timeline = { org, job, windowMs: HOUR, start: now - HOUR, end: now, follow: true, chosen: false };
  fitView(state.timeline);
  $('timeline').hidden = false;
  $('timeline-heading').replaceChildren('Timeline of ', el('bdi', {}, org), ' / ', el('bdi', {}, job));
  setWindowButtons();
  drawTimeline();
  loadTimeline();
  watchQueue();
  $('timeline-heading').focus();
}

function setWindowButtons() {
  for (const button of document.querySelectorAll('button.window')) {
    button.setAttribute('aria-pressed', String(Number(button.dataset.window) === state.timeline.windowMs));
  }
}

// Reads the key's history for the window, newest first, at most TIMELINE_PAGES pages per state; a
// new window, another timeline or closing it stops the reading.
export async function loadTimeline() {
  const target = state.timeline;
  if (!target) return;
  if (state.timelineAbort) state.timelineAbort.abort();
  const controller = new AbortController();
  state.timelineAbort = controller;
  const since = serverNow() - target.windowMs;
  const filter = { organization_id: target.org, job_type: target.job };
  target.message = 'Loading the history…';
  $('timeline-state').textContent = target.message;
  let oldest = null; // the oldest release read, when a state had more pages than were read
  try {
    for (const kind of ['released', 'reclaimed']) {
      const options = { pages: TIMELINE_PAGES, signal: controller.signal };
      const items = await listAll(Object.assign({ state: kind }, filter), (last) => Date.parse(last.released_at) < since,
        null, options);
      if (options.cut && items.length) {
        const last = Date.parse(items[items.length - 1].released_at);
        oldest = oldest === null ? last : Math.max(oldest, last);
      }
    }
    await listAll(filter, null, (items, perfAt) => {
      for (const lock of items) state.live.set(lock.id, { lock, seen: perfAt });
    }, { signal: controller.signal });
    target.message = oldest === null ? '' :
      `Showing the newest ${(TIMELINE_PAGES * LIST_LIMIT).toLocaleString('en')} ended locks of each kind, ` +
      `back to ${new Date(oldest).toISOString()}; older ones were not loaded.`;
  } catch (error) {
    if (controller.signal.aborted) return;
    target.message = error instanceof Refused ? '' : `The history could not be read: ${error.message}`;
  }
  if (state.timelineAbort === controller) state.timelineAbort = null;
  if (state.timeline !== target) return;
  if (!target.chosen) fitView(target);
  drawTimeline();
}

// Until the viewer picks a view (a window, a zoom, a pan), the view runs from a little before the
// key's earliest lock in the window to now, and never less than FIT_LEAST_MS: on a new server the
// last hour would squeeze every bar into its last few pixels.
const FIT_LEAST_MS = 60 * 1000;
const FIT_MARGIN = 0.1; // of the span, before the earliest lock
function fitView(t) {
  const now = serverNow();
  let earliest = now;
  for (const lock of state.known.values()) {
    if (lock.organization_id !== t.org || lock.job_type !== t.job) continue;
    const [start, end, gapEnd] = lockSpan(lock, now);
    if ((gapEnd ?? end) >= now - t.windowMs) earliest = Math.min(earliest, start);
  }
  const span = Math.min(t.windowMs, Math.max(FIT_LEAST_MS, (now - earliest) * (1 + FIT_MARGIN)));
  t.start = now - span;
  t.end = now;
  t.follow = true;
}

let timelinePending = false; // private to this module: a drawing is already scheduled
export function scheduleTimeline() {
  if (timelinePending) return;
  timelinePending = true;
  setTimeout(() => {
    timelinePending = false;
    if (state.timeline) drawTimeline();
  }, 200);
}

// While the view follows now, it is drawn again every 5 s; but not when it would move by less than
// a pixel (a week's view moves a pixel in some 14 minutes), unless a minute has passed. Every
// change of the view or of its locks draws it at once anyway.
setInterval(() => {
  const t = state.timeline;
  if (!t || !t.follow) return;
  const moved = ((serverNow() - t.end) / (t.end - t.start)) * t.plot;
  if (moved < 1 && performance.now() - t.drawnAt < 60000) return;
  drawTimeline();
}, 5000);

// The bar of each lock: [start, end of its lease or release, the reclaim gap's end or null, kind].
// An ended lock's bar never changes: it is worked out once per lock object.
const endedSpans = new WeakMap(); // a cache private to this module
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
    modeOf(lock) === 'shared'
      ? `shared (a reader), reader slot ${lock.slot}, fencing token ${lock.fencing_token}`
      : `exclusive, slot ${lock.slot} of ${lock.max_holders}, fencing token ${lock.fencing_token}`,
    `acquired ${lock.acquired_at}`,
    `expires ${lock.expires_at}`,
  ];
  if (lock.hold_limit_at) lines.push(`hold limit ${lock.hold_limit_at}: no lease runs past it`);
  if (lock.closed_until) lines.push(`closed until ${lock.closed_until}: no other lock of the key before it`);
  if (lock.released_at) lines.push(`released ${lock.released_at} (${lock.release_reason})`);
  if (lock.forced_by) lines.push(`forced by the admin key ${lock.forced_by}`);
  if (lock.session_id) lines.push(`in session ${lock.session_id}, whose lease it shares`);
  if (kind === 'reclaimed') lines.push(`crash: ${duration(gapMs)} from the lease's end to the reclaim`);
  if (kind === 'expired') lines.push(`lease ran out ${duration(gapMs)} ago: awaiting reclaim`);
  if (lock.metadata !== null && lock.metadata !== undefined) lines.push(`metadata ${metadataText(lock)}`);
  return lines.join('\n');
}

// The lanes of the locks in view: the exclusive locks' lanes by slot, then the shared locks'
// lanes by slot, each reader in the lane of its own slot. Beside readers, an exclusive lock's lane
// is labelled writer (writer 0, writer 1… for a semaphore's); without any, slot 0, slot 1… as
// ever. Each lane is {mode, slot, label}; laneOf(lock) is the index of a lock's lane.
function laneLayout(inView) {
  let writers = 0;
  let readers = 0;
  for (const [lock] of inView) {
    if (modeOf(lock) === 'shared') readers = Math.max(readers, lock.slot + 1);
    else writers = Math.max(writers, lock.slot + 1);
  }
  if (!writers && !readers) writers = 1;
  const lanes = [];
  for (let slot = 0; slot < writers; slot++) {
    const label = !readers ? `slot ${slot}` : writers > 1 ? `writer ${slot}` : 'writer';
    lanes.push({ mode: 'exclusive', slot, label });
  }
  for (let slot = 0; slot < readers; slot++) lanes.push({ mode: 'shared', slot, label: `reader ${slot}` });
  const laneOf = (lock) => (modeOf(lock) === 'shared' ? writers + lock.slot : lock.slot);
  return { lanes, laneOf, writers, readers };
}

function tickStep(span) {
  const minute = 60 * 1000;
  const steps = [minute, 5 * minute, 10 * minute, 15 * minute, 30 * minute, HOUR, 3 * HOUR, 6 * HOUR,
    12 * HOUR, 24 * HOUR, 48 * HOUR];
  return steps.find((step) => span / step <= 8) || 7 * 24 * HOUR;
}

export function drawTimeline() {
  if (!state.timeline) return;
  const t = state.timeline;
  const now = serverNow();
  if (t.follow) {
    const span = t.end - t.start;
    t.end = now;
    t.start = now - span;
  }
  const locks = Array.from(state.known.values()).filter(
    (lock) => lock.organization_id === t.org && lock.job_type === t.job,
  );
  const inView = locks
    .map((lock) => [lock, lockSpan(lock, now)])
    .filter(([, span]) => (span[2] ?? span[1]) >= t.start && span[0] <= t.end);
  const { lanes: laneList, laneOf, writers, readers } = laneLayout(inView);
  const lanes = laneList.length;
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
  laneList.forEach((lane, index) => {
    const y = top + index * laneHeight;
    svg.append(svgEl('text', {
      x: 4, y: y + laneHeight / 2 + 4, class: `lane-label ${lane.mode}`, 'data-mode': lane.mode,
      'data-slot': lane.slot,
    }, lane.label));
    svg.append(svgEl('line', { x1: left, x2: left + plot, y1: y + laneHeight, y2: y + laneHeight, class: 'lane' }));
  });
  if (writers && readers) { // where the writers' lanes end and the readers' begin
    const y = top + writers * laneHeight;
    svg.append(svgEl('line', { x1: 0, x2: left + plot, y1: y, y2: y, class: 'lane-divide' }));
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
    const lane = laneOf(lock);
    const name = lane * 100000 + pixel;
    let bucket = merged.get(name);
    if (bucket === undefined) {
      bucket = { lane, pixel, kind, counts: {}, first: start, last: end, locks: [] };
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
    const text = `${counts} in ${laneList[bucket.lane].label}, from ${new Date(bucket.first).toISOString()} to ` +
      `${new Date(bucket.last).toISOString()}: zoom in for each lock`;
    const group = svgEl('g', {
      class: `lock merged ${bucket.kind}`, 'data-kind': 'merged', 'data-lane': laneList[bucket.lane].label,
      tabindex: 0, role: 'img', 'aria-label': text,
    });
    group.append(svgEl('title', {}, text));
    group.append(svgEl('rect', {
      x: bucket.pixel, y: top + bucket.lane * laneHeight + 5, width: 1, height: laneHeight - 10, class: 'bar',
    }));
    bars.append(group);
  }
  for (const [lock, [start, end, gapEnd, kind]] of inView) {
    if (drawnMerged.has(lock)) continue;
    const lane = laneOf(lock);
    const y = top + lane * laneHeight + 5;
    const h = laneHeight - 10;
    const gapMs = gapEnd === null ? 0 : gapEnd - end;
    const title = lockTitle(lock, kind, gapMs);
    // Focusable, and named as its tooltip, so that its facts are reachable by keyboard too.
    const group = svgEl('g', {
      class: `lock ${kind}`, 'data-kind': kind, 'data-lock-id': lock.id, 'data-mode': modeOf(lock),
      'data-lane': laneList[lane].label, tabindex: 0, role: 'img', 'aria-label': title,
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
  const t = state.timeline;
  const now = serverNow();
  span = Math.max(10 * 1000, Math.min(t.windowMs, span));
  let start = t.start;
  start = Math.max(now - t.windowMs, Math.min(now - span, start));
  t.start = start;
  t.end = start + span;
  t.follow = t.end >= now - 1000;
}

export function zoom(factor, at) {
  if (!state.timeline) return;
  const t = state.timeline;
  t.chosen = true;
  const center = at ?? (t.start + t.end) / 2;
  const span = (t.end - t.start) * factor;
  t.start = center - (center - t.start) * factor;
  clampView(span);
  drawTimeline();
}

export function pan(ms) {
  if (!state.timeline) return;
  const span = state.timeline.end - state.timeline.start;
  state.timeline.chosen = true;
  state.timeline.start += ms;
  clampView(span);
  drawTimeline();
}


// The timeline's controls: its window, zoom, pan and close buttons.
export function wireTimeline() {
  for (const button of document.querySelectorAll('button.window')) {
    button.addEventListener('click', () => {
      const t = state.timeline;
      if (!t) return;
      const now = serverNow();
      t.windowMs = Number(button.dataset.window);
      t.chosen = true;
      t.start = now - t.windowMs;
      t.end = now;
      t.follow = true;
      setWindowButtons();
      drawTimeline();
      loadTimeline();
    });
  }
  $('zoom-in').addEventListener('click', () => zoom(0.5));
  $('zoom-out').addEventListener('click', () => zoom(2));
  $('earlier').addEventListener('click', () => state.timeline && pan(-(state.timeline.end - state.timeline.start) / 2));
  $('later').addEventListener('click', () => state.timeline && pan((state.timeline.end - state.timeline.start) / 2));
  $('close-timeline').addEventListener('click', () => {
    closeTimeline();
    forgetOld();
    $('filter').focus();
  });
}
