package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/keyenc"
	"github.com/verity-go/verity/versioncache"
)

// Modes, in the order "both" runs them.
const (
	modeNaive     = "naive"
	modeVersioned = "versioned"
)

// config is one race test.
type config struct {
	Readers  int
	Writers  int
	Duration time.Duration
	Modes    []string
	// Window is an artificial pause between the database read and the
	// cache fill, to widen the race for demonstrations. Zero in real runs.
	Window time.Duration
	// WritePause is how long each writer rests between writes.
	WritePause time.Duration
	// DropVersionEvery, in versioned mode, deletes the product's version
	// key at this interval, as an eviction, FLUSHALL or restart would. Zero
	// never does.
	DropVersionEvery time.Duration
	// TTL of cached values; long, as in the seed, so a stale value would
	// otherwise stay.
	TTL time.Duration
}

// maxWorkers bounds --readers and --writers: each is a goroutine and a
// Redis connection (the pool is sized to their sum), and the tracker keeps
// a slot per reader.
const maxWorkers = 10_000

// maxSeconds bounds --seconds: a run is a demonstration, and the bound
// keeps the length far inside time.Duration.
const maxSeconds = 7 * 24 * 3600

func (c config) validate() error {
	switch {
	case c.Readers < 1 || c.Readers > maxWorkers:
		return fmt.Errorf("--readers must be from 1 to %d", maxWorkers)
	case c.Writers < 1 || c.Writers > maxWorkers:
		return fmt.Errorf("--writers must be from 1 to %d", maxWorkers)
	case c.Duration <= 0:
		return fmt.Errorf("--seconds must be above 0 and at most %d (a week)", maxSeconds)
	case c.Window < 0 || c.WritePause < 0 || c.DropVersionEvery < 0:
		return errors.New("--window, --write-pause and --drop-version-every must not be negative")
	case len(c.Modes) == 0:
		return errors.New("--mode must be naive, versioned or both")
	}
	for _, m := range c.Modes {
		if m != modeNaive && m != modeVersioned {
			return fmt.Errorf("--mode: unknown mode %q (want naive, versioned or both)", m)
		}
	}
	return nil
}

// deps are the servers a run uses. The run creates its own table in the
// pool's current schema and its own keys under Prefix, and removes both.
type deps struct {
	Pool   *pgxpool.Pool
	Redis  redis.UniversalClient
	Prefix string
}

// Result is one mode's figures; the JSON keys are part of the example's
// interface.
type Result struct {
	Mode               string   `json:"mode"`
	Writes             int64    `json:"writes"`
	Divergences        int64    `json:"divergences"`
	FirstDivergenceS   *float64 `json:"first_divergence_s"`
	Reads              int64    `json:"reads"`
	StaleReadsAfterAck int64    `json:"stale_reads_after_ack"`
	ReadP50us          float64  `json:"read_p50_us"`
	ReadP99us          float64  `json:"read_p99_us"`
	Converged          bool     `json:"converged"`

	// CacheStats are versioncache's counters (versioned mode only), for the
	// human output.
	CacheStats *versioncache.Stats `json:"-"`
	// VersionKeyDrops counts --drop-version-every deletions that hit.
	VersionKeyDrops int64 `json:"-"`
}

const productID = 41

// run runs each mode in turn on a fresh table and key prefix.
func run(ctx context.Context, cfg config, d deps) ([]Result, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if cfg.TTL == 0 {
		cfg.TTL = time.Hour
	}
	var results []Result
	for _, mode := range cfg.Modes {
		r, err := runMode(ctx, cfg, d, mode)
		if err != nil {
			return results, fmt.Errorf("%s: %w", mode, err)
		}
		results = append(results, r)
	}
	return results, nil
}

func runMode(ctx context.Context, cfg config, d deps, mode string) (res Result, err error) {
	suffix := randomSuffix()
	tbl := pgx.Identifier{"race_products_" + suffix}.Sanitize()
	prefix := d.Prefix + suffix + ":" + mode + ":"

	defer func() {
		// Clean up even when ctx was canceled (Ctrl-C).
		cleanup, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, derr := d.Pool.Exec(cleanup, fmt.Sprintf(sqlDrop, tbl)); derr != nil && err == nil {
			err = fmt.Errorf("drop table: %w", derr)
		}
		if derr := deletePrefix(cleanup, d.Redis, prefix); derr != nil && err == nil {
			err = fmt.Errorf("delete keys: %w", derr)
		}
	}()
	// An interrupt does not cut the CREATE short: pgx would give up on the
	// connection at once while the server went on to commit the statement,
	// after the DROP above ran on another connection and found nothing.
	createCtx, cancelCreate := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	_, err = d.Pool.Exec(createCtx, fmt.Sprintf(sqlCreate, tbl))
	cancelCreate()
	if err != nil {
		return res, fmt.Errorf("create table: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return res, err
	}
	var initialVersion int64
	if err := d.Pool.QueryRow(ctx, fmt.Sprintf(sqlInsert, tbl), productID, 4900).Scan(&initialVersion); err != nil {
		return res, fmt.Errorf("insert product: %w", err)
	}

	var cache productCache
	var vc *versioncache.Cache[product]
	switch mode {
	case modeNaive:
		cache = &naiveCache{client: d.Redis, prefix: prefix, ttl: cfg.TTL}
	case modeVersioned:
		// FailClosed: a Redis error fails the run, as it does in naive
		// mode. FailOpen would serve such reads straight from PostgreSQL
		// and count them as fresh reads the cache never served.
		vc, err = versioncache.New[product](d.Redis, &versioncache.Config{Prefix: prefix, TTL: cfg.TTL,
			FailureMode: versioncache.FailClosed})
		if err != nil {
			return res, err
		}
		cache = &versionedCache{cache: vc}
	}

	id := strconv.Itoa(productID)
	selectSQL, updateSQL := fmt.Sprintf(sqlSelect, tbl), fmt.Sprintf(sqlUpdate, tbl)
	load := func(ctx context.Context) (product, error) {
		var p product
		err := d.Pool.QueryRow(ctx, selectSQL, productID).Scan(&p.ID, &p.PriceCents, &p.RowVersion)
		if err == nil && cfg.Window > 0 {
			time.Sleep(cfg.Window)
		}
		return p, err
	}

	tr := newTracker(cfg.Readers, initialVersion)
	runCtx, stop := context.WithTimeout(ctx, cfg.Duration)
	defer stop()
	// Each operation runs to completion on its own context: a write cut off
	// between COMMIT and Invalidate would leave the cache behind by design,
	// not by a race.
	opCtx := context.WithoutCancel(ctx)
	errs := make(chan error, cfg.Readers+cfg.Writers+1) // +1: the version dropper

	var wg sync.WaitGroup
	for i := range cfg.Readers {
		wg.Go(func() {
			for runCtx.Err() == nil {
				snap := tr.beginRead(i)
				p, err := cache.Get(opCtx, id, load)
				tr.endRead(snap, p.RowVersion, err == nil)
				if err != nil {
					errs <- fmt.Errorf("read: %w", err)
					return
				}
			}
		})
	}
	for w := range cfg.Writers {
		wg.Go(func() {
			for n := 0; runCtx.Err() == nil; n++ {
				var version int64
				price := 4000 + int64(w*100000+n)%100000
				if err := d.Pool.QueryRow(opCtx, updateSQL, productID, price).Scan(&version); err != nil {
					errs <- fmt.Errorf("write: %w", err)
					return
				}
				if err := cache.Invalidate(opCtx, id); err != nil {
					tr.abandon(version)
					errs <- fmt.Errorf("invalidate: %w", err)
					return
				}
				tr.acknowledge(version)
				if cfg.WritePause > 0 {
					// The pause is between writes, never inside one: the
					// run's end (or an interrupt) cuts it short.
					pause := time.NewTimer(cfg.WritePause)
					select {
					case <-pause.C:
					case <-runCtx.Done():
						pause.Stop()
					}
				}
			}
		})
	}
	var versionDrops int64
	if mode == modeVersioned && cfg.DropVersionEvery > 0 {
		versionKey := keyenc.Tagged(prefix, id, ":v")
		wg.Go(func() {
			tick := time.NewTicker(cfg.DropVersionEvery)
			defer tick.Stop()
			for {
				select {
				case <-tick.C:
					n, err := d.Redis.Del(opCtx, versionKey).Result()
					if err != nil {
						errs <- fmt.Errorf("drop the version key: %w", err)
						return
					}
					versionDrops += n
				case <-runCtx.Done():
					return
				}
			}
		})
	}
	monitorDone := make(chan struct{})
	go func() {
		defer close(monitorDone)
		tick := time.NewTicker(200 * time.Microsecond)
		defer tick.Stop()
		for {
			select {
			case <-tick.C:
				tr.settle()
			case <-runCtx.Done():
				return
			}
		}
	}()
	wg.Wait()
	stop()
	<-monitorDone
	tr.settle()
	close(errs)
	if err := <-errs; err != nil {
		return res, err
	}
	if err := ctx.Err(); err != nil {
		return res, err
	}

	res = Result{
		Mode:               mode,
		Writes:             tr.writes,
		Divergences:        int64(len(tr.diverged)),
		Reads:              tr.reads.Load(),
		StaleReadsAfterAck: tr.staleAfterAck.Load(),
	}
	if res.Divergences > 0 {
		s := tr.firstDiv.Seconds()
		res.FirstDivergenceS = &s
	}
	res.ReadP50us, res.ReadP99us = tr.percentiles()
	if vc != nil {
		st := vc.Stats()
		res.CacheStats = &st
	}
	res.VersionKeyDrops = versionDrops
	res.Converged, err = converged(ctx, cache, id, load)
	return res, err
}

// converged reports whether, with the load stopped, what the cache holds and
// what a read returns both equal the database row.
func converged(ctx context.Context, cache productCache, id string, load func(context.Context) (product, error)) (bool, error) {
	want, err := load(ctx)
	if err != nil {
		return false, err
	}
	cached, ok, err := cache.Peek(ctx, id)
	if err != nil {
		return false, err
	}
	if ok && cached != want {
		return false, nil
	}
	got, err := cache.Get(ctx, id, load)
	if err != nil {
		return false, err
	}
	return got == want, nil
}

// deletePrefix removes the run's keys (on every master of a cluster).
func deletePrefix(ctx context.Context, client redis.UniversalClient, prefix string) error {
	del := func(ctx context.Context, c redis.UniversalClient) error {
		iter := c.Scan(ctx, 0, prefix+"*", 1000).Iterator()
		for iter.Next(ctx) {
			if err := c.Unlink(ctx, iter.Val()).Err(); err != nil {
				return err
			}
		}
		return iter.Err()
	}
	if cc, ok := client.(*redis.ClusterClient); ok {
		return cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return del(ctx, c) })
	}
	return del(ctx, client)
}

func randomSuffix() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
