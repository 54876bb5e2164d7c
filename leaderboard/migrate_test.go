package leaderboard

import (
	"context"
	"fmt"
	"net/url"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/services"
	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
	"github.com/verity-go/verity/reconcile"
)

func TestMigrate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// Cancelled while its script waits for the advisory lock another
	// migration holds, Migrate stops waiting on the server before it
	// returns (pgx alone returns first and cancels in the background).
	t.Run("CancelledStopsWaitingOnTheServer", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		cfg := tb.board.Config()
		conn, err := pgx.Connect(ctx, tb.pg.ConnString)
		require.NoError(t, err)
		defer conn.Close(ctx)
		holder, err := tb.pg.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = holder.Rollback(ctx) }()
		_, err = holder.Exec(ctx, `SELECT pg_advisory_xact_lock(8317442061)`)
		require.NoError(t, err)

		waiting := func() int {
			var n int
			require.NoError(t, tb.pg.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE NOT granted AND pid = $1`, conn.PgConn().PID()).Scan(&n))
			return n
		}
		mctx, cancel := context.WithCancel(ctx)
		defer cancel()
		done := make(chan error, 1)
		go func() { done <- Migrate(mctx, conn, &cfg) }()
		require.Eventually(t, func() bool { return waiting() == 1 }, 10*time.Second, 5*time.Millisecond)
		cancel()
		require.ErrorIs(t, <-done, context.Canceled)
		require.Zero(t, waiting())
		require.NoError(t, holder.Rollback(ctx))
		require.NoError(t, Migrate(ctx, conn, &cfg), "the connection is kept")
	})

	// A migrated schema must migrate again without waiting for the
	// transactions that write to it: a start-up Migrate would otherwise
	// stall behind, and then block, every submit.
	t.Run("DoesNotWaitForOpenWriters", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		tb.submit(t, "user-a", 10)
		cfg := tb.board.Config()

		// A transaction holding a row of user_scores (and no outbox row, so
		// that only this package's script is at stake in Migrate).
		tx, err := tb.pg.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		_, err = tx.Exec(ctx, `UPDATE user_scores SET score = score + 1 WHERE user_id = 'user-a'`)
		require.NoError(t, err)
		// A lock wait behind tx would last until tx ends, so any bound
		// catches it; a generous one also covers Migrate queuing behind the
		// migrations of other tests (one advisory lock) on a loaded machine.
		mctx, cancel := context.WithTimeout(ctx, 15*time.Second)
		defer cancel()
		require.NoError(t, Migrate(mctx, tb.pg.Pool, &cfg))

		// An open SubmitTx also holds an outbox row; the board's own
		// migration script does not wait for it either.
		tx2, err := tb.pg.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx2.Rollback(ctx) }()
		_, err = tb.board.SubmitTx(ctx, tx2, Command{EventID: uuid.New(), UserID: "user-b", Delta: 1})
		require.NoError(t, err)
		mctx2, cancel2 := context.WithTimeout(ctx, 15*time.Second)
		defer cancel2()
		script, err := MigrationSQL(&cfg)
		require.NoError(t, err)
		_, err = tb.pg.Pool.Exec(mctx2, script)
		require.NoError(t, err)
	})

	// The index guard puts the index name in a string literal inside a
	// dollar-quoted body: names holding quotes, backslashes or dollar
	// quotes must stay names. Were the guard to look up another name, the
	// second Migrate would fail to create the existing index again.
	t.Run("IndexGuardQuotesNames", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		rd := testenv.Redis(t)
		cfg := &Config{Name: "b", Schema: pg.Schema + `'\$$$verity$`, KeyPrefix: rd.Prefix}
		t.Cleanup(func() {
			_, _ = pg.Pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{cfg.Schema}.Sanitize()+" CASCADE")
		})
		for i := 0; i < 2; i++ {
			require.NoError(t, Migrate(ctx, pg.Pool, cfg))
		}
		var indexes int
		require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_indexes WHERE schemaname = $1 AND indexname = $2`,
			cfg.Schema, rankIndexName).Scan(&indexes))
		require.Equal(t, 1, indexes)
	})

	// A CREATE INDEX CONCURRENTLY of the rank index that failed leaves an
	// invalid index of its name, which the planner cannot use: Migrate
	// kept it without a word, and PostgreSQL reads sorted the whole table.
	// It fails instead, as the outbox's Migrate does, until it is dropped.
	t.Run("InvalidRankIndexRefused", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		cfg := &Config{Schema: pg.Schema}
		require.NoError(t, Migrate(ctx, pg.Pool, cfg))
		index := pgx.Identifier{pg.Schema, rankIndexName}.Sanitize()
		scores := pgx.Identifier{pg.Schema, "user_scores"}.Sanitize()
		_, err := pg.Pool.Exec(ctx, `DROP INDEX `+index+`;
			INSERT INTO `+scores+` (board, user_id, score, version) VALUES ('b', 'u1', 1, 1), ('b', 'u2', 1, 1)`)
		require.NoError(t, err)
		// Unique on board: the build fails on the duplicate, and leaves it.
		_, err = pg.Pool.Exec(ctx, `CREATE UNIQUE INDEX CONCURRENTLY `+pgx.Identifier{rankIndexName}.Sanitize()+` ON `+scores+` (board)`)
		require.Error(t, err)

		err = Migrate(ctx, pg.Pool, cfg)
		require.ErrorContains(t, err, "exists but is invalid")
		_, err = pg.Pool.Exec(ctx, `DROP INDEX `+index)
		require.NoError(t, err)
		require.NoError(t, Migrate(ctx, pg.Pool, cfg))
		var valid bool
		require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)`, index).Scan(&valid))
		require.True(t, valid)
	})

	// A name that spells a placeholder of the script is still only a name.
	t.Run("NameHoldingAPlaceholder", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		rd := testenv.Redis(t)
		cfg := &Config{Name: "b", Schema: pg.Schema + "{{do}}{{user_scores}}", KeyPrefix: rd.Prefix}
		t.Cleanup(func() {
			_, _ = pg.Pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{cfg.Schema}.Sanitize()+" CASCADE")
		})
		require.NoError(t, Migrate(ctx, pg.Pool, cfg))
		board, err := New(pg.Pool, rd.Client, cfg)
		require.NoError(t, err)
		_, err = board.Submit(ctx, Command{EventID: uuid.New(), UserID: "u", Delta: 1})
		require.NoError(t, err)
	})

	// A board used before Migrate says so: every statement that meets a
	// missing table returns ErrNotMigrated, which is outbox.ErrNotMigrated,
	// the board's Worker's error for the same mistake; so do reads from
	// Redis, under every policy.
	t.Run("BoardUsedBeforeMigrate", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		rd := testenv.Redis(t)
		cfg := &Config{Name: "weekly", Schema: pg.Schema, KeyPrefix: rd.Prefix, ReadPolicy: FallbackToPostgres}
		board, err := New(pg.Pool, rd.Client, cfg)
		require.NoError(t, err)
		t.Cleanup(board.Close)
		alone := *cfg
		alone.MaxSubmitsPerStatement = 1
		ungrouped, err := New(pg.Pool, rd.Client, &alone)
		require.NoError(t, err)
		t.Cleanup(ungrouped.Close)
		cmd := func() Command { return Command{EventID: uuid.New(), UserID: "ada", Delta: 1} }

		for name, call := range map[string]func() error{
			"Submit":          func() error { _, err := board.Submit(ctx, cmd()); return err },
			"SubmitUngrouped": func() error { _, err := ungrouped.Submit(ctx, cmd()); return err },
			"SubmitBatch":     func() error { _, err := board.SubmitBatch(ctx, []Command{cmd(), cmd()}); return err },
			"SubmitTx": func() error {
				tx, err := pg.Pool.Begin(ctx)
				require.NoError(t, err)
				defer func() { _ = tx.Rollback(ctx) }()
				_, err = board.SubmitTx(ctx, tx, cmd())
				return err
			},
			"SubmitBatchTx": func() error {
				tx, err := pg.Pool.Begin(ctx)
				require.NoError(t, err)
				defer func() { _ = tx.Rollback(ctx) }()
				_, err = board.SubmitBatchTx(ctx, tx, []Command{cmd(), cmd()})
				return err
			},
			"Authoritative": func() error { _, err := board.Authoritative(ctx, 10); return err },
			"PageFromPostgres": func() error {
				_, err := board.Page(ctx, "", 10, forcePostgres())
				return err
			},
			"RankFromPostgres": func() error {
				_, _, err := board.Rank(ctx, "ada", forcePostgres())
				return err
			},
			"AroundFromPostgres": func() error {
				_, err := board.Around(ctx, "ada", 1, forcePostgres())
				return err
			},
			"Source": func() error { _, err := board.Source().Page(ctx, reconcile.Cursor{}, 10); return err },
			// Redis reads: their lag probe meets the missing outbox, which
			// must not become an empty page (ServeStale) or a *StaleError.
			"TopServeStale": func() error {
				_, err := board.Top(ctx, 10, WithPolicy(ServeStale))
				return err
			},
			"PageFailClosed": func() error {
				_, err := board.Page(ctx, "", 10, WithPolicy(FailClosed))
				return err
			},
			"RankServeStale": func() error {
				_, _, err := board.Rank(ctx, "ada", WithPolicy(ServeStale))
				return err
			},
			"AroundFailClosed": func() error {
				_, err := board.Around(ctx, "ada", 1, WithPolicy(FailClosed))
				return err
			},
			"RankAtLeastFailClosed": func() error {
				_, _, err := board.Rank(ctx, "ada", AtLeast("ada", 1), WithPolicy(FailClosed))
				return err
			},
			"TopAtLeastFromPostgres": func() error {
				_, err := board.Top(ctx, 10, AtLeast("ada", 1), forcePostgres())
				return err
			},
		} {
			err := call()
			require.ErrorIs(t, err, ErrNotMigrated, name)
			require.ErrorIs(t, err, outbox.ErrNotMigrated, name)
			require.ErrorContains(t, err, "run leaderboard.Migrate", name)
			if name == "SubmitTx" || name == "SubmitBatchTx" {
				// Or the caller's transaction is on another database.
				require.ErrorContains(t, err, "give "+name+" a transaction of that database")
			}
			require.ErrorContains(t, err, pg.Schema, name)
			var pgErr *pgconn.PgError
			require.ErrorAs(t, err, &pgErr, "%s: the driver's error is kept", name)
		}
		require.Equal(t, time.Duration(-1), board.Freshness(ctx).Lag, "the lag cannot be measured")

		w, err := board.Worker(nil)
		require.NoError(t, err)
		_, err = w.RunOnce(ctx)
		require.ErrorIs(t, err, ErrNotMigrated, "the Worker's error is the same sentinel")
	})

	// A role that uses the board (USAGE on the schema, DML on its tables)
	// but may not create schemas or tables, nor owns them, can run Migrate
	// on a migrated schema, as services do at every start-up: CREATE
	// SCHEMA and CREATE TABLE IF NOT EXISTS check CREATE before they look.
	t.Run("MigratedSchemaNeedsOnlyUsage", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		cfg := tb.board.Config()
		role := "verity_board_user_" + services.RandomSuffix(8)
		schema := pgx.Identifier{tb.pg.Schema}.Sanitize()
		for _, stmt := range []string{
			"CREATE ROLE " + role + " LOGIN",
			"GRANT USAGE ON SCHEMA " + schema + " TO " + role,
			"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA " + schema + " TO " + role,
		} {
			_, err := tb.pg.Pool.Exec(ctx, stmt)
			require.NoError(t, err, stmt)
		}
		t.Cleanup(func() {
			conn, err := pgx.Connect(context.Background(), tb.pg.ServerURL)
			require.NoError(t, err)
			defer conn.Close(context.Background())
			_, err = conn.Exec(context.Background(), "DROP OWNED BY "+role+"; DROP ROLE "+role)
			require.NoError(t, err)
		})
		u, err := url.Parse(tb.pg.ConnString)
		require.NoError(t, err)
		u.User = url.User(role)
		conn, err := pgx.Connect(ctx, u.String())
		require.NoError(t, err)
		defer conn.Close(ctx)
		require.NoError(t, Migrate(ctx, conn, &cfg))
	})

	// An outbox named like one of the board's tables is refused before
	// anything is created.
	t.Run("OutboxTableNamedLikeABoardTable", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		for _, name := range []string{UserScoresTable, ScoreEventsTable, rankIndexName, UserScoresTable + "_pkey"} {
			err := Migrate(ctx, pg.Pool, &Config{Schema: pg.Schema, OutboxTable: name})
			var cerr *ConfigError
			require.ErrorAs(t, err, &cerr, name)
			require.Equal(t, "Config.OutboxTable", cerr.Field)
			require.ErrorIs(t, err, ErrInvalidConfig)
			_, err = New(pg.Pool, testenv.Redis(t).Client, &Config{Name: "b", Schema: pg.Schema, OutboxTable: name})
			require.ErrorAs(t, err, &cerr, name)
		}
		var relations int
		require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace WHERE n.nspname = $1`,
			pg.Schema).Scan(&relations))
		require.Zero(t, relations, "nothing created")
	})

	// "Safe to run concurrently": eight processes migrating two fresh
	// schemas at once all succeed, four times over; without the board
	// script's advisory lock two of its check-then-create blocks race
	// (a duplicate pg_type row). Then the same under a role whose default
	// isolation is SERIALIZABLE, which outbox.Migrate lowers for its own
	// part and the board's script does not need to.
	t.Run("Concurrent", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		pg := testenv.Postgres(t)
		serializable := (&testBundle{pg: pg}).newPool(t, func(pc *pgxpool.Config) {
			pc.ConnConfig.RuntimeParams["default_transaction_isolation"] = "serializable"
			pc.MaxConns = 8
		})
		for round := range 4 {
			schemas := []string{fmt.Sprintf("%s_r%d", pg.Schema, round), fmt.Sprintf("%s_r%d_other", pg.Schema, round)}
			t.Cleanup(func() {
				for _, schema := range schemas {
					_, _ = pg.Pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
				}
			})
			errs := make(chan error, 8)
			for i := range 8 {
				cfg := &Config{Schema: schemas[i%2]}
				go func() { errs <- Migrate(ctx, pg.Pool, cfg) }()
			}
			for range 8 {
				require.NoError(t, <-errs, "round %d", round)
			}

			schema := fmt.Sprintf("%s_s%d", pg.Schema, round)
			t.Cleanup(func() {
				_, _ = pg.Pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
			})
			for range 6 {
				go func() { errs <- Migrate(ctx, serializable, &Config{Schema: schema}) }()
			}
			for range 6 {
				require.NoError(t, <-errs, "serializable round %d", round)
			}
		}
	})

	// Migrate creates "the outbox tables (cfg.Schema, cfg.OutboxTable)",
	// not default-named ones.
	t.Run("ConfiguredOutboxTable", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		require.NoError(t, Migrate(ctx, pg.Pool, &Config{Schema: pg.Schema, OutboxTable: "board_outbox"}))
		var configured, defaultNamed *string
		require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT to_regclass($1)::text, to_regclass($2)::text`,
			pgx.Identifier{pg.Schema, "board_outbox"}.Sanitize(), pgx.Identifier{pg.Schema, outbox.TableDefault}.Sanitize()).Scan(&configured, &defaultNamed))
		require.NotNil(t, configured, "the configured outbox table exists")
		require.Nil(t, defaultNamed, "no default-named outbox was made")
	})
}
