package helixlocks

// What the tests against a real service share: the service (named by environment variables, as
// tests/system/test_go_client.py starts it), and proxies in front of it that lose an answer,
// answer 503, change what passes, record it, cut connections or stop forwarding.

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"
)

const org = "acme"

// testService is the service under test.
type testService struct {
	url      string
	apiKey   string // acme's
	adminKey string
}

func theService(t *testing.T) testService {
	t.Helper()
	url := os.Getenv("HELIX_LOCKS_TEST_URL")
	if url == "" {
		t.Skip("HELIX_LOCKS_TEST_URL is not set: run these tests with `pytest tests/system/test_go_client.py`," +
			" which starts helix-locks serve, or see clients/go/README.md")
	}
	return testService{url: url, apiKey: os.Getenv("HELIX_LOCKS_TEST_API_KEY"), adminKey: os.Getenv("HELIX_LOCKS_TEST_ADMIN_KEY")}
}

// client is a client of the service, or of a proxy in front of it.
func (s testService) client(t *testing.T, url string) *Client {
	t.Helper()
	if url == "" {
		url = s.url
	}
	client, err := New(Options{URL: url, APIKey: s.apiKey})
	if err != nil {
		t.Fatal(err)
	}
	return client
}

// admin calls the service as an admin, without the client: force, a look at a lock.
func (s testService) admin(t *testing.T, method, path string) (int, map[string]any) {
	t.Helper()
	if s.adminKey == "" {
		t.Fatal("HELIX_LOCKS_TEST_ADMIN_KEY: an admin key is needed")
	}
	request, _ := http.NewRequest(method, s.url+path, nil)
	request.Header.Set("Authorization", "Bearer "+s.adminKey)
	response, err := (&http.Client{Timeout: 10 * time.Second}).Do(request)
	if err != nil {
		t.Fatal(err)
	}
	defer response.Body.Close()
	var body map[string]any
	data, _ := io.ReadAll(response.Body)
	if len(data) > 0 {
		if err := json.Unmarshal(data, &body); err != nil {
			t.Fatalf("%s %s: %s", method, path, data)
		}
	}
	return response.StatusCode, body
}

// jobType is a job type of its own for each test, so that tests never meet on a key.
func jobType(name string) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return name + "-" + hex.EncodeToString(b[:])
}

// eventually waits for cond, polling, or fails the test after timeout.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// fault is what a faultyProxy plays on the first request that matches it: drop (forward it, then
// close the connection without answering: it took effect, its answer was lost), or status (forward
// it, then answer that status with Retry-After in place of the service's answer).
type fault struct {
	method     string
	path       string // a prefix
	drop       bool
	status     int
	retryAfter string
}

// relayed is a request that passed the proxy: what its client was told ("dropped", or a status)
// and the service's own answer.
type relayed struct {
	method   string
	path     string
	header   http.Header
	at       time.Time
	told     string
	answered int
	body     []byte
}

// faultyProxy is an HTTP proxy in front of the service that forwards every request and relays
// its answer, but plays its faults, and changes requests as mangle says while it is set.
type faultyProxy struct {
	target string
	server *httptest.Server
	mu     sync.Mutex
	faults []fault
	seen   []*relayed
	mangle func(*http.Request)
}

func newFaultyProxy(t *testing.T, target string, faults ...fault) *faultyProxy {
	p := &faultyProxy{target: target, faults: faults}
	p.server = httptest.NewServer(http.HandlerFunc(p.forward))
	t.Cleanup(func() {
		p.server.CloseClientConnections()
		p.server.Close()
	})
	return p
}

func (p *faultyProxy) setMangle(mangle func(*http.Request)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.mangle = mangle
}

func (p *faultyProxy) requests(method, suffix string) []relayed {
	p.mu.Lock()
	defer p.mu.Unlock()
	var found []relayed
	for _, r := range p.seen {
		if (method == "" || r.method == method) && strings.HasSuffix(strings.SplitN(r.path, "?", 2)[0], suffix) {
			found = append(found, *r)
		}
	}
	return found
}

func (p *faultyProxy) forward(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	record := &relayed{method: r.Method, path: r.URL.RequestURI(), header: r.Header.Clone(), at: time.Now()}
	p.mu.Lock()
	p.seen = append(p.seen, record)
	var matched *fault
	for i, f := range p.faults {
		if f.method == r.Method && strings.HasPrefix(r.URL.Path, f.path) {
			matched = &f
			p.faults = append(p.faults[:i:i], p.faults[i+1:]...)
			break
		}
	}
	mangle := p.mangle
	p.mu.Unlock()
	out, _ := http.NewRequest(r.Method, p.target+r.URL.RequestURI(), bytes.NewReader(body))
	out.Header = r.Header.Clone()
	if mangle != nil {
		mangle(out)
	}
	status, header, answer := 502, http.Header{}, []byte(`{"detail": "the proxy got no answer"}`)
	if response, err := http.DefaultTransport.RoundTrip(out); err == nil {
		answer, _ = io.ReadAll(response.Body)
		response.Body.Close()
		status, header = response.StatusCode, response.Header
	}
	p.mu.Lock()
	record.answered, record.body = status, answer
	p.mu.Unlock()
	tell := func(told string) {
		p.mu.Lock()
		record.told = told
		p.mu.Unlock()
	}
	switch {
	case matched != nil && matched.drop:
		tell("dropped")
		if conn, _, err := w.(http.Hijacker).Hijack(); err == nil {
			conn.Close()
		}
	case matched != nil:
		tell(http.StatusText(matched.status))
		w.Header().Set("Content-Type", "application/problem+json")
		w.Header().Set("Retry-After", matched.retryAfter)
		w.WriteHeader(matched.status)
		_, _ = w.Write([]byte(`{"type": "urn:helix-locks:problem:database-unavailable", "status": 503}`))
	default:
		tell(http.StatusText(status))
		for _, name := range []string{"Content-Type", "Retry-After", "Location", "X-Request-Id"} {
			if value := header.Get(name); value != "" {
				w.Header().Set(name, value)
			}
		}
		w.WriteHeader(status)
		_, _ = w.Write(answer)
	}
}

// tcpProxy is a TCP proxy in front of the service that a test can cut (every open connection
// dropped), shut (new connections closed at once) or stall (nothing forwarded any more, either
// way, on open connections and new ones: the service stops answering, as behind a dead link).
type tcpProxy struct {
	target   string
	listener net.Listener
	url      string
	mu       sync.Mutex
	open     map[net.Conn]bool
	opened   int
	shut     bool
	stalled  bool
}

func newTCPProxy(t *testing.T, target string) *tcpProxy {
	t.Helper()
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &tcpProxy{target: strings.TrimPrefix(target, "http://"), listener: listener, open: map[net.Conn]bool{}}
	p.url = "http://" + listener.Addr().String()
	go p.accept()
	t.Cleanup(func() {
		listener.Close()
		p.cut()
	})
	return p
}

func (p *tcpProxy) accept() {
	for {
		conn, err := p.listener.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		if p.shut {
			p.mu.Unlock()
			conn.Close()
			continue
		}
		p.opened++
		p.open[conn] = true
		p.mu.Unlock()
		go p.serve(conn)
	}
}

func (p *tcpProxy) serve(conn net.Conn) {
	upstream, err := net.Dial("tcp", p.target)
	if err != nil {
		p.drop(conn)
		return
	}
	p.mu.Lock()
	p.open[upstream] = true
	p.mu.Unlock()
	go p.pipe(conn, upstream)
	p.pipe(upstream, conn)
}

// pipe copies from one end to the other, dropping what it reads while stalled.
func (p *tcpProxy) pipe(from, to net.Conn) {
	defer p.drop(from)
	defer p.drop(to)
	buffer := make([]byte, 32<<10)
	for {
		n, err := from.Read(buffer)
		if n > 0 && !p.isStalled() {
			if _, err := to.Write(buffer[:n]); err != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *tcpProxy) isStalled() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stalled
}

func (p *tcpProxy) drop(conn net.Conn) {
	conn.Close()
	p.mu.Lock()
	delete(p.open, conn)
	p.mu.Unlock()
}

func (p *tcpProxy) cut() {
	p.mu.Lock()
	conns := make([]net.Conn, 0, len(p.open))
	for conn := range p.open {
		conns = append(conns, conn)
	}
	p.mu.Unlock()
	for _, conn := range conns {
		p.drop(conn)
	}
}

func (p *tcpProxy) set(shut, stalled bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.shut, p.stalled = shut, stalled
}

func (p *tcpProxy) connections() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.opened
}

// background is a context for a test's calls, bounded so that a hang fails instead of stalling.
func background(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}
