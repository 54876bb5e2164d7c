package leaderboard

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
	"github.com/verity-go/verity/projection"
	"github.com/verity-go/verity/reconcile"
)

func TestWorker(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("RunProjectsLive", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) {
			c.ReadPolicy = FailClosed
			c.ReadYourWritesTimeout = 10 * time.Second
		})
		worker, err := tb.board.Worker(&WorkerConfig{Relay: &outbox.RelayConfig{PollInterval: time.Minute}})
		require.NoError(t, err)
		runCtx, stop := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- worker.Run(runCtx) }()

		// With a one-minute poll, only the NOTIFY sent by the board's
		// notifier after Submit can wake the worker in time.
		res := tb.submit(t, "user-a", 10)
		e, fr, err := tb.board.Rank(ctx, "user-a", AtLeast("user-a", res.Version))
		require.NoError(t, err)
		require.Equal(t, SourceRedis, fr.Source)
		require.Equal(t, int64(10), e.Score)
		stop()
		require.NoError(t, <-done)
	})

	// One Worker runs once at a time; the refusal is the relay's error,
	// as Run's doc says, not a leaderboard sentinel.
	t.Run("SecondConcurrentRunRefused", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		worker, err := tb.board.Worker(nil)
		require.NoError(t, err)
		runCtx, stop := context.WithCancel(ctx)
		defer stop()
		done := make(chan error, 2)
		for range 2 {
			go func() { done <- worker.Run(runCtx) }()
		}
		select {
		case err := <-done: // whichever Run came second
			require.ErrorIs(t, err, outbox.ErrRelayRunning)
		case <-time.After(10 * time.Second):
			t.Fatal("neither of two concurrent Runs was refused")
		}
		stop()
		require.NoError(t, <-done, "the Run that ran returns nil after the cancellation")
	})

	t.Run("ClientWithoutTimeoutsRefused", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		opts, err := redis.ParseURL(tb.rd.URL)
		require.NoError(t, err)
		opts.ReadTimeout = -1
		unbounded := redis.NewClient(opts)
		t.Cleanup(func() { _ = unbounded.Close() })
		// Refused by New: a worker's shutdown, and every read, could wait
		// for a stalled Redis forever.
		_, err = New(tb.pg.Pool, unbounded, new(tb.board.Config()))
		require.ErrorIs(t, err, ErrInvalidConfig)
		var boardErr *ConfigError
		require.ErrorAs(t, err, &boardErr)
		require.Equal(t, "rdb", boardErr.Field)
		require.ErrorContains(t, err, "Options.ReadTimeout")
		opts.ReadTimeout, opts.WriteTimeout = 0, -2
		noDeadline := redis.NewClient(opts)
		t.Cleanup(func() { _ = noDeadline.Close() })
		_, err = New(tb.pg.Pool, noDeadline, new(tb.board.Config()))
		require.ErrorContains(t, err, "Options.WriteTimeout")
		opts.ReadTimeout, opts.WriteTimeout = -1, 0

		opts.ContextTimeoutEnabled = true
		bounded := redis.NewClient(opts)
		t.Cleanup(func() { _ = bounded.Close() })
		board, err := New(tb.pg.Pool, bounded, new(tb.board.Config()))
		require.NoError(t, err)
		t.Cleanup(board.Close)
		_, err = board.Worker(nil)
		require.NoError(t, err, "the context's deadline bounds each command")
	})

	t.Run("RedeliveryAndReorderingAreHarmless", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		tb.submit(t, "user-a", 10)
		tb.submit(t, "user-a", 7)
		tb.drain(t)
		worker, err := tb.board.Worker(nil)
		require.NoError(t, err)
		record := func(version int64, score string) outbox.Record {
			return outbox.Record{Message: outbox.Message{EventID: uuid.New(), Stream: tb.board.Stream(), Key: "user-a", Version: version, Payload: []byte(score)}}
		}
		outcomes, err := worker.Projector().Project(ctx, []outbox.Record{record(2, "17"), record(1, "10")})
		require.NoError(t, err)
		require.Equal(t, []projection.Outcome{projection.OutcomeDuplicate, projection.OutcomeStale}, outcomes)
		score, err := tb.rd.Client.ZScore(ctx, tb.board.SortedSetKey(), "user-a").Result()
		require.NoError(t, err)
		require.Equal(t, float64(-17), score) // negated: ascending order is the ranking

		// A record of another stream is refused, not projected.
		_, err = tb.board.Mapper().Map(outbox.Record{Message: outbox.Message{Stream: "leaderboard:other", Key: "x", Version: 1, Payload: []byte("1")}})
		require.Error(t, err)
	})
}

func TestReconciler(t *testing.T) {
	t.Parallel()
	t.Run("InvalidConfig", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		_, err := tb.board.Reconciler(&reconcile.Config{PageSize: reconcile.PageSizeMax + 1})
		var cerr *ConfigError
		require.ErrorAs(t, err, &cerr)
		require.Equal(t, "reconcile.Config.PageSize", cerr.Field)
		require.ErrorIs(t, err, ErrInvalidConfig)
		require.ErrorIs(t, err, reconcile.ErrInvalidConfig)
		_, _, err = tb.board.Verify(context.Background(), &reconcile.Config{PageSize: -1})
		require.ErrorIs(t, err, ErrInvalidConfig)
	})
	for _, buckets := range []int{0, 8} {
		t.Run(fmt.Sprintf("VersionBuckets%d", buckets), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			tb := setup(t, func(c *Config) { c.VersionBuckets = buckets })
			for i, u := range []string{"ada", "bob", "cy", "dee"} {
				tb.submit(t, u, int64(10*(i+1)))
			}
			tb.submit(t, "bob", 1)
			tb.drain(t)
			key := tb.board.SortedSetKey()
			verKey := func(user string) string { return tb.board.Keyspace().VersionKey(tb.board.target(user)) }

			// Lose one entry, hand-edit one score, roll one version back,
			// and add members no user id can be (a buggy writer's).
			require.NoError(t, tb.rd.Client.ZRem(ctx, key, "ada").Err())
			for _, junk := range []string{"bad\xff", "nul\x00byte"} {
				require.NoError(t, tb.rd.Client.ZAdd(ctx, key, redis.Z{Score: -5, Member: junk}).Err())
			}
			require.Equal(t, int64(1), tb.rd.Client.HDel(ctx, verKey("ada"), "ada").Val())
			require.NoError(t, tb.rd.Client.ZAdd(ctx, key, redis.Z{Score: -999, Member: "cy"}).Err())
			require.Equal(t, int64(0), tb.rd.Client.HSet(ctx, verKey("bob"), "bob", "1").Val()) // 0: overwrote bob's version

			rec, err := tb.board.Reconciler(nil)
			require.NoError(t, err)
			report, err := rec.Run(ctx, reconcile.RunOptions{})
			require.NoError(t, err)
			require.Equal(t, int64(4), report.Checked)
			require.Equal(t, int64(1), report.Counts[reconcile.ClassMissing])
			require.Equal(t, int64(1), report.Counts[reconcile.ClassCorrupt])
			require.Equal(t, int64(1), report.Counts[reconcile.ClassStale])
			require.Equal(t, int64(1), report.Counts[reconcile.ClassCurrent])
			require.Equal(t, int64(2), report.Counts[reconcile.ClassOrphan])
			require.Equal(t, int64(3), report.Repaired) // orphans are reported, not removed, by default
			for _, junk := range []string{"bad\xff", "nul\x00byte"} {
				require.NoError(t, tb.rd.Client.ZRem(ctx, key, junk).Err())
			}

			fromRedis, _, err := tb.board.redisPage(ctx, nil, MaxPageSize, nil)
			require.NoError(t, err)
			fromPG, err := tb.board.Authoritative(ctx, MaxPageSize)
			require.NoError(t, err)
			require.Equal(t, fromPG, fromRedis)

			sample, err := rec.Run(ctx, reconcile.RunOptions{Sample: 2})
			require.NoError(t, err)
			require.Equal(t, int64(2), sample.Checked)
			require.Equal(t, int64(2), sample.Counts[reconcile.ClassCurrent])
		})
	}
}

func TestVersionBuckets(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const buckets = 16
	tb := setup(t, func(c *Config) {
		c.VersionBuckets = buckets
		c.ReadPolicy = FailClosed
		c.ReadYourWritesTimeout = 10 * time.Second
	})
	users := make([]string, 64)
	for i := range users {
		users[i] = fmt.Sprintf("player-%02d", i)
		tb.submit(t, users[i], int64(i+1))
	}
	res := tb.submit(t, users[0], 100)
	tb.drain(t)

	t.Run("VersionsLiveInBuckets", func(t *testing.T) {
		ks := tb.board.Keyspace()
		require.Equal(t, buckets, ks.VersionBuckets())
		one, err := projection.NewKeyspace(ks.Prefix())
		require.NoError(t, err)
		require.Zero(t, tb.rd.Client.Exists(ctx, one.VersionKey(tb.board.target(""))).Val(), "no single version hash")
		stored := 0
		for _, k := range ks.VersionKeys(tb.board.Name(), projection.KindSortedSet) {
			stored += int(tb.rd.Client.HLen(ctx, k).Val())
		}
		require.Equal(t, len(users), stored)
		v, err := tb.rd.Client.HGet(ctx, ks.VersionKey(tb.board.target(users[0])), users[0]).Int64()
		require.NoError(t, err)
		require.Equal(t, res.Version, v)
	})

	t.Run("ReadYourWritesFindsTheBucket", func(t *testing.T) {
		e, fr, err := tb.board.Rank(ctx, users[0], AtLeast(users[0], res.Version))
		require.NoError(t, err)
		require.Equal(t, SourceRedis, fr.Source)
		require.Equal(t, int64(101), e.Score)
	})

	t.Run("OtherCountIsRefused", func(t *testing.T) {
		cfg := *tb.board.cfg
		cfg.VersionBuckets = 0
		other, err := New(tb.pg.Pool, tb.rd.Client, &cfg)
		require.NoError(t, err)
		worker, err := other.Worker(nil)
		require.NoError(t, err)
		before := tb.rd.Client.ZScore(ctx, tb.board.SortedSetKey(), users[1]).Val()
		rec := outbox.Record{Message: outbox.Message{EventID: uuid.New(), Stream: other.Stream(), Key: users[1], Version: 99, Payload: []byte("5")}}
		_, err = worker.Projector().Project(ctx, []outbox.Record{rec})
		require.ErrorIs(t, err, projection.ErrLayoutMismatch)
		require.Equal(t, before, tb.rd.Client.ZScore(ctx, tb.board.SortedSetKey(), users[1]).Val(), "nothing written")
	})
}

func TestPageStableUnderConcurrentUpdates(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	var cmds []Command
	for i := 0; i < 60; i++ {
		cmds = append(cmds, Command{EventID: uuid.New(), UserID: fmt.Sprintf("stable-%02d", i), Delta: int64(i % 7 * 100)})
		cmds = append(cmds, Command{EventID: uuid.New(), UserID: fmt.Sprintf("busy-%02d", i), Delta: int64(i % 5 * 100)})
	}
	_, err := tb.board.SubmitBatch(ctx, cmds)
	require.NoError(t, err)
	tb.drain(t)

	worker, err := tb.board.Worker(nil)
	require.NoError(t, err)
	runCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); _ = worker.Run(runCtx) }()
	go func() {
		defer wg.Done()
		for i := 0; runCtx.Err() == nil; i++ {
			_, _ = tb.board.Submit(runCtx, Command{EventID: uuid.New(), UserID: fmt.Sprintf("busy-%02d", i%60), Delta: int64(i%21 - 10)})
		}
	}()
	defer func() { stop(); wg.Wait() }()

	for _, opts := range [][]ReadOption{{WithPolicy(ServeStale)}, {WithPolicy(FallbackToPostgres), forcePostgres()}} {
		for walk := 0; walk < 3; walk++ {
			seen := map[string]int{}
			var prev *Entry
			cur := ""
			for {
				r, err := tb.board.Page(ctx, cur, 7, opts...)
				require.NoError(t, err)
				for i := range r.Entries {
					e := r.Entries[i]
					seen[e.UserID]++
					if prev != nil {
						// Strictly increasing in ranking order across pages.
						require.True(t, e.Score < prev.Score || e.Score == prev.Score && e.UserID > prev.UserID,
							"%v after %v", e, *prev)
					}
					prev = &e
				}
				if r.Next == "" {
					break
				}
				cur = r.Next
			}
			for i := 0; i < 60; i++ {
				require.Equal(t, 1, seen[fmt.Sprintf("stable-%02d", i)], "stable user seen once")
			}
		}
	}
}

// The eviction check's log lines.
const (
	evictionWarning  = "leaderboard: worker: the board's Redis may evict the projection's version keys; run it with maxmemory-policy noeviction"
	evictionKept     = "leaderboard: worker: the Redis eviction policy keeps the projection's version keys"
	evictionCutShort = "leaderboard: worker: the eviction check was cut short by Run's ctx; the next Run checks again"
	evictionCouldNot = "leaderboard: worker: could not check the Redis eviction policy"
)

// loggingBoard returns a migrated board over rdb, in a schema of its own,
// that logs into the returned sink.
func loggingBoard(t *testing.T, rdb redis.UniversalClient) (*testBundle, *testenv.LogSink) {
	t.Helper()
	pg := testenv.Postgres(t)
	logs := &testenv.LogSink{}
	cfg := &Config{Name: "evicting", Schema: pg.Schema, Logger: logs.Logger()}
	require.NoError(t, Migrate(context.Background(), pg.Pool, cfg))
	board, err := New(pg.Pool, rdb, cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	return &testBundle{board: board, pg: pg}, logs
}

// TestWorkerChecksEvictionPolicy runs a Worker against a Redis that may
// evict keys without a TTL (a memory limit and allkeys-lru), where the
// gate's version keys could be evicted and an older record applied: Run
// warns once as it starts, and projects meanwhile. Against noeviction it
// warns of nothing.
func TestWorkerChecksEvictionPolicy(t *testing.T) {
	t.Parallel()
	const warning, keeps = evictionWarning, evictionKept
	run := func(t *testing.T, policy, verdict string) *testenv.LogSink {
		ctx := context.Background()
		server := testenv.StartRedis(t, "--maxmemory", "100mb", "--maxmemory-policy", policy)
		tb, logs := loggingBoard(t, server.Client(t))
		board := tb.board
		tb.submit(t, "alice", 3)
		w, err := board.Worker(nil)
		require.NoError(t, err)
		runCtx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- w.Run(runCtx) }()
		require.Eventually(t, func() bool {
			rank, _, err := board.Rank(ctx, "alice")
			return err == nil && rank.Score == 3
		}, 10*time.Second, 10*time.Millisecond, "the worker projects")
		require.Eventually(t, func() bool { return len(logs.Lines(t, verdict)) > 0 }, 10*time.Second, 10*time.Millisecond, "the check ends")
		cancel()
		require.NoError(t, <-done)
		return logs
	}

	t.Run("AllKeysLRUWarns", func(t *testing.T) {
		t.Parallel()
		logs := run(t, "allkeys-lru", warning)
		lines := logs.Lines(t, warning)
		require.Len(t, lines, 1)
		require.Equal(t, "WARN", lines[0]["level"])
		require.Contains(t, lines[0]["error"], "maxmemory-policy allkeys-lru")
		require.Empty(t, logs.Lines(t, keeps))
	})
	t.Run("NoEvictionIsQuiet", func(t *testing.T) {
		t.Parallel()
		logs := run(t, "noeviction", keeps)
		require.Empty(t, logs.Lines(t, warning))
		require.Equal(t, "DEBUG", logs.Lines(t, keeps)[0]["level"])
	})
}

// TestWorkerChecksEvictionAfterCancelledRun runs a Worker whose first Run
// is cancelled before the eviction check could answer: that Run does not
// stand for the check, and the next Run warns of an evicting Redis.
func TestWorkerChecksEvictionAfterCancelledRun(t *testing.T) {
	t.Parallel()
	const cutShort, couldNot, warning = evictionCutShort, evictionCouldNot, evictionWarning
	ctx := context.Background()
	server := testenv.StartRedis(t, "--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru")
	tb, logs := loggingBoard(t, server.Client(t))
	w, err := tb.board.Worker(nil)
	require.NoError(t, err)

	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	require.NoError(t, w.Run(cancelled))
	require.Eventually(t, func() bool {
		return len(logs.Lines(t, cutShort))+len(logs.Lines(t, couldNot)) == 1
	}, 10*time.Second, 10*time.Millisecond, "the cancelled Run's check ends")
	require.Empty(t, logs.Lines(t, warning), "a check cut short warns of nothing")

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- w.Run(runCtx) }()
	require.Eventually(t, func() bool { return len(logs.Lines(t, warning)) == 1 }, 10*time.Second, 10*time.Millisecond, "the next Run checks again and warns")
	stop()
	require.NoError(t, <-done)
	require.Len(t, logs.Lines(t, cutShort), 1, "the first check says it was cut short")
}

// TestWorkerChecksEvictionAfterRunCancelledMidCheck cancels a Worker's
// first Run while its eviction check waits for a Redis that does not
// answer: that Run returns at once, and the next Run, started before the
// check gives up, checks again and warns of an evicting Redis.
func TestWorkerChecksEvictionAfterRunCancelledMidCheck(t *testing.T) {
	t.Parallel()
	const cutShort, warning = evictionCutShort, evictionWarning
	ctx := context.Background()
	server := testenv.StartRedis(t, "--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru")
	proxy := startStallProxy(t, server.Addr())
	const readTimeout = time.Second
	rdb := redis.NewClient(&redis.Options{Addr: proxy.ln.Addr().String(), ReadTimeout: readTimeout})
	t.Cleanup(func() { _ = rdb.Close() })
	tb, logs := loggingBoard(t, rdb)
	w, err := tb.board.Worker(nil)
	require.NoError(t, err)

	proxy.armed.Store(true)
	first, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- w.Run(first) }()
	select {
	case <-proxy.stalled:
	case <-time.After(5 * time.Second):
		t.Fatal("setup: the first Run's check never reached Redis")
	}
	cancel()
	require.NoError(t, <-done)

	// The next Run, once the first has returned.
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	next := make(chan error, 1)
	go func() { next <- w.Run(runCtx) }()
	require.Eventually(t, func() bool { return len(logs.Lines(t, cutShort)) == 1 }, 10*readTimeout, 10*time.Millisecond,
		"setup: the first Run's check ends cut short")
	require.Eventually(t, func() bool { return len(logs.Lines(t, warning)) >= 1 }, 10*readTimeout, 10*time.Millisecond,
		"the next Run, started after the first Run's ctx ended before Redis answered, checks again and warns")
	stop()
	require.NoError(t, <-next)
}

// stallProxy forwards to upstream, except that once armed, the first
// connection that sends an INFO command is black-holed from then on: its
// commands are read and never forwarded, so its reply never comes.
type stallProxy struct {
	ln      net.Listener
	armed   atomic.Bool
	stalled chan struct{}
	mu      sync.Mutex
	conns   []net.Conn
}

func startStallProxy(t *testing.T, upstream string) *stallProxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &stallProxy{ln: ln, stalled: make(chan struct{})}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			u, err := net.Dial("tcp", upstream)
			if err != nil {
				_ = c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, u)
			p.mu.Unlock()
			go func() { _, _ = io.Copy(c, u) }()
			go func() {
				buf := make([]byte, 64<<10)
				holed := false
				for {
					n, err := c.Read(buf)
					if err != nil {
						_ = u.Close()
						return
					}
					if !holed && bytes.Contains(bytes.ToLower(buf[:n]), []byte("info")) && p.armed.CompareAndSwap(true, false) {
						holed = true
						close(p.stalled)
					}
					if holed {
						continue
					}
					if _, err := u.Write(buf[:n]); err != nil {
						return
					}
				}
			}()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		p.mu.Lock()
		defer p.mu.Unlock()
		for _, c := range p.conns {
			_ = c.Close()
		}
	})
	return p
}

// TestWorkerRunWhileEvictionCheckHangs runs a Worker whose Redis accepts
// connections and never answers, with a client that does not apply ctx
// deadlines to socket reads (go-redis's default): the eviction check's
// INFO then waits for the client's ReadTimeout. Run must still return
// promptly once its ctx is cancelled, and a second Run, refused because
// the first is under way, at once, without a check of its own.
func TestWorkerRunWhileEvictionCheckHangs(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var (
		mu    sync.Mutex
		conns []net.Conn
	)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			go func() { _, _ = io.Copy(io.Discard, c) }() // reads, never answers
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	const readTimeout = 10 * time.Second
	// Each Worker's check holds a connection until ReadTimeout.
	rdb := redis.NewClient(&redis.Options{Addr: ln.Addr().String(), ReadTimeout: readTimeout, PoolSize: 1000})
	t.Cleanup(func() { _ = rdb.Close() })

	ctx := context.Background()
	pg := testenv.Postgres(t)
	cfg := &Config{Name: "hung", Schema: pg.Schema}
	require.NoError(t, Migrate(ctx, pg.Pool, cfg))
	board, err := New(pg.Pool, rdb, cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	w, err := board.Worker(nil)
	require.NoError(t, err)

	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- w.Run(runCtx) }()
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(conns) > 0
	}, 5*time.Second, 10*time.Millisecond, "the check reached the server")

	start := time.Now()
	require.ErrorIs(t, w.Run(ctx), outbox.ErrRelayRunning)
	require.Less(t, time.Since(start), readTimeout/2, "the second Run is refused at once")

	cancel()
	start = time.Now()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(readTimeout / 2):
		t.Fatalf("Run still running %s after its ctx was cancelled: it waits for the eviction check", time.Since(start))
	}

	// Two Runs of a new Worker started together: the one that starts the
	// check may lose the race for the relay. Refused, it still returns at
	// once; it used to wait for the check (in a few trials in a hundred).
	for trial := range 100 {
		w, err := board.Worker(&WorkerConfig{Relay: &outbox.RelayConfig{DisableNotify: true, PollInterval: time.Hour}})
		require.NoError(t, err)
		runCtx, cancel := context.WithCancel(ctx)
		refused := make(chan error, 2)
		begin := make(chan struct{})
		for range 2 {
			go func() {
				<-begin
				refused <- w.Run(runCtx)
			}()
		}
		close(begin)
		start := time.Now()
		require.ErrorIs(t, <-refused, outbox.ErrRelayRunning, "trial %d", trial)
		require.Less(t, time.Since(start), readTimeout/2, "trial %d: the refused Run waited for the eviction check", trial)
		cancel()
		require.NoError(t, <-refused)
	}
}

// TestWorkerReportsAReusedVersion: PostgreSQL goes back (a row rewound, as
// a restore or a failover to a lagging standby leaves it) and the next
// command reuses a version Redis already holds, with another score. The
// gate keeps Redis's score and the Worker warns of the conflict; a
// reconcile pass finds the entry corrupt and repairs it from PostgreSQL.
func TestWorkerReportsAReusedVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	logs := &testenv.LogSink{}
	tb := setup(t, func(c *Config) { c.Logger = logs.Logger() })
	tb.submit(t, "ada", 10)
	tb.submit(t, "ada", 5) // version 2, score 15
	tb.drain(t)
	_, err := tb.pg.Pool.Exec(ctx, `UPDATE user_scores SET score = 10, version = 1 WHERE user_id = 'ada'`)
	require.NoError(t, err)
	res := tb.submit(t, "ada", 3)
	require.Equal(t, Result{Score: 13, Version: 2}, Result{Score: res.Score, Version: res.Version})
	tb.drain(t)

	score, err := tb.rd.Client.ZScore(ctx, tb.board.SortedSetKey(), "ada").Result()
	require.NoError(t, err)
	require.Equal(t, -15.0, score, "the gate kept the score it had for version 2 (negated: ascending order is the ranking)")
	var warned []map[string]any
	for _, l := range logs.Lines(t, "") {
		if msg, _ := l["msg"].(string); l["level"] == "WARN" && strings.HasPrefix(msg, "projection: a record's version is stored with another value") {
			warned = append(warned, l)
		}
	}
	require.Len(t, warned, 1)
	require.Equal(t, "ada", warned[0]["key"])
	require.Equal(t, 2.0, warned[0]["version"])

	r, err := tb.board.Reconciler(nil)
	require.NoError(t, err)
	rep, err := r.Run(ctx, reconcile.RunOptions{})
	require.NoError(t, err)
	require.Equal(t, int64(1), rep.Counts[reconcile.ClassCorrupt])
	require.Equal(t, int64(1), rep.Repaired)
	score, err = tb.rd.Client.ZScore(ctx, tb.board.SortedSetKey(), "ada").Result()
	require.NoError(t, err)
	require.Equal(t, -13.0, score)
}

// TestDrainCountsWhatItHandled: Drain returns how many records it handled.
func TestDrainCountsWhatItHandled(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	for _, u := range []string{"ada", "bo", "cy"} {
		tb.submit(t, u, 10)
	}
	w, err := tb.board.Worker(nil)
	require.NoError(t, err)
	n, err := w.Drain(ctx)
	require.NoError(t, err)
	require.Equal(t, 3, n)
	n, err = w.Drain(ctx)
	require.NoError(t, err)
	require.Zero(t, n)
}
