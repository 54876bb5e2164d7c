package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/outbox"
)

// activeBackends counts appName's backends running a statement.
func (b *testBundle) activeBackends(t *testing.T, appName string) int {
	t.Helper()
	var n int
	require.NoError(t, b.pool.QueryRow(context.Background(),
		`SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND state = 'active'`, appName).Scan(&n))
	return n
}

// requireCancelledWhileWaiting runs call with a context it cancels once
// appName's backend waits for a lock, and requires call to return ctx's
// error within 5 s with no statement of appName's still running.
func (b *testBundle) requireCancelledWhileWaiting(t *testing.T, appName string, call func(context.Context) error) {
	t.Helper()
	took, err := b.cancelWhenWaiting(t, appName, call)
	require.ErrorIs(t, err, context.Canceled)
	require.Less(t, took, 5*time.Second)
	require.Zero(t, b.activeBackends(t, appName), "the call returned with its statement still running on the server")
}

// cancelWhenWaiting runs call with a context it cancels once appName's
// backend waits for a lock, and returns call's error and how long it took
// to return after the cancel.
func (b *testBundle) cancelWhenWaiting(t *testing.T, appName string, call func(context.Context) error) (time.Duration, error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- call(ctx) }()
	require.Eventually(t, func() bool { return b.waitingForLock(appName, "") },
		10*time.Second, 5*time.Millisecond, "the call never waited for the lock")
	start := time.Now()
	cancel()
	select {
	case err := <-done:
		return time.Since(start), err
	case <-time.After(30 * time.Second):
		t.Fatal("the call has not returned 30s after its cancel")
		return 0, nil
	}
}

// TestReplayDeadCancelledWhileWaiting: a replay waiting on an append of
// its event id, cancelled, stops waiting on the server before it returns;
// with pgx alone, which returns first and cancels in the background, the
// append's rollback right after could let it move the dead letter back.
func TestReplayDeadCancelledWhileWaiting(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	ev := uuid.New()
	b.insertDead(t, 1, ev)
	appender, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = appender.Rollback(context.Background()) })
	msg := newMessage("s", "k", 1)
	msg.EventID = ev
	require.NoError(t, b.writer.Append(ctx, appender, msg))

	appName := "replay-cancelled-" + uuid.NewString()
	r := b.relay(t, newPoolNamed(t, b.pg.ConnString, appName), &recorder{}, outbox.RelayConfig{})
	b.requireCancelledWhileWaiting(t, appName, func(ctx context.Context) error {
		_, err := r.ReplayDead(ctx, outbox.ReplayFilter{})
		return err
	})

	require.NoError(t, appender.Rollback(ctx))
	time.Sleep(500 * time.Millisecond)
	require.Zero(t, b.count(t, pgx.Identifier{b.cfg.Schema, outbox.TableDefault}.Sanitize()), "a cancelled ReplayDead moved a dead letter back after it returned")
	require.Equal(t, 1, b.count(t, b.deadTable()))
}

// TestPruneCommandsCancelledWhileWaiting: a prune waiting for a record
// another transaction holds, cancelled, stops waiting on the server before
// it returns; with pgx alone, which returns first and cancels in the
// background, that transaction's rollback right after could let it delete
// the record.
func TestPruneCommandsCancelledWhileWaiting(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	id := uuid.New()
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	_, err = b.writer.RecordCommand(ctx, tx, id, outbox.Fingerprint([]byte("c")))
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	time.Sleep(10 * time.Millisecond)

	// Another prune, in a transaction of its own, holds the record.
	holder, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = holder.Rollback(context.Background()) })
	n, err := b.writer.PruneCommands(ctx, holder, time.Microsecond)
	require.NoError(t, err)
	require.EqualValues(t, 1, n)

	appName := "prune-cancelled-" + uuid.NewString()
	pool := newPoolNamed(t, b.pg.ConnString, appName)
	b.requireCancelledWhileWaiting(t, appName, func(ctx context.Context) error {
		_, err := b.writer.PruneCommands(ctx, pool, time.Microsecond)
		return err
	})

	require.NoError(t, holder.Rollback(ctx))
	time.Sleep(500 * time.Millisecond)
	require.Equal(t, 1, b.idempotencyRows(t), "a cancelled PruneCommands deleted the record after it returned")
}
