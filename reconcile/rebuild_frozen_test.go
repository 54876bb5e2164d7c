package reconcile

import (
	"context"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/projection"
)

// redisPID is the process id the server behind client reports.
func redisPID(t *testing.T, client *redis.Client) int {
	t.Helper()
	info, err := client.Info(context.Background(), "server").Result()
	require.NoError(t, err)
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "process_id:"); ok {
			pid, err := strconv.Atoi(v)
			require.NoError(t, err)
			return pid
		}
	}
	t.Fatal("INFO server has no process_id")
	return 0
}

// TestRebuildCleanUpFailsWhileRedisIsFrozen: a Rebuild cancelled while its
// Redis server has stopped answering (SIGSTOP) cannot remove its marker and
// shadow keys within RepairTimeout either. Its error says so (it said only
// "context canceled", while the marker held other rebuilds off); the live
// projection is left as it was, the marker holds the next Rebuild off
// until it expires, and that Rebuild then succeeds.
func TestRebuildCleanUpFailsWhileRedisIsFrozen(t *testing.T) {
	t.Parallel()
	bg := context.Background()
	server := testenv.StartRedis(t)
	client := redis.NewClient(&redis.Options{Addr: server.Addr(), ReadTimeout: time.Second, WriteTimeout: time.Second})
	t.Cleanup(func() { _ = client.Close() })
	pid := redisPID(t, client)
	frozen := false
	thaw := func() {
		if frozen {
			frozen = false
			require.NoError(t, syscall.Kill(pid, syscall.SIGCONT))
		}
	}
	t.Cleanup(thaw)

	b := setupWith(t, projection.KindSortedSet, client, "frozen:")
	live := make([]projection.Write, 10)
	for i := range live {
		k := "k" + strconv.Itoa(i)
		b.insert(t, k, 1)
		live[i] = projection.Write{Target: b.target.target(k), Version: 1, Value: b.value(k, 1)}
	}
	_, err := b.gate.Apply(bg, live)
	require.NoError(t, err)
	_, err = b.pool.Exec(bg, `UPDATE items SET version = 2, score = score + 10`)
	require.NoError(t, err)

	stopped := make(chan struct{})
	hs := &hookedSource{Source: b.source, onPage: func(_ context.Context, n int) {
		if n == 3 {
			frozen = true
			if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
				t.Error(err)
			}
			close(stopped)
		}
	}}
	r, err := New(hs, b.target, &Config{PageSize: 2, RepairTimeout: 3 * time.Second})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(bg)
	defer cancel()
	type result struct {
		rep *RebuildReport
		err error
	}
	done := make(chan result, 1)
	go func() { rep, err := r.Rebuild(ctx); done <- result{rep, err} }()
	<-stopped
	cancel()
	var got result
	select {
	case got = <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("Rebuild has not returned")
	}
	thaw()
	require.ErrorIs(t, got.err, context.Canceled)
	require.ErrorContains(t, got.err, "clean-up failed")
	require.False(t, got.rep.Switched)

	for i := range live {
		k := "k" + strconv.Itoa(i)
		score, err := client.ZScore(bg, b.ks.ValueKey(b.target.target(k)), k).Result()
		require.NoError(t, err)
		require.Equal(t, float64(b.value(k, 1).Score), score, "live %s left as it was", k)
	}
	marker, _, _ := b.rebuildKeys()
	next, err := New(b.source, b.target, &Config{PageSize: 2})
	require.NoError(t, err)
	_, err = next.Rebuild(bg)
	require.ErrorIs(t, err, ErrRebuildInProgress, "the marker left behind holds the next rebuild off")
	require.NoError(t, client.PExpire(bg, marker, time.Millisecond).Err()) // as if it expired
	require.Eventually(t, func() bool { return client.Exists(bg, marker).Val() == 0 }, 5*time.Second, 5*time.Millisecond)
	rep, err := next.Rebuild(bg)
	require.NoError(t, err)
	require.True(t, rep.Switched)
	b.requireNoRebuildLeft(t)
	for i := range live {
		k := "k" + strconv.Itoa(i)
		score, err := client.ZScore(bg, b.ks.ValueKey(b.target.target(k)), k).Result()
		require.NoError(t, err)
		require.Equal(t, float64(b.value(k, 1).Score+10), score, "rebuilt %s", k)
	}
}
