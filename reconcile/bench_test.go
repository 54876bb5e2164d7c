package reconcile

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/projection"
)

// benchRows is the table size of the benchmarks; VERITY_BENCH_ROWS
// overrides it.
func benchRows() int {
	if n, err := strconv.Atoi(os.Getenv("VERITY_BENCH_ROWS")); err == nil && n > 0 {
		return n
	}
	return 20_000
}

// The three ways to check a sorted-set projection against PostgreSQL, on
// the same data. Each reports rows/s.
func BenchmarkCheck(b *testing.B) {
	bundle := setupBench(b)
	n := benchRows()
	ctx := context.Background()

	b.Run("Reconciler", func(b *testing.B) {
		r, err := New(bundle.source, bundle.target, &Config{PageSize: 1000, SkipOrphans: true})
		require.NoError(b, err)
		for b.Loop() {
			rep, err := r.Run(ctx, RunOptions{DryRun: true})
			require.NoError(b, err)
			require.EqualValues(b, n, rep.Checked)
		}
		b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds(), "rows/s")
	})

	b.Run("NaiveZScorePerRow", func(b *testing.B) {
		// SELECT everything, then one ZSCORE and one HGET round trip per row.
		key, verKey := bundle.ks.ValueKey(bundle.target.target("")), bundle.ks.VersionKey(bundle.target.target(""))
		for b.Loop() {
			rows, err := bundle.pool.Query(ctx, `SELECT key, version, score FROM items WHERE board = $1`, testBoard)
			require.NoError(b, err)
			checked := 0
			for rows.Next() {
				var k string
				var v, s int64
				require.NoError(b, rows.Scan(&k, &v, &s))
				score, err := bundle.client.ZScore(ctx, key, k).Result()
				if err != nil && err != redis.Nil {
					b.Fatal(err)
				}
				ver, err := bundle.client.HGet(ctx, verKey, k).Result()
				if err != nil && err != redis.Nil {
					b.Fatal(err)
				}
				_, _ = score, ver
				checked++
			}
			require.NoError(b, rows.Err())
			require.Equal(b, n, checked)
		}
		b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds(), "rows/s")
	})

	b.Run("KeysetPipelinedLoop", func(b *testing.B) {
		// Hand-written keyset pages of 1000 and one pipelined ZMSCORE+HMGET
		// per page, sequential (no prefetch, no repairs, no report).
		key, verKey := bundle.ks.ValueKey(bundle.target.target("")), bundle.ks.VersionKey(bundle.target.target(""))
		for b.Loop() {
			after, first, checked := "", true, 0
			for {
				var rows pgx.Rows
				var err error
				if first {
					rows, err = bundle.pool.Query(ctx, `SELECT key, version, score FROM items WHERE board = $1 ORDER BY key LIMIT 1000`, testBoard)
				} else {
					rows, err = bundle.pool.Query(ctx, `SELECT key, version, score FROM items WHERE board = $1 AND key > $2 ORDER BY key LIMIT 1000`, testBoard, after)
				}
				require.NoError(b, err)
				var members []any
				for rows.Next() {
					var k string
					var v, s int64
					require.NoError(b, rows.Scan(&k, &v, &s))
					members = append(members, k)
				}
				require.NoError(b, rows.Err())
				if len(members) == 0 {
					break
				}
				pipe := bundle.client.Pipeline()
				pipe.Do(ctx, append([]any{"ZMSCORE", key}, members...)...)
				pipe.Do(ctx, append([]any{"HMGET", verKey}, members...)...)
				_, err = pipe.Exec(ctx)
				require.NoError(b, err)
				checked += len(members)
				after, first = members[len(members)-1].(string), false
			}
			require.Equal(b, n, checked)
		}
		b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds(), "rows/s")
	})
}

// setupBench loads benchRows() rows, all projected, one in 100 corrupted.
func setupBench(b *testing.B) *testBundle {
	bundle := setup(b, projection.KindSortedSet)
	rows := bundle.insertMany(b, benchRows())
	bundle.projectRows(b, rows)
	for i := 0; i < len(rows); i += 100 {
		bundle.setRaw(b, rows[i].Key, &projection.Value{Score: -1}, nil)
	}
	_, err := bundle.pool.Exec(context.Background(), "ANALYZE items")
	require.NoError(b, err)
	return bundle
}

// TestMillionRows is an opt-in scale test (VERITY_TEST_MILLION=1): a full
// pass over 1,000,000 rows with memory bounded by the page size. It logs
// rows/s and the peak heap.
func TestMillionRows(t *testing.T) {
	if os.Getenv("VERITY_TEST_MILLION") != "1" {
		t.Skip("set VERITY_TEST_MILLION=1 to run the 1M-row pass")
	}
	const n = 1_000_000
	b := setup(t, projection.KindSortedSet)
	rows := b.insertMany(t, n)
	b.projectRows(t, rows[:n-1000]) // the last 1000 are missing
	rows = nil
	runtime.GC()

	var peak uint64
	stop := make(chan struct{})
	go func() {
		var ms runtime.MemStats
		for {
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
				runtime.ReadMemStats(&ms)
				peak = max(peak, ms.HeapInuse)
			}
		}
	}()
	r := b.reconciler(t, &Config{PageSize: 1000})
	rep, err := r.Run(context.Background(), RunOptions{})
	close(stop)
	require.NoError(t, err)
	require.EqualValues(t, n, rep.Checked)
	require.EqualValues(t, 1000, rep.Repaired)
	require.True(t, rep.OrphanScanSkipped)
	t.Logf("1M rows, 1000 repaired, orphan scan skipped by counts: %s, %.0f rows/s, peak heap in use %.1f MiB",
		rep.Duration, float64(n)/rep.Duration.Seconds(), float64(peak)/(1<<20))

	// With one orphan, the counts differ and the whole projection is
	// scanned and looked up in the source as well.
	b.project(t, "orphan", 1)
	rep, err = r.Run(context.Background(), RunOptions{DryRun: true})
	require.NoError(t, err)
	require.EqualValues(t, 1, rep.Counts[ClassOrphan])
	require.EqualValues(t, n+1, rep.Scanned)
	t.Logf("1M rows plus orphan scan of %d entries: %s, %.0f rows/s", rep.Scanned, rep.Duration, float64(n)/rep.Duration.Seconds())
}

// BenchmarkRebuild rebuilds the whole sorted set (shadow copy through the
// gate, then the atomic switch) and reports rows/s.
func BenchmarkRebuild(b *testing.B) {
	bundle := setupBench(b)
	n := benchRows()
	r, err := New(bundle.source, bundle.target, &Config{PageSize: 1000})
	require.NoError(b, err)
	for b.Loop() {
		rep, err := r.Rebuild(context.Background())
		require.NoError(b, err)
		require.EqualValues(b, n, rep.Rows)
	}
	b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds(), "rows/s")
}

// BenchmarkCheckBuckets compares a full pass (orphan count check included)
// over one collection kept with one version hash and the same data kept
// with version buckets (rows / 64 of them, as documented). Each reports
// rows/s.
func BenchmarkCheckBuckets(b *testing.B) {
	flat := setupBench(b)
	n := benchRows()
	bucketed := flat.withBuckets(b, max(1, (n+32)/64))
	// Same prefix and name would share the value key: move the bucketed
	// copy to a collection of its own.
	bucketed.target.Name = testBoard + "-buckets"
	rows, err := flat.source.Page(context.Background(), Cursor{}, n)
	require.NoError(b, err)
	for len(rows) > 0 {
		k := min(len(rows), 1000)
		writes := make([]projection.Write, k)
		for i, r := range rows[:k] {
			writes[i] = projection.Write{Target: bucketed.target.target(r.Key), Version: r.Version, Value: r.Value}
		}
		_, err := bucketed.gate.Apply(context.Background(), writes)
		require.NoError(b, err)
		rows = rows[k:]
	}
	for i := 0; i < n; i += 100 { // the same drift as setupBench's
		bucketed.setRaw(b, fmt.Sprintf("k%07d", i), &projection.Value{Score: -1}, nil)
	}
	for _, v := range []struct {
		name   string
		bundle *testBundle
	}{{"OneVersionHash", flat}, {"VersionBuckets", bucketed}} {
		b.Run(v.name, func(b *testing.B) {
			r, err := New(v.bundle.source, v.bundle.target, &Config{PageSize: 1000})
			require.NoError(b, err)
			for b.Loop() {
				rep, err := r.Run(context.Background(), RunOptions{DryRun: true})
				require.NoError(b, err)
				require.EqualValues(b, n, rep.Checked)
				require.EqualValues(b, n/100, rep.Counts[ClassCorrupt])
			}
			b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds(), "rows/s")
		})
	}
}
