// Package projection keeps Redis read models in step with PostgreSQL: it
// writes the absolute state carried by outbox records into Redis through a
// version gate that makes at-least-once, out-of-order delivery harmless.
//
// # Model
//
// The source of truth (PostgreSQL) owns every entity's state and a version
// that strictly increases with each change. Each change commits, in the same
// transaction, an outbox message holding the entity's whole state at that
// version (see package outbox). A relay hands batches of those records to a
// Projector, which writes them to Redis. Redis may lag, but it never moves
// backwards and never holds a state the source did not commit — as long as
// it keeps the versions the gate stored. Run it with maxmemory-policy
// noeviction: a version key lost to eviction, a FLUSHALL or a failover
// lets a redelivered older record (a relay that crashed before its ack, a
// replayed dead letter) apply over a newer value until a reconcile pass
// repairs it, and the outbox lag does not show it. (A volatile-* policy
// evicts only keys with a TTL, which the projection's value, version and
// layout keys never have; a reconcile Rebuild's marker has one, and its
// eviction aborts the rebuild (reconcile.ErrRebuildAborted) before it
// switches its copy in.)
// CheckEvictionPolicy tells whether the servers behind a client could
// evict them; leaderboard's Worker runs it at start and logs a warning.
//
// A Mapper turns each record into a Write: a Target (where), a Version and
// a Value (what). Three kinds of target are built in:
//
//   - KindSortedSet: the score of a member of a sorted set (a leaderboard).
//     Value.Score is an int64 within ±2^53 (MinScore, MaxScore); Redis keeps
//     scores as doubles, which hold every integer in that range exactly.
//     Anything outside is refused with *ScoreOutOfRangeError, never rounded.
//   - KindHash: the bytes of one field of a hash.
//   - KindDocument: one string key per document (JSON, typically).
//
// SortedSetMapper, HashMapper, DocumentMapper and StreamMapper cover the
// common layouts; any MapperFunc projects a custom stream.
//
// # The gate
//
// For each write, in batch order, the gate reads the stored version S of the
// target and compares it with the write's version V:
//
//	no S, or V > S                 write value and version   OutcomeApplied
//	V == S, same value or none     nothing                   OutcomeDuplicate
//	V == S, another value stored   nothing                   OutcomeConflict
//	V < S                          nothing                   OutcomeStale
//
// The comparison and the writes run inside one Lua script, so no other
// client can interleave between them. Versions are int64 and must be
// positive (*InvalidVersionError otherwise). Lua numbers are doubles, which
// cannot tell 2^53 from 2^53+1, so the script never converts a version to a
// number: it compares canonical decimal strings by length, then digit by
// digit. A stored version that the gate could not have written — anything
// but a positive int64 in canonical decimal (a hand edit, a foreign writer:
// "007", "0", "-7", "99999999999999999999") — is never guessed at: that
// write is refused with *CorruptVersionError and left for reconciliation to
// repair. Ordering against it would be wrong both ways: a stored version
// past int64 would make every later write stale, a negative one would let
// any write in.
//
// # Why no per-event marker keys
//
// A redelivered record carries the version it carried the first time. The
// source assigns versions per entity in the transaction that changes it and
// every change raises it, so two different changes of one entity never share
// a version: an equal version can only be the same change, that is, the
// same absolute state, already applied. The stored version therefore
// identifies the last event applied to the target, and "duplicate" needs no
// other memory. A marker key per event id would add a key and a write per
// event, expire (after which the version check is what protects the state
// anyway), and bring nothing the version does not already decide.
//
// The gate still checks that claim: a write at its stored version whose
// value differs from the one stored with that version is OutcomeConflict,
// not a duplicate, and RedisProjector logs it as a warning (a line a
// second at most, per projector). Two states for one version mean the
// source or the Mapper broke the contract, or the stored value was edited
// since, and the drop is then a loss worth seeing at once, not only at the
// next reconciliation. The value is read only for writes at their stored
// version, so a batch of new versions pays nothing for it.
//
// We found one situation where version equality stops identifying the
// event: a source that reuses versions — a database restored from an older
// backup, a failover to an asynchronous standby that missed the last
// commits (their versions were projected, then lost with the old primary),
// or an entity deleted and re-created with its counter back at 1. Then a
// genuinely new state arrives with a version already seen and is reported
// stale, or conflict (duplicate if the states happen to be equal), and
// nothing is written. A marker would not help
// either: the write would pass the marker and still lose the version
// comparison. Keep versions monotonic across deletes (never reset a
// counter; a sequence works), and run reconciliation after a restore or
// such a failover: it compares source and projection and finds such
// entries — ahead (a version the source no longer has), orphan (an entity
// it no longer has), or corrupt when the versions match but the values
// differ. By default it repairs corrupt entries and only reports ahead and
// orphan ones; repair those with reconcile.Policy{Ahead: ActionRepair,
// Orphan: ActionRepair}, or rebuild the projection. Markers are therefore
// not offered.
//
// # Keys and Redis Cluster
//
// Keyspace names every key; see its documentation for the layout. All keys
// of one collection (value, versions, rebuild marker, shadows) and both keys
// of one document share one hash tag, and so one Cluster slot, which is what
// lets a single script touch them. Names and members are arbitrary bytes:
// the tag holds keyenc.Escape(name), which is injective and never contains
// '{', '}' or ':', so no id can move a key to another slot or make two
// targets share a key; members are stored verbatim inside the structures.
//
// Gate.Apply groups a batch by slot (KeySlot is the CRC16 Redis uses) and
// sends one script call per slot group — per batch on a single node or
// Sentinel — pipelined in one round trip when there are several. The script
// is loaded once (EVALSHA); a node that answers NOSCRIPT (restart, failover,
// SCRIPT FLUSH) gets the source with EVAL, pipelined as well. Within a
// call, writes to collections with one version hash, none of them being
// rebuilt, are decided in order and then written with a few commands per
// collection (HMGET of the stored versions, one ZADD or HSET of values,
// one HSET of versions), which costs Redis about a third less per write
// than a command per write; a call that holds a document, or a write to a
// collection with version buckets or being rebuilt, takes all its writes
// one at a time. Both give the same replies. Works with any
// redis.UniversalClient. A Gate made with the zero Keyspace refuses every
// call with a *ConfigError: pass NewGate NewKeyspace(prefix) or the
// projector's Keyspace().
//
// # Version buckets (memory)
//
// By default each collection keeps its members' versions in one hash (P
// T:zv). Past 128 entries Redis stores a hash as a hashtable, about 58
// bytes per member — more than a third of a sorted-set projection's memory.
// Config.VersionBuckets (or Keyspace.WithVersionBuckets) spreads the
// versions over that many small hashes (P T:zv:0 … P T:zv:<B-1>; the bucket
// is FNV-1a of the member modulo B) that Redis keeps as listpacks while each
// holds at most 128 entries of at most 64 bytes (hash-max-listpack-entries
// and -value, Redis 7 defaults): about 21 bytes per member. With
// B = members / 64, examples/benchmark measured 125.0 bytes per member for a
// 100,000-member board (sorted set 103.9, versions 21.1 in 1,563 buckets)
// against 162.3 with one version hash and 266.3 for the seed design's
// per-event markers (both under a short key namespace). Buckets that outgrow the limits stay correct, only
// larger; size B for the collection's expected size, and migrate (below)
// when it grows past twice that.
//
// Buckets cost the gate some CPU in Redis (a listpack is searched entry by
// entry), and a bucketed collection is written one write at a time, not in
// bulk (see above; grouping a call's writes by bucket was measured and is
// slower at members / 64 buckets, where a batch touches about a bucket per
// write): BenchmarkGate/BatchedVersionBuckets, batches of 100
// over 15 buckets, ran at 0.48–0.75× (median about 0.65×) the unbucketed
// throughput in seven runs on 2026-12-04 (0.46–1.06×, median about 0.8×,
// before the bulk writes). Reconciliation pays more:
// a page of source rows touches a bucket per member instead of one hash,
// so a full pass ran at 0.34–0.7× the unbucketed speed (see package
// reconcile). Collections without buckets pay one GET of the layout key
// per collection per script call (and up to two EXISTS while it is
// absent: an empty collection, or one older than layout keys, until a
// write records it), and keep five arguments per write; the unbucketed
// BenchmarkGate measured 206,000–237,000 events/s against 197,000–226,000
// before layouts existed (alternating runs), and one EXISTS more per call
// was within the noise: 130,000–139,000 events/s against 104,000–144,000
// without it, three alternating runs at load 6–8. Documents are never
// bucketed.
//
// The bucket count is part of the stored data: a version looked up in the
// wrong bucket looks absent, and the gate would let a stale write in. So it
// is recorded in a layout key (P T:z~layout) that the gate reads in the
// same script that compares and writes. Every collection records it, 0
// included: the first write into a collection without one records the
// writer's count. A writer whose count differs gets *LayoutMismatchError
// (errors.Is ErrLayoutMismatch) and nothing is written to that collection;
// readers in package reconcile refuse the same way. Without a layout key
// the collection's keys decide: an empty one takes the count of its first
// writer; one with the unbucketed version hash — written before layout
// keys were recorded — counts as 0 buckets, which its next unbucketed
// write records. Values with neither mean a lost layout key (a DEL,
// eviction under maxmemory): the bucket count is unknown, and a writer
// guessing 0 would find no versions and overwrite newer data, so every
// writer is refused (Stored -1, unreadable). Setting the layout key to the
// true count, or a Rebuild, unblocks it. An unbucketed collection whose
// version hash disappears (its last entry deleted, or the hash evicted)
// keeps its layout key 0, so its writes still apply and reconcile repairs
// its values, left without versions, as corrupt. (One written before
// layout keys that loses the hash before its next write looks like a lost
// layout key: set the layout key to 0.) A bucketed collection that loses its
// values and its layout key together, keeping only its version buckets,
// looks empty: the gate reads only the buckets of the writer's own count, so
// a writer whose count differs records its count and finds no versions, and
// may apply writes older than the versions the buckets hold. Run with an
// eviction policy that keeps these keys (CheckEvictionPolicy), and drop a
// collection by deleting all of its keys, never some of them.
//
// To change the count of a live collection, run reconcile's Rebuild with
// the new count: it copies the source into shadow keys of the new layout
// (live writers of the old count dual-write into them: a layout error from
// the shadow makes the gate rebuild its shadow keys once and remember the
// layout) and switches values, every version bucket and the layout key in
// one script. From the switch on, writers with
// the old count are refused until they are redeployed with the new one.
// Through RedisProjector.Handle (the relay's path) only that collection's
// records fail, each with its own Result.Err; the rest of the batch is
// applied. The relay retries those records with backoff and, once one has
// been attempted MaxAttempts times, moves it to the dead-letter table, from
// where Relay.ReplayDead requeues it after the redeploy. So redeploy the
// writers within the relay's retry budget, or replay the dead letters.
//
// # Failure semantics
//
// Every write of a batch is validated before anything is sent; bad input
// returns a typed error and writes nothing. A version layout that differs
// from the Keyspace's is refused (*LayoutMismatchError) by the script before
// it writes anything in that slot group: Gate.Apply and Project return it
// for the batch, Handle gives it to that collection's records only and
// sends the rest of the slot group again. Within one slot group the
// script runs alone (nothing interleaves with it) and checks what it can
// before it writes; across slot groups nothing is atomic (Redis has no
// cross-slot atomicity): if a call fails, the other groups' calls, sent
// in the same round trip, may have been applied. Handle gives the failed
// call's error to the records of that slot group only and acknowledges
// the rest; Gate.Apply and Project fail the batch with it. Either way the
// metrics count the verdicts of every write the gate decided, and as
// failed only the records that the failed call left undecided. A Redis
// error inside a script (WRONGTYPE, when a key holds another type) also
// keeps the writes the script made before it: Redis does not roll a
// script back. Both are safe because the gate makes every write
// idempotent and order-insensitive: the relay re-delivers what failed,
// applied records come back duplicate, the rest are applied. Gate.Apply
// and Project return a WRONGTYPE error for the batch. Handle gives a
// *WrongKeyTypeError (ErrWrongKeyType) to the records whose keys hold
// another type only: the script reports the writes it finished before the
// error, whose outcomes (and metrics) stand — a record it applied counts
// as applied, not as a duplicate — and the slot group's writes after the
// failing one are sent again one by one.
//
// When a Cluster master dies, writes to its slots fail until a replica is
// promoted (through Handle, only the records of those slots: the rest of
// each batch is applied and acknowledged); the gate then makes the client
// reload its slot map, so the relay's next retry reaches the new master
// (whose empty script cache the NOSCRIPT fallback fills). Redis
// replication is asynchronous, so a failover can lose writes the old
// master had already acknowledged — and the relay has already
// acknowledged their records. The gate cannot see
// that loss; the projection is behind (never wrong in the other direction)
// until the next write of that target or a reconciliation run repairs it.
//
// Resharding a Cluster fails every gate call for a collection whose slot
// is being moved, with TRYAGAIN, until the slot has moved: each call names
// keys that usually do not exist (the rebuild marker, the shadow keys),
// and Redis refuses to look for keys on a migrating slot. Through Handle
// only those records fail, and the relay retries them with backoff: let a
// reshard finish well within the relay's MaxAttempts, or replay the dead
// letters after it. A batch whose writes span slots goes out as one
// pipeline, and go-redis sends a node's whole part of a pipeline again when
// its first command is answered TRYAGAIN, the script calls it is already
// following a MOVED or ASK of included (one then runs on two masters at
// once, and its own write comes back duplicate): on a cluster client the
// gate therefore starts the pipeline with one single-key EXISTS per slot,
// which Redis never answers TRYAGAIN and which go-redis never sends again
// (nor, with it, the node's batch: on LOADING, CLUSTERDOWN or a broken
// connection the calls not answered fail, and the relay retries them), and
// the refused call alone fails.
// A resent script's write still comes back duplicate or stale, not
// applied, on any client whose MaxRetries lets go-redis resend a script
// whose reply was lost (a connection cut after Redis ran it, a
// ReadTimeout): the applied count and the lag histogram miss it for that
// batch; what Redis holds is right.
//
// A *redis.Ring needs one option. By default go-redis pings every shard
// and, after a few missed pings, hashes the keys of a shard it marks down
// onto the others until it answers again. Versions live with the keys, so
// during such a move the gate compares against a shard that has never seen
// the target (a redelivered older record is applied), and when the shard
// returns the writes acknowledged meanwhile vanish from readers: the
// projection moves backwards, to the shard's older state. Give the Ring a
// RingOptions.HeartbeatFn that always reports the shard up, so that a
// shard that does not answer fails the writes it holds (the relay retries
// their records) instead of moving keys:
//
//	HeartbeatFn: func(context.Context, *redis.Client) bool { return true },
//
// Changing a Ring's shards (SetAddrs) moves keys the same way: rebuild or
// reconcile the collections after it.
//
// go-redis does not end a command in flight when its context is cancelled,
// only at the connection's deadline (ReadTimeout, WriteTimeout, and with
// ContextTimeoutEnabled the context's deadline). NewRedisProjector
// therefore refuses a client that sets either timeout to -2, which makes
// go-redis set no deadline at all (not even the context's), or to -1 (no
// timeout) without ContextTimeoutEnabled: against a Redis that stops
// answering, the relay's shutdown would never end. A relay's Run then
// waits for a batch stuck in Redis at most its ShutdownTimeout plus the
// client's ReadTimeout for the command in flight (and its WriteTimeout on
// top if Redis stalls while the command is still being sent); with
// ContextTimeoutEnabled and the timeouts -1, until the Handler context's
// deadline, which the relay sets to the end of the claim's lease. What is
// checked for a Ring or a ClusterOptions.NewClient function: see
// NewRedisProjector.
//
// # Rebuilds
//
// A full rebuild (reconcile's Reconciler.Rebuild) fills shadow keys from the source and
// swaps them in. While the collection's rebuild marker exists, the gate
// applies each live write to the shadow keys too, by the same rule and
// independently (the shadow outcome is not reported), so that writes made
// during the copy are not lost by the swap. Gate.ApplyShadow gates the copy
// itself into the shadow keys, so it never overwrites a newer dual-written
// version, and checks the rebuild's token against the marker in the same
// script (ErrShadowNotOwned), so a rebuild that stalled past its marker's
// expiry cannot copy stale rows into the shadow keys of the next one.
// Gate.ApplyShadowCopy, which the rebuild uses, also counts each batch's
// writes in the collection's copy count (Keyspace.RebuildCopyKey) in that
// same script, once per batch number: Redis keeps or loses rows and count
// together, so the rebuild's switch can refuse a shadow that lost writes
// in a failover or a restart while its marker survived. Every write into
// the shadow keys, copied or dual-written, also counts there the members
// and versions it creates, so that the switch can refuse a shadow that
// lost some to an eviction even when new members made up the numbers.
//
// # Projector and relay
//
// RedisProjector implements Projector and outbox.Handler and is given to
// outbox.NewRelay as is. Project fails the whole batch on a record that
// cannot be mapped, or on a collection whose version layout differs;
// Handle instead gives each such record its own Result.Err (the relay
// retries, then dead-letters it) and projects the rest. A failed script
// call (a Redis error) fails the batch in Project; in Handle it fails only
// the records of its slot group, with the call's error. A record whose
// value, member or keys are longer than Config.MaxValueBytes (Redis's
// proto-max-bulk-len, 512 MB unless lowered) counts as one that cannot be
// mapped: Redis would close the connection on it, failing every record of
// its call, on every retry.
//
// # Metrics
//
// With Config.MeterProvider set, the projector reports OpenTelemetry metrics
// (verity.projection.*): the gate's verdicts by outcome (applied, duplicate,
// stale, conflict, unknown) and mode (live, shadow), records that failed by reason (map,
// corrupt_version, layout, redis; when a Mapper refuses records, Project
// fails the whole batch but counts only those records, and when one slot
// group's script call fails, only that group's records count as failed
// while the other groups' verdicts and lag are recorded), the gate's
// round-trip time, and verity.projection.lag, the commit-to-visible lag of
// each applied record: the projector's clock at the moment the gate
// answered, minus the record's CreatedAt. CreatedAt is set by PostgreSQL
// (now() of the writing transaction, i.e. its start), so the figure includes
// the writing transaction's own duration, and any skew between the
// database's clock and the projector host's clock shifts it; a negative
// difference (database clock ahead) is recorded as zero. Keep both hosts on
// NTP and read small lags (below the skew) with that in mind. Duplicates
// and stale writes are not in the histogram: they are redeliveries, and
// their lag would measure the retry, not the projection.
//
// # Throughput
//
// BenchmarkGate compares the batched gate with the per-event design (one
// script call per event plus a marker key per event) on identical batches
// of 100 sorted-set events, against a private Redis 7.0 on localhost:
//
//	go test -run '^$' -bench BenchmarkGate -benchtime 2s ./projection
//
// On a 2-core machine shared with other heavy jobs (load average about 15)
// it measured about 65,000 events/s batched against about 19,500 events/s
// with one call per event, and 40,000 events/s when those per-event calls
// are pipelined. The batched gate saves a round trip and a marker key per
// event. On the 3-master test cluster (BenchmarkGateCluster) a batch of one
// collection ran at about 47,000 events/s and a batch of 100 documents, one
// slot each, at about 27,000 events/s. The figures are noisy; the ratio is
// the point.
package projection
