package versioncache

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/keyenc"
	"github.com/verity-go/verity/internal/testenv"
)

// The read script builds the value and lease keys from the version it reads,
// so they are not in KEYS. This runs everything against a real 3-master
// cluster to show that Redis accepts it: those keys share the declared keys'
// hash tag, so they hash to the same slot.
func TestCluster(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	setupCluster := func(t *testing.T, cfg *Config) *testBundle {
		t.Helper()
		cluster := testenv.SharedRedisCluster(t)
		return setupWith(t, cluster.Client(t), cluster.Prefix(t), cfg)
	}

	t.Run("GetInvalidateCheckAcrossSlots", func(t *testing.T) {
		t.Parallel()
		b := setupCluster(t, nil)
		ids := make([]string, 30)
		slots := map[int64]bool{}
		for i := range ids {
			ids[i] = fmt.Sprintf("product-%d{%d}", i, i) // braces in ids too
			b.truth.write(ids[i], i)
			slot := b.client.ClusterKeySlot(ctx, keyenc.Tagged(b.prefix, ids[i], suffixVersion)).Val()
			require.Equal(t, slot, b.client.ClusterKeySlot(ctx, keyenc.Tagged(b.prefix, ids[i], suffixValue+"123")).Val())
			slots[slot] = true
		}
		require.Greater(t, len(slots), 10, "ids spread over slots (and so over masters)")

		for _, id := range ids {
			got, err := b.cache.Get(ctx, id, b.truth.loader(id))
			require.NoError(t, err)
			require.Equal(t, b.truth.read(id), got)
		}
		for _, id := range ids[:10] {
			b.truth.write(id, -1)
			require.NoError(t, b.cache.Invalidate(ctx, id))
		}
		for _, id := range ids {
			got, err := b.cache.Get(ctx, id, b.truth.loader(id))
			require.NoError(t, err)
			require.Equal(t, b.truth.read(id), got)
			got, err = b.cache.GetAt(ctx, id, got.Version, b.truth.loader(id))
			require.NoError(t, err)
			require.Equal(t, b.truth.read(id), got)
		}
		report, err := b.cache.Check(ctx, ids, 0, func(ctx context.Context, id string) (product, error) {
			return b.truth.read(id), nil
		})
		require.NoError(t, err)
		require.Equal(t, len(ids), report.Cached)
		require.Zero(t, report.Divergent)
		st := b.cache.Stats()
		require.Zero(t, st.RedisErrors)
		require.EqualValues(t, 10, st.OrphanedValueKeys)
	})

	t.Run("FillLeaseStorm", func(t *testing.T) {
		t.Parallel()
		cluster := testenv.SharedRedisCluster(t)
		client, prefix := cluster.Client(t), cluster.Prefix(t)
		caches := make([]*Cache[product], 3)
		for i := range caches {
			c, err := New[product](client, &Config{Prefix: prefix})
			require.NoError(t, err)
			caches[i] = c
		}
		src := newTruth()
		var total int64
		for range 3 {
			loads := missStorm(t, caches, src, "hot{x}", 8, 10*time.Millisecond)
			require.GreaterOrEqual(t, loads, int64(1))
			total += loads
		}
		require.LessOrEqual(t, total, int64(2*3), "about one load per storm")
	})

	t.Run("InvalidateReplicasConfirmed", func(t *testing.T) {
		t.Parallel()
		// One replica per master: the bump is confirmed on the replica of
		// whichever master owns each id.
		b := setupCluster(t, &Config{InvalidateReplicas: 1, InvalidateWaitTimeout: time.Second})
		waitReplicasOnline(t, b.client.(*redis.ClusterClient))
		for i := range 10 {
			id := fmt.Sprintf("r%d", i)
			b.truth.write(id, i)
			require.NoError(t, b.cache.Invalidate(ctx, id))
			got, err := b.cache.Get(ctx, id, b.truth.loader(id))
			require.NoError(t, err)
			require.Equal(t, b.truth.read(id), got)
		}
	})

	t.Run("ConcurrentVersionKeyLoss", func(t *testing.T) {
		t.Parallel()
		b := setupCluster(t, &Config{DisableFillLease: true})
		versionLossRace(t, b, time.Second)
	})
}

// waitReplicasOnline waits until every master's replicas finished their
// initial sync: a cluster reports healthy while they are still in
// wait_bgsave, and WAIT counts no replica until then.
func waitReplicasOnline(t *testing.T, client *redis.ClusterClient) {
	t.Helper()
	ctx := context.Background()
	require.Eventually(t, func() bool {
		err := client.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
			info, err := c.Info(ctx, "replication").Result()
			if err != nil {
				return err
			}
			if !strings.Contains(info, "connected_slaves:0") && !strings.Contains(info, "state=online") {
				return fmt.Errorf("%s: replica not online", c.Options().Addr)
			}
			if strings.Contains(info, "state=wait_bgsave") || strings.Contains(info, "state=send_bulk") {
				return fmt.Errorf("%s: replica syncing", c.Options().Addr)
			}
			return nil
		})
		return err == nil
	}, 30*time.Second, 100*time.Millisecond, "replicas never came online")
}
