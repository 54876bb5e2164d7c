package telemetry_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric/noop"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/verity-go/verity/internal/telemetry"
	"github.com/verity-go/verity/internal/telemetry/metrictest"
)

func TestEnabled(t *testing.T) {
	t.Parallel()
	require.False(t, telemetry.Enabled(nil))
	require.False(t, telemetry.Enabled(noop.NewMeterProvider()))
	require.True(t, telemetry.Enabled(metrictest.New(t).Provider))

	// A provider pointer left nil turns metrics off like a nil interface,
	// instead of panicking in the SDK at the first instrument.
	var off *sdkmetric.MeterProvider
	require.False(t, telemetry.Enabled(off))
	counter, err := telemetry.Meter(off, "outbox").Int64Counter("c")
	require.NoError(t, err)
	counter.Add(context.Background(), 1)
}

func TestInstruments(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("RecordsOnTheNamedMeter", func(t *testing.T) {
		t.Parallel()
		rec := metrictest.New(t)
		in := telemetry.New(rec.Provider, "outbox")
		c := in.Counter("verity.test.count", "{thing}", "Things.")
		h := in.Histogram("verity.test.duration", "s", "Durations.", telemetry.DurationBuckets()...)
		require.NoError(t, in.Err())
		c.Add(ctx, 3)
		h.Record(ctx, 0.2)
		s := rec.Collect(t)
		require.Equal(t, int64(3), s.Int("verity.test.count"))
		require.Equal(t, "{thing}", s.Unit("verity.test.count"))
		require.Equal(t, uint64(1), s.Count("verity.test.duration"))
		require.Equal(t, "github.com/verity-go/verity/outbox", s.Scope("verity.test.count"), "the meter is named by the package's import path")
		require.Equal(t, telemetry.DurationBuckets(), s.Bounds("verity.test.duration"), "the histogram has the buckets asked for")
	})

	t.Run("InvalidNameIsReportedAndStillUsable", func(t *testing.T) {
		t.Parallel()
		in := telemetry.New(metrictest.New(t).Provider, "outbox")
		c := in.Counter("9 is not a valid instrument name", "{thing}", "")
		require.NotNil(t, c)
		c.Add(ctx, 1) // must not panic
		require.ErrorContains(t, in.Err(), "9 is not a valid instrument name")
	})

	t.Run("NilProviderIsNoop", func(t *testing.T) {
		t.Parallel()
		in := telemetry.New(nil, "outbox")
		in.Counter("verity.test.count", "{thing}", "").Add(ctx, 1)
		require.NoError(t, in.Err())
	})

	t.Run("BucketsAreFreshCopies", func(t *testing.T) {
		t.Parallel()
		b := telemetry.LagBuckets()
		b[0] = -1
		require.Positive(t, telemetry.LagBuckets()[0])
	})
}
