package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
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
			"004_dead_stream_index.sql", "005_stream_length.sql", "006_created_at_finite.sql"}, names)
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
			require.Equal(t, 9, blocks, "one DO block per index, and one per constraint (stream length, finite created_at)")
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
		// _dead_stream_idx, also in a generic plan, is checked by its own
		// test (leaderboard.TestLagProbePlan) against the real statement.
		require.Subset(t, indexes, []string{cfg.Table + "_dead_stream_idx", cfg.Table + "_partition_idx"})
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
// database/sql transaction (SQLTx) at REPEATABLE READ: Migrate sets READ
// COMMITTED only for its own implicit transaction, never for a caller's.
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
}
