package deps

import (
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// NotInTransaction says why v, given where the caller's open transaction
// belongs, is not one: a pool, whose every statement commits on its own
// (and may run on another connection), or a connection that is not inside
// a transaction. It returns "" for anything else, which it cannot judge (a
// pgx.Tx, an adapter of a *sql.Tx, a wrapper). Writes meant to commit with
// the caller's own would otherwise commit without them: a command recorded
// as done whose effects a crash then lost, an outbox row for a state change
// that never committed, or the reverse.
func NotInTransaction(v any) string {
	var conn *pgconn.PgConn
	switch c := v.(type) {
	case *pgxpool.Pool:
		return "is a *pgxpool.Pool, whose statements each commit on their own"
	case *pgx.Conn:
		if c.IsClosed() {
			return "is a closed *pgx.Conn"
		}
		conn = c.PgConn()
	case *pgxpool.Conn:
		if conn = PooledPgConn(c); conn == nil {
			return releasedConn
		}
	default:
		return ""
	}
	if conn.TxStatus() == 'I' {
		return "is a connection outside a transaction, whose statements each commit on their own"
	}
	return ""
}

const releasedConn = "is a *pgxpool.Conn already released (or hijacked), which has no connection"

// Released says why v cannot run a statement at all, or returns "": a
// *pgxpool.Conn already released or hijacked, on which pgxpool panics
// instead of returning an error.
func Released(v any) string {
	if c, ok := v.(*pgxpool.Conn); ok && PooledPgConn(c) == nil {
		return releasedConn
	}
	return ""
}

// PooledPgConn returns c's connection, or nil when c was released or
// hijacked: pgxpool's Conn then panics on every method, and exports no
// way to ask first.
func PooledPgConn(c *pgxpool.Conn) (conn *pgconn.PgConn) {
	defer func() {
		if recover() != nil {
			conn = nil
		}
	}()
	return c.Conn().PgConn()
}
