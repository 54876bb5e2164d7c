package leaderboard

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// TestVerifiedRecordCompanion: the companion key of Verify's record holds
// the size the pass found, and goes with the record when a pass refutes it.
func TestVerifiedRecordCompanion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	verifying := func(t *testing.T) *testBundle {
		return setup(t, func(c *Config) {
			c.RequireVerifiedProjection = true
			c.ReadPolicy = FailClosed
			c.LagProbeInterval = time.Nanosecond
		})
	}

	// The companion holds the size the pass found: a sorted set that new
	// scores recreated with one member fewer than the pass checked no
	// longer counts as verified (verified.lua: held is ZCARD, not less).
	t.Run("RecordStopsCountingOneMemberShort", func(t *testing.T) {
		t.Parallel()
		tb := verifying(t)
		for _, u := range []string{"ada", "bo", "cy"} {
			tb.submit(t, u, 10)
		}
		tb.drain(t)
		_, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified)
		require.False(t, tb.board.Freshness(ctx).Unverified)

		require.NoError(t, tb.rd.Client.Del(ctx, tb.board.zsetKey).Err())
		tb.submit(t, "dee", 1)
		tb.submit(t, "eve", 1)
		tb.drain(t)
		n, err := tb.rd.Client.ZCard(ctx, tb.board.zsetKey).Result()
		require.NoError(t, err)
		require.EqualValues(t, 2, n)
		require.True(t, tb.board.Freshness(ctx).Unverified, "the pass found 3 members; 2 are left")
	})

	// A pass that finds the projection wrong deletes the earlier record and
	// its companion: nothing of the refuted verification is left.
	t.Run("RefutationLeavesNoCompanion", func(t *testing.T) {
		t.Parallel()
		tb := verifying(t)
		tb.submit(t, "ada", 10)
		tb.drain(t)
		_, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified)
		// An orphan, which the default policy only reports.
		require.NoError(t, tb.rd.Client.ZAdd(ctx, tb.board.zsetKey, redis.Z{Score: 1, Member: "ghost"}).Err())
		_, verified, err = tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.False(t, verified)
		n, err := tb.rd.Client.Exists(ctx, tb.board.verifiedKey, tb.board.heldKey, tb.board.verifyingKey).Result()
		require.NoError(t, err)
		require.Zero(t, n, "record, companion and marker are all gone")
	})
}

// TestFailClosedCancelledBeforeTheProbeIsNotStale: a FailClosed read whose
// ctx ended before the lag was measured reports the cancellation, not
// staleness.
func TestFailClosedCancelledBeforeTheProbeIsNotStale(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t, func(c *Config) {
		c.ReadPolicy = FailClosed
		c.LagProbeInterval = time.Nanosecond
	})
	tb.submit(t, "ada", 10)
	tb.drain(t)
	rctx, cancel := context.WithCancel(ctx)
	cancel()
	_, err := tb.board.Top(rctx, 10)
	require.ErrorIs(t, err, context.Canceled)
	require.NotErrorIs(t, err, ErrStale)
}

// TestDrainCountsWhatItHandled: Drain returns how many records it handled.
func TestDrainCountsWhatItHandled(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	for _, u := range []string{"ada", "bo", "cy"} {
		tb.submit(t, u, 10)
	}
	w, err := tb.board.Worker(nil)
	require.NoError(t, err)
	n, err := w.Drain(ctx)
	require.NoError(t, err)
	require.Equal(t, 3, n)
	n, err = w.Drain(ctx)
	require.NoError(t, err)
	require.Zero(t, n)
}
