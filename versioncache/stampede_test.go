package versioncache

import (
	"context"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// stormHold bounds how long a storm's load waits for the storm's other Gets
// to miss; stormConfig's lease outlasts it, so that a process waiting for
// the winner's fill never gives up and loads on its own while the winner is
// held.
const stormHold = 5 * time.Second

// stormConfig is cfg with a fill lease that outlasts a held load (see
// stormHold), for caches that missStorm runs on.
func stormConfig(cfg Config) Config {
	cfg.FillLeaseTTL = 3 * stormHold
	cfg.FillLeaseWait = 2 * stormHold
	return cfg
}

// missStorm invalidates id, then lets processes×goroutines Gets of it start
// at once, each process being its own Cache (own single flight, own lease
// token). It returns how many loads the storm caused and checks every Get
// returned the current row.
//
// A load does not return before every Get of the storm has missed (up to
// stormHold): Get counts a miss just before it joins or starts its process's
// load, so every Get of the storm really overlaps the load it should share,
// however the goroutines are scheduled. (A load of a fixed duration let a
// goroutine that was not scheduled until it had finished start a fresh one.)
// What remains is a Get descheduled in the few instructions between counting
// its miss and joining the flight, which then correctly loads again: rare,
// and what the callers' bounds allow for.
func missStorm(tb testing.TB, caches []*Cache[product], src *truth, id string, goroutines int) int64 {
	tb.Helper()
	ctx := context.Background()
	want := src.write(id, int(time.Now().UnixNano()%10000))
	require.NoError(tb, caches[0].Invalidate(ctx, id))
	misses := func() uint64 {
		var n uint64
		for _, c := range caches {
			n += c.Stats().Misses
		}
		return n
	}
	before, gets := misses(), uint64(len(caches)*goroutines)
	var loads atomic.Int64
	loader := func(ctx context.Context) (product, error) {
		loads.Add(1)
		p := src.read(id)
		deadline := time.Now().Add(stormHold)
		for misses()-before < gets {
			if time.Now().After(deadline) {
				tb.Errorf("load held %v: only %d of the storm's %d Gets missed",
					stormHold, misses()-before, gets)
				break
			}
			time.Sleep(time.Millisecond)
		}
		return p, nil
	}
	start := make(chan struct{})
	var wg sync.WaitGroup
	results := make(chan product, len(caches)*goroutines)
	for _, c := range caches {
		for range goroutines {
			wg.Go(func() {
				<-start
				p, err := c.Get(ctx, id, loader)
				if err != nil {
					tb.Errorf("Get: %v", err)
				}
				results <- p
			})
		}
	}
	close(start)
	wg.Wait()
	close(results)
	for p := range results {
		require.Equal(tb, want, p)
	}
	return loads.Load()
}

func newProcesses(tb testing.TB, n int, cfg Config) ([]*Cache[product], *truth) {
	tb.Helper()
	rd := testenv.Redis(tb)
	cfg.Prefix = rd.Prefix
	caches := make([]*Cache[product], n)
	for i := range caches {
		c, err := New[product](rd.Client, &cfg)
		require.NoError(tb, err)
		caches[i] = c
	}
	return caches, newTruth()
}

func TestStampede(t *testing.T) {
	t.Parallel()
	const processes, goroutines, storms = 4, 16, 5

	t.Run("FillLease", func(t *testing.T) {
		t.Parallel()
		caches, src := newProcesses(t, processes, stormConfig(Config{}))
		var total int64
		for range storms {
			loads := missStorm(t, caches, src, "hot", goroutines)
			require.GreaterOrEqual(t, loads, int64(1))
			total += loads
		}
		// About one load per storm. Not exactly: see missStorm for the
		// goroutine that correctly loads again.
		require.LessOrEqual(t, total, int64(2*storms))
		var waits, waitHits uint64
		for _, c := range caches {
			waits += c.Stats().LeaseWaits
			waitHits += c.Stats().LeaseWaitHits
		}
		t.Logf("%d processes x %d goroutines: %.2f loads per miss storm (lease waits %d, served by the winner %d)",
			processes, goroutines, float64(total)/storms, waits, waitHits)
	})

	t.Run("SingleFlightOnly", func(t *testing.T) {
		t.Parallel()
		caches, src := newProcesses(t, processes, stormConfig(Config{DisableFillLease: true}))
		var total int64
		for range storms {
			loads := missStorm(t, caches, src, "hot", goroutines)
			require.GreaterOrEqual(t, loads, int64(1))
			total += loads
		}
		// About one load per process (see FillLease for why not exactly),
		// far below one per goroutine.
		require.LessOrEqual(t, total, int64((processes+1)*storms))
		t.Logf("%d processes x %d goroutines, no lease: %.2f loads per miss storm",
			processes, goroutines, float64(total)/storms)
	})

	t.Run("DuringRollout", func(t *testing.T) {
		t.Parallel()
		// The value cached is the old release's, which no new process
		// decodes: each misses, one takes the lease, and the others must
		// wait for its fill, not take the old value they are polling past
		// for it. They loaded at once, one load per process.
		rd := testenv.Redis(t)
		src := newTruth()
		ctx := context.Background()
		want := src.write("hot", 7)
		old, err := New[product](rd.Client, &Config{Prefix: rd.Prefix})
		require.NoError(t, err)
		_, err = old.Get(ctx, "hot", src.loader("hot"))
		require.NoError(t, err)

		const goroutines = 4
		cfg := stormConfig(Config{Prefix: rd.Prefix})
		caches := make([]*Cache[productV2], processes)
		for i := range caches {
			caches[i], err = New[productV2](rd.Client, &cfg)
			require.NoError(t, err)
		}
		stats := func() (s Stats) {
			for _, c := range caches {
				cs := c.Stats()
				s.Misses += cs.Misses
				s.LeaseWaits += cs.LeaseWaits
				s.LeaseWaitHits += cs.LeaseWaitHits
			}
			return s
		}
		var loads atomic.Int64
		loader := func(ctx context.Context) (productV2, error) {
			loads.Add(1)
			p := src.read("hot")
			for deadline := time.Now().Add(stormHold); stats().Misses < processes*goroutines && time.Now().Before(deadline); {
				time.Sleep(time.Millisecond)
			}
			// A query that outlasts a poll: the waiters poll the old
			// value before the fill replaces it.
			time.Sleep(50 * time.Millisecond)
			return productV2{ID: p.ID, Price: p.Price, Version: p.Version}, nil
		}
		start := make(chan struct{})
		var wg sync.WaitGroup
		for _, c := range caches {
			for range goroutines {
				wg.Go(func() {
					<-start
					p, err := c.Get(ctx, "hot", loader)
					if err != nil || p.Version != want.Version {
						t.Errorf("Get: %+v, %v", p, err)
					}
				})
			}
		}
		close(start)
		wg.Wait()
		s := stats()
		t.Logf("%d processes x %d goroutines after a rollout: %d loads (lease waits %d, served by the winner %d)",
			processes, goroutines, loads.Load(), s.LeaseWaits, s.LeaseWaitHits)
		require.LessOrEqual(t, loads.Load(), int64(2), "about one load, as without a rollout")
		require.GreaterOrEqual(t, s.LeaseWaitHits, uint64(processes-2), "the other processes served by the winner's fill")
	})

	t.Run("LeaseHolderVanishes", func(t *testing.T) {
		t.Parallel()
		// A process takes the lease and never fills (it crashed). Others
		// wait at most FillLeaseWait, then load themselves.
		caches, src := newProcesses(t, 2, Config{FillLeaseWait: 50 * time.Millisecond})
		want := src.write("p", 1)
		ctx := context.Background()
		r, err := caches[0].read(ctx, "p", true, false)
		require.NoError(t, err)
		require.EqualValues(t, leaseHeldByUs, r.lease)

		got, err := caches[1].Get(ctx, "p", src.loader("p"))
		require.NoError(t, err)
		require.Equal(t, want, got)
		require.EqualValues(t, 1, caches[1].Stats().LeaseFallbacks)
	})
}

// BenchmarkMissStorm reports loads per miss storm: 4 processes × 16
// goroutines missing the same key at once, each load held until all of them
// have missed (see missStorm).
//
//	go test -run XXX -bench MissStorm -benchtime 20x ./versioncache
func BenchmarkMissStorm(b *testing.B) {
	for _, tc := range []struct {
		name string
		cfg  Config
	}{{"FillLease", Config{}}, {"SingleFlightOnly", Config{DisableFillLease: true}}} {
		b.Run(tc.name, func(b *testing.B) {
			caches, src := newProcesses(b, 4, stormConfig(tc.cfg))
			var loads int64
			for b.Loop() {
				loads += missStorm(b, caches, src, "hot", 16)
			}
			b.ReportMetric(float64(loads)/float64(b.N), "loads/storm")
		})
	}
}

// A lease only guards a load under the version it was taken for. Once the
// version moves, the holder's fill will be refused, so a miss under the new
// version takes the lease at once, and the old holder's refused fill or
// release must not drop the new holder's lease.
func TestLeaseFollowsVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	caches, src := newProcesses(t, 2, Config{})
	src.write("p", 1)
	old, err := caches[0].read(ctx, "p", true, false)
	require.NoError(t, err)
	require.EqualValues(t, leaseHeldByUs, old.lease)

	want := src.write("p", 2)
	require.NoError(t, caches[0].Invalidate(ctx, "p"))
	r, err := caches[1].read(ctx, "p", true, false)
	require.NoError(t, err)
	require.NotEqual(t, old.version, r.version)
	require.EqualValues(t, leaseHeldByUs, r.lease, "a lease of a moved version does not block")

	_, err = caches[0].loadAndFill(ctx, "p", old, src.loader("p"), new(bool))
	require.NoError(t, err)
	require.EqualValues(t, 1, caches[0].Stats().StaleFillsSkipped)
	caches[0].releaseLease(ctx, "p", old)
	again, err := caches[0].read(ctx, "p", true, false)
	require.NoError(t, err)
	require.Equal(t, r.version, again.version)
	require.EqualValues(t, leaseHeldByPeer, again.lease, "the new lease survived")

	res, err := caches[1].loadAndFill(ctx, "p", r, src.loader("p"), new(bool))
	require.NoError(t, err)
	require.Equal(t, want, res.val)
	got, err := caches[0].Get(ctx, "p", src.loader("p"))
	require.NoError(t, err)
	require.Equal(t, want, got)
	require.EqualValues(t, 1, caches[0].Stats().Hits)
}

// TestFlightLoadExits has the load a caller runs exit its goroutine
// (runtime.Goexit, as t.FailNow does in a test's loader): the goroutine
// ends as Go ends it, without a panic that would stop the program, and the
// flight is over, so the next call for the key runs its own load.
func TestFlightLoadExits(t *testing.T) {
	t.Parallel()
	var g flightGroup[int]
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		_, _, _, _ = g.do(context.Background(), "k", "id", func() (int, error) {
			runtime.Goexit()
			return 0, nil
		})
		t.Error("do returned although the load's goroutine exited")
	}()
	<-exited
	v, shared, _, err := g.do(context.Background(), "k", "id", func() (int, error) { return 7, nil })
	require.NoError(t, err)
	require.False(t, shared)
	require.Equal(t, 7, v)
}

// TestSharedLoadGivesEachCallerItsOwnValue: concurrent misses that share
// one load each get their own copy (decoded from the same bytes, as a hit
// would give it), so that one caller changing its map does not change
// another's.
func TestSharedLoadGivesEachCallerItsOwnValue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rd := testenv.Redis(t)
	cache, err := New[map[string]int](rd.Client, &Config{Prefix: rd.Prefix, DisableFillLease: true})
	require.NoError(t, err)
	release := make(chan struct{})
	started := make(chan struct{})
	var once sync.Once
	load := func(context.Context) (map[string]int, error) {
		once.Do(func() { close(started) })
		<-release
		return map[string]int{"qty": 1}, nil
	}
	results := make(chan map[string]int, 2)
	go func() {
		v, err := cache.Get(ctx, "cart", load)
		if err != nil {
			t.Errorf("leader: %v", err)
		}
		results <- v
	}()
	<-started
	go func() {
		v, err := cache.Get(ctx, "cart", load)
		if err != nil {
			t.Errorf("joiner: %v", err)
		}
		results <- v
	}()
	require.Eventually(t, func() bool { return cache.Stats().Misses == 2 }, 5*time.Second, time.Millisecond)
	require.Eventually(t, func() bool { return cache.flights.joiners() == 1 }, 5*time.Second, time.Millisecond, "the others joined the load in flight")
	close(release)
	a, b := <-results, <-results
	require.EqualValues(t, 1, cache.Stats().SharedLoads)
	a["qty"] = 99 // the caller's own copy, it thinks
	require.Equal(t, 1, b["qty"], "another caller's value changed under it")
}

// productV2 is product in a later release that added a field: the same
// prefix, another shape.
type productV2 struct {
	ID      string `json:"id"`
	Price   int    `json:"price"`
	Version int64  `json:"version"`
	Extra   string `json:"extra"`
}

// TestLeaseLapses: Config.FillLeaseTTL is "how long the process that won a
// miss may take to load and fill before the lease lapses and another process
// may load". A lease whose holder vanished must lapse after FillLeaseTTL: a
// miss after that takes it at once instead of waiting FillLeaseWait for a
// fill that never comes.
func TestLeaseLapses(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	caches, src := newProcesses(t, 2, Config{FillLeaseTTL: 100 * time.Millisecond, FillLeaseWait: 3 * time.Second})
	want := src.write("p", 1)
	r, err := caches[0].read(ctx, "p", true, false)
	require.NoError(t, err)
	require.EqualValues(t, leaseHeldByUs, r.lease) // and caches[0] vanishes
	time.Sleep(200 * time.Millisecond)

	start := time.Now()
	got, err := caches[1].Get(ctx, "p", src.loader("p"))
	require.NoError(t, err)
	require.Equal(t, want, got)
	st := caches[1].Stats()
	require.Zero(t, st.LeaseWaits, "waited %v for a lease that should have lapsed", time.Since(start))
	require.EqualValues(t, 1, st.Fills)
}

// TestFillReleasesLease: a fill releases the lease it was taken with
// (fill.lua, ARGV[4]): once the value is cached, nothing is being loaded, so
// a miss under the same version after the value expired (TTL below
// FillLeaseTTL) must not wait for a lease nobody holds.
func TestFillReleasesLease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	caches, src := newProcesses(t, 2, Config{TTL: 100 * time.Millisecond, FillLeaseTTL: 5 * time.Second, FillLeaseWait: 3 * time.Second})
	want := src.write("p", 1)
	got, err := caches[0].Get(ctx, "p", src.loader("p"))
	require.NoError(t, err)
	require.Equal(t, want, got)
	require.EqualValues(t, 1, caches[0].Stats().Fills)
	time.Sleep(200 * time.Millisecond) // the value expires; its version does not

	start := time.Now()
	got, err = caches[1].Get(ctx, "p", src.loader("p"))
	require.NoError(t, err)
	require.Equal(t, want, got)
	require.Zero(t, caches[1].Stats().LeaseWaits, "waited %v for the lease of a load that had filled", time.Since(start))
}
