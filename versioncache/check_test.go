package versioncache

import (
	"context"
	"fmt"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

func TestCheck(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	fill := func(t *testing.T, b *testBundle, n int) []string {
		t.Helper()
		ids := make([]string, n)
		for i := range ids {
			ids[i] = fmt.Sprintf("p%d", i)
			b.truth.write(ids[i], 100+i)
			_, err := b.cache.Get(ctx, ids[i], b.truth.loader(ids[i]))
			require.NoError(t, err)
		}
		return ids
	}
	byID := func(b *testBundle) IDLoader[product] {
		return func(ctx context.Context, id string) (product, error) { return b.truth.read(id), nil }
	}

	t.Run("HonestCache", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		ids := fill(t, b, 20)
		ids = append(ids, "never-read", ids[0], "never-read") // listed twice: checked once
		report, err := b.cache.Check(ctx, ids, 0, byID(b))
		require.NoError(t, err)
		require.Equal(t, 21, report.Sampled)
		require.Equal(t, 20, report.Cached)
		require.Equal(t, 1, report.NotCached)
		require.Zero(t, report.Divergent)
	})

	t.Run("FindsDivergence", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		ids := fill(t, b, 20)
		// A write nobody invalidated: exactly the bug the check exists for.
		want := b.truth.write("p7", 1)

		report, err := b.cache.Check(ctx, ids, 0, byID(b))
		require.NoError(t, err)
		require.Equal(t, 1, report.Divergent)
		require.Len(t, report.Divergences, 1)
		d := report.Divergences[0]
		require.Equal(t, "p7", d.ID)
		require.Equal(t, 107, d.Cached.Price)
		require.Equal(t, want, d.Current)
		_, version, _, err := b.cache.Peek(ctx, "p7")
		require.NoError(t, err)
		require.Equal(t, version, d.Version)
		raw, err := b.client.Get(ctx, b.cache.currentKey("p7")).Bytes()
		require.NoError(t, err)
		stored, _, err := splitVersioned(raw)
		require.NoError(t, err)
		require.Equal(t, stored, d.Version, "reported under the version it is cached under")
	})

	// gob encodes a map in iteration order: equal values, different bytes.
	t.Run("NondeterministicCodec", func(t *testing.T) {
		t.Parallel()
		rd := testenv.Redis(t)
		cache, err := New[map[string]int](rd.Client, &Config{Prefix: rd.Prefix, Codec: gobCodec{}})
		require.NoError(t, err)
		row := make(map[string]int)
		for i := range 16 {
			row[fmt.Sprintf("k%d", i)] = i
		}
		load := func(context.Context, string) (map[string]int, error) { return row, nil }
		_, err = cache.Get(ctx, "r", func(ctx context.Context) (map[string]int, error) { return load(ctx, "r") })
		require.NoError(t, err)
		for range 10 {
			report, err := cache.Check(ctx, []string{"r"}, 0, load)
			require.NoError(t, err)
			require.Equal(t, 1, report.Cached)
			require.Zero(t, report.Divergent, "%+v", report.Divergences)
		}
		row["k3"] = 300 // and a real divergence is still found
		report, err := cache.Check(ctx, []string{"r"}, 0, load)
		require.NoError(t, err)
		require.Equal(t, 1, report.Divergent)
	})

	// Get reloads and overwrites a cached value that does not decode, so it
	// is never served: Check counts it and goes on to the other ids.
	t.Run("CountsUndecodable", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		ids := fill(t, b, 5)
		require.NoError(t, b.client.Set(ctx, b.cache.currentKey("p2"), "1:not json", 0).Err())
		report, err := b.cache.Check(ctx, ids, 0, byID(b))
		require.NoError(t, err)
		require.Equal(t, 5, report.Sampled)
		require.Equal(t, 4, report.Cached)
		require.Equal(t, 1, report.Undecodable)
		require.Zero(t, report.Divergent)
		require.EqualValues(t, 1, b.cache.Stats().DecodeErrors)
	})

	// A value that decoded at the first look and not at the confirming one
	// was replaced meanwhile: like any change mid-comparison, it is Moved.
	t.Run("ReplacedByUndecodableIsMoved", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		ids := fill(t, b, 1)
		_, version, _, err := b.cache.Peek(ctx, ids[0])
		require.NoError(t, err)
		calls := 0
		report, err := b.cache.Check(ctx, ids, 0, func(ctx context.Context, id string) (product, error) {
			calls++
			if calls == 1 {
				bad := fmt.Sprintf("%d:not json", version)
				if err := b.client.Set(ctx, b.cache.currentKey(id), bad, 0).Err(); err != nil {
					return product{}, err
				}
				return product{ID: id, Price: -1}, nil // differs: Check looks again
			}
			return b.truth.read(id), nil
		})
		require.NoError(t, err)
		require.Equal(t, 1, report.Cached)
		require.Equal(t, 1, report.Moved)
		require.Zero(t, report.Divergent)
	})

	t.Run("Samples", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		ids := fill(t, b, 20)
		seen := map[string]bool{}
		for range 10 {
			report, err := b.cache.Check(ctx, ids, 5, func(ctx context.Context, id string) (product, error) {
				seen[id] = true
				return b.truth.read(id), nil
			})
			require.NoError(t, err)
			require.Equal(t, 5, report.Sampled)
			require.Equal(t, 5, report.Cached)
		}
		require.Greater(t, len(seen), 5, "samples differ between runs")
	})

	// The report returned with an error adds up: the id whose Peek failed
	// was not classified, so it is not counted as sampled either.
	t.Run("PartialReportAddsUp", func(t *testing.T) {
		t.Parallel()
		rd := testenv.Redis(t)
		opt, err := redis.ParseURL(rd.URL)
		require.NoError(t, err)
		client := redis.NewClient(opt)
		b := setupWith(t, client, rd.Prefix, nil)
		require.NoError(t, client.Close()) // every Peek fails
		report, err := b.cache.Check(ctx, []string{"p1"}, 0, byID(b))
		require.ErrorIs(t, err, ErrRedis)
		require.Equal(t, CheckReport[product]{}, report)
	})

	t.Run("NilLoader", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		_, err := b.cache.Check(ctx, []string{"a"}, 1, nil)
		require.ErrorIs(t, err, ErrNilLoader)
	})
}

// TestCheckAtValueGoneDuringConfirmation: in CheckAt a cached value that is
// deleted or stops decoding between the two reads was replaced while it was
// compared: Moved, as Check counts it, never a Divergence reporting a zero
// value as cached.
func TestCheckAtValueGoneDuringConfirmation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, tc := range map[string]struct {
		version int64
		replace func(b *testBundle) error
	}{
		"DeletedAtVersionZero": {0, func(b *testBundle) error { return b.cache.Invalidate(ctx, "p1") }},
		"UndecodableAtSameVersion": {5, func(b *testBundle) error {
			return b.client.Set(ctx, b.cache.atKey("p1"), "5:another release's shape", 0).Err()
		}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			cached := product{ID: "p1", Price: 1, Version: tc.version}
			_, err := b.cache.GetAt(ctx, "p1", tc.version, func(context.Context) (product, error) { return cached, nil })
			require.NoError(t, err)
			// A write that kept the version; the first load also sees the
			// cached value replaced right after it (a write in flight).
			current := product{ID: "p1", Price: 2, Version: tc.version}
			calls := 0
			report, err := b.cache.CheckAt(ctx, []string{"p1"}, 0, func(ctx context.Context, id string) (product, int64, error) {
				calls++
				if calls == 1 {
					if err := tc.replace(b); err != nil {
						return product{}, 0, err
					}
				}
				return current, tc.version, nil
			})
			require.NoError(t, err)
			require.Equal(t, 1, report.Moved, "%+v", report)
			require.Zero(t, report.Divergent, "%+v", report.Divergences)
		})
	}
}
