package testenv

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// PassThroughHook is a go-redis hook that passes dials, commands and
// pipelines through unchanged. A test's hook embeds it and overrides only
// the part it watches.
type PassThroughHook struct{}

// DialHook returns next.
func (PassThroughHook) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessHook returns next.
func (PassThroughHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }

// ProcessPipelineHook returns next.
func (PassThroughHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// CommandHook is a go-redis hook that calls fn with the name of every
// command the client sends (pipelined ones included), for tests that check
// which node a command reached: add it to each node with
// ClusterClient.OnNewNode.
type CommandHook func(name string)

var _ redis.Hook = CommandHook(nil)

// DialHook implements redis.Hook.
func (h CommandHook) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessHook implements redis.Hook.
func (h CommandHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h(cmd.Name())
		return next(ctx, cmd)
	}
}

// ProcessPipelineHook implements redis.Hook.
func (h CommandHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, c := range cmds {
			h(c.Name())
		}
		return next(ctx, cmds)
	}
}

// WaitSlotReplicas waits until CLUSTER SLOTS lists a replica for every
// slot range of the cluster on every node, failing t after timeout.
// go-redis builds its slot map from CLUSTER SLOTS of a node it picks at
// random, so a client created afterwards can route reads to replicas
// whichever node it asks; right after start-up the replicas may not be
// listed yet, and a node may list them later than another (a client that
// asked it then keeps a map without them until its next reload, 60 s by
// default).
func (c *RedisCluster) WaitSlotReplicas(t testing.TB, timeout time.Duration) {
	t.Helper()
	ctx := context.Background()
	deadline := time.Now().Add(timeout)
	for _, addr := range c.Addrs() {
		node := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
		for {
			//lint:ignore SA1019 go-redis builds its slot map from CLUSTER SLOTS, so that is the view to wait for.
			slots, err := node.ClusterSlots(ctx).Result()
			if err == nil && len(slots) > 0 && allReplicated(slots) {
				break
			}
			if time.Now().After(deadline) {
				_ = node.Close()
				t.Fatalf("testenv: CLUSTER SLOTS of %s lists no replica for some slots after %s (err %v)", addr, timeout, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
		_ = node.Close()
	}
}

func allReplicated(slots []redis.ClusterSlot) bool {
	for _, s := range slots {
		if len(s.Nodes) < 2 {
			return false
		}
	}
	return true
}
