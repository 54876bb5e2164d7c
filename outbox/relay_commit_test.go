package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
)

// singleConnPool opens a pool of exactly one connection, so that every
// statement of a test runs on the connection the relay used.
func singleConnPool(t *testing.T, connString string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(connString)
	require.NoError(t, err)
	cfg.MaxConns, cfg.MinConns = 1, 0
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// drain runs r.RunOnce until it finds nothing due and returns the number of
// batches that claimed rows.
func drain(t *testing.T, r *outbox.Relay) int {
	t.Helper()
	batches := 0
	for {
		n, err := r.RunOnce(context.Background())
		require.NoError(t, err)
		if n == 0 {
			return batches
		}
		batches++
	}
}

func TestRelayBookkeepingCommit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// Every part of the claim and settle statements runs (ack, retry,
	// dead letter) on a one-connection pool; afterwards the connection's
	// synchronous_commit is what it was, outside and inside a transaction.
	t.Run("SettingDoesNotLeakIntoPool", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		pool := singleConnPool(t, b.pg.ConnString)
		show := func() string {
			var v string
			require.NoError(t, pool.QueryRow(ctx, `SHOW synchronous_commit`).Scan(&v))
			return v
		}
		before := show()
		require.NotEqual(t, "off", before, "the test needs a server whose default is not off")

		b.appendCommitted(t, newMessage("s", "ok", 1), newMessage("s", "retry", 1), newMessage("s", "dead", 1))
		failures := map[string]int{}
		h := &recorder{fail: func(rec outbox.Record) error {
			switch rec.Key {
			case "dead":
				return errors.New("always fails")
			case "retry":
				if failures[rec.Key]++; failures[rec.Key] == 1 {
					return errors.New("fails once")
				}
			}
			return nil
		}}
		r := b.relay(t, pool, h, outbox.RelayConfig{MaxAttempts: 2, RetryBackoffMin: 1, RetryBackoffMax: 1})
		require.False(t, r.Config().DurableBookkeeping, "non-durable bookkeeping is the default")

		for range 3 { // claim+settle; retries are due again after 1ns
			drain(t, r)
		}
		require.Equal(t, before, show(), "synchronous_commit leaked into the pooled connection")
		var inTx string
		require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			return tx.QueryRow(ctx, `SHOW synchronous_commit`).Scan(&inTx)
		}))
		require.Equal(t, before, inTx)

		require.Zero(t, b.count(t, b.writer.Table()), "ok and retry acknowledged, dead buried")
		dead, err := r.DeadLetters(ctx, 0, 10)
		require.NoError(t, err)
		require.Len(t, dead, 1)
		require.Equal(t, "dead", dead[0].Key)
		require.Len(t, h.seen(), 5, "ok once, retry twice, dead twice")
	})

	// On a private server (nobody else writes WAL there) the relay's
	// commits write WAL at every commit when durable, and leave it to the
	// WAL writer otherwise. The private server runs with fsync off, so the
	// figure compared is pg_stat_wal.wal_write (write() calls), which a
	// synchronous commit makes as its flush request; it would be wal_sync
	// with fsync on.
	t.Run("CommitsAsynchronouslyUnlessDurable", func(t *testing.T) {
		t.Parallel()
		srv := testenv.StartPostgres(t)
		pool := singleConnPool(t, srv.ConnString())
		cfg := &outbox.Config{Schema: "bookkeeping"}
		require.NoError(t, outbox.Migrate(ctx, pool, cfg))
		w, err := outbox.NewWriter(cfg)
		require.NoError(t, err)

		// walWrites reads the server's WAL write count after forcing this
		// backend's pending statistics out (they are flushed when it next
		// goes idle, i.e. after the first statement).
		walWrites := func() int64 {
			_, err := pool.Exec(ctx, `SELECT pg_stat_force_next_flush()`)
			require.NoError(t, err)
			var n int64
			require.NoError(t, pool.QueryRow(ctx, `SELECT wal_write FROM pg_stat_wal`).Scan(&n))
			return n
		}
		const rows = 200
		writes := func(durable bool) (commits, walWritten int64) {
			msgs := make([]outbox.Message, rows)
			for i := range msgs {
				msgs[i] = newMessage("s", fmt.Sprint("k", i), 1)
			}
			require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return w.Append(ctx, tx, msgs...) }))
			r, err := outbox.NewRelay(pool, &recorder{}, &outbox.RelayConfig{Schema: cfg.Schema, BatchSize: 1, DurableBookkeeping: durable})
			require.NoError(t, err)
			start := walWrites()
			batches := drain(t, r)
			require.Equal(t, rows, batches)
			return int64(2 * batches), walWrites() - start
		}
		commits, durableWrites := writes(true)
		require.GreaterOrEqual(t, durableWrites, commits/2, "durable commits should each write WAL")
		commits, asyncWrites := writes(false)
		require.Less(t, asyncWrites, commits/4, "asynchronous commits should leave WAL writes to the WAL writer (durable: %d)", durableWrites)
		t.Logf("%d commits: %d WAL writes durable, %d asynchronous", commits, durableWrites, asyncWrites)
	})
}
