package outbox_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/lograte"
	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
)

// relay builds a relay on the bundle's outbox; cfg's Schema and Table are
// filled in from the bundle.
func (b *testBundle) relay(t *testing.T, pool *pgxpool.Pool, h outbox.Handler, cfg outbox.RelayConfig) *outbox.Relay {
	t.Helper()
	if pool == nil {
		pool = b.pool
	}
	cfg.Schema, cfg.Table = b.cfg.Schema, b.cfg.Table
	r, err := outbox.NewRelay(pool, h, &cfg)
	require.NoError(t, err)
	return r
}

// startRun runs r.Run in the background. The returned stop cancels it and
// waits for Run to return, failing the test if it does not within 10s; it
// also runs at cleanup.
func startRun(t *testing.T, r *outbox.Relay) (stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	var once sync.Once
	var runErr error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case runErr = <-done:
			case <-time.After(10 * time.Second):
				runErr = errors.New("Run did not return within 10s of cancellation")
			}
		})
		return runErr
	}
	t.Cleanup(func() { require.NoError(t, stop()) })
	return stop
}

// recorder is a Handler that remembers what it was given.
type recorder struct {
	mu      sync.Mutex
	records []outbox.Record
	fail    func(rec outbox.Record) error // nil: every record succeeds
	delay   time.Duration                 // how long each batch takes
}

func (h *recorder) Handle(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
	time.Sleep(h.delay)
	h.mu.Lock()
	defer h.mu.Unlock()
	results := make([]outbox.Result, len(batch))
	for i, rec := range batch {
		h.records = append(h.records, rec)
		if h.fail != nil {
			results[i].Err = h.fail(rec)
		}
	}
	return results, nil
}

func (h *recorder) seen() []outbox.Record {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]outbox.Record(nil), h.records...)
}

func TestRelayDelivery(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("BatchesAndAcks", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		msgs := make([]outbox.Message, 250)
		for i := range msgs {
			msgs[i] = newMessage("scores", fmt.Sprint("user-", i), int64(i+1))
		}
		b.appendCommitted(t, msgs...)
		h := &recorder{}
		r := b.relay(t, nil, h, outbox.RelayConfig{BatchSize: 100})

		for _, want := range []int{100, 100, 50, 0} {
			n, err := r.RunOnce(ctx)
			require.NoError(t, err)
			require.Equal(t, want, n)
		}
		seen := h.seen()
		require.Len(t, seen, len(msgs))
		for i, rec := range seen {
			require.Equal(t, msgs[i].EventID, rec.EventID, "rows are delivered in id order")
			require.Equal(t, msgs[i].Key, rec.Key)
			require.Equal(t, msgs[i].Version, rec.Version)
			require.Equal(t, msgs[i].Payload, rec.Payload)
			require.Equal(t, 1, rec.Attempts)
			require.Positive(t, rec.ID)
			require.WithinDuration(t, time.Now(), rec.CreatedAt, time.Minute)
		}
		require.Zero(t, b.count(t, b.writer.Table()), "acknowledged rows are deleted")
	})

	t.Run("KeepPublished", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendCommitted(t, newMessage("s", "a", 1), newMessage("s", "b", 1))
		r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{KeepPublished: true})
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 2, n)
		n, err = r.RunOnce(ctx)
		require.NoError(t, err)
		require.Zero(t, n, "published rows are not delivered again")
		rows := b.rows(t)
		require.Len(t, rows, 2)
		for _, row := range rows {
			require.NotNil(t, row.PublishedAt)
		}
		b.requireLeasesFree(t)
		// Kept rows are delivered: neither Pending nor OldestPendingAge may
		// count them, or a KeepPublished outbox would alert on rows that
		// wait for nothing. Aged by an hour, they could not hide in a small
		// age.
		_, err = b.pool.Exec(ctx, `UPDATE `+b.writer.Table()+` SET created_at = created_at - interval '1 hour'`)
		require.NoError(t, err)
		stats, err := r.Stats(ctx)
		require.NoError(t, err)
		require.Zero(t, stats.Pending)
		require.Zero(t, stats.OldestPendingAge, "a published row's age counted as pending")
	})

	t.Run("StreamsFilter", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendCommitted(t, newMessage("a", "k", 1), newMessage("b", "k", 1), newMessage("c", "k", 1))
		h := &recorder{}
		r := b.relay(t, nil, h, outbox.RelayConfig{Streams: []string{"a", "c"}})
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 2, n)
		for _, rec := range h.seen() {
			require.NotEqual(t, "b", rec.Stream)
		}
		rows := b.rows(t)
		require.Len(t, rows, 1)
		require.Equal(t, "b", rows[0].Stream)
	})

	t.Run("PartialFailure", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		good, bad := newMessage("s", "good", 1), newMessage("s", "bad", 1)
		b.appendCommitted(t, good, bad)
		h := &recorder{fail: func(rec outbox.Record) error {
			if rec.Key == "bad" {
				return errors.New("redis said no")
			}
			return nil
		}}
		r := b.relay(t, nil, h, outbox.RelayConfig{})
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 2, n)
		rows := b.rows(t)
		require.Len(t, rows, 1)
		require.Equal(t, bad.EventID, rows[0].EventID)
		require.Equal(t, "redis said no", *rows[0].LastError)
		b.requireLeasesFree(t)
	})

	// One settle statement acknowledges most of a batch and retries the
	// rest: the failed rows between acknowledged ones must stay, single
	// or in a run across a partition edge, in every partition the batch
	// spans and with either acknowledgement.
	t.Run("InterleavedOutcomes", func(t *testing.T) {
		t.Parallel()
		for _, keep := range []bool{false, true} {
			b := setup(t)
			// 700 rows span three partitions (256 consecutive ids each),
			// so one batch of 1,000 holds them all.
			msgs := make([]outbox.Message, 700)
			for i := range msgs {
				msgs[i] = newMessage("s", fmt.Sprint("k", i), 1)
			}
			b.appendCommitted(t, msgs...)
			failing := func(key string) bool {
				var i int
				_, err := fmt.Sscanf(key, "k%d", &i)
				require.NoError(t, err)
				return i%3 == 1 || (i >= 250 && i < 262) // singles, and a run across a partition edge
			}
			h := &recorder{fail: func(rec outbox.Record) error {
				if failing(rec.Key) {
					return errors.New("not now")
				}
				return nil
			}}
			r := b.relay(t, nil, h, outbox.RelayConfig{KeepPublished: keep})
			n, err := r.RunOnce(ctx)
			require.NoError(t, err)
			require.Equal(t, len(msgs), n, "one batch")

			var kept, failed int
			for _, row := range b.rows(t) {
				if failing(row.Key) {
					failed++
					require.Nil(t, row.PublishedAt, "row %s failed", row.Key)
					require.NotNil(t, row.LastError, "row %s failed", row.Key)
					require.Equal(t, 1, row.Attempts)
					continue
				}
				require.True(t, keep, "acknowledged row %s must be deleted", row.Key)
				require.NotNil(t, row.PublishedAt, "row %s was acknowledged", row.Key)
				require.Nil(t, row.LastError)
				kept++
			}
			wantFailed := 0
			for i := range msgs {
				if failing(msgs[i].Key) {
					wantFailed++
				}
			}
			require.Equal(t, wantFailed, failed, "every failed row is still there")
			if keep {
				require.Equal(t, len(msgs)-wantFailed, kept, "every acknowledged row is kept as published")
			}
			b.requireLeasesFree(t)
		}
	})

	t.Run("HandlerBreaksContract", func(t *testing.T) {
		t.Parallel()
		handlers := map[string]outbox.HandlerFunc{
			"WrongResultCount": func(context.Context, []outbox.Record) ([]outbox.Result, error) {
				return []outbox.Result{}, nil
			},
			"Panic": func(context.Context, []outbox.Record) ([]outbox.Result, error) {
				panic("handler bug")
			},
			"BatchError": func(context.Context, []outbox.Record) ([]outbox.Result, error) {
				return nil, errors.New("redis unreachable")
			},
			// A non-nil error fails every record even when the handler
			// also returned a full slice of nil (successful) Results.
			"BatchErrorWithResults": func(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
				return make([]outbox.Result, len(batch)), errors.New("pipeline failed after the writes")
			},
			// A nil *T in the error interface: its Error() panics, and
			// settle calls it outside the handler's recover.
			"PanickingError": func(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
				var typedNil *panickingError
				results := make([]outbox.Result, len(batch))
				for i := range results {
					results[i].Err = typedNil
				}
				return results, nil
			},
		}
		for name, h := range handlers {
			b := setup(t)
			b.appendCommitted(t, newMessage("s", "a", 1), newMessage("s", "b", 1))
			r := b.relay(t, nil, h, outbox.RelayConfig{})
			n, err := r.RunOnce(ctx)
			require.NoError(t, err, name)
			require.Equal(t, 2, n, name)
			rows := b.rows(t)
			require.Len(t, rows, 2, "%s: nothing is acknowledged", name)
			for _, row := range rows {
				require.NotNil(t, row.LastError, name)
				require.Equal(t, 1, row.Attempts, name)
				require.True(t, row.AvailableAt.After(time.Now().Add(-time.Second)), name)
			}
			switch name {
			case "BatchError":
				require.Equal(t, "redis unreachable", *rows[0].LastError, name)
			case "BatchErrorWithResults":
				require.Equal(t, "pipeline failed after the writes", *rows[0].LastError, name)
			default:
				require.Contains(t, *rows[0].LastError, "handler broke its contract", name)
			}
		}
	})
}

func TestRelayLease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// blockingHandler signals started when called, then waits for unblock
	// regardless of its context, like a relay whose process froze.
	type blockingHandler struct {
		started  chan []outbox.Record
		release  chan struct{}
		deadline chan time.Time
		unblock  func() // idempotent
	}
	// newBlocking's handler is unblocked at t's cleanup at the latest, so
	// a subtest that fails while it blocks leaves no call stuck behind it.
	// A subtest whose Run cleanup waits for the call (startRun) registers
	// unblock again after startRun: cleanups run last-registered first.
	newBlocking := func(t *testing.T) *blockingHandler {
		h := &blockingHandler{started: make(chan []outbox.Record, 1), release: make(chan struct{}), deadline: make(chan time.Time, 1)}
		var once sync.Once
		h.unblock = func() { once.Do(func() { close(h.release) }) }
		t.Cleanup(h.unblock)
		return h
	}
	handle := func(h *blockingHandler) outbox.HandlerFunc {
		return func(ctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			d, _ := ctx.Deadline()
			h.deadline <- d
			h.started <- batch
			<-h.release
			return make([]outbox.Result, len(batch)), nil
		}
	}

	t.Run("ExpiryRedeliversAndLateAckIsRefused", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		msg := newMessage("s", "k", 1)
		b.appendCommitted(t, msg)
		// A lease far longer than the checks made while it lasts; the test
		// ends it on purpose (expireLeases) when it wants it over.
		const lease = time.Minute

		slow := newBlocking(t)
		relayA := b.relay(t, nil, handle(slow), outbox.RelayConfig{LeaseDuration: lease, Name: "a"})
		claimedAt := time.Now()
		type outcome struct {
			n   int
			err error
		}
		doneA := make(chan outcome, 1)
		go func() {
			n, err := relayA.RunOnce(ctx)
			doneA <- outcome{n, err}
		}()
		batchA := receive(t, slow.started)
		handlerStarted := time.Now()
		require.Len(t, batchA, 1)
		require.Equal(t, 1, batchA[0].Attempts)
		deadline := <-slow.deadline
		require.False(t, deadline.IsZero(), "the handler's context carries the lease deadline")
		require.False(t, deadline.Before(claimedAt.Add(lease)), "deadline %s before the lease could end", deadline)
		require.False(t, deadline.After(handlerStarted.Add(lease)), "deadline %s after the lease ends", deadline)
		// The lease the claim wrote on the server lasts LeaseDuration too
		// (it is sent in microseconds): a lease 1000 times too short lets
		// another relay re-claim the rows while the Handler still runs, and
		// one 1000 times too long leaves a crashed relay's rows waiting for
		// hours. What is left of it is read by the database's clock; half a
		// lease (30s) of slack for the claim and the checks above.
		var left time.Duration
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT max(leased_until) - now() FROM `+b.leasesTable()).Scan(&left))
		require.Greater(t, left, lease/2, "the server's lease is shorter than LeaseDuration")
		require.LessOrEqual(t, left, lease, "the server's lease is longer than LeaseDuration")

		// While A's lease lasts nobody else gets the row.
		h := &recorder{}
		relayB := b.relay(t, nil, h, outbox.RelayConfig{LeaseDuration: time.Minute, Name: "b"})
		n, err := relayB.RunOnce(ctx)
		require.NoError(t, err)
		require.Zero(t, n, "a leased row is not claimed again")
		stats, err := relayB.Stats(ctx)
		require.NoError(t, err)
		require.EqualValues(t, 1, stats.InFlight)

		// After it, the row is no longer in flight, although A's lease row
		// still lists it (A hung or crashed: the row is up for grabs), and
		// B claims and acknowledges it.
		require.EqualValues(t, 1, b.expireLeases(t), "A's batch holds one partition")
		stats, err = relayB.Stats(ctx)
		require.NoError(t, err)
		require.EqualValues(t, 1, stats.Pending)
		require.Zero(t, stats.InFlight, "the rows of an expired lease are not in flight")
		n, err = relayB.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n, "the row is claimed again once the lease ended")
		seen := h.seen()
		require.Len(t, seen, 1)
		require.Equal(t, msg.EventID, seen[0].EventID)
		require.Equal(t, 2, seen[0].Attempts, "the re-delivery is the second attempt")

		// A finally finishes: its acknowledgement is refused.
		slow.unblock()
		resA := receive(t, doneA)
		require.Equal(t, 1, resA.n)
		require.ErrorIs(t, resA.err, outbox.ErrLeaseLost)
		var lost *outbox.LeaseLostError
		require.ErrorAs(t, resA.err, &lost)
		require.Equal(t, []int64{batchA[0].ID}, lost.IDs)
		require.Contains(t, resA.err.Error(), fmt.Sprintf("ids %d", batchA[0].ID))
		require.Zero(t, b.count(t, b.writer.Table()))
	})

	// The server's lease runs from when it received the claim, so the
	// Handler's deadline must run from no later than the claim was sent:
	// measured from when the claim's reply came back, it would outlast the
	// lease by the claim's duration, and the Handler could still be
	// projecting rows that another relay had taken over.
	t.Run("HandlerDeadlineRunsFromBeforeTheClaimWasSent", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendCommitted(t, newMessage("s", "k", 1))
		tracer := &claimClock{}
		pool := newPoolTraced(t, b.pg.ConnString, tracer)
		const lease = time.Minute
		var deadline time.Time
		r := b.relay(t, pool, outbox.HandlerFunc(func(ctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			deadline, _ = ctx.Deadline()
			return make([]outbox.Result, len(batch)), nil
		}), outbox.RelayConfig{LeaseDuration: lease})
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		sent := tracer.sent()
		require.False(t, sent.IsZero(), "the claim was traced")
		require.False(t, deadline.After(sent.Add(lease)), "the deadline %s is later than the claim's send %s plus the lease", deadline, sent)
	})

	// The lease runs from the claim's send, so the Handler's deadline
	// must too, not from before the wait for a pool connection: the
	// relay's pool is usually the application's, and a Handler cut off
	// early fails an attempt (at MaxAttempts, buries its rows) while the
	// lease still had the time it took.
	t.Run("HandlerDeadlineLeavesOutTheWaitForAConnection", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendCommitted(t, newMessage("s", "k", 1))
		pool := poolWith(t, b, func(pc *pgxpool.Config) { pc.MaxConns = 1 })
		const lease = 5 * time.Second
		var deadline time.Time
		r := b.relay(t, pool, outbox.HandlerFunc(func(ctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			deadline, _ = ctx.Deadline()
			return make([]outbox.Result, len(batch)), nil
		}), outbox.RelayConfig{LeaseDuration: lease})

		// Something else holds the pool's only connection for a while.
		conn, err := pool.Acquire(ctx)
		require.NoError(t, err)
		var released time.Time
		go func() {
			time.Sleep(300 * time.Millisecond)
			released = time.Now()
			conn.Release()
		}()
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		// The claim got the connection after released was read.
		require.False(t, deadline.Before(released.Add(lease)),
			"the Handler's deadline %s ends the lease %s early: it counts the wait for a connection", deadline, released.Add(lease).Sub(deadline))
	})

	// The settle, likewise, waits for a connection as long as the lease
	// lasts: cut off by its own bound on a busy pool, it left rows the
	// Handler completed to be counted a crashed attempt (and, with
	// MaxAttempts 1, buried).
	t.Run("SettleWaitsForAConnectionWithinTheLease", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendCommitted(t, newMessage("s", "k", 1))
		pool := poolWith(t, b, func(pc *pgxpool.Config) { pc.MaxConns = 1 })
		held := make(chan struct{})
		var handled atomic.Int32
		r := b.relay(t, pool, outbox.HandlerFunc(func(ctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			if handled.Add(1) == 1 {
				// The application takes the pool's only connection for
				// longer than the settle's own bound, well within the lease.
				conn, err := pool.Acquire(ctx)
				if err != nil {
					return nil, err
				}
				go func() {
					defer close(held)
					time.Sleep(time.Second)
					conn.Release()
				}()
			}
			return make([]outbox.Result, len(batch)), nil
		}), outbox.RelayConfig{LeaseDuration: time.Minute, MaxAttempts: 1})
		r.SetSettleTimeout(200 * time.Millisecond)

		n, err := r.RunOnce(ctx)
		<-held
		require.NoError(t, err, "the settle waited for a connection within the lease")
		require.Equal(t, 1, n)
		require.Zero(t, b.count(t, b.writer.Table()), "acknowledged")
		require.Zero(t, b.count(t, b.deadTable()), "a row its Handler completed was buried")
	})

	// A shutdown that begins while the settle waits for a connection
	// leaves it settleTimeout from then, not the rest of the lease: the
	// documented bound on Run's return counts the settle's 10 s from the
	// shutdown.
	t.Run("ShutdownCutsTheSettlesWait", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendCommitted(t, newMessage("s", "k", 1))
		pool := poolWith(t, b, func(pc *pgxpool.Config) { pc.MaxConns = 1 })
		handled := make(chan *pgxpool.Conn, 1)
		r := b.relay(t, pool, outbox.HandlerFunc(func(ctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			conn, err := pool.Acquire(ctx) // held until the test lets go
			if err != nil {
				return nil, err
			}
			handled <- conn
			return make([]outbox.Result, len(batch)), nil
		}), outbox.RelayConfig{LeaseDuration: time.Minute, DisableNotify: true, PollInterval: time.Hour})
		r.SetSettleTimeout(300 * time.Millisecond)

		runCtx, cancel := context.WithCancel(ctx)
		defer cancel()
		done := make(chan error, 1)
		go func() { done <- r.Run(runCtx) }()
		conn := <-handled
		defer conn.Release()
		time.Sleep(100 * time.Millisecond) // the settle waits for the connection
		cancel()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			t.Fatal("Run did not return 20 s after its cancellation: the settle kept waiting for the lease's end")
		}
	})

	// A batch that lost its lease was still a full claim, so Run claims
	// again at once, as after any full batch, rather than waiting a
	// PollInterval (an hour here, and no notification wakes it) while
	// rows are due.
	t.Run("RunClaimsAgainAtOnceAfterAFullBatchLostItsLease", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		first, second := newMessage("s", "k1", 1), newMessage("s", "k2", 1)
		b.appendCommitted(t, first)
		b.appendCommitted(t, second)

		slow := newBlocking(t)
		h := &recorder{}
		var calls atomic.Int32
		relayA := b.relay(t, nil, outbox.HandlerFunc(func(ctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			if calls.Add(1) == 1 {
				return handle(slow)(ctx, batch)
			}
			return h.Handle(ctx, batch)
		}), outbox.RelayConfig{BatchSize: 1, PollInterval: time.Hour, DisableNotify: true, LeaseDuration: time.Minute})
		startRun(t, relayA)
		t.Cleanup(slow.unblock) // before startRun's stop, should the test fail first
		require.Equal(t, first.EventID, receive(t, slow.started)[0].EventID, "A's first claim is full with one row")

		require.EqualValues(t, 1, b.expireLeases(t))
		relayB := b.relay(t, nil, &recorder{}, outbox.RelayConfig{BatchSize: 1, Name: "b"})
		n, err := relayB.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n, "B takes over the first row")

		slow.unblock() // A's settle finds its lease lost
		require.Eventually(t, func() bool { return len(h.seen()) == 1 }, 10*time.Second, 10*time.Millisecond,
			"A claims the second row without waiting its PollInterval")
		require.Equal(t, second.EventID, h.seen()[0].EventID)
		// The handler saw the row before the settle deleted it.
		require.Eventually(t, func() bool { return b.count(t, b.writer.Table()) == 0 }, 10*time.Second, 10*time.Millisecond)
	})

	t.Run("LostLeaseDoesNotTouchReclaimedRow", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendCommitted(t, newMessage("s", "k", 1))
		// A lease far longer than A's claim could take (a claim is bounded
		// by the lease, and on a loaded machine a short one can run out
		// before the claim's reply arrives); the test ends it on purpose
		// (expireLeases), as in ExpiryRedeliversAndLateAckIsRefused.
		const lease = 10 * time.Second

		// A fails its batch after B has re-claimed it: A's failure must not
		// reschedule or release B's claim.
		slow := newBlocking(t)
		relayA := b.relay(t, nil, outbox.HandlerFunc(func(ctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			slow.started <- batch
			<-slow.release
			return nil, errors.New("too late anyway")
		}), outbox.RelayConfig{LeaseDuration: lease})
		doneA := runOnceAsync(ctx, relayA)
		receive(t, slow.started)
		require.EqualValues(t, 1, b.expireLeases(t), "A's batch holds one partition")

		hold := newBlocking(t)
		relayB := b.relay(t, nil, handle(hold), outbox.RelayConfig{LeaseDuration: time.Minute})
		doneB := runOnceAsync(ctx, relayB)
		receive(t, hold.started)
		rowsBefore := b.rows(t)
		require.Len(t, rowsBefore, 1)

		slow.unblock()
		require.ErrorIs(t, receive(t, doneA), outbox.ErrLeaseLost)
		rowsAfter := b.rows(t)
		require.Equal(t, rowsBefore, rowsAfter, "A's late failure changed nothing")

		hold.unblock()
		require.NoError(t, receive(t, doneB))
		require.Zero(t, b.count(t, b.writer.Table()))
	})

	// A's handler succeeds while B, which re-claimed its row after A's
	// lease ended, is still handling it: A's acknowledgement must change
	// nothing (the partition is B's), and B then settles its own claim.
	// An acknowledgement after B had deleted the row could not tell one
	// that honours the lease from one that ignores it.
	t.Run("LateAckDoesNotTouchReclaimedRow", func(t *testing.T) {
		t.Parallel()
		for name, keep := range map[string]bool{"Delete": false, "KeepPublished": true} {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				b := setup(t)
				b.appendCommitted(t, newMessage("s", "k", 1))
				// A long lease, ended on purpose (expireLeases), as in
				// ExpiryRedeliversAndLateAckIsRefused.
				const lease = 10 * time.Second

				slow := newBlocking(t)
				relayA := b.relay(t, nil, handle(slow), outbox.RelayConfig{LeaseDuration: lease, KeepPublished: keep, Name: "a"})
				doneA := runOnceAsync(ctx, relayA)
				batchA := receive(t, slow.started)
				require.Len(t, batchA, 1)
				require.EqualValues(t, 1, b.expireLeases(t), "A's batch holds one partition")

				hold := newBlocking(t)
				relayB := b.relay(t, nil, handle(hold), outbox.RelayConfig{LeaseDuration: time.Minute, KeepPublished: keep, Name: "b"})
				doneB := runOnceAsync(ctx, relayB)
				batchB := receive(t, hold.started)
				require.Len(t, batchB, 1)
				require.Equal(t, batchA[0].ID, batchB[0].ID)
				rowsBefore := b.rows(t)
				require.Len(t, rowsBefore, 1)

				slow.unblock()
				require.ErrorIs(t, receive(t, doneA), outbox.ErrLeaseLost, "A's late acknowledgement is refused")
				require.Equal(t, rowsBefore, b.rows(t), "A's late acknowledgement changed a row B holds")

				hold.unblock()
				require.NoError(t, receive(t, doneB), "B holds the lease: its settle succeeds")
			})
		}
	})

	// A's settle runs while another relay's claim is taking A's expired
	// partition over, not yet committed. The settle must wait for that
	// claim and then find the partition no longer A's: acknowledging with
	// what it read before the takeover would delete a row the other relay
	// has just been handed, and releasing would free that relay's lease
	// for a third relay while its batch is out.
	t.Run("SettleWaitsForATakeoverUnderWay", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendCommitted(t, newMessage("s", "k", 1))
		appName := "verity_relay_" + uuid.NewString()[:8]
		slow := newBlocking(t)
		// A long lease, ended on purpose (expireLeases).
		relayA := b.relay(t, newPoolNamed(t, b.pg.ConnString, appName), handle(slow), outbox.RelayConfig{LeaseDuration: 10 * time.Second})
		doneA := runOnceAsync(ctx, relayA)
		batchA := receive(t, slow.started)
		require.Len(t, batchA, 1)
		require.EqualValues(t, 1, b.expireLeases(t), "A's batch holds one partition")

		// The takeover claim, as leaseSQL writes it, holding the lease row.
		takeover, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = takeover.Rollback(ctx) })
		var owner uuid.UUID
		require.NoError(t, takeover.QueryRow(ctx, `UPDATE `+b.leasesTable()+` SET owner = gen_random_uuid(),
    leased_until = now() + interval '1 hour', inflight = int8multirange(int8range($1, $1, '[]'))
WHERE part = mod($1 / 256, 64) RETURNING owner`, batchA[0].ID).Scan(&owner))

		slow.unblock()
		require.Eventually(t, func() bool { return b.waitingForLock(appName, "") }, 10*time.Second, 10*time.Millisecond,
			"A's settle waits for the takeover's lock")
		require.NoError(t, takeover.Commit(ctx))
		require.ErrorIs(t, receive(t, doneA), outbox.ErrLeaseLost)
		require.Equal(t, 1, b.count(t, b.writer.Table()), "the row handed to the other relay is still there")
		var held bool
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT owner = $1 AND leased_until > now() FROM `+b.leasesTable()+
			` WHERE part = mod($2 / 256, 64)`, owner, batchA[0].ID).Scan(&held))
		require.True(t, held, "the other relay's lease still holds")
	})

	// Rows a stopping relay releases count as settled only where its lease
	// still holds: RunOnce reports the others lost, as it does for
	// acknowledgements and failures.
	t.Run("ReleaseAfterTakeoverIsReportedLost", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendCommitted(t, newMessage("s", "k", 1))
		slow := newBlocking(t)
		relayA := b.relay(t, nil, outbox.HandlerFunc(func(ctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			slow.started <- batch
			<-slow.release
			return nil, ctx.Err()
		}), outbox.RelayConfig{LeaseDuration: 10 * time.Second})
		runCtx, cancel := context.WithCancel(ctx)
		defer cancel()
		doneA := make(chan error, 1)
		go func() {
			_, err := relayA.RunOnce(runCtx)
			doneA <- err
		}()
		batchA := receive(t, slow.started)
		require.EqualValues(t, 1, b.expireLeases(t), "A's batch holds one partition")
		batchB, err := b.relay(t, nil, &recorder{}, outbox.RelayConfig{LeaseDuration: time.Minute}).ClaimOnly(ctx)
		require.NoError(t, err)
		require.Len(t, batchB, 1, "B takes the partition over")

		cancel() // A stops: its rows are released, not retried
		slow.unblock()
		err = receive(t, doneA)
		var lost *outbox.LeaseLostError
		require.ErrorAs(t, err, &lost)
		require.Equal(t, []int64{batchA[0].ID}, lost.IDs)
	})

	t.Run("LostLeaseLogsNoOutcome", func(t *testing.T) {
		t.Parallel()
		// A's failure would bury its row (MaxAttempts 1) or reschedule it
		// (2), but another relay takes the partition over first: A's settle
		// changes nothing, so its log must not report a burial or a retry
		// that did not happen. Once settled, the same failure is logged.
		for name, maxAttempts := range map[string]int{"DeadLetter": 1, "Retry": 2} {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				b := setup(t)
				b.appendCommitted(t, newMessage("a", "k1", 1), newMessage("b", "k2", 1)) // consecutive ids: one partition

				var logs syncBuffer
				slow := newBlocking(t)
				cfg := outbox.RelayConfig{
					Streams: []string{"a"}, MaxAttempts: maxAttempts, LeaseDuration: 10 * time.Second,
					RetryBackoffMin: time.Minute, RetryBackoffMax: time.Minute,
					Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
				}
				failing := outbox.HandlerFunc(func(ctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
					slow.started <- batch
					<-slow.release
					out := make([]outbox.Result, len(batch))
					for i := range out {
						out[i].Err = errors.New("projection refused it")
					}
					return out, nil
				})
				relayA := b.relay(t, nil, failing, cfg)
				doneA := runOnceAsync(ctx, relayA)
				batchA := receive(t, slow.started)
				require.Len(t, batchA, 1)
				require.EqualValues(t, 1, b.expireLeases(t), "A's batch holds one partition")

				relayB := b.relay(t, nil, &recorder{}, outbox.RelayConfig{Streams: []string{"b"}})
				n, err := relayB.RunOnce(ctx)
				require.NoError(t, err)
				require.Equal(t, 1, n, "B takes the partition over and delivers its row")

				slow.unblock()
				require.ErrorIs(t, receive(t, doneA), outbox.ErrLeaseLost)
				st, err := relayA.Stats(ctx)
				require.NoError(t, err)
				require.EqualValues(t, 1, st.Pending, "A's row is still in the outbox")
				require.Zero(t, st.DeadLetters)
				out := logs.String()
				require.NotContains(t, out, "moved to dead letters", out)
				require.NotContains(t, out, "will retry", out)
				require.Contains(t, out, "dead=0", out)
				require.Contains(t, out, "retry=0", out)
				require.Contains(t, out, "lost=1", out)

				// The same first attempt again (B's takeover counted A's),
				// settled this time: now the outcome is logged, with the
				// row's fields.
				row := b.rows(t)[0]
				_, err = b.pool.Exec(ctx, `UPDATE `+b.writer.Table()+` SET attempts = 0, available_at = now() WHERE id = $1`, row.ID)
				require.NoError(t, err)
				relayC := b.relay(t, nil, &recorder{fail: func(outbox.Record) error { return errors.New("projection refused it") }}, cfg)
				n, err = relayC.RunOnce(ctx)
				require.NoError(t, err)
				require.Equal(t, 1, n)
				out = logs.String()
				if maxAttempts == 1 {
					require.Contains(t, out, "outbox row moved to dead letters", out)
					require.Contains(t, out, fmt.Sprintf("event_id=%s stream=a attempts=1", batchA[0].EventID), out)
				} else {
					require.Contains(t, out, "outbox row failed; will retry", out)
				}
				require.Contains(t, out, fmt.Sprintf("id=%d", row.ID), out)
				require.Contains(t, out, `error="projection refused it"`, out)
			})
		}
	})

	t.Run("ExpiredButNotReclaimedStillAcks", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendCommitted(t, newMessage("s", "k", 1))
		slow := newBlocking(t)
		// A long lease, ended on purpose once the batch is handled: a short
		// one could run out during the claim itself on a loaded machine.
		r := b.relay(t, nil, handle(slow), outbox.RelayConfig{LeaseDuration: 10 * time.Second})
		done := make(chan error, 1)
		go func() {
			_, err := r.RunOnce(ctx)
			done <- err
		}()
		receive(t, slow.started)
		require.EqualValues(t, 1, b.expireLeases(t), "the batch holds one partition")
		slow.unblock()
		require.NoError(t, receive(t, done), "the claim token is still ours, so the work counts")
		require.Zero(t, b.count(t, b.writer.Table()))
	})
}

func TestRelayRetries(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("FailedBatchWarnsOnce", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendCommitted(t, newMessage("scores", "a", 1), newMessage("scores", "b", 1), newMessage("scores", "c", 1))

		var logs syncBuffer
		h := &recorder{fail: func(rec outbox.Record) error { return errors.New("redis: connection refused") }}
		r := b.relay(t, nil, h, outbox.RelayConfig{
			RetryBackoffMin: time.Minute, RetryBackoffMax: time.Minute,
			Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo})),
		})
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 3, n)
		out := logs.String()
		// At the default level, a handler outage is one warning per batch,
		// naming how many rows failed and why.
		require.Equal(t, 1, strings.Count(out, "outbox batch had failures"), out)
		require.Contains(t, out, "failed=3")
		require.Contains(t, out, "connection refused")
	})

	// Batches failing in a row during an outage log one line a second,
	// the next one counting the batches left out; it was a line per batch,
	// as many a second as batches of new rows.
	t.Run("FailedBatchesWarnOnceASecond", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		var logs syncBuffer
		h := &recorder{fail: func(rec outbox.Record) error { return errors.New("redis: connection refused") }}
		r := b.relay(t, nil, h, outbox.RelayConfig{
			BatchSize: 1, RetryBackoffMin: time.Minute, RetryBackoffMax: time.Minute,
			Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo})),
		})
		// The first warning is logged after start and before firstLogged:
		// the five batches fall within its second if they end within a
		// second of start, and a batch after firstLogged plus a second
		// falls outside it (from start, a slow first batch left it inside).
		start := time.Now()
		var firstLogged time.Time
		for i := range 5 {
			b.appendCommitted(t, newMessage("scores", fmt.Sprint("k", i), 1))
			n, err := r.RunOnce(ctx)
			require.NoError(t, err)
			require.Equal(t, 1, n)
			if i == 0 {
				firstLogged = time.Now()
			}
		}
		if time.Since(start) >= lograte.Interval {
			t.Skip("five batches took longer than the interval on this machine")
		}
		require.Equal(t, 1, strings.Count(logs.String(), "outbox batch had failures"), logs.String())
		require.Contains(t, logs.String(), "suppressed=0")
		time.Sleep(time.Until(firstLogged.Add(lograte.Interval + 50*time.Millisecond)))
		b.appendCommitted(t, newMessage("scores", "late", 1))
		_, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 2, strings.Count(logs.String(), "outbox batch had failures"), logs.String())
		require.Contains(t, logs.String(), "suppressed=4")
	})

	t.Run("BackoffThenDeadLetterThenReplay", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		msg := newMessage("scores", "user-a", 4)
		b.appendCommitted(t, msg, newMessage("other", "x", 1))
		var row outboxRow // msg's row, once the first attempt failed

		var failing atomic.Bool
		failing.Store(true)
		h := &recorder{fail: func(rec outbox.Record) error {
			if failing.Load() {
				return fmt.Errorf("attempt %d failed", rec.Attempts)
			}
			return nil
		}}
		// A backoff far longer than the test: the row stays waiting however
		// slowly the checks below run, and the test makes it due on purpose
		// (makeDue) before each later attempt.
		const backoffMin = time.Minute
		r := b.relay(t, nil, h, outbox.RelayConfig{MaxAttempts: 3, RetryBackoffMin: backoffMin, RetryBackoffMax: 2 * time.Minute, Streams: []string{"scores"}})
		makeDue := func() {
			t.Helper()
			tag, err := b.pool.Exec(ctx, `UPDATE `+b.writer.Table()+` SET available_at = now() WHERE id = $1 AND available_at > now()`, row.ID)
			require.NoError(t, err)
			require.EqualValues(t, 1, tag.RowsAffected(), "the row was waiting out a backoff")
		}

		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		for _, rr := range b.rows(t) {
			if rr.EventID == msg.EventID {
				row = rr
			}
		}
		require.Equal(t, 1, row.Attempts)
		require.Equal(t, "attempt 1 failed", *row.LastError)
		b.requireLeasesFree(t)
		var delayUS int64
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT (EXTRACT(EPOCH FROM available_at - now()) * 1000000)::bigint FROM `+
			b.writer.Table()+` WHERE id = $1`, row.ID).Scan(&delayUS))
		delay := time.Duration(delayUS) * time.Microsecond
		require.Greater(t, delay, time.Duration(0), "the row waits out a backoff")
		require.LessOrEqual(t, delay, backoffMin)

		n, err = r.RunOnce(ctx)
		require.NoError(t, err)
		require.Zero(t, n, "not due during its backoff")
		stats, err := r.Stats(ctx)
		require.NoError(t, err)
		require.EqualValues(t, 1, stats.Retrying)

		// Attempts 2 and 3 fail once the backoff is over; the second waits
		// out a backoff again, the third moves the row to dead letters.
		makeDue()
		n, err = r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n, "due again after its backoff")
		n, err = r.RunOnce(ctx)
		require.NoError(t, err)
		require.Zero(t, n, "not due during its second backoff")
		stats, err = r.Stats(ctx)
		require.NoError(t, err)
		require.EqualValues(t, 1, stats.Retrying)
		require.Zero(t, stats.DeadLetters)
		makeDue()
		n, err = r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		stats, err = r.Stats(ctx)
		require.NoError(t, err)
		require.EqualValues(t, 1, stats.DeadLetters)
		require.Len(t, h.seen(), 3)
		dead, err := r.DeadLetters(ctx, 0, 10)
		require.NoError(t, err)
		require.Len(t, dead, 1)
		require.Equal(t, msg.EventID, dead[0].EventID)
		require.Equal(t, row.ID, dead[0].ID)
		require.Equal(t, 3, dead[0].Attempts)
		require.Equal(t, "attempt 3 failed", dead[0].LastError)
		require.Equal(t, msg.Payload, dead[0].Payload)
		require.Equal(t, msg.Version, dead[0].Version)
		stats, err = r.Stats(ctx)
		require.NoError(t, err)
		require.EqualValues(t, 1, stats.Pending, "only the other stream's row is pending")

		// Replaying an unknown event moves nothing.
		moved, err := r.ReplayDead(ctx, outbox.ReplayFilter{EventIDs: []uuid.UUID{uuid.New()}})
		require.NoError(t, err)
		require.Zero(t, moved)

		// A filter no dead letter can match is bad input: typed, nothing moved.
		for name, bad := range map[string]outbox.ReplayFilter{
			"NULInStream":   {Stream: "a\x00b"},
			"InvalidUTF8":   {Stream: "\xff"},
			"StreamTooLong": {Stream: strings.Repeat("s", outbox.MaxStreamBytes+1)},
			"NegativeLimit": {Limit: -1},
		} {
			_, err := r.ReplayDead(ctx, bad)
			var cerr *outbox.ConfigError
			require.ErrorAs(t, err, &cerr, name)
			require.ErrorIs(t, err, outbox.ErrInvalidConfig, name)
		}
		require.Equal(t, 1, b.count(t, b.deadTable()))

		// Fixed: replay and deliver, picking the event by its id (among
		// unknown ones) and its stream.
		failing.Store(false)
		moved, err = r.ReplayDead(ctx, outbox.ReplayFilter{EventIDs: []uuid.UUID{uuid.New(), msg.EventID}, Stream: "scores"})
		require.NoError(t, err)
		require.EqualValues(t, 1, moved)
		n, err = r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		seen := h.seen()
		last := seen[len(seen)-1]
		require.Equal(t, msg.EventID, last.EventID)
		require.Equal(t, row.ID, last.ID, "a replayed row keeps its id")
		require.Equal(t, 1, last.Attempts, "attempts restart after a replay")
		stats, err = r.Stats(ctx)
		require.NoError(t, err)
		require.Zero(t, stats.DeadLetters)
		require.EqualValues(t, 1, stats.Pending)
	})

	// A row waiting out a backoff is not handed out before its time when a
	// new row in the same partition makes a claim lease that partition:
	// re-delivered on every append, it would burn its attempts early.
	// A row whose Handler hangs until the context ends, driven by RunOnce
	// under a deadline (a cron pass, a bounded Drain): each pass's failure
	// counts, as at the lease's end, so the row backs off and dies after
	// MaxAttempts. Released instead, as on a cancellation, it was handed
	// out as attempt 1 in every pass, for ever.
	t.Run("CallerDeadlineCountsTheAttempt", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendCommitted(t, newMessage("scores", "poison", 1))
		var (
			mu   sync.Mutex
			seen []int
			pass *expiring
		)
		h := outbox.HandlerFunc(func(ctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			mu.Lock()
			seen = append(seen, batch[0].Attempts)
			mu.Unlock()
			pass.expire() // the caller's deadline passes while the Handler runs
			<-ctx.Done()
			return nil, ctx.Err()
		})
		r := b.relay(t, nil, h, outbox.RelayConfig{MaxAttempts: 2, RetryBackoffMin: time.Millisecond, RetryBackoffMax: time.Millisecond})
		for range 5 {
			pass = newExpiring()
			_, err := r.RunOnce(pass)
			require.NoError(t, err)
			time.Sleep(5 * time.Millisecond) // past the backoff
		}
		mu.Lock()
		defer mu.Unlock()
		require.Equal(t, []int{1, 2}, seen, "attempts handed out")
		require.Equal(t, 1, b.count(t, b.deadTable()), "the row is dead-lettered")
	})

	t.Run("BackoffHoldsWhileItsPartitionIsClaimed", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		failing := newMessage("s", "failing", 1)
		b.appendCommitted(t, failing)
		h := &recorder{fail: func(rec outbox.Record) error {
			if rec.EventID == failing.EventID {
				return errors.New("projection target down")
			}
			return nil
		}}
		r := b.relay(t, nil, h, outbox.RelayConfig{RetryBackoffMin: time.Hour, RetryBackoffMax: time.Hour, MaxAttempts: 5})
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)

		// A new row right after it: consecutive ids, the same partition.
		fresh := newMessage("s", "fresh", 1)
		b.appendCommitted(t, fresh)
		n, err = r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n, "only the new row is due; the failed one waits an hour")
		seen := h.seen()
		require.Len(t, seen, 2)
		require.Equal(t, fresh.EventID, seen[1].EventID)
		rows := b.rows(t)
		require.Len(t, rows, 1)
		require.Equal(t, failing.EventID, rows[0].EventID)
		require.Equal(t, 1, rows[0].Attempts, "the failed row was not attempted again")
	})

	// The delay a failed row waits in the outbox is the backoff of the
	// attempt that failed: within the upper half of RetryBackoffMin
	// doubled once per earlier attempt. Twenty rows make the check
	// independent of the jitter: the second attempt's delays all lie in
	// [1m, 2m], the first's in [30s, 1m], so a settle that used the first
	// attempt's backoff every time would leave no row waiting past a minute.
	t.Run("BackoffDoublesPerAttempt", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		msgs := make([]outbox.Message, 20)
		for i := range msgs {
			msgs[i] = newMessage("s", fmt.Sprint("k", i), 1)
		}
		b.appendCommitted(t, msgs...)
		h := &recorder{fail: func(outbox.Record) error { return errors.New("down") }}
		const backoffMin = time.Minute
		r := b.relay(t, nil, h, outbox.RelayConfig{RetryBackoffMin: backoffMin, RetryBackoffMax: time.Hour, MaxAttempts: 5})
		// delays returns how long each row still waits, by the database's
		// clock, and makes every row due for the next attempt.
		delays := func() []time.Duration {
			t.Helper()
			rows, err := b.pool.Query(ctx, `SELECT (EXTRACT(EPOCH FROM available_at - now()) * 1000000)::bigint FROM `+
				b.writer.Table()+` ORDER BY id`)
			require.NoError(t, err)
			us, err := pgx.CollectRows(rows, pgx.RowTo[int64])
			require.NoError(t, err)
			require.Len(t, us, len(msgs), "every failed row is still in the outbox")
			b.makeDue(t)
			out := make([]time.Duration, len(us))
			for i, v := range us {
				out[i] = time.Duration(v) * time.Microsecond
			}
			return out
		}
		// A generous allowance for the time between the settle and the
		// query; the ranges below are a minute apart.
		const slack = 10 * time.Second
		for attempt := 1; attempt <= 3; attempt++ {
			n, err := r.RunOnce(ctx)
			require.NoError(t, err)
			require.Equal(t, len(msgs), n, "attempt %d", attempt)
			ceiling := backoffMin << (attempt - 1)
			ds := delays()
			for i, d := range ds {
				require.LessOrEqual(t, d, ceiling, "attempt %d, row %d", attempt, i)
				require.Greater(t, d, ceiling/2-slack, "attempt %d, row %d: jittered within the upper half", attempt, i)
			}
			require.Greater(t, slices.Max(ds), ceiling*3/4, "attempt %d: delays spread over the upper half (%v)", attempt, ds)
		}
		for _, row := range b.rows(t) {
			require.Equal(t, 3, row.Attempts)
		}
	})

	// A handler error is stored as last_error whatever its text: NUL bytes
	// and invalid UTF-8, which a text column refuses, and a text longer
	// than 4,096 bytes, bounded. Unsanitised, one such error would fail the
	// settle of the whole batch, its successes included.
	t.Run("UnstorableErrorText", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		bad, good := newMessage("s", "bad", 1), newMessage("s", "good", 1)
		b.appendCommitted(t, bad, good)
		text := "a\x00b\xff" + strings.Repeat("é", 3000)
		h := &recorder{fail: func(rec outbox.Record) error {
			if rec.EventID == bad.EventID {
				return errors.New(text)
			}
			return nil
		}}
		r := b.relay(t, nil, h, outbox.RelayConfig{MaxAttempts: 2, RetryBackoffMin: time.Hour, RetryBackoffMax: time.Hour})
		requireStored := func(stored string) {
			t.Helper()
			require.True(t, utf8.ValidString(stored))
			require.NotContains(t, stored, "\x00")
			require.LessOrEqual(t, len(stored), 4096)
			require.Greater(t, len(stored), 4000, "only the excess is cut")
			require.True(t, strings.HasPrefix(stored, "ab\uFFFDéé"), "%.20q", stored)
		}

		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 2, n)
		rows := b.rows(t)
		require.Len(t, rows, 1, "the good row is acknowledged")
		require.Equal(t, bad.EventID, rows[0].EventID)
		require.Equal(t, 1, rows[0].Attempts)
		requireStored(*rows[0].LastError)

		// The dead-letter path stores it the same way.
		b.makeDue(t)
		n, err = r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		require.Zero(t, b.count(t, b.writer.Table()))
		dead, err := r.DeadLetters(ctx, 0, 10)
		require.NoError(t, err)
		require.Len(t, dead, 1)
		require.Equal(t, 2, dead[0].Attempts)
		requireStored(dead[0].LastError)
	})

	t.Run("BackoffWithoutCap", func(t *testing.T) {
		t.Parallel()
		// The largest Duration as "no cap": doubling must not overflow.
		b := setup(t)
		r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{RetryBackoffMin: time.Second, RetryBackoffMax: math.MaxInt64, MaxAttempts: 100})
		prev := time.Duration(0)
		for attempts := 1; attempts <= 100; attempts++ {
			d := r.Backoff(attempts)
			require.Positive(t, d, "attempt %d", attempts)
			require.GreaterOrEqual(t, d, prev/2, "attempt %d", attempts) // jitter stays in the upper half
			prev = d
		}
	})

	t.Run("ReconnectPausesWithoutCap", func(t *testing.T) {
		t.Parallel()
		pauses := outbox.Pauses(math.MaxInt64, 100)
		for i := 1; i < len(pauses); i++ {
			require.GreaterOrEqual(t, pauses[i], pauses[i-1], "pause %d of %v", i, pauses)
		}
		require.Equal(t, time.Duration(math.MaxInt64), pauses[len(pauses)-1])
		require.Equal(t, []time.Duration{time.Second, time.Second}, outbox.Pauses(time.Second, 6)[4:])
	})

	t.Run("MaxLengthStreamIsDeadLettered", func(t *testing.T) {
		t.Parallel()
		// A dead letter's stream is indexed: the longest stream Append
		// allows must fit the index even when it does not compress.
		b := setup(t)
		stream := make([]byte, outbox.MaxStreamBytes)
		for i := range stream {
			stream[i] = byte(33 + rand.IntN(94))
		}
		b.appendCommitted(t, newMessage(string(stream), "a", 1), newMessage("s", "b", 1))
		h := &recorder{fail: func(rec outbox.Record) error {
			if rec.Key == "a" {
				return errors.New("cannot project")
			}
			return nil
		}}
		r := b.relay(t, nil, h, outbox.RelayConfig{MaxAttempts: 1})
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 2, n)
		require.Zero(t, b.count(t, b.writer.Table()))
		require.Equal(t, 1, b.count(t, b.deadTable()))
	})

	t.Run("BackoffGrowsWithJitter", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{RetryBackoffMin: time.Second, RetryBackoffMax: time.Minute})
		for attempts := 1; attempts <= 12; attempts++ {
			ceiling := min(time.Second<<(attempts-1), time.Minute)
			for range 50 {
				d := r.Backoff(attempts)
				require.GreaterOrEqual(t, d, ceiling/2, "attempt %d", attempts)
				require.LessOrEqual(t, d, ceiling, "attempt %d", attempts)
			}
		}
		// Jitter: many draws are not all equal.
		draws := map[time.Duration]bool{}
		for range 20 {
			draws[r.Backoff(3)] = true
		}
		require.Greater(t, len(draws), 1)
	})

	t.Run("SameEventDiesTwice", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		msg := newMessage("s", "k", 1)
		b.appendCommitted(t, msg)
		r := b.relay(t, nil, &recorder{fail: func(outbox.Record) error { return errors.New("no") }}, outbox.RelayConfig{MaxAttempts: 1})
		_, err := r.RunOnce(ctx)
		require.NoError(t, err)
		// The same event is appended again while its first row is dead: a
		// replay skips it, since the outbox holds the event already.
		b.appendCommitted(t, msg)
		moved, err := r.ReplayDead(ctx, outbox.ReplayFilter{})
		require.NoError(t, err)
		require.Zero(t, moved)
		stats, err := r.Stats(ctx)
		require.NoError(t, err)
		require.EqualValues(t, 1, stats.DeadLetters)
		require.EqualValues(t, 1, stats.Pending)

		// The second row dies as well: burying it must not fail, and a
		// good row in the same batch is still acknowledged.
		good := newMessage("s", "good", 1)
		b.appendCommitted(t, good)
		r2 := b.relay(t, nil, &recorder{fail: func(rec outbox.Record) error {
			if rec.EventID == msg.EventID {
				return errors.New("still no")
			}
			return nil
		}}, outbox.RelayConfig{MaxAttempts: 1})
		n, err := r2.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 2, n)
		stats, err = r.Stats(ctx)
		require.NoError(t, err)
		require.EqualValues(t, 2, stats.DeadLetters)
		require.Zero(t, stats.Pending)
	})

	// Two dead letters of one event must not block the replay of the others:
	// the event comes back once, from its newest dead letter, and its older
	// copy goes.
	t.Run("ReplayDuplicateDeadLetters", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		msg, other := newMessage("s", "k", 1), newMessage("s", "other", 1)
		r := b.relay(t, nil, &recorder{fail: func(outbox.Record) error { return errors.New("no") }}, outbox.RelayConfig{MaxAttempts: 1})
		b.appendCommitted(t, msg)
		_, err := r.RunOnce(ctx)
		require.NoError(t, err)
		b.appendCommitted(t, msg, other) // re-sent by a client, without an idempotency record
		_, err = r.RunOnce(ctx)
		require.NoError(t, err)
		dead, err := r.DeadLetters(ctx, 0, 10)
		require.NoError(t, err)
		require.Len(t, dead, 3)
		require.Equal(t, []uuid.UUID{msg.EventID, msg.EventID, other.EventID},
			[]uuid.UUID{dead[0].EventID, dead[1].EventID, dead[2].EventID})

		moved, err := r.ReplayDead(ctx, outbox.ReplayFilter{})
		require.NoError(t, err)
		require.EqualValues(t, 2, moved)
		rows := b.rows(t)
		require.Len(t, rows, 2)
		require.Equal(t, dead[1].ID, rows[0].ID, "the newest dead letter of the event is replayed")
		require.Equal(t, msg.EventID, rows[0].EventID)
		require.Equal(t, dead[2].ID, rows[1].ID)
		require.Zero(t, b.count(t, b.deadTable()), "the older copy went with the replay")

		// Once delivered, the event is not replayed a second time.
		n, err := b.relay(t, nil, &recorder{}, outbox.RelayConfig{}).RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 2, n)
		moved, err = r.ReplayDead(ctx, outbox.ReplayFilter{})
		require.NoError(t, err)
		require.Zero(t, moved)
	})
}

func TestRelayConcurrency(t *testing.T) {
	t.Parallel()

	b := setup(t)
	const (
		relays = 4
		rows   = 600
	)
	msgs := make([]outbox.Message, rows)
	for i := range msgs {
		msgs[i] = newMessage("s", fmt.Sprint("k", i%50), int64(i+1))
	}

	var (
		mu         sync.Mutex
		inFlight   = map[uuid.UUID]string{}
		deliveries = map[uuid.UUID]int{}
		overlap    atomic.Value
		handledBy  = map[string]int{}
	)
	handler := func(name string) outbox.HandlerFunc {
		return func(ctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			mu.Lock()
			for _, rec := range batch {
				if other, busy := inFlight[rec.EventID]; busy {
					overlap.Store(fmt.Sprintf("row %d handled by %s and %s at once", rec.ID, other, name))
				}
				inFlight[rec.EventID] = name
			}
			mu.Unlock()
			time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond)
			mu.Lock()
			for _, rec := range batch {
				delete(inFlight, rec.EventID)
				deliveries[rec.EventID]++
				handledBy[name]++
			}
			mu.Unlock()
			return make([]outbox.Result, len(batch)), nil
		}
	}
	// Two pools stand for two processes.
	pools := []*pgxpool.Pool{b.pool, testenv.NewPool(t, b.pg.ConnString)}
	for i := range relays {
		name := fmt.Sprint("relay-", i)
		r := b.relay(t, pools[i%len(pools)], handler(name), outbox.RelayConfig{BatchSize: 10, PollInterval: 50 * time.Millisecond, Name: name})
		startRun(t, r)
	}
	// Append while the relays run, in several transactions.
	for i := 0; i < rows; i += 100 {
		b.appendCommitted(t, msgs[i:i+100]...)
	}
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(deliveries) == rows
	}, 30*time.Second, 20*time.Millisecond)
	require.Nil(t, overlap.Load(), "no row is handled by two relays at once")
	require.Eventually(t, func() bool { return b.count(t, b.writer.Table()) == 0 }, 5*time.Second, 20*time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	for _, m := range msgs {
		require.Equal(t, 1, deliveries[m.EventID], "with leases that never expire every row is delivered once")
	}
	t.Logf("rows handled per relay: %v", handledBy)
}

func TestRelayRun(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("NotifyWakesRelay", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		handled := make(chan time.Time, 10)
		r := b.relay(t, nil, outbox.HandlerFunc(func(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			for range batch {
				handled <- time.Now()
			}
			return make([]outbox.Result, len(batch)), nil
		}), outbox.RelayConfig{PollInterval: time.Hour})
		startRun(t, r)
		waitListening(t, b)

		// With an hourly poll, only notifications can wake the relay. A
		// relay passes at start and once after LISTEN succeeds, so three
		// sequential rounds cannot all be served without notifications.
		for round := range 3 {
			committed := b.appendNow(t, newMessage("s", fmt.Sprint("k", round), 1))
			select {
			case at := <-handled:
				t.Logf("round %d: NOTIFY to handler latency %s", round, at.Sub(committed))
			case <-time.After(2 * time.Second):
				t.Fatalf("round %d: relay not woken within 2s", round)
			}
		}
	})

	t.Run("ListenReconnects", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		h := &recorder{}
		r := b.relay(t, nil, h, outbox.RelayConfig{PollInterval: time.Hour, ReconnectBackoffMax: 100 * time.Millisecond})
		startRun(t, r)
		pid := waitListening(t, b)
		_, err := b.pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid)
		require.NoError(t, err)
		require.Eventually(t, func() bool {
			newPid := listenerPid(b)
			return newPid != 0 && newPid != pid
		}, 10*time.Second, 20*time.Millisecond, "the relay listens again on a new connection")
		b.appendNow(t, newMessage("s", "k", 1))
		require.Eventually(t, func() bool { return len(h.seen()) == 1 }, 5*time.Second, 10*time.Millisecond)
	})

	// The LISTEN connection is opened the way the pool opens its own: a
	// pool whose BeforeConnect supplies connection parameters (rotating
	// credentials, the current primary) and whose AfterConnect prepares the
	// session. Here BeforeConnect supplies the port (the static config names
	// a closed one) and AfterConnect names the session.
	t.Run("ListenRunsPoolConnectHooks", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		cfg, err := pgxpool.ParseConfig(b.pg.ConnString)
		require.NoError(t, err)
		realPort := cfg.ConnConfig.Port
		cfg.ConnConfig.Port = 1 // nothing listens there
		for _, fb := range cfg.ConnConfig.Fallbacks {
			fb.Port = 1
		}
		cfg.BeforeConnect = func(_ context.Context, cc *pgx.ConnConfig) error {
			cc.Port = realPort
			for _, fb := range cc.Fallbacks {
				fb.Port = realPort
			}
			return nil
		}
		appName := "verity_hooked_" + uuid.NewString()[:8]
		cfg.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
			_, err := conn.Exec(ctx, `SELECT set_config('application_name', $1, false)`, appName)
			return err
		}
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)

		handled := make(chan struct{}, 10)
		r := b.relay(t, pool, outbox.HandlerFunc(func(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			for range batch {
				handled <- struct{}{}
			}
			return make([]outbox.Result, len(batch)), nil
		}), outbox.RelayConfig{PollInterval: time.Hour, ReconnectBackoffMax: 100 * time.Millisecond})
		startRun(t, r)
		pid := waitListening(t, b)
		var listenerApp string
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT application_name FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&listenerApp))
		require.Equal(t, appName, listenerApp, "AfterConnect ran on the LISTEN connection")

		// With an hourly poll only notifications can serve all three
		// rounds (see NotifyWakesRelay).
		for round := range 3 {
			b.appendCommitted(t, newMessage("s", fmt.Sprint("k", round), 1))
			select {
			case <-handled:
			case <-time.After(2 * time.Second):
				t.Fatalf("round %d: relay not woken within 2s", round)
			}
		}
	})

	t.Run("PollingOnly", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		h := &recorder{}
		r := b.relay(t, nil, h, outbox.RelayConfig{DisableNotify: true, PollInterval: 50 * time.Millisecond})
		startRun(t, r)
		b.appendCommitted(t, newMessage("s", "a", 1))
		require.Eventually(t, func() bool { return len(h.seen()) == 1 }, 5*time.Second, 10*time.Millisecond)
		requireNoListener(t, b, "no LISTEN connection with DisableNotify")
	})

	t.Run("SurvivesKilledConnections", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		h := &recorder{}
		// Every connection of the relay, pooled or its listener (opened
		// from the pool's configuration), carries this application_name.
		appName := "verity_relay_" + uuid.NewString()[:8]
		relayPool := newPoolNamed(t, b.pg.ConnString, appName)
		r := b.relay(t, relayPool, h, outbox.RelayConfig{PollInterval: 100 * time.Millisecond, ReconnectBackoffMax: 100 * time.Millisecond})
		startRun(t, r)
		listener := waitListening(t, b)
		b.appendCommitted(t, newMessage("s", "a", 1))
		require.Eventually(t, func() bool { return len(h.seen()) == 1 }, 5*time.Second, 10*time.Millisecond)
		// Its batch is settled: no statement of it can be cut off below.
		require.Eventually(t, func() bool { return b.count(t, b.writer.Table()) == 0 }, 5*time.Second, 10*time.Millisecond)

		// Kill every connection the relay holds: pooled ones and the
		// listener. The relay must recover on its own.
		rows, err := b.pool.Query(ctx, `WITH relay AS MATERIALIZED (
			SELECT pid FROM pg_stat_activity WHERE application_name = $1
		) SELECT pid FROM relay WHERE pg_terminate_backend(pid)`, appName)
		require.NoError(t, err)
		pids, err := pgx.CollectRows(rows, pgx.RowTo[int])
		require.NoError(t, err)
		require.Contains(t, pids, listener, "the listener was killed")
		require.GreaterOrEqual(t, len(pids), 2, "pooled connections were killed too: %v", pids)
		b.appendCommitted(t, newMessage("s", "b", 1))
		require.Eventually(t, func() bool { return len(h.seen()) == 2 }, 10*time.Second, 10*time.Millisecond)
	})

	// While claims fail, the relay retries after the growing error pause
	// (100ms, 200ms, 400ms, ...), not once per notification, though every
	// commit notifies; a row notified during the pause is claimed as soon
	// as the pause ends, not at the next poll.
	t.Run("ErrorPauseOutlastsNotifications", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		logs := &syncBuffer{}
		r := b.relay(t, newPoolLockTimeout(t, b.pg.ConnString, "20ms"), &recorder{}, outbox.RelayConfig{
			PollInterval: time.Hour, Logger: slog.New(slog.NewTextHandler(logs, nil))})
		// Something holds the lease table (REINDEX, VACUUM FULL, ALTER):
		// every claim fails with lock_not_available.
		blocker := b.lockLeases(t)

		start := time.Now()
		startRun(t, r)
		waitListening(t, b)
		appended := 0
		for time.Since(start) < 2*time.Second {
			b.appendCommitted(t, newMessage("s", fmt.Sprint("k", appended), 1))
			appended++
			time.Sleep(5 * time.Millisecond)
		}
		failures := strings.Count(logs.String(), "outbox relay batch failed")
		t.Logf("%d claims failed in %s while %d rows were appended", failures, time.Since(start), appended)
		// Pauses of 100+200+400+800 ms allow at most 5 claims in 2 s (timers
		// never fire early); retrying per notification makes dozens.
		require.GreaterOrEqual(t, failures, 1, "the claims failed")
		require.LessOrEqual(t, failures, 10, "notifications cut the error pause short")

		// The relay is in a pause of at most 1.6 s and polls hourly.
		require.NoError(t, blocker.Rollback(ctx))
		require.Eventually(t, func() bool { return b.count(t, b.writer.Table()) == 0 }, 10*time.Second, 10*time.Millisecond,
			"rows appended during the pause are delivered when it ends")
	})

	// ReconnectBackoffMax, not PollInterval, caps the error pause: a short
	// poll must not turn a failing database into a retry every poll.
	t.Run("ErrorPauseNotCappedByPollInterval", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		logs := &syncBuffer{}
		r := b.relay(t, newPoolLockTimeout(t, b.pg.ConnString, "20ms"), &recorder{}, outbox.RelayConfig{
			DisableNotify: true, PollInterval: 50 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(logs, nil))})
		b.lockLeases(t)
		start := time.Now()
		startRun(t, r)
		time.Sleep(2 * time.Second)
		failures := strings.Count(logs.String(), "outbox relay batch failed")
		t.Logf("%d claims failed in %s", failures, time.Since(start))
		// At most 5 claims fit in 2 s (see ErrorPauseOutlastsNotifications);
		// one per poll would be about 30.
		require.GreaterOrEqual(t, failures, 1, "the claims failed")
		require.LessOrEqual(t, failures, 10, "PollInterval cut the error pause short")
	})

	t.Run("ShutdownDuringErrorPause", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		logs := &syncBuffer{}
		r := b.relay(t, newPoolLockTimeout(t, b.pg.ConnString, "20ms"), &recorder{}, outbox.RelayConfig{
			PollInterval: time.Hour, Logger: slog.New(slog.NewTextHandler(logs, nil))})
		b.lockLeases(t)
		stop := startRun(t, r)
		require.Eventually(t, func() bool { return strings.Contains(logs.String(), "pause=1.6s") }, 10*time.Second, 5*time.Millisecond)
		begun := time.Now()
		require.NoError(t, stop())
		require.Less(t, time.Since(begun), time.Second, "Run waited out the error pause")
	})

	t.Run("GracefulShutdownFinishesBatch", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		started := make(chan struct{}, 1)
		var finished atomic.Bool
		r := b.relay(t, nil, outbox.HandlerFunc(func(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			started <- struct{}{}
			time.Sleep(300 * time.Millisecond) // the work in flight
			finished.Store(true)
			return make([]outbox.Result, len(batch)), nil
		}), outbox.RelayConfig{ShutdownTimeout: 5 * time.Second})
		stop := startRun(t, r)
		b.appendCommitted(t, newMessage("s", "a", 1), newMessage("s", "b", 1))
		receive(t, started)
		require.NoError(t, stop())
		require.True(t, finished.Load(), "Run returned only after the batch finished")
		require.Zero(t, b.count(t, b.writer.Table()), "the finished batch was acknowledged")
		requireNoListener(t, b, "the LISTEN connection is closed")
	})

	// A claim already sent when Run is stopped is part of the batch in
	// flight: it finishes, and its rows are delivered and acknowledged,
	// instead of being cut off and released.
	t.Run("ShutdownLetsASentClaimFinish", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		appName := "verity_relay_" + uuid.NewString()[:8]
		h := &recorder{}
		r := b.relay(t, newPoolNamed(t, b.pg.ConnString, appName), h, outbox.RelayConfig{DisableNotify: true, PollInterval: time.Hour})
		msg, blocker := b.blockNextClaim(t, r)
		stop := startRun(t, r)
		waitingForLock := func() bool { return b.waitingForLock(appName, "") }
		require.Eventually(t, waitingForLock, 5*time.Second, 10*time.Millisecond, "the claim waits for the row lock")

		stopped := make(chan error, 1)
		go func() { stopped <- stop() }()
		// Time for a cut-off claim's cancel request to reach the server.
		time.Sleep(200 * time.Millisecond)
		require.True(t, waitingForLock(), "the claim still waits after Run was stopped")
		require.NoError(t, blocker.Commit(ctx))
		require.NoError(t, receive(t, stopped))

		seen := h.seen()
		require.NotEmpty(t, seen)
		require.Equal(t, msg.EventID, seen[len(seen)-1].EventID, "the claimed row was delivered")
		require.Zero(t, b.count(t, b.writer.Table()), "and acknowledged")
	})

	t.Run("ShutdownTimeoutReleasesRows", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		started := make(chan struct{}, 1)
		r := b.relay(t, nil, outbox.HandlerFunc(func(ctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			started <- struct{}{}
			<-ctx.Done() // a handler that only stops when told to
			return nil, ctx.Err()
		}), outbox.RelayConfig{ShutdownTimeout: 200 * time.Millisecond})
		stop := startRun(t, r)
		b.appendCommitted(t, newMessage("s", "a", 1))
		receive(t, started)
		began := time.Now()
		require.NoError(t, stop())
		require.Less(t, time.Since(began), 5*time.Second)
		rows := b.rows(t)
		require.Len(t, rows, 1)
		require.Nil(t, rows[0].LastError, "a release is not a failure")
		require.Zero(t, rows[0].Attempts, "a release is not a failure")
		b.requireLeasesFree(t)

		// Another relay gets the row at once, as its first attempt.
		h := &recorder{}
		n, err := b.relay(t, nil, h, outbox.RelayConfig{}).RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		require.Equal(t, 1, h.seen()[0].Attempts)
	})

	// ShutdownTimeout bounds Run, its settle included: a settle that waits
	// (here for a lock on the lease rows) is cut off at ShutdownTimeout,
	// not after settleTimeout's 10 s, and its rows, left leased, are
	// delivered again once the lease ends.
	// ShutdownTimeout bounds the Handler, not the settle after it: a settle
	// cut off there would leave the rows leased, and the next claim would
	// count a crashed attempt, burying them at MaxAttempts although the
	// Handler never completed them.
	t.Run("ShutdownTimeoutDoesNotCutTheSettle", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		started := make(chan struct{}, 1)
		const grace = 100 * time.Millisecond
		r := b.relay(t, nil, outbox.HandlerFunc(func(ctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			started <- struct{}{}
			<-ctx.Done()
			return nil, ctx.Err()
		}), outbox.RelayConfig{ShutdownTimeout: grace, MaxAttempts: 1, DisableNotify: true, PollInterval: 10 * time.Millisecond})
		runCtx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- r.Run(runCtx) }()
		msg := newMessage("s", "a", 1)
		b.appendCommitted(t, msg)
		receive(t, started)

		// The settle's release waits for this lock, past ShutdownTimeout.
		locker, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = locker.Rollback(context.Background()) })
		_, err = locker.Exec(ctx, `SELECT 1 FROM `+b.leasesTable()+` FOR UPDATE`)
		require.NoError(t, err)
		cancel()
		const held = grace + 500*time.Millisecond
		select {
		case err := <-done:
			t.Fatalf("Run returned (%v) while its settle waited for a lock", err)
		case <-time.After(held):
		}
		require.NoError(t, locker.Rollback(ctx))
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(10 * time.Second):
			t.Fatal("Run did not return once its settle could run")
		}

		// The row was released: delivered again at once, not buried.
		h := &recorder{}
		n, err := b.relay(t, nil, h, outbox.RelayConfig{MaxAttempts: 1}).RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		require.Equal(t, msg.EventID, h.seen()[0].EventID)
		require.Zero(t, b.count(t, b.deadTable()))
		require.Zero(t, b.count(t, b.writer.Table()))
	})

	// The settle of the batch in flight at shutdown runs after ctx ended;
	// if it fails, Run still returns nil but says so in the log.
	t.Run("ShutdownLogsFailedSettle", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		logs := &syncBuffer{}
		started := make(chan struct{}, 1)
		r := b.relay(t, nil, outbox.HandlerFunc(func(ctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			started <- struct{}{}
			<-ctx.Done()
			return nil, ctx.Err()
		}), outbox.RelayConfig{ShutdownTimeout: 100 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(logs, nil))})
		stop := startRun(t, r)
		b.appendCommitted(t, newMessage("s", "a", 1))
		receive(t, started)
		// The settle statement will not find the lease table.
		_, err := b.pool.Exec(ctx, `ALTER TABLE `+b.leasesTable()+` RENAME TO gone`)
		require.NoError(t, err)
		require.NoError(t, stop())
		require.Contains(t, logs.String(), "could not settle its last batch at shutdown")
		require.Contains(t, logs.String(), "settle batch")
	})

	t.Run("RunTwiceIsRefused", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{})
		stop := startRun(t, r)
		waitListening(t, b) // the first Run is under way
		probeCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		require.ErrorIs(t, r.Run(probeCtx), outbox.ErrRelayRunning)
		require.NoError(t, stop())
		// Once stopped, it may run again.
		require.NoError(t, startRun(t, r)())
	})

	t.Run("CancelledBeforeStart", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{})
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		require.NoError(t, r.Run(cctx))
		_, err := r.RunOnce(cctx)
		require.ErrorIs(t, err, context.Canceled)
	})
}

// newPoolNamed opens a small pool on connString whose connections report
// appName as their application_name, closed at cleanup.
func newPoolNamed(t *testing.T, connString, appName string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(connString)
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["application_name"] = appName
	cfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// newPoolTraced opens a pool on connString whose connections report to
// tracer, closed at cleanup.
func newPoolTraced(t *testing.T, connString string, tracer pgx.QueryTracer) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(connString)
	require.NoError(t, err)
	cfg.ConnConfig.Tracer = tracer
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// newPoolLockTimeout opens a pool on connString whose statements give up
// waiting for a lock after lockTimeout, closed at cleanup.
func newPoolLockTimeout(t *testing.T, connString, lockTimeout string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(connString)
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["lock_timeout"] = lockTimeout
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// lockLeases locks the lease table until the returned transaction ends (at
// the latest at cleanup), so that every claim waits for it.
func (b *testBundle) lockLeases(t *testing.T) pgx.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(ctx) })
	_, err = tx.Exec(ctx, `LOCK TABLE `+b.leasesTable()+` IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	return tx
}

// appendNow appends and commits msgs and returns the commit time.
func (b *testBundle) appendNow(t *testing.T, msgs ...outbox.Message) time.Time {
	t.Helper()
	b.appendCommitted(t, msgs...)
	return time.Now()
}

// listenerPid returns the pid of the relay's LISTEN connection, or 0 when
// there is none, or when the query fails (for require.Eventually; use
// requireNoListener to assert there is none).
func listenerPid(b *testBundle) int {
	pid, err := queryListenerPid(b)
	if err != nil {
		return 0
	}
	return pid
}

func queryListenerPid(b *testBundle) (int, error) {
	var pid int
	err := b.pool.QueryRow(context.Background(), `SELECT COALESCE(max(pid), 0) FROM pg_stat_activity WHERE query = $1`,
		`LISTEN "`+b.writer.Channel()+`"`).Scan(&pid)
	return pid, err
}

// requireNoListener asserts that no backend LISTENs on the bundle's
// channel. It gives a closed connection's server process a second to exit
// (it outlives the client's close by some milliseconds, more under load);
// a connection left open stays.
func requireNoListener(t *testing.T, b *testBundle, msg string) {
	t.Helper()
	require.Eventually(t, func() bool {
		pid, err := queryListenerPid(b)
		return err == nil && pid == 0
	}, time.Second, 10*time.Millisecond, msg)
}

func waitListening(t *testing.T, b *testBundle) int {
	t.Helper()
	var pid int
	require.Eventually(t, func() bool {
		pid = listenerPid(b)
		return pid != 0
	}, 10*time.Second, 10*time.Millisecond, "relay never LISTENed")
	return pid
}

func TestRelayStats(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{})

	stats, err := r.Stats(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.Stats{}, stats, "empty outbox")

	b.appendCommitted(t, newMessage("s", "a", 1), newMessage("s", "b", 1), newMessage("s", "c", 1))
	time.Sleep(50 * time.Millisecond)

	started, release := make(chan struct{}), make(chan struct{})
	holder := b.relay(t, nil, outbox.HandlerFunc(func(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
		close(started)
		<-release
		return make([]outbox.Result, len(batch)), nil
	}), outbox.RelayConfig{BatchSize: 2})
	done := make(chan error, 1)
	go func() {
		_, err := holder.RunOnce(ctx)
		done <- err
	}()
	receive(t, started)
	stats, err = r.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 3, stats.Pending)
	require.EqualValues(t, 2, stats.InFlight)
	require.Zero(t, stats.Retrying)
	require.Zero(t, stats.DeadLetters)
	require.GreaterOrEqual(t, stats.OldestPendingAge, 50*time.Millisecond)
	require.Less(t, stats.OldestPendingAge, time.Minute)

	close(release)
	require.NoError(t, receive(t, done))
	stats, err = r.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, stats.Pending)
	require.Zero(t, stats.InFlight)

	// OldestPendingAge, the figure to alert on, is the age of the oldest
	// pending row, not of the newest (the rows above were all appended at
	// once, so they could not tell). The remaining row is dated an hour
	// back by the database's clock rather than slept on.
	_, err = b.pool.Exec(ctx, `UPDATE `+b.writer.Table()+` SET created_at = now() - interval '1 hour'`)
	require.NoError(t, err)
	b.appendCommitted(t, newMessage("s", "d", 1))
	stats, err = r.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 2, stats.Pending)
	require.GreaterOrEqual(t, stats.OldestPendingAge, time.Hour, "the oldest row's age, not the newest's")
	require.Less(t, stats.OldestPendingAge, time.Hour+time.Minute)
}

// TestRelayDeadLetters checks DeadLetters' pages (id order, strictly after
// afterID, at most limit) and contents, and that a page size of 0 or less
// is refused with a *ConfigError naming "limit".
func TestRelayDeadLetters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	msgs := make([]outbox.Message, 5)
	for i := range msgs {
		msgs[i] = newMessage(fmt.Sprint("stream-", i), fmt.Sprint("key-", i), int64(i+1))
	}
	b.appendCommitted(t, msgs...)
	r := b.relay(t, nil, &recorder{fail: func(rec outbox.Record) error {
		return fmt.Errorf("cannot project %s", rec.Key)
	}}, outbox.RelayConfig{MaxAttempts: 1})
	n, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, len(msgs), n)
	require.Zero(t, b.count(t, b.writer.Table()), "every row is dead after its only attempt")

	for _, limit := range []int{0, -1} {
		dead, err := r.DeadLetters(ctx, 0, limit)
		require.ErrorIs(t, err, outbox.ErrInvalidConfig, "limit %d", limit)
		var cfgErr *outbox.ConfigError
		require.ErrorAs(t, err, &cfgErr, "limit %d", limit)
		require.Equal(t, "limit", cfgErr.Field)
		require.Nil(t, dead)
	}

	var all []outbox.DeadLetter
	after := int64(0)
	for _, want := range []int{2, 2, 1, 0} {
		page, err := r.DeadLetters(ctx, after, 2)
		require.NoError(t, err)
		require.Len(t, page, want, "page after id %d", after)
		for _, d := range page {
			require.Greater(t, d.ID, after, "only ids after afterID")
			after = d.ID
		}
		all = append(all, page...)
	}
	require.Len(t, all, len(msgs), "the pages hold every dead letter once")
	for i, d := range all {
		m := msgs[i]
		require.Equal(t, m.EventID, d.EventID)
		require.Equal(t, m.Stream, d.Stream)
		require.Equal(t, m.Key, d.Key)
		require.Equal(t, m.Version, d.Version)
		require.Equal(t, m.Payload, d.Payload)
		require.Equal(t, 1, d.Attempts)
		require.Equal(t, "cannot project "+m.Key, d.LastError)
		require.WithinDuration(t, time.Now(), d.CreatedAt, time.Minute)
		require.WithinDuration(t, time.Now(), d.FailedAt, time.Minute)
		require.False(t, d.FailedAt.Before(d.CreatedAt), "failed after it was created")
	}
	stats, err := r.Stats(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.Stats{DeadLetters: int64(len(msgs))}, stats)
}

// TestRelayStatsAncientRow checks that OldestPendingAge saturates at the
// largest Duration for a row older than a Duration holds (a composed
// INSERT that passes an unset time.Time stores year 1, which migration
// 006 accepts as finite), rather than wrapping to 0 or to an arbitrary age
// while that row is the one to alert on.
func TestRelayStatsAncientRow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	b.appendCommitted(t, newMessage("s", "k", 1))
	r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{})
	for _, at := range []string{"0001-01-01 00:00:00+00", "1700-01-01 00:00:00+00"} {
		_, err := b.pool.Exec(ctx, `UPDATE `+b.writer.Table()+` SET created_at = $1::timestamptz`, at)
		require.NoError(t, err)
		stats, err := r.Stats(ctx)
		require.NoError(t, err)
		require.EqualValues(t, 1, stats.Pending)
		require.Equal(t, time.Duration(math.MaxInt64), stats.OldestPendingAge, "created_at %s", at)
	}
}

// TestRelayStatsFutureRow checks that a row dated after the database's
// clock (a composed INSERT: created_at need only be finite; or a clock
// that stepped back) counts as not having waited at all: OldestPendingAge
// is never negative, which an alert or a gauge would misread.
func TestRelayStatsFutureRow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{})
	_, err := b.pool.Exec(ctx, `INSERT INTO `+b.writer.Table()+` (event_id, stream, key, version, payload, created_at)
		VALUES (gen_random_uuid(), 's', 'future', 1, '\x00', now() + interval '1 hour')`)
	require.NoError(t, err)
	stats, err := r.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, stats.Pending)
	require.Zero(t, stats.OldestPendingAge)
}

// insertBeforeMigration006 inserts, with a composed INSERT, a row of
// partition 0 whose created_at is createdAt ('infinity' or '-infinity'), as
// an outbox without migration 006's constraint accepts: the constraint is
// dropped first.
func (b *testBundle) insertBeforeMigration006(t *testing.T, key, createdAt string) {
	t.Helper()
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `ALTER TABLE `+b.writer.Table()+` DROP CONSTRAINT IF EXISTS verity_outbox_created_at_finite`)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `INSERT INTO `+b.writer.Table()+` (event_id, stream, key, version, payload, created_at)
		VALUES (gen_random_uuid(), 's', $1, 1, '\x00', $2::timestamptz)`, key, createdAt)
	require.NoError(t, err)
}

// TestRelayNonFiniteCreatedAt covers rows whose created_at is 'infinity'
// or '-infinity', which time.Time cannot hold: they used to fail every
// claim that read them, uncounted, so neither they nor the other rows of
// the partitions claimed with them were ever delivered.
func TestRelayNonFiniteCreatedAt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// seed stores both kinds in partition 0, after a good row there, and a
	// good row in partition 1.
	seed := func(t *testing.T) *testBundle {
		b := setup(t)
		b.appendCommitted(t, newMessage("s", "good-same-partition", 1))
		b.insertBeforeMigration006(t, "infinity", "infinity")
		b.insertBeforeMigration006(t, "-infinity", "-infinity")
		_, err := b.pool.Exec(ctx, `ALTER TABLE `+b.writer.Table()+` ALTER COLUMN id RESTART WITH 257`)
		require.NoError(t, err)
		b.appendCommitted(t, newMessage("s", "good-other-partition", 1))
		return b
	}

	t.Run("DeliveredWithUnknownAge", func(t *testing.T) {
		t.Parallel()
		b := seed(t)
		h := &recorder{}
		r := b.relay(t, nil, h, outbox.RelayConfig{})
		stats, err := r.Stats(ctx)
		require.NoError(t, err)
		require.EqualValues(t, 4, stats.Pending)
		require.Greater(t, stats.OldestPendingAge, time.Duration(0), "the good rows' age")
		require.Less(t, stats.OldestPendingAge, time.Minute, "rows without an age are left out")

		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 4, n)
		for _, rec := range h.seen() {
			require.Equal(t, strings.HasPrefix(rec.Key, "good"), !rec.CreatedAt.IsZero(), rec.Key)
		}
		require.Zero(t, b.count(t, b.writer.Table()))
	})

	t.Run("FailingRowIsDeadLetteredAndReplayed", func(t *testing.T) {
		t.Parallel()
		b := seed(t)
		h := &recorder{fail: func(rec outbox.Record) error {
			if strings.HasPrefix(rec.Key, "good") {
				return nil
			}
			return errors.New("poison")
		}}
		r := b.relay(t, nil, h, outbox.RelayConfig{MaxAttempts: 1})
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 4, n)
		require.Zero(t, b.count(t, b.writer.Table()))
		dead, err := r.DeadLetters(ctx, 0, 10)
		require.NoError(t, err)
		require.Len(t, dead, 2)
		for _, d := range dead {
			require.True(t, d.CreatedAt.IsZero(), d.Key)
		}

		// With migration 006 in place the outbox refuses their created_at:
		// the replay gives them the time of their return.
		require.NoError(t, outbox.Migrate(ctx, b.pool, b.cfg))
		moved, err := r.ReplayDead(ctx, outbox.ReplayFilter{})
		require.NoError(t, err)
		require.EqualValues(t, 2, moved)
		var finite bool
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT bool_and(isfinite(created_at)) FROM `+b.writer.Table()).Scan(&finite))
		require.True(t, finite)
	})
}

func TestRelayConfig(t *testing.T) {
	t.Parallel()
	b := setup(t)
	h := &recorder{}

	cases := []struct {
		name  string
		cfg   outbox.RelayConfig
		field string
	}{
		{"NegativeBatchSize", outbox.RelayConfig{BatchSize: -1}, "BatchSize"},
		{"HugeBatchSize", outbox.RelayConfig{BatchSize: outbox.BatchSizeMax + 1}, "BatchSize"},
		{"NegativeLease", outbox.RelayConfig{LeaseDuration: -time.Second}, "LeaseDuration"},
		{"TinyLease", outbox.RelayConfig{LeaseDuration: time.Microsecond}, "LeaseDuration"},
		// The claim runs within the lease: shorter than a claim, no batch
		// could ever be delivered.
		{"LeaseShorterThanAClaim", outbox.RelayConfig{LeaseDuration: 99 * time.Millisecond, BatchSize: 1}, "LeaseDuration"},
		{"LeaseShorterThanALargeClaim", outbox.RelayConfig{LeaseDuration: 199 * time.Millisecond, BatchSize: outbox.BatchSizeMax}, "LeaseDuration"},
		{"NegativePoll", outbox.RelayConfig{PollInterval: -1}, "PollInterval"},
		{"NegativeMaxAttempts", outbox.RelayConfig{MaxAttempts: -3}, "MaxAttempts"},
		{"BackoffMaxBelowMin", outbox.RelayConfig{RetryBackoffMin: time.Minute, RetryBackoffMax: time.Second}, "RetryBackoffMax"},
		{"NegativeShutdown", outbox.RelayConfig{ShutdownTimeout: -time.Second}, "ShutdownTimeout"},
		{"EmptyStream", outbox.RelayConfig{Streams: []string{"a", ""}}, "Streams"},
		{"LongStream", outbox.RelayConfig{Streams: []string{strings.Repeat("s", outbox.MaxStreamBytes+1)}}, "Streams"},
		{"NegativeListenCheck", outbox.RelayConfig{ListenCheckInterval: -time.Second}, "ListenCheckInterval"},
		{"BadTable", outbox.RelayConfig{Table: "x\x00"}, "Table"},
		{"DerivedTable", outbox.RelayConfig{Table: "x_dead"}, "Table"},
		{"ReservedSchema", outbox.RelayConfig{Schema: "pg_x"}, "Schema"},
		{"NegativeBackoffMin", outbox.RelayConfig{RetryBackoffMin: -time.Second}, "RetryBackoffMin"},
		{"NegativeBackoffMax", outbox.RelayConfig{RetryBackoffMax: -time.Second}, "RetryBackoffMax"},
		{"NegativeReconnectBackoff", outbox.RelayConfig{ReconnectBackoffMax: -time.Second}, "ReconnectBackoffMax"},
		{"NegativeStatsInterval", outbox.RelayConfig{StatsInterval: -time.Second}, "StatsInterval"},
		{"NULInStream", outbox.RelayConfig{Streams: []string{"a\x00b"}}, "Streams"},
		{"InvalidUTF8Stream", outbox.RelayConfig{Streams: []string{"\xff"}}, "Streams"},
		// A bare integer is nanoseconds: below 1ms the relay would poll,
		// reconnect or ping PostgreSQL in a busy loop.
		{"NanosecondPoll", outbox.RelayConfig{PollInterval: 5}, "PollInterval"},
		{"TinyReconnectBackoff", outbox.RelayConfig{ReconnectBackoffMax: time.Millisecond - 1}, "ReconnectBackoffMax"},
		{"TinyListenCheck", outbox.RelayConfig{ListenCheckInterval: time.Microsecond}, "ListenCheckInterval"},
		{"TinyStatsInterval", outbox.RelayConfig{StatsInterval: 10}, "StatsInterval"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := outbox.NewRelay(b.pool, h, &tc.cfg)
			require.ErrorIs(t, err, outbox.ErrInvalidConfig)
			var cfgErr *outbox.ConfigError
			require.ErrorAs(t, err, &cfgErr)
			require.Equal(t, tc.field, cfgErr.Field)
		})
	}

	// Each bound is inclusive, as the fields' docs say.
	t.Run("BoundsAreInclusive", func(t *testing.T) {
		t.Parallel()
		for name, cfg := range map[string]outbox.RelayConfig{
			"BatchSizeMax":           {BatchSize: outbox.BatchSizeMax, LeaseDuration: time.Minute},
			"BatchSizeOne":           {BatchSize: 1},
			"BackoffMaxEqualsMin":    {RetryBackoffMin: time.Second, RetryBackoffMax: time.Second},
			"OneAttempt":             {MaxAttempts: 1},
			"StreamOfMaxStreamBytes": {Streams: []string{strings.Repeat("s", outbox.MaxStreamBytes)}},
			"MillisecondIntervals":   {PollInterval: time.Millisecond, ReconnectBackoffMax: time.Millisecond, ListenCheckInterval: time.Millisecond, StatsInterval: time.Millisecond},
		} {
			cfg.Schema, cfg.Table = b.cfg.Schema, b.cfg.Table
			_, err := outbox.NewRelay(b.pool, h, &cfg)
			require.NoError(t, err, name)
		}
	})

	// WithDefaults copies Streams: a caller reusing its slice after
	// NewRelay, or editing Config().Streams, changes nothing the relay
	// serves.
	t.Run("KeepsItsOwnStreams", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		h := &recorder{}
		streams := []string{"scores"}
		r, err := outbox.NewRelay(b.pool, h, &outbox.RelayConfig{Schema: b.cfg.Schema, Table: b.cfg.Table, Streams: streams})
		require.NoError(t, err)
		streams[0] = "other"
		r.Config().Streams[0] = "other"
		b.appendCommitted(t, newMessage("scores", "ada", 1))
		n, err := r.RunOnce(context.Background())
		require.NoError(t, err)
		require.Equal(t, 1, n, "the relay serves the stream it was made with")
		require.Len(t, h.seen(), 1)
		require.Equal(t, "scores", h.seen()[0].Stream)
	})

	t.Run("MissingDependencies", func(t *testing.T) {
		t.Parallel()
		_, err := outbox.NewRelay(nil, h, nil)
		require.ErrorIs(t, err, outbox.ErrInvalidConfig)
		_, err = outbox.NewRelay(b.pool, nil, nil)
		require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	})

	t.Run("Defaults", func(t *testing.T) {
		t.Parallel()
		r, err := outbox.NewRelay(b.pool, h, nil)
		require.NoError(t, err)
		got := r.Config()
		require.Equal(t, outbox.SchemaDefault, got.Schema)
		require.Equal(t, outbox.TableDefault, got.Table)
		require.Equal(t, outbox.BatchSizeDefault, got.BatchSize)
		require.Equal(t, outbox.LeaseDurationDefault, got.LeaseDuration)
		require.Equal(t, outbox.PollIntervalDefault, got.PollInterval)
		require.Equal(t, outbox.MaxAttemptsDefault, got.MaxAttempts)
		require.Equal(t, outbox.RetryBackoffMinDefault, got.RetryBackoffMin)
		require.Equal(t, outbox.RetryBackoffMaxDefault, got.RetryBackoffMax)
		require.Equal(t, outbox.ShutdownTimeoutDefault, got.ShutdownTimeout)
		require.Equal(t, outbox.ReconnectBackoffMaxDefault, got.ReconnectBackoffMax)
		require.Equal(t, outbox.ListenCheckIntervalDefault, got.ListenCheckInterval)
		require.Equal(t, outbox.StatsIntervalDefault, got.StatsInterval)
		require.NotEmpty(t, got.Name)
		require.NotNil(t, got.Logger)
	})
}

// claimClock is a pgx tracer that notes when the last claim batch (the one
// that starts with the claim's advisory lock) was sent.
type claimClock struct {
	mu   sync.Mutex
	last time.Time
}

func (c *claimClock) sent() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.last
}

func (c *claimClock) TraceBatchStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchStartData) context.Context {
	if qs := data.Batch.QueuedQueries; len(qs) > 0 && strings.Contains(qs[0].SQL, "pg_advisory_xact_lock") {
		c.mu.Lock()
		c.last = time.Now()
		c.mu.Unlock()
	}
	return ctx
}

func (c *claimClock) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (c *claimClock) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func (c *claimClock) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (c *claimClock) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// expireLeases ends every live partition lease now, by the database's
// clock, as if its LeaseDuration had passed; the lease rows keep their owner
// and in-flight ids, like a lease that ran out. It returns how many leases
// it ended.
func (b *testBundle) expireLeases(t *testing.T) int64 {
	t.Helper()
	tag, err := b.pool.Exec(context.Background(), `UPDATE `+b.leasesTable()+
		` SET leased_until = now() WHERE leased_until > now()`)
	require.NoError(t, err)
	return tag.RowsAffected()
}

// requireLeasesFree asserts that no partition is leased or lists ids in
// flight: every batch so far was settled and its partitions released.
func (b *testBundle) requireLeasesFree(t *testing.T) {
	t.Helper()
	var held int
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+b.leasesTable()+
		` WHERE owner IS NOT NULL OR leased_until IS NOT NULL OR NOT isempty(inflight)`).Scan(&held))
	require.Zero(t, held, "every partition lease is released")
}

// leasesTable is the quoted name of the bundle's partition lease table.
func (b *testBundle) leasesTable() string {
	return pgx.Identifier{b.cfg.Schema, outbox.TableDefault + "_leases"}.Sanitize()
}

// syncBuffer is a bytes.Buffer safe for the relay's concurrent logging.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// panickingError's Error dereferences its receiver: a nil *panickingError
// in an error interface panics when printed.
type panickingError struct{ msg string }

func (e *panickingError) Error() string { return e.msg }

// The LISTEN connection runs the pool's BeforeClose after its AfterConnect,
// as pgxpool does: a pool whose hooks pair up per connection (register in
// AfterConnect, unregister in BeforeClose) is left with no registration
// once the relay and the pool are closed. A connection whose AfterConnect
// failed registered nothing, and is not passed to BeforeClose either.
func TestListenPairsAfterConnectWithBeforeClose(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	cfg, err := pgxpool.ParseConfig(b.pg.ConnString)
	require.NoError(t, err)
	var open atomic.Int64
	var refuse atomic.Bool // the next connection's AfterConnect fails: BeforeClose is not its pair
	cfg.AfterConnect = func(context.Context, *pgx.Conn) error {
		if refuse.CompareAndSwap(true, false) {
			return errors.New("session setup refused")
		}
		open.Add(1)
		return nil
	}
	cfg.BeforeClose = func(*pgx.Conn) { open.Add(-1) }
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	c, err := pool.Acquire(ctx) // the claims' connection, opened before the refusal
	require.NoError(t, err)
	c.Release()
	refuse.Store(true)
	r := b.relay(t, pool, &recorder{}, outbox.RelayConfig{PollInterval: time.Hour, ReconnectBackoffMax: 100 * time.Millisecond})
	stop := startRun(t, r)
	waitListening(t, b)
	require.False(t, refuse.Load(), "a connection's AfterConnect was refused")
	require.NoError(t, stop())
	pool.Close()
	require.Zero(t, open.Load(), "AfterConnect and BeforeClose do not pair up: positive, connections never passed to BeforeClose; negative, refused ones passed to it")
}

// runOnceAsync runs r.RunOnce in a goroutine and returns the channel its
// error arrives on.
func runOnceAsync(ctx context.Context, r *outbox.Relay) chan error {
	done := make(chan error, 1)
	go func() {
		_, err := r.RunOnce(ctx)
		done <- err
	}()
	return done
}

// expiring is a RunOnce caller's context whose deadline the test passes
// when it chooses (expire): its Err is then context.DeadlineExceeded, so
// the claim before it never races a timer.
type expiring struct {
	context.Context
	done chan struct{}
	once sync.Once
}

func newExpiring() *expiring {
	return &expiring{Context: context.Background(), done: make(chan struct{})}
}

func (e *expiring) expire()               { e.once.Do(func() { close(e.done) }) }
func (e *expiring) Done() <-chan struct{} { return e.done }

func (e *expiring) Err() error {
	select {
	case <-e.done:
		return context.DeadlineExceeded
	default:
		return nil
	}
}

// TestRelayClaimsUpToBatchSize: a claim takes whatever is due up to
// BatchSize, also above the 1,024 rows four partitions hold on a backlog of
// one run per partition, and also when the backlog's ids do not start at a
// run's boundary (as after any earlier traffic: BatchSize consecutive ids
// then span one partition more). At 1,024 or less a claim keeps four
// partitions (the package doc says what that costs).
func TestRelayClaimsUpToBatchSize(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, tc := range []struct {
		size  int
		start int64 // the id sequence's last value before the backlog
	}{{2000, 0}, {outbox.BatchSizeMax, 0}, {2000, 128}, {4096, 128}} {
		t.Run(fmt.Sprintf("%dFrom%d", tc.size, tc.start+1), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			if tc.start > 0 {
				_, err := b.pool.Exec(ctx, `SELECT setval(pg_get_serial_sequence($1, 'id'), $2)`, b.writer.Table(), tc.start)
				require.NoError(t, err)
			}
			msgs := make([]outbox.Message, tc.size)
			for i := range msgs {
				msgs[i] = newMessage("s", fmt.Sprintf("k%d", i), 1)
			}
			b.appendCommitted(t, msgs...)
			ok := outbox.HandlerFunc(func(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
				return make([]outbox.Result, len(batch)), nil
			})
			r := b.relay(t, nil, ok, outbox.RelayConfig{BatchSize: tc.size})
			got, err := r.RunOnce(ctx)
			require.NoError(t, err)
			require.Equal(t, tc.size, got, "one claim of BatchSize %d with %d rows due", tc.size, tc.size)
		})
	}
}

// TestRelayDrainsIdsWithGaps: on ids with gaps (rolled-back inserts, a
// sequence cache) a claim of four partitions gets few rows, but a RunOnce
// loop still hands out every row exactly once and empties the outbox.
func TestRelayDrainsIdsWithGaps(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, gap := range map[string]int64{"Sparse": 40, "VerySparse": 200} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			want := make(map[uuid.UUID]bool)
			for i := range 300 {
				// Each row after a jump of 1 to gap ids, starting unaligned.
				_, err := b.pool.Exec(ctx, `SELECT setval(pg_get_serial_sequence($1, 'id'), $2)`,
					b.writer.Table(), 77+int64(i)*gap+int64(i*7)%gap)
				require.NoError(t, err)
				msg := newMessage("s", fmt.Sprintf("k%d", i), 1)
				want[msg.EventID] = true
				b.appendCommitted(t, msg)
			}
			h := &recorder{}
			r := b.relay(t, nil, h, outbox.RelayConfig{DisableNotify: true})
			for claims := 0; ; claims++ {
				require.Less(t, claims, 300, "every claim hands out at least one row while rows are due")
				n, err := r.RunOnce(ctx)
				require.NoError(t, err)
				if n == 0 {
					break
				}
			}
			delivered := make(map[uuid.UUID]int)
			for _, rec := range h.seen() {
				delivered[rec.EventID]++
			}
			require.Len(t, delivered, len(want))
			for id := range want {
				require.Equal(t, 1, delivered[id], "row %s", id)
			}
			require.Zero(t, b.count(t, b.writer.Table()))
		})
	}
}

// "Retrying counts rows waiting out a retry backoff": a failed row is
// retrying until its backoff passes, then due again, and no longer counted.
func TestRelayStatsRetrying(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	b.appendCommitted(t, newMessage("s", "a", 1))
	r := b.relay(t, nil, &recorder{fail: func(outbox.Record) error { return errors.New("no") }}, outbox.RelayConfig{MaxAttempts: 3})
	n, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	st, err := r.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, st.Retrying)
	b.makeDue(t)
	st, err = r.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, st.Pending)
	require.Zero(t, st.Retrying, "a row whose backoff has passed is due, not retrying")
}
