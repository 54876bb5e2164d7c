package reconcile_test

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/services"
	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/projection"
	"github.com/verity-go/verity/reconcile"
)

// Rebuild replaces a drifted leaderboard wholesale: the orphan disappears
// and the hand-edited score is corrected, with a single atomic switch.
func ExampleReconciler_Rebuild() {
	ctx := context.Background()
	pgURL, redisURL, cleanup, err := services.ResolveForExample()
	if err != nil {
		fmt.Println("services unavailable:", err)
		return
	}
	defer cleanup()
	pool, err := pgxpool.New(ctx, pgURL)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	opt, err := redis.ParseURL(redisURL)
	if err != nil {
		fmt.Println(err)
		return
	}
	client := redis.NewClient(opt)
	defer client.Close()

	if _, err := pool.Exec(ctx, `
		CREATE TABLE user_scores (board text, user_id text, score bigint NOT NULL, version bigint NOT NULL,
			PRIMARY KEY (board, user_id));
		INSERT INTO user_scores VALUES ('weekly', 'user-a', 17, 2), ('weekly', 'user-b', 25, 1), ('daily', 'user-c', 5, 1)`); err != nil {
		fmt.Println(err)
		return
	}

	ks, err := projection.NewKeyspace("example:rebuild:" + services.RandomSuffix(8) + ":")
	if err != nil {
		fmt.Println(err)
		return
	}
	weekly := projection.Target{Kind: projection.KindSortedSet, Name: "weekly"}
	leaderboard := ks.ValueKey(weekly)
	defer testenv.DeletePrefix(ctx, client, ks.Prefix()) //nolint:errcheck // best effort, like the schema cleanup
	// A hand-edited score, and a user deleted from PostgreSQL but not from Redis.
	err = client.ZAdd(ctx, leaderboard, redis.Z{Score: 999, Member: "user-a"}, redis.Z{Score: 40, Member: "deleted-user"}).Err()
	if err != nil {
		fmt.Println(err)
		return
	}

	source, err := reconcile.NewSQLSource(pool, &reconcile.SQLSourceConfig{
		Table: "user_scores", KeyColumn: "user_id", VersionColumn: "version", ValueColumn: "score",
		Kind: projection.KindSortedSet, Filters: []reconcile.Filter{{Column: "board", Value: "weekly"}},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	r, err := reconcile.New(source, reconcile.Target{
		Client: client, Keyspace: ks, Kind: projection.KindSortedSet, Name: "weekly",
	}, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	report, err := r.Rebuild(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("copied %d rows, switched: %v\n", report.Rows, report.Switched)
	ranking, err := client.ZRevRangeWithScores(ctx, leaderboard, 0, -1).Result()
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, z := range ranking {
		fmt.Println(z.Member, z.Score)
	}
	// Output:
	// copied 2 rows, switched: true
	// user-b 25
	// user-a 17
}
