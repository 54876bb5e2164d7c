package leaderboard

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" database/sql driver
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/outbox"
)

// callerTx is a transaction the test opens as an application would, through
// pgx or through database/sql.
type callerTx struct {
	tx       outbox.Tx
	pid      int // backend pid, to see the transaction wait on a lock
	commit   func() error
	rollback func() error
}

// txPaths opens caller transactions on the bundle's schema: one path per
// driver SubmitTx supports.
func txPaths(t *testing.T, tb *testBundle) map[string]func(t *testing.T) *callerTx {
	ctx := context.Background()
	db, err := sql.Open("pgx", tb.pg.ConnString)
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	return map[string]func(t *testing.T) *callerTx{
		"Pgx": func(t *testing.T) *callerTx {
			tx, err := tb.pg.Pool.Begin(ctx)
			require.NoError(t, err)
			t.Cleanup(func() { _ = tx.Rollback(ctx) })
			c := &callerTx{tx: tx, commit: func() error { return tx.Commit(ctx) }, rollback: func() error { return tx.Rollback(ctx) }}
			require.NoError(t, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&c.pid))
			return c
		},
		"DatabaseSQL": func(t *testing.T) *callerTx {
			tx, err := db.BeginTx(ctx, nil)
			require.NoError(t, err)
			t.Cleanup(func() { _ = tx.Rollback() })
			c := &callerTx{tx: outbox.SQLTx(tx), commit: tx.Commit, rollback: tx.Rollback}
			require.NoError(t, tx.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&c.pid))
			return c
		},
	}
}

// commitFirstWhileTwinWaits runs submit (a submit in twin's transaction of
// a command first's uncommitted transaction holds) in the background,
// commits first once twin waits on its locks (it cannot see the
// uncommitted command), and returns submit's error.
func commitFirstWhileTwinWaits(t *testing.T, tb *testBundle, first, twin *callerTx, submit func() error) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- submit() }()
	require.Eventually(t, func() bool {
		var waiting bool
		err := tb.pg.Pool.QueryRow(context.Background(),
			`SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = $1 AND NOT granted)`, twin.pid).Scan(&waiting)
		return err == nil && waiting
	}, 10*time.Second, 5*time.Millisecond)
	require.NoError(t, first.commit())
	select {
	case err := <-done:
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("the twin's submit did not return after the first committed")
		return nil
	}
}

func TestSubmitTx(t *testing.T) {
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
				res, err := tb.board.SubmitTx(ctx, c.tx, Command{EventID: uuid.New(), UserID: "alice", Delta: 10})
				require.NoError(t, err)
				require.Equal(t, Result{Score: 10, Version: 1}, res)
				events, users, queued := tb.counts(t)
				require.Equal(t, [3]int{0, 0, 0}, [3]int{events, users, queued}, "nothing is visible before the caller commits")

				res, err = tb.board.SubmitTx(ctx, c.tx, Command{EventID: uuid.New(), UserID: "alice", Delta: 5})
				require.NoError(t, err)
				require.Equal(t, Result{Score: 15, Version: 2}, res)
				require.NoError(t, c.commit())

				events, users, queued = tb.counts(t)
				require.Equal(t, [3]int{2, 1, 2}, [3]int{events, users, queued})
				var payload []byte
				require.NoError(t, tb.pg.Pool.QueryRow(ctx, `SELECT payload FROM verity_outbox ORDER BY version DESC LIMIT 1`).Scan(&payload))
				require.Equal(t, "15", string(payload))
			})

			t.Run("RollbackLeavesNothing", func(t *testing.T) {
				t.Parallel()
				tb, begin := setupTx(t)
				c := begin(t)
				_, err := tb.board.SubmitTx(ctx, c.tx, Command{EventID: uuid.New(), UserID: "bob", Delta: 3})
				require.NoError(t, err)
				require.NoError(t, c.rollback())
				events, users, queued := tb.counts(t)
				require.Equal(t, [3]int{0, 0, 0}, [3]int{events, users, queued})
			})

			t.Run("DuplicateReturnsOriginal", func(t *testing.T) {
				t.Parallel()
				tb, begin := setupTx(t)
				cmd := Command{EventID: uuid.New(), UserID: "carol", Delta: 7}
				first, err := tb.board.Submit(ctx, cmd)
				require.NoError(t, err)
				c := begin(t)
				res, err := tb.board.SubmitTx(ctx, c.tx, cmd)
				require.NoError(t, err)
				require.Equal(t, Result{Score: first.Score, Version: first.Version, Duplicate: true}, res)
				require.NoError(t, c.commit())
				events, users, queued := tb.counts(t)
				require.Equal(t, [3]int{1, 1, 1}, [3]int{events, users, queued})
			})

			t.Run("ConflictWritesNothingAndKeepsTxUsable", func(t *testing.T) {
				t.Parallel()
				tb, begin := setupTx(t)
				id := uuid.New()
				_, err := tb.board.Submit(ctx, Command{EventID: id, UserID: "dave", Delta: 1})
				require.NoError(t, err)
				c := begin(t)
				_, err = tb.board.SubmitTx(ctx, c.tx, Command{EventID: id, UserID: "dave", Delta: 2})
				var conflict *IdempotencyConflictError
				require.ErrorAs(t, err, &conflict)
				require.Equal(t, int64(1), conflict.Delta)

				_, err = tb.board.SubmitTx(ctx, c.tx, Command{EventID: uuid.New(), UserID: "", Delta: 2})
				require.ErrorIs(t, err, ErrInvalidCommand)

				res, err := tb.board.SubmitTx(ctx, c.tx, Command{EventID: uuid.New(), UserID: "dave", Delta: 2})
				require.NoError(t, err, "the transaction survives refused commands")
				require.Equal(t, Result{Score: 3, Version: 2}, res)
				require.NoError(t, c.commit())
				events, _, _ := tb.counts(t)
				require.Equal(t, 2, events)
			})

			t.Run("ConcurrentTwinAbortsAndRetryIsDuplicate", func(t *testing.T) {
				t.Parallel()
				tb, begin := setupTx(t)
				cmd := Command{EventID: uuid.New(), UserID: "erin", Delta: 4}
				first := begin(t)
				_, err := tb.board.SubmitTx(ctx, first.tx, cmd)
				require.NoError(t, err)

				twin := begin(t)
				err2 := commitFirstWhileTwinWaits(t, tb, first, twin, func() error {
					_, err := tb.board.SubmitTx(ctx, twin.tx, cmd)
					return err
				})
				var concurrent *ConcurrentSubmitError
				require.ErrorAs(t, err2, &concurrent)
				require.ErrorIs(t, err2, ErrConcurrentSubmit)
				require.Equal(t, cmd.EventID, concurrent.EventID)
				require.Error(t, twin.commit(), "the caller's transaction is aborted")

				retry := begin(t)
				res, err := tb.board.SubmitTx(ctx, retry.tx, cmd)
				require.NoError(t, err)
				require.Equal(t, Result{Score: 4, Version: 1, Duplicate: true}, res)
				require.NoError(t, retry.rollback())
				events, users, queued := tb.counts(t)
				require.Equal(t, [3]int{1, 1, 1}, [3]int{events, users, queued})
				var score int64
				require.NoError(t, tb.pg.Pool.QueryRow(ctx, `SELECT score FROM user_scores WHERE user_id = 'erin'`).Scan(&score))
				require.Equal(t, int64(4), score, "the aborted twin's score change is undone with its transaction")
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
				_, err = tb.board.SubmitTx(ctx, c.tx, Command{EventID: id, UserID: "frank", Delta: 1})
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

			t.Run("ScoreOutOfRange", func(t *testing.T) {
				t.Parallel()
				tb, begin := setupTx(t)
				c := begin(t)
				_, err := tb.board.SubmitTx(ctx, c.tx, Command{EventID: uuid.New(), UserID: "gina", Delta: 1000})
				require.NoError(t, err)
				require.NoError(t, c.commit())
				_, err = tb.pg.Pool.Exec(ctx, `UPDATE user_scores SET score = $1`, MaxScore)
				require.NoError(t, err)
				c = begin(t)
				_, err = tb.board.SubmitTx(ctx, c.tx, Command{EventID: uuid.New(), UserID: "gina", Delta: 1})
				var outOfRange *ScoreOutOfRangeError
				require.ErrorAs(t, err, &outOfRange)
				require.NoError(t, c.rollback())
			})
		})
	}

	t.Run("NilTx", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		_, err := tb.board.SubmitTx(ctx, nil, Command{EventID: uuid.New(), UserID: "x", Delta: 1})
		require.ErrorIs(t, err, ErrInvalidConfig)
		var cfgErr *ConfigError
		require.ErrorAs(t, err, &cfgErr)
		require.Equal(t, "tx", cfgErr.Field)
		require.Contains(t, cfgErr.Reason, "SubmitTx needs the caller's open transaction")
	})

	// A pool, or a connection outside a transaction, would commit the
	// score without the caller's writes: refused, nothing written.
	t.Run("NotATransaction", func(t *testing.T) {
		t.Parallel()
		requireNonTransactionRefused(t, func(tb *testBundle, tx outbox.Tx) error {
			_, err := tb.board.SubmitTx(ctx, tx, Command{EventID: uuid.New(), UserID: "x", Delta: 1})
			return err
		})
	})
}

// requireNonTransactionRefused: submit, given a pool or a connection outside
// a transaction as tx (which would commit the score without the caller's
// writes), is refused with a *ConfigError naming tx, and writes nothing.
func requireNonTransactionRefused(t *testing.T, submit func(tb *testBundle, tx outbox.Tx) error) {
	t.Helper()
	ctx := context.Background()
	tb := setup(t)
	conn, err := tb.pg.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	for name, tx := range map[string]outbox.Tx{"Pool": tb.pg.Pool, "Conn": conn} {
		err := submit(tb, tx)
		require.ErrorIs(t, err, ErrInvalidConfig, name)
		var cfgErr *ConfigError
		require.ErrorAs(t, err, &cfgErr, name)
		require.Equal(t, "tx", cfgErr.Field, name)
		require.Contains(t, cfgErr.Reason, "commit on their own", name)
	}
	var n int
	require.NoError(t, tb.pg.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM user_scores) + (SELECT count(*) FROM verity_outbox)`).Scan(&n))
	require.Zero(t, n, "nothing written")
}

// TestSubmitTxConflictOnAnotherBoard: SubmitTx with an event id recorded for
// the same user and delta on another board of the same tables is a reused
// id: an *IdempotencyConflictError naming the recorded board, nothing
// written, tx usable.
func TestSubmitTxConflictOnAnotherBoard(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, path := range []string{"Pgx", "DatabaseSQL"} {
		t.Run(path, func(t *testing.T) {
			t.Parallel()
			tb := setup(t)
			begin := txPaths(t, tb)[path]
			id := record(t, tb.sibling(t, "other"), "a", 1)

			c := begin(t)
			cmd := Command{EventID: id, UserID: "a", Delta: 1}
			res, err := tb.board.SubmitTx(ctx, c.tx, cmd)
			require.ErrorIs(t, err, ErrIdempotencyConflict, "got %+v", res)
			var conflict *IdempotencyConflictError
			require.ErrorAs(t, err, &conflict)
			require.Equal(t, &IdempotencyConflictError{EventID: id, Board: "other", UserID: "a", Delta: 1, Attempted: cmd}, conflict)

			// tx stays usable, and the refused command wrote nothing.
			_, err = tb.board.SubmitTx(ctx, c.tx, Command{EventID: uuid.New(), UserID: "a", Delta: 2})
			require.NoError(t, err)
			require.NoError(t, c.commit())
			var n int
			require.NoError(t, tb.pg.Pool.QueryRow(ctx, `SELECT count(*) FROM score_events WHERE board = $1`, tb.board.Name()).Scan(&n))
			require.Equal(t, 1, n)
		})
	}
}
