// A Helix Locks worker in Go, on the helix-locks Go client (clients/go), standard library only.
// Each iteration takes the lock for one organization and job type (waiting while it is held),
// works while the client renews it, hands the fencing token to what it writes, and releases it.
// To run it from the repository's top folder (go.mod points at ../../clients/go):
//
//	(cd examples/go-worker && go build -o go-worker .) && examples/go-worker/go-worker [OUTPUT_FILE]
//
// In a module of your own, require github.com/helix-locks/helix-locks/clients/go with a replace
// directive to a clone's clients/go, as this one's go.mod does.
//
//	HELIX_LOCKS_URL (default http://127.0.0.1:8080), HELIX_LOCKS_API_KEY (sent as a Bearer token)
//	WORKER_ORG, WORKER_JOB_TYPE  the lock's key (default acme, nightly-report)
//	WORKER_TTL           lease in seconds, renewed every TTL/3 (default 30)
//	WORKER_ITERATIONS    how many times to take the lock and work (default 1)
//	WORKER_WORK_SECONDS  how long one piece of work takes (default 1)
//	WORKER_WAIT_SECONDS  how long to wait for a held lock before giving up (default 60)
//	WORKER_MAX_HOLDERS   a semaphore: up to this many workers hold the key at once, each in a slot
//	                     of its own (default 1: one at a time); all of them must give the same value
//	WORKER_HOLDER        holder name (default the client's, user@host:pid)
//	OUTPUT_FILE or WORKER_OUTPUT  gets a line "fencing_token holder lock_id acquired_at slot" per
//	                     piece of work, as a storage layer would (default worker-output.txt)
//
// A request that the holder let go (POST /v1/locks/{id}/revocation) is learnt from a renewal: the
// worker finishes the piece of work under way, releases the lock and takes it no more (exit 0).
//
// Exit status, as `helix-locks run`'s: 0 done; 75 the lock stayed held past WORKER_WAIT_SECONDS;
// 69 the service could not be reached; 76 the lock was lost (a refused renewal, or renewals failing
// until the lease was nearly over): the work was stopped at once and the lock not released; 1
// unexpected; 2 bad configuration (max-holders-mismatch included). SIGTERM/Ctrl-C stop the work
// and release the lock (exit 143, 130).
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"

	helixlocks "github.com/helix-locks/helix-locks/clients/go"
)

// stamp is a database time as the service sent it: RFC 3339 with microseconds.
const stamp = "2006-01-02T15:04:05.000000Z07:00"

func setting(name, fallback string) string {
	if value, ok := os.LookupEnv(name); ok {
		return value
	}
	return fallback
}

// seconds reads a setting given in seconds.
func seconds(name, fallback string) (time.Duration, error) {
	value, err := strconv.ParseFloat(setting(name, fallback), 64)
	if err != nil || value < 0 {
		return 0, fmt.Errorf("%s must be a number of seconds: %q", name, setting(name, fallback))
	}
	return time.Duration(value * float64(time.Second)), nil
}

func main() {
	holder := setting("WORKER_HOLDER", "")
	name := holder
	if name == "" {
		name = "go-worker"
	}
	status, err := work(holder)
	if status == 130 || status == 143 {
		fmt.Fprintf(os.Stderr, "%s: stopped by a signal; the lock was released\n", name)
	} else if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %s: %v\n", name, kind(err), err)
	} else {
		fmt.Fprintf(os.Stderr, "%s: done\n", name)
	}
	os.Exit(status)
}

// work runs the iterations; its exit status, and the error that ended it.
func work(holder string) (int, error) {
	options := helixlocks.AcquireOptions{
		OrganizationID: setting("WORKER_ORG", "acme"),
		JobType:        setting("WORKER_JOB_TYPE", "nightly-report"),
		Holder:         holder,
	}
	var err error
	if options.TTL, err = seconds("WORKER_TTL", "30"); err != nil {
		return 2, err
	}
	if options.Wait, err = seconds("WORKER_WAIT_SECONDS", "60"); err != nil {
		return 2, err
	}
	pieceOfWork, err := seconds("WORKER_WORK_SECONDS", "1")
	if err != nil {
		return 2, err
	}
	iterations, err := strconv.Atoi(setting("WORKER_ITERATIONS", "1"))
	if err != nil {
		return 2, fmt.Errorf("WORKER_ITERATIONS must be a whole number: %w", err)
	}
	if options.MaxHolders, err = strconv.Atoi(setting("WORKER_MAX_HOLDERS", "1")); err != nil {
		return 2, fmt.Errorf("WORKER_MAX_HOLDERS must be a whole number: %w", err)
	}
	output := setting("WORKER_OUTPUT", "worker-output.txt")
	if len(os.Args) > 1 {
		output = os.Args[1]
	}

	// SIGTERM/Ctrl-C: stop the work; WithLock releases the lock.
	ctx, interrupt := context.WithCancel(context.Background())
	defer interrupt()
	var interrupted int32
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		got := <-signals
		atomic.StoreInt32(&interrupted, map[os.Signal]int32{syscall.SIGINT: 130, syscall.SIGTERM: 143}[got])
		interrupt()
	}()

	client, err := helixlocks.New(helixlocks.Options{}) // HELIX_LOCKS_URL, HELIX_LOCKS_API_KEY
	if err != nil {
		return 2, err
	}
	var revoked *helixlocks.Revocation
	for i := 1; i <= iterations && ctx.Err() == nil; i++ {
		err = client.WithLock(ctx, options, func(ctx context.Context, lease *helixlocks.Lease) error {
			// The work. Real work passes ctx on to what it waits on (HTTP requests, commands): it is
			// cancelled the moment the lock may be lost, and on SIGTERM.
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(pieceOfWork):
			}
			if err := lease.Check(); err != nil {
				return err
			}
			// What the work writes carries the fencing token, so storage can refuse a stale holder;
			// and the slot, by which storage keys its fence when several hold the key at once.
			lock := lease.Lock()
			line := fmt.Sprintf("%d %s %d %s %d\n", lock.FencingToken, lock.Holder, lock.ID, lock.AcquiredAt.Format(stamp), lock.Slot)
			// A request to let go cancels nothing: the piece of work is done, and no other starts.
			revoked = lease.Revocation()
			return appendLine(output, line)
		})
		if err != nil || revoked != nil {
			break
		}
	}
	if revoked != nil {
		fmt.Fprintf(os.Stderr, "asked to let go (%s): stopped after this piece of work\n", revoked.Reason)
	}
	if status := atomic.LoadInt32(&interrupted); status != 0 {
		return int(status), err
	}
	return statusOf(err), err
}

func appendLine(path, line string) error {
	out, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	if _, err := out.WriteString(line); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// statusOf is the exit status for how the work ended, as `helix-locks run` has them.
func statusOf(err error) int {
	var lost *helixlocks.LockLostError
	var held *helixlocks.LockHeldError
	var unavailable *helixlocks.UnavailableError
	var mismatch *helixlocks.MaxHoldersMismatchError
	var api *helixlocks.APIError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &lost): // first: its cause may be any error of the work's
		return 76
	case errors.As(err, &held):
		return 75
	case errors.As(err, &unavailable):
		return 69
	case errors.As(err, &mismatch), errors.As(err, &api) && api.Status == 422:
		return 2
	}
	return 1
}

func kind(err error) string {
	var lost *helixlocks.LockLostError
	var held *helixlocks.LockHeldError
	var unavailable *helixlocks.UnavailableError
	var mismatch *helixlocks.MaxHoldersMismatchError
	var api *helixlocks.APIError
	switch {
	case errors.As(err, &lost):
		return "LockLostError"
	case errors.As(err, &held):
		return "LockHeldError"
	case errors.As(err, &unavailable):
		return "UnavailableError"
	case errors.As(err, &mismatch):
		return "MaxHoldersMismatchError"
	case errors.As(err, &api):
		return "APIError"
	}
	return "error"
}
