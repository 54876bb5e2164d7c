package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// barrierHook holds the seed workers' EVALSHA pipelines until want of them
// are in flight at once (each inside its claim transaction); it then lets
// everything through and reports the peak reached. No clock decides: want
// is at most the seed pool's connections, the most that can be in at once.
type barrierHook struct {
	want    int32
	in      atomic.Int32
	peak    atomic.Int32
	release chan struct{}
	once    sync.Once
}

func (h *barrierHook) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (h *barrierHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (h *barrierHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if len(cmds) > 0 && cmds[0].Name() == "evalsha" {
			n := h.in.Add(1)
			for p := h.peak.Load(); n > p && !h.peak.CompareAndSwap(p, n); p = h.peak.Load() {
			}
			if n >= h.want {
				h.once.Do(func() { close(h.release) })
			}
			select {
			case <-h.release:
			case <-ctx.Done(): // the test's deadline: fail, not hang
			}
			defer h.in.Add(-1)
		}
		return next(ctx, cmds)
	}
}

// TestDrainSeedWorkersAllRunAtOnce: the drain baseline is "as many seed
// workers" as -relays, each holding its claim transaction (a connection)
// while it calls Redis. With -relays above the seed pool's 16 connections
// only 16 worked at once.
func TestDrainSeedWorkersAllRunAtOnce(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const workers = 20
	e := testEnv(t, quickSizes)
	e.opts.Relays = workers
	schema, err := e.schema(ctx, "drain")
	require.NoError(t, err)
	seedPool, err := e.seedWorkerPool(ctx)
	require.NoError(t, err)
	h := &barrierHook{want: min(workers, seedPool.Config().MaxConns), release: make(chan struct{})}
	e.rdb.AddHook(h)
	_, err = drainSeed(ctx, e, seedPool, schema, "many", 4_000, 1_000, workers)
	require.NoError(t, err)
	require.EqualValues(t, workers, h.peak.Load(), "seed workers in their Redis call at once, of %d", workers)
}

// slowScriptLoad delays every SCRIPT LOAD and notes when it ended: setup, which the README says
// the drain clock does not include ("from the first claim to the last
// acknowledgement").
type slowScriptLoad struct {
	delay time.Duration
	mu    sync.Mutex
	end   time.Time // when the last SCRIPT LOAD ended
}

func (h *slowScriptLoad) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *slowScriptLoad) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() != "script" {
			return next(ctx, cmd)
		}
		time.Sleep(h.delay)
		err := next(ctx, cmd)
		h.mu.Lock()
		h.end = time.Now()
		h.mu.Unlock()
		return err
	}
}
func (h *slowScriptLoad) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// clockStartedAfterLoad: a clock that read elapsed when its caller
// returned started no later than now-elapsed, so correct code never fails
// this however slow the drain. A clock that included the load started
// about the load's delay before the load ended; the check catches it while
// the caller's work after its clock stopped (its checks of the drain)
// takes less than that delay.
func (h *slowScriptLoad) clockStartedAfterLoad(elapsed time.Duration) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return !time.Now().Add(-elapsed).Before(h.end)
}

// TestDrainClockExcludesSetup: both sides load their Lua script before
// draining, outside the clock ("from the first claim to the last
// acknowledgement"); the library loaded its inside its timed window.
func TestDrainClockExcludesSetup(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const delay = 2 * time.Second // see clockStartedAfterLoad
	e := testEnv(t, quickSizes)
	schema, err := e.schema(ctx, "drain")
	require.NoError(t, err)
	seedPool, err := e.seedWorkerPool(ctx)
	require.NoError(t, err)
	h := &slowScriptLoad{delay: delay}
	e.rdb.AddHook(h)
	seed, err := drainSeed(ctx, e, seedPool, schema, "setup", 203, 50, 2)
	require.NoError(t, err)
	require.True(t, h.clockStartedAfterLoad(seed), "seed's timed drain of 203 rows (%v) includes its SCRIPT LOAD", seed)
	lib, err := drainLibrary(ctx, e, schema, "setup", 203, 50, 2)
	require.NoError(t, err)
	require.True(t, h.clockStartedAfterLoad(lib), "library's timed drain of 203 rows (%v) includes its SCRIPT LOAD", lib)
}

// TestDrainWarmsUpFirst: before its first timed round each side drains a
// tenth of the backlog on tables and keys of its own, so that the cost a
// process pays once does not fall on whichever side goes first; the timed
// rounds' tables hold only their own rows.
func TestDrainWarmsUpFirst(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := testEnv(t, quickSizes)
	var mu sync.Mutex
	var drained []string // "library <tag>" or "seed <tag>", in order
	e.log = func(format string, args ...any) {
		line := fmt.Sprintf(format, args...)
		if rest, ok := strings.CutPrefix(line, "drain: "); ok && (strings.HasPrefix(rest, "library ") || strings.HasPrefix(rest, "seed ")) {
			mu.Lock()
			defer mu.Unlock()
			side, _, _ := strings.Cut(rest, ":")
			drained = append(drained, side)
		}
	}
	_, err := runDrain(ctx, e)
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(drained), 2+2*drainRounds, "drain rounds logged: %q", drained)
	require.Equal(t, []string{"library warmup", "seed warmup"}, drained[:2], "the first drains of each side (every drain in order: %q)", drained)
	for _, d := range drained[2:] {
		require.NotContains(t, d, "warmup", "a warm-up after the timed rounds began (every drain in order: %q)", drained)
	}

	schema := e.schemas[len(e.schemas)-1]
	var warm, timed int64
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT
	(SELECT count(*) FROM `+qualify(schema, "seed_warmup_leaderboard_outbox")+`),
	(SELECT count(*) FROM `+qualify(schema, "seed_w2_r0_leaderboard_outbox")+`)`).Scan(&warm, &timed))
	require.Equal(t, int64(quickSizes.DrainRows/drainWarmupShare), warm, "the seed's warm-up rows, in a table of their own")
	require.Equal(t, int64(quickSizes.DrainRows/drainRounds), timed, "the seed's first timed round's rows")
}
