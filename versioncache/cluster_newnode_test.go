package versioncache

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// TestClusterMigrationToNewMaster: resharding onto a newly added master
// (one that serves no slot yet, as when a node joins and the first slot
// moves to it). A command pinned to a master cannot follow the ASK to it.
// Invalidate with InvalidateReplicas (bump+WAIT through clusterpin) and
// Peek through a replica-reading client wait for the migration until ctx
// ends and match ErrSlotMigrating, as with a known importing master; a
// FailClosed miss fails at once matching it. They used to give up after
// five redirects with a bare ASK error.
func TestClusterMigrationToNewMaster(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	m := startNewNodeMigration(t)
	cluster, prefix, id, waiting := m.cluster, m.prefix, m.id, m.waiting
	t.Run("Invalidate", func(t *testing.T) {
		cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		defer cancel()
		start := time.Now()
		err := waiting.Invalidate(cctx, id)
		require.GreaterOrEqual(t, time.Since(start), 2*time.Second, "it gave up before ctx ended")
		require.ErrorIs(t, err, ErrSlotMigrating, "a migration is what kept the bump from running")
		require.ErrorIs(t, err, context.DeadlineExceeded, "it waited for the migration until ctx ended")
	})
	// A replica-reading client pins Peek (so Check) to the master too.
	ro := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs(), ReadOnly: true})
	t.Cleanup(func() { _ = ro.Close() })
	reader, err := New[product](ro, &Config{Prefix: prefix, FailureMode: FailClosed})
	require.NoError(t, err)
	t.Run("Peek", func(t *testing.T) {
		pctx, pcancel := context.WithTimeout(ctx, 3*time.Second)
		defer pcancel()
		start := time.Now()
		_, _, _, err := reader.Peek(pctx, id)
		require.GreaterOrEqual(t, time.Since(start), 2*time.Second, "it gave up before ctx ended")
		require.ErrorIs(t, err, ErrSlotMigrating)
		require.ErrorIs(t, err, context.DeadlineExceeded)
	})
	t.Run("FailClosedMiss", func(t *testing.T) {
		// A FailClosed miss fails at once, matching ErrSlotMigrating.
		_, err := reader.Get(ctx, id, func(context.Context) (product, error) { return product{}, nil })
		require.ErrorIs(t, err, ErrSlotMigrating)
	})
}

// newNodeMigration: a slot MIGRATING from its master to a node that just
// joined the cluster and serves no slot yet.
type newNodeMigration struct {
	cluster    *testenv.RedisCluster
	prefix, id string
	waiting    *Cache[product] // invalidates waiting for one replica
}

func startNewNodeMigration(t *testing.T) *newNodeMigration {
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 0)
	admin := cluster.Client(t)
	node := testenv.StartRedis(t, "--cluster-enabled", "yes")
	nc := node.Client(t)
	host, port, _ := strings.Cut(node.Addr(), ":")
	masters := testenv.Masters(t, admin)
	require.NoError(t, masters[0].Do(ctx, "CLUSTER", "MEET", host, port).Err())
	require.Eventually(t, func() bool {
		for _, m := range append([]*redis.Client{nc}, masters...) {
			info, err := m.ClusterInfo(ctx).Result()
			if err != nil || !strings.Contains(info, "cluster_known_nodes:4") || !strings.Contains(info, "cluster_state:ok") {
				return false
			}
		}
		return true
	}, 20*time.Second, 50*time.Millisecond)

	client := cluster.Client(t)
	prefix := cluster.Prefix(t)
	waiting, err := New[product](client, &Config{Prefix: prefix, FailureMode: FailClosed,
		InvalidateReplicas: 1, InvalidateWaitTimeout: 10 * time.Millisecond})
	require.NoError(t, err)
	id := "to-new-node"
	slot := keySlot(waiting.versionKey(id))
	src, err := admin.MasterForKey(ctx, waiting.versionKey(id))
	require.NoError(t, err)
	srcID := src.Do(ctx, "CLUSTER", "MYID").Val().(string)
	dstID := nc.Do(ctx, "CLUSTER", "MYID").Val().(string)
	require.NoError(t, nc.Do(ctx, "CLUSTER", "SETSLOT", slot, "IMPORTING", srcID).Err())
	require.NoError(t, src.Do(ctx, "CLUSTER", "SETSLOT", slot, "MIGRATING", dstID).Err())
	t.Cleanup(func() {
		for _, n := range append([]*redis.Client{nc}, masters...) {
			_ = n.Do(context.Background(), "CLUSTER", "SETSLOT", slot, "STABLE").Err()
		}
	})
	return &newNodeMigration{cluster: cluster, prefix: prefix, id: id, waiting: waiting}
}
