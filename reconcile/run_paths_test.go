package reconcile

// Which path a run takes: the repair route a finding is sent by, and what
// SkipOrphans leaves out.

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/projection"
)

// TestStaleDocumentWithForeignValueKeyRefused: a document that reads as
// stale (its version key holds an older version) is repaired through the
// gate, and its value key holding another type is refused there, as a
// compare-and-set repair refuses one: a *WrongKeyTypeError, nothing
// written, the foreign key kept. Deleted by hand, the next run repairs it.
func TestStaleDocumentWithForeignValueKeyRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, projection.KindDocument)
	b.insert(t, "a", 2)
	b.project(t, "a", 1)
	b.insert(t, "b", 2) // stale too, repaired in the same gate call
	b.project(t, "b", 1)
	// A hash where a's value belongs: the version key still holds 1.
	valueKey := b.ks.ValueKey(b.target.target("a"))
	versionKey := b.ks.VersionKey(b.target.target("a"))
	require.NoError(t, b.client.Del(ctx, valueKey).Err())
	require.NoError(t, b.client.HSet(ctx, valueKey, "f", "1").Err())

	r := b.reconciler(t, nil)
	rep, err := r.Run(ctx, RunOptions{})
	require.ErrorIs(t, err, projection.ErrWrongKeyType)
	var wt *WrongKeyTypeError
	require.ErrorAs(t, err, &wt)
	require.Equal(t, WrongKeyTypeError{Key: "a", RedisKey: valueKey, Type: "hash"}, *wt)
	require.EqualValues(t, 2, rep.Counts[ClassStale])
	require.EqualValues(t, 1, rep.Results[ResultNotAttempted])
	require.EqualValues(t, 1, rep.Repaired, "b")
	require.Equal(t, map[string]string{"f": "1"}, b.client.HGetAll(ctx, valueKey).Val(), "the foreign key is kept")
	require.Equal(t, "1", b.client.Get(ctx, versionKey).Val(), "nothing written for a")
	require.Equal(t, string(b.value("b", 2).Data), b.client.Get(ctx, b.ks.ValueKey(b.target.target("b"))).Val())

	require.NoError(t, b.client.Del(ctx, valueKey).Err())
	rep, err = r.Run(ctx, RunOptions{})
	require.NoError(t, err)
	require.EqualValues(t, 1, rep.Repaired)
	require.Equal(t, string(b.value("a", 2).Data), b.client.Get(ctx, valueKey).Val())
	require.Equal(t, "2", b.client.Get(ctx, versionKey).Val())
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
