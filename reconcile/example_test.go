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

// A leaderboard whose Redis copy was hand-edited: user-a's score became 999
// while PostgreSQL still says 17. One run finds and repairs it, and Redis
// ranks the users as PostgreSQL does again.
func Example() {
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

	// The source of truth.
	_, err = pool.Exec(ctx, `
		CREATE TABLE user_scores (user_id text PRIMARY KEY, score bigint NOT NULL, version bigint NOT NULL);
		INSERT INTO user_scores VALUES ('user-a', 17, 2), ('user-b', 25, 1)`)
	if err != nil {
		fmt.Println(err)
		return
	}

	// The projection, as the outbox relay and the gate left it...
	ks, err := projection.NewKeyspace("example:reconcile:" + services.RandomSuffix(8) + ":")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer testenv.DeletePrefix(ctx, client, ks.Prefix()) //nolint:errcheck // best effort, like the schema cleanup
	gate := projection.NewGate(client, ks)
	board := func(member string) projection.Target {
		return projection.Target{Kind: projection.KindSortedSet, Name: "weekly", Member: member}
	}
	_, err = gate.Apply(ctx, []projection.Write{
		{Target: board("user-a"), Version: 2, Value: projection.Value{Score: 17}},
		{Target: board("user-b"), Version: 1, Value: projection.Value{Score: 25}},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	leaderboard := ks.ValueKey(board(""))
	// ...and a hand edit that no outbox message will ever undo.
	if err := client.ZAdd(ctx, leaderboard, redis.Z{Score: 999, Member: "user-a"}).Err(); err != nil {
		fmt.Println(err)
		return
	}

	source, err := reconcile.NewSQLSource(pool, &reconcile.SQLSourceConfig{
		Table: "user_scores", KeyColumn: "user_id", VersionColumn: "version", ValueColumn: "score",
		Kind: projection.KindSortedSet,
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
	report, err := r.Run(ctx, reconcile.RunOptions{})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("checked %d: %d current, %d corrupt; repaired %d\n",
		report.Checked, report.Counts[reconcile.ClassCurrent], report.Counts[reconcile.ClassCorrupt], report.Repaired)
	fmt.Println("corrupt:", report.Examples[reconcile.ClassCorrupt][0].Key)

	ranking, err := client.ZRevRangeWithScores(ctx, leaderboard, 0, -1).Result()
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, z := range ranking {
		fmt.Println(z.Member, z.Score)
	}
	// Output:
	// checked 2: 1 current, 1 corrupt; repaired 1
	// corrupt: user-a
	// user-b 25
	// user-a 17
}
