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
