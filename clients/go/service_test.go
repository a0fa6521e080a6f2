package helixlocks

// The client against a real service (tests/system/test_go_client.py starts it): its calls, its
// errors, semaphores, shared locks, sessions, the event stream, and leases lost by a refusal or
// by the clock, answers lost on the way back, and 503s.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"reflect"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestServiceWithLockRenewsPastItsTTLPublishesProgressAndReleases(t *testing.T) {
	t.Parallel()
	s := theService(t)
	locks := s.client(t, "")
	ctx := background(t)
	job := jobType("renews")
	var seen *Lease
	err := locks.WithLock(ctx, AcquireOptions{OrganizationID: org, JobType: job, TTL: 1500 * time.Millisecond,
		Metadata: map[string]any{"run": 1}}, func(ctx context.Context, lease *Lease) error {
		seen = lease
		first := lease.Lock().ExpiresAt
		for i := 0; i < 20; i++ { // 2 s: longer than the lease, renewed every third of one
			time.Sleep(100 * time.Millisecond)
			if err := lease.Check(); err != nil {
				return err
			}
		}
		if !lease.Lock().ExpiresAt.After(first) {
			t.Error("not renewed: the latest lock object has the first expiry")
		}
		current, err := locks.Current(ctx, Key{org, job})
		if err != nil || current == nil || current.ID != lease.ID() || current.FencingToken != lease.FencingToken() ||
			current.Metadata["run"] != 1.0 {
			t.Errorf("current: %+v, %v", current, err)
		}
		updated, err := lease.Update(ctx, map[string]any{"done": 40, "of": 100})
		if err != nil || updated.Metadata["done"] != 40.0 || lease.Lock().Metadata["of"] != 100.0 {
			t.Errorf("updated: %+v, %v", updated, err)
		}
		if lease.Slot() != 0 || lease.MaxHolders() != 1 || lease.Mode() != Exclusive {
			t.Errorf("slot %d of %d, %s", lease.Slot(), lease.MaxHolders(), lease.Mode())
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if current, err := locks.Current(ctx, Key{org, job}); current != nil || err != nil {
		t.Errorf("not released at the end: %v, %v", current, err)
	}
	ended, err := locks.Get(ctx, seen.ID())
	if err != nil || ended.ReleaseReason != "released" {
		t.Errorf("%+v, %v", ended, err)
	}
	if seen.Context().Err() == nil || seen.Err() == nil {
		t.Error("the context of a released lease is not done")
	}
}

func TestServiceAcquireRenewUpdateGetCurrentListAndRelease(t *testing.T) {
	t.Parallel()
	s := theService(t)
	locks := s.client(t, "")
	ctx := background(t)
	job := jobType("calls")
	grant, err := locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job, TTL: 30 * time.Second, Holder: "calls-test"})
	if err != nil {
		t.Fatal(err)
	}
	if grant.Holder != "calls-test" || len(grant.Token()) != 32 || grant.Reclaimed != nil || grant.Mode() != Exclusive {
		t.Errorf("%v", grant)
	}
	if strings.Contains(fmt.Sprint(grant), grant.Token()) {
		t.Error("a printed grant shows its token")
	}
	renewed, err := locks.Renew(ctx, grant.ID, grant.Token(), time.Minute)
	if err != nil || renewed.Lapsed || renewed.TTLRemainingMs <= 30000 {
		t.Errorf("%+v, %v", renewed, err)
	}
	if updated, err := locks.Update(ctx, grant.ID, grant.Token(), map[string]any{"step": 2}); err != nil || updated.Metadata["step"] != 2.0 {
		t.Errorf("%+v, %v", updated, err)
	}
	if got, err := locks.Get(ctx, grant.ID); err != nil || got.Metadata["step"] != 2.0 {
		t.Errorf("%+v, %v", got, err)
	}
	if got, err := locks.CurrentSlot(ctx, Key{org, job}, 0); err != nil || got.ID != grant.ID {
		t.Errorf("%+v, %v", got, err)
	}
	if err := locks.Release(ctx, grant.ID, grant.Token()); err != nil {
		t.Fatal(err)
	}
	// A release repeated (as after a lost answer) finds the lock released by its own token: done.
	if err := locks.Release(ctx, grant.ID, grant.Token()); err != nil {
		t.Errorf("a repeated release: %v", err)
	}
	_, err = locks.Renew(ctx, grant.ID, grant.Token(), 0)
	var lost *LockLostError
	if !errors.As(err, &lost) || lost.Status != 410 || !lost.ReleasedByItsToken() || lost.Problem.Kind() != "lock-ended" {
		t.Errorf("%v", err)
	}
	if _, err = locks.Update(ctx, grant.ID, grant.Token(), nil); !errors.As(err, &lost) || lost.Problem.String("release_reason") != "released" {
		t.Errorf("%v", err)
	}

	// A listing, page by page and lock by lock.
	listed := jobType("listed")
	var ids []int64
	for n := 0; n < 5; n++ {
		held, err := locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: fmt.Sprintf("%s-%d", listed, n), TTL: 30 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, held.ID)
		defer locks.Release(ctx, held.ID, held.Token())
	}
	pages := 0
	var paged []int64
	options := ListOptions{OrganizationID: org, State: "held", Limit: 2}
	for {
		page, err := locks.List(ctx, options)
		if err != nil {
			t.Fatal(err)
		}
		pages++
		if len(page.Items) > 2 {
			t.Errorf("%d items in a page of 2", len(page.Items))
		}
		for _, lock := range page.Items {
			paged = append(paged, lock.ID)
		}
		if page.NextCursor == "" {
			break
		}
		options.Cursor = page.NextCursor
	}
	var all []int64
	if err := locks.ListAll(ctx, ListOptions{OrganizationID: org, State: "held", Limit: 2}, func(lock Lock) error {
		all = append(all, lock.ID)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	// Other tests take and let go of locks of the organization meanwhile: ours are held throughout.
	sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
	if pages < 3 || !reflect.DeepEqual(only(paged, ids), ids) || !reflect.DeepEqual(only(all, ids), ids) {
		t.Errorf("%d pages: %v; all %v; ours %v", pages, paged, all, ids)
	}
}

// only is the ids of list that are among wanted, sorted.
func only(list, wanted []int64) []int64 {
	ours := map[int64]bool{}
	for _, id := range wanted {
		ours[id] = true
	}
	var found []int64
	for _, id := range list {
		if ours[id] {
			found = append(found, id)
		}
	}
	sort.Slice(found, func(i, j int) bool { return found[i] < found[j] })
	return found
}

func TestServiceBadInputAndOtherRefusalsAreTypedErrorsWithTheProblemsFields(t *testing.T) {
	t.Parallel()
	s := theService(t)
	locks := s.client(t, "")
	ctx := background(t)
	job := jobType("bad")
	invalid := func(err error, field string) {
		t.Helper()
		var api *APIError
		if !errors.As(err, &api) || api.Status != 422 || api.Kind() != "invalid-request" || api.RequestID == "" {
			t.Errorf("%s: %v", field, err)
			return
		}
		for _, e := range api.Problem.Errors {
			if e.Field == field {
				return
			}
		}
		t.Errorf("%s not among %+v", field, api.Problem.Errors)
	}
	_, err := locks.Acquire(ctx, AcquireOptions{OrganizationID: "not an id", JobType: job})
	invalid(err, "organization_id")
	_, err = locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job, TTL: -time.Second})
	invalid(err, "ttl_seconds")
	_, err = locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job, Wait: -time.Second})
	invalid(err, "wait_seconds")
	_, err = locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job, MaxHolders: 1001})
	invalid(err, "max_holders")
	_, err = locks.CurrentSlot(ctx, Key{org, job}, 1000)
	invalid(err, "slot")
	_, err = locks.List(ctx, ListOptions{Limit: 501})
	invalid(err, "limit")
	called := false
	err = locks.WithLock(ctx, AcquireOptions{OrganizationID: org, JobType: job, TTL: -time.Second}, func(context.Context, *Lease) error {
		called = true
		return nil
	})
	invalid(err, "ttl_seconds")
	if called {
		t.Error("the callback ran without the lock")
	}

	var api *APIError
	if _, err := locks.Get(ctx, 0); !errors.As(err, &api) || api.Status != 404 || api.Kind() != "lock-not-found" {
		t.Errorf("%v", err)
	}
	grant, err := locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job, TTL: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer locks.Release(ctx, grant.ID, grant.Token())
	_, err = locks.Renew(ctx, grant.ID, strings.Repeat("0", 32), 0)
	var lost *LockLostError
	var mismatch *TokenMismatchError
	if !errors.As(err, &lost) || lost.Status != 403 || !errors.As(err, &mismatch) || mismatch.Kind() != "token-mismatch" {
		t.Errorf("%v", err)
	}
	_, err = locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job, Holder: "rival"})
	var held *LockHeldError
	if !errors.As(err, &held) || held.LockID != grant.ID || held.Holder != grant.Holder || !held.ExpiresAt.Equal(grant.ExpiresAt) ||
		held.RetryAfter < time.Second || held.RetryAfter > 30*time.Second || len(held.Holders) != 1 || held.Holders[0].LockID != grant.ID {
		t.Errorf("%v: %+v", err, held)
	}
	if s.apiKey != "" {
		_, err = locks.Acquire(ctx, AcquireOptions{OrganizationID: "globex", JobType: job})
		if !errors.As(err, &api) || api.Status != 403 || api.Kind() != "forbidden" {
			t.Errorf("another organization: %v", err)
		}
		stranger, _ := New(Options{URL: s.url, APIKey: "hlk_not-a-key"})
		_, err = stranger.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job})
		if !errors.As(err, &api) || api.Status != 401 || api.Kind() != "unauthenticated" {
			t.Errorf("an unknown key: %v", err)
		}
	}
	err = locks.Watch(ctx, WatchOptions{OrganizationID: org, LastEventID: "not-an-event-id"}, func(Event) error { return nil })
	if !errors.As(err, &api) || api.Status != 422 {
		t.Errorf("a refused watch: %v", err)
	}
}

func TestServiceQueueListsTheWaitersAndAWaiterIsGrantedByTheRelease(t *testing.T) {
	t.Parallel()
	s := theService(t)
	locks := s.client(t, "")
	ctx := background(t)
	job := jobType("queued")
	first, err := locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job, TTL: time.Minute, Holder: "holder"})
	if err != nil {
		t.Fatal(err)
	}
	type outcome struct {
		grant *Grant
		err   error
		at    time.Time
	}
	waited := make(chan outcome, 1)
	go func() {
		grant, err := locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job, TTL: 30 * time.Second, Holder: "go-waiter", Wait: 30 * time.Second})
		waited <- outcome{grant, err, time.Now()}
	}()
	eventually(t, 10*time.Second, "the waiter's place", func() bool {
		page, err := locks.Queue(ctx, QueueOptions{OrganizationID: org, JobType: job})
		return err == nil && len(page.Items) == 1
	})
	page, err := locks.Queue(ctx, QueueOptions{OrganizationID: org, JobType: job, Limit: 10})
	if err != nil || page.NextCursor != "" || len(page.Items) != 1 || page.Items[0].Holder != "go-waiter" ||
		page.Items[0].Position != 1 || page.Items[0].Mode != Exclusive {
		t.Fatalf("%+v, %v", page, err)
	}
	_, err = locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job, TTL: 30 * time.Second})
	var jumper *LockHeldError
	if !errors.As(err, &jumper) || jumper.Kind() != "waiters-ahead" || jumper.Waiting != 1 || jumper.RetryAfter <= time.Second {
		t.Errorf("%v", err)
	}
	released := time.Now()
	if err := locks.Release(ctx, first.ID, first.Token()); err != nil {
		t.Fatal(err)
	}
	got := <-waited
	if got.err != nil || got.grant.Holder != "go-waiter" || got.grant.FencingToken != first.FencingToken+1 {
		t.Fatalf("%v, %v", got.grant, got.err)
	}
	if latency := got.at.Sub(released); latency > 2*time.Second {
		t.Errorf("granted %v after the release: not woken by it", latency)
	}
	_ = locks.Release(ctx, got.grant.ID, got.grant.Token())
	if page, err := locks.Queue(ctx, QueueOptions{OrganizationID: org, JobType: job}); err != nil || len(page.Items) != 0 {
		t.Errorf("%+v, %v", page, err)
	}
}

func TestServiceASemaphoreOfTwoAndAnotherMaxHoldersRefusedAtOnce(t *testing.T) {
	t.Parallel()
	s := theService(t)
	locks := s.client(t, "")
	ctx := background(t)
	job := jobType("semaphore")
	key := AcquireOptions{OrganizationID: org, JobType: job, TTL: 10 * time.Second, MaxHolders: 2}
	var inside, tried sync.WaitGroup
	inside.Add(2)
	tried.Add(2)
	type result struct {
		slot  int
		token int64
		third error
	}
	results := make(chan result, 2)
	errs := make(chan error, 2)
	for _, holder := range []string{"sem-a", "sem-b"} {
		options := key
		options.Holder = holder
		go func() {
			errs <- locks.WithLock(ctx, options, func(ctx context.Context, lease *Lease) error {
				inside.Done()
				inside.Wait()
				_, third := locks.Acquire(ctx, key)
				tried.Done()
				tried.Wait() // neither lets go before both third acquires are answered
				results <- result{lease.Slot(), lease.FencingToken(), third}
				return nil
			})
		}()
	}
	a, b := <-results, <-results
	for i := 0; i < 2; i++ {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if slots := []int{a.slot, b.slot}; !(slots[0]+slots[1] == 1 && slots[0] != slots[1]) || a.token == b.token {
		t.Errorf("slots %v, tokens %d %d", slots, a.token, b.token)
	}
	var third *LockHeldError
	if !errors.As(a.third, &third) || third.MaxHolders != 2 || len(third.Holders) != 2 || third.RetryAfter < time.Second {
		t.Fatalf("%v", a.third)
	}
	names := []string{third.Holders[0].Holder, third.Holders[1].Holder}
	sort.Strings(names)
	if !reflect.DeepEqual(names, []string{"sem-a", "sem-b"}) || third.Holders[0].Slot+third.Holders[1].Slot != 1 {
		t.Errorf("%+v", third.Holders)
	}
	if current, err := locks.Current(ctx, Key{org, job}); current != nil || err != nil {
		t.Errorf("both slots released: %v %v", current, err)
	}
	heldThree, err := locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job, MaxHolders: 3, TTL: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	started := time.Now()
	_, err = locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job, MaxHolders: 2, Wait: 20 * time.Second})
	var mismatch *MaxHoldersMismatchError
	if !errors.As(err, &mismatch) || mismatch.MaxHolders != 3 || mismatch.Status != 409 || time.Since(started) > 5*time.Second {
		t.Errorf("%v after %v", err, time.Since(started))
	}
	_ = locks.Release(ctx, heldThree.ID, heldThree.Token())
}

func TestServiceSharedLocksReadersTogetherAndAWriterAlone(t *testing.T) {
	t.Parallel()
	s := theService(t)
	locks := s.client(t, "")
	ctx := background(t)
	job := jobType("shared")
	reader := AcquireOptions{OrganizationID: org, JobType: job, TTL: 30 * time.Second, Mode: Shared}
	first, err := locks.Acquire(ctx, reader)
	if err != nil {
		t.Fatal(err)
	}
	second, err := locks.Acquire(ctx, reader)
	if err != nil {
		t.Fatal(err)
	}
	if first.Mode() != Shared || second.Mode() != Shared || first.ID == second.ID || first.Token() == second.Token() ||
		second.FencingToken <= first.FencingToken {
		t.Errorf("%v %v", first, second)
	}
	err = locks.WithLock(ctx, reader, func(ctx context.Context, lease *Lease) error {
		if lease.Mode() != Shared || lease.Lock().Mode != Shared {
			t.Errorf("%s", lease.Mode())
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	_, err = locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job, TTL: 30 * time.Second, Holder: "writer"})
	var held *LockHeldError
	if !errors.As(err, &held) || held.Kind() != "lock-held" || held.Mode != Shared || held.HoldersTotal != 2 || held.LockID != first.ID {
		t.Errorf("%v: %+v", err, held)
	}
	_, err = locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job, Mode: Shared, MaxHolders: 2})
	var api *APIError
	if !errors.As(err, &api) || api.Status != 422 || len(api.Problem.Errors) == 0 || api.Problem.Errors[0].Field != "mode" {
		t.Errorf("%v", err)
	}
	_ = locks.Release(ctx, first.ID, first.Token())
	_ = locks.Release(ctx, second.ID, second.Token())
	writer, err := locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job, TTL: 30 * time.Second})
	if err != nil || writer.Mode() != Exclusive || writer.FencingToken <= second.FencingToken {
		t.Fatalf("%v, %v", writer, err)
	}
	_ = locks.Release(ctx, writer.ID, writer.Token())
}

func TestServiceASessionTakesItsLocksAllAtOnceRenewsThemWithOneRequestAndEndsThem(t *testing.T) {
	t.Parallel()
	s := theService(t)
	locks := s.client(t, "")
	ctx := background(t)
	a, b, c, d := jobType("set-a"), jobType("set-b"), jobType("set-c"), jobType("set-d")
	heldB, err := locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: b, TTL: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	_, err = locks.OpenSession(ctx, SessionOptions{OrganizationID: org, JobTypes: []string{c, b, a}, TTL: 30 * time.Second})
	var held *LockHeldError
	if !errors.As(err, &held) || held.JobType != b {
		t.Fatalf("%v", err)
	}
	if current, _ := locks.Current(ctx, Key{org, a}); current != nil {
		t.Error("a lock of a refused set was granted")
	}
	if _, err := locks.OpenSession(ctx, SessionOptions{OrganizationID: org, JobTypes: []string{a}, Shared: []string{b}}); err == nil {
		t.Error("Shared names a job type the call does not ask for, and no error")
	}
	var sessionID int64
	err = locks.WithSession(ctx, SessionOptions{OrganizationID: org, JobTypes: []string{a, d}, Shared: []string{d}, TTL: 1500 * time.Millisecond},
		func(ctx context.Context, session *SessionLease) error {
			sessionID = session.ID()
			if got := session.Locks(); got[a].Mode != Exclusive || got[d].Mode != Shared || len(session.FencingTokens()) != 2 {
				t.Errorf("%+v", got)
			}
			_, err := locks.AddSessionLocks(ctx, session.Grant(), AddLocksOptions{JobTypes: []string{c, b}})
			if !errors.As(err, &held) || held.JobType != b {
				t.Errorf("%v", err)
			}
			_ = locks.Release(ctx, heldB.ID, heldB.Token())
			added, err := locks.AddSessionLocks(ctx, session.Grant(), AddLocksOptions{JobTypes: []string{c, b}, Wait: 5 * time.Second})
			if err != nil || len(added) != 2 || len(session.FencingTokens()) != 4 {
				t.Fatalf("%v, %v", added, err)
			}
			for i := 0; i < 20; i++ { // 2 s: longer than the lease, all four renewed with the session
				time.Sleep(100 * time.Millisecond)
				if err := session.Check(); err != nil {
					return err
				}
			}
			if !session.Session().ExpiresAt.After(session.Grant().Opened.ExpiresAt) {
				t.Error("the session was not renewed")
			}
			current, err := locks.Current(ctx, Key{org, c})
			if err != nil || current == nil || current.SessionID != session.ID() {
				t.Errorf("%+v, %v", current, err)
			}
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	ended, err := locks.GetSession(ctx, sessionID)
	if err != nil || ended.State != "ended" || len(ended.Locks) != 0 {
		t.Errorf("%+v, %v", ended, err)
	}
	if current, _ := locks.Current(ctx, Key{org, c}); current != nil {
		t.Error("an added lock outlived its session")
	}
}

func TestServiceASessionThatLostALockToAnAdminsForceIsLostAtItsNextRenewal(t *testing.T) {
	t.Parallel()
	s := theService(t)
	locks := s.client(t, "")
	ctx := background(t)
	a, b := jobType("session-a"), jobType("session-b")
	var forcedAt, cancelledAt time.Time
	var kept int64
	err := locks.WithSession(ctx, SessionOptions{OrganizationID: org, JobTypes: []string{a, b}, TTL: 1500 * time.Millisecond},
		func(ctx context.Context, session *SessionLease) error {
			kept = session.Locks()[a].ID
			forcedAt = time.Now()
			if status, _ := s.admin(t, "DELETE", fmt.Sprintf("/v1/locks/%d?force=true", session.Locks()[b].ID)); status != 204 {
				t.Errorf("force: %d", status)
			}
			select {
			case <-ctx.Done():
				cancelledAt = time.Now()
			case <-time.After(10 * time.Second):
				t.Error("the context was not cancelled")
			}
			return ctx.Err()
		})
	var lost *LockLostError
	if !errors.As(err, &lost) || lost.Status != 410 || lost.Problem.Kind() != "session-ended" || lost.Problem.String("end_reason") != "lost" {
		t.Fatalf("%v", err)
	}
	if took := cancelledAt.Sub(forcedAt); took <= 0 || took > 500*time.Millisecond+700*time.Millisecond {
		t.Errorf("cancelled %v after the force (renewals every 0.5 s)", took)
	}
	if other, err := locks.Get(ctx, kept); err != nil || other.State != "released" {
		t.Errorf("the session's other lock: %+v, %v", other, err)
	}
}

// lossCase is a way a renewal is refused by the real service: 410 (an admin forced the release),
// 403 (the proxy sends another token) or 404 (the proxy renews a lock that does not exist).
func TestServiceALeaseIsLostTheMomentARenewalIsRefused(t *testing.T) {
	t.Parallel()
	s := theService(t)
	for _, status := range []int{410, 403, 404} {
		status := status
		t.Run(fmt.Sprint(status), func(t *testing.T) {
			t.Parallel()
			proxy := newFaultyProxy(t, s.url)
			locks := s.client(t, proxy.server.URL)
			ctx := background(t)
			ttl := 1500 * time.Millisecond // renewed every 0.5 s
			var refusedAt, cancelledAt time.Time
			var lockID int64
			err := locks.WithLock(ctx, AcquireOptions{OrganizationID: org, JobType: jobType(fmt.Sprintf("refused-%d", status)), TTL: ttl},
				func(ctx context.Context, lease *Lease) error {
					lockID = lease.ID()
					refusedAt = time.Now()
					switch status {
					case 410:
						if code, _ := s.admin(t, "DELETE", fmt.Sprintf("/v1/locks/%d?force=true", lease.ID())); code != 204 {
							t.Errorf("force: %d", code)
						}
					case 403:
						proxy.setMangle(func(r *http.Request) { r.Header.Set("Lock-Token", strings.Repeat("0", 32)) })
					case 404:
						proxy.setMangle(func(r *http.Request) {
							r.URL.Path = strings.Replace(r.URL.Path, fmt.Sprintf("/%d/", lease.ID()), "/999999999/", 1)
						})
					}
					select { // the work: it waits on the context, as an HTTP request or a command would
					case <-ctx.Done():
						cancelledAt = time.Now()
					case <-time.After(10 * time.Second):
						t.Error("the context was not cancelled")
					}
					return ctx.Err()
				})
			var lost *LockLostError
			if !errors.As(err, &lost) || lost.Status != status || !errors.Is(err, context.Canceled) {
				t.Fatalf("%v", err)
			}
			want := map[int]string{410: "lock-ended", 403: "token-mismatch", 404: "lock-not-found"}[status]
			if lost.Problem.Kind() != want {
				t.Errorf("%s, not %s", lost.Problem.Kind(), want)
			}
			var mismatch *TokenMismatchError
			if errors.As(err, &mismatch) != (status == 403) {
				t.Errorf("TokenMismatchError: %v", mismatch)
			}
			if took := cancelledAt.Sub(refusedAt); took <= 0 || took > ttl/3+700*time.Millisecond {
				t.Errorf("cancelled %v after the fault", took)
			}
			renewals := proxy.requests("POST", "/renew")
			if last := renewals[len(renewals)-1]; last.answered != status {
				t.Errorf("the last renewal was answered %d", last.answered)
			}
			if released := proxy.requests("DELETE", ""); len(released) != 0 {
				t.Errorf("a lost lock was released: %v", released)
			}
			if status == 410 {
				if got, err := locks.Get(ctx, lockID); err != nil || got.ReleaseReason != "forced" || got.ForcedBy == "" {
					t.Errorf("%+v, %v", got, err)
				}
				if lost.Problem.String("release_reason") != "forced" {
					t.Errorf("%+v", lost.Problem.Fields)
				}
			} else {
				// The lock stands: the client let it go without a release, and it lapses.
				proxy.setMangle(nil)
				if got, err := locks.Get(ctx, lockID); err != nil || got.ReleasedAt != nil {
					t.Errorf("%+v, %v", got, err)
				}
			}
		})
	}
}

func TestServiceALeaseIsLostByTheClockBeforeItsExpiryWhileTheServiceIsUnreachable(t *testing.T) {
	t.Parallel()
	s := theService(t)
	proxy := newTCPProxy(t, s.url)
	locks := s.client(t, proxy.url)
	direct := s.client(t, "")
	ctx := background(t)
	ttl := 2 * time.Second
	var stalledAt, cancelledAt, cancelledWall time.Time
	var lockID int64
	err := locks.WithLock(ctx, AcquireOptions{OrganizationID: org, JobType: jobType("unreachable"), TTL: ttl},
		func(ctx context.Context, lease *Lease) error {
			lockID = lease.ID()
			first := lease.Grant().ExpiresAt
			eventually(t, 5*time.Second, "a renewal", func() bool { return lease.Lock().ExpiresAt.After(first) })
			proxy.set(false, true) // nothing passes any more, either way
			stalledAt = time.Now()
			select {
			case <-ctx.Done():
				cancelledAt, cancelledWall = time.Now(), time.Now().Round(0)
			case <-time.After(10 * time.Second):
				t.Error("the context was not cancelled")
			}
			return ctx.Err()
		})
	var lost *LockLostError
	if !errors.As(err, &lost) || lost.Status != 0 || !strings.Contains(lost.Reason, "lapsed") {
		t.Fatalf("%v", err)
	}
	if took := cancelledAt.Sub(stalledAt); took <= 0 || took > ttl {
		t.Errorf("cancelled %v after the service became unreachable: not within one lease", took)
	}
	// The lease's expiry by the database's clock, as the service holds it (the database and this
	// process share one host's clock): the context was cancelled before it.
	lock, err := direct.Get(ctx, lockID)
	if err != nil {
		t.Fatal(err)
	}
	margin := lock.ExpiresAt.Sub(cancelledWall)
	t.Logf("unreachable -> cancelled after %v, %v before the lease's expiry", cancelledAt.Sub(stalledAt), margin)
	if margin <= 0 {
		t.Errorf("cancelled %v after the lease's expiry (%s)", -margin, lock.ExpiresAt)
	}
	if lock.ReleasedAt != nil {
		t.Errorf("released: %+v", lock)
	}
}

func TestServiceAHoldLimitCutsTheLastLeaseShortAndThenRenewalsAreRefused(t *testing.T) {
	t.Parallel()
	s := theService(t)
	locks := s.client(t, "")
	ctx := background(t)
	hold := 3 * time.Second
	grant, err := locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: jobType("hold-limit"), TTL: time.Second, MaxHold: hold})
	if err != nil {
		t.Fatal(err)
	}
	if grant.HoldLimitAt == nil || !grant.HoldLimitAt.Equal(grant.AcquiredAt.Add(hold)) {
		t.Fatalf("the hold limit %v of a grant at %s", grant.HoldLimitAt, grant.AcquiredAt)
	}
	limit := *grant.HoldLimitAt
	// Renewed every 0.25 s for a second: far from the limit, the lease is the ttl asked for; near
	// it, the lease is cut short at the limit.
	var renewed *Renewed
	for n := 0; ; n++ {
		renewed, err = locks.Renew(ctx, grant.ID, grant.Token(), time.Second)
		if err != nil {
			t.Fatalf("a renewal before the limit: %v", err)
		}
		if renewed.Limited {
			if n == 0 {
				t.Error("the first renewal, 2 s before the limit, was limited")
			}
			break
		}
		if !renewed.ExpiresAt.Before(limit) {
			t.Fatalf("a lease to %s, past the hold limit %s, and not limited", renewed.ExpiresAt, limit)
		}
		time.Sleep(250 * time.Millisecond)
	}
	if !renewed.ExpiresAt.Equal(limit) || renewed.HoldLimitAt == nil || !renewed.HoldLimitAt.Equal(limit) {
		t.Errorf("a limited lease to %s, the hold limit %v, not %s", renewed.ExpiresAt, renewed.HoldLimitAt, limit)
	}
	// Once the limit has come (by the database's count of what was left), no renewal: a lock lost.
	time.Sleep(time.Duration(renewed.TTLRemainingMs)*time.Millisecond + 100*time.Millisecond)
	_, err = locks.Renew(ctx, grant.ID, grant.Token(), time.Second)
	var limited *HoldLimitError
	var lost *LockLostError
	if !errors.As(err, &limited) || !errors.As(err, &lost) || lost.Status != 410 || lost.Problem.Kind() != "hold-limit-reached" {
		t.Fatalf("%v", err)
	}
	if !limited.HoldLimitAt.Equal(limit) || limited.Status != 410 {
		t.Errorf("%+v", limited)
	}
	if !errors.As(limited, &lost) || lost.Status != 410 {
		t.Errorf("a HoldLimitError that is not a LockLostError: %v", limited)
	}

	// A session's hold limit: a 30 s ttl cut short to its 2 s, at the opening and at a renewal.
	session, err := locks.OpenSession(ctx, SessionOptions{OrganizationID: org, JobTypes: []string{jobType("hold-limit-session")},
		TTL: 30 * time.Second, MaxHold: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	opened := session.Opened
	if opened.HoldLimitAt == nil || !opened.ExpiresAt.Equal(*opened.HoldLimitAt) {
		t.Errorf("a session's lease to %s, its hold limit %v", opened.ExpiresAt, opened.HoldLimitAt)
	}
	if renewedSession, err := locks.RenewSession(ctx, session.ID, session.Token(), 30*time.Second); err != nil ||
		!renewedSession.Limited || !renewedSession.ExpiresAt.Equal(opened.ExpiresAt) {
		t.Errorf("%+v, %v", renewedSession, err)
	}
	if err := locks.EndSession(ctx, session.ID, session.Token()); err != nil {
		t.Error(err)
	}

	// A hold limit under a second is the service's to refuse.
	_, err = locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: jobType("hold-limit"), MaxHold: 500 * time.Millisecond})
	var api *APIError
	if !errors.As(err, &api) || api.Status != 422 || len(api.Problem.Errors) == 0 || !strings.Contains(api.Problem.Errors[0].Field, "max_hold_seconds") {
		t.Errorf("%v", err)
	}
}

func TestServiceWithLockCancelsAHungCallbacksContextBeforeTheHoldLimit(t *testing.T) {
	t.Parallel()
	s := theService(t)
	proxy := newFaultyProxy(t, s.url) // to see the renewals
	locks := s.client(t, proxy.server.URL)
	direct := s.client(t, "") // the database's word, over a connection opened before the cancellation
	ctx := background(t)
	var started, cancelled time.Time
	var lease *Lease
	var after *Lock
	sent := time.Now()
	err := locks.WithLock(ctx, AcquireOptions{OrganizationID: org, JobType: jobType("hung"), TTL: 2 * time.Second, MaxHold: 3 * time.Second},
		func(ctx context.Context, held *Lease) error {
			started, lease = time.Now(), held
			if _, err := direct.Get(ctx, held.ID()); err != nil {
				t.Error(err)
			}
			select { // the work hangs while the renewals go on: only its context stops it
			case <-ctx.Done():
				cancelled = time.Now()
				var err error
				if after, err = direct.Get(context.Background(), held.ID()); err != nil {
					t.Error(err)
				}
			case <-time.After(10 * time.Second):
				t.Error("the context was not cancelled")
			}
			return ctx.Err()
		})
	var limited *HoldLimitError
	var lost *LockLostError
	if !errors.As(err, &limited) || !errors.As(err, &lost) || lost.Status != 0 || !errors.Is(err, context.Canceled) {
		t.Fatalf("%v", err)
	}
	grant := lease.Grant()
	if grant.HoldLimitAt == nil || !limited.HoldLimitAt.Equal(*grant.HoldLimitAt) {
		t.Fatalf("the loss's hold limit %s, the grant's %v", limited.HoldLimitAt, grant.HoldLimitAt)
	}
	if !errors.As(lease.Err(), &limited) {
		t.Errorf("the lease says it was lost to %v", lease.Err())
	}
	// By the database's times. Asked after the cancellation, the database still had the lease
	// (which the last renewal ended at the limit) running: the cancellation came before the limit.
	limit := *grant.HoldLimitAt
	if after == nil || after.State != "held" || after.TTLRemainingMs <= 0 || !after.ExpiresAt.Equal(limit) {
		t.Fatalf("after the cancellation, the database said: %+v", after)
	}
	// And not long before it (the renewals kept the lock): the grant was made at AcquiredAt, which
	// this process's clock puts between the acquire's send and the callback's start.
	latest, earliest := grant.AcquiredAt.Add(cancelled.Sub(sent)), grant.AcquiredAt.Add(cancelled.Sub(started))
	t.Logf("cancelled between %v and %v before the hold limit; %d ms were left at the database's next answer",
		limit.Sub(latest), limit.Sub(earliest), after.TTLRemainingMs)
	if earliest.Before(limit.Add(-time.Second)) {
		t.Errorf("cancelled as early as %v before the hold limit", limit.Sub(earliest))
	}
	// Renewed until a renewal's lease reached the limit, then no more; and a lost lock is not
	// released: its lease ends at the limit.
	renewals := proxy.requests("POST", "/renew")
	if len(renewals) == 0 {
		t.Error("never renewed")
	}
	for i, renewal := range renewals {
		var answer Renewed
		if renewal.answered != 200 || json.Unmarshal(renewal.body, &answer) != nil || answer.Limited != (i == len(renewals)-1) {
			t.Errorf("renewal %d of %d: %d %s", i+1, len(renewals), renewal.answered, renewal.body)
		}
	}
	if released := proxy.requests("DELETE", ""); len(released) != 0 {
		t.Errorf("a lost lock was released: %v", released)
	}
	if got, err := locks.Get(ctx, grant.ID); err != nil || got.ReleasedAt != nil || !got.ExpiresAt.Equal(limit) {
		t.Errorf("%+v, %v", got, err)
	}
}

func TestServiceAnAcquireWhoseAnswerWasLostIsRetriedAndGetsTheSameGrant(t *testing.T) {
	t.Parallel()
	s := theService(t)
	proxy := newFaultyProxy(t, s.url, fault{method: "POST", path: "/v1/locks", drop: true})
	locks := s.client(t, proxy.server.URL)
	ctx := background(t)
	job := jobType("lost-answer")
	var id, fence int64
	var token string
	var current *Lock
	err := locks.WithLock(ctx, AcquireOptions{OrganizationID: org, JobType: job, TTL: 30 * time.Second}, func(ctx context.Context, lease *Lease) error {
		id, fence, token = lease.ID(), lease.FencingToken(), lease.Grant().Token()
		var err error
		current, err = s.client(t, "").Current(ctx, Key{org, job})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	tries := proxy.requests("POST", "/v1/locks")
	if len(tries) != 2 || tries[0].told != "dropped" || tries[1].answered != 201 {
		t.Fatalf("%+v", tries)
	}
	// The service granted the first try; its client never heard. The retry carried the same
	// Idempotency-Key and was answered that same grant, not 409 from its own lock.
	var first acquired
	if tries[0].answered != 201 || decode(&answer{body: tries[0].body}, &first) != nil {
		t.Fatalf("the first try: %d %s", tries[0].answered, tries[0].body)
	}
	key := tries[0].header.Get("Idempotency-Key")
	if key == "" || tries[1].header.Get("Idempotency-Key") != key {
		t.Errorf("keys %q, %q", key, tries[1].header.Get("Idempotency-Key"))
	}
	if id != first.ID || token != first.Token || fence != first.FencingToken || current == nil || current.ID != first.ID {
		t.Errorf("held %d/%d, the first try's %d/%d; current %+v", id, fence, first.ID, first.FencingToken, current)
	}
	released := proxy.requests("DELETE", "")
	if len(released) != 1 || released[0].path != fmt.Sprintf("/v1/locks/%d", first.ID) || released[0].answered != 204 {
		t.Errorf("%+v", released)
	}
}

func TestServiceA503WithRetryAfterIsHonouredAndItsRetryGetsTheGrant(t *testing.T) {
	t.Parallel()
	s := theService(t)
	proxy := newFaultyProxy(t, s.url, fault{method: "POST", path: "/v1/locks", status: 503, retryAfter: "2"})
	locks := s.client(t, proxy.server.URL)
	ctx := background(t)
	grant, err := locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: jobType("retry-after"), TTL: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	tries := proxy.requests("POST", "/v1/locks")
	if len(tries) != 2 || tries[0].told != "Service Unavailable" || tries[1].answered != 201 {
		t.Fatalf("%+v", tries)
	}
	if gap := tries[1].at.Sub(tries[0].at); gap < 2*time.Second || gap > 3500*time.Millisecond {
		t.Errorf("retried after %v, not Retry-After's 2 s", gap)
	}
	// The 503 stood in for a grant the service did make: the retry got it back.
	var first acquired
	_ = decode(&answer{body: tries[0].body}, &first)
	if grant.ID != first.ID {
		t.Errorf("granted %d, the first try %d", grant.ID, first.ID)
	}
	_ = locks.Release(ctx, grant.ID, grant.Token())
}

func TestServiceALeaseKeepsItsLockThroughARenewalAnswered503AndAReleaseAnswered503Counts(t *testing.T) {
	t.Parallel()
	s := theService(t)
	proxy := newFaultyProxy(t, s.url, fault{method: "POST", path: "/v1/locks/", status: 503, retryAfter: "1"},
		fault{method: "DELETE", path: "/v1/locks/", status: 503, retryAfter: "1"})
	locks := s.client(t, proxy.server.URL)
	ctx := background(t)
	var id int64
	err := locks.WithLock(ctx, AcquireOptions{OrganizationID: org, JobType: jobType("renew-503"), TTL: 3 * time.Second},
		func(ctx context.Context, lease *Lease) error {
			id = lease.ID()
			eventually(t, 10*time.Second, "two renewals", func() bool {
				n := 0
				for _, r := range proxy.requests("POST", "/renew") {
					if r.told == "OK" {
						n++
					}
				}
				return n >= 2 && lease.Check() == nil
			})
			return lease.Check()
		})
	if err != nil {
		t.Fatal(err)
	}
	renewals := proxy.requests("POST", "/renew")
	if renewals[0].told != "Service Unavailable" || renewals[1].at.Sub(renewals[0].at) < time.Second {
		t.Errorf("%+v", renewals[:2])
	}
	var told []string
	for _, r := range proxy.requests("DELETE", "") {
		told = append(told, r.told)
	}
	if !reflect.DeepEqual(told, []string{"Service Unavailable", "Gone"}) {
		t.Errorf("releases told %v: the retry finds the lock released by the first try", told)
	}
	if ended, err := s.client(t, "").Get(ctx, id); err != nil || ended.ReleaseReason != "released" {
		t.Errorf("%+v, %v", ended, err)
	}
}

func TestServiceWatchHandsOverTheEventsInOrderAndResumesAfterACut(t *testing.T) {
	t.Parallel()
	s := theService(t)
	locks := s.client(t, "")
	ctx := background(t)
	job := jobType("watched")
	proxy := newTCPProxy(t, s.url)
	watching := s.client(t, proxy.url)
	var mu sync.Mutex
	var events []Event
	watchCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- watching.Watch(watchCtx, WatchOptions{OrganizationID: org, JobType: job, Within: 10 * time.Second}, func(event Event) error {
			mu.Lock()
			events = append(events, event)
			mu.Unlock()
			return nil
		})
	}()
	seen := func(kind string, id int64) func() bool {
		return func() bool {
			mu.Lock()
			defer mu.Unlock()
			for _, event := range events {
				if event.Type == kind && event.Lock.ID == id {
					return true
				}
			}
			return false
		}
	}
	// The stream is surely open once a marker lock's release comes through.
	for tries := 0; ; tries++ {
		marker, err := locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job, TTL: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		_ = locks.Release(ctx, marker.ID, marker.Token())
		deadline := time.Now().Add(1500 * time.Millisecond)
		for !seen("released", marker.ID)() && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if seen("released", marker.ID)() {
			break
		}
		if tries > 10 {
			t.Fatal("the watch never saw a marker")
		}
	}
	mu.Lock()
	before := len(events)
	mu.Unlock()
	grant, err := locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job, TTL: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "acquired", seen("acquired", grant.ID))
	proxy.set(true, false)
	proxy.cut()
	// While the watcher is away: a change of a lock it has seen, and a new lock.
	_ = locks.Release(ctx, grant.ID, grant.Token())
	second, err := locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job, TTL: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond) // away for a while: the watch retries meanwhile
	proxy.set(false, false)
	eventually(t, 10*time.Second, "the second acquired", seen("acquired", second.ID))
	_ = locks.Release(ctx, second.ID, second.Token())
	eventually(t, 10*time.Second, "the second released", seen("released", second.ID))
	stop()
	if err := <-done; err != context.Canceled {
		t.Errorf("the watch ended with %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	var kinds []string
	for _, event := range events[before:] {
		kinds = append(kinds, fmt.Sprintf("%s %d", event.Type, event.Lock.ID))
	}
	// The release made while the watcher was away came: only a resume (Last-Event-ID) sends it.
	want := []string{fmt.Sprintf("acquired %d", grant.ID), fmt.Sprintf("released %d", grant.ID),
		fmt.Sprintf("acquired %d", second.ID), fmt.Sprintf("released %d", second.ID)}
	if !reflect.DeepEqual(kinds, want) {
		t.Errorf("events %v, not %v", kinds, want)
	}
	ids := map[string]bool{}
	for _, event := range events {
		if ids[event.ID] || event.ID == "" {
			t.Errorf("event id %q repeated or missing", event.ID)
		}
		ids[event.ID] = true
		if strings.Contains(string(event.Data), `"token"`) {
			t.Errorf("an event with a token: %s", event.Data)
		}
	}
	if proxy.connections() < 2 {
		t.Error("not opened again after the cut")
	}
}

func TestServiceAKeyClosedByHoldAtLeastRefusesAcquiresUntilClosedUntilAndAWaitIsGrantedThen(t *testing.T) {
	t.Parallel()
	s := theService(t)
	proxy := newFaultyProxy(t, s.url) // to count the requests of a wait that cannot help
	locks := s.client(t, proxy.server.URL)
	ctx := background(t)
	job := jobType("closed")
	closing := 2 * time.Second
	grant, err := locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job, TTL: 30 * time.Second, HoldAtLeast: closing})
	if err != nil {
		t.Fatal(err)
	}
	if grant.ClosedUntil == nil || !grant.ClosedUntil.Equal(grant.AcquiredAt.Add(closing)) {
		t.Fatalf("closed until %v by a grant at %s", grant.ClosedUntil, grant.AcquiredAt)
	}
	closedUntil := *grant.ClosedUntil
	// Released at once, the key stays closed: the job ran, and no other machine runs it again.
	if err := locks.Release(ctx, grant.ID, grant.Token()); err != nil {
		t.Fatal(err)
	}
	_, err = locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job})
	var closed *ClosedUntilError
	var held *LockHeldError
	if !errors.As(err, &closed) || !errors.As(err, &held) || held.Kind() != "closed-until" {
		t.Fatalf("%v", err)
	}
	if !closed.ClosedUntil.Equal(closedUntil) || closed.RetryAfter < time.Second || closed.RetryAfter > closing {
		t.Errorf("%+v", closed)
	}

	// A wait that ends before the opening is refused at once, with one request.
	asked := len(proxy.requests("POST", "/v1/locks"))
	wait := 500 * time.Millisecond
	started := time.Now()
	_, err = locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job, Wait: wait})
	took := time.Since(started)
	if !errors.As(err, &closed) || !closed.ClosedUntil.Equal(closedUntil) {
		t.Fatalf("%v", err)
	}
	if took >= wait/2 || len(proxy.requests("POST", "/v1/locks")) != asked+1 {
		t.Errorf("a %v wait of a closed key gave up after %v and %d requests", wait, took,
			len(proxy.requests("POST", "/v1/locks"))-asked)
	}

	// A wait that outlasts the closing is granted once the key opens, by the database's clock.
	opened, err := locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job, Wait: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer locks.Release(ctx, opened.ID, opened.Token())
	if opened.AcquiredAt.Before(closedUntil) || opened.ClosedUntil != nil {
		t.Errorf("granted at %s, the key closed until %s; closes until %v", opened.AcquiredAt, closedUntil, opened.ClosedUntil)
	}

	// Only an exclusive lock of one holder closes its key.
	_, err = locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: jobType("closed"), MaxHolders: 2, HoldAtLeast: time.Minute})
	var api *APIError
	if !errors.As(err, &api) || api.Status != 422 {
		t.Errorf("%v", err)
	}
}

func TestServiceCancelOnRevocationCancelsTheCallbackWhichThenReleases(t *testing.T) {
	t.Parallel()
	s := theService(t)
	locks := s.client(t, "")
	ctx := background(t)
	var seen *Lease
	opts := AcquireOptions{OrganizationID: org, JobType: jobType("cancelled"), TTL: 3 * time.Second, CancelOnRevocation: true}
	err := locks.WithLock(ctx, opts, func(work context.Context, lease *Lease) error {
		seen = lease
		if _, err := s.client(t, "").RequestRevocation(ctx, lease.ID(), "deploying v2", RevocationOptions{}); err != nil {
			return err
		}
		select { // cancelled by the request, learnt from the next renewal
		case <-work.Done():
		case <-time.After(5 * time.Second):
			return errors.New("the callback's context was not cancelled by the request")
		}
		if lease.Err() != nil || lease.Revocation() == nil {
			t.Errorf("cancelled for a request, not a loss: %v, %+v", lease.Err(), lease.Revocation())
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if ended, err := locks.Get(ctx, seen.ID()); err != nil || ended.ReleaseReason != "released" {
		t.Errorf("%+v, %v", ended, err)
	}
}

func TestServiceARevocationRequestReachesTheLeaseWhichFinishesWithoutCancellationAndReleases(t *testing.T) {
	t.Parallel()
	s := theService(t)
	locks := s.client(t, "")
	asker := s.client(t, "") // any key of the organization may ask
	ctx := background(t)
	job := jobType("revoked")
	var seen *Lease
	err := locks.WithLock(ctx, AcquireOptions{OrganizationID: org, JobType: job, TTL: 3 * time.Second},
		func(ctx context.Context, lease *Lease) error {
			seen = lease
			if lease.Revocation() != nil {
				t.Error("a revocation before any request")
			}
			asked, err := asker.RequestRevocation(ctx, lease.ID(), "deploying v2", RevocationOptions{Deadline: 30 * time.Second})
			if err != nil {
				return err
			}
			r := asked.Revocation
			if r == nil || r.Reason != "deploying v2" || !r.Deadline.Equal(r.RequestedAt.Add(30*time.Second)) || r.By == "" {
				t.Errorf("%+v", r)
			}
			// A repeat leaves the first request as it was.
			again, err := asker.RequestRevocation(ctx, lease.ID(), "another reason", RevocationOptions{})
			if err != nil || again.Revocation == nil || again.Revocation.Reason != r.Reason || !again.Revocation.RequestedAt.Equal(r.RequestedAt) {
				t.Errorf("%+v, %v", again, err)
			}
			select { // learnt from the next renewal, a third of the ttl on
			case <-lease.RevocationRequested():
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(5 * time.Second):
				return errors.New("the revocation request was not learnt")
			}
			if got := lease.Revocation(); got == nil || got.Reason != "deploying v2" {
				t.Errorf("%+v", got)
			}
			// Nothing is forced: the lock is still held, and the work finishes as it chooses.
			if ctx.Err() != nil || lease.Err() != nil {
				t.Errorf("a revocation request cancelled the work: %v, %v", ctx.Err(), lease.Err())
			}
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	ended, err := locks.Get(ctx, seen.ID())
	if err != nil || ended.ReleaseReason != "released" || ended.Revocation == nil || ended.Revocation.Reason != "deploying v2" {
		t.Errorf("%+v, %v", ended, err)
	}
	// Of an ended lock, a request is a loss to tell.
	_, err = asker.RequestRevocation(ctx, seen.ID(), "too late", RevocationOptions{})
	var lost *LockLostError
	if !errors.As(err, &lost) || lost.Status != 410 {
		t.Errorf("%v", err)
	}

	// A session's lease learns of a request for any of its locks.
	jobs := []string{jobType("revoked-a"), jobType("revoked-b")}
	err = locks.WithSession(ctx, SessionOptions{OrganizationID: org, JobTypes: jobs, TTL: 3 * time.Second},
		func(ctx context.Context, session *SessionLease) error {
			if _, err := asker.RequestRevocation(ctx, session.Locks()[jobs[1]].ID, "rebalancing", RevocationOptions{}); err != nil {
				return err
			}
			select {
			case <-session.RevocationRequested():
			case <-time.After(5 * time.Second):
				return errors.New("the session's revocation request was not learnt")
			}
			if got := session.Revocation(); got == nil || got.Reason != "rebalancing" || ctx.Err() != nil {
				t.Errorf("%+v, %v", got, ctx.Err())
			}
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
}

func TestServiceAPreferredHolderIsGrantedTheReleasedKeyAndOthersAreRefusedReserved(t *testing.T) {
	t.Parallel()
	s := theService(t)
	locks := s.client(t, "")
	ctx := background(t)
	job := jobType("handover")
	leader, err := locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job, TTL: 30 * time.Second, Holder: "leader"})
	if err != nil {
		t.Fatal(err)
	}
	asked, err := locks.RequestRevocation(ctx, leader.ID, "hand over", RevocationOptions{Deadline: time.Minute, PreferredHolder: "successor"})
	if err != nil || asked.Revocation == nil || asked.Revocation.PreferredHolder != "successor" {
		t.Fatalf("%+v, %v", asked, err)
	}
	if err := locks.Release(ctx, leader.ID, leader.Token()); err != nil {
		t.Fatal(err)
	}
	_, err = locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job, Holder: "bystander"})
	var reserved *ReservedError
	var held *LockHeldError
	if !errors.As(err, &reserved) || !errors.As(err, &held) || held.Kind() != "reserved" {
		t.Fatalf("%v", err)
	}
	if reserved.PreferredHolder != "successor" || !reserved.Deadline.Equal(asked.Revocation.Deadline) || reserved.RetryAfter < time.Second {
		t.Errorf("%+v", reserved)
	}
	successor, err := locks.Acquire(ctx, AcquireOptions{OrganizationID: org, JobType: job, Holder: "successor"})
	if err != nil {
		t.Fatal(err)
	}
	if err := locks.Release(ctx, successor.ID, successor.Token()); err != nil {
		t.Error(err)
	}
}
