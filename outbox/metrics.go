package outbox

import (
	"context"
	"log/slog"
	"math"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/verity-go/verity/internal/telemetry"
)

// Instrument names of the package (see the README's metrics table).
const (
	metricClaimed         = "verity.outbox.claimed"
	metricAcked           = "verity.outbox.acked"
	metricRetried         = "verity.outbox.retried"
	metricDeadLettered    = "verity.outbox.dead_lettered"
	metricReleased        = "verity.outbox.released"
	metricLeaseLost       = "verity.outbox.lease_lost"
	metricReplayed        = "verity.outbox.replayed"
	metricHandlerDuration = "verity.outbox.handler.duration"
	metricPending         = "verity.outbox.pending"
	metricInFlight        = "verity.outbox.in_flight"
	metricRetrying        = "verity.outbox.retrying"
	metricOldestAge       = "verity.outbox.oldest_pending_age"
	metricDeadLetters     = "verity.outbox.dead_letters"
)

// AttributeTable is the attribute naming the outbox table ("schema.table";
// quoted, "schema"."table", when either name holds a '.' or a '"')
// on every instrument of the package. Relay names are not used: they are
// random by default and would make unbounded series.
const AttributeTable = "verity.outbox.table"

// relayMetrics holds a relay's instruments, created once in NewRelay.
type relayMetrics struct {
	enabled bool
	attrs   metric.MeasurementOption // the table attribute, built once

	claimed, acked, retried, deadLettered metric.Int64Counter
	released, leaseLost, replayed         metric.Int64Counter
	handlerDuration                       metric.Float64Histogram

	pending, inFlight, retrying, deadLetters metric.Int64ObservableGauge
	oldestAge                                metric.Float64ObservableGauge
}

func newRelayMetrics(cfg *RelayConfig) (*relayMetrics, error) {
	in := telemetry.New(cfg.MeterProvider, "outbox")
	table := strings.TrimPrefix(cfg.Schema+"."+cfg.Table, ".")
	if strings.ContainsAny(cfg.Schema+cfg.Table, `."`) {
		// "a.b"."c" and "a"."b.c" would both read a.b.c: quoted, as
		// PostgreSQL writes them, no two tables share the attribute.
		table = pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()
	}
	m := &relayMetrics{
		enabled: telemetry.Enabled(cfg.MeterProvider),
		attrs:   metric.WithAttributeSet(attribute.NewSet(attribute.String(AttributeTable, table))),

		claimed:      in.Counter(metricClaimed, "{row}", "Outbox rows claimed by relays (each delivery attempt counts)."),
		acked:        in.Counter(metricAcked, "{row}", "Outbox rows acknowledged after the handler processed them; a row delivered again after PostgreSQL lost an acknowledgement it had answered (a crash under non-durable bookkeeping) counts again."),
		retried:      in.Counter(metricRetried, "{row}", "Outbox rows the handler failed that were scheduled for a retry after a backoff."),
		deadLettered: in.Counter(metricDeadLettered, "{row}", "Outbox rows moved to the dead-letter table after MaxAttempts failures."),
		released:     in.Counter(metricReleased, "{row}", "Outbox rows released unprocessed for immediate re-delivery at shutdown, or when a RunOnce context is cancelled while its Handler runs."),
		leaseLost:    in.Counter(metricLeaseLost, "{row}", "Outbox rows whose lease had expired and been taken by another relay before settling."),
		replayed:     in.Counter(metricReplayed, "{row}", "Dead letters moved back into the outbox by ReplayDead."),
		handlerDuration: in.Histogram(metricHandlerDuration, "s", "Duration of Handler calls, one per claimed batch.",
			telemetry.DurationBuckets()...),

		pending:     in.Int64ObservableGauge(metricPending, "{row}", "Outbox rows not yet acknowledged (from the relay's latest Stats snapshot)."),
		inFlight:    in.Int64ObservableGauge(metricInFlight, "{row}", "Outbox rows claimed under an unexpired lease."),
		retrying:    in.Int64ObservableGauge(metricRetrying, "{row}", "Outbox rows waiting out a retry backoff."),
		deadLetters: in.Int64ObservableGauge(metricDeadLetters, "{row}", "Rows in the dead-letter table."),
		oldestAge:   in.Float64ObservableGauge(metricOldestAge, "s", "Age of the oldest pending outbox row; the figure to alert on."),
	}
	return m, in.Err()
}

// statsSample is a Stats snapshot and when it was taken.
type statsSample struct {
	stats Stats
	at    time.Time
}

// registerGauges registers the callback observing the relay's latest Stats
// snapshot. The callback never queries the database (Stats is O(pending)):
// Run refreshes the snapshot every StatsInterval, and a snapshot older than
// two intervals is not reported, so a stopped relay stops reporting instead
// of freezing a healthy-looking backlog.
func (r *Relay) registerGauges() (metric.Registration, error) {
	m := r.metrics
	maxAge := time.Duration(math.MaxInt64) // saturated: 2*StatsInterval could wrap negative
	if r.cfg.StatsInterval <= math.MaxInt64/2 {
		maxAge = 2 * r.cfg.StatsInterval
	}
	return telemetry.Meter(r.cfg.MeterProvider, "outbox").RegisterCallback(
		func(_ context.Context, o metric.Observer) error {
			s := r.lastStats.Load()
			if s == nil || time.Since(s.at) > maxAge {
				return nil
			}
			o.ObserveInt64(m.pending, s.stats.Pending, m.attrs)
			o.ObserveInt64(m.inFlight, s.stats.InFlight, m.attrs)
			o.ObserveInt64(m.retrying, s.stats.Retrying, m.attrs)
			o.ObserveInt64(m.deadLetters, s.stats.DeadLetters, m.attrs)
			o.ObserveFloat64(m.oldestAge, s.stats.OldestPendingAge.Seconds(), m.attrs)
			return nil
		},
		m.pending, m.inFlight, m.retrying, m.deadLetters, m.oldestAge)
}

// statsRefreshTimeoutMin is the least a Stats refresh is given.
const statsRefreshTimeoutMin = 5 * time.Second

// refreshStats keeps the Stats snapshot fresh until ctx (Run's) ends. A
// refresh whose statement was sent then finishes under workCtx, like a
// batch in flight: cut off, its statement would leave pgx closing the
// connection in the background after Run returned (see listen). One still
// waiting for a pool connection sent nothing, and ends with ctx.
func (r *Relay) refreshStats(ctx, workCtx context.Context) {
	t := time.NewTicker(r.cfg.StatsInterval)
	defer t.Stop()
	for ctx.Err() == nil {
		// Bounded: on a half-open connection pgx waits for ever (the
		// kernel keeps the socket), and the gauges would stay absent while
		// the relay runs and the database answers on new connections.
		deadline := time.Now().Add(max(r.cfg.StatsInterval, statsRefreshTimeoutMin))
		sctx, cancel := context.WithDeadline(workCtx, deadline)
		// The pool connection is waited for under ctx, as the claims' is:
		// only a statement already sent gets the shutdown's grace.
		actx, cancelAcquire := context.WithDeadline(ctx, deadline)
		conn, err := r.pool.Acquire(actx)
		cancelAcquire()
		if err == nil {
			_, err = r.statsOn(sctx, conn)
			conn.Release()
		} else if ctx.Err() != nil {
			err = nil // shutting down: nothing was sent
		} else {
			err = mapError("stats", err)
		}
		cancel()
		if err != nil && workCtx.Err() == nil {
			r.logger.Warn("outbox relay could not refresh its stats for metrics", slog.String("error", err.Error()))
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// settled records a settled batch's outcome.
func (m *relayMetrics) settled(ctx context.Context, acked, retried, dead, released, lost int) {
	add := func(c metric.Int64Counter, n int) {
		if n > 0 {
			c.Add(ctx, int64(n), m.attrs)
		}
	}
	add(m.acked, acked)
	add(m.retried, retried)
	add(m.deadLettered, dead)
	add(m.released, released)
	add(m.leaseLost, lost)
}
