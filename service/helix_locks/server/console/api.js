// The HTTP API as the page asks it: the key in each request, problem documents as text, listings
// read page by page, and a 401 that signs the page out.

import { signOut } from './session.js';
import { noteClock, remember, state } from './state.js';

export const LIST_LIMIT = 500;
const RETRY_FIRST_MS = 1000;
const RETRY_MOST_MS = 10000;

// The wait before the next try: 1 s, doubling up to 10 s.
export function backoff(failures) {
  return Math.min(RETRY_MOST_MS, RETRY_FIRST_MS * 2 ** Math.max(0, failures - 1));
}

export function authHeaders(extra) {
  const headers = Object.assign({}, extra);
  if (state.apiKey) headers.Authorization = `Bearer ${state.apiKey}`;
  return headers;
}

export class Refused extends Error {}

export async function problemText(response) {
  try {
    const body = await response.json();
    const parts = [body.title, body.detail].filter((part) => typeof part === 'string' && part);
    if (parts.length) return `${response.status} ${parts.join(': ')}`;
  } catch (error) {
    // not a problem document: say the status alone
  }
  return `HTTP ${response.status}`;
}

export async function call(path, options) {
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
export async function listAll(params, stopWhen, onPage, options) {
  const gen = state.generation;
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
    if (gen !== state.generation) throw new Refused('signed out');
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
