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

// GetAt with a row_version column that every write moves: a cheap read of
// the version decides whether the cached value is current, so writes need
// no Invalidate (see GetAt for the trap of a write that forgets the
// version).
func ExampleCache_GetAt() {
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
	if _, err := db.Exec(ctx, `CREATE TEMP TABLE products (id BIGINT PRIMARY KEY, price_cents BIGINT NOT NULL, row_version BIGINT NOT NULL);
		INSERT INTO products VALUES (41, 4900, 1)`); err != nil {
		log.Fatal(err)
	}

	prefix := "example:vc:" + services.RandomSuffix(8) + ":"
	defer cleanup(rdb, prefix)
	cache, err := versioncache.New[Product](rdb, &versioncache.Config{Prefix: prefix})
	if err != nil {
		log.Fatal(err)
	}
	get := func() (Product, error) {
		var version int64
		if err := db.QueryRow(ctx, `SELECT row_version FROM products WHERE id = 41`).Scan(&version); err != nil {
			return Product{}, err
		}
		return cache.GetAt(ctx, "41", version, func(ctx context.Context) (Product, error) {
			var p Product
			err := db.QueryRow(ctx, `SELECT id, price_cents FROM products WHERE id = 41`).Scan(&p.ID, &p.PriceCents)
			return p, err
		})
	}

	p, err := get() // miss: loads and caches at version 1
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("price:", p.PriceCents)
	p, err = get() // hit: version 1 is cached
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("price from cache:", p.PriceCents)

	// The write moves the version; no Invalidate.
	if _, err := db.Exec(ctx, `UPDATE products SET price_cents = 4400, row_version = row_version + 1 WHERE id = 41`); err != nil {
		log.Fatal(err)
	}
	p, err = get() // version 2: loads again
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("price after update:", p.PriceCents)

	st := cache.Stats()
	fmt.Printf("hits=%d loads=%d\n", st.Hits, st.Loads)
	// Output:
	// price: 4900
	// price from cache: 4900
	// price after update: 4400
	// hits=1 loads=2
}
