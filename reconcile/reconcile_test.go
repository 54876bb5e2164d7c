package reconcile

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/projection"
)

var allKinds = []projection.Kind{projection.KindSortedSet, projection.KindHash, projection.KindDocument}

// collectionKinds are the kinds that hold one collection of many members.
var collectionKinds = []projection.Kind{projection.KindSortedSet, projection.KindHash}

// drift builds one entity of every class and returns the expected class per
// key.
func (b *testBundle) drift(t *testing.T) map[string]Class {
	t.Helper()
	b.insert(t, "cur", 2)
	b.project(t, "cur", 2)

	b.insert(t, "miss", 1)

	b.insert(t, "stale", 3)
	b.project(t, "stale", 2)

	b.insert(t, "ahead", 1)
	b.project(t, "ahead", 2)

	b.insert(t, "corrupt", 2)
	b.project(t, "corrupt", 2)
	b.setRaw(t, "corrupt", &projection.Value{Score: 999, Data: []byte("garbage")}, nil)

	b.insert(t, "bad{ver}", 1)
	b.project(t, "bad{ver}", 1)
	b.setRaw(t, "bad{ver}", nil, ptr("01"))

	b.insert(t, "nover", 1)
	b.project(t, "nover", 1)
	b.setRaw(t, "nover", nil, ptr(""))

	b.project(t, "orphan", 1)

	// In the source, but on another board: the filter hides it.
	_, err := b.pool.Exec(context.Background(), `INSERT INTO items (key, board, version, score, data) VALUES ('elsewhere', 'daily', 1, 1, 'x')`)
	require.NoError(t, err)
	b.project(t, "elsewhere", 1)

	return map[string]Class{
		"cur": ClassCurrent, "miss": ClassMissing, "stale": ClassStale, "ahead": ClassAhead,
		"corrupt": ClassCorrupt, "bad{ver}": ClassCorrupt, "nover": ClassCorrupt,
		"orphan": ClassOrphan, "elsewhere": ClassOrphan,
	}
}

func countClasses(m map[string]Class) map[Class]int64 {
	out := make(map[Class]int64)
	for _, c := range m {
		out[c]++
	}
	return out
}

func TestRunClasses(t *testing.T) {
	t.Parallel()
	forKinds(t, allKinds, func(t *testing.T, b *testBundle) {
		want := b.drift(t)
		ctx := context.Background()

		var mu sync.Mutex
		alerts := map[string]Class{}
		r := b.reconciler(t, &Config{PageSize: 3, OnAlert: func(_ context.Context, f Finding) {
			mu.Lock()
			defer mu.Unlock()
			alerts[f.Key] = f.Class
		}})
		rep, err := r.Run(ctx, RunOptions{})
		require.NoError(t, err)
		require.Equal(t, countClasses(want), rep.Counts)
		require.EqualValues(t, 7, rep.Checked)
		require.EqualValues(t, 5, rep.Repaired) // missing, stale, 3 corrupt
		require.EqualValues(t, 3, rep.Skipped)  // ahead and 2 orphans, reported only
		require.EqualValues(t, 3, rep.Results[ResultReported])
		require.Equal(t, map[string]Class{"ahead": ClassAhead, "orphan": ClassOrphan, "elsewhere": ClassOrphan}, alerts)
		for key, c := range want {
			if c == ClassCurrent {
				continue
			}
			ex := rep.Examples[c]
			found := false
			for _, f := range ex {
				found = found || f.Key == key
			}
			require.True(t, found, "example for %s (%s)", key, c)
		}

		// Repaired entries now hold the source's state; ahead and orphans
		// are untouched.
		for _, key := range []string{"miss", "stale", "corrupt", "bad{ver}", "nover"} {
			rows, err := b.source.Lookup(ctx, []string{key})
			require.NoError(t, err)
			require.Equal(t, ClassCurrent, Classify(b.kind, &rows[0], b.state(t, r, key)), key)
		}
		require.Equal(t, int64(2), b.state(t, r, "ahead").Version)
		require.True(t, b.state(t, r, "orphan").HasValue)

		// A second run finds only what the policy leaves alone.
		rep, err = r.Run(ctx, RunOptions{})
		require.NoError(t, err)
		require.Equal(t, map[Class]int64{ClassCurrent: 6, ClassAhead: 1, ClassOrphan: 2}, rep.Counts)
		require.Zero(t, rep.Repaired)
	})
}

func TestRunForceAheadAndOrphan(t *testing.T) {
	t.Parallel()
	forKinds(t, allKinds, func(t *testing.T, b *testBundle) {
		b.drift(t)
		// OnAlert fires before any repair: the entry it is told about
		// is still in Redis as it was read.
		var r *Reconciler
		unrepaired := map[string]bool{}
		r = b.reconciler(t, &Config{Policy: Policy{Ahead: ActionRepair, Orphan: ActionRepair},
			OnAlert: func(_ context.Context, f Finding) {
				unrepaired[f.Key] = sameProjected(f.Projected, b.state(t, r, f.Key))
			}})
		rep, err := r.Run(context.Background(), RunOptions{})
		require.NoError(t, err)
		require.Equal(t, map[string]bool{"ahead": true, "orphan": true, "elsewhere": true}, unrepaired,
			"OnAlert is called before the repair")
		require.EqualValues(t, 8, rep.Repaired)
		require.EqualValues(t, 1, rep.RepairedByClass[ClassAhead])
		require.EqualValues(t, 2, rep.RepairedByClass[ClassOrphan])

		require.Equal(t, int64(1), b.state(t, r, "ahead").Version)
		require.Equal(t, Projected{}, b.state(t, r, "orphan"))
		require.Equal(t, Projected{}, b.state(t, r, "elsewhere"))

		rep, err = r.Run(context.Background(), RunOptions{})
		require.NoError(t, err)
		require.Equal(t, map[Class]int64{ClassCurrent: 7}, rep.Counts)
	})
}

func TestRunDryRun(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet)
	want := b.drift(t)
	called := false
	r := b.reconciler(t, &Config{
		Policy:       Policy{Orphan: ActionRepair},
		BeforeRepair: func(context.Context, Finding) bool { called = true; return true },
	})
	for range 2 { // nothing was written, so the second run sees the same
		rep, err := r.Run(context.Background(), RunOptions{DryRun: true})
		require.NoError(t, err)
		require.True(t, rep.DryRun)
		require.Equal(t, countClasses(want), rep.Counts)
		require.Zero(t, rep.Repaired)
		require.EqualValues(t, 7, rep.Results[ResultDryRun]) // missing, stale, 3 corrupt, 2 orphans
		require.EqualValues(t, 1, rep.Results[ResultReported])
	}
	require.False(t, called)
}

// TestRunDryRunWritesNothing runs dry with every class forced to repair,
// ahead and orphan included, on every kind: Redis must hold byte for byte
// what it held before, every finding must be ResultDryRun (and so counted
// Skipped), OnAlert must still fire for ahead and orphan findings, and no
// other hook may be called.
func TestRunDryRunWritesNothing(t *testing.T) {
	t.Parallel()
	forKinds(t, allKinds, func(t *testing.T, b *testBundle) {
		ctx := context.Background()
		want := b.drift(t)
		before := b.dumpPrefix(t)
		alerts := map[string]Class{}
		hooks := 0
		r := b.reconciler(t, &Config{
			PageSize:     3,
			Policy:       Policy{Ahead: ActionRepair, Orphan: ActionRepair},
			OnAlert:      func(_ context.Context, f Finding) { alerts[f.Key] = f.Class },
			BeforeRepair: func(context.Context, Finding) bool { hooks++; return true },
			AfterRepair:  func(context.Context, Finding) { hooks++ },
		})
		rep, err := r.Run(ctx, RunOptions{DryRun: true})
		require.NoError(t, err)
		require.Equal(t, before, b.dumpPrefix(t), "a dry run writes nothing")
		require.Equal(t, countClasses(want), rep.Counts)
		require.EqualValues(t, 7, rep.Checked)
		require.Zero(t, rep.Repaired)
		require.Empty(t, rep.RepairedByClass)
		require.Equal(t, map[Result]int64{ResultDryRun: 8}, rep.Results) // all but current
		require.EqualValues(t, 8, rep.Skipped, "dry-run findings are skipped")
		require.Zero(t, rep.Uncertain)
		require.Equal(t, rep.Drift(), rep.Repaired+rep.Skipped+rep.Uncertain)
		require.Equal(t, map[string]Class{"ahead": ClassAhead, "orphan": ClassOrphan, "elsewhere": ClassOrphan}, alerts,
			"OnAlert still fires in a dry run")
		require.Zero(t, hooks, "BeforeRepair and AfterRepair are not called in a dry run")

		rep, err = r.CheckKeys(ctx, []string{"miss", "stale", "ahead", "corrupt", "orphan"}, RunOptions{DryRun: true})
		require.NoError(t, err)
		require.EqualValues(t, 5, rep.Results[ResultDryRun])
		require.Equal(t, before, b.dumpPrefix(t), "a dry CheckKeys writes nothing")
		require.Zero(t, hooks)
	})
}

// dumpPrefix DUMPs every key under the bundle's prefix (documents have a
// server of their own), so a test can assert that a call wrote nothing.
func (b *testBundle) dumpPrefix(t testing.TB) map[string]string {
	t.Helper()
	ctx := context.Background()
	out := map[string]string{}
	iter := b.client.Scan(ctx, 0, escapeGlob(b.ks.Prefix())+"*", 1000).Iterator()
	for iter.Next(ctx) {
		v, err := b.client.Dump(ctx, iter.Val()).Result()
		require.NoError(t, err)
		out[iter.Val()] = v
	}
	require.NoError(t, iter.Err())
	require.NotEmpty(t, out)
	return out
}

func TestRunPolicyAndVeto(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindHash)
	b.drift(t)
	var after []Finding
	r := b.reconciler(t, &Config{
		SkipOrphans: true,
		Policy:      Policy{Stale: ActionReport},
		BeforeRepair: func(_ context.Context, f Finding) bool {
			require.Equal(t, ResultNone, f.Result)
			return f.Key != "corrupt"
		},
		AfterRepair: func(_ context.Context, f Finding) { after = append(after, f) },
	})
	rep, err := r.Run(context.Background(), RunOptions{})
	require.NoError(t, err)
	require.Zero(t, rep.Scanned)
	require.Zero(t, rep.Counts[ClassOrphan])
	require.EqualValues(t, 1, rep.Results[ResultVetoed])
	require.EqualValues(t, 2, rep.Results[ResultReported]) // stale by policy, ahead by default
	require.EqualValues(t, 3, rep.Repaired)                // miss, bad{ver}, nover
	require.EqualValues(t, 3, rep.Skipped, "vetoed and reported findings are skipped")
	require.Equal(t, rep.Drift(), rep.Repaired+rep.Skipped+rep.Uncertain)
	require.Len(t, after, 3)
	for _, f := range after {
		require.Equal(t, ResultRepaired, f.Result)
	}
	require.Equal(t, int64(2), b.state(t, r, "stale").Version)
	require.Equal(t, []byte("garbage"), b.state(t, r, "corrupt").Data)
}

// TestRepairRace makes a newer gate write land between the classification
// and the repair of every repairable class: the repair must decline and the
// newer state must survive.
func TestRepairRace(t *testing.T) {
	t.Parallel()
	forKinds(t, allKinds, func(t *testing.T, b *testBundle) {
		want := b.drift(t)
		raced := map[string]int64{}
		r := b.reconciler(t, &Config{
			Policy: Policy{Ahead: ActionRepair, Orphan: ActionRepair},
			BeforeRepair: func(_ context.Context, f Finding) bool {
				// The outbox delivers version 7 just now. For bad{ver}
				// and nover the gate cannot order the write, so a hand
				// edit stands in for it.
				switch f.Key {
				case "bad{ver}":
					b.setRaw(t, f.Key, nil, ptr("02"))
				case "nover":
					b.setRaw(t, f.Key, &projection.Value{Score: 5, Data: []byte("5")}, nil)
				default:
					require.Equal(t, projection.OutcomeApplied, b.project(t, f.Key, 7))
					raced[f.Key] = 7
				}
				return true
			},
		})
		rep, err := r.Run(context.Background(), RunOptions{})
		require.NoError(t, err)
		require.Equal(t, countClasses(want), rep.Counts)
		require.Zero(t, rep.Repaired)
		require.EqualValues(t, 8, rep.Results[ResultRaced])
		for key, v := range raced {
			p := b.state(t, r, key)
			require.Equal(t, v, p.Version, key)
			require.Equal(t, ClassCurrent, Classify(b.kind, &Row{Key: key, Version: v, Value: b.value(key, v)}, p), key)
		}
		require.Equal(t, "02", b.state(t, r, "bad{ver}").RawVersion)
	})
}

// TestRepairRaceVersionAppearsWithTheSameValue makes a version appear, with
// the value already held, between the read of an entry without a version and
// its compare-and-set repair: the repair expected no version, so it must
// decline, not overwrite the newer gate write with the older source row it
// read (corrupt) or delete an entry projected after the read (orphan).
// TestRepairRace's race on "nover" changes the value as well.
func TestRepairRaceVersionAppearsWithTheSameValue(t *testing.T) {
	t.Parallel()
	forKinds(t, allKinds, func(t *testing.T, b *testBundle) {
		ctx := context.Background()
		// A projected entry, so that the collection records its layout.
		b.insert(t, "anchor", 1)
		require.Equal(t, projection.OutcomeApplied, b.project(t, "anchor", 1))
		// corrupt: the source has version 3; Redis holds the value of
		// version 5 without any version (a lost version key).
		b.insert(t, "corrupt", 3)
		v5 := b.value("corrupt", 5)
		b.setRaw(t, "corrupt", &v5, nil)
		// orphan: not in the source; Redis holds a value without a version.
		o2 := b.value("orphan", 2)
		b.setRaw(t, "orphan", &o2, nil)

		r := b.reconciler(t, &Config{
			Policy: Policy{Orphan: ActionRepair},
			BeforeRepair: func(ctx context.Context, f Finding) bool {
				// The outbox delivers a newer version with the value
				// Redis already holds. BeforeRepair may run on another
				// goroutine: assert, not require.
				switch f.Key {
				case "corrupt":
					b.insert(t, "corrupt", 5)
					assert.Equal(t, projection.OutcomeApplied, b.project(t, "corrupt", 5))
				case "orphan":
					b.insert(t, "orphan", 2)
					assert.Equal(t, projection.OutcomeApplied, b.project(t, "orphan", 2))
				}
				return true
			},
		})
		rep, err := r.Run(ctx, RunOptions{})
		require.NoError(t, err)
		require.EqualValues(t, 1, rep.Counts[ClassCorrupt], "report: %v", rep)
		require.EqualValues(t, 1, rep.Counts[ClassOrphan], "report: %v", rep)
		require.EqualValues(t, 2, rep.Results[ResultRaced], "results: %v", rep.Results)

		p := b.state(t, r, "corrupt")
		require.Equal(t, int64(5), p.Version, "the repair overwrote a newer gate write with the older source row it had read")
		require.Equal(t, ClassCurrent, Classify(b.kind, &Row{Key: "corrupt", Version: 5, Value: v5}, p))
		p = b.state(t, r, "orphan")
		require.True(t, p.HasValue && p.HasVersion, "the orphan removal deleted an entry projected after the read")
		require.Equal(t, int64(2), p.Version)
	})
}

// TestRepairRaceGateAnswersDuplicate has the relay project the source's very
// version of a missing and a stale entry between their read and their repair
// through the gate, which then answers duplicate: the reconciler wrote
// nothing, so the findings are raced, not repaired. TestRepairRace races
// with another version, which the gate answers stale.
func TestRepairRaceGateAnswersDuplicate(t *testing.T) {
	t.Parallel()
	forKinds(t, allKinds, func(t *testing.T, b *testBundle) {
		b.insert(t, "missing", 3)
		b.insert(t, "stale", 4)
		require.Equal(t, projection.OutcomeApplied, b.project(t, "stale", 2))
		r := b.reconciler(t, &Config{
			BeforeRepair: func(ctx context.Context, f Finding) bool {
				// The relay delivers exactly the source's version now.
				assert.Equal(t, projection.OutcomeApplied, b.project(t, f.Key, f.Source.Version))
				return true
			},
		})
		rep, err := r.Run(context.Background(), RunOptions{})
		require.NoError(t, err)
		require.EqualValues(t, 1, rep.Counts[ClassMissing], "report: %v", rep)
		require.EqualValues(t, 1, rep.Counts[ClassStale], "report: %v", rep)
		require.Zero(t, rep.Repaired, "the relay had delivered both versions; results %v", rep.Results)
		require.EqualValues(t, 2, rep.Results[ResultRaced], "results: %v", rep.Results)
	})
}

// TestRepairRaceVersionsAboveDoublePrecision re-creates and projects an
// orphan between its classification and its removal, at the next version
// and the same score. Both versions are above 2^53, where they round to the
// same double: the compare-and-set must compare versions exactly, decline,
// and leave the newer entry in place.
func TestRepairRaceVersionsAboveDoublePrecision(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, projection.KindSortedSet)
	const read = int64(1_000_000_000_000_000_000) // doubles are 128 apart here
	const newer = read + 1
	out, err := b.gate.Apply(ctx, []projection.Write{{Target: b.target.target("x"), Version: read, Value: projection.Value{Score: 5}}})
	require.NoError(t, err)
	require.Equal(t, projection.OutcomeApplied, out[0])

	r := b.reconciler(t, &Config{
		Policy: Policy{Orphan: ActionRepair},
		BeforeRepair: func(ctx context.Context, f Finding) bool {
			if f.Key == "x" {
				// BeforeRepair may run on another goroutine: assert, not require.
				_, err := b.pool.Exec(ctx, `INSERT INTO items (key, board, version, score) VALUES ('x', $1, $2, 5)`, testBoard, newer)
				assert.NoError(t, err)
				out, err := b.gate.Apply(ctx, []projection.Write{{Target: b.target.target("x"), Version: newer, Value: projection.Value{Score: 5}}})
				assert.NoError(t, err)
				assert.Equal(t, []projection.Outcome{projection.OutcomeApplied}, out)
			}
			return true
		},
	})
	rep, err := r.Run(ctx, RunOptions{})
	require.NoError(t, err)
	require.EqualValues(t, 1, rep.Counts[ClassOrphan])
	require.EqualValues(t, 1, rep.Results[ResultRaced], "results: %v", rep.Results)
	p := b.state(t, r, "x")
	require.True(t, p.HasValue && p.HasVersion, "the entry projected after the read was removed")
	require.Equal(t, newer, p.Version)
}

// TestRunCancelled cancels the run while the first page's repairs are being
// prepared: every repair that reached Redis is counted, the others are
// reported as not attempted, and nothing is left unreported.
func TestRunCancelled(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet)
	rows := b.insertMany(t, 50)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	seen := 0
	r := b.reconciler(t, &Config{PageSize: 10, BeforeRepair: func(context.Context, Finding) bool {
		seen++
		if seen == 15 { // in the second page
			cancel()
		}
		return true
	}})
	rep, err := r.Run(ctx, RunOptions{})
	require.ErrorIs(t, err, context.Canceled)
	require.EqualValues(t, 20, rep.Checked)
	require.EqualValues(t, 20, rep.Counts[ClassMissing])
	require.EqualValues(t, 10, rep.Repaired)
	require.EqualValues(t, 10, rep.Results[ResultNotAttempted])
	require.Equal(t, rep.Drift(), rep.Repaired+rep.Skipped+rep.Uncertain)

	n, err := b.client.ZCard(context.Background(), b.ks.ValueKey(b.target.target(""))).Result()
	require.NoError(t, err)
	require.Equal(t, rep.Repaired, n, "every repair written is reported")
	_ = rows

	// Cancelled while a batch is in flight: the batch completes on the
	// detached context and is counted.
	b2 := setup(t, projection.KindSortedSet)
	b2.insertMany(t, 30)
	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	r2 := b2.reconciler(t, &Config{PageSize: 30, BeforeRepair: func(context.Context, Finding) bool { return true },
		AfterRepair: func(context.Context, Finding) { cancel2() }})
	rep2, err := r2.Run(ctx2, RunOptions{})
	require.ErrorIs(t, err, context.Canceled)
	require.EqualValues(t, 30, rep2.Repaired)
	n, err = b2.client.ZCard(context.Background(), b2.ks.ValueKey(b2.target.target(""))).Result()
	require.NoError(t, err)
	require.EqualValues(t, 30, n)
}

func TestRunSample(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet)
	rows := b.insertMany(t, 3000)
	// Project every row except each tenth.
	var projected []Row
	for i, r := range rows {
		if i%10 != 0 {
			projected = append(projected, r)
		}
	}
	// And 300 orphans: 10% of the projection's 3000 entries.
	for i := range 300 {
		key := fmt.Sprintf("orphan%03d", i)
		projected = append(projected, Row{Key: key, Version: 1, Value: b.value(key, 1)})
	}
	b.projectRows(t, projected)
	_, err := b.pool.Exec(context.Background(), "ANALYZE items")
	require.NoError(t, err)

	r := b.reconciler(t, &Config{PageSize: 50})
	rep, err := r.Run(context.Background(), RunOptions{Sample: 400, DryRun: true})
	require.NoError(t, err)
	require.True(t, rep.Sampled)
	require.EqualValues(t, 400, rep.Checked)
	require.EqualValues(t, 400, rep.Scanned, "400 projection entries sampled for orphans")
	require.Equal(t, rep.Checked, rep.Counts[ClassCurrent]+rep.Counts[ClassMissing])
	// 10% of the source is missing and 300 of the projection's 3,000
	// entries are orphans; 400 draws each (without replacement) fall
	// outside 10..70 less than twice in ten million runs.
	require.InDelta(t, 40, rep.Counts[ClassMissing], 30)
	require.InDelta(t, 40, rep.Counts[ClassOrphan], 30)

	sample, err := b.source.Sample(context.Background(), 400)
	require.NoError(t, err)
	keys := map[string]bool{}
	for _, s := range sample {
		require.False(t, keys[s.Key], "sample rows are distinct")
		keys[s.Key] = true
	}
	require.Len(t, keys, 400)

	// More than the table holds: all of it.
	all, err := b.source.Sample(context.Background(), 5000)
	require.NoError(t, err)
	require.Len(t, all, 3000)
}

func TestRunSourceError(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet)
	b.insert(t, "a", 1)
	_, err := b.pool.Exec(context.Background(), `INSERT INTO items (key, board, version, score) VALUES ('b', $1, 0, 1)`, testBoard)
	require.NoError(t, err)
	r := b.reconciler(t, nil)
	rep, err := r.Run(context.Background(), RunOptions{})
	var rowErr *InvalidRowError
	require.ErrorAs(t, err, &rowErr)
	require.Equal(t, "b", rowErr.Key)
	require.True(t, errors.Is(err, ErrInvalidRow))
	require.NotNil(t, rep)

	// The SQLSource's error is the package's own: wrapped, it is not
	// prefixed twice, whichever way the source was read.
	for name, err := range map[string]error{
		"Run":       err,
		"Sample":    func() error { _, err := r.Run(context.Background(), RunOptions{Sample: 5}); return err }(),
		"CheckKeys": func() error { _, err := r.CheckKeys(context.Background(), []string{"b"}, RunOptions{}); return err }(),
	} {
		require.ErrorAs(t, err, &rowErr, name)
		require.Equal(t, 1, strings.Count(err.Error(), "reconcile: "), "%s: %q", name, err.Error())
	}
	require.Equal(t, `reconcile: reading source page: source row "b": version 0 is not positive`, err.Error())
}

// TestLogLines: a run's and a rebuild's lines name the collection they
// are about, since a process may reconcile several with one logger, and
// say "error" only when there is one.
func TestLogLines(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, projection.KindSortedSet)
	b.insert(t, "a", 1)
	var logs bytes.Buffer
	r := b.reconciler(t, &Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	names := fmt.Sprintf("kind=sorted-set collection=%s ", testBoard)

	_, err := r.Run(ctx, RunOptions{})
	require.NoError(t, err)
	line := logs.String()
	require.Contains(t, line, `level=INFO msg="reconcile run finished" `+names, line)
	require.NotContains(t, line, "error=", line)

	logs.Reset()
	_, err = r.Rebuild(ctx)
	require.NoError(t, err)
	line = logs.String()
	require.Contains(t, line, `level=INFO msg="reconcile rebuild finished" `+names, line)
	require.Equal(t, 1, strings.Count(line, "collection="), line)
	require.NotContains(t, line, "error=", line)

	logs.Reset()
	_, err = b.pool.Exec(ctx, `INSERT INTO items (key, board, version, score) VALUES ('b', $1, 0, 1)`, testBoard)
	require.NoError(t, err)
	_, err = r.Run(ctx, RunOptions{})
	require.ErrorIs(t, err, ErrInvalidRow)
	line = logs.String()
	require.Contains(t, line, `level=WARN msg="reconcile run finished" `+names, line)
	require.Contains(t, line, "error=", line)

	// CheckKeys is a run too (runs{mode=keys}): a line each, repairing or
	// failing.
	logs.Reset()
	_, err = r.CheckKeys(ctx, []string{"a"}, RunOptions{})
	require.NoError(t, err)
	line = logs.String()
	require.Contains(t, line, `level=INFO msg="reconcile check of keys finished" `+names, line)
	require.Contains(t, line, "keys=1 ", line)
	logs.Reset()
	_, err = r.CheckKeys(ctx, []string{"b"}, RunOptions{})
	require.ErrorIs(t, err, ErrInvalidRow)
	line = logs.String()
	require.Contains(t, line, `level=WARN msg="reconcile check of keys finished" `+names, line)
	require.Contains(t, line, "error=", line)
}

func kindName(k projection.Kind) string {
	switch k {
	case projection.KindSortedSet:
		return "SortedSet"
	case projection.KindHash:
		return "Hash"
	}
	return "Document"
}

// TestOrphanScanSkipped checks the count shortcut: a clean projection needs
// no scan, and a single orphan forces one (and is found).
func TestOrphanScanSkipped(t *testing.T) {
	t.Parallel()
	forKinds(t, collectionKinds, func(t *testing.T, b *testBundle) {
		rows := b.insertMany(t, 40)
		b.projectRows(t, rows[:30]) // 10 missing: repaired, then counted as present
		r := b.reconciler(t, &Config{PageSize: 16})
		rep, err := r.Run(context.Background(), RunOptions{})
		require.NoError(t, err)
		require.EqualValues(t, 10, rep.Repaired)
		require.True(t, rep.OrphanScanSkipped)
		require.Zero(t, rep.Scanned)

		b.project(t, "orphan", 1)
		b.setRaw(t, rows[0].Key, nil, ptr("")) // value without version: counts differ too
		rep, err = r.Run(context.Background(), RunOptions{})
		require.NoError(t, err)
		require.False(t, rep.OrphanScanSkipped)
		require.EqualValues(t, 41, rep.Scanned) // 40 versions + the versionless value
		require.EqualValues(t, 1, rep.Counts[ClassOrphan])
		require.EqualValues(t, 1, rep.Counts[ClassCorrupt])

		// Dry run over a drifted projection: counts use what was read.
		rep, err = r.Run(context.Background(), RunOptions{DryRun: true})
		require.NoError(t, err)
		require.False(t, rep.OrphanScanSkipped)
		require.EqualValues(t, 1, rep.Counts[ClassOrphan])
	})
}

// TestOrphanScanAfterAheadRowDeleted deletes the source row of an ahead
// entry after its page was read, so the re-check turns it into an orphan,
// which the policy removes. The removed entry must not count as one the
// pass accounted for: then the counts would match while another orphan
// exists, and the scan that finds it would be skipped.
func TestOrphanScanAfterAheadRowDeleted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, projection.KindSortedSet)
	b.insert(t, "a", 1)
	b.projectRows(t, []Row{b.insert(t, "b", 1)})
	b.project(t, "a", 2) // ahead of the source's 1
	b.project(t, "z", 1) // an orphan: never in the source

	src := &windowSource{Source: b.source}
	var once sync.Once
	src.afterPage = func(rows []Row) {
		once.Do(func() {
			_, err := b.pool.Exec(ctx, `DELETE FROM items WHERE key = 'a'`)
			assert.NoError(t, err)
		})
	}
	r, err := New(src, b.target, &Config{Policy: Policy{Orphan: ActionRepair}})
	require.NoError(t, err)
	rep, err := r.Run(ctx, RunOptions{})
	require.NoError(t, err)
	require.False(t, rep.OrphanScanSkipped)
	require.EqualValues(t, 2, rep.Counts[ClassOrphan], "a (deleted mid-pass) and z; report: %v", rep)
	require.False(t, b.state(t, r, "z").HasValue, "z was not removed")
}

// TestRunUncertain kills Redis after the projection was read and before the
// repairs are sent: the repairs' fate is unknown, and the report says so for
// every one of them instead of dropping them.
func TestRunUncertain(t *testing.T) {
	t.Parallel()
	rs := testenv.StartRedis(t)
	b := setupWith(t, projection.KindSortedSet, rs.Client(t), "uncertain:")
	b.drift(t)
	killed := false
	r := b.reconciler(t, &Config{RepairTimeout: 2 * time.Second, BeforeRepair: func(context.Context, Finding) bool {
		if !killed {
			require.NoError(t, rs.Kill())
			killed = true
		}
		return true
	}})
	rep, err := r.Run(context.Background(), RunOptions{})
	require.Error(t, err)
	require.EqualValues(t, 5, rep.Uncertain) // missing, stale, 3 corrupt
	require.EqualValues(t, 5, rep.Results[ResultUncertain])
	require.Zero(t, rep.Repaired)
	require.Equal(t, rep.Drift(), rep.Repaired+rep.Skipped+rep.Uncertain)
}

// TestRepairRaceConcurrent repairs a stale projection while the outbox keeps
// delivering newer versions: no delivered version is ever regressed, and
// every stale entry is either repaired or reported raced.
func TestRepairRaceConcurrent(t *testing.T) {
	t.Parallel()
	forKinds(t, allKinds, func(t *testing.T, b *testBundle) {
		const n = 400
		rows := b.insertMany(t, n)
		b.projectRows(t, rows)
		ctx := context.Background()
		_, err := b.pool.Exec(ctx, `UPDATE items SET version = 2, score = score + 1, data = data || 'x'`)
		require.NoError(t, err)

		var (
			mu        sync.Mutex
			delivered = map[string]int64{}
			stop      = make(chan struct{})
			done      = make(chan error, 1)
		)
		go func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					done <- nil
					return
				default:
				}
				key := rows[(i*7919)%n].Key
				version := int64(3 + i/n)
				applied, err := b.outboxWrite(ctx, key, version)
				if err != nil {
					done <- err
					return
				}
				if applied {
					mu.Lock()
					delivered[key] = version
					mu.Unlock()
				}
			}
		}()
		r := b.reconciler(t, &Config{PageSize: 20, SkipOrphans: true})
		rep, err := r.Run(ctx, RunOptions{})
		close(stop)
		require.NoError(t, <-done)
		require.NoError(t, err)
		require.EqualValues(t, n, rep.Checked)
		require.Equal(t, rep.Counts[ClassStale], rep.Repaired+rep.Results[ResultRaced])

		for key, v := range delivered {
			require.GreaterOrEqual(t, b.state(t, r, key).Version, v, "delivered version of %s regressed", key)
		}
		final, err := r.Run(ctx, RunOptions{DryRun: true})
		require.NoError(t, err)
		require.Equal(t, map[Class]int64{ClassCurrent: n}, final.Counts)
	})
}

// rowsSource is a Source over fixed rows, for rows SQLSource would refuse.
type rowsSource struct{ rows []Row }

func (s rowsSource) Page(_ context.Context, after Cursor, limit int) ([]Row, error) {
	if _, ok := after.Key(); ok {
		return nil, nil
	}
	return s.rows[:min(limit, len(s.rows))], nil
}
func (s rowsSource) Sample(ctx context.Context, n int) ([]Row, error) {
	return s.Page(ctx, Cursor{}, n)
}
func (s rowsSource) Lookup(context.Context, []string) ([]Row, error) { return s.rows, nil }

func TestRunInvalidRowsFromAnySource(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet)
	for name, row := range map[string]Row{
		"ZeroVersion": {Key: "a", Version: 0},
		"HugeScore":   {Key: "a", Version: 1, Value: projection.Value{Score: projection.MaxScore + 1}},
	} {
		r, err := New(rowsSource{rows: []Row{{Key: "ok", Version: 1}, row}}, b.target, nil)
		require.NoError(t, err)
		rep, err := r.Run(context.Background(), RunOptions{})
		require.ErrorIs(t, err, ErrInvalidRow, name)
		require.Zero(t, rep.Checked, name)
		require.Equal(t, Projected{}, b.state(t, r, "ok"), "nothing written")

		// Rebuild reports the row as Run does, not as the gate would.
		_, err = r.Rebuild(context.Background())
		var rowErr *InvalidRowError
		require.ErrorAs(t, err, &rowErr, name)
		require.Equal(t, "a", rowErr.Key, name)
		require.Equal(t, Projected{}, b.state(t, r, "ok"), "nothing written")
	}
}

// TestRunRefusesAValueOverMaxValueBytes: a hash or document row whose
// value Redis would refuse for its length made Redis close the connection
// on the page's repairs, on every run, reported as a connection error;
// it is an *InvalidRowError now, like any row the projection could not
// hold. A value at the limit, and a sorted set's row (whose Data is not
// sent), pass.
func TestRunRefusesAValueOverMaxValueBytes(t *testing.T) {
	t.Parallel()
	forKinds(t, []projection.Kind{projection.KindHash, projection.KindDocument}, func(t *testing.T, b *testBundle) {
		// Above the longest key a document row's key makes here (the
		// test's prefix is long), so that only the values are over it.
		limit := b.target.Keyspace.MaxKeyLen("over") + 10
		at := Row{Key: "at", Version: 1, Value: projection.Value{Data: []byte(strings.Repeat("x", limit))}}
		over := Row{Key: "over", Version: 1, Value: projection.Value{Data: []byte(strings.Repeat("x", limit+1))}}
		r, err := New(rowsSource{rows: []Row{at, over}}, b.target, &Config{MaxValueBytes: limit})
		require.NoError(t, err)
		rep, err := r.Run(context.Background(), RunOptions{})
		var rowErr *InvalidRowError
		require.ErrorAs(t, err, &rowErr)
		require.Equal(t, "over", rowErr.Key)
		require.Contains(t, rowErr.Reason, "Config.MaxValueBytes")
		require.Zero(t, rep.Checked)
		require.Equal(t, Projected{}, b.state(t, r, "at"), "nothing written")
		if b.target.Kind == projection.KindHash { // Rebuild takes no documents
			_, err = r.Rebuild(context.Background())
			require.ErrorAs(t, err, &rowErr)
			require.Equal(t, Projected{}, b.state(t, r, "at"), "nothing written")
		}

		r, err = New(rowsSource{rows: []Row{at}}, b.target, &Config{MaxValueBytes: limit})
		require.NoError(t, err)
		rep, err = r.Run(context.Background(), RunOptions{})
		require.NoError(t, err)
		require.EqualValues(t, 1, rep.Repaired)
	})
	b := setup(t, projection.KindSortedSet)
	r, err := New(rowsSource{rows: []Row{{Key: "z", Version: 1, Value: projection.Value{Score: 1, Data: []byte("ignored")}}}}, b.target, &Config{MaxValueBytes: 1})
	require.NoError(t, err)
	_, err = r.Run(context.Background(), RunOptions{})
	require.NoError(t, err, "a sorted set's row sends no Data")

	// A key is sent too, as a member or a hash field: one over the limit
	// is refused the same way, quoted only in part.
	long := strings.Repeat("k", 100)
	r, err = New(rowsSource{rows: []Row{{Key: long, Version: 1, Value: projection.Value{Score: 1}}}}, b.target, &Config{MaxValueBytes: 99})
	require.NoError(t, err)
	_, err = r.Run(context.Background(), RunOptions{})
	require.Contains(t, requireInvalidRow(t, err, long[:64]).Reason, "key is 100 bytes")
	_, err = r.CheckKeys(context.Background(), []string{long}, RunOptions{})
	require.Contains(t, requireInvalidRow(t, err, long[:64]).Reason, "key is 100 bytes", "CheckKeys refuses it too")
}

// requireInvalidRow requires err to hold an *InvalidRowError for key (as
// quoted: up to 64 bytes) and returns it.
func requireInvalidRow(t *testing.T, err error, key string) *InvalidRowError {
	t.Helper()
	var rowErr *InvalidRowError
	require.ErrorAs(t, err, &rowErr)
	require.Equal(t, key, rowErr.Key)
	return rowErr
}

// TestRunRefusesADocumentKeyWhoseRedisKeysAreTooLong: a document's key
// goes to Redis inside its keys, escaped (a ':' takes three bytes), with
// the prefix and suffixes. A key under Config.MaxValueBytes whose keys are
// over it made Redis close the connection on the page's read ("reading
// projection: ... connection reset by peer", on every run); it is refused
// as an *InvalidRowError now, measured as the projection measures it.
func TestRunRefusesADocumentKeyWhoseRedisKeysAreTooLong(t *testing.T) {
	t.Parallel()
	const limit = 1 << 20
	rs := testenv.StartRedis(t, "--proto-max-bulk-len", "1mb")
	b := setupWith(t, projection.KindDocument, rs.Client(t), "doc:")
	long := strings.Repeat(":", limit/3+1) // 349,526 bytes, escaped to over 1 MB
	require.Greater(t, b.target.Keyspace.MaxKeyLen(long), limit)
	ok := Row{Key: "ok", Version: 1, Value: projection.Value{Data: []byte(`{}`)}}
	over := Row{Key: long, Version: 1, Value: projection.Value{Data: []byte(`{}`)}}
	r, err := New(rowsSource{rows: []Row{ok, over}}, b.target, &Config{MaxValueBytes: limit, SkipOrphans: true})
	require.NoError(t, err)
	_, err = r.Run(context.Background(), RunOptions{})
	require.Contains(t, requireInvalidRow(t, err, long[:64]).Reason, "over Config.MaxValueBytes")
	require.Equal(t, Projected{}, b.state(t, r, "ok"), "nothing written")

	// CheckKeys sent the key to Redis before it looked at the row, and
	// failed with the closed connection; it refuses the key before
	// anything is read now, whether or not the source has it.
	_, err = r.CheckKeys(context.Background(), []string{"ok", long}, RunOptions{})
	requireInvalidRow(t, err, long[:64])
	require.Equal(t, Projected{}, b.state(t, r, "ok"), "nothing written")
	lacking, err := New(rowsSource{}, b.target, &Config{MaxValueBytes: limit})
	require.NoError(t, err)
	_, err = lacking.CheckKeys(context.Background(), []string{long}, RunOptions{})
	requireInvalidRow(t, err, long[:64])

	// The projection accepts a key whose keys are at the limit; so does
	// reconcile, and repairs it.
	fits := strings.Repeat("k", limit-b.target.Keyspace.MaxKeyLen("k")+len("k"))
	require.Equal(t, limit, b.target.Keyspace.MaxKeyLen(fits))
	r, err = New(rowsSource{rows: []Row{{Key: fits, Version: 1, Value: projection.Value{Data: []byte(`{}`)}}}}, b.target, &Config{MaxValueBytes: limit, SkipOrphans: true})
	require.NoError(t, err)
	rep, err := r.Run(context.Background(), RunOptions{})
	require.NoError(t, err)
	require.EqualValues(t, 1, rep.Repaired)
}

// TestRunRepairsEntriesReadAtMaxValueBytes: the repair script is sent what
// was read, to compare before it writes; "=" and a value (or a version
// field) of MaxValueBytes is one byte over Redis's bulk limit, and Redis
// refused the call: an entry the projector had accepted at the limit,
// ahead or orphaned, was "uncertain" on every run, and the run failed.
// What is read at the limit is sent as its SHA-1 now.
func TestRunRepairsEntriesReadAtMaxValueBytes(t *testing.T) {
	t.Parallel()
	const limit = 1 << 20
	big := projection.Value{Data: bytes.Repeat([]byte("x"), limit)}
	for _, kind := range []projection.Kind{projection.KindHash, projection.KindDocument} {
		t.Run(kind.String(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			rs := testenv.StartRedis(t, "--proto-max-bulk-len", "1mb")
			b := setupWith(t, kind, rs.Client(t), "lim:")
			_, err := b.gate.Apply(ctx, []projection.Write{
				{Target: b.target.target("ahead"), Version: 2, Value: big},
				{Target: b.target.target("orphan"), Version: 1, Value: big},
				{Target: b.target.target("bigversion"), Version: 1, Value: b.value("bigversion", 1)},
			})
			require.NoError(t, err)
			// A version field a writer filled to the limit: corrupt.
			bigVersion := strings.Repeat("9", limit)
			b.setRaw(t, "bigversion", nil, &bigVersion)
			rows := []Row{
				{Key: "ahead", Version: 1, Value: b.value("ahead", 1)},
				{Key: "bigversion", Version: 1, Value: b.value("bigversion", 1)},
			}
			all := Policy{Missing: ActionRepair, Stale: ActionRepair, Corrupt: ActionRepair, Ahead: ActionRepair, Orphan: ActionRepair}
			r, err := New(rowsSource{rows: rows}, b.target, &Config{MaxValueBytes: limit, Policy: all})
			require.NoError(t, err)
			rep, err := r.Run(ctx, RunOptions{})
			require.NoError(t, err)
			require.EqualValues(t, 3, rep.Repaired, "%+v", rep)
			for _, row := range rows {
				got := b.state(t, r, row.Key)
				require.Equal(t, row.Value.Data, got.Data, row.Key)
				require.Equal(t, "1", got.RawVersion, row.Key)
			}
			require.Equal(t, Projected{}, b.state(t, r, "orphan"), "the orphan is gone")
			rep, err = r.Run(ctx, RunOptions{})
			require.NoError(t, err)
			require.Zero(t, rep.Repaired)
		})
	}
}

// TestHazardousKeys reconciles keys that are empty or contain braces,
// colons, glob characters, spaces and non-ASCII bytes.
func TestHazardousKeys(t *testing.T) {
	t.Parallel()
	keys := []string{"", "a:b", "{x}", "}{", "*?[", "% 20", "ü→✓", "new\nline"}
	forKinds(t, allKinds, func(t *testing.T, b *testBundle) {
		for i, k := range keys {
			b.insert(t, k, 2)
			switch i % 3 {
			case 0: // missing
			case 1:
				b.project(t, k, 1) // stale
			case 2:
				b.project(t, k, 2)
				b.setRaw(t, k, &projection.Value{Score: -7, Data: []byte("edited")}, nil)
			}
			b.project(t, "orphan"+k, 1)
		}
		// Members no text column can hold (a buggy writer's): orphans
		// too, even though PostgreSQL rejects them as lookup keys.
		junk := []string{"junk\xff", "nul\x00"}
		for _, k := range junk {
			b.project(t, k, 1)
		}
		r := b.reconciler(t, &Config{PageSize: 3, Policy: Policy{Orphan: ActionRepair}})
		rep, err := r.Run(context.Background(), RunOptions{})
		require.NoError(t, err)
		require.Equal(t, map[Class]int64{ClassMissing: 3, ClassStale: 3, ClassCorrupt: 2, ClassOrphan: int64(len(keys) + len(junk))}, rep.Counts)
		require.EqualValues(t, 8+len(keys)+len(junk), rep.Repaired)

		rep, err = r.Run(context.Background(), RunOptions{})
		require.NoError(t, err)
		require.Equal(t, map[Class]int64{ClassCurrent: int64(len(keys))}, rep.Counts)
		for _, k := range keys {
			require.Equal(t, Projected{}, b.state(t, r, "orphan"+k), k)
		}
		for _, k := range junk {
			require.Equal(t, Projected{}, b.state(t, r, k), k)
		}
	})
}

func TestCheckKeys(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet)
	want := b.drift(t)
	r := b.reconciler(t, nil)
	rep, err := r.CheckKeys(context.Background(), []string{"cur", "stale", "corrupt", "orphan", "nowhere", "stale"}, RunOptions{})
	require.NoError(t, err)
	require.EqualValues(t, 3, rep.Checked)
	require.Equal(t, map[Class]int64{ClassCurrent: 1, ClassStale: 1, ClassCorrupt: 1, ClassOrphan: 1}, rep.Counts)
	require.EqualValues(t, 2, rep.Repaired)
	require.Regexp(t, `^checked 3, scanned 0, drift 3 \(stale 1, corrupt 1, orphan 1\), repaired 2, skipped 1 in \d+ms$`, rep.String())
	require.Equal(t, ClassMissing, want["miss"])
	require.Equal(t, Projected{}, b.state(t, r, "miss"), "keys not asked about are left alone")

	// opts.Sample is ignored: the keys given are checked, not a sample.
	rep, err = r.CheckKeys(context.Background(), []string{"cur", "stale", "nowhere"}, RunOptions{Sample: 1, DryRun: true})
	require.NoError(t, err)
	require.False(t, rep.Sampled)
	require.EqualValues(t, 2, rep.Checked)
	require.Equal(t, map[Class]int64{ClassCurrent: 2}, rep.Counts)
}

// TestExamplesPerClass keeps the first ExamplesPerClass findings of each
// class, in source order, and none at all with -1, while the counts are
// unchanged.
func TestExamplesPerClass(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindHash)
	want := b.drift(t)
	for _, tc := range []struct {
		examples int
		corrupt  []string
	}{{1, []string{"bad{ver}"}}, {2, []string{"bad{ver}", "corrupt"}}, {-1, nil}} {
		rep, err := b.reconciler(t, &Config{ExamplesPerClass: tc.examples}).Run(context.Background(), RunOptions{DryRun: true})
		require.NoError(t, err)
		require.Equal(t, countClasses(want), rep.Counts)
		var keys []string
		for _, f := range rep.Examples[ClassCorrupt] {
			keys = append(keys, f.Key)
		}
		require.Equal(t, tc.corrupt, keys, "ExamplesPerClass %d", tc.examples)
		if tc.examples < 0 {
			require.Empty(t, rep.Examples, "ExamplesPerClass -1 keeps none")
		}
	}
}

func TestPrefetched(t *testing.T) {
	t.Parallel()
	boom := errors.New("boom")
	counting := func(n int, failAt int) (func(context.Context, func([]string) error) error, *int) {
		emitted := 0
		return func(ctx context.Context, emit func([]string) error) error {
			for i := range n {
				if i == failAt {
					return boom
				}
				if err := emit([]string{fmt.Sprint(i)}); err != nil {
					return err
				}
				emitted++
			}
			return nil
		}, &emitted
	}

	t.Run("All", func(t *testing.T) {
		t.Parallel()
		produce, _ := counting(50, -1)
		var got []string
		require.NoError(t, prefetched(context.Background(), func(k []string) error { got = append(got, k...); return nil }, produce))
		require.Len(t, got, 50)
		require.Equal(t, "49", got[49])
	})
	t.Run("ConsumerFails", func(t *testing.T) {
		t.Parallel()
		produce, emitted := counting(1000, -1)
		calls := 0
		err := prefetched(context.Background(), func([]string) error { calls++; return boom }, produce)
		require.ErrorIs(t, err, boom)
		require.Equal(t, 1, calls)
		require.Less(t, *emitted, 5, "the producer stops")
	})
	t.Run("ProducerFails", func(t *testing.T) {
		t.Parallel()
		produce, _ := counting(10, 3)
		calls := 0
		err := prefetched(context.Background(), func([]string) error { calls++; return nil }, produce)
		require.ErrorIs(t, err, boom)
		require.Equal(t, 3, calls)
	})
}

// TestDocumentNamespace reconciles one stream's documents ("order:" + key)
// next to another stream's ("invoice:" + key) under the same key prefix:
// the other stream's documents are not this source's orphans, and repairs
// write and remove the namespaced documents only.
func TestDocumentNamespace(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, projection.KindDocument)
	b.target.Namespace = "order:"
	invoices := b.target
	invoices.Namespace = "invoice:"
	for _, key := range []string{"a", "b", "c"} {
		b.insert(t, key, 1)
	}
	b.project(t, "a", 1)
	b.project(t, "b", 1)
	b.project(t, "gone", 1) // an order the source does not have
	for _, key := range []string{"a", "x{y}%"} {
		_, err := b.gate.Apply(ctx, []projection.Write{{Target: invoices.target(key), Version: 7, Value: b.value(key, 7)}})
		require.NoError(t, err)
	}

	r := b.reconciler(t, &Config{Policy: Policy{Orphan: ActionRepair}})
	rep, err := r.Run(ctx, RunOptions{})
	require.NoError(t, err)
	require.Equal(t, map[Class]int64{ClassCurrent: 2, ClassMissing: 1, ClassOrphan: 1}, rep.Counts)
	require.EqualValues(t, 4, rep.Scanned, "only the order documents are scanned: a, b, c (repaired) and gone")
	require.Equal(t, "gone", rep.Examples[ClassOrphan][0].Key)
	require.Equal(t, int64(1), b.state(t, r, "c").Version)
	require.Equal(t, Projected{}, b.state(t, r, "gone"))

	// The invoices are untouched, under their own ids.
	for _, key := range []string{"a", "x{y}%"} {
		tg := invoices.target(key)
		data, err := b.client.Get(ctx, b.ks.ValueKey(tg)).Result()
		require.NoError(t, err, key)
		require.Equal(t, string(b.value(key, 7).Data), data)
		require.Equal(t, "7", b.client.Get(ctx, b.ks.VersionKey(tg)).Val(), key)
	}
	// No document of the source's keys exists without the namespace.
	n, err := b.client.Exists(ctx, b.ks.ValueKey(projection.Target{Kind: projection.KindDocument, Name: "c"})).Result()
	require.NoError(t, err)
	require.Zero(t, n)

	rep, err = r.Run(ctx, RunOptions{})
	require.NoError(t, err)
	require.Equal(t, map[Class]int64{ClassCurrent: 3}, rep.Counts)
}

// TestTornReadIsNotCorrupt hands checkRead what a read torn by a gate write
// looks like (the values command before the write, the versions command
// after it: the old value with the new version) for an entry that Redis
// holds current: it is read again and counted current, not reported as
// corrupt. An entry read corrupt twice stays corrupt.
func TestTornReadIsNotCorrupt(t *testing.T) {
	t.Parallel()
	forKinds(t, collectionKinds, func(t *testing.T, b *testBundle) {
		ctx := context.Background()
		row := b.insert(t, "k", 2)
		b.project(t, "k", 2)
		bad := b.insert(t, "bad", 1)
		b.project(t, "bad", 1)
		b.setRaw(t, "bad", &projection.Value{Score: 999, Data: []byte("garbage")}, nil)
		r := b.reconciler(t, &Config{Policy: Policy{Corrupt: ActionReport}})

		torn := b.state(t, r, "k")
		old := b.value("k", 1)
		torn.Score, torn.Data = float64(old.Score), old.Data
		require.Equal(t, ClassCorrupt, Classify(b.kind, &row, torn), "the torn read alone looks corrupt")

		// A read that differs from Redis in its version only (here one the
		// gate would not write, since replaced) is read again too: the
		// version is part of the state compared.
		vrow := b.insert(t, "v", 3)
		b.project(t, "v", 3)
		tornVersion := b.state(t, r, "v")
		tornVersion.parseVersion("03")
		require.Equal(t, ClassCorrupt, Classify(b.kind, &vrow, tornVersion))

		rep := newReport(RunOptions{})
		require.NoError(t, r.checkRead(ctx, RunOptions{}, []Row{row, bad, vrow}, []Projected{torn, b.state(t, r, "bad"), tornVersion}, rep))
		require.Equal(t, map[Class]int64{ClassCurrent: 2, ClassCorrupt: 1}, rep.Counts)
		require.Equal(t, "bad", rep.Examples[ClassCorrupt][0].Key)
	})
}

// TestReportCarry adds an earlier pass of a run (stopped by a slot move) to
// the pass run again: a full pass saw the earlier repairs' entities as
// current, so they go back to their classes; a sampled pass drew other
// rows, so everything adds up.
func TestReportCarry(t *testing.T) {
	t.Parallel()
	row := &Row{Key: "k", Version: 2}
	pass := func(sampled bool, findings ...Finding) *Report {
		rep := newReport(RunOptions{Sample: map[bool]int{true: 10}[sampled]})
		for i := range findings {
			rep.Checked++
			rep.record(&findings[i], 5)
		}
		return rep
	}
	current := Finding{Class: ClassCurrent}
	repaired := Finding{Class: ClassMissing, Key: "m", Source: row, Result: ResultRepaired}
	reported := Finding{Class: ClassAhead, Key: "a", Source: row, Result: ResultReported}

	t.Run("Full", func(t *testing.T) {
		t.Parallel()
		earlier := pass(false, current, repaired, reported)
		later := pass(false, current, current, reported) // m is current now
		later.carry(earlier, 5)
		require.EqualValues(t, 3, later.Checked)
		require.Equal(t, map[Class]int64{ClassCurrent: 1, ClassMissing: 1, ClassAhead: 1}, later.Counts)
		require.Equal(t, map[Result]int64{ResultRepaired: 1, ResultReported: 1}, later.Results)
		require.EqualValues(t, 1, later.Repaired)
		require.EqualValues(t, 1, later.Skipped)
		require.Equal(t, "m", later.Examples[ClassMissing][0].Key)
		require.Len(t, later.Examples[ClassAhead], 1, "the ahead entry was checked again, not twice")
		require.Equal(t, earlier.Started, later.Started)
	})
	t.Run("Sampled", func(t *testing.T) {
		t.Parallel()
		earlier := pass(true, current, repaired)
		later := pass(true, current, current, reported)
		later.carry(earlier, 5)
		require.EqualValues(t, 5, later.Checked)
		require.Equal(t, map[Class]int64{ClassCurrent: 3, ClassMissing: 1, ClassAhead: 1}, later.Counts)
		require.Equal(t, map[Result]int64{ResultRepaired: 1, ResultReported: 1}, later.Results)
		require.EqualValues(t, 1, later.Repaired)
		require.EqualValues(t, 1, later.Skipped)
		require.Equal(t, "m", later.Examples[ClassMissing][0].Key)
	})
}

// TestReportWithInfiniteScoreEncodes: Redis accepts a hand-set "+inf" score,
// just what a pass exists to find, and the Report that found it must still
// encode as JSON (for logs and exports); JSON has no infinity.
func TestReportWithInfiniteScoreEncodes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, projection.KindSortedSet)
	b.insert(t, "ada", 1)
	b.project(t, "ada", 1)
	require.NoError(t, b.client.ZAdd(ctx, b.ks.ValueKey(projection.Target{Kind: projection.KindSortedSet, Name: testBoard}),
		redis.Z{Score: math.Inf(1), Member: "ada"}).Err())
	r := b.reconciler(t, &Config{Policy: Policy{Corrupt: ActionReport}})
	rep, err := r.Run(ctx, RunOptions{})
	require.NoError(t, err)
	require.Equal(t, int64(1), rep.Counts[ClassCorrupt])
	data, err := json.Marshal(rep)
	require.NoError(t, err)
	require.Contains(t, string(data), `"Score":"+Inf"`)

	finite, err := json.Marshal(Projected{HasValue: true, Score: 42.5})
	require.NoError(t, err)
	require.Contains(t, string(finite), `"Score":42.5`)
	require.NotContains(t, string(finite), `"plain"`)
}

// TestRepairTimeoutBoundsStalledRepair: with ContextTimeoutEnabled,
// RepairTimeout is the deadline of a repair sent to a Redis that stopped
// answering, also after the run's ctx was cancelled; the repair is counted
// uncertain, never dropped.
func TestRepairTimeoutBoundsStalledRepair(t *testing.T) {
	t.Parallel()
	rs := testenv.StartRedis(t)
	client := redis.NewClient(&redis.Options{Addr: rs.Addr(), ReadTimeout: -1, WriteTimeout: -1, ContextTimeoutEnabled: true, MaxRetries: -1})
	t.Cleanup(func() { _ = client.Close() })
	admin := rs.Client(t)
	t.Cleanup(func() { _ = admin.Do(context.Background(), "CLIENT", "UNPAUSE").Err() })
	b := setupWith(t, projection.KindSortedSet, client, "stall:")
	b.insert(t, "alice", 1) // missing in Redis: a gate repair
	require.NoError(t, b.gate.Load(context.Background()))

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var sentAt time.Time
	r := b.reconciler(t, &Config{
		RepairTimeout: 300 * time.Millisecond,
		BeforeRepair: func(context.Context, Finding) bool {
			// Redis stalls writes from now on; the run's ctx is
			// cancelled just after the repair goes out.
			require.NoError(t, admin.Do(context.Background(), "CLIENT", "PAUSE", "20000", "WRITE").Err())
			sentAt = time.Now()
			time.AfterFunc(100*time.Millisecond, cancel)
			return true
		},
	})
	rep, err := r.Run(ctx, RunOptions{})
	took := time.Since(sentAt)
	require.Error(t, err)
	require.Less(t, took, 3*time.Second, "the stalled repair outlived RepairTimeout")
	require.EqualValues(t, 1, rep.Uncertain, "the repair's outcome is unknown, not lost")
}

// TestRunRefusesWrongTypedKeysAlone: a document whose value key a foreign
// writer left holding a hash (its version intact), and one whose version
// key holds a hash (its value intact), read as corrupt, but repair.lua
// refuses their repairs before touching anything. The hand edits around
// them, on their page (b) and on a later one (f), are repaired in the same
// run, every page is checked, the orphan scan runs (it finds z), and Run
// returns one *WrongKeyTypeError per refused document, leaving the foreign
// keys as they were.
func TestRunRefusesWrongTypedKeysAlone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, projection.KindDocument)
	for _, key := range []string{"a", "b", "c", "d", "e", "f"} {
		b.insert(t, key, 1)
		b.project(t, key, 1)
	}
	b.project(t, "z", 1) // an orphan, for the orphan scan to find
	doc := func(key string) projection.Target { return b.target.target(key) }
	// a's value key and c's version key hold hashes (corrupt: repaired by
	// compare-and-set); d's version key holds a hash and its value is gone
	// (missing: repaired through the gate, in one call with e's).
	aValue, cVersion, dVersion := b.ks.ValueKey(doc("a")), b.ks.VersionKey(doc("c")), b.ks.VersionKey(doc("d"))
	require.NoError(t, b.client.Del(ctx, aValue, cVersion, dVersion, b.ks.ValueKey(doc("d")), b.ks.ValueKey(doc("e")), b.ks.VersionKey(doc("e"))).Err())
	for _, key := range []string{aValue, cVersion, dVersion} {
		require.NoError(t, b.client.HSet(ctx, key, "f", "1").Err())
	}
	for _, key := range []string{"b", "f"} {
		b.setRaw(t, key, &projection.Value{Data: []byte("hand edit")}, nil)
	}

	r := b.reconciler(t, &Config{PageSize: 3})
	check := func(t *testing.T, rep *Report, err error, want ...*WrongKeyTypeError) {
		t.Helper()
		require.ErrorIs(t, err, projection.ErrWrongKeyType)
		var refused []*WrongKeyTypeError
		for _, e := range err.(interface{ Unwrap() []error }).Unwrap() {
			var wt *WrongKeyTypeError
			require.ErrorAs(t, e, &wt)
			refused = append(refused, wt)
		}
		require.Equal(t, want, refused)
		require.EqualValues(t, len(want), rep.Results[ResultNotAttempted])
		require.Equal(t, rep.Drift(), rep.Repaired+rep.Skipped+rep.Uncertain)
		for key, foreign := range map[string]string{aValue: "a's value key", cVersion: "c's version key", dVersion: "d's version key"} {
			require.Equal(t, map[string]string{"f": "1"}, b.client.HGetAll(ctx, key).Val(), "%s is left as it was", foreign)
		}
	}
	refusedA := &WrongKeyTypeError{Key: "a", RedisKey: aValue, Type: "hash"}
	refusedC := &WrongKeyTypeError{Key: "c", RedisKey: cVersion, Type: "hash"}
	refusedD := &WrongKeyTypeError{Key: "d", RedisKey: dVersion, Type: "hash"}

	t.Run("Run", func(t *testing.T) {
		rep, err := r.Run(ctx, RunOptions{})
		check(t, rep, err, refusedA, refusedC, refusedD)
		require.EqualValues(t, 6, rep.Checked, "every page is checked")
		require.Equal(t, map[Class]int64{ClassCorrupt: 4, ClassMissing: 2, ClassOrphan: 1}, rep.Counts, "the orphan scan ran")
		require.EqualValues(t, 3, rep.Repaired, "b, e and f")
		for _, key := range []string{"b", "e", "f"} {
			require.Equal(t, string(b.value(key, 1).Data), b.client.Get(ctx, b.ks.ValueKey(doc(key))).Val(), key)
		}
	})
	t.Run("CheckKeys", func(t *testing.T) {
		rep, err := r.CheckKeys(ctx, []string{"a", "c", "d"}, RunOptions{})
		check(t, rep, err, refusedD, refusedA, refusedC)
		require.Equal(t, map[Class]int64{ClassCorrupt: 2, ClassMissing: 1}, rep.Counts)
	})
	t.Run("DeletedByHand", func(t *testing.T) {
		// The documented remedy: delete the foreign keys, and the next
		// run repairs the documents from the source.
		require.NoError(t, b.client.Del(ctx, aValue, cVersion, dVersion).Err())
		rep, err := r.Run(ctx, RunOptions{})
		require.NoError(t, err)
		require.EqualValues(t, 3, rep.Repaired)
		rep, err = r.Run(ctx, RunOptions{})
		require.NoError(t, err)
		require.Equal(t, map[Class]int64{ClassCurrent: 6, ClassOrphan: 1}, rep.Counts)
	})
}

// TestRepairScoresRedisPrintsOtherwise force-repairs sorted-set members
// whose scores Redis prints otherwise than the reconciler's read formats
// them (3000000 against 3e+06, 0.10000000000000001 against 0.1): the
// compare-and-set compares scores as numbers, so each repair is written,
// not declined as raced run after run.
func TestRepairScoresRedisPrintsOtherwise(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, projection.KindSortedSet)
	for key, score := range map[string]int64{"corrupt": 2_000_000, "fraction": 7, "ahead": 1} {
		_, err := b.pool.Exec(ctx, `INSERT INTO items (key, board, version, score) VALUES ($1, $2, 1, $3)`, key, testBoard, score)
		require.NoError(t, err)
	}
	var writes []projection.Write
	for key, w := range map[string]struct{ version, score int64 }{
		"corrupt": {1, 3_000_000}, "fraction": {1, 7}, "ahead": {2, projection.MaxScore}, "orphan": {1, -5_000_000},
	} {
		writes = append(writes, projection.Write{Target: b.target.target(key), Version: w.version, Value: projection.Value{Score: w.score}})
	}
	_, err := b.gate.Apply(ctx, writes)
	require.NoError(t, err)
	require.NoError(t, b.client.ZAdd(ctx, b.ks.ValueKey(b.target.target("")), redis.Z{Score: 0.1, Member: "fraction"}).Err())

	r := b.reconciler(t, &Config{Policy: Policy{Ahead: ActionRepair, Orphan: ActionRepair}})
	rep, err := r.Run(ctx, RunOptions{})
	require.NoError(t, err)
	require.Equal(t, map[Class]int64{ClassCorrupt: 2, ClassAhead: 1, ClassOrphan: 1}, rep.Counts)
	require.Equal(t, map[Result]int64{ResultRepaired: 4}, rep.Results)
	require.Equal(t, Projected{}, b.state(t, r, "orphan"))
	rep, err = r.Run(ctx, RunOptions{DryRun: true})
	require.NoError(t, err)
	require.Equal(t, map[Class]int64{ClassCurrent: 3}, rep.Counts)
}

// TestOrphanScanFindsAValueWithoutVersion: an orphan that is a value
// without a version leaves the version count as the pass accounted for it;
// the value count differs, so the scan runs and finds it.
func TestOrphanScanFindsAValueWithoutVersion(t *testing.T) {
	t.Parallel()
	forKinds(t, collectionKinds, func(t *testing.T, b *testBundle) {
		b.projectRows(t, b.insertMany(t, 20))
		b.setRaw(t, "ghost", &projection.Value{Score: 3, Data: []byte("ghost")}, nil)
		rep, err := b.reconciler(t, &Config{PageSize: 8}).Run(context.Background(), RunOptions{})
		require.NoError(t, err)
		require.False(t, rep.OrphanScanSkipped)
		require.Equal(t, map[Class]int64{ClassCurrent: 20, ClassOrphan: 1}, rep.Counts)
		require.Equal(t, "ghost", rep.Examples[ClassOrphan][0].Key)
	})
}

// TestOrphanScanFindsAVersionWithoutValue is the converse: an orphan that
// is a version without a value leaves the value count as the pass
// accounted for it; the version count differs, so the scan runs and finds
// it.
func TestOrphanScanFindsAVersionWithoutValue(t *testing.T) {
	t.Parallel()
	forKinds(t, collectionKinds, func(t *testing.T, b *testBundle) {
		b.projectRows(t, b.insertMany(t, 20))
		b.setRaw(t, "ghost", nil, ptr("7"))
		rep, err := b.reconciler(t, &Config{PageSize: 8}).Run(context.Background(), RunOptions{})
		require.NoError(t, err)
		require.False(t, rep.OrphanScanSkipped)
		require.Equal(t, map[Class]int64{ClassCurrent: 20, ClassOrphan: 1}, rep.Counts)
		require.Equal(t, "ghost", rep.Examples[ClassOrphan][0].Key)
	})
}

// TestRunRefusesASourceRepeatingKeys: a Source whose Page ignores the
// cursor returns its first page forever. Run and Rebuild stop at the
// repeated page with an error instead of reading it again and again.
func TestRunRefusesASourceRepeatingKeys(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	b := setup(t, projection.KindSortedSet)
	r, err := New(repeatingSource{rowsSource{rows: []Row{b.insert(t, "a", 1), b.insert(t, "b", 1)}}}, b.target, nil)
	require.NoError(t, err)
	_, err = r.Run(ctx, RunOptions{})
	require.ErrorContains(t, err, `source returned key "b" again`)
	rep, err := r.Rebuild(ctx)
	require.ErrorContains(t, err, `source returned key "b" again`)
	require.False(t, rep.Switched)
}

// repeatingSource is a rowsSource whose Page ignores the cursor.
type repeatingSource struct{ rowsSource }

func (s repeatingSource) Page(ctx context.Context, _ Cursor, limit int) ([]Row, error) {
	return s.rowsSource.Page(ctx, Cursor{}, limit)
}

// TestRepairRaceVersionCorruptedBeforeGateRepair: a hand edit leaves one
// of two stale entries with a version the gate refuses ("garbage")
// between their read and their gate repair. That write is declined
// (raced, the edit left for the next run, which finds it corrupt) and the
// other is written: the run neither fails nor calls the batch uncertain.
func TestRepairRaceVersionCorruptedBeforeGateRepair(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindHash)
	for _, key := range []string{"s1", "s2"} {
		b.insert(t, key, 3)
		b.project(t, key, 1)
	}
	r := b.reconciler(t, &Config{BeforeRepair: func(_ context.Context, f Finding) bool {
		if f.Key == "s1" {
			b.setRaw(t, "s1", nil, ptr("garbage"))
		}
		return true
	}})
	rep, err := r.Run(context.Background(), RunOptions{})
	require.NoError(t, err)
	require.Equal(t, map[Class]int64{ClassStale: 2}, rep.Counts)
	require.Equal(t, map[Result]int64{ResultRepaired: 1, ResultRaced: 1}, rep.Results)
	require.Equal(t, "garbage", b.state(t, r, "s1").RawVersion)
	require.Equal(t, int64(3), b.state(t, r, "s2").Version)
}

// CheckKeys checks each key once, whatever the list repeats: the report
// counts entities (Checked, Counts, Drift). TestCheckKeys repeats a key
// within one page only, where the page's own Lookup collapses the copies;
// copies in different pages (a list longer than PageSize) were checked,
// counted and repaired twice once the dedupe went, and no test failed.
// (A mutation audit of 2026-12-07 found this untested.)
func TestCheckKeysRepeatAcrossPages(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet)
	want := b.drift(t)
	require.Equal(t, ClassStale, want["stale"])
	require.Equal(t, ClassOrphan, want["orphan"])
	r := b.reconciler(t, &Config{PageSize: 1})
	rep, err := r.CheckKeys(context.Background(), []string{"stale", "orphan", "stale", "orphan"}, RunOptions{DryRun: true})
	require.NoError(t, err)
	require.EqualValues(t, 1, rep.Checked, "%s", rep)
	require.Equal(t, map[Class]int64{ClassStale: 1, ClassOrphan: 1}, rep.Counts, "%s", rep)
	require.EqualValues(t, 2, rep.Drift())
}

// RunOptions.Sample is "at most SampleMax": SampleMax itself is a valid
// sample (on a small source it checks every row). The tests refused
// SampleMax+1 and never ran SampleMax, so a bound of >= went unnoticed.
// (A mutation audit of 2026-12-07 found this untested.)
func TestSampleMaxIsAccepted(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet)
	b.drift(t)
	r := b.reconciler(t, nil)
	full, err := r.Run(context.Background(), RunOptions{DryRun: true})
	require.NoError(t, err)
	rep, err := r.Run(context.Background(), RunOptions{Sample: SampleMax, DryRun: true})
	require.NoError(t, err, "Sample = SampleMax")
	require.True(t, rep.Sampled)
	require.Equal(t, full.Checked, rep.Checked, "a sample larger than the source checks every row")
	_, err = r.Run(context.Background(), RunOptions{Sample: SampleMax + 1, DryRun: true})
	require.ErrorIs(t, err, ErrInvalidConfig)
}

// TestRacedRepairDoesNotSkipTheOrphanScan: a raced repair leaves the entry's
// state unknown: the count comparison must not skip the orphan scan on the
// strength of the state as read. Here the raced entry vanished, so Redis
// holds exactly as many entries as were read, one of them an orphan.
func TestRacedRepairDoesNotSkipTheOrphanScan(t *testing.T) {
	t.Parallel()
	forKinds(t, []projection.Kind{projection.KindSortedSet, projection.KindHash}, func(t *testing.T, b *testBundle) {
		ctx := context.Background()
		b.insert(t, "k1", 2)
		b.project(t, "k1", 2)
		b.project(t, "orphan", 1)
		other := b.value("k1", 9)
		b.setRaw(t, "k1", &other, nil) // corrupt: same version, another value
		r := b.reconciler(t, &Config{BeforeRepair: func(ctx context.Context, f Finding) bool {
			// A write between the read and the repair: the entry is gone.
			tg := b.target.target(f.Key)
			if b.kind == projection.KindSortedSet {
				require.NoError(t, b.client.ZRem(ctx, b.ks.ValueKey(tg), f.Key).Err())
			} else {
				require.NoError(t, b.client.HDel(ctx, b.ks.ValueKey(tg), f.Key).Err())
			}
			require.NoError(t, b.client.HDel(ctx, b.ks.VersionKey(tg), f.Key).Err())
			return true
		}})
		rep, err := r.Run(ctx, RunOptions{})
		require.NoError(t, err)
		require.Equal(t, int64(1), rep.Results[ResultRaced], rep.String())
		require.False(t, rep.OrphanScanSkipped)
		require.Equal(t, int64(1), rep.Counts[ClassOrphan], rep.String())
	})
}

// TestRunKeepsNoKeyPerEntryLeftMissing: a dry run, or a policy that only
// reports, over a projection that lost its entries kept a key per row in
// the Report for the orphan scan, against the package doc's memory bound
// of PageSize times ReadAhead; an entry left missing or stale is one the
// scan never counts, so none is kept now, and the counts stay exact.
func TestRunKeepsNoKeyPerEntryLeftMissing(t *testing.T) {
	t.Parallel()
	const rows, pageSize = 3_000, 100
	b := setup(t, projection.KindSortedSet)
	b.insertMany(t, rows) // Redis holds none of them
	for name, run := range map[string]struct {
		cfg  *Config
		opts RunOptions
		want Result
	}{
		"DryRun":     {&Config{PageSize: pageSize}, RunOptions{DryRun: true}, ResultDryRun},
		"ReportOnly": {&Config{PageSize: pageSize, Policy: Policy{Missing: ActionReport}}, RunOptions{}, ResultReported},
	} {
		r := b.reconciler(t, run.cfg)
		rep, err := r.Run(context.Background(), run.opts)
		require.NoError(t, err, name)
		require.EqualValues(t, rows, rep.Counts[ClassMissing], name)
		require.EqualValues(t, rows, rep.Results[run.want], name)
		require.Zero(t, rep.Counts[ClassOrphan], name)
		require.LessOrEqual(t, len(rep.drifted), pageSize*r.cfg.ReadAhead, name)
	}
}
