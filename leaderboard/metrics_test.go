package leaderboard

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"

	"github.com/verity-go/verity/internal/telemetry/metrictest"
	"github.com/verity-go/verity/projection"
	"github.com/verity-go/verity/reconcile"
)

func TestBoardMetrics(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	outcome := func(o string) attribute.KeyValue { return attribute.String(AttributeOutcome, o) }

	t.Run("SubmitsWorkerAndReads", func(t *testing.T) {
		t.Parallel()
		rec := metrictest.New(t)
		tb := setup(t, func(c *Config) { c.MeterProvider = rec.Provider })
		board := attribute.String(AttributeBoard, tb.board.Name())

		dup := Command{EventID: uuid.New(), UserID: "alice", Delta: 10}
		_, err := tb.board.Submit(ctx, dup)
		require.NoError(t, err)
		_, err = tb.board.Submit(ctx, dup)
		require.NoError(t, err)
		_, err = tb.board.Submit(ctx, Command{EventID: dup.EventID, UserID: "alice", Delta: 11})
		require.ErrorIs(t, err, ErrIdempotencyConflict)
		_, err = tb.board.Submit(ctx, Command{EventID: uuid.New(), UserID: "", Delta: 1})
		require.ErrorIs(t, err, ErrInvalidCommand)
		_, err = tb.board.SubmitBatch(ctx, []Command{
			{EventID: uuid.New(), UserID: "bob", Delta: 3},
			{EventID: uuid.New(), UserID: "carol", Delta: 4},
			dup,
		})
		require.NoError(t, err)
		tx, err := tb.pg.Pool.Begin(ctx)
		require.NoError(t, err)
		_, err = tb.board.SubmitTx(ctx, tx, Command{EventID: uuid.New(), UserID: "dave", Delta: 5})
		require.NoError(t, err)
		require.NoError(t, tx.Commit(ctx))

		// The worker inherits the board's provider for the relay and the
		// projector.
		worker, err := tb.board.Worker(nil)
		require.NoError(t, err)
		n, err := worker.Drain(ctx)
		require.NoError(t, err)
		require.Equal(t, 4, n)

		_, err = tb.board.Top(ctx, 10)
		require.NoError(t, err)
		_, _, err = tb.board.Rank(ctx, "nobody")
		require.ErrorIs(t, err, ErrUserNotFound)

		s := rec.Collect(t)
		require.Equal(t, int64(4), s.Int(metricSubmits, board, outcome("applied")))
		require.Equal(t, int64(2), s.Int(metricSubmits, board, outcome("duplicate")))
		require.Equal(t, int64(1), s.Int(metricSubmits, board, outcome("conflict")))
		require.Equal(t, int64(1), s.Int(metricSubmits, board, outcome("invalid")))

		require.Equal(t, int64(4), s.Int("verity.outbox.claimed"))
		require.Equal(t, int64(4), s.Int("verity.outbox.acked"))
		require.Equal(t, int64(4), s.Int("verity.projection.writes",
			attribute.String(projection.AttributeName, tb.board.Name()), attribute.String(projection.AttributeOutcome, "applied")))
		require.Equal(t, uint64(4), s.Count("verity.projection.lag", attribute.String(projection.AttributeName, tb.board.Name())))

		require.Equal(t, int64(1), s.Int(metricReads, board, attribute.String(AttributeSource, "redis"), outcome("ok")))
		require.Equal(t, int64(1), s.Int(metricReads, board, outcome("not_found")))
		require.True(t, s.Has(metricLag), "reads measured the lag")
		require.Zero(t, s.Float(metricLag, board), "nothing is pending after the drain")
	})

	t.Run("ReconcilerInheritsTheProvider", func(t *testing.T) {
		t.Parallel()
		rec := metrictest.New(t)
		tb := setup(t, func(c *Config) { c.MeterProvider = rec.Provider })
		tb.submit(t, "fay", 2)
		tb.submit(t, "gus", 3)
		// Nothing projected: both users are missing from Redis.
		r, err := tb.board.Reconciler(&reconcile.Config{})
		require.NoError(t, err)
		rep, err := r.Run(ctx, reconcile.RunOptions{})
		require.NoError(t, err)
		require.Equal(t, int64(2), rep.Repaired)
		s := rec.Collect(t)
		require.Equal(t, int64(2), s.Int("verity.reconcile.rows",
			attribute.String(reconcile.AttributeName, tb.board.Name()), attribute.String(reconcile.AttributeClass, "missing")))
		require.Equal(t, int64(2), s.Int("verity.reconcile.repaired"))
	})

	t.Run("FailClosedReadIsStale", func(t *testing.T) {
		t.Parallel()
		rec := metrictest.New(t)
		tb := setup(t, func(c *Config) {
			c.MeterProvider = rec.Provider
			c.ReadPolicy = FailClosed
		})
		res := tb.submit(t, "erin", 1)
		// No worker runs: the projection never reaches the version.
		_, _, err := tb.board.Rank(ctx, "erin", AtLeast("erin", res.Version))
		require.ErrorIs(t, err, ErrStale)
		s := rec.Collect(t)
		require.Equal(t, int64(1), s.Int(metricReads, outcome("stale")))
		require.Zero(t, s.Int(metricReads, outcome("ok")))
	})
}
