package versioncache

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// TestWaitForPeerNoticesMovedVersion: a process waiting for a
// peer's fill must notice that the id's version moved (an Invalidate) and
// start over (errVersionMoved), rather than take the new version's lease
// under the old version, whose fill is then skipped and whose new lease is
// never released by that fill.
func TestWaitForPeerNoticesMovedVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	caches, src := newProcesses(t, 2, Config{FillLeasePoll: 5 * time.Millisecond, FillLeaseWait: 2 * time.Second})
	src.write("p", 1)
	held, err := caches[0].read(ctx, "p", true, false)
	require.NoError(t, err)
	require.EqualValues(t, leaseHeldByUs, held.lease)
	waiting, err := caches[1].read(ctx, "p", true, false)
	require.NoError(t, err)
	require.EqualValues(t, leaseHeldByPeer, waiting.lease)

	src.write("p", 2)
	require.NoError(t, caches[0].Invalidate(ctx, "p"))
	start := time.Now()
	got, _, err := caches[1].waitForPeer(ctx, "p", &waiting)
	require.False(t, got)
	require.ErrorIs(t, err, errVersionMoved, "the version moved while waiting")
	require.Less(t, time.Since(start), time.Second)
	// The poll that saw the move took no lease under the new version: a
	// caller whose ctx ended before going round would leave it to lapse,
	// and other processes to wait for a fill that never comes.
	lease, err := caches[1].client.Get(ctx, caches[1].leaseKey("p")).Result()
	if err == nil {
		require.NotContains(t, lease, caches[1].leaseToken, "the new version's lease is not left held")
	} else {
		require.ErrorIs(t, err, redis.Nil)
	}
}

// beforeScript runs fn, once armed, before the next script its client
// sends.
type beforeScript struct {
	testenv.PassThroughHook
	armed *atomic.Bool
	fn    func()
}

func (h beforeScript) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if n := cmd.Name(); (n == "evalsha" || n == "eval") && h.armed.CompareAndSwap(true, false) {
			h.fn()
		}
		return next(ctx, cmd)
	}
}

// countScripts counts the scripts its client sends while on is set.
type countScripts struct {
	testenv.PassThroughHook
	on *atomic.Bool
	n  *atomic.Int32
}

func (h countScripts) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if n := cmd.Name(); (n == "evalsha" || n == "eval") && h.on.Load() {
			h.n.Add(1)
		}
		return next(ctx, cmd)
	}
}

// threeProcesses returns two Caches on one Redis, with long fill leases
// and waits and a short poll, and a client of its own for a third one, on
// which a test hooks the waiter's script calls.
func threeProcesses(t *testing.T) (holder, third *Cache[product], waiterClient *redis.Client) {
	t.Helper()
	rd := testenv.Redis(t)
	cfg := Config{Prefix: rd.Prefix, FillLeaseTTL: time.Minute, FillLeaseWait: time.Minute, FillLeasePoll: 5 * time.Millisecond}
	holder, err := New[product](rd.Client, &cfg)
	require.NoError(t, err)
	third, err = New[product](rd.Client, &cfg)
	require.NoError(t, err)
	waiterClient = redis.NewClient(rd.Client.(*redis.Client).Options())
	t.Cleanup(func() { _ = waiterClient.Close() })
	return holder, third, waiterClient
}

// TestLeaseWaitsCountsAMissOnce: a miss waits for a holder's fill, the
// version moves, and a third process takes the new version's lease before
// the waiter's next poll, so the waiter waits again within the same Get.
// LeaseWaits counts misses that waited: one. It used to count each wait.
func TestLeaseWaitsCountsAMissOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	holder, third, waiterClient := threeProcesses(t)
	var armed, moved atomic.Bool
	var scriptsSince atomic.Int32 // the waiter's scripts since the move
	src := newTruth()
	src.write("p", 1)
	waiterClient.AddHook(beforeScript{armed: &armed, fn: func() {
		src.write("p", 2)
		require.NoError(t, holder.Invalidate(ctx, "p"))
		r, err := third.read(ctx, "p", true, false)
		require.NoError(t, err)
		require.EqualValues(t, leaseHeldByUs, r.lease)
		moved.Store(true)
	}})
	waiterClient.AddHook(countScripts{on: &moved, n: &scriptsSince})
	waiter, err := New[product](waiterClient, holder.config)
	require.NoError(t, err)
	held, err := holder.read(ctx, "p", true, false)
	require.NoError(t, err)
	require.EqualValues(t, leaseHeldByUs, held.lease)

	done := make(chan error, 1)
	go func() {
		_, err := waiter.Get(ctx, "p", src.loader("p"))
		done <- err
	}()
	require.Eventually(t, func() bool { return waiter.Stats().LeaseWaits == 1 }, 10*time.Second, time.Millisecond)
	armed.Store(true)
	// The poll that saw the move, Get's read going round, then a poll of
	// the second wait, on the third's lease.
	require.Eventually(t, func() bool { return scriptsSince.Load() >= 3 }, 10*time.Second, time.Millisecond, "the waiter waits again")
	// The third process gives up its lease (as after a failed load): the
	// waiter's next poll takes it and loads.
	require.NoError(t, holder.client.Del(ctx, third.leaseKey("p")).Err())
	require.NoError(t, <-done)
	st := waiter.Stats()
	require.EqualValues(t, 1, st.Misses)
	require.EqualValues(t, 1, st.LeaseWaits, "one miss that waited, twice")
}

// TestLeaseWaitEndings ends a process's wait for a peer's fill in each way
// other than the two Stats name: it is a LeaseWait, and neither a
// LeaseWaitHit (it got no value from the holder) nor a LeaseFallback, which
// says the holder did not deliver within FillLeaseWait (the lease_timeout
// fallback an operator raises FillLeaseWait for). FillLeaseTTL and
// FillLeaseWait are long, so only the ending under test ends the wait.
func TestLeaseWaitEndings(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		// end ends waiter's wait for holder's lease on "p", taken under
		// version held; it returns the row the Get must answer, or nil
		// when the Get must fail with context.Canceled.
		end          func(t *testing.T, holder *Cache[product], src *truth, held readResult, cancel context.CancelFunc) *product
		decodeErrors uint64
	}{
		{name: "LeasePassedToWaiter", end: func(t *testing.T, holder *Cache[product], src *truth, _ readResult, _ context.CancelFunc) *product {
			// The holder's lease is gone (it lapsed): the waiter's next
			// poll takes it and loads.
			require.NoError(t, holder.client.Del(context.Background(), holder.leaseKey("p")).Err())
			want := src.read("p")
			return &want
		}},
		{name: "VersionMoved", end: func(t *testing.T, holder *Cache[product], src *truth, _ readResult, _ context.CancelFunc) *product {
			want := src.write("p", 2)
			require.NoError(t, holder.Invalidate(context.Background(), "p"))
			return &want
		}},
		{name: "FilledValueUndecodable", decodeErrors: 1, end: func(t *testing.T, holder *Cache[product], src *truth, held readResult, _ context.CancelFunc) *product {
			// Under the waited-for version, but not this Cache's shape.
			require.NoError(t, holder.client.Set(context.Background(), holder.currentKey("p"), held.version+":foreign", 0).Err())
			want := src.read("p")
			return &want
		}},
		{name: "CallerGaveUp", end: func(_ *testing.T, _ *Cache[product], _ *truth, _ readResult, cancel context.CancelFunc) *product {
			cancel()
			return nil
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			caches, src := newProcesses(t, 2, Config{FillLeaseTTL: time.Minute, FillLeaseWait: time.Minute})
			holder, waiter := caches[0], caches[1]
			src.write("p", 1)
			held, err := holder.read(context.Background(), "p", true, false)
			require.NoError(t, err)
			require.EqualValues(t, leaseHeldByUs, held.lease)

			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			type result struct {
				val product
				err error
			}
			done := make(chan result, 1)
			go func() {
				val, err := waiter.Get(ctx, "p", src.loader("p"))
				done <- result{val, err}
			}()
			require.Eventually(t, func() bool { return waiter.Stats().LeaseWaits == 1 },
				10*time.Second, time.Millisecond, "the waiter waits for the holder's fill")
			want := tc.end(t, holder, src, held, cancel)
			res := <-done
			if want == nil {
				require.ErrorIs(t, res.err, context.Canceled)
			} else {
				require.NoError(t, res.err)
				require.Equal(t, *want, res.val)
			}
			st := waiter.Stats()
			require.EqualValues(t, 1, st.LeaseWaits)
			require.Zero(t, st.LeaseWaitHits, "no value came from the holder")
			require.Zero(t, st.LeaseFallbacks, "the wait did not run out")
			require.Equal(t, tc.decodeErrors, st.DecodeErrors)
		})
	}
}

// afterReadScript runs fn, once armed, after the next miss script (read.lua)
// its client sends has answered, and whose reply reply accepts (any reply
// when reply is nil).
type afterReadScript struct {
	testenv.PassThroughHook
	armed *atomic.Bool
	sha   string
	reply func([]any) bool
	fn    func()
}

func (h afterReadScript) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if args := cmd.Args(); cmd.Name() == "evalsha" && len(args) > 1 && args[1] == h.sha {
			res, _ := cmd.(*redis.Cmd).Slice()
			if (h.reply == nil || h.reply(res)) && h.armed.CompareAndSwap(true, false) {
				h.fn()
			}
		}
		return err
	}
}

// TestWaiterTakesNoLeaseUnderAMovedVersion: the version moves while a
// goroutine of process A waits; right after its poll sees the new version,
// another goroutine of A misses, takes the new version's lease and loads,
// and the waiter's caller gives up. A third process waits for A's load. A
// waiter whose poll took the new lease, and gave it up as it started over,
// used to release the lease the other goroutine was loading under.
func TestWaiterTakesNoLeaseUnderAMovedVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	peer, third, aClient := threeProcesses(t)
	a, err := New[product](aClient, peer.config)
	require.NoError(t, err)
	src := newTruth()
	src.write("p", 1)
	held, err := peer.read(ctx, "p", true, false)
	require.NoError(t, err)
	require.EqualValues(t, leaseHeldByUs, held.lease)

	waiterCtx, giveUp := context.WithCancel(ctx)
	defer giveUp()
	started, unblock := make(chan struct{}), make(chan struct{})
	loaderDone := make(chan error, 1)
	var armed atomic.Bool
	aClient.AddHook(afterReadScript{armed: &armed, sha: a.lua.read.Hash(),
		reply: func(res []any) bool { return len(res) == 3 && res[0] != held.version },
		fn: func() {
			giveUp()
			go func() {
				_, err := a.Get(ctx, "p", func(context.Context) (product, error) {
					close(started)
					<-unblock
					return src.read("p"), nil
				})
				loaderDone <- err
			}()
			<-started
		}})
	waiterDone := make(chan error, 1)
	go func() {
		_, err := a.Get(waiterCtx, "p", src.loader("p"))
		waiterDone <- err
	}()
	require.Eventually(t, func() bool { return a.Stats().LeaseWaits == 1 }, 10*time.Second, time.Millisecond)
	armed.Store(true)
	src.write("p", 2)
	require.NoError(t, peer.Invalidate(ctx, "p"))
	require.ErrorIs(t, <-waiterDone, context.Canceled)
	r, err := third.read(ctx, "p", true, false)
	require.NoError(t, err)
	close(unblock)
	require.NoError(t, <-loaderDone)
	require.EqualValues(t, leaseHeldByPeer, r.lease, "a third process waits for A's load, not load the version again")
}

// TestWaiterTakesTheLeaseAFailedLoadGaveUp: the lease holder's load fails
// and it gives the lease up, so that other processes need not wait for it
// to lapse: a waiting process takes it at its next poll and loads. During
// a rollout (the value cached is the other release's, which neither
// process decodes) the poll found that value and looked no further, and the
// waiter sat out FillLeaseWait before loading without a lease.
func TestWaiterTakesTheLeaseAFailedLoadGaveUp(t *testing.T) {
	t.Parallel()
	for _, rollout := range []bool{false, true} {
		t.Run(map[bool]string{false: "NoRollout", true: "DuringRollout"}[rollout], func(t *testing.T) {
			t.Parallel()
			rd := testenv.Redis(t)
			src := newTruth()
			ctx := context.Background()
			want := src.write("hot", 7)
			if rollout {
				old, err := New[product](rd.Client, &Config{Prefix: rd.Prefix})
				require.NoError(t, err)
				_, err = old.Get(ctx, "hot", src.loader("hot"))
				require.NoError(t, err)
			}
			cfg := Config{Prefix: rd.Prefix, FillLeaseTTL: 20 * time.Second, FillLeaseWait: 4 * time.Second, FillLeasePoll: 10 * time.Millisecond}
			a, err := New[productV2](rd.Client, &cfg)
			require.NoError(t, err)
			b, err := New[productV2](rd.Client, &cfg)
			require.NoError(t, err)

			started, fail := make(chan struct{}), make(chan struct{})
			aDone := make(chan error, 1)
			go func() {
				_, err := a.Get(ctx, "hot", func(ctx context.Context) (productV2, error) {
					close(started)
					<-fail
					return productV2{}, errors.New("the database hiccupped")
				})
				aDone <- err
			}()
			<-started // a holds the lease
			type answer struct {
				p   productV2
				err error
			}
			bDone := make(chan answer, 1)
			go func() {
				p, err := b.Get(ctx, "hot", func(ctx context.Context) (productV2, error) {
					q := src.read("hot")
					return productV2{ID: q.ID, Price: q.Price, Version: q.Version}, nil
				})
				bDone <- answer{p, err}
			}()
			require.Eventually(t, func() bool { return b.Stats().LeaseWaits == 1 }, 2*time.Second, time.Millisecond, "b waits for a's fill")
			close(fail)
			require.Error(t, <-aDone)
			got := <-bDone
			require.NoError(t, got.err)
			require.Equal(t, want.Version, got.p.Version)
			require.Zero(t, b.Stats().LeaseFallbacks, "b sat out FillLeaseWait instead of taking the lease a gave up")
			require.EqualValues(t, 1, b.Stats().Loads)
		})
	}
}

// missedKey marks the ctx of the Get whose miss scriptEnded times.
type missedKey struct{}

// scriptEnded records when the first script sent under a ctx marked with
// missedKey returned: the miss that found another process's lease.
type scriptEnded struct {
	testenv.PassThroughHook
	at *atomic.Int64 // unix nanoseconds
}

func (h scriptEnded) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if n := cmd.Name(); ctx.Value(missedKey{}) != nil && (n == "evalsha" || n == "eval") {
			h.at.CompareAndSwap(0, time.Now().UnixNano())
		}
		return err
	}
}

// TestLeaseWaitBoundsASlowPoll: a process that lost the fill lease loads
// itself FillLeaseWait after its miss even when its polls wait for a pool
// connection or for a slow Redis's answer (a client with
// ContextTimeoutEnabled). Before, each poll ran under the caller's ctx: a
// Redis answering a second late, with the client's two connections busy,
// held the waiter for seconds against a 300 ms FillLeaseWait.
func TestLeaseWaitBoundsASlowPoll(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rd := testenv.Redis(t)
	cfg := Config{Prefix: rd.Prefix, FillLeaseTTL: time.Minute, FillLeaseWait: 300 * time.Millisecond, FillLeasePoll: 5 * time.Millisecond}
	filler, err := New[product](rd.Client, &cfg)
	require.NoError(t, err)
	slow, proxy := testenv.RedisBehindDelayProxy(t, rd.Client, func(opts *redis.Options) {
		opts.PoolSize = 2
		opts.ContextTimeoutEnabled = true
		opts.ReadTimeout, opts.PoolTimeout = 30*time.Second, 30*time.Second // only the wait may cut a poll
	})
	var missed atomic.Int64
	slow.AddHook(scriptEnded{at: &missed})
	waiter, err := New[product](slow, &cfg)
	require.NoError(t, err)
	src := newTruth()
	src.write("p", 1)

	var wg sync.WaitGroup
	defer wg.Wait()
	loading, finish := make(chan struct{}), make(chan struct{})
	defer close(finish)
	wg.Go(func() { // holds the lease until the test ends
		_, err := filler.Get(ctx, "p", func(context.Context) (product, error) {
			close(loading)
			<-finish
			return src.read("p"), nil
		})
		require.NoError(t, err)
	})
	<-loading
	const delay = time.Second
	proxy.SetDelay(delay)
	defer proxy.SetDelay(0)
	stop := make(chan struct{})
	for i := range 2 { // other reads keep the client's two connections busy
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				_, _, _, _ = waiter.Peek(ctx, fmt.Sprintf("other-%d", i))
			}
		})
	}
	time.Sleep(100 * time.Millisecond)
	var loadedAt atomic.Int64
	got, err := waiter.Get(context.WithValue(ctx, missedKey{}, true), "p", func(context.Context) (product, error) {
		loadedAt.Store(time.Now().UnixNano())
		return src.read("p"), nil
	})
	close(stop)
	require.NoError(t, err)
	require.Equal(t, src.read("p"), got)
	require.NotZero(t, missed.Load(), "the miss script never returned")
	require.NotZero(t, loadedAt.Load(), "the waiter never loaded itself")
	waited := time.Duration(loadedAt.Load() - missed.Load())
	require.Less(t, waited, cfg.FillLeaseWait+delay/2, "the wait outlived FillLeaseWait by a slow poll")
	require.Equal(t, uint64(1), waiter.Stats().LeaseFallbacks, "%+v waited %v", waiter.Stats(), waited)
}
