package helixlocks

// Leases against scripted answers: what the clock says, what a refusal does, what is released.
// No service needed.

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

const safety3s = 300 * time.Millisecond // a tenth of a 3 s ttl

func acquireAnswer(ttlMs int64, delay time.Duration) scriptedAnswer {
	return scriptedAnswer{status: 201, header: map[string]string{"content-type": "application/json"},
		body: lockBody(7, ttlMs, map[string]any{"token": "t", "reclaimed": nil}), delay: delay}
}

func renewAnswer(ttlMs int64) scriptedAnswer {
	return scriptedAnswer{status: 200, header: map[string]string{"content-type": "application/json"},
		body: lockBody(7, ttlMs, map[string]any{"lapsed": false})}
}

func count(seen []seenRequest, method, suffix string) int {
	n := 0
	for _, request := range seen {
		if request.method == method && strings.HasSuffix(strings.SplitN(request.path, "?", 2)[0], suffix) {
			n++
		}
	}
	return n
}

func TestALeaseCountsFromWhenTheAcquireWasSentNotFromItsLateAnswer(t *testing.T) {
	t.Parallel()
	server := newScripted(t, []scriptedAnswer{acquireAnswer(3000, 600*time.Millisecond)}, &scriptedAnswer{status: 204})
	err := server.client.WithLock(context.Background(), AcquireOptions{OrganizationID: "acme", JobType: "report", TTL: 3 * time.Second},
		func(ctx context.Context, lease *Lease) error {
			acquire := server.requests()[0]
			// The request reached the server after it was sent: the lease may last no longer from there.
			endsAt := time.Now().Add(lease.Remaining())
			if limit := acquire.at.Add(3*time.Second - safety3s + time.Millisecond); endsAt.After(limit) {
				t.Errorf("the lease ends %v after the acquire reached the service", endsAt.Sub(acquire.at))
			}
			if n := count(server.requests(), "POST", "/renew"); n != 0 {
				t.Errorf("%d renewals before the work: none was needed", n)
			}
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
}

func TestALeaseLastsNoLongerThanTheServiceSaidWasLeftOfIt(t *testing.T) {
	t.Parallel()
	// The service answers that 1.2 s are left of a 3 s lease (a lease cut short, as a hold limit
	// would): counted from the send, the context is cancelled a safety margin before those 1.2 s,
	// not before the 3 s asked for; renewals answered 503 meanwhile do not save it.
	busy := scriptedAnswer{status: 503, header: map[string]string{"retry-after": "0.05"}}
	server := newScripted(t, []scriptedAnswer{acquireAnswer(1200, 0)}, &busy)
	var cancelledAfter time.Duration
	err := server.client.WithLock(context.Background(), AcquireOptions{OrganizationID: "acme", JobType: "report", TTL: 3 * time.Second},
		func(ctx context.Context, lease *Lease) error {
			select {
			case <-ctx.Done():
				cancelledAfter = time.Since(server.requests()[0].at)
			case <-time.After(5 * time.Second):
				t.Error("the context was not cancelled")
			}
			if lease.Err() == nil || !lease.Lost() {
				t.Error("a cancelled lease that is not lost")
			}
			return ctx.Err()
		})
	var lost *LockLostError
	if !errors.As(err, &lost) || !strings.Contains(lost.Reason, "lapsed") || lost.Status != 0 {
		t.Fatalf("%v", err)
	}
	if !errors.Is(err, context.Canceled) {
		t.Errorf("the callback's own error is not the loss's cause: %v", err)
	}
	// Counted from the send, which came a little before the service saw the request.
	if cancelledAfter < 800*time.Millisecond || cancelledAfter > 1200*time.Millisecond-safety3s+50*time.Millisecond {
		t.Errorf("cancelled %v after the acquire reached the service, not at 0.9 s", cancelledAfter)
	}
	if n := count(server.requests(), "DELETE", "/7"); n != 0 {
		t.Errorf("a lost lock was released (%d)", n)
	}
}

func TestALeaseThatEndsAtItsHoldLimitIsNotRenewedAndIsLostToTheLimitBeforeIt(t *testing.T) {
	t.Parallel()
	// A 3 s ttl that a 1.2 s hold cuts short, as the service answers it: the lease ends at the
	// limit, so no renewal is sent, and the margin is a tenth of the 1.2 s, not of the 3 s.
	grant := acquireAnswer(1200, 0)
	grant.body["hold_limit_at"] = grant.body["expires_at"]
	server := newScripted(t, []scriptedAnswer{grant}, &scriptedAnswer{status: 204})
	var cancelledAfter time.Duration
	err := server.client.WithLock(context.Background(), AcquireOptions{OrganizationID: "acme", JobType: "report",
		TTL: 3 * time.Second, MaxHold: 1500 * time.Millisecond}, func(ctx context.Context, lease *Lease) error {
		if !lease.AtHoldLimit() || lease.Grant().HoldLimitAt == nil {
			t.Errorf("not at the hold limit: %v", lease.Grant().HoldLimitAt)
		}
		select {
		case <-ctx.Done():
			cancelledAfter = time.Since(server.requests()[0].at)
		case <-time.After(5 * time.Second):
			t.Error("the context was not cancelled")
		}
		return ctx.Err()
	})
	var limited *HoldLimitError
	var lost *LockLostError
	if !errors.As(err, &limited) || !errors.As(err, &lost) || lost.Status != 0 || !errors.Is(err, context.Canceled) {
		t.Fatalf("%v", err)
	}
	if at := grant.body["expires_at"].(string); limited.HoldLimitAt.Format(time.RFC3339Nano) != at {
		t.Errorf("the hold limit %s, not %s", limited.HoldLimitAt, at)
	}
	if cancelledAfter < 900*time.Millisecond || cancelledAfter > 1200*time.Millisecond-120*time.Millisecond+50*time.Millisecond {
		t.Errorf("cancelled %v after the acquire reached the service, not at 1.08 s", cancelledAfter)
	}
	if n := count(server.requests(), "POST", "/renew") + count(server.requests(), "DELETE", "/7"); n != 0 {
		t.Errorf("%d renewals or releases of a lease at its hold limit", n)
	}
	if body := string(server.requests()[0].body); !strings.Contains(body, `"max_hold_seconds":1.5`) {
		t.Errorf("sent %s", body)
	}
	// Without MaxHold, no limit is sent: a service older than hold limits gets the same body.
	server.push(acquireAnswer(5000, 0))
	if _, err := server.client.Acquire(context.Background(), AcquireOptions{OrganizationID: "acme", JobType: "report"}); err != nil {
		t.Fatal(err)
	}
	if seen := server.requests(); strings.Contains(string(seen[len(seen)-1].body), "max_hold") {
		t.Errorf("sent %s", seen[len(seen)-1].body)
	}
}

func TestAfterAnAcquireThatTookLongerThanARenewalPeriodTheWorkStartsOnARenewalsLease(t *testing.T) {
	t.Parallel()
	server := newScripted(t, []scriptedAnswer{acquireAnswer(3000, 1500*time.Millisecond), renewAnswer(3000)}, &scriptedAnswer{status: 204})
	err := server.client.WithLock(context.Background(), AcquireOptions{OrganizationID: "acme", JobType: "report", TTL: 3 * time.Second},
		func(ctx context.Context, lease *Lease) error {
			seen := server.requests()
			if n := count(seen, "POST", "/renew"); n != 1 {
				t.Fatalf("%d renewals before the work started, not one", n)
			}
			endsAt := time.Now().Add(lease.Remaining())
			if limit := seen[1].at.Add(3*time.Second - safety3s + time.Millisecond); endsAt.After(limit) {
				t.Errorf("the lease ends %v after the renewal", endsAt.Sub(seen[1].at))
			}
			if lease.Lost() {
				t.Error("lost")
			}
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
}

func TestRenewalsAnsweredWithSomethingThatIsNotTheServicesLoseTheLeaseAtItsMargin(t *testing.T) {
	t.Parallel()
	garbage := scriptedAnswer{status: 200, header: map[string]string{"content-type": "text/html"}, text: text("<html>a captive portal</html>")}
	server := newScripted(t, []scriptedAnswer{acquireAnswer(3000, 0)}, &garbage)
	err := server.client.WithLock(context.Background(), AcquireOptions{OrganizationID: "acme", JobType: "report", TTL: 3 * time.Second},
		func(ctx context.Context, lease *Lease) error {
			select {
			case <-lease.Done():
			case <-time.After(6 * time.Second):
				t.Error("never lost")
			}
			return nil
		})
	var lost *LockLostError
	if !errors.As(err, &lost) || !strings.Contains(lost.Reason, "lapsed") {
		t.Fatalf("%v", err)
	}
	seen := server.requests()
	if count(seen, "POST", "/renew") < 1 {
		t.Error("it did not try to renew")
	}
	if took := time.Since(seen[0].at); took > 3*time.Second+500*time.Millisecond {
		t.Errorf("lost %v after the acquire", took)
	}
}

func TestARenewalRefusedCancelsTheContextAndTheLockIsNotReleased(t *testing.T) {
	t.Parallel()
	for _, refusal := range []struct {
		status int
		kind   string
	}{{410, "lock-ended"}, {403, "token-mismatch"}, {404, "lock-not-found"}} {
		answer := scriptedAnswer{status: refusal.status, body: map[string]any{"type": problemPrefix + refusal.kind, "detail": "gone"}}
		server := newScripted(t, []scriptedAnswer{acquireAnswer(1500, 0)}, &answer)
		started := time.Now()
		var cancelled time.Duration
		err := server.client.WithLock(context.Background(), AcquireOptions{OrganizationID: "acme", JobType: "report", TTL: 1500 * time.Millisecond},
			func(ctx context.Context, lease *Lease) error {
				<-ctx.Done()
				cancelled = time.Since(started)
				return errors.New("the work stopped")
			})
		var lost *LockLostError
		if !errors.As(err, &lost) || lost.Status != refusal.status || lost.Problem.Kind() != refusal.kind {
			t.Fatalf("%d: %v", refusal.status, err)
		}
		if lost.Cause == nil || lost.Cause.Error() != "the work stopped" {
			t.Errorf("%d: the callback's error is not the cause: %v", refusal.status, lost.Cause)
		}
		var mismatch *TokenMismatchError
		if errors.As(err, &mismatch) != (refusal.status == 403) {
			t.Errorf("%d: TokenMismatchError found: %v", refusal.status, mismatch)
		}
		// Renewed every 0.5 s: the first renewal's refusal, well before the lease's margin.
		if cancelled < 450*time.Millisecond || cancelled > 1200*time.Millisecond {
			t.Errorf("%d: cancelled %v after the start", refusal.status, cancelled)
		}
		seen := server.requests()
		if n := count(seen, "DELETE", "/7"); n != 0 || count(seen, "POST", "/renew") != 1 {
			t.Errorf("%d: %d releases, %d renewals", refusal.status, n, count(seen, "POST", "/renew"))
		}
	}
}

func TestWithLockReturnsTheCallbacksErrorAfterReleasingAndReleasesOnAPanic(t *testing.T) {
	t.Parallel()
	server := newScripted(t, []scriptedAnswer{acquireAnswer(5000, 0), {status: 204}, acquireAnswer(5000, 0), {status: 204}}, nil)
	failure := errors.New("the work failed")
	var seen *Lease
	err := server.client.WithLock(context.Background(), AcquireOptions{OrganizationID: "acme", JobType: "report", TTL: 5 * time.Second},
		func(ctx context.Context, lease *Lease) error {
			seen = lease
			return failure
		})
	if err != failure {
		t.Fatalf("%v", err)
	}
	if count(server.requests(), "DELETE", "/7") != 1 {
		t.Error("not released")
	}
	// The lease tells a task that outlived the callback that the lock is no longer held.
	select {
	case <-seen.Context().Done():
	default:
		t.Error("the context of a released lease is not done")
	}
	if lost, ok := seen.Err().(*LockLostError); !ok || !strings.Contains(lost.Reason, "released") {
		t.Errorf("%v", seen.Err())
	}
	func() {
		defer func() {
			if recovered := recover(); recovered != "boom" {
				t.Errorf("recovered %v", recovered)
			}
		}()
		_ = server.client.WithLock(context.Background(), AcquireOptions{OrganizationID: "acme", JobType: "report", TTL: 5 * time.Second},
			func(ctx context.Context, lease *Lease) error { panic("boom") })
	}()
	if count(server.requests(), "DELETE", "/7") != 2 {
		t.Error("not released after the panic")
	}
}

func TestAReleaseWhoseRetryFindsTheLockReleasedByItsTokenSucceeds(t *testing.T) {
	t.Parallel()
	released := scriptedAnswer{status: 410, body: map[string]any{"type": problemPrefix + "lock-ended", "release_reason": "released"}}
	server := newScripted(t, []scriptedAnswer{acquireAnswer(5000, 0), {status: 503, header: map[string]string{"retry-after": "0"}}, released}, nil)
	err := server.client.WithLock(context.Background(), AcquireOptions{OrganizationID: "acme", JobType: "report", TTL: 5 * time.Second},
		func(ctx context.Context, lease *Lease) error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	if n := count(server.requests(), "DELETE", "/7"); n != 2 {
		t.Errorf("%d releases", n)
	}
}

func TestAMismatchIsNotWaitedForAndAnswersThatAreNotTheServicesAreAPIErrors(t *testing.T) {
	t.Parallel()
	mismatch := scriptedAnswer{status: 409, body: map[string]any{"type": problemPrefix + "max-holders-mismatch", "max_holders": 3}}
	server := newScripted(t, nil, &mismatch)
	started := time.Now()
	_, err := server.client.Acquire(context.Background(), AcquireOptions{OrganizationID: "acme", JobType: "report", MaxHolders: 2, Wait: 5 * time.Second})
	var wrong *MaxHoldersMismatchError
	var api *APIError
	if !errors.As(err, &wrong) || wrong.MaxHolders != 3 || !errors.As(err, &api) || api.Status != 409 {
		t.Fatalf("%v", err)
	}
	if time.Since(started) > time.Second || len(server.requests()) != 1 {
		t.Errorf("waited for a mismatch: %d requests", len(server.requests()))
	}
	if body := string(server.requests()[0].body); !strings.Contains(body, `"max_holders":2`) {
		t.Errorf("sent %s", body)
	}
	for _, answer := range []scriptedAnswer{
		{status: 301, header: map[string]string{"content-type": "text/html", "location": "http://127.0.0.1:1/"}, text: text("moved")},
		{status: 200, header: map[string]string{"content-type": "text/html"}, text: text("<html></html>")},
		{status: 201, header: map[string]string{"content-type": "application/json"}, text: text("null")},
	} {
		server := newScripted(t, nil, &answer)
		_, err := server.client.Acquire(context.Background(), AcquireOptions{OrganizationID: "acme", JobType: "report"})
		var held *LockHeldError
		if !errors.As(err, &api) || errors.As(err, &held) || api.Status != answer.status {
			t.Errorf("%d: %v", answer.status, err)
		}
	}
}

func TestAnAcquireToAnAddressWhereNothingListensIsUnavailableAtOnce(t *testing.T) {
	t.Parallel()
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	address := listener.Addr().String()
	listener.Close()
	client, err := New(Options{URL: "http://" + address})
	if err != nil {
		t.Fatal(err)
	}
	started := time.Now()
	_, err = client.Acquire(context.Background(), AcquireOptions{OrganizationID: "acme", JobType: "report", TTL: time.Minute})
	var unavailable *UnavailableError
	if !errors.As(err, &unavailable) || !strings.Contains(unavailable.Message, "refused") {
		t.Fatalf("%v", err)
	}
	if took := time.Since(started); took < 500*time.Millisecond || took > refusedWithin+500*time.Millisecond {
		t.Errorf("gave up after %v: a refused connection is retried for about a second", took)
	}
	if _, err := New(Options{URL: "localhost:8080"}); err == nil {
		t.Error("an address without a scheme was taken")
	}
}

func TestAWatchResumesAfterACutAndAfterSilenceWithLastEventIDHonouringRetry(t *testing.T) {
	saved := watchSilence
	watchSilence = 300 * time.Millisecond
	defer func() { watchSilence = saved }()
	var opened int32
	var mu sync.Mutex
	var sent []string
	var at []time.Time
	events := []string{
		"retry: 250\nid: 1\nevent: acquired\ndata: {\"type\": \"acquired\", \"lock\": {\"id\": 4}}\n\n",
		"id: 2\ndata: {\"type\": \"released\", \"lock\": {\"id\": 4}}\n\n",
		": keep-alive\n\nid: 3\ndata: {\"type\": \"acquired\", \"lock\": {\"id\": 5}}\n\n",
	}
	server := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := atomic.AddInt32(&opened, 1)
		mu.Lock()
		sent = append(sent, r.Header.Get("Last-Event-ID"))
		at = append(at, time.Now())
		mu.Unlock()
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(200)
		switch n {
		case 1: // an event, then the stream ends
			_, _ = w.Write([]byte(events[0]))
		case 2: // an event, and half of another, then silence
			_, _ = w.Write([]byte(events[1] + "id: 9\ndata: {\"type\""))
			w.(http.Flusher).Flush()
			<-r.Context().Done()
		default:
			_, _ = w.Write([]byte(events[2]))
			w.(http.Flusher).Flush()
			<-r.Context().Done()
		}
	}))
	defer server.Close()
	client, _ := New(Options{URL: server.URL})
	var got []string
	stop := errors.New("enough")
	err := client.Watch(context.Background(), WatchOptions{JobType: "report"}, func(event Event) error {
		got = append(got, event.ID+":"+event.Type)
		if len(got) == 3 {
			return stop
		}
		return nil
	})
	if err != stop {
		t.Fatalf("%v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if strings.Join(got, " ") != "1:acquired 2:released 3:acquired" {
		t.Errorf("events %v", got)
	}
	if strings.Join(sent, ",") != ",1,2" {
		t.Errorf("Last-Event-ID sent: %q", sent)
	}
	if gap := at[1].Sub(at[0]); gap < 250*time.Millisecond {
		t.Errorf("opened again after %v, before the stream's retry: 250", gap)
	}
	if gap := at[2].Sub(at[1]); gap < 300*time.Millisecond || gap > 2*time.Second {
		t.Errorf("a silent stream was opened again after %v", gap)
	}
}

func TestAWatchEndsWithItsContextAndOnAnEventThatIsNotJSON(t *testing.T) {
	server := newScripted(t, []scriptedAnswer{{status: 200, header: map[string]string{"content-type": "text/event-stream"}, text: text("data: nope\n\n")}}, nil)
	err := server.client.Watch(context.Background(), WatchOptions{}, func(Event) error { return nil })
	var api *APIError
	if !errors.As(err, &api) || !strings.Contains(api.Problem.Detail, "nope") {
		t.Errorf("%v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	idle := newScripted(t, nil, &scriptedAnswer{status: 200, header: map[string]string{"content-type": "text/event-stream"},
		text: text(": keep-alive\n\n"), delay: 100 * time.Millisecond})
	started := time.Now()
	err = idle.client.Watch(ctx, WatchOptions{}, func(Event) error { return nil })
	if err != context.DeadlineExceeded || time.Since(started) > time.Second {
		t.Errorf("%v after %v", err, time.Since(started))
	}
}
