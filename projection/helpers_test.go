package projection

import (
	"context"
	"strconv"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// backend is a Redis deployment the suites run against.
type backend struct {
	name    string
	connect func(t *testing.T) (client redis.UniversalClient, prefix string)
}

var backends = []backend{
	{name: "SingleNode", connect: func(t *testing.T) (redis.UniversalClient, string) {
		rd := testenv.Redis(t)
		return rd.Client, rd.Prefix
	}},
	// A Ring of two shards on two distinct servers (the shared test server
	// and a private one), so a write routed to the wrong shard is missing
	// when read back through the Ring: exercises grouping by hash tag and
	// pipelines split across shards.
	{name: "Ring", connect: func(t *testing.T) (redis.UniversalClient, string) {
		rd := testenv.Redis(t)
		shared, err := redis.ParseURL(rd.URL)
		require.NoError(t, err)
		private := testenv.StartRedis(t)
		ring := redis.NewRing(&redis.RingOptions{
			Addrs:       map[string]string{"shared": shared.Addr, "private": private.Addr()},
			HeartbeatFn: func(context.Context, *redis.Client) bool { return true }, // as the package documents
			NewClient: func(opt *redis.Options) *redis.Client {
				if opt.Addr == shared.Addr { // the private server has no auth and one database
					opt.DB, opt.Username, opt.Password = shared.DB, shared.Username, shared.Password
				}
				return redis.NewClient(opt)
			},
		})
		t.Cleanup(func() { _ = ring.Close() })
		return ring, rd.Prefix
	}},
	{name: "Sentinel", connect: func(t *testing.T) (redis.UniversalClient, string) {
		s := testenv.SharedRedisSentinel(t)
		return s.Client(t), s.Prefix(t)
	}},
	{name: "Cluster", connect: func(t *testing.T) (redis.UniversalClient, string) {
		c := testenv.SharedRedisCluster(t)
		return c.Client(t), c.Prefix(t)
	}},
}

// forEachBackend runs fn as a parallel subtest per backend.
func forEachBackend(t *testing.T, fn func(t *testing.T, b backend)) {
	t.Helper()
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			fn(t, b)
		})
	}
}

// storedState is what Redis holds for one target.
type storedState struct {
	exists  bool
	value   string // the score as a decimal integer for sorted sets
	version string
}

func readState(t *testing.T, client redis.UniversalClient, ks Keyspace, tg Target) storedState {
	t.Helper()
	return readKeys(t, client, tg, ks.ValueKey(tg), ks.VersionKey(tg))
}

func readShadowState(t *testing.T, client redis.UniversalClient, ks Keyspace, tg Target) storedState {
	t.Helper()
	return readKeys(t, client, tg, ks.ShadowValueKey(tg.Name, tg.Kind), ks.ShadowVersionKeys(tg.Name, tg.Kind)[ks.VersionBucket(tg.Member)])
}

func readKeys(t *testing.T, client redis.UniversalClient, tg Target, valueKey, versionKey string) storedState {
	t.Helper()
	ctx := context.Background()
	var value, version string
	var err error
	switch tg.Kind {
	case KindSortedSet:
		var score float64
		score, err = client.ZScore(ctx, valueKey, tg.Member).Result()
		if err == nil {
			value = formatScore(score)
		}
	case KindHash:
		value, err = client.HGet(ctx, valueKey, tg.Member).Result()
	case KindDocument:
		value, err = client.Get(ctx, valueKey).Result()
	}
	if err == redis.Nil {
		return storedState{}
	}
	require.NoError(t, err)
	if tg.Kind == KindDocument {
		version, err = client.Get(ctx, versionKey).Result()
	} else {
		version, err = client.HGet(ctx, versionKey, tg.Member).Result()
	}
	require.NoError(t, err, "a value without a version")
	return storedState{exists: true, value: value, version: version}
}

// formatScore renders an integral score exactly (2^53 as 9007199254740992).
func formatScore(f float64) string { return strconv.FormatFloat(f, 'f', -1, 64) }
