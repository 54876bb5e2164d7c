package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"

	"github.com/verity-go/verity/internal/telemetry/metrictest"
	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
)

// README: verity.outbox.released counts "rows released unprocessed for
// immediate re-delivery ... when the context of a RunOnce is cancelled while
// its Handler runs" -- and such rows are neither retried nor lease-lost.
func TestRelayMetricsReleasedOnRunOnceCancel(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rec := metrictest.New(t)
	b.appendCommitted(t, newMessage("scores", "rel-1", 1), newMessage("scores", "rel-2", 1))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	started := make(chan struct{})
	h := outbox.HandlerFunc(func(hctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
		close(started)
		<-hctx.Done()
		return nil, hctx.Err()
	})
	r := b.relay(t, nil, h, outbox.RelayConfig{MeterProvider: rec.Provider, LeaseDuration: 30 * time.Second})
	go func() { <-started; cancel() }()
	n, _ := r.RunOnce(ctx)
	require.Equal(t, 2, n)
	table := attribute.String(outbox.AttributeTable, b.cfg.Schema+".verity_outbox")
	s := rec.Collect(t)
	require.Equal(t, int64(2), s.Int("verity.outbox.claimed", table))
	require.Equal(t, int64(2), s.Int("verity.outbox.released", table), "both rows released")
	require.Zero(t, s.Int("verity.outbox.retried"))
	require.Zero(t, s.Int("verity.outbox.acked"))
	require.Zero(t, s.Int("verity.outbox.lease_lost"))
}

// README: pending counts every unacknowledged row, retrying only those
// waiting out a backoff, dead_letters the dead-letter table, and
// oldest_pending_age is in seconds. The existing gauge test has pending ==
// retrying, no dead letter and only checks the age is positive.
func TestRelayMetricsBacklogGaugesDistinct(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rec := metrictest.New(t)
	dead := newMessage("scores", "gauge-dead", 1)
	b.appendCommitted(t, dead)
	failAll := &recorder{fail: func(outbox.Record) error { return errors.New("projection down") }}
	burier := b.relay(t, nil, failAll, outbox.RelayConfig{MaxAttempts: 1})
	n, err := burier.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, n)

	// Two rows of the relay's stream, which fail and back off, and one of
	// another stream, pending but neither retrying nor in flight.
	b.appendCommitted(t, newMessage("scores", "gauge-a", 1), newMessage("scores", "gauge-b", 1),
		newMessage("other", "gauge-c", 1))
	time.Sleep(1100 * time.Millisecond) // the oldest pending row is over a second old
	r := b.relay(t, nil, failAll, outbox.RelayConfig{
		MeterProvider: rec.Provider, StatsInterval: 20 * time.Millisecond,
		Streams:         []string{"scores"},
		RetryBackoffMin: time.Hour, RetryBackoffMax: time.Hour,
	})
	startRun(t, r)
	require.Eventually(t, func() bool { return rec.Collect(t).Int("verity.outbox.retrying") == 2 },
		10*time.Second, 10*time.Millisecond, "the failed rows wait out their backoff")
	table := attribute.String(outbox.AttributeTable, b.cfg.Schema+".verity_outbox")
	s := rec.Collect(t)
	require.Equal(t, int64(3), s.Int("verity.outbox.pending", table))
	require.Equal(t, int64(2), s.Int("verity.outbox.retrying", table))
	require.Equal(t, int64(1), s.Int("verity.outbox.dead_letters", table))
	age := s.Float("verity.outbox.oldest_pending_age", table)
	require.GreaterOrEqual(t, age, 1.0, "seconds")
	require.Less(t, age, 60.0, "seconds, not milliseconds")
	require.Equal(t, "s", s.Unit("verity.outbox.oldest_pending_age"))
	require.Equal(t, "{row}", s.Unit("verity.outbox.dead_letters"))
}

// README: the gauges are "not [reported] at all once the snapshot is older
// than two intervals", so a relay whose Stats refresh cannot answer stops
// reporting instead of freezing a healthy-looking backlog.
func TestRelayMetricsGaugesVanishWhenStatsStall(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rec := metrictest.New(t)
	r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{
		MeterProvider: rec.Provider, StatsInterval: 50 * time.Millisecond,
		DisableNotify: true, PollInterval: time.Hour,
	})
	startRun(t, r)
	require.Eventually(t, func() bool { return rec.Collect(t).Has("verity.outbox.pending") },
		10*time.Second, 10*time.Millisecond, "the gauges report while running")
	// Stats reads the dead-letter table: hold it locked, and every refresh
	// waits (cut off after 5 s) while Run keeps running.
	tx, err := b.pool.Begin(context.Background())
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	_, err = tx.Exec(context.Background(), "LOCK TABLE "+b.cfg.Schema+".verity_outbox_dead IN ACCESS EXCLUSIVE MODE")
	require.NoError(t, err)
	require.Eventually(t, func() bool { return !rec.Collect(t).Has("verity.outbox.pending") },
		3*time.Second, 10*time.Millisecond, "a snapshot older than two intervals is not reported")
}

// README: lease_lost counts "rows whose partition lease expired and was
// taken over by another relay before this one settled them"; such a row's
// late acknowledgement is refused, so it is not acked by this relay.
func TestRelayMetricsLeaseLost(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	rec := metrictest.New(t)
	b.appendCommitted(t, newMessage("scores", "lost-1", 1))
	started, release := make(chan struct{}), make(chan struct{})
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})
	slow := outbox.HandlerFunc(func(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
		close(started)
		<-release
		return make([]outbox.Result, len(batch)), nil
	})
	relayA := b.relay(t, nil, slow, outbox.RelayConfig{MeterProvider: rec.Provider, LeaseDuration: time.Minute, Name: "a"})
	errA := make(chan error, 1)
	go func() { _, err := relayA.RunOnce(ctx); errA <- err }()
	<-started
	require.EqualValues(t, 1, b.expireLeases(t))
	relayB := b.relay(t, nil, &recorder{}, outbox.RelayConfig{LeaseDuration: time.Minute, Name: "b"})
	n, err := relayB.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	close(release)
	require.ErrorIs(t, <-errA, outbox.ErrLeaseLost)
	table := attribute.String(outbox.AttributeTable, b.cfg.Schema+".verity_outbox")
	s := rec.Collect(t)
	require.Equal(t, int64(1), s.Int("verity.outbox.lease_lost", table))
	require.Zero(t, s.Int("verity.outbox.acked"), "a refused acknowledgement is not counted")
}

// Two outboxes whose names hold a '.', schema "S.q" with table "t" and
// schema "S" with table "q.t" (both legal quoted identifiers), both read
// S.q.t in the verity.outbox.table attribute: one's dead letters were
// counted as the other's, and their backlog gauges shared a series. Such
// names are quoted in the attribute now, as PostgreSQL writes them; others
// keep the plain schema.table their dashboards know.
func TestRelayMetricsOfDottedTableNames(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testenv.Postgres(t)
	dotted := pg.Schema + ".q"
	_, err := pg.Pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{dotted}.Sanitize())
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = pg.Pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{dotted}.Sanitize()+" CASCADE")
	})
	rec := metrictest.New(t)
	failing := &recorder{fail: func(outbox.Record) error { return errors.New("boom") }}
	open := func(schema, table string) (*outbox.Writer, *outbox.Relay) {
		cfg := &outbox.Config{Schema: schema, Table: table}
		require.NoError(t, outbox.Migrate(ctx, pg.Pool, cfg))
		w, err := outbox.NewWriter(cfg)
		require.NoError(t, err)
		r, err := outbox.NewRelay(pg.Pool, failing, &outbox.RelayConfig{Schema: schema, Table: table, MaxAttempts: 1, MeterProvider: rec.Provider})
		require.NoError(t, err)
		return w, r
	}
	wA, relayA := open(dotted, "t")
	wB, relayB := open(pg.Schema, "q.t")
	wC, relayC := open(pg.Schema, "plain")
	for w, n := range map[*outbox.Writer]int{wA: 1, wB: 2, wC: 3} {
		tx, err := pg.Pool.Begin(ctx)
		require.NoError(t, err)
		for i := range n {
			require.NoError(t, w.Append(ctx, tx, newMessage("scores", fmt.Sprint("user-", i), 1)))
		}
		require.NoError(t, tx.Commit(ctx))
	}
	for _, r := range []*outbox.Relay{relayA, relayB, relayC} {
		_, err := r.RunOnce(ctx)
		require.NoError(t, err)
	}

	s := rec.Collect(t)
	table := func(name string) attribute.KeyValue { return attribute.String(outbox.AttributeTable, name) }
	require.Equal(t, 3, s.Series("verity.outbox.dead_lettered"), "one series per outbox table")
	require.EqualValues(t, 1, s.Int("verity.outbox.dead_lettered", table(pgx.Identifier{dotted, "t"}.Sanitize())))
	require.EqualValues(t, 2, s.Int("verity.outbox.dead_lettered", table(pgx.Identifier{pg.Schema, "q.t"}.Sanitize())))
	require.EqualValues(t, 3, s.Int("verity.outbox.dead_lettered", table(pg.Schema+".plain")))
}
