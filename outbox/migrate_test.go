package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/services"
	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
)

// TestMigrationsForTools covers the migrations as handed to migration tools
// (Migrations, MigrationSQL), which apply them in their own way.
func TestMigrationsForTools(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("Enumerated", func(t *testing.T) {
		t.Parallel()
		migrations, err := outbox.Migrations(nil)
		require.NoError(t, err)
		var names []string
		for _, m := range migrations {
			names = append(names, m.Name)
		}
		require.Equal(t, []string{"001_outbox.sql", "002_queue_autovacuum.sql", "003_partition_leases.sql",
			"004_dead_stream_index.sql", "005_stream_length.sql", "006_created_at_finite.sql", "007_long_streams_dead.sql",
			"008_dead_created_index.sql"}, names)
		script, err := outbox.MigrationSQL(nil)
		require.NoError(t, err)
		for _, name := range names {
			require.Contains(t, script, "-- "+name+"\n")
		}
	})

	// goose splits a script into statements at every line ending with a
	// semicolon, dollar quotes or not, unless the script is annotated:
	// every DO block must come out whole.
	t.Run("GooseSplitKeepsDOBlocksWhole", func(t *testing.T) {
		t.Parallel()
		doOpen := regexp.MustCompile(`^DO (\$verity\d*\$)\n`)
		for _, cfg := range []*outbox.Config{nil, quotingNamesConfig("s")} {
			migrations, err := outbox.Migrations(cfg)
			require.NoError(t, err)
			blocks := 0
			for _, m := range migrations {
				for _, stmt := range gooseStatements(t, m.SQL) {
					if !strings.HasPrefix(stmt, "DO ") {
						continue
					}
					blocks++
					tag := doOpen.FindStringSubmatch(stmt)
					require.NotNil(t, tag, "%s: %s", m.Name, stmt)
					require.True(t, strings.HasSuffix(stmt, "\n"+tag[1]+";"), "%s: DO block cut apart:\n%s", m.Name, stmt)
				}
			}
			require.Equal(t, 19, blocks, "one DO block per index, table, storage setting and constraint, for the schema, and for 007's move")
		}
	})

	// Applied one statement at a time, as goose does, the migrations build
	// the same outbox as Migrate, again and again.
	t.Run("GooseStatementsApply", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		cfg := quotingNamesConfig(pg.Schema)
		t.Cleanup(func() {
			_, err := pg.Pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+pgx.Identifier{cfg.Schema}.Sanitize()+` CASCADE`)
			require.NoError(t, err)
		})
		migrations, err := outbox.Migrations(cfg)
		require.NoError(t, err)
		for range 2 {
			for _, m := range migrations {
				for _, stmt := range gooseStatements(t, m.SQL) {
					_, err := pg.Pool.Exec(ctx, stmt)
					require.NoError(t, err, "%s:\n%s", m.Name, stmt)
				}
			}
		}
		rows, err := pg.Pool.Query(ctx, `SELECT indexname FROM pg_indexes WHERE schemaname = $1`, cfg.Schema)
		require.NoError(t, err)
		indexes, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		// That the leaderboard's lag probe reads dead letters by
		// _dead_stream_idx and _dead_created_idx, also in a generic plan, is
		// checked by its own test (leaderboard.TestLagProbePlan) against the
		// real statement.
		require.Subset(t, indexes, []string{cfg.Table + "_dead_stream_idx", cfg.Table + "_dead_created_idx", cfg.Table + "_partition_idx"})
		w, err := outbox.NewWriter(cfg)
		require.NoError(t, err)
		tx, err := pg.Pool.Begin(ctx)
		require.NoError(t, err)
		require.NoError(t, w.Append(ctx, tx, newMessage("s", "k", 1)))
		require.NoError(t, tx.Commit(ctx))
	})
}

// quotingNamesConfig names an outbox in schema+suffix with quotes and the
// migrations' own dollar-quote tag in its names (see IndexesUnderQuotingNames).
func quotingNamesConfig(schema string) *outbox.Config {
	return &outbox.Config{Schema: schema + `$"'`, Table: `q"'$verity$\$$`}
}

// gooseStatements splits script into statements as goose (v3) does for a
// file without StatementBegin/End annotations: blank and comment lines
// before a statement are dropped, and a statement ends at the first line
// whose last word before any word starting with "--" ends with ';'. Dollar
// quotes are not recognised.
func gooseStatements(t *testing.T, script string) []string {
	t.Helper()
	var (
		stmts []string
		buf   strings.Builder
	)
	for line := range strings.Lines(script) {
		line = strings.TrimSuffix(line, "\n")
		trimmed := strings.TrimSpace(line)
		if buf.Len() == 0 && (trimmed == "" || strings.HasPrefix(trimmed, "--")) {
			continue
		}
		fmt.Fprintln(&buf, line)
		last := ""
		for word := range strings.FieldsSeq(line) {
			if strings.HasPrefix(word, "--") {
				break
			}
			last = word
		}
		if strings.HasSuffix(last, ";") {
			stmts = append(stmts, strings.TrimSpace(buf.String()))
			buf.Reset()
		}
	}
	require.Empty(t, strings.TrimSpace(buf.String()), "goose refuses a last statement without a semicolon")
	return stmts
}

// TestMigrateUnderStricterDefaultIsolation runs Migrate from several
// processes at once, queued behind the migration lock, on a role whose
// default_transaction_isolation is stricter than PostgreSQL's default: a
// snapshot taken before the lock was granted must not make a replica fail
// on what another committed meanwhile (a constraint added, lease rows a
// relay updated).
func TestMigrateUnderStricterDefaultIsolation(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, isolation string
		relay           bool // a relay claims and settles while the replicas wait
	}{
		{"RepeatableReadUpgrade", "repeatable read", false},
		{"SerializableUpgrade", "serializable", false},
		{"SerializableRelayRunning", "serializable", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			pg := testenv.Postgres(t)
			cfg := &outbox.Config{Schema: pg.Schema}
			require.NoError(t, outbox.Migrate(ctx, pg.Pool, cfg))
			if !tc.relay { // an outbox of the release before the constraint
				_, err := pg.Pool.Exec(ctx, `ALTER TABLE `+pgx.Identifier{pg.Schema, outbox.TableDefault}.Sanitize()+` DROP CONSTRAINT verity_outbox_stream_length`)
				require.NoError(t, err)
			}

			// Hold the migration lock so that the replicas queue behind it.
			holder, err := pgx.Connect(ctx, pg.ConnString)
			require.NoError(t, err)
			defer holder.Close(context.Background())
			_, err = holder.Exec(ctx, `SELECT pg_advisory_lock($1)`, int64(outbox.MigrationLockKey))
			require.NoError(t, err)
			const replicas = 3
			var pids []uint32
			errs := make(chan error, replicas)
			for range replicas {
				pc, err := pgxpool.ParseConfig(pg.ConnString)
				require.NoError(t, err)
				pc.MaxConns = 1
				pc.ConnConfig.RuntimeParams["default_transaction_isolation"] = tc.isolation
				pool, err := pgxpool.NewWithConfig(ctx, pc)
				require.NoError(t, err)
				t.Cleanup(pool.Close)
				conn, err := pool.Acquire(ctx)
				require.NoError(t, err)
				pids = append(pids, conn.Conn().PgConn().PID())
				conn.Release()
				go func() { errs <- outbox.Migrate(ctx, pool, cfg) }()
			}
			require.Eventually(t, func() bool {
				var waiting int
				err := holder.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND pid = ANY($1)`, pids).Scan(&waiting)
				return err == nil && waiting == replicas
			}, 10*time.Second, 10*time.Millisecond)
			if tc.relay {
				w, err := outbox.NewWriter(cfg)
				require.NoError(t, err)
				tx, err := pg.Pool.Begin(ctx)
				require.NoError(t, err)
				require.NoError(t, w.Append(ctx, tx, outbox.Message{EventID: uuid.New(), Stream: "s", Key: "k", Version: 1}))
				require.NoError(t, tx.Commit(ctx))
				r, err := outbox.NewRelay(pg.Pool, outbox.HandlerFunc(func(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
					return make([]outbox.Result, len(batch)), nil
				}), &outbox.RelayConfig{Schema: pg.Schema})
				require.NoError(t, err)
				n, err := r.RunOnce(ctx)
				require.NoError(t, err)
				require.Equal(t, 1, n)
			}
			_, err = holder.Exec(ctx, `SELECT pg_advisory_unlock($1)`, int64(outbox.MigrationLockKey))
			require.NoError(t, err)
			for range replicas {
				require.NoError(t, <-errs)
			}
		})
	}
}

// TestMigrateLeavesACallersTransactionsLevelAlone runs Migrate inside a
// database/sql transaction (SQLTx) at REPEATABLE READ, and inside a pgx.Tx:
// Migrate sets READ COMMITTED only for its own implicit transaction, never
// for a caller's.
func TestMigrateLeavesACallersTransactionsLevelAlone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testenv.Postgres(t)
	db, err := sql.Open("pgx", pg.ConnString)
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })

	t.Run("RepeatableReadTxAfterAStatement", func(t *testing.T) {
		t.Parallel()
		tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
		require.NoError(t, err)
		defer tx.Rollback() //nolint:errcheck
		// The application's own work first.
		_, err = tx.ExecContext(ctx, `SELECT count(*) FROM pg_class`)
		require.NoError(t, err)
		require.NoError(t, outbox.Migrate(ctx, outbox.SQLTx(tx), &outbox.Config{Schema: pg.Schema}))
	})
	// A pgx.Tx is recognised as a transaction too.
	t.Run("PgxRepeatableReadTxIsLeftAlone", func(t *testing.T) {
		t.Parallel()
		tx, err := pg.Pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck
		require.NoError(t, outbox.Migrate(ctx, tx, &outbox.Config{Schema: pg.Schema}))
		var level string
		require.NoError(t, tx.QueryRow(ctx, `SHOW transaction_isolation`).Scan(&level))
		require.Equal(t, "repeatable read", level, "Migrate changed the caller's transaction's isolation level")
	})
	t.Run("RepeatableReadTxIsLeftAlone", func(t *testing.T) {
		t.Parallel()
		tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
		require.NoError(t, err)
		defer tx.Rollback() //nolint:errcheck
		require.NoError(t, outbox.Migrate(ctx, outbox.SQLTx(tx), &outbox.Config{Schema: pg.Schema}))
		var level string
		require.NoError(t, tx.QueryRowContext(ctx, `SHOW transaction_isolation`).Scan(&level))
		require.Equal(t, "repeatable read", level, "Migrate changed the caller's transaction's isolation level")
	})
}

// TestMigrateFiniteCreatedAt covers migration 006: a created_at of
// 'infinity' or '-infinity' is refused for new rows, and pending rows that
// already hold one are repaired, since the constraint also checks the
// relay's updates of them.
func TestMigrateFiniteCreatedAt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("RefusesComposedInsert", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		for _, value := range []string{"infinity", "-infinity"} {
			_, err := b.pool.Exec(ctx, `INSERT INTO `+b.writer.Table()+` (event_id, stream, key, version, payload, created_at)
				VALUES (gen_random_uuid(), 's', 'k', 1, '', $1::timestamptz)`, value)
			var pgErr *pgconn.PgError
			require.ErrorAs(t, err, &pgErr, value)
			require.Equal(t, "23514", pgErr.Code, value)
			require.Equal(t, "verity_outbox_created_at_finite", pgErr.ConstraintName, value)
		}
	})

	t.Run("RepairsPendingRows", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.insertBeforeMigration006(t, "k", "-infinity")
		require.NoError(t, outbox.Migrate(ctx, b.pool, b.cfg))
		var age time.Duration
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT now() - created_at FROM `+b.writer.Table()).Scan(&age))
		require.GreaterOrEqual(t, age, time.Duration(0))
		require.Less(t, age, time.Minute)

		// The relay's retry updates the row, which the constraint checks.
		r := b.relay(t, nil, &recorder{fail: func(outbox.Record) error { return errors.New("fails") }}, outbox.RelayConfig{})
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		rows := b.rows(t)
		require.Len(t, rows, 1)
		require.Equal(t, 1, rows[0].Attempts)
		require.Equal(t, "fails", *rows[0].LastError)
	})

	// 006 gives pending rows holding 'infinity' (not only '-infinity') the
	// migration's time, and leaves rows kept published as they are.
	t.Run("RepairsBothInfinitiesOfPendingRowsOnly", func(t *testing.T) {
		t.Parallel()
		pg, table := outboxBefore(t, "006")
		cfg := &outbox.Config{Schema: pg.Schema}
		_, err := pg.Pool.Exec(ctx, `INSERT INTO `+table+` (event_id, stream, key, version, payload, created_at, published_at)
			VALUES (gen_random_uuid(), 's', 'pos', 1, '', 'infinity', NULL),
			       (gen_random_uuid(), 's', 'neg', 1, '', '-infinity', NULL),
			       (gen_random_uuid(), 's', 'kept', 1, '', 'infinity', now())`)
		require.NoError(t, err)
		require.NoError(t, outbox.Migrate(ctx, pg.Pool, cfg))
		rows, err := pg.Pool.Query(ctx, `SELECT key || '=' || CASE WHEN isfinite(created_at) THEN 'finite' ELSE created_at::text END FROM `+table+` ORDER BY key`)
		require.NoError(t, err)
		got, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		require.Equal(t, []string{"kept=infinity", "neg=finite", "pos=finite"}, got)
	})

	// 006's UPDATE runs after its constraint is in place "so it finds every
	// such row": also one a writer of the old release committed while the
	// first Migrate waited for the constraint's lock.
	t.Run("RepairsARowCommittedWhileMigrateWaits", func(t *testing.T) {
		t.Parallel()
		pg, table := outboxBefore(t, "006")
		cfg := &outbox.Config{Schema: pg.Schema}
		tx, err := pg.Pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(context.Background()) //nolint:errcheck
		_, err = tx.Exec(ctx, `INSERT INTO `+table+` (event_id, stream, key, version, payload, created_at) VALUES (gen_random_uuid(), 's', 'k', 1, '', 'infinity')`)
		require.NoError(t, err)
		done := make(chan error, 1)
		go func() { done <- outbox.Migrate(ctx, pg.Pool, cfg) }()
		require.Eventually(t, func() bool {
			var n int
			err := pg.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = to_regclass($1)`, table).Scan(&n)
			return err == nil && n == 1
		}, 10*time.Second, 10*time.Millisecond)
		require.NoError(t, tx.Commit(ctx))
		require.NoError(t, <-done)
		var finite bool
		require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT isfinite(created_at) FROM `+table).Scan(&finite))
		require.True(t, finite, "the row committed while Migrate waited was repaired")
	})
}

// TestMigrateLongStreamsBeforeMigration005 covers outboxes upgraded from
// the release before 005, whose Append put no bound on the stream: pending
// rows with a stream over MaxStreamBytes must neither stall the relays nor
// the upgrade (005's NOT VALID constraint still checks every UPDATE), and
// are kept, in the dead-letter table.
func TestMigrateLongStreamsBeforeMigration005(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dead := func(pg *testenv.PG) string {
		return pgx.Identifier{pg.Schema, outbox.TableDefault + "_dead"}.Sanitize()
	}

	// 005 bounds the stream at MaxStreamBytes inclusive: Append takes a
	// stream of exactly that length, and the constraint refuses a composed
	// INSERT one byte longer.
	t.Run("ConstraintAdmitsMaxStreamBytes", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendCommitted(t, newMessage(strings.Repeat("s", outbox.MaxStreamBytes), "k", 1))
		_, err := b.pool.Exec(ctx, `INSERT INTO `+b.writer.Table()+` (event_id, stream, key, version, payload) VALUES (gen_random_uuid(), $1, 'k', 1, '')`,
			strings.Repeat("s", outbox.MaxStreamBytes+1))
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr)
		require.Equal(t, "verity_outbox_stream_length", pgErr.ConstraintName)
	})

	// 007 moves a pending row whose stream is one byte over MaxStreamBytes,
	// and leaves rows kept published (KeepPublished) and a row of exactly
	// MaxStreamBytes where they are.
	t.Run("EdgesOfMaxStreamBytes", func(t *testing.T) {
		t.Parallel()
		pg, table := outboxBefore005(t)
		_, err := pg.Pool.Exec(ctx, `INSERT INTO `+table+` (event_id, stream, key, version, payload, published_at)
			VALUES (gen_random_uuid(), repeat('x', $1::int + 1), 'over', 1, '', NULL),
			       (gen_random_uuid(), repeat('x', $1::int), 'max', 1, '', NULL),
			       (gen_random_uuid(), repeat('x', $1::int + 500), 'kept', 1, '', now())`, outbox.MaxStreamBytes)
		require.NoError(t, err)
		require.NoError(t, outbox.Migrate(ctx, pg.Pool, &outbox.Config{Schema: pg.Schema}))
		keys := func(table string) []string {
			rows, err := pg.Pool.Query(ctx, `SELECT key FROM `+table+` ORDER BY key`)
			require.NoError(t, err)
			out, err := pgx.CollectRows(rows, pgx.RowTo[string])
			require.NoError(t, err)
			return out
		}
		require.Equal(t, []string{"kept", "max"}, keys(table))
		require.Equal(t, []string{"over"}, keys(dead(pg)))
	})

	// 007: "a row whose id the dead-letter table already holds ... cannot be
	// moved: Migrate then fails, moving nothing, with a message that counts
	// them".
	t.Run("IDAlreadyDeadFailsMovingNothing", func(t *testing.T) {
		t.Parallel()
		pg, table := outboxBefore005(t)
		_, err := pg.Pool.Exec(ctx, `INSERT INTO `+dead(pg)+` (id, event_id, stream, key, version, payload, created_at, attempts, last_error)
			VALUES (7, gen_random_uuid(), 's', 'old', 1, '', now(), 3, 'x')`)
		require.NoError(t, err)
		_, err = pg.Pool.Exec(ctx, `INSERT INTO `+table+` (id, event_id, stream, key, version, payload) OVERRIDING SYSTEM VALUE
			VALUES (7, gen_random_uuid(), repeat('x', 2000), 'long', 1, '')`)
		require.NoError(t, err)
		err = outbox.Migrate(ctx, pg.Pool, &outbox.Config{Schema: pg.Schema})
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr)
		require.Contains(t, pgErr.Message, "1 pending outbox rows have a stream longer than")
		var n int
		require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&n))
		require.Equal(t, 1, n, "nothing moved, nothing lost")
	})

	// One failed attempt of such a row used to fail the settle of its batch
	// and then every claim (the takeover counts the attempt with an UPDATE),
	// for every partition: the relay never delivered anything again.
	t.Run("MovedToDeadLettersRelaysDeliverTheRest", func(t *testing.T) {
		t.Parallel()
		pg, table := outboxBefore005(t)
		long := strings.Repeat("x", 2000)
		_, err := pg.Pool.Exec(ctx, `INSERT INTO `+table+` (id, event_id, stream, key, version, payload, attempts, last_error)
			OVERRIDING SYSTEM VALUE
			VALUES (1, $1, $2, 'long', 1, '\x00', 1, 'handler bug'), (2, $3, 's', 'same-partition', 1, '\x00', 0, NULL)`,
			uuid.New(), long, uuid.New())
		require.NoError(t, err)

		cfg := &outbox.Config{Schema: pg.Schema}
		for range 2 { // the second run finds nothing to move
			require.NoError(t, outbox.Migrate(ctx, pg.Pool, cfg))
		}
		dead := pgx.Identifier{pg.Schema, outbox.TableDefault + "_dead"}.Sanitize()
		var (
			id       int64
			stream   string
			attempts int
			lastErr  string
		)
		require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT id, stream, attempts, last_error FROM `+dead).Scan(&id, &stream, &attempts, &lastErr))
		require.EqualValues(t, 1, id)
		require.Equal(t, long, stream)
		require.Equal(t, 1, attempts)
		require.Equal(t, "moved to the dead letters by migration 007: its stream is 2000 bytes, more than the 1024 (MaxStreamBytes) "+
			"the outbox accepts since migration 005, so it could not be retried; last error: handler bug", lastErr)

		r, err := outbox.NewRelay(pg.Pool, outbox.HandlerFunc(func(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			return make([]outbox.Result, len(batch)), nil
		}), &outbox.RelayConfig{Schema: pg.Schema})
		require.NoError(t, err)
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		var left int
		require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&left))
		require.Zero(t, left)
	})

	// 006's fix-up UPDATE of a non-finite created_at used to be refused by
	// 005's constraint for such a row, so the upgrade failed on every try.
	t.Run("InfiniteCreatedAtDoesNotFailUpgrade", func(t *testing.T) {
		t.Parallel()
		pg, table := outboxBefore005(t)
		_, err := pg.Pool.Exec(ctx, `INSERT INTO `+table+` (event_id, stream, key, version, payload, created_at)
			VALUES ($1, $2, 'k', 1, '\x00', 'infinity')`, uuid.New(), strings.Repeat("x", 2000))
		require.NoError(t, err)
		for range 2 {
			require.NoError(t, outbox.Migrate(ctx, pg.Pool, &outbox.Config{Schema: pg.Schema}))
		}
		var createdAt string
		require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT created_at::text FROM `+
			pgx.Identifier{pg.Schema, outbox.TableDefault + "_dead"}.Sanitize()).Scan(&createdAt))
		require.Equal(t, "infinity", createdAt, "kept as it was")
	})

	// A stream too long even for the dead-letter index cannot be moved:
	// Migrate fails, saying how many and what to do, and loses nothing.
	t.Run("TooLongForDeadLetterIndexFailsMigrate", func(t *testing.T) {
		t.Parallel()
		pg, table := outboxBefore005(t)
		var incompressible strings.Builder
		for incompressible.Len() < 8000 {
			incompressible.WriteString(uuid.NewString())
		}
		_, err := pg.Pool.Exec(ctx, `INSERT INTO `+table+` (event_id, stream, key, version, payload)
			VALUES ($1, $2, 'too-long', 1, '\x00'), ($3, $4, 'long', 1, '\x00')`,
			uuid.New(), incompressible.String(), uuid.New(), strings.Repeat("x", 2000))
		require.NoError(t, err)
		err = outbox.Migrate(ctx, pg.Pool, &outbox.Config{Schema: pg.Schema})
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr)
		require.Equal(t, "1 pending outbox rows have a stream longer than 1024 bytes (MaxStreamBytes) and cannot be moved to the dead letters "+
			"(the stream is too long for their (stream, id) index, or their id is there already)", pgErr.Message)
		require.Contains(t, pgErr.Hint, "then migrate again")
		var keys []string
		rows, err := pg.Pool.Query(ctx, `SELECT key FROM `+table+` ORDER BY key`)
		require.NoError(t, err)
		keys, err = pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		require.Equal(t, []string{"long", "too-long"}, keys, "nothing moved, nothing lost")
	})
}

// TestMigrateDeadCreatedIndexOverLongestDeadLetter upgrades an outbox of the
// release before migration 008 whose dead-letter table holds a row with the
// longest stream 004's (stream, id) index admits: 008's (stream,
// created_at) index, of the same size, must admit it too, or the upgrade
// would fail on such an outbox.
func TestMigrateDeadCreatedIndexOverLongestDeadLetter(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testenv.Postgres(t)
	cfg := &outbox.Config{Schema: pg.Schema}
	migrateBefore(t, pg, cfg, "008")
	dead := pgx.Identifier{pg.Schema, outbox.TableDefault + "_dead"}.Sanitize()
	var random strings.Builder
	for random.Len() < 8000 {
		random.WriteString(uuid.NewString())
	}
	insert := func(n int) error {
		_, err := pg.Pool.Exec(ctx, `INSERT INTO `+dead+` (id, event_id, stream, key, version, payload, created_at, attempts, last_error)
			VALUES ($1, $2, $3, 'k', 1, '\x00', now(), 1, 'x')`, n, uuid.New(), random.String()[:n])
		return err
	}
	// The longest prefix of random that enters the dead-letter table, by
	// bisection: a longer one is refused by 004's index.
	lo, hi := 1, random.Len()
	for lo < hi {
		mid := (lo + hi + 1) / 2
		if err := insert(mid); err == nil {
			_, err := pg.Pool.Exec(ctx, `DELETE FROM `+dead)
			require.NoError(t, err)
			lo = mid
		} else {
			var pgErr *pgconn.PgError
			require.ErrorAs(t, err, &pgErr)
			require.Equal(t, "54000", pgErr.Code, "refused by the index: %v", err)
			hi = mid - 1
		}
	}
	require.Greater(t, lo, outbox.MaxStreamBytes)
	require.NoError(t, insert(lo))

	require.NoError(t, outbox.Migrate(ctx, pg.Pool, cfg))
	var valid bool
	require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT i.indisvalid FROM pg_index AS i
		JOIN pg_class AS c ON c.oid = i.indexrelid JOIN pg_namespace AS n ON n.oid = c.relnamespace
		WHERE n.nspname = $1 AND c.relname = $2`, pg.Schema, outbox.TableDefault+"_dead_created_idx").Scan(&valid))
	require.True(t, valid)
	var streamBytes int
	require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT octet_length(stream) FROM `+dead).Scan(&streamBytes))
	require.Equal(t, lo, streamBytes, "the dead letter is kept as it was")
}

// outboxBefore005 returns a schema holding an outbox of the release before
// migration 005 (001-004 applied), and its quoted table name.
func outboxBefore005(t *testing.T) (*testenv.PG, string) {
	t.Helper()
	return outboxBefore(t, "005")
}

// outboxBefore returns a schema of the test's own holding an outbox of the
// release before migration first, and the outbox's qualified name.
func outboxBefore(t *testing.T, first string) (*testenv.PG, string) {
	t.Helper()
	pg := testenv.Postgres(t)
	migrateBefore(t, pg, &outbox.Config{Schema: pg.Schema}, first)
	return pg, pgx.Identifier{pg.Schema, outbox.TableDefault}.Sanitize()
}

// migrateBefore applies cfg's migrations whose names sort before first (a
// migration's number, "005"), as an outbox of the release before it, and
// fails unless there is a migration first.
func migrateBefore(t *testing.T, pg *testenv.PG, cfg *outbox.Config, first string) {
	t.Helper()
	migrations, err := outbox.Migrations(cfg)
	require.NoError(t, err)
	found := false
	for _, m := range migrations {
		if m.Name >= first {
			found = strings.HasPrefix(m.Name, first)
			break
		}
		_, err := pg.Pool.Exec(context.Background(), m.SQL)
		require.NoError(t, err, m.Name)
	}
	require.True(t, found, "no migration %s", first)
}

// TestMigratePrivileges covers Migrate by a role that uses the outbox but
// neither owns its tables nor may create schemas or tables: on an outbox
// already migrated it needs nothing more (CREATE SCHEMA and CREATE TABLE
// IF NOT EXISTS check CREATE first, and ALTER TABLE … SET ownership, even
// when they have nothing to do).
func TestMigratePrivileges(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("MigratedOutboxNeedsOnlyUsage", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		cfg := &outbox.Config{Schema: pg.Schema}
		require.NoError(t, outbox.Migrate(ctx, pg.Pool, cfg)) // by the owner
		connString := outboxUserRole(t, pg)
		conn, err := pgx.Connect(ctx, connString)
		require.NoError(t, err)
		defer conn.Close(ctx)

		w, err := outbox.NewWriter(cfg)
		require.NoError(t, err)
		require.NoError(t, pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			return w.Append(ctx, tx, newMessage("s", "k", 1))
		}))
		require.NoError(t, outbox.Migrate(ctx, conn, cfg), "Migrate of a fully migrated outbox by a role that uses it")
	})

	// The guards compare the settings, so settings an owner changed are
	// put back as before.
	t.Run("ChangedSettingsRestored", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		cfg := &outbox.Config{Schema: pg.Schema}
		require.NoError(t, outbox.Migrate(ctx, pg.Pool, cfg))
		table := pgx.Identifier{pg.Schema, outbox.TableDefault}.Sanitize()
		leases := pgx.Identifier{pg.Schema, outbox.TableDefault + "_leases"}.Sanitize()
		_, err := pg.Pool.Exec(ctx, `ALTER TABLE `+table+` SET (autovacuum_vacuum_threshold = 50, fillfactor = 70);
			ALTER TABLE `+leases+` RESET (toast.autovacuum_vacuum_cost_delay)`)
		require.NoError(t, err)
		require.NoError(t, outbox.Migrate(ctx, pg.Pool, cfg))
		var heap, toast []string
		require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT c.reloptions, t.reloptions FROM pg_class c JOIN pg_class t ON t.oid = c.reltoastrelid
			WHERE c.oid = $1::regclass`, leases).Scan(&heap, &toast))
		require.ElementsMatch(t, []string{"autovacuum_vacuum_scale_factor=0", "autovacuum_vacuum_threshold=1000", "autovacuum_vacuum_cost_delay=0"}, heap)
		require.ElementsMatch(t, []string{"autovacuum_vacuum_scale_factor=0", "autovacuum_vacuum_threshold=1000", "autovacuum_vacuum_cost_delay=0"}, toast)
		require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT reloptions FROM pg_class WHERE oid = $1::regclass`, table).Scan(&heap))
		require.ElementsMatch(t, []string{"autovacuum_vacuum_scale_factor=0", "autovacuum_vacuum_threshold=5000", "autovacuum_vacuum_cost_delay=0", "fillfactor=100"}, heap)
	})
}

// outboxUserRole creates a login role, dropped at cleanup, with what a role
// needs to use pg's outbox (USAGE on the schema, DML on its tables) and no
// more, and returns a connection string for it.
func outboxUserRole(t *testing.T, pg *testenv.PG) string {
	t.Helper()
	ctx := context.Background()
	role := "verity_outbox_user_" + services.RandomSuffix(8)
	schema := pgx.Identifier{pg.Schema}.Sanitize()
	for _, stmt := range []string{
		"CREATE ROLE " + role + " LOGIN",
		"GRANT USAGE ON SCHEMA " + schema + " TO " + role,
		"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA " + schema + " TO " + role,
	} {
		_, err := pg.Pool.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
	}
	t.Cleanup(func() {
		conn, err := pgx.Connect(context.Background(), pg.ServerURL)
		require.NoError(t, err)
		defer conn.Close(context.Background())
		_, err = conn.Exec(context.Background(), "DROP OWNED BY "+role+"; DROP ROLE "+role)
		require.NoError(t, err)
	})
	u, err := url.Parse(pg.ConnString)
	require.NoError(t, err)
	u.User = url.User(role)
	return u.String()
}
