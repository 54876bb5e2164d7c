package deps

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"runtime"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Unbounded names a Redis client option that lets a command wait for
// Redis forever, and says how to fix it. Each package turns it into its
// own *ConfigError.
type Unbounded struct {
	Field  string // for example "Options.ReadTimeout"
	Reason string
}

// Error makes an Unbounded usable as the error a Ring's ForEachShard
// callback returns.
func (u *Unbounded) Error() string { return u.Field + ": " + u.Reason }

// UnboundedRedis reports a client that can wait for Redis forever, or nil.
//
// go-redis ends a command in flight only at its connection's deadline,
// which comes from ReadTimeout and WriteTimeout and, with
// ContextTimeoutEnabled, from the context's deadline; cancelling the
// context does not end it. So a *redis.Client, *redis.ClusterClient or
// *redis.Ring is reported when its ReadTimeout or WriteTimeout is -2,
// which makes go-redis set no deadline at all (not even the context's), or
// is -1 (no timeout) while ContextTimeoutEnabled is false. A Ring is
// checked on its RingOptions, which go-redis gives every shard, up or
// down; with a RingOptions.NewClient function of the caller's, on the
// clients it made for the shards that are up. Not checked: other client
// types, and the node clients a ClusterOptions.NewClient function makes.
func UnboundedRedis(client redis.UniversalClient) *Unbounded {
	switch c := client.(type) {
	case *redis.Client:
		// Options() hold what Options.init made of the caller's values:
		// -1 reads as 0, -2 as -1.
		o := c.Options()
		return checkDeadlines("Options", o.ReadTimeout, o.WriteTimeout, o.ContextTimeoutEnabled)
	case *redis.ClusterClient:
		// ClusterOptions.init turns -1 into 0 and keeps -2; the cluster's
		// pipelines and its node clients apply those.
		o := c.Options()
		return checkDeadlines("ClusterOptions", o.ReadTimeout, o.WriteTimeout, o.ContextTimeoutEnabled)
	case *redis.Ring:
		// RingOptions keep the caller's values. With go-redis's own
		// NewClient every shard's client gets them as Options.init reads
		// them, so they are checked for every shard, also one the
		// heartbeat has marked down (ForEachShard skips those). A caller's
		// NewClient may set other timeouts: then the clients it made for
		// the shards that are up are checked.
		o := c.Options()
		if !customRingClients(o) {
			read, write := clientTimeouts(o.ReadTimeout, o.WriteTimeout)
			return checkDeadlines("RingOptions", read, write, o.ContextTimeoutEnabled)
		}
		// ForEachShard calls back concurrently and returns one of the
		// errors; any of them will do.
		err := c.ForEachShard(context.Background(), func(_ context.Context, shard *redis.Client) error {
			o := shard.Options()
			if u := checkDeadlines("RingOptions", o.ReadTimeout, o.WriteTimeout, o.ContextTimeoutEnabled); u != nil {
				return u
			}
			return nil
		})
		var u *Unbounded
		if errors.As(err, &u) {
			return u
		}
	}
	return nil
}

// customRingClients reports whether a Ring's shard clients come from a
// caller's RingOptions.NewClient rather than from the function
// RingOptions.init puts there when it is nil. Should go-redis rename that
// function, every Ring reads as custom, and the shards that are up are
// checked as before.
func customRingClients(o *redis.RingOptions) bool {
	if o.NewClient == nil {
		return false
	}
	fn := runtime.FuncForPC(reflect.ValueOf(o.NewClient).Pointer())
	return fn == nil || !strings.HasPrefix(fn.Name(), "github.com/redis/go-redis/v9.(*RingOptions).init.")
}

// clientTimeouts returns the read and write timeouts a client gets from
// the caller's values, as Options.init reads them: -2 becomes -1 (no
// deadline), -1 becomes 0 (no timeout), a zero ReadTimeout 5s and a zero
// WriteTimeout the ReadTimeout.
func clientTimeouts(read, write time.Duration) (time.Duration, time.Duration) {
	conv := func(d, zero time.Duration) time.Duration {
		switch d {
		case -2:
			return -1
		case -1:
			return 0
		case 0:
			return zero
		}
		return d
	}
	read = conv(read, 5*time.Second)
	return read, conv(write, read)
}

// checkDeadlines checks timeouts as go-redis applies them: positive, a
// timeout; 0, none (only the context's deadline, with ContextTimeoutEnabled);
// negative, no deadline at all, since pool.Conn.WithReader and WithWriter
// then skip SetReadDeadline and SetWriteDeadline, the context's deadline
// included. opts names the caller's options type in the field.
func checkDeadlines(opts string, read, write time.Duration, ctxDeadline bool) *Unbounded {
	for _, t := range []struct {
		field string
		d     time.Duration
	}{{"ReadTimeout", read}, {"WriteTimeout", write}} {
		switch {
		case t.d < 0:
			return &Unbounded{Field: opts + "." + t.field, Reason: fmt.Sprintf("is -2 (or another negative value), which makes go-redis set no deadline on the connection at all, "+
				"not even the context's with ContextTimeoutEnabled: a Redis that stops answering would block the call, and a shutdown waiting for it, forever; "+
				"set a positive %s (go-redis's default is 5s), or -1 with ContextTimeoutEnabled so that the context's deadline ends the command", t.field)}
		case t.d == 0 && !ctxDeadline:
			return &Unbounded{Field: opts + "." + t.field, Reason: fmt.Sprintf("disables the timeout while ContextTimeoutEnabled is false: "+
				"go-redis does not end a command in flight when its context is cancelled, so a Redis that stops answering would block the call, "+
				"and a shutdown waiting for it, forever; set a positive %s (go-redis's default is 5s), or ContextTimeoutEnabled so that the context's deadline ends the command", t.field)}
		}
	}
	return nil
}
