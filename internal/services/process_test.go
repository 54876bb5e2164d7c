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

	// A server stopped for a restart leaves its port free for a while:
	// no port goes to two callers in one process, so no other test here
	// can take it then. (By chance alone, 300 draws from the ports below
	// the ephemeral range would repeat one more often than not.)
	t.Run("NeverTwice", func(t *testing.T) {
		t.Parallel()
		seen := map[int]bool{}
		for i := range 300 {
			p, err := FreePortPair(i % 2 * 10000)
			require.NoError(t, err)
			require.False(t, seen[p], "port %d handed out twice", p)
			seen[p] = true
			if i%2 == 1 {
				require.False(t, seen[p+10000], "port %d handed out twice", p+10000)
				seen[p+10000] = true
			}
		}
	})
}
