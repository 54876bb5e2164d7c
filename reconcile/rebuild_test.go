package reconcile

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/projection"
)

// hookedSource delegates to a real Source and calls onPage before each page,
// to pace or interrupt a pass.
type hookedSource struct {
	Source
	onPage func(ctx context.Context, n int)
	pages  atomic.Int64
}

func (s *hookedSource) Page(ctx context.Context, after Cursor, limit int) ([]Row, error) {
	if s.onPage != nil {
		s.onPage(ctx, int(s.pages.Add(1)))
	}
	return s.Source.Page(ctx, after, limit)
}

// outboxWrite updates key to version in the source, then gates it into the
// projection, as a transaction plus its outbox relay would.
func (b *testBundle) outboxWrite(ctx context.Context, key string, version int64) (bool, error) {
	return b.outboxWriteVia(ctx, func() *projection.Gate { return b.gate }, key, version)
}

// outboxWriteVia is outboxWrite through the gate gate() returns when the
// write is applied.
func (b *testBundle) outboxWriteVia(ctx context.Context, gate func() *projection.Gate, key string, version int64) (bool, error) {
	v := b.value(key, version)
	if _, err := b.pool.Exec(ctx, `UPDATE items SET version = $3, score = $4, data = $5 WHERE board = $1 AND key = $2`,
		testBoard, key, version, v.Score, v.Data); err != nil {
		return false, err
	}
	out, err := gate().Apply(ctx, []projection.Write{{Target: b.target.target(key), Version: version, Value: v}})
	if err != nil {
		return false, err
	}
	return out[0] == projection.OutcomeApplied, nil
}

func (b *testBundle) keysExist(t *testing.T, keys ...string) []bool {
	t.Helper()
	out := make([]bool, len(keys))
	for i, k := range keys {
		n, err := b.client.Exists(context.Background(), k).Result()
		require.NoError(t, err)
		out[i] = n == 1
	}
	return out
}

// requireNoRebuildLeft fails t unless the rebuild's marker, shadow keys
// and copy count are gone, as a switch and an abort leave them.
func (b *testBundle) requireNoRebuildLeft(t *testing.T, msgAndArgs ...any) {
	t.Helper()
	marker, sv, sver := b.rebuildKeys()
	require.Equal(t, []bool{false, false, false, false}, b.keysExist(t, marker, sv, sver, b.copyKey()), msgAndArgs...)
}

func (b *testBundle) rebuildKeys() (marker, shadowValue, shadowVersion string) {
	k, n := b.kind, b.target.Name
	return b.ks.RebuildMarkerKey(n, k), b.ks.ShadowValueKey(n, k), b.ks.ShadowVersionKey(n, k)
}

func TestRebuild(t *testing.T) {
	t.Parallel()
	forKinds(t, collectionKinds, func(t *testing.T, b *testBundle) {
		want := b.drift(t)
		r := b.reconciler(t, &Config{PageSize: 2})
		rep, err := r.Rebuild(context.Background())
		require.NoError(t, err)
		require.True(t, rep.Switched)
		require.EqualValues(t, len(want)-2, rep.Rows)
		require.EqualValues(t, rep.Rows, rep.Applied)

		b.requireNoRebuildLeft(t)

		run, err := r.Run(context.Background(), RunOptions{DryRun: true})
		require.NoError(t, err)
		require.Equal(t, map[Class]int64{ClassCurrent: 7}, run.Counts, "ahead replaced, orphans gone")
	})
	// The switched key lives twice RepairTimeout (or the marker's TTL if
	// longer): with RepairTimeout above half the largest Duration, twice
	// it wrapped negative, and the key got the marker's minute.
	t.Run("SwitchedKeyWithTheLongestRepairTimeout", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindSortedSet)
		b.insert(t, "a", 1)
		rep, err := b.reconciler(t, &Config{RepairTimeout: math.MaxInt64}).Rebuild(context.Background())
		require.NoError(t, err)
		require.True(t, rep.Switched)
		// Raw milliseconds: go-redis's PTTL overflows a Duration here.
		pttl, err := b.client.Do(context.Background(), "PTTL", rebuildSwitchedKey(b.ks, b.target.Name, b.kind)).Int64()
		require.NoError(t, err)
		require.Greater(t, pttl, int64(100*365*24*time.Hour/time.Millisecond))
	})

	t.Run("Documents", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindDocument)
		_, err := b.reconciler(t, nil).Rebuild(context.Background())
		require.ErrorIs(t, err, ErrRebuildUnsupported)
	})
	t.Run("EmptySource", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindSortedSet)
		b.project(t, "orphan", 1)
		rep, err := b.reconciler(t, nil).Rebuild(context.Background())
		require.NoError(t, err)
		require.True(t, rep.Switched)
		value, version := b.ks.ValueKey(b.target.target("")), b.ks.VersionKey(b.target.target(""))
		require.Equal(t, []bool{false, false}, b.keysExist(t, value, version))
	})
}

// TestRebuildConcurrentWrites runs the outbox (source update, then gate
// write) and readers while a rebuild copies the source slowly: readers
// always see the whole projection, and no gate write is lost.
func TestRebuildConcurrentWrites(t *testing.T) {
	t.Parallel()
	forKinds(t, collectionKinds, func(t *testing.T, b *testBundle) {
		rebuildUnderWrites(t, b, b.ks)
	})
}

// rebuildUnderWrites rebuilds b's collection into keyspace to (b.ks, or
// the same prefix with another bucket count: a migration) while the outbox
// writes through b's gate. After a migration's switch, b's gate meets the
// new layout and is refused (projection.ErrLayoutMismatch, nothing
// written); the writer then moves to a gate of the new layout and retries,
// as a relay redeployed with the new count would.
func rebuildUnderWrites(t *testing.T, b *testBundle, to projection.Keyspace) {
	const n = 600
	rows := b.insertMany(t, n)
	b.projectRows(t, rows)
	// Some drift for the rebuild to fix.
	b.setRaw(t, rows[1].Key, &projection.Value{Score: -1, Data: []byte("x")}, nil)
	b.project(t, "orphan", 3)

	ctx := context.Background()
	newGate := projection.NewGate(b.client, to)
	var current atomic.Pointer[projection.Gate]
	current.Store(b.gate)
	write := func(ctx context.Context, key string, version int64) (bool, error) {
		applied, err := b.outboxWriteVia(ctx, func() *projection.Gate { return current.Load() }, key, version)
		if errors.Is(err, projection.ErrLayoutMismatch) && to.VersionBuckets() != b.ks.VersionBuckets() {
			current.Store(newGate)
			applied, err = b.outboxWriteVia(ctx, current.Load, key, version)
		}
		return applied, err
	}
	newTarget := b.target
	newTarget.Keyspace = to
	var (
		stop      = make(chan struct{})
		wg        sync.WaitGroup
		written   atomic.Int64
		inBand    atomic.Int64
		minSeen   atomic.Int64
		readerErr atomic.Value
	)
	// Before each page, the outbox delivers three newer versions of odd rows
	// (some already copied, some not yet): writes certainly made during the
	// rebuild. A goroutine meanwhile updates even rows as fast as it can.
	src := &hookedSource{Source: b.source, onPage: func(ctx context.Context, page int) {
		for j := range 3 {
			key := rows[(page*74+j*134+1)%n|1].Key
			applied, err := write(ctx, key, int64(1000+page))
			if err != nil {
				readerErr.Store(err)
			}
			if applied {
				inBand.Add(1)
			}
		}
		time.Sleep(10 * time.Millisecond)
	}}
	r, err := New(src, newTarget, &Config{PageSize: 50})
	require.NoError(t, err)

	minSeen.Store(n + 1)
	valueKey := b.ks.ValueKey(b.target.target(""))
	wg.Add(2)
	go func() { // the outbox: newer versions of random rows
		defer wg.Done()
		version := int64(1)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			if i%n == 0 {
				version++
			}
			key := rows[(i*7919)%n&^1].Key
			applied, err := write(ctx, key, version)
			if err != nil {
				readerErr.Store(err)
				return
			}
			if applied {
				written.Add(1)
			}
		}
	}()
	go func() { // readers
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			var size int64
			var err error
			if b.kind == projection.KindSortedSet {
				size, err = b.client.ZCard(ctx, valueKey).Result()
			} else {
				size, err = b.client.HLen(ctx, valueKey).Result()
			}
			if err != nil {
				readerErr.Store(err)
				return
			}
			if size < minSeen.Load() {
				minSeen.Store(size)
			}
		}
	}()

	rep, err := r.Rebuild(ctx)
	close(stop)
	wg.Wait()
	require.NoError(t, err)
	require.True(t, rep.Switched)
	require.Nil(t, readerErr.Load())
	require.GreaterOrEqual(t, inBand.Load(), int64(3*n/50), "gate writes happened during the rebuild")
	require.Positive(t, rep.Kept, "copy rows kept newer live writes; the switch counted them as sent")
	t.Logf("gate writes during the rebuild: %d in band, %d concurrent", inBand.Load(), written.Load())
	require.GreaterOrEqual(t, minSeen.Load(), int64(n), "readers never saw a partial projection")

	// Every gate write survived: source and projection agree everywhere.
	check, err := New(b.source, newTarget, nil)
	require.NoError(t, err)
	run, err := check.Run(ctx, RunOptions{DryRun: true})
	require.NoError(t, err)
	require.Equal(t, map[Class]int64{ClassCurrent: n}, run.Counts)
}

func TestRebuildInProgress(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet)
	b.insert(t, "a", 1)
	marker, sv, _ := b.rebuildKeys()
	require.NoError(t, b.client.Set(context.Background(), marker, "someone-else", time.Minute).Err())
	b.project(t, "a", 1) // dual-written into the other rebuild's shadow
	_, err := b.reconciler(t, nil).Rebuild(context.Background())
	require.ErrorIs(t, err, ErrRebuildInProgress)
	require.Equal(t, []bool{true, true}, b.keysExist(t, marker, sv), "the other rebuild's keys are untouched")
}

// A refused rebuild is a failed one: logged at Warn with its error, as the
// metrics count it (Config.Logger promises a line per rebuild).
func TestRebuildRefusalLogged(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		kind projection.Kind
		want error
	}{
		{"InProgress", projection.KindSortedSet, ErrRebuildInProgress},
		{"Unsupported", projection.KindDocument, ErrRebuildUnsupported},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, tc.kind)
			if tc.kind != projection.KindDocument {
				marker, _, _ := b.rebuildKeys()
				require.NoError(t, b.client.Set(context.Background(), marker, "someone-else", time.Minute).Err())
			}
			var logs testenv.LogSink
			_, err := b.reconciler(t, &Config{Logger: logs.Logger()}).Rebuild(context.Background())
			require.ErrorIs(t, err, tc.want)
			lines := logs.Lines(t, "reconcile rebuild finished")
			require.Len(t, lines, 1, "one line for the rebuild")
			require.Equal(t, "WARN", lines[0]["level"])
			require.Contains(t, lines[0]["error"], err.Error())
		})
	}
}

func TestRebuildAborted(t *testing.T) {
	t.Parallel()
	t.Run("MarkerExpired", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindSortedSet)
		b.insertMany(t, 30)
		b.project(t, "orphan", 1)
		src := &hookedSource{Source: b.source, onPage: func(context.Context, int) { time.Sleep(250 * time.Millisecond) }}
		r, err := New(src, b.target, &Config{PageSize: 10, RebuildMarkerTTL: 200 * time.Millisecond})
		require.NoError(t, err)
		rep, err := r.Rebuild(context.Background())
		require.ErrorIs(t, err, ErrRebuildAborted)
		require.False(t, rep.Switched)
		require.True(t, b.state(t, r, "orphan").HasValue, "live projection untouched")
		b.requireNoRebuildLeft(t)
	})
	t.Run("MarkerGoneAtSwitch", func(t *testing.T) {
		t.Parallel()
		// The switch's own reply says the marker is gone (deleted as the
		// switch is sent, after the whole copy, so that the copy cannot
		// notice first): a definite abort, neither uncertain nor "in
		// progress", with the shadow keys removed.
		b := setup(t, projection.KindSortedSet)
		b.projectRows(t, b.insertMany(t, 30))
		b.project(t, "orphan", 1)
		marker, sv, sver := b.rebuildKeys()
		hook := &rebuildStepHold{step: "switch", before: func(context.Context) {
			if err := b.client.Del(context.Background(), marker).Err(); err != nil {
				t.Error(err)
			}
		}}
		var logs bytes.Buffer
		logger := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
		r := b.withHook(t, hook).reconciler(t, &Config{PageSize: 10, RebuildMarkerTTL: time.Minute, Logger: logger})
		rep, err := r.Rebuild(context.Background())
		require.True(t, hook.done.Load(), "the switch was sent")
		require.ErrorIs(t, err, ErrRebuildAborted)
		require.NotErrorIs(t, err, ErrRebuildUncertain)
		require.NotErrorIs(t, err, ErrRebuildInProgress)
		require.False(t, rep.Switched)
		require.EqualValues(t, 30, rep.Rows)
		require.True(t, b.state(t, r, "orphan").HasValue, "live projection untouched")
		require.Equal(t, []bool{false, false, false, false}, b.keysExist(t, marker, sv, sver, b.copyKey()))
		require.Contains(t, logs.String(), "level=WARN msg=\"reconcile rebuild finished\"", "a failed rebuild is a warning, as a failed Run is")
	})
	t.Run("UnreadableShadowLayout", func(t *testing.T) {
		t.Parallel()
		// A hand edit leaves the shadow layout key holding no bucket
		// count mid-copy: the copy fails, and its abort still removes
		// the marker and the shadow keys. Left, the marker would make
		// the gate refuse every live write until its TTL.
		b := setup(t, projection.KindSortedSet)
		b.projectRows(t, b.insertMany(t, 20))
		shadowLayout := b.ks.ShadowLayoutKey(b.target.Name, b.kind)
		src := &hookedSource{Source: b.source, onPage: func(_ context.Context, n int) {
			if n == 2 {
				if err := b.client.Set(context.Background(), shadowLayout, "junk", 0).Err(); err != nil {
					t.Error(err)
				}
			}
		}}
		r, err := New(src, b.target, &Config{PageSize: 5, RebuildMarkerTTL: time.Minute})
		require.NoError(t, err)
		rep, err := r.Rebuild(context.Background())
		require.ErrorIs(t, err, projection.ErrLayoutMismatch)
		require.False(t, rep.Switched)
		marker, sv, _ := b.rebuildKeys()
		require.Equal(t, []bool{false, false, false}, b.keysExist(t, marker, sv, shadowLayout))
		_, err = b.gate.Apply(context.Background(), []projection.Write{{Target: b.target.target("k-new"), Version: 1, Value: b.value("k-new", 1)}})
		require.NoError(t, err, "a live write after the failed rebuild")
		rep, err = r.Rebuild(context.Background())
		require.NoError(t, err, "the next rebuild")
		require.True(t, rep.Switched)
	})
	t.Run("Cancelled", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindHash)
		b.insertMany(t, 30)
		b.project(t, "orphan", 1)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		src := &hookedSource{Source: b.source, onPage: func(_ context.Context, n int) {
			if n == 2 {
				cancel()
			}
		}}
		r, err := New(src, b.target, &Config{PageSize: 10})
		require.NoError(t, err)
		rep, err := r.Rebuild(ctx)
		require.ErrorIs(t, err, context.Canceled)
		require.False(t, rep.Switched)
		require.True(t, b.state(t, r, "orphan").HasValue, "live projection untouched")
		b.requireNoRebuildLeft(t)
	})
}

// errLost stands for a reply lost on the way back (a timeout, a dropped
// connection).
var errLost = errors.New("test: reply lost")

// loseReply is a go-redis hook that fails the first call of one rebuild.lua
// step with errLost, after Redis ran it (sent) or without sending it.
type loseReply struct {
	testenv.PassThroughHook
	step string
	sent bool
	done atomic.Bool
}

func (h *loseReply) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.done.Load() || rebuildStepOf(cmd) != h.step {
			return next(ctx, cmd)
		}
		if h.sent {
			if err := next(ctx, cmd); err != nil {
				return err // NOSCRIPT: the script is retried with EVAL
			}
		}
		h.done.Store(true)
		cmd.SetErr(errLost)
		return errLost
	}
}

// loseSecondLayoutRead is a go-redis hook that fails the second pipeline
// reading the layout keys (MGET) with errLost after Redis ran it, and
// records the rebuild.lua steps sent that read them first (not the copy's).
type loseSecondLayoutRead struct {
	testenv.PassThroughHook
	mu    sync.Mutex
	reads int
	steps []string
}

func (h *loseSecondLayoutRead) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if step := rebuildStepOf(cmd); slices.Contains([]string{"start", "refresh", "switch", "abort"}, step) {
			h.mu.Lock()
			h.steps = append(h.steps, step)
			h.mu.Unlock()
		}
		return next(ctx, cmd)
	}
}

func (h *loseSecondLayoutRead) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		if len(cmds) == 0 || cmds[0].Name() != "mget" {
			return err
		}
		h.mu.Lock()
		h.reads++
		lose := h.reads == 2
		h.mu.Unlock()
		if !lose {
			return err
		}
		for _, cmd := range cmds {
			cmd.SetErr(errLost)
		}
		return errLost
	}
}

// scripts returns the rebuild.lua steps sent, each once (a NOSCRIPT retry
// with EVAL is not a second step).
func (h *loseSecondLayoutRead) scripts() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Compact(slices.Clone(h.steps))
}

// rebuildStepOf returns ARGV[1] of an EVAL or EVALSHA, the step for
// rebuild.lua ("" for other commands).
func rebuildStepOf(cmd redis.Cmder) string {
	args := cmd.Args()
	if name := cmd.Name(); (name != "evalsha" && name != "eval") || len(args) < 3 {
		return ""
	}
	numKeys, ok := args[2].(int)
	if !ok || len(args) <= 3+numKeys {
		return ""
	}
	step, _ := args[3+numKeys].(string)
	return step
}

// withLostReply returns b on a client of its own that loses the reply to
// the first call of step.
func (b *testBundle) withLostReply(t *testing.T, step string, sent bool) *testBundle {
	return b.withHook(t, &loseReply{step: step, sent: sent})
}

// withHook returns b on a client of its own with hook added.
func (b *testBundle) withHook(t *testing.T, hook redis.Hook) *testBundle {
	opts := *b.client.(*redis.Client).Options()
	client := redis.NewClient(&opts)
	t.Cleanup(func() { _ = client.Close() })
	client.AddHook(hook)
	out := *b
	out.client = client
	out.gate = projection.NewGate(client, b.ks)
	out.target.Client = client
	return &out
}

func TestRebuildLostReply(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// Start ran, its reply was lost: the marker must not stay behind to
	// refuse every rebuild (ErrRebuildInProgress) until its TTL expires.
	t.Run("Start", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindSortedSet).withBuckets(t, 3)
		b.projectRows(t, b.insertMany(t, 20))
		b.project(t, "orphan", 1)
		lossy := b.withLostReply(t, "start", true)
		rep, err := lossy.reconciler(t, nil).Rebuild(ctx)
		require.ErrorIs(t, err, errLost)
		require.False(t, rep.Switched)
		marker, sv, _ := b.rebuildKeys()
		shadowLayout := b.ks.ShadowLayoutKey(testBoard, b.kind)
		require.Equal(t, []bool{false, false, false}, b.keysExist(t, marker, sv, shadowLayout))
		require.True(t, b.state(t, b.reconciler(t, nil), "orphan").HasValue, "live projection untouched")

		rep, err = b.reconciler(t, nil).Rebuild(ctx)
		require.NoError(t, err, "no marker left to hold the next rebuild off")
		require.True(t, rep.Switched)
	})

	// Start was refused (another rebuild's marker), and that reply lost:
	// the abort that follows must leave the other rebuild's keys alone.
	t.Run("StartRefused", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindSortedSet)
		b.insert(t, "a", 1)
		marker, sv, _ := b.rebuildKeys()
		require.NoError(t, b.client.Set(ctx, marker, "someone-else", time.Minute).Err())
		b.project(t, "a", 1) // dual-written into the other rebuild's shadow
		_, err := b.withLostReply(t, "start", true).reconciler(t, nil).Rebuild(ctx)
		require.ErrorIs(t, err, errLost)
		require.Equal(t, []bool{true, true}, b.keysExist(t, marker, sv), "the other rebuild's keys are untouched")
		require.Equal(t, "someone-else", b.client.Get(ctx, marker).Val())
	})

	// The switch ran, its reply was lost: the outcome is unknown, not "not
	// switched", and the abort that follows leaves the switched projection
	// whole.
	t.Run("SwitchApplied", func(t *testing.T) {
		t.Parallel()
		for _, n := range []int{0, 4} {
			t.Run(fmt.Sprintf("Buckets%d", n), func(t *testing.T) {
				t.Parallel()
				b := setup(t, projection.KindHash).withBuckets(t, n)
				b.projectRows(t, b.insertMany(t, 20))
				b.project(t, "orphan", 1)
				lossy := b.withLostReply(t, "switch", true)
				rep, err := lossy.reconciler(t, nil).Rebuild(ctx)
				require.ErrorIs(t, err, ErrRebuildUncertain)
				require.ErrorIs(t, err, errLost)
				require.False(t, rep.Switched)

				run, err := b.reconciler(t, nil).Run(ctx, RunOptions{DryRun: true})
				require.NoError(t, err)
				require.Equal(t, map[Class]int64{ClassCurrent: 20}, run.Counts, "switched: the orphan is gone, the rest intact")
				marker, sv, _ := b.rebuildKeys()
				require.Equal(t, []bool{false, false}, b.keysExist(t, marker, sv))
			})
		}
	})

	// The read of the layout keys that precedes the switch lost its reply:
	// the switch was certainly not sent, so the outcome is known (not
	// switched), not ErrRebuildUncertain, and the old projection is live.
	t.Run("ReadBeforeSwitchLost", func(t *testing.T) {
		t.Parallel()
		for _, kind := range []projection.Kind{projection.KindSortedSet, projection.KindHash} {
			t.Run(kind.String(), func(t *testing.T) {
				t.Parallel()
				b := setup(t, kind)
				b.projectRows(t, b.insertMany(t, 10)[:5]) // 5 missing: the switch would add them
				// Its second read precedes the switch (the first, the start).
				h := &loseSecondLayoutRead{}
				// A TTL of an hour: no refresh of the marker reads the layout.
				rep, err := b.withHook(t, h).reconciler(t, &Config{PageSize: 3, RebuildMarkerTTL: time.Hour}).Rebuild(ctx)
				require.ErrorIs(t, err, errLost)
				require.NotErrorIs(t, err, ErrRebuildUncertain, "no switch was sent: %v", err)
				require.False(t, rep.Switched)
				require.Equal(t, []string{"start", "abort"}, h.scripts(), "the switch was not sent")
				run, err := b.reconciler(t, nil).Run(ctx, RunOptions{DryRun: true})
				require.NoError(t, err)
				require.Equal(t, map[Class]int64{ClassCurrent: 5, ClassMissing: 5}, run.Counts, "the old projection is live")
			})
		}
	})

	// The switch never reached Redis: still unknown to the caller, and the
	// abort leaves the old projection live.
	t.Run("SwitchNotSent", func(t *testing.T) {
		t.Parallel()
		b := setup(t, projection.KindSortedSet)
		b.projectRows(t, b.insertMany(t, 20))
		b.project(t, "orphan", 1)
		rep, err := b.withLostReply(t, "switch", false).reconciler(t, nil).Rebuild(ctx)
		require.ErrorIs(t, err, ErrRebuildUncertain)
		require.ErrorIs(t, err, errLost)
		require.Equal(t, 1, strings.Count(err.Error(), "reconcile: "), "the package is named once: %q", err.Error())
		require.False(t, rep.Switched)
		require.True(t, b.state(t, b.reconciler(t, nil), "orphan").HasValue, "not switched")
		b.requireNoRebuildLeft(t)
	})
}

// dropConn closes the connection right after Redis has run the first
// command whose bytes contain marker, so its reply never arrives (io.EOF),
// as when Redis, a proxy or a load balancer drops a connection after a
// script ran. go-redis then resends the command on a new connection by
// itself (Options.MaxRetries): Redis runs it twice.
type dropConn struct {
	net.Conn
	marker []byte
	fired  *atomic.Bool
	armed  atomic.Bool
}

func (c *dropConn) Write(b []byte) (int, error) {
	if !c.fired.Load() && bytes.Contains(b, c.marker) && c.fired.CompareAndSwap(false, true) {
		c.armed.Store(true)
	}
	return c.Conn.Write(b)
}

func (c *dropConn) Read(b []byte) (int, error) {
	if c.armed.Load() {
		time.Sleep(100 * time.Millisecond) // let Redis run the command
		_ = c.Conn.Close()
		return 0, io.EOF
	}
	return c.Conn.Read(b)
}

// withDroppedReply returns b on a client of its own whose connection drops
// once, after the first rebuild.lua call of step reached Redis; fired
// reports whether it did.
func (b *testBundle) withDroppedReply(t *testing.T, step string) (out *testBundle, fired *atomic.Bool) {
	opts := *b.client.(*redis.Client).Options()
	require.Positive(t, opts.MaxRetries, "go-redis resends by default")
	fired = new(atomic.Bool)
	opts.Dialer = func(ctx context.Context, network, addr string) (net.Conn, error) {
		var d net.Dialer
		c, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &dropConn{Conn: c, marker: []byte("\r\n" + step + "\r\n"), fired: fired}, nil
	}
	client := redis.NewClient(&opts)
	t.Cleanup(func() { _ = client.Close() })
	// Loaded, so that the step's EVALSHA runs it rather than answering
	// NOSCRIPT (and the EVAL that follows run it once).
	require.NoError(t, redis.NewScript(rebuildSource).Load(context.Background(), client).Err())
	o := *b
	o.client = client
	o.gate = projection.NewGate(client, b.ks)
	o.target.Client = client
	return &o, fired
}

// TestRebuildStepResent: the connection drops after Redis ran a step and
// go-redis resends it, so Redis runs it twice with the same token. The
// rerun must answer as the first run did: a start must not find its own
// marker and report ErrRebuildInProgress (leaving that marker to hold off
// every rebuild for its TTL), and a switch must not find its marker gone
// and report ErrRebuildAborted (live projection untouched) when the
// shadow did replace the live keys.
func TestRebuildStepResent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, step := range []string{"start", "switch"} {
		for _, c := range []struct {
			name     string
			kind     projection.Kind
			from, to int // version buckets before and after the rebuild
		}{
			{"SortedSet", projection.KindSortedSet, 0, 0},
			{"HashBuckets", projection.KindHash, 4, 4},
			{"Migration", projection.KindSortedSet, 0, 3},
		} {
			t.Run(strings.ToUpper(step[:1])+step[1:]+"/"+c.name, func(t *testing.T) {
				t.Parallel()
				b := setup(t, c.kind).withBuckets(t, c.from)
				b.projectRows(t, b.insertMany(t, 20))
				b.project(t, "orphan", 1)
				to := b.withBuckets(t, c.to)
				lossy, fired := to.withDroppedReply(t, step)
				rep, err := lossy.reconciler(t, nil).Rebuild(ctx)
				require.True(t, fired.Load(), "the connection dropped after the %s ran", step)
				require.NoError(t, err)
				require.True(t, rep.Switched)

				run, err := to.reconciler(t, nil).Run(ctx, RunOptions{DryRun: true})
				require.NoError(t, err)
				require.Equal(t, map[Class]int64{ClassCurrent: 20}, run.Counts, "switched: the orphan is gone, the rest intact")
				marker, sv, _ := b.rebuildKeys()
				require.Equal(t, []bool{false, false, false}, b.keysExist(t, marker, sv, b.copyKey()))

				rep, err = to.reconciler(t, nil).Rebuild(ctx)
				require.NoError(t, err, "nothing left to hold the next rebuild off")
				require.True(t, rep.Switched)
			})
		}
	}
}

// pausedSource reads a page from the real source, then calls after (which
// may block) before returning the rows.
type pausedSource struct {
	Source
	after func(n int)
	n     int
	mu    sync.Mutex
}

func (s *pausedSource) Page(ctx context.Context, c Cursor, limit int) ([]Row, error) {
	rows, err := s.Source.Page(ctx, c, limit)
	s.mu.Lock()
	s.n++
	n := s.n
	s.mu.Unlock()
	if s.after != nil {
		s.after(n)
	}
	return rows, err
}

// TestRebuildAfterAStalledRebuild stalls rebuild A after it read a page,
// past its marker's expiry; the row "ghost" is deleted from the source and
// rebuild B starts. When A resumes, its stale page must not land in B's
// shadow keys (the copy is checked against the marker's token in the script
// that writes it): A aborts, and B's switch leaves no trace of "ghost".
func TestRebuildAfterAStalledRebuild(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet)
	ctx := context.Background()
	rows := b.insertMany(t, 25)
	ghost := b.insert(t, "ghost", 7) // sorts before "k…": on A's first page
	b.projectRows(t, append(rows, ghost))

	aReadPage1 := make(chan struct{})
	aGo := make(chan struct{})
	srcA := &pausedSource{Source: b.source, after: func(n int) {
		if n == 1 {
			close(aReadPage1)
			<-aGo
		}
	}}
	rA, err := New(srcA, b.target, &Config{PageSize: 10, RebuildMarkerTTL: 200 * time.Millisecond})
	require.NoError(t, err)

	var (
		wg     sync.WaitGroup
		errA   error
		repA   *RebuildReport
		errB   error
		repB   *RebuildReport
		bStart = make(chan struct{})
		bGo    = make(chan struct{})
		aDone  = make(chan struct{})
		bDone  = make(chan struct{})
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(aDone)
		repA, errA = rA.Rebuild(ctx)
	}()
	select { // A ends before its first page if its start fails
	case <-aReadPage1:
	case <-aDone:
		t.Fatalf("A ended before its first page: %v", errA)
	}
	time.Sleep(400 * time.Millisecond) // A's marker expires (A stalled: GC, slow PG, ...)
	_, err = b.pool.Exec(ctx, `DELETE FROM items WHERE board = $1 AND key = 'ghost'`, testBoard)
	require.NoError(t, err)

	srcB := &hookedSource{Source: b.source, onPage: func(_ context.Context, n int) {
		if n == 1 {
			close(bStart)
			<-bGo
		}
	}}
	rB, err := New(srcB, b.target, &Config{PageSize: 10})
	require.NoError(t, err)
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(bDone)
		repB, errB = rB.Rebuild(ctx)
	}()
	select {
	case <-bStart: // B's marker and (empty) shadow keys exist now
	case <-bDone:
		close(aGo)
		t.Fatalf("B ended before its first page: %v", errB)
	}
	// A resumes and tries to copy its stale first page into the shadow
	// keys, which are B's now.
	close(aGo)
	<-aDone
	close(bGo)
	wg.Wait()
	require.ErrorIs(t, errA, ErrRebuildAborted)
	require.NoError(t, errB)
	require.True(t, repB.Switched)

	require.Zero(t, repA.Rows, "A's stale page was refused")
	run, err := b.reconciler(t, nil).Run(ctx, RunOptions{DryRun: true})
	require.NoError(t, err)
	require.Equal(t, map[Class]int64{ClassCurrent: 25}, run.Counts,
		"the projection holds a row the source deleted before B started")
}

// copyKey is the collection's rebuild copy count.
func (b *testBundle) copyKey() string { return b.ks.RebuildCopyKey(b.target.Name, b.kind) }

// waitShadow waits until the shadow value key holds want entries; hooks
// run on the reader's goroutine, so it reports with t.Errorf.
func (b *testBundle) waitShadow(ctx context.Context, t *testing.T, admin redis.UniversalClient, want int64) {
	key := b.ks.ShadowValueKey(b.target.Name, b.kind)
	for deadline := time.Now().Add(10 * time.Second); ; {
		size, err := admin.HLen(ctx, key).Result()
		if b.kind == projection.KindSortedSet {
			size, err = admin.ZCard(ctx, key).Result()
		}
		if err == nil && size >= want {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("shadow holds %d, want %d: %v", size, want, err)
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestRebuildRefusesAShadowThatLostCopyWrites: Redis loses part of a
// rebuild's copy but keeps its marker (a failover to a replica that had
// the marker and the first pages only, a restart from a snapshot taken
// mid-copy). The switch must not rename that partial shadow over the live
// projection, which would delete the members that survived: the copy
// count, written in the script that writes each page, falls short of the
// rows sent, and the rebuild aborts with the live projection untouched.
func TestRebuildRefusesAShadowThatLostCopyWrites(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// The review's reproduction: a real restart from a snapshot that holds
	// the marker and the first of three pages.
	t.Run("RestartFromSnapshot", func(t *testing.T) {
		t.Parallel()
		rs := testenv.StartRedis(t)
		b := setupWith(t, projection.KindSortedSet, rs.Client(t), "rb:")
		const n = 300
		b.projectRows(t, b.insertMany(t, n))
		admin := rs.Client(t)
		src := &hookedSource{Source: b.source, onPage: func(ctx context.Context, page int) {
			switch page {
			case 2: // page 1 is in the shadow: a snapshot
				b.waitShadow(ctx, t, admin, 100)
				if err := admin.Save(ctx).Err(); err != nil {
					t.Errorf("SAVE: %v", err)
				}
			case 4: // pages 2 and 3 copied: Redis restarts from the snapshot
				b.waitShadow(ctx, t, admin, n)
				if err := rs.Kill(); err != nil {
					t.Errorf("kill: %v", err)
				}
				if err := rs.Start(); err != nil {
					t.Errorf("start: %v", err)
				}
			}
		}}
		r, err := New(src, b.target, &Config{PageSize: 100})
		require.NoError(t, err)
		rep, err := r.Rebuild(ctx)
		require.ErrorIs(t, err, ErrRebuildAborted)
		require.NotErrorIs(t, err, ErrRebuildUncertain)
		require.False(t, rep.Switched)
		require.EqualValues(t, n, rep.Rows)
		require.EqualValues(t, n, admin.ZCard(ctx, b.ks.ValueKey(b.target.target(""))).Val(), "live projection untouched")
		b.requireNoRebuildLeft(t)

		rep, err = b.reconciler(t, nil).Rebuild(ctx)
		require.NoError(t, err, "once Redis is stable, Rebuild again")
		require.True(t, rep.Switched)
		run, err := b.reconciler(t, nil).Run(ctx, RunOptions{DryRun: true})
		require.NoError(t, err)
		require.Equal(t, map[Class]int64{ClassCurrent: n}, run.Counts)
	})

	// The same loss for every kind and layout, made by putting the
	// rebuild's keys back to their state after the first page once the
	// copy is done (as a restart from a snapshot taken then would).
	for _, kind := range []projection.Kind{projection.KindSortedSet, projection.KindHash} {
		for _, buckets := range []int{0, 4} {
			t.Run(fmt.Sprintf("LostPages%s/Buckets%d", kindName(kind), buckets), func(t *testing.T) {
				t.Parallel()
				b := setup(t, kind).withBuckets(t, buckets)
				const n = 40
				b.projectRows(t, b.insertMany(t, n))
				b.project(t, "orphan", 1) // a switch would remove it
				before := b.snapshot(t)
				var saved map[string]string
				src := &hookedSource{Source: b.source, onPage: func(ctx context.Context, page int) {
					switch page {
					case 2:
						b.waitShadow(ctx, t, b.client, 10)
						saved = b.dumpCopy(ctx, t)
					case 5: // the empty page that ends the copy
						b.waitShadow(ctx, t, b.client, n)
						b.restoreCopy(ctx, t, saved)
					}
				}}
				r, err := New(src, b.target, &Config{PageSize: 10})
				require.NoError(t, err)
				rep, err := r.Rebuild(ctx)
				require.ErrorIs(t, err, ErrRebuildAborted)
				require.False(t, rep.Switched)
				require.EqualValues(t, n, rep.Rows)
				require.Contains(t, saved, b.copyKey(), "the snapshot held a count of the first page")
				require.Equal(t, before, b.snapshot(t), "live projection untouched, no rebuild key left")
			})
		}
	}
}

// TestRebuildRefusesAShadowThatLostAKey: an allkeys-* eviction can take a
// shadow key alone and leave the copy count complete. The switch used to
// trust the count, remove the live keys and install nothing (an evicted
// shadow value) or values without versions: it refuses a shadow holding
// fewer values or versions than rows sent.
func TestRebuildRefusesAShadowThatLostAKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, kind := range []projection.Kind{projection.KindSortedSet, projection.KindHash} {
		for _, buckets := range []int{0, 4} {
			for _, lost := range []string{"Values", "Versions"} {
				t.Run(fmt.Sprintf("%s/Buckets%d/%s", kindName(kind), buckets, lost), func(t *testing.T) {
					t.Parallel()
					b := setup(t, kind).withBuckets(t, buckets)
					const n = 40
					b.projectRows(t, b.insertMany(t, n))
					before := b.snapshot(t)
					k, name := b.kind, b.target.Name
					evict := []string{b.ks.ShadowValueKey(name, k)}
					if lost == "Versions" {
						evict = b.ks.ShadowVersionKeys(name, k)
					}
					src := &hookedSource{Source: b.source, onPage: func(ctx context.Context, page int) {
						if page != 5 { // the empty page that ends the copy
							return
						}
						b.waitShadow(ctx, t, b.client, n)
						if err := b.client.Del(ctx, evict...).Err(); err != nil {
							t.Errorf("DEL %v: %v", evict, err)
						}
					}}
					r, err := New(src, b.target, &Config{PageSize: 10})
					require.NoError(t, err)
					rep, err := r.Rebuild(ctx)
					require.ErrorIs(t, err, ErrRebuildAborted)
					require.ErrorContains(t, err, "an eviction")
					require.False(t, rep.Switched)
					require.EqualValues(t, n, rep.Rows)
					require.Equal(t, before, b.snapshot(t), "live projection untouched, no rebuild key left")
				})
			}
		}
	}
}

// TestRebuildRefusesAShadowWhoseLossNewMembersMadeUpFor: the live writes
// of a rebuild are dual-written into the shadow too, and new members among
// them (new users' first scores) raised the shadow's counts back to the
// rows copied after an eviction took the copied ones: the switch went
// ahead, installing a shadow without the copied members (or without their
// versions, which lets any older redelivery in). Every shadow write counts
// what it creates, and the switch refuses a shadow holding less.
func TestRebuildRefusesAShadowWhoseLossNewMembersMadeUpFor(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, kind := range []projection.Kind{projection.KindSortedSet, projection.KindHash} {
		for _, buckets := range []int{0, 4} {
			for _, lost := range []string{"Values", "Versions", "OneBucket"} {
				if lost == "OneBucket" && buckets == 0 {
					continue
				}
				t.Run(fmt.Sprintf("%s/Buckets%d/%s", kindName(kind), buckets, lost), func(t *testing.T) {
					t.Parallel()
					b := setup(t, kind).withBuckets(t, buckets)
					const n = 40
					b.projectRows(t, b.insertMany(t, n))
					k, name := b.kind, b.target.Name
					evict := []string{b.ks.ShadowValueKey(name, k)}
					switch lost {
					case "Versions":
						evict = b.ks.ShadowVersionKeys(name, k)
					case "OneBucket":
						evict = b.ks.ShadowVersionKeys(name, k)[:1]
					}
					src := &hookedSource{Source: b.source, onPage: func(ctx context.Context, page int) {
						if page != 5 { // the empty page that ends the copy
							return
						}
						b.waitShadow(ctx, t, b.client, n)
						if err := b.client.Del(ctx, evict...).Err(); err != nil {
							t.Errorf("DEL %v: %v", evict, err)
						}
						// New entities, before the copy's cursor: only the
						// live writes bring them to the shadow.
						for i := range n {
							key := fmt.Sprintf("a%07d", i)
							b.insert(t, key, 1)
							if o := b.project(t, key, 1); o != projection.OutcomeApplied {
								t.Errorf("project %s: %v", key, o)
							}
						}
					}}
					r, err := New(src, b.target, &Config{PageSize: 10})
					require.NoError(t, err)
					rep, err := r.Rebuild(ctx)
					require.ErrorIs(t, err, ErrRebuildAborted)
					require.ErrorContains(t, err, "an eviction")
					require.False(t, rep.Switched)
					run, err := r.Run(ctx, RunOptions{DryRun: true})
					require.NoError(t, err)
					require.Zero(t, run.Drift(), "the live projection holds every entity: %v", run.Counts)
					require.EqualValues(t, 2*n, run.Checked)
				})
			}
		}
	}
}

// runCopyTwice is a go-redis hook that runs the first call of a counted
// shadow copy twice, as a client that retried a call whose reply was lost
// after Redis ran it would.
type runCopyTwice struct {
	testenv.PassThroughHook
	done atomic.Bool
}

func (h *runCopyTwice) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		// ARGV[1] of a counted copy is "shadow <token> <batch>".
		if f := strings.Fields(rebuildStepOf(cmd)); len(f) == 3 && f[0] == "shadow" && !h.done.Load() {
			if err := next(ctx, cmd); err != nil {
				return err
			}
			h.done.Store(true)
		}
		return next(ctx, cmd)
	}
}

// TestRebuildCopyRunTwice: a copy page that Redis ran twice (a retry after
// a lost reply) is counted once, so the rebuild still switches.
func TestRebuildCopyRunTwice(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindHash)
	b.projectRows(t, b.insertMany(t, 30))
	b.project(t, "orphan", 1)
	hook := &runCopyTwice{}
	twice := b.withHook(t, hook)
	rep, err := twice.reconciler(t, &Config{PageSize: 10}).Rebuild(context.Background())
	require.NoError(t, err)
	require.True(t, hook.done.Load(), "a copy page ran twice")
	require.True(t, rep.Switched)
	require.EqualValues(t, 30, rep.Rows)
	require.False(t, b.state(t, b.reconciler(t, nil), "orphan").HasValue, "switched")
	require.Equal(t, []bool{false}, b.keysExist(t, b.copyKey()))
}

// TestRebuildCountsConflicts: a live write at a source row's version with
// another value (a source that reused a version) lands in the shadow keys
// during a rebuild; the copy of that row is then a conflict, counted among
// the kept rows and apart, and warned about. The switch keeps the live
// write's value, which a Run then finds corrupt.
func TestRebuildCountsConflicts(t *testing.T) {
	t.Parallel()
	forKinds(t, collectionKinds, func(t *testing.T, b *testBundle) {
		ctx := context.Background()
		const n = 120
		rows := b.insertMany(t, n)
		b.projectRows(t, rows)
		var (
			once     sync.Once
			outcomes []projection.Outcome
			hookErr  error
		)
		src := &hookedSource{Source: b.source, onPage: func(ctx context.Context, _ int) {
			once.Do(func() { // before the first page is read: after the marker is set
				row := rows[n/2]
				outcomes, hookErr = b.gate.Apply(ctx, []projection.Write{{
					Target: b.target.target(row.Key), Version: row.Version, Value: b.value(row.Key, row.Version+1000),
				}})
			})
		}}
		var logs testenv.LogSink
		r, err := New(src, b.target, &Config{PageSize: 50, Logger: logs.Logger()})
		require.NoError(t, err)
		rep, err := r.Rebuild(ctx)
		require.NoError(t, err)
		require.NoError(t, hookErr)
		require.Equal(t, []projection.Outcome{projection.OutcomeConflict}, outcomes, "the live keys held the source's value")
		require.True(t, rep.Switched)
		require.Equal(t, RebuildReport{Rows: n, Applied: n - 1, Kept: 1, Conflicts: 1, Switched: true},
			RebuildReport{Rows: rep.Rows, Applied: rep.Applied, Kept: rep.Kept, Conflicts: rep.Conflicts, Switched: rep.Switched})
		warned := logs.Lines(t, "reconcile rebuild: source rows met a live write of their version with another value; "+
			"the live write's value was kept (run the reconciler to repair it from the source)")
		require.Len(t, warned, 1)
		require.Equal(t, 1.0, warned[0]["conflicts"])

		run, err := b.reconciler(t, nil).Run(ctx, RunOptions{DryRun: true})
		require.NoError(t, err)
		require.Equal(t, map[Class]int64{ClassCurrent: n - 1, ClassCorrupt: 1}, run.Counts)
	})
}

// cancelAfterStep is a go-redis hook that calls cancel once Redis has
// answered a rebuild.lua step.
type cancelAfterStep struct {
	testenv.PassThroughHook
	step   string
	cancel context.CancelFunc
}

func (h *cancelAfterStep) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if err == nil && rebuildStepOf(cmd) == h.step && h.cancel != nil {
			h.cancel()
		}
		return err
	}
}

// TestRebuildCancelledRightAfterStart cancels ctx once the start step has
// set the marker, before the copy reads a page. The copy's read-ahead then
// either fails its first read or stops without reading at all, having
// copied nothing; either way the rebuild must abort, not switch the empty
// shadow in (its copy count, 0, equals the rows it sent). Whichever the
// read-ahead does is up to Go's select, so the rebuild is tried several
// times.
func TestRebuildCancelledRightAfterStart(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet)
	b.projectRows(t, b.insertMany(t, 20))
	b.project(t, "orphan", 1)
	hook := &cancelAfterStep{step: "start"}
	r := b.withHook(t, hook).reconciler(t, &Config{PageSize: 5})
	marker, sv, sver := b.rebuildKeys()
	for i := range 8 {
		ctx, cancel := context.WithCancel(context.Background())
		hook.cancel = cancel
		rep, err := r.Rebuild(ctx)
		cancel()
		require.ErrorIs(t, err, context.Canceled, "attempt %d", i)
		require.False(t, rep.Switched, "attempt %d", i)
		n, err := b.client.ZCard(context.Background(), b.ks.ValueKey(b.target.target(""))).Result()
		require.NoError(t, err)
		require.EqualValues(t, 21, n, "attempt %d: the live projection is untouched", i)
		require.Equal(t, []bool{false, false, false, false}, b.keysExist(t, marker, sv, sver, b.copyKey()), "attempt %d", i)
	}
}

// cancelAtEndSource calls wait and then cancel once the source has
// answered its last (empty) page.
type cancelAtEndSource struct {
	Source
	wait   func()
	cancel context.CancelFunc
}

func (s *cancelAtEndSource) Page(ctx context.Context, after Cursor, limit int) ([]Row, error) {
	rows, err := s.Source.Page(ctx, after, limit)
	if err == nil && len(rows) == 0 {
		s.wait()
		s.cancel()
	}
	return rows, err
}

// TestRebuildCancelledAfterTheLastPage: ctx cancelled after the copy read
// the source's end and wrote every row, before the switch: the rebuild
// returns the cancellation and does not switch.
func TestRebuildCancelledAfterTheLastPage(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet)
	b.projectRows(t, b.insertMany(t, 20))
	b.project(t, "orphan", 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	src := &cancelAtEndSource{Source: b.source, cancel: cancel, wait: func() {
		b.waitShadow(context.Background(), t, b.client, 20) // the last page of rows is written
		time.Sleep(100 * time.Millisecond)                  // and its reply has reached the copy
	}}
	r, err := New(src, b.target, &Config{PageSize: 5})
	require.NoError(t, err)
	rep, err := r.Rebuild(ctx)
	require.ErrorIs(t, err, context.Canceled)
	require.False(t, rep.Switched)
	require.True(t, b.state(t, r, "orphan").HasValue, "live projection untouched")
	b.requireNoRebuildLeft(t)
}

// TestRebuildClearsADeadRebuildsShadow: a rebuild whose process died
// mid-copy leaves its shadow keys behind (only its marker expires). The
// next Rebuild's start clears them, so that none of their entries survives
// its switch: neither a member since deleted from the source nor a version
// ahead of the source's.
func TestRebuildClearsADeadRebuildsShadow(t *testing.T) {
	t.Parallel()
	forKinds(t, collectionKinds, func(t *testing.T, b *testBundle) {
		ctx := context.Background()
		b.projectRows(t, []Row{b.insert(t, "a", 1), b.insert(t, "b", 1)})
		_, sv, sver := b.rebuildKeys()
		// What the dead rebuild copied: "ghost" (deleted from the source
		// since) and "a" at a version the source never had.
		for member, version := range map[string]string{"ghost": "5", "a": "9"} {
			if b.kind == projection.KindSortedSet {
				require.NoError(t, b.client.ZAdd(ctx, sv, redis.Z{Score: 999, Member: member}).Err())
			} else {
				require.NoError(t, b.client.HSet(ctx, sv, member, "dead rebuild").Err())
			}
			require.NoError(t, b.client.HSet(ctx, sver, member, version).Err())
		}
		r := b.reconciler(t, nil)
		rep, err := r.Rebuild(ctx)
		require.NoError(t, err)
		require.True(t, rep.Switched)
		require.EqualValues(t, 2, rep.Applied, "every row copied into an empty shadow")
		require.Equal(t, Projected{}, b.state(t, r, "ghost"))
		run, err := r.Run(ctx, RunOptions{DryRun: true})
		require.NoError(t, err)
		require.Equal(t, map[Class]int64{ClassCurrent: 2}, run.Counts)
	})
}

// A rebuild whose copy Redis partly lost (its keys put back to their state
// after the first page, as a restart from a snapshot would) while live
// dual-writes created as many new members in the shadow as were lost: the
// shadow then holds as many values and versions as rows were copied and as
// members were created, and only the copy count ("rows") tells the loss.
// The switch must refuse it, or the copied members the loss took vanish
// from the live projection (the other lost-copy tests are refused by the
// held-members check too: mutation audit of 2026-12-07).
func TestRebuildRefusesLostCopyHiddenByDualWrites(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, projection.KindSortedSet)
	const n = 40
	b.projectRows(t, b.insertMany(t, n))
	var saved map[string]string
	src := &hookedSource{Source: b.source, onPage: func(ctx context.Context, page int) {
		switch page {
		case 2:
			b.waitShadow(ctx, t, b.client, 10)
			saved = b.dumpCopy(ctx, t)
		case 5: // the empty page that ends the copy
			b.waitShadow(ctx, t, b.client, n)
			b.restoreCopy(ctx, t, saved)
			// Live writes of new members, dual-written into the shadow,
			// as many as the loss took.
			for i := range n - 10 {
				out, err := b.gate.Apply(ctx, []projection.Write{{Target: b.target.target(fmt.Sprintf("new%02d", i)), Version: 1, Value: b.value("x", 1)}})
				if err != nil || out[0] != projection.OutcomeApplied {
					t.Errorf("dual write: %v %v", out, err)
				}
			}
		}
	}}
	r, err := New(src, b.target, &Config{PageSize: 10})
	require.NoError(t, err)
	rep, err := r.Rebuild(ctx)
	require.ErrorIs(t, err, ErrRebuildAborted)
	require.False(t, rep.Switched)
	require.EqualValues(t, 2*n-10, b.client.ZCard(ctx, b.ks.ValueKey(b.target.target(""))).Val(),
		"live projection keeps every copied member (and the new ones)")
}

// copyKeys are the keys a rebuild's copy lives in: the shadow's value,
// layout and version keys, and the copy count.
func (b *testBundle) copyKeys() []string {
	k, name := b.kind, b.target.Name
	return append([]string{b.ks.ShadowValueKey(name, k), b.ks.ShadowLayoutKey(name, k), b.copyKey()},
		b.ks.ShadowVersionKeys(name, k)...)
}

// dumpCopy returns a DUMP of each of copyKeys that exists, for
// restoreCopy: Redis as a snapshot taken now would restore it.
func (b *testBundle) dumpCopy(ctx context.Context, t *testing.T) map[string]string {
	saved := map[string]string{}
	for _, key := range b.copyKeys() {
		if v, err := b.client.Dump(ctx, key).Result(); err == nil {
			saved[key] = v
		} else if !errors.Is(err, redis.Nil) {
			t.Errorf("DUMP %s: %v", key, err)
		}
	}
	return saved
}

// restoreCopy puts copyKeys back as dumpCopy saved them, as a restart from
// that snapshot would: keys it did not save are deleted.
func (b *testBundle) restoreCopy(ctx context.Context, t *testing.T, saved map[string]string) {
	for _, key := range b.copyKeys() {
		if err := b.client.Del(ctx, key).Err(); err != nil {
			t.Errorf("DEL %s: %v", key, err)
		}
		if v, ok := saved[key]; ok {
			if err := b.client.Restore(ctx, key, 0, v).Err(); err != nil {
				t.Errorf("RESTORE %s: %v", key, err)
			}
		}
	}
}
