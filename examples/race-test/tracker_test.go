package main

import (
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The metric definitions, on hand-made timelines.
func TestTracker(t *testing.T) {
	t.Parallel()

	t.Run("ReadBeganBeforeAckIsNotStale", func(t *testing.T) {
		t.Parallel()
		tr := newTracker(1, 1)
		read := tr.beginRead(0)
		tr.acknowledge(2)
		tr.endRead(read, 1, true)
		tr.settle()
		require.Zero(t, tr.staleAfterAck.Load())
		require.Empty(t, tr.diverged)
		require.EqualValues(t, 1, tr.writes)
	})

	t.Run("StaleAfterSettleIsDivergenceOncePerWrite", func(t *testing.T) {
		t.Parallel()
		tr := newTracker(1, 1)
		tr.acknowledge(2)
		tr.settle() // no read in flight: settled at once
		require.EqualValues(t, 2, tr.settledFloor.Load())
		for range 2 {
			read := tr.beginRead(0)
			tr.endRead(read, 1, true)
		}
		require.EqualValues(t, 2, tr.staleAfterAck.Load())
		require.Equal(t, map[int64]bool{2: true}, tr.diverged)
		require.Positive(t, tr.firstDiv)
	})

	t.Run("InFlightReadHoldsSettlement", func(t *testing.T) {
		t.Parallel()
		tr := newTracker(2, 1)
		slow := tr.beginRead(0)
		tr.acknowledge(2)
		tr.settle()
		require.EqualValues(t, 1, tr.settledFloor.Load(), "reader 0 began before the ack and is still reading")

		// Reader 1 begins after the ack: a stale read, not yet a divergence.
		fast := tr.beginRead(1)
		tr.endRead(fast, 1, true)
		require.EqualValues(t, 1, tr.staleAfterAck.Load())
		require.Empty(t, tr.diverged)

		tr.endRead(slow, 1, true)
		tr.settle()
		require.EqualValues(t, 2, tr.settledFloor.Load())
		after := tr.beginRead(1)
		tr.endRead(after, 2, true)
		require.Empty(t, tr.diverged, "a current read after settling is fine")
	})

	t.Run("FailedInvalidateMakesNoClaim", func(t *testing.T) {
		t.Parallel()
		tr := newTracker(1, 1)
		tr.abandon(2)
		tr.acknowledge(3)
		tr.settle()
		require.EqualValues(t, 3, tr.settledFloor.Load())
		read := tr.beginRead(0)
		tr.endRead(read, 1, true)
		require.Equal(t, map[int64]bool{3: true}, tr.diverged, "version 2 was never acknowledged")
	})

	t.Run("Percentiles", func(t *testing.T) {
		t.Parallel()
		tr := newTracker(2, 1)
		for i := int64(1); i <= 100; i++ {
			tr.recordLatency(int(i)%2, i)
		}
		p50, p99 := tr.percentiles()
		require.InDelta(t, 51, p50, 1)
		require.InDelta(t, 100, p99, 1)
	})

	// A write acknowledged between settle's scan of the reads in flight and
	// its taking the lock was settled, although a read that began after the
	// scan and before the ack was still in flight: a read returning the
	// older version then counted as a divergence, not a stale read.
	t.Run("AckDuringSettleWaitsForReadsBeforeIt", func(t *testing.T) {
		t.Parallel()
		tr := newTracker(2, 1)
		tr.mu.Lock()
		done := make(chan struct{})
		go func() { defer close(done); tr.settle() }() // scans: nobody reading; then waits for mu
		time.Sleep(100 * time.Millisecond)
		slow := tr.beginRead(0) // after the scan, before the ack
		time.Sleep(time.Millisecond)
		// acknowledge(2), as it runs while settle waits for the lock.
		tr.acked.Store(2)
		tr.writes++
		tr.pending = append(tr.pending, ackedWrite{version: 2, ackedAt: tr.now()})
		tr.mu.Unlock()
		<-done

		require.EqualValues(t, 1, tr.settledFloor.Load(), "reader 0 began before write 2's ack and is still reading")
		fast := tr.beginRead(1)
		tr.endRead(fast, 1, true)
		require.Empty(t, tr.diverged, "write 2 is not settled")
		tr.endRead(slow, 1, true)
	})
}

// TestTrackerMemoryIsBoundedByReads: the tracker's doc says it turns
// events into figures "while the run goes on (a long run makes far too many
// reads to keep)", and --seconds accepts up to a week, yet every read's
// latency was kept (4 bytes a read, per reader, then copied into one slice
// and sorted for the percentiles). The README's own five-minute run made
// 699,279 reads; a week at that rate is 1.4 billion reads: 5.6 GB kept, and
// as much again to sort. Memory must not grow with the number of reads.
// Not parallel: it measures the heap, which parallel tests would grow.
func TestTrackerMemoryIsBoundedByReads(t *testing.T) {
	const reads = 4_000_000
	tr := newTracker(1, 1)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for range reads {
		s := tr.beginRead(0)
		tr.endRead(s, 1, true)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	grown := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	t.Logf("%d reads: heap grew by %d bytes", reads, grown)
	p50, p99 := tr.percentiles()
	require.EqualValues(t, reads, tr.reads.Load())
	require.LessOrEqual(t, p50, p99)
	runtime.KeepAlive(tr)
	require.Less(t, grown, int64(2<<20), "the tracker kept every read: %d bytes for %d reads", grown, reads)
}

// TestPercentilesStayExactBelowAMillisecondAndClose above it: the
// percentiles of a bounded tracker are those of the reads it saw.
func TestPercentilesOfRecordedReads(t *testing.T) {
	t.Parallel()
	tr := newTracker(1, 1)
	for i := int64(1); i <= 100; i++ {
		tr.recordLatency(0, i)
	}
	p50, p99 := tr.percentiles()
	require.InDelta(t, 51, p50, 1)
	require.InDelta(t, 100, p99, 1)

	tr = newTracker(2, 1)
	for i := int64(1); i <= 100_000; i++ {
		tr.recordLatency(int(i%2), i*100) // 100µs to 10s
	}
	p50, p99 = tr.percentiles()
	require.InEpsilon(t, 5_000_000, p50, 0.005)
	require.InEpsilon(t, 9_900_000, p99, 0.005)
}

// TestFirstDivergenceStaysTheFirst: first_divergence_s is the time of the
// first divergence; a later one must not move it.
func TestFirstDivergenceStaysTheFirst(t *testing.T) {
	t.Parallel()
	tr := newTracker(1, 1)
	tr.acknowledge(2)
	tr.settle()
	read := tr.beginRead(0)
	tr.endRead(read, 1, true) // diverges from write 2
	require.Equal(t, map[int64]bool{2: true}, tr.diverged)
	first := tr.firstDiv

	time.Sleep(20 * time.Millisecond) // a later divergence has a later time
	tr.acknowledge(3)
	tr.settle()
	read = tr.beginRead(0)
	tr.endRead(read, 2, true) // diverges from write 3
	require.Equal(t, map[int64]bool{2: true, 3: true}, tr.diverged)
	require.Equal(t, first, tr.firstDiv, "the second divergence moved first_divergence_s")
}
