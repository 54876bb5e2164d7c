// Command failure-experiment reproduces the leaderboard failure experiment
// against real PostgreSQL and Redis: a duplicated command, a stopped worker,
// a hand-corrupted Redis score, and the reconciliation that repairs it.
//
//	go run ./examples/failure-experiment [--json]
//
// It exits 0 when the experiment reproduced the expected outcome, 1 when
// it did not or could not run, and 2 on a usage error (an unknown flag, a
// stray argument).
//
// It finds the servers like the test harness does (DATABASE_URL / REDIS_URL,
// then the local default ports, then private servers from local binaries,
// then Docker), works in its own schema and key prefix, and removes both
// when it ends, also on Ctrl-C or SIGTERM.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"text/tabwriter"

	"github.com/verity-go/verity/internal/services"
)

func main() {
	asJSON, err := parseFlags(os.Args[1:], os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return // -h: the flags were printed; asked for, not a failure
	} else if err != nil {
		os.Exit(2) // a usage error, already reported
	}

	// SIGTERM too (timeout(1), CI cancellation, kill): either way the run
	// ends through its cleanup and drops its schema and keys.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Stdout, asJSON); err != nil {
		fmt.Fprintln(os.Stderr, "failure-experiment:", err)
		os.Exit(1)
	}
}

// parseFlags reads the command line. A usage error is reported on stderr
// with the flags, before anything connects.
func parseFlags(args []string, stderr io.Writer) (asJSON bool, err error) {
	fs := flag.NewFlagSet("failure-experiment", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.BoolVar(&asJSON, "json", false, "print the report as JSON")
	if err := fs.Parse(args); err != nil {
		return false, err
	}
	// failure-experiment takes no arguments: one is a flag typed without
	// its dashes ("json" for --json), not to be ignored.
	if fs.NArg() > 0 {
		err := fmt.Errorf("unexpected argument %q", fs.Arg(0))
		fmt.Fprintln(stderr, "failure-experiment:", err)
		fs.Usage()
		return false, err
	}
	return asJSON, nil
}

func run(ctx context.Context, out io.Writer, asJSON bool) error {
	ep, err := services.Resolve(ctx, services.Options{})
	if err != nil {
		return err
	}
	defer ep.Close()
	report, err := Run(ctx, Options{PostgresURL: ep.PostgresURL, RedisURL: ep.RedisURL})
	if err != nil {
		return err
	}
	if asJSON {
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		err = enc.Encode(report)
	} else {
		err = printTable(out, report)
	}
	if err != nil {
		return err
	}
	// The table is printed either way; a result other than the seed's is
	// a failure of the run, not just a line in it.
	if err := report.Check(); err != nil {
		return fmt.Errorf("the experiment did not reproduce the expected outcome: %w", err)
	}
	return nil
}

// printTable renders the report as the experiment's table.
func printTable(out io.Writer, r *Report) error {
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "Stage\tPostgreSQL source\tRedis projection\tResult")
	for _, st := range r.Stages {
		var src, proj []string
		for _, u := range sortedUsers(st.Source) {
			src = append(src, fmt.Sprintf("%s %d (v%d)", u, st.Source[u].Score, st.Source[u].Version))
		}
		for _, u := range sortedUsers(st.Projection) {
			proj = append(proj, fmt.Sprintf("%s %d", u, st.Projection[u]))
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", st.Name, orNone(src), orNone(proj), st.Result)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(out, "\nreconcile: %d checked, %d current, %d corrupt, %d repaired\n",
		r.Reconcile.Checked, r.Reconcile.Current, r.Reconcile.Corrupt, r.Reconcile.Repaired)
	fmt.Fprintf(out, "final ordering identical in PostgreSQL and Redis: %t\n", r.OrderingMatch)
	return nil
}

func orNone(items []string) string {
	if len(items) == 0 {
		return "(empty)"
	}
	return strings.Join(items, ", ")
}
