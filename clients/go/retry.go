package helixlocks

// When a request is sent again, and after how long: clients/contract.json's policy, which the
// Python SDK and the Node client follow too (docs/workers.md says why). No I/O here.

import (
	"math"
	"regexp"
	"strconv"
	"time"
)

var (
	// retried: the service did nothing (429), or a proxy or a restarting replica answered (502,
	// 503, 504); sent again, after Retry-After when given, within the request's time limit.
	retried = statusSet(429, 502, 503, 504)
	// unknownOutcome: of those, the ones that may come after the service acted; sent again only
	// when the request is idempotent (every request this client sends is), and once the time
	// limit is reached, UnavailableError. A 429 that lasts is its own APIError.
	unknownOutcome = statusSet(502, 503, 504)
	// lockGone: a held lock's renewal, update or release answered so has lost it; 410 any request.
	lockGone = statusSet(403, 404, 410)
	// watchRetried: a watch opens its stream again after these; any other refusal ends it.
	watchRetried = statusSet(429, 502, 503, 504)
)

const (
	firstBackoff      = 50 * time.Millisecond
	maxBackoff        = 2 * time.Second
	backoffMultiplier = 2
	// refusedWithin is how long an acquire (or a watch not yet heard) retries a refused
	// connection: a restarting service takes longer, but a worker pointed at the wrong address
	// should hear so at once.
	refusedWithin = time.Second
)

func statusSet(statuses ...int) map[int]bool {
	set := make(map[int]bool, len(statuses))
	for _, status := range statuses {
		set[status] = true
	}
	return set
}

// backoff is the pause before retry attempt (from 0) when the answer gave no Retry-After:
// 50 ms, doubling, at most 2 s; no jitter.
func backoff(attempt int) time.Duration {
	pause := firstBackoff
	for i := 0; i < attempt && pause < maxBackoff; i++ {
		pause *= backoffMultiplier
	}
	if pause > maxBackoff {
		return maxBackoff
	}
	return pause
}

var delaySeconds = regexp.MustCompile(`^[ \t]*([0-9]+(?:\.[0-9]+)?)[ \t]*$`)

// retryAfter reads a Retry-After header: decimal seconds (digits, an optional fraction); anything
// else (an HTTP date, a sign, hex, an exponent, infinity) is not read, as in the other clients.
func retryAfter(value string) (time.Duration, bool) {
	found := delaySeconds.FindStringSubmatch(value)
	if found == nil {
		return 0, false
	}
	seconds, err := strconv.ParseFloat(found[1], 64)
	if err != nil {
		return 0, false
	}
	if seconds*float64(time.Second) >= math.MaxInt64 {
		return time.Duration(math.MaxInt64), true
	}
	return time.Duration(math.Round(seconds * float64(time.Second))), true
}
