package outbox_test

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/outbox"
)

// TestRelayReleaseClaim covers how a relay undoes a claim cut off by its
// context (see also CutOffClaimReleasesItsPartitions).
func TestRelayReleaseClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// A relay whose sessions run under SET ROLE may not cancel the claim's
	// backend (pg_cancel_backend raises an ERROR: the backend's login role
	// is a superuser). The release must still wait for the claim to end and
	// free its partitions, not give up with the refused cancel.
	t.Run("CancelRefusedUnderSetRole", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		rp := newSetRolePool(t, b)
		logs := &syncBuffer{}
		h := &recorder{}
		r := b.relay(t, rp.pool, h, outbox.RelayConfig{LeaseDuration: time.Minute,
			Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
		msg, blocker := b.blockNextClaim(t, r)

		rp.refuse.Store(true)
		cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		defer cancel()
		done := make(chan error, 1)
		go func() {
			_, err := r.RunOnce(cctx)
			done <- err
		}()
		// Its cancel refused, the release waits for the claim's advisory
		// lock; the claim ends once the writer commits.
		require.Eventually(t, func() bool { return rp.waitingForAdvisoryLock(b) }, 3*time.Second, 10*time.Millisecond,
			"the release waits for the cut-off claim to end")
		require.NoError(t, blocker.Commit(ctx))
		require.ErrorIs(t, receive(t, done), context.DeadlineExceeded)

		var leased int
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM `+b.leasesTable()+
			` WHERE owner IS NOT NULL AND leased_until > now()`).Scan(&leased))
		require.Zero(t, leased, "no partition is leased to the cut-off claim")
		require.Contains(t, logs.String(), "could not cancel a cut-off claim")
		require.NotContains(t, logs.String(), "could not release")
		rp.refuse.Store(false)

		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n, "the row is claimable at once")
		seen := h.seen()
		require.Equal(t, msg.EventID, seen[len(seen)-1].EventID)
		require.Equal(t, 2, seen[len(seen)-1].Attempts, "the crashed relay's attempt and this one")
	})

	// A claim that neither ends nor can be cancelled holds up the release
	// only for the lock timeout: the server gives up, the relay returns and
	// its connection stays in the pool (the pool cannot open another here).
	t.Run("WaitForStuckClaimIsBounded", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		rp := newSetRolePool(t, b)
		logs := &syncBuffer{}
		r := b.relay(t, rp.pool, &recorder{}, outbox.RelayConfig{LeaseDuration: time.Minute,
			Logger: slog.New(slog.NewTextHandler(logs, nil))})
		r.SetReleaseLockTimeout(200 * time.Millisecond)
		_, blocker := b.blockNextClaim(t, r)

		rp.refuse.Store(true)
		cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		defer cancel()
		began := time.Now()
		_, err := r.RunOnce(cctx)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.Less(t, time.Since(began), 2*time.Second, "the release gave up at its lock timeout")
		require.Contains(t, logs.String(), "could not release the partitions of a failed claim")
		require.Contains(t, logs.String(), "lock timeout")
		require.NoError(t, blocker.Commit(ctx))
		require.EqualValues(t, 1, rp.pool.Stat().IdleConns(), "the release's connection went back to the pool")
	})

	// A cancel that hangs (a slow dial, a busy server) is given up at its
	// own timeout, and the wait gets only what is left of the release's
	// time, less a margin: the server still gives up first and the
	// connection stays in the pool. The wait's cap here is the release's
	// whole time, so a wait that ignored the time already spent would
	// outlast the client's deadline.
	t.Run("SlowCancelLeavesTheServerTheLastWord", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		rp := newSetRolePool(t, b)
		logs := &syncBuffer{}
		r := b.relay(t, rp.pool, &recorder{}, outbox.RelayConfig{LeaseDuration: time.Minute,
			Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
		// Four seconds: what is left for the wait is the release's time less
		// the stalled cancel, the connection's acquisition and the server's
		// margin (a second); with two, a loaded machine left it nothing, and
		// the release correctly gave up without waiting.
		r.SetReleaseTimeouts(4*time.Second, 200*time.Millisecond, 4*time.Second)
		_, blocker := b.blockNextClaim(t, r)

		rp.refuse.Store(true)
		rp.stallCancel.Store(true)
		cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		defer cancel()
		_, err := r.RunOnce(cctx)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.True(t, rp.cancelStalled.Load(), "the release tried to cancel the claim")
		require.Contains(t, logLine(t, logs.String(), "could not cancel a cut-off claim"), "deadline exceeded",
			"the cancel was given up at its own timeout")
		require.Contains(t, logLine(t, logs.String(), "could not release the partitions"), "lock timeout",
			"the server gave up waiting before the client's deadline")
		require.NoError(t, blocker.Commit(ctx))
		require.EqualValues(t, 1, rp.pool.Stat().IdleConns(), "the release's connection went back to the pool")
	})

	// A claim whose context ends before its statements leave the client
	// sent nothing, so there is nothing to release: no round trips (and no
	// warning if the database is what failed).
	t.Run("ClaimThatSentNothingIsNotReleased", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		tracer := &claimSaboteur{}
		pool := newPoolTraced(t, b.pg.ConnString, tracer)
		r := b.relay(t, pool, &recorder{}, outbox.RelayConfig{})
		b.appendCommitted(t, newMessage("s", "k", 1))

		tracer.armed.Store(true)
		_, err := r.RunOnce(ctx)
		require.ErrorIs(t, err, context.Canceled)
		require.True(t, pgconn.SafeToRetry(err), "the claim's statements never left")
		require.False(t, tracer.armed.Load(), "the claim was cut off")
		for _, sql := range tracer.sent() {
			require.NotContains(t, sql, "pg_cancel_backend")
			require.NotContains(t, sql, "SET owner = NULL")
		}
	})
}

// claimSaboteur is a pgx tracer that, once armed, hands the next claim an
// already cancelled context, as a shutdown between acquiring a connection
// and sending would; it records every statement sent after that.
type claimSaboteur struct {
	armed atomic.Bool
	mu    sync.Mutex
	sqls  []string
}

func (s *claimSaboteur) sent() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.sqls...)
}

func (s *claimSaboteur) record(sql string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sqls = append(s.sqls, sql)
}

func (s *claimSaboteur) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	s.record(data.SQL)
	return ctx
}

func (s *claimSaboteur) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (s *claimSaboteur) TraceBatchStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchStartData) context.Context {
	qs := data.Batch.QueuedQueries
	// The claim is the batch that starts with its advisory lock.
	if len(qs) > 0 && strings.Contains(qs[0].SQL, "pg_advisory_xact_lock") && s.armed.CompareAndSwap(true, false) {
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		return cctx
	}
	for _, q := range qs {
		s.record(q.SQL)
	}
	return ctx
}

func (s *claimSaboteur) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (s *claimSaboteur) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// setRolePool is a pool whose sessions log in as the test's (superuser) role
// and SET ROLE to a fresh unprivileged role, so that they may not cancel
// each other's statements.
type setRolePool struct {
	pool   *pgxpool.Pool
	role   string       // also the sessions' application_name
	refuse *atomic.Bool // refuse new connections
	// stallCancel holds the release's cancel statement back until its
	// context ends; cancelStalled reports that it did.
	stallCancel, cancelStalled *atomic.Bool
}

// TraceQueryStart stalls the release's cancel statement (stallCancel).
func (rp *setRolePool) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if rp.stallCancel.Load() && strings.Contains(data.SQL, "pg_cancel_backend(l.pid)") {
		rp.cancelStalled.Store(true)
		<-ctx.Done()
	}
	return ctx
}

func (rp *setRolePool) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// logLine returns the first line of logs that contains msg.
func logLine(t *testing.T, logs, msg string) string {
	t.Helper()
	for line := range strings.Lines(logs) {
		if strings.Contains(line, msg) {
			return line
		}
	}
	require.Failf(t, "no such log line", "%q in:\n%s", msg, logs)
	return ""
}

func newSetRolePool(t *testing.T, b *testBundle) *setRolePool {
	t.Helper()
	ctx := context.Background()
	role := "verity_test_" + strings.ReplaceAll(uuid.NewString(), "-", "")[:16]
	qrole := pgx.Identifier{role}.Sanitize()
	qschema := pgx.Identifier{b.pg.Schema}.Sanitize()
	_, err := b.pool.Exec(ctx, `CREATE ROLE `+qrole+` NOLOGIN`)
	require.NoError(t, err)
	t.Cleanup(func() {
		// Roles are cluster-wide: revoke its grants, then drop it.
		_, err := b.pool.Exec(context.Background(), `DROP OWNED BY `+qrole+`; DROP ROLE `+qrole)
		require.NoError(t, err)
	})
	_, err = b.pool.Exec(ctx, `GRANT USAGE ON SCHEMA `+qschema+` TO `+qrole+`;
		GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA `+qschema+` TO `+qrole)
	require.NoError(t, err)

	// As in CutOffClaimReleasesItsPartitions, the pool can refuse new
	// connections once warm, so that pgx's own cancel request never arrives.
	rp := &setRolePool{role: role, refuse: &atomic.Bool{}, stallCancel: &atomic.Bool{}, cancelStalled: &atomic.Bool{}}
	cfg, err := pgxpool.ParseConfig(b.pg.ConnString)
	require.NoError(t, err)
	cfg.ConnConfig.Tracer = rp
	cfg.MaxConns = 2
	cfg.ConnConfig.RuntimeParams["application_name"] = role
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if rp.refuse.Load() {
			return nil, errors.New("test: new connections refused")
		}
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, `SET ROLE `+qrole)
		return err
	}
	rp.pool, err = pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(rp.pool.Close)

	c1, err := rp.pool.Acquire(ctx)
	require.NoError(t, err)
	defer c1.Release()
	c2, err := rp.pool.Acquire(ctx)
	require.NoError(t, err)
	defer c2.Release()
	// The premise: under the role, cancelling the pool's other backend is
	// refused with an ERROR.
	_, err = c1.Exec(ctx, `SELECT pg_cancel_backend($1)`, c2.Conn().PgConn().PID())
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "42501", pgErr.Code, "insufficient_privilege")
	return rp
}

// waitingForAdvisoryLock reports whether a session of the pool waits for an
// advisory lock, asking on b's pool: rp's may have no connection to spare.
func (rp *setRolePool) waitingForAdvisoryLock(b *testBundle) bool {
	return b.waitingForLock(rp.role, "advisory")
}

// waitingForLock reports whether a session with the application name waits
// for a lock of the type (any type if lockType is empty); false on error, as
// it runs inside Eventually.
func (b *testBundle) waitingForLock(appName, lockType string) bool {
	var waiting bool
	err := b.pool.QueryRow(context.Background(), `SELECT EXISTS (
		SELECT 1 FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
		WHERE a.application_name = $1 AND ($2 = '' OR l.locktype = $2) AND NOT l.granted)`, appName, lockType).Scan(&waiting)
	return err == nil && waiting
}

// blockNextClaim makes r's next claim wait for a row lock until the
// returned transaction ends: a crashed relay's expired lease lists a new
// row, so the claim's attempt-counting UPDATE must lock it, and the
// transaction holds that lock. r is warmed up first (one delivery), so
// its claim statements are prepared.
func (b *testBundle) blockNextClaim(t *testing.T, r *outbox.Relay) (outbox.Message, pgx.Tx) {
	t.Helper()
	ctx := context.Background()
	b.appendCommitted(t, newMessage("s", "warm-up", 1))
	n, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)

	msg := newMessage("s", "k", 1)
	b.appendCommitted(t, msg)
	id := b.rows(t)[0].ID
	_, err = b.pool.Exec(ctx, `UPDATE `+b.leasesTable()+` SET owner = gen_random_uuid(), leased_until = now() - interval '1 second',
		inflight = int8multirange(int8range($1, $1, '[]')), touched_at = '-infinity' WHERE part = mod($1 / 256, 64)`, id)
	require.NoError(t, err)
	blocker, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = blocker.Rollback(context.Background()) }) // no-op after commit
	_, err = blocker.Exec(ctx, `SELECT 1 FROM `+b.writer.Table()+` WHERE id = $1 FOR UPDATE`, id)
	require.NoError(t, err)
	return msg, blocker
}

// TestCutOffClaimReachingTheServerLate: a RunOnce whose ctx ends after its
// claim was sent but before the server began it (its messages held in the
// network; on a loaded server, a backend not yet scheduled does the same).
// The release found no claim transaction to wait for and nothing leased,
// and the claim then ran and committed: its partitions stayed leased to a
// token nobody holds, and the rows it recorded counted an attempt no
// Handler made, which with MaxAttempts 1 buried a row no Handler saw. The
// release ends the claim connection's backend first.
func TestCutOffClaimReachingTheServerLate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// cutOff returns a relay whose claim was cut off while its messages
	// were held for 1.5 s, and its Handler.
	cutOff := func(t *testing.T, b *testBundle, lease time.Duration) *recorder {
		var proxy *delayProxy
		pool := poolWith(t, b, func(pc *pgxpool.Config) {
			proxy = startDelayProxy(t, net.JoinHostPort(pc.ConnConfig.Host, strconv.Itoa(int(pc.ConnConfig.Port))), 1500*time.Millisecond)
			host, port, err := net.SplitHostPort(proxy.addr)
			require.NoError(t, err)
			n, err := strconv.Atoi(port)
			require.NoError(t, err)
			pc.ConnConfig.Host, pc.ConnConfig.Port = host, uint16(n)
			pc.MaxConns = 2
		})
		h := &recorder{}
		r := b.relay(t, pool, h, outbox.RelayConfig{LeaseDuration: lease, MaxAttempts: 1})
		// Warm up: the claim's statements are prepared on the pool's
		// connection, which the proxy then holds back.
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Zero(t, n)
		b.appendCommitted(t, newMessage("s", "k", 1))
		proxy.delayOpen()
		cut, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		n, err = r.RunOnce(cut)
		cancel()
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.Zero(t, n)
		return h
	}

	t.Run("LeavesNoPartitionLeased", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		h := cutOff(t, b, 20*time.Second)
		time.Sleep(2 * time.Second) // the held messages have reached the server
		var held int
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM `+b.leasesTable()+` WHERE leased_until > now()`).Scan(&held))
		require.Zero(t, held, "a partition is leased to the cut-off claim, which its relay released")
		other := &recorder{}
		n, err := b.relay(t, nil, other, outbox.RelayConfig{MaxAttempts: 1}).RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n, "the row waits for the lease of a claim nobody holds")
		require.Empty(t, h.seen())
	})

	t.Run("BuriesNoRowNoHandlerSaw", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		h := cutOff(t, b, 2*time.Second)
		time.Sleep(3500 * time.Millisecond) // a late claim would have committed, and its lease run out
		other := &recorder{}
		r := b.relay(t, nil, other, outbox.RelayConfig{MaxAttempts: 1})
		n, err := r.RunOnce(ctx)
		require.NoError(t, err)
		dead, err := r.DeadLetters(ctx, 0, 10)
		require.NoError(t, err)
		require.Empty(t, dead, "a row no Handler saw was buried as crashed")
		require.Equal(t, 1, n, "the row, never handed to a Handler, is delivered")
		require.Empty(t, h.seen())
	})
}

// delayProxy forwards TCP to upstream; client-to-server bytes of the
// connections marked by delayOpen are held for delay before being
// forwarded (a claim's messages that reach its backend late: a loaded
// server, a retransmission). A client that closes its side still has its
// held bytes delivered, as the kernel would.
type delayProxy struct {
	addr  string
	delay time.Duration
	mu    sync.Mutex
	open  []*atomic.Bool
}

func startDelayProxy(t *testing.T, upstream string, delay time.Duration) *delayProxy {
	p := &delayProxy{delay: delay}
	p.addr = forwardTCP(t, upstream, func(c, s net.Conn) {
		delayed := &atomic.Bool{}
		p.mu.Lock()
		p.open = append(p.open, delayed)
		p.mu.Unlock()
		go func() { // server to client; keeps draining when the client is gone
			buf := make([]byte, 1<<16)
			for {
				n, err := s.Read(buf)
				if n > 0 {
					_, _ = c.Write(buf[:n])
				}
				if err != nil {
					_ = c.Close()
					return
				}
			}
		}()
		buf := make([]byte, 1<<16) // client to server
		for {
			n, err := c.Read(buf)
			if n > 0 {
				chunk := append([]byte(nil), buf[:n]...)
				if delayed.Load() {
					time.Sleep(p.delay)
				}
				_, _ = s.Write(chunk)
			}
			if err != nil {
				time.Sleep(p.delay) // let the server read what was held
				_ = s.Close()
				return
			}
		}
	})
	return p
}

// delayOpen delays the connections open now, not those opened later.
func (p *delayProxy) delayOpen() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, d := range p.open {
		d.Store(true)
	}
}
