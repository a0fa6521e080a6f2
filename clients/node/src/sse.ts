// Server-Sent Events, as the WHATWG HTML standard parses them, without I/O: bytes in, events out.

/** One event of a text/event-stream: its type, its data, and the last event id at its dispatch. */
export interface ServerEvent {
  event: string;
  data: string;
  id: string | null;
}

/**
 * Decodes a text/event-stream fed chunk by chunk. Lines end with CRLF, LF or CR (also when a CRLF
 * is split across chunks). An id counts once its event is dispatched: a stream cut in the middle of
 * an event resumes from the event before it, so that the cut one is sent again.
 */
export class EventStreamDecoder {
  /** What a reconnection sends as Last-Event-ID. */
  lastEventId: string | null;
  /** The server's reconnection time, in milliseconds, once it sent one. */
  retry: number | null = null;
  // UTF-8 whatever the charset says. The BOM is kept here (by default TextDecoder drops one) and
  // dropped below, once: a stream that opens with two has a line that starts with the second.
  #text = new TextDecoder("utf-8", { ignoreBOM: true });
  #buffer = "";
  #skipLineFeed = false; // the previous chunk ended with CR: a LF opening this one ends no line
  #first = true;
  #id: string | null;
  #event = "";
  #data: string[] = [];

  constructor(lastEventId: string | null = null) {
    this.lastEventId = lastEventId;
    this.#id = lastEventId;
  }

  /** Feed a chunk of the body; returns the events it completes. */
  feed(chunk: Uint8Array | string): ServerEvent[] {
    let text = typeof chunk === "string" ? chunk : this.#text.decode(chunk, { stream: true });
    // Bytes that decoded to nothing yet: a CR before them still waits for its LF.
    if (text.length === 0) return [];
    if (this.#first) {
      this.#first = false;
      if (text.startsWith("\ufeff")) text = text.slice(1);
    }
    if (this.#skipLineFeed && text.startsWith("\n")) text = text.slice(1);
    this.#skipLineFeed = false;
    const events: ServerEvent[] = [];
    this.#buffer += text;
    let start = 0;
    for (let i = 0; i < this.#buffer.length; i++) {
      const c = this.#buffer.charCodeAt(i);
      if (c !== 10 && c !== 13) continue;
      const line = this.#buffer.slice(start, i);
      if (c === 13) {
        if (i + 1 === this.#buffer.length) this.#skipLineFeed = true;
        else if (this.#buffer.charCodeAt(i + 1) === 10) i++;
      }
      start = i + 1;
      const event = this.#line(line);
      if (event !== null) events.push(event);
    }
    this.#buffer = this.#buffer.slice(start);
    return events;
  }

  /** One line, without its end; the event a blank line completes. */
  #line(line: string): ServerEvent | null {
    if (line === "") return this.#dispatch();
    if (line.startsWith(":")) return null; // a comment: the keep-alive
    const colon = line.indexOf(":");
    const name = colon === -1 ? line : line.slice(0, colon);
    let value = colon === -1 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (name === "data") this.#data.push(value);
    else if (name === "event") this.#event = value;
    else if (name === "id") {
      if (!value.includes("\0")) this.#id = value;
    } else if (name === "retry" && /^[0-9]+$/.test(value)) this.retry = Number(value);
    return null;
  }

  #dispatch(): ServerEvent | null {
    this.lastEventId = this.#id;
    const data = this.#data;
    const event = this.#event;
    this.#data = [];
    this.#event = "";
    if (data.length === 0) return null;
    return { event: event || "message", data: data.join("\n"), id: this.#id };
  }
}
