package versioncache

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// strictPrelude shadows redis.call for the script appended to it, so that a
// call on any key not passed in KEYS fails the script. Redis does not check
// this itself (a cluster only checks the slot), but promises correct routing,
// replication and key-permission checks only for declared keys. Commands
// missing from the tables fail too, so a new one cannot slip through.
const strictPrelude = `
local real = redis
local redis = setmetatable({}, {__index = real})
local declared = {}
for _, k in ipairs(KEYS) do declared[k] = true end
local firstArgIsKey = {GET = true, SET = true, GETRANGE = true, PEXPIRE = true, PTTL = true}
local allArgsAreKeys = {DEL = true}
local noKeys = {TIME = true}
redis.call = function(cmd, ...)
  local name = string.upper(cmd)
  local args = {...}
  local keys
  if firstArgIsKey[name] then
    keys = {args[1]}
  elseif allArgsAreKeys[name] then
    keys = args
  elseif noKeys[name] then
    keys = {}
  else
    error('strict: add ' .. name .. ' to the key tables')
  end
  for _, k in ipairs(keys) do
    if not declared[k] then
      error('strict: undeclared key ' .. tostring(k))
    end
  end
  return real.call(cmd, ...)
end
`

var strictScripts = newScripts(func(src string) string { return strictPrelude + src })

// setupStrict is setup with every script run under strictPrelude, and
// FailClosed so that a failing read script is returned, not loaded around.
func setupStrict(t *testing.T, cfg *Config) *testBundle {
	t.Helper()
	c := Config{FailureMode: FailClosed}
	if cfg != nil {
		c = *cfg
		c.FailureMode = FailClosed
	}
	b := setup(t, &c)
	b.cache.lua = strictScripts
	return b
}

// Every script must declare every key it touches in KEYS: this runs every
// path of Get, GetAt, Invalidate, Peek and Check with scripts that fail on
// any other key. A fill or release that fails is only logged, so the tests
// also check that nothing counted a Redis error and that fills happened.
func TestScriptsDeclareEveryKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("WrapperRejectsUndeclaredKeys", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		key := b.cache.currentKey("p1")
		for src, want := range map[string]string{
			"return redis.call('GET', KEYS[1])":                        "",
			"return redis.call('GET', KEYS[1] .. 'x')":                 "strict: undeclared key",
			"return redis.call('DEL', KEYS[1], KEYS[1] .. 'x')":        "strict: undeclared key",
			"return redis.call('EXISTS', KEYS[1])":                     "strict: add EXISTS",
			"return redis.call('set', KEYS[1], 'v', 'PX', 1000)['ok']": "",
		} {
			err := redis.NewScript(strictPrelude+src).Run(ctx, b.client, []string{key}).Err()
			if errors.Is(err, redis.Nil) {
				err = nil
			}
			if want == "" {
				require.NoError(t, err, src)
			} else {
				require.ErrorContains(t, err, want, src)
			}
		}
	})

	t.Run("GetInvalidatePeekCheck", func(t *testing.T) {
		t.Parallel()
		b := setupStrict(t, nil)
		b.truth.write("p1", 1)
		for range 2 { // miss with lease and fill, then hit
			got, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
			require.NoError(t, err)
			require.Equal(t, b.truth.read("p1"), got)
		}
		b.truth.write("p1", 2)
		require.NoError(t, b.cache.Invalidate(ctx, "p1"))
		// The version key lost: the read script re-creates it.
		require.NoError(t, b.client.Del(ctx, b.cache.versionKey("p1")).Err())
		got, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, b.truth.read("p1"), got)
		// An undecodable current value: read with the current key ignored.
		require.NoError(t, b.client.Set(ctx, b.cache.currentKey("p1"), "1:not json", 0).Err())
		got, err = b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, b.truth.read("p1"), got)

		_, _, ok, err := b.cache.Peek(ctx, "p1")
		require.NoError(t, err)
		require.True(t, ok)
		report, err := b.cache.Check(ctx, []string{"p1", "p2"}, 0, func(ctx context.Context, id string) (product, error) {
			return b.truth.read(id), nil
		})
		require.NoError(t, err)
		require.Equal(t, 1, report.Cached)
		st := b.cache.Stats()
		require.Zero(t, st.RedisErrors)
		require.EqualValues(t, 3, st.Fills)
	})

	t.Run("LeaseAcrossProcesses", func(t *testing.T) {
		t.Parallel()
		caches, src := newProcesses(t, 2, Config{FailureMode: FailClosed, FillLeaseWait: 10 * time.Second})
		for _, c := range caches {
			c.lua = strictScripts
		}
		want := src.write("p", 1)

		// A failed load releases the lease: the other process then loads
		// at once (below) instead of waiting for it to lapse.
		_, err := caches[0].Get(ctx, "p", func(context.Context) (product, error) {
			return product{}, errors.New("boom")
		})
		require.ErrorIs(t, err, ErrLoad)

		// One process loads slowly while the other waits for its fill.
		loading, release := make(chan struct{}), make(chan struct{})
		first := make(chan product, 1)
		go func() {
			p, err := caches[1].Get(ctx, "p", func(ctx context.Context) (product, error) {
				close(loading)
				<-release
				return src.read("p"), nil
			})
			if err != nil {
				t.Errorf("Get: %v", err)
			}
			first <- p
		}()
		<-loading
		second := make(chan product, 1)
		go func() {
			p, err := caches[0].Get(ctx, "p", src.loader("p"))
			if err != nil {
				t.Errorf("Get: %v", err)
			}
			second <- p
		}()
		require.Eventually(t, func() bool { return caches[0].Stats().LeaseWaits == 1 },
			5*time.Second, time.Millisecond)
		close(release)
		require.Equal(t, want, <-first)
		require.Equal(t, want, <-second)
		require.Zero(t, caches[1].Stats().LeaseWaits, "the failed load released its lease")
		require.EqualValues(t, 1, caches[0].Stats().LeaseWaitHits, "served by the lease holder's fill")
		require.Zero(t, src.loads.Load(), "only the lease holder loaded")
		for _, c := range caches {
			require.Zero(t, c.Stats().RedisErrors)
		}
	})

	t.Run("InvalidateReplicas", func(t *testing.T) {
		t.Parallel()
		// The bump runs as EVAL in a pipeline with WAIT; nobody confirms
		// on the shared server, so a ReplicationError means the bump ran.
		b := setupStrict(t, &Config{InvalidateReplicas: 1, InvalidateWaitTimeout: 10 * time.Millisecond})
		require.ErrorIs(t, b.cache.Invalidate(ctx, "p1"), ErrNotReplicated)
	})

	t.Run("GetAt", func(t *testing.T) {
		t.Parallel()
		b := setupStrict(t, nil)
		v1 := b.truth.write("p1", 1)
		// A value without a valid version prefix is replaced.
		require.NoError(t, b.client.Set(ctx, b.cache.atKey("p1"), "v99:not json", 0).Err())
		for range 2 {
			got, err := b.cache.GetAt(ctx, "p1", v1.Version, b.truth.loader("p1"))
			require.NoError(t, err)
			require.Equal(t, v1, got)
		}
		v2 := b.truth.write("p1", 2)
		got, err := b.cache.GetAt(ctx, "p1", v2.Version, b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, v2, got)
		// An undecodable value under a newer version is kept.
		require.NoError(t, b.client.Set(ctx, b.cache.atKey("p1"), "99:not json", 0).Err())
		got, err = b.cache.GetAt(ctx, "p1", v2.Version, b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, v2, got)
		st := b.cache.Stats()
		require.Zero(t, st.RedisErrors)
		require.EqualValues(t, 2, st.Fills)
		require.EqualValues(t, 1, st.StaleFillsSkipped)
	})
}
