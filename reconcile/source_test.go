package reconcile

import (
	"context"
	"database/sql"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/projection"
)

func TestSQLSource(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("KeysetOverBigintKeys", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		_, err := pg.Pool.Exec(ctx, `CREATE TABLE "Scores" ("User Id" bigint PRIMARY KEY, "Ver" bigint NOT NULL, "Pts" bigint NOT NULL);
			INSERT INTO "Scores" SELECT g, 1, g * 3 FROM generate_series(1, 25) g`)
		require.NoError(t, err)
		src, err := NewSQLSource(pg.Pool, &SQLSourceConfig{
			Table: "Scores", Schema: pg.Schema, KeyColumn: "User Id", VersionColumn: "Ver", ValueColumn: "Pts", Kind: projection.KindSortedSet,
		})
		require.NoError(t, err)
		var keys []string
		var cursor Cursor
		for {
			rows, err := src.Page(ctx, cursor, 7)
			require.NoError(t, err)
			if len(rows) == 0 {
				break
			}
			require.LessOrEqual(t, len(rows), 7)
			for _, r := range rows {
				keys = append(keys, r.Key)
			}
			cursor = After(rows[len(rows)-1].Key)
		}
		// Numeric order, not text order ("10" after "9"), and nothing twice.
		require.Len(t, keys, 25)
		require.Equal(t, "9", keys[8])
		require.Equal(t, "10", keys[9])

		found, err := src.Lookup(ctx, []string{"3", "30", "12"})
		require.NoError(t, err)
		require.ElementsMatch(t, []Row{
			{Key: "3", Version: 1, Value: projection.Value{Score: 9}},
			{Key: "12", Version: 1, Value: projection.Value{Score: 36}},
		}, found)
	})

	t.Run("LookupLeavesOutKeysTheColumnCannotHold", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		_, err := pg.Pool.Exec(ctx, `CREATE TABLE n (k bigint PRIMARY KEY, v bigint NOT NULL, p bigint NOT NULL, board text NOT NULL);
			INSERT INTO n SELECT g, 1, g, 'daily' FROM generate_series(1, 25) g`)
		require.NoError(t, err)
		newSource := func(board string) *SQLSource {
			src, err := NewSQLSource(pg.Pool, &SQLSourceConfig{Table: "n", Schema: pg.Schema, KeyColumn: "k", VersionColumn: "v",
				ValueColumn: "p", Kind: projection.KindSortedSet, Filters: []Filter{{Column: "board", Value: board}}})
			require.NoError(t, err)
			return src
		}
		found, err := newSource("daily").Lookup(ctx, []string{"3", "abc", "12", "99999999999999999999", "bad\xff", "30", " 7"})
		require.NoError(t, err)
		require.ElementsMatch(t, []Row{
			{Key: "3", Version: 1, Value: projection.Value{Score: 3}},
			{Key: "12", Version: 1, Value: projection.Value{Score: 12}},
			{Key: "7", Version: 1, Value: projection.Value{Score: 7}}, // " 7" is a bigint, but not the member "7"
		}, found)

		// A filter value PostgreSQL rejects is the caller's error, not an
		// absent key: the lookup fails instead of finding nothing.
		_, err = newSource("bad\x00").Lookup(ctx, []string{"3"})
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr)
		require.Equal(t, "22021", pgErr.Code)
	})

	// A domain's CHECK refuses a key with a check violation (23514), not
	// a data exception: such a key, too, is one the column cannot hold,
	// left out as absent rather than failing the lookup (and the run).
	t.Run("LookupLeavesOutKeysADomainRefuses", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		_, err := pg.Pool.Exec(ctx, `CREATE DOMAIN user_id AS text CHECK (VALUE LIKE 'u%');
			CREATE TABLE d (k user_id PRIMARY KEY, v bigint NOT NULL, p bigint NOT NULL);
			INSERT INTO d VALUES ('u1', 1, 10), ('u2', 1, 20)`)
		require.NoError(t, err)
		src, err := NewSQLSource(pg.Pool, &SQLSourceConfig{Table: "d", Schema: pg.Schema, KeyColumn: "k", VersionColumn: "v",
			ValueColumn: "p", Kind: projection.KindSortedSet})
		require.NoError(t, err)
		found, err := src.Lookup(ctx, []string{"u1", "x9", "u2", "u3"})
		require.NoError(t, err)
		require.ElementsMatch(t, []Row{{Key: "u1", Version: 1, Value: projection.Value{Score: 10}},
			{Key: "u2", Version: 1, Value: projection.Value{Score: 20}}}, found)
	})

	// A name column's binary input (pgx's default exec modes) refuses a
	// key of more than 63 bytes with name_too_long (42622), not a data
	// exception: one such member in Redis (a hand edit, a buggy writer)
	// failed every orphan scan and CheckKeys instead of being reported as
	// the orphan it is. (The text modes truncate it, and find no row.)
	t.Run("LookupLeavesOutKeysANameCannotHold", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		rd := testenv.Redis(t)
		_, err := pg.Pool.Exec(ctx, `CREATE TABLE nm (k name PRIMARY KEY, v bigint NOT NULL, p bigint NOT NULL);
			INSERT INTO nm VALUES ('alice', 1, 5)`)
		require.NoError(t, err)
		ks, err := projection.NewKeyspace(rd.Prefix)
		require.NoError(t, err)
		long := "alice-" + strings.Repeat("0", 70)
		var writes []projection.Write
		for _, k := range []string{"alice", long} {
			writes = append(writes, projection.Write{Target: projection.Target{Kind: projection.KindSortedSet, Name: "b", Member: k},
				Version: 1, Value: projection.Value{Score: 5}})
		}
		_, err = projection.NewGate(rd.Client, ks).Apply(ctx, writes)
		require.NoError(t, err)
		for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeDescribeExec} {
			for _, viaTx := range []bool{false, true} {
				cfg, err := pgxpool.ParseConfig(pg.ConnString)
				require.NoError(t, err)
				cfg.ConnConfig.DefaultQueryExecMode = mode
				pool, err := pgxpool.NewWithConfig(ctx, cfg)
				require.NoError(t, err)
				t.Cleanup(pool.Close)
				var db DBTX = pool
				if viaTx {
					tx, err := pool.Begin(ctx)
					require.NoError(t, err)
					t.Cleanup(func() { _ = tx.Rollback(ctx) })
					db = tx
				}
				src, err := NewSQLSource(db, &SQLSourceConfig{Table: "nm", Schema: pg.Schema, KeyColumn: "k", VersionColumn: "v",
					ValueColumn: "p", Kind: projection.KindSortedSet})
				require.NoError(t, err)
				r, err := New(src, Target{Client: rd.Client, Keyspace: ks, Kind: projection.KindSortedSet, Name: "b"}, nil)
				require.NoError(t, err)
				rep, err := r.Run(ctx, RunOptions{DryRun: true})
				require.NoError(t, err, "%s, tx %v", mode, viaTx)
				require.Equal(t, map[Class]int64{ClassCurrent: 1, ClassOrphan: 1}, rep.Counts, "%s, tx %v", mode, viaTx)
				rep, err = r.CheckKeys(ctx, []string{"alice", long}, RunOptions{DryRun: true})
				require.NoError(t, err, "%s, tx %v", mode, viaTx)
				require.Equal(t, map[Class]int64{ClassCurrent: 1, ClassOrphan: 1}, rep.Counts, "%s, tx %v", mode, viaTx)
			}
		}
	})

	// Through a pgx.Tx (one snapshot for a whole pass), the statements a
	// rejected key fails would abort the transaction: Lookup failed with
	// the key's error instead of leaving it out, so the orphan scan never
	// reported it, and every later statement of the pass failed too.
	t.Run("LookupInsideATransaction", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		rd := testenv.Redis(t)
		_, err := pg.Pool.Exec(ctx, `CREATE TABLE n (k bigint PRIMARY KEY, v bigint NOT NULL, p bigint NOT NULL);
			INSERT INTO n SELECT g, 1, g FROM generate_series(1, 5) g`)
		require.NoError(t, err)
		tx, err := pg.Pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // read-only
		src, err := NewSQLSource(tx, &SQLSourceConfig{Table: "n", Schema: pg.Schema, KeyColumn: "k", VersionColumn: "v",
			ValueColumn: "p", Kind: projection.KindSortedSet})
		require.NoError(t, err)

		found, err := src.Lookup(ctx, []string{"3", "user:42", "5"})
		require.NoError(t, err)
		require.ElementsMatch(t, []Row{{Key: "3", Version: 1, Value: projection.Value{Score: 3}},
			{Key: "5", Version: 1, Value: projection.Value{Score: 5}}}, found)
		page, err := src.Page(ctx, Cursor{}, 10)
		require.NoError(t, err, "the transaction is still usable")
		require.Len(t, page, 5)

		ks, err := projection.NewKeyspace(rd.Prefix)
		require.NoError(t, err)
		var writes []projection.Write
		for _, k := range []string{"1", "2", "3", "4", "5", "user:42"} {
			writes = append(writes, projection.Write{Target: projection.Target{Kind: projection.KindSortedSet, Name: "b", Member: k},
				Version: 1, Value: projection.Value{Score: int64(k[0] - '0')}})
		}
		_, err = projection.NewGate(rd.Client, ks).Apply(ctx, writes)
		require.NoError(t, err)
		r, err := New(src, Target{Client: rd.Client, Keyspace: ks, Kind: projection.KindSortedSet, Name: "b"}, nil)
		require.NoError(t, err)
		rep, err := r.Run(ctx, RunOptions{DryRun: true})
		require.NoError(t, err)
		require.Equal(t, map[Class]int64{ClassCurrent: 5, ClassOrphan: 1}, rep.Counts)
	})

	// Keys no text parameter can carry (invalid UTF-8, a NUL byte) were
	// sent and bisected: about two failed statements per such key, in
	// Lookup and in the orphan scan that looks each batch up twice.
	t.Run("LookupDropsKeysNoTextCanHoldWithoutQuerying", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		rd := testenv.Redis(t)
		_, err := pg.Pool.Exec(ctx, `CREATE TABLE u (k text PRIMARY KEY, v bigint NOT NULL, p bigint NOT NULL);
			INSERT INTO u SELECT g::text, 1, g FROM generate_series(1, 300) g`)
		require.NoError(t, err)
		db := &countingDB{DBTX: pg.Pool}
		src, err := NewSQLSource(db, &SQLSourceConfig{Table: "u", Schema: pg.Schema, KeyColumn: "k", VersionColumn: "v",
			ValueColumn: "p", Kind: projection.KindSortedSet})
		require.NoError(t, err)

		var keys, bad []string
		var want []Row
		for i := 1; i <= 300; i++ {
			keys = append(keys, strconv.Itoa(i), "bad\xff"+strconv.Itoa(i), strconv.Itoa(i)+"\x00")
			bad = append(bad, "bad\xff"+strconv.Itoa(i), strconv.Itoa(i)+"\x00")
			want = append(want, Row{Key: strconv.Itoa(i), Version: 1, Value: projection.Value{Score: int64(i)}})
		}
		found, err := src.Lookup(ctx, keys)
		require.NoError(t, err)
		require.ElementsMatch(t, want, found)
		// One more, the first time such a key comes, reads the database's
		// encoding (a SQL_ASCII one can hold keys that are not UTF-8).
		require.EqualValues(t, 2, db.n.Load(), "statements for one lookup")
		found, err = src.Lookup(ctx, bad)
		require.NoError(t, err)
		require.Empty(t, found)
		require.EqualValues(t, 2, db.n.Load(), "statements for a lookup of nothing but such keys")

		// A full pass over a projection holding them: its orphan scan
		// reports them without a statement each.
		ks, err := projection.NewKeyspace(rd.Prefix)
		require.NoError(t, err)
		var writes []projection.Write
		for i, k := range keys {
			writes = append(writes, projection.Write{Target: projection.Target{Kind: projection.KindSortedSet, Name: "b", Member: k},
				Version: 1, Value: projection.Value{Score: int64(i/3 + 1)}})
		}
		_, err = projection.NewGate(rd.Client, ks).Apply(ctx, writes)
		require.NoError(t, err)
		r, err := New(src, Target{Client: rd.Client, Keyspace: ks, Kind: projection.KindSortedSet, Name: "b"},
			&Config{PageSize: 100})
		require.NoError(t, err)
		db.n.Store(0)
		rep, err := r.Run(ctx, RunOptions{DryRun: true})
		require.NoError(t, err)
		require.EqualValues(t, 300, rep.Counts[ClassCurrent])
		require.EqualValues(t, 600, rep.Counts[ClassOrphan])
		// 4 pages of rows; 9 orphan-scan batches of 100, each looked up
		// and confirmed: 22 at most, not two per bad member.
		require.LessOrEqual(t, db.n.Load(), int64(22), "statements for a pass")
	})

	t.Run("LookupProbesWithoutStatistics", func(t *testing.T) {
		t.Parallel()
		// A table loaded in bulk and never analysed: key = ANY ($n) of
		// 1,000 keys was planned as a read of the whole table.
		pg := testenv.Postgres(t)
		_, err := pg.Pool.Exec(ctx, `CREATE TABLE s (k bigint PRIMARY KEY, v bigint NOT NULL, p bigint NOT NULL, board text NOT NULL)
				WITH (autovacuum_enabled = false);
			INSERT INTO s SELECT g, 1, g, 'daily' FROM generate_series(1, 50000) g`)
		require.NoError(t, err)
		src, err := NewSQLSource(pg.Pool, &SQLSourceConfig{Table: "s", Schema: pg.Schema, KeyColumn: "k", VersionColumn: "v",
			ValueColumn: "p", Kind: projection.KindSortedSet, Filters: []Filter{{Column: "board", Value: "daily"}}})
		require.NoError(t, err)
		keys, present := make([]string, 1000), 0
		for i := range keys {
			k := i*53 + 1 // up to 52,948: the last 56 are absent
			keys[i] = strconv.Itoa(k)
			if k <= 50000 {
				present++
			}
		}
		for _, generic := range []bool{false, true} {
			plan := testenv.Plan(t, pg.ConnString, generic, "TEXT", src.lookupSQL, "daily", keys)
			require.NotContains(t, plan, "Seq Scan on s", "generic %v plan:\n%s", generic, plan)
			require.Regexp(t, `Index Cond: \(.*\bk = `, plan, "generic %v plan:\n%s", generic, plan)
		}
		found, err := src.Lookup(ctx, keys)
		require.NoError(t, err)
		require.Len(t, found, present)
	})

	t.Run("EmptyKeyAndFilter", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindHash)
		b.insert(t, "", 1)
		b.insert(t, "b", 2)
		_, err := b.pool.Exec(ctx, `INSERT INTO items VALUES ('a', 'daily', 1, NULL, 'x')`)
		require.NoError(t, err)
		rows, err := b.source.Page(ctx, Cursor{}, 10)
		require.NoError(t, err)
		require.Equal(t, []Row{
			{Key: "", Version: 1, Value: projection.Value{Data: []byte("@1")}},
			{Key: "b", Version: 2, Value: projection.Value{Data: []byte("b@2")}},
		}, rows)
		rows, err = b.source.Page(ctx, After(""), 10)
		require.NoError(t, err)
		require.Len(t, rows, 1)
	})

	t.Run("SampleNeverAnalyzed", func(t *testing.T) {
		t.Parallel()
		// reltuples is unknown (-1) until the first (auto) ANALYZE: the sample
		// starts at 1% of the blocks and grows until it has enough rows.
		b := setup(t, projection.KindSortedSet)
		b.insertMany(t, 2000)
		rows, err := b.source.Sample(ctx, 150)
		require.NoError(t, err)
		require.Len(t, rows, 150)
		seen := map[string]bool{}
		for _, r := range rows {
			require.False(t, seen[r.Key])
			seen[r.Key] = true
		}
		rows, err = b.source.Sample(ctx, 0)
		require.NoError(t, err)
		require.Empty(t, rows)
	})

	t.Run("InvalidRows", func(t *testing.T) {
		t.Parallel()
		for name, stmt := range map[string]string{
			"NullVersion":   `INSERT INTO items VALUES ('k', 'weekly', NULL, 1, 'x')`,
			"ZeroVersion":   `INSERT INTO items VALUES ('k', 'weekly', 0, 1, 'x')`,
			"NullValue":     `INSERT INTO items VALUES ('k', 'weekly', 1, NULL, 'x')`,
			"ScoreTooLarge": `INSERT INTO items VALUES ('k', 'weekly', 1, 9007199254740993, 'x')`,
		} {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				b := setup(t, projection.KindSortedSet)
				_, err := b.pool.Exec(ctx, stmt)
				require.NoError(t, err)
				_, err = b.source.Page(ctx, Cursor{}, 10)
				var rowErr *InvalidRowError
				require.ErrorAs(t, err, &rowErr)
				require.Equal(t, "k", rowErr.Key)
			})
		}
	})

	// A hash's value may be empty but not NULL, in a bytea column and in a
	// text one.
	t.Run("HashValues", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindHash)
		_, err := b.pool.Exec(ctx, `INSERT INTO items VALUES ('empty', 'weekly', 1, NULL, ''), ('full', 'weekly', 2, NULL, 'x')`)
		require.NoError(t, err)
		rows, err := b.source.Page(ctx, Cursor{}, 10)
		require.NoError(t, err)
		require.Equal(t, []Row{
			{Key: "empty", Version: 1, Value: projection.Value{Data: []byte{}}},
			{Key: "full", Version: 2, Value: projection.Value{Data: []byte("x")}},
		}, rows)

		_, err = b.pool.Exec(ctx, `INSERT INTO items VALUES ('null', 'weekly', 1, NULL, NULL)`)
		require.NoError(t, err)
		_, err = b.source.Page(ctx, Cursor{}, 10)
		var rowErr *InvalidRowError
		require.ErrorAs(t, err, &rowErr)
		require.Equal(t, "null", rowErr.Key)
		require.Contains(t, rowErr.Reason, "NULL")

		_, err = b.pool.Exec(ctx, `CREATE TABLE texts (key text PRIMARY KEY, version int4, body text)`)
		require.NoError(t, err)
		_, err = b.pool.Exec(ctx, `INSERT INTO texts VALUES ('e', 1, ''), ('n', 3, NULL)`)
		require.NoError(t, err)
		src, err := NewSQLSource(b.pool, &SQLSourceConfig{Table: "texts", KeyColumn: "key", VersionColumn: "version", ValueColumn: "body", Kind: projection.KindHash})
		require.NoError(t, err)
		rows, err = src.Lookup(ctx, []string{"e"})
		require.NoError(t, err)
		require.Equal(t, []Row{{Key: "e", Version: 1, Value: projection.Value{Data: []byte{}}}}, rows)
		_, err = src.Lookup(ctx, []string{"n"})
		require.ErrorAs(t, err, &rowErr)
		require.Equal(t, "n", rowErr.Key)
	})

	// Filters on a column whose name needs quoting, several at once (each
	// compared with its own parameter), and a NULL key: only the row
	// matching every filter is read, by Page and by Lookup, and the
	// NULL-keyed row is ignored.
	t.Run("FiltersQuotedNumberedAndNullKeys", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		_, err := pg.Pool.Exec(ctx, `CREATE TABLE f ("Key" text, v bigint NOT NULL, p bigint NOT NULL, "Board Name" text NOT NULL, season int NOT NULL);
			INSERT INTO f VALUES ('a', 1, 10, 'weekly', 1), ('b', 1, 20, 'weekly', 2), ('c', 1, 30, 'daily', 1), (NULL, 1, 40, 'weekly', 1)`)
		require.NoError(t, err)
		src, err := NewSQLSource(pg.Pool, &SQLSourceConfig{Table: "f", Schema: pg.Schema, KeyColumn: "Key", VersionColumn: "v",
			ValueColumn: "p", Kind: projection.KindSortedSet, Filters: []Filter{{Column: "Board Name", Value: "weekly"}, {Column: "season", Value: 1}}})
		require.NoError(t, err)
		want := []Row{{Key: "a", Version: 1, Value: projection.Value{Score: 10}}}
		rows, err := src.Page(ctx, Cursor{}, 10)
		require.NoError(t, err)
		require.Equal(t, want, rows)
		rows, err = src.Lookup(ctx, []string{"a", "b", "c"})
		require.NoError(t, err)
		require.Equal(t, want, rows)
	})

	t.Run("Config", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		ok := SQLSourceConfig{Table: "t", KeyColumn: "k", VersionColumn: "v", ValueColumn: "x", Kind: projection.KindHash}
		for field, mutate := range map[string]func(c *SQLSourceConfig){
			"SQLSourceConfig.Table":             func(c *SQLSourceConfig) { c.Table = "" },
			"SQLSourceConfig.KeyColumn":         func(c *SQLSourceConfig) { c.KeyColumn = "" },
			"SQLSourceConfig.VersionColumn":     func(c *SQLSourceConfig) { c.VersionColumn = "" },
			"SQLSourceConfig.ValueColumn":       func(c *SQLSourceConfig) { c.ValueColumn = "" },
			"SQLSourceConfig.Kind":              func(c *SQLSourceConfig) { c.Kind = 0 },
			"SQLSourceConfig.Filters[0].Column": func(c *SQLSourceConfig) { c.Filters = []Filter{{Value: 1}} },
			// Names PostgreSQL would not receive verbatim: Sanitize drops
			// NUL bytes ("t\x00" would read table "t"), PostgreSQL
			// truncates past 63 bytes.
			"SQLSourceConfig.Schema":          func(c *SQLSourceConfig) { c.Schema = "s\x00" },
			"SQLSourceConfig.Table#Nul":       func(c *SQLSourceConfig) { c.Table = "t\x00" },
			"SQLSourceConfig.Table#UTF8":      func(c *SQLSourceConfig) { c.Table = "t\xff" },
			"SQLSourceConfig.Table#Long":      func(c *SQLSourceConfig) { c.Table = strings.Repeat("t", 64) },
			"SQLSourceConfig.KeyColumn#Nul":   func(c *SQLSourceConfig) { c.KeyColumn = "k\x00" },
			"SQLSourceConfig.ValueColumn#Nul": func(c *SQLSourceConfig) { c.ValueColumn = "x\x00" },
			"SQLSourceConfig.Filters[0].Column#Nul": func(c *SQLSourceConfig) {
				c.Filters = []Filter{{Column: "b\x00", Value: 1}}
			},
		} {
			field, _, _ = strings.Cut(field, "#")
			cfg := ok
			mutate(&cfg)
			_, err := NewSQLSource(pg.Pool, &cfg)
			var cfgErr *ConfigError
			require.ErrorAs(t, err, &cfgErr, field)
			require.Equal(t, field, cfgErr.Field)
			require.ErrorIs(t, err, ErrInvalidConfig)
		}
		_, err := NewSQLSource((*pgxpool.Pool)(nil), &ok)
		var dbErr *ConfigError
		require.ErrorAs(t, err, &dbErr, "a typed-nil pool")
		require.Equal(t, "db", dbErr.Field)
		// pgxpool panics on a released Conn; the source would at its
		// first page, inside a reconcile run.
		released, err := pg.Pool.Acquire(ctx)
		require.NoError(t, err)
		released.Release()
		_, err = NewSQLSource(released, &ok)
		require.ErrorAs(t, err, &dbErr, "a released pooled connection")
		require.Equal(t, "db", dbErr.Field)

		// A filter that PostgreSQL receives as NULL matches no row.
		var nilText *string
		for name, value := range map[string]any{"Nil": nil, "NilPointer": nilText, "NullValuer": pgtype.Text{}, "NullSQL": sql.NullInt64{}} {
			cfg := ok
			cfg.Filters = []Filter{{Column: "board", Value: "b"}, {Column: "k", Value: value}}
			_, err := NewSQLSource(pg.Pool, &cfg)
			var cfgErr *ConfigError
			require.ErrorAs(t, err, &cfgErr, name)
			require.Equal(t, "SQLSourceConfig.Filters[1].Value", cfgErr.Field, name)
		}
		for name, value := range map[string]any{"Zero": 0, "Empty": "", "Valuer": pgtype.Text{String: "b", Valid: true}} {
			cfg := ok
			cfg.Filters = []Filter{{Column: "k", Value: value}}
			_, err := NewSQLSource(pg.Pool, &cfg)
			require.NoError(t, err, name)
		}
		_, err = NewSQLSource(pg.Pool, &ok)
		require.NoError(t, err)
		longest := ok
		longest.Table = strings.Repeat("t", 63)
		_, err = NewSQLSource(pg.Pool, &longest)
		require.NoError(t, err)
	})
}

// countingDB counts the statements a SQLSource sends.
type countingDB struct {
	DBTX
	n atomic.Int64
}

func (c *countingDB) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	c.n.Add(1)
	return c.DBTX.Query(ctx, sql, args...)
}

func (c *countingDB) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	c.n.Add(1)
	return c.DBTX.QueryRow(ctx, sql, args...)
}

func TestClassify(t *testing.T) {
	t.Parallel()
	row := &Row{Key: "k", Version: 5, Value: projection.Value{Score: 42, Data: []byte("v")}}
	proj := func(raw string, score float64, data string) Projected {
		var p Projected
		if raw != "" {
			p.parseVersion(raw)
		}
		p.HasValue = score != 0 || data != ""
		p.Score, p.Data = score, []byte(data)
		return p
	}
	for name, tc := range map[string]struct {
		kind projection.Kind
		row  *Row
		p    Projected
		want Class
	}{
		"Current":             {projection.KindSortedSet, row, proj("5", 42, ""), ClassCurrent},
		"CurrentBytes":        {projection.KindHash, row, proj("5", 0, "v"), ClassCurrent},
		"Missing":             {projection.KindSortedSet, row, Projected{}, ClassMissing},
		"Stale":               {projection.KindSortedSet, row, proj("4", 42, ""), ClassStale},
		"StaleValueGone":      {projection.KindHash, row, proj("4", 0, ""), ClassStale},
		"Ahead":               {projection.KindDocument, row, proj("6", 0, "v"), ClassAhead},
		"AheadValueGone":      {projection.KindHash, row, proj("6", 0, ""), ClassAhead},
		"CorruptScore":        {projection.KindSortedSet, row, proj("5", 999, ""), ClassCorrupt},
		"CorruptFraction":     {projection.KindSortedSet, row, proj("5", 42.5, ""), ClassCorrupt},
		"CorruptBytes":        {projection.KindHash, row, proj("5", 0, "w"), ClassCorrupt},
		"VersionWithoutValue": {projection.KindHash, row, proj("5", 0, ""), ClassCorrupt},
		"ValueWithoutVersion": {projection.KindSortedSet, row, proj("", 42, ""), ClassCorrupt},
		"NonCanonicalVersion": {projection.KindSortedSet, row, proj("05", 42, ""), ClassCorrupt},
		"NegativeVersion":     {projection.KindSortedSet, row, proj("-5", 42, ""), ClassCorrupt},
		"ZeroVersion":         {projection.KindSortedSet, row, proj("0", 42, ""), ClassCorrupt},
		"ZeroVersionNoValue":  {projection.KindHash, row, proj("0", 0, ""), ClassCorrupt},
		"PlusSignVersion":     {projection.KindSortedSet, row, proj("+5", 42, ""), ClassCorrupt},
		"GarbageVersion":      {projection.KindSortedSet, row, proj("five", 42, ""), ClassCorrupt},
		"HugeVersion":         {projection.KindSortedSet, row, proj("99999999999999999999", 42, ""), ClassCorrupt},
		"Orphan":              {projection.KindSortedSet, nil, proj("1", 1, ""), ClassOrphan},
		"OrphanVersionOnly":   {projection.KindSortedSet, nil, proj("1", 0, ""), ClassOrphan},
		"AbsentEverywhere":    {projection.KindSortedSet, nil, Projected{}, ClassCurrent},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			require.Equal(t, tc.want, Classify(tc.kind, tc.row, tc.p))
		})
	}
	// A version without its value is corrupt even where the source's value
	// is the zero value (a score of 0, an empty field or document), which
	// the absent value's zero Score and Data equal: a sorted-set member
	// that vanished at score 0 must not pass as current.
	t.Run("VersionWithoutValueZeroSource", func(t *testing.T) {
		t.Parallel()
		zero := &Row{Key: "k", Version: 5, Value: projection.Value{Score: 0, Data: []byte{}}}
		for _, kind := range allKinds {
			var p Projected
			p.parseVersion("5")
			require.Equal(t, ClassCorrupt, Classify(kind, zero, p), kindName(kind))
			p.HasValue = true
			require.Equal(t, ClassCurrent, Classify(kind, zero, p), "%s: the zero value, present, is current", kindName(kind))
		}
	})
	require.Equal(t, "corrupt", ClassCorrupt.String())
	require.Equal(t, "class(99)", Class(99).String())
}

func TestNewValidation(t *testing.T) {
	t.Parallel()
	rd := testenv.Redis(t)
	src := &SQLSource{}
	ks, err := projection.NewKeyspace(rd.Prefix)
	require.NoError(t, err)
	okTarget := Target{Client: rd.Client, Keyspace: ks, Kind: projection.KindSortedSet, Name: "b"}

	for field, tc := range map[string]struct {
		source Source
		target Target
		cfg    *Config
	}{
		"source":                    {nil, okTarget, nil},
		"Target.Client":             {src, Target{Kind: projection.KindHash}, nil},
		"Target.Keyspace":           {src, Target{Client: rd.Client, Kind: projection.KindSortedSet, Name: "b"}, nil},
		"Target.Kind":               {src, Target{Client: rd.Client, Keyspace: ks}, nil},
		"Target.Name":               {src, Target{Client: rd.Client, Keyspace: ks, Kind: projection.KindDocument, Name: "x"}, nil},
		"Target.Namespace":          {src, Target{Client: rd.Client, Keyspace: ks, Kind: projection.KindHash, Name: "h", Namespace: "x:"}, nil},
		"Target.Client (typed nil)": {src, Target{Client: (*redis.Client)(nil), Kind: projection.KindHash, Name: "h"}, nil},
		"source (typed nil)":        {(*SQLSource)(nil), okTarget, nil},
		"Config.PageSize":           {src, okTarget, &Config{PageSize: -1}},
		"Config.ExamplesPerClass":   {src, okTarget, &Config{ExamplesPerClass: -2}},
		"Config.RepairTimeout":      {src, okTarget, &Config{RepairTimeout: -1}},
		"Config.RebuildMarkerTTL":   {src, okTarget, &Config{RebuildMarkerTTL: 1}},
		"Config.Policy.Ahead":       {src, okTarget, &Config{Policy: Policy{Ahead: 7}}},
	} {
		_, err := New(tc.source, tc.target, tc.cfg)
		var cfgErr *ConfigError
		require.ErrorAs(t, err, &cfgErr, field)
		require.Equal(t, strings.TrimSuffix(field, " (typed nil)"), cfgErr.Field)
	}
	r, err := New(src, okTarget, nil)
	require.NoError(t, err)
	require.Equal(t, PageSizeDefault, r.cfg.PageSize)
	empty, err := projection.NewKeyspace("")
	require.NoError(t, err)
	_, err = New(src, Target{Client: rd.Client, Keyspace: empty, Kind: projection.KindSortedSet, Name: "b"}, nil)
	require.NoError(t, err, "an empty prefix is a projector's choice; only the zero Keyspace is refused")

	_, err = r.Run(context.Background(), RunOptions{Sample: -1})
	require.ErrorIs(t, err, ErrInvalidConfig)
	_, err = r.Run(context.Background(), RunOptions{Sample: SampleMax + 1})
	require.ErrorIs(t, err, ErrInvalidConfig, "a sample too large to hold")

	require.Equal(t, ActionRepair, Policy{}.For(ClassStale))
	require.Equal(t, ActionReport, Policy{}.For(ClassOrphan))
	require.Equal(t, ActionRepair, Policy{Orphan: ActionRepair}.For(ClassOrphan))
	require.Equal(t, ActionReport, Policy{Missing: ActionReport}.For(ClassMissing))
}

// TestNewRefusesSQLSourceOfAnotherKind: an SQLSource reads ValueColumn by
// its Kind, so one of another Kind than the Target would have every entry
// compared with, and repaired to, a value read for the other kind (a hash
// source's rows carry no score: a sorted set's every member would get 0).
// New refuses it.
func TestNewRefusesSQLSourceOfAnotherKind(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet)
	kinds := []projection.Kind{projection.KindSortedSet, projection.KindHash, projection.KindDocument}
	for _, sourceKind := range kinds {
		src, err := NewSQLSource(b.pool, &SQLSourceConfig{Table: "items", KeyColumn: "key", VersionColumn: "version",
			ValueColumn: "data", Kind: sourceKind, Filters: []Filter{{Column: "board", Value: testBoard}}})
		require.NoError(t, err)
		for _, targetKind := range kinds {
			target := Target{Client: b.client, Keyspace: b.ks, Kind: targetKind, Name: testBoard}
			if targetKind == projection.KindDocument {
				target.Name = ""
			}
			r, err := New(src, target, &Config{SkipOrphans: true})
			if sourceKind == targetKind {
				require.NoError(t, err, "%s source, %s target", sourceKind, targetKind)
				continue
			}
			require.ErrorIs(t, err, ErrInvalidConfig, "%s source, %s target", sourceKind, targetKind)
			var cfgErr *ConfigError
			require.ErrorAs(t, err, &cfgErr)
			require.Equal(t, "SQLSourceConfig.Kind", cfgErr.Field)
			require.Contains(t, cfgErr.Reason, "Kind "+targetKind.String())
			require.Nil(t, r)
		}
	}
}

// TestZeroValues: a Reconciler or SQLSource not made by its constructor
// (a zero value, or nil) is refused with a *ConfigError naming the
// constructor, not dereferenced, as projection.Gate's zero value is.
func TestZeroValues(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, r := range map[string]*Reconciler{"Zero": {}, "Nil": nil} {
		t.Run("Reconciler"+name, func(t *testing.T) {
			t.Parallel()
			for method, call := range map[string]func() error{
				"Run":       func() error { _, err := r.Run(ctx, RunOptions{}); return err },
				"RunSample": func() error { _, err := r.Run(ctx, RunOptions{Sample: 5}); return err },
				"CheckKeys": func() error { _, err := r.CheckKeys(ctx, []string{"k"}, RunOptions{}); return err },
				"Rebuild":   func() error { _, err := r.Rebuild(ctx); return err },
			} {
				var cfgErr *ConfigError
				require.ErrorAs(t, call(), &cfgErr, method)
				require.Equal(t, "Reconciler", cfgErr.Field, method)
				require.Contains(t, cfgErr.Reason, "create it with New", method)
			}
		})
	}
	for name, s := range map[string]*SQLSource{"Zero": {}, "Nil": nil} {
		t.Run("SQLSource"+name, func(t *testing.T) {
			t.Parallel()
			for method, call := range map[string]func() error{
				"Page":   func() error { _, err := s.Page(ctx, Cursor{}, 10); return err },
				"Lookup": func() error { _, err := s.Lookup(ctx, []string{"k"}); return err },
				"Sample": func() error { _, err := s.Sample(ctx, 10); return err },
			} {
				var cfgErr *ConfigError
				require.ErrorAs(t, call(), &cfgErr, method)
				require.Equal(t, "SQLSource", cfgErr.Field, method)
				require.Contains(t, cfgErr.Reason, "create it with NewSQLSource", method)
			}
		})
	}
}

// TestLookupOfARowThatFailsIsNotAnOrphan: a row the source cannot
// evaluate (here a view whose value divides by zero for it) fails its
// lookup with a data exception, as a key the key column cannot hold does.
// Lookup used to take it for such a key and leave it out, so that the
// reconciler classified the row's projection entry as an orphan and, under
// an ActionRepair policy, deleted it. The row exists: Lookup fails, and so
// does the check, with the entry left as it was.
func TestLookupOfARowThatFailsIsNotAnOrphan(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, projection.KindSortedSet)
	_, err := b.pool.Exec(ctx, `ALTER TABLE items ADD COLUMN divisor bigint NOT NULL DEFAULT 1;
		CREATE VIEW items_by_divisor AS SELECT key, board, version, score / divisor AS score FROM items`)
	require.NoError(t, err)
	src, err := NewSQLSource(b.pool, &SQLSourceConfig{Table: "items_by_divisor", KeyColumn: "key", VersionColumn: "version",
		ValueColumn: "score", Kind: projection.KindSortedSet, Filters: []Filter{{Column: "board", Value: testBoard}}})
	require.NoError(t, err)
	b.source = src
	b.insert(t, "alice", 3)
	b.insert(t, "bob", 1)
	b.project(t, "alice", 3)
	before := b.state(t, b.reconciler(t, nil), "alice")
	require.True(t, before.HasValue)
	_, err = b.pool.Exec(ctx, `UPDATE items SET divisor = 0 WHERE key = 'alice'`)
	require.NoError(t, err)

	_, err = src.Lookup(ctx, []string{"bob", "alice", "carol"})
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "22012", pgErr.Code, "division_by_zero")

	r := b.reconciler(t, &Config{Policy: Policy{Orphan: ActionRepair}})
	_, err = r.CheckKeys(ctx, []string{"alice"}, RunOptions{})
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, before, b.state(t, r, "alice"), "the entry of a row that exists is kept")
}

// TestSQLSourceUnderEveryExecMode reads through pools set to each of pgx's
// statement modes: behind a transaction-pooling proxy the simple protocol
// writes every argument in as an untyped literal, so the lookup's key array
// must get its type from the statement itself.
func TestSQLSourceUnderEveryExecMode(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeExec, pgx.QueryExecModeDescribeExec, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			pg := testenv.Postgres(t)
			_, err := pg.Pool.Exec(ctx, `CREATE TABLE "Scores Tbl" ("User Id" bigint PRIMARY KEY, "Ver" bigint NOT NULL, "Pts" bigint NOT NULL);
				INSERT INTO "Scores Tbl" SELECT g, 1, g * 3 FROM generate_series(1, 25) g;
				CREATE TABLE "Docs" (k text PRIMARY KEY, v bigint NOT NULL, d bytea NOT NULL);
				INSERT INTO "Docs" VALUES ('a', 1, '\x00ff'), ('b', 2, '');
				CREATE TABLE sessions (k text PRIMARY KEY, v int NOT NULL, id uuid NOT NULL, at time NOT NULL, doc jsonb NOT NULL);
				INSERT INTO sessions VALUES ('s', 7, 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '10:00', '{"b": 1, "a": [2]}')`)
			require.NoError(t, err)
			pcfg, err := pgxpool.ParseConfig(pg.ConnString)
			require.NoError(t, err)
			pcfg.ConnConfig.DefaultQueryExecMode = mode
			pool, err := pgxpool.NewWithConfig(ctx, pcfg)
			require.NoError(t, err)
			defer pool.Close()

			scores, err := NewSQLSource(pool, &SQLSourceConfig{Schema: pg.Schema, Table: "Scores Tbl", KeyColumn: "User Id", VersionColumn: "Ver", ValueColumn: "Pts", Kind: projection.KindSortedSet})
			require.NoError(t, err)
			page, err := scores.Page(ctx, After("9"), 2)
			require.NoError(t, err)
			require.Equal(t, []Row{{Key: "10", Version: 1, Value: projection.Value{Score: 30}}, {Key: "11", Version: 1, Value: projection.Value{Score: 33}}}, page)
			found, err := scores.Lookup(ctx, []string{"3", "30"})
			require.NoError(t, err, "Lookup on a bigint key")
			require.Equal(t, []Row{{Key: "3", Version: 1, Value: projection.Value{Score: 9}}}, found)
			found, err = scores.Lookup(ctx, []string{"abc", "3"})
			require.NoError(t, err, "Lookup of a key a bigint cannot hold")
			require.Equal(t, []Row{{Key: "3", Version: 1, Value: projection.Value{Score: 9}}}, found)

			docs, err := NewSQLSource(pool, &SQLSourceConfig{Schema: pg.Schema, Table: "Docs", KeyColumn: "k", VersionColumn: "v", ValueColumn: "d", Kind: projection.KindDocument})
			require.NoError(t, err)
			found, err = docs.Lookup(ctx, []string{"a", "zz"})
			require.NoError(t, err, "Lookup on a text key")
			require.Equal(t, []Row{{Key: "a", Version: 1, Value: projection.Value{Data: []byte{0, 0xff}}}}, found)

			// A value column of another type is read in its text form in
			// every mode: binary, a uuid scanned as its 16 raw bytes (and a
			// default Run overwrote a projection holding the text form
			// with them), a time in another form.
			for column, want := range map[string]string{"id": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "at": "10:00:00", "doc": `{"a": [2], "b": 1}`} {
				for _, kind := range []projection.Kind{projection.KindHash, projection.KindDocument} {
					src, err := NewSQLSource(pool, &SQLSourceConfig{Schema: pg.Schema, Table: "sessions", KeyColumn: "k", VersionColumn: "v", ValueColumn: column, Kind: kind})
					require.NoError(t, err)
					wantRows := []Row{{Key: "s", Version: 7, Value: projection.Value{Data: []byte(want)}}}
					page, err := src.Page(ctx, Cursor{}, 10)
					require.NoError(t, err)
					require.Equal(t, wantRows, page, "%s as %v", column, kind)
					found, err := src.Lookup(ctx, []string{"s"})
					require.NoError(t, err)
					require.Equal(t, wantRows, found, "%s as %v", column, kind)
					sampled, err := src.Sample(ctx, 5)
					require.NoError(t, err)
					require.Equal(t, wantRows, sampled, "%s as %v", column, kind)
				}
			}
		})
	}
}

// TestSQLSourceKeysNotUTF8: a SQL_ASCII database holds keys that are not
// UTF-8. Through pgx's default session there (client_encoding SQL_ASCII)
// they are walked, paged past and looked up like any other: the entry that
// matches its row is current, not an orphan (an orphan repair policy used
// to delete it on every run). A session declaring client_encoding UTF8
// can neither read them (PostgreSQL refuses to send the row: 22021) nor
// send them back: a lookup of one is refused with an *InvalidRowError.
// Either way nothing is written.
func TestSQLSourceKeysNotUTF8(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testenv.Postgres(t)
	db := "verity_ascii_" + strings.ToLower(strings.NewReplacer("-", "_", ".", "_").Replace(pg.Schema))
	_, err := pg.Pool.Exec(ctx, `CREATE DATABASE `+pgx.Identifier{db}.Sanitize()+` ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0`)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, err := pg.Pool.Exec(context.Background(), `DROP DATABASE `+pgx.Identifier{db}.Sanitize()+` WITH (FORCE)`)
		require.NoError(t, err)
	})
	newPool := func(t *testing.T, clientEncoding string) *pgxpool.Pool {
		t.Helper()
		cfg, err := pgxpool.ParseConfig(pg.ServerURL)
		require.NoError(t, err)
		cfg.ConnConfig.Database = db
		if clientEncoding != "" {
			cfg.ConnConfig.RuntimeParams["client_encoding"] = clientEncoding
		}
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		return pool
	}
	_, err = newPool(t, "").Exec(ctx, `CREATE TABLE t (k text PRIMARY KEY, v bigint NOT NULL, p bigint NOT NULL);
		INSERT INTO t VALUES ('apple', 1, 4), (E'caf\xe9', 1, 5), ('plain', 1, 6)`)
	require.NoError(t, err)
	allRepair := Policy{Missing: ActionRepair, Stale: ActionRepair, Corrupt: ActionRepair, Ahead: ActionRepair, Orphan: ActionRepair}

	for name, tc := range map[string]struct {
		clientEncoding string
		sendable       bool
	}{
		"DefaultSession": {sendable: true},
		"UTF8Session":    {clientEncoding: "UTF8"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			rd := testenv.Redis(t)
			ks, err := projection.NewKeyspace(rd.Prefix)
			require.NoError(t, err)
			target := Target{Client: rd.Client, Keyspace: ks, Kind: projection.KindSortedSet, Name: "b"}
			var writes []projection.Write
			for k, score := range map[string]int64{"apple": 4, "caf\xe9": 5, "plain": 6, "gone": 7} {
				writes = append(writes, projection.Write{Target: target.target(k), Version: 1, Value: projection.Value{Score: score}})
			}
			_, err = projection.NewGate(rd.Client, ks).Apply(ctx, writes)
			require.NoError(t, err)
			src, err := NewSQLSource(newPool(t, tc.clientEncoding), &SQLSourceConfig{Table: "t", KeyColumn: "k", VersionColumn: "v", ValueColumn: "p", Kind: projection.KindSortedSet})
			require.NoError(t, err)
			// Pages of one row: the key is the second page's cursor.
			r, err := New(src, target, &Config{PageSize: 1, Policy: allRepair})
			require.NoError(t, err)
			members := func() []string {
				t.Helper()
				got, err := rd.Client.ZRange(ctx, ks.ValueKey(target.target("")), 0, -1).Result()
				require.NoError(t, err)
				return got
			}

			rep, err := r.Run(ctx, RunOptions{})
			if tc.sendable {
				require.NoError(t, err)
				require.Equal(t, map[Class]int64{ClassCurrent: 3, ClassOrphan: 1}, rep.Counts)
				require.ElementsMatch(t, []string{"apple", "caf\xe9", "plain"}, members(), "only the true orphan removed")
				rep, err = r.CheckKeys(ctx, []string{"caf\xe9", "nul\x00"}, RunOptions{DryRun: true})
				require.NoError(t, err)
				require.Equal(t, map[Class]int64{ClassCurrent: 1}, rep.Counts, "a key with a NUL byte is in no database: not projected, not an orphan")
				return
			}
			// PostgreSQL itself refuses to send the row to such a session.
			var pgErr *pgconn.PgError
			require.ErrorAs(t, err, &pgErr)
			require.Equal(t, "22021", pgErr.Code)
			require.Len(t, members(), 4, "nothing removed")
			_, err = r.CheckKeys(ctx, []string{"caf\xe9"}, RunOptions{})
			var invalid *InvalidRowError
			require.ErrorAs(t, err, &invalid)
			require.Equal(t, "caf\xe9", invalid.Key)
			require.Contains(t, invalid.Reason, "client_encoding UTF8")
			require.Contains(t, members(), "caf\xe9", "nothing removed")
		})
	}
}

// TestPolicyRefusesTheFirstInvalidAction: every Policy field refuses the
// first value past ActionRepair, not only far-off ones: Action(3) would
// otherwise resolve to itself, neither report nor repair, and be taken for
// ActionReport silently.
func TestPolicyRefusesTheFirstInvalidAction(t *testing.T) {
	t.Parallel()
	rd := testenv.Redis(t)
	ks, err := projection.NewKeyspace(rd.Prefix)
	require.NoError(t, err)
	target := Target{Client: rd.Client, Keyspace: ks, Kind: projection.KindSortedSet, Name: "b"}
	bad := ActionRepair + 1
	for field, p := range map[string]Policy{
		"Missing": {Missing: bad}, "Stale": {Stale: bad}, "Corrupt": {Corrupt: bad},
		"Ahead": {Ahead: bad}, "Orphan": {Orphan: bad},
	} {
		_, err := New(&SQLSource{}, target, &Config{Policy: p})
		var cfgErr *ConfigError
		require.ErrorAs(t, err, &cfgErr, field)
		require.Equal(t, "Config.Policy."+field, cfgErr.Field)
	}
}
