package versioncache

import (
	"bytes"
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"reflect"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/clusterpin"
	"github.com/verity-go/verity/internal/deps"
	"github.com/verity-go/verity/internal/keyenc"
	"github.com/verity-go/verity/internal/lograte"
)

var (
	//go:embed lua/versions.lua
	versionsLua string
	//go:embed lua/read.lua
	readLua string
	//go:embed lua/fill.lua
	fillLua string
	//go:embed lua/bump.lua
	bumpLua string
	//go:embed lua/release.lua
	releaseLua string
	//go:embed lua/fill_at.lua
	fillAtLua string

	defaultScripts = newScripts(func(src string) string { return src })
)

// scripts are the Lua scripts a Cache runs. They are per Cache only so that
// tests can run every path under a wrapper that rejects undeclared keys.
type scripts struct {
	read, peek, fill, bump, release, fillAt *redis.Script
	bumpSrc                                 string // for EVAL in bumpAndWait's pipeline
}

// Each script declares its flags (Redis 7), because Redis checks maxmemory
// for a script without them only at its first command that may grow
// memory, and a script that first ran a write Redis allows when full
// (PEXPIRE, DEL) then writes freely past the limit. Declared:
//   - scriptMayGrow: a miss's read (version key, lease) and the fills are
//     refused whole by a Redis at maxmemory (an OOM error; a FailOpen miss
//     then serves the loaded value uncached), so a full Redis stays full
//     rather than growing until the kernel ends it.
//   - scriptFrees: Invalidate and a lease's release run on a full Redis.
//     Invalidate must: it deletes the value a write made stale, and its new
//     version replaces the old one in place.
//   - scriptReadOnly: Peek and Check, sent as EVALSHA_RO, which refuses a
//     script declared to write.
const (
	scriptMayGrow  = "#!lua\n"
	scriptFrees    = "#!lua flags=allow-oom\n"
	scriptReadOnly = "#!lua flags=no-writes\n"
)

func newScripts(wrap func(src string) string) *scripts {
	return &scripts{
		read:    redis.NewScript(scriptMayGrow + wrap(versionsLua+readLua)),
		peek:    redis.NewScript(scriptReadOnly + wrap(versionsLua+readLua)),
		fill:    redis.NewScript(scriptMayGrow + wrap(fillLua)),
		bump:    redis.NewScript(scriptFrees + wrap(versionsLua+bumpLua)),
		release: redis.NewScript(scriptFrees + wrap(releaseLua)),
		fillAt:  redis.NewScript(scriptMayGrow + wrap(fillAtLua)),
		bumpSrc: scriptFrees + wrap(versionsLua+bumpLua),
	}
}

// Key suffixes after the P{id} part. Every key of one id shares the hash tag
// {id}, so one script can touch all of them on Redis Cluster.
const (
	suffixVersion   = ":v" // version counter
	suffixCurrent   = ":c" // current value: "<version>:<shape>~<encoded value>"
	suffixLease     = ":l" // fill lease: "<version>:<lease token>"
	suffixAt        = ":a" // GetAt value: "<caller's version>:<shape>~<encoded value>"
	leaseHeldByUs   = 1
	leaseHeldByPeer = 2
)

// Loader reads the current value from the source of truth. It is called at
// most once per (id, version) per Cache at a time, and after the version it
// will be cached under was read, which is what makes a slow load harmless.
//
// An error it returns reaches every caller sharing its load as a *LoadError,
// a context error from a timeout of its own included, unless the ctx of the
// caller that ran it had ended by the time it returned: the others whose ctx
// is live then load again, whatever the error, since a loader may report its
// ctx ending as any error (an i/o timeout from a connection deadline taken
// from ctx, an RPC's Canceled status). A panic (or runtime.Goexit) is not
// recovered: it goes on in the caller that ran the loader, the callers
// sharing its load get a *LoadError saying it panicked or did not return,
// and the fill lease is given up, as after an error.
//
// Nothing is cached after an error, so an error is no way to report absence:
// every read of a missing row would load again. To cache that a row does
// not exist, return a value that says so (a tombstone), such as nil when T
// is a pointer type (*X: JSONCodec caches it as null, and a hit returns
// nil), or a struct with a Found field; Invalidate it when the row is
// created, as after any write.
type Loader[T any] func(ctx context.Context) (T, error)

// Cache is a read-through cache of values of type T keyed by string ids. It
// is safe for concurrent use. Create it with New: the methods of a zero
// Cache or a nil *Cache return a *ConfigError (Field "client") instead.
type Cache[T any] struct {
	client redis.UniversalClient
	// primary is set when client may route plain reads to replicas: a hit
	// must then be sent to the primary explicitly, because a replica may not
	// have applied an Invalidate the primary has already acknowledged.
	primary    *redis.ClusterClient
	config     *Config
	lua        *scripts
	leaseToken string
	plainJSON  bool   // decode with json.Unmarshal (see plainJSON)
	shape      []byte // precedes every encoded value (see shapeTag)
	flights    flightGroup[loaded[T]]
	stats      counters
	metrics    *cacheMetrics // nil: no MeterProvider
	// bypassLocal is set when client answers single reads from go-redis's
	// client-side cache, which learns of an Invalidate only when the
	// server's invalidation message has been processed, after the
	// Invalidate returned: a hit must then reach the server.
	bypassLocal bool
	// logs limits each warning a failure can repeat on every call (see
	// Config.Logger): an outage or a codec change must not log a line per
	// Get.
	logs struct {
		failOpen, fill, release, decode lograte.Limiter
	}
}

// New returns a Cache storing values through client, configured by config,
// which must set Prefix (a nil config is a *ConfigError naming it).
//
// Hits read the primary, also through a client that routes reads to
// replicas, and bypass go-redis's client-side cache
// (Options.ClientSideCacheConfig or ClientSideCache) when client has one.
// Two kinds of client defeat this, and New cannot tell them: a Sentinel
// client built with ReadOnly (ReplicaOnly) reads a replica, where hits may
// lag an Invalidate, and cluster node or ring shard clients given a
// client-side cache by a NewClient function serve stale hits. Do not pass
// them; see the package documentation.
//
// New refuses a client that could wait for Redis forever (see the package
// documentation on a Redis that stops answering) with a *ConfigError
// naming the option (Field "Options.ReadTimeout",
// "ClusterOptions.WriteTimeout", ...): a ReadTimeout or WriteTimeout of -2
// (go-redis then ignores the ctx's deadline too), or of -1 without
// ContextTimeoutEnabled. With ContextTimeoutEnabled and timeouts of -1, a
// call whose ctx has no deadline can still wait forever. Rings and
// ClusterOptions.NewClient functions are checked as by
// projection.NewRedisProjector.
func New[T any](client redis.UniversalClient, config *Config) (*Cache[T], error) {
	if deps.Missing(client) {
		return nil, ErrNilClient
	}
	cfg := config.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if u := deps.UnboundedRedis(client); u != nil {
		return nil, &ConfigError{Field: u.Field, Reason: u.Reason}
	}
	if cfg.InvalidateReplicas > 0 {
		var readTimeout time.Duration
		switch c := client.(type) {
		case *redis.Client:
			readTimeout = c.Options().ReadTimeout
		case *redis.ClusterClient:
			readTimeout = c.Options().ReadTimeout
		default:
			return nil, &ConfigError{Field: "InvalidateReplicas",
				Reason: fmt.Sprintf("is not supported with %T; use *redis.Client or *redis.ClusterClient, or leave it 0", client)}
		}
		// Options() are after go-redis applied its defaults: a positive
		// ReadTimeout is the one in force, anything else means none.
		// WAIT blocks the reply for up to InvalidateWaitTimeout; a client
		// that gives up on the reply first would report a Redis error for
		// a bump that happened, and retry the pipeline, bumping again.
		if readTimeout > 0 && cfg.InvalidateWaitTimeout > readTimeout-waitReplySlack { // no sum: it could overflow
			return nil, waitTimeoutError(cfg.InvalidateWaitTimeout, readTimeout, config.InvalidateWaitTimeout == 0)
		}
	}
	var token [12]byte
	if _, err := rand.Read(token[:]); err != nil {
		return nil, fmt.Errorf("versioncache: lease token: %w", err)
	}
	c := &Cache[T]{client: client, config: cfg, lua: defaultScripts, leaseToken: hex.EncodeToString(token[:]),
		plainJSON: plainJSON(cfg.Codec, reflect.TypeFor[T]()), shape: shapeTag(cfg.Codec, reflect.TypeFor[T]())}
	c.primary = clusterpin.Client(client)
	c.bypassLocal = clientSideCached(client)
	metrics, err := newCacheMetrics(cfg, c.Stats)
	if err != nil {
		return nil, fmt.Errorf("versioncache: metrics: %w", err)
	}
	c.metrics = metrics
	return c, nil
}

// waitTimeoutError refuses an InvalidateWaitTimeout that leaves the client
// less than waitReplySlack to read WAIT's reply, naming fixes New accepts: a
// lower InvalidateWaitTimeout only while the client's ReadTimeout leaves
// room for one of at least 1ms (validate's minimum), a longer ReadTimeout
// only when it does not overflow.
func waitTimeoutError(wait, readTimeout time.Duration, isDefault bool) *ConfigError {
	what := wait.String()
	if isDefault {
		what += " (the default: it was left zero)"
	}
	raise := fmt.Sprintf("raise the client's ReadTimeout to at least %s above a lower InvalidateWaitTimeout", waitReplySlack)
	if wait <= math.MaxInt64-waitReplySlack { // no overflow
		raise = fmt.Sprintf("raise the client's ReadTimeout to at least %s", wait+waitReplySlack)
	}
	var fix string
	switch room := readTimeout - waitReplySlack; {
	case room >= time.Millisecond && wait > math.MaxInt64-waitReplySlack:
		fix = fmt.Sprintf("lower it to at most %s", room)
	case room >= time.Millisecond:
		fix = fmt.Sprintf("lower it to at most %s, or %s", room, raise)
	default:
		fix = fmt.Sprintf("%s (as it is, it leaves no room for an InvalidateWaitTimeout, which must be at least 1ms), or leave InvalidateReplicas 0 (InvalidateWaitTimeout only bounds its wait)", raise)
	}
	return &ConfigError{Field: "InvalidateWaitTimeout",
		Reason: fmt.Sprintf("is %s, too long for the client's ReadTimeout (%s), which must exceed it by at least %s for WAIT's reply: %s",
			what, readTimeout, waitReplySlack, fix)}
}

// Close unregisters the Cache's metrics from Config.MeterProvider. It does
// not close the Redis client, and the Cache stays usable. It only matters
// with a MeterProvider, whose callback otherwise keeps the Cache reachable:
// create Caches once per cached type and Close those you discard. Close is
// idempotent, and does nothing on a Cache that New did not make.
func (c *Cache[T]) Close() error {
	if c == nil {
		return nil
	}
	return c.metrics.close()
}

// notFromNew reports a Cache that New did not make: a zero Cache, or a
// nil *Cache. Its methods refuse it with errNotFromNew rather than panic;
// the check is two comparisons, nothing on a hit's budget.
func (c *Cache[T]) notFromNew() bool { return c == nil || c.config == nil }

// Get returns the cached value of id, loading and caching it on a miss.
//
// A hit costs one Redis round trip, a plain GET: the current value of id is
// kept under one key, and that key exists only while its value is current.
// Invalidate deletes it atomically with moving the version, and a miss stores
// its load there only if the version is still the one it read before loading.
// A write that calls Invalidate after its commit therefore either happens
// before that version was read (and the load sees the write) or moves the
// version (and the possibly stale load is not stored).
//
// Concurrent misses of the same id and version in this process share one
// load; each caller gets its own copy of the value, decoded from the bytes
// cached (a miss answers what its hits will). Unless DisableFillLease is
// set, processes also race for a short lease so that, across processes,
// about one of them loads while the others wait up to FillLeaseWait for its
// value. A failed load's *LoadError is every sharing caller's (see Loader
// for a load whose caller gave up, and for panics). An error is not cached:
// to cache a row's absence, load a tombstone value (see Loader).
//
// If Redis fails, Get returns load's value (FailOpen) or a *RedisError
// (FailClosed); if the caller's own ctx ended, it returns ctx's error
// under either mode, and counts no Redis error. It never returns a value it
// cannot prove current. A miss while the id's Redis Cluster slot migrates
// fails so at once (the *RedisError matches ErrSlotMigrating): unlike
// Invalidate and Peek, Get does not wait for the migration to end.
func (c *Cache[T]) Get(ctx context.Context, id string, load Loader[T]) (T, error) {
	var zero T
	if c.notFromNew() {
		return zero, errNotFromNew()
	}
	if load == nil {
		return zero, ErrNilLoader
	}
	// ignoreCurrent is set once the current value failed to decode (a codec
	// change, a foreign writer): it is then a miss, to be overwritten.
	ignoreCurrent := false
	// undecodable is the current value that did not decode, if any: while
	// waiting for another process's fill, it is not that fill.
	var undecodable []byte
	// missed: the call has been counted as a miss. A call is one read
	// however often it goes round: once it has run or joined a load, it is
	// a miss, even if it is then served from Redis.
	missed := false
	// waited: the call has been counted in LeaseWaits. A miss can wait
	// again when the version moved during its first wait.
	waited := false
	for {
		if !ignoreCurrent {
			data, found, err := c.getCurrent(ctx, id)
			if err != nil {
				return c.redisDown(ctx, id, "read", err, load)
			}
			if found {
				if val, _, ok := c.decodeCurrent(ctx, id, data); ok {
					if !missed {
						c.stats.hits.Add(1)
					}
					return val, nil
				}
				ignoreCurrent, undecodable = true, data
			}
		}
		r, err := c.read(ctx, id, true, ignoreCurrent)
		if err != nil {
			if !missed {
				// The GET answered, with no value to serve: a miss,
				// whatever the script that was to start its load met.
				c.stats.misses.Add(1)
			}
			return c.redisDown(ctx, id, "read", err, load)
		}
		if r.found {
			// Filled by someone else between the GET and the script.
			if val, _, ok := c.decodeCurrent(ctx, id, r.current); ok {
				if !missed {
					c.stats.hits.Add(1)
				}
				return val, nil
			}
			ignoreCurrent, undecodable = true, r.current
			continue
		}
		if !missed {
			c.stats.misses.Add(1)
			missed = true
		}
		r.undecodable = undecodable
		res, shared, leaderEnded, err := c.flights.do(ctx, c.flightKey(id, r.version), id, func() (loaded[T], error) {
			return c.loadAndFill(ctx, id, r, load, &waited)
		})
		switch {
		case errors.Is(err, errVersionMoved):
			ignoreCurrent, undecodable = false, nil
			continue
		case err != nil && shared && leaderEnded && ctx.Err() == nil:
			// The caller that ran the shared load gave up; we have not.
			// Whatever its error, it may be that caller's ctx ending as the
			// loader saw it (a connection deadline's i/o timeout, an RPC
			// status), so go round and load again. An error while its ctx
			// was live is the loader's own (its query's timeout): every
			// joiner shares it, or N callers would run the failing load N
			// times, one after another. Each round needs another caller's
			// ctx to end during its load, and a load we run is never sent
			// round.
			continue
		}
		if shared {
			// Counted only now: a joined load dropped above answered
			// nothing, and the call goes on to be answered otherwise.
			c.stats.sharedLoads.Add(1)
		}
		if err != nil {
			return zero, err
		}
		return c.answer(id, res, shared)
	}
}

// getPastLocalCache is one GET that never comes from go-redis's
// client-side cache: GetAt's and CheckAt's read of an id's GetAt key
// (which a replica may serve, see GetAt), and Get's hit on a client that
// does not read from replicas. That cache can answer with a value an acknowledged Invalidate deleted
// until its invalidation message arrives, at the caller's own version
// included: the value of a data fix that kept the version, which the
// Invalidate was to repair. Its error is redis.Nil for an absent key.
func (c *Cache[T]) getPastLocalCache(ctx context.Context, key string) ([]byte, error) {
	if !c.bypassLocal {
		return c.client.Get(ctx, key).Bytes()
	}
	// go-redis serves only single commands from its client-side cache,
	// never a pipeline's.
	p := c.client.Pipeline()
	cmd := p.Get(ctx, key)
	if _, err := p.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return nil, err
	}
	return cmd.Bytes()
}

// getCurrent is the hit path: one GET of the current key, on the primary.
func (c *Cache[T]) getCurrent(ctx context.Context, id string) ([]byte, bool, error) {
	key := c.currentKey(id)
	var (
		data []byte
		err  error
	)
	if c.primary != nil {
		var cmd *redis.StringCmd
		err = clusterpin.OnMaster(ctx, c.primary, key, func(p redis.Pipeliner) { cmd = p.Get(ctx, key) })
		if err != nil && !errors.Is(err, redis.Nil) {
			return nil, false, err
		}
		data, err = cmd.Bytes()
	} else {
		data, err = c.getPastLocalCache(ctx, key) // the same GET, past any client-side cache
	}
	switch {
	case err == nil:
		return data, true, nil
	case errors.Is(err, redis.Nil):
		return nil, false, nil
	default:
		return nil, false, err
	}
}

// clientSideCached reports whether client has go-redis's client-side cache
// (Options.ClientSideCache or ClientSideCacheConfig, which
// UniversalOptions passes on to a standalone client). Only a *redis.Client
// takes those options.
func clientSideCached(client redis.UniversalClient) bool {
	c, ok := client.(*redis.Client)
	if !ok {
		return false
	}
	o := c.Options()
	return o.ClientSideCache != nil || o.ClientSideCacheConfig != nil
}

// decodeCurrent decodes the contents of a current key, returning the
// encoded value too, or reports false after counting and logging a decode
// error.
func (c *Cache[T]) decodeCurrent(ctx context.Context, id string, data []byte) (T, []byte, bool) {
	payload, err := versionedPayload(data)
	if err == nil {
		var val T
		if val, err = c.decode(payload); err == nil {
			return val, payload, true
		}
	}
	var zero T
	c.decodeFailed(ctx, id, err)
	return zero, nil, false
}

// decodeFailed counts and logs a cached value that does not decode.
func (c *Cache[T]) decodeFailed(ctx context.Context, id string, err error) {
	c.stats.decodeErrors.Add(1)
	c.warn(ctx, &c.logs.decode, "versioncache: cached value does not decode; reloading", id, err)
}

// warn logs msg about id at WARN unless l suppresses it, with the number
// of occurrences l suppressed since its last line (see Config.Logger). A
// suppressed line allocates nothing.
func (c *Cache[T]) warn(ctx context.Context, l *lograte.Limiter, msg, id string, err error) {
	if log, suppressed := l.Allow(); log {
		c.config.Logger.LogAttrs(ctx, slog.LevelWarn, msg, slog.String("id", id), slog.String("error", err.Error()),
			slog.Int64(lograte.Suppressed, suppressed))
	}
}

// loaded is the result of a load shared by concurrent misses: the value and
// the encoding it was decoded from.
type loaded[T any] struct {
	val  T
	data []byte
}

// answer returns a shared load's value to one of its callers: the one that
// ran it gets the value itself, each other caller a copy decoded from the
// same bytes, as a hit would give it, so that no two callers share a map,
// slice or pointer.
func (c *Cache[T]) answer(id string, res loaded[T], shared bool) (T, error) {
	if !shared {
		return res.val, nil
	}
	val, err := c.decode(res.data)
	if err != nil { // it decoded a moment ago
		var zero T
		return zero, &CodecError{Op: "decode", ID: id, Err: err}
	}
	return val, nil
}

// errMalformed is the decode error for a stored value without its version
// prefix (written by something other than this package).
var errMalformed = errors.New("versioncache: stored value has no version prefix")

// splitVersioned splits "<version>:<payload>" as stored in current keys.
// The version must be a non-negative int64 in canonical decimal (no sign, no
// leading zeros), as the scripts write it and as fill_at.lua compares it.
func splitVersioned(data []byte) (int64, []byte, error) {
	i := bytes.IndexByte(data, ':')
	if i <= 0 {
		return 0, nil, errMalformed
	}
	text := string(data[:i])
	version, err := strconv.ParseInt(text, 10, 64)
	if err != nil || version < 0 || strconv.FormatInt(version, 10) != text {
		return 0, nil, errMalformed
	}
	return version, data[i+1:], nil
}

// versionedPayload is splitVersioned for the hit path, which needs only the
// payload: it checks the prefix's shape without parsing it, and accepts
// exactly what splitVersioned accepts, so that Get serves no value Peek and
// Check would call undecodable (a foreign writer's "0001:" or a number
// past int64).
func versionedPayload(data []byte) ([]byte, error) {
	i := bytes.IndexByte(data, ':')
	if i <= 0 || i > len(maxVersionText) || (i > 1 && data[0] == '0') {
		return nil, errMalformed
	}
	for _, b := range data[:i] {
		if b < '0' || b > '9' {
			return nil, errMalformed
		}
	}
	if i == len(maxVersionText) && string(data[:i]) > maxVersionText {
		return nil, errMalformed
	}
	return data[i+1:], nil
}

// maxVersionText is the largest version prefix, math.MaxInt64 in decimal.
const maxVersionText = "9223372036854775807"

// joinVersioned builds "<version>:<payload>".
func joinVersioned(version string, payload []byte) []byte {
	out := make([]byte, 0, len(version)+1+len(payload))
	out = append(out, version...)
	out = append(out, ':')
	return append(out, payload...)
}

// errVersionMoved tells Get to start over: the version changed while waiting
// for another process's fill.
var errVersionMoved = errors.New("versioncache: version moved")

func (c *Cache[T]) loadAndFill(ctx context.Context, id string, r readResult, load Loader[T], waited *bool) (loaded[T], error) {
	var zero loaded[T]
	if r.lease == leaseHeldByPeer {
		if !*waited {
			*waited = true
			c.stats.leaseWaits.Add(1)
		}
		got, res, err := c.waitForPeer(ctx, id, &r)
		var rerr *RedisError
		if errors.As(err, &rerr) {
			// As if the miss's read had failed: FailClosed must not load.
			// A fail-open load here may stay in the flight: it starts after
			// the version that every joiner observed.
			return c.failOpen(ctx, id, rerr.Op, rerr.Err, load)
		}
		if err != nil {
			return zero, err
		}
		if got {
			return res, nil
		}
	}
	// Unless the fill runs (it releases the lease itself), give the lease up:
	// after a failed load, and also when load panics or exits its goroutine,
	// so that other processes need not wait for it to lapse.
	filling := false
	defer func() {
		if !filling {
			c.releaseLease(ctx, id, r)
		}
	}()
	c.stats.loads.Add(1)
	start := time.Now()
	val, err := load(ctx)
	c.metrics.loaded(ctx, start)
	if err != nil {
		return zero, &LoadError{ID: id, Err: err}
	}
	val, data, err := c.encode(id, val)
	if err != nil {
		return zero, err
	}
	token := ""
	if r.lease == leaseHeldByUs {
		token = c.leaseToken
	}
	// The fill (which also releases our lease) is every joined caller's
	// and every waiting process's, not only this caller's: when this
	// caller's ctx ended with its load, it runs detached (bounded);
	// otherwise within the caller's deadline.
	filling = true
	fillCtx, cancel, detached := fillContext(ctx)
	defer cancel()
	stored, err := c.lua.fill.Run(fillCtx, c.client,
		[]string{c.versionKey(id), c.currentKey(id), c.leaseKey(id)},
		r.version, joinVersioned(r.version, data), c.config.TTL.Milliseconds(), token).Int()
	switch {
	case err != nil:
		// The loaded value is current; only caching it failed. The lease
		// is left to expire: a release would go to the Redis that just
		// failed (or held up the fill past the caller's deadline), and
		// would keep the caller waiting for it. Not a Redis error if the
		// caller's own ctx cut it off (a detached fill's bound is ours).
		c.fillFailed(ctx, id, err, detached || c.gaveUp(ctx, err) == nil)
	default:
		c.filled(stored)
	}
	return loaded[T]{val, data}, nil
}

// detachedTimeout bounds the Redis calls that run on after the caller's ctx
// ended because others depend on them: a fill, a lease's release. A
// command in flight honours it only with ContextTimeoutEnabled; otherwise
// the client's ReadTimeout and WriteTimeout bound it (see New).
const detachedTimeout = time.Second

// fillContext returns the ctx a fill of Get or GetAt runs on. The fill is
// every joined caller's too (and, for Get, every waiting process's), not
// only that of the caller whose ctx it was: once that ctx has ended, the
// fill runs detached from it, bounded by detachedTimeout, and detached
// reports so. Call cancel when the fill is done.
func fillContext(ctx context.Context) (fillCtx context.Context, cancel context.CancelFunc, detached bool) {
	if ctx.Err() == nil {
		return ctx, func() {}, false
	}
	fillCtx, cancel = context.WithTimeout(context.WithoutCancel(ctx), detachedTimeout)
	return fillCtx, cancel, true
}

// releaseLease gives up this process's lease after a failed (or panicked)
// load, even when ctx is what failed, so other processes need not wait
// FillLeaseTTL. It runs on ctx while ctx lasts, so that the caller's
// deadline holds (a release cut off by it leaves the lease to lapse, as a
// failed fill does), and detached, bounded by detachedTimeout, once ctx
// has ended.
func (c *Cache[T]) releaseLease(ctx context.Context, id string, r readResult) {
	if r.lease != leaseHeldByUs {
		return
	}
	relCtx, cancel, detached := fillContext(ctx)
	defer cancel()
	if err := c.lua.release.Run(relCtx, c.client, []string{c.leaseKey(id)}, r.version, c.leaseToken).Err(); err != nil {
		// A Redis error unless the caller's own ctx cut it off.
		if detached || c.gaveUp(ctx, err) == nil {
			c.redisFailed(relCtx, err)
		}
		c.warn(relCtx, &c.logs.release, "versioncache: releasing fill lease failed", id, err)
	}
}

// waitForPeer polls for the value another process is filling under r.version.
// It reports got=true with the value, or got=false when this process should
// load itself (the lease lapsed into our hands, or the wait ran out). It
// returns errVersionMoved when the version changed meanwhile, and a
// *RedisError, not yet counted, when a poll failed: that is for the failure
// mode to decide, not a reason to load.
func (c *Cache[T]) waitForPeer(ctx context.Context, id string, r *readResult) (bool, loaded[T], error) {
	var zero loaded[T]
	deadline := time.Now().Add(c.config.FillLeaseWait)
	timer := time.NewTimer(min(c.config.FillLeasePoll, c.config.FillLeaseWait))
	defer timer.Stop()
	for time.Now().Before(deadline) {
		select {
		case <-ctx.Done():
			return false, zero, ctx.Err()
		case <-timer.C:
		}
		// A poll is part of the wait: bounded by its deadline, so that a
		// slow Redis (or a busy client pool) does not stretch the wait
		// past FillLeaseWait.
		pctx, cancel := context.WithDeadline(ctx, deadline)
		next, err := c.pollWaited(pctx, id, r.version)
		if err == nil && next.found && r.undecodable != nil && bytes.Equal(next.current, r.undecodable) {
			// Still the value this miss found undecodable (another
			// release's): the lease holder has not filled yet. Look past
			// it at the lease, taking it if the holder gave it up.
			next, err = c.readScript(pctx, id, true, true, r.version)
		}
		cut := err != nil && ctx.Err() == nil && pctx.Err() != nil
		cancel()
		if cut {
			break // the wait ran out during the poll
		}
		if err != nil {
			return false, zero, &RedisError{Op: "read", ID: id, Err: err}
		}
		if next.found {
			// Whatever is in the current key is current, whoever filled it.
			if val, data, ok := c.decodeCurrent(ctx, id, next.current); ok {
				c.stats.leaseWaitHits.Add(1)
				return true, loaded[T]{val, data}, nil
			}
			return false, zero, nil
		}
		if next.version != r.version {
			// The poll took no lease under the new version (see
			// pollWaited): Get goes round and takes one there.
			return false, zero, errVersionMoved
		}
		if next.lease == leaseHeldByUs {
			r.lease = leaseHeldByUs
			return false, zero, nil
		}
		timer.Reset(max(0, min(c.config.FillLeasePoll, time.Until(deadline))))
	}
	c.stats.leaseFallbacks.Add(1)
	return false, zero, nil
}

// redisDown handles a failed read according to the failure mode. Fail-open
// loads directly and deliberately outside the single flight: without a
// version there is no way to tell whether a running load started before or
// after a write this caller already saw acknowledged.
func (c *Cache[T]) redisDown(ctx context.Context, id, op string, err error, load Loader[T]) (T, error) {
	res, err := c.failOpen(ctx, id, op, err, load)
	return res.val, err
}

// failOpen is redisDown for a shared load: it returns the value's encoding
// too.
func (c *Cache[T]) failOpen(ctx context.Context, id, op string, err error, load Loader[T]) (loaded[T], error) {
	var zero loaded[T]
	if cerr := c.gaveUp(ctx, err); cerr != nil {
		return zero, cerr // not a Redis failure
	}
	c.redisFailed(ctx, err)
	if redis.IsTryAgainError(err) || isAsk(err) {
		// Not retried: a read should not wait for a whole migration.
		err = slotMigrating(err, nil)
	}
	rerr := &RedisError{Op: op, ID: id, Err: err}
	if c.config.FailureMode == FailClosed || isContextErr(err) {
		return zero, rerr
	}
	c.warn(ctx, &c.logs.failOpen, "versioncache: redis failed; serving from loader", id, err)
	c.stats.loads.Add(1)
	c.stats.failOpenLoads.Add(1)
	start := time.Now()
	val, lerr := load(ctx)
	c.metrics.loaded(ctx, start)
	if lerr != nil {
		return zero, &LoadError{ID: id, Err: lerr}
	}
	// Answered as a hit would answer it once Redis is back.
	val, data, cerr := c.encode(id, val)
	if cerr != nil {
		return zero, cerr
	}
	return loaded[T]{val, data}, nil
}

// GetAt is Get for callers that already know the value's version from the
// source of truth, such as a row_version column the writes increment,
// usually read with a cheap query before an expensive load.
// No counter is read or bumped and no Invalidate is needed: one key per id
// holds the value together with the version it was cached under, and a hit
// (one GET) is any stored version at or above the caller's. A miss loads and
// stores unless a newer version is stored by then, so the stored version
// never goes backwards while the key lasts. Once Invalidate has deleted it
// or its TTL has ended, a caller with an older version stores that one;
// no hit comes of it for a caller with a newer version, which misses and
// replaces it. A stored value that does not decode is a miss, and
// the fill replaces it like any other: if its version is not newer than the
// caller's, or if it has no version (no canonical decimal "<version>:" prefix).
// One that does have a newer version is left alone, and the caller is
// served what it loaded, uncached: during a rollout that changes the Codec
// or T, old and new processes cannot decode each other's values, and
// replacing them would have each overwrite the other's newer values with
// older ones, so that both keep missing.
//
// The trap: GetAt is only as correct as the version. A write that does not
// change it (a bulk UPDATE or a data fix that forgets row_version, a
// trigger that is disabled) leaves the old value cached under the unchanged
// version until TTL. A timestamp is a poor version even without a clock
// fault: PostgreSQL's now() (CURRENT_TIMESTAMP, DEFAULT now()) is the
// writing transaction's start, so a transaction that began first and
// commits last stores an older updated_at over a newer one, and GetAt then
// serves the superseded value, cached under the "newer" version, as a hit;
// clock_timestamp() narrows that to clock steps and ties. Prefer Get with
// Invalidate unless every write path provably moves the version, and use a
// counter each write increments (version = version + 1 in the UPDATE);
// CheckAt finds such values, and Invalidate deletes them (see Invalidate for
// a GetAt load in flight during the call).
//
// GetAt reads and writes only P{id}:a; Get, Peek and Check never read it,
// and Invalidate deletes it. Concurrent misses share a load as in Get, and
// its fill, which the callers sharing it depend on, runs on after the ctx
// of the caller that ran the load ended, with a one-second ctx of its own.
//
// load should read the row at that version or later; a value loaded from a
// newer row under an older version is harmless (it is ahead, not stale), and
// so is a hit on a value cached under a newer version than the caller's.
func (c *Cache[T]) GetAt(ctx context.Context, id string, version int64, load Loader[T]) (T, error) {
	var zero T
	if c.notFromNew() {
		return zero, errNotFromNew()
	}
	if load == nil {
		return zero, ErrNilLoader
	}
	if version < 0 {
		return zero, ErrInvalidVersion
	}
	key := c.atKey(id)
	versionText := strconv.FormatInt(version, 10)
	missed := false // as in Get: one read per call
	for {
		// Any replica may serve this read: a lagging one holds an older
		// version, which is a miss, never a stale hit.
		data, err := c.getPastLocalCache(ctx, key)
		switch {
		case err == nil:
			stored, payload, serr := splitVersioned(data)
			if serr == nil && stored < version {
				break // an older version: a miss
			}
			if serr == nil {
				val, derr := c.decode(payload)
				if derr == nil {
					if !missed {
						c.stats.hits.Add(1)
					}
					return val, nil
				}
				serr = derr
			}
			// A miss. fill_at.lua replaces the value only if its version
			// prefix does not parse or is not newer than ours: a newer one
			// may be valid for another process's Codec or T.
			c.decodeFailed(ctx, id, serr)
		case errors.Is(err, redis.Nil):
		default:
			return c.redisDown(ctx, id, "read", err, load)
		}
		if !missed {
			c.stats.misses.Add(1)
			missed = true
		}
		res, shared, leaderEnded, err := c.flights.do(ctx, key+"@"+versionText, id, func() (loaded[T], error) {
			return c.loadAndFillAt(ctx, id, key, versionText, load)
		})
		if err != nil && shared && leaderEnded && ctx.Err() == nil {
			// As in Get: only the leader's own ctx ending is a reason to
			// go round again, whatever its error, and the dropped load is
			// not counted.
			continue
		}
		if shared {
			c.stats.sharedLoads.Add(1)
		}
		if err != nil {
			return zero, err
		}
		return c.answer(id, res, shared)
	}
}

// loadAndFillAt is GetAt's load and fill, under the caller's version.
func (c *Cache[T]) loadAndFillAt(ctx context.Context, id, key, versionText string, load Loader[T]) (loaded[T], error) {
	c.stats.loads.Add(1)
	start := time.Now()
	val, err := load(ctx)
	c.metrics.loaded(ctx, start)
	if err != nil {
		return loaded[T]{}, &LoadError{ID: id, Err: err}
	}
	val, data, err := c.encode(id, val)
	if err != nil {
		return loaded[T]{}, err
	}
	// As in Get: the joined callers are served this value, so it is cached
	// for them too after this caller's ctx ended.
	fillCtx, cancel, detached := fillContext(ctx)
	defer cancel()
	stored, err := c.lua.fillAt.Run(fillCtx, c.client, []string{key},
		versionText, joinVersioned(versionText, data), c.config.TTL.Milliseconds()).Int()
	if err != nil {
		c.fillFailed(ctx, id, err, detached || c.gaveUp(ctx, err) == nil)
	} else {
		c.filled(stored)
	}
	return loaded[T]{val, data}, nil
}

// fillFailed counts and logs a fill that failed; redisFailed says whether
// Redis is to blame (not the caller's own ctx ending).
func (c *Cache[T]) fillFailed(ctx context.Context, id string, err error, redisFailed bool) {
	if redisFailed {
		c.redisFailed(ctx, err)
	}
	c.warn(ctx, &c.logs.fill, "versioncache: fill failed; serving loaded value uncached", id, err)
}

// filled counts a fill script's answer: 1 stored, anything else skipped
// because the version moved (or a newer one is stored).
func (c *Cache[T]) filled(stored int) {
	if stored == 1 {
		c.stats.fills.Add(1)
	} else {
		c.stats.staleFillsSkipped.Add(1)
	}
}

// Invalidate moves id to a new version and deletes its current value
// (P{id}:c, Get's) and its GetAt value (P{id}:a), in one atomic step, so that
// no value cached before the call can be read again, by Get or by GetAt (by
// GetAt through a client that reads from replicas, once the replica has
// the delete), and no Get load that began before it can be stored. Call it after the database
// transaction that changed the value has committed (calling it before leaves
// a window in which a read caches the pre-commit value under the new
// version).
//
// GetAt's values are keyed by the caller's version, not by the id's: a GetAt
// load in flight during the call may still store what it loaded, under its
// caller's version, after Invalidate returned. That is GetAt's contract (the
// caller's version names the value), and it matters only for a write that
// kept that version: then Invalidate, after the write committed, is the
// repair for the divergence CheckAt reports, and CheckAt run again confirms
// it (a GetAt load that read the row before the write and stored after the
// Invalidate shows up as still divergent: Invalidate again). Moving the
// row's version is the lasting fix. An id that only GetAt reads gets a
// version key from Invalidate too, kept for TTL.
//
// Nothing is left behind: the previous value is deleted, not orphaned. A
// *RedisError means the bump may not have happened and the previous value
// may be served until its TTL: retry, or invalidate from an outbox. (One
// such error is Redis refusing a bump that foreign values in the id's keys
// leave without a new version: it names the keys to delete.) A
// *ReplicationError (only with Config.InvalidateReplicas) means the bump
// happened on the primary but fewer replicas than asked confirmed it. When
// the caller's own ctx ended, the *RedisError wraps ctx's error, also when
// go-redis reported it as an i/o timeout (wrapped too), and is not counted
// as a Redis error.
//
// While the id's Redis Cluster slot migrates, Redis answers the bump
// TRYAGAIN (see the package documentation): Invalidate tries again, backing
// off up to 200 ms, until the migration has ended or ctx does. The
// *RedisError it then returns matches ErrSlotMigrating as well as ctx's
// error, and counts as one Redis error. Give it a ctx with a deadline.
func (c *Cache[T]) Invalidate(ctx context.Context, id string) error {
	if c.notFromNew() {
		return errNotFromNew()
	}
	keys := []string{c.versionKey(id), c.currentKey(id), c.atKey(id)}
	ttl := c.config.TTL.Milliseconds()
	replicas := -1
	err := retryMigrating(ctx, func() error {
		if c.config.InvalidateReplicas > 0 {
			var err error
			_, replicas, err = c.bumpAndWait(ctx, keys, ttl)
			return err
		}
		return c.lua.bump.Run(ctx, c.client, keys, ttl).Err()
	})
	if err != nil {
		// Still a *RedisError (the bump may or may not have happened), but
		// the caller's own ctx ending is no Redis failure, and the error
		// says so whatever go-redis reported it as (with
		// ContextTimeoutEnabled, an i/o timeout at the ctx's deadline).
		// A migration that outlasted the ctx is one, counted once.
		switch cerr := c.gaveUp(ctx, err); {
		case cerr == nil || errors.Is(err, ErrSlotMigrating):
			c.redisFailed(ctx, err)
		case !errors.Is(err, cerr):
			err = fmt.Errorf("%w: %w", cerr, err)
		}
		return &RedisError{Op: "invalidate", ID: id, Err: err}
	}
	if replicas >= 0 && replicas < c.config.InvalidateReplicas {
		c.stats.replicationErrors.Add(1)
		return &ReplicationError{ID: id, Want: c.config.InvalidateReplicas, Got: replicas}
	}
	c.stats.invalidations.Add(1)
	return nil
}

// bumpAndWait runs the bump and WAIT in one pipeline on one connection of the
// primary that owns the id: WAIT only counts that connection's writes.
func (c *Cache[T]) bumpAndWait(ctx context.Context, keys []string, ttl int64) ([]any, int, error) {
	var bump *redis.Cmd
	var wait *redis.Cmd
	queue := func(p redis.Pipeliner) {
		// EVAL, not EVALSHA: a NOSCRIPT inside the pipeline would still
		// run the WAIT, for nothing.
		bump = p.Eval(ctx, c.lua.bumpSrc, keys, ttl)
		wait = p.Do(ctx, "WAIT", c.config.InvalidateReplicas, c.config.InvalidateWaitTimeout.Milliseconds())
	}
	var err error
	switch client := c.client.(type) {
	case *redis.ClusterClient:
		// A MOVED or ASK reply to the bump (the pipeline's only keyed
		// command) means it did not run: it runs again on the new master.
		err = clusterpin.OnMaster(ctx, client, keys[0], queue)
	case *redis.Client:
		_, err = client.Pipelined(ctx, func(p redis.Pipeliner) error {
			queue(p)
			return nil
		})
	}
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
// Check. It reads what Get caches (P{id}:c), not GetAt's values (P{id}:a). ok is false when
// nothing is cached. version is the version the value
// was cached under when ok, else the id's current version (0 when it has
// none). It reads on the primary, like Get.
//
// Unlike Get, Peek does not repair: a cached value that does not decode is
// left in place and reported as a *CodecError with Op "decode", ok false,
// and the version it claims (0 when it has none).
//
// While the id's Redis Cluster slot migrates, Peek waits for it to end as
// Invalidate does; when ctx ends first, it returns a *RedisError matching
// ErrSlotMigrating and ctx's error, counted as one Redis error.
func (c *Cache[T]) Peek(ctx context.Context, id string) (val T, version int64, ok bool, err error) {
	if c.notFromNew() {
		return val, 0, false, errNotFromNew()
	}
	var r readResult
	err = retryMigrating(ctx, func() (err error) {
		r, err = c.read(ctx, id, false, false)
		return err
	})
	if err != nil {
		if cerr := c.gaveUp(ctx, err); cerr != nil && !errors.Is(err, ErrSlotMigrating) {
			return val, 0, false, cerr
		}
		c.redisFailed(ctx, err)
		return val, 0, false, &RedisError{Op: "peek", ID: id, Err: err}
	}
	if !r.found {
		if r.version != "" {
			version, _ = strconv.ParseInt(r.version, 10, 64)
		}
		return val, version, false, nil
	}
	version, payload, err := splitVersioned(r.current)
	if err == nil {
		val, err = c.decode(payload)
	}
	if err != nil {
		c.stats.decodeErrors.Add(1)
		return val, version, false, &CodecError{Op: "decode", ID: id, Err: err}
	}
	return val, version, true, nil
}

type readResult struct {
	version string // as stored; "" when not found by Peek, or when found
	current []byte // contents of the current key, when found
	found   bool
	lease   int64
	// undecodable: the current value Get found undecodable before this
	// miss (set by Get, not by the script).
	undecodable []byte
}

// read runs the miss script: the current value if there is one (unless
// ignoreCurrent), else the version (initialising it when initialise) and,
// for Get, the fill lease.
func (c *Cache[T]) read(ctx context.Context, id string, initialise, ignoreCurrent bool) (readResult, error) {
	return c.readScript(ctx, id, initialise, ignoreCurrent, "")
}

// pollWaited is a waiter's poll for the value of version: read as a miss,
// except that under another version it takes no lease. A lease taken
// there would be given up when the waiter starts over, or left to lapse if
// its caller gave up first; and the process may hold it already, for
// another goroutine's load, which giving it up would expose to a second
// load by another process.
func (c *Cache[T]) pollWaited(ctx context.Context, id, version string) (readResult, error) {
	return c.readScript(ctx, id, true, false, version)
}

// readScript is read, and pollWaited when waitedFor is a version.
func (c *Cache[T]) readScript(ctx context.Context, id string, initialise, ignoreCurrent bool, waitedFor string) (readResult, error) {
	mode, leaseTTL, ignore := "0", "0", "0"
	if initialise {
		mode = "1"
		if !c.config.DisableFillLease {
			leaseTTL = strconv.FormatInt(c.config.FillLeaseTTL.Milliseconds(), 10)
		}
	}
	if ignoreCurrent {
		ignore = "1"
	}
	keys := []string{c.versionKey(id), c.currentKey(id), c.leaseKey(id)}
	// A miss keeps the version key alive for TTL + FillLeaseTTL (in
	// milliseconds, where the sum cannot overflow), so that a load that
	// outlasts TTL is still cached; see Config.TTL.
	versionLife := c.config.TTL.Milliseconds() + c.config.FillLeaseTTL.Milliseconds()
	args := []any{mode, versionLife, leaseTTL, c.leaseToken, ignore, waitedFor}
	// Peek's mode ("0") returns before any write in read.lua: it goes as
	// EVALSHA_RO (EVAL_RO after NOSCRIPT), which Redis checks against
	// read key permission only, so a tool whose ACL user may only read the
	// cache's keys (%R~) can Peek and Check; EVALSHA and EVAL need write
	// permission on every key named. A miss's mode writes, so it cannot.
	var cmd *redis.Cmd
	switch {
	case c.primary != nil && initialise:
		// On the master, like the hit's GET: the script may return the
		// current value, and a demoted master would run it as a replica.
		cmd = clusterpin.Eval(ctx, c.primary, c.lua.read, keys, args...)
	case c.primary != nil:
		// Pinned too: go-redis deems the RO variants read-only.
		cmd = clusterpin.EvalRO(ctx, c.primary, c.lua.peek, keys, args...)
	case initialise:
		cmd = c.lua.read.Run(ctx, c.client, keys, args...)
	default:
		// c.primary is nil: the client routes no read to a replica, so
		// the RO variants go where EVALSHA would.
		cmd = c.lua.peek.RunRO(ctx, c.client, keys, args...)
	}
	res, err := cmd.Slice()
	if err != nil {
		return readResult{}, err
	}
	if len(res) != 3 {
		return readResult{}, fmt.Errorf("versioncache: read script returned %d elements, want 3", len(res))
	}
	var r readResult
	r.version, _ = res[0].(string)
	if v, ok := res[1].(string); ok {
		r.current, r.found = []byte(v), true
	}
	r.lease, _ = res[2].(int64)
	if initialise && !r.found && r.version == "" {
		return readResult{}, errors.New("versioncache: read script returned no version")
	}
	return r, nil
}

// encode encodes a loaded value for the cache and returns it as a hit will
// decode it: a miss and the hits after it answer the same value (the same
// rounding, the same dropped fields), and a value that does not survive its
// Codec is an error now rather than a decode failure on every later hit.
func (c *Cache[T]) encode(id string, val T) (T, []byte, error) {
	var zero T
	data, err := c.marshal(val)
	if err != nil {
		return zero, nil, &CodecError{Op: "encode", ID: id, Err: err}
	}
	decoded, err := c.decode(data)
	if err != nil {
		return zero, nil, &CodecError{Op: "decode", ID: id, Err: err}
	}
	return decoded, data, nil
}

// marshal encodes val with the Codec, behind the Cache's shape tag.
func (c *Cache[T]) marshal(val T) ([]byte, error) {
	data, err := c.config.Codec.Marshal(val)
	if err != nil {
		return nil, err
	}
	return append(c.shape[:len(c.shape):len(c.shape)], data...), nil
}

// errOtherShape: the value was stored by a Cache with another T or Codec.
var errOtherShape = errors.New("stored for another type or Codec under this Prefix (its shape tag differs)")

// decode decodes what marshal encoded.
func (c *Cache[T]) decode(data []byte) (T, error) {
	var val T
	if !bytes.HasPrefix(data, c.shape) {
		return val, errOtherShape
	}
	data = data[len(c.shape):]
	if c.plainJSON {
		return val, json.Unmarshal(data, &val)
	}
	err := c.config.Codec.Unmarshal(data, &val)
	return val, err
}

func (c *Cache[T]) versionKey(id string) string {
	return keyenc.Tagged(c.config.Prefix, id, suffixVersion)
}

// currentKey holds "<version>:<shape>~<encoded value>" while that value is current.
func (c *Cache[T]) currentKey(id string) string {
	return keyenc.Tagged(c.config.Prefix, id, suffixCurrent)
}

// atKey holds GetAt's "<caller's version>:<shape>~<encoded value>".
func (c *Cache[T]) atKey(id string) string {
	return keyenc.Tagged(c.config.Prefix, id, suffixAt)
}

// flightKey names one load of id under version within this process.
func (c *Cache[T]) flightKey(id, version string) string {
	return c.currentKey(id) + "@" + version
}

// leaseKey holds the fill lease of id: "<version>:<lease token>". One key per
// id, not per version, so that the read script can declare it in KEYS
// before it has read the version.
func (c *Cache[T]) leaseKey(id string) string {
	return keyenc.Tagged(c.config.Prefix, id, suffixLease)
}

func isContextErr(err error) bool {
	return errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
}

// callerGaveUp returns the caller's own context error when a Redis call
// failed because the caller's ctx ended, and nil otherwise: with a context
// error, or with the network timeout a client with ContextTimeoutEnabled
// (and no retry to notice the ctx) gets at the ctx's deadline — which the
// connection can see a moment before the ctx itself is done. That is not a
// Redis failure.
func callerGaveUp(ctx context.Context, err error) error {
	cerr := ctx.Err()
	switch {
	case isContextErr(err):
		return cerr
	case !errors.Is(err, os.ErrDeadlineExceeded):
		return nil
	case cerr != nil:
		return cerr
	}
	if deadline, ok := ctx.Deadline(); ok && !time.Now().Before(deadline) {
		return context.DeadlineExceeded
	}
	return nil
}

// gaveUp is callerGaveUp for a call c made, which also has a cluster
// client reload its slot map (rate-limited, as for a Redis failure; not
// counted as one) when the caller's deadline ended the call: a master that
// stopped answering without resetting its connections (a lost host)
// shows a caller whose deadline is shorter than the client's ReadTimeout
// nothing but that deadline, and without the reload every call would go
// to it until go-redis's periodic reload, a minute later by default.
func (c *Cache[T]) gaveUp(ctx context.Context, err error) error {
	cerr := callerGaveUp(ctx, err)
	if errors.Is(cerr, context.DeadlineExceeded) {
		clusterpin.ReloadIfUnreachable(ctx, c.client, err)
	}
	return cerr
}

// Backoff between attempts of a call that Redis Cluster answered TRYAGAIN
// (see retryMigrating): short at first, since moving one slot's keys often
// takes milliseconds, and capped so that the call notices the migration's
// end soon after it. migratingRedirectsMax bounds the redirects retried in
// a row, so that a cluster whose nodes keep disagreeing fails the call.
const (
	migratingBackoffMin   = 10 * time.Millisecond
	migratingBackoffMax   = 200 * time.Millisecond
	migratingRedirectsMax = 5
)

// retryMigrating runs attempt again, with capped exponential backoff, for
// as long as it fails with TRYAGAIN and ctx lasts. During a slot migration
// Redis Cluster answers TRYAGAIN to a script unless one node holds every
// key it names, and ours name keys that rarely all exist (P{id}:a, P{id}:l,
// or P{id}:c on a miss): nearly every call on the slot gets it until the
// migration ends, far longer than go-redis's own retries (MaxRedirects).
// TRYAGAIN means the script did not run, so running it again is safe.
//
// As the migration ends, the two nodes briefly disagree about the slot's
// owner, and go-redis's redirects can run out on a MOVED or ASK reply;
// that too means the script did not run, and up to migratingRedirectsMax
// of them in a row are retried the same way.
//
// When ctx ends after a TRYAGAIN or a redirect, the error matches
// ErrSlotMigrating and wraps that reply and ctx's error, including when
// ctx cut off an attempt in flight (which may then have run). Any other
// error is attempt's own.
func retryMigrating(ctx context.Context, attempt func() error) error {
	var (
		refused   error // the last TRYAGAIN or redirect reply
		redirects int   // redirects in a row
	)
	for backoff := migratingBackoffMin; ; backoff = min(2*backoff, migratingBackoffMax) {
		err := attempt()
		switch {
		case redis.IsTryAgainError(err) || isAsk(err):
			// ASK: the slot is migrating and the command did not run; a
			// pinned command cannot follow it to an importing master that
			// serves no slot yet (a node just added), so wait as for
			// TRYAGAIN.
			redirects = 0
		case isRedirect(err) && redirects < migratingRedirectsMax:
			redirects++
		default:
			if refused != nil {
				if cerr := callerGaveUp(ctx, err); cerr != nil {
					return slotMigrating(refused, cerr)
				}
			}
			return err
		}
		refused = err
		select {
		case <-ctx.Done():
			return slotMigrating(refused, ctx.Err())
		case <-time.After(backoff):
		}
	}
}

// isAsk reports whether err is an ASK reply.
func isAsk(err error) bool {
	_, ok := redis.IsAskError(err)
	return ok
}

// isRedirect reports whether err is a MOVED or ASK reply.
func isRedirect(err error) bool {
	if _, ok := redis.IsMovedError(err); ok {
		return true
	}
	_, ok := redis.IsAskError(err)
	return ok
}

// slotMigrating returns a TRYAGAIN or redirect reply as an error matching
// ErrSlotMigrating, and cerr, the caller's ctx error that ended its
// retries, when not nil.
func slotMigrating(tryAgain, cerr error) error {
	if cerr == nil {
		return fmt.Errorf("%w: %w", ErrSlotMigrating, tryAgain)
	}
	return fmt.Errorf("%w (retried until %w): %w", ErrSlotMigrating, cerr, tryAgain)
}

// redisFailed counts a failed Redis call, and has a cluster client reload
// its slot map when the call could not reach its node: go-redis reloads it
// on redirects and every ClusterStateReloadInterval only, so after a
// master died the commands it routes there would fail until then.
func (c *Cache[T]) redisFailed(ctx context.Context, err error) {
	c.stats.redisErrors.Add(1)
	clusterpin.ReloadIfUnreachable(ctx, c.client, err)
}
