package outbox_test

import (
	"context"
	"fmt"
	"strings"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/verity-go/verity/internal/services"
	"github.com/verity-go/verity/outbox"
)

// A score command applied with an idempotency record and an outbox message
// in one transaction, retried by the client, then delivered by a relay.
func Example() {
	ctx := context.Background()
	pgURL, _, cleanup, err := services.ResolveForExample()
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
	var schema string
	if err := pool.QueryRow(ctx, `SELECT current_schema()`).Scan(&schema); err != nil {
		panic(err)
	}

	cfg := &outbox.Config{Schema: schema}
	if err := outbox.Migrate(ctx, pool, cfg); err != nil {
		panic(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE scores (user_id text PRIMARY KEY, score bigint NOT NULL, version bigint NOT NULL)`); err != nil {
		panic(err)
	}
	writer, err := outbox.NewWriter(cfg)
	if err != nil {
		panic(err)
	}

	// addScore is the command handler: one transaction records the command,
	// changes the state row and appends the absolute new state.
	addScore := func(eventID uuid.UUID, user string, delta int64) (string, error) {
		var answer string
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			command := fmt.Sprintf("add %d to %s", delta, user)
			cmd, err := writer.RecordCommand(ctx, tx, eventID, outbox.Fingerprint([]byte(command)))
			if err != nil {
				return err
			}
			if cmd.Duplicate {
				answer = "duplicate: " + string(cmd.Result)
				return nil
			}
			var score, version int64
			err = tx.QueryRow(ctx, `INSERT INTO scores VALUES ($1, $2, 1)
				ON CONFLICT (user_id) DO UPDATE SET score = scores.score + $2, version = scores.version + 1
				RETURNING score, version`, user, delta).Scan(&score, &version)
			if err != nil {
				return err
			}
			answer = fmt.Sprintf("score %d at version %d", score, version)
			if err := writer.StoreCommandResult(ctx, tx, eventID, []byte(answer)); err != nil {
				return err
			}
			return writer.Append(ctx, tx, outbox.Message{EventID: eventID, Stream: "leaderboard", Key: user,
				Version: version, Payload: fmt.Appendf(nil, "%d", score)})
		})
		return answer, err
	}

	first, second := uuid.New(), uuid.New()
	for _, call := range []struct {
		id    uuid.UUID
		delta int64
	}{{first, 10}, {first, 10}, {second, 7}} { // the second call is a client retry
		answer, err := addScore(call.id, "user-a", call.delta)
		if err != nil {
			panic(err)
		}
		fmt.Println("command:", answer)
	}

	relay, err := outbox.NewRelay(pool, outbox.HandlerFunc(func(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
		for _, rec := range batch {
			fmt.Printf("deliver %s %s v%d: %s (attempt %d)\n", rec.Stream, rec.Key, rec.Version, rec.Payload, rec.Attempts)
		}
		return make([]outbox.Result, len(batch)), nil
	}), &outbox.RelayConfig{Schema: schema})
	if err != nil {
		panic(err)
	}
	if _, err := relay.RunOnce(ctx); err != nil {
		panic(err)
	}
	stats, err := relay.Stats(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println("pending after delivery:", stats.Pending)

	// Output:
	// command: score 10 at version 1
	// command: duplicate: score 10 at version 1
	// command: score 17 at version 2
	// deliver leaderboard user-a v1: 10 (attempt 1)
	// deliver leaderboard user-a v2: 17 (attempt 1)
	// pending after delivery: 0
}

// The migration as SQL text, for a migration tool; identifiers are quoted.
func ExampleMigrationSQL() {
	script, err := outbox.MigrationSQL(&outbox.Config{Schema: "app", Table: "events_outbox"})
	if err != nil {
		panic(err)
	}
	for _, line := range strings.Split(script, "\n") {
		if strings.HasPrefix(line, "CREATE TABLE") {
			fmt.Println(line)
		}
	}
	// Output:
	// CREATE TABLE IF NOT EXISTS "app"."events_outbox" (
	// CREATE TABLE IF NOT EXISTS "app"."events_outbox_dead" (
	// CREATE TABLE IF NOT EXISTS "app"."events_outbox_idempotency" (
	// CREATE TABLE IF NOT EXISTS "app"."events_outbox_leases" (
}
