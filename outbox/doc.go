// Package outbox is a transactional outbox for PostgreSQL: projection messages
// are written in the same transaction as the state change they describe, and
// leased relays deliver them, at least once, to a Handler (typically the
// projection package's Redis writer).
//
// The write and the delivery are decoupled on purpose. PostgreSQL is the
// source of truth; a message that committed will be delivered even if Redis,
// the relay or the process is down at commit time, and a transaction that
// rolled back leaves no message behind.
//
// # Quick start
//
//	// Once, at deploy or start-up (idempotent):
//	err := outbox.Migrate(ctx, pool, &outbox.Config{Schema: "app"})
//
//	// Once, at start-up (the error names a bad field):
//	w, err := outbox.NewWriter(&outbox.Config{Schema: "app"})
//
//	// In every command handler, inside the caller's own transaction:
//	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
//		cmd, err := w.RecordCommand(ctx, tx, eventID, outbox.Fingerprint(requestBytes))
//		if err != nil || cmd.Duplicate {
//			return err // duplicate: cmd.Result holds what StoreCommandResult stored, if anything
//		}
//		score, version := ... // update the state row, bump its version
//		return w.Append(ctx, tx, outbox.Message{
//			EventID: eventID, Stream: "leaderboard", Key: userID,
//			Version: version, Payload: encode(score), // absolute state
//		})
//	})
//
//	// In one or more worker processes:
//	relay, err := outbox.NewRelay(pool, projector, &outbox.RelayConfig{Schema: "app"})
//	err = relay.Run(ctx) // until ctx is cancelled
//
// # Schema
//
// Migrate (or the SQL text from MigrationSQL / Migrations, for goose,
// golang-migrate or atlas) creates, in Config.Schema:
//
//   - Table (default "verity_outbox"): one row per undelivered message.
//   - Table+"_dead": messages that failed MaxAttempts times, with the error.
//   - Table+"_idempotency": command ids with their fingerprint and result.
//   - Table+"_leases": one row per partition of the outbox, leased by
//     relays (see "Partition leases").
//
// Indexes are named from Table the same way (Table+"_pending_idx", …).
// Several outboxes may share a schema, so a Table that ends in one of
// these derived suffixes (or in "_pkey", "_event_id_key" or "_id_seq",
// PostgreSQL's names for the outbox's keys and id sequence; Config.Table
// lists them all) is refused with a *ConfigError: outbox "q_dead" would
// otherwise be the dead-letter table of outbox "q", and q's ReplayDead
// would move q_dead's pending messages into q. Upgrading: an outbox whose
// Table ends in such a suffix is now refused by NewWriter, NewRelay,
// Migrate and MigrationSQL; rename it (with its derived tables and
// indexes) or move to a new outbox.
//
// Every identifier is quoted with pgx.Identifier, so schema and table names
// may contain any characters (quotes, semicolons, spaces) without being able
// to inject SQL. The outbox table's columns:
//
//	id           bigint identity primary key   assigned at insert
//	event_id     uuid, unique                  the command's id
//	stream       text, not empty               which projection
//	key          text                          which entity
//	version      bigint, > 0                   entity version of this state
//	payload      bytea                         ABSOLUTE state, never a delta
//	created_at   timestamptz, default now()    finite (migration 006)
//	attempts     integer, default 0            claims so far
//	available_at timestamptz, default now()    not before (retry backoff)
//	leased_until timestamptz, null             row lease of relays before 003
//	claim_token  uuid, null                    row lease of relays before 003
//	last_error   text, null                    last handler error or crash
//	published_at timestamptz, null             set on ack with KeepPublished
//
// Relays of this version never write leased_until and claim_token (they
// lease partitions instead, migration 003) but still honour them, so rows
// claimed by a relay of an earlier version during a rolling upgrade are
// left to it until its lease ends. The reverse does not hold: a relay of a
// version before 003 does not see partition leases, so while relays of
// both run on one table it claims rows a newer relay's batch holds. Such
// rows are delivered twice (the version gate answers the second as a
// duplicate) and the relay that settles second logs that it lost a lease,
// on both sides, until the older relays stop: stop them before starting
// newer ones if either matters. Relays of versions since 003 run together
// without either.
//
// # Composing your own INSERT
//
// Append is one statement for any number of messages, but a caller that
// already writes its state change as a single statement (a CTE that updates
// the score and returns the new version) can insert the outbox row in that
// same statement. The INSERT names only the five message columns; every
// other column has a default:
//
//	WITH s AS (
//	    UPDATE scores SET score = score + $2, version = version + 1
//	    WHERE user_id = $1 RETURNING user_id, score, version
//	), o AS (
//	    INSERT INTO <w.Table()> (event_id, stream, key, version, payload)
//	    SELECT $3, 'leaderboard', user_id, version, <encode score> FROM s
//	    RETURNING 1
//	)
//	SELECT ... FROM s, o, pg_notify($4, 'leaderboard')  -- $4 = w.Channel()
//
// Writer.Table returns the quoted, qualified table name to splice into the
// SQL text (it is safe to concatenate: it is sanitized), and Writer.Channel
// the NOTIFY channel to pass as a parameter; the payload, the rows' stream
// (or empty when they have several), wakes only the relays that serve it.
// Without pg_notify the rows are
// still delivered, at the relays' next poll, or as soon as a Notifier's
// Notify, called after the commit, wakes the relays: leaving pg_notify out
// and calling Notify keeps the notification out of the writing
// transaction, whose commit a NOTIFY serialises with every other notifying
// one (see Notifier). A composed INSERT is the only way to do that: Append
// always runs pg_notify inside the caller's transaction.
//
// The CHECK constraints (version > 0, a stream of 1 to MaxStreamBytes
// bytes, a finite created_at) and the unique event_id hold for composed
// inserts as for Append.
//
// # Lifecycle of a row
//
//  1. Append (or a composed INSERT) adds the row in the caller's transaction
//     and queues a notification; both become visible on commit, neither on
//     rollback.
//  2. A relay claims it: it leases the row's partition (with up to three
//     more that have due rows) until now() + LeaseDuration, stamping each
//     lease row with the batch's token, and reads up to BatchSize due rows
//     of those partitions with a plain SELECT. Free partitions are locked
//     with FOR UPDATE SKIP LOCKED while being leased, so concurrent relays
//     take disjoint partitions. The claim is one round trip and commits at
//     once; no transaction stays open. The outbox row is not written
//     (except the rows a crashed batch left behind, and rows that reached
//     MaxAttempts already, which the claim moves to the dead-letter table:
//     see below).
//  3. The relay calls the Handler with the batch. Its context expires with
//     the lease, measured on this process's clock from before the claim;
//     the lease itself ends by the database's clock, so a step forward of
//     that clock can end it early and hand the rows to another relay while
//     this Handler still runs (this batch's settle then meets
//     ErrLeaseLost, and the gate keeps Redis right; a Handler with
//     effects outside Redis sees the rows twice, at once).
//  4. One statement settles the batch, each part guarded by "the row's
//     partition is still leased to this batch's token": successes are
//     deleted (or marked published_at with KeepPublished); failures get
//     last_error, the attempt count and available_at = now() + an
//     exponential, jittered backoff; a failure on the MaxAttempts-th attempt
//     moves the row to the dead-letter table instead. The same statement
//     releases the partitions.
//  5. Dead letters stay until ReplayDead moves them back (attempts reset,
//     same id), typically after the cause is fixed.
//
// If the relay dies during step 3 or 4 the lease simply runs out and any
// relay leases the partition again. The lease row lists the ids the dead
// relay was given, and the relay that takes the partition over adds one to
// their attempts: an attempt that crashed its process (or hung past its
// lease) still counts, and the row's last_error says so. A row whose
// attempts thereby reach MaxAttempts is moved to the dead-letter table by
// that claim instead of being handed out again, with a last_error saying its
// relay stopped without settling it, so a row that kills every relay
// handling it reaches the dead-letter table after MaxAttempts like any
// failing row. Nothing tells which row of a batch killed its relay: the
// rows that shared the crashing row's batch count each crash too and may
// reach the dead-letter table with it; ReplayDead brings them back. A
// claiming relay buries only rows of the streams it serves
// (RelayConfig.Streams) and only under its own MaxAttempts: a row of another
// stream only has the attempt counted. No relay hands out an attempt past
// its own MaxAttempts, though: a row of its streams that it reads with that
// many attempts counted already (a crash counted by another stream's relay,
// or failures retried by a relay allowing more attempts) is moved to the
// dead-letter table by the claim instead, keeping its last_error. So a row
// is handed out at most MaxAttempts times (not counting releases, which
// count no attempt: those of a RunOnce cancelled while its Handler ran,
// and those of a Run stopped while its Handler ran past ShutdownTimeout;
// a caller that always cancels there, or a process stopped again and
// again while its Handler hangs on a row, hands that row out again and
// again); with relays of different
// MaxAttempts, at most the largest one's, and a relay of a smaller one
// buries, without another attempt, a row that reaches it past its own. A
// row whose id is already in the dead-letter table (possible only after the
// outbox's ids were reset) is handed out again rather than fail the claim,
// and when its last attempt fails it stays in the outbox, retried after
// RetryBackoffMax and logged, rather than fail its batch's settle; delete
// the stale dead letter (ReplayDead skips it: its id is taken) to let it be
// buried.
// A claim that buried every row it read is followed by another at once,
// so a backlog of such rows (a rollout that lowers MaxAttempts while rows
// are retrying) holds up the rows due behind it for no PollInterval, and
// RunOnce, which does not count buried rows, never returns 0 because of
// them. It does return 0 while rows are due in partitions that another
// batch's lease holds: another relay's batch in flight, or a crashed
// relay's until its lease ends (LeaseDuration).
//
// If the Handler outlives its lease and another relay takes the partition
// over, the first relay's settle statement no longer finds its token there:
// it changes nothing for those rows and reports a *LeaseLostError
// (ErrLeaseLost). Run logs it and goes on, claiming again at once when that
// batch was full, as after any full batch. A relay whose lease expired but
// whose partitions nobody took over still settles them: the token is still
// its own.
//
// # Delivery guarantees
//
// Delivery is at-least-once. A row can reach a Handler twice: after a lease
// expiry, after a failed settle statement, or when a batch is retried because
// some of its records failed. Within a partition rows are claimed in
// (available_at, id) order, but two rows of one entity can be handled out of
// order (they may lie in different partitions, which different relays
// handle in parallel; a retried row comes back after newer ones). This is
// why a Message carries the absolute state and a version: the receiving side
// must be idempotent and discard versions older than the one it holds (the
// projection package's version gate does exactly that). The outbox never
// merges, drops or invents messages.
//
// # Partition leases
//
// Every outbox row belongs to one of 64 partitions, mod(id / 256, 64): runs
// of 256 consecutive ids take turns. A relay leases partitions, not rows:
// the claim writes one lease row per partition, reads the partitions' due
// rows with a plain SELECT through an index on (partition, available_at,
// id), and the acknowledgement deletes them. Per-row leases wrote every
// claimed row once more (an UPDATE of claim_token, leased_until and
// attempts) only to delete it moments later, and every claim walked over
// the rows other relays held under live leases before it found free ones;
// a partition claim writes nothing on the rows it hands out (only on the
// rows it moves to the dead-letter table, see "Lifecycle of a row") and
// never visits another relay's partition. A claim leases up to four
// partitions, or, for a BatchSize above 1,024, as many as a batch fills
// when each holds one run (BatchSize / 256 rounded up, plus one for the
// partial runs at a backlog's ends, at most all 64): four runs
// would cap a claim at 1,024 rows on a backlog under 16,384. At a BatchSize
// of 1,024 or less (the default 1,000 included) a claim keeps its four
// partitions, and can hand out fewer rows than BatchSize: it takes the
// partitions claimed least recently, not those of the lowest ids, so the
// partial runs at both ends of a backlog whose ids do not start at a
// run's boundary can be among its four (514 rows when each end holds one
// row, measured), and on ids with gaps (rolled-back inserts, a sequence
// cache) it gets four runs' share of the rows, however few (17-35 rows a
// claim measured on 400 rows over 41,000 ids). Run claims again at once
// when a claim took all the partitions it could, so a short claim costs a
// round trip, never a PollInterval.
// Runs of consecutive ids keep a batch on few heap pages,
// and keep a trickle of new rows in one or two partitions, so that one claim
// finds them all.
//
// What per-row leases gave is kept: leases last one batch (a partition is
// released when its batch is settled, and relays take free partitions least
// recently claimed first), so no relay owns a share of the keyspace, there
// is no membership or rebalancing protocol, a relay that stops simply lets
// its leases run out, and a failing row backs off on its own (its
// available_at moves) without holding its partition. Rows committed late
// with a lower id are not skipped: every claim reads a partition from the
// start of its due range. The partition count caps the relays that can
// drain one backlog at once at 64, far beyond what one database serves.
//
// A claim is three statements sent together (one round trip, one implicit
// transaction): the first takes an advisory lock on the claim's token, so
// that a relay whose claim was cut off can find that transaction and wait
// for its end before releasing what it leased; the second locks and leases
// partitions; the third reads their rows with a snapshot taken after the
// locks, so it never sees rows that the partition's previous holder
// deleted a moment before. It reads
// each partition in index order and stops at BatchSize rows; the claim
// turns bitmap scans off for its own transaction so that the planner cannot
// prefer reading and sorting a whole partition of a deep backlog.
//
// Measured on the development machine (PostgreSQL 15, 2 cores shared with
// other jobs; no-op handler, one relay draining 100,000 rows at the default
// BatchSize, back-to-back runs): a batch of 1,000 rows took 3.2-3.4 ms to
// claim and 1.9-2.2 ms to settle, against 7.1-8.5 ms and 2.2-2.6 ms with
// per-row leases (173,000-190,000 rows/s against 90,000-107,000), and wrote
// 0.6 MB of WAL per 10,000 rows against 3.2-5.1 MB. Of the speed-up, 20%
// comes from full pages: fillfactor 100, where per-row leases needed 50 to
// keep their claim updates HOT. With Redis projection (go run ./examples/benchmark -only drain
// -drain-rows 800000, load average 4-10 from other jobs, per-row leases run
// alternately) four relays drained 3.9-4.0x the seed design's rows/s
// against 2.1-2.5x with per-row leases, and one relay 3.1-4.7x against
// 2.1-2.5x; at the default 200,000 rows, whose rounds last under a second,
// 2.3-3.9x against 1.5-2.7x. PostgreSQL's share of the drain's CPU fell
// from about 90% of a core to about 70%, next to Redis's 35% and the
// relays' process's 25%.
//
// Three other designs were considered. Claiming inside a transaction held
// open while the handler runs (SELECT … FOR UPDATE SKIP LOCKED, handle,
// DELETE, COMMIT) pins a connection and an open transaction (holding back
// vacuum) per in-flight batch, and a hung handler holds its rows until the
// connection dies. Static partition ownership (each relay owns a share of
// the partitions until it leaves) needs a membership and rebalancing
// protocol and lets one slow relay stall its share. Keeping per-row leases
// while moving leased rows out of the scanned index range would turn the
// claim's HOT update into an update of every index.
//
// Upgrading: apply migration 003 (Migrate does; it needs PostgreSQL 14 or
// later) before starting relays of this version; they report
// ErrNotMigrated otherwise. On an existing outbox
// the migration builds the partition index while holding a SHARE lock, so
// appends wait for the build (seconds per million pending rows); to avoid
// that, create the index beforehand with CREATE INDEX CONCURRENTLY under
// the same name and definition (see MigrationSQL), and 003 will keep it
// (if that build failed and left the index invalid, Migrate says so and
// stops: drop it and migrate again).
// Indexes are created only when missing (a DO block checks first, since
// CREATE INDEX IF NOT EXISTS would take the SHARE lock anyway), so running
// Migrate again on a migrated outbox, at every start-up, makes no writer or
// relay wait. Migration 004 indexes the dead-letter table by (stream, id),
// for consumers that look up a stream's dead letters (the leaderboard's lag
// probe); the dead-letter table is normally small, so its build is short.
// Migration 005 bounds the stream to MaxStreamBytes with a CHECK
// constraint (a longer one could not enter that index, so its row could
// never be dead-lettered). Adding it takes an ACCESS EXCLUSIVE lock once
// (NOT VALID: the ALTER scans no existing row), so the first Migrate after
// the upgrade waits for open writers; later ones find it and take no
// lock. Migrate holds that lock until it commits, through 006's update,
// 007's read of the pending rows and 008's index build on the dead-letter
// table: writers and relays wait for them once, O(pending + dead letters)
// (190 ms behind a backlog of a million rows, measured on 2026-12-06; 503
// ms behind 400,000 dead letters). Build 008's index beforehand with
// CREATE INDEX CONCURRENTLY (its name is in MigrationSQL's output) to
// leave only the read of the pending rows.
// Migration 006 likewise refuses a created_at of 'infinity' or
// '-infinity', which time.Time cannot hold, and gives pending rows that
// already hold one the migration's time (the constraint checks the relay's
// updates of them too); relays hand such a row out with a zero
// Record.CreatedAt, and Stats leaves it out of OldestPendingAge.
// Migration 007 moves pending rows appended before 005 with a stream over
// MaxStreamBytes (which 005's constraint would make fail every retry) to
// the dead-letter table, with a last_error saying why; ReplayDead skips
// them. A stream too long even for the dead-letter index makes Migrate
// fail, moving nothing, with a message counting such rows.
// Migration 008 indexes the dead-letter table by (stream, created_at), for
// consumers that look for a stream's dead letters dated after the
// database clock (the leaderboard's lag probe, which otherwise reads all of
// the stream's dead letters on every probe). Every dead letter fits it, as
// it fits 004's index of the same size.
// Migration 001 itself changed in the first hour of this package's history
// (2026-11-30, before any release): an outbox created by that hour's
// commits lacks the leased_until column (every claim then fails with
// SQLSTATE 42703) and keeps a UNIQUE event_id on its dead-letter table (an
// event that dies twice then fails its batch's settle). Migrate does not
// change such tables: recreate them, or add the column and drop that
// constraint by hand.
// Schema, tables, storage settings, constraints and indexes are created
// or changed only when the catalog shows them missing, so Migrate of a
// migrated outbox needs only USAGE on the schema and DML on the tables
// (see Migrate).
// With names free of line breaks and "--", no line inside a statement of
// the migrations ends with a semicolon, so tools that split scripts at such
// lines (goose, without StatementBegin and StatementEnd annotations) apply
// them as they are.
// While relays of both versions run, they do not see each other's leases
// completely (a new relay skips rows an old relay stamped, but an old relay
// may stamp a row of a partition a new relay holds), so some rows may be
// delivered twice during the rollout, which the version gate answers as
// duplicates.
//
// There is no partition filter on relays: static partitions would only buy
// per-key affinity, which the version gate makes unnecessary (a retried row
// breaks per-key order anyway), while RelayConfig.Streams already splits
// work by projection. A relay restricted to some streams leases partitions
// like any other, so while its batch runs, relays of other streams skip
// those partitions.
//
// The outbox is a queue: every acknowledged row is deleted, so the table
// churns through its whole content while staying small, and PostgreSQL's
// default autovacuum trigger (20% of the table dead) lets a large backlog
// pile up hundreds of thousands of dead rows. Their entries stay in the
// indexes until vacuum removes them, and every claim starts at the head of
// its partition's range and walks over them (with per-row leases, measured
// on the single (available_at, id) index that every claim then read): on a 1,000,000-row outbox
// with half of it acknowledged, the first claim took 104-202 ms and read
// about 18,900 buffers, against 3-7 ms normally. Migration 002 therefore sets
// the table's autovacuum options like a queue's: a fixed threshold of 5,000
// dead rows (scale factor 0) and no cost delay, so vacuum keeps pace with
// the deletes. It cannot help while another session's old snapshot still
// sees the deleted rows (a long transaction anywhere in the database); keep
// transactions short on the outbox's database. Nor does it do anything on a
// server with autovacuum = off (some test machines run so; the development
// machine's figures in this package and in examples/benchmark were taken on
// one): there, VACUUM (ANALYZE) the outbox table on a schedule of your own.
// The relays' statements do not depend on statistics for their shape (the
// claim probes the partition index partition by partition whatever the
// planner knows), but without any, the plans PostgreSQL makes for an
// acknowledgement's own ids (its first five on each connection) read the
// whole table; the generic plan it compares them with afterwards probes
// the primary key.
//
// # Non-durable bookkeeping
//
// A batch costs two commits of the relay's own (the claim and the settle),
// and with synchronous_commit on each waits for a WAL flush; under load
// those flushes, not Redis, dominated a batch. Unless
// RelayConfig.DurableBookkeeping is set, both statements therefore commit
// with synchronous_commit = off: the commit returns once its WAL record is
// written to the server's memory, and the WAL writer flushes it within a
// fraction of a second (three times wal_writer_delay at most). The setting
// is made inside each statement with set_config(…, true), so it applies to
// that statement's own transaction only and never to the pooled connection
// afterwards, or to the caller's transactions.
//
// Only a crash of the database server (or a failover to a standby) can lose
// such a commit, and then only the last fraction of a second of them; a
// crash of the relay's process loses nothing. PostgreSQL writes WAL in
// order, so a lost commit is never followed by a surviving one: whatever a
// later durable transaction saw is durable with it. Every loss is one the
// relay already survives:
//
//   - The outbox rows themselves are written by the writer's transaction,
//     with the caller's own durability, so no message can be lost.
//   - A lost claim puts the rows back as they were: claimable again, by any
//     relay, at once or when the previous lease ends.
//   - A lost acknowledgement (or release) leaves the rows claimed; when the
//     lease ends (or sooner: a relay that saw its settle fail ends the
//     lease before its next claim) they are delivered again and the
//     version gate answers duplicate. This is the same re-delivery a relay crash between handling
//     and settling causes, which at-least-once delivery allows anyway, and
//     it counts as such a crashed attempt: a row acknowledged on its
//     MaxAttempts-th attempt whose acknowledgement is lost (or whose settle
//     fails, say on a connection the server dropped) reaches the
//     dead-letter table, although it was handled. ReplayDead delivers it
//     again, and the gate answers duplicate.
//   - A lost retry or dead-letter move leaves the row claimed: when the
//     lease ends the attempt counts as one whose relay stopped without
//     settling it, so the row's backoff is shortened, or it reaches the
//     dead-letter table with that last_error instead of the Handler's
//     error. The dead-letter row and the outbox row are moved in one
//     statement, so both or neither are lost: a message is never in
//     neither table.
//
// What a user can act on stays durable: Writer.Append and RecordCommand run
// in the caller's transaction, and ReplayDead, PruneCommands and Stats use
// the connection's own setting. Set DurableBookkeeping when a re-delivery
// after a server crash is expensive for the Handler or an audit depends on
// an acknowledgement surviving one.
//
// Measured on the development machine (fsync on, load average 12, no-op
// handler, one relay; go test -run '^$' -bench RelayLeased -benchtime
// 20000x ./outbox/): 46,850 rows/s asynchronous against 26,380 durable at
// BatchSize 100, and 67,580 against 34,824 at the default BatchSize 1000.
// With Redis projection and four relays (examples/benchmark -only drain)
// the relay went from 1.35x the seed design's throughput to 3.37x with
// both changes, in back-to-back runs at the same load.
//
// # Waking relays
//
// Append calls pg_notify in the same statement; PostgreSQL delivers the
// notification only when the transaction commits. (A composed INSERT may
// leave it out and wake the relays after the commit with a Notifier.) Each
// running Relay keeps a dedicated connection (opened from the pool's
// configuration, not taken from the pool, running the pool's BeforeConnect,
// AfterConnect and BeforeClose hooks; a hook's failure fails the
// connection, retried like any other) in LISTEN on a channel derived from
// Schema and Table (Writer.Channel), claims as soon as it is notified of
// rows it serves (a payload naming a stream outside RelayConfig.Streams
// does not wake it; an empty one does), and
// reconnects with a growing pause if that connection fails, or if, after
// ListenCheckInterval (10 s) without a notification, it does not answer a
// ping within the same time (a half-open connection fails nothing by
// itself); it claims after each reconnection, since notifications sent
// meanwhile are lost. Relays of one process serving the same table can
// share that connection instead (RelayConfig.Listener, made by
// NewListener): a process running a relay per stream then holds one
// connection outside its pool rather than one per relay (one per outbox
// table: boards in different schemas need a Listener each). Notifications
// are an optimisation:
// a relay also polls every PollInterval, which picks up rows whose backoff or
// lease ran out and covers any lost notification. When rows it could take
// are due in partitions another relay's batch holds (that relay serves
// other streams, or its batch is full), or that another relay's claim had
// locked at that instant, it claims again after a pause of
// 100 ms, doubling up to 2 s (or PollInterval if shorter), jittered, while
// they stay held. The end of a batch notifies the streams of rows it
// leaves for others: rows released at shutdown, and, for a relay
// restricted to some streams, the stream of the first other stream's row
// due among the 32 rows after its own batch in each partition it releases
// (that row's relay, if it is restricted too, then announces the next the
// same way), and, of the streams whose rows there have been due for more
// than 2 s (rows nobody took: their relay is not running or does not
// listen), the youngest row's and one picked at random, so that a busy stream holding a
// partition again and again does not keep a quiet stream's row there
// waiting. Rows deeper behind a backlog, or behind a row nobody takes for
// less than 2 s, wait for their relay's pause; and while another stream's
// relay works through a backlog of its own in that partition, claiming it
// again at once after each full batch, the partition is free only between
// two of its batches, which those pauses rarely hit: such a row can wait
// for most of that backlog (measured: a row 200 rows behind a stream whose
// relay failed every 800 ms batch of 20 waited about 8 s).
// After a full batch (rows
// its claim moved to the dead-letter table count toward it) it claims again
// at once. After a database error it pauses before claiming
// again, 100ms doubling up to ReconnectBackoffMax; notifications do not cut
// that pause short. Behind a transaction-pooling proxy, set DisableNotify
// and rely on polling: there LISTEN lands on whichever server connection
// the proxy picks, whose notifications the proxy drops. A LISTEN
// connection (a relay's own, or a Listener's) finds that out: after each
// LISTEN it also listens on the channel verity_listen_probe and sends a
// notification there through the pool, and if that has not come back
// within ListenCheckInterval (5 s at least) of being sent it counts as
// failed, logged at Warn (to the relay's Logger, or the Listener's) with a
// message naming DisableNotify; relays sharing a Listener must drop it
// too, which DisableNotify refuses. The text-format exec modes such a proxy needs
// (pgx.QueryExecModeExec, QueryExecModeSimpleProtocol) parse timestamps
// and bytea only in PostgreSQL's default DateStyle (ISO) and bytea_output
// (hex). A claim, and DeadLetters, set both for their own transaction, so
// relays work whatever the session's settings (PgBouncer refuses
// bytea_output as a connection parameter, and keeps another client's
// plain SET on the server connection). RecordCommand and
// StoreCommandResult, which run in the caller's transaction and so set
// nothing, read the fingerprint, the result and the time as hex text and
// microseconds, which no setting changes.
//
// The relay's claims and settles are written for READ COMMITTED,
// PostgreSQL's default: give it a pool that runs at that level (with a
// role whose default_transaction_isolation is stricter, set
// ConnConfig.RuntimeParams["default_transaction_isolation"] to "read
// committed"), or claims and settles racing each other fail with
// serialization errors and are retried: a claim at the next poll, a settle
// at once, up to five runs of its statement (as after a deadlock, or a
// lock wait past a lock_timeout the pool's sessions set), after which the
// batch is left unsettled as after a crash: the relay's next claim ends
// its leases, and the attempt counts.
//
// # Idempotent commands
//
// RecordCommand stores the command's event id and fingerprint in the
// caller's transaction. The primary key makes concurrent twins wait for each
// other: the second sees the first's outcome once it commits (Duplicate,
// with the stored result) or records the command itself if the first rolled
// back. The same id with a different fingerprint is a client bug and returns
// *IdempotencyConflictError without writing anything. StoreCommandResult
// keeps the first result stored for an id: the same bytes again are
// accepted, different ones are a *CommandResultConflictError, and nothing
// is written. PruneCommands removes old records; a command whose record it
// removed before RecordCommand's insert is recorded anew at any isolation
// level, even when the transaction's snapshot still sees the old record.
// One whose record it removes after the insert found it is recorded anew
// in READ COMMITTED (RecordCommand retries its insert, and gives up with
// ErrCommandRecordDeleted, writing nothing, only if the record is deleted
// again after each of three), and is a duplicate under REPEATABLE READ or
// SERIALIZABLE, whose snapshot still sees the record.
//
// # Monitoring
//
// Relay.Stats returns Pending, InFlight, Retrying, OldestPendingAge and
// DeadLetters in one statement. OldestPendingAge is an O(1) probe of a partial
// index and is the figure to alert on. The three backlog counts are exact and
// cost one pass over the pending rows, O(pending); DeadLetters costs O(dead
// letters). Measured (same machine, go test -run '^$' -bench Stats
// -benchtime 1000000x ./outbox/): 0.56 s per call with 1,000,000 pending
// rows. Poll Stats every few seconds, not per request.
//
// With RelayConfig.MeterProvider set, the relay reports OpenTelemetry
// metrics (verity.outbox.*): counters of claimed, acknowledged, retried,
// dead-lettered, released and lease-lost rows and a histogram of handler
// durations, all attributed to the outbox table. While Run runs it also
// reports the Stats figures as gauges. Scrapes never query the database: Run
// refreshes a snapshot every StatsInterval (each Stats call also refreshes
// it), and a snapshot older than two intervals is not reported, so the
// gauges of a stopped relay (or one whose refreshes fail) disappear instead
// of freezing; a refresh is cut off after StatsInterval or 5 s, whichever
// is longer, so one stuck on a connection that stopped answering does not
// hold up the next. Writer.Append
// records nothing: it runs in the caller's transaction, which may still roll
// back.
//
// # Shutdown and cancellation
//
// Run returns after its context is cancelled: it claims nothing more, waits
// up to ShutdownTimeout for the in-flight batch and settles it; past the
// timeout it cancels the Handler's context and releases the rows the Handler
// did not complete, for immediate re-delivery by another relay (a release is
// not a failure and sets no backoff). Run waits for its own goroutines (the
// listener, the metrics' Stats refresh) before returning; a LISTEN or Stats
// statement under way gets the same grace as the batch. Every database call
// honours its context. A claim cut off by its context (or a broken
// connection) may still be running on the server and commit, or not have
// reached it yet; the relay then ends the claim connection's backend,
// cancels the claim there, waits for its transaction to end and frees what
// it leased (bounded by a few seconds), so its partitions are not left to a
// lease nobody holds. A release the database could not answer (a crash
// that lost the claim's answer after its commit) is tried again before
// each later claim until the lease would have ended, so the rows are
// delivered again as soon as the database is back. Behind PgBouncer, whose backend process IDs are keys
// of its own, or under a SET ROLE whose role may not signal the login
// role's backends (as for the cancel), a claim still on its way when it
// was cut off is not stopped: it may lease its partitions after the
// release, until the lease ends.
//
// ShutdownTimeout bounds the Handler, not Run: the settle that follows
// (acknowledging what the Handler completed, releasing the rest) runs on
// its own bound of 10 s, its wait for a pool connection included (outside
// a shutdown it may take until the batch's lease ends, if that is later,
// so that a busy pool does not turn a completed batch into a crashed
// attempt), and a cut-off claim's release on one of 5 s, so
// against a database that stops answering Run can return up to about
// ShutdownTimeout + 15 s after its context ends. Size a termination grace
// period to that, plus whatever a Handler needs to notice its cancelled
// context. go-redis does not end a command in flight on cancellation, only
// at its connection's deadline, so a RedisProjector's command ends the
// client's ReadTimeout after it was sent (up to its WriteTimeout more
// while Redis stalls the sending) or, for a client with
// ContextTimeoutEnabled, at the Handler context's deadline if that comes
// first: the end of the claim's lease (LeaseDuration, counted from just
// before the claim was sent). NewRedisProjector refuses a client with
// neither bound. The settle is not cut shorter on purpose: a
// settle cut off leaves its rows leased, and the next claim counts that as
// a crashed attempt, which at MaxAttempts dead-letters rows the Handler
// completed or never saw.
//
// Run does not cut off a claim it has sent: the claim is part of the batch in
// flight. A statement cut off by its context (RunOnce's, or any at
// ShutdownTimeout) makes pgx close that connection in a goroutine of its
// own, which pgxpool's Close waits for. Over TLS, when the cut falls between
// two of a statement's writes, pgx (v5.12) cannot send its goodbye on the
// broken TLS stream and waits out its 15 s deadline, and pool.Close with it.
//
// # database/sql
//
// Writer methods take the narrow Tx interface, which pgx.Tx satisfies. SQLTx
// adapts a *sql.Tx opened with the pgx stdlib driver
// (github.com/jackc/pgx/v5/stdlib). A *pgxpool.Pool, or a *pgx.Conn or
// *pgxpool.Conn outside a transaction, satisfies Tx too, and is refused
// with a *ConfigError (Field "tx") before anything is written: its
// statements would each commit on their own, so a command could be recorded
// as done while a crash lost its effects, and every retry would then be a
// duplicate. A connection on which the caller ran BEGIN is a transaction.
//
// # Errors
//
// Bad input and bad configuration get typed errors (*MessageError,
// *ConfigError) before anything is written. Sentinels for errors.Is are
// listed in one var block: ErrInvalidConfig, ErrInvalidMessage,
// ErrEventIDExists, ErrIdempotencyConflict, ErrCommandRecordDeleted,
// ErrCommandNotRecorded, ErrCommandResultConflict, ErrLeaseLost,
// ErrHandlerContract, ErrRelayRunning, ErrNotMigrated. Statement errors
// keep the driver's error: ErrEventIDExists (from Append and ReplayDead)
// wraps the unique violation, so errors.As reaches its *pgconn.PgError. A
// Schema beginning with "pg_" (reserved by PostgreSQL) is refused with a
// *ConfigError by NewWriter, NewRelay, NewListener, Migrate and
// MigrationSQL.
package outbox
