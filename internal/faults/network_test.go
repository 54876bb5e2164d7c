package faults

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/rs/zerolog"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/verity-go/verity/internal/services"
	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
	"github.com/verity-go/verity/outbox"
	"github.com/verity-go/verity/projection"
)

// netProxy is one toxiproxy proxy embedded in the test process. The proxies
// are driven through their Go API rather than toxiproxy's HTTP API: the
// HTTP server cannot be shut down, which would itself leak goroutines.
type netProxy struct {
	proxy  *toxiproxy.Proxy
	mu     sync.Mutex // add may run on a Handler's goroutine
	toxics []string
}

var toxiServer = sync.OnceValue(func() *toxiproxy.ApiServer {
	return toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
})

func startProxy(t *testing.T, name, upstream string) *netProxy {
	t.Helper()
	p := toxiproxy.NewProxy(toxiServer(), name, "127.0.0.1:0", upstream)
	require.NoError(t, p.Start())
	t.Cleanup(p.Stop)
	return &netProxy{proxy: p}
}

func (np *netProxy) addr() string { return np.proxy.Listen }

// add installs a toxic; stream is "upstream" (client → server) or
// "downstream". It is removed, with every other toxic (see heal), when t
// ends: a test that fails before it heals must not leave the fault in place
// for the tests after it.
func (np *netProxy) add(t *testing.T, typ, stream string, attrs map[string]any) {
	t.Helper()
	name := typ + "_" + stream + "_" + services.RandomSuffix(4)
	body, err := json.Marshal(map[string]any{"name": name, "type": typ, "stream": stream, "toxicity": 1.0, "attributes": attrs})
	require.NoError(t, err)
	_, err = np.proxy.Toxics.AddToxicJson(strings.NewReader(string(body)))
	require.NoError(t, err)
	np.mu.Lock()
	np.toxics = append(np.toxics, name)
	np.mu.Unlock()
	t.Cleanup(func() { np.heal(t) })
}

// heal removes every toxic. Healing again removes nothing, so tests heal
// where the scenario needs it and add's cleanup heals whatever is left.
func (np *netProxy) heal(t *testing.T) {
	t.Helper()
	np.mu.Lock()
	toxics := np.toxics
	np.toxics = nil
	np.mu.Unlock()
	for _, name := range toxics {
		if err := np.proxy.Toxics.RemoveToxic(context.Background(), name); err != nil {
			t.Errorf("heal: remove toxic %s: %v", name, err)
		}
	}
}

// partition black-holes the link both ways: bytes are accepted and dropped,
// nothing is answered, connections stay open. Healing (removing the timeout
// toxics) closes the connections they held, as a recovering firewall's RST
// would. A connection that stays dead and is never closed is a different
// fault: see halfopen_test.go.
func (np *netProxy) partition(t *testing.T) {
	t.Helper()
	np.add(t, "timeout", "upstream", map[string]any{"timeout": 0})
	np.add(t, "timeout", "downstream", map[string]any{"timeout": 0})
}

// hostPort returns the host:port of a postgres:// or redis:// URL.
func hostPort(t *testing.T, raw string) string {
	t.Helper()
	u, err := url.Parse(raw)
	require.NoError(t, err)
	return u.Host
}

// withHost returns raw with its host:port replaced and application_name set.
func withHost(t *testing.T, raw, hostport, app string) string {
	t.Helper()
	u, err := url.Parse(raw)
	require.NoError(t, err)
	u.Host = hostport
	q := u.Query()
	q.Set("application_name", app)
	q.Set("connect_timeout", "1")
	u.RawQuery = q.Encode()
	return u.String()
}

// netBundle is a board whose PostgreSQL and Redis connections both go
// through toxiproxy, next to direct connections to the same data.
type netBundle struct {
	*boardBundle               // through the proxies
	direct       *boardBundle  // same board, direct connections
	pgProxy      *netProxy     // between the board and PostgreSQL
	redisProxy   *netProxy     // between the board and Redis
	app          string        // application_name / client name of proxied connections
	pool         *pgxpool.Pool // proxied
	rdb          *redis.Client // proxied
	directRedis  redis.UniversalClient
}

// overrun is how much longer than its own timeout an operation under a fault
// may take to return before the test calls it unbounded. It is generous
// because CI runs every package's tests at once under -race on two cores
// (3.16s was seen for a 1s timeout), and still far short of a hang.
const overrun = 5 * time.Second

// boundedErr checks that op fails within limit, and returns its error.
func boundedErr(t *testing.T, limit time.Duration, op func() error) (time.Duration, error) {
	t.Helper()
	start := time.Now()
	err := op()
	took := time.Since(start)
	require.Error(t, err, "the operation must fail during the fault")
	require.Less(t, took, limit, "the operation must return within a bounded time (err: %v)", err)
	return took, err
}

// typedNetErr reports whether err is an error a caller can classify: a
// deadline, a cancellation or a network error.
func typedNetErr(err error) bool {
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) || errors.As(err, &ne) ||
		strings.Contains(err.Error(), "connection reset") || strings.Contains(err.Error(), "EOF") ||
		strings.Contains(err.Error(), "timeout")
}

// TestNetworkFaults puts toxiproxy between the library and both servers and
// injects latency, a black-holed Redis, PostgreSQL connection resets, a
// slow link that outlives a lease, and a partition that heals. Every
// operation must return within a bounded time with an error, leases must
// expire and rows be re-delivered, the projection must converge, and
// nothing may leak: no goroutine (goleak) and no server connection.
//
// It does not call t.Parallel: goleak compares the goroutines of the whole
// process, which other tests running at the same time would pollute.
func TestNetworkFaults(t *testing.T) {
	// Resolve the shared servers first: their process-lifetime goroutines
	// are not this test's.
	_, err := services.Shared(context.Background())
	if err != nil {
		testenv.Unavailable(t, "services: %v", err)
	}
	ignore := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, ignore, toxiproxyPipes) }) // runs last: after every close below

	ctx := context.Background()
	pg := testenv.Postgres(t)
	rd := testenv.Redis(t)
	app := "verity-faults-net-" + services.RandomSuffix(6)
	nb := &netBundle{app: app, directRedis: rd.Client}
	nb.pgProxy = startProxy(t, "postgres", hostPort(t, pg.ConnString))
	nb.redisProxy = startProxy(t, "redis", hostPort(t, rd.URL))

	pcfg, err := pgxpool.ParseConfig(withHost(t, pg.ConnString, nb.pgProxy.addr(), app))
	require.NoError(t, err)
	pcfg.MaxConns = 4
	nb.pool, err = pgxpool.NewWithConfig(ctx, pcfg)
	require.NoError(t, err)
	nb.rdb = redis.NewClient(&redis.Options{
		Addr: nb.redisProxy.addr(), ClientName: app, PoolSize: 4,
		DialTimeout: 500 * time.Millisecond, ReadTimeout: 500 * time.Millisecond, WriteTimeout: 500 * time.Millisecond,
		MaxRetries: -1,
	})
	closed := false
	closeClients := func() {
		if !closed {
			closed = true
			nb.pool.Close()
			_ = nb.rdb.Close()
		}
	}
	t.Cleanup(closeClients)
	nb.boardBundle = newBoard(t, nb.pool, pg.Schema, nb.rdb, rd.Prefix, "net")
	nb.direct = newBoard(t, pg.Pool, pg.Schema, rd.Client, rd.Prefix, "net")

	submit := func(b *leaderboard.Board, timeout time.Duration) error {
		c, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		_, err := b.Submit(c, leaderboard.Command{EventID: uuid.New(), UserID: "user-" + services.RandomSuffix(1), Delta: 3})
		return err
	}
	figures := map[string]any{}

	t.Run("LatencyStillConverges", func(t *testing.T) {
		nb.pgProxy.add(t, "latency", "downstream", map[string]any{"latency": 20, "jitter": 10})
		nb.redisProxy.add(t, "latency", "downstream", map[string]any{"latency": 20, "jitter": 10})
		defer nb.pgProxy.heal(t)
		defer nb.redisProxy.heal(t)
		for range 20 {
			require.NoError(t, submit(nb.board, 5*time.Second))
		}
		_, err := nb.worker(t, "latency").Drain(ctx)
		require.NoError(t, err)
		nb.direct.requireConverged(t)
	})

	t.Run("RedisBlackholeBoundsReadsAndRelays", func(t *testing.T) {
		require.NoError(t, submit(nb.direct.board, 5*time.Second))
		var maxAttempts atomic.Int64
		projector, err := projection.NewRedisProjector(nb.rdb, nb.board.Mapper(), &projection.Config{Prefix: rd.Prefix})
		require.NoError(t, err)
		counting := outbox.HandlerFunc(func(hctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			for _, r := range batch {
				if int64(r.Attempts) > maxAttempts.Load() {
					maxAttempts.Store(int64(r.Attempts))
				}
			}
			return projector.Handle(hctx, batch)
		})
		cfg := faultRelayConfig("blackhole")
		cfg.Schema, cfg.Streams, cfg.LeaseDuration = pg.Schema, []string{nb.board.Stream()}, time.Second
		relay, err := outbox.NewRelay(nb.pool, counting, cfg)
		require.NoError(t, err)

		nb.redisProxy.partition(t)
		took, err := boundedErr(t, 2*time.Second+overrun, func() error {
			c, cancel := context.WithTimeout(ctx, 2*time.Second)
			defer cancel()
			_, err := nb.board.Top(c, 10)
			return err
		})
		require.True(t, typedNetErr(err), "read error %T: %v", err, err)
		figures["redis_blackhole_read_failed_after"] = took.Round(time.Millisecond)
		start := time.Now()
		n, err := relay.RunOnce(ctx)
		require.NoError(t, err, "a Redis failure is a failed batch, retried later")
		require.Positive(t, n)
		require.Less(t, time.Since(start), cfg.LeaseDuration+overrun, "the relay's batch is bounded by its lease (plus scheduling), not by the black hole")
		st, err := nb.direct.stats(ctx)
		require.NoError(t, err)
		require.Positive(t, st.Pending, "the failed rows must stay in the outbox")

		nb.redisProxy.heal(t)
		require.Eventually(t, func() bool {
			_, _ = relay.RunOnce(ctx)
			st, err := nb.direct.stats(ctx)
			return err == nil && st.Pending == 0
		}, 15*time.Second, 20*time.Millisecond)
		require.GreaterOrEqual(t, maxAttempts.Load(), int64(2), "rows must have been re-delivered")
		figures["redis_blackhole_max_attempts"] = maxAttempts.Load()
		nb.direct.requireConverged(t)
	})

	t.Run("PostgresResetsFailFast", func(t *testing.T) {
		nb.pgProxy.add(t, "reset_peer", "upstream", map[string]any{"timeout": 0})
		for range 3 {
			took, err := boundedErr(t, 2*time.Second+overrun, func() error { return submit(nb.board, 2*time.Second) })
			require.True(t, typedNetErr(err), "submit error %T: %v", err, err)
			figures["postgres_reset_submit_failed_after"] = took.Round(time.Millisecond)
		}
		nb.pgProxy.heal(t)
		require.Eventually(t, func() bool { return submit(nb.board, 2*time.Second) == nil }, 10*time.Second, 50*time.Millisecond,
			"the pool must recover once resets stop")
		require.LessOrEqual(t, nb.pool.Stat().TotalConns(), int32(4))
	})

	t.Run("LostAcknowledgementIsDeduplicated", func(t *testing.T) {
		// The command reaches PostgreSQL and commits, but the reply is
		// dropped: the client sees a timeout, not knowing whether it was
		// applied. Its retry with the same event id must be answered as a
		// duplicate with the original result, and applied once.
		cmd := leaderboard.Command{EventID: uuid.New(), UserID: "lost-ack", Delta: 7}
		// A pool of one connection that is never pinged on acquire: the
		// statement itself, not a liveness ping, must be what goes out
		// while replies are dropped.
		cfg, err := pgxpool.ParseConfig(withHost(t, pg.ConnString, nb.pgProxy.addr(), app))
		require.NoError(t, err)
		cfg.MaxConns = 1
		cfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		require.NoError(t, err)
		defer pool.Close()
		lossy := newBoard(t, pool, pg.Schema, nb.rdb, rd.Prefix, nb.board.Name())
		// Connect, and let pgx prepare the submit statement, before the
		// fault: otherwise the lost reply is the prepare's and the command
		// is never sent at all. Close stops the board's relay wake-ups,
		// whose NOTIFY would otherwise be the statement holding the one
		// connection when replies start to vanish.
		require.NoError(t, submit(lossy.board, 5*time.Second))
		lossy.board.Close()
		require.Eventually(t, func() bool { return pool.Stat().AcquiredConns() == 0 }, 5*time.Second, 10*time.Millisecond)
		nb.pgProxy.add(t, "timeout", "downstream", map[string]any{"timeout": 0})
		// Should the test fail below, heal before the deferred pool.Close,
		// which stalls for about 15s on the black-holed connection.
		defer nb.pgProxy.heal(t)
		took, err := boundedErr(t, time.Second+overrun, func() error {
			c, cancel := context.WithTimeout(ctx, time.Second)
			defer cancel()
			_, err := lossy.board.Submit(c, cmd)
			return err
		})
		require.True(t, typedNetErr(err), "submit error %T: %v", err, err)
		figures["lost_ack_submit_failed_after"] = took.Round(time.Millisecond)
		nb.pgProxy.heal(t)
		var events int
		require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT count(*) FROM `+nb.table(leaderboard.ScoreEventsTable)+` WHERE event_id = $1`, cmd.EventID).Scan(&events))
		require.Equal(t, 1, events, "the command must have committed although its reply was lost")
		var res leaderboard.Result
		require.Eventually(t, func() bool {
			c, cancel := context.WithTimeout(ctx, 2*time.Second)
			defer cancel()
			res, err = lossy.board.Submit(c, cmd)
			return err == nil
		}, 10*time.Second, 50*time.Millisecond)
		require.Equal(t, leaderboard.Result{Score: 7, Version: 1, Duplicate: true}, res)
		var score int64
		require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT score FROM `+nb.table(leaderboard.UserScoresTable)+` WHERE board = $1 AND user_id = $2`, nb.board.Name(), cmd.UserID).Scan(&score))
		require.Equal(t, int64(7), score, "applied exactly once")
		figures["lost_ack_deduplicated"] = 1
	})

	t.Run("LeaseExpiresAndRowsAreRedelivered", func(t *testing.T) {
		for range 5 {
			require.NoError(t, submit(nb.direct.board, 5*time.Second))
		}
		projector, err := projection.NewRedisProjector(rd.Client, nb.board.Mapper(), &projection.Config{Prefix: rd.Prefix})
		require.NoError(t, err)
		entered := make(chan struct{})
		// Relay A: its PostgreSQL link turns slow (2.5s, longer than the 1s
		// lease) while it handles its batch, so its acknowledgement arrives
		// after relay B has re-claimed the rows.
		const latency = 2500 * time.Millisecond
		slowAck := outbox.HandlerFunc(func(hctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			nb.pgProxy.add(t, "latency", "upstream", map[string]any{"latency": latency.Milliseconds()})
			close(entered)
			return projector.Handle(hctx, batch)
		})
		var redelivered atomic.Int64
		counting := outbox.HandlerFunc(func(hctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
			for _, r := range batch {
				if r.Attempts >= 2 {
					redelivered.Add(1)
				}
			}
			return projector.Handle(hctx, batch)
		})
		cfg := faultRelayConfig("lease")
		cfg.Schema, cfg.Streams, cfg.LeaseDuration = pg.Schema, []string{nb.board.Stream()}, time.Second
		relayA, err := outbox.NewRelay(nb.pool, slowAck, cfg)
		require.NoError(t, err)
		relayB, err := outbox.NewRelay(pg.Pool, counting, cfg)
		require.NoError(t, err)

		type runOnce struct {
			n    int
			err  error
			took time.Duration
		}
		aDone := make(chan runOnce, 1)
		go func() {
			start := time.Now()
			n, err := relayA.RunOnce(ctx)
			aDone <- runOnce{n, err, time.Since(start)}
		}()
		select {
		case <-entered: // A holds the rows; only now does B start looking
		case a := <-aDone:
			t.Fatalf("relay A claimed nothing: %+v", a)
		}
		bCtx, stopB := context.WithCancel(ctx)
		bDone := make(chan struct{})
		go func() {
			defer close(bDone)
			for bCtx.Err() == nil {
				if n, _ := relayB.RunOnce(bCtx); n == 0 {
					time.Sleep(20 * time.Millisecond)
				}
			}
		}()
		a := <-aDone
		stopB()
		<-bDone
		n, err, took := a.n, a.err, a.took
		nb.pgProxy.heal(t)
		require.Positive(t, n)
		require.ErrorIs(t, err, outbox.ErrLeaseLost, "A's late acknowledgement must find its lease taken")
		var lost *outbox.LeaseLostError
		require.ErrorAs(t, err, &lost)
		// The settle statement's two round trips (prepare, execute) each
		// wait out the latency.
		require.Less(t, took, 2*latency+overrun)
		require.Positive(t, redelivered.Load(), "relay B must have received the rows again")
		figures["lease_lost_rows"] = len(lost.IDs)
		figures["lease_redelivered_rows"] = redelivered.Load()
		nb.direct.waitDrained(t, 10*time.Second)
		nb.direct.requireConverged(t)
	})

	t.Run("PartitionHeals", func(t *testing.T) {
		w := nb.worker(t, "partition")
		runCtx, stopRun := context.WithCancel(ctx)
		runDone := make(chan error, 1)
		go func() { runDone <- w.Run(runCtx) }()
		defer func() {
			stopRun()
			select {
			case err := <-runDone:
				require.NoError(t, err)
			case <-time.After(15 * time.Second):
				t.Error("the worker did not stop within 15s of its cancellation")
			}
		}()
		for range 5 {
			require.NoError(t, submit(nb.direct.board, 5*time.Second))
		}
		nb.direct.waitDrained(t, 10*time.Second)

		nb.pgProxy.partition(t)
		nb.redisProxy.partition(t)
		// Should the test fail during the partition, heal before the deferred
		// stop above rather than after it, as add's cleanup would: a batch
		// settling through the partition would hold the worker's stop up for
		// its whole settle timeout.
		defer nb.pgProxy.heal(t)
		defer nb.redisProxy.heal(t)
		partitioned := time.Now()
		took, err := boundedErr(t, time.Second+overrun, func() error { return submit(nb.board, time.Second) })
		require.True(t, typedNetErr(err), "submit error %T: %v", err, err)
		figures["partition_submit_failed_after"] = took.Round(time.Millisecond)
		_, err = boundedErr(t, time.Second+overrun, func() error {
			c, cancel := context.WithTimeout(ctx, time.Second)
			defer cancel()
			_, err := nb.board.Top(c, 10)
			return err
		})
		require.True(t, typedNetErr(err), "read error %T: %v", err, err)
		for range 10 { // commands keep arriving on the healthy side
			require.NoError(t, submit(nb.direct.board, 5*time.Second))
		}
		time.Sleep(2*time.Second - time.Since(partitioned))
		nb.pgProxy.heal(t)
		nb.redisProxy.heal(t)
		healed := time.Now()
		nb.direct.waitDrained(t, 20*time.Second)
		figures["partition_drained_after_heal"] = time.Since(healed).Round(time.Millisecond)
		nb.direct.requireConverged(t)
	})

	// Everything the library opened is closed: no server connection of ours
	// is left on either server, and (at cleanup) no goroutine.
	closeClients()
	require.Eventually(t, func() bool {
		var n int
		err := pg.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, app).Scan(&n)
		return err == nil && n == 0
	}, 10*time.Second, 50*time.Millisecond, "PostgreSQL connections left open")
	require.Eventually(t, func() bool {
		list, err := rd.Client.ClientList(ctx).Result()
		return err == nil && !strings.Contains(list, "name="+app+" ")
	}, 10*time.Second, 50*time.Millisecond, "Redis connections left open")
	summary(t, "network", "toxiproxy", "faults", 6,
		"lost_ack_submit_failed_after", figures["lost_ack_submit_failed_after"], "lost_ack_deduplicated", figures["lost_ack_deduplicated"],
		"redis_blackhole_read_failed_after", figures["redis_blackhole_read_failed_after"],
		"redis_blackhole_max_attempts", figures["redis_blackhole_max_attempts"],
		"postgres_reset_submit_failed_after", figures["postgres_reset_submit_failed_after"],
		"partition_submit_failed_after", figures["partition_submit_failed_after"],
		"partition_drained_after_heal", figures["partition_drained_after_heal"],
		"lease_lost_rows", figures["lease_lost_rows"], "lease_redelivered_rows", figures["lease_redelivered_rows"],
		"leaked_connections", 0, "leaked_goroutines", 0, "lost", 0)
}
