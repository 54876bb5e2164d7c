package reconcile

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/projection"
)

// TestReportCountsEachEntityOnce: a Report counts every entity it met in
// exactly one class, and a cancelled run's partial Report counts only what
// it checked, and writes nothing after the cancellation.
func TestReportCountsEachEntityOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// A document orphan whose version key holds another type reads as a
	// value without a version: the version-key scan met it (SCAN matches
	// a key whatever its type), and so did the value-key scan, which keeps
	// the entries without a version: one entity, two orphans.
	t.Run("OrphanWithAWrongTypedVersionKey", func(t *testing.T) {
		t.Parallel()
		for name, policy := range map[string]Policy{"Report": {}, "Repair": {Orphan: ActionRepair}} {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				b := setup(t, projection.KindDocument)
				b.insert(t, "a", 1)
				b.project(t, "a", 1)
				b.project(t, "o", 1) // an orphan
				version := b.ks.VersionKey(b.target.target("o"))
				require.NoError(t, b.client.Del(ctx, version).Err())
				require.NoError(t, b.client.HSet(ctx, version, "f", "v").Err())
				rep, _ := b.reconciler(t, &Config{Policy: policy}).Run(ctx, RunOptions{})
				require.EqualValues(t, 1, rep.Counts[ClassOrphan], "%s", rep)
				require.LessOrEqual(t, len(rep.refused), 1, "refused once at most")
			})
		}
	})

	// An ahead document whose row is deleted during the pass is an
	// orphan; its forced removal, refused for a value key of another type,
	// wrote nothing, and the orphan scan that followed met the entry again
	// and counted (and refused) it a second time.
	t.Run("RefusedOrphanRemoval", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindDocument)
		b.insert(t, "k", 1)
		b.project(t, "k", 2) // ahead of the source
		value := b.ks.ValueKey(b.target.target("k"))
		require.NoError(t, b.client.Del(ctx, value).Err())
		require.NoError(t, b.client.HSet(ctx, value, "f", "v").Err())
		src := &windowSource{Source: b.source}
		src.beforeLookup = once("k", func() {
			_, err := b.pool.Exec(ctx, `DELETE FROM items WHERE key = 'k'`)
			require.NoError(t, err)
		})
		r, err := New(src, b.target, &Config{Policy: Policy{Orphan: ActionRepair}})
		require.NoError(t, err)
		rep, err := r.Run(ctx, RunOptions{})
		require.ErrorIs(t, err, projection.ErrWrongKeyType)
		require.EqualValues(t, 1, rep.Checked)
		require.EqualValues(t, 1, rep.Counts[ClassOrphan], "%s", rep)
		require.Len(t, rep.refused, 1)
	})

	// Cancelled while an ahead finding was looked up again, a page's
	// current rows were counted, but its rows not as checked.
	t.Run("CancelledDuringARecheck", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindSortedSet)
		for _, k := range []string{"a", "b", "c", "d"} {
			b.insert(t, k, 1)
			b.project(t, k, 1)
		}
		b.insert(t, "e", 1)
		b.project(t, "e", 2) // ahead
		rctx, cancel := context.WithCancel(ctx)
		defer cancel()
		src := &windowSource{Source: b.source, beforeLookup: func([]string) { cancel() }}
		r, err := New(src, b.target, &Config{SkipOrphans: true})
		require.NoError(t, err)
		rep, err := r.Run(rctx, RunOptions{})
		require.ErrorIs(t, err, context.Canceled)
		var counted int64
		for _, c := range []Class{ClassCurrent, ClassMissing, ClassStale, ClassAhead, ClassCorrupt} {
			counted += rep.Counts[c]
		}
		require.Equal(t, rep.Checked, counted, "%s", rep)
	})

	// Cancelled while a page's gate repairs were in flight, the run still
	// sent the page's compare-and-set repairs afterwards, which had not
	// been sent when it was cancelled.
	t.Run("CancelledDuringTheGateRepairs", func(t *testing.T) {
		t.Parallel()
		base := setup(t, projection.KindHash)
		rctx, cancel := context.WithCancel(ctx)
		defer cancel()
		hook := &afterScript{run: cancel}
		b := base.withHook(t, hook)
		b.insert(t, "missing", 1) // repaired through the gate
		b.insert(t, "corrupt", 1)
		b.project(t, "corrupt", 1)
		b.setRaw(t, "corrupt", &projection.Value{Data: []byte("garbage")}, nil)
		r := b.reconciler(t, &Config{SkipOrphans: true})
		hook.armed.Store(true)
		rep, err := r.Run(rctx, RunOptions{})
		require.ErrorIs(t, err, context.Canceled)
		require.False(t, hook.armed.Load(), "the gate's script ran")
		require.Equal(t, []byte("garbage"), b.state(t, r, "corrupt").Data, "no compare-and-set repair after the cancellation")
		require.EqualValues(t, 1, rep.Repaired, "the gate's repair, sent before, counts: %s", rep)
	})

	// An entry ahead of its row, whose row the recheck found deleted (an
	// orphan), and whose removal raced a relay's write: the orphan scan
	// met the changed entry again and counted the entity twice.
	t.Run("OrphanFoundAheadWhoseRemovalRaced", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindHash)
		b.insert(t, "x", 3)
		b.project(t, "x", 5)
		src := &deletingSource{SQLSource: b.source, b: b, key: "x"}
		raced := false
		r, err := New(src, b.target, &Config{
			Policy: Policy{Ahead: ActionRepair, Orphan: ActionRepair},
			BeforeRepair: func(ctx context.Context, f Finding) bool {
				if !raced && f.Key == "x" {
					raced = true
					b.project(t, "x", 6) // a relay, between the read and the removal
				}
				return true
			},
		})
		require.NoError(t, err)
		rep, err := r.Run(ctx, RunOptions{})
		require.NoError(t, err)
		require.True(t, raced)
		require.EqualValues(t, 1, rep.Counts[ClassOrphan], "one entity: %s", rep)
		require.EqualValues(t, 1, rep.Results[ResultRaced], "left to the next run: %s", rep)
		require.EqualValues(t, 6, b.state(t, r, "x").Version, "the relay's write stays until the next run")
		rep, err = r.Run(ctx, RunOptions{})
		require.NoError(t, err)
		require.EqualValues(t, 1, rep.Repaired, "the next run removes it: %s", rep)
	})

	// Keys another application wrote under the prefix with an empty hash
	// tag ("doc:{}:d"; Escape writes the empty id as "{%}") read as the
	// empty id's entries: counted as scanned, and with the empty id's own
	// orphan met in another SCAN batch, one entity counted twice.
	t.Run("ForeignKeysWithAnEmptyHashTag", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindDocument)
		require.NoError(t, b.client.Set(ctx, "doc:{}:dv", "7", 0).Err())
		require.NoError(t, b.client.Set(ctx, "doc:{}:d", "x", 0).Err())
		r := b.reconciler(t, &Config{PageSize: 1})
		rep, err := r.Run(ctx, RunOptions{})
		require.NoError(t, err)
		require.Zero(t, rep.Drift(), "%s", rep)
		require.Zero(t, rep.Scanned, "foreign keys are not projection entries: %s", rep)

		b.project(t, "", 1) // the empty id's own entry, an orphan
		pipe := b.client.Pipeline()
		for i := range 3000 {
			pipe.Set(ctx, fmt.Sprintf("filler:%d", i), "f", 0)
		}
		_, err = pipe.Exec(ctx)
		require.NoError(t, err)
		for range 5 {
			rep, err = r.Run(ctx, RunOptions{})
			require.NoError(t, err)
			require.EqualValues(t, 1, rep.Counts[ClassOrphan], "one entity, one orphan: %s", rep)
		}
	})
}

// deletingSource is b's source, but its first Lookup (the recheck of an
// entry found ahead) finds key's row deleted by a writer first.
type deletingSource struct {
	*SQLSource
	b    *testBundle
	key  string
	done bool
}

func (s *deletingSource) Lookup(ctx context.Context, keys []string) ([]Row, error) {
	if !s.done {
		s.done = true
		if _, err := s.b.pool.Exec(ctx, `DELETE FROM items WHERE key = $1`, s.key); err != nil {
			return nil, err
		}
	}
	return s.SQLSource.Lookup(ctx, keys)
}

// afterScript runs run once, when armed, right after the first script
// call (EVAL or EVALSHA: the gate's, which a page's repairs send first)
// has returned.
type afterScript struct {
	testenv.PassThroughHook
	armed atomic.Bool
	run   func()
}

func (h *afterScript) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if (cmd.Name() == "evalsha" || cmd.Name() == "eval") && h.armed.CompareAndSwap(true, false) {
			h.run()
		}
		return err
	}
}

// TestOrphanScanBatchesBoundedByPageSize: "PageSize is ... the number of
// projection entries read (and repaired) per round trip. Memory use is
// proportional to it": also in the orphan scan, whose SCAN-family replies
// can hold more (a small hash or sorted set answers HSCAN and ZSCAN whole,
// and the documents' SCAN asks for ten pages' worth per call).
func TestOrphanScanBatchesBoundedByPageSize(t *testing.T) {
	t.Parallel()
	const pageSize, orphans = 10, 100
	forKinds(t, allKinds, func(t *testing.T, b *testBundle) {
		b.projectRows(t, []Row{b.insert(t, "kept", 1)})
		for i := range orphans {
			b.project(t, fmt.Sprintf("orphan%03d", i), 1)
		}
		sizes := &batchSizes{Source: b.source}
		b.client.AddHook(sizes)
		r, err := New(sizes, b.target, &Config{PageSize: pageSize, Policy: Policy{Orphan: ActionRepair}})
		require.NoError(t, err)
		rep, err := r.Run(context.Background(), RunOptions{})
		require.NoError(t, err)
		require.EqualValues(t, orphans, rep.Counts[ClassOrphan])
		require.EqualValues(t, orphans, rep.Repaired)
		sizes.mu.Lock()
		defer sizes.mu.Unlock()
		require.Positive(t, sizes.repairs, "the hook saw the repairs")
		require.LessOrEqual(t, sizes.lookup, pageSize, "Source.Lookup batch")
		require.LessOrEqual(t, sizes.read, pageSize, "entries read by one command")
		require.LessOrEqual(t, sizes.repairs, pageSize, "repairs in one script call")
	})
}

// batchSizes records the largest Source.Lookup batch, the most entries one
// ZMSCORE, HMGET or MGET read, and the most removals one script call sent.
type batchSizes struct {
	Source
	testenv.PassThroughHook
	mu                    sync.Mutex
	lookup, read, repairs int
}

func (s *batchSizes) Lookup(ctx context.Context, keys []string) ([]Row, error) {
	s.mu.Lock()
	s.lookup = max(s.lookup, len(keys))
	s.mu.Unlock()
	return s.Source.Lookup(ctx, keys)
}

func (s *batchSizes) note(cmd redis.Cmder) {
	args := cmd.Args()
	s.mu.Lock()
	defer s.mu.Unlock()
	switch strings.ToLower(cmd.Name()) {
	case "zmscore", "hmget":
		s.read = max(s.read, len(args)-2)
	case "mget":
		s.read = max(s.read, (len(args)-1)/2) // a document's value and version keys
	case "evalsha", "eval":
		n := 0
		for _, a := range args {
			if a == "del" { // repair.lua's action of a removal
				n++
			}
		}
		s.repairs = max(s.repairs, n)
	}
}

func (s *batchSizes) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		s.note(cmd)
		return next(ctx, cmd)
	}
}

func (s *batchSizes) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, c := range cmds {
			s.note(c)
		}
		return next(ctx, cmds)
	}
}

// sampleWithReplacement is a Source whose Sample draws the first row
// twice: "up to n rows chosen at random" allows a sample with replacement.
type sampleWithReplacement struct{ rowsSource }

func (s sampleWithReplacement) Sample(context.Context, int) ([]Row, error) {
	return []Row{s.rows[0], s.rows[0]}, nil
}

// TestSampleCountsARepeatedRowOnce: a sampled run checks, counts and
// repairs an entity its Source sampled twice once, and reports no race
// for the second repair of it.
func TestSampleCountsARepeatedRowOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet)
	r, err := New(sampleWithReplacement{rowsSource{rows: []Row{b.insert(t, "a", 1)}}}, b.target, &Config{SkipOrphans: true})
	require.NoError(t, err)
	rep, err := r.Run(context.Background(), RunOptions{Sample: 2})
	require.NoError(t, err)
	require.EqualValues(t, 1, rep.Checked)
	require.EqualValues(t, 1, rep.Counts[ClassMissing], "one entity")
	require.EqualValues(t, 1, rep.Repaired)
	require.Zero(t, rep.Results[ResultRaced])
	require.True(t, b.state(t, r, "a").HasValue)
}

// TestOrphanScanGoesOnPastEmptyReplies: HSCAN may answer a page with no
// entries and a cursor to go on with (a sparse hash table: COUNT bounds the
// buckets visited, not the entries returned). The orphan scan must go on
// until the cursor is 0.
func TestOrphanScanGoesOnPastEmptyReplies(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindHash)
	ctx := context.Background()
	// 600 entries make the version hash a hash table of 1024 buckets;
	// 110 left (10.7%, above the 10% at which Redis shrinks it) spread
	// thinly over them.
	rows := make([]Row, 600)
	for i := range rows {
		k := fmt.Sprintf("o%04d", i)
		rows[i] = Row{Key: k, Version: 1, Value: b.value(k, 1)}
	}
	b.projectRows(t, rows)
	tg := b.target.target("")
	for _, row := range rows[110:] {
		require.NoError(t, b.client.HDel(ctx, b.ks.ValueKey(tg), row.Key).Err())
		require.NoError(t, b.client.HDel(ctx, b.ks.VersionKey(tg), row.Key).Err())
	}
	enc, err := b.client.ObjectEncoding(ctx, b.ks.VersionKey(tg)).Result()
	require.NoError(t, err)
	require.Equal(t, "hashtable", enc)
	// Some reply of the version scan is empty with a cursor to go on.
	var empty bool
	for cursor := uint64(0); ; {
		keys, next, err := b.client.HScan(ctx, b.ks.VersionKey(tg), cursor, "", 1).Result()
		require.NoError(t, err)
		empty = empty || (len(keys) == 0 && next != 0)
		if cursor = next; cursor == 0 {
			break
		}
	}
	require.True(t, empty, "no empty HSCAN reply: the test does not exercise the case")

	r := b.reconciler(t, &Config{PageSize: 1})
	rep, err := r.Run(ctx, RunOptions{})
	require.NoError(t, err)
	require.Equal(t, int64(110), rep.Counts[ClassOrphan], rep.String())
}
