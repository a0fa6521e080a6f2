package helixlocks

import (
	"encoding/json"
	"fmt"
	"strings"
	"time"
)

const problemPrefix = "urn:helix-locks:problem:"

// Problem is an RFC 9457 (formerly 7807) problem as the service sent it: type, title, status,
// detail, and the fields of its kind in Fields.
type Problem struct {
	Type   string
	Title  string
	Status int
	Detail string
	// Errors names each invalid field of a 422.
	Errors []FieldError
	// Fields holds every field of the problem as sent (numbers as json.Number), its kind's own
	// ones included: lock_id, holder, release_reason, end_reason…
	Fields map[string]any
}

// FieldError is one invalid field of a 422.
type FieldError struct {
	Field   string `json:"field"`
	Message string `json:"message"`
}

// Kind is the problem's type without its URN prefix: invalid-request, lock-held, lock-ended…
func (p *Problem) Kind() string {
	if p == nil {
		return ""
	}
	return strings.TrimPrefix(p.Type, problemPrefix)
}

// String is the text of one of the problem's fields, or "" when it has none.
func (p *Problem) String(name string) string {
	if p == nil {
		return ""
	}
	text, _ := p.Fields[name].(string)
	return text
}

// Int is one of the problem's integer fields, and whether it has one.
func (p *Problem) Int(name string) (int64, bool) {
	if p == nil {
		return 0, false
	}
	number, ok := p.Fields[name].(json.Number)
	if !ok {
		return 0, false
	}
	value, err := number.Int64()
	return value, err == nil
}

func (p *Problem) said() string {
	if p == nil {
		return ""
	}
	if p.Detail != "" {
		return p.Detail
	}
	return p.Title
}

// parseProblem reads an error answer's body: its JSON object, or a problem whose detail is the
// first 200 bytes of whatever else it was.
func parseProblem(body []byte, isJSON bool) *Problem {
	problem := &Problem{Fields: map[string]any{}}
	if isJSON {
		decoder := json.NewDecoder(strings.NewReader(string(body)))
		decoder.UseNumber()
		var fields map[string]any
		if decoder.Decode(&fields) == nil && fields != nil {
			problem.Fields = fields
		}
	}
	if len(problem.Fields) == 0 {
		text := string(body)
		if len(text) > 200 {
			text = text[:200]
		}
		problem.Fields["detail"] = text
	}
	problem.Type, _ = problem.Fields["type"].(string)
	problem.Title, _ = problem.Fields["title"].(string)
	problem.Detail, _ = problem.Fields["detail"].(string)
	if status, ok := problem.Int("status"); ok {
		problem.Status = int(status)
	}
	if list, ok := problem.Fields["errors"].([]any); ok {
		for _, item := range list {
			entry, _ := item.(map[string]any)
			field, _ := entry["field"].(string)
			message, _ := entry["message"].(string)
			problem.Errors = append(problem.Errors, FieldError{Field: field, Message: message})
		}
	}
	return problem
}

// APIError is an answer of the service that no more specific error stands for: a bad request
// (422, with Problem.Errors naming each field), a missing or revoked key (401), another
// organization (403), a quota that lasted (429), and so on. LockHeldError (ClosedUntilError and
// ReservedError too), MaxHoldersMismatchError and TokenMismatchError are APIErrors too (errors.As
// finds it in them).
type APIError struct {
	// Status is the HTTP status.
	Status  int
	Problem *Problem
	// RequestID is the answer's X-Request-Id, which the service's log line carries too.
	RequestID string
	// RetryAfter is the answer's Retry-After, when it had one that reads as seconds; else nil.
	RetryAfter *time.Duration
}

func (e *APIError) Error() string {
	said := e.Problem.said()
	if said == "" {
		said = "error"
	}
	said = fmt.Sprintf("%d: %s", e.Status, said)
	if e.Problem != nil {
		for _, field := range e.Problem.Errors {
			said += fmt.Sprintf("\n  %s: %s", field.Field, field.Message)
		}
	}
	return said
}

// Kind is the problem's type without its URN prefix (lock-held, invalid-request…).
func (e *APIError) Kind() string { return e.Problem.Kind() }

// LockHeldError says that another holder has the lock (409 lock-held); of a semaphore, live locks
// hold every slot; to a shared acquire, a writer holds or waits for the key (waiters-ahead); the
// key is closed (ClosedUntilError) or reserved for another holder (ReservedError). Every 409 but
// max-holders-mismatch is one: Kind says which, and errors.As finds the more specific error.
type LockHeldError struct {
	APIError
	// LockID, Holder and ExpiresAt name the held lock whose lease runs out first (zero when the
	// body names none, as a waiters-ahead of a key nobody holds).
	LockID    int64
	Holder    string
	ExpiresAt time.Time
	// MaxHolders is the key's number of slots (1 for a plain lock).
	MaxHolders int
	// Holders lists at most 20 held locks, those whose leases run out first; HoldersTotal counts
	// them all.
	Holders      []Holder
	HoldersTotal int
	// Mode is the held locks' mode: Shared when readers hold the key, else Exclusive.
	Mode Mode
	// JobType is, to a session's call, the job type of the first pair (in job type order) held.
	JobType string
	// Waiting is, of a 409 waiters-ahead, how many acquires wait in the key's queue and come first.
	Waiting int
	// RetryAfter is the answer's Retry-After (the seconds until the first lease ends, at least 1),
	// or 1 s when it had none.
	RetryAfter time.Duration
}

func newLockHeld(api APIError, retryAfter time.Duration) *LockHeldError {
	p := api.Problem
	e := &LockHeldError{APIError: api, RetryAfter: retryAfter, Mode: Exclusive, MaxHolders: 1}
	e.LockID, _ = p.Int("lock_id")
	e.Holder = p.String("holder")
	if at, err := time.Parse(time.RFC3339Nano, p.String("expires_at")); err == nil {
		e.ExpiresAt = at
	}
	if n, ok := p.Int("max_holders"); ok {
		e.MaxHolders = int(n)
	}
	if list, ok := p.Fields["holders"].([]any); ok {
		raw, _ := json.Marshal(list)
		_ = json.Unmarshal(raw, &e.Holders)
	} else if e.LockID != 0 {
		// A service older than semaphores names its one holder only.
		e.Holders = []Holder{{LockID: e.LockID, Holder: e.Holder, ExpiresAt: e.ExpiresAt}}
	}
	e.HoldersTotal = len(e.Holders)
	if n, ok := p.Int("holders_total"); ok {
		e.HoldersTotal = int(n)
	}
	if p.String("mode") == string(Shared) {
		e.Mode = Shared
	}
	e.JobType = p.String("job_type")
	if n, ok := p.Int("waiting"); ok {
		e.Waiting = int(n)
	}
	return e
}

func (e *LockHeldError) Error() string {
	switch {
	case e.Waiting > 0:
		return fmt.Sprintf("%d acquires wait in the queue, and come first", e.Waiting)
	case e.Mode == Shared:
		return fmt.Sprintf("held by %d shared lock(s), the first until %s", e.HoldersTotal, e.Problem.String("expires_at"))
	case e.Holder != "":
		return fmt.Sprintf("held by %s until %s", e.Holder, e.Problem.String("expires_at"))
	}
	return "held: " + e.APIError.Error()
}

// As lets errors.As find the APIError in a LockHeldError.
func (e *LockHeldError) As(target any) bool {
	if api, ok := target.(**APIError); ok {
		*api = &e.APIError
		return true
	}
	return false
}

// ClosedUntilError says that a grant with HoldAtLeast closed the key (409 closed-until): no lock
// of it is granted before ClosedUntil, whoever holds it now, if anyone. It is a LockHeldError too
// (errors.As finds it), so code that waits or gives up on "someone else has it" keeps working; its
// RetryAfter counts the whole seconds until the key opens, and JobType names the closed key of a
// session's call. A waiting acquire whose wait would end before the opening returns it at once.
type ClosedUntilError struct {
	LockHeldError
	// ClosedUntil is when the key opens, by the database's clock (zero when the body does not say).
	ClosedUntil time.Time
}

func (e *ClosedUntilError) Error() string {
	return "closed until " + e.Problem.String("closed_until")
}

// As lets errors.As find the LockHeldError (and so the APIError) in a ClosedUntilError.
func (e *ClosedUntilError) As(target any) bool { return e.LockHeldError.asHeld(target) }

// ReservedError says that a revocation request reserved the free key for its PreferredHolder
// until Deadline (409 reserved): anyone else's acquire is refused meanwhile. It is a LockHeldError
// too (errors.As finds it); its RetryAfter counts the whole seconds until the deadline.
type ReservedError struct {
	LockHeldError
	PreferredHolder string
	// Deadline is when the reservation ends, by the database's clock (zero when the body does not
	// say).
	Deadline time.Time
}

func (e *ReservedError) Error() string {
	return fmt.Sprintf("reserved for %s until %s", e.PreferredHolder, e.Problem.String("deadline"))
}

// As lets errors.As find the LockHeldError (and so the APIError) in a ReservedError.
func (e *ReservedError) As(target any) bool { return e.LockHeldError.asHeld(target) }

// asHeld is the As of an error that embeds a LockHeldError: it finds that, or its APIError.
func (e *LockHeldError) asHeld(target any) bool {
	if held, ok := target.(**LockHeldError); ok {
		*held = e
		return true
	}
	return e.As(target)
}

// MaxHoldersMismatchError says that the key's held locks share another max_holders than the
// acquire named (409 max-holders-mismatch): a configuration error, which waiting does not cure.
type MaxHoldersMismatchError struct {
	APIError
	// MaxHolders is the value in force (0 when the body does not say).
	MaxHolders int
}

func (e *MaxHoldersMismatchError) Error() string {
	return fmt.Sprintf("the key's held locks share max_holders %d: %s", e.MaxHolders, e.APIError.Error())
}

// As lets errors.As find the APIError in a MaxHoldersMismatchError.
func (e *MaxHoldersMismatchError) As(target any) bool {
	if api, ok := target.(**APIError); ok {
		*api = &e.APIError
		return true
	}
	return false
}

// TokenMismatchError says that a Lock-Token is not the lock's (403 token-mismatch). To a held
// lock's renewal, update or release it comes inside a LockLostError (errors.As finds it there):
// the lock is not this holder's.
type TokenMismatchError struct {
	APIError
}

func (e *TokenMismatchError) Error() string { return "token mismatch: " + e.APIError.Error() }

// As lets errors.As find the APIError in a TokenMismatchError.
func (e *TokenMismatchError) As(target any) bool {
	if api, ok := target.(**APIError); ok {
		*api = &e.APIError
		return true
	}
	return false
}

// LockLostError says that the lock is not held any more: it ended (released, reclaimed, forced),
// its token does not match, it is gone, or it may have lapsed by this process's own clock because
// renewals did not succeed in time.
type LockLostError struct {
	// Reason says why, for humans.
	Reason string
	// Status is the service's answer that said so (410, 403, 404); 0 when the clock did.
	Status int
	// Problem is that answer's problem, or nil.
	Problem   *Problem
	RequestID string
	// Cause is, from WithLock and WithSession, the callback's own error when it failed too (or the
	// release's failure); errors.Is and errors.As look there through Unwrap.
	Cause error

	// holdLimit: the loss is the hold limit's (errors.As finds a HoldLimitError), which came at
	// holdLimitAt as the service named it (zero when it did not).
	holdLimit   bool
	holdLimitAt time.Time
}

func (e *LockLostError) Error() string {
	if e.Cause != nil {
		return fmt.Sprintf("lock lost: %s (and: %v)", e.Reason, e.Cause)
	}
	return "lock lost: " + e.Reason
}

// Unwrap is Cause.
func (e *LockLostError) Unwrap() error { return e.Cause }

// As lets errors.As find a TokenMismatchError in the loss that a 403 token-mismatch told, and a
// HoldLimitError in a loss to the hold limit.
func (e *LockLostError) As(target any) bool {
	switch target := target.(type) {
	case **TokenMismatchError:
		if e.Status != 403 || e.Problem.Kind() != "token-mismatch" {
			return false
		}
		*target = &TokenMismatchError{APIError{Status: e.Status, Problem: e.Problem, RequestID: e.RequestID}}
		return true
	case **HoldLimitError:
		if !e.holdLimit {
			return false
		}
		*target = &HoldLimitError{LockLostError: *e, HoldLimitAt: e.holdLimitAt}
		return true
	}
	return false
}

// ReleasedByItsToken says whether the lock was released with this holder's own token, by an
// earlier attempt whose answer was lost: a 410 answers only a request whose Lock-Token matched (a
// wrong one is 403 whatever the state), and its release_reason (a session's end_reason) says
// "released".
func (e *LockLostError) ReleasedByItsToken() bool {
	return e.Status == 410 && (e.Problem.String("release_reason") == "released" || e.Problem.String("end_reason") == "released")
}

// withCause is the loss, with the callback's own error as its cause when it failed otherwise.
func (e *LockLostError) withCause(cause error) *LockLostError {
	if cause == nil || cause == error(e) {
		return e
	}
	copied := *e
	copied.Cause = cause
	return &copied
}

// HoldLimitError says that the hold limit (AcquireOptions.MaxHold, SessionOptions.MaxHold) has
// come, or is about to: a renewal was answered 410 hold-limit-reached, or the safety margin before
// the limit was reached on this process's monotonic clock. No renewal takes a lease past the
// limit, however well the holder is doing, so the lock is lost as any LockLostError says, and the
// next acquire of the key reclaims it once the limit has come. It comes inside a LockLostError,
// as a TokenMismatchError does: errors.As finds either.
type HoldLimitError struct {
	LockLostError
	// HoldLimitAt is the limit as the service named it (hold_limit_at); zero when it did not.
	HoldLimitAt time.Time
}

// As lets errors.As find the LockLostError in a HoldLimitError.
func (e *HoldLimitError) As(target any) bool {
	if lost, ok := target.(**LockLostError); ok {
		*lost = &e.LockLostError
		return true
	}
	return e.LockLostError.As(target)
}

// UnavailableError says that the service could not be reached, or kept answering 502, 503 or 504,
// until the retries ran out.
type UnavailableError struct {
	Message string
	// Status is the last answer's status, 0 when none came; Problem its problem, if any.
	Status  int
	Problem *Problem
	// Err is the last network error, if any.
	Err error
}

func (e *UnavailableError) Error() string { return e.Message }

// Unwrap is the last network error.
func (e *UnavailableError) Unwrap() error { return e.Err }
