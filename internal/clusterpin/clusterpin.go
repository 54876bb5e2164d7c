// Package clusterpin sends reads to the master that serves a key's slot.
//
// A *redis.ClusterClient configured with ReadOnly, RouteByLatency or
// RouteRandomly sends read-only commands to replicas, whose replication lag
// nothing in verity measures. Reads that must see every acknowledged write
// (a cache hit after an Invalidate, a leaderboard read whose freshness is
// reported, a reconciler's comparison) go to the master through its own
// node client instead. That client does not follow redirects, so a MOVED
// or ASK reply — a failover or a resharding the cluster client's slot map
// has not caught up with — would fail every pinned read until go-redis
// reloads the map on its own, up to ten seconds later. OnMaster follows
// the redirect and stays on a master.
package clusterpin

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

const (
	// AwaitTimeout bounds how long OnMaster and AwaitMaster wait for a
	// reloaded slot map to name the master a MOVED reply named. A cluster
	// that answers MOVED already agrees on the new owner; the wait covers
	// the reload's round trip and go-redis's 200 ms pause between reloads.
	AwaitTimeout = 2 * time.Second

	// pollInterval is how often AwaitMaster looks at the slot map.
	pollInterval = 5 * time.Millisecond
)

// ErrMapBehind reports that the cluster client's slot map still did not
// name the master a MOVED reply named after AwaitTimeout.
var ErrMapBehind = errors.New("clusterpin: the cluster client's slot map did not catch up with a MOVED reply")

// Client returns client as a *redis.ClusterClient when it may send
// read-only commands to replicas (ReadOnly, RouteByLatency or
// RouteRandomly), and nil otherwise, when every command already goes to the
// master and follows redirects.
func Client(client redis.UniversalClient) *redis.ClusterClient {
	cc, ok := client.(*redis.ClusterClient)
	if !ok {
		return nil
	}
	if o := cc.Options(); o.ReadOnly || o.RouteByLatency || o.RouteRandomly {
		return cc
	}
	return nil
}

// IsRedirect reports whether err is a MOVED or ASK reply, wrapped or not.
func IsRedirect(err error) bool {
	if err == nil {
		return false
	}
	if _, ok := redis.IsMovedError(err); ok {
		return true
	}
	_, ok := redis.IsAskError(err)
	return ok
}

// OnMaster runs read with the node client of the master that serves key's
// slot, as the cluster client's slot map has it.
//
// When read meets a MOVED reply, OnMaster reloads the map, waits until it
// names the master the reply named (AwaitMaster) and runs read once more
// there. When read meets an ASK reply (the slot is migrating and key has
// already left), it runs read once on the importing master, on one
// connection, right after ASKING. ASKING covers only the next command, so
// read should send one command on key (a pipeline may follow it with keyless
// ones, such as WAIT); a later keyed command meets the ASK reply again, and
// its error is returned. Any other error, and a second redirect, is
// returned as it is.
func OnMaster(ctx context.Context, cc *redis.ClusterClient, key string, read func(redis.Cmdable) error) error {
	node, err := cc.MasterForKey(ctx, key)
	if err != nil {
		return err
	}
	err = read(node)
	if addr, ok := redis.IsMovedError(err); ok {
		node, awaitErr := AwaitMaster(ctx, cc, key, addr)
		if awaitErr != nil {
			return fmt.Errorf("%w (after %w)", awaitErr, err)
		}
		return read(node)
	}
	if addr, ok := redis.IsAskError(err); ok {
		return readAsking(ctx, cc, addr, err, read)
	}
	return err
}

// readAsking runs read on one connection to the master at addr after
// ASKING. ask is the ASK reply, returned when no known master has addr.
func readAsking(ctx context.Context, cc *redis.ClusterClient, addr string, ask error, read func(redis.Cmdable) error) error {
	node := knownMaster(ctx, cc, addr)
	if node == nil {
		return ask
	}
	conn := node.Conn()
	defer conn.Close()
	if err := conn.Do(ctx, "ASKING").Err(); err != nil {
		return err
	}
	return read(conn)
}

// knownMaster returns the node client of the master at addr, or nil.
func knownMaster(ctx context.Context, cc *redis.ClusterClient, addr string) *redis.Client {
	found := make(chan *redis.Client, 1)
	// ForEachMaster calls fn concurrently; at most one master has addr.
	_ = cc.ForEachMaster(ctx, func(_ context.Context, n *redis.Client) error {
		if n.Options().Addr == addr {
			select {
			case found <- n:
			default: // never blocks, however the map lists its masters
			}
		}
		return nil
	})
	select {
	case n := <-found:
		return n
	default:
		return nil
	}
}

// AwaitMaster asks cc to reload its slot map and waits until the map names
// the master at addr (from a MOVED reply) as the one serving key, then
// returns that master's node client. It gives up with ErrMapBehind after
// AwaitTimeout, and with ctx's error when ctx ends first.
func AwaitMaster(ctx context.Context, cc *redis.ClusterClient, key, addr string) (*redis.Client, error) {
	deadline := time.Now().Add(AwaitTimeout)
	for {
		// A reload already running, or in go-redis's pause after one, is
		// only marked pending: asking on every poll reloads at most once
		// per pause.
		cc.ReloadState(ctx)
		if node, err := cc.MasterForKey(ctx, key); err == nil && node.Options().Addr == addr {
			return node, nil
		}
		if !time.Now().Before(deadline) {
			return nil, ErrMapBehind
		}
		if err := sleep(ctx, pollInterval); err != nil {
			return nil, err
		}
	}
}

// sleep waits for d or until ctx ends, whichever comes first.
func sleep(ctx context.Context, d time.Duration) error {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-timer.C:
		return nil
	}
}
