package reconcile

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/projection"
)

// windowSource calls hooks around the wrapped Source's answers, to land a
// concurrent write exactly in the window between a source read and the
// projection read or repair that follows it. Hooks run on whichever
// goroutine the Reconciler calls from (Page on the read-ahead walk), so
// they report failures through t.Error rather than require.
type windowSource struct {
	Source
	lookups      atomic.Int64
	afterPage    func(rows []Row)
	beforeLookup func(keys []string)
	afterLookup  func(keys []string)
}

func (s *windowSource) Page(ctx context.Context, after Cursor, limit int) ([]Row, error) {
	rows, err := s.Source.Page(ctx, after, limit)
	if err == nil && s.afterPage != nil {
		s.afterPage(rows)
	}
	return rows, err
}

func (s *windowSource) Lookup(ctx context.Context, keys []string) ([]Row, error) {
	s.lookups.Add(1)
	if s.beforeLookup != nil {
		s.beforeLookup(keys)
	}
	rows, err := s.Source.Lookup(ctx, keys)
	if err == nil && s.afterLookup != nil {
		s.afterLookup(keys)
	}
	return rows, err
}

// once returns a hook that runs fn the first time it sees key.
func once(key string, fn func()) func([]string) {
	return nth(1, key, fn)
}

// nth returns a hook that runs fn the nth time it sees key.
func nth(n int, key string, fn func()) func([]string) {
	seen := 0
	return func(keys []string) {
		if slices.Contains(keys, key) {
			if seen++; seen == n {
				fn()
			}
		}
	}
}

// TestOrphanCheckReadsProjectionFirst creates an entity right after the
// source lookup said it does not exist: the orphan check must compare with
// the projection as it was before the lookup, so the new entry survives.
func TestOrphanCheckReadsProjectionFirst(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("CheckKeys", func(t *testing.T) {
		t.Parallel()
		forKinds(t, allKinds, func(t *testing.T, b *testBundle) {
			src := &windowSource{Source: b.source}
			src.afterLookup = once("newuser", func() {
				b.insert(t, "newuser", 1)
				require.Equal(t, projection.OutcomeApplied, b.project(t, "newuser", 1))
			})
			alerts := 0
			r, err := New(src, b.target, &Config{Policy: Policy{Orphan: ActionRepair},
				OnAlert: func(context.Context, Finding) { alerts++ }})
			require.NoError(t, err)
			rep, err := r.CheckKeys(ctx, []string{"newuser"}, RunOptions{})
			require.NoError(t, err)
			require.Zero(t, rep.Counts[ClassOrphan])
			require.Zero(t, alerts)
			require.EqualValues(t, 1, b.state(t, r, "newuser").Version, "the new entry survives")
		})
	})

	// The scan finds an entry deleted from the source; it is created again
	// (a newer version) right after the lookup that confirms the absence
	// (the second: the first only picks the keys to read): the removal
	// must decline.
	t.Run("OrphanScan", func(t *testing.T) {
		t.Parallel()
		forKinds(t, allKinds, func(t *testing.T, b *testBundle) {
			b.project(t, "gone", 1)
			src := &windowSource{Source: b.source}
			src.afterLookup = nth(2, "gone", func() {
				b.insert(t, "gone", 2)
				require.Equal(t, projection.OutcomeApplied, b.project(t, "gone", 2))
			})
			r, err := New(src, b.target, &Config{Policy: Policy{Orphan: ActionRepair}})
			require.NoError(t, err)
			rep, err := r.Run(ctx, RunOptions{})
			require.NoError(t, err)
			require.Equal(t, map[Class]int64{ClassOrphan: 1}, rep.Counts)
			require.EqualValues(t, 1, rep.Results[ResultRaced])
			require.Zero(t, rep.Repaired)
			require.EqualValues(t, 2, b.state(t, r, "gone").Version, "the re-created entry survives")
			require.EqualValues(t, 2, src.lookups.Load(), "looked up, read, looked up again")
		})
	})

	// Created right after the first lookup: the read sees it and the
	// confirming lookup finds it, so it is not even reported.
	t.Run("OrphanScanFirstLookup", func(t *testing.T) {
		t.Parallel()
		forKinds(t, allKinds, func(t *testing.T, b *testBundle) {
			b.project(t, "gone", 1)
			src := &windowSource{Source: b.source}
			src.afterLookup = once("gone", func() {
				b.insert(t, "gone", 2)
				require.Equal(t, projection.OutcomeApplied, b.project(t, "gone", 2))
			})
			r, err := New(src, b.target, &Config{Policy: Policy{Orphan: ActionRepair}})
			require.NoError(t, err)
			rep, err := r.Run(ctx, RunOptions{})
			require.NoError(t, err)
			require.Empty(t, rep.Counts)
			require.EqualValues(t, 1, rep.Scanned)
			require.EqualValues(t, 2, b.state(t, r, "gone").Version)
		})
	})
}

// TestAheadLookedUpAgain lands a write between a page's source read and its
// projection read, so the projection looks ahead of the page: the finding
// must be judged against the source as it is after the projection read.
func TestAheadLookedUpAgain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const key = "k0000003" // on the first page of 5

	// The write committed and was projected: the entry is current, no
	// alert fires, and a forced ahead repair does not regress it. (Without
	// the orphan check, the only lookup is the second look.)
	t.Run("NewerWriteIsCurrent", func(t *testing.T) {
		t.Parallel()
		for _, kind := range allKinds {
			t.Run(kindName(kind), func(t *testing.T) {
				t.Parallel()
				b, r, src, rep, alerts := runAheadWindow(t, kind, key, nil)
				require.Equal(t, map[Class]int64{ClassCurrent: 10}, rep.Counts)
				require.Empty(t, alerts)
				require.EqualValues(t, 1, src.lookups.Load(), "the ahead entry was looked up again")
				require.EqualValues(t, 2, b.state(t, r, key).Version, "the newer version survives")
			})
		}
	})

	// The row was deleted before the second lookup: the entry is an
	// orphan, and reported as one.
	t.Run("DeletedIsOrphan", func(t *testing.T) {
		t.Parallel()
		for _, kind := range allKinds {
			t.Run(kindName(kind), func(t *testing.T) {
				t.Parallel()
				b, r, _, rep, alerts := runAheadWindow(t, kind, key, func(b *testBundle) {
					_, err := b.pool.Exec(ctx, `DELETE FROM items WHERE key = $1`, key)
					require.NoError(t, err)
				})
				require.Equal(t, map[Class]int64{ClassCurrent: 9, ClassOrphan: 1}, rep.Counts)
				require.Len(t, alerts, 1)
				require.Equal(t, ClassOrphan, alerts[0].Class)
				require.Nil(t, alerts[0].Source)
				require.EqualValues(t, 2, alerts[0].Projected.Version)
				require.EqualValues(t, 1, rep.Results[ResultReported], "orphans are reported by default")
				require.EqualValues(t, 2, b.state(t, r, key).Version)
			})
		}
	})
}

// runAheadWindow projects 10 rows of kind, lands version 2 of key between
// the source read and the projection read of its page (running
// beforeLookup, if set, just before key is looked up again), and runs a
// full pass that repairs ahead entries, recording its alerts.
func runAheadWindow(t *testing.T, kind projection.Kind, key string, beforeLookup func(*testBundle)) (*testBundle, *Reconciler, *windowSource, *Report, []Finding) {
	t.Helper()
	b := setup(t, kind)
	b.projectRows(t, b.insertMany(t, 10))
	src := &windowSource{Source: b.source}
	src.afterPage = newerWrite(t, b, key)
	if beforeLookup != nil {
		src.beforeLookup = once(key, func() { beforeLookup(b) })
	}
	var alerts []Finding
	r, err := New(src, b.target, &Config{PageSize: 5, SkipOrphans: true, Policy: Policy{Ahead: ActionRepair},
		OnAlert: func(_ context.Context, f Finding) { alerts = append(alerts, f) }})
	require.NoError(t, err)
	rep, err := r.Run(context.Background(), RunOptions{})
	require.NoError(t, err)
	return b, r, src, rep, alerts
}

// newerWrite returns an afterPage hook that, once the page holding key has
// been read from the source, writes version 2 of key to the source and
// projects it, as a Submit and its projector would.
func newerWrite(t *testing.T, b *testBundle, key string) func([]Row) {
	done := false
	return func(rows []Row) {
		if done || !slices.ContainsFunc(rows, func(r Row) bool { return r.Key == key }) {
			return
		}
		done = true
		applied, err := b.outboxWrite(context.Background(), key, 2)
		if err != nil || !applied {
			t.Errorf("writing %s at version 2: applied %v, %v", key, applied, err)
		}
	}
}

// tornRead is a go-redis hook that tears the first pipeline whose first
// command reads the values of member from valueKey (ZMSCORE or HMGET): it
// sends that command alone, runs between, then sends the rest — what Redis
// does when another client's command lands between two commands of a
// pipeline.
type tornRead struct {
	valueKey, member string
	between          func()
	done             atomic.Bool
}

func (h *tornRead) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (h *tornRead) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }

func (h *tornRead) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if len(cmds) < 2 || h.done.Load() {
			return next(ctx, cmds)
		}
		args := cmds[0].Args()
		if name := cmds[0].Name(); (name != "zmscore" && name != "hmget") || len(args) < 3 ||
			args[1] != h.valueKey || !slices.Contains(args[2:], any(h.member)) || !h.done.CompareAndSwap(false, true) {
			return next(ctx, cmds)
		}
		if err := next(ctx, cmds[:1]); err != nil {
			return err
		}
		h.between()
		return next(ctx, cmds[1:])
	}
}

// TestTornReadOfAnUpdatedRow lands an ordinary write (source and gate, to
// version 2) between the value and version commands of a page's projection
// read, after the page's source read saw version 1: the read pairs the old
// value with version 2, which looks ahead, and against the row looked up
// again, corrupt. Redis holds exactly the source's state, so nothing may be
// reported.
func TestTornReadOfAnUpdatedRow(t *testing.T) {
	t.Parallel()
	forKinds(t, collectionKinds, func(t *testing.T, b *testBundle) {
		ctx := context.Background()
		b.projectRows(t, b.insertMany(t, 10))
		const key = "k0000003"
		hook := &tornRead{valueKey: b.ks.ValueKey(b.target.target(key)), member: key}
		hook.between = func() {
			applied, err := b.outboxWrite(ctx, key, 2)
			if err != nil || !applied {
				t.Errorf("writing %s at version 2: applied %v, %v", key, applied, err)
			}
		}
		b.client.AddHook(hook)
		var alerts []Finding
		r := b.reconciler(t, &Config{PageSize: 5, OnAlert: func(_ context.Context, f Finding) { alerts = append(alerts, f) }})

		rep, err := r.Run(ctx, RunOptions{})
		require.NoError(t, err)
		require.True(t, hook.done.Load(), "the write landed inside the projection read")
		require.EqualValues(t, 2, b.state(t, r, key).Version)
		require.Equal(t, map[Class]int64{ClassCurrent: 10}, rep.Counts, "examples: %+v", rep.Examples)
		require.Zero(t, rep.Results[ResultRaced])
		require.Empty(t, alerts)
	})
}

// TestAheadRowDeletedCountedOnce deletes an ahead entry's row after its
// page was read: the ahead check makes it an orphan, and the orphan scan
// (which runs because of another orphan) must not count and alert it a
// second time while the default policy leaves it in place.
func TestAheadRowDeletedCountedOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b, src := aheadRowDeletedMidPass(t)
	b.project(t, "z", 1) // an orphan: never in the source
	alerts := map[string]int{}
	r, err := New(src, b.target, &Config{OnAlert: func(_ context.Context, f Finding) { alerts[f.Key]++ }})
	require.NoError(t, err)

	rep, err := r.Run(ctx, RunOptions{})
	require.NoError(t, err)
	require.False(t, rep.OrphanScanSkipped)
	require.Equal(t, map[string]int{"a": 1, "z": 1}, alerts)
	require.Equal(t, map[Class]int64{ClassCurrent: 1, ClassOrphan: 2}, rep.Counts)
	require.EqualValues(t, 2, rep.Results[ResultReported])
}

// TestOrphanWrittenBackAfterItsRemoval removes an ahead entry whose row was
// deleted mid-pass, and then lets a relay write the row's last record back,
// as it may: the orphan scan of the same run must count and remove it
// again, not take it for the orphan already dealt with.
func TestOrphanWrittenBackAfterItsRemoval(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b, src := aheadRowDeletedMidPass(t)
	var writtenBack atomic.Bool
	r, err := New(src, b.target, &Config{
		Policy: Policy{Orphan: ActionRepair},
		AfterRepair: func(_ context.Context, f Finding) {
			if f.Key == "a" && f.Result == ResultRepaired && writtenBack.CompareAndSwap(false, true) {
				if out := b.project(t, "a", 2); out != projection.OutcomeApplied {
					t.Errorf("writing a back: %v", out)
				}
			}
		},
	})
	require.NoError(t, err)

	rep, err := r.Run(ctx, RunOptions{})
	require.NoError(t, err)
	require.True(t, writtenBack.Load())
	require.Equal(t, map[Class]int64{ClassCurrent: 1, ClassOrphan: 2}, rep.Counts)
	require.EqualValues(t, 2, rep.Results[ResultRepaired])
	require.Equal(t, Projected{}, b.state(t, r, "a"), "removed again")
}

// aheadRowDeletedMidPass projects "b" current and "a" ahead of its source
// row, and returns a source that deletes a's row once the first page has
// been read, before the pass reads the projection.
func aheadRowDeletedMidPass(t *testing.T) (*testBundle, *windowSource) {
	t.Helper()
	b := setup(t, projection.KindSortedSet)
	b.insert(t, "a", 1)
	b.projectRows(t, []Row{b.insert(t, "b", 1)})
	b.project(t, "a", 2) // ahead of the source's 1
	src := &windowSource{Source: b.source}
	var deleted sync.Once
	src.afterPage = func([]Row) {
		deleted.Do(func() {
			if _, err := b.pool.Exec(context.Background(), `DELETE FROM items WHERE key = 'a'`); err != nil {
				t.Errorf("deleting a: %v", err)
			}
		})
	}
	return b, src
}
