package outbox_test

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/verity-go/verity/internal/telemetry/metrictest"
	"github.com/verity-go/verity/outbox"
)

func TestRelayMetrics(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// A refresh stuck on a half-open connection is cut off, so the gauges
	// come back once the database answers on new connections: unbounded,
	// it held the refresh loop until the kernel gave up on the socket, and
	// the gauges stayed absent as if the relay had stopped.
	t.Run("StatsRefreshOnAHalfOpenConnection", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		rec := metrictest.New(t)
		proxy, pool := holePool(t, b, nil)
		h := &recorder{}
		r := b.relay(t, pool, h, outbox.RelayConfig{
			MeterProvider: rec.Provider, StatsInterval: 50 * time.Millisecond,
			DisableNotify: true, PollInterval: 50 * time.Millisecond,
			LeaseDuration: time.Second, ShutdownTimeout: time.Second,
		})
		startRun(t, r)
		require.Eventually(t, func() bool { return rec.Collect(t).Has("verity.outbox.pending") },
			10*time.Second, 10*time.Millisecond, "the gauges report while running")
		require.Positive(t, proxy.freezeAll(), "every pool connection stops answering")
		b.appendCommitted(t, newMessage("scores", "after-freeze", 1))
		require.Eventually(t, func() bool { return len(h.seen()) == 1 }, 20*time.Second, 20*time.Millisecond,
			"the relay recovers from the frozen connections")
		// Back once a refresh that met a frozen connection is cut off
		// and the next one answers.
		require.Eventually(t, func() bool { return rec.Collect(t).Has("verity.outbox.pending") },
			20*time.Second, 20*time.Millisecond, "the backlog gauges stay absent while the relay runs and the database answers")
	})

	t.Run("CountersAddUpPerBatch", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		rec := metrictest.New(t)
		bad := newMessage("scores", "user-bad", 1)
		b.appendCommitted(t, newMessage("scores", "user-1", 1), newMessage("scores", "user-2", 1), bad)
		h := &recorder{fail: func(r outbox.Record) error {
			if r.EventID == bad.EventID {
				return errors.New("boom")
			}
			return nil
		}}
		r := b.relay(t, nil, h, outbox.RelayConfig{MaxAttempts: 1, MeterProvider: rec.Provider})

		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 3, n)
		table := attribute.String(outbox.AttributeTable, b.cfg.Schema+".verity_outbox")
		s := rec.Collect(t)
		require.Equal(t, int64(3), s.Int("verity.outbox.claimed", table))
		require.Equal(t, int64(2), s.Int("verity.outbox.acked", table))
		require.Equal(t, int64(1), s.Int("verity.outbox.dead_lettered", table))
		require.Zero(t, s.Int("verity.outbox.retried"))
		require.Equal(t, uint64(1), s.Count("verity.outbox.handler.duration", table))
		require.Equal(t, "{row}", s.Unit("verity.outbox.claimed"))
		require.Equal(t, "s", s.Unit("verity.outbox.handler.duration"))

		// The dead letter comes back, fails again under a more patient
		// relay and is retried instead of buried.
		moved, err := r.ReplayDead(ctx, outbox.ReplayFilter{})
		require.NoError(t, err)
		require.Equal(t, int64(1), moved)
		patient := b.relay(t, nil, h, outbox.RelayConfig{MaxAttempts: 5, MeterProvider: rec.Provider})
		n, err = patient.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)

		s = rec.Collect(t)
		require.Equal(t, int64(1), s.Int("verity.outbox.replayed", table))
		require.Equal(t, int64(4), s.Int("verity.outbox.claimed", table))
		require.Equal(t, int64(2), s.Int("verity.outbox.acked", table))
		require.Equal(t, int64(1), s.Int("verity.outbox.retried", table))
		require.Equal(t, int64(1), s.Int("verity.outbox.dead_lettered", table))
		require.Equal(t, uint64(2), s.Count("verity.outbox.handler.duration", table))
	})

	t.Run("NothingClaimedRecordsNothing", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		rec := metrictest.New(t)
		r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{MeterProvider: rec.Provider})
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Zero(t, n)
		s := rec.Collect(t)
		require.Zero(t, s.Int("verity.outbox.claimed"))
		require.Zero(t, s.Count("verity.outbox.handler.duration"))
	})

	t.Run("BacklogGaugesWhileRunning", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		rec := metrictest.New(t)
		b.appendCommitted(t, newMessage("scores", "a", 1), newMessage("scores", "b", 1), newMessage("scores", "c", 1))
		failAll := &recorder{fail: func(outbox.Record) error { return errors.New("projection down") }}
		r := b.relay(t, nil, failAll, outbox.RelayConfig{
			MeterProvider:   rec.Provider,
			StatsInterval:   20 * time.Millisecond,
			RetryBackoffMin: time.Hour,
			RetryBackoffMax: time.Hour,
		})
		// Before Run nothing is observed: the gauges belong to a running relay.
		require.Zero(t, rec.Collect(t).Int("verity.outbox.pending"))

		stop := startRun(t, r)
		require.Eventually(t, func() bool {
			s := rec.Collect(t)
			return s.Int("verity.outbox.retrying") == 3
		}, 10*time.Second, 10*time.Millisecond, "the failed rows wait out their backoff")
		s := rec.Collect(t)
		require.Equal(t, int64(3), s.Int("verity.outbox.pending"))
		require.Zero(t, s.Int("verity.outbox.in_flight"))
		require.Zero(t, s.Int("verity.outbox.dead_letters"))
		require.Positive(t, s.Float("verity.outbox.oldest_pending_age"))
		require.Equal(t, int64(3), s.Int("verity.outbox.retried"))

		require.NoError(t, stop())
		s = rec.Collect(t)
		require.Zero(t, s.Int("verity.outbox.pending"), "a stopped relay no longer reports its backlog")
		require.Equal(t, int64(3), s.Int("verity.outbox.retried"), "counters survive the relay")
	})

	// A StatsInterval above half the largest Duration: twice it, the age
	// past which a snapshot is no longer reported, wrapped negative, and
	// no snapshot was ever reported.
	t.Run("BacklogGaugesWithTheLongestStatsInterval", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		rec := metrictest.New(t)
		b.appendCommitted(t, newMessage("scores", "a", 1))
		failAll := &recorder{fail: func(outbox.Record) error { return errors.New("projection down") }}
		r := b.relay(t, nil, failAll, outbox.RelayConfig{
			MeterProvider: rec.Provider, StatsInterval: math.MaxInt64,
			RetryBackoffMin: time.Hour, RetryBackoffMax: time.Hour,
		})
		startRun(t, r)
		require.Eventually(t, func() bool { return rec.Collect(t).Int("verity.outbox.retried") == 1 },
			10*time.Second, 10*time.Millisecond)
		require.Eventually(t, func() bool { return rec.Collect(t).Has("verity.outbox.pending") },
			5*time.Second, 10*time.Millisecond, "Run's first snapshot is reported")
	})

	// A typed-nil provider (a *sdkmetric.MeterProvider left nil when
	// metrics are off) records nothing, like an untyped nil.
	t.Run("TypedNilProvider", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{MeterProvider: (*sdkmetric.MeterProvider)(nil)})
		_, err := r.RunOnce(ctx)
		require.NoError(t, err)
	})

	t.Run("InvalidStatsInterval", func(t *testing.T) {
		t.Parallel()
		_, err := outbox.NewRelay(setup(t).pool, &recorder{}, &outbox.RelayConfig{StatsInterval: -time.Second})
		var cfgErr *outbox.ConfigError
		require.ErrorAs(t, err, &cfgErr)
		require.Equal(t, "StatsInterval", cfgErr.Field)
	})
}
