package reconcile

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sort"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/projection"
)

// withBuckets returns b with its keyspace, gate and target moved to n
// version buckets (same source, client and prefix).
func (b *testBundle) withBuckets(t testing.TB, n int) *testBundle {
	t.Helper()
	ks, err := b.ks.WithVersionBuckets(n)
	require.NoError(t, err)
	out := *b
	out.ks = ks
	out.gate = projection.NewGate(b.client, ks)
	out.target.Keyspace = ks
	return &out
}

// snapshot DUMPs every key under the bundle's collection — value, layout,
// marker, shadows, copy count, and version hashes of the unbucketed layout
// and of layouts 1..16 — so a test can assert that a refused call wrote
// nothing.
func (b *testBundle) snapshot(t testing.TB) map[string]string {
	t.Helper()
	k, n := b.kind, b.target.Name
	keys := []string{b.ks.ValueKey(b.target.target("")), b.ks.LayoutKey(n, k), b.ks.RebuildMarkerKey(n, k),
		b.ks.ShadowValueKey(n, k), b.ks.ShadowLayoutKey(n, k), b.ks.RebuildCopyKey(n, k)}
	for buckets := 0; buckets <= 16; buckets++ {
		ks := withBuckets(b.ks, buckets)
		keys = append(keys, ks.VersionKeys(n, k)...)
		keys = append(keys, ks.ShadowVersionKeys(n, k)...)
	}
	out := map[string]string{}
	for _, key := range keys {
		v, err := b.client.Dump(context.Background(), key).Result()
		if errors.Is(err, redis.Nil) {
			continue
		}
		require.NoError(t, err)
		out[key] = v
	}
	return out
}

// layoutOf returns the collection's layout key ("" when absent).
func (b *testBundle) layoutOf(t testing.TB) string {
	t.Helper()
	v, err := b.client.Get(context.Background(), b.ks.LayoutKey(b.target.Name, b.kind)).Result()
	if errors.Is(err, redis.Nil) {
		return ""
	}
	require.NoError(t, err)
	return v
}

func TestBucketsRunClasses(t *testing.T) {
	t.Parallel()
	for _, kind := range []projection.Kind{projection.KindSortedSet, projection.KindHash} {
		t.Run(kindName(kind), func(t *testing.T) {
			t.Parallel()
			b := setup(t, kind).withBuckets(t, 4)
			want := b.drift(t)
			require.Equal(t, "4", b.layoutOf(t))
			ctx := context.Background()
			r := b.reconciler(t, &Config{PageSize: 3})
			rep, err := r.Run(ctx, RunOptions{})
			require.NoError(t, err)
			require.Equal(t, countClasses(want), rep.Counts)
			require.EqualValues(t, 5, rep.Repaired) // missing, stale, 3 corrupt
			require.EqualValues(t, 3, rep.Skipped)  // ahead and 2 orphans, reported only
			require.False(t, rep.OrphanScanSkipped)
			for _, key := range []string{"miss", "stale", "corrupt", "bad{ver}", "nover"} {
				rows, err := b.source.Lookup(ctx, []string{key})
				require.NoError(t, err)
				require.Equal(t, ClassCurrent, Classify(kind, &rows[0], b.state(t, r, key)), key)
			}

			// Forcing ahead and orphans goes through the compare-and-set
			// script, bucket keys included.
			r = b.reconciler(t, &Config{PageSize: 3, Policy: Policy{Ahead: ActionRepair, Orphan: ActionRepair}})
			rep, err = r.Run(ctx, RunOptions{})
			require.NoError(t, err)
			require.EqualValues(t, 3, rep.Repaired)
			rep, err = r.Run(ctx, RunOptions{})
			require.NoError(t, err)
			require.Equal(t, map[Class]int64{ClassCurrent: 7}, rep.Counts)
			require.True(t, rep.OrphanScanSkipped, "bucket counts add up to the source")

			// Nothing ever went to the unbucketed hash.
			flat := withBuckets(b.ks, 0)
			require.Zero(t, b.client.Exists(ctx, flat.VersionKey(b.target.target("cur"))).Val())
		})
	}
}

func TestBucketsOrphanScan(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindHash).withBuckets(t, 7)
	rows := b.insertMany(t, 300)
	b.projectRows(t, rows[:250])
	r := b.reconciler(t, &Config{PageSize: 32})
	rep, err := r.Run(context.Background(), RunOptions{})
	require.NoError(t, err)
	require.EqualValues(t, 50, rep.Repaired)
	require.True(t, rep.OrphanScanSkipped)

	for i := range 5 {
		b.project(t, fmt.Sprintf("orphan%d", i), 1)
	}
	b.setRaw(t, rows[0].Key, nil, ptr("")) // value without version
	rep, err = r.Run(context.Background(), RunOptions{})
	require.NoError(t, err)
	require.False(t, rep.OrphanScanSkipped)
	require.EqualValues(t, 305, rep.Scanned, "304 versions over 7 buckets + the versionless value")
	require.EqualValues(t, 5, rep.Counts[ClassOrphan])
	require.EqualValues(t, 1, rep.Counts[ClassCorrupt])
}

func TestBucketsRunSample(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet).withBuckets(t, 16)
	rows := b.insertMany(t, 2000)
	projected := append([]Row(nil), rows...)
	for i := range 500 {
		key := fmt.Sprintf("orphan%03d", i)
		projected = append(projected, Row{Key: key, Version: 1, Value: b.value(key, 1)})
	}
	b.projectRows(t, projected)
	_, err := b.pool.Exec(context.Background(), "ANALYZE items")
	require.NoError(t, err)
	r := b.reconciler(t, &Config{PageSize: 50})
	rep, err := r.Run(context.Background(), RunOptions{Sample: 300, DryRun: true})
	require.NoError(t, err)
	require.EqualValues(t, 300, rep.Scanned, "300 distinct versioned entries sampled from the buckets")
	// 20% of the projection are orphans: 60 expected, 25..95 is beyond 4 sigma.
	require.InDelta(t, 60, rep.Counts[ClassOrphan], 35)
}

func TestBucketsVersionsNearMaxInt64(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindHash).withBuckets(t, 3)
	b.insert(t, "max", math.MaxInt64)
	b.project(t, "max", math.MaxInt64)
	b.insert(t, "below", math.MaxInt64)
	b.project(t, "below", math.MaxInt64-1)
	b.insert(t, "ahead", 1<<53)
	b.project(t, "ahead", 1<<53+1)
	r := b.reconciler(t, nil)
	rep, err := r.Run(context.Background(), RunOptions{})
	require.NoError(t, err)
	require.Equal(t, map[Class]int64{ClassCurrent: 1, ClassStale: 1, ClassAhead: 1}, rep.Counts)
	require.Equal(t, int64(math.MaxInt64), b.state(t, r, "below").Version)
}

func TestBucketsLayoutMismatch(t *testing.T) {
	t.Parallel()
	t.Run("RunRefusedNothingWritten", func(t *testing.T) {
		t.Parallel()
		four := setup(t, projection.KindSortedSet).withBuckets(t, 4)
		four.drift(t) // plenty to repair
		before := four.snapshot(t)
		for _, n := range []int{0, 2, 8} {
			other := four.withBuckets(t, n)
			r := other.reconciler(t, &Config{Policy: Policy{Ahead: ActionRepair, Orphan: ActionRepair}})
			_, err := r.Run(context.Background(), RunOptions{})
			var lm *projection.LayoutMismatchError
			require.ErrorAs(t, err, &lm, "%d buckets", n)
			require.Equal(t, projection.LayoutMismatchError{Kind: projection.KindSortedSet, Name: testBoard, Stored: 4, Configured: n}, *lm)
			// A dry run writes nothing anyway; the read itself must refuse to
			// classify versions looked up in the wrong buckets.
			_, err = r.Run(context.Background(), RunOptions{DryRun: true})
			require.ErrorIs(t, err, projection.ErrLayoutMismatch)
			_, err = r.CheckKeys(context.Background(), []string{"miss", "orphan"}, RunOptions{})
			require.ErrorIs(t, err, projection.ErrLayoutMismatch)
			_, err = r.Run(context.Background(), RunOptions{Sample: 5})
			require.ErrorIs(t, err, projection.ErrLayoutMismatch)
			require.Equal(t, before, four.snapshot(t), "nothing written with %d buckets", n)
		}
	})

	// A sampled run whose source sample is empty reads no row, so only the
	// orphan sample can find the mismatch: it checked nothing and found no
	// member in the version keys of the configured layout, which the
	// collection does not use, and so reported no drift.
	t.Run("SampleOfAnEmptySource", func(t *testing.T) {
		t.Parallel()
		four := setup(t, projection.KindSortedSet).withBuckets(t, 4)
		for _, k := range []string{"a", "b", "c"} {
			four.project(t, k, 1) // orphans: the source has no rows
		}
		for _, n := range []int{0, 2} {
			r := four.withBuckets(t, n).reconciler(t, nil)
			rep, err := r.Run(context.Background(), RunOptions{Sample: 10})
			var lm *projection.LayoutMismatchError
			require.ErrorAs(t, err, &lm, "%d buckets: report %s", n, rep)
			require.Equal(t, projection.LayoutMismatchError{Kind: projection.KindSortedSet, Name: testBoard, Stored: 4, Configured: n}, *lm)
		}
		// Each of the 200 draws picks one of the 4 buckets, so a bucket
		// holding one of the 3 members goes undrawn with odds of (3/4)^200:
		// with 10 draws, CI once found 2 of the 3.
		rep, err := four.reconciler(t, nil).Run(context.Background(), RunOptions{Sample: 200, DryRun: true})
		require.NoError(t, err)
		require.Equal(t, map[Class]int64{ClassOrphan: 3}, rep.Counts, "the sample finds them with the stored layout")
	})

	// Written before layouts were recorded: values and the unbucketed
	// version hash, no layout key. It has layout 0, which the first repair
	// records, as the gate's first write would.
	t.Run("LegacyCollection", func(t *testing.T) {
		t.Parallel()
		flat := setup(t, projection.KindHash)
		want := flat.drift(t)
		require.Equal(t, "0", flat.layoutOf(t))
		require.NoError(t, flat.client.Del(context.Background(), flat.ks.LayoutKey(testBoard, flat.kind)).Err())
		before := flat.snapshot(t)
		_, err := flat.withBuckets(t, 4).reconciler(t, nil).Run(context.Background(), RunOptions{})
		var lm *projection.LayoutMismatchError
		require.ErrorAs(t, err, &lm)
		require.Equal(t, 0, lm.Stored)
		require.Equal(t, before, flat.snapshot(t))

		// Only the compare-and-set path, so that the gate's adoption does
		// not hide the script's.
		r := flat.reconciler(t, &Config{Policy: Policy{Missing: ActionReport, Stale: ActionReport}})
		rep, err := r.Run(context.Background(), RunOptions{})
		require.NoError(t, err)
		require.Equal(t, countClasses(want), rep.Counts)
		require.EqualValues(t, 3, rep.Repaired, "the corrupt entries")
		require.Equal(t, "0", flat.layoutOf(t))
	})

	// An unbucketed collection whose version hash is gone entirely (its
	// last entry HDEL'd, or the hash evicted) keeps its recorded layout 0:
	// its values classify as corrupt and are repaired from the source, as
	// are redeliveries through the gate.
	t.Run("UnbucketedLostVersionHash", func(t *testing.T) {
		t.Parallel()
		for _, kind := range []projection.Kind{projection.KindSortedSet, projection.KindHash} {
			t.Run(kindName(kind), func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				flat := setup(t, kind)
				for _, k := range []string{"a", "b", "c"} {
					flat.insert(t, k, 3)
					flat.project(t, k, 3)
				}
				versions := flat.ks.VersionKey(flat.target.target(""))
				require.NoError(t, flat.client.Del(ctx, versions).Err())
				require.Equal(t, "0", flat.layoutOf(t))

				r := flat.reconciler(t, nil)
				rep, err := r.Run(ctx, RunOptions{})
				require.NoError(t, err)
				require.Equal(t, map[Class]int64{ClassCorrupt: 3}, rep.Counts)
				require.EqualValues(t, 3, rep.Repaired)
				rep, err = r.Run(ctx, RunOptions{DryRun: true})
				require.NoError(t, err)
				require.Equal(t, map[Class]int64{ClassCurrent: 3}, rep.Counts)

				require.NoError(t, flat.client.Del(ctx, versions).Err())
				require.Equal(t, projection.OutcomeApplied, flat.project(t, "c", 3), "a redelivery applies")
			})
		}
	})

	t.Run("EmptyCollectionAdoptsTheLayout", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindSortedSet).withBuckets(t, 4)
		b.insertMany(t, 10)
		// Only the compare-and-set path: a corrupt entry (a value without a
		// version) in an otherwise empty, layout-less collection.
		b.setRaw(t, "k0000000", &projection.Value{Score: 5}, nil)
		require.Empty(t, b.layoutOf(t))
		_, err := b.reconciler(t, nil).Run(context.Background(), RunOptions{})
		var lm *projection.LayoutMismatchError
		require.ErrorAs(t, err, &lm)
		require.Equal(t, -1, lm.Stored, "values without a layout key or unbucketed version hash: a lost layout key")

		require.NoError(t, b.client.Del(context.Background(), b.ks.ValueKey(b.target.target(""))).Err())
		rep, err := b.reconciler(t, nil).Run(context.Background(), RunOptions{})
		require.NoError(t, err)
		require.EqualValues(t, 10, rep.Repaired)
		require.Equal(t, "4", b.layoutOf(t))
	})

	// A bucketed collection that lost its layout key looks, to a Keyspace
	// without buckets, like values without versions: every entry corrupt,
	// and repairing them would overwrite a@7, ahead of the source, and give
	// the gate a flat hash to accept stale writes against.
	t.Run("LostLayoutKey", func(t *testing.T) {
		t.Parallel()
		for _, kind := range []projection.Kind{projection.KindSortedSet, projection.KindHash} {
			t.Run(kindName(kind), func(t *testing.T) {
				t.Parallel()
				flat := setup(t, kind)
				four := flat.withBuckets(t, 4)
				flat.insert(t, "a", 5)
				flat.insert(t, "b", 3)
				four.project(t, "a", 7)
				four.project(t, "b", 3)
				require.NoError(t, flat.client.Del(context.Background(), flat.ks.LayoutKey(testBoard, kind)).Err())
				before := flat.snapshot(t)

				r := flat.reconciler(t, nil)
				_, err := r.Run(context.Background(), RunOptions{})
				var lm *projection.LayoutMismatchError
				require.ErrorAs(t, err, &lm)
				require.Equal(t, projection.LayoutMismatchError{Kind: kind, Name: testBoard, Stored: -1, Configured: 0}, *lm)
				// The read refuses on its own, repairs or not.
				_, err = r.Run(context.Background(), RunOptions{DryRun: true})
				require.ErrorAs(t, err, &lm)
				require.Equal(t, -1, lm.Stored)
				_, err = r.CheckKeys(context.Background(), []string{"a"}, RunOptions{})
				require.ErrorIs(t, err, projection.ErrLayoutMismatch)
				require.Equal(t, before, flat.snapshot(t), "nothing written")

				// The gate still refuses a stale redelivery of b.
				_, err = flat.gate.Apply(context.Background(), []projection.Write{{Target: flat.target.target("b"), Version: 1, Value: flat.value("b", 1)}})
				require.ErrorIs(t, err, projection.ErrLayoutMismatch)
			})
		}
	})

	// The layout key is read fine, then the collection loses it and its
	// unbucketed version hash: the compare-and-set script refuses by the
	// same rule (the gate refuses the missing and stale repairs on its own).
	t.Run("LostLayoutKeyBeforeRepair", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindSortedSet)
		b.drift(t)
		flatVersions := b.ks.VersionKey(b.target.target(""))
		var before map[string]string
		r := b.reconciler(t, &Config{PageSize: 100, BeforeRepair: func(ctx context.Context, f Finding) bool {
			if before == nil {
				require.NoError(t, b.client.Del(ctx, flatVersions, b.ks.LayoutKey(testBoard, b.kind)).Err())
				before = b.snapshot(t)
			}
			return true
		}})
		rep, err := r.Run(context.Background(), RunOptions{})
		var lm *projection.LayoutMismatchError
		require.ErrorAs(t, err, &lm)
		require.Equal(t, -1, lm.Stored)
		require.Zero(t, rep.Repaired)
		require.EqualValues(t, 5, rep.Results[ResultNotAttempted], "gate and compare-and-set repairs both refused")
		require.Equal(t, before, b.snapshot(t))
	})

	t.Run("LayoutChangedBeforeRepair", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindSortedSet).withBuckets(t, 4)
		b.drift(t)
		layout := b.ks.LayoutKey(testBoard, b.kind)
		var before map[string]string
		r := b.reconciler(t, &Config{PageSize: 100, BeforeRepair: func(ctx context.Context, f Finding) bool {
			if before == nil {
				// Someone migrated the collection between read and repair.
				require.NoError(t, b.client.Set(ctx, layout, "9", 0).Err())
				before = b.snapshot(t)
			}
			return true
		}})
		rep, err := r.Run(context.Background(), RunOptions{})
		require.ErrorIs(t, err, projection.ErrLayoutMismatch)
		require.Zero(t, rep.Repaired)
		require.Zero(t, rep.Uncertain, "refused before writing: not attempted, not uncertain")
		require.EqualValues(t, 5, rep.Results[ResultNotAttempted], "gate and compare-and-set repairs both refused")
		require.Equal(t, before, b.snapshot(t))
	})

	// A foreign value written into the layout key between read and repair
	// is an unreadable layout for both scripts, however the error reply
	// that carries it would split ("1 2", "") or read (" 4", "4 " as 4;
	// "4\n" as 4 and "8\n" as 8, trimmed by Redis): one Run reports it
	// alike for the gate's repairs and the compare-and-set ones.
	t.Run("UnreadableLayoutBeforeRepair", func(t *testing.T) {
		t.Parallel()
		for name, stored := range map[string]string{"Empty": "", "TwoFields": "1 2", "TrailingSpace": "4 ", "LeadingSpace": " 4",
			"TrailingNewline": "4\n", "TrailingNewlineOtherCount": "8\n", "TrailingCRLFOtherCount": "16\r\n", "Letter": "x"} {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				b := setup(t, projection.KindSortedSet).withBuckets(t, 4)
				b.drift(t)
				var before map[string]string
				r := b.reconciler(t, &Config{PageSize: 100, BeforeRepair: func(ctx context.Context, f Finding) bool {
					if before == nil {
						require.NoError(t, b.client.Set(ctx, b.ks.LayoutKey(testBoard, b.kind), stored, 0).Err())
						before = b.snapshot(t)
					}
					return true
				}})
				rep, err := r.Run(context.Background(), RunOptions{})
				lms := layoutMismatches(err)
				require.Len(t, lms, 2, "the gate's repairs and the compare-and-set ones: %v", err)
				for _, lm := range lms {
					require.Equal(t, projection.LayoutMismatchError{Kind: projection.KindSortedSet, Name: testBoard, Stored: -1, Configured: 4}, *lm,
						"stored %q is no bucket count", stored)
				}
				require.Zero(t, rep.Repaired)
				require.Zero(t, rep.Uncertain, "refused before writing: not attempted, not uncertain")
				require.EqualValues(t, 5, rep.Results[ResultNotAttempted], "gate and compare-and-set repairs both refused")
				require.Equal(t, before, b.snapshot(t))
			})
		}
	})
}

// TestRebuildMigratesLayout changes a live collection's bucket count with
// Rebuild: 0 → 8 → 3 → 0, each time with drift to fix, and checks that the
// new layout is the only one left and the only one the gate accepts.
func TestRebuildMigratesLayout(t *testing.T) {
	t.Parallel()
	for _, kind := range []projection.Kind{projection.KindSortedSet, projection.KindHash} {
		t.Run(kindName(kind), func(t *testing.T) {
			t.Parallel()
			flat := setup(t, kind)
			rows := flat.insertMany(t, 400)
			flat.projectRows(t, rows[:390])
			flat.project(t, "orphan", 1)
			ctx := context.Background()
			prev := flat
			for _, n := range []int{8, 3, 0} {
				next := flat.withBuckets(t, n)
				prev.project(t, "orphan", 2) // drift the rebuild removes
				rep, err := next.reconciler(t, &Config{PageSize: 64}).Rebuild(ctx)
				require.NoError(t, err, "to %d buckets", n)
				require.True(t, rep.Switched)
				require.EqualValues(t, 400, rep.Rows)

				require.Equal(t, fmt.Sprint(n), next.layoutOf(t))
				// Only the new layout's keys are left.
				var keys []string
				for k := range next.snapshot(t) {
					keys = append(keys, k)
				}
				want := append([]string{next.ks.ValueKey(next.target.target("")), next.ks.LayoutKey(testBoard, kind)},
					next.ks.VersionKeys(testBoard, kind)...)
				sort.Strings(keys)
				sort.Strings(want)
				require.Equal(t, want, keys, "to %d buckets", n)

				run, err := next.reconciler(t, nil).Run(ctx, RunOptions{DryRun: true})
				require.NoError(t, err)
				require.Equal(t, map[Class]int64{ClassCurrent: 400}, run.Counts)
				require.True(t, run.OrphanScanSkipped)

				// The old layout's gate is refused, the new one's works.
				_, err = prev.gate.Apply(ctx, []projection.Write{{Target: prev.target.target(rows[0].Key), Version: 9, Value: prev.value(rows[0].Key, 9)}})
				if prev.ks.VersionBuckets() != n {
					require.ErrorIs(t, err, projection.ErrLayoutMismatch)
				}
				require.Equal(t, projection.OutcomeDuplicate, next.project(t, rows[1].Key, 1))
				prev = next
			}
		})
	}
}

// TestRebuildLostLayoutKey rebuilds a bucketed collection that lost its
// layout key: the old bucket count is unknown, so the switch must remove
// every bucket, or the stale versions of buckets the new layout does not
// overwrite would come back.
func TestRebuildLostLayoutKey(t *testing.T) {
	t.Parallel()
	// Every target count is below the old one (6): buckets the new layout
	// writes would hide a missing sweep.
	for _, n := range []int{0, 2, 3} {
		t.Run(fmt.Sprintf("To%d", n), func(t *testing.T) {
			t.Parallel()
			rebuildLostLayout(t, setup(t, projection.KindHash), n, "")
		})
	}
	// A layout key that holds no bucket count (a hand edit) is as good as
	// lost: the gate and Run refuse the collection, and Rebuild, which
	// their errors recommend, replaces it.
	t.Run("Unreadable", func(t *testing.T) {
		t.Parallel()
		rebuildLostLayout(t, setup(t, projection.KindSortedSet), 2, "garbage")
	})
}

// rebuildLostLayout projects rows into b's collection with 6 buckets,
// deletes its layout key (or, with garbage set, overwrites it) and
// rebuilds it with n buckets.
func rebuildLostLayout(t *testing.T, b *testBundle, n int, garbage string) {
	t.Helper()
	six := b.withBuckets(t, 6)
	rows := b.insertMany(t, 60)
	six.projectRows(t, rows)
	six.project(t, "orphan", 1)
	ctx := context.Background()
	require.Equal(t, int64(6), countExisting(t, six, six.ks.VersionKeys(testBoard, b.kind)))
	if garbage == "" {
		require.NoError(t, b.client.Del(ctx, b.ks.LayoutKey(testBoard, b.kind)).Err())
	} else {
		require.NoError(t, b.client.Set(ctx, b.ks.LayoutKey(testBoard, b.kind), garbage, 0).Err())
		_, err := six.reconciler(t, nil).Run(ctx, RunOptions{DryRun: true})
		require.ErrorIs(t, err, projection.ErrLayoutMismatch, "the collection is unreadable")
	}

	next := b.withBuckets(t, n)
	rep, err := next.reconciler(t, nil).Rebuild(ctx)
	require.NoError(t, err)
	require.True(t, rep.Switched)
	var keys []string
	for k := range next.snapshot(t) {
		keys = append(keys, k)
	}
	want := append([]string{next.ks.ValueKey(next.target.target("")), next.ks.LayoutKey(testBoard, b.kind)},
		next.ks.VersionKeys(testBoard, b.kind)...)
	sort.Strings(keys)
	sort.Strings(want)
	require.Equal(t, want, keys, "only the new layout's keys are left")
	run, err := next.reconciler(t, nil).Run(ctx, RunOptions{DryRun: true})
	require.NoError(t, err)
	require.Equal(t, map[Class]int64{ClassCurrent: 60}, run.Counts)
	require.True(t, run.OrphanScanSkipped)
}

// TestRebuildMigrationUnderWrites migrates 0 → 16 buckets while the outbox
// keeps writing through an unbucketed gate (which dual-writes into the new
// layout's shadow keys, then is refused after the switch and replaced).
func TestRebuildMigrationUnderWrites(t *testing.T) {
	t.Parallel()
	forKinds(t, collectionKinds, func(t *testing.T, b *testBundle) {
		rebuildUnderWrites(t, b, b.withBuckets(t, 16).ks)
	})
	t.Run("BucketsToBuckets", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindSortedSet).withBuckets(t, 5)
		rebuildUnderWrites(t, b, b.withBuckets(t, 12).ks)
	})
}

// TestBucketsSharedCluster runs classification, repair and a migration
// under writes with buckets on the shared 3-master Redis Cluster.
func TestBucketsSharedCluster(t *testing.T) {
	t.Parallel()
	cluster := testenv.SharedRedisCluster(t)
	client := cluster.Client(t)
	for _, kind := range []projection.Kind{projection.KindSortedSet, projection.KindHash} {
		t.Run("Classes"+kindName(kind), func(t *testing.T) {
			t.Parallel()
			b := setupWith(t, kind, client, cluster.Prefix(t)).withBuckets(t, 6)
			want := b.drift(t)
			r := b.reconciler(t, &Config{PageSize: 4, Policy: Policy{Orphan: ActionRepair}})
			rep, err := r.Run(context.Background(), RunOptions{})
			require.NoError(t, err)
			require.Equal(t, countClasses(want), rep.Counts)
			require.EqualValues(t, 7, rep.Repaired)
			rep, err = r.Run(context.Background(), RunOptions{})
			require.NoError(t, err)
			require.Equal(t, map[Class]int64{ClassCurrent: 6, ClassAhead: 1}, rep.Counts)

			_, err = b.withBuckets(t, 3).reconciler(t, nil).Run(context.Background(), RunOptions{})
			require.ErrorIs(t, err, projection.ErrLayoutMismatch)
		})
	}
	t.Run("MigrationUnderWrites", func(t *testing.T) {
		t.Parallel()
		b := setupWith(t, projection.KindSortedSet, client, cluster.Prefix(t))
		rebuildUnderWrites(t, b, b.withBuckets(t, 16).ks)
	})
	t.Run("RebuildLostLayoutKey", func(t *testing.T) {
		t.Parallel()
		rebuildLostLayout(t, setupWith(t, projection.KindSortedSet, client, cluster.Prefix(t)), 2, "")
	})
}

// TestRebuildMaxBuckets migrates to and from VersionBucketsMax buckets: the
// switch script handles tens of thousands of keys (removed in slices, since
// Lua's unpack cannot take them all at once).
func TestRebuildMaxBuckets(t *testing.T) {
	t.Parallel()
	flat := setup(t, projection.KindHash)
	rows := flat.insertMany(t, 50)
	flat.projectRows(t, rows)
	ctx := context.Background()
	for _, n := range []int{projection.VersionBucketsMax, 0} {
		next := flat.withBuckets(t, n)
		rep, err := next.reconciler(t, nil).Rebuild(ctx)
		require.NoError(t, err, "to %d buckets", n)
		require.True(t, rep.Switched)
		run, err := next.reconciler(t, nil).Run(ctx, RunOptions{DryRun: true})
		require.NoError(t, err)
		require.Equal(t, map[Class]int64{ClassCurrent: 50}, run.Counts)
		require.True(t, run.OrphanScanSkipped)
		require.EqualValues(t, min(50, max(n, 1)), countExisting(t, next, next.ks.VersionKeys(testBoard, projection.KindHash)),
			"one bucket per member at most")
	}
	big := flat.withBuckets(t, projection.VersionBucketsMax)
	require.Zero(t, countExisting(t, flat, big.ks.VersionKeys(testBoard, projection.KindHash)), "the way back removed every bucket")
}

// countExisting counts the keys that exist, pipelined.
func countExisting(t *testing.T, b *testBundle, keys []string) int64 {
	t.Helper()
	pipe := b.client.Pipeline()
	cmds := make([]*redis.IntCmd, len(keys))
	for i, k := range keys {
		cmds[i] = pipe.Exists(context.Background(), k)
	}
	_, err := pipe.Exec(context.Background())
	require.NoError(t, err)
	var n int64
	for _, c := range cmds {
		n += c.Val()
	}
	return n
}

// layoutMismatches returns every *projection.LayoutMismatchError in err's
// tree (errors.As finds only the first).
func layoutMismatches(err error) []*projection.LayoutMismatchError {
	switch e := err.(type) {
	case *projection.LayoutMismatchError:
		return []*projection.LayoutMismatchError{e}
	case interface{ Unwrap() []error }:
		var out []*projection.LayoutMismatchError
		for _, inner := range e.Unwrap() {
			out = append(out, layoutMismatches(inner)...)
		}
		return out
	case interface{ Unwrap() error }:
		return layoutMismatches(e.Unwrap())
	}
	return nil
}

// Rebuild's switch moves every version bucket within RepairTimeout, so New
// refuses a RepairTimeout too short for the layout's buckets, though it
// fits a page of PageSize: with the client's ContextTimeoutEnabled (the way
// the doc gives to make RepairTimeout the switch's deadline), 100ms and
// VersionBucketsMax buckets made every Rebuild end in ErrRebuildUncertain.
func TestRepairTimeoutCoversTheSwitch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, projection.KindSortedSet)
	opt := b.client.(*redis.Client).Options()
	opt.ContextTimeoutEnabled = true
	client := redis.NewClient(opt)
	t.Cleanup(func() { _ = client.Close() })
	b.client, b.target.Client = client, client
	b = b.withBuckets(t, projection.VersionBucketsMax)
	b.projectRows(t, []Row{b.insert(t, "a", 1), b.insert(t, "b", 1)})

	_, err := New(b.source, b.target, &Config{RepairTimeout: 100 * time.Millisecond})
	var cfgErr *ConfigError
	require.ErrorAs(t, err, &cfgErr)
	require.Equal(t, "Config.RepairTimeout", cfgErr.Field)
	require.Contains(t, err.Error(), "65536 version buckets")
	require.Contains(t, err.Error(), "1.31072s")

	// The floor is accepted; it is a floor, not a margin (a loaded CI
	// machine under -race took longer than it for one switch), so the
	// Rebuild runs with the default.
	_, err = New(b.source, b.target, &Config{RepairTimeout: time.Duration(projection.VersionBucketsMax) * switchPerBucket})
	require.NoError(t, err)
	rep, err := b.reconciler(t, nil).Rebuild(ctx)
	require.NoError(t, err)
	require.True(t, rep.Switched)
	require.Equal(t, fmt.Sprint(projection.VersionBucketsMax), b.layoutOf(t))
}

// A sampled run draws its orphan candidates from every version bucket
// (sampleVersioned: "n draws of a random bucket"). Orphans that all sit in
// the last bucket must be found; TestBucketsRunSample spreads orphans over
// 16 buckets, where a draw that never picks the last one (rand.IntN(n-1))
// still finds 15/16 of them within its tolerance.
// (A mutation audit of 2026-12-07 found this untested.)
func TestSampleDrawsTheLastBucket(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet).withBuckets(t, 2)
	var orphans []Row
	for i := 0; len(orphans) < 40; i++ {
		key := fmt.Sprintf("orphan%03d", i)
		if b.ks.VersionBucket(key) == 1 {
			orphans = append(orphans, Row{Key: key, Version: 1, Value: b.value(key, 1)})
		}
	}
	b.projectRows(t, orphans)
	r := b.reconciler(t, nil)
	rep, err := r.Run(context.Background(), RunOptions{Sample: 60, DryRun: true})
	require.NoError(t, err)
	// About 30 of the 60 draws pick bucket 1; all of them miss it with
	// probability 2^-60.
	require.Positive(t, rep.Counts[ClassOrphan], "%s", rep)
}
