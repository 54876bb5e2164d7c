package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// SQLTx adapts a database/sql transaction to Tx, so that applications on
// database/sql can append to the outbox in their own transactions. The
// transaction must come from the pgx driver (github.com/jackc/pgx/v5/stdlib,
// driver name "pgx"), which passes the outbox's array arguments through to
// pgx unchanged; other drivers are not supported. SQLTx(nil) is a nil Tx,
// which every method taking a Tx refuses.
func SQLTx(tx *sql.Tx) Tx {
	if tx == nil {
		return nil
	}
	return sqlTx{tx: tx}
}

type sqlTx struct{ tx *sql.Tx }

var _ Tx = sqlTx{}

// Exec runs the statement. database/sql does not expose the server's command
// tag, so the returned tag carries only the number of rows affected
// ("EXEC n"): RowsAffected works, Insert/Update/Delete/Select report false.
func (s sqlTx) Exec(ctx context.Context, query string, args ...any) (pgconn.CommandTag, error) {
	res, err := s.tx.ExecContext(ctx, query, args...)
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	n, err := res.RowsAffected()
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	return pgconn.NewCommandTag(fmt.Sprintf("EXEC %d", n)), nil
}

// QueryRow runs the query; its Scan reports pgx.ErrNoRows (which also
// matches sql.ErrNoRows) when there is no row.
func (s sqlTx) QueryRow(ctx context.Context, query string, args ...any) pgx.Row {
	return sqlRow{row: s.tx.QueryRowContext(ctx, query, args...)}
}

type sqlRow struct{ row *sql.Row }

func (r sqlRow) Scan(dest ...any) error {
	err := r.row.Scan(dest...)
	if errors.Is(err, sql.ErrNoRows) {
		return pgx.ErrNoRows
	}
	return err
}
