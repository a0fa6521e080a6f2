package helixlocks

import (
	"context"
	"errors"
	"sync"
	"time"
)

const (
	// A lease is given up this long before it would lapse by this process's clock (network delay
	// and clock drift): a tenth of it, at least 100 ms.
	safetyDivisor = 10
	minSafety     = 100 * time.Millisecond
	// minWithin is the least time a renewal is given to retry.
	minWithin = 100 * time.Millisecond
)

// leaseOf is how long a lease lasts, counted from the send of the request it answered: what the
// service said was left of it at its answer (ttl_remaining_ms, by the database's clock), at most
// the ttl asked for. The answer came after the send, so the lease never ends sooner than that by
// the service's count; counting from the answer's reading instead could make it seem longer.
func leaseOf(ttl time.Duration, remainingMs int64) time.Duration {
	remaining := time.Duration(remainingMs) * time.Millisecond
	if remaining < 0 {
		return 0
	}
	if remaining > ttl {
		return ttl
	}
	return remaining
}

// term is what an answer about a held lease (its grant's, a renewal's) says of its end, counted
// from the send of the request it answered.
type term struct {
	// lease is how long the lease lasts (leaseOf).
	lease time.Duration
	// holdLimitAt is the hold limit as the answer named it (nil: none), which has surely come hold
	// after the send.
	holdLimitAt *time.Time
	hold        time.Duration
}

// termOf is an answer's term. Its hold limit lies as far beyond the lease's end as the answer puts
// it (hold_limit_at - expires_at, database times both, never this machine's wall clock), and the
// lease's end ttl_remaining_ms after the answer, which came after the send: counted from the send,
// the limit never comes later than the service's.
func termOf(ttl time.Duration, expiresAt time.Time, remainingMs int64, holdLimitAt *time.Time) term {
	t := term{lease: leaseOf(ttl, remainingMs), holdLimitAt: holdLimitAt}
	if holdLimitAt != nil {
		t.hold = holdLimitAt.Sub(expiresAt) + time.Duration(remainingMs)*time.Millisecond
		if t.hold < 0 {
			t.hold = 0
		}
	}
	return t
}

// held is a held lock or session: its context, its clock and its renewals. The moment the lock
// may end by this process's clock is `ends`: the lease's end, counted from the latest successful
// renewal's send, or the hold limit if that comes first.
type held struct {
	ttl    time.Duration
	safety time.Duration
	// ctx is the callback's: cancelled the moment the lock may be lost (and when its parent is).
	ctx    context.Context
	cancel context.CancelFunc
	// renewing is the renewals': cancelled once they stop, and on loss.
	renewing     context.Context
	stopRenewing context.CancelFunc
	renewerDone  chan struct{}
	lostCh       chan struct{}
	// renewOnce sends one renewal, keeps its answer, and returns the term the answer gave.
	renewOnce func(ctx context.Context, within time.Duration) (term, error)

	mu     sync.Mutex
	sentAt time.Time // monotonic: when the latest successful renewal (or the grant) was sent
	ends   time.Time
	// limit is when the hold limit has surely come, by the monotonic clock (zero: no limit), and
	// holdLimitAt the service's word for it.
	limit       time.Time
	holdLimitAt time.Time
	lost        *LockLostError
	timer       *time.Timer
	// revocation is the first request to let go that an answer carried; revokedCh is closed then.
	revocation *Revocation
	revokedCh  chan struct{}
	// cancelOnRevocation: the callback's context is cancelled with the request (set before the
	// renewals start).
	cancelOnRevocation bool
}

func newHeld(parent context.Context, ttl time.Duration, sentAt time.Time, first term,
	renewOnce func(context.Context, time.Duration) (term, error)) *held {
	h := &held{
		ttl:         ttl,
		renewerDone: make(chan struct{}),
		lostCh:      make(chan struct{}),
		revokedCh:   make(chan struct{}),
		renewOnce:   renewOnce,
	}
	h.count(sentAt, first)
	// A lease that the hold limit makes shorter than the ttl has the margin of a lease that long:
	// a tenth of the ttl could take all of a short hold.
	lease := ttl
	if first.holdLimitAt != nil && first.hold < lease {
		lease = first.hold
	}
	h.safety = lease / safetyDivisor
	if h.safety < minSafety {
		h.safety = minSafety
	}
	h.ctx, h.cancel = context.WithCancel(parent)
	h.renewing, h.stopRenewing = context.WithCancel(context.Background())
	h.mu.Lock()
	h.arm()
	h.mu.Unlock()
	return h
}

// Context is the context handed to the callback: cancelled the moment the lock may be lost (a
// renewal refused, or the safety margin before the lease's end or its hold limit reached on this
// process's monotonic clock), once the lock is released, and when the context it was made from
// is. Go 1.19's contexts carry no cause: Err says why.
func (h *held) Context() context.Context { return h.ctx }

// Done is closed the moment the lock may be lost, or once it was released: a channel to select
// on, as Consul's lock has.
func (h *held) Done() <-chan struct{} { return h.lostCh }

// Err is nil while the lock is surely held, else the LockLostError that says why not (with a
// HoldLimitError inside, for errors.As, when the hold limit ended it).
func (h *held) Err() error {
	if lost := h.lostReason(); lost != nil {
		return lost
	}
	return nil
}

// Check is Err: call it between pieces of work.
func (h *held) Check() error { return h.Err() }

// Lost says whether the lock may be lost (or was released).
func (h *held) Lost() bool { return h.lostReason() != nil }

// Remaining is how long until the lease could lapse (or its hold limit come) by this process's
// clock, less the safety margin; negative once it has.
func (h *held) Remaining() time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	return time.Until(h.ends.Add(-h.safety))
}

// AtHoldLimit says whether the lease ends at the hold limit: no renewal takes it further, so
// none is sent, and the context is cancelled the safety margin before the limit.
func (h *held) AtHoldLimit() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.atLimit()
}

func (h *held) atLimit() bool { return !h.limit.IsZero() && !h.limit.After(h.ends) }

// RevocationRequested is closed once someone has asked the holder to let go
// (Client.RequestRevocation), learnt from a renewal's answer, so within a renewal period (TTL/3)
// of the request: finish the work cleanly and return, and the lock is released. Nothing is forced:
// the lock is still held, and the context is not cancelled for it.
func (h *held) RevocationRequested() <-chan struct{} { return h.revokedCh }

// Revocation is the request to let go (who asked, why, by when), the first one made, or nil while
// none is known.
func (h *held) Revocation() *Revocation {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.revocation
}

// asked notes the first revocation request that the lock objects of an answer carry: a lock's, or
// of a session's, any of its locks'.
func (h *held) asked(locks ...Lock) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, lock := range locks {
		if lock.Revocation != nil && h.revocation == nil {
			h.revocation = lock.Revocation
			close(h.revokedCh)
			if h.cancelOnRevocation {
				h.cancel() // the work stops; the lock is not lost, and is released after it
			}
		}
	}
}

// count counts the lease from the send of the request whose answer gave t.
func (h *held) count(sentAt time.Time, t term) {
	h.sentAt, h.ends = sentAt, sentAt.Add(t.lease)
	if t.holdLimitAt != nil {
		// The latest answer's count of the limit: from the latest send, the least clock drift.
		h.limit, h.holdLimitAt = sentAt.Add(t.hold), *t.holdLimitAt
	}
	if !h.limit.IsZero() && h.limit.Before(h.ends) {
		h.ends = h.limit
	}
}

func (h *held) lostReason() *LockLostError {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.checkClock()
	return h.lost
}

// checkClock loses the lease once its safety margin is reached; it says whether it is lost.
func (h *held) checkClock() bool {
	if h.lost == nil && !time.Now().Before(h.ends.Add(-h.safety)) {
		if h.atLimit() {
			h.loseLocked(&LockLostError{Reason: "the hold limit comes at " + h.holdLimitAt.Format(time.RFC3339Nano) +
				": no lease runs past it", holdLimit: true, holdLimitAt: h.holdLimitAt})
		} else {
			h.loseLocked(&LockLostError{Reason: "the lease may have lapsed: renewals did not succeed in time"})
		}
	}
	return h.lost != nil
}

// arm sets a timer for the moment the safety margin is reached, so that the context is cancelled
// by itself, on time, whatever the renewals are doing.
func (h *held) arm() {
	if h.timer != nil {
		h.timer.Stop()
		h.timer = nil
	}
	if h.checkClock() {
		return
	}
	h.timer = time.AfterFunc(time.Until(h.ends.Add(-h.safety)), func() {
		h.mu.Lock()
		defer h.mu.Unlock()
		if !h.checkClock() {
			h.arm() // the lease was renewed meanwhile
		}
	})
}

func (h *held) lose(reason *LockLostError) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.loseLocked(reason)
}

func (h *held) loseLocked(reason *LockLostError) {
	if h.lost != nil {
		return
	}
	h.lost = reason
	if h.timer != nil {
		h.timer.Stop()
		h.timer = nil
	}
	h.cancel()
	h.stopRenewing()
	close(h.lostCh)
}

// renewed counts the lease from a successful renewal's send, unless a later one was counted.
func (h *held) renewed(sentAt time.Time, t term) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.lost != nil || !sentAt.After(h.sentAt) {
		return // a lease counted lost stays lost
	}
	h.count(sentAt, t)
	h.arm()
}

// keepAlive renews every ttl/3 from the previous renewal's send until stopped or lost, or until
// the lease ends at the hold limit.
func (h *held) keepAlive() {
	defer close(h.renewerDone)
	period := h.ttl / 3
	h.mu.Lock()
	sent := h.sentAt
	h.mu.Unlock()
	for {
		if h.AtHoldLimit() {
			// No renewal takes the lease past the limit: the clock ends it (the renewals' context
			// is cancelled then too).
			<-h.renewing.Done()
			return
		}
		if sleep(h.renewing, time.Until(sent.Add(period))) != nil || h.Lost() {
			return
		}
		started := time.Now()
		sent = started
		within := h.Remaining()
		if within < minWithin {
			within = minWithin
		}
		t, err := h.renewOnce(h.renewing, within)
		if err == nil {
			h.renewed(started, t)
			continue
		}
		if h.renewing.Err() != nil || h.Lost() {
			return // stopped, or lost meanwhile by the clock
		}
		var lost *LockLostError
		if errors.As(err, &lost) {
			h.lose(lost)
			return
		}
		// Anything else (the service out of reach until the lease is nearly over, a key revoked):
		// try again next period; the clock says when the lease may be gone.
	}
}

// stop stops the renewals (one in flight is abandoned) and waits for them to end.
func (h *held) stop() {
	h.stopRenewing()
	<-h.renewerDone
}

// Lease is a held lock, renewed in the background every TTL/3 while WithLock's callback runs.
//
// Its Context (the callback's) is cancelled, and Done closed, the moment the lock may be lost: a
// renewal refused (410, 403, 404), or the lease's safety margin (a tenth of the TTL, at least
// 100 ms) reached on this process's monotonic clock because renewals did not succeed in time.
// Err then says why. Both happen too once WithLock has released the lock.
//
// With a hold limit (AcquireOptions.MaxHold), the limit is the end of the lease however the
// renewals go: the context is cancelled a safety margin before it (a tenth of the shorter of the
// TTL and the hold, at least 100 ms), and Err is then a LockLostError with a HoldLimitError
// inside. The limit is counted as the lease is, from the send of the latest answer that named it.
//
// A request that the holder let go (Client.RequestRevocation) closes RevocationRequested, and
// Revocation says who asked, why and by when, once a renewal's answer carries it. It cancels
// nothing: the lock is still held, and the callback decides when to finish and return.
type Lease struct {
	*held
	client *Client
	grant  *Grant

	answerMu sync.Mutex
	lock     Lock
}

// ID is the lock's id.
func (l *Lease) ID() int64 { return l.grant.ID }

// FencingToken strictly increases with every grant of the key: hand it to the storage the work
// writes to.
func (l *Lease) FencingToken() int64 { return l.grant.FencingToken }

// Slot is, of a semaphore, the place this lock holds (from 0); 0 for a plain lock.
func (l *Lease) Slot() int { return l.grant.Slot }

// MaxHolders is how many may hold the key at once: 1 for a plain lock.
func (l *Lease) MaxHolders() int { return l.grant.MaxHolders }

// Mode is Exclusive, or Shared (a reader, held beside the key's other readers).
func (l *Lease) Mode() Mode { return l.grant.Mode() }

// Grant is the acquire's answer (its Token included).
func (l *Lease) Grant() *Grant { return l.grant }

// Lock is the latest lock object the service answered: at the grant, or at the latest renewal or
// update.
func (l *Lease) Lock() Lock {
	l.answerMu.Lock()
	defer l.answerMu.Unlock()
	return l.lock
}

// keep keeps a lock object the service answered, and notes the revocation request it carries.
func (l *Lease) keep(lock Lock) {
	l.asked(lock)
	l.answerMu.Lock()
	defer l.answerMu.Unlock()
	if !l.Lost() {
		l.lock = lock
	}
}

// Update replaces the lock's metadata (progress, a leader's address) and returns the lock. It
// returns the LockLostError without a request when the lease is lost already, and when the
// service says it is (which loses the lease).
func (l *Lease) Update(ctx context.Context, metadata map[string]any) (*Lock, error) {
	if err := l.Err(); err != nil {
		return nil, err
	}
	within := l.Remaining()
	if within < minWithin {
		within = minWithin
	}
	lock, err := l.client.update(ctx, l.grant.ID, l.grant.token, metadata, within)
	var lost *LockLostError
	if errors.As(err, &lost) {
		l.lose(lost)
	}
	if err != nil {
		return nil, err
	}
	l.keep(*lock)
	return lock, nil
}

func (l *Lease) renewOnce(ctx context.Context, within time.Duration) (term, error) {
	renewed, err := l.client.renew(ctx, l.grant.ID, l.grant.token, l.grant.TTL, within)
	if err != nil {
		return term{}, err
	}
	l.keep(renewed.Lock)
	return termOf(l.grant.TTL, renewed.ExpiresAt, renewed.TTLRemainingMs, renewed.HoldLimitAt), nil
}

// SessionLease is a held session (all its locks), renewed in the background every TTL/3 with one
// request while WithSession's callback runs. Its Context is cancelled, and Done closed, as a
// Lease's, the moment any of its locks may be lost (the service ends a session that lost one,
// releasing the rest), and before its hold limit (SessionOptions.MaxHold), as a Lease's. Its
// RevocationRequested is closed once a request to let go of any of its locks is learnt.
type SessionLease struct {
	*held
	client *Client
	grant  *SessionGrant

	answerMu sync.Mutex
	session  Session
}

// ID is the session's id.
func (s *SessionLease) ID() int64 { return s.grant.ID }

// Grant is the session's opening answer (its Token included), with the locks added since.
func (s *SessionLease) Grant() *SessionGrant { return s.grant }

// Locks are its locks by job type.
func (s *SessionLease) Locks() map[string]Lock { return s.grant.Locks() }

// FencingTokens are the fencing token of each of its locks, by job type.
func (s *SessionLease) FencingTokens() map[string]int64 { return s.grant.FencingTokens() }

// Session is the latest session object the service answered.
func (s *SessionLease) Session() Session {
	s.answerMu.Lock()
	defer s.answerMu.Unlock()
	return s.session
}

func (s *SessionLease) renewOnce(ctx context.Context, within time.Duration) (term, error) {
	renewed, err := s.client.renewSession(ctx, s.grant.ID, s.grant.token, s.grant.TTL, within)
	if err != nil {
		return term{}, err
	}
	s.asked(renewed.Locks...)
	s.answerMu.Lock()
	if !s.Lost() {
		s.session = renewed.Session
	}
	s.answerMu.Unlock()
	return termOf(s.grant.TTL, renewed.ExpiresAt, renewed.TTLRemainingMs, renewed.HoldLimitAt), nil
}

// WithLock holds the lock while fn runs: it acquires (waiting up to opts.Wait), renews every
// TTL/3 in the background, and releases when fn returns, unless the lock was lost. fn's context
// is cancelled the moment the lock may be lost; pass it to what the work waits on.
//
// It returns fn's error; a *LockLostError when the lock was lost meanwhile (its Cause is fn's own
// error, if fn failed too), in which case it is not released, as it may be another's by then; and
// the acquire's error (LockHeldError, MaxHoldersMismatchError, UnavailableError, APIError, or
// ctx's) without calling fn. A release that fails otherwise than by the lock being lost leaves
// the lease to lapse. After an acquire that took longer than a renewal period (a wait), it renews
// once before fn starts, and counts the lease from that renewal. With opts.MaxHold, fn's context
// is cancelled before the lock's hold limit, however the renewals go, and WithLock returns a
// LockLostError with a HoldLimitError inside (errors.As finds it). A request that the holder let
// go closes lease.RevocationRequested() and cancels nothing (with opts.CancelOnRevocation, fn's
// context): return from fn to hand the lock over.
func (c *Client) WithLock(ctx context.Context, opts AcquireOptions, fn func(ctx context.Context, lease *Lease) error) error {
	if fn == nil {
		return errors.New("helixlocks: WithLock needs a function to run while holding the lock")
	}
	grant, err := c.Acquire(ctx, opts)
	if err != nil {
		return err
	}
	sentAt, latest := grant.sentAt, grant.Lock
	if time.Since(grant.sentAt) >= grant.TTL/3 {
		started := time.Now()
		renewed, err := c.renew(ctx, grant.ID, grant.token, grant.TTL, confirmWithin(grant.TTL))
		if err != nil {
			c.giveBack(err, func(ctx context.Context) error { return c.release(ctx, grant.ID, grant.token, time.Second) })
			return err
		}
		sentAt, latest = started, renewed.Lock
	}
	l := &Lease{client: c, grant: grant, lock: latest}
	first := termOf(grant.TTL, latest.ExpiresAt, latest.TTLRemainingMs, latest.HoldLimitAt)
	l.held = newHeld(ctx, grant.TTL, sentAt, first, l.renewOnce)
	l.cancelOnRevocation = opts.CancelOnRevocation
	l.asked(latest) // a request made during a long acquire, learnt from the confirming renewal
	release := func(ctx context.Context, within time.Duration) error {
		return c.release(ctx, grant.ID, grant.token, within)
	}
	return holding(l.held, func() error { return fn(l.ctx, l) }, release, "WithLock")
}

// WithSession holds all the locks of opts.JobTypes while fn runs, in one session: opened with all
// of them granted at once or none (LockHeldError, whose JobType names the first pair held; with
// Wait, it waits until all are free), renewed every TTL/3 with one request for all of them, and
// ended (every lock released) when fn returns, unless lost. It returns as WithLock does, and
// cancels fn's context before the session's hold limit (opts.MaxHold) as WithLock does.
func (c *Client) WithSession(ctx context.Context, opts SessionOptions,
	fn func(ctx context.Context, session *SessionLease) error) error {
	if fn == nil {
		return errors.New("helixlocks: WithSession needs a function to run while holding the locks")
	}
	grant, err := c.OpenSession(ctx, opts)
	if err != nil {
		return err
	}
	sentAt, latest := grant.sentAt, grant.Opened
	if time.Since(grant.sentAt) >= grant.TTL/3 {
		started := time.Now()
		renewed, err := c.renewSession(ctx, grant.ID, grant.token, grant.TTL, confirmWithin(grant.TTL))
		if err != nil {
			c.giveBack(err, func(ctx context.Context) error { return c.endSession(ctx, grant.ID, grant.token, time.Second) })
			return err
		}
		sentAt, latest = started, renewed.Session
	}
	s := &SessionLease{client: c, grant: grant, session: latest}
	first := termOf(grant.TTL, latest.ExpiresAt, latest.TTLRemainingMs, latest.HoldLimitAt)
	s.held = newHeld(ctx, grant.TTL, sentAt, first, s.renewOnce)
	s.cancelOnRevocation = opts.CancelOnRevocation
	s.asked(latest.Locks...)
	release := func(ctx context.Context, within time.Duration) error {
		return c.endSession(ctx, grant.ID, grant.token, within)
	}
	return holding(s.held, func() error { return fn(s.ctx, s) }, release, "WithSession")
}

func confirmWithin(ttl time.Duration) time.Duration {
	if ttl/3 < time.Second {
		return time.Second
	}
	return ttl / 3
}

// giveBack releases what a failed confirmation leaves held, unless it was lost: the work never
// starts on a lease that may be over.
func (c *Client) giveBack(err error, release func(ctx context.Context) error) {
	var lost *LockLostError
	if errors.As(err, &lost) {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = release(ctx)
}

// holding runs fn while h renews in the background, then stops the renewals (before releasing, so
// that no renewal crosses the release) and releases, unless the lock was lost.
func holding(h *held, fn func() error, release func(ctx context.Context, within time.Duration) error, name string) error {
	go h.keepAlive()
	var failure error
	func() {
		defer func() {
			if recovered := recover(); recovered != nil {
				h.stop()
				if h.lostReason() == nil {
					_ = releaseWithin(h, release)
					h.lose(&LockLostError{Reason: "released: " + name + "'s callback panicked"})
				}
				panic(recovered)
			}
		}()
		failure = fn()
	}()
	h.stop()
	if lost := h.lostReason(); lost != nil {
		return lost.withCause(failure) // a lost lock is not released: it may be another's now
	}
	err := releaseWithin(h, release)
	var lost *LockLostError
	switch {
	case err == nil:
		h.lose(&LockLostError{Reason: "released: " + name + "'s callback ended"})
	case errors.As(err, &lost):
		h.lose(lost)
		return h.lostReason().withCause(failure)
	default:
		h.lose(&LockLostError{Reason: name + "'s callback ended; the release failed, the lease lapses", Cause: err})
	}
	return failure
}

// releaseWithin releases within what is left of the lease (at least 1 s, at most 10 s), whatever
// became of the callback's context.
func releaseWithin(h *held, release func(ctx context.Context, within time.Duration) error) error {
	within := h.Remaining()
	if within < time.Second {
		within = time.Second
	}
	if within > defaultTimeout {
		within = defaultTimeout
	}
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	return release(ctx, within)
}
