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
