package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// runMainEnv, set to the command's arguments (space-separated), makes the
// test binary run main with them instead of its tests: the signal test
// starts the command as a child process.
const runMainEnv = "RACE_TEST_RUN_MAIN"

// TestMain fails the package's tests if any goroutine outlives them.
func TestMain(m *testing.M) {
	if args, ok := os.LookupEnv(runMainEnv); ok {
		os.Args = append([]string{"race-test"}, strings.Fields(args)...)
		main()
		os.Exit(0)
	}
	testenv.Main(m)
}

func TestHelpIsNotAnError(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	require.NoError(t, mainErr([]string{"-h"}, &out))
	require.Empty(t, out.String(), "-h ran the race")
}

// TestUsageErrors: a command line race-test cannot run as asked — a stray
// argument (a flag typed without its dashes), an unknown flag, a bad value
// — exits 2 before anything connects, as leaderboard-service does, instead
// of running with the defaults or failing like a run (exit 1).
func TestUsageErrors(t *testing.T) {
	t.Parallel()
	// Flags that keep a run short, should one start.
	short := []string{"--readers=1", "--writers=1", "--seconds=0.05", "--mode=versioned"}
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"StrayArgument", slices.Concat(short, []string{"naive"}), `unexpected argument "naive"`},
		{"StrayArgumentAfterFlagTerminator", slices.Concat(short, []string{"--", "--mode=naive"}), `unexpected argument "--mode=naive"`},
		{"UnknownFlag", slices.Concat(short, []string{"--nope"}), "flag provided but not defined"},
		{"BadValue", slices.Concat(short, []string{"--readers=0"}), "--readers must be from 1 to 10000"},
		// Sized into the Redis pool, these panicked in redis.NewClient
		// after the servers were resolved.
		{"TooManyReaders", slices.Concat(short, []string{"--readers=4611686018427387904"}), "--readers must be from 1 to 10000"},
		{"TooManyWriters", slices.Concat(short, []string{"--writers=3000000000"}), "--writers must be from 1 to 10000"},
		// Converted to a time.Duration, these overflowed into a negative
		// length, and the message said "must be positive".
		{"TooManySeconds", slices.Concat(short, []string{"--seconds=1e10"}), "--seconds must be above 0 and at most 604800"},
		{"NaNSeconds", slices.Concat(short, []string{"--seconds=NaN"}), "--seconds must be above 0 and at most 604800"},
		{"ZeroSeconds", slices.Concat(short, []string{"--seconds=0"}), "--seconds must be above 0 and at most 604800"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var out bytes.Buffer
			err := mainErr(tc.args, &out)
			require.ErrorContains(t, err, tc.want)
			require.ErrorAs(t, err, new(usageError))
			require.Empty(t, out.String(), "the race ran")
		})
	}

	t.Run("ExitsTwo", func(t *testing.T) {
		t.Parallel()
		cmd := exec.Command(os.Args[0])
		cmd.Env = append(os.Environ(), runMainEnv+"="+strings.Join(slices.Concat(short, []string{"naive"}), " "))
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		var exitErr *exec.ExitError
		require.True(t, errors.As(err, &exitErr), "exit status 0; stdout: %s", stdout.String())
		require.Equal(t, 2, exitErr.ExitCode(), "stderr: %s", stderr.String())
		require.Contains(t, stderr.String(), `race-test: unexpected argument "naive"`)
		require.Empty(t, stdout.String(), "the race ran")
	})
}

// childRun is the command run as a child process by startChildRun, once
// it has created its table and filled its cache.
type childRun struct {
	cmd    *exec.Cmd
	done   chan error // cmd.Wait's result, put back by whoever takes it
	stderr *bytes.Buffer
	table  string // schema.table, as pg_tables names it
	ident  string // the table, quoted
	prefix string // its Redis keys'
	tables func() map[string]bool
}

// startChildRun starts the command as a child process on the test
// servers and waits until its table exists and its cache holds the
// product. Its callers are not parallel: it finds the child's table as
// the one that was not there before, which holds only while no other test
// of the package creates one (they wait for the sequential tests to end).
func startChildRun(t *testing.T, pg *testenv.PG, rd *testenv.RD) *childRun {
	t.Helper()
	ctx := context.Background()
	r := &childRun{done: make(chan error, 1), stderr: &bytes.Buffer{}}
	r.tables = func() map[string]bool { // t.Errorf: it also runs inside Eventually
		rows, err := pg.Pool.Query(ctx, `SELECT schemaname || '.' || tablename FROM pg_tables WHERE tablename LIKE 'race_products_%'`)
		if err != nil {
			t.Errorf("list tables: %v", err)
			return nil
		}
		names, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Errorf("list tables: %v", err)
			return nil
		}
		set := map[string]bool{}
		for _, n := range names {
			set[n] = true
		}
		return set
	}
	before := r.tables()
	r.cmd = exec.Command(os.Args[0])
	// The child finds its servers by DATABASE_URL and REDIS_URL: name this
	// test's, never whatever the shell exports.
	r.cmd.Env = append(os.Environ(), runMainEnv+"=--seconds=30 --readers=2 --writers=1 --mode=naive",
		"DATABASE_URL="+pg.ServerURL, "REDIS_URL="+rd.URL)
	r.cmd.Stderr = r.stderr
	require.NoError(t, r.cmd.Start())
	go func() { r.done <- r.cmd.Wait() }()
	t.Cleanup(func() {
		_ = r.cmd.Process.Kill()
		<-r.done
	})
	require.Eventually(t, func() bool {
		for n := range r.tables() {
			if !before[n] {
				r.table = n
				return true
			}
		}
		return false
	}, 30*time.Second, 5*time.Millisecond, "the run never created its table")
	schema, table, _ := strings.Cut(r.table, ".")
	r.ident = pgx.Identifier{schema, table}.Sanitize()
	r.prefix = "verity:race-test:" + strings.TrimPrefix(table, "race_products_") + ":"
	t.Cleanup(func() {
		_, _ = pg.Pool.Exec(context.Background(), "DROP TABLE IF EXISTS "+r.ident)
		_ = testenv.DeletePrefix(context.Background(), rd.Client, r.prefix)
	})
	require.Eventually(t, func() bool { // the cache holds the product
		keys, err := rd.Client.Keys(ctx, r.prefix+"*").Result()
		return err == nil && len(keys) > 0
	}, 30*time.Second, 5*time.Millisecond, "the run never filled its cache")
	return r
}

// wait returns the child's exit within d, or fails the test with what.
func (r *childRun) wait(t *testing.T, d time.Duration, what string) error {
	t.Helper()
	select {
	case err := <-r.done:
		r.done <- err // for the cleanup
		return err
	case <-time.After(d):
		t.Fatalf("%s; stderr:\n%s", what, r.stderr)
		return nil
	}
}

// TestSIGTERMCleansUp: SIGTERM (timeout(1), CI cancellation, kill) ends a
// run through its cleanup, as Ctrl-C does, leaving neither its table nor
// its keys behind.
func TestSIGTERMCleansUp(t *testing.T) {
	pg, rd := testenv.Postgres(t), testenv.Redis(t) // a pool on the server the child resolves
	r := startChildRun(t, pg, rd)
	require.NoError(t, r.cmd.Process.Signal(syscall.SIGTERM))
	werr := r.wait(t, 30*time.Second, "race-test did not end on SIGTERM")
	// Canceled, the run reports its error and exits 1; killed by the
	// signal, the process has no exit code (-1).
	var exitErr *exec.ExitError
	require.True(t, errors.As(werr, &exitErr), "%v", werr)
	require.Equal(t, 1, exitErr.ExitCode(), "SIGTERM killed the run instead of canceling it: %v %s", werr, r.stderr)
	require.Contains(t, r.stderr.String(), context.Canceled.Error())
	require.False(t, r.tables()[r.table], "table %s left behind", r.table)
	keys, err := rd.Client.Keys(context.Background(), r.prefix+"*").Result()
	require.NoError(t, err)
	require.Empty(t, keys)
}

// TestSecondSignalEndsAStuckRun: a run whose operations wait on
// PostgreSQL (another session holds a lock on its table) cannot finish on
// the first signal, since each operation runs to completion on a context
// the signal does not cancel; a second signal ends the process at once,
// killed by it, instead of being swallowed.
func TestSecondSignalEndsAStuckRun(t *testing.T) {
	ctx := context.Background()
	pg, rd := testenv.Postgres(t), testenv.Redis(t)
	r := startChildRun(t, pg, rd)
	lock, err := pg.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = lock.Rollback(context.Background()) })
	_, err = lock.Exec(ctx, "LOCK TABLE "+r.ident+" IN ACCESS EXCLUSIVE MODE")
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		var n int
		err := pg.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = $1::regclass`, r.ident).Scan(&n)
		return err == nil && n > 0
	}, 10*time.Second, 10*time.Millisecond, "the run never waited for the lock")

	require.NoError(t, r.cmd.Process.Signal(syscall.SIGINT))
	select {
	case err := <-r.done:
		r.done <- err
		t.Fatalf("the first signal ended the stuck run: %v", err)
	case <-time.After(500 * time.Millisecond):
	}
	require.NoError(t, r.cmd.Process.Signal(syscall.SIGINT))
	werr := r.wait(t, 5*time.Second, "race-test still running 5 s after a second SIGINT")
	var exitErr *exec.ExitError
	require.True(t, errors.As(werr, &exitErr), "%v", werr)
	status, ok := exitErr.Sys().(syscall.WaitStatus)
	require.True(t, ok && status.Signaled() && status.Signal() == syscall.SIGINT, "exit %v, want killed by SIGINT", werr)
}
