package reconcile

import (
	"context"
	"errors"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/verity-go/verity/internal/telemetry"
)

// Attributes of the package's instruments. The name is the projection's
// collection name (a board), bounded; documents report their Target's
// Namespace (a document's own name is an id: unbounded).
const (
	AttributeName    = "verity.reconcile.name"
	AttributePrefix  = "verity.reconcile.prefix"  // the Keyspace's prefix: collections of one name under two prefixes (tenants) are two projections
	AttributeMode    = "verity.reconcile.mode"    // full, sample, keys
	AttributeOutcome = "verity.reconcile.outcome" // ok, error; switched, aborted, in_progress, unsupported, error for rebuilds
	AttributeDryRun  = "verity.reconcile.dry_run"
	AttributeClass   = "verity.reconcile.class"  // current, missing, stale, ahead, corrupt, orphan
	AttributeResult  = "verity.reconcile.result" // repaired, reported, dry-run, vetoed, raced, not-attempted, uncertain
)

// Instrument names of the package.
const (
	metricRuns         = "verity.reconcile.runs"
	metricRows         = "verity.reconcile.rows"
	metricResults      = "verity.reconcile.results"
	metricRepaired     = "verity.reconcile.repaired"
	metricDuration     = "verity.reconcile.duration"
	metricRebuilds     = "verity.reconcile.rebuilds"
	metricRebuildRows  = "verity.reconcile.rebuild.rows"
	modeFull           = "full"
	modeSample         = "sample"
	modeKeys           = "keys"
	outcomeOK          = "ok"
	outcomeError       = "error"
	outcomeSwitched    = "switched"
	outcomeAborted     = "aborted"
	outcomeInProgress  = "in_progress"
	outcomeUnsupported = "unsupported"
)

// reconcileMetrics holds a Reconciler's instruments; nil records nothing.
// Everything is recorded once per run from the finished Report, so the
// counters add up exactly like the Report's.
type reconcileMetrics struct {
	name                          []attribute.KeyValue // name and prefix
	runs, rows, results, repaired metric.Int64Counter
	rebuilds, rebuildRows         metric.Int64Counter
	duration                      metric.Float64Histogram
}

func newReconcileMetrics(cfg *Config, target Target) (*reconcileMetrics, error) {
	if !telemetry.Enabled(cfg.MeterProvider) {
		return nil, nil
	}
	in := telemetry.New(cfg.MeterProvider, "reconcile")
	m := &reconcileMetrics{
		name: []attribute.KeyValue{attribute.String(AttributeName, target.label()), attribute.String(AttributePrefix, target.Keyspace.Prefix())},
		runs: in.Counter(metricRuns, "{run}", "Reconcile runs (Run, CheckKeys) by mode (full, sample, keys), outcome (ok, error) and dry_run."),
		rows: in.Counter(metricRows, "{entity}",
			"Entities checked by reconcile runs, by class: current, missing, stale, ahead (a version the source never had), corrupt (same version, different value), orphan (not in the source)."),
		results: in.Counter(metricResults, "{entity}",
			"Findings (entities not current) by what the run did: repaired, reported, dry-run, vetoed, raced, not-attempted, uncertain."),
		repaired: in.Counter(metricRepaired, "{entity}", "Repairs written, by class."),
		duration: in.Histogram(metricDuration, "s", "Duration of reconcile runs, by mode.", telemetry.DurationBuckets()...),
		rebuilds: in.Counter(metricRebuilds, "{run}",
			"Rebuilds by outcome: switched, aborted (marker lost, or copy writes lost), in_progress (another rebuild held the marker), unsupported, error."),
		rebuildRows: in.Counter(metricRebuildRows, "{row}", "Source rows copied into shadow keys by rebuilds."),
	}
	if err := in.Err(); err != nil {
		return m, err
	}
	// Every mode and class starts at 0: a series born at its first drift
	// would show Prometheus's increase() no growth, and the README's drift
	// alerts would miss the first drift a process finds.
	for _, mode := range []string{modeFull, modeSample, modeKeys} {
		for _, class := range Classes {
			m.rows.Add(context.Background(), 0, metric.WithAttributes(m.with(
				attribute.String(AttributeMode, mode), attribute.String(AttributeClass, class.String()))...))
		}
	}
	return m, nil
}

// with returns the run's name and prefix attributes followed by extra.
func (m *reconcileMetrics) with(extra ...attribute.KeyValue) []attribute.KeyValue {
	return append(m.name[:len(m.name):len(m.name)], extra...)
}

func (m *reconcileMetrics) recordRun(ctx context.Context, mode string, rep *Report, err error) {
	if m == nil || rep == nil {
		return
	}
	outcome := outcomeOK
	if err != nil {
		outcome = outcomeError
	}
	modeAttr := attribute.String(AttributeMode, mode)
	m.runs.Add(ctx, 1, metric.WithAttributes(m.with(modeAttr,
		attribute.String(AttributeOutcome, outcome), attribute.Bool(AttributeDryRun, rep.DryRun))...))
	for class, n := range rep.Counts {
		if n > 0 {
			m.rows.Add(ctx, n, metric.WithAttributes(m.with(modeAttr, attribute.String(AttributeClass, class.String()))...))
		}
	}
	for result, n := range rep.Results {
		if n > 0 {
			m.results.Add(ctx, n, metric.WithAttributes(m.with(attribute.String(AttributeResult, result.String()))...))
		}
	}
	for class, n := range rep.RepairedByClass {
		if n > 0 {
			m.repaired.Add(ctx, n, metric.WithAttributes(m.with(attribute.String(AttributeClass, class.String()))...))
		}
	}
	m.duration.Record(ctx, rep.Duration.Seconds(), metric.WithAttributes(m.with(modeAttr)...))
}

func (m *reconcileMetrics) recordRebuild(ctx context.Context, rep *RebuildReport, err error) {
	if m == nil || rep == nil {
		return
	}
	outcome := outcomeError
	switch {
	case rep.Switched:
		outcome = outcomeSwitched
	case errors.Is(err, ErrRebuildAborted):
		outcome = outcomeAborted
	case errors.Is(err, ErrRebuildInProgress):
		outcome = outcomeInProgress
	case errors.Is(err, ErrRebuildUnsupported):
		outcome = outcomeUnsupported
	}
	m.rebuilds.Add(ctx, 1, metric.WithAttributes(m.with(attribute.String(AttributeOutcome, outcome))...))
	if rep.Rows > 0 {
		m.rebuildRows.Add(ctx, rep.Rows, metric.WithAttributes(m.name...))
	}
}
