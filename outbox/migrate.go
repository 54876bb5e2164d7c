package outbox

import (
	"bytes"
	"context"
	"embed"
	"fmt"
	"io/fs"
	"sort"
	"strings"
	"text/template"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/verity-go/verity/internal/deps"
	"github.com/verity-go/verity/internal/pgcancel"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Execer is the narrowest database handle Migrate needs. *pgx.Conn,
// *pgxpool.Pool, pgx.Tx and every Tx satisfy it.
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

var (
	_ Execer = (*pgxpool.Pool)(nil)
	_ Execer = (*pgx.Conn)(nil)
	_ Execer = Tx(nil)
)

// migrationLockKey serialises concurrent Migrate calls (several processes
// starting at once) with a transaction-scoped advisory lock: without it two
// "CREATE TABLE IF NOT EXISTS" can race and one fails on the catalog's unique
// index. The constant is arbitrary; it spells "verity" in ASCII.
const migrationLockKey = 0x766572697479

// Migration is one embedded migration file rendered for a configuration.
type Migration struct {
	Name string // file name, e.g. "001_outbox.sql"; files apply in name order
	SQL  string // the statements, identifiers quoted
}

// Migrations renders the embedded migration files for cfg (nil means
// defaults), in the order they must be applied. Every statement is idempotent,
// so a tool that tracks applied versions (goose, golang-migrate, atlas) can
// store each Migration as one version, and a tool that does not can apply all
// of them every time.
func Migrations(cfg *Config) ([]Migration, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	n := newNames(cfg.Schema, cfg.Table)

	entries, err := fs.ReadDir(migrationFiles, "migrations")
	if err != nil {
		return nil, fmt.Errorf("outbox: read embedded migrations: %w", err)
	}
	sort.Slice(entries, func(i, j int) bool { return entries[i].Name() < entries[j].Name() })

	out := make([]Migration, 0, len(entries))
	for _, e := range entries {
		raw, err := migrationFiles.ReadFile("migrations/" + e.Name())
		if err != nil {
			return nil, fmt.Errorf("outbox: read migration %s: %w", e.Name(), err)
		}
		// The template only ever substitutes fields of names, which are
		// quoted identifiers; option "missingkey=error" has no effect on
		// structs, so Execute itself fails on an unknown field. createIndex
		// renders a {{define}}d CREATE INDEX and guards it (see
		// createIndexIfMissing).
		// createTable and do likewise render a {{define}}d statement or
		// PL/pgSQL body; createSchema and setOptions guard statements that
		// check privileges before they find there is nothing to do.
		tmpl := template.New(e.Name())
		render := func(def string) (string, error) {
			var stmt bytes.Buffer
			if err := tmpl.ExecuteTemplate(&stmt, def, n); err != nil {
				return "", err
			}
			return strings.TrimSpace(stmt.String()), nil
		}
		tmpl, err = tmpl.Funcs(template.FuncMap{
			"addCheck":     addCheckIfMissing,
			"createSchema": createSchemaIfMissing,
			"setOptions":   setOptionsIfDifferent,
			"createIndex": func(def, index string) (string, error) {
				stmt, err := render(def)
				if err != nil {
					return "", err
				}
				return createIndexIfMissing(n.Schema+"."+index, stmt), nil
			},
			"createTable": func(def, table string) (string, error) {
				stmt, err := render(def)
				if err != nil {
					return "", err
				}
				return createTableIfMissing(table, stmt), nil
			},
			"do": func(def string) (string, error) {
				body, err := render(def)
				if err != nil {
					return "", err
				}
				return "DO " + dollarQuote("\n"+body+"\n"), nil
			},
		}).Parse(string(raw))
		if err != nil {
			return nil, fmt.Errorf("outbox: parse migration %s: %w", e.Name(), err)
		}
		var buf bytes.Buffer
		if err := tmpl.Execute(&buf, n); err != nil {
			return nil, fmt.Errorf("outbox: render migration %s: %w", e.Name(), err)
		}
		out = append(out, Migration{Name: e.Name(), SQL: buf.String()})
	}
	return out, nil
}

// createIndexIfMissing wraps a CREATE INDEX statement in a DO block that
// runs it only when index (schema-qualified, quoted) does not exist.
// CREATE INDEX IF NOT EXISTS would not do: it takes its SHARE lock on the
// table before it finds the index, and holds it until the transaction ends,
// so every Migrate at start-up would make all writers of a live outbox wait
// behind the oldest open one. The block's body and the index name inside it
// are dollar-quoted with tags that the quoted text does not contain, so no
// identifier can end either literal early. No line of the block ends with a
// semicolon: tools that split scripts into statements at such lines, blind
// to dollar quotes (goose without StatementBegin), would cut it apart.
//
// An index of that name that exists but is invalid (a CREATE INDEX
// CONCURRENTLY that failed, was cancelled, or is still running) fails the
// migration with a message saying so: the planner cannot use it, and
// keeping it silently would leave the relays' claims without their index.
func createIndexIfMissing(index, stmt string) string {
	name := dollarQuote(index)
	body := fmt.Sprintf("\nBEGIN\n    IF to_regclass(%s) IS NULL THEN\n        %s; ELSIF NOT (SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)) THEN\n"+
		"        RAISE EXCEPTION 'index %% exists but is invalid (a CREATE INDEX CONCURRENTLY that failed or is still running): drop it, or let its build finish, then migrate again', %s; END IF; END\n",
		name, stmt, name, name) // not re-indented: a quoted name may hold a newline
	return "DO " + dollarQuote(body)
}

// createSchemaIfMissing returns a DO block that creates schema (quoted)
// only when it does not exist. CREATE SCHEMA IF NOT EXISTS alone would not
// do: it checks the CREATE privilege on the database before it looks for
// the schema, so a role that only uses a migrated outbox could not run
// Migrate at start-up. IF NOT EXISTS stays for tools that apply the
// statement without the migration lock.
func createSchemaIfMissing(schema string) string {
	body := fmt.Sprintf("\nBEGIN\n    IF to_regnamespace(%s) IS NULL THEN\n        CREATE SCHEMA IF NOT EXISTS %s; END IF; END\n",
		dollarQuote(schema), schema)
	return "DO " + dollarQuote(body)
}

// createTableIfMissing wraps a CREATE TABLE statement in a DO block that
// runs it only when table (qualified, quoted) does not exist: CREATE TABLE
// IF NOT EXISTS checks the CREATE privilege on the schema before it looks
// for the table.
func createTableIfMissing(table, stmt string) string {
	body := fmt.Sprintf("\nBEGIN\n    IF to_regclass(%s) IS NULL THEN\n%s; END IF; END\n",
		dollarQuote(table), stmt) // at the line's start, as in the file; not re-indented: a quoted name may hold a newline
	return "DO " + dollarQuote(body)
}

// setOptionsIfDifferent returns a DO block that runs ALTER TABLE table
// SET (options) only when the table's storage parameters (pg_class
// reloptions, and its TOAST table's for "toast." options) do not already
// hold every one of options, each written "name=value" as PostgreSQL
// stores it. ALTER TABLE … SET needs ownership of the table even when
// nothing changes, so a role that only uses a migrated outbox could not
// run Migrate. The options are constants of the migration files.
func setOptionsIfDifferent(table string, options ...string) string {
	var heap, toast, set []string
	for _, o := range options {
		name, value, _ := strings.Cut(o, "=")
		set = append(set, name+" = "+value)
		if rest, ok := strings.CutPrefix(o, "toast."); ok {
			toast = append(toast, "'"+rest+"'")
		} else {
			heap = append(heap, "'"+o+"'")
		}
	}
	body := fmt.Sprintf("\nBEGIN\n    IF NOT (SELECT coalesce(c.reloptions, '{}') @> ARRAY[%s]::text[] AND coalesce(t.reloptions, '{}') @> ARRAY[%s]::text[]\n"+
		"        FROM pg_class AS c LEFT JOIN pg_class AS t ON t.oid = c.reltoastrelid WHERE c.oid = %s::regclass) THEN\n"+
		"        ALTER TABLE %s SET (%s); END IF; END\n",
		strings.Join(heap, ", "), strings.Join(toast, ", "), dollarQuote(table), table, strings.Join(set, ", "))
	return "DO " + dollarQuote(body)
}

// addCheckIfMissing wraps ALTER TABLE … ADD CONSTRAINT … CHECK (…) NOT
// VALID in a DO block that runs it only when table (qualified, quoted) has
// no constraint of that name. The ALTER takes an ACCESS EXCLUSIVE lock, so
// only the first Migrate after an upgrade waits for open writers (and makes
// new ones wait); later ones find the constraint and take no lock. NOT
// VALID checks new rows only: the ALTER scans no existing one. The lock
// is held until Migrate's transaction commits, so the later statements of
// that Migrate run under it (007 reads the pending rows). The constraint
// name and check are constants of the migration files.
func addCheckIfMissing(table, constraint, check string) string {
	body := fmt.Sprintf("\nBEGIN\n    IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = %s::regclass AND conname = %s) THEN\n"+
		"        ALTER TABLE %s ADD CONSTRAINT %s CHECK (%s) NOT VALID; END IF; END\n",
		dollarQuote(table), dollarQuote(constraint), table, pgx.Identifier{constraint}.Sanitize(), check)
	return "DO " + dollarQuote(body)
}

// dollarQuote returns s as a dollar-quoted string constant. The tag is the
// first of $verity$, $verity1$, … whose first occurrence in s followed by the
// closing tag is that closing tag (so s can neither contain it nor end with
// a prefix of it that would close the literal early).
func dollarQuote(s string) string {
	for i := 0; ; i++ {
		tag := "$verity$"
		if i > 0 {
			tag = fmt.Sprintf("$verity%d$", i)
		}
		if strings.Index(s+tag, tag) == len(s) {
			return tag + s + tag
		}
	}
}

// MigrationSQL returns every migration for cfg (nil means defaults) as one
// SQL script, for users who manage schema changes with their own tool. The
// script is idempotent.
func MigrationSQL(cfg *Config) (string, error) {
	migrations, err := Migrations(cfg)
	if err != nil {
		return "", err
	}
	var buf bytes.Buffer
	for _, m := range migrations {
		fmt.Fprintf(&buf, "-- %s\n%s\n", m.Name, m.SQL)
	}
	return buf.String(), nil
}

// Migrate creates the outbox tables described by cfg (nil means defaults) if
// they do not exist. It is idempotent and safe to call from several processes
// at once: the statements run as one implicit transaction under an advisory
// lock, at READ COMMITTED whatever the role's default_transaction_isolation
// (a stricter level would take its snapshot before waiting for the lock,
// and fail on what another process committed meanwhile). db may be a pool,
// a connection or a transaction — a pgx.Tx or an SQLTx — (then the lock is
// held until that transaction ends, and the transaction must be READ
// COMMITTED, PostgreSQL's default); a connection on which the caller ran
// BEGIN itself, or a wrapper of a transaction, is not recognised as one. Migrate keeps no record of applied versions and
// runs every statement each time; on an outbox already migrated none of them
// takes a lock that makes writers or relays wait, so calling it at every
// start-up is safe.
//
// On a fresh or older outbox a step may wait for writers' transactions to
// end (an index build on the outbox table), and while it waits, new
// writers queue behind it. Ending ctx then stops the step on the server
// before Migrate returns: it sends a cancel request and waits for the
// statement to end, and the script's implicit transaction rolls back whole,
// so no step is half applied, none is applied after Migrate returned its
// error, and nobody queues behind it. (pgx alone would return at once and
// cancel in the background, leaving a window in which the lock could be
// granted and the steps committed.) A server that does not answer within
// two seconds has its connection closed instead, and may go on until the
// request lands. For a database/sql transaction (SQLTx) ending ctx is left
// to the driver; the steps, in the caller's transaction, cannot commit
// without it.
//
// Privileges: on a fresh outbox Migrate needs CREATE on the database (to
// create Config.Schema, unless it exists) or on the schema, and later
// owns the tables it creates; migrations that change an existing table
// (002's and 003's storage settings, 005's and 006's constraints, the
// indexes) need ownership of it the first time they apply. Every such
// statement runs only when the catalog shows it missing, so on an outbox
// fully migrated Migrate needs no more than a role using the outbox has:
// USAGE on the schema, and SELECT, INSERT, UPDATE and DELETE on its tables.
func Migrate(ctx context.Context, db Execer, cfg *Config) error {
	if deps.Missing(db) {
		return missingDB()
	}
	if reason := deps.Released(db); reason != "" {
		return &ConfigError{Field: "db", Reason: reason}
	}
	script, err := MigrationSQL(cfg)
	if err != nil {
		return err
	}
	// Without arguments pgx uses the simple protocol, which accepts several
	// statements and runs them in one implicit transaction.
	script = fmt.Sprintf("SELECT pg_advisory_xact_lock(%d);\n%s", migrationLockKey, script)
	script = readCommitted(db) + script
	if _, err := pgcancel.Exec(ctx, db, script); err != nil {
		return mapError("migrate", err)
	}
	return nil
}

// readCommitted returns the statement that sets the isolation level of a
// migration script's implicit transaction to READ COMMITTED, or "" when db
// is a transaction — a pgx.Tx or an SQLTx — whose level is the caller's
// (and can no longer be changed once it has run a statement). Any other db
// is taken for a pool or a connection outside a transaction.
func readCommitted(db Execer) string {
	switch db.(type) {
	case pgx.Tx, sqlTx:
		return ""
	}
	return "SET TRANSACTION ISOLATION LEVEL READ COMMITTED;\n"
}
