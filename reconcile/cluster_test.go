package reconcile

import (
	"context"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
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

// TestRingDocuments checks documents on a Ring of two servers, 100 pairs of
// them sharing a Cluster slot under different hash tags: the reconciler
// must read (and repair) each on the shard the gate wrote it to, not send a
// slot's documents to the shard of the first one. The documents' orphan
// scan cannot cover a Ring, so New refuses one without SkipOrphans rather
// than let every full run fail after its whole pass.
func TestRingDocuments(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s1, s2 := testenv.StartRedis(t), testenv.StartRedis(t)
	ring := redis.NewRing(&redis.RingOptions{
		Addrs:       map[string]string{"a": s1.Addr(), "b": s2.Addr()},
		HeartbeatFn: func(context.Context, *redis.Client) bool { return true }, // as package projection documents
	})
	t.Cleanup(func() { _ = ring.Close() })
	b := setupWith(t, projection.KindDocument, ring, "ring-docs:")
	firstOfSlot := map[int]string{}
	var rows []Row
	for i := 0; len(rows) < 200; i++ {
		id := fmt.Sprintf("user-%d", i)
		slot := b.ks.Slot(b.target.target(id))
		switch other, seen := firstOfSlot[slot]; {
		case !seen:
			firstOfSlot[slot] = id
		case other != "":
			rows = append(rows, b.insert(t, other, 1), b.insert(t, id, 1))
			firstOfSlot[slot] = ""
		}
	}
	b.projectRows(t, rows[:180])
	require.NotZero(t, s1.Client(t).DBSize(ctx).Val())
	require.NotZero(t, s2.Client(t).DBSize(ctx).Val())

	_, err := New(b.source, b.target, nil)
	require.ErrorIs(t, err, ErrInvalidConfig)
	var cfgErr *ConfigError
	require.ErrorAs(t, err, &cfgErr)
	require.Equal(t, "Config.SkipOrphans", cfgErr.Field)
	require.Contains(t, cfgErr.Reason, "*redis.Ring")

	r := b.reconciler(t, &Config{SkipOrphans: true})
	rep, err := r.Run(ctx, RunOptions{})
	require.NoError(t, err)
	require.Equal(t, map[Class]int64{ClassCurrent: 180, ClassMissing: 20}, rep.Counts)
	require.EqualValues(t, 20, rep.Repaired)
	rep, err = r.Run(ctx, RunOptions{DryRun: true})
	require.NoError(t, err)
	require.Equal(t, map[Class]int64{ClassCurrent: 200}, rep.Counts)
}

// TestClusterReplicaReads reconciles through a cluster client that sends
// read-only commands to replicas. A replica's replication lag would show
// as drift, so every read of the reconciler must still reach a master.
func TestClusterReplicaReads(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.SharedRedisCluster(t)
	masters := map[string]bool{}
	for _, m := range testenv.Masters(t, cluster.Client(t)) {
		masters[m.Options().Addr] = true
	}
	var mu sync.Mutex
	client := cluster.ReadOnlyClient(t)
	offMaster := map[string]int{} // read command → count sent to a replica
	reads := 0
	client.OnNewNode(func(node *redis.Client) {
		addr := node.Options().Addr
		node.AddHook(testenv.CommandHook(func(name string) {
			switch name {
			case "zmscore", "hmget", "mget", "exists", "hlen", "zcard", "hscan", "zscan", "hrandfield", "scan":
				mu.Lock()
				defer mu.Unlock()
				reads++
				if !masters[addr] {
					offMaster[name]++
				}
			}
		}))
	})
	for _, kind := range allKinds {
		b := setupWith(t, kind, client, cluster.Prefix(t)+kindName(kind))
		rows := b.insertMany(t, 60)
		b.projectRows(t, rows[:50])
		b.project(t, "orphan", 1)
		r := b.reconciler(t, &Config{PageSize: 16})
		rep, err := r.Run(ctx, RunOptions{})
		require.NoError(t, err, kindName(kind))
		require.Equal(t, map[Class]int64{ClassCurrent: 50, ClassMissing: 10, ClassOrphan: 1}, rep.Counts, kindName(kind))
		_, err = r.Run(ctx, RunOptions{Sample: 10})
		require.NoError(t, err, kindName(kind))
	}
	mu.Lock()
	defer mu.Unlock()
	require.NotZero(t, reads)
	require.Empty(t, offMaster, "reads sent to replicas")
}

// TestClusterSlotMoveDuringReplicaReads moves a slot of the projection to
// another master behind the back of a replica-reading cluster client: a
// collection's slot, or one document's. The reconciler reads on the master
// it knows, whose connection answers MOVED and does not follow it: the run
// must still complete (Run waits for the reloaded slot map to name the new
// master and runs again), with every read still on a master, and not fail
// until the client's periodic reload.
func TestClusterSlotMoveDuringReplicaReads(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 1)
	masters := map[string]bool{}
	for _, m := range testenv.Masters(t, cluster.Client(t)) {
		masters[m.Options().Addr] = true
	}
	client := cluster.ReadOnlyClient(t)
	var mu sync.Mutex
	offMaster := 0
	client.OnNewNode(func(node *redis.Client) {
		addr := node.Options().Addr
		node.AddHook(testenv.CommandHook(func(name string) {
			switch name {
			case "zmscore", "hmget", "mget", "exists", "hlen", "zcard", "hscan", "zscan", "scan":
				mu.Lock()
				defer mu.Unlock()
				if !masters[addr] {
					offMaster++
				}
			}
		}))
	})
	for _, kind := range allKinds {
		t.Run(kindName(kind), func(t *testing.T) {
			prefix := "slot-move-" + kindName(kind) + ":"
			b, rows, r, rep := projectedAndLoaded(t, kind, client, prefix)
			require.Equal(t, map[Class]int64{ClassCurrent: 30}, rep.Counts)

			// Reassign the slot to another master, whose copy is empty
			// (Redis refuses to reassign a slot whose keys are still there,
			// so they are deleted first): the collection, or one document.
			moved := b.target.target(rows[0].Key)
			if kind != projection.KindDocument {
				moved = b.target.target("")
			}
			src, err := client.MasterForKey(ctx, b.ks.ValueKey(moved))
			require.NoError(t, err)
			want := map[Class]int64{ClassMissing: 30}
			if kind == projection.KindDocument {
				require.NoError(t, src.Del(ctx, b.ks.ValueKey(moved), b.ks.VersionKey(moved)).Err())
				want = map[Class]int64{ClassCurrent: 29, ClassMissing: 1}
			} else {
				require.NoError(t, testenv.DeletePrefix(ctx, src, prefix))
			}
			cluster.ReassignSlot(t, b.ks.ValueKey(moved))
			mu.Lock()
			offMaster = 0
			mu.Unlock()

			rep, err = r.Run(ctx, RunOptions{DryRun: true})
			require.NoError(t, err, "a run pinned to the old master after the slot moved")
			require.Equal(t, want, rep.Counts, "read on the new master")
			mu.Lock()
			defer mu.Unlock()
			require.Zero(t, offMaster, "reads sent to replicas")
		})
	}
	// A Rebuild whose first step meets the move reads the collection's
	// layout on the new master too.
	for _, kind := range []projection.Kind{projection.KindSortedSet, projection.KindHash} {
		t.Run("Rebuild"+kindName(kind), func(t *testing.T) {
			prefix := "slot-move-rebuild-" + kindName(kind) + ":"
			b, _, r, _ := projectedAndLoaded(t, kind, client, prefix)
			collection := b.ks.ValueKey(b.target.target(""))
			src, err := client.MasterForKey(ctx, collection)
			require.NoError(t, err)
			// Every collection here shares the slot of its name: earlier
			// subtests' keys go too.
			require.NoError(t, testenv.DeletePrefix(ctx, src, "slot-move-"))
			cluster.ReassignSlot(t, collection)

			rebuilt, err := r.Rebuild(ctx)
			require.NoError(t, err, "a rebuild pinned to the old master after the slot moved")
			require.True(t, rebuilt.Switched)
			require.EqualValues(t, 30, rebuilt.Applied)
			rep, err := r.Run(ctx, RunOptions{DryRun: true})
			require.NoError(t, err)
			require.Equal(t, map[Class]int64{ClassCurrent: 30}, rep.Counts, "rebuilt on the new master")
		})
	}
	// Repairs written before the run met the move are in its report,
	// although the pass run again finds their documents current.
	t.Run("RepairsBeforeTheMove", func(t *testing.T) {
		b, rows, _, _ := projectedAndLoaded(t, projection.KindDocument, client, "slot-move-repairs:")
		r := b.reconciler(t, &Config{PageSize: 10, ReadAhead: 1})
		first := b.target.target(rows[0].Key) // page 1: missing, repaired
		require.NoError(t, client.Del(ctx, b.ks.ValueKey(first), b.ks.VersionKey(first)).Err())
		moved := b.target.target(rows[25].Key) // page 3: its slot moves
		// The earlier subtests' documents of the same ids share the slot.
		reassignEmptied(t, cluster, client, b.ks.ValueKey(moved))

		rep, err := r.Run(ctx, RunOptions{})
		require.NoError(t, err)
		require.Equal(t, map[Class]int64{ClassCurrent: 28, ClassMissing: 2}, rep.Counts)
		require.EqualValues(t, 2, rep.Repaired)
		require.Equal(t, map[Class]int64{ClassMissing: 2}, rep.RepairedByClass)
		require.Equal(t, map[Result]int64{ResultRepaired: 2}, rep.Results)
		var keys []string
		for _, f := range rep.Examples[ClassMissing] {
			keys = append(keys, f.Key)
		}
		require.Equal(t, []string{rows[0].Key, rows[25].Key}, keys)

		rep, err = r.Run(ctx, RunOptions{DryRun: true})
		require.NoError(t, err)
		require.Equal(t, map[Class]int64{ClassCurrent: 30}, rep.Counts)
	})
}

// TestClusterFailoverDuringReplicaReads fails the collection's master over
// to its replica behind the back of a replica-reading client, whose
// connections all open with READONLY: the demoted master, still named by
// the client's slot map, must not serve the run's reads as a replica (its
// lag would show as drift, or hide it); they reach the new master.
func TestClusterFailoverDuringReplicaReads(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 1)
	client := cluster.ReadOnlyClient(t)
	var mu sync.Mutex
	reads := map[string]int{} // node address → reads of the collection
	client.OnNewNode(func(node *redis.Client) {
		addr := node.Options().Addr
		node.AddHook(testenv.CommandHook(func(name string) {
			switch name {
			case "zmscore", "hmget", "mget", "exists", "hlen", "zcard", "zscan", "hscan":
				mu.Lock()
				defer mu.Unlock()
				reads[addr]++
			}
		}))
	})
	b, _, r, rep := projectedAndLoaded(t, projection.KindSortedSet, client, "failover:")
	require.Equal(t, map[Class]int64{ClassCurrent: 30}, rep.Counts)

	collection := b.ks.ValueKey(b.target.target(""))
	oldMaster, newMaster := cluster.Failover(t, collection)
	named, err := client.MasterForKey(ctx, collection)
	require.NoError(t, err)
	require.Equal(t, oldMaster, named.Options().Addr, "the client's map has not caught up")
	mu.Lock()
	before := reads[newMaster]
	mu.Unlock()

	rep, err = r.Run(ctx, RunOptions{DryRun: true})
	require.NoError(t, err)
	require.Equal(t, map[Class]int64{ClassCurrent: 30}, rep.Counts)
	mu.Lock()
	defer mu.Unlock()
	require.Greater(t, reads[newMaster], before, "the run read on the new master")
}

// TestClusterSlotMoveRenamedNodes reaches the cluster under a host name
// while its nodes announce 127.0.0.1, so go-redis names every node by that
// host (it replaces loopback addresses) while MOVED replies carry
// 127.0.0.1: a run meeting a move must still find the new master.
func TestClusterSlotMoveRenamedNodes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 1)
	const host = "verity-renamed.invalid"
	var addrs []string
	for _, a := range cluster.Addrs() {
		_, port, err := net.SplitHostPort(a)
		require.NoError(t, err)
		addrs = append(addrs, net.JoinHostPort(host, port))
	}
	cluster.WaitSlotReplicas(t, 30*time.Second)
	client := redis.NewClusterClient(&redis.ClusterOptions{
		Addrs:    addrs,
		ReadOnly: true,
		Dialer: func(ctx context.Context, network, addr string) (net.Conn, error) {
			_, port, err := net.SplitHostPort(addr)
			if err != nil {
				return nil, err
			}
			var d net.Dialer
			return d.DialContext(ctx, network, net.JoinHostPort("127.0.0.1", port))
		},
	})
	t.Cleanup(func() { _ = client.Close() })
	b, _, r, _ := projectedAndLoaded(t, projection.KindSortedSet, client, "renamed:")
	collection := b.ks.ValueKey(b.target.target(""))
	src, err := client.MasterForKey(ctx, collection)
	require.NoError(t, err)
	require.Contains(t, src.Options().Addr, host, "go-redis names the nodes by the host it was given")
	require.NoError(t, testenv.DeletePrefix(ctx, src, "renamed:"))
	cluster.ReassignSlot(t, collection)

	rep, err := r.Run(ctx, RunOptions{DryRun: true})
	require.NoError(t, err, "a run meeting MOVED 127.0.0.1:… with nodes named by host")
	require.Equal(t, map[Class]int64{ClassMissing: 30}, rep.Counts, "read on the new master")
}

// projectedAndLoaded sets up a bundle of kind under prefix on client with
// 30 rows projected, and a reconciler whose dry run (rep) has loaded the
// client's slot map.
func projectedAndLoaded(t *testing.T, kind projection.Kind, client redis.UniversalClient, prefix string) (*testBundle, []Row, *Reconciler, *Report) {
	t.Helper()
	b := setupWith(t, kind, client, prefix)
	rows := b.insertMany(t, 30)
	b.projectRows(t, rows)
	r := b.reconciler(t, nil)
	rep, err := r.Run(context.Background(), RunOptions{DryRun: true})
	require.NoError(t, err)
	return b, rows, r, rep
}

// startSlotMigration puts the slot of key into MIGRATING (source) and
// IMPORTING (destination) state, as redis-cli --cluster reshard does before
// it moves the slot's keys, without moving any key yet. The migration it
// returns moves them.
func startSlotMigration(t *testing.T, client *redis.ClusterClient, key string) *testenv.SlotMigration {
	t.Helper()
	ctx := context.Background()
	slot, err := client.ClusterKeySlot(ctx, key).Result()
	require.NoError(t, err)
	source, err := client.MasterForKey(ctx, key)
	require.NoError(t, err)
	return testenv.StartSlotMigration(t, client, int(slot), source)
}

// beforeSwitch runs fn once, just before the first rebuild "switch" script
// is sent.
type beforeSwitch struct {
	testenv.PassThroughHook
	once sync.Once
	fn   func()
}

func (h *beforeSwitch) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		name := cmd.Name()
		if name == "evalsha" || name == "eval" {
			for _, a := range cmd.Args() {
				if s, ok := a.(string); ok && s == "switch" {
					h.once.Do(h.fn)
				}
			}
		}
		return next(ctx, cmd)
	}
}

// TestRebuildSwitchDuringSlotMigration: a switch that meets the
// collection's slot MIGRATING (resharding begun, no key moved) while every
// key it uses exists (a rebuild switched moments ago, so its switched key
// is there) must not run halfway: Redis checks each command of a script on
// a migrating slot and stops it at the first key that is not on the node,
// which, after the switch deleted the live keys, left readers an empty
// board. The probe key makes Redis refuse the step before it runs.
func TestRebuildSwitchDuringSlotMigration(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 0)
	client := cluster.Client(t)
	b, _, r, rep := projectedAndLoaded(t, projection.KindSortedSet, client, "mig:")
	require.Equal(t, map[Class]int64{ClassCurrent: 30}, rep.Counts)
	rb, err := r.Rebuild(ctx)
	require.NoError(t, err)
	require.True(t, rb.Switched)

	valueKey := b.ks.ValueKey(b.target.target(""))
	client.AddHook(&beforeSwitch{fn: func() { startSlotMigration(t, client, valueKey) }})
	rb, err = r.Rebuild(ctx)
	require.Error(t, err, "the switch cannot run on a migrating slot")
	require.False(t, rb.Switched)
	n, err := client.ZCard(ctx, valueKey).Result() // follows ASK, as a reader's would
	require.NoError(t, err)
	require.EqualValues(t, 30, n, "the live projection is whole")
}

// TestClusterWrongTypeCheckOnMasters: the type check that refuses a gate
// repair of a document whose version key holds another type reads on the
// masters, which answered WRONGTYPE, not on a replica that may lag.
func TestClusterWrongTypeCheckOnMasters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.SharedRedisCluster(t)
	masters := map[string]bool{}
	for _, m := range testenv.Masters(t, cluster.Client(t)) {
		masters[m.Options().Addr] = true
	}
	var mu sync.Mutex
	offMaster := map[string]int{}
	client := cluster.ReadOnlyClient(t)
	client.OnNewNode(func(node *redis.Client) {
		addr := node.Options().Addr
		node.AddHook(testenv.CommandHook(func(name string) {
			if name == "type" {
				mu.Lock()
				defer mu.Unlock()
				if !masters[addr] {
					offMaster[name]++
				}
			}
		}))
	})
	b := setupWith(t, projection.KindDocument, client, cluster.Prefix(t))
	for _, k := range []string{"a", "b", "c", "d"} {
		b.insert(t, k, 1)
	}
	require.NoError(t, client.HSet(ctx, b.ks.VersionKey(b.target.target("c")), "f", "1").Err())
	r := b.reconciler(t, &Config{SkipOrphans: true})
	rep, err := r.Run(ctx, RunOptions{})
	t.Logf("report %v, err %v", rep, err)
	require.ErrorIs(t, err, projection.ErrWrongKeyType)
	mu.Lock()
	defer mu.Unlock()
	require.Empty(t, offMaster, "TYPE checks sent to replicas")
	require.EqualValues(t, 1, rep.Results[ResultNotAttempted], "c alone is refused")
}

// TestClusterMasterKilled kills the master serving a collection's slot
// (SIGKILL) and promotes its replica behind the back of a plain cluster
// client, whose slot map go-redis reloads on redirects and periodically
// only (here: not within the test). A dead node sends no redirect: a run,
// a CheckKeys and a Rebuild that fail because they cannot reach it must
// have the map reloaded, so that the next one reaches the promoted replica
// within seconds rather than after the periodic reload (60 s by default).
// So must a master lost without a reset, met by callers whose deadline is
// shorter than the client's ReadTimeout.
func TestClusterMasterKilled(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("starts a private Redis Cluster and kills its masters")
	}
	cluster := testenv.StartRedisCluster(t, 3, 1)
	for _, c := range []struct {
		name string
		run  func(ctx context.Context, r *Reconciler, rows []Row) error
	}{
		{"Run", func(ctx context.Context, r *Reconciler, _ []Row) error {
			rep, err := r.Run(ctx, RunOptions{DryRun: true})
			if err == nil {
				require.Equal(t, map[Class]int64{ClassCurrent: 30}, rep.Counts)
			}
			return err
		}},
		{"CheckKeys", func(ctx context.Context, r *Reconciler, rows []Row) error {
			rep, err := r.CheckKeys(ctx, []string{rows[0].Key, rows[1].Key}, RunOptions{DryRun: true})
			if err == nil {
				require.Equal(t, map[Class]int64{ClassCurrent: 2}, rep.Counts)
			}
			return err
		}},
		{"Rebuild", func(ctx context.Context, r *Reconciler, _ []Row) error {
			rep, err := r.Rebuild(ctx)
			if err == nil {
				require.EqualValues(t, 30, rep.Rows)
				require.True(t, rep.Switched)
			}
			return err
		}},
	} {
		// A lost host sends no reset: a caller whose deadline (1 s here)
		// is shorter than ReadTimeout sees only that deadline, which must
		// have the map reloaded too.
		for _, loss := range testenv.MasterLosses() {
			if loss.Timeout != 0 {
				loss.Timeout = time.Second
			}
			t.Run(c.name+"/"+loss.Name, func(t *testing.T) {
				client := redis.NewClusterClient(&redis.ClusterOptions{
					Addrs:                      cluster.Addrs(),
					ClusterStateReloadInterval: time.Hour,
					ReadTimeout:                2 * time.Second,
				})
				t.Cleanup(func() { _ = client.Close() })
				b, rows, r, _ := projectedAndLoaded(t, projection.KindSortedSet, client, "killed-"+c.name+"-"+loss.Name+":")
				collection := b.ks.ValueKey(b.target.target(""))
				failing := cluster.LoseMasterAndRetry(t, loss, collection, 30*time.Second, func(ctx context.Context) error { return c.run(ctx, r, rows) })
				t.Logf("%s reached the promoted replica %s after the loss", c.name, failing)
			})
		}
	}
}

// reassignEmptied deletes every key of key's slot on its master (Redis
// reassigns only an empty slot; key must be among them) and moves the slot
// to another master behind the client's back. It returns the slot.
func reassignEmptied(t *testing.T, cluster *testenv.RedisCluster, client *redis.ClusterClient, key string) int64 {
	t.Helper()
	ctx := context.Background()
	src, err := client.MasterForKey(ctx, key)
	require.NoError(t, err)
	slot, err := src.ClusterKeySlot(ctx, key).Result()
	require.NoError(t, err)
	inSlot, err := src.ClusterGetKeysInSlot(ctx, int(slot), 1000).Result()
	require.NoError(t, err)
	require.Contains(t, inSlot, key)
	require.NoError(t, src.Del(ctx, inSlot...).Err())
	cluster.ReassignSlot(t, key)
	return slot
}
