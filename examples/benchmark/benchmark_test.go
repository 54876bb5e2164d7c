package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/services"
	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
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
	return testEnvOn(t, sizes, testenv.Postgres(t).ServerURL)
}

// testEnvOn is testEnv on the PostgreSQL database at pgURL.
func testEnvOn(t *testing.T, sizes Sizes, pgURL string) *env {
	t.Helper()
	ctx := context.Background()
	rd := testenv.Redis(t)
	pool, err := pgxpool.New(ctx, pgURL)
	require.NoError(t, err)
	ropts, err := redis.ParseURL(rd.URL)
	require.NoError(t, err)
	rdb := redis.NewClient(ropts)
	suffix := services.RandomSuffix(8)
	e := &env{
		opts:   Options{PostgresURL: pgURL, RedisURL: rd.URL, Sizes: sizes, Relays: 2, BatchSize: 100, SeedPoll: 10 * time.Millisecond},
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
		{"ZeroSeedPoll", []string{"-silent", "-json", "-seed-poll", "0"}, "-seed-poll must be positive"},
		{"NegativeSeedPoll", []string{"-silent", "-json", "-seed-poll", "-1ms"}, "-seed-poll must be positive"},
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

// dropInsertsInto returns the URL of a private database (dropped at
// cleanup) in which every INSERT into a table named table, in any schema,
// is silently dropped: an event trigger gives each such table, as it is
// created, a BEFORE INSERT trigger returning NULL. The statements then
// succeed and store nothing. Event triggers are per database, so other
// tests are not touched.
func dropInsertsInto(t *testing.T, table string) string {
	t.Helper()
	ctx := context.Background()
	pg := testenv.Postgres(t)
	db := "verity_bench_drop_" + strings.ToLower(services.RandomSuffix(8))
	_, err := pg.Pool.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{db}.Sanitize())
	require.NoError(t, err)
	t.Cleanup(func() {
		_, err := pg.Pool.Exec(context.Background(), "DROP DATABASE IF EXISTS "+pgx.Identifier{db}.Sanitize()+" WITH (FORCE)")
		require.NoError(t, err)
	})
	u, err := url.Parse(pg.ServerURL)
	require.NoError(t, err)
	u.Path = "/" + db
	conn, err := pgx.Connect(ctx, u.String())
	require.NoError(t, err)
	defer conn.Close(ctx)
	// table is one of the test's constants: a plain lowercase name.
	_, err = conn.Exec(ctx, `
CREATE FUNCTION public.drop_insert() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$;
CREATE FUNCTION public.on_create() RETURNS event_trigger LANGUAGE plpgsql AS $$
DECLARE r record;
BEGIN
    FOR r IN SELECT * FROM pg_event_trigger_ddl_commands() WHERE command_tag = 'CREATE TABLE' LOOP
        IF r.object_identity LIKE '%.`+table+`' THEN
            EXECUTE format('CREATE TRIGGER drop_insert BEFORE INSERT ON %s FOR EACH ROW EXECUTE FUNCTION public.drop_insert()', r.object_identity);
        END IF;
    END LOOP;
END $$;
CREATE EVENT TRIGGER drop_inserts ON ddl_command_end WHEN TAG IN ('CREATE TABLE') EXECUTE FUNCTION public.on_create();`)
	require.NoError(t, err)
	return u.String()
}

// TestIngestChecksCommandsStored: an ingest command counts only if it was
// stored. A call returning without an error is not proof: with the inserts
// into score_events (or the outbox) dropped, the library's Submit still
// changes the score and returns a result, and the seed's handler takes
// every command for a duplicate and commits nothing. Each side's phase
// must then fail the group instead of posting a figure.
func TestIngestChecksCommandsStored(t *testing.T) {
	t.Parallel()
	sizes := quickSizes
	sizes.IngestDuration = 400 * time.Millisecond
	for _, tc := range []struct {
		name, table, want string
	}{
		// The library's phase runs first and stores no event.
		{"LibraryEvents", leaderboard.ScoreEventsTable, "stored 0 events and queued 0 outbox rows"},
		// The library's phase stores its events but queues nothing.
		{"LibraryOutbox", leaderboard.OutboxTableDefault, "queued 0 outbox rows"},
		// The library's phase passes; the seed's answers duplicates.
		{"SeedEvents", "seed_score_events", "seed submit: event"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := testEnvOn(t, sizes, dropInsertsInto(t, tc.table))
			figs, err := runIngest(context.Background(), e)
			require.ErrorContains(t, err, tc.want, "figures %+v", figs)
			require.Empty(t, figs)
		})
	}
}

// TestRSSChecksRowsProjected: the relay_rss_peak figure counts only if the
// relay child projected its backlog. The child's own count of rows handled
// includes records its projector refused; here every payload is not a
// score, nothing reaches Redis, the rows stay in the outbox (or go to the
// dead letters), and the child still reports them all handled.
func TestRSSChecksRowsProjected(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := testEnv(t, quickSizes)
	schema, err := e.schema(ctx, "rss")
	require.NoError(t, err)
	const rows, users = 500, 100

	t.Run("Projected", func(t *testing.T) {
		table, err := newOutbox(ctx, e.pool, schema, "rss_good")
		require.NoError(t, err)
		require.NoError(t, fillOutbox(ctx, e.pool, table, drainStream, rows, users))
		peak, err := runRelayChild(ctx, e, schema, "rss_good", rows, users)
		require.NoError(t, err)
		require.Positive(t, peak)
	})

	t.Run("PayloadsRefused", func(t *testing.T) {
		table, err := newOutbox(ctx, e.pool, schema, "rss_bad")
		require.NoError(t, err)
		_, err = e.pool.Exec(ctx, `INSERT INTO `+table+` (event_id, stream, key, version, payload)
SELECT gen_random_uuid(), $1, 'user-' || (g % $3), g / $3 + 1, convert_to('not a score', 'UTF8')
FROM generate_series(0, $2::int - 1) AS g`, drainStream, rows, users)
		require.NoError(t, err)
		peak, err := runRelayChild(ctx, e, schema, "rss_bad", rows, users)
		require.ErrorContains(t, err, "0 members of 100", "peak %.1f MiB reported", peak)
	})
}

// TestHostCPU: PostgreSQL's share is read only for a server on this host,
// and from /proc where there is one.
func TestHostCPU(t *testing.T) {
	t.Parallel()
	for host, want := range map[string]bool{
		"127.0.0.1": true, "::1": true, "localhost": true, "/var/run/postgresql": true,
		"10.0.0.7": false, "db.example.com": false, "": false,
	} {
		require.Equal(t, want, onThisHost(host), "host %q", host)
	}
	require.False(t, readHostCPU("10.0.0.7").ok, "a remote server's CPU is not this host's postgres processes'")
	if _, err := os.Stat("/proc/stat"); err != nil {
		t.Skip("no /proc on this system")
	}
	pg := testenv.Postgres(t)
	before := readHostCPU(pg.Pool.Config().ConnConfig.Host)
	if !before.ok {
		t.Skipf("PostgreSQL (%s) does not run on this host", pg.Pool.Config().ConnConfig.Host)
	}
	// Work the server so that its processes' CPU time moves.
	_, err := pg.Pool.Exec(context.Background(), `SELECT count(*) FROM generate_series(1, 3000000)`)
	require.NoError(t, err)
	after := readHostCPU(pg.Pool.Config().ConnConfig.Host)
	require.True(t, after.ok)
	require.Greater(t, after.postgres, before.postgres, "the query's CPU time is counted")
	require.Greater(t, after.total, before.total)
	require.LessOrEqual(t, after.busy-before.busy, after.total-before.total)
}

// TestHostCPUParsing: guest time, which the kernel already counts in user
// and nice, is not counted twice, and exited children's time is counted.
func TestHostCPUParsing(t *testing.T) {
	t.Parallel()

	t.Run("GuestCountedOnce", func(t *testing.T) {
		t.Parallel()
		// user 100 (of it guest 40), nice 10 (guest_nice 5), system 20,
		// idle 300, iowait 7, irq 1, softirq 2, steal 3.
		h, ok := parseCPULine("cpu  100 10 20 300 7 1 2 3 40 5")
		require.True(t, ok)
		require.Equal(t, 443*clockTick, h.total)
		require.Equal(t, 136*clockTick, h.busy)
		// Older kernels end before steal.
		h, ok = parseCPULine("cpu  100 10 20 300 7")
		require.True(t, ok)
		require.Equal(t, 437*clockTick, h.total)
		require.Equal(t, 130*clockTick, h.busy)
		for _, bad := range []string{"", "cpu0 1 2 3 4 5", "cpu 1 2 3", "cpu 1 2 x 4 5"} {
			_, ok := parseCPULine(bad)
			require.False(t, ok, "%q", bad)
		}
	})

	t.Run("ProcessAndWaitedChildren", func(t *testing.T) {
		t.Parallel()
		// utime 11, stime 12, cutime 13, cstime 14; a comm with spaces and
		// parentheses is not postgres.
		const line = "42 (postgres) S 1 42 42 0 -1 4194560 900 0 0 0 11 12 13 14 20 0 1 0 100 0 0"
		ticks, ok := postgresTicks(line)
		require.True(t, ok)
		require.Equal(t, int64(50), ticks)
		for _, other := range []string{
			"43 (redis-server) S 1 43 43 0 -1 4194560 900 0 0 0 11 12 13 14 20 0 1 0 100 0 0",
			"44 (x) (postgres) S 1 44 44 0 -1 4194560 900 0 0 0 11 12 13 14 20 0 1 0 100 0 0",
			"45 (postgres) S 1 45",
		} {
			_, ok := postgresTicks(other)
			require.False(t, ok, "%q", other)
		}
	})

	t.Run("ExitedBackendStillCounts", func(t *testing.T) {
		t.Parallel()
		if _, err := os.Stat("/proc/self/stat"); err != nil {
			t.Skip("no /proc on this system")
		}
		pg := testenv.Postgres(t)
		if !onThisHost(pg.Pool.Config().ConnConfig.Host) {
			t.Skip("PostgreSQL does not run on this host")
		}
		ctx := context.Background()
		conn, err := pgx.ConnectConfig(ctx, pg.Pool.Config().ConnConfig.Copy())
		require.NoError(t, err)
		pid := conn.PgConn().PID()
		_, err = conn.Exec(ctx, `SELECT count(*) FROM generate_series(1, 3000000)`)
		require.NoError(t, err)
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			t.Skipf("cannot read the backend's /proc entry: %v", err)
		}
		backend, ok := postgresTicks(string(stat))
		require.True(t, ok)
		require.Positive(t, backend, "the query took CPU time")
		// The backend's parent is the postmaster, which waits for it.
		fields := strings.Fields(string(stat)[strings.LastIndexByte(string(stat), ')')+1:])
		postmaster := "/proc/" + fields[1] + "/stat"
		readPostmaster := func() int64 {
			b, err := os.ReadFile(postmaster)
			require.NoError(t, err)
			ticks, ok := postgresTicks(string(b))
			require.True(t, ok)
			return ticks
		}
		before := readPostmaster()
		require.NoError(t, conn.Close(ctx))
		require.Eventually(t, func() bool {
			_, err := os.Stat(fmt.Sprintf("/proc/%d", pid))
			return err != nil
		}, 10*time.Second, 10*time.Millisecond, "the backend exits")
		require.Eventually(t, func() bool { return readPostmaster()-before >= backend }, 10*time.Second, 10*time.Millisecond,
			"the exited backend's %d ticks move to the postmaster", backend)
	})
}
