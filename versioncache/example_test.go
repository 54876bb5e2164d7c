package versioncache_test

import (
	"context"
	"fmt"
	"log"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/services"
	"github.com/verity-go/verity/versioncache"
)

type Product struct {
	ID         int64 `json:"id"`
	PriceCents int64 `json:"price_cents"`
}

func Example() {
	ctx := context.Background()
	ep, err := services.Shared(ctx)
	if err != nil {
		log.Fatal(err)
	}
	db, err := pgx.Connect(ctx, ep.PostgresURL)
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close(ctx)
	opt, err := redis.ParseURL(ep.RedisURL)
	if err != nil {
		log.Fatal(err)
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()

	// A temporary table stands in for the application's own.
	if _, err := db.Exec(ctx, `CREATE TEMP TABLE products (id BIGINT PRIMARY KEY, price_cents BIGINT NOT NULL);
		INSERT INTO products VALUES (41, 4900)`); err != nil {
		log.Fatal(err)
	}

	prefix := "example:vc:" + services.RandomSuffix(8) + ":"
	defer cleanup(rdb, prefix)
	cache, err := versioncache.New[Product](rdb, &versioncache.Config{Prefix: prefix})
	if err != nil {
		log.Fatal(err)
	}
	load := func(ctx context.Context) (Product, error) {
		var p Product
		err := db.QueryRow(ctx, `SELECT id, price_cents FROM products WHERE id = 41`).Scan(&p.ID, &p.PriceCents)
		return p, err
	}

	p, err := cache.Get(ctx, "41", load) // miss: loads and caches
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("price:", p.PriceCents)

	// Write, commit, then invalidate.
	if _, err := db.Exec(ctx, `UPDATE products SET price_cents = 4400 WHERE id = 41`); err != nil {
		log.Fatal(err)
	}
	if err := cache.Invalidate(ctx, "41"); err != nil {
		log.Fatal(err)
	}

	p, err = cache.Get(ctx, "41", load) // new version: loads again
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("price after update:", p.PriceCents)
	p, err = cache.Get(ctx, "41", load) // hit: one round trip
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("price from cache:", p.PriceCents)

	st := cache.Stats()
	fmt.Printf("hits=%d loads=%d invalidations=%d\n", st.Hits, st.Loads, st.Invalidations)
	// Output:
	// price: 4900
	// price after update: 4400
	// price from cache: 4400
	// hits=1 loads=2 invalidations=1
}

func cleanup(rdb *redis.Client, prefix string) {
	ctx := context.Background()
	iter := rdb.Scan(ctx, 0, prefix+"*", 5000).Iterator()
	for iter.Next(ctx) {
		rdb.Unlink(ctx, iter.Val())
	}
}
