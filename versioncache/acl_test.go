package versioncache

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// TestPeekWithReadOnlyKeyPermission runs Peek, Check and CheckAt as Redis
// ACL users with read permission only on the cache's keys (%R~prefix*), one
// allowed every command and one only the commands README ("Redis
// permissions") lists for them: Peek's read script goes as EVALSHA_RO
// (EVAL_RO after NOSCRIPT), which Redis checks for reading only, where
// EVALSHA and EVAL count as writes to every key they name.
func TestPeekWithReadOnlyKeyPermission(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.StartRedis(t)
	admin := srv.Client(t)
	cfg := &Config{Prefix: "acl:", FailureMode: FailClosed}
	writer, err := New[string](admin, cfg)
	require.NoError(t, err)
	_, err = writer.Get(ctx, "cached", func(context.Context) (string, error) { return "v", nil })
	require.NoError(t, err)
	_, err = writer.Get(ctx, "invalidated", func(context.Context) (string, error) { return "old", nil })
	require.NoError(t, err)
	require.NoError(t, writer.Invalidate(ctx, "invalidated"))
	_, at, ok, err := writer.Peek(ctx, "invalidated")
	require.NoError(t, err)
	require.False(t, ok)
	_, err = writer.GetAt(ctx, "at", 3, func(context.Context) (string, error) { return "v3", nil })
	require.NoError(t, err)

	for _, user := range []struct {
		name  string
		rules []string
	}{
		// Any command, read permission on the keys: EVALSHA would be
		// refused the keys.
		{"AllCommands", []string{"+@all"}},
		// Exactly the commands README lists for Peek, Check and CheckAt.
		{"ListedCommands", []string{"-@all", "+evalsha_ro", "+eval_ro", "+get"}},
	} {
		// Not parallel: SCRIPT FLUSH is server-wide.
		t.Run(user.name, func(t *testing.T) {
			acl := []any{"ACL", "SETUSER", user.name, "reset", "on", ">pw", "%R~acl:*"}
			for _, r := range user.rules {
				acl = append(acl, r)
			}
			require.NoError(t, admin.Do(ctx, acl...).Err())
			require.NoError(t, admin.ScriptFlush(ctx).Err(), "the first Peek falls back to EVAL_RO")
			ro := redis.NewClient(&redis.Options{Addr: srv.Addr(), Username: user.name, Password: "pw"})
			t.Cleanup(func() { _ = ro.Close() })
			reader, err := New[string](ro, cfg)
			require.NoError(t, err)

			v, _, ok, err := reader.Peek(ctx, "cached")
			require.NoError(t, err, "Peek")
			require.True(t, ok)
			require.Equal(t, "v", v)
			_, version, ok, err := reader.Peek(ctx, "invalidated")
			require.NoError(t, err)
			require.False(t, ok)
			require.Equal(t, at, version, "the version, as the writer peeked it")
			_, version, ok, err = reader.Peek(ctx, "never")
			require.NoError(t, err)
			require.False(t, ok)
			require.Zero(t, version)

			report, err := reader.Check(ctx, []string{"cached", "invalidated", "never"}, 0,
				func(context.Context, string) (string, error) { return "v", nil })
			require.NoError(t, err, "Check")
			require.Equal(t, 1, report.Cached)
			require.Equal(t, 2, report.NotCached)
			require.Zero(t, report.Divergent)
			report, err = reader.CheckAt(ctx, []string{"at"}, 0,
				func(context.Context, string) (string, int64, error) { return "v3", 3, nil })
			require.NoError(t, err, "CheckAt")
			require.Equal(t, 1, report.Cached)
			require.Zero(t, reader.Stats().RedisErrors)
		})
	}
	for _, name := range []string{"evalsha_ro", "eval_ro"} {
		require.Positive(t, testenv.CommandCalls(t, admin, name), name)
	}
}

// TestClusterPeekWithReadOnlyKeyPermission is
// TestPeekWithReadOnlyKeyPermission through a cluster client that reads
// from replicas: Peek's script is pinned to the id's master there, and
// still goes as EVALSHA_RO, which a user with read permission only on the
// keys may run.
func TestClusterPeekWithReadOnlyKeyPermission(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 0)
	prefix := cluster.Prefix(t)
	writer, err := New[string](cluster.Client(t), &Config{Prefix: prefix})
	require.NoError(t, err)
	ids := []string{"a", "b", "c", "d", "e", "f"} // over more than one master
	for _, id := range ids {
		_, err := writer.Get(ctx, id, func(context.Context) (string, error) { return "v-" + id, nil })
		require.NoError(t, err)
	}
	// ACL users are per node.
	for _, addr := range cluster.Addrs() {
		node := redis.NewClient(&redis.Options{Addr: addr})
		err := node.Do(ctx, "ACL", "SETUSER", "peeker", "reset", "on", ">pw", "%R~"+prefix+"*", "+@all").Err()
		_ = node.Close()
		require.NoError(t, err, addr)
	}
	ro := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs(), ReadOnly: true, Username: "peeker", Password: "pw"})
	t.Cleanup(func() { _ = ro.Close() })
	reader, err := New[string](ro, &Config{Prefix: prefix, FailureMode: FailClosed})
	require.NoError(t, err)
	require.NotNil(t, reader.primary, "Peek is pinned to the master")

	for _, id := range ids {
		v, _, ok, err := reader.Peek(ctx, id)
		require.NoError(t, err, "Peek %s", id)
		require.True(t, ok)
		require.Equal(t, "v-"+id, v)
	}
	report, err := reader.Check(ctx, ids, 0, func(_ context.Context, id string) (string, error) { return "v-" + id, nil })
	require.NoError(t, err, "Check")
	require.Equal(t, len(ids), report.Cached)
	require.Zero(t, reader.Stats().RedisErrors)
}
