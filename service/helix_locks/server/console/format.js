// How times, modes and metadata read on the page: durations, UTC clock times, a lock's mode,
// metadata as JSON text.

// A span of time in its two largest units: "42 s", "49 min 26 s", "1 h 5 min", "3 d 2 h". A
// countdown rounds up (roundUp), so that it reads 0 s only once the time is up.
export function duration(ms, roundUp = false) {
  if (!Number.isFinite(ms)) return '';
  const seconds = Math.max(0, roundUp ? Math.ceil(ms / 1000) : Math.floor(ms / 1000));
  if (seconds < 60) return `${seconds} s`;
  const minutes = Math.floor(seconds / 60);
  if (minutes < 60) return `${minutes} min ${seconds % 60} s`;
  const hours = Math.floor(minutes / 60);
  if (hours < 48) return `${hours} h ${minutes % 60} min`;
  return `${Math.floor(hours / 24)} d ${hours % 24} h`;
}

export function utc(ms, withDate) {
  const iso = new Date(ms).toISOString();
  return withDate ? `${iso.slice(5, 10)} ${iso.slice(11, 16)}` : iso.slice(11, 16);
}

// Each lock's metadata as text, made once per lock object: sorting must not stringify every lock.
const metadataTexts = new WeakMap(); // a cache private to this module
export function metadataText(lock) {
  let text = metadataTexts.get(lock);
  if (text === undefined) {
    text = lock.metadata === null || lock.metadata === undefined ? '' : JSON.stringify(lock.metadata);
    metadataTexts.set(lock, text);
  }
  return text;
}

// Identifiers never break inside (nightly-report stays whole; a table scrolls sideways in its
// box instead), but one longer than this many characters may wrap anywhere, so that no value
// makes a table wider than a few screens: the class to add to its cell.
const UNBROKEN_MOST = 40;
export function unbroken(value) {
  return value.length > UNBROKEN_MOST ? ' long' : '';
}

// A lock's or a queue place's mode: shared (a reader, held beside the pair's other readers) or
// exclusive (a writer, held alone). A service from before shared locks sends none: exclusive.
export function modeOf(item) {
  return item.mode === 'shared' ? 'shared' : 'exclusive';
}

// What each mode means, for a cell's or a lane's tooltip.
export const MODE_TITLES = {
  shared: 'shared: a reader, held beside the other readers of this organization and job type',
  exclusive: 'exclusive: a writer, held alone (a semaphore: one holder per slot)',
};
