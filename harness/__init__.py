"""What the tests and the benchmarks share: service processes, proxies, the event-stream watcher,
the Node client's build, the offline browser, and the lock-history checker with its racing load.
Nothing here is a test; tests/ and bench/ both import it."""
