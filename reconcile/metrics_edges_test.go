package reconcile

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"

	"github.com/verity-go/verity/internal/telemetry/metrictest"
	"github.com/verity-go/verity/projection"
)

// README: verity.reconcile.runs has outcome (ok, error), and
// verity.reconcile.rebuilds outcome (switched, aborted, in_progress,
// unsupported, error). Existing tests only check ok and switched.
func TestMetricsFailedRunsAndRefusedRebuilds(t *testing.T) {
	t.Parallel()
	name := attribute.String(AttributeName, testBoard)
	outcome := func(o string) attribute.KeyValue { return attribute.String(AttributeOutcome, o) }

	t.Run("FailedRun", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindSortedSet)
		b.insertMany(t, 5)
		rec := metrictest.New(t)
		r := b.reconciler(t, &Config{MeterProvider: rec.Provider})
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		_, err := r.Run(ctx, RunOptions{})
		require.Error(t, err)
		s := rec.Collect(t)
		require.Equal(t, int64(1), s.Int(metricRuns, name, attribute.String(AttributeMode, "full"), outcome("error")))
		require.Zero(t, s.Int(metricRuns, outcome("ok")))
	})
	t.Run("RebuildInProgress", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindSortedSet)
		b.insert(t, "a", 1)
		marker, _, _ := b.rebuildKeys()
		require.NoError(t, b.client.Set(context.Background(), marker, "someone-else", time.Minute).Err())
		rec := metrictest.New(t)
		_, err := b.reconciler(t, &Config{MeterProvider: rec.Provider}).Rebuild(context.Background())
		require.ErrorIs(t, err, ErrRebuildInProgress)
		require.Equal(t, int64(1), rec.Collect(t).Int(metricRebuilds, name, outcome("in_progress")))
	})
	t.Run("RebuildUnsupported", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindDocument)
		rec := metrictest.New(t)
		_, err := b.reconciler(t, &Config{MeterProvider: rec.Provider}).Rebuild(context.Background())
		require.ErrorIs(t, err, ErrRebuildUnsupported)
		require.Equal(t, int64(1), rec.Collect(t).Int(metricRebuilds, outcome("unsupported")))
	})
	t.Run("RebuildAborted", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindSortedSet)
		b.insertMany(t, 30)
		src := &hookedSource{Source: b.source, onPage: func(context.Context, int) { time.Sleep(250 * time.Millisecond) }}
		rec := metrictest.New(t)
		r, err := New(src, b.target, &Config{PageSize: 10, RebuildMarkerTTL: 200 * time.Millisecond, MeterProvider: rec.Provider})
		require.NoError(t, err)
		_, err = r.Rebuild(context.Background())
		require.ErrorIs(t, err, ErrRebuildAborted)
		require.Equal(t, int64(1), rec.Collect(t).Int(metricRebuilds, name, outcome("aborted")))
	})
}
