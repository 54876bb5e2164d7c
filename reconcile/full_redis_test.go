package reconcile

import (
	"context"
	"fmt"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/projection"
)

// TestRepairOnAFullRedis runs a reconciliation against a private Redis at
// maxmemory with the noeviction policy: Redis refuses every repair script
// whole with an OOM error. That is an answer, not a lost reply: the
// findings are not attempted, none is uncertain, and the next run after
// room is made repairs them.
func TestRepairOnAFullRedis(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.StartRedis(t, "--maxmemory-policy", "noeviction")
	client := srv.Client(t)
	b := setupWith(t, projection.KindSortedSet, client, "full:")
	b.insert(t, "current", 1)
	b.project(t, "current", 1)
	b.insert(t, "missing", 1) // repaired through the gate
	b.insert(t, "corrupt", 2) // repaired by compare-and-set
	b.project(t, "corrupt", 2)
	b.setRaw(t, "corrupt", &projection.Value{Score: -1}, nil)
	testenv.FillRedis(t, client)

	rec := b.reconciler(t, nil)
	rep, err := rec.Run(ctx, RunOptions{})
	require.ErrorContains(t, err, "OOM")
	require.EqualValues(t, 1, rep.Counts[ClassMissing])
	require.EqualValues(t, 1, rep.Counts[ClassCorrupt])
	require.Zero(t, rep.Uncertain, "report: %v", rep)
	require.EqualValues(t, 2, rep.Results[ResultNotAttempted], "report: %v", rep)
	require.Equal(t, Projected{}, b.state(t, rec, "missing"), "nothing written")

	require.NoError(t, client.ConfigSet(ctx, "maxmemory", "0").Err())
	rep, err = rec.Run(ctx, RunOptions{})
	require.NoError(t, err)
	require.EqualValues(t, 2, rep.Results[ResultRepaired], "report: %v", rep)
}

// TestRepairOnAFullRedisRemovesOrphans: removing an orphan is a write a
// full Redis allows (it frees memory), so with Orphan: ActionRepair it
// runs, while overwrites are refused and stop the Run, before its orphan
// scan (the README's "Redis full" row says so); CheckKeys removes them.
// Orphans are repaired in calls of their own, after the page's: a call
// never removes before it overwrites, which would let the overwrites
// follow past maxmemory.
func TestRepairOnAFullRedisRemovesOrphans(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.StartRedis(t, "--maxmemory-policy", "noeviction")
	client := srv.Client(t)
	b := setupWith(t, projection.KindSortedSet, client, "full:")
	b.project(t, "a-orphan", 1) // in Redis only
	b.insert(t, "b-corrupt", 2)
	b.project(t, "b-corrupt", 2)
	b.setRaw(t, "b-corrupt", &projection.Value{Score: -1}, nil)
	testenv.FillRedis(t, client)

	rec := b.reconciler(t, &Config{Policy: Policy{Orphan: ActionRepair}})
	rep, err := rec.Run(ctx, RunOptions{})
	require.ErrorContains(t, err, "OOM")
	require.EqualValues(t, 1, rep.Counts[ClassCorrupt], "report: %v", rep)
	require.EqualValues(t, 1, rep.Results[ResultNotAttempted], "report: %v", rep)
	require.Equal(t, float64(-1), b.state(t, rec, "b-corrupt").Score, "nothing written past maxmemory")
	require.Zero(t, rep.Counts[ClassOrphan], "the Run stopped before its orphan scan: report: %v", rep)
	require.True(t, b.state(t, rec, "a-orphan").HasValue)

	rep, err = rec.CheckKeys(ctx, []string{"a-orphan"}, RunOptions{})
	require.NoError(t, err)
	require.EqualValues(t, 1, rep.Counts[ClassOrphan], "report: %v", rep)
	require.EqualValues(t, 1, rep.Results[ResultRepaired], "report: %v", rep)
	require.False(t, b.state(t, rec, "a-orphan").HasValue, "removed on the full Redis")

	require.NoError(t, client.ConfigSet(ctx, "maxmemory", "0").Err())
	rep, err = rec.Run(ctx, RunOptions{})
	require.NoError(t, err)
	require.EqualValues(t, 1, rep.Results[ResultRepaired], "report: %v", rep)
}

// TestRepairOnAFullRedisOverwritesBeforeRemovals: a call that mixes
// removals and overwrites (a row the source took back mid-pass is removed
// beside its page's overwrites) sends the overwrites first, so that a full
// Redis refuses the call whole: a removal first, which a full Redis
// allows, would let the overwrites after it pass maxmemory.
func TestRepairOnAFullRedisOverwritesBeforeRemovals(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.StartRedis(t, "--maxmemory-policy", "noeviction")
	client := srv.Client(t)
	b := setupWith(t, projection.KindSortedSet, client, "full:")
	b.project(t, "a-gone", 1)
	corrupt := b.insert(t, "b-corrupt", 2)
	b.project(t, "b-corrupt", 2)
	b.setRaw(t, "b-corrupt", &projection.Value{Score: -1}, nil)
	rec := b.reconciler(t, nil)
	findings := []*Finding{
		{Class: ClassOrphan, Key: "a-gone", Projected: b.state(t, rec, "a-gone")},
		{Class: ClassCorrupt, Key: "b-corrupt", Source: &corrupt, Projected: b.state(t, rec, "b-corrupt")},
	}
	testenv.FillRedis(t, client)

	_, err := rec.casRepair(ctx, findings)
	require.ErrorContains(t, err, "OOM")
	require.Equal(t, float64(-1), b.state(t, rec, "b-corrupt").Score, "nothing written past maxmemory")
	require.True(t, b.state(t, rec, "a-gone").HasValue, "refused whole")
	require.Equal(t, "a-gone", findings[0].Key, "the caller's order is left as it was")
}

// TestRepairOnOneFullShard: documents spread over a Ring, one of whose
// shards is full. The gate sends one script per shard: the healthy shard's
// repairs are applied, so the findings of a call that failed with OOM are
// uncertain (which of them were written, the error does not say), never
// "not attempted" (nothing written).
func TestRepairOnOneFullShard(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	full := testenv.StartRedis(t, "--maxmemory-policy", "noeviction")
	healthy := testenv.StartRedis(t)
	ring := redis.NewRing(&redis.RingOptions{
		Addrs:       map[string]string{"a": full.Addr(), "b": healthy.Addr()},
		HeartbeatFn: func(context.Context, *redis.Client) bool { return true },
	})
	t.Cleanup(func() { _ = ring.Close() })
	b := setupWith(t, projection.KindDocument, ring, "ring:")
	const n = 40
	for i := range n {
		b.insert(t, fmt.Sprintf("user-%d", i), 1) // all missing from Redis
	}
	testenv.FillRedis(t, full.Client(t))

	rec := b.reconciler(t, &Config{SkipOrphans: true})
	rep, err := rec.Run(ctx, RunOptions{})
	require.ErrorContains(t, err, "OOM")
	written := 0
	for i := range n {
		if b.state(t, rec, fmt.Sprintf("user-%d", i)).HasValue {
			written++
		}
	}
	require.NotZero(t, written, "setup: the healthy shard took none")
	require.Less(t, written, n, "setup: the full shard took some")
	require.Zero(t, rep.Results[ResultNotAttempted], "report: %v", rep)
	require.EqualValues(t, n, rep.Uncertain, "report: %v", rep)
}

// TestRepairOnAReplicaIsUncertain: a replica refuses every write with
// READONLY, but that reply is no proof that nothing was written: go-redis
// retries a command on READONLY, and on a connection that broke before the
// reply came, so a master demoted by a failover can answer the retry of an
// attempt that was applied. The repairs are uncertain, not "not attempted"
// (ResultUncertain's doc).
func TestRepairOnAReplicaIsUncertain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.StartRedis(t)
	client := srv.Client(t)
	b := setupWith(t, projection.KindSortedSet, client, "replica:")
	b.insert(t, "current", 1)
	b.project(t, "current", 1)
	b.insert(t, "missing", 1) // repaired through the gate
	b.insert(t, "corrupt", 2) // repaired by compare-and-set
	b.project(t, "corrupt", 2)
	b.setRaw(t, "corrupt", &projection.Value{Score: -1}, nil)
	// A replica of a master that never answers keeps its data and refuses
	// writes.
	require.NoError(t, client.Do(ctx, "REPLICAOF", "127.0.0.1", "1").Err())

	rec := b.reconciler(t, nil)
	rep, err := rec.Run(ctx, RunOptions{})
	require.ErrorContains(t, err, "READONLY")
	require.EqualValues(t, 1, rep.Counts[ClassMissing], "report: %v", rep)
	require.EqualValues(t, 1, rep.Counts[ClassCorrupt], "report: %v", rep)
	require.EqualValues(t, 2, rep.Uncertain, "report: %v", rep)
	require.EqualValues(t, 2, rep.Results[ResultUncertain], "report: %v", rep)
	require.Equal(t, Projected{}, b.state(t, rec, "missing"), "a replica writes nothing")

	require.NoError(t, client.Do(ctx, "REPLICAOF", "NO", "ONE").Err())
	rep, err = rec.Run(ctx, RunOptions{})
	require.NoError(t, err)
	require.EqualValues(t, 2, rep.Results[ResultRepaired], "report: %v", rep)
}
