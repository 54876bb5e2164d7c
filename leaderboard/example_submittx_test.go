package leaderboard_test

import (
	"context"
	"database/sql"
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

// A score change committed in the application's own database/sql
// transaction, together with the application's other writes.
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
	if _, err := db.ExecContext(ctx, `CREATE TABLE matches (id uuid PRIMARY KEY, winner text NOT NULL)`); err != nil {
		log.Fatal(err)
	}

	recordWin := func(matchID uuid.UUID, winner string) (leaderboard.Result, error) {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return leaderboard.Result{}, err
		}
		defer tx.Rollback() //nolint:errcheck // a no-op after Commit
		if _, err := tx.ExecContext(ctx, `INSERT INTO matches (id, winner) VALUES ($1, $2) ON CONFLICT DO NOTHING`, matchID, winner); err != nil {
			return leaderboard.Result{}, err
		}
		// The match id doubles as the event id: replaying the match is a
		// duplicate, not a second win.
		res, err := board.SubmitTx(ctx, outbox.SQLTx(tx), leaderboard.Command{EventID: matchID, UserID: winner, Delta: 3})
		if err != nil {
			return leaderboard.Result{}, err
		}
		return res, tx.Commit()
	}

	match := uuid.New()
	for range 2 {
		// A leaderboard.ErrConcurrentSubmit here would mean a twin committed
		// while the transaction ran: calling recordWin again reports Duplicate.
		res, err := recordWin(match, "ada")
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("ada: score %d, version %d, duplicate %t\n", res.Score, res.Version, res.Duplicate)
	}
	// Output:
	// ada: score 3, version 1, duplicate false
	// ada: score 3, version 1, duplicate true
}
