package versioncache

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
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
