// Server-Sent Events as the WHATWG HTML standard parses them, without I/O: text in, events out.
// It knows nothing of the page, so that Node runs it on the cases every client shares
// (clients/contract.json, through tests/sse_cases.mjs).
//
// Lines end with CRLF, LF or CR, also when a CRLF is split across chunks; one leading byte order
// mark is ignored; "retry:" with ASCII digits only sets the reconnection time. An id counts once its
// event is dispatched: a stream cut in the middle of an event resumes from the event before it, so
// that the cut one is sent again. An event without data dispatches nothing but its id.

export class EventStreamDecoder {
  constructor(lastEventId = null) {
    this.lastEventId = lastEventId; // what a reconnection sends as Last-Event-ID
    this.retry = null; // the server's reconnection time, in milliseconds, once it sent one
    this.buffer = ''; // the line under way
    this.skipLineFeed = false; // the previous chunk ended with CR: a LF opening this one ends no line
    this.first = true;
    this.id = lastEventId;
    this.event = '';
    this.data = [];
  }

  // Feed a chunk of the body's text; returns the events it completes, each {event, data, id,
  // retry}: its type, its data, the last event id and the reconnection time at its dispatch.
  feed(text) {
    if (this.first && text.length > 0) {
      this.first = false;
      if (text.startsWith('\ufeff')) text = text.slice(1);
    }
    if (text === '') return []; // bytes that decoded to nothing yet: a CR before them still waits
    if (this.skipLineFeed && text.startsWith('\n')) text = text.slice(1);
    this.skipLineFeed = false;
    const events = [];
    const buffer = this.buffer + text;
    let start = 0;
    for (let i = 0; i < buffer.length; i++) {
      const c = buffer.charCodeAt(i);
      if (c !== 10 && c !== 13) continue;
      const line = buffer.slice(start, i);
      if (c === 13) {
        if (i + 1 === buffer.length) this.skipLineFeed = true;
        else if (buffer.charCodeAt(i + 1) === 10) i++;
      }
      start = i + 1;
      const event = this.line(line);
      if (event !== null) events.push(event);
    }
    this.buffer = buffer.slice(start);
    return events;
  }

  // One line, without its end; the event that a blank line completes, or null.
  line(line) {
    if (line === '') return this.dispatch();
    if (line.startsWith(':')) return null; // a comment: the keep-alive
    const colon = line.indexOf(':');
    const name = colon === -1 ? line : line.slice(0, colon);
    let value = colon === -1 ? '' : line.slice(colon + 1);
    if (value.startsWith(' ')) value = value.slice(1);
    if (name === 'data') this.data.push(value);
    else if (name === 'event') this.event = value;
    else if (name === 'id') {
      if (!value.includes('\0')) this.id = value;
    } else if (name === 'retry' && /^[0-9]+$/.test(value)) this.retry = Number(value);
    return null;
  }

  dispatch() {
    this.lastEventId = this.id;
    const data = this.data;
    const event = this.event;
    this.data = [];
    this.event = '';
    if (data.length === 0) return null;
    return { event: event || 'message', data: data.join('\n'), id: this.id, retry: this.retry };
  }
}
