package lograte

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestLimiter(t *testing.T) {
	t.Parallel()

	// The first occurrence logs at once, the rest of its Interval are
	// counted, and the first occurrence after the Interval logs them.
	t.Run("FirstAtOnceThenOncePerInterval", func(t *testing.T) {
		t.Parallel()
		var l Limiter
		log, n := l.allowAt(0)
		require.True(t, log)
		require.Zero(t, n)
		for i := range 99 {
			log, n = l.allowAt(time.Duration(i) * time.Millisecond)
			require.False(t, log)
			require.Zero(t, n)
		}
		log, _ = l.allowAt(Interval - 1)
		require.False(t, log)
		log, n = l.allowAt(Interval)
		require.True(t, log)
		require.EqualValues(t, 100, n, "the 99 above and the one just before the Interval ended")
		log, n = l.allowAt(Interval + time.Millisecond)
		require.False(t, log)
		require.Zero(t, n)
	})

	// After a quiet spell the next occurrence logs at once, with what was
	// left unlogged at the end of the previous spell.
	t.Run("QuietSpellThenAtOnce", func(t *testing.T) {
		t.Parallel()
		var l Limiter
		log, _ := l.allowAt(5 * time.Second)
		require.True(t, log)
		log, _ = l.allowAt(5*time.Second + time.Millisecond)
		require.False(t, log)
		log, n := l.allowAt(time.Hour)
		require.True(t, log)
		require.EqualValues(t, 1, n)
	})

	// Allow measures from the package's epoch: the first call logs.
	t.Run("AllowUsesTheClock", func(t *testing.T) {
		t.Parallel()
		var l Limiter
		log, n := l.Allow()
		require.True(t, log)
		require.Zero(t, n)
		log, _ = l.Allow()
		require.False(t, log, "well within Interval of the first")
	})

	// Concurrent occurrences: one line per Interval, and every occurrence
	// either logged or reported by the next line.
	t.Run("Concurrent", func(t *testing.T) {
		t.Parallel()
		var l Limiter
		const goroutines, each = 8, 1000
		var mu sync.Mutex
		lines, reported := 0, int64(0)
		var wg sync.WaitGroup
		for g := range goroutines {
			wg.Go(func() {
				for i := range each {
					// Every goroutine sweeps the same ten Intervals.
					now := time.Duration(i) * 10 * Interval / each
					if log, n := l.allowAt(now + time.Duration(g)); log {
						mu.Lock()
						lines++
						reported += n
						mu.Unlock()
					}
				}
			})
		}
		wg.Wait()
		require.LessOrEqual(t, lines, 10+1)
		require.GreaterOrEqual(t, lines, 2)
		log, n := l.allowAt(time.Hour)
		require.True(t, log)
		require.EqualValues(t, goroutines*each, int64(lines)+reported+n,
			"every occurrence is logged or counted exactly once")
	})
}

// TestLimiterAllocatesNothing: an occurrence, logged or not, allocates
// nothing. Every measured run has one of each: within one Interval only
// the first occurrence is logged, and AllocsPerRun does not measure its
// warm-up call. Not parallel: AllocsPerRun refuses to run in a parallel
// test.
func TestLimiterAllocatesNothing(t *testing.T) {
	var l Limiter
	require.Zero(t, testing.AllocsPerRun(100, func() { l.Allow() }), "Allow")
	var fresh Limiter
	var now time.Duration
	require.Zero(t, testing.AllocsPerRun(100, func() {
		now += Interval
		if log, _ := fresh.allowAt(now); !log {
			t.Fatal("an occurrence a whole Interval after the last line was not logged")
		}
		if log, _ := fresh.allowAt(now); log {
			t.Fatal("a second occurrence at the same instant was logged")
		}
	}), "logged and suppressed")
}
