package projection

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/deps"
)

// EvictionPolicyError reports a Redis server that may evict keys without a
// TTL, the gate's version keys among them: it has a memory limit and an
// allkeys-* maxmemory-policy. An evicted version key lets a redelivered
// older record apply, until a reconcile pass repairs the entry.
type EvictionPolicyError struct {
	Addr      string // the server, as the client names it
	Policy    string // its maxmemory-policy, for example "allkeys-lru"
	MaxMemory int64  // its maxmemory in bytes (never 0: without a limit nothing is evicted)
}

func (e *EvictionPolicyError) Error() string {
	return fmt.Sprintf("projection: redis %s may evict the gate's version keys (maxmemory-policy %s, maxmemory %d bytes), and then let an older record apply; set maxmemory-policy noeviction (or a volatile-* policy, which evicts only keys with a TTL)",
		e.Addr, e.Policy, e.MaxMemory)
}

// Is matches ErrEvictionPolicy.
func (e *EvictionPolicyError) Is(target error) bool { return target == ErrEvictionPolicy }

// CheckEvictionPolicy asks the servers behind client for their memory
// limit and maxmemory-policy (INFO memory) and returns an
// *EvictionPolicyError for each that may evict keys without a TTL: one
// with a maxmemory and an allkeys-* policy. The gate keeps its versions in
// such keys; an evicted one lets a redelivered older record apply (see
// the package documentation). noeviction, and the volatile-* policies,
// which evict only keys with a TTL (the projection's value, version and
// layout keys have none), keep them.
//
// It asks every node of a *redis.ClusterClient's slot map, replicas
// included (a failover promotes a replica with its own settings), every
// shard of a *redis.Ring that the Ring counts as up, and otherwise the
// server the client sends commands to. A server that cannot be asked (a
// node the client lists but cannot reach, INFO refused by an ACL or by a
// managed service) adds its error, which does not match
// ErrEvictionPolicy: callers that only warn (leaderboard's Worker logs a
// warning at start) can tell the two apart with errors.Is. The errors are
// joined, sorted by server.
//
// A node the client no longer lists is not asked, and adds no error: a
// replica the cluster has marked failed (CLUSTER SLOTS leaves it out), or
// a Ring shard that go-redis's default heartbeat has marked down (a Ring
// built as the package documents, with a HeartbeatFn that reports every
// shard up, lists them all). Check again when such a node is back. A Ring
// that lists no shard at all, closed or with every shard down, asks no
// server and fails with the Ring's own error (redis.ErrClosed once
// closed).
func CheckEvictionPolicy(ctx context.Context, client redis.UniversalClient) error {
	if deps.Missing(client) {
		return &ConfigError{Field: "client", Reason: "is nil: pass the Redis client the projection writes with"}
	}
	type nodeError struct {
		addr string
		err  error
	}
	var (
		mu   sync.Mutex
		errs []nodeError
	)
	check := func(ctx context.Context, addr string, c redis.Cmdable) error {
		if err := checkEvictionPolicy(ctx, addr, c); err != nil {
			mu.Lock()
			errs = append(errs, nodeError{addr, err})
			mu.Unlock()
		}
		return nil
	}
	node := func(ctx context.Context, c *redis.Client) error { return check(ctx, c.Options().Addr, c) }
	switch c := client.(type) {
	case *redis.ClusterClient:
		if err := c.ForEachShard(ctx, node); err != nil {
			errs = append(errs, nodeError{err: fmt.Errorf("projection: checking the eviction policy: %w", err)})
		}
	case *redis.Ring:
		if err := forEachRingShard(ctx, c, node); err != nil {
			errs = append(errs, nodeError{err: fmt.Errorf("projection: checking the eviction policy: %w", err)})
		}
	case *redis.Client:
		_ = node(ctx, c)
	default:
		_ = check(ctx, "", client)
	}
	// By server, then by text: the order does not depend on which node
	// answered first.
	slices.SortFunc(errs, func(a, b nodeError) int {
		return cmp.Or(cmp.Compare(a.addr, b.addr), cmp.Compare(a.err.Error(), b.err.Error()))
	})
	joined := make([]error, len(errs))
	for i, e := range errs {
		joined[i] = e.err
	}
	return errors.Join(joined...)
}

// checkEvictionPolicy asks one server.
func checkEvictionPolicy(ctx context.Context, addr string, c redis.Cmdable) error {
	info, err := c.Info(ctx, "memory").Result()
	if err != nil {
		return fmt.Errorf("projection: checking the eviction policy of redis %s: %w", addr, err)
	}
	var (
		policy    string
		maxMemory int64 = -1
	)
	sc := bufio.NewScanner(strings.NewReader(info))
	for sc.Scan() {
		name, value, _ := strings.Cut(strings.TrimSpace(sc.Text()), ":")
		switch name {
		case "maxmemory_policy":
			policy = value
		case "maxmemory":
			if n, err := strconv.ParseInt(value, 10, 64); err == nil {
				maxMemory = n
			}
		}
	}
	if policy == "" || maxMemory < 0 {
		return fmt.Errorf("projection: checking the eviction policy of redis %s: %w: INFO memory lacks maxmemory or maxmemory_policy", addr, ErrUnexpectedReply)
	}
	if maxMemory > 0 && strings.HasPrefix(policy, "allkeys-") {
		return &EvictionPolicyError{Addr: addr, Policy: policy, MaxMemory: maxMemory}
	}
	return nil
}

// forEachRingShard is ring.ForEachShard, but for a Ring that lists no
// shard, closed or with every shard down: ForEachShard then calls fn on
// none and returns nil, as if every server had been asked, where
// forEachRingShard returns the Ring's own error. The Ring answers that
// PING without a round trip.
func forEachRingShard(ctx context.Context, ring *redis.Ring, fn func(context.Context, *redis.Client) error) error {
	var asked atomic.Bool
	err := ring.ForEachShard(ctx, func(ctx context.Context, shard *redis.Client) error {
		asked.Store(true)
		return fn(ctx, shard)
	})
	if err == nil && !asked.Load() {
		err = ring.Ping(ctx).Err()
	}
	return err
}
