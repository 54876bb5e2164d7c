package projection

import (
	"context"
	"strconv"
	"testing"
	"time"

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
