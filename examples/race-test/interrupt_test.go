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
