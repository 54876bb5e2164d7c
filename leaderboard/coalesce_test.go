package leaderboard

import (
	"context"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
)

// groupBundle is a board whose Submit statements the test can hold back:
// it runs on a small pool of its own (one connection unless said), whose
// connections the test takes (hold) and gives back (release), with one
// flusher that never counts as stalled. A test queues calls one at a time
// behind a first, held one, so it knows which calls share a statement.
type groupBundle struct {
	*testBundle
	board *Board
	pool  *pgxpool.Pool
	held  []*pgxpool.Conn
}

func setupGroups(t *testing.T, mutate ...func(*Config)) *groupBundle {
	t.Helper()
	return setupGroupsOn(t, 1, mutate...)
}

func setupGroupsOn(t *testing.T, conns int32, mutate ...func(*Config)) *groupBundle {
	t.Helper()
	tb := setup(t, mutate...)
	pc, err := pgxpool.ParseConfig(tb.pg.ConnString)
	require.NoError(t, err)
	pc.MaxConns = conns
	pool, err := pgxpool.NewWithConfig(context.Background(), pc)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return groupsOn(t, tb, pool)
}

// groupsOn returns tb's board rebuilt on pool, with one flusher that never
// counts as stalled.
func groupsOn(t *testing.T, tb *testBundle, pool *pgxpool.Pool) *groupBundle {
	t.Helper()
	cfg := tb.board.Config()
	cfg.SubmitStatements = 1
	board, err := New(pool, tb.rd.Client, &cfg)
	require.NoError(t, err)
	board.group.stallAfter = time.Hour
	t.Cleanup(board.Close)
	return &groupBundle{testBundle: tb, board: board, pool: pool}
}

// hold takes every connection of the board's pool.
func (gb *groupBundle) hold(t *testing.T) {
	t.Helper()
	for range gb.pool.Config().MaxConns {
		conn, err := gb.pool.Acquire(context.Background())
		require.NoError(t, err)
		gb.held = append(gb.held, conn)
	}
	t.Cleanup(gb.release) // before the board's Close, which waits for the statement
}

func (gb *groupBundle) release() {
	for _, conn := range gb.held {
		conn.Release()
	}
	gb.held = nil
}

// groupBehindFirst queues cmds, in order, as one group behind a first call
// (of user-z) that holds the board's only statement, lets them run, and
// returns their outcomes once the first call is done.
func (gb *groupBundle) groupBehindFirst(t *testing.T, ctx context.Context, cmds ...Command) []<-chan outcome {
	t.Helper()
	gb.hold(t)
	firstOut := gb.submitQueued(t, ctx, Command{EventID: uuid.New(), UserID: "user-z", Delta: 1}, 0)
	outs := make([]<-chan outcome, len(cmds))
	for i, cmd := range cmds {
		outs[i] = gb.submitQueued(t, ctx, cmd, i+1)
	}
	gb.release()
	require.NoError(t, wait(t, firstOut).err)
	return outs
}

// enqueue queues calls as Submit queues a call that finds every statement
// busy, and starts a flusher if one may start: a test builds the calls
// itself to control their contexts.
func (g *submitGroup) enqueue(calls ...*submitCall) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.queue = append(g.queue, calls...)
	g.startFlusherLocked()
}

// outcome is what a Submit call returned.
type outcome struct {
	res Result
	err error
}

// submitQueued starts Submit(ctx, cmd) and returns once the call is queued
// behind queued others. The first call of a test (queued 0) waits until no
// flusher runs, and returns once the flusher it starts has taken it: that
// flusher then waits for the held connection.
func (gb *groupBundle) submitQueued(t *testing.T, ctx context.Context, cmd Command, queued int) <-chan outcome {
	t.Helper()
	if queued == 0 {
		// No flusher may run yet: the one this call starts must take it.
		// (wait returns when the statements are done; their flusher retires
		// a moment later.)
		gb.board.group.wait()
		g := &gb.board.group
		require.Eventually(t, func() bool {
			g.mu.Lock()
			defer g.mu.Unlock()
			return g.flushers == 0 && len(g.queue) == 0
		}, 5*time.Second, time.Millisecond, "a flusher is still running")
	}
	out := make(chan outcome, 1)
	go func() {
		res, err := gb.board.Submit(ctx, cmd)
		out <- outcome{res, err}
	}()
	g := &gb.board.group
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		g.mu.Lock()
		n, flushers := len(g.queue), g.flushers
		g.mu.Unlock()
		if n == queued && flushers == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the call was not queued behind %d others in 5 s: %d queued, %d flushers", queued, n, flushers)
		}
	}
	return out
}

func wait(t *testing.T, c <-chan outcome) outcome {
	t.Helper()
	select {
	case o := <-c:
		return o
	case <-time.After(10 * time.Second):
		t.Fatal("Submit did not return")
		return outcome{}
	}
}

// transactions returns how many transactions wrote the score events of ids.
func (tb *testBundle) transactions(t *testing.T, ids ...uuid.UUID) int {
	t.Helper()
	var n int
	require.NoError(t, tb.pg.Pool.QueryRow(context.Background(),
		`SELECT count(DISTINCT xmin::text) FROM score_events WHERE event_id = ANY ($1)`, ids).Scan(&n))
	return n
}

func TestSubmitGroups(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("ConcurrentCallsShareOneStatement", func(t *testing.T) {
		t.Parallel()
		gb := setupGroups(t)
		gb.hold(t)
		first := Command{EventID: uuid.New(), UserID: "user-z", Delta: 4}
		firstOut := gb.submitQueued(t, ctx, first, 0)
		var (
			cmds []Command
			outs []<-chan outcome
		)
		for i, user := range []string{"user-a", "user-b", "user-a", "user-c", "user-a"} {
			cmd := Command{EventID: uuid.New(), UserID: user, Delta: int64(i + 1)}
			cmds = append(cmds, cmd)
			outs = append(outs, gb.submitQueued(t, ctx, cmd, i+1))
		}
		gb.release()

		o := wait(t, firstOut)
		require.NoError(t, o.err)
		require.Equal(t, Result{Score: 4, Version: 1}, o.res)
		// Each command keeps its own result, in queue order per user.
		want := []Result{{Score: 1, Version: 1}, {Score: 2, Version: 1}, {Score: 4, Version: 2}, {Score: 4, Version: 1}, {Score: 9, Version: 3}}
		ids := []uuid.UUID{}
		for i, c := range outs {
			o := wait(t, c)
			require.NoError(t, o.err, "call %d", i)
			require.Equal(t, want[i], o.res, "call %d", i)
			ids = append(ids, cmds[i].EventID)
		}
		require.Equal(t, 1, gb.transactions(t, ids...), "the queued calls share a transaction")
		require.Equal(t, 2, gb.transactions(t, append(ids, first.EventID)...))

		// Every event is recorded with its own result and, as with a Submit
		// on its own, has its own outbox row.
		for i, cmd := range cmds {
			var score, version int64
			require.NoError(t, gb.pg.Pool.QueryRow(ctx, `SELECT score, version FROM score_events WHERE event_id = $1`, cmd.EventID).Scan(&score, &version))
			require.Equal(t, want[i], Result{Score: score, Version: version})
		}
		rows, err := gb.pg.Pool.Query(ctx, `SELECT key, version, convert_from(payload, 'UTF8') FROM verity_outbox WHERE key <> 'user-z' ORDER BY key, version`)
		require.NoError(t, err)
		type queued struct {
			key     string
			version int64
			payload string
		}
		var got []queued
		for rows.Next() {
			var q queued
			require.NoError(t, rows.Scan(&q.key, &q.version, &q.payload))
			got = append(got, q)
		}
		require.NoError(t, rows.Err())
		require.Equal(t, []queued{{"user-a", 1, "1"}, {"user-a", 2, "4"}, {"user-a", 3, "9"}, {"user-b", 1, "2"}, {"user-c", 1, "4"}}, got)
	})

	t.Run("BoundedByMaxSubmitsPerStatement", func(t *testing.T) {
		t.Parallel()
		gb := setupGroups(t, func(c *Config) { c.MaxSubmitsPerStatement = 2 })
		gb.hold(t)
		var ids []uuid.UUID
		var outs []<-chan outcome
		for i := range 6 {
			cmd := Command{EventID: uuid.New(), UserID: fmt.Sprintf("user-%d", i), Delta: 1}
			ids = append(ids, cmd.EventID)
			outs = append(outs, gb.submitQueued(t, ctx, cmd, i))
		}
		gb.release()
		for _, c := range outs {
			require.NoError(t, wait(t, c).err)
		}
		require.Equal(t, 4, gb.transactions(t, ids...), "1, then 2, 2 and 1")
	})

	t.Run("OneTurnsGroupingOff", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) { c.MaxSubmitsPerStatement = 1 })
		// With every statement slot of the group counted as busy, a Submit
		// that went through the group would queue with no flusher to take
		// it.
		g := &tb.board.group
		setFlushers := func(n int) {
			g.mu.Lock()
			defer g.mu.Unlock()
			g.flushers = n
		}
		setFlushers(tb.board.cfg.SubmitStatements)
		defer setFlushers(0)
		out := make(chan outcome, 1)
		go func() {
			res, err := tb.board.Submit(ctx, Command{EventID: uuid.New(), UserID: "user-a", Delta: 1})
			out <- outcome{res, err}
		}()
		var o outcome
		select {
		case o = <-out:
		case <-time.After(5 * time.Second):
			t.Fatal("Submit went through the group")
		}
		require.NoError(t, o.err)
		require.Equal(t, Result{Score: 1, Version: 1}, o.res)
	})

	t.Run("TwinsInOneStatement", func(t *testing.T) {
		t.Parallel()
		gb := setupGroups(t)
		cmd := Command{EventID: uuid.New(), UserID: "user-a", Delta: 3}
		other := Command{EventID: uuid.New(), UserID: "user-b", Delta: 1}
		outs := gb.groupBehindFirst(t, ctx, cmd, cmd, other)

		oa, ot, ob := wait(t, outs[0]), wait(t, outs[1]), wait(t, outs[2])
		require.NoError(t, oa.err)
		require.NoError(t, ot.err)
		require.NoError(t, ob.err)
		require.Equal(t, Result{Score: 3, Version: 1}, oa.res)
		require.Equal(t, Result{Score: 3, Version: 1, Duplicate: true}, ot.res)
		require.Equal(t, 1, gb.transactions(t, cmd.EventID, other.EventID))
		events, _, _ := gb.counts(t)
		require.Equal(t, 3, events)
	})

	t.Run("ConflictGivesEachCallItsOwnOutcome", func(t *testing.T) {
		t.Parallel()
		gb := setupGroups(t, func(c *Config) { c.MinDelta, c.MaxDelta = MinScore, MaxScore })
		_, err := gb.board.Submit(ctx, Command{EventID: uuid.New(), UserID: "user-high", Delta: MaxScore - 1})
		require.NoError(t, err)
		id := uuid.New()
		ok1 := Command{EventID: uuid.New(), UserID: "user-a", Delta: 1}
		reused := Command{EventID: id, UserID: "user-b", Delta: 1}
		conflicting := Command{EventID: id, UserID: "user-c", Delta: 1}
		overflow := Command{EventID: uuid.New(), UserID: "user-high", Delta: 5}
		ok2 := Command{EventID: uuid.New(), UserID: "user-a", Delta: 1}
		outs := gb.groupBehindFirst(t, ctx, ok1, reused, conflicting, overflow, ok2)

		// Replayed concurrently: the two commands of user-a get versions 1
		// and 2 in either order, and either user of the reused id wins.
		a1, a2 := wait(t, outs[0]), wait(t, outs[4])
		require.NoError(t, a1.err)
		require.NoError(t, a2.err)
		require.ElementsMatch(t, []Result{{Score: 1, Version: 1}, {Score: 2, Version: 2}}, []Result{a1.res, a2.res})
		b, c := wait(t, outs[1]), wait(t, outs[2])
		winner, loser, lost := reused, b, c
		if c.err == nil {
			winner, loser, lost = conflicting, c, b
		}
		require.NoError(t, loser.err, "one of the two uses of the id is applied")
		require.Equal(t, Result{Score: 1, Version: 1}, loser.res)
		var conflict *IdempotencyConflictError
		require.ErrorAs(t, lost.err, &conflict)
		require.Equal(t, winner.UserID, conflict.UserID)
		o := wait(t, outs[3])
		var tooHigh *ScoreOutOfRangeError
		require.ErrorAs(t, o.err, &tooHigh)
		require.Equal(t, "user-high", tooHigh.UserID)

		var high int64
		require.NoError(t, gb.pg.Pool.QueryRow(ctx, `SELECT score FROM user_scores WHERE user_id = 'user-high'`).Scan(&high))
		require.Equal(t, MaxScore-1, high, "the refused command wrote nothing")
		events, users, _ := gb.counts(t)
		require.Equal(t, 5, events) // user-high's first, user-z, ok1, reused, ok2
		require.Equal(t, 4, users)
	})

	// A group one of whose commands reuses an event id recorded earlier
	// for another user, or on another board, with the same delta: the
	// shared statement writes nothing, and each call gets its own outcome,
	// the group's other command applied once, not reported as a duplicate.
	t.Run("ConflictWithARecordedCommandGivesEachCallItsOwnOutcome", func(t *testing.T) {
		t.Parallel()
		for _, board := range []string{"", "other"} { // "": this board
			name := "AnotherUser"
			if board != "" {
				name = "AnotherBoard"
			}
			t.Run(name, func(t *testing.T) {
				gb := setupGroups(t)
				recorder := gb.board
				if board != "" {
					recorder = gb.sibling(t, board)
				}
				recorded := Command{EventID: uuid.New(), UserID: "user-b", Delta: 1}
				_, err := recorder.Submit(ctx, recorded)
				require.NoError(t, err)
				reused := recorded
				if board == "" {
					reused.UserID = "user-c"
				}

				ok := Command{EventID: uuid.New(), UserID: "user-a", Delta: 1}
				outs := gb.groupBehindFirst(t, ctx, ok, reused)

				o := wait(t, outs[0])
				require.NoError(t, o.err)
				require.Equal(t, Result{Score: 1, Version: 1}, o.res, "applied once, by its own call")
				var conflict *IdempotencyConflictError
				require.ErrorAs(t, wait(t, outs[1]).err, &conflict)
				require.Equal(t, &IdempotencyConflictError{EventID: recorded.EventID, Board: recorder.Name(),
					UserID: recorded.UserID, Delta: recorded.Delta, Attempted: reused}, conflict)
				events, users, queued := gb.counts(t)
				require.Equal(t, []int{3, 3, 3}, []int{events, users, queued}) // recorded, user-z, ok
			})
		}
	})

	t.Run("ConflictInTheGroupNeedsNoLookup", func(t *testing.T) {
		t.Parallel()
		// A group that uses an event id for two commands applies each
		// command on its own, which reports the conflict to the call that
		// loses: it must not first look up the command recorded under the
		// id, as SubmitBatch does to describe its conflict. Here that
		// lookup always fails; had the group run it, every call of the
		// group would have got its error.
		gb := setupGroups(t)
		gb.board.sql.lookupEvent = `SELECT 1/0 WHERE $1::uuid IS NOT NULL`
		id := uuid.New()
		ok := Command{EventID: uuid.New(), UserID: "user-a", Delta: 1}
		reused := Command{EventID: id, UserID: "user-b", Delta: 1}
		conflicting := Command{EventID: id, UserID: "user-c", Delta: 1}
		outs := gb.groupBehindFirst(t, ctx, ok, reused, conflicting)

		o := wait(t, outs[0])
		require.NoError(t, o.err)
		require.Equal(t, Result{Score: 1, Version: 1}, o.res)
		// One connection: the two uses of the id run one after the other,
		// and the second sees the first's command recorded.
		b, c := wait(t, outs[1]), wait(t, outs[2])
		lost := c
		if c.err == nil {
			lost = b
		} else {
			require.NoError(t, b.err, "one of the two uses of the id is applied")
		}
		var conflict *IdempotencyConflictError
		require.ErrorAs(t, lost.err, &conflict)
		events, _, _ := gb.counts(t)
		require.Equal(t, 3, events) // user-z, ok and one use of the id
	})

	t.Run("LockedRowHoldsUpOnlyItsCommand", func(t *testing.T) {
		t.Parallel()
		// A caller holds user-a's row in its own transaction and, before
		// committing, submits for user-b; another client's Submit of
		// user-a shares that statement. The group must not wait for the
		// lock as a whole: the caller would be waiting for itself.
		gb := setupGroupsOn(t, 3)
		_, err := gb.board.Submit(ctx, Command{EventID: uuid.New(), UserID: "user-a", Delta: 1})
		require.NoError(t, err)
		tx, err := gb.pg.Pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // rolled back below
		_, err = gb.board.SubmitTx(ctx, tx, Command{EventID: uuid.New(), UserID: "user-a", Delta: 1})
		require.NoError(t, err)

		gb.hold(t)
		first := gb.submitQueued(t, ctx, Command{EventID: uuid.New(), UserID: "user-z", Delta: 1}, 0)
		other := gb.submitQueued(t, ctx, Command{EventID: uuid.New(), UserID: "user-a", Delta: 1}, 1)
		mctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		mine := gb.submitQueued(t, mctx, Command{EventID: uuid.New(), UserID: "user-b", Delta: 1}, 2)
		gb.release()
		require.NoError(t, wait(t, first).err)

		o := wait(t, mine)
		require.NoError(t, o.err, "the Submit of user-b waited for user-a's lock")
		require.Equal(t, Result{Score: 1, Version: 1}, o.res)
		select {
		case o := <-other:
			t.Fatalf("the Submit of user-a returned while its row was locked: %+v", o)
		default:
		}
		require.NoError(t, tx.Rollback(ctx))
		o = wait(t, other)
		require.NoError(t, o.err)
		require.Equal(t, Result{Score: 2, Version: 2}, o.res)
	})

	t.Run("LockTimeoutDoesNotOutliveTheStatement", func(t *testing.T) {
		t.Parallel()
		gb := setupGroups(t) // one connection: the next query runs on it
		cmds := []Command{{EventID: uuid.New(), UserID: "user-a", Delta: 1}, {EventID: uuid.New(), UserID: "user-b", Delta: 2}}
		out, err := gb.board.submitBatch(ctx, cmds, batchOptions{everyState: true, lockTimeout: submitLockTimeout})
		require.NoError(t, err)
		require.Equal(t, []Result{{Score: 1, Version: 1}, {Score: 2, Version: 1}}, out)
		var setting string
		require.NoError(t, gb.pool.QueryRow(ctx, `SHOW lock_timeout`).Scan(&setting))
		require.Equal(t, "0", setting)
	})

	t.Run("LoneCallIsSentByItsCaller", func(t *testing.T) {
		t.Parallel()
		// With no statement under way and nobody queued, the call's own
		// goroutine applies it: no flusher goroutine runs. A call queued
		// meanwhile is served by a flusher once the lone one is done.
		gb := setupGroups(t)
		gb.hold(t)
		lone := Command{EventID: uuid.New(), UserID: "user-a", Delta: 2}
		loneOut := gb.submitQueued(t, ctx, lone, 0)
		// Other tests' boards run in this process: look for this group's
		// methods by their receiver.
		stacks := make([]byte, 1<<20)
		stacks = stacks[:runtime.Stack(stacks, true)]
		g := &gb.board.group
		require.Contains(t, string(stacks), fmt.Sprintf("(*submitGroup).applyAlone(%p", g), "the caller applies its call")
		require.NotContains(t, string(stacks), fmt.Sprintf("(*submitGroup).flush(%p", g), "no flusher goroutine")
		next := Command{EventID: uuid.New(), UserID: "user-a", Delta: 3}
		nextOut := gb.submitQueued(t, ctx, next, 1)
		gb.release()
		o := wait(t, loneOut)
		require.NoError(t, o.err)
		require.Equal(t, Result{Score: 2, Version: 1}, o.res)
		o = wait(t, nextOut)
		require.NoError(t, o.err)
		require.Equal(t, Result{Score: 5, Version: 2}, o.res)
		require.Equal(t, 2, gb.transactions(t, lone.EventID, next.EventID))
	})

	t.Run("EndedWhileQueuedIsNotTaken", func(t *testing.T) {
		t.Parallel()
		// A caller's ctx has ended but its goroutine has not run yet: the
		// call is still queued. The flusher must drop it, not write it
		// alongside a live call.
		gb := setupGroups(t)
		g := &gb.board.group
		ended, cancel := context.WithCancel(ctx)
		cancel()
		live := &submitCall{ctx: ctx, cmd: Command{EventID: uuid.New(), UserID: "user-a", Delta: 1}, done: make(chan struct{})}
		dead := &submitCall{ctx: ended, cmd: Command{EventID: uuid.New(), UserID: "user-b", Delta: 1}, done: make(chan struct{})}
		g.enqueue(live, dead)
		<-live.done
		<-dead.done
		require.NoError(t, live.err)
		require.ErrorIs(t, dead.err, context.Canceled)
		require.Zero(t, gb.transactions(t, dead.cmd.EventID))
	})

	// Close waits for statements that callers send themselves too: an
	// ungrouped Submit and a SubmitBatch, held up by a row lock.
	t.Run("CloseWaitsForUngroupedAndBatchStatements", func(t *testing.T) {
		t.Parallel()
		for name, send := range map[string]func(b *Board) error{
			"Ungrouped": func(b *Board) error {
				_, err := b.Submit(ctx, Command{EventID: uuid.New(), UserID: "user-a", Delta: 1})
				return err
			},
			"Batch": func(b *Board) error {
				_, err := b.SubmitBatch(ctx, []Command{{EventID: uuid.New(), UserID: "user-a", Delta: 1}})
				return err
			},
		} {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				tb := setup(t, func(c *Config) { c.MaxSubmitsPerStatement = 1 })
				require.NoError(t, send(tb.board)) // user-a's row exists
				tx, waitBlocked := lockUserRow(t, tb, "user-a")
				sent := make(chan error, 1)
				go func() { sent <- send(tb.board) }()
				waitBlocked("the statement did not wait for the lock")

				closed := make(chan struct{})
				go func() { tb.board.Close(); close(closed) }()
				select {
				case <-closed:
					t.Fatal("Close returned while a statement was under way")
				case <-time.After(100 * time.Millisecond):
				}
				require.NoError(t, tx.Rollback(ctx))
				require.NoError(t, <-sent)
				<-closed
			})
		}
	})

	t.Run("CloseDuringSubmits", func(t *testing.T) {
		t.Parallel()
		// Close waits for the statements under way when it is called, not
		// for traffic that keeps coming, and may race with calls that start
		// flushers.
		tb := setup(t)
		for round := range 20 {
			board, err := New(tb.pg.Pool, tb.rd.Client, tb.board.cfg)
			require.NoError(t, err)
			stop := make(chan struct{})
			errs := make(chan error, 4)
			for c := range 4 {
				go func() {
					for i := 0; ; i++ {
						select {
						case <-stop:
							errs <- nil
							return
						default:
						}
						if _, err := board.Submit(ctx, Command{EventID: uuid.New(), UserID: fmt.Sprintf("u%d-%d-%d", round, c, i%3), Delta: 1}); err != nil {
							errs <- err
							return
						}
					}
				}()
			}
			time.Sleep(2 * time.Millisecond)
			closed := make(chan struct{})
			go func() {
				board.Close()
				close(closed)
			}()
			select {
			case <-closed:
			case <-time.After(5 * time.Second):
				t.Fatal("Close did not return while Submit calls kept coming")
			}
			close(stop)
			for range 4 {
				require.NoError(t, <-errs)
			}
			board.Close()
		}
	})

	t.Run("CancelledWhileQueuedWritesNothing", func(t *testing.T) {
		t.Parallel()
		gb := setupGroups(t)
		gb.hold(t)
		firstOut := gb.submitQueued(t, ctx, Command{EventID: uuid.New(), UserID: "user-z", Delta: 1}, 0)
		cctx, cancel := context.WithCancel(ctx)
		cmd := Command{EventID: uuid.New(), UserID: "user-a", Delta: 1}
		out := gb.submitQueued(t, cctx, cmd, 1)
		cancel()
		require.ErrorIs(t, wait(t, out).err, context.Canceled)
		gb.release()
		require.NoError(t, wait(t, firstOut).err)
		gb.board.Close() // the flusher is done
		events, _, _ := gb.counts(t)
		require.Equal(t, 1, events)
		require.Zero(t, gb.transactions(t, cmd.EventID))
	})

	t.Run("CancelledWhileItsGroupWaitsForAConnectionWritesNothing", func(t *testing.T) {
		t.Parallel()
		// The pool stops the connection of the group led by the call
		// carrying groupKey (its statement's ctx keeps that call's values)
		// on its way out, as an exhausted pool would keep it waiting.
		type groupKey struct{}
		entered, proceed := make(chan struct{}), make(chan struct{})
		tb := setup(t)
		pc, err := pgxpool.ParseConfig(tb.pg.ConnString)
		require.NoError(t, err)
		pc.MaxConns = 1
		pc.PrepareConn = func(ctx context.Context, _ *pgx.Conn) (bool, error) {
			if ctx.Value(groupKey{}) != nil {
				close(entered)
				<-proceed
			}
			return true, nil
		}
		pool, err := pgxpool.NewWithConfig(ctx, pc)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		gb := groupsOn(t, tb, pool)

		gb.hold(t)
		first := gb.submitQueued(t, ctx, Command{EventID: uuid.New(), UserID: "user-z", Delta: 1}, 0)
		cctx, cancel := context.WithCancel(context.WithValue(ctx, groupKey{}, true))
		defer cancel()
		cancelled := Command{EventID: uuid.New(), UserID: "user-a", Delta: 1}
		a := gb.submitQueued(t, cctx, cancelled, 1)
		b := gb.submitQueued(t, ctx, Command{EventID: uuid.New(), UserID: "user-b", Delta: 1}, 2)
		gb.release()
		require.NoError(t, wait(t, first).err)
		select {
		case <-entered: // the flusher took user-a and user-b; their connection waits
		case <-time.After(10 * time.Second):
			t.Fatal("the group of user-a and user-b never asked for a connection")
		}
		cancel()
		require.ErrorIs(t, wait(t, a).err, context.Canceled)
		close(proceed)
		o := wait(t, b)
		require.NoError(t, o.err)
		require.Equal(t, Result{Score: 1, Version: 1}, o.res)
		gb.board.Close()
		require.Zero(t, gb.transactions(t, cancelled.EventID), "a call cancelled before its statement was sent wrote")
	})

	t.Run("CancelledCallersLeaveTheOthers", func(t *testing.T) {
		t.Parallel()
		gb := setupGroups(t)
		gb.hold(t)
		cctx, cancel := context.WithCancel(ctx)
		first := gb.submitQueued(t, cctx, Command{EventID: uuid.New(), UserID: "user-z", Delta: 1}, 0)
		cancel() // the first caller gives up while its statement waits
		require.ErrorIs(t, wait(t, first).err, context.Canceled)
		// The flusher has given the first call up, or will: either way the
		// second is taken at once.
		second := gb.submitQueued(t, ctx, Command{EventID: uuid.New(), UserID: "user-a", Delta: 1}, 0)
		gb.release()
		o := wait(t, second)
		require.NoError(t, o.err)
		require.Equal(t, Result{Score: 1, Version: 1}, o.res)
	})

	t.Run("StalledStatementDoesNotHoldUpOthers", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) { c.SubmitStatements = 1 })
		_, err := tb.board.Submit(ctx, Command{EventID: uuid.New(), UserID: "user-a", Delta: 1})
		require.NoError(t, err)
		// A caller's transaction holds user-a's row: the next Submit of
		// user-a waits for it, in the board's only statement slot.
		tx, waitBlocked := lockUserRow(t, tb, "user-a")
		blocked := make(chan outcome, 1)
		go func() {
			res, err := tb.board.Submit(ctx, Command{EventID: uuid.New(), UserID: "user-a", Delta: 1})
			blocked <- outcome{res, err}
		}()
		waitBlocked("the Submit of user-a did not wait for the lock")

		// Other users' Submit calls go through while it waits.
		sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		for i := range 3 {
			res, err := tb.board.Submit(sctx, Command{EventID: uuid.New(), UserID: fmt.Sprintf("user-%d", i), Delta: 1})
			require.NoError(t, err)
			require.Equal(t, Result{Score: 1, Version: 1}, res)
		}
		select {
		case o := <-blocked:
			t.Fatalf("the Submit of user-a returned while its row was locked: %+v", o)
		default:
		}
		require.NoError(t, tx.Rollback(ctx))
		o := wait(t, blocked)
		require.NoError(t, o.err)
		require.Equal(t, Result{Score: 2, Version: 2}, o.res)
	})
}

// TestSubmitGroupsUnderLoad runs many concurrent Submit calls on few users,
// with twins, and checks every result against the events PostgreSQL
// recorded: each user's versions are 1..n with no gap or repeat, each
// result is its event's, and each user's score is the sum of its deltas.
func TestSubmitGroupsUnderLoad(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	const callers, each = 16, 40
	type sent struct {
		cmd Command
		res Result
	}
	results := make(chan sent, callers*each*2)
	errs := make(chan error, callers)
	for c := range callers {
		go func() {
			for i := range each {
				cmd := Command{EventID: uuid.New(), UserID: fmt.Sprintf("user-%d", (c+i)%5), Delta: int64(i%7 + 1)}
				res, err := tb.board.Submit(ctx, cmd)
				if err != nil {
					errs <- err
					return
				}
				results <- sent{cmd, res}
				if i%10 == 0 { // a client retry
					twin, err := tb.board.Submit(ctx, cmd)
					if err != nil {
						errs <- err
						return
					}
					if !twin.Duplicate || twin.Score != res.Score || twin.Version != res.Version {
						errs <- fmt.Errorf("retry of %s: got %+v, first %+v", cmd.EventID, twin, res)
						return
					}
				}
			}
			errs <- nil
		}()
	}
	for range callers {
		require.NoError(t, <-errs)
	}
	close(results)
	versions := map[string]map[int64]bool{}
	sums := map[string]int64{}
	n := 0
	for s := range results {
		n++
		require.False(t, s.res.Duplicate)
		var score, version int64
		require.NoError(t, tb.pg.Pool.QueryRow(ctx, `SELECT score, version FROM score_events WHERE event_id = $1`, s.cmd.EventID).Scan(&score, &version))
		require.Equal(t, Result{Score: score, Version: version}, s.res)
		if versions[s.cmd.UserID] == nil {
			versions[s.cmd.UserID] = map[int64]bool{}
		}
		require.False(t, versions[s.cmd.UserID][version], "version %d of %s twice", version, s.cmd.UserID)
		versions[s.cmd.UserID][version] = true
		sums[s.cmd.UserID] += s.cmd.Delta
	}
	require.Equal(t, callers*each, n)
	for user, vs := range versions {
		for v := int64(1); v <= int64(len(vs)); v++ {
			require.True(t, vs[v], "%s lacks version %d", user, v)
		}
		var score int64
		require.NoError(t, tb.pg.Pool.QueryRow(ctx, `SELECT score FROM user_scores WHERE user_id = $1`, user).Scan(&score))
		require.Equal(t, sums[user], score, user)
	}
	var shared int
	require.NoError(t, tb.pg.Pool.QueryRow(ctx, `SELECT count(*) - count(DISTINCT xmin::text) FROM score_events`).Scan(&shared))
	require.Positive(t, shared, "no two calls shared a statement")
}

// lockUserRow locks user's score row in a transaction of its own (rolled
// back at cleanup, if the test has not ended it) and returns it, with a
// function that waits until some statement is blocked by that transaction
// — this test's, not another test's lock wait in the shared database.
func lockUserRow(t *testing.T, tb *testBundle, user string) (pgx.Tx, func(msg string)) {
	t.Helper()
	ctx := context.Background()
	tx, err := tb.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	_, err = tx.Exec(ctx, `SELECT 1 FROM user_scores WHERE user_id = $1 FOR UPDATE`, user)
	require.NoError(t, err)
	var holder int32
	require.NoError(t, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&holder))
	return tx, func(msg string) {
		t.Helper()
		require.Eventually(t, func() bool {
			var waiting bool
			err := tb.pg.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
				WHERE $1 = ANY (pg_blocking_pids(pid)))`, holder).Scan(&waiting)
			return err == nil && waiting
		}, 5*time.Second, 5*time.Millisecond, msg)
	}
}
