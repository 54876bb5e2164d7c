package outbox

import (
	"cmp"
	"context"
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
	"github.com/jackc/pgx/v5/pgxpool"
)

// settleTimeout bounds the statement that acknowledges, retries, buries and
// releases a batch. It runs on a context detached from cancellation, so that
// work finished during shutdown is still recorded.
const settleTimeout = 10 * time.Second

// maxErrorLength bounds the handler error text stored in last_error.
const maxErrorLength = 4096

// Relay delivers outbox rows to a Handler. It claims due rows with a lease in
// one statement, calls the Handler with no transaction open, and settles the
// batch (acknowledge, retry later, or dead-letter) in one more statement that
// only touches rows still carrying its claim token. Any number of relays, in
// any number of processes, may serve the same outbox.
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
	running atomic.Bool

	metrics   *relayMetrics
	lastStats atomic.Pointer[statsSample] // latest Stats result, for the gauges

	claimSQL  string
	settleSQL string
}

// NewRelay returns a Relay that hands rows of the outbox described by cfg
// (nil means defaults) to handler. It does not touch the database.
func NewRelay(pool *pgxpool.Pool, handler Handler, cfg *RelayConfig) (*Relay, error) {
	if pool == nil {
		return nil, &ConfigError{Field: "pool", Reason: "is nil; pass the *pgxpool.Pool of the outbox's database"}
	}
	if handler == nil {
		return nil, &ConfigError{Field: "handler", Reason: "is nil; pass the Handler that projects the records"}
	}
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	n := newNames(cfg.Schema, cfg.Table)
	streamFilter := ""
	if len(cfg.Streams) > 0 {
		streamFilter = "\n      AND stream = ANY($4::text[])"
	}
	metrics, err := newRelayMetrics(cfg)
	if err != nil {
		return nil, fmt.Errorf("outbox: NewRelay: %w", err)
	}
	ack := fmt.Sprintf(ackDeleteSQL, n.Outbox)
	if cfg.KeepPublished {
		ack = fmt.Sprintf(ackKeepSQL, n.Outbox)
	}
	async := asyncCommitClause
	if cfg.DurableBookkeeping {
		async = ""
	}
	return &Relay{
		pool:      pool,
		handler:   handler,
		cfg:       *cfg,
		names:     n,
		logger:    cfg.Logger.With(slog.String("relay", cfg.Name)),
		metrics:   metrics,
		claimSQL:  fmt.Sprintf(claimSQL, n.Outbox, streamFilter, async),
		settleSQL: fmt.Sprintf(settleSQL, ack, n.Outbox, n.Dead, async),
	}, nil
}

// Config returns the relay's configuration with defaults applied.
func (r *Relay) Config() RelayConfig { return *r.cfg.WithDefaults() }

// claimSQL leases up to $3 due rows in one statement. The MATERIALIZED CTE
// picks and locks the rows exactly once (SKIP LOCKED: rows another relay is
// claiming at this instant are left to it); the UPDATE stamps them with this
// batch's token and sets leased_until, which keeps other relays away once
// this statement commits. The scan follows the (available_at, id) partial
// index up to now(), so rows backing off are never visited; rows under a
// live lease are visited and skipped, at most relays × BatchSize of them.
// Only unindexed columns change, so the update can be HOT. The ids are
// matched with "= ANY(ARRAY(…))" rather than a join: with a join, the generic
// plan that a prepared statement switches to after a few executions estimates
// LIMIT $3 at a tenth of the table and may hash-join against a sequential
// scan of the whole outbox; an id array always probes the primary key.
const claimSQL = `WITH due AS MATERIALIZED (
    SELECT id FROM %[1]s
    WHERE published_at IS NULL
      AND available_at <= now()
      AND (leased_until IS NULL OR leased_until <= now())%[2]s
    ORDER BY available_at, id
    LIMIT $3
    FOR UPDATE SKIP LOCKED
)
UPDATE %[1]s AS o
SET claim_token = $1,
    leased_until = now() + $2 * interval '1 microsecond',
    attempts = o.attempts + 1
WHERE o.id = ANY(ARRAY(SELECT id FROM due))%[3]s
RETURNING o.id, o.event_id, o.stream, o.key, o.version, o.payload, o.created_at, o.attempts`

// asyncCommitClause makes the statement it is part of commit with
// synchronous_commit = off unless RelayConfig.DurableBookkeeping is set.
// set_config(…, true) sets the parameter for the current transaction only,
// which for a statement sent on its own is the statement's implicit
// transaction: PostgreSQL reads synchronous_commit when that transaction
// commits, right after the statement, and resets it at the transaction's
// end, so the setting never outlives the statement on the pooled connection.
// The subquery has no column references, so the planner evaluates it once,
// as a one-time filter, whether or not any row qualifies; it is in a part of
// each statement that always runs (the claim's UPDATE, the settle's last
// data-modifying CTE).
const asyncCommitClause = `
      AND (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL`

// The acknowledgement variants; both only touch rows still holding the
// batch's claim token ($1).
const (
	ackDeleteSQL = `DELETE FROM %s WHERE id = ANY($2::bigint[]) AND claim_token = $1 RETURNING id`
	ackKeepSQL   = `UPDATE %s SET published_at = now(), claim_token = NULL, leased_until = NULL
    WHERE id = ANY($2::bigint[]) AND claim_token = $1 RETURNING id`
)

// settleSQL records a whole batch's outcome in one statement: acknowledged
// rows ($2), rows to retry with their error and delay ($3-$5), rows to bury in
// the dead-letter table with their error ($6-$7) and rows to release for
// immediate re-delivery ($8). Every part requires the batch's claim token, so
// rows that another relay re-claimed after this relay's lease expired are
// left alone; the ids returned are those actually settled.
const settleSQL = `WITH acked AS (
    %[1]s
),
retried AS (
    UPDATE %[2]s AS o
    SET claim_token = NULL,
        leased_until = NULL,
        last_error = f.err,
        available_at = now() + f.delay_us * interval '1 microsecond'
    FROM unnest($3::bigint[], $4::text[], $5::bigint[]) AS f(id, err, delay_us)
    WHERE o.id = f.id AND o.claim_token = $1
    RETURNING o.id
),
buried AS (
    DELETE FROM %[2]s AS o
    USING unnest($6::bigint[], $7::text[]) AS f(id, err)
    WHERE o.id = f.id AND o.claim_token = $1
    RETURNING o.id, o.event_id, o.stream, o.key, o.version, o.payload, o.created_at, o.attempts, f.err
),
dead AS (
    INSERT INTO %[3]s (id, event_id, stream, key, version, payload, created_at, attempts, last_error)
    SELECT id, event_id, stream, key, version, payload, created_at, attempts, err FROM buried
    RETURNING id
),
released AS (
    UPDATE %[2]s
    SET claim_token = NULL, leased_until = NULL
    WHERE id = ANY($8::bigint[]) AND claim_token = $1%[4]s
    RETURNING id
)
SELECT id FROM acked
UNION ALL SELECT id FROM retried
UNION ALL SELECT id FROM dead
UNION ALL SELECT id FROM released`

// RunOnce claims one batch of due rows, hands it to the Handler and settles
// it. It returns the number of rows claimed (0 when nothing was due).
//
// The Handler's context is ctx, bounded by the lease. If ctx is cancelled
// while the Handler runs, the rows it fails are released for immediate
// re-delivery instead of being retried after a backoff. Settling runs even
// after ctx is cancelled (bounded by 10s), so completed work is recorded.
//
// A non-nil error with a positive count means the batch was handled but not
// entirely settled: a *LeaseLostError (errors.Is(err, ErrLeaseLost)) lists
// rows another relay had re-claimed; any other error leaves the rows to be
// re-delivered when their lease expires.
func (r *Relay) RunOnce(ctx context.Context) (int, error) {
	return r.runBatch(ctx, ctx)
}

// runBatch claims with claimCtx (no new claims once it is cancelled) and
// runs the handler under workCtx, which Run cancels only when the shutdown
// timeout has passed.
func (r *Relay) runBatch(claimCtx, workCtx context.Context) (int, error) {
	if err := claimCtx.Err(); err != nil {
		return 0, err
	}
	token := uuid.New()
	start := time.Now()
	// Without a deadline a half-open connection (a dead NAT entry, a proxy
	// that stopped forwarding) would block the relay forever. A claim that
	// outlives a lease is useless anyway: its rows are claimable again by then.
	boundedCtx, cancelClaim := context.WithTimeout(claimCtx, r.cfg.LeaseDuration)
	batch, err := r.claim(boundedCtx, token)
	cancelClaim()
	if err != nil || len(batch) == 0 {
		return 0, err
	}
	// The handler's deadline is measured from before the claim was sent,
	// so it ends no later than the lease on the server.
	r.metrics.claimed.Add(claimCtx, int64(len(batch)), r.metrics.attrs)
	handlerCtx, cancel := context.WithDeadline(workCtx, start.Add(r.cfg.LeaseDuration))
	handleStart := time.Now()
	results := r.handle(handlerCtx, batch)
	r.metrics.handlerDuration.Record(workCtx, time.Since(handleStart).Seconds(), r.metrics.attrs)
	cancel()
	stopping := workCtx.Err() != nil
	return len(batch), r.settle(context.WithoutCancel(workCtx), token, batch, results, stopping)
}

func (r *Relay) claim(ctx context.Context, token uuid.UUID) ([]Record, error) {
	args := []any{token, r.cfg.LeaseDuration.Microseconds(), r.cfg.BatchSize}
	if len(r.cfg.Streams) > 0 {
		args = append(args, r.cfg.Streams)
	}
	rows, err := r.pool.Query(ctx, r.claimSQL, args...)
	if err != nil {
		return nil, mapError("claim", err)
	}
	batch, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Record, error) {
		var rec Record
		err := row.Scan(&rec.ID, &rec.EventID, &rec.Stream, &rec.Key, &rec.Version, &rec.Payload, &rec.CreatedAt, &rec.Attempts)
		return rec, err
	})
	if err != nil {
		return nil, mapError("claim", err)
	}
	slices.SortFunc(batch, func(a, b Record) int { return cmp.Compare(a.ID, b.ID) })
	return batch, nil
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
		return failAll(err)
	case len(results) != len(batch):
		return failAll(fmt.Errorf("%w: %d results for a batch of %d", ErrHandlerContract, len(results), len(batch)))
	}
	return results
}

// settle records the outcome of every record of the batch in one statement.
func (r *Relay) settle(ctx context.Context, token uuid.UUID, batch []Record, results []Result, stopping bool) error {
	ctx, cancel := context.WithTimeout(ctx, settleTimeout)
	defer cancel()

	var (
		acked                    []int64
		retryIDs, retryDelays    []int64
		retryErrs                []string
		deadIDs                  []int64
		deadErrs                 []string
		released                 []int64
		want                     = make(map[int64]bool, len(batch))
		failedCount, buriedCount int
		firstErr                 error
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
			buriedCount++
			r.logger.Warn("outbox row moved to dead letters", slog.Int64("id", rec.ID),
				slog.String("event_id", rec.EventID.String()), slog.Int("attempts", rec.Attempts), slog.String("error", err.Error()))
		default:
			retryIDs = append(retryIDs, rec.ID)
			retryErrs = append(retryErrs, errorText(err))
			retryDelays = append(retryDelays, r.backoff(rec.Attempts).Microseconds())
			failedCount++
			if firstErr == nil {
				firstErr = err
			}
			r.logger.Debug("outbox row failed; will retry", slog.Int64("id", rec.ID), slog.Int("attempts", rec.Attempts), slog.String("error", err.Error()))
		}
	}
	if failedCount > 0 {
		// One line per batch, not per row: an outage of the handler's
		// target (Redis down, NOAUTH) must be visible at the default level
		// long before rows reach the dead-letter table.
		r.logger.Warn("outbox batch had failures; rows will be retried after a backoff",
			slog.Int("failed", failedCount), slog.Int("batch", len(batch)), slog.String("first_error", firstErr.Error()))
	}
	rows, err := r.pool.Query(ctx, r.settleSQL, token, nonNil(acked), nonNil(retryIDs), nonNil(retryErrs),
		nonNil(retryDelays), nonNil(deadIDs), nonNil(deadErrs), nonNil(released))
	if err != nil {
		return mapError("settle batch", err)
	}
	settled, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return mapError("settle batch", err)
	}
	for _, id := range settled {
		delete(want, id)
	}
	if r.metrics.enabled {
		settledCount := func(ids []int64) int {
			n := 0
			for _, id := range ids {
				if !want[id] {
					n++
				}
			}
			return n
		}
		r.metrics.settled(ctx, settledCount(acked), settledCount(retryIDs), settledCount(deadIDs),
			settledCount(released), len(want))
	}
	r.logger.Debug("outbox batch settled", slog.Int("acked", len(acked)), slog.Int("retry", failedCount),
		slog.Int("dead", buriedCount), slog.Int("released", len(released)), slog.Int("lost", len(want)))
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

// backoff is the delay before the attempt following attempt number attempts
// (1-based): RetryBackoffMin doubled per attempt, capped at RetryBackoffMax,
// jittered uniformly within its upper half.
func (r *Relay) backoff(attempts int) time.Duration {
	d := r.cfg.RetryBackoffMin
	for i := 1; i < attempts && d < r.cfg.RetryBackoffMax; i++ {
		d *= 2
	}
	d = min(d, r.cfg.RetryBackoffMax)
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
// commit), every PollInterval, and immediately again after a full batch. Only
// one batch is in flight per relay; run several relays for parallelism. When
// ctx is cancelled Run claims nothing more, lets the in-flight batch finish
// and settles it; if the Handler has not returned after ShutdownTimeout, its
// context is cancelled and the rows it did not complete are released (not
// counted as failures). Run returns only after its goroutines have exited,
// so the Handler must honour its context.
func (r *Relay) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return ErrRelayRunning
	}
	defer r.running.Store(false)

	// workCtx outlives ctx by at most ShutdownTimeout.
	workCtx, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()
	var graceTimer atomic.Pointer[time.Timer]
	stopGrace := context.AfterFunc(ctx, func() {
		graceTimer.Store(time.AfterFunc(r.cfg.ShutdownTimeout, cancelWork))
	})
	defer func() {
		stopGrace()
		if t := graceTimer.Load(); t != nil {
			t.Stop()
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
			r.refreshStats(ctx)
		}()
	}
	if !r.cfg.DisableNotify {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.listen(ctx, wake)
		}()
	}

	r.logger.Info("outbox relay started", slog.String("channel", r.names.Channel))
	defer r.logger.Info("outbox relay stopped")

	errPause := newPauser(r.cfg.ReconnectBackoffMax)
	for {
		n, err := r.runBatch(ctx, workCtx)
		var wait time.Duration
		switch {
		case ctx.Err() != nil:
			return nil
		case err != nil && !errors.Is(err, ErrLeaseLost):
			wait = min(errPause.next(), r.cfg.PollInterval)
			r.logger.Error("outbox relay batch failed", slog.String("error", err.Error()), slog.Duration("pause", wait))
		case err != nil:
			errPause.reset()
			r.logger.Warn("outbox relay lost a lease; another relay owns those rows", slog.String("error", err.Error()))
		case n == r.cfg.BatchSize:
			errPause.reset()
			continue // probably more due rows
		default:
			errPause.reset()
			wait = r.cfg.PollInterval
		}
		if wait == 0 {
			wait = r.cfg.PollInterval
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

// pauser produces exponentially growing pauses: 100ms, 200ms, … up to max.
type pauser struct {
	max, cur time.Duration
}

const pauseMin = 100 * time.Millisecond

func newPauser(max time.Duration) *pauser { return &pauser{max: max} }

func (p *pauser) next() time.Duration {
	if p.cur == 0 {
		p.cur = min(pauseMin, p.max)
	} else {
		p.cur = min(p.cur*2, p.max)
	}
	return p.cur
}

func (p *pauser) reset() { p.cur = 0 }

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
