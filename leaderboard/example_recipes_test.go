package leaderboard_test

import (
	"context"
	"database/sql"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
)

// recipeBundle is what the Examples' recipes run against: a migrated board
// and the application's database/sql handle on the same schema, with the
// wallets table recordWin credits.
type recipeBundle struct {
	board      *leaderboard.Board
	db         *sql.DB
	connString string
}

// recipeBoard returns a migrated board named name, in a schema and key
// prefix of the test's own, and its database.
func recipeBoard(t *testing.T, name string) (*leaderboard.Board, *testenv.PG) {
	t.Helper()
	pg := testenv.Postgres(t)
	rd := testenv.Redis(t)
	cfg := &leaderboard.Config{Name: name, Schema: pg.Schema, KeyPrefix: rd.Prefix}
	require.NoError(t, leaderboard.Migrate(context.Background(), pg.Pool, cfg))
	board, err := leaderboard.New(pg.Pool, rd.Client, cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	return board, pg
}

func recipeSetup(t *testing.T) *recipeBundle {
	t.Helper()
	ctx := context.Background()
	board, pg := recipeBoard(t, "weekly-2026-48")
	db, err := sql.Open("pgx", pg.ConnString)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	_, err = db.ExecContext(ctx, `CREATE TABLE wallets (user_id text PRIMARY KEY, coins bigint NOT NULL);
		INSERT INTO wallets VALUES ('ada', 0)`)
	require.NoError(t, err)
	return &recipeBundle{board: board, db: db, connString: pg.ConnString}
}

// coinsAndScore returns ada's wallet and her score in PostgreSQL.
func (rb *recipeBundle) coinsAndScore(t *testing.T) (coins, score int64) {
	t.Helper()
	require.NoError(t, rb.db.QueryRowContext(context.Background(),
		`SELECT (SELECT coins FROM wallets WHERE user_id = 'ada'), (SELECT score FROM user_scores WHERE user_id = 'ada')`).Scan(&coins, &score))
	return coins, score
}

// TestSubmitTxRecipeAppliesAppWritesOnce runs ExampleBoard_SubmitTx's
// recordWin, the recipe applications copy, whose own write is not
// idempotent (a wallet credit): a replayed match, sequential or racing its
// original, must credit the wallet once, as it scores the win once.
func TestSubmitTxRecipeAppliesAppWritesOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("Replay", func(t *testing.T) {
		t.Parallel()
		rb := recipeSetup(t)
		match := uuid.New()
		first, err := recordWin(ctx, rb.db, rb.board, match, "ada")
		require.NoError(t, err)
		require.False(t, first.Duplicate)
		again, err := recordWin(ctx, rb.db, rb.board, match, "ada")
		require.NoError(t, err)
		require.True(t, again.Duplicate)
		require.Equal(t, first.Score, again.Score)
		coins, score := rb.coinsAndScore(t)
		require.EqualValues(t, 3, score)
		require.EqualValues(t, 10, coins, "a replayed match credited the wallet again")
	})

	// Twins racing each other: both statements run before either commits
	// (they queue behind a lock on ada's score row), so the loser's sees
	// the winner's commit mid-statement (ErrConcurrentSubmit), which the
	// recipe retries.
	t.Run("ConcurrentTwins", func(t *testing.T) {
		t.Parallel()
		rb := recipeSetup(t)
		_, err := rb.board.Submit(ctx, leaderboard.Command{EventID: uuid.New(), UserID: "ada", Delta: 1})
		require.NoError(t, err)
		// The twins' connections carry an application_name of their own,
		// which tells their lock waits apart from other tests'.
		app := "recipe-twins-" + uuid.NewString()[:8]
		cc, err := pgx.ParseConfig(rb.connString)
		require.NoError(t, err)
		cc.RuntimeParams["application_name"] = app
		twinsDB := stdlib.OpenDB(*cc)
		defer twinsDB.Close()

		locker, err := rb.db.BeginTx(ctx, nil)
		require.NoError(t, err)
		defer locker.Rollback() //nolint:errcheck // rolled back below
		_, err = locker.ExecContext(ctx, `SELECT 1 FROM user_scores WHERE user_id = 'ada' FOR UPDATE`)
		require.NoError(t, err)

		const twins = 2
		match := uuid.New()
		var (
			wg      sync.WaitGroup
			results = make([]leaderboard.Result, twins)
			errs    = make([]error, twins)
		)
		for i := range twins {
			wg.Go(func() { results[i], errs[i] = recordWin(ctx, twinsDB, rb.board, match, "ada") })
		}
		require.Eventually(t, func() bool {
			var waiting int
			err := rb.db.QueryRowContext(ctx, `SELECT count(*) FROM pg_stat_activity
				WHERE application_name = $1 AND wait_event_type = 'Lock'`, app).Scan(&waiting)
			return err == nil && waiting == twins
		}, 10*time.Second, 5*time.Millisecond, "the twins never both waited for the lock")
		require.NoError(t, locker.Rollback())
		wg.Wait()

		fresh := 0
		for i := range twins {
			require.NoError(t, errs[i], "twin %d", i)
			if !results[i].Duplicate {
				fresh++
			}
		}
		require.Equal(t, 1, fresh, "exactly one twin applies the match")
		coins, score := rb.coinsAndScore(t)
		require.EqualValues(t, 4, score)
		require.EqualValues(t, 10, coins, "twins of one match credited the wallet more than once")
	})
}

// TestSubmitBatchTxRecipeOverlappingRunsPayOnce runs
// ExampleBoard_SubmitBatchTx's reward job twice at once (a cron overlap,
// two replicas): both statements wait behind a lock on ada's score row, so
// the second sees the first's commit mid-statement (ErrConcurrentSubmit).
// The job retries that once and reports the rewards as duplicates; it
// failed when the Example passed the error to log.Fatal.
func TestSubmitBatchTxRecipeOverlappingRunsPayOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	board, pg := recipeBoard(t, "season-7")
	_, err := pg.Pool.Exec(ctx, `CREATE TABLE season_payouts (season int PRIMARY KEY, users int NOT NULL)`)
	require.NoError(t, err)
	_, err = board.Submit(ctx, leaderboard.Command{EventID: uuid.New(), UserID: "ada", Delta: 1})
	require.NoError(t, err)

	// The jobs' connections carry an application_name of their own, which
	// tells their lock waits apart from other tests'.
	app := "recipe-rewards-" + uuid.NewString()[:8]
	pc := pg.Pool.Config()
	pc.ConnConfig.RuntimeParams["application_name"] = app
	jobs, err := pgxpool.NewWithConfig(ctx, pc)
	require.NoError(t, err)
	defer jobs.Close()

	locker, err := pg.Pool.Begin(ctx)
	require.NoError(t, err)
	defer locker.Rollback(ctx) //nolint:errcheck // rolled back below
	_, err = locker.Exec(ctx, `SELECT 1 FROM user_scores WHERE user_id = 'ada' FOR UPDATE`)
	require.NoError(t, err)

	const runs = 2
	var (
		wg      sync.WaitGroup
		results = make([][]leaderboard.Result, runs)
		errs    = make([]error, runs)
	)
	for i := range runs {
		wg.Go(func() { results[i], errs[i] = grantSeasonRewards(ctx, jobs, board, []string{"ada", "bob"}) })
	}
	require.Eventually(t, func() bool {
		var waiting int
		err := pg.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = $1 AND wait_event_type = 'Lock'`, app).Scan(&waiting)
		return err == nil && waiting == runs
	}, 10*time.Second, 5*time.Millisecond, "the runs never both waited for the lock")
	require.NoError(t, locker.Rollback(ctx))
	wg.Wait()

	fresh := 0
	for i := range runs {
		require.NoError(t, errs[i], "run %d", i)
		if !results[i][0].Duplicate {
			fresh++
		}
	}
	require.Equal(t, 1, fresh, "exactly one run grants the rewards")
	var score int64
	require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT score FROM user_scores WHERE user_id = 'ada'`).Scan(&score))
	require.EqualValues(t, 101, score, "the overlapping runs rewarded ada once")
}
