package pgcancel_test

import (
	"testing"

	"github.com/verity-go/verity/internal/testenv"
)

// TestMain fails the package's tests if any goroutine outlives them.
func TestMain(m *testing.M) { testenv.Main(m) }
