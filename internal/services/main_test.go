package services

import (
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"
)

// TestMain is testenv.Main for this package, which testenv itself imports:
// after the tests it stops the shared servers they started and fails if any
// goroutine is still running.
func TestMain(m *testing.M) {
	code := m.Run()
	CloseShared()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "services: goroutines still running after every test passed:\n%v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}
