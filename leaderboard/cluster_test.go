package leaderboard

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/reconcile"
)

// TestRedisCluster runs the Redis side of the board — worker, reads with
// scripts and transactions, reconciler — on a real Redis Cluster, with
// several boards whose keys land in different slots.
func TestRedisCluster(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.SharedRedisCluster(t)
	pg := testenv.Postgres(t)
	client := cluster.Client(t)
	prefix := cluster.Prefix(t)
	require.NoError(t, Migrate(ctx, pg.Pool, &Config{Schema: pg.Schema}))

	for _, name := range []string{"weekly-2026-48", "season {7}: finals", "daily"} {
		board, err := New(pg.Pool, client, &Config{Name: name, Schema: pg.Schema, KeyPrefix: prefix})
		require.NoError(t, err)
		tb := &testBundle{board: board, pg: pg}
		for i, u := range tieUsers {
			tb.submit(t, u, int64(i%3*10))
		}
		tb.drain(t)

		all, src := allPages(t, board, 4, WithPolicy(ServeStale))
		require.Equal(t, SourceRedis, src)
		auth, err := board.Authoritative(ctx, MaxPageSize)
		require.NoError(t, err)
		require.Equal(t, auth, all)
		for _, e := range auth[:3] {
			got, _, err := board.Rank(ctx, e.UserID, WithPolicy(ServeStale))
			require.NoError(t, err)
			require.Equal(t, e, got)
			around, err := board.Around(ctx, e.UserID, 1, WithPolicy(ServeStale))
			require.NoError(t, err)
			require.Contains(t, around.Entries, e)
		}

		rec, err := board.Reconciler(nil)
		require.NoError(t, err)
		report, err := rec.Run(ctx, reconcile.RunOptions{})
		require.NoError(t, err)
		require.Equal(t, int64(len(tieUsers)), report.Counts[reconcile.ClassCurrent])
	}
}
