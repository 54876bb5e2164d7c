package clusterpin

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/verity-go/verity/internal/testenv"
)

// TestMain fails the package's tests if any goroutine outlives them, except
// those of the Sentinel watcher go-redis starts for a client built by
// NewFailoverClusterClient (TestOnMasterSentinel), which its Close leaves
// running (go-redis v9.23.0): the Sentinel's pub/sub listener and its
// channel's two helpers. This package uses no pub/sub itself.
func TestMain(m *testing.M) {
	testenv.Main(m,
		goleak.IgnoreAnyFunction("github.com/redis/go-redis/v9.(*sentinelFailover).listen"),
		goleak.IgnoreAnyFunction("github.com/redis/go-redis/v9.(*channel).initMsgChan.func1"),
		goleak.IgnoreAnyFunction("github.com/redis/go-redis/v9.(*channel).initHealthCheck.func1"))
}
