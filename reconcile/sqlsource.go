package reconcile

import (
	"context"
	"database/sql/driver"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/verity-go/verity/internal/deps"
	"github.com/verity-go/verity/projection"
)

// DBTX is the narrow view of PostgreSQL that SQLSource needs. *pgxpool.Pool,
// *pgx.Conn and pgx.Tx satisfy it. Through a pgx.Tx, Lookup runs each
// statement in a savepoint, so that a key it expects PostgreSQL to reject
// does not abort the transaction; begin a transaction as a pgx.Tx rather
// than with BEGIN on a *pgx.Conn, which SQLSource cannot tell from a
// connection outside one. A source made over a pgx.Tx prepares statements
// of its own on the transaction's connection (pgx's default exec mode),
// so make one source per transaction, not one per pass.
//
// Prefer a pool. A REPEATABLE READ or SERIALIZABLE transaction reads one
// snapshot for the whole pass, and the lookups that confirm ahead and
// orphan findings (package doc, "Repairs") then cannot see a
// write committed after it: once projected, such a write is reported as
// ahead, or its new entity as an orphan; and an entry Redis lost since (or
// whose version it lost) would be repaired, as missing (or corrupt), at the
// snapshot's older version. Through such a transaction, Reconciler.Run and
// CheckKeys refuse to repair missing, corrupt, ahead or orphan entries
// (unless DryRun; the default Policy repairs missing and corrupt ones, so
// set Policy.Missing and Policy.Corrupt to ActionReport), and
// Reconciler.Rebuild refuses to
// run, each with a *ConfigError: a repair would take a newer version back,
// or delete a new entity, and a rebuild would switch in versions older than
// the live ones. Stale entries are still repaired, to the snapshot's
// version, which the gate writes only over an older one, so such a repair
// never takes Redis back; but after Redis lost writes made since the
// snapshot (a failover to a replica that missed them, a restart from an
// older RDB), the entry it repairs stays older than PostgreSQL's row, and
// is counted as repaired, until a pass through a pool.
type DBTX interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

var (
	_ DBTX   = (*pgxpool.Pool)(nil)
	_ DBTX   = (*pgx.Conn)(nil)
	_ DBTX   = (pgx.Tx)(nil)
	_ Source = (*SQLSource)(nil)
)

// Filter restricts a SQLSource to the rows where Column = Value, for example
// the board a leaderboard projects. Value must not be nil or anything sent
// as NULL (NewSQLSource refuses it): Column = NULL matches no row.
type Filter struct {
	Column string
	Value  any
}

// SQLSourceConfig describes the table a SQLSource reads. Every identifier is
// quoted (pgx.Identifier.Sanitize), so names are used verbatim, case
// included, and can never inject SQL; NewSQLSource refuses a name that
// PostgreSQL could not take verbatim (a NUL byte, invalid UTF-8, more than
// 63 bytes).
type SQLSourceConfig struct {
	// Schema qualifies Table. Defaults to "" (the connection's search_path).
	Schema string
	// Table is the table to read. Required. It must be a table or a
	// materialized view for Sample (TABLESAMPLE needs physical blocks); Page
	// and Lookup also work on views.
	Table string
	// KeyColumn identifies the entity: it becomes Row.Key through a ::text
	// cast. Any scalar type with ordering and a text form works (text,
	// bigint, uuid; not an array or composite type, which Page or Lookup
	// refuse with PostgreSQL's error) whose collation is deterministic (the default; a
	// nondeterministic collation can make distinct keys compare equal, and
	// a keyset page would skip one). Required. Index it (it is usually the
	// primary key): every page is an index range scan. Rows whose key is
	// NULL are ignored. Lookup probes the key once per key asked for, so a
	// table PostgreSQL has no statistics for yet is not read whole.
	//
	// Some types' text forms depend on the session's settings: timestamptz
	// on TimeZone and DateStyle, date and timestamp on DateStyle, interval
	// on IntervalStyle, floats on extra_float_digits, bytea on
	// bytea_output, money on lc_monetary. The projector must write members
	// in the form this source's sessions write, and every connection of
	// its pool must share those settings: a member written in another form
	// (the same instant under another TimeZone) is not the key's entry, so
	// the row reads as missing and the member as an orphan, which an
	// orphan repair policy removes. A pass that reads a key whose text form
	// does not read back as the same key in its session (DateStyle SQL or
	// Postgres under a zone whose abbreviation PostgreSQL reads as another
	// zone, such as Asia/Kolkata's IST; extra_float_digits below 1) fails
	// with an *InvalidRowError before checking that row's page: such a
	// key, as the next page's cursor, would skip rows or walk back. A text
	// form PostgreSQL cannot read at all (a zone's local mean time, "LMT",
	// for an instant before the zone's standard time, under those
	// DateStyles) fails the pass with PostgreSQL's 22007 instead. A Lookup
	// (orphan checks, CheckKeys, rechecks) that finds no row for a key whose
	// text does not read back as itself fails with an *InvalidRowError too,
	// since the key may name a row the lookup could not find: for such
	// types, a member in another form than PostgreSQL's own (not one the
	// projector wrote) stops the orphan checks instead of being removed.
	// Nothing is repaired in any of these cases. Each pass's first Page,
	// and each Sample, reads the key column's type from the catalog for
	// the check, so a migration that changes it is seen by the next pass.
	KeyColumn string
	// VersionColumn holds the entity's version, an integer column. Required.
	VersionColumn string
	// ValueColumn holds the absolute value: an integer score for
	// projection.KindSortedSet, bytes for KindHash and KindDocument: a bytea
	// column's bytes, any other column's text form as PostgreSQL writes it
	// (text and json as stored, jsonb, uuid or time as their output
	// functions give them), whatever pgx's statement mode; the projector
	// must write the same bytes for rows to compare as current. Required.
	ValueColumn string
	// Kind is the projection kind the values feed; it decides how
	// ValueColumn is read. Required. It must be the Target.Kind of the
	// Reconciler the source is given to: New refuses another with
	// *ConfigError.
	Kind projection.Kind
	// Filters restrict the rows to those matching every Column = Value.
	// Defaults to none (the whole table).
	Filters []Filter
}

// sentAsNull reports whether v would reach PostgreSQL as NULL: nil, a nil
// pointer, slice, map or interface, or a driver.Valuer (sql.NullString,
// pgtype.Text, …) whose value is nil.
func sentAsNull(v any) bool {
	if deps.Missing(v) {
		return true
	}
	// pgx sends a nil slice or map as NULL too.
	if rv := reflect.ValueOf(v); (rv.Kind() == reflect.Slice || rv.Kind() == reflect.Map) && rv.IsNil() {
		return true
	}
	if valuer, ok := v.(driver.Valuer); ok {
		value, err := valuer.Value()
		return err == nil && value == nil
	}
	return false
}

// SQLSource is a Source reading one PostgreSQL table (optionally filtered) by
// keyset pagination.
//
// Sample uses TABLESAMPLE SYSTEM, which picks whole heap blocks at random: it
// reads only about the sampled fraction of the table, but the rows it returns
// are correlated (rows stored together are sampled together), so a sample
// over-represents clusters of recently inserted or updated rows when those
// share blocks. Each row's chance of being chosen is about the same, not
// exactly: about twice n rows are sampled and n of them kept at random, so
// a row in a fuller block, which brings more rows with it, has a slightly
// smaller chance than one in a sparse block. When a
// block sample returns fewer than n rows (a small or freshly loaded table
// whose pg_class.reltuples estimate is low, or a selective filter), the
// fraction is raised and the sample retried, up to the whole table.
//
// Lookup of a key the key column's type rejects ("user:42" for a bigint
// column) costs a bisection of failed statements, each logged by the
// server; see Lookup for the cost and the remedy.
type SQLSource struct {
	db   DBTX
	kind projection.Kind
	args []any // filter values, $1..$len(args)

	// walkSQL holds the page and sample statements, built on the first
	// Page or Sample, which learns the key column's type (see walkSQLs).
	walkSQL     atomic.Pointer[walkStatements]
	keyTypeSQL  string
	keyColumn   string
	walkCols    string // SELECT list and FROM with a %s for a read-back check
	walkKey     string
	walkWhere   string
	walkArgs    int
	lookupSQL   string
	keyCastSQL  string
	keyBackSQL  string
	estimateSQL string
	relation    string

	// encodings caches what rawKeys learnt; nil until a key that is not
	// UTF-8 first comes.
	encodings atomic.Pointer[encodings]

	// txTag, for a source over a pgx.Tx, makes its statements its own (see
	// NewSQLSource).
	txTag string
}

// encodings says what an SQLSource's database and sessions do with keys
// that are not UTF-8 (see rawKeys).
type encodings struct {
	held     bool   // the database can hold them (its encoding is SQL_ASCII)
	sendable bool   // and the session can send them back (client_encoding SQL_ASCII too)
	client   string // the session's client_encoding
}

// NewSQLSource validates cfg and returns a source reading through db.
func NewSQLSource(db DBTX, cfg *SQLSourceConfig) (*SQLSource, error) {
	if deps.Missing(db) {
		return nil, &ConfigError{Field: "db", Reason: "must not be nil; pass a *pgxpool.Pool"}
	}
	if reason := deps.Released(db); reason != "" {
		return nil, &ConfigError{Field: "db", Reason: reason + "; pass a *pgxpool.Pool"}
	}
	if cfg == nil {
		return nil, &ConfigError{Field: "SQLSourceConfig", Reason: "must not be nil"}
	}
	for _, f := range []struct{ name, val string }{
		{"SQLSourceConfig.Table", cfg.Table},
		{"SQLSourceConfig.KeyColumn", cfg.KeyColumn},
		{"SQLSourceConfig.VersionColumn", cfg.VersionColumn},
		{"SQLSourceConfig.ValueColumn", cfg.ValueColumn},
	} {
		if f.val == "" {
			return nil, &ConfigError{Field: f.name, Reason: "is required"}
		}
	}
	switch cfg.Kind {
	case projection.KindSortedSet, projection.KindHash, projection.KindDocument:
	default:
		return nil, &ConfigError{Field: "SQLSourceConfig.Kind", Reason: "must be projection.KindSortedSet, KindHash or KindDocument"}
	}
	names := []struct{ name, val string }{
		{"SQLSourceConfig.Table", cfg.Table},
		{"SQLSourceConfig.KeyColumn", cfg.KeyColumn},
		{"SQLSourceConfig.VersionColumn", cfg.VersionColumn},
		{"SQLSourceConfig.ValueColumn", cfg.ValueColumn},
	}
	if cfg.Schema != "" {
		names = append(names, struct{ name, val string }{"SQLSourceConfig.Schema", cfg.Schema})
	}
	for i, f := range cfg.Filters {
		names = append(names, struct{ name, val string }{fmt.Sprintf("SQLSourceConfig.Filters[%d].Column", i), f.Column})
	}
	for _, f := range names {
		if err := validateIdentifier(f.name, f.val); err != nil {
			return nil, err
		}
	}
	for i, f := range cfg.Filters {
		if f.Column == "" {
			return nil, &ConfigError{Field: fmt.Sprintf("SQLSourceConfig.Filters[%d].Column", i), Reason: "is required"}
		}
		// Column = NULL matches no row: the source would look empty, a
		// pass would call every projected entry an orphan and a Rebuild
		// would publish an empty collection.
		if sentAsNull(f.Value) {
			return nil, &ConfigError{Field: fmt.Sprintf("SQLSourceConfig.Filters[%d].Value", i), Reason: "is nil or encodes as NULL, which matches no row; pass the value the rows hold"}
		}
	}

	s := &SQLSource{db: db, kind: cfg.Kind}
	if _, ok := db.(pgx.Tx); ok {
		// The catalog read that names the columns' types in the
		// statements runs in the transaction's snapshot, which under
		// REPEATABLE READ can predate a migration the planner sees: the
		// connection's statements cached under the same text would fail
		// (0A000). The source's own, prepared anew, are planned for it.
		s.txTag = fmt.Sprintf(", source %016x", rand.Uint64())
	}
	s.buildSQL(cfg)
	return s, nil
}

// identifierMaxLen is PostgreSQL's longest name (NAMEDATALEN - 1 bytes);
// it silently truncates longer ones, which could then name another table.
const identifierMaxLen = 63

// validateIdentifier refuses a name that would not reach PostgreSQL
// verbatim: pgx.Identifier.Sanitize drops NUL bytes, PostgreSQL truncates
// long names and refuses invalid UTF-8 only when the first query runs.
func validateIdentifier(field, name string) error {
	switch {
	case len(name) > identifierMaxLen:
		return &ConfigError{Field: field, Reason: fmt.Sprintf("is %d bytes long; PostgreSQL names hold at most %d", len(name), identifierMaxLen)}
	case !utf8.ValidString(name):
		return &ConfigError{Field: field, Reason: "is not valid UTF-8; use the name as PostgreSQL spells it"}
	case strings.IndexByte(name, 0) >= 0:
		return &ConfigError{Field: field, Reason: "contains a NUL byte, which PostgreSQL names cannot hold; remove it"}
	}
	return nil
}

// buildSQL renders every statement once; it is the only place this package
// writes SQL.
func (s *SQLSource) buildSQL(cfg *SQLSourceConfig) {
	rel := pgx.Identifier{cfg.Table}
	if cfg.Schema != "" {
		rel = pgx.Identifier{cfg.Schema, cfg.Table}
	}
	s.relation = rel.Sanitize()
	// Columns are qualified with the alias "src" so that ORDER BY means the
	// key column itself, never the output column of the same name (its
	// ::text cast would sort 10 before 9 and break the keyset).
	key := "src." + pgx.Identifier{cfg.KeyColumn}.Sanitize()
	ver := "src." + pgx.Identifier{cfg.VersionColumn}.Sanitize()
	val := "src." + pgx.Identifier{cfg.ValueColumn}.Sanitize()

	conds := []string{key + " IS NOT NULL"}
	for _, f := range cfg.Filters {
		s.args = append(s.args, f.Value)
		conds = append(conds, fmt.Sprintf("src.%s = $%d", pgx.Identifier{f.Column}.Sanitize(), len(s.args)))
	}
	where := strings.Join(conds, " AND ")
	n := len(s.args)
	cols := fmt.Sprintf("SELECT %s::text, %s, %s FROM %s AS src", key, ver, val, s.relation)

	// The walk's statements (pages and samples) are built by walkSQLs,
	// once the key column's type is known.
	s.keyColumn, s.walkKey, s.walkWhere, s.walkArgs = cfg.KeyColumn, key, where, n
	s.walkCols = fmt.Sprintf("SELECT %s::text, %s, %s%%s FROM %s AS src", key, ver, val, s.relation)
	s.keyTypeSQL = `SELECT a.atttypid, format_type(a.atttypid, a.atttypmod),
	pg_snapshot_xmax(pg_current_snapshot())::text::bigint, pg_snapshot_xmin(pg_current_snapshot())::text::bigint, cardinality(ARRAY(SELECT pg_snapshot_xip(pg_current_snapshot()))),
	(coalesce(pg_last_wal_replay_lsn(), '0/0') - '0/0')::bigint,
	(SELECT has_schema_privilege(t.typnamespace, 'USAGE') FROM pg_catalog.pg_type AS t WHERE t.oid = a.atttypid),
	(SELECT string_agg(c.atttypid::text || ':' || c.atttypmod || ':' || c.attcollation, ',' ORDER BY c.attnum) FROM pg_catalog.pg_attribute AS c WHERE c.attrelid = a.attrelid AND c.attnum > 0 AND NOT c.attisdropped)
FROM pg_catalog.pg_attribute AS a
WHERE a.attrelid = to_regclass($1) AND a.attname = $2 AND a.attnum > 0 AND NOT a.attisdropped`
	// Lookup probes the key once per distinct key, through a lateral
	// subquery that OFFSET 0 keeps from being flattened into a join:
	// written as key = ANY ($n), the planner chose by the table's
	// statistics, and without any (a table loaded in bulk, autovacuum
	// behind or off) read the whole table for every batch of keys.
	// unnest($n) alone would leave $n's type undetermined; COALESCE with
	// an empty array of the key column (WHERE false: never read) makes it
	// an array of the key's type, in one statement whichever way pgx
	// sends $n (the simple protocol writes it in as an untyped literal).
	s.lookupSQL = fmt.Sprintf(`SELECT found.key, found.version, found.value
FROM (SELECT DISTINCT unnest(COALESCE($%[3]d, (SELECT array_agg(%[2]s) FROM %[1]s AS src WHERE false)))) AS wanted(key)
CROSS JOIN LATERAL (%[4]s WHERE %[5]s AND %[2]s = wanted.key OFFSET 0) AS found(key, version, value)`,
		s.relation, key, n+1, cols, where)
	// The lookup's key array alone, cast as lookupSQL casts it and no row
	// read: it fails only for a key the key column cannot hold.
	s.keyCastSQL = fmt.Sprintf("SELECT cardinality(COALESCE($1, (SELECT array_agg(%s) FROM %s AS src WHERE false)))", key, s.relation)
	s.keyBackSQL = fmt.Sprintf("SELECT t.orig FROM unnest($1::text[], COALESCE($2, (SELECT array_agg(%s) FROM %s AS src WHERE false))) AS t(orig, k) WHERE t.k::text IS DISTINCT FROM t.orig LIMIT 1", key, s.relation)
	s.estimateSQL = "SELECT COALESCE((SELECT reltuples::float8 FROM pg_class WHERE oid = to_regclass($1)), -1)"
}

// unmade reports an SQLSource not made by NewSQLSource (a zero value, or
// nil), which has no database or queries.
func (s *SQLSource) unmade() bool { return s == nil || s.db == nil }

// errUnmadeSource refuses an SQLSource not made by NewSQLSource.
func errUnmadeSource() error {
	return &ConfigError{Field: "SQLSource", Reason: "has no database or table (a zero value, or nil); create it with NewSQLSource(db, cfg)"}
}

// Page implements Source with keyset pagination.
func (s *SQLSource) Page(ctx context.Context, after Cursor, limit int) ([]Row, error) {
	if s.unmade() {
		return nil, errUnmadeSource()
	}
	if limit <= 0 {
		return nil, nil
	}
	k, ok := after.Key()
	// A pass's first page reads the key column's type again: a migration
	// may have changed it since the statements were built.
	walk, err := s.walkSQLs(ctx, !ok)
	if err != nil {
		return nil, err
	}
	args := append([]any(nil), s.args...)
	sql := walk.first
	if ok {
		sql = walk.after
		args = append(args, k)
	}
	args = append(args, limit)
	return s.query(ctx, limit, sql, args...)
}

// walkStatements are the statements that read rows for a pass: its pages
// and its samples.
type walkStatements struct {
	first, after, sample string
	// The snapshot of the catalog read they were built from: a later
	// snapshot has a greater xmax, or the same xmax and a greater xmin
	// (on a hot standby pg_current_snapshot lists no xip: a snapshot
	// taken in recovery keeps them in subxip), or both the same and fewer
	// transactions in progress, or (on a standby, where none are listed)
	// all the same and a later replay position read by the same statement.
	xmax, xmin, nxip, replay int64
	// checked: the key's type has a read-back check (not keyTextFixed).
	checked bool
	// typed: the comment naming the types, for the lookups' statements.
	typed string
}

// newer reports whether w was built from a later catalog snapshot than o.
func (w *walkStatements) newer(o *walkStatements) bool {
	if w.xmax != o.xmax {
		return w.xmax > o.xmax
	}
	if w.xmin != o.xmin {
		return w.xmin > o.xmin
	}
	if w.nxip != o.nxip {
		return w.nxip < o.nxip
	}
	return w.replay > o.replay
}

// walkSQLs returns the walk's statements, built once the key column's type
// is known, and again when fresh (a pass's first page, a sample). For a type whose text form depends on the session's settings,
// each returns a fourth column, true when the key's text form, read back as
// the key column's type, is the key again. In a session whose
// settings write a form that reads back as another value (DateStyle SQL or
// Postgres under a time zone whose abbreviation PostgreSQL reads as
// another zone, as Asia/Kolkata's IST; a float rounded by a low
// extra_float_digits), that text as the next page's cursor would skip rows
// or walk back and forth for ever, and the key's lookups would miss its
// row, taking its correct entry for an orphan: scan refuses such a row.
//
// The key is compared and ordered in its own type (so an index on it is
// used) and only cast to text for the caller; the $after parameter is a
// string, which PostgreSQL converts to the column's type.
func (s *SQLSource) walkSQLs(ctx context.Context, fresh bool) (*walkStatements, error) {
	if w := s.walkSQL.Load(); w != nil && !fresh {
		return w, nil
	}
	var (
		oid   uint32
		typ   string
		check string
		types string
	)
	var xmax, xmin, nxip, replay int64
	var usable bool
	switch err := s.db.QueryRow(ctx, s.keyTypeSQL, s.relation, s.keyColumn).Scan(&oid, &typ, &xmax, &xmin, &nxip, &replay, &usable, &types); {
	case errors.Is(err, pgx.ErrNoRows):
		// No such table or column (yet): the statements, left unchecked
		// and not kept, fail with PostgreSQL's own error (42P01, 42703).
	case err != nil:
		return nil, fmt.Errorf("reconcile: reading the type of %s's key column: %w", s.relation, err)
	case !keyTextFixed[oid] && usable:
		check = fmt.Sprintf(", %[1]s::text::%[2]s = %[1]s", s.walkKey, typ)
	case !keyTextFixed[oid]:
		// The type's schema is not usable by this role, so its name
		// cannot be written in a cast (42501), though the table reads
		// fine: read the text back through the relation's row type.
		check = fmt.Sprintf(", (json_populate_record(NULL::%[2]s, json_build_object(%[3]s, %[1]s::text))).%[4]s = %[1]s",
			s.walkKey, s.relation, "'"+strings.ReplaceAll(s.keyColumn, "'", "''")+"'", pgx.Identifier{s.keyColumn}.Sanitize())
	}
	cols := fmt.Sprintf(s.walkCols, check)
	key, where, n := s.walkKey, s.walkWhere, s.walkArgs
	// The type's oid, in a comment, makes each type's statements distinct
	// text: pgx's default exec mode prepares a statement once per
	// connection, cached by its text, and PostgreSQL keeps the parameter
	// types it inferred then. Statements of the same text for a key
	// changed from bigint to text (neither checked) would send the cursor
	// "user:3" as a bigint (22P02) until the pool recycled the connection.
	// Every column's type, not the key's alone: a filter column changed
	// from bigint to text failed the same way (42883), and a version
	// column from integer to bigint with 0A000. Lookups carry the same
	// comment (typedSuffix).
	typed := ""
	if typ != "" {
		typed = fmt.Sprintf(" /* key type %d, column types %s%s */", oid, types, s.txTag)
	}
	// The page size is hidden from the planner in a subquery: on a table
	// never analysed (a bulk import, autovacuum behind or off) a custom
	// plan that saw it, with a filter, read every row after the cursor
	// and sorted them (100,000 of 200,000 rows a page) instead of walking
	// the index; a hidden limit is costed at a tenth of the rows, as in a
	// generic plan.
	w := &walkStatements{
		first:   fmt.Sprintf("%s WHERE %s ORDER BY %s LIMIT (SELECT $%d::bigint)%s", cols, where, key, n+1, typed),
		after:   fmt.Sprintf("%s WHERE %s AND %s > $%d ORDER BY %s LIMIT (SELECT $%d::bigint)%s", cols, where, key, n+1, key, n+2, typed),
		sample:  fmt.Sprintf("%s TABLESAMPLE SYSTEM ($%d::float8) WHERE %s ORDER BY random() LIMIT $%d%s", cols, n+1, where, n+2, typed),
		xmax:    xmax,
		xmin:    xmin,
		nxip:    nxip,
		replay:  replay,
		checked: check != "",
		typed:   typed,
	}
	// Kept unless statements built from a later snapshot were kept
	// first: a read of the type that PostgreSQL answered before a
	// migration, however late it is sent or its reply arrives, must not
	// replace those of a pass whose first page saw the migration. (Ordered
	// by the snapshot PostgreSQL used, not by when this process asked:
	// a read asked first can wait for a connection and be answered last.
	// A pool moved to another cluster, whose transaction ids are lower,
	// keeps the old statements until its ids pass them.)
	for typ != "" {
		cur := s.walkSQL.Load()
		if (cur != nil && cur.newer(w)) || s.walkSQL.CompareAndSwap(cur, w) {
			break
		}
	}
	return w, nil
}

// typedSuffix is the types comment of the statements the latest pass
// built (none before any), for the lookups' statements: a pass's first
// page read the key column's type, so its lookups are prepared anew after
// a migration, as its pages are.
func (s *SQLSource) typedSuffix() string {
	if w := s.walkSQL.Load(); w != nil {
		return w.typed
	}
	return ""
}

// keyTextFixed holds the key column types whose text form no session
// setting changes and reads back exactly: their walk needs no read-back
// check, which cost about 0.1 µs a row. A domain over one of them is
// checked all the same.
var keyTextFixed = map[uint32]bool{
	pgtype.TextOID: true, pgtype.VarcharOID: true, pgtype.BPCharOID: true, pgtype.NameOID: true,
	pgtype.Int2OID: true, pgtype.Int4OID: true, pgtype.Int8OID: true, pgtype.NumericOID: true,
	pgtype.UUIDOID: true, pgtype.BoolOID: true,
}

// Lookup implements Source. A key the key column cannot hold cannot be in
// the table, so it is left out of the result like any absent key. A key no
// PostgreSQL text parameter can carry (invalid UTF-8, a NUL byte: a
// projection member written by something other than the gate) is dropped
// before querying and costs nothing, except in a SQL_ASCII database, which
// can hold keys that are not UTF-8: there such a key is looked up, or, when
// the session's client_encoding cannot send it, refused with an
// *InvalidRowError (the first such key costs a statement to learn the
// encodings). A key PostgreSQL rejects for the
// column's type ("user:42" for a bigint column) costs more: the server
// rejects the whole statement for it, so the batch is split in halves until
// each rejected key stands alone, about two failed statements per such key,
// each logged as an ERROR by the server, and a third confirms that the key
// column cannot hold it. A row that fails the same way for another reason
// (a view whose value expression fails for it) exists and is not left out:
// Lookup returns that error. A clean batch costs one query (through a
// pgx.Tx, with a savepoint around it: see DBTX). If
// the projection may hold many such keys, use a key column of a text type,
// or a Source of your own whose Lookup leaves out keys its column cannot
// hold.
func (s *SQLSource) Lookup(ctx context.Context, keys []string) ([]Row, error) {
	if s.unmade() {
		return nil, errUnmadeSource()
	}
	if slices.ContainsFunc(keys, unsendable) {
		drop := unsendable
		if i := slices.IndexFunc(keys, notUTF8); i >= 0 {
			enc, err := s.rawKeys(ctx)
			switch {
			case err != nil:
				return nil, err
			case enc.sendable:
				drop = hasNUL
			case enc.held:
				return nil, enc.refuse(keys[i])
			}
		}
		keys = slices.DeleteFunc(slices.Clone(keys), drop)
	}
	if len(keys) == 0 {
		return nil, nil
	}
	typed := s.typedSuffix()
	rows, err := s.lookupKeys(ctx, keys)
	if err != nil && ctx.Err() == nil {
		// Statements prepared for the column types the last pass read can
		// fail after a migration (42846: the key array's type no longer
		// matches the column's) until a pass reads the new ones: read them
		// now, and look up again if they changed.
		if _, werr := s.walkSQLs(ctx, true); werr == nil && s.typedSuffix() != typed {
			rows, err = s.lookupKeys(ctx, keys)
		}
	}
	return rows, err
}

// lookupKeys is Lookup for keys that a text parameter can carry.
func (s *SQLSource) lookupKeys(ctx context.Context, keys []string) ([]Row, error) {
	rows, err := s.lookup(ctx, keys)
	if err != nil && isDataException(err) {
		// Rule out a rejected filter value: then the error is not the keys'.
		if _, perr := s.lookup(ctx, []string{}); perr != nil {
			return nil, err
		}
		rows, err = s.lookupSplit(ctx, keys)
	}
	if err != nil {
		return nil, err
	}
	return rows, s.absentReadBack(ctx, keys, rows)
}

// absentReadBack refuses, as a walk does, a key Lookup did not find whose
// text does not read back as itself in this session (IST read as Israel
// time): it may be the text form of a row the lookup could not find, and
// taken for an orphan its correct entry would be deleted.
func (s *SQLSource) absentReadBack(ctx context.Context, keys []string, rows []Row) error {
	found := make(map[string]bool, len(rows))
	for _, r := range rows {
		found[r.Key] = true
	}
	absent := slices.DeleteFunc(slices.Clone(keys), func(k string) bool { return found[k] })
	if len(absent) == 0 {
		return nil
	}
	w, err := s.walkSQLs(ctx, false)
	if err != nil || !w.checked {
		return err
	}
	check := func(ks []string) (string, error) {
		var bad string
		err := s.mayFail(ctx, func(db DBTX) error {
			err := db.QueryRow(ctx, s.keyBackSQL+w.typed, ks, ks).Scan(&bad)
			if errors.Is(err, pgx.ErrNoRows) {
				return nil
			}
			return err
		})
		return bad, err
	}
	bad, err := check(absent)
	if err != nil && isDataException(err) {
		// Some key the column cannot hold: check the others one by one.
		for _, k := range absent {
			if bad, err = check([]string{k}); err == nil && bad != "" || err != nil && !isDataException(err) {
				break
			}
			err = nil
		}
	}
	switch {
	case err != nil:
		return fmt.Errorf("reconcile: querying %s: %w", s.relation, err)
	case bad != "":
		return &InvalidRowError{Key: bad, Reason: "the key does not read back as the same text in this session (its DateStyle and TimeZone, or extra_float_digits, read it as another value): the row it names cannot be looked up, and its entry would be taken for an orphan"}
	}
	return nil
}

// unsendable reports a key that no PostgreSQL text value can hold, so no
// stored key of any type can have it as its text form, unless it is only
// not UTF-8 and the database is SQL_ASCII (see rawKeys).
func unsendable(k string) bool { return !utf8.ValidString(k) || hasNUL(k) }

func hasNUL(k string) bool { return strings.IndexByte(k, 0) >= 0 }

// notUTF8 reports a key that is not UTF-8 and holds no NUL: one a SQL_ASCII
// database can hold.
func notUTF8(k string) bool { return !utf8.ValidString(k) && !hasNUL(k) }

// rawKeys tells what the database and its sessions do with keys that are
// not UTF-8, asking once per SQLSource (when such a key first comes). A
// database whose encoding is not SQL_ASCII holds none. A SQL_ASCII one
// holds any bytes but NUL: a session whose client_encoding is SQL_ASCII
// too (pgx's default there) reads and sends them as they are, but one that
// declares another encoding (UTF8, which the simple protocol requires)
// has every such parameter refused (and such rows are not sent to it). Left out of a Lookup as absent, such a
// key's projection entry would be taken for an orphan and, under an orphan
// repair policy, deleted; sent as a page's cursor, it would fail the pass
// there.
func (s *SQLSource) rawKeys(ctx context.Context) (*encodings, error) {
	if enc := s.encodings.Load(); enc != nil {
		return enc, nil
	}
	var server, client string
	if err := s.db.QueryRow(ctx, encodingsSQL).Scan(&server, &client); err != nil {
		return nil, fmt.Errorf("reconcile: reading the encodings of %s's database and session: %w", s.relation, err)
	}
	enc := &encodings{held: server == "SQL_ASCII", client: client}
	enc.sendable = enc.held && client == "SQL_ASCII"
	s.encodings.Store(enc)
	return enc, nil
}

// refuse is the error for key, which is not UTF-8, when the session cannot
// send it back.
func (enc *encodings) refuse(key string) error {
	return &InvalidRowError{Key: key, Reason: fmt.Sprintf(
		"is not valid UTF-8, which this SQL_ASCII database holds but a session with client_encoding %s cannot send back in a query, so it cannot be reconciled: connect with client_encoding SQL_ASCII, or convert the key column's values to UTF-8",
		enc.client)}
}

// encodingsSQL reads the database's encoding and the session's.
const encodingsSQL = "SELECT current_setting('server_encoding'), current_setting('client_encoding')"

func (s *SQLSource) lookup(ctx context.Context, keys []string) (rows []Row, err error) {
	args := append(append([]any(nil), s.args...), keys)
	typed := s.typedSuffix()
	err = s.mayFail(ctx, func(db DBTX) error {
		rows, err = s.queryOn(ctx, db, len(keys), s.lookupSQL+typed, args...)
		return err
	})
	return rows, err
}

// mayFail runs one of Lookup's statements, whose failure (for a key the key
// column cannot hold) Lookup expects and recovers from. A failed statement
// aborts the transaction it runs in, and with it every statement after:
// Lookup's next try, and the rest of the pass. So when the source reads
// through a pgx.Tx, each such statement runs in a savepoint of its own
// (two more round trips), rolled back if it fails. A pool or a connection
// outside a transaction needs none.
func (s *SQLSource) mayFail(ctx context.Context, run func(DBTX) error) error {
	tx, ok := s.db.(pgx.Tx)
	if !ok {
		return run(s.db)
	}
	sp, err := tx.Begin(ctx)
	if err != nil {
		return fmt.Errorf("reconcile: querying %s: %w", s.relation, err)
	}
	if err := run(sp); err != nil {
		if rerr := sp.Rollback(ctx); rerr != nil {
			// Not a data exception: Lookup gives up.
			return fmt.Errorf("reconcile: rolling back a failed lookup in %s (%v): %w", s.relation, err, rerr)
		}
		return err
	}
	if err := sp.Commit(ctx); err != nil {
		return fmt.Errorf("reconcile: querying %s: %w", s.relation, err)
	}
	return nil
}

// lookupSplit looks keys up in halves, dropping each key PostgreSQL rejects
// on its own.
func (s *SQLSource) lookupSplit(ctx context.Context, keys []string) ([]Row, error) {
	rows, err := s.lookup(ctx, keys)
	switch {
	case err == nil:
		return rows, nil
	case !isDataException(err):
		return nil, err
	case len(keys) == 1:
		return nil, s.keyRejected(ctx, keys[0], err)
	}
	half := len(keys) / 2
	first, err := s.lookupSplit(ctx, keys[:half])
	if err != nil {
		return nil, err
	}
	second, err := s.lookupSplit(ctx, keys[half:])
	if err != nil {
		return nil, err
	}
	return append(first, second...), nil
}

// keyRejected decides what a data exception err of a lookup of key alone
// means. It returns nil if the key column cannot hold key: no row can have
// it, and the key is left out as absent. Otherwise the error came from a
// row (a view whose value expression fails for it, say): that row exists,
// and leaving it out would report its projection entry as an orphan, which
// an ActionRepair policy deletes, so err is returned.
func (s *SQLSource) keyRejected(ctx context.Context, key string, err error) error {
	cerr := s.mayFail(ctx, func(db DBTX) error {
		var n int
		return db.QueryRow(ctx, s.keyCastSQL+s.typedSuffix(), []string{key}).Scan(&n)
	})
	switch {
	case cerr == nil:
		return err
	case isDataException(cerr):
		return nil
	}
	return fmt.Errorf("reconcile: querying %s: %w", s.relation, cerr)
}

// frozenSnapshot reports whether s reads through a pgx.Tx whose isolation
// (REPEATABLE READ or SERIALIZABLE) keeps one snapshot for the whole
// transaction: a lookup through it cannot see a write committed since, so
// it cannot confirm a finding. Through a pool, a connection, or a READ
// COMMITTED transaction, every statement takes a fresh snapshot.
func (s *SQLSource) frozenSnapshot(ctx context.Context) (bool, error) {
	if _, ok := s.db.(pgx.Tx); !ok {
		return false, nil
	}
	var level string
	if err := s.db.QueryRow(ctx, isolationSQL).Scan(&level); err != nil {
		return false, fmt.Errorf("reconcile: reading the isolation of the source's transaction: %w", err)
	}
	return level == "repeatable read" || level == "serializable", nil
}

// isolationSQL reads the isolation level of the current transaction.
const isolationSQL = "SELECT current_setting('transaction_isolation')"

// isDataException reports a PostgreSQL data exception (SQLSTATE class 22),
// a value its type cannot represent; a check violation (23514), which is
// how a domain type's CHECK refuses a value cast to it; or a name too long
// (42622), which is how a name column's binary input refuses a key of more
// than 63 bytes (the statements' own identifiers NewSQLSource checks).
func isDataException(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) &&
		(strings.HasPrefix(pgErr.Code, "22") || pgErr.Code == pgCheckViolation || pgErr.Code == pgNameTooLong)
}

const (
	pgCheckViolation = "23514" // PostgreSQL's SQLSTATE check_violation
	pgNameTooLong    = "42622" // PostgreSQL's SQLSTATE name_too_long
)

// Sample implements Source with TABLESAMPLE SYSTEM; see SQLSource for the
// bias this implies.
func (s *SQLSource) Sample(ctx context.Context, n int) ([]Row, error) {
	if s.unmade() {
		return nil, errUnmadeSource()
	}
	if n <= 0 {
		return nil, nil
	}
	walk, err := s.walkSQLs(ctx, true)
	if err != nil {
		return nil, err
	}
	var estimate float64
	if err := s.db.QueryRow(ctx, s.estimateSQL, s.relation).Scan(&estimate); err != nil {
		return nil, fmt.Errorf("reconcile: estimating rows of %s: %w", s.relation, err)
	}
	// Ask for twice the needed fraction so that one sample usually suffices
	// despite filters and estimate error; unknown estimates start at 1%.
	percent := 1.0
	if estimate > 0 {
		percent = 200 * float64(n) / estimate
	}
	for {
		percent = math.Min(math.Max(percent, 0.0001), 100)
		args := append(append([]any(nil), s.args...), percent, n)
		rows, err := s.query(ctx, n, walk.sample, args...)
		if err != nil || len(rows) >= n || percent >= 100 {
			return rows, err
		}
		percent *= 4
	}
}

// query runs a walk's or a sample's statement. A row whose key is not
// UTF-8 stops the pass when the session cannot send it back (as the next
// page's cursor, or in the orphan scan's lookups): see rawKeys. (PostgreSQL
// refuses to send such a row to a UTF8 session in the first place.)
func (s *SQLSource) query(ctx context.Context, capHint int, sql string, args ...any) ([]Row, error) {
	rows, err := s.queryOn(ctx, s.db, capHint, sql, args...)
	if err != nil {
		return nil, err
	}
	if i := slices.IndexFunc(rows, func(r Row) bool { return !utf8.ValidString(r.Key) }); i >= 0 {
		enc, err := s.rawKeys(ctx)
		if err != nil {
			return nil, err
		}
		if !enc.sendable {
			return nil, enc.refuse(rows[i].Key)
		}
	}
	return rows, nil
}

func (s *SQLSource) queryOn(ctx context.Context, db DBTX, capHint int, sql string, args ...any) ([]Row, error) {
	if s.kind != projection.KindSortedSet {
		// A value's bytes must not depend on pgx's statement mode: in
		// binary a uuid column scans as its 16 raw bytes, and a time
		// column in another form, where the simple protocol reads their
		// text forms.
		args = append([]any{valueResultFormats}, args...)
	}
	rows, err := db.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("reconcile: querying %s: %w", s.relation, err)
	}
	defer rows.Close()
	out := make([]Row, 0, min(capHint, 4096))
	// The walk's statements have a fourth column (see walkSQLs); the
	// lookup's have three.
	sc := s.newScanner(len(rows.FieldDescriptions()) == 4)
	for rows.Next() {
		r, err := sc.scan(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("reconcile: reading %s: %w", s.relation, err)
	}
	return out, nil
}

// valueResultFormats asks for the columns of a hash or document source in
// PostgreSQL's text form, but bytea (whose bytes are the value either way,
// and twice as long in text) and integers (the version, parsed either way).
var valueResultFormats = pgx.QueryResultFormatsByOID{
	pgtype.ByteaOID: pgx.BinaryFormatCode,
	pgtype.Int8OID:  pgx.BinaryFormatCode,
	pgtype.Int4OID:  pgx.BinaryFormatCode,
	pgtype.Int2OID:  pgx.BinaryFormatCode,
}

// rowScanner scans one query's rows into the same targets, row after row,
// so that a page allocates its keys and values but not scan targets.
// Version and score are pgtype.Int8, whose Valid tells NULL without the
// reflection and allocation of scanning into a **int64; the value of a hash
// or document stays a **[]byte, so NULL is told from an empty value
// whatever the column's type.
type rowScanner struct {
	src     *SQLSource
	key     string
	version pgtype.Int8
	score   pgtype.Int8
	data    *[]byte
	// readsBack is a walk's fourth column: the key's text form reads back
	// as the key (see walkSQLs).
	readsBack pgtype.Bool
	dests     []any
}

func (s *SQLSource) newScanner(checked bool) *rowScanner {
	sc := &rowScanner{src: s}
	var value any = &sc.data
	if s.kind == projection.KindSortedSet {
		value = &sc.score
	}
	sc.dests = []any{&sc.key, &sc.version, value}
	if checked {
		sc.dests = append(sc.dests, &sc.readsBack)
	}
	return sc
}

func (sc *rowScanner) scan(rows pgx.Rows) (Row, error) {
	s := sc.src
	sc.data = nil
	if err := rows.Scan(sc.dests...); err != nil {
		return Row{}, fmt.Errorf("reconcile: scanning %s: %w", s.relation, err)
	}
	r := Row{Key: sc.key}
	switch {
	case len(sc.dests) == 4 && !sc.readsBack.Bool:
		return Row{}, &InvalidRowError{Key: r.Key, Reason: "the key's text form does not read back as the same key in this session (its DateStyle and TimeZone, or extra_float_digits, write a form that names another value): as a cursor it would skip rows or walk back, and its entry would be taken for an orphan"}
	case !sc.version.Valid:
		return Row{}, &InvalidRowError{Key: r.Key, Reason: "version is NULL"}
	case sc.version.Int64 <= 0:
		return Row{}, &InvalidRowError{Key: r.Key, Reason: "version " + strconv.FormatInt(sc.version.Int64, 10) + " is not positive"}
	case s.kind == projection.KindSortedSet && !sc.score.Valid, s.kind != projection.KindSortedSet && sc.data == nil:
		return Row{}, &InvalidRowError{Key: r.Key, Reason: "value is NULL"}
	}
	r.Version = sc.version.Int64
	if s.kind == projection.KindSortedSet {
		if sc.score.Int64 < projection.MinScore || sc.score.Int64 > projection.MaxScore {
			return Row{}, &InvalidRowError{Key: r.Key, Reason: fmt.Sprintf("score %d outside ±2^53", sc.score.Int64)}
		}
		r.Value.Score = sc.score.Int64
	} else {
		r.Value.Data = *sc.data
	}
	return r, nil
}
