package leaderboard

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

// TestSubmitGroupOverflow: a shared statement refused because one of its
// commands would leave the score range (and for no other reason) gives
// every call the outcome its command would have had alone.
func TestSubmitGroupOverflow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	gb := setupGroups(t, func(c *Config) { c.MinDelta, c.MaxDelta = MinScore, MaxScore })
	_, err := gb.board.Submit(ctx, Command{EventID: uuid.New(), UserID: "user-high", Delta: MaxScore - 1})
	require.NoError(t, err)
	ok := Command{EventID: uuid.New(), UserID: "user-a", Delta: 1}
	overflow := Command{EventID: uuid.New(), UserID: "user-high", Delta: 5}
	outs := gb.groupBehindFirst(t, ctx, ok, overflow)

	o := wait(t, outs[0])
	require.NoError(t, o.err, "the other command of the group is applied")
	require.Equal(t, Result{Score: 1, Version: 1}, o.res)
	var tooHigh *ScoreOutOfRangeError
	require.ErrorAs(t, wait(t, outs[1]).err, &tooHigh)
	require.Equal(t, ScoreOutOfRangeError{UserID: "user-high", Delta: 5}, *tooHigh)
	require.Zero(t, gb.transactions(t, overflow.EventID), "the refused command wrote nothing")
	events, users, queued := gb.counts(t)
	require.Equal(t, []int{3, 3, 3}, []int{events, users, queued}) // user-high's first, user-z, ok
}

// TestSubmitGroupCallsEndedOrStalled covers the group's bookkeeping for
// calls whose ctx ends and for statements that stall.
func TestSubmitGroupCallsEndedOrStalled(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// The only queued call's ctx has ended before a flusher takes it: the
	// flusher drops it with its ctx's error; it is not sent.
	t.Run("EndedAloneInTheQueueIsNotSent", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		g := &tb.board.group
		ended, cancel := context.WithCancel(ctx)
		cancel()
		dead := &submitCall{ctx: ended, cmd: Command{EventID: uuid.New(), UserID: "user-a", Delta: 1}, done: make(chan struct{})}
		g.enqueue(dead)
		select {
		case <-dead.done:
		case <-time.After(10 * time.Second):
			t.Fatal("the ended call was never finished")
		}
		require.Equal(t, context.Canceled, dead.err, "dropped with its ctx's error, not sent")
		tb.board.Close()
		require.Zero(t, tb.transactions(t, dead.cmd.EventID))
	})

	// A lone call sent by its caller, whose ctx ends while the statement
	// waits for a lock, returns its ctx's error.
	t.Run("LoneCallCancelledInFlightReturnsItsCtxError", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		submitted(t, tb.board, "user-a", 1)
		tx, waitBlocked := lockUserRow(t, tb, "user-a")
		cctx, cancel := context.WithCancel(ctx)
		defer cancel()
		out := make(chan outcome, 1)
		go func() {
			res, err := tb.board.Submit(cctx, Command{EventID: uuid.New(), UserID: "user-a", Delta: 1})
			out <- outcome{res, err}
		}()
		waitBlocked("the Submit of user-a did not wait for the lock")
		cancel()
		o := wait(t, out)
		require.Equal(t, context.Canceled, o.err)
		require.NoError(t, tx.Rollback(ctx))
	})

	// A statement that stalls gives its place back once: when it is over,
	// no place is given back again, and the count of statements under way
	// returns to zero, so SubmitStatements still bounds them.
	stalled := func(t *testing.T, send func(tb *testBundle, cmd Command) <-chan outcome) {
		t.Helper()
		tb := setup(t, func(c *Config) { c.SubmitStatements = 1 })
		g := &tb.board.group
		g.stallAfter = 10 * time.Millisecond // before any statement reads it
		submitted(t, tb.board, "user-a", 1)
		tx, waitBlocked := lockUserRow(t, tb, "user-a")
		out := send(tb, Command{EventID: uuid.New(), UserID: "user-a", Delta: 1})
		waitBlocked("the Submit of user-a did not wait for the lock")
		flushers := func() int {
			g.mu.Lock()
			defer g.mu.Unlock()
			return g.flushers
		}
		require.Eventually(t, func() bool { return flushers() == 0 }, 5*time.Second, time.Millisecond,
			"the stalled statement did not give its place back")
		require.NoError(t, tx.Rollback(ctx))
		o := wait(t, out)
		require.NoError(t, o.err)
		require.Equal(t, Result{Score: 2, Version: 2}, o.res)
		// The flusher, if one sent it, retires: look for this group's by
		// its receiver (other tests' boards run in this process).
		require.Eventually(t, func() bool {
			stacks := make([]byte, 1<<20)
			stacks = stacks[:runtime.Stack(stacks, true)]
			return !strings.Contains(string(stacks), fmt.Sprintf("(*submitGroup).flush(%p", g))
		}, 5*time.Second, time.Millisecond, "the flusher did not retire")
		require.Equal(t, 0, flushers(), "statements counted once the stalled one is over")
	}
	t.Run("StalledLoneCallGivesItsPlaceBackOnce", func(t *testing.T) {
		t.Parallel()
		stalled(t, func(tb *testBundle, cmd Command) <-chan outcome {
			out := make(chan outcome, 1)
			go func() {
				res, err := tb.board.Submit(ctx, cmd)
				out <- outcome{res, err}
			}()
			return out
		})
	})
	t.Run("StalledFlusherGivesItsPlaceBackOnce", func(t *testing.T) {
		t.Parallel()
		stalled(t, func(tb *testBundle, cmd Command) <-chan outcome {
			// Queued as a call that found the statement busy: a flusher sends it.
			g := &tb.board.group
			call := &submitCall{ctx: ctx, cmd: cmd, done: make(chan struct{})}
			g.enqueue(call)
			out := make(chan outcome, 1)
			go func() {
				<-call.done
				out <- outcome{call.res, call.err}
			}()
			return out
		})
	})
}
