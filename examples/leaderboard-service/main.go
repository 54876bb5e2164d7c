// Command leaderboard-service serves a verity leaderboard over HTTP and
// carries the operations an on-call engineer needs, in one binary.
//
//	go run ./examples/leaderboard-service                   # serve (the default)
//	go run ./examples/leaderboard-service stats [--json]    # outbox backlog, dead letters, lag
//	go run ./examples/leaderboard-service reconcile [--sample=N] [--dry-run] [--verify] [--json]
//	go run ./examples/leaderboard-service rebuild [--json]
//	go run ./examples/leaderboard-service replay-dead [--limit=N] [--json]
//
// serve runs an HTTP JSON API over a leaderboard.Board:
//
//	POST /scores              {"user_id","delta"} + Idempotency-Key: <uuid>
//	                          201 applied, 200 duplicate, 409 key reused for
//	                          another command, 422 invalid input
//	GET  /leaderboard         ?limit=&cursor=  entries, freshness, next cursor
//	GET  /users/{id}/rank     ?at_least=<version> for read-your-writes
//	GET  /healthz             PostgreSQL and Redis ping
//	GET  /metrics             Prometheus text, from OpenTelemetry instruments
//	GET  /stats               outbox backlog (cached for a second)
//	GET  /reconcile/last      the last scheduled reconcile report
//	GET  /                    a live page: top 10, submit, rank, freshness
//
// together with the board's projection Worker and a sampled reconcile on a
// schedule (--reconcile-every, --reconcile-sample). --read-policy and
// --max-lag choose what reads do while the projection lags: answer from
// Redis with the lag (serve-stale), answer from PostgreSQL
// (fallback-to-postgres) or answer 503 (fail-closed). SIGINT or SIGTERM stops it gracefully: no new connections,
// in-flight requests finish, the worker settles its batch, every goroutine
// exits. A second SIGINT or SIGTERM ends the process at once.
//
// Each server comes from its flag (--database-url, --redis-url), else its
// variable (DATABASE_URL, REDIS_URL), else the local default port, else a
// private server started from local binaries (which dies with the
// process); a server given by its flag is never looked for elsewhere. With
// --redis-cluster, --redis-url (else REDIS_URL) is a Redis Cluster seed
// list (redis://host1:6379?addr=host2:6379&addr=host3:6379), never a local
// or private server. The board's tables and keys go to --schema (public)
// and --key-prefix (the board's default: verity:lb:, or in another schema
// verity:lb:<schema>:) and stay there: this is a service, not a
// demo that cleans up. Every subcommand runs the board's migration first;
// it is idempotent.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	// The first signal starts a graceful shutdown; stop then restores the
	// signals' default action, so that a second one ends the process at
	// once instead of waiting out in-flight requests.
	context.AfterFunc(ctx, stop)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// Exit codes.
const (
	exitOK    = 0
	exitError = 1
	exitUsage = 2
	// exitNotVerified: reconcile --verify ran its pass but did not record
	// the projection as verified (errNotVerified), so that a script can
	// tell it from a pass that verified (0) and from one that failed (1).
	exitNotVerified = 3
)

// run executes one subcommand and returns the process exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	name, named := "serve", false
	if len(args) > 0 && len(args[0]) > 0 && args[0][0] != '-' {
		name, args, named = args[0], args[1:], true
	}
	cmd, ok := commands[name]
	if !ok {
		fmt.Fprintf(stderr, "leaderboard-service: unknown command %q\n\n", name)
		usage(stderr)
		return exitUsage
	}
	opts, err := parseFlags(name, args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		// Asked for, so not a usage error; a bare -h also lists the
		// commands, since it showed only the default command's flags.
		if !named {
			fmt.Fprintln(stderr)
			usage(stderr)
		}
		return exitOK
	}
	if err != nil {
		return exitUsage
	}
	if err := cmd.run(ctx, opts, stdout, stderr); err != nil {
		fmt.Fprintf(stderr, "leaderboard-service %s: %v\n", name, err)
		switch {
		case errors.As(err, new(usageError)):
			return exitUsage
		case errors.Is(err, errNotVerified):
			return exitNotVerified
		}
		return exitError
	}
	return exitOK
}

type command struct {
	summary string
	run     func(ctx context.Context, opts *options, stdout, stderr io.Writer) error
}

var commands = map[string]command{
	"serve":       {"run the HTTP service, the projection worker and the scheduled reconcile (default)", cmdServe},
	"stats":       {"print the outbox backlog, dead letters and the board's projection lag", cmdStats},
	"reconcile":   {"compare the board's PostgreSQL rows with Redis and repair drift", cmdReconcile},
	"rebuild":     {"rebuild the board's Redis sorted set from PostgreSQL and switch atomically", cmdRebuild},
	"replay-dead": {"move the board's dead-lettered outbox rows back for delivery", cmdReplayDead},
}

var commandOrder = []string{"serve", "stats", "reconcile", "rebuild", "replay-dead"}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: leaderboard-service [command] [flags]")
	fmt.Fprintln(w, "\ncommands:")
	for _, name := range commandOrder {
		fmt.Fprintf(w, "  %-12s %s\n", name, commands[name].summary)
	}
	fmt.Fprintln(w, "\nrun 'leaderboard-service <command> --help' for its flags")
}
