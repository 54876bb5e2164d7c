package reconcile

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/projection"
)

// TestRebuildRefreshesItsMarker is MarkerExpired's counterpart (see
// TestRebuildAborted): a copy that outlasts RebuildMarkerTTL but makes
// progress keeps its marker alive, refreshed as it goes, and switches.
// The pacing is wall-clock on purpose: the marker's TTL is.
func TestRebuildRefreshesItsMarker(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet)
	b.insertMany(t, 30)
	const ttl = 2 * time.Second
	// Six pages (five of rows, one empty) of 600ms each: about twice the
	// TTL in all, each page well within it (with room for a loaded
	// machine, 1.4s: the marker lapses only if a page and its copy take a
	// TTL; with a 1s TTL and 300ms pages it lapsed once under a load of
	// 12 on two cores).
	src := &hookedSource{Source: b.source, onPage: func(context.Context, int) { time.Sleep(600 * time.Millisecond) }}
	r, err := New(src, b.target, &Config{PageSize: 6, RebuildMarkerTTL: ttl})
	require.NoError(t, err)
	start := time.Now()
	rep, err := r.Rebuild(context.Background())
	require.NoError(t, err)
	require.True(t, rep.Switched)
	require.EqualValues(t, 30, rep.Rows)
	require.Greater(t, time.Since(start), ttl, "the copy outlasted the TTL")
}
