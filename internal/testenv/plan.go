package testenv

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
)

// Plan returns PostgreSQL's plan for sql with args, as EXPLAIN (FORMAT
// format) prints it, its rows joined by newlines. It plans on a connection
// of its own: the custom plan made for these argument values or, with
// generic, the generic plan a statement cached by pgx switches to after
// five runs. Nothing is executed.
//
// The generic plan is the one EXPLAIN EXECUTE prints for sql prepared
// (PREPARE) under plan_cache_mode force_generic_plan: EXPLAIN of sql
// itself, even as a prepared statement, plans it with its parameters'
// values, whatever plan_cache_mode says. Plan fails the test unless
// pg_prepared_statements counts the generic plan.
func Plan(t testing.TB, connString string, generic bool, format, sql string, args ...any) string {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, connString)
	if err != nil {
		t.Fatalf("testenv: plan: %v", err)
	}
	defer func() { _ = conn.Close(ctx) }()
	var rows pgx.Rows
	if generic {
		if _, err := conn.Exec(ctx, `SET plan_cache_mode = force_generic_plan`); err != nil {
			t.Fatalf("testenv: plan: %v", err)
		}
		if _, err := conn.Exec(ctx, `PREPARE planned AS `+sql); err != nil {
			t.Fatalf("testenv: plan: %v", err)
		}
		params := make([]string, len(args))
		for i := range args {
			params[i] = fmt.Sprintf("$%d", i+1)
		}
		// The simple protocol sends the arguments as literals of EXECUTE,
		// which casts them to the prepared statement's parameter types.
		rows, err = conn.Query(ctx, `EXPLAIN (FORMAT `+format+`) EXECUTE planned(`+strings.Join(params, ", ")+`)`,
			append([]any{pgx.QueryExecModeSimpleProtocol}, args...)...)
	} else {
		rows, err = conn.Query(ctx, `EXPLAIN (FORMAT `+format+`) `+sql, args...)
	}
	if err != nil {
		t.Fatalf("testenv: plan: %v", err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatalf("testenv: plan: %v", err)
	}
	if generic {
		var plans int64
		if err := conn.QueryRow(ctx, `SELECT generic_plans FROM pg_prepared_statements WHERE name = 'planned'`).Scan(&plans); err != nil {
			t.Fatalf("testenv: plan: %v", err)
		}
		if plans == 0 {
			t.Fatalf("testenv: plan: PostgreSQL made no generic plan")
		}
	}
	return strings.Join(lines, "\n")
}
