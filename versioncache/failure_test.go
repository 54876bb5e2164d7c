package versioncache

import (
	"context"
	"errors"
	"math"
	"os"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"

	"github.com/verity-go/verity/internal/lograte"
	"github.com/verity-go/verity/internal/telemetry/metrictest"
	"github.com/verity-go/verity/internal/testenv"
)

func TestRedisUnavailable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	setupPrivate := func(t *testing.T, mode FailureMode) (*testenv.RedisServer, *testBundle) {
		t.Helper()
		rs := testenv.StartRedis(t)
		client := rs.Client(t)
		client.Options().MaxRetries = 0 // no retry: once NewClient has run, 0 is one attempt (-1 would make pipelines send nothing)
		return rs, setupWith(t, client, "vc:", &Config{FailureMode: mode})
	}

	// A fill that Redis holds up stays within the caller's deadline (with a
	// client that honours deadlines: go-redis's ContextTimeoutEnabled): the
	// loaded value is returned when the deadline comes, uncached. So does
	// the lease's release after a failed load, which ran on a detached
	// one-second context even while the caller's was live, and the caller
	// waited for it.
	for name, loadErr := range map[string]error{
		"SlowFillKeepsTheCallersDeadline":   nil,
		"FailedLoadKeepsTheCallersDeadline": errors.New("database said no"),
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			rs := testenv.StartRedis(t)
			client := rs.Client(t)
			client.Options().ContextTimeoutEnabled = true
			sends := &deadlineRecorder{}
			client.AddHook(sends)
			b := setupWith(t, client, "vc:", &Config{FailureMode: FailOpen})
			want := b.truth.write("p1", 4900)
			admin := rs.Client(t)
			ctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
			defer cancel()
			callerDeadline, _ := ctx.Deadline()
			start := time.Now()
			got, err := b.cache.Get(ctx, "p1", func(ctx context.Context) (product, error) {
				sends.loaded.Store(true)
				// Writes (the fill's or the release's script) wait for 3 s
				// from now.
				if err := admin.Do(context.Background(), "CLIENT", "PAUSE", 3000, "WRITE").Err(); err != nil {
					return product{}, err
				}
				if loadErr != nil {
					return product{}, loadErr
				}
				return b.truth.loader("p1")(ctx)
			})
			elapsed := time.Since(start)
			if loadErr != nil {
				require.ErrorIs(t, err, loadErr)
			} else {
				require.NoError(t, err)
				require.Equal(t, want, got)
			}
			// Every command after the load (the fill's or the release's
			// script) went with the caller's deadline, not a later one:
			// checked on the deadlines sent, which no slow machine blurs.
			afterLoad := sends.afterLoad()
			require.NotEmpty(t, afterLoad, "no command was sent after the load")
			for _, sent := range afterLoad {
				require.True(t, sent.hasDeadline, "%s was sent without a deadline", sent.name)
				require.False(t, sent.deadline.After(callerDeadline),
					"%s was sent with a deadline %s past the caller's", sent.name, sent.deadline.Sub(callerDeadline))
			}
			// And the call did not wait out the 3 s pause.
			require.Less(t, elapsed, 2*time.Second, "Get waited for Redis past its 300 ms deadline")
			require.NoError(t, admin.Do(context.Background(), "CLIENT", "UNPAUSE").Err())
		})
	}

	// A client that honours deadlines and does not retry reports the
	// caller's deadline as a network timeout, not a context error: still
	// the caller's, not a Redis failure, and no load under a dead ctx.
	t.Run("OwnDeadlineIsNotARedisFailure", func(t *testing.T) {
		t.Parallel()
		rs := testenv.StartRedis(t)
		client := rs.Client(t)
		client.Options().ContextTimeoutEnabled = true
		client.Options().MaxRetries = 0 // no retry: once NewClient has run, 0 is one attempt (-1 would make pipelines send nothing)
		b := setupWith(t, client, "vc:", &Config{FailureMode: FailOpen})
		admin := rs.Client(t)
		require.NoError(t, admin.Do(ctx, "CLIENT", "PAUSE", 1000, "ALL").Err())
		ctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		defer cancel()
		_, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.NotErrorIs(t, err, ErrRedis)
		require.Zero(t, b.cache.Stats().RedisErrors)
		require.Zero(t, b.truth.loads.Load())
		require.NoError(t, admin.Do(context.Background(), "CLIENT", "UNPAUSE").Err())
	})

	// An Invalidate that Redis holds up past the caller's deadline, with a
	// client that honours deadlines and does not retry: go-redis reports an
	// i/o timeout, and the *RedisError must still say that the caller's
	// deadline ended it.
	t.Run("OwnDeadlineOfInvalidateWrapsCtxError", func(t *testing.T) {
		t.Parallel()
		rs := testenv.StartRedis(t)
		client := rs.Client(t)
		client.Options().ContextTimeoutEnabled = true
		client.Options().MaxRetries = 0 // no retry: once NewClient has run, 0 is one attempt (-1 would make pipelines send nothing)
		b := setupWith(t, client, "vc:", nil)
		admin := rs.Client(t)
		require.NoError(t, admin.Do(ctx, "CLIENT", "PAUSE", 1000, "WRITE").Err())
		ctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		err := b.cache.Invalidate(ctx, "p1")
		require.NoError(t, admin.Do(context.Background(), "CLIENT", "UNPAUSE").Err())
		var rerr *RedisError
		require.ErrorAs(t, err, &rerr, "the bump may have happened: still reported")
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.ErrorIs(t, err, os.ErrDeadlineExceeded, "go-redis's own error is kept too")
		require.Zero(t, b.cache.Stats().RedisErrors)
	})

	// A fill and an Invalidate that Redis holds up past the caller's
	// deadline: the caller's, not a Redis failure, in Stats and metrics.
	t.Run("OwnDeadlineOfFillOrInvalidateIsNotARedisFailure", func(t *testing.T) {
		t.Parallel()
		rs := testenv.StartRedis(t)
		client := rs.Client(t)
		client.Options().ContextTimeoutEnabled = true
		rec := metrictest.New(t)
		b := setupWith(t, client, "vc:", &Config{MeterProvider: rec.Provider})
		t.Cleanup(func() { require.NoError(t, b.cache.Close()) })
		want := b.truth.write("p1", 4900)
		admin := rs.Client(t)
		pause := func() error { return admin.Do(context.Background(), "CLIENT", "PAUSE", 1000, "WRITE").Err() }
		unpause := func() { require.NoError(t, admin.Do(context.Background(), "CLIENT", "UNPAUSE").Err()) }
		for _, name := range []string{"Get", "GetAt"} {
			ctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
			load := func(ctx context.Context) (product, error) {
				if err := pause(); err != nil { // the fill's script waits
					return product{}, err
				}
				return b.truth.loader("p1")(ctx)
			}
			var got product
			var err error
			if name == "GetAt" {
				got, err = b.cache.GetAt(ctx, "p1", 1, load)
			} else {
				got, err = b.cache.Get(ctx, "p1", load)
			}
			cancel()
			unpause()
			require.NoError(t, err, name)
			require.Equal(t, want, got, name)
		}
		require.NoError(t, pause())
		ctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		err := b.cache.Invalidate(ctx, "p1")
		unpause()
		require.ErrorIs(t, err, ErrRedis, "a possibly lost invalidation is still reported")
		require.Zero(t, b.cache.Stats().Fills, "Redis held the fills up")
		require.Zero(t, b.cache.Stats().RedisErrors)
		require.Zero(t, rec.Collect(t).Int(metricErrors, attribute.String(AttributeKind, "redis")))
	})

	// Check and CheckAt stop at a failed read of the cache, and each such
	// read counts as a Redis error, as Get's and Peek's do.
	t.Run("CheckAndCheckAtCountTheFailedRead", func(t *testing.T) {
		t.Parallel()
		// Nothing listens on port 1: every Redis call fails at once.
		client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: time.Second})
		t.Cleanup(func() { _ = client.Close() })
		b := setupWith(t, client, "vc:", nil)
		_, err := b.cache.Check(ctx, []string{"p1"}, 0, func(context.Context, string) (product, error) {
			return product{}, errors.New("Check loaded after a failed read")
		})
		var rerr *RedisError
		require.ErrorAs(t, err, &rerr)
		require.Equal(t, "peek", rerr.Op)
		require.EqualValues(t, 1, b.cache.Stats().RedisErrors)

		_, err = b.cache.CheckAt(ctx, []string{"p1"}, 0, func(context.Context, string) (product, int64, error) {
			return product{}, 0, errors.New("CheckAt loaded after a failed read")
		})
		require.ErrorAs(t, err, &rerr)
		require.Equal(t, "peek", rerr.Op)
		require.EqualValues(t, 2, b.cache.Stats().RedisErrors)
	})

	// A fail-open load that fails is counted as a load and a fail-open
	// load, as Stats.FailOpenLoads says: it ran because Redis failed.
	t.Run("FailOpenLoadThatFailsIsCounted", func(t *testing.T) {
		t.Parallel()
		client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: time.Second})
		t.Cleanup(func() { _ = client.Close() })
		b := setupWith(t, client, "vc:", nil)
		_, err := b.cache.Get(ctx, "p1", func(context.Context) (product, error) {
			return product{}, errors.New("the database failed too")
		})
		require.ErrorIs(t, err, ErrLoad)
		stats := b.cache.Stats()
		require.EqualValues(t, 1, stats.Loads)
		require.EqualValues(t, 1, stats.FailOpenLoads)
		require.EqualValues(t, 1, stats.RedisErrors)
	})

	// A dashboard subtracts FailOpenLoads from Loads (loads while Redis
	// answered): no snapshot may hold a fail-open load but not its load,
	// which made that difference wrap round to 2^64-1.
	t.Run("StatsNeverShowMoreFailOpenLoadsThanLoads", func(t *testing.T) {
		t.Parallel()
		client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: time.Second})
		t.Cleanup(func() { _ = client.Close() })
		b := setupWith(t, client, "vc:", nil)
		loadCtx, stop := context.WithTimeout(ctx, time.Second)
		defer stop()
		var loaders sync.WaitGroup
		for range 2 {
			loaders.Go(func() {
				for loadCtx.Err() == nil {
					_, _ = b.cache.Get(loadCtx, "p1", func(context.Context) (product, error) { return product{ID: "p1"}, nil })
				}
			})
		}
		reads, inconsistent := 0, 0
		var example Stats
		for loadCtx.Err() == nil {
			s := b.cache.Stats()
			reads++
			if s.FailOpenLoads > s.Loads {
				if inconsistent == 0 {
					example = s
				}
				inconsistent++
			}
		}
		loaders.Wait()
		final := b.cache.Stats()
		require.Positive(t, final.FailOpenLoads)
		require.Equal(t, final.Loads, final.FailOpenLoads, "every load ran because Redis failed")
		require.Zero(t, inconsistent, "of %d snapshots (%d fail-open loads): e.g. FailOpenLoads %d, Loads %d",
			reads, final.FailOpenLoads, example.FailOpenLoads, example.Loads)
	})

	t.Run("FailOpenServesTheDatabaseNeverTheOldValue", func(t *testing.T) {
		t.Parallel()
		rs, b := setupPrivate(t, FailOpen)
		b.truth.write("p1", 4900)
		_, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)

		require.NoError(t, rs.Stop())
		want := b.truth.write("p1", 4400)
		err = b.cache.Invalidate(ctx, "p1")
		var rerr *RedisError
		require.ErrorAs(t, err, &rerr, "a lost invalidation must be reported")
		require.Equal(t, "invalidate", rerr.Op)

		got, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, want, got)
		require.Positive(t, b.cache.Stats().RedisErrors)

		// Back, empty (no persistence): the version restarts from the clock.
		require.NoError(t, rs.Start())
		got, err = b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, want, got)
		_, _, ok, err := b.cache.Peek(ctx, "p1")
		require.NoError(t, err)
		require.True(t, ok, "filled again once Redis is back")
	})

	t.Run("FailClosedReturnsTypedError", func(t *testing.T) {
		t.Parallel()
		rs, b := setupPrivate(t, FailClosed)
		b.truth.write("p1", 4900)
		require.NoError(t, rs.Stop())
		loadsBefore := b.truth.loads.Load()
		_, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		var rerr *RedisError
		require.ErrorAs(t, err, &rerr)
		require.Equal(t, "read", rerr.Op)
		require.Equal(t, "p1", rerr.ID)
		require.ErrorIs(t, err, ErrRedis)
		require.Equal(t, loadsBefore, b.truth.loads.Load(), "fail-closed does not touch the database")
	})

	// FailClosed refuses a failed read only: once the loader ran, its
	// value is served even though caching it failed, and that fill is a
	// Redis error.
	t.Run("FailClosedServesALoadWhoseFillFailed", func(t *testing.T) {
		t.Parallel()
		rs, b := setupPrivate(t, FailClosed)
		want := b.truth.write("p1", 4900)
		got, err := b.cache.Get(ctx, "p1", func(ctx context.Context) (product, error) {
			require.NoError(t, rs.Stop())
			return b.truth.loader("p1")(ctx)
		})
		require.NoError(t, err)
		require.Equal(t, want, got)
		stats := b.cache.Stats()
		require.EqualValues(t, 1, stats.Loads)
		require.Zero(t, stats.FailOpenLoads, "the read succeeded: not a fail-open load")
		require.Zero(t, stats.Fills)
		require.Zero(t, stats.StaleFillsSkipped, "the fill failed: no version check refused it")
		require.EqualValues(t, 1, stats.RedisErrors, "the failed fill")
	})

	// Process A holds the fill lease of p1 and is loading; process B (own
	// Cache, own client) misses p1 and polls for A's value; then B loses
	// Redis. The failed poll is a Redis failure like any other, not a
	// reason to load: B must follow its FailureMode. It returns B, the
	// current row and what B's Get returned.
	redisDownWhileWaiting := func(t *testing.T, mode FailureMode) (b *testBundle, want, got product, err error) {
		t.Helper()
		rd := testenv.Redis(t)
		a := setupWith(t, rd.Client, rd.Prefix, &Config{FillLeaseTTL: time.Minute})
		want = a.truth.write("p1", 4900)
		opt, err := redis.ParseURL(rd.URL)
		require.NoError(t, err)
		clientB := redis.NewClient(opt)
		t.Cleanup(func() { _ = clientB.Close() })
		// B never gives up on A's lease: only the Redis failure ends its wait.
		b = setupWith(t, clientB, rd.Prefix, &Config{FailureMode: mode, FillLeaseWait: time.Minute})
		b.truth.write("p1", 4900) // B's loader reads the same row

		loading, release := make(chan struct{}), make(chan struct{})
		aDone := make(chan error, 1)
		go func() {
			_, err := a.cache.Get(ctx, "p1", func(ctx context.Context) (product, error) {
				close(loading)
				<-release
				return a.truth.read("p1"), nil
			})
			aDone <- err
		}()
		defer func() {
			close(release)
			require.NoError(t, <-aDone)
		}()
		<-loading

		type result struct {
			val product
			err error
		}
		bDone := make(chan result, 1)
		go func() {
			val, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
			bDone <- result{val, err}
		}()
		require.Eventually(t, func() bool { return b.cache.Stats().LeaseWaits == 1 },
			10*time.Second, time.Millisecond, "B waits for A's fill")
		require.NoError(t, clientB.Close())
		res := <-bDone
		require.Zero(t, b.cache.Stats().LeaseFallbacks, "B did not give up on the lease")
		return b, want, res.val, res.err
	}

	t.Run("FailClosedWhileWaitingForLease", func(t *testing.T) {
		t.Parallel()
		b, _, _, err := redisDownWhileWaiting(t, FailClosed)
		var rerr *RedisError
		require.ErrorAs(t, err, &rerr)
		require.Equal(t, "read", rerr.Op)
		require.Equal(t, "p1", rerr.ID)
		require.ErrorIs(t, err, redis.ErrClosed)
		require.Zero(t, b.truth.loads.Load(), "fail-closed does not touch the database")
		stats := b.cache.Stats()
		require.Zero(t, stats.Loads)
		require.Zero(t, stats.FailOpenLoads)
		require.EqualValues(t, 1, stats.RedisErrors)
	})

	t.Run("FailOpenWhileWaitingForLease", func(t *testing.T) {
		t.Parallel()
		b, want, got, err := redisDownWhileWaiting(t, FailOpen)
		require.NoError(t, err)
		require.Equal(t, want, got)
		require.EqualValues(t, 1, b.truth.loads.Load())
		stats := b.cache.Stats()
		require.EqualValues(t, 1, stats.Loads)
		require.EqualValues(t, 1, stats.FailOpenLoads, "a load because Redis failed is a fail-open load")
		require.EqualValues(t, 1, stats.RedisErrors)
		// Redis failed after the call missed: it stays a miss (a fallback
		// too), unlike a call whose first read failed, which is neither.
		require.EqualValues(t, 1, stats.Misses)
		require.Zero(t, stats.Hits)
	})

	// An outage is one condition, not one per Get: the cache logs its
	// first failure at once, then at most one a second, each line counting
	// the failures it left out since the line before; Stats count them all.
	t.Run("FailOpenOutageLogsAtMostOnceASecond", func(t *testing.T) {
		t.Parallel()
		rs := testenv.StartRedis(t)
		// One dial per failed Get, not five: the outage is only refused
		// connections.
		client := redis.NewClient(&redis.Options{Addr: rs.Addr(), MaxRetries: -1, DialerRetries: 1})
		t.Cleanup(func() { _ = client.Close() })
		logs := &testenv.LogSink{}
		b := setupWith(t, client, "vc:", &Config{FailureMode: FailOpen, Logger: logs.Logger()})
		want := b.truth.write("p1", 4900)
		require.NoError(t, rs.Stop())

		const reads = 200
		start := time.Now()
		for i := range reads {
			var got product
			var err error
			if i%2 == 0 {
				got, err = b.cache.Get(ctx, "p1", b.truth.loader("p1"))
			} else {
				got, err = b.cache.GetAt(ctx, "p1", want.Version, b.truth.loader("p1"))
			}
			require.NoError(t, err)
			require.Equal(t, want, got)
		}
		elapsed := time.Since(start)
		lines := logs.Lines(t, "")
		require.NotEmpty(t, lines, "the outage is logged")
		require.LessOrEqual(t, len(lines), 1+int(elapsed/lograte.Interval),
			"%d lines for %d Gets in %v", len(lines), reads, elapsed)
		require.Zero(t, lines[0][lograte.Suppressed], "the first failure is logged at once")

		// Once the interval is over, the next failure is logged with the
		// count of those left out.
		time.Sleep(lograte.Interval)
		_, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		lines = logs.Lines(t, "")
		last := lines[len(lines)-1]
		require.Positive(t, last[lograte.Suppressed])
		logged := 0.0
		for _, l := range lines {
			require.Equal(t, "versioncache: redis failed; serving from loader", l["msg"])
			logged += 1 + l[lograte.Suppressed].(float64)
		}
		require.EqualValues(t, reads+1, logged, "each failure is logged or counted by a line")
		require.EqualValues(t, reads+1, b.cache.Stats().RedisErrors)
		require.EqualValues(t, reads+1, b.cache.Stats().FailOpenLoads)

		// Back: the client's pool redials within a second (ending the
		// goroutine that retries its dial).
		require.NoError(t, rs.Start())
		require.Eventually(t, func() bool {
			_, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
			_, _, cached, perr := b.cache.Peek(ctx, "p1")
			return err == nil && perr == nil && cached
		}, 10*time.Second, 10*time.Millisecond)
	})

	// A lease release that fails (Redis went away while the load ran) is
	// logged at most once a second, so Stats must count every one.
	t.Run("FailedLeaseReleaseIsCounted", func(t *testing.T) {
		t.Parallel()
		rs := testenv.StartRedis(t)
		client := redis.NewClient(&redis.Options{Addr: rs.Addr(), MaxRetries: -1, DialerRetries: 1})
		t.Cleanup(func() { _ = client.Close() })
		logs := &testenv.LogSink{}
		b := setupWith(t, client, "vc:", &Config{FailureMode: FailClosed, Logger: logs.Logger()})
		loadErr := errors.New("database down")
		_, err := b.cache.Get(ctx, "p1", func(context.Context) (product, error) {
			require.NoError(t, rs.Stop())
			return product{}, loadErr
		})
		require.ErrorIs(t, err, loadErr)
		lines := logs.Lines(t, "")
		require.Len(t, lines, 1)
		require.Equal(t, "versioncache: releasing fill lease failed", lines[0]["msg"])
		require.EqualValues(t, 1, b.cache.Stats().RedisErrors, "the release runs detached: its failure is Redis's")
	})

	t.Run("CanceledContext", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		ctx, cancel := context.WithCancel(ctx)
		cancel()
		_, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.ErrorIs(t, err, context.Canceled)
		require.Zero(t, b.truth.loads.Load())
		// The caller gave up; Redis did not fail: no *RedisError to alert
		// on, under either failure mode, from Get, GetAt or Peek.
		require.NotErrorIs(t, err, ErrRedis)
		_, err = b.cache.GetAt(ctx, "p1", 1, b.truth.loader("p1"))
		require.ErrorIs(t, err, context.Canceled)
		require.NotErrorIs(t, err, ErrRedis)
		_, _, _, err = b.cache.Peek(ctx, "p1")
		require.ErrorIs(t, err, context.Canceled)
		require.NotErrorIs(t, err, ErrRedis)
		require.Zero(t, b.cache.Stats().RedisErrors)
		closed := setup(t, &Config{FailureMode: FailClosed})
		_, err = closed.cache.Get(ctx, "p1", closed.truth.loader("p1"))
		require.ErrorIs(t, err, context.Canceled)
		require.NotErrorIs(t, err, ErrRedis)
		require.Zero(t, closed.cache.Stats().RedisErrors)
		// Invalidate still reports it (the bump may have happened), but
		// counts no Redis failure either.
		for _, cfg := range []*Config{nil, {InvalidateReplicas: 1}} {
			c := setup(t, cfg)
			err = c.cache.Invalidate(ctx, "p1")
			require.ErrorIs(t, err, ErrRedis)
			require.ErrorIs(t, err, context.Canceled)
			require.Zero(t, c.cache.Stats().RedisErrors, "%+v", cfg)
		}
	})
}

// The fixes an InvalidateWaitTimeout error names, with their durations.
var (
	lowerTo = regexp.MustCompile(`lower it to at most ([0-9.hmsunµ]+)`)
	raiseTo = regexp.MustCompile(`ReadTimeout to at least ([0-9.hmsunµ]+)( above)?`)
)

// A failover that loses the bump but keeps the version key does not make it
// disappear: it makes it old. Re-seeding from the clock cannot help then;
// the previous value is readable again. This pins that limitation down, and
// the InvalidateReplicas option that narrows it.
func TestLostBump(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("OldVersionKeyServesOldValue", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		b.truth.write("p1", 4900)
		_, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		version, err := b.client.Get(ctx, b.cache.versionKey("p1")).Result()
		require.NoError(t, err)
		current, err := b.client.Get(ctx, b.cache.currentKey("p1")).Result()
		require.NoError(t, err)

		b.truth.write("p1", 4400)
		require.NoError(t, b.cache.Invalidate(ctx, "p1"))
		// The promoted replica never saw the bump, nor the delete that is
		// part of the same script.
		require.NoError(t, b.client.Set(ctx, b.cache.versionKey("p1"), version, 0).Err())
		require.NoError(t, b.client.Set(ctx, b.cache.currentKey("p1"), current, 0).Err())

		got, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, 4900, got.Price)
	})

	t.Run("InvalidateReplicasReportsUnconfirmedBump", func(t *testing.T) {
		t.Parallel()
		// The shared test server has no replicas: nobody can confirm.
		b := setup(t, &Config{InvalidateReplicas: 1, InvalidateWaitTimeout: 20 * time.Millisecond})
		b.truth.write("p1", 1)
		err := b.cache.Invalidate(ctx, "p1")
		var rerr *ReplicationError
		require.ErrorAs(t, err, &rerr)
		require.Equal(t, 1, rerr.Want)
		require.Equal(t, 0, rerr.Got)
		require.ErrorIs(t, err, ErrNotReplicated)
		_, version, _, err := b.cache.Peek(ctx, "p1")
		require.NoError(t, err)
		require.Positive(t, version, "the primary has the bump")
		stats := b.cache.Stats()
		require.Zero(t, stats.Invalidations, "a failed Invalidate is not a successful one")
		require.Equal(t, uint64(1), stats.ReplicationErrors)
	})

	t.Run("InvalidateWaitTimeoutBelowReadTimeout", func(t *testing.T) {
		t.Parallel()
		// A client that gave up on WAIT's reply would report a Redis
		// error for a bump that happened, and retry it: refused up front.
		for _, tc := range []struct {
			readTimeout, wait time.Duration
			ctxTimeout        bool
			ok                bool
		}{
			{200 * time.Millisecond, 500 * time.Millisecond, false, false},
			{200 * time.Millisecond, 150 * time.Millisecond, false, false}, // within the slack
			{200 * time.Millisecond, 100 * time.Millisecond, false, false}, // WAIT answers up to 100 ms late
			{350 * time.Millisecond, 100 * time.Millisecond, false, true},
			{200 * time.Millisecond, math.MaxInt64, false, false}, // "as long as it takes": no overflow past the check
			{200 * time.Millisecond, math.MaxInt64 - 50*time.Millisecond, false, false},
			{0, 5 * time.Second, false, false}, // go-redis's 5 s default
			{0, time.Second, false, true},
			// No read timeout: the ctx's deadline bounds WAIT's reply
			// (without ContextTimeoutEnabled, New refuses the client).
			{-1, time.Minute, true, true},
			// Too short a ReadTimeout for the default (wait 0), or for any
			// InvalidateWaitTimeout: only a longer one is a fix.
			{80 * time.Millisecond, 0, false, false},
			{150 * time.Millisecond, 0, false, false},
			{100 * time.Millisecond, time.Millisecond, false, false},
			{100*time.Millisecond + 500*time.Microsecond, 0, false, false},
			{80 * time.Millisecond, math.MaxInt64, false, false},
		} {
			newCache := func(readTimeout, wait time.Duration, replicas int) error {
				client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", ReadTimeout: readTimeout, ContextTimeoutEnabled: tc.ctxTimeout})
				defer client.Close()
				_, err := New[product](client, &Config{Prefix: "p:", InvalidateReplicas: replicas, InvalidateWaitTimeout: wait})
				return err
			}
			err := newCache(tc.readTimeout, tc.wait, 1)
			if tc.ok {
				require.NoError(t, err, "%+v", tc)
				continue
			}
			var cerr *ConfigError
			require.ErrorAs(t, err, &cerr, "%+v", tc)
			require.Equal(t, "InvalidateWaitTimeout", cerr.Field)
			// Every fix the error names is one New accepts.
			fixes := 0
			if m := lowerTo.FindStringSubmatch(cerr.Reason); m != nil {
				wait, perr := time.ParseDuration(m[1])
				require.NoError(t, perr, cerr.Reason)
				require.NoError(t, newCache(tc.readTimeout, wait, 1), "lowered as told: %s", cerr.Reason)
				fixes++
			}
			if m := raiseTo.FindStringSubmatch(cerr.Reason); m != nil && m[2] == "" { // not "100ms above" another value
				readTimeout, perr := time.ParseDuration(m[1])
				require.NoError(t, perr, cerr.Reason)
				require.NoError(t, newCache(readTimeout, tc.wait, 1), "raised as told: %s", cerr.Reason)
				fixes++
			}
			if strings.Contains(cerr.Reason, "leave InvalidateReplicas 0") {
				require.NoError(t, newCache(tc.readTimeout, tc.wait, 0), cerr.Reason)
				fixes++
			}
			require.Positive(t, fixes, "no fix named: %s", cerr.Reason)
			require.Equal(t, tc.wait == 0, strings.Contains(cerr.Reason, "the default"), cerr.Reason)
		}
	})

	// The same check for a cluster client, whose bump and WAIT go to the
	// id's master in one pipeline, read with the cluster's ReadTimeout.
	t.Run("InvalidateWaitTimeoutBelowClusterReadTimeout", func(t *testing.T) {
		t.Parallel()
		client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{"127.0.0.1:1"}, ReadTimeout: 350 * time.Millisecond})
		defer client.Close()
		_, err := New[product](client, &Config{Prefix: "p:", InvalidateReplicas: 1, InvalidateWaitTimeout: 500 * time.Millisecond})
		var cerr *ConfigError
		require.ErrorAs(t, err, &cerr)
		require.Equal(t, "InvalidateWaitTimeout", cerr.Field)
		require.Contains(t, cerr.Reason, "(350ms)", "it names the cluster client's ReadTimeout")
		_, err = New[product](client, &Config{Prefix: "p:", InvalidateReplicas: 1, InvalidateWaitTimeout: 100 * time.Millisecond})
		require.NoError(t, err)
	})

	t.Run("InvalidateReplicasNeedsKnownClient", func(t *testing.T) {
		t.Parallel()
		ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": "127.0.0.1:1"}})
		defer ring.Close()
		_, err := New[product](ring, &Config{Prefix: "p:", InvalidateReplicas: 1})
		var cerr *ConfigError
		require.ErrorAs(t, err, &cerr)
		require.Equal(t, "InvalidateReplicas", cerr.Field)
	})
}

// deadlineRecorder is a go-redis hook that records each command sent
// after loaded was set, with its context's deadline.
type deadlineRecorder struct {
	testenv.PassThroughHook
	loaded atomic.Bool
	mu     sync.Mutex
	sent   []sentCommand
}

type sentCommand struct {
	name        string
	deadline    time.Time
	hasDeadline bool
}

func (h *deadlineRecorder) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.loaded.Load() {
			deadline, ok := ctx.Deadline()
			h.mu.Lock()
			h.sent = append(h.sent, sentCommand{name: cmd.Name(), deadline: deadline, hasDeadline: ok})
			h.mu.Unlock()
		}
		return next(ctx, cmd)
	}
}

func (h *deadlineRecorder) afterLoad() []sentCommand {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]sentCommand(nil), h.sent...)
}
