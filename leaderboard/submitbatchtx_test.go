package leaderboard

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
)

func TestSubmitBatchTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	for _, path := range []string{"Pgx", "DatabaseSQL"} {
		t.Run(path, func(t *testing.T) {
			t.Parallel()

			setupTx := func(t *testing.T) (*testBundle, func(t *testing.T) *callerTx) {
				tb := setup(t)
				return tb, txPaths(t, tb)[path]
			}

			t.Run("CommitMakesItVisible", func(t *testing.T) {
				t.Parallel()
				tb, begin := setupTx(t)
				c := begin(t)
				first := Command{EventID: uuid.New(), UserID: "alice", Delta: 10}
				out, err := tb.board.SubmitBatchTx(ctx, c.tx, []Command{
					first,
					{EventID: uuid.New(), UserID: "bob", Delta: 5},
					{EventID: uuid.New(), UserID: "alice", Delta: -3},
					first, // a repeat within the batch
				})
				require.NoError(t, err)
				require.Equal(t, []Result{
					{Score: 10, Version: 1},
					{Score: 5, Version: 1},
					{Score: 7, Version: 2},
					{Score: 10, Version: 1, Duplicate: true},
				}, out)
				events, users, queued := tb.counts(t)
				require.Equal(t, [3]int{0, 0, 0}, [3]int{events, users, queued}, "nothing is visible before the caller commits")

				// The transaction goes on, and sees its own batch.
				res, err := tb.board.SubmitTx(ctx, c.tx, Command{EventID: uuid.New(), UserID: "bob", Delta: 1})
				require.NoError(t, err)
				require.Equal(t, Result{Score: 6, Version: 2}, res)
				require.NoError(t, c.commit())

				events, users, queued = tb.counts(t)
				require.Equal(t, [3]int{4, 2, 3}, [3]int{events, users, queued}, "each user's last state of the batch, and the SubmitTx's row")
				rows, err := tb.pg.Pool.Query(ctx, `SELECT key, version, convert_from(payload, 'UTF8') FROM verity_outbox ORDER BY key, version`)
				require.NoError(t, err)
				var queuedRows []string
				for rows.Next() {
					var key, payload string
					var version int64
					require.NoError(t, rows.Scan(&key, &version, &payload))
					queuedRows = append(queuedRows, fmt.Sprintf("%s v%d %s", key, version, payload))
				}
				require.NoError(t, rows.Err())
				require.Equal(t, []string{"alice v2 7", "bob v1 5", "bob v2 6"}, queuedRows)
			})

			t.Run("RollbackLeavesNothing", func(t *testing.T) {
				t.Parallel()
				tb, begin := setupTx(t)
				c := begin(t)
				_, err := tb.board.SubmitBatchTx(ctx, c.tx, []Command{{EventID: uuid.New(), UserID: "bob", Delta: 3}})
				require.NoError(t, err)
				require.NoError(t, c.rollback())
				events, users, queued := tb.counts(t)
				require.Equal(t, [3]int{0, 0, 0}, [3]int{events, users, queued})
			})

			t.Run("DuplicatesReturnTheirOriginal", func(t *testing.T) {
				t.Parallel()
				tb, begin := setupTx(t)
				cmd := Command{EventID: uuid.New(), UserID: "carol", Delta: 7}
				first, err := tb.board.Submit(ctx, cmd)
				require.NoError(t, err)
				c := begin(t)
				out, err := tb.board.SubmitBatchTx(ctx, c.tx, []Command{cmd, {EventID: uuid.New(), UserID: "carol", Delta: 1}})
				require.NoError(t, err)
				require.Equal(t, []Result{{Score: first.Score, Version: first.Version, Duplicate: true}, {Score: 8, Version: 2}}, out)
				require.NoError(t, c.commit())
				events, users, queued := tb.counts(t)
				require.Equal(t, [3]int{2, 1, 2}, [3]int{events, users, queued})
			})

			t.Run("RefusedBatchesWriteNothingAndKeepTxUsable", func(t *testing.T) {
				t.Parallel()
				tb, begin := setupTx(t)
				id := uuid.New()
				_, err := tb.board.Submit(ctx, Command{EventID: id, UserID: "dave", Delta: 1})
				require.NoError(t, err)
				c := begin(t)
				fresh := Command{EventID: uuid.New(), UserID: "dave", Delta: 100}

				// An event id recorded for another command.
				_, err = tb.board.SubmitBatchTx(ctx, c.tx, []Command{fresh, {EventID: id, UserID: "dave", Delta: 2}})
				var conflict *IdempotencyConflictError
				require.ErrorAs(t, err, &conflict)
				require.Equal(t, Command{EventID: id, UserID: "dave", Delta: 2}, conflict.Attempted)
				require.Equal(t, int64(1), conflict.Delta, "the recorded command")

				// An event id recorded for another user, and one recorded on
				// another board, each with the same delta.
				_, err = tb.board.SubmitBatchTx(ctx, c.tx, []Command{fresh, {EventID: id, UserID: "erin", Delta: 1}})
				require.ErrorAs(t, err, &conflict)
				require.Equal(t, "dave", conflict.UserID, "the recorded command")
				otherID := record(t, tb.sibling(t, "other"), "dave", 1)
				_, err = tb.board.SubmitBatchTx(ctx, c.tx, []Command{fresh, {EventID: otherID, UserID: "dave", Delta: 1}})
				require.ErrorAs(t, err, &conflict)
				require.Equal(t, "other", conflict.Board, "the recorded command")

				// An event id used twice within the batch.
				reused := uuid.New()
				_, err = tb.board.SubmitBatchTx(ctx, c.tx, []Command{fresh, {EventID: reused, UserID: "x", Delta: 1}, {EventID: reused, UserID: "x", Delta: 2}})
				require.ErrorAs(t, err, &conflict)
				require.True(t, conflict.WithinBatch)
				require.Equal(t, int64(2), conflict.Attempted.Delta)

				// An invalid command.
				_, err = tb.board.SubmitBatchTx(ctx, c.tx, []Command{fresh, {EventID: uuid.New(), UserID: "", Delta: 2}})
				var invalid *ValidationError
				require.ErrorAs(t, err, &invalid)
				require.Equal(t, 1, invalid.Index)

				out, err := tb.board.SubmitBatchTx(ctx, c.tx, []Command{fresh})
				require.NoError(t, err, "the transaction survives refused batches")
				require.Equal(t, []Result{{Score: 101, Version: 2}}, out)
				require.NoError(t, c.commit())
				events, users, queued := tb.counts(t)
				require.Equal(t, [3]int{3, 2, 3}, [3]int{events, users, queued}) // with the other board's
			})

			t.Run("ConcurrentTwinAbortsAndRetryIsDuplicate", func(t *testing.T) {
				t.Parallel()
				tb, begin := setupTx(t)
				cmd := Command{EventID: uuid.New(), UserID: "erin", Delta: 4}
				other := Command{EventID: uuid.New(), UserID: "zoe", Delta: 1}
				first := begin(t)
				_, err := tb.board.SubmitTx(ctx, first.tx, cmd)
				require.NoError(t, err)

				twin := begin(t)
				err2 := commitFirstWhileTwinWaits(t, tb, first, twin, func() error {
					_, err := tb.board.SubmitBatchTx(ctx, twin.tx, []Command{other, cmd})
					return err
				})
				var concurrent *ConcurrentSubmitError
				require.ErrorAs(t, err2, &concurrent)
				require.ErrorIs(t, err2, ErrConcurrentSubmit)
				require.Equal(t, cmd.EventID, concurrent.EventID, "the server's detail names the id")
				require.Error(t, twin.commit(), "the caller's transaction is aborted")

				retry := begin(t)
				out, err := tb.board.SubmitBatchTx(ctx, retry.tx, []Command{other, cmd})
				require.NoError(t, err)
				require.Equal(t, []Result{{Score: 1, Version: 1}, {Score: 4, Version: 1, Duplicate: true}}, out)
				require.NoError(t, retry.commit())
				events, users, queued := tb.counts(t)
				require.Equal(t, [3]int{2, 2, 2}, [3]int{events, users, queued})
			})

			t.Run("EventIDOfAnotherOutboxWriter", func(t *testing.T) {
				t.Parallel()
				tb, begin := setupTx(t)
				w, err := outbox.NewWriter(&outbox.Config{Schema: tb.pg.Schema})
				require.NoError(t, err)
				id := uuid.New()
				other := begin(t)
				require.NoError(t, w.Append(ctx, other.tx, outbox.Message{EventID: id, Stream: "orders", Key: "o1", Version: 1}))
				require.NoError(t, other.commit())

				c := begin(t)
				_, err = tb.board.SubmitBatchTx(ctx, c.tx, []Command{{EventID: uuid.New(), UserID: "frank", Delta: 2}, {EventID: id, UserID: "frank", Delta: 1}})
				require.ErrorIs(t, err, ErrIdempotencyConflict)
				require.False(t, errors.Is(err, ErrConcurrentSubmit), "retrying would not help")
				var conflict *IdempotencyConflictError
				require.False(t, errors.As(err, &conflict))
				var pgErr *pgconn.PgError
				require.ErrorAs(t, err, &pgErr, "the driver's unique violation is kept")
				require.Error(t, c.commit())
				events, users, _ := tb.counts(t)
				require.Equal(t, [2]int{0, 0}, [2]int{events, users})
			})

			// The statement's constraint violation aborts the transaction,
			// so the board cannot look for the culprit: Index -1.
			t.Run("ScoreOutOfRange", func(t *testing.T) {
				t.Parallel()
				tb, begin := setupTx(t)
				tb.submit(t, "gina", 1)
				_, err := tb.pg.Pool.Exec(ctx, `UPDATE user_scores SET score = $1`, MaxScore-1)
				require.NoError(t, err)
				c := begin(t)
				_, err = tb.board.SubmitBatchTx(ctx, c.tx, []Command{
					{EventID: uuid.New(), UserID: "hal", Delta: 1},
					{EventID: uuid.New(), UserID: "gina", Delta: 1},
					{EventID: uuid.New(), UserID: "gina", Delta: 1},
				})
				var outOfRange *ScoreOutOfRangeError
				require.ErrorAs(t, err, &outOfRange)
				require.ErrorIs(t, err, ErrScoreOutOfRange)
				require.Equal(t, -1, outOfRange.Index)
				require.Error(t, c.commit(), "the caller's transaction is aborted")
				events, users, queued := tb.counts(t)
				require.Equal(t, [3]int{1, 1, 1}, [3]int{events, users, queued}, "only the first submit")
			})
		})
	}

	// Above MaxSubmitsPerStatementDefault commands a pgx transaction on a
	// statement-caching connection sends the statement unnamed, so that it
	// never runs on a generic plan; smaller batches use the cached
	// statement. The results are the same either way, also past the fifth
	// run, when a cached statement switches to a generic plan.
	t.Run("LargeBatches", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		conn, err := tb.pg.Pool.Acquire(ctx)
		require.NoError(t, err)
		defer conn.Release()
		prepared := func() int {
			var n int
			require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE '%pg_notify($7::text%' AND statement NOT LIKE '%pg_prepared_statements%'`).Scan(&n))
			return n
		}
		for _, n := range []int{MaxSubmitsPerStatementDefault + 1, MaxSubmitsPerStatementDefault} {
			for round := range 7 {
				tx, err := conn.Begin(ctx)
				require.NoError(t, err)
				cmds := make([]Command, n)
				want := map[string]Result{}
				for i := range cmds {
					cmds[i] = Command{EventID: uuid.New(), UserID: fmt.Sprintf("user-%d", i%50), Delta: 1}
					r := want[cmds[i].UserID]
					want[cmds[i].UserID] = Result{Score: r.Score + 1, Version: r.Version + 1}
				}
				out, err := tb.board.SubmitBatchTx(ctx, tx, cmds)
				require.NoError(t, err, "n=%d round %d", n, round)
				require.Len(t, out, n)
				require.NoError(t, tx.Rollback(ctx))
				for i, cmd := range cmds[n-50:] { // each user's last command
					require.Equal(t, want[cmd.UserID], out[n-50+i], "n=%d round %d", n, round)
				}
			}
			if n > MaxSubmitsPerStatementDefault {
				require.Zero(t, prepared(), "sent unnamed")
			} else {
				require.Equal(t, 1, prepared(), "the cached statement")
			}
		}
	})

	t.Run("EmptyBatch", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		tx, err := tb.pg.Pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // the test only reads
		out, err := tb.board.SubmitBatchTx(ctx, tx, nil)
		require.NoError(t, err)
		require.Empty(t, out)
	})

	// A server whose message names none of the batch's ids (translated,
	// or cut short) leaves EventID unknown, and the message says so.
	t.Run("ConcurrentSubmitErrorWithoutEventID", func(t *testing.T) {
		t.Parallel()
		err := &ConcurrentSubmitError{}
		require.ErrorIs(t, err, ErrConcurrentSubmit)
		require.Contains(t, err.Error(), "an event of the batch was committed by a concurrent transaction")
		id := uuid.New()
		require.Contains(t, (&ConcurrentSubmitError{EventID: id}).Error(), "event "+id.String()+" was committed")
		cmds := []Command{{EventID: uuid.New()}, {EventID: id}}
		require.Equal(t, id, twinEventID(&pgconn.PgError{Code: "23505", Detail: "Schlüssel »(event_id)=(" + id.String() + ")« existiert bereits."}, cmds, []int{0, 1}))
		require.Equal(t, uuid.Nil, twinEventID(&pgconn.PgError{Code: "23505"}, cmds, []int{0, 1}))
		require.Equal(t, uuid.Nil, twinEventID(&pgconn.PgError{Code: "23505", Detail: id.String()}, cmds, []int{0}), "only the batch's sent ids")
	})

	t.Run("NilTx", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		_, err := tb.board.SubmitBatchTx(ctx, nil, []Command{{EventID: uuid.New(), UserID: "x", Delta: 1}})
		require.ErrorIs(t, err, ErrInvalidConfig)
		var cfgErr *ConfigError
		require.ErrorAs(t, err, &cfgErr)
		require.Equal(t, "tx", cfgErr.Field)
		require.Contains(t, cfgErr.Reason, "SubmitBatchTx needs the caller's open transaction")
	})

	// A pool, or a connection outside a transaction, would commit the
	// score without the caller's writes: refused, nothing written.
	t.Run("NotATransaction", func(t *testing.T) {
		t.Parallel()
		requireNonTransactionRefused(t, func(tb *testBundle, tx outbox.Tx) error {
			_, err := tb.board.SubmitBatchTx(ctx, tx, []Command{{EventID: uuid.New(), UserID: "x", Delta: 1}})
			return err
		})
	})
}

// TestSubmitBatchTxThroughDatabaseSQLIsPlannedForItsArrays runs batches
// larger than preparedBatchMax through database/sql, whose driver caches
// the statement: PostgreSQL must plan each for its arrays, never with the
// generic plan a cached statement switches to after five runs (its nested
// loops made a batch of 2,000 take 530 ms instead of 40). The caller's own
// plan_cache_mode is back after each.
func TestSubmitBatchTxThroughDatabaseSQLIsPlannedForItsArrays(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	db, err := sql.Open("pgx", tb.pg.ConnString)
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	db.SetMaxOpenConns(1) // one session: its prepared statements are the ones counted
	for run := range 8 {
		cmds := make([]Command, preparedBatchMax+1)
		for i := range cmds {
			cmds[i] = Command{EventID: uuid.New(), UserID: fmt.Sprintf("u%d-%d", run, i), Delta: 1}
		}
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		_, err = tx.ExecContext(ctx, `SET LOCAL plan_cache_mode = force_generic_plan`)
		require.NoError(t, err)
		_, err = tb.board.SubmitBatchTx(ctx, outbox.SQLTx(tx), cmds)
		require.NoError(t, err)
		var mode string
		require.NoError(t, tx.QueryRowContext(ctx, `SELECT current_setting('plan_cache_mode')`).Scan(&mode))
		require.Equal(t, "force_generic_plan", mode, "run %d: the caller's setting is back", run)
		require.NoError(t, tx.Commit())
	}
	var prepared, generic, custom int64
	require.NoError(t, db.QueryRowContext(ctx, `
		SELECT count(*), coalesce(sum(generic_plans), 0), coalesce(sum(custom_plans), 0)
		FROM pg_prepared_statements
		WHERE statement LIKE '%json_build_object(%' AND statement NOT LIKE '%pg_prepared_statements%'`).Scan(&prepared, &generic, &custom))
	require.Equal(t, int64(1), prepared, "setup: the driver cached the batch statement")
	require.Zero(t, generic, "runs on the generic plan")
	require.Equal(t, int64(8), custom)
}

// TestSubmitBatchTxInPgxIsPlannedForItsArrays runs batches larger than
// preparedBatchMax in a pgx transaction, in each of pgx's query modes,
// with the caller's plan_cache_mode auto and force_generic_plan: each is
// planned for its arrays (auto_explain's plan holds the batch's values,
// not unnest($1)), past the five runs after which a cached statement goes
// generic, and the caller's setting is back after each.
func TestSubmitBatchTxInPgxIsPlannedForItsArrays(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	modes := []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
		pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol}
	for _, callerMode := range []string{"auto", "force_generic_plan"} {
		for _, mode := range modes {
			t.Run(fmt.Sprintf("%s/%v", callerMode, mode), func(t *testing.T) {
				t.Parallel()
				tb := setup(t)
				cfg, err := pgx.ParseConfig(tb.pg.ConnString)
				require.NoError(t, err)
				cfg.DefaultQueryExecMode = mode
				plans := collectPlans(cfg, "json_build_object(")
				conn, err := pgx.ConnectConfig(ctx, cfg)
				require.NoError(t, err)
				t.Cleanup(func() { conn.Close(context.Background()) })
				for run := range 7 { // past the five custom plans of a cached statement
					tx, err := conn.Begin(ctx)
					require.NoError(t, err)
					for _, s := range []string{`LOAD 'auto_explain'`,
						`SET LOCAL auto_explain.log_min_duration = 0`, `SET LOCAL auto_explain.log_level = notice`,
						`SET LOCAL auto_explain.log_format = json`, `SET LOCAL auto_explain.log_verbose = on`,
						`SET LOCAL plan_cache_mode = ` + callerMode} {
						_, err := tx.Exec(ctx, s)
						require.NoError(t, err, s)
					}
					cmds := make([]Command, preparedBatchMax+1)
					for i := range cmds {
						cmds[i] = Command{EventID: uuid.New(), UserID: fmt.Sprintf("zzmark%d-%d", run, i), Delta: 1}
					}
					_, err = tb.board.SubmitBatchTx(ctx, tx, cmds)
					require.NoError(t, err)
					var got string
					require.NoError(t, tx.QueryRow(ctx, `SELECT current_setting('plan_cache_mode')`).Scan(&got))
					require.Equal(t, callerMode, got, "the caller's setting is back")
					require.NoError(t, tx.Commit(ctx))
				}
				require.Len(t, plans(), 7)
				for run, p := range plans() {
					if !strings.Contains(p, fmt.Sprintf("zzmark%d-", run)) {
						t.Errorf("run %d is planned with the generic plan, not for its arrays (unnest($1) in the plan: %v)", run, strings.Contains(p, `unnest($1)`))
					}
				}
			})
		}
	}
}

// stallBeforePlanRestore forwards to a transaction and, just before the
// statement that puts the caller's plan_cache_mode back, stops the
// transaction's server process (SIGSTOP): the database stops answering
// at that moment, as behind a network partition.
type stallBeforePlanRestore struct {
	outbox.Tx
	pid     int
	stalled chan struct{}
}

func (s *stallBeforePlanRestore) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if sql == restorePlanModeSQL {
		_ = syscall.Kill(s.pid, syscall.SIGSTOP)
		close(s.stalled)
	}
	return s.Tx.QueryRow(ctx, sql, args...)
}

// TestSubmitBatchTxPlanRestoreIsBounded: ctx does not cut short the
// statement that puts the caller's plan_cache_mode back (the batch is in
// the transaction by then), but planRestoreTimeout does: a database that
// stopped answering there held the call until it answered again.
func TestSubmitBatchTxPlanRestoreIsBounded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.StartPostgres(t) // a private server: its backend is stopped
	pool := srv.Pool(t)
	rd := testenv.Redis(t)
	cfg := &Config{Name: "b", KeyPrefix: rd.Prefix}
	require.NoError(t, Migrate(ctx, pool, cfg))
	board, err := New(pool, rd.Client, cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	// Before the pool's Close, which waits for the transaction's connection.
	t.Cleanup(func() { _ = tx.Rollback(ctx) })
	var pid int
	require.NoError(t, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
	t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGCONT) })
	stalling := &stallBeforePlanRestore{Tx: tx, pid: pid, stalled: make(chan struct{})}
	cmds := make([]Command, preparedBatchMax+1)
	for i := range cmds {
		cmds[i] = Command{EventID: uuid.New(), UserID: fmt.Sprintf("u%d", i), Delta: 1}
	}
	callCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { _, err := board.SubmitBatchTx(callCtx, stalling, cmds); done <- err }()
	select {
	case <-stalling.stalled:
	case err := <-done: // stalled would never close
		t.Fatalf("SubmitBatchTx returned before putting plan_cache_mode back: %v", err)
	}
	// The caller gives up only once the batch is in tx and the database
	// has stopped answering (a call deadline could end the call before it
	// reached the restore on a loaded machine).
	cancel()
	select {
	case err := <-done:
		// planRestoreTimeout's deadline, not the caller's cancellation.
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.NotErrorIs(t, err, context.Canceled)
	case <-time.After(planRestoreTimeout + 5*time.Second):
		require.NoError(t, syscall.Kill(pid, syscall.SIGCONT))
		<-done
		t.Fatalf("SubmitBatchTx was held past planRestoreTimeout (%v) by a database that stopped answering", planRestoreTimeout)
	}
	require.NoError(t, syscall.Kill(pid, syscall.SIGCONT))
}

// cancelAfterTracer cancels a context once a statement whose text holds
// marker has ended.
type cancelAfterTracer struct {
	marker string
	cancel atomic.Pointer[context.CancelFunc]
}

type cancelAfterKey struct{}

func (c *cancelAfterTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, c.marker) {
		return context.WithValue(ctx, cancelAfterKey{}, true)
	}
	return ctx
}

func (c *cancelAfterTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	if ctx.Value(cancelAfterKey{}) != nil {
		if cancel := c.cancel.Swap(nil); cancel != nil {
			(*cancel)()
		}
	}
}

// TestSubmitBatchTxPutsSettingsBackWhenCancelled: ctx ends after the
// statement that forces custom plans and turns JIT off for a large batch,
// before the batch's statement is sent. Nothing aborts the caller's
// transaction, and its plan_cache_mode and jit were left changed.
func TestSubmitBatchTxPutsSettingsBackWhenCancelled(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	tr := &cancelAfterTracer{marker: "current_setting('jit')"}
	pool := tb.newPool(t, func(pc *pgxpool.Config) {
		pc.MaxConns = 1
		pc.ConnConfig.Tracer = tr
	})
	cfg := tb.board.Config()
	board, err := New(pool, tb.rd.Client, &cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)

	bg := context.Background()
	tx, err := pool.Begin(bg)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(bg) }()
	cmds := make([]Command, preparedBatchMax+1)
	for i := range cmds {
		cmds[i] = Command{EventID: uuid.New(), UserID: fmt.Sprintf("u%d", i), Delta: 1}
	}
	ctx, cancel := context.WithCancel(bg)
	defer cancel()
	tr.cancel.Store(&cancel)
	_, err = board.SubmitBatchTx(ctx, tx, cmds)
	require.ErrorIs(t, err, context.Canceled)
	var jit, mode string
	require.NoError(t, tx.QueryRow(bg, `SELECT current_setting('jit'), current_setting('plan_cache_mode')`).Scan(&jit, &mode),
		"the caller's transaction is still usable")
	require.Equal(t, []string{"on", "auto"}, []string{jit, mode}, "the caller's settings are put back")
}
