package faults

import (
	"context"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
	"github.com/verity-go/verity/outbox"
)

// freezer is a TCP forwarder that can freeze every connection open at the
// moment of the call: their bytes stop flowing in both directions, forever,
// and they are never closed — the half-open connection a dead NAT entry or
// a silently dropping firewall leaves behind. Connections opened afterwards
// work normally. (toxiproxy's timeout toxic closes its connections when it is
// removed, so it cannot model a connection that stays dead.)
type freezer struct {
	ln       net.Listener
	upstream string

	mu  sync.Mutex
	all map[*frozenPair]bool
	wg  sync.WaitGroup
}

type frozenPair struct {
	client, server net.Conn
	freeze         chan struct{}
	// Guarded by freezer.mu: frozen once freezeAll froze it, closed once
	// a side ended.
	frozen, closed bool
}

func startFreezer(t *testing.T, upstream string) *freezer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	f := &freezer{ln: ln, upstream: upstream, all: map[*frozenPair]bool{}}
	f.wg.Add(1)
	go f.accept()
	t.Cleanup(f.close)
	return f
}

func (f *freezer) addr() string { return f.ln.Addr().String() }

func (f *freezer) accept() {
	defer f.wg.Done()
	for {
		c, err := f.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", f.upstream)
		if err != nil {
			_ = c.Close()
			continue
		}
		p := &frozenPair{client: c, server: s, freeze: make(chan struct{})}
		f.mu.Lock()
		f.all[p] = true
		f.mu.Unlock()
		f.wg.Add(2)
		go f.pipe(p, c, s)
		go f.pipe(p, s, c)
	}
}

// pipe copies src to dst until either side closes, or drops everything once
// the pair is frozen.
func (f *freezer) pipe(p *frozenPair, dst, src net.Conn) {
	defer f.wg.Done()
	defer func() {
		f.mu.Lock()
		p.closed = true
		f.mu.Unlock()
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		select {
		case <-p.freeze:
			n = 0 // dropped on the floor
		default:
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			if err != io.EOF {
				return
			}
			select {
			case <-p.freeze:
				return // frozen: the peer never learns of the close
			default:
			}
			_ = dst.Close()
			return
		}
	}
}

// freezeAll freezes every connection open now and returns how many.
func (f *freezer) freezeAll() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for p := range f.all {
		if !p.frozen && !p.closed {
			p.frozen = true
			close(p.freeze)
			n++
		}
	}
	return n
}

func (f *freezer) close() {
	_ = f.ln.Close()
	f.mu.Lock()
	for p := range f.all { // closing a frozen pair is the only way its peers learn anything
		_ = p.client.Close()
		_ = p.server.Close()
	}
	f.mu.Unlock()
	f.wg.Wait()
}

// TestRelaySurvivesHalfOpenConnections freezes every PostgreSQL connection
// of a running worker (bytes stop, nothing is closed) while commands keep
// arriving through a healthy connection. A relay must not wait forever on a
// connection that will never answer: within a bounded time it must give up
// on it and project the new commands through a fresh connection.
func TestRelaySurvivesHalfOpenConnections(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testenv.Postgres(t)
	rd := testenv.Redis(t)
	fz, pool := freezerPool(t, pg, "verity-faults-halfopen")
	frozenSide := newBoard(t, pool, pg.Schema, rd.Client, rd.Prefix, "halfopen")
	direct := newBoard(t, pg.Pool, pg.Schema, rd.Client, rd.Prefix, "halfopen")

	runFrozenWorker(t, fz, frozenSide.worker(t, "halfopen"))
	frozen, recovered := freezeAndRecover(t, ctx, fz, direct)
	summary(t, "network", "half-open-postgres", "frozen_connections", frozen,
		"recovered_after", recovered.Round(time.Millisecond), "lost", 0)
}

// TestListenerSurvivesHalfOpenConnection freezes the LISTEN connection of a
// Listener (and the pool connection its probe went through) shared by a
// running worker, whose claims go straight to the
// database, with an hour's PollInterval: waiting for a notification only
// reads from the socket, so without the Listener's idle check the frozen
// connection would never fail and every row would wait for the poll.
// Within ListenCheckInterval twice over (the wait, then the ping), and the
// 2 s it gives the dead connection to close, the Listener must replace it,
// wake the worker for the rows written meanwhile, and pass notifications
// again.
func TestListenerSurvivesHalfOpenConnection(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testenv.Postgres(t)
	rd := testenv.Redis(t)
	fz, listenPool := freezerPool(t, pg, "verity-faults-halfopen-listen")
	bb := newBoard(t, pg.Pool, pg.Schema, rd.Client, rd.Prefix, "halfopen-listen")
	const check = 500 * time.Millisecond
	listener, err := outbox.NewListener(listenPool, &outbox.ListenerConfig{
		Schema: pg.Schema, Table: leaderboard.OutboxTableDefault, ListenCheckInterval: check, ReconnectBackoffMax: 300 * time.Millisecond,
	})
	require.NoError(t, err)
	relayCfg := faultRelayConfig("halfopen-listen")
	relayCfg.PollInterval = time.Hour
	relayCfg.Listener = listener
	w, err := bb.board.Worker(&leaderboard.WorkerConfig{Relay: relayCfg})
	require.NoError(t, err)
	runFrozenWorker(t, fz, w)

	submit := func(user string) {
		for range 5 {
			_, err := bb.board.Submit(ctx, leaderboard.Command{EventID: uuid.New(), UserID: user, Delta: 1})
			require.NoError(t, err)
		}
	}
	submit("u")
	bb.waitDrained(t, 10*time.Second)
	// The LISTEN connection is the Listener's own; the pool holds the
	// connection its probe notification went through. The worker's claims
	// use pg.Pool, which does not go through the freezer.
	listening := 1 + int(listenPool.Stat().TotalConns())
	require.Equal(t, listening, fz.freezeAll(), "only the Listener's connections go through the freezer")
	frozenAt := time.Now()
	submit("v") // its notifications go to the frozen connection: lost
	bb.waitDrained(t, 2*check+2*time.Second+5*time.Second)
	recovered := time.Since(frozenAt)
	submit("w") // through the new connection
	bb.waitDrained(t, 5*time.Second)
	bb.requireConverged(t)
	summary(t, "network", "half-open-listen", "check_interval", check,
		"recovered_after", recovered.Round(time.Millisecond), "lost", 0)
}

// freezerPool returns a freezer in front of pg and a pool of connections
// through it, named appName.
func freezerPool(t *testing.T, pg *testenv.PG, appName string) (*freezer, *pgxpool.Pool) {
	t.Helper()
	fz := startFreezer(t, hostPort(t, pg.ConnString))
	pcfg, err := pgxpool.ParseConfig(withHost(t, pg.ConnString, fz.addr(), appName))
	require.NoError(t, err)
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return fz, pool
}

// runFrozenWorker runs w until the test ends. On the way out it unblocks
// everything in order: cancel the worker, close the frozen connections (a
// query stuck on one holds a pool connection, which pool.Close would wait
// for), wait for the worker.
func runFrozenWorker(t *testing.T, fz *freezer, w *leaderboard.Worker) {
	t.Helper()
	runCtx, stopRun := context.WithCancel(context.Background())
	runDone := make(chan error, 1)
	go func() { runDone <- w.Run(runCtx) }()
	t.Cleanup(func() {
		select {
		case <-runDone:
		case <-time.After(20 * time.Second):
			t.Error("the worker did not return after its connections were closed")
		}
	})
	t.Cleanup(fz.close)
	t.Cleanup(stopRun)
}

// TestRelaySurvivesHalfOpenRedis freezes every Redis connection of a
// running worker (bytes stop, nothing is closed) while commands keep
// arriving. The Redis client here has go-redis's default timeouts: the
// handler's call must give up within them, the batch be retried on a fresh
// connection, and everything be projected.
func TestRelaySurvivesHalfOpenRedis(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testenv.Postgres(t)
	rd := testenv.Redis(t)
	fz := startFreezer(t, hostPort(t, rd.URL))
	rdb := redis.NewClient(&redis.Options{Addr: fz.addr()}) // default timeouts
	t.Cleanup(func() { _ = rdb.Close() })
	frozenSide := newBoard(t, pg.Pool, pg.Schema, rdb, rd.Prefix, "halfopen-redis")
	direct := newBoard(t, pg.Pool, pg.Schema, rd.Client, rd.Prefix, "halfopen-redis")

	stop := frozenSide.runWorkers(t, 1)
	t.Cleanup(fz.close) // runs before the workers' cleanup: unblocks anything stuck
	frozen, recovered := freezeAndRecover(t, ctx, fz, direct)
	stop()
	summary(t, "network", "half-open-redis", "frozen_connections", frozen,
		"recovered_after", recovered.Round(time.Millisecond), "lost", 0)
}

// freezeAndRecover projects a few commands, freezes every connection that
// goes through fz, submits more through direct (which bypasses fz) and waits
// until the frozen worker has projected them too. It returns how many
// connections were frozen and how long recovery took. The lease (2 s)
// bounds the handler and settling is bounded at 10 s: 30 s is ample for the
// relay to notice that its connections are dead.
func freezeAndRecover(t *testing.T, ctx context.Context, fz *freezer, direct *boardBundle) (int, time.Duration) {
	t.Helper()
	submit := func(user string) {
		for range 5 {
			_, err := direct.board.Submit(ctx, leaderboard.Command{EventID: uuid.New(), UserID: user, Delta: 1})
			require.NoError(t, err)
		}
	}
	submit("u")
	direct.waitDrained(t, 10*time.Second)

	frozen := fz.freezeAll()
	require.Positive(t, frozen)
	frozenAt := time.Now()
	submit("v")
	direct.waitDrained(t, 30*time.Second)
	recovered := time.Since(frozenAt)
	direct.requireConverged(t)
	return frozen, recovered
}
