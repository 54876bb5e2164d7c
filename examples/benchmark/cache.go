package main

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"time"

	"github.com/verity-go/verity/versioncache"
)

// product is the cached value: a small JSON document, as in the seed.
type product struct {
	ID    string `json:"id"`
	Name  string `json:"name"`
	Price int64  `json:"price_cents"`
}

const cacheWarmup = 500

// runCache measures the latency of a cache hit, one sequential client:
// versioncache.Get (one GET of the id's current-value key, which embeds its version) against a
// plain GET of a cached value (no version, the floor) and against the seed's
// versioned read (GET the version, then GET the value key under it). All
// three decode the same JSON. The three reads are interleaved call by call,
// so that load from other processes falls on all of them alike, and their
// order rotates each round, so that none always runs right after the same
// one: in a fixed order (this one, library first) the hit measured up to
// 10 % above the plain GET after the drain or ingest group, and within 3 %
// rotated (benchmark README).
func runCache(ctx context.Context, e *env) ([]Figure, error) {
	kp := e.keyPrefix("cache")
	cache, err := versioncache.New[product](e.rdb, &versioncache.Config{Prefix: kp + "lib:"})
	if err != nil {
		return nil, err
	}
	want := product{ID: "41", Name: "a product with a reasonably long name", Price: 4900}
	load := func(context.Context) (product, error) { return want, nil }
	if _, err := cache.Get(ctx, want.ID, load); err != nil { // fill
		return nil, err
	}
	data, err := json.Marshal(want)
	if err != nil {
		return nil, err
	}
	plainKey := kp + "plain:product:41"
	seedVersionKey, seedValueKey := kp+"seed:product:41:v", kp+"seed:product:41:7"
	if err := e.rdb.Set(ctx, plainKey, data, time.Hour).Err(); err != nil {
		return nil, err
	}
	if err := e.rdb.Set(ctx, seedVersionKey, "7", 0).Err(); err != nil {
		return nil, err
	}
	if err := e.rdb.Set(ctx, seedValueKey, data, time.Hour).Err(); err != nil {
		return nil, err
	}

	reads := []func() error{
		func() error { // library
			got, err := cache.Get(ctx, want.ID, load)
			if err == nil && got != want {
				err = fmt.Errorf("versioncache returned %+v", got)
			}
			return err
		},
		func() error { // plain GET
			raw, err := e.rdb.Get(ctx, plainKey).Bytes()
			if err != nil {
				return err
			}
			var p product
			return json.Unmarshal(raw, &p)
		},
		func() error { // seed: version, then value
			v, err := e.rdb.Get(ctx, seedVersionKey).Result()
			if err != nil {
				return err
			}
			raw, err := e.rdb.Get(ctx, kp+"seed:product:41:"+v).Bytes()
			if err != nil {
				return err
			}
			var p product
			return json.Unmarshal(raw, &p)
		},
	}
	n := e.opts.Sizes.CacheReads
	samples := make([][]time.Duration, len(reads))
	for i := range samples {
		samples[i] = make([]time.Duration, 0, n)
	}
	for i := range cacheWarmup + n {
		for k := range reads {
			j := (i + k) % len(reads)
			start := time.Now()
			if err := reads[j](); err != nil {
				return nil, err
			}
			if i >= cacheWarmup {
				samples[j] = append(samples[j], time.Since(start))
			}
		}
	}
	for _, s := range samples {
		slices.Sort(s)
	}
	if st := cache.Stats(); st.Loads != 1 {
		return nil, fmt.Errorf("versioncache loaded %d times; every timed read should have been a hit", st.Loads)
	}
	lib, plain, seed := samples[0], samples[1], samples[2]
	e.log("cache: p50 lib %.0fµs plain %.0fµs seed %.0fµs", us(percentile(lib, .5)), us(percentile(plain, .5)), us(percentile(seed, .5)))
	return []Figure{
		newFigure("cache_hit_p50", "µs", us(percentile(lib, .5)), us(percentile(plain, .5))),
		newFigure("cache_hit_p99", "µs", us(percentile(lib, .99)), us(percentile(plain, .99))),
		newFigure("cache_hit_p50_vs_seed", "µs", us(percentile(lib, .5)), us(percentile(seed, .5))),
		newFigure("cache_hit_p99_vs_seed", "µs", us(percentile(lib, .99)), us(percentile(seed, .99))),
	}, nil
}
