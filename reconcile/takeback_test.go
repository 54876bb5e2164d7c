package reconcile

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/projection"
)

// afterLookup calls after once, right after its n-th Lookup (from 1)
// returned.
type afterLookup struct {
	Source
	n, calls atomic.Int32
	after    func()
}

func (s *afterLookup) Lookup(ctx context.Context, keys []string) ([]Row, error) {
	rows, err := s.Source.Lookup(ctx, keys)
	if err == nil && s.calls.Add(1) == s.n.Load() {
		s.after()
	}
	return rows, err
}

// TestTakenBackEntriesMeetWritesCommittedMeanwhile: after PostgreSQL went
// back (the leaderboard's "When PostgreSQL goes back"), Redis holds
// versions the source lost, and the forced ahead and orphan repairs take
// them back. A write committed after the confirming lookup reuses a lost
// version: its delivery met the entry's higher version and was refused as
// stale, and the repair then wrote the source's older state over it (or
// removed the re-created entity), behind the source with nothing left in
// the outbox. The run now looks the entries it took back up once more and
// writes what the source holds through the gate; and an entity created
// again between the orphan scan's two lookups, which the scan dropped,
// is classified against its row.
func TestTakenBackEntriesMeetWritesCommittedMeanwhile(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	forced := &Config{Policy: Policy{Ahead: ActionRepair, Orphan: ActionRepair}}
	for _, kind := range []projection.Kind{projection.KindSortedSet, projection.KindHash, projection.KindDocument} {
		t.Run("Ahead"+kindName(kind), func(t *testing.T) {
			t.Parallel()
			b := setup(t, kind)
			b.insert(t, "u1", 2)
			require.Equal(t, projection.OutcomeApplied, b.project(t, "u1", 4), "the commit PostgreSQL lost")
			src := &afterLookup{Source: b.source}
			src.n.Store(1)
			src.after = func() {
				b.insert(t, "u1", 3)
				require.Equal(t, projection.OutcomeStale, b.project(t, "u1", 3), "delivered before the repair")
			}
			r, err := New(src, b.target, forced)
			require.NoError(t, err)
			rep, err := r.Run(ctx, RunOptions{})
			require.NoError(t, err)
			require.Equal(t, int64(1), rep.Counts[ClassAhead], "%v", rep.Counts)
			got := b.state(t, r, "u1")
			require.Equal(t, int64(3), got.Version, "the source's version 3, not the 2 the repair wrote")
			want := b.value("u1", 3)
			require.Equal(t, float64(want.Score), got.Score)
			require.Equal(t, want.Data, got.Data)
		})
	}
	// The orphan scan looks the entries up once (u2 absent), reads them
	// from Redis, then looks them up again to confirm before the removal.
	// The user is created again after the first lookup (then it is no
	// orphan: it is classified against its row, ahead, and the forced
	// repair takes it to the row's version; it was left at the lost one),
	// or after the second (the removal happens, then the new row is
	// written).
	for n, class := range map[int32]Class{1: ClassAhead, 2: ClassOrphan} {
		t.Run(fmt.Sprintf("OrphanCreatedAfterLookup%d", n), func(t *testing.T) {
			t.Parallel()
			b := setup(t, projection.KindSortedSet)
			b.insert(t, "u0", 1)
			b.project(t, "u0", 1)
			require.Equal(t, projection.OutcomeApplied, b.project(t, "u2", 2), "a user PostgreSQL lost")
			src := &afterLookup{Source: b.source}
			src.n.Store(n)
			var delivered projection.Outcome
			src.after = func() {
				b.insert(t, "u2", 1)
				delivered = b.project(t, "u2", 1)
			}
			r, err := New(src, b.target, forced)
			require.NoError(t, err)
			rep, err := r.Run(ctx, RunOptions{})
			require.NoError(t, err)
			require.Equal(t, projection.OutcomeStale, delivered)
			require.Equal(t, int64(1), rep.Counts[class], "%v", rep.Counts)
			require.Equal(t, int64(1), rep.Results[ResultRepaired], "%v", rep.Counts)
			got := b.state(t, r, "u2")
			require.True(t, got.HasValue, "u2 removed, though the source has it")
			require.Equal(t, int64(1), got.Version)
		})
	}
}
