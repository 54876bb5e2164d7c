package versioncache

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/verity-go/verity/internal/keyenc"
	"github.com/verity-go/verity/internal/testenv"
)

// product is the cached type of these tests. Version is the source of
// truth's own row version, which is how staleness is judged.
type product struct {
	ID      string `json:"id"`
	Price   int    `json:"price"`
	Version int64  `json:"version"`
}

// truth is the source of truth the loaders read: a map standing in for
// table rows, updated under a mutex and versioned like a row_version column.
type truth struct {
	mu    sync.Mutex
	rows  map[string]product
	loads atomic.Int64
}

func newTruth() *truth { return &truth{rows: map[string]product{}} }

func (s *truth) write(id string, price int) product {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.rows[id]
	p.ID, p.Price, p.Version = id, price, p.Version+1
	s.rows[id] = p
	return p
}

func (s *truth) read(id string) product {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rows[id]
}

func (s *truth) loader(id string) Loader[product] {
	return func(ctx context.Context) (product, error) {
		s.loads.Add(1)
		return s.read(id), nil
	}
}

type testBundle struct {
	client redis.UniversalClient
	prefix string
	cache  *Cache[product]
	truth  *truth
}

// pttl is key's remaining time to live; it fails the test if key is absent
// or has no expiry.
func (b *testBundle) pttl(t *testing.T, key string) time.Duration {
	t.Helper()
	d, err := b.client.PTTL(context.Background(), key).Result()
	require.NoError(t, err)
	require.Positive(t, d, "%s has a time to live", key)
	return d
}

func setup(t *testing.T, cfg *Config) *testBundle {
	t.Helper()
	rd := testenv.Redis(t)
	return setupWith(t, rd.Client, rd.Prefix, cfg)
}

func setupWith(t *testing.T, client redis.UniversalClient, prefix string, cfg *Config) *testBundle {
	t.Helper()
	c := Config{}
	if cfg != nil {
		c = *cfg
	}
	c.Prefix = prefix
	cache, err := New[product](client, &c)
	require.NoError(t, err)
	return &testBundle{client: client, prefix: prefix, cache: cache, truth: newTruth()}
}

func TestNew(t *testing.T) {
	t.Parallel()

	t.Run("NilClient", func(t *testing.T) {
		t.Parallel()
		_, err := New[product](nil, nil)
		require.ErrorIs(t, err, ErrNilClient)
		_, err = New[product]((*redis.Client)(nil), nil)
		require.ErrorIs(t, err, ErrNilClient, "a typed nil is refused too, not dereferenced on the first Get")
	})

	t.Run("InvalidConfig", func(t *testing.T) {
		t.Parallel()
		client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
		defer client.Close()
		for _, tc := range []struct {
			field string
			cfg   Config
		}{
			{"Prefix", Config{Prefix: "a{b}:"}},
			{"Prefix", Config{}}, // required: no two caches share one by default
			{"TTL", Config{TTL: time.Microsecond}},
			{"FailureMode", Config{FailureMode: 7}},
			{"FillLeaseTTL", Config{FillLeaseTTL: -time.Second}},
			// Used with the lease off too, so its error must not suggest
			// turning the lease off.
			{"FillLeaseTTL", Config{FillLeaseTTL: time.Microsecond, DisableFillLease: true}},
			{"FillLeaseWait", Config{FillLeaseWait: -time.Second}},
			{"FillLeaseWait", Config{FillLeaseWait: -1}},
			{"FillLeasePoll", Config{FillLeasePoll: -time.Second}},
			{"FillLeasePoll", Config{FillLeasePoll: -1}},
			{"InvalidateReplicas", Config{InvalidateReplicas: -1}},
			{"InvalidateWaitTimeout", Config{InvalidateWaitTimeout: 500 * time.Microsecond}},
			// A typed nil is refused like a nil client, not dereferenced on
			// the first miss (only an untyped nil selects JSONCodec).
			{"Codec", Config{Codec: (*JSONCodec)(nil)}},
		} {
			if tc.cfg.Prefix == "" && tc.field != "Prefix" {
				tc.cfg.Prefix = "p:"
			}
			_, err := New[product](client, &tc.cfg)
			var cerr *ConfigError
			require.ErrorAs(t, err, &cerr, tc.field)
			require.Equal(t, tc.field, cerr.Field)
			require.ErrorIs(t, err, ErrInvalidConfig)
			require.NotContains(t, cerr.Reason, "DisableFillLease", "advice that would not help")
		}
		_, err := New[product](client, nil)
		var cerr *ConfigError
		require.ErrorAs(t, err, &cerr, "a nil config has no Prefix")
		require.Equal(t, "Prefix", cerr.Field)
	})

	// Each bound is inclusive: "at least 1ms" accepts 1ms.
	t.Run("BoundsAreInclusive", func(t *testing.T) {
		t.Parallel()
		client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
		defer client.Close()
		for name, cfg := range map[string]Config{
			"TTL":                   {Prefix: "p:", TTL: time.Millisecond},
			"FillLeaseTTL":          {Prefix: "p:", FillLeaseTTL: time.Millisecond},
			"InvalidateWaitTimeout": {Prefix: "p:", InvalidateWaitTimeout: time.Millisecond},
			"FillLeasePoll":         {Prefix: "p:", FillLeasePoll: 1},
		} {
			c, err := New[product](client, &cfg)
			require.NoError(t, err, name)
			require.NoError(t, c.Close())
		}
	})

	t.Run("TypedNilMeterProvider", func(t *testing.T) {
		t.Parallel()
		client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
		defer client.Close()
		// A provider left nil to turn metrics off records nothing.
		c, err := New[product](client, &Config{Prefix: "p:", MeterProvider: (*sdkmetric.MeterProvider)(nil)})
		require.NoError(t, err)
		require.NoError(t, c.Close())
	})

	t.Run("NotMadeByNew", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		load := func(context.Context) (product, error) { return product{}, nil }
		idLoad := func(context.Context, string) (product, error) { return product{}, nil }
		versionedLoad := func(context.Context, string) (product, int64, error) { return product{}, 1, nil }
		for name, c := range map[string]*Cache[product]{"Zero": new(Cache[product]), "Nil": nil} {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				for method, call := range map[string]func() error{
					"Get":        func() error { _, err := c.Get(ctx, "id", load); return err },
					"GetAt":      func() error { _, err := c.GetAt(ctx, "id", 1, load); return err },
					"Invalidate": func() error { return c.Invalidate(ctx, "id") },
					"Peek":       func() error { _, _, _, err := c.Peek(ctx, "id"); return err },
					"Check":      func() error { _, err := c.Check(ctx, []string{"id"}, 1, idLoad); return err },
					"CheckAt":    func() error { _, err := c.CheckAt(ctx, []string{"id"}, 1, versionedLoad); return err },
				} {
					err := call()
					var cerr *ConfigError
					require.ErrorAs(t, err, &cerr, method)
					require.Equal(t, "client", cerr.Field, method)
					require.ErrorIs(t, err, ErrInvalidConfig, method)
				}
				require.Equal(t, Stats{}, c.Stats())
				require.NoError(t, c.Close())
			})
		}
	})

	// go-redis does not end a command in flight when its ctx is cancelled:
	// a client that sets no connection deadline would let a stalled Redis
	// hold a Get (or a detached fill) forever.
	t.Run("ClientThatCanWaitForever", func(t *testing.T) {
		t.Parallel()
		const addr = "127.0.0.1:1" // never dialled
		single := func(read, write time.Duration, ctxTimeout bool) redis.UniversalClient {
			return redis.NewClient(&redis.Options{Addr: addr, ReadTimeout: read, WriteTimeout: write, ContextTimeoutEnabled: ctxTimeout})
		}
		cluster := func(read, write time.Duration, ctxTimeout bool) redis.UniversalClient {
			return redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{addr}, ReadTimeout: read, WriteTimeout: write, ContextTimeoutEnabled: ctxTimeout})
		}
		ring := func(read, write time.Duration, ctxTimeout bool) redis.UniversalClient {
			return redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": addr},
				HeartbeatFn: func(context.Context, *redis.Client) bool { return true },
				ReadTimeout: read, WriteTimeout: write, ContextTimeoutEnabled: ctxTimeout})
		}
		for name, tc := range map[string]struct {
			client redis.UniversalClient
			field  string // "" when accepted
		}{
			"NoReadTimeout":                 {single(-1, 0, false), "Options.ReadTimeout"},
			"NoWriteTimeout":                {single(time.Second, -1, false), "Options.WriteTimeout"},
			"NoDeadlineEvenFromCtx":         {single(-2, time.Second, true), "Options.ReadTimeout"},
			"ClusterNoReadTimeout":          {cluster(-1, 0, false), "ClusterOptions.ReadTimeout"},
			"ClusterNoWriteDeadline":        {cluster(0, -2, true), "ClusterOptions.WriteTimeout"},
			"RingNoWriteTimeout":            {ring(0, -1, false), "RingOptions.WriteTimeout"},
			"Defaults":                      {single(0, 0, false), ""},
			"Timeouts":                      {single(time.Second, time.Second, false), ""},
			"CtxDeadlineOnly":               {single(-1, -1, true), ""},
			"ClusterCtxDeadlineOnly":        {cluster(-1, -1, true), ""},
			"RingTimeouts":                  {ring(time.Second, 0, false), ""},
			"RingCtxDeadlineAndReadTimeout": {ring(time.Second, -1, true), ""},
		} {
			_, err := New[product](tc.client, &Config{Prefix: "p:"})
			require.NoError(t, tc.client.Close())
			if tc.field == "" {
				require.NoError(t, err, name)
				continue
			}
			require.ErrorIs(t, err, ErrInvalidConfig, name)
			var cerr *ConfigError
			require.ErrorAs(t, err, &cerr, name)
			require.Equal(t, tc.field, cerr.Field, name)
			require.Contains(t, cerr.Reason, "ContextTimeoutEnabled", name)
			require.True(t, strings.HasPrefix(err.Error(), "versioncache: the client's "+tc.field+" "), "%s: %s", name, err)
		}
	})

	t.Run("Defaults", func(t *testing.T) {
		t.Parallel()
		cfg := (*Config)(nil).WithDefaults()
		require.Empty(t, cfg.Prefix, "no default")
		require.Equal(t, TTLDefault, cfg.TTL)
		require.Equal(t, FailOpen, cfg.FailureMode)
		require.Equal(t, FillLeaseWaitDefault, cfg.FillLeaseWait)
		require.Equal(t, FillLeaseTTLDefault, cfg.FillLeaseTTL)
		require.Equal(t, FillLeasePollDefault, cfg.FillLeasePoll)
		require.Equal(t, InvalidateWaitTimeoutDefault, cfg.InvalidateWaitTimeout)
		require.Equal(t, JSONCodec{}, cfg.Codec)
		require.False(t, cfg.DisableFillLease, "lease on")
		require.Zero(t, cfg.InvalidateReplicas, "do not wait")
		require.Nil(t, cfg.MeterProvider)
		require.NotNil(t, cfg.Logger)

		// A copy: the caller's Config is left as it was.
		in := &Config{Prefix: "p:", TTL: time.Minute}
		out := in.WithDefaults()
		require.Equal(t, &Config{Prefix: "p:", TTL: time.Minute}, in)
		require.Equal(t, "p:", out.Prefix)
		require.Equal(t, time.Minute, out.TTL)
	})

	t.Run("FailureModeString", func(t *testing.T) {
		t.Parallel()
		require.Equal(t, "fail-open", FailOpen.String())
		require.Equal(t, "fail-closed", FailClosed.String())
		require.Equal(t, "FailureMode(7)", FailureMode(7).String())
	})
}

func TestGet(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("MissThenHit", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		want := b.truth.write("p1", 4900)
		for range 3 {
			got, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
			require.NoError(t, err)
			require.Equal(t, want, got)
		}
		require.EqualValues(t, 1, b.truth.loads.Load())
		st := b.cache.Stats()
		require.EqualValues(t, 2, st.Hits)
		require.EqualValues(t, 1, st.Misses)
		require.EqualValues(t, 1, st.Fills)
	})

	t.Run("InvalidateServesNewValue", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		b.truth.write("p1", 4900)
		_, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)

		want := b.truth.write("p1", 4400)
		require.NoError(t, b.cache.Invalidate(ctx, "p1"))
		got, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, want, got)

		st := b.cache.Stats()
		require.EqualValues(t, 1, st.Invalidations)
		require.Zero(t, st.OrphanedValueKeys)

		// Invalidate deletes the current value rather than orphaning it:
		// only the version key (and no value) is left for the id.
		require.NoError(t, b.cache.Invalidate(ctx, "p1"))
		keys, err := b.client.Keys(ctx, keyenc.Tagged(b.prefix, "p1", "*")).Result()
		require.NoError(t, err)
		require.Equal(t, []string{b.cache.versionKey("p1")}, keys)
	})

	// The seed's timeline: a read misses and queries the database, a write
	// commits and invalidates, then the read fills. The fill must not be
	// readable afterwards.
	t.Run("StaleFillIsNeverServed", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		b.truth.write("p41", 4900)

		loaded := make(chan struct{})
		release := make(chan struct{})
		slowLoader := func(ctx context.Context) (product, error) {
			p := b.truth.read("p41") // T2: reads 4900
			close(loaded)
			<-release // T5 happens after the write below
			return p, nil
		}
		done := make(chan product)
		go func() {
			p, err := b.cache.Get(ctx, "p41", slowLoader)
			if err != nil {
				t.Errorf("Get: %v", err)
			}
			done <- p
		}()
		<-loaded
		want := b.truth.write("p41", 4400)                 // T3
		require.NoError(t, b.cache.Invalidate(ctx, "p41")) // T4
		close(release)
		require.Equal(t, 4900, (<-done).Price, "a read that began before the write may return the old value")

		got, err := b.cache.Get(ctx, "p41", b.truth.loader("p41"))
		require.NoError(t, err)
		require.Equal(t, want, got)
		require.EqualValues(t, 1, b.cache.Stats().StaleFillsSkipped)
	})

	// doc.go, Stampedes: a joiner can only join a load that started after
	// the version it observed. A Get that begins after an Invalidate
	// returned must not share a load that read the row before the write.
	t.Run("NoJoiningALoadOfAnOlderVersion", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		b.truth.write("p1", 4900)

		loaded := make(chan struct{})
		release := make(chan struct{})
		oldDone := make(chan product, 1)
		go func() {
			p, err := b.cache.Get(ctx, "p1", func(ctx context.Context) (product, error) {
				p := b.truth.read("p1") // reads 4900
				close(loaded)
				<-release
				return p, nil
			})
			if err != nil {
				t.Errorf("Get: %v", err)
			}
			oldDone <- p
		}()
		<-loaded
		want := b.truth.write("p1", 4400)
		require.NoError(t, b.cache.Invalidate(ctx, "p1"))

		newDone := make(chan product, 1)
		go func() {
			p, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
			if err != nil {
				t.Errorf("Get: %v", err)
			}
			newDone <- p
		}()
		var got product
		select {
		case got = <-newDone:
			close(release)
		case <-time.After(200 * time.Millisecond):
			// It joined the older load; let that load finish so that the
			// assertion below reports what it was served.
			close(release)
			got = <-newDone
		}
		require.Equal(t, want, got, "a Get begun after Invalidate returned is served the write")
		require.Equal(t, 4900, (<-oldDone).Price)
		require.Zero(t, b.cache.Stats().SharedLoads)
	})

	// Config.TTL: TTL bounds how long a value is kept after it was loaded,
	// and a hit does not extend it: a write whose Invalidate was lost is
	// visible once TTL has passed.
	t.Run("ValueExpiresAfterTTL", func(t *testing.T) {
		t.Parallel()
		const ttl = time.Second
		b := setup(t, &Config{TTL: ttl})
		first := b.truth.write("p1", 4900)
		got, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		// The fill set the value's TTL before Get returned; a time taken
		// before the call could precede the fill by more than the slack
		// below on a loaded machine.
		filled := time.Now()
		require.NoError(t, err)
		require.Equal(t, first, got)
		left := b.pttl(t, b.cache.currentKey("p1"))
		require.True(t, left > 0 && left <= ttl, "the value expires within TTL: %s", left)

		want := b.truth.write("p1", 4400) // no Invalidate: a lost one
		got, err = b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, first, got, "within TTL the cached value is a hit")
		require.EqualValues(t, 1, b.cache.Stats().Hits)
		require.LessOrEqual(t, b.pttl(t, b.cache.currentKey("p1")), left, "a hit does not extend the value's life")

		time.Sleep(time.Until(filled.Add(ttl + 100*time.Millisecond)))
		got, err = b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, want, got, "TTL after the load, despite the hit in between, the value is gone")
		require.EqualValues(t, 2, b.truth.loads.Load())
	})

	// doc.go: an Invalidate of an id with no version key stores one, for
	// TTL (so that invalidating ids that were never cached cannot grow a
	// Redis for ever).
	t.Run("InvalidateOfUncachedIDKeepsVersionForTTL", func(t *testing.T) {
		t.Parallel()
		const ttl = 10 * time.Second
		b := setup(t, &Config{TTL: ttl})
		require.NoError(t, b.cache.Invalidate(ctx, "never-cached"))
		keys, err := b.client.Keys(ctx, keyenc.Tagged(b.prefix, "never-cached", "*")).Result()
		require.NoError(t, err)
		require.Equal(t, []string{b.cache.versionKey("never-cached")}, keys)
		require.LessOrEqual(t, b.pttl(t, b.cache.versionKey("never-cached")), ttl, "the version key expires within TTL")
	})

	// Config.TTL: the version key lives at least TTL after a fill too. A
	// load slower than FillLeaseTTL leaves the miss's version key less than
	// TTL to live; the fill extends it, or it would expire before the value
	// it stands for (no test failed when fill.lua skipped that: the
	// mutation audit).
	t.Run("FillKeepsVersionKeyForTTL", func(t *testing.T) {
		t.Parallel()
		const ttl, lease, load = 3 * time.Second, 200 * time.Millisecond, time.Second
		b := setup(t, &Config{TTL: ttl, FillLeaseTTL: lease})
		want := b.truth.write("p1", 4900)
		got, err := b.cache.Get(ctx, "p1", func(ctx context.Context) (product, error) {
			time.Sleep(load)
			return b.truth.loader("p1")(ctx)
		})
		require.NoError(t, err)
		require.Equal(t, want, got)
		require.EqualValues(t, 1, b.cache.Stats().Fills, "the slow load was cached")
		filledAt := time.Now()
		// Without the extension about ttl+lease-load (2.2s) would be left.
		require.Greater(t, b.pttl(t, b.cache.versionKey("p1")), ttl-400*time.Millisecond)

		// Past the miss's TTL+FillLeaseTTL, within the value's TTL.
		time.Sleep(time.Until(filledAt.Add(ttl + lease - load + 200*time.Millisecond)))
		got, err = b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, want, got)
		require.EqualValues(t, 1, b.cache.Stats().Hits, "the value cached within TTL is a hit")
		require.EqualValues(t, 1, b.truth.loads.Load())
	})

	// The version key a miss reads must still be there at its fill, or
	// the fill is refused: a load slower than the key's remaining life
	// would never be cached, miss after miss.
	t.Run("LoadLongerThanTTLIsCached", func(t *testing.T) {
		t.Parallel()
		const ttl = 200 * time.Millisecond
		slowly := func(b *testBundle, d time.Duration) Loader[product] {
			return func(ctx context.Context) (product, error) {
				time.Sleep(d)
				return b.truth.loader("p1")(ctx)
			}
		}

		t.Run("NewVersion", func(t *testing.T) {
			t.Parallel()
			// The second Get must come within TTL of the fill: 200 ms is
			// less than a loaded machine may take between two calls.
			const ttl = time.Second
			b := setup(t, &Config{TTL: ttl})
			want := b.truth.write("p1", 4900)
			got, err := b.cache.Get(ctx, "p1", slowly(b, ttl+50*time.Millisecond))
			require.NoError(t, err)
			require.Equal(t, want, got)
			got, err = b.cache.Get(ctx, "p1", b.truth.loader("p1"))
			require.NoError(t, err)
			require.Equal(t, want, got)
			st := b.cache.Stats()
			require.EqualValues(t, 1, st.Fills)
			require.Zero(t, st.StaleFillsSkipped, "no write happened during the load")
			require.EqualValues(t, 1, st.Hits)
		})

		// After an Invalidate the version key has TTL to live: a miss late
		// in that life must not lose its fill to the key's expiry.
		t.Run("VersionNearItsExpiry", func(t *testing.T) {
			t.Parallel()
			b := setup(t, &Config{TTL: ttl})
			want := b.truth.write("p1", 4900)
			require.NoError(t, b.cache.Invalidate(ctx, "p1"))
			time.Sleep(ttl - 50*time.Millisecond)
			got, err := b.cache.Get(ctx, "p1", slowly(b, 100*time.Millisecond))
			require.NoError(t, err)
			require.Equal(t, want, got)
			st := b.cache.Stats()
			require.EqualValues(t, 1, st.Fills)
			require.Zero(t, st.StaleFillsSkipped)
		})

		// Another process's quick fill under the same version must not cut
		// the version key's life short under a slow load still running.
		t.Run("AfterAnotherProcessFilled", func(t *testing.T) {
			t.Parallel()
			fast := setup(t, &Config{TTL: ttl, DisableFillLease: true})
			slow := setupWith(t, fast.client, fast.prefix, &Config{TTL: ttl, DisableFillLease: true})
			slow.truth = fast.truth // one database
			want := fast.truth.write("p1", 4900)
			slowStarted := make(chan struct{})
			done := make(chan error, 1)
			go func() {
				_, err := slow.cache.Get(ctx, "p1", func(ctx context.Context) (product, error) {
					close(slowStarted)
					time.Sleep(ttl + 100*time.Millisecond)
					return slow.truth.loader("p1")(ctx)
				})
				done <- err
			}()
			<-slowStarted // both load under the same version
			got, err := fast.cache.Get(ctx, "p1", fast.truth.loader("p1"))
			require.NoError(t, err)
			require.Equal(t, want, got)
			require.NoError(t, <-done)
			require.EqualValues(t, 1, fast.cache.Stats().Fills)
			st := slow.cache.Stats()
			require.EqualValues(t, 1, st.Fills)
			require.Zero(t, st.StaleFillsSkipped)
		})

		// Past TTL + FillLeaseTTL the version key has expired, and with it
		// the proof that no write happened during the load: served, not
		// cached, and counted as documented.
		t.Run("NotBeyondTTLPlusFillLeaseTTL", func(t *testing.T) {
			t.Parallel()
			b := setup(t, &Config{TTL: 100 * time.Millisecond, FillLeaseTTL: 100 * time.Millisecond})
			want := b.truth.write("p1", 4900)
			got, err := b.cache.Get(ctx, "p1", slowly(b, 300*time.Millisecond))
			require.NoError(t, err)
			require.Equal(t, want, got)
			st := b.cache.Stats()
			require.Zero(t, st.Fills)
			require.EqualValues(t, 1, st.StaleFillsSkipped)
		})
	})

	t.Run("LoaderErrorCachesNothing", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		boom := errors.New("boom")
		_, err := b.cache.Get(ctx, "p1", func(context.Context) (product, error) { return product{}, boom })
		var lerr *LoadError
		require.ErrorAs(t, err, &lerr)
		require.Equal(t, "p1", lerr.ID)
		require.ErrorIs(t, err, boom)
		require.ErrorIs(t, err, ErrLoad)

		_, _, ok, err := b.cache.Peek(ctx, "p1")
		require.NoError(t, err)
		require.False(t, ok)
	})

	t.Run("NilLoader", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		_, err := b.cache.Get(ctx, "p1", nil)
		require.ErrorIs(t, err, ErrNilLoader)
	})

	t.Run("UndecodableValueIsReloaded", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		want := b.truth.write("p1", 10)
		_, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		_, version, ok, err := b.cache.Peek(ctx, "p1")
		require.NoError(t, err)
		require.True(t, ok)
		// A payload the codec rejects, then one without the version prefix.
		for i, bad := range []string{fmt.Sprintf("%d:not json", version), "not json"} {
			require.NoError(t, b.client.Set(ctx, b.cache.currentKey("p1"), bad, 0).Err())

			got, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
			require.NoError(t, err)
			require.Equal(t, want, got)
			require.EqualValues(t, i+1, b.cache.Stats().DecodeErrors)
			_, _, ok, err = b.cache.Peek(ctx, "p1")
			require.NoError(t, err)
			require.True(t, ok, "the reload overwrote the bad value")
		}
	})

	t.Run("AwkwardIDs", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		ids := []string{"", "a{b}c", "}{", "with:colon", "%41", "A", "ü"}
		for i, id := range ids {
			b.truth.write(id, i)
		}
		for _, id := range ids {
			got, err := b.cache.Get(ctx, id, b.truth.loader(id))
			require.NoError(t, err)
			require.Equal(t, b.truth.read(id), got, id)
		}
		// Each id has its own key space: no loads shared between ids.
		require.EqualValues(t, len(ids), b.truth.loads.Load())
	})

	// go-redis's client-side cache answers a single GET from process memory
	// until the server's invalidation message has been processed, which can
	// be after another process's Invalidate returned. The cache below holds
	// that message back for good, so a hit it served would be stale.
	t.Run("ClientSideCacheIsBypassed", func(t *testing.T) {
		t.Parallel()
		rd := testenv.Redis(t)
		opt, err := redis.ParseURL(rd.URL)
		require.NoError(t, err)
		for name, newClient := range map[string]func(local redis.Cache) redis.UniversalClient{
			"Client": func(local redis.Cache) redis.UniversalClient {
				o := *opt
				o.Protocol, o.ClientSideCache = 3, local
				return redis.NewClient(&o)
			},
			"UniversalClient": func(local redis.Cache) redis.UniversalClient {
				return redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{opt.Addr},
					DB: opt.DB, Username: opt.Username, Password: opt.Password, Protocol: 3, ClientSideCache: local})
			},
		} {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				local := &heldBackCache{LocalCache: redis.NewLocalCache(redis.ClientSideCacheConfig{})}
				client := newClient(local)
				t.Cleanup(func() { client.Close() })
				prefix := rd.Prefix + name + ":"
				reader := setupWith(t, client, prefix, nil)
				writer := setupWith(t, rd.Client, prefix, nil) // another process
				writer.truth = reader.truth                    // one database
				reader.truth.write("p1", 4900)
				_, err := writer.cache.Get(ctx, "p1", writer.truth.loader("p1")) // cached
				require.NoError(t, err)
				for range 2 { // hits
					_, err := reader.cache.Get(ctx, "p1", reader.truth.loader("p1"))
					require.NoError(t, err)
				}

				want := reader.truth.write("p1", 4400)
				require.NoError(t, writer.cache.Invalidate(ctx, "p1"))
				got, err := reader.cache.Get(ctx, "p1", reader.truth.loader("p1"))
				require.NoError(t, err)
				require.Equal(t, want, got, "a value an acknowledged Invalidate deleted was served")
				require.Zero(t, local.gets.Load(), "the hit consulted the client-side cache")

				// GetAt's and CheckAt's reads too: Invalidate is the repair
				// of a data fix that kept the row's version, so a GetAt
				// value it deleted must not come back at that version.
				at := reader.truth.write("p2", 100)
				_, err = writer.cache.GetAt(ctx, "p2", at.Version, writer.truth.loader("p2")) // cached
				require.NoError(t, err)
				for range 2 { // hits
					_, err := reader.cache.GetAt(ctx, "p2", at.Version, reader.truth.loader("p2"))
					require.NoError(t, err)
				}
				reader.truth.mu.Lock()
				fixed := reader.truth.rows["p2"]
				fixed.Price = 1 // the version stays
				reader.truth.rows["p2"] = fixed
				reader.truth.mu.Unlock()
				require.NoError(t, writer.cache.Invalidate(ctx, "p2"))
				report, err := reader.cache.CheckAt(ctx, []string{"p2"}, 0, func(_ context.Context, id string) (product, int64, error) {
					p := reader.truth.read(id)
					return p, p.Version, nil
				})
				require.NoError(t, err)
				require.Equal(t, CheckReport[product]{Sampled: 1, NotCached: 1}, report, "CheckAt read a value an acknowledged Invalidate deleted")
				got, err = reader.cache.GetAt(ctx, "p2", fixed.Version, reader.truth.loader("p2"))
				require.NoError(t, err)
				require.Equal(t, fixed, got, "GetAt served a value an acknowledged Invalidate deleted")
				require.Zero(t, local.gets.Load(), "GetAt or CheckAt consulted the client-side cache")

				// The client does cache single GETs, or this test proves nothing.
				key := reader.cache.currentKey("p1")
				for range 2 {
					require.NoError(t, client.Get(ctx, key).Err())
				}
				require.NotZero(t, local.gets.Load(), "client-side caching is off")
			})
		}
	})
}

// heldBackCache is a go-redis client-side cache whose invalidation messages
// never arrive: what it holds stays stale.
type heldBackCache struct {
	*redis.LocalCache
	gets atomic.Int64
}

func (c *heldBackCache) Get(ctx context.Context, cacheKey string) ([]byte, bool) {
	c.gets.Add(1)
	return c.LocalCache.Get(ctx, cacheKey)
}

func (c *heldBackCache) DeleteByRedisKey(string) int { return 0 }

func TestVersionNeverGoesBackwards(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("AfterVersionKeyLoss", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		b.truth.write("p1", 1)
		_, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		var highest int64
		for range 5 {
			require.NoError(t, b.cache.Invalidate(ctx, "p1"))
			_, v, _, err := b.cache.Peek(ctx, "p1")
			require.NoError(t, err)
			require.Greater(t, v, highest)
			highest = v
		}
		// Losing the version key must not let any version come back.
		require.NoError(t, b.client.Del(ctx, keyenc.Tagged(b.prefix, "p1", suffixVersion)).Err())
		want := b.truth.write("p1", 2)
		got, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, want, got)
		_, v, ok, err := b.cache.Peek(ctx, "p1")
		require.NoError(t, err)
		require.True(t, ok)
		require.Greater(t, v, highest)
	})

	// The version key is evicted alone; the current value survives it. It is
	// still current (only Invalidate removes it), so it keeps being served,
	// and the next Invalidate must both delete it and pick a version above
	// the one embedded in it, even if the clock is behind that version.
	t.Run("CurrentValueOutlivesVersionKey", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		want := b.truth.write("p1", 1)
		_, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		require.NoError(t, b.client.Del(ctx, b.cache.versionKey("p1")).Err())
		got, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, want, got)
		require.EqualValues(t, 1, b.cache.Stats().Hits)
		require.EqualValues(t, 1, b.truth.loads.Load())

		// Pretend the value was cached under a version far ahead of the
		// clock (a clock that stepped back since), then lose the version.
		ahead := time.Now().Add(24 * time.Hour).UnixMicro()
		data, err := json.Marshal(want)
		require.NoError(t, err)
		require.NoError(t, b.client.Set(ctx, b.cache.currentKey("p1"),
			string(joinVersioned(strconv.FormatInt(ahead, 10), data)), 0).Err())
		require.NoError(t, b.client.Del(ctx, b.cache.versionKey("p1")).Err())

		want = b.truth.write("p1", 2)
		require.NoError(t, b.cache.Invalidate(ctx, "p1"))
		_, v, ok, err := b.cache.Peek(ctx, "p1")
		require.NoError(t, err)
		require.False(t, ok, "Invalidate deleted the current value")
		require.Greater(t, v, ahead)

		// A fill still carrying the old version is refused.
		stored, err := b.cache.lua.fill.Run(ctx, b.client,
			[]string{b.cache.versionKey("p1"), b.cache.currentKey("p1"), b.cache.leaseKey("p1")},
			strconv.FormatInt(ahead, 10), joinVersioned(strconv.FormatInt(ahead, 10), data), 60000, "").Int()
		require.NoError(t, err)
		require.Zero(t, stored)
		got, err = b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, want, got)
	})

	// Invalidate's version is at least Redis's clock (doc.go: the largest of
	// current+1, the clock and one above the embedded version), not merely
	// one above the stored version.
	t.Run("InvalidateCatchesUpWithTheClock", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		b.truth.write("p1", 1)
		_, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		// A version well behind the clock, as one stored long ago.
		behind := time.Now().Add(-time.Hour).UnixMicro()
		require.NoError(t, b.client.Set(ctx, b.cache.versionKey("p1"), strconv.FormatInt(behind, 10), time.Hour).Err())
		now, err := b.client.Time(ctx).Result()
		require.NoError(t, err)

		require.NoError(t, b.cache.Invalidate(ctx, "p1"))
		_, v, _, err := b.cache.Peek(ctx, "p1")
		require.NoError(t, err)
		require.GreaterOrEqual(t, v, now.UnixMicro(), "the version stayed behind the clock")
	})

	// The version key holds a version ahead of Redis's clock (a clock that
	// stepped back, a failover to a server whose clock lags) and the current
	// value embeds an older one: Invalidate must still move the version up,
	// not back to the clock, below versions already handed out.
	t.Run("VersionKeyAheadOfClock", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		b.truth.write("p1", 1)
		_, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		ahead := time.Now().Add(time.Hour).UnixMicro()
		require.NoError(t, b.client.Set(ctx, b.cache.versionKey("p1"), strconv.FormatInt(ahead, 10), time.Hour).Err())

		require.NoError(t, b.cache.Invalidate(ctx, "p1"))
		_, v, ok, err := b.cache.Peek(ctx, "p1")
		require.NoError(t, err)
		require.False(t, ok, "Invalidate deleted the current value")
		require.Greater(t, v, ahead, "Invalidate moved the version backwards")

		// A fill still carrying the version read before the Invalidate is refused.
		stored, err := b.cache.lua.fill.Run(ctx, b.client,
			[]string{b.cache.versionKey("p1"), b.cache.currentKey("p1"), b.cache.leaseKey("p1")},
			strconv.FormatInt(ahead, 10), joinVersioned(strconv.FormatInt(ahead, 10), []byte(`{}`)), 60000, "").Int()
		require.NoError(t, err)
		require.Zero(t, stored)
	})

	// FLUSHALL, simulated per id (the shared server must not be flushed): a
	// load that began before it must not be stored after it.
	t.Run("BothKeysLost", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		b.truth.write("p1", 1)
		_, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		before := mustVersion(t, b, "p1")
		b.truth.write("p1", 2)
		require.NoError(t, b.client.Del(ctx, b.cache.versionKey("p1"), b.cache.currentKey("p1")).Err())
		stale, err := json.Marshal(product{ID: "p1", Price: 1})
		require.NoError(t, err)
		stored, err := b.cache.lua.fill.Run(ctx, b.client,
			[]string{b.cache.versionKey("p1"), b.cache.currentKey("p1"), b.cache.leaseKey("p1")},
			before, joinVersioned(before, stale), 60000, "").Int()
		require.NoError(t, err)
		require.Zero(t, stored, "no version: nothing may be stored")
		got, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, b.truth.read("p1"), got)
		after := mustVersion(t, b, "p1")
		require.Greater(t, after, before) // same length: string order is numeric order
	})

	// A foreign value under the current key whose prefix is at or above
	// 2^53 (a snowflake id) must not seed the version: Lua's doubles would
	// round "one more" back to the same number, every Invalidate would
	// write the same version again, and a load from before a write would
	// pass the fill.
	t.Run("ForeignCurrentValueBeyond2To53", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		b.truth.write("p1", 100)
		require.NoError(t, b.client.Set(ctx, b.cache.currentKey("p1"), "9007199254740993:foreign", 0).Err())
		_, err := b.cache.Get(ctx, "p1", b.truth.loader("p1")) // replaces it
		require.NoError(t, err)
		before := mustVersion(t, b, "p1")
		require.NoError(t, b.cache.Invalidate(ctx, "p1"))
		require.NotEqual(t, before, mustVersion(t, b, "p1"), "Invalidate left the version as it was")

		// The seed's race: a read loads the old row, a write commits and
		// invalidates, then the read fills.
		old, err := b.cache.Get(ctx, "p1", func(ctx context.Context) (product, error) {
			p := b.truth.read("p1")
			b.truth.write("p1", 200)
			return p, b.cache.Invalidate(ctx, "p1")
		})
		require.NoError(t, err)
		want := b.truth.read("p1")
		require.Less(t, old.Version, want.Version)
		got, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, want, got, "a load from before an acknowledged Invalidate was cached")
	})

	// Anything in the version key that is not a version these scripts
	// write is foreign: Invalidate moves away from it to a version below
	// 2^53, and a fill carrying it is refused. 2^53 - 1 is a version, but
	// one without a successor below 2^53.
	t.Run("ForeignVersionKey", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		data, err := json.Marshal(product{ID: "p1"})
		require.NoError(t, err)
		for i, foreign := range []string{"9007199254740993", "9007199254740992", "9007199254740991", "18446744073709551616", "-5", "0042", "v7", ""} {
			id := fmt.Sprintf("p%d", i)
			keys := []string{b.cache.versionKey(id), b.cache.currentKey(id), b.cache.leaseKey(id)}
			require.NoError(t, b.client.Set(ctx, keys[0], foreign, 0).Err())
			var versions []int64
			for range 2 {
				require.NoError(t, b.cache.Invalidate(ctx, id), foreign)
				v, err := strconv.ParseInt(mustVersion(t, b, id), 10, 64)
				require.NoError(t, err, foreign)
				require.Less(t, v, int64(1)<<53, foreign)
				versions = append(versions, v)
			}
			require.Less(t, versions[0], versions[1], foreign)
			stored, err := b.cache.lua.fill.Run(ctx, b.client, keys, foreign, joinVersioned(foreign, data), 60000, "").Int()
			require.NoError(t, err)
			require.Zero(t, stored, "a fill under the foreign version %q", foreign)
		}
	})

	// doc.go: a P{id}:v holding no version is treated as lost and replaced
	// by the next miss, not only by the next Invalidate: the miss caches
	// under a version of its own, and the next Get is a hit.
	t.Run("ForeignVersionKeyReplacedByMiss", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		for i, foreign := range []string{"9007199254740993", "9007199254740992", "18446744073709551616", "-5", "0042", "v7", ""} {
			id := fmt.Sprintf("p%d", i)
			want := b.truth.write(id, 4900+i)
			require.NoError(t, b.client.Set(ctx, b.cache.versionKey(id), foreign, 0).Err())
			for range 2 {
				got, err := b.cache.Get(ctx, id, b.truth.loader(id))
				require.NoError(t, err, foreign)
				require.Equal(t, want, got, foreign)
			}
			v := b.client.Get(ctx, b.cache.versionKey(id)).Val()
			require.NotEqual(t, foreign, v, "the miss replaced %q", foreign)
			n, err := strconv.ParseInt(v, 10, 64)
			require.NoError(t, err, foreign)
			require.Less(t, n, int64(1)<<53, foreign)
			_, cached, ok, err := b.cache.Peek(ctx, id)
			require.NoError(t, err, foreign)
			require.True(t, ok, foreign)
			require.Equal(t, n, cached, "cached under the new version, not %q", foreign)
		}
		st := b.cache.Stats()
		require.EqualValues(t, 7, st.Misses)
		require.EqualValues(t, 7, st.Hits)
	})

	// read.lua: a miss that re-creates a lost version key while the current
	// value survived but does not decode (another release's shape) starts
	// above the version embedded in that value, as Invalidate does: a
	// re-created version is larger than every version handed out.
	t.Run("UndecodableCurrentValueBoundsARecreatedVersion", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		want := b.truth.write("p1", 4900)
		ahead := time.Now().Add(24 * time.Hour).UnixMicro()
		require.NoError(t, b.client.Set(ctx, b.cache.currentKey("p1"),
			strconv.FormatInt(ahead, 10)+":another release's shape", 0).Err())
		got, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, want, got)
		require.EqualValues(t, 1, b.cache.Stats().DecodeErrors)
		_, v, ok, err := b.cache.Peek(ctx, "p1")
		require.NoError(t, err)
		require.True(t, ok)
		require.Greater(t, v, ahead)
	})

	// The one case that leaves Invalidate no new version: 2^53 - 1 as the
	// version (no successor) and 2^53 - 2 in the current value (whose
	// successor is the version as it is). Invalidate must fail, not
	// silently leave the version where it was.
	t.Run("NoNewVersionIsAnError", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		versionKey, currentKey := b.cache.versionKey("p1"), b.cache.currentKey("p1")
		require.NoError(t, b.client.Set(ctx, versionKey, "9007199254740991", 0).Err())
		require.NoError(t, b.client.Set(ctx, currentKey, "9007199254740990:foreign", 0).Err())
		err := b.cache.Invalidate(ctx, "p1")
		var rerr *RedisError
		require.ErrorAs(t, err, &rerr)
		require.ErrorIs(t, err, ErrRedis)
		require.ErrorContains(t, err, "no new version")
		require.EqualValues(t, 1, b.cache.Stats().RedisErrors)
		require.Zero(t, b.cache.Stats().Invalidations)
		require.Equal(t, "9007199254740991", b.client.Get(ctx, versionKey).Val(), "a refused bump changes nothing")
		require.Equal(t, "9007199254740990:foreign", b.client.Get(ctx, currentKey).Val())

		// Deleting the keys, as the error says, ends it.
		require.NoError(t, b.client.Del(ctx, versionKey, currentKey).Err())
		require.NoError(t, b.cache.Invalidate(ctx, "p1"))
	})

	t.Run("ConcurrentVersionKeyLoss", func(t *testing.T) {
		t.Parallel()
		b := setup(t, &Config{DisableFillLease: true})
		versionLossRace(t, b, 2*time.Second)
	})
}

// versionLossRace runs readers, writers and a goroutine that keeps deleting
// the version key, all at once. A read that begins after a write's
// Invalidate returned must never see an older row version.
func versionLossRace(t *testing.T, b *testBundle, d time.Duration) {
	const id = "hot"
	b.truth.write(id, 0)
	versionKey := keyenc.Tagged(b.prefix, id, suffixVersion)

	var acked, reads, stale, deletes atomic.Int64
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	var wg sync.WaitGroup
	slowLoader := func(ctx context.Context) (product, error) {
		p := b.truth.read(id)
		time.Sleep(200 * time.Microsecond) // widen the read→fill window
		return p, nil
	}
	for range 8 {
		wg.Go(func() {
			for ctx.Err() == nil {
				floor := acked.Load()
				p, err := b.cache.Get(ctx, id, slowLoader)
				if err != nil {
					continue // only the deadline
				}
				reads.Add(1)
				if p.Version < floor {
					stale.Add(1)
				}
			}
		})
	}
	for i := range 2 {
		wg.Go(func() {
			for n := 0; ctx.Err() == nil; n++ {
				p := b.truth.write(id, 1000*i+n)
				if b.cache.Invalidate(context.Background(), id) == nil {
					for {
						cur := acked.Load()
						if p.Version <= cur || acked.CompareAndSwap(cur, p.Version) {
							break
						}
					}
				}
				time.Sleep(time.Millisecond)
			}
		})
	}
	wg.Go(func() {
		for ctx.Err() == nil {
			if b.client.Del(context.Background(), versionKey).Val() == 1 {
				deletes.Add(1)
			}
			time.Sleep(3 * time.Millisecond)
		}
	})
	wg.Wait()
	t.Logf("reads=%d writes=%d version-key deletions=%d stale=%d",
		reads.Load(), acked.Load(), deletes.Load(), stale.Load())
	require.Positive(t, reads.Load())
	require.Positive(t, deletes.Load())
	require.Zero(t, stale.Load())
}

// frozenClockScripts runs every script with Redis's TIME answering micros,
// so that a test can put a version exactly at the clock.
func frozenClockScripts(micros int64) *scripts {
	prelude := fmt.Sprintf(`
local real = redis
local redis = setmetatable({}, {__index = real})
redis.call = function(cmd, ...)
  if string.upper(cmd) == 'TIME' then return {'%d', '%d'} end
  return real.call(cmd, ...)
end
`, micros/1_000_000, micros%1_000_000)
	return newScripts(func(src string) string { return prelude + src })
}

// TestVersionAtTheClock: doc.go says Invalidate sets the version to the
// largest of current+1, the clock and one above the embedded version. At the
// boundary, a version key equal to the clock, the new version is current+1:
// Invalidate must neither fail nor keep the version.
func TestVersionAtTheClock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const clock = int64(1_800_000_000_123_456)
	text := strconv.FormatInt(clock, 10)

	for name, stored := range map[string]struct {
		key   func(c *Cache[product], id string) string
		value string
	}{
		"VersionKeyEqualsClock":      {(*Cache[product]).versionKey, text},
		"EmbeddedVersionEqualsClock": {(*Cache[product]).currentKey, text + ":x"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			b.cache.lua = frozenClockScripts(clock)
			require.NoError(t, b.client.Set(ctx, stored.key(b.cache, "p1"), stored.value, 0).Err())
			require.NoError(t, b.cache.Invalidate(ctx, "p1"))
			require.Equal(t, strconv.FormatInt(clock+1, 10), mustVersion(t, b, "p1"))
		})
	}

	// read.lua: a miss re-creating a lost version key next to an
	// undecodable current value embedding the clock starts above it.
	t.Run("MissAboveEmbeddedVersionAtClock", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		b.cache.lua = frozenClockScripts(clock)
		want := b.truth.write("p1", 7)
		require.NoError(t, b.client.Set(ctx, b.cache.currentKey("p1"), text+":another shape", 0).Err())
		got, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, want, got)
		_, v, ok, err := b.cache.Peek(ctx, "p1")
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, clock+1, v)
	})
}
