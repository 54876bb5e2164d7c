package faults

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
)

// TestPostgresRestartDuringIngest kills (-9) and cleanly restarts a private
// PostgreSQL while clients submit commands and retry failures with the same
// event id. Every acknowledged command must be applied exactly once — a
// retry whose first attempt had committed must come back as a duplicate of
// the original result — and no command may be half-applied: score_events,
// user_scores and the outbox must tell the same story row for row.
func TestPostgresRestartDuringIngest(t *testing.T) {
	t.Parallel()
	var (
		clients   = 8
		perClient = size(250, 5_000)
		users     = 50
		restarts  = size(4, 40)
	)
	srv := testenv.StartPostgres(t)
	cfg, err := pgxpool.ParseConfig(srv.ConnString())
	require.NoError(t, err)
	cfg.MaxConns = int32(clients + 2)
	cfg.ConnConfig.ConnectTimeout = 2 * time.Second
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	bb := newBoard(t, pool, "faults_pg", testenv.Redis(t).Client, "verity:faults:pg:", "pg-faults")

	type outcome struct {
		cmd leaderboard.Command
		res leaderboard.Result
	}
	var (
		mu       sync.Mutex
		outcomes []outcome
		retries  int
		failed   int
	)
	userIDs := make([]string, users)
	for i := range userIDs {
		userIDs[i] = fmt.Sprintf("player-%02d'; --", i)
	}
	// The clients keep submitting, past perClient commands each, until every
	// fault has landed: otherwise fast clients end the run after one or two.
	var faultsDone atomic.Bool
	defer faultsDone.Store(true) // also when a fault fails the test
	var wg sync.WaitGroup
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(rand.Uint64(), uint64(c)))
			for n := 0; n < perClient || !faultsDone.Load(); n++ {
				cmd := leaderboard.Command{EventID: uuid.New(), UserID: userIDs[rng.IntN(users)], Delta: randomDelta(rng)}
				giveUp := time.Now().Add(60 * time.Second)
				for attempt := 0; ; attempt++ {
					ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
					res, err := bb.board.Submit(ctx, cmd)
					cancel()
					if err == nil {
						mu.Lock()
						outcomes = append(outcomes, outcome{cmd, res})
						mu.Unlock()
						break
					}
					mu.Lock()
					retries++
					mu.Unlock()
					if time.Now().After(giveUp) {
						mu.Lock()
						failed++
						mu.Unlock()
						break
					}
					time.Sleep(time.Duration(20+10*min(attempt, 20)) * time.Millisecond)
				}
			}
		}()
	}

	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	faults := 0
	for i := 0; i < restarts; i++ {
		time.Sleep(time.Duration(150+rand.IntN(200)) * time.Millisecond)
		if i%2 == 0 {
			require.NoError(t, srv.Kill()) // crash: in-flight transactions vanish
		} else {
			require.NoError(t, srv.Stop()) // fast shutdown: in-flight transactions roll back
		}
		faults++
		time.Sleep(100 * time.Millisecond)
		require.NoError(t, srv.Start())
	}
	faultsDone.Store(true)
	<-done
	require.Zero(t, failed, "commands still failing after 60s of retries")
	require.GreaterOrEqual(t, len(outcomes), clients*perClient)
	// A connection left idle since before the last restart is dead, and
	// pgxpool pings only connections idle for over a second: the checks
	// below start from fresh ones (seen in CI: "unexpected EOF").
	pool.Reset()

	ctx := context.Background()
	// Every acknowledged command is recorded exactly once, as acknowledged.
	type recorded struct {
		user           string
		delta          int64
		score, version int64
	}
	events := map[uuid.UUID]recorded{}
	rows, err := pool.Query(ctx, `SELECT event_id, user_id, delta, score, version FROM `+bb.table(leaderboard.ScoreEventsTable))
	require.NoError(t, err)
	for rows.Next() {
		var id uuid.UUID
		var r recorded
		require.NoError(t, rows.Scan(&id, &r.user, &r.delta, &r.score, &r.version))
		events[id] = r
	}
	require.NoError(t, rows.Err())
	require.Len(t, events, len(outcomes), "score events vs acknowledged commands")
	sums := map[string]int64{}
	duplicates := 0
	for _, o := range outcomes {
		r, ok := events[o.cmd.EventID]
		require.True(t, ok, "acknowledged command %s not recorded", o.cmd.EventID)
		require.Equal(t, recorded{o.cmd.UserID, o.cmd.Delta, o.res.Score, o.res.Version}, r,
			"the acknowledgement must be the recorded result (duplicate=%v)", o.res.Duplicate)
		sums[o.cmd.UserID] += o.cmd.Delta
		if o.res.Duplicate {
			duplicates++
		}
	}

	// No command half-applied: each user's score is the sum of its events,
	// its version their count, and the outbox holds exactly one row per
	// (user, version) with the score as of that version.
	var scoreMismatch, versionMismatch, outboxMismatch int
	rows, err = pool.Query(ctx, `
		SELECT u.user_id, u.score, u.version,
		       (SELECT count(*) FROM `+bb.table(leaderboard.ScoreEventsTable)+` e WHERE e.board = u.board AND e.user_id = u.user_id),
		       (SELECT count(*) FROM `+bb.table("verity_outbox")+` o WHERE o.key = u.user_id),
		       (SELECT count(DISTINCT o.version) FROM `+bb.table("verity_outbox")+` o WHERE o.key = u.user_id),
		       (SELECT count(*) FROM `+bb.table("verity_outbox")+` o WHERE o.key = u.user_id AND o.published_at IS NULL),
		       (SELECT count(*) FROM `+bb.table("verity_outbox")+` o
		          JOIN `+bb.table(leaderboard.ScoreEventsTable)+` e ON e.event_id = o.event_id
		         WHERE o.key = u.user_id AND (o.version <> e.version OR convert_from(o.payload, 'UTF8') <> e.score::text))
		FROM `+bb.table(leaderboard.UserScoresTable)+` u WHERE u.board = $1`, bb.board.Name())
	require.NoError(t, err)
	usersChecked := 0
	for rows.Next() {
		var user string
		var score, version, nEvents, nOutbox, nVersions, nPending, nWrong int64
		require.NoError(t, rows.Scan(&user, &score, &version, &nEvents, &nOutbox, &nVersions, &nPending, &nWrong))
		usersChecked++
		if score != sums[user] {
			scoreMismatch++
		}
		if version != nEvents {
			versionMismatch++
		}
		// No relay runs: every row is still pending, none published.
		if nOutbox != version || nVersions != version || nPending != version || nWrong != 0 {
			outboxMismatch++
		}
	}
	require.NoError(t, rows.Err())
	require.Equal(t, len(sums), usersChecked)
	require.Zero(t, scoreMismatch, "users whose score is not the sum of acknowledged deltas")
	require.Zero(t, versionMismatch, "users whose version is not their number of events")
	require.Zero(t, outboxMismatch, "users whose outbox rows do not match their events")
	summary(t, "postgres", "restart-during-ingest",
		"faults", faults, "commands_acked", len(outcomes), "retries", retries,
		"acks_lost_then_deduplicated", duplicates, "rows_checked", len(events), "users_checked", usersChecked,
		"half_applied", 0, "applied_twice", 0, "lost", 0)
}
