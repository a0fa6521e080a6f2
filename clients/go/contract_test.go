package helixlocks

// The Go client keeps clients/contract.json, which the Python SDK's and the Node client's tests read
// too: which answers a request retries and how long it pauses, which end a held lock, how
// Retry-After reads, what an APIError carries, and every text/event-stream case through the
// client's parser. Against a small scripted HTTP server of each test's own; no service needed.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"
)

var held409 = map[string]any{"type": "urn:helix-locks:problem:lock-held", "holder": "w", "expires_at": "soon"}

func grantedBody() map[string]any {
	return lockBody(7, 30000, map[string]any{"token": "t", "reclaimed": nil})
}

func set(lists ...[]int) map[int]bool {
	found := map[int]bool{}
	for _, list := range lists {
		for _, status := range list {
			found[status] = true
		}
	}
	return found
}

func sorted(statuses map[int]bool) []int {
	var list []int
	for status := range statuses {
		list = append(list, status)
	}
	sort.Ints(list)
	return list
}

// statuses: every status the contract names, and others a service or a proxy may answer.
func statuses(c *contract) []int {
	return sorted(set(c.Requests.RetryStatuses, c.Requests.UnknownOutcomeStatuses, c.Requests.LockGoneStatuses,
		[]int{400, 401, 408, 409, 413, 422, 500, 501, 505}))
}

func expectedPause(c *contract, attempt int) float64 {
	b := c.Requests.Backoff
	return math.Min(b.MaxS, b.InitialS*math.Pow(b.Multiplier, float64(attempt)))
}

func TestContractRetriesTheRetriedStatusesAndNoOthers(t *testing.T) {
	c := theContract(t)
	retriedHere := set(c.Requests.RetryStatuses)
	for _, status := range statuses(c) {
		server := newScripted(t, []scriptedAnswer{{status: status, header: map[string]string{"retry-after": "0"}}}, nil)
		_, err := server.client.Get(context.Background(), 1)
		seen := len(server.requests())
		if retriedHere[status] {
			if err != nil || seen != 2 {
				t.Errorf("%d was not retried: %v, %d requests", status, err, seen)
			}
		} else if err == nil || seen != 1 {
			t.Errorf("%d: error %v after %d requests (want an error after one)", status, err, seen)
		}
	}
}

func TestContractSendsAPostThatIsNotIdempotentAgainOnlyWhenTheServiceDidNothing(t *testing.T) {
	// No request the client sends is of this kind (an acquire carries an Idempotency-Key): the rule
	// is checked on the method that sends them all, with a POST that carries none.
	c := theContract(t)
	unknown := set(c.Requests.UnknownOutcomeStatuses)
	for _, status := range c.Requests.RetryStatuses {
		server := newScripted(t, []scriptedAnswer{{status: status, header: map[string]string{"retry-after": "0"}}}, nil)
		_, err := server.client.send(context.Background(), call{method: "POST", path: "/v1/anything",
			body: fixed(map[string]any{}), within: time.Second})
		seen := len(server.requests())
		var unavailable *UnavailableError
		if unknown[status] {
			if !errors.As(err, &unavailable) || seen != 1 {
				t.Errorf("%d: a POST that may have taken effect: %v after %d requests", status, err, seen)
			}
		} else if err != nil || seen != 2 {
			t.Errorf("%d: %v after %d requests, not retried", status, err, seen)
		}
	}
}

func TestContractAnAcquireCarriesOneIdempotencyKeyAndSoIsRetried(t *testing.T) {
	c := theContract(t)
	var answers []scriptedAnswer
	for _, status := range c.Requests.RetryStatuses {
		answers = append(answers, scriptedAnswer{status: status, header: map[string]string{"retry-after": "0"}})
	}
	server := newScripted(t, answers, &scriptedAnswer{status: 201, body: grantedBody()})
	grant, err := server.client.Acquire(context.Background(), AcquireOptions{OrganizationID: "acme", JobType: "report", TTL: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if grant.ID != 7 || grant.Token() != "t" {
		t.Errorf("granted %v", grant)
	}
	seen := server.requests()
	if len(seen) != len(c.Requests.RetryStatuses)+1 {
		t.Fatalf("%d requests", len(seen))
	}
	keys := map[string]bool{}
	for _, request := range seen {
		keys[request.header.Get("Idempotency-Key")] = true
	}
	if len(keys) != 1 || keys[""] {
		t.Errorf("every attempt carries the same Idempotency-Key: %v", keys)
	}
}

func TestContractAWaitingAcquireAsksAgainAfterTheBackoffAtMostRetryAfter(t *testing.T) {
	t.Parallel()
	c := theContract(t)
	if c.Requests.WaitingAcquire.Pause != "backoff" || !c.Requests.WaitingAcquire.AtMostRetryAfter {
		t.Fatal("the contract's waiting acquire changed: this test needs to follow it")
	}
	var answers []scriptedAnswer
	for i := 0; i < 4; i++ {
		answers = append(answers, scriptedAnswer{status: 409, header: map[string]string{"retry-after": "0.1"}, body: held409})
	}
	server := newScripted(t, answers, &scriptedAnswer{status: 201, body: grantedBody()})
	grant, err := server.client.Acquire(context.Background(), AcquireOptions{OrganizationID: "acme", JobType: "report", Wait: 10 * time.Second})
	if err != nil || grant.ID != 7 {
		t.Fatalf("%v, %v", grant, err)
	}
	for attempt, gap := range server.gaps() {
		expected := math.Min(expectedPause(c, attempt), 0.1)
		if gap < expected-0.002 || gap >= expected*1.5+0.25 {
			t.Errorf("pause %d: %.3f s, not %.3f s", attempt, gap, expected)
		}
	}
	// Each attempt asked the service to wait what was left of the wait.
	if body := string(server.requests()[0].body); !strings.Contains(body, `"wait_seconds":`) {
		t.Errorf("the first attempt did not wait: %s", body)
	}
}

func TestContractAWaitingAcquireAsksAgainNoLaterThanItsWaitEnds(t *testing.T) {
	t.Parallel()
	c := theContract(t)
	if !c.Requests.WaitingAcquire.AtMostWaitLeft {
		t.Fatal("the contract's waiting acquire changed: this test needs to follow it")
	}
	server := newScripted(t, nil, &scriptedAnswer{status: 409, header: map[string]string{"retry-after": "5"}, body: held409})
	started := time.Now()
	_, err := server.client.Acquire(context.Background(), AcquireOptions{OrganizationID: "acme", JobType: "report", Wait: 300 * time.Millisecond})
	took := time.Since(started).Seconds()
	var held *LockHeldError
	if !errors.As(err, &held) {
		t.Fatalf("%v", err)
	}
	if took < 0.3-0.002 || took >= 0.8 {
		t.Errorf("gave up after %.3f s of a 0.3 s wait", took)
	}
	if len(server.requests()) < 3 {
		t.Errorf("asked %d times within the wait", len(server.requests()))
	}
}

func TestContractAWaitingAcquireOfAKeyClosedPastItsWaitAsksOnceAndOneClosedLongerThanARoundAsksNearItsOpening(t *testing.T) {
	t.Parallel()
	closed := map[string]any{"type": "urn:helix-locks:problem:closed-until", "closed_until": "2030-01-02T03:04:05.5Z", "job_type": "report"}
	server := newScripted(t, nil, &scriptedAnswer{status: 409, header: map[string]string{"retry-after": "5"}, body: closed})
	_, err := server.client.Acquire(context.Background(), AcquireOptions{OrganizationID: "acme", JobType: "report", Wait: 2 * time.Second})
	var refused *ClosedUntilError
	var held *LockHeldError
	if !errors.As(err, &refused) || !errors.As(err, &held) || held.RetryAfter != 5*time.Second || held.JobType != "report" {
		t.Fatalf("%v", err)
	}
	if !refused.ClosedUntil.Equal(time.Date(2030, 1, 2, 3, 4, 5, 5e8, time.UTC)) || refused.Kind() != "closed-until" {
		t.Errorf("%+v", refused)
	}
	if seen := len(server.requests()); seen != 1 {
		t.Errorf("a key that opens after the wait was asked for %d times", seen)
	}

	// Closed for 52 s, with a wait of a minute: the service refuses at once what it cannot wait for
	// in one round, so the next ask comes once the opening is within a round (2 s), not every
	// backoff's pause.
	server = newScripted(t, []scriptedAnswer{{status: 409, header: map[string]string{"retry-after": "52"}, body: closed}},
		&scriptedAnswer{status: 201, body: grantedBody()})
	if _, err := server.client.Acquire(context.Background(), AcquireOptions{OrganizationID: "acme", JobType: "report", Wait: time.Minute}); err != nil {
		t.Fatal(err)
	}
	if gaps := server.gaps(); len(gaps) != 1 || gaps[0] < 2-0.002 || gaps[0] > 2.5 {
		t.Errorf("asked again after %v s", gaps)
	}
}

func TestContractAReservedKeyIsALockHeldErrorThatNamesItsPreferredHolder(t *testing.T) {
	reserved := map[string]any{"type": "urn:helix-locks:problem:reserved", "preferred_holder": "w-9", "deadline": "2030-01-02T03:04:05Z"}
	server := newScripted(t, nil, &scriptedAnswer{status: 409, header: map[string]string{"retry-after": "30"}, body: reserved})
	_, err := server.client.Acquire(context.Background(), AcquireOptions{OrganizationID: "acme", JobType: "report"})
	var refused *ReservedError
	var held *LockHeldError
	var api *APIError
	if !errors.As(err, &refused) || !errors.As(err, &held) || !errors.As(err, &api) || api.Status != 409 {
		t.Fatalf("%v", err)
	}
	if refused.PreferredHolder != "w-9" || !refused.Deadline.Equal(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)) ||
		held.RetryAfter != 30*time.Second || err.Error() != "reserved for w-9 until 2030-01-02T03:04:05Z" {
		t.Errorf("%+v: %v", refused, err)
	}
}

func TestContractARevocationRequestIsSentAgainAfterAnUnknownOutcomeAsARepeatChangesNothing(t *testing.T) {
	c := theContract(t)
	var answers []scriptedAnswer
	for _, status := range c.Requests.UnknownOutcomeStatuses {
		answers = append(answers, scriptedAnswer{status: status, header: map[string]string{"retry-after": "0"}})
	}
	revocation := map[string]any{"requested_at": "2030-01-02T03:04:05Z", "reason": "deploying v2",
		"deadline": "2030-01-02T03:05:05Z", "by": nil, "preferred_holder": "w-9"}
	server := newScripted(t, answers, &scriptedAnswer{status: 202, body: lockBody(7, 30000, map[string]any{"revocation": revocation})})
	lock, err := server.client.RequestRevocation(context.Background(), 7, "deploying v2", RevocationOptions{PreferredHolder: "w-9"})
	if err != nil {
		t.Fatal(err)
	}
	if r := lock.Revocation; r == nil || r.Reason != "deploying v2" || r.By != "" || r.PreferredHolder != "w-9" ||
		!r.Deadline.Equal(r.RequestedAt.Add(time.Minute)) {
		t.Errorf("%+v", lock.Revocation)
	}
	seen := server.requests()
	if len(seen) != len(answers)+1 {
		t.Fatalf("%d requests", len(seen))
	}
	// The default deadline is the service's: not sent.
	if body := string(seen[0].body); seen[0].path != "/v1/locks/7/revocation" || body != `{"preferred_holder":"w-9","reason":"deploying v2"}` {
		t.Errorf("%s %s", seen[0].path, body)
	}
}

func TestContractTheLockGoneStatusesLoseAHeldLockAnd410AnyRequest(t *testing.T) {
	c := theContract(t)
	gone := set(c.Requests.LockGoneStatuses)
	for _, status := range sorted(set(c.Requests.LockGoneStatuses, []int{400, 409, 422})) {
		server := newScripted(t, []scriptedAnswer{{status: status}, {status: status}}, nil)
		_, renewal := server.client.renew(context.Background(), 1, "t", 30*time.Second, time.Second)
		_, read := server.client.Get(context.Background(), 1)
		var lost *LockLostError
		if errors.As(renewal, &lost) != gone[status] {
			t.Errorf("%d to a renewal: %v", status, renewal)
		}
		if errors.As(read, &lost) != (status == 410) {
			t.Errorf("%d to a read: %v", status, read)
		}
		if len(server.requests()) != 2 {
			t.Errorf("%d: %d requests", status, len(server.requests()))
		}
	}
}

func TestContractTheBackoffIsTheContracts(t *testing.T) {
	c := theContract(t)
	if c.Requests.Backoff.Jitter != 0 {
		t.Fatal("the client does not jitter: a contract that does needs it here too")
	}
	for attempt := 0; attempt < 12; attempt++ {
		if got := backoff(attempt).Seconds(); math.Abs(got-expectedPause(c, attempt)) > 1e-9 {
			t.Errorf("attempt %d: %v", attempt, got)
		}
	}
}

func TestContractARequestPausesAsTheBackoffSaysBetweenAttempts(t *testing.T) {
	t.Parallel()
	c := theContract(t)
	failures := 4
	var answers []scriptedAnswer
	for i := 0; i < failures; i++ {
		answers = append(answers, scriptedAnswer{status: 503})
	}
	server := newScripted(t, answers, nil)
	if _, err := server.client.Get(context.Background(), 1); err != nil {
		t.Fatal(err)
	}
	if len(server.requests()) != failures+1 {
		t.Fatalf("%d requests", len(server.requests()))
	}
	for attempt, gap := range server.gaps() {
		expected := expectedPause(c, attempt)
		if gap < expected-0.002 || gap >= expected*1.5+0.25 {
			t.Errorf("pause %d: %.3f s, not %.3f s", attempt, gap, expected)
		}
	}
}

func TestContractRetryAfterIsHonouredInPlaceOfTheBackoff(t *testing.T) {
	t.Parallel()
	c := theContract(t)
	if !c.Requests.HonoursRetryAfter {
		t.Fatal("the contract no longer honours Retry-After: this test needs to follow it")
	}
	for _, refusal := range []struct {
		status  int
		seconds string
	}{{503, "1"}, {429, "0.5"}} {
		server := newScripted(t, []scriptedAnswer{{status: refusal.status, header: map[string]string{"retry-after": refusal.seconds}}}, nil)
		if _, err := server.client.Get(context.Background(), 1); err != nil {
			t.Fatal(err)
		}
		var want float64
		fmt.Sscan(refusal.seconds, &want)
		if gap := server.gaps()[0]; gap < want-0.002 || gap >= want+0.5 {
			t.Errorf("%d: %.3f s", refusal.status, gap)
		}
	}
}

func TestContractRetryAfterReadsAsTheContractSaysAndAnAPIErrorCarriesIt(t *testing.T) {
	c := theContract(t)
	server := newScripted(t, nil, nil)
	for _, example := range c.Requests.RetryAfter.Cases {
		got, ok := retryAfter(example.Header)
		if ok != (example.Seconds != nil) || (ok && math.Abs(got.Seconds()-*example.Seconds) > 1e-9) {
			t.Errorf("%q read as %v, %v", example.Header, got, ok)
		}
		server.push(scriptedAnswer{status: 422, header: map[string]string{"retry-after": example.Header, "x-request-id": "r-1"}})
		_, err := server.client.Get(context.Background(), 1)
		var api *APIError
		if !errors.As(err, &api) {
			t.Fatalf("%q: %v", example.Header, err)
		}
		if api.Status != 422 || api.RequestID != "r-1" || (api.RetryAfter != nil) != (example.Seconds != nil) ||
			(api.RetryAfter != nil && math.Abs(api.RetryAfter.Seconds()-*example.Seconds) > 1e-9) {
			t.Errorf("%q: %d %q %v", example.Header, api.Status, api.RequestID, api.RetryAfter)
		}
	}
}

func TestContractOnceTheTimeRunsOutA429IsItsAPIErrorAndTheOthersUnavailable(t *testing.T) {
	t.Parallel()
	c := theContract(t)
	unknown := set(c.Requests.UnknownOutcomeStatuses)
	for _, status := range c.Requests.RetryStatuses {
		refusal := scriptedAnswer{status: status, header: map[string]string{"retry-after": "0.1", "x-request-id": "r-2"},
			body: map[string]any{"detail": "busy"}}
		server := newScripted(t, nil, &refusal)
		started := time.Now()
		_, err := server.client.renew(context.Background(), 1, "t", 30*time.Second, 500*time.Millisecond)
		if len(server.requests()) <= 2 {
			t.Errorf("%d: retried %d times before the time ran out", status, len(server.requests()))
		}
		if took := time.Since(started); took >= 2*time.Second {
			t.Errorf("%d: %v", status, took)
		}
		if unknown[status] {
			var unavailable *UnavailableError
			if !errors.As(err, &unavailable) || !strings.Contains(unavailable.Message, fmt.Sprintf("answered %d", status)) {
				t.Fatalf("%d: %v", status, err)
			}
			if unavailable.Status != status || unavailable.Problem.Detail != "busy" || unavailable.Problem.Status != status {
				t.Errorf("%d: %+v", status, unavailable)
			}
		} else {
			var api *APIError
			if !errors.As(err, &api) || api.Status != status || api.RequestID != "r-2" || api.RetryAfter == nil ||
				*api.RetryAfter != 100*time.Millisecond {
				t.Errorf("%d: %v", status, err)
			}
		}
	}
}

func TestContractAnAPIErrorAndALockHeldErrorCarryTheRequestID(t *testing.T) {
	server := newScripted(t, []scriptedAnswer{
		{status: 401, header: map[string]string{"x-request-id": "r-3"}, body: map[string]any{"detail": "no key"}},
		{status: 409, header: map[string]string{"x-request-id": "r-4", "retry-after": "3"}, body: held409},
	}, nil)
	_, refused := server.client.Get(context.Background(), 1)
	_, busy := server.client.Acquire(context.Background(), AcquireOptions{OrganizationID: "acme", JobType: "report"})
	var api *APIError
	if !errors.As(refused, &api) || api.Status != 401 || api.RequestID != "r-3" || api.RetryAfter != nil || api.Problem.Detail != "no key" {
		t.Errorf("%v", refused)
	}
	var held *LockHeldError
	if !errors.As(busy, &held) || held.RequestID != "r-4" || held.RetryAfter != 3*time.Second || held.Holder != "w" || held.Kind() != "lock-held" {
		t.Errorf("%v", busy)
	}
	// A LockHeldError is an APIError too.
	if !errors.As(busy, &api) || api.Status != 409 {
		t.Errorf("%v is no APIError", busy)
	}
}

func TestContractAWatchOpensItsStreamAgainAfterTheContractsStatusesAndNoOthers(t *testing.T) {
	c := theContract(t)
	retriedHere := set(c.Events.RetryStatuses)
	for _, status := range sorted(set(c.Events.RetryStatuses, []int{400, 401, 403, 404, 409, 410, 422, 500, 501})) {
		server := newScripted(t, []scriptedAnswer{
			{status: status, header: map[string]string{"retry-after": "0", "x-request-id": "r-1"}},
			{status: 401, body: map[string]any{"type": "urn:helix-locks:problem:unauthenticated"}},
		}, nil)
		var events []Event
		err := server.client.Watch(context.Background(), WatchOptions{Within: 5 * time.Second}, func(event Event) error {
			events = append(events, event)
			return nil
		})
		var api *APIError
		if len(events) != 0 || !errors.As(err, &api) {
			t.Fatalf("%d: %v, %v", status, events, err)
		}
		seen := len(server.requests())
		if retriedHere[status] {
			if api.Status != 401 || seen != 2 {
				t.Errorf("%d did not open the stream again: %v after %d", status, err, seen)
			}
		} else if api.Status != status || seen != 1 || api.RequestID != "r-1" || api.RetryAfter == nil || *api.RetryAfter != 0 {
			t.Errorf("%d opened the stream again, or lost its fields: %v after %d", status, err, seen)
		}
	}
}

func TestContractAnEmptyLastEventIDIsNotSent(t *testing.T) {
	c := theContract(t)
	if c.Events.SendsEmptyLastEventID {
		t.Fatal("the contract sends an empty Last-Event-ID: this test needs to follow it")
	}
	stream := map[string]string{"content-type": "text/event-stream", "retry-after": "0"}
	server := newScripted(t, []scriptedAnswer{
		{status: 200, header: stream, text: text("id: 5\ndata: {\"type\": \"acquired\"}\n\nid\n\n")},
		{status: 401, body: map[string]any{"type": "urn:helix-locks:problem:unauthenticated"}},
	}, nil)
	var ids []string
	err := server.client.Watch(context.Background(), WatchOptions{LastEventID: "4", Within: 5 * time.Second}, func(event Event) error {
		ids = append(ids, event.ID)
		return nil
	})
	var api *APIError
	if !errors.As(err, &api) || api.Status != 401 {
		t.Fatalf("%v", err)
	}
	if !reflect.DeepEqual(ids, []string{"5"}) {
		t.Errorf("events %v", ids)
	}
	var sent [][]string
	for _, request := range server.requests() {
		sent = append(sent, request.header.Values("Last-Event-ID"))
	}
	if !reflect.DeepEqual(sent, [][]string{{"4"}, nil}) {
		t.Errorf("Last-Event-ID sent: %q", sent)
	}
}

func TestContractTheClientsSetsAreTheContracts(t *testing.T) {
	// What the tests above cannot tell apart from the sets themselves.
	c := theContract(t)
	for name, pair := range map[string][2]map[int]bool{
		"retried":         {retried, set(c.Requests.RetryStatuses)},
		"unknown outcome": {unknownOutcome, set(c.Requests.UnknownOutcomeStatuses)},
		"lock gone":       {lockGone, set(c.Requests.LockGoneStatuses)},
		"watch retried":   {watchRetried, set(c.Events.RetryStatuses)},
	} {
		if !reflect.DeepEqual(pair[0], pair[1]) {
			t.Errorf("%s: %v, the contract's %v", name, sorted(pair[0]), sorted(pair[1]))
		}
	}
	if refusedWithin.Seconds() != c.Requests.RefusedWithinS {
		t.Errorf("a refused connection is retried for %v, the contract's %v s", refusedWithin, c.Requests.RefusedWithinS)
	}
	if watchSilence.Seconds() != c.Events.SilenceS {
		t.Errorf("a watch takes %v of silence for a dead stream, the contract %v s", watchSilence, c.Events.SilenceS)
	}
}

// --- text/event-stream -------------------------------------------------------------------------

// parse feeds each piece as it comes; each event with the reconnection time in force once its
// piece was fed.
func parse(pieces [][]byte) ([]sseEvent, *EventStreamDecoder) {
	decoder := NewEventStreamDecoder("")
	events := []sseEvent{}
	for _, piece := range pieces {
		for _, sent := range decoder.Feed(piece) {
			event := sseEvent{Event: sent.Event, Data: sent.Data}
			if sent.HasID {
				id := sent.ID
				event.ID = &id
			}
			if retry, ok := decoder.Retry(); ok {
				ms := retry.Milliseconds()
				event.Retry = &ms
			}
			events = append(events, event)
		}
	}
	return events, decoder
}

func TestContractEventStream(t *testing.T) {
	for _, example := range theContract(t).SSE {
		example := example
		t.Run(example.Name, func(t *testing.T) {
			// The chunks as they come, the whole stream at once, and a byte at a time: a piece may
			// complete an event and then set a retry, so an event's own reconnection time is
			// checked on the last.
			whole := []byte(strings.Join(example.Chunks, ""))
			var chunks, bytewise [][]byte
			for _, chunk := range example.Chunks {
				chunks = append(chunks, []byte(chunk))
			}
			for i := range whole {
				bytewise = append(bytewise, whole[i:i+1])
			}
			passes := []struct {
				name     string
				pieces   [][]byte
				bytewise bool
			}{{"chunks", chunks, false}, {"whole", [][]byte{whole}, false}, {"bytes", bytewise, true}}
			for _, pass := range passes {
				events, decoder := parse(pass.pieces)
				want := append([]sseEvent{}, example.Events...)
				if !pass.bytewise {
					for i := range events {
						events[i].Retry = nil
					}
					for i := range want {
						want[i].Retry = nil
					}
				}
				if !reflect.DeepEqual(events, want) {
					t.Errorf("%s: %s, want %s", pass.name, show(events), show(want))
				}
				var retry *int64
				if every, ok := decoder.Retry(); ok {
					ms := every.Milliseconds()
					retry = &ms
				}
				var last *string
				if id, ok := decoder.LastEventID(); ok {
					last = &id
				}
				if !reflect.DeepEqual(retry, example.Retry) || !reflect.DeepEqual(last, example.LastEventID) {
					t.Errorf("%s: retry %v, last event id %v", pass.name, show(retry), show(last))
				}
			}
		})
	}
}

func show(v any) string {
	return strings.ReplaceAll(fmt.Sprintf("%s", mustJSON(v)), "\\n", "\\n")
}
