package versioncache

import (
	"context"
	"encoding/json"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestGetAt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("KeyedByCallerVersion", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		v1 := b.truth.write("p1", 4900)
		got, err := b.cache.GetAt(ctx, "p1", v1.Version, b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, v1, got)
		got, err = b.cache.GetAt(ctx, "p1", v1.Version, b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, v1, got)
		require.EqualValues(t, 1, b.truth.loads.Load(), "second read is a hit")

		v2 := b.truth.write("p1", 4400)
		got, err = b.cache.GetAt(ctx, "p1", v2.Version, b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, v2, got)
		require.EqualValues(t, 2, b.truth.loads.Load())
	})

	// The documented trap: a write that does not move the version (a bulk
	// UPDATE forgetting row_version) is invisible to GetAt until TTL.
	t.Run("TrapWriteWithoutVersionBump", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		v1 := b.truth.write("p1", 4900)
		_, err := b.cache.GetAt(ctx, "p1", v1.Version, b.truth.loader("p1"))
		require.NoError(t, err)

		b.truth.mu.Lock()
		row := b.truth.rows["p1"]
		row.Price = 1 // "bulk UPDATE" that leaves the version alone
		b.truth.rows["p1"] = row
		b.truth.mu.Unlock()

		got, err := b.cache.GetAt(ctx, "p1", row.Version, b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, 4900, got.Price, "GetAt cannot see a write that keeps the version")

		// Get with Invalidate after the write is not fooled.
		require.NoError(t, b.cache.Invalidate(ctx, "p1"))
		got, err = b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, 1, got.Price)
	})

	// One key per id holds the newest version stored: an older caller
	// version is served the newer value (ahead, never stale), and a slow
	// load under an older version cannot overwrite it.
	t.Run("VersionNeverGoesBackwards", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		v1 := b.truth.write("p1", 4900)
		v2 := b.truth.write("p1", 4400)
		got, err := b.cache.GetAt(ctx, "p1", v2.Version, b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, v2, got)

		got, err = b.cache.GetAt(ctx, "p1", v1.Version, b.truth.loader("p1"))
		require.NoError(t, err)
		require.Equal(t, v2, got, "an older caller version is served the newer value")
		require.EqualValues(t, 1, b.truth.loads.Load())

		// A load under the older version that finishes late is refused.
		old := strconv.FormatInt(v1.Version, 10)
		stored, err := b.cache.lua.fillAt.Run(ctx, b.client, []string{b.cache.atKey("p1")},
			old, joinVersioned(old, []byte("{}")), 60000).Int()
		require.NoError(t, err)
		require.Zero(t, stored)
		// Versions are compared as numbers, not strings: 10 > 9.
		require.NoError(t, b.client.Set(ctx, b.cache.atKey("p1"), "9:{}", 0).Err())
		stored, err = b.cache.lua.fillAt.Run(ctx, b.client, []string{b.cache.atKey("p1")}, "10", "10:{}", 60000).Int()
		require.NoError(t, err)
		require.EqualValues(t, 1, stored)
		stored, err = b.cache.lua.fillAt.Run(ctx, b.client, []string{b.cache.atKey("p1")}, "9", "9:{}", 60000).Int()
		require.NoError(t, err)
		require.Zero(t, stored)
	})

	// A stored value that does not decode is a miss for every caller. It
	// must be replaced even when it claims a newer version than the
	// caller's; otherwise every caller below that version loads until TTL.
	t.Run("UndecodableValueIsReplaced", func(t *testing.T) {
		t.Parallel()
		for _, tc := range []struct{ name, stored string }{
			{"NewerVersion", "9000000000000000000:not json"},
			{"VersionOverflowsInt64", "99999999999999999999:{}"},
			{"NoNumericVersion", "v2:{}"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				t.Parallel()
				b := setup(t, nil)
				v1 := b.truth.write("p1", 4900)
				require.NoError(t, b.client.Set(ctx, b.cache.atKey("p1"), tc.stored, 0).Err())
				for range 2 {
					got, err := b.cache.GetAt(ctx, "p1", v1.Version, b.truth.loader("p1"))
					require.NoError(t, err)
					require.Equal(t, v1, got)
				}
				require.EqualValues(t, 1, b.truth.loads.Load(), "the load replaced it: the second read is a hit")
				require.EqualValues(t, 1, b.cache.Stats().DecodeErrors)
				raw, err := b.client.Get(ctx, b.cache.atKey("p1")).Bytes()
				require.NoError(t, err)
				stored, _, err := splitVersioned(raw)
				require.NoError(t, err)
				require.Equal(t, v1.Version, stored, "stored under the caller's version")
			})
		}
	})

	// The replacement is a compare-and-set on the bytes that did not decode:
	// a valid value written meanwhile (by a process whose codec reads it)
	// stays.
	t.Run("ReplacementKeepsConcurrentWrite", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		v1 := b.truth.write("p1", 4900)
		v2 := b.truth.write("p1", 4400)
		require.NoError(t, b.client.Set(ctx, b.cache.atKey("p1"), "9000000000000000000:not json", 0).Err())
		newer, err := json.Marshal(v2)
		require.NoError(t, err)
		valid := string(joinVersioned(strconv.FormatInt(v2.Version, 10), newer))
		got, err := b.cache.GetAt(ctx, "p1", v1.Version, func(ctx context.Context) (product, error) {
			// Another process fills a newer, valid value during the load.
			if err := b.client.Set(ctx, b.cache.atKey("p1"), valid, 0).Err(); err != nil {
				return product{}, err
			}
			return v1, nil
		})
		require.NoError(t, err)
		require.Equal(t, v1, got)
		raw, err := b.client.Get(ctx, b.cache.atKey("p1")).Result()
		require.NoError(t, err)
		require.Equal(t, valid, raw)
		require.EqualValues(t, 1, b.cache.Stats().StaleFillsSkipped)
	})

	t.Run("BadInput", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		_, err := b.cache.GetAt(ctx, "p1", -1, b.truth.loader("p1"))
		require.ErrorIs(t, err, ErrInvalidVersion)
		_, err = b.cache.GetAt(ctx, "p1", 1, nil)
		require.ErrorIs(t, err, ErrNilLoader)
		require.Zero(t, b.truth.loads.Load())
	})
}
