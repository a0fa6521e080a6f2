// The event stream: GET /v1/events read with fetch, its events applied to the live locks, and
// polling instead while it cannot be had.

import { Refused, call, problemText } from './api.js';
import { $, sleep } from './dom.js';
import { checkMetrics, loadLive } from './loading.js';
import { remember, state } from './state.js';
import { EventStreamDecoder } from './sse.js';
import { scheduleRender } from './table.js';
import { scheduleTimeline } from './timeline.js';

const POLL_MS = 5000;
const RETRY_MS = 1000; // the wait before resuming a cut stream, unless the server sent retry:
const ENDED = new Set(['released', 'forced', 'reclaimed']);

// Reads GET /v1/events with fetch (EventSource cannot send Authorization) until signed out.
// Resolves the returned promise once the stream is joined, or has failed to open.
export function watch(gen) {
  let joinedResolve;
  const joined = new Promise((resolve) => {
    joinedResolve = resolve;
  });
  (async () => {
    let failures = 0;
    let retryMs = RETRY_MS; // a stream's retry: holds for the streams after it too
    while (gen === state.generation) {
      const controller = new AbortController();
      state.streamAbort = controller;
      let response = null;
      const resumeFrom = state.lastEventId;
      try {
        const headers = { Accept: 'text/event-stream' };
        if (resumeFrom) headers['Last-Event-ID'] = resumeFrom;
        response = await call('/v1/events', { headers, signal: controller.signal });
      } catch (error) {
        if (error instanceof Refused) return;
        response = null;
      }
      if (gen !== state.generation) return;
      if (response && response.status === 410) {
        // Too far behind to replay: join from now, then list everything again (once joined, below).
        state.lastEventId = null;
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
      const decoder = new EventStreamDecoder(resumeFrom);
      try {
        await readStream(response.body, gen, decoder, () => {
          failures = 0;
          const polling = state.pollTimer !== null;
          stopPolling();
          // A stream joined without Last-Event-ID replays nothing, and polling may have missed a
          // change since its last round: list again, now that every later change reaches the stream.
          if (!resumeFrom || polling) loadLive(gen);
          if (state.metricsTimer !== null) {
            clearTimeout(state.metricsTimer);
            checkMetrics(gen, 1);
          }
          setStreamState('Live: following the event stream.');
          joinedResolve();
        });
      } catch (error) {
        // the connection broke: resume below
      }
      if (gen !== state.generation) return;
      setStreamState('The event stream was cut: resuming…');
      if (decoder.retry !== null) retryMs = decoder.retry;
      await sleep(retryMs);
    }
  })();
  return joined;
}

export function stopStream() {
  if (state.streamAbort) state.streamAbort.abort();
  state.streamAbort = null;
}

function setStreamState(text) {
  $('stream-state').textContent = text;
}

// Reads the stream's text through the WHATWG decoder (sse.js), which strips the one byte order
// mark itself (so the text decoder keeps it) and learns the server's reconnection time.
async function readStream(body, gen, decoder, onJoined) {
  const reader = body.pipeThrough(new TextDecoderStream('utf-8', { ignoreBOM: true })).getReader();
  let joined = false;
  for (;;) {
    const { value, done } = await reader.read();
    if (done || gen !== state.generation) return;
    if (!joined) {
      joined = true;
      onJoined();
    }
    for (const event of decoder.feed(value)) {
      state.lastEventId = event.id;
      dispatch(event.event, event.data);
    }
    state.lastEventId = decoder.lastEventId; // an event without data still moves it
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
  if (state.loading) state.listedDuringLoad.add(lock.id);
  if (type === 'acquired' && payload.reclaimed) state.live.delete(payload.reclaimed.lock_id);
  if (ENDED.has(type) || lock.released_at) {
    state.live.delete(lock.id);
  } else if (['acquired', 'renewed', 'updated', 'expired'].includes(type)) {
    state.live.set(lock.id, { lock, seen });
  }
  scheduleRender();
  const t = state.timeline;
  if (t && t.org === lock.organization_id && t.job === lock.job_type) {
    scheduleTimeline();
  }
}

function startPolling(gen) {
  if (state.pollTimer !== null) return;
  const round = async () => {
    if (gen !== state.generation) return;
    await loadLive(gen);
    if (gen === state.generation && state.pollTimer !== null) state.pollTimer = setTimeout(round, POLL_MS);
  };
  state.pollTimer = setTimeout(round, 0);
}

export function stopPolling() {
  if (state.pollTimer !== null) clearTimeout(state.pollTimer);
  state.pollTimer = null;
}
