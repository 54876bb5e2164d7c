package outbox_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
)

// testBundle is one test's outbox: its own schema, migrated.
type testBundle struct {
	pg     *testenv.PG
	pool   *pgxpool.Pool
	cfg    *outbox.Config
	writer *outbox.Writer
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	pg := testenv.Postgres(t)
	cfg := &outbox.Config{Schema: pg.Schema}
	ctx := context.Background()
	require.NoError(t, outbox.Migrate(ctx, pg.Pool, cfg))
	w, err := outbox.NewWriter(cfg)
	require.NoError(t, err)
	return &testBundle{pg: pg, pool: pg.Pool, cfg: cfg, writer: w}
}

func newMessage(stream, key string, version int64) outbox.Message {
	return outbox.Message{
		EventID: uuid.New(),
		Stream:  stream,
		Key:     key,
		Version: version,
		Payload: []byte(fmt.Sprintf(`{"key":%q,"version":%d}`, key, version)),
	}
}

// appendCommitted appends msgs in a transaction of its own and commits it.
func (b *testBundle) appendCommitted(t *testing.T, msgs ...outbox.Message) {
	t.Helper()
	ctx := context.Background()
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
	require.NoError(t, b.writer.Append(ctx, tx, msgs...))
	require.NoError(t, tx.Commit(ctx))
}

// makeDue makes every outbox row due now, as if its retry backoff had
// passed.
func (b *testBundle) makeDue(t *testing.T) {
	t.Helper()
	_, err := b.pool.Exec(context.Background(), `UPDATE `+b.writer.Table()+` SET available_at = now()`)
	require.NoError(t, err)
}

// outboxRow is a row of the outbox as stored.
type outboxRow struct {
	ID          int64
	EventID     uuid.UUID
	Stream      string
	Key         string
	Version     int64
	Payload     []byte
	Attempts    int
	AvailableAt time.Time
	LeasedUntil *time.Time
	ClaimToken  *uuid.UUID
	LastError   *string
	PublishedAt *time.Time
}

func (b *testBundle) rows(t *testing.T) []outboxRow {
	t.Helper()
	rows, err := b.pool.Query(context.Background(), `SELECT id, event_id, stream, key, version, payload, attempts,
		available_at, leased_until, claim_token, last_error, published_at FROM `+b.writer.Table()+` ORDER BY id`)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[outboxRow])
	require.NoError(t, err)
	return out
}

// deadTable is the quoted name of the bundle's dead-letter table.
func (b *testBundle) deadTable() string {
	return pgx.Identifier{b.cfg.Schema, outbox.TableDefault + "_dead"}.Sanitize()
}

func (b *testBundle) count(t *testing.T, table string) int {
	t.Helper()
	var n int
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+table).Scan(&n))
	return n
}

func TestAppend(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("CommitMakesRowsVisible", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		msgs := []outbox.Message{newMessage("scores", "user-a", 1), newMessage("scores", "user-b", 7), newMessage("prices", "", 3)}
		msgs[2].Payload = nil // stored as empty
		b.appendCommitted(t, msgs...)

		rows := b.rows(t)
		require.Len(t, rows, len(msgs))
		for i, r := range rows {
			require.Equal(t, msgs[i].EventID, r.EventID, "ids ascend in message order")
			require.Equal(t, msgs[i].Stream, r.Stream)
			require.Equal(t, msgs[i].Key, r.Key)
			require.Equal(t, msgs[i].Version, r.Version)
			require.Equal(t, string(msgs[i].Payload), string(r.Payload))
			require.Zero(t, r.Attempts)
			require.Nil(t, r.ClaimToken)
			require.Nil(t, r.LastError)
			require.Nil(t, r.PublishedAt)
			require.WithinDuration(t, time.Now(), r.AvailableAt, time.Minute)
		}
		require.NotNil(t, rows[2].Payload)
	})

	t.Run("ManyMessagesOneStatement", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		msgs := make([]outbox.Message, 1000)
		for i := range msgs {
			msgs[i] = newMessage("bulk", fmt.Sprint("k", i), int64(i+1))
		}
		b.appendCommitted(t, msgs...)
		require.Equal(t, len(msgs), b.count(t, b.writer.Table()))
	})

	t.Run("RollbackLeavesNothing", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		require.NoError(t, b.writer.Append(ctx, tx, newMessage("scores", "user-a", 1), newMessage("scores", "user-a", 2)))
		require.NoError(t, tx.Rollback(ctx))
		require.Zero(t, b.count(t, b.writer.Table()))
	})

	t.Run("NoMessagesIsNoOp", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		require.NoError(t, b.writer.Append(ctx, nil))
		require.Zero(t, b.count(t, b.writer.Table()))
	})

	t.Run("ValidationWritesNothing", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		dup := newMessage("s", "k", 1)
		cases := []struct {
			name  string
			bad   func(m *outbox.Message)
			field string
		}{
			{"NilEventID", func(m *outbox.Message) { m.EventID = uuid.Nil }, "EventID"},
			{"EmptyStream", func(m *outbox.Message) { m.Stream = "" }, "Stream"},
			{"ZeroVersion", func(m *outbox.Message) { m.Version = 0 }, "Version"},
			{"NegativeVersion", func(m *outbox.Message) { m.Version = -5 }, "Version"},
			{"InvalidUTF8Key", func(m *outbox.Message) { m.Key = "\xff\xfe" }, "Key"},
			{"NULInStream", func(m *outbox.Message) { m.Stream = "a\x00b" }, "Stream"},
			{"LongStream", func(m *outbox.Message) { m.Stream = strings.Repeat("s", outbox.MaxStreamBytes+1) }, "Stream"},
			{"DuplicateEventIDInCall", func(m *outbox.Message) { m.EventID = dup.EventID }, "EventID"},
		}
		// The cases run one after another (not in parallel): each checks
		// that the bundle's table is still empty.
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				tx, err := b.pool.Begin(ctx)
				require.NoError(t, err)
				// A failed check must not leave the transaction open: it
				// holds a pooled connection, and the pool's Close at cleanup
				// would wait for it until the test binary's timeout.
				defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
				bad := newMessage("s", "k2", 2)
				tc.bad(&bad)
				err = b.writer.Append(ctx, tx, dup, bad)
				require.ErrorIs(t, err, outbox.ErrInvalidMessage)
				var msgErr *outbox.MessageError
				require.ErrorAs(t, err, &msgErr)
				require.Equal(t, 1, msgErr.Index)
				require.Equal(t, tc.field, msgErr.Field)
				require.Contains(t, err.Error(), tc.field)
				// The transaction is untouched: it still commits, and nothing
				// (not even the valid first message) was written.
				require.NoError(t, tx.Commit(ctx))
				require.Zero(t, b.count(t, b.writer.Table()))
			})
		}
	})

	t.Run("EventIDAlreadyInOutbox", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		first := newMessage("s", "k", 1)
		b.appendCommitted(t, first)

		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck
		again := newMessage("s", "k", 2)
		again.EventID = first.EventID
		err = b.writer.Append(ctx, tx, newMessage("s", "other", 1), again)
		require.ErrorIs(t, err, outbox.ErrEventIDExists)
		// The driver's unique violation is kept, as for any other
		// statement error.
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr)
		require.Equal(t, "23505", pgErr.Code)
		require.Contains(t, err.Error(), first.EventID.String(), "the error names the event id")
		require.NoError(t, tx.Rollback(ctx))
		require.Equal(t, 1, b.count(t, b.writer.Table()))
	})

	// After the outbox's ids were reset, a new event whose row takes an
	// id the outbox still holds fails on the primary key: not reported as
	// an event id already in the outbox, which it is not.
	t.Run("IDClashIsNotAnEventIDClash", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendCommitted(t, newMessage("s", "k", 1))
		_, err := b.pool.Exec(ctx, `ALTER TABLE `+b.writer.Table()+` ALTER COLUMN id RESTART WITH 1`)
		require.NoError(t, err)
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck
		fresh := newMessage("s", "k", 2)
		err = b.writer.Append(ctx, tx, fresh)
		require.Error(t, err)
		require.NotErrorIs(t, err, outbox.ErrEventIDExists, "event %s is not in the outbox", fresh.EventID)
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr)
		require.Equal(t, "23505", pgErr.Code)
	})

	t.Run("NotMigrated", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		w, err := outbox.NewWriter(&outbox.Config{Schema: pg.Schema})
		require.NoError(t, err)
		tx, err := pg.Pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck
		err = w.Append(ctx, tx, newMessage("s", "k", 1))
		require.ErrorIs(t, err, outbox.ErrNotMigrated)
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr)
		require.True(t, strings.HasPrefix(err.Error(), "outbox: append: tables not found; run outbox.Migrate first ("), "%q", err.Error())
		require.Equal(t, 1, strings.Count(err.Error(), "outbox: "), "the package is named once: %q", err.Error())

		// So do the relay's errors (a claim here).
		r, err := outbox.NewRelay(pg.Pool, outbox.HandlerFunc(func(_ context.Context, b []outbox.Record) ([]outbox.Result, error) {
			return make([]outbox.Result, len(b)), nil
		}), &outbox.RelayConfig{Schema: pg.Schema})
		require.NoError(t, err)
		_, err = r.RunOnce(ctx)
		require.ErrorIs(t, err, outbox.ErrNotMigrated)
		require.ErrorAs(t, err, &pgErr)
		require.Equal(t, 1, strings.Count(err.Error(), "outbox: "), "the package is named once: %q", err.Error())
	})
}

func TestMigrate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("Idempotent", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendCommitted(t, newMessage("s", "k", 1))
		require.NoError(t, outbox.Migrate(ctx, b.pool, b.cfg))
		require.Equal(t, 1, b.count(t, b.writer.Table()), "a second Migrate keeps the data")
	})

	t.Run("InvalidIndexIsReported", func(t *testing.T) {
		t.Parallel()
		// A CREATE INDEX CONCURRENTLY of the partition index, built
		// beforehand as the docs suggest, failed and left the name behind
		// invalid (simulated in the catalog: the tests run as superuser).
		b := setup(t)
		index := pgx.Identifier{b.pg.Schema, outbox.TableDefault + "_partition_idx"}.Sanitize()
		_, err := b.pool.Exec(ctx, `UPDATE pg_index SET indisvalid = false WHERE indexrelid = $1::regclass`, index)
		require.NoError(t, err)
		err = outbox.Migrate(ctx, b.pool, b.cfg)
		require.ErrorContains(t, err, "exists but is invalid")
		// Dropped, the next Migrate builds it again.
		_, err = b.pool.Exec(ctx, `DROP INDEX `+index)
		require.NoError(t, err)
		require.NoError(t, outbox.Migrate(ctx, b.pool, b.cfg))
		var valid bool
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT indisvalid FROM pg_index WHERE indexrelid = $1::regclass`, index).Scan(&valid))
		require.True(t, valid)
	})

	t.Run("QueueAutovacuumSettings", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		require.NoError(t, outbox.Migrate(ctx, b.pool, b.cfg), "the ALTER TABLE is idempotent")
		var opts []string
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT reloptions FROM pg_class WHERE oid = $1::regclass`,
			b.writer.Table()).Scan(&opts))
		require.ElementsMatch(t, []string{
			"fillfactor=100", // 003: claims no longer update rows in place
			"autovacuum_vacuum_scale_factor=0",
			"autovacuum_vacuum_threshold=5000",
			"autovacuum_vacuum_cost_delay=0",
		}, opts)
	})

	t.Run("Concurrent", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		cfg := &outbox.Config{Schema: pg.Schema, Table: "concurrent"}
		errs := make(chan error, 4)
		for range 4 {
			go func() { errs <- outbox.Migrate(ctx, pg.Pool, cfg) }()
		}
		for range 4 {
			require.NoError(t, <-errs)
		}
	})

	// Migrate runs at every start-up, next to live writers: on a migrated
	// outbox it must not queue for a lock that an open writer transaction
	// holds (every appending, recording or settling transaction holds ROW
	// EXCLUSIVE on its tables), or every writer after it would queue too.
	t.Run("RerunDoesNotWaitForWriters", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // the transaction is only held open
		msg := newMessage("s", "k", 1)
		_, err = b.writer.RecordCommand(ctx, tx, msg.EventID, outbox.Fingerprint([]byte("cmd")))
		require.NoError(t, err)
		require.NoError(t, b.writer.Append(ctx, tx, msg))
		_, err = tx.Exec(ctx, `LOCK TABLE `+b.deadTable()+`, `+b.leasesTable()+` IN ROW EXCLUSIVE MODE`)
		require.NoError(t, err)

		// A lock wait behind tx would last until tx ends, so any bound
		// catches it; a generous one also covers Migrate queuing behind the
		// migrations of other tests (one advisory lock) on a loaded machine.
		mctx, cancel := context.WithTimeout(ctx, 15*time.Second)
		defer cancel()
		require.NoError(t, outbox.Migrate(mctx, b.pool, b.cfg))
		require.NoError(t, tx.Commit(ctx), "the writer was not disturbed")
	})

	// Indexes are created by DO blocks whose body and index name are string
	// constants: names holding quotes and the constants' own dollar-quote
	// tag must still give every index its exact name, and the existence
	// check must look in the outbox's schema, not on the search_path.
	t.Run("IndexesUnderQuotingNames", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		schema, table := pg.Schema+`$"'`, `q"'$verity$\$$`
		t.Cleanup(func() {
			_, err := pg.Pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema}.Sanitize()+` CASCADE`)
			require.NoError(t, err)
		})
		cfg := &outbox.Config{Schema: schema, Table: table}
		require.NoError(t, outbox.Migrate(ctx, pg.Pool, cfg))
		require.NoError(t, outbox.Migrate(ctx, pg.Pool, cfg), "idempotent")
		rows, err := pg.Pool.Query(ctx, `SELECT indexname FROM pg_indexes WHERE schemaname = $1`, schema)
		require.NoError(t, err)
		indexes, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		require.Subset(t, indexes, []string{
			table + "_pending_idx", table + "_created_idx", table + "_dead_event_idx", table + "_dead_stream_idx",
			table + "_dead_created_idx", table + "_idempotency_created_idx", table + "_leases_touched_idx", table + "_partition_idx",
		})
	})

	t.Run("SQLTextMatchesMigrate", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		cfg := &outbox.Config{Schema: pg.Schema, Table: "by_tool"}
		script, err := outbox.MigrationSQL(cfg)
		require.NoError(t, err)
		require.Contains(t, script, `CREATE TABLE IF NOT EXISTS "`+pg.Schema+`"."by_tool"`)
		// Apply it the way an external tool would, then use the outbox.
		_, err = pg.Pool.Exec(ctx, script)
		require.NoError(t, err)
		w, err := outbox.NewWriter(cfg)
		require.NoError(t, err)
		tx, err := pg.Pool.Begin(ctx)
		require.NoError(t, err)
		require.NoError(t, w.Append(ctx, tx, newMessage("s", "k", 1)))
		require.NoError(t, tx.Commit(ctx))
	})
}

func TestComposedInsert(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)

	// A caller composes its own single statement: the INSERT names only the
	// five message columns, everything else defaults.
	eventID := uuid.New()
	_, err := b.pool.Exec(ctx, `WITH o AS (
		INSERT INTO `+b.writer.Table()+` (event_id, stream, key, version, payload)
		VALUES ($1, 'scores', 'user-a', 3, '\x7b7d'::bytea) RETURNING id)
		SELECT pg_notify($2, '') FROM o`, eventID, b.writer.Channel())
	require.NoError(t, err)
	rows := b.rows(t)
	require.Len(t, rows, 1)
	require.Equal(t, eventID, rows[0].EventID)
	require.Equal(t, "{}", string(rows[0].Payload))
	require.Zero(t, rows[0].Attempts)
	require.Nil(t, rows[0].ClaimToken)

	// The CHECK constraints hold for composed inserts too.
	for name, bad := range map[string]struct {
		stream  string
		version int64
	}{
		"ZeroVersion": {"scores", 0},
		"LongStream":  {strings.Repeat("s", outbox.MaxStreamBytes+1), 1},
	} {
		_, err = b.pool.Exec(ctx, `INSERT INTO `+b.writer.Table()+` (event_id, stream, key, version, payload)
			VALUES ($1, $2, 'user-a', $3, '')`, uuid.New(), bad.stream, bad.version)
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr, name)
		require.Equal(t, "23514", pgErr.Code, name) // check_violation
	}
}

func TestConfig(t *testing.T) {
	t.Parallel()

	long := func(n int) string {
		b := make([]byte, n)
		for i := range b {
			b[i] = 'a'
		}
		return string(b)
	}
	cases := []struct {
		name  string
		cfg   outbox.Config
		field string
	}{
		{"TableTooLong", outbox.Config{Table: long(outbox.MaxTableLength + 1)}, "Table"},
		{"SchemaTooLong", outbox.Config{Schema: long(64)}, "Schema"},
		{"NULInTable", outbox.Config{Table: "a\x00b"}, "Table"},
		{"InvalidUTF8Schema", outbox.Config{Schema: "\xff"}, "Schema"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := outbox.NewWriter(&tc.cfg)
			require.ErrorIs(t, err, outbox.ErrInvalidConfig)
			var cfgErr *outbox.ConfigError
			require.ErrorAs(t, err, &cfgErr)
			require.Equal(t, tc.field, cfgErr.Field)
			require.Contains(t, err.Error(), tc.field)

			_, err = outbox.MigrationSQL(&tc.cfg)
			require.ErrorIs(t, err, outbox.ErrInvalidConfig)
		})
	}

	// Relations of a schema share one namespace and Migrate creates each
	// only if missing: an outbox named like another's derived relation
	// ("q_dead", q's dead-letter table) would adopt it, and q's ReplayDead
	// would move q_dead's pending rows into q. Every name Migrate derives
	// from Table, and every name two outboxes' derived names could then
	// share, is refused everywhere a Config is validated, and a refused
	// Migrate creates nothing.
	t.Run("TableEndingInDerivedSuffix", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		pg := testenv.Postgres(t)
		relations := func() []string {
			rows, err := pg.Pool.Query(ctx, `SELECT c.relname FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
				WHERE n.nspname = $1 ORDER BY 1`, pg.Schema)
			require.NoError(t, err)
			names, err := pgx.CollectRows(rows, pgx.RowTo[string])
			require.NoError(t, err)
			return names
		}
		refused := func(table string) {
			t.Helper()
			cfg := &outbox.Config{Schema: pg.Schema, Table: table}
			requireTableRefused := func(err error, entry string) {
				t.Helper()
				require.ErrorIs(t, err, outbox.ErrInvalidConfig, "%s(%q)", entry, table)
				var cfgErr *outbox.ConfigError
				require.ErrorAs(t, err, &cfgErr, "%s(%q)", entry, table)
				require.Equal(t, "Table", cfgErr.Field, "%s(%q)", entry, table)
				require.Contains(t, cfgErr.Reason, "choose a name", "%s(%q): says how to fix it", entry, table)
			}
			_, err := outbox.NewWriter(cfg)
			requireTableRefused(err, "NewWriter")
			_, err = outbox.Migrations(cfg)
			requireTableRefused(err, "Migrations")
			_, err = outbox.MigrationSQL(cfg)
			requireTableRefused(err, "MigrationSQL")
			requireTableRefused(outbox.Migrate(ctx, pg.Pool, cfg), "Migrate")
			_, err = outbox.NewRelay(pg.Pool, &recorder{}, &outbox.RelayConfig{Schema: pg.Schema, Table: table})
			requireTableRefused(err, "NewRelay")
		}

		// The report's case, in an empty schema: nothing is created.
		refused("q_dead")
		require.Empty(t, relations(), "a refused Migrate creates nothing")

		const table = "t"
		require.NoError(t, outbox.Migrate(ctx, pg.Pool, &outbox.Config{Schema: pg.Schema, Table: table}))
		derived := relations()
		require.Contains(t, derived, table+"_dead")
		require.Contains(t, derived, table+"_id_seq")
		for _, long := range derived {
			for _, short := range derived {
				// An outbox named table+x has long's name for one of its own
				// (x = long's suffix, short = table) or shares one with this
				// outbox (short = table+s, long = table+x+s).
				s := strings.TrimPrefix(short, table)
				if long == short || !strings.HasSuffix(long, s) {
					continue
				}
				refused(strings.TrimSuffix(long, s))
			}
		}
		require.Equal(t, derived, relations(), "refused Migrates created nothing")

		// A Table that merely contains a suffix, or ends in one of another
		// case, is accepted.
		for _, ok := range []string{"q_dead_letters", "q_DEAD", "dead"} {
			_, err := outbox.NewWriter(&outbox.Config{Table: ok})
			require.NoError(t, err, ok)
		}
	})

	// PostgreSQL creates no schema whose name begins with "pg_": Migrate
	// failed with a raw SQLSTATE 42939 after every constructor had accepted
	// the name. Its test is case-sensitive, and so is the refusal.
	t.Run("ReservedSchema", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		pg := testenv.Postgres(t)
		for _, schema := range []string{"pg_outbox", "pg_catalog", "pg_"} {
			cfg := &outbox.Config{Schema: schema}
			requireSchemaRefused := func(err error, entry string) {
				t.Helper()
				require.ErrorIs(t, err, outbox.ErrInvalidConfig, "%s(%q)", entry, schema)
				var cfgErr *outbox.ConfigError
				require.ErrorAs(t, err, &cfgErr, "%s(%q)", entry, schema)
				require.Equal(t, "Schema", cfgErr.Field, "%s(%q)", entry, schema)
				require.Contains(t, cfgErr.Reason, `choose a name that does not begin with "pg_"`, "%s(%q): says how to fix it", entry, schema)
			}
			_, err := outbox.NewWriter(cfg)
			requireSchemaRefused(err, "NewWriter")
			_, err = outbox.Migrations(cfg)
			requireSchemaRefused(err, "Migrations")
			_, err = outbox.MigrationSQL(cfg)
			requireSchemaRefused(err, "MigrationSQL")
			requireSchemaRefused(outbox.Migrate(ctx, pg.Pool, cfg), "Migrate")
			_, err = outbox.NewRelay(pg.Pool, &recorder{}, &outbox.RelayConfig{Schema: schema})
			requireSchemaRefused(err, "NewRelay")
		}
		for _, ok := range []string{"PG_outbox", "Pg_outbox", "pgoutbox", "x_pg_"} {
			_, err := outbox.NewWriter(&outbox.Config{Schema: ok})
			require.NoError(t, err, ok)
		}
	})

	t.Run("Defaults", func(t *testing.T) {
		t.Parallel()
		var nilCfg *outbox.Config
		got := nilCfg.WithDefaults()
		require.Equal(t, outbox.SchemaDefault, got.Schema)
		require.Equal(t, outbox.TableDefault, got.Table)
		w, err := outbox.NewWriter(nil)
		require.NoError(t, err)
		require.Equal(t, `"public"."verity_outbox"`, w.Table())

		orig := &outbox.Config{Table: "x"}
		_ = orig.WithDefaults()
		require.Empty(t, orig.Schema, "WithDefaults returns a copy")
	})

	t.Run("ChannelDependsOnSchemaAndTable", func(t *testing.T) {
		t.Parallel()
		a, err := outbox.NewWriter(&outbox.Config{Schema: "a", Table: "t"})
		require.NoError(t, err)
		b, err := outbox.NewWriter(&outbox.Config{Schema: "b", Table: "t"})
		require.NoError(t, err)
		c, err := outbox.NewWriter(&outbox.Config{Schema: "a", Table: "u"})
		require.NoError(t, err)
		require.NotEqual(t, a.Channel(), b.Channel())
		require.NotEqual(t, a.Channel(), c.Channel())
		require.LessOrEqual(t, len(a.Channel()), 63)
	})
}

// receive waits for a value from ch, failing the test after 10s instead of
// hanging until the package timeout.
func receive[T any](t *testing.T, ch chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(10 * time.Second):
		t.Fatalf("timed out waiting on %T", ch)
		panic("unreachable")
	}
}
