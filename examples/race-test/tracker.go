package main

import (
	"math"
	"math/bits"
	"sync"
	"sync/atomic"
	"time"
)

// tracker turns the readers' and writers' events into the race-test figures
// while the run goes on (a long run makes far too many reads to keep).
//
// Definitions, with "older" always judged by the database's row_version:
//
//   - stale read after ack: a read that began after some write's Invalidate
//     returned, yet returned an older row version than that write's.
//   - a write is settled once its Invalidate returned and every read that
//     began before that has finished: from then on nothing in flight can
//     excuse an old value.
//   - divergence: a write such that a read that began after it, and every
//     write of a lower row version, settled still returned an older row
//     version. Each write counts at most once. Writes of one row can settle
//     out of order (their Invalidates return in any order): a read that
//     began after a write settled but before a lower one did, and returned
//     a version below the first, is counted by stale reads after ack only.
type tracker struct {
	start time.Time

	// acked is the highest row version whose Invalidate has returned.
	acked atomic.Int64
	// settledFloor is the highest row version v such that every write with
	// a version up to v is settled (or failed and makes no claim).
	settledFloor atomic.Int64

	// inFlight[i] is reader i's read: 0 idle, -1 about to start, else
	// the read's start in nanoseconds since start (plus one).
	inFlight []atomic.Int64

	mu        sync.Mutex
	pending   []ackedWrite   // acked, not yet settled, in ack order
	settled   map[int64]bool // settled versions above settledFloor
	claimless map[int64]bool // versions that make no claim (failed invalidate)
	diverged  map[int64]bool // versions counted as divergences
	firstDiv  time.Duration  // since start; valid when len(diverged) > 0
	writes    int64          // acknowledged writes

	// latencies counts reads by latency bucket (latencyBucket): a fixed
	// size whatever the number of reads.
	latencies [latencyBuckets]atomic.Int64

	reads, staleAfterAck atomic.Int64
}

type ackedWrite struct {
	version int64
	ackedAt int64 // nanoseconds since start
}

func newTracker(readers int, initialVersion int64) *tracker {
	t := &tracker{
		start:     time.Now(),
		inFlight:  make([]atomic.Int64, readers),
		settled:   map[int64]bool{},
		claimless: map[int64]bool{},
		diverged:  map[int64]bool{},
	}
	t.acked.Store(initialVersion)
	t.settledFloor.Store(initialVersion)
	return t
}

func (t *tracker) now() int64 { return int64(time.Since(t.start)) }

// readSnapshot is what a read knows when it begins.
type readSnapshot struct {
	reader       int
	began        time.Time
	acked, floor int64
}

func (t *tracker) beginRead(reader int) readSnapshot {
	// -1 first: a monitor that sees it cannot tell when the read began, so
	// it waits, and one that still sees 0 knows the read begins after it.
	t.inFlight[reader].Store(-1)
	began := time.Now()
	t.inFlight[reader].Store(int64(began.Sub(t.start)) + 1)
	return readSnapshot{reader: reader, began: began, acked: t.acked.Load(), floor: t.settledFloor.Load()}
}

func (t *tracker) endRead(s readSnapshot, version int64, ok bool) {
	elapsed := time.Since(s.began)
	t.inFlight[s.reader].Store(0)
	if !ok {
		return
	}
	t.recordLatency(s.reader, elapsed.Microseconds())
	t.reads.Add(1)
	if version < s.acked {
		t.staleAfterAck.Add(1)
	}
	if version >= s.floor {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for v := version + 1; v <= s.floor; v++ {
		if t.claimless[v] || t.diverged[v] {
			continue
		}
		if len(t.diverged) == 0 {
			t.firstDiv = time.Since(t.start)
		}
		t.diverged[v] = true
	}
}

// acknowledge records a write whose Invalidate returned.
func (t *tracker) acknowledge(version int64) {
	at := t.now()
	for {
		cur := t.acked.Load()
		if version <= cur || t.acked.CompareAndSwap(cur, version) {
			break
		}
	}
	t.mu.Lock()
	t.writes++
	t.pending = append(t.pending, ackedWrite{version: version, ackedAt: at})
	t.mu.Unlock()
}

// abandon records a committed write whose Invalidate failed: it makes no
// claim, and must not hold back the settled floor.
func (t *tracker) abandon(version int64) {
	t.mu.Lock()
	t.claimless[version] = true
	t.advanceFloor()
	t.mu.Unlock()
}

// settle moves pending writes whose earlier reads have all finished into the
// settled set. It is called often by a monitor goroutine.
func (t *tracker) settle() {
	// Only writes acknowledged before the scan can be judged by it: a read
	// the scan saw idle may have begun after the scan and before a later
	// ack.
	scanned := t.now()
	oldest := int64(math.MaxInt64) // earliest start of a read in flight
	unknown := false
	for i := range t.inFlight {
		switch s := t.inFlight[i].Load(); {
		case s == -1:
			unknown = true
		case s > 0:
			oldest = min(oldest, s-1)
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	kept := t.pending[:0]
	for _, w := range t.pending {
		if unknown || oldest < w.ackedAt || w.ackedAt > scanned {
			kept = append(kept, w)
			continue
		}
		t.settled[w.version] = true
	}
	t.pending = kept
	t.advanceFloor()
}

func (t *tracker) advanceFloor() {
	floor := t.settledFloor.Load()
	for t.settled[floor+1] || t.claimless[floor+1] {
		floor++
		delete(t.settled, floor)
	}
	t.settledFloor.Store(floor)
}

// Latency buckets: exact below 1,024 µs, then 512 per power of two (within
// 0.2 %), up to math.MaxInt32 µs.
const latencyBuckets = 1024 + 22*512

func latencyBucket(us int64) int {
	us = max(0, min(us, math.MaxInt32))
	if us < 1024 {
		return int(us)
	}
	e := bits.Len64(uint64(us)) - 10 // us>>e is in [512, 1024)
	return 1024 + (e-1)*512 + int(us>>e) - 512
}

// bucketValue is the smallest latency of bucket b, in µs.
func bucketValue(b int) int64 {
	if b < 1024 {
		return int64(b)
	}
	e := (b-1024)/512 + 1
	return int64((b-1024)%512+512) << e
}

// recordLatency counts one read of us microseconds.
func (t *tracker) recordLatency(_ int, us int64) {
	t.latencies[latencyBucket(us)].Add(1)
}

// percentiles returns p50 and p99 read latency in microseconds.
// Call it only after the readers stopped.
func (t *tracker) percentiles() (p50, p99 float64) {
	var n int64
	for i := range t.latencies {
		n += t.latencies[i].Load()
	}
	if n == 0 {
		return 0, 0
	}
	at := func(q float64) float64 {
		rank := min(n-1, int64(q*float64(n))) // 0-based, as before
		var seen int64
		for b := range t.latencies {
			seen += t.latencies[b].Load()
			if seen > rank {
				return float64(bucketValue(b))
			}
		}
		return float64(bucketValue(latencyBuckets - 1))
	}
	return at(0.50), at(0.99)
}
