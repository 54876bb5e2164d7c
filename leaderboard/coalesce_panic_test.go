package leaderboard

import (
	"context"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
)

// panickyTracer panics once, when armed, as the next pool connection is
// acquired (before one is taken), or, with inQuery, as the next statement
// starts (on a connection taken); or, with goexit, ends the goroutine with
// runtime.Goexit, as t.FailNow in a tracer would.
type panickyTracer struct {
	armed   atomic.Bool
	goexit  bool
	inQuery bool
}

func (p *panickyTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	if p.inQuery {
		p.fire()
	}
	return ctx
}

func (p *panickyTracer) fire() {
	if p.armed.CompareAndSwap(true, false) {
		if p.goexit {
			runtime.Goexit()
		}
		panic("tracer panic")
	}
}

func (p *panickyTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (p *panickyTracer) TraceAcquireStart(ctx context.Context, _ *pgxpool.Pool, _ pgxpool.TraceAcquireStartData) context.Context {
	if !p.inQuery {
		p.fire()
	}
	return ctx
}
func (p *panickyTracer) TraceAcquireEnd(context.Context, *pgxpool.Pool, pgxpool.TraceAcquireEndData) {
}

// TestSubmitAfterARecoveredPanic: a panic in an application's pgx tracer
// during a lone Submit (sent on its caller's goroutine) reaches the caller,
// which recovers it (net/http does, for a handler). The statement stayed
// registered as under way, and its place in SubmitStatements taken: Close
// waited for ever, and with one place every later Submit queued with no
// one to send it. A runtime.Goexit there kept the place too.
func TestSubmitAfterARecoveredPanic(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		statements int
		goexit     bool
	}{{"OnePlace", 1, false}, {"Default", 0, false}, {"GoexitOnePlace", 1, true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tb := setup(t)
			tr := &panickyTracer{goexit: tc.goexit}
			pool := tb.newPool(t, func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = tr })
			cfg := tb.board.Config()
			cfg.SubmitStatements = tc.statements
			board, err := New(pool, tb.rd.Client, &cfg)
			require.NoError(t, err)

			tr.armed.Store(true)
			if tc.goexit {
				exited := make(chan struct{})
				go func() {
					defer close(exited)
					_, _ = board.Submit(context.Background(), Command{EventID: uuid.New(), UserID: "user-a", Delta: 1})
				}()
				<-exited
			} else {
				func() {
					defer func() { require.NotNil(t, recover(), "the tracer's panic reaches the caller") }()
					_, _ = board.Submit(context.Background(), Command{EventID: uuid.New(), UserID: "user-a", Delta: 1})
				}()
			}

			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			res, err := board.Submit(ctx, Command{EventID: uuid.New(), UserID: "user-b", Delta: 1})
			require.NoError(t, err, "a Submit after the recovered panic is sent")
			require.EqualValues(t, 1, res.Score)

			closed := make(chan struct{})
			go func() { board.Close(); close(closed) }()
			select {
			case <-closed:
			case <-time.After(10 * time.Second):
				t.Fatal("Board.Close waits for the statement that panicked")
			}
		})
	}
}

// TestSubmitAfterAQueryTracerPanic: a panic (or runtime.Goexit) in an
// application's tracer as a lone Submit's statement starts, on a
// connection the pool has handed out. pgxpool's QueryRow gives the
// connection back only in Scan: the pool lost it for good, and with one
// connection every later Submit waited for its ctx and pool.Close for
// ever. The connection is back in the pool, and the board usable.
func TestSubmitAfterAQueryTracerPanic(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		goexit bool
	}{{"Panic", false}, {"Goexit", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tb := setup(t)
			tr := &panickyTracer{goexit: tc.goexit, inQuery: true}
			pc, err := pgxpool.ParseConfig(tb.pg.ConnString)
			require.NoError(t, err)
			pc.MaxConns = 1
			pc.ConnConfig.Tracer = tr
			pool, err := pgxpool.NewWithConfig(context.Background(), pc)
			require.NoError(t, err)
			t.Cleanup(func() { go pool.Close() }) // a lost connection makes Close wait for ever
			cfg := tb.board.Config()
			board, err := New(pool, tb.rd.Client, &cfg)
			require.NoError(t, err)

			tr.armed.Store(true)
			ended := make(chan any, 1)
			go func() {
				defer func() { ended <- recover() }()
				_, _ = board.Submit(context.Background(), Command{EventID: uuid.New(), UserID: "user-a", Delta: 1})
			}()
			if got := <-ended; !tc.goexit {
				require.NotNil(t, got, "the tracer's panic reaches the caller")
			}
			require.Zero(t, pool.Stat().AcquiredConns(), "the connection is back in the pool")

			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			res, err := board.Submit(ctx, Command{EventID: uuid.New(), UserID: "user-b", Delta: 1})
			require.NoError(t, err, "a Submit after the panic is sent")
			require.EqualValues(t, 1, res.Score)
			board.Close()
		})
	}
}
