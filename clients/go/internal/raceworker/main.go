// Command raceworker is one racer of tests/system/test_go_client.py's race: for SECONDS it takes
// one key's lock with WithLock (ttl 1.5 s, so that each piece of work is renewed once), works
// 0.6 s, and records what it was told as JSON lines in OUTPUT, for the project's history checker,
// as clients/node/test/race-worker.mjs does.
//
// Usage: raceworker NAME SECONDS OUTPUT ORGANIZATION JOB_TYPE
// (HELIX_LOCKS_URL, HELIX_LOCKS_API_KEY: the service)
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"

	helixlocks "github.com/helix-locks/helix-locks/clients/go"
)

// stamp is a database time as the service sent it: RFC 3339 with microseconds.
const stamp = "2006-01-02T15:04:05.000000Z07:00"

func main() {
	if len(os.Args) != 6 {
		fmt.Fprintln(os.Stderr, "usage: raceworker NAME SECONDS OUTPUT ORGANIZATION JOB_TYPE")
		os.Exit(2)
	}
	name, output, organization, jobType := os.Args[1], os.Args[3], os.Args[4], os.Args[5]
	seconds, err := strconv.ParseFloat(os.Args[2], 64)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	out, err := os.OpenFile(output, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer out.Close()
	record := func(line map[string]any) {
		line["worker"] = name
		data, _ := json.Marshal(line)
		if _, err := out.Write(append(data, '\n')); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
	wall := func() float64 { return float64(time.Now().UnixNano()) / 1e9 }
	client, err := helixlocks.New(helixlocks.Options{}) // HELIX_LOCKS_URL, HELIX_LOCKS_API_KEY
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	ttl := 1500 * time.Millisecond
	deadline := time.Now().Add(time.Duration(seconds * float64(time.Second)))
	for time.Now().Before(deadline) {
		var held *helixlocks.Lease
		options := helixlocks.AcquireOptions{OrganizationID: organization, JobType: jobType, TTL: ttl, Wait: 10 * time.Second, Holder: name}
		err := client.WithLock(context.Background(), options, func(ctx context.Context, lease *helixlocks.Lease) error {
			held = lease
			lock := lease.Grant().Lock
			record(map[string]any{"kind": "told", "lock_id": lock.ID, "fencing_token": lock.FencingToken,
				"acquired_at": lock.AcquiredAt.Format(stamp), "slot": lock.Slot})
			start := wall()
			select {
			case <-ctx.Done():
			case <-time.After(600 * time.Millisecond):
			}
			if err := lease.Check(); err != nil {
				return err
			}
			record(map[string]any{"kind": "work", "lock_id": lock.ID, "start": start, "end": wall()})
			return nil
		})
		var busy *helixlocks.LockHeldError
		var lost *helixlocks.LockLostError
		switch {
		case err == nil:
			if latest := held.Lock(); !latest.ExpiresAt.Equal(held.Grant().ExpiresAt) {
				record(map[string]any{"kind": "renewed", "lock_id": held.ID(), "expires_at": latest.ExpiresAt.Format(stamp),
					"ttl": ttl.Seconds()})
			}
			record(map[string]any{"kind": "release_attempt", "lock_id": held.ID()})
		case errors.As(err, &busy):
			record(map[string]any{"kind": "held"})
		case errors.As(err, &lost):
			var id any
			if held != nil {
				id = held.ID()
			}
			record(map[string]any{"kind": "lost", "lock_id": id, "message": err.Error()})
		default:
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
}
