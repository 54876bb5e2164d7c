package outbox_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
)

// notificationPath is a TCP forwarder to PostgreSQL that drops
// notifications on the way to its clients (see startNotificationPath).
type notificationPath struct {
	addr string
	// dropped counts the notifications dropped; passedProbes, the probe
	// channel's notifications passed on.
	dropped, passedProbes atomic.Int64

	mu   sync.Mutex
	pids map[uint32]bool // server processes of the connections through it
}

// ours reports whether server process pid serves a connection through p.
func (p *notificationPath) ours(pid uint32) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.pids[pid]
}

// startNotificationPath forwards TCP to upstream, dropping the server's
// NotificationResponse ('A') messages: every one when dropAll, a path that
// loses notifications and nothing else, as a transaction-pooling proxy
// does (PgBouncer in transaction mode drops those that arrive for a server
// connection while it serves another client, or none); otherwise only
// those sent by a connection through the path itself (its server process
// is read from BackendKeyData), so that a LISTEN connection through it
// never receives what its own pool sends but receives everyone else's.
// The client must not ask for TLS: the server's stream is parsed from its
// first byte.
func startNotificationPath(t *testing.T, upstream string, dropAll bool) *notificationPath {
	t.Helper()
	p := &notificationPath{pids: map[uint32]bool{}}
	forward := func(c, s net.Conn) {
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
			switch header[0] {
			case 'K': // BackendKeyData: the server process's pid, then a secret
				p.mu.Lock()
				p.pids[binary.BigEndian.Uint32(body)] = true
				p.mu.Unlock()
			case 'A': // NotificationResponse: the sender's pid, channel, payload
				if dropAll || p.ours(binary.BigEndian.Uint32(body)) {
					p.dropped.Add(1)
					continue
				}
				if channel, _, _ := bytes.Cut(body[4:], []byte{0}); string(channel) == "verity_listen_probe" {
					p.passedProbes.Add(1)
				}
			}
			_, _ = out.Write(header)
			_, _ = out.Write(body)
			if in.Buffered() == 0 && out.Flush() != nil {
				return
			}
		}
	}
	p.addr = forwardTCP(t, upstream, func(c, s net.Conn) {
		t.Cleanup(func() { _ = c.Close(); _ = s.Close() })
		go func() { _, _ = io.Copy(s, c) }()
		forward(c, s)
	})
	return p
}

// forwardTCP listens on a free local port, which it returns, until t ends;
// it dials upstream for each connection it accepts and hands both to serve,
// in a goroutine of their own.
func forwardTCP(t *testing.T, upstream string, serve func(client, server net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
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
			go serve(c, s)
		}
	}()
	return ln.Addr().String()
}

// poolThrough returns a pool of b's database whose connections go through
// a notification path (see startNotificationPath), without TLS.
func poolThrough(t *testing.T, b *testBundle, dropAll bool) (*pgxpool.Pool, *notificationPath) {
	t.Helper()
	var path *notificationPath
	pool := poolWith(t, b, func(pc *pgxpool.Config) {
		path = startNotificationPath(t, net.JoinHostPort(pc.ConnConfig.Host, strconv.Itoa(int(pc.ConnConfig.Port))), dropAll)
		host, port, _ := net.SplitHostPort(path.addr)
		n, _ := strconv.Atoi(port)
		pc.ConnConfig.Host, pc.ConnConfig.Port, pc.ConnConfig.TLSConfig, pc.ConnConfig.Fallbacks = host, uint16(n), nil, nil
	})
	return pool, path
}

// TestListenerFindsNotificationsLost: a Listener whose notifications never
// arrive (behind a transaction-pooling proxy, where the README says to set
// DisableNotify) used to listen on, deaf and silent, its relays falling
// back to PollInterval. Its probe does not come back, and the log says
// what to do.
func TestListenerFindsNotificationsLost(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pool, path := poolThrough(t, b, true)
	var logs testenv.LogSink
	// ListenCheckInterval also bounds opening the connection and LISTEN:
	// one second, so that a busy machine does not fail them first (the
	// probe is waited for 5 s whatever the interval).
	l, err := outbox.NewListener(pool, &outbox.ListenerConfig{Schema: b.cfg.Schema, Table: b.cfg.Table,
		ListenCheckInterval: time.Second, ReconnectBackoffMax: time.Second, Logger: logs.Logger()})
	require.NoError(t, err)
	startRun(t, b.relay(t, nil, &recorder{}, outbox.RelayConfig{PollInterval: time.Hour, Listener: l}))
	require.Eventually(t, func() bool {
		return len(logs.Lines(t, "outbox LISTEN connection failed; reconnecting")) > 0
	}, 15*time.Second, 10*time.Millisecond, "a LISTEN connection that receives no notification at all goes unnoticed")
	line := logs.Lines(t, "outbox LISTEN connection failed; reconnecting")[0]
	require.Contains(t, line["error"], "DisableNotify")
	require.Positive(t, path.dropped.Load(), "the probe was sent, and lost on the way")

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
		// A probe has ListenCheckInterval to be sent: one second, so that
		// a busy machine sends it (one not sent proves nothing, and is
		// asserted against below).
		l, err := outbox.NewListener(b.pool, &outbox.ListenerConfig{Schema: b.cfg.Schema, Table: b.cfg.Table,
			ListenCheckInterval: time.Second, Logger: logs.Logger()})
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

// TestListenerPauseResetsOnceItsProbeComesBack: the pause before a
// reconnection grows while connections fail, and starts again from 100 ms
// once a connection proved itself (its probe came back): failures far apart
// must not each wait longer than the one before, up to ReconnectBackoffMax.
func TestListenerPauseResetsOnceItsProbeComesBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var logs testenv.LogSink
	// A probe has ListenCheckInterval (10 s) to be sent; one that could
	// not be sent proves nothing either way, and resets the pause too.
	l, err := outbox.NewListener(b.pool, &outbox.ListenerConfig{Schema: b.cfg.Schema, Table: b.cfg.Table,
		ReconnectBackoffMax: time.Minute, Logger: logs.Logger()})
	require.NoError(t, err)
	startRun(t, b.relay(t, nil, &recorder{}, outbox.RelayConfig{PollInterval: time.Hour, Listener: l}))
	killListenerConnections(t, b, &logs, 3, func(i int) {
		require.Eventually(t, func() bool {
			return len(logs.Lines(t, "outbox LISTEN probe came back"))+len(logs.Lines(t, "outbox LISTEN probe not sent")) == i
		}, 15*time.Second, 10*time.Millisecond, "connection %d: its probe came back", i)
	})
	requireReconnectPausesReset(t, &logs, "whose probe came back")
}

// killListenerConnections kills the Listener's LISTEN connection n times,
// each new one once ready(i) returns for it (i from 1), and waits for the
// Listener to log each failure.
func killListenerConnections(t *testing.T, b *testBundle, logs *testenv.LogSink, n int, ready func(i int)) {
	t.Helper()
	pid := 0
	for i := 1; i <= n; i++ {
		require.Eventually(t, func() bool {
			next := listenerPid(b)
			if next == 0 || next == pid {
				return false
			}
			pid = next
			return true
		}, 10*time.Second, 10*time.Millisecond, "connection %d listens", i)
		ready(i)
		_, err := b.pool.Exec(context.Background(), `SELECT pg_terminate_backend($1)`, pid)
		require.NoError(t, err)
		require.Eventually(t, func() bool {
			return len(logs.Lines(t, "outbox LISTEN connection failed; reconnecting")) == i
		}, 10*time.Second, 10*time.Millisecond, "connection %d failed", i)
	}
}

// requireReconnectPausesReset requires every logged reconnection to have
// waited the first pause, 100 ms.
func requireReconnectPausesReset(t *testing.T, logs *testenv.LogSink, connections string) {
	t.Helper()
	for i, line := range logs.Lines(t, "outbox LISTEN connection failed; reconnecting") {
		require.EqualValues(t, 100*time.Millisecond, line["pause"], "failure %d: the pause grew across connections %s", i+1, connections)
	}
}

// TestListenerProbeOfAnotherConnectionProvesNothing: a LISTEN connection
// receives every other connection's probes (one channel for all), so only
// its own token may prove its path. Here its own probe is lost (its pool
// and it share a path that drops what they send) while another Listener's
// probe reaches it: it must still find its notifications lost.
func TestListenerProbeOfAnotherConnectionProvesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pool, path := poolThrough(t, b, false)
	// The probe is sent within ListenCheckInterval or not at all (which
	// proves nothing either way): one second, and a connection already in
	// the pool, so that a busy machine (TLS through the path) sends it.
	require.NoError(t, pool.Ping(context.Background()))
	var logs, otherLogs testenv.LogSink
	l, err := outbox.NewListener(pool, &outbox.ListenerConfig{Schema: b.cfg.Schema, Table: b.cfg.Table,
		ListenCheckInterval: time.Second, Logger: logs.Logger()})
	require.NoError(t, err)
	startRun(t, b.relay(t, nil, &recorder{}, outbox.RelayConfig{PollInterval: time.Hour, Listener: l}))
	waitListening(t, b)

	other, err := outbox.NewListener(b.pool, &outbox.ListenerConfig{Schema: b.cfg.Schema, Table: b.cfg.Table,
		ListenCheckInterval: time.Second, Logger: otherLogs.Logger()})
	require.NoError(t, err)
	startRun(t, b.relay(t, nil, &recorder{}, outbox.RelayConfig{PollInterval: time.Hour, Listener: other}))
	require.Eventually(t, func() bool {
		return len(otherLogs.Lines(t, "outbox LISTEN probe came back")) > 0
	}, 15*time.Second, 10*time.Millisecond, "the other Listener's probe")
	// The other Listener's probe reaches the connection under test at
	// about the same time, through the path: not necessarily first.
	require.Eventually(t, func() bool { return path.passedProbes.Load() > 0 }, 5*time.Second, time.Millisecond,
		"another connection's probe reached the connection under test")
	require.Empty(t, logs.Lines(t, "outbox LISTEN probe not sent"), "the probe under test was not sent: the test proves nothing")
	require.Empty(t, logs.Lines(t, "outbox LISTEN connection failed; reconnecting"),
		"failed before the other probe arrived: the test proves nothing (the wait is at least 5 s)")

	require.Eventually(t, func() bool {
		return len(logs.Lines(t, "outbox LISTEN connection failed; reconnecting")) > 0
	}, 15*time.Second, 10*time.Millisecond, "another connection's probe was taken for this one's")
	require.Empty(t, logs.Lines(t, "outbox LISTEN probe came back"))
	require.Positive(t, path.dropped.Load(), "its own probe was sent, and lost on the way")
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

// TestListenerPauseResetsWhenItsProbeCannotBeSent: the Listener's pool
// has no connection free (its only one held), so no probe can be sent; a
// probe that could not be sent proves nothing either way and, the
// connection having lived ListenCheckInterval by then, resets the
// reconnect pause (listen.go, run and listenProbe.poll): connections killed
// one after another, each after its probe failed to go, are each
// reconnected after the first pause, 100 ms.
func TestListenerPauseResetsWhenItsProbeCannotBeSent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	logs := b.runOnListenerWithNoFreeConn(t, &outbox.ListenerConfig{ListenCheckInterval: time.Second, ReconnectBackoffMax: time.Minute})
	// Each connection sends one probe, which gives up on the pool after
	// ListenCheckInterval: one "not sent" line per connection. The
	// connection's loop takes that answer, and resets the pause, when its
	// wait for notifications next ends, at most ListenCheckInterval and a
	// ping later: only then is it killed. (Killed as soon as the line was
	// logged, a connection could fail first, and its pause rightly grow.)
	killListenerConnections(t, b, logs, 3, func(i int) {
		require.Eventually(t, func() bool { return len(logs.Lines(t, "outbox LISTEN probe not sent")) == i },
			15*time.Second, 10*time.Millisecond, "connection %d: its probe could not be sent", i)
		time.Sleep(1500 * time.Millisecond)
	})
	requireReconnectPausesReset(t, logs, "whose probe could not be sent")
}

// TestListenerFailureDoesNotWaitForAProbeStuckInThePool: the probe's
// send waits for a pool connection (up to ListenCheckInterval, 5 s here)
// when the pool has none free; a LISTEN connection that fails meanwhile is
// replaced after the reconnect pause (100 ms), not once that wait is over
// (listenProbe.stop cancels the send of a connection that failed).
func TestListenerFailureDoesNotWaitForAProbeStuckInThePool(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	logs := b.runOnListenerWithNoFreeConn(t, &outbox.ListenerConfig{ListenCheckInterval: 5 * time.Second})
	pid := waitListening(t, b)
	killed := time.Now()
	_, err := b.pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid)
	require.NoError(t, err)
	require.Eventually(t, func() bool { next := listenerPid(b); return next != 0 && next != pid }, 10*time.Second, 5*time.Millisecond)
	took := time.Since(killed)
	require.Less(t, took, 3500*time.Millisecond, "the failed connection waited for its probe's pool connection before reconnecting")
	for _, line := range logs.Lines(t, "outbox LISTEN probe not sent") {
		require.Equal(t, "context canceled", line["error"], "the probe gave up before the connection was killed: the test proves nothing")
	}
}

// TestListenerSlowProbeKeepsAHealthyConnection: "a busy server must
// not make a short ListenCheckInterval replace healthy connections"
// (probeWaitMin): the probe, delayed 1.5 s on its way to the LISTEN
// connection (other notifications and replies pass at once), still comes
// back within the 5 s it is given although ListenCheckInterval is 500 ms:
// the connection is kept, nothing is logged.
func TestListenerSlowProbeKeepsAHealthyConnection(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const delay = 1500 * time.Millisecond
	pool := poolWith(t, b, func(pc *pgxpool.Config) {
		upstream := net.JoinHostPort(pc.ConnConfig.Host, strconv.Itoa(int(pc.ConnConfig.Port)))
		addr := forwardTCP(t, upstream, func(c, s net.Conn) {
			t.Cleanup(func() { _ = c.Close(); _ = s.Close() })
			go func() { _, _ = io.Copy(s, c) }()
			var mu sync.Mutex
			write := func(msg []byte) error {
				mu.Lock()
				defer mu.Unlock()
				_, err := c.Write(msg)
				return err
			}
			in := bufio.NewReader(s)
			for {
				header := make([]byte, 5)
				if _, err := io.ReadFull(in, header); err != nil {
					return
				}
				msg := make([]byte, 5+int(binary.BigEndian.Uint32(header[1:]))-4)
				copy(msg, header)
				if _, err := io.ReadFull(in, msg[5:]); err != nil {
					return
				}
				if header[0] == 'A' && bytes.Contains(msg, []byte("verity_listen_probe\x00")) {
					time.AfterFunc(delay, func() { _ = write(msg) })
					continue
				}
				if write(msg) != nil {
					return
				}
			}
		})
		host, port, _ := net.SplitHostPort(addr)
		n, _ := strconv.Atoi(port)
		pc.ConnConfig.Host, pc.ConnConfig.Port, pc.ConnConfig.TLSConfig, pc.ConnConfig.Fallbacks = host, uint16(n), nil, nil
	})
	var logs testenv.LogSink
	l, err := outbox.NewListener(pool, &outbox.ListenerConfig{Schema: b.cfg.Schema, Table: b.cfg.Table,
		ListenCheckInterval: 500 * time.Millisecond, Logger: logs.Logger()})
	require.NoError(t, err)
	startRun(t, b.relay(t, nil, &recorder{}, outbox.RelayConfig{PollInterval: time.Hour, Listener: l}))
	require.Eventually(t, func() bool { return len(logs.Lines(t, "outbox LISTEN probe came back")) > 0 }, 10*time.Second, 10*time.Millisecond)
	require.Empty(t, logs.Lines(t, "outbox LISTEN connection failed; reconnecting"), "a probe 1.5 s late replaced a healthy connection")
}

// TestListenerFindsALostProbeWithinItsWait: DisableNotify's doc: "when
// that has not come back within ListenCheckInterval (5 s at least) of being
// sent, it logs a warning". With ListenCheckInterval 6 s and a path that
// drops every notification, the warning comes about 6 s after LISTEN, not
// at the idle check after that (about 12 s).
func TestListenerFindsALostProbeWithinItsWait(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pool, _ := poolThrough(t, b, true)
	var logs testenv.LogSink
	l, err := outbox.NewListener(pool, &outbox.ListenerConfig{Schema: b.cfg.Schema, Table: b.cfg.Table,
		ListenCheckInterval: 6 * time.Second, Logger: logs.Logger()})
	require.NoError(t, err)
	start := time.Now()
	startRun(t, b.relay(t, nil, &recorder{}, outbox.RelayConfig{PollInterval: time.Hour, Listener: l}))
	require.Eventually(t, func() bool { return len(logs.Lines(t, "outbox LISTEN connection failed; reconnecting")) > 0 },
		20*time.Second, 10*time.Millisecond)
	took := time.Since(start)
	require.Less(t, took, 10*time.Second, "the lost probe was found at the idle check after its deadline")
}

// runOnListenerWithNoFreeConn runs a relay, polling once an hour, on a
// Listener configured by cfg (its schema, table and logger set here) whose
// pool's only connection is held until the test ends, so that no probe can
// be sent; it returns the Listener's log.
func (b *testBundle) runOnListenerWithNoFreeConn(t *testing.T, cfg *outbox.ListenerConfig) *testenv.LogSink {
	t.Helper()
	pool := poolWith(t, b, func(pc *pgxpool.Config) { pc.MaxConns = 1 })
	held, err := pool.Acquire(context.Background())
	require.NoError(t, err)
	t.Cleanup(held.Release)
	logs := &testenv.LogSink{}
	cfg.Schema, cfg.Table, cfg.Logger = b.cfg.Schema, b.cfg.Table, logs.Logger()
	l, err := outbox.NewListener(pool, cfg)
	require.NoError(t, err)
	startRun(t, b.relay(t, nil, &recorder{}, outbox.RelayConfig{PollInterval: time.Hour, Listener: l}))
	return logs
}

// TestListenerPauseGrowsWhenItsProbeIsRefusedAtOnce: the Listener's pool
// is closed, so its probe is refused at once; other connections' probes,
// which every LISTEN connection receives, keep arriving; each connection is
// killed 50 ms after its LISTEN. None proved anything, so the pauses double
// as documented. A refused send counted as proof as soon as the loop read
// it, which any notification made it do: the Listener reconnected every
// 100 ms for ever.
func TestListenerPauseGrowsWhenItsProbeIsRefusedAtOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pool := poolWith(t, b, func(*pgxpool.Config) {})
	pool.Close()
	var logs testenv.LogSink
	l, err := outbox.NewListener(pool, &outbox.ListenerConfig{Schema: b.cfg.Schema, Table: b.cfg.Table,
		ListenCheckInterval: time.Second, ReconnectBackoffMax: time.Minute, Logger: logs.Logger()})
	require.NoError(t, err)
	startRun(t, b.relay(t, nil, &recorder{}, outbox.RelayConfig{PollInterval: time.Hour, Listener: l}))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { // other connections' probes
		defer close(done)
		for ctx.Err() == nil {
			_, _ = b.pool.Exec(ctx, `SELECT pg_notify('verity_listen_probe', 'another connection')`)
			time.Sleep(2 * time.Millisecond)
		}
	}()
	defer func() { cancel(); <-done }()
	killListenerConnections(t, b, &logs, 4, func(int) { time.Sleep(50 * time.Millisecond) })
	var pauses []time.Duration
	for _, line := range logs.Lines(t, "outbox LISTEN connection failed; reconnecting") {
		pauses = append(pauses, time.Duration(line["pause"].(float64)))
	}
	require.Equal(t, []time.Duration{100 * time.Millisecond, 200 * time.Millisecond, 400 * time.Millisecond, 800 * time.Millisecond}, pauses,
		"connections that proved nothing reset the reconnect pause")
}

// TestListenerIdleCheckAfterARefusedProbe: a connection that has received
// nothing for ListenCheckInterval is pinged, also when its probe was
// refused at once and a notification then woke the loop before the
// connection had lived that long. The wait cut short for the probe's sake
// used to skip the ping, which came a whole interval late (1.9 s after the
// notification with an interval of 1 s). A private server: every test's
// probes on the shared one reach every LISTEN connection.
func TestListenerIdleCheckAfterARefusedProbe(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.StartPostgres(t)
	pool := srv.Pool(t)
	cfg := &outbox.Config{Schema: "idle_check"}
	require.NoError(t, outbox.Migrate(ctx, pool, cfg))
	w, err := outbox.NewWriter(cfg)
	require.NoError(t, err)
	refusing, err := pgxpool.New(ctx, srv.ConnString())
	require.NoError(t, err)
	refusing.Close() // the probe is refused at once
	const check = time.Second
	l, err := outbox.NewListener(refusing, &outbox.ListenerConfig{Schema: cfg.Schema,
		ListenCheckInterval: check, ReconnectBackoffMax: time.Minute})
	require.NoError(t, err)
	r, err := outbox.NewRelay(pool, &recorder{}, &outbox.RelayConfig{Schema: cfg.Schema, PollInterval: time.Hour, Listener: l})
	require.NoError(t, err)
	startRun(t, r)
	var pid int
	var listened time.Time
	require.Eventually(t, func() bool {
		return pool.QueryRow(ctx, `SELECT pid, query_start FROM pg_stat_activity WHERE query = $1`,
			`LISTEN "`+w.Channel()+`"`).Scan(&pid, &listened) == nil
	}, 10*time.Second, 10*time.Millisecond)
	time.Sleep(100 * time.Millisecond) // the refusal has come back
	var notified time.Time
	require.NoError(t, pool.QueryRow(ctx, `SELECT clock_timestamp() FROM pg_notify('verity_listen_probe', 'another connection')`).Scan(&notified))
	var pinged time.Time
	require.Eventually(t, func() bool {
		err := pool.QueryRow(ctx, `SELECT query_start FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&pinged)
		return err == nil && pinged.After(listened)
	}, 10*time.Second, 10*time.Millisecond)
	quiet := pinged.Sub(notified)
	require.GreaterOrEqual(t, quiet, check-50*time.Millisecond, "pinged before the interval")
	require.Less(t, quiet, check+500*time.Millisecond, "the idle check skipped a ping: nothing received for %s", quiet)
}
