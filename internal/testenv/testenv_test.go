package testenv_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

func TestPostgresIsolation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	a, b := testenv.Postgres(t), testenv.Postgres(t)
	require.NotEqual(t, a.Schema, b.Schema)

	_, err := a.Pool.Exec(ctx, `CREATE TABLE "t" ("v" int)`)
	require.NoError(t, err)
	_, err = a.Pool.Exec(ctx, `INSERT INTO "t" VALUES (1)`)
	require.NoError(t, err)

	// The same unqualified name in the other schema does not exist.
	_, err = b.Pool.Exec(ctx, `SELECT * FROM "t"`)
	require.ErrorContains(t, err, "does not exist")

	// ConnString carries the search_path too.
	conn, err := pgx.Connect(ctx, a.ConnString)
	require.NoError(t, err)
	defer conn.Close(ctx)
	var v int
	require.NoError(t, conn.QueryRow(ctx, `SELECT "v" FROM "t"`).Scan(&v))
	require.Equal(t, 1, v)
}

func TestRedisPrefixCleanup(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	var prefix string
	var url string
	t.Run("Inner", func(t *testing.T) {
		rd := testenv.Redis(t)
		prefix, url = rd.Prefix, rd.URL
		require.False(t, strings.ContainsAny(rd.Prefix, "{}*?[]"))
		for _, k := range []string{"a", "{tag}:b", "c"} {
			require.NoError(t, rd.Client.Set(ctx, rd.Prefix+k, "1", 0).Err())
		}
	})
	// After the subtest's cleanup, nothing under its prefix is left.
	rd := testenv.Redis(t)
	require.Equal(t, url, rd.URL)
	keys, _, err := rd.Client.Scan(ctx, 0, prefix+"*", 1000).Result()
	require.NoError(t, err)
	require.Empty(t, keys)
}

func TestStartPostgresKillRestart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	srv := testenv.StartPostgres(t)
	conn, err := pgx.Connect(ctx, srv.ConnString())
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `CREATE TABLE "kept" ("v" int); INSERT INTO "kept" VALUES (7)`)
	require.NoError(t, err)

	require.NoError(t, srv.Kill())
	require.Error(t, conn.Ping(ctx), "a killed server must not answer")
	conn.Close(ctx)

	require.NoError(t, srv.Start())
	conn, err = pgx.Connect(ctx, srv.ConnString())
	require.NoError(t, err)
	defer conn.Close(ctx)
	var v int
	require.NoError(t, conn.QueryRow(ctx, `SELECT "v" FROM "kept"`).Scan(&v))
	require.Equal(t, 7, v, "a committed row survives kill -9")

	require.NoError(t, srv.Stop())
	require.NoError(t, srv.Start())

	// Backends live in sessions of their own (PostgreSQL calls setsid), so a
	// restart right after kill -9 only works if Kill reaped them too.
	for i := range 5 {
		require.NoError(t, srv.Kill())
		require.NoError(t, srv.Start(), "restart %d right after kill -9", i)
	}
}

func TestStartRedisKillRestart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	srv := testenv.StartRedis(t)
	c := srv.Client(t)
	require.NoError(t, c.Set(ctx, "k", "v", 0).Err())

	require.NoError(t, srv.Kill())
	require.Error(t, c.Ping(ctx).Err())

	require.NoError(t, srv.Start())
	require.NoError(t, c.Ping(ctx).Err())
	n, err := c.Exists(ctx, "k").Result()
	require.NoError(t, err)
	require.Zero(t, n, "no persistence: a restarted server is empty")
}
