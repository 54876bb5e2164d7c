package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/verity-go/verity/outbox"
)

// A message its handler keeps failing goes to the dead-letter table after
// MaxAttempts attempts. Once the cause is fixed, ReplayDead moves it back to
// the outbox, due at once with its attempts reset.
func ExampleRelay_ReplayDead() {
	ctx := context.Background()
	// A migrated outbox in a schema of its own, set up as in Example.
	pool, schema, writer, cleanup, err := exampleOutbox(ctx)
	if err != nil {
		panic(err)
	}
	defer cleanup()
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return writer.Append(ctx, tx, outbox.Message{EventID: uuid.New(), Stream: "invoices", Key: "inv-7", Version: 1, Payload: []byte(`{"total_cents":4400}`)})
	})
	if err != nil {
		panic(err)
	}

	gatewayDown := true
	relay, err := outbox.NewRelay(pool, outbox.HandlerFunc(func(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
		results := make([]outbox.Result, len(batch))
		for i, rec := range batch {
			if gatewayDown {
				results[i].Err = errors.New("payment gateway unavailable")
			}
			fmt.Printf("attempt %d of %s: failed %t\n", rec.Attempts, rec.Key, gatewayDown)
		}
		return results, nil
	}), &outbox.RelayConfig{
		Schema:      schema,
		MaxAttempts: 2,
		// Retry at once, so that the example need not wait out a backoff.
		RetryBackoffMin: time.Millisecond,
		RetryBackoffMax: time.Millisecond,
		Logger:          slog.New(slog.DiscardHandler), // the relay logs failures at Warn
	})
	if err != nil {
		panic(err)
	}
	for {
		if _, err := relay.RunOnce(ctx); err != nil {
			panic(err)
		}
		stats, err := relay.Stats(ctx)
		if err != nil {
			panic(err)
		}
		if stats.Pending == 0 {
			break
		}
		time.Sleep(5 * time.Millisecond) // the retry's backoff
	}

	dead, err := relay.DeadLetters(ctx, 0, 100)
	if err != nil {
		panic(err)
	}
	for _, d := range dead {
		fmt.Printf("dead letter %s after %d attempts: %s\n", d.Key, d.Attempts, d.LastError)
	}

	gatewayDown = false // the cause, fixed
	n, err := relay.ReplayDead(ctx, outbox.ReplayFilter{Stream: "invoices"})
	if err != nil {
		panic(err)
	}
	fmt.Println("replayed:", n)
	if _, err := relay.RunOnce(ctx); err != nil {
		panic(err)
	}
	stats, err := relay.Stats(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println("pending:", stats.Pending, "dead letters:", stats.DeadLetters)
	// Output:
	// attempt 1 of inv-7: failed true
	// attempt 2 of inv-7: failed true
	// dead letter inv-7 after 2 attempts: payment gateway unavailable
	// replayed: 1
	// attempt 1 of inv-7: failed false
	// pending: 0 dead letters: 0
}
