package leaderboard_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/google/uuid"

	"github.com/verity-go/verity/leaderboard"
)

// Read-your-writes: AtLeast makes a read reflect a Submit's version. No
// worker projects the change at first, so the wait runs out and
// FallbackToPostgres answers from the source of truth; once a worker has
// projected it, Redis answers.
func ExampleBoard_Rank() {
	ctx := context.Background()
	// A migrated board in a schema and key prefix of its own, set up as in Example.
	board, cleanup, err := exampleBoard(ctx, leaderboard.Config{
		Name:                  "weekly-2026-48",
		ReadYourWritesTimeout: 50 * time.Millisecond, // how long AtLeast waits for the projection
	})
	if err != nil {
		log.Fatal(err)
	}
	defer cleanup()

	if _, err := board.Submit(ctx, leaderboard.Command{EventID: uuid.New(), UserID: "bob", Delta: 45}); err != nil {
		log.Fatal(err)
	}
	res, err := board.Submit(ctx, leaderboard.Command{EventID: uuid.New(), UserID: "ada", Delta: 30})
	if err != nil {
		log.Fatal(err)
	}
	mine := leaderboard.AtLeast("ada", res.Version)

	entry, fresh, err := board.Rank(ctx, "ada", mine, leaderboard.WithPolicy(leaderboard.FallbackToPostgres))
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("ada: rank %d, score %d, from %s, AtLeastMet %t\n", entry.Rank, entry.Score, fresh.Source, fresh.AtLeastMet)

	worker, err := board.Worker(nil)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := worker.Drain(ctx); err != nil {
		log.Fatal(err)
	}
	entry, fresh, err = board.Rank(ctx, "ada", mine)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("ada: rank %d, score %d, from %s, AtLeastMet %t\n", entry.Rank, entry.Score, fresh.Source, fresh.AtLeastMet)
	// Output:
	// ada: rank 2, score 30, from postgres, AtLeastMet true
	// ada: rank 2, score 30, from redis, AtLeastMet true
}
