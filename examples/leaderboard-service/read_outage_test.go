package main

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
)

// TestFailClosedReadsWithPostgresDown: under fail-closed, a read while
// PostgreSQL is down cannot measure the lag (StaleError.Lag -1). It is an
// outage of the store, as /healthz and the fallback-to-postgres reads of
// the same moment say, not a projection "catching up": nothing can catch
// up while the relay cannot reach PostgreSQL either.
func TestFailClosedReadsWithPostgresDown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	ps := testenv.StartPostgres(t)
	pool := ps.Pool(t)
	rd := testenv.Redis(t)
	cfg := &leaderboard.Config{Name: testBoard, KeyPrefix: rd.Prefix, ReadPolicy: leaderboard.FailClosed}
	require.NoError(t, leaderboard.Migrate(ctx, pool, cfg))
	board, err := leaderboard.New(pool, rd.Client, cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	svc, err := NewService(pool, rd.Client, board, ServiceConfig{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = svc.Close() })
	tb := &testBundle{rd: rd, board: board, svc: svc, srv: newServer(t, svc)}
	require.Equal(t, http.StatusCreated, tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":1}`).status)
	tb.drain(t)
	require.Equal(t, http.StatusOK, tb.do(t, http.MethodGet, "/leaderboard", nil, "").status)

	require.NoError(t, ps.Stop())
	require.Contains(t, string(tb.do(t, http.MethodGet, "/healthz", nil, "").body), `"postgres":"unavailable"`)
	// Past the lag probe interval: until then a read reuses the lag the
	// read before the stop measured, and is answered.
	time.Sleep(2 * leaderboard.LagProbeIntervalDefault)
	for _, path := range []string{"/leaderboard", "/users/ada/rank", "/users/ada/rank?at_least=1"} {
		r, _ := tb.doWithin(t, 15*time.Second, http.MethodGet, path, nil, "")
		require.Equal(t, http.StatusServiceUnavailable, r.status, "%s: %s", path, r.body)
		require.Equal(t, "1", r.header.Get("Retry-After"), path)
		require.JSONEq(t, `{"error":"the leaderboard's store cannot be reached; retry shortly"}`, string(r.body), path)
	}
}
