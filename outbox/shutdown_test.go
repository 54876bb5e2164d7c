package outbox_test

import (
	"bytes"
	"context"
	"net"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/telemetry/metrictest"
	"github.com/verity-go/verity/outbox"
)

// TestRelayRunLeavesNothingClosing checks that once Run returns, none of its
// connections is still being closed. pgx closes a connection cut off
// mid-statement in a goroutine of its own (a cancel request, then reading
// until the server hangs up): Run must wait for that for its LISTEN
// connection, or a caller's goroutine leak check fails, and must not cut off
// a claim it has sent, or the pool's Close waits for such a goroutine — over
// TLS, when the cut falls between two writes, for pgx's full 15 s. Run is
// stopped at varying moments, some while LISTEN or a claim is in flight.
//
// It does not call t.Parallel: it looks at every goroutine of the binary,
// and parallel tests only start once the sequential ones are done.
func TestRelayRunLeavesNothingClosing(t *testing.T) {
	b := setup(t)
	for round := range 200 {
		relayPool := newPoolNamed(t, b.pg.ConnString, "verity_relay_closes_listener")
		r := b.relay(t, relayPool, &recorder{}, outbox.RelayConfig{PollInterval: time.Hour})
		stop := startRun(t, r)
		time.Sleep(time.Duration(round%10) * time.Millisecond)
		require.NoError(t, stop())
		began := time.Now()
		relayPool.Close()
		require.Less(t, time.Since(began), 5*time.Second, "round %d: the pool's Close waited for a connection being closed", round)
		closing := closingConnections()
		require.Empty(t, closing, "round %d: a connection was still being closed after Run returned and its pool closed", round)
	}
}

// TestRelayRunLetsAProbeFinish stops Run while its LISTEN connection's
// probe (a pg_notify through the pool, sent right after LISTEN) waits for
// the server's answer. The probe ran under Run's ctx, not under the grace
// the relay's other statements get: cut off mid-statement, pgx closed its
// pool connection in the background (a cancel request on a new connection,
// then Terminate), which outlived Run and held up the pool's Close (here
// new dials take 3 s). Sequential, for the same reason as
// TestRelayRunLeavesNothingClosing.
func TestRelayRunLetsAProbeFinish(t *testing.T) {
	b := setup(t)
	var probing, slowDials atomic.Bool
	pool := poolWith(t, b, func(pc *pgxpool.Config) {
		pc.ConnConfig.TLSConfig, pc.ConnConfig.Fallbacks = nil, nil // plain bytes for slowProbeConn
		pc.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			if slowDials.Load() {
				select {
				case <-time.After(3 * time.Second):
				case <-ctx.Done():
					return nil, ctx.Err()
				}
			}
			c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return &slowProbeConn{Conn: c, probing: &probing}, nil
		}
	})
	r := b.relay(t, pool, &recorder{}, outbox.RelayConfig{PollInterval: time.Hour})
	stop := startRun(t, r)
	require.Eventually(t, probing.Load, 10*time.Second, time.Millisecond, "the probe was never sent")
	slowDials.Store(true)
	require.NoError(t, stop())
	closing := closingConnections()
	began := time.Now()
	pool.Close()
	require.Empty(t, closing, "a pool connection was still being closed after Run returned (the probe was cut off)")
	require.Less(t, time.Since(began), time.Second, "the pool's Close waited for the probe's connection being closed")
}

// slowProbeConn delays the server's answer to the LISTEN probe's
// pg_notify by 300 ms (a slow server or network, for one statement).
type slowProbeConn struct {
	net.Conn
	probing *atomic.Bool // set once a probe was sent on any connection
	delay   atomic.Bool
}

func (c *slowProbeConn) Write(p []byte) (int, error) {
	if bytes.Contains(p, []byte("SELECT pg_notify($1::text, $2::text)")) {
		c.delay.Store(true)
		c.probing.Store(true)
	}
	return c.Conn.Write(p)
}

func (c *slowProbeConn) Read(p []byte) (int, error) {
	if c.delay.CompareAndSwap(true, false) {
		time.Sleep(300 * time.Millisecond)
	}
	return c.Conn.Read(p)
}

// closingConnections returns the stacks of the goroutines in which pgx is
// still closing an interrupted connection. A goroutine found with pgx's
// closing function as its only frame is either yet to start or returning,
// its cleanup already signalled: it is looked at again until it has either
// gone or got busy closing.
func closingConnections() []string {
	for range 100 {
		closing, undecided := closingGoroutines()
		if undecided == 0 {
			return closing
		}
		time.Sleep(time.Millisecond)
	}
	closing, _ := closingGoroutines()
	return closing
}

// closingGoroutines returns the stacks of the goroutines running pgx's
// closing function, and how many of them have it as their only frame.
func closingGoroutines() (closing []string, undecided int) {
	for _, g := range goroutineStacks() {
		if !strings.Contains(g, "pgconn.(*PgConn).asyncClose.func") {
			continue
		}
		closing = append(closing, g)
		// A header, then a function and a file line per frame.
		frames, _, _ := strings.Cut(g, "\ncreated by ")
		if strings.Count(frames, "\n") == 2 {
			undecided++
		}
	}
	return closing, undecided
}

// TestRelayRunDoesNotWaitForAConnectionAStatsRefreshNeverGot: with
// metrics on and the pool's only connection held by the application, the
// relay has nothing in flight: its claim waits for a connection under
// Run's ctx and ends with it. Its Stats refresh waited for one under the
// shutdown's grace instead, and Run returned ShutdownTimeout (10 s) after
// its ctx ended. Only a statement already sent gets the grace.
func TestRelayRunDoesNotWaitForAConnectionAStatsRefreshNeverGot(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pool := poolWith(t, b, func(pc *pgxpool.Config) { pc.MaxConns = 1 })
	r := b.relay(t, pool, &recorder{}, outbox.RelayConfig{
		PollInterval:  time.Hour,
		DisableNotify: true,
		MeterProvider: metrictest.New(t).Provider,
	})
	held, err := pool.Acquire(context.Background())
	require.NoError(t, err)
	defer held.Release()

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	time.Sleep(300 * time.Millisecond) // the claim and the refresh wait for the held connection
	cancel()
	began := time.Now()
	require.NoError(t, <-done)
	require.Less(t, time.Since(began), 2*time.Second, "nothing was in flight")
}

// TestRelayRunLetsAStatsRefreshFinish stops Run while its metrics' Stats
// refresh waits for a lock: the refresh must finish (within the shutdown
// grace, like a batch in flight) rather than be cut off, which left pgx
// closing its connection after Run returned. Sequential, for the same
// reason as TestRelayRunLeavesNothingClosing.
func TestRelayRunLetsAStatsRefreshFinish(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	const appName = "verity_relay_stats_refresh"
	locker, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = locker.Rollback(context.Background()) })
	_, err = locker.Exec(ctx, `LOCK TABLE `+b.deadTable()+` IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)

	relayPool := newPoolNamed(t, b.pg.ConnString, appName)
	r := b.relay(t, relayPool, &recorder{}, outbox.RelayConfig{
		PollInterval:  time.Hour,
		DisableNotify: true,
		MeterProvider: metrictest.New(t).Provider,
	})
	stop := startRun(t, r)
	require.Eventually(t, func() bool { return b.waitingForLock(appName, "relation") }, 10*time.Second, 5*time.Millisecond,
		"the relay's Stats refresh never waited for the dead-letter table")

	stopped := make(chan error, 1)
	go func() { stopped <- stop() }()
	select {
	case err := <-stopped:
		t.Fatalf("Run returned (%v) while its Stats refresh was still waiting: the refresh was cut off", err)
	case <-time.After(200 * time.Millisecond):
	}
	require.True(t, b.waitingForLock(appName, "relation"), "the Stats refresh stopped waiting while Run shut down")

	require.NoError(t, locker.Rollback(ctx))
	require.NoError(t, <-stopped)
	relayPool.Close()
	require.Empty(t, closingConnections(), "a connection was still being closed after Run returned")
}

// A LISTEN connection frozen (half-open) and replaced: pgx closes it in a
// goroutine of its own (a cancel request on a new connection, which the
// frozen path accepts and never answers, for up to 15 s); listen.go waits
// for it only listenCloseTimeout (2 s), so it was still running, holding the
// frozen socket, when Run returned. Sequential, for the same reason as
// TestRelayRunLeavesNothingClosing.
func TestRelayRunLeavesNoFrozenListenerClosing(t *testing.T) {
	b := setup(t)
	proxy, lpool := holePool(t, b, nil)
	l, err := outbox.NewListener(lpool, &outbox.ListenerConfig{Schema: b.cfg.Schema, Table: b.cfg.Table,
		ListenCheckInterval: 500 * time.Millisecond, ReconnectBackoffMax: 100 * time.Millisecond})
	require.NoError(t, err)
	stop := startRun(t, b.relay(t, nil, &recorder{}, outbox.RelayConfig{PollInterval: time.Hour, Listener: l, ShutdownTimeout: time.Second}))
	waitListening(t, b)
	time.Sleep(200 * time.Millisecond)
	proxy.hole.Store(true)
	require.Positive(t, proxy.freezeAll())
	time.Sleep(3500 * time.Millisecond) // ping fails at ~1 s, close waited 2 s
	began := time.Now()
	require.NoError(t, stop())
	t.Logf("Run returned %s after cancel", time.Since(began))
	closing := closingConnections()
	require.Empty(t, closing, "a LISTEN connection is still being closed after Run returned")
}

// TestRelaySettleLeavesNoTimer cancels RunOnce's ctx (a shutdown) from the
// Handler and closes the pool, so the settle fails at once: the function
// the settle registered to cut its wait short on a shutdown then runs on a
// goroutine of its own, which must not outlive RunOnce and arm a timer
// nobody stops. With both cores that goroutine mostly runs at once; with
// one, it ran after RunOnce returned in the first round on the code before.
// Sequential, for the same reason as TestRelayRunLeavesNothingClosing, and
// because it sets GOMAXPROCS for the whole binary.
func TestRelaySettleLeavesNoTimer(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	for round := range 10 {
		b := setup(t) // a schema each: the last round's batch stays leased
		b.appendCommitted(t, newMessage("s", "k", 1))
		pool := poolWith(t, b, func(pc *pgxpool.Config) { pc.MaxConns = 2 })
		ctx, cancel := context.WithCancel(context.Background())
		r := b.relay(t, pool, outbox.HandlerFunc(func(context.Context, []outbox.Record) ([]outbox.Result, error) {
			cancel()
			pool.Close()
			return []outbox.Result{{}}, nil
		}), outbox.RelayConfig{DisableNotify: true})
		_, err := r.RunOnce(ctx)
		require.ErrorContains(t, err, "settle", "round %d", round)
		require.Empty(t, goroutinesIn("outbox.(*Relay).settleWithin"), "round %d: a goroutine of the settle outlived RunOnce", round)
	}
}

// goroutinesIn returns the stacks of the goroutines with fn in a frame.
func goroutinesIn(fn string) []string {
	var found []string
	for _, g := range goroutineStacks() {
		if strings.Contains(g, fn) {
			found = append(found, g)
		}
	}
	return found
}

// goroutineStacks returns the stack of every goroutine of the binary.
func goroutineStacks() []string {
	buf := make([]byte, 1<<16)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return strings.Split(string(buf[:n]), "\n\n")
		}
		buf = make([]byte, 2*len(buf))
	}
}
