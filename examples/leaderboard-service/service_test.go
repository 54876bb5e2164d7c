package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
	"github.com/verity-go/verity/outbox"
	"github.com/verity-go/verity/reconcile"
)

// TestSnapshotSingleFlight stalls the stats read and checks that callers
// share it, that a caller's deadline ends its wait (not the read), and that
// a failed read is reused for statsTTL like a good one.
func TestSnapshotSingleFlight(t *testing.T) {
	t.Parallel()
	svc := setup(t).svc
	stalled := errors.New("postgres stalled")
	var reads atomic.Int32
	started := make(chan struct{}, 1)
	release := make(chan struct{})
	var releaseOnce sync.Once
	unblock := func() { releaseOnce.Do(func() { close(release) }) }
	t.Cleanup(unblock)
	svc.readStats = func(ctx context.Context) *statsSnapshot {
		reads.Add(1)
		select {
		case started <- struct{}{}:
		default:
		}
		select {
		case <-release:
		case <-ctx.Done():
		}
		return &statsSnapshot{At: time.Now(), Err: stalled}
	}
	background := func() <-chan *statsSnapshot {
		ch := make(chan *statsSnapshot, 1)
		go func() { ch <- svc.snapshot(context.Background()) }()
		return ch
	}

	first := background()
	select {
	case <-started:
	case <-time.After(5 * time.Second):
		t.Fatal("the stats read did not start")
	}

	// A caller with a deadline gives up at it while the read goes on.
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	impatient := make(chan *statsSnapshot, 1)
	go func() { impatient <- svc.snapshot(ctx) }()
	select {
	case snap := <-impatient:
		require.ErrorIs(t, snap.Err, context.DeadlineExceeded)
	case <-time.After(2 * time.Second):
		unblock()
		t.Fatal("a caller waited for the stats read past its own deadline")
	}

	second := background()
	unblock()
	for _, ch := range []<-chan *statsSnapshot{first, second} {
		require.ErrorIs(t, (<-ch).Err, stalled)
	}
	require.Equal(t, int32(1), reads.Load(), "concurrent callers must share one read")

	// The failure is reused: a failing PostgreSQL is not asked again at once.
	require.ErrorIs(t, svc.snapshot(context.Background()).Err, stalled)
	require.Equal(t, int32(1), reads.Load(), "a failed read must be cached for statsTTL")

	// ... but only for statsTTL.
	require.Eventually(t, func() bool {
		svc.snapshot(context.Background())
		return reads.Load() == 2
	}, 5*statsTTL, statsTTL/10)
}

// TestStopStatsReads checks what Run relies on at shutdown: once
// stopStatsReads returns, no stats read runs, also one started for a caller
// that stopped waiting before the read's goroutine was scheduled, and none
// starts afterwards.
func TestStopStatsReads(t *testing.T) {
	t.Parallel()
	svc := setup(t).svc
	var started, running atomic.Int64
	svc.readStats = func(ctx context.Context) *statsSnapshot {
		started.Add(1)
		running.Add(1)
		defer running.Add(-1)
		<-ctx.Done() // a stalled PostgreSQL
		return &statsSnapshot{At: time.Now(), Err: ctx.Err()}
	}
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	snap := svc.snapshot(gone) // a request whose client already left
	require.ErrorIs(t, snap.Err, context.Canceled)

	svc.stopStatsReads()
	require.Zero(t, running.Load(), "a stats read runs after stopStatsReads returned")
	require.LessOrEqual(t, started.Load(), int64(1))

	before := started.Load()
	snap = svc.snapshot(context.Background())
	require.ErrorIs(t, snap.Err, errServiceStopped)
	require.Equal(t, before, started.Load(), "a stats read started after stopStatsReads")
}

// TestSnapshotPanic makes the stats read panic: a panic on the read's own
// goroutine would kill the process; /stats must answer 500 instead, and work again once the read
// does.
func TestSnapshotPanic(t *testing.T) {
	t.Parallel()
	var logs lockedBuffer
	tb := setup(t).withService(t, ServiceConfig{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	read := tb.svc.readStats
	var panicking atomic.Bool
	panicking.Store(true)
	tb.svc.readStats = func(ctx context.Context) *statsSnapshot {
		if panicking.Load() {
			panic("stats read exploded")
		}
		return read(ctx)
	}

	res := tb.do(t, http.MethodGet, "/stats", nil, "")
	require.Equal(t, http.StatusInternalServerError, res.status, "%s", res.body)
	require.Equal(t, "internal error", res.json(t)["error"])
	require.Contains(t, logs.String(), "stats read panicked")
	require.Contains(t, logs.String(), "stats read exploded")

	panicking.Store(false)
	require.Eventually(t, func() bool {
		return tb.do(t, http.MethodGet, "/stats", nil, "").status == http.StatusOK
	}, 5*statsTTL, statsTTL/10, "/stats answers again once the read works")
}

// TestStatsDuringPostgresStall stalls the real stats query behind a table
// lock: /stats answers at the request deadline instead of queueing behind
// the read, and the concurrent requests cost one query between them.
func TestStatsDuringPostgresStall(t *testing.T) {
	t.Parallel()
	const timeout = 300 * time.Millisecond
	tb := setup(t).withService(t, ServiceConfig{RequestTimeout: timeout})
	release := tb.lockOutbox(t)

	const n = 4
	var wg sync.WaitGroup
	results := make([]response, n)
	took := make([]time.Duration, n)
	for i := range n {
		wg.Go(func() { results[i], took[i] = tb.doWithin(t, 10*time.Second, http.MethodGet, "/stats", nil, "") })
	}
	wg.Wait()
	for i := range n {
		require.Equal(t, http.StatusServiceUnavailable, results[i].status, "%s", results[i].body)
		require.Less(t, took[i], timeout+2*time.Second, "a /stats request queued behind the stalled read")
	}
	require.Equal(t, 1, tb.lockWaiters(t, "verity_outbox"), "the stalled requests must share one stats query")

	// Once PostgreSQL answers again, so does /stats.
	release()
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		res := tb.do(t, http.MethodGet, "/stats", nil, "")
		assert.Equal(c, http.StatusOK, res.status, "%s", res.body)
	}, 10*time.Second, 50*time.Millisecond)
}

// TestRequestTimeout stalls a submit behind a table lock: the handler's
// context ends at RequestTimeout and the client gets a 503 it can retry.
func TestRequestTimeout(t *testing.T) {
	t.Parallel()

	t.Run("Stall", func(t *testing.T) {
		t.Parallel()
		const timeout = 300 * time.Millisecond
		var logs lockedBuffer
		tb := setup(t).withService(t, ServiceConfig{RequestTimeout: timeout,
			Logger: slog.New(slog.NewTextHandler(&logs, nil))})
		release := tb.lockOutbox(t)

		key := uuid.NewString()
		h := map[string]string{"Content-Type": "application/json", "Idempotency-Key": key}
		res, took := tb.doWithin(t, 10*time.Second, http.MethodPost, "/scores", h, `{"user_id":"ada","delta":1}`)
		require.Equal(t, http.StatusServiceUnavailable, res.status, "%s", res.body)
		require.Equal(t, submitTimedOut, res.json(t)["error"])
		require.Equal(t, "1", res.header.Get("Retry-After"))
		require.GreaterOrEqual(t, took, timeout)
		require.Less(t, took, timeout+2*time.Second)
		require.Contains(t, logs.String(), "request timed out")

		// The retry the answer asks for works once PostgreSQL does.
		release()
		res = tb.submit(t, key, `{"user_id":"ada","delta":1}`)
		require.Contains(t, []int{http.StatusCreated, http.StatusOK}, res.status, "%s", res.body)
		require.EqualValues(t, 1, res.json(t)["score"])
	})

	// Under FailClosed a read cut short by the deadline can fail as stale:
	// it is still the request's timeout, answered and logged as one.
	t.Run("StaleAfterDeadline", func(t *testing.T) {
		t.Parallel()
		const timeout = 50 * time.Millisecond
		var logs lockedBuffer
		tb := setup(t).withService(t, ServiceConfig{RequestTimeout: timeout,
			Logger: slog.New(slog.NewTextHandler(&logs, nil))})
		svc := tb.svc
		h := svc.withTimeout(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			<-r.Context().Done()
			svc.writeError(w, r, &leaderboard.StaleError{Lag: -1, MaxLag: time.Millisecond})
		}))
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequestWithContext(t.Context(), http.MethodGet, "/leaderboard", nil))
		require.Equal(t, http.StatusServiceUnavailable, rec.Code, "%s", rec.Body)
		require.Equal(t, "1", rec.Header().Get("Retry-After"))
		require.Equal(t, "the request took too long; retry shortly", response{body: rec.Body.Bytes()}.json(t)["error"])
		require.Contains(t, logs.String(), "request timed out")

		// Without the deadline, the same error is staleness.
		rec = httptest.NewRecorder()
		svc.writeError(rec, httptest.NewRequestWithContext(t.Context(), http.MethodGet, "/leaderboard", nil),
			&leaderboard.StaleError{Lag: -1, MaxLag: time.Millisecond})
		require.Equal(t, http.StatusServiceUnavailable, rec.Code)
		require.Equal(t, "the leaderboard is catching up; retry shortly", response{body: rec.Body.Bytes()}.json(t)["error"])
	})

	// A submit whose connection to PostgreSQL broke after it was sent may
	// have been applied: a 503 asking for a retry with the same key, not
	// a 500.
	t.Run("OutcomeUnknown", func(t *testing.T) {
		t.Parallel()
		var logs lockedBuffer
		tb := setup(t).withService(t, ServiceConfig{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
		rec := httptest.NewRecorder()
		tb.svc.writeError(rec, httptest.NewRequestWithContext(t.Context(), http.MethodPost, "/scores", nil),
			fmt.Errorf("%w: %w", leaderboard.ErrOutcomeUnknown, io.ErrUnexpectedEOF))
		require.Equal(t, http.StatusServiceUnavailable, rec.Code, "%s", rec.Body)
		require.Equal(t, "1", rec.Header().Get("Retry-After"))
		require.Contains(t, response{body: rec.Body.Bytes()}.json(t)["error"], "retry with the same Idempotency-Key")
		require.Contains(t, logs.String(), "submit outcome unknown")
	})

	// A submit whose body has not arrived by the deadline is cut off like
	// any other request, not left to the server's longer ReadTimeout.
	t.Run("SlowBody", func(t *testing.T) {
		t.Parallel()
		const timeout = 300 * time.Millisecond
		tb := setup(t).withService(t, ServiceConfig{RequestTimeout: timeout})
		conn, err := net.Dial("tcp", tb.srv.Listener.Addr().String())
		require.NoError(t, err)
		defer conn.Close()
		body := `{"user_id":"ada","delta":1}`
		_, err = fmt.Fprintf(conn, "POST /scores HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nIdempotency-Key: %s\r\nContent-Length: %d\r\n\r\n%s",
			uuid.NewString(), len(body), body[:10]) // the rest never comes
		require.NoError(t, err)
		start := time.Now()
		require.NoError(t, conn.SetReadDeadline(time.Now().Add(5*time.Second)))
		res, err := http.ReadResponse(bufio.NewReader(conn), nil)
		require.NoError(t, err, "no answer")
		defer res.Body.Close()
		require.Equal(t, http.StatusServiceUnavailable, res.StatusCode)
		require.Equal(t, "1", res.Header.Get("Retry-After"))
		require.Less(t, time.Since(start), timeout+2*time.Second)
		var events int
		require.NoError(t, tb.pg.Pool.QueryRow(context.Background(), `SELECT count(*) FROM score_events`).Scan(&events))
		require.Zero(t, events, "nothing was written")
	})

	t.Run("Default", func(t *testing.T) {
		t.Parallel()
		svc := setup(t).svc
		require.Equal(t, RequestTimeoutDefault, svc.cfg.RequestTimeout)
	})

	t.Run("Negative", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		_, err := NewService(tb.pg.Pool, tb.rd.Client, tb.board, ServiceConfig{RequestTimeout: -time.Second})
		require.ErrorContains(t, err, "RequestTimeout")
	})
}

// TestCloseClosesOwnBoard checks that Close closes the board NewService
// built (a closed board's submits send no NOTIFY) and never a board that
// the caller passed in and still owns.
func TestCloseClosesOwnBoard(t *testing.T) {
	t.Parallel()

	t.Run("Built", func(t *testing.T) {
		t.Parallel()
		board, listen := closeFixture(t, nil)
		svc, err := NewService(board.pool, board.rdb, board.Board, ServiceConfig{})
		require.NoError(t, err)
		require.NotSame(t, board.Board, svc.board, "without a MeterProvider NewService builds an instrumented board")

		require.NoError(t, svc.Close())
		listen.submit(t, svc.board)
		require.False(t, listen.notified(500*time.Millisecond), "the service's board still wakes the relays after Close")
		listen.submit(t, board.Board)
		require.True(t, listen.notified(5*time.Second), "Close must not close the caller's board")
	})

	t.Run("Given", func(t *testing.T) {
		t.Parallel()
		// A board with a MeterProvider is used as given, so it stays the
		// caller's to close.
		board, listen := closeFixture(t, func(c *leaderboard.Config) { c.MeterProvider = noop.NewMeterProvider() })
		svc, err := NewService(board.pool, board.rdb, board.Board, ServiceConfig{})
		require.NoError(t, err)
		require.Same(t, board.Board, svc.board)

		require.NoError(t, svc.Close())
		listen.submit(t, board.Board)
		require.True(t, listen.notified(5*time.Second), "Close must not close the caller's board")
	})
}

type closeBoard struct {
	*leaderboard.Board
	pool *pgxpool.Pool
	rdb  redis.UniversalClient
}

// notifyListener is a connection LISTENing on a board's outbox channel.
type notifyListener struct{ conn *pgx.Conn }

func (l notifyListener) submit(t *testing.T, b *leaderboard.Board) {
	t.Helper()
	_, err := b.Submit(context.Background(), leaderboard.Command{EventID: uuid.New(), UserID: "ada", Delta: 1})
	require.NoError(t, err)
}

func (l notifyListener) notified(within time.Duration) bool {
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	_, err := l.conn.WaitForNotification(ctx)
	return err == nil
}

// closeFixture builds a migrated board (closed at cleanup) and a listener
// on the channel its submits NOTIFY.
func closeFixture(t *testing.T, mutate func(*leaderboard.Config)) (closeBoard, notifyListener) {
	t.Helper()
	pg := testenv.Postgres(t)
	rd := testenv.Redis(t)
	cfg := &leaderboard.Config{Name: testBoard, Schema: pg.Schema, KeyPrefix: rd.Prefix}
	if mutate != nil {
		mutate(cfg)
	}
	ctx := context.Background()
	require.NoError(t, leaderboard.Migrate(ctx, pg.Pool, cfg))
	board, err := leaderboard.New(pg.Pool, rd.Client, cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)

	w, err := outbox.NewWriter(&outbox.Config{Schema: pg.Schema, Table: board.Config().OutboxTable})
	require.NoError(t, err)
	conn, err := pgx.Connect(ctx, pg.ConnString)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	_, err = conn.Exec(ctx, "LISTEN "+pgx.Identifier{w.Channel()}.Sanitize())
	require.NoError(t, err)
	return closeBoard{Board: board, pool: pg.Pool, rdb: rd.Client}, notifyListener{conn: conn}
}

// TestStatsWhateverTheReadPolicy: /stats and the service's gauges report
// the projection's lag and the backlog under every ReadPolicy, also while
// the lag is above MaxLag, when reads fail closed or fall back to
// PostgreSQL (and report a PostgreSQL answer's zero lag).
func TestStatsWhateverTheReadPolicy(t *testing.T) {
	t.Parallel()
	for _, policy := range []leaderboard.ReadPolicy{leaderboard.ServeStale, leaderboard.FailClosed, leaderboard.FallbackToPostgres} {
		t.Run(policy.String(), func(t *testing.T) {
			t.Parallel()
			tb := setup(t, func(c *leaderboard.Config) {
				c.ReadPolicy, c.MaxLag, c.LagProbeInterval = policy, time.Millisecond, 1
			})
			require.Equal(t, http.StatusCreated, tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":5}`).status)
			const waited = 50 * time.Millisecond // well above MaxLag
			time.Sleep(waited)
			require.EventuallyWithT(t, func(c *assert.CollectT) {
				res := tb.do(t, http.MethodGet, "/stats", nil, "")
				if !assert.Equal(c, http.StatusOK, res.status, "%s", res.body) {
					return
				}
				body := res.json(t)
				assert.Equal(c, 1.0, body["pending"])
				fresh := body["freshness"].(map[string]any)
				assert.GreaterOrEqual(c, fresh["lag_ms"], float64(waited/time.Millisecond), "the projection's lag, not a fallback's zero")

				text := string(tb.do(t, http.MethodGet, "/metrics", nil, "").body)
				assert.Regexp(c, `(?m)^verity_service_outbox_pending\{[^}]*\} 1$`, text)
				m := regexp.MustCompile(`(?m)^verity_service_projection_lag_seconds\{[^}]*\} (\S+)$`).FindStringSubmatch(text)
				if assert.Len(c, m, 2, "no lag gauge") {
					lag, err := strconv.ParseFloat(m[1], 64)
					assert.NoError(c, err)
					assert.GreaterOrEqual(c, lag, waited.Seconds())
				}
			}, 10*time.Second, 50*time.Millisecond)
		})
	}
}

// TestReconcileFindingsMetric: the findings counter counts entities that
// were not current, never the current ones, so that alerting on any
// increase stays quiet on healthy runs; and every finding class has its
// series, at 0, before the first finding, so that increase() sees it.
func TestReconcileFindingsMetric(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	// findings returns the class's count in /metrics, "" when it has no series.
	findings := func(class string) string {
		text := string(tb.do(t, http.MethodGet, "/metrics", nil, "").body)
		m := regexp.MustCompile(`(?m)^verity_service_reconcile_findings_total\{[^}]*\bclass="` + class + `"[^}]*\} (\d+)$`).FindStringSubmatch(text)
		if m == nil {
			return ""
		}
		return m[1]
	}
	for _, class := range []string{"missing", "stale", "ahead", "corrupt", "orphan"} {
		require.Equal(t, "0", findings(class), class)
	}
	tb.svc.metrics.recordReconcile(context.Background(), &reconcile.Report{
		Counts: map[reconcile.Class]int64{reconcile.ClassCurrent: 7, reconcile.ClassMissing: 2},
	}, nil)
	require.Equal(t, "2", findings("missing"))
	require.Empty(t, findings("current"))
}

// TestLastReconcileHidesConnectionDetails fails the scheduled reconcile on
// a connection error, which names the host, database and user: like
// /healthz, the unauthenticated /reconcile/last (and the page) must not
// hand those out.
func TestLastReconcileHidesConnectionDetails(t *testing.T) {
	t.Parallel()
	pool, rdb, board, database := boardWithoutDatabase(t)
	svc, err := NewService(pool, rdb, board, ServiceConfig{ReconcileEvery: time.Minute, ReconcileSample: 10})
	require.NoError(t, err)
	t.Cleanup(func() { _ = svc.Close() })
	tb := &testBundle{srv: newServer(t, svc)}

	health := tb.do(t, http.MethodGet, "/healthz", nil, "")
	require.NotContains(t, string(health.body), database)
	svc.reconcileOnce(context.Background())
	last := tb.do(t, http.MethodGet, "/reconcile/last", nil, "")
	require.Equal(t, http.StatusOK, last.status)
	require.NotContains(t, string(last.body), database, "%s", last.body)
	require.Contains(t, string(last.body), "the reconcile run failed; see the service log")
}

// TestScheduledReconcileVerifies runs the scheduled reconcile of a service
// whose board requires a verified projection: while it is unverified (a
// new board, or after a Redis loss), reads refuse and the scheduled run is
// the full, verifying pass instead of a sample; once verified, reads answer
// and the schedule samples again.
func TestScheduledReconcileVerifies(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb, svc, refused := refusedUnverified(t, time.Minute)
	require.Equal(t, "60", refused.header.Get("Retry-After"), "after the next scheduled, verifying reconcile")
	require.Equal(t, "the leaderboard is not verified (a new board, Redis lost its data or cannot be read, or PostgreSQL is not the database last verified against); retry later", refused.json(t)["error"])
	svc.reconcileOnce(ctx)
	last := svc.lastReconcile.Load()
	require.NotNil(t, last.Verified)
	require.True(t, *last.Verified)
	require.False(t, last.Sampled)

	time.Sleep(2 * time.Millisecond)
	res := tb.do(t, http.MethodGet, "/leaderboard", nil, "")
	require.Equal(t, http.StatusOK, res.status, "%s", res.body)
	svc.reconcileOnce(ctx)
	last = svc.lastReconcile.Load()
	require.Nil(t, last.Verified)
	require.True(t, last.Sampled)
}

// TestScheduledVerifyWaitsForAnotherProcesssPass: two service instances
// on one board, each starting a verifying pass whenever the board is
// unverified, replaced each other's pass markers so that neither recorded
// (when a pass took more than half the interval, for as long as their
// schedules kept overlapping). A run that finds another process's marker
// it had not seen skips its pass; one found unchanged a whole interval
// later is a dead process's, and is replaced.
func TestScheduledVerifyWaitsForAnotherProcesssPass(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb, svc, _ := refusedUnverified(t, time.Minute)
	markerKey := tb.board.SortedSetKey() + "~verifying"
	other := func(token string) {
		require.NoError(t, tb.rd.Client.Set(ctx, markerKey, token+" ", 0).Err())
	}
	unverified := func() bool {
		time.Sleep(2 * time.Millisecond) // past the probe interval
		return tb.board.Freshness(ctx).Unverified
	}

	other("pass-of-another-process")
	svc.reconcileOnce(ctx)
	require.Equal(t, "pass-of-another-process ", tb.rd.Client.Get(ctx, markerKey).Val(), "the other pass's marker is left alone")
	require.Nil(t, svc.lastReconcile.Load(), "no run")
	require.True(t, unverified())

	other("a-later-pass") // the other process began another pass meanwhile
	svc.reconcileOnce(ctx)
	require.Equal(t, "a-later-pass ", tb.rd.Client.Get(ctx, markerKey).Val())
	require.True(t, unverified())

	svc.reconcileOnce(ctx) // the same marker a whole interval later: a dead process's
	last := svc.lastReconcile.Load()
	require.NotNil(t, last)
	require.NotNil(t, last.Verified)
	require.True(t, *last.Verified)
	require.False(t, unverified())
}

// refusedUnverified starts a fail-closed service, reconciling every every
// (0: never), whose board requires a verified projection, submits and
// projects a score, and returns its first top-10 read: refused, for no
// full pass has verified the board.
func refusedUnverified(t *testing.T, every time.Duration) (*testBundle, *Service, response) {
	t.Helper()
	tb := setup(t, func(c *leaderboard.Config) {
		c.RequireVerifiedProjection, c.ReadPolicy, c.LagProbeInterval = true, leaderboard.FailClosed, time.Millisecond
	})
	svc, err := NewService(tb.pg.Pool, tb.rd.Client, tb.board, ServiceConfig{ReconcileEvery: every, ReconcileSample: 10})
	require.NoError(t, err)
	t.Cleanup(func() { _ = svc.Close() })
	tb.srv = newServer(t, svc)
	require.Equal(t, http.StatusCreated, tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":5}`).status)
	tb.drain(t)

	time.Sleep(2 * time.Millisecond) // past the probe interval
	refused := tb.do(t, http.MethodGet, "/leaderboard", nil, "")
	require.Equal(t, http.StatusServiceUnavailable, refused.status, "unverified")
	return tb, svc, refused
}

// TestUnverifiedWithoutSchedule: a service that requires a verified
// projection but runs no reconcile of its own cannot say when the board
// will be verified, so its refusals name no Retry-After; they say an
// operator's 'reconcile --verify' is needed; after one, reads answer.
func TestUnverifiedWithoutSchedule(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb, _, refused := refusedUnverified(t, 0)
	require.Empty(t, refused.header.Get("Retry-After"), "nothing here will verify the board")
	require.Contains(t, refused.json(t)["error"], "an operator must run 'reconcile --verify'")

	_, verified, err := tb.board.Verify(ctx, nil)
	require.NoError(t, err)
	require.True(t, verified)
	time.Sleep(2 * time.Millisecond)
	res := tb.do(t, http.MethodGet, "/leaderboard", nil, "")
	require.Equal(t, http.StatusOK, res.status, "%s", res.body)
}

// TestUserNotFoundSaysHowFresh: under serve-stale, a user Redis lost (the
// board unverified) answered a bare 404 "no score", indistinguishable from
// a user who never scored. The 404 now carries the answer's freshness.
func TestUserNotFoundSaysHowFresh(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t, func(c *leaderboard.Config) {
		c.RequireVerifiedProjection, c.ReadPolicy, c.LagProbeInterval = true, leaderboard.ServeStale, time.Millisecond
	})
	require.Equal(t, http.StatusCreated, tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":5}`).status)
	tb.drain(t)
	_, verified, err := tb.board.Verify(ctx, nil)
	require.NoError(t, err)
	require.True(t, verified)
	keys, err := tb.rd.Client.Keys(ctx, tb.rd.Prefix+"*").Result()
	require.NoError(t, err)
	require.NoError(t, tb.rd.Client.Del(ctx, keys...).Err()) // Redis lost the board

	time.Sleep(2 * time.Millisecond) // past the probe interval
	res := tb.do(t, http.MethodGet, "/users/ada/rank", nil, "")
	require.Equal(t, http.StatusNotFound, res.status)
	body := res.json(t)
	require.Equal(t, "user has no score on this leaderboard", body["error"])
	fresh, ok := body["freshness"].(map[string]any)
	require.True(t, ok, "%s", res.body)
	require.Equal(t, "redis", fresh["source"])
	require.Equal(t, true, fresh["unverified"])
	require.Equal(t, -1.0, fresh["lag_ms"])

	// An id no store can hold is not looked up: no freshness to tell.
	res = tb.do(t, http.MethodGet, "/users/a%00b/rank", nil, "")
	require.Equal(t, http.StatusNotFound, res.status)
	require.NotContains(t, res.json(t), "freshness")
}

// TestReconcileScheduleKeepsItsCadence runs the reconcile schedule with a
// first run held up behind a lock: the next run starts one interval after
// the first started, and next_run (what /reconcile/last shows) said so,
// not one interval after the slow run ended.
func TestReconcileScheduleKeepsItsCadence(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	// A run gets its whole interval (its timeout): 3 s leaves a loaded
	// machine room to finish the stalled run within its slot.
	const every, stall = 3 * time.Second, 600 * time.Millisecond
	svc, err := NewService(tb.pg.Pool, tb.rd.Client, tb.board, ServiceConfig{ReconcileEvery: every, ReconcileSample: 10})
	require.NoError(t, err)
	t.Cleanup(func() { _ = svc.Close() })

	lock, err := tb.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = lock.Exec(ctx, `LOCK TABLE `+leaderboard.UserScoresTable+` IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	time.AfterFunc(stall, func() { _ = lock.Rollback(ctx) })

	loopCtx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); svc.reconcileLoop(loopCtx) }()
	t.Cleanup(func() { cancel(); <-done })

	var first *reconcileSummary
	var next time.Time
	require.Eventually(t, func() bool {
		first = svc.lastReconcile.Load()
		if n := svc.nextReconcile.Load(); n != nil {
			next = *n
		}
		return first != nil && !next.IsZero()
	}, 10*time.Second, 5*time.Millisecond)
	require.GreaterOrEqual(t, first.DurationMS, float64(stall/2/time.Millisecond), "the first run waited for the lock")
	require.WithinDuration(t, first.Started.Add(every), next, 200*time.Millisecond, "next_run is one interval after the first run started")

	var second *reconcileSummary
	require.Eventually(t, func() bool {
		second = svc.lastReconcile.Load()
		return second != first
	}, 10*time.Second, 5*time.Millisecond)
	require.False(t, second.Started.Before(next), "the second run started at %s, before next_run %s", second.Started, next)
}
