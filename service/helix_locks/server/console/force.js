// Force release: the dialog that names the lock, the DELETE ?force=true, and where the keyboard's
// focus goes when the dialog closes.

import { Refused, call, problemText } from './api.js';
import { $, el, setStatus } from './dom.js';
import { duration, modeOf } from './format.js';
import { age, state } from './state.js';
import { scheduleRender } from './table.js';

export function askForce(id) {
  const entry = state.live.get(id);
  if (!entry) return;
  const lock = entry.lock;
  state.forceTarget = lock;
  const slot = modeOf(lock) === 'shared' ? `shared: reader slot ${lock.slot}` : `slot ${lock.slot}`;
  // Each value sits in its own <bdi>, so that a direction mark in it cannot reorder the sentence.
  $('force-text').replaceChildren(
    `Break lock ${lock.id} of `, el('bdi', {}, lock.organization_id), ' / ', el('bdi', {}, lock.job_type),
    ` (${slot}), held by “`, el('bdi', { class: 'holder' }, lock.holder),
    `” for ${duration(age(lock))}? Its holder is not told until its next renewal or release, which `,
    'will answer 410.');
  $('force-error').textContent = '';
  $('force-confirm').disabled = false;
  $('force-dialog').showModal();
  $('force-cancel').focus();
}

async function confirmForce() {
  const lock = state.forceTarget;
  if (!lock || !state.apiKey) return; // only an admin key may force: never send it without one
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
    state.live.delete(lock.id);
    scheduleRender();
    $('force-dialog').close();
    setStatus(`Lock ${lock.id} (holder “${lock.holder}”) was released by force.`);
    return;
  }
  $('force-error').textContent = await problemText(response);
  $('force-confirm').disabled = false;
}

export function wireForce() {
  $('force-confirm').addEventListener('click', confirmForce);
  $('force-cancel').addEventListener('click', () => $('force-dialog').close());
  $('force-dialog').addEventListener('close', () => {
    const lock = state.forceTarget;
    state.forceTarget = null;
    if ($('locks').hidden) return; // signed out: the sign-in form has the focus
    // The rows may have been drawn again meanwhile: find the lock's button again by its id, else
    // fall back to the filter, which is always there.
    const again = lock && state.live.has(lock.id) && $('lock-rows').querySelector(`[data-focus="force-${lock.id}"]`);
    (again || $('filter')).focus();
  });
}
