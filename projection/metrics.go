package projection

import (
	"context"
	"errors"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/verity-go/verity/internal/telemetry"
	"github.com/verity-go/verity/outbox"
)

// Attributes of the package's instruments. All are low-cardinality: the
// name is a collection's (a board's) name, bounded by the number of
// collections; documents report an empty name, because a document's Name
// is its id. Every instrument carries the projector's key prefix: one name
// under two prefixes (a board per tenant) is two projections.
const (
	AttributeName    = "verity.projection.name"
	AttributePrefix  = "verity.projection.prefix"
	AttributeKind    = "verity.projection.kind"    // sorted-set, hash, document
	AttributeOutcome = "verity.projection.outcome" // applied, duplicate, stale, conflict, unknown
	AttributeMode    = "verity.projection.mode"    // live, shadow
	AttributeReason  = "verity.projection.reason"  // map, corrupt_version, layout, redis
)

// Instrument names of the package.
const (
	metricWrites        = "verity.projection.writes"
	metricFailed        = "verity.projection.failed"
	metricLag           = "verity.projection.lag"
	metricBatchDuration = "verity.projection.batch.duration"
)

// Reasons of verity.projection.failed.
const (
	reasonMap            = "map"
	reasonCorruptVersion = "corrupt_version"
	reasonLayout         = "layout"
	reasonRedis          = "redis"
)

// failReason is the reason an error fails records with.
func failReason(err error) string {
	if errors.Is(err, ErrLayoutMismatch) {
		return reasonLayout
	}
	return reasonRedis
}

// projectionMetrics holds a projector's instruments, created once in
// NewRedisProjector. A nil *projectionMetrics records nothing.
type projectionMetrics struct {
	writes, failed metric.Int64Counter
	lag            metric.Float64Histogram
	batchDuration  metric.Float64Histogram
	// now is the clock the lag is measured with.
	now func() time.Time
	// prefix is the projector's key prefix, an attribute of every
	// instrument.
	prefix attribute.KeyValue

	// names caches the attribute option of each collection name, so the
	// lag histogram does not allocate an attribute set per record.
	names sync.Map // string -> metric.MeasurementOption
}

func newProjectionMetrics(mp metric.MeterProvider, prefix string) (*projectionMetrics, error) {
	if !telemetry.Enabled(mp) {
		return nil, nil
	}
	in := telemetry.New(mp, "projection")
	m := &projectionMetrics{
		writes: in.Counter(metricWrites, "{write}",
			"Writes decided by the version gate, by outcome: applied, duplicate (same version again), stale (older version), conflict (same version, another value), unknown (refused: unreadable stored version, the collection's version layout differs, or, under Handle, a key it needs holds another Redis type)."),
		failed: in.Counter(metricFailed, "{record}",
			"Outbox records the projector could not apply, by reason: map (the Mapper refused it), corrupt_version (unreadable stored version), layout (its collection's version layout differs from the projector's), redis (the script call of its slot group failed, or a key holds another Redis type)."),
		lag: in.Histogram(metricLag, "s",
			"Commit-to-visible lag: time from the outbox row's created_at (database clock) until the gate applied it in Redis (projector host clock). Only applied writes.",
			telemetry.LagBuckets()...),
		batchDuration: in.Histogram(metricBatchDuration, "s",
			"Duration of one gate call: one round trip (one script call per Redis Cluster slot, pipelined), plus the rounds that isolate a write Redis refused (a WRONGTYPE key, a layout mismatch) when there is one.",
			telemetry.DurationBuckets()...),
		now:    time.Now,
		prefix: attribute.String(AttributePrefix, prefix),
	}
	return m, in.Err()
}

func (m *projectionMetrics) nameOption(name string) metric.MeasurementOption {
	if opt, ok := m.names.Load(name); ok {
		return opt.(metric.MeasurementOption)
	}
	opt := metric.WithAttributeSet(attribute.NewSet(m.prefix, attribute.String(AttributeName, name)))
	m.names.Store(name, opt)
	return opt
}

// writeKey groups the writes of a batch counted under the same attributes.
type writeKey struct {
	name    string
	kind    Kind
	outcome Outcome
}

// recordWrites counts the gate's verdicts, one Add per distinct attribute
// set of the batch. Writes marked undecided (nil: none), whose script call
// failed, have no verdict and are not counted.
func (m *projectionMetrics) recordWrites(ctx context.Context, mode string, writes []Write, outcomes []Outcome, undecided []bool) {
	if m == nil {
		return
	}
	counts := make(map[writeKey]int64, 1)
	for i := range writes {
		if undecided != nil && undecided[i] {
			continue
		}
		name, kind := metricName(writes[i].Target), writes[i].Target.Kind
		counts[writeKey{name: name, kind: kind, outcome: outcomes[i]}]++
		// The conflict series exists, at 0, from a collection's first
		// batch: born at its first conflict, it would show Prometheus's
		// increase() no growth (the README's alert covers a conflict in
		// that first batch too).
		counts[writeKey{name: name, kind: kind, outcome: OutcomeConflict}] += 0
	}
	for k, n := range counts {
		m.writes.Add(ctx, n, metric.WithAttributes(
			m.prefix,
			attribute.String(AttributeName, k.name),
			attribute.String(AttributeKind, k.kind.String()),
			attribute.String(AttributeOutcome, k.outcome.String()),
			attribute.String(AttributeMode, mode),
		))
	}
}

// recordLag records the commit-to-visible lag of every applied record.
// written[i] is the Write of batch[i]; applied[i] whether the gate applied it.
func (m *projectionMetrics) recordLag(ctx context.Context, batch []outbox.Record, written []Write, applied []bool) {
	if m == nil {
		return
	}
	now := m.now()
	for i := range batch {
		if !applied[i] || batch[i].CreatedAt.IsZero() {
			continue
		}
		// Clock skew between the database and this host can make the
		// difference negative; it is recorded as zero rather than dropped,
		// so the count still matches the applied writes.
		lag := max(now.Sub(batch[i].CreatedAt), 0)
		m.lag.Record(ctx, lag.Seconds(), m.nameOption(metricName(written[i].Target)))
	}
}

func (m *projectionMetrics) recordFailed(ctx context.Context, reason string, n int) {
	if m == nil || n == 0 {
		return
	}
	m.failed.Add(ctx, int64(n), metric.WithAttributes(m.prefix, attribute.String(AttributeReason, reason)))
}

func (m *projectionMetrics) recordBatch(ctx context.Context, mode string, d time.Duration) {
	if m == nil {
		return
	}
	m.batchDuration.Record(ctx, d.Seconds(), metric.WithAttributes(m.prefix, attribute.String(AttributeMode, mode)))
}

// metricName is the name attribute of a target: the collection's name, or
// "" for a document (its Name is an id, unbounded).
func metricName(t Target) string {
	if t.Kind == KindDocument {
		return ""
	}
	return t.Name
}
