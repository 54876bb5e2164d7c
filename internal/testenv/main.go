package testenv

import (
	"fmt"
	"os"
	"testing"

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
		if err := goleak.Find(opts...); err != nil {
			fmt.Fprintf(os.Stderr, "testenv: goroutines still running after every test passed:\n%v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}
