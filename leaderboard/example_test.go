package leaderboard_test

import (
	"context"
	"fmt"
	"log"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/services"
	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
)

func Example() {
	ctx := context.Background()
	pgURL, redisURL, cleanup, err := services.ResolveForExample()
	if err != nil {
		log.Fatal(err)
	}
	defer cleanup()
	pool, err := pgxpool.New(ctx, pgURL)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	var schema string // ResolveForExample made a fresh schema the search_path
	if err := pool.QueryRow(ctx, "SELECT current_schema()").Scan(&schema); err != nil {
		log.Fatal(err)
	}
	redisOpts, err := redis.ParseURL(redisURL)
	if err != nil {
		log.Fatal(err)
	}
	rdb := redis.NewClient(redisOpts)
	defer rdb.Close()
	prefix := "verity-example-" + services.RandomSuffix(8) + ":"
	defer testenv.DeletePrefix(context.Background(), rdb, prefix) //nolint:errcheck // best-effort cleanup

	cfg := &leaderboard.Config{Name: "weekly-2026-48", Schema: schema, KeyPrefix: prefix}
	if err := leaderboard.Migrate(ctx, pool, cfg); err != nil {
		log.Fatal(err)
	}
	board, err := leaderboard.New(pool, rdb, cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer board.Close() // stops the relay wake-ups; runs before pool.Close

	// Clients send a stable event id with every command.
	retried := leaderboard.Command{EventID: uuid.New(), UserID: "bob", Delta: 45}
	for _, cmd := range []leaderboard.Command{
		{EventID: uuid.New(), UserID: "ada", Delta: 30},
		retried,
		{EventID: uuid.New(), UserID: "cy", Delta: 30},
		retried, // a retry: no second effect
	} {
		res, err := board.Submit(ctx, cmd)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("%s: score %d, version %d, duplicate %t\n", cmd.UserID, res.Score, res.Version, res.Duplicate)
	}

	// A worker projects the outbox into Redis (normally Worker.Run, in a
	// goroutine: see its example).
	worker, err := board.Worker(nil)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := worker.Drain(ctx); err != nil {
		log.Fatal(err)
	}

	top, err := board.Top(ctx, 10)
	if err != nil {
		log.Fatal(err)
	}
	for _, e := range top.Entries {
		fmt.Printf("%d. %s %d\n", e.Rank, e.UserID, e.Score)
	}
	// Lag's value depends on the database's round trip: print only whether
	// it is within MaxLag (5 s by default), where Redis answers are trusted.
	fresh := top.Freshness.Lag >= 0 && top.Freshness.Lag <= leaderboard.MaxLagDefault
	fmt.Println("answered by:", top.Freshness.Source, "within MaxLag:", fresh)

	// Prizes come from PostgreSQL, never from the projection.
	winners, err := board.Authoritative(ctx, 1)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("payout to:", winners[0].UserID)

	// Output:
	// ada: score 30, version 1, duplicate false
	// bob: score 45, version 1, duplicate false
	// cy: score 30, version 1, duplicate false
	// bob: score 45, version 1, duplicate true
	// 1. bob 45
	// 2. ada 30
	// 3. cy 30
	// answered by: redis within MaxLag: true
	// payout to: bob
}
