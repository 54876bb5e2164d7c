package versioncache

import (
	"context"
	"errors"
	"sync"
)

// errLoadAbandoned is what the callers sharing a load get when the load
// panicked or its goroutine exited without returning.
var errLoadAbandoned = errors.New("versioncache: the shared load panicked or exited without returning")

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
}

// do runs fn for key unless a run is already in flight, in which case it waits
// for that run (or for ctx). shared reports whether the result came from
// another caller's run.
func (g *flightGroup[T]) do(ctx context.Context, key string, fn func() (T, error)) (val T, shared bool, err error) {
	g.mu.Lock()
	if g.calls == nil {
		g.calls = make(map[string]*flightCall[T])
	}
	if c, ok := g.calls[key]; ok {
		g.mu.Unlock()
		select {
		case <-c.done:
			return c.val, true, c.err
		case <-ctx.Done():
			var zero T
			return zero, true, ctx.Err()
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
			c.err = errLoadAbandoned
			g.release(key, c)
		}
	}()
	c.val, c.err = fn()
	finished = true
	g.release(key, c)
	return c.val, false, c.err
}

func (g *flightGroup[T]) release(key string, c *flightCall[T]) {
	g.mu.Lock()
	delete(g.calls, key)
	g.mu.Unlock()
	close(c.done)
}
