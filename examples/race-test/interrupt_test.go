package main

import (
	"bytes"
	"context"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// interruptOnCreate passes a connection through, and once the run's CREATE
// TABLE has been written cancels the run's context (Ctrl-C landing
// mid-statement), then waits pause. With slowCancel, pgx's CancelRequest
// (sent when it gives up on a connection) is held back 1.5 s, so that it
// arrives after the statement ended.
type interruptOnCreate struct {
	net.Conn
	once       *sync.Once
	cancel     context.CancelFunc
	pause      time.Duration
	slowCancel bool
}

func (c interruptOnCreate) Write(b []byte) (int, error) {
	if c.slowCancel && len(b) == 16 && bytes.Equal(b[:8], []byte{0, 0, 0, 16, 0x04, 0xd2, 0x16, 0x2e}) {
		time.Sleep(1500 * time.Millisecond)
	}
	n, err := c.Conn.Write(b)
	if err == nil && bytes.Contains(b, []byte("CREATE TABLE")) {
		c.once.Do(func() {
			c.cancel()
			time.Sleep(c.pause)
		})
	}
	return n, err
}

// runInterruptedOnCreate runs the naive mode through a pool on connString
// whose connections are conn (plain text, so that it sees the statement go
// by) and cancels the run's context as its CREATE TABLE goes out. The run
// must return the cancellation.
func runInterruptedOnCreate(t *testing.T, connString string, conn interruptOnCreate) {
	t.Helper()
	rd := testenv.Redis(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cfg, err := pgxpool.ParseConfig(connString)
	require.NoError(t, err)
	cfg.ConnConfig.TLSConfig = nil
	cfg.ConnConfig.Fallbacks = nil
	conn.once, conn.cancel = new(sync.Once), cancel
	dialer := &net.Dialer{}
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dialer.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		conn := conn
		conn.Conn = c
		return conn, nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	defer pool.Close()
	_, err = run(ctx, config{Readers: 1, Writers: 1, Duration: time.Second, Modes: []string{modeNaive}},
		deps{Pool: pool, Redis: rd.Client, Prefix: rd.Prefix})
	require.ErrorIs(t, err, context.Canceled)
}

// raceTables lists the race-test tables in schema.
func raceTables(t *testing.T, pool *pgxpool.Pool, schema string) []string {
	t.Helper()
	rows, err := pool.Query(context.Background(),
		`SELECT tablename FROM pg_tables WHERE tablename LIKE 'race_products_%' AND schemaname = $1`, schema)
	require.NoError(t, err)
	tables, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return tables
}

// README: each mode's table is "removed at the end, also on Ctrl-C or
// SIGTERM". An interrupt that lands while CREATE TABLE is in flight made
// runMode return before it registered the DROP: the table stayed.
func TestRunInterruptedDuringCreateTableLeavesNoTable(t *testing.T) {
	t.Parallel()
	pg := testenv.Postgres(t)
	runInterruptedOnCreate(t, pg.ConnString, interruptOnCreate{pause: 200 * time.Millisecond})
	require.Empty(t, raceTables(t, pg.Pool, pg.Schema), "the interrupted run left its table behind")
}

// README: each mode's table is "removed at the end, also on Ctrl-C or
// SIGTERM". pgx's default cancellation drops the connection at once, so the
// deferred DROP, on another connection, ran before the server had
// committed the CREATE TABLE it was still executing: DROP TABLE IF EXISTS
// found nothing, then the CREATE committed, and the table stayed. A slow
// CREATE (an event trigger on a private server) and a CancelRequest that
// arrives after it ended make the window certain.
func TestRunInterruptedWhileTheServerStillCreatesLeavesNoTable(t *testing.T) {
	t.Parallel()
	srv := testenv.StartPostgres(t)
	admin := srv.Pool(t)
	bg := context.Background()
	_, err := admin.Exec(bg, `CREATE FUNCTION slow_create() RETURNS event_trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_sleep(1);
END $$`)
	require.NoError(t, err)
	_, err = admin.Exec(bg, `CREATE EVENT TRIGGER slow_create ON ddl_command_end WHEN TAG IN ('CREATE TABLE') EXECUTE FUNCTION slow_create()`)
	require.NoError(t, err)

	runInterruptedOnCreate(t, srv.ConnString(), interruptOnCreate{slowCancel: true})
	time.Sleep(2 * time.Second) // the server ends the CREATE it was executing
	require.Empty(t, raceTables(t, admin, "public"), "the interrupted run left its table behind")
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
