package versioncache

import (
	"context"
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
		stored, err := fillAtScript.Run(ctx, b.client, []string{b.cache.atKey("p1")},
			old, joinVersioned(old, []byte("{}")), 60000).Int()
		require.NoError(t, err)
		require.Zero(t, stored)
		// Versions are compared as numbers, not strings: 10 > 9.
		require.NoError(t, b.client.Set(ctx, b.cache.atKey("p1"), "9:{}", 0).Err())
		stored, err = fillAtScript.Run(ctx, b.client, []string{b.cache.atKey("p1")}, "10", "10:{}", 60000).Int()
		require.NoError(t, err)
		require.EqualValues(t, 1, stored)
		stored, err = fillAtScript.Run(ctx, b.client, []string{b.cache.atKey("p1")}, "9", "9:{}", 60000).Int()
		require.NoError(t, err)
		require.Zero(t, stored)
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
