package reconcile

import (
	"context"
	"errors"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/projection"
)

// rebuildStepHold calls before(ctx) before a rebuild step named step is sent
// (once), and then sends it.
type rebuildStepHold struct {
	testenv.PassThroughHook
	step   string
	done   atomic.Bool
	before func(ctx context.Context)
}

func (h *rebuildStepHold) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if rebuildStepOf(cmd) == h.step && h.done.CompareAndSwap(false, true) {
			h.before(ctx)
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		return next(ctx, cmd)
	}
}

// TestRebuildSwitchedKeyTTL: the switched key lives "for twice
// Config.RepairTimeout or the marker TTL if longer" -- neither for ever nor
// for the shorter of the two.
func TestRebuildSwitchedKeyTTL(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name           string
		repair, marker time.Duration
	}{
		{"MarkerLonger", 10 * time.Second, time.Minute},
		{"RepairLonger", 50 * time.Second, time.Minute},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, projection.KindSortedSet)
			b.insert(t, "a", 1)
			rep, err := b.reconciler(t, &Config{RepairTimeout: c.repair, RebuildMarkerTTL: c.marker}).Rebuild(context.Background())
			require.NoError(t, err)
			require.True(t, rep.Switched)
			pttl, err := b.client.Do(context.Background(), "PTTL", rebuildSwitchedKey(b.ks, b.target.Name, b.kind)).Int64()
			require.NoError(t, err)
			want := max(c.marker, 2*c.repair).Milliseconds()
			require.LessOrEqual(t, pttl, want)
			require.Greater(t, pttl, want-5000)
		})
	}
}

// TestRebuildSwitchIgnoresCancellation: "The switch runs even if
// ctx is cancelled now": a ctx cancelled as the switch is sent does not
// stop it.
func TestRebuildSwitchIgnoresCancellation(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet)
	b.projectRows(t, b.insertMany(t, 10))
	b.project(t, "orphan", 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	hook := &rebuildStepHold{step: "switch", before: func(context.Context) { cancel() }}
	r := b.withHook(t, hook).reconciler(t, nil)
	rep, err := r.Rebuild(ctx)
	require.NoError(t, err)
	require.True(t, rep.Switched)
	require.False(t, b.state(t, r, "orphan").HasValue, "switched")
}

// TestRebuildStalledSwitchBounded: RepairTimeout bounds Rebuild's
// switch: a switch that gets no answer ends after it, uncertain, not when
// Redis answers.
func TestRebuildStalledSwitchBounded(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet)
	b.projectRows(t, b.insertMany(t, 10))
	hook := &rebuildStepHold{step: "switch", before: func(ctx context.Context) {
		select { // a Redis that does not answer, for up to 10s
		case <-ctx.Done():
		case <-time.After(10 * time.Second):
		}
	}}
	r := b.withHook(t, hook).reconciler(t, &Config{RepairTimeout: 300 * time.Millisecond})
	start := time.Now()
	rep, err := r.Rebuild(context.Background())
	require.ErrorIs(t, err, ErrRebuildUncertain)
	require.False(t, rep.Switched)
	require.Less(t, time.Since(start), 5*time.Second, "bounded by RepairTimeout")
}

// rebuildReadsHook watches the reads that precede each rebuild step (the
// rebuild's only pipelines of three MGETs on a single Redis), counted from
// 1: before(n), when set, runs before the n-th is sent and fails it with
// the error it returns; after(n), when set, runs once it was answered,
// before the step's script is sent.
type rebuildReadsHook struct {
	testenv.PassThroughHook
	n      atomic.Int64
	before func(n int64) error
	after  func(n int64)
}

func (h *rebuildReadsHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if len(cmds) != 4 || cmds[0].Name() != "mget" { // not a rebuild step's reads
			return next(ctx, cmds)
		}
		n := h.n.Add(1)
		if h.before != nil {
			if err := h.before(n); err != nil {
				for _, c := range cmds {
					c.SetErr(err)
				}
				return err
			}
		}
		err := next(ctx, cmds)
		if h.after != nil {
			h.after(n)
		}
		return err
	}
}

// TestRebuildSwitchNotSent: when the reads that precede the switch
// fail, the switch was never sent: Rebuild knows the live projection is the
// old one, aborts (marker and shadow removed) and does not call the
// outcome uncertain.
func TestRebuildSwitchNotSent(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet)
	b.projectRows(t, b.insertMany(t, 10))
	b.project(t, "orphan", 1)
	boom := errors.New("connection reset before the switch")
	hook := &rebuildReadsHook{before: func(n int64) error {
		if n == 2 { // start, then switch
			return boom
		}
		return nil
	}}
	r := b.withHook(t, hook).reconciler(t, nil)
	rep, err := r.Rebuild(context.Background())
	require.ErrorIs(t, err, boom)
	require.NotErrorIs(t, err, ErrRebuildUncertain)
	require.False(t, rep.Switched)
	require.True(t, b.state(t, r, "orphan").HasValue, "live projection untouched")
	b.requireNoRebuildLeft(t)
}

// TestRebuildSwitchRefusedByLayout: a switch refused before it is
// sent (the shadow layout key holds no bucket count) is a definite
// projection.ErrLayoutMismatch, not ErrRebuildUncertain.
func TestRebuildSwitchRefusedByLayout(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet)
	b.projectRows(t, b.insertMany(t, 10))
	b.project(t, "orphan", 1)
	hook := &rebuildReadsHook{before: func(n int64) error {
		if n == 2 {
			return b.client.Set(context.Background(), b.ks.ShadowLayoutKey(b.target.Name, b.kind), "garbage", 0).Err()
		}
		return nil
	}}
	r := b.withHook(t, hook).reconciler(t, nil)
	rep, err := r.Rebuild(context.Background())
	require.ErrorIs(t, err, projection.ErrLayoutMismatch)
	require.NotErrorIs(t, err, ErrRebuildUncertain)
	require.False(t, rep.Switched)
	require.True(t, b.state(t, r, "orphan").HasValue, "live projection untouched")
}

// TestRebuildSwitchRereadsAChangedLayout: the live layout key
// changes between the switch's reads and its script (a writer's first write
// into a collection that had none, here its layout key set to 4 buckets):
// the script touches nothing and answers so, and the step reads the layouts
// again, rather than failing the rebuild.
func TestRebuildSwitchRereadsAChangedLayout(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet)
	b.insertMany(t, 10)
	b.project(t, "orphan", 1)
	hook := &rebuildReadsHook{after: func(n int64) {
		if n == 2 { // start, then switch
			layout := b.ks.LayoutKey(b.target.Name, b.kind)
			require.NoError(t, b.client.Set(context.Background(), layout, "4", 0).Err())
		}
	}}
	r := b.withHook(t, hook).reconciler(t, nil)
	rep, err := r.Rebuild(context.Background())
	require.NoError(t, err)
	require.True(t, rep.Switched)
	require.EqualValues(t, 3, hook.n.Load(), "start, switch, switch again")
	run, err := r.Run(context.Background(), RunOptions{DryRun: true})
	require.NoError(t, err)
	require.Equal(t, map[Class]int64{ClassCurrent: 10}, run.Counts)
}

// rebuildReplyError is an error reply of Redis.
type rebuildReplyError string

func (e rebuildReplyError) Error() string { return string(e) }
func (rebuildReplyError) RedisError()     {}

// rebuildReplyHook replaces the reply to the first step named step with err,
// after Redis ran it.
type rebuildReplyHook struct {
	testenv.PassThroughHook
	step string
	done atomic.Bool
	err  error
}

func (h *rebuildReplyHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if err == nil && rebuildStepOf(cmd) == h.step && h.done.CompareAndSwap(false, true) {
			cmd.SetErr(h.err)
			return h.err
		}
		return err
	}
}

// TestRebuildSwitchStoppedHalfway: Redis Cluster stops a script
// that reaches a key no longer on the node ("non local key") after what it
// wrote before: a switch answered so may have run, and Rebuild must say
// ErrRebuildUncertain, not a definite failure.
func TestRebuildSwitchStoppedHalfway(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet)
	b.projectRows(t, b.insertMany(t, 10))
	b.project(t, "orphan", 1)
	hook := &rebuildReplyHook{step: "switch", err: rebuildReplyError("ERR Error running script: Script attempted to access a non local key in a cluster node")}
	r := b.withHook(t, hook).reconciler(t, nil)
	rep, err := r.Rebuild(context.Background())
	require.ErrorIs(t, err, ErrRebuildUncertain)
	require.False(t, rep.Switched)
}

// TestRebuildSwitchLayoutKeepsChanging: a switch whose script
// answered, each time, that the layout keys had changed since they were
// read touched nothing: the failure is definite (ErrUnexpectedReply), the
// old projection live, not ErrRebuildUncertain.
func TestRebuildSwitchLayoutKeepsChanging(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet)
	b.projectRows(t, b.insertMany(t, 10))
	b.project(t, "orphan", 1)
	layout := b.ks.LayoutKey(b.target.Name, b.kind)
	hook := &rebuildReadsHook{after: func(n int64) {
		if n >= 2 && n < 2+rebuildStepRetries { // every read of the switch
			require.NoError(t, b.client.Set(context.Background(), layout, strconv.Itoa(1<<n), 0).Err())
		}
	}}
	r := b.withHook(t, hook).reconciler(t, nil)
	rep, err := r.Rebuild(context.Background())
	require.ErrorIs(t, err, ErrUnexpectedReply)
	require.NotErrorIs(t, err, ErrRebuildUncertain)
	require.False(t, rep.Switched)
	b.requireNoRebuildLeft(t, "aborted")
	n, err := b.client.ZCard(context.Background(), b.ks.ValueKey(b.target.target(""))).Result()
	require.NoError(t, err)
	require.EqualValues(t, 11, n, "the old projection is live")
}

// TestRebuildNoLayoutKeyWithFlatVersions: a collection without a
// layout key whose unbucketed version hash exists is an unbucketed one (the
// gate's "0", not "missing"): it rebuilds.
func TestRebuildNoLayoutKeyWithFlatVersions(t *testing.T) {
	t.Parallel()
	b := setup(t, projection.KindSortedSet)
	b.projectRows(t, b.insertMany(t, 10))
	b.project(t, "orphan", 1)
	layout := b.ks.LayoutKey(b.target.Name, b.kind)
	require.NoError(t, b.client.Del(context.Background(), layout).Err())
	r := b.reconciler(t, nil)
	rep, err := r.Rebuild(context.Background())
	require.NoError(t, err)
	require.True(t, rep.Switched)
	require.False(t, b.state(t, r, "orphan").HasValue, "switched")
}
