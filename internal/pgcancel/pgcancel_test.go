package pgcancel_test

import (
	"context"
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/pgcancel"
	"github.com/verity-go/verity/internal/testenv"
)

// script waits for the lock setup holds, then writes two rows.
const script = `INSERT INTO "held" VALUES (1); INSERT INTO "held" VALUES (2)`

type testBundle struct {
	pg *testenv.PG
	// holder's transaction holds "held" exclusively until it ends.
	holder pgx.Tx
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	ctx := context.Background()
	pg := testenv.Postgres(t)
	_, err := pg.Pool.Exec(ctx, `CREATE TABLE "held" ("n" int)`)
	require.NoError(t, err)
	holder, err := pg.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = holder.Rollback(context.Background()) })
	_, err = holder.Exec(ctx, `LOCK TABLE "held" IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	return &testBundle{pg: pg, holder: holder}
}

// waiting counts the lock requests on "held" not granted.
func (b *testBundle) waiting(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, b.pg.Pool.QueryRow(context.Background(),
		`SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = to_regclass('held')`).Scan(&n))
	return n
}

// execOnceWaiting runs script with pgcancel.Exec on db and ends its
// context (with cancel) once the server waits for the lock.
func (b *testBundle) execOnceWaiting(t *testing.T, db pgcancel.Execer) (time.Duration, error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- execErr(ctx, db, script) }()
	require.Eventually(t, func() bool { return b.waiting(t) == 1 }, 10*time.Second, 5*time.Millisecond)
	start := time.Now()
	cancel()
	select {
	case err := <-done:
		return time.Since(start), err
	case <-time.After(pgcancel.Grace + 30*time.Second):
		t.Fatal("Exec has not returned")
		return 0, nil
	}
}

// requireNothingLeft: the script's backend is no longer waiting (nobody
// queues behind it), and once the lock is free nothing it wrote commits.
func (b *testBundle) requireNothingLeft(t *testing.T) {
	t.Helper()
	require.Zero(t, b.waiting(t), "the statement still waits on the server")
	require.NoError(t, b.holder.Rollback(context.Background()))
	var n int
	require.NoError(t, b.pg.Pool.QueryRow(context.Background(), `SELECT count(*) FROM "held"`).Scan(&n))
	require.Zero(t, n)
}

func requireCancelled(t *testing.T, err error, elapsed time.Duration) {
	t.Helper()
	require.ErrorIs(t, err, context.Canceled)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr, "the server cancelled the statement")
	require.Equal(t, "57014", pgErr.Code)
	require.Less(t, elapsed, pgcancel.Grace)
}

func TestExec(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("Pool", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		elapsed, err := b.execOnceWaiting(t, b.pg.Pool)
		requireCancelled(t, err, elapsed)
		b.requireNothingLeft(t)
	})

	// A connection of the caller's is kept, usable.
	for name, open := range map[string]func(t *testing.T, b *testBundle) pgcancel.Execer{
		"PoolConn": func(t *testing.T, b *testBundle) pgcancel.Execer {
			c, err := b.pg.Pool.Acquire(ctx)
			require.NoError(t, err)
			t.Cleanup(c.Release)
			return c
		},
		"Conn": func(t *testing.T, b *testBundle) pgcancel.Execer {
			conn, err := pgx.Connect(ctx, b.pg.ConnString)
			require.NoError(t, err)
			t.Cleanup(func() { _ = conn.Close(ctx) })
			return conn
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			db := open(t, b)
			elapsed, err := b.execOnceWaiting(t, db)
			requireCancelled(t, err, elapsed)
			b.requireNothingLeft(t)
			_, err = db.Exec(ctx, `SELECT 1`)
			require.NoError(t, err, "the connection is kept")
		})
	}

	t.Run("Tx", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		tx, err := b.pg.Pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck
		elapsed, err := b.execOnceWaiting(t, tx)
		requireCancelled(t, err, elapsed)
		b.requireNothingLeft(t)
		_, err = tx.Exec(ctx, `SELECT 1`)
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr)
		require.Equal(t, "25P02", pgErr.Code, "the caller's transaction is aborted")
		require.NoError(t, tx.Rollback(ctx))
	})

	t.Run("DeadlineIsTheCause", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		dctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		defer cancel()
		err := execErr(dctx, b.pg.Pool, script)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		b.requireNothingLeft(t)
	})

	// A cause the caller gave is kept beside ctx's error, which callers
	// match (pgx's own error matches it).
	t.Run("CauseKeptBesideCtxErr", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		errSlow := errors.New("too slow")
		dctx, cancel := context.WithTimeoutCause(ctx, 300*time.Millisecond, errSlow)
		defer cancel()
		err := execErr(dctx, b.pg.Pool, script)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.ErrorIs(t, err, errSlow)
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr)
		require.Equal(t, "57014", pgErr.Code)
		b.requireNothingLeft(t)
	})

	t.Run("FinishedFirst", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		_, err := pg.Pool.Exec(ctx, `CREATE TABLE "held" ("n" int)`)
		require.NoError(t, err)
		cctx, cancel := context.WithCancel(ctx)
		defer cancel()
		require.NoError(t, execErr(cctx, pg.Pool, script))
		var n int
		require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT count(*) FROM "held"`).Scan(&n))
		require.Equal(t, 2, n)
	})

	// With arguments (the extended protocol), the statement's tag comes
	// back, and a statement waiting for a lock is cancelled as well.
	t.Run("ArgumentsAndTag", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		const insert = `INSERT INTO "held" SELECT generate_series(1, $1::int)`
		cctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { _, err := pgcancel.Exec(cctx, b.pg.Pool, insert, 3); done <- err }()
		require.Eventually(t, func() bool { return b.waiting(t) == 1 }, 10*time.Second, 5*time.Millisecond)
		cancel()
		requireCancelled(t, <-done, 0)
		b.requireNothingLeft(t)
		tag, err := pgcancel.Exec(ctx, b.pg.Pool, insert, 3)
		require.NoError(t, err)
		require.EqualValues(t, 3, tag.RowsAffected())
	})

	t.Run("EndedBeforeStart", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		conn, err := pgx.Connect(ctx, b.pg.ConnString)
		require.NoError(t, err)
		defer conn.Close(ctx)
		for _, db := range []pgcancel.Execer{b.pg.Pool, conn} {
			require.ErrorIs(t, execErr(cctx, db, script), context.Canceled)
		}
		errGone := errors.New("gone")
		causeCtx, cancelCause := context.WithCancelCause(ctx)
		cancelCause(errGone)
		err = execErr(causeCtx, conn, script)
		require.ErrorIs(t, err, context.Canceled)
		require.ErrorIs(t, err, errGone, "the cause is kept")
		b.requireNothingLeft(t)
	})

	t.Run("ReleasedPoolConn", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		c, err := pg.Pool.Acquire(ctx)
		require.NoError(t, err)
		c.Release()
		require.ErrorIs(t, execErr(ctx, c, `SELECT 1`), pgcancel.ErrReleased)
	})

	// A cancel request that cannot reach the server: Exec closes the
	// connection once Grace has passed, and returns.
	t.Run("CancelUnanswered", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg, err := pgx.ParseConfig(b.pg.ConnString)
		require.NoError(t, err)
		var connected atomic.Bool
		var cancelDials atomic.Int32
		var d net.Dialer
		// Closed at the end, so that pgx's own cancel request on closing
		// the connection fails at once rather than at its deadline.
		unblock := make(chan struct{})
		defer close(unblock)
		cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			if connected.Load() { // the cancel request's connection
				cancelDials.Add(1)
				select {
				case <-ctx.Done():
					return nil, ctx.Err()
				case <-unblock:
					return nil, errors.New("unreachable")
				}
			}
			return d.DialContext(ctx, network, addr)
		}
		conn, err := pgx.ConnectConfig(ctx, cfg)
		require.NoError(t, err)
		defer conn.Close(ctx)
		connected.Store(true)
		elapsed, err := b.execOnceWaiting(t, conn)
		require.ErrorIs(t, err, context.Canceled)
		require.GreaterOrEqual(t, elapsed, pgcancel.Grace)
		require.Less(t, elapsed, pgcancel.Grace+5*time.Second)
		require.NotZero(t, cancelDials.Load(), "a cancel request was tried")
		require.True(t, conn.IsClosed())
	})

	// A database/sql adapter, or any handle not of pgx's, runs as it is.
	t.Run("OtherHandle", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		_, err := pg.Pool.Exec(ctx, `CREATE TABLE "held" ("n" int)`)
		require.NoError(t, err)
		require.NoError(t, execErr(ctx, execFunc(pg.Pool.Exec), script))
		var n int
		require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT count(*) FROM "held"`).Scan(&n))
		require.Equal(t, 2, n)
	})
}

// execErr is pgcancel.Exec without its command tag.
func execErr(ctx context.Context, db pgcancel.Execer, sql string) error {
	_, err := pgcancel.Exec(ctx, db, sql)
	return err
}

type execFunc func(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)

func (f execFunc) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return f(ctx, sql, args...)
}
