package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
)

// Run with, for example:
//
//	go test -run '^$' -bench . -benchtime 20000x ./outbox/
//
// Each benchmark reports rows/s; the relay benchmarks fill the outbox before
// the timer starts and drain it with a no-op handler, so they measure the
// database cost of delivery alone.

func benchSetup(b *testing.B) (*testenv.PG, *outbox.Config, *outbox.Writer) {
	b.Helper()
	pg := testenv.Postgres(b)
	cfg := &outbox.Config{Schema: pg.Schema}
	require.NoError(b, outbox.Migrate(context.Background(), pg.Pool, cfg))
	w, err := outbox.NewWriter(cfg)
	require.NoError(b, err)
	return pg, cfg, w
}

func fill(b *testing.B, pg *testenv.PG, w *outbox.Writer, n int) {
	b.Helper()
	ctx := context.Background()
	const chunk = 5000
	for done := 0; done < n; done += chunk {
		msgs := make([]outbox.Message, min(chunk, n-done))
		for i := range msgs {
			msgs[i] = outbox.Message{EventID: uuid.New(), Stream: "bench", Key: fmt.Sprint("key-", (done+i)%1000), Version: int64(done + i + 1), Payload: make([]byte, 64)}
		}
		require.NoError(b, pgx.BeginFunc(ctx, pg.Pool, func(tx pgx.Tx) error { return w.Append(ctx, tx, msgs...) }))
	}
	_, err := pg.Pool.Exec(ctx, `ANALYZE `+w.Table())
	require.NoError(b, err)
}

func BenchmarkAppend(b *testing.B) {
	for _, size := range []int{1, 100} {
		b.Run(fmt.Sprint("Messages", size), func(b *testing.B) {
			pg, _, w := benchSetup(b)
			ctx := context.Background()
			msgs := make([]outbox.Message, size)
			b.ResetTimer()
			for range b.N {
				for i := range msgs {
					msgs[i] = outbox.Message{EventID: uuid.New(), Stream: "bench", Key: "k", Version: 1, Payload: make([]byte, 64)}
				}
				if err := pgx.BeginFunc(ctx, pg.Pool, func(tx pgx.Tx) error { return w.Append(ctx, tx, msgs...) }); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N*size)/b.Elapsed().Seconds(), "rows/s")
		})
	}
}

// BenchmarkRelayLeased drains b.N rows with the relay's partition leases:
// one claim round trip (lease partitions, read their rows) and one settle
// statement per batch, committed durably or not
// (RelayConfig.DurableBookkeeping).
func BenchmarkRelayLeased(b *testing.B) {
	for _, batch := range []int{10, 100, 1000} {
		for _, durable := range []bool{false, true} {
			name := fmt.Sprint("Batch", batch, "/Async")
			if durable {
				name = fmt.Sprint("Batch", batch, "/Durable")
			}
			b.Run(name, func(b *testing.B) { benchRelayLeased(b, batch, durable) })
		}
	}
}

func benchRelayLeased(b *testing.B, batch int, durable bool) {
	pg, cfg, w := benchSetup(b)
	fill(b, pg, w, b.N)
	r, err := outbox.NewRelay(pg.Pool, outbox.HandlerFunc(func(_ context.Context, recs []outbox.Record) ([]outbox.Result, error) {
		return make([]outbox.Result, len(recs)), nil
	}), &outbox.RelayConfig{Schema: cfg.Schema, BatchSize: batch, DurableBookkeeping: durable})
	require.NoError(b, err)
	ctx := context.Background()
	b.ResetTimer()
	total := 0
	for total < b.N {
		n, err := r.RunOnce(ctx)
		if err != nil {
			b.Fatal(err)
		}
		if n == 0 {
			b.Fatalf("drained %d of %d", total, b.N)
		}
		total += n
	}
	b.ReportMetric(float64(total)/b.Elapsed().Seconds(), "rows/s")
}

// BenchmarkStats measures Stats on a backlog of b.N pending rows (run with
// -benchtime 1x after setting the row count, e.g. -benchtime 1000000x takes
// a while to fill).
func BenchmarkStats(b *testing.B) {
	pg, cfg, w := benchSetup(b)
	rowsWanted := b.N
	fill(b, pg, w, rowsWanted)
	_, err := pg.Pool.Exec(context.Background(), `VACUUM ANALYZE `+w.Table())
	require.NoError(b, err)
	r, err := outbox.NewRelay(pg.Pool, outbox.HandlerFunc(func(context.Context, []outbox.Record) ([]outbox.Result, error) { return nil, nil }),
		&outbox.RelayConfig{Schema: cfg.Schema})
	require.NoError(b, err)
	ctx := context.Background()
	const calls = 5
	b.ResetTimer()
	start := time.Now()
	for range calls {
		s, err := r.Stats(ctx)
		if err != nil {
			b.Fatal(err)
		}
		if s.Pending != int64(rowsWanted) {
			b.Fatalf("pending %d, want %d", s.Pending, rowsWanted)
		}
	}
	b.ReportMetric(float64(time.Since(start).Milliseconds())/calls, "ms/Stats")
}
