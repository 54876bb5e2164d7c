package versioncache

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/verity-go/verity/internal/telemetry/metrictest"
)

func TestCacheMetrics(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	result := func(r string) attribute.KeyValue { return attribute.String(AttributeResult, r) }

	t.Run("CountersFollowStats", func(t *testing.T) {
		t.Parallel()
		rec := metrictest.New(t)
		b := setup(t, &Config{MeterProvider: rec.Provider})
		t.Cleanup(func() { require.NoError(t, b.cache.Close()) })
		prefix := attribute.String(AttributePrefix, b.prefix)
		b.truth.write("p1", 100)

		for range 2 {
			_, err := b.cache.Get(ctx, "p1", b.truth.loader("p1")) // miss, then hit
			require.NoError(t, err)
		}
		b.truth.write("p1", 120)
		require.NoError(t, b.cache.Invalidate(ctx, "p1"))
		got, err := b.cache.Get(ctx, "p1", b.truth.loader("p1")) // miss under the new version
		require.NoError(t, err)
		require.Equal(t, 120, got.Price)
		for range 2 {
			_, err := b.cache.GetAt(ctx, "p1", 2, b.truth.loader("p1")) // miss, then hit
			require.NoError(t, err)
		}

		s := rec.Collect(t)
		require.Equal(t, int64(2), s.Int(metricReads, prefix, result("hit")))
		require.Equal(t, int64(3), s.Int(metricReads, prefix, result("miss")))
		require.Equal(t, int64(3), s.Int(metricLoads, prefix, attribute.Bool(AttributeShared, false)))
		require.Zero(t, s.Int(metricLoads, attribute.Bool(AttributeShared, true)))
		require.Equal(t, int64(3), s.Int(metricFills, prefix))
		require.Equal(t, int64(1), s.Int(metricInvalidations, prefix))
		require.Equal(t, int64(b.cache.Stats().OrphanedValueKeys), s.Int(metricOrphans, prefix))
		require.Zero(t, s.Int(metricFallbacks))
		require.Zero(t, s.Int(metricErrors))
		require.Equal(t, uint64(3), s.Count(metricLoadDuration, prefix))
		require.Equal(t, int64(3), b.truth.loads.Load())

		require.NoError(t, b.cache.Close())
		require.NoError(t, b.cache.Close(), "Close is idempotent")
		require.Zero(t, rec.Collect(t).Int(metricReads), "a closed cache is no longer observed")
		_, err = b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err, "the cache stays usable after Close")
	})

	// The caller running a shared load gives up; the caller that joined it
	// loads again itself. Two calls are two reads, two misses, answered by
	// two loads that each ran: the dropped joined load is not counted.
	t.Run("OneReadPerCall", func(t *testing.T) {
		t.Parallel()
		for _, name := range []string{"Get", "GetAt"} {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				rec := metrictest.New(t)
				b := setup(t, &Config{MeterProvider: rec.Provider})
				t.Cleanup(func() { require.NoError(t, b.cache.Close()) })
				want := b.truth.write("p1", 5)
				get := func(ctx context.Context, load Loader[product]) (product, error) {
					if name == "GetAt" {
						return b.cache.GetAt(ctx, "p1", 1, load)
					}
					return b.cache.Get(ctx, "p1", load)
				}
				leaderCtx, cancel := context.WithCancel(ctx)
				defer cancel()
				started := make(chan struct{})
				leaderErr := make(chan error, 1)
				go func() {
					_, err := get(leaderCtx, func(ctx context.Context) (product, error) {
						close(started)
						<-ctx.Done()
						return product{}, ctx.Err()
					})
					leaderErr <- err
				}()
				<-started
				joined := make(chan product, 1)
				go func() {
					p, err := get(ctx, b.truth.loader("p1"))
					if err != nil {
						t.Errorf("joiner: %v", err)
					}
					joined <- p
				}()
				require.Eventually(t, func() bool { return b.cache.Stats().Misses == 2 }, 5*time.Second, time.Millisecond)
				require.Eventually(t, func() bool { return b.cache.flights.joiners() == 1 }, 5*time.Second, time.Millisecond, "the others joined the load in flight")
				cancel()
				require.ErrorIs(t, <-leaderErr, context.Canceled)
				require.Equal(t, want, <-joined)

				st := b.cache.Stats()
				require.Zero(t, st.Hits)
				require.EqualValues(t, 2, st.Misses, "the joiner's second round is the same call")
				require.EqualValues(t, 2, st.Loads)
				require.Zero(t, st.SharedLoads, "the joined load was dropped, not used")
				m := rec.Collect(t)
				require.Equal(t, int64(2), m.Int(metricReads))
				require.Equal(t, int64(2), m.Int(metricReads, result("miss")))
				require.Equal(t, int64(2), m.Int(metricLoads, attribute.Bool(AttributeShared, false)))
				require.Zero(t, m.Int(metricLoads, attribute.Bool(AttributeShared, true)))
			})
		}
	})

	t.Run("FailOpenIsAFallback", func(t *testing.T) {
		t.Parallel()
		rec := metrictest.New(t)
		// Nothing listens on port 1: every Redis call fails at once.
		client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: time.Second})
		t.Cleanup(func() { _ = client.Close() })
		b := setupWith(t, client, "verity:test:failopen:", &Config{MeterProvider: rec.Provider})
		t.Cleanup(func() { _ = b.cache.Close() })
		b.truth.write("p1", 7)

		got, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, 7, got.Price)
		s := rec.Collect(t)
		require.Equal(t, int64(1), s.Int(metricFallbacks, attribute.String(AttributeReason, "redis_error")))
		require.Equal(t, int64(1), s.Int(metricErrors, attribute.String(AttributeKind, "redis")))
		require.Equal(t, int64(1), s.Int(metricLoads, attribute.Bool(AttributeShared, false)))
		require.Zero(t, s.Int(metricReads))
		require.Equal(t, uint64(1), b.cache.Stats().FailOpenLoads)
	})

	// The descriptions are the Prometheus HELP lines: every kind=
	// errors carries must be explained there.
	t.Run("ErrorsDescriptionNamesEveryKind", func(t *testing.T) {
		t.Parallel()
		reader := sdkmetric.NewManualReader()
		mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
		t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
		b := setup(t, &Config{MeterProvider: mp})
		t.Cleanup(func() { require.NoError(t, b.cache.Close()) })

		var rm metricdata.ResourceMetrics
		require.NoError(t, reader.Collect(ctx, &rm))
		var desc string
		var kinds []string
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				if m.Name != metricErrors {
					continue
				}
				desc = m.Description
				for _, p := range m.Data.(metricdata.Sum[int64]).DataPoints {
					v, _ := p.Attributes.Value(attribute.Key(AttributeKind))
					kinds = append(kinds, v.AsString())
				}
			}
		}
		require.ElementsMatch(t, []string{"redis", "decode", "replication"}, kinds)
		for _, kind := range kinds {
			require.Contains(t, desc, kind+" (", "the description says what kind=%s counts", kind)
		}
	})

	t.Run("NoProvider", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		require.Nil(t, b.cache.metrics)
		require.NoError(t, b.cache.Close())
	})
}
