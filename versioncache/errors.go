package versioncache

import (
	"errors"
	"fmt"
	"strings"
)

// Sentinel errors. Match them with errors.Is; the typed errors below match
// the relevant sentinel too.
var (
	// ErrNilClient is returned by New without a Redis client.
	ErrNilClient = errors.New("versioncache: nil redis client")
	// ErrNilLoader is returned by Get, GetAt, Check and CheckAt without a
	// loader.
	ErrNilLoader = errors.New("versioncache: nil loader")
	// ErrInvalidConfig is matched by every *ConfigError.
	ErrInvalidConfig = errors.New("versioncache: invalid config")
	// ErrRedis is matched by every *RedisError.
	ErrRedis = errors.New("versioncache: redis failed")
	// ErrLoad is matched by every *LoadError.
	ErrLoad = errors.New("versioncache: loader failed")
	// ErrCodec is matched by every *CodecError.
	ErrCodec = errors.New("versioncache: codec failed")
	// ErrNotReplicated is matched by every *ReplicationError.
	ErrNotReplicated = errors.New("versioncache: invalidation not confirmed by replicas")
	// ErrInvalidVersion is returned by GetAt for a negative version.
	ErrInvalidVersion = errors.New("versioncache: version must not be negative")
	// ErrSlotMigrating is matched by a *RedisError that Redis Cluster
	// caused by answering TRYAGAIN: the id's slot is migrating between
	// masters, and no one node holds every key the call's script names.
	// Invalidate and Peek (so Check) retry TRYAGAIN until their ctx ends
	// and only then return it; a miss of Get returns it (FailClosed) at
	// once. See the package documentation on Redis Cluster.
	ErrSlotMigrating = errors.New("versioncache: the id's Redis Cluster slot is migrating")
)

// ConfigError reports a Config field that cannot be used; or, with Field
// naming a go-redis option ("Options.ReadTimeout",
// "ClusterOptions.WriteTimeout", "RingOptions.ReadTimeout", ...), a client
// that could wait for Redis forever (see New); or, with Field "client", a
// Cache that New did not make (a zero Cache or a nil *Cache), which has no
// Redis client: its methods return it instead of panicking.
type ConfigError struct {
	Field  string
	Reason string
}

func (e *ConfigError) Error() string {
	switch {
	case e.Field == fieldClient:
		return "versioncache: " + e.Field + " " + e.Reason
	case clientOption(e.Field):
		return fmt.Sprintf("versioncache: the client's %s %s", e.Field, e.Reason)
	}
	return fmt.Sprintf("versioncache: Config.%s %s", e.Field, e.Reason)
}

// clientOption reports whether a ConfigError's Field names an option of
// the Redis client ("Options.ReadTimeout") rather than of Config, whose
// fields have no dot.
func clientOption(field string) bool { return strings.Contains(field, ".") }

// fieldClient is ConfigError.Field for a Cache that New did not make.
const fieldClient = "client"

// errNotFromNew is the error of a method called on a Cache that New did
// not make.
func errNotFromNew() error {
	return &ConfigError{Field: fieldClient, Reason: "is nil: the Cache was not made by New; create it with New(client, config)"}
}

// Is reports whether target is ErrInvalidConfig.
func (e *ConfigError) Is(target error) bool { return target == ErrInvalidConfig }

// RedisError is a failed Redis operation. With FailOpen, Get never returns
// it (it serves the loader's value); Invalidate always does, because a lost
// invalidation leaves the previous value readable until its TTL. A read
// that failed because the caller's own ctx ended is not one: Get, GetAt and
// Peek return ctx.Err() and count no Redis error. Invalidate still returns
// one then (the bump may have happened), wrapping ctx's error (so that
// errors.Is(err, context.DeadlineExceeded) holds, whatever go-redis
// reported) as well as the client's, but counts no Redis error either.
//
// One that Redis Cluster caused with TRYAGAIN, during a slot migration,
// also matches ErrSlotMigrating. Invalidate and Peek return it only once
// their ctx has ended (it then wraps ctx's error too); it is counted as
// one Redis error however often the call was retried.
type RedisError struct {
	Op  string // "read", "invalidate", "peek"
	ID  string
	Err error
}

func (e *RedisError) Error() string {
	return fmt.Sprintf("versioncache: redis %s of id %q: %v", e.Op, e.ID, e.Err)
}

func (e *RedisError) Unwrap() error { return e.Err }

// Is reports whether target is ErrRedis.
func (e *RedisError) Is(target error) bool { return target == ErrRedis }

// LoadError wraps an error returned by the caller's loader, or, for callers
// that shared a load whose loader panicked or did not return (see Loader),
// an error saying so. Nothing is cached when the loader fails.
type LoadError struct {
	ID  string
	Err error
}

func (e *LoadError) Error() string {
	return fmt.Sprintf("versioncache: load of id %q: %v", e.ID, e.Err)
}

func (e *LoadError) Unwrap() error { return e.Err }

// Is reports whether target is ErrLoad.
func (e *LoadError) Is(target error) bool { return target == ErrLoad }

// CodecError is a loaded value that does not survive the Codec (it does not
// encode, or its encoding does not decode: from Get, GetAt, Check and
// CheckAt), or, from Peek only, a cached value it could not decode. Get and
// GetAt never fail on a cached value that does not decode: they treat it as a miss,
// load, and overwrite it with what they loaded. GetAt does not overwrite one
// stored under a newer version than the caller's (it may be valid for a
// process with another Codec or type, during a rollout): it serves the
// caller's load uncached. Check counts it as CheckReport.Undecodable.
type CodecError struct {
	Op  string // "encode" or "decode"
	ID  string
	Err error
}

func (e *CodecError) Error() string {
	return fmt.Sprintf("versioncache: %s value of id %q: %v", e.Op, e.ID, e.Err)
}

func (e *CodecError) Unwrap() error { return e.Err }

// Is reports whether target is ErrCodec.
func (e *CodecError) Is(target error) bool { return target == ErrCodec }

// ReplicationError is returned by Invalidate when Config.InvalidateReplicas
// is set and fewer replicas confirmed the new version in time. The primary
// has the new version; a failover before the replicas catch up could lose it.
type ReplicationError struct {
	ID        string
	Want, Got int
}

func (e *ReplicationError) Error() string {
	return fmt.Sprintf("versioncache: invalidation of id %q reached %d of %d replicas", e.ID, e.Got, e.Want)
}

// Is reports whether target is ErrNotReplicated.
func (e *ReplicationError) Is(target error) bool { return target == ErrNotReplicated }
