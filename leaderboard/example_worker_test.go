package leaderboard_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/google/uuid"

	"github.com/verity-go/verity/leaderboard"
)

// A worker runs for the life of the process: start Run in a goroutine and,
// at shutdown, cancel its context and wait for Run to return, which it
// does once its in-flight batch is settled.
func ExampleWorker_Run() {
	ctx := context.Background()
	// A migrated board in a schema and key prefix of its own, set up as in Example.
	board, cleanup, err := exampleBoard(ctx, leaderboard.Config{
		Name:                  "weekly-2026-48",
		ReadYourWritesTimeout: 10 * time.Second, // ample for the worker to project the submit
	})
	if err != nil {
		log.Fatal(err)
	}
	defer cleanup()
	worker, err := board.Worker(nil)
	if err != nil {
		log.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- worker.Run(runCtx) }()

	res, err := board.Submit(ctx, leaderboard.Command{EventID: uuid.New(), UserID: "ada", Delta: 42})
	if err != nil {
		log.Fatal(err)
	}
	top, err := board.Top(ctx, 10, leaderboard.AtLeast("ada", res.Version)) // waits for the worker
	if err != nil {
		log.Fatal(err)
	}
	for _, e := range top.Entries {
		fmt.Printf("%d. %s %d\n", e.Rank, e.UserID, e.Score)
	}
	fmt.Println("answered by:", top.Freshness.Source, "AtLeastMet:", top.Freshness.AtLeastMet)

	stop()
	if err := <-done; err != nil { // nil after a cancellation
		log.Fatal(err)
	}
	fmt.Println("worker stopped")
	// Output:
	// 1. ada 42
	// answered by: redis AtLeastMet: true
	// worker stopped
}
