package outbox_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/outbox"
)

// TestClaimPlanUsesIndexes guards the claim statement against plans that
// scan the whole outbox. Prepared statements switch to a generic plan after
// a few executions, so the test forces one and inspects it.
func TestClaimPlanUsesIndexes(t *testing.T) {
	t.Parallel()
	t.Run("Analyzed", func(t *testing.T) {
		t.Parallel()
		testClaimPlan(t, setupBacklog(t, 5000))
	})
	// Without statistics (autovacuum off or behind a burst) the planner
	// once read every due row through the pending index per claim.
	t.Run("NeverAnalyzed", func(t *testing.T) {
		t.Parallel()
		testClaimPlan(t, setupBacklogUnanalyzed(t, 5000))
	})
}

func testClaimPlan(t *testing.T, b *testBundle) {
	for _, streams := range [][]string{nil, {"s"}} {
		r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{Streams: streams})
		leaseSQL, pickSQL := r.ClaimSQL()
		// Both statements take the token and one number ($2), then the
		// streams; the lease statement's $2 is the lease, the pick's the batch.
		args := fmt.Sprintf("'%s', 100", uuid.New())
		if streams != nil {
			args += ", '{s}'"
		}
		for name, sql := range map[string]string{"lease": leaseSQL, "pick": pickSQL} {
			// The first five runs on a connection take custom plans.
			for _, mode := range []string{"generic", "custom"} {
				plan := statementPlan(t, b, mode, sql, args)
				t.Logf("%s %s plan (streams %v):\n%s", mode, name, streams, plan)
				// The lease table has one row per partition; only the
				// outbox must never be scanned whole, nor all its due rows.
				require.NotRegexp(t, `Seq Scan on verity_outbox\b`, plan, "the %s statement must not scan the whole outbox", name)
				require.NotContains(t, plan, "_pending_idx", "the %s statement must not read every due row", name)
				require.Contains(t, plan, "_partition_idx", "due rows come from the partition index (%s)", name)
			}
		}
	}
}

// TestSettlePlanUsesIndexes guards the settle statement the same way: the
// rows it acknowledges, retries or buries are found by id through the
// primary key, never by reading the whole outbox.
func TestSettlePlanUsesIndexes(t *testing.T) {
	t.Parallel()
	b := setupBacklog(t, 5000)
	for _, keep := range []bool{false, true} {
		for _, streams := range [][]string{nil, {"s"}} {
			r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{KeepPublished: keep, Streams: streams})
			// The token, then acknowledged ids ($2), rows to retry ($3-$5),
			// to bury ($6-$7), to release ($8), the attempt numbers
			// ($9-$10), the channel ($11) and the relay's streams ($12).
			args := "'" + uuid.NewString() + "', '{1, 2, 3}', '{4}', '{boom}', '{1000}', '{5}', '{boom}', '{6}', '{1}', '{3}', 'channel'"
			if streams != nil {
				args += ", '{s}'"
			}
			plan := genericPlan(t, b, r.SettleSQL(), args)
			t.Logf("generic settle plan (keep published %v, streams %v):\n%s", keep, streams, plan)
			require.NotRegexp(t, `Seq Scan on verity_outbox\b`, plan, "the settle statement must not scan the whole outbox")
			require.NotContains(t, plan, "_pending_idx", "the settle statement must not read every due row")
			require.Regexp(t, `Index (Only )?Scan using verity_outbox_pkey on verity_outbox`, plan, "rows are found through the primary key")
			if streams != nil {
				require.Contains(t, plan, "_partition_idx", "other streams' rows come from the partition index")
			}
		}
	}
}

// TestClaimHeldCostOnAnotherStreamsBacklog: a relay restricted to some
// streams reads past another stream's pending rows when it looks for due
// partitions (RelayConfig.Streams documents the cost). Its held column,
// which reports rows in partitions the claim skipped, must not read them a
// second time: it reuses that look.
func TestClaimHeldCostOnAnotherStreamsBacklog(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	_, err := b.pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %s (event_id, stream, key, version, payload)
        SELECT gen_random_uuid(), 'a', 'k' || g, 1, '{}' FROM generate_series(1, 60000) AS g`, b.writer.Table()))
	require.NoError(t, err)
	b.appendNow(t, newMessage("b", "kb", 1))
	_, err = b.pool.Exec(ctx, `ANALYZE `+b.writer.Table())
	require.NoError(t, err)

	r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{Streams: []string{"b"}})
	lease, _ := r.ClaimSQL()
	i := strings.Index(lease, "CASE WHEN (SELECT count(*) FROM leased)")
	require.Positive(t, i, "the held column is the statement's last")
	withHeld := statementBuffers(t, b, lease, []string{"b"})
	without := statementBuffers(t, b, lease[:i]+"false", []string{"b"})
	t.Logf("lease statement buffers: %d with the held column, %d without", withHeld, without)
	require.Less(t, float64(withHeld), 1.3*float64(without), "the held column reads the other stream's backlog again")
}

// TestClaimCostAfterPartialDrain: on a backlog, the partitions drained
// last begin with index entries of deleted rows (vacuum has not run), which
// a due-row probe reads past. A claim must probe only the first partitions
// in lease order (the least recently drained), not all of them.
func TestClaimCostAfterPartialDrain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupBacklog(t, 20000)
	r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{BatchSize: 1000, Streams: []string{"s"}})
	for drained := 0; drained < 10000; {
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Positive(t, n)
		drained += n
	}
	lease, _ := r.ClaimSQL()
	buffers := statementBuffers(t, b, lease, []string{"s"})
	t.Logf("lease statement after draining half the backlog: %d buffers", buffers)
	// Probing every partition read 271-556 buffers here; the first eight, 47.
	require.Less(t, buffers, 150, "the claim probed the drained partitions")
}

// statementBuffers runs a claim's lease statement under EXPLAIN (ANALYZE,
// BUFFERS) in a transaction it rolls back, and returns the shared buffers
// the whole statement touched (hit + read).
func statementBuffers(t *testing.T, b *testBundle, sql string, streams []string) int {
	t.Helper()
	ctx := context.Background()
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	args := []any{uuid.New(), int64(30_000_000)}
	if streams != nil {
		args = append(args, streams)
	}
	rows, err := tx.Query(ctx, "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "+sql, args...)
	require.NoError(t, err)
	plans, err := pgx.CollectRows(rows, pgx.RowTo[[]map[string]any])
	require.NoError(t, err)
	require.Len(t, plans, 1)
	top := plans[0][0]["Plan"].(map[string]any)
	hit, _ := top["Shared Hit Blocks"].(float64)
	read, _ := top["Shared Read Blocks"].(float64)
	require.Positive(t, hit+read, "no buffers in %v", top)
	return int(hit + read)
}

// setupBacklog is setup with n pending rows, analyzed, so that plans see
// a table of that size.
func setupBacklog(t *testing.T, n int) *testBundle {
	t.Helper()
	b := setupBacklogUnanalyzed(t, n)
	_, err := b.pool.Exec(context.Background(), `ANALYZE `+b.writer.Table())
	require.NoError(t, err)
	return b
}

// setupBacklogUnanalyzed is setup with n pending rows that PostgreSQL has
// no statistics for: autovacuum is off for the table.
func setupBacklogUnanalyzed(t *testing.T, n int) *testBundle {
	t.Helper()
	b := setup(t)
	_, err := b.pool.Exec(context.Background(), `ALTER TABLE `+b.writer.Table()+` SET (autovacuum_enabled = false)`)
	require.NoError(t, err)
	msgs := make([]outbox.Message, n)
	for i := range msgs {
		msgs[i] = newMessage("s", fmt.Sprint("k", i), 1)
	}
	b.appendCommitted(t, msgs...)
	return b
}

// genericPlan prepares sql on a connection forced to use generic plans
// and returns the EXPLAIN output for the given arguments (nothing is
// executed). EXPLAIN EXECUTE takes no bind parameters: args are literals.
func genericPlan(t *testing.T, b *testBundle, sql, args string) string {
	t.Helper()
	return statementPlan(t, b, "generic", sql, args)
}

// statementPlan is genericPlan for mode "generic", and for "custom" the
// plan PostgreSQL makes for these arguments in particular.
func statementPlan(t *testing.T, b *testBundle, mode, sql, args string) string {
	t.Helper()
	ctx := context.Background()
	conn, err := b.pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	// The connection's session state is changed; do not return it to the pool.
	defer func() { _ = conn.Conn().Close(ctx) }()

	_, err = conn.Exec(ctx, `SET plan_cache_mode = force_`+mode+`_plan`)
	require.NoError(t, err)
	_, err = conn.Conn().Prepare(ctx, "planned", sql)
	require.NoError(t, err)
	rows, err := conn.Query(ctx, `EXPLAIN EXECUTE planned(`+args+`)`)
	require.NoError(t, err)
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return strings.Join(lines, "\n")
}

// TestClaimIsNotJITCompiled: the claim's statements are not JIT-compiled
// by a server with the default jit settings (jit = on, jit_above_cost =
// 100000), as the lease statement was once the lease table had grown. JIT emission costs tens of milliseconds of CPU
// per execution (the plan is not reused across executions), against ~2 ms
// for the whole statement: a relay on a loaded machine then claims a
// batch per second. Checked on a fresh outbox and after the lease table has
// seen a few hundred claims without a vacuum (autovacuum off or behind).
func TestClaimIsNotJITCompiled(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `ALTER TABLE `+b.writer.Table()+` SET (autovacuum_enabled = false)`)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `ALTER TABLE `+b.cfg.Schema+`.verity_outbox_leases SET (autovacuum_enabled = false)`)
	require.NoError(t, err)
	r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{Streams: []string{"s"}, BatchSize: 7})
	lease, pick := r.ClaimSQL()
	check := func(stage string) {
		for name, sql := range map[string]string{"lease": lease, "pick": pick} {
			for _, mode := range []string{"custom", "generic"} {
				plan := jitPlan(t, b, mode, sql)
				if i := strings.Index(plan, "JIT:"); i >= 0 {
					t.Fatalf("%s: the %s statement's %s plan is JIT-compiled: %s\n%s", stage, name, mode, strings.SplitN(plan, "\n", 2)[0], plan[i:])
				}
			}
		}
	}
	check("fresh outbox")
	msgs := make([]outbox.Message, 2000)
	for i := range msgs {
		msgs[i] = newMessage("s", fmt.Sprint("k", i), 1)
	}
	b.appendCommitted(t, msgs...)
	// Concurrent transactions (other sessions of the database) hold back
	// pruning, so the lease rows' old versions pile up between vacuums: the
	// stalled run's lease table had 42 pages for its 64 rows. A snapshot
	// held open while relays claim does the same.
	snap, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	_, err = snap.Exec(ctx, `SET TRANSACTION ISOLATION LEVEL REPEATABLE READ`)
	require.NoError(t, err)
	var one int
	require.NoError(t, snap.QueryRow(ctx, `SELECT 1`).Scan(&one))
	claims := 0
	var pages int64
	for ; claims < 5000 && pages < 42; claims++ {
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		if n == 0 {
			b.appendCommitted(t, msgs[:700]...)
		}
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT pg_relation_size($1) / 8192`, b.cfg.Schema+".verity_outbox_leases").Scan(&pages))
	}
	require.NoError(t, snap.Rollback(ctx))
	t.Logf("%d claims; lease table %d pages", claims, pages)
	check(fmt.Sprintf("after %d claims (lease table %d pages)", claims, pages))
}

// jitPlan prepares sql on a connection of its own with plan_cache_mode
// forced to mode and returns EXPLAIN (ANALYZE) of one execution, in a
// transaction rolled back.
func jitPlan(t *testing.T, b *testBundle, mode, sql string) string {
	t.Helper()
	ctx := context.Background()
	conn, err := b.pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	defer func() { _ = conn.Conn().Close(ctx) }()
	_, err = conn.Exec(ctx, `SET plan_cache_mode = force_`+mode+`_plan`)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `BEGIN`)
	require.NoError(t, err)
	// As the relay sends it: the claim's first statement, in its transaction.
	_, err = conn.Exec(ctx, outbox.ClaimLockSQL, int64(42))
	require.NoError(t, err)
	defer func() { _, _ = conn.Exec(ctx, `ROLLBACK`) }()
	_, err = conn.Conn().Prepare(ctx, "planned", sql)
	require.NoError(t, err)
	args := fmt.Sprintf("'%s', 7, '{s}'", uuid.New())
	if strings.HasPrefix(strings.TrimSpace(sql), "WITH due") {
		args = fmt.Sprintf("'%s', 30000000, '{s}'", uuid.New())
	}
	rows, err := conn.Query(ctx, `EXPLAIN (ANALYZE) EXECUTE planned(`+args+`)`)
	require.NoError(t, err)
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return strings.Join(lines, "\n")
}
