package projection

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"

	"github.com/verity-go/verity/internal/telemetry/metrictest"
	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
)

// TestGateSeveralGroupsFailFirstErrorWins: Apply documents "When several slot
// groups fail, the error is the first's." Two collections in different
// Cluster slots, both refused for a layout mismatch: the error must name
// the collection of the first group (the batch's first write).
func TestGateSeveralGroupsFailFirstErrorWins(t *testing.T) {
	t.Parallel()
	c := testenv.SharedRedisCluster(t)
	client := c.Client(t)
	ks, err := NewKeyspace(c.Prefix(t))
	require.NoError(t, err)
	ctx := context.Background()
	// Two collection names in different slots.
	names := []string{"first"}
	for _, n := range []string{"second", "other", "another", "yet", "more"} {
		if ks.Slot(Target{Kind: KindSortedSet, Name: n}) != ks.Slot(Target{Kind: KindSortedSet, Name: "first"}) {
			names = append(names, n)
			break
		}
	}
	require.Len(t, names, 2)
	eight, err := ks.WithVersionBuckets(8)
	require.NoError(t, err)
	_, err = NewGate(client, eight).Apply(ctx, []Write{zset(names[0], "a", 1, 1), zset(names[1], "a", 1, 1)})
	require.NoError(t, err)

	four, err := ks.WithVersionBuckets(4)
	require.NoError(t, err)
	for _, order := range [][2]string{{names[0], names[1]}, {names[1], names[0]}} {
		out, err := NewGate(client, four).Apply(ctx, []Write{zset(order[0], "b", 1, 1), zset(order[1], "b", 1, 1)})
		require.Nil(t, out)
		var lm *LayoutMismatchError
		require.ErrorAs(t, err, &lm)
		require.Equal(t, order[0], lm.Name, "the error is the first failed group's")
	}
}

// TestGateFailedCallCountsNoVerdict: the writes counter's "unknown"
// outcome means refused by the gate (unreadable stored version, layout
// mismatch); a write whose script call failed (Redis unreachable) was not
// decided and must not be counted at all.
func TestGateFailedCallCountsNoVerdict(t *testing.T) {
	t.Parallel()
	rec := metrictest.New(t)
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
	t.Cleanup(func() { _ = client.Close() })
	p, err := NewRedisProjector(client, testMapper(), &Config{Prefix: "zz-mut2:", MeterProvider: rec.Provider})
	require.NoError(t, err)
	results, err := p.Handle(context.Background(), []outbox.Record{record("scores", "alice", 1, "10"), record("scores", "bob", 1, "5")})
	if err == nil {
		for _, r := range results {
			require.Error(t, r.Err, "Redis is unreachable")
		}
	}
	s := rec.Collect(t)
	require.Equal(t, int64(0), s.Int(metricWrites), "no write was decided")
	require.Equal(t, int64(0), s.Int(metricWrites, attribute.String(AttributeOutcome, "unknown")))
}

// TestGateCallFailedPartWayCountsNoVerdict: a script call that Redis fails
// after some of its writes (here WRONGTYPE, without Handle's isolation)
// leaves every write of its group undecided, the ones it applied before
// the error too: none is counted among the verdicts, each counts as
// failed. Kept verdicts are for WRONGTYPE under isolation only (see the
// failed-call case in Gate.run).
func TestGateCallFailedPartWayCountsNoVerdict(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rd := testenv.Redis(t)
	rec := metrictest.New(t)
	p, err := NewRedisProjector(rd.Client, testMapper(), &Config{Prefix: rd.Prefix, MeterProvider: rec.Provider})
	require.NoError(t, err)
	ks := p.Keyspace()
	// One node: both records go in one call, and the board's version hash
	// is a string, so the call fails at bob, after applying alice.
	require.NoError(t, rd.Client.Set(ctx, ks.VersionKey(Target{Kind: KindSortedSet, Name: "board"}), "not a hash", 0).Err())
	out, err := p.Project(ctx, []outbox.Record{record("profiles", "alice", 1, "a"), record("scores", "bob", 1, "2")})
	require.ErrorContains(t, err, "WRONGTYPE")
	require.Nil(t, out)
	require.Equal(t, storedState{true, "a", "1"}, readState(t, rd.Client, ks, Target{Kind: KindHash, Name: "profiles", Member: "alice"}),
		"alice was written before the error")

	s := rec.Collect(t)
	require.Zero(t, s.Int(metricWrites), "no verdict counted, alice's included")
	require.Equal(t, int64(2), s.Int(metricFailed, attribute.String(AttributeReason, reasonRedis)))
}

// TestLayoutMismatchReportsMaxBuckets: a collection stored with
// VersionBucketsMax buckets is a valid layout; a writer configured
// otherwise is refused with a *LayoutMismatchError naming the stored count,
// not -1 ("not a bucket count").
func TestLayoutMismatchReportsMaxBuckets(t *testing.T) {
	t.Parallel()
	rd := testenv.Redis(t)
	ks, err := NewKeyspace(rd.Prefix)
	require.NoError(t, err)
	maxKS, err := ks.WithVersionBuckets(VersionBucketsMax)
	require.NoError(t, err)
	ctx := context.Background()
	_, err = NewGate(rd.Client, maxKS).Apply(ctx, []Write{zset("board", "a", 1, 1)})
	require.NoError(t, err)
	four, err := ks.WithVersionBuckets(4)
	require.NoError(t, err)
	_, err = NewGate(rd.Client, four).Apply(ctx, []Write{zset("board", "b", 1, 1)})
	var lm *LayoutMismatchError
	require.ErrorAs(t, err, &lm)
	require.Equal(t, LayoutMismatchError{Kind: KindSortedSet, Name: "board", Stored: VersionBucketsMax, Configured: 4}, *lm)
	require.Equal(t, VersionBucketsMax, ParseLayout(strconv.Itoa(VersionBucketsMax)))
	// ParseLayout reads what readers find in a layout key: a canonical
	// decimal within [0, VersionBucketsMax], else -1.
	for s, want := range map[string]int{"0": 0, "8": 8, strconv.Itoa(VersionBucketsMax + 1): -1, "-1": -1, "07": -1, "+8": -1, "": -1, "8 ": -1, "x": -1} {
		require.Equal(t, want, ParseLayout(s), "%q", s)
	}
}

// TestGateOnAFullRedis: a Redis at maxmemory with the noeviction policy
// refuses a script's first write, and nothing after it runs. A call that
// decides writes and then writes them all at once (a live batch of
// existing collections without buckets) must fail whole, with no verdict
// kept and nothing written, for any mix of kinds and verdicts; and once
// there is room the same batch goes through.
func TestGateOnAFullRedis(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.StartRedis(t, "--maxmemory-policy", "noeviction")
	client := srv.Client(t)
	ks, err := NewKeyspace("full:")
	require.NoError(t, err)
	gate := NewGate(client, ks)
	// Both collections exist, with their layouts recorded, before Redis is
	// full: the batch's first write is a value, not a layout.
	out, err := gate.Apply(ctx, []Write{zset("board", "ada", 2, 10), hash("profiles", "ada", 2, "a")})
	require.NoError(t, err)
	require.Equal(t, []Outcome{OutcomeApplied, OutcomeApplied}, out)
	testenv.FillRedis(t, client)

	batch := []Write{
		zset("board", "ada", 2, 10),      // duplicate
		zset("board", "ada", 1, 5),       // stale
		zset("board", "bob", 1, 7),       // new
		hash("profiles", "bob", 1, "b"),  // new
		zset("board", "ada", 3, 11),      // newer
		hash("profiles", "ada", 2, "a2"), // conflict: same version, another value
		hash("profiles", "ada", 2, "a"),  // duplicate
	}
	out, err = gate.Apply(ctx, batch)
	require.ErrorContains(t, err, "OOM")
	for i, o := range out {
		require.Equal(t, OutcomeUnknown, o, "write %d: no verdict is kept from a failed call", i)
	}
	require.Equal(t, storedState{true, "10", "2"}, readState(t, client, ks, zset("board", "ada", 0, 0).Target))
	require.Equal(t, storedState{}, readState(t, client, ks, zset("board", "bob", 0, 0).Target))
	require.Equal(t, storedState{}, readState(t, client, ks, hash("profiles", "bob", 0, "").Target))
	require.Equal(t, storedState{true, "a", "2"}, readState(t, client, ks, hash("profiles", "ada", 0, "").Target))

	require.NoError(t, client.ConfigSet(ctx, "maxmemory", "0").Err())
	out, err = gate.Apply(ctx, batch)
	require.NoError(t, err)
	require.Equal(t, []Outcome{OutcomeDuplicate, OutcomeStale, OutcomeApplied, OutcomeApplied, OutcomeApplied, OutcomeConflict, OutcomeDuplicate}, out)
	require.Equal(t, storedState{true, "11", "3"}, readState(t, client, ks, zset("board", "ada", 0, 0).Target))
	require.Equal(t, storedState{true, "7", "1"}, readState(t, client, ks, zset("board", "bob", 0, 0).Target))
	require.Equal(t, storedState{true, "b", "1"}, readState(t, client, ks, hash("profiles", "bob", 0, "").Target))
}

// TestGateVersionHashOfAnotherType: a live batch of collections without
// buckets, one of whose version hashes is a key of another type, fails
// that collection's writes and applies the others, in either position.
func TestGateVersionHashOfAnotherType(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rd := testenv.Redis(t)
	ks, err := NewKeyspace(rd.Prefix)
	require.NoError(t, err)
	gate := NewGate(rd.Client, ks)
	_, err = gate.Apply(ctx, []Write{zset("board", "ada", 1, 1), hash("profiles", "ada", 1, "a")})
	require.NoError(t, err)
	versions := ks.VersionKey(zset("board", "", 0, 0).Target)
	require.NoError(t, rd.Client.Del(ctx, versions).Err())
	require.NoError(t, rd.Client.Set(ctx, versions, "not a hash", 0).Err())

	for _, first := range []bool{true, false} {
		name := "profiles-" + strconv.FormatBool(first)
		writes := []Write{hash(name, "a", 1, "x"), zset("board", "bob", 1, 2), hash(name, "b", 1, "y")}
		if !first {
			writes[0], writes[1] = writes[1], writes[0]
		}
		bad := 1
		if !first {
			bad = 0
		}
		outcomes, perWrite, err := gate.run(ctx, modeLive, "", writes, true)
		require.NoError(t, err)
		for i := range writes {
			if i == bad {
				require.Equal(t, OutcomeUnknown, outcomes[i])
				var wt *WrongKeyTypeError
				require.ErrorAs(t, perWrite[i], &wt, "write %d", i)
				require.Equal(t, i, wt.Index)
				continue
			}
			require.NoError(t, perWrite[i], "write %d", i)
			require.Equal(t, OutcomeApplied, outcomes[i], "write %d", i)
		}
		require.Equal(t, storedState{true, "x", "1"}, readState(t, rd.Client, ks, hash(name, "a", 0, "").Target))
		require.Equal(t, storedState{true, "y", "1"}, readState(t, rd.Client, ks, hash(name, "b", 0, "").Target))
	}
	require.Equal(t, "not a hash", rd.Client.Get(ctx, versions).Val())
}

// TestGateLayoutMismatchAdoptsNothing: a slot group refused for one
// collection's layout writes nothing, not even the layout key of a new
// collection checked before it: a refused writer must not pin the bucket
// count of a collection it never wrote. (One node: on Cluster and a Ring
// the two collections are sent in calls of their own.)
func TestGateLayoutMismatchAdoptsNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	flat := setupGate(t, backends[0])
	eight := flat.bucketed(t, 8)
	eight.apply(t, zset("board", "a", 1, 10))
	board := flat.dump(t, "board", KindSortedSet)
	for _, writes := range [][]Write{
		{hash("new", "a", 1, "x"), zset("board", "b", 1, 1)},
		{zset("board", "b", 1, 1), hash("new", "a", 1, "x")},
	} {
		out, err := flat.gate.Apply(ctx, writes)
		require.Nil(t, out)
		var lm *LayoutMismatchError
		require.ErrorAs(t, err, &lm)
		require.Equal(t, LayoutMismatchError{Kind: KindSortedSet, Name: "board", Stored: 8, Configured: 0}, *lm)
		require.Empty(t, flat.dump(t, "new", KindHash), "the refused call wrote the new collection's keys")
		require.Equal(t, board, flat.dump(t, "board", KindSortedSet))
	}
	// The new collection takes the count of its first write that lands.
	require.Equal(t, []Outcome{OutcomeApplied}, eight.apply(t, hash("new", "a", 1, "x")))
	require.Equal(t, "8", flat.client.Get(ctx, flat.ks.LayoutKey("new", KindHash)).Val())
}

// TestGateGroupsSameSlotTags: collections whose hash tags differ but share
// a Cluster slot are written in one script call per slot on Cluster, in a
// call per hash tag on a Ring (which places keys by tag, not by slot, so a
// call for two tags could write one of them on the wrong shard), and in
// one call on a single node; every write lands where readers find it.
func TestGateGroupsSameSlotTags(t *testing.T) {
	t.Parallel()
	ks, err := NewKeyspace("")
	require.NoError(t, err)
	var names []string // pairs of collection names in one slot
	bySlot := map[int]string{}
	for i := 0; len(names) < 16; i++ {
		n := "c" + strconv.Itoa(i)
		s := ks.Slot(Target{Kind: KindSortedSet, Name: n})
		if other, ok := bySlot[s]; ok {
			names = append(names, other, n)
			delete(bySlot, s)
			continue
		}
		bySlot[s] = n
	}
	groups := map[string]int{"SingleNode": 1, "Sentinel": 1, "Cluster": len(names) / 2, "Ring": len(names)}
	forEachBackend(t, func(t *testing.T, b backend) {
		gb := setupGate(t, b)
		var writes []Write
		all := make([]int, len(names))
		for i, n := range names {
			writes = append(writes, zset(n, "m", 1, int64(i)))
			all[i] = i
		}
		require.Len(t, gb.gate.group(modeLive, "", writes, all), groups[b.name])
		for i, o := range gb.apply(t, writes...) {
			require.Equal(t, OutcomeApplied, o, "write %d", i)
		}
		for _, w := range writes {
			require.Equal(t, storedState{true, valueOf(w), "1"}, readState(t, gb.client, gb.ks, w.Target), "%s", w.Target)
		}
		if ring, ok := gb.client.(*redis.Ring); ok {
			// The Ring case tells grouping by tag from grouping by slot
			// only if some same-slot pair spans both shards: a call for
			// the pair would then write one of them on the wrong shard.
			require.True(t, pairSpansShards(t, ring, gb.ks, names), "no same-slot pair of collections spans the Ring's shards: pick other names")
		}
	})
}

// pairSpansShards reports whether the value keys of some pair of names
// (names[0] and names[1], names[2] and names[3], ...) are stored on
// different shards of ring.
func pairSpansShards(t *testing.T, ring *redis.Ring, ks Keyspace, names []string) bool {
	t.Helper()
	ctx := context.Background()
	var mu sync.Mutex
	shardOf := map[string]string{}
	require.NoError(t, ring.ForEachShard(ctx, func(ctx context.Context, shard *redis.Client) error {
		for _, n := range names {
			k, err := shard.Exists(ctx, ks.ValueKey(Target{Kind: KindSortedSet, Name: n})).Result()
			if err != nil {
				return err
			}
			if k == 1 {
				mu.Lock()
				shardOf[n] = shard.Options().Addr
				mu.Unlock()
			}
		}
		return nil
	}))
	require.Len(t, shardOf, len(names), "every collection's key is on a shard")
	for i := 0; i+1 < len(names); i += 2 {
		if shardOf[names[i]] != shardOf[names[i+1]] {
			return true
		}
	}
	return false
}

// TestGateShortReplyIsUnexpected: a reply with fewer verdicts than writes
// (another script under the gate's SHA, a proxy rewriting replies) is
// ErrUnexpectedReply, not writes left OutcomeUnknown without an error
// (OutcomeUnknown "appears only next to a non-nil error").
func TestGateShortReplyIsUnexpected(t *testing.T) {
	t.Parallel()
	client, prefix := backends[0].connect(t)
	ks, err := NewKeyspace(prefix)
	require.NoError(t, err)
	g := NewGate(client, ks)
	g.script = redis.NewScript("return {1}")
	out, err := g.Apply(context.Background(), []Write{zset("board", "a", 1, 1), zset("board", "b", 1, 2)})
	require.ErrorIs(t, err, ErrUnexpectedReply, "outcomes %v", out)
}

// TestLayoutMismatchSparesTheSameNameOfAnotherKind: a layout mismatch
// fails only the records of the collection whose layout differs (Handle's
// doc): a collection of another kind with the same name has a layout key
// of its own, and is applied.
func TestLayoutMismatchSparesTheSameNameOfAnotherKind(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client, prefix := backends[0].connect(t)
	bucketed, err := NewRedisProjector(client, StreamMapper{"scores": SortedSetMapper("board")}, &Config{Prefix: prefix, VersionBuckets: 16})
	require.NoError(t, err)
	_, err = bucketed.Gate().Apply(ctx, []Write{zset("board", "alice", 1, 1)})
	require.NoError(t, err)

	p, err := NewRedisProjector(client, StreamMapper{"scores": SortedSetMapper("board"), "names": HashMapper("board")}, &Config{Prefix: prefix})
	require.NoError(t, err)
	results, err := p.Handle(ctx, []outbox.Record{record("scores", "bob", 1, "5"), record("names", "bob", 1, "Bob")})
	require.NoError(t, err)
	var lm *LayoutMismatchError
	require.ErrorAs(t, results[0].Err, &lm, "the bucketed sorted set is refused")
	require.Equal(t, KindSortedSet, lm.Kind)
	require.NoError(t, results[1].Err, "the hash named board has its own layout")
	require.Equal(t, storedState{true, "Bob", "1"}, readState(t, client, p.Keyspace(), hash("board", "bob", 0, "").Target))
}

// TestGateAcrossSlotsDuringAResharding: a batch of two collections whose
// slots differ and share a master, while a resharding moves B's slot (the
// gate's client does not know yet: MOVED) and then A's (migrating: A's
// script, which names A's rebuild marker and shadow keys, none of them
// there, is answered TRYAGAIN before any key has moved). go-redis sent the
// node's whole batch again on the TRYAGAIN, B's script included, which it
// was already following the MOVED of: B's script ran twice on its new
// master at once (a data race under -race), and the call could report
// B's own write as a duplicate. A single-key guard ahead of each node's
// batch keeps go-redis from sending it again (clusterpin.Guard).
func TestGateAcrossSlotsDuringAResharding(t *testing.T) {
	t.Parallel()
	for name, finishDuringTheRetry := range map[string]bool{"MigrationUnfinished": false, "MigrationFinishedDuringTheRetry": true} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			cluster := testenv.StartRedisCluster(t, 3, 0)
			admin := cluster.Client(t)
			ks, err := NewKeyspace("rs:")
			require.NoError(t, err)
			slot := func(name string) int { return ks.Slot(Target{Kind: KindSortedSet, Name: name}) }
			a, b, source := twoSlotsOfOneMaster(t, admin, ks)

			var migrateA *testenv.SlotMigration
			var once sync.Once
			finished := make(chan error, 1)
			client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs()})
			t.Cleanup(func() { _ = client.Close() })
			if finishDuringTheRetry {
				// Right after the node's batch was answered TRYAGAIN, in
				// go-redis's backoff before it sends the batch again.
				client.OnNewNode(func(node *redis.Client) {
					node.AddHook(afterTryAgain{fn: func() { once.Do(func() { finished <- migrateA.Finish(ctx) }) }})
				})
			}
			gate := warmGate(t, client, ks)
			outcomes, err := gate.Apply(ctx, []Write{write(a, 1), write(b, 1)})
			require.NoError(t, err)
			require.Equal(t, []Outcome{OutcomeApplied, OutcomeApplied}, outcomes)

			require.NoError(t, testenv.StartSlotMigration(t, admin, slot(b), source).Finish(ctx))
			migrateA = testenv.StartSlotMigration(t, admin, slot(a), source)
			outcomes, err = gate.Apply(ctx, []Write{write(a, 2), write(b, 2)})
			t.Logf("during the resharding: %v, %v", outcomes, err)
			if err == nil {
				require.Equal(t, []Outcome{OutcomeApplied, OutcomeApplied}, outcomes, "B's version 2 was written by this call")
			}
			if finishDuringTheRetry {
				select {
				case err := <-finished:
					require.NoError(t, err)
				default:
					require.NoError(t, migrateA.Finish(ctx))
				}
			} else {
				require.NoError(t, migrateA.Finish(ctx))
			}
			again, err := gate.Apply(ctx, []Write{write(a, 2), write(b, 2)})
			require.NoError(t, err)
			require.Equal(t, OutcomeDuplicate, again[1], "B's version 2 is stored")
		})
	}
}

// TestGateAcrossSlotsWithASlotNotServed: as
// TestGateAcrossSlotsDuringAResharding, but the first command of the
// node's batch is answered "CLUSTERDOWN Hash slot not served" (A's slot
// unassigned, cluster-require-full-coverage no) while B's slot has moved.
// go-redis sends a node's whole batch again on CLUSTERDOWN (and LOADING,
// MASTERDOWN, a broken connection) as on TRYAGAIN, even when its first
// command is a guard, unless the guard is a NoRetry command.
func TestGateAcrossSlotsWithASlotNotServed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 0)
	admin := cluster.Client(t)
	ks, err := NewKeyspace("rs:")
	require.NoError(t, err)
	a, b, source := twoSlotsOfOneMaster(t, admin, ks)
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs()})
	t.Cleanup(func() { _ = client.Close() })
	gate := warmGate(t, client, ks)
	outcomes, err := gate.Apply(ctx, []Write{write(b, 1)})
	require.NoError(t, err)
	require.Equal(t, []Outcome{OutcomeApplied}, outcomes)

	masters := testenv.Masters(t, admin)
	for _, m := range masters {
		require.NoError(t, m.ConfigSet(ctx, "cluster-require-full-coverage", "no").Err())
	}
	require.NoError(t, testenv.StartSlotMigration(t, admin, ks.Slot(write(b, 0).Target), source).Finish(ctx))
	for _, m := range masters {
		require.NoError(t, m.Do(ctx, "CLUSTER", "DELSLOTS", ks.Slot(write(a, 0).Target)).Err())
	}
	outcomes, perWrite, err := gate.run(ctx, modeLive, "", []Write{write(a, 2), write(b, 2)}, false)
	t.Logf("A's slot not served, B's moved: %v, %v, %v", outcomes, perWrite, err)
	require.ErrorContains(t, perWrite[0], "CLUSTERDOWN")
	require.NoError(t, perWrite[1])
	require.Equal(t, OutcomeApplied, outcomes[1], "B's version 2 was written by this call")
}

// twoSlotsOfOneMaster returns two sorted-set collection names whose slots
// differ and are served by one master, and that master.
func twoSlotsOfOneMaster(t *testing.T, admin *redis.ClusterClient, ks Keyspace) (a, b string, master *redis.Client) {
	t.Helper()
	masterOf := func(name string) *redis.Client {
		m, err := admin.MasterForKey(context.Background(), ks.ValueKey(write(name, 0).Target))
		require.NoError(t, err)
		return m
	}
	a, master = "c0", masterOf("c0")
	for i := 1; b == ""; i++ {
		if name := "c" + strconv.Itoa(i); masterOf(name).Options().Addr == master.Options().Addr && ks.Slot(write(name, 0).Target) != ks.Slot(write(a, 0).Target) {
			b = name
		}
	}
	return a, b, master
}

// write is a sorted-set write of member "m" of collection name at version,
// scored version.
func write(name string, version int64) Write {
	return Write{Target: Target{Kind: KindSortedSet, Name: name, Member: "m"}, Version: version, Value: Value{Score: version}}
}

// warmGate returns a gate on client whose script every master has loaded,
// as on a cluster in service.
func warmGate(t *testing.T, client *redis.ClusterClient, ks Keyspace) *Gate {
	t.Helper()
	gate := NewGate(client, ks)
	var warm []Write
	for i := range 30 {
		warm = append(warm, write("warm"+strconv.Itoa(i), 1))
	}
	_, err := gate.Apply(context.Background(), warm)
	require.NoError(t, err)
	return gate
}

// afterTryAgain runs fn after a pipeline one of whose commands was
// answered TRYAGAIN.
type afterTryAgain struct {
	testenv.PassThroughHook
	fn func()
}

func (h afterTryAgain) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		for _, cmd := range cmds {
			if redis.IsTryAgainError(cmd.Err()) {
				h.fn()
				break
			}
		}
		return err
	}
}
