package helixlocks

// Server-Sent Events, as the WHATWG HTML standard parses them, without I/O: bytes in, events out.

import (
	"bytes"
	"strconv"
	"strings"
	"time"
)

var bom = []byte("\ufeff")

// ServerEvent is one event of a text/event-stream: its type, its data, and the last event id at
// its dispatch (HasID false before any id: field).
type ServerEvent struct {
	Event string
	Data  string
	ID    string
	HasID bool
}

// EventStreamDecoder decodes a text/event-stream fed chunk by chunk. Lines end with CRLF, LF or
// CR (also when a CRLF is split across chunks). An id counts once its event is dispatched: a
// stream cut in the middle of an event resumes from the event before it, so that the cut one is
// sent again. The zero value is ready to use.
type EventStreamDecoder struct {
	lastID    string
	hasLastID bool
	retry     time.Duration
	hasRetry  bool
	started   bool   // the stream's first bytes are past (a BOM there dropped)
	head      []byte // the first bytes, while they may still be a BOM
	buffer    []byte // a line not ended yet
	skipLF    bool   // the previous chunk ended with CR: a LF opening this one ends no line
	id        string
	hasID     bool
	event     string
	data      []string
}

// NewEventStreamDecoder is a decoder that resumes after lastEventID (empty: none).
func NewEventStreamDecoder(lastEventID string) *EventStreamDecoder {
	d := &EventStreamDecoder{}
	if lastEventID != "" {
		d.lastID, d.hasLastID, d.id, d.hasID = lastEventID, true, lastEventID, true
	}
	return d
}

// LastEventID is what a reconnection sends as Last-Event-ID, and whether there is one (an empty
// id, from a bare id: field, is one, and means none to the service).
func (d *EventStreamDecoder) LastEventID() (string, bool) { return d.lastID, d.hasLastID }

// Retry is the stream's reconnection time, once it sent a valid retry: field.
func (d *EventStreamDecoder) Retry() (time.Duration, bool) { return d.retry, d.hasRetry }

// Feed decodes a chunk of the stream and returns the events it completes.
func (d *EventStreamDecoder) Feed(chunk []byte) []ServerEvent {
	if len(chunk) == 0 {
		return nil // bytes that decoded to nothing yet: a CR before them still waits for its LF
	}
	if !d.started {
		d.head = append(d.head, chunk...)
		if len(d.head) < len(bom) && bytes.HasPrefix(bom, d.head) {
			return nil // may still be a BOM
		}
		d.started = true
		chunk = bytes.TrimPrefix(d.head, bom) // one BOM, once
		d.head = nil
		if len(chunk) == 0 {
			return nil
		}
	}
	if d.skipLF && chunk[0] == '\n' {
		chunk = chunk[1:]
	}
	d.skipLF = false
	var events []ServerEvent
	d.buffer = append(d.buffer, chunk...)
	start := 0
	for i := 0; i < len(d.buffer); i++ {
		c := d.buffer[i]
		if c != '\n' && c != '\r' {
			continue
		}
		line := d.buffer[start:i]
		if c == '\r' {
			if i+1 == len(d.buffer) {
				d.skipLF = true
			} else if d.buffer[i+1] == '\n' {
				i++
			}
		}
		start = i + 1
		if event, ok := d.line(strings.ToValidUTF8(string(line), "\ufffd")); ok {
			events = append(events, event)
		}
	}
	d.buffer = append(d.buffer[:0], d.buffer[start:]...)
	return events
}

// line takes one line, without its end; a blank line completes an event.
func (d *EventStreamDecoder) line(line string) (ServerEvent, bool) {
	if line == "" {
		return d.dispatch()
	}
	if strings.HasPrefix(line, ":") {
		return ServerEvent{}, false // a comment: the keep-alive
	}
	name, value := line, ""
	if colon := strings.IndexByte(line, ':'); colon >= 0 {
		name, value = line[:colon], line[colon+1:]
	}
	value = strings.TrimPrefix(value, " ")
	switch name {
	case "data":
		d.data = append(d.data, value)
	case "event":
		d.event = value
	case "id":
		if !strings.ContainsRune(value, 0) {
			d.id, d.hasID = value, true
		}
	case "retry":
		if digitsOnly(value) {
			if ms, err := strconv.ParseInt(value, 10, 64); err == nil && ms <= int64(time.Duration(1<<62)/time.Millisecond) {
				d.retry, d.hasRetry = time.Duration(ms)*time.Millisecond, true
			}
		}
	}
	return ServerEvent{}, false
}

func (d *EventStreamDecoder) dispatch() (ServerEvent, bool) {
	d.lastID, d.hasLastID = d.id, d.hasID
	data, event := d.data, d.event
	d.data, d.event = nil, ""
	if len(data) == 0 {
		return ServerEvent{}, false
	}
	if event == "" {
		event = "message"
	}
	return ServerEvent{Event: event, Data: strings.Join(data, "\n"), ID: d.id, HasID: d.hasID}, true
}

func digitsOnly(value string) bool {
	if value == "" {
		return false
	}
	for i := 0; i < len(value); i++ {
		if value[i] < '0' || value[i] > '9' {
			return false
		}
	}
	return true
}
