package reconcile

import (
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/projection"
)

func TestConfig(t *testing.T) {
	t.Parallel()

	t.Run("Defaults", func(t *testing.T) {
		t.Parallel()
		cfg := (*Config)(nil).WithDefaults()
		require.Equal(t, PageSizeDefault, cfg.PageSize)
		require.Equal(t, ReadAheadDefault, cfg.ReadAhead)
		require.Equal(t, ExamplesPerClassDefault, cfg.ExamplesPerClass)
		require.Equal(t, RepairTimeoutDefault, cfg.RepairTimeout)
		require.Equal(t, RebuildMarkerTTLDefault, cfg.RebuildMarkerTTL)
		require.Equal(t, projection.MaxValueBytesDefault, cfg.MaxValueBytes)
		require.NotNil(t, cfg.Logger)
		require.NoError(t, cfg.validate())

		mine := &Config{ReadAhead: 9}
		got := mine.WithDefaults()
		require.Equal(t, 9, got.ReadAhead, "a set field is kept")
		require.Zero(t, mine.PageSize, "WithDefaults returns a copy")
	})

	// New refuses a bad field with a *ConfigError naming it; the target is
	// valid and never contacted.
	t.Run("Invalid", func(t *testing.T) {
		t.Parallel()
		client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
		t.Cleanup(func() { client.Close() })
		ks, err := projection.NewKeyspace("cfg:")
		require.NoError(t, err)
		target := Target{Client: client, Keyspace: ks, Kind: projection.KindSortedSet, Name: "board"}
		src := &countingSource{} // New only checks that a source is given
		for field, cfg := range map[string]*Config{
			"Config.PageSize":         {PageSize: 100_001},
			"Config.ReadAhead":        {ReadAhead: -1},
			"Config.ExamplesPerClass": {ExamplesPerClass: -2},
			"Config.RepairTimeout":    {RepairTimeout: -time.Second},
			"Config.RebuildMarkerTTL": {RebuildMarkerTTL: time.Millisecond},
			"Config.MaxValueBytes":    {MaxValueBytes: -1},
			"Config.Policy.Orphan":    {Policy: Policy{Orphan: ActionRepair + 1}},
			"Config.Policy.Missing":   {Policy: Policy{Missing: ActionRepair + 1}},
			"Config.Policy.Stale":     {Policy: Policy{Stale: ActionRepair + 1}},
			"Config.Policy.Corrupt":   {Policy: Policy{Corrupt: ActionRepair + 1}},
		} {
			_, err := New(src, target, cfg)
			var cfgErr *ConfigError
			require.ErrorAs(t, err, &cfgErr, field)
			require.Equal(t, field, cfgErr.Field)
			require.ErrorIs(t, err, ErrInvalidConfig)
		}
		_, err = New(src, target, &Config{ReadAhead: ReadAheadMax + 1})
		require.ErrorContains(t, err, "Config.ReadAhead: must be between 1 and 64")
		// Too short for any Redis round trip: every repair would fail,
		// and a Rebuild report a switch it never sent as uncertain.
		_, err = New(src, target, &Config{RepairTimeout: time.Millisecond - 1})
		require.ErrorContains(t, err, "Config.RepairTimeout: is 999.999µs; use at least 1ms")
		_, err = New(src, target, &Config{RepairTimeout: time.Millisecond, PageSize: 10})
		require.NoError(t, err)
		// A page's repairs are one batch: a timeout no such batch can
		// meet would leave every missing or stale page unrepaired.
		_, err = New(src, target, &Config{RepairTimeout: time.Millisecond})
		require.ErrorContains(t, err, "Config.RepairTimeout: is 1ms, too short for a batch of repairs of a page of Config.PageSize (1000) rows; use at least 100ms")
		_, err = New(src, target, &Config{PageSize: PageSizeMax, RepairTimeout: 10*time.Second - 1})
		require.ErrorContains(t, err, "use at least 10s")
		_, err = New(src, target, &Config{ReadAhead: ReadAheadMax, PageSize: PageSizeMax, RebuildMarkerTTL: 100 * time.Millisecond})
		require.ErrorContains(t, err, "Config.RebuildMarkerTTL: is 100ms, too short to outlast reading and copying a page of Config.PageSize (100000) rows; use at least 10s")
		_, err = New(src, target, &Config{ReadAhead: ReadAheadMax, PageSize: PageSizeMax, RebuildMarkerTTL: 10 * time.Second})
		require.NoError(t, err, "the largest ReadAhead and PageSize with the shortest RebuildMarkerTTL they allow are valid")
		_, err = New(src, target, &Config{RebuildMarkerTTL: 100 * time.Millisecond})
		require.NoError(t, err, "the shortest RebuildMarkerTTL is valid with the default PageSize")
	})

	// Repairs and Rebuild's switch run detached, bounded by RepairTimeout
	// through the command's deadline: a client that can wait for Redis
	// forever would hold them, and a cancelled Run, for good.
	t.Run("UnboundedClientRefused", func(t *testing.T) {
		t.Parallel()
		ks, err := projection.NewKeyspace("cfg:")
		require.NoError(t, err)
		for name, tc := range map[string]struct {
			opts  redis.Options
			field string
		}{
			"NoReadTimeout":  {redis.Options{ReadTimeout: -1}, "Target.Client Options.ReadTimeout"},
			"NoDeadline":     {redis.Options{ReadTimeout: -2, ContextTimeoutEnabled: true}, "Target.Client Options.ReadTimeout"},
			"NoWriteTimeout": {redis.Options{WriteTimeout: -1}, "Target.Client Options.WriteTimeout"},
			"Bounded":        {redis.Options{ReadTimeout: -1, WriteTimeout: -1, ContextTimeoutEnabled: true}, ""},
			"Defaults":       {redis.Options{}, ""},
		} {
			opts := tc.opts
			opts.Addr = "127.0.0.1:1"
			client := redis.NewClient(&opts)
			t.Cleanup(func() { client.Close() })
			_, err := New(&countingSource{}, Target{Client: client, Keyspace: ks, Kind: projection.KindSortedSet, Name: "board"}, nil)
			if tc.field == "" {
				require.NoError(t, err, name)
				continue
			}
			var cfgErr *ConfigError
			require.ErrorAs(t, err, &cfgErr, name)
			require.Equal(t, tc.field, cfgErr.Field, name)
			require.ErrorIs(t, err, ErrInvalidConfig, name)
		}
	})
}
