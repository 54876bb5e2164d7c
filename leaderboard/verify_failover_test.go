package leaderboard

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/reconcile"
)

// TestVerifyFailoverDuringPass: Redis fails over while a Verify pass runs,
// to a replica that has the pass's marker (set before the pass) but not
// its repairs (asynchronous replication). The marker alone cannot tell;
// the pass must not record the projection complete, or a FailClosed read
// serves the board the failover emptied as verified. A pass after the
// failover repairs and records as before.
func TestVerifyFailoverDuringPass(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// Just before the pass records, Redis fails over to the cut replica.
	pair, tb, beforeRecord := failoverBoard(t)
	board := tb.board
	for i, user := range []string{"ada", "bob", "cy"} {
		_, err := board.Submit(ctx, Command{EventID: uuid.New(), UserID: user, Delta: int64(10 * (i + 1))})
		require.NoError(t, err)
	}
	tb.drain(t)
	// Redis restarted empty: the whole board is missing, record included.
	require.NoError(t, pair.master.FlushAll(ctx).Err())
	_, err := board.Top(ctx, 10)
	var stale *StaleError
	require.ErrorAs(t, err, &stale)
	require.True(t, stale.Unverified)

	var cut atomic.Bool
	report, verified, err := board.Verify(ctx, &reconcile.Config{
		BeforeRepair: func(context.Context, reconcile.Finding) bool {
			if cut.CompareAndSwap(false, true) {
				// The marker is set and replicated; the repairs will not be.
				pair.cutReplica(t)
			}
			return true
		},
	})
	require.NoError(t, err)
	require.True(t, cut.Load())
	require.True(t, beforeRecord.fired.Load(), "the failover never happened")
	require.Equal(t, int64(3), report.RepairedByClass[reconcile.ClassMissing])
	require.False(t, verified, "Verify recorded as complete a projection whose repairs the failover lost")
	_, err = board.Top(ctx, 10)
	require.ErrorAs(t, err, &stale, "a FailClosed read served the board the failover emptied")
	require.True(t, stale.Unverified)

	// The next pass, on the promoted server, repairs again and records.
	report, verified, err = board.Verify(ctx, nil)
	require.NoError(t, err)
	require.True(t, verified)
	require.Equal(t, int64(3), report.RepairedByClass[reconcile.ClassMissing])
	top, err := board.Top(ctx, 10)
	require.NoError(t, err)
	require.Len(t, top.Entries, 3)
}

// failoverPair is a private master with one replica. The replica can be
// cut off (it keeps what it had), and the master then made to take the
// replica's data by a full resync from it: what a client sees after a
// failover to a replica that missed the last writes.
type failoverPair struct {
	master, replica      *redis.Client
	masterAddr, replAddr string
}

// failoverBoard is a board on the master of a new failover pair, whose
// Redis client fails the pair over to its cut replica just before Verify
// records (beforeRecord.fired tells that it did).
func failoverBoard(t *testing.T) (*failoverPair, *testBundle, *beforeScript) {
	t.Helper()
	pair := startFailoverPair(t)
	client := redis.NewClient(&redis.Options{Addr: pair.masterAddr})
	t.Cleanup(func() { _ = client.Close() })
	beforeRecord := &beforeScript{hash: verifiedScript.Hash(), fn: func() { pair.failover(t) }}
	client.AddHook(beforeRecord)
	pg := testenv.Postgres(t)
	cfg := &Config{Name: "weekly", Schema: pg.Schema, KeyPrefix: "fo:",
		RequireVerifiedProjection: true, ReadPolicy: FailClosed, LagProbeInterval: time.Nanosecond}
	require.NoError(t, Migrate(context.Background(), pg.Pool, cfg))
	board, err := New(pg.Pool, client, cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	return pair, &testBundle{board: board, pg: pg}, beforeRecord
}

func startFailoverPair(t *testing.T) *failoverPair {
	t.Helper()
	m := testenv.StartRedis(t, "--repl-diskless-sync-delay", "0")
	r := testenv.StartRedis(t, "--repl-diskless-sync-delay", "0")
	p := &failoverPair{master: m.Client(t), replica: r.Client(t), masterAddr: m.Addr(), replAddr: r.Addr()}
	host, port, _ := strings.Cut(m.Addr(), ":")
	require.NoError(t, p.replica.ReplicaOf(context.Background(), host, port).Err())
	waitReplicationUp(t, p.replica)
	return p
}

// cutReplica waits until the replica has every write so far, then detaches
// it: it keeps that state, and misses every later write.
func (p *failoverPair) cutReplica(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	n, err := p.master.Do(ctx, "WAIT", 1, 5000).Int()
	require.NoError(t, err)
	require.Equal(t, 1, n, "the replica did not acknowledge the writes")
	require.NoError(t, p.replica.ReplicaOf(ctx, "no", "one").Err())
}

// failover gives the master the cut replica's data (a full resync from
// it), then promotes it again: every write acknowledged after the cut is
// gone, and the master has a new replication id, as a promoted replica
// has.
func (p *failoverPair) failover(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	host, port, _ := strings.Cut(p.replAddr, ":")
	require.NoError(t, p.master.ReplicaOf(ctx, host, port).Err())
	waitReplicationUp(t, p.master)
	require.NoError(t, p.master.ReplicaOf(ctx, "no", "one").Err())
}

func waitReplicationUp(t *testing.T, c *redis.Client) {
	t.Helper()
	require.Eventually(t, func() bool {
		info, err := c.Info(context.Background(), "replication").Result()
		return err == nil && strings.Contains(info, "master_link_status:up") && strings.Contains(info, "master_sync_in_progress:0")
	}, 20*time.Second, 20*time.Millisecond, "the replication link never came up")
}

// beforeScript calls fn once, just before the client sends the script
// whose digest is hash (EVALSHA, or the EVAL go-redis falls back to).
type beforeScript struct {
	testenv.PassThroughHook
	hash  string
	fn    func()
	fired atomic.Bool
}

func (h *beforeScript) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if name := cmd.Name(); name == "evalsha" || name == "eval" {
			args := cmd.Args()
			if len(args) > 1 && (args[1] == any(h.hash) || args[1] == any(verifiedLua)) && h.fired.CompareAndSwap(false, true) {
				h.fn()
			}
		}
		return next(ctx, cmd)
	}
}

// TestVerifyWithoutInfo: a Redis user refused INFO stores no replication
// id with the pass's marker, so the failover check is off, and Verify
// records as before (the README's permissions say so).
func TestVerifyWithoutInfo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.StartRedis(t)
	acl := []any{"ACL", "SETUSER", "noinfo", "reset", "on", ">pw", "~ni:*", "-@all"}
	for _, c := range writerCommands {
		if c != "info" {
			acl = append(acl, "+"+c)
		}
	}
	require.NoError(t, srv.Client(t).Do(ctx, acl...).Err())
	limited := redis.NewClient(&redis.Options{Addr: srv.Addr(), Username: "noinfo", Password: "pw"})
	t.Cleanup(func() { _ = limited.Close() })
	require.Error(t, limited.Info(ctx, "replication").Err(), "the user may not send INFO")

	pg := testenv.Postgres(t)
	cfg := &Config{Name: "ni", Schema: pg.Schema, KeyPrefix: "ni:"}
	require.NoError(t, Migrate(ctx, pg.Pool, cfg))
	board, err := New(pg.Pool, limited, cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	tb := &testBundle{board: board, pg: pg}
	tb.submit(t, "ada", 10)
	report, verified, err := board.Verify(ctx, nil)
	require.NoError(t, err)
	require.True(t, verified)
	require.Equal(t, int64(1), report.RepairedByClass[reconcile.ClassMissing])
}

// A Verify pass during which Redis fails over to a replica that has every
// member and version, but older ones (the pass's repairs of stale users were
// not replicated), must not record the projection complete: the sorted
// set's size and version count cannot tell, only the replication id in the
// pass's marker can (verified.lua; TestVerifyFailoverDuringPass empties
// Redis, which the size checks refuse anyway: mutation audit of
// 2026-12-07).
func TestVerifyFailoverLosesStaleRepairs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pair, tb, beforeRecord := failoverBoard(t)
	board := tb.board
	users := []string{"ada", "bob", "cy"}
	for i, user := range users {
		_, err := board.Submit(ctx, Command{EventID: uuid.New(), UserID: user, Delta: int64(10 * (i + 1))})
		require.NoError(t, err)
	}
	tb.drain(t)
	// Newer scores committed, not projected: Redis holds every user, stale.
	for _, user := range users {
		_, err := board.Submit(ctx, Command{EventID: uuid.New(), UserID: user, Delta: 1000})
		require.NoError(t, err)
	}

	var cut atomic.Bool
	report, verified, err := board.Verify(ctx, &reconcile.Config{
		BeforeRepair: func(context.Context, reconcile.Finding) bool {
			if cut.CompareAndSwap(false, true) {
				pair.cutReplica(t) // the marker is replicated; the repairs will not be
			}
			return true
		},
	})
	require.NoError(t, err)
	require.True(t, cut.Load())
	require.True(t, beforeRecord.fired.Load(), "the failover never happened")
	require.Equal(t, int64(3), report.RepairedByClass[reconcile.ClassStale])
	require.False(t, verified, "Verify recorded as complete a projection whose repairs the failover lost")
}
