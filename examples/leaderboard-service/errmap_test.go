package main

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
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

// A read-your-writes read while the board's slot is being moved, half its
// keys on each master: through a cluster client that reads from replicas
// (a cluster URL with read_only=true), the board's version poll is pinned
// to masters and fails with the redirect itself, MOVED or ASK, where a
// plain cluster client's fails with TRYAGAIN. Either is a slot being
// moved, an outage to wait out: 503 with Retry-After, not a 500.
func TestReadDuringSlotMigrationIs503(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 1)
	for name, client := range map[string]func(testing.TB) *redis.ClusterClient{
		"PlainClient":  cluster.Client,
		"ReplicaReads": cluster.ReadOnlyClient,
	} {
		t.Run(name, func(t *testing.T) {
			rdb := client(t)
			pg := testenv.Postgres(t)
			cfg := &leaderboard.Config{Name: testBoard, Schema: pg.Schema, KeyPrefix: cluster.Prefix(t), ReadPolicy: leaderboard.ServeStale}
			require.NoError(t, leaderboard.Migrate(ctx, pg.Pool, cfg))
			board, err := leaderboard.New(pg.Pool, rdb, cfg)
			require.NoError(t, err)
			t.Cleanup(board.Close)
			svc, err := NewService(pg.Pool, rdb, board, ServiceConfig{})
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, svc.Close()) })
			var res leaderboard.Result
			for i := range 10 {
				res, err = board.Submit(ctx, leaderboard.Command{EventID: uuid.New(), UserID: fmt.Sprintf("u%d", i), Delta: int64(i + 1)})
				require.NoError(t, err)
			}
			w, err := board.Worker(nil)
			require.NoError(t, err)
			_, err = w.Drain(ctx)
			require.NoError(t, err)

			plain := cluster.Client(t)
			slot, err := plain.ClusterKeySlot(ctx, board.SortedSetKey()).Result()
			require.NoError(t, err)
			source, err := plain.MasterForKey(ctx, board.SortedSetKey())
			require.NoError(t, err)
			migration := testenv.StartSlotMigration(t, plain, int(slot), source)
			keys, err := source.ClusterGetKeysInSlot(ctx, int(slot), 100).Result()
			require.NoError(t, err)
			for i, key := range keys {
				if i%2 == 0 {
					require.NoError(t, migration.Move(ctx, key))
				}
			}
			t.Cleanup(func() { require.NoError(t, migration.Finish(ctx)) })

			req := httptest.NewRequest(http.MethodGet, fmt.Sprintf("/users/u9/rank?at_least=%d", res.Version), nil)
			rec := httptest.NewRecorder()
			svc.Handler().ServeHTTP(rec, req)
			require.Equal(t, http.StatusServiceUnavailable, rec.Code, "%s", rec.Body)
			require.Equal(t, "1", rec.Header().Get("Retry-After"))
		})
	}
}

// A service whose Redis URL names a cluster node, without --redis-cluster,
// that does not serve the board's slot: every read is redirected for good,
// a misconfiguration to fix (500), not an outage to wait out (503 with
// Retry-After tells clients to retry every second for ever).
func TestReadThroughASingleServerClientOnAClusterNodeIs500(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 0)
	clusterClient := cluster.Client(t)
	pg := testenv.Postgres(t)
	cfg := &leaderboard.Config{Name: testBoard, Schema: pg.Schema, KeyPrefix: cluster.Prefix(t), ReadPolicy: leaderboard.ServeStale}
	require.NoError(t, leaderboard.Migrate(ctx, pg.Pool, cfg))
	board, err := leaderboard.New(pg.Pool, clusterClient, cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	owner, err := clusterClient.MasterForKey(ctx, board.SortedSetKey())
	require.NoError(t, err)
	other := slices.IndexFunc(cluster.Addrs(), func(addr string) bool { return addr != owner.Options().Addr })
	single := redis.NewClient(&redis.Options{Addr: cluster.Addrs()[other]})
	t.Cleanup(func() { _ = single.Close() })
	misdirected, err := leaderboard.New(pg.Pool, single, cfg)
	require.NoError(t, err)
	t.Cleanup(misdirected.Close)
	svc, err := NewService(pg.Pool, single, misdirected, ServiceConfig{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, svc.Close()) })

	for _, path := range []string{"/leaderboard", "/users/u1/rank"} {
		rec := httptest.NewRecorder()
		svc.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
		require.Equal(t, http.StatusInternalServerError, rec.Code, "%s: %s", path, rec.Body)
		require.Empty(t, rec.Header().Get("Retry-After"), path)
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
