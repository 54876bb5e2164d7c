package reconcile

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/projection"
)

// TestSQLSourcePagesReadOnePageWithoutStatistics: over a table bulk-loaded
// and never analysed (autovacuum behind or off), a filtered SQLSource's
// pages of 1,000 were planned as a bitmap scan of every row after the
// cursor and a sort (200,000 and 100,000 rows read of a 200,000-row
// table), for the first five runs of each pooled connection's cached
// statement. Each page must read its own rows from the index in key order,
// with statistics or without.
func TestSQLSourcePagesReadOnePageWithoutStatistics(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testenv.Postgres(t)
	const rows, limit = 200_000, 1000
	_, err := pg.Pool.Exec(ctx, `CREATE TABLE scores (board text NOT NULL, user_id text COLLATE "C" NOT NULL,
		version bigint NOT NULL, score bigint NOT NULL, PRIMARY KEY (board, user_id)) WITH (autovacuum_enabled = false)`)
	require.NoError(t, err)
	_, err = pg.Pool.Exec(ctx, `INSERT INTO scores SELECT 'weekly', 'user-' || lpad(i::text, 7, '0'), 1, i % 1000
		FROM generate_series(1, $1::int) AS i`, rows)
	require.NoError(t, err)
	src, err := NewSQLSource(pg.Pool, &SQLSourceConfig{Table: "scores", Schema: pg.Schema, KeyColumn: "user_id",
		VersionColumn: "version", ValueColumn: "score", Kind: projection.KindSortedSet,
		Filters: []Filter{{Column: "board", Value: "weekly"}}})
	require.NoError(t, err)
	walk, err := src.walkSQLs(ctx, true)
	require.NoError(t, err)

	for _, stats := range []string{"NoStatistics", "Analysed"} {
		if stats == "Analysed" {
			_, err := pg.Pool.Exec(ctx, `ANALYZE scores`)
			require.NoError(t, err)
		}
		for _, st := range []struct {
			name string
			sql  string
			args []any
		}{
			{"First", walk.first, []any{"weekly", limit}},
			{"After", walk.after, []any{"weekly", fmt.Sprintf("user-%07d", rows/2), limit}},
		} {
			var doc string
			require.NoError(t, pg.Pool.QueryRow(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) "+st.sql, st.args...).Scan(&doc))
			reads := testenv.ParsePlan(t, doc).Find(func(n *testenv.PlanNode) bool { return n.RelationName == "scores" })
			require.Len(t, reads, 1, "%s/%s:\n%s", stats, st.name, doc)
			require.Equal(t, "Index Scan", reads[0].NodeType, "%s/%s:\n%s", stats, st.name, doc)
			require.LessOrEqual(t, reads[0].ActualRows, float64(limit), "%s/%s: a page of %d read %.0f rows", stats, st.name, limit, reads[0].ActualRows)
		}
	}
}
