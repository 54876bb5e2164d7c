package projection

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
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
