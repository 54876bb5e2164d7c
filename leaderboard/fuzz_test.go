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
