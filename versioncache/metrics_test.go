package versioncache

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/verity-go/verity/internal/telemetry/metrictest"
	"github.com/verity-go/verity/internal/testenv"
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

	// Get's GET answered with no value to serve, then its read script
	// failed (a real WRONGTYPE: a list under the version key): the call
	// missed, and counts so. It counted as neither.
	t.Run("MissThenRedisError", func(t *testing.T) {
		t.Parallel()
		for name, undecodable := range map[string]bool{"Absent": false, "Undecodable": true} {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				rec := metrictest.New(t)
				b := setup(t, &Config{MeterProvider: rec.Provider, FailureMode: FailClosed})
				t.Cleanup(func() { require.NoError(t, b.cache.Close()) })
				if undecodable {
					require.NoError(t, b.client.Set(ctx, b.cache.currentKey("p1"), "not a cached value", 0).Err())
				}
				require.NoError(t, b.client.RPush(ctx, b.cache.versionKey("p1"), "x").Err())
				_, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
				require.Error(t, err)
				st := b.cache.Stats()
				require.EqualValues(t, 1, st.RedisErrors)
				require.EqualValues(t, 1, st.Misses)
				require.Equal(t, int64(1), rec.Collect(t).Int(metricReads, result("miss")))
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

	// A process waits for a peer's fill twice: once the peer fills in time
	// (a lease wait hit), once it never fills (a fallback after
	// FillLeaseWait). Each wait shows under its own result, and only the
	// fallback is a lease_timeout fallback.
	t.Run("LeaseWaitsByResult", func(t *testing.T) {
		t.Parallel()
		rd := testenv.Redis(t)
		// The peer holds its leases until it fills or the test ends.
		peer := setupWith(t, rd.Client, rd.Prefix, &Config{FillLeaseTTL: time.Minute})
		newWaiter := func(wait time.Duration) (*Cache[product], *metrictest.Recorder) {
			rec := metrictest.New(t)
			c, err := New[product](rd.Client, &Config{Prefix: rd.Prefix, MeterProvider: rec.Provider, FillLeaseWait: wait})
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, c.Close()) })
			return c, rec
		}
		fallback := attribute.String(AttributeResult, "fallback")
		leaseTimeout := attribute.String(AttributeReason, "lease_timeout")

		t.Run("Hit", func(t *testing.T) {
			waiter, rec := newWaiter(time.Minute) // only the peer's fill ends the wait
			want := peer.truth.write("h", 1)
			held, err := peer.cache.read(ctx, "h", true, false)
			require.NoError(t, err)
			require.EqualValues(t, leaseHeldByUs, held.lease)
			got := make(chan product, 1)
			go func() {
				p, err := waiter.Get(ctx, "h", peer.truth.loader("h"))
				if err != nil {
					t.Errorf("Get: %v", err)
				}
				got <- p
			}()
			require.Eventually(t, func() bool { return waiter.Stats().LeaseWaits == 1 },
				10*time.Second, time.Millisecond, "the waiter waits for the peer's fill")
			_, err = peer.cache.loadAndFill(ctx, "h", held, peer.truth.loader("h"), new(bool))
			require.NoError(t, err)
			require.Equal(t, want, <-got)
			require.EqualValues(t, 1, waiter.Stats().LeaseWaitHits)

			s := rec.Collect(t)
			require.Equal(t, int64(1), s.Int(metricLeaseWaits, result("hit")))
			require.Zero(t, s.Int(metricLeaseWaits, fallback))
			require.Zero(t, s.Int(metricFallbacks, leaseTimeout))
		})

		t.Run("Fallback", func(t *testing.T) {
			waiter, rec := newWaiter(50 * time.Millisecond)
			want := peer.truth.write("f", 1)
			held, err := peer.cache.read(ctx, "f", true, false)
			require.NoError(t, err)
			require.EqualValues(t, leaseHeldByUs, held.lease, "a peer that never fills")
			got, err := waiter.Get(ctx, "f", peer.truth.loader("f"))
			require.NoError(t, err)
			require.Equal(t, want, got)
			require.EqualValues(t, 1, waiter.Stats().LeaseFallbacks)

			s := rec.Collect(t)
			require.Equal(t, int64(1), s.Int(metricLeaseWaits, fallback))
			require.Zero(t, s.Int(metricLeaseWaits, result("hit")))
			require.Equal(t, int64(1), s.Int(metricFallbacks, leaseTimeout))
			require.Zero(t, s.Int(metricFallbacks, attribute.String(AttributeReason, "redis_error")))
		})
	})

	// Stale fills, shared loads and each error kind show under their own
	// instrument and attribute, with counts that differ from each other.
	t.Run("StaleSharedAndErrorKinds", func(t *testing.T) {
		t.Parallel()
		rec := metrictest.New(t)
		// No replica confirms on the test server: Invalidate reports a
		// *ReplicationError.
		b := setup(t, &Config{MeterProvider: rec.Provider, InvalidateReplicas: 1, InvalidateWaitTimeout: 10 * time.Millisecond})
		t.Cleanup(func() { require.NoError(t, b.cache.Close()) })
		writer := setupWith(t, b.client, b.prefix, nil) // invalidates without waiting for replicas

		// A write lands during the load: its fill is refused.
		b.truth.write("s", 1)
		_, err := b.cache.Get(ctx, "s", func(ctx context.Context) (product, error) {
			p := b.truth.read("s")
			b.truth.write("s", 2)
			return p, writer.cache.Invalidate(ctx, "s")
		})
		require.NoError(t, err)
		// Two cached values that do not decode.
		for _, id := range []string{"d1", "d2"} {
			b.truth.write(id, 1)
			require.NoError(t, b.client.Set(ctx, b.cache.currentKey(id), "1:not ours", 0).Err())
			_, err := b.cache.Get(ctx, id, b.truth.loader(id))
			require.NoError(t, err)
		}
		require.ErrorIs(t, b.cache.Invalidate(ctx, "r"), ErrNotReplicated)
		// A miss joins another's load in flight.
		b.truth.write("j", 1)
		started, release := make(chan struct{}), make(chan struct{})
		var wg sync.WaitGroup
		wg.Go(func() {
			_, err := b.cache.Get(ctx, "j", func(ctx context.Context) (product, error) {
				close(started)
				<-release
				return b.truth.read("j"), nil
			})
			if err != nil {
				t.Errorf("leader: %v", err)
			}
		})
		<-started
		wg.Go(func() {
			if _, err := b.cache.Get(ctx, "j", b.truth.loader("j")); err != nil {
				t.Errorf("joiner: %v", err)
			}
		})
		require.Eventually(t, func() bool { return b.cache.flights.joiners() == 1 }, 5*time.Second, time.Millisecond, "the joiner joined the load in flight")
		close(release)
		wg.Wait()

		st := b.cache.Stats()
		require.EqualValues(t, 1, st.StaleFillsSkipped)
		require.EqualValues(t, 2, st.DecodeErrors)
		require.EqualValues(t, 1, st.ReplicationErrors)
		require.EqualValues(t, 1, st.SharedLoads)
		s := rec.Collect(t)
		require.Equal(t, int64(1), s.Int(metricStaleSkipped))
		require.Equal(t, int64(2), s.Int(metricErrors, attribute.String(AttributeKind, "decode")))
		require.Equal(t, int64(1), s.Int(metricErrors, attribute.String(AttributeKind, "replication")))
		require.Zero(t, s.Int(metricErrors, attribute.String(AttributeKind, "redis")))
		require.Equal(t, int64(1), s.Int(metricLoads, attribute.Bool(AttributeShared, true)))
		require.Equal(t, int64(st.Loads), s.Int(metricLoads, attribute.Bool(AttributeShared, false)))
		require.Equal(t, int64(st.Fills), s.Int(metricFills))
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
