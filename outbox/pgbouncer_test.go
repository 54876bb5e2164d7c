package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
)

// TestCutOffClaimReleased: behind PgBouncer in transaction
// mode, a claim whose server connection breaks after PostgreSQL committed
// it, before its answer arrived, reaches the relay as PgBouncer's own
// error ("server conn crashed?", SQLSTATE 08P01), which the relay took for
// the server's answer: it left the committed lease to run out
// (LeaseDuration), and the next claim found no rows. A claim cut off by a
// broken connection is released at once, as the package doc promises.
// So is one without PgBouncer in those modes, whose lost answer pgx
// reports as pgconn.ErrConnClosed, marked safe to retry (nothing sent).
func TestCutOffClaimReleased(t *testing.T) {
	t.Parallel()
	for _, via := range []string{"PgBouncer", "Direct"} {
		for _, mode := range []string{"exec", "simple_protocol"} { // the README's modes for a pooler
			t.Run(via+"/"+mode, func(t *testing.T) {
				t.Parallel()
				cutOffClaimReleased(t, via == "PgBouncer", mode)
			})
		}
	}
}

func cutOffClaimReleased(t *testing.T, viaPgBouncer bool, mode string) {
	ctx := context.Background()
	b := setup(t)
	addr, database := testenv.ServerAddr(t, b.pg.ServerURL)
	drop := testenv.StartReplyDropper(t, addr)
	url := "postgres://postgres@" + drop.Addr() + "/" + database + "?sslmode=disable"
	if viaPgBouncer {
		url = testenv.StartPgBouncer(t, drop.Addr(), "transaction", 1).URL(database)
	}
	pool := testenv.NewPool(t, url+"&pool_max_conns=1&default_query_exec_mode="+mode)
	b.appendCommitted(t, newMessage("s", "k1", 1), newMessage("s", "k2", 1))
	r, err := outbox.NewRelay(pool, &recorder{}, &outbox.RelayConfig{Schema: b.cfg.Schema, Table: b.cfg.Table,
		DisableNotify: true, LeaseDuration: time.Hour})
	require.NoError(t, err)
	require.NoError(t, pool.Ping(ctx)) // PgBouncer's server connection is made now

	drop.DropReplyAfter("pg_advisory_xact_lock") // the claim's first statement
	_, err = r.RunOnce(ctx)
	require.Error(t, err, "the claim's answer was lost")
	n, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, n, "the next claim finds the rows, not a lease of the lost claim")
}
