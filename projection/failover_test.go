package projection

import (
	"context"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"

	"github.com/verity-go/verity/internal/telemetry/metrictest"
	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
)

// TestGateClusterFailover kills the master that owns a collection's slot in
// the middle of a stream of batches. Batches fail until a replica takes
// over; retried, they complete (on the promoted replica, whose script cache
// is empty, through the NOSCRIPT fallback), and every target ends at its
// highest version. The gate's slot-map reload on failure is what lets the
// retries find the new master before go-redis's periodic reload (60s).
func TestGateClusterFailover(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("starts a private Redis Cluster and waits for a failover")
	}
	c := testenv.StartRedisCluster(t, 3, 1)
	client := c.Client(t)
	ks, err := NewKeyspace("failover:")
	require.NoError(t, err)
	gate := NewGate(client, ks)
	ctx := context.Background()

	batch := func(v int64) []Write {
		var writes []Write
		for i := 0; i < 10; i++ {
			writes = append(writes, zset("board", "m"+strconv.Itoa(i), v, v*10+int64(i)), doc("doc-"+strconv.Itoa(i), v, "v"+strconv.FormatInt(v, 10)))
		}
		return writes
	}
	applyUntilAccepted := func(writes []Write) []Outcome {
		var out []Outcome
		require.Eventually(t, func() bool {
			var err error
			out, err = gate.Apply(ctx, writes)
			return err == nil
		}, 30*time.Second, 100*time.Millisecond)
		return out
	}
	for _, o := range applyUntilAccepted(batch(1)) {
		require.Equal(t, OutcomeApplied, o)
	}

	master := c.MasterForSlot(t, ks.Slot(zset("board", "", 0, 0).Target))
	c.Kill(master)

	// Retries re-send groups that did land: those come back duplicate.
	for _, o := range applyUntilAccepted(batch(2)) {
		require.Contains(t, []Outcome{OutcomeApplied, OutcomeDuplicate}, o)
	}
	require.NotEqual(t, master, c.MasterForSlot(t, ks.Slot(zset("board", "", 0, 0).Target)), "a replica took over")

	c.Start(t, master)
	c.WaitHealthy(t)
	for _, o := range applyUntilAccepted(batch(3)) {
		require.Equal(t, OutcomeApplied, o)
	}
	for _, w := range batch(3) {
		require.Equal(t, storedState{true, valueOf(w), "3"}, readState(t, client, ks, w.Target), "%s", w.Target)
	}
	// Redelivering an older batch changes nothing.
	for _, o := range applyUntilAccepted(batch(2)) {
		require.Equal(t, OutcomeStale, o)
	}
}

// TestGateClusterReloadOnFailedCall counts the loads of a Cluster client's
// slot map (ClusterOptions.ClusterSlots, answered by the shared cluster's
// own CLUSTER SLOTS; no periodic reload is due during the test). A failed
// script call makes the gate ask for a reload, which is what lets the
// relay's retries find a promoted replica (TestGateClusterFailover); a call
// that failed because the caller cancelled says nothing about the cluster
// and asks for none, but one its deadline ended does (to a caller whose
// deadline is shorter than ReadTimeout, a master that stopped answering
// shows nothing else).
func TestGateClusterReloadOnFailedCall(t *testing.T) {
	t.Parallel()
	c := testenv.SharedRedisCluster(t)
	ctx := context.Background()
	seed := redis.NewClient(&redis.Options{Addr: c.Addrs()[0]})
	t.Cleanup(func() { _ = seed.Close() })
	var loads atomic.Int64
	client := redis.NewClusterClient(&redis.ClusterOptions{
		ClusterSlots: func(ctx context.Context) ([]redis.ClusterSlot, error) {
			loads.Add(1)
			//lint:ignore SA1019 go-redis builds its slot map from CLUSTER SLOTS.
			return seed.ClusterSlots(ctx).Result()
		},
		ClusterStateReloadInterval: time.Hour,
	})
	t.Cleanup(func() { _ = client.Close() })
	ks, err := NewKeyspace(c.Prefix(t))
	require.NoError(t, err)
	gate := NewGate(client, ks)
	out, err := gate.Apply(ctx, []Write{zset("board", "ada", 1, 10)})
	require.NoError(t, err)
	require.Equal(t, []Outcome{OutcomeApplied}, out)
	require.EqualValues(t, 1, loads.Load(), "the first call loads the slot map")

	t.Run("NotWhenTheCallerGaveUp", func(t *testing.T) {
		cancelled, cancel := context.WithCancel(ctx)
		cancel()
		_, err := gate.Apply(cancelled, []Write{zset("board", "ada", 2, 20)})
		require.ErrorIs(t, err, context.Canceled)
		// A reload would start at once, asynchronously: watch for one for
		// a while (FailedCall below shows the counting sees them).
		require.Never(t, func() bool { return loads.Load() > 1 }, 2*time.Second, 20*time.Millisecond)
	})

	t.Run("WhenTheCallersDeadlineEnded", func(t *testing.T) {
		ended, cancel := context.WithDeadline(ctx, time.Now().Add(-time.Second))
		defer cancel()
		before := loads.Load()
		_, err := gate.Apply(ended, []Write{zset("board", "ada", 2, 20)})
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.Eventually(t, func() bool { return loads.Load() > before }, 10*time.Second, 20*time.Millisecond)
	})

	t.Run("FailedCall", func(t *testing.T) {
		// Any failed call; here Redis refuses it (a collection's version
		// hash replaced by a string), which a test on a shared cluster can
		// cause.
		versions := ks.VersionKey(zset("board", "", 0, 0).Target)
		require.NoError(t, client.Del(ctx, versions).Err())
		require.NoError(t, client.Set(ctx, versions, "not a hash", 0).Err())
		before := loads.Load()
		// go-redis drops a reload asked for while one is under way (its
		// pending mark is cleared when that one ends), as the previous
		// subtest's may still be: each failed call asks again.
		var refused atomic.Int64
		require.Eventually(t, func() bool {
			if _, err := gate.Apply(ctx, []Write{zset("board", "bob", 1, 10)}); err != nil && strings.Contains(err.Error(), "WRONGTYPE") {
				refused.Add(1)
			}
			return loads.Load() > before
		}, 10*time.Second, 250*time.Millisecond)
		require.Positive(t, refused.Load(), "the calls failed as set up")
	})
}

// TestGateRingShardOutage pauses the Ring shard that holds a collection. A
// Ring built as the package documents (a HeartbeatFn that never marks a
// shard down) keeps the keys on their shard: writes wait or fail while it
// does not answer, nothing is written to another shard, and every write is
// gated against the versions it holds — a redelivered
// older record is stale and the newer one is applied. (With go-redis's
// default heartbeat the Ring would move the keys to the other shard, where
// the older record is applied, and back again, where the newer one is
// gone.)
func TestGateRingShardOutage(t *testing.T) {
	t.Parallel()
	a, b := testenv.StartRedis(t), testenv.StartRedis(t)
	ring := redis.NewRing(&redis.RingOptions{
		Addrs:              map[string]string{"a": a.Addr(), "b": b.Addr()},
		HeartbeatFrequency: 100 * time.Millisecond,
		HeartbeatFn:        func(context.Context, *redis.Client) bool { return true },
		NewClient: func(opt *redis.Options) *redis.Client {
			opt.ReadTimeout, opt.WriteTimeout, opt.MaxRetries = 200*time.Millisecond, 200*time.Millisecond, -1
			return redis.NewClient(opt)
		},
	})
	t.Cleanup(func() { _ = ring.Close() })
	ctx := context.Background()
	ks, err := NewKeyspace("ring-outage:")
	require.NoError(t, err)
	g := NewGate(ring, ks)
	target := Target{Kind: KindHash, Name: "board", Member: "ada"}
	write := func(v int64) []Write {
		return []Write{{Target: target, Version: v, Value: Value{Data: []byte(strconv.FormatInt(v, 10))}}}
	}
	out, err := g.Apply(ctx, write(2))
	require.NoError(t, err)
	require.Equal(t, []Outcome{OutcomeApplied}, out)
	home, other := a.Client(t), b.Client(t)
	if home.Exists(ctx, ks.ValueKey(target)).Val() == 0 {
		home, other = other, home
	}
	require.EqualValues(t, 1, home.Exists(ctx, ks.ValueKey(target)).Val())

	const pause = 1500 * time.Millisecond
	paused := time.Now()
	require.NoError(t, home.Do(ctx, "CLIENT", "PAUSE", pause.Milliseconds(), "ALL").Err())
	time.Sleep(700 * time.Millisecond) // seven heartbeats: the default would have moved the keys
	// The writes either time out or wait for the shard; either way they are
	// gated against the versions it holds.
	out, err = g.Apply(ctx, write(1))
	if err == nil {
		require.Equal(t, []Outcome{OutcomeStale}, out, "a redelivered older record")
	}
	require.Zero(t, other.DBSize(ctx).Val(), "nothing may be written to another shard")
	time.Sleep(time.Until(paused.Add(pause + 200*time.Millisecond)))
	require.Eventually(t, func() bool { // the relay's retries
		out, err = g.Apply(ctx, write(3))
		return err == nil
	}, 10*time.Second, 50*time.Millisecond)
	// Duplicate if an attempt that failed on the client ran on the server.
	require.Contains(t, []Outcome{OutcomeApplied, OutcomeDuplicate}, out[0])
	out, err = g.Apply(ctx, write(1))
	require.NoError(t, err)
	require.Equal(t, []Outcome{OutcomeStale}, out)
	require.Equal(t, "3", home.HGet(ctx, ks.VersionKey(target), "ada").Val())
	require.Zero(t, other.DBSize(ctx).Val())
}

// TestProjectorClusterMasterDown projects batches that span two Cluster
// masters while one of them is down. The script call to the live master
// runs and applies its writes, so its records are acknowledged (Handle)
// and counted by their verdicts and lag (Handle and Project); only the
// records of the dead master's slot group fail, each with the call's
// error, and only they count as failed. Project and Gate.Apply keep their
// batch contract: the call's error, no outcomes.
func TestProjectorClusterMasterDown(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("starts a private Redis Cluster")
	}
	c := testenv.StartRedisCluster(t, 3, 0)
	ctx := context.Background()
	// Without full coverage required, the live masters keep serving their
	// slots once the cluster has marked the dead one failed.
	for _, addr := range c.Addrs() {
		node := redis.NewClient(&redis.Options{Addr: addr})
		require.NoError(t, node.ConfigSet(ctx, "cluster-require-full-coverage", "no").Err())
		require.NoError(t, node.Close())
	}
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(),
		DialTimeout: 500 * time.Millisecond, ReadTimeout: time.Second, WriteTimeout: time.Second,
		MaxRedirects: 1, MaxRetries: -1})
	t.Cleanup(func() { _ = client.Close() })
	rec := metrictest.New(t)
	ks, err := NewKeyspace("down:") // a private cluster: nothing to clean up
	require.NoError(t, err)

	// Two collections whose keys live on different masters.
	master := func(name string) int { return c.MasterForSlot(t, ks.Slot(Target{Kind: KindSortedSet, Name: name})) }
	live, dead := "board-0", ""
	for i := 1; dead == ""; i++ {
		if name := "board-" + strconv.Itoa(i); master(name) != master(live) {
			dead = name
		}
	}
	mapper := StreamMapper{"live": SortedSetMapper(live), "dead": SortedSetMapper(dead)}
	p, err := NewRedisProjector(client, mapper, &Config{Prefix: "down:", MeterProvider: rec.Provider})
	require.NoError(t, err)
	// Load the slot map and the script on both masters.
	results, err := p.Handle(ctx, []outbox.Record{record("live", "warm", 1, "1"), record("dead", "warm", 1, "1")})
	require.NoError(t, err)
	require.Equal(t, []outbox.Result{{}, {}}, results)

	byOutcome := func(s metrictest.Snapshot, name, outcome string) int64 {
		return s.Int(metricWrites, attribute.String(AttributeName, name), attribute.String(AttributeOutcome, outcome))
	}
	failed := func(s metrictest.Snapshot, reason string) int64 {
		return s.Int(metricFailed, attribute.String(AttributeReason, reason))
	}
	lagSamples := func(s metrictest.Snapshot) uint64 { return s.Count(metricLag, attribute.String(AttributeName, live)) }
	score := func(member string) float64 {
		got, err := client.ZScore(ctx, ks.ValueKey(Target{Kind: KindSortedSet, Name: live, Member: member}), member).Result()
		require.NoError(t, err)
		return got
	}
	committed := func(batch ...outbox.Record) []outbox.Record {
		for i := range batch {
			batch[i].CreatedAt = time.Now()
		}
		return batch
	}
	before := rec.Collect(t)
	c.Kill(master(dead))

	t.Run("HandleAcknowledgesTheLiveMastersRecords", func(t *testing.T) {
		batch := committed(record("live", "ada", 1, "10"), record("dead", "bob", 1, "20"),
			record("nowhere", "cy", 1, "30"), record("live", "dee", 1, "40"))
		results, err := p.Handle(ctx, batch)
		require.NoError(t, err, "the failure is the dead master's records', not the batch's")
		require.Len(t, results, len(batch))
		require.NoError(t, results[0].Err)
		require.NoError(t, results[3].Err)
		require.Error(t, results[1].Err)
		require.Contains(t, results[1].Err.Error(), "projection: gate script:")
		var mapErr *MapError
		require.ErrorAs(t, results[2].Err, &mapErr, "an unmappable record keeps its own error")
		require.Equal(t, 10.0, score("ada"))
		require.Equal(t, 40.0, score("dee"))

		s := rec.Collect(t)
		require.Equal(t, int64(2), byOutcome(s, live, "applied")-byOutcome(before, live, "applied"), "ada and dee")
		require.Zero(t, byOutcome(s, dead, "applied")-byOutcome(before, dead, "applied"))
		require.Zero(t, byOutcome(s, dead, "unknown"), "bob's call failed: the gate decided nothing")
		require.Equal(t, int64(1), failed(s, reasonRedis), "bob only")
		require.Equal(t, int64(1), failed(s, reasonMap), "cy")
		require.Equal(t, uint64(2), lagSamples(s)-lagSamples(before), "ada and dee")
	})

	t.Run("ProjectFailsTheBatchButCountsTheLiveMastersWrites", func(t *testing.T) {
		before := rec.Collect(t)
		out, err := p.Project(ctx, committed(record("live", "ada", 2, "11"), record("dead", "bob", 2, "21")))
		require.Error(t, err)
		require.Contains(t, err.Error(), "projection: gate script:")
		require.Nil(t, out)
		require.Equal(t, 11.0, score("ada"))

		s := rec.Collect(t)
		require.Equal(t, int64(1), byOutcome(s, live, "applied")-byOutcome(before, live, "applied"), "ada")
		require.Equal(t, int64(1), failed(s, reasonRedis)-failed(before, reasonRedis), "bob only")
		require.Equal(t, uint64(1), lagSamples(s)-lagSamples(before), "ada")
	})

	t.Run("ApplyFailsTheBatch", func(t *testing.T) {
		out, err := p.Gate().Apply(ctx, []Write{zset(live, "ada", 3, 12), zset(dead, "bob", 3, 22)})
		require.Error(t, err)
		require.Nil(t, out)
		require.Equal(t, 12.0, score("ada"), "the live master's group was applied")
	})
}
