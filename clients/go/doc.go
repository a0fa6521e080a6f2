// Package helixlocks is the Go client of Helix Locks, a distributed lock service over HTTP.
//
// It gives a Go worker what the Python SDK and the Node client give theirs: a lock that renews
// itself, a context that is cancelled the moment the lock may be lost, waiting, idempotent
// retries, typed errors and the event stream. It uses the standard library alone.
//
//	client, err := helixlocks.New(helixlocks.Options{}) // HELIX_LOCKS_URL, HELIX_LOCKS_API_KEY
//	if err != nil {
//		log.Fatal(err)
//	}
//	opts := helixlocks.AcquireOptions{OrganizationID: "acme", JobType: "nightly-report", TTL: 30 * time.Second}
//	err = client.WithLock(ctx, opts, func(ctx context.Context, lease *helixlocks.Lease) error {
//		return work(ctx, lease.FencingToken()) // ctx is cancelled the moment the lock may be lost
//	})
//	var held *helixlocks.LockHeldError
//	if errors.As(err, &held) {
//		log.Printf("held by %s until %s", held.Holder, held.ExpiresAt)
//	}
//
// What the client retries, how long it pauses, which answers end a held lock and how it reads an
// event stream follow clients/contract.json, the contract that the Python SDK and the Node client
// keep too; the tests of each read that file.
//
// A lease is counted on this process's monotonic clock (time.Now's monotonic reading), from the
// moment the acquire or the latest successful renewal was sent, for as long as the service's
// answer said was left of it (ttl_remaining_ms): never from when an answer was read, and never
// by the wall clock. WithLock and WithSession cancel the callback's context a safety margin (a
// tenth of the lease, at least 100 ms) before that moment when renewals have not succeeded, or
// as soon as a renewal is refused (403, 404, 410).
//
// A hold limit (AcquireOptions.MaxHold, SessionOptions.MaxHold) bounds a worker that hangs while
// its renewals go on: no lease runs past the grant plus MaxHold, however the holder renews, and
// the callback's context is cancelled a safety margin before it, with a HoldLimitError inside the
// LockLostError that Err and WithLock return. Choose a little more than the longest honest run.
//
// A grant with AcquireOptions.HoldAtLeast closes its key for that long, whatever becomes of the
// lock, so that a job that many machines schedule runs once per interval: acquires meanwhile get
// a ClosedUntilError (a LockHeldError too). Client.RequestRevocation asks a holder to let go: its
// lease's RevocationRequested channel is closed once a renewal's answer carries the request, and
// nothing is cancelled or forced, so the callback finishes its step and returns.
package helixlocks
