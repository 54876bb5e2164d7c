package clusterpin

import (
	"context"
	"errors"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

type testBundle struct {
	cluster *testenv.RedisCluster
	// stale is a client whose slot map was loaded before the test moved
	// anything; fresh is created after, and knows the current owners.
	stale *redis.ClusterClient
}

// setup returns a bundle over cluster whose stale client has loaded its
// slot map.
func setup(t *testing.T, cluster *testenv.RedisCluster) *testBundle {
	t.Helper()
	stale := cluster.Client(t)
	require.NoError(t, stale.Ping(context.Background()).Err(), "loads the slot map")
	return &testBundle{cluster: cluster, stale: stale}
}

// nodeAddr names the node a read ran on: a node client, or a connection
// taken from one (the ASK path).
func nodeAddr(rdb redis.Cmdable) string {
	switch n := rdb.(type) {
	case *redis.Client:
		return n.Options().Addr
	case *redis.Conn:
		return "conn"
	}
	return "?"
}

func TestOnMaster(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// One private cluster for the subtests, each on its own hash tag: they
	// move slots, which a shared cluster's other users must not see.
	cluster := testenv.StartRedisCluster(t, 3, 0)

	t.Run("ReadsOnTheMaster", func(t *testing.T) {
		t.Parallel()
		b := setup(t, cluster)
		key := "{plain}k"
		require.NoError(t, b.stale.Set(ctx, key, "v", 0).Err())
		master, err := b.stale.MasterForKey(ctx, key)
		require.NoError(t, err)
		var ran []string
		var got string
		err = OnMaster(ctx, b.stale, key, func(rdb redis.Cmdable) error {
			ran = append(ran, nodeAddr(rdb))
			got, err = rdb.Get(ctx, key).Result()
			return err
		})
		require.NoError(t, err)
		require.Equal(t, "v", got)
		require.Equal(t, []string{master.Options().Addr}, ran)
	})

	t.Run("FollowsMoved", func(t *testing.T) {
		t.Parallel()
		b := setup(t, cluster)
		key := "{moved}k"
		old, err := b.stale.MasterForKey(ctx, key)
		require.NoError(t, err)
		b.cluster.ReassignSlot(t, key) // the slot is empty
		fresh := b.cluster.Client(t)
		require.NoError(t, fresh.Set(ctx, key, "on the new master", 0).Err())
		owner, err := fresh.MasterForKey(ctx, key)
		require.NoError(t, err)
		require.NotEqual(t, old.Options().Addr, owner.Options().Addr)

		// The old master's own connection does not follow the move.
		err = old.Get(ctx, key).Err()
		require.True(t, IsRedirect(err), "the old master answers MOVED: %v", err)

		var ran []string
		var got string
		err = OnMaster(ctx, b.stale, key, func(rdb redis.Cmdable) error {
			ran = append(ran, nodeAddr(rdb))
			got, err = rdb.Get(ctx, key).Result()
			return err
		})
		require.NoError(t, err)
		require.Equal(t, "on the new master", got)
		require.Equal(t, []string{old.Options().Addr, owner.Options().Addr}, ran)
		now, err := b.stale.MasterForKey(ctx, key)
		require.NoError(t, err)
		require.Equal(t, owner.Options().Addr, now.Options().Addr, "the stale client's map caught up")
	})

	t.Run("FollowsAsk", func(t *testing.T) {
		t.Parallel()
		b := setup(t, cluster)
		key := "{ask}k"
		require.NoError(t, b.stale.Set(ctx, key, "migrated", 0).Err())
		old, err := b.stale.MasterForKey(ctx, key)
		require.NoError(t, err)
		b.cluster.MigrateKey(t, key)

		err = old.Get(ctx, key).Err()
		_, isAsk := redis.IsAskError(err)
		require.True(t, isAsk, "the migrating master answers ASK: %v", err)

		var ran []string
		var got string
		err = OnMaster(ctx, b.stale, key, func(rdb redis.Cmdable) error {
			ran = append(ran, nodeAddr(rdb))
			got, err = rdb.Get(ctx, key).Result()
			return err
		})
		require.NoError(t, err)
		require.Equal(t, "migrated", got)
		require.Equal(t, []string{old.Options().Addr, "conn"}, ran)
	})

	t.Run("MapThatNeverCatchesUp", func(t *testing.T) {
		t.Parallel()
		b := setup(t, cluster)
		key := "{behind}k"
		frozen := slotMap(t, b.stale)
		// A client whose every reload returns the map from before the move.
		stuck := redis.NewClusterClient(&redis.ClusterOptions{
			Addrs:        b.cluster.Addrs(),
			ClusterSlots: func(context.Context) ([]redis.ClusterSlot, error) { return frozen, nil },
		})
		t.Cleanup(func() { _ = stuck.Close() })
		require.NoError(t, stuck.Ping(ctx).Err())
		b.cluster.ReassignSlot(t, key)

		runs := 0
		read := func(rdb redis.Cmdable) error {
			runs++
			return rdb.Get(ctx, key).Err()
		}
		start := time.Now()
		err := OnMaster(ctx, stuck, key, read)
		require.ErrorIs(t, err, ErrMapBehind)
		require.True(t, IsRedirect(err), "the MOVED reply is kept: %v", err)
		require.GreaterOrEqual(t, time.Since(start), AwaitTimeout)
		require.Equal(t, 1, runs, "not run again on a master the map still names")

		short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		defer cancel()
		start = time.Now()
		err = OnMaster(short, stuck, key, read)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.Less(t, time.Since(start), AwaitTimeout, "the context ends the wait")
	})

	t.Run("OtherErrorsAreReturnedAsTheyAre", func(t *testing.T) {
		t.Parallel()
		b := setup(t, cluster)
		key := "{wrongtype}k"
		require.NoError(t, b.stale.HSet(ctx, key, "f", "v").Err())
		runs := 0
		err := OnMaster(ctx, b.stale, key, func(rdb redis.Cmdable) error {
			runs++
			return rdb.Get(ctx, key).Err()
		})
		require.Error(t, err)
		require.Contains(t, err.Error(), "WRONGTYPE")
		require.False(t, IsRedirect(err))
		require.Equal(t, 1, runs)
	})
}

// slotMap returns the cluster's slot map as CLUSTER SHARDS gives it, in the
// form of ClusterOptions.ClusterSlots: each range with its master.
func slotMap(t *testing.T, client *redis.ClusterClient) []redis.ClusterSlot {
	t.Helper()
	shards, err := client.ClusterShards(context.Background()).Result()
	require.NoError(t, err)
	var slots []redis.ClusterSlot
	for _, shard := range shards {
		for _, n := range shard.Nodes {
			if n.Role != "master" {
				continue
			}
			master := redis.ClusterNode{ID: n.ID, Addr: net.JoinHostPort(n.IP, strconv.FormatInt(n.Port, 10))}
			for _, r := range shard.Slots {
				slots = append(slots, redis.ClusterSlot{Start: int(r.Start), End: int(r.End), Nodes: []redis.ClusterNode{master}})
			}
		}
	}
	require.NotEmpty(t, slots)
	return slots
}

func TestClient(t *testing.T) {
	t.Parallel()
	addrs := []string{"127.0.0.1:1"} // never dialled
	for _, tc := range []struct {
		name   string
		client redis.UniversalClient
		pinned bool
	}{
		{"Single", redis.NewClient(&redis.Options{Addr: addrs[0]}), false},
		{"Cluster", redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs}), false},
		{"ReadOnly", redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs, ReadOnly: true}), true},
		{"RouteByLatency", redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs, RouteByLatency: true}), true},
		{"RouteRandomly", redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs, RouteRandomly: true}), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			t.Cleanup(func() { _ = tc.client.Close() })
			require.Equal(t, tc.pinned, Client(tc.client) != nil)
		})
	}
}

func TestIsRedirect(t *testing.T) {
	t.Parallel()
	require.False(t, IsRedirect(nil))
	require.False(t, IsRedirect(errors.New("ERR something")))
	require.False(t, IsRedirect(redis.Nil))
}
