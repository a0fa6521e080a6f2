// Runs SSE cases through the console's own decoder (service/helix_locks/server/console/sse.js):
// reads [{name, chunks}] as JSON on stdin, writes [{name, events}] as JSON on stdout.
import { readFileSync } from 'node:fs';

const { EventStreamDecoder } = await import(new URL('../../service/helix_locks/server/console/sse.js', import.meta.url));

const cases = JSON.parse(readFileSync(0, 'utf8'));
const results = cases.map((given) => {
  const decoder = new EventStreamDecoder();
  const events = [];
  for (const chunk of given.chunks) events.push(...decoder.feed(chunk));
  return { name: given.name, events, last_event_id: decoder.lastEventId, retry: decoder.retry };
});
process.stdout.write(JSON.stringify(results));
