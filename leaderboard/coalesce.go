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
// that finds a statement free and nobody queued is sent at once, alone,
// by its own goroutine (taking a flusher's place meanwhile), so a lone
// client pays no added latency, and groups form only while statements are
// in flight, which is when sharing a commit pays.
//
// A flusher is a goroutine that lives only while commands are queued, as
// the board's Notifier's does: a board that is dropped leaves none behind.
// Sending a lone call from its caller spares it the hand-off to a flusher
// and back: one client ran 2,620-2,640 Submits/s against 2,240-2,520, two
// 3,420-3,450 against 3,140-3,230; eight, grouped, about the same.
type submitGroup struct {
	b          *Board
	stallAfter time.Duration // submitStallAfter; tests change it

	mu       sync.Mutex
	queue    []*submitCall
	flushers int // flushers counted against SubmitStatements
	// inFlight holds a channel per statement under way, closed when it is
	// done: Close waits for those it finds, not for later traffic.
	inFlight map[chan struct{}]struct{}
}

// submitStallAfter is how long a shared statement may run before its
// flusher stops counting against Config.SubmitStatements and another may
// start, so that a slow statement does not hold up the calls queued after
// it.
const submitStallAfter = 50 * time.Millisecond

// submitLockTimeout is a shared statement's lock_timeout (see apply).
const submitLockTimeout = 50 * time.Millisecond

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

// submit queues cmd (validated) and waits for its outcome or ctx, or, with
// a statement free and nobody queued, applies it itself. A call whose ctx
// ends before its statement is sent (queued, or taken into a group that
// waits for a connection) is dropped and writes nothing; a call whose ctx
// ends after its statement was sent returns ctx's error (unless
// its own goroutine saw the statement succeed), and its command may or may
// not commit, as for any statement cancelled in flight (retrying with the
// same event id is safe).
func (g *submitGroup) submit(ctx context.Context, cmd Command) (Result, error) {
	if err := ctx.Err(); err != nil {
		return Result{}, err
	}
	call := &submitCall{ctx: ctx, cmd: cmd, done: make(chan struct{})}
	g.mu.Lock()
	if len(g.queue) == 0 && g.flushers < g.b.cfg.SubmitStatements {
		// A statement is free and nobody waits: this goroutine sends the
		// command itself, sparing the call a hand-off to a flusher and back.
		g.flushers++
		call.state.Store(callTaken)
		done := g.underWayLocked()
		g.mu.Unlock()
		g.applyAlone(call, done)
		if call.err != nil && ctx.Err() != nil {
			return Result{}, ctx.Err()
		}
		return call.res, call.err
	}
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
		go g.flush()
	}
}

// flush applies queued commands until the queue is empty, or until one of
// its statements stalls and another flusher took its place.
func (g *submitGroup) flush() {
	for {
		// The callers the previous statement answered are runnable now;
		// letting them run first lets the next group include the commands
		// they submit straight away, instead of leaving them for the next
		// round trip. It costs a lone caller well under a microsecond.
		runtime.Gosched()
		calls, done := g.take()
		if len(calls) == 0 {
			return
		}
		stalled := g.apply(calls)
		g.mu.Lock()
		delete(g.inFlight, done)
		g.mu.Unlock()
		close(done)
		if stalled {
			return
		}
	}
}

// take removes up to MaxSubmitsPerStatement live calls from the queue and
// records their statement as under way (done is closed when it is over)
// or, when there are none, retires the flusher. A call whose ctx has ended
// is dropped here even if its caller has not noticed yet: it must write
// nothing.
func (g *submitGroup) take() (calls []*submitCall, done chan struct{}) {
	g.mu.Lock()
	defer g.mu.Unlock()
	n := 0
	for n < len(g.queue) && len(calls) < g.b.cfg.MaxSubmitsPerStatement {
		call := g.queue[n]
		g.queue[n] = nil
		n++
		if err := call.ctx.Err(); err != nil {
			if call.state.CompareAndSwap(callQueued, callAbandoned) {
				call.finish(Result{}, err)
			}
			continue
		}
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
		return nil, nil
	}
	return calls, g.underWayLocked()
}

// track records a statement that a caller sends itself (grouping off,
// SubmitBatch) as under way, so that Close waits for it too, and returns
// the function that ends it.
func (g *submitGroup) track() (done func()) {
	g.mu.Lock()
	ch := g.underWayLocked()
	g.mu.Unlock()
	return func() {
		g.mu.Lock()
		delete(g.inFlight, ch)
		g.mu.Unlock()
		close(ch)
	}
}

// underWayLocked records a statement as under way and returns the channel
// to close when it is done. g.mu must be held.
func (g *submitGroup) underWayLocked() chan struct{} {
	done := make(chan struct{})
	if g.inFlight == nil {
		g.inFlight = make(map[chan struct{}]struct{})
	}
	g.inFlight[done] = struct{}{}
	return done
}

// applyAlone applies call, taken by submit itself with a flusher's place
// counted, as a statement of its own; then it gives the place back, or
// hands it to a flusher for the calls queued meanwhile.
func (g *submitGroup) applyAlone(call *submitCall, done chan struct{}) {
	stalled := g.applyOrRelease(call, done)
	g.mu.Lock()
	delete(g.inFlight, done)
	if !stalled { // a stalled statement's place was given back already
		g.flushers--
		g.startFlusherLocked()
	}
	g.mu.Unlock()
	close(done)
}

// applyOrRelease applies call alone; if apply panics or calls
// runtime.Goexit (a pgx tracer or pool hook: either goes on in the caller),
// the statement is no longer under way, and apply gave its place back.
func (g *submitGroup) applyOrRelease(call *submitCall, done chan struct{}) bool {
	ok := false
	defer func() {
		if !ok {
			g.mu.Lock()
			delete(g.inFlight, done)
			g.mu.Unlock()
			close(done)
		}
	}()
	stalled := g.apply([]*submitCall{call})
	ok = true
	return stalled
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
//
// The statement waits for no lock longer than submitLockTimeout: a command whose
// user's row is locked by a caller's transaction would otherwise hold up
// the others, and a caller that holds that lock while it waits for a
// Submit of another user in the same group would wait for itself. On a
// lock timeout the commands are applied on their own, concurrently, so
// that only the command that needs the lock waits for it.
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
	returned := false
	defer func() {
		timer.Stop()
		if !returned {
			// A panic (a pgx tracer or hook) or runtime.Goexit goes on in
			// the caller: give the place back now, as a stalled
			// statement's is.
			if state.CompareAndSwap(running, released) {
				g.mu.Lock()
				g.flushers--
				g.startFlusherLocked()
				g.mu.Unlock()
			}
			return
		}
		stalled = !state.CompareAndSwap(running, done)
	}()
	g.applyCalls(calls)
	returned = true
	return
}

// applyCalls is apply's statement.
func (g *submitGroup) applyCalls(calls []*submitCall) {
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
	// A call whose ctx ends before its statement is sent must write
	// nothing, as it would alone; the wait that matters is the one for a
	// connection, which an exhausted pool can make long. So the group takes
	// its connection first and only then settles who is in.
	conn, err := g.b.pool.Acquire(ctx)
	if err != nil {
		for _, call := range calls {
			call.finish(Result{}, g.b.dbError("submit", err))
		}
		return
	}
	calls = dropEnded(calls)
	if len(calls) == 0 {
		conn.Release()
		return
	}
	cmds := make([]Command, len(calls))
	for i, call := range calls {
		cmds[i] = call.cmd
	}
	out, err := g.b.submitBatch(ctx, cmds, batchOptions{everyState: true, lockTimeout: submitLockTimeout, conn: conn, group: true})
	conn.Release() // before the fallback below, which takes connections of its own
	switch {
	case err == nil:
		for i, call := range calls {
			call.finish(out[i], nil)
		}
	case commandError(err):
		var wg sync.WaitGroup
		for _, call := range calls {
			wg.Go(func() { call.finish(g.b.submitOne(call.ctx, call.cmd)) })
		}
		wg.Wait()
	default:
		for _, call := range calls {
			call.finish(Result{}, err)
		}
	}
}

// dropEnded finishes the calls whose ctx has ended with its error (their
// callers have returned it, or will) and returns the others.
func dropEnded(calls []*submitCall) []*submitCall {
	live := calls[:0]
	for _, call := range calls {
		if err := call.ctx.Err(); err != nil {
			call.finish(Result{}, err)
			continue
		}
		live = append(live, call)
	}
	return live
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
		errors.Is(err, ErrIdempotencyConflict) || isUniqueViolation(err) ||
		isDeadlock(err) || isLockTimeout(err) || isVersionOverflow(err)
}

// wait returns once the statements under way when it was called are done.
// Calls queued meanwhile are applied later, as usual: their callers are
// still waiting for them.
func (g *submitGroup) wait() {
	g.mu.Lock()
	pending := make([]chan struct{}, 0, len(g.inFlight))
	for done := range g.inFlight {
		pending = append(pending, done)
	}
	g.mu.Unlock()
	for _, done := range pending {
		<-done
	}
}
