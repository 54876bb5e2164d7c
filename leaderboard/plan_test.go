package leaderboard

import (
	"context"
	"encoding/json"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// TestManyKeyPlans checks that the statements given a batch of event ids or
// user ids probe the primary keys once per element on tables PostgreSQL
// has no statistics for (a bulk import into new tables, autovacuum behind
// or off). Written as key = ANY ($n), they were planned as reads of the
// whole event history, or of the whole board, for every batch.
func TestManyKeyPlans(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	board := tb.board.Config().Name

	// 50,000 events and users, never analysed (nor by autovacuum meanwhile).
	for _, table := range []string{ScoreEventsTable, UserScoresTable} {
		_, err := tb.pg.Pool.Exec(ctx, `ALTER TABLE `+table+` SET (autovacuum_enabled = false)`)
		require.NoError(t, err)
	}
	_, err := tb.pg.Pool.Exec(ctx, `
		INSERT INTO `+ScoreEventsTable+` (event_id, board, user_id, delta, score, version)
		SELECT gen_random_uuid(), $1, 'user-' || i, 1, 1, 1 FROM generate_series(1, 50000) AS i`, board)
	require.NoError(t, err)
	_, err = tb.pg.Pool.Exec(ctx, `
		INSERT INTO `+UserScoresTable+` (board, user_id, score, version)
		SELECT $1, 'user-' || i, 1, 1 FROM generate_series(1, 50000) AS i`, board)
	require.NoError(t, err)

	const n = 1000
	ids, users, deltas := make([]string, n), make([]string, n), make([]int64, n)
	for i := range n {
		ids[i], users[i], deltas[i] = uuid.NewString(), fmt.Sprintf("user-%d", i*37%50000), 1
	}
	statements := []struct {
		name string
		sql  string
		args []any
		// keyed maps each table the statement reads to the column its
		// index condition must hold.
		keyed map[string]string
	}{
		{"SubmitBatch", tb.board.sql.submitBatch, []any{ids, users, deltas, board, tb.board.Stream(), false},
			map[string]string{ScoreEventsTable: "event_id"}},
		{"SourceLookup", tb.board.sql.sourceLookup, []any{board, users},
			map[string]string{UserScoresTable: "user_id"}},
		{"OverflowProbe", tb.board.sql.overflowProbe, []any{board, users, ids},
			map[string]string{ScoreEventsTable: "event_id", UserScoresTable: "user_id"}},
	}
	for _, st := range statements {
		t.Run(st.name, func(t *testing.T) {
			// SubmitBatch plans large batches for their arrays (an unnamed
			// statement) and Submit's groups once (a generic plan); the
			// lookups take the pool's default, which comes to the generic
			// plan after five runs. Both must probe.
			for _, generic := range []bool{false, true} {
				plan, doc := explainPlan(t, tb.pg.ConnString, st.sql, generic, st.args)
				for table, column := range st.keyed {
					scans := plan.Find(func(n *planNode) bool {
						return n.RelationName == table && n.NodeType != "ModifyTable"
					})
					require.NotEmpty(t, scans, "no read of %s in\n%s", table, doc)
					for _, scan := range scans {
						require.Contains(t, []string{"Index Scan", "Index Only Scan", "Bitmap Heap Scan"}, scan.NodeType, doc)
						cond := scan.IndexCond
						for _, child := range scan.Plans {
							cond += " " + child.IndexCond
						}
						require.Contains(t, cond, column, "%s read without a probe on %s:\n%s", table, column, doc)
					}
				}
			}
		})
	}
}

// explainPlan returns the plan of sql for args, and the EXPLAIN document
// it was read from: the custom plan for these values, or the generic plan.
func explainPlan(t *testing.T, connString, sql string, generic bool, args []any) (*planNode, string) {
	t.Helper()
	doc := testenv.Plan(t, connString, generic, "JSON", sql, args...)
	return testenv.ParsePlan(t, doc), doc
}

// planNode is a node of EXPLAIN (FORMAT JSON).
type planNode = testenv.PlanNode

// TestKeysetPagesReadOnePageWithoutStatistics: on a board bulk-loaded and
// never analysed (autovacuum behind or off), the planner expected 654 rows
// of a board of 200,000 users, and planned a page of 1,000 (the reconcile
// source's pages, and Top, Page and Around from PostgreSQL) as a bitmap
// scan of every row after the cursor and a sort: 100,000-200,000 rows read
// per page, for the first five runs of each pooled connection's cached
// statement and for every unnamed one. Each page must read about its own
// rows, from the index in key order, with statistics or without. The
// count of the entries ahead (an aggregate) is O(rank) by design.
func TestKeysetPagesReadOnePageWithoutStatistics(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	const users, limit = 200_000, 1000
	board := tb.board.Config().Name
	_, err := tb.pg.Pool.Exec(ctx, `ALTER TABLE `+UserScoresTable+` SET (autovacuum_enabled = false)`)
	require.NoError(t, err)
	_, err = tb.pg.Pool.Exec(ctx, `INSERT INTO `+UserScoresTable+` (board, user_id, score, version)
		SELECT $1, 'user-' || lpad(i::text, 7, '0'), hashint4(i) % 100000, 1 FROM generate_series(1, $2::int) AS i`, board, users)
	require.NoError(t, err)
	var analysed bool
	require.NoError(t, tb.pg.Pool.QueryRow(ctx, `SELECT reltuples >= 0 FROM pg_class WHERE oid = $1::regclass`, UserScoresTable).Scan(&analysed))
	require.False(t, analysed, "the table must be without statistics")
	var midScore int64
	var midUser string
	require.NoError(t, tb.pg.Pool.QueryRow(ctx, `SELECT score, user_id FROM `+UserScoresTable+`
		WHERE board = $1 ORDER BY -score, user_id OFFSET $2 LIMIT 1`, board, users/2).Scan(&midScore, &midUser))

	statements := []struct {
		name string
		sql  string
		args []any
	}{
		{"SourceFirst", tb.board.sql.sourceFirst, []any{board, limit}},
		{"SourcePage", tb.board.sql.sourcePage, []any{board, fmt.Sprintf("user-%07d", users/2), limit}},
		{"Top", tb.board.sql.top, []any{board, limit}},
		{"Page", tb.board.sql.page, []any{board, limit, midScore, midUser}},
		{"PageFromTop", tb.board.sql.page, []any{board, limit, int64(1) << 40, ""}},
		{"PageBytes", tb.board.sql.pageBytes, []any{board, limit, midScore, []byte(midUser + "\xff")}},
		{"Around", tb.board.sql.around, []any{board, midUser, limit}},
	}
	// pageReads returns the reads of the board's table outside counts.
	var pageReads func(n *planNode) []*planNode
	pageReads = func(n *planNode) []*planNode {
		if n.NodeType == "Aggregate" {
			return nil
		}
		var out []*planNode
		if n.RelationName == UserScoresTable {
			out = append(out, n)
		}
		for i := range n.Plans {
			out = append(out, pageReads(&n.Plans[i])...)
		}
		return out
	}
	for _, stats := range []string{"NoStatistics", "Analysed"} {
		if stats == "Analysed" {
			_, err := tb.pg.Pool.Exec(ctx, `ANALYZE `+UserScoresTable)
			require.NoError(t, err)
		}
		for _, st := range statements {
			// A custom plan, as a cached statement's first five runs get.
			var doc string
			require.NoError(t, tb.pg.Pool.QueryRow(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) "+st.sql, st.args...).Scan(&doc))
			reads := pageReads(testenv.ParsePlan(t, doc))
			require.NotEmpty(t, reads, "%s/%s: no read of the board in\n%s", stats, st.name, doc)
			for _, read := range reads {
				require.LessOrEqual(t, read.ActualRows, float64(limit+1),
					"%s/%s: a page of %d read as a %s of %.0f rows", stats, st.name, limit, read.NodeType, read.ActualRows)
			}
		}
	}
}

// TestLargeGroupsArePlannedForTheirArrays checks that a shared Submit
// statement of more than preparedBatchMax commands (MaxSubmitsPerStatement
// raised above its default) is planned for its arrays every time. It runs
// as the pool's cached prepared statement, which PostgreSQL would switch to
// a generic plan after five runs: for groups of 256 that plan made Submit
// about half as fast. The group's set_config forces a custom plan for its
// own transaction only; smaller groups keep the generic plan.
func TestLargeGroupsArePlannedForTheirArrays(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)

	// One connection, so that its prepared statements are the board's.
	poolCfg, err := pgxpool.ParseConfig(tb.pg.ConnString)
	require.NoError(t, err)
	poolCfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	cfg := tb.board.Config()
	cfg.MaxSubmitsPerStatement = 2 * preparedBatchMax
	board, err := New(pool, tb.rd.Client, &cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)

	group := func(n int) {
		t.Helper()
		cmds := make([]Command, n)
		for i := range cmds {
			cmds[i] = Command{EventID: uuid.New(), UserID: fmt.Sprintf("user-%d", i), Delta: 1}
		}
		_, err := board.submitBatch(ctx, cmds, batchOptions{everyState: true, lockTimeout: submitLockTimeout})
		require.NoError(t, err)
	}
	plans := func() (generic, custom int64) {
		t.Helper()
		require.NoError(t, pool.QueryRow(ctx,
			`SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement = $1`,
			board.sql.submitBatch).Scan(&generic, &custom))
		return generic, custom
	}

	for range 7 {
		group(10)
	}
	generic, custom := plans()
	require.Equal(t, [2]int64{2, 5}, [2]int64{generic, custom}, "small groups: five custom plans, then the generic one")
	for range 7 {
		group(preparedBatchMax + 1)
	}
	generic, custom = plans()
	require.Equal(t, [2]int64{2, 12}, [2]int64{generic, custom}, "every large group planned for its arrays")
	for range 2 {
		group(10)
	}
	generic, custom = plans()
	require.Equal(t, [2]int64{4, 12}, [2]int64{generic, custom}, "the setting did not outlive the large groups' transactions")
}

// TestSubmitBatchRetryIsLinear retries a committed batch of 8,000
// commands (as after ErrOutcomeUnknown): the conflict check joins the prior
// events with the batch without comparing every pair (64M pairs took 3-8 s).
func TestSubmitBatchRetryIsLinear(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	const n = 8000
	cmds := make([]Command, n)
	for i := range cmds {
		cmds[i] = Command{EventID: uuid.New(), UserID: fmt.Sprintf("u%d", i), Delta: 1}
	}
	start := time.Now()
	_, err := tb.board.SubmitBatch(ctx, cmds)
	require.NoError(t, err)
	first := time.Since(start)
	start = time.Now()
	res, err := tb.board.SubmitBatch(ctx, cmds)
	require.NoError(t, err)
	again := time.Since(start)
	require.True(t, res[n-1].Duplicate)
	t.Logf("n=%d first=%s retry=%s", n, first, again)
	// The planner's choice, not a timing: no join over n*n rows.
	in, err := tb.board.prepareBatch(ctx, tb.pg.Pool, cmds, false)
	require.NoError(t, err)
	var plan string
	require.NoError(t, tb.pg.Pool.QueryRow(ctx, "EXPLAIN (ANALYZE, COSTS OFF, FORMAT JSON) "+tb.board.sql.submitBatch,
		in.ids, in.users, in.deltas, tb.board.cfg.Name, tb.board.stream, false).Scan(&plan))
	worst := 0
	for _, m := range regexp.MustCompile(`"Rows Removed by Join Filter": (\d+)`).FindAllStringSubmatch(plan, -1) {
		v, _ := strconv.Atoi(m[1])
		worst = max(worst, v)
	}
	require.Less(t, worst, 10*n, "a join of the retry compared %d pairs for %d ids", worst, n)

	// SubmitBatchTx shares the statement's CTEs.
	tx, err := tb.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	start = time.Now()
	res, err = tb.board.SubmitBatchTx(ctx, tx, cmds)
	require.NoError(t, err)
	inTx := time.Since(start)
	require.True(t, res[0].Duplicate)
	t.Logf("SubmitBatchTx retry=%s", inTx)
}

// TestLargeSubmitBatchesAreNotJITCompiled: from about 10,000 commands the
// batch statement's estimated cost passes the default jit_above_cost, and
// PostgreSQL compiled it for every batch (111 functions, 62-226 ms), for
// no gain: 10 alternating batches of 10,000 took 415 ms at the median with
// JIT, 356 without. SubmitBatch and SubmitBatchTx run it without JIT, and
// the caller's transaction gets its setting back.
func TestLargeSubmitBatchesAreNotJITCompiled(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	var statements func() []explained
	pool := tb.newPool(t, func(poolCfg *pgxpool.Config) {
		poolCfg.MaxConns = 1
		statements = collectExplained(poolCfg.ConnConfig, "WITH input AS")
		poolCfg.AfterConnect = autoExplain
	})
	cfg := tb.board.Config()
	board, err := New(pool, tb.rd.Client, &cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	commands := func(run int) []Command {
		cmds := make([]Command, 12000)
		for i := range cmds {
			cmds[i] = Command{EventID: uuid.New(), UserID: fmt.Sprintf("user-%d-%d", run, i), Delta: 1}
		}
		return cmds
	}

	_, err = board.SubmitBatch(ctx, commands(0))
	require.NoError(t, err)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SET LOCAL jit_above_cost = 100000`) // the default, whatever the server's
	require.NoError(t, err)
	_, err = board.SubmitBatchTx(ctx, tx, commands(1))
	require.NoError(t, err)
	var jit, above string
	require.NoError(t, tx.QueryRow(ctx, `SELECT current_setting('jit'), current_setting('jit_above_cost')`).Scan(&jit, &above))
	require.Equal(t, "on", jit, "the caller's setting is put back")
	require.Equal(t, "100000", above)
	require.NoError(t, tx.Commit(ctx))

	got := statements()
	require.Len(t, got, 2, "SubmitBatch's statement and SubmitBatchTx's")
	for i, e := range got {
		require.Empty(t, e.JIT, "statement %d was JIT-compiled: %s", i, e.JIT)
	}
}

// TestSubmitBatchIsPlannedForItsArraysUnderForcedGenericPlans: a role or
// database with plan_cache_mode force_generic_plan (or a proxy's other
// client that left it set) applies it to unnamed statements too, and a
// batch of 2,000 commands took 0.7-0.8 s instead of 45-55 ms. In every
// pgx mode, each batch larger than preparedBatchMax is planned for its
// arrays (auto_explain's plan holds the batch's values), past the five
// runs after which a cached statement goes generic, and the session's
// setting is left as it was.
func TestSubmitBatchIsPlannedForItsArraysUnderForcedGenericPlans(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
		pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			tb := setup(t)
			var plans func() []string
			pool := tb.newPool(t, func(poolCfg *pgxpool.Config) {
				poolCfg.MaxConns = 1
				poolCfg.ConnConfig.DefaultQueryExecMode = mode
				poolCfg.ConnConfig.RuntimeParams["plan_cache_mode"] = "force_generic_plan"
				plans = collectPlans(poolCfg.ConnConfig, "WITH ORDINALITY AS i(event_id")
				poolCfg.AfterConnect = autoExplain
			})
			cfg := tb.board.Config()
			board, err := New(pool, tb.rd.Client, &cfg)
			require.NoError(t, err)
			t.Cleanup(board.Close)

			for run := range 7 { // past the five custom plans of a cached statement
				cmds := make([]Command, preparedBatchMax+1)
				for i := range cmds {
					cmds[i] = Command{EventID: uuid.New(), UserID: fmt.Sprintf("zzmark%d-%d", run, i), Delta: 1}
				}
				_, err := board.SubmitBatch(ctx, cmds)
				require.NoError(t, err)
			}
			var setting string
			require.NoError(t, pool.QueryRow(ctx, `SELECT current_setting('plan_cache_mode')`).Scan(&setting))
			require.Equal(t, "force_generic_plan", setting, "the session's setting is left as it was")
			require.Len(t, plans(), 7)
			for run, p := range plans() {
				if !strings.Contains(p, fmt.Sprintf("zzmark%d-", run)) {
					t.Errorf("run %d is planned with the generic plan, not for its arrays (unnest($1) in the plan: %v)", run, strings.Contains(p, `unnest($1)`))
				}
			}
		})
	}
}

// collectPlans has auto_explain's JSON plans (notices: see the sessions'
// auto_explain settings) of the statements whose text contains marker
// collected from connections of cfg, and returns them so far.
func collectPlans(cfg *pgx.ConnConfig, marker string) (plans func() []string) {
	explained := collectExplained(cfg, marker)
	return func() []string {
		var out []string
		for _, e := range explained() {
			out = append(out, string(e.Plan))
		}
		return out
	}
}

// explained is one statement's auto_explain output: its plan, and what
// PostgreSQL compiled for it (JIT, absent when nothing was).
type explained struct {
	Query string          `json:"Query Text"`
	Plan  json.RawMessage `json:"Plan"`
	JIT   json.RawMessage `json:"JIT"`
}

// collectExplained is collectPlans with each statement's JIT summary too.
func collectExplained(cfg *pgx.ConnConfig, marker string) func() []explained {
	var (
		mu        sync.Mutex
		collected []explained
	)
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		i := strings.Index(n.Message, "plan:\n")
		if i < 0 {
			return
		}
		var e explained
		if json.Unmarshal([]byte(n.Message[i+len("plan:\n"):]), &e) == nil && strings.Contains(e.Query, marker) {
			mu.Lock()
			collected = append(collected, e)
			mu.Unlock()
		}
	}
	return func() []explained {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(collected)
	}
}

// autoExplain has a session send auto_explain's JSON plans of every
// statement as notices (see collectPlans).
func autoExplain(ctx context.Context, conn *pgx.Conn) error {
	for _, s := range []string{`LOAD 'auto_explain'`, `SET auto_explain.log_min_duration = 0`,
		`SET auto_explain.log_level = notice`, `SET auto_explain.log_format = json`, `SET auto_explain.log_verbose = on`} {
		if _, err := conn.Exec(ctx, s, pgx.QueryExecModeSimpleProtocol); err != nil {
			return err
		}
	}
	return nil
}
