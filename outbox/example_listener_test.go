package outbox_test

import (
	"context"
	"fmt"
	"sync"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/verity-go/verity/outbox"
)

// Relays serving different streams of one outbox, in one process, share a
// Listener: one LISTEN connection between them instead of one each. Each
// relay is still woken only by its own stream's rows.
func ExampleListener() {
	ctx := context.Background()
	// A migrated outbox in a schema of its own, set up as in Example.
	pool, schema, writer, cleanup, err := exampleOutbox(ctx)
	if err != nil {
		panic(err)
	}
	defer cleanup()

	listener, err := outbox.NewListener(pool, &outbox.ListenerConfig{Schema: schema})
	if err != nil {
		panic(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	var running sync.WaitGroup
	delivered := map[string]chan string{"prices": make(chan string, 1), "stock": make(chan string, 1)}
	for stream, out := range delivered {
		relay, err := outbox.NewRelay(pool, outbox.HandlerFunc(func(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			for _, rec := range batch {
				out <- fmt.Sprintf("%s relay: %s = %s", stream, rec.Key, rec.Payload)
			}
			return make([]outbox.Result, len(batch)), nil
		}), &outbox.RelayConfig{Schema: schema, Streams: []string{stream}, Listener: listener})
		if err != nil {
			panic(err)
		}
		running.Go(func() {
			if err := relay.Run(runCtx); err != nil {
				panic(err)
			}
		})
	}

	for _, m := range []outbox.Message{
		{EventID: uuid.New(), Stream: "prices", Key: "sku-1", Version: 1, Payload: []byte("9.99")},
		{EventID: uuid.New(), Stream: "stock", Key: "sku-1", Version: 1, Payload: []byte("12")},
	} {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return writer.Append(ctx, tx, m) })
		if err != nil {
			panic(err)
		}
	}
	fmt.Println(<-delivered["prices"])
	fmt.Println(<-delivered["stock"])

	stop()
	running.Wait() // the last relay to return closed the shared connection
	// Output:
	// prices relay: sku-1 = 9.99
	// stock relay: sku-1 = 12
}
