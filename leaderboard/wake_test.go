package leaderboard

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/outbox"
)

// TestWakeUp checks that every write path wakes a running worker: with a
// one-minute poll, only a NOTIFY can make the change visible in time.
// Submit and SubmitBatch notify through the board's Notifier after their
// statement; SubmitTx and SubmitBatchTx notify inside the caller's
// transaction.
func TestWakeUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	writers := map[string]func(t *testing.T, tb *testBundle, user string) Result{
		"Submit": func(t *testing.T, tb *testBundle, user string) Result {
			res, err := tb.board.Submit(ctx, Command{EventID: uuid.New(), UserID: user, Delta: 10})
			require.NoError(t, err)
			return res
		},
		"SubmitBatch": func(t *testing.T, tb *testBundle, user string) Result {
			out, err := tb.board.SubmitBatch(ctx, []Command{
				{EventID: uuid.New(), UserID: user, Delta: 4},
				{EventID: uuid.New(), UserID: user, Delta: 6},
			})
			require.NoError(t, err)
			return out[1]
		},
		"SubmitTx": func(t *testing.T, tb *testBundle, user string) Result {
			tx, err := tb.pg.Pool.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
			res, err := tb.board.SubmitTx(ctx, tx, Command{EventID: uuid.New(), UserID: user, Delta: 10})
			require.NoError(t, err)
			require.NoError(t, tx.Commit(ctx))
			return res
		},
		"SubmitBatchTx": func(t *testing.T, tb *testBundle, user string) Result {
			tx, err := tb.pg.Pool.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
			out, err := tb.board.SubmitBatchTx(ctx, tx, []Command{
				{EventID: uuid.New(), UserID: user, Delta: 4},
				{EventID: uuid.New(), UserID: user, Delta: 6},
			})
			require.NoError(t, err)
			require.NoError(t, tx.Commit(ctx))
			return out[1]
		},
	}
	for name, write := range writers {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			tb := setup(t, func(c *Config) {
				c.ReadPolicy = FailClosed
				c.ReadYourWritesTimeout = 10 * time.Second
			})
			worker, err := tb.board.Worker(&WorkerConfig{Relay: &outbox.RelayConfig{PollInterval: time.Minute}})
			require.NoError(t, err)
			runCtx, stop := context.WithCancel(ctx)
			done := make(chan error, 1)
			go func() { done <- worker.Run(runCtx) }()
			defer func() {
				stop()
				require.NoError(t, <-done)
			}()

			// Twice: the second write comes after the notifier's goroutine
			// went idle and exited, so it must start a new one.
			for round, user := range []string{"user-a", "user-b"} {
				if round > 0 {
					time.Sleep(2 * outbox.NotifierIdleTimeoutDefault)
				}
				res := write(t, tb, user)
				e, fr, err := tb.board.Rank(ctx, user, AtLeast(user, res.Version))
				require.NoError(t, err)
				require.Equal(t, SourceRedis, fr.Source)
				require.Equal(t, int64(10), e.Score)
			}
		})
	}

	// Boards of one schema share the outbox table and its channel. Every
	// write path names its board's stream in the notification, so the
	// Workers of other boards stay asleep: each wake-up would be a claim
	// transaction, and with a Worker per board one write would make every
	// Worker claim.
	t.Run("OtherBoardsWorkersStayAsleep", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		var acquired atomic.Int64 // the other boards' pool: a claim pass takes at least one
		pool := tb.newPool(t, func(pc *pgxpool.Config) {
			pc.PrepareConn = func(context.Context, *pgx.Conn) (bool, error) {
				acquired.Add(1)
				return true, nil
			}
		})
		runCtx, stop := context.WithCancel(ctx)
		var running sync.WaitGroup
		t.Cleanup(func() { stop(); running.Wait() })
		run := func(b *Board) {
			w, err := b.Worker(&WorkerConfig{Relay: &outbox.RelayConfig{PollInterval: time.Hour}})
			require.NoError(t, err)
			running.Go(func() { _ = w.Run(runCtx) })
		}
		run(tb.board)
		const others = 3
		for i := range others {
			cfg := tb.board.Config()
			cfg.Name = fmt.Sprintf("other-%d", i)
			b, err := New(pool, tb.rd.Client, &cfg)
			require.NoError(t, err)
			t.Cleanup(b.Close)
			run(b)
		}
		require.Eventually(t, func() bool {
			var n int
			err := tb.pg.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN %' AND state = 'idle'
				AND query LIKE '%' || $1 || '%'`, tb.board.channel).Scan(&n)
			return err == nil && n == others+1
		}, 10*time.Second, 10*time.Millisecond, "every Worker listens")
		quiet := func() int64 { // the startup passes are over
			for {
				before := acquired.Load()
				time.Sleep(200 * time.Millisecond)
				if n := acquired.Load(); n == before {
					return n
				}
			}
		}
		before := quiet()
		for i := range 10 {
			user := fmt.Sprint("user-", i)
			for _, write := range writers {
				write(t, tb, user)
			}
			time.Sleep(5 * time.Millisecond)
		}
		require.LessOrEqual(t, quiet()-before, int64(others), "40 writes on one board woke the other boards' Workers")
	})

	t.Run("CloseStopsOnlyWakeUps", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		tb.board.Close()
		tb.board.Close() // idempotent
		res := tb.submit(t, "user-a", 3)
		require.Equal(t, int64(3), res.Score)
		tb.drain(t) // the rows are there for a relay to find
		e, fr, err := tb.board.Rank(ctx, "user-a")
		require.NoError(t, err)
		require.Equal(t, SourceRedis, fr.Source)
		require.Equal(t, int64(3), e.Score)
	})
}

// TestWorkersShareAListener: the Workers of many boards in one process can
// share one LISTEN connection (WorkerConfig.Relay.Listener), and each is
// still woken for its own board's writes, made at the same moment.
func TestWorkersShareAListener(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("OneConnectionForEveryBoard", func(t *testing.T) {
		t.Parallel()
		readOwnWrites := func(c *Config) {
			c.ReadPolicy = FailClosed
			c.ReadYourWritesTimeout = 10 * time.Second
		}
		tb := setup(t, readOwnWrites)
		listener, err := outbox.NewListener(tb.pg.Pool, &outbox.ListenerConfig{Schema: tb.board.Config().Schema, Table: OutboxTableDefault})
		require.NoError(t, err)
		boards := []*Board{tb.board}
		for i := range 5 {
			cfg := tb.board.Config()
			cfg.Name = fmt.Sprintf("other-%d", i)
			b, err := New(tb.pg.Pool, tb.rd.Client, &cfg)
			require.NoError(t, err)
			t.Cleanup(b.Close)
			boards = append(boards, b)
		}
		runCtx, stop := context.WithCancel(ctx)
		var running sync.WaitGroup
		t.Cleanup(func() { stop(); running.Wait() })
		for _, b := range boards {
			w, err := b.Worker(&WorkerConfig{Relay: &outbox.RelayConfig{PollInterval: time.Hour, Listener: listener}})
			require.NoError(t, err)
			running.Go(func() { assertNoError(t, w.Run(runCtx)) })
		}
		listening := func() int {
			var n int
			require.NoError(t, tb.pg.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE query = $1`,
				`LISTEN "`+tb.board.channel+`"`).Scan(&n))
			return n
		}
		require.Eventually(t, func() bool { return listening() == 1 }, 10*time.Second, 10*time.Millisecond, "the Workers listen")
		time.Sleep(200 * time.Millisecond) // the Workers' first claims are over
		require.Equal(t, 1, listening(), "Workers sharing a Listener hold one LISTEN connection")

		// A write on every board at once: the Workers claim together.
		var wg sync.WaitGroup
		for _, b := range boards {
			wg.Go(func() {
				res, err := b.Submit(ctx, Command{EventID: uuid.New(), UserID: "u", Delta: 7})
				if !assertNoError(t, err) {
					return
				}
				e, fr, err := b.Rank(ctx, "u", AtLeast("u", res.Version))
				if assertNoError(t, err) && (fr.Source != SourceRedis || e.Score != 7) {
					t.Errorf("board %s: %+v from %v, want 7 from Redis", b.Config().Name, e, fr.Source)
				}
			})
		}
		wg.Wait()
	})

	t.Run("ListenerOfAnotherTableRefused", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		other, err := outbox.NewListener(tb.pg.Pool, &outbox.ListenerConfig{Schema: tb.board.Config().Schema, Table: "other_outbox"})
		require.NoError(t, err)
		_, err = tb.board.Worker(&WorkerConfig{Relay: &outbox.RelayConfig{Listener: other}})
		var cerr *ConfigError
		require.ErrorAs(t, err, &cerr)
		require.Equal(t, "WorkerConfig.Relay.Listener", cerr.Field)
		require.ErrorIs(t, err, ErrInvalidConfig)
	})
}

// assertNoError reports err as a test failure, from any goroutine, and
// whether there was none.
func assertNoError(t *testing.T, err error) bool {
	t.Helper()
	if err != nil {
		t.Error(err)
		return false
	}
	return true
}
