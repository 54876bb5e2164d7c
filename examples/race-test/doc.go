// Command race-test reproduces the read-through stale-set race against real
// PostgreSQL and Redis, and shows that versioncache closes it.
//
//	go run ./examples/race-test --readers=40 --writers=4 --seconds=30
//
// Readers read one hot product through the cache while writers update its
// price in PostgreSQL and invalidate the cache after each commit. Mode naive
// is read-through with delete-on-write; mode versioned is versioncache. See
// README.md for what each figure means and the figures measured.
//
// The run logic is run (race.go), tested with short runs in race_test.go; the
// metric definitions live on tracker (tracker.go).
package main
