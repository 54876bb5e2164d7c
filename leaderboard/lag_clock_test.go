package leaderboard

import (
	"context"
	"fmt"
	"math"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// futurePending dates the board's pending outbox rows d after their
// creation, as if PostgreSQL's clock had stepped back by d since it wrote
// them (an NTP step, a VM resumed, a failover to a host whose clock lags).
func (tb *testBundle) futurePending(t *testing.T, d time.Duration) {
	t.Helper()
	_, err := tb.pg.Pool.Exec(context.Background(),
		`UPDATE verity_outbox SET created_at = created_at + $1::interval WHERE published_at IS NULL`, d)
	require.NoError(t, err)
}

// futureDead dates user's dead letters d after their creation (see
// futurePending).
func (tb *testBundle) futureDead(t *testing.T, d time.Duration, user string) {
	t.Helper()
	_, err := tb.pg.Pool.Exec(context.Background(),
		`UPDATE verity_outbox_dead SET created_at = created_at + $1::interval WHERE key = $2`, d, user)
	require.NoError(t, err)
}

// clockStepBoard sets up a board under policy whose lag probe runs every
// 20 ms, with MaxLag 400 ms, and user-a's score 10 projected.
func clockStepBoard(t *testing.T, policy ReadPolicy) *testBundle {
	t.Helper()
	tb := setup(t, func(c *Config) {
		c.ReadPolicy = policy
		c.MaxLag = 400 * time.Millisecond
		c.LagProbeInterval = 20 * time.Millisecond
	})
	tb.submit(t, "user-a", 10)
	tb.drain(t)
	return tb
}

// requireRefusedUnmeasured requires Top to refuse with a *StaleError whose
// lag could not be measured.
func requireRefusedUnmeasured(t *testing.T, tb *testBundle) *StaleError {
	t.Helper()
	r, err := tb.board.Top(context.Background(), 10)
	var stale *StaleError
	require.ErrorAs(t, err, &stale, "served %+v", r)
	require.Negative(t, stale.Lag)
	return stale
}

// TestLagWhenTheDatabaseClockSteppedBack checks that a change dated after
// the database clock makes the lag unmeasured (Lag -1, as a failed probe)
// rather than 0: clamped to 0, it read as fresh on every probe until the
// clock caught up with it, so FailClosed served a projection behind by up
// to the step.
func TestLagWhenTheDatabaseClockSteppedBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("FailClosedRefuses", func(t *testing.T) {
		t.Parallel()
		tb := clockStepBoard(t, FailClosed)
		tb.submit(t, "user-a", 7) // never projected: Redis keeps 10
		tb.futurePending(t, time.Hour)

		// Pending for longer than MaxLag, and from the first probe on.
		for range 2 {
			require.False(t, requireRefusedUnmeasured(t, tb).Unverified)
			time.Sleep(tb.board.Config().MaxLag + 10*time.Millisecond)
		}
		_, ok := tb.board.observedLag(ctx)
		require.False(t, ok, "the lag gauge is absent while the lag cannot be measured")

		// Once the change is projected, the lag is measured again.
		tb.drain(t)
		time.Sleep(tb.board.Config().LagProbeInterval)
		r, err := tb.board.Top(ctx, 10)
		require.NoError(t, err)
		require.Equal(t, SourceRedis, r.Freshness.Source)
		require.Equal(t, int64(17), r.Entries[0].Score)
		require.GreaterOrEqual(t, r.Freshness.Lag, time.Duration(0))
	})

	// An older change stamped before the step and a newer one stamped after
	// it: the newer one is the oldest by created_at, and its small age
	// hid the older one.
	t.Run("OlderChangeHiddenByNewerOne", func(t *testing.T) {
		t.Parallel()
		tb := clockStepBoard(t, FallbackToPostgres)
		tb.submit(t, "user-a", 7) // before the step
		tb.futurePending(t, time.Hour)
		tb.submit(t, "user-b", 1) // after it

		r, err := tb.board.Top(ctx, 10)
		require.NoError(t, err)
		require.Equal(t, SourcePostgres, r.Freshness.Source, "Lag %s", r.Freshness.Lag)
		require.Equal(t, []Entry{{UserID: "user-a", Score: 17, Rank: 1}, {UserID: "user-b", Score: 1, Rank: 2}}, r.Entries)

		r, err = tb.board.Top(ctx, 10, WithPolicy(ServeStale))
		require.NoError(t, err)
		require.Equal(t, SourceRedis, r.Freshness.Source)
		require.Equal(t, time.Duration(-1), r.Freshness.Lag)
		require.True(t, r.Freshness.ProjectedThrough.IsZero())
	})

	// A dead letter keeps its original creation time: one dated after the
	// clock cannot be aged either.
	t.Run("DeadLetterDatedAfterTheClock", func(t *testing.T) {
		t.Parallel()
		tb := clockStepBoard(t, FailClosed)
		tb.submit(t, "user-a", 7) // dead-lettered: Redis keeps 10
		tb.bury(t)
		tb.futureDead(t, time.Hour, "user-a")

		requireRefusedUnmeasured(t, tb)
	})

	// A change written after the step is the oldest by created_at, and its
	// small age hid the dead letter dated after the clock, whose change
	// Redis lacks.
	t.Run("DeadLetterDatedAfterTheClockHiddenByNewerRow", func(t *testing.T) {
		t.Parallel()
		tb := clockStepBoard(t, FailClosed)
		tb.submit(t, "user-a", 7) // dead-lettered before the step: Redis keeps 10
		tb.bury(t)
		tb.futureDead(t, time.Hour, "user-a")
		tb.submit(t, "user-b", 1) // after the step, pending

		requireRefusedUnmeasured(t, tb) // user-a: 10 in Redis, 17 in PostgreSQL
	})

	// The first dead letter in id order, stamped long enough before the
	// step to be dated in the past, hid a later one dated after the clock.
	t.Run("DeadLetterDatedAfterTheClockBehindAnOlderOne", func(t *testing.T) {
		t.Parallel()
		tb := clockStepBoard(t, FailClosed)
		tb.submit(t, "user-b", 1) // dead-lettered, dated in the past
		tb.bury(t)
		tb.submit(t, "user-a", 7) // dead-lettered, dated after the clock: Redis keeps 10
		tb.bury(t)
		tb.futureDead(t, time.Hour, "user-a")

		requireRefusedUnmeasured(t, tb) // user-a: 10 in Redis, 17 in PostgreSQL
	})

	// A dead letter whose user's newer version reached Redis does not count
	// as lag, nor when dated after the clock: Lag stays measured.
	t.Run("SupersededDeadLetterDatedAfterTheClock", func(t *testing.T) {
		t.Parallel()
		tb := clockStepBoard(t, FailClosed)
		tb.submit(t, "user-a", 7) // dead-lettered
		tb.bury(t)
		tb.futureDead(t, time.Hour, "user-a")
		tb.submit(t, "user-a", 1) // supersedes it once projected
		tb.drain(t)

		r, err := tb.board.Top(ctx, 10)
		require.NoError(t, err)
		require.Equal(t, SourceRedis, r.Freshness.Source)
		require.Equal(t, []Entry{{UserID: "user-a", Score: 18, Rank: 1}}, r.Entries)
		require.GreaterOrEqual(t, r.Freshness.Lag, time.Duration(0))
	})

	// Every probe finds the change again: the board says what it found,
	// about once a second, and not as a failed probe.
	t.Run("LoggedAtMostOnceASecond", func(t *testing.T) {
		t.Parallel()
		logs := &testenv.LogSink{}
		tb := setup(t, func(c *Config) {
			c.ReadPolicy = ServeStale
			c.MaxLag = 400 * time.Millisecond
			c.LagProbeInterval = 5 * time.Millisecond
			c.Logger = logs.Logger()
		})
		tb.submit(t, "user-a", 10)
		tb.futurePending(t, time.Hour)

		start := time.Now()
		for range 20 {
			r, err := tb.board.Top(ctx, 10)
			require.NoError(t, err)
			require.Equal(t, time.Duration(-1), r.Freshness.Lag)
			time.Sleep(tb.board.Config().LagProbeInterval)
		}
		elapsed := time.Since(start)
		lines := logs.Lines(t, "leaderboard: the database clock appears to have stepped back: a change of the board not yet projected is dated after it, so the projection lag cannot be measured (reads see Lag -1) until the changes dated up to it are projected")
		require.NotEmpty(t, lines)
		require.LessOrEqual(t, len(lines), 1+int(elapsed/time.Second), "%d lines in %v", len(lines), elapsed)
		require.Equal(t, "weekly-2026-48", lines[0]["board"])
		ahead := time.Duration(lines[0]["ahead"].(float64))
		require.InDelta(t, float64(time.Hour), float64(ahead), float64(time.Minute), "ahead %v", ahead)
		require.Empty(t, logs.Lines(t, "leaderboard: measuring projection lag failed"))
	})
}

// TestLagSaturatesForAncientPendingChange checks that a pending row dated
// year 1 (finite: migration 006 accepts it, as from a composed INSERT that
// passes an unset time.Time) reports the largest Duration as its lag, to
// reads and to the lag gauge. Its age by the database clock saturates at
// that Duration, and adding the measurement's age wrapped the sum to a
// huge negative lag: "not measured" for reads, and a valid observation far
// below any alert threshold for the gauge.
func TestLagSaturatesForAncientPendingChange(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t, func(c *Config) {
		c.ReadPolicy = ServeStale
		c.MaxLag = time.Second
		c.LagProbeInterval = 100 * time.Millisecond
	})
	tb.submit(t, "user-a", 10)
	tb.drain(t)
	tb.submit(t, "user-a", 7) // never projected
	_, err := tb.pg.Pool.Exec(ctx,
		`UPDATE verity_outbox SET created_at = '0001-01-01 00:00:00+00' WHERE published_at IS NULL`)
	require.NoError(t, err)

	_, err = tb.board.Top(ctx, 10)
	require.NoError(t, err)
	time.Sleep(5 * time.Millisecond) // the measurement has an age
	r, err := tb.board.Top(ctx, 10)
	require.NoError(t, err)
	require.Equal(t, time.Duration(math.MaxInt64), r.Freshness.Lag)
	gauge, ok := tb.board.observedLag(ctx)
	require.True(t, ok)
	require.Equal(t, time.Duration(math.MaxInt64), gauge)

	_, err = tb.board.Top(ctx, 10, WithPolicy(FailClosed))
	var stale *StaleError
	require.ErrorAs(t, err, &stale)
	require.Equal(t, time.Duration(math.MaxInt64), stale.Lag)
}

// slept returns tm as seen from a process that resumed after its host
// slept for d since tm was taken: Go's monotonic clock (CLOCK_MONOTONIC on
// Linux) does not advance while the host is suspended, its wall clock does.
// From after the resume, tm's wall reading is d older than its monotonic
// reading says: the same as moving tm's wall reading back by d and keeping
// its monotonic reading, which is what this does (d whole seconds).
func slept(t *testing.T, tm time.Time, d time.Duration) time.Time {
	t.Helper()
	type raw struct {
		wall uint64
		ext  int64
		loc  *time.Location
	}
	const hasMonotonic, nsecShift = 1 << 63, 30
	r := (*raw)(unsafe.Pointer(&tm))
	require.NotZero(t, r.wall&hasMonotonic, "tm carries a monotonic reading")
	out := tm
	o := (*raw)(unsafe.Pointer(&out))
	o.wall -= uint64(d/time.Second) << nsecShift
	require.Equal(t, tm.Round(0).Add(-d), out.Round(0), "wall reading moved back")
	require.Zero(t, out.Sub(tm), "monotonic reading kept")
	return out
}

// hostSleeps makes b's last lag measurement (and look for Verify's record)
// taken d before a host suspend the process has just resumed from.
func hostSleeps(t *testing.T, b *Board, d time.Duration) {
	t.Helper()
	b.lagMu.Lock()
	defer b.lagMu.Unlock()
	require.False(t, b.lagProbe.at.IsZero())
	b.lagProbe.at = slept(t, b.lagProbe.at, d)
	if !b.verification.at.IsZero() {
		b.verification.at = slept(t, b.verification.at, d)
	}
}

// suspendFor is how long the tests' host sleeps.
const suspendFor = time.Hour

// suspendForedWithBacklog sets up a FailClosed board (MaxLag 2 s, probe every
// second) with user-a's 10 projected and measured as current; then the host
// sleeps an hour, during which another instance of the service writes
// user-a +7 that the sleeping host's worker does not project.
func suspendForedWithBacklog(t *testing.T) *testBundle {
	t.Helper()
	ctx := context.Background()
	tb := setup(t, func(c *Config) {
		c.ReadPolicy = FailClosed
		c.MaxLag = 2 * time.Second
		c.LagProbeInterval = time.Second
	})
	tb.submit(t, "user-a", 10)
	tb.drain(t)
	r, err := tb.board.Top(ctx, 10) // measures: nothing pending
	require.NoError(t, err)
	require.Zero(t, r.Freshness.Lag)

	tb.submit(t, "user-a", 7)
	_, err = tb.pg.Pool.Exec(ctx,
		`UPDATE verity_outbox SET created_at = created_at - $1::interval WHERE published_at IS NULL`, suspendFor)
	require.NoError(t, err)
	hostSleeps(t, tb.board, suspendFor)
	return tb
}

// TestHostSuspendAgesTheLagMeasurement checks the documented bound (Lag understates the
// true lag by less than LagProbeInterval) across a host suspend: a
// measurement taken before the suspend is not reused as current after it.
func TestHostSuspendAgesTheLagMeasurement(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	bound := time.Second // LagProbeInterval

	t.Run("FailClosedRead", func(t *testing.T) {
		t.Parallel()
		tb := suspendForedWithBacklog(t)
		r, err := tb.board.Top(ctx, 10)
		var stale *StaleError
		require.ErrorAs(t, err, &stale,
			"served %v with Lag %v and ProjectedThrough %v ago, while the oldest change has waited %v",
			r.Entries, r.Freshness.Lag, time.Now().Round(0).Sub(r.Freshness.ProjectedThrough.Round(0)).Round(time.Second), suspendFor)
		require.Greater(t, stale.Lag, suspendFor-bound)
	})

	t.Run("Freshness", func(t *testing.T) {
		t.Parallel()
		tb := suspendForedWithBacklog(t)
		fr := tb.board.Freshness(ctx)
		require.Greater(t, fr.Lag, suspendFor-bound, "%+v", fr)
	})

	t.Run("LagGauge", func(t *testing.T) {
		t.Parallel()
		tb := suspendForedWithBacklog(t)
		lag, ok := tb.board.observedLag(ctx)
		require.True(t, ok)
		require.Greater(t, lag, suspendFor-bound)
	})
}

// TestHostSuspendHidesNoRedisLoss: with RequireVerifiedProjection, a
// Redis that lost the board's keys during the suspend is seen by the first
// read after it ("every read made LagProbeInterval or more after the loss
// sees it"), not hidden by a look for Verify's record taken before.
func TestHostSuspendHidesNoRedisLoss(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t, func(c *Config) {
		c.RequireVerifiedProjection = true
		c.ReadPolicy = FailClosed
		c.MaxLag = 2 * time.Second
		c.LagProbeInterval = time.Second
	})
	tb.submit(t, "ada", 10)
	tb.drain(t)
	tb.verify(t)
	r, err := tb.board.Top(ctx, 10) // measures and looks for the record
	require.NoError(t, err)
	require.Len(t, r.Entries, 1)

	// During the suspend Redis restarts without persistence.
	keys, err := tb.rd.Client.Keys(ctx, tb.rd.Prefix+"*").Result()
	require.NoError(t, err)
	require.NotEmpty(t, keys)
	require.NoError(t, tb.rd.Client.Del(ctx, keys...).Err())
	hostSleeps(t, tb.board, suspendFor)

	r, err = tb.board.Top(ctx, 10)
	var stale *StaleError
	require.ErrorAs(t, err, &stale, "served %+v", r)
	require.True(t, stale.Unverified)
}

// TestHostSuspendProjectedThrough: after a host suspend, a read that
// reuses the measurement taken before it (a probe under way) reports Lag
// as the measurement's wall-clock age, and ProjectedThrough as the time of
// that measurement; time.Since(ProjectedThrough) must then say as much,
// not the monotonic age that stopped during the suspend.
func TestHostSuspendProjectedThrough(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := measuredNothingPending(t)
	hostSleeps(t, tb.board, suspendFor)
	// The first read after the resume is measuring (a slow reply): others
	// reuse the previous measurement.
	tb.board.lagMu.Lock()
	tb.board.lagProbe.running = true
	tb.board.lagMu.Unlock()
	fr := tb.board.Freshness(ctx)
	require.Greater(t, fr.Lag, suspendFor-time.Second, "%+v", fr)
	require.Greater(t, time.Since(fr.ProjectedThrough), suspendFor-time.Second,
		"Lag %v but time.Since(ProjectedThrough) %v", fr.Lag, time.Since(fr.ProjectedThrough))
}

// TestProjectedThroughAfterWallClockStepBack: the host's wall
// clock steps back (an NTP step) after a lag measurement that found nothing
// pending. A change committed after the step, not projected, is dated
// before the measurement's old wall reading; a read that reuses the
// measurement must not report a ProjectedThrough after that change
// ("a time before which every committed change of the board is reflected
// in the answer"), nor one in the future.
func TestProjectedThroughAfterWallClockStepBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := measuredNothingPending(t)

	// The wall clock steps back an hour: the measurement's wall reading is
	// now an hour ahead of the clock, its monotonic one unchanged.
	tb.board.lagMu.Lock()
	tb.board.lagProbe.at = slept(t, tb.board.lagProbe.at, -time.Hour)
	tb.board.lagMu.Unlock()

	tb.submit(t, "ada", 5) // committed, not projected
	committed := time.Now()
	r, err := tb.board.Top(ctx, 10)
	require.NoError(t, err)
	require.Equal(t, []Entry{{UserID: "ada", Score: 10, Rank: 1}}, r.Entries, "the change is not in the answer")
	require.False(t, r.Freshness.ProjectedThrough.After(committed),
		"ProjectedThrough %v claims the change committed at %v (%v in the future), which the answer lacks",
		r.Freshness.ProjectedThrough, committed.Round(0), r.Freshness.ProjectedThrough.Sub(time.Now().Round(0)).Round(time.Second))

	// A probe stuck meanwhile (a slow PostgreSQL): Lag grows with the
	// measurement's age; ProjectedThrough must stay consistent with it.
	tb.board.lagMu.Lock()
	tb.board.lagProbe.running = true
	tb.board.lagMu.Unlock()
	time.Sleep(1100 * time.Millisecond)
	fr := tb.board.Freshness(ctx)
	require.Positive(t, fr.Lag)
	require.False(t, fr.ProjectedThrough.After(time.Now()), "Lag %v, ProjectedThrough %v in the future", fr.Lag, fr.ProjectedThrough)
}

// TestClockStepAndRecordOfAnotherDatabase: the database clock steps back
// (the probe finds a pending change dated after it, as after a failover to
// a host whose clock lags), and Verify's record names another database
// than the one the lag probe found: reads are unverified, though the lag
// cannot be measured.
func TestClockStepAndRecordOfAnotherDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t, func(c *Config) {
		c.RequireVerifiedProjection = true
		c.ReadPolicy = FailClosed
		c.LagProbeInterval = time.Nanosecond
	})
	tb.submit(t, "ada", 10)
	tb.drain(t)
	tb.verify(t)
	require.False(t, tb.board.Freshness(ctx).Unverified)

	// The record now names another database (a promoted standby's system
	// identifier), as after a failover.
	record := tb.rd.Client.Get(ctx, tb.board.verifiedKey).Val()
	f := strings.Fields(record)
	require.Len(t, f, 4) // token, time, database, outbox table
	_, tl, _ := strings.Cut(f[2], ":")
	f[2] = "1234567890123456789:" + tl
	require.NoError(t, tb.rd.Client.Set(ctx, tb.board.verifiedKey, strings.Join(f, " "), 0).Err())
	require.True(t, tb.board.Freshness(ctx).Unverified, "another database, clock fine")

	// The new host's clock lags: a pending change is dated after it.
	tb.submit(t, "bob", 3)
	tb.futurePending(t, time.Hour)
	fr := tb.board.Freshness(ctx)
	require.Equal(t, time.Duration(-1), fr.Lag)
	require.True(t, fr.Unverified, "the record names another database than the probe found, yet %+v", fr)
	_, err := tb.board.Top(ctx, 10)
	var stale *StaleError
	require.ErrorAs(t, err, &stale)
	require.True(t, stale.Unverified, "%v", err)
}

// measuredNothingPending returns a board (LagProbeInterval 1 s) holding
// one projected score, whose last lag measurement found nothing pending.
func measuredNothingPending(t *testing.T) *testBundle {
	t.Helper()
	tb := setup(t, func(c *Config) { c.LagProbeInterval = time.Second })
	tb.submit(t, "ada", 10)
	tb.drain(t)
	r, err := tb.board.Top(context.Background(), 10) // measures: nothing pending
	require.NoError(t, err)
	require.Zero(t, r.Freshness.Lag)
	return tb
}

// skewedPool returns a pool on the bundle's database whose sessions see
// PostgreSQL's clock shifted by the value of <schema>_skew.offset_us (in
// microseconds; change it with setSkew): a schema before pg_catalog in the
// search_path holds now(), clock_timestamp() and statement_timestamp(),
// which verity's SQL calls unqualified. Column defaults (created_at DEFAULT
// now()) keep pg_catalog's, as they were bound at CREATE TABLE.
func (tb *testBundle) skewedPool(t *testing.T) (*pgxpool.Pool, func(time.Duration)) {
	t.Helper()
	ctx := context.Background()
	skew := pgx.Identifier{tb.pg.Schema + "_skew"}.Sanitize()
	for _, q := range []string{
		`CREATE SCHEMA ` + skew,
		`CREATE TABLE ` + skew + `.offset_us (v bigint NOT NULL)`,
		`INSERT INTO ` + skew + `.offset_us VALUES (0)`,
		`CREATE FUNCTION ` + skew + `.clock_timestamp() RETURNS timestamptz LANGUAGE sql VOLATILE AS
			$$ SELECT pg_catalog.clock_timestamp() + (SELECT v FROM ` + skew + `.offset_us) * interval '1 microsecond' $$`,
		`CREATE FUNCTION ` + skew + `.now() RETURNS timestamptz LANGUAGE sql STABLE AS
			$$ SELECT pg_catalog.now() + (SELECT v FROM ` + skew + `.offset_us) * interval '1 microsecond' $$`,
		`CREATE FUNCTION ` + skew + `.statement_timestamp() RETURNS timestamptz LANGUAGE sql STABLE AS
			$$ SELECT pg_catalog.statement_timestamp() + (SELECT v FROM ` + skew + `.offset_us) * interval '1 microsecond' $$`,
	} {
		_, err := tb.pg.Pool.Exec(ctx, q)
		require.NoError(t, err, q)
	}
	t.Cleanup(func() { _, _ = tb.pg.Pool.Exec(context.Background(), `DROP SCHEMA `+skew+` CASCADE`) })
	pool := tb.newPool(t, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["search_path"] = fmt.Sprintf("%s, pg_catalog, %s", skew, pgx.Identifier{tb.pg.Schema}.Sanitize())
	})
	// The skew is in effect for the pool's sessions.
	var d time.Duration
	setSkew := func(d time.Duration) {
		_, err := tb.pg.Pool.Exec(ctx, `UPDATE `+skew+`.offset_us SET v = $1`, d.Microseconds())
		require.NoError(t, err)
	}
	setSkew(-time.Hour)
	require.NoError(t, pool.QueryRow(ctx, `SELECT pg_catalog.clock_timestamp() - clock_timestamp()`).Scan(&d))
	require.InDelta(t, float64(time.Hour), float64(d), float64(time.Minute), "the skew schema is not in effect")
	setSkew(0)
	return pool, setSkew
}

// skewedReader returns a FailClosed board of tb's tables and keys on a
// pool whose database clock setSkew shifts (see skewedPool), with the
// probe and MaxLag of clockStepBoard.
func (tb *testBundle) skewedReader(t *testing.T) (*Board, func(time.Duration)) {
	t.Helper()
	pool, setSkew := tb.skewedPool(t)
	reader, err := New(pool, tb.rd.Client, &Config{Name: tb.board.Config().Name, Schema: tb.pg.Schema, KeyPrefix: tb.rd.Prefix,
		ReadPolicy: FailClosed, MaxLag: 400 * time.Millisecond, LagProbeInterval: 20 * time.Millisecond})
	require.NoError(t, err)
	t.Cleanup(reader.Close)
	return reader, setSkew
}

// TestLagAfterTheDatabaseClockSteppedBack: PostgreSQL's own clock steps
// back (not the rows' dates, as in TestLagWhenTheDatabaseClockSteppedBack)
// while a change waits, never projected: Redis keeps user-a's 10, the
// database holds 17. No FailClosed read may serve the 10 as fresh once
// the change has waited longer than MaxLag. Before, once the clock passed
// a change dated after it, its age was understated by the step and reads
// were served for up to the step; and a step shorter than the change's
// age, which dates no change after the clock, was not seen at all.
func TestLagAfterTheDatabaseClockSteppedBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// served counts reads that returned Redis's stale 10 after the change
	// had waited longer than the board could have missed it by.
	servedStale := func(t *testing.T, reader *Board, committed time.Time, read time.Duration, step func(waited time.Duration)) int {
		t.Helper()
		cfg := reader.Config()
		served := 0
		for waited := time.Since(committed); waited < read; waited = time.Since(committed) {
			step(waited)
			r, err := reader.Top(ctx, 10)
			if err != nil {
				var stale *StaleError
				require.ErrorAs(t, err, &stale)
			} else if r.Entries[0].Score == 10 && time.Since(committed) > cfg.MaxLag+cfg.LagProbeInterval+100*time.Millisecond {
				served++
			}
			time.Sleep(20 * time.Millisecond)
		}
		return served
	}
	requireRecovers := func(t *testing.T, tb *testBundle, reader *Board) {
		t.Helper()
		tb.drain(t)
		require.Eventually(t, func() bool {
			r, err := reader.Top(ctx, 10)
			return err == nil && r.Freshness.Source == SourceRedis && r.Entries[0].Score == 17 && r.Freshness.Lag >= 0
		}, 10*time.Second, 20*time.Millisecond, "once the change is projected the lag is measured again")
	}

	t.Run("ClockPassesTheWaitingChange", func(t *testing.T) {
		t.Parallel()
		tb := clockStepBoard(t, FailClosed)
		reader, setSkew := tb.skewedReader(t)
		r, err := reader.Top(ctx, 10)
		require.NoError(t, err)
		require.Equal(t, int64(10), r.Entries[0].Score)
		const step = 1500 * time.Millisecond
		tb.submit(t, "user-a", 7) // never projected
		committed := time.Now()
		setSkew(-step)
		require.Zero(t, servedStale(t, reader, committed, step+time.Second, func(time.Duration) {}))
		requireRecovers(t, tb, reader)
	})

	t.Run("StepShorterThanTheChangesAge", func(t *testing.T) {
		t.Parallel()
		tb := clockStepBoard(t, FailClosed)
		reader, setSkew := tb.skewedReader(t)
		tb.submit(t, "user-a", 7) // never projected
		committed := time.Now()
		stepped := false
		require.Zero(t, servedStale(t, reader, committed, 2*time.Second, func(waited time.Duration) {
			if waited > time.Second && !stepped {
				setSkew(-800 * time.Millisecond)
				stepped = true
			}
		}))
		requireRecovers(t, tb, reader)
	})
}

// TestLagWithAPoolOverServersWhoseClocksDiffer: a reader's pool whose
// connections reach two servers (two standbys behind a load balancer, say)
// whose clocks differ by 200 ms, both at or ahead of the primary's that
// dates the changes: no clock stepped back, and no change is dated after
// either clock. A pending change a few ms old reads as a small lag, not
// -1: comparing two probes' clocks across connections read half the
// rounds as a step back (10 of 20).
func TestLagWithAPoolOverServersWhoseClocksDiffer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := clockStepBoard(t, FailClosed)
	skew := pgx.Identifier{tb.pg.Schema + "_clocks"}.Sanitize()
	for _, q := range []string{
		`CREATE SCHEMA ` + skew,
		`CREATE FUNCTION ` + skew + `.clock_timestamp() RETURNS timestamptz LANGUAGE sql VOLATILE AS
			$$ SELECT pg_catalog.clock_timestamp() + coalesce(nullif(current_setting('test.skew_us', true), ''), '0')::bigint * interval '1 microsecond' $$`,
	} {
		_, err := tb.pg.Pool.Exec(ctx, q)
		require.NoError(t, err, q)
	}
	t.Cleanup(func() { _, _ = tb.pg.Pool.Exec(context.Background(), `DROP SCHEMA `+skew+` CASCADE`) })
	var n atomic.Int64
	pool := tb.newPool(t, func(c *pgxpool.Config) {
		c.MaxConns, c.MinConns = 2, 0
		c.ConnConfig.RuntimeParams["search_path"] = fmt.Sprintf("%s, pg_catalog, %s", skew, pgx.Identifier{tb.pg.Schema}.Sanitize())
		c.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
			us := 200_000 * (n.Add(1) % 2) // "server" A: +200 ms, "server" B: +0
			_, err := conn.Exec(ctx, fmt.Sprintf(`SET test.skew_us = '%d'`, us))
			return err
		}
	})
	c1, err := pool.Acquire(ctx)
	require.NoError(t, err)
	c2, err := pool.Acquire(ctx)
	require.NoError(t, err)
	conns := []*pgx.Conn{c1.Conn(), c2.Conn()}
	c1.Release()
	c2.Release()
	reader, err := New(pool, tb.rd.Client, &Config{Name: tb.board.Config().Name, Schema: tb.pg.Schema, KeyPrefix: tb.rd.Prefix,
		ReadPolicy: FailClosed, MaxLag: 400 * time.Millisecond, LagProbeInterval: 20 * time.Millisecond})
	require.NoError(t, err)
	t.Cleanup(reader.Close)

	unmeasured, refused := 0, 0
	const rounds = 20
	for i := 0; i < rounds; i++ {
		tb.drain(t)
		tb.submit(t, "user-a", 1) // pending, a few ms old at the read
		time.Sleep(25 * time.Millisecond)
		// The probe gets the other connection ("server").
		hc, err := pool.Acquire(ctx)
		require.NoError(t, err)
		var other *pgxpool.Conn
		if hc.Conn() != conns[i%2] {
			other = hc
			hc, err = pool.Acquire(ctx)
			require.NoError(t, err)
			other.Release()
		}
		fr := reader.Freshness(ctx)
		if fr.Lag < 0 {
			unmeasured++
		}
		if _, err := reader.Top(ctx, 10); err != nil {
			refused++
		}
		hc.Release()
	}
	t.Logf("rounds=%d unmeasured=%d refused=%d", rounds, unmeasured, refused)
	require.Zero(t, unmeasured, "a healthy board read Lag -1 in %d of %d rounds (%d reads refused)", unmeasured, rounds, refused)
}
