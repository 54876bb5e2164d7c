package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/services"
	"github.com/verity-go/verity/internal/testenv"
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
