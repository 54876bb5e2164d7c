package leaderboard_test

import (
	"context"
	"errors"
	"fmt"
	"log"

	"github.com/google/uuid"

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
