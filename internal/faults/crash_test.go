package faults

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// relayProc is one relay running as a separate OS process (this test binary
// re-executed with relayChildEnv set).
type relayProc struct {
	t       testing.TB
	spec    childSpec
	logPath string
	cmd     *exec.Cmd
	done    chan error
	logFrom int64 // size of the log when the running process started
}

func startRelayProc(t testing.TB, spec childSpec, dir string) *relayProc {
	t.Helper()
	p := &relayProc{t: t, spec: spec, logPath: filepath.Join(dir, spec.Name+".log")}
	p.start()
	t.Cleanup(func() { p.kill() })
	return p
}

func (p *relayProc) start() {
	p.t.Helper()
	spec, err := json.Marshal(p.spec)
	require.NoError(p.t, err)
	logFile, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	require.NoError(p.t, err)
	info, err := logFile.Stat()
	require.NoError(p.t, err)
	p.logFrom = info.Size() // the previous process, if any, was killed and waited for
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), relayChildEnv+"="+string(spec))
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	require.NoError(p.t, cmd.Start())
	_ = logFile.Close() // the child holds its own descriptor
	p.cmd, p.done = cmd, make(chan error, 1)
	go func() { p.done <- cmd.Wait() }()
}

// kill SIGKILLs the process and waits for it to exit.
func (p *relayProc) kill() {
	if p.cmd == nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
	p.cmd = nil
}

// stop asks the process to shut down gracefully and returns its exit error.
// It first waits for the process to handle SIGTERM: one restarted just
// before (the last kill) may still be starting, on a loaded machine for
// longer than the drain takes, and SIGTERM would kill it outright.
func (p *relayProc) stop() error {
	if p.cmd == nil {
		return nil
	}
	if err := p.waitReady(30 * time.Second); err != nil {
		p.kill()
		return err
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-p.done:
		p.cmd = nil
		return err
	case <-time.After(30 * time.Second):
		p.kill()
		return fmt.Errorf("relay %s ignored SIGTERM for 30s", p.spec.Name)
	}
}

// waitReady waits until the running process has logged relayChildReady
// (the log file is shared by every process of p: its own part starts at
// logFrom).
func (p *relayProc) waitReady(within time.Duration) error {
	deadline := time.Now().Add(within)
	for {
		log, _ := os.ReadFile(p.logPath)
		if int64(len(log)) > p.logFrom && strings.Contains(string(log[p.logFrom:]), relayChildReady) {
			return nil
		}
		if err := p.exitedEarly(); err != nil {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("relay %s did not start handling SIGTERM within %s: %s", p.spec.Name, within, tail(string(log), 2000))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// exitedEarly reports an exit the test did not cause (a crash of its own).
func (p *relayProc) exitedEarly() error {
	select {
	case err := <-p.done:
		p.cmd = nil
		log, _ := os.ReadFile(p.logPath)
		return fmt.Errorf("relay %s exited on its own (%v): %s", p.spec.Name, err, tail(string(log), 2000))
	default:
		return nil
	}
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// TestRelayCrash runs relays as separate OS processes and SIGKILLs one of
// them at random moments, N times, while they drain M preloaded events and
// new commands keep arriving. A killed relay dies holding claimed rows,
// possibly after its gate write and before its acknowledgement; the lease
// must bring those rows back and the version gate must make the replays
// harmless. At the end Redis must equal PostgreSQL for every key, with no
// reconcile pass, and the outbox must be empty: nothing left, nothing lost.
func TestRelayCrash(t *testing.T) {
	t.Parallel()
	var (
		kills  = size(15, 100)
		events = size(6_000, 100_000)
		users  = size(1_500, 20_000)
		relays = 3
	)
	pg := testenv.Postgres(t)
	rd := testenv.Redis(t)
	bb := newBoard(t, pg.Pool, pg.Schema, rd.Client, rd.Prefix, "crash")
	gen := newLoadGen(bb.board, users)
	gen.preload(t, events)

	dir := t.TempDir()
	procs := make([]*relayProc, relays)
	for i := range procs {
		procs[i] = startRelayProc(t, childSpec{
			PostgresURL: pg.ConnString, RedisURL: rd.URL, Schema: pg.Schema,
			Board: bb.board.Name(), KeyPrefix: rd.Prefix, Name: fmt.Sprintf("relay-%d", i),
		}, dir)
	}

	ctx, stopLoad := context.WithCancel(context.Background())
	waitLoad := gen.run(ctx, t, 2, time.Millisecond)

	rng := rand.New(rand.NewPCG(rand.Uint64(), 7))
	started := time.Now()
	minBacklog, maxBacklog, midDrain := int64(-1), int64(0), 0
	for range kills {
		// Random pauses, longer in soak mode so the kills spread over the
		// whole (longer) drain instead of crowding its start.
		time.Sleep(time.Duration(20+rng.IntN(size(180, 700))) * time.Millisecond)
		for _, p := range procs {
			require.NoError(t, p.exitedEarly())
		}
		st, err := bb.stats(context.Background())
		require.NoError(t, err)
		if minBacklog < 0 || st.Pending < minBacklog {
			minBacklog = st.Pending
		}
		maxBacklog = max(maxBacklog, st.Pending)
		if st.InFlight > 0 {
			midDrain++ // some relay held a claimed batch at the moment of the kill
		}
		victim := procs[rng.IntN(len(procs))]
		victim.kill()
		victim.start()
	}
	killPhase := time.Since(started)
	stopLoad()
	waitLoad()

	bb.waitDrained(t, size(60*time.Second, 20*time.Minute))
	drained := time.Since(started)
	for _, p := range procs {
		require.NoError(t, p.stop())
	}
	checked := bb.requireConverged(t)
	gen.requireExactlyOnce(t, bb)
	// An independent check: the reconciler must agree there is no drift.
	rep := bb.reconcile(t)
	require.Zero(t, rep.Drift(), "reconcile found drift: %+v", rep.Counts)
	for _, p := range procs {
		log, _ := os.ReadFile(p.logPath)
		require.NotContains(t, string(log), "panic", "relay log of %s", p.spec.Name)
	}
	summary(t, "crash", "relay-sigkill",
		"kills", kills, "kills_with_batch_in_flight", midDrain,
		"backlog_at_kill_min", minBacklog, "backlog_at_kill_max", maxBacklog,
		"events_preloaded", events, "commands_acked", gen.ackedCount(), "submit_retries", gen.retries.Load(),
		"rows_checked", checked, "reconcile_drift", rep.Drift(), "rows_repaired", rep.Repaired, "outbox_left", 0, "lost", 0,
		"kill_phase", killPhase.Round(time.Millisecond), "drained_after", drained.Round(time.Millisecond))
}
