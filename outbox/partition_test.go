package outbox_test

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"

	"github.com/verity-go/verity/internal/telemetry/metrictest"
	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
)

// TestRelayPartitionLeases covers what the partition leases must keep from
// per-row leases: crashed attempts count, no row is skipped, the migration
// upgrades a live outbox, and Run does not stop at one claim's partitions.
func TestRelayPartitionLeases(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// A row whose handling kills the relay every time is not retried
	// forever: each takeover of the dead relay's partition counts the
	// attempt, and the attempt that fails with an error buries it.
	t.Run("CrashedAttemptsCountTowardsDeadLetter", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		poison := newMessage("s", "poison", 1)
		b.appendCommitted(t, poison)
		// A lease longer than a claim could take (RunOnce's claim is bounded
		// by it, and a short one can run out before the claim's reply on a
		// loaded machine), ended on purpose after each crash.
		const lease = 10 * time.Second
		cfg := outbox.RelayConfig{LeaseDuration: lease, MaxAttempts: 3}
		for crash := 1; crash <= 2; crash++ {
			crashed := b.relay(t, nil, &recorder{}, cfg)
			batch, err := crashed.ClaimOnly(ctx)
			require.NoError(t, err)
			require.Len(t, batch, 1)
			require.Equal(t, crash, batch[0].Attempts)
			require.EqualValues(t, 1, b.expireLeases(t), "the crashed claim holds one partition")
		}
		h := &recorder{fail: func(outbox.Record) error { return errors.New("poison") }}
		n, err := b.relay(t, nil, h, cfg).RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		require.Equal(t, 3, h.seen()[0].Attempts, "two crashed attempts and this one")
		require.Zero(t, b.count(t, b.writer.Table()))
		dead, err := b.relay(t, nil, h, cfg).DeadLetters(ctx, 0, 10)
		require.NoError(t, err)
		require.Len(t, dead, 1)
		require.Equal(t, poison.EventID, dead[0].EventID)
		require.Equal(t, 3, dead[0].Attempts)
	})

	// A row whose handling kills the relay every time never fails with an
	// error: the claim that recovers its MaxAttempts-th crashed attempt
	// buries it instead of handing it out again. The rows that shared every
	// crashed batch go with it (nothing tells which row was the cause); a
	// row that shared fewer is delivered, and ReplayDead brings the others
	// back.
	t.Run("RowThatAlwaysCrashesIsDeadLettered", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		poison := newMessage("s", "poison", 1)
		neighbour := newMessage("s", "neighbour", 1)
		late := newMessage("s", "late", 1)
		b.appendCommitted(t, poison, neighbour)
		const maxAttempts = 3
		// A lease longer than a claim could take, ended on purpose after
		// each crash (see CrashedAttemptsCountTowardsDeadLetter).
		cfg := outbox.RelayConfig{LeaseDuration: 10 * time.Second, MaxAttempts: maxAttempts}
		for crash := 1; crash <= maxAttempts; crash++ {
			batch, err := b.relay(t, nil, &recorder{}, cfg).ClaimOnly(ctx)
			require.NoError(t, err)
			attempts := map[string]int{}
			for _, rec := range batch {
				attempts[rec.Key] = rec.Attempts
			}
			want := map[string]int{"poison": crash, "neighbour": crash}
			if crash > 1 {
				want["late"] = crash - 1
			}
			require.Equal(t, want, attempts, "crash %d", crash)
			require.EqualValues(t, 1, b.expireLeases(t), "the crashed claim holds one partition")
			if crash == 1 {
				b.appendCommitted(t, late)
			}
		}

		logs := &syncBuffer{}
		metrics := metrictest.New(t)
		h := &recorder{}
		cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
		cfg.MeterProvider = metrics.Provider
		r := b.relay(t, nil, h, cfg)
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n, "only the row that shared two of the three crashes is handed out")
		require.Equal(t, late.EventID, h.seen()[0].EventID)
		require.Equal(t, maxAttempts, h.seen()[0].Attempts, "its last attempt")
		require.Zero(t, b.count(t, b.writer.Table()))
		b.requireLeasesFree(t)

		dead, err := r.DeadLetters(ctx, 0, 10)
		require.NoError(t, err)
		require.Len(t, dead, 2)
		for i, msg := range []outbox.Message{poison, neighbour} {
			require.Equal(t, msg.EventID, dead[i].EventID)
			require.Equal(t, maxAttempts, dead[i].Attempts)
			require.Contains(t, dead[i].LastError, "the relay handling attempt 3 stopped without settling it")
		}
		// The claim that takes the partition over buries them, and says why;
		// not its reading of the rows, which would log that their attempts
		// had been used up elsewhere.
		require.Contains(t, logs.String(), "outbox rows moved to dead letters: the relay handling their last attempt stopped without settling them")
		require.NotContains(t, logs.String(), "came to this relay with MaxAttempts attempts counted already")
		table := attribute.String(outbox.AttributeTable, b.cfg.Schema+".verity_outbox")
		s := metrics.Collect(t)
		require.Equal(t, int64(2), s.Int("verity.outbox.dead_lettered", table))
		require.Equal(t, int64(1), s.Int("verity.outbox.acked", table))

		moved, err := r.ReplayDead(ctx, outbox.ReplayFilter{})
		require.NoError(t, err)
		require.Equal(t, int64(2), moved)
		n, err = r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 2, n)
		for _, rec := range h.seen()[1:] {
			require.Equal(t, 1, rec.Attempts, "a replayed row starts over")
		}
	})

	// A transaction that took a lower id but commits after higher ids were
	// delivered is still delivered: claims read each partition from its
	// start, not from a remembered position.
	t.Run("LateCommitWithLowerIDIsDelivered", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		early := newMessage("s", "early-id", 1)
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
		require.NoError(t, b.writer.Append(ctx, tx, early))
		late := newMessage("s", "late-id", 1)
		b.appendCommitted(t, late)

		h := &recorder{}
		r := b.relay(t, nil, h, outbox.RelayConfig{})
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		require.NoError(t, tx.Commit(ctx))
		n, err = r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		seen := h.seen()
		require.Equal(t, late.EventID, seen[0].EventID)
		require.Equal(t, early.EventID, seen[1].EventID)
		require.Less(t, seen[1].ID, seen[0].ID, "the late row has the lower id")
	})

	// A row stamped by a relay of an earlier version (row-level lease) is
	// left to that relay while its lease lasts, so a rolling upgrade does
	// not deliver it twice at once, and Stats counts it in flight. Once
	// that lease has ended (the old relay crashed) the row is neither in
	// flight nor held back.
	t.Run("RowLeaseOfOlderRelayIsHonoured", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendCommitted(t, newMessage("s", "live", 1), newMessage("s", "expired", 1))
		_, err := b.pool.Exec(ctx, `UPDATE `+b.writer.Table()+` SET leased_until = now() + interval '1 hour', claim_token = gen_random_uuid() WHERE key = 'live'`)
		require.NoError(t, err)
		_, err = b.pool.Exec(ctx, `UPDATE `+b.writer.Table()+` SET leased_until = now() - interval '1 hour', claim_token = gen_random_uuid() WHERE key = 'expired'`)
		require.NoError(t, err)
		h := &recorder{}
		r := b.relay(t, nil, h, outbox.RelayConfig{})
		stats, err := r.Stats(ctx)
		require.NoError(t, err)
		require.EqualValues(t, 2, stats.Pending)
		require.EqualValues(t, 1, stats.InFlight, "the live row-level lease counts; the expired one does not")

		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		require.Equal(t, "expired", h.seen()[0].Key)
		n, err = r.RunOnce(ctx)
		require.NoError(t, err)
		require.Zero(t, n, "the live row-level lease is left alone")
	})

	// A claim cut off by its context is still running on the server, and
	// pgx's cancel request, sent in the background as it drops the
	// connection, may land too late or not at all: once unblocked the claim
	// would commit its lease, leaving the partition to a token nobody holds
	// until the lease ends. The relay releases it instead. The relay's pool
	// refuses new connections once warm, so that pgx's cancel request never
	// arrives and the release runs on the pool's other connection.
	t.Run("CutOffClaimReleasesItsPartitions", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		var refuse atomic.Bool
		cfg, err := pgxpool.ParseConfig(b.pg.ConnString)
		require.NoError(t, err)
		cfg.MaxConns = 2
		cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			if refuse.Load() {
				return nil, errors.New("test: new connections refused")
			}
			return (&net.Dialer{}).DialContext(ctx, network, addr)
		}
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		c1, err := pool.Acquire(ctx)
		require.NoError(t, err)
		c2, err := pool.Acquire(ctx)
		require.NoError(t, err)
		c1.Release()
		c2.Release()
		h := &recorder{}
		r := b.relay(t, pool, h, outbox.RelayConfig{LeaseDuration: time.Minute})
		msg, blocker := b.blockNextClaim(t, r)
		// Another relay's batch holds partition 63: the release frees only
		// what the cut-off claim leased.
		var otherOwner string
		require.NoError(t, b.pool.QueryRow(ctx, `UPDATE `+b.leasesTable()+` SET owner = gen_random_uuid(),
    leased_until = now() + interval '1 hour' WHERE part = 63 RETURNING owner::text`).Scan(&otherOwner))

		refuse.Store(true)
		cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		began := time.Now()
		_, err = r.RunOnce(cctx)
		cancel()
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.Less(t, time.Since(began), 2*time.Second, "the release cancels the claim rather than wait for its lock")
		require.NoError(t, blocker.Commit(ctx))
		// Wait for the claim's transaction, if it still runs, to end: it
		// holds the lease row's lock.
		_, err = b.pool.Exec(ctx, `SELECT 1 FROM `+b.leasesTable()+` FOR UPDATE`)
		require.NoError(t, err)
		var leased []string
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT coalesce(array_agg(owner::text), '{}') FROM `+b.leasesTable()+
			` WHERE owner IS NOT NULL AND leased_until > now()`).Scan(&leased))
		require.Equal(t, []string{otherOwner}, leased, "no partition is leased to the cut-off claim; the other relay's lease holds")
		refuse.Store(false)

		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n, "the row is claimable at once")
		seen := h.seen()
		require.Equal(t, msg.EventID, seen[len(seen)-1].EventID)
		require.Equal(t, 2, seen[len(seen)-1].Attempts, "the crashed relay's attempt and this one; the cut-off claim's none")
	})

	// Within a partition rows are claimed in (available_at, id) order: a
	// row whose backoff ended earlier goes before a lower id that became
	// due later (a retried row comes back behind rows due before it).
	t.Run("PartitionIsClaimedInAvailableAtOrder", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendCommitted(t, newMessage("s", "due-later", 1), newMessage("s", "due-earlier", 1), newMessage("s", "due-last", 1))
		_, err := b.pool.Exec(ctx, `UPDATE `+b.writer.Table()+` SET available_at = now() - CASE key
    WHEN 'due-earlier' THEN interval '3 minutes' WHEN 'due-later' THEN interval '2 minutes' ELSE interval '1 minute' END`)
		require.NoError(t, err)
		h := &recorder{}
		r := b.relay(t, nil, h, outbox.RelayConfig{BatchSize: 1})
		for range 3 {
			n, err := r.RunOnce(ctx)
			require.NoError(t, err)
			require.Equal(t, 1, n)
		}
		var keys []string
		for _, rec := range h.seen() {
			keys = append(keys, rec.Key)
		}
		require.Equal(t, []string{"due-earlier", "due-later", "due-last"}, keys)
	})

	// A batch spanning partitions is handed to the Handler in id order,
	// whatever order the partitions were read in.
	t.Run("BatchIsInIDOrder", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendPartitions(t, 2)
		b.claimOrder(t, 1, 0)
		h := &recorder{}
		n, err := b.relay(t, nil, h, outbox.RelayConfig{BatchSize: 600}).RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 511, n)
		require.True(t, slices.IsSortedFunc(h.seen(), func(a, b outbox.Record) int { return cmp.Compare(a.ID, b.ID) }))
	})

	// A claim fills its batch from the partitions it leased least recently
	// claimed first, so that on a backlog the partition that waited longest
	// is served, not leased and given back again.
	t.Run("BatchFillsFromLeastRecentlyClaimed", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		ctx := context.Background()
		b.appendPartitions(t, 10)
		rows := b.rows(t)
		require.EqualValues(t, 1, rows[0].ID)
		require.EqualValues(t, 10*256-1, rows[len(rows)-1].ID)
		// More due partitions than a claim looks at (eight), so that the
		// ones it looks at must be the least recently claimed too.
		for _, order := range [][]int{{9, 8, 7, 6, 5, 4, 3, 2, 1, 0}, {1, 3, 0, 4, 2, 9, 7, 5, 8, 6}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}} {
			b.claimOrder(t, order...)
			h := &recorder{}
			r := b.relay(t, nil, h, outbox.RelayConfig{BatchSize: 5, PollInterval: time.Hour, DisableNotify: true})
			n, err := r.RunOnce(ctx)
			require.NoError(t, err)
			require.Equal(t, 5, n)
			for _, rec := range h.seen() {
				require.EqualValues(t, order[0], rec.ID/256%64, "order %v: record %d", order, rec.ID)
			}
		}
	})

	// Rows spread over more partitions than one claim takes are all
	// delivered by Run at once, not one claim per poll.
	t.Run("RunClaimsAgainWhenMorePartitionsAreDue", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		const rows = 6 * 256 // six partitions
		msgs := make([]outbox.Message, rows)
		for i := range msgs {
			msgs[i] = newMessage("s", fmt.Sprint("k", i), 1)
		}
		b.appendCommitted(t, msgs...)
		var handled atomic.Int64
		r := b.relay(t, nil, outbox.HandlerFunc(func(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			handled.Add(int64(len(batch)))
			return make([]outbox.Result, len(batch)), nil
		}), outbox.RelayConfig{BatchSize: outbox.BatchSizeMax, PollInterval: time.Hour, DisableNotify: true})
		startRun(t, r)
		require.Eventually(t, func() bool { return handled.Load() == rows }, 10*time.Second, 10*time.Millisecond)
	})

	// The same when a claim locked as many partitions as it may but read
	// less than a full batch from them: rows may be due in partitions it
	// did not lease, and Run claims again at once.
	t.Run("RunClaimsAgainAfterLeasingAsManyPartitionsAsItMay", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendPartitions(t, 6)
		// Ten rows in each of six partitions: a claim of four partitions
		// reads forty, well under BatchSize.
		_, err := b.pool.Exec(ctx, `DELETE FROM `+b.writer.Table()+` WHERE id % 256 >= 10`)
		require.NoError(t, err)
		var due int64
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM `+b.writer.Table()).Scan(&due))
		require.Greater(t, due, int64(4*10), "more than one claim of four partitions reads")
		var handled atomic.Int64
		r := b.relay(t, nil, outbox.HandlerFunc(func(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			handled.Add(int64(len(batch)))
			return make([]outbox.Result, len(batch)), nil
		}), outbox.RelayConfig{BatchSize: 100, PollInterval: time.Hour, DisableNotify: true})
		startRun(t, r)
		require.Eventually(t, func() bool { return handled.Load() == due }, 10*time.Second, 10*time.Millisecond,
			"rows in the partitions the first claim did not lease waited for the poll")
	})

	// Claims that run at the same moment lock the same first partitions;
	// one that finds every one of them locked takes the next free ones
	// instead of coming back empty (in Run, to wait a pause while a
	// backlog waits too).
	t.Run("ClaimPassesPartitionsOtherClaimsAreTaking", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendPartitions(t, 12)
		b.claimOrder(t, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)
		// Two claims under way hold the eight partitions claimed longest ago.
		others := b.lockPartitionsBelow(t, 8)

		h := &recorder{}
		r := b.relay(t, nil, h, outbox.RelayConfig{BatchSize: 300, PollInterval: time.Hour, DisableNotify: true})
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 300, n, "256 rows of partition 8, then 44 of partition 9")
		for _, rec := range h.seen() {
			require.Contains(t, []int64{8, 9}, rec.ID/256%64, "record %d", rec.ID)
		}
		require.NoError(t, others.Rollback(ctx))
		n, err = r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 300, n)
		require.EqualValues(t, 1, h.seen()[300].ID, "partition 0 is next once it is free")
	})

	// When every partition the claim looked at first is being taken by
	// other claims, it looks further ("more"), and there too it must pass
	// partitions that another relay's live lease holds: that relay's batch
	// has their rows.
	t.Run("ClaimPassingLockedPartitionsSkipsLiveLeases", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendPartitions(t, 11)
		b.claimOrder(t, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
		// Partition 8 is another relay's, its lease live for an hour.
		_, err := b.pool.Exec(ctx, `UPDATE `+b.leasesTable()+` SET owner = gen_random_uuid(), leased_until = now() + interval '1 hour',
			inflight = '{[2048,2304)}' WHERE part = 8`)
		require.NoError(t, err)
		// Claims under way hold the eight partitions claimed longest ago.
		b.lockPartitionsBelow(t, 8)

		h := &recorder{}
		r := b.relay(t, nil, h, outbox.RelayConfig{BatchSize: 300, PollInterval: time.Hour, DisableNotify: true})
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 300, n, "256 rows of partition 9, then 44 of partition 10")
		for _, rec := range h.seen() {
			require.Contains(t, []int64{9, 10}, rec.ID/256%64, "record %d", rec.ID)
		}
		var owned bool
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT owner IS DISTINCT FROM NULL AND leased_until > now() AND inflight = '{[2048,2304)}'
FROM `+b.leasesTable()+` WHERE part = 8`).Scan(&owned))
		require.True(t, owned, "partition 8's lease is the other relay's still")
	})

	// While its batch is out, a claim's lease rows say exactly which rows
	// it handed out (what a takeover after a crash counts an attempt for),
	// and a leased partition that contributed none is back at once, still
	// first in line.
	t.Run("ClaimRecordsWhatItHandedOut", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendPartitions(t, 3)
		// Partition 0 is claimed first, then 1, then 2; row 100 of
		// partition 0 is not due, so what partition 0 hands out is two runs.
		b.claimOrder(t, 0, 1, 2)
		_, err := b.pool.Exec(ctx, `UPDATE `+b.writer.Table()+` SET available_at = now() + interval '1 hour' WHERE id = 100`)
		require.NoError(t, err)

		type lease struct {
			Part     int
			Owned    bool
			Inflight string
			Touched  bool // touched_at moved from what the test set
		}
		var during []lease
		r := b.relay(t, nil, outbox.HandlerFunc(func(ctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			rows, err := b.pool.Query(ctx, `SELECT part, owner IS NOT NULL AND leased_until > now(), inflight::text,
    touched_at <> '2000-01-01'::timestamptz + part * interval '1 hour'
FROM `+b.leasesTable()+` WHERE part < 3 ORDER BY part`)
			if err != nil {
				return nil, err
			}
			during, err = pgx.CollectRows(rows, pgx.RowToStructByPos[lease])
			return make([]outbox.Result, len(batch)), err
		}), outbox.RelayConfig{BatchSize: 300, PollInterval: time.Hour, DisableNotify: true})
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 300, n, "254 rows of partition 0, then 46 of partition 1")
		require.Equal(t, []lease{
			{Part: 0, Owned: true, Inflight: "{[1,100),[101,256)}", Touched: true},
			{Part: 1, Owned: true, Inflight: "{[256,302)}", Touched: true},
			{Part: 2, Owned: false, Inflight: "{}", Touched: false},
		}, during)
		b.requireLeasesFree(t)
	})
}

// A claim looks at a bounded number of partitions with due rows, least
// recently claimed first, and gives back the ones that gave it nothing
// without moving them back in that order. So the due-row test must count
// only rows this relay could take: eight partitions (as many as one claim
// looks at) holding only rows it cannot take, claimed before the one that
// holds a row it can, would otherwise fill every claim, and that row would
// never be delivered.
func TestClaimIsNotCrowdedOutByRowsItCannotTake(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, c := range map[string]struct {
		untake string // makes a row one the relay cannot take
		cfg    outbox.RelayConfig
	}{
		"BackingOff":           {untake: `available_at = now() + interval '1 hour'`},
		"Published":            {untake: `published_at = now()`, cfg: outbox.RelayConfig{KeepPublished: true}},
		"RowLeaseOfOlderRelay": {untake: `leased_until = now() + interval '1 hour', claim_token = gen_random_uuid()`},
		"OtherStream":          {untake: `stream = 'other'`, cfg: outbox.RelayConfig{Streams: []string{"s"}}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			// One row in each of partitions 0 to 8 (ids 1, 257, …, 2049).
			b.appendPartitions(t, 9)
			_, err := b.pool.Exec(ctx, `DELETE FROM `+b.writer.Table()+` WHERE id % 256 <> 1`)
			require.NoError(t, err)
			_, err = b.pool.Exec(ctx, `UPDATE `+b.writer.Table()+` SET `+c.untake+` WHERE id < 8 * 256`)
			require.NoError(t, err)
			b.claimOrder(t, 0, 1, 2, 3, 4, 5, 6, 7, 8)

			h := &recorder{}
			c.cfg.PollInterval, c.cfg.DisableNotify = time.Hour, true
			n, err := b.relay(t, nil, h, c.cfg).RunOnce(ctx)
			require.NoError(t, err)
			require.Equal(t, 1, n, "the row of partition 8 is delivered")
			require.EqualValues(t, 8*256+1, h.seen()[0].ID)
		})
	}
}

// appendPartitions appends and commits rows with ids 1 to n*256-1: every
// id of partitions 0 to n-1 (id 0 is never assigned).
func (b *testBundle) appendPartitions(t *testing.T, n int) {
	t.Helper()
	msgs := make([]outbox.Message, n*256-1)
	for i := range msgs {
		msgs[i] = newMessage("s", fmt.Sprint("k", i), 1)
	}
	b.appendCommitted(t, msgs...)
}

// lockPartitionsBelow locks the lease rows of partitions 0 to n-1, as
// claims under way do, in a transaction it returns (rolled back at the
// test's end at the latest).
func (b *testBundle) lockPartitionsBelow(t *testing.T, n int) pgx.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(ctx) })
	_, err = tx.Exec(ctx, `SELECT 1 FROM `+b.leasesTable()+` WHERE part < $1 FOR UPDATE`, n)
	require.NoError(t, err)
	return tx
}

// claimOrder makes claims take the partitions parts in that order: the
// touched_at of the lease of parts[rank] is 2000-01-01 plus rank hours.
// They are written in reverse, so that the lease rows' physical order (an
// UPDATE moves a row to the end) is the opposite of the claim order.
func (b *testBundle) claimOrder(t *testing.T, parts ...int) {
	t.Helper()
	for rank := len(parts) - 1; rank >= 0; rank-- {
		_, err := b.pool.Exec(context.Background(), `UPDATE `+b.leasesTable()+
			` SET touched_at = '2000-01-01'::timestamptz + $2 * interval '1 hour' WHERE part = $1`, parts[rank], rank)
		require.NoError(t, err)
	}
}

// TestMigratePartitionLeasesOnExistingOutbox applies the migrations before
// 003 (an outbox of the previous version), appends rows, then migrates to
// the current version: the rows are delivered and nothing is lost.
func TestMigratePartitionLeasesOnExistingOutbox(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testenv.Postgres(t)
	cfg := &outbox.Config{Schema: pg.Schema}
	migrateBefore(t, pg, cfg, "003")
	w, err := outbox.NewWriter(cfg)
	require.NoError(t, err)
	b := &testBundle{pg: pg, pool: pg.Pool, cfg: cfg, writer: w}

	// Before 003 a relay of this version cannot claim, and says why.
	_, err = b.relay(t, nil, &recorder{}, outbox.RelayConfig{}).RunOnce(ctx)
	require.ErrorIs(t, err, outbox.ErrNotMigrated)

	msgs := make([]outbox.Message, 700)
	for i := range msgs {
		msgs[i] = newMessage("s", fmt.Sprint("k", i), 1)
	}
	b.appendCommitted(t, msgs...)

	require.NoError(t, outbox.Migrate(ctx, pg.Pool, cfg))
	require.NoError(t, outbox.Migrate(ctx, pg.Pool, cfg), "idempotent")
	require.Equal(t, 64, b.count(t, b.leasesTable()), "one lease row per partition, once")

	h := &recorder{}
	drain(t, b.relay(t, nil, h, outbox.RelayConfig{BatchSize: 300}))
	require.Len(t, h.seen(), len(msgs))
	require.Zero(t, b.count(t, w.Table()))
}
