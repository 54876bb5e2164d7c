package services

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

// deadURLs point at a port nothing listens on, so "local" does not answer.
func deadURLs(t *testing.T) (pg, rd string) {
	t.Helper()
	port, err := FreePort()
	require.NoError(t, err)
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?connect_timeout=1", port),
		fmt.Sprintf("redis://127.0.0.1:%d/0", port)
}

// env is an environment holding only vars.
func env(vars map[string]string) func(string) string {
	return func(k string) string { return vars[k] }
}

func TestResolveOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("EnvWins", func(t *testing.T) {
		t.Parallel()
		rs, err := StartRedis(ctx, "")
		require.NoError(t, err)
		t.Cleanup(rs.Close)
		pg, _ := deadURLs(t)
		// Postgres falls through to a private server because local is dead.
		ep, err := Resolve(ctx, Options{
			Getenv:           env(map[string]string{"REDIS_URL": rs.URL()}),
			LocalPostgresURL: pg, LocalRedisURL: DefaultRedisURL,
		})
		require.NoError(t, err)
		t.Cleanup(ep.Close)
		require.Equal(t, OriginEnv, ep.RedisOrigin)
		require.Equal(t, rs.URL(), ep.RedisURL)
		require.Equal(t, OriginPrivate, ep.PostgresOrigin)
		require.NoError(t, pingPostgres(ctx, ep.PostgresURL))
	})

	t.Run("EnvSetButDeadIsAnError", func(t *testing.T) {
		_, rd := deadURLs(t)
		t.Parallel()
		_, err := Resolve(ctx, Options{Getenv: env(map[string]string{"REDIS_URL": rd})})
		require.ErrorContains(t, err, "REDIS_URL is set but does not answer")
	})

	t.Run("SkippedServersAreLeftOut", func(t *testing.T) {
		pg, rd := deadURLs(t)
		t.Parallel()
		// Both variables point at nothing and nothing answers locally:
		// only a server that is not skipped is looked for at all.
		dead := env(map[string]string{"DATABASE_URL": pg, "REDIS_URL": rd})
		ep, err := Resolve(ctx, Options{Getenv: dead, LocalPostgresURL: pg, LocalRedisURL: rd, SkipPostgres: true, SkipRedis: true})
		require.NoError(t, err)
		require.Equal(t, Endpoints{}, *ep)

		_, err = Resolve(ctx, Options{Getenv: dead, LocalPostgresURL: pg, LocalRedisURL: rd, SkipPostgres: true})
		require.ErrorContains(t, err, "REDIS_URL is set but does not answer")
		_, err = Resolve(ctx, Options{Getenv: dead, LocalPostgresURL: pg, LocalRedisURL: rd, SkipRedis: true})
		require.ErrorContains(t, err, "DATABASE_URL is set but does not answer")
	})

	t.Run("LocalThenPrivate", func(t *testing.T) {
		t.Parallel()
		pg, rd := deadURLs(t)
		ep, err := Resolve(ctx, Options{
			Getenv:           env(nil),
			LocalPostgresURL: pg, LocalRedisURL: rd,
		})
		require.NoError(t, err)
		require.Equal(t, OriginPrivate, ep.PostgresOrigin)
		require.Equal(t, OriginPrivate, ep.RedisOrigin)
		require.NoError(t, pingRedis(ctx, ep.RedisURL))
		ep.Close()
		require.Error(t, pingRedis(ctx, ep.RedisURL), "Close stops the private servers")
	})
}

func TestRedactURL(t *testing.T) {
	t.Parallel()
	require.Equal(t, "postgres://app:xxxxx@db:5432/x", redactURL("postgres://app:s3cret@db:5432/x"))
	require.Equal(t, "redis://127.0.0.1:6379/0", redactURL("redis://127.0.0.1:6379/0"))
}
