package leaderboard_test

import (
	"context"
	"fmt"
	"log"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/verity-go/verity/internal/services"
	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
)

// Metrics: one MeterProvider on the board's Config reaches the board, its
// worker (outbox relay and projector) and its reconciler. A real service
// would hand in a provider with the Prometheus or OTLP exporter; a manual
// reader makes the figures printable here.
func Example_metrics() {
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

	reader := sdkmetric.NewManualReader()
	provider := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer provider.Shutdown(ctx) //nolint:errcheck // nothing left to flush

	cfg := &leaderboard.Config{Name: "weekly-2026-48", Schema: schema, KeyPrefix: prefix, MeterProvider: provider}
	if err := leaderboard.Migrate(ctx, pool, cfg); err != nil {
		log.Fatal(err)
	}
	board, err := leaderboard.New(pool, rdb, cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer board.Close() // stops the relay wake-ups; runs before pool.Close
	retried := leaderboard.Command{EventID: uuid.New(), UserID: "ada", Delta: 30}
	for _, cmd := range []leaderboard.Command{retried, retried, {EventID: uuid.New(), UserID: "bob", Delta: 20}} {
		if _, err := board.Submit(ctx, cmd); err != nil {
			log.Fatal(err)
		}
	}
	worker, err := board.Worker(nil)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := worker.Drain(ctx); err != nil {
		log.Fatal(err)
	}

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		log.Fatal(err)
	}
	for _, scope := range rm.ScopeMetrics {
		for _, m := range scope.Metrics {
			switch m.Name {
			case "verity.leaderboard.submits", "verity.outbox.acked", "verity.projection.writes":
				var total int64
				for _, p := range m.Data.(metricdata.Sum[int64]).DataPoints {
					total += p.Value
				}
				fmt.Printf("%s: %d\n", m.Name, total)
			case "verity.projection.lag":
				fmt.Printf("%s: %d values\n", m.Name, m.Data.(metricdata.Histogram[float64]).DataPoints[0].Count)
			}
		}
	}
	// Unordered output:
	// verity.leaderboard.submits: 3
	// verity.outbox.acked: 2
	// verity.projection.writes: 2
	// verity.projection.lag: 2 values
}
