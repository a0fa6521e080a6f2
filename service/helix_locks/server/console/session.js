// Signing in and out, and starting the page: the first listing decides between anonymous mode,
// the sign-in form, and trying again later.

import { authHeaders, backoff, problemText } from './api.js';
import { $, setStatus, sleep } from './dom.js';
import { checkMetrics, loadLive, loadRecentHistory } from './loading.js';
import { state } from './state.js';
import { stopPolling, stopStream, watch } from './stream.js';
import { buildHead } from './table.js';
import { closeTimeline } from './timeline.js';

const KEY_STORAGE = 'helix-locks.console.api-key';
// A key travels in a header: printable ASCII without spaces, of a sane length.
const KEY_PATTERN = /^[\x21-\x7e]{1,512}$/;

export function restoreKey() {
  state.apiKey = sessionStorage.getItem(KEY_STORAGE) || '';
}

export async function start() {
  const gen = ++state.generation;
  if (state.apiKey && !KEY_PATTERN.test(state.apiKey)) {
    forgetKey();
    showSignIn('That key cannot be right: a key is printable ASCII without spaces, at most 512 characters.');
    return;
  }
  $('sign-out').hidden = !state.apiKey; // a stored key can always be signed out, even while retrying
  setStatus('Connecting…');
  let response = null;
  let problem;
  try {
    response = await fetch('/v1/locks?limit=1', { headers: authHeaders(), cache: 'no-store' });
  } catch (error) {
    problem = 'The service cannot be reached';
  }
  if (gen !== state.generation) return;
  if (response && response.status === 401) {
    state.startFailures = 0;
    showSignIn(state.apiKey ? 'The service refused this key (401).' : '');
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
    const wait = backoff(++state.startFailures);
    setStatus(`${problem}; trying again in ${wait / 1000} s.`);
    setTimeout(() => gen === state.generation && start(), wait);
    return;
  }
  state.startFailures = 0;
  $('sign-in').hidden = true;
  $('sign-out').hidden = !state.apiKey;
  $('overview').hidden = false;
  $('locks').hidden = false;
  setStatus(state.apiKey ? 'Signed in with an API key.' : 'No API key: the service answers without one (anonymous mode, loopback only).');
  buildHead();
  checkMetrics(gen, 0);
  // The stream lists the locks each time it joins without a Last-Event-ID, the first time too:
  // joining before listing means that no change falls between the listing and the stream.
  const joined = watch(gen);
  const first = await Promise.race([joined.then(() => 'joined'), sleep(3000)]);
  if (gen !== state.generation) return;
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
  state.apiKey = '';
  sessionStorage.removeItem(KEY_STORAGE);
}

export function signOut(message) {
  state.generation++;
  forgetKey();
  // An open dialog would keep the sign-in form out of reach, and its action needs the key.
  for (const dialog of document.querySelectorAll('dialog[open]')) dialog.close();
  state.forceTarget = null;
  closeTimeline();
  if (state.metricsTimer !== null) clearTimeout(state.metricsTimer);
  state.metricsTimer = null;
  stopStream();
  stopPolling();
  state.live.clear();
  state.known.clear();
  state.lastEventId = null;
  state.canForce = false;
  state.forceKnown = false;
  $('force-note').hidden = true;
  state.renderedRows = [];
  $('lock-rows').replaceChildren();
  $('charts').replaceChildren();
  showSignIn(message);
}

// The sign-in form: a key that no header can carry is refused at once, and kept nowhere.
export function wireSignIn() {
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
    state.apiKey = key;
    sessionStorage.setItem(KEY_STORAGE, key);
    $('api-key').value = '';
    start();
  });
  $('sign-out').addEventListener('click', () => signOut('Signed out: the key is gone from this tab.'));
}
