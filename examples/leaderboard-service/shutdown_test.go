package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/leaderboard"
)

// TestRunShutsDownGracefully runs the whole service (HTTP, worker,
// scheduled reconcile), uses it, cancels it, and checks that Run returns and
// leaves no goroutine behind. It is not parallel on purpose: it counts the
// process's goroutines, which other tests running at the same time would
// change. The request in flight when it is cancelled is a read-your-writes
// read of a version submitted only once the listener is closed: it is
// answered with that version, so the worker kept projecting until the
// request was done.
func TestRunShutsDownGracefully(t *testing.T) {
	// The in-flight read waits up to this long for its version; the worker
	// must project it well before, so a shutdown that stops the worker
	// first answers it unmet, and late.
	const slowRead = 8 * time.Second
	tb := setup(t, func(c *leaderboard.Config) { c.ReadYourWritesTimeout = slowRead })
	svc, err := NewService(tb.pg.Pool, tb.rd.Client, tb.board, ServiceConfig{ReconcileEvery: 50 * time.Millisecond, ReconcileSample: 10})
	require.NoError(t, err)
	t.Cleanup(func() { _ = svc.Close() })
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 10 * time.Second}
	slowStarted := make(chan struct{})
	handler := svc.handler
	svc.handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("at_least") == "2" {
			close(slowStarted)
		}
		handler.ServeHTTP(w, r)
	})

	before := runtime.NumGoroutine()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	base := "http://" + ln.Addr().String()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- svc.Run(ctx, ln) }()

	// The server answers, the worker projects, the reconcile loop reports.
	req, err := http.NewRequest(http.MethodPost, base+"/scores", strings.NewReader(`{"user_id":"ada","delta":7}`))
	require.NoError(t, err)
	req.Header.Set("Idempotency-Key", uuid.NewString())
	resp, err := client.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusCreated, resp.StatusCode)
	require.Eventually(t, func() bool {
		resp, err := client.Get(base + "/users/ada/rank")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 10*time.Second, 20*time.Millisecond, "the worker never projected the score")
	require.Eventually(t, func() bool {
		last := svc.lastReconcile.Load()
		return last != nil && last.Checked == 1 && last.Error == ""
	}, 10*time.Second, 20*time.Millisecond, "the scheduled reconcile never reported")

	// Shut down while a request is in flight, waiting for ada's version 2:
	// it must still be answered, and with that version.
	type answer struct {
		status int
		body   rankResponse
	}
	slowDone := make(chan answer, 1)
	go func() {
		resp, err := client.Get(base + "/users/ada/rank?at_least=2")
		if err != nil {
			slowDone <- answer{status: -1}
			return
		}
		defer resp.Body.Close()
		a := answer{status: resp.StatusCode}
		_ = json.NewDecoder(resp.Body).Decode(&a.body)
		slowDone <- a
	}()
	select {
	case <-slowStarted:
	case <-time.After(10 * time.Second):
		t.Fatal("the slow request never reached the handler")
	}
	cancel()
	require.Eventually(t, func() bool {
		resp, err := client.Get(base + "/healthz")
		if err == nil {
			resp.Body.Close()
		}
		return err != nil
	}, 10*time.Second, 5*time.Millisecond, "the listener never closed")
	res, err := tb.board.Submit(context.Background(), leaderboard.Command{EventID: uuid.New(), UserID: "ada", Delta: 3})
	require.NoError(t, err)
	require.Equal(t, int64(2), res.Version)
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(15 * time.Second):
		t.Fatal("Run did not return after cancellation")
	}
	// Run returned after its worker's Run did: the worker is free to run
	// again (a Run still under way refuses another).
	ended, end := context.WithCancel(context.Background())
	end()
	require.NoError(t, svc.worker.Run(ended), "Run returned before its worker stopped")
	got := <-slowDone
	require.Equal(t, http.StatusOK, got.status, "the in-flight request was answered")
	require.True(t, got.body.Freshness.AtLeastMet, "the worker stopped before the in-flight request was done")
	require.Equal(t, int64(10), got.body.Score)

	// Goroutines wind down asynchronously (connection readers notice the
	// close); give them a moment, then compare.
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > before {
		buf := make([]byte, 1<<20)
		t.Fatalf("%d goroutines before Run, %d after it returned:\n%s", before, n, buf[:runtime.Stack(buf, true)])
	}
}

// program is the real service started as a subprocess by startProgram.
type program struct {
	cmd    *exec.Cmd
	base   string // http://host:port
	out    *lockedBuffer
	exited chan error // cmd.Wait's result
	client *http.Client
}

// startProgram starts the real program's serve command on the bundle's
// servers as a subprocess and waits until it answers /healthz.
func startProgram(t *testing.T, tb *testBundle) *program {
	t.Helper()
	// Port 0: the program binds a free port itself and logs it, so no other
	// test can take the port between choosing and binding it.
	cmd := exec.Command(os.Args[0], append([]string{"serve", "--addr=127.0.0.1:0", "--reconcile-every=200ms"}, tb.opsFlags()...)...)
	cmd.Env = append(os.Environ(), mainEnv+"=1")
	p := &program{cmd: cmd, out: &lockedBuffer{}, exited: make(chan error, 1), client: &http.Client{Timeout: 5 * time.Second}}
	cmd.Stdout, cmd.Stderr = p.out, p.out
	require.NoError(t, cmd.Start())
	go func() { p.exited <- cmd.Wait() }()
	t.Cleanup(func() { _ = cmd.Process.Kill() })

	serving := regexp.MustCompile(`msg=serving addr=(\S+)`)
	require.Eventually(t, func() bool {
		if m := serving.FindStringSubmatch(p.out.String()); m != nil {
			p.base = "http://" + m[1]
		}
		return p.base != ""
	}, 30*time.Second, 20*time.Millisecond, "the service never logged its address: %s", p.out)
	require.Eventually(t, func() bool {
		resp, err := p.client.Get(p.base + "/healthz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 30*time.Second, 50*time.Millisecond, "the service never became healthy: %s", p.out)
	return p
}

// submit posts one command under the Idempotency-Key key.
func (p *program) submit(key, userID string, delta int) (*http.Response, error) {
	req, err := http.NewRequest(http.MethodPost, p.base+"/scores", strings.NewReader(fmt.Sprintf(`{"user_id":%q,"delta":%d}`, userID, delta)))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Idempotency-Key", key)
	resp, err := p.client.Do(req)
	if err == nil {
		resp.Body.Close()
	}
	return resp, err
}

// TestSIGTERM starts the real program as a subprocess, uses it, sends it
// SIGTERM and expects a clean exit.
func TestSIGTERM(t *testing.T) {
	t.Parallel()
	p := startProgram(t, setup(t))
	resp, err := p.submit(uuid.NewString(), "ada", 7)
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, resp.StatusCode)

	require.NoError(t, p.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case err := <-p.exited:
		require.NoError(t, err, "exit status; output:\n%s", p.out)
	case <-time.After(20 * time.Second):
		t.Fatalf("no exit 20s after SIGTERM; output:\n%s", p.out)
	}
	out := p.out.String()
	require.Contains(t, out, "shutting down")
	require.Contains(t, out, "msg=stopped")
}

// TestSecondSignalEndsShutdown: a graceful shutdown waits for in-flight
// requests (up to ShutdownTimeoutDefault, 10 s); a second signal ends the
// process at once, killed by it. The submit it cut off, waiting for a
// lock, may or may not commit; its retry with the same Idempotency-Key,
// on a new process, leaves exactly one event.
func TestSecondSignalEndsShutdown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	p := startProgram(t, tb)

	lock, err := tb.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = lock.Rollback(ctx) })
	_, err = lock.Exec(ctx, `LOCK TABLE score_events IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	key := uuid.NewString()
	submitted := make(chan error, 1)
	go func() {
		_, err := p.submit(key, "ada", 7)
		submitted <- err
	}()
	require.Eventually(t, func() bool { return tb.lockWaiters(t, "score_events") > 0 },
		10*time.Second, 10*time.Millisecond, "the submit never waited for the lock")

	require.NoError(t, p.cmd.Process.Signal(syscall.SIGINT))
	require.Eventually(t, func() bool { return strings.Contains(p.out.String(), "shutting down") },
		5*time.Second, 10*time.Millisecond, "no graceful shutdown began: %s", p.out)
	select {
	case err := <-p.exited:
		t.Fatalf("the first signal ended the process (%v) with a request in flight:\n%s", err, p.out)
	case <-time.After(300 * time.Millisecond):
	}

	require.NoError(t, p.cmd.Process.Signal(syscall.SIGINT))
	select {
	case err := <-p.exited:
		var exit *exec.ExitError
		require.ErrorAs(t, err, &exit, "output:\n%s", p.out)
		status, ok := exit.Sys().(syscall.WaitStatus)
		require.True(t, ok && status.Signaled() && status.Signal() == syscall.SIGINT, "exit %v, want killed by SIGINT; output:\n%s", err, p.out)
	case <-time.After(5 * time.Second):
		t.Fatalf("no exit 5s after the second signal (graceful shutdown waits up to %v); output:\n%s", ShutdownTimeoutDefault, p.out)
	}
	require.Error(t, <-submitted, "the cut-off submit got an answer")
	require.NoError(t, lock.Rollback(ctx))
	require.Eventually(t, func() bool {
		return tb.lockWaiters(t, "score_events") == 0
	}, 10*time.Second, 20*time.Millisecond, "the cut-off submit still waits for the lock")

	retry := startProgram(t, tb)
	resp, err := retry.submit(key, "ada", 7)
	require.NoError(t, err)
	require.Contains(t, []int{http.StatusOK, http.StatusCreated}, resp.StatusCode, "the retry's status")
	events, _ := tb.counts(t)
	require.Equal(t, 1, events, "score events after the cut-off submit and its retry")
}

// TestShutdownDuringScrapeOfStalledStats stops the service while a
// /metrics scrape waits for a stats read that PostgreSQL stalls. The gauge
// callback runs under the metrics SDK's lock, which the worker's relay
// needs to stop: the scrape must give up on the read soon, so that Run
// returns within its ShutdownTimeout and not when the read times out. The
// read itself, which nobody waits for any more, must have ended by then.
func TestShutdownDuringScrapeOfStalledStats(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	svc, err := NewService(tb.pg.Pool, tb.rd.Client, tb.board, ServiceConfig{ShutdownTimeout: 200 * time.Millisecond})
	require.NoError(t, err)
	t.Cleanup(func() { _ = svc.Close() })
	started := make(chan struct{})
	handler := svc.handler
	svc.handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/metrics" {
			close(started)
		}
		handler.ServeHTTP(w, r)
	})
	// A stalled PostgreSQL, for the stats read: it ends at statsTimeout.
	readEnded := make(chan struct{})
	svc.readStats = func(ctx context.Context) *statsSnapshot {
		defer close(readEnded)
		<-ctx.Done()
		return &statsSnapshot{At: time.Now(), Err: ctx.Err()}
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- svc.Run(ctx, ln) }()
	go func() {
		resp, err := http.Get("http://" + ln.Addr().String() + "/metrics")
		if err == nil {
			resp.Body.Close()
		}
	}()
	<-started
	time.Sleep(100 * time.Millisecond) // the scrape is waiting for the stats read
	stopAt := time.Now()
	cancel()
	require.NoError(t, <-done)
	require.Less(t, time.Since(stopAt), 2*time.Second,
		"Run took %v to return with ShutdownTimeout 200ms", time.Since(stopAt))
	select {
	case <-readEnded:
	default:
		t.Fatal("Run returned while the stats read it served was still running")
	}
}

// TestShutdownWithTinyReconcileInterval runs the service with the smallest
// interval the flag takes (1ns): the schedule skips the slots a run
// overran without stepping through each (the steps took longer than the
// time they covered, and the loop never caught up), and a cancellation
// ends the loop even when its next slot is already due.
func TestShutdownWithTinyReconcileInterval(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	svc, err := NewService(tb.pg.Pool, tb.rd.Client, tb.board, ServiceConfig{ReconcileEvery: time.Nanosecond, ReconcileSample: 10})
	require.NoError(t, err)
	t.Cleanup(func() { _ = svc.Close() })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- svc.Run(ctx, ln) }()
	time.Sleep(3 * time.Second)
	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(15 * time.Second):
		t.Fatal("Run did not return within 15s of the cancellation")
	}
}

// TestRunTwiceIsRefused: a second Run, while the first serves or after it
// returned, is refused and leaves the first alone. It used to start its
// worker, be refused by the relay, and on its way out stop the stats reads
// for good: the first Run, still serving, answered every /stats with 500.
func TestRunTwiceIsRefused(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 10 * time.Second}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	base := "http://" + ln.Addr().String()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- tb.svc.Run(ctx, ln) }()

	stats := func() (int, string) {
		t.Helper()
		resp, err := client.Get(base + "/stats")
		require.NoError(t, err)
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	require.Eventually(t, func() bool { code, _ := stats(); return code == http.StatusOK }, 10*time.Second, 20*time.Millisecond)

	ln2, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln2.Close()
	require.ErrorIs(t, tb.svc.Run(context.Background(), ln2), errRunTwice)
	time.Sleep(statsTTL + 100*time.Millisecond) // past the cached snapshot
	code, body := stats()
	require.Equal(t, http.StatusOK, code, "the refused Run left the first one's /stats alone: %s", body)

	cancel()
	require.NoError(t, <-done)
	require.ErrorIs(t, tb.svc.Run(context.Background(), ln2), errRunTwice, "after the first returned too")
}
