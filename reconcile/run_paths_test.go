package reconcile

// Which path a run takes: the repair route a finding is sent by, and what
// SkipOrphans leaves out.

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/projection"
)

// TestStaleDocumentWithForeignValueKeyRepaired pins that stale entries are
// repaired through the gate, not by compare-and-set: the package documents
// that a document reading as stale whose value key holds another type is
// written through the gate, whose SET replaces that key as the relay's
// would. A compare-and-set repair would refuse it (WrongKeyTypeError).
func TestStaleDocumentWithForeignValueKeyRepaired(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, projection.KindDocument)
	b.insert(t, "a", 2)
	b.project(t, "a", 1)
	// A hash where a's value belongs: the version key still holds 1.
	valueKey := b.ks.ValueKey(b.target.target("a"))
	require.NoError(t, b.client.Del(ctx, valueKey).Err())
	require.NoError(t, b.client.HSet(ctx, valueKey, "f", "1").Err())

	rep, err := b.reconciler(t, nil).Run(ctx, RunOptions{})
	require.NoError(t, err)
	require.EqualValues(t, 1, rep.Counts[ClassStale])
	require.EqualValues(t, 1, rep.Repaired)
	require.Equal(t, string(b.value("a", 2).Data), b.client.Get(ctx, valueKey).Val(), "the gate's SET replaced the hash")
	require.Equal(t, "2", b.client.Get(ctx, b.ks.VersionKey(b.target.target("a"))).Val())
}

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
