package helixlocks

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sort"
	"strings"
	"sync"
	"time"
)

// SessionOptions name the locks a session holds and how.
type SessionOptions struct {
	OrganizationID string
	// JobTypes are the job types whose locks the session holds: 0 to 32, distinct, all granted at
	// once or none.
	JobTypes []string
	// Shared names the job types of JobTypes taken as shared locks (readers); the others are
	// exclusive.
	Shared []string
	// TTL is the session's lease, every lock's; renewed every TTL/3 by WithSession. Default 30 s.
	TTL time.Duration
	// Wait is how long to wait until all of them are free at once (none is held meanwhile).
	Wait time.Duration
	// Holder names the worker; default DefaultHolder().
	Holder string
	// Metadata is what each lock gets at its grant.
	Metadata map[string]any
	// MaxHold is a hold limit from the opening, as AcquireOptions.MaxHold is from a grant: no
	// lease of the session, nor so of any of its locks (added ones too), runs past it.
	MaxHold time.Duration
	// CancelOnRevocation: as AcquireOptions.CancelOnRevocation, for a request about any lock
	// of the session (WithSession).
	CancelOnRevocation bool
}

// AddLocksOptions name the locks added to a held session.
type AddLocksOptions struct {
	JobTypes []string
	Shared   []string
	Wait     time.Duration
}

// SessionGrant is an opened session: what the service granted (its locks, each with its own
// fencing token), and the token of the session and of all its locks.
type SessionGrant struct {
	ID             int64
	OrganizationID string
	Holder         string
	// TTL is the lease asked for.
	TTL time.Duration
	// Opened is the session object the service answered at the opening (without the token).
	Opened Session

	token  string
	sentAt time.Time // as Grant's
	mu     sync.Mutex
	locks  map[string]Lock
}

// Token is the secret of the session and of each of its locks (Lock-Token); not a field.
func (g *SessionGrant) Token() string { return g.token }

// Locks are its locks by job type: those granted at the opening and those added since.
func (g *SessionGrant) Locks() map[string]Lock {
	g.mu.Lock()
	defer g.mu.Unlock()
	locks := make(map[string]Lock, len(g.locks))
	for jobType, lock := range g.locks {
		locks[jobType] = lock
	}
	return locks
}

// FencingTokens are the fencing token of each of its locks, by job type: hand each to the storage
// its lock guards.
func (g *SessionGrant) FencingTokens() map[string]int64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	tokens := make(map[string]int64, len(g.locks))
	for jobType, lock := range g.locks {
		tokens[jobType] = lock.FencingToken
	}
	return tokens
}

func (g *SessionGrant) added(locks []Lock) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, lock := range locks {
		g.locks[lock.JobType] = lock
	}
}

// String describes the session without its token.
func (g *SessionGrant) String() string {
	jobTypes := make([]string, 0)
	for jobType := range g.Locks() {
		jobTypes = append(jobTypes, jobType)
	}
	sort.Strings(jobTypes)
	return fmt.Sprintf("session %d of %s held by %s: %s", g.ID, g.OrganizationID, g.Holder, strings.Join(jobTypes, ", "))
}

// sessionLocks is a session call's locks: each job type, shared if shared names it (the default,
// exclusive, is not sent).
func sessionLocks(jobTypes, shared []string) ([]map[string]any, error) {
	asked := make(map[string]bool, len(jobTypes))
	for _, jobType := range jobTypes {
		asked[jobType] = true
	}
	readers := make(map[string]bool, len(shared))
	var unknown []string
	for _, jobType := range shared {
		readers[jobType] = true
		if !asked[jobType] {
			unknown = append(unknown, jobType)
		}
	}
	if len(unknown) > 0 {
		sort.Strings(unknown)
		return nil, fmt.Errorf("helixlocks: Shared names job types the call does not ask for: %s", strings.Join(unknown, ", "))
	}
	locks := make([]map[string]any, 0, len(jobTypes))
	for _, jobType := range jobTypes {
		lock := map[string]any{"job_type": jobType}
		if readers[jobType] {
			lock["mode"] = Shared
		}
		locks = append(locks, lock)
	}
	return locks, nil
}

// OpenSession opens a session holding the locks of JobTypes, all granted at once or none
// (LockHeldError names the first pair held as JobType); with Wait, it waits until all are free.
// Renew it with RenewSession, end it with EndSession; or let WithSession do both. With MaxHold,
// Opened.HoldLimitAt is its hold limit.
func (c *Client) OpenSession(ctx context.Context, opts SessionOptions) (*SessionGrant, error) {
	locks, err := sessionLocks(opts.JobTypes, opts.Shared)
	if err != nil {
		return nil, err
	}
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
		"holder":          holder,
		"ttl_seconds":     seconds(ttl),
		"locks":           locks,
	}
	if opts.Metadata != nil {
		body["metadata"] = opts.Metadata
	}
	if opts.MaxHold != 0 {
		body["max_hold_seconds"] = seconds(opts.MaxHold)
	}
	got, sentAt, err := c.granted(ctx, "/v1/sessions", body, ttl, opts.Wait, nil)
	if err != nil {
		return nil, err
	}
	var opened openedSession
	if err := decode(got, &opened); err != nil {
		return nil, err
	}
	grant := &SessionGrant{
		ID:             opened.ID,
		OrganizationID: opened.OrganizationID,
		Holder:         opened.Holder,
		TTL:            ttl,
		Opened:         opened.Session,
		token:          opened.Token,
		sentAt:         sentAt,
		locks:          map[string]Lock{},
	}
	grant.added(opened.Locks)
	return grant, nil
}

// AddSessionLocks adds the locks of JobTypes to a held session, all granted at once or none
// (LockHeldError names the first pair held as JobType); with Wait, it waits until all are free.
// They share the session's lease, and session.Locks lists them from then on. A retry after a lost
// answer gets the same locks (one Idempotency-Key for every attempt).
func (c *Client) AddSessionLocks(ctx context.Context, session *SessionGrant, opts AddLocksOptions) ([]Lock, error) {
	locks, err := sessionLocks(opts.JobTypes, opts.Shared)
	if err != nil {
		return nil, err
	}
	body := map[string]any{"locks": locks}
	path := fmt.Sprintf("/v1/sessions/%d/locks", session.ID)
	got, _, err := c.granted(ctx, path, body, 20*time.Second, opts.Wait, map[string]string{"Lock-Token": session.token})
	if err != nil {
		return nil, err
	}
	var added Session
	if err := decode(got, &added); err != nil {
		return nil, err
	}
	session.added(added.Locks)
	return added.Locks, nil
}

// RenewSession gives the session and every one of its locks a new lease of ttl, in one request,
// or up to its hold limit if that comes first (SessionRenewed.Limited); LockLostError once it
// ended, or lost a lock (the service then released the rest), a HoldLimitError inside it once
// the hold limit has come.
func (c *Client) RenewSession(ctx context.Context, id int64, token string, ttl time.Duration) (*SessionRenewed, error) {
	return c.renewSession(ctx, id, token, ttl, defaultTimeout)
}

func (c *Client) renewSession(ctx context.Context, id int64, token string, ttl, within time.Duration) (*SessionRenewed, error) {
	if ttl == 0 {
		ttl = defaultTTL
	}
	got, err := c.send(ctx, call{
		method:  http.MethodPost,
		path:    fmt.Sprintf("/v1/sessions/%d/renew", id),
		header:  map[string]string{"Lock-Token": token},
		body:    fixed(map[string]any{"ttl_seconds": seconds(ttl)}),
		within:  within,
		holding: true,
	})
	if err != nil {
		return nil, err
	}
	var renewed SessionRenewed
	if err := decode(got, &renewed); err != nil {
		return nil, err
	}
	return &renewed, nil
}

// EndSession ends the session, releasing every lock of it; LockLostError if it had ended
// otherwise or lost a lock. A retry that finds it ended by its first attempt is a success.
func (c *Client) EndSession(ctx context.Context, id int64, token string) error {
	return c.endSession(ctx, id, token, defaultTimeout)
}

func (c *Client) endSession(ctx context.Context, id int64, token string, within time.Duration) error {
	_, err := c.send(ctx, call{
		method:  http.MethodDelete,
		path:    fmt.Sprintf("/v1/sessions/%d", id),
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

// GetSession returns a session and its unreleased locks; an APIError 404 for none (or another
// organization's).
func (c *Client) GetSession(ctx context.Context, id int64) (*Session, error) {
	var session Session
	if err := c.get(ctx, fmt.Sprintf("/v1/sessions/%d", id), nil, &session); err != nil {
		return nil, err
	}
	return &session, nil
}
