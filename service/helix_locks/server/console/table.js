// The live table: its columns, filter, sort and pages, drawn from state.live, and the cells that
// count down with time.

import { renderCharts } from './charts.js';
import { $, el } from './dom.js';
import { askForce } from './force.js';
import { MODE_TITLES, duration, metadataText, modeOf, unbroken } from './format.js';
import { age, awaitingReclaim, closedLeft, holdLeft, state, ttlLeft } from './state.js';
import { openTimeline } from './timeline.js';

const PAGE_SIZE = 50;
const LONG_HELD_MS = 3600 * 1000;

const COLUMNS = [
  { key: 'organization_id', label: 'Organization', value: (e) => e.lock.organization_id },
  { key: 'job_type', label: 'Job type', value: (e) => e.lock.job_type },
  { key: 'holder', label: 'Holder', value: (e) => e.lock.holder },
  { key: 'mode', label: 'Mode', value: (e) => modeOf(e.lock) },
  { key: 'state', label: 'State', value: (e) => (awaitingReclaim(e) ? 'expired' : e.lock.state) },
  { key: 'slot', label: 'Slot / max', value: (e) => e.lock.slot },
  { key: 'fencing_token', label: 'Fencing token', value: (e) => e.lock.fencing_token },
  { key: 'ttl', label: 'TTL left', value: (e) => ttlLeft(e) },
  { key: 'age', label: 'Age', value: (e) => -Date.parse(e.lock.acquired_at) },
  { key: 'metadata', label: 'Metadata', value: (e) => metadataText(e.lock) },
  { key: null, label: 'Action', force: true },
];

// The columns shown: Action only to a viewer who may break locks, who alone has a button in it.
function columns() {
  return COLUMNS.filter((column) => !column.force || state.canForce);
}

// Whether this key may force is known once /metrics has answered: the Action column comes or goes,
// and a viewer who may not force is told once, above the table, what it takes.
export function showForce() {
  $('force-note').hidden = !state.forceKnown || state.canForce;
  if ($('lock-head').children.length !== columns().length) buildHead();
  scheduleRender();
}

export function buildHead() {
  const view = state.view;
  const row = $('lock-head');
  row.replaceChildren();
  for (const column of columns()) {
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
  const view = state.view;
  const needle = view.filter.trim().toLowerCase();
  let entries = Array.from(state.live.values());
  if (needle) {
    entries = entries.filter((entry) => {
      const lock = entry.lock;
      if (entry.text === undefined || entry.textOf !== lock) {
        entry.text = [
          lock.organization_id, lock.job_type, lock.holder, modeOf(lock), lock.state, metadataText(lock),
        ].join('\n').toLowerCase();
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

let renderPending = false; // private to this module: a drawing is already scheduled
export function scheduleRender() {
  if (renderPending) return;
  renderPending = true;
  setTimeout(() => {
    renderPending = false;
    render();
  }, 100);
}

export function render() {
  if ($('locks').hidden) return;
  const view = state.view;
  const live = state.live;
  const entries = visibleEntries();
  const pages = Math.max(1, Math.ceil(entries.length / PAGE_SIZE));
  view.page = Math.min(view.page, pages - 1);
  const shown = entries.slice(view.page * PAGE_SIZE, (view.page + 1) * PAGE_SIZE);
  const body = $('lock-rows');
  const focused = document.activeElement && body.contains(document.activeElement)
    ? document.activeElement.getAttribute('data-focus') : null;
  state.renderedRows = [];
  const rows = shown.map((entry) => row(entry));
  body.replaceChildren(...rows);
  if (!rows.length) {
    const text = state.loading ? 'Loading…' : live.size ? 'No live lock matches the filter.' : 'No live locks.';
    body.append(el('tr', {}, el('td', { colspan: columns().length, class: 'empty' }, text)));
  }
  if (focused) {
    const again = body.querySelector(`[data-focus="${CSS.escape(focused)}"]`);
    if (again) again.focus();
  }
  $('lock-count').textContent = `(${live.size.toLocaleString('en')}${state.loading ? ', loading…' : ''})`;
  $('page-info').textContent =
    `Page ${view.page + 1} of ${pages}: ${entries.length.toLocaleString('en')} shown of ${live.size.toLocaleString('en')}`;
  $('previous-page').disabled = view.page === 0;
  $('next-page').disabled = view.page >= pages - 1;
  renderCharts();
}

function row(entry) {
  const lock = entry.lock;
  const keyButton = el('button', {
    type: 'button', class: `key${unbroken(lock.job_type)}`,
    'data-focus': `key-${lock.id}`,
    title: 'Open the timeline of this organization and job type',
  }, el('bdi', {}, lock.job_type));
  keyButton.addEventListener('click', () => openTimeline(lock.organization_id, lock.job_type));
  const stateCell = el('td', { class: 'state' });
  // The lease left, and under it, for a lock with a hold limit, the time left until that limit,
  // and for one whose grant closed its key, the time left until the key opens again.
  const ttlText = document.createTextNode('');
  const ttlCell = el('td', { class: 'number ttl' }, ttlText);
  let holdCell = null;
  if (lock.hold_limit_at) {
    holdCell = el('span', {
      class: 'hold-limit', 'data-mark': 'hold-limit',
      title: `hold limit ${lock.hold_limit_at}: no lease of this lock runs past it`,
    });
    ttlCell.append(holdCell);
  }
  let closedCell = null;
  if (lock.closed_until) {
    closedCell = el('span', {
      class: 'closed-until', 'data-mark': 'closed-until',
      title: `closed until ${lock.closed_until}: no other lock of this key is granted before it,`
        + ' even once this one ends',
    });
    ttlCell.append(closedCell);
  }
  const ageCell = el('td', { class: 'number age' });
  const mode = modeOf(lock);
  // A reader's slot is its own among the pair's readers (up to 1000); its max_holders is always 1.
  const slotCell = mode === 'shared'
    ? el('td', { class: 'number', title: 'a reader\'s slot: up to 1000 readers hold the key together' },
      String(lock.slot))
    : el('td', { class: 'number' }, `${lock.slot} / ${lock.max_holders}`);
  const action = [];
  if (state.canForce) {
    const force = el('button', {
      type: 'button', class: 'danger force', 'data-focus': `force-${lock.id}`,
      'aria-label': `Force release lock ${lock.id}`,
    }, 'Force…');
    force.addEventListener('click', () => askForce(lock.id));
    action.push(el('td', {}, force));
  }
  const tr = el('tr', { 'data-lock-id': lock.id },
    el('td', { class: `org${unbroken(lock.organization_id)}` }, el('bdi', {}, lock.organization_id)),
    el('td', {}, keyButton),
    el('td', {
      class: `holder${unbroken(lock.holder)}`,
      ...(lock.session_id ? { title: `in session ${lock.session_id}, whose lease it shares` } : {}),
    }, el('bdi', {}, lock.holder)),
    el('td', { class: `mode ${mode}`, 'data-mode': mode, title: MODE_TITLES[mode] }, mode),
    stateCell,
    slotCell,
    el('td', { class: 'number' }, String(lock.fencing_token)),
    ttlCell,
    ageCell,
    el('td', { class: 'metadata' }, metadataCode(lock.metadata)),
    ...action);
  const rendered = { entry, stateCell, ttlText, holdCell, closedCell, ageCell };
  tick(rendered);
  state.renderedRows.push(rendered);
  return tr;
}

// Metadata as its JSON text, each top-level entry ("key":value) an unbreakable unit in its own
// <bdi>, with a break allowed only after the comma between two entries; an entry longer than
// UNBROKEN_MOST characters (format.js) may still wrap anywhere. Its text is JSON.stringify's, character for
// character.
function metadataCode(metadata) {
  const code = el('code', {});
  if (metadata === null || metadata === undefined) return code;
  const unit = (text) => el('bdi', { class: `entry${unbroken(text)}` }, text);
  if (typeof metadata !== 'object') {
    code.append(unit(JSON.stringify(metadata)));
    return code;
  }
  const array = Array.isArray(metadata);
  const entries = array
    ? metadata.map((value) => JSON.stringify(value))
    : Object.entries(metadata).map(([key, value]) => `${JSON.stringify(key)}:${JSON.stringify(value)}`);
  code.append(array ? '[' : '{');
  entries.forEach((text, i) => {
    if (i > 0) code.append(',', el('wbr', {}));
    code.append(unit(text));
  });
  code.append(array ? ']' : '}');
  return code;
}

// The cells that move with time: the lease left, the age and the marks they lead to.
function tick(rendered) {
  const entry = rendered.entry;
  const left = ttlLeft(entry);
  rendered.ttlText.data = duration(left, true);
  if (rendered.holdCell) {
    const holdMs = holdLeft(entry);
    rendered.holdCell.textContent = holdMs > 0 ? `hold limit in ${duration(holdMs, true)}` : 'hold limit reached';
  }
  if (rendered.closedCell) {
    const closedMs = closedLeft(entry);
    rendered.closedCell.textContent = closedMs > 0 ? `key closed for ${duration(closedMs, true)}` : 'key open again';
  }
  const held = age(entry.lock);
  rendered.ageCell.textContent = duration(held);
  const marks = [];
  if (awaitingReclaim(entry)) marks.push(['expired', 'expired: awaiting reclaim']);
  if (held > LONG_HELD_MS) marks.push(['long', 'held over 1 h']);
  const signature = marks.map((mark) => mark[0]).join(' ');
  if (rendered.signature === signature) return;
  rendered.signature = signature;
  const lockState = marks.length && marks[0][0] === 'expired' ? 'expired' : entry.lock.state;
  rendered.stateCell.replaceChildren(lockState);
  for (const [kind, text] of marks) {
    rendered.stateCell.append(' ', el('span', { class: `badge ${kind}`, 'data-mark': kind }, text));
  }
}

setInterval(() => {
  for (const rendered of state.renderedRows) tick(rendered);
}, 250);

// The table's own controls: the filter and the pager.
export function wireTable() {
  const view = state.view;
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
}
