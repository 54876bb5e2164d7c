package outbox_test

import (
	"context"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/outbox"
)

// TestHandlerGoexit: runtime.Goexit in a Handler (t.FailNow in a test's
// handler) cannot be recovered. Under RunOnce it ends the caller's goroutine
// with the batch leased; Run stops claiming and its goroutine ends once ctx
// does (at once without a LISTEN connection of its own), without returning. Either way another relay delivers the batch once
// the lease ends, as the Handler doc says.
func TestHandlerGoexit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// Long enough for a claim (bounded by it) on a loaded machine: with
	// 300ms a RunOnce under a load of 15 on two cores returned before its
	// Handler ran.
	const lease = 2 * time.Second
	goexit := outbox.HandlerFunc(func(context.Context, []outbox.Record) ([]outbox.Result, error) {
		runtime.Goexit()
		return nil, nil
	})
	deliverAfterLease := func(t *testing.T, b *testBundle) {
		t.Helper()
		require.Len(t, b.rows(t), 2, "nothing acknowledged")
		var leasedUntil time.Time
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT max(leased_until) FROM `+b.leasesTable()+
			` WHERE leased_until > now()`).Scan(&leasedUntil), "the batch stays leased")
		var delivered atomic.Int64
		ok := outbox.HandlerFunc(func(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			delivered.Add(int64(len(batch)))
			return make([]outbox.Result, len(batch)), nil
		})
		r := b.relay(t, nil, ok, outbox.RelayConfig{LeaseDuration: lease})
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Zero(t, n, "leased rows are not claimed before the lease ends")
		time.Sleep(time.Until(leasedUntil.Add(50 * time.Millisecond)))
		n, err = r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 2, n)
		require.EqualValues(t, 2, delivered.Load())
	}

	// runInBackground runs r.Run(ctx) on a goroutine of its own: ended is
	// closed when that goroutine ends, and returned, read after, tells
	// whether Run returned.
	runInBackground := func(ctx context.Context, r *outbox.Relay) (ended <-chan struct{}, returned func() bool) {
		done, ran := make(chan struct{}), false
		go func() {
			defer close(done)
			_ = r.Run(ctx)
			ran = true
		}()
		return done, func() bool { <-done; return ran }
	}

	t.Run("RunOnce", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendCommitted(t, newMessage("s", "a", 1), newMessage("s", "b", 1))
		r := b.relay(t, nil, goexit, outbox.RelayConfig{LeaseDuration: lease})
		returned, ended := false, make(chan struct{})
		go func() {
			defer close(ended)
			_, _ = r.RunOnce(ctx)
			returned = true
		}()
		<-ended
		require.False(t, returned, "RunOnce does not return: the goroutine ends")
		deliverAfterLease(t, b)
	})

	t.Run("Run", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendCommitted(t, newMessage("s", "a", 1), newMessage("s", "b", 1))
		var calls atomic.Int64
		h := outbox.HandlerFunc(func(ctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			calls.Add(1)
			return goexit(ctx, batch)
		})
		r := b.relay(t, nil, h, outbox.RelayConfig{LeaseDuration: lease, PollInterval: 10 * time.Millisecond})
		runCtx, cancel := context.WithCancel(ctx)
		defer cancel()
		ended, returned := runInBackground(runCtx, r)
		require.Eventually(t, func() bool { return calls.Load() == 1 }, 5*time.Second, 5*time.Millisecond)
		deliverAfterLease(t, b)
		require.EqualValues(t, 1, calls.Load(), "Run claims nothing after the Goexit")
		select {
		case <-ended:
			t.Fatal("Run's goroutine ended before ctx did")
		default:
		}
		cancel()
		select {
		case <-ended:
		case <-time.After(5 * time.Second):
			t.Fatal("Run's goroutine did not end after ctx")
		}
		require.False(t, returned(), "Run does not return")
	})

	// With no goroutine of its own to wait for, Run's goroutine ends at
	// once, ctx still live.
	t.Run("RunWithoutNotify", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendCommitted(t, newMessage("s", "a", 1), newMessage("s", "b", 1))
		r := b.relay(t, nil, goexit, outbox.RelayConfig{LeaseDuration: lease, PollInterval: 10 * time.Millisecond, DisableNotify: true})
		runCtx, cancel := context.WithCancel(ctx)
		defer cancel()
		ended, returned := runInBackground(runCtx, r)
		select {
		case <-ended:
		case <-time.After(5 * time.Second):
			t.Fatal("Run's goroutine did not end (DisableNotify, no metrics)")
		}
		require.NoError(t, runCtx.Err())
		require.False(t, returned(), "Run does not return")
		deliverAfterLease(t, b)
	})
}
