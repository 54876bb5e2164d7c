package testenv

import (
	"context"
	"encoding/json"
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

// PlanNode is a node of EXPLAIN (FORMAT JSON), with the rows it returned
// when EXPLAIN ran with ANALYZE.
type PlanNode struct {
	NodeType     string     `json:"Node Type"`
	Alias        string     `json:"Alias"`
	RelationName string     `json:"Relation Name"`
	IndexName    string     `json:"Index Name"`
	IndexCond    string     `json:"Index Cond"`
	SubplanName  string     `json:"Subplan Name"`
	ActualRows   float64    `json:"Actual Rows"`
	Plans        []PlanNode `json:"Plans"`
}

// ParsePlan returns the root of the plan of an EXPLAIN (FORMAT JSON)
// document of one statement.
func ParsePlan(t testing.TB, doc string) *PlanNode {
	t.Helper()
	var plans []struct{ Plan PlanNode }
	if err := json.Unmarshal([]byte(doc), &plans); err != nil || len(plans) != 1 {
		t.Fatalf("testenv: not the plan of one statement (%v): %s", err, doc)
	}
	return &plans[0].Plan
}

// Find returns the nodes of the tree under n (n included) that match, in
// depth-first order.
func (n *PlanNode) Find(match func(*PlanNode) bool) []*PlanNode {
	var out []*PlanNode
	if match(n) {
		out = append(out, n)
	}
	for i := range n.Plans {
		out = append(out, n.Plans[i].Find(match)...)
	}
	return out
}
