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
// Here every id has a version, and the current value of an id is kept
// together with the version it was loaded under. Get on a miss reads the
// version, loads, and stores the result only if the version is still the one
// it read before loading. Invalidate, called after the commit, moves the
// version and deletes the current value in one atomic step. A load that
// raced a write is therefore not stored, and a value stored before a write
// is gone once its Invalidate returns.
//
// # One round trip per hit, on Redis Cluster too
//
// For a prefix P and id, the keys are
//
//	P{id}:v  the version
//	P{id}:c  the current value: "<version>:<shape>~<encoded value>", with a TTL
//	P{id}:l  a short fill lease: "<version>:<lease token>"
//	P{id}:a  GetAt's value: "<caller's version>:<shape>~<encoded value>",
//	         with a TTL (read only by GetAt and CheckAt; Invalidate deletes it)
//
// where shape is the Codec's shape tag (see "Types and Codecs in a rollout"),
// and id is escaped by internal/keyenc so it can hold any bytes. A hit is a
// plain GET of P{id}:c: that key exists only while its value is current,
// because
//
//   - Invalidate moves the version and deletes P{id}:c in one script, so a
//     GET either ran before the Invalidate (the read began before the write
//     was acknowledged: allowed) or finds nothing;
//   - a fill is a script that stores P{id}:c only if P{id}:v still holds the
//     version read before loading; any Invalidate since then moved it, and a
//     version, once replaced or lost, never comes back (next section, which
//     also names the exceptions), so a load that may predate a write is
//     refused;
//   - nothing else writes P{id}:c.
//
// A hit does not need the embedded version; Peek and Check report it, and
// Invalidate uses it (below). Misses, fills and Invalidate are Lua scripts;
// every key they touch is declared in KEYS (the tests run them under a
// wrapper that fails on any other key). The lease is one key per id, holding
// the version it was taken for, precisely so that it can be declared before
// the script has read the version. All of an id's keys share the hash tag
// {id}, so each call runs on the one Redis Cluster node that owns the id. The
// tests run this against a real three-master cluster.
//
// A replica can lag an Invalidate that its primary has acknowledged, so the
// hit GET goes to the primary (with one exception, below), also with a
// *redis.ClusterClient that routes reads to replicas (ReadOnly,
// RouteByLatency, RouteRandomly); so do
// the read script of a miss and of Peek, which may return the cached value,
// and Invalidate's bump and WAIT when InvalidateReplicas is set. These commands
// run on the master's own connection, after READWRITE: a replica-reading
// client opens every connection with READONLY, and a master demoted by a
// failover the cluster client's slot map has not caught up with would
// otherwise serve the hit as a replica. It answers MOVED instead, and so
// does a master that lost the slot to a resharding; the Cache then reloads
// the map, waits for it to name the new master (up to two seconds) and
// sends the command again there. An ASK reply (a slot in the middle of a
// migration) sends it once to the importing master, after ASKING.
// A master that died (SIGKILL, a lost host) answers nothing: the command
// fails with its connection error (or, for a caller whose deadline is
// shorter than the client's ReadTimeout, with that deadline: all go-redis
// reports of a host that stopped answering), and the cache has the
// cluster client reload its slot map, so the commands after it reach the replica promoted
// in its place within seconds of the promotion (0.9–2.6 s in the tests).
// go-redis itself reloads the map on redirects and every
// ClusterStateReloadInterval (60 s by default) only, never on connection
// errors.
//
// While a slot migrates (MIGRATING on its master, IMPORTING on another, for
// as long as a resharding takes to move its keys), Redis runs a command
// that names several keys only on a node holding every one of them: the
// migrating master answers ASK when it lacks any (one that exists nowhere
// included), and the importing master then answers TRYAGAIN unless it has
// them all. Each script here names three keys, and P{id}:a (written only by
// GetAt), P{id}:l (held only during a miss) and, on a miss, P{id}:c seldom
// all exist: for the whole migration, nearly every Invalidate, Peek, miss
// and fill of an id in that slot meets TRYAGAIN, whether or not the id's
// keys have moved. go-redis retries it only briefly: a cluster client
// gives up after MaxRedirects attempts (3 by default: some tens of
// milliseconds, with MinRetryBackoff's 10 ms), and the Cache's commands
// pinned to masters (above) follow one ASK and do not retry. So:
//
//   - Invalidate and Peek (so Check) retry TRYAGAIN, backing off from 10 ms
//     to 200 ms, until the migration ends or their ctx does; so do those
//     pinned to a master that meet an ASK they cannot follow (the
//     importing master joined the cluster and serves no slot yet, so the
//     client's slot map does not name it). They then
//     return a *RedisError matching ErrSlotMigrating and ctx's error,
//     counted as one Redis error (Stats.RedisErrors); the bump did not
//     happen (unless the ctx cut off an attempt in flight), so retry it as
//     any failed Invalidate. Give them a ctx with a deadline: a migration
//     left unfinished (a resharding tool that died, until redis-cli
//     --cluster fix) would keep one without a deadline waiting.
//   - Get does not wait for a migration. A miss meeting TRYAGAIN is served
//     by its loader, uncached, with FailOpen, and fails at once with a
//     *RedisError matching ErrSlotMigrating with FailClosed; a fill meeting
//     it is skipped (its loaded value is served, as after any failed fill).
//     A hit, one GET of one key, is not held up: the migrating master
//     answers it, or sends it to the importing one. One exception: through
//     a client that reads from replicas (its reads pinned to masters), a
//     hit whose key has moved to an importing master that serves no slot
//     yet cannot follow the ASK, and is a miss that met a migration (a
//     load with FailOpen, ErrSlotMigrating with FailClosed).
//   - GetAt and CheckAt name one key per command, and are not held up.
//
// Nothing stale is served meanwhile: a script that meets TRYAGAIN did not
// run, P{id}:c is current wherever it is, and a value cached before a
// write stays readable only while that write's Invalidate has not
// returned, as always.
//
// Sentinel with replica reads (redis.NewUniversalClient with MasterName and
// RouteRandomly or RouteByLatency) builds such a client over servers that
// are not in cluster mode: those reads go to the master Sentinel named, as
// they are (no READWRITE, no MOVED), and a master Sentinel has just demoted
// may serve them as a replica until Sentinel's next answer reaches the
// client.
//
// A Sentinel client built with ReadOnly (redis.NewUniversalClient with
// MasterName and ReadOnly, without RouteRandomly or RouteByLatency; or
// redis.NewFailoverClient with ReplicaOnly) is a *redis.Client connected to
// a replica, and nothing steers it to the master (New cannot tell it from a
// client of the master either): its hits may lag an Invalidate the master
// has acknowledged. Misses and Invalidate fail loudly there, because a
// replica refuses their scripts' writes: counted in Stats.RedisErrors, and
// Invalidate returns a *RedisError. Do not give a Cache such a client.
//
// go-redis's client-side cache (Options.ClientSideCache or
// ClientSideCacheConfig, with RESP3; UniversalOptions passes them on to a
// standalone client) answers a single read command from process memory
// until the server's invalidation message for its key has been processed,
// asynchronously: after another process's Invalidate may have returned.
// With such a *redis.Client the hit GET is therefore sent as a one-command
// pipeline, which go-redis never answers from that cache: the hit costs
// its round trip as with any other client, and the client-side cache saves
// the Cache nothing. Other clients' hits remain a single GET. Node or shard
// clients with a client-side cache, made by the NewClient function of
// ClusterOptions or RingOptions, are not detected and would serve stale
// hits: do not use them. GetAt's and CheckAt's GETs bypass it the same
// way. Their hit only needs a version at or above the caller's, but a
// value go-redis holds can be the very one an Invalidate deleted to repair
// a write that kept its version (see Checking).
//
// # Versions never go backwards
//
// Versions are microseconds of the Redis server clock: a missing version key
// (never set, expired, evicted, FLUSHALL, a restart without persistence) is
// re-created from the clock, and Invalidate sets the version to the largest
// of current+1, the clock and one above the version embedded in P{id}:c.
// Every version handed out is therefore at most the clock when it was handed
// out (unless the one before it already reached the clock: two Invalidates
// of an id within one microsecond, which one server's scripts, each longer
// than that, do not manage, or a clock that stepped back), and a re-created
// version is larger than all of them: a fill still in
// flight under an old version cannot pass the check. This holds as long as
// the server clock does not step back by more than the time since the last
// version was handed out, by an Invalidate or a re-creation (relevant after
// a failover to a host with a lagging clock).
//
// Versions are decimal integers below 2^53, where the scripts' Lua numbers
// (doubles) still count by one. Anything else in P{id}:v or before the ':'
// of P{id}:c, written by something else (a snowflake id, a sign, a leading
// zero), is no version: it never seeds the next version, and a P{id}:v
// holding it is treated as lost and replaced by the next miss or
// Invalidate. Nor does 2^53 - 1 seed it, having no successor below 2^53:
// the next version comes from the clock and the other key. When that
// leaves Invalidate no new version at all (2^53 - 1 in P{id}:v and 2^53 - 2
// in P{id}:c, both foreign), it changes nothing and returns a *RedisError
// naming the keys to delete, rather than keep the version.
//
// The version key can be lost while P{id}:c survives (it is evicted alone).
// The value is still current (no Invalidate ran, or it would be gone), so it
// is served. The next Invalidate then starts the version above both the clock
// and the version embedded in P{id}:c, and deletes P{id}:c, as always. When
// both keys are lost, a fill in flight finds no version and stores nothing.
//
// A failover can lose an Invalidate (the bump and the delete together, being
// one script): the new primary then still holds the value cached before the
// write, readable until its TTL. Config.InvalidateReplicas makes Invalidate
// wait until replicas have it and report when they do not.
//
// So can a restart that reloads an older snapshot (RDB, or AOF with
// appendfsync everysec, after a crash): the version key and the value come
// back together as they were, and every Invalidate acknowledged since is
// undone until TTL. After an unclean restart of a Redis with persistence,
// delete the prefix's keys (or run it with appendfsync always).
//
// A *redis.Ring moves the ids of a shard it marks down to the other shards,
// and back when the shard answers again, usually with its data: the value
// cached there before an Invalidate that ran on another shard is readable
// again. Give the Ring a HeartbeatFn that always reports its shards up (a
// shard that does not answer then fails its calls, and Invalidate reports
// it), and delete the prefix's keys after changing its shards (SetAddrs).
//
// Upgrading from the previous layout (values under P{id}:d:<version>): old
// and new processes must not share a prefix, because an old Invalidate does
// not delete P{id}:c. Change Config.Prefix with the upgrade, or stop all old
// writers first; the old keys expire within TTL. Releases that kept leases
// under P{id}:l:<version> can share a prefix with this one, but the two do not
// see each other's leases: during the rollout a miss storm may cost one load
// per release instead of one, and nothing else changes.
//
// Upgrading to the release whose Invalidate deletes GetAt's value too: an
// Invalidate by an older process leaves P{id}:a in place, so a divergence
// CheckAt reports is repaired only by a new process's Invalidate.
//
// Upgrading to the release that dropped PrefixDefault: Config.Prefix is
// required; "verity:vc:" keeps a cache's existing keys (for one cached type
// only). JSONCodec now decodes a number inside an interface value (a
// map[string]any) as a json.Number, not a float64, so that 64-bit ids keep
// their digits: code asserting .(float64) on such values must change.
//
// Upgrading to the release that tags values with their shape (below):
// values cached by earlier releases do not decode for it, nor its values for
// them, as between any two releases with different shapes.
//
// # Types and Codecs in a rollout
//
// Every value is stored behind a shape tag: 8 hex digits hashing the Codec's
// type and the shape of T (type names, field names, struct tags and field
// types, recursively). While a rolling deploy that adds a field to T runs
// old and new processes on one Prefix, each sees the other's values as
// values that do not decode — a miss, reloaded, counted in
// Stats.DecodeErrors — instead of decoding them into its own shape, which
// encoding/json does without complaint (a field the value lacks is left at
// its zero value, a value the source never held). The price is load on the
// source while both releases run: an id both read is reloaded each time the
// other release cached it last, and once the rollout is over every id
// costs one more load. The tag does not cover
// what only the code decides: a Codec's settings, or a MarshalJSON method
// whose output changes while the type stays. Change Config.Prefix with such
// a release.
//
// The shape includes unexported fields, recursively, of T and of the
// Codec's type (a Codec may encode them). A release that changes only
// private fields, say by upgrading Go or a dependency whose struct (or
// time.Time) is inside T, therefore changes the tag as well: the cache
// empties (every id costs one load), and during the rolling deploy old and
// new processes reload each other's values, as above.
//
// # Stampedes
//
// Concurrent misses of one id and version in a process share a single load
// (a joiner can only join a load that started after the version it observed,
// so it cannot receive a value older than a write it has seen acknowledged),
// each getting its own copy decoded from the cached bytes. A load that fails
// fails them all with its *LoadError (also a loader's own timeout), unless
// the ctx of the caller running it ended: the others then load again,
// whatever the error (a loader may report its ctx ending as an i/o timeout
// or an RPC status as well as a context error). A loader's panic goes on in
// the caller that ran it; the others get a *LoadError.
// Across processes, the first miss takes a lease inside the same script; the
// others poll for its value for up to FillLeaseWait, then load themselves. A
// lease guards only the version it was taken under: once the version moves,
// the holder's fill will be refused, so the next miss takes the lease over.
// Leases save loads and nothing else; correctness never depends on them.
// BenchmarkMissStorm reports loads per storm (one, with the lease, for 4
// processes × 16 goroutines missing together; four without it).
//
// # When Redis fails
//
// With FailOpen (the default) Get serves the loader's value; with FailClosed
// it returns a *RedisError. A fill that fails after a load is served in
// both modes: the value came from the source of truth; only caching it
// failed (logged, counted as a Redis error, as a failed lease release is).
// A read cut off by the caller's own ctx is neither: it returns the ctx's
// error and counts no Redis error (nor does a fill or an Invalidate cut off
// by it). No value is kept in process memory, so neither mode can serve a
// stale one. Invalidate always reports failure: a lost invalidation leaves
// the previous value readable until TTL, so retry it or drive invalidations
// from a transactional outbox. An outage does not log a line per Get: each
// kind of warning is logged at most once a second, with a count of those
// left out (see Config.Logger), while Stats and the metrics count every
// failure.
//
// A Redis at its maxmemory with the noeviction policy (a Redis it shares
// with a projection should have that policy) refuses every script that
// could grow it with an OOM error, whole: a miss of Get is then a Redis
// failure as above (FailOpen serves the loaded value uncached, FailClosed
// returns the *RedisError), and nothing is stored. A miss of GetAt, whose
// only script is the fill after its load, is served uncached in both
// modes (a failed fill, as above), each call loading again. Hits, Peek,
// Check and Invalidate keep working; Invalidate must, since a value it fails to
// delete stays readable. It frees the value it deletes, but an
// Invalidate of an id with no version key (never cached, or expired)
// stores one (about 140 bytes, for TTL), so on a full Redis invalidations
// of such ids grow it by that much each. Each script
// declares its flags for this (Redis 7 shebangs): without them Redis
// checks maxmemory only until a script's first write, and a miss's script
// may begin with one Redis allows when full (PEXPIRE): its lease and the
// fill after it would then be stored past the limit.
//
// A Redis that stops answering fails a call only at its connection's
// deadline: go-redis does not end a command in flight when its ctx is
// cancelled. That deadline comes from the client's ReadTimeout and
// WriteTimeout and, with ContextTimeoutEnabled, also from the ctx's
// deadline, whichever is first; New refuses a client that would set none
// (a timeout of -2, or of -1 without ContextTimeoutEnabled). The fill (of
// Get or GetAt) and the lease release that run on for the callers sharing a
// load after its caller's ctx ended get a one-second ctx of their own, which
// a command in flight honours only with ContextTimeoutEnabled.
//
// # Costs
//
// One value key, one version key and (briefly, during a miss) one lease key
// per cached id; a value takes its encoding, its version and the 9-byte
// shape tag. Invalidate deletes the current value instead of leaving it
// behind under an old version, and a refused fill stores nothing, so no value
// key is ever orphaned (Stats.OrphanedValueKeys stays 0, kept for
// compatibility). A miss keeps the id's version key for TTL + FillLeaseTTL
// and a fill for at least TTL, so that a load that takes longer than TTL
// can still be cached (Config.TTL says how much longer); a version key that
// outlives its use costs memory, never correctness. A miss costs two
// round trips before the load (the GET that missed, then the script that
// reads the version and takes the lease) and one after it (the fill).
//
// # Caller-supplied versions
//
// GetAt caches under a version the caller already has, such as a
// database-incremented row_version. It needs no Invalidate (which deletes
// P{id}:a all the same, see Checking): P{id}:a holds the
// newest version stored, a hit is one GET whose embedded version is at or
// above the caller's (a newer value is ahead, never stale), and a fill never
// replaces a newer version with an older one, not even when the newer value
// does not decode for the caller: during a rollout that changes the Codec or
// the cached type, it may be valid for the other side, and replacing it
// would have old and new processes overwrite each other's values and both
// keep missing. The caller is then served its own load, uncached. Only a
// value whose version prefix does not parse (not a non-negative int64 in
// canonical decimal) is replaced whatever it claims: it can serve nobody.
// It is silently wrong for any write that does not move that version (a
// bulk UPDATE or data fix that forgets it). Prefer Get with Invalidate when
// that cannot be ruled out.
//
// # Checking
//
// Check compares a random sample of cached values with the database: the
// standing assertion (say, 500 ids an hour) that would have caught the race
// in production long before a customer did. It reads what Get caches
// (through Peek). CheckAt does the same for the values GetAt caches, with a
// loader that also returns the version callers pass: it finds GetAt's own
// trap, a write that changed a row but not its version. Peek sends its
// script, in a mode that writes nothing, with EVALSHA_RO (EVAL_RO when
// Redis lacks it), which Redis checks against read key permission only:
// a checking tool can run as an ACL user allowed to read the cache's keys
// (%R~prefix*) and the few commands README lists under Redis permissions.
//
// Invalidate repairs what either finds: it deletes P{id}:c and P{id}:a. A
// GetAt load in flight during the Invalidate may store what it read, under
// its caller's version, after the delete (GetAt trusts that version to name
// the value), and GetAt and CheckAt through a client that reads from
// replicas may read one that has not applied the delete yet, so run
// CheckAt again to confirm, and move the row's version with a data fix to
// rule that out.
//
// # Metrics
//
// Stats returns the cache's counters. With Config.MeterProvider set they are
// also exported as OpenTelemetry observable counters (verity.cache.*), read
// in one callback at collection time, so hits pay nothing for metrics; only
// loader durations are recorded as they happen. The callback keeps the Cache
// reachable: create one Cache per cached type and Close any you discard.
package versioncache
