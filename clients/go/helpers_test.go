package helixlocks

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"
)

// contract is clients/contract.json, which the Python SDK's and the Node client's tests read too.
type contract struct {
	Requests struct {
		RetryStatuses          []int `json:"retry_statuses"`
		UnknownOutcomeStatuses []int `json:"unknown_outcome_statuses"`
		LockGoneStatuses       []int `json:"lock_gone_statuses"`
		Backoff                struct {
			InitialS   float64 `json:"initial_s"`
			MaxS       float64 `json:"max_s"`
			Multiplier float64 `json:"multiplier"`
			Jitter     float64 `json:"jitter"`
		} `json:"backoff"`
		HonoursRetryAfter bool `json:"honours_retry_after"`
		WaitingAcquire    struct {
			Pause            string `json:"pause"`
			AtMostRetryAfter bool   `json:"at_most_retry_after"`
			AtMostWaitLeft   bool   `json:"at_most_wait_left"`
		} `json:"waiting_acquire"`
		RetryAfter struct {
			Cases []struct {
				Header  string   `json:"header"`
				Seconds *float64 `json:"seconds"`
			} `json:"cases"`
		} `json:"retry_after"`
		RefusedWithinS float64 `json:"refused_within_s"`
	} `json:"requests"`
	Events struct {
		RetryStatuses         []int   `json:"retry_statuses"`
		SilenceS              float64 `json:"silence_s"`
		SendsEmptyLastEventID bool    `json:"sends_empty_last_event_id"`
	} `json:"events"`
	SSE []sseCase `json:"sse"`
}

type sseCase struct {
	Name        string     `json:"name"`
	Chunks      []string   `json:"chunks"`
	Events      []sseEvent `json:"events"`
	Retry       *int64     `json:"retry"`
	LastEventID *string    `json:"last_event_id"`
}

type sseEvent struct {
	ID    *string `json:"id"`
	Event string  `json:"event"`
	Data  string  `json:"data"`
	Retry *int64  `json:"retry"`
}

var (
	contractOnce sync.Once
	loaded       contract
)

// theContract reads clients/contract.json from this module's folder, clients/go.
func theContract(t *testing.T) *contract {
	t.Helper()
	var err error
	contractOnce.Do(func() {
		var data []byte
		data, err = os.ReadFile(filepath.Join("..", "contract.json"))
		if err == nil {
			err = json.Unmarshal(data, &loaded)
		}
	})
	if err != nil {
		t.Fatalf("clients/contract.json: %v", err)
	}
	if len(loaded.Requests.RetryStatuses) == 0 || len(loaded.SSE) == 0 {
		t.Fatal("clients/contract.json was not read")
	}
	return &loaded
}

// scriptedAnswer is one answer of a scripted server: a problem's fields as body (with status
// added), or text sent as it is.
type scriptedAnswer struct {
	status int
	header map[string]string
	body   map[string]any
	text   *string
	delay  time.Duration
}

type seenRequest struct {
	method string
	path   string
	header http.Header
	body   []byte
	at     time.Time
}

// scripted is an HTTP server that answers each request with the next of its answers, and with
// then once they have run out; seen records every request.
type scripted struct {
	t       *testing.T
	mu      sync.Mutex
	answers []scriptedAnswer
	then    scriptedAnswer
	seen    []seenRequest
	server  *httptest.Server
	client  *Client
}

func newScripted(t *testing.T, answers []scriptedAnswer, then *scriptedAnswer) *scripted {
	t.Helper()
	s := &scripted{t: t, answers: answers, then: scriptedAnswer{status: 200, body: map[string]any{"id": 1, "ok": true}}}
	if then != nil {
		s.then = *then
	}
	s.server = httptest.NewServer(http.HandlerFunc(s.serve))
	t.Cleanup(func() {
		s.server.CloseClientConnections()
		s.server.Close()
	})
	client, err := New(Options{URL: s.server.URL, APIKey: "hlk_test"})
	if err != nil {
		t.Fatal(err)
	}
	s.client = client
	return s
}

func (s *scripted) serve(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	s.mu.Lock()
	s.seen = append(s.seen, seenRequest{method: r.Method, path: r.URL.RequestURI(), header: r.Header.Clone(), body: body, at: time.Now()})
	answer := s.then
	if len(s.answers) > 0 {
		answer, s.answers = s.answers[0], s.answers[1:]
	}
	s.mu.Unlock()
	if answer.delay > 0 {
		select {
		case <-time.After(answer.delay):
		case <-r.Context().Done():
			return
		}
	}
	var sent []byte
	if answer.text != nil {
		sent = []byte(*answer.text)
	} else {
		fields := map[string]any{"status": answer.status}
		for name, value := range answer.body {
			fields[name] = value
		}
		sent, _ = json.Marshal(fields)
	}
	w.Header().Set("Content-Type", "application/problem+json")
	w.Header().Set("Content-Length", strconv.Itoa(len(sent)))
	for name, value := range answer.header {
		w.Header()[http.CanonicalHeaderKey(name)] = []string{value}
	}
	w.WriteHeader(answer.status)
	_, _ = w.Write(sent)
}

func (s *scripted) requests() []seenRequest {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]seenRequest(nil), s.seen...)
}

func (s *scripted) push(answers ...scriptedAnswer) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.answers = append(s.answers, answers...)
}

// gaps are the seconds between one request and the next.
func (s *scripted) gaps() []float64 {
	seen := s.requests()
	var gaps []float64
	for i := 1; i < len(seen); i++ {
		gaps = append(gaps, seen[i].at.Sub(seen[i-1].at).Seconds())
	}
	return gaps
}

func text(s string) *string { return &s }

// lockBody is a lock object as the service sends one.
func lockBody(id int64, ttlMs int64, extra map[string]any) map[string]any {
	now := time.Now().UTC()
	body := map[string]any{
		"id": id, "organization_id": "acme", "job_type": "report", "holder": "w", "fencing_token": id + 2,
		"acquired_at": now.Format(time.RFC3339Nano), "expires_at": now.Add(time.Duration(ttlMs) * time.Millisecond).Format(time.RFC3339Nano),
		"released_at": nil, "release_reason": nil, "state": "held", "ttl_remaining_ms": ttlMs, "metadata": nil,
		"max_holders": 1, "slot": 0, "mode": "exclusive", "forced_by": nil, "session_id": nil,
	}
	for name, value := range extra {
		body[name] = value
	}
	return body
}

func mustJSON(v any) []byte {
	data, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return data
}
