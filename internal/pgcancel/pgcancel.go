// Package pgcancel runs a statement that may wait on the server for a long
// time, such as a migration queued behind another transaction's lock, so
// that the end of its context stops it on the server too.
//
// pgx answers a context's end by returning at once, and closes the
// connection in the background, sending the server a cancel request there.
// Until that request lands the statement runs on: a lock it waited for may
// be granted meanwhile, and the statement commit after the call returned
// its error (the caller's next statement, which the lock held up, can be
// what lets it through). Exec and Run return only once the server has
// taken the request and the statement has ended, unless the server does
// not answer within Grace: then they close the connection and return, and
// the statement may run on until a cancel request reaches it.
package pgcancel

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/verity-go/verity/internal/deps"
)

// Grace bounds how long Exec waits, once its context has ended, for the
// server to answer the cancel request before it closes the connection as
// pgx would have.
const Grace = 2 * time.Second

// Execer is the handle Exec runs a statement on.
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// ErrReleased is returned for a *pgxpool.Conn already released or hijacked,
// on which pgxpool would panic.
var ErrReleased = errors.New("pgcancel: the *pgxpool.Conn was already released (or hijacked)")

// Exec runs sql with args on db and returns its command tag. Without
// arguments pgx uses the simple protocol, which runs several statements in
// one implicit transaction.
//
// When ctx ends before the server has answered and db is a *pgxpool.Pool,
// a *pgxpool.Conn, a *pgx.Conn or a pgx.Tx, Exec stops the statement on the
// server as Run does. Any other db (an adapter of a database/sql
// transaction) runs the statement with its own Exec, whose answer to ctx's
// end is its driver's.
func Exec(ctx context.Context, db Execer, sql string, args ...any) (pgconn.CommandTag, error) {
	var tag pgconn.CommandTag
	on := func(db Execer) func(context.Context) error {
		return func(ctx context.Context) (err error) {
			tag, err = db.Exec(ctx, sql, args...)
			return err
		}
	}
	switch d := db.(type) {
	case *pgxpool.Pool:
		c, err := d.Acquire(ctx)
		if err != nil {
			return tag, err
		}
		defer c.Release()
		return tag, Run(ctx, c.Conn().PgConn(), on(c))
	case *pgxpool.Conn:
		pc := deps.PooledPgConn(d)
		if pc == nil {
			return tag, ErrReleased
		}
		return tag, Run(ctx, pc, on(d))
	case *pgx.Conn:
		if !d.IsClosed() {
			return tag, Run(ctx, d.PgConn(), on(d))
		}
	case pgx.Tx:
		if c := d.Conn(); c != nil && !c.IsClosed() {
			return tag, Run(ctx, c.PgConn(), on(d))
		}
	}
	return db.Exec(ctx, sql, args...)
}

// Run calls f, which sends statements on pc's connection with the context
// it is given. When ctx ends before f returns, Run sends the server a
// cancel request and waits up to Grace for f to return; only then does it
// close the connection (and the statement may run on until pgx's own
// cancel request, sent as it closes, lands). It returns once f has
// returned, with f's error wrapped with ctx's error (and its cause, if the
// caller gave one), or nil if the statement finished before the request
// reached it. A statement cancelled in the caller's transaction
// leaves that transaction aborted.
func Run(ctx context.Context, pc *pgconn.PgConn, f func(context.Context) error) error {
	if ctx.Err() != nil {
		return ended(ctx, nil)
	}
	// f runs on a context that ctx's end does not reach, so that pgx keeps
	// the connection open while the server answers.
	fctx, closeConn := context.WithCancel(context.WithoutCancel(ctx))
	defer closeConn()
	done := make(chan error, 1)
	go func() { done <- f(fctx) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	graceCtx, cancelGrace := context.WithTimeout(context.Background(), Grace)
	defer cancelGrace()
	// Best effort: a request that cannot be sent leaves the statement to
	// the connection's closing below. CancelRequest returns once the server
	// has taken the request, so it cannot reach a statement sent after Run
	// returns.
	_ = pc.CancelRequest(graceCtx)
	var err error
	select {
	case err = <-done:
	case <-graceCtx.Done():
		closeConn()
		err = <-done
	}
	if err == nil {
		return nil
	}
	return ended(ctx, err)
}

// ended returns ctx's error, with the caller's cause if one was given, and
// err (the statement's) if not nil.
func ended(ctx context.Context, err error) error {
	cause := context.Cause(ctx)
	switch {
	case cause != ctx.Err() && err != nil:
		return fmt.Errorf("%w (%w): %w", ctx.Err(), cause, err)
	case cause != ctx.Err():
		return fmt.Errorf("%w (%w)", ctx.Err(), cause)
	case err != nil:
		return fmt.Errorf("%w: %w", ctx.Err(), err)
	}
	return ctx.Err()
}
