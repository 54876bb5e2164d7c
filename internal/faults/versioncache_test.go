package faults

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/versioncache"
)

// cachedRow is the value the race test caches: a row and its version.
type cachedRow struct {
	ID         int64 `json:"id"`
	Value      int64 `json:"value"`
	RowVersion int64 `json:"row_version"`
}

// TestVersionCacheRedisLoss runs the race-test workload (readers through a
// read-through cache, writers updating PostgreSQL and invalidating after
// commit) against a private Redis, and in the middle of it deletes the
// version keys and kills and restarts Redis (empty), several times. A read
// that starts after a write was acknowledged (committed and invalidated)
// must never return an older row: lost versions must never let an old value
// back in.
func TestVersionCacheRedisLoss(t *testing.T) {
	t.Parallel()
	var (
		duration = size(3*time.Second, 60*time.Second)
		readers  = 8
		writers  = 2
		ids      = 4
	)
	pg := testenv.Postgres(t)
	rs := testenv.StartRedis(t)
	rdb := redis.NewClient(&redis.Options{Addr: rs.Addr(), DialTimeout: 500 * time.Millisecond,
		ReadTimeout: 500 * time.Millisecond, WriteTimeout: 500 * time.Millisecond})
	t.Cleanup(func() { _ = rdb.Close() })
	ctx := context.Background()
	_, err := pg.Pool.Exec(ctx, `CREATE TABLE cached_rows (id bigint PRIMARY KEY, value bigint NOT NULL, row_version bigint NOT NULL)`)
	require.NoError(t, err)
	_, err = pg.Pool.Exec(ctx, `INSERT INTO cached_rows SELECT g, 0, 1 FROM generate_series(1, $1::int) g`, ids)
	require.NoError(t, err)

	const prefix = "verity:faults:vc:"
	cache, err := versioncache.New[cachedRow](rdb, &versioncache.Config{Prefix: prefix, TTL: time.Hour})
	require.NoError(t, err)
	load := func(id int64) versioncache.Loader[cachedRow] {
		return func(ctx context.Context) (cachedRow, error) {
			var r cachedRow
			err := pg.Pool.QueryRow(ctx, `SELECT id, value, row_version FROM cached_rows WHERE id = $1`, id).
				Scan(&r.ID, &r.Value, &r.RowVersion)
			time.Sleep(2 * time.Millisecond) // widens the load-to-fill window, as race-test's --window
			return r, err
		}
	}

	acked := make([]atomic.Int64, ids+1) // highest acknowledged row_version per id
	for i := range acked {
		acked[i].Store(1)
	}
	var reads, stale, readErrors, writes, invalidateRetries atomic.Int64
	runCtx, stop := context.WithTimeout(ctx, duration)
	defer stop()
	var wg sync.WaitGroup
	for r := range readers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for n := 0; runCtx.Err() == nil; n++ {
				id := int64(1 + (r+n)%ids)
				watermark := acked[id].Load()
				got, err := cache.Get(ctx, strconv.FormatInt(id, 10), load(id))
				reads.Add(1)
				switch {
				case err != nil:
					readErrors.Add(1)
				case got.RowVersion < watermark:
					stale.Add(1)
				}
			}
		}()
	}
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for n := 0; runCtx.Err() == nil; n++ {
				id := int64(1 + (w+n)%ids)
				var version int64
				if err := pg.Pool.QueryRow(ctx,
					`UPDATE cached_rows SET value = value + 1, row_version = row_version + 1 WHERE id = $1 RETURNING row_version`,
					id).Scan(&version); err != nil {
					t.Errorf("write: %v", err)
					return
				}
				// The write is acknowledged once the invalidation succeeded;
				// while Redis is down that takes retries.
				for attempt := 0; ; attempt++ {
					if err := cache.Invalidate(ctx, strconv.FormatInt(id, 10)); err == nil {
						break
					}
					invalidateRetries.Add(1)
					if attempt > 500 {
						t.Errorf("invalidate of %d failed for too long", id)
						return
					}
					time.Sleep(10 * time.Millisecond)
				}
				writes.Add(1)
				for {
					cur := acked[id].Load()
					if version <= cur || acked[id].CompareAndSwap(cur, version) {
						break
					}
				}
				time.Sleep(time.Millisecond)
			}
		}()
	}

	// Version keys also vanish every 5 ms: a lost version must never come
	// back as one a load still in flight was started under, and at the
	// loop's pace below no load lasts from one loss to the next.
	var dropped atomic.Int64
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for runCtx.Err() == nil {
			<-tick.C
			if keys, err := rdb.Keys(ctx, prefix+"*:v").Result(); err == nil && len(keys) > 0 {
				if n, err := rdb.Del(ctx, keys...).Result(); err == nil {
					dropped.Add(n)
				}
			}
		}
	}()

	// Faults: alternately delete every version key and kill + restart Redis.
	var versionKeysDeleted, restarts int
	for i := 0; runCtx.Err() == nil; i++ {
		select {
		case <-runCtx.Done():
		case <-time.After(300 * time.Millisecond):
		}
		if runCtx.Err() != nil {
			break
		}
		if i%2 == 0 {
			keys, err := rdb.Keys(ctx, prefix+"*:v").Result() // a private server: KEYS is fine
			if err == nil && len(keys) > 0 {
				n, err := rdb.Del(ctx, keys...).Result()
				if err == nil {
					versionKeysDeleted += int(n)
				}
			}
		} else {
			require.NoError(t, rs.Kill())
			time.Sleep(50 * time.Millisecond)
			require.NoError(t, rs.Start())
			restarts++
		}
	}
	wg.Wait()
	versionKeysDeleted += int(dropped.Load())

	// After the run, every id reads its current row.
	for id := int64(1); id <= int64(ids); id++ {
		got, err := cache.Get(ctx, strconv.FormatInt(id, 10), load(id))
		require.NoError(t, err)
		want, err := load(id)(ctx)
		require.NoError(t, err)
		require.Equal(t, want, got, "id %d after the run", id)
	}
	require.Positive(t, versionKeysDeleted, "the version-key fault never hit")
	require.Positive(t, restarts)
	require.Positive(t, writes.Load())
	require.Zero(t, stale.Load(), "stale reads after acknowledgement")
	require.Zero(t, readErrors.Load(), "FailOpen reads must serve the loader's value, not fail")
	summary(t, "versioncache", "version-key-loss-and-restart",
		"faults", versionKeysDeleted+restarts, "version_keys_deleted", versionKeysDeleted, "redis_restarts", restarts,
		"reads", reads.Load(), "writes", writes.Load(), "invalidate_retries", invalidateRetries.Load(),
		"stale_reads_after_ack", stale.Load(), "lost", 0, "duration", fmt.Sprint(duration))
}
