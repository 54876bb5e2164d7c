package leaderboard

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
)

type testBundle struct {
	board *Board
	pg    *testenv.PG
	rd    *testenv.RD
}

// setup returns a migrated board in the test's own schema and key prefix.
// mutate, when given, adjusts the Config before New.
func setup(t *testing.T, mutate ...func(*Config)) *testBundle {
	t.Helper()
	return setupTB(t, mutate...)
}

// sibling opens the board name in the bundle's schema and key prefix: the
// same tables and the same Redis namespace, as another board of one
// deployment. mutate, when given, adjusts its Config. It is closed at
// cleanup.
func (tb *testBundle) sibling(t *testing.T, name string, mutate ...func(*Config)) *Board {
	t.Helper()
	cfg := &Config{Name: name, Schema: tb.pg.Schema, KeyPrefix: tb.rd.Prefix}
	for _, m := range mutate {
		m(cfg)
	}
	b, err := New(tb.pg.Pool, tb.rd.Client, cfg)
	require.NoError(t, err)
	t.Cleanup(b.Close)
	return b
}

// setupTB is setup for tests and benchmarks.
func setupTB(t testing.TB, mutate ...func(*Config)) *testBundle {
	t.Helper()
	pg := testenv.Postgres(t)
	rd := testenv.Redis(t)
	cfg := &Config{Name: "weekly-2026-48", Schema: pg.Schema, KeyPrefix: rd.Prefix}
	for _, m := range mutate {
		m(cfg)
	}
	require.NoError(t, Migrate(context.Background(), pg.Pool, cfg))
	board, err := New(pg.Pool, rd.Client, cfg)
	require.NoError(t, err)
	return &testBundle{board: board, pg: pg, rd: rd}
}

// newPool opens a pool of its own on the bundle's database, its
// configuration adjusted by mutate, closed when the test ends.
func (tb *testBundle) newPool(t *testing.T, mutate func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	pc, err := pgxpool.ParseConfig(tb.pg.ConnString)
	require.NoError(t, err)
	mutate(pc)
	pool, err := pgxpool.NewWithConfig(context.Background(), pc)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// counts returns the number of score events, user rows and outbox rows.
func (tb *testBundle) counts(t *testing.T) (events, users, queued int) {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, tb.pg.Pool.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM score_events),
		(SELECT count(*) FROM user_scores),
		(SELECT count(*) FROM verity_outbox)`).Scan(&events, &users, &queued))
	return events, users, queued
}

func TestSubmit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("AppliesAndQueuesAbsoluteScore", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		res, err := tb.board.Submit(ctx, Command{EventID: uuid.New(), UserID: "user-a", Delta: 10})
		require.NoError(t, err)
		require.Equal(t, Result{Score: 10, Version: 1}, res)
		res, err = tb.board.Submit(ctx, Command{EventID: uuid.New(), UserID: "user-a", Delta: 7})
		require.NoError(t, err)
		require.Equal(t, Result{Score: 17, Version: 2}, res)

		var stream, key string
		var version int64
		var payload []byte
		require.NoError(t, tb.pg.Pool.QueryRow(ctx,
			`SELECT stream, key, version, payload FROM verity_outbox ORDER BY id DESC LIMIT 1`).
			Scan(&stream, &key, &version, &payload))
		require.Equal(t, "leaderboard:weekly-2026-48", stream)
		require.Equal(t, "user-a", key)
		require.Equal(t, int64(2), version)
		require.Equal(t, "17", string(payload))
	})

	t.Run("DuplicateEventID", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		cmd := Command{EventID: uuid.New(), UserID: "user-a", Delta: 10}
		first, err := tb.board.Submit(ctx, cmd)
		require.NoError(t, err)
		_, err = tb.board.Submit(ctx, Command{EventID: uuid.New(), UserID: "user-a", Delta: 5})
		require.NoError(t, err)
		again, err := tb.board.Submit(ctx, cmd)
		require.NoError(t, err)
		require.Equal(t, Result{Score: first.Score, Version: first.Version, Duplicate: true}, again)
		events, users, queued := tb.counts(t)
		require.Equal(t, []int{2, 1, 2}, []int{events, users, queued})
	})

	t.Run("ConcurrentTwins", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		for round := 0; round < 5; round++ {
			cmd := Command{EventID: uuid.New(), UserID: "racer", Delta: 3}
			const twins = 8
			results := make([]Result, twins)
			errs := make([]error, twins)
			var wg sync.WaitGroup
			for i := 0; i < twins; i++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					results[i], errs[i] = tb.board.Submit(ctx, cmd)
				}()
			}
			wg.Wait()
			applied := 0
			for i := range results {
				require.NoError(t, errs[i])
				require.Equal(t, int64(3*(round+1)), results[i].Score)
				require.Equal(t, int64(round+1), results[i].Version)
				if !results[i].Duplicate {
					applied++
				}
			}
			require.Equal(t, 1, applied)
		}
		events, users, queued := tb.counts(t)
		require.Equal(t, []int{5, 1, 5}, []int{events, users, queued})
	})

	t.Run("IdempotencyConflict", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		id := uuid.New()
		_, err := tb.board.Submit(ctx, Command{EventID: id, UserID: "user-a", Delta: 10})
		require.NoError(t, err)
		for _, cmd := range []Command{
			{EventID: id, UserID: "user-a", Delta: 11},
			{EventID: id, UserID: "user-b", Delta: 10},
		} {
			_, err = tb.board.Submit(ctx, cmd)
			require.ErrorIs(t, err, ErrIdempotencyConflict)
			var conflict *IdempotencyConflictError
			require.ErrorAs(t, err, &conflict)
			require.Equal(t, "user-a", conflict.UserID)
			require.Equal(t, int64(10), conflict.Delta)
			require.Equal(t, cmd, conflict.Attempted)
		}
		// Another board of the same tables must not reuse the id either.
		other := tb.sibling(t, "other")
		_, err = other.Submit(ctx, Command{EventID: id, UserID: "user-a", Delta: 10})
		require.ErrorIs(t, err, ErrIdempotencyConflict)

		// An event id held by another writer of the same outbox.
		foreign := uuid.New()
		_, err = tb.pg.Pool.Exec(ctx, `INSERT INTO verity_outbox (event_id, stream, key, version, payload) VALUES ($1, 'orders', 'o1', 1, '\x00')`, foreign)
		require.NoError(t, err)
		_, err = tb.board.Submit(ctx, Command{EventID: foreign, UserID: "user-a", Delta: 1})
		require.ErrorIs(t, err, ErrIdempotencyConflict)
		_, err = tb.board.SubmitBatch(ctx, []Command{{EventID: foreign, UserID: "user-a", Delta: 1}})
		require.ErrorIs(t, err, ErrIdempotencyConflict)

		events, users, queued := tb.counts(t)
		require.Equal(t, []int{1, 1, 2}, []int{events, users, queued})
	})

	// An event id another writer of the same outbox used is refused while
	// that writer's row is in the outbox table, and only then: once the
	// relay deletes it on delivery, nothing records the id, and the board
	// accepts it.
	t.Run("EventIDOfAnotherOutboxWriter", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		foreign := func(stream string) uuid.UUID {
			id := uuid.New()
			_, err := tb.pg.Pool.Exec(ctx, `INSERT INTO verity_outbox (event_id, stream, key, version, payload) VALUES ($1, $2, 'o1', 1, '\x00')`, id, stream)
			require.NoError(t, err)
			return id
		}
		deliver := func(stream string, keep bool) {
			relay, err := outbox.NewRelay(tb.pg.Pool, outbox.HandlerFunc(func(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
				return make([]outbox.Result, len(batch)), nil
			}), &outbox.RelayConfig{Schema: tb.pg.Schema, Streams: []string{stream}, KeepPublished: keep})
			require.NoError(t, err)
			n, err := relay.RunOnce(ctx)
			require.NoError(t, err)
			require.Equal(t, 1, n)
		}
		// The driver's unique violation stays reachable, as in every other
		// statement error of the board.
		violation := func(err error, when string) {
			var pgErr *pgconn.PgError
			require.ErrorAs(t, err, &pgErr, when)
			require.Equal(t, "23505", pgErr.Code, when)
			require.Equal(t, "verity_outbox", pgErr.TableName, when)
		}
		refused := func(id uuid.UUID, when string) {
			cmd := Command{EventID: id, UserID: "user-a", Delta: 1}
			_, err := tb.board.Submit(ctx, cmd)
			require.ErrorIs(t, err, ErrIdempotencyConflict, when)
			var conflict *IdempotencyConflictError
			require.False(t, errors.As(err, &conflict), "no command of the board is recorded %s: %v", when, err)
			violation(err, when)
			_, err = tb.board.SubmitBatch(ctx, []Command{cmd})
			require.ErrorIs(t, err, ErrIdempotencyConflict, when)
			require.False(t, errors.As(err, &conflict), when)
			violation(err, when)
			tx, err := tb.pg.Pool.Begin(ctx)
			require.NoError(t, err)
			_, err = tb.board.SubmitTx(ctx, tx, cmd)
			require.ErrorIs(t, err, ErrIdempotencyConflict, when)
			require.False(t, errors.As(err, &conflict), when)
			violation(err, when)
			require.NoError(t, tx.Rollback(ctx))
			tx, err = tb.pg.Pool.Begin(ctx)
			require.NoError(t, err)
			_, err = tb.board.SubmitBatchTx(ctx, tx, []Command{cmd})
			require.ErrorIs(t, err, ErrIdempotencyConflict, when)
			require.False(t, errors.As(err, &conflict), when)
			violation(err, when)
			require.NoError(t, tx.Rollback(ctx))
		}

		pending, kept := foreign("orders"), foreign("audit")
		refused(pending, "while the other writer's row is pending")
		refused(kept, "while the other writer's row is pending")
		deliver("audit", true)
		refused(kept, "while the other writer's delivered row is kept")

		deliver("orders", false)
		res, err := tb.board.Submit(ctx, Command{EventID: pending, UserID: "user-a", Delta: 1})
		require.NoError(t, err, "after the relay deleted the other writer's row")
		require.Equal(t, Result{Score: 1, Version: 1}, res)
		events, users, queued := tb.counts(t)
		require.Equal(t, []int{1, 1, 2}, []int{events, users, queued}) // ours and the kept row
	})

	t.Run("Validation", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		for _, tc := range []struct {
			name  string
			cmd   Command
			field string
		}{
			{"NilEventID", Command{UserID: "u", Delta: 1}, "EventID"},
			{"EmptyUserID", Command{EventID: uuid.New(), Delta: 1}, "UserID"},
			{"LongUserID", Command{EventID: uuid.New(), UserID: strings.Repeat("x", 129), Delta: 1}, "UserID"},
			{"InvalidUTF8", Command{EventID: uuid.New(), UserID: "bad\xff", Delta: 1}, "UserID"},
			{"NULByte", Command{EventID: uuid.New(), UserID: "a\x00b", Delta: 1}, "UserID"},
			{"DeltaTooLow", Command{EventID: uuid.New(), UserID: "u", Delta: -1001}, "Delta"},
			{"DeltaTooHigh", Command{EventID: uuid.New(), UserID: "u", Delta: 1001}, "Delta"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				_, err := tb.board.Submit(ctx, tc.cmd)
				require.ErrorIs(t, err, ErrInvalidCommand)
				var verr *ValidationError
				require.ErrorAs(t, err, &verr)
				require.Equal(t, tc.field, verr.Field)

				_, err = tb.board.SubmitBatch(ctx, []Command{{EventID: uuid.New(), UserID: "ok", Delta: 1}, tc.cmd})
				require.ErrorAs(t, err, &verr)
				require.Equal(t, 1, verr.Index)
			})
		}
		// Limits are inclusive, and any other bytes are accepted verbatim.
		for _, cmd := range []Command{
			{EventID: uuid.New(), UserID: strings.Repeat("x", 128), Delta: 1000},
			{EventID: uuid.New(), UserID: "{brace}:colon\nnewline 🎮 'quote\"; DROP TABLE user_scores; --", Delta: -1000},
		} {
			_, err := tb.board.Submit(ctx, cmd)
			require.NoError(t, err)
		}
		events, users, queued := tb.counts(t)
		require.Equal(t, []int{2, 2, 2}, []int{events, users, queued})
	})

	// The configured MaxUserIDLength and delta pair are the limits, not the
	// defaults: MinDelta 0, MaxDelta 50 allows increments only.
	t.Run("ConfiguredLimits", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) { c.MaxUserIDLength, c.MinDelta, c.MaxDelta = 4, 0, 50 })
		for _, tc := range []struct {
			cmd   Command
			field string
		}{
			{Command{EventID: uuid.New(), UserID: "abcde", Delta: 1}, "UserID"},
			{Command{EventID: uuid.New(), UserID: "ab", Delta: -1}, "Delta"},
			{Command{EventID: uuid.New(), UserID: "ab", Delta: 51}, "Delta"},
		} {
			_, err := tb.board.Submit(ctx, tc.cmd)
			var verr *ValidationError
			require.ErrorAs(t, err, &verr, "%+v", tc.cmd)
			require.Equal(t, tc.field, verr.Field)
			_, err = tb.board.SubmitBatch(ctx, []Command{tc.cmd})
			require.ErrorAs(t, err, &verr, "%+v", tc.cmd)
			require.Equal(t, tc.field, verr.Field)
		}
		for _, cmd := range []Command{
			{EventID: uuid.New(), UserID: "abcd", Delta: 0},
			{EventID: uuid.New(), UserID: "ab", Delta: 50},
		} {
			_, err := tb.board.Submit(ctx, cmd)
			require.NoError(t, err)
		}
		events, users, queued := tb.counts(t)
		require.Equal(t, []int{2, 2, 2}, []int{events, users, queued})
	})

	t.Run("ScoreOutOfRange", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) { c.MinDelta, c.MaxDelta = MinScore, MaxScore })
		_, err := tb.board.Submit(ctx, Command{EventID: uuid.New(), UserID: "u", Delta: MaxScore})
		require.NoError(t, err)
		_, err = tb.board.Submit(ctx, Command{EventID: uuid.New(), UserID: "u", Delta: 1})
		require.ErrorIs(t, err, ErrScoreOutOfRange)
		var rangeErr *ScoreOutOfRangeError
		require.ErrorAs(t, err, &rangeErr)
		require.Equal(t, "u", rangeErr.UserID)

		_, err = tb.board.Submit(ctx, Command{EventID: uuid.New(), UserID: "v", Delta: MinScore})
		require.NoError(t, err)
		_, err = tb.board.Submit(ctx, Command{EventID: uuid.New(), UserID: "v", Delta: -1})
		require.ErrorIs(t, err, ErrScoreOutOfRange)

		// A batch whose intermediate score leaves the range is refused
		// whole, and the error says which command.
		_, err = tb.board.SubmitBatch(ctx, []Command{
			{EventID: uuid.New(), UserID: "w", Delta: 5},
			{EventID: uuid.New(), UserID: "u", Delta: 1},
			{EventID: uuid.New(), UserID: "u", Delta: -10},
		})
		require.ErrorIs(t, err, ErrScoreOutOfRange)
		require.ErrorAs(t, err, &rangeErr)
		require.Equal(t, ScoreOutOfRangeError{Index: 1, UserID: "u", Delta: 1}, *rangeErr)

		events, users, queued := tb.counts(t)
		require.Equal(t, []int{2, 2, 2}, []int{events, users, queued})
	})
}

func TestSubmitBatch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// Every user but c has history (a two versions, b one), projected
	// before the batch, so each user's versions continue from the stored
	// one; a and b get several commands, interleaved.
	t.Run("MatchesSequentialSubmits", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		tb.submit(t, "a", 7)
		tb.submit(t, "a", 3)
		prior := Command{EventID: uuid.New(), UserID: "b", Delta: 4}
		priorRes, err := tb.board.Submit(ctx, prior)
		require.NoError(t, err)
		tb.drain(t)

		repeated := Command{EventID: uuid.New(), UserID: "a", Delta: 2}
		cmds := []Command{
			{EventID: uuid.New(), UserID: "a", Delta: 10},
			{EventID: uuid.New(), UserID: "b", Delta: 1},
			prior,
			{EventID: uuid.New(), UserID: "c", Delta: 6},
			repeated,
			{EventID: uuid.New(), UserID: "a", Delta: -3},
			{EventID: uuid.New(), UserID: "b", Delta: -8},
			repeated,
		}
		got, err := tb.board.SubmitBatch(ctx, cmds)
		require.NoError(t, err)
		// Running sums and consecutive versions per user, as if submitted
		// one by one: each command its own, not its user's last.
		require.Equal(t, []Result{
			{Score: 20, Version: 3},
			{Score: 5, Version: 2},
			{Score: priorRes.Score, Version: priorRes.Version, Duplicate: true},
			{Score: 6, Version: 1},
			{Score: 22, Version: 4},
			{Score: 19, Version: 5},
			{Score: -3, Version: 3},
			{Score: 22, Version: 4, Duplicate: true},
		}, got)

		// PostgreSQL holds each user's last state, and the outbox that state
		// alone (the prior submits' rows were drained).
		type state struct { // exported fields: pgx.RowToStructByPos
			User           string
			Score, Version int64
		}
		want := []state{{"a", 19, 5}, {"b", -3, 3}, {"c", 6, 1}}
		collect := func(sql string, args ...any) []state {
			t.Helper()
			rows, err := tb.pg.Pool.Query(ctx, sql, args...)
			require.NoError(t, err)
			states, err := pgx.CollectRows(rows, pgx.RowToStructByPos[state])
			require.NoError(t, err)
			return states
		}
		require.Equal(t, want, collect(`SELECT user_id, score, version FROM user_scores WHERE board = $1 ORDER BY user_id`, tb.board.Name()))
		require.Equal(t, want, collect(`SELECT key, convert_from(payload, 'UTF8')::bigint, version FROM verity_outbox ORDER BY key, version`))

		// Resubmitting the batch changes nothing and reports duplicates.
		again, err := tb.board.SubmitBatch(ctx, cmds)
		require.NoError(t, err)
		for i := range again {
			require.True(t, again[i].Duplicate)
			require.Equal(t, got[i].Score, again[i].Score)
			require.Equal(t, got[i].Version, again[i].Version)
		}
		events, users, queued := tb.counts(t)
		// 3 earlier events and 6 new; one outbox row per user.
		require.Equal(t, []int{9, 3, 3}, []int{events, users, queued})

		// Projected, Redis holds the same scores and versions.
		tb.drain(t)
		for _, w := range want {
			score, err := tb.rd.Client.ZScore(ctx, tb.board.SortedSetKey(), w.User).Result()
			require.NoError(t, err, w.User)
			version, err := tb.rd.Client.HGet(ctx, tb.board.Keyspace().VersionKey(tb.board.target(w.User)), w.User).Int64()
			require.NoError(t, err, w.User)
			require.Equal(t, w, state{w.User, -int64(score), version}) // negated: ascending order is the ranking
		}
	})

	t.Run("ConflictWritesNothing", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		id := uuid.New()
		_, err := tb.board.Submit(ctx, Command{EventID: id, UserID: "a", Delta: 1})
		require.NoError(t, err)
		_, err = tb.board.SubmitBatch(ctx, []Command{
			{EventID: uuid.New(), UserID: "c", Delta: 1},
			{EventID: id, UserID: "a", Delta: 2},
		})
		require.ErrorIs(t, err, ErrIdempotencyConflict)

		dup := uuid.New()
		_, err = tb.board.SubmitBatch(ctx, []Command{
			{EventID: dup, UserID: "c", Delta: 1},
			{EventID: dup, UserID: "c", Delta: 2},
		})
		require.True(t, errors.Is(err, ErrIdempotencyConflict))

		events, users, queued := tb.counts(t)
		require.Equal(t, []int{1, 1, 1}, []int{events, users, queued})
	})

	// An event id recorded earlier for another command differs from the
	// batch's use of it in one field only (the board, the user or the
	// delta): the batch is refused whole, its other commands included, and
	// the conflict describes the recorded command.
	t.Run("ConflictWithARecordedCommandWritesNothing", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		id := record(t, tb.board, "a", 1)
		otherID := record(t, tb.sibling(t, "other"), "a", 1)

		for _, tc := range []struct {
			name     string
			reused   Command
			board    string
			recorded Command
		}{
			{"AnotherBoard", Command{EventID: otherID, UserID: "a", Delta: 1}, "other", Command{UserID: "a", Delta: 1}},
			{"AnotherUser", Command{EventID: id, UserID: "b", Delta: 1}, tb.board.Name(), Command{UserID: "a", Delta: 1}},
			{"AnotherDelta", Command{EventID: id, UserID: "a", Delta: 2}, tb.board.Name(), Command{UserID: "a", Delta: 1}},
		} {
			t.Run(tc.name, func(t *testing.T) {
				_, err := tb.board.SubmitBatch(ctx, []Command{{EventID: uuid.New(), UserID: "c", Delta: 5}, tc.reused})
				require.ErrorIs(t, err, ErrIdempotencyConflict)
				var conflict *IdempotencyConflictError
				require.ErrorAs(t, err, &conflict)
				require.Equal(t, &IdempotencyConflictError{EventID: tc.reused.EventID, Board: tc.board,
					UserID: tc.recorded.UserID, Delta: tc.recorded.Delta, Attempted: tc.reused}, conflict)
			})
		}
		events, users, queued := tb.counts(t)
		require.Equal(t, []int{2, 2, 2}, []int{events, users, queued}, "only the two earlier submits")
		var c int
		require.NoError(t, tb.pg.Pool.QueryRow(ctx, `SELECT count(*) FROM user_scores WHERE user_id = 'c'`).Scan(&c))
		require.Zero(t, c, "the batch's valid command was not applied")
	})

	// An event id used twice in one batch, for two different commands: the
	// conflict reports the command the database recorded under it, when
	// there is one, whichever copy of the batch comes first.
	t.Run("ConflictWithinTheBatchReportsTheRecordedCommand", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		id := record(t, tb.board, "a", 1)
		otherID := record(t, tb.sibling(t, "other"), "x", 5)

		for _, tc := range []struct {
			name      string
			batch     []Command
			want      IdempotencyConflictError
			attempted int // index in batch of the refused command
		}{
			{"RecordedCopySecond", []Command{{EventID: id, UserID: "a", Delta: 2}, {EventID: id, UserID: "a", Delta: 1}},
				IdempotencyConflictError{EventID: id, Board: tb.board.Name(), UserID: "a", Delta: 1}, 0},
			{"RecordedCopyFirst", []Command{{EventID: id, UserID: "a", Delta: 1}, {EventID: id, UserID: "b", Delta: 1}},
				IdempotencyConflictError{EventID: id, Board: tb.board.Name(), UserID: "a", Delta: 1}, 1},
			{"NeitherCopyRecorded", []Command{{EventID: id, UserID: "b", Delta: 3}, {EventID: id, UserID: "b", Delta: 4}},
				IdempotencyConflictError{EventID: id, Board: tb.board.Name(), UserID: "a", Delta: 1}, 0},
			{"RecordedOnAnotherBoard", []Command{{EventID: otherID, UserID: "x", Delta: 5}, {EventID: otherID, UserID: "x", Delta: 6}},
				IdempotencyConflictError{EventID: otherID, Board: "other", UserID: "x", Delta: 5}, 0},
		} {
			t.Run(tc.name, func(t *testing.T) {
				_, err := tb.board.SubmitBatch(ctx, tc.batch)
				var conflict *IdempotencyConflictError
				require.ErrorAs(t, err, &conflict)
				want := tc.want
				want.Attempted = tc.batch[tc.attempted]
				require.Equal(t, &want, conflict)
			})
		}

		// With nothing recorded, the batch's first command under the id is
		// the one the conflict describes.
		dup := uuid.New()
		_, err := tb.board.SubmitBatch(ctx, []Command{
			{EventID: uuid.New(), UserID: "c", Delta: 7},
			{EventID: dup, UserID: "c", Delta: 1},
			{EventID: dup, UserID: "c", Delta: 2},
		})
		var conflict *IdempotencyConflictError
		require.ErrorAs(t, err, &conflict)
		require.Equal(t, &IdempotencyConflictError{EventID: dup, Board: tb.board.Name(), UserID: "c", Delta: 1,
			Attempted: Command{EventID: dup, UserID: "c", Delta: 2}, WithinBatch: true}, conflict)
		require.NotContains(t, conflict.Error(), "recorded")

		events, users, queued := tb.counts(t)
		require.Equal(t, []int{2, 2, 2}, []int{events, users, queued})
	})
}

// TestSubmitBatchInThePoolsExecMode runs SubmitBatch on pools set up for a
// transaction-pooling proxy, which must not leave statements prepared on a
// server connection: the next transaction may get another one, where a
// cached statement does not exist (simulated with DEALLOCATE ALL).
func TestSubmitBatchInThePoolsExecMode(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec, pgx.QueryExecModeCacheDescribe} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			tb := setup(t)
			pc, err := pgxpool.ParseConfig(tb.pg.ConnString)
			require.NoError(t, err)
			pc.MaxConns = 1
			pc.ConnConfig.DefaultQueryExecMode = mode
			pool, err := pgxpool.NewWithConfig(ctx, pc)
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			cfg := tb.board.Config()
			board, err := New(pool, tb.rd.Client, &cfg)
			require.NoError(t, err)
			t.Cleanup(board.Close)

			for round := range 2 {
				res, err := board.SubmitBatch(ctx, []Command{{EventID: uuid.New(), UserID: "a", Delta: 1}, {EventID: uuid.New(), UserID: "b", Delta: 2}})
				require.NoError(t, err, "round %d", round)
				require.Equal(t, Result{Score: int64(round + 1), Version: int64(round + 1)}, res[0])
				require.NoError(t, pool.AcquireFunc(ctx, func(c *pgxpool.Conn) error {
					var prepared int
					if err := c.QueryRow(ctx, `SELECT count(*) FROM pg_prepared_statements`).Scan(&prepared); err != nil {
						return err
					}
					require.Zero(t, prepared, "statements prepared on the server connection")
					_, err := c.Exec(ctx, `DEALLOCATE ALL`) // the proxy's next connection
					return err
				}))
			}
		})
	}
}
