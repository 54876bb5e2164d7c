package leaderboard

import (
	"context"
	"errors"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/verity-go/verity/internal/telemetry"
)

// Attributes of the package's instruments. Boards are bounded in number;
// user ids and event ids are never attributes. Every instrument carries the
// board's Name and Schema: boards of the same name in different schemas
// (one per tenant) are different boards, and report apart.
const (
	AttributeBoard   = "verity.leaderboard.board"
	AttributeSchema  = "verity.leaderboard.schema"
	AttributeOutcome = "verity.leaderboard.outcome"
	AttributeSource  = "verity.leaderboard.source"
)

// Outcomes of verity.leaderboard.submits and verity.leaderboard.reads.
const (
	outcomeApplied    = "applied"
	outcomeStaged     = "staged"
	outcomeDuplicate  = "duplicate"
	outcomeConflict   = "conflict"
	outcomeConcurrent = "concurrent"
	outcomeInvalid    = "invalid"
	outcomeOutOfRange = "out_of_range"
	outcomeError      = "error"
	outcomeOK         = "ok"
	outcomeStale      = "stale"
	outcomeNotFound   = "not_found"
)

const (
	metricSubmits = "verity.leaderboard.submits"
	metricReads   = "verity.leaderboard.reads"
	metricLag     = "verity.leaderboard.lag"
)

// boardMetrics holds a board's instruments; nil records nothing.
type boardMetrics struct {
	board   []attribute.KeyValue // name and schema
	submits metric.Int64Counter
	reads   metric.Int64Counter

	lagGauge *telemetry.Once // the lag gauge's callback
	prefetch lagPrefetch     // starts the gauge's measurement ahead of a collection
}

// newBoardMetrics creates the board's instruments. lag returns the lag to
// report, or false for none (see Board.observedLag); it is called at
// collection time, and by the gauge's prefetch with an ended context, which
// starts a measurement that is due without waiting for it.
func newBoardMetrics(c *Config, lag func(context.Context) (time.Duration, bool)) (*boardMetrics, error) {
	if !telemetry.Enabled(c.MeterProvider) {
		return nil, nil
	}
	in := telemetry.New(c.MeterProvider, "leaderboard")
	board := []attribute.KeyValue{attribute.String(AttributeBoard, c.Name), attribute.String(AttributeSchema, c.Schema)}
	m := &boardMetrics{
		board: board,
		submits: in.Counter(metricSubmits, "{command}",
			"Score commands by outcome: applied (committed by the board: Submit, SubmitBatch), staged (SubmitTx, SubmitBatchTx: written in the caller's transaction, whose commit or rollback the board does not see), duplicate, conflict (event id reused for another command), concurrent (SubmitTx or SubmitBatchTx lost to a twin), invalid, out_of_range, error."),
		reads: in.Counter(metricReads, "{read}",
			"Reads (Top, Page, Rank, Around) by the store that answered (redis, postgres; none on error, and for a user id no store can hold) and outcome (ok; stale: refused by FailClosed, or an unmet AtLeast whose user is not in Redis; not_found; error). Reads refused for invalid input (limit, cursor, ReadOption) before any store is read are not counted."),
	}
	gauge := in.Float64ObservableGauge(metricLag, "s",
		"Projection lag of the board's stream as reads measure it (age of the oldest pending outbox row, or dead letter not yet overtaken in Redis by a newer version of its user, on the database's clock; measured at most once per LagProbeInterval); absent while it cannot be measured.")
	if err := in.Err(); err != nil {
		return nil, err
	}
	boardOp := metric.WithAttributeSet(attribute.NewSet(board...))
	prefetch := func() {
		ended, cancel := context.WithCancel(context.Background())
		cancel()
		lag(ended)
	}
	reg, err := in.Meter().RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		m.prefetch.schedule(time.Now(), prefetch)
		if d, ok := lag(ctx); ok {
			o.ObserveFloat64(gauge, d.Seconds(), boardOp)
		}
		return nil
	}, gauge)
	if err != nil {
		return nil, err
	}
	m.lagGauge = telemetry.NewOnce(reg)
	return m, nil
}

// close unregisters the lag gauge's callback and stops its prefetch; later
// calls do nothing. A prefetch that has started a measurement has
// registered it with the board's group (Board.Close waits for it) before
// close returns.
func (m *boardMetrics) close() error {
	if m == nil {
		return nil
	}
	err := m.lagGauge.Unregister() // waits for a collection under way
	m.prefetch.stop()
	return err
}

// lagPrefetch starts the lag gauge's measurement lagGaugeWait before the
// collection it expects next, a collection interval after the last one,
// so that when the database stops answering, the measurement of every
// board is already under way when the collection comes, and none waits
// for it (Board.observedLag); when it answers, the collection finds the
// measurement done. It keeps one timer, which fires at most once per
// collection and which close stops; a board dropped without Close makes
// at most one measurement after its provider's last collection.
type lagPrefetch struct {
	mu     sync.Mutex
	last   time.Time   // when the last collection called the callback; zero before the first
	timer  *time.Timer // nil before the first prefetch is scheduled
	closed bool
}

// schedule records a collection at now and sets the timer to run start
// lagGaugeWait before the next one is due, a collection interval after
// now, when the interval since the previous collection is longer than
// lagGaugeWait. A shorter interval (a second reader collecting right after
// the first) leaves the timer as it is.
func (p *lagPrefetch) schedule(now time.Time, start func()) {
	p.mu.Lock()
	defer p.mu.Unlock()
	prev := p.last
	p.last = now
	if p.closed || prev.IsZero() {
		return
	}
	delay := now.Sub(prev) - lagGaugeWait
	if delay <= 0 {
		return
	}
	if p.timer == nil {
		p.timer = time.AfterFunc(delay, func() {
			p.mu.Lock()
			defer p.mu.Unlock()
			if !p.closed {
				start()
			}
		})
		return
	}
	p.timer.Reset(delay)
}

// stop stops the timer for good. A prefetch that fired already either
// waits for stop and does nothing, or has started its measurement when
// stop returns.
func (p *lagPrefetch) stop() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	if p.timer != nil {
		p.timer.Stop()
	}
}

// submitted counts n commands that ended with err (or, without error, as
// duplicates or written). written is the outcome of a command written
// without error: outcomeApplied when the board committed it, outcomeStaged
// when the caller's transaction will commit it, or roll it back, unseen.
func (m *boardMetrics) submitted(ctx context.Context, n int, written string, duplicate bool, err error) {
	if m == nil || n == 0 {
		return
	}
	outcome := written
	var conflict *IdempotencyConflictError
	switch {
	case err == nil && duplicate:
		outcome = outcomeDuplicate
	case err == nil:
	case errors.As(err, &conflict), errors.Is(err, ErrIdempotencyConflict):
		outcome = outcomeConflict
	case errors.Is(err, ErrConcurrentSubmit):
		outcome = outcomeConcurrent
	case errors.Is(err, ErrInvalidCommand):
		outcome = outcomeInvalid
	case errors.Is(err, ErrScoreOutOfRange):
		outcome = outcomeOutOfRange
	default:
		outcome = outcomeError
	}
	m.submits.Add(ctx, int64(n), metric.WithAttributes(append(m.board[:len(m.board):len(m.board)], attribute.String(AttributeOutcome, outcome))...))
}

// read counts one read.
func (m *boardMetrics) read(ctx context.Context, fresh Freshness, err error) {
	if m == nil {
		return
	}
	source, outcome := string(fresh.Source), outcomeOK
	switch {
	case err == nil:
	case errors.Is(err, ErrStale):
		source, outcome = "none", outcomeStale
	case errors.Is(err, ErrUserNotFound):
		outcome = outcomeNotFound
		if source == "" {
			source = "none"
		}
	default:
		source, outcome = "none", outcomeError
	}
	m.reads.Add(ctx, 1, metric.WithAttributes(append(m.board[:len(m.board):len(m.board)],
		attribute.String(AttributeSource, source), attribute.String(AttributeOutcome, outcome))...))
}
