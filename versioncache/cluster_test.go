package versioncache

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// Every key of an id carries the hash tag {id}, so each script's declared
// keys (TestScriptsDeclareEveryKey checks that it touches no others) hash to
// one slot. This runs everything against a real 3-master cluster, with ids
// spread over many slots, to show each call lands on the node owning it.
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
			// The keys the Cache names, not what it should name them.
			slot := b.client.ClusterKeySlot(ctx, b.cache.versionKey(ids[i])).Val()
			for _, key := range []string{b.cache.currentKey(ids[i]), b.cache.atKey(ids[i]), b.cache.leaseKey(ids[i])} {
				require.Equal(t, slot, b.client.ClusterKeySlot(ctx, key).Val(), key)
			}
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
		require.EqualValues(t, 10, st.Invalidations)
		require.Zero(t, st.OrphanedValueKeys)
	})

	t.Run("FillLeaseStorm", func(t *testing.T) {
		t.Parallel()
		cluster := testenv.SharedRedisCluster(t)
		client, prefix := cluster.Client(t), cluster.Prefix(t)
		caches := make([]*Cache[product], 3)
		for i := range caches {
			cfg := stormConfig(Config{Prefix: prefix})
			c, err := New[product](client, &cfg)
			require.NoError(t, err)
			caches[i] = c
		}
		src := newTruth()
		var total int64
		for range 3 {
			loads := missStorm(t, caches, src, "hot{x}", 8)
			require.GreaterOrEqual(t, loads, int64(1))
			total += loads
		}
		require.LessOrEqual(t, total, int64(2*3), "about one load per storm")
		t.Logf("3 processes x 8 goroutines: %.2f loads per miss storm", float64(total)/3)
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

	// A client that reads from replicas must still send hits to the primary:
	// a replica may not yet have applied an Invalidate the primary acked.
	t.Run("ReplicaReadingClientHitsPrimary", func(t *testing.T) {
		t.Parallel()
		// A private cluster: the shared one may have lost its replicas to
		// other tests' failovers.
		cluster := testenv.StartRedisCluster(t, 3, 1)
		plain := cluster.Client(t)
		waitReplicasOnline(t, plain)
		cluster.WaitSlotReplicas(t, 20*time.Second)
		client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs(), ReadOnly: true})
		t.Cleanup(func() { _ = client.Close() })
		gets := &getsByNode{counts: map[string]int{}}
		client.OnNewNode(func(node *redis.Client) { node.AddHook(gets.hook(node.Options().Addr)) })
		// Peek's script goes as EVALSHA_RO (EVAL_RO), which go-redis
		// deems read-only and would send to a replica too.
		var mu sync.Mutex
		peeks := map[string]int{} // node address → read-only scripts
		client.OnNewNode(func(node *redis.Client) {
			addr := node.Options().Addr
			node.AddHook(testenv.CommandHook(func(name string) {
				if name == "evalsha_ro" || name == "eval_ro" {
					mu.Lock()
					defer mu.Unlock()
					peeks[addr]++
				}
			}))
		})
		b := setupWith(t, client, cluster.Prefix(t), nil)
		require.NotNil(t, b.cache.primary)
		master, err := client.MasterForKey(ctx, b.cache.currentKey("r"))
		require.NoError(t, err)
		before := gets.total()
		beforeMaster := gets.count(master.Options().Addr)
		for i := range 300 {
			want := b.truth.write("r", i)
			require.NoError(t, b.cache.Invalidate(ctx, "r"))
			got, err := b.cache.Get(ctx, "r", b.truth.loader("r"))
			require.NoError(t, err)
			require.Equal(t, want, got, "iteration %d", i)
			got, err = b.cache.Get(ctx, "r", b.truth.loader("r"))
			require.NoError(t, err)
			require.Equal(t, want, got, "hit, iteration %d", i)
			got, _, ok, err := b.cache.Peek(ctx, "r")
			require.NoError(t, err)
			require.True(t, ok)
			require.Equal(t, want, got, "Peek, iteration %d", i)
		}
		require.Equal(t, gets.total()-before, gets.count(master.Options().Addr)-beforeMaster,
			"every GET of the current key went to its primary")
		require.GreaterOrEqual(t, gets.total()-before, 600)
		mu.Lock()
		defer mu.Unlock()
		total := 0
		for _, n := range peeks {
			total += n
		}
		require.GreaterOrEqual(t, total, 300)
		require.Equal(t, total, peeks[master.Options().Addr], "every Peek ran on the primary: %v", peeks)
	})

	t.Run("ConcurrentVersionKeyLoss", func(t *testing.T) {
		t.Parallel()
		b := setupCluster(t, &Config{DisableFillLease: true})
		versionLossRace(t, b, time.Second)
	})
}

// waitReplicasOnline waits until every master has a replica (the clusters
// here have one per master) that finished its initial sync: a cluster
// reports healthy while replicas are still connecting or in wait_bgsave,
// and WAIT counts no replica until then.
func waitReplicasOnline(t *testing.T, client *redis.ClusterClient) {
	t.Helper()
	ctx := context.Background()
	require.Eventually(t, func() bool {
		err := client.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
			info, err := c.Info(ctx, "replication").Result()
			if err != nil {
				return err
			}
			if strings.Contains(info, "connected_slaves:0") || !strings.Contains(info, "state=online") {
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

// getsByNode counts GET commands per node address.
type getsByNode struct {
	mu     sync.Mutex
	counts map[string]int
}

func (g *getsByNode) hook(addr string) redis.Hook { return getCounter{g: g, addr: addr} }

func (g *getsByNode) count(addr string) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.counts[addr]
}

func (g *getsByNode) total() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	n := 0
	for _, c := range g.counts {
		n += c
	}
	return n
}

type getCounter struct {
	testenv.PassThroughHook
	g    *getsByNode
	addr string
}

func (h getCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "get" {
			h.g.mu.Lock()
			h.g.counts[h.addr]++
			h.g.mu.Unlock()
		}
		return next(ctx, cmd)
	}
}

// ProcessPipelineHook counts pipelined GETs too: hits pinned to a master
// are sent in a pipeline after READWRITE.
func (h getCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			if cmd.Name() == "get" {
				h.g.mu.Lock()
				h.g.counts[h.addr]++
				h.g.mu.Unlock()
			}
		}
		return next(ctx, cmds)
	}
}

// TestClusterInvalidateReplicasWaitsOnTheBumpsConnection has Invalidate
// with InvalidateReplicas bump an id whose master has lost its replica,
// while the other masters keep theirs. WAIT counts the replicas that
// acknowledged the writes of the connection it is sent on, so only on the
// connection that ran the bump does it count 0: sent anywhere else
// (another master, another connection), it counts replicas with nothing
// to acknowledge, and reports a bump that no replica holds as confirmed.
func TestClusterInvalidateReplicasWaitsOnTheBumpsConnection(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 1)
	client := cluster.Client(t)
	waitReplicasOnline(t, client)
	b := setupWith(t, client, cluster.Prefix(t), &Config{InvalidateReplicas: 1, InvalidateWaitTimeout: 50 * time.Millisecond})
	id := "unreplicated"
	master, err := client.MasterForKey(ctx, b.cache.versionKey(id))
	require.NoError(t, err)
	killed := 0
	for _, addr := range replicaAddrs(t, master) {
		i := slices.Index(cluster.Addrs(), addr)
		require.GreaterOrEqual(t, i, 0, "replica %s is a node of the cluster", addr)
		cluster.Kill(i)
		killed++
	}
	require.Positive(t, killed, "the master had a replica")
	require.Eventually(t, func() bool {
		info, err := master.Info(ctx, "replication").Result()
		return err == nil && strings.Contains(info, "connected_slaves:0")
	}, 10*time.Second, 10*time.Millisecond, "the master saw its replica go")

	// A WAIT sent elsewhere lands on another master (and counts its
	// replica) about two times in three: twenty calls all but rule that
	// out.
	for i := range 20 {
		err := b.cache.Invalidate(ctx, id)
		var rerr *ReplicationError
		require.ErrorAs(t, err, &rerr, "Invalidate %d: no replica has the bump", i)
		require.Zero(t, rerr.Got)
	}
	st := b.cache.Stats()
	require.EqualValues(t, 20, st.ReplicationErrors)
	require.Zero(t, st.Invalidations)
	version, err := client.Get(ctx, b.cache.versionKey(id)).Result()
	require.NoError(t, err)
	require.NotEmpty(t, version, "the master has the bumps")
}

// TestClusterNodesDisagree gives an id's slot away on its master only:
// that master answers MOVED to another, which still names the first as the
// owner and answers MOVED back, until someone assigns the slot on the other
// masters too. go-redis gives up after MaxRedirects; Invalidate then
// retries a few such redirects in a row (a migration's end looks like this
// for a moment), and fails with the redirect once they run out.
func TestClusterNodesDisagree(t *testing.T) {
	t.Parallel()
	cluster := testenv.StartRedisCluster(t, 3, 0)

	// giveAway has the master of id's keys assign their slot to another
	// master, without telling that one. It returns a func that assigns the
	// slot to that master on every master, as a repair would.
	giveAway := func(t *testing.T, b *testBundle, id string) (repair func()) {
		t.Helper()
		ctx := context.Background()
		client := cluster.Client(t)
		key := b.cache.versionKey(id)
		src, err := client.MasterForKey(ctx, key)
		require.NoError(t, err)
		masters := testenv.Masters(t, client)
		var dst *redis.Client
		for _, m := range masters {
			if m.Options().Addr != src.Options().Addr {
				dst = m
			}
		}
		require.NotNil(t, dst)
		dstID, err := dst.Do(ctx, "CLUSTER", "MYID").Text()
		require.NoError(t, err)
		require.NoError(t, src.Do(ctx, "CLUSTER", "SETSLOT", keySlot(key), "NODE", dstID).Err(), "the slot holds no keys")
		return func() {
			for _, m := range append([]*redis.Client{dst}, masters...) {
				require.NoError(t, m.Do(ctx, "CLUSTER", "SETSLOT", keySlot(key), "NODE", dstID).Err())
			}
		}
	}

	// Nobody repairs it: Invalidate fails with the redirect long before
	// its ctx ends, rather than wait for a repair that is not coming.
	t.Run("ForGood", func(t *testing.T) {
		t.Parallel()
		b := setupWith(t, cluster.Client(t), cluster.Prefix(t), nil)
		giveAway(t, b, "disputed")
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		err := b.cache.Invalidate(ctx, "disputed")
		require.ErrorIs(t, err, ErrRedis)
		require.ErrorContains(t, err, "MOVED")
		require.NotErrorIs(t, err, ErrSlotMigrating, "not retried until the ctx ended")
		require.NoError(t, ctx.Err())
		require.EqualValues(t, 1, b.cache.Stats().RedisErrors)
	})

	// The slot is assigned on every master as soon as go-redis has given
	// up on the redirects once: Invalidate's next try gets through.
	t.Run("UntilRepaired", func(t *testing.T) {
		t.Parallel()
		client := cluster.Client(t)
		b := setupWith(t, client, cluster.Prefix(t), nil)
		id := "repaired"
		require.NotEqual(t, keySlot(b.cache.versionKey("disputed")), keySlot(b.cache.versionKey(id)))
		repair := giveAway(t, b, id)
		var moved atomic.Int32
		client.AddHook(afterMoved{once: new(sync.Once), moved: &moved, fn: repair})
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, b.cache.Invalidate(ctx, id))
		require.EqualValues(t, 1, moved.Load(), "go-redis ran out of redirects once")
		require.Zero(t, b.cache.Stats().RedisErrors)
		version, err := client.Get(ctx, b.cache.versionKey(id)).Int64()
		require.NoError(t, err, "the bump landed")
		require.Positive(t, version)
	})
}

// afterMoved calls fn once, when a command its cluster client sent failed
// with a MOVED reply after go-redis's own redirects, and counts such
// failures in moved.
type afterMoved struct {
	testenv.PassThroughHook
	once  *sync.Once
	moved *atomic.Int32
	fn    func()
}

func (h afterMoved) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if _, ok := redis.IsMovedError(err); ok {
			h.moved.Add(1)
			h.once.Do(h.fn)
		}
		return err
	}
}

// TestClusterSlotMove moves an id's slot to another master behind the back
// of a replica-reading client. Hits and Invalidate's bump-and-WAIT run on
// the master's own connection, which answers MOVED and does not follow it:
// the Cache must follow it, as the cluster client would, instead of failing
// until go-redis reloads its slot map on its own.
func TestClusterSlotMove(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 1)
	waitReplicasOnline(t, cluster.Client(t))
	cfg := &Config{InvalidateReplicas: 1, InvalidateWaitTimeout: time.Second}
	prefix := cluster.Prefix(t)
	// stale loads its slot map now, before any move.
	stale := setupWith(t, cluster.ReadOnlyClient(t), prefix, cfg)
	require.NotNil(t, stale.cache.primary)
	require.NoError(t, stale.client.Ping(ctx).Err())

	t.Run("Hit", func(t *testing.T) {
		t.Parallel()
		id := "hit-after-move"
		cluster.ReassignSlot(t, stale.cache.currentKey(id)) // the slot is empty
		fresh := setupWith(t, cluster.ReadOnlyClient(t), prefix, cfg)
		stale.truth.write(id, 7)
		want, err := fresh.cache.Get(ctx, id, stale.truth.loader(id))
		require.NoError(t, err)

		before := stale.cache.Stats()
		require.Equal(t, want, stale.hit(t, id))
		after := stale.cache.Stats()
		require.Equal(t, before.Hits+1, after.Hits)
		require.Equal(t, before.RedisErrors, after.RedisErrors)
	})

	t.Run("Invalidate", func(t *testing.T) {
		t.Parallel()
		id := "invalidate-after-move"
		cluster.ReassignSlot(t, stale.cache.versionKey(id))
		require.NoError(t, stale.cache.Invalidate(ctx, id))
		// A client that reads on masters and follows redirects.
		version, err := cluster.Client(t).Get(ctx, stale.cache.versionKey(id)).Int64()
		require.NoError(t, err, "the bump landed on the new master")
		require.Positive(t, version)
	})
}

// TestClusterFailover fails an id's master over to its replica behind the
// back of a replica-reading client, whose connections all open with
// READONLY: the demoted master, still named by the client's slot map, must
// not serve the hit as a replica (it may lag an Invalidate the new master
// acknowledged); the hit is answered by the new master.
func TestClusterFailover(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 1)
	waitReplicasOnline(t, cluster.Client(t))
	client := cluster.ReadOnlyClient(t)
	gets := &getsByNode{counts: map[string]int{}}
	client.OnNewNode(func(node *redis.Client) { node.AddHook(gets.hook(node.Options().Addr)) })
	b := setupWith(t, client, cluster.Prefix(t), nil)
	id := "failed-over"
	b.truth.write(id, 3)
	want, err := b.cache.Get(ctx, id, b.truth.loader(id))
	require.NoError(t, err)

	oldMaster, newMaster := cluster.Failover(t, b.cache.currentKey(id))
	named, err := client.MasterForKey(ctx, b.cache.currentKey(id))
	require.NoError(t, err)
	require.Equal(t, oldMaster, named.Options().Addr, "the client's map has not caught up")

	before := b.cache.Stats()
	require.Equal(t, want, b.hit(t, id))
	require.Equal(t, before.Hits+1, b.cache.Stats().Hits)
	require.Equal(t, 1, gets.count(newMaster), "the hit was read on the new master")
}

// TestClusterFailoverPeek fails an id's master over behind the back of a
// replica-reading client: Peek (and a miss's read script, which may return
// the current value) runs on the new master, not on the demoted one.
func TestClusterFailoverPeek(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 1)
	waitReplicasOnline(t, cluster.Client(t))
	client := cluster.ReadOnlyClient(t)
	var mu sync.Mutex
	scripts := map[string]int{} // node address → script calls
	client.OnNewNode(func(node *redis.Client) {
		addr := node.Options().Addr
		node.AddHook(testenv.CommandHook(func(name string) {
			if name == "evalsha" || name == "eval" || name == "evalsha_ro" || name == "eval_ro" {
				mu.Lock()
				defer mu.Unlock()
				scripts[addr]++
			}
		}))
	})
	b := setupWith(t, client, cluster.Prefix(t), nil)
	id := "peeked"
	b.truth.write(id, 5)
	want, err := b.cache.Get(ctx, id, b.truth.loader(id))
	require.NoError(t, err)

	_, newMaster := cluster.Failover(t, b.cache.currentKey(id))
	got, _, ok, err := b.cache.Peek(ctx, id)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, want, got)
	mu.Lock()
	defer mu.Unlock()
	require.Positive(t, scripts[newMaster], "Peek's script ran on the new master")
}

// hit gets id from b's cache with a loader that fails the test: the value
// must be a hit.
func (b *testBundle) hit(t *testing.T, id string) product {
	t.Helper()
	got, err := b.cache.Get(context.Background(), id, func(context.Context) (product, error) {
		t.Error("a hit must not load")
		return product{}, nil
	})
	require.NoError(t, err)
	return got
}

// TestClusterMasterKilled kills an id's master (SIGKILL) and promotes its
// replica behind the back of a plain cluster client whose periodic reload
// (ClusterStateReloadInterval, 60 s by default) is far off. go-redis
// reloads its slot map on redirects only, and a dead node sends none: an
// Invalidate that meets the refused connection has the map reloaded, so
// that the ones after it reach the new master within seconds.
func TestClusterMasterKilled(t *testing.T) {
	t.Parallel()
	// A lost host sends no reset either: a caller whose deadline is
	// shorter than ReadTimeout sees only that deadline, which must still
	// have the map reloaded, for reads (Peek) and Invalidate alike: each
	// through a client of its own, so that one's reload cannot serve the
	// other.
	for _, loss := range testenv.MasterLosses() {
		t.Run(loss.Name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			cluster := testenv.StartRedisCluster(t, 3, 1)
			waitReplicasOnline(t, cluster.Client(t))
			prefix := cluster.Prefix(t)
			newCache := func() *testBundle {
				client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs(), ReadTimeout: time.Second})
				t.Cleanup(func() { _ = client.Close() })
				return setupWith(t, client, prefix, nil)
			}
			b, invalidator := newCache(), newCache()
			id := "master-killed"
			b.truth.write(id, 1)
			_, err := b.cache.Get(ctx, id, b.truth.loader(id))
			require.NoError(t, err)
			_, _, _, err = invalidator.cache.Peek(ctx, id) // loads its slot map
			require.NoError(t, err)
			loss.Lose(cluster, t, b.cache.versionKey(id))
			start := time.Now()
			retry := func(what string, call func(ctx context.Context) error) {
				t.Helper()
				for {
					err := loss.Call(ctx, call)
					if err == nil {
						t.Logf("%s reached the new master %s after the failover", what, time.Since(start))
						return
					}
					require.Less(t, time.Since(start), 10*time.Second, "%s still fails: %v", what, err)
					time.Sleep(50 * time.Millisecond)
				}
			}

			retry("Peek", func(ctx context.Context) error {
				_, _, _, err := b.cache.Peek(ctx, id)
				return err
			})
			b.truth.write(id, 2)
			retry("Invalidate", func(ctx context.Context) error { return invalidator.cache.Invalidate(ctx, id) })
			got, err := b.cache.Get(ctx, id, b.truth.loader(id))
			require.NoError(t, err)
			require.Equal(t, b.truth.read(id), got)
		})
	}
}
