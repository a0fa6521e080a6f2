package helixlocks

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/user"
	"strings"
	"sync"
	"syscall"
	"time"
)

const (
	defaultURL     = "http://127.0.0.1:8080"
	defaultTimeout = 10 * time.Second
	defaultTTL     = 30 * time.Second
	// maxAnswerBytes is the largest answer read: a full listing page is far smaller.
	maxAnswerBytes = 32 << 20
)

// Options configure a Client. The zero value takes the service's address from HELIX_LOCKS_URL
// (else http://127.0.0.1:8080) and the key from HELIX_LOCKS_API_KEY.
type Options struct {
	// URL is the service's root address, http:// or https://.
	URL string
	// APIKey is sent as a Bearer token.
	APIKey string
	// Timeout is how long one attempt of a request may take (a waiting acquire's: plus its wait).
	// Default 10 s.
	Timeout time.Duration
	// HTTPClient sends the requests; default, a client of its own that follows no redirect.
	HTTPClient *http.Client
}

// Client is a client of a Helix Locks service, safe for use by several goroutines at once.
// Durations (TTL, Wait) go to the service as seconds, to the millisecond.
type Client struct {
	baseURL string
	apiKey  string
	timeout time.Duration
	http    *http.Client
}

// New makes a client; an error, at once, for an address that cannot be the service's.
func New(opts Options) (*Client, error) {
	address := opts.URL
	if address == "" {
		address = os.Getenv("HELIX_LOCKS_URL")
	}
	if address == "" {
		address = defaultURL
	}
	address = strings.TrimRight(address, "/")
	parsed, err := url.Parse(address)
	if err != nil {
		return nil, fmt.Errorf("helixlocks: not a URL: %q: %w", address, err)
	}
	if (parsed.Scheme != "http" && parsed.Scheme != "https") || parsed.Host == "" {
		return nil, fmt.Errorf("helixlocks: not a service URL: %q: it needs http:// or https:// and a host", address)
	}
	apiKey := opts.APIKey
	if apiKey == "" {
		apiKey = os.Getenv("HELIX_LOCKS_API_KEY")
	}
	timeout := opts.Timeout
	if timeout == 0 {
		timeout = defaultTimeout
	}
	if timeout < 0 {
		return nil, fmt.Errorf("helixlocks: a negative timeout: %v", timeout)
	}
	client := opts.HTTPClient
	if client == nil {
		transport := http.DefaultTransport.(*http.Transport).Clone()
		transport.MaxIdleConnsPerHost = 16
		client = &http.Client{
			Transport: transport,
			// A redirect is not the service's answer: it is an APIError, as any other.
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		}
	}
	return &Client{baseURL: address, apiKey: apiKey, timeout: timeout, http: client}, nil
}

// URL is the service's address, as the client sends its requests there.
func (c *Client) URL() string { return c.baseURL }

var (
	holderOnce sync.Once
	holderName string
)

// DefaultHolder is user@host:pid, so that a human can tell whose worker holds a lock.
func DefaultHolder() string {
	holderOnce.Do(func() {
		name := "go"
		if current, err := user.Current(); err == nil && current.Username != "" {
			name = current.Username
		}
		host, err := os.Hostname()
		if err != nil {
			host = "localhost"
		}
		holderName = fmt.Sprintf("%s@%s:%d", name, host, os.Getpid())
	})
	return holderName
}

// newIdempotencyKey is a random UUID (version 4): one per logical acquire, sent on every attempt.
func newIdempotencyKey() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(fmt.Sprintf("helixlocks: no randomness for an Idempotency-Key: %v", err))
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

// seconds is a duration as the service takes it: seconds, to the millisecond.
func seconds(d time.Duration) float64 {
	return float64(d.Round(time.Millisecond)) / float64(time.Second)
}

// answer is one HTTP answer, read.
type answer struct {
	status  int
	header  http.Header
	body    []byte
	json    bool
	problem *Problem // of an error status
}

// call is one request as send retries it.
type call struct {
	method string
	path   string
	query  url.Values
	header map[string]string
	// body is computed again before each attempt: the body (nil: none), and how much longer than
	// the client's timeout the attempt may take (a waiting acquire's wait).
	body func() (any, time.Duration)
	// within is how long to go on retrying, from the first failed attempt.
	within time.Duration
	// refusedWithin is how long to go on retrying a refused connection, from the start (0: within).
	refusedWithin time.Duration
	// holding: the request acts on a lock this client holds, so 403 and 404 mean it is lost too.
	holding bool
	// repeatable: a POST whose repeat changes nothing (a revocation request keeps the first one),
	// so it may be sent again whatever became of an earlier attempt.
	repeatable bool
}

// send sends one request, retried on network trouble and on the retried statuses (after
// Retry-After when given) for at most within from the first failure, a refused connection for at
// most refusedWithin from the start. Every request this client sends may be repeated: an acquire
// carries its Idempotency-Key, a revocation request is repeatable, and the rest act on one lock
// or read. A POST without an Idempotency-Key would be sent again only when the service surely did
// nothing (429, a refused connection). A success comes back as its answer, a refusal as its error.
func (c *Client) send(ctx context.Context, r call) (*answer, error) {
	started := time.Now()
	idempotent := r.method != http.MethodPost || r.holding || r.repeatable || r.header["Idempotency-Key"] != ""
	refusing := r.refusedWithin
	if refusing == 0 {
		refusing = r.within
	}
	refusedUntil := started.Add(refusing)
	var until time.Time
	target := c.baseURL + r.path
	if len(r.query) > 0 {
		target += "?" + r.query.Encode()
	}
	for attempt := 0; ; attempt++ {
		got, err := c.attempt(ctx, r, target)
		if err != nil && ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if got != nil && !retried[got.status] {
			if failure := c.errorFor(got, r.holding); failure != nil {
				return nil, failure
			}
			return got, nil
		}
		if got != nil && !idempotent && unknownOutcome[got.status] {
			return nil, c.gaveUp(time.Since(started), nil, got) // it may have taken effect
		}
		if got == nil && !transient(err) {
			return nil, err // a mistake in the request, or not the service
		}
		if got == nil && !idempotent && !nothingThere(err) {
			return nil, c.gaveUp(time.Since(started), err, nil)
		}
		if until.IsZero() {
			until = time.Now().Add(r.within)
		}
		pause := pauseFor(attempt, got)
		limit := until
		if got == nil && nothingThere(err) && refusedUntil.Before(limit) {
			limit = refusedUntil
		}
		if time.Now().Add(pause).After(limit) {
			// A 429 that lasts is its own refusal; the others leave the outcome unknown.
			if got != nil && !unknownOutcome[got.status] {
				return nil, c.errorFor(got, r.holding)
			}
			return nil, c.gaveUp(time.Since(started), err, got)
		}
		if err := sleep(ctx, pause); err != nil {
			return nil, err
		}
	}
}

// attemptTimeout is an attempt that got no answer in time.
type attemptTimeout struct{ after time.Duration }

func (e *attemptTimeout) Error() string {
	return fmt.Sprintf("no answer within %.1f s", e.after.Seconds())
}
func (e *attemptTimeout) Timeout() bool   { return true }
func (e *attemptTimeout) Temporary() bool { return true }

func (c *Client) attempt(ctx context.Context, r call, target string) (*answer, error) {
	var payload io.Reader
	var extra time.Duration
	if r.body != nil {
		var body any
		body, extra = r.body()
		if body != nil {
			encoded, err := json.Marshal(body)
			if err != nil {
				return nil, fmt.Errorf("helixlocks: a request body that is not JSON: %w", err)
			}
			payload = bytes.NewReader(encoded)
		}
	}
	limit := c.timeout + extra
	attemptCtx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	request, err := http.NewRequestWithContext(attemptCtx, r.method, target, payload)
	if err != nil {
		return nil, err
	}
	c.headers(request, "application/json")
	if payload != nil {
		request.Header.Set("Content-Type", "application/json")
	}
	for name, value := range r.header {
		request.Header.Set(name, value)
	}
	response, err := c.http.Do(request)
	if err == nil {
		defer response.Body.Close()
		var got *answer
		if got, err = read(response); err == nil {
			return got, nil
		}
	}
	if attemptCtx.Err() == context.DeadlineExceeded && ctx.Err() == nil {
		return nil, &attemptTimeout{limit}
	}
	return nil, err
}

func (c *Client) headers(request *http.Request, accept string) {
	request.Header.Set("Accept", accept)
	request.Header.Set("User-Agent", "helix-locks-go")
	if c.apiKey != "" {
		request.Header.Set("Authorization", "Bearer "+c.apiKey)
	}
}

// read reads an answer's body: JSON when it says so, a problem for an error status.
func read(response *http.Response) (*answer, error) {
	body, err := io.ReadAll(io.LimitReader(response.Body, maxAnswerBytes+1))
	if err != nil {
		return nil, err
	}
	if len(body) > maxAnswerBytes {
		return nil, &APIError{Status: response.StatusCode, Problem: &Problem{
			Detail: fmt.Sprintf("an answer larger than %d bytes", maxAnswerBytes),
		}}
	}
	got := &answer{
		status: response.StatusCode,
		header: response.Header,
		body:   body,
		json:   strings.Contains(response.Header.Get("Content-Type"), "json"),
	}
	if got.status < 200 || got.status >= 300 {
		got.problem = parseProblem(body, got.json)
	}
	return got, nil
}

// errorFor is an answer as an error, or nil for a success; holding: the request acts on a lock
// this client holds (renew, update, release).
func (c *Client) errorFor(got *answer, holding bool) error {
	if got.status >= 200 && got.status < 300 {
		// Every success but a release's 204 is a JSON object: anything else is not the service.
		if got.status == http.StatusNoContent || isObject(got) {
			return nil
		}
		return &APIError{Status: got.status, Problem: &Problem{
			Detail: fmt.Sprintf("a %d answer that is not a JSON object", got.status),
		}}
	}
	api := apiError(got)
	switch {
	case got.status == http.StatusConflict && api.Kind() == "max-holders-mismatch":
		n, _ := api.Problem.Int("max_holders")
		return &MaxHoldersMismatchError{APIError: *api, MaxHolders: int(n)}
	case got.status == http.StatusConflict:
		wait, ok := retryAfter(got.header.Get("Retry-After"))
		if !ok {
			wait = time.Second
		}
		held := newLockHeld(*api, wait)
		switch api.Kind() {
		case "closed-until":
			closed := &ClosedUntilError{LockHeldError: *held}
			closed.ClosedUntil, _ = time.Parse(time.RFC3339Nano, got.problem.String("closed_until"))
			return closed
		case "reserved":
			reserved := &ReservedError{LockHeldError: *held, PreferredHolder: got.problem.String("preferred_holder")}
			reserved.Deadline, _ = time.Parse(time.RFC3339Nano, got.problem.String("deadline"))
			return reserved
		}
		return held
	case got.status == http.StatusGone || (holding && lockGone[got.status]):
		lost := &LockLostError{
			Reason:    strings.TrimSpace(fmt.Sprintf("%d: %s", got.status, got.problem.said())),
			Status:    got.status,
			Problem:   got.problem,
			RequestID: api.RequestID,
		}
		if got.status == http.StatusGone && api.Kind() == "hold-limit-reached" {
			lost.holdLimit = true
			lost.holdLimitAt, _ = time.Parse(time.RFC3339Nano, got.problem.String("hold_limit_at"))
		}
		return lost
	case got.status == http.StatusForbidden && api.Kind() == "token-mismatch":
		return &TokenMismatchError{*api}
	}
	return api
}

// apiError is the answer as an APIError, whatever its status.
func apiError(got *answer) *APIError {
	api := &APIError{Status: got.status, Problem: got.problem, RequestID: got.header.Get("X-Request-Id")}
	if api.Problem == nil {
		api.Problem = &Problem{Fields: map[string]any{}}
	}
	if wait, ok := retryAfter(got.header.Get("Retry-After")); ok {
		api.RetryAfter = &wait
	}
	return api
}

func isObject(got *answer) bool {
	if !got.json {
		return false
	}
	var object map[string]json.RawMessage
	return json.Unmarshal(got.body, &object) == nil && object != nil
}

// decode reads a success's JSON object into v.
func decode(got *answer, v any) error {
	if err := json.Unmarshal(got.body, v); err != nil {
		return &APIError{Status: got.status, Problem: &Problem{
			Detail: fmt.Sprintf("an answer this client cannot read: %v", err),
		}}
	}
	return nil
}

func pauseFor(attempt int, got *answer) time.Duration {
	pause := backoff(attempt)
	if got != nil {
		if wait, ok := retryAfter(got.header.Get("Retry-After")); ok {
			return wait
		}
	}
	return pause
}

// sleep pauses for d, or until ctx is done (its error).
func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-timer.C:
		return nil
	}
}

// transient says whether a request's failure is network trouble worth retrying: a refused or cut
// connection, an answer that is not HTTP, or no answer in time. Anything else (a header the
// request cannot carry, an answer too large) is a mistake that no retry mends.
func transient(err error) bool {
	if err == nil {
		return false
	}
	var timeout *attemptTimeout
	if errors.As(err, &timeout) || errors.Is(err, errSilence) {
		return true
	}
	var wrapped *url.Error
	if errors.As(err, &wrapped) {
		err = wrapped.Err // a url.Error is a net.Error whatever it wraps: look inside
	}
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return true
	}
	var network net.Error
	var errno syscall.Errno
	if errors.As(err, &network) || errors.As(err, &errno) {
		return true
	}
	said := err.Error()
	for _, words := range []string{"server closed idle connection", "connection reset", "broken pipe",
		"malformed HTTP", "transport connection broken", "unexpected EOF"} {
		if strings.Contains(said, words) {
			return true
		}
	}
	return false
}

// refused says whether a connection was refused: nothing listens at the address.
func refused(err error) bool { return errors.Is(err, syscall.ECONNREFUSED) }

// nothingThere says whether the address has no service: the connection was refused, or the host's
// name does not resolve (not a slow answer, which retrying may cure).
func nothingThere(err error) bool {
	var dns *net.DNSError
	return refused(err) || (errors.As(err, &dns) && dns.IsNotFound)
}

func (c *Client) gaveUp(took time.Duration, err error, got *answer) *UnavailableError {
	var dns *net.DNSError
	switch {
	case refused(err):
		return &UnavailableError{Message: fmt.Sprintf("%s refused the connection: is the service running there?", c.baseURL), Err: err}
	case errors.As(err, &dns) && dns.IsNotFound:
		return &UnavailableError{Message: fmt.Sprintf("%s: the host name %q does not resolve", c.baseURL, dns.Name), Err: err}
	case got != nil:
		message := fmt.Sprintf("%s answered %d for %.1f s", c.baseURL, got.status, took.Seconds())
		if said := got.problem.said(); said != "" {
			message += ": " + said
		}
		return &UnavailableError{Message: message, Status: got.status, Problem: got.problem}
	}
	message := fmt.Sprintf("no answer from %s within %.1f s", c.baseURL, took.Seconds())
	if err != nil {
		message += ": " + err.Error()
	}
	return &UnavailableError{Message: message, Err: err}
}
