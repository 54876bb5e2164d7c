package versioncache_test

import (
	"context"
	"fmt"
	"log"

	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/services"
	"github.com/verity-go/verity/versioncache"
)

// The standing assertion: compare a sample of cached values with the source
// of truth. Here a map is the database, and one write "forgets" Invalidate.
func ExampleCache_Check() {
	ctx := context.Background()
	ep, err := services.Shared(ctx)
	if err != nil {
		log.Fatal(err)
	}
	opt, err := redis.ParseURL(ep.RedisURL)
	if err != nil {
		log.Fatal(err)
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()
	prefix := "example:vc:" + services.RandomSuffix(8) + ":"
	defer cleanup(rdb, prefix)

	prices := map[string]int{"a": 100, "b": 200, "c": 300}
	cache, err := versioncache.New[int](rdb, &versioncache.Config{Prefix: prefix})
	if err != nil {
		log.Fatal(err)
	}
	ids := []string{"a", "b", "c"}
	for _, id := range ids {
		if _, err := cache.Get(ctx, id, func(context.Context) (int, error) { return prices[id], nil }); err != nil {
			log.Fatal(err)
		}
	}
	prices["b"] = 250 // a data fix that bypassed Invalidate

	report, err := cache.Check(ctx, ids, 500, func(ctx context.Context, id string) (int, error) {
		return prices[id], nil
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%d sampled, %d divergent\n", report.Sampled, report.Divergent)
	for _, d := range report.Divergences {
		fmt.Printf("%s: cached %d, database %d\n", d.ID, d.Cached, d.Current)
		if err := cache.Invalidate(ctx, d.ID); err != nil { // repair
			log.Fatal(err)
		}
	}
	// Output:
	// 3 sampled, 1 divergent
	// b: cached 200, database 250
}

// GetAt's trap, caught: a data fix changed a price but not its row_version,
// so GetAt keeps serving the old price under a version that still looks
// current. CheckAt compares values cached at the source's own version.
func ExampleCache_CheckAt() {
	ctx := context.Background()
	ep, err := services.Shared(ctx)
	if err != nil {
		log.Fatal(err)
	}
	opt, err := redis.ParseURL(ep.RedisURL)
	if err != nil {
		log.Fatal(err)
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()
	prefix := "example:vc:" + services.RandomSuffix(8) + ":"
	defer cleanup(rdb, prefix)

	type row struct{ price, version int64 }
	rows := map[string]row{"a": {100, 3}, "b": {200, 7}}
	cache, err := versioncache.New[int64](rdb, &versioncache.Config{Prefix: prefix})
	if err != nil {
		log.Fatal(err)
	}
	ids := []string{"a", "b"}
	for _, id := range ids {
		load := func(context.Context) (int64, error) { return rows[id].price, nil }
		if _, err := cache.GetAt(ctx, id, rows[id].version, load); err != nil {
			log.Fatal(err)
		}
	}
	rows["b"] = row{250, 7} // UPDATE … SET price = 250 (row_version forgotten)

	report, err := cache.CheckAt(ctx, ids, 0, func(ctx context.Context, id string) (int64, int64, error) {
		return rows[id].price, rows[id].version, nil
	})
	if err != nil {
		log.Fatal(err)
	}
	for _, d := range report.Divergences {
		fmt.Printf("%s at version %d: cached %d, database %d\n", d.ID, d.Version, d.Cached, d.Current)
	}
	// Output:
	// b at version 7: cached 200, database 250
}
