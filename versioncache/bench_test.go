package versioncache

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// BenchmarkHit compares a cache hit (one GET of the current key, whose value
// carries its version as a prefix) with a plain GET plus decode of the same
// value, and with the seed's second round trip for the version.
//
//	go test -run XXX -bench Hit -benchtime 2s ./versioncache
func BenchmarkHit(b *testing.B) {
	ctx := context.Background()
	rd := testenv.Redis(b)
	cache, err := New[product](rd.Client, &Config{Prefix: rd.Prefix})
	require.NoError(b, err)
	want := product{ID: "p1", Price: 4900, Version: 1}
	load := func(context.Context) (product, error) { return want, nil }
	_, err = cache.Get(ctx, "p1", load)
	require.NoError(b, err)

	b.Run("Versioned", func(b *testing.B) {
		for b.Loop() {
			if _, err := cache.Get(ctx, "p1", load); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("PlainGET", func(b *testing.B) {
		key := rd.Prefix + "plain"
		data, _ := json.Marshal(want)
		require.NoError(b, rd.Client.Set(ctx, key, data, 0).Err())
		for b.Loop() {
			raw, err := rd.Client.Get(ctx, key).Bytes()
			if err != nil {
				b.Fatal(err)
			}
			var p product
			if err := json.Unmarshal(raw, &p); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("TwoRoundTrips", func(b *testing.B) {
		// The seed's scheme: GET the version, then GET the value.
		vkey, dkey := rd.Prefix+"v", rd.Prefix+"d:7"
		data, _ := json.Marshal(want)
		require.NoError(b, rd.Client.Set(ctx, vkey, "7", 0).Err())
		require.NoError(b, rd.Client.Set(ctx, dkey, data, 0).Err())
		for b.Loop() {
			v, err := rd.Client.Get(ctx, vkey).Result()
			if err != nil {
				b.Fatal(err)
			}
			raw, err := rd.Client.Get(ctx, rd.Prefix+"d:"+v).Bytes()
			if err != nil {
				b.Fatal(err)
			}
			var p product
			if err := json.Unmarshal(raw, &p); err != nil {
				b.Fatal(err)
			}
		}
	})
	require.Zero(b, cache.Stats().RedisErrors)
}
