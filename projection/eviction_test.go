package projection

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

func TestCheckEvictionPolicy(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	for _, c := range []struct {
		name      string
		args      []string
		evicting  bool
		maxMemory int64
	}{
		{"NoEviction", []string{"--maxmemory", "100mb", "--maxmemory-policy", "noeviction"}, false, 0},
		{"VolatilePolicyKeepsKeysWithoutTTL", []string{"--maxmemory", "100mb", "--maxmemory-policy", "volatile-lru"}, false, 0},
		{"AllKeysWithoutLimit", []string{"--maxmemory", "0", "--maxmemory-policy", "allkeys-lru"}, false, 0},
		{"AllKeysLRU", []string{"--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru"}, true, 100 << 20},
		{"AllKeysRandom", []string{"--maxmemory", "1gb", "--maxmemory-policy", "allkeys-random"}, true, 1 << 30},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			server := testenv.StartRedis(t, c.args...)
			err := CheckEvictionPolicy(ctx, server.Client(t))
			if !c.evicting {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, ErrEvictionPolicy)
			var perr *EvictionPolicyError
			require.ErrorAs(t, err, &perr)
			require.Equal(t, server.Addr(), perr.Addr)
			require.Equal(t, c.args[3], perr.Policy)
			require.Equal(t, c.maxMemory, perr.MaxMemory)
		})
	}

	t.Run("InfoRefusedIsNotAFinding", func(t *testing.T) {
		t.Parallel()
		server := testenv.StartRedis(t, "--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru")
		require.NoError(t, server.Client(t).Do(ctx, "ACL", "SETUSER", "no-info", "on", ">pw", "~*", "+@all", "-info").Err())
		limited := redis.NewClient(&redis.Options{Addr: server.Addr(), Username: "no-info", Password: "pw"})
		t.Cleanup(func() { _ = limited.Close() })
		err := CheckEvictionPolicy(ctx, limited)
		require.Error(t, err)
		require.NotErrorIs(t, err, ErrEvictionPolicy, "the policy is unknown, not found evicting")
		require.Contains(t, err.Error(), server.Addr())
	})

	t.Run("CancelledIsNotAFinding", func(t *testing.T) {
		t.Parallel()
		server := testenv.StartRedis(t, "--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru")
		cancelled, cancel := context.WithCancel(ctx)
		cancel()
		err := CheckEvictionPolicy(cancelled, server.Client(t))
		require.ErrorIs(t, err, context.Canceled, "the server's error is wrapped, so callers can tell why")
		require.NotErrorIs(t, err, ErrEvictionPolicy)
		require.Contains(t, err.Error(), server.Addr())
	})

	// A Cluster client that cannot load its slot map asks no node: that
	// is an error, not a clean bill. (A server without cluster support
	// stands for a cluster that cannot be reached.)
	t.Run("ClusterSlotMapUnavailable", func(t *testing.T) {
		t.Parallel()
		server := testenv.StartRedis(t, "--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru")
		client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{server.Addr()}})
		t.Cleanup(func() { _ = client.Close() })
		err := CheckEvictionPolicy(ctx, client)
		require.Error(t, err)
		require.NotErrorIs(t, err, ErrEvictionPolicy)
		var rerr redis.Error
		require.ErrorAs(t, err, &rerr, "Redis's error is wrapped")
		require.ErrorContains(t, err, "cluster support disabled")
	})

	// Any other UniversalClient (here one embedding a *redis.Client) is
	// asked through its own commands.
	t.Run("ClientOfAnotherType", func(t *testing.T) {
		t.Parallel()
		server := testenv.StartRedis(t, "--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru")
		err := CheckEvictionPolicy(ctx, embeddedClient{server.Client(t)})
		require.ErrorIs(t, err, ErrEvictionPolicy)
		var perr *EvictionPolicyError
		require.ErrorAs(t, err, &perr)
		require.Equal(t, "allkeys-lru", perr.Policy)
	})

	t.Run("NilClient", func(t *testing.T) {
		t.Parallel()
		require.ErrorIs(t, CheckEvictionPolicy(ctx, nil), ErrInvalidConfig)
		var nilClient *redis.Client
		require.ErrorIs(t, CheckEvictionPolicy(ctx, nilClient), ErrInvalidConfig)
	})
}

// embeddedClient is a redis.UniversalClient of a type CheckEvictionPolicy
// does not know.
type embeddedClient struct{ *redis.Client }

// TestCheckEvictionPolicyRing: every shard of a Ring is asked, and each
// that may evict is reported under its own address, the errors sorted by
// server whatever order the shards answer in.
func TestCheckEvictionPolicyRing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	addrs := map[string]string{"keeps": testenv.StartRedis(t, "--maxmemory", "100mb", "--maxmemory-policy", "noeviction").Addr()}
	var evicting []string
	for _, policy := range []string{"allkeys-lru", "allkeys-lfu", "allkeys-random"} {
		addr := testenv.StartRedis(t, "--maxmemory", "100mb", "--maxmemory-policy", policy).Addr()
		addrs[policy] = addr
		evicting = append(evicting, addr)
	}
	ring := redis.NewRing(&redis.RingOptions{Addrs: addrs, HeartbeatFn: func(context.Context, *redis.Client) bool { return true }})
	t.Cleanup(func() { _ = ring.Close() })
	for range 5 { // the shards answer concurrently
		err := CheckEvictionPolicy(ctx, ring)
		require.ErrorIs(t, err, ErrEvictionPolicy)
		joined, ok := err.(interface{ Unwrap() []error })
		require.True(t, ok, "%v", err)
		var got, text []string
		for _, e := range joined.Unwrap() {
			var perr *EvictionPolicyError
			require.ErrorAs(t, e, &perr)
			require.Equal(t, addrs[perr.Policy], perr.Addr)
			got = append(got, perr.Addr)
			text = append(text, e.Error())
		}
		require.ElementsMatch(t, evicting, got)
		require.True(t, slices.IsSorted(text), "sorted by server: %q", text)
	}

	// A Ring that lists no shard asks no server: that is no check passed,
	// and no script loaded. ForEachShard itself returns nil for it.
	t.Run("NoShardListed", func(t *testing.T) {
		t.Parallel()
		addr := testenv.Redis(t).Client.(*redis.Client).Options().Addr
		ks, err := NewKeyspace("nolisted")
		require.NoError(t, err)

		closed := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": addr}, HeartbeatFn: func(context.Context, *redis.Client) bool { return true }})
		require.NoError(t, CheckEvictionPolicy(ctx, closed), "an open Ring is checked")
		require.NoError(t, NewGate(closed, ks).Load(ctx), "and loaded")
		require.NoError(t, closed.Close())
		require.ErrorIs(t, CheckEvictionPolicy(ctx, closed), redis.ErrClosed)
		require.ErrorIs(t, NewGate(closed, ks).Load(ctx), redis.ErrClosed)

		down := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": addr}, HeartbeatFrequency: 10 * time.Millisecond,
			HeartbeatFn: func(context.Context, *redis.Client) bool { return false }})
		t.Cleanup(func() { _ = down.Close() })
		require.Eventually(t, func() bool { return down.Ping(ctx).Err() != nil }, 10*time.Second, 10*time.Millisecond)
		err = CheckEvictionPolicy(ctx, down)
		require.ErrorContains(t, err, "all ring shards are down")
		require.NotErrorIs(t, err, ErrEvictionPolicy)
		require.ErrorContains(t, NewGate(down, ks).Load(ctx), "all ring shards are down")
	})

	// A server that cannot be asked is sorted by its address too, not
	// ahead of every finding because of its message's wording.
	t.Run("RefusedAndEvictingSortedByServer", func(t *testing.T) {
		t.Parallel()
		servers := []*testenv.RedisServer{
			testenv.StartRedis(t, "--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru"),
			testenv.StartRedis(t, "--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru"),
		}
		slices.SortFunc(servers, func(a, b *testenv.RedisServer) int { return cmp.Compare(a.Addr(), b.Addr()) })
		// The first server answers INFO and is found evicting; the second
		// refuses INFO to the ring's user.
		for i, server := range servers {
			info := "+info"
			if i == 1 {
				info = "-info"
			}
			require.NoError(t, server.Client(t).Do(ctx, "ACL", "SETUSER", "checker", "on", ">pw", "~*", "+@all", info).Err())
		}
		ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": servers[0].Addr(), "b": servers[1].Addr()},
			Username: "checker", Password: "pw", HeartbeatFn: func(context.Context, *redis.Client) bool { return true }})
		t.Cleanup(func() { _ = ring.Close() })
		err := CheckEvictionPolicy(ctx, ring)
		require.ErrorIs(t, err, ErrEvictionPolicy)
		joined := err.(interface{ Unwrap() []error }).Unwrap()
		require.Len(t, joined, 2)
		var perr *EvictionPolicyError
		require.ErrorAs(t, joined[0], &perr, "the lower address first: %v", err)
		require.Equal(t, servers[0].Addr(), perr.Addr)
		require.NotErrorIs(t, joined[1], ErrEvictionPolicy)
		require.Contains(t, joined[1].Error(), servers[1].Addr())
	})

	// The caller's context reaches every shard: cancelled, none is asked
	// and each reports why.
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	err := CheckEvictionPolicy(cancelled, ring)
	require.ErrorIs(t, err, context.Canceled)
	require.NotErrorIs(t, err, ErrEvictionPolicy)
	require.Len(t, err.(interface{ Unwrap() []error }).Unwrap(), len(addrs))
}

// TestCheckEvictionPolicyCluster sets an evicting policy on one replica of
// a private cluster: a failover would promote it with its settings, so it
// is reported too, and the masters are not.
func TestCheckEvictionPolicyCluster(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("starts a private Redis Cluster")
	}
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 1)
	cluster.WaitSlotReplicas(t, 30*time.Second) // in the client's slot map
	client := cluster.Client(t)
	require.NoError(t, CheckEvictionPolicy(ctx, client))

	var replica string
	for _, addr := range cluster.Addrs() {
		node := redis.NewClient(&redis.Options{Addr: addr})
		role, err := node.Do(ctx, "ROLE").Slice()
		if err == nil && len(role) > 0 && role[0] == "slave" {
			replica = addr
			err = errors.Join(
				node.ConfigSet(ctx, "maxmemory", "64mb").Err(),
				node.ConfigSet(ctx, "maxmemory-policy", "allkeys-lfu").Err())
		}
		_ = node.Close()
		require.NoError(t, err)
		if replica != "" {
			break
		}
	}
	require.NotEmpty(t, replica, "the cluster has a replica")

	err := CheckEvictionPolicy(ctx, client)
	require.ErrorIs(t, err, ErrEvictionPolicy)
	var perr *EvictionPolicyError
	require.ErrorAs(t, err, &perr)
	require.Equal(t, replica, perr.Addr)
	require.Equal(t, "allkeys-lfu", perr.Policy)
	require.Len(t, err.(interface{ Unwrap() []error }).Unwrap(), 1, "the masters and the other replicas keep their keys")

	t.Run("EveryNodeIsReported", func(t *testing.T) {
		// Every node, masters included, may evict, each with a policy of
		// its own: each is reported once, under its own address, sorted.
		policies := map[string]string{}
		for i, addr := range cluster.Addrs() {
			policy := []string{"allkeys-lru", "allkeys-lfu", "allkeys-random"}[i%3]
			node := redis.NewClient(&redis.Options{Addr: addr})
			err := errors.Join(
				node.ConfigSet(ctx, "maxmemory", "64mb").Err(),
				node.ConfigSet(ctx, "maxmemory-policy", policy).Err())
			_ = node.Close()
			require.NoError(t, err)
			policies[addr] = policy
		}
		err := CheckEvictionPolicy(ctx, client)
		require.ErrorIs(t, err, ErrEvictionPolicy)
		var got, text []string
		for _, e := range err.(interface{ Unwrap() []error }).Unwrap() {
			var perr *EvictionPolicyError
			require.ErrorAs(t, e, &perr)
			require.Equal(t, policies[perr.Addr], perr.Policy, "%s", perr.Addr)
			got = append(got, perr.Addr)
			text = append(text, e.Error())
		}
		require.ElementsMatch(t, cluster.Addrs(), got)
		require.True(t, slices.IsSorted(text), "sorted by server: %q", text)
	})

	t.Run("CancelledIsNotAFinding", func(t *testing.T) {
		// The caller's context reaches every node: cancelled, none is
		// asked, and the evicting policies set above go unreported.
		cancelled, cancel := context.WithCancel(ctx)
		cancel()
		err := CheckEvictionPolicy(cancelled, client)
		require.ErrorIs(t, err, context.Canceled)
		require.NotErrorIs(t, err, ErrEvictionPolicy)
	})
}
