package outbox

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/verity-go/verity/internal/deps"
	"github.com/verity-go/verity/internal/lograte"
)

// settleTimeout bounds the statement that acknowledges, retries, buries and
// releases a batch, with its wait for a pool connection; outside a shutdown
// they get until the batch's lease ends, if that is later (a settle cut off
// by a busy pool leaves rows the Handler completed to be counted a crashed
// attempt), and a shutdown that begins meanwhile leaves them settleTimeout
// from then at most (see settleWithin). It runs on a context detached from
// cancellation, so that work finished during shutdown is still recorded.
const settleTimeout = 10 * time.Second

// maxErrorLength bounds the handler error text stored in last_error.
const maxErrorLength = 4096

// Relay delivers outbox rows to a Handler. It leases partitions of the
// outbox and reads their due rows in one round trip, calls the Handler with
// no transaction open, and settles the batch (acknowledge, retry later, or
// dead-letter) in one more statement that only touches rows of partitions
// its lease still holds, and releases them. Any number of relays, in any
// number of processes, may serve the same outbox.
//
// Run it with Run (long-running, notified through LISTEN with a polling
// fallback) or drive it batch by batch with RunOnce. Stats, DeadLetters and
// ReplayDead are administrative helpers that need no running relay.
type Relay struct {
	pool    *pgxpool.Pool
	handler Handler
	cfg     RelayConfig
	names   names
	logger  *slog.Logger
	// batchFailures limits the warning for a batch with failures.
	batchFailures lograte.Limiter
	running       atomic.Bool

	metrics   *relayMetrics
	lastStats atomic.Pointer[statsSample] // latest Stats result, for the gauges
	// lastBatch is how many rows the last claim handed out: the next
	// batch's starting capacity, so that a backlog's batches of BatchSize
	// records are not grown by doubling, nor a trickle's given BatchSize.
	lastBatch atomic.Int64

	leaseSQL        string
	pickSQL         string
	settleSQL       string
	releaseSQL      string
	endUnsettledSQL string

	releaseTimeouts releaseTimeouts // tests shorten them
	settleTimeout   time.Duration   // settleTimeout; tests shorten it

	// unsettled holds the tokens of batches whose settle failed: their
	// leases are ended (see endUnsettled) once the database answers again.
	unsettledMu sync.Mutex
	unsettled   []unsettledBatch
}

// NewRelay returns a Relay that hands rows of the outbox described by cfg
// (nil means defaults) to handler. It does not touch the database.
func NewRelay(pool *pgxpool.Pool, handler Handler, cfg *RelayConfig) (*Relay, error) {
	if pool == nil {
		return nil, &ConfigError{Field: "pool", Reason: "is nil; pass the *pgxpool.Pool of the outbox's database"}
	}
	if deps.Missing(handler) {
		return nil, &ConfigError{Field: "handler", Reason: "is nil; pass the Handler that projects the records"}
	}
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	n := newNames(cfg.Schema, cfg.Table)
	streamFilter := ""
	if len(cfg.Streams) > 0 {
		streamFilter = "\n          AND o.stream = ANY($3::text[])"
	}
	metrics, err := newRelayMetrics(cfg)
	if err != nil {
		return nil, fmt.Errorf("outbox: NewRelay: %w", err)
	}
	ack := fmt.Sprintf(ackDeleteSQL, n.Outbox, partitionCount, partitionBlock)
	if cfg.KeepPublished {
		ack = fmt.Sprintf(ackKeepSQL, n.Outbox, partitionCount, partitionBlock)
	}
	async := asyncCommitClause
	if cfg.DurableBookkeeping {
		async = ""
	}
	others := ""
	if len(cfg.Streams) > 0 {
		others = fmt.Sprintf(settleOthers, n.Outbox, partitionBlock, partitionCount, settleLookahead, heldPauseMax.Microseconds())
	}
	lease := fmt.Sprintf(leaseSQL, n.Outbox, n.Leases, streamFilter, async, partitionCount, claimPartitions(cfg.BatchSize), partitionBlock, n.Dead,
		crashedError("LEAST(o.attempts, 2147483646) + 1"), buryCrashed(n.Dead, cfg), crashedError("attempts"),
		fmt.Sprintf(dueRowProbe, n.Outbox, partitionBlock, partitionCount, streamFilter))
	return &Relay{
		pool:            pool,
		handler:         handler,
		cfg:             *cfg,
		names:           n,
		logger:          cfg.Logger.With(slog.String("relay", cfg.Name)),
		metrics:         metrics,
		leaseSQL:        lease,
		pickSQL:         fmt.Sprintf(pickSQL, n.Outbox, n.Leases, streamFilter, partitionCount, partitionBlock, n.Dead, cfg.MaxAttempts, crashedError("attempts")),
		settleSQL:       fmt.Sprintf(settleSQL, ack, n.Outbox, n.Dead, async, n.Leases, partitionCount, partitionBlock, others, cfg.RetryBackoffMax.Microseconds()),
		releaseSQL:      fmt.Sprintf(releaseClaimSQL, n.Leases),
		endUnsettledSQL: fmt.Sprintf(endUnsettledSQL, n.Leases),

		settleTimeout: settleTimeout,
		releaseTimeouts: releaseTimeouts{
			total:  releaseClaimTimeout,
			cancel: releaseCancelTimeout,
			lock:   releaseLockTimeout,
		},
	}, nil
}

// Config returns the relay's configuration with defaults applied (only
// the defaults for a Relay not made by NewRelay).
func (r *Relay) Config() RelayConfig {
	if r == nil {
		return *(*RelayConfig)(nil).WithDefaults()
	}
	return *r.cfg.WithDefaults()
}

// unmade reports a Relay not made by NewRelay (a zero value, or nil),
// which has no pool, handler or statements to run.
func (r *Relay) unmade() bool { return r == nil || r.pool == nil }

// errUnmadeRelay refuses a Relay not made by NewRelay.
func errUnmadeRelay() error {
	return &ConfigError{Field: "Relay", Reason: "has no pool or handler (a zero value, or nil); create it with NewRelay(pool, handler, cfg)"}
}

// partitionCount is the number of lease partitions (see partitionBlock for
// which rows belong to which). Migration 003 creates one lease row per
// partition and an index on the same expression; the numbers are part of
// both, so they cannot change without a migration. It caps how many relays
// can work on a backlog at once (each batch holds at least one partition),
// far above what one database serves.
const partitionCount = 64

// partitionBlock is how many consecutive ids go to one partition before
// the next partition's turn: a row's partition is mod(id / partitionBlock,
// partitionCount). Runs of consecutive ids keep a batch on few heap pages
// (ids follow insertion order), which the acknowledging DELETE and vacuum
// pay for per page, and keep a trickle of new rows in one or two
// partitions, so that one claim finds them all.
const partitionBlock = 256

// partitionsPerClaim is the most partitions one claim locks while it looks
// for rows. A claim locks free partitions that have due rows, least recently
// claimed first, and fills its batch from them in that order; concurrent
// claims skip each other's locks, so each takes different partitions. On a
// backlog the first partition fills the batch; on a trickle, a handful of
// partitions hold all the rows due since the last batch. Keeping the number
// well below partitionCount leaves partitions for the other relays' claims
// running at the same instant; Run claims again at once when a claim locked
// this many, since more partitions may have due rows.
const partitionsPerClaim = 4

// claimPartitions is the most partitions a claim of batchSize rows locks:
// partitionsPerClaim, or enough partitions for a batch when each holds one
// run of partitionBlock ids (a backlog of fewer than
// partitionCount*partitionBlock rows), so that a BatchSize above
// partitionsPerClaim*partitionBlock is not capped at that many rows.
func claimPartitions(batchSize int) int {
	if batchSize <= partitionsPerClaim*partitionBlock {
		return partitionsPerClaim
	}
	// A backlog's ids rarely start at a run's boundary: batchSize
	// consecutive ids span one run more than batchSize/partitionBlock.
	return min(partitionCount, (batchSize+partitionBlock-1)/partitionBlock+1)
}

// A claim is two statements sent together (one round trip, one implicit
// transaction, a snapshot each), after claimLockSQL: leaseSQL takes
// partitions, pickSQL reads their rows. They are separate so that the rows are read with a snapshot
// taken after the partitions were locked: a single statement could lock a
// partition that its previous holder released a moment ago and still see,
// in its older snapshot, rows that holder had already deleted.
//
// leaseSQL also turns bitmap scans off for the rest of the claim's
// transaction (set_config(…, true) ends with it, like the asynchronous
// commit setting): pickSQL, planned after leaseSQL ran, must read each
// partition in index order and stop after $2 rows. A generic plan
// estimates "available_at <= now()" at a third of the partition and prefers
// a bitmap scan that reads the whole partition and sorts it, which on a deep
// backlog is thousands of rows per claim instead of one batch.
//
// leaseSQL locks (FOR UPDATE SKIP LOCKED) up to partitionsPerClaim
// partitions that no live lease holds and that have a due row, least
// recently claimed first, and leases them to this batch's token ($1) until
// now() + $2 µs: one row write per partition. "crashed" lists the ids
// handed to a batch whose relay never released its partition (it crashed,
// or hung past its lease), and that attempt counts: "recovered" adds one to
// their attempts, with a last_error saying so (crashedError), or, when
// that reaches MaxAttempts (buryCrashed, formatted in by NewRelay), "buried"
// and "dead" move them to the dead-letter table as the settle does, so a row
// that kills every relay handling it is not handed out forever. A row
// counted but not buried here because it is of another stream is buried by
// pickSQL of its own streams' next claim, if its attempts reach that relay's
// MaxAttempts. The two take complementary conditions because one statement
// cannot both update and delete a row. Every id of that batch counts the attempt:
// nothing tells which one killed the relay. The statement returns the ids
// it buried, to be logged and counted.
// The attempt count saturates at the integer column's maximum (LEAST(…,
// 2147483646) + 1, in pickSQL too): a composed INSERT may store any
// attempts, and an overflow would fail every claim of its partition.
// The row-level lease columns that relays of earlier versions stamp are
// still honoured, so a rolling upgrade does not hand a row claimed the old
// way to a new relay.
//
// "due" lists the first partitions, least recently claimed first, that no
// live lease holds (in the statement's snapshot) and that have a row due
// this relay could take, twice as many as a claim takes; "free" locks up to
// partitionsPerClaim of them. The last column, held, reports rows this
// relay could take in partitions it did not lease: in a partition of "due"
// that another claim, not yet committed, had locked (so that this claim
// skipped it while, in its snapshot, no lease held it), or in one another
// claim's live lease holds, not in that batch (its inflight ids: the
// holder's relay picks only its own streams' rows, or its batch was full).
// Nothing wakes this relay when that claim's batch ends for certain (a
// settle notifies only some of the rows it leaves, see settleSQL), so Run
// claims again after a short pause instead of a PollInterval. It is not
// asked when the claim leased as many partitions as it may (Run claims
// again at once); the first half reads "due" again, the second probes each
// partition held at the moment (few: partitionsPerClaim per relay's batch
// under way). Claims running at the same moment see the same "due" (their
// leases are not committed yet) and lock its partitions first come, first
// served: when "due" was full and "free" got fewer than partitionsPerClaim,
// "more" locks the rest from the partitions after it, in the same order
// and with the same probe, instead of this claim leasing fewer than it
// could (measured on 2026-12-04: of four relays starting a drain together,
// two found all of "due" locked and came back empty). With "due" not full
// every due partition is in it already, and "more" reads nothing (LIMIT
// 0). Two relays of one stream woken by one write (an HA pair) make one
// extra claim when one skips the partition the other is claiming.
//
// The due-row test is one probe of the partition index per partition
// visited, in lease order (the leases' touched index), stopping once
// "due" is full: OFFSET 0 keeps PostgreSQL from turning the EXISTS into a
// join, which on
// an outbox without statistics (never analysed: autovacuum off, or behind
// a burst) it planned as a hash join over every due row of the outbox,
// read through the pending index on every claim. With statistics the join
// it chose walked the partitions in the same order, so nothing changes
// there. Stopping early matters on a backlog: the partitions drained last
// begin with the index entries of rows their acknowledgements deleted,
// which a probe reads past until vacuum removes them.
const leaseSQL = `WITH due AS MATERIALIZED (
    SELECT l.part
    FROM %[2]s AS l
    WHERE (l.leased_until IS NULL OR l.leased_until <= now())
      AND %[12]s
    ORDER BY l.touched_at, l.part
    LIMIT 2 * %[6]d
),
free AS MATERIALIZED (
    SELECT l.part, l.owner, l.inflight
    FROM %[2]s AS l
    WHERE (l.leased_until IS NULL OR l.leased_until <= now())
      AND l.part IN (SELECT part FROM due)
    ORDER BY l.touched_at, l.part
    LIMIT %[6]d
    FOR UPDATE OF l SKIP LOCKED
),
more AS MATERIALIZED (
    SELECT l.part, l.owner, l.inflight
    FROM %[2]s AS l
    WHERE (l.leased_until IS NULL OR l.leased_until <= now())
      AND l.part NOT IN (SELECT part FROM due)
      AND %[12]s
    ORDER BY l.touched_at, l.part
    LIMIT CASE WHEN (SELECT count(*) FROM due) < 2 * %[6]d THEN 0 ELSE %[6]d - (SELECT count(*) FROM free) END
    FOR UPDATE OF l SKIP LOCKED
),
taken AS MATERIALIZED (
    SELECT part, owner, inflight FROM free
    UNION ALL
    SELECT part, owner, inflight FROM more
),
leased AS (
    UPDATE %[2]s AS l
    SET owner = $1,
        leased_until = now() + $2 * interval '1 microsecond',
        inflight = '{}'
    FROM taken AS f
    WHERE l.part = f.part%[4]s
    RETURNING l.part
),
crashed AS MATERIALIZED (
    SELECT generate_series(lower(r), upper(r) - 1) AS id
    FROM taken AS f, unnest(f.inflight) AS r
    WHERE f.owner IS NOT NULL
),
recovered AS (
    UPDATE %[1]s AS o
    SET attempts = LEAST(o.attempts, 2147483646) + 1,
        last_error = %[9]s
    WHERE o.id = ANY(ARRAY(SELECT id FROM crashed))
      AND NOT (%[10]s)
    RETURNING o.id
),
buried AS (
    DELETE FROM %[1]s AS o
    WHERE o.id = ANY(ARRAY(SELECT id FROM crashed))
      AND %[10]s
    RETURNING o.id, o.event_id, o.stream, o.key, o.version, o.payload, o.created_at, LEAST(o.attempts, 2147483646) + 1 AS attempts
),
dead AS (
    INSERT INTO %[8]s (id, event_id, stream, key, version, payload, created_at, attempts, last_error)
    SELECT id, event_id, stream, key, version, payload, created_at, attempts, %[11]s
    FROM buried
    RETURNING id
)
SELECT (SELECT count(*) FROM leased), set_config('enable_bitmapscan', 'off', true),
    ARRAY(SELECT id FROM dead ORDER BY id),
    CASE WHEN (SELECT count(*) FROM leased) >= %[6]d THEN false ELSE
        EXISTS (SELECT 1 FROM due WHERE part NOT IN (SELECT part FROM leased))
        OR EXISTS (
            SELECT 1 FROM %[2]s AS h
            WHERE h.leased_until > now()
              AND EXISTS (
                SELECT 1 FROM %[1]s AS o
                WHERE mod(o.id / %[7]d, %[5]d) = h.part
                  AND o.published_at IS NULL
                  AND o.available_at <= now()
                  AND (o.leased_until IS NULL OR o.leased_until <= now())%[3]s
                  AND NOT h.inflight @> o.id
                OFFSET 0))
    END`

// dueRowProbe tests whether the partition of lease row l has a row due
// that the relay could take: one probe of the partition index (leaseSQL
// says why OFFSET 0). Outbox, block, count and the stream filter are
// formatted in by NewRelay.
const dueRowProbe = `EXISTS (
        SELECT 1 FROM %[1]s AS o
        WHERE mod(o.id / %[2]d, %[3]d) = l.part
          AND o.published_at IS NULL
          AND o.available_at <= now()
          AND (o.leased_until IS NULL OR o.leased_until <= now())%[4]s
        OFFSET 0)`

// buryCrashed is the condition under which the claim buries a row o of a
// crashed batch instead of counting the attempt: its attempts, counting
// this one, reach this relay's MaxAttempts (compared before the increment,
// which cannot overflow there), it is of a stream this relay serves (another
// stream's relays may allow more attempts: for those rows the attempt is
// only counted, and their own relays' next claim buries them in pickSQL
// if their attempts reach its MaxAttempts), and its id is not in the
// dead-letter table already (possible only after the outbox's ids were
// reset): a claim that failed on that conflict would fail every claim,
// whereas the row handed out again fails only its own batch's settle.
func buryCrashed(dead string, cfg *RelayConfig) string {
	streams := ""
	if len(cfg.Streams) > 0 {
		streams = " AND o.stream = ANY($3::text[])"
	}
	return fmt.Sprintf("o.attempts >= %d%s AND NOT EXISTS (SELECT 1 FROM %s AS d WHERE d.id = o.id)",
		cfg.MaxAttempts-1, streams, dead)
}

// pickSQL reads up to $2 due rows of the partitions leased to the batch's
// token ($1), partition after partition, least recently claimed first (the
// nested loop keeps the order owned was materialized in), each in
// (available_at, id) order through the partition index; the rows handed out
// are not written. It records the ids handed out in each partition's lease
// row (and when it was last served, for the least-recently-claimed order)
// and releases the partitions that contributed none (the batch filled up
// first) without moving them back in that order. The ids are aggregated
// once, per partition ("served"), and joined to the lease rows: subqueries
// per lease row read the whole batch once per row and per column (in a
// claim of 1,000 rows, auto_explain timed the lease rows' update at 1.7
// of the statement's 3.3 ms that way, 1.1 of 2.5 ms this way).
//
// A row read with this relay's MaxAttempts (formatted in by NewRelay)
// attempts counted already is moved to the dead-letter table instead
// ("bury", "buried", "dead"), so that no relay hands out an attempt past
// its MaxAttempts: a relay of other streams counted the row's crashed last
// attempt without burying it (see buryCrashed), or a relay allowing more
// attempts retried it. The row keeps its last_error: the crash's, written
// when the attempt was counted, or the failure the other relay retried;
// crashedError stands in for a row without one (attempts stored by a
// composed INSERT, or counted by a relay of an earlier version). The test
// is a comparison on rows already read, and the dead-letter probe runs only
// for rows that pass it, so a claim without such rows pays next to nothing.
// A row whose id is in the dead-letter table already is handed out, as in
// leaseSQL. The buried rows come last, marked by the final column, to be
// logged and counted (the INSERT runs whether or not it is read, and fails
// the statement rather than lose one).
const pickSQL = `WITH owned AS MATERIALIZED (
    SELECT part FROM %[2]s WHERE owner = $1
    ORDER BY touched_at, part
),
picked AS MATERIALIZED (
    SELECT f.part, r.*,
        CASE WHEN r.attempts >= %[7]d THEN NOT EXISTS (SELECT 1 FROM %[6]s AS d WHERE d.id = r.id) ELSE false END AS bury
    FROM owned AS f
    CROSS JOIN LATERAL (
        SELECT o.id, o.event_id, o.stream, o.key, o.version, o.payload, o.created_at, o.attempts
        FROM %[1]s AS o
        WHERE mod(o.id / %[5]d, %[4]d) = f.part
          AND o.published_at IS NULL
          AND o.available_at <= now()
          AND (o.leased_until IS NULL OR o.leased_until <= now())%[3]s
        ORDER BY mod(o.id / %[5]d, %[4]d), o.available_at, o.id
        LIMIT $2
    ) AS r
    LIMIT $2
),
buried AS (
    DELETE FROM %[1]s AS o
    WHERE o.id = ANY(ARRAY(SELECT id FROM picked WHERE bury))
    RETURNING o.id, o.event_id, o.stream, o.key, o.version, o.payload, o.created_at, o.attempts, o.last_error
),
dead AS (
    INSERT INTO %[6]s (id, event_id, stream, key, version, payload, created_at, attempts, last_error)
    SELECT id, event_id, stream, key, version, payload, created_at, attempts, COALESCE(last_error, %[8]s)
    FROM buried
    RETURNING id
),
served AS (
    SELECT part, range_agg(int8range(id, id, '[]')) AS ids
    FROM picked WHERE NOT bury
    GROUP BY part
),
recorded AS (
    UPDATE %[2]s AS l
    SET inflight = COALESCE(s.ids, '{}'),
        owner = CASE WHEN s.part IS NOT NULL THEN l.owner END,
        leased_until = CASE WHEN s.part IS NOT NULL THEN l.leased_until END,
        touched_at = CASE WHEN s.part IS NOT NULL THEN now() ELSE l.touched_at END
    FROM owned AS f LEFT JOIN served AS s ON s.part = f.part
    WHERE l.part = f.part AND l.owner = $1
    RETURNING l.part
)
SELECT p.id, p.event_id, p.stream, p.key, p.version, p.payload, p.created_at, LEAST(p.attempts, 2147483646) + 1, false
FROM picked AS p
WHERE NOT p.bury
UNION ALL
SELECT b.id, b.event_id, b.stream, b.key, b.version, b.payload, b.created_at, b.attempts, true
FROM buried AS b`

// crashedError is the SQL expression of the last_error of a row whose
// attempt (the SQL expression attempt) was counted because its relay
// stopped without settling it.
func crashedError(attempt string) string {
	return `'the relay handling attempt ' || ` + attempt + ` || ' stopped without settling it: it crashed, or hung past its lease;'
        || ' every row of its batch counts that attempt, so this row may not be the one that caused it'`
}

// asyncCommitClause makes the statement it is part of commit with
// synchronous_commit = off unless RelayConfig.DurableBookkeeping is set.
// set_config(…, true) sets the parameter for the current transaction only,
// which for a statement sent on its own is the statement's implicit
// transaction (for the claim, the one implicit transaction of its two
// statements): PostgreSQL reads synchronous_commit when that transaction
// commits, right after the statement, and resets it at the transaction's
// end, so the setting never outlives the statement on the pooled connection.
// The subquery has no column references, so the planner evaluates it once,
// as a one-time filter, whether or not any row qualifies; it is in a part of
// each statement that always runs (the claim's lease UPDATE, the settle's
// release).
const asyncCommitClause = `
      AND (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL`

// The acknowledgement variants; both only touch rows of partitions the
// batch still holds ("owned").
const (
	ackDeleteSQL = `DELETE FROM %[1]s WHERE id = ANY($2::bigint[]) AND mod(id / %[3]d, %[2]d) IN (SELECT part FROM owned) RETURNING id`
	ackKeepSQL   = `UPDATE %[1]s SET published_at = now(), claim_token = NULL, leased_until = NULL
    WHERE id = ANY($2::bigint[]) AND mod(id / %[3]d, %[2]d) IN (SELECT part FROM owned) RETURNING id`
)

// settleSQL records a whole batch's outcome in one statement and releases
// its partitions: acknowledged rows ($2), rows to retry with their error,
// delay and attempt number ($3-$5, $9), rows to bury in the dead-letter
// table with their error and attempt number ($6-$7, $10) and rows to release
// for immediate re-delivery ($8, nothing to write: a claim wrote nothing on
// them). A row to bury whose id is already in the dead-letter table (the
// outbox's ids were reset) is kept as a retry after RetryBackoffMax instead
// ("kept", returned flagged true): its INSERT would fail the whole statement,
// and with it the batch's acknowledgements. "owned" locks the partitions
// still leased to the batch's token ($1);
// every part touches only rows of those, so a relay whose lease expired and
// whose partition another relay took over changes nothing there; the ids
// returned are those actually settled.
//
// Releasing the partitions notifies, on the outbox's channel ($11, sent on
// commit), streams whose rows are left for others to claim: those of the
// rows released for re-delivery (another relay of their stream, idle since
// its claim saw them in this batch, is woken by nothing else), and, for a
// relay restricted to some streams, the stream of the first other stream's
// row due among the first settleLookahead rows of each released partition
// after this batch's own (settleOthers): its relay skipped the partition
// while this batch held it, and a busy stream whose relay held it again and
// again would otherwise keep it waiting for a claim that happens to find
// the partition free. Only the first: that relay's settle announces the
// next, so rows of N streams in one partition cost O(N) claims, not the
// O(N²) of waking them all after every batch. That chain stops at a row
// nobody takes (its stream's relay is not running, or does not listen), so
// the settle also announces, of the other streams whose rows in the look
// have been due for longer than heldPauseMax (the longest a relay that
// found its row held waits before it claims again), the stream of the
// youngest such row (a row behind rows nobody takes becomes the youngest
// the moment it passes heldPauseMax) and one picked at random (so that no
// row is passed over for ever by younger rows nobody takes). Two, not all:
// a chain of N healthy relays whose batches outlast heldPauseMax would
// otherwise wake every relay still waiting its turn after every batch,
// O(N²) again. The look is bounded so that
// a settle on a backlog of the relay's own stream reads, per partition, the
// index entries of its batch (still there in the statement's snapshot) and
// settleLookahead more, not the backlog; rows deeper in such a partition
// wait for their relay's growing pause (see leaseSQL's held).
const settleSQL = `WITH owned AS MATERIALIZED (
    SELECT part, inflight FROM %[5]s WHERE owner = $1 FOR UPDATE
),
acked AS (
    %[1]s
),
retried AS (
    UPDATE %[2]s AS o
    SET claim_token = NULL,
        leased_until = NULL,
        attempts = f.attempts,
        last_error = f.err,
        available_at = now() + f.delay_us * interval '1 microsecond'
    FROM unnest($3::bigint[], $4::text[], $5::bigint[], $9::int[]) AS f(id, err, delay_us, attempts)
    WHERE o.id = f.id AND mod(o.id / %[7]d, %[6]d) IN (SELECT part FROM owned)
    RETURNING o.id
),
buried AS (
    DELETE FROM %[2]s AS o
    USING unnest($6::bigint[], $7::text[], $10::int[]) AS f(id, err, attempts)
    WHERE o.id = f.id AND mod(o.id / %[7]d, %[6]d) IN (SELECT part FROM owned)
      AND NOT EXISTS (SELECT 1 FROM %[3]s AS d WHERE d.id = o.id)
    RETURNING o.id, o.event_id, o.stream, o.key, o.version, o.payload, o.created_at, f.attempts, f.err
),
kept AS (
    UPDATE %[2]s AS o
    SET claim_token = NULL,
        leased_until = NULL,
        attempts = f.attempts,
        last_error = f.err,
        available_at = now() + %[9]d * interval '1 microsecond'
    FROM unnest($6::bigint[], $7::text[], $10::int[]) AS f(id, err, attempts)
    WHERE o.id = f.id AND mod(o.id / %[7]d, %[6]d) IN (SELECT part FROM owned)
      AND EXISTS (SELECT 1 FROM %[3]s AS d WHERE d.id = o.id)
    RETURNING o.id
),
dead AS (
    INSERT INTO %[3]s (id, event_id, stream, key, version, payload, created_at, attempts, last_error)
    SELECT id, event_id, stream, key, version, payload, created_at, attempts, err FROM buried
    RETURNING id
),
woken AS (
    SELECT o.stream FROM %[2]s AS o
    WHERE o.id = ANY($8::bigint[]) AND mod(o.id / %[7]d, %[6]d) IN (SELECT part FROM owned)%[8]s
),
released AS (
    UPDATE %[5]s
    SET owner = NULL, leased_until = NULL, inflight = '{}'
    WHERE part IN (SELECT part FROM owned)%[4]s
      AND (SELECT count(pg_notify($11, w.stream)) FROM (SELECT DISTINCT stream FROM woken) AS w) >= 0
    RETURNING part
)
SELECT id, false FROM acked
UNION ALL SELECT id, false FROM retried
UNION ALL SELECT id, false FROM dead
UNION ALL SELECT id, true FROM kept
UNION ALL SELECT r.id, false FROM unnest($8::bigint[]) AS r(id) WHERE mod(r.id / %[7]d, %[6]d) IN (SELECT part FROM owned)`

// settleLookahead is how many of a released partition's first due rows the
// settle looks at for other streams' rows (see settleSQL).
const settleLookahead = 32

// settleOthers is the part of settleSQL's "woken" that finds other streams'
// rows due in the released partitions, for a relay restricted to streams
// ($12): per partition, the stream of the first such row and, of those
// due for longer than heldPauseMax, the youngest's and one picked at
// random (each NULL when there is none). Outbox, block, count, look-ahead and
// heldPauseMax are formatted in by NewRelay.
const settleOthers = `
    UNION ALL
    SELECT s.stream FROM owned AS w CROSS JOIN LATERAL (
        SELECT (array_agg(a.stream ORDER BY a.available_at, a.id))[1] AS first,
            (array_agg(a.stream ORDER BY a.available_at DESC, a.id DESC) FILTER (WHERE a.old))[1] AS youngest,
            array_agg(DISTINCT a.stream) FILTER (WHERE a.old) AS old
        FROM (
            SELECT o.stream, o.available_at, o.id, o.available_at < now() - %[5]d * interval '1 microsecond' AS old
            FROM %[1]s AS o
            WHERE mod(o.id / %[2]d, %[3]d) = w.part
              AND o.published_at IS NULL
              AND o.available_at <= now()
              AND (o.leased_until IS NULL OR o.leased_until <= now())
              AND NOT w.inflight @> o.id
            ORDER BY mod(o.id / %[2]d, %[3]d), o.available_at, o.id
            LIMIT %[4]d
        ) AS a
        WHERE NOT a.stream = ANY($12::text[])
    ) AS n
    CROSS JOIN LATERAL (VALUES (n.first), (n.youngest), (n.old[1 + floor(random() * cardinality(n.old))::int])) AS s(stream)
    WHERE s.stream IS NOT NULL`

// RunOnce claims one batch of due rows, hands it to the Handler and settles
// it. It returns the number of rows handed to the Handler: 0 when no row it
// may take was due. Rows in a partition that another batch's lease holds
// are not for it to take: another relay's batch in flight, or a crashed
// relay's until its lease ends (LeaseDuration). So a loop until RunOnce
// returns 0 can stop while such rows are due; Stats tells what is left. A
// claim moves rows that reached MaxAttempts already to the dead-letter
// table instead of handing them out (see the package documentation,
// "Lifecycle of a row"); they are not counted, and never make RunOnce
// return 0: after a claim that only buried rows it claims again, until it
// finds rows to hand out or none are due.
//
// The Handler's context is ctx, bounded by the lease. If ctx is cancelled
// while the Handler runs, the rows it fails are released for immediate
// re-delivery instead of being retried after a backoff. If ctx's deadline
// passes instead, their failures count as attempts, as at the lease's end:
// a row that outlasts every deadline still backs off and, after
// MaxAttempts, reaches the dead-letter table. Settling runs even after ctx
// is done (bounded by 10s), so completed work is recorded.
//
// A non-nil error with a positive count means the batch was handled but not
// entirely settled: a *LeaseLostError (errors.Is(err, ErrLeaseLost)) lists
// rows another relay had re-claimed; any other error leaves the rows leased,
// to be re-delivered when the lease expires or, sooner, once the relay's
// next RunOnce reaches the database: before it claims, it ends the leases
// its failed settles left (a settle that committed after all leaves none).
func (r *Relay) RunOnce(ctx context.Context) (int, error) {
	if r.unmade() {
		return 0, errUnmadeRelay()
	}
	n, _, err := r.runBatch(ctx, ctx)
	return n, err
}

// runBatch claims unless claimCtx is cancelled and runs the handler under
// workCtx, which Run cancels only when the shutdown timeout has passed.
// again says when to claim next (see claim).
func (r *Relay) runBatch(claimCtx, workCtx context.Context) (n int, again claimAgain, err error) {
	r.endUnsettled(claimCtx)
	token := uuid.New()
	batch, again, start, err := r.claim(claimCtx, workCtx, token)
	if err != nil || len(batch) == 0 {
		return 0, again, err
	}
	// The handler's deadline is measured from before the claim was sent,
	// so it ends no later than the lease on the server.
	r.metrics.claimed.Add(claimCtx, int64(len(batch)), r.metrics.attrs)
	handlerCtx, cancel := context.WithDeadline(workCtx, start.Add(r.cfg.LeaseDuration))
	handleStart := time.Now()
	results := r.handle(handlerCtx, batch)
	r.metrics.handlerDuration.Record(workCtx, time.Since(handleStart).Seconds(), r.metrics.attrs)
	cancel()
	// Only a cancellation stops: a deadline (RunOnce's caller's) ends the
	// attempt as the lease's does, and the failure counts. Released
	// instead, a row that hangs its Handler until any deadline would be
	// handed out first in every pass, never backing off nor dying, and the
	// rows behind it in its partition never reached. Run's workCtx is
	// only ever cancelled.
	stopping := errors.Is(workCtx.Err(), context.Canceled)
	err = r.settleWithin(claimCtx, workCtx, start, token, batch, results, stopping)
	if err != nil && !errors.Is(err, ErrLeaseLost) {
		r.noteUnsettled(token, start)
	}
	return len(batch), again, err
}

// endUnsettledSQL ends now the leases that a batch whose settle failed
// still holds, as if they had run out: the next claim takes the partitions
// over and counts the attempt, as after a crash (see claimSQL). It matches
// only the batch's own token, so a settle that committed after all (its
// answer lost, the leases freed) or a partition another relay has taken
// since is left alone; a settle still running on the server holds the
// lease rows' locks, and the statement waits for it (bounded, below) and
// then finds them freed.
const endUnsettledSQL = `UPDATE %s SET leased_until = now() WHERE owner = $1 AND leased_until > now()`

// unsettledBatch is a batch whose settle failed, or a cut-off claim whose
// release failed (release), and when its lease ends by itself.
type unsettledBatch struct {
	token   uuid.UUID
	until   time.Time
	release bool
}

// noteUnsettled records the batch of token, claimed at start, whose settle
// failed, for endUnsettled.
func (r *Relay) noteUnsettled(token uuid.UUID, start time.Time) {
	r.unsettledMu.Lock()
	r.unsettled = append(r.unsettled, unsettledBatch{token: token, until: start.Add(r.cfg.LeaseDuration)})
	r.unsettledMu.Unlock()
}

// endUnsettled ends the leases of the batches whose settle failed (a
// connection lost as PostgreSQL restarted, say), and releases the cut-off
// claims whose release failed (a claim that committed as PostgreSQL
// crashed, losing only its answer), before the next claim, so that their
// rows are delivered again as soon as the database answers rather than
// when the leases run out (LeaseDuration). A batch whose
// statement fails stays listed until its lease has run out by itself. It
// runs under the claim's ctx: a shutdown does not wait for it, and a
// statement cut short only leaves the lease to run out.
func (r *Relay) endUnsettled(ctx context.Context) {
	r.unsettledMu.Lock()
	pending := r.unsettled
	r.unsettled = nil
	r.unsettledMu.Unlock()
	if len(pending) == 0 || ctx.Err() != nil {
		r.keepUnsettled(pending)
		return
	}
	for i, u := range pending {
		if !time.Now().Before(u.until) {
			continue // ran out by itself
		}
		if u.release {
			// No backend to end: the claim's connection is gone, and its
			// process ID may name another session by now.
			if err := r.releaseClaim(ctx, u.token, 0); err != nil {
				if claimStillHeld(err) {
					r.releaseFailed(err, false)
					continue
				}
				r.logger.DebugContext(ctx, "outbox: releasing a cut-off claim did not succeed; retrying before the next claim", slog.Any("error", err))
				r.keepUnsettled(pending[i:])
				return
			}
			continue
		}
		uctx, cancel := context.WithTimeout(ctx, releaseClaimTimeout)
		b := &pgx.Batch{}
		b.Queue(releaseUpdateTimeoutSQL, fmt.Sprintf("%dms", releaseUpdateTimeout.Milliseconds()))
		b.Queue(r.endUnsettledSQL, pgUUID(u.token))
		err := r.pool.SendBatch(uctx, b).Close()
		cancel()
		if err != nil {
			// The database does not answer yet, or the settle still runs:
			// try again before the next claim.
			r.logger.DebugContext(ctx, "outbox: ending the leases of a batch whose settle failed did not succeed; retrying before the next claim", slog.Any("error", err))
			r.keepUnsettled(pending[i:])
			return
		}
	}
}

// keepUnsettled puts batches back for the next endUnsettled.
func (r *Relay) keepUnsettled(batches []unsettledBatch) {
	if len(batches) == 0 {
		return
	}
	r.unsettledMu.Lock()
	r.unsettled = append(batches, r.unsettled...)
	r.unsettledMu.Unlock()
}

// claimRetries bounds how often claim leases again after leasing
// partitions whose due rows turned out to be gone: the lease statement
// decides which partitions have due rows with its own snapshot, and a
// relay that settled a partition while that statement ran leaves it
// empty. Returning such an empty claim would make Run wait a PollInterval
// although other partitions have rows. A claim that buried rows instead
// of handing them out is not counted: it made progress (see claim).
const claimRetries = 3

// claim leases partitions and returns their due rows, sorted by id,
// when to claim again (claimNow when more rows may be due already: the
// claim read a full batch, buried rows included, or leased as many
// partitions as it may; claimSoon when rows it could take wait in
// partitions other claims hold), and when
// the claim that found them was sent: the leases, and so the Handler's
// deadline, run from then. It claims until a claim finds rows to hand out,
// finds no partition with due rows, or comes back empty claimRetries times,
// and returns no rows only then (or on an error, or when claimCtx ends).
//
// A claim that only buried rows (they had reached MaxAttempts: see pickSQL
// and leaseSQL) is followed by another at once, without counting against
// claimRetries: every row it buried left the outbox, so a backlog of such
// rows, however long, ends, and rows due behind it are reached without a
// PollInterval's wait (a rollout that lowers MaxAttempts while many rows
// are retrying leaves such a backlog). The partitions of such a claim are
// released by pickSQL, which gave them no row to hand out, and keep their
// place in the least-recently-claimed order, so the next claim takes them
// again first.
//
// A claim waits for a connection under claimCtx, but its statements, once
// sent, run under workCtx: they are part of the in-flight batch a shutdown
// lets finish. Cut off, they would leave the relay releasing what they
// leased and pgx closing their connection in the background (which over
// TLS can take pgx's full 15 s, holding up the pool's Close).
func (r *Relay) claim(claimCtx, workCtx context.Context, token uuid.UUID) (batch []Record, again claimAgain, start time.Time, err error) {
	held := false
	for empty := 0; empty < claimRetries; {
		if err := claimCtx.Err(); err != nil {
			return nil, claimOnWake, start, err
		}
		start = time.Now()
		// Without a deadline a half-open connection (a dead NAT entry, a
		// proxy that stopped forwarding) would block the relay forever. A
		// claim that outlives a lease is useless anyway: its rows are
		// claimable again by then.
		acquireCtx, cancelAcquire := context.WithDeadline(claimCtx, start.Add(r.cfg.LeaseDuration))
		c, sent, err := r.claimOnce(acquireCtx, workCtx, token)
		cancelAcquire()
		if !sent.IsZero() {
			// The lease, and so the Handler's deadline, runs from the
			// send, not from before the wait for a pool connection.
			start = sent
		}
		if err == nil {
			held = c.held
		}
		switch {
		case err != nil:
			return nil, claimOnWake, start, err
		case len(c.batch) > 0:
			// Rows pickSQL buried took places in the batch as handed-out
			// ones do: a full read may have left rows due.
			if c.read >= r.cfg.BatchSize || c.leased >= claimPartitions(r.cfg.BatchSize) {
				return c.batch, claimNow, start, nil
			}
			return c.batch, whenHeld(held), start, nil
		case c.buried > 0:
			// Progress: claim again.
		case c.leased == 0:
			return nil, whenHeld(held), start, nil
		default:
			empty++
		}
	}
	return nil, whenHeld(held), start, nil
}

// whenHeld is when to claim again after a claim that found no more rows:
// soon when rows it could take are due in partitions other claims hold.
func whenHeld(held bool) claimAgain {
	if held {
		return claimSoon
	}
	return claimOnWake
}

// claimed is what one claim found.
type claimed struct {
	batch  []Record // rows handed out, sorted by id
	leased int      // partitions leased
	read   int      // rows pickSQL read: the batch and the rows it buried
	buried int      // rows moved to the dead-letter table, by either statement
	held   bool     // rows this relay could take are due in partitions other claims hold
}

// claimAgain says when Run claims after a batch.
type claimAgain int

const (
	// claimOnWake: at the next notification, or after PollInterval.
	claimOnWake claimAgain = iota
	// claimNow: rows may be due already (a full batch, or as many
	// partitions as a claim takes).
	claimNow
	// claimSoon: rows this relay could take are due in partitions other
	// relays' leases hold; after a short, growing pause, or the next
	// notification.
	claimSoon
)

// claimOnce runs the claim statements once under sendCtx, on a connection
// acquired under acquireCtx, and returns what it found.
//
// A claim that fails without an answer from the server (its context ended,
// the connection broke) may still commit there: pgx drops the connection
// and sends a cancel request in the background, which may land too late or
// not at all, and a statement waiting for a lock does not notice the
// dropped connection. Its partitions would then stay leased to a token
// nobody holds until the lease ends, and the rows it recorded would be
// counted an attempt they never had; releaseClaim undoes that. A server
// error aborted the claim's transaction (but a connection exception,
// SQLSTATE class 08, is not the server's: PgBouncer reports a server
// connection that broke under the claim, which may have committed, as its
// own 08P01), and a claim that found no
// connection, or failed before its statements left (pgconn.SafeToRetry: for
// example its context ended as it began), sent nothing: neither needs it,
// and skipping it spares a shutdown the release's round trips. Not
// pgconn.ErrConnClosed, which pgconn marks SafeToRetry too: on the
// connection the pool gave out open, pgx reports it for statements sent in
// the simple protocol or QueryExecModeExec when the read after them broke
// the connection.
func (r *Relay) claimOnce(acquireCtx, workCtx context.Context, token uuid.UUID) (claimed, time.Time, error) {
	conn, err := r.pool.Acquire(acquireCtx)
	if err != nil {
		return claimed{}, time.Time{}, mapError("claim", err)
	}
	sent := time.Now()
	sendCtx, cancelSend := context.WithDeadline(workCtx, sent.Add(r.cfg.LeaseDuration))
	defer cancelSend()
	backend := conn.Conn().PgConn().PID()
	c, err := r.sendClaim(sendCtx, conn.Conn(), token)
	// Back to the pool first: releaseClaim may need this pool's only
	// connection.
	conn.Release()
	if err != nil && !serverAnswered(err) &&
		(!pgconn.SafeToRetry(err) || errors.Is(err, pgconn.ErrConnClosed)) {
		if rerr := r.releaseClaim(context.WithoutCancel(sendCtx), token, backend); rerr != nil {
			// A crash loses the claim's answer, not its commit, and the
			// release fails while the server is down, or refuses
			// connections as it shuts down or starts up (57P03): it is
			// tried again before each claim (endUnsettled) until the lease
			// ends. Not a claim still holding its lock at the release's
			// timeouts: trying again would only make every claim wait as
			// long.
			retry := !claimStillHeld(rerr)
			r.releaseFailed(rerr, retry)
			if retry {
				r.unsettledMu.Lock()
				r.unsettled = append(r.unsettled, unsettledBatch{token: token, until: sent.Add(r.cfg.LeaseDuration), release: true})
				r.unsettledMu.Unlock()
			}
		}
	}
	return c, sent, err
}

// sendClaim sends the claim statements on conn and reads their results.
func (r *Relay) sendClaim(ctx context.Context, conn *pgx.Conn, token uuid.UUID) (claimed, error) {
	leaseArgs := []any{pgUUID(token), r.cfg.LeaseDuration.Microseconds()}
	pickArgs := []any{pgUUID(token), r.cfg.BatchSize}
	if len(r.cfg.Streams) > 0 {
		leaseArgs = append(leaseArgs, r.cfg.Streams)
		pickArgs = append(pickArgs, r.cfg.Streams)
	}
	// Queued statements before one Sync run in one implicit transaction:
	// the partitions stay locked until the rows are read and recorded. The
	// first statement marks the transaction as this token's, for
	// releaseClaim.
	b := &pgx.Batch{}
	b.Queue(claimLockSQL, claimLockKey(token))
	b.Queue(r.leaseSQL, leaseArgs...)
	b.Queue(r.pickSQL, pickArgs...)
	res := conn.SendBatch(ctx, b)
	defer res.Close()
	if _, err := res.Exec(); err != nil {
		return claimed{}, mapError("claim", err)
	}
	var (
		leased  int
		setting string
		buried  []int64
		held    bool
	)
	if err := res.QueryRow().Scan(&leased, &setting, &buried, &held); err != nil {
		return claimed{}, mapError("claim", err)
	}
	rows, err := res.Query()
	if err != nil {
		return claimed{}, mapError("claim", err)
	}
	var (
		batch     = make([]Record, 0, r.lastBatch.Load())
		exhausted []int64 // rows pickSQL buried
		rec       Record
		isBuried  bool
	)
	// The event id is scanned as the 16 bytes it is: through uuid.UUID's
	// sql.Scanner, pgx would turn each id into text and the scanner parse
	// it back.
	_, err = pgx.ForEachRow(rows, []any{&rec.ID, (*[16]byte)(&rec.EventID), &rec.Stream, &rec.Key, &rec.Version, &rec.Payload,
		createdAt{&rec.CreatedAt}, &rec.Attempts, &isBuried}, func() error {
		if isBuried {
			exhausted = append(exhausted, rec.ID)
		} else {
			batch = append(batch, rec)
		}
		return nil
	})
	if err != nil {
		return claimed{}, mapError("claim", err)
	}
	if err := res.Close(); err != nil {
		return claimed{}, mapError("claim", err)
	}
	r.lastBatch.Store(int64(len(batch)))
	// Committed now. Like the settle's burials, these are dead letters an
	// operator must hear of; they never reach a Handler to be logged.
	if len(buried) > 0 {
		r.metrics.deadLettered.Add(ctx, int64(len(buried)), r.metrics.attrs)
		r.logger.Warn("outbox rows moved to dead letters: the relay handling their last attempt stopped without settling them (it crashed, or hung past its lease)",
			slog.Any("ids", buried), slog.Int("max_attempts", r.cfg.MaxAttempts))
	}
	if len(exhausted) > 0 {
		r.metrics.deadLettered.Add(ctx, int64(len(exhausted)), r.metrics.attrs)
		r.logger.Warn("outbox rows moved to dead letters: they came to this relay with MaxAttempts attempts counted already (a relay of other streams counted their crashed last attempt, or a relay allowing more attempts retried them); each keeps its last error",
			slog.Any("ids", exhausted), slog.Int("max_attempts", r.cfg.MaxAttempts))
	}
	slices.SortFunc(batch, func(a, b Record) int { return cmp.Compare(a.ID, b.ID) })
	return claimed{batch: batch, leased: leased, read: len(batch) + len(exhausted), buried: len(buried) + len(exhausted), held: held}, nil
}

// claimLockSQL takes a transaction-scoped advisory lock on the claim's
// token (claimLockKey) before the claim leases anything, so that
// releaseClaim can find the claim's transaction and wait for its end.
//
// It also pins, for the claim's transaction only, the output settings
// pgx's text formats need (hex bytea, ISO timestamps), which the exec modes
// a transaction-pooling proxy needs return the claimed rows in. A client
// cannot pin them for the session behind such a proxy (PgBouncer refuses
// bytea_output as a startup parameter), and another client's plain SET
// stays on the server connection it leaves; with another setting every
// claim would fail after the server committed it.
//
// And it turns JIT off for the claim: once the lease table has grown
// between vacuums (autovacuum off or behind, old row versions held by
// other sessions' snapshots), the lease statement's estimated cost passes
// the default jit_above_cost, and PostgreSQL compiled it on every claim:
// about 70 ms of CPU against 2 ms for the statement, which on a loaded
// machine slowed a relay to a batch a second.
const claimLockSQL = `SELECT pg_advisory_xact_lock($1), set_config('bytea_output', 'hex', true), set_config('DateStyle', 'ISO', true), set_config('jit', 'off', true)`

// claimLockKey is the advisory lock key of a claim: the token's first 64
// bits, random, so it collides with no other key in practice.
func claimLockKey(token uuid.UUID) int64 {
	return int64(binary.BigEndian.Uint64(token[:8]))
}

// releaseClaimTimeout bounds releaseClaim. If it runs out, the partitions
// stay leased until the lease ends, as they would have without it.
const releaseClaimTimeout = 5 * time.Second

// releaseCancelTimeout bounds releaseClaim's cancel statement, which may
// need a new connection (the claim's was dropped). The cancel only speeds
// the release up, so it must not eat the time the release needs to wait
// for the claim's end: without its own bound a slow dial or server would
// leave that wait too little time, and the client's deadline would drop the
// release's connection mid-statement.
const releaseCancelTimeout = time.Second

// releaseLockTimeout caps the release's wait for the claim's transaction
// to end (lock_timeout). The wait gets what is left of releaseClaimTimeout,
// less releaseServerMargin, up to this.
const releaseLockTimeout = 4 * time.Second

// releaseUpdateTimeout bounds the UPDATE that frees the partitions
// (statement_timeout): it runs after the wait, and could wait for locks of
// its own (lock_timeout applies to each wait, not to the statement).
const releaseUpdateTimeout = 500 * time.Millisecond

// releaseServerMargin is what the release keeps of its time after the
// wait, so that the server gives up before the client's deadline: the
// UPDATE's statement_timeout and half a second for the server's answer to
// arrive. The connection then goes back to the pool instead of being
// dropped mid-statement.
const releaseServerMargin = releaseUpdateTimeout + 500*time.Millisecond

// releaseTimeouts are releaseClaim's time limits (the constants above);
// tests shorten them.
type releaseTimeouts struct {
	total, cancel, lock time.Duration
}

// The statements of releaseClaim. terminateClaimSQL ends the claim
// connection's backend (process ID $1) and waits up to $2 ms for it to
// exit, if it is this database's and this login role's (the role a
// backend is listed under, whatever SET ROLE made the current one). cancelClaimSQL cancels the claim's
// statement if the claim's transaction still runs (it holds the advisory
// lock of the token, $1). The others are sent together (one implicit
// transaction): the first sets lock_timeout for that transaction only (like
// SET LOCAL, but with the value as a parameter), the second waits until
// the claim's transaction has ended, committed or not; the third sets
// statement_timeout, likewise, for the fourth, which, with a snapshot taken
// after the wait, frees whatever the claim leased and forgets the ids it
// recorded as handed out: no handler saw them.
const (
	terminateClaimSQL = `SELECT pg_terminate_backend(a.pid, $2)
FROM pg_stat_activity AS a
WHERE a.pid = $1
  AND a.pid <> pg_backend_pid()
  AND a.datname = current_database()
  AND a.usename = session_user`
	cancelClaimSQL = `SELECT pg_cancel_backend(l.pid)
FROM pg_locks AS l
WHERE l.locktype = 'advisory'
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.objsubid = 1
  AND ((l.classid::int8 << 32) | l.objid::int8) = $1
  AND l.granted
  AND l.pid <> pg_backend_pid()`
	releaseLockTimeoutSQL   = `SELECT set_config('lock_timeout', $1::text, true)`
	releaseUpdateTimeoutSQL = `SELECT set_config('statement_timeout', $1::text, true)`
	releaseClaimSQL         = `UPDATE %s SET owner = NULL, leased_until = NULL, inflight = '{}' WHERE owner = $1`
)

// serverAnswered reports whether err is PostgreSQL's own answer, not a
// connection that failed (a connection exception, class 08, is
// PgBouncer's report of a broken server connection).
func serverAnswered(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && !strings.HasPrefix(pgErr.Code, "08")
}

// claimStillHeld reports whether a release failed at its timeouts waiting
// for the cut-off claim to end (lock_timeout, statement_timeout), rather
// than for want of a database to run it.
func claimStillHeld(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == pgLockNotAvailable || pgErr.Code == pgQueryCanceled)
}

// releaseFailed logs a release of a cut-off claim that failed: its
// partitions stay leased until the lease ends, unless retry says it is
// tried again before the next claim.
func (r *Relay) releaseFailed(err error, retry bool) {
	msg := "outbox relay could not release the partitions of a failed claim; they stay leased until the lease ends"
	if retry {
		msg = "outbox relay could not release the partitions of a failed claim; retrying before each claim until the lease ends"
	}
	r.logger.Warn(msg, slog.String("error", err.Error()), slog.Duration("lease", r.cfg.LeaseDuration))
}

// releaseClaim frees the partitions a failed claim may have leased to token
// (see claimOnce), sent on the connection whose backend process ID the
// server gave as backend (0: none to end). It returns why it could not.
func (r *Relay) releaseClaim(ctx context.Context, token uuid.UUID, backend uint32) error {
	ctx, cancel := context.WithTimeout(ctx, r.releaseTimeouts.total)
	defer cancel()
	key := claimLockKey(token)
	// A claim whose statements have not reached its backend yet (still in
	// the network, or in a backend not yet scheduled) holds no lock for the
	// wait below to find: it would run, and commit, after the release,
	// leasing its partitions to nobody. Its connection is being closed
	// anyway: end its backend, waiting for it to exit, so that the claim
	// either ran before the wait or never runs. Sent on its own, like the
	// cancel below, and for the same reason: under SET ROLE the current
	// role may not signal the login role's backends, and the late claim
	// is then not stopped. Nor is it behind PgBouncer, where the process
	// ID is PgBouncer's own key, which names no backend (the same database
	// and login role make one it could name unlikely). Its lease then
	// runs out.
	if backend != 0 {
		termCtx, termCancel := context.WithTimeout(ctx, r.releaseTimeouts.cancel)
		// The server waits for the exit half as long as the client waits
		// for the server.
		_, err := r.pool.Exec(termCtx, terminateClaimSQL, int64(backend), (r.releaseTimeouts.cancel / 2).Milliseconds())
		termCancel()
		if err != nil {
			r.logger.Debug("outbox relay could not end a cut-off claim's backend; cancelling it",
				slog.String("error", err.Error()))
		}
	}
	// Sent on its own: pg_cancel_backend raises an ERROR when this session's
	// current role lacks the privileges of the claim's login role (under SET
	// ROLE, for example), which would abort the release with it. Without the
	// cancel the release still waits for the claim to end by itself.
	cancelCtx, cancelCancel := context.WithTimeout(ctx, r.releaseTimeouts.cancel)
	_, err := r.pool.Exec(cancelCtx, cancelClaimSQL, key)
	cancelCancel()
	if err != nil {
		r.logger.Debug("outbox relay could not cancel a cut-off claim; waiting for it to end",
			slog.String("error", err.Error()))
	}
	conn, err := r.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	// The wait gets the time left, less the margin, measured once the
	// connection is at hand: the server gives up before the client does.
	deadline, _ := ctx.Deadline()
	wait := min(r.releaseTimeouts.lock, time.Until(deadline)-releaseServerMargin)
	if wait < time.Millisecond {
		// lock_timeout 0 would mean no limit at all.
		return fmt.Errorf("no time left to wait for the claim to end: %w", context.DeadlineExceeded)
	}
	b := &pgx.Batch{}
	b.Queue(releaseLockTimeoutSQL, fmt.Sprintf("%dms", wait.Milliseconds()))
	b.Queue(claimLockSQL, key)
	b.Queue(releaseUpdateTimeoutSQL, fmt.Sprintf("%dms", releaseUpdateTimeout.Milliseconds()))
	b.Queue(r.releaseSQL, pgUUID(token))
	return conn.SendBatch(ctx, b).Close()
}

// handle calls the handler and always returns one result per record: a
// handler error, a wrong number of results or a panic fails every record.
func (r *Relay) handle(ctx context.Context, batch []Record) (results []Result) {
	failAll := func(err error) []Result {
		out := make([]Result, len(batch))
		for i := range out {
			out[i].Err = err
		}
		return out
	}
	defer func() {
		if p := recover(); p != nil {
			r.logger.Error("outbox handler panicked", slog.Any("panic", p), slog.Int("batch", len(batch)))
			results = failAll(fmt.Errorf("%w: panic: %v", ErrHandlerContract, p))
		}
	}()
	results, err := r.handler.Handle(ctx, batch)
	switch {
	case err != nil:
		return failAll(safeError(err))
	case len(results) != len(batch):
		return failAll(fmt.Errorf("%w: %d results for a batch of %d", ErrHandlerContract, len(results), len(batch)))
	}
	for i := range results {
		if results[i].Err != nil {
			results[i].Err = safeError(results[i].Err)
		}
	}
	return results
}

// safeError returns err, or an ErrHandlerContract error in its place when
// err.Error() panics (typically a nil *T stored in the error interface):
// settle calls Error() outside the recover above, and one bad error value
// must not take the relay's process down with its batch still leased.
func safeError(err error) (safe error) {
	defer func() {
		if p := recover(); p != nil {
			safe = fmt.Errorf("%w: the handler's error (%T) panicked in Error(): %v", ErrHandlerContract, err, p)
		}
	}()
	_ = err.Error()
	return err
}

// settleWithin runs settle, its wait for a pool connection included,
// within settleTimeout, or until the lease that began at start ends if that
// is later, unless Run is shutting down (claimCtx ended): then within
// settleTimeout from the shutdown's start at the latest, as the package
// documentation's bound on Run's return counts it.
func (r *Relay) settleWithin(claimCtx, workCtx context.Context, start time.Time, token uuid.UUID, batch []Record, results []Result, stopping bool) error {
	by := time.Now().Add(r.settleTimeout)
	if claimCtx.Err() == nil {
		by = later(by, start.Add(r.cfg.LeaseDuration))
	}
	ctx, cancel := context.WithDeadline(context.WithoutCancel(workCtx), by)
	defer cancel()
	// As Run's grace timer: the function context.AfterFunc runs on a
	// goroutine of its own is waited for, so that neither it nor its timer
	// outlives the settle.
	var cut *time.Timer
	cutStarted := make(chan struct{})
	stopCut := context.AfterFunc(claimCtx, func() {
		defer close(cutStarted)
		cut = time.AfterFunc(r.settleTimeout, cancel)
	})
	defer func() {
		if !stopCut() {
			<-cutStarted
			cut.Stop()
		}
	}()
	return r.settle(ctx, token, batch, results, stopping)
}

// settle records the outcome of every record of the batch in one statement.
func (r *Relay) settle(ctx context.Context, token uuid.UUID, batch []Record, results []Result, stopping bool) error {
	var (
		acked                 []int64
		retryIDs, retryDelays []int64
		retryErrs             []string
		retryAttempts         []int32
		deadIDs               []int64
		deadErrs              []string
		deadAttempts          []int32
		released              []int64
		dead, retry           []int // indexes into batch, logged once settled
		want                  = make(map[int64]bool, len(batch))
		failedCount           int
		firstErr              error
	)
	for i, rec := range batch {
		want[rec.ID] = true
		err := results[i].Err
		switch {
		case err == nil:
			acked = append(acked, rec.ID)
		case stopping:
			released = append(released, rec.ID)
		case rec.Attempts >= r.cfg.MaxAttempts:
			deadIDs = append(deadIDs, rec.ID)
			deadErrs = append(deadErrs, errorText(err))
			deadAttempts = append(deadAttempts, int32(rec.Attempts))
			dead = append(dead, i)
		default:
			retryIDs = append(retryIDs, rec.ID)
			retryErrs = append(retryErrs, errorText(err))
			retryDelays = append(retryDelays, r.backoff(rec.Attempts).Microseconds())
			retryAttempts = append(retryAttempts, int32(rec.Attempts))
			failedCount++
			if firstErr == nil {
				firstErr = err
			}
			retry = append(retry, i)
		}
	}
	if failedCount > 0 {
		// One line per batch, not per row, and at most one a second: an
		// outage of the handler's target (Redis down, NOAUTH) must be
		// visible at the default level long before rows reach the
		// dead-letter table, without a line per batch of new rows.
		if log, suppressed := r.batchFailures.Allow(); log {
			r.logger.Warn("outbox batch had failures; rows will be retried after a backoff",
				slog.Int("failed", failedCount), slog.Int("batch", len(batch)), slog.String("first_error", firstErr.Error()),
				slog.Int64(lograte.Suppressed, suppressed))
		}
	}
	args := []any{pgUUID(token), nonNil(acked), nonNil(retryIDs), nonNil(retryErrs),
		nonNil(retryDelays), nonNil(deadIDs), nonNil(deadErrs), nonNil(released), nonNil(retryAttempts), nonNil(deadAttempts),
		r.names.Channel}
	if len(r.cfg.Streams) > 0 {
		args = append(args, r.cfg.Streams) // settleOthers
	}
	type settledRow struct {
		id   int64
		kept bool // to bury, but its id is in the dead-letter table: retried
	}
	var settled []settledRow
	for attempt := 1; ; attempt++ {
		rows, err := r.pool.Query(ctx, r.settleSQL, args...)
		if err == nil {
			settled, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (settledRow, error) {
				var s settledRow
				return s, row.Scan(&s.id, &s.kept)
			})
		}
		if err == nil {
			break
		}
		// A serialization failure or a deadlock (a pool whose default
		// isolation is stricter than READ COMMITTED, racing a claim), or a
		// lock wait past the session's lock_timeout, rolled the statement
		// back whole: run it again rather than leave the handled rows
		// leased, their attempt counted as a crash.
		var pgErr *pgconn.PgError
		if attempt < settleRetries && ctx.Err() == nil && errors.As(err, &pgErr) &&
			(pgErr.Code == pgSerializationFailure || pgErr.Code == pgDeadlockDetected || pgErr.Code == pgLockNotAvailable) {
			continue
		}
		return mapError("settle batch", err)
	}
	kept := make(map[int64]bool)
	for _, s := range settled {
		delete(want, s.id)
		if s.kept {
			kept[s.id] = true
		}
	}
	// Only now, and only for the rows the statement settled: a row whose
	// partition another relay took over was neither buried nor rescheduled.
	for _, i := range dead {
		rec := batch[i]
		switch {
		case want[rec.ID]:
		case kept[rec.ID]:
			r.logger.Warn("outbox row not moved to dead letters: its id is already a dead letter (the outbox's ids were reset); retried after RetryBackoffMax",
				slog.Int64("id", rec.ID), slog.String("event_id", rec.EventID.String()),
				slog.String("stream", rec.Stream), slog.Int("attempts", rec.Attempts), slog.String("error", results[i].Err.Error()))
		default:
			r.logger.Warn("outbox row moved to dead letters", slog.Int64("id", rec.ID), slog.String("event_id", rec.EventID.String()),
				slog.String("stream", rec.Stream), slog.Int("attempts", rec.Attempts), slog.String("error", results[i].Err.Error()))
		}
	}
	for _, i := range retry {
		if rec := batch[i]; !want[rec.ID] {
			r.logger.Debug("outbox row failed; will retry", slog.Int64("id", rec.ID), slog.Int("attempts", rec.Attempts),
				slog.String("error", results[i].Err.Error()))
		}
	}
	settledCount := func(ids []int64) int {
		n := 0
		for _, id := range ids {
			if !want[id] {
				n++
			}
		}
		return n
	}
	nAcked, nRetry, nDead, nReleased := settledCount(acked), settledCount(retryIDs)+len(kept), settledCount(deadIDs)-len(kept), settledCount(released)
	if r.metrics.enabled {
		r.metrics.settled(ctx, nAcked, nRetry, nDead, nReleased, len(want))
	}
	r.logger.Debug("outbox batch settled", slog.Int("acked", nAcked), slog.Int("retry", nRetry),
		slog.Int("dead", nDead), slog.Int("released", nReleased), slog.Int("lost", len(want)))
	if len(want) > 0 {
		lost := make([]int64, 0, len(want))
		for id := range want {
			lost = append(lost, id)
		}
		slices.Sort(lost)
		return &LeaseLostError{IDs: lost}
	}
	return nil
}

// settleRetries bounds the runs of a settle statement that PostgreSQL
// rolled back whole: a serialization failure, a deadlock or a lock wait
// past the session's lock_timeout.
const settleRetries = 5

// backoff is the delay before the attempt following attempt number attempts
// (1-based): RetryBackoffMin doubled per attempt, capped at RetryBackoffMax,
// jittered uniformly within its upper half.
func (r *Relay) backoff(attempts int) time.Duration {
	d := r.cfg.RetryBackoffMin
	for i := 1; i < attempts && d < r.cfg.RetryBackoffMax; i++ {
		d = doubled(d, r.cfg.RetryBackoffMax)
	}
	return jittered(min(d, r.cfg.RetryBackoffMax))
}

// jittered returns a duration drawn uniformly from the upper half of d, so
// that relays started by one event do not all act again at one instant.
func jittered(d time.Duration) time.Duration {
	half := d / 2
	return half + rand.N(d-half+1)
}

// errorText makes a handler error storable in a text column.
func errorText(err error) string {
	s := strings.ToValidUTF8(err.Error(), "\uFFFD")
	s = strings.ReplaceAll(s, "\x00", "")
	if len(s) > maxErrorLength {
		s = strings.ToValidUTF8(s[:maxErrorLength], "")
	}
	return s
}

// nonNil turns a nil slice into an empty one: pgx encodes a nil slice as
// NULL, and unnest(NULL) or "= ANY(NULL)" would be fine but is less obvious.
func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}

// Run delivers rows until ctx is cancelled, then shuts down gracefully and
// returns nil. It returns ErrRelayRunning if the relay is already running.
//
// Run claims a batch whenever it is notified (Writer.Append notifies on
// commit), every PollInterval, and immediately again after a full batch
// (rows its claim moved to the dead-letter table count toward it, see
// RunOnce).
// After a database error it pauses (see RelayConfig.ReconnectBackoffMax)
// and then claims, whether or not it was notified meanwhile. Only
// one batch is in flight per relay; run several relays for parallelism. When
// ctx is cancelled Run claims nothing more, lets the in-flight batch (a claim
// already sent included) finish and settles it; if the Handler has not
// returned after ShutdownTimeout, its context is cancelled and the rows it
// did not complete are released (not counted as failures). Run returns
// only after its goroutines have exited, so the Handler must honour its
// context.
func (r *Relay) Run(ctx context.Context) error {
	if r.unmade() {
		return errUnmadeRelay()
	}
	if !r.running.CompareAndSwap(false, true) {
		return ErrRelayRunning
	}
	defer r.running.Store(false)

	// workCtx outlives ctx by at most ShutdownTimeout.
	workCtx, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()
	// The grace timer is started when ctx ends, by a function that
	// context.AfterFunc runs on a goroutine of its own: Run waits for that
	// function before it stops the timer, so that neither outlives Run.
	var graceTimer *time.Timer
	graceStarted := make(chan struct{})
	stopGrace := context.AfterFunc(ctx, func() {
		defer close(graceStarted)
		graceTimer = time.AfterFunc(r.cfg.ShutdownTimeout, cancelWork)
	})
	defer func() {
		if !stopGrace() {
			<-graceStarted
			graceTimer.Stop()
		}
	}()

	wake := make(chan struct{}, 1)
	var wg sync.WaitGroup
	defer wg.Wait()
	if r.metrics.enabled {
		reg, err := r.registerGauges()
		if err != nil {
			return fmt.Errorf("outbox: relay metrics: %w", err)
		}
		defer func() { _ = reg.Unregister() }()
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.refreshStats(ctx, workCtx)
		}()
	}
	switch {
	case r.cfg.DisableNotify:
	case r.cfg.Listener != nil:
		// Notifications are of no use once ctx ends: the relay leaves
		// then, so that closing the shared connection (when it is the
		// last to leave) overlaps the batch in flight, with the same
		// grace as the relay's own connection would get.
		unsubscribe := r.cfg.Listener.subscribe(r.serves, wake)
		left := make(chan struct{})
		stopLeave := context.AfterFunc(ctx, func() {
			defer close(left)
			unsubscribe(r.cfg.ShutdownTimeout)
		})
		defer func() {
			if stopLeave() {
				unsubscribe(r.cfg.ShutdownTimeout)
			} else {
				<-left
			}
		}()
	default:
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.listen(ctx, workCtx, wake)
		}()
	}

	r.logger.Info("outbox relay started", slog.String("channel", r.names.Channel))
	defer r.logger.Info("outbox relay stopped")

	errPause := newPauser(r.cfg.ReconnectBackoffMax)
	// heldPause spaces the claims while rows this relay could take wait in
	// partitions other relays hold (claimSoon): a batch's settle notifies
	// only some of the rows it leaves (see settleSQL). It is jittered,
	// because relays woken together (a reconnected Listener, a write of
	// many streams) find their rows held together and would otherwise
	// collide again at every doubling, and capped at heldPauseMax, a
	// backstop for rows a settle does not announce.
	heldPause := newPauser(min(r.cfg.PollInterval, heldPauseMax))
	for {
		n, again, err := r.runBatch(ctx, workCtx)
		if errors.Is(err, ErrLeaseLost) {
			// The settle committed: the rows of the lost lease are another
			// relay's now, and the batch counts as any other (a full one
			// claims again at once).
			r.logger.Warn("outbox relay lost a lease; another relay owns those rows", slog.String("error", err.Error()))
			err = nil
		}
		switch {
		case ctx.Err() != nil:
			// The last batch (n > 0) may have failed to settle, which must
			// not go unnoticed; an error without a batch is only the claim
			// seeing ctx end.
			if n > 0 && err != nil {
				r.logger.Error("outbox relay could not settle its last batch at shutdown; its rows are delivered again when their lease ends",
					slog.String("error", err.Error()), slog.Int("batch", n))
			}
			return nil
		case err != nil:
			pause := errPause.next()
			r.logger.Error("outbox relay batch failed", slog.String("error", err.Error()), slog.Duration("pause", pause))
			// Notifications do not cut the pause short: every commit sends
			// one, so a failing database would be retried (and logged) per
			// commit. The claim that follows sees every row committed
			// before it, so a notification left pending meanwhile is spent.
			if !sleep(ctx, pause) {
				return nil
			}
			select {
			case <-wake:
			default:
			}
			continue
		case again == claimNow:
			errPause.reset()
			heldPause.reset()
			continue // a full batch, or more partitions than one claim takes
		default:
			errPause.reset()
		}
		wait := r.cfg.PollInterval
		if again == claimSoon {
			wait = jittered(heldPause.next())
		} else {
			heldPause.reset()
		}
		timer := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil
		case <-wake:
		case <-timer.C:
		}
		timer.Stop()
	}
}

// heldPauseMax caps the pause between claims while rows this relay could
// take wait in partitions other relays hold.
const heldPauseMax = 2 * time.Second

// pauser produces exponentially growing pauses: 100ms, 200ms, … up to
// ceiling.
type pauser struct {
	ceiling, cur time.Duration
}

const pauseMin = 100 * time.Millisecond

func newPauser(ceiling time.Duration) *pauser { return &pauser{ceiling: ceiling} }

func (p *pauser) next() time.Duration {
	if p.cur == 0 {
		p.cur = min(pauseMin, p.ceiling)
	} else {
		p.cur = doubled(p.cur, p.ceiling)
	}
	return p.cur
}

func (p *pauser) reset() { p.cur = 0 }

// doubled returns 2d capped at limit, without overflowing when limit is
// close to the largest Duration (a "no cap" setting).
func doubled(d, limit time.Duration) time.Duration {
	if d > limit/2 {
		return limit
	}
	return 2 * d
}

// sleep waits for d or until ctx is done; it reports whether ctx is still live.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

func randomSuffix() string { return strings.ReplaceAll(uuid.NewString(), "-", "")[:10] }

// later returns the later of a and b.
func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
