package leaderboard

import (
	"context"
	"fmt"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
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
			addr, _ := testenv.ServerAddr(t, tb.pg.ServerURL)
			drop := testenv.StartReplyDropper(t, addr)
			board, _ := boardBehindPgBouncer(t, tb, drop.Addr(), mode)

			// PgBouncer's server connection is made now, not at the lost answer.
			_, err := board.Submit(ctx, Command{EventID: uuid.New(), UserID: "u", Delta: 1})
			require.NoError(t, err)

			// The answer lost is the one to the statement that carries this
			// user id, not one to the board's own traffic (its NOTIFY).
			cmd := Command{EventID: uuid.New(), UserID: "lost-submit", Delta: 7}
			drop.DropReplyAfter(cmd.UserID)
			_, err = board.Submit(ctx, cmd)
			require.Error(t, err)
			events, _, _ := tb.counts(t)
			require.Equal(t, 2, events, "the Submit committed")
			require.ErrorIs(t, err, ErrOutcomeUnknown, "a commit whose answer was lost reads as a definite failure")
			res, err := board.Submit(ctx, cmd)
			require.NoError(t, err)
			require.True(t, res.Duplicate)

			drop.DropReplyAfter("lost-batch")
			_, err = board.SubmitBatch(ctx, []Command{{EventID: uuid.New(), UserID: "lost-batch", Delta: 2}, {EventID: uuid.New(), UserID: "v", Delta: 3}})
			require.ErrorIs(t, err, ErrOutcomeUnknown)
		})
	}
}

// TestOversizedBatchBehindPgBouncer: PgBouncer refuses a packet larger
// than its max_packet_size with its own 08P01 ("bad packet header") before
// anything reaches PostgreSQL. That is a definite failure, not
// ErrOutcomeUnknown, whose retry with the same ids would be refused the
// same way for ever.
func TestOversizedBatchBehindPgBouncer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	addr, _ := testenv.ServerAddr(t, tb.pg.ServerURL)
	board, _ := boardBehindPgBouncer(t, tb, addr, "exec", "max_packet_size = 65536")
	cmds := make([]Command, 3000) // about 150 kB of arrays
	for i := range cmds {
		cmds[i] = Command{EventID: uuid.New(), UserID: fmt.Sprintf("user-%06d", i), Delta: 1}
	}
	_, err := board.SubmitBatch(ctx, cmds)
	require.ErrorContains(t, err, "bad packet header")
	require.NotErrorIs(t, err, ErrOutcomeUnknown, "refused before it was sent, and on every retry")
	events, _, _ := tb.counts(t)
	require.Zero(t, events)
}

// TestWaitedUnsentBehindPgBouncer: a Submit that waited in PgBouncer for
// a server connection until its query_wait_timeout never reached
// PostgreSQL: a definite failure, not ErrOutcomeUnknown ("was sent ... may
// have committed").
func TestWaitedUnsentBehindPgBouncer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	addr, _ := testenv.ServerAddr(t, tb.pg.ServerURL)
	board, url := boardBehindPgBouncer(t, tb, addr, "exec", "query_wait_timeout = 1")

	// Another client's transaction holds PgBouncer's only server connection.
	hold, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer hold.Close(ctx)
	tx, err := hold.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, "SELECT 1")
	require.NoError(t, err)
	_, err = board.Submit(ctx, Command{EventID: uuid.New(), UserID: "never-sent", Delta: 7})
	require.ErrorContains(t, err, "query_wait_timeout")
	require.NotErrorIs(t, err, ErrOutcomeUnknown, "never sent, yet reported as maybe committed")
	require.NoError(t, tx.Rollback(ctx))
	events, _, _ := tb.counts(t)
	require.Zero(t, events)
}

// boardBehindPgBouncer returns a board on tb's tables whose pool (one
// connection, exec mode) goes through a private PgBouncer in transaction
// mode with one server connection, in front of target (tb's server, or a
// ReplyDropper in front of it), and that PgBouncer's URL for tb's database.
func boardBehindPgBouncer(t *testing.T, tb *testBundle, target, mode string, settings ...string) (*Board, string) {
	t.Helper()
	_, database := testenv.ServerAddr(t, tb.pg.ServerURL)
	url := testenv.StartPgBouncer(t, target, "transaction", 1, settings...).URL(database) + "&default_query_exec_mode=" + mode
	pool := testenv.NewPool(t, url+"&pool_max_conns=1")
	cfg := tb.board.Config()
	board, err := New(pool, tb.rd.Client, &cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	return board, url
}
