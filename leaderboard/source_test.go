package leaderboard

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/reconcile"
)

// TestVerifiedAgainstAnotherDatabase fails a private PostgreSQL over to its
// asynchronous standby after a commit the standby never received was
// projected: Redis then shows a score the new primary does not have, with
// the outbox drained (Lag 0). With RequireVerifiedProjection the record
// Verify made names the old primary's timeline, so reads on the promoted
// standby (a new timeline) are unverified until Verify, and the runbook
// (leaderboard doc, "When PostgreSQL goes back") restores a right
// projection.
func TestVerifiedAgainstAnotherDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	primary := testenv.StartPostgres(t)
	standby := primary.StartStandby(t)
	sibling := primary.StartStandby(t) // follows standby once it is promoted
	rd := testenv.Redis(t)
	cfg := &Config{
		Name: "b", KeyPrefix: rd.Prefix, RequireVerifiedProjection: true,
		ReadPolicy: FailClosed, LagProbeInterval: time.Nanosecond,
	}
	open := func(server *testenv.PostgresServer) *testBundle {
		pool := server.Pool(t)
		board, err := New(pool, rd.Client, cfg)
		require.NoError(t, err)
		t.Cleanup(board.Close)
		return &testBundle{board: board, pg: &testenv.PG{Pool: pool}, rd: rd}
	}
	primaryPool := primary.Pool(t)
	require.NoError(t, Migrate(ctx, primaryPool, cfg))
	old := open(primary)
	old.submit(t, "ada", 10)
	old.drain(t)
	_, verified, err := old.board.Verify(ctx, nil)
	require.NoError(t, err)
	require.True(t, verified)

	// The standbys replay everything so far, then stop receiving: the
	// sibling first, so that it can follow the promoted standby's timeline
	// from a point no later than where that one forks.
	var lsn string
	require.NoError(t, primaryPool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&lsn))
	standbyPool, siblingPool := standby.Pool(t), sibling.Pool(t)
	replayed := func(pool *pgxpool.Pool, lsn string) {
		require.Eventually(t, func() bool {
			var done bool
			err := pool.QueryRow(ctx, `SELECT pg_last_wal_replay_lsn() >= $1::pg_lsn`, lsn).Scan(&done)
			return err == nil && done
		}, 30*time.Second, 10*time.Millisecond)
	}
	follow := func(pool *pgxpool.Pool, conninfo string) {
		for _, q := range []string{`ALTER SYSTEM SET primary_conninfo = ` + quoteLiteral(conninfo), `SELECT pg_reload_conf()`} {
			_, err := pool.Exec(ctx, q)
			require.NoError(t, err)
		}
	}
	for _, pool := range []*pgxpool.Pool{siblingPool, standbyPool} {
		replayed(pool, lsn)
		follow(pool, "")
		require.Eventually(t, func() bool {
			var receivers int
			err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_wal_receiver`).Scan(&receivers)
			return err == nil && receivers == 0
		}, 30*time.Second, 10*time.Millisecond)
	}

	// A reader on a standby of the verified primary is verified.
	var identity string
	require.NoError(t, siblingPool.QueryRow(ctx, sourceIdentitySQL).Scan(&identity))
	require.True(t, strings.HasSuffix(identity, ":~00000001"), identity)
	require.False(t, open(sibling).board.Freshness(ctx).Unverified, "a standby of the primary Verify checked")

	// Committed and projected on the primary only, then lost with it.
	old.submit(t, "ada", 5)
	old.submit(t, "cy", 7)
	old.drain(t)
	require.NoError(t, primary.Kill())
	var promoted bool
	require.NoError(t, standbyPool.QueryRow(ctx, `SELECT pg_promote(true, 60)`).Scan(&promoted))
	require.True(t, promoted)

	tb := open(standby)
	truth, err := tb.board.Authoritative(ctx, 10)
	require.NoError(t, err)
	require.Equal(t, []Entry{{UserID: "ada", Score: 10, Rank: 1}}, truth)

	t.Run("ReadsAreUnverified", func(t *testing.T) {
		_, err := tb.board.Top(ctx, 10)
		var stale *StaleError
		require.ErrorAs(t, err, &stale, "Redis (ada 15, cy 7) was served as verified")
		require.True(t, stale.Unverified)
		fr := tb.board.Freshness(ctx)
		require.True(t, fr.Unverified)
		require.Equal(t, time.Duration(-1), fr.Lag)
		// A new write reuses the lost version 2: the gate answers it as a
		// duplicate, and Redis keeps the lost score.
		res, err := tb.board.Submit(ctx, Command{EventID: uuid.New(), UserID: "ada", Delta: 1})
		require.NoError(t, err)
		require.Equal(t, int64(2), res.Version)
		tb.drain(t)
		score, err := rd.Client.ZScore(ctx, tb.board.SortedSetKey(), "ada").Result()
		require.NoError(t, err)
		require.Equal(t, float64(-15), score, "the projection gate applied a reused version")
	})

	// A reader on a standby knows a lower bound of its timeline only (its
	// last restartpoint's): once it passes the record's, reads there are
	// unverified too.
	t.Run("AStandbyFollowingThePromotedOne", func(t *testing.T) {
		follow(siblingPool, standby.ConnString())
		_, err := standbyPool.Exec(ctx, `CHECKPOINT`)
		require.NoError(t, err)
		var lsn string
		require.NoError(t, standbyPool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&lsn))
		replayed(siblingPool, lsn)
		_, err = siblingPool.Exec(ctx, `CHECKPOINT`) // a restartpoint
		require.NoError(t, err)
		require.NoError(t, siblingPool.QueryRow(ctx, sourceIdentitySQL).Scan(&identity))
		require.True(t, strings.HasSuffix(identity, ":~00000002"), identity)

		reader := open(sibling)
		fr := reader.board.Freshness(ctx)
		require.True(t, fr.Unverified, "a reader on a standby of the new timeline")
		_, err = reader.board.Top(ctx, 10)
		var stale *StaleError
		require.ErrorAs(t, err, &stale)
		require.True(t, stale.Unverified)
	})

	t.Run("RunbookRestoresTheProjection", func(t *testing.T) {
		rep, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.False(t, verified)
		require.Equal(t, int64(1), rep.Counts[reconcile.ClassCorrupt], "ada: version 2 with another score")
		require.Equal(t, int64(1), rep.Counts[reconcile.ClassOrphan], "cy")
		_, err = tb.board.Top(ctx, 10)
		require.Error(t, err)

		_, verified, err = tb.board.Verify(ctx, &reconcile.Config{Policy: reconcile.Policy{Orphan: reconcile.ActionRepair}})
		require.NoError(t, err)
		require.True(t, verified)
		r, err := tb.board.Top(ctx, 10)
		require.NoError(t, err)
		require.False(t, r.Freshness.Unverified)
		require.Equal(t, []Entry{{UserID: "ada", Score: 11, Rank: 1}}, r.Entries)
	})
}

func TestSameSource(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		recorded, current string
		same              bool
	}{
		{"7715209476908992695:00000001", "7715209476908992695:00000001", true},
		{"7715209476908992695:00000001", "7715209476908992695:00000002", false},  // promoted standby, PITR
		{"7715209476908992695:00000001", "8000000000000000001:00000001", false},  // another cluster
		{"7715209476908992695:00000001", "7715209476908992695:~00000001", true},  // read on a standby
		{"7715209476908992695:00000002", "7715209476908992695:~00000001", true},  // its restartpoint still before the switch
		{"7715209476908992695:0000000A", "7715209476908992695:~00000009", true},  // hexadecimal
		{"7715209476908992695:00000001", "7715209476908992695:~00000002", false}, // it follows a promoted standby
		{"7715209476908992695:00000009", "7715209476908992695:~0000000A", false},
		{"7715209476908992695:00000001", "8000000000000000001:~00000001", false},
		{"7715209476908992695:~00000001", "7715209476908992695:00000001", false}, // verified on a standby: which timeline?
		{"7715209476908992695:~00000002", "7715209476908992695:~00000002", true},
		{"7715209476908992695:~00000001", "7715209476908992695:~00000002", false},
		{"7715209476908992695:~00000001", "8000000000000000001:~00000001", false},
		{"7715209476908992695:00000001", "7715209476908992695:~0000000G", false}, // malformed
		{"7715209476908992695:", "7715209476908992695:~00000001", false},
		{"7715209476908992695", "7715209476908992695:00000001", false},
		{"", "7715209476908992695:00000002", true}, // not read when recorded
		{"7715209476908992695:00000001", "", true}, // not read
	} {
		require.Equal(t, c.same, sameSource(c.recorded, c.current), "%q vs %q", c.recorded, c.current)
	}
}

// TestVerifiedWhereTheIdentityIsRefused: a role that may not run the
// identity's functions (revoked, or a managed service without them) keeps
// its lag measured and Verify working, as before records named a
// database, and the log says what the board cannot see.
func TestVerifiedWhereTheIdentityIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	server := testenv.StartPostgres(t)
	admin := server.Pool(t)
	for _, q := range []string{
		`CREATE ROLE app LOGIN`,
		`GRANT CREATE ON DATABASE postgres TO app`,
		`REVOKE EXECUTE ON FUNCTION pg_current_wal_lsn() FROM PUBLIC`,
	} {
		_, err := admin.Exec(ctx, q)
		require.NoError(t, err)
	}
	pool := testenv.NewPool(t, strings.Replace(server.ConnString(), "postgres@", "app@", 1))
	rd := testenv.Redis(t)
	var logs testenv.LogSink
	cfg := &Config{
		Name: "b", Schema: "game", KeyPrefix: rd.Prefix, RequireVerifiedProjection: true,
		ReadPolicy: FailClosed, LagProbeInterval: time.Nanosecond, Logger: logs.Logger(),
	}
	require.NoError(t, Migrate(ctx, pool, cfg))
	board, err := New(pool, rd.Client, cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	tb := &testBundle{board: board, pg: &testenv.PG{Pool: pool}, rd: rd}
	tb.submit(t, "ada", 10)
	tb.drain(t)
	_, verified, err := board.Verify(ctx, nil)
	require.NoError(t, err)
	require.True(t, verified)
	r, err := board.Top(ctx, 10)
	require.NoError(t, err)
	require.GreaterOrEqual(t, r.Freshness.Lag, time.Duration(0))
	require.False(t, r.Freshness.Unverified)
	lines := logs.Lines(t, "leaderboard: the database's identity cannot be read (pg_control_system, pg_walfile_name, pg_current_wal_lsn, pg_control_checkpoint, pg_control_recovery), so RequireVerifiedProjection cannot see a failover or restore; grant the board's role EXECUTE on them")
	require.NotEmpty(t, lines)
	require.Contains(t, lines[0]["error"], "42501")
}
