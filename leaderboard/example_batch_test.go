package leaderboard_test

import (
	"context"
	"errors"
	"fmt"
	"log"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/verity-go/verity/leaderboard"
)

// A bulk import in one statement. A command imported before (its event id
// applied already) is reported as a duplicate with its original result, a
// user's commands apply in batch order, each with its own version, and one
// invalid command fails the whole batch, which writes nothing.
func ExampleBoard_SubmitBatch() {
	ctx := context.Background()
	// A migrated board in a schema and key prefix of its own, set up as in Example.
	board, cleanup, err := exampleBoard(ctx, leaderboard.Config{Name: "weekly-2026-48"})
	if err != nil {
		log.Fatal(err)
	}
	defer cleanup()

	imported := leaderboard.Command{EventID: uuid.New(), UserID: "ada", Delta: 30}
	if _, err := board.Submit(ctx, imported); err != nil { // an earlier, interrupted import
		log.Fatal(err)
	}
	cmds := []leaderboard.Command{
		imported,
		{EventID: uuid.New(), UserID: "bob", Delta: 45},
		{EventID: uuid.New(), UserID: "ada", Delta: 20},
		{EventID: uuid.New(), UserID: "ada", Delta: -5},
	}
	results, err := board.SubmitBatch(ctx, cmds)
	if err != nil {
		log.Fatal(err)
	}
	for i, res := range results {
		fmt.Printf("%s %+d: score %d, version %d, duplicate %t\n", cmds[i].UserID, cmds[i].Delta, res.Score, res.Version, res.Duplicate)
	}

	_, err = board.SubmitBatch(ctx, []leaderboard.Command{
		{EventID: uuid.New(), UserID: "cy", Delta: 10},
		{EventID: uuid.New(), UserID: "", Delta: 10},
	})
	var invalid *leaderboard.ValidationError
	if !errors.As(err, &invalid) {
		log.Fatal("want a *leaderboard.ValidationError, got ", err)
	}
	fmt.Printf("refused: command %d, field %s\n", invalid.Index, invalid.Field)
	// Output:
	// ada +30: score 30, version 1, duplicate true
	// bob +45: score 45, version 1, duplicate false
	// ada +20: score 50, version 2, duplicate false
	// ada -5: score 45, version 3, duplicate false
	// refused: command 1, field UserID
}

// Season rewards granted in the application's own pgx transaction, with
// the application's record of the payout: both commit, or neither. The
// reward's event ids derive from the season and the user, so a rerun of
// the job reports duplicates instead of paying twice.
func ExampleBoard_SubmitBatchTx() {
	ctx := context.Background()
	// A migrated board and its pool, set up as in Example.
	board, pool, cleanup, err := exampleBoardAndPool(ctx, leaderboard.Config{Name: "season-7"})
	if err != nil {
		log.Fatal(err)
	}
	defer cleanup()
	if _, err := pool.Exec(ctx, `CREATE TABLE season_payouts (season int PRIMARY KEY, users int NOT NULL)`); err != nil {
		log.Fatal(err)
	}

	for range 2 { // the job runs twice
		winners := []string{"ada", "bob"}
		results, err := grantSeasonRewards(ctx, pool, board, winners)
		if err != nil {
			log.Fatal(err)
		}
		for i, res := range results {
			fmt.Printf("%s: score %d, duplicate %t\n", winners[i], res.Score, res.Duplicate)
		}
	}
	// Output:
	// ada: score 100, duplicate false
	// bob: score 100, duplicate false
	// ada: score 100, duplicate true
	// bob: score 100, duplicate true
}

// grantSeasonRewards is the reward job of ExampleBoard_SubmitBatchTx: one
// pgx transaction scores the rewards and records the payout.
func grantSeasonRewards(ctx context.Context, pool *pgxpool.Pool, board *leaderboard.Board, winners []string) ([]leaderboard.Result, error) {
	results, err := grantSeasonRewardsTx(ctx, pool, board, winners)
	if errors.Is(err, leaderboard.ErrConcurrentSubmit) {
		// An overlapping run committed one of the rewards while this
		// transaction ran, and aborted it. Run it once more: it sees that
		// run's rewards and reports them as duplicates.
		results, err = grantSeasonRewardsTx(ctx, pool, board, winners)
	}
	return results, err
}

func grantSeasonRewardsTx(ctx context.Context, pool *pgxpool.Pool, board *leaderboard.Board, winners []string) ([]leaderboard.Result, error) {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return nil, err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	cmds := make([]leaderboard.Command, len(winners))
	for i, user := range winners {
		id := uuid.NewSHA1(uuid.NameSpaceURL, []byte("season-7-reward/"+user))
		cmds[i] = leaderboard.Command{EventID: id, UserID: user, Delta: 100}
	}
	results, err := board.SubmitBatchTx(ctx, tx, cmds)
	if err != nil {
		return nil, err
	}
	if _, err := tx.Exec(ctx, `INSERT INTO season_payouts VALUES (7, $1) ON CONFLICT DO NOTHING`, len(winners)); err != nil {
		return nil, err
	}
	return results, tx.Commit(ctx)
}
