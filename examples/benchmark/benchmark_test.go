package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/services"
	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/projection"
)

// TestMain lets the test binary stand in for the benchmark binary when the
// rss figure re-executes itself as a relay child.
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "relay" {
		if err := relayChild(context.Background(), os.Stdin, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, "benchmark relay child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	testenv.Main(m)
}

// wantFigures is every figure a full run reports.
var wantFigures = []string{
	"drain", "drain_1_worker",
	"ingest", "ingest_ungrouped", "ingest_submit_batch",
	"lag_p50", "lag_p99", "lag_load_achieved",
	"cache_hit_p50", "cache_hit_p99", "cache_hit_p50_vs_seed", "cache_hit_p99_vs_seed",
	"reconcile",
	"memory", "relay_rss_peak",
}

// TestQuick runs the whole harness in quick mode, as CI does. It asserts
// that the harness works — every figure present, positive, in the JSON
// shape documented — and nothing about speed: these are benchmarks, and
// the machine running the tests may be arbitrarily slow or busy.
func TestQuick(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testenv.Postgres(t)
	rd := testenv.Redis(t)

	opts := Options{
		PostgresURL: pg.ServerURL, RedisURL: rd.URL,
		Sizes: quickSizes, Relays: 4, BatchSize: 100, SeedPoll: 10 * time.Millisecond,
		Suffix: services.RandomSuffix(8),
	}
	figs, err := Run(ctx, opts)
	require.NoError(t, err)

	var out bytes.Buffer
	require.NoError(t, writeFigures(&out, figs, true, opts))
	dec := json.NewDecoder(&out)
	got := map[string]map[string]any{}
	for dec.More() {
		var obj map[string]any
		require.NoError(t, dec.Decode(&obj))
		require.ElementsMatch(t, []string{"name", "value", "unit", "baseline", "ratio"}, keysOf(obj))
		got[obj["name"].(string)] = obj
	}
	require.ElementsMatch(t, wantFigures, keysOf(got))
	for name, obj := range got {
		for _, field := range []string{"value", "baseline", "ratio"} {
			require.Positive(t, obj[field].(float64), "%s: %s", name, field)
		}
		require.NotEmpty(t, obj["unit"], name)
	}

	// Everything the run created is gone.
	var schemas int
	require.NoError(t, pg.Pool.QueryRow(ctx,
		`SELECT count(*) FROM pg_namespace WHERE starts_with(nspname, $1)`, "verity_bench_"+opts.Suffix+"_").Scan(&schemas))
	require.Zero(t, schemas, "schemas left behind")
	var left []string
	for _, pattern := range []string{"verity-bench-" + opts.Suffix + ":*", memoryPrefix(opts.Suffix) + "*"} {
		iter := rd.Client.Scan(ctx, 0, pattern, 1000).Iterator()
		for iter.Next(ctx) {
			left = append(left, iter.Val())
		}
		require.NoError(t, iter.Err())
	}
	require.Empty(t, left, "keys left behind")

	var table bytes.Buffer
	require.NoError(t, writeFigures(&table, figs, false, opts))
	for _, name := range wantFigures {
		require.Contains(t, table.String(), name)
	}
}

func keysOf[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// testEnv returns a harness env with sizes on the test servers, as Run
// builds one; everything it creates is removed at cleanup.
func testEnv(t *testing.T, sizes Sizes) *env {
	t.Helper()
	ctx := context.Background()
	pg := testenv.Postgres(t)
	rd := testenv.Redis(t)
	pool, err := pgxpool.New(ctx, pg.ServerURL)
	require.NoError(t, err)
	ropts, err := redis.ParseURL(rd.URL)
	require.NoError(t, err)
	rdb := redis.NewClient(ropts)
	suffix := services.RandomSuffix(8)
	e := &env{
		opts:   Options{PostgresURL: pg.ServerURL, RedisURL: rd.URL, Sizes: sizes, Relays: 2, BatchSize: 100, SeedPoll: 10 * time.Millisecond},
		pool:   pool,
		rdb:    rdb,
		suffix: suffix,
		prefix: "verity-bench-" + suffix + ":",
		log:    func(string, ...any) {},
	}
	t.Cleanup(func() {
		require.NoError(t, e.close(context.Background()))
		rdb.Close()
		pool.Close()
	})
	return e
}

// TestDrainChecksProjectedValues: a drain counts only if every member
// ends up with its last row's score and version; rows handled and members
// counted are not enough (a drain whose writes were all refused as stale
// handles every row and leaves every member in place).
func TestDrainChecksProjectedValues(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := testEnv(t, quickSizes)
	schema, err := e.schema(ctx, "drain")
	require.NoError(t, err)
	seedPool, err := e.seedWorkerPool(ctx)
	require.NoError(t, err)
	const n, users = 203, 50 // users 0-2 get one row more than the rest

	t.Run("Current", func(t *testing.T) {
		_, err := drainLibrary(ctx, e, schema, "current", n, users, 2)
		require.NoError(t, err)
		_, err = drainSeed(ctx, e, seedPool, schema, "current", n, users, 2)
		require.NoError(t, err)
	})

	t.Run("LibraryWritesStale", func(t *testing.T) {
		ks, err := projection.NewKeyspace(e.keyPrefix("drain-lib-stale"))
		require.NoError(t, err)
		writes := make([]projection.Write, users)
		for k := range writes {
			writes[k] = projection.Write{
				Target:  projection.Target{Kind: projection.KindSortedSet, Name: "drain", Member: fmt.Sprintf("user-%d", k)},
				Version: 1_000_000, Value: projection.Value{Score: -1},
			}
		}
		_, err = projection.NewGate(e.rdb, ks).Apply(ctx, writes)
		require.NoError(t, err)
		_, err = drainLibrary(ctx, e, schema, "stale", n, users, 2)
		require.ErrorContains(t, err, "50 of 50 members hold a wrong score or version")
	})

	t.Run("SeedWritesStale", func(t *testing.T) {
		s := newSeedKeys(e.rdb, e.keyPrefix("drain-seed-stale"))
		for k := range users {
			member := fmt.Sprintf("user-%d", k)
			require.NoError(t, e.rdb.HSet(ctx, s.versions, member, 1_000_000).Err())
			require.NoError(t, e.rdb.ZAdd(ctx, s.zset, redis.Z{Score: -1, Member: member}).Err())
		}
		_, err := drainSeed(ctx, e, seedPool, schema, "stale", n, users, 2)
		require.ErrorContains(t, err, "50 of 50 members hold a wrong score or version")
	})
}

// TestMemoryChecksMembersStored: the memory figure divides by the members
// projected, so a write the gate did not apply fails the group.
func TestMemoryChecksMembersStored(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	sizes := quickSizes
	sizes.MemoryMembers = 200
	e := testEnv(t, sizes)
	// user-000000007 is already at version 2: the group's version 1 is stale.
	ks, err := projection.NewKeyspace(memoryPrefix(e.suffix) + "lib:")
	require.NoError(t, err)
	ks, err = ks.WithVersionBuckets(bucketCount(sizes.MemoryMembers))
	require.NoError(t, err)
	_, err = projection.NewGate(e.rdb, ks).Apply(ctx, []projection.Write{{
		Target:  projection.Target{Kind: projection.KindSortedSet, Name: "board", Member: "user-000000007"},
		Version: 2, Value: projection.Value{Score: 1},
	}})
	require.NoError(t, err)

	_, err = runMemory(ctx, e)
	require.ErrorContains(t, err, "user-000000007 write stale")
}

// TestDrainRowsMinimum: a backlog too small for every drain round is
// refused, never reported as a figure of 0 rows/s.
func TestDrainRowsMinimum(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("UsageError", func(t *testing.T) {
		var out, progress bytes.Buffer
		err := mainErr(ctx, []string{"-quick", "-only", "drain", "-silent", "-json", "-drain-rows", strconv.Itoa(minDrainRows - 1)}, &out, &progress)
		require.ErrorContains(t, err, "-drain-rows must be at least")
		require.ErrorAs(t, err, new(usageError))
		require.Empty(t, out.String(), "figures printed")
	})

	t.Run("NoZeroFigure", func(t *testing.T) {
		sizes := quickSizes
		sizes.DrainRows = minDrainRows / 2 // drain_1_worker rounds get 0 rows
		figs, err := runDrain(ctx, testEnv(t, sizes))
		require.ErrorContains(t, err, "drain_1_worker: library: nothing to measure", "figures %+v", figs)
	})
}

// TestUsageErrors: a command line the benchmark cannot run as asked — a
// stray argument ("quick" for -quick), an unknown flag or figure group, a
// bad value — is a usage error (exit 2) found before anything connects,
// as leaderboard-service's are, never a full run of several minutes with
// the stray word ignored. The context is already cancelled, so that a run
// started by mistake does no work.
func TestUsageErrors(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"StrayArgument", []string{"-silent", "-json", "-only", "cache", "quick"}, `unexpected argument "quick"`},
		{"UnknownFlag", []string{"-silent", "-json", "-nope"}, "flag provided but not defined"},
		{"UnknownGroup", []string{"-silent", "-json", "-only", "cache,drian"}, `-only: unknown figure group "drian"`},
		{"BadRelays", []string{"-silent", "-json", "-relays", "0"}, "-relays must be at least 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var out, progress bytes.Buffer
			err := mainErr(ctx, tc.args, &out, &progress)
			require.ErrorContains(t, err, tc.want)
			require.ErrorAs(t, err, new(usageError))
			require.Empty(t, out.String(), "figures printed")
		})
	}
}
