package leaderboard

import (
	"context"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/reconcile"
)

// TestOutages stops real servers: Redis (writes go on, reads fall back, the
// projection is rebuilt from PostgreSQL after a restart that lost every
// key) and PostgreSQL (the projection keeps serving, honest about not
// knowing its lag).
func TestOutages(t *testing.T) {
	t.Parallel()

	t.Run("RedisDown", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		rs := testenv.StartRedis(t)
		pg := testenv.Postgres(t)
		cfg := &Config{Name: "b", Schema: pg.Schema, ReadPolicy: FallbackToPostgres}
		require.NoError(t, Migrate(ctx, pg.Pool, cfg))
		board, err := New(pg.Pool, rs.Client(t), cfg)
		require.NoError(t, err)
		tb := &testBundle{board: board, pg: pg}
		tb.submit(t, "ada", 10)
		tb.submit(t, "bob", 20)
		tb.drain(t)

		require.NoError(t, rs.Kill())
		// Writes need PostgreSQL only.
		tb.submit(t, "ada", 15)
		r, err := board.Top(ctx, 10)
		require.NoError(t, err)
		require.Equal(t, SourcePostgres, r.Freshness.Source)
		require.Equal(t, []Entry{{UserID: "ada", Score: 25, Rank: 1}, {UserID: "bob", Score: 20, Rank: 2}}, r.Entries)
		_, err = board.Top(ctx, 10, WithPolicy(ServeStale))
		require.Error(t, err)
		_, err = board.Top(ctx, 10, WithPolicy(FailClosed))
		require.Error(t, err)

		// Redis comes back empty (no persistence): the worker projects what
		// was pending, the reconciler restores the rest.
		require.NoError(t, rs.Start())
		tb.drain(t)
		rec, err := board.Reconciler(nil)
		require.NoError(t, err)
		report, err := rec.Run(ctx, reconcile.RunOptions{})
		require.NoError(t, err)
		require.Equal(t, int64(1), report.Counts[reconcile.ClassMissing]) // bob
		require.Equal(t, int64(1), report.Repaired)
		r, err = board.Top(ctx, 10)
		require.NoError(t, err)
		require.Equal(t, SourceRedis, r.Freshness.Source)
		auth, err := board.Authoritative(ctx, 10)
		require.NoError(t, err)
		require.Equal(t, auth, r.Entries)
	})

	t.Run("PostgresDown", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		srv := testenv.StartPostgres(t)
		pool := srv.Pool(t)
		rd := testenv.Redis(t)
		cfg := &Config{Name: "b", KeyPrefix: rd.Prefix, ReadPolicy: ServeStale, LagProbeInterval: time.Nanosecond}
		require.NoError(t, Migrate(ctx, pool, cfg))
		board, err := New(pool, rd.Client, cfg)
		require.NoError(t, err)
		tb := &testBundle{board: board}
		tb.submit(t, "ada", 10)
		tb.drain(t)

		require.NoError(t, srv.Stop())
		r, err := board.Top(ctx, 10)
		require.NoError(t, err)
		require.Equal(t, SourceRedis, r.Freshness.Source)
		require.Negative(t, r.Freshness.Lag, "lag is unknown, and says so")
		require.Equal(t, []Entry{{UserID: "ada", Score: 10, Rank: 1}}, r.Entries)

		_, err = board.Top(ctx, 10, WithPolicy(FailClosed))
		require.ErrorIs(t, err, ErrStale)
		_, err = board.Top(ctx, 10, WithPolicy(FallbackToPostgres))
		require.Error(t, err)
		_, err = board.Submit(ctx, Command{EventID: uuid.New(), UserID: "ada", Delta: 1})
		require.Error(t, err)
		_, err = board.Authoritative(ctx, 10)
		require.Error(t, err, "payout rankings never come from Redis")
	})
}

// TestReadCutOffByItsDeadline: a read whose Redis stops answering ends at
// the caller's deadline with ctx's error, under every policy, also through
// a client that reports it as a bare i/o timeout (ContextTimeoutEnabled,
// no retries): the caller can tell its own deadline from an outage.
func TestReadCutOffByItsDeadline(t *testing.T) {
	t.Parallel()
	rs := testenv.StartRedis(t)
	rc := redis.NewClient(&redis.Options{Addr: rs.Addr(), ContextTimeoutEnabled: true,
		ReadTimeout: 20 * time.Second, WriteTimeout: 20 * time.Second, MaxRetries: -1})
	t.Cleanup(func() { _ = rc.Close() })
	logs := &testenv.LogSink{}
	tb := boardOn(t, rc, &Config{Name: "b", Logger: logs.Logger()})
	board := tb.board
	tb.submit(t, "ada", 10)
	tb.drain(t)

	pid := redisPID(t, rc)
	require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
	t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGCONT) })
	for _, policy := range []ReadPolicy{ServeStale, FallbackToPostgres, FailClosed} {
		for name, read := range map[string]func(ctx context.Context) error{
			"Top":    func(ctx context.Context) error { _, err := board.Top(ctx, 10, WithPolicy(policy)); return err },
			"Rank":   func(ctx context.Context) error { _, _, err := board.Rank(ctx, "ada", WithPolicy(policy)); return err },
			"Around": func(ctx context.Context) error { _, err := board.Around(ctx, "ada", 2, WithPolicy(policy)); return err },
		} {
			ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
			err := read(ctx)
			cancel()
			require.ErrorIs(t, err, context.DeadlineExceeded, "%s under %s", name, policy)
		}
	}
	// Not a Redis failure to fall back from: the caller gave up.
	require.Empty(t, logs.Lines(t, "leaderboard: Redis read failed; answering from PostgreSQL"))
}

// boardOn returns a board of cfg on client, migrated in a schema of the
// test's own (cfg.Schema is set to it) and closed at cleanup.
func boardOn(t *testing.T, client redis.UniversalClient, cfg *Config) *testBundle {
	t.Helper()
	pg := testenv.Postgres(t)
	cfg.Schema = pg.Schema
	require.NoError(t, Migrate(context.Background(), pg.Pool, cfg))
	board, err := New(pg.Pool, client, cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	return &testBundle{board: board, pg: pg}
}

// redisPID is the process id of the Redis server client talks to.
func redisPID(t *testing.T, client *redis.Client) int {
	t.Helper()
	info, err := client.InfoMap(context.Background(), "server").Result()
	require.NoError(t, err)
	pid, err := strconv.Atoi(info["Server"]["process_id"])
	require.NoError(t, err)
	return pid
}

// A pool whose connections answer a cancelled ctx with a cancel request
// (pgconn.CancelRequestContextWatcherHandler, a pgx option) gets
// PostgreSQL's query_canceled (57014), not ctx's error. A SubmitBatch or a
// read from PostgreSQL whose own ctx ended must still return an error that
// matches ctx's (ErrOutcomeUnknown's doc, ReadPolicy's): it returned the
// bare 57014, which callers and the reads metric took for a server fault.
func TestCallerEndedUnderCancelRequestWatcher(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	t.Run("Submit", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		tb.submit(t, "a", 1)
		board := cancelRequestBoard(t, tb, 0, nil)
		holdUserRow(t, tb, "a")
		var err error
		for _, n := range []int{0, 1, 100} { // 0: Submit
			cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
			cmds := make([]Command, max(n, 1))
			for i := range cmds {
				cmds[i] = Command{EventID: uuid.New(), UserID: "a", Delta: 1}
			}
			if n == 0 {
				_, err = board.Submit(cctx, cmds[0])
			} else {
				_, err = board.SubmitBatch(cctx, cmds)
			}
			cancel()
			require.ErrorIs(t, err, context.DeadlineExceeded, "%d commands: %v", n, err)
		}
	})

	// Grouping off: Submit runs its statement itself.
	t.Run("SubmitAlone", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		tb.submit(t, "a", 1)
		board := cancelRequestBoard(t, tb, 0, func(_ *pgxpool.Config, c *Config) { c.MaxSubmitsPerStatement = 1 })
		holdUserRow(t, tb, "a")
		cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		_, err := board.Submit(cctx, Command{EventID: uuid.New(), UserID: "a", Delta: 1})
		require.ErrorIs(t, err, context.DeadlineExceeded, "%v", err)
	})

	t.Run("ReadFromPostgres", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		tb.submit(t, "a", 1)
		board := cancelRequestBoard(t, tb, 0, func(_ *pgxpool.Config, c *Config) {
			c.LagProbeInterval, c.MaxLag = 10*time.Second, 20*time.Second
		})
		board.Freshness(ctx) // measured: the read below reuses it
		tx, err := tb.pg.Pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(ctx) })
		_, err = tx.Exec(ctx, `LOCK TABLE user_scores IN ACCESS EXCLUSIVE MODE`)
		require.NoError(t, err)
		cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		_, err = board.Top(cctx, 10, forcePostgres(), WithPolicy(FallbackToPostgres))
		require.ErrorIs(t, err, context.DeadlineExceeded, "%v", err)
	})
}

// A Submit whose ctx ended, and whose connection then broke before the
// cancel request went out (a pool with a CancelRequestDelay; the server
// terminated the backend: a restart, a failover), returns an error matching
// its ctx's, as ErrOutcomeUnknown's doc promises ("A call whose own context
// ended returns that context's error instead"), grouped or alone.
func TestCallerEndedThenConnectionBroke(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, per := range map[string]int{"Alone": 1, "Grouped": 0, "Batch": -1} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			tb := setup(t)
			tb.submit(t, "a", 1)
			app := "ended" + uuid.NewString()[:8]
			board := cancelRequestBoard(t, tb, 3*time.Second, func(pc *pgxpool.Config, c *Config) {
				pc.ConnConfig.RuntimeParams["application_name"] = app
				if per > 0 {
					c.MaxSubmitsPerStatement = per
				}
			})
			holdUserRow(t, tb, "a")
			var err error
			go func() {
				time.Sleep(700 * time.Millisecond) // the caller's ctx ended at 200 ms
				_, _ = tb.pg.Pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'`, app)
			}()
			cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
			defer cancel()
			if per < 0 {
				_, err = board.SubmitBatch(cctx, []Command{{EventID: uuid.New(), UserID: "a", Delta: 1}})
			} else {
				_, err = board.Submit(cctx, Command{EventID: uuid.New(), UserID: "a", Delta: 1})
			}
			require.ErrorIs(t, err, context.DeadlineExceeded, "%v", err)
		})
	}
}

// A Submit whose ctx ended once its statement was sent "may have
// committed" (Submit's doc): the commit can come well after the call
// returned, and after the outbox stayed empty for a while. Here the
// statement's backend is stopped before it reads the statement; pgx gives
// up, closes the connection and sends a cancel request, which the server
// ignores while the backend waits for a command; run again, the backend
// reads the statement and commits it. A retry with the same event id
// returns that commit's result.
func TestSubmitCancelledInFlightCommitsLater(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	cfg := tb.board.Config()
	pool := tb.newPool(t, func(pc *pgxpool.Config) { pc.MaxConns, pc.MinConns = 1, 1 })
	board, err := New(pool, tb.rd.Client, &cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	// Prepares the board's statements on the pool's one connection.
	_, err = board.Submit(ctx, Command{EventID: uuid.New(), UserID: "a", Delta: 1})
	require.NoError(t, err)
	worker, err := tb.board.Worker(nil)
	require.NoError(t, err)
	_, err = worker.Drain(ctx)
	require.NoError(t, err)

	var pid int
	require.NoError(t, pool.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Skipf("cannot stop the PostgreSQL backend (%v): run as root or as the server's user", err)
	}
	resumed := false
	resume := func() {
		if !resumed {
			resumed = true
			require.NoError(t, syscall.Kill(pid, syscall.SIGCONT))
		}
	}
	defer resume()
	cmd := Command{EventID: uuid.New(), UserID: "a", Delta: 1}
	// Long enough for the statement to be sent on a loaded machine: the
	// stopped backend cannot answer it however long the call waits.
	cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	_, err = board.Submit(cctx, cmd)
	cancel()
	require.ErrorIs(t, err, context.DeadlineExceeded)

	for range 5 {
		st, err := worker.Relay().Stats(ctx)
		require.NoError(t, err)
		require.Zero(t, st.Pending, "the backend is stopped: nothing can have committed")
		time.Sleep(20 * time.Millisecond)
	}
	resume()
	var version int64
	for deadline := time.Now().Add(10 * time.Second); version != 2 && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		require.NoError(t, tb.pg.Pool.QueryRow(ctx, `SELECT version FROM user_scores WHERE user_id = 'a'`).Scan(&version))
	}
	require.Equal(t, int64(2), version, "the cancelled Submit did not commit once its backend ran again")
	res, err := tb.board.Submit(ctx, cmd)
	require.NoError(t, err)
	require.True(t, res.Duplicate)
	require.Equal(t, int64(2), res.Version)
}

// cancelRequestBoard is a board like tb's over a new pool whose connections
// answer a cancelled ctx with a cancel request (a pgx option), sent after
// delay; mutate, if not nil, adjusts the pool's and the board's config.
func cancelRequestBoard(t *testing.T, tb *testBundle, delay time.Duration, mutate func(*pgxpool.Config, *Config)) *Board {
	t.Helper()
	cfg := tb.board.Config()
	pool := tb.newPool(t, func(pc *pgxpool.Config) {
		pc.ConnConfig.BuildContextWatcherHandler = func(c *pgconn.PgConn) ctxwatch.Handler {
			return &pgconn.CancelRequestContextWatcherHandler{Conn: c, CancelRequestDelay: delay, DeadlineDelay: 5 * time.Second}
		}
		if mutate != nil {
			mutate(pc, &cfg)
		}
	})
	board, err := New(pool, tb.rd.Client, &cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	return board
}

// holdUserRow locks user's row of user_scores in a transaction held until
// the test ends, so that a submit for user waits.
func holdUserRow(t *testing.T, tb *testBundle, user string) {
	t.Helper()
	ctx := context.Background()
	tx, err := tb.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(ctx) })
	_, err = tx.Exec(ctx, `UPDATE user_scores SET score = score WHERE user_id = $1`, user)
	require.NoError(t, err)
}

// TestUnverifiedWhilePostgresDown: with RequireVerifiedProjection, Redis
// loses the board's keys while PostgreSQL cannot be asked. Reads report the
// board unverified within LagProbeInterval, however slow (or down)
// PostgreSQL is: a failed lag probe skipped the look for Verify's record,
// and a ServeStale read served the empty board as verified.
func TestUnverifiedWhilePostgresDown(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	srv := testenv.StartPostgres(t)
	pool := srv.Pool(t)
	rd := testenv.Redis(t)
	cfg := &Config{Name: "b", KeyPrefix: rd.Prefix, ReadPolicy: ServeStale,
		RequireVerifiedProjection: true, LagProbeInterval: 10 * time.Millisecond}
	require.NoError(t, Migrate(ctx, pool, cfg))
	board, err := New(pool, rd.Client, cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	tb := &testBundle{board: board}
	tb.submit(t, "ada", 10)
	tb.drain(t)
	_, verified, err := board.Verify(ctx, nil)
	require.NoError(t, err)
	require.True(t, verified)
	r, err := board.Top(ctx, 10)
	require.NoError(t, err)
	require.False(t, r.Freshness.Unverified)
	require.Len(t, r.Entries, 1)

	// PostgreSQL goes down, then Redis loses every key of the board (a
	// restart without persistence).
	require.NoError(t, srv.Stop())
	keys, err := rd.Client.Keys(ctx, rd.Prefix+"*").Result()
	require.NoError(t, err)
	require.NotEmpty(t, keys)
	require.NoError(t, rd.Client.Del(ctx, keys...).Err())
	time.Sleep(50 * time.Millisecond) // several LagProbeIntervals

	r, err = board.Top(ctx, 10)
	require.NoError(t, err)
	require.Empty(t, r.Entries)
	require.Equal(t, time.Duration(-1), r.Freshness.Lag)
	require.True(t, r.Freshness.Unverified, "Redis holds no record of a Verify, yet the read says %+v", r.Freshness)
	require.True(t, board.Freshness(ctx).Unverified, "Board.Freshness")
	_, err = board.Top(ctx, 10, WithPolicy(FailClosed))
	var stale *StaleError
	require.ErrorAs(t, err, &stale)
	require.True(t, stale.Unverified, "FailClosed refusal: %v", err)
}

// TestFrozenRedisUnderRequireVerified: with RequireVerifiedProjection, a
// FailClosed read of a Redis that stopped answering (keys and Verify's
// record intact) is refused as unverified, the look for the record having
// failed, and its error says that Redis could not be read, not only that
// it lost the board's keys: Verify is not the fix, and once Redis answers
// the reads are verified again without it.
func TestFrozenRedisUnderRequireVerified(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rs := testenv.StartRedis(t)
	rc := redis.NewClient(&redis.Options{Addr: rs.Addr(), ReadTimeout: 300 * time.Millisecond, MaxRetries: -1})
	t.Cleanup(func() { _ = rc.Close() })
	cfg := &Config{Name: "b", ReadPolicy: FailClosed, RequireVerifiedProjection: true,
		LagProbeInterval: 5 * time.Millisecond}
	tb := boardOn(t, rc, cfg)
	board := tb.board
	tb.submit(t, "ada", 10)
	tb.drain(t)
	_, verified, err := board.Verify(ctx, nil)
	require.NoError(t, err)
	require.True(t, verified)
	_, _, err = board.Rank(ctx, "ada")
	require.NoError(t, err)

	pid := redisPID(t, rc)
	time.Sleep(2 * cfg.LagProbeInterval) // the last look is older than an interval
	require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
	t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGCONT) })
	_, _, err = board.Rank(ctx, "ada")
	require.NoError(t, syscall.Kill(pid, syscall.SIGCONT))
	var stale *StaleError
	require.ErrorAs(t, err, &stale)
	require.True(t, stale.Unverified, "%v", err)
	require.Contains(t, err.Error(), "Redis could not be read")

	require.Eventually(t, func() bool {
		e, f, err := board.Rank(ctx, "ada")
		return err == nil && !f.Unverified && e.Score == 10
	}, 5*time.Second, 10*time.Millisecond, "verified again without Verify: the record was never lost")
}
