package outbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/outbox"
)

// oddOutputSession returns a pool in mode whose sessions have bytea_output
// and DateStyle other than PostgreSQL's defaults, and appends a message
// whose payload text bytea must escape, returning it and its creation time.
func oddOutputSession(t *testing.T, b *testBundle, mode pgx.QueryExecMode) (*pgxpool.Pool, outbox.Message, time.Time) {
	t.Helper()
	pool := poolWith(t, b, func(pc *pgxpool.Config) {
		pc.ConnConfig.DefaultQueryExecMode = mode
		pc.ConnConfig.RuntimeParams["bytea_output"] = "escape"
		pc.ConnConfig.RuntimeParams["DateStyle"] = "SQL, DMY"
	})
	msg := newMessage("s", "k", 1)
	msg.Payload = []byte{0, 1, 2, 0xff, '\\', '"'}
	return pool, msg, b.appendNow(t, msg)
}

// requireOddOutput fails unless pool's sessions kept oddOutputSession's
// settings (a pin for one transaction must not outlive it).
func requireOddOutput(t *testing.T, pool *pgxpool.Pool, msg string) {
	t.Helper()
	var output, style string
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT current_setting('bytea_output'), current_setting('DateStyle')`).Scan(&output, &style))
	require.Equal(t, "escape, SQL, DMY", output+", "+style, msg)
}

// TestRelayClaimsUnderAnySessionOutputSettings runs a relay in the
// text-format exec modes a transaction-pooling proxy needs, on sessions whose
// bytea_output and DateStyle are not PostgreSQL's defaults. pgx parses text
// bytea only as hex and timestamps only as ISO, and behind PgBouncer a
// session setting cannot be pinned from the client (it refuses
// bytea_output as a startup parameter) while another client's plain SET
// stays on the shared server connection: the claim pins both for its own
// transaction.
func TestRelayClaimsUnderAnySessionOutputSettings(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			b := setup(t)
			pool, msg, written := oddOutputSession(t, b, mode)
			var got []outbox.Record
			r := b.relay(t, pool, outbox.HandlerFunc(func(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
				got = append(got, batch...)
				return make([]outbox.Result, len(batch)), nil
			}), outbox.RelayConfig{DisableNotify: true})
			n, err := r.RunOnce(ctx)
			require.NoError(t, err)
			require.Equal(t, 1, n)
			require.Len(t, got, 1)
			require.Equal(t, msg.Payload, got[0].Payload)
			require.WithinDuration(t, written, got[0].CreatedAt, time.Minute)
			requireOddOutput(t, pool, "the claim's settings outlived its transaction")
		})
	}
}

// TestDeadLettersUnderAnySessionOutputSettings: DeadLetters reads bytea and
// timestamps too, and pins the settings for its own transaction as claims
// do. It failed ("invalid hex format") on such a session, also behind
// PgBouncer after an ALTER ROLE, which the proxy's open server
// connections do not see.
func TestDeadLettersUnderAnySessionOutputSettings(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			b := setup(t)
			pool, msg, written := oddOutputSession(t, b, mode)
			r := b.relay(t, pool, outbox.HandlerFunc(func(_ context.Context, batch []outbox.Record) ([]outbox.Result, error) {
				return nil, errors.New("poison")
			}), outbox.RelayConfig{DisableNotify: true, MaxAttempts: 1})
			_, err := r.RunOnce(ctx)
			require.NoError(t, err)
			dead, err := r.DeadLetters(ctx, 0, 10)
			require.NoError(t, err)
			require.Len(t, dead, 1)
			require.Equal(t, msg.Payload, dead[0].Payload)
			require.WithinDuration(t, written, dead[0].CreatedAt, time.Minute)
			require.WithinDuration(t, time.Now(), dead[0].FailedAt, time.Minute)
			require.Equal(t, "poison", dead[0].LastError)
			requireOddOutput(t, pool, "DeadLetters' settings outlived its transaction")
		})
	}
}

// TestRecordCommandUnderAnySessionOutputSettings: RecordCommand and
// StoreCommandResult run in the caller's transaction, which they must not
// pin as a claim does; they read bytea and times in forms no setting
// changes. On such a session they failed, each call ("invalid hex
// format", a DateStyle SQL time pgx could not parse).
func TestRecordCommandUnderAnySessionOutputSettings(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			b := setup(t)
			pool, _, _ := oddOutputSession(t, b, mode)
			fingerprint := outbox.Fingerprint([]byte("c"))
			result := []byte{0, 1, 0xff, '\\', '"'}
			run := func(id uuid.UUID, fingerprint, result []byte) (outbox.Command, error) {
				tx, err := pool.Begin(ctx)
				require.NoError(t, err)
				defer tx.Rollback(ctx) //nolint:errcheck
				cmd, err := b.writer.RecordCommand(ctx, tx, id, fingerprint)
				if err != nil {
					return cmd, err
				}
				if result != nil {
					if err := b.writer.StoreCommandResult(ctx, tx, id, result); err != nil {
						return cmd, err
					}
				}
				require.NoError(t, tx.Commit(ctx))
				return cmd, nil
			}

			id := uuid.New()
			before := time.Now()
			first, err := run(id, fingerprint, result)
			require.NoError(t, err)
			require.False(t, first.Duplicate)
			require.WithinDuration(t, before, first.RecordedAt, time.Minute)

			again, err := run(id, fingerprint, result) // the same result again: accepted
			require.NoError(t, err)
			require.True(t, again.Duplicate)
			require.Equal(t, result, again.Result)
			require.True(t, first.RecordedAt.Equal(again.RecordedAt), "%s vs %s", first.RecordedAt, again.RecordedAt)

			_, err = run(id, fingerprint, []byte("another"))
			var resultConflict *outbox.CommandResultConflictError
			require.ErrorAs(t, err, &resultConflict)
			require.Equal(t, result, resultConflict.StoredResult)

			_, err = run(id, outbox.Fingerprint([]byte("d")), nil)
			var conflict *outbox.IdempotencyConflictError
			require.ErrorAs(t, err, &conflict)
			require.Equal(t, fingerprint, conflict.RecordedFingerprint)

			// An empty result is a result, not "none stored".
			empty := uuid.New()
			_, err = run(empty, fingerprint, []byte{})
			require.NoError(t, err)
			dup, err := run(empty, fingerprint, nil)
			require.NoError(t, err)
			require.NotNil(t, dup.Result)
			require.Empty(t, dup.Result)
			requireOddOutput(t, pool, "RecordCommand changed the session's settings")
		})
	}
}
