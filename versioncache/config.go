package versioncache

import (
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/metric"

	"github.com/verity-go/verity/internal/deps"
	"github.com/verity-go/verity/internal/keyenc"
)

// Defaults for Config fields left at their zero value.
const (
	// TTLDefault is how long a cached value lives.
	TTLDefault = time.Hour
	// FillLeaseTTLDefault is how long a cross-process fill lease is held
	// before another process may take it over.
	FillLeaseTTLDefault = 5 * time.Second
	// FillLeaseWaitDefault is how long a process that lost the fill lease
	// polls for the winner's value before it loads on its own.
	FillLeaseWaitDefault = 500 * time.Millisecond
	// FillLeasePollDefault is the interval between those polls.
	FillLeasePollDefault = 5 * time.Millisecond
	// InvalidateWaitTimeoutDefault bounds how long Invalidate waits for
	// replicas when InvalidateReplicas is set.
	InvalidateWaitTimeoutDefault = 100 * time.Millisecond
)

// waitReplySlack is how much longer than InvalidateWaitTimeout the client
// must be willing to wait for WAIT's reply: Redis ends a WAIT that timed
// out on its event loop's next tick, up to 1/hz later (100 ms at the
// default hz 10), and the reply still has to travel.
const waitReplySlack = 250 * time.Millisecond

// FailureMode says what Get does when Redis cannot be reached.
type FailureMode int

const (
	// FailOpen serves the loader's value, straight from the source of truth,
	// and does not cache it. Availability follows the database. Each Get
	// still waits for the Redis client to give up first, so keep its
	// DialTimeout, ReadTimeout and MaxRetries short. Every such Get is
	// counted (Stats.RedisErrors and FailOpenLoads, and their metrics), but
	// its warning is logged at most once a second (see Config.Logger).
	FailOpen FailureMode = iota
	// FailClosed returns a *RedisError instead, protecting the database from
	// the full read load when the cache is down. It refuses only a failed
	// read: once a loader ran, its value is served even if caching it
	// fails (that fill is logged and counted as a Redis error).
	FailClosed
)

// String returns "fail-open" for FailOpen, "fail-closed" for FailClosed,
// and "FailureMode(N)" for any other value (N its number).
func (m FailureMode) String() string {
	switch m {
	case FailOpen:
		return "fail-open"
	case FailClosed:
		return "fail-closed"
	}
	return fmt.Sprintf("FailureMode(%d)", int(m))
}

// Config configures a Cache. Prefix is required; every other field's zero
// value selects its default.
type Config struct {
	// Prefix is prepended to every key; it is required, and must not contain
	// '{' or '}'. Give each cache its own ("shop:product:"): two caches that
	// share a prefix share versions and values, and one would serve the
	// other's values as its own (JSON decodes a product into a user without
	// complaint), so there is no default.
	Prefix string

	// TTL bounds how long a value is kept after it was loaded (a hit does
	// not extend it). Invalidate deletes values rather than leaving them
	// behind, so TTL bounds staleness only for writes that never call
	// Invalidate (or whose Invalidate was lost), not memory.
	//
	// It also sets the idle lifetime of an id's version key: at least TTL
	// after an Invalidate or a fill, and TTL + FillLeaseTTL after a miss, so
	// that the miss's load can take longer than TTL. A load is cached when
	// its fill comes within TTL + FillLeaseTTL of the last miss that read
	// its version (and no Invalidate came in between). A slower load is
	// served but not cached, and counted in Stats.StaleFillsSkipped: its
	// version key has expired, and with it the proof that no write
	// happened during the load. Defaults to TTLDefault.
	TTL time.Duration

	// Codec encodes cached values. Defaults to JSONCodec. A typed nil (a
	// nil *MyCodec) is not taken for unset: New refuses it with a
	// *ConfigError naming Codec, as it refuses a typed-nil client, rather
	// than failing on the first miss.
	Codec Codec

	// FailureMode decides between serving the loader's value and returning
	// an error when Redis fails. A stale value is never served in either
	// mode. Defaults to FailOpen.
	FailureMode FailureMode

	// DisableFillLease turns off the cross-process fill lease, leaving only
	// the in-process single flight. Defaults to false (lease on).
	DisableFillLease bool

	// FillLeaseTTL is how long the process that won a miss may take to load
	// and fill before the lease lapses and another process may load. It
	// should exceed a slow load. With the lease on or off, it also lets a
	// load outlast TTL and still be cached (see TTL). Defaults to
	// FillLeaseTTLDefault.
	FillLeaseTTL time.Duration

	// FillLeaseWait is how long a process that lost the lease waits for the
	// winner's value before loading itself. A poll still waiting for a pool
	// connection, or for Redis's answer on a client with
	// ContextTimeoutEnabled, is cut off when it runs out (without
	// ContextTimeoutEnabled, go-redis waits for the answer to a command it
	// has sent, up to its ReadTimeout). Defaults to FillLeaseWaitDefault.
	FillLeaseWait time.Duration

	// FillLeasePoll is the interval at which a waiting process looks for the
	// winner's value. Defaults to FillLeasePollDefault.
	FillLeasePoll time.Duration

	// InvalidateReplicas, when positive, makes Invalidate wait (Redis WAIT,
	// on the connection that ran the bump) until that many replicas have the
	// new version, and return a *ReplicationError if fewer confirm in time.
	// Without it, a failover right after Invalidate can promote a replica
	// that never saw the bump: the version key is then not missing but old,
	// and the value cached before the write is readable again until TTL.
	// Supported with *redis.Client (including failover clients) and
	// *redis.ClusterClient. Defaults to 0 (do not wait).
	InvalidateReplicas int

	// InvalidateWaitTimeout bounds the wait for InvalidateReplicas, and is
	// used for nothing else. It must be at least 250 ms below the client's
	// ReadTimeout (go-redis's default is 5 s), or the client could give up
	// on WAIT's reply first (Redis answers a WAIT that timed out up to 1/hz
	// late: 100 ms at the default hz 10); New refuses it otherwise (only when
	// InvalidateReplicas is set). A client ReadTimeout below 350 ms is
	// therefore too short for the default, and one below 251 ms for any
	// value (it must be at least 1 ms): raise it, or leave
	// InvalidateReplicas 0. Defaults to
	// InvalidateWaitTimeoutDefault.
	InvalidateWaitTimeout time.Duration

	// Logger receives warnings about Redis failures and codec errors.
	// Each kind of warning (a FailOpen read, a failed fill, a failed lease
	// release, a value that does not decode) is logged at once the first
	// time, then at most once a second while it recurs, so that an outage
	// logs about a line a second rather than a line per Get; each line's
	// "suppressed" attribute counts the occurrences not logged since the
	// line before. Stats and the metrics count every occurrence. Defaults
	// to a logger that discards everything.
	Logger *slog.Logger

	// MeterProvider receives the cache's metrics (verity.cache.*: reads by
	// hit or miss, loads, fills, stale fills skipped, fallbacks, lease
	// waits, invalidations, errors, load duration; see the README's
	// metrics table). The counters are the Stats counters, observed at
	// collection time, so a hit costs nothing extra. Call Close when
	// discarding a Cache created with a provider. Defaults to nil (left
	// nil by WithDefaults): nothing is recorded.
	MeterProvider metric.MeterProvider
}

// WithDefaults returns a copy of c (or of the zero Config when c is nil)
// with every unset field but Prefix set to its default.
func (c *Config) WithDefaults() *Config {
	out := Config{}
	if c != nil {
		out = *c
	}
	if out.TTL == 0 {
		out.TTL = TTLDefault
	}
	if out.Codec == nil {
		out.Codec = JSONCodec{}
	}
	if out.FillLeaseTTL == 0 {
		out.FillLeaseTTL = FillLeaseTTLDefault
	}
	if out.FillLeaseWait == 0 {
		out.FillLeaseWait = FillLeaseWaitDefault
	}
	if out.FillLeasePoll == 0 {
		out.FillLeasePoll = FillLeasePollDefault
	}
	if out.InvalidateWaitTimeout == 0 {
		out.InvalidateWaitTimeout = InvalidateWaitTimeoutDefault
	}
	if out.Logger == nil {
		out.Logger = slog.New(slog.DiscardHandler)
	}
	return &out
}

func (c *Config) validate() error {
	if c.Prefix == "" {
		return &ConfigError{Field: "Prefix", Reason: `is required: give each cache its own prefix (say "shop:product:"); caches that share one serve each other's values`}
	}
	if err := keyenc.ValidatePrefix(c.Prefix); err != nil {
		return &ConfigError{Field: "Prefix", Reason: err.Error()}
	}
	if c.TTL < time.Millisecond {
		return &ConfigError{Field: "TTL", Reason: "must be at least 1ms (Redis expiries are in milliseconds); leave it zero for the default"}
	}
	if deps.Missing(c.Codec) { // WithDefaults set an untyped nil: a typed one
		return &ConfigError{Field: "Codec", Reason: fmt.Sprintf("is a nil %T; leave it nil for JSONCodec, or pass a usable Codec", c.Codec)}
	}
	if c.FailureMode != FailOpen && c.FailureMode != FailClosed {
		return &ConfigError{Field: "FailureMode", Reason: "must be FailOpen or FailClosed"}
	}
	if c.FillLeaseTTL < time.Millisecond {
		return &ConfigError{Field: "FillLeaseTTL", Reason: "must be at least 1ms, with the lease on or off (it also bounds how long a load may take and still be cached); leave it zero for the default"}
	}
	if c.FillLeaseWait < 0 {
		return &ConfigError{Field: "FillLeaseWait", Reason: "must not be negative"}
	}
	if c.InvalidateReplicas < 0 {
		return &ConfigError{Field: "InvalidateReplicas", Reason: "must not be negative"}
	}
	if c.InvalidateWaitTimeout < time.Millisecond {
		return &ConfigError{Field: "InvalidateWaitTimeout", Reason: "must be at least 1ms (WAIT takes milliseconds); leave it zero for the default"}
	}
	if c.FillLeasePoll <= 0 {
		return &ConfigError{Field: "FillLeasePoll", Reason: "must be positive; leave it zero for the default"}
	}
	return nil
}
