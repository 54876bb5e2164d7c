package leaderboard

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/verity-go/verity/internal/deps"
	"github.com/verity-go/verity/internal/pgcancel"
	"github.com/verity-go/verity/outbox"
)

//go:embed schema.sql
var schemaSQL string

// Table names, created in Config.Schema.
const (
	ScoreEventsTable = "score_events"
	UserScoresTable  = "user_scores"
	rankIndexName    = "user_scores_rank_idx"
)

// Execer is the narrow database dependency of Migrate: *pgxpool.Pool,
// *pgx.Conn and pgx.Tx satisfy it.
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// MigrationSQL returns the SQL that creates the board tables of cfg.Schema,
// for use with goose, golang-migrate, atlas and the like. It is idempotent.
// It does not include the outbox's own migration (outbox.MigrationSQL).
// cfg is checked as Migrate checks it: a Schema or OutboxTable that Migrate
// and New refuse (a NUL byte, a name longer than PostgreSQL's 63 bytes...)
// returns a *ConfigError, not SQL for some other schema.
func MigrationSQL(cfg *Config) (string, error) {
	c := cfg.WithDefaults()
	if err := c.validateMigration(); err != nil {
		return "", err
	}
	schema := c.Schema
	names := []string{
		"{{score_events}}", qualify(schema, ScoreEventsTable),
		"{{user_scores}}", qualify(schema, UserScoresTable),
		"{{rank_index}}", pgx.Identifier{rankIndexName}.Sanitize(),
		"{{rank_index_regclass}}", quoteLiteral(qualify(schema, rankIndexName)),
		"{{score_events_regclass}}", quoteLiteral(qualify(schema, ScoreEventsTable)),
		"{{user_scores_regclass}}", quoteLiteral(qualify(schema, UserScoresTable)),
		"{{schema}}", pgx.Identifier{schema}.Sanitize(),
		"{{schema_literal}}", quoteLiteral(pgx.Identifier{schema}.Sanitize()),
	}
	// A DO body is dollar-quoted, and any identifier may contain "$$": the
	// tag must occur in neither the script nor a name, so that no name can
	// end the body early. (Every name is quoted, and the tag holds no quote,
	// so none can form across a name's edge.) All placeholders are replaced
	// in one pass: a name that spells one ("{{do}}") stays a name.
	tag := "$verity$"
	for i := 1; strings.Contains(schemaSQL+strings.Join(names, ""), tag); i++ {
		tag = fmt.Sprintf("$verity%d$", i)
	}
	return strings.NewReplacer(append(names, "{{do}}", tag)...).Replace(schemaSQL), nil
}

// quoteLiteral returns s as an escape string literal (E'...'), whose
// meaning does not depend on standard_conforming_strings.
func quoteLiteral(s string) string {
	return "E'" + strings.NewReplacer(`\`, `\\`, `'`, `''`).Replace(s) + "'"
}

// Migrate creates (if missing) the tables every board of cfg.Schema shares,
// and the outbox tables (cfg.Schema, cfg.OutboxTable) through
// outbox.Migrate. It is idempotent and safe to run concurrently (each part
// takes an advisory lock). Only Schema and OutboxTable are used; Name may be
// empty. On a fresh schema it needs the privileges to create it (CREATE on
// the database, or on an existing schema) and the tables; on one already
// migrated every creating or altering statement is skipped after a catalog
// look-up, so USAGE on the schema and SELECT, INSERT, UPDATE and DELETE on
// its tables suffice (see outbox.Migrate). A nil cfg is the zero Config:
// Schema SchemaDefault ("public"), whatever the connection's search_path,
// as for New, and the default table names. Ending ctx stops a part still
// running on the server, as outbox.Migrate describes.
func Migrate(ctx context.Context, db Execer, cfg *Config) error {
	if deps.Missing(db) {
		return &ConfigError{Field: "db", Reason: "is nil; pass the board's database (a *pgxpool.Pool, a connection or a transaction)"}
	}
	if reason := deps.Released(db); reason != "" {
		return &ConfigError{Field: "db", Reason: reason}
	}
	c := cfg.WithDefaults()
	script, err := MigrationSQL(c)
	if err != nil {
		return err
	}
	if err := outbox.Migrate(ctx, db, &outbox.Config{Schema: c.Schema, Table: c.OutboxTable}); err != nil {
		if errors.As(err, new(*outbox.ConfigError)) {
			return fromOutboxConfig("Config.", err)
		}
		return fmt.Errorf("leaderboard: migrate: %w", err)
	}
	// Without arguments pgx sends the script with the simple protocol: all
	// statements run in one implicit transaction, so the advisory lock is
	// held until the last one is done.
	if _, err := pgcancel.Exec(ctx, db, script); err != nil {
		return fmt.Errorf("leaderboard: migrate: %w", err)
	}
	return nil
}

// qualify returns schema.name quoted.
func qualify(schema, name string) string {
	return pgx.Identifier{schema, name}.Sanitize()
}
