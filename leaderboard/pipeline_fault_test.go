package leaderboard

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// TestSharedStatementGivesItsConnectionBack: however a grouped statement's
// result ends, its pool connection comes back. A statement sent with a
// lock timeout is a pipeline whose results hold the connection until they
// are closed; a read that fails between two rows must close them too.
func TestSharedStatementGivesItsConnectionBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("ConnectionResetBetweenRows", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		pool, mode := cutPool(t, tb)
		cfg := tb.board.Config()
		board, err := New(pool, tb.rd.Client, &cfg)
		require.NoError(t, err)
		t.Cleanup(board.Close)

		cmds := []Command{{EventID: uuid.New(), UserID: "user-a", Delta: 1}, {EventID: uuid.New(), UserID: "user-b", Delta: 1}}
		mode.Store(cutReset)
		_, err = board.submitBatch(ctx, cmds, batchOptions{everyState: true, lockTimeout: submitLockTimeout})
		t.Logf("submitBatch: %v", err)
		require.Error(t, err)
		mode.Store(cutOff)

		require.Zero(t, acquiredSettles(pool), "the dead connection's pool slot is still acquired")
		sctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		defer cancel()
		_, err = board.Submit(sctx, Command{EventID: uuid.New(), UserID: "later", Delta: 1})
		require.NoError(t, err, "a later Submit on the board")
	})

	t.Run("EveryCallerGoneBeforeTheResult", func(t *testing.T) {
		t.Parallel()
		// No network failure: the statement commits, but both callers'
		// contexts end before its result is read (they get ctx's error, as
		// documented), which cancels the read.
		tb := setup(t)
		pool, mode := cutPool(t, tb)
		gb := groupsOn(t, tb, pool)
		board := gb.board

		gb.hold(t)
		first := gb.submitQueued(t, ctx, Command{EventID: uuid.New(), UserID: "z", Delta: 1}, 0)
		actx, cancelA := context.WithCancel(ctx)
		bctx, cancelB := context.WithCancel(ctx)
		a := gb.submitQueued(t, actx, Command{EventID: uuid.New(), UserID: "a", Delta: 1}, 1)
		b := gb.submitQueued(t, bctx, Command{EventID: uuid.New(), UserID: "b", Delta: 1}, 2)
		mode.Store(cutStall) // cuts at the group statement's first row (7 columns)
		gb.release()
		require.NoError(t, wait(t, first).err)
		time.Sleep(300 * time.Millisecond) // the group statement has committed; its result is "in flight"
		cancelA()
		cancelB()
		require.ErrorIs(t, wait(t, a).err, context.Canceled)
		require.ErrorIs(t, wait(t, b).err, context.Canceled)
		mode.Store(cutOff)

		sctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		defer cancel()
		_, err := board.Submit(sctx, Command{EventID: uuid.New(), UserID: "later", Delta: 1})
		require.NoError(t, err, "a later Submit on the board (pool: %d of 1 connections acquired)", pool.Stat().AcquiredConns())
	})
}

// acquiredSettles waits briefly for the acquired count to drop to zero and
// returns the count it ended with.
func acquiredSettles(pool *pgxpool.Pool) int32 {
	deadline := time.Now().Add(2 * time.Second)
	for {
		n := pool.Stat().AcquiredConns()
		if n == 0 || time.Now().After(deadline) {
			return n
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// cutConn parses the server's message stream and, once armed, cuts it right
// after the first DataRow of submitBatchSQL (7 columns): mode cutReset then
// fails every later read (a connection reset between two rows of the
// result); mode cutStall delivers nothing more (the rest of the result, the
// commit's ReadyForQuery, is "in the network") until the read deadline pgx
// sets when the query's ctx ends.
type cutConn struct {
	net.Conn
	mode *atomic.Int32
	mu   sync.Mutex
	cut  bool
	hdr  [5]byte
	hdrN int
	left int
	pos  int
	cols [2]byte
}

const (
	cutOff int32 = iota
	cutReset
	cutStall
)

func (c *cutConn) Read(p []byte) (int, error) {
	c.mu.Lock()
	cut := c.cut
	c.mu.Unlock()
	if cut {
		if c.mode.Load() == cutReset {
			return 0, errors.New("injected: connection reset by peer")
		}
		var one [1]byte
		_, err := c.Conn.Read(one[:])
		if err == nil {
			err = errors.New("injected: unexpected data after the cut")
		}
		return 0, err
	}
	n, err := c.Conn.Read(p)
	c.mu.Lock()
	defer c.mu.Unlock()
	for i := 0; i < n; i++ {
		b := p[i]
		if c.hdrN < 5 {
			c.hdr[c.hdrN] = b
			c.hdrN++
			if c.hdrN == 5 {
				c.left, c.pos = int(binary.BigEndian.Uint32(c.hdr[1:]))-4, 0
				if c.left == 0 {
					c.hdrN = 0
				}
			}
			continue
		}
		if c.pos < 2 {
			c.cols[c.pos] = b
		}
		c.pos++
		c.left--
		if c.left == 0 {
			c.hdrN = 0
			if c.hdr[0] == 'D' && binary.BigEndian.Uint16(c.cols[:]) == 7 && c.mode.Load() != cutOff {
				c.cut = true
				return i + 1, nil
			}
		}
	}
	return n, err
}

// cutPool is a pool of one connection whose server stream cutConn watches.
func cutPool(t *testing.T, tb *testBundle) (*pgxpool.Pool, *atomic.Int32) {
	t.Helper()
	pc, err := pgxpool.ParseConfig(tb.pg.ConnString)
	require.NoError(t, err)
	pc.MaxConns = 1
	pc.ConnConfig.TLSConfig, pc.ConnConfig.Fallbacks = nil, nil // no SSLRequest: plain framing from the start
	mode := &atomic.Int32{}
	var d net.Dialer
	pc.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &cutConn{Conn: c, mode: mode}, nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), pc)
	require.NoError(t, err)
	t.Cleanup(func() {
		if n := pool.Stat().AcquiredConns(); n != 0 {
			t.Logf("NOT closing the pool: %d connection(s) still acquired (leaked)", n)
			return
		}
		pool.Close()
	})
	return pool, mode
}

// TestSubmitOutcomeUnknown: a Submit or SubmitBatch whose connection breaks
// after the server committed, before its answer arrived, cannot know
// whether the commands took effect. Its error says so (ErrOutcomeUnknown,
// the driver's error kept); it used to be a bare driver error, though the
// doc said that no error case wrote anything. A retry with the same event
// ids returns the original results as duplicates: one effect.
func TestSubmitOutcomeUnknown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	armed := &atomic.Bool{}
	var d net.Dialer
	pool := tb.newPool(t, func(pc *pgxpool.Config) {
		pc.MaxConns = 1
		pc.ConnConfig.TLSConfig, pc.ConnConfig.Fallbacks = nil, nil
		pc.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := d.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return &lostReplyConn{Conn: c, armed: armed}, nil
		}
	})
	cfg := tb.board.Config()
	cfg.MinDelta, cfg.MaxDelta = MinScore, MaxScore // PostgreSQL refuses an overflow
	board, err := New(pool, tb.rd.Client, &cfg)
	require.NoError(t, err)
	// No NOTIFY on the one connection: only the statements under test
	// read from it.
	board.Close()

	// Warm-ups: the connection is open and both statements are prepared,
	// so the armed read is the execution's answer.
	_, err = board.Submit(ctx, Command{EventID: uuid.New(), UserID: "u", Delta: 5})
	require.NoError(t, err)
	_, err = board.SubmitBatch(ctx, []Command{{EventID: uuid.New(), UserID: "w", Delta: 1}})
	require.NoError(t, err)

	cmd := Command{EventID: uuid.New(), UserID: "u", Delta: 7}
	armed.Store(true)
	_, err = board.Submit(ctx, cmd)
	require.ErrorIs(t, err, ErrOutcomeUnknown)
	require.ErrorContains(t, err, "injected: connection reset")
	events, _, _ := tb.counts(t)
	require.Equal(t, 3, events, "the Submit committed")
	// Moved on meanwhile; the retry still answers the original result.
	_, err = board.Submit(ctx, Command{EventID: uuid.New(), UserID: "u", Delta: 1})
	require.NoError(t, err)
	res, err := board.Submit(ctx, cmd)
	require.NoError(t, err)
	require.Equal(t, Result{Score: 12, Version: 2, Duplicate: true}, res)

	// The connection that replaced the broken one prepares the batch
	// statement first.
	_, err = board.SubmitBatch(ctx, []Command{{EventID: uuid.New(), UserID: "w", Delta: 1}})
	require.NoError(t, err)
	batch := []Command{{EventID: uuid.New(), UserID: "u", Delta: 2}, {EventID: uuid.New(), UserID: "v", Delta: 3}}
	armed.Store(true)
	_, err = board.SubmitBatch(ctx, batch)
	require.ErrorIs(t, err, ErrOutcomeUnknown)
	out, err := board.SubmitBatch(ctx, batch)
	require.NoError(t, err)
	require.Equal(t, []Result{{Score: 15, Version: 4, Duplicate: true}, {Score: 3, Version: 1, Duplicate: true}}, out)

	// A server error is no unknown outcome: nothing was written.
	_, err = board.Submit(ctx, Command{EventID: uuid.New(), UserID: "u", Delta: MaxScore})
	require.ErrorIs(t, err, ErrScoreOutOfRange)
	require.NotErrorIs(t, err, ErrOutcomeUnknown)
}

// TestSubmitOutcomeUnknownInEveryExecMode: in the simple protocol (every
// statement) and QueryExecModeExec (pipelines: grouped Submits, batches
// above 64 commands), pgx reports a reply lost after the commit as
// pgconn.ErrConnClosed, which pgconn marks safe to retry (nothing sent);
// the committed commands came back with that, not ErrOutcomeUnknown.
func TestSubmitOutcomeUnknownInEveryExecMode(t *testing.T) {
	t.Parallel()
	for name, mode := range map[string]pgx.QueryExecMode{"Exec": pgx.QueryExecModeExec, "SimpleProtocol": pgx.QueryExecModeSimpleProtocol} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			tb := setup(t)
			addr, _ := testenv.ServerAddr(t, tb.pg.ConnString)
			dropper := testenv.StartReplyDropper(t, addr)
			host, port, err := net.SplitHostPort(dropper.Addr())
			require.NoError(t, err)
			portNumber, err := strconv.Atoi(port)
			require.NoError(t, err)
			pool := tb.newPool(t, func(pc *pgxpool.Config) {
				pc.ConnConfig.Host, pc.ConnConfig.Port = host, uint16(portNumber)
				pc.ConnConfig.TLSConfig, pc.ConnConfig.Fallbacks = nil, nil
				pc.ConnConfig.DefaultQueryExecMode = mode
				pc.MaxConns = 1
			})
			gb := groupsOn(t, tb, pool)
			board := gb.board
			board.Close() // no NOTIFY on the one connection
			requireUnknownButCommitted := func(what string, err error, ids ...uuid.UUID) {
				t.Helper()
				var n int
				require.NoError(t, tb.pg.Pool.QueryRow(ctx, `SELECT count(*) FROM score_events WHERE event_id = ANY ($1)`, ids).Scan(&n))
				require.Equal(t, len(ids), n, "%s: setup: the reply was lost after the commit (%v)", what, err)
				require.ErrorIs(t, err, ErrOutcomeUnknown, what)
			}
			_, err = board.Submit(ctx, Command{EventID: uuid.New(), UserID: "w", Delta: 1})
			require.NoError(t, err)

			lone := Command{EventID: uuid.New(), UserID: "lone", Delta: 1}
			dropper.DropReplyAfter("user_id, delta\nFROM prior")
			_, err = board.Submit(ctx, lone)
			if mode == pgx.QueryExecModeSimpleProtocol { // in exec mode, unexpected EOF already
				requireUnknownButCommitted("lone Submit", err, lone.EventID)
			}

			batch := make([]Command, 100)
			ids := make([]uuid.UUID, len(batch))
			for i := range batch {
				batch[i] = Command{EventID: uuid.New(), UserID: fmt.Sprintf("u%d", i%7), Delta: 1}
				ids[i] = batch[i].EventID
			}
			dropper.DropReplyAfter("p.user_id::text, p.delta")
			_, err = board.SubmitBatch(ctx, batch)
			requireUnknownButCommitted("SubmitBatch of 100", err, ids...)

			first := Command{EventID: uuid.New(), UserID: "g1", Delta: 2}
			second := Command{EventID: uuid.New(), UserID: "g2", Delta: 3}
			dropper.DropReplyAfter("p.user_id::text, p.delta")
			outs := gb.groupBehindFirst(t, ctx, first, second)
			requireUnknownButCommitted("grouped Submit, first", wait(t, outs[0]).err, first.EventID)
			requireUnknownButCommitted("grouped Submit, second", wait(t, outs[1]).err, second.EventID)

			for _, cmd := range []Command{lone, first, second} { // the retries answer the originals
				res, err := board.Submit(ctx, cmd)
				require.NoError(t, err)
				require.True(t, res.Duplicate)
			}
		})
	}
}

// lostReplyConn, once armed, drops the next answer the server sends (it
// sends it after the commit: PostgreSQL flushes at ReadyForQuery) and fails
// that read and every later one: the commit happened, its answer was lost.
type lostReplyConn struct {
	net.Conn
	armed *atomic.Bool
	dead  atomic.Bool
}

func (c *lostReplyConn) Read(p []byte) (int, error) {
	if c.dead.Load() {
		return 0, errors.New("injected: connection reset by peer")
	}
	n, err := c.Conn.Read(p)
	if n > 0 && c.armed.CompareAndSwap(true, false) {
		c.dead.Store(true)
		_ = c.Conn.Close()
		return 0, errors.New("injected: connection reset by peer")
	}
	return n, err
}

// TestSubmitErrorsThatAreNotWhatTheySeem: errors that resemble another
// case. A closed pool sends nothing, so it is no unknown outcome. A clash
// on the outbox's primary key (its ids reset while a row is undelivered)
// is no event id used by another outbox writer: the event id is new.
func TestSubmitErrorsThatAreNotWhatTheySeem(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("ClosedPoolIsNoUnknownOutcome", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		pool := tb.newPool(t, func(*pgxpool.Config) {})
		cfg := tb.board.Config()
		board, err := New(pool, tb.rd.Client, &cfg)
		require.NoError(t, err)
		board.Close()
		pool.Close()
		_, err = board.Submit(ctx, Command{EventID: uuid.New(), UserID: "u", Delta: 1})
		require.Error(t, err)
		require.NotErrorIs(t, err, ErrOutcomeUnknown)
		_, err = board.SubmitBatch(ctx, []Command{{EventID: uuid.New(), UserID: "u", Delta: 1}})
		require.Error(t, err)
		require.NotErrorIs(t, err, ErrOutcomeUnknown)
	})

	// Statements no retry gets sent: pgx refuses, before sending
	// anything, every query of a pool whose exec mode needs a cache it was
	// told to keep empty, or of a session the simple protocol cannot quote
	// for; and a pool whose hooks refuse every connection (a token fetch
	// in BeforeConnect, type registration in AfterConnect, a PrepareConn
	// check) gives none to send on, which SubmitBatch, letting its query
	// take the connection, called an unknown outcome.
	t.Run("NothingSentIsNoUnknownOutcome", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		refused := errors.New("no token for the database today")
		pools := map[string]struct {
			mutate func(*pgxpool.Config)
			cause  error // the error's cause, when the pool's
		}{
			"StatementCacheDisabled": {mutate: func(c *pgxpool.Config) {
				c.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheStatement
				c.ConnConfig.StatementCacheCapacity = 0
			}},
			"DescriptionCacheDisabled": {mutate: func(c *pgxpool.Config) {
				c.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheDescribe
				c.ConnConfig.DescriptionCacheCapacity = 0
			}},
			"SimpleProtocolWithoutStandardStrings": {mutate: func(c *pgxpool.Config) {
				c.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
				c.ConnConfig.RuntimeParams["standard_conforming_strings"] = "off"
			}},
			"SimpleProtocolInLatin1": {mutate: func(c *pgxpool.Config) {
				c.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
				c.ConnConfig.RuntimeParams["client_encoding"] = "LATIN1"
			}},
			"BeforeConnectRefuses": {cause: refused, mutate: func(c *pgxpool.Config) {
				c.BeforeConnect = func(context.Context, *pgx.ConnConfig) error { return refused }
			}},
			"AfterConnectRefuses": {cause: refused, mutate: func(c *pgxpool.Config) {
				c.AfterConnect = func(context.Context, *pgx.Conn) error { return refused }
			}},
			"PrepareConnRefuses": {cause: refused, mutate: func(c *pgxpool.Config) {
				c.PrepareConn = func(context.Context, *pgx.Conn) (bool, error) { return true, refused }
			}},
		}
		cfg := tb.board.Config()
		for name, pool := range pools {
			board, err := New(tb.newPool(t, pool.mutate), tb.rd.Client, &cfg)
			require.NoError(t, err)
			t.Cleanup(board.Close)
			_, submitErr := board.Submit(ctx, Command{EventID: uuid.New(), UserID: "u", Delta: 1})
			_, batchErr := board.SubmitBatch(ctx, []Command{{EventID: uuid.New(), UserID: "u", Delta: 1}, {EventID: uuid.New(), UserID: "v", Delta: 1}})
			for _, err := range []error{submitErr, batchErr} {
				require.Error(t, err, name)
				require.NotErrorIs(t, err, ErrOutcomeUnknown, "%s: nothing was sent: %v", name, err)
				if pool.cause != nil {
					require.ErrorIs(t, err, pool.cause, name)
				}
			}
		}
		events, _, _ := tb.counts(t)
		require.Zero(t, events, "nothing was written")
	})

	t.Run("OutboxIDClashIsNoIdempotencyConflict", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		_, err := tb.board.SubmitBatch(ctx, []Command{{EventID: uuid.New(), UserID: "u", Delta: 1}, {EventID: uuid.New(), UserID: "w", Delta: 1}})
		require.NoError(t, err)
		_, err = tb.pg.Pool.Exec(ctx, `ALTER TABLE `+pgx.Identifier{tb.pg.Schema, tb.board.Config().OutboxTable}.Sanitize()+` ALTER COLUMN id RESTART WITH 1`)
		require.NoError(t, err)
		_, err = tb.board.Submit(ctx, Command{EventID: uuid.New(), UserID: "v", Delta: 1})
		require.Error(t, err)
		require.NotErrorIs(t, err, ErrIdempotencyConflict, "a new event id reported as used by another outbox writer")
		require.ErrorContains(t, err, "_pkey")
		_, err = tb.board.SubmitBatch(ctx, []Command{{EventID: uuid.New(), UserID: "v", Delta: 1}})
		require.Error(t, err)
		require.NotErrorIs(t, err, ErrIdempotencyConflict, "a new event id reported as used by another outbox writer")
		events, _, _ := tb.counts(t)
		require.Equal(t, 2, events, "nothing of the refused commands was written")
	})
}
