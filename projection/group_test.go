package projection

import (
	"fmt"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// TestGroupArgsLinearInBatch: on a Cluster (or Ring) gate every document
// of a batch may fall in its own slot group. Each group's argument slice
// was made with room for the whole batch, so a batch of n documents over
// n slots reserved n × 5n arguments: 76 MB for the relay's default batch
// of 1,000, 5.7 GB and 8.8 s for 10,000. The room reserved must stay
// linear in the batch.
func TestGroupArgsLinearInBatch(t *testing.T) {
	t.Parallel()
	// No server is asked: grouping computes slots locally.
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{"127.0.0.1:1"}})
	t.Cleanup(func() { _ = client.Close() })
	ks, err := NewKeyspace("p:")
	require.NoError(t, err)
	g := NewGate(client, ks)
	for _, n := range []int{1, 10, 2000} {
		writes := make([]Write, n)
		idx := make([]int, n)
		for i := range writes {
			writes[i] = doc(fmt.Sprint("doc", i), 5, "x")
			idx[i] = i
		}
		groups := g.group(modeLive, "", writes, idx)
		require.Greater(t, len(groups), n/2, "n=%d: documents spread over slots", n)
		var used, reserved int
		for _, grp := range groups {
			used += len(grp.args)
			reserved += cap(grp.args)
		}
		// At most the first group's room for the whole batch, and twice
		// what the others use (append's growth).
		require.LessOrEqual(t, reserved, 2+5*n+2*used, "n=%d: %d groups reserved %d arguments for %d used", n, len(groups), reserved, used)
	}
}
