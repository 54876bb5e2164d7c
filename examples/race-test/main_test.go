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

// TestSIGTERMCleansUp: SIGTERM (timeout(1), CI cancellation, kill) ends a
// run through its cleanup, as Ctrl-C does, leaving neither its table nor
// its keys behind.
func TestSIGTERMCleansUp(t *testing.T) {
	// Not parallel: it finds its child's table as the one that was not there
	// before, which holds only while no other test of the package creates
	// one (they wait for the sequential tests to end).
	pg := testenv.Postgres(t) // a pool on the server the child resolves
	rd := testenv.Redis(t)
	ctx := context.Background()
	tables := func() map[string]bool { // t.Errorf: it also runs inside Eventually
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
	before := tables()
	cmd := exec.Command(os.Args[0])
	// The child finds its servers by DATABASE_URL and REDIS_URL: name this
	// test's, never whatever the shell exports.
	cmd.Env = append(os.Environ(), runMainEnv+"=--seconds=30 --readers=2 --writers=1 --mode=naive",
		"DATABASE_URL="+pg.ServerURL, "REDIS_URL="+rd.URL)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-done
	})
	var mine string
	require.Eventually(t, func() bool {
		for n := range tables() {
			if !before[n] {
				mine = n
				return true
			}
		}
		return false
	}, 30*time.Second, 5*time.Millisecond, "the run never created its table")
	schema, table, _ := strings.Cut(mine, ".")
	prefix := "verity:race-test:" + strings.TrimPrefix(table, "race_products_") + ":"
	t.Cleanup(func() {
		_, _ = pg.Pool.Exec(context.Background(), "DROP TABLE IF EXISTS "+pgx.Identifier{schema, table}.Sanitize())
		_ = testenv.DeletePrefix(context.Background(), rd.Client, prefix)
	})
	require.Eventually(t, func() bool { // the cache holds the product
		keys, err := rd.Client.Keys(ctx, prefix+"*").Result()
		return err == nil && len(keys) > 0
	}, 30*time.Second, 5*time.Millisecond, "the run never filled its cache")

	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	var werr error
	select {
	case werr = <-done:
		done <- werr // for the cleanup
	case <-time.After(30 * time.Second):
		t.Fatal("race-test did not end on SIGTERM")
	}
	// Canceled, the run reports its error and exits 1; killed by the
	// signal, the process has no exit code (-1).
	var exitErr *exec.ExitError
	require.True(t, errors.As(werr, &exitErr), "%v", werr)
	require.Equal(t, 1, exitErr.ExitCode(), "SIGTERM killed the run instead of canceling it: %v %s", werr, stderr.String())
	require.Contains(t, stderr.String(), context.Canceled.Error())
	require.False(t, tables()[mine], "table %s left behind", mine)
	keys, err := rd.Client.Keys(ctx, prefix+"*").Result()
	require.NoError(t, err)
	require.Empty(t, keys)
}
