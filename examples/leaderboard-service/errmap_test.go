package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
)

// A client that went away before a stale or unverified read was answered is
// answered (and counted) as 499, not 503: hang-ups must not feed the 5xx
// rate. The unverified case probes Redis first, and a client gone by then
// made that probe fail and fall through to a 503.
func TestClientGoneBeforeStaleAnswer(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	for name, err := range map[string]error{
		"Unverified": &leaderboard.StaleError{Lag: -1, Unverified: true},
		"Lagging":    &leaderboard.StaleError{Lag: time.Minute, MaxLag: time.Second},
	} {
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			req := httptest.NewRequestWithContext(ctx, http.MethodGet, "/leaderboard", nil)
			rec := httptest.NewRecorder()
			tb.svc.writeError(rec, req, err)
			require.Equal(t, statusClientClosedRequest, rec.Code, "%s", rec.Body)
		})
	}
}

// 'stats --require-verified' on a Redis Cluster down for the board's slot
// fails (exit 1), as the README promises for a Redis that cannot be
// reached, instead of saying Redis lost data and sending the operator to
// 'reconcile --verify': the nodes still answer PING, so the command reads
// the board's key to tell.
func TestStatsCommandClusterDown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testenv.Postgres(t)
	cluster := testenv.StartRedisCluster(t, 3, 0)
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs(), MaxRetries: -1})
	t.Cleanup(func() { _ = rdb.Close() })
	prefix := cluster.Prefix(t)
	cfg := &leaderboard.Config{Name: testBoard, Schema: pg.Schema, KeyPrefix: prefix, RequireVerifiedProjection: true}
	require.NoError(t, leaderboard.Migrate(ctx, pg.Pool, cfg))
	board, err := leaderboard.New(pg.Pool, rdb, cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	_, ok, err := board.Verify(ctx, nil)
	require.NoError(t, err)
	require.True(t, ok)

	addrs := cluster.Addrs()
	flags := []string{"stats", "--require-verified", "--redis-cluster",
		"--redis-url=redis://" + addrs[0] + "?addr=" + strings.Join(addrs[1:], "&addr="),
		"--database-url=" + pg.ConnString, "--schema=" + pg.Schema, "--key-prefix=" + prefix, "--board=" + testBoard}
	code, stdout, stderr := runCommand(t, flags...)
	require.Equal(t, exitOK, code, stderr)
	require.NotContains(t, stdout, "not verified")

	// Kill a master that does not hold the board's slot, and wait for the
	// cluster to go down for keys.
	boardNode, err := rdb.MasterForKey(ctx, board.SortedSetKey())
	require.NoError(t, err)
	victim := -1
	for i, addr := range addrs {
		if addr != boardNode.Options().Addr {
			victim = i
			break
		}
	}
	require.NotEqual(t, -1, victim)
	cluster.Kill(victim)
	node := redis.NewClient(&redis.Options{Addr: boardNode.Options().Addr})
	t.Cleanup(func() { _ = node.Close() })
	require.Eventually(t, func() bool {
		info, err := node.ClusterInfo(ctx).Result()
		return err == nil && strings.Contains(info, "cluster_state:fail")
	}, 30*time.Second, 50*time.Millisecond)

	for range 3 {
		code, stdout, stderr := runCommand(t, flags...)
		require.Equal(t, exitError, code, "stdout: %s\nstderr: %s", stdout, stderr)
		require.NotContains(t, stdout, "not verified")
	}
}
