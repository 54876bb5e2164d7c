package testenv

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

func TestStartRedisCluster(t *testing.T) {
	t.Parallel()

	c := StartRedisCluster(t, 3, 1)
	require.Equal(t, 6, c.Size())
	require.Len(t, c.Addrs(), 6)

	ctx := context.Background()
	client := c.Client(t)

	// Keys spread over all masters; every write is readable back.
	for i := 0; i < 50; i++ {
		require.NoError(t, client.Set(ctx, "k"+strconv.Itoa(i), i, 0).Err())
	}
	for i := 0; i < 50; i++ {
		v, err := client.Get(ctx, "k"+strconv.Itoa(i)).Int()
		require.NoError(t, err)
		require.Equal(t, i, v)
	}
	masters := map[int]bool{}
	for _, slot := range []int{0, 8000, 16383} {
		masters[c.MasterForSlot(t, slot)] = true
	}
	require.Len(t, masters, 3, "the three slot ranges are served by three masters")

	t.Run("KillMasterPromotesReplica", func(t *testing.T) {
		const key = "failover-key"
		require.NoError(t, client.Set(ctx, key, "v", 0).Err())
		slot, err := client.ClusterKeySlot(ctx, key).Result()
		require.NoError(t, err)
		master := c.MasterForSlot(t, int(slot))

		c.Kill(master)
		require.Eventually(t, func() bool {
			return c.MasterForSlot(t, int(slot)) != master
		}, 30*time.Second, 100*time.Millisecond, "a replica takes over the killed master's slots")

		c.Start(t, master)
		c.WaitHealthy(t)
		require.Eventually(t, func() bool {
			return client.Set(ctx, key, "after", 0).Err() == nil
		}, 10*time.Second, 50*time.Millisecond)
		require.Equal(t, "after", client.Get(ctx, key).Val())
	})
}

func TestSharedRedisCluster(t *testing.T) {
	t.Parallel()

	a := SharedRedisCluster(t)
	b := SharedRedisCluster(t)
	require.Same(t, a, b, "one cluster per test binary")

	p1, p2 := a.Prefix(t), a.Prefix(t)
	require.NotEqual(t, p1, p2)
	require.NotContains(t, p1, "{")

	ctx := context.Background()
	client := a.Client(t)
	require.NoError(t, client.Set(ctx, p1+"x", "1", 0).Err())
	require.Equal(t, "1", client.Get(ctx, p1+"x").Val())
	require.NoError(t, DeletePrefix(ctx, client, p1))
	require.Zero(t, client.Exists(ctx, p1+"x").Val(), "a prefix is usable with DeletePrefix")
}

func TestSharedRedisSentinel(t *testing.T) {
	t.Parallel()

	s := SharedRedisSentinel(t)
	require.Same(t, s, SharedRedisSentinel(t))
	ctx := context.Background()
	client := s.Client(t)
	prefix := s.Prefix(t)
	require.NoError(t, client.Set(ctx, prefix+"k", "v", 0).Err())
	require.Equal(t, "v", client.Get(ctx, prefix+"k").Val())

	// The write reached the master the sentinel reports, and its replica.
	master := redis.NewClient(&redis.Options{Addr: s.MasterAddr()})
	t.Cleanup(func() { _ = master.Close() })
	require.Equal(t, "v", master.Get(ctx, prefix+"k").Val())
	replica := redis.NewClient(&redis.Options{Addr: s.replicas[0].addr()})
	t.Cleanup(func() { _ = replica.Close() })
	require.Eventually(t, func() bool { return replica.Get(ctx, prefix+"k").Val() == "v" },
		5*time.Second, 10*time.Millisecond)
}
