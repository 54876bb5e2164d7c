package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// runMainEnv, set to the command's arguments (space-separated, possibly
// none), makes the test binary run the command's main with them instead of
// its tests: the signal and usage tests start it as a child process.
const runMainEnv = "FAILURE_EXPERIMENT_RUN_MAIN"

// TestMain fails the package's tests if any goroutine outlives them.
func TestMain(m *testing.M) {
	if args, ok := os.LookupEnv(runMainEnv); ok {
		os.Args = append([]string{"failure-experiment"}, strings.Fields(args)...)
		main()
		os.Exit(0)
	}
	testenv.Main(m)
}

// TestUsageErrors: a stray argument (a flag typed without its dashes) or
// an unknown flag exits 2 before anything connects, as leaderboard-service
// does, instead of running the experiment with the word ignored; -h is
// asked for, not an error.
func TestUsageErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		args       string
		wantCode   int
		wantStderr string
	}{
		{"StrayArgument", "json", 2, `failure-experiment: unexpected argument "json"`},
		{"StrayArgumentAfterFlag", "--json now", 2, `failure-experiment: unexpected argument "now"`},
		{"UnknownFlag", "--jsn", 2, "flag provided but not defined: -jsn"},
		{"Help", "-h", 0, "-json"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cmd := exec.Command(os.Args[0])
			cmd.Env = append(os.Environ(), runMainEnv+"="+tc.args)
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			err := cmd.Run()
			code := 0
			if err != nil {
				var exitErr *exec.ExitError
				require.True(t, errors.As(err, &exitErr), "%v", err)
				code = exitErr.ExitCode()
			}
			require.Equal(t, tc.wantCode, code, "stdout: %s\nstderr: %s", stdout.String(), stderr.String())
			require.Contains(t, stderr.String(), tc.wantStderr)
			require.Contains(t, stderr.String(), "Usage of failure-experiment", "the flags were not listed")
			require.Empty(t, stdout.String(), "the experiment ran")
		})
	}
}

// TestSIGTERMCleansUp: SIGTERM (timeout(1), CI cancellation, kill) ends a
// run through its cleanup, as Ctrl-C does, leaving neither its schema nor
// its keys behind.
func TestSIGTERMCleansUp(t *testing.T) {
	// Not parallel: it finds its child's schema as the one that was not there
	// before, which holds only while no other test of the package creates
	// one (they wait for the sequential tests to end).
	pg := testenv.Postgres(t) // a pool on the server the child resolves
	rd := testenv.Redis(t)
	ctx := context.Background()
	schemas := func() map[string]bool {
		rows, err := pg.Pool.Query(ctx, `SELECT nspname FROM pg_namespace WHERE nspname LIKE 'verity_experiment_%'`)
		require.NoError(t, err)
		names, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		set := map[string]bool{}
		for _, n := range names {
			set[n] = true
		}
		return set
	}
	// A run takes about a second: try a few to land the signal after the
	// schema exists and before the run ends.
	for range 5 {
		before := schemas()
		cmd := exec.Command(os.Args[0])
		// The child finds its servers by DATABASE_URL and REDIS_URL: name
		// this test's, never whatever the shell exports.
		cmd.Env = append(os.Environ(), runMainEnv+"=", "DATABASE_URL="+pg.ServerURL, "REDIS_URL="+rd.URL)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		require.NoError(t, cmd.Start())
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()

		var mine string
		var werr error
		exited := false
	poll:
		for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); {
			for n := range schemas() {
				if !before[n] {
					mine = n
					break poll
				}
			}
			select {
			case werr = <-done:
				exited = true
				break poll
			case <-time.After(2 * time.Millisecond):
			}
		}
		if mine == "" {
			if !exited {
				_ = cmd.Process.Kill()
				<-done
			}
			require.True(t, exited, "the experiment never created its schema")
			require.NoError(t, werr, stderr.String())
			continue // ran start to end between two polls; try again
		}
		prefix := "verity-experiment-" + strings.TrimPrefix(mine, "verity_experiment_") + ":"
		t.Cleanup(func() {
			_, _ = pg.Pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{mine}.Sanitize()+" CASCADE")
			_ = testenv.DeletePrefix(context.Background(), rd.Client, prefix)
		})
		require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
		if werr = <-done; werr == nil {
			continue // finished before the signal landed; try again
		}
		// Canceled, the run reports its error and exits 1; killed by the
		// signal, the process has no exit code (-1).
		var exitErr *exec.ExitError
		require.True(t, errors.As(werr, &exitErr), "%v", werr)
		require.Equal(t, 1, exitErr.ExitCode(), "SIGTERM killed the run instead of canceling it: %v %s", werr, stderr.String())
		require.Contains(t, stderr.String(), context.Canceled.Error())
		require.False(t, schemas()[mine], "schema %s left behind", mine)
		keys, err := rd.Client.Keys(ctx, prefix+"*").Result()
		require.NoError(t, err)
		require.Empty(t, keys)
		return
	}
	t.Skip("the signal never landed during a run")
}
