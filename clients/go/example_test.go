package helixlocks_test

// The samples of clients/go/README.md and docs/workers.md, compiled: each sample is the body of an
// example here, as TestTheDocumentsGoSamplesAreCompiledHere checks. Examples without an Output
// comment are compiled by go test and go vet, not run.

import (
	"context"
	"errors"
	"log"
	"time"

	helixlocks "github.com/helix-locks/helix-locks/clients/go"
)

// What the samples stand in for: the job's own work.
func daysToReport() []string                                          { return nil }
func fetchRows(ctx context.Context, days ...string) ([]string, error) { return nil, ctx.Err() }
func store(ctx context.Context, rows []string, fence ...any) error    { return ctx.Err() }
func sendReport(ctx context.Context, fence int64) error               { return ctx.Err() }
func runStep(ctx context.Context, step string, fence int64) error     { return ctx.Err() }

func Example_worker() {
	ctx := context.Background()
	client, err := helixlocks.New(helixlocks.Options{}) // HELIX_LOCKS_URL, HELIX_LOCKS_API_KEY
	if err != nil {
		log.Fatal(err)
	}
	opts := helixlocks.AcquireOptions{OrganizationID: "acme", JobType: "nightly-report",
		TTL: 30 * time.Second, Wait: time.Minute}
	err = client.WithLock(ctx, opts, func(ctx context.Context, lease *helixlocks.Lease) error {
		for _, day := range daysToReport() {
			// ctx is cancelled the moment the lock may be lost: the work stops there.
			rows, err := fetchRows(ctx, day)
			if err != nil {
				return err
			}
			if err := store(ctx, rows, lease.FencingToken()); err != nil {
				return err
			}
		}
		return nil
	})
	var held *helixlocks.LockHeldError
	if errors.As(err, &held) {
		log.Printf("still held by %s after a minute", held.Holder)
	} else if err != nil {
		log.Fatal(err) // a *LockLostError: the lock was lost meanwhile
	}
}

func Example_workersPage() {
	ctx := context.Background()
	client, err := helixlocks.New(helixlocks.Options{}) // HELIX_LOCKS_URL, HELIX_LOCKS_API_KEY
	if err != nil {
		log.Fatal(err)
	}
	opts := helixlocks.AcquireOptions{OrganizationID: "acme", JobType: "nightly-report", TTL: 30 * time.Second, Wait: time.Minute}
	err = client.WithLock(ctx, opts, func(ctx context.Context, lease *helixlocks.Lease) error {
		rows, err := fetchRows(ctx) // stops the moment the lock may be lost
		if err != nil {
			return err
		}
		return store(ctx, rows, lease.FencingToken(), lease.Slot())
	})
	var held *helixlocks.LockHeldError
	if errors.As(err, &held) {
		log.Printf("still held by %s", held.Holder)
	} else if err != nil {
		log.Fatal(err) // a *LockLostError: the lock was lost meanwhile
	}
}

func ExampleClient_Watch() {
	ctx := context.Background()
	client, _ := helixlocks.New(helixlocks.Options{})
	err := client.Watch(ctx, helixlocks.WatchOptions{OrganizationID: "acme", JobType: "nightly-report"},
		func(event helixlocks.Event) error {
			log.Printf("%s: lock %d (%s), token %d", event.Type, event.Lock.ID, event.Lock.Holder, event.Lock.FencingToken)
			return nil // an error ends the watch, and Watch returns it
		})
	if err != nil {
		log.Fatal(err)
	}
}

func Example_scheduledEverywhere() {
	ctx := context.Background()
	client, _ := helixlocks.New(helixlocks.Options{})
	// Every machine runs this at the top of the hour, by its own clock.
	opts := helixlocks.AcquireOptions{OrganizationID: "acme", JobType: "hourly-report",
		TTL: time.Minute, HoldAtLeast: 55 * time.Minute}
	err := client.WithLock(ctx, opts, func(ctx context.Context, lease *helixlocks.Lease) error {
		return sendReport(ctx, lease.FencingToken())
	})
	var closed *helixlocks.ClosedUntilError
	if errors.As(err, &closed) {
		log.Printf("this hour's report ran elsewhere; the key opens at %s", closed.ClosedUntil)
	} else if err != nil {
		log.Fatal(err)
	}
}

func Example_politeHandoff() {
	ctx := context.Background()
	client, _ := helixlocks.New(helixlocks.Options{})
	opts := helixlocks.AcquireOptions{OrganizationID: "acme", JobType: "nightly-report", TTL: 30 * time.Second}
	err := client.WithLock(ctx, opts, func(ctx context.Context, lease *helixlocks.Lease) error {
		for _, step := range []string{"extract", "transform", "load"} {
			select {
			case <-lease.RevocationRequested(): // learnt from a renewal, within ttl/3 of the request
				log.Printf("asked to let go: %s", lease.Revocation().Reason)
				return nil // returning releases the lock
			default:
			}
			if err := runStep(ctx, step, lease.FencingToken()); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
}

func ExampleClient_RequestRevocation() {
	ctx := context.Background()
	client, _ := helixlocks.New(helixlocks.Options{})
	held, err := client.Current(ctx, helixlocks.Key{OrganizationID: "acme", JobType: "nightly-report"})
	if err != nil || held == nil {
		log.Fatalf("no lock to ask about: %v", err)
	}
	lock, err := client.RequestRevocation(ctx, held.ID, "deploying v2",
		helixlocks.RevocationOptions{Deadline: time.Minute, PreferredHolder: "worker-9@host-1"})
	if err != nil {
		log.Fatal(err)
	}
	log.Printf("asked %s to let go by %s", lock.Holder, lock.Revocation.Deadline)
}
