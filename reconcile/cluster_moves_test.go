package reconcile

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/projection"
)

// pageHook calls before with each Page call's number (from 1) and cursor;
// an error it returns fails the call.
type pageHook struct {
	Source
	calls  atomic.Int32
	before func(n int32, after Cursor) error
}

func (s *pageHook) Page(ctx context.Context, after Cursor, limit int) ([]Row, error) {
	if err := s.before(s.calls.Add(1), after); err != nil {
		return nil, err
	}
	return s.Source.Page(ctx, after, limit)
}

// TestClusterRerunCountsOnlyWhatItChecked: a pass repairs 9 documents of
// page 2 and refuses the 10th (its value key holds a hash), meets a slot
// move on page 3 and runs again; the re-run checks page 1 (10 current
// documents) and fails reading page 2. The Report counts page 1's 10
// current documents and the 9 repairs: it used to take the first pass's
// rewrites off current whether or not the re-run had got that far. The
// refusal is returned and reported too: it used to be dropped, as if the
// re-run had met it again.
func TestClusterRerunCountsOnlyWhatItChecked(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 1)
	client := cluster.ReadOnlyClient(t)
	b, rows, _, _ := projectedAndLoaded(t, projection.KindDocument, client, "carry:")
	// The second read after page 1 (the re-run's) fails.
	var walks atomic.Int32
	src := &pageHook{Source: b.source, before: func(_ int32, after Cursor) error {
		if k, ok := after.Key(); ok && k == rows[9].Key && walks.Add(1) == 2 {
			return errors.New("source failed")
		}
		return nil
	}}
	r, err := New(src, b.target, &Config{PageSize: 10, ReadAhead: 1})
	require.NoError(t, err)
	// Prime the reconciler's slot map.
	_, err = r.Run(ctx, RunOptions{DryRun: true})
	require.NoError(t, err)
	walks.Store(0)

	for _, row := range rows[10:19] { // page 2: missing, repaired by pass 1
		tg := b.target.target(row.Key)
		require.NoError(t, client.Del(ctx, b.ks.ValueKey(tg), b.ks.VersionKey(tg)).Err())
	}
	wrong := b.target.target(rows[19].Key) // page 2: corrupt, its repair refused
	require.NoError(t, client.Del(ctx, b.ks.ValueKey(wrong)).Err())
	require.NoError(t, client.HSet(ctx, b.ks.ValueKey(wrong), "f", "v").Err())
	moved := b.target.target(rows[25].Key) // page 3: its slot moves
	slot := reassignEmptied(t, cluster, client, b.ks.ValueKey(moved))
	for _, row := range rows[:10] { // page 1 does not share the moved slot
		s, err := client.ClusterKeySlot(ctx, b.ks.ValueKey(b.target.target(row.Key))).Result()
		require.NoError(t, err)
		require.NotEqual(t, slot, s)
	}

	rep, err := r.Run(ctx, RunOptions{})
	require.ErrorContains(t, err, "source failed")
	t.Logf("report: %s counts=%v results=%v checked=%d", rep, rep.Counts, rep.Results, rep.Checked)
	require.EqualValues(t, 9, rep.Repaired, "pass 1's repairs are reported")
	require.EqualValues(t, 10, rep.Checked, "the re-run checked page 1")
	require.EqualValues(t, 10, rep.Counts[ClassCurrent], "page 1's 10 documents were current in the re-run")
	var refused *WrongKeyTypeError
	require.ErrorAs(t, err, &refused, "pass 1's refusal is returned")
	require.Equal(t, rows[19].Key, refused.Key)
	require.EqualValues(t, 1, rep.Counts[ClassCorrupt])
	require.EqualValues(t, 1, rep.Results[ResultNotAttempted])
	require.Equal(t, rep.Drift(), rep.Repaired+rep.Skipped+rep.Uncertain)
}

// TestClusterTryAgainRepairIsNotUncertain: a run of a collection whose
// slot is MIGRATING (a reshard begun, no key moved): Redis refuses every
// repair script up front with TRYAGAIN (each names a key that does not
// exist), so nothing is written. The repairs are not attempted, not
// uncertain ("sent, reply lost, may have been applied").
func TestClusterTryAgainRepairIsNotUncertain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 0)
	client := cluster.Client(t)
	b := setupWith(t, projection.KindSortedSet, client, "try:").withBuckets(t, 4)
	rows := b.insertMany(t, 30)
	b.projectRows(t, rows)
	r := b.reconciler(t, nil)
	_, err := r.Run(ctx, RunOptions{DryRun: true})
	require.NoError(t, err)

	b.setRaw(t, rows[3].Key, &projection.Value{Score: 1}, nil) // corrupt: CAS repair
	b.setRaw(t, rows[7].Key, nil, ptr(""))                     // version gone: corrupt too
	require.NoError(t, client.ZRem(ctx, b.ks.ValueKey(b.target.target("")), rows[11].Key).Err())
	b.setRaw(t, rows[11].Key, nil, ptr("")) // missing: gate repair
	startSlotMigration(t, client, b.ks.ValueKey(b.target.target("")))

	rep, err := r.Run(ctx, RunOptions{})
	require.Error(t, err)
	require.Contains(t, err.Error(), "TRYAGAIN")
	// Nothing was written.
	require.Equal(t, float64(1), client.ZScore(ctx, b.ks.ValueKey(b.target.target("")), rows[3].Key).Val())
	require.Zero(t, rep.Uncertain, "TRYAGAIN: refused before anything ran, not uncertain")
	require.EqualValues(t, 3, rep.Results[ResultNotAttempted])
}

// TestClusterCheckKeysAfterFailover: CheckKeys of a collection through a
// replica-reading client, after a failover its slot map has not caught up
// with: the reads are pinned to the demoted master, which answers MOVED.
// CheckKeys follows the move as Run does; it used to fail until go-redis's
// periodic reload.
func TestClusterCheckKeysAfterFailover(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 1)
	client := cluster.ReadOnlyClient(t)
	b, rows, r, rep := projectedAndLoaded(t, projection.KindSortedSet, client, "ck:")
	require.Equal(t, map[Class]int64{ClassCurrent: 30}, rep.Counts)
	collection := b.ks.ValueKey(b.target.target(""))
	oldMaster, _ := cluster.Failover(t, collection)
	named, err := client.MasterForKey(ctx, collection)
	require.NoError(t, err)
	require.Equal(t, oldMaster, named.Options().Addr, "the client's map has not caught up")

	rep, err = r.CheckKeys(ctx, []string{rows[0].Key, rows[1].Key}, RunOptions{DryRun: true})
	rep2, err2 := r.CheckKeys(ctx, []string{rows[0].Key, rows[1].Key}, RunOptions{DryRun: true})
	require.NoError(t, err, "CheckKeys after a failover")
	require.NoError(t, err2, "the CheckKeys after that")
	require.Equal(t, map[Class]int64{ClassCurrent: 2}, rep.Counts)
	require.Equal(t, map[Class]int64{ClassCurrent: 2}, rep2.Counts)
}

// TestClusterRebuildAbortsDuringMigration: a Rebuild whose collection's
// slot starts migrating mid-copy fails; the doc promises that then "the
// marker and shadow keys are removed", but the abort, refused with TRYAGAIN
// like every step, was not tried again, and the marker held off the next
// Rebuild for its TTL. Once the resharding is called off, the next Rebuild
// runs.
func TestClusterRebuildAbortsDuringMigration(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 0)
	client := cluster.Client(t)
	b, _, _, _ := projectedAndLoaded(t, projection.KindSortedSet, client, "rb:")
	valueKey := b.ks.ValueKey(b.target.target(""))
	slot, err := client.ClusterKeySlot(ctx, valueKey).Result()
	require.NoError(t, err)
	masters := testenv.Masters(t, client)
	// The resharding is called off a second after it began, while the
	// failed rebuild is still aborting.
	callOff := func() {
		time.Sleep(time.Second)
		for _, m := range masters {
			_ = m.Do(ctx, "CLUSTER", "SETSLOT", slot, "STABLE").Err()
		}
	}
	src := &pageHook{Source: b.source, before: func(n int32, _ Cursor) error {
		if n == 2 {
			startSlotMigration(t, client, valueKey)
			go callOff()
		}
		return nil
	}}
	r, err := New(src, b.target, &Config{PageSize: 10, ReadAhead: 1})
	require.NoError(t, err)
	_, err = r.Rebuild(ctx)
	t.Logf("rebuild during migration: %v", err)
	require.Error(t, err)

	time.Sleep(1500 * time.Millisecond) // the resharding is called off
	requireFailedRebuildCleanedUp(t, b, client)
}

// TestClusterRebuildAbortsAfterKeysMoved: a Rebuild whose collection's
// slot starts migrating mid-copy, its keys moved at once (all of them, or
// only the live ones and the shadow layout key, so that the step's reads
// meet both TRYAGAIN and ASK), the resharding finished a second later: the
// failed rebuild cleans up, and the next one switches. Its step's reads,
// one MGET of both layout keys, made go-redis send the pipeline's other
// commands to both masters at once (a data race under -race).
func TestClusterRebuildAbortsAfterKeysMoved(t *testing.T) {
	t.Parallel()
	for name, moved := range map[string]func(b *testBundle) []string{
		"AllKeys": func(*testBundle) []string { return nil },
		"LiveKeysAndShadowLayout": func(b *testBundle) []string {
			return []string{b.ks.ValueKey(b.target.target("")), b.ks.VersionKeys(b.target.Name, b.kind)[0], b.ks.ShadowLayoutKey(b.target.Name, b.kind)}
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			err := rebuildCutByAMigration(t, testenv.StartRedisCluster(t, 3, 0).Client(t), moved, nil)
			require.Error(t, err)
		})
	}
}

// TestClusterRebuildAbortRetriesARedirect: a Rebuild whose source fails
// once every key of its slot has moved, the slot still migrating, on a
// client whose redirects run out on ASK (go-redis follows ASK, is answered
// TRYAGAIN after ASKING, follows ASK again: with MaxRedirects 2 the last
// answer is the ASK). The abort is tried again until the resharding ends,
// a second later, as on TRYAGAIN.
func TestClusterRebuildAbortRetriesARedirect(t *testing.T) {
	t.Parallel()
	cluster := testenv.StartRedisCluster(t, 3, 0)
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs(), MaxRedirects: 2})
	t.Cleanup(func() { _ = client.Close() })
	sourceFailed := errors.New("source failed")
	err := rebuildCutByAMigration(t, client, func(*testBundle) []string { return nil }, sourceFailed)
	require.ErrorIs(t, err, sourceFailed)
	require.NotContains(t, err.Error(), "clean-up failed")
}

// rebuildCutByAMigration runs a Rebuild whose collection's slot starts
// migrating before its second source page: the keys moved(b) names (all
// of them for none) move at once, the page then fails with sourceErr
// (nil: it does not), and the resharding finishes a second later. It
// returns the Rebuild's error, once the failed rebuild is found cleaned up
// and the next one switches.
func rebuildCutByAMigration(t *testing.T, client *redis.ClusterClient, moved func(b *testBundle) []string, sourceErr error) error {
	t.Helper()
	ctx := context.Background()
	b, _, _, _ := projectedAndLoaded(t, projection.KindSortedSet, client, "rbm:")
	finished := make(chan error, 1)
	src := &pageHook{Source: b.source, before: func(n int32, _ Cursor) error {
		if n != 2 {
			return nil
		}
		migration := startSlotMigration(t, client, b.ks.ValueKey(b.target.target("")))
		if err := migration.Move(ctx, moved(b)...); err != nil {
			return err
		}
		go func() {
			time.Sleep(time.Second)
			finished <- migration.Finish(ctx)
		}()
		return sourceErr
	}}
	r, err := New(src, b.target, &Config{PageSize: 10, ReadAhead: 1})
	require.NoError(t, err)
	_, rebuildErr := r.Rebuild(ctx)
	t.Logf("rebuild during migration: %v", rebuildErr)
	require.NoError(t, <-finished)
	requireFailedRebuildCleanedUp(t, b, client)
	return rebuildErr
}

// requireFailedRebuildCleanedUp checks that a failed Rebuild of b's
// collection left neither its marker nor its shadow values, and that the
// next Rebuild switches.
func requireFailedRebuildCleanedUp(t *testing.T, b *testBundle, client *redis.ClusterClient) {
	t.Helper()
	ctx := context.Background()
	marker, err := client.Exists(ctx, b.ks.RebuildMarkerKey(b.target.Name, b.kind)).Result()
	require.NoError(t, err)
	shadow, err := client.Exists(ctx, b.ks.ShadowValueKey(b.target.Name, b.kind)).Result()
	require.NoError(t, err)
	require.Zero(t, marker, "the failed rebuild's marker is left")
	require.Zero(t, shadow, "the failed rebuild's shadow values are left")
	rb, err := b.reconciler(t, nil).Rebuild(ctx)
	require.NoError(t, err, "a rebuild after the failed one")
	require.True(t, rb.Switched)
}

// TestClusterRebuildThroughASingleServerClientFailsAtOnce: a client for
// one server, pointed at a cluster node that does not serve the
// collection's slot, is redirected for good: the failed Rebuild's abort is
// not tried again until RepairTimeout, as during a migration.
func TestClusterRebuildThroughASingleServerClientFailsAtOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 0)
	client := cluster.Client(t)
	b, _, _, _ := projectedAndLoaded(t, projection.KindSortedSet, client, "rbs:")
	owner, err := client.MasterForKey(ctx, b.ks.ValueKey(b.target.target("")))
	require.NoError(t, err)
	other := slices.IndexFunc(cluster.Addrs(), func(addr string) bool { return addr != owner.Options().Addr })
	single := redis.NewClient(&redis.Options{Addr: cluster.Addrs()[other]})
	t.Cleanup(func() { _ = single.Close() })
	target := b.target
	target.Client = single
	r, err := New(b.source, target, &Config{RepairTimeout: 5 * time.Second})
	require.NoError(t, err)
	start := time.Now()
	_, err = r.Rebuild(ctx)
	require.Error(t, err)
	require.ErrorContains(t, err, "MOVED")
	require.Less(t, time.Since(start), 2*time.Second, "the abort waited for a redirect that lasts: %v", err)
}

// lookupHook fails the fail-th Lookup call (from 1).
type lookupHook struct {
	Source
	calls atomic.Int32
	fail  int32
}

func (s *lookupHook) Lookup(ctx context.Context, keys []string) ([]Row, error) {
	if s.calls.Add(1) == s.fail {
		return nil, errors.New("source failed")
	}
	return s.Source.Lookup(ctx, keys)
}

// TestClusterRerunKeepsRefusedOrphan: a CheckKeys pass refuses an orphan's
// removal (its value key holds a hash), meets a slot move on its next
// batch and runs again; the re-run fails looking its first batch up. The
// refusal and its finding are reported: an orphan adds nothing to Checked,
// so the re-run used to count as having met it again.
func TestClusterRerunKeepsRefusedOrphan(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 1)
	client := cluster.ReadOnlyClient(t)
	b, rows, _, _ := projectedAndLoaded(t, projection.KindDocument, client, "carryorphan:")
	src := &lookupHook{Source: b.source}
	r, err := New(src, b.target, &Config{PageSize: 1, ReadAhead: 1, Policy: Policy{Orphan: ActionRepair}})
	require.NoError(t, err)
	// Prime the reconciler's slot map.
	_, err = r.CheckKeys(ctx, []string{rows[0].Key, rows[25].Key}, RunOptions{DryRun: true})
	require.NoError(t, err)

	const orphan = "orphan"
	orphanKey := b.ks.ValueKey(b.target.target(orphan))
	b.projectRows(t, []Row{{Key: orphan, Version: 1, Value: b.value(orphan, 1)}})
	require.NoError(t, client.Del(ctx, orphanKey).Err())
	require.NoError(t, client.HSet(ctx, orphanKey, "f", "v").Err())
	moved := b.ks.ValueKey(b.target.target(rows[25].Key))
	orphanSlot, err := client.ClusterKeySlot(ctx, orphanKey).Result()
	require.NoError(t, err)
	movedSlot, err := client.ClusterKeySlot(ctx, moved).Result()
	require.NoError(t, err)
	require.NotEqual(t, orphanSlot, movedSlot)
	reassignEmptied(t, cluster, client, moved)
	src.calls.Store(0)
	src.fail = 2 // the re-run's lookup of its first batch

	rep, err := r.CheckKeys(ctx, []string{orphan, rows[25].Key}, RunOptions{})
	require.ErrorContains(t, err, "source failed")
	require.EqualValues(t, 2, src.calls.Load())
	var refused *WrongKeyTypeError
	require.ErrorAs(t, err, &refused, "the first pass's refusal is returned")
	require.Equal(t, orphan, refused.Key)
	require.EqualValues(t, 1, rep.Counts[ClassOrphan])
	require.EqualValues(t, 1, rep.Results[ResultNotAttempted])
}

// TestClusterRepairsAcrossSlotsDuringAResharding: a Run whose page holds
// documents of two slots of one master, while a resharding moves B's slot
// (the Run's client does not know yet: MOVED) and is moving A's (A's
// version key moved, its value key not yet: TRYAGAIN). go-redis sent the
// node's whole batch again on the TRYAGAIN, B's repair (and, reading, B's
// MGET) included, which it was already following the MOVED of: it ran on
// both masters at once (a data race under -race), and B, repaired by this
// Run, was reported raced.
func TestClusterRepairsAcrossSlotsDuringAResharding(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// setup makes a cluster with documents A and B projected, and returns
	// a client and the resharding to start.
	setup := func(t *testing.T) (b *testBundle, client *redis.ClusterClient, docA, docB string, reshard func(context.Context) error) {
		cluster := testenv.StartRedisCluster(t, 3, 0)
		admin := cluster.Client(t)
		client = redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs()})
		t.Cleanup(func() { _ = client.Close() })
		b = setupWith(t, projection.KindDocument, client, "rs:")
		masterOf := func(key string) *redis.Client {
			m, err := admin.MasterForKey(ctx, b.ks.ValueKey(b.target.target(key)))
			require.NoError(t, err)
			return m
		}
		slot := func(key string) int { return b.ks.Slot(b.target.target(key)) }
		docA, source := "a", masterOf("a")
		for i := 0; docB == ""; i++ {
			if key := "b" + strconv.Itoa(i); masterOf(key).Options().Addr == source.Options().Addr && slot(key) != slot(docA) {
				docB = key
			}
		}
		for _, key := range []string{docA, docB} {
			b.insert(t, key, 1)
			require.Equal(t, projection.OutcomeApplied, b.project(t, key, 1))
		}
		for _, m := range testenv.Masters(t, admin) { // the script loaded on every master
			require.NoError(t, m.ScriptLoad(ctx, repairSource).Err())
		}
		reshard = func(ctx context.Context) error {
			if err := testenv.StartSlotMigration(t, admin, slot(docB), source).Finish(ctx); err != nil {
				return err
			}
			migration := testenv.StartSlotMigration(t, admin, slot(docA), source)
			t.Cleanup(func() { require.NoError(t, migration.Finish(context.Background())) })
			return migration.Move(ctx, b.ks.VersionKey(b.target.target(docA)))
		}
		return b, client, docA, docB, reshard
	}

	t.Run("Repair", func(t *testing.T) {
		t.Parallel()
		b, client, docA, docB, reshard := setup(t)
		for _, key := range []string{docA, docB} {
			b.setRaw(t, key, &projection.Value{Data: []byte("garbage")}, nil)
		}
		var (
			once       sync.Once
			reshardErr error
			mu         sync.Mutex
			results    = map[string]Result{}
		)
		r := b.reconciler(t, &Config{
			BeforeRepair: func(ctx context.Context, _ Finding) bool {
				once.Do(func() { reshardErr = reshard(ctx) })
				return true
			},
			AfterRepair: func(_ context.Context, f Finding) {
				mu.Lock()
				defer mu.Unlock()
				results[f.Key] = f.Result
			},
		})
		_, err := r.Run(ctx, RunOptions{})
		require.NoError(t, reshardErr)
		t.Logf("run: %v; results %v", err, results)
		require.Equal(t, ResultRepaired, results[docB], "B was repaired by this Run")
		require.Equal(t, ResultNotAttempted, results[docA], "A's repair was answered TRYAGAIN")
		got, err := client.Get(ctx, b.ks.ValueKey(b.target.target(docB))).Result()
		require.NoError(t, err)
		require.Equal(t, string(b.value(docB, 1).Data), got)
	})

	// Reading, many clients whose slot maps predate the resharding, so
	// that some send both groups in one batch to the old master.
	t.Run("Read", func(t *testing.T) {
		t.Parallel()
		b, client, _, _, reshard := setup(t)
		var readers []*Reconciler
		for range 8 {
			reader := redis.NewClusterClient(&redis.ClusterOptions{Addrs: client.Options().Addrs})
			t.Cleanup(func() { _ = reader.Close() })
			require.NoError(t, reader.ForEachMaster(ctx, func(ctx context.Context, n *redis.Client) error { return n.Ping(ctx).Err() }))
			target := b.target
			target.Client = reader
			r, err := New(b.source, target, nil)
			require.NoError(t, err)
			readers = append(readers, r)
		}
		require.NoError(t, reshard(ctx))
		for _, r := range readers {
			_, err := r.Run(ctx, RunOptions{DryRun: true})
			if err != nil {
				require.ErrorContains(t, err, "TRYAGAIN", "only the migrating slot's read may fail")
			}
		}
	})
}
