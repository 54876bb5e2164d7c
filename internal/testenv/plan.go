package testenv

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
)

// Plan returns PostgreSQL's plan for sql with args, as EXPLAIN (FORMAT
// format) prints it, its rows joined by newlines. It plans on a connection
// of its own, for a prepared statement with plan_cache_mode forced: the
// custom plan made for these argument values or, with generic, the generic
// plan a statement cached by pgx switches to after five runs. Nothing is
// executed.
func Plan(t testing.TB, connString string, generic bool, format, sql string, args ...any) string {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, connString)
	if err != nil {
		t.Fatalf("testenv: plan: %v", err)
	}
	defer func() { _ = conn.Close(ctx) }()
	mode := "force_custom_plan"
	if generic {
		mode = "force_generic_plan"
	}
	if _, err := conn.Exec(ctx, `SET plan_cache_mode = `+mode); err != nil {
		t.Fatalf("testenv: plan: %v", err)
	}
	if _, err := conn.Prepare(ctx, "planned", `EXPLAIN (FORMAT `+format+`) `+sql); err != nil {
		t.Fatalf("testenv: plan: %v", err)
	}
	rows, err := conn.Query(ctx, "planned", args...)
	if err != nil {
		t.Fatalf("testenv: plan: %v", err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatalf("testenv: plan: %v", err)
	}
	return strings.Join(lines, "\n")
}
