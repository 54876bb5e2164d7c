package main

import (
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
		for i := int32(1); i <= 100; i++ {
			tr.latencies[int(i)%2] = append(tr.latencies[int(i)%2], i)
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
