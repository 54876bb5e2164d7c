package main

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
)

// A POST /scores that PostgreSQL could not take (the server down or
// read-only, or the session ended by an administrator before the command
// committed) is an outage to wait out: 503 with Retry-After, telling the client to retry
// with the same Idempotency-Key, never 500. The retry has exactly one
// effect, without restarting the service.
func TestSubmitDuringPostgresOutage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const body = `{"user_id":"ada","delta":7}`

	// setupPrivate runs the service over a private PostgreSQL, which the
	// test may stop, and returns it with a second pool for the test's own
	// statements.
	setupPrivate := func(t *testing.T) (*testBundle, *testenv.PostgresServer, *pgxpool.Pool) {
		t.Helper()
		ps := testenv.StartPostgres(t)
		pool := ps.Pool(t)
		rd := testenv.Redis(t)
		cfg := &leaderboard.Config{Name: testBoard, KeyPrefix: rd.Prefix}
		require.NoError(t, leaderboard.Migrate(ctx, pool, cfg))
		board, err := leaderboard.New(pool, rd.Client, cfg)
		require.NoError(t, err)
		svc, err := NewService(pool, rd.Client, board, ServiceConfig{})
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, svc.Close()) })
		tb := &testBundle{rd: rd, board: board, svc: svc, srv: newServer(t, svc)}
		require.Equal(t, 201, tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":1}`).status)
		return tb, ps, ps.Pool(t)
	}
	events := func(t *testing.T, db *pgxpool.Pool, key string) (n int) {
		t.Helper()
		require.NoError(t, db.QueryRow(ctx, `SELECT count(*) FROM score_events WHERE event_id = $1`, key).Scan(&n))
		return n
	}
	requireRetryAnswer := func(t *testing.T, r response) {
		t.Helper()
		require.Equal(t, 503, r.status, "%s", r.body)
		require.Equal(t, "1", r.header.Get("Retry-After"))
		require.Contains(t, string(r.body), "same Idempotency-Key")
	}
	retryOnce := func(t *testing.T, tb *testBundle, db *pgxpool.Pool, key string) {
		t.Helper()
		require.Equal(t, 201, tb.submit(t, key, body).status)
		require.Equal(t, 200, tb.submit(t, key, body).status)
		require.Equal(t, 1, events(t, db, key), "exactly one effect")
	}

	t.Run("SessionTerminatedBeforeCommit", func(t *testing.T) {
		t.Parallel()
		tb, _, admin := setupPrivate(t)
		// The submit waits on a lock the test holds, and is terminated
		// there (57P01): nothing committed.
		tx, err := admin.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(ctx) })
		_, err = tx.Exec(ctx, `LOCK TABLE verity_outbox IN ACCESS EXCLUSIVE MODE`)
		require.NoError(t, err)
		key := uuid.NewString()
		answer := make(chan response, 1)
		go func() {
			r, _ := tb.doWithin(t, 20*time.Second, "POST", "/scores", map[string]string{"Idempotency-Key": key}, body)
			answer <- r
		}()
		require.Eventually(t, func() bool {
			var n int
			err := admin.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
				WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() AND wait_event_type = 'Lock'`).Scan(&n)
			return err == nil && n > 0
		}, 10*time.Second, 10*time.Millisecond, "no submit waited on the lock")
		r := <-answer
		require.NoError(t, tx.Rollback(ctx))
		requireRetryAnswer(t, r)
		require.Zero(t, events(t, admin, key))
		retryOnce(t, tb, admin, key)
	})

	// A primary turned read-only (as in a switchover) refuses the write
	// with 25006.
	t.Run("ServerReadOnly", func(t *testing.T) {
		t.Parallel()
		tb, _, admin := setupPrivate(t)
		setReadOnly(t, admin, tb.svc.pool, true)
		key := uuid.NewString()
		r := tb.submit(t, key, body)
		setReadOnly(t, admin, tb.svc.pool, false)
		requireRetryAnswer(t, r)
		require.Zero(t, events(t, admin, key))
		retryOnce(t, tb, admin, key)
	})

	t.Run("ServerDown", func(t *testing.T) {
		t.Parallel()
		tb, ps, admin := setupPrivate(t)
		require.NoError(t, ps.Stop())
		key := uuid.NewString()
		r := tb.submit(t, key, body)
		require.NoError(t, ps.Start())
		requireRetryAnswer(t, r)
		require.Zero(t, events(t, admin, key))
		retryOnce(t, tb, admin, key)
	})
}

// setReadOnly turns the server's default_transaction_read_only on or off
// (ALTER SYSTEM, then a reload) and waits until every idle connection of
// both pools shows it. The admin's SHOW alone proves nothing about the
// service's connection: the postmaster signals its backends one by one,
// and each applies the reload only at its next command, so under load the
// service's submit could still run with the old value.
func setReadOnly(t *testing.T, admin, service *pgxpool.Pool, on bool) {
	t.Helper()
	ctx := context.Background()
	stmt := `ALTER SYSTEM SET default_transaction_read_only = on`
	if !on {
		stmt = `ALTER SYSTEM RESET default_transaction_read_only`
	}
	_, err := admin.Exec(ctx, stmt)
	require.NoError(t, err)
	_, err = admin.Exec(ctx, `SELECT pg_reload_conf()`)
	require.NoError(t, err)
	want := map[bool]string{true: "on", false: "off"}[on]
	// A connection opened later forks from the postmaster, which reloaded
	// before signalling anyone: only the idle ones need asking.
	seen := func(p *pgxpool.Pool) bool {
		ok := true
		for _, c := range p.AcquireAllIdle(ctx) {
			var got string
			ok = ok && c.QueryRow(ctx, `SHOW default_transaction_read_only`).Scan(&got) == nil && got == want
			c.Release()
		}
		return ok
	}
	require.Eventually(t, func() bool {
		var got string
		return admin.QueryRow(ctx, `SHOW default_transaction_read_only`).Scan(&got) == nil && got == want && seen(service)
	}, 10*time.Second, 10*time.Millisecond)
}
