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

// validCommand is the documented validation rule, written out independently.
func validCommand(cmd leaderboard.Command) bool {
	return cmd.EventID != uuid.Nil &&
		cmd.UserID != "" && len(cmd.UserID) <= leaderboard.MaxUserIDLengthDefault &&
		utf8.ValidString(cmd.UserID) && !strings.ContainsRune(cmd.UserID, 0) &&
		cmd.Delta >= leaderboard.MinDeltaDefault && cmd.Delta <= leaderboard.MaxDeltaDefault
}

// FuzzSubmit submits arbitrary commands to a board on a real PostgreSQL.
// A command the documented rule rejects must fail with a *ValidationError
// and write nothing; an event id reused for another command must fail with
// ErrIdempotencyConflict and write nothing; an accepted command writes one
// score event and one outbox row, and its Result is what PostgreSQL holds.
// No input may produce any other error.
func FuzzSubmit(f *testing.F) {
	pg := testenv.Postgres(f)
	rd := testenv.Redis(f)
	cfg := &leaderboard.Config{Name: "fuzz", Schema: pg.Schema, KeyPrefix: rd.Prefix}
	require.NoError(f, leaderboard.Migrate(context.Background(), pg.Pool, cfg))
	board, err := leaderboard.New(pg.Pool, rd.Client, cfg)
	require.NoError(f, err)

	id := uuid.MustParse("6f1c1e2a-8d4b-4c1e-9a51-3b0d2f4e5a61")
	f.Add(id[:], "alice", int64(10))
	f.Add(id[:], "alice", int64(11)) // same id, different delta: a conflict
	f.Add(make([]byte, 16), "bob", int64(1))
	f.Add([]byte{1}, "", int64(1))
	f.Add([]byte{2}, "carol'); DROP TABLE user_scores; --", int64(-1000))
	f.Add([]byte{3}, "dave", int64(1001))
	f.Add([]byte{4}, "nul\x00byte", int64(1))
	f.Add([]byte{5}, "\xff\xfe", int64(1))
	f.Add([]byte{6}, strings.Repeat("é", 65), int64(1))
	f.Add([]byte{7}, "{slot}:x", int64(-9223372036854775808))
	f.Fuzz(func(t *testing.T, idBytes []byte, userID string, delta int64) {
		var eventID uuid.UUID
		copy(eventID[:], idBytes)
		cmd := leaderboard.Command{EventID: eventID, UserID: userID, Delta: delta}
		before := fuzzCounts(t, pg)
		res, err := board.Submit(context.Background(), cmd)
		after := fuzzCounts(t, pg)

		var verr *leaderboard.ValidationError
		switch {
		case errors.As(err, &verr):
			require.False(t, validCommand(cmd), "a valid command was refused: %v", err)
			require.ErrorIs(t, err, leaderboard.ErrInvalidCommand)
			require.Equal(t, before, after, "a refused command wrote something")
			return
		case errors.Is(err, leaderboard.ErrIdempotencyConflict):
			require.Equal(t, before, after, "a conflicting command wrote something")
			return
		}
		require.NoError(t, err)
		require.True(t, validCommand(cmd), "an invalid command was accepted: %+v", cmd)
		if res.Duplicate {
			require.Equal(t, before, after, "a duplicate wrote something")
			return
		}
		require.Equal(t, before[0]+1, after[0], "score events")
		require.Equal(t, before[2]+1, after[2], "outbox rows")
		var score, version int64
		require.NoError(t, pg.Pool.QueryRow(context.Background(),
			`SELECT score, version FROM `+pgx.Identifier{leaderboard.UserScoresTable}.Sanitize()+` WHERE board = $1 AND user_id = $2`,
			board.Name(), userID).Scan(&score, &version))
		require.Equal(t, leaderboard.Result{Score: score, Version: version}, res)
		var payload []byte
		require.NoError(t, pg.Pool.QueryRow(context.Background(),
			`SELECT payload FROM `+pgx.Identifier{outbox.TableDefault}.Sanitize()+` WHERE event_id = $1`, eventID).Scan(&payload))
		require.Equal(t, strconv.FormatInt(score, 10), string(payload), "the outbox carries the absolute score")
	})
}
