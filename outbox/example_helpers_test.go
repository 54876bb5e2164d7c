package outbox_test

import (
	"context"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/verity-go/verity/internal/services"
	"github.com/verity-go/verity/outbox"
)

// exampleOutbox sets up what Example does before its first command: a pool
// on a database of its own (its current schema), the outbox migrated there,
// and a Writer. cleanup closes the pool and drops the database's schema.
func exampleOutbox(ctx context.Context) (pool *pgxpool.Pool, schema string, writer *outbox.Writer, cleanup func(), err error) {
	pgURL, _, dropSchema, err := services.ResolveForExample()
	if err != nil {
		return nil, "", nil, nil, err
	}
	pool, err = pgxpool.New(ctx, pgURL)
	if err != nil {
		dropSchema()
		return nil, "", nil, nil, err
	}
	cleanup = func() {
		pool.Close()
		dropSchema()
	}
	cfg := &outbox.Config{}
	if err = pool.QueryRow(ctx, `SELECT current_schema()`).Scan(&cfg.Schema); err == nil {
		if err = outbox.Migrate(ctx, pool, cfg); err == nil {
			writer, err = outbox.NewWriter(cfg)
		}
	}
	if err != nil {
		cleanup()
		return nil, "", nil, nil, err
	}
	return pool, cfg.Schema, writer, cleanup, nil
}
