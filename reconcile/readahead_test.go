package reconcile

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/projection"
)

// countingSource counts the pages a run asks its Source for, and the
// pages its Source has answered.
type countingSource struct {
	Source
	pages, answered atomic.Int64
}

func (s *countingSource) Page(ctx context.Context, after Cursor, limit int) ([]Row, error) {
	s.pages.Add(1)
	defer s.answered.Add(1)
	return s.Source.Page(ctx, after, limit)
}

func TestReadAhead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("SameFindingsAtEveryDepth", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindSortedSet)
		want := countClasses(b.drift(t))
		b.insertMany(t, 40)
		want[ClassMissing] += 40
		for _, depth := range []int{1, 2, 3, ReadAheadMax} {
			rep, err := b.reconciler(t, &Config{PageSize: 2, ReadAhead: depth}).Run(ctx, RunOptions{DryRun: true})
			require.NoError(t, err, "ReadAhead %d", depth)
			require.Equal(t, want, rep.Counts, "ReadAhead %d", depth)
			require.EqualValues(t, 47, rep.Checked, "ReadAhead %d", depth)
			require.EqualValues(t, 45, rep.Results[ResultDryRun], "ReadAhead %d: missing, stale and corrupt", depth)
		}
	})

	// While the first page waits in BeforeRepair, the next pages are read
	// ahead — ReadAhead pages in all, counting the held one, never more —
	// and the source is read no further than the projection, so that no
	// page's rows wait for a slot while the projection moves on.
	t.Run("ReadsAheadUpToTheBound", func(t *testing.T) {
		t.Parallel()
		for _, depth := range []int{1, 3} {
			t.Run(strconv.Itoa(depth), func(t *testing.T) {
				t.Parallel()
				server := testenv.StartRedis(t)
				client := server.Client(t)
				b := setupWith(t, projection.KindSortedSet, client, "ra:")
				b.insertMany(t, 60) // all missing: 12 pages of 5

				src := &countingSource{Source: b.source}
				var reads, pages int64
				first := true
				r, err := New(src, b.target, &Config{PageSize: 5, ReadAhead: depth, BeforeRepair: func(context.Context, Finding) bool {
					if first {
						first = false
						require.Eventually(t, func() bool { return testenv.CommandCalls(t, client, "zmscore") >= int64(depth) },
							10*time.Second, 5*time.Millisecond, "the pages after the first are read ahead")
						time.Sleep(100 * time.Millisecond) // time for a read beyond the bound to show
						reads, pages = testenv.CommandCalls(t, client, "zmscore"), src.pages.Load()
					}
					return true
				}})
				require.NoError(t, err)
				rep, err := r.Run(ctx, RunOptions{})
				require.NoError(t, err)
				require.EqualValues(t, 60, rep.Repaired)
				require.EqualValues(t, depth, reads, "projection reads done while the first page was held")
				require.EqualValues(t, depth, pages, "source pages read while the first page was held")
			})
		}
	})

	// A page is read from the source only when its projection read can
	// follow at once: a write made while earlier pages are settled is
	// seen by the source read of the page it is on, so nothing looks ahead
	// and no row has to be looked up again.
	t.Run("SourceReadWaitsForASlot", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindSortedSet)
		rows := b.insertMany(t, 40) // 8 pages of 5
		b.projectRows(t, rows[1:])  // k0000000 missing: page 1 has a repair
		src := &windowSource{Source: &countingSource{Source: b.source}}
		counted := src.Source.(*countingSource)
		first := true
		r, err := New(src, b.target, &Config{PageSize: 5, ReadAhead: 4, SkipOrphans: true,
			BeforeRepair: func(context.Context, Finding) bool {
				if first {
					first = false
					require.Eventually(t, func() bool { return counted.pages.Load() >= 4 }, 10*time.Second, time.Millisecond)
					time.Sleep(100 * time.Millisecond) // time for a page beyond the bound to be read
					// k0000022 is on page 5, not yet read.
					applied, err := b.outboxWrite(ctx, "k0000022", 2)
					require.NoError(t, err)
					require.True(t, applied)
				}
				return true
			}})
		require.NoError(t, err)
		rep, err := r.Run(ctx, RunOptions{})
		require.NoError(t, err)
		require.Equal(t, map[Class]int64{ClassMissing: 1, ClassCurrent: 39}, rep.Counts)
		require.Zero(t, src.lookups.Load(), "no ahead finding needed a second look")
		require.EqualValues(t, 2, b.state(t, r, "k0000022").Version)
	})

	// A failing read ahead of the consumer surfaces in page order, after the
	// pages before it are settled, and stops the run without leaking the
	// pipeline's goroutines (the race detector and -count runs would show
	// a read still writing after Run returned).
	t.Run("ErrorInOrder", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindSortedSet)
		b.insertMany(t, 30)
		// An invalid row on the fourth page of 3: rows are validated in the
		// read stage, ahead of the consumer.
		_, err := b.pool.Exec(ctx, `UPDATE items SET version = 0 WHERE key = 'k0000010'`)
		require.NoError(t, err)
		var mu sync.Mutex
		repaired := 0
		r := b.reconciler(t, &Config{PageSize: 3, ReadAhead: 8, AfterRepair: func(context.Context, Finding) {
			mu.Lock()
			defer mu.Unlock()
			repaired++
		}})
		rep, err := r.Run(ctx, RunOptions{})
		var rowErr *InvalidRowError
		require.ErrorAs(t, err, &rowErr)
		require.Equal(t, "k0000010", rowErr.Key)
		require.EqualValues(t, 9, rep.Checked, "the three pages before the bad one")
		require.EqualValues(t, 9, rep.Repaired)
		require.Equal(t, 9, repaired)
	})

	// A walk that ctx cuts short ends with a page carrying ctx's error,
	// never as if the source had no more rows: taken for complete, a
	// rebuild's partial copy would be switched over the live projection.
	// The walk is cut while it waits for a slot, the one place it stops
	// without reading anything more.
	t.Run("CutWalkEndsWithTheContextsError", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindSortedSet)
		b.insertMany(t, 20)
		src := &countingSource{Source: b.source}
		r, err := New(src, b.target, &Config{PageSize: 2})
		require.NoError(t, err)
		walkCtx, cancel := context.WithCancel(ctx)
		defer cancel()
		pages, stop := r.pages(walkCtx, false)
		defer stop()
		var got []page
		for p := range pages {
			if len(got) == 0 {
				// Both of the walk's slots are taken: this page and the
				// next, already read.
				require.Eventually(t, func() bool { return src.answered.Load() == 2 },
					10*time.Second, time.Millisecond, "the next page is read ahead")
				cancel()
			}
			got = append(got, p)
		}
		require.Len(t, got, 3, "the page held, the page read ahead, and the end")
		require.NoError(t, got[0].err)
		require.NoError(t, got[1].err)
		require.ErrorIs(t, got[2].err, context.Canceled)
	})
}
