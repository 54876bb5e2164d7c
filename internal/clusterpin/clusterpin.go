// Package clusterpin sends reads to the master that serves a key's slot.
//
// A *redis.ClusterClient configured with ReadOnly, RouteByLatency or
// RouteRandomly sends read-only commands to replicas, whose replication lag
// nothing in verity measures. Reads that must see every acknowledged write
// (a cache hit after an Invalidate, a leaderboard read whose freshness is
// reported, a reconciler's comparison) go to the master through its own
// node client instead. Two things can still put such a read on a replica
// or fail it:
//
//   - Such a client opens every connection with READONLY, masters' included.
//     After a failover, a node the slot map still names as master may have
//     become a replica, and it would then serve the read itself, from a
//     dataset that may lag the new master. Pinned commands are therefore
//     sent after READWRITE, in the same pipeline: the node answers MOVED.
//   - The node client does not follow redirects, so a MOVED or ASK reply — a
//     failover or a resharding the slot map has not caught up with — would
//     fail every pinned read until go-redis reloads the map on its own
//     (ClusterStateReloadInterval, 60 s by default, or sooner if the cluster
//     client meets a redirect itself). OnMaster follows it, staying on a
//     master.
//   - go-redis reloads the map on redirects and every
//     ClusterStateReloadInterval, never on connection errors: once a
//     master dies and its replica is promoted, commands the map sends to
//     the dead node — pinned or not — fail until that interval is up. A
//     pinned command that fails with a connection-level error (refused or
//     reset connection, EOF, an i/o timeout, also one that came after the
//     caller's context ended, as a frozen node's does when go-redis bounds
//     its reads by its own ReadTimeout; and the caller's deadline itself,
//     all go-redis reports of a frozen or lost node to a caller whose
//     deadline is shorter than ReadTimeout; not the caller's cancellation)
//     therefore asks the cluster client to reload its map. The
//     command still fails, with that error (no retry here); the ones
//     after it reach the new master as soon as a node answers the reload
//     with the promotion, rather than up to a minute later. The reload
//     runs in go-redis's own goroutine, one at a time per client, with a
//     200 ms pause after each that succeeds, however many commands fail
//     (see Pipeline). Commands that are not pinned get no such help from
//     go-redis: they keep failing until its next periodic reload, unless
//     their caller passes their error to ReloadIfUnreachable, as every
//     verity package does.
//
// A client whose slot map comes from ClusterOptions.ClusterSlots rather than
// from the servers — the one redis.NewUniversalClient builds for Sentinel
// with RouteRandomly or RouteByLatency (NewFailoverClusterClient) — talks to
// servers that are not in cluster mode: they refuse READWRITE and READONLY
// and never answer MOVED. go-redis opens no READONLY connection for such a
// client, so pinned commands go to the master the map names as they are.
// Until Sentinel's next answer reaches that map, a master Sentinel has just
// demoted may still serve them, as a replica.
package clusterpin

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"strings"
	"sync"
	"time"
	"weak"

	"github.com/redis/go-redis/v9"
)

const (
	// AwaitTimeout bounds how long OnMaster and AwaitMaster wait, after a
	// MOVED reply, for a reloaded slot map to name the slot's new master.
	// The node that answers MOVED already knows the new owner; the wait
	// covers the reload's round trip, go-redis's 200 ms pause between
	// reloads, and nodes that learn of the change a little later.
	AwaitTimeout = 2 * time.Second

	// pollInterval is how often AwaitMaster looks at the slot map.
	pollInterval = 5 * time.Millisecond
)

// ErrMapBehind reports that the cluster client's slot map still named the
// node that answered MOVED (or no master that owns the slot) after
// AwaitTimeout.
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

// OnMaster sends the commands queue adds to p, in one pipeline after
// READWRITE, to the master that serves key's slot as the cluster client's
// slot map has it, and returns the error of the first command that failed
// (redis.Nil included), as Pipeliner.Exec does. The caller reads results
// from the commands it queued; queue may be called more than once, each
// time with a new pipeline, and must queue the same commands each time.
//
// When a command meets a MOVED reply, OnMaster reloads the map, waits until
// it names another master for key (AwaitMaster) and sends the commands
// again there, as long as replies are MOVED, for AwaitTimeout in all. When
// one meets an ASK reply (the slot is migrating, and the node lacks a key
// the command names: for a command or script naming several keys, any one
// of them, even one that exists nowhere), it sends them once to the
// importing master, ASKING first. That master answers a command naming
// several keys TRYAGAIN unless it holds every one of them, so a script
// whose keys do not all exist meets TRYAGAIN for the whole migration,
// whether or not its keys were split. OnMaster returns it as it is:
// callers that must get through retry it (versioncache's Invalidate and
// Peek do). ASKING covers only the next command: queue should hold one
// command on key (keyless ones, such as WAIT, may follow), because the
// importing master answers a later keyed command with MOVED back to the
// old owner, and that error is returned. An importing master that serves
// no slot yet is not in the slot map, nor is one go-redis names differently
// from the reply (it replaces loopback hosts, for one): its ASK reply is
// returned as it is. Any other error, and a second redirect, is returned
// as it is; a connection-level one also asks cc to reload its slot map
// (see Pipeline).
//
// A replica-reading client sends READONLY on every connection, and pinned
// commands add READWRITE (see Pipeline): its ACL user needs both. Granting
// @connection covers the two; a user whose commands are listed one by one
// must list each (+readonly +readwrite).
func OnMaster(ctx context.Context, cc *redis.ClusterClient, key string, queue func(p redis.Pipeliner)) error {
	node, err := cc.MasterForKey(ctx, key)
	if err != nil {
		return err
	}
	deadline := time.Now().Add(AwaitTimeout)
	for moves := 0; ; moves++ {
		err = send(ctx, cc, node, false, queue)
		addr, ok := redis.IsMovedError(err)
		if !ok {
			break
		}
		if !time.Now().Before(deadline) {
			return fmt.Errorf("%w (after %w)", ErrMapBehind, err)
		}
		// Until the deadline: a map reloaded mid-failover may name a node
		// that is not the owner either (go-redis picks a random node for
		// a slot its map lacks), which answers MOVED in turn. From the
		// second MOVED on, the reload gets a poll interval first, rather
		// than every node being asked in turn at full speed.
		if moves > 0 {
			if err := sleep(ctx, pollInterval); err != nil {
				return err
			}
		}
		next, awaitErr := awaitMaster(ctx, cc, key, addr, node.Options().Addr, deadline)
		if awaitErr != nil {
			return fmt.Errorf("%w (after %w)", awaitErr, err)
		}
		node = next
	}
	if addr, ok := redis.IsAskError(err); ok {
		addr = normalizeAddr(addr)
		target, kerr := knownMaster(ctx, cc, addr)
		if kerr != nil {
			return fmt.Errorf("%w (after %w)", kerr, err)
		}
		if target == nil {
			return err
		}
		err = send(ctx, cc, target, true, queue)
		if errors.Is(err, redis.ErrClosed) {
			forgetMaster(cc, addr)
		}
		return err
	}
	return err
}

// Eval runs script on keys (all in one slot) on the master of keys[0], as
// OnMaster sends commands: EVALSHA, and EVAL when the master does not have
// the script yet. The returned command holds the reply or the error.
func Eval(ctx context.Context, cc *redis.ClusterClient, script *redis.Script, keys []string, args ...any) *redis.Cmd {
	return eval(ctx, cc, script, false, keys, args)
}

// EvalRO is Eval for a script that never writes (in the mode args select):
// EVALSHA_RO, and EVAL_RO when the master does not have the script yet
// (Redis 7.0 or later). Redis checks the ACL key permissions of the
// read-only variants for reading only, where EVALSHA and EVAL need write
// permission on every key named, and refuses a write the script attempts.
// go-redis deems these commands read-only and would send them to a
// replica; OnMaster keeps them on the master, like any pinned command.
func EvalRO(ctx context.Context, cc *redis.ClusterClient, script *redis.Script, keys []string, args ...any) *redis.Cmd {
	return eval(ctx, cc, script, true, keys, args)
}

func eval(ctx context.Context, cc *redis.ClusterClient, script *redis.Script, ro bool, keys []string, args []any) *redis.Cmd {
	evalSha, evalSrc := script.EvalSha, script.Eval
	if ro {
		evalSha, evalSrc = script.EvalShaRO, script.EvalRO
	}
	var cmd *redis.Cmd
	err := OnMaster(ctx, cc, keys[0], func(p redis.Pipeliner) { cmd = evalSha(ctx, p, keys, args...) })
	if redis.HasErrorPrefix(err, "NOSCRIPT") {
		err = OnMaster(ctx, cc, keys[0], func(p redis.Pipeliner) { cmd = evalSrc(ctx, p, keys, args...) })
	}
	if cmd == nil { // OnMaster failed before queueing
		cmd = redis.NewCmd(ctx)
	}
	if err != nil { // the script's own error, or what kept it from running
		cmd.SetErr(err)
	}
	return cmd
}

// Pipeline returns a pipeline on node, a master's node client of cc, for
// reads that handle redirects themselves. Unless cc's slot map comes from
// ClusterSlots (see the package documentation), it starts with READWRITE
// and, when cc reads from replicas, ends with READONLY: the connection goes
// back to the node client's pool, which cc also uses to read from that node
// once a failover has made it a replica. Exec it once: READWRITE is queued
// only at the start.
//
// When Exec fails with a connection-level error (refused or reset
// connection, EOF, an i/o timeout while Exec's context is still live), it
// asks cc to reload its slot map (ReloadState) before returning that error:
// node may have died and a replica taken over its slots, which go-redis
// would otherwise learn only at its next periodic reload
// (ClusterStateReloadInterval). ReloadState only starts go-redis's reload,
// in go-redis's goroutine, or marks one pending when a reload or go-redis's
// 200 ms pause after one is under way, so a burst of failures costs at most
// one reload per pause; a reload that fails (no node answers) has no pause,
// but each of its attempts goes through the node clients' retries and
// backoff first.
func Pipeline(ctx context.Context, cc *redis.ClusterClient, node *redis.Client) redis.Pipeliner {
	pipe := pinnedPipeline{Pipeliner: node.Pipeline(), cc: cc}
	opts := cc.Options()
	if opts.ClusterSlots != nil { // not cluster-mode servers (package doc)
		return pipe
	}
	pipe.ReadWrite(ctx)
	pipe.restore = opts.ReadOnly
	return pipe
}

// pinnedPipeline sends READONLY after the queued commands when restore is
// set, and asks cc to reload its slot map when the node is unreachable.
type pinnedPipeline struct {
	redis.Pipeliner
	cc      *redis.ClusterClient
	restore bool
}

func (p pinnedPipeline) Exec(ctx context.Context) ([]redis.Cmder, error) {
	if p.restore {
		p.Pipeliner.ReadOnly(ctx)
	}
	cmds, err := p.Pipeliner.Exec(ctx)
	ReloadIfUnreachable(ctx, p.cc, err)
	return cmds, err
}

// ReloadIfUnreachable asks client, when it is a *redis.ClusterClient, to
// reload its slot map (ReloadState, rate-limited by go-redis as Pipeline
// describes) when err, from a command sent with ctx, is a connection-level
// error, and reports whether it asked. Commands sent through the cluster
// client itself need it as much as pinned ones: go-redis reloads on
// redirects and every ClusterStateReloadInterval only.
func ReloadIfUnreachable(ctx context.Context, client redis.UniversalClient, err error) bool {
	cc, ok := client.(*redis.ClusterClient)
	if !ok || !connectionLost(ctx, err) {
		return false
	}
	cc.ReloadState(ctx)
	return true
}

// connectionLost reports whether err says the node could not be reached or
// dropped the connection, rather than that ctx ended or the server replied
// with an error.
//
// Whether ctx has ended by now does not decide it: by default go-redis
// does not bound its socket reads by ctx (ContextTimeoutEnabled), so a
// frozen or partitioned node's read fails on go-redis's own ReadTimeout,
// seconds after a short per-call deadline ended, and only that error says
// the node is gone. A context error says nothing about the node, unless
// ctx is still live: then it is a deadline go-redis set itself.
func connectionLost(ctx context.Context, err error) bool {
	if err == nil {
		return false
	}
	// A caller's cancellation says nothing about the node. Its deadline
	// may: go-redis returns it, instead of a frozen or lost node's read
	// timeout, when the deadline ends before its retry (a deadline shorter
	// than ReadTimeout), so it costs a rate-limited reload.
	if ctx.Err() != nil && errors.Is(err, context.Canceled) {
		return false
	}
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return true
	}
	// Dial and socket errors (*net.OpError: refused, reset, i/o timeout,
	// including one at a socket deadline taken from ctx, which costs a
	// rate-limited reload at worst), and a deadline go-redis set itself
	// (DialTimeout, ReadTimeout). Server replies are never net.Errors.
	var netErr net.Error
	return errors.As(err, &netErr)
}

// send runs queue's commands on one connection of node, after READWRITE
// and, when asking, ASKING.
func send(ctx context.Context, cc *redis.ClusterClient, node *redis.Client, asking bool, queue func(redis.Pipeliner)) error {
	pipe := Pipeline(ctx, cc, node)
	if asking {
		pipe.Do(ctx, "ASKING")
	}
	queue(pipe)
	_, err := pipe.Exec(ctx)
	return err
}

// normalizeAddr writes a redirect's address as go-redis names nodes: an
// IPv6 host in brackets ("::1:7000" becomes "[::1]:7000").
func normalizeAddr(addr string) string {
	i := strings.LastIndexByte(addr, ':')
	if i < 0 || strings.HasPrefix(addr, "[") {
		return addr
	}
	return net.JoinHostPort(addr[:i], addr[i+1:])
}

// knownMaster returns the node client of the master at addr, or nil.
//
// ForEachMaster, the one way go-redis offers to reach a node by its
// address, reloads the slot map (CLUSTER SLOTS) before every call, without
// the pause ReloadState keeps; every pinned read that meets an ASK during
// a resharding would add one. So the masters it lists are kept per client,
// and listed again only for an address they lack, at most once per
// askRelistInterval.
func knownMaster(ctx context.Context, cc *redis.ClusterClient, addr string) (*redis.Client, error) {
	idx := mastersOf(cc)
	// Another caller may be listing the masters, bounded by its own ctx
	// only: wait for it no longer than ours.
	select {
	case idx.lock <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	defer func() { <-idx.lock }()
	if n := idx.byAddr[addr]; n != nil {
		return n, nil
	}
	if !idx.listed.IsZero() && time.Since(idx.listed) < askRelistInterval {
		return nil, nil
	}
	var mu sync.Mutex
	byAddr := map[string]*redis.Client{}
	// ForEachMaster calls fn concurrently.
	_ = cc.ForEachMaster(ctx, func(_ context.Context, n *redis.Client) error {
		mu.Lock()
		defer mu.Unlock()
		byAddr[n.Options().Addr] = n
		return nil
	})
	idx.byAddr, idx.listed = byAddr, time.Now()
	return byAddr[addr], nil
}

// forgetMaster drops addr's node client from cc's list, after go-redis
// closed it (a node gone from the map): the next ASK lists the masters
// again.
func forgetMaster(cc *redis.ClusterClient, addr string) {
	idx := mastersOf(cc)
	idx.lock <- struct{}{}
	defer func() { <-idx.lock }()
	delete(idx.byAddr, addr)
	idx.listed = time.Time{}
}

// askRelistInterval is the least time between two listings of a client's
// masters for ASK replies, as go-redis pauses between slot-map reloads.
const askRelistInterval = 200 * time.Millisecond

// masterList is a cluster client's masters by address, as last listed.
type masterList struct {
	lock   chan struct{} // held by one caller at a time; a channel so that a waiter's ctx ends its wait
	byAddr map[string]*redis.Client
	listed time.Time
}

// masterLists holds a *masterList per cluster client, keyed weakly: an
// entry goes when its client is garbage collected. (Package-wide because
// go-redis gives a client nowhere to keep it.)
var masterLists sync.Map // weak.Pointer[redis.ClusterClient] → *masterList

func mastersOf(cc *redis.ClusterClient) *masterList {
	key := weak.Make(cc)
	if v, ok := masterLists.Load(key); ok {
		return v.(*masterList)
	}
	v, loaded := masterLists.LoadOrStore(key, &masterList{lock: make(chan struct{}, 1)})
	if !loaded {
		runtime.AddCleanup(cc, func(k weak.Pointer[redis.ClusterClient]) { masterLists.Delete(k) }, key)
	}
	return v.(*masterList)
}

// AwaitMaster asks cc to reload its slot map and waits until the map names,
// as the master serving key, the one a MOVED reply named (moved) or, when
// stale is not empty, any master but stale (the node that answered MOVED:
// go-redis may name nodes differently from the reply, e.g. when it replaces
// a loopback host). It returns that master's node client, or ErrMapBehind
// after AwaitTimeout, or ctx's error when ctx ends first.
func AwaitMaster(ctx context.Context, cc *redis.ClusterClient, key, moved, stale string) (*redis.Client, error) {
	return awaitMaster(ctx, cc, key, moved, stale, time.Now().Add(AwaitTimeout))
}

func awaitMaster(ctx context.Context, cc *redis.ClusterClient, key, moved, stale string, deadline time.Time) (*redis.Client, error) {
	moved = normalizeAddr(moved)
	for {
		// A reload already running, or in go-redis's pause after one, is
		// only marked pending: asking on every poll reloads at most once
		// per pause.
		cc.ReloadState(ctx)
		if node, err := cc.MasterForKey(ctx, key); err == nil {
			if addr := node.Options().Addr; addr == moved || stale != "" && addr != stale {
				return node, nil
			}
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

// Guard queues on pipe, when client is a *redis.ClusterClient and the
// pipeline's commands touch more than one slot, one EXISTS of each key
// (one key of each slot), ahead of the commands queued after it. go-redis's
// cluster pipeline (v9 pipelineReadCmds) sends a node's whole batch again
// when its first command is answered with an error it retries (TRYAGAIN: a
// command of several keys in a slot being migrated; LOADING, CLUSTERDOWN,
// MASTERDOWN) or a connection error cuts it, the commands of that batch it
// is already following a MOVED or ASK of included: those then run on both
// masters at once (a data race on their replies, and a write run twice).
// The guards are NoRetry commands, and go-redis never sends again whole a
// batch that holds one: a command it follows a redirect of runs once, and
// the commands not answered fail with the batch's error, for the caller to
// retry. A pipeline of one slot's commands needs no guard: go-redis sends
// it to one node, and a redirect moves all of it. The guards' replies are
// of no interest.
func Guard(ctx context.Context, client redis.UniversalClient, pipe redis.Pipeliner, keys ...string) {
	if _, ok := client.(*redis.ClusterClient); !ok || len(keys) < 2 {
		return
	}
	for _, key := range keys {
		_ = pipe.Process(ctx, noRetry{redis.NewIntCmd(ctx, "exists", key)})
	}
}

// noRetry is a command go-redis must not send again: a node's batch that
// holds one is never sent again whole, whatever its first command was
// answered (TRYAGAIN, but also LOADING, CLUSTERDOWN, MASTERDOWN) or
// whichever connection error cut it, so that a command of the batch it is
// following a MOVED or ASK of never runs twice.
type noRetry struct{ *redis.IntCmd }

func (noRetry) NoRetry() bool { return true }
