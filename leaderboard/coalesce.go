package leaderboard

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// A submitGroup coalesces concurrent Submit calls into shared statements:
// group commit. Each call queues its command; up to
// Config.SubmitStatements flushers take whatever is queued (at most
// Config.MaxSubmitsPerStatement commands) and apply it in one statement,
// one transaction and one WAL flush. Nothing waits for company: a call
// that finds a flusher free is sent at once, alone, so a lone client pays
// no added latency, and groups form only while statements are in flight,
// which is when sharing a commit pays.
//
// A flusher is a goroutine that lives only while commands are queued, as
// the board's Notifier's does: a board that is dropped leaves none behind.
type submitGroup struct {
	b          *Board
	stallAfter time.Duration // submitStallAfter; tests change it

	mu       sync.Mutex
	queue    []*submitCall
	flushers int            // flushers counted against SubmitStatements
	running  sync.WaitGroup // every flusher, stalled ones included
}

// submitStallAfter is how long a shared statement may run before its
// flusher stops counting against Config.SubmitStatements and another may
// start. A statement that long is waiting, usually for a row lock held by
// a caller's transaction (SubmitTx); without this, the Submit calls of
// every other user would queue behind it.
const submitStallAfter = 50 * time.Millisecond

// submitCall is one queued Submit.
type submitCall struct {
	ctx   context.Context
	cmd   Command
	state atomic.Int32 // callQueued, callTaken or callAbandoned
	done  chan struct{}
	res   Result
	err   error
}

const (
	callQueued int32 = iota
	callTaken
	callAbandoned
)

// submit queues cmd (validated) and waits for its outcome or ctx. A call
// whose ctx ends while it is still queued is dropped and writes nothing; a
// call whose ctx ends after its statement was sent returns ctx's error,
// and its command may or may not commit, as for any statement cancelled
// in flight (retrying with the same event id is safe).
func (g *submitGroup) submit(ctx context.Context, cmd Command) (Result, error) {
	if err := ctx.Err(); err != nil {
		return Result{}, err
	}
	call := &submitCall{ctx: ctx, cmd: cmd, done: make(chan struct{})}
	g.mu.Lock()
	g.queue = append(g.queue, call)
	g.startFlusherLocked()
	g.mu.Unlock()
	select {
	case <-call.done:
		return call.res, call.err
	case <-ctx.Done():
		if call.state.CompareAndSwap(callQueued, callAbandoned) {
			return Result{}, ctx.Err()
		}
		select { // taken: the statement may be running or done
		case <-call.done:
			return call.res, call.err
		default:
			return Result{}, ctx.Err()
		}
	}
}

// startFlusherLocked starts a flusher if commands are queued and fewer
// than SubmitStatements flushers count. g.mu must be held.
func (g *submitGroup) startFlusherLocked() {
	if len(g.queue) > 0 && g.flushers < g.b.cfg.SubmitStatements {
		g.flushers++
		g.running.Add(1)
		go g.flush()
	}
}

// flush applies queued commands until the queue is empty, or until one of
// its statements stalls and another flusher took its place.
func (g *submitGroup) flush() {
	defer g.running.Done()
	for {
		// The callers the previous statement answered are runnable now;
		// letting them run first lets the next group include the commands
		// they submit straight away, instead of leaving them for the next
		// round trip. It costs a lone caller well under a microsecond.
		runtime.Gosched()
		calls := g.take()
		if len(calls) == 0 {
			return
		}
		if stalled := g.apply(calls); stalled {
			return
		}
	}
}

// take removes up to MaxSubmitsPerStatement live calls from the queue or,
// when there are none, retires the flusher.
func (g *submitGroup) take() []*submitCall {
	g.mu.Lock()
	defer g.mu.Unlock()
	var calls []*submitCall
	n := 0
	for n < len(g.queue) && len(calls) < g.b.cfg.MaxSubmitsPerStatement {
		call := g.queue[n]
		g.queue[n] = nil
		n++
		if call.state.CompareAndSwap(callQueued, callTaken) {
			calls = append(calls, call)
		}
	}
	g.queue = g.queue[n:]
	if len(g.queue) == 0 {
		g.queue = nil // let the backing array go
	}
	if len(calls) == 0 {
		g.flushers--
	}
	return calls
}

// apply runs calls in one statement and reports whether it stalled (ran
// longer than submitStallAfter, after which the flusher no longer counts
// and must retire).
//
// The statement runs under a context that ends when every caller's has
// (it keeps the first caller's values, for tracing). When it fails because
// of one command — a reused event id, a score out of range — it wrote
// nothing, and each command is applied on its own, so that every caller
// gets the outcome its command would have had alone. Any other failure
// (the database is unreachable, say) is every caller's.
func (g *submitGroup) apply(calls []*submitCall) (stalled bool) {
	const running, done, released = 0, 1, 2
	var state atomic.Int32
	timer := time.AfterFunc(g.stallAfter, func() {
		if state.CompareAndSwap(running, released) {
			g.mu.Lock()
			g.flushers--
			g.startFlusherLocked()
			g.mu.Unlock()
		}
	})
	defer func() {
		timer.Stop()
		stalled = !state.CompareAndSwap(running, done)
	}()

	ctx, cancel := context.WithCancel(context.WithoutCancel(calls[0].ctx))
	defer cancel()
	var live atomic.Int64
	live.Store(int64(len(calls)))
	for _, call := range calls {
		stop := context.AfterFunc(call.ctx, func() {
			if live.Add(-1) == 0 {
				cancel()
			}
		})
		defer stop()
	}

	if len(calls) == 1 {
		calls[0].finish(g.b.submitOne(ctx, calls[0].cmd))
		return
	}
	cmds := make([]Command, len(calls))
	for i, call := range calls {
		cmds[i] = call.cmd
	}
	out, err := g.b.submitBatch(ctx, cmds, true)
	switch {
	case err == nil:
		for i, call := range calls {
			call.finish(out[i], nil)
		}
	case commandError(err):
		for _, call := range calls {
			call.finish(g.b.submitOne(call.ctx, call.cmd))
		}
	default:
		for _, call := range calls {
			call.finish(Result{}, err)
		}
	}
	return
}

// finish delivers the outcome of call.
func (c *submitCall) finish(res Result, err error) {
	c.res, c.err = res, err
	close(c.done)
}

// commandError reports a failure of a shared statement that one of its
// commands may have caused, after which applying each on its own gives
// every caller its own outcome. The statement wrote nothing.
func commandError(err error) bool {
	var conflict *IdempotencyConflictError
	var overflow *ScoreOutOfRangeError
	return errors.As(err, &conflict) || errors.As(err, &overflow) ||
		errors.Is(err, ErrIdempotencyConflict) || isUniqueViolation(err) || isDeadlock(err)
}

// wait returns once no flusher runs.
func (g *submitGroup) wait() { g.running.Wait() }
