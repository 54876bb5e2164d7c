package metrictest_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/verity-go/verity/internal/telemetry/metrictest"
)

// TestSnapshot records known values, under two attribute sets, on every
// kind of instrument the lookups read, and checks that each lookup sums
// exactly the matching points: the library's metric tests rely on these
// lookups failing when the wrong value, or the wrong attributes, were
// recorded.
func TestSnapshot(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rec := metrictest.New(t)
	meter := rec.Provider.Meter("example.test/scope")
	a, b := attribute.String("kind", "a"), attribute.String("kind", "b")
	extra, other := attribute.Int("n", 1), attribute.String("kind", "other")

	counter, err := meter.Int64Counter("test.counter", metric.WithUnit("{thing}"))
	require.NoError(t, err)
	counter.Add(ctx, 2, metric.WithAttributes(a))
	counter.Add(ctx, 5, metric.WithAttributes(b, extra))
	floats, err := meter.Float64Counter("test.floats")
	require.NoError(t, err)
	floats.Add(ctx, 1.5, metric.WithAttributes(a))
	floats.Add(ctx, 2.25, metric.WithAttributes(b))
	gauge, err := meter.Int64ObservableGauge("test.gauge")
	require.NoError(t, err)
	floatGauge, err := meter.Float64ObservableGauge("test.floatgauge")
	require.NoError(t, err)
	_, err = meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		o.ObserveInt64(gauge, 7, metric.WithAttributes(a))
		o.ObserveInt64(gauge, 11, metric.WithAttributes(b))
		o.ObserveFloat64(floatGauge, 0.5, metric.WithAttributes(a))
		o.ObserveFloat64(floatGauge, 0.75, metric.WithAttributes(b))
		return nil
	}, gauge, floatGauge)
	require.NoError(t, err)
	hist, err := meter.Float64Histogram("test.hist", metric.WithExplicitBucketBoundaries(1, 2))
	require.NoError(t, err)
	hist.Record(ctx, 0.5, metric.WithAttributes(a))
	hist.Record(ctx, 3, metric.WithAttributes(b))
	hist.Record(ctx, 0.25, metric.WithAttributes(b))

	s := rec.Collect(t)

	t.Run("Presence", func(t *testing.T) {
		t.Parallel()
		require.True(t, s.Has("test.counter"))
		require.False(t, s.Has("test.absent"))
		require.Equal(t, "{thing}", s.Unit("test.counter"))
		require.Empty(t, s.Unit("test.absent"))
		require.Equal(t, "example.test/scope", s.Scope("test.hist"))
		require.Empty(t, s.Scope("test.absent"))
		require.Equal(t, []float64{1, 2}, s.Bounds("test.hist"))
		require.Nil(t, s.Bounds("test.counter"), "not a histogram")
	})

	t.Run("Int", func(t *testing.T) {
		t.Parallel()
		require.EqualValues(t, 7, s.Int("test.counter"), "every point")
		require.EqualValues(t, 2, s.Int("test.counter", a))
		require.EqualValues(t, 5, s.Int("test.counter", b))
		require.EqualValues(t, 5, s.Int("test.counter", b, extra), "a point with every attribute asked for")
		require.Zero(t, s.Int("test.counter", a, extra), "no point has both")
		require.Zero(t, s.Int("test.counter", other))
		require.Zero(t, s.Int("test.absent"))
		require.EqualValues(t, 18, s.Int("test.gauge"), "a gauge's points")
		require.EqualValues(t, 11, s.Int("test.gauge", b))
	})

	t.Run("Float", func(t *testing.T) {
		t.Parallel()
		require.InDelta(t, 3.75, s.Float("test.floats"), 1e-9)
		require.InDelta(t, 2.25, s.Float("test.floats", b), 1e-9)
		require.Zero(t, s.Float("test.floats", other))
		require.InDelta(t, 1.25, s.Float("test.floatgauge"), 1e-9, "a gauge's points")
		require.InDelta(t, 0.5, s.Float("test.floatgauge", a), 1e-9)
		require.Zero(t, s.Float("test.absent"))
	})

	t.Run("Count", func(t *testing.T) {
		t.Parallel()
		require.EqualValues(t, 3, s.Count("test.hist"))
		require.EqualValues(t, 1, s.Count("test.hist", a))
		require.EqualValues(t, 2, s.Count("test.hist", b))
		require.Zero(t, s.Count("test.hist", other))
		require.Zero(t, s.Count("test.absent"))
	})

	t.Run("Min", func(t *testing.T) {
		t.Parallel()
		low, ok := s.Min("test.hist")
		require.True(t, ok)
		require.InDelta(t, 0.25, low, 1e-9, "the smallest over every point")
		low, ok = s.Min("test.hist", a)
		require.True(t, ok)
		require.InDelta(t, 0.5, low, 1e-9)
		_, ok = s.Min("test.hist", other)
		require.False(t, ok, "no matching point")
		_, ok = s.Min("test.absent")
		require.False(t, ok)
	})
}
