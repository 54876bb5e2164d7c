package versioncache

import (
	"context"
	"errors"
	"sync"
	"time"
)

// errLoadAbandoned is what the callers sharing a load get, wrapped in a
// *LoadError, when the load panicked or its goroutine exited without
// returning.
var errLoadAbandoned = errors.New("the loader panicked or did not return (in the caller that ran the shared load)")

// flightGroup runs one function per key at a time and hands its result to
// every caller that asked for the same key meanwhile. The key always names a
// version, so a caller only ever joins a load that started after the version
// it observed came into being (see Get for why that keeps joiners fresh).
type flightGroup[T any] struct {
	mu    sync.Mutex
	calls map[string]*flightCall[T]
}

type flightCall[T any] struct {
	done chan struct{}
	val  T
	err  error
	// leaderEnded: the ctx of the caller that ran fn had ended when fn
	// returned, so its error, of whatever kind, may be that caller's, not
	// the load's.
	leaderEnded bool
	// joiners counts the callers that found the call in flight and wait
	// for it (guarded by the group's mu).
	joiners int
}

// do runs fn for key unless a run is already in flight, in which case it waits
// for that run (or for ctx). shared reports whether the result came from
// another caller's run (not when ctx ended first: the result is then
// ctx.Err(), this caller's own), and leaderEnded whether that caller's ctx
// had ended by the time its run returned. If fn panics or exits its goroutine, the
// panic or Goexit goes on in the caller that ran it, and the others get a
// *LoadError of id saying so (built only then: a miss allocates nothing for
// it).
func (g *flightGroup[T]) do(ctx context.Context, key, id string, fn func() (T, error)) (val T, shared, leaderEnded bool, err error) {
	g.mu.Lock()
	if g.calls == nil {
		g.calls = make(map[string]*flightCall[T])
	}
	if c, ok := g.calls[key]; ok {
		c.joiners++
		g.mu.Unlock()
		select {
		case <-c.done:
			return c.val, true, c.leaderEnded, c.err
		case <-ctx.Done():
			var zero T
			return zero, false, false, ctx.Err()
		}
	}
	c := &flightCall[T]{done: make(chan struct{})}
	g.calls[key] = c
	g.mu.Unlock()

	finished := false
	defer func() {
		if !finished {
			// fn panicked, or called runtime.Goexit (t.FailNow in a
			// test's loader): the waiters get an error, and the panic or
			// Goexit goes on, as it is, in the caller that ran fn.
			c.err = &LoadError{ID: id, Err: errLoadAbandoned}
			g.release(key, c)
		}
	}()
	c.val, c.err = fn()
	c.leaderEnded = ctxEnded(ctx)
	finished = true
	g.release(key, c)
	return c.val, false, false, c.err
}

// joiners reports how many callers have joined the calls still in flight,
// so that a test can wait for a joiner rather than for time to pass.
func (g *flightGroup[T]) joiners() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	n := 0
	for _, c := range g.calls {
		n += c.joiners
	}
	return n
}

func (g *flightGroup[T]) release(key string, c *flightCall[T]) {
	g.mu.Lock()
	delete(g.calls, key)
	g.mu.Unlock()
	close(c.done)
}

// ctxEnded reports whether ctx is done or past its deadline (which a
// connection can see a moment before ctx itself is done).
func ctxEnded(ctx context.Context) bool {
	if ctx.Err() != nil {
		return true
	}
	deadline, ok := ctx.Deadline()
	return ok && !time.Now().Before(deadline)
}
