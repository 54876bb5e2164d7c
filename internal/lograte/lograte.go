// Package lograte keeps a recurring failure from flooding the log. A cache
// or a board that logs every failed call would, while its Redis is down,
// log a line per call: as many lines per second as it serves calls, for as
// long as the outage lasts. A Limiter lets the first occurrence of such a
// condition be logged at once, then at most one per Interval, each logged
// line carrying how many occurrences went unlogged since the line before
// (under the key Suppressed). Counters and metrics, not the log, are where
// every occurrence is counted.
//
// Limiting costs nothing until the condition occurs: a Limiter is two
// atomic words, read and written only by occurrences, and never allocates.
package lograte

import (
	"sync/atomic"
	"time"
)

// Interval is the least time between two lines a Limiter lets through.
const Interval = time.Second

// Suppressed is the attribute key under which a logged line reports the
// occurrences not logged since the line before it.
const Suppressed = "suppressed"

// epoch is what a Limiter measures time from, on the monotonic clock, so
// that setting the wall clock back cannot silence a Limiter for as long as
// it was set back.
var epoch = time.Now()

// Limiter decides which occurrences of one condition are logged. Its zero
// value is ready to use; it is safe for concurrent use and must not be
// copied after its first use.
type Limiter struct {
	// next is when the next line may be logged, as a time since epoch
	// (at least Interval once a line was); zero before the first line.
	next atomic.Int64
	// suppressed counts the occurrences not logged since the last line.
	suppressed atomic.Int64
}

// Allow records one occurrence and reports whether to log it, with the
// number of occurrences not logged since the previous line (0 for the
// first line), which the line should report under the key Suppressed. An
// occurrence not logged is counted for the next line that is.
func (l *Limiter) Allow() (log bool, suppressed int64) {
	return l.allowAt(time.Since(epoch))
}

// allowAt is Allow at now, a time since epoch.
func (l *Limiter) allowAt(now time.Duration) (bool, int64) {
	next := l.next.Load()
	// Of concurrent occurrences that find the interval over, only the one
	// that moves next logs.
	if next != 0 && int64(now) < next || !l.next.CompareAndSwap(next, int64(now+Interval)) {
		l.suppressed.Add(1)
		return false, 0
	}
	return true, l.suppressed.Swap(0)
}
