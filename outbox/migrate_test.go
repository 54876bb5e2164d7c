package outbox_test

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
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
			"004_dead_stream_index.sql", "005_stream_length.sql"}, names)
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
			require.Equal(t, 8, blocks, "one DO block per index, and one for the stream length constraint")
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
