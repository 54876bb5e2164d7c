package main

import (
	"bytes"
	"context"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// cancelOnCreate passes a connection through, and once the run's CREATE TABLE
// has been sent, cancels the run's context (Ctrl-C landing mid-statement) and
// gives the server a moment to finish the statement.
type cancelOnCreate struct {
	net.Conn
	once   *sync.Once
	cancel context.CancelFunc
}

func (c cancelOnCreate) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	if err == nil && bytes.Contains(b, []byte("CREATE TABLE")) {
		c.once.Do(func() {
			c.cancel()
			time.Sleep(200 * time.Millisecond)
		})
	}
	return n, err
}

// README: each mode's table is "removed at the end, also on Ctrl-C or
// SIGTERM". An interrupt that lands while CREATE TABLE is in flight made
// runMode return before it registered the DROP: the table stayed.
func TestRunInterruptedDuringCreateTableLeavesNoTable(t *testing.T) {
	t.Parallel()
	pg := testenv.Postgres(t)
	rd := testenv.Redis(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cfg, err := pgxpool.ParseConfig(pg.ConnString)
	require.NoError(t, err)
	// Plain text, so that the wrapper can see the statement go by.
	cfg.ConnConfig.TLSConfig = nil
	cfg.ConnConfig.Fallbacks = nil
	once := new(sync.Once)
	dialer := &net.Dialer{}
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dialer.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return cancelOnCreate{Conn: c, once: once, cancel: cancel}, nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	defer pool.Close()

	_, err = run(ctx, config{Readers: 1, Writers: 1, Duration: time.Second, Modes: []string{modeNaive}},
		deps{Pool: pool, Redis: rd.Client, Prefix: rd.Prefix})
	require.ErrorIs(t, err, context.Canceled)

	var tables []string
	rows, err := pg.Pool.Query(context.Background(),
		`SELECT tablename FROM pg_tables WHERE tablename LIKE 'race_products_%' AND schemaname = $1`, pg.Schema)
	require.NoError(t, err)
	for rows.Next() {
		var n string
		require.NoError(t, rows.Scan(&n))
		tables = append(tables, n)
	}
	require.NoError(t, rows.Err())
	require.Empty(t, tables, "the interrupted run left its table behind")
}

// README: a usage error is "--seconds outside (0, 604800]". 1e-10 is inside,
// yet it was refused with "--seconds must be above 0". With --mode=bogus as
// the only bad flag, the error must name --mode (no run starts either way).
func TestTinySecondsIsNotAUsageError(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	err := mainErr([]string{"--seconds=1e-10", "--mode=bogus"}, &out)
	require.ErrorAs(t, err, new(usageError))
	require.True(t, strings.Contains(err.Error(), "--mode"), "refused a --seconds inside (0, 604800]: %v", err)
}

// cancelAfterCreateSent cancels the run's context as soon as CREATE TABLE
// has been written, without waiting for the server: Ctrl-C landing while the
// server is still executing the statement.
type cancelAfterCreateSent struct {
	net.Conn
	once   *sync.Once
	cancel context.CancelFunc
}

func (c cancelAfterCreateSent) Write(b []byte) (int, error) {
	// pgx's CancelRequest (sent when it gives up on a connection) takes its
	// time to arrive: the statement ends first.
	if len(b) == 16 && bytes.Equal(b[:8], []byte{0, 0, 0, 16, 0x04, 0xd2, 0x16, 0x2e}) {
		time.Sleep(1500 * time.Millisecond)
	}
	n, err := c.Conn.Write(b)
	if err == nil && bytes.Contains(b, []byte("CREATE TABLE")) {
		c.once.Do(c.cancel)
	}
	return n, err
}

// README: each mode's table is "removed at the end, also on Ctrl-C or
// SIGTERM". pgx's default cancellation drops the connection at once, so the
// deferred DROP, on another connection, ran before the server had
// committed the CREATE TABLE it was still executing: DROP TABLE IF EXISTS
// found nothing, then the CREATE committed, and the table stayed. A slow CREATE (an
// event trigger sleeping in this test's schema only) and a CancelRequest
// that arrives after it ended (delayed here) make the window certain.
func TestRunInterruptedWhileTheServerStillCreatesLeavesNoTable(t *testing.T) {
	t.Parallel()
	// A private server: the event trigger slows every CREATE TABLE of its
	// database.
	srv := testenv.StartPostgres(t)
	admin := srv.Pool(t)
	rd := testenv.Redis(t)
	bg := context.Background()
	_, err := admin.Exec(bg, `CREATE FUNCTION slow_create() RETURNS event_trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_sleep(1);
END $$`)
	require.NoError(t, err)
	_, err = admin.Exec(bg, `CREATE EVENT TRIGGER slow_create ON ddl_command_end WHEN TAG IN ('CREATE TABLE') EXECUTE FUNCTION slow_create()`)
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(bg)
	defer cancel()
	cfg, err := pgxpool.ParseConfig(srv.ConnString())
	require.NoError(t, err)
	cfg.ConnConfig.TLSConfig = nil
	cfg.ConnConfig.Fallbacks = nil
	once := new(sync.Once)
	dialer := &net.Dialer{}
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dialer.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return cancelAfterCreateSent{Conn: c, once: once, cancel: cancel}, nil
	}
	pool, err := pgxpool.NewWithConfig(bg, cfg)
	require.NoError(t, err)
	defer pool.Close()

	_, err = run(ctx, config{Readers: 1, Writers: 1, Duration: time.Second, Modes: []string{modeNaive}},
		deps{Pool: pool, Redis: rd.Client, Prefix: rd.Prefix})
	require.ErrorIs(t, err, context.Canceled)

	time.Sleep(2 * time.Second) // the server ends the CREATE it was executing
	var tables []string
	rows, err := admin.Query(bg, `SELECT tablename FROM pg_tables WHERE tablename LIKE 'race_products_%'`)
	require.NoError(t, err)
	for rows.Next() {
		var n string
		require.NoError(t, rows.Scan(&n))
		tables = append(tables, n)
	}
	require.NoError(t, rows.Err())
	require.Empty(t, tables, "the interrupted run left its table behind")
}
