package leaderboard_test

import (
	"context"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/services"
	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
)

// exampleBoard migrates and returns a board configured by cfg, as Example
// does in full, in a PostgreSQL schema and under a Redis key prefix of its
// own (it sets cfg.Schema and cfg.KeyPrefix). cleanup closes the board and
// the clients and removes the schema and the keys.
func exampleBoard(ctx context.Context, cfg leaderboard.Config) (board *leaderboard.Board, cleanup func(), err error) {
	board, _, cleanup, err = exampleBoardAndPool(ctx, cfg)
	return board, cleanup, err
}

// exampleBoardAndPool is exampleBoard that also returns the board's pool,
// for examples that open their own transactions.
func exampleBoardAndPool(ctx context.Context, cfg leaderboard.Config) (board *leaderboard.Board, pool *pgxpool.Pool, cleanup func(), err error) {
	pgURL, redisURL, dropSchema, err := services.ResolveForExample()
	if err != nil {
		return nil, nil, nil, err
	}
	var undo []func()
	cleanup = func() {
		for i := len(undo) - 1; i >= 0; i-- {
			undo[i]()
		}
	}
	undo = append(undo, dropSchema)
	fail := func(err error) (*leaderboard.Board, *pgxpool.Pool, func(), error) {
		cleanup()
		return nil, nil, nil, err
	}
	pool, err = pgxpool.New(ctx, pgURL)
	if err != nil {
		return fail(err)
	}
	undo = append(undo, pool.Close)
	if err := pool.QueryRow(ctx, "SELECT current_schema()").Scan(&cfg.Schema); err != nil {
		return fail(err)
	}
	redisOpts, err := redis.ParseURL(redisURL)
	if err != nil {
		return fail(err)
	}
	rdb := redis.NewClient(redisOpts)
	cfg.KeyPrefix = "verity-example-" + services.RandomSuffix(8) + ":"
	undo = append(undo, func() {
		_ = testenv.DeletePrefix(context.Background(), rdb, cfg.KeyPrefix) // best-effort cleanup
		_ = rdb.Close()
	})
	if err := leaderboard.Migrate(ctx, pool, &cfg); err != nil {
		return fail(err)
	}
	board, err = leaderboard.New(pool, rdb, &cfg)
	if err != nil {
		return fail(err)
	}
	undo = append(undo, board.Close) // stops the relay wake-ups, before pool.Close
	return board, pool, cleanup, nil
}
