package outbox

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
)

const (
	// SchemaDefault is the default for Config.Schema and RelayConfig.Schema.
	SchemaDefault = "public"
	// TableDefault is the default for Config.Table and RelayConfig.Table.
	TableDefault = "verity_outbox"

	// MaxTableLength is the longest Table name accepted, in bytes. The
	// outbox derives other names from it (for example Table+"_idempotency"),
	// and PostgreSQL silently truncates identifiers longer than 63 bytes, so
	// longer names would make the derived ones collide.
	MaxTableLength = 63 - len("_idempotency_created_idx")
	// maxIdentifierLength is PostgreSQL's NAMEDATALEN-1.
	maxIdentifierLength = 63
	// reservedSchemaPrefix begins the schema names PostgreSQL keeps for
	// itself (pg_catalog, pg_toast, pg_temp_N...).
	reservedSchemaPrefix = "pg_"
)

// Config locates the outbox tables. It is used by NewWriter, Migrate and
// MigrationSQL; RelayConfig carries the same two fields. A nil *Config means
// all defaults.
//
// Names are never interpolated into SQL unquoted: every identifier goes
// through pgx.Identifier.Sanitize, so any string PostgreSQL can hold as a
// name (not empty, at most 63 bytes of UTF-8 without NUL), including one
// containing quotes, semicolons or spaces, is used literally as a name.
// The fields' docs list the few names refused besides.
type Config struct {
	// Schema is the PostgreSQL schema holding the outbox tables. Migrate
	// creates it if it does not exist. Defaults to SchemaDefault ("public").
	// A Schema beginning with "pg_" is refused with a *ConfigError:
	// PostgreSQL reserves that prefix for system schemas and creates none
	// with it. Its test is case-sensitive, and so is this one ("PG_x" is
	// accepted).
	Schema string

	// Table is the name of the outbox table. The dead-letter table is
	// Table+"_dead", the idempotency table Table+"_idempotency" and the
	// relays' partition lease table Table+"_leases"; index
	// names are derived the same way. At most MaxTableLength bytes. Defaults
	// to TableDefault ("verity_outbox").
	//
	// A Table ending in one of the suffixes those names are derived with is
	// refused with a *ConfigError: "_dead", "_idempotency", "_leases",
	// "_pending_idx", "_created_idx", "_dead_event_idx", "_dead_stream_idx",
	// "_dead_created_idx", "_idempotency_created_idx", "_partition_idx",
	// "_leases_touched_idx", and "_pkey", "_event_id_key", "_id_seq" (PostgreSQL's names for the
	// tables' primary keys, the unique event_id and the id sequence). Such
	// a Table is a name another outbox of the schema derives (outbox "q"
	// keeps its dead letters in "q_dead"), and the two outboxes would take
	// each other's tables or indexes for their own. Upgrading: an outbox
	// whose Table ends in one of them (for example "orders_dead") is now
	// refused; rename it, with its derived tables and indexes, to the names
	// of a new Table, or migrate a new outbox and let the old one drain.
	Table string
}

// derivedSuffixes are the suffixes of newNames (tables and indexes) and of
// PostgreSQL's implicit names for the migrations' constraints and identity
// sequence ("_pkey" covers every table's primary key). Keep Config.Table's
// doc in step.
var derivedSuffixes = []string{
	"_dead", "_idempotency", "_leases",
	"_pending_idx", "_created_idx", "_dead_event_idx", "_dead_stream_idx",
	"_dead_created_idx", "_idempotency_created_idx", "_partition_idx",
	"_leases_touched_idx", "_pkey", "_event_id_key", "_id_seq",
}

// WithDefaults returns a copy of c with every zero field set to its default.
// It is safe to call on a nil *Config.
func (c *Config) WithDefaults() *Config {
	out := Config{}
	if c != nil {
		out = *c
	}
	if out.Schema == "" {
		out.Schema = SchemaDefault
	}
	if out.Table == "" {
		out.Table = TableDefault
	}
	return &out
}

func (c *Config) validate() error {
	return validateNames(c.Schema, c.Table)
}

func validateNames(schema, table string) error {
	if err := validateIdentifier("Schema", schema, maxIdentifierLength); err != nil {
		return err
	}
	// PostgreSQL refuses to create a schema whose name begins with "pg_"
	// (SQLSTATE 42939, even with IF NOT EXISTS), and its test is
	// case-sensitive, on the name as quoted: "PG_x" is an ordinary name.
	if strings.HasPrefix(schema, reservedSchemaPrefix) {
		return &ConfigError{Field: "Schema", Reason: fmt.Sprintf(
			"%q begins with %q, a prefix PostgreSQL reserves for system schemas (Migrate could not create it); choose a name that does not begin with %q",
			schema, reservedSchemaPrefix, reservedSchemaPrefix)}
	}
	if err := validateIdentifier("Table", table, MaxTableLength); err != nil {
		return err
	}
	// Relations of one schema share a namespace, and Migrate creates each
	// only if missing: a Table equal to another outbox's derived name would
	// adopt that outbox's table (outbox "q" would take the live queue of
	// outbox "q_dead" for its dead letters, and its ReplayDead would move
	// q_dead's pending rows into q) or silently skip one of its indexes.
	// Refusing every Table that ends in a derived suffix rules that out,
	// for the derived names too: with these suffixes, two outboxes' names
	// coincide only when one Table is the other's plus a suffix ("q_dead"
	// and "q" share "q_dead_pkey"), which TestConfig checks.
	for _, suffix := range derivedSuffixes {
		if strings.HasSuffix(table, suffix) {
			return &ConfigError{Field: "Table", Reason: fmt.Sprintf(
				"%q ends in %q, a suffix the outbox derives the names of its other tables and indexes with, so it could be one of outbox %q's; choose a name that ends in none of %s",
				table, suffix, strings.TrimSuffix(table, suffix), strings.Join(derivedSuffixes, ", "))}
		}
	}
	return nil
}

// validateInterval checks a polling, reconnecting or reporting interval:
// positive, and at least a millisecond. A shorter one is almost always a
// bare integer (5 is 5ns, not 5s), and would have the relay or Listener
// query, reconnect to or ping PostgreSQL in a busy loop.
func validateInterval(field string, v time.Duration) error {
	switch {
	case v <= 0:
		return &ConfigError{Field: field, Reason: fmt.Sprintf("is %s; use a positive duration, or zero for the default", v)}
	case v < time.Millisecond:
		return &ConfigError{Field: field, Reason: fmt.Sprintf("is %s; use at least 1ms (a bare 5 is 5ns: write 5 * time.Second)", v)}
	}
	return nil
}

func validateIdentifier(field, value string, maxLen int) error {
	switch {
	case value == "":
		return &ConfigError{Field: field, Reason: "must not be empty; leave it unset to use the default"}
	case len(value) > maxLen:
		return &ConfigError{Field: field, Reason: fmt.Sprintf("is %d bytes long; use at most %d bytes", len(value), maxLen)}
	case !utf8.ValidString(value):
		return &ConfigError{Field: field, Reason: "is not valid UTF-8; use a UTF-8 name"}
	case strings.IndexByte(value, 0) >= 0:
		return &ConfigError{Field: field, Reason: "contains a NUL byte, which PostgreSQL names cannot hold; remove it"}
	}
	return nil
}

// names holds the quoted, qualified identifiers of one outbox installation.
// It is computed once from a validated Config; the SQL of the package is built
// only from these strings and from bind parameters.
type names struct {
	Schema                  string // quoted schema
	Outbox                  string // quoted schema.table
	Dead                    string // quoted schema.table_dead
	Idempotency             string // quoted schema.table_idempotency
	PendingIndex            string // quoted index name (unqualified: indexes live in the table's schema)
	CreatedIndex            string
	DeadEventIndex          string
	DeadStreamIndex         string
	DeadCreatedIndex        string
	IdempotencyCreatedIndex string
	Leases                  string // quoted schema.table_leases
	PartitionIndex          string
	LeasesTouchedIndex      string
	// Partitions is the number of lease partitions (partitionCount), for
	// the migration text; it is a constant, not a name.
	Partitions int
	// Block is the lease partitions' block of consecutive ids
	// (partitionBlock).
	Block int
	// MaxStreamBytes is MaxStreamBytes, for the migration text.
	MaxStreamBytes int
	// Channel is the NOTIFY channel, unquoted: it is passed to pg_notify as
	// a bind parameter and quoted when used in LISTEN.
	Channel string
}

func newNames(schema, table string) names {
	qualified := func(name string) string { return pgx.Identifier{schema, name}.Sanitize() }
	return names{
		Schema:                  pgx.Identifier{schema}.Sanitize(),
		Outbox:                  qualified(table),
		Dead:                    qualified(table + "_dead"),
		Idempotency:             qualified(table + "_idempotency"),
		PendingIndex:            pgx.Identifier{table + "_pending_idx"}.Sanitize(),
		CreatedIndex:            pgx.Identifier{table + "_created_idx"}.Sanitize(),
		DeadEventIndex:          pgx.Identifier{table + "_dead_event_idx"}.Sanitize(),
		DeadStreamIndex:         pgx.Identifier{table + "_dead_stream_idx"}.Sanitize(),
		DeadCreatedIndex:        pgx.Identifier{table + "_dead_created_idx"}.Sanitize(),
		IdempotencyCreatedIndex: pgx.Identifier{table + "_idempotency_created_idx"}.Sanitize(),
		Leases:                  qualified(table + "_leases"),
		PartitionIndex:          pgx.Identifier{table + "_partition_idx"}.Sanitize(),
		LeasesTouchedIndex:      pgx.Identifier{table + "_leases_touched_idx"}.Sanitize(),
		Partitions:              partitionCount,
		Block:                   partitionBlock,
		MaxStreamBytes:          MaxStreamBytes,
		Channel:                 channelName(schema, table),
	}
}

// channelName derives the NOTIFY channel from the schema and table, so that
// outboxes in different schemas (for example one per test) never wake each
// other's relays. A hash keeps it short and free of characters that would
// need quoting, whatever the names contain.
func channelName(schema, table string) string {
	sum := sha256.Sum256([]byte(schema + "\x00" + table))
	return "verity_outbox_" + hex.EncodeToString(sum[:8])
}
