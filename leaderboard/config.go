package leaderboard

import (
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"go.opentelemetry.io/otel/metric"

	"github.com/verity-go/verity/internal/keyenc"
	"github.com/verity-go/verity/outbox"
	"github.com/verity-go/verity/projection"
)

// ReadPolicy decides what a read does when the Redis projection cannot be
// trusted to be fresh enough: it lags by more than Config.MaxLag, or a
// read-your-writes requirement (AtLeast) was not met in time.
type ReadPolicy uint8

const (
	// ServeStale always answers from Redis and reports how stale the answer
	// may be in Freshness (except an unmet AtLeast read that finds its user
	// missing in Redis: a *StaleError, not a denial of the user's score).
	// It never puts read load on PostgreSQL, apart from the cheap lag
	// probe, which a PostgreSQL that stopped answering makes the read that
	// sends it wait for until the probe is cut off (MaxLag or 5 s, whichever
	// is longer; see the package doc). A Redis error is returned to the
	// caller.
	ServeStale ReadPolicy = iota + 1
	// FallbackToPostgres answers from Redis while it is fresh enough and
	// from PostgreSQL otherwise, including when Redis fails. Answers from
	// PostgreSQL are exact (Freshness.Source is SourcePostgres, Lag zero)
	// as of what is committed: when a version asked for with AtLeast is not
	// committed there either (the submitting transaction rolled back, or
	// has not committed yet), the answer lacks it and Freshness.AtLeastMet
	// is false, checked in the answer's own statement. Choose it only if
	// PostgreSQL can absorb the read load of an outage. A read that falls
	// back because Redis failed is logged at most once a second (see
	// Config.Logger), while the reads metric and each answer's
	// Freshness.Source report every one.
	FallbackToPostgres
	// FailClosed answers from Redis while it is fresh enough and returns a
	// *StaleError (errors.Is(err, ErrStale)) otherwise. A Redis error is
	// returned to the caller, except with Config.RequireVerifiedProjection
	// when it fails the look for Verify's record: the read is then refused
	// with a *StaleError whose Unverified is set (the look is logged).
	FailClosed
)

// String returns "serve-stale", "fallback-to-postgres", "fail-closed" or
// "policy(N)".
func (p ReadPolicy) String() string {
	switch p {
	case ServeStale:
		return "serve-stale"
	case FallbackToPostgres:
		return "fallback-to-postgres"
	case FailClosed:
		return "fail-closed"
	}
	return fmt.Sprintf("policy(%d)", uint8(p))
}

// Defaults applied by Config.WithDefaults to zero-valued fields.
const (
	MinDeltaDefault               int64         = -1000
	MaxDeltaDefault               int64         = 1000
	MaxUserIDLengthDefault                      = 128
	ReadPolicyDefault                           = ServeStale
	MaxLagDefault                 time.Duration = 5 * time.Second
	ReadYourWritesTimeoutDefault  time.Duration = 250 * time.Millisecond
	LagProbeIntervalDefault       time.Duration = 100 * time.Millisecond
	KeyPrefixDefault                            = "verity:lb:"
	VersionBucketsDefault                       = 0
	SchemaDefault                               = outbox.SchemaDefault
	OutboxTableDefault                          = outbox.TableDefault
	MaxSubmitsPerStatementDefault               = 64
	SubmitStatementsDefault                     = 2
)

// Hard limits that configuration cannot exceed.
const (
	// MaxNameLength bounds Config.Name in bytes.
	MaxNameLength = 200
	// MaxUserIDLengthLimit bounds Config.MaxUserIDLength: user ids are
	// primary-key columns, and PostgreSQL B-tree entries must stay well
	// under a third of a page.
	MaxUserIDLengthLimit = 1024
	// MaxScore and MinScore bound every score a board stores: ±2^53, the
	// range in which a Redis score (an IEEE-754 double) represents every
	// integer exactly. They also bound the delta limits.
	MaxScore int64 = 1 << 53
	MinScore int64 = -(1 << 53)
	// MaxSubmitsPerStatementLimit bounds Config.MaxSubmitsPerStatement.
	MaxSubmitsPerStatementLimit = 1000
)

// Config configures a Board. The zero value of every field except Name
// selects the documented default (MinDelta and MaxDelta only as a pair).
type Config struct {
	// Name identifies the board, for example "weekly-2026-48". Many boards
	// (games, seasons) live side by side in the same tables and the same
	// Redis key prefix, keyed by name. It must be non-empty valid UTF-8
	// without NUL bytes, at most MaxNameLength bytes. There is no default.
	Name string

	// Schema is the PostgreSQL schema holding the board's tables and the
	// outbox table. Defaults to SchemaDefault ("public").
	Schema string

	// OutboxTable is the name of the outbox table (in Schema) the board
	// appends its projection work to. A name the board's own tables use
	// (score_events, user_scores, their _pkey indexes, the rank index) is
	// refused. The board's rows carry the stream StreamPrefix + Name, and
	// only the board's Worker may project them: any other relay on this
	// table (an application's own outbox.Relay on the default table, say)
	// must set outbox.RelayConfig.Streams to streams of its own, or it
	// claims the board's rows: its mapper either writes them where it says
	// and the rows are deleted, so that the board's Redis ranking misses
	// those changes while its Lag, which counts pending rows, reads 0 (a
	// reconcile pass finds and repairs them), or refuses them until they
	// are dead-lettered (projection.ErrUnmappedStream), which the Lag does
	// count. Give the board a table of its own when in doubt; another
	// stream's backlog in the table also slows the board's lag probe (see
	// "Reading" in the package documentation). Changing it on a board
	// with rows pending or dead-lettered in the old table strands them:
	// the board's Worker relays only this table and its Lag counts only
	// this table, so its reads serve Redis without those changes as fresh
	// (see "Upgrading" in the package documentation). Defaults to
	// OutboxTableDefault.
	OutboxTable string

	// MinDelta and MaxDelta bound Command.Delta (inclusive). They are taken
	// as a pair: when both are zero they default to MinDeltaDefault and
	// MaxDeltaDefault; otherwise both are used as given (so MinDelta 0,
	// MaxDelta 50 allows increments only). Both must lie within
	// [MinScore, MaxScore].
	MinDelta, MaxDelta int64

	// MaxSubmitsPerStatement bounds how many concurrent Submit calls share
	// one statement (group commit). A Submit that arrives while the board's
	// Submit statements are all in flight waits for one to finish and is
	// then applied together with the others that arrived meanwhile, in one
	// statement, one transaction and one WAL flush: each command keeps its
	// own event record, version, result and outbox row, as if submitted
	// alone. A Submit never waits for company: with a statement free it is
	// sent at once. When a shared statement fails because of one command (a
	// reused event id, a score out of range), nothing is written and each
	// command is applied on its own, so every caller gets the outcome its
	// command would have had alone. 1 turns the grouping off: every Submit
	// is a statement of its own, on a pool connection of its own. At most
	// MaxSubmitsPerStatementLimit. Defaults to MaxSubmitsPerStatementDefault.
	//
	// Grouping pays where commits and per-statement work are the cost:
	// many concurrent callers on few cores. The README's Performance section
	// has the figures, with grouping and without.
	MaxSubmitsPerStatement int

	// SubmitStatements bounds how many Submit statements of the board run
	// at once, each on a pool connection; the Submit calls that find them
	// all busy are grouped. A statement that has run for 50 ms stops
	// counting, so that it does not hold up the calls queued after it; and
	// a shared statement waits for no lock longer than 50 ms (a row that a
	// caller's transaction holds, say) before its commands are applied on
	// their own, so that only the command that needs the lock waits for
	// it. The replay of a shared statement that failed because of one
	// command runs one statement per command, all at once, each on a pool
	// connection of its own (see MaxSubmitsPerStatement): those are not
	// bounded by SubmitStatements, only by the pool. It has no effect when
	// MaxSubmitsPerStatement is 1. Defaults to SubmitStatementsDefault.
	SubmitStatements int

	// MaxUserIDLength bounds Command.UserID in bytes. Defaults to
	// MaxUserIDLengthDefault; at most MaxUserIDLengthLimit.
	MaxUserIDLength int

	// ReadPolicy decides what reads do when the projection lags by more
	// than MaxLag or an AtLeast requirement is not met. Defaults to
	// ReadPolicyDefault (ServeStale).
	ReadPolicy ReadPolicy

	// MaxLag is the largest projection lag at which Redis answers are
	// considered fresh. It applies under every ReadPolicy (a read may pick
	// another with WithPolicy) and must be greater than LagProbeInterval.
	// The lag a read sees includes its measurement's age, at least the
	// probe query's round trip (on a local connection, well under 100µs at
	// times): a MaxLag of a few nanoseconds (with LagProbeInterval 1ns)
	// makes every Redis answer stale, so FailClosed reads always fail and
	// FallbackToPostgres reads always go to PostgreSQL (a way to read
	// PostgreSQL by the fallback path); one below the usual age makes most
	// of them stale. Defaults to MaxLagDefault.
	MaxLag time.Duration

	// ReadYourWritesTimeout bounds how long a read with AtLeast waits for
	// the projection to reach the requested version before ReadPolicy
	// applies. A version poll still waiting for a pool connection, or for
	// Redis's answer on a client with ContextTimeoutEnabled, is cut off when
	// it runs out (without ContextTimeoutEnabled, go-redis waits for the
	// answer to a command it has sent, up to its ReadTimeout). Defaults to
	// ReadYourWritesTimeoutDefault.
	ReadYourWritesTimeout time.Duration

	// LagProbeInterval is how long a measured lag is reused before
	// PostgreSQL is asked again, so that reads do not each cost a database
	// query. Reported lag may be understated by less than this interval:
	// a measurement reused for longer (while a slow probe is under way)
	// adds its age to the lag. It must be less than MaxLag: reads made
	// while a probe runs see a lag of at least this interval, so a larger
	// one would turn every probe into a spell of stale reads. With
	// RequireVerifiedProjection, a look for Verify's record in Redis is
	// reused for this long too. Defaults to LagProbeIntervalDefault.
	LagProbeInterval time.Duration

	// KeyPrefix prefixes every Redis key of the projection. It must not
	// contain '{' or '}'. A prefix set here is used as given: boards of the
	// same Name that share one Redis (in different Schemas) must then differ
	// in it, or they share every key and serve each other's users. It only
	// places the keys: Schema and Name tell boards apart. Two Boards of one
	// Schema and Name are one board in PostgreSQL (the same scores and
	// outbox stream) whatever their KeyPrefix, and with different prefixes
	// each one's Worker takes rows the other's keys then miss; to keep
	// boards apart in one schema, give them different Names. The
	// default keeps boards of different schemas apart. Defaults to
	// KeyPrefixDefault ("verity:lb:") in SchemaDefault, and in any other
	// schema to KeyPrefixDefault + the schema (escaped: no ':' or brace) +
	// ":", "verity:lb:tenant_a:" for schema tenant_a.
	KeyPrefix string

	// VersionBuckets spreads the board's per-user versions in Redis over
	// this many small hashes instead of one large one, which cuts the
	// projection's Redis memory by about a quarter on large boards (see
	// projection.Config.VersionBuckets); use about expected users / 64.
	// Every Worker, Reconciler and reader of a board must use the same
	// count: a projection stored with another count is refused with
	// projection.ErrLayoutMismatch, and reconcile's Rebuild migrates it.
	// At most projection.VersionBucketsMax. Defaults to
	// VersionBucketsDefault (0: one version hash per board).
	VersionBuckets int

	// RequireVerifiedProjection makes reads see a Redis that lost the
	// board's keys (a restart without persistence, FLUSHALL, a failover
	// to an empty replica), which the lag, measured in the outbox, cannot
	// see. Board.Verify runs a full reconcile pass and, when the pass
	// repaired everything it found and Redis kept the board's keys
	// throughout, records in Redis that the projection is complete; a
	// Redis that loses its data loses that record too. While it is absent,
	// Freshness reports Lag -1 and Unverified, so FailClosed reads refuse
	// and FallbackToPostgres reads fall back. Reads look for the record in
	// Redis at most once per LagProbeInterval, apart from the lag probe:
	// every read made LagProbeInterval or more after the loss sees it,
	// however slow PostgreSQL is. Only the loss of the board's keys, or a
	// Verify whose pass finds an entry wrong and leaves it so (an ahead or
	// orphan entry it only reports, a repair not made), removes it; a
	// record also stops counting once the sorted set holds fewer members
	// than the pass found (a DEL of it alone, its eviction, also after new
	// scores recreated it; an orphan repair or a Rebuild that removed
	// users, after which Verify is due anyway), and a Board that saw that
	// does not count the record again until the next Verify, even once new
	// scores make the sorted set as large; one that never looked while it
	// was smaller (started since, or the set grew back within one
	// LagProbeInterval) counts it again then, the lost users still
	// missing. It counts only to the size
	// the pass found: a board verified empty (a new board's first pass)
	// shows no loss of the members it gained since, so Verify it again once
	// it has scores. After a
	// partial loss (evicted version keys, writes a failover lost) only a
	// reconcile pass finds what is missing. The record names the PostgreSQL it was
	// made against (system identifier and timeline, which the lag probe
	// also reads): after a failover to a standby, a point-in-time recovery
	// or a logical restore into a new cluster, which may lack commits the
	// projection still shows, reads are unverified too (on a standby, once
	// it made a restartpoint on the new timeline; see "When PostgreSQL goes
	// back" in the package documentation for the cases it cannot see). Call Verify
	// after the first deployment, after every Redis loss (a new board
	// needs one too), and after every PostgreSQL failover or restore.
	// Defaults to false: Lag measures the outbox only.
	RequireVerifiedProjection bool

	// Logger receives the board's logs. A warning that a failure would
	// repeat on every read or lag probe (a Redis read that failed under
	// FallbackToPostgres, a lag probe or a look for Verify's record that
	// failed, a lag probe that found a change not yet projected dated
	// after the database clock) is logged at once the first time, then at
	// most once a second while it recurs, so that an outage logs about a
	// line a second per board and kind rather than a line per read; each line's
	// "suppressed" attribute counts the occurrences not logged since the
	// line before. The reads metric and each read's Freshness (Source, and
	// Lag -1 after a failed or unmeasurable probe or a failed look) report
	// every one. Defaults to discarding them.
	Logger *slog.Logger

	// MeterProvider receives the board's metrics (verity.leaderboard.*:
	// submits by outcome, where a SubmitTx that wrote its command is staged,
	// not applied, as the board does not see the caller commit; reads by
	// source and outcome; the measured lag; see the README's metrics
	// table). It is also handed to the board's Worker (outbox relay and
	// projector metrics) and Reconciler (reconcile metrics) unless their
	// own configs set one. The board's lag gauge stays registered with it
	// until Board.Close. Defaults to nil (left nil by WithDefaults):
	// nothing is recorded.
	MeterProvider metric.MeterProvider
}

// WithDefaults returns a copy of c with every zero field set to its default.
// A nil c is treated as the zero Config.
func (c *Config) WithDefaults() *Config {
	out := &Config{}
	if c != nil {
		*out = *c
	}
	if out.Schema == "" {
		out.Schema = SchemaDefault
	}
	if out.OutboxTable == "" {
		out.OutboxTable = OutboxTableDefault
	}
	if out.MinDelta == 0 && out.MaxDelta == 0 {
		out.MinDelta, out.MaxDelta = MinDeltaDefault, MaxDeltaDefault
	}
	if out.MaxSubmitsPerStatement == 0 {
		out.MaxSubmitsPerStatement = MaxSubmitsPerStatementDefault
	}
	if out.SubmitStatements == 0 {
		out.SubmitStatements = SubmitStatementsDefault
	}
	if out.MaxUserIDLength == 0 {
		out.MaxUserIDLength = MaxUserIDLengthDefault
	}
	if out.ReadPolicy == 0 {
		out.ReadPolicy = ReadPolicyDefault
	}
	if out.MaxLag == 0 {
		out.MaxLag = MaxLagDefault
	}
	if out.ReadYourWritesTimeout == 0 {
		out.ReadYourWritesTimeout = ReadYourWritesTimeoutDefault
	}
	if out.LagProbeInterval == 0 {
		out.LagProbeInterval = LagProbeIntervalDefault
	}
	if out.KeyPrefix == "" {
		out.KeyPrefix = defaultKeyPrefix(out.Schema)
	}
	if out.Logger == nil {
		out.Logger = slog.New(slog.DiscardHandler)
	}
	return out
}

// defaultKeyPrefix returns the KeyPrefix of a board in schema that sets
// none. The public schema keeps KeyPrefixDefault, the keys its boards have
// always had. Another schema's prefix adds the escaped schema and a ':':
// Escape is injective and emits no ':', so two schemas never share a
// prefix, nor one's keys the other's; and every projection key puts a '{'
// right after the prefix, which Escape never emits, so no schema's keys are
// a public board's.
func defaultKeyPrefix(schema string) string {
	if schema == SchemaDefault {
		return KeyPrefixDefault
	}
	return KeyPrefixDefault + keyenc.Escape(schema) + ":"
}

// boardRelations are the tables and indexes Migrate creates for the boards of
// a schema; an outbox table of one of these names (or whose primary key
// would take one) would stop the board's tables from being created.
var boardRelations = []string{
	ScoreEventsTable, ScoreEventsTable + "_pkey",
	UserScoresTable, UserScoresTable + "_pkey", rankIndexName,
}

// validateTables checks the fields Migrate uses, Schema and OutboxTable, of a
// Config that has been through WithDefaults.
func (c *Config) validateTables() error {
	bad := func(field, reason string, args ...any) error {
		return &ConfigError{Field: "Config." + field, Reason: fmt.Sprintf(reason, args...)}
	}
	switch {
	case strings.IndexByte(c.Schema, 0) >= 0 || !utf8.ValidString(c.Schema):
		return bad("Schema", "must be valid UTF-8 without NUL bytes")
	case strings.IndexByte(c.OutboxTable, 0) >= 0 || !utf8.ValidString(c.OutboxTable):
		return bad("OutboxTable", "must be valid UTF-8 without NUL bytes")
	case slices.Contains(boardRelations, c.OutboxTable):
		return bad("OutboxTable", "%q is a name the board's own tables use in Config.Schema; choose another (the default is %q)", c.OutboxTable, OutboxTableDefault)
	}
	return nil
}

// validateMigration checks what Migrate and MigrationSQL use of a Config
// that has been through WithDefaults: validateTables, and the outbox's own
// checks of the same names (their length above all: PostgreSQL would
// truncate a longer name and migrate another schema), which New runs too.
func (c *Config) validateMigration() error {
	if err := c.validateTables(); err != nil {
		return err
	}
	if _, err := outbox.Migrations(&outbox.Config{Schema: c.Schema, Table: c.OutboxTable}); err != nil {
		return fromOutboxConfig("Config.", err)
	}
	return nil
}

// validate checks a Config that has been through WithDefaults. Its errors
// are *ConfigError, naming the field and how to fix it.
func (c *Config) validate() error {
	bad := func(field, reason string, args ...any) error {
		return &ConfigError{Field: "Config." + field, Reason: fmt.Sprintf(reason, args...)}
	}
	if err := c.validateTables(); err != nil {
		return err
	}
	switch {
	case c.Name == "":
		return bad("Name", "is required (for example \"weekly-2026-48\")")
	case len(c.Name) > MaxNameLength:
		return bad("Name", "is %d bytes; shorten it to at most %d", len(c.Name), MaxNameLength)
	case !utf8.ValidString(c.Name) || strings.IndexByte(c.Name, 0) >= 0:
		return bad("Name", "must be valid UTF-8 without NUL bytes")
	case c.MinDelta > c.MaxDelta:
		return bad("MinDelta", "(%d) is above Config.MaxDelta (%d); swap them", c.MinDelta, c.MaxDelta)
	case c.MinDelta < MinScore:
		return bad("MinDelta", "(%d) is below MinScore; raise it to at least %d", c.MinDelta, MinScore)
	case c.MaxDelta > MaxScore:
		return bad("MaxDelta", "(%d) is above MaxScore; lower it to at most %d", c.MaxDelta, MaxScore)
	case c.MaxSubmitsPerStatement < 1 || c.MaxSubmitsPerStatement > MaxSubmitsPerStatementLimit:
		return bad("MaxSubmitsPerStatement", "must be between 1 (no grouping) and %d (got %d)", MaxSubmitsPerStatementLimit, c.MaxSubmitsPerStatement)
	case c.SubmitStatements < 1:
		return bad("SubmitStatements", "must be at least 1 (got %d); leave it 0 for the default, %d", c.SubmitStatements, SubmitStatementsDefault)
	case c.MaxUserIDLength < 1 || c.MaxUserIDLength > MaxUserIDLengthLimit:
		return bad("MaxUserIDLength", "must be between 1 and %d (got %d)", MaxUserIDLengthLimit, c.MaxUserIDLength)
	case c.ReadPolicy < ServeStale || c.ReadPolicy > FailClosed:
		return bad("ReadPolicy", "%s is unknown; use ServeStale, FallbackToPostgres or FailClosed", c.ReadPolicy)
	case c.MaxLag < 0:
		return bad("MaxLag", "must not be negative")
	case c.ReadYourWritesTimeout < 0:
		return bad("ReadYourWritesTimeout", "must not be negative")
	case c.LagProbeInterval < 0:
		return bad("LagProbeInterval", "must not be negative")
	case c.MaxLag <= c.LagProbeInterval:
		return bad("MaxLag", "(%s) must be greater than Config.LagProbeInterval (%s), since reads made while a lag probe runs see a lag of at least LagProbeInterval; raise MaxLag or lower LagProbeInterval to a small fraction of it", c.MaxLag, c.LagProbeInterval)
	case c.VersionBuckets < 0 || c.VersionBuckets > projection.VersionBucketsMax:
		return bad("VersionBuckets", "must be between 0 (one version hash) and %d (got %d); use about expected users / 64", projection.VersionBucketsMax, c.VersionBuckets)
	}
	if err := keyenc.ValidatePrefix(c.KeyPrefix); err != nil {
		return bad("KeyPrefix", "%q: %v", c.KeyPrefix, err)
	}
	return nil
}
