// The last hour at a glance: grants, reclaims and forced releases per 5 minutes, counted from the
// locks the page has already read.

import { $, el, svgEl } from './dom.js';
import { utc } from './format.js';
import { forgetOld, serverNow, state } from './state.js';

// At most one drawing every 2 s, however many events come; the last change is always drawn.
// Private to this module: when it last drew, and the drawing it has scheduled.
let chartsAt = -Infinity;
let chartsTimer = null;
export function renderCharts() {
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
  for (const lock of state.known.values()) {
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
