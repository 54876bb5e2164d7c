package outbox_test

import (
	"context"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/outbox"
)

// holeProxy forwards TCP to upstream until freezeAll: then every open pair
// stops passing bytes (nothing is closed: half-open), and while hole is
// set, new connections are accepted and black-holed the same way (a
// frozen middlebox or proxy). Clearing hole heals new connections only;
// frozen ones stay dead, as they would behind a proxy whose upstream
// connections died.
type holeProxy struct {
	ln       net.Listener
	upstream string
	hole     atomic.Bool
	mu       sync.Mutex
	frozen   []chan struct{}
	conns    []net.Conn
}

func startHoleProxy(t *testing.T, upstream string) *holeProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &holeProxy{ln: ln, upstream: upstream}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.mu.Lock()
			p.conns = append(p.conns, c)
			p.mu.Unlock()
			if p.hole.Load() {
				go func() { _, _ = c.Read(make([]byte, 1<<16)) }() // read, answer nothing
				continue
			}
			s, err := net.Dial("tcp", upstream)
			if err != nil {
				_ = c.Close()
				continue
			}
			fr := make(chan struct{})
			p.mu.Lock()
			p.frozen = append(p.frozen, fr)
			p.conns = append(p.conns, s)
			p.mu.Unlock()
			pipe := func(dst, src net.Conn) {
				buf := make([]byte, 32<<10)
				for {
					n, err := src.Read(buf)
					select {
					case <-fr:
						n = 0
					default:
					}
					if n > 0 {
						if _, err := dst.Write(buf[:n]); err != nil {
							return
						}
					}
					if err != nil {
						return
					}
				}
			}
			go pipe(c, s)
			go pipe(s, c)
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		p.mu.Lock()
		defer p.mu.Unlock()
		for _, c := range p.conns {
			_ = c.Close()
		}
	})
	return p
}

// freezeAll freezes every pair open now and returns how many.
func (p *holeProxy) freezeAll() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, fr := range p.frozen {
		close(fr)
	}
	n := len(p.frozen)
	p.frozen = nil
	return n
}

// holePool returns a holeProxy in front of the bundle's database and a pool
// of connections through it running afterConnect.
func holePool(t *testing.T, b *testBundle, afterConnect func(context.Context, *pgx.Conn) error) (*holeProxy, *pgxpool.Pool) {
	t.Helper()
	var p *holeProxy
	pool := poolWith(t, b, func(pc *pgxpool.Config) {
		p = startHoleProxy(t, net.JoinHostPort(pc.ConnConfig.Host, strconv.Itoa(int(pc.ConnConfig.Port))))
		host, port, _ := net.SplitHostPort(p.ln.Addr().String())
		n, _ := strconv.Atoi(port)
		pc.ConnConfig.Host, pc.ConnConfig.Port = host, uint16(n)
		pc.AfterConnect = afterConnect
	})
	return p, pool
}

// poolWith returns a pool of the bundle's database whose configuration
// mutate has changed, closed when the test ends.
func poolWith(t *testing.T, b *testBundle, mutate func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	pc, err := pgxpool.ParseConfig(b.pg.ConnString)
	require.NoError(t, err)
	mutate(pc)
	pool, err := pgxpool.NewWithConfig(context.Background(), pc)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// TestListenerReconnectsThroughAFrozenPath: the idle check finds the
// connection frozen while the path is still a black hole (a frozen
// middlebox that accepts connections and passes nothing): the replacement
// it opens meets the hole. Opening it and LISTEN are bounded like the check,
// so the Listener keeps trying and listens again once the path heals;
// unbounded, it hung on that connection for as long as the relays ran.
func TestListenerReconnectsThroughAFrozenPath(t *testing.T) {
	t.Parallel()
	b := setup(t)
	proxy, lpool := holePool(t, b, nil)
	l, err := outbox.NewListener(lpool, &outbox.ListenerConfig{Schema: b.cfg.Schema, Table: b.cfg.Table,
		ListenCheckInterval: 500 * time.Millisecond, ReconnectBackoffMax: 100 * time.Millisecond})
	require.NoError(t, err)
	h := &recorder{}
	startRun(t, b.relay(t, nil, h, outbox.RelayConfig{PollInterval: time.Hour, Listener: l}))
	waitListening(t, b)
	time.Sleep(200 * time.Millisecond)

	proxy.hole.Store(true)
	require.Positive(t, proxy.freezeAll())
	time.Sleep(3 * time.Second) // check fails after ~1 s; the reconnection meets the hole
	proxy.hole.Store(false)     // the path heals for new connections
	healed := time.Now()
	time.Sleep(200 * time.Millisecond)
	b.appendNow(t, newMessage("s", "k", 1))
	require.Eventually(t, func() bool { return len(h.seen()) == 1 }, 10*time.Second, 10*time.Millisecond,
		"10 s after the path healed (ListenCheckInterval 500 ms) the row still waits for the PollInterval: "+
			"the Listener's reconnection hangs on the connection it opened while the path was frozen")
	t.Logf("delivered %s after the path healed", time.Since(healed).Round(time.Millisecond))
}

// TestListenerReplacesAConnectionFrozenBeforeListen: a connection that
// freezes after it is opened but before LISTEN answers (AfterConnect
// freezes it here) is not yet under the idle check; AfterConnect and
// LISTEN are bounded by ListenCheckInterval, so it is replaced too.
func TestListenerReplacesAConnectionFrozenBeforeListen(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var proxy *holeProxy
	var calls atomic.Int32
	proxy, lpool := holePool(t, b, func(context.Context, *pgx.Conn) error {
		if calls.Add(1) == 1 {
			proxy.freezeAll() // the path freezes as the connection is set up; later ones pass
		}
		return nil
	})
	l, err := outbox.NewListener(lpool, &outbox.ListenerConfig{Schema: b.cfg.Schema, Table: b.cfg.Table,
		ListenCheckInterval: 500 * time.Millisecond, ReconnectBackoffMax: 100 * time.Millisecond})
	require.NoError(t, err)
	h := &recorder{}
	startRun(t, b.relay(t, nil, h, outbox.RelayConfig{PollInterval: time.Hour, Listener: l, ShutdownTimeout: time.Second}))
	time.Sleep(3 * time.Second)
	b.appendNow(t, newMessage("s", "k", 1))
	require.Eventually(t, func() bool { return len(h.seen()) == 1 }, 10*time.Second, 10*time.Millisecond,
		"with a 500 ms ListenCheckInterval, a LISTEN connection that froze before LISTEN answered is never replaced: the row waits for the PollInterval")
	require.GreaterOrEqual(t, calls.Load(), int32(2), "the frozen connection was replaced")
}

// TestRelayListensWhenThePoolSetsOnNotification: the LISTEN connection is
// opened from the pool's ConnConfig; an OnNotification callback set there
// (an application handling its own channels on pooled connections) would
// take every notification, which pgx then no longer queues for
// WaitForNotification: the relay was deaf (before that, it crashed on a
// nil notification).
func TestRelayListensWhenThePoolSetsOnNotification(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var appGot atomic.Int32
	pool := poolWith(t, b, func(pc *pgxpool.Config) {
		pc.ConnConfig.OnNotification = func(*pgconn.PgConn, *pgconn.Notification) { appGot.Add(1) }
	})
	h := &recorder{}
	startRun(t, b.relay(t, pool, h, outbox.RelayConfig{PollInterval: time.Hour}))
	waitListening(t, b)
	time.Sleep(300 * time.Millisecond)
	b.appendNow(t, newMessage("s", "k", 1))
	require.Eventually(t, func() bool { return len(h.seen()) == 1 }, 5*time.Second, 10*time.Millisecond,
		"a pool whose ConnConfig sets OnNotification makes the relay deaf: the row waits for PollInterval (an hour)")
	require.Zero(t, appGot.Load(), "the pool's callback is for its own connections")
}

// TestRelayIgnoresOtherChannels: the LISTEN connection runs the pool's
// AfterConnect, which may LISTEN on a channel of the application's own;
// its notifications arrive on the relay's connection too, and must not
// wake the relay into a claim.
func TestRelayIgnoresOtherChannels(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var acquired atomic.Int64
	pool := poolWith(t, b, func(pc *pgxpool.Config) {
		pc.PrepareConn = func(context.Context, *pgx.Conn) (bool, error) { acquired.Add(1); return true, nil }
		pc.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
			_, err := c.Exec(ctx, `LISTEN app_events`)
			return err
		}
	})
	h := &recorder{}
	startRun(t, b.relay(t, pool, h, outbox.RelayConfig{Streams: []string{"a"}, PollInterval: time.Hour}))
	waitListening(t, b)
	time.Sleep(500 * time.Millisecond) // the first claims are over
	before := acquired.Load()
	for _, payload := range []string{"a", ""} {
		for range 10 {
			_, err := b.pool.Exec(context.Background(), `SELECT pg_notify('app_events', $1)`, payload)
			require.NoError(t, err)
			time.Sleep(10 * time.Millisecond)
		}
	}
	time.Sleep(300 * time.Millisecond)
	require.Zero(t, acquired.Load()-before, "notifications on the application's channel made the relay claim")
	b.appendNow(t, newMessage("a", "k", 1))
	require.Eventually(t, func() bool { return len(h.seen()) == 1 }, 5*time.Second, 10*time.Millisecond, "the outbox's own notification wakes it")
}

// TestListenerLogsAnIntervalTooShortToConnect: ListenCheckInterval bounds
// opening the connection too, so one shorter than a slow BeforeConnect (a
// credentials fetch) fails every attempt; the log must name the setting,
// not only a deadline.
func TestListenerLogsAnIntervalTooShortToConnect(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pool := poolWith(t, b, func(pc *pgxpool.Config) {
		pc.BeforeConnect = func(ctx context.Context, _ *pgx.ConnConfig) error {
			select {
			case <-time.After(300 * time.Millisecond):
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}
	})
	logs := &syncBuffer{}
	l, err := outbox.NewListener(pool, &outbox.ListenerConfig{Schema: b.cfg.Schema, Table: b.cfg.Table,
		ListenCheckInterval: 100 * time.Millisecond, ReconnectBackoffMax: 100 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(logs, nil))})
	require.NoError(t, err)
	startRun(t, b.relay(t, nil, &recorder{}, outbox.RelayConfig{PollInterval: time.Hour, Listener: l}))
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), "within ListenCheckInterval (100ms)") }, 5*time.Second, 10*time.Millisecond,
		"the Listener's log does not say the connection failed its ListenCheckInterval: %s", logs.String())
}
