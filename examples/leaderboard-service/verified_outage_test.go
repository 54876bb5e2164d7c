package main

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
	"github.com/verity-go/verity/reconcile"
)

// With --require-verified and fail-closed, a read while Redis cannot serve
// (stopped, or a replica cut off from its master: MASTERDOWN) finds Verify's
// record unreadable, and the board calls the projection unverified. The
// service must answer as for any store that cannot be reached (503,
// Retry-After: 1), not blame the data and send the operator to
// 'reconcile --verify', which cannot run either and is not needed after.
func TestVerifiedReadsWithRedisUnreachable(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"Stopped", "MasterDown"} {
		for _, every := range []time.Duration{0, 30 * time.Second} {
			t.Run(mode+"/ReconcileEvery"+every.String(), func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				pg := testenv.Postgres(t)
				rs := testenv.StartRedis(t)
				rdb := redis.NewClient(&redis.Options{Addr: rs.Addr(), MaxRetries: -1})
				t.Cleanup(func() { _ = rdb.Close() })
				cfg := &leaderboard.Config{Name: testBoard, Schema: pg.Schema, ReadPolicy: leaderboard.FailClosed,
					RequireVerifiedProjection: true, LagProbeInterval: time.Millisecond}
				require.NoError(t, leaderboard.Migrate(ctx, pg.Pool, cfg))
				board, err := leaderboard.New(pg.Pool, rdb, cfg)
				require.NoError(t, err)
				t.Cleanup(board.Close)
				svc, err := NewService(pg.Pool, rdb, board, ServiceConfig{ReconcileEvery: every})
				require.NoError(t, err)
				t.Cleanup(func() { _ = svc.Close() })
				tb := &testBundle{svc: svc, srv: newServer(t, svc)}
				require.Equal(t, http.StatusCreated, tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":5}`).status)
				tb.drain(t)
				_, ok, err := board.Verify(ctx, nil)
				require.NoError(t, err)
				require.True(t, ok)
				require.Equal(t, http.StatusOK, tb.do(t, http.MethodGet, "/leaderboard", nil, "").status)

				switch mode {
				case "Stopped":
					require.NoError(t, rs.Stop())
				case "MasterDown":
					// Copy the board (and Verify's record) to another server,
					// make this one its replica, then stop the master.
					m := testenv.StartRedis(t)
					mc := m.Client(t)
					host, port, _ := strings.Cut(rs.Addr(), ":")
					require.NoError(t, mc.ReplicaOf(ctx, host, port).Err())
					waitReplicaInSync(t, mc)
					require.NoError(t, mc.ReplicaOf(ctx, "no", "one").Err())
					host, port, _ = strings.Cut(m.Addr(), ":")
					require.NoError(t, rdb.ReplicaOf(ctx, host, port).Err())
					waitReplicaInSync(t, rdb)
					require.NoError(t, rdb.ConfigSet(ctx, "replica-serve-stale-data", "no").Err())
					require.NoError(t, m.Stop())
					require.Eventually(t, func() bool {
						err := rdb.Get(ctx, "x").Err()
						return err != nil && strings.HasPrefix(err.Error(), "MASTERDOWN")
					}, 10*time.Second, 20*time.Millisecond)
				}
				time.Sleep(5 * time.Millisecond) // past LagProbeInterval: the read probes again
				for _, path := range []string{"/leaderboard", "/users/ada/rank"} {
					res := tb.do(t, http.MethodGet, path, nil, "")
					require.Equal(t, http.StatusServiceUnavailable, res.status, "%s: %s", path, res.body)
					require.Equal(t, "1", res.header.Get("Retry-After"), "%s: %s", path, res.body)
					require.Contains(t, res.json(t)["error"], "cannot be reached", path)
				}
			})
		}
	}
}

// waitReplicaInSync waits until c, a replica, has its master's data.
func waitReplicaInSync(t *testing.T, c *redis.Client) {
	t.Helper()
	require.Eventually(t, func() bool {
		info, err := c.Info(context.Background(), "replication").Result()
		return err == nil && strings.Contains(info, "master_link_status:up") && strings.Contains(info, "master_sync_in_progress:0")
	}, 10*time.Second, 20*time.Millisecond)
}

// The same on a Redis Cluster, where a PING says nothing about the node
// serving the board's slot (a cluster client sends it to any node, and a
// node answers it while the cluster is down for keys): a read of an
// unverified board answers "cannot be reached" while the board's slot
// cannot be served, and still sends the operator to 'reconcile --verify'
// while it can, another master down or not.
func TestVerifiedReadsOnClusterWithANodeDown(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name                        string
		killBoardNode, fullCoverage bool
		want                        string
	}{
		// Default settings: the board's master dies (no replica to fail
		// over to), or another one does and, after cluster-node-timeout,
		// every node answers CLUSTERDOWN for keys.
		{"BoardNodeDown", true, true, "cannot be reached"},
		{"OtherNodeDownClusterDown", false, true, "cannot be reached"},
		// cluster-require-full-coverage no: the board's node serves on,
		// and the board is as unverified as before.
		{"OtherNodeDownBoardServes", false, false, "reconcile --verify"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pg := testenv.Postgres(t)
			cluster := testenv.StartRedisCluster(t, 3, 0)
			if !c.fullCoverage {
				for _, addr := range cluster.Addrs() {
					node := redis.NewClient(&redis.Options{Addr: addr})
					require.NoError(t, node.ConfigSet(ctx, "cluster-require-full-coverage", "no").Err())
					require.NoError(t, node.Close())
				}
			}
			rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs(), MaxRetries: -1})
			t.Cleanup(func() { _ = rdb.Close() })
			cfg := &leaderboard.Config{Name: testBoard, Schema: pg.Schema, KeyPrefix: cluster.Prefix(t), ReadPolicy: leaderboard.FailClosed,
				RequireVerifiedProjection: true, LagProbeInterval: time.Millisecond}
			require.NoError(t, leaderboard.Migrate(ctx, pg.Pool, cfg))
			board, err := leaderboard.New(pg.Pool, rdb, cfg)
			require.NoError(t, err)
			t.Cleanup(board.Close)
			svc, err := NewService(pg.Pool, rdb, board, ServiceConfig{ReconcileEvery: 0})
			require.NoError(t, err)
			t.Cleanup(func() { _ = svc.Close() })
			tb := &testBundle{svc: svc, srv: newServer(t, svc)}
			require.Equal(t, http.StatusCreated, tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":5}`).status)
			tb.drain(t)
			// Never verified: the operator must verify it.
			before := tb.do(t, http.MethodGet, "/leaderboard", nil, "")
			require.Equal(t, http.StatusServiceUnavailable, before.status, "%s", before.body)
			require.Contains(t, before.json(t)["error"], "reconcile --verify")

			boardNode, err := rdb.MasterForKey(ctx, board.SortedSetKey())
			require.NoError(t, err)
			victim, witness := -1, -1
			for i, addr := range cluster.Addrs() {
				switch holds := addr == boardNode.Options().Addr; {
				case victim < 0 && holds == c.killBoardNode:
					victim = i
				case witness < 0 && !holds:
					witness = i
				}
			}
			require.True(t, victim >= 0 && witness >= 0)
			cluster.Kill(victim)
			// Wait for a surviving master to mark the victim failed, and,
			// with full coverage required, the cluster down.
			node := redis.NewClient(&redis.Options{Addr: cluster.Addrs()[witness]})
			t.Cleanup(func() { _ = node.Close() })
			require.Eventually(t, func() bool {
				nodes, err := node.ClusterNodes(ctx).Result()
				if err != nil {
					return false
				}
				for line := range strings.SplitSeq(nodes, "\n") {
					if strings.Contains(line, cluster.Addrs()[victim]) {
						return strings.Contains(line, "fail") && !strings.Contains(line, "fail?")
					}
				}
				return false
			}, 20*time.Second, 50*time.Millisecond)
			if c.fullCoverage {
				require.Eventually(t, func() bool {
					info, err := node.ClusterInfo(ctx).Result()
					return err == nil && strings.Contains(info, "cluster_state:fail")
				}, 20*time.Second, 50*time.Millisecond)
			}

			for range 5 {
				res := tb.do(t, http.MethodGet, "/leaderboard", nil, "")
				require.Equal(t, http.StatusServiceUnavailable, res.status, "%s", res.body)
				require.Contains(t, res.json(t)["error"], c.want)
				if c.want == "cannot be reached" {
					require.Equal(t, "1", res.header.Get("Retry-After"))
				}
			}
			// /healthz asks the node serving the board's slot too, not
			// any node a PING would reach.
			health := tb.do(t, http.MethodGet, "/healthz", nil, "")
			if c.want == "cannot be reached" {
				require.Equal(t, http.StatusServiceUnavailable, health.status, "%s", health.body)
				require.Equal(t, "unavailable", health.json(t)["redis"])
			} else {
				require.Equal(t, http.StatusOK, health.status, "%s", health.body)
			}
		})
	}
}

// A new board's first verifying pass finds it empty, and its record counts
// no member: readers compare the sorted set's size with that count, so a
// loss of the members the board gained since (a DEL of the sorted set, its
// eviction) went unseen, and fail-closed reads served an empty board as
// fresh. The scheduled reconcile verifies again until a pass finds
// members, which readers then count, whoever made the pass that found the
// board empty: this service, or another process ('reconcile --verify',
// another instance, this service before a restart).
func TestReverifiesABoardVerifiedEmpty(t *testing.T) {
	t.Parallel()
	for _, byThisService := range []bool{true, false} {
		name := map[bool]string{true: "ByThisService", false: "ByAnotherProcess"}[byThisService]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pg, rd, board := failClosedVerifiedBoard(t)
			if !byThisService {
				_, verified, err := board.Verify(ctx, nil)
				require.NoError(t, err)
				require.True(t, verified)
			}
			svc, err := NewService(pg.Pool, rd.Client, board, ServiceConfig{ReconcileEvery: time.Minute})
			require.NoError(t, err)
			t.Cleanup(func() { _ = svc.Close() })
			tb := &testBundle{svc: svc, srv: newServer(t, svc)}
			if byThisService {
				// The first scheduled run verifies the empty board.
				svc.reconcileOnce(ctx)
				first := svc.lastReconcile.Load()
				require.NotNil(t, first.Verified, "the first run is a verifying pass")
				require.True(t, *first.Verified)
			}

			require.Equal(t, http.StatusCreated, tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":5}`).status)
			tb.drain(t)
			time.Sleep(5 * time.Millisecond) // past LagProbeInterval
			res := tb.do(t, http.MethodGet, "/leaderboard", nil, "")
			require.Equal(t, http.StatusOK, res.status, "%s", res.body)
			require.Contains(t, string(res.body), `"ada"`)

			// The next scheduled run, whatever it is, leaves a record that
			// sees the sorted set's loss.
			svc.reconcileOnce(ctx)
			require.NoError(t, rd.Client.Del(ctx, board.SortedSetKey()).Err())
			time.Sleep(5 * time.Millisecond) // past LagProbeInterval: the read looks again
			for _, path := range []string{"/leaderboard", "/users/ada/rank"} {
				res := tb.do(t, http.MethodGet, path, nil, "")
				require.Equal(t, http.StatusServiceUnavailable, res.status, "%s after the sorted set's loss: %s", path, res.body)
			}
		})
	}
}

// A board verified empty that has grown past what one verifying pass can
// check within --reconcile-every: each re-verification is cut off at the
// interval and records nothing, so the record still counts no member, and
// every scheduled run was a verifying pass again: no sampled reconcile
// ran any more. A failed re-verification is followed by a sample.
func TestReverifyingAnEmptyBoardDoesNotStarveSamples(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg, rd, board := failClosedVerifiedBoard(t)
	_, verified, err := board.Verify(ctx, nil) // the new board's first pass
	require.NoError(t, err)
	require.True(t, verified)

	// The board grows (an import); a full pass brings Redis up to date.
	_, err = pg.Pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %q.%s (board, user_id, score, version)
		SELECT $1, 'u' || g, g, 1 FROM generate_series(1, 30000) g`, pg.Schema, leaderboard.UserScoresTable), testBoard)
	require.NoError(t, err)
	_, err = pg.Pool.Exec(ctx, fmt.Sprintf(`ANALYZE %q.%s`, pg.Schema, leaderboard.UserScoresTable))
	require.NoError(t, err) // so that a sample reads its rows, not the table
	rec, err := board.Reconciler(nil)
	require.NoError(t, err)
	_, err = rec.Run(ctx, reconcile.RunOptions{})
	require.NoError(t, err)
	start := time.Now()
	_, err = rec.Run(ctx, reconcile.RunOptions{})
	require.NoError(t, err)
	full := time.Since(start)

	// An interval half a full pass long.
	svc, err := NewService(pg.Pool, rd.Client, board, ServiceConfig{ReconcileEvery: full / 2, ReconcileSample: 200})
	require.NoError(t, err)
	t.Cleanup(func() { _ = svc.Close() })
	require.False(t, board.Freshness(ctx).Unverified, "reads trust the record")
	samples := 0
	for range 4 {
		svc.reconcileOnce(ctx)
		if svc.lastReconcile.Load().Verified == nil {
			samples++
		}
	}
	require.Positive(t, samples, "4 scheduled runs after a full pass took %v, every one a verifying pass: no sampled reconcile ran", full)
}

// failClosedVerifiedBoard returns a migrated board in the test's own schema
// and key prefix that fails closed and requires a verified projection,
// looking for Verify's record at every read (LagProbeInterval 1 ms).
func failClosedVerifiedBoard(t *testing.T) (*testenv.PG, *testenv.RD, *leaderboard.Board) {
	t.Helper()
	pg := testenv.Postgres(t)
	rd := testenv.Redis(t)
	cfg := &leaderboard.Config{Name: testBoard, Schema: pg.Schema, KeyPrefix: rd.Prefix, ReadPolicy: leaderboard.FailClosed,
		RequireVerifiedProjection: true, LagProbeInterval: time.Millisecond}
	require.NoError(t, leaderboard.Migrate(context.Background(), pg.Pool, cfg))
	board, err := leaderboard.New(pg.Pool, rd.Client, cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	return pg, rd, board
}
