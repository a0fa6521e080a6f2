package helixlocks

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"time"
)

// watchSilence: the service sends a keep-alive at least every 15 s, so a stream that says nothing
// for three of them is taken for dead and opened again.
var watchSilence = 45 * time.Second

// errSilence is a stream that said nothing for watchSilence.
var errSilence = errors.New("the event stream went silent")

// WatchOptions say which events to watch, and from where.
type WatchOptions struct {
	// OrganizationID: only this organization's locks (an organization's key watches its own only;
	// empty: the key's own, or every organization for an admin key).
	OrganizationID string
	// JobType: only this job type's locks.
	JobType string
	// LastEventID resumes after this event's id (an Event's ID).
	LastEventID string
	// Within is how long a watch that cannot open a stream goes on trying before it returns
	// UnavailableError (a refused first connection: a second). Default 60 s; negative: for ever.
	Within time.Duration
}

// Watch calls fn with each event of GET /v1/events as it comes, opening the stream again after
// every cut, end, 45 s of silence, 429, 502, 503 or 504, with Last-Event-ID, so that no event is
// missed or repeated; it pauses the longer of the backoff (or Retry-After) and the stream's
// retry: time between openings. It returns fn's error when fn returns one; ctx's error once ctx
// is done; UnavailableError once no stream could be opened for Within; and an APIError for any
// other refusal (401, 403, 410 events-expired, 422).
func (c *Client) Watch(ctx context.Context, opts WatchOptions, fn func(Event) error) error {
	limit := opts.Within
	if limit == 0 {
		limit = time.Minute
	}
	query := url.Values{}
	if opts.OrganizationID != "" {
		query.Set("organization_id", opts.OrganizationID)
	}
	if opts.JobType != "" {
		query.Set("job_type", opts.JobType)
	}
	target := c.baseURL + "/v1/events"
	if len(query) > 0 {
		target += "?" + query.Encode()
	}
	resume := opts.LastEventID
	var retry time.Duration
	attempt, heard, since := 0, false, time.Now()
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		// Opening waits no longer than what is left of Within, nor than a silence.
		opening := watchSilence
		if limit > 0 {
			if left := time.Until(since.Add(limit)); left < opening {
				opening = left
			}
		}
		if opening < time.Millisecond {
			opening = time.Millisecond
		}
		// Anything heard, a keep-alive included, says the service is there again.
		heardOf := func() { attempt, heard, since = 0, true, time.Now() }
		refusal, failure, err := c.stream(ctx, target, opening, &resume, &retry, fn, heardOf)
		if err != nil {
			return err
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if failure != nil && !transient(failure) {
			return failure // a mistake in the request
		}
		pause := pauseFor(attempt, refusal)
		if retry > pause {
			pause = retry
		}
		var gaveUpAt time.Time
		switch {
		case !heard && nothingThere(failure):
			gaveUpAt = since.Add(refusedWithin)
		case limit > 0:
			gaveUpAt = since.Add(limit)
		}
		if !gaveUpAt.IsZero() && time.Now().Add(pause).After(gaveUpAt) {
			return c.gaveUp(time.Since(since), failure, refusal)
		}
		if err := sleep(ctx, pause); err != nil {
			return err
		}
		attempt++
	}
}

// stream opens the stream once and reads it to its end. It returns the refusal that the watch
// retries (an answer of watchRetried), the failure that ended the stream (a network error, or
// silence), or the error that ends the watch. resume and retry are updated as the stream says.
func (c *Client) stream(ctx context.Context, target string, opening time.Duration, resume *string,
	retry *time.Duration, fn func(Event) error, heardOf func()) (*answer, error, error) {
	streamCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	var silent int32
	timer := time.AfterFunc(opening, func() {
		atomic.StoreInt32(&silent, 1)
		cancel()
	})
	defer timer.Stop()
	silence := func(err error) error {
		if atomic.LoadInt32(&silent) == 1 && ctx.Err() == nil {
			return errSilence
		}
		return err
	}
	request, err := http.NewRequestWithContext(streamCtx, http.MethodGet, target, nil)
	if err != nil {
		return nil, nil, err
	}
	c.headers(request, "text/event-stream")
	request.Header.Set("Cache-Control", "no-cache")
	if *resume != "" { // an empty id (a stream's bare id:) means none, as EventSource has it
		request.Header.Set("Last-Event-ID", *resume)
	}
	response, err := c.http.Do(request)
	if err != nil {
		return nil, silence(err), nil
	}
	defer response.Body.Close()
	if response.StatusCode != http.StatusOK {
		refusal, err := read(response)
		if err != nil {
			return nil, silence(err), nil
		}
		if !watchRetried[refusal.status] {
			// A refusal of the stream is an APIError: its 410 is events-expired, not a lost lock.
			return nil, nil, apiError(refusal)
		}
		return refusal, nil, nil
	}
	if kind := response.Header.Get("Content-Type"); !strings.HasPrefix(kind, "text/event-stream") {
		if kind == "" {
			kind = "no"
		}
		return nil, nil, &APIError{Status: http.StatusOK, Problem: &Problem{
			Detail: fmt.Sprintf("%s answered %s type, not text/event-stream", target, kind),
		}}
	}
	decoder := NewEventStreamDecoder(*resume)
	defer func() {
		if id, ok := decoder.LastEventID(); ok {
			*resume = id
		}
		if every, ok := decoder.Retry(); ok {
			*retry = every
		}
	}()
	buffer := make([]byte, 32<<10)
	for {
		timer.Reset(watchSilence)
		n, err := response.Body.Read(buffer)
		timer.Stop() // the time fn takes is not the stream's silence
		if n > 0 {
			heardOf()
			for _, sent := range decoder.Feed(buffer[:n]) {
				event, failure := toEvent(sent)
				if failure != nil {
					return nil, nil, failure
				}
				if failure := fn(event); failure != nil {
					return nil, nil, failure
				}
			}
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				return nil, nil, nil // the stream ended: opened again
			}
			return nil, silence(err), nil
		}
	}
}

// toEvent is an event's data as the client hands it over: the JSON object, with its id added.
func toEvent(sent ServerEvent) (Event, error) {
	var event Event
	var object map[string]json.RawMessage
	if json.Unmarshal([]byte(sent.Data), &object) != nil || object == nil || json.Unmarshal([]byte(sent.Data), &event) != nil {
		data := sent.Data
		if len(data) > 200 {
			data = data[:200]
		}
		return Event{}, &APIError{Status: http.StatusOK, Problem: &Problem{
			Detail: "an event whose data is not a lock event's JSON object: " + data,
		}}
	}
	if event.Type == "" {
		event.Type = sent.Event
	}
	event.ID = sent.ID
	event.Data = json.RawMessage(sent.Data)
	return event, nil
}
