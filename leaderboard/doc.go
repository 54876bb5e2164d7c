// Package leaderboard is a production leaderboard built on verity: scores
// live in PostgreSQL, the source of truth; a Redis sorted set is a read
// model kept honest by the transactional outbox, the projection's version
// gate and the reconciler; and every read says how fresh it is.
//
// # Writing scores
//
// A Board is one leaderboard (a game, a season: "weekly-2026-48"); many
// boards share the same tables and Redis prefix, keyed by name. Boards of
// the same name in different schemas (one per tenant) are different boards:
// the default Config.KeyPrefix includes the schema (except in "public"), so
// they never share a Redis key. A KeyPrefix set explicitly is used as
// given: boards of the same name that share one Redis must then differ in
// it. Migrate creates the tables (score_events, user_scores and the
// outbox), and MigrationSQL returns the board tables' SQL for a migration
// tool; New builds a Board from a pgx pool, a redis.UniversalClient and a
// Config. A board used before Migrate fails with ErrNotMigrated (its
// reads under every ReadPolicy, and its Worker's RunOnce and Drain, too;
// Worker.Run, like the relay's, logs the error and tries again).
//
// Submit applies a Command{EventID, UserID, Delta} and returns the user's
// resulting Score and Version. It costs ONE database round trip: a single
// statement whose data-modifying CTEs record the event, upsert the score and
// append the absolute score to the outbox, all committed together (in
// autocommit the statement is its own transaction). There is no window in
// which the score changed but the outbox row is missing, or the reverse.
//
// Concurrent Submit calls share statements (group commit): a call that finds
// the board's statements busy (Config.SubmitStatements, 2 by default) waits
// for one and is applied together with the calls that arrived meanwhile, up
// to Config.MaxSubmitsPerStatement (64), in one statement, one transaction
// and one WAL flush. A call that finds a statement free goes at once, alone:
// nothing waits for company. Each command keeps its own event record,
// version, result and outbox row, and a shared statement that fails because
// of one command (a reused event id, a score out of range) is replayed as
// one statement per command, all at once, so every caller gets the outcome
// its command would have had alone, and a command that waits for a lock
// holds up no other in its statement. The replays are not bounded by
// SubmitStatements: each takes a pool connection of its own while the pool
// has one free. A command waiting for a row lock (another transaction
// holds the user's row) keeps its connection meanwhile, so as many such
// commands as the pool has connections hold up every other Submit until
// one ends: bound each call's ctx.
// MaxSubmitsPerStatement 1 turns grouping off.
//
// A call that sends its statement itself (it found a statement free and
// nobody queued, or grouping is off) runs it on its caller's goroutine; a
// call that waited for a statement is sent, alone or shared, on goroutines
// of the board's, as are the one-by-one statements that replay a shared
// one that failed, the Notifier's NOTIFY and the lag measurement behind
// the metrics' lag gauge. A panic in code of the application's that pgx
// calls (a tracer, a pool hook) reaches the caller of a Submit that sent
// its own statement; one as its statement runs leaves the board usable,
// but one in pgxpool's Acquire after it has taken a connection
// (TraceAcquireEnd, BeforeAcquire, PrepareConn) loses that connection for
// good, as it would for any caller of the pool. On the board's goroutines
// a panic ends the process, as any goroutine's panic does, and so does a
// panic in the Logger's handler there.
//
// The relays are woken after the commit, not inside it: a pg_notify in the
// statement would make PostgreSQL serialise the commits of concurrent
// submits (it holds a database-wide lock from PreCommit_Notify through the
// WAL flush), which cost 3-4x in throughput. Instead each Board owns an
// outbox.Notifier that sends at most one NOTIFY per millisecond, as its own
// statement, once a submit has returned. If the process dies between a
// commit and that NOTIFY, the relays find the row at their next poll
// (outbox.RelayConfig.PollInterval): the projection is late, nothing is
// lost. Board.Close stops the notifier; it is optional, because the
// notifier's goroutine exits on its own after 100 ms without submits.
// SubmitTx and SubmitBatchTx, whose commit the caller makes, keep the
// pg_notify inside the statement, so the wake-up is delivered exactly when
// the caller commits.
//
// The event id makes Submit idempotent. Submitting it again changes nothing
// and returns the original result with Duplicate set — also when two twins
// race: the loser's statement fails on the event's primary key as a whole
// and Submit answers from the winner's row. Reusing an event id for another
// board, user or delta returns an *IdempotencyConflictError. Event ids are
// unique across boards (the outbox needs them unique). An event id that
// another writer of the same outbox used is refused with
// ErrIdempotencyConflict only while that writer's row is in the outbox
// table; after a relay deletes it, the id is accepted, so give each
// writer's events ids of their own.
//
// SubmitBatch applies many commands in one statement for bulk imports.
//
// SubmitTx runs the same statement inside the caller's transaction (a
// pgx.Tx, or a database/sql *sql.Tx of the pgx stdlib driver through
// outbox.SQLTx), so a score change commits or rolls back with the
// application's own writes. One case differs from Submit: when a twin
// commits while the statement runs, its unique violation aborts the
// caller's transaction, where no follow-up read is possible. SubmitTx then
// returns a *ConcurrentSubmitError (ErrConcurrentSubmit): roll back and
// retry the transaction, and the retry reports Duplicate. No savepoint is
// used: it would cost a round trip per call, and many in one transaction
// overflow PostgreSQL's subtransaction cache.
//
// SubmitBatchTx is SubmitBatch inside the caller's transaction, on the same
// terms as SubmitTx; an out-of-range score aborts that transaction before
// the board can find which command caused it, so its
// *ScoreOutOfRangeError has Index -1.
//
// # Validation
//
// Every refusal writes nothing and has a typed error:
//
//   - EventID: a non-nil UUID (*ValidationError, Field "EventID").
//   - UserID: non-empty, at most Config.MaxUserIDLength bytes (128 by
//     default), valid UTF-8 and free of NUL bytes — the two things a
//     PostgreSQL text column cannot hold. Everything else (spaces, quotes,
//     braces, colons, newlines, emoji) is stored verbatim: SQL only sees it
//     as a bind parameter and Redis keys never contain it (members are
//     values; key names go through internal/keyenc).
//   - Delta: within [Config.MinDelta, Config.MaxDelta], −1000..1000 by
//     default.
//   - The resulting score must stay within [MinScore, MaxScore] = ±2^53,
//     where a Redis score (a double) is exact; this also rules out int64
//     overflow. It is checked by CHECK constraints inside the same statement,
//     so the check and the write are atomic (*ScoreOutOfRangeError).
//   - A user whose version is at int64's largest (only a hand edit or an
//     import can put it there) takes no more commands: each fails with
//     PostgreSQL's not-null violation on column "version", as an error of
//     that command alone, and writes nothing.
//
// # Ordering and ties
//
// The ranking order is: score descending, then user id ascending by bytes.
// Ranks are positions in that order (1-based), so tied scores get distinct
// ranks, the lower user id first.
//
// Redis and PostgreSQL give exactly the same order. The sorted set stores
// the NEGATED score, so its native ascending order (score, then member by
// memcmp) is the ranking order and every read is a plain forward range.
// In PostgreSQL, user_id uses the C collation, whose order is byte order —
// never a locale collation, which would order "B", "a", "ä" differently —
// and an index on (board, -score, user_id) returns every read's rows in
// order. Lua scripts compare members bytewise too (Lua's own string
// comparison uses the server's locale).
//
// # Reading
//
// Top, Page, Rank and Around read the Redis projection and return Entries
// plus a Freshness{Source, ProjectedThrough, Lag, AtLeastMet, Unverified}.
// Page cursors are opaque keyset positions (score, user id): a page starts
// right after the previous one ended, so concurrent updates never make it
// repeat or skip an entry that kept its place, and the same cursor works
// against Redis and PostgreSQL. A cursor is bound to its board (Name, Schema and
// KeyPrefix): another board refuses it with ErrInvalidCursor. (Boards are
// told apart by Schema and Name; see Config.KeyPrefix for what sharing both
// with another prefix does.)
//
// Lag is the age, by the database clock, of the board's oldest outbox row
// not yet projected, pending or dead-lettered (when there is none: zero
// while the measurement is fresh, its age after that, see Freshness.Lag);
// ProjectedThrough is when that row was written — every change committed
// before it is visible. The probe is one small query, reused for
// Config.LagProbeInterval, and cut off after Config.MaxLag or 5 s,
// whichever is longer (a failed measurement: Lag -1), so that a connection
// that stopped answering holds the read that sent it no longer than that,
// and not the next measurement: under any policy, a read whose deadline is
// shorter fails with its context's error meanwhile. It finds the board's oldest pending row by reading pending
// rows oldest first, other streams' included: a backlog
// of another board (or any stream) in the same outbox table makes it
// slower (68-75 ms with 400,000 rows of another board pending, against
// about 1 ms), and a reader's Lag then adds that time, enough to refuse
// FailClosed reads of a board with nothing pending under a MaxLag of a
// few hundred milliseconds. Boards whose Workers may stop for long, or
// that need a tight MaxLag, take an outbox table of their own
// (Config.OutboxTable). A measurement reused for longer, while a slow
// probe is under way, adds its age to the lag, so Lag understates the
// truth by less than LagProbeInterval (more only for a change whose
// transaction was open across the measurement: see Board.SubmitTx). Lag is -1 when it could not be
// measured, which the read policies treat as a lag above MaxLag: the probe
// failed, or it found a change not yet projected dated after the database
// clock (the clock stepped back since the change was written, so neither
// its age nor that of the changes before it is known; logged at most once
// a second). A dead letter of the board counts until it is replayed or
// deleted, or until a newer version of its user has reached Redis (it
// carries the user's whole score, which makes the dead letter moot): the
// dead letter keeps counting while any change of that user is pending, and
// when the user's current version was dead-lettered too. The probe infers
// "reached Redis" from the current version being neither pending nor
// dead-lettered, so deleting a user's newest dead letter by hand also ends
// the count of its older ones: replay or delete them together.
//
// When Lag exceeds Config.MaxLag, Config.ReadPolicy decides: ServeStale
// answers from Redis anyway (the Freshness tells the caller), FallbackToPostgres
// answers from PostgreSQL (also when Redis fails, though not when the
// read's own ctx ended: that read returns ctx's error; a fallback caused
// by a Redis failure is logged at most once a second, see Config.Logger),
// FailClosed returns a *StaleError. A Redis read that meets a score the projection never writes
// (a hand edit: ±inf, a fraction, out of [MinScore, MaxScore]) fails with
// ErrCorruptScore, like Redis failing, rather than answer a garbage score.
// PostgreSQL answers use the same order and ranks; counting a rank there
// reads O(rank) rows (through the index, or a scan when the planner finds
// that cheaper deep in the board), which is why it is a fallback.
//
// Read-your-writes: pass AtLeast(user, result.Version) to a read, once per
// user written (up to MaxAtLeast: the winner and the loser of a match that
// one transaction scored). It waits up to Config.ReadYourWritesTimeout for
// the projection to reach every one of those versions, then applies the
// policy; Freshness.AtLeastMet is true only when the answer reflects them
// all, from Redis (which reads the versions in the script that reads the
// answer: a Redis gone back to an older state since the wait, as after a
// failover that lost the newest writes, meets the policy as an unmet wait
// does) or from PostgreSQL (which checks, in the answer's own statement,
// that they are committed: a SubmitTx whose transaction rolled back, or
// has not committed yet, is not, until a later command of the user
// commits: a version counts the user's committed commands, so a rolled-back
// command's number goes to the user's next one, which then meets it). A
// board whose
// Config.VersionBuckets is not the projection's stored count, or whose
// projection lost its layout key and holds values but no unbucketed
// version hash (the gate then refuses every writer), does not wait: the
// read fails with projection.ErrLayoutMismatch under every policy.
//
// What Lag cannot see: it measures the outbox, so a projection that Redis
// itself lost (a restart without persistence, FLUSHALL, eviction under a
// maxmemory-policy other than noeviction, a failover that dropped
// acknowledged writes) looks current, with Lag zero, until the reconciler
// repairs it. Run the board's Redis with noeviction, and a reconcile pass
// (or Rebuild) after every such event and on a schedule.
// Config.RequireVerifiedProjection closes the first two cases: Board.Verify
// runs a full pass and records in Redis that the projection is complete,
// reads report Lag -1 and Freshness.Unverified while that record is
// missing (looked for at most once per LagProbeInterval, apart from the
// lag probe, so a slow PostgreSQL does not delay it), and a Redis that
// loses its data loses the record with it.
// Losses that keep the record (eviction of some keys, a failover or a
// restart from an older snapshot, a Ring whose shards changed (SetAddrs)
// back to a shard holding an older copy of the board, record included)
// still go unseen until a reconcile pass: rebuild after changing a Ring's
// shards (see package projection).
// With a cluster client that reads from replicas (ReadOnly, RouteByLatency
// or RouteRandomly), the board still reads from the masters, whose lag is
// the one measured, and follows a failover or a resharding there. Such a
// client opens every connection with READONLY, so the board sends its reads
// after READWRITE: a master demoted by a failover the client's slot map has
// not caught up with then answers MOVED instead of serving the read as a
// replica; a MOVED reply has the map reloaded and the read sent again to
// the new master, an ASK reply sends it to the importing master (a read of
// several keys of a slot being migrated may fail instead, with TRYAGAIN or
// the redirect, until the migration is done: go-redis and Redis allow only
// the command right after ASKING there). A master
// that died answers nothing: with any cluster client, whether it reads
// from replicas or not, a read, Verify or reconcile pass that cannot reach
// it fails with its connection error (or the caller's deadline, when that
// is shorter than the client's ReadTimeout; no hidden retry) and has the map
// reloaded, so the calls after it reach the replica promoted in its place
// within seconds of the promotion, not at go-redis's next periodic reload
// (ClusterStateReloadInterval, 60 s by default), the only one go-redis
// makes after a connection error. The Worker's projection gate reloads the
// map after any failed write.
// Sentinel with replica reads (redis.NewUniversalClient with MasterName and
// RouteRandomly or RouteByLatency) builds such a client over servers that
// are not in cluster mode: those reads go to the master Sentinel named, as
// they are (no READWRITE, no MOVED), and a master Sentinel has just demoted
// may serve them as a replica until Sentinel's next answer reaches the
// client. A Sentinel client built with ReadOnly (redis.NewUniversalClient
// with MasterName and ReadOnly, without RouteRandomly or RouteByLatency;
// or redis.NewFailoverClient with ReplicaOnly) is a *redis.Client
// connected to a replica, which New cannot tell from a client of the
// master: a board on it reads the replica, whose own lag behind the master
// Freshness does not measure, and its Worker's writes fail (a replica
// refuses them). Do not give a Board such a client.
//
// Reads send their scripts with EVALSHA_RO (EVAL_RO when Redis lacks
// them), which Redis checks against read key permission only: a process
// that only reads can run as an ACL user allowed to read the board's keys
// (%R~prefix*) and the few commands README lists under Redis permissions.
//
// # A pool on a standby
//
// The lag probe and PostgreSQL answers read the board's pool. A reader
// whose pool is on a streaming standby measures Lag and ProjectedThrough
// against what that standby has replayed: a change the primary committed
// and the standby has not replayed yet is neither pending nor present
// there, so Lag can read 0 and a PostgreSQL answer's ProjectedThrough the
// time of the read while the standby is behind (a paused replay, a
// conflict with a long query under max_standby_streaming_delay, a lost
// connection to the primary). FailClosed and FallbackToPostgres then
// bound staleness by Redis's lag behind the standby, not behind the
// primary. Where the bound must hold against the primary, give the board
// a pool on the primary, or bound the standby's own delay (for example
// pg_last_xact_replay_timestamp() on the standby against the primary's
// clock, or the primary's pg_stat_replication.replay_lag) before reading.
// Authoritative on a standby answers as of its replay too: run payouts
// with a pool on the primary.
//
// # Payouts
//
// Authoritative reads the ranking from PostgreSQL only. Use it, and never
// a Redis read, for prizes, payouts and anything irreversible: the
// projection can lag, lose keys or be edited until the reconciler repairs
// it.
//
// # Keeping the projection honest
//
// Board.Worker returns a Worker — an outbox relay limited to the board's
// stream ("leaderboard:" + name) feeding a projection.RedisProjector with
// the board's Mapper. Delivery is at-least-once; the gate's version check
// makes redeliveries and out-of-order deliveries harmless. A Worker's Run,
// RunOnce and Drain return its relay's errors as they are
// (outbox.ErrRelayRunning for a second concurrent Run, outbox.ErrLeaseLost);
// Run returns nil after a cancellation. Board.Reconciler
// returns a reconcile.Reconciler over the board's rows that classifies and
// repairs missing, stale and corrupt entries (and reports ahead and orphan
// ones); run it on a schedule, and use its Rebuild after a Redis loss.
//
// Config.VersionBuckets (about expected users / 64) stores the per-user
// versions in many small Redis hashes instead of one large one: at 100,000
// users the projection then takes about 125 instead of 162 bytes per user.
// The board's Worker, Reconciler and read-your-writes reads all follow it;
// a worker configured with another count than the stored one is refused
// (projection.ErrLayoutMismatch) and writes nothing, an AtLeast read is
// refused the same way instead of waiting for a version it cannot see, and
// Rebuild migrates a board from one count to another.
//
// # When PostgreSQL goes back
//
// The projection trusts versions to only grow. A PostgreSQL that goes back
// in time breaks that: a failover to an asynchronous standby that had not
// received the last commits, or a restore from a backup. Commits the
// Worker had already projected are then gone from PostgreSQL but not from
// Redis, and the board, fed by the outbox, cannot tell: Lag is zero and
// every read policy serves, for a user whose commit was lost, a score
// PostgreSQL no longer has, or a user it no longer has. New writes of
// such a user reuse the lost versions, so the projection gate answers
// them as conflict or stale (duplicate where the scores happen to match:
// conflicts are logged as warnings, a line a second per Worker) and writes
// nothing until the user's version passes the one in Redis; an AtLeast
// read of such a version is met by the lost score. Nothing is lost beyond
// what PostgreSQL lost, but Redis is wrong until repaired. After such an event:
//
//  1. Let the Worker drain the outbox on the new PostgreSQL.
//  2. Rebuild the projection (Board.Reconciler, then Rebuild;
//     leaderboard-service rebuild), or run a reconcile pass that repairs
//     every class: reconcile.Policy{Ahead: reconcile.ActionRepair,
//     Orphan: reconcile.ActionRepair}. The default policy repairs entries
//     whose version matches with another score, and only reports ahead and
//     orphan ones.
//  3. With Config.RequireVerifiedProjection, run Verify.
//
// While users keep scoring, new writes reuse the lost versions during the
// pass too, and their deliveries are refused as stale until a user's
// version passes Redis's. The repairs take that into account: they look
// each key they took back up again and write what PostgreSQL then holds
// through the gate, and the orphan scan settles a lost user created again
// after the walk passed it.
//
// Config.RequireVerifiedProjection sees the common cases by itself.
// Verify's record names the database it checked the projection against:
// its system identifier, which only a new cluster has (initdb, then a
// logical restore), and its timeline, which a promoted standby or a
// point-in-time recovery starts anew. The lag probe reads both (at most once per
// LagProbeInterval), and once they differ from the record's, reads report
// Unverified (Lag -1: FailClosed refuses, FallbackToPostgres answers from
// PostgreSQL) until Verify records the projection right against the new
// database. A planned switchover starts a new timeline too, with no commit
// lost: reads are unverified after it as well, until Verify. Run Verify
// with a pool on the primary: a record made on a standby cannot tell which
// timeline it checked, and matches no primary. A reader whose pool is on a
// standby knows only a lower bound of the timeline it replays (its last
// restartpoint's, or its minimum recovery point's): after its standby
// starts following a promoted one, its reads may stay verified until its
// next restartpoint (sooner when a page it writes out advances the minimum
// recovery point), which follows the new primary's next checkpoint by
// checkpoint_timeout at most (5 minutes by default). A Verify that finds ahead or orphan entries and leaves
// them (its default policy) deletes the earlier record whichever database
// it names. What keeps the identity, and goes unseen: a server that lost
// acknowledged commits without a failover (a crash under
// synchronous_commit = off); a rollback of the same cluster to a snapshot
// of its disk; a physical copy (a base backup, a standby) started as a
// primary without archive recovery, which keeps both the system identifier
// and the timeline; a pg_dump restored into the same server; and a second
// standby promoted after the first without a shared WAL archive, which
// can pick the same timeline number. After those, follow the steps above.
// A role that may not run any one of pg_control_system, pg_walfile_name,
// pg_current_wal_lsn, pg_control_checkpoint and pg_control_recovery
// (PostgreSQL checks them all, on a primary and on a standby; a revoked
// grant, a managed service without them) has
// its lag measured and Verify run as without the identity, which is then
// not compared, with a warning at most once a second.
//
// Payouts read PostgreSQL (Board.Authoritative), which is right by
// definition, before and after.
//
// # Cost
//
// Measured on a 2-core machine shared with other busy processes (load
// average about 14), PostgreSQL 15 on localhost; figures move with load, so
// the interleaved benchmark runs both handlers in one loop:
//
//	go test -run '^$' -bench SubmitInterleaved -benchtime 400x ./leaderboard
//
//	                      Submit (1 statement)   seed handler (5 statements)
//	durable commit p50    1.8 ms                 2.7 ms
//	async commit   p50    0.20 ms                0.41 ms
//	async commit   p90    0.34 ms                0.90 ms
//
// With a durable commit the WAL flush dominates both; without it, Submit
// costs half the seed's handler. SubmitBatch (BenchmarkSubmitBatch) applied
// 26,500 to 28,700 commands/s in batches of 1,000 and of 5,000 on a 2-core
// VM with no other load, and 37,900 to 44,600 on the same VM in a faster
// phase (2026-12-01 and -02; 7,400 to 14,500 under the load above);
// the statement's time goes to index maintenance (each score change moves
// its ranking-index entry) and the outbox rows. Its event ids are looked
// up one primary-key probe each, so the cost of a batch does not grow
// with the event history, whatever PostgreSQL's statistics say.
//
// The examples/failure-experiment program runs the whole story: a
// duplicated command, a stopped worker, a hand-corrupted score and its
// repair.
//
// # Upgrading
//
// Default key prefix per schema: a board whose Config.Schema is not
// "public" and whose Config.KeyPrefix is unset used to take "verity:lb:",
// the prefix of every schema's boards, so boards of the same name in two
// schemas shared their keys. Such a board now takes "verity:lb:<schema>:"
// (see Config.KeyPrefix) and starts with empty keys, which its Lag
// (measured in the outbox) does not show: run a reconcile pass (or
// reconcile's Rebuild) to rebuild its projection from PostgreSQL right
// after the upgrade. With Config.RequireVerifiedProjection its reads are
// unverified until Board.Verify. Its page cursors issued before the upgrade
// are refused with ErrInvalidCursor (they are bound to the prefix). The old
// keys are left as they were: a board of the same name in "public" keeps
// using them (its reconcile pass reports the other schemas' members there
// as orphans); with none, delete them. Boards in "public", and boards that
// set KeyPrefix, keep their keys.
//
// Verify's record names the database (see "When PostgreSQL goes back"):
// a record made by an earlier release names none and is trusted as before,
// against any database, until the next Verify replaces it; so is one
// without the sorted set's size beside it, while the sorted set holds
// members (records now come with the size, and a record whose size is
// lost, as an eviction can take it, is not trusted; an earlier release's
// record reads unverified while the sorted set is empty, and verified
// again once a new score recreates it, whether the board was verified
// empty or an eviction took its size with the sorted set: run Verify
// after upgrading). Reads with
// RequireVerifiedProjection now read the record with GET (they checked it
// with EXISTS): a Redis ACL user of a reading process needs the get
// command (README, "Redis permissions").
//
// During a rolling deploy old processes project into the old keys while
// new ones read the new, empty keys and, without RequireVerifiedProjection,
// serve them as fresh. To avoid that window, first deploy with KeyPrefix
// set to "verity:lb:" (the old keys; correct only while no other schema
// has a board of the same name). To move to the new default later, run a
// reconcile pass of a Board configured with the new prefix (it fills the
// new keys from PostgreSQL while the old ones serve), deploy the default
// with RequireVerifiedProjection set, and run Verify once no process of
// the old prefix runs a Worker. While both releases run, each one's
// Workers project only into its own keys, and both read a lag of 0: the
// new release's reads stay unverified until that Verify (FailClosed
// refuses them, FallbackToPostgres reads PostgreSQL), but the old release
// serves the entries the new Workers changed, stale, as fresh; stopping
// the old processes before starting new ones avoids that.
//
// Changing Config.OutboxTable: a board's Worker relays, and its Lag
// counts, only the table its Config names. Rows the board left pending or
// dead-lettered in the old table are never projected by the new Workers,
// nor counted in their Lag: reads then serve Redis without those changes
// as fresh, for good. Stop the board's writers of the old table, let a
// Worker of the old table drain it (its Lag 0, no dead letters of the
// board's stream) and only then start the new one; or run a reconcile
// pass (or Verify) with the new table right after the switch. While old
// and new processes run, each one's Lag misses the other's rows. Verify's
// record names the outbox table: with RequireVerifiedProjection, a board
// reads unverified until a Verify with its own table (a record made by an
// earlier release names none and is trusted as before: run Verify after
// the switch).
package leaderboard
