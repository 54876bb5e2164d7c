package outbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/outbox"
)

// TestReplayDeadLockedRows covers ReplayDead next to a transaction that
// holds dead letters (a concurrent replay, an operator's session).
func TestReplayDeadLockedRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// A locked dead letter is skipped and does not count towards Limit, so
	// a loop replaying until it moves 0 does not stop early.
	t.Run("LockedRowDoesNotUseUpLimit", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		for id := int64(1); id <= 3; id++ {
			b.insertDead(t, id, uuid.New())
		}
		lock := b.lockDead(t, 1)
		r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{})
		moved, err := r.ReplayDead(lockedCtx(t), outbox.ReplayFilter{Limit: 2})
		require.NoError(t, err)
		require.EqualValues(t, 2, moved)
		require.Equal(t, []int64{2, 3}, b.outboxIDs(t))
		require.NoError(t, lock.Rollback(ctx))
		moved, err = r.ReplayDead(ctx, outbox.ReplayFilter{Limit: 2})
		require.NoError(t, err)
		require.EqualValues(t, 1, moved)
		require.Equal(t, []int64{1, 2, 3}, b.outboxIDs(t))
	})

	// An event's newest dead letter is the one a replay moves and locks:
	// while another transaction holds it the event is skipped, not
	// replayed from an older copy, and it comes back from its newest copy
	// once the lock is gone.
	t.Run("LockedNewestCopySkipsEvent", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		event := uuid.New()
		b.insertDead(t, 1, event)
		b.insertDead(t, 2, uuid.New())
		b.insertDead(t, 5, event)
		lock := b.lockDead(t, 5)
		r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{})
		moved, err := r.ReplayDead(lockedCtx(t), outbox.ReplayFilter{})
		require.NoError(t, err)
		require.EqualValues(t, 1, moved)
		require.Equal(t, []int64{2}, b.outboxIDs(t))
		require.Equal(t, 2, b.count(t, b.deadTable()), "both copies of the held event stay")
		require.NoError(t, lock.Rollback(ctx))
		moved, err = r.ReplayDead(ctx, outbox.ReplayFilter{})
		require.NoError(t, err)
		require.EqualValues(t, 1, moved)
		require.Equal(t, []int64{2, 5}, b.outboxIDs(t))
		require.Zero(t, b.count(t, b.deadTable()), "the older copy went with the replay")
	})
}

// lockedCtx bounds a call that must not wait for a held lock, so that one
// that does fails instead of hanging the test.
func lockedCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// TestReplayDeadLongStream covers a dead letter whose stream is longer than
// MaxStreamBytes (buried before migration 005, or moved there by 007),
// which the outbox refuses: it used to fail a replay of all dead letters
// as a whole; it is now left in place, skipped and not counted.
func TestReplayDeadLongStream(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	long := strings.Repeat("x", 2000)
	_, err := b.pool.Exec(ctx, `INSERT INTO `+b.deadTable()+` (id, event_id, stream, key, version, payload, created_at, attempts, last_error)
		VALUES (1000000, $1, $2, 'k', 1, '\x00', now(), 3, 'buried before 005')`, uuid.New(), long)
	require.NoError(t, err)
	b.appendCommitted(t, newMessage("s", "ordinary", 1))
	r := b.relay(t, nil, &recorder{fail: func(outbox.Record) error { return errors.New("fails") }}, outbox.RelayConfig{MaxAttempts: 1})
	_, err = r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, b.count(t, b.deadTable()))

	moved, err := r.ReplayDead(ctx, outbox.ReplayFilter{})
	require.NoError(t, err)
	require.EqualValues(t, 1, moved, "the ordinary dead letter, alone")
	rows := b.rows(t)
	require.Len(t, rows, 1)
	require.Equal(t, "ordinary", rows[0].Key)
	dead, err := r.DeadLetters(ctx, 0, 10)
	require.NoError(t, err)
	require.Len(t, dead, 1)
	require.Equal(t, long, dead[0].Stream)

	moved, err = r.ReplayDead(ctx, outbox.ReplayFilter{})
	require.NoError(t, err)
	require.Zero(t, moved)
	require.Equal(t, 1, b.count(t, b.deadTable()))
}

// TestReplayDeadEventBackInOutbox covers a dead event that the outbox holds
// again (a client re-sent it): the replay must not deliver it twice, nor
// lose its dead letter.
func TestReplayDeadEventBackInOutbox(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// An event appended anew since it died is skipped, not counted, and
	// its dead letter stays; the other events are replayed.
	t.Run("AppendedBefore", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		again, other := b.twoDeadEvents(t)
		b.appendCommitted(t, again)
		r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{})

		moved, err := r.ReplayDead(ctx, outbox.ReplayFilter{})
		require.NoError(t, err)
		require.EqualValues(t, 1, moved)
		rows := b.rows(t)
		require.Len(t, rows, 2)
		require.Equal(t, again.EventID, rows[0].EventID)
		require.Equal(t, int64(2), rows[0].Version, "the appended row, untouched")
		require.Equal(t, replayDeadID+1, rows[1].ID, "the other event, from its dead letter")
		require.Equal(t, other, rows[1].EventID)
		requireDeadEvents(t, r, again.EventID)

		moved, err = r.ReplayDead(ctx, outbox.ReplayFilter{EventIDs: []uuid.UUID{again.EventID}})
		require.NoError(t, err)
		require.Zero(t, moved, "asked for by id, it is skipped all the same")
		require.Equal(t, 1, b.count(t, b.deadTable()))
	})

	// An event appended while the replay runs makes the replay's insert
	// fail on the unique key: the replay moves nothing, dead letters
	// included, and says why; a second replay skips that event.
	t.Run("AppendedDuringReplay", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		again, _ := b.twoDeadEvents(t)
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
		require.NoError(t, b.writer.Append(ctx, tx, again))

		appName := "replay-" + uuid.NewString()
		r := b.relay(t, newPoolNamed(t, b.pg.ConnString, appName), &recorder{}, outbox.RelayConfig{})
		type result struct {
			moved int64
			err   error
		}
		done := make(chan result, 1)
		go func() {
			moved, err := r.ReplayDead(lockedCtx(t), outbox.ReplayFilter{})
			done <- result{moved, err}
		}()
		// The replay waits on the appended row's unique key until the
		// append's transaction ends.
		require.Eventually(t, func() bool { return b.waitingForLock(appName, "") },
			5*time.Second, 10*time.Millisecond, "the replay never waited for the appended row")
		require.NoError(t, tx.Commit(ctx))

		res := <-done
		require.ErrorIs(t, res.err, outbox.ErrEventIDExists)
		require.Contains(t, res.err.Error(), again.EventID.String(), "the error names the event id")
		require.Zero(t, res.moved)
		rows := b.rows(t)
		require.Len(t, rows, 1, "nothing was replayed")
		require.Equal(t, again.EventID, rows[0].EventID)
		require.Equal(t, 2, b.count(t, b.deadTable()), "no dead letter was lost")

		moved, err := r.ReplayDead(ctx, outbox.ReplayFilter{})
		require.NoError(t, err)
		require.EqualValues(t, 1, moved, "the other event")
		require.Equal(t, []int64{rows[0].ID, replayDeadID + 1}, b.outboxIDs(t))
		requireDeadEvents(t, r, again.EventID)
	})
}

// TestReplayDeadDeadlockAndIDClash covers two clashes a replay's insert can
// meet besides an event back in the outbox: a deadlock with a transaction
// appending two dead events, and a dead letter whose id the outbox holds
// again.
func TestReplayDeadDeadlockAndIDClash(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// The caller's transaction appends dead event y, the replay inserts x
	// and waits for y, the caller appends x: a deadlock. PostgreSQL aborts
	// one side. When it is the replay, the replay (which moved nothing)
	// runs again instead of failing with a bare 40P01: it then names the
	// clash, or finds both events appended and moves nothing.
	t.Run("DeadlockWithAppendingTransaction", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		x, y := newMessage("s", "kx", 2), newMessage("s", "ky", 2)
		b.insertDead(t, replayDeadID, x.EventID)
		b.insertDead(t, replayDeadID+1, y.EventID)
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
		require.NoError(t, b.writer.Append(ctx, tx, y))

		appName := "replay-" + uuid.NewString()
		r := b.relay(t, newPoolNamed(t, b.pg.ConnString, appName), &recorder{}, outbox.RelayConfig{})
		done := make(chan error, 1)
		go func() {
			_, err := r.ReplayDead(lockedCtx(t), outbox.ReplayFilter{})
			done <- err
		}()
		require.Eventually(t, func() bool { return b.waitingForLock(appName, "") },
			5*time.Second, 10*time.Millisecond, "the replay never waited for the appended row")
		appendErr := b.writer.Append(ctx, tx, x)
		if appendErr != nil {
			// The caller's transaction lost the deadlock: a retryable
			// failure of its own; the replay then moves both events.
			var pgErr *pgconn.PgError
			require.ErrorAs(t, appendErr, &pgErr)
			require.Equal(t, "40P01", pgErr.Code)
			require.NoError(t, tx.Rollback(ctx))
			require.NoError(t, <-done)
			require.Len(t, b.rows(t), 2, "both events replayed")
			require.Zero(t, b.count(t, b.deadTable()))
			return
		}
		require.NoError(t, tx.Commit(ctx))
		if err := <-done; err != nil {
			require.ErrorIs(t, err, outbox.ErrEventIDExists, "a failed replay names the clash, not a bare deadlock")
		}
		require.Len(t, b.rows(t), 2, "the two appended rows, nothing replayed")
		require.Equal(t, 2, b.count(t, b.deadTable()), "no dead letter lost")
	})

	// After the outbox's ids were reset, a dead letter whose id a pending
	// row holds again is skipped (it stays), like an event back in the
	// outbox; it used to fail every replay on the primary key, reported
	// as an event id already in the outbox.
	t.Run("DeadLetterIDHeldAgain", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.appendCommitted(t, newMessage("s", "k", 1))
		ids := b.outboxIDs(t)
		require.Len(t, ids, 1)
		clash, other := uuid.New(), uuid.New()
		b.insertDead(t, ids[0], clash)
		b.insertDead(t, replayDeadID, other)
		r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{})
		moved, err := r.ReplayDead(ctx, outbox.ReplayFilter{})
		require.NoError(t, err)
		require.EqualValues(t, 1, moved, "the other event")
		require.Equal(t, []int64{ids[0], replayDeadID}, b.outboxIDs(t))
		requireDeadEvents(t, r, clash)
		moved, err = r.ReplayDead(ctx, outbox.ReplayFilter{})
		require.NoError(t, err)
		require.Zero(t, moved)
	})
}

// replayDeadID is the first dead letter id of TestReplayDeadEventBackInOutbox,
// above the outbox's own ids, as a buried row's would be.
const replayDeadID int64 = 1_000_001

// twoDeadEvents inserts two dead letters, ids replayDeadID and the next:
// one of again's event (again is the message a client re-sends; the test
// appends it) and one of other.
func (b *testBundle) twoDeadEvents(t *testing.T) (again outbox.Message, other uuid.UUID) {
	t.Helper()
	again, other = newMessage("s", "k", 2), uuid.New()
	b.insertDead(t, replayDeadID, again.EventID)
	b.insertDead(t, replayDeadID+1, other)
	return again, other
}

// requireDeadEvents fails unless the dead letters hold exactly these
// events, in id order.
func requireDeadEvents(t *testing.T, r *outbox.Relay, want ...uuid.UUID) {
	t.Helper()
	dead, err := r.DeadLetters(context.Background(), 0, 100)
	require.NoError(t, err)
	got := make([]uuid.UUID, len(dead))
	for i, d := range dead {
		got[i] = d.EventID
	}
	require.Equal(t, want, got)
}

// insertDead adds a dead letter with the given id and event id.
func (b *testBundle) insertDead(t *testing.T, id int64, eventID uuid.UUID) {
	t.Helper()
	b.insertDeadAt(t, id, eventID, "s", 0)
}

// lockDead locks a dead letter in a transaction of its own, rolled back at
// cleanup if the test has not ended it.
func (b *testBundle) lockDead(t *testing.T, id int64) pgx.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	_, err = tx.Exec(ctx, `SELECT 1 FROM `+b.deadTable()+` WHERE id = $1 FOR UPDATE`, id)
	require.NoError(t, err)
	return tx
}

// outboxIDs lists the ids of the outbox rows, ascending.
func (b *testBundle) outboxIDs(t *testing.T) []int64 {
	t.Helper()
	var ids []int64
	for _, row := range b.rows(t) {
		ids = append(ids, row.ID)
	}
	return ids
}

// ReplayFilter.Stream selects the dead letters ReplayDead moves back, and
// Limit counts events of that stream: a lower-id dead letter of another
// stream must neither use up the limit nor be moved (mutation audit of
// 2026-12-07: with the filter dropped from the selection, stream a's dead
// letters used the limit up and nothing moved).
func TestReplayDeadStreamFilterBeforeLimit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	// Two events of stream "a" die first (lower ids), then one of "b".
	b.appendCommitted(t, newMessage("a", "a1", 1), newMessage("a", "a2", 1))
	b.appendCommitted(t, newMessage("b", "b1", 1))
	r := b.relay(t, nil, &recorder{fail: func(outbox.Record) error { return errors.New("no") }}, outbox.RelayConfig{MaxAttempts: 1})
	n, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 3, n)
	require.Equal(t, 3, b.count(t, b.deadTable()))

	moved, err := r.ReplayDead(ctx, outbox.ReplayFilter{Stream: "b", Limit: 1})
	require.NoError(t, err)
	require.EqualValues(t, 1, moved, "the one dead letter of stream b is moved back; stream a's do not count towards Limit")
	rows := b.rows(t)
	require.Len(t, rows, 1)
	require.Equal(t, 2, b.count(t, b.deadTable()), "stream a's dead letters stay")
}

// A dead letter whose stream is as long as Append allows (MaxStreamBytes)
// is replayed: only longer ones, which the outbox no longer accepts, are
// skipped.
func TestReplayDeadMaxLengthStream(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	stream := strings.Repeat("s", outbox.MaxStreamBytes)
	b.appendCommitted(t, newMessage(stream, "a", 1))
	r := b.relay(t, nil, &recorder{fail: func(outbox.Record) error { return errors.New("no") }}, outbox.RelayConfig{MaxAttempts: 1})
	n, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, 1, b.count(t, b.deadTable()))
	moved, err := r.ReplayDead(ctx, outbox.ReplayFilter{})
	require.NoError(t, err)
	require.EqualValues(t, 1, moved, "a stream of MaxStreamBytes is one the outbox accepts")
	require.Zero(t, b.count(t, b.deadTable()))
}

// insertDeadAt adds a dead letter with the given id, event, stream and age.
func (b *testBundle) insertDeadAt(t *testing.T, id int64, eventID uuid.UUID, stream string, age time.Duration) {
	t.Helper()
	_, err := b.pool.Exec(context.Background(), `INSERT INTO `+b.deadTable()+`
		(id, event_id, stream, key, version, payload, created_at, attempts, last_error)
		VALUES ($1, $2, $3, 'k', 1, '', now() - $4 * interval '1 microsecond', 1, 'x')`, id, eventID, stream, age.Microseconds())
	require.NoError(t, err)
}

// TestReplayDeadDocumentedDetails: Limit's order, EventIDs selecting
// before Limit counts, created_at kept, the long-stream skip's bound, and
// the wake.
func TestReplayDeadDocumentedDetails(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// "Limit, when positive, moves at most this many events (lowest ids
	// first)".
	t.Run("LimitTakesLowestIDs", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		for i := range 3 {
			b.insertDeadAt(t, 500+int64(i), uuid.New(), "s", 0)
		}
		r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{})
		moved, err := r.ReplayDead(ctx, outbox.ReplayFilter{Limit: 2})
		require.NoError(t, err)
		require.EqualValues(t, 2, moved)
		require.Equal(t, []int64{500, 501}, b.outboxIDs(t))
	})

	// EventIDs selects before Limit counts: a lower-id dead letter of
	// another event neither uses up the limit nor moves.
	t.Run("EventIDsBeforeLimit", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		other, wanted := uuid.New(), uuid.New()
		b.insertDeadAt(t, 550, other, "s", 0)
		b.insertDeadAt(t, 551, wanted, "s", 0)
		r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{})
		moved, err := r.ReplayDead(ctx, outbox.ReplayFilter{EventIDs: []uuid.UUID{wanted}, Limit: 1})
		require.NoError(t, err)
		require.EqualValues(t, 1, moved, "the selected event is moved; the other does not count towards Limit")
		require.Equal(t, []int64{551}, b.outboxIDs(t))
		requireDeadEvents(t, r, other)
	})

	// "A row moved back keeps its created_at".
	t.Run("KeepsCreatedAt", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.insertDeadAt(t, 600, uuid.New(), "s", 3*time.Hour)
		r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{})
		dead, err := r.DeadLetters(ctx, 0, 10)
		require.NoError(t, err)
		moved, err := r.ReplayDead(ctx, outbox.ReplayFilter{})
		require.NoError(t, err)
		require.EqualValues(t, 1, moved)
		var created time.Time
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT created_at FROM `+b.writer.Table()).Scan(&created))
		require.True(t, dead[0].CreatedAt.Equal(created), "created_at %v, dead letter's %v", created, dead[0].CreatedAt)
		st, err := r.Stats(ctx)
		require.NoError(t, err)
		require.Greater(t, st.OldestPendingAge, 2*time.Hour, "the replayed row's age counts from its first append")
	})

	// Only a stream longer than MaxStreamBytes is skipped: one byte over
	// is skipped, and the rest replayed, without failing the replay.
	t.Run("StreamOneByteTooLong", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		long := uuid.New()
		b.insertDeadAt(t, 700, long, strings.Repeat("s", outbox.MaxStreamBytes+1), 0)
		b.insertDeadAt(t, 701, uuid.New(), "s", 0)
		r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{})
		moved, err := r.ReplayDead(ctx, outbox.ReplayFilter{})
		require.NoError(t, err)
		require.EqualValues(t, 1, moved)
		requireDeadEvents(t, r, long)
	})

	// "… and wakes the relays": an idle Run with a long PollInterval
	// delivers a replayed row at once.
	t.Run("WakesTheRelays", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		h := &recorder{}
		r := b.relay(t, nil, h, outbox.RelayConfig{PollInterval: time.Minute})
		startRun(t, r)
		waitListening(t, b)
		b.insertDeadAt(t, 800, uuid.New(), "s", 0)
		moved, err := r.ReplayDead(ctx, outbox.ReplayFilter{})
		require.NoError(t, err)
		require.EqualValues(t, 1, moved)
		require.Eventually(t, func() bool { return len(h.seen()) == 1 }, 5*time.Second, 20*time.Millisecond,
			"the replayed row was not delivered: the relay was not woken")
	})
}
