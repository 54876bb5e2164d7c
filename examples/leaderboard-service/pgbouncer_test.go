package main

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// TestUnreachableBehindPgBouncer: the README runs the service behind
// PgBouncer in transaction mode and promises 503 with Retry-After when
// PostgreSQL cannot be reached. Behind PgBouncer that reaches the service
// as PgBouncer's own errors, SQLSTATE 08P01: "server conn crashed?" for a
// server connection that broke under a statement, query_wait_timeout for
// a statement that waited for a server that is down. They were answered
// 500, as faults.
func TestUnreachableBehindPgBouncer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	wantOutage := func(t *testing.T, err error) {
		t.Helper()
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr)
		require.Equal(t, "08P01", pgErr.Code, "%v", err)
		require.True(t, unreachable(err), "%v", err)
	}

	t.Run("ServerConnectionBroke", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		addr, database := testenv.ServerAddr(t, pg.ServerURL)
		drop := testenv.StartReplyDropper(t, addr)
		bouncer := testenv.StartPgBouncer(t, drop.Addr(), "transaction", 1)
		conn, err := pgx.Connect(ctx, bouncer.URL(database)+"&default_query_exec_mode=exec")
		require.NoError(t, err)
		defer conn.Close(ctx)
		require.NoError(t, conn.Ping(ctx)) // PgBouncer's server connection is made now
		drop.DropNextReply()
		_, err = conn.Exec(ctx, "SELECT 1")
		wantOutage(t, err)
	})

	t.Run("ServerDown", func(t *testing.T) {
		t.Parallel()
		srv := testenv.StartPostgres(t)
		addr, database := testenv.ServerAddr(t, srv.ConnString())
		bouncer := testenv.StartPgBouncer(t, addr, "transaction", 1, "query_wait_timeout = 1")
		conn, err := pgx.Connect(ctx, bouncer.URL(database)+"&default_query_exec_mode=exec")
		require.NoError(t, err)
		defer conn.Close(ctx)
		require.NoError(t, conn.Ping(ctx))
		require.NoError(t, srv.Stop())
		_, err = conn.Exec(ctx, "SELECT 1")
		wantOutage(t, err)
	})

	// PgBouncer relabels PostgreSQL's own refusal of a new connection
	// 08P01 too: a missing database is a fault to fix (500), not an
	// outage to wait out.
	t.Run("MissingDatabase", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		addr, _ := testenv.ServerAddr(t, pg.ServerURL)
		bouncer := testenv.StartPgBouncer(t, addr, "transaction", 1)
		conn, err := pgx.Connect(ctx, bouncer.URL("verity_no_such_database")+"&default_query_exec_mode=exec")
		if err == nil {
			defer conn.Close(ctx)
			_, err = conn.Exec(ctx, "SELECT 1")
		}
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr)
		require.Equal(t, "08P01", pgErr.Code, "%v", err)
		require.False(t, unreachable(err), "%v", err)
	})

	// While connecting, PgBouncer's own limit and its login timeout while
	// PostgreSQL is down are outages, as PostgreSQL's 53300 would be.
	t.Run("ClientLimit", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		addr, database := testenv.ServerAddr(t, pg.ServerURL)
		bouncer := testenv.StartPgBouncer(t, addr, "transaction", 1, "max_client_conn = 1")
		first, err := pgx.Connect(ctx, bouncer.URL(database)+"&default_query_exec_mode=exec")
		require.NoError(t, err)
		defer first.Close(ctx)
		_, err = pgx.Connect(ctx, bouncer.URL(database)+"&default_query_exec_mode=exec")
		wantOutage(t, err)
	})
	t.Run("LoginTimeoutServerDown", func(t *testing.T) {
		t.Parallel()
		srv := testenv.StartPostgres(t)
		addr, database := testenv.ServerAddr(t, srv.ConnString())
		require.NoError(t, srv.Stop())
		bouncer := testenv.StartPgBouncer(t, addr, "transaction", 1, "client_login_timeout = 1")
		_, err := pgx.Connect(ctx, bouncer.URL(database)+"&default_query_exec_mode=exec")
		wantOutage(t, err)
	})

	// PostgreSQL's own outages, relabelled 08P01 while connecting: here
	// its 57P03 during a smart shutdown.
	t.Run("ServerShuttingDown", func(t *testing.T) {
		t.Parallel()
		srv := testenv.StartPostgres(t)
		addr, database := testenv.ServerAddr(t, srv.ConnString())
		bouncer := testenv.StartPgBouncer(t, addr, "transaction", 1)
		smartShutdown(t, srv)
		conn, err := pgx.Connect(ctx, bouncer.URL(database)+"&default_query_exec_mode=exec")
		if err == nil {
			defer conn.Close(ctx)
			_, err = conn.Exec(ctx, "SELECT 1")
		}
		require.ErrorContains(t, err, "shutting down")
		wantOutage(t, err)
	})
}
