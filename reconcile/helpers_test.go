package reconcile

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/projection"
)

// testBundle is one test's source table and projection.
type testBundle struct {
	pool   *pgxpool.Pool
	client redis.UniversalClient
	ks     projection.Keyspace
	gate   *projection.Gate
	source *SQLSource
	target Target
	kind   projection.Kind
}

const testBoard = "weekly"

// setup creates a source table "items" (key text, board text, version
// bigint, score bigint, data bytea) in a fresh schema and a projection
// under a fresh key prefix on the shared single-node Redis.
//
// Documents get a private Redis server: their orphan scan SCANs the whole
// keyspace, and the shared server holds every other test's keys.
func setup(t testing.TB, kind projection.Kind) *testBundle {
	t.Helper()
	if kind == projection.KindDocument {
		rs := testenv.StartRedis(t)
		return setupWith(t, kind, rs.Client(t), "doc:")
	}
	rd := testenv.Redis(t)
	return setupWith(t, kind, rd.Client, rd.Prefix)
}

func setupWith(t testing.TB, kind projection.Kind, client redis.UniversalClient, prefix string) *testBundle {
	t.Helper()
	pg := testenv.Postgres(t)
	_, err := pg.Pool.Exec(context.Background(), `CREATE TABLE items (
		key text NOT NULL,
		board text NOT NULL,
		version bigint,
		score bigint,
		data bytea,
		PRIMARY KEY (board, key)
	)`)
	require.NoError(t, err)
	ks, err := projection.NewKeyspace(prefix)
	require.NoError(t, err)
	valueColumn := "data"
	if kind == projection.KindSortedSet {
		valueColumn = "score"
	}
	src, err := NewSQLSource(pg.Pool, &SQLSourceConfig{
		Table: "items", KeyColumn: "key", VersionColumn: "version", ValueColumn: valueColumn,
		Kind: kind, Filters: []Filter{{Column: "board", Value: testBoard}},
	})
	require.NoError(t, err)
	name := testBoard
	if kind == projection.KindDocument {
		name = ""
	}
	return &testBundle{
		pool: pg.Pool, client: client, ks: ks, gate: projection.NewGate(client, ks), source: src,
		target: Target{Client: client, Keyspace: ks, Kind: kind, Name: name}, kind: kind,
	}
}

func (b *testBundle) reconciler(t testing.TB, cfg *Config) *Reconciler {
	t.Helper()
	r, err := New(b.source, b.target, cfg)
	require.NoError(t, err)
	return r
}

// value is the deterministic value of key at version.
func (b *testBundle) value(key string, version int64) projection.Value {
	if b.kind == projection.KindSortedSet {
		return projection.Value{Score: version*10 + int64(len(key))}
	}
	return projection.Value{Data: []byte(fmt.Sprintf("%s@%d", key, version))}
}

// insert puts key at version into the source.
func (b *testBundle) insert(t testing.TB, key string, version int64) Row {
	t.Helper()
	v := b.value(key, version)
	var score any
	var data any
	if b.kind == projection.KindSortedSet {
		score = v.Score
	} else {
		data = v.Data
	}
	_, err := b.pool.Exec(context.Background(), `INSERT INTO items (key, board, version, score, data) VALUES ($1, $2, $3, $4, $5)
		ON CONFLICT (board, key) DO UPDATE SET version = EXCLUDED.version, score = EXCLUDED.score, data = EXCLUDED.data`,
		key, testBoard, version, score, data)
	require.NoError(t, err)
	return Row{Key: key, Version: version, Value: v}
}

// insertMany inserts keys k00000.. at version 1 with one COPY.
func (b *testBundle) insertMany(t testing.TB, n int) []Row {
	t.Helper()
	rows := make([]Row, n)
	data := make([][]any, n)
	for i := range n {
		key := fmt.Sprintf("k%07d", i)
		v := b.value(key, 1)
		rows[i] = Row{Key: key, Version: 1, Value: v}
		if b.kind == projection.KindSortedSet {
			data[i] = []any{key, testBoard, int64(1), v.Score, nil}
		} else {
			data[i] = []any{key, testBoard, int64(1), nil, v.Data}
		}
	}
	_, err := b.pool.CopyFrom(context.Background(), pgx.Identifier{"items"},
		[]string{"key", "board", "version", "score", "data"}, pgx.CopyFromRows(data))
	require.NoError(t, err)
	return rows
}

// project writes key at version through the gate, as the projector would.
func (b *testBundle) project(t testing.TB, key string, version int64) projection.Outcome {
	t.Helper()
	out, err := b.gate.Apply(context.Background(), []projection.Write{{
		Target: b.target.target(key), Version: version, Value: b.value(key, version),
	}})
	require.NoError(t, err)
	return out[0]
}

// projectRows gates rows into the projection in batches.
func (b *testBundle) projectRows(t testing.TB, rows []Row) {
	t.Helper()
	for len(rows) > 0 {
		n := min(len(rows), 1000)
		writes := make([]projection.Write, n)
		for i, r := range rows[:n] {
			writes[i] = projection.Write{Target: b.target.target(r.Key), Version: r.Version, Value: r.Value}
		}
		_, err := b.gate.Apply(context.Background(), writes)
		require.NoError(t, err)
		rows = rows[n:]
	}
}

// state reads one entry as Run would.
func (b *testBundle) state(t testing.TB, r *Reconciler, key string) Projected {
	t.Helper()
	p, err := r.read(context.Background(), []string{key})
	require.NoError(t, err)
	return p[0]
}

// setRaw overwrites an entry's value and/or version behind the gate's back
// (nil leaves it; "" for version deletes it).
func (b *testBundle) setRaw(t testing.TB, key string, value *projection.Value, version *string) {
	t.Helper()
	ctx := context.Background()
	tg := b.target.target(key)
	vk, verk := b.ks.ValueKey(tg), b.ks.VersionKey(tg)
	if value != nil {
		switch b.kind {
		case projection.KindSortedSet:
			require.NoError(t, b.client.ZAdd(ctx, vk, redis.Z{Score: float64(value.Score), Member: key}).Err())
		case projection.KindHash:
			require.NoError(t, b.client.HSet(ctx, vk, key, value.Data).Err())
		default:
			require.NoError(t, b.client.Set(ctx, vk, value.Data, 0).Err())
		}
	}
	if version != nil {
		switch {
		case b.kind == projection.KindDocument && *version == "":
			require.NoError(t, b.client.Del(ctx, verk).Err())
		case b.kind == projection.KindDocument:
			require.NoError(t, b.client.Set(ctx, verk, *version, 0).Err())
		case *version == "":
			require.NoError(t, b.client.HDel(ctx, verk, key).Err())
		default:
			require.NoError(t, b.client.HSet(ctx, verk, key, *version).Err())
		}
	}
}

func ptr[T any](v T) *T { return &v }

// forKinds runs test as a parallel subtest, named by kind, for each of
// kinds, each with a bundle of its own.
func forKinds(t *testing.T, kinds []projection.Kind, test func(t *testing.T, b *testBundle)) {
	t.Helper()
	for _, kind := range kinds {
		t.Run(kindName(kind), func(t *testing.T) {
			t.Parallel()
			test(t, setup(t, kind))
		})
	}
}
