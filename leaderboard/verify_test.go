package leaderboard

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/reconcile"
)

// TestVerify checks RequireVerifiedProjection: reads see a Redis that lost
// the board's keys, which the outbox lag cannot show, until Verify has
// found the projection complete again.
func TestVerify(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	verifying := func(t *testing.T) *testBundle {
		return setup(t, func(c *Config) {
			c.RequireVerifiedProjection = true
			c.ReadPolicy = FailClosed
			c.LagProbeInterval = time.Nanosecond
		})
	}
	requireUnverified := func(t *testing.T, tb *testBundle) {
		t.Helper()
		_, err := tb.board.Top(ctx, 10)
		var stale *StaleError
		require.ErrorAs(t, err, &stale)
		require.Equal(t, time.Duration(-1), stale.Lag)
		require.True(t, stale.Unverified)
		require.ErrorContains(t, err, "Board.Verify")
		fr := tb.board.Freshness(ctx)
		require.True(t, fr.Unverified)
		require.Equal(t, time.Duration(-1), fr.Lag)
	}

	t.Run("UnverifiedUntilVerify", func(t *testing.T) {
		t.Parallel()
		tb := verifying(t)
		tb.submit(t, "ada", 10)
		tb.drain(t)
		requireUnverified(t, tb)

		rep, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified)
		require.Equal(t, int64(1), rep.Counts[reconcile.ClassCurrent])
		r, err := tb.board.Top(ctx, 10)
		require.NoError(t, err)
		require.False(t, r.Freshness.Unverified)
		require.Equal(t, int64(10), r.Entries[0].Score)
	})

	t.Run("RedisLossIsSeenAndRepaired", func(t *testing.T) {
		t.Parallel()
		tb := verifying(t)
		for _, u := range []string{"ada", "bob", "cy"} {
			tb.submit(t, u, 10)
		}
		tb.drain(t)
		_, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified)

		// Redis loses the board; new writes then recreate part of it.
		require.NoError(t, testenv.DeletePrefix(ctx, tb.rd.Client, tb.rd.Prefix))
		tb.submit(t, "dee", 5)
		tb.drain(t)
		requireUnverified(t, tb)
		r, err := tb.board.Top(ctx, 10, WithPolicy(ServeStale))
		require.NoError(t, err)
		require.Len(t, r.Entries, 1, "setup: only dee is back")
		require.True(t, r.Freshness.Unverified)

		rep, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified)
		require.Equal(t, int64(3), rep.RepairedByClass[reconcile.ClassMissing])
		r, err = tb.board.Top(ctx, 10)
		require.NoError(t, err)
		require.Len(t, r.Entries, 4)
	})

	// A read-your-writes read refused on an unverified board says why: the
	// awaited version may never come back until Verify repairs it.
	t.Run("AtLeastRefusalNamesVerify", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) {
			c.RequireVerifiedProjection = true
			c.ReadPolicy = FailClosed
			c.LagProbeInterval = time.Nanosecond
			c.ReadYourWritesTimeout = 20 * time.Millisecond
		})
		res := tb.submit(t, "ada", 10)
		tb.drain(t)
		_, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified)
		require.NoError(t, testenv.DeletePrefix(ctx, tb.rd.Client, tb.rd.Prefix)) // Redis loses the board
		_, _, err = tb.board.Rank(ctx, "ada", AtLeast("ada", res.Version))
		var stale *StaleError
		require.ErrorAs(t, err, &stale)
		require.True(t, stale.Unverified)
		require.Equal(t, res.Version, stale.Version)
		require.ErrorContains(t, err, "Board.Verify")
	})

	t.Run("LossDuringVerifyIsNotRecorded", func(t *testing.T) {
		t.Parallel()
		tb := verifying(t)
		tb.submit(t, "ada", 10)
		tb.submit(t, "bob", 20)
		tb.drain(t)
		require.NoError(t, tb.rd.Client.ZRem(ctx, tb.board.SortedSetKey(), "ada").Err()) // one repair to make
		wiped := false
		_, verified, err := tb.board.Verify(ctx, &reconcile.Config{
			BeforeRepair: func(ctx context.Context, _ reconcile.Finding) bool {
				if !wiped { // Redis restarts empty while the pass runs
					wiped = true
					assert.NoError(t, testenv.DeletePrefix(ctx, tb.rd.Client, tb.rd.Prefix))
				}
				return true
			},
		})
		require.NoError(t, err)
		require.True(t, wiped)
		require.False(t, verified, "bob, checked before the loss, is gone again")
		requireUnverified(t, tb)
	})

	t.Run("IncompletePassIsNotRecorded", func(t *testing.T) {
		t.Parallel()
		tb := verifying(t)
		tb.submit(t, "ada", 10)
		// Not projected: missing, and a policy that only reports it.
		rep, verified, err := tb.board.Verify(ctx, &reconcile.Config{Policy: reconcile.Policy{Missing: reconcile.ActionReport}})
		require.NoError(t, err)
		require.False(t, verified)
		require.Equal(t, int64(1), rep.Counts[reconcile.ClassMissing])
		rep, verified, err = tb.board.Verify(ctx, &reconcile.Config{BeforeRepair: func(context.Context, reconcile.Finding) bool { return false }})
		require.NoError(t, err)
		require.False(t, verified)
		require.Equal(t, int64(1), rep.Results[reconcile.ResultVetoed])
		requireUnverified(t, tb)
	})

	t.Run("OffByDefault", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) { c.ReadPolicy = FailClosed })
		tb.submit(t, "ada", 10)
		tb.drain(t)
		r, err := tb.board.Top(ctx, 10)
		require.NoError(t, err)
		require.False(t, r.Freshness.Unverified)
	})
}
