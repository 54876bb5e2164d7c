package reconcile

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/projection"
)

// TestRunSampleSkipOrphans pins that Config.SkipOrphans turns off the
// orphan sample of a sampled run too, as Config documents, not only the
// orphan scan of a full run: nothing of the projection is sampled, and the
// orphan projected here is neither counted nor removed under a policy
// that would remove it.
func TestRunSampleSkipOrphans(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, projection.KindSortedSet)
	b.insert(t, "a", 1)
	b.project(t, "a", 1)
	b.project(t, "orphan", 1)

	r := b.reconciler(t, &Config{SkipOrphans: true, Policy: Policy{Orphan: ActionRepair}})
	rep, err := r.Run(ctx, RunOptions{Sample: 10})
	require.NoError(t, err)
	require.True(t, rep.Sampled)
	require.EqualValues(t, 1, rep.Checked, "the source is sampled")
	require.Zero(t, rep.Scanned, "the projection is not")
	require.Zero(t, rep.Counts[ClassOrphan])
	require.Equal(t, float64(1*10+len("orphan")), b.client.ZScore(ctx, b.ks.ValueKey(b.target.target("orphan")), "orphan").Val(), "left in place")
}
