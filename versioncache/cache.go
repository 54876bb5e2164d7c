package versioncache

import (
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/keyenc"
)

var (
	//go:embed lua/read.lua
	readLua string
	//go:embed lua/fill.lua
	fillLua string
	//go:embed lua/bump.lua
	bumpLua string
	//go:embed lua/release.lua
	releaseLua string

	readScript    = redis.NewScript(readLua)
	fillScript    = redis.NewScript(fillLua)
	bumpScript    = redis.NewScript(bumpLua)
	releaseScript = redis.NewScript(releaseLua)
)

// Key suffixes after the P{id} part. Every key of one id shares the hash tag
// {id}, so one script can touch all of them on Redis Cluster.
const (
	suffixVersion   = ":v"  // version counter
	suffixValue     = ":d:" // value stem; value key = stem + version
	suffixLease     = ":l:" // fill-lease stem; lease key = stem + version
	suffixRowValue  = ":r:" // GetAt value stem; key = stem + caller's version
	leaseHeldByUs   = 1
	leaseHeldByPeer = 2
)

// Loader reads the current value from the source of truth. It is called at
// most once per (id, version) per Cache at a time, and after the version it
// will be cached under was read, which is what makes a slow load harmless.
type Loader[T any] func(ctx context.Context) (T, error)

// Cache is a read-through cache of values of type T keyed by string ids. It
// is safe for concurrent use.
type Cache[T any] struct {
	client     redis.UniversalClient
	config     *Config
	leaseToken string
	flights    flightGroup[T]
	stats      counters
	metrics    *cacheMetrics // nil: no MeterProvider
}

// New returns a Cache storing values through client, configured by config
// (nil means all defaults).
func New[T any](client redis.UniversalClient, config *Config) (*Cache[T], error) {
	if client == nil {
		return nil, ErrNilClient
	}
	cfg := config.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if cfg.InvalidateReplicas > 0 {
		switch client.(type) {
		case *redis.Client, *redis.ClusterClient:
		default:
			return nil, &ConfigError{Field: "InvalidateReplicas",
				Reason: fmt.Sprintf("is not supported with %T; use *redis.Client or *redis.ClusterClient, or leave it 0", client)}
		}
	}
	var token [12]byte
	if _, err := rand.Read(token[:]); err != nil {
		return nil, fmt.Errorf("versioncache: lease token: %w", err)
	}
	c := &Cache[T]{client: client, config: cfg, leaseToken: hex.EncodeToString(token[:])}
	metrics, err := newCacheMetrics(cfg, c.Stats)
	if err != nil {
		return nil, fmt.Errorf("versioncache: metrics: %w", err)
	}
	c.metrics = metrics
	return c, nil
}

// Close unregisters the Cache's metrics from Config.MeterProvider. It does
// not close the Redis client, and the Cache stays usable. It only matters
// with a MeterProvider, whose callback otherwise keeps the Cache reachable:
// create Caches once per cached type and Close those you discard. Close is
// idempotent.
func (c *Cache[T]) Close() error { return c.metrics.close() }

// Get returns the cached value of id, loading and caching it on a miss.
//
// A hit costs one Redis round trip: a script reads the version of id and the
// value stored under that version together. On a miss the version read in
// that same round trip is the one the loaded value is stored under, and the
// store is skipped if the version moved while loading. A write that calls
// Invalidate after its commit therefore either happens before the version was
// read (and the load sees the write) or moves the version (and the possibly
// stale load is never stored, or is stored under a version nobody reads).
//
// Concurrent misses of the same id and version in this process share one
// load. Unless DisableFillLease is set, processes also race for a short lease
// so that, across processes, about one of them loads while the others wait
// up to FillLeaseWait for its value.
//
// If Redis fails, Get returns load's value (FailOpen) or a *RedisError
// (FailClosed). It never returns a value it cannot prove current.
func (c *Cache[T]) Get(ctx context.Context, id string, load Loader[T]) (T, error) {
	var zero T
	if load == nil {
		return zero, ErrNilLoader
	}
	for {
		r, err := c.read(ctx, id, true)
		if err != nil {
			return c.redisDown(ctx, id, "read", err, load)
		}
		if r.found {
			val, err := c.decode(r.value)
			if err == nil {
				c.stats.hits.Add(1)
				return val, nil
			}
			// An undecodable value (a codec change, a foreign writer) is a
			// miss: load and overwrite it under the same version.
			c.stats.decodeErrors.Add(1)
			c.config.Logger.WarnContext(ctx, "versioncache: cached value does not decode; reloading",
				slog.String("id", id), slog.String("error", err.Error()))
		}
		c.stats.misses.Add(1)
		val, shared, err := c.flights.do(ctx, c.valueKey(id, r.version), func() (T, error) {
			return c.loadAndFill(ctx, id, r, load)
		})
		if shared {
			c.stats.sharedLoads.Add(1)
		}
		switch {
		case err == nil:
			return val, nil
		case errors.Is(err, errVersionMoved):
			continue
		case shared && isContextErr(err) && ctx.Err() == nil:
			// The caller that ran the shared load gave up; we have not.
			continue
		default:
			return zero, err
		}
	}
}

// errVersionMoved tells Get to start over: the version changed while waiting
// for another process's fill.
var errVersionMoved = errors.New("versioncache: version moved")

func (c *Cache[T]) loadAndFill(ctx context.Context, id string, r readResult, load Loader[T]) (T, error) {
	var zero T
	if r.lease == leaseHeldByPeer {
		c.stats.leaseWaits.Add(1)
		got, val, err := c.waitForPeer(ctx, id, &r)
		if err != nil {
			return zero, err
		}
		if got {
			return val, nil
		}
	}
	c.stats.loads.Add(1)
	start := time.Now()
	val, err := load(ctx)
	c.metrics.loaded(ctx, start)
	if err != nil {
		c.releaseLease(ctx, id, r)
		return zero, &LoadError{ID: id, Err: err}
	}
	data, err := c.config.Codec.Marshal(val)
	if err != nil {
		c.releaseLease(ctx, id, r)
		return zero, &CodecError{ID: id, Err: err}
	}
	token := ""
	if r.lease == leaseHeldByUs {
		token = c.leaseToken
	}
	stored, err := fillScript.Run(ctx, c.client,
		[]string{c.versionKey(id), c.valueKey(id, r.version), c.leaseKey(id, r.version)},
		r.version, data, c.config.TTL.Milliseconds(), token).Int()
	switch {
	case err != nil:
		// The loaded value is current; only caching it failed.
		c.stats.redisErrors.Add(1)
		c.config.Logger.WarnContext(ctx, "versioncache: fill failed; serving loaded value uncached",
			slog.String("id", id), slog.String("error", err.Error()))
	case stored == 1:
		c.stats.fills.Add(1)
	default:
		c.stats.staleFillsSkipped.Add(1)
	}
	return val, nil
}

// releaseLease gives up this process's lease after a failed load, even when
// ctx is what failed, so other processes need not wait FillLeaseTTL.
func (c *Cache[T]) releaseLease(ctx context.Context, id string, r readResult) {
	if r.lease != leaseHeldByUs {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
	defer cancel()
	if err := releaseScript.Run(ctx, c.client, []string{c.leaseKey(id, r.version)}, c.leaseToken).Err(); err != nil {
		c.config.Logger.WarnContext(ctx, "versioncache: releasing fill lease failed",
			slog.String("id", id), slog.String("error", err.Error()))
	}
}

// waitForPeer polls for the value another process is filling under r.version.
// It reports got=true with the value, or got=false when this process should
// load itself (the lease lapsed into our hands, the wait ran out, or Redis
// failed). It returns errVersionMoved when the version changed meanwhile.
func (c *Cache[T]) waitForPeer(ctx context.Context, id string, r *readResult) (bool, T, error) {
	var zero T
	deadline := time.Now().Add(c.config.FillLeaseWait)
	timer := time.NewTimer(c.config.FillLeasePoll)
	defer timer.Stop()
	for time.Now().Before(deadline) {
		select {
		case <-ctx.Done():
			return false, zero, ctx.Err()
		case <-timer.C:
		}
		next, err := c.read(ctx, id, true)
		if err != nil {
			c.stats.redisErrors.Add(1)
			return false, zero, nil
		}
		if next.version != r.version {
			return false, zero, errVersionMoved
		}
		if next.found {
			if val, err := c.decode(next.value); err == nil {
				c.stats.leaseWaitHits.Add(1)
				return true, val, nil
			}
			c.stats.decodeErrors.Add(1)
			return false, zero, nil
		}
		if next.lease == leaseHeldByUs {
			r.lease = leaseHeldByUs
			return false, zero, nil
		}
		timer.Reset(c.config.FillLeasePoll)
	}
	c.stats.leaseFallbacks.Add(1)
	return false, zero, nil
}

// redisDown handles a failed read according to the failure mode. Fail-open
// loads directly and deliberately outside the single flight: without a
// version there is no way to tell whether a running load started before or
// after a write this caller already saw acknowledged.
func (c *Cache[T]) redisDown(ctx context.Context, id, op string, err error, load Loader[T]) (T, error) {
	var zero T
	c.stats.redisErrors.Add(1)
	rerr := &RedisError{Op: op, ID: id, Err: err}
	if c.config.FailureMode == FailClosed || isContextErr(err) {
		return zero, rerr
	}
	c.config.Logger.WarnContext(ctx, "versioncache: redis failed; serving from loader",
		slog.String("id", id), slog.String("error", err.Error()))
	c.stats.loads.Add(1)
	c.stats.failOpenLoads.Add(1)
	start := time.Now()
	val, lerr := load(ctx)
	c.metrics.loaded(ctx, start)
	if lerr != nil {
		return zero, &LoadError{ID: id, Err: lerr}
	}
	return val, nil
}

// GetAt is Get for callers that already know the value's version from the
// source of truth, such as a row_version column or updated_at (as Unix
// microseconds), usually read with a cheap query before an expensive load.
// The value lives under (id, version); no counter is read or bumped and no
// Invalidate is needed, so a hit is one GET.
//
// The trap: GetAt is only as correct as the version. A write that does not
// change it (a bulk UPDATE or a data fix that forgets row_version or
// updated_at, a trigger that is disabled, a clock that ties two updated_at
// values) leaves the old value cached under the unchanged version until TTL.
// Prefer Get with Invalidate unless every write path provably moves the
// version, and prefer a database-incremented counter to a timestamp.
//
// load should read the row at that version or later; a value loaded from a
// newer row under an older version is harmless (it is ahead, not stale).
func (c *Cache[T]) GetAt(ctx context.Context, id string, version int64, load Loader[T]) (T, error) {
	var zero T
	if load == nil {
		return zero, ErrNilLoader
	}
	if version < 0 {
		return zero, ErrInvalidVersion
	}
	key := keyenc.Tagged(c.config.Prefix, id, suffixRowValue+strconv.FormatInt(version, 10))
	data, err := c.client.Get(ctx, key).Bytes()
	switch {
	case err == nil:
		val, derr := c.decode(data)
		if derr == nil {
			c.stats.hits.Add(1)
			return val, nil
		}
		c.stats.decodeErrors.Add(1)
	case errors.Is(err, redis.Nil):
	default:
		return c.redisDown(ctx, id, "read", err, load)
	}
	c.stats.misses.Add(1)
	val, shared, err := c.flights.do(ctx, key, func() (T, error) {
		c.stats.loads.Add(1)
		start := time.Now()
		val, err := load(ctx)
		c.metrics.loaded(ctx, start)
		if err != nil {
			return zero, &LoadError{ID: id, Err: err}
		}
		data, err := c.config.Codec.Marshal(val)
		if err != nil {
			return zero, &CodecError{ID: id, Err: err}
		}
		if err := c.client.Set(ctx, key, data, c.config.TTL).Err(); err != nil {
			c.stats.redisErrors.Add(1)
			c.config.Logger.WarnContext(ctx, "versioncache: fill failed; serving loaded value uncached",
				slog.String("id", id), slog.String("error", err.Error()))
		} else {
			c.stats.fills.Add(1)
		}
		return val, nil
	})
	if shared {
		c.stats.sharedLoads.Add(1)
	}
	if err != nil && shared && isContextErr(err) && ctx.Err() == nil {
		return c.GetAt(ctx, id, version, load)
	}
	return val, err
}

// Invalidate moves id to a new version, so that no value cached before the
// call can be read again. Call it after the database transaction that changed
// the value has committed (calling it before leaves a window in which a read
// caches the pre-commit value under the new version).
//
// The value cached under the previous version, if any, becomes an orphan that
// expires within TTL; Stats counts them. A *RedisError means the bump may
// not have happened and the previous value may be served until its TTL:
// retry, or invalidate from an outbox. A *ReplicationError (only with
// Config.InvalidateReplicas) means the bump happened on the primary but
// fewer replicas than asked confirmed it.
func (c *Cache[T]) Invalidate(ctx context.Context, id string) error {
	keys := []string{c.versionKey(id), c.valueStem(id)}
	ttl := c.config.TTL.Milliseconds()
	var (
		res      []any
		err      error
		replicas = -1
	)
	if c.config.InvalidateReplicas > 0 {
		res, replicas, err = c.bumpAndWait(ctx, keys, ttl)
	} else {
		res, err = bumpScript.Run(ctx, c.client, keys, ttl).Slice()
	}
	if err != nil {
		c.stats.redisErrors.Add(1)
		return &RedisError{Op: "invalidate", ID: id, Err: err}
	}
	c.stats.invalidations.Add(1)
	if len(res) == 2 {
		if orphan, _ := res[1].(int64); orphan == 1 {
			c.stats.orphanedValueKeys.Add(1)
		}
	}
	if replicas >= 0 && replicas < c.config.InvalidateReplicas {
		return &ReplicationError{ID: id, Want: c.config.InvalidateReplicas, Got: replicas}
	}
	return nil
}

// bumpAndWait runs the bump and WAIT in one pipeline on one connection of the
// primary that owns the id: WAIT only counts that connection's writes.
func (c *Cache[T]) bumpAndWait(ctx context.Context, keys []string, ttl int64) ([]any, int, error) {
	var node *redis.Client
	switch client := c.client.(type) {
	case *redis.ClusterClient:
		var err error
		if node, err = client.MasterForKey(ctx, keys[0]); err != nil {
			return nil, 0, err
		}
	case *redis.Client:
		node = client
	}
	var bump *redis.Cmd
	var wait *redis.Cmd
	_, err := node.Pipelined(ctx, func(p redis.Pipeliner) error {
		// EVAL, not EVALSHA: a NOSCRIPT inside the pipeline would still run
		// the WAIT, for nothing.
		bump = p.Eval(ctx, bumpLua, keys, ttl)
		wait = p.Do(ctx, "WAIT", c.config.InvalidateReplicas, c.config.InvalidateWaitTimeout.Milliseconds())
		return nil
	})
	if err != nil {
		return nil, 0, err
	}
	res, err := bump.Slice()
	if err != nil {
		return nil, 0, err
	}
	acked, err := wait.Int()
	if err != nil {
		return nil, 0, err
	}
	return res, acked, nil
}

// Peek returns the value cached for id and its version without loading,
// initialising a version or taking a lease: for debugging tools, warmers and
// Check, which must all go through the version indirection. ok is false when
// nothing is cached; version is 0 when id has no version key.
func (c *Cache[T]) Peek(ctx context.Context, id string) (val T, version int64, ok bool, err error) {
	r, err := c.read(ctx, id, false)
	if err != nil {
		c.stats.redisErrors.Add(1)
		return val, 0, false, &RedisError{Op: "peek", ID: id, Err: err}
	}
	if r.version != "" {
		version, _ = strconv.ParseInt(r.version, 10, 64)
	}
	if !r.found {
		return val, version, false, nil
	}
	val, err = c.decode(r.value)
	if err != nil {
		c.stats.decodeErrors.Add(1)
		return val, version, false, &CodecError{ID: id, Err: err}
	}
	return val, version, true, nil
}

type readResult struct {
	version string // as stored; "" only from Peek when there is no version
	value   []byte
	found   bool
	lease   int64
}

func (c *Cache[T]) read(ctx context.Context, id string, initialise bool) (readResult, error) {
	mode, leaseTTL := "0", "0"
	if initialise {
		mode = "1"
		if !c.config.DisableFillLease {
			leaseTTL = strconv.FormatInt(c.config.FillLeaseTTL.Milliseconds(), 10)
		}
	}
	res, err := readScript.Run(ctx, c.client,
		[]string{c.versionKey(id), c.valueStem(id), c.leaseStem(id)},
		mode, c.config.TTL.Milliseconds(), leaseTTL, c.leaseToken).Slice()
	if err != nil {
		return readResult{}, err
	}
	if len(res) != 3 {
		return readResult{}, fmt.Errorf("versioncache: read script returned %d elements, want 3", len(res))
	}
	var r readResult
	r.version, _ = res[0].(string)
	if v, ok := res[1].(string); ok {
		r.value, r.found = []byte(v), true
	}
	r.lease, _ = res[2].(int64)
	if initialise && r.version == "" {
		return readResult{}, errors.New("versioncache: read script returned no version")
	}
	return r, nil
}

func (c *Cache[T]) decode(data []byte) (T, error) {
	var val T
	err := c.config.Codec.Unmarshal(data, &val)
	return val, err
}

func (c *Cache[T]) versionKey(id string) string {
	return keyenc.Tagged(c.config.Prefix, id, suffixVersion)
}

func (c *Cache[T]) valueStem(id string) string {
	return keyenc.Tagged(c.config.Prefix, id, suffixValue)
}

func (c *Cache[T]) valueKey(id, version string) string {
	return c.valueStem(id) + version
}

func (c *Cache[T]) leaseStem(id string) string {
	return keyenc.Tagged(c.config.Prefix, id, suffixLease)
}

func (c *Cache[T]) leaseKey(id, version string) string {
	return c.leaseStem(id) + version
}

func isContextErr(err error) bool {
	return errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
}
