package leaderboard

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// TestOutcomeUnknownBehindPgBouncer: behind PgBouncer in transaction mode,
// a statement whose server connection breaks after PostgreSQL committed,
// before its answer arrived, gets PgBouncer's own error ("server conn
// crashed?", SQLSTATE 08P01), which PostgreSQL never sent. It was returned
// as a definite failure; the command had committed. It must match
// ErrOutcomeUnknown, and a retry with the same id be a duplicate.
func TestOutcomeUnknownBehindPgBouncer(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"exec", "simple_protocol"} { // the README's modes for a pooler
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			tb := setup(t)
			addr, database := testenv.ServerAddr(t, tb.pg.ServerURL)
			drop := testenv.StartReplyDropper(t, addr)
			bouncer := testenv.StartPgBouncer(t, drop.Addr(), "transaction", 1)
			pool := testenv.NewPool(t, bouncer.URL(database)+"&pool_max_conns=1&default_query_exec_mode="+mode)
			cfg := tb.board.Config()
			board, err := New(pool, tb.rd.Client, &cfg)
			require.NoError(t, err)
			t.Cleanup(board.Close)

			// PgBouncer's server connection is made now, not at the lost answer.
			_, err = board.Submit(ctx, Command{EventID: uuid.New(), UserID: "u", Delta: 1})
			require.NoError(t, err)

			cmd := Command{EventID: uuid.New(), UserID: "u", Delta: 7}
			drop.DropNextReply()
			_, err = board.Submit(ctx, cmd)
			require.Error(t, err)
			events, _, _ := tb.counts(t)
			require.Equal(t, 2, events, "the Submit committed")
			require.ErrorIs(t, err, ErrOutcomeUnknown, "a commit whose answer was lost reads as a definite failure")
			res, err := board.Submit(ctx, cmd)
			require.NoError(t, err)
			require.True(t, res.Duplicate)

			drop.DropNextReply()
			_, err = board.SubmitBatch(ctx, []Command{{EventID: uuid.New(), UserID: "u", Delta: 2}, {EventID: uuid.New(), UserID: "v", Delta: 3}})
			require.ErrorIs(t, err, ErrOutcomeUnknown)
		})
	}
}
