package outbox

// An internal test: it checks the sending goroutine's lifecycle (running),
// which the exported API deliberately does not show.

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// countingExecer passes statements to a real pool and counts them.
type countingExecer struct {
	db    Execer
	calls atomic.Int64
}

func (c *countingExecer) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	c.calls.Add(1)
	return c.db.Exec(ctx, sql, args...)
}

// gatedExecer holds each statement until release is closed, after saying
// so on entered, then passes it to a real pool.
type gatedExecer struct {
	db      Execer
	entered chan struct{}
	release chan struct{}
}

func (g *gatedExecer) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	select {
	case g.entered <- struct{}{}:
	default:
	}
	<-g.release
	return g.db.Exec(ctx, sql, args...)
}

type notifierBundle struct {
	pool    *pgxpool.Pool
	db      *countingExecer
	channel string
}

func setupNotifier(t *testing.T) *notifierBundle {
	t.Helper()
	pg := testenv.Postgres(t)
	// A channel of this test's own: the schema name is unique per test.
	return &notifierBundle{pool: pg.Pool, db: &countingExecer{db: pg.Pool}, channel: "verity_notifier_" + pg.Schema}
}

// listen opens a dedicated connection LISTENing on the bundle's channel.
func (b *notifierBundle) listen(t *testing.T) *pgx.Conn {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.ConnectConfig(ctx, b.pool.Config().ConnConfig)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	_, err = conn.Exec(ctx, "LISTEN "+pgx.Identifier{b.channel}.Sanitize())
	require.NoError(t, err)
	return conn
}

// sendClock records when each statement was sent, then passes it on.
type sendClock struct {
	db Execer
	mu sync.Mutex
	at []time.Time
}

func (s *sendClock) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	s.mu.Lock()
	s.at = append(s.at, time.Now())
	s.mu.Unlock()
	return s.db.Exec(ctx, sql, args...)
}

// since returns the send times as offsets from start.
func (s *sendClock) since(start time.Time) []time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]time.Duration, len(s.at))
	for i, at := range s.at {
		out[i] = at.Sub(start)
	}
	return out
}

// inBubble runs f in a synctest bubble, with a sendClock on a connection to
// the test's database that is opened and closed inside the bubble. The
// bubble's clock is fake: it moves only when every goroutine in the bubble
// is blocked on the bubble's channels or timers, so a Notifier made in it
// sends at exact instants however loaded the machine is, and time.Sleep in
// f sets the schedule of its calls rather than waiting for anything. The
// NOTIFYs are real: a goroutine waiting for PostgreSQL's reply is not
// blocked in that sense, so the clock does not move while a send is under
// way.
func (b *notifierBundle) inBubble(t *testing.T, f func(t *testing.T, db *sendClock)) {
	t.Helper()
	synctest.Test(t, func(t *testing.T) {
		conn, err := pgx.ConnectConfig(context.Background(), b.pool.Config().ConnConfig)
		require.NoError(t, err)
		defer func() { _ = conn.Close(context.Background()) }()
		f(t, &sendClock{db: conn})
	})
}

// received reads want notifications from conn, failing if one is missing.
func received(t *testing.T, conn *pgx.Conn, want int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for i := range want {
		_, err := conn.WaitForNotification(ctx)
		require.NoError(t, err, "notification %d of %d", i+1, want)
	}
}

func (n *Notifier) isRunning() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.running
}

func TestNotifier(t *testing.T) {
	t.Parallel()

	t.Run("WakesListener", func(t *testing.T) {
		t.Parallel()
		b := setupNotifier(t)
		conn := b.listen(t)
		n, err := NewNotifier(b.db, b.channel, nil)
		require.NoError(t, err)
		defer n.Close()

		n.Notify()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		got, err := conn.WaitForNotification(ctx)
		require.NoError(t, err)
		require.Equal(t, b.channel, got.Channel)
		require.Empty(t, got.Payload)
	})

	// With Stream set, the payload says which relays the rows are for
	// (see Relay.serves); the longest stream allowed fits pg_notify's.
	t.Run("SendsStreamAsPayload", func(t *testing.T) {
		t.Parallel()
		b := setupNotifier(t)
		conn := b.listen(t)
		for _, stream := range []string{"leaderboard:weekly", strings.Repeat("é", MaxStreamBytes/2)} {
			n, err := NewNotifier(b.db, b.channel, &NotifierConfig{Stream: stream})
			require.NoError(t, err)
			n.Notify()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			got, err := conn.WaitForNotification(ctx)
			cancel()
			require.NoError(t, err)
			require.Equal(t, stream, got.Payload)
			n.Close()
		}
	})

	// Bursts of Notify calls from eight goroutines every 0.3 Interval, on
	// the bubble's fake clock (see inBubble): the first burst's NOTIFY
	// goes at once, the others are coalesced into one at each Interval,
	// and Close flushes the one the last bursts owe.
	t.Run("CoalescesPerInterval", func(t *testing.T) {
		t.Parallel()
		b := setupNotifier(t)
		conn := b.listen(t)
		const interval = time.Minute
		var sent []time.Duration
		b.inBubble(t, func(t *testing.T, db *sendClock) {
			n, err := NewNotifier(db, b.channel, &NotifierConfig{Interval: interval})
			require.NoError(t, err)
			defer n.Close()
			start := time.Now()
			for burst := range 10 { // at 0, 0.3, ..., 2.7 Intervals
				if burst > 0 {
					time.Sleep(interval * 3 / 10)
				}
				var wg sync.WaitGroup
				for range 8 {
					wg.Go(func() {
						for range 100 {
							n.Notify()
						}
					})
				}
				wg.Wait()
			}
			n.Close() // sends what the last bursts owe
			sent = db.since(start)
		})
		require.Equal(t, "[0s 1m0s 2m0s 2m42s]", fmt.Sprint(sent),
			"8000 calls to Notify: one NOTIFY at once, one per Interval after it, one flushed by Close")
		received(t, conn, len(sent))
	})

	t.Run("IdleGoroutineExitsAndRestarts", func(t *testing.T) {
		t.Parallel()
		b := setupNotifier(t)
		conn := b.listen(t)
		n, err := NewNotifier(b.db, b.channel, &NotifierConfig{IdleTimeout: 20 * time.Millisecond})
		require.NoError(t, err)
		// Never closed: it must not need to be.

		n.Notify()
		require.Eventually(t, func() bool { return !n.isRunning() }, 10*time.Second, 5*time.Millisecond)
		require.Equal(t, int64(1), b.db.calls.Load())

		// A Notify after the goroutine exited starts a new one and is sent.
		n.Notify()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		for range 2 { // both notifications arrive (PostgreSQL does not fold separate transactions)
			_, err := conn.WaitForNotification(ctx)
			require.NoError(t, err)
		}
		require.Eventually(t, func() bool { return !n.isRunning() }, 10*time.Second, 5*time.Millisecond)
		require.Equal(t, int64(2), b.db.calls.Load())
	})

	// Interval bounds the rate of NOTIFYs also when the sending goroutine
	// exits idle between two calls and a new one starts. On the bubble's
	// fake clock (see inBubble), the second NOTIFY goes exactly one
	// Interval after the first.
	t.Run("IntervalHoldsAcrossIdleRestart", func(t *testing.T) {
		t.Parallel()
		b := setupNotifier(t)
		conn := b.listen(t)
		const interval = time.Minute
		var sent []time.Duration
		b.inBubble(t, func(t *testing.T, db *sendClock) {
			n, err := NewNotifier(db, b.channel, &NotifierConfig{Interval: interval, IdleTimeout: time.Second})
			require.NoError(t, err)
			defer n.Close()
			start := time.Now()
			n.Notify()
			time.Sleep(interval / 2)
			require.False(t, n.isRunning(), "the sending goroutine exits after IdleTimeout")
			n.Notify()
			time.Sleep(interval)
			require.False(t, n.isRunning(), "the restarted goroutine exits after IdleTimeout too")
			sent = db.since(start)
		})
		require.Equal(t, "[0s 1m0s]", fmt.Sprint(sent),
			"a Notify half an Interval after the first NOTIFY, with the goroutine restarted, is sent when the Interval is over")
		received(t, conn, len(sent))
	})

	// The coalescing itself, on a machine of any speed: with an Interval
	// of an hour, a Notify after the first NOTIFY stays owed (whether the
	// goroutine went idle or not) until Close flushes it.
	t.Run("NotifyWithinTheIntervalWaits", func(t *testing.T) {
		t.Parallel()
		b := setupNotifier(t)
		n, err := NewNotifier(b.db, b.channel, &NotifierConfig{Interval: time.Hour, IdleTimeout: 5 * time.Millisecond})
		require.NoError(t, err)
		n.Notify()
		require.Eventually(t, func() bool { return b.db.calls.Load() == 1 && !n.isRunning() }, 10*time.Second, time.Millisecond)
		n.Notify()
		n.Notify()
		require.Never(t, func() bool { return b.db.calls.Load() > 1 }, 200*time.Millisecond, time.Millisecond,
			"a NOTIFY was sent within the Interval of the first")
		n.Close()
		require.EqualValues(t, 2, b.db.calls.Load(), "Close sends the owed notification, once")
	})

	t.Run("CloseFlushesAndStops", func(t *testing.T) {
		t.Parallel()
		b := setupNotifier(t)
		// A long Interval: the second Notify is owed, not sent, when Close runs.
		n, err := NewNotifier(b.db, b.channel, &NotifierConfig{Interval: time.Hour})
		require.NoError(t, err)
		n.Notify()
		require.Eventually(t, func() bool { return b.db.calls.Load() == 1 }, 10*time.Second, time.Millisecond)
		n.Notify()
		n.Close()
		require.Equal(t, int64(2), b.db.calls.Load(), "Close sends the owed notification")
		require.False(t, n.isRunning())

		n.Notify() // no-op after Close
		n.Close()  // idempotent
		require.False(t, n.isRunning())
		require.Equal(t, int64(2), b.db.calls.Load())
	})

	t.Run("ConcurrentCloseWaitsForTheOwedSend", func(t *testing.T) {
		t.Parallel()
		// A second Close must not return while the first still sends the
		// owed notification: its caller may close the pool next.
		b := setupNotifier(t)
		db := &gatedExecer{db: b.pool, entered: make(chan struct{}, 1), release: make(chan struct{})}
		n, err := NewNotifier(db, b.channel, nil)
		require.NoError(t, err)
		n.dirty.Store(true) // owed, no goroutine started: Close sends it
		first := make(chan struct{})
		go func() { n.Close(); close(first) }()
		<-db.entered
		second := make(chan struct{})
		go func() { n.Close(); close(second) }()
		select {
		case <-second:
			t.Fatal("the second Close returned while the first was still sending")
		case <-time.After(50 * time.Millisecond):
		}
		close(db.release)
		<-first
		<-second
	})

	t.Run("CloseSendsWhatARacingNotifyOwes", func(t *testing.T) {
		t.Parallel()
		// Notify A marks the Notifier dirty and is about to start its
		// goroutine; Notify B sees it dirty and returns; then Close. B
		// returned before Close, so its notification must be sent. (The
		// interleaving is forced by spinning on dirty; it happened in
		// about half of the iterations before Close flushed.)
		b := setupNotifier(t)
		lost := 0
		const iterations = 500
		for i := range iterations {
			db := &countingExecer{db: b.pool}
			n, err := NewNotifier(db, b.channel, &NotifierConfig{Interval: time.Hour, IdleTimeout: time.Millisecond})
			require.NoError(t, err)
			// One NOTIFY sent; the next waits out the Interval, so the
			// next Notify's stays owed until Close.
			n.Notify()
			require.Eventually(t, func() bool { return db.calls.Load() == 1 && !n.isRunning() },
				5*time.Second, 100*time.Microsecond, "the first NOTIFY is sent and the goroutine goes idle")
			var aReturned atomic.Bool
			go func() { n.Notify(); aReturned.Store(true) }() // A
			// Spin, not yield: yielding would let A finish first. The spin
			// also ends when A has returned: if A's notification was sent
			// at once (the Interval did not hold it), dirty may be true
			// only for an instant this loop never sees.
			for !n.dirty.Load() && !aReturned.Load() {
			}
			n.Notify() // B: returns at once, the notification is owed
			// The race this test needs: the Interval holds A's notification,
			// so it is owed, not sent, until Close. Nothing before Close can
			// clear dirty on a correct Notifier.
			if sent, owed := db.calls.Load(), n.dirty.Load(); sent != 1 || !owed {
				n.Close()
				require.Failf(t, "a Notify within the Interval of the first NOTIFY was sent at once: the Interval must hold it until Close",
					"iteration %d: %d NOTIFYs before Close, owed %v", i, sent, owed)
			}
			n.Close()
			if db.calls.Load() == 1 {
				lost++
			}
		}
		require.Zero(t, lost, "Close returned without sending an owed notification (%d of %d)", lost, iterations)
	})

	t.Run("StaleKickDoesNotHoldTheGoroutine", func(t *testing.T) {
		t.Parallel()
		// Under load the idle timer can fire before the goroutine takes
		// the kick of the Notify that started it: it sends, and then finds
		// that kick with nothing owed. It must go idle, not wait out the
		// Interval (an hour here) for nothing. Staged directly: a kick
		// without a dirty flag.
		b := setupNotifier(t)
		n, err := NewNotifier(b.db, b.channel, &NotifierConfig{Interval: time.Hour, IdleTimeout: time.Millisecond})
		require.NoError(t, err)
		t.Cleanup(n.Close)
		n.mu.Lock()
		n.lastSent = time.Now()
		n.running = true
		n.wg.Add(1)
		n.mu.Unlock()
		n.kick <- struct{}{}
		go n.run()
		require.Eventually(t, func() bool { return !n.isRunning() }, 5*time.Second, time.Millisecond)
		require.Zero(t, b.db.calls.Load(), "nothing was owed")
	})

	// failing returns an Execer whose every call fails: a closed pool.
	failing := func(t *testing.T, b *notifierBundle) *countingExecer {
		closed, err := pgxpool.NewWithConfig(context.Background(), b.pool.Config())
		require.NoError(t, err)
		closed.Close()
		return &countingExecer{db: closed}
	}

	t.Run("FailedNotifyIsNotFatal", func(t *testing.T) {
		t.Parallel()
		b := setupNotifier(t)
		db := failing(t, b)
		n, err := NewNotifier(db, b.channel, &NotifierConfig{IdleTimeout: 10 * time.Millisecond})
		require.NoError(t, err)
		n.Notify()
		require.Eventually(t, func() bool { return db.calls.Load() == 1 && !n.isRunning() }, 10*time.Second, time.Millisecond)
		n.Close()
	})

	// A database that refuses every connection (max_connections reached)
	// fails every NOTIFY; a warning per failure would be a line per commit.
	t.Run("FailedNotifiesLogOnceASecond", func(t *testing.T) {
		t.Parallel()
		b := setupNotifier(t)
		db := failing(t, b)
		var logs testenv.LogSink
		n, err := NewNotifier(db, b.channel, &NotifierConfig{Logger: logs.Logger()})
		require.NoError(t, err)
		for range 50 {
			// Read before Notify: the call may be counted before Notify returns.
			want := db.calls.Load() + 1
			n.Notify()
			require.Eventually(t, func() bool { return db.calls.Load() >= want }, 10*time.Second, time.Millisecond)
		}
		n.Close()
		lines := logs.Lines(t, "outbox notifier: NOTIFY failed; relays will find the rows at their next poll")
		require.NotEmpty(t, lines)
		require.Less(t, len(lines), 5, "50 failed NOTIFYs in well under 4 s")
		var reported int64
		for _, l := range lines {
			reported += 1 + int64(l["suppressed"].(float64))
		}
		// The failures after the last line are counted in the next one, so
		// they go unreported when no line follows.
		require.LessOrEqual(t, reported, db.calls.Load())
		require.Greater(t, reported, int64(0))
	})

	t.Run("Validation", func(t *testing.T) {
		t.Parallel()
		b := setupNotifier(t)
		cases := []struct {
			name    string
			db      Execer
			channel string
			cfg     *NotifierConfig
			field   string
		}{
			{"NilDB", nil, b.channel, nil, "db"},
			{"EmptyChannel", b.db, "", nil, "channel"},
			{"NULInChannel", b.db, "a\x00b", nil, "channel"},
			{"ChannelTooLong", b.db, strings.Repeat("c", 64), nil, "channel"},
			{"NegativeInterval", b.db, b.channel, &NotifierConfig{Interval: -time.Millisecond}, "Interval"},
			{"NegativeIdleTimeout", b.db, b.channel, &NotifierConfig{IdleTimeout: -1}, "IdleTimeout"},
			{"NegativeTimeout", b.db, b.channel, &NotifierConfig{Timeout: -1}, "Timeout"},
			{"StreamTooLong", b.db, b.channel, &NotifierConfig{Stream: strings.Repeat("s", MaxStreamBytes+1)}, "Stream"},
			{"StreamNotUTF8", b.db, b.channel, &NotifierConfig{Stream: "\xff"}, "Stream"},
			{"NULInStream", b.db, b.channel, &NotifierConfig{Stream: "a\x00b"}, "Stream"},
		}
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				t.Parallel()
				_, err := NewNotifier(tc.db, tc.channel, tc.cfg)
				require.ErrorIs(t, err, ErrInvalidConfig)
				var cfgErr *ConfigError
				require.ErrorAs(t, err, &cfgErr)
				require.Equal(t, tc.field, cfgErr.Field)
			})
		}

		// The length limit is PostgreSQL's: 63 bytes notify, 64 fail.
		_, err := NewNotifier(b.db, strings.Repeat("c", 63), nil)
		require.NoError(t, err)
		_, err = b.db.Exec(context.Background(), `SELECT pg_notify($1, '')`, strings.Repeat("c", 63))
		require.NoError(t, err)
		_, err = b.db.Exec(context.Background(), `SELECT pg_notify($1, '')`, strings.Repeat("c", 64))
		require.ErrorContains(t, err, "too long")

		c := (*NotifierConfig)(nil).WithDefaults()
		require.Equal(t, NotifierIntervalDefault, c.Interval)
		require.Equal(t, NotifierIdleTimeoutDefault, c.IdleTimeout)
		require.Equal(t, NotifierTimeoutDefault, c.Timeout)
		require.NotNil(t, c.Logger)
	})
}

// TestNotifierZeroValue: a Notifier not made by NewNotifier (a zero value,
// or nil) has no database to notify through: Notify and Close do nothing.
// The calls run in a child process: a goroutine Notify started on such a
// Notifier would dereference its nil configuration, and that panic takes
// the whole process down, which no test can recover.
func TestNotifierZeroValue(t *testing.T) {
	const child = "VERITY_TEST_ZERO_NOTIFIER"
	if os.Getenv(child) == "1" {
		var zero Notifier
		zero.Notify()
		zero.Notify()
		require.False(t, zero.isRunning(), "no sending goroutine")
		zero.Close()
		zero.Close()
		zero.Notify()
		var none *Notifier
		none.Notify()
		none.Close()
		return // TestMain fails the child if a goroutine is left
	}
	t.Parallel()
	cmd := exec.Command(os.Args[0], "-test.run=^TestNotifierZeroValue$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), child+"=1")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "the child process failed:\n%s", out)
	require.Contains(t, string(out), "--- PASS: TestNotifierZeroValue", "the child ran the calls")
}
