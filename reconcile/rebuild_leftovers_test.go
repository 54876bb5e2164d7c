package reconcile

import (
	"context"
	"fmt"
	"sort"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/projection"
)

// A rebuild that died (its marker expired) leaves its shadow keys, its
// shadow layout key and its copy count behind, in its own layout. The next
// rebuild's start must clear all of them, in the dead rebuild's layout and
// in its own: a copy count left in place keeps the new copy's first batches
// from being counted (the switch then refuses a complete shadow), shadow
// versions left in the new layout make the copy keep rows out of the
// shadow, and shadow buckets of another layout are never removed by
// anything after.
func TestRebuildClearsADeadRebuildsLeftovers(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		dead, next int
		lostLayout bool // the dead rebuild's shadow layout key is gone (evicted, deleted)
	}{{4, 4, false}, {8, 0, false}, {8, 4, false}, {0, 0, false}, {4, 4, true}} {
		t.Run(fmt.Sprintf("Dead%dNext%dLostLayout%v", c.dead, c.next, c.lostLayout), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			b := setup(t, projection.KindSortedSet).withBuckets(t, c.next)
			b.projectRows(t, []Row{b.insert(t, "a", 1), b.insert(t, "b", 1)})
			dead := b.withBuckets(t, c.dead)
			n, k := b.target.Name, b.kind
			if !c.lostLayout {
				require.NoError(t, b.client.Set(ctx, b.ks.ShadowLayoutKey(n, k), fmt.Sprint(c.dead), 0).Err())
			}
			require.NoError(t, b.client.ZAdd(ctx, b.ks.ShadowValueKey(n, k), redis.Z{Score: 999, Member: "ghost"}, redis.Z{Score: 999, Member: "a"}).Err())
			for _, key := range dead.ks.ShadowVersionKeys(n, k) {
				require.NoError(t, b.client.HSet(ctx, key, "ghost", "5", "a", "9").Err())
			}
			// The dead rebuild's count after its first page.
			require.NoError(t, b.client.HSet(ctx, b.copyKey(), "rows", "3", "batch", "1", "members", "2", "versions", "2").Err())

			r := b.reconciler(t, nil)
			rep, err := r.Rebuild(ctx)
			require.NoError(t, err)
			require.True(t, rep.Switched)
			require.EqualValues(t, 2, rep.Applied, "every row copied into an empty shadow")

			allowed := map[string]bool{b.ks.ValueKey(b.target.target("")): true, b.ks.LayoutKey(n, k): true}
			for _, key := range b.ks.VersionKeys(n, k) {
				allowed[key] = true
			}
			var extra []string
			for key := range b.snapshot(t) {
				if !allowed[key] {
					extra = append(extra, key)
				}
			}
			sort.Strings(extra)
			require.Empty(t, extra, "only the new layout's live keys are left")
			run, err := r.Run(ctx, RunOptions{DryRun: true})
			require.NoError(t, err)
			require.Equal(t, map[Class]int64{ClassCurrent: 2}, run.Counts)
		})
	}
}

// TestRebuildStartClearsAnUnreadableShadowLayout: a dead rebuild's
// leftovers stay "until the next Rebuild of that collection starts: its
// start clears them", also when their shadow layout key holds no bucket
// count (a hand edit): the start clears every possible shadow bucket
// instead of refusing with a layout mismatch whose advice is to rebuild.
func TestRebuildStartClearsAnUnreadableShadowLayout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, projection.KindSortedSet).withBuckets(t, 4)
	b.projectRows(t, []Row{b.insert(t, "a", 1), b.insert(t, "b", 1)})
	n, k := b.target.Name, b.kind
	require.NoError(t, b.client.Set(ctx, b.ks.ShadowLayoutKey(n, k), "junk", 0).Err())
	require.NoError(t, b.client.ZAdd(ctx, b.ks.ShadowValueKey(n, k), redis.Z{Score: 999, Member: "ghost"}).Err())
	for _, key := range b.withBuckets(t, 8).ks.ShadowVersionKeys(n, k) { // a dead rebuild's of another layout
		require.NoError(t, b.client.HSet(ctx, key, "ghost", "5").Err())
	}
	rep, err := b.reconciler(t, nil).Rebuild(ctx)
	require.NoError(t, err)
	require.True(t, rep.Switched)
	live := map[string]bool{b.ks.ValueKey(b.target.target("")): true, b.ks.LayoutKey(n, k): true}
	for _, key := range b.ks.VersionKeys(n, k) {
		live[key] = true
	}
	for key := range b.snapshot(t) {
		require.True(t, live[key], "leftover %s", key)
	}
}
