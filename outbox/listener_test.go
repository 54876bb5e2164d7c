package outbox_test

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/outbox"
)

// listeners counts the connections LISTENing on the bundle's channel.
func (b *testBundle) listeners(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity WHERE query = $1`,
		`LISTEN "`+b.writer.Channel()+`"`).Scan(&n))
	return n
}

// countingPool returns a pool of the bundle's database that counts its
// acquisitions (a claim pass takes at least one).
func (b *testBundle) countingPool(t *testing.T, acquired *atomic.Int64) *pgxpool.Pool {
	t.Helper()
	return poolWith(t, b, func(cfg *pgxpool.Config) {
		cfg.PrepareConn = func(context.Context, *pgx.Conn) (bool, error) {
			acquired.Add(1)
			return true, nil
		}
	})
}

func (b *testBundle) listener(t *testing.T, pool *pgxpool.Pool) *outbox.Listener {
	t.Helper()
	if pool == nil {
		pool = b.pool
	}
	l, err := outbox.NewListener(pool, &outbox.ListenerConfig{Schema: b.cfg.Schema, Table: b.cfg.Table, ReconnectBackoffMax: 100 * time.Millisecond})
	require.NoError(t, err)
	return l
}

func TestListener(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// Relays sharing a Listener hold one LISTEN connection between them,
	// and each is notified of its own stream's rows.
	t.Run("SharesOneConnection", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		l := b.listener(t, nil)
		streams := []string{"s0", "s1", "s2", "s3"}
		handlers := make([]*recorder, len(streams))
		for i, s := range streams {
			handlers[i] = &recorder{}
			startRun(t, b.relay(t, nil, handlers[i], outbox.RelayConfig{Streams: []string{s}, PollInterval: time.Hour, Listener: l}))
		}
		waitListening(t, b)
		time.Sleep(200 * time.Millisecond) // the relays' first claims are over
		require.Equal(t, 1, b.listeners(t), "relays sharing a Listener hold one LISTEN connection")
		for i, s := range streams {
			b.appendNow(t, newMessage(s, "k", int64(i+1)))
		}
		for i, h := range handlers {
			require.Eventually(t, func() bool { return len(h.seen()) == 1 }, 10*time.Second, 10*time.Millisecond,
				"relay of %s was not woken for its row (its PollInterval is an hour)", streams[i])
			require.Equal(t, streams[i], h.seen()[0].Stream)
		}
		require.Equal(t, 1, b.listeners(t))
	})

	// The idle check pings a healthy connection and keeps it: the same
	// backend listens throughout, and notifications sent at any moment,
	// during a ping too, still wake the relay at once.
	t.Run("IdleChecksKeepAHealthyConnection", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		// A ping must answer within the interval: 250 ms, so that a busy
		// machine does not fail a healthy connection's ping.
		const interval = 250 * time.Millisecond
		l, err := outbox.NewListener(b.pool, &outbox.ListenerConfig{Schema: b.cfg.Schema, Table: b.cfg.Table, ListenCheckInterval: interval})
		require.NoError(t, err)
		h := &recorder{}
		startRun(t, b.relay(t, nil, h, outbox.RelayConfig{PollInterval: time.Hour, Listener: l}))
		pid := waitListening(t, b)
		time.Sleep(4 * interval) // several idle checks
		for i := range 40 {
			b.appendNow(t, newMessage("s", "k", int64(i+1)))
			require.Eventually(t, func() bool { return len(h.seen()) == i+1 }, 5*time.Second, time.Millisecond,
				"row %d waits for the PollInterval (an hour): a notification was lost across an idle check", i+1)
			time.Sleep(time.Duration(i%7) * interval / 5) // up to 1.2 intervals: some sent during a check
		}
		require.Equal(t, pid, listenerPid(b), "an idle check replaced a healthy connection")
	})

	// A notification naming a stream wakes only the relays serving it; an
	// empty payload wakes them all.
	t.Run("WakesOnlyTheRelaysOfTheStream", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		l := b.listener(t, nil)
		var acquiredA, acquiredB atomic.Int64
		startRun(t, b.relay(t, b.countingPool(t, &acquiredA), &recorder{}, outbox.RelayConfig{Streams: []string{"a"}, PollInterval: time.Hour, Listener: l}))
		startRun(t, b.relay(t, b.countingPool(t, &acquiredB), &recorder{}, outbox.RelayConfig{Streams: []string{"b"}, PollInterval: time.Hour, Listener: l}))
		waitListening(t, b)
		quiet := func() (a, b int64) {
			for {
				a0, b0 := acquiredA.Load(), acquiredB.Load()
				time.Sleep(100 * time.Millisecond)
				if a, b := acquiredA.Load(), acquiredB.Load(); a == a0 && b == b0 {
					return a, b
				}
			}
		}
		notify := func(payload string) {
			_, err := b.pool.Exec(ctx, `SELECT pg_notify($1, $2)`, b.writer.Channel(), payload)
			require.NoError(t, err)
		}

		a0, b0 := quiet()
		for range 30 {
			notify("b")
			time.Sleep(5 * time.Millisecond)
		}
		a1, b1 := quiet()
		require.LessOrEqual(t, a1-a0, int64(2), "notifications for stream b woke relay a")
		require.Greater(t, b1, b0, "notifications for stream b did not wake relay b")

		notify("")
		require.Eventually(t, func() bool { return acquiredA.Load() > a1 && acquiredB.Load() > b1 }, 10*time.Second, 10*time.Millisecond,
			"an empty payload wakes every relay")
	})

	// Notifications sent while the connection is down are lost: once it is
	// back, the Listener wakes every relay, which then finds the rows.
	t.Run("WakesEveryRelayAfterReconnecting", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		var connects atomic.Int64
		gate := make(chan struct{})
		cfg, err := pgxpool.ParseConfig(b.pg.ConnString)
		require.NoError(t, err)
		cfg.BeforeConnect = func(ctx context.Context, _ *pgx.ConnConfig) error {
			if connects.Add(1) == 1 {
				return nil
			}
			select { // the reconnection waits until the rows are written
			case <-gate:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		listenPool, err := pgxpool.NewWithConfig(ctx, cfg)
		require.NoError(t, err)
		t.Cleanup(listenPool.Close)
		l := b.listener(t, listenPool)
		// Twenty relays woken at once find their rows in one partition:
		// all but one find it held, and must still deliver promptly.
		streams := make([]string, 20)
		handlers := make([]*recorder, len(streams))
		for i := range streams {
			streams[i] = fmt.Sprint("s", i)
			handlers[i] = &recorder{delay: 20 * time.Millisecond} // a projection's round trips
			startRun(t, b.relay(t, nil, handlers[i], outbox.RelayConfig{Streams: streams[i : i+1], PollInterval: time.Hour, Listener: l}))
		}
		pid := waitListening(t, b)
		time.Sleep(300 * time.Millisecond) // the relays' first claims are over

		_, err = b.pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid)
		require.NoError(t, err)
		require.Eventually(t, func() bool { return connects.Load() >= 2 }, 10*time.Second, 10*time.Millisecond, "the Listener reconnects")
		for _, s := range streams { // nobody listens
			b.appendNow(t, newMessage(s, "k", 1))
		}
		close(gate)
		requireEachDelivers(t, handlers, 5*time.Second, "a row written while the Listener was reconnecting")
	})

	// The connection is open only while a relay sharing the Listener runs:
	// the last Run to return closes it, and a later Run opens it again.
	t.Run("OpenWhileARelayRuns", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		l := b.listener(t, nil)
		time.Sleep(100 * time.Millisecond)
		require.Zero(t, b.listeners(t), "NewListener connected")

		stopA := startRun(t, b.relay(t, nil, &recorder{}, outbox.RelayConfig{Streams: []string{"a"}, Listener: l}))
		stopB := startRun(t, b.relay(t, nil, &recorder{}, outbox.RelayConfig{Streams: []string{"b"}, Listener: l}))
		waitListening(t, b)
		require.NoError(t, stopA())
		require.Equal(t, 1, b.listeners(t), "a relay still runs")
		require.NoError(t, stopB())
		requireNoListener(t, b, "the last relay's Run returned with the connection open")

		h := &recorder{}
		startRun(t, b.relay(t, nil, h, outbox.RelayConfig{Streams: []string{"c"}, PollInterval: time.Hour, Listener: l}))
		waitListening(t, b)
		time.Sleep(200 * time.Millisecond)
		b.appendNow(t, newMessage("c", "k", 1))
		require.Eventually(t, func() bool { return len(h.seen()) == 1 }, 10*time.Second, 10*time.Millisecond)
	})

	t.Run("Config", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		l := b.listener(t, nil)
		require.Equal(t, b.cfg.Schema, l.Config().Schema)
		require.Equal(t, 100*time.Millisecond, l.Config().ReconnectBackoffMax)

		def := (*outbox.ListenerConfig)(nil).WithDefaults()
		require.Equal(t, outbox.SchemaDefault, def.Schema)
		require.Equal(t, outbox.TableDefault, def.Table)
		require.Equal(t, outbox.ReconnectBackoffMaxDefault, def.ReconnectBackoffMax)
		require.Equal(t, outbox.ListenCheckIntervalDefault, def.ListenCheckInterval)
		require.NotNil(t, def.Logger)
		require.Equal(t, *def, (*outbox.Listener)(nil).Config())

		for name, tc := range map[string]struct {
			pool  *pgxpool.Pool
			cfg   outbox.ListenerConfig
			field string
		}{
			"NilPool":         {nil, outbox.ListenerConfig{}, "pool"},
			"ReservedSchema":  {b.pool, outbox.ListenerConfig{Schema: "pg_x"}, "Schema"},
			"DerivedTable":    {b.pool, outbox.ListenerConfig{Table: "q_dead"}, "Table"},
			"NegativeBackoff": {b.pool, outbox.ListenerConfig{ReconnectBackoffMax: -time.Second}, "ReconnectBackoffMax"},
			"NegativeCheck":   {b.pool, outbox.ListenerConfig{ListenCheckInterval: -time.Second}, "ListenCheckInterval"},
			"TinyBackoff":     {b.pool, outbox.ListenerConfig{ReconnectBackoffMax: 5}, "ReconnectBackoffMax"},
			"TinyCheck":       {b.pool, outbox.ListenerConfig{ListenCheckInterval: time.Microsecond}, "ListenCheckInterval"},
		} {
			_, err := outbox.NewListener(tc.pool, &tc.cfg)
			var cerr *outbox.ConfigError
			require.ErrorAs(t, err, &cerr, name)
			require.Equal(t, tc.field, cerr.Field, name)
			require.ErrorIs(t, err, outbox.ErrInvalidConfig, name)
		}

		other, err := outbox.NewListener(b.pool, &outbox.ListenerConfig{Schema: b.cfg.Schema, Table: "other", Logger: slog.Default()})
		require.NoError(t, err)
		for name, cfg := range map[string]outbox.RelayConfig{
			"AnotherTable":      {Listener: other},
			"WithDisableNotify": {Listener: l, DisableNotify: true},
			"NotFromNew":        {Listener: &outbox.Listener{}},
		} {
			cfg.Schema, cfg.Table = b.cfg.Schema, b.cfg.Table
			_, err := outbox.NewRelay(b.pool, &recorder{}, &cfg)
			var cerr *outbox.ConfigError
			require.ErrorAs(t, err, &cerr, name)
			require.Equal(t, "Listener", cerr.Field, name)
		}
	})
}

// TestListenerStopGivesShutdownTimeout: the last relay to stop closes the
// shared connection within its ShutdownTimeout, as its own connection
// would be, even while the connection's setup (AfterConnect, LISTEN) hangs;
// a setup that ends within ShutdownTimeout is let finish, not cut off.
func TestListenerStopGivesShutdownTimeout(t *testing.T) {
	t.Parallel()
	for name, shared := range map[string]bool{"OwnConnection": false, "SharedListener": true} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			t.Run("HangingSetupIsCut", func(t *testing.T) {
				t.Parallel()
				stop, _ := runWithListenSetupHanging(t, shared, 100*time.Millisecond, nil)
				began := time.Now()
				require.NoError(t, stop())
				require.Less(t, time.Since(began), time.Second, "Run waited past ShutdownTimeout for the LISTEN connection's setup")
			})

			// A statement cut off mid-flight makes pgx close its connection
			// in the background (over TLS, for up to 15 s): within
			// ShutdownTimeout the setup keeps its context.
			t.Run("SetupFinishesWithinShutdownTimeout", func(t *testing.T) {
				t.Parallel()
				proceed := make(chan struct{})
				stop, cut := runWithListenSetupHanging(t, shared, time.Minute, proceed)
				stopped := make(chan error, 1)
				go func() { stopped <- stop() }()
				require.Never(t, cut.Load, time.Second, time.Millisecond,
					"the LISTEN connection's setup was cut off long before ShutdownTimeout")
				close(proceed)
				require.NoError(t, receive(t, stopped))
				require.False(t, cut.Load())
			})
		})
	}
}

// runWithListenSetupHanging runs a relay whose LISTEN connection's
// AfterConnect hangs until its context ends (then cut reports true) or
// proceed is closed (never, when nil), the connection shared through a
// Listener or the relay's own. It returns once the hook hangs and the
// relay's first claim is over.
func runWithListenSetupHanging(t *testing.T, shared bool, shutdownTimeout time.Duration, proceed <-chan struct{}) (stop func() error, cut *atomic.Bool) {
	t.Helper()
	b := setup(t)
	entered := make(chan struct{}, 1)
	cut = new(atomic.Bool)
	var hang atomic.Bool // set once the pool holds a connection for the claims
	cfg, err := pgxpool.ParseConfig(b.pg.ConnString)
	require.NoError(t, err)
	cfg.AfterConnect = func(ctx context.Context, _ *pgx.Conn) error {
		if !hang.Load() {
			return nil
		}
		select {
		case entered <- struct{}{}:
		default:
		}
		select { // a session setup that does not end by itself (a lock, a slow server)
		case <-ctx.Done():
			cut.Store(true)
			return ctx.Err()
		case <-proceed:
			return nil
		}
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	c, err := pool.Acquire(context.Background())
	require.NoError(t, err)
	c.Release()
	hang.Store(true)
	rc := outbox.RelayConfig{PollInterval: time.Hour, ShutdownTimeout: shutdownTimeout}
	if shared {
		rc.Listener = b.listener(t, pool)
	}
	stop = startRun(t, b.relay(t, pool, &recorder{}, rc))
	receive(t, entered)
	// The relay's first claim (on the pool's idle connection) must
	// be over: cut off by the shutdown, it would lose its
	// connection, and its release, which needs a new one, would
	// hang in AfterConnect for its own bound (5 s), not the
	// LISTEN's.
	require.Eventually(t, func() bool {
		st := pool.Stat()
		return st.AcquireCount() >= 2 && st.AcquiredConns() == 0
	}, 10*time.Second, time.Millisecond, "the relay's first claim")
	return stop, cut
}

// requireEachDelivers waits until each handler has seen one row, failing
// the test, with what, when one has not within d.
func requireEachDelivers(t *testing.T, handlers []*recorder, d time.Duration, what string) {
	t.Helper()
	deadline := time.Now().Add(d)
	for i, h := range handlers {
		require.Eventually(t, func() bool { return len(h.seen()) == 1 }, max(time.Until(deadline), time.Millisecond), 10*time.Millisecond,
			"%s: relay %d had not handled it within %s", what, i, d)
	}
}
