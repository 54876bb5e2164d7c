package outbox_test

import (
	"context"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/outbox"
)

// TestRelayRunClosesListener checks that once Run returns, nothing of its
// LISTEN connection is still running. pgx closes a connection cut off
// mid-statement in a goroutine of its own (a cancel request, then reading
// until the server hangs up); a Run that returned before it ended would fail
// a caller's goroutine leak check. Run is stopped at varying moments, some
// while its LISTEN statement is in flight.
//
// It does not call t.Parallel: it looks at every goroutine of the binary,
// and parallel tests only start once the sequential ones are done. The relay
// has a pool of its own, closed before the check: a claim cut off by the
// cancellation leaves a pooled connection closing too, which the pool's
// Close waits for. That pool does without TLS, as pgx can take its full
// 15 s to close a TLS connection cut off mid-statement, and the pool's
// Close gives up waiting after as long.
func TestRelayRunClosesListener(t *testing.T) {
	b := setup(t)
	for round := range 200 {
		relayPool := plainPool(t, b.pg.ConnString)
		r := b.relay(t, relayPool, &recorder{}, outbox.RelayConfig{PollInterval: time.Hour})
		stop := startRun(t, r)
		time.Sleep(time.Duration(round%10) * time.Millisecond)
		require.NoError(t, stop())
		relayPool.Close()
		closing := closingConnections()
		require.Empty(t, closing, "round %d: Run returned while its LISTEN connection was still being closed", round)
	}
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
	buf := make([]byte, 1<<16)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	for _, g := range strings.Split(string(buf), "\n\n") {
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

// plainPool is a pool on connString that does without TLS.
func plainPool(t *testing.T, connString string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(connString)
	require.NoError(t, err)
	cfg.ConnConfig.TLSConfig, cfg.ConnConfig.Fallbacks = nil, nil
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}
