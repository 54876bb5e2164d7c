package outbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
)

// TestHostileIdentifiers configures names built to break out of naive SQL
// quoting. They must neither inject SQL nor fail: the outbox works under
// exactly those names.
func TestHostileIdentifiers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testenv.Postgres(t)

	// A sentinel table the injected statements would drop.
	_, err := pg.Pool.Exec(ctx, `CREATE TABLE victim (id int)`)
	require.NoError(t, err)

	// Newlines too: a script that re-indents statements must not touch
	// the quoted names inside them.
	schema := pg.Schema + "\"; DROP TABLE victim; --\n"
	table := "out\"box; DROP TABLE victim;\n-- 'x' $1"
	t.Cleanup(func() {
		_, err := pg.Pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema}.Sanitize()+` CASCADE`)
		require.NoError(t, err)
	})
	cfg := &outbox.Config{Schema: schema, Table: table}

	script, err := outbox.MigrationSQL(cfg)
	require.NoError(t, err)
	require.Contains(t, script, `"`+strings.ReplaceAll(table, `"`, `""`)+`"`)
	require.NoError(t, outbox.Migrate(ctx, pg.Pool, cfg))

	// The tables exist under exactly the configured names.
	rows, err := pg.Pool.Query(ctx, `SELECT tablename FROM pg_tables WHERE schemaname = $1 ORDER BY tablename`, schema)
	require.NoError(t, err)
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{table, table + "_dead", table + "_idempotency", table + "_leases"}, names)

	w, err := outbox.NewWriter(cfg)
	require.NoError(t, err)
	tx, err := pg.Pool.Begin(ctx)
	require.NoError(t, err)
	id := uuid.New()
	cmd, err := w.RecordCommand(ctx, tx, id, outbox.Fingerprint([]byte("c")))
	require.NoError(t, err)
	require.False(t, cmd.Duplicate)
	require.NoError(t, w.Append(ctx, tx, outbox.Message{EventID: id, Stream: `s"; --`, Key: `k'); DROP TABLE victim; --`, Version: 1}))
	require.NoError(t, tx.Commit(ctx))

	handled := make(chan outbox.Record, 1)
	r, err := outbox.NewRelay(pg.Pool, outbox.HandlerFunc(func(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
		for _, rec := range batch {
			handled <- rec
		}
		return []outbox.Result{{Err: errors.New("fails once, to exercise the dead-letter path")}}, nil
	}), &outbox.RelayConfig{Schema: schema, Table: table, MaxAttempts: 1, PollInterval: 50 * time.Millisecond})
	require.NoError(t, err)
	stop := startRun(t, r)
	rec := receive(t, handled)
	require.Equal(t, `k'); DROP TABLE victim; --`, rec.Key)
	require.NoError(t, stop())

	stats, err := r.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, stats.DeadLetters)
	moved, err := r.ReplayDead(ctx, outbox.ReplayFilter{})
	require.NoError(t, err)
	require.EqualValues(t, 1, moved)

	var victimExists bool
	require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, pgx.Identifier{pg.Schema, "victim"}.Sanitize()).Scan(&victimExists))
	require.True(t, victimExists, "no injected statement ran")
}

// TestMissingHandles passes nil (and typed-nil) transactions and database
// handles, and a *pgxpool.Conn already released: each call returns a
// *ConfigError naming the argument, instead of dereferencing it (pgxpool
// panics on a released Conn).
func TestMissingHandles(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	var noTx pgx.Tx
	var noConn *pgx.Conn
	released, err := b.pool.Acquire(ctx)
	require.NoError(t, err)
	released.Release()
	id := uuid.New()
	for name, call := range map[string]struct {
		field string
		run   func() error
	}{
		"Migrate":            {"db", func() error { return outbox.Migrate(ctx, nil, nil) }},
		"MigrateTypedNil":    {"db", func() error { return outbox.Migrate(ctx, noConn, nil) }},
		"MigrateReleased":    {"db", func() error { return outbox.Migrate(ctx, released, nil) }},
		"PruneReleased":      {"db", func() error { _, err := b.writer.PruneCommands(ctx, released, time.Hour); return err }},
		"NotifierReleased":   {"db", func() error { _, err := outbox.NewNotifier(released, b.writer.Channel(), nil); return err }},
		"Append":             {"tx", func() error { return b.writer.Append(ctx, noTx, newMessage("s", "k", 1)) }},
		"AppendSQLTx":        {"tx", func() error { return b.writer.Append(ctx, outbox.SQLTx(nil), newMessage("s", "k", 1)) }},
		"RecordCommand":      {"tx", func() error { _, err := b.writer.RecordCommand(ctx, nil, id, []byte("f")); return err }},
		"StoreCommandResult": {"tx", func() error { return b.writer.StoreCommandResult(ctx, nil, id, []byte("r")) }},
		"PruneCommands":      {"db", func() error { _, err := b.writer.PruneCommands(ctx, noConn, time.Hour); return err }},
		"NewNotifier":        {"db", func() error { _, err := outbox.NewNotifier(noConn, b.writer.Channel(), nil); return err }},
		"NewRelayHandler": {"handler", func() error {
			_, err := outbox.NewRelay(b.pool, outbox.HandlerFunc(nil), &outbox.RelayConfig{Schema: b.cfg.Schema})
			return err
		}},
	} {
		err := call.run()
		require.ErrorIs(t, err, outbox.ErrInvalidConfig, name)
		var cfgErr *outbox.ConfigError
		require.ErrorAs(t, err, &cfgErr, name)
		require.Equal(t, call.field, cfgErr.Field, name)
	}
	require.Empty(t, b.rows(t), "nothing was written")
}

// TestZeroRelay: a Relay not made by NewRelay (a zero value, or nil) has no
// pool, handler or statements: every method that would use them returns a
// *ConfigError saying to create it with NewRelay, instead of dereferencing
// them.
func TestZeroRelay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, r := range map[string]*outbox.Relay{"Zero": {}, "Nil": nil} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			for method, call := range map[string]func() error{
				"Run":         func() error { return r.Run(ctx) },
				"RunOnce":     func() error { _, err := r.RunOnce(ctx); return err },
				"Stats":       func() error { _, err := r.Stats(ctx); return err },
				"DeadLetters": func() error { _, err := r.DeadLetters(ctx, 0, 10); return err },
				"ReplayDead":  func() error { _, err := r.ReplayDead(ctx, outbox.ReplayFilter{}); return err },
			} {
				err := call()
				require.ErrorIs(t, err, outbox.ErrInvalidConfig, method)
				var cfgErr *outbox.ConfigError
				require.ErrorAs(t, err, &cfgErr, method)
				require.Equal(t, "Relay", cfgErr.Field, method)
				require.Contains(t, cfgErr.Reason, "create it with NewRelay", method)
			}
			cfg := r.Config()
			require.Equal(t, outbox.TableDefault, cfg.Table, "the defaults")
			require.Equal(t, outbox.BatchSizeDefault, cfg.BatchSize, "the defaults")
		})
	}
}

// A Writer not made by NewWriter is refused with a *ConfigError by every
// method that writes, and nothing is written: the caller's transaction
// stays usable.
func TestZeroWriter(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	for name, w := range map[string]*outbox.Writer{"Zero": {}, "Nil": nil} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			tx, err := b.pool.Begin(ctx)
			require.NoError(t, err)
			t.Cleanup(func() { _ = tx.Rollback(ctx) })
			for method, call := range map[string]func() error{
				"Append":        func() error { return w.Append(ctx, tx, newMessage("s", "k", 1)) },
				"RecordCommand": func() error { _, err := w.RecordCommand(ctx, tx, uuid.New(), []byte("f")); return err },
				"StoreCommandResult": func() error {
					return w.StoreCommandResult(ctx, tx, uuid.New(), []byte("r"))
				},
				"PruneCommands": func() error { _, err := w.PruneCommands(ctx, tx, time.Hour); return err },
			} {
				err := call()
				require.ErrorIs(t, err, outbox.ErrInvalidConfig, method)
				var cfgErr *outbox.ConfigError
				require.ErrorAs(t, err, &cfgErr, method)
				require.Equal(t, "Writer", cfgErr.Field, method)
				require.Contains(t, cfgErr.Reason, "create it with NewWriter", method)
			}
			var n int
			require.NoError(t, tx.QueryRow(ctx, "SELECT count(*) FROM "+b.writer.Table()).Scan(&n), "the transaction is still usable")
			require.Zero(t, n, "nothing was written")
			require.Empty(t, w.Table())
			require.Empty(t, w.Channel())
			require.Equal(t, outbox.TableDefault, w.Config().Table, "the defaults")
		})
	}
}
