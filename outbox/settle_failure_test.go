package outbox_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
)

// gatedHandler acknowledges every record and records the attempt each
// event was last delivered at; while gate is set, the next batch closes
// entered and waits for gate to be closed.
type gatedHandler struct {
	mu      sync.Mutex
	gate    chan struct{}
	entered chan struct{}
	last    map[uuid.UUID]int
}

func (h *gatedHandler) Handle(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
	h.mu.Lock()
	gate, entered := h.gate, h.entered
	h.gate, h.entered = nil, nil
	for _, rec := range batch {
		h.last[rec.EventID] = rec.Attempts
	}
	h.mu.Unlock()
	if gate != nil {
		close(entered)
		<-gate
	}
	return make([]outbox.Result, len(batch)), nil
}

// lostSettleReplyConn loses the server's answer to the settle statement
// once armed: the statement runs and commits, the relay sees a broken
// connection (simple protocol: one ReadyForQuery ends the answer).
type lostSettleReplyConn struct {
	net.Conn
	arm  *atomic.Bool
	sent atomic.Bool
}

func (c *lostSettleReplyConn) Write(p []byte) (int, error) {
	if c.arm.Load() && bytes.Contains(p, []byte("retried AS (")) { // settleSQL's text
		c.arm.Store(false)
		c.sent.Store(true)
	}
	return c.Conn.Write(p)
}

func (c *lostSettleReplyConn) Read(p []byte) (int, error) {
	if c.sent.Load() {
		// The server answers ReadyForQuery only once the settle has
		// committed: read up to it, then lose it all.
		var got []byte
		for !bytes.Contains(got, []byte{'Z', 0, 0, 0, 5}) {
			n, err := c.Conn.Read(p)
			got = append(got, p[:n]...)
			if err != nil {
				break
			}
		}
		_ = c.Conn.Close()
		return 0, io.ErrUnexpectedEOF
	}
	return c.Conn.Read(p)
}

// TestRelayFailedSettle: a batch whose settle failed leaves its partitions
// leased; the relay ends those leases itself before its next claim, so its
// rows are delivered again as soon as the database answers, not when the
// lease runs out, and it touches no lease but its own.
func TestRelayFailedSettle(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// PostgreSQL restarts while a batch is in the Handler, so its settle
	// fails. With a lease of 10 minutes the rows were delivered again only
	// when it ran out (19.7 s after the restart with a 20 s lease).
	t.Run("LeasesEndOnceTheDatabaseAnswers", func(t *testing.T) {
		t.Parallel()
		srv := testenv.StartPostgres(t)
		pool := testenv.NewPool(t, srv.ConnString())
		cfg := &outbox.Config{Schema: "settle_failure"}
		require.NoError(t, outbox.Migrate(ctx, pool, cfg))
		w, err := outbox.NewWriter(cfg)
		require.NoError(t, err)
		h := &gatedHandler{last: map[uuid.UUID]int{}}
		r, err := outbox.NewRelay(pool, h, &outbox.RelayConfig{Schema: cfg.Schema, LeaseDuration: 10 * time.Minute,
			PollInterval: 200 * time.Millisecond, ReconnectBackoffMax: 500 * time.Millisecond})
		require.NoError(t, err)
		startRun(t, r)
		pending := func() int {
			var n int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+w.Table()).Scan(&n); err != nil {
				return -1 // the server is not back yet
			}
			return n
		}

		for round := range 2 {
			gate, entered := make(chan struct{}), make(chan struct{})
			h.mu.Lock()
			h.gate, h.entered = gate, entered
			h.mu.Unlock()
			msgs := make([]outbox.Message, 5)
			for i := range msgs {
				msgs[i] = newMessage("s", fmt.Sprintf("k%d-%d", round, i), 1)
			}
			require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return w.Append(ctx, tx, msgs...) }))
			select {
			case <-entered:
			case <-time.After(time.Minute):
				t.Fatal("the batch never reached the Handler")
			}
			require.NoError(t, srv.Stop())
			close(gate) // the settle fails: the server is down
			require.NoError(t, srv.Start())
			require.Eventually(t, func() bool { return pending() == 0 }, time.Minute, 20*time.Millisecond,
				"round %d: the rows of the batch whose settle failed wait for its lease", round)
			h.mu.Lock()
			for _, m := range msgs {
				require.Equal(t, 2, h.last[m.EventID], "round %d: the unsettled attempt counts, as after a crash", round)
			}
			h.mu.Unlock()
		}
	})

	// The settle commits but its answer is lost; meanwhile another relay
	// takes every partition. Ending the failed batch's leases must leave
	// the other relay's alone.
	t.Run("EndsOnlyItsOwnLeases", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		var arm atomic.Bool
		pool := poolWith(t, b, func(pc *pgxpool.Config) {
			pc.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
			pc.ConnConfig.TLSConfig, pc.ConnConfig.Fallbacks = nil, nil // plain bytes to match
			pc.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
				c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
				if err != nil {
					return nil, err
				}
				return &lostSettleReplyConn{Conn: c, arm: &arm}, nil
			}
		})
		r := b.relay(t, pool, &recorder{}, outbox.RelayConfig{LeaseDuration: time.Minute})
		b.appendNow(t, newMessage("s", "k", 1))
		arm.Store(true)
		n, err := r.RunOnce(ctx)
		require.Equal(t, 1, n)
		require.Error(t, err, "the settle's answer was lost")
		require.False(t, arm.Load(), "the settle was sent")
		var left int
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM `+b.writer.Table()).Scan(&left))
		require.Zero(t, left, "the settle committed")

		other := uuid.NewString()
		_, err = b.pool.Exec(ctx, `UPDATE `+b.leasesTable()+` SET owner = $1, leased_until = now() + interval '1 hour'`, other)
		require.NoError(t, err)
		n, err = r.RunOnce(ctx)
		require.NoError(t, err)
		require.Zero(t, n)
		var held, total int
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE owner::text = $1 AND leased_until > now() + interval '50 minutes'), count(*) FROM `+b.leasesTable(), other).Scan(&held, &total))
		require.Positive(t, total)
		require.Equal(t, total, held, "the other relay's leases are untouched")
	})
}

// TestRelaySettleRetriesAStatementPostgreSQLRolledBack: a settle that
// PostgreSQL rolls back whole (here at the session's lock_timeout, as for
// a serialization failure or a deadlock) is run again. It was not: the
// handled rows stayed leased, their attempt counted as a crash, and with
// MaxAttempts 1 they went to the dead letters though the Handler had
// succeeded.
func TestRelaySettleRetriesAStatementPostgreSQLRolledBack(t *testing.T) {
	t.Parallel()
	const lockTimeout = 200 * time.Millisecond
	b := setup(t)
	ctx := context.Background()
	pc, err := pgxpool.ParseConfig(b.pg.ConnString)
	require.NoError(t, err)
	pc.ConnConfig.RuntimeParams["lock_timeout"] = fmt.Sprint(lockTimeout.Milliseconds())
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	msg := newMessage("s", "k", 1)
	b.appendCommitted(t, msg)

	// The Handler locks its row from another transaction, so the settle's
	// DELETE waits; the lock is released once one settle attempt has
	// timed out and the next is waiting.
	var calls atomic.Int32
	released := make(chan error, 1)
	h := outbox.HandlerFunc(func(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
		if calls.Add(1) == 1 { // ctx, not the Handler's: the lock outlives the call
			holder, err := b.pool.Begin(ctx)
			if err != nil {
				return nil, err
			}
			var pid int
			if err := holder.QueryRow(ctx, `SELECT pg_backend_pid() FROM `+b.writer.Table()+` WHERE id = $1 FOR UPDATE`, batch[0].ID).Scan(&pid); err != nil {
				_ = holder.Rollback(ctx)
				return nil, err
			}
			go func() {
				defer func() { _ = holder.Rollback(ctx) }()
				deadline := time.Now().Add(30 * time.Second)
				for {
					var waiting int
					if err := b.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))`, pid).Scan(&waiting); err != nil {
						released <- err
						return
					}
					if waiting > 0 {
						break
					}
					if time.Now().After(deadline) {
						released <- fmt.Errorf("the settle never waited for the row")
						return
					}
					time.Sleep(5 * time.Millisecond)
				}
				time.Sleep(lockTimeout * 3 / 2)
				released <- nil
			}()
		}
		return make([]outbox.Result, len(batch)), nil
	})
	r, err := outbox.NewRelay(pool, h, &outbox.RelayConfig{Schema: b.cfg.Schema, MaxAttempts: 1, DisableNotify: true})
	require.NoError(t, err)
	n, err := r.RunOnce(ctx)
	require.NoError(t, err, "the settle is run again after its lock_timeout")
	require.Equal(t, 1, n)
	require.NoError(t, <-released)

	stats, err := r.Stats(ctx)
	require.NoError(t, err)
	require.Zero(t, stats.Pending)
	require.Zero(t, stats.DeadLetters, "a row the Handler handled is not buried")
	require.EqualValues(t, 1, calls.Load())
}

// TestRelayReleasesAClaimACrashCutOff: a claim that committed as
// PostgreSQL crashed or stopped (the claim's answer was lost, not its
// commit) leaves its partitions leased to a token nobody holds. The
// release the relay sends at once fails (the server is down, or refuses
// connections as it shuts down: 57P03); it is tried again before the next
// claim. Before, it was not: the rows waited for the whole lease (a
// minute here) after the server was back.
func TestRelayReleasesAClaimACrashCutOff(t *testing.T) {
	t.Parallel()
	for name, stop := range map[string]func(*testenv.PostgresServer) error{
		"Crash":    (*testenv.PostgresServer).Kill,
		"Shutdown": (*testenv.PostgresServer).Stop,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			releaseAfterServerLoss(t, stop)
		})
	}
}

func releaseAfterServerLoss(t *testing.T, stop func(*testenv.PostgresServer) error) {
	ctx := context.Background()
	srv := testenv.StartPostgres(t)
	pool := testenv.NewPool(t, srv.ConnString())
	cfg := &outbox.Config{Schema: "crash"}
	require.NoError(t, outbox.Migrate(ctx, pool, cfg))
	w, err := outbox.NewWriter(cfg)
	require.NoError(t, err)
	b := &testBundle{pool: pool, cfg: cfg, writer: w}
	b.appendCommitted(t, newMessage("s", "a", 1), newMessage("s", "b", 1))
	var dataDir string
	require.NoError(t, pool.QueryRow(ctx, `SHOW data_directory`).Scan(&dataDir))
	h := &recorder{}
	// DurableBookkeeping commits the claim synchronously: with a standby
	// named that never connects, its commit is written and then waits.
	r := b.relay(t, pool, h, outbox.RelayConfig{DurableBookkeeping: true, LeaseDuration: time.Minute})
	_, err = pool.Exec(ctx, `CREATE TABLE sync_probe (x int)`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `ALTER SYSTEM SET synchronous_standby_names = 'nobody'`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `SELECT pg_reload_conf()`)
	require.NoError(t, err)
	// Commits wait for the standby once the checkpointer has read the
	// reload, which may be after any session has: wait until a probe's
	// commit waits (cut off at once; its row commits all the same).
	require.Eventually(t, func() bool {
		conn, err := pgx.Connect(ctx, srv.ConnString())
		if err != nil {
			return false
		}
		defer conn.Close(context.Background())
		pctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		_, err = conn.Exec(pctx, `INSERT INTO sync_probe VALUES (1)`)
		return errors.Is(err, context.DeadlineExceeded) || pctx.Err() != nil
	}, 10*time.Second, 10*time.Millisecond, "commits never waited for the standby")
	syncWaiters := func() int {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'`).Scan(&n); err != nil {
			return -1
		}
		return n
	}
	// The probes' sessions still wait: end them, so that the wait below
	// is the claim's.
	_, err = pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE wait_event = 'SyncRep'`)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return syncWaiters() == 0 }, 10*time.Second, 10*time.Millisecond)

	done := make(chan error, 1)
	go func() { _, err := r.RunOnce(ctx); done <- err }()
	require.Eventually(t, func() bool { return syncWaiters() > 0 }, 10*time.Second, 10*time.Millisecond,
		"the claim never waited for the standby")
	require.NoError(t, stop(srv))
	select {
	case err := <-done:
		require.Error(t, err, "the claim's answer was lost")
	case <-time.After(30 * time.Second):
		t.Fatal("RunOnce did not return after the crash")
	}
	require.Empty(t, h.seen(), "the crashed claim reached no Handler")
	auto := filepath.Join(dataDir, "postgresql.auto.conf")
	text, err := os.ReadFile(auto)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(auto, []byte(strings.ReplaceAll(string(text), "synchronous_standby_names = 'nobody'", "")), 0o600))
	require.NoError(t, srv.Start())
	require.Eventually(t, func() bool { return pool.Ping(ctx) == nil }, 30*time.Second, 50*time.Millisecond)
	var leased int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+b.leasesTable()+` WHERE leased_until > now()`).Scan(&leased))
	require.Positive(t, leased, "the claim committed before the crash")

	require.Eventually(t, func() bool {
		_, err := r.RunOnce(ctx)
		return err == nil && len(h.seen()) == 2
	}, 20*time.Second, 100*time.Millisecond, "the crashed claim's rows waited for its lease")
	for _, rec := range h.seen() {
		require.Equal(t, 1, rec.Attempts, "the crashed claim counted no attempt")
	}
}
