package reconcile

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"

	"github.com/verity-go/verity/internal/telemetry/metrictest"
	"github.com/verity-go/verity/projection"
)

// TestSnapshotSource: through a REPEATABLE READ or SERIALIZABLE
// transaction, the lookups that confirm ahead and orphan findings read the
// snapshot the pass began with, so a write committed and projected during
// the pass looked like drift: forced repairs took a's newer version back
// and deleted the new entity c, and a Rebuild switched in a's older
// version; and after Redis lost a (or a's version), a missing (or corrupt)
// repair wrote a's v1 back.
// Such a source is refused for those, with nothing written; dry runs, and
// a policy that only reports missing, ahead and orphan entries, still run
// through it, and a READ COMMITTED transaction confirms as a pool does.
func TestSnapshotSource(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	forced := &Config{Policy: Policy{Ahead: ActionRepair, Orphan: ActionRepair}}

	// open returns a SQLSource through a new transaction of level iso,
	// whose snapshot (for a snapshot level) predates a := v2 and c, both
	// committed and projected afterwards.
	open := func(t *testing.T, iso pgx.TxIsoLevel) (*testBundle, *SQLSource) {
		t.Helper()
		b := setup(t, projection.KindSortedSet)
		b.projectRows(t, []Row{b.insert(t, "a", 1), b.insert(t, "b", 1)})
		src := snapshotSource(t, b, iso)
		b.project(t, "a", b.insert(t, "a", 2).Version)
		b.project(t, "c", b.insert(t, "c", 1).Version)
		return b, src
	}
	// untouched checks that the projection still holds what the relay wrote.
	untouched := func(t *testing.T, b *testBundle, r *Reconciler) {
		t.Helper()
		require.Equal(t, int64(2), b.state(t, r, "a").Version)
		require.True(t, b.state(t, r, "c").HasValue, "c is still projected")
	}

	for _, iso := range []pgx.TxIsoLevel{pgx.RepeatableRead, pgx.Serializable} {
		t.Run("ForcedRepairsRefused"+pascal(string(iso)), func(t *testing.T) {
			t.Parallel()
			b, src := open(t, iso)
			rec := metrictest.New(t)
			r, err := New(src, b.target, &Config{Policy: forced.Policy, MeterProvider: rec.Provider})
			require.NoError(t, err)
			_, err = r.Run(ctx, RunOptions{})
			var cfgErr *ConfigError
			require.ErrorAs(t, err, &cfgErr)
			require.Equal(t, "source", cfgErr.Field)
			require.ErrorIs(t, err, ErrInvalidConfig)
			_, err = r.Run(ctx, RunOptions{Sample: 10})
			require.ErrorAs(t, err, &cfgErr, "a sampled run repairs ahead entries too")
			untouched(t, b, r)
			// Refused runs are failed runs, for the alert on them.
			errOutcome := attribute.String(AttributeOutcome, outcomeError)
			collected := rec.Collect(t)
			require.Equal(t, int64(1), collected.Int(metricRuns, errOutcome, attribute.String(AttributeMode, modeFull)))
			require.Equal(t, int64(1), collected.Int(metricRuns, errOutcome, attribute.String(AttributeMode, modeSample)))

			// A dry run, and a policy repairing only stale entries, run.
			rep, err := r.Run(ctx, RunOptions{DryRun: true})
			require.NoError(t, err)
			require.Equal(t, int64(1), rep.Counts[ClassAhead], "ahead as of the snapshot")
			r, err = New(src, b.target, &Config{Policy: Policy{Missing: ActionReport, Corrupt: ActionReport}})
			require.NoError(t, err)
			_, err = r.Run(ctx, RunOptions{})
			require.NoError(t, err)
			untouched(t, b, r)
		})

		// Redis loses the collection's keys after a's v2 was projected: a missing
		// repair from the snapshot wrote a's v1 back, a reverted value no
		// outbox record would correct.
		t.Run("MissingRepairsRefused"+pascal(string(iso)), func(t *testing.T) {
			t.Parallel()
			b, src := open(t, iso)
			tg := b.target.target("a")
			require.NoError(t, b.client.Del(ctx, b.ks.ValueKey(tg), b.ks.VersionKey(tg)).Err())
			r, err := New(src, b.target, nil)
			require.NoError(t, err)
			_, err = r.Run(ctx, RunOptions{})
			var cfgErr *ConfigError
			require.ErrorAs(t, err, &cfgErr, "the default policy repairs missing entries")
			require.Equal(t, "source", cfgErr.Field)
			_, err = r.CheckKeys(ctx, []string{"a"}, RunOptions{})
			require.ErrorAs(t, err, &cfgErr)
			require.False(t, b.state(t, r, "a").HasValue, "nothing written back")
			rep, err := r.Run(ctx, RunOptions{DryRun: true})
			require.NoError(t, err)
			require.Equal(t, int64(2), rep.Counts[ClassMissing], "a and b, the snapshot's rows: %v", rep.Counts)
		})

		// Redis loses the version hash alone after a's v2 was projected: a
		// reads as corrupt (a value without a version), and a repair from
		// the snapshot wrote a's v1 back over v2's value.
		t.Run("CorruptRepairsRefused"+pascal(string(iso)), func(t *testing.T) {
			t.Parallel()
			b, src := open(t, iso)
			tg := b.target.target("a")
			before, err := b.client.ZScore(ctx, b.ks.ValueKey(tg), "a").Result()
			require.NoError(t, err)
			require.NoError(t, b.client.Del(ctx, b.ks.VersionKey(tg)).Err())
			r, err := New(src, b.target, &Config{Policy: Policy{Missing: ActionReport}})
			require.NoError(t, err)
			_, err = r.Run(ctx, RunOptions{})
			var cfgErr *ConfigError
			require.ErrorAs(t, err, &cfgErr, "the policy repairs corrupt entries")
			after, err := b.client.ZScore(ctx, b.ks.ValueKey(tg), "a").Result()
			require.NoError(t, err)
			require.Equal(t, before, after, "a's v2 value left as it was")
			rep, err := r.Run(ctx, RunOptions{DryRun: true})
			require.NoError(t, err)
			require.Equal(t, int64(2), rep.Counts[ClassCorrupt], "a and b, the snapshot's rows: %v", rep.Counts)
		})

		// Redis goes back to a's v1 (a failover to a replica that missed
		// the last writes) after v3 was projected, and the snapshot holds
		// v2: a reads as stale, and the repair writes the snapshot's v2,
		// newer than what Redis held, older than PostgreSQL's row, as the
		// DBTX doc says; a pass through a pool then brings it to v3.
		t.Run("StaleRepairStopsAtTheSnapshot"+pascal(string(iso)), func(t *testing.T) {
			t.Parallel()
			b := setup(t, projection.KindSortedSet)
			b.projectRows(t, []Row{b.insert(t, "a", 1), b.insert(t, "b", 1)})
			b.insert(t, "a", 2)
			src := snapshotSource(t, b, iso) // a at v2
			b.project(t, "a", 2)
			b.project(t, "a", b.insert(t, "a", 3).Version)
			tg := b.target.target("a")
			require.NoError(t, b.client.Del(ctx, b.ks.ValueKey(tg), b.ks.VersionKey(tg)).Err())
			b.projectRows(t, []Row{{Key: "a", Version: 1, Value: b.value("a", 1)}, {Key: "b", Version: 1, Value: b.value("b", 1)}})

			r, err := New(src, b.target, &Config{Policy: Policy{Missing: ActionReport, Corrupt: ActionReport}})
			require.NoError(t, err)
			rep, err := r.Run(ctx, RunOptions{})
			require.NoError(t, err, "stale repairs alone go ahead")
			require.Equal(t, int64(1), rep.Counts[ClassStale], "%v", rep.Counts)
			require.Equal(t, int64(1), rep.Repaired)
			require.Equal(t, int64(2), b.state(t, r, "a").Version, "the snapshot's version, not PostgreSQL's")

			pooled := b.reconciler(t, nil)
			rep, err = pooled.Run(ctx, RunOptions{})
			require.NoError(t, err)
			require.Equal(t, int64(1), rep.Counts[ClassStale], "%v", rep.Counts)
			require.Equal(t, int64(3), b.state(t, pooled, "a").Version)
		})

		t.Run("RebuildRefused"+pascal(string(iso)), func(t *testing.T) {
			t.Parallel()
			b, src := open(t, iso)
			r, err := New(src, b.target, nil)
			require.NoError(t, err)
			rep, err := r.Rebuild(ctx)
			var cfgErr *ConfigError
			require.ErrorAs(t, err, &cfgErr)
			require.Equal(t, "source", cfgErr.Field)
			require.False(t, rep.Switched)
			untouched(t, b, r)
		})
	}

	// Each statement of a READ COMMITTED transaction sees what committed
	// before it: the confirming lookups find a's v2 and c.
	t.Run("ReadCommittedConfirms", func(t *testing.T) {
		t.Parallel()
		b, src := open(t, pgx.ReadCommitted)
		r, err := New(src, b.target, forced)
		require.NoError(t, err)
		rep, err := r.Run(ctx, RunOptions{})
		require.NoError(t, err)
		require.Zero(t, rep.Drift(), "%v", rep.Counts)
		untouched(t, b, r)
		rebuilt, err := r.Rebuild(ctx)
		require.NoError(t, err)
		require.True(t, rebuilt.Switched)
		untouched(t, b, r)
	})
}

// snapshotSource returns a SQLSource over b's items through a new read-only
// transaction of level iso, its snapshot taken (for a snapshot level).
func snapshotSource(t *testing.T, b *testBundle, iso pgx.TxIsoLevel) *SQLSource {
	t.Helper()
	ctx := context.Background()
	tx, err := b.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso, AccessMode: pgx.ReadOnly})
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(ctx) })
	src, err := NewSQLSource(tx, &SQLSourceConfig{Table: "items", KeyColumn: "key", VersionColumn: "version",
		ValueColumn: "score", Kind: projection.KindSortedSet, Filters: []Filter{{Column: "board", Value: testBoard}}})
	require.NoError(t, err)
	_, err = src.Page(ctx, Cursor{}, 10) // the snapshot is taken
	require.NoError(t, err)
	return src
}

// pascal turns a transaction isolation level ("repeatable read") into a
// subtest name ("RepeatableRead").
func pascal(s string) string {
	out := []byte{}
	up := true
	for i := range len(s) {
		switch c := s[i]; {
		case c == ' ':
			up = true
		case up && c >= 'a' && c <= 'z':
			out = append(out, c-'a'+'A')
			up = false
		default:
			out = append(out, c)
			up = false
		}
	}
	return string(out)
}

// CheckKeys refuses forced ahead and orphan repairs through one snapshot,
// as Run does: a's version 2 and the new entity c, written and projected
// after the snapshot, read as ahead and orphan there, and were taken back
// to version 1 and deleted.
func TestCheckKeysFrozenSourceRefusesForcedRepairs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, projection.KindSortedSet)
	b.projectRows(t, []Row{b.insert(t, "a", 1), b.insert(t, "b", 1)})
	src := snapshotSource(t, b, pgx.RepeatableRead)
	b.project(t, "a", b.insert(t, "a", 2).Version)
	b.project(t, "c", b.insert(t, "c", 1).Version)

	r, err := New(src, b.target, &Config{Policy: Policy{Ahead: ActionRepair, Orphan: ActionRepair}})
	require.NoError(t, err)
	_, err = r.CheckKeys(ctx, []string{"a", "c"}, RunOptions{})
	var cfgErr *ConfigError
	require.ErrorAs(t, err, &cfgErr)
	require.Equal(t, "source", cfgErr.Field)
	require.EqualValues(t, 2, b.state(t, r, "a").Version, "a's version 2 was taken back")
	require.True(t, b.state(t, r, "c").HasValue, "c was deleted")

	// Reported, not repaired, the check goes on.
	rep, err := r.CheckKeys(ctx, []string{"a", "c"}, RunOptions{DryRun: true})
	require.NoError(t, err)
	require.EqualValues(t, 1, rep.Counts[ClassAhead])
	require.EqualValues(t, 1, rep.Counts[ClassOrphan])
}
