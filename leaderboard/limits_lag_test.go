package leaderboard

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/outbox"
)

// TestPageSizeLimits checks that every read taking a size refuses one
// outside its documented range with ErrInvalidLimit, and accepts both
// ends: MaxPageSize bounds the n of Top, Page and Authoritative and the
// neighbourhood of Around. Authoritative matters most: a regression
// letting Authoritative(0) through would answer "no entries" from the
// source of truth, an empty payout list, instead of an error.
func TestPageSizeLimits(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	tb.submit(t, "amy", 5)
	tb.submit(t, "bob", 3)
	tb.drain(t)

	for _, n := range []int{0, -1, MaxPageSize + 1} {
		got, err := tb.board.Authoritative(ctx, n)
		require.ErrorIs(t, err, ErrInvalidLimit, "Authoritative(%d) = %v", n, got)
		_, err = tb.board.Top(ctx, n)
		require.ErrorIs(t, err, ErrInvalidLimit, "Top(%d)", n)
		_, err = tb.board.Page(ctx, "", n)
		require.ErrorIs(t, err, ErrInvalidLimit, "Page(%d)", n)
	}
	// Around's n counts neighbours on each side, so 0 (the user alone) is
	// valid.
	for _, n := range []int{-1, MaxPageSize + 1} {
		r, err := tb.board.Around(ctx, "amy", n)
		require.ErrorIs(t, err, ErrInvalidLimit, "Around(%d) = %v", n, r.Entries)
		// Its text names Around's own range, not the pages' "from 1".
		require.ErrorContains(t, err, fmt.Sprintf("between 0 and %d", MaxPageSize))
	}

	amy, bob := Entry{UserID: "amy", Score: 5, Rank: 1}, Entry{UserID: "bob", Score: 3, Rank: 2}
	auth, err := tb.board.Authoritative(ctx, MaxPageSize)
	require.NoError(t, err)
	require.Equal(t, []Entry{amy, bob}, auth)
	auth, err = tb.board.Authoritative(ctx, 1)
	require.NoError(t, err)
	require.Equal(t, []Entry{amy}, auth)
	r, err := tb.board.Around(ctx, "bob", 0)
	require.NoError(t, err)
	require.Equal(t, []Entry{bob}, r.Entries)
	r, err = tb.board.Around(ctx, "bob", MaxPageSize)
	require.NoError(t, err)
	require.Equal(t, []Entry{amy, bob}, r.Entries)
}

// TestLagWithKeptPublishedRows checks the lag probe on an outbox whose
// worker keeps delivered rows (outbox.RelayConfig.KeepPublished): a kept
// row is projected, so it is neither lag itself nor a pending change that
// keeps a dead letter counting. Otherwise Lag would grow without bound
// and a FailClosed board would refuse every read although Redis is
// current.
func TestLagWithKeptPublishedRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	keepPublished := func() *WorkerConfig { return &WorkerConfig{Relay: &outbox.RelayConfig{KeepPublished: true}} }
	// Every read probes; MaxLag is well above a probe's duration.
	failClosedBoard := func(t *testing.T) *testBundle {
		return setup(t, func(c *Config) {
			c.ReadPolicy = FailClosed
			c.MaxLag = 5 * time.Second
			c.LagProbeInterval = time.Nanosecond
		})
	}

	t.Run("DeliveredRowIsNotLag", func(t *testing.T) {
		t.Parallel()
		tb := failClosedBoard(t)
		tb.submit(t, "amy", 5)
		w, err := tb.board.Worker(keepPublished())
		require.NoError(t, err)
		_, err = w.Drain(ctx)
		require.NoError(t, err)
		// Dated a minute back, the kept row would be well past MaxLag if
		// it counted; no sleeping on the clock.
		tag, err := tb.pg.Pool.Exec(ctx,
			`UPDATE verity_outbox SET created_at = created_at - interval '1 minute' WHERE published_at IS NOT NULL`)
		require.NoError(t, err)
		require.EqualValues(t, 1, tag.RowsAffected(), "the delivered row is kept")

		require.Less(t, tb.board.Freshness(ctx).Lag, 5*time.Second, "a kept, delivered row counted as unprojected")
		r, err := tb.board.Top(ctx, 1)
		require.NoError(t, err)
		require.Equal(t, []Entry{{UserID: "amy", Score: 5, Rank: 1}}, r.Entries)
	})

	// A dead letter stops counting once a newer version of its user has
	// reached Redis. A worker keeping delivered rows leaves that newer
	// version in the outbox, published: it is not pending, so it must not
	// keep the dead letter counting as an unprojected change would.
	t.Run("KeptNewerVersionSupersedesDeadLetter", func(t *testing.T) {
		t.Parallel()
		tb := failClosedBoard(t)
		tb.submit(t, "user-a", 10)
		tb.drain(t)
		tb.submit(t, "user-a", 7) // version 2, buried
		tb.bury(t)
		tb.ageDeadLetters(t, time.Minute)
		_, err := tb.board.Top(ctx, 1)
		var stale *StaleError
		require.ErrorAs(t, err, &stale, "the dead letter counts while Redis lacks its change")

		require.Equal(t, int64(3), tb.submit(t, "user-a", 1).Version)
		w, err := tb.board.Worker(keepPublished())
		require.NoError(t, err)
		_, err = w.Drain(ctx)
		require.NoError(t, err)
		var kept int
		require.NoError(t, tb.pg.Pool.QueryRow(ctx,
			`SELECT count(*) FROM verity_outbox WHERE published_at IS NOT NULL`).Scan(&kept))
		require.Equal(t, 1, kept, "version 3 is kept, published")
		r, err := tb.board.Top(ctx, 1)
		require.NoError(t, err, "version 3 reached Redis: the dead letter no longer counts")
		require.Equal(t, []Entry{{UserID: "user-a", Score: 18, Rank: 1}}, r.Entries)
	})
}
