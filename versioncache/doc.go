// Package versioncache is a read-through cache in Redis for values whose
// source of truth is a database, built so that a read racing a write can
// never leave a stale value behind.
//
// # The race it closes
//
// A plain read-through cache misses, queries the database, and writes what it
// read. If a write commits and invalidates (deletes) the key between that
// query and that cache write, the delete finds nothing and the old value is
// written afterwards, to stay until its TTL. Deleting instead of updating on
// write narrows the window; it does not close it, because the delete comes
// before the write it needed to prevent.
//
// Here every id has a version, and values are stored under (id, version).
// Get reads the version and the value under it together; on a miss it loads
// and stores the result under the version it read before loading, and only
// if that is still the current version. Invalidate, called after the commit,
// moves the version. A load that raced a write is therefore either not
// stored or stored under a version nobody reads again.
//
// # One round trip per hit, on Redis Cluster too
//
// For a prefix P and id, the keys are
//
//	P{id}:v            the version
//	P{id}:d:<version>  the value, with a TTL
//	P{id}:l:<version>  a short fill lease
//	P{id}:r:<version>  a value cached by GetAt under the caller's version
//
// where id is escaped by internal/keyenc so it can hold any bytes. A single
// Lua script reads the version and then the value under it, so a hit costs
// one round trip. The script must build the value key from the version it
// has just read, so that key cannot be passed in KEYS; instead the script is
// given the version key and the value-key stem ("P{id}:d:") in KEYS, and every
// key it builds starts with the same hash tag {id}. Redis Cluster routes the
// call by the declared keys and only requires that every key a script touches
// hashes to the same slot, which a shared hash tag guarantees. The tests run
// this against a real three-master cluster.
//
// # Versions never go backwards
//
// Versions are microseconds of the Redis server clock: a missing version key
// (never set, expired, evicted, FLUSHALL, a restart without persistence) is
// re-created from the clock, and Invalidate sets the version to the larger of
// current+1 and the clock. Every version handed out is therefore at most the
// clock when it was handed out, and a re-created version is larger than all
// of them: no value stored before the loss can be reached again. This holds
// as long as the server clock does not step back by more than the time since
// the last Invalidate (relevant after a failover to a host with a lagging
// clock).
//
// A failover can also lose an Invalidate without losing the key: the new
// primary then holds the previous version, and the value cached before the
// write is readable again until its TTL. Config.InvalidateReplicas makes
// Invalidate wait until replicas have the bump and report when they do not.
// Because the version key may vanish safely, it has a TTL like the values.
//
// # Stampedes
//
// Concurrent misses of one id and version in a process share a single load
// (a joiner can only join a load that started after the version it observed,
// so it cannot receive a value older than a write it has seen acknowledged).
// Across processes, the first miss takes a lease inside the same script; the
// others poll for its value for up to FillLeaseWait, then load themselves.
// BenchmarkMissStorm reports loads per storm (one, with the lease, for 4
// processes × 16 goroutines missing together; four without it).
//
// # When Redis fails
//
// With FailOpen (the default) Get serves the loader's value; with FailClosed
// it returns a *RedisError. No value is kept in process memory, so neither
// mode can serve a stale one. Invalidate always reports failure: a lost
// invalidation leaves the previous value readable until TTL, so retry it or
// drive invalidations from a transactional outbox.
//
// # Costs
//
// Each Invalidate orphans the value cached under the previous version, if
// any, until its TTL: at most (invalidations per TTL) dead keys per id, which
// Stats.OrphanedValueKeys counts. Shortening TTL bounds the memory at the
// expense of hit rate. Anything that reads these keys directly (a debugging
// command, a warmer) must follow the version indirection; use Peek.
//
// # Caller-supplied versions
//
// GetAt caches under a version the caller already has, such as a
// database-incremented row_version. It needs no Invalidate, and is silently
// wrong for any write that does not move that version (a bulk UPDATE or data
// fix that forgets it). Prefer Get with Invalidate when that cannot be ruled
// out.
//
// # Checking
//
// Check compares a random sample of cached values with the database: the
// standing assertion (say, 500 ids an hour) that would have caught the race
// in production long before a customer did.
//
// # Metrics
//
// Stats returns the cache's counters. With Config.MeterProvider set they are
// also exported as OpenTelemetry observable counters (verity.cache.*), read
// in one callback at collection time, so hits pay nothing for metrics; only
// loader durations are recorded as they happen. The callback keeps the Cache
// reachable: create one Cache per cached type and Close any you discard.
package versioncache
