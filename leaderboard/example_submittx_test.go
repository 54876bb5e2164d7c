package leaderboard_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver
	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/services"
	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
	"github.com/verity-go/verity/outbox"
)

// recordWin is the application's command: one database/sql transaction
// scores the win and credits the winner's wallet. The match id doubles as
// the event id: replaying the match is a duplicate, not a second win.
func recordWin(ctx context.Context, db *sql.DB, board *leaderboard.Board, matchID uuid.UUID, winner string) (leaderboard.Result, error) {
	res, err := recordWinTx(ctx, db, board, matchID, winner)
	if errors.Is(err, leaderboard.ErrConcurrentSubmit) {
		// A twin of this match (a client retry racing its original)
		// committed while the transaction ran, and aborted it. Run it once
		// more: it sees the twin and reports Duplicate.
		res, err = recordWinTx(ctx, db, board, matchID, winner)
	}
	return res, err
}

func recordWinTx(ctx context.Context, db *sql.DB, board *leaderboard.Board, matchID uuid.UUID, winner string) (leaderboard.Result, error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return leaderboard.Result{}, err
	}
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit
	res, err := board.SubmitTx(ctx, outbox.SQLTx(tx), leaderboard.Command{EventID: matchID, UserID: winner, Delta: 3})
	if err != nil {
		return leaderboard.Result{}, err
	}
	if res.Duplicate {
		// The first submission credited the wallet already: return its
		// result and commit nothing, or a replay would pay twice.
		return res, nil
	}
	if _, err := tx.ExecContext(ctx, `UPDATE wallets SET coins = coins + 10 WHERE user_id = $1`, winner); err != nil {
		return leaderboard.Result{}, err
	}
	return res, tx.Commit()
}

// A score change committed in the application's own database/sql
// transaction, together with the application's other writes, which a
// replayed command must not apply twice.
func ExampleBoard_SubmitTx() {
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

	cfg := &leaderboard.Config{Name: "weekly-2026-48", Schema: schema, KeyPrefix: prefix}
	if err := leaderboard.Migrate(ctx, pool, cfg); err != nil {
		log.Fatal(err)
	}
	board, err := leaderboard.New(pool, rdb, cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer board.Close() // stops the relay wake-ups; runs before pool.Close

	// The application's side of the story, on database/sql.
	db, err := sql.Open("pgx", pgURL)
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	if _, err := db.ExecContext(ctx, `CREATE TABLE wallets (user_id text PRIMARY KEY, coins bigint NOT NULL);
		INSERT INTO wallets VALUES ('ada', 0)`); err != nil {
		log.Fatal(err)
	}

	match := uuid.New()
	for range 2 { // the second call replays the match
		res, err := recordWin(ctx, db, board, match, "ada")
		if err != nil {
			log.Fatal(err)
		}
		var coins int64
		if err := db.QueryRowContext(ctx, `SELECT coins FROM wallets WHERE user_id = 'ada'`).Scan(&coins); err != nil {
			log.Fatal(err)
		}
		fmt.Printf("ada: score %d, version %d, duplicate %t, coins %d\n", res.Score, res.Version, res.Duplicate, coins)
	}
	// Output:
	// ada: score 3, version 1, duplicate false, coins 10
	// ada: score 3, version 1, duplicate true, coins 10
}
