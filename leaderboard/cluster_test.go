package leaderboard

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
	"github.com/verity-go/verity/reconcile"
)

// TestRedisCluster runs the Redis side of the board — worker, reads with
// scripts and transactions, reconciler — on a real Redis Cluster, with
// several boards whose keys land in different slots.
func TestRedisCluster(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.SharedRedisCluster(t)
	pg := testenv.Postgres(t)
	client := cluster.Client(t)
	prefix := cluster.Prefix(t)
	require.NoError(t, Migrate(ctx, pg.Pool, &Config{Schema: pg.Schema}))

	for _, c := range []struct {
		name    string
		buckets int
	}{{"weekly-2026-48", 0}, {"season {7}: finals", 4}, {"daily", 0}} {
		board, err := New(pg.Pool, client, &Config{Name: c.name, Schema: pg.Schema, KeyPrefix: prefix, VersionBuckets: c.buckets})
		require.NoError(t, err)
		tb := &testBundle{board: board, pg: pg}
		var atLeast []ReadOption // every user's version: keys in every bucket
		for i, u := range tieUsers {
			res := tb.submit(t, u, int64(i%3*10))
			atLeast = append(atLeast, AtLeast(u, res.Version))
		}
		tb.drain(t)

		all, src := allPages(t, board, 4, WithPolicy(ServeStale))
		require.Equal(t, SourceRedis, src)
		auth, err := board.Authoritative(ctx, MaxPageSize)
		require.NoError(t, err)
		require.Equal(t, auth, all)
		for _, e := range auth[:3] {
			got, _, err := board.Rank(ctx, e.UserID, WithPolicy(ServeStale))
			require.NoError(t, err)
			require.Equal(t, e, got)
			around, err := board.Around(ctx, e.UserID, 1, WithPolicy(ServeStale))
			require.NoError(t, err)
			require.Contains(t, around.Entries, e)
		}
		// Reads with AtLeast read the versions in their answer's script.
		failClosed := append(atLeast, WithPolicy(FailClosed))
		top, err := board.Top(ctx, 4, failClosed...)
		require.NoError(t, err)
		require.Equal(t, SourceRedis, top.Freshness.Source)
		require.True(t, top.Freshness.AtLeastMet)
		require.Equal(t, auth[:4], top.Entries)
		page, err := board.Page(ctx, top.Next, 4, failClosed...)
		require.NoError(t, err)
		require.True(t, page.Freshness.AtLeastMet)
		require.Equal(t, auth[4:8], page.Entries)
		got, fr, err := board.Rank(ctx, auth[5].UserID, failClosed...)
		require.NoError(t, err)
		require.True(t, fr.AtLeastMet)
		require.Equal(t, auth[5], got)
		around, err := board.Around(ctx, auth[5].UserID, 1, failClosed...)
		require.NoError(t, err)
		require.True(t, around.Freshness.AtLeastMet)
		require.Equal(t, auth[4:7], around.Entries)

		rec, err := board.Reconciler(nil)
		require.NoError(t, err)
		report, err := rec.Run(ctx, reconcile.RunOptions{})
		require.NoError(t, err)
		require.Equal(t, int64(len(tieUsers)), report.Counts[reconcile.ClassCurrent])
	}
}

// TestRedisClusterReplicaReads uses a cluster client that sends read-only
// commands to replicas. Freshness measures the projection's lag on the
// masters only, so every read of the board must still reach the master
// that owns its key.
func TestRedisClusterReplicaReads(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.SharedRedisCluster(t)
	client := cluster.ReadOnlyClient(t)
	var mu sync.Mutex
	reads := map[string]int{} // node address → read-only commands of the board
	client.OnNewNode(func(node *redis.Client) {
		addr := node.Options().Addr
		node.AddHook(testenv.CommandHook(func(name string) {
			switch name {
			case "zrange", "hget", "zscore", "zrank", "evalsha", "eval", "evalsha_ro", "eval_ro":
				mu.Lock()
				reads[addr]++
				mu.Unlock()
			}
		}))
	})
	pg := testenv.Postgres(t)
	cfg := &Config{Name: "replicas", Schema: pg.Schema, KeyPrefix: cluster.Prefix(t), ReadPolicy: FailClosed}
	require.NoError(t, Migrate(ctx, pg.Pool, cfg))
	board, err := New(pg.Pool, client, cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	tb := &testBundle{board: board, pg: pg}
	master, err := client.MasterForKey(ctx, board.SortedSetKey())
	require.NoError(t, err)

	tb.submit(t, "user-b", -1)
	for range 20 {
		res := tb.submit(t, "user-a", 1)
		tb.drain(t)
		r, err := board.Top(ctx, 1, AtLeast("user-a", res.Version))
		require.NoError(t, err)
		require.Equal(t, res.Score, r.Entries[0].Score)
		page, err := board.Page(ctx, r.Next, 1) // the page script
		require.NoError(t, err)
		require.Equal(t, "user-b", page.Entries[0].UserID)
		e, _, err := board.Rank(ctx, "user-a")
		require.NoError(t, err)
		require.Equal(t, res.Score, e.Score)
	}
	mu.Lock()
	defer mu.Unlock()
	require.NotZero(t, reads[master.Options().Addr])
	for addr, n := range reads {
		require.Equal(t, master.Options().Addr, addr, "%d reads went to another node than the master (%v)", n, reads)
	}
}

// TestRedisClusterReplicaReadsAfterSlotMove moves the board's (empty) slot
// to another master behind the back of a replica-reading cluster client.
// The board reads on the master it knows, whose connection answers MOVED
// and does not follow it: the board must follow it, as the cluster client
// does, instead of failing reads until the client's slot map is reloaded.
func TestRedisClusterReplicaReadsAfterSlotMove(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster, _, board := replicaReadingBoard(t, &Config{Name: "moved", KeyPrefix: "rv:", ReadPolicy: ServeStale})

	cluster.ReassignSlot(t, board.SortedSetKey()) // the board has no keys yet

	// The board's master-pinned reads follow the move as the cluster
	// client does, without waiting for its periodic slot-map reload.
	_, err := board.Top(ctx, 1)
	require.NoError(t, err, "a read pinned to the old master after the slot moved")
	_, _, err = board.Rank(ctx, "nobody", AtLeast("nobody", 1)) // waitForVersions' HGET
	require.ErrorIs(t, err, ErrStale)
}

// replicaReadingBoard opens the board cfg describes (in a schema of the
// test's own) on a new 3-master cluster, through a client that reads from
// replicas, and reads it once to load the client's slot map.
func replicaReadingBoard(t *testing.T, cfg *Config) (*testenv.RedisCluster, *redis.ClusterClient, *Board) {
	t.Helper()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 1)
	client := cluster.ReadOnlyClient(t)
	pg := testenv.Postgres(t)
	cfg.Schema = pg.Schema
	require.NoError(t, Migrate(ctx, pg.Pool, cfg))
	board, err := New(pg.Pool, client, cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	_, err = board.Top(ctx, 1)
	require.NoError(t, err)
	return cluster, client, board
}

// TestRedisClusterWaitRunsOutFollowingRedirects: an AtLeast wait whose
// deadline comes while its poll follows MOVED replies (only the slot's old
// owner gave it away, so the two masters send the client back and forth)
// applies the policy, as any wait that runs out: FailClosed answers
// ErrStale. The redirect, wrapped in the deadline's error, was taken for
// Redis's answer, and the read failed with "reading the projected
// version: context deadline exceeded".
func TestRedisClusterWaitRunsOutFollowingRedirects(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, client, board := replicaReadingBoard(t, &Config{Name: "pingpong", KeyPrefix: "pp:", ReadPolicy: FailClosed,
		ReadYourWritesTimeout: 300 * time.Millisecond})

	key := board.SortedSetKey()
	slot, err := client.ClusterKeySlot(ctx, key).Result()
	require.NoError(t, err)
	owner, err := client.MasterForKey(ctx, key)
	require.NoError(t, err)
	var other string
	for _, m := range testenv.Masters(t, client) {
		if m.Options().Addr != owner.Options().Addr {
			other, err = m.Do(ctx, "CLUSTER", "MYID").Text()
			require.NoError(t, err)
			break
		}
	}
	require.NoError(t, owner.Do(ctx, "CLUSTER", "SETSLOT", slot, "NODE", other).Err())
	for range 3 {
		_, _, err := board.Rank(ctx, "nobody", AtLeast("nobody", 1))
		require.ErrorIs(t, err, ErrStale)
	}
}

// TestRedisClusterFailoverReads fails the board's master over to its
// replica behind the back of a replica-reading cluster client. Its
// connections all open with READONLY, and its slot map still names the
// demoted master: every read — plain commands and scripts alike — must be
// answered by the new master, not served by the demoted one as a replica,
// whose lag Freshness does not measure.
func TestRedisClusterFailoverReads(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 1)
	pg := testenv.Postgres(t)
	cfg := &Config{Name: "failover", Schema: pg.Schema, KeyPrefix: "fo:", ReadPolicy: ServeStale}
	require.NoError(t, Migrate(ctx, pg.Pool, cfg))
	var mu sync.Mutex
	reads := map[string]int{} // node address → read commands of the board
	// Each subtest gets a client of its own: a client that followed the
	// previous subtest's failover may still be reloading its slot map (go-redis
	// reloads again after a 200 ms pause when asked during one), and would
	// learn of this subtest's failover before the read this test is about.
	newBoard := func(t *testing.T) (*Board, *redis.ClusterClient) {
		cluster.WaitSlotReplicas(t, 30*time.Second)
		client := redis.NewClusterClient(&redis.ClusterOptions{
			Addrs:                      cluster.Addrs(),
			ReadOnly:                   true,
			ClusterStateReloadInterval: time.Hour, // no periodic reload either
		})
		t.Cleanup(func() { _ = client.Close() })
		client.OnNewNode(func(node *redis.Client) {
			addr := node.Options().Addr
			node.AddHook(testenv.CommandHook(func(name string) {
				switch name {
				case "zrange", "hget", "exists", "get", "evalsha", "eval", "evalsha_ro", "eval_ro":
					mu.Lock()
					reads[addr]++
					mu.Unlock()
				}
			}))
		})
		board, err := New(pg.Pool, client, cfg)
		require.NoError(t, err)
		t.Cleanup(board.Close)
		return board, client
	}
	board, _ := newBoard(t)
	tb := &testBundle{board: board, pg: pg}
	tb.submit(t, "user-a", 2)
	last := tb.submit(t, "user-b", 1)
	tb.drain(t)
	top, err := board.Top(ctx, 1)
	require.NoError(t, err)

	for _, read := range []struct {
		name string
		run  func(board *Board) error
	}{
		{"Top", func(board *Board) error { _, err := board.Top(ctx, 2); return err }},
		{"Page", func(board *Board) error { _, err := board.Page(ctx, top.Next, 1); return err }},
		{"Rank", func(board *Board) error { _, _, err := board.Rank(ctx, "user-b"); return err }},
		{"Around", func(board *Board) error { _, err := board.Around(ctx, "user-a", 1); return err }},
		{"ReadYourWrites", func(board *Board) error {
			_, err := board.Top(ctx, 1, AtLeast("user-b", last.Version))
			return err
		}},
	} {
		t.Run(read.name, func(t *testing.T) {
			board, client := newBoard(t)
			_, err := board.Top(ctx, 1) // loads the slot map
			require.NoError(t, err)
			oldMaster, newMaster := cluster.Failover(t, board.SortedSetKey())
			named, err := client.MasterForKey(ctx, board.SortedSetKey())
			require.NoError(t, err)
			require.Equal(t, oldMaster, named.Options().Addr, "the client's map has not caught up")
			mu.Lock()
			before := reads[newMaster]
			mu.Unlock()
			require.NoError(t, read.run(board))
			mu.Lock()
			defer mu.Unlock()
			require.Greater(t, reads[newMaster], before, "the read was answered by the new master")
		})
	}
}

// TestRedisClusterMasterKilled kills the master serving a board's slot
// (SIGKILL) and promotes its replica behind the back of a plain cluster
// client, whose slot map go-redis reloads on redirects and periodically
// only (here: not within the test). A dead node sends no redirect: each
// way the board talks to Redis must have the map reloaded when its command
// cannot reach the node, so that the reads and Verify after it reach the
// promoted replica within seconds rather than after the periodic reload
// (60 s by default). So must a master lost without a reset, met by callers
// whose deadline is shorter than the client's ReadTimeout.
func TestRedisClusterMasterKilled(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("starts a private Redis Cluster and kills its masters")
	}
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 1)
	pg := testenv.Postgres(t)
	cfg := &Config{Name: "killed", Schema: pg.Schema, KeyPrefix: "killed:", ReadPolicy: ServeStale}
	require.NoError(t, Migrate(ctx, pg.Pool, cfg))
	newBoard := func(t *testing.T) *Board {
		client := redis.NewClusterClient(&redis.ClusterOptions{
			Addrs:                      cluster.Addrs(),
			ClusterStateReloadInterval: time.Hour,
			ReadTimeout:                2 * time.Second,
		})
		t.Cleanup(func() { _ = client.Close() })
		board, err := New(pg.Pool, client, cfg)
		require.NoError(t, err)
		t.Cleanup(board.Close)
		return board
	}
	tb := &testBundle{board: newBoard(t), pg: pg}
	tb.submit(t, "user-a", 2)
	tb.submit(t, "user-b", 1)
	tb.drain(t)
	want := []Entry{{UserID: "user-a", Score: 2, Rank: 1}, {UserID: "user-b", Score: 1, Rank: 2}}

	for _, c := range []struct {
		name string
		run  func(ctx context.Context, board *Board) error
	}{
		// A pipeline of plain commands (onMaster's unpinned branch).
		{"Top", func(ctx context.Context, board *Board) error {
			page, err := board.Top(ctx, 2)
			if err == nil {
				require.Equal(t, want, page.Entries)
				require.Equal(t, SourceRedis, page.Freshness.Source)
			}
			return err
		}},
		// A read script (evalRead's unpinned branch).
		{"Around", func(ctx context.Context, board *Board) error {
			page, err := board.Around(ctx, "user-b", 1)
			if err == nil {
				require.Equal(t, want, page.Entries)
			}
			return err
		}},
		// Verify's marker, set before its reconcile pass.
		{"Verify", func(ctx context.Context, board *Board) error {
			_, verified, err := board.Verify(ctx, nil)
			if err == nil {
				require.True(t, verified)
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
				board := newBoard(t)
				_, _, err := board.Rank(ctx, "user-a") // loads the slot map
				require.NoError(t, err)
				failing := cluster.LoseMasterAndRetry(t, loss, board.SortedSetKey(), 10*time.Second, func(ctx context.Context) error { return c.run(ctx, board) })
				t.Logf("%s reached the promoted replica %s after the loss", c.name, failing)
			})
		}
	}
}

// TestVerifiedDuringSlotMigration: a verified board on a Redis Cluster, its
// slot being migrated and one of its keys, the record's companion, moved.
// The look for Verify's record is a pipeline of three commands on keys of
// the slot; through a client that reads from replicas (the board pins its
// reads to masters) only the first after ASKING ran on the importing
// master, the look failed, and every FailClosed read was refused as
// unverified for the migration. Each command now follows its own ASK.
func TestVerifiedDuringSlotMigration(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 1)
	for _, replicaReads := range []bool{true, false} {
		t.Run(fmt.Sprintf("replicaReads=%v", replicaReads), func(t *testing.T) {
			var client *redis.ClusterClient
			if replicaReads {
				client = cluster.ReadOnlyClient(t)
			} else {
				client = cluster.Client(t)
			}
			tb := boardOn(t, client, &Config{Name: fmt.Sprintf("migrating%v", replicaReads), KeyPrefix: cluster.Prefix(t),
				ReadPolicy: FailClosed, RequireVerifiedProjection: true, LagProbeInterval: time.Nanosecond})
			board := tb.board
			tb.submit(t, "ada", 10)
			tb.drain(t)
			_, verified, err := board.Verify(ctx, nil)
			require.NoError(t, err)
			require.True(t, verified)
			r, err := board.Top(ctx, 10)
			require.NoError(t, err)
			require.Len(t, r.Entries, 1)

			// Mid-resharding: the slot is MIGRATING, one key of it moved.
			importing := cluster.MigrateKey(t, board.heldKey)
			t.Cleanup(func() { finishMigration(t, cluster, board.SortedSetKey(), board.heldKey, importing) })

			r, err = board.Top(ctx, 10)
			require.NoError(t, err, "a verified board read during a slot migration")
			require.False(t, r.Freshness.Unverified)
		})
	}
}

// finishMigration moves key back from the importing master and ends the
// migration of its slot on every master.
func finishMigration(t *testing.T, cluster *testenv.RedisCluster, key, moved, importing string) {
	ctx := context.Background()
	client := cluster.Client(t)
	slot, err := client.ClusterKeySlot(ctx, key).Result()
	require.NoError(t, err)
	src, err := client.MasterForKey(ctx, key)
	require.NoError(t, err)
	require.NoError(t, src.Do(ctx, "CLUSTER", "SETSLOT", slot, "STABLE").Err())
	for _, m := range testenv.Masters(t, client) {
		if m.Options().Addr == importing {
			host, port, _ := net.SplitHostPort(src.Options().Addr)
			require.NoError(t, m.Migrate(ctx, host, port, moved, 0, 5*time.Second).Err())
			require.NoError(t, m.Do(ctx, "CLUSTER", "SETSLOT", slot, "STABLE").Err())
		}
	}
}
