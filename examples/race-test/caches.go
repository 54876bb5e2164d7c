package main

import (
	"context"
	"encoding/json"
	"errors"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/versioncache"
)

// product is the cached row. RowVersion is incremented by the database on
// every write and is how staleness is judged.
type product struct {
	ID         int64 `json:"id"`
	PriceCents int64 `json:"price_cents"`
	RowVersion int64 `json:"row_version"`
}

// productCache is what the readers and writers exercise; one implementation
// per mode.
type productCache interface {
	Get(ctx context.Context, id string, load func(context.Context) (product, error)) (product, error)
	// Invalidate is called after the write's transaction committed.
	Invalidate(ctx context.Context, id string) error
	// Peek returns what a reader would be served from the cache alone.
	Peek(ctx context.Context, id string) (product, bool, error)
}

var (
	_ productCache = (*naiveCache)(nil)
	_ productCache = (*versionedCache)(nil)
)

// naiveCache is the seed's "standard advice": read-through on a miss, delete
// on write. It narrows the stale-set race without closing it.
type naiveCache struct {
	client redis.UniversalClient
	prefix string
	ttl    time.Duration
}

func (c *naiveCache) key(id string) string { return c.prefix + "product:" + id }

func (c *naiveCache) Get(ctx context.Context, id string, load func(context.Context) (product, error)) (product, error) {
	if p, ok, err := c.Peek(ctx, id); err != nil || ok {
		return p, err
	}
	p, err := load(ctx)
	if err != nil {
		return p, err
	}
	data, err := json.Marshal(p)
	if err != nil {
		return p, err
	}
	// The window: a write that commits and deletes between load and here is
	// overwritten by this older value until the TTL.
	return p, c.client.Set(ctx, c.key(id), data, c.ttl).Err()
}

func (c *naiveCache) Invalidate(ctx context.Context, id string) error {
	return c.client.Del(ctx, c.key(id)).Err()
}

func (c *naiveCache) Peek(ctx context.Context, id string) (product, bool, error) {
	var p product
	data, err := c.client.Get(ctx, c.key(id)).Bytes()
	if errors.Is(err, redis.Nil) {
		return p, false, nil
	}
	if err != nil {
		return p, false, err
	}
	return p, true, json.Unmarshal(data, &p)
}

// versionedCache adapts versioncache.Cache.
type versionedCache struct {
	cache *versioncache.Cache[product]
}

func (c *versionedCache) Get(ctx context.Context, id string, load func(context.Context) (product, error)) (product, error) {
	return c.cache.Get(ctx, id, load)
}

func (c *versionedCache) Invalidate(ctx context.Context, id string) error {
	return c.cache.Invalidate(ctx, id)
}

func (c *versionedCache) Peek(ctx context.Context, id string) (product, bool, error) {
	p, _, ok, err := c.cache.Peek(ctx, id)
	return p, ok, err
}
