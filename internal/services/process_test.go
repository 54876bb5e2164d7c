package services

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestFreePort checks that ports for private servers come from below the
// range the kernel gives outgoing connections, so that a server restarted
// on its port does not find it taken by one of them. (Whether a port is
// still free when the test looks is a race with the package's other tests,
// which take such ports too: not asserted.)
func TestFreePort(t *testing.T) {
	t.Parallel()
	ephemeral := ephemeralPortsStart()
	if ephemeral <= minFixedPort+10000+100 {
		t.Skipf("the ephemeral port range starts at %d: no room below it", ephemeral)
	}

	t.Run("Single", func(t *testing.T) {
		t.Parallel()
		for range 20 {
			p, err := FreePort()
			require.NoError(t, err)
			require.GreaterOrEqual(t, p, minFixedPort)
			require.Less(t, p, ephemeral)
		}
	})

	t.Run("Pair", func(t *testing.T) {
		t.Parallel()
		for range 20 {
			p, err := FreePortPair(10000)
			require.NoError(t, err)
			require.GreaterOrEqual(t, p, minFixedPort)
			require.Less(t, p+10000, ephemeral, "the pair's second port must stay below the range too")
		}
	})
}
