package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
)

// mainEnv, set to 1, makes the test binary run main() instead of the tests,
// so a test can start the real program as a subprocess and signal it.
const mainEnv = "LEADERBOARD_SERVICE_RUN_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(mainEnv) == "1" {
		main()
		return
	}
	testenv.Main(m)
}

const testBoard = "weekly-2026-48"

type testBundle struct {
	pg    *testenv.PG
	rd    *testenv.RD
	board *leaderboard.Board
	svc   *Service
	srv   *httptest.Server
}

// setup returns a migrated board in the test's own schema and key prefix, a
// Service over it (not running: tests drive its worker with Drain), and an
// httptest server with its handler.
func setup(t *testing.T, mutate ...func(*leaderboard.Config)) *testBundle {
	t.Helper()
	pg := testenv.Postgres(t)
	rd := testenv.Redis(t)
	cfg := &leaderboard.Config{Name: testBoard, Schema: pg.Schema, KeyPrefix: rd.Prefix}
	for _, m := range mutate {
		m(cfg)
	}
	require.NoError(t, leaderboard.Migrate(context.Background(), pg.Pool, cfg))
	board, err := leaderboard.New(pg.Pool, rd.Client, cfg)
	require.NoError(t, err)
	svc, err := NewService(pg.Pool, rd.Client, board, ServiceConfig{ReconcileEvery: 0})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, svc.Close()) })
	return &testBundle{pg: pg, rd: rd, board: board, svc: svc, srv: newServer(t, svc)}
}

// newServer serves svc's handler on a loopback port until the test ends.
func newServer(t *testing.T, svc *Service) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(svc.Handler())
	t.Cleanup(srv.Close)
	return srv
}

// opsFlags are the flags that point a subcommand at the bundle's board.
func (tb *testBundle) opsFlags() []string {
	return []string{
		"--database-url=" + tb.pg.ConnString, "--redis-url=" + tb.rd.URL,
		"--schema=" + tb.pg.Schema, "--key-prefix=" + tb.rd.Prefix, "--board=" + testBoard,
	}
}

// drain projects everything pending into Redis.
func (tb *testBundle) drain(t *testing.T) {
	t.Helper()
	_, err := tb.svc.worker.Drain(context.Background())
	require.NoError(t, err)
}

// response is an HTTP answer with its body read.
type response struct {
	status int
	header http.Header
	body   []byte
}

// json decodes the body into a generic map.
func (r response) json(t *testing.T) map[string]any {
	t.Helper()
	var m map[string]any
	require.NoError(t, json.Unmarshal(r.body, &m), "body: %s", r.body)
	return m
}

func (tb *testBundle) do(t *testing.T, method, path string, header map[string]string, body string) response {
	t.Helper()
	var rdr io.Reader
	if body != "" {
		rdr = bytes.NewBufferString(body)
	}
	req, err := http.NewRequestWithContext(t.Context(), method, tb.srv.URL+path, rdr)
	require.NoError(t, err)
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := tb.srv.Client().Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return response{status: resp.StatusCode, header: resp.Header, body: b}
}

// submit posts a score with the given Idempotency-Key.
func (tb *testBundle) submit(t *testing.T, key, body string) response {
	t.Helper()
	h := map[string]string{"Content-Type": "application/json"}
	if key != "" {
		h["Idempotency-Key"] = key
	}
	return tb.do(t, http.MethodPost, "/scores", h, body)
}

// counts returns the number of score events and outbox rows.
func (tb *testBundle) counts(t *testing.T) (events, queued int) {
	t.Helper()
	require.NoError(t, tb.pg.Pool.QueryRow(context.Background(),
		`SELECT (SELECT count(*) FROM score_events), (SELECT count(*) FROM verity_outbox)`).Scan(&events, &queued))
	return events, queued
}

// withService returns a copy of the bundle whose svc and srv are a second
// Service over the same board, built with cfg.
func (tb *testBundle) withService(t *testing.T, cfg ServiceConfig) *testBundle {
	t.Helper()
	svc, err := NewService(tb.pg.Pool, tb.rd.Client, tb.board, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, svc.Close()) })
	out := *tb
	out.svc, out.srv = svc, newServer(t, svc)
	return &out
}

// lockOutbox holds an ACCESS EXCLUSIVE lock on the bundle's outbox table
// until the returned function (also run at cleanup) releases it: every
// submit and every Stats read then waits, as during a PostgreSQL stall.
func (tb *testBundle) lockOutbox(t *testing.T) (release func()) {
	t.Helper()
	tx, err := tb.pg.Pool.Begin(context.Background())
	require.NoError(t, err)
	_, err = tx.Exec(context.Background(), `LOCK TABLE verity_outbox IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	var once sync.Once
	release = func() { once.Do(func() { _ = tx.Rollback(context.Background()) }) }
	t.Cleanup(release)
	return release
}

// lockWaiters counts the sessions waiting for a lock on table, a table of
// the bundle's schema.
func (tb *testBundle) lockWaiters(t *testing.T, table string) int {
	t.Helper()
	var n int
	require.NoError(t, tb.pg.Pool.QueryRow(context.Background(),
		`SELECT count(*) FROM pg_locks WHERE relation = $1::regclass AND NOT granted`, table).Scan(&n))
	return n
}

// doWithin is do with its own deadline, for requests that might hang: a
// request still unanswered after d fails the test instead of blocking it.
func (tb *testBundle) doWithin(t *testing.T, d time.Duration, method, path string, header map[string]string, body string) (response, time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), d)
	defer cancel()
	var rdr io.Reader
	if body != "" {
		rdr = bytes.NewBufferString(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, tb.srv.URL+path, rdr)
	require.NoError(t, err)
	for k, v := range header {
		req.Header.Set(k, v)
	}
	start := time.Now()
	resp, err := tb.srv.Client().Do(req)
	require.NoError(t, err, "%s %s: no answer within %v", method, path, d)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return response{status: resp.StatusCode, header: resp.Header, body: b}, time.Since(start)
}

// boardWithoutDatabase returns a board whose pool points at a database that
// does not exist, on the test server, so that every PostgreSQL call fails
// with pgx's connect error — which names the database (returned), the user
// and the host; the database name stands in for all of them.
func boardWithoutDatabase(t *testing.T) (*pgxpool.Pool, redis.UniversalClient, *leaderboard.Board, string) {
	t.Helper()
	pg := testenv.Postgres(t)
	rd := testenv.Redis(t)
	database := "verity_no_such_db_" + strings.ReplaceAll(uuid.NewString(), "-", "")
	pcfg, err := pgxpool.ParseConfig(pg.ServerURL)
	require.NoError(t, err)
	pcfg.ConnConfig.Database = database
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	board, err := leaderboard.New(pool, rd.Client, &leaderboard.Config{Name: testBoard, KeyPrefix: rd.Prefix})
	require.NoError(t, err)
	return pool, rd.Client, board, database
}
