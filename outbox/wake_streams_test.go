package outbox_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/outbox"
)

// TestRelayWakesOnlyForItsStreams: every wake-up is a claim transaction,
// so a relay restricted to some streams must not wake for notifications
// naming another: with one relay per stream on one table (a leaderboard
// Worker per board), one write would otherwise make every relay claim.
func TestRelayWakesOnlyForItsStreams(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)

	var acquired atomic.Int64
	h := &recorder{}
	r := b.relay(t, b.countingPool(t, &acquired), h, outbox.RelayConfig{Streams: []string{"a"}, PollInterval: time.Hour})
	startRun(t, r)
	waitListening(t, b)
	// The passes at start and after LISTEN are over once a notified row
	// of the relay's stream was handled and the pool has been quiet.
	b.appendNow(t, newMessage("a", "k0", 1))
	require.Eventually(t, func() bool { return len(h.seen()) == 1 }, 10*time.Second, 10*time.Millisecond)
	quiet := func() int64 { return quietCount(t, &acquired, 100*time.Millisecond) }
	notify := func(payload string) {
		_, err := b.pool.Exec(ctx, `SELECT pg_notify($1, $2)`, b.writer.Channel(), payload)
		require.NoError(t, err)
	}

	// Thirty notifications for stream b, apart: a relay that woke for each
	// would claim for each.
	before := quiet()
	for range 30 {
		notify("b")
		time.Sleep(5 * time.Millisecond)
	}
	b.appendNow(t, newMessage("b", "kb", 1)) // Append names stream b too
	require.LessOrEqual(t, quiet()-before, int64(2), "notifications for another stream woke the relay")

	// Its own stream's notification, and one that names none, wake it.
	for _, payload := range []string{"a", ""} {
		before := quiet()
		notify(payload)
		require.Eventually(t, func() bool { return acquired.Load() > before }, 10*time.Second, 10*time.Millisecond, "payload %q", payload)
	}
}

// TestAppendNotifiesItsStream: Append's notification names the messages'
// stream when they share one, else none (every relay wakes).
func TestAppendNotifiesItsStream(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	conn := b.listenOn(t)

	for _, tc := range []struct {
		streams []string
		payload string
	}{
		{[]string{"orders"}, "orders"},
		{[]string{"orders", "orders"}, "orders"},
		{[]string{"orders", "invoices"}, ""},
	} {
		var msgs []outbox.Message
		for i, s := range tc.streams {
			msgs = append(msgs, newMessage(s, "k", int64(i+1)))
		}
		b.appendCommitted(t, msgs...)
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		n, err := conn.WaitForNotification(wctx)
		cancel()
		require.NoError(t, err)
		require.Equal(t, tc.payload, n.Payload, "%v", tc.streams)
	}
}

// TestRelayClaimsRowsFreedByAnotherStreamsRelay: rows of several streams
// share partitions, and a relay skips the partitions another relay's
// batch holds. When it was notified of a row in such a partition, nothing
// wakes it when that batch ends (a settle sends no notification, and
// notifications naming other streams do not wake it): it must claim
// again by itself, not a PollInterval later.
func TestRelayClaimsRowsFreedByAnotherStreamsRelay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	entered, release := make(chan struct{}, 1), make(chan struct{})
	holder := outbox.HandlerFunc(func(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
		entered <- struct{}{}
		<-release
		return make([]outbox.Result, len(batch)), nil
	})
	hB := &recorder{}
	startRun(t, b.relay(t, nil, holder, outbox.RelayConfig{Streams: []string{"a"}, PollInterval: time.Hour}))
	startRun(t, b.relay(t, nil, hB, outbox.RelayConfig{Streams: []string{"b"}, PollInterval: time.Hour}))
	require.Eventually(t, func() bool {
		var n int
		err := b.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE query = $1`, `LISTEN "`+b.writer.Channel()+`"`).Scan(&n)
		return err == nil && n == 2
	}, 10*time.Second, 10*time.Millisecond, "both relays listen")

	b.appendNow(t, newMessage("a", "ka", 1)) // the first ids: one partition
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("relay a never claimed its row")
	}
	b.appendNow(t, newMessage("b", "kb", 1)) // same partition, held by a's batch
	// Relay b was notified and claimed, but the partition is held.
	time.Sleep(300 * time.Millisecond)
	require.Empty(t, hB.seen(), "relay b took a row from a partition relay a holds")

	close(release) // a's batch settles, releasing the partition; nothing is written after
	require.Eventually(t, func() bool { return len(hB.seen()) == 1 }, 5*time.Second, 10*time.Millisecond,
		"relay b's row waits for its PollInterval (an hour) after the partition was released")
}

// TestRelayDoesNotReclaimForAnotherRelaysBatch: the rows a batch under way
// holds are not rows another relay could take, so relays of the same
// stream (an HA pair) wait for a notification or PollInterval while it
// runs, instead of claiming again and again.
func TestRelayDoesNotReclaimForAnotherRelaysBatch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	var acquired atomic.Int64 // by the idle relay's pool
	cfg, err := pgxpool.ParseConfig(b.pg.ConnString)
	require.NoError(t, err)
	cfg.PrepareConn = func(context.Context, *pgx.Conn) (bool, error) {
		acquired.Add(1)
		return true, nil
	}
	idlePool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(idlePool.Close)

	entered, release := make(chan struct{}, 2), make(chan struct{})
	var once sync.Once
	releaseOnce := func() { once.Do(func() { close(release) }) }
	handler := outbox.HandlerFunc(func(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
		entered <- struct{}{}
		<-release
		return make([]outbox.Result, len(batch)), nil
	})
	startRun(t, b.relay(t, nil, handler, outbox.RelayConfig{Streams: []string{"a"}, PollInterval: time.Hour}))
	b.appendNow(t, newMessage("a", "k", 1))
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the first relay never claimed the row")
	}
	// The second relay starts while the first one's batch holds the row.
	startRun(t, b.relay(t, idlePool, handler, outbox.RelayConfig{Streams: []string{"a"}, PollInterval: time.Hour}))
	t.Cleanup(releaseOnce) // runs before either relay's stop (startRun's cleanup)
	require.Eventually(t, func() bool {
		var n int
		err := b.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE query = $1`, `LISTEN "`+b.writer.Channel()+`"`).Scan(&n)
		return err == nil && n == 2
	}, 10*time.Second, 10*time.Millisecond, "both relays listen")
	// Its claims at start and after LISTEN, and the probe notification its
	// LISTEN connection sends through the pool; a fixed sleep here let a
	// stalled one land in the window below.
	require.Eventually(t, func() bool { return acquired.Load() >= 3 }, 10*time.Second, 5*time.Millisecond,
		"the idle relay's claims at start and after LISTEN, and its probe")
	time.Sleep(100 * time.Millisecond)
	before := acquired.Load()
	time.Sleep(1500 * time.Millisecond) // a relay that re-claimed would at 100, 200, 400, 800 ms
	require.LessOrEqual(t, acquired.Load()-before, int64(1), "the idle relay claimed again while the other's batch ran")
}

// TestRelayClaimsRowsSkippedByItsClaim: a claim skips the partitions that
// concurrent claims have locked, and in its snapshot no lease holds them
// yet (those claims have not committed). Rows it could take there must
// make it claim again soon, as rows in a held partition do: relays of
// several streams woken by writes at the same moment otherwise leave all
// but one of those rows to the PollInterval.
func TestRelayClaimsRowsSkippedByItsClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	h := &recorder{}
	startRun(t, b.relay(t, nil, h, outbox.RelayConfig{Streams: []string{"b"}, PollInterval: time.Hour}))
	waitListening(t, b)
	time.Sleep(200 * time.Millisecond) // the first claim is over

	// Another claim under way: every partition locked, no lease committed.
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SELECT 1 FROM `+b.leasesTable()+` FOR UPDATE`)
	require.NoError(t, err)
	b.appendNow(t, newMessage("b", "k", 1)) // notifies the relay, which skips every partition
	time.Sleep(300 * time.Millisecond)
	require.Empty(t, h.seen(), "the relay claimed through a locked partition")

	require.NoError(t, tx.Rollback(ctx)) // that claim ends; nothing is written after
	require.Eventually(t, func() bool { return len(h.seen()) == 1 }, 5*time.Second, 10*time.Millisecond,
		"the row the claim skipped waits for the PollInterval (an hour)")
}

// TestRelayWakesForRowsReleasedAtShutdown: a relay stopping with its
// Handler past ShutdownTimeout releases the rows for immediate re-delivery.
// The other relay of the stream (an HA pair, a rolling restart) is idle,
// and its last claim saw those rows in the stopping relay's batch: only a
// notification from the release wakes it before its PollInterval.
func TestRelayWakesForRowsReleasedAtShutdown(t *testing.T) {
	t.Parallel()
	b := setup(t)
	entered := make(chan struct{}, 1)
	hung := outbox.HandlerFunc(func(ctx context.Context, _ []outbox.Record) ([]outbox.Result, error) {
		select {
		case entered <- struct{}{}:
		default:
		}
		<-ctx.Done() // past ShutdownTimeout: the rows are released
		return nil, ctx.Err()
	})
	stopA := startRun(t, b.relay(t, nil, hung, outbox.RelayConfig{
		Streams: []string{"s"}, PollInterval: time.Hour, ShutdownTimeout: 100 * time.Millisecond,
	}))
	b.appendNow(t, newMessage("s", "k", 1))
	receive(t, entered)
	h := &recorder{}
	startRun(t, b.relay(t, nil, h, outbox.RelayConfig{Streams: []string{"s"}, PollInterval: time.Hour}))
	require.Eventually(t, func() bool { return b.listeners(t) == 2 }, 10*time.Second, 10*time.Millisecond, "both relays listen")
	time.Sleep(300 * time.Millisecond) // the second relay's first claims are over

	require.NoError(t, stopA())
	require.Eventually(t, func() bool { return len(h.seen()) == 1 }, 5*time.Second, 10*time.Millisecond,
		"the row released at shutdown waits for the other relay's PollInterval (an hour)")
}

// TestRelayServesRowsInABusyStreamsPartition: a trickle of writes lands in
// one partition (256 consecutive ids share one), so a quiet stream's row
// shares it with a busy stream's, whose relay holds the partition almost
// all the time. The quiet relay's own retries rarely find the partition
// free; the busy relay's settle, which releases it with that row due,
// must wake the quiet relay, also when a row nobody takes (its stream's
// relay is not running) comes before it.
func TestRelayServesRowsInABusyStreamsPartition(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		ahead []string // streams of rows written before the quiet one
		bound time.Duration
	}{
		"RightBehindTheBatch":   {nil, 2 * time.Second},
		"BehindARowNobodyTakes": {[]string{"orphan"}, 5 * time.Second}, // announced once it has waited heldPauseMax
		"BehindRowsNobodyTakes": {[]string{"orphan", "stray", "lost"}, 5 * time.Second},
		// Announced as the youngest row due for more than heldPauseMax
		// (a random pick among 17 streams took up to 6.5 s).
		"BehindManyRowsNobodyTakes": {nobody(16), 5 * time.Second},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			stop := b.busyPartition(t)
			defer stop()
			h := &recorder{}
			startRun(t, b.relay(t, nil, h, outbox.RelayConfig{Streams: []string{"quiet"}, PollInterval: time.Hour}))
			require.Eventually(t, func() bool { return b.listeners(t) == 2 }, 10*time.Second, 10*time.Millisecond, "both relays listen")
			time.Sleep(500 * time.Millisecond)
			for _, s := range tc.ahead {
				b.appendNow(t, newMessage(s, "k", 1))
			}
			b.appendNow(t, newMessage("quiet", "k", 1))
			require.Eventually(t, func() bool { return len(h.seen()) == 1 }, tc.bound, 10*time.Millisecond,
				"the quiet stream's row waits while the busy relay holds its partition")
		})
	}
}

// nobody returns n streams whose relays never run.
func nobody(n int) []string {
	streams := make([]string, n)
	for i := range streams {
		streams[i] = fmt.Sprint("nobody-", i)
	}
	return streams
}

// busyPartition runs a relay of stream "busy" whose batches take 40 ms and
// writes a row of that stream every 20 ms, until stop is called: the busy
// relay holds the trickle's partition almost all the time.
func (b *testBundle) busyPartition(t *testing.T) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	startRun(t, b.relay(t, nil, &recorder{delay: 40 * time.Millisecond}, outbox.RelayConfig{Streams: []string{"busy"}, PollInterval: time.Hour}))
	var writing sync.WaitGroup
	writing.Go(func() {
		for i := 0; ctx.Err() == nil && i < 1000; i++ {
			err := pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
				return b.writer.Append(ctx, tx, newMessage("busy", fmt.Sprint("k", i), 1))
			})
			if err != nil {
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
	return func() { cancel(); writing.Wait() }
}

// TestRelaysWokenTogetherAllDeliver: one Append of rows of twenty streams
// notifies with an empty payload, which wakes every relay at once; the
// rows share a partition, so all relays but one find it held. Each must
// still deliver its row promptly, not after pauses that grew in step.
func TestRelaysWokenTogetherAllDeliver(t *testing.T) {
	t.Parallel()
	b := setup(t)
	msgs, handlers, _ := b.relayPerStream(t, 20, 20*time.Millisecond)
	b.appendNow(t, msgs...)
	requireEachDelivers(t, handlers, 5*time.Second, "a row of a write that woke every relay")
}

// listenOn opens a connection of the test's own LISTENing on the bundle's
// channel.
func (b *testBundle) listenOn(t *testing.T) *pgx.Conn {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.ConnectConfig(ctx, b.pool.Config().ConnConfig)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	_, err = conn.Exec(ctx, "LISTEN "+pgx.Identifier{b.writer.Channel()}.Sanitize())
	require.NoError(t, err)
	return conn
}

// payloads collects the notifications conn receives within d.
func payloads(conn *pgx.Conn, d time.Duration) []string {
	var out []string
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return out
		}
		out = append(out, n.Payload)
	}
}

// TestSettleAnnouncesTheRowBehindItsBatch: a relay restricted to a stream
// settles a batch that took more rows from a partition than the settle
// looks ahead; the row right behind them, another stream's, is the
// partition's first due row once the settle commits, and its stream must
// be notified: its relay skipped the partition while the batch held it.
func TestSettleAnnouncesTheRowBehindItsBatch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	msgs := make([]outbox.Message, 40) // more than the settle's look-ahead
	for i := range msgs {
		msgs[i] = newMessage("busy", fmt.Sprint("k", i), 1)
	}
	b.appendCommitted(t, msgs...)                     // the first ids: one partition
	b.appendCommitted(t, newMessage("quiet", "q", 1)) // the next id, the same partition
	conn := b.listenOn(t)

	r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{Streams: []string{"busy"}})
	n, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, len(msgs), n)
	require.Equal(t, []string{"quiet"}, payloads(conn, time.Second), "the settle's notifications")
}

// TestSettleWakesOneStreamAtATime: rows of many streams in one partition,
// a relay per stream. Each settle wakes the relay of the next stream's row,
// whose own settle wakes the one after: waking every stream with a row
// there after each batch made every remaining relay claim after every
// batch, O(N²) claims for N rows (495 pool acquisitions for 30 streams).
// A chain of slow batches outlasts heldPauseMax, after which the rows
// behind it count as rows nobody took: announcing all of them after every
// batch was O(N²) again (about 540 acquisitions for 40 streams); one, at
// random, is enough to pass a row nobody takes.
func TestSettleWakesOneStreamAtATime(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		streams int
		batch   time.Duration
		perRow  int64 // pool acquisitions allowed per row
	}{
		"QuickBatches": {30, 20 * time.Millisecond, 7},
		// The chain takes 4 s; meanwhile each waiting relay also claims on
		// its own held pause (100 ms doubling up to 2 s): about 7 claims.
		"ChainLongerThanHeldPauseMax": {40, 100 * time.Millisecond, 10},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			msgs, handlers, acquired := b.relayPerStream(t, tc.streams, tc.batch)
			before := acquired.Load()
			b.appendNow(t, msgs...)
			requireEachDelivers(t, handlers, 30*time.Second, "a row of a write of many streams")
			time.Sleep(2 * time.Second) // pauses still running end
			got := acquired.Load() - before
			t.Logf("%d pool acquisitions for %d rows", got, len(msgs))
			require.LessOrEqual(t, got, tc.perRow*int64(len(msgs)), "claims grow with the square of the streams sharing a partition")
		})
	}
}

// relayPerStream runs n relays on a pool of their own, one per stream
// s0, s1, …, sharing a Listener, each batch taking batch (a projection's
// round trips), with an hour's PollInterval, and returns once they listen
// and their first claims are over: a message for each stream, the relays'
// handlers, and the count of the pool's acquisitions.
func (b *testBundle) relayPerStream(t *testing.T, n int, batch time.Duration) ([]outbox.Message, []*recorder, *atomic.Int64) {
	t.Helper()
	acquired := new(atomic.Int64)
	pool := b.countingPool(t, acquired)
	msgs := make([]outbox.Message, n)
	handlers := make([]*recorder, n)
	l := b.listener(t, pool) // one connection, not n: parallel tests share max_connections
	for i := range msgs {
		s := fmt.Sprint("s", i)
		msgs[i] = newMessage(s, "k", 1)
		handlers[i] = &recorder{delay: batch}
		startRun(t, b.relay(t, pool, handlers[i], outbox.RelayConfig{Streams: []string{s}, PollInterval: time.Hour, Listener: l}))
	}
	require.Eventually(t, func() bool { return b.listeners(t) == 1 }, 10*time.Second, 10*time.Millisecond, "the relays listen")
	// Their claims at start and after LISTEN, and the probe: about two
	// acquisitions a relay, which took up to 576 ms on a loaded machine
	// and so could not be left to a fixed sleep.
	quietCount(t, acquired, 200*time.Millisecond)
	return msgs, handlers, acquired
}

// quietCount waits until counter has not moved for window and returns its
// value; it fails the test if that takes more than 10 s.
func quietCount(t *testing.T, counter *atomic.Int64, window time.Duration) int64 {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		before := counter.Load()
		time.Sleep(window)
		n := counter.Load()
		if n == before {
			return n
		}
		if time.Now().After(deadline) {
			t.Fatalf("the count kept moving for 10s (%d, %d a window of %s ago)", n, before, window)
		}
	}
}
