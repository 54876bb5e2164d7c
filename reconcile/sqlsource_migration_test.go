package reconcile

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/projection"
)

// Migrations between two passes of a long-lived SQLSource, through pgx's
// default exec mode, which prepares each statement once per connection and
// caches it by its text (PostgreSQL keeps the parameter and result types
// it inferred then): every statement names the relation's column types in
// a comment, so a migration gets new ones.

// A migration of a filter column (bigint to text), through pgx's default
// exec mode: the walk's statements keep their text, so each connection's
// prepared statement keeps $1 as bigint.
func TestSQLSourceFilterColumnTypeChanged(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupKeyText(t, "bigint", "g", 8, nil)
	pool := b.src.db.(*pgxpool.Pool)
	_, err := pool.Exec(ctx, `ALTER TABLE ev ADD COLUMN tenant bigint NOT NULL DEFAULT 7`)
	require.NoError(t, err)
	src, err := NewSQLSource(pool, &SQLSourceConfig{Table: "ev", KeyColumn: "k", VersionColumn: "v", ValueColumn: "s",
		Kind: projection.KindSortedSet, Filters: []Filter{{Column: "tenant", Value: "7"}}})
	require.NoError(t, err)
	r, err := New(src, b.target, &Config{PageSize: 3})
	require.NoError(t, err)
	runPasses(t, r, 3, 8, "before the migration")
	_, err = pool.Exec(ctx, `ALTER TABLE ev ALTER COLUMN tenant TYPE text USING tenant::text`)
	require.NoError(t, err)
	runPasses(t, r, 3, 8, "after the migration")
}

// A migration of the version column (integer to bigint): same key type.
func TestSQLSourceVersionColumnTypeChanged(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupKeyText(t, "bigint", "g", 8, nil)
	pool := b.src.db.(*pgxpool.Pool)
	var r *Reconciler
	_, err := pool.Exec(ctx, `ALTER TABLE ev ALTER COLUMN v TYPE integer`)
	require.NoError(t, err)
	r, err = New(b.src, b.target, &Config{PageSize: 3})
	require.NoError(t, err)
	runPasses(t, r, 3, 8, "before the migration")
	_, err = pool.Exec(ctx, `ALTER TABLE ev ALTER COLUMN v TYPE bigint`)
	require.NoError(t, err)
	runPasses(t, r, 3, 8, "after the migration")
}

// CheckKeys (lookups) after a migration of the version column.
func TestSQLSourceVersionColumnTypeChangedLookup(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupKeyText(t, "bigint", "g", 8, nil)
	pool := b.src.db.(*pgxpool.Pool)
	r, err := New(b.src, b.target, &Config{PageSize: 3})
	require.NoError(t, err)
	for range 3 {
		_, err := r.CheckKeys(ctx, []string{"1", "2"}, RunOptions{})
		require.NoError(t, err)
	}
	_, err = pool.Exec(ctx, `ALTER TABLE ev ALTER COLUMN v TYPE numeric`)
	require.NoError(t, err)
	for i := range 3 {
		rep, err := r.CheckKeys(ctx, []string{"1", "2"}, RunOptions{})
		require.NoError(t, err, "check %d after the migration", i)
		require.EqualValues(t, 2, rep.Checked)
	}
}

// Key column migrations through pgx's default exec mode, each followed by
// passes and key checks on every connection.
func TestSQLSourceKeyTypeMigrations(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cases := []struct{ name, typ, gen, alter string }{
		{"TextToBigint", "text", "g::text", `ALTER TABLE ev ALTER COLUMN k TYPE bigint USING k::bigint`},
		{"BigintToNumeric", "bigint", "g", `ALTER TABLE ev ALTER COLUMN k TYPE numeric USING k::numeric`},
		{"IntToBigint", "int", "g", `ALTER TABLE ev ALTER COLUMN k TYPE bigint`},
		{"Varchar5To10", "varchar(5)", "g::text", `ALTER TABLE ev ALTER COLUMN k TYPE varchar(10)`},
		{"TextToDomainBigint", "text", "g::text", `CREATE DOMAIN pk AS bigint; ALTER TABLE ev ALTER COLUMN k TYPE pk USING k::bigint`},
		{"DropCreateAsText", "bigint", "g", `DROP TABLE ev; CREATE TABLE ev (k text PRIMARY KEY, v bigint NOT NULL, s bigint NOT NULL);
			INSERT INTO ev SELECT g::text, 1, g FROM generate_series(1, 8) AS g`},
		{"ViewRedefined", "bigint", "g", `ALTER TABLE ev RENAME TO ev_t; CREATE VIEW ev AS SELECT k::text AS k, v, s FROM ev_t`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			b := setupKeyText(t, c.typ, c.gen, 8, nil)
			pool := b.src.db.(*pgxpool.Pool)
			r, err := New(b.src, b.target, &Config{PageSize: 3, Policy: Policy{Orphan: ActionRepair}})
			require.NoError(t, err)
			warmStatements(t, r, "1", "2")
			for range 3 {
				_, err = b.src.Sample(ctx, 3)
				require.NoError(t, err)
			}
			_, err = pool.Exec(ctx, c.alter)
			require.NoError(t, err)
			for i := range 3 {
				rep, err := r.CheckKeys(ctx, []string{"1", "2"}, RunOptions{})
				require.NoError(t, err, "check %d", i)
				require.EqualValues(t, 2, rep.Counts[ClassCurrent], "%v", rep.Counts)
				rep, err = r.Run(ctx, RunOptions{})
				require.NoError(t, err, "pass %d", i)
				require.EqualValues(t, 8, rep.Checked)
				require.Len(t, b.members(t), 8)
			}
		})
	}
}

// A correct member after the key column became text by DROP+CREATE (or a
// view redefined), through pgx's default exec mode, with an orphan repair
// policy: CheckKeys must not delete it.
func TestSQLSourceLookupAfterKeyTypeChanged(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, alter := range map[string]string{
		"DropCreate": `DROP TABLE ev; CREATE TABLE ev (k text PRIMARY KEY, v bigint NOT NULL, s bigint NOT NULL);
			INSERT INTO ev SELECT 'user:' || g, 1, g FROM generate_series(1, 8) AS g`,
		"View":  `ALTER TABLE ev RENAME TO ev_t; CREATE VIEW ev AS SELECT 'user:' || k AS k, v, s FROM ev_t`,
		"Alter": `ALTER TABLE ev ALTER COLUMN k TYPE text USING 'user:' || k`,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setupKeyText(t, "bigint", "g", 8, nil)
			pool := b.src.db.(*pgxpool.Pool)
			r, err := New(b.src, b.target, &Config{PageSize: 3, Policy: Policy{Orphan: ActionRepair}})
			require.NoError(t, err)
			for range 3 {
				_, err := r.CheckKeys(ctx, []string{"1", "2"}, RunOptions{})
				require.NoError(t, err)
			}
			_, err = pool.Exec(ctx, alter)
			require.NoError(t, err)
			_, err = projection.NewGate(b.target.Client, b.target.Keyspace).Apply(ctx,
				[]projection.Write{{Target: b.target.target("user:1"), Version: 1, Value: projection.Value{Score: 1}}})
			require.NoError(t, err)
			for i := range 3 {
				rep, err := r.CheckKeys(ctx, []string{"user:1"}, RunOptions{})
				t.Logf("check %d: counts %v repaired %d err %v", i, rep.Counts, rep.Repaired, err)
				require.Contains(t, b.members(t), "user:1", "check %d deleted a correct entry", i)
			}
		})
	}
}

// A full pass after a key column migration (text to bigint, a view
// redefined), through pgx's default exec mode, with an orphan entry in
// the projection: its first page reads the new type, and its orphan
// lookups must work too.
func TestSQLSourcePassLookupsAfterKeyTypeChanged(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, c := range map[string]struct{ typ, gen, alter string }{
		"TextToBigint":  {"text", "g::text", `ALTER TABLE ev ALTER COLUMN k TYPE bigint USING k::bigint`},
		"ViewRedefined": {"bigint", "g", `ALTER TABLE ev RENAME TO ev_t; CREATE VIEW ev AS SELECT k::text AS k, v, s FROM ev_t`},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setupKeyText(t, c.typ, c.gen, 8, nil)
			pool := b.src.db.(*pgxpool.Pool)
			_, err := projection.NewGate(b.target.Client, b.target.Keyspace).Apply(ctx,
				[]projection.Write{{Target: b.target.target("99"), Version: 1, Value: projection.Value{Score: 1}}})
			require.NoError(t, err)
			r, err := New(b.src, b.target, &Config{PageSize: 3})
			require.NoError(t, err)
			for range 3 {
				rep, err := r.Run(ctx, RunOptions{})
				require.NoError(t, err)
				require.EqualValues(t, 1, rep.Counts[ClassOrphan])
			}
			_, err = pool.Exec(ctx, c.alter)
			require.NoError(t, err)
			for i := range 3 {
				rep, err := r.Run(ctx, RunOptions{})
				require.NoError(t, err, "pass %d after the migration", i)
				require.EqualValues(t, 1, rep.Counts[ClassOrphan])
				require.EqualValues(t, 8, rep.Counts[ClassCurrent])
			}
		})
	}
}

// A migration that changes a column's type modifier only (a KindHash value
// column widened from varchar(10) to varchar(20)) keeps every column's type
// oid, and so does a change of its collation: the comment names each
// column's type modifier and collation too, or pgx's cached statements
// fail the next pass with "cached plan must not change result type".
func TestSQLSourceColumnTypmodOrCollationChanged(t *testing.T) {
	t.Parallel()
	for name, alter := range map[string]string{
		"Typmod":    `ALTER TABLE ev ALTER COLUMN s TYPE varchar(20)`,
		"Collation": `ALTER TABLE ev ALTER COLUMN s TYPE varchar(10) COLLATE "C"`,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			typmodMigration(t, alter)
		})
	}
}

func typmodMigration(t *testing.T, alter string) {
	ctx := context.Background()
	pg := testenv.Postgres(t)
	rd := testenv.Redis(t)
	_, err := pg.Pool.Exec(ctx, `CREATE TABLE ev (k bigint PRIMARY KEY, v bigint NOT NULL, s varchar(10) NOT NULL);
		INSERT INTO ev SELECT g, 1, 'x' || g FROM generate_series(1, 8) AS g`)
	require.NoError(t, err)
	ks, err := projection.NewKeyspace(rd.Prefix)
	require.NoError(t, err)
	target := Target{Client: rd.Client, Keyspace: ks, Kind: projection.KindHash, Name: "b"}
	src, err := NewSQLSource(pg.Pool, &SQLSourceConfig{Table: "ev", KeyColumn: "k", VersionColumn: "v", ValueColumn: "s", Kind: projection.KindHash})
	require.NoError(t, err)
	r, err := New(src, target, &Config{PageSize: 3})
	require.NoError(t, err)
	runPasses(t, r, 3, 8, "before the migration")
	_, err = pg.Pool.Exec(ctx, alter)
	require.NoError(t, err)
	runPasses(t, r, 3, 8, "after the migration")
}

// A pass through a REPEATABLE READ pgx.Tx whose snapshot predates a
// migration, on a connection that cached the walk's statements: the
// catalog read, in that snapshot, names the old types, and the cached
// statements failed (0A000). A source over a pgx.Tx has statements of its
// own.
func TestSQLSourceOverTxSnapshotBeforeMigration(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testenv.Postgres(t)
	rd := testenv.Redis(t)
	_, err := pg.Pool.Exec(ctx, `CREATE TABLE ev (k bigint PRIMARY KEY, v bigint NOT NULL, s varchar(10) NOT NULL);
		INSERT INTO ev SELECT g, 1, 'x' || g FROM generate_series(1, 8) AS g`)
	require.NoError(t, err)
	cfg, err := pgxpool.ParseConfig(pg.ConnString)
	require.NoError(t, err)
	cfg.MaxConns = 1
	one, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(one.Close)

	ks, err := projection.NewKeyspace(rd.Prefix)
	require.NoError(t, err)
	target := Target{Client: rd.Client, Keyspace: ks, Kind: projection.KindHash, Name: "b"}
	scfg := &SQLSourceConfig{Table: "ev", KeyColumn: "k", VersionColumn: "v", ValueColumn: "s", Kind: projection.KindHash}
	src, err := NewSQLSource(one, scfg)
	require.NoError(t, err)
	r, err := New(src, target, &Config{PageSize: 3})
	require.NoError(t, err)
	for range 2 {
		rep, err := r.Run(ctx, RunOptions{})
		require.NoError(t, err)
		require.EqualValues(t, 8, rep.Checked)
	}

	tx, err := one.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	_, err = tx.Exec(ctx, `SELECT 1`) // the snapshot
	require.NoError(t, err)
	_, err = pg.Pool.Exec(ctx, `ALTER TABLE ev ALTER COLUMN s TYPE varchar(20)`)
	require.NoError(t, err)

	txsrc, err := NewSQLSource(tx, scfg)
	require.NoError(t, err)
	rt, err := New(txsrc, target, &Config{PageSize: 3})
	require.NoError(t, err)
	rep, err := rt.Run(ctx, RunOptions{DryRun: true})
	require.NoError(t, err, "pass through the transaction after the migration")
	require.EqualValues(t, 8, rep.Checked)
}

// runPasses runs n passes of r, each of which must check want rows.
func runPasses(t *testing.T, r *Reconciler, n int, want int64, when string) {
	t.Helper()
	for i := range n {
		rep, err := r.Run(context.Background(), RunOptions{})
		require.NoError(t, err, "pass %d %s", i, when)
		require.EqualValues(t, want, rep.Checked, "pass %d %s", i, when)
	}
}

// warmStatements runs three passes of r and three CheckKeys of keys, so
// that the pool's connections hold the source's prepared statements (pgx's
// default exec mode) before a migration.
func warmStatements(t *testing.T, r *Reconciler, keys ...string) {
	t.Helper()
	for range 3 {
		_, err := r.Run(context.Background(), RunOptions{})
		require.NoError(t, err)
		_, err = r.CheckKeys(context.Background(), keys, RunOptions{})
		require.NoError(t, err)
	}
}
