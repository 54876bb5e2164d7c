package leaderboard

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
)

// TestSubmitBatchLockOrder: a batch takes its locks in a fixed order,
// whatever order its commands come in: users' score rows in user id order,
// event ids in id order. Two batches that share users or ids then wait for
// each other instead of deadlocking (the deadlock would be retried, but
// only after deadlock_timeout, a second by default). Each subtest holds the
// lock of the middle key in a transaction of its own, sends a batch whose
// commands are in another order, and once the batch waits, looks at which
// of the other keys it holds: exactly those before the middle one.
func TestSubmitBatchLockOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const n = 20
	const middle = n / 2

	// scrambled returns 0..n-1 in an order that is neither ascending nor
	// descending, with the middle element neither first nor last.
	scrambled := func() []int {
		order := make([]int, 0, n)
		for i := 0; i < n; i++ {
			order = append(order, (i*7+3)%n) // 7 and n are coprime
		}
		return order
	}

	t.Run("UserRows", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		users := make([]string, n)
		for i := range users {
			users[i] = fmt.Sprintf("u%02d", i)
		}
		// Every user has a row already: the batch updates them, and an
		// update waits for the row's lock.
		var first []Command
		for _, u := range users {
			first = append(first, Command{EventID: uuid.New(), UserID: u, Delta: 1})
		}
		_, err := tb.board.SubmitBatch(ctx, first)
		require.NoError(t, err)

		holder, waitBlocked := lockUserRow(t, tb, users[middle])
		var cmds []Command
		for _, i := range scrambled() {
			cmds = append(cmds, Command{EventID: uuid.New(), UserID: users[i], Delta: int64(i + 1)})
		}
		done := make(chan batchOut, 1)
		go func() {
			res, err := tb.board.SubmitBatch(ctx, cmds)
			done <- batchOut{res, err}
		}()
		waitBlocked("the batch never waited for the middle user's row")

		// SKIP LOCKED returns the rows nobody holds.
		probe, err := tb.pg.Pool.Begin(ctx)
		require.NoError(t, err)
		rows, err := probe.Query(ctx, `SELECT user_id FROM user_scores
			WHERE user_id = ANY ($1) ORDER BY user_id FOR UPDATE SKIP LOCKED`, users)
		require.NoError(t, err)
		free, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		require.NoError(t, probe.Rollback(ctx))
		require.Equal(t, users[middle+1:], free,
			"while waiting for %s, the batch must hold exactly the users before it", users[middle])

		require.NoError(t, holder.Rollback(ctx))
		out := <-done
		require.NoError(t, out.err)
		for k, i := range scrambled() {
			require.Equal(t, Result{Score: 1 + int64(i+1), Version: 2}, out.res[k], users[i])
		}
	})

	t.Run("EventIDs", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		ids := make([]uuid.UUID, n)
		for i := range ids {
			ids[i] = uuid.New()
		}
		slices.SortFunc(ids, func(a, b uuid.UUID) int { return bytes.Compare(a[:], b[:]) })

		// The holder records the middle id, uncommitted: the batch, which
		// cannot see it, inserts it too and waits to learn whether it
		// commits.
		holder := beginCaller(t, tb)
		_, err := holder.tx.Exec(ctx, `INSERT INTO score_events (event_id, board, user_id, delta, score, version)
			VALUES ($1, 'elsewhere', 'holder', 1, 1, 1)`, ids[middle])
		require.NoError(t, err)

		// Users in a third order, so that neither the commands' order nor
		// their users' order is the ids' order.
		var cmds []Command
		for _, i := range scrambled() {
			cmds = append(cmds, Command{EventID: ids[i], UserID: fmt.Sprintf("u%02d", (i*13+5)%n), Delta: 1})
		}
		done := make(chan batchOut, 1)
		go func() {
			res, err := tb.board.SubmitBatch(ctx, cmds)
			done <- batchOut{res, err}
		}()
		waitBlockedBy(t, tb, holder.pid, "the batch never waited for the middle event id")

		// An id the batch has inserted makes another insert of it wait
		// (until lock_timeout); one it has not reached yet goes in.
		var taken, before []int // positions in ids
		for i, id := range ids {
			if i == middle {
				continue
			}
			if i < middle {
				before = append(before, i)
			}
			waited, err := insertWaits(ctx, tb, id)
			require.NoError(t, err)
			if waited {
				taken = append(taken, i)
			}
		}
		require.Equal(t, before, taken,
			"while waiting for id %d of %d in id order, the batch must hold exactly the ids before it", middle, n)

		require.NoError(t, holder.tx.Rollback(ctx))
		out := <-done
		require.NoError(t, out.err)
		for k, i := range scrambled() {
			require.Equal(t, Result{Score: 1, Version: 1}, out.res[k], "command %d", i)
		}
	})
}

// insertWaits reports whether recording id in score_events has to wait for
// another transaction: it tries, in a transaction rolled back at once, with
// a short lock_timeout.
func insertWaits(ctx context.Context, tb *testBundle, id uuid.UUID) (bool, error) {
	tx, err := tb.pg.Pool.Begin(ctx)
	if err != nil {
		return false, err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '100ms'`); err != nil {
		return false, err
	}
	_, err = tx.Exec(ctx, `INSERT INTO score_events (event_id, board, user_id, delta, score, version)
		VALUES ($1, 'elsewhere', 'probe', 1, 1, 1)`, id)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available
		return true, nil
	}
	return false, err
}
