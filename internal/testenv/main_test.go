package testenv

import "testing"

// TestMain fails the package's tests if any goroutine outlives them, and
// stops (and removes) the private servers they started.
func TestMain(m *testing.M) { Main(m) }
