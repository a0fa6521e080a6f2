package helixlocks

import (
	"encoding/json"
	"time"
)

// Mode is a lock's mode: Exclusive (the default) or Shared.
type Mode string

const (
	// Exclusive: no other lock of the key is held beside it (up to MaxHolders of them, for a
	// semaphore, each in a slot of its own).
	Exclusive Mode = "exclusive"
	// Shared: a reader, held beside the key's other shared locks (up to 1000, each with a lease of
	// its own), never beside an exclusive one.
	Shared Mode = "shared"
)

// Key names what a lock is for: one live lock per key at a time, or up to max_holders.
type Key struct {
	OrganizationID string
	JobType        string
}

// Lock is the lock object every endpoint that returns a lock returns (never with its token).
// Times are the database's.
type Lock struct {
	ID             int64  `json:"id"`
	OrganizationID string `json:"organization_id"`
	JobType        string `json:"job_type"`
	Holder         string `json:"holder"`
	// FencingToken strictly increases with every grant of the key (across all the slots of a
	// semaphore, and across shared and exclusive grants): hand it to the storage the work writes to.
	FencingToken int64      `json:"fencing_token"`
	AcquiredAt   time.Time  `json:"acquired_at"`
	ExpiresAt    time.Time  `json:"expires_at"`
	ReleasedAt   *time.Time `json:"released_at"`
	// ReleaseReason is released, reclaimed or forced; empty while the lock has not ended.
	ReleaseReason string `json:"release_reason"`
	// State is held (live), expired (its lease ran out, not yet reclaimed), released or reclaimed.
	State string `json:"state"`
	// TTLRemainingMs is the milliseconds of lease left when the database answered.
	TTLRemainingMs int64          `json:"ttl_remaining_ms"`
	Metadata       map[string]any `json:"metadata"`
	// MaxHolders is how many locks may hold the key at once (1 for a plain lock); Slot is which
	// of those places this lock holds, from 0.
	MaxHolders int  `json:"max_holders"`
	Slot       int  `json:"slot"`
	Mode       Mode `json:"mode"`
	// ForcedBy is the id of the admin key that released the lock by force; empty otherwise.
	ForcedBy string `json:"forced_by"`
	// SessionID is the session the lock belongs to, whose token and lease it shares; 0 for a lock
	// on its own.
	SessionID int64 `json:"session_id"`
	// HoldLimitAt is the lock's hold limit: acquired_at + the acquire's MaxHold. No lease of the
	// lock runs past it, however it is renewed. Nil without one (and from a service older than
	// hold limits).
	HoldLimitAt *time.Time `json:"hold_limit_at"`
	// ClosedUntil is until when the grant closed its key (AcquiredAt + the acquire's HoldAtLeast):
	// no other lock of the key is granted before it, whatever becomes of this one. Nil when the
	// acquire closed nothing (and from a service older than closed keys).
	ClosedUntil *time.Time `json:"closed_until"`
	// Revocation is the request that the holder let go (Client.RequestRevocation), the first one
	// made; nil when none was.
	Revocation *Revocation `json:"revocation"`
}

// Revocation is a request that a lock's holder let go: nothing is forced, the lock is still held.
// Times are the database's.
type Revocation struct {
	RequestedAt time.Time `json:"requested_at"`
	Reason      string    `json:"reason"`
	// Deadline is by when the asker would like the lock released; after it an admin may force it.
	Deadline time.Time `json:"deadline"`
	// By is the id of the API key that asked; empty for an anonymous request.
	By string `json:"by"`
	// PreferredHolder is the holder the key is reserved for, once released, until Deadline; empty
	// for none.
	PreferredHolder string `json:"preferred_holder"`
}

// Reclaimed is the stale lock an acquire took over.
type Reclaimed struct {
	LockID    int64     `json:"lock_id"`
	Holder    string    `json:"holder"`
	ExpiredAt time.Time `json:"expired_at"`
}

// Renewed is a renewal's answer: the lock, whether its lease had run out before the renewal
// (nobody had reclaimed it meanwhile), and whether the hold limit cut the new lease short.
type Renewed struct {
	Lock
	Lapsed bool `json:"lapsed"`
	// Limited: the new lease ends at HoldLimitAt, sooner than the ttl asked; no renewal takes it
	// further.
	Limited bool `json:"limited"`
}

// Holder is one held lock of a key, as a 409 lock-held lists them.
type Holder struct {
	LockID    int64     `json:"lock_id"`
	Holder    string    `json:"holder"`
	Slot      int       `json:"slot"`
	ExpiresAt time.Time `json:"expires_at"`
}

// Page is one page of a listing; NextCursor is empty when nothing follows.
type Page struct {
	Items      []Lock `json:"items"`
	NextCursor string `json:"next_cursor"`
}

// Place is one place in a key's queue: a waiting acquire.
type Place struct {
	Holder       string    `json:"holder"`
	Mode         Mode      `json:"mode"`
	MaxHolders   int       `json:"max_holders"`
	WaitingSince time.Time `json:"waiting_since"`
	WaitUntil    time.Time `json:"wait_until"`
	// Position counts from 1: the next to be granted.
	Position int `json:"position"`
}

// QueuePage is one page of a key's queue, first place first; NextCursor is empty when nothing
// follows.
type QueuePage struct {
	Items      []Place `json:"items"`
	NextCursor string  `json:"next_cursor"`
}

// Session is a session as the service answers it: one lease that its locks share.
type Session struct {
	ID             int64     `json:"id"`
	OrganizationID string    `json:"organization_id"`
	Holder         string    `json:"holder"`
	ExpiresAt      time.Time `json:"expires_at"`
	TTLRemainingMs int64     `json:"ttl_remaining_ms"`
	// State is held, expired or ended.
	State string `json:"state"`
	// Locks are its unreleased locks, in job type order.
	Locks []Lock `json:"locks"`
	// HoldLimitAt is the session's hold limit: its opening + SessionOptions.MaxHold. No lease of
	// the session, nor so of any of its locks, runs past it. Nil without one.
	HoldLimitAt *time.Time `json:"hold_limit_at"`
}

// SessionRenewed is a session's renewal answer.
type SessionRenewed struct {
	Session
	Lapsed bool `json:"lapsed"`
	// Limited: the new lease ends at HoldLimitAt, as a Renewed's.
	Limited bool `json:"limited"`
}

// Event is one event of GET /v1/events.
type Event struct {
	// ID is the event's id in the stream: what a watch resumes after (WatchOptions.LastEventID).
	ID string `json:"-"`
	// Type is acquired, renewed, updated, released, forced, expired, reclaimed or
	// revocation-requested (Lock.Revocation says who asked, why and by when).
	Type string `json:"type"`
	// At is when it happened, by the database's clock.
	At   time.Time `json:"at"`
	Lock Lock      `json:"lock"`
	// Reclaimed is, of an acquired event, the stale lock the grant took over.
	Reclaimed *Reclaimed `json:"reclaimed"`
	// Data is the event's data as the service sent it.
	Data json.RawMessage `json:"-"`
}

// acquired is an acquire's answer as sent.
type acquired struct {
	Lock
	Token     string     `json:"token"`
	Reclaimed *Reclaimed `json:"reclaimed"`
}

// openedSession is a session's opening answer as sent.
type openedSession struct {
	Session
	Token string `json:"token"`
}
