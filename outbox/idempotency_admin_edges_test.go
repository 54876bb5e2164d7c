package outbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/outbox"
)

// IdempotencyConflictError.GivenFingerprint is "the fingerprint of the
// refused call": a caller that reuses its fingerprint buffer afterwards
// (hashing the next command into it) must not change what the error reports.
func TestRecordCommandConflictCopiesTheGivenFingerprint(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	id := uuid.New()
	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		_, err := b.writer.RecordCommand(ctx, tx, id, outbox.Fingerprint([]byte("a")))
		return err
	}))

	given := outbox.Fingerprint([]byte("b"))
	want := append([]byte(nil), given...)
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	_, err = b.writer.RecordCommand(ctx, tx, id, given)
	var conflict *outbox.IdempotencyConflictError
	require.ErrorAs(t, err, &conflict)
	copy(given, outbox.Fingerprint([]byte("next command"))) // the caller reuses its buffer
	require.Equal(t, want, conflict.GivenFingerprint, "the error's GivenFingerprint changed with the caller's buffer")
}

// PruneCommands "deletes idempotency records older than retention": a record
// exactly retention old (to the microsecond, on the prune's own now()) is
// not older, and stays; one a microsecond older goes.
func TestPruneCommandsKeepsARecordExactlyRetentionOld(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	table := pgx.Identifier{b.cfg.Schema, outbox.TableDefault + "_idempotency"}.Sanitize()
	id := uuid.New()
	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		_, err := b.writer.RecordCommand(ctx, tx, id, outbox.Fingerprint([]byte("a")))
		return err
	}))

	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	// The record is dated exactly one second before this transaction's now(),
	// which PruneCommands, run in it, measures from.
	_, err = tx.Exec(ctx, `UPDATE `+table+` SET created_at = now() - interval '1 second' WHERE event_id = $1`, id)
	require.NoError(t, err)
	n, err := b.writer.PruneCommands(ctx, tx, time.Second)
	require.NoError(t, err)
	require.Zero(t, n, "a record exactly retention old is not older than retention")
	n, err = b.writer.PruneCommands(ctx, tx, time.Second-time.Microsecond)
	require.NoError(t, err)
	require.EqualValues(t, 1, n, "a record older than retention is deleted")
}

// storeHookTx runs after once StoreCommandResult's UPDATE has run.
type storeHookTx struct {
	pgx.Tx
	after func()
}

func (h storeHookTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if !strings.HasPrefix(sql, "UPDATE") {
		return h.Tx.QueryRow(ctx, sql, args...)
	}
	return afterScanRow{row: h.Tx.QueryRow(ctx, sql, args...), after: h.after}
}

// A StoreCommandResult whose UPDATE found no record, in a READ COMMITTED
// transaction that did not record the id, while another transaction
// records it (without a result) and commits before the lookup: no result is
// stored, so the call must neither succeed (nothing was written) nor claim
// a stored result with different bytes (ErrCommandResultConflict: "the
// command already has a different result stored"; none is). It reports
// ErrCommandNotRecorded, as its doc says.
func TestStoreCommandResultBesideARecordCommittedMeanwhile(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, tc := range []struct {
		name   string
		result []byte
	}{{"Empty", []byte{}}, {"NonEmpty", []byte("r")}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			id := uuid.New()
			other, err := b.pool.Begin(ctx)
			require.NoError(t, err)
			defer other.Rollback(ctx) //nolint:errcheck
			_, err = b.writer.RecordCommand(ctx, other, id, outbox.Fingerprint([]byte("c")))
			require.NoError(t, err)

			tx, err := b.pool.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(ctx) //nolint:errcheck
			hooked := storeHookTx{Tx: tx, after: func() { require.NoError(t, other.Commit(ctx)) }}
			err = b.writer.StoreCommandResult(ctx, hooked, id, tc.result)
			require.Error(t, err, "StoreCommandResult reported success, yet stored nothing")
			require.False(t, errors.Is(err, outbox.ErrCommandResultConflict), "no result is stored, yet: %v", err)
			require.ErrorIs(t, err, outbox.ErrCommandNotRecorded, "to this transaction the command was not recorded when its update ran")
			var stored *[]byte
			require.NoError(t, b.pool.QueryRow(ctx, `SELECT result FROM `+
				pgx.Identifier{b.cfg.Schema, outbox.TableDefault + "_idempotency"}.Sanitize()+` WHERE event_id = $1`, id).Scan(&stored))
			require.Nil(t, stored)
		})
	}
}

// Stats.OldestPendingAge: "Zero when nothing is pending ... Rows whose
// created_at is not finite have no age and are left out." With only an
// 'infinity' row pending (stored before migration 006), Stats still
// succeeds, counts it as pending, and reports an age of 0.
func TestRelayStatsOnlyAnInfinityRowPending(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	b.insertBeforeMigration006(t, "k", "infinity")
	r := b.relay(t, nil, &recorder{}, outbox.RelayConfig{})
	stats, err := r.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, stats.Pending)
	require.Zero(t, stats.OldestPendingAge, "a row without an age is left out")
}

// ReplayFilter.Stream "selects only this stream"; validate refuses only a
// filter no dead letter can match, and a stream of exactly MaxStreamBytes is
// a valid stream (Message.Stream: "at most MaxStreamBytes bytes"): its dead
// letters can be selected by it.
func TestReplayDeadFilterStreamOfMaxStreamBytes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	stream := strings.Repeat("s", outbox.MaxStreamBytes)
	b.appendCommitted(t, newMessage(stream, "k", 1), newMessage("other", "k", 1))
	r := b.relay(t, nil, &recorder{fail: func(outbox.Record) error { return errors.New("poison") }},
		outbox.RelayConfig{MaxAttempts: 1})
	_, err := r.RunOnce(ctx)
	require.NoError(t, err)
	dead, err := r.DeadLetters(ctx, 0, 10)
	require.NoError(t, err)
	require.Len(t, dead, 2)

	n, err := r.ReplayDead(ctx, outbox.ReplayFilter{Stream: stream})
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	require.Equal(t, 1, b.count(t, b.writer.Table()))
}
