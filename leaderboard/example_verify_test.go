package leaderboard_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/services"
	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
	"github.com/verity-go/verity/reconcile"
)

// A board that must not answer from a Redis that lost its data: with
// RequireVerifiedProjection, reads treat the projection as of unknown
// freshness until Verify has found it complete, and again as soon as
// Redis loses the board's keys.
func ExampleBoard_Verify() {
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
	var schema string
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

	cfg := &leaderboard.Config{
		Name: "season-7", Schema: schema, KeyPrefix: prefix,
		ReadPolicy:                leaderboard.FailClosed,
		RequireVerifiedProjection: true,
		LagProbeInterval:          time.Millisecond, // measure on every read, for the example
	}
	if err := leaderboard.Migrate(ctx, pool, cfg); err != nil {
		log.Fatal(err)
	}
	board, err := leaderboard.New(pool, rdb, cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer board.Close()
	worker, err := board.Worker(nil)
	if err != nil {
		log.Fatal(err)
	}
	for _, user := range []string{"ada", "bob"} {
		if _, err := board.Submit(ctx, leaderboard.Command{EventID: uuid.New(), UserID: user, Delta: 10}); err != nil {
			log.Fatal(err)
		}
	}
	if _, err := worker.Drain(ctx); err != nil {
		log.Fatal(err)
	}
	read := func() {
		time.Sleep(2 * time.Millisecond) // past the probe interval
		top, err := board.Top(ctx, 10)
		switch {
		case errors.Is(err, leaderboard.ErrStale):
			fmt.Println("refused: projection not verified")
		case err != nil:
			log.Fatal(err)
		default:
			fmt.Println("entries:", len(top.Entries))
		}
	}
	verify := func() {
		report, verified, err := board.Verify(ctx, nil)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("verified %t, missing entries repaired: %d\n", verified, report.RepairedByClass[reconcile.ClassMissing])
	}

	read() // a new board has never been verified
	verify()
	read()
	// Redis restarts without persistence: the board's keys are gone.
	if err := testenv.DeletePrefix(ctx, rdb, prefix); err != nil {
		log.Fatal(err)
	}
	read()
	verify()
	read()

	// Output:
	// refused: projection not verified
	// verified true, missing entries repaired: 0
	// entries: 2
	// refused: projection not verified
	// verified true, missing entries repaired: 2
	// entries: 2
}
