package reconcile

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/projection"
)

// TestCluster runs the reconciler against a real 3-master Redis Cluster:
// documents spread over many slots (per-slot MGET reads, per-slot repair
// scripts, SCAN on every master), collections in one slot, and a rebuild
// under concurrent writes.
func TestCluster(t *testing.T) {
	t.Parallel()
	cluster := testenv.StartRedisCluster(t, 3, 1)
	client := cluster.Client(t)

	for _, kind := range allKinds {
		t.Run("Classes"+kindName(kind), func(t *testing.T) {
			b := setupWith(t, kind, client, cluster.Prefix(t))
			want := b.drift(t)
			r := b.reconciler(t, &Config{PageSize: 4, Policy: Policy{Orphan: ActionRepair}})
			rep, err := r.Run(context.Background(), RunOptions{})
			require.NoError(t, err)
			require.Equal(t, countClasses(want), rep.Counts)
			require.EqualValues(t, 7, rep.Repaired)

			rep, err = r.Run(context.Background(), RunOptions{})
			require.NoError(t, err)
			require.Equal(t, map[Class]int64{ClassCurrent: 6, ClassAhead: 1}, rep.Counts)
		})
	}

	t.Run("DocumentsAcrossSlots", func(t *testing.T) {
		b := setupWith(t, projection.KindDocument, client, cluster.Prefix(t))
		rows := b.insertMany(t, 300)
		b.projectRows(t, rows[:200]) // 100 missing
		for _, row := range rows[:20] {
			b.setRaw(t, row.Key, &projection.Value{Data: []byte("hand edit")}, nil)
		}
		for _, k := range []string{"gone-1", "gone-2", "gone-3"} {
			b.project(t, k, 1)
		}
		slots := map[int]bool{}
		for _, row := range rows {
			slots[b.ks.Slot(b.target.target(row.Key))] = true
		}
		require.Greater(t, len(slots), 100)

		r := b.reconciler(t, &Config{PageSize: 64})
		rep, err := r.Run(context.Background(), RunOptions{})
		require.NoError(t, err)
		require.Equal(t, map[Class]int64{ClassCurrent: 180, ClassCorrupt: 20, ClassMissing: 100, ClassOrphan: 3}, rep.Counts)
		require.EqualValues(t, 120, rep.Repaired)
	})

	t.Run("RebuildUnderWrites", func(t *testing.T) {
		b := setupWith(t, projection.KindSortedSet, client, cluster.Prefix(t))
		rebuildUnderWrites(t, b, b.ks)
	})
}
