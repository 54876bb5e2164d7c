package projection_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/services"
	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
	"github.com/verity-go/verity/projection"
)

// exampleRedis connects to the Redis the examples resolve, with a key
// prefix of their own that is removed afterwards.
func exampleRedis() (client *redis.Client, prefix, pgURL string, cleanup func(), err error) {
	pgURL, redisURL, done, err := services.ResolveForExample()
	if err != nil {
		return nil, "", "", nil, err
	}
	opt, err := redis.ParseURL(redisURL)
	if err != nil {
		done()
		return nil, "", "", nil, err
	}
	client = redis.NewClient(opt)
	prefix = "example:projection:" + services.RandomSuffix(8) + ":"
	return client, prefix, pgURL, func() {
		_ = testenv.DeletePrefix(context.Background(), client, prefix)
		_ = client.Close()
		done()
	}, nil
}

// A weekly leaderboard projected from score records: a redelivered record is
// a duplicate, an older version arriving late is stale, and neither changes
// the ranking.
func Example() {
	ctx := context.Background()
	client, prefix, _, cleanup, err := exampleRedis()
	if err != nil {
		fmt.Println("services unavailable:", err)
		return
	}
	defer cleanup()

	projector, err := projection.NewRedisProjector(client,
		projection.StreamMapper{"scores": projection.SortedSetMapper("weekly")},
		&projection.Config{Prefix: prefix})
	if err != nil {
		panic(err)
	}
	score := func(user string, version, points int64) outbox.Record {
		return outbox.Record{Message: outbox.Message{EventID: uuid.New(), Stream: "scores", Key: user,
			Version: version, Payload: []byte(strconv.FormatInt(points, 10))}}
	}

	first := []outbox.Record{score("user-a", 1, 10), score("user-b", 1, 25), score("user-a", 2, 17)}
	outcomes, err := projector.Project(ctx, first)
	if err != nil {
		panic(err)
	}
	fmt.Println("first delivery:", outcomes)

	// The relay delivers the same batch again (it crashed before its ack),
	// and then user-a's version 1 once more, late.
	outcomes, err = projector.Project(ctx, append(first, score("user-a", 1, 10)))
	if err != nil {
		panic(err)
	}
	fmt.Println("redelivery:", outcomes)

	board := projector.Keyspace().ValueKey(projection.Target{Kind: projection.KindSortedSet, Name: "weekly"})
	ranking, err := client.ZRevRangeWithScores(ctx, board, 0, -1).Result()
	if err != nil {
		panic(err)
	}
	for i, z := range ranking {
		fmt.Printf("%d. %s %.0f\n", i+1, z.Member, z.Score)
	}
	// Output:
	// first delivery: [applied applied applied]
	// redelivery: [stale duplicate duplicate stale]
	// 1. user-b 25
	// 2. user-a 17
}

// The projector is an outbox.Handler: a relay delivers what the application
// committed to the outbox, in the same transaction as its own state.
func ExampleRedisProjector_relay() {
	ctx := context.Background()
	client, prefix, pgURL, cleanup, err := exampleRedis()
	if err != nil {
		fmt.Println("services unavailable:", err)
		return
	}
	defer cleanup()
	pool, err := pgxpool.New(ctx, pgURL)
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	// The example's own schema (its URL's search_path) holds the outbox.
	var schema string
	if err := pool.QueryRow(ctx, "SELECT current_schema()").Scan(&schema); err != nil {
		panic(err)
	}
	outboxCfg := &outbox.Config{Schema: schema}
	if err := outbox.Migrate(ctx, pool, outboxCfg); err != nil {
		panic(err)
	}
	writer, err := outbox.NewWriter(outboxCfg)
	if err != nil {
		panic(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE products (id bigint PRIMARY KEY, price_cents bigint NOT NULL, version bigint NOT NULL);
		INSERT INTO products VALUES (41, 4900, 7)`); err != nil {
		panic(err)
	}

	// The application's command: change the state, append the message, in
	// one transaction (BeginFunc rolls it back if either fails).
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var version int64
		err := tx.QueryRow(ctx, `UPDATE products SET price_cents = 4400, version = version + 1 WHERE id = 41 RETURNING version`).Scan(&version)
		if err != nil {
			return err
		}
		return writer.Append(ctx, tx,
			outbox.Message{EventID: uuid.New(), Stream: "products", Key: "41", Version: version, Payload: []byte(`{"price_cents":4400}`)})
	})
	if err != nil {
		panic(err)
	}

	projector, err := projection.NewRedisProjector(client,
		projection.StreamMapper{"products": projection.DocumentMapper("product:")},
		&projection.Config{Prefix: prefix})
	if err != nil {
		panic(err)
	}
	relay, err := outbox.NewRelay(pool, projector, &outbox.RelayConfig{Schema: schema})
	if err != nil {
		panic(err)
	}
	n, err := relay.RunOnce(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println("claimed:", n) // handed to the projector; a failed record would be retried

	product := projection.Target{Kind: projection.KindDocument, Name: "product:41"}
	doc, err := client.Get(ctx, projector.Keyspace().ValueKey(product)).Result()
	if err != nil {
		panic(err)
	}
	version, err := client.Get(ctx, projector.Keyspace().VersionKey(product)).Result()
	if err != nil {
		panic(err)
	}
	fmt.Println(doc, "at version", version)
	// Output:
	// claimed: 1
	// {"price_cents":4400} at version 8
}

// Ids may contain anything, braces included: they are encoded so that all
// keys of a collection stay in one Cluster slot. A version applied again
// is a duplicate, or a conflict if its value differs; a value outside the
// exact range of a Redis score is refused before anything is written.
func ExampleGate_Apply() {
	ctx := context.Background()
	client, prefix, _, cleanup, err := exampleRedis()
	if err != nil {
		fmt.Println("services unavailable:", err)
		return
	}
	defer cleanup()

	ks, err := projection.NewKeyspace(prefix)
	if err != nil {
		panic(err)
	}
	gate := projection.NewGate(client, ks)
	member := func(name string) projection.Target {
		return projection.Target{Kind: projection.KindSortedSet, Name: "season{2}", Member: name}
	}
	outcomes, err := gate.Apply(ctx, []projection.Write{
		{Target: member("a}b"), Version: 1, Value: projection.Value{Score: 5}},
		{Target: member("a}b"), Version: 1, Value: projection.Value{Score: 5}}, // a redelivery
		{Target: member("a}b"), Version: 1, Value: projection.Value{Score: 6}}, // one version, two states
		{Target: member("{c"), Version: 9_223_372_036_854_775_807, Value: projection.Value{Score: projection.MaxScore}},
	})
	fmt.Println(outcomes, err)
	fmt.Println(ks.Slot(member("x")) == projection.KeySlot(ks.ValueKey(member("x"))),
		ks.Slot(member("x")) == projection.KeySlot(ks.VersionKey(member("x"))))

	_, err = gate.Apply(ctx, []projection.Write{
		{Target: member("d"), Version: 1, Value: projection.Value{Score: projection.MaxScore + 1}},
	})
	fmt.Println(err)
	// Output:
	// [applied duplicate conflict applied] <nil>
	// true true
	// projection: write 0 (sorted-set "season{2}" member "d"): score 9007199254740993 outside [-9007199254740992, 9007199254740992]
}

// A large leaderboard keeps its versions in small hashes: Redis stores each
// bucket as a compact listpack. A writer configured with another bucket
// count is refused and writes nothing; reconcile's Rebuild migrates a
// collection from one count to another.
func ExampleKeyspace_WithVersionBuckets() {
	ctx := context.Background()
	client, prefix, _, cleanup, err := exampleRedis()
	if err != nil {
		fmt.Println("services unavailable:", err)
		return
	}
	defer cleanup()

	// About expected members / 64: 100,000 players → 1,563 buckets.
	mapper := projection.StreamMapper{"scores": projection.SortedSetMapper("global")}
	projector, err := projection.NewRedisProjector(client, mapper, &projection.Config{Prefix: prefix, VersionBuckets: 1563})
	if err != nil {
		panic(err)
	}
	ks := projector.Keyspace()
	ada := projection.Target{Kind: projection.KindSortedSet, Name: "global", Member: "ada"}
	out, err := projector.Gate().Apply(ctx, []projection.Write{{Target: ada, Version: 3, Value: projection.Value{Score: 42}}})
	fmt.Println(out, err)
	version, err := client.HGet(ctx, ks.VersionKey(ada), "ada").Result()
	if err != nil {
		panic(err)
	}
	encoding, err := client.ObjectEncoding(ctx, ks.VersionKey(ada)).Result()
	if err != nil {
		panic(err)
	}
	layout, err := client.Get(ctx, ks.LayoutKey("global", projection.KindSortedSet)).Result()
	if err != nil {
		panic(err)
	}
	fmt.Println(len(ks.VersionKeys("global", projection.KindSortedSet)), version, encoding, layout)

	// A deployment still on one version hash per collection.
	flat, err := projection.NewKeyspace(prefix)
	if err != nil {
		panic(err)
	}
	_, err = projection.NewGate(client, flat).Apply(ctx, []projection.Write{{Target: ada, Version: 2, Value: projection.Value{Score: 7}}})
	var mismatch *projection.LayoutMismatchError
	fmt.Println(errors.As(err, &mismatch), mismatch.Stored, mismatch.Configured)
	// Output:
	// [applied] <nil>
	// 1563 3 listpack 1563
	// true 1563 0
}
