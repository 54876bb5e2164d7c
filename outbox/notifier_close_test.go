package outbox_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
)

// TestNotifierTimeoutBoundsWaitingForAPoolConnection: Timeout bounds
// one NOTIFY "including waiting for a pool connection": with the pool's
// only connection held, Close (which sends the notification owed) returns
// within about Timeout, and a NOTIFY that could not go fails nothing.
func TestNotifierTimeoutBoundsWaitingForAPoolConnection(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	pool := poolWith(t, b, func(cfg *pgxpool.Config) { cfg.MaxConns = 1 })
	held, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer held.Release()
	var logs testenv.LogSink
	n, err := outbox.NewNotifier(pool, b.writer.Channel(), &outbox.NotifierConfig{Timeout: 300 * time.Millisecond, Logger: logs.Logger()})
	require.NoError(t, err)
	n.Notify()
	start := time.Now()
	closed := make(chan struct{})
	go func() { n.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		held.Release() // let Close return, so that the test ends
		<-closed
		t.Fatal("Close waited for a pool connection past Timeout (300 ms)")
	}
	require.Less(t, time.Since(start), 2*time.Second)
	require.NotEmpty(t, logs.Lines(t, "outbox notifier: NOTIFY failed; relays will find the rows at their next poll"))
}

// slowExecer holds each statement for delay, then runs it on db.
type slowExecer struct {
	db              outbox.Execer
	delay           time.Duration
	entered, exited atomic.Int64
}

func (s *slowExecer) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	s.entered.Add(1)
	defer s.exited.Add(1)
	time.Sleep(s.delay)
	return s.db.Exec(ctx, sql, args...)
}

// TestNotifierCloseWaitsForTheNotifyInFlight: Close "waits for a
// NOTIFY already in flight ... waits for the sending goroutine to exit":
// when it returns, no statement of the Notifier is still running (its
// caller may close the pool next).
func TestNotifierCloseWaitsForTheNotifyInFlight(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := &slowExecer{db: b.pool, delay: 300 * time.Millisecond}
	n, err := outbox.NewNotifier(db, b.writer.Channel(), nil)
	require.NoError(t, err)
	n.Notify()
	require.Eventually(t, func() bool { return db.entered.Load() == 1 }, 5*time.Second, time.Millisecond)
	n.Close()
	require.Equal(t, db.entered.Load(), db.exited.Load(), "Close returned while a NOTIFY was in flight")
}
