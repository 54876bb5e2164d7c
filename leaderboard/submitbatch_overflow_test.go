package leaderboard

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
)

// TestSubmitBatchLocatesTheOverflow: SubmitBatch's *ScoreOutOfRangeError
// names the first command whose resulting score leaves the range, replaying
// the batch over this board's current scores: commands applied before
// (duplicates) change nothing, every new command's score counts for the
// next, both bounds apply, and another board's scores play no part.
func TestSubmitBatchLocatesTheOverflow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	wide := func(c *Config) { c.MinDelta, c.MaxDelta = MinScore, MaxScore }

	for _, tc := range []struct {
		name  string
		prior func(t *testing.T, tb *testBundle) Command // recorded before the batch
		batch func(prior Command) []Command
		index int
	}{
		{"DuplicatesChangeNothing",
			func(t *testing.T, tb *testBundle) Command { return submitted(t, tb.board, "u", MaxScore-1) },
			func(prior Command) []Command {
				return []Command{prior, {EventID: uuid.New(), UserID: "u", Delta: 1}, {EventID: uuid.New(), UserID: "u", Delta: 1}}
			}, 2},
		{"IntermediateScoresCount",
			func(t *testing.T, tb *testBundle) Command { return submitted(t, tb.board, "u", MaxScore-2) },
			func(Command) []Command {
				return []Command{{EventID: uuid.New(), UserID: "u", Delta: 1}, {EventID: uuid.New(), UserID: "u", Delta: 1}, {EventID: uuid.New(), UserID: "u", Delta: 1}}
			}, 2},
		{"BelowMinScore",
			func(t *testing.T, tb *testBundle) Command { return submitted(t, tb.board, "u", MinScore+1) },
			func(Command) []Command {
				return []Command{{EventID: uuid.New(), UserID: "w", Delta: 1}, {EventID: uuid.New(), UserID: "u", Delta: -1}, {EventID: uuid.New(), UserID: "u", Delta: -1}}
			}, 2},
		{"ScoresOfThisBoardOnly",
			func(t *testing.T, tb *testBundle) Command {
				return submitted(t, tb.sibling(t, "other", wide), "u", MaxScore)
			},
			func(Command) []Command {
				return []Command{{EventID: uuid.New(), UserID: "u", Delta: 5}, {EventID: uuid.New(), UserID: "x", Delta: MaxScore}, {EventID: uuid.New(), UserID: "x", Delta: 1}}
			}, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tb := setup(t, wide)
			batch := tc.batch(tc.prior(t, tb))
			before, _, _ := tb.counts(t)
			_, err := tb.board.SubmitBatch(ctx, batch)
			var rangeErr *ScoreOutOfRangeError
			require.ErrorAs(t, err, &rangeErr)
			want := batch[tc.index]
			require.Equal(t, ScoreOutOfRangeError{Index: tc.index, UserID: want.UserID, Delta: want.Delta}, *rangeErr)
			after, _, _ := tb.counts(t)
			require.Equal(t, before, after, "the refused batch wrote nothing")
		})
	}
}

// TestSubmitBatchRangeIsPerCommand: the range applies to each command's
// score, not to the sum of a user's deltas in a batch. The statement
// proposed that sum as a new row's score, and PostgreSQL checks the
// range on the proposed row even when it updates an existing one: a user at
// MinScore given +MaxScore twice (scores 0, then MaxScore) was refused.
func TestSubmitBatchRangeIsPerCommand(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	wide := func(c *Config) { c.MinDelta, c.MaxDelta = MinScore, MaxScore }
	batch := func() []Command {
		return []Command{
			{EventID: uuid.New(), UserID: "u", Delta: MaxScore},
			{EventID: uuid.New(), UserID: "new", Delta: 7},
			{EventID: uuid.New(), UserID: "u", Delta: MaxScore},
		}
	}
	want := []Result{{Score: 0, Version: 2}, {Score: 7, Version: 1}, {Score: MaxScore, Version: 3}}
	// next checks the stored score: the next command counts from MaxScore.
	next := func(t *testing.T, b *Board) {
		t.Helper()
		res, err := b.Submit(ctx, Command{EventID: uuid.New(), UserID: "u", Delta: -1})
		require.NoError(t, err)
		require.Equal(t, Result{Score: MaxScore - 1, Version: 4}, res)
	}

	t.Run("SubmitBatch", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, wide)
		submitted(t, tb.board, "u", MinScore)
		out, err := tb.board.SubmitBatch(ctx, batch())
		require.NoError(t, err)
		require.Equal(t, want, out)
		next(t, tb.board)
	})

	t.Run("SubmitBatchTx", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, wide)
		submitted(t, tb.board, "u", MinScore)
		tx, err := tb.pg.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		out, err := tb.board.SubmitBatchTx(ctx, tx, batch())
		require.NoError(t, err)
		require.Equal(t, want, out)
		require.NoError(t, tx.Commit(ctx))
		next(t, tb.board)
	})
}

// submitted submits delta for user on b and returns the command.
func submitted(t *testing.T, b *Board, user string, delta int64) Command {
	t.Helper()
	cmd := Command{EventID: uuid.New(), UserID: user, Delta: delta}
	_, err := b.Submit(context.Background(), cmd)
	require.NoError(t, err)
	return cmd
}

// TestSubmitBatchConflictRefusesTheFirstDifferingCopy: with nothing
// recorded under a reused event id, the conflict describes the batch's
// first command with the id and refuses the first later one that differs
// from it, not a copy equal to it nor a later differing one.
func TestSubmitBatchConflictRefusesTheFirstDifferingCopy(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	id := uuid.New()
	batch := []Command{
		{EventID: id, UserID: "a", Delta: 1},
		{EventID: id, UserID: "a", Delta: 1},
		{EventID: id, UserID: "b", Delta: 1},
		{EventID: id, UserID: "c", Delta: 2},
	}
	_, err := tb.board.SubmitBatch(ctx, batch)
	var conflict *IdempotencyConflictError
	require.ErrorAs(t, err, &conflict)
	require.Equal(t, &IdempotencyConflictError{EventID: id, Board: tb.board.Name(), UserID: "a", Delta: 1,
		Attempted: batch[2], WithinBatch: true}, conflict)
	events, users, queued := tb.counts(t)
	require.Equal(t, []int{0, 0, 0}, []int{events, users, queued})
}

// TestSubmitBatchOverflowAfterItsCallerGaveUp: a batch refused for the
// range, whose caller's context ends before the look-up that locates the
// command: the error is still a *ScoreOutOfRangeError (Index -1), and
// matches the context's error too. It used to blame a concurrent change.
func TestSubmitBatchOverflowAfterItsCallerGaveUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t, func(c *Config) { c.MinDelta, c.MaxDelta = MinScore, MaxScore })
	submitted(t, tb.board, "u", MaxScore)
	bctx, cancel := context.WithCancel(ctx)
	defer cancel()
	pool := tb.newPool(t, func(pc *pgxpool.Config) {
		pc.ConnConfig.Tracer = &cancelAfterQuery{match: refusedForTheRange, nth: 1, cancel: cancel}
	})
	board, err := New(pool, tb.rd.Client, &Config{Name: tb.board.Name(), Schema: tb.pg.Schema, KeyPrefix: tb.rd.Prefix,
		MinDelta: MinScore, MaxDelta: MaxScore})
	require.NoError(t, err)
	t.Cleanup(board.Close)

	_, err = board.SubmitBatch(bctx, []Command{{EventID: uuid.New(), UserID: "v", Delta: 1}, {EventID: uuid.New(), UserID: "u", Delta: 1}})
	var rangeErr *ScoreOutOfRangeError
	require.ErrorAs(t, err, &rangeErr)
	require.Equal(t, -1, rangeErr.Index)
	require.ErrorIs(t, err, context.Canceled)
	events, _, _ := tb.counts(t)
	require.Equal(t, 1, events, "the refused batch wrote nothing")
}

// refusedForTheRange matches a statement the score range's CHECK refused.
func refusedForTheRange(_ string, err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23514"
}

// TestSubmitVersionAtItsLargest: a user whose version is at int64's largest
// (only a hand edit or an import puts it there) can take no more commands,
// though the score each would leave (10) is in range. Every submit path
// refuses it without a *ScoreOutOfRangeError, which blamed the delta (the
// service answered it 422 on "delta"); grouped with other users' commands
// it fails alone; nothing is written.
func TestSubmitVersionAtItsLargest(t *testing.T) {
	t.Parallel()
	for name, mutate := range map[string]func(*Config){
		"Grouped": func(*Config) {},
		"Alone":   func(c *Config) { c.MaxSubmitsPerStatement = 1 },
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			tb := setup(t, mutate)
			ctx := context.Background()
			b := tb.board
			_, err := b.Submit(ctx, Command{EventID: uuid.New(), UserID: "ada", Delta: 5})
			require.NoError(t, err)
			_, err = tb.pg.Pool.Exec(ctx, `UPDATE user_scores SET version = $1 WHERE user_id = 'ada'`, int64(math.MaxInt64))
			require.NoError(t, err)
			refused := func(path string, err error) {
				t.Helper()
				require.ErrorContains(t, err, `column "version"`, path)
				require.NotErrorIs(t, err, ErrScoreOutOfRange, path)
			}

			_, err = b.Submit(ctx, Command{EventID: uuid.New(), UserID: "ada", Delta: 5})
			refused("Submit", err)
			tx, err := tb.pg.Pool.Begin(ctx)
			require.NoError(t, err)
			_, err = b.SubmitTx(ctx, tx, Command{EventID: uuid.New(), UserID: "ada", Delta: 5})
			require.NoError(t, tx.Rollback(ctx))
			refused("SubmitTx", err)
			_, err = b.SubmitBatch(ctx, []Command{{EventID: uuid.New(), UserID: "ada", Delta: 5}})
			refused("SubmitBatch", err)
			tx, err = tb.pg.Pool.Begin(ctx)
			require.NoError(t, err)
			_, err = b.SubmitBatchTx(ctx, tx, []Command{{EventID: uuid.New(), UserID: "ada", Delta: 5}})
			require.NoError(t, tx.Rollback(ctx))
			refused("SubmitBatchTx", err)

			var wg sync.WaitGroup
			errs := make([]error, 64)
			for i := range errs {
				user := fmt.Sprint("other", i)
				if i == 0 {
					user = "ada"
				}
				wg.Go(func() {
					_, errs[i] = b.Submit(ctx, Command{EventID: uuid.New(), UserID: user, Delta: 1})
				})
			}
			wg.Wait()
			refused("concurrent Submit", errs[0])
			for i, err := range errs[1:] {
				require.NoError(t, err, "caller %d, grouped with the refused one", i+1)
			}

			var score, version, events int64
			require.NoError(t, tb.pg.Pool.QueryRow(ctx, `SELECT score, version FROM user_scores WHERE user_id = 'ada'`).Scan(&score, &version))
			require.Equal(t, int64(5), score)
			require.Equal(t, int64(math.MaxInt64), version)
			require.NoError(t, tb.pg.Pool.QueryRow(ctx, `SELECT count(*) FROM score_events WHERE user_id = 'ada'`).Scan(&events))
			require.Equal(t, int64(1), events)
		})
	}
}

// TestSubmitBatchReportsTheFirstConflict: with several commands reusing
// recorded event ids for other commands, the *IdempotencyConflictError
// describes the first of them in the batch's order, in SubmitBatch and
// SubmitBatchTx alike, whatever order the statement's rows come back in
// (by user id, here the batch's reverse order).
func TestSubmitBatchReportsTheFirstConflict(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	ids := []uuid.UUID{uuid.New(), uuid.New(), uuid.New()}
	slices.SortFunc(ids, func(a, b uuid.UUID) int { return -bytes.Compare(a[:], b[:]) })
	recorded := make([]Command, 3)
	for i, user := range []string{"zoe", "yann", "xia"} {
		recorded[i] = Command{EventID: ids[i], UserID: user, Delta: 1}
		_, err := tb.board.Submit(ctx, recorded[i])
		require.NoError(t, err)
	}
	batch := []Command{
		{EventID: uuid.New(), UserID: "zz-new", Delta: 5},
		{EventID: recorded[0].EventID, UserID: "zoe", Delta: 2},  // recorded with delta 1
		{EventID: recorded[1].EventID, UserID: "yann", Delta: 3}, // likewise
		{EventID: recorded[2].EventID, UserID: "xia", Delta: 4},  // likewise
	}
	want := &IdempotencyConflictError{EventID: recorded[0].EventID, Board: tb.board.Name(), UserID: "zoe", Delta: 1, Attempted: batch[1]}

	_, err := tb.board.SubmitBatch(ctx, batch)
	var conflict *IdempotencyConflictError
	require.ErrorAs(t, err, &conflict)
	require.Equal(t, want, conflict, "SubmitBatch")

	// A merge join returns the recorded commands in event id order, here
	// the batch's reverse.
	pool := tb.newPool(t, func(pc *pgxpool.Config) {
		pc.ConnConfig.RuntimeParams["enable_hashjoin"] = "off"
		pc.ConnConfig.RuntimeParams["enable_nestloop"] = "off"
	})
	cfg := tb.board.Config()
	mergeBoard, err := New(pool, tb.rd.Client, &cfg)
	require.NoError(t, err)
	t.Cleanup(mergeBoard.Close)
	_, err = mergeBoard.SubmitBatch(ctx, batch)
	require.ErrorAs(t, err, &conflict)
	require.Equal(t, want, conflict, "SubmitBatch with a merge join")

	tx, err := tb.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tb.board.SubmitBatchTx(ctx, tx, batch)
	require.ErrorAs(t, err, &conflict)
	require.Equal(t, want, conflict, "SubmitBatchTx")
	_, err = tx.Exec(ctx, `SET LOCAL enable_hashjoin = off; SET LOCAL enable_nestloop = off`)
	require.NoError(t, err)
	_, err = tb.board.SubmitBatchTx(ctx, tx, batch)
	require.ErrorAs(t, err, &conflict)
	require.Equal(t, want, conflict, "SubmitBatchTx with a merge join")

	events, users, queued := tb.counts(t)
	require.Equal(t, []int{3, 3, 3}, []int{events, users, queued}, "the recorded commands alone")
}

// TestSubmitVersionAtItsLargestInAGroup: a user at int64's largest version,
// in a shared statement with another user's command: its command fails alone
// (the not-null violation on "version"), the other is applied, as the
// package doc promises ("as an error of that command alone").
// TestSubmitVersionAtItsLargest's Grouped case starts the refused user's
// goroutine first, so it is usually sent alone and never shares a statement.
func TestSubmitVersionAtItsLargestInAGroup(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	gb := setupGroups(t)
	_, err := gb.board.Submit(ctx, Command{EventID: uuid.New(), UserID: "ada", Delta: 5})
	require.NoError(t, err)
	_, err = gb.pg.Pool.Exec(ctx, `UPDATE user_scores SET version = 9223372036854775807 WHERE user_id = 'ada'`)
	require.NoError(t, err)

	outs := gb.groupBehindFirst(t, ctx,
		Command{EventID: uuid.New(), UserID: "ada", Delta: 1},
		Command{EventID: uuid.New(), UserID: "bob", Delta: 2})
	ada, bob := wait(t, outs[0]), wait(t, outs[1])
	require.ErrorContains(t, ada.err, `column "version"`)
	require.NotErrorIs(t, ada.err, ErrScoreOutOfRange)
	require.NoError(t, bob.err, "grouped with the refused command")
	require.Equal(t, Result{Score: 2, Version: 1}, bob.res)
	var events int
	require.NoError(t, gb.pg.Pool.QueryRow(ctx, `SELECT count(*) FROM score_events WHERE user_id = 'ada'`).Scan(&events))
	require.Equal(t, 1, events, "the refused command wrote nothing")
}
