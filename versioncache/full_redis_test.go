package versioncache

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// TestFullRedis runs the cache against a private Redis with maxmemory-policy
// noeviction whose maxmemory is set just below its use, so that a plain SET
// is refused with OOM. Every cached value here has a live version key (the
// ids were cached, then invalidated), the case where a miss's script used
// to start with a write Redis allows when full (PEXPIRE) and then store its
// lease and the fill past the limit.
func TestFullRedis(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.StartRedis(t, "--maxmemory-policy", "noeviction")
	client := srv.Client(t)
	const ids = 100
	big := strings.Repeat("x", 10_000)
	load := func(context.Context) (string, error) { return big, nil }
	open := func(mode FailureMode) *Cache[string] {
		c, err := New[string](client, &Config{Prefix: "full:", FailureMode: mode})
		require.NoError(t, err)
		return c
	}
	cache := open(FailOpen)
	for i := range ids {
		_, err := cache.Get(ctx, strconv.Itoa(i), load)
		require.NoError(t, err)
		require.NoError(t, cache.Invalidate(ctx, strconv.Itoa(i)))
	}
	limit := testenv.FillRedis(t, client)

	t.Run("FailOpenServesUncached", func(t *testing.T) {
		before := cache.Stats().Fills
		for i := range ids {
			v, err := cache.Get(ctx, strconv.Itoa(i), load)
			require.NoError(t, err)
			require.Equal(t, big, v)
		}
		require.Zero(t, cache.Stats().Fills-before, "a full Redis stored fills")
		require.Less(t, testenv.UsedMemory(t, client)-limit, int64(64<<10), "the cache grew Redis past maxmemory")
		n, err := client.Exists(ctx, cache.currentKey("0"), cache.leaseKey("0")).Result()
		require.NoError(t, err)
		require.Zero(t, n, "a value or lease was stored")
	})

	t.Run("FailClosedMissIsARedisError", func(t *testing.T) {
		_, err := open(FailClosed).Get(ctx, "0", load)
		var redisErr *RedisError
		require.ErrorAs(t, err, &redisErr)
		require.Equal(t, "read", redisErr.Op)
		require.ErrorContains(t, err, "OOM")
	})

	// GetAt's only script on a miss is the fill after its load: a failed
	// fill, served in both modes, each call loading again (the package
	// doc's "When Redis fails").
	t.Run("FailClosedGetAtMissIsServed", func(t *testing.T) {
		closed := open(FailClosed)
		loads := 0
		for range 3 {
			v, err := closed.GetAt(ctx, "at", 7, func(context.Context) (string, error) { loads++; return big, nil })
			require.NoError(t, err)
			require.Equal(t, big, v)
		}
		require.Equal(t, 3, loads, "each call loads again")
		st := closed.Stats()
		require.EqualValues(t, 3, st.RedisErrors, "%+v", st)
		require.Zero(t, st.Fills, "%+v", st)
		n, err := client.Exists(ctx, closed.atKey("at")).Result()
		require.NoError(t, err)
		require.Zero(t, n, "nothing stored")
	})

	t.Run("PeekAndInvalidateStillWork", func(t *testing.T) {
		_, v1, _, err := cache.Peek(ctx, "1")
		require.NoError(t, err)
		require.NoError(t, cache.Invalidate(ctx, "1"), "an Invalidate refused by a full Redis would leave a stale value")
		_, v2, _, err := cache.Peek(ctx, "1")
		require.NoError(t, err)
		require.Greater(t, v2, v1)
	})

	t.Run("FillsResumeWhenRoomIsMade", func(t *testing.T) {
		require.NoError(t, client.ConfigSet(ctx, "maxmemory", "0").Err())
		before := cache.Stats().Fills
		_, err := cache.Get(ctx, "2", load)
		require.NoError(t, err)
		require.Equal(t, uint64(1), cache.Stats().Fills-before)
		_, _, ok, err := cache.Peek(ctx, "2")
		require.NoError(t, err)
		require.True(t, ok)
	})
}
