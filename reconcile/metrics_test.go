package reconcile

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/verity-go/verity/internal/telemetry/metrictest"
	"github.com/verity-go/verity/projection"
)

func TestReconcileMetrics(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	name := attribute.String(AttributeName, testBoard)
	mode := func(m string) attribute.KeyValue { return attribute.String(AttributeMode, m) }
	class := func(c Class) attribute.KeyValue { return attribute.String(AttributeClass, c.String()) }

	t.Run("RunAddsUpLikeTheReport", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindSortedSet)
		want := countClasses(b.drift(t))
		rec := metrictest.New(t)
		r := b.reconciler(t, &Config{MeterProvider: rec.Provider})
		// Every mode and class has its series, at 0, before any run: an
		// alert on increase() would not see the first drift of a series
		// born at its first value.
		before := rec.Collect(t)
		for _, m := range []string{"full", "sample", "keys"} {
			for _, c := range Classes {
				require.Equal(t, 1, before.Series(metricRows, name, mode(m), class(c)), "%s %s", m, c)
			}
		}

		rep, err := r.Run(ctx, RunOptions{})
		require.NoError(t, err)
		s := rec.Collect(t)
		require.Equal(t, int64(1), s.Int(metricRuns, name, mode("full"),
			attribute.String(AttributeOutcome, "ok"), attribute.Bool(AttributeDryRun, false)))
		for c, n := range want {
			require.Equal(t, n, s.Int(metricRows, name, mode("full"), class(c)), c.String())
		}
		require.Equal(t, int64(3), s.Int(metricRows, class(ClassCorrupt)))
		for res, n := range rep.Results {
			require.Equal(t, n, s.Int(metricResults, name, attribute.String(AttributeResult, res.String())), res.String())
		}
		var repaired int64
		for c, n := range rep.RepairedByClass {
			require.Equal(t, n, s.Int(metricRepaired, name, class(c)), c.String())
			repaired += n
		}
		require.Equal(t, rep.Repaired, repaired)
		require.Equal(t, int64(5), repaired, "missing, stale and three corrupt entries are repaired by default")
		require.Zero(t, s.Int(metricRepaired, class(ClassOrphan)), "orphans are only reported by default")
		require.Equal(t, uint64(1), s.Count(metricDuration, name, mode("full")))

		// A second pass finds only what the policy left alone.
		_, err = r.CheckKeys(ctx, []string{"cur", "miss"}, RunOptions{DryRun: true})
		require.NoError(t, err)
		s = rec.Collect(t)
		require.Equal(t, int64(1), s.Int(metricRuns, mode("keys"), attribute.Bool(AttributeDryRun, true)))
		require.Equal(t, int64(2), s.Int(metricRows, mode("keys"), class(ClassCurrent)), "both were current after the repair")
		require.Equal(t, int64(5), s.Int(metricRepaired), "a dry run repairs nothing")
	})

	// Options no run can take are the caller's mistake, refused before
	// anything is read: not a failed run.
	t.Run("InvalidOptionsAreNoRun", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindSortedSet)
		rec := metrictest.New(t)
		r := b.reconciler(t, &Config{MeterProvider: rec.Provider})
		for _, opts := range []RunOptions{{Sample: -1}, {Sample: SampleMax + 1}} {
			_, err := r.Run(ctx, opts)
			require.ErrorIs(t, err, ErrInvalidConfig)
		}
		_, err := r.Run(ctx, RunOptions{Sample: 3})
		require.NoError(t, err)
		s := rec.Collect(t)
		require.Zero(t, s.Int(metricRuns, attribute.String(AttributeOutcome, "error")))
		require.Equal(t, int64(1), s.Int(metricRuns, name, mode("sample"), attribute.String(AttributeOutcome, "ok")))
	})

	t.Run("Rebuild", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindSortedSet)
		rows := b.insertMany(t, 7)
		rec := metrictest.New(t)
		r := b.reconciler(t, &Config{MeterProvider: rec.Provider})
		rep, err := r.Rebuild(ctx)
		require.NoError(t, err)
		require.True(t, rep.Switched)
		s := rec.Collect(t)
		require.Equal(t, int64(1), s.Int(metricRebuilds, name, attribute.String(AttributeOutcome, "switched")))
		require.Equal(t, int64(len(rows)), s.Int(metricRebuildRows, name))
	})

	t.Run("NoProvider", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindSortedSet)
		r := b.reconciler(t, nil)
		require.Nil(t, r.metrics)
		_, err := r.Run(ctx, RunOptions{})
		require.NoError(t, err)
		// A typed-nil provider (a *sdkmetric.MeterProvider left nil when
		// metrics are off) is no provider too.
		r = b.reconciler(t, &Config{MeterProvider: (*sdkmetric.MeterProvider)(nil)})
		require.Nil(t, r.metrics)
		_, err = r.Run(ctx, RunOptions{})
		require.NoError(t, err)
	})
}
