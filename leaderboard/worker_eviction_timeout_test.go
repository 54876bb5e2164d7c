package leaderboard

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// TestWorkerEvictionCheckTimedOutStands: a first Run whose
// eviction check ran out of its own 2s (Redis did not answer) while Run's
// ctx was alive was not "cut short by Run's ctx": it logs that it could not
// check, and the next Run does not check again (only a Run whose ctx ended
// before the servers answered leaves the check to the next one).
func TestWorkerEvictionCheckTimedOutStands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	server := testenv.StartRedis(t, "--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru")
	proxy := startStallProxy(t, server.Addr())
	rdb := redis.NewClient(&redis.Options{Addr: proxy.ln.Addr().String(), ReadTimeout: 10 * time.Second, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = rdb.Close() })
	tb, logs := loggingBoard(t, rdb)
	w, err := tb.board.Worker(nil)
	require.NoError(t, err)

	proxy.armed.Store(true)
	first, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- w.Run(first) }()
	require.Eventually(t, func() bool {
		return len(logs.Lines(t, evictionCouldNot))+len(logs.Lines(t, evictionCutShort)) == 1
	}, 8*time.Second, 10*time.Millisecond, "the check times out")
	cancel()
	require.NoError(t, <-done)
	require.Len(t, logs.Lines(t, evictionCouldNot), 1, "a check that timed out could not check")
	require.Empty(t, logs.Lines(t, evictionCutShort))

	second, stop := context.WithCancel(ctx)
	next := make(chan error, 1)
	go func() { next <- w.Run(second) }()
	time.Sleep(time.Second)
	stop()
	require.NoError(t, <-next)
	require.Empty(t, logs.Lines(t, evictionWarning), "the first Run stood for the check")
}
