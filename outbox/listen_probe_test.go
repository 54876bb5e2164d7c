package outbox_test

import (
	"bufio"
	"context"
	"encoding/binary"
	"io"
	"net"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
)

// startNotificationDropper forwards TCP to upstream, dropping every
// NotificationResponse ('A') message from the server: a path that loses
// notifications and nothing else, as a transaction-pooling proxy does
// (PgBouncer in transaction mode drops those that arrive for a server
// connection while it serves another client, or none). It returns its
// address and the count of notifications dropped. The client must not
// ask for TLS: the server's stream is parsed from its first byte.
func startNotificationDropper(t *testing.T, upstream string) (addr string, dropped *atomic.Int64) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	dropped = &atomic.Int64{}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", upstream)
			if err != nil {
				_ = c.Close()
				continue
			}
			t.Cleanup(func() { _ = c.Close(); _ = s.Close() })
			go func() { _, _ = io.Copy(s, c) }()
			go func() {
				in, out := bufio.NewReader(s), bufio.NewWriter(c)
				header := make([]byte, 5)
				for {
					if _, err := io.ReadFull(in, header); err != nil {
						return
					}
					body := make([]byte, int(binary.BigEndian.Uint32(header[1:]))-4)
					if _, err := io.ReadFull(in, body); err != nil {
						return
					}
					if header[0] == 'A' {
						dropped.Add(1)
						continue
					}
					_, _ = out.Write(header)
					_, _ = out.Write(body)
					if in.Buffered() == 0 && out.Flush() != nil {
						return
					}
				}
			}()
		}
	}()
	t.Cleanup(func() { _ = ln.Close() })
	return ln.Addr().String(), dropped
}

// TestListenerFindsNotificationsLost: a Listener whose notifications never
// arrive (behind a transaction-pooling proxy, where the README says to set
// DisableNotify) used to listen on, deaf and silent, its relays falling
// back to PollInterval. Its probe does not come back, and the log says
// what to do.
func TestListenerFindsNotificationsLost(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var dropped *atomic.Int64
	pool := poolWith(t, b, func(pc *pgxpool.Config) {
		var addr string
		addr, dropped = startNotificationDropper(t, net.JoinHostPort(pc.ConnConfig.Host, strconv.Itoa(int(pc.ConnConfig.Port))))
		host, port, _ := net.SplitHostPort(addr)
		n, _ := strconv.Atoi(port)
		pc.ConnConfig.Host, pc.ConnConfig.Port, pc.ConnConfig.TLSConfig, pc.ConnConfig.Fallbacks = host, uint16(n), nil, nil
	})
	var logs testenv.LogSink
	l, err := outbox.NewListener(pool, &outbox.ListenerConfig{Schema: b.cfg.Schema, Table: b.cfg.Table,
		ListenCheckInterval: 100 * time.Millisecond, ReconnectBackoffMax: time.Second, Logger: logs.Logger()})
	require.NoError(t, err)
	startRun(t, b.relay(t, nil, &recorder{}, outbox.RelayConfig{PollInterval: time.Hour, Listener: l}))
	require.Eventually(t, func() bool {
		return len(logs.Lines(t, "outbox LISTEN connection failed; reconnecting")) > 0
	}, 15*time.Second, 10*time.Millisecond, "a LISTEN connection that receives no notification at all goes unnoticed")
	line := logs.Lines(t, "outbox LISTEN connection failed; reconnecting")[0]
	require.Contains(t, line["error"], "DisableNotify")
	require.Positive(t, dropped.Load(), "the probe was sent, and lost on the way")

	// Every LISTEN succeeds on such a path: the pause grows all the same,
	// so the warnings (and the LISTENs left on a proxy's connections) slow
	// down.
	require.Eventually(t, func() bool {
		return len(logs.Lines(t, "outbox LISTEN connection failed; reconnecting")) >= 2
	}, 15*time.Second, 10*time.Millisecond)
	lines := logs.Lines(t, "outbox LISTEN connection failed; reconnecting")
	first, second := lines[0]["pause"].(float64), lines[1]["pause"].(float64) // nanoseconds
	require.Greater(t, second, first, "the pause was reset by a LISTEN whose probe never came back")
}

// TestListenerProbeComesBack: on a direct connection the probe arrives, so
// the connection is kept; the probes of other connections are ignored.
func TestListenerProbeComesBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var logs testenv.LogSink
	newListener := func() *outbox.Listener {
		l, err := outbox.NewListener(b.pool, &outbox.ListenerConfig{Schema: b.cfg.Schema, Table: b.cfg.Table,
			ListenCheckInterval: 100 * time.Millisecond, Logger: logs.Logger()})
		require.NoError(t, err)
		return l
	}
	startRun(t, b.relay(t, nil, &recorder{}, outbox.RelayConfig{PollInterval: time.Hour, Listener: newListener()}))
	waitListening(t, b)
	pid := listenerPid(b)
	startRun(t, b.relay(t, nil, &recorder{}, outbox.RelayConfig{PollInterval: time.Hour, Listener: newListener()}))
	// Each connection's own probe came back (the other's, which it also
	// receives, does not count): it will not be replaced for it.
	require.Eventually(t, func() bool {
		return len(logs.Lines(t, "outbox LISTEN probe came back")) == 2
	}, 15*time.Second, 10*time.Millisecond)
	require.Empty(t, logs.Lines(t, "outbox LISTEN probe not sent"))
	require.Empty(t, logs.Lines(t, "outbox LISTEN connection failed; reconnecting"))
	var still bool
	require.NoError(t, b.pool.QueryRow(context.Background(),
		`SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)`, pid).Scan(&still))
	require.True(t, still, "the first connection was replaced")
}

// TestListenerPassesNotificationsWhileItsProbeWaits: a Listener whose pool
// has no connection free cannot send its probe until ListenCheckInterval
// (a minute here) ends; the notifications that arrive meanwhile are passed
// on at once, not held back behind the send.
func TestListenerPassesNotificationsWhileItsProbeWaits(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	pool := poolWith(t, b, func(pc *pgxpool.Config) { pc.MaxConns = 1 })
	held, err := pool.Acquire(ctx)
	require.NoError(t, err)
	t.Cleanup(held.Release)
	var logs testenv.LogSink
	l, err := outbox.NewListener(pool, &outbox.ListenerConfig{Schema: b.cfg.Schema, Table: b.cfg.Table,
		ListenCheckInterval: time.Minute, Logger: logs.Logger()})
	require.NoError(t, err)
	h := &recorder{}
	startRun(t, b.relay(t, nil, h, outbox.RelayConfig{PollInterval: time.Hour, Listener: l}))
	waitListening(t, b)
	time.Sleep(200 * time.Millisecond) // the relay's first claim is over
	b.appendNow(t, newMessage("s", "k", 1))
	require.Eventually(t, func() bool { return len(h.seen()) == 1 }, 30*time.Second, 10*time.Millisecond,
		"the notification waited for the probe's send (a minute)")
	require.Empty(t, logs.Lines(t, "outbox LISTEN probe came back"), "the probe went through the held connection")
}
