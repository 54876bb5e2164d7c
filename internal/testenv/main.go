package testenv

import (
	"fmt"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/verity-go/verity/internal/services"
)

// Main is a test binary's TestMain:
//
//	func TestMain(m *testing.M) { testenv.Main(m) }
//
// It runs the tests, stops the shared servers, Redis Cluster and Sentinel
// deployment the binary started, and then fails the binary if any goroutine
// is still running: a relay, worker, cache flight or notifier that outlived
// its Close or its context, or a client a test forgot to close. The check only
// runs after every test passed, so a failing test's own report is not
// buried under the goroutines it left behind. ignore names goroutines that
// belong to a test tool, never to the library (toxiproxy's pipes, for one).
func Main(m *testing.M, ignore ...goleak.Option) {
	code := m.Run()
	closeShared()
	opts := ignore
	if services.CloseShared() {
		// The Docker client's idle keep-alive connections, not ours.
		opts = append(opts,
			goleak.IgnoreAnyFunction("net/http.(*persistConn).readLoop"),
			goleak.IgnoreAnyFunction("net/http.(*persistConn).writeLoop"))
	}
	if code == 0 {
		if err := findLeaks(opts...); err != nil {
			fmt.Fprintf(os.Stderr, "testenv: goroutines still running after every test passed:\n%v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// leakGrace is how long findLeaks lets goroutines end. goleak.Find alone
// waits about 1.5 s; go-redis's redial goroutine, which a pool starts once
// its dials to a dead node have failed, sleeps 1 s between attempts and
// notices its pool's Close only when it wakes, which a loaded machine
// running the race detector can delay past that.
const leakGrace = 5 * time.Second

// findLeaks runs goleak.Find until it finds no goroutine or leakGrace has
// passed, and returns its last error.
func findLeaks(opts ...goleak.Option) error {
	deadline := time.Now().Add(leakGrace)
	for {
		err := goleak.Find(opts...)
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(250 * time.Millisecond)
	}
}
