package outbox_test

import (
	"context"
	"errors"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/outbox"
)

// TestWriterRefusesNonTransaction: a pool, or a connection outside a
// transaction, given as tx would commit each statement on its own: a
// command recorded as done, then a crash before its effects, and every
// retry is a duplicate of an effect that never happened. Each Writer
// method refuses one with a *ConfigError naming tx, and writes nothing; a
// connection on which the caller ran BEGIN is a transaction, and accepted.
func TestWriterRefusesNonTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	pooled, err := b.pool.Acquire(ctx)
	require.NoError(t, err)
	t.Cleanup(pooled.Release)
	conn, err := pgx.Connect(ctx, b.pg.ConnString)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })

	for name, tx := range map[string]outbox.Tx{"Pool": b.pool, "PoolConn": pooled, "Conn": conn} {
		id := uuid.New()
		_, err := b.writer.RecordCommand(ctx, tx, id, outbox.Fingerprint([]byte("cmd")))
		requireTxRefused(t, err, name+" RecordCommand")
		requireTxRefused(t, b.writer.StoreCommandResult(ctx, tx, id, []byte("result")), name+" StoreCommandResult")
		requireTxRefused(t, b.writer.Append(ctx, tx, newMessage("s", "k", 1)), name+" Append")
	}
	require.Zero(t, b.idempotencyRows(t), "nothing recorded")
	require.Zero(t, b.count(t, b.writer.Table()), "nothing appended")

	// A pooled connection released too early, and a closed one, are
	// refused the same way, typed, not with pgxpool's nil-pointer panic.
	t.Run("ReleasedOrClosedConn", func(t *testing.T) {
		released, err := b.pool.Acquire(ctx)
		require.NoError(t, err)
		released.Release()
		closed, err := pgx.Connect(ctx, b.pg.ConnString)
		require.NoError(t, err)
		require.NoError(t, closed.Close(ctx))
		for name, tx := range map[string]outbox.Tx{"ReleasedPoolConn": released, "ClosedConn": closed} {
			id := uuid.New()
			_, err := b.writer.RecordCommand(ctx, tx, id, outbox.Fingerprint([]byte("cmd")))
			for what, err := range map[string]error{"RecordCommand": err,
				"StoreCommandResult": b.writer.StoreCommandResult(ctx, tx, id, []byte("result")),
				"Append":             b.writer.Append(ctx, tx, newMessage("s", "k", 1))} {
				var ce *outbox.ConfigError
				require.ErrorAs(t, err, &ce, name+" "+what)
				require.Equal(t, "tx", ce.Field, name+" "+what)
				require.ErrorIs(t, err, outbox.ErrInvalidConfig, name+" "+what)
			}
		}
		require.Zero(t, b.idempotencyRows(t), "nothing recorded")
		require.Zero(t, b.count(t, b.writer.Table()), "nothing appended")
	})

	t.Run("ConnInsideBegin", func(t *testing.T) {
		_, err := conn.Exec(ctx, "BEGIN")
		require.NoError(t, err)
		id := uuid.New()
		cmd, err := b.writer.RecordCommand(ctx, conn, id, outbox.Fingerprint([]byte("cmd")))
		require.NoError(t, err)
		require.False(t, cmd.Duplicate)
		require.NoError(t, b.writer.Append(ctx, conn, newMessage("s", "k", 1)))
		require.NoError(t, b.writer.StoreCommandResult(ctx, conn, id, []byte("result")))
		require.Zero(t, b.count(t, b.writer.Table()), "not visible before COMMIT")
		_, err = conn.Exec(ctx, "COMMIT")
		require.NoError(t, err)
		require.Equal(t, 1, b.idempotencyRows(t))
		require.Equal(t, 1, b.count(t, b.writer.Table()))
	})
}

func requireTxRefused(t *testing.T, err error, what string) {
	t.Helper()
	var ce *outbox.ConfigError
	require.True(t, errors.As(err, &ce), "%s: %v", what, err)
	require.Equal(t, "tx", ce.Field, what)
	require.ErrorIs(t, err, outbox.ErrInvalidConfig, what)
	require.Contains(t, ce.Reason, "commit on their own", what)
}
