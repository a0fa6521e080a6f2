package helixlocks

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"time"
)

// AcquireOptions name the lock to acquire and how.
type AcquireOptions struct {
	OrganizationID string
	JobType        string
	// TTL is the lease (1 s to 24 h, to the millisecond); renewed every TTL/3 by WithLock.
	// Default 30 s.
	TTL time.Duration
	// Wait is how long to wait for a held lock (any duration: the service waits in rounds of at
	// most 60 s). Default 0: LockHeldError at once.
	Wait time.Duration
	// MaxHolders makes the key a semaphore: up to this many hold it at once, each in a slot of its
	// own (1 to 1000). Default 1.
	MaxHolders int
	// Mode is Shared for a reader, held beside the key's other readers and never beside an
	// exclusive lock, which waits for every reader; a reader waits behind a waiting writer. Not
	// with MaxHolders above 1. Default Exclusive.
	Mode Mode
	// Holder names the worker, for humans. Default DefaultHolder().
	Holder string
	// Metadata is the lock's metadata at grant (a JSON object of at most 8 KiB).
	Metadata map[string]any
	// MaxHold is a hold limit (1 s to 7 days): no lease of the lock runs past its grant plus
	// MaxHold (Grant.HoldLimitAt, by the database's clock), however it is renewed, so a holder
	// that hangs while its renewals go on loses the lock then; WithLock cancels the callback's
	// context a safety margin before it, with a HoldLimitError. Choose a little more than the
	// longest honest run: a run still going at the limit is cut short. Default 0: none.
	MaxHold time.Duration
	// HoldAtLeast closes the key behind the grant (1 s to 7 days; exclusive locks with MaxHolders
	// 1 only): no other lock of it is granted before Grant.ClosedUntil (its AcquiredAt plus
	// HoldAtLeast, by the database's clock), whatever becomes of this one, released at once
	// included. Acquires meanwhile get ClosedUntilError. So a job that many machines schedule runs
	// once per interval, however their clocks differ. Default 0: the key stays open.
	HoldAtLeast time.Duration
	// CancelOnRevocation makes WithLock cancel the callback's context when a request that the
	// holder let go is learnt (Client.RequestRevocation), as it does when the lock may be lost,
	// though the lock is still held: it is released when the callback returns. For work that
	// stops cleanly on cancellation. Default false: only lease.RevocationRequested() tells.
	CancelOnRevocation bool
}

// Grant is an acquired lock: the lock object the service answered, and the token that proves
// ownership.
type Grant struct {
	// Lock is the lock object of the grant.
	Lock
	// Reclaimed is the stale lock this acquire took over, or nil.
	Reclaimed *Reclaimed
	// TTL is the lease asked for.
	TTL time.Duration

	token string
	// sentAt is this process's monotonic clock when the acquire that was granted was sent (the
	// grant came after it, so a lease counted from there never ends after the service's).
	sentAt time.Time
}

// Token is the secret that proves ownership (the Lock-Token of renew, update and release). Not a
// field: a grant printed or serialized does not show it.
func (g *Grant) Token() string { return g.token }

// Mode is the grant's mode (Exclusive for a service older than modes).
func (g *Grant) Mode() Mode {
	if g.Lock.Mode == "" {
		return Exclusive
	}
	return g.Lock.Mode
}

// String describes the grant without its token.
func (g *Grant) String() string {
	return fmt.Sprintf("lock %d of %s/%s held by %s, fencing token %d, slot %d", g.ID, g.OrganizationID, g.JobType,
		g.Holder, g.FencingToken, g.Slot)
}

// Acquire takes a lock, or returns LockHeldError. With Wait, the service waits for a held lock
// (in rounds of at most 60 s) until the wait is over; between rounds, and after a 409 at once,
// the client asks again after the backoff's pause, at most Retry-After and what is left of the
// wait. Every attempt carries one Idempotency-Key, so that a retry after a lost answer or a 503
// (honouring Retry-After, for at most half the lease, at least 1 s) gets the same grant.
// MaxHoldersMismatchError comes at once, never waited for, and so does a ClosedUntilError whose
// key opens after the wait's end. With MaxHold, the grant's HoldLimitAt is its hold limit:
// renewals past it are refused (HoldLimitError). With HoldAtLeast, the grant's ClosedUntil is
// until when it closed the key.
func (c *Client) Acquire(ctx context.Context, opts AcquireOptions) (*Grant, error) {
	ttl := opts.TTL
	if ttl == 0 {
		ttl = defaultTTL
	}
	holder := opts.Holder
	if holder == "" {
		holder = DefaultHolder()
	}
	body := map[string]any{
		"organization_id": opts.OrganizationID,
		"job_type":        opts.JobType,
		"holder":          holder,
		"ttl_seconds":     seconds(ttl),
	}
	if opts.Metadata != nil {
		body["metadata"] = opts.Metadata
	}
	if opts.MaxHolders != 0 && opts.MaxHolders != 1 {
		body["max_holders"] = opts.MaxHolders // the default is not sent: an older service gets the same body
	}
	if opts.Mode != "" && opts.Mode != Exclusive {
		body["mode"] = opts.Mode
	}
	if opts.MaxHold != 0 {
		body["max_hold_seconds"] = seconds(opts.MaxHold) // likewise: no limit is not sent
	}
	if opts.HoldAtLeast != 0 {
		body["hold_at_least_seconds"] = seconds(opts.HoldAtLeast)
	}
	got, sentAt, err := c.granted(ctx, "/v1/locks", body, ttl, opts.Wait, nil)
	if err != nil {
		return nil, err
	}
	var grant acquired
	if err := decode(got, &grant); err != nil {
		return nil, err
	}
	return &Grant{Lock: grant.Lock, Reclaimed: grant.Reclaimed, TTL: ttl, token: grant.Token, sentAt: sentAt}, nil
}

// granted sends a grant's request (an acquire, a session's opening, locks added to a session)
// with one Idempotency-Key for every attempt, asked again after each 409 until wait is over. It
// returns the answer and when the round that got it was sent.
func (c *Client) granted(ctx context.Context, path string, body map[string]any, ttl, wait time.Duration,
	extra map[string]string) (*answer, time.Time, error) {
	waitable := wait >= 0
	if !waitable {
		body["wait_seconds"] = seconds(wait) // the service says what is wrong with it
	}
	header := map[string]string{"Idempotency-Key": newIdempotencyKey()} // a retry never locks us out
	for name, value := range extra {
		header[name] = value
	}
	giveUp := time.Now()
	if waitable {
		giveUp = giveUp.Add(wait)
	}
	within := ttl / 2
	if within < time.Second {
		within = time.Second
	}
	for round := 0; ; round++ {
		started := time.Now()
		got, err := c.send(ctx, call{
			method: http.MethodPost,
			path:   path,
			header: header,
			body: func() (any, time.Duration) {
				if !waitable {
					return body, 0
				}
				// Each attempt waits what is left of the wait, at most the service's 60 s.
				waiting := time.Until(giveUp).Round(time.Millisecond)
				if waiting > 60*time.Second {
					waiting = 60 * time.Second
				}
				if waiting <= 0 {
					return body, 0
				}
				asked := make(map[string]any, len(body)+1)
				for name, value := range body {
					asked[name] = value
				}
				asked["wait_seconds"] = seconds(waiting)
				return asked, waiting
			},
			within:        within,
			refusedWithin: refusedWithin,
		})
		if err == nil {
			return got, started, nil
		}
		var held *LockHeldError
		if !errors.As(err, &held) || !time.Now().Before(giveUp) {
			return nil, time.Time{}, err
		}
		left := time.Until(giveUp)
		var closed *ClosedUntilError
		isClosed := errors.As(err, &closed)
		if isClosed && closed.RetryAfter > left {
			// A closed key opens no sooner than Retry-After: asking again within the wait cannot help.
			return nil, time.Time{}, err
		}
		// The service waited as long as it would (a round ends at its 60 s), or does not wait: ask
		// again soon, never in a tight loop against a 409 that comes at once, never past the wait.
		pause := backoff(round)
		if held.RetryAfter < pause {
			pause = held.RetryAfter
		}
		// A key closed for longer than a round is refused at once until then: ask again once its
		// opening is within a round, which the service then waits for.
		if isClosed && closed.RetryAfter-closedRound > pause {
			pause = closed.RetryAfter - closedRound
		}
		if left < pause {
			pause = left
		}
		if err := sleep(ctx, pause); err != nil {
			return nil, time.Time{}, err
		}
	}
}

// closedRound is the longest the service waits in one acquire (60 s), less a margin for the
// round trip: a waiting acquire asks for a key closed longer than that again once its opening is
// this near.
const closedRound = 50 * time.Second

// Renew extends a held lock's lease to ttl from now, by the database's clock, or to its hold
// limit if that comes first (Renewed.Limited); LockLostError if the lock is not the token's any
// more (403, 404, 410), a HoldLimitError inside it once the hold limit has come.
func (c *Client) Renew(ctx context.Context, id int64, token string, ttl time.Duration) (*Renewed, error) {
	return c.renew(ctx, id, token, ttl, defaultTimeout)
}

func (c *Client) renew(ctx context.Context, id int64, token string, ttl, within time.Duration) (*Renewed, error) {
	if ttl == 0 {
		ttl = defaultTTL
	}
	got, err := c.send(ctx, call{
		method:  http.MethodPost,
		path:    fmt.Sprintf("/v1/locks/%d/renew", id),
		header:  map[string]string{"Lock-Token": token},
		body:    fixed(map[string]any{"ttl_seconds": seconds(ttl)}),
		within:  within,
		holding: true,
	})
	if err != nil {
		return nil, err
	}
	var renewed Renewed
	if err := decode(got, &renewed); err != nil {
		return nil, err
	}
	return &renewed, nil
}

// Update replaces a held lock's metadata (progress, a leader's address) and returns the lock;
// LockLostError if the lock is not the token's any more. The lease is not changed.
func (c *Client) Update(ctx context.Context, id int64, token string, metadata map[string]any) (*Lock, error) {
	return c.update(ctx, id, token, metadata, defaultTimeout)
}

func (c *Client) update(ctx context.Context, id int64, token string, metadata map[string]any, within time.Duration) (*Lock, error) {
	got, err := c.send(ctx, call{
		method:  http.MethodPatch,
		path:    fmt.Sprintf("/v1/locks/%d", id),
		header:  map[string]string{"Lock-Token": token},
		body:    fixed(map[string]any{"metadata": metadata}),
		within:  within,
		holding: true,
	})
	if err != nil {
		return nil, err
	}
	var lock Lock
	if err := decode(got, &lock); err != nil {
		return nil, err
	}
	return &lock, nil
}

// Release releases a held lock; LockLostError if it had already ended otherwise (it was not the
// token's any more). A retry after an answer that never came (or a 503) may find the lock released
// by the first attempt: that is this release's own success, not a loss.
func (c *Client) Release(ctx context.Context, id int64, token string) error {
	return c.release(ctx, id, token, defaultTimeout)
}

func (c *Client) release(ctx context.Context, id int64, token string, within time.Duration) error {
	_, err := c.send(ctx, call{
		method:  http.MethodDelete,
		path:    fmt.Sprintf("/v1/locks/%d", id),
		header:  map[string]string{"Lock-Token": token},
		within:  within,
		holding: true,
	})
	var lost *LockLostError
	if errors.As(err, &lost) && lost.ReleasedByItsToken() {
		return nil
	}
	return err
}

// RevocationOptions say by when, and for whom, a revocation request asks the holder to let go.
type RevocationOptions struct {
	// Deadline is by when, from now, the asker would like the lock released (1 s to 24 h); after
	// it an admin may force the release. Default 0: the service's, 60 s.
	Deadline time.Duration
	// PreferredHolder reserves the key, once released, for that holder until the deadline (an
	// exclusive lock with MaxHolders 1 only): anyone else's acquire gets ReservedError meanwhile.
	// Holder names are not authenticated: it orders honest workers, it is not access control.
	// Default "": no reservation.
	PreferredHolder string
}

// RequestRevocation asks the holder of a live lock to let go, saying why (reason: 1 to 1024
// characters), and returns the lock, whose Revocation records the request: the first one made, as
// a repeat changes nothing (so a lost answer or a 503 is retried safely). Nothing is forced: the
// holder learns of it from its next renewal (Lease.RevocationRequested), finishes and releases.
// Any key of the lock's organization may ask; no token is needed. A LockLostError if the lock has
// ended; an APIError 404 if the key may see no such lock.
func (c *Client) RequestRevocation(ctx context.Context, lockID int64, reason string, opts RevocationOptions) (*Lock, error) {
	body := map[string]any{"reason": reason}
	if opts.Deadline != 0 {
		body["deadline_seconds"] = seconds(opts.Deadline)
	}
	if opts.PreferredHolder != "" {
		body["preferred_holder"] = opts.PreferredHolder
	}
	got, err := c.send(ctx, call{
		method:     http.MethodPost,
		path:       fmt.Sprintf("/v1/locks/%d/revocation", lockID),
		body:       fixed(body),
		within:     defaultTimeout,
		repeatable: true,
	})
	if err != nil {
		return nil, err
	}
	var lock Lock
	if err := decode(got, &lock); err != nil {
		return nil, err
	}
	return &lock, nil
}

// Get returns one lock, in any state; an APIError 404 for none (or another organization's).
func (c *Client) Get(ctx context.Context, id int64) (*Lock, error) {
	var lock Lock
	if err := c.get(ctx, fmt.Sprintf("/v1/locks/%d", id), nil, &lock); err != nil {
		return nil, err
	}
	return &lock, nil
}

// Current returns the lock held now for the key, or nil when none is (a lapsed lease included):
// of a semaphore, the one with the highest fencing token; of shared locks, the one with the
// highest token; else the exclusive holder.
func (c *Client) Current(ctx context.Context, key Key) (*Lock, error) {
	return c.current(ctx, key, nil)
}

// CurrentSlot returns the lock held now in a slot of the key (a semaphore's), or nil.
func (c *Client) CurrentSlot(ctx context.Context, key Key, slot int) (*Lock, error) {
	return c.current(ctx, key, &slot)
}

func (c *Client) current(ctx context.Context, key Key, slot *int) (*Lock, error) {
	query := url.Values{"organization_id": {key.OrganizationID}, "job_type": {key.JobType}}
	if slot != nil {
		query.Set("slot", strconv.Itoa(*slot))
	}
	var lock Lock
	err := c.get(ctx, "/v1/locks/current", query, &lock)
	var api *APIError
	if errors.As(err, &api) && api.Status == http.StatusNotFound && api.Kind() == "lock-not-found" {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return &lock, nil
}

// ListOptions filter a listing of locks. Zero values are not sent.
type ListOptions struct {
	OrganizationID string
	JobType        string
	// State is held or expired (default: both) to list live locks; released or reclaimed to read
	// the history, newest first.
	State string
	// Limit is the locks per page, 1 to 500; default 100.
	Limit int
	// Cursor starts from a page's NextCursor.
	Cursor string
}

func (o ListOptions) query() url.Values {
	query := url.Values{}
	set := func(name, value string) {
		if value != "" {
			query.Set(name, value)
		}
	}
	set("organization_id", o.OrganizationID)
	set("job_type", o.JobType)
	set("state", o.State)
	set("cursor", o.Cursor)
	if o.Limit != 0 {
		query.Set("limit", strconv.Itoa(o.Limit))
	}
	return query
}

// List returns one page of locks; pass its NextCursor as Cursor for the next (empty: none).
func (c *Client) List(ctx context.Context, opts ListOptions) (*Page, error) {
	var page Page
	if err := c.get(ctx, "/v1/locks", opts.query(), &page); err != nil {
		return nil, err
	}
	return &page, nil
}

// ListAll calls fn with every lock of the listing, page after page, until the last page or until
// fn returns an error (which ListAll returns).
func (c *Client) ListAll(ctx context.Context, opts ListOptions, fn func(Lock) error) error {
	for {
		page, err := c.List(ctx, opts)
		if err != nil {
			return err
		}
		for _, lock := range page.Items {
			if err := fn(lock); err != nil {
				return err
			}
		}
		if page.NextCursor == "" {
			return nil
		}
		opts.Cursor = page.NextCursor
	}
}

// QueueOptions name a key's queue, and the page of it.
type QueueOptions struct {
	OrganizationID string
	JobType        string
	Limit          int
	Cursor         string
}

// Queue returns one page of the key's queue: the acquires waiting for it, in the order they will
// be granted; pass its NextCursor as Cursor for the next.
func (c *Client) Queue(ctx context.Context, opts QueueOptions) (*QueuePage, error) {
	query := ListOptions{OrganizationID: opts.OrganizationID, JobType: opts.JobType, Limit: opts.Limit,
		Cursor: opts.Cursor}.query()
	var page QueuePage
	if err := c.get(ctx, "/v1/locks/queue", query, &page); err != nil {
		return nil, err
	}
	return &page, nil
}

// get reads a JSON answer into v, retried as any request for at most 10 s.
func (c *Client) get(ctx context.Context, path string, query url.Values, v any) error {
	got, err := c.send(ctx, call{method: http.MethodGet, path: path, query: query, within: defaultTimeout})
	if err != nil {
		return err
	}
	return decode(got, v)
}

func fixed(body any) func() (any, time.Duration) {
	return func() (any, time.Duration) { return body, 0 }
}
