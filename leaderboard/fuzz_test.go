package leaderboard_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
	"github.com/verity-go/verity/outbox"
)

// fuzzCounts returns the rows a submit can write: score events, user rows,
// and outbox rows.
func fuzzCounts(t *testing.T, pg *testenv.PG) [3]int64 {
	t.Helper()
	var c [3]int64
	q := `SELECT (SELECT count(*) FROM ` + pgx.Identifier{leaderboard.ScoreEventsTable}.Sanitize() + `),
	             (SELECT count(*) FROM ` + pgx.Identifier{leaderboard.UserScoresTable}.Sanitize() + `),
	             (SELECT count(*) FROM ` + pgx.Identifier{outbox.TableDefault}.Sanitize() + `)`
	require.NoError(t, pg.Pool.QueryRow(context.Background(), q).Scan(&c[0], &c[1], &c[2]))
	return c
}

// validCommand is the documented validation rule, written out independently,
// for a board whose deltas lie in [minDelta, maxDelta].
func validCommand(cmd leaderboard.Command, minDelta, maxDelta int64) bool {
	return cmd.EventID != uuid.Nil &&
		cmd.UserID != "" && len(cmd.UserID) <= leaderboard.MaxUserIDLengthDefault &&
		utf8.ValidString(cmd.UserID) && !strings.ContainsRune(cmd.UserID, 0) &&
		cmd.Delta >= minDelta && cmd.Delta <= maxDelta
}

// FuzzSubmit submits arbitrary commands to a board on a real PostgreSQL:
// one with the default delta bounds, or (wide) one that allows any delta in
// [MinScore, MaxScore], so that sums leave the score range. A command the
// documented rule rejects must fail with a *ValidationError and write
// nothing; an event id reused for another command must fail with
// ErrIdempotencyConflict and write nothing; a command whose score, the
// user's previous one plus its delta, would leave [MinScore, MaxScore] must
// fail with a *ScoreOutOfRangeError and write nothing; an accepted command
// writes one score event and one outbox row, its score is that sum, and its
// Result is what PostgreSQL holds. No input may produce any other error.
func FuzzSubmit(f *testing.F) {
	pg := testenv.Postgres(f)
	rd := testenv.Redis(f)
	ctx := context.Background()
	newBoard := func(cfg *leaderboard.Config) *leaderboard.Board {
		require.NoError(f, leaderboard.Migrate(ctx, pg.Pool, cfg))
		board, err := leaderboard.New(pg.Pool, rd.Client, cfg)
		require.NoError(f, err)
		f.Cleanup(board.Close)
		return board
	}
	narrow := newBoard(&leaderboard.Config{Name: "fuzz", Schema: pg.Schema, KeyPrefix: rd.Prefix})
	wideBoard := newBoard(&leaderboard.Config{Name: "fuzz-wide", Schema: pg.Schema, KeyPrefix: rd.Prefix,
		MinDelta: leaderboard.MinScore, MaxDelta: leaderboard.MaxScore})
	scoreOf := func(t *testing.T, board *leaderboard.Board, userID string) (score, version int64, found bool) {
		t.Helper()
		err := pg.Pool.QueryRow(ctx,
			`SELECT score, version FROM `+pgx.Identifier{leaderboard.UserScoresTable}.Sanitize()+` WHERE board = $1 AND user_id = $2`,
			board.Name(), userID).Scan(&score, &version)
		if errors.Is(err, pgx.ErrNoRows) {
			return 0, 0, false
		}
		require.NoError(t, err)
		return score, version, true
	}

	id := uuid.MustParse("6f1c1e2a-8d4b-4c1e-9a51-3b0d2f4e5a61")
	f.Add(id[:], "alice", int64(10), false)
	f.Add(id[:], "alice", int64(11), false) // same id, different delta: a conflict
	f.Add(make([]byte, 16), "bob", int64(1), false)
	f.Add([]byte{1}, "", int64(1), false)
	f.Add([]byte{2}, "carol'); DROP TABLE user_scores; --", int64(-1000), false)
	f.Add([]byte{3}, "dave", int64(1001), false)
	f.Add([]byte{4}, "nul\x00byte", int64(1), false)
	f.Add([]byte{5}, "\xff\xfe", int64(1), false)
	f.Add([]byte{6}, strings.Repeat("é", 65), int64(1), false)
	f.Add([]byte{7}, "{slot}:x", int64(-9223372036854775808), false)
	f.Add([]byte{8}, "erin", leaderboard.MaxScore, true)
	f.Add([]byte{9}, "erin", int64(1), true) // past MaxScore after the previous
	f.Add([]byte{10}, "frank", leaderboard.MinScore, true)
	f.Add([]byte{11}, "frank", leaderboard.MinScore, true)
	f.Add([]byte{12}, "gus", leaderboard.MaxScore+1, true)
	f.Fuzz(func(t *testing.T, idBytes []byte, userID string, delta int64, wide bool) {
		board, minDelta, maxDelta := narrow, leaderboard.MinDeltaDefault, leaderboard.MaxDeltaDefault
		if wide {
			board, minDelta, maxDelta = wideBoard, leaderboard.MinScore, leaderboard.MaxScore
		}
		var eventID uuid.UUID
		copy(eventID[:], idBytes)
		cmd := leaderboard.Command{EventID: eventID, UserID: userID, Delta: delta}
		valid := validCommand(cmd, minDelta, maxDelta)
		var prior int64
		if valid {
			prior, _, _ = scoreOf(t, board, userID)
		}
		// Both operands lie in [MinScore, MaxScore], so the sum cannot
		// overflow int64.
		sum := prior + delta
		inRange := sum >= leaderboard.MinScore && sum <= leaderboard.MaxScore
		before := fuzzCounts(t, pg)
		res, err := board.Submit(ctx, cmd)
		after := fuzzCounts(t, pg)

		var (
			verr *leaderboard.ValidationError
			rerr *leaderboard.ScoreOutOfRangeError
		)
		switch {
		case errors.As(err, &verr):
			require.False(t, valid, "a valid command was refused: %v", err)
			require.ErrorIs(t, err, leaderboard.ErrInvalidCommand)
			require.Equal(t, before, after, "a refused command wrote something")
			return
		case errors.Is(err, leaderboard.ErrIdempotencyConflict):
			require.Equal(t, before, after, "a conflicting command wrote something")
			return
		case errors.As(err, &rerr):
			require.True(t, valid, "an invalid command got past validation: %v", err)
			require.False(t, inRange, "%d + %d was refused as out of range: %v", prior, delta, err)
			require.ErrorIs(t, err, leaderboard.ErrScoreOutOfRange)
			require.Equal(t, userID, rerr.UserID)
			require.Equal(t, delta, rerr.Delta)
			require.Equal(t, before, after, "an out-of-range command wrote something")
			return
		}
		require.NoError(t, err)
		require.True(t, valid, "an invalid command was accepted: %+v", cmd)
		if res.Duplicate {
			require.Equal(t, before, after, "a duplicate wrote something")
			return
		}
		require.True(t, inRange, "%d + %d was accepted out of range", prior, delta)
		require.Equal(t, before[0]+1, after[0], "score events")
		require.Equal(t, before[2]+1, after[2], "outbox rows")
		score, version, found := scoreOf(t, board, userID)
		require.True(t, found, "an accepted command left no score row")
		require.Equal(t, sum, score, "the score is the previous one plus the delta")
		require.Equal(t, leaderboard.Result{Score: score, Version: version}, res)
		var payload []byte
		require.NoError(t, pg.Pool.QueryRow(ctx,
			`SELECT payload FROM `+pgx.Identifier{outbox.TableDefault}.Sanitize()+` WHERE event_id = $1`, eventID).Scan(&payload))
		require.Equal(t, strconv.FormatInt(score, 10), string(payload), "the outbox carries the absolute score")
	})
}

// FuzzSubmitBatch submits arbitrary batches (ids drawn from a small set,
// so repeats within and across batches happen; users from a small set plus
// an arbitrary one; arbitrary deltas on a board allowing any delta)
// through SubmitBatch, SubmitBatchTx or SubmitTx, and checks each against
// a model computed from what PostgreSQL holds before the call: the first
// invalid command's *ValidationError, a conflict within the batch or with
// an earlier submission, the first out-of-range score, duplicates answered
// with the original result, and otherwise exact scores, versions, events
// and outbox rows. A refused batch writes nothing and leaves the caller's
// transaction usable.
func FuzzSubmitBatch(f *testing.F) {
	pg := testenv.Postgres(f)
	rd := testenv.Redis(f)
	ctx := context.Background()
	cfg := &leaderboard.Config{Name: "fuzz-batch", Schema: pg.Schema, KeyPrefix: rd.Prefix,
		MinDelta: leaderboard.MinScore, MaxDelta: leaderboard.MaxScore}
	require.NoError(f, leaderboard.Migrate(ctx, pg.Pool, cfg))
	board, err := leaderboard.New(pg.Pool, rd.Client, cfg)
	require.NoError(f, err)
	f.Cleanup(board.Close)

	f.Add([]byte{1, 0, 2, 1, 1, 0}, "z", int64(5), int64(-3), int64(7), false)
	f.Add([]byte{1, 0, 1, 0}, "z", int64(5), int64(5), int64(7), false)
	f.Add([]byte{1, 0, 1, 1}, "z", int64(5), int64(6), int64(7), true)
	f.Add([]byte{3, 2, 4, 2}, "", int64(leaderboard.MaxScore), int64(1), int64(-1), false)
	f.Add([]byte{5, 0, 6, 0}, "x", int64(leaderboard.MaxScore), int64(1), int64(-2), true)
	f.Add([]byte{0, 0}, "x", int64(1), int64(1), int64(1), false)
	f.Add([]byte{7, 2}, "nul\x00", int64(1), int64(1), int64(1), false)
	f.Add([]byte{9, 1, 10, 1, 11, 1}, "x", int64(-9007199254740992), int64(-1), int64(3), false)

	type event struct {
		user        string
		delta       int64
		score, vers int64
		found       bool
	}
	priorEvent := func(t *testing.T, id uuid.UUID) event {
		var e event
		var boardName string
		err := pg.Pool.QueryRow(ctx, `SELECT board, user_id, delta, score, version FROM `+
			pgx.Identifier{leaderboard.ScoreEventsTable}.Sanitize()+` WHERE event_id = $1`, id).
			Scan(&boardName, &e.user, &e.delta, &e.score, &e.vers)
		if errors.Is(err, pgx.ErrNoRows) {
			return e
		}
		require.NoError(t, err)
		e.found = true
		return e
	}
	userScore := func(t *testing.T, user string) (int64, int64) {
		var s, v int64
		err := pg.Pool.QueryRow(ctx, `SELECT score, version FROM `+
			pgx.Identifier{leaderboard.UserScoresTable}.Sanitize()+` WHERE board = $1 AND user_id = $2`,
			board.Name(), user).Scan(&s, &v)
		if errors.Is(err, pgx.ErrNoRows) {
			return 0, 0
		}
		require.NoError(t, err)
		return s, v
	}

	f.Fuzz(func(t *testing.T, data []byte, u string, d0, d1, d2 int64, useTx bool) {
		deltas := []int64{d0, d1, d2}
		var cmds []leaderboard.Command
		for i := 0; i+1 < len(data) && len(cmds) < 6; i += 2 {
			var id uuid.UUID
			if sel := data[i] % 16; sel != 0 {
				id = uuid.MustParse("00000000-0000-4000-8000-0000000000" + string("0123456789abcdef"[sel]) + "0")
			}
			user := []string{"a", "b", u}[int(data[i+1])%3]
			cmds = append(cmds, leaderboard.Command{EventID: id, UserID: user, Delta: deltas[len(cmds)%3]})
		}
		if len(cmds) == 0 {
			return
		}
		// The model.
		firstInvalid := -1
		for i, c := range cmds {
			if !validCommand(c, leaderboard.MinScore, leaderboard.MaxScore) {
				firstInvalid = i
				break
			}
		}
		conflict := false
		first := map[uuid.UUID]int{}
		priors := map[uuid.UUID]event{}
		if firstInvalid < 0 {
			for i, c := range cmds {
				if j, ok := first[c.EventID]; ok {
					if cmds[j].UserID != c.UserID || cmds[j].Delta != c.Delta {
						conflict = true
					}
					continue
				}
				first[c.EventID] = i
				p := priorEvent(t, c.EventID)
				priors[c.EventID] = p
				if p.found && (p.user != c.UserID || p.delta != c.Delta) {
					conflict = true
				}
			}
		}
		want := make([]leaderboard.Result, len(cmds))
		outOfRange := -1
		state := map[string][2]int64{}
		newEvents, newUsers := 0, map[string]bool{}
		if firstInvalid < 0 && !conflict {
			for i, c := range cmds {
				if j := first[c.EventID]; j != i {
					want[i] = want[j]
					want[i].Duplicate = true
					continue
				}
				if p := priors[c.EventID]; p.found {
					want[i] = leaderboard.Result{Score: p.score, Version: p.vers, Duplicate: true}
					continue
				}
				st, ok := state[c.UserID]
				if !ok {
					s, v := userScore(t, c.UserID)
					st = [2]int64{s, v}
				}
				st[0] += c.Delta
				st[1]++
				state[c.UserID] = st
				if outOfRange < 0 && (st[0] > leaderboard.MaxScore || st[0] < leaderboard.MinScore) {
					outOfRange = i
				}
				want[i] = leaderboard.Result{Score: st[0], Version: st[1]}
				newEvents++
				newUsers[c.UserID] = true
			}
		}

		before := fuzzCounts(t, pg)
		var got []leaderboard.Result
		var err error
		if useTx {
			tx, terr := pg.Pool.Begin(ctx)
			require.NoError(t, terr)
			if len(cmds) == 1 && data[0]&0x80 != 0 {
				var r leaderboard.Result
				r, err = board.SubmitTx(ctx, tx, cmds[0])
				if err == nil {
					got = []leaderboard.Result{r}
				}
			} else {
				got, err = board.SubmitBatchTx(ctx, tx, cmds)
			}
			var ic *leaderboard.IdempotencyConflictError
			var ve *leaderboard.ValidationError
			if errors.As(err, &ic) || errors.As(err, &ve) {
				_, uerr := tx.Exec(ctx, "SELECT 1")
				require.NoError(t, uerr, "tx unusable after %v (cmds %+v)", err, cmds)
			}
			if err == nil {
				require.NoError(t, tx.Commit(ctx))
			} else {
				_ = tx.Rollback(ctx)
			}
		} else {
			got, err = board.SubmitBatch(ctx, cmds)
		}
		after := fuzzCounts(t, pg)

		var (
			verr *leaderboard.ValidationError
			rerr *leaderboard.ScoreOutOfRangeError
		)
		switch {
		case firstInvalid >= 0:
			require.True(t, errors.As(err, &verr), "want a *ValidationError for command %d, got %v", firstInvalid, err)
			require.Equal(t, firstInvalid, verr.Index, "%v", err)
			require.Equal(t, before, after, "a refused batch wrote something")
		case conflict:
			require.ErrorIs(t, err, leaderboard.ErrIdempotencyConflict, "cmds %+v", cmds)
			require.Equal(t, before, after, "a conflicting batch wrote something")
		case outOfRange >= 0:
			require.True(t, errors.As(err, &rerr), "want a *ScoreOutOfRangeError for command %d, got %v (cmds %+v)", outOfRange, err, cmds)
			if !useTx {
				require.Equal(t, outOfRange, rerr.Index, "%v (cmds %+v)", err, cmds)
				require.Equal(t, cmds[outOfRange].UserID, rerr.UserID)
				require.Equal(t, cmds[outOfRange].Delta, rerr.Delta)
			}
			require.Equal(t, before, after, "an out-of-range batch wrote something")
		default:
			require.NoError(t, err, "cmds %+v", cmds)
			require.Equal(t, want, got, "cmds %+v", cmds)
			require.Equal(t, before[0]+int64(newEvents), after[0], "score events")
			require.Equal(t, before[2]+int64(len(newUsers)), after[2], "outbox rows")
			for user, st := range state {
				s, v := userScore(t, user)
				require.Equal(t, st, [2]int64{s, v}, "user %q", user)
			}
		}
	})
}
