package clusterpin

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

type testBundle struct {
	cluster *testenv.RedisCluster
	// stale is a client whose slot map was loaded before the test moved
	// anything.
	stale *redis.ClusterClient
	gets  *getsByNode
}

// getsByNode counts the GET commands each node was sent, and the CLUSTER
// commands (slot-map reloads) sent to any.
type getsByNode struct {
	mu      sync.Mutex
	counts  map[string]int
	reloads int
}

func (g *getsByNode) clusterCommands() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.reloads
}

func (g *getsByNode) count(addr string) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.counts[addr]
}

// countGets counts the GET commands cc sends to each node from now on.
func countGets(cc *redis.ClusterClient) *getsByNode {
	gets := &getsByNode{counts: map[string]int{}}
	cc.OnNewNode(func(node *redis.Client) {
		addr := node.Options().Addr
		node.AddHook(testenv.CommandHook(func(name string) {
			gets.mu.Lock()
			defer gets.mu.Unlock()
			switch name {
			case "get":
				gets.counts[addr]++
			case "cluster":
				gets.reloads++
			}
		}))
	})
	return gets
}

// setup returns a bundle whose stale client, made by newClient from
// cluster's addresses, counts GETs per node and has loaded its slot map.
func setup(t *testing.T, cluster *testenv.RedisCluster, opts *redis.ClusterOptions) *testBundle {
	t.Helper()
	if opts == nil {
		opts = &redis.ClusterOptions{}
	}
	opts.Addrs = cluster.Addrs()
	stale := redis.NewClusterClient(opts)
	t.Cleanup(func() { _ = stale.Close() })
	gets := countGets(stale)
	require.NoError(t, stale.Ping(context.Background()).Err(), "loads the slot map")
	return &testBundle{cluster: cluster, stale: stale, gets: gets}
}

// get reads key with OnMaster through b's stale client.
func (b *testBundle) get(ctx context.Context, key string) (string, error) {
	var cmd *redis.StringCmd
	err := OnMaster(ctx, b.stale, key, func(p redis.Pipeliner) { cmd = p.Get(ctx, key) })
	if err != nil {
		return "", err
	}
	return cmd.Val(), nil
}

func TestOnMaster(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// One private cluster for the subtests, each on its own hash tag: they
	// move slots, which a shared cluster's other users must not see.
	cluster := testenv.StartRedisCluster(t, 3, 0)

	t.Run("ReadsOnTheMaster", func(t *testing.T) {
		t.Parallel()
		b := setup(t, cluster, nil)
		key := "{plain}k"
		require.NoError(t, b.stale.Set(ctx, key, "v", 0).Err())
		master, err := b.stale.MasterForKey(ctx, key)
		require.NoError(t, err)
		got, err := b.get(ctx, key)
		require.NoError(t, err)
		require.Equal(t, "v", got)
		require.Equal(t, 1, b.gets.count(master.Options().Addr))

		var cmd *redis.StringCmd
		err = OnMaster(ctx, b.stale, "{plain}missing", func(p redis.Pipeliner) { cmd = p.Get(ctx, "{plain}missing") })
		require.ErrorIs(t, err, redis.Nil, "the first failed command's error, as Exec returns it")
		require.ErrorIs(t, cmd.Err(), redis.Nil)
	})

	t.Run("FollowsMoved", func(t *testing.T) {
		t.Parallel()
		b := setup(t, cluster, nil)
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

		oldGets := b.gets.count(old.Options().Addr)
		got, err := b.get(ctx, key)
		require.NoError(t, err)
		require.Equal(t, "on the new master", got)
		require.Equal(t, oldGets+1, b.gets.count(old.Options().Addr), "answered MOVED")
		require.Equal(t, 1, b.gets.count(owner.Options().Addr))
	})

	t.Run("AwaitsAMasterOtherThanTheStaleOne", func(t *testing.T) {
		t.Parallel()
		// go-redis may name the new master differently from the MOVED
		// reply (it replaces loopback hosts, for one): any master but
		// the one that answered MOVED will do.
		b := setup(t, cluster, nil)
		key := "{renamed}k"
		old, err := b.stale.MasterForKey(ctx, key)
		require.NoError(t, err)
		b.cluster.ReassignSlot(t, key)
		owner, err := b.cluster.Client(t).MasterForKey(ctx, key)
		require.NoError(t, err)
		node, err := AwaitMaster(ctx, b.stale, key, "moved.example:1", old.Options().Addr)
		require.NoError(t, err)
		require.Equal(t, owner.Options().Addr, node.Options().Addr)
	})

	t.Run("FollowsAsk", func(t *testing.T) {
		t.Parallel()
		b := setup(t, cluster, nil)
		key := "{ask}k"
		require.NoError(t, b.stale.Set(ctx, key, "migrated", 0).Err())
		old, err := b.stale.MasterForKey(ctx, key)
		require.NoError(t, err)
		dst := b.cluster.MigrateKey(t, key)

		err = old.Get(ctx, key).Err()
		_, isAsk := redis.IsAskError(err)
		require.True(t, isAsk, "the migrating master answers ASK: %v", err)

		got, err := b.get(ctx, key)
		require.NoError(t, err)
		require.Equal(t, "migrated", got)
		require.Equal(t, 1, b.gets.count(dst))

		// Following ASK does not reload the slot map each time (go-redis's
		// ForEachMaster would, with no pause): a resharding's reads would
		// flood the cluster with CLUSTER SLOTS.
		reloads := b.gets.clusterCommands()
		for range 100 {
			got, err := b.get(ctx, key)
			require.NoError(t, err)
			require.Equal(t, "migrated", got)
		}
		require.Equal(t, 101, b.gets.count(dst))
		require.LessOrEqual(t, b.gets.clusterCommands()-reloads, 2, "slot-map reloads for 100 ASK-followed reads")
	})

	t.Run("MapThatNeverCatchesUp", func(t *testing.T) {
		t.Parallel()
		key := "{behind}k"
		frozen := slotMap(t, cluster.Client(t))
		// A client whose every reload returns the map from before the move.
		b := setup(t, cluster, &redis.ClusterOptions{
			ClusterSlots: func(context.Context) ([]redis.ClusterSlot, error) { return frozen, nil },
		})
		b.cluster.ReassignSlot(t, key)

		runs := 0
		queue := func(p redis.Pipeliner) {
			runs++
			p.Get(ctx, key)
		}
		start := time.Now()
		err := OnMaster(ctx, b.stale, key, queue)
		require.ErrorIs(t, err, ErrMapBehind)
		require.True(t, IsRedirect(err), "the MOVED reply is kept: %v", err)
		require.GreaterOrEqual(t, time.Since(start), AwaitTimeout)
		require.Equal(t, 1, runs, "not sent again to a master the map still names")

		short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		defer cancel()
		start = time.Now()
		err = OnMaster(short, b.stale, key, queue)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.Less(t, time.Since(start), AwaitTimeout, "the context ends the wait")
	})

	t.Run("OtherErrorsAreReturnedAsTheyAre", func(t *testing.T) {
		t.Parallel()
		b := setup(t, cluster, nil)
		key := "{wrongtype}k"
		require.NoError(t, b.stale.HSet(ctx, key, "f", "v").Err())
		runs := 0
		err := OnMaster(ctx, b.stale, key, func(p redis.Pipeliner) {
			runs++
			p.Get(ctx, key)
		})
		require.Error(t, err)
		require.Contains(t, err.Error(), "WRONGTYPE")
		require.False(t, IsRedirect(err))
		require.Equal(t, 1, runs)
	})
}

// TestOnMasterAfterFailover fails the master of a key over to its replica
// behind the back of a replica-reading client. Its node clients open every
// connection with READONLY, so the demoted master, still named by the
// client's slot map, would serve the pinned read itself, as a replica;
// after READWRITE it answers MOVED, and the read lands on the new master.
func TestOnMasterAfterFailover(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 1)
	cluster.WaitSlotReplicas(t, 30*time.Second)
	b := setup(t, cluster, &redis.ClusterOptions{ReadOnly: true})
	key := "{failover}k"
	require.NoError(t, b.stale.Set(ctx, key, "v", 0).Err())
	before, err := b.stale.MasterForKey(ctx, key)
	require.NoError(t, err)

	oldMaster, newMaster := cluster.Failover(t, key)
	require.Equal(t, before.Options().Addr, oldMaster)
	named, err := b.stale.MasterForKey(ctx, key)
	require.NoError(t, err)
	require.Equal(t, oldMaster, named.Options().Addr, "the client's map has not caught up")

	got, err := b.get(ctx, key)
	require.NoError(t, err)
	require.Equal(t, "v", got)
	require.Equal(t, 1, b.gets.count(newMaster), "the read was served by the new master")
	require.Equal(t, 1, b.gets.count(oldMaster), "the demoted master answered MOVED, and served nothing")
}

// TestEvalRO runs a read script with EvalRO through a replica-reading
// client. go-redis deems EVALSHA_RO and EVAL_RO read-only, and that client
// sends them to a replica when it routes them itself; pinned, they run on
// the master, the new one after a failover the client's map has not caught
// up with, and they are the read-only variants: a write is refused.
func TestEvalRO(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 1)
	cluster.WaitSlotReplicas(t, 30*time.Second)
	stale := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs(), ReadOnly: true})
	t.Cleanup(func() { _ = stale.Close() })
	var mu sync.Mutex
	scripts := map[string]map[string]int{} // node address → command → calls
	stale.OnNewNode(func(node *redis.Client) {
		addr := node.Options().Addr
		node.AddHook(testenv.CommandHook(func(name string) {
			if strings.HasPrefix(name, "eval") {
				mu.Lock()
				defer mu.Unlock()
				if scripts[addr] == nil {
					scripts[addr] = map[string]int{}
				}
				scripts[addr][name]++
			}
		}))
	})
	calls := func(addr, name string) int {
		mu.Lock()
		defer mu.Unlock()
		return scripts[addr][name]
	}
	key := "{evalro}k"
	require.NoError(t, stale.Set(ctx, key, "v", 0).Err(), "loads the slot map")
	master, err := stale.MasterForKey(ctx, key)
	require.NoError(t, err)
	read := redis.NewScript("return redis.call('GET', KEYS[1])")

	// The same command routed by the client itself goes to a replica, or
	// to the master while go-redis deems the replica failing (for 15 s
	// after it answered LOADING, or an attempt on it failed) or its slot
	// map lacks the replica (loaded from a node that did not list it yet):
	// asked until one does not reach the master, reloading the map
	// meanwhile (go-redis reloads it by itself every 60 s only).
	toReplica := false
	for deadline := time.Now().Add(20 * time.Second); !toReplica && time.Now().Before(deadline); {
		before := calls(master.Options().Addr, "eval_ro")
		require.NoError(t, stale.EvalRO(ctx, "return 1", []string{key}).Err())
		toReplica = calls(master.Options().Addr, "eval_ro") == before
		if !toReplica {
			stale.ReloadState(ctx)
			time.Sleep(100 * time.Millisecond)
		}
	}
	require.True(t, toReplica, "the client sends EVAL_RO to a replica")

	roBefore := calls(master.Options().Addr, "eval_ro")
	got, err := EvalRO(ctx, stale, read, []string{key}).Text()
	require.NoError(t, err)
	require.Equal(t, "v", got)
	require.Equal(t, 1, calls(master.Options().Addr, "evalsha_ro"), "EVALSHA_RO first")
	require.Equal(t, roBefore+1, calls(master.Options().Addr, "eval_ro"), "EVAL_RO after NOSCRIPT")

	write := redis.NewScript("return redis.call('SET', KEYS[1], 'w')")
	err = EvalRO(ctx, stale, write, []string{key}).Err()
	require.ErrorContains(t, err, "Write commands are not allowed from read-only scripts")
	require.NoError(t, Eval(ctx, stale, write, []string{key}).Err(), "Eval may write")
	require.Equal(t, 1, calls(master.Options().Addr, "evalsha"), "the script cache is shared: EVAL_RO loaded it")
	require.Zero(t, calls(master.Options().Addr, "eval"))

	oldMaster, newMaster := cluster.Failover(t, key)
	require.Equal(t, master.Options().Addr, oldMaster)
	before := calls(oldMaster, "evalsha_ro")
	got, err = EvalRO(ctx, stale, read, []string{key}).Text()
	require.NoError(t, err)
	require.Equal(t, "w", got)
	require.Equal(t, before+1, calls(oldMaster, "evalsha_ro"), "the demoted master answered MOVED")
	require.Positive(t, calls(newMaster, "evalsha_ro"), "the new master ran it")
}

// TestPipelineRestoresReadOnly checks that a pinned read leaves the node
// client's connections as a replica-reading client opened them, READONLY:
// once a failover makes that node a replica, the client reads from it, and
// a READWRITE connection would answer those reads with MOVED.
func TestPipelineRestoresReadOnly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.SharedRedisCluster(t)
	name := "clusterpin-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	b := setup(t, cluster, &redis.ClusterOptions{ReadOnly: true, ClientName: name})
	key := "{restore}" + name
	require.NoError(t, b.stale.Set(ctx, key, "v", 0).Err())
	master, err := b.stale.MasterForKey(ctx, key)
	require.NoError(t, err)
	for range 5 {
		got, err := b.get(ctx, key)
		require.NoError(t, err)
		require.Equal(t, "v", got)
	}
	admin := redis.NewClient(&redis.Options{Addr: master.Options().Addr})
	t.Cleanup(func() { _ = admin.Close() })
	list, err := admin.ClientList(ctx).Result()
	require.NoError(t, err)
	conns := 0
	for _, line := range strings.Split(strings.TrimSpace(list), "\n") {
		if !strings.Contains(line, " name="+name+" ") {
			continue
		}
		conns++
		var flags string
		for _, field := range strings.Fields(line) {
			if v, ok := strings.CutPrefix(field, "flags="); ok {
				flags = v
			}
		}
		require.Contains(t, flags, "r", "a connection left READWRITE: %s", line)
	}
	require.NotZero(t, conns)
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

// TestIsRedirectRealReplies: the MOVED of a master that does not own the
// key and the ASK of its owner mid-migration, as a real Cluster sends them,
// bare and wrapped. Reconcile and leaderboard retry on these during a
// resharding; a check that missed ASK would make them fail instead.
func TestIsRedirectRealReplies(t *testing.T) {
	t.Parallel()
	cluster := testenv.StartRedisCluster(t, 3, 0)
	ctx := context.Background()
	client := cluster.Client(t)
	const key = "{is-redirect}x"
	require.NoError(t, client.Set(ctx, key, "v", 0).Err())
	owner, err := client.MasterForKey(ctx, key)
	require.NoError(t, err)

	var moved error
	for _, m := range testenv.Masters(t, client) {
		if m.Options().Addr != owner.Options().Addr {
			moved = m.Get(ctx, key).Err()
			break
		}
	}
	_, isMoved := redis.IsMovedError(moved)
	require.True(t, isMoved, "a MOVED reply expected, got %v", moved)
	require.True(t, IsRedirect(moved))
	require.True(t, IsRedirect(fmt.Errorf("wrapped: %w", moved)))

	cluster.MigrateKey(t, key)
	ask := owner.Get(ctx, key).Err()
	_, isAsk := redis.IsAskError(ask)
	require.True(t, isAsk, "an ASK reply expected, got %v", ask)
	require.True(t, IsRedirect(ask))
	require.True(t, IsRedirect(fmt.Errorf("wrapped: %w", ask)))
}

func TestNormalizeAddr(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"127.0.0.1:7000":  "127.0.0.1:7000",
		"::1:7000":        "[::1]:7000",
		"[::1]:7000":      "[::1]:7000",
		"fe80::1:2:7000":  "[fe80::1:2]:7000",
		"redis-0.svc:700": "redis-0.svc:700",
		"no-port":         "no-port",
	} {
		require.Equal(t, want, normalizeAddr(in), in)
	}
}

// TestOnMasterSentinel: for Sentinel with replica reads, go-redis builds a
// cluster client over servers that are not in cluster mode, which refuse
// READWRITE ("cluster support disabled"): a pinned read is sent without it,
// to the master.
func TestOnMasterSentinel(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := testenv.SharedRedisSentinel(t)
	client := redis.NewUniversalClient(&redis.UniversalOptions{
		MasterName:    testenv.SentinelMasterName,
		Addrs:         []string{s.SentinelAddr()},
		RouteRandomly: true,
	})
	t.Cleanup(func() { _ = client.Close() })
	cc := Client(client)
	require.NotNil(t, cc, "a replica-reading client is pinned")
	gets := countGets(cc)
	key := s.Prefix(t) + "pinned"
	require.NoError(t, client.Set(ctx, key, "v", 0).Err())
	for range 5 {
		var cmd *redis.StringCmd
		require.NoError(t, OnMaster(ctx, cc, key, func(p redis.Pipeliner) { cmd = p.Get(ctx, key) }))
		require.Equal(t, "v", cmd.Val())
	}
	// go-redis names Sentinel's nodes by port alone (":port").
	_, masterPort, err := net.SplitHostPort(s.MasterAddr())
	require.NoError(t, err)
	gets.mu.Lock()
	defer gets.mu.Unlock()
	for addr, n := range gets.counts {
		_, port, err := net.SplitHostPort(addr)
		require.NoError(t, err)
		require.Equal(t, masterPort, port, "%d pinned reads went to %s, not the master", n, addr)
	}
	require.Len(t, gets.counts, 1)
}

// TestOnMasterReloadsAfterMasterKilled kills the master of a key (SIGKILL)
// and promotes its replica behind the back of a replica-reading client
// whose periodic reload (ClusterStateReloadInterval, 60 s by default) is
// far off. go-redis reloads its slot map on redirects only, and a dead
// node sends none: the pinned read that meets the refused connection must
// ask for the reload itself, so that the reads after it reach the new
// master within seconds.
func TestOnMasterReloadsAfterMasterKilled(t *testing.T) {
	t.Parallel()
	// A lost host sends no reset either: a caller whose deadline is
	// shorter than ReadTimeout sees only that deadline, which must still
	// have the map reloaded, not wait for go-redis's periodic reload.
	for _, loss := range testenv.MasterLosses() {
		t.Run(loss.Name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			cluster := testenv.StartRedisCluster(t, 3, 1)
			cluster.WaitSlotReplicas(t, 30*time.Second)
			b := setup(t, cluster, &redis.ClusterOptions{ReadOnly: true, ReadTimeout: time.Second})
			key := "{killed}k"
			require.NoError(t, b.stale.Set(ctx, key, "v", 0).Err())
			_, replica := loss.Lose(cluster, t, key)
			get := func() (got string, err error) {
				err = loss.Call(ctx, func(ctx context.Context) error {
					got, err = b.get(ctx, key)
					return err
				})
				return got, err
			}

			// The read that meets the lost master fails with the
			// connection error or the caller's deadline (no hidden retry),
			// unless the map was reloaded before it was sent.
			if _, err := get(); err != nil {
				require.False(t, IsRedirect(err), "a connection error: %v", err)
			}

			start := time.Now()
			deadline := start.Add(10 * time.Second)
			for {
				got, err := get()
				if err == nil {
					require.Equal(t, "v", got)
					t.Logf("pinned reads reached the new master %s after the failover", time.Since(start))
					break
				}
				require.True(t, time.Now().Before(deadline),
					"pinned reads still fail %s after the failover: %v", time.Since(start), err)
				time.Sleep(50 * time.Millisecond)
			}
			named, err := b.stale.MasterForKey(ctx, key)
			require.NoError(t, err)
			require.Equal(t, replica, named.Options().Addr, "the client's map names the promoted replica")
			require.Positive(t, b.gets.count(replica), "the read was served by the new master")
		})
	}
}

// A pinned read that meets an ASK while another caller lists the masters
// for its own ASK, asking a frozen node (bounded only by that caller's
// ctx or ReadTimeout), gives up at its own deadline: it waited on a mutex
// for the other caller's listing, 1.4 s past a 50 ms deadline. A hook
// tells when the listing is stuck at the frozen node, whether and when the
// timed read met the ASK and when the listing returned, so that the verdict
// is an order of events a starved machine cannot turn around.
func TestOnMasterAskWaitEndsAtCallersDeadline(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 0)
	admin := cluster.Client(t)
	key := "{ask-wait}k"
	require.NoError(t, admin.Set(ctx, key, "v", 0).Err())
	src, err := admin.MasterForKey(ctx, key)
	require.NoError(t, err)
	dst := cluster.MigrateKey(t, key)
	frozen := slices.IndexFunc(cluster.Addrs(), func(a string) bool { return a != src.Options().Addr && a != dst })
	require.GreaterOrEqual(t, frozen, 0)

	// The listing asks one node at random for the slot map: try again
	// until it asked the frozen one (a third of the time).
	for trial := range 60 {
		cc := redis.NewClusterClient(&redis.ClusterOptions{
			Addrs: cluster.Addrs(), ReadOnly: true,
			ContextTimeoutEnabled: true, ReadTimeout: 1500 * time.Millisecond,
		})
		watch := &askWatch{frozen: cluster.Addrs()[frozen], stuck: make(chan struct{})}
		cc.OnNewNode(func(n *redis.Client) { n.AddHook(askWatchHook{watch, n.Options().Addr}) })
		_, err := cc.MasterForKey(ctx, key) // loads the slot map
		require.NoError(t, err)
		watch.armed.Store(true) // that load does not count
		get := func(ctx context.Context) error {
			return OnMaster(ctx, cc, key, func(p redis.Pipeliner) { p.Get(ctx, key) })
		}
		cluster.Freeze(frozen)
		first := make(chan struct{})
		go func() { _ = get(ctx); close(first) }()
		select {
		case <-first: // its listing asked a live node
			cluster.Thaw(frozen)
			_ = cc.Close()
			continue
		case <-watch.stuck: // its listing waits for the frozen node
		}
		watch.asked.Store(false)
		short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		start := time.Now()
		err = get(short)
		took := time.Since(start)
		returned := time.Now().UnixNano()
		cancel()
		cluster.Thaw(frozen)
		<-first
		_ = cc.Close()
		t.Logf("trial %d: a read with a 50 ms deadline took %s (met the ASK: %v): %v", trial, took, watch.asked.Load(), err)
		if !watch.asked.Load() {
			continue // its deadline ended before it met the ASK: not the case under test
		}
		ended := watch.listingEnded.Load()
		if ended != 0 && ended < watch.askedAt.Load() {
			continue // the listing was over before the read met the ASK: nothing to wait for
		}
		var netErr net.Error
		require.True(t, errors.Is(err, context.DeadlineExceeded) || errors.As(err, &netErr) && netErr.Timeout(), "the read's own deadline: %v", err)
		// By order, not by a timer: the stuck listing ends only at Thaw,
		// after the read; a read that waited for it returns after it.
		require.True(t, ended == 0 || ended > returned,
			"the read waited for another caller's listing of the masters: it returned %s after the listing ended", time.Duration(returned-ended))
		return
	}
	t.Fatal("no trial had a read meet the ASK while a listing asked the frozen node")
}

// askWatch records, for TestOnMasterAskWaitEndsAtCallersDeadline, when a
// node client sends CLUSTER SLOTS to the frozen node once armed (a
// listing of the masters stuck there), and whether a pinned read met an
// ASK.
type askWatch struct {
	frozen       string
	armed, asked atomic.Bool
	once         sync.Once
	stuck        chan struct{}
	// listingEnded and askedAt are when the stuck listing returned and
	// when the timed read met the ASK (Unix ns; 0 until then).
	listingEnded, askedAt atomic.Int64
}

type askWatchHook struct {
	*askWatch
	addr string
}

func (h askWatchHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h askWatchHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		stuck := false // the listing that got stuck first, not a later one
		if args := cmd.Args(); h.armed.Load() && h.addr == h.frozen && len(args) > 1 &&
			strings.EqualFold(cmd.Name(), "cluster") && strings.EqualFold(fmt.Sprint(args[1]), "slots") {
			h.once.Do(func() { close(h.stuck); stuck = true })
		}
		err := next(ctx, cmd)
		if stuck {
			h.listingEnded.Store(time.Now().UnixNano())
		}
		return err
	}
}

func (h askWatchHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		for _, c := range cmds {
			if _, ok := redis.IsAskError(c.Err()); ok && !h.asked.Load() {
				h.askedAt.Store(time.Now().UnixNano())
				h.asked.Store(true)
			}
		}
		return err
	}
}

func TestReloadIfUnreachable(t *testing.T) {
	t.Parallel()
	live := context.Background()
	ended, cancel := context.WithCancel(live)
	cancel()
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	reset := &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}
	for _, tc := range []struct {
		name   string
		ctx    context.Context
		err    error
		reload bool
	}{
		{"NoError", live, nil, false},
		{"Nil", live, redis.Nil, false},
		{"ServerError", live, errors.New("WRONGTYPE Operation against a key holding the wrong kind of value"), false},
		{"Refused", live, refused, true},
		{"Reset", live, reset, true},
		{"EOF", live, io.EOF, true},
		{"UnexpectedEOF", live, io.ErrUnexpectedEOF, true},
		{"TimeoutOfItsOwn", live, context.DeadlineExceeded, true},
		// The node's own answer, whenever ctx ended: go-redis may report
		// a frozen node's read timeout long after a short deadline.
		{"RefusedAfterCallersContextEnded", ended, refused, true},
		{"ReadTimeoutAfterCallersContextEnded", ended, &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}, true},
		{"CallersContextError", ended, context.Canceled, false},
		{"CallersDeadline", ended, context.DeadlineExceeded, true},
		{"DialCancelledByCaller", ended, &net.OpError{Op: "dial", Net: "tcp", Err: context.Canceled}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cc := redis.NewClusterClient(&redis.ClusterOptions{
				Addrs: []string{"127.0.0.1:1"}, // never dialled: the reload fails at once
				ClusterSlots: func(context.Context) ([]redis.ClusterSlot, error) {
					return nil, errors.New("no slots")
				},
			})
			t.Cleanup(func() { _ = cc.Close() })
			require.Equal(t, tc.reload, ReloadIfUnreachable(tc.ctx, cc, tc.err))
			single := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
			t.Cleanup(func() { _ = single.Close() })
			require.False(t, ReloadIfUnreachable(tc.ctx, single, tc.err), "not a cluster client")
		})
	}
}
