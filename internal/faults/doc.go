// Package faults holds verity's reliability suites: tests that crash relays
// (as separate OS processes), kill, restart and flush Redis and PostgreSQL,
// inject network faults through an embedded toxiproxy, feed hostile input and
// hostile configuration, and then prove that nothing was lost or invented:
// every Redis key equals PostgreSQL, the outbox is empty, every acknowledged
// command was applied exactly once.
//
// The package has no API; it exists for its tests. Each suite logs one
// parseable summary line per scenario:
//
//	faults-summary suite=<name> scenario=<name> key=value ...
//
// with the figures the README's Reliability section quotes (the faults
// injected, the rows checked and repaired, lost=0, where they apply). Sizes
// are small enough for CI (-race, 2 cores); VERITY_SOAK=1 selects the soak
// sizes (for example 100 relay kills during a 100k-event drain).
//
//	go test -race -count=1 ./internal/faults/
//	VERITY_SOAK=1 go test -count=1 -timeout 60m -v -run 'Test' ./internal/faults/
package faults
