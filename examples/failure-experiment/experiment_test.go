package main

import (
	"bytes"
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
)

func TestExperiment(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testenv.Postgres(t)
	rd := testenv.Redis(t)

	schema := pg.Schema + "_experiment"
	report, err := Run(ctx, Options{PostgresURL: pg.ServerURL, RedisURL: rd.URL, Schema: schema, KeyPrefix: rd.Prefix})
	require.NoError(t, err)

	type state = map[string]SourceState
	a10 := state{"user-a": {Score: 10, Version: 1}}
	both := state{"user-a": {Score: 17, Version: 2}, "user-b": {Score: 25, Version: 1}}
	want := []struct {
		name       string
		source     state
		projection map[string]int64
	}{
		{"first command for user-a", a10, map[string]int64{"user-a": 10}},
		{"same event id again", a10, map[string]int64{"user-a": 10}},
		{"worker stopped", both, map[string]int64{"user-a": 10}},
		{"worker restarted", both, map[string]int64{"user-a": 17, "user-b": 25}},
		{"redis user-a changed to 999", both, map[string]int64{"user-a": 999, "user-b": 25}},
		{"repair complete", both, map[string]int64{"user-a": 17, "user-b": 25}},
	}
	require.Len(t, report.Stages, len(want))
	for i, w := range want {
		st := report.Stages[i]
		require.Equal(t, w.name, st.Name)
		require.Equal(t, w.source, st.Source, st.Name)
		require.Equal(t, w.projection, st.Projection, st.Name)
	}
	require.Contains(t, report.Stages[0].Result, "applied")
	require.Contains(t, report.Stages[1].Result, "duplicate")
	require.Contains(t, report.Stages[2].Result, "2 outbox rows pending")
	require.Contains(t, report.Stages[3].Result, "drained (0 pending)")
	require.Contains(t, report.Stages[4].Result, "user-a as corrupt")
	require.Equal(t, ReconcileFigures{Checked: 2, Current: 1, Corrupt: 1, Repaired: 1}, report.Reconcile)
	require.True(t, report.OrderingMatch)

	// The JSON shape is the documented one.
	raw, err := json.Marshal(report)
	require.NoError(t, err)
	var generic map[string]any
	require.NoError(t, json.Unmarshal(raw, &generic))
	require.ElementsMatch(t, []string{"stages", "reconcile", "ordering_match"}, keys(generic))
	stage := generic["stages"].([]any)[0].(map[string]any)
	require.ElementsMatch(t, []string{"name", "source", "projection", "result"}, keys(stage))
	require.ElementsMatch(t, []string{"score", "version"}, keys(stage["source"].(map[string]any)["user-a"].(map[string]any)))
	require.ElementsMatch(t, []string{"checked", "current", "corrupt", "repaired"}, keys(generic["reconcile"].(map[string]any)))

	// It cleaned up after itself.
	var exists bool
	require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, schema).Scan(&exists))
	require.False(t, exists)
	left, err := rd.Client.Keys(ctx, rd.Prefix+"*").Result()
	require.NoError(t, err)
	require.Empty(t, left)

	var table bytes.Buffer
	require.NoError(t, printTable(&table, report))
	require.Contains(t, table.String(), "reconcile: 2 checked, 1 current, 1 corrupt, 1 repaired")
}

func keys(m map[string]any) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// TestCommandJSON runs the command's own path (service resolution, the
// experiment, --json output) as the README invokes it.
func TestCommandJSON(t *testing.T) {
	t.Parallel()
	testenv.Postgres(t) // skips, or fails under VERITY_TEST_REQUIRE_SERVICES, without servers
	var out bytes.Buffer
	require.NoError(t, run(context.Background(), &out, true))
	var report Report
	require.NoError(t, json.Unmarshal(out.Bytes(), &report))
	require.Len(t, report.Stages, 6)
	require.Equal(t, ReconcileFigures{Checked: 2, Current: 1, Corrupt: 1, Repaired: 1}, report.Reconcile)
	require.True(t, report.OrderingMatch)
}

// TestRestartWorkerInterrupted: an interrupt while the restarted worker
// drains (stage 4) is reported as the cancellation it is. The worker's Run
// returns nil once its context ends; wrapped as it was, that nil read
// "worker stopped: %!w(<nil>)".
func TestRestartWorkerInterrupted(t *testing.T) {
	t.Parallel()
	pg := testenv.Postgres(t)
	rd := testenv.Redis(t)
	cfg := &leaderboard.Config{Name: "experiment", Schema: pg.Schema, KeyPrefix: rd.Prefix}
	require.NoError(t, leaderboard.Migrate(context.Background(), pg.Pool, cfg))
	board, err := leaderboard.New(pg.Pool, rd.Client, cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	worker, err := board.Worker(nil)
	require.NoError(t, err)
	x := &experiment{pool: pg.Pool, board: board, worker: worker}

	ctx, cancel := context.WithCancel(context.Background())
	cancel() // the signal landed
	err = x.restartWorker(ctx)
	require.ErrorIs(t, err, context.Canceled)
	require.NotContains(t, err.Error(), "%!w")
}

// TestCheckReadsEachStagesResult: the exit code comes from Report.Check,
// which compared each stage's states but not the Result it printed. A
// replay applied a second time ("applied again: DOUBLE EFFECT"), or a dry
// run that found no drift, was printed and still exited 0; then only the
// words before the duplicate's original result were compared, so a retry
// answered with another result (a zero Result, a later version) did too.
func TestCheckReadsEachStagesResult(t *testing.T) {
	t.Parallel()
	good := func() *Report {
		r := &Report{Reconcile: reference.repair, OrderingMatch: true}
		for i, st := range reference.stages {
			st.Result = []string{
				"applied (score 10, version 1)",
				"duplicate detected; no second effect (original result: score 10, version 1)",
				"projection lags: 2 outbox rows pending, oldest 4ms old",
				"outbox drained (0 pending)",
				"reconciliation classified user-a as corrupt",
				"1 of 2 rows repaired; identical ranking",
			}[i]
			r.Stages = append(r.Stages, st)
		}
		return r
	}
	require.NoError(t, good().Check())
	for _, bad := range []struct {
		stage  int
		result string
	}{
		{1, "applied again: DOUBLE EFFECT"},
		{1, "duplicate detected; no second effect (original result: score 0, version 0)"},
		{1, "duplicate detected; no second effect (original result: score 17, version 2)"},
		{4, "no drift found"},
	} {
		r := good()
		r.Stages[bad.stage].Result = bad.result
		require.Error(t, r.Check(), "stage %q printed %q", r.Stages[bad.stage].Name, bad.result)
	}
}

// TestInterruptDuringMigrateLeavesNoSchema: main.go promises the
// experiment "works in its own schema and key prefix, and removes both when
// it ends, also on Ctrl-C or SIGTERM". An interrupt that lands while the
// migration's CREATE SCHEMA is executing makes pgx give up on the
// connection at once; the deferred DROP SCHEMA IF EXISTS, on another
// connection, runs before the server has committed the schema, finds
// nothing, and the schema is committed afterwards and stays. (race-test
// closed the same window for its CREATE TABLE.) A slow CREATE SCHEMA (an
// event trigger on a private server that also shrugs off the cancel
// request) makes the window certain.
func TestInterruptDuringMigrateLeavesNoSchema(t *testing.T) {
	t.Parallel()
	srv := testenv.StartPostgres(t)
	rd := testenv.Redis(t)
	admin := srv.Pool(t)
	bg := context.Background()
	_, err := admin.Exec(bg, `CREATE FUNCTION slow_ddl() RETURNS event_trigger LANGUAGE plpgsql AS $$
DECLARE
  until timestamptz := clock_timestamp() + interval '1500 milliseconds';
BEGIN
  WHILE clock_timestamp() < until LOOP
    BEGIN
      PERFORM pg_sleep(0.02);
    EXCEPTION WHEN query_canceled THEN NULL;
    END;
  END LOOP;
END $$`)
	require.NoError(t, err)
	_, err = admin.Exec(bg, `CREATE EVENT TRIGGER slow_ddl ON ddl_command_end WHEN TAG IN ('CREATE SCHEMA') EXECUTE FUNCTION slow_ddl()`)
	require.NoError(t, err)

	const schema = "verity_experiment_zzreview"
	ctx, cancel := context.WithCancel(bg)
	defer cancel()
	go func() { // Ctrl-C while the CREATE SCHEMA runs
		for ctx.Err() == nil {
			var n int
			_ = admin.QueryRow(bg, `SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND pid <> pg_backend_pid()`).Scan(&n)
			if n > 0 {
				cancel()
				return
			}
			time.Sleep(2 * time.Millisecond)
		}
	}()
	_, err = Run(ctx, Options{PostgresURL: srv.ConnString(), RedisURL: rd.URL, Schema: schema, KeyPrefix: rd.Prefix})
	require.ErrorIs(t, err, context.Canceled)
	time.Sleep(2500 * time.Millisecond) // the server ends the statement it was executing
	var exists bool
	require.NoError(t, admin.QueryRow(bg, `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, schema).Scan(&exists))
	require.False(t, exists, "the interrupted run left its schema %s behind", schema)
}

// TestCheckReadsStatesFiguresAndOrdering: the exit code comes from
// Report.Check, which compares more than each stage's printed Result
// (TestCheckReadsEachStagesResult): each stage's Redis projection and
// PostgreSQL state, the repair run's figures and the final ordering. Each
// is broken in turn here.
func TestCheckReadsStatesFiguresAndOrdering(t *testing.T) {
	t.Parallel()
	good := func() *Report {
		r := &Report{Reconcile: reference.repair, OrderingMatch: true}
		for i, st := range reference.stages {
			st.Result = reference.results[i]
			r.Stages = append(r.Stages, st)
		}
		return r
	}
	require.NoError(t, good().Check())
	for name, breakIt := range map[string]func(r *Report){
		// The repair left the hand edit in Redis.
		"ProjectionNotRepaired": func(r *Report) {
			r.Stages[5].Projection = map[string]int64{"user-a": 999, "user-b": 25}
		},
		// The stopped worker still projected (or the gate let a stale write in).
		"ProjectionWhileWorkerStopped": func(r *Report) {
			r.Stages[2].Projection = map[string]int64{"user-a": 17, "user-b": 25}
		},
		// The duplicate was applied a second time in PostgreSQL.
		"SourceDoubleEffect": func(r *Report) {
			r.Stages[1].Source = map[string]SourceState{"user-a": {Score: 20, Version: 2}}
		},
		"RepairFiguresDiffer": func(r *Report) {
			r.Reconcile = ReconcileFigures{Checked: 2, Current: 1, Corrupt: 1, Repaired: 0}
		},
		"OrderingDiffers": func(r *Report) { r.OrderingMatch = false },
	} {
		r := good()
		breakIt(r)
		require.Error(t, r.Check(), name)
	}
}
