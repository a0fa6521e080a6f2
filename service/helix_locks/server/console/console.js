// The Helix Locks console: live locks, a timeline per key, and force release. This module starts
// the page and wires its controls; each other module opens with a note on its own job.
//
// Everything the API answers is user data (holders and metadata most of all), so it reaches the
// page only as text: through createElement, createElementNS, setAttribute and textContent, never
// as HTML. The page's policy allows no inline script or style, and nothing from another origin.

import { askForce, wireForce } from './force.js';
import { restoreKey, signOut, start, wireSignIn } from './session.js';
import { HOUR, serverNow, state } from './state.js';
import { wireTable } from './table.js';
import { drawTimeline, openTimeline, wireTimeline } from './timeline.js';

// What an operator at the browser's devtools, and the browser tests, reach by name: modules have
// no globals, so the page's state and a few actions are named on window, read-only.
const inspect = {
  live: () => state.live,
  known: () => state.known,
  lastEventId: () => state.lastEventId,
  streamAbort: () => state.streamAbort,
  HOUR: () => HOUR,
  serverNow: () => serverNow,
  askForce: () => askForce,
  openTimeline: () => openTimeline,
  drawTimeline: () => drawTimeline,
  signOut: () => signOut,
};
for (const [name, get] of Object.entries(inspect)) Object.defineProperty(window, name, { get });

restoreKey();
document.addEventListener('DOMContentLoaded', () => {
  wireSignIn();
  wireTable();
  wireTimeline();
  wireForce();
  start();
});
