// Package reconcile finds and repairs drift between a source of truth in
// PostgreSQL and the Redis projection that the projection package's version
// gate maintains.
//
// Idempotency is not repair. The gate makes redelivered and reordered outbox
// messages harmless, but nothing in it notices a key that Redis evicted or
// lost in a failover, a member someone edited by hand, a buggy writer, or a
// row deleted from the source. A cache that is rebuilt only at start-up and
// never checked again serves wrong answers until the next restart. This
// package checks, on a schedule you choose, and puts things right.
//
// # Classes
//
// Every source row is compared with what Redis holds for it, and every
// projection entry is looked up in the source, giving one Class each:
//
//	current   same version, same value
//	missing   nothing projected (lost key, eviction, never projected)
//	stale     projected version lower (the outbox is lagging, or a write was lost)
//	ahead     projected version higher than the source's
//	corrupt   same version but another value or none; a value without a
//	          version; a version the gate would not have written (a
//	          version without a value that is lower or higher than the
//	          source's is stale or ahead)
//	orphan    projected, but absent from the source (or outside its filter)
//
// Classify is the pure function behind this, usable on its own.
//
// # Repairs
//
// By default missing, stale and corrupt entries are repaired; ahead and orphan
// entries are reported and Config.OnAlert fires, because Redis knowing more
// than the source can mean that the source read was stale (a lagging replica,
// the wrong database) rather than that Redis is wrong. Config.Policy opts in
// to forcing them (ActionRepair) or turns any repair off (ActionReport).
// Config.BeforeRepair can veto single repairs and Config.AfterRepair observes
// them; RunOptions.DryRun writes nothing at all.
//
// Every repair is a compare-and-set, so a repair can never regress a newer
// write that lands between the read and the repair:
//
//   - missing and stale entries are written through projection.Gate.Apply:
//     a gate write of a newer version made meanwhile makes the gate answer
//     stale (duplicate or conflict for the same version), and nothing is
//     written;
//   - corrupt, ahead and orphan entries are overwritten or removed by a Lua
//     script that acts only if the stored version and value are still
//     exactly those that were read.
//
// Ahead and orphan repairs take an entry back (or remove it), so once they
// are done the run looks their keys up in the source again and writes what
// it holds through the gate: a write committed after the confirming
// lookup (after PostgreSQL went back, a new write reuses a lost version)
// was delivered against the entry's higher version and refused as stale,
// and would otherwise stay behind the repair's older state with nothing in
// the outbox to correct it.
//
// A declined repair is reported as ResultRaced; the next run looks again.
// So is a repair the Redis client resent by itself after Redis ran it (a
// connection dropped before the reply; go-redis retries up to
// Options.MaxRetries times): the resend finds the repaired state, not the
// one read, and declines, so the repair was written but reads as raced.
//
// The classes a write racing the check could fake are looked at again
// before anything is alerted or repaired, so a write committed and
// projected during a check is not taken for drift:
//
//   - a source row is read before its Redis entry, so an ahead finding's
//     key is looked up in the source again and classified against the
//     fresh row (a newer write makes it current or stale; a deletion makes
//     it an orphan);
//   - a collection's values and versions are read by two commands of one
//     pipeline, which a gate write can land between; a corrupt finding is
//     read from Redis again and classified by the fresh read if it
//     changed. A finding one check turns into the other's class (a torn
//     read looks ahead, and against the fresh row corrupt) is checked
//     again, a few rounds at most;
//   - for orphans, the entries the source lacks are read from Redis and
//     looked up again, and the removal insists on the state read before
//     that confirming lookup: an entry created after the read changes it,
//     and the removal declines. The entries the scan's lookups find in
//     the source are read from Redis again, and those it holds ahead of
//     their row, or with another value at its version, are settled as a
//     page's findings are: an entity created again after the walk passed
//     it, at a version Redis still holds (after PostgreSQL went back),
//     reads as ahead, not as nothing. Those a write landed on meanwhile
//     (current, or behind their row, once looked up again) belong to the
//     walk and the outbox, and are not counted twice.
//
// Those lookups see a write committed since the page was read only if the
// source takes a fresh snapshot per statement: a pool does; a REPEATABLE
// READ or SERIALIZABLE transaction does not, so through one, a run whose
// policy repairs missing, corrupt, ahead or orphan entries (the default
// policy repairs missing and corrupt ones) is refused (a key Redis lost, or
// a value whose version it lost, would be written back at the snapshot's
// older version): only a dry run, or one repairing stale entries alone
// (up to the snapshot's version, never back), goes ahead; and Rebuild
// refuses to run (see DBTX).
// A custom Source whose lookups read an old snapshot must not be run with
// those repairs, nor rebuilt from.
//
// Missing and stale entries are not looked up again: a row deleted from the
// source after its page was read may be written back, as a relay delivering
// the row's last outbox record would write it, and the next run reports it
// as an orphan.
//
// # Runs
//
// Reconciler.Run walks the source by keyset pagination (WHERE key > $last
// ORDER BY key LIMIT n; never OFFSET, which rescans every skipped row and
// skips or repeats rows when the table changes). Each page costs one
// PostgreSQL query and one Redis round trip (pipelined):
//
//	sorted set   ZMSCORE of the values, HMGET of the version hash
//	hash         HMGET of the values,   HMGET of the version hash
//	  with version buckets: one HMGET per bucket the page touches instead
//	  of the one HMGET
//	collections  MGET of the layout key, EXISTS of the value key and of
//	             the unbucketed hash (see "Version buckets" below)
//	documents    one MGET of values and versions per Cluster slot (per
//	             hash tag on a Ring)
//
// With a cluster client that sends reads to replicas (ReadOnly,
// RouteByLatency or RouteRandomly), the reconciler still reads on the
// masters: a replica's replication lag would show as drift. Such a client
// opens every connection with READONLY, so the reads go after READWRITE, and
// a master demoted by a failover answers MOVED instead of serving them as a
// replica. A master's own connection does not follow redirects, so a run
// (Run or CheckKeys) that meets a slot move (a MOVED reply: a failover, or
// a resharding the client's slot map has not caught up with) has the map
// reloaded, waits up to two seconds for it to name the new master and runs
// once more, still on masters; a Rebuild's
// reads follow the move the same way. A run that meets a slot in the middle
// of a migration (ASK), or a map that does not catch up, fails, and can be
// run again. A master that died sends no redirect: with any cluster client,
// a Run, CheckKeys or Rebuild that cannot reach a node fails with its
// connection error (or the caller's deadline, when that is shorter than the
// client's ReadTimeout) and has the map reloaded, so that the next one reaches
// the replica promoted in its place within seconds, not at go-redis's
// next periodic reload (ClusterStateReloadInterval, 60 s by default).
// Document reads and compare-and-set repairs of several slots go out in
// one pipeline that go-redis does not send again whole (so that a command
// it follows a redirect of runs once; see the projection package's
// resharding notes): a connection cut under it fails the run, its repairs
// on that node ResultUncertain, where go-redis would otherwise have sent
// the batch again.
// Sentinel with replica reads (redis.NewUniversalClient with MasterName and
// RouteRandomly or RouteByLatency) builds such a client over servers that
// are not in cluster mode: those reads go to the master Sentinel named, as
// they are (no READWRITE, no MOVED), and a master Sentinel has just demoted
// may serve them as a replica until Sentinel's next answer reaches the
// client.
//
// A full run pipelines the pages: up to Config.ReadAhead pages (4 by
// default) are read at once, counting the one being classified and
// repaired, so Redis, which executes commands on one thread, stays busy
// instead of waiting for the client; ReadAhead 1 reads one page at a time.
// Each page's Redis read follows its source read at once, so the two see
// nearly the same moment. Pages are still classified, repaired and
// reported in source order. Repairs of a page go out in one more round
// trip, two when the page has both missing or stale entries (written
// through the gate) and others (written by the compare-and-set script).
// Memory is proportional to Config.PageSize times Config.ReadAhead,
// not to the table: a 1,000,000-row pass runs in a few MiB. The one
// exception is kept for the orphan scan, which must not count an entry
// twice: a key per entry found ahead or corrupt, or missing or stale
// whose repair raced, was cut off or refused unsent (ResultNotAttempted)
// or went unanswered (ResultUncertain), held by the Report (tens of bytes
// each; a whole table found ahead, after a restore from an older backup,
// keeps one per row). A missing or stale entry left as found on purpose (a
// dry run, a report-only policy, a veto) keeps none.
//
// After the source, a full run looks for orphans. For a collection it first
// compares counts (HLEN of the versions — of every bucket, pipelined —
// and ZCARD or HLEN of the values) with the entries the pass accounted
// for: when they match, which is the usual case, there is nothing to scan
// (Report.OrphanScanSkipped). Otherwise it scans the projection (HSCAN of
// the version hash or of every bucket, pipelined, ZSCAN/HSCAN of the
// values, or SCAN on every master for documents) and looks the entries up
// in the source in batches. The documents' SCAN needs a *redis.Client or
// *redis.ClusterClient: on a Ring, which it cannot cover, New refuses a
// document Target unless Config.SkipOrphans is set. Documents are matched
// by Target.Namespace (a DocumentMapper's namespace): a reconciler sees
// only its own stream's documents, not those of other streams projected
// under the same prefix.
//
// RunOptions.Sample checks random samples instead, which is cheap on large
// tables: source rows through Source.Sample (SQLSource uses TABLESAMPLE
// SYSTEM and documents the bias that implies) and, for collections,
// projection entries through HRANDFIELD for orphans (with version buckets,
// HRANDFIELD of randomly drawn buckets: uniform as far as hashing fills the
// buckets evenly).
//
// # Version buckets
//
// A projection written with version buckets (projection.Config.VersionBuckets,
// projection.Keyspace.WithVersionBuckets; see the projection package for
// why) must be reconciled with a Target.Keyspace of the same bucket count.
// Every read checks the collection's stored layout, and every repair checks
// it again atomically where it writes (the gate for missing and stale
// entries, repair.lua for the rest): on a mismatch Run, CheckKeys and
// dry runs return *projection.LayoutMismatchError (errors.Is
// projection.ErrLayoutMismatch) and write nothing, because versions looked
// up in the wrong buckets would all look absent. The keys involved, for a
// collection with tag T under prefix P:
//
//	P T:z / P T:h            values
//	P T:zv / P T:hv          versions without buckets
//	P T:zv:<b> / P T:hv:<b>  versions in bucket b (0 ≤ b < B)
//	P T:z~layout             B, recorded for every collection (0
//	                         included) by its first write; see below
//	… ~r                     each key's rebuild shadow
//	P T:z~rebuild            a running rebuild's marker (its token)
//	P T:z~rebuild~copied     what its copy wrote, checked at the switch
//	P T:z~rebuild~switched   the token of a rebuild that switched, kept
//	                         briefly so a resent switch answers "switched"
//
// Rebuild is the migration to another bucket count, 0 included: give it a
// Reconciler whose Target.Keyspace has the new count. It records the new
// layout for the shadow keys when it sets the marker, fills the shadows in
// that layout (live writers still on the old count dual-write into them
// too — the gate learns the shadow layout from the script and retries that
// slot group once), and its switch removes every version key of the old
// layout, renames the shadows — values and every bucket — over the live
// keys and sets the layout key to the new count, in one script. From then on writers and
// readers configured with the old count are refused with
// ErrLayoutMismatch; redeploy them with the new count. A relay's refused
// records count as failed attempts: they are retried with the relay's
// backoff until its MaxAttempts, then moved to the dead letters (with
// outbox's defaults, four to eight and a half minutes after the switch),
// which outbox.Relay.ReplayDead moves back once the relays run the new
// count.
//
// Without a layout key, the gate's rule applies here too: an empty
// collection fits any count (the first repair written records the
// reconciler's), and one with the unbucketed version hash was written
// before layout keys were recorded and has 0 (a repair records it). Values
// with neither mean the layout key was lost (a hand DEL, an eviction): the
// bucket count is unknown, so the gate refuses the collection's writers,
// and Run and CheckKeys refuse it too (*projection.LayoutMismatchError
// with Stored -1), rather than read every entry as corrupt and overwrite
// versions that may be ahead of the source. Set the layout key to the true
// count, or Rebuild: since the old count is unknown, its switch removes the
// version keys of every possible bucket. An unbucketed collection that
// only loses its version hash keeps its layout key 0, so its entries
// classify as corrupt and are repaired from the source.
//
// A run returns a Report: rows checked, entries scanned, counts per class,
// what was done (repaired, skipped, uncertain, and why), the duration, and
// the first few findings per class. When the context is cancelled, Run
// stops and returns the partial Report with the error. No repair goes
// unreported: repairs already sent are completed on a detached context and
// counted, repairs not yet sent are ResultNotAttempted, and a repair that
// may or may not have been applied is ResultUncertain.
//
// # Keys of another type
//
// A key holding another Redis type than the projection keeps there (a hash
// where a document's value belongs, left by a hand edit or another
// program) is reported, not repaired, whichever way its repair is sent
// (a compare-and-set script, or the gate: below). A
// document whose value or version key holds another type reads as having
// none, so it usually looks corrupt (or missing or stale: below);
// its compare-and-set repair checks the types of its keys before it reads
// or writes them and is refused with nothing written (ResultNotAttempted),
// while the other repairs of the same script call are applied. The run
// goes on through the other pages and the orphan scan, and Run (or
// CheckKeys) returns one *WrongKeyTypeError (projection.ErrWrongKeyType)
// per refusal, joined, with the whole Report; leaderboard's Board.Verify
// therefore records nothing. Delete such a key by hand, and the next run
// repairs the entity from the source.
// Documents cannot be rebuilt (ErrRebuildUnsupported), so for them that is
// the only remedy. A collection whose value key or version hash holds
// another type fails the run when it is read (WRONGTYPE); delete the key,
// or Rebuild the collection. A document that reads as missing or stale
// (its version key absent, or holding an older version, and its value key
// of another type, which reads as absent) is written through the gate,
// like the relay's writes, and the gate refuses a value or version key of
// another type as repair.lua does, with nothing written for that document
// (the page's other gate repairs are sent again; any the first call had
// applied then count as raced). Keep other programs' keys out of the
// projection's prefix.
//
// # Rebuild
//
// Reconciler.Rebuild replaces a whole collection (sorted set or hash) with
// the source's state, without readers ever seeing it empty or half built:
// it sets the collection's rebuild marker (clearing old shadow keys in the
// same script), copies the source into shadow keys with the gate's rule,
// and then, in one script, renames the shadow keys over the live ones if
// the marker is still its own and the shadow holds every row the copy
// wrote. While the marker exists, the gate writes every update to the
// shadow keys as well, so updates made during the rebuild are not lost.
// Each copy page is counted in the script that writes it, so if Redis
// loses some of the copy but keeps the marker (a failover to a replica
// that missed later pages, a restart from a snapshot taken mid-copy), the
// count falls short of the rows sent and the rebuild aborts
// (ErrRebuildAborted) instead of switching a partial projection in. So it
// does when the shadow keys hold fewer members or versions than rows
// sent, or than the gate created there (every write into the shadow, the
// copy's and the dual-written live ones, counts the members and versions
// it creates), whatever the count says: an allkeys-* eviction can take a
// shadow key and leave the count, and new members dual-written after it
// would otherwise make up the numbers (the source's keys must be unique,
// as for Run). Each
// step may be resent by the Redis client after Redis ran it (go-redis
// retries a command whose connection dropped before the reply): a resent
// start finds its own marker and succeeds without clearing anything, a
// resent copy page is counted once, and the switch leaves its token
// behind briefly so that a resent switch answers "switched" rather than
// "marker gone". All keys share the collection's hash tag, so this
// works on Redis Cluster. Given a Keyspace with another version bucket
// count than the collection's, Rebuild migrates it (see "Version buckets").
//
// A Rebuild whose process dies mid-copy (SIGKILL, an OOM kill) never runs
// its abort. Its marker expires after Config.RebuildMarkerTTL and the gate
// stops dual-writing, but what the copy wrote has no TTL: the shadow values
// (P T:z~r or P T:h~r), the shadow versions (P T:zv~r, or P T:zv:<b>~r for
// every bucket b below the shadow layout's count; P T:hv… for a hash), the
// copy count (… ~rebuild~copied) and the shadow layout (… ~layout~r) stay,
// up to doubling the collection's memory on a noeviction Redis, until the
// next Rebuild of that collection starts: its start clears them. To free
// the memory sooner, DEL those keys by hand while no Rebuild of the
// collection runs (its marker P T:z~rebuild is absent); read the shadow
// layout's count before deleting it.
//
// # Metrics
//
// With Config.MeterProvider set, every Run, CheckKeys and Rebuild records
// OpenTelemetry metrics (verity.reconcile.*) once, from its finished report:
// entities by class, findings by what was done about them, repairs by class,
// run durations and rebuild outcomes. They therefore add up exactly like the
// Report. Alert on any class other than current, and on ahead or orphan at
// all: the policy does not repair those by default.
//
// # Performance
//
// Measured on a shared 2-core machine against local PostgreSQL 15 and Redis
// 7.0 (figures vary with load; run them yourself). Version buckets make a
// pass slower: a page of 1,000 keys touches up to 1,000 buckets, so it
// costs up to 1,000 small HMGETs instead of one large one (a script doing
// one HGET per key was slower still, 211,000-285,000 and
// 105,000-116,000 rows/s in the two runs below). That is the price of the
// buckets' memory saving; reconciliation is background work.
//
//	go test -run XXX -bench . -benchtime 3x ./reconcile       (20,000 rows)
//	  Reconciler, full dry-run pass        ~175,000-240,000 rows/s
//	  keyset + pipelined hand loop         ~260,000-440,000 rows/s (no classification, no report)
//	  SELECT all + ZSCORE/HGET per row       ~5,000 rows/s
//	  Rebuild (shadow copy + switch)        ~80,000-90,000 rows/s
//	go test -run XXX -bench CheckBuckets -benchtime 3x ./reconcile   (full pass, orphan count check)
//	  one version hash                      ~395,000-476,000 rows/s
//	  313 version buckets (rows / 64)       ~282,000-328,000 rows/s
//	VERITY_BENCH_ROWS=200000, 3,125 buckets  ~310,000-335,000 vs ~134,000-161,000 rows/s
//	go run ./examples/benchmark -only reconcile   (200,000 users, load 3-4)
//	  3,125 version buckets: 0.34-0.54x the one-hash pass (0.48-0.61x on 2026-12-01, load 1-2)
//	VERITY_TEST_MILLION=1 go test -run TestMillionRows -v ./reconcile
//	  1,000,000 rows, 1,000 repaired        8.2 s (~120,000 rows/s), peak heap ~5 MiB
//	  the same with a forced orphan scan    20.8 s
//
// # Sources
//
// A Source pages through (key, version, absolute value) rows, samples them,
// and looks keys up. SQLSource implements it over one PostgreSQL table,
// optionally filtered (Filters, for example a board column), with every
// identifier quoted. New refuses an SQLSource whose Kind differs from the
// Target's (*ConfigError, Field "SQLSourceConfig.Kind"): its repairs would
// write the other kind's values. A custom Source's rows must carry the
// value form the Target's Kind expects.
//
// The orphan scan looks every projection entry up in the source, so a
// member the source's key column cannot hold is an orphan found through
// Lookup. SQLSource drops a key no PostgreSQL text parameter can carry
// (invalid UTF-8, a NUL byte) without querying. A SQL_ASCII database is
// the exception: it can hold keys that are not UTF-8. A session whose
// client_encoding is SQL_ASCII too (pgx's default there) sends them as
// they are, and they are looked up like any other. One that declares
// another client_encoding can neither read nor send them: a pass that
// meets such a row stops with PostgreSQL's error (22021: the server
// refuses to send it), and a lookup of such a key with an
// *InvalidRowError, rather than take its entry for an orphan. A key PostgreSQL rejects
// for the column's type ("user:42" for a bigint column, or a value a
// domain's CHECK refuses) makes it reject the
// whole batch: SQLSource then bisects the batch until each rejected key
// stands alone, about two failed statements per such key (each twice per
// pass, for the orphan scan confirms its lookups), every one an ERROR in
// the server's log, and casts the lone key on its own to be sure: a row
// that fails the same way for another reason (a view whose value
// expression fails for it) exists, so Lookup returns its error instead of
// leaving it out to be taken for an orphan. If the projection may hold
// many such members, give the
// table a key column of a text type, or write a Source whose Lookup leaves
// out keys its column cannot hold.
package reconcile
