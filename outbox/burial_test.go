package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"

	"github.com/verity-go/verity/internal/telemetry/metrictest"
	"github.com/verity-go/verity/outbox"
)

// A relay restricted to stream "a" with MaxAttempts 1 takes over a partition
// whose lease a stream-"b" relay (MaxAttempts 10) let run out after its first
// attempt. The claim counts b's crashed attempt but leaves burying it to
// b's relays, whose MaxAttempts may be higher.
func TestClaimBuriesOnlyItsOwnStreams(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	rowB := newMessage("b", "kb", 1)
	rowA := newMessage("a", "ka", 1)
	b.appendCommitted(t, rowB, rowA) // consecutive ids: one partition

	relayB := b.relay(t, nil, &recorder{}, outbox.RelayConfig{Streams: []string{"b"}, MaxAttempts: 10, LeaseDuration: 10 * time.Second})
	batch, err := relayB.ClaimOnly(ctx) // relay B dies during attempt 1
	require.NoError(t, err)
	require.Len(t, batch, 1)
	require.Equal(t, rowB.EventID, batch[0].EventID)
	require.EqualValues(t, 1, b.expireLeases(t))

	relayA := b.relay(t, nil, &recorder{}, outbox.RelayConfig{Streams: []string{"a"}, MaxAttempts: 1})
	n, err := relayA.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)

	require.Zero(t, b.count(t, b.deadTable()),
		"stream b's row had 1 of its relay's 10 attempts")
	batch, err = relayB.ClaimOnly(ctx)
	require.NoError(t, err)
	require.Len(t, batch, 1)
	require.Equal(t, 2, batch[0].Attempts, "the crashed attempt counted")
}

// No relay hands out an attempt past its own MaxAttempts: a row of its
// streams that comes to it with that many attempts counted already is moved
// to the dead-letter table by the claim, keeping its last error.
func TestClaimBuriesRowsAtItsMaxAttempts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// Relays split by stream, all with the same MaxAttempts. A stream-"a"
	// row kills its relay on every attempt; after the last one a stream-"b"
	// relay takes the partition over and counts the attempt without burying
	// another stream's row. The next "a" relay handed it out once more, as
	// attempt MaxAttempts+1, and killed one relay too many.
	t.Run("CrashCountedByAnotherStreamsRelay", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		rowA := newMessage("a", "ka", 1)
		rowB := newMessage("b", "kb", 1)
		b.appendCommitted(t, rowA, rowB) // consecutive ids: one partition

		const maxAttempts = 2
		cfgA := outbox.RelayConfig{Streams: []string{"a"}, MaxAttempts: maxAttempts, LeaseDuration: 10 * time.Second}
		for crash := 1; crash <= maxAttempts; crash++ {
			batch, err := b.relay(t, nil, &recorder{}, cfgA).ClaimOnly(ctx) // the "a" relay dies during this attempt
			require.NoError(t, err)
			require.Len(t, batch, 1)
			require.Equal(t, crash, batch[0].Attempts)
			require.EqualValues(t, 1, b.expireLeases(t))
		}

		hb := &recorder{}
		n, err := b.relay(t, nil, hb, outbox.RelayConfig{Streams: []string{"b"}, MaxAttempts: maxAttempts}).RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		require.Equal(t, rowB.EventID, hb.seen()[0].EventID)
		rows := b.rows(t)
		require.Equal(t, maxAttempts, rows[0].Attempts, "the crashed attempt counted")
		require.Contains(t, *rows[0].LastError, fmt.Sprintf("the relay handling attempt %d stopped without settling it", maxAttempts))
		require.Zero(t, b.count(t, b.deadTable()), "not buried by a relay of another stream")

		logs := &syncBuffer{}
		metrics := metrictest.New(t)
		cfgA.Logger = slog.New(slog.NewTextHandler(logs, nil))
		cfgA.MeterProvider = metrics.Provider
		ha := &recorder{}
		r := b.relay(t, nil, ha, cfgA)
		n, err = r.RunOnce(ctx)
		require.NoError(t, err)
		require.Zero(t, n)
		require.Empty(t, ha.seen(), "attempt %d not handed out", maxAttempts+1)
		require.Zero(t, b.count(t, b.writer.Table()))
		b.requireLeasesFree(t)

		dead, err := r.DeadLetters(ctx, 0, 10)
		require.NoError(t, err)
		require.Len(t, dead, 1)
		require.Equal(t, rowA.EventID, dead[0].EventID)
		require.Equal(t, maxAttempts, dead[0].Attempts)
		require.Contains(t, dead[0].LastError, fmt.Sprintf("the relay handling attempt %d stopped without settling it", maxAttempts))
		require.Contains(t, logs.String(), "outbox rows moved to dead letters: they came to this relay with MaxAttempts attempts counted already")
		table := attribute.String(outbox.AttributeTable, b.cfg.Schema+".verity_outbox")
		require.Equal(t, int64(1), metrics.Collect(t).Int("verity.outbox.dead_lettered", table))
	})

	// A relay allowing more attempts retried the row past a smaller
	// MaxAttempts: the relay of the smaller one buries it with the last
	// failure instead of handing it out once more.
	t.Run("FailuresRetriedByARelayAllowingMore", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		msg := newMessage("s", "k", 1)
		b.appendCommitted(t, msg)
		failing := &recorder{fail: func(rec outbox.Record) error { return fmt.Errorf("attempt %d failed", rec.Attempts) }}
		// A backoff far longer than the test; the row is made due on purpose.
		more := b.relay(t, nil, failing, outbox.RelayConfig{MaxAttempts: 5, RetryBackoffMin: time.Minute, RetryBackoffMax: time.Minute})
		for range 2 {
			n, err := more.RunOnce(ctx)
			require.NoError(t, err)
			require.Equal(t, 1, n)
			b.makeDue(t)
		}

		h := &recorder{fail: func(outbox.Record) error { return errors.New("handed out") }}
		r := b.relay(t, nil, h, outbox.RelayConfig{MaxAttempts: 2})
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Zero(t, n)
		require.Empty(t, h.seen())
		b.requireLeasesFree(t)
		dead, err := r.DeadLetters(ctx, 0, 10)
		require.NoError(t, err)
		require.Len(t, dead, 1)
		require.Equal(t, msg.EventID, dead[0].EventID)
		require.Equal(t, 2, dead[0].Attempts)
		require.Equal(t, "attempt 2 failed", dead[0].LastError)
	})
}

// A row whose crashed attempt reaches MaxAttempts is moved to the
// dead-letter table by the claim that counted it (package doc, "Lifecycle
// of a row"), also when that claim's batch fills from another partition
// before its pick reaches the crashed one.
func TestClaimBuriesACrashedLastAttemptItDoesNotPick(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	msgs := make([]outbox.Message, 257)
	for i := range msgs {
		msgs[i] = newMessage("s", fmt.Sprint("k", i), 1)
	}
	b.appendCommitted(t, msgs...)
	// Keep id 1 (partition 0) and id 257 (partition 1).
	_, err := b.pool.Exec(ctx, `DELETE FROM `+b.writer.Table()+` WHERE id BETWEEN 2 AND 256`)
	require.NoError(t, err)

	const maxAttempts = 2
	cfg := outbox.RelayConfig{MaxAttempts: maxAttempts, BatchSize: 1, LeaseDuration: 10 * time.Second}
	for crash := 1; crash <= maxAttempts; crash++ {
		b.claimOrder(t, 0, 1)
		batch, err := b.relay(t, nil, &recorder{}, cfg).ClaimOnly(ctx) // dies during the attempt
		require.NoError(t, err)
		require.Len(t, batch, 1)
		require.EqualValues(t, 1, batch[0].ID)
		require.Equal(t, crash, batch[0].Attempts)
		require.EqualValues(t, 1, b.expireLeases(t))
	}

	b.claimOrder(t, 1, 0) // the batch of one fills from partition 1
	h := &recorder{}
	n, err := b.relay(t, nil, h, cfg).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.EqualValues(t, 257, h.seen()[0].ID)
	require.Equal(t, 1, b.count(t, b.deadTable()), "the crashed last attempt is buried by the claim that counted it")
	require.Zero(t, b.count(t, b.writer.Table()))
}

// A dead letter that already holds the id of a row whose crashed attempts
// reach MaxAttempts (an operator reset the outbox identity with TRUNCATE …
// RESTART IDENTITY while dead letters remained) makes every claim fail on
// the dead-letter primary key: the partition's touched_at would never
// advance, so every claim would lock it again and the whole relay stall,
// rows of other partitions included. The claim leaves such a row to be
// handed out again (only that batch's settle can fail on it).
func TestClaimBurialSkipsAnIDAlreadyDead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	poison := newMessage("s", "poison", 1)
	b.appendCommitted(t, poison)
	id := b.outboxIDs(t)[0]
	b.insertDead(t, id, uuid.New()) // a stale dead letter with the same id

	cfg := outbox.RelayConfig{MaxAttempts: 1, LeaseDuration: 10 * time.Second}
	_, err := b.relay(t, nil, &recorder{}, cfg).ClaimOnly(ctx) // dies during attempt 1
	require.NoError(t, err)
	require.EqualValues(t, 1, b.expireLeases(t))

	// A row of another partition.
	_, err = b.pool.Exec(ctx, `ALTER TABLE `+b.writer.Table()+` ALTER COLUMN id RESTART WITH 100000`)
	require.NoError(t, err)
	other := newMessage("s", "other", 1)
	b.appendCommitted(t, other)

	h := &recorder{}
	r := b.relay(t, nil, h, cfg)
	var errs []error
	for range 3 {
		_, err := r.RunOnce(ctx)
		errs = append(errs, err)
	}
	delivered := false
	for _, rec := range h.seen() {
		if rec.EventID == other.EventID {
			delivered = true
		}
	}
	require.True(t, delivered, "the row of the other partition is delivered; claims failed with %v", errs)
}

// The settle's burial meets the same stale dead letter: a row whose last
// attempt failed while its id is already in the dead-letter table stays in
// the outbox, retried after RetryBackoffMax, and the rest of its batch is
// settled. The burial's INSERT used to fail the whole settle on the
// primary key, so the rows the Handler had projected were never
// acknowledged, counted the failed settle as a crash, and were buried
// after MaxAttempts rounds although every attempt succeeded.
func TestSettleBurialKeepsAnIDAlreadyDead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	poison, good := newMessage("s", "poison", 1), newMessage("s", "good", 1)
	b.appendCommitted(t, poison, good) // consecutive ids: one partition, one batch
	poisonID := b.outboxIDs(t)[0]
	b.insertDead(t, poisonID, uuid.New()) // a stale dead letter with the same id

	h := &recorder{fail: func(rec outbox.Record) error {
		if rec.EventID == poison.EventID {
			return errors.New("projection failed")
		}
		return nil
	}}
	cfg := outbox.RelayConfig{MaxAttempts: 1, LeaseDuration: 10 * time.Second, RetryBackoffMax: time.Hour, DisableNotify: true}
	r := b.relay(t, nil, h, cfg)
	for range 3 {
		_, err := r.RunOnce(ctx)
		require.NoError(t, err, "the settle of a batch holding a row whose id is already dead")
	}
	dead, err := r.DeadLetters(ctx, 0, 100)
	require.NoError(t, err)
	require.Len(t, dead, 1, "only the stale dead letter")
	require.NotEqual(t, poison.EventID, dead[0].EventID)
	require.NotEqual(t, good.EventID, dead[0].EventID)

	rows := b.rows(t)
	require.Len(t, rows, 1, "the good row is acknowledged, the poisoned one kept")
	require.Equal(t, poison.EventID, rows[0].EventID)
	require.Equal(t, 1, rows[0].Attempts)
	require.NotNil(t, rows[0].LastError)
	require.Equal(t, "projection failed", *rows[0].LastError)
	require.Nil(t, rows[0].ClaimToken, "the kept row's lease is ended")
	require.Greater(t, time.Until(rows[0].AvailableAt), 50*time.Minute, "the kept row waits RetryBackoffMax")
	require.Len(t, h.seen(), 2, "each row handed out once")
}

// A row that comes to a claim with MaxAttempts attempts counted but no
// last_error (attempts stored by a composed INSERT, or counted by a relay
// of an earlier version) is buried with a last_error saying its relay
// stopped without settling it: the dead-letter table's last_error is NOT
// NULL, and a burial it refused would fail every claim of the partition.
func TestClaimBuriesARowWithoutLastError(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	exhausted, good := newMessage("s", "exhausted", 1), newMessage("s", "good", 1)
	b.appendCommitted(t, exhausted, good)
	_, err := b.pool.Exec(ctx, `UPDATE `+b.writer.Table()+` SET attempts = 3 WHERE key = 'exhausted'`)
	require.NoError(t, err)

	h := &recorder{}
	r := b.relay(t, nil, h, outbox.RelayConfig{MaxAttempts: 3})
	n, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, good.EventID, h.seen()[0].EventID)
	dead, err := r.DeadLetters(ctx, 0, 10)
	require.NoError(t, err)
	require.Len(t, dead, 1)
	require.Equal(t, exhausted.EventID, dead[0].EventID)
	require.Equal(t, 3, dead[0].Attempts)
	require.Contains(t, dead[0].LastError, "the relay handling attempt 3 stopped without settling it")
}

// A composed INSERT may store any attempts, up to the integer column's
// maximum: adding the current attempt to it overflowed in every claim of
// its partition, which failed uncounted again and again. The count now
// saturates, on every path that adds an attempt: the claim's own (a relay
// whose MaxAttempts is beyond the column's range hands such a row out;
// others bury it), a crashed attempt counted for another stream's row, and
// a burial.
func TestClaimSaturatesAttempts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	_, err := b.pool.Exec(ctx, `INSERT INTO `+b.writer.Table()+` (event_id, stream, key, version, payload, attempts)
		VALUES (gen_random_uuid(), 'b', 'kb', 1, '', 2147483647)`)
	require.NoError(t, err)
	rowA := newMessage("a", "ka", 1)
	b.appendCommitted(t, rowA) // the same partition

	cfg := outbox.RelayConfig{LeaseDuration: 10 * time.Second, MaxAttempts: math.MaxInt}
	batch, err := b.relay(t, nil, &recorder{}, cfg).ClaimOnly(ctx) // dies during the attempt
	require.NoError(t, err)
	require.Len(t, batch, 2)
	require.Equal(t, math.MaxInt32, batch[0].Attempts)
	require.EqualValues(t, 1, b.expireLeases(t))

	// Stream a's relay counts the crashed attempt of b's row without burying it.
	h := &recorder{}
	n, err := b.relay(t, nil, h, outbox.RelayConfig{Streams: []string{"a"}}).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, rowA.EventID, h.seen()[0].EventID)
	require.Equal(t, math.MaxInt32, b.rows(t)[0].Attempts)

	// A relay of every stream dies with it again, and the next claim, of a
	// relay whose MaxAttempts the count reaches, buries it.
	_, err = b.relay(t, nil, &recorder{}, cfg).ClaimOnly(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, b.expireLeases(t))
	n, err = b.relay(t, nil, &recorder{}, outbox.RelayConfig{MaxAttempts: math.MaxInt32}).RunOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, n)
	var attempts int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT attempts FROM `+b.deadTable()).Scan(&attempts))
	require.Equal(t, math.MaxInt32, attempts)
}

// exhaustedBacklog appends n rows and lets a relay allowing 5 attempts fail
// each of them twice, then makes them due again: rows that a relay with
// MaxAttempts 2 buries at its next claim (as after a rollout that lowers
// MaxAttempts while rows are retrying). Then it appends good, behind them
// in the same partition.
func (b *testBundle) exhaustedBacklog(t *testing.T, n int, good ...outbox.Message) {
	t.Helper()
	ctx := context.Background()
	msgs := make([]outbox.Message, n)
	for i := range msgs {
		msgs[i] = newMessage("s", fmt.Sprint("exhausted-", i), 1)
	}
	b.appendCommitted(t, msgs...)
	failing := &recorder{fail: func(rec outbox.Record) error { return fmt.Errorf("attempt %d failed", rec.Attempts) }}
	// A backoff far longer than the test; the rows are made due on purpose.
	more := b.relay(t, nil, failing, outbox.RelayConfig{MaxAttempts: 5, RetryBackoffMin: time.Minute, RetryBackoffMax: time.Minute})
	for range 2 {
		got, err := more.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, n, got)
		b.makeDue(t)
	}
	b.appendCommitted(t, good...)
}

// A claim that buries rows at its MaxAttempts makes progress although it
// hands nothing out. Counted as an empty claim, it ended RunOnce with 0
// after claimRetries of them, while rows were due behind the buried ones
// (leaderboard.Worker.Drain stops on 0, "none is due"), and Run waited a
// PollInterval after such claims, and after a batch partly buried.
func TestClaimBurialsAreProgress(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	delivered := func(h *recorder, msgs ...outbox.Message) func() bool {
		return func() bool {
			seen := map[uuid.UUID]bool{}
			for _, rec := range h.seen() {
				seen[rec.EventID] = true
			}
			for _, m := range msgs {
				if !seen[m.EventID] {
					return false
				}
			}
			return true
		}
	}

	// More than claimRetries claims bury only, then the good row.
	t.Run("RunOnceReachesRowsBehindThem", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		good := newMessage("s", "good", 1)
		b.exhaustedBacklog(t, 4, good)

		h := &recorder{}
		r := b.relay(t, nil, h, outbox.RelayConfig{MaxAttempts: 2, BatchSize: 1})
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n, "RunOnce returns 0 only when nothing is due; buried rows are not counted")
		require.Len(t, h.seen(), 1)
		require.Equal(t, good.EventID, h.seen()[0].EventID)
		require.Equal(t, 4, b.count(t, b.deadTable()))
		b.requireLeasesFree(t)

		n, err = r.RunOnce(ctx)
		require.NoError(t, err)
		require.Zero(t, n)
		st, err := r.Stats(ctx)
		require.NoError(t, err)
		require.Zero(t, st.Pending)
	})

	// Run claims again at once after claims that only buried (more of them
	// than claimRetries) as after a full batch.
	t.Run("RunDoesNotWaitAfterClaimsThatOnlyBuried", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		good := newMessage("s", "good", 1)
		b.exhaustedBacklog(t, 6, good)

		h := &recorder{}
		startRun(t, b.relay(t, nil, h, outbox.RelayConfig{MaxAttempts: 2, BatchSize: 2, PollInterval: time.Minute, DisableNotify: true}))
		require.Eventually(t, delivered(h, good), 5*time.Second, 20*time.Millisecond,
			"the good row, due from the start, is delivered within 5s (PollInterval 1m)")
	})

	// A batch of BatchSize rows read, one of them buried, is a full batch:
	// the row behind it is due at once.
	t.Run("RunDoesNotWaitAfterABatchPartlyBuried", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		first, second := newMessage("s", "first", 1), newMessage("s", "second", 1)
		b.exhaustedBacklog(t, 1, first, second)

		h := &recorder{}
		startRun(t, b.relay(t, nil, h, outbox.RelayConfig{MaxAttempts: 2, BatchSize: 2, PollInterval: time.Minute, DisableNotify: true}))
		require.Eventually(t, delivered(h, first, second), 5*time.Second, 20*time.Millisecond,
			"both good rows, due from the start, are delivered within 5s (PollInterval 1m)")
		require.Len(t, h.seen(), 2, "in two batches, the first partly buried")
	})
}
