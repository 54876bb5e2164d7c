package outbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" database/sql driver
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/outbox"
)

func (b *testBundle) idempotencyRows(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, b.pool.QueryRow(context.Background(),
		`SELECT count(*) FROM `+pgx.Identifier{b.cfg.Schema, outbox.TableDefault + "_idempotency"}.Sanitize()).Scan(&n))
	return n
}

// insertHookTx calls before and after each INSERT that RecordCommand sends
// through it, so a test can commit a concurrent change, on another
// connection, exactly between RecordCommand's statements.
type insertHookTx struct {
	pgx.Tx
	before, after func()
}

func (h insertHookTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if !strings.HasPrefix(sql, "INSERT INTO") {
		return h.Tx.QueryRow(ctx, sql, args...)
	}
	if h.before != nil {
		h.before()
	}
	return afterScanRow{row: h.Tx.QueryRow(ctx, sql, args...), after: h.after}
}

// afterScanRow calls after once the statement has run (Scan returned).
type afterScanRow struct {
	row   pgx.Row
	after func()
}

func (r afterScanRow) Scan(dest ...any) error {
	err := r.row.Scan(dest...)
	if r.after != nil {
		r.after()
	}
	return err
}

func TestRecordCommand(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// execute runs one command the way a handler would: record it, and
	// when it is new, store a result, append its message and commit.
	execute := func(t *testing.T, b *testBundle, id uuid.UUID, command string) (outbox.Command, error) {
		t.Helper()
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck
		cmd, err := b.writer.RecordCommand(ctx, tx, id, outbox.Fingerprint([]byte(command)))
		if err != nil {
			return cmd, err
		}
		if !cmd.Duplicate {
			require.NoError(t, b.writer.StoreCommandResult(ctx, tx, id, []byte("result of "+command)))
			require.NoError(t, b.writer.Append(ctx, tx, outbox.Message{EventID: id, Stream: "s", Key: "k", Version: 1, Payload: []byte(command)}))
		}
		require.NoError(t, tx.Commit(ctx))
		return cmd, nil
	}

	// executedThenTx executes command "c" under a new event id, then
	// begins a transaction at iso (rolled back at cleanup) for a test to
	// race a prune against.
	executedThenTx := func(t *testing.T, b *testBundle, iso pgx.TxIsoLevel) (uuid.UUID, pgx.Tx) {
		t.Helper()
		id := uuid.New()
		_, err := execute(t, b, id, "c")
		require.NoError(t, err)
		tx, err := b.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(ctx) })
		return id, tx
	}

	// txBeganBeforeC begins a REPEATABLE READ transaction (rolled back at
	// cleanup), then executes "c" under a new event id, then takes tx's
	// snapshot, which sees c: tx's now() is older than c's created_at.
	txBeganBeforeC := func(t *testing.T, b *testBundle) (uuid.UUID, pgx.Tx) {
		t.Helper()
		id := uuid.New()
		tx, err := b.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(ctx) })
		time.Sleep(5 * time.Millisecond) // tx's now() is before c's
		_, err = execute(t, b, id, "c")
		require.NoError(t, err)
		_, err = tx.Exec(ctx, "SELECT 1") // takes the snapshot, which sees c
		require.NoError(t, err)
		return id, tx
	}

	t.Run("FirstThenDuplicate", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		id := uuid.New()
		first, err := execute(t, b, id, "add 10 to user-a")
		require.NoError(t, err)
		require.False(t, first.Duplicate)
		require.Equal(t, id, first.EventID)

		again, err := execute(t, b, id, "add 10 to user-a")
		require.NoError(t, err)
		require.True(t, again.Duplicate)
		require.Equal(t, "result of add 10 to user-a", string(again.Result))
		require.WithinDuration(t, first.RecordedAt, again.RecordedAt, time.Millisecond)
		require.Equal(t, 1, b.count(t, b.writer.Table()), "one effect only")
	})

	// A duplicate of a command whose transaction stored no result sees
	// none (nil), not an empty result: the two are told apart.
	t.Run("DuplicateWithoutStoredResult", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		id := uuid.New()
		record := func() outbox.Command {
			t.Helper()
			tx, err := b.pool.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(ctx) //nolint:errcheck
			cmd, err := b.writer.RecordCommand(ctx, tx, id, outbox.Fingerprint([]byte("c")))
			require.NoError(t, err)
			require.NoError(t, tx.Commit(ctx))
			return cmd
		}
		require.False(t, record().Duplicate)
		again := record()
		require.True(t, again.Duplicate)
		require.Nil(t, again.Result, "no result was stored")
	})

	t.Run("ConflictingFingerprint", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		id := uuid.New()
		_, err := execute(t, b, id, "add 10 to user-a")
		require.NoError(t, err)

		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck
		_, err = b.writer.RecordCommand(ctx, tx, id, outbox.Fingerprint([]byte("add 99 to user-b")))
		require.ErrorIs(t, err, outbox.ErrIdempotencyConflict)
		var conflict *outbox.IdempotencyConflictError
		require.ErrorAs(t, err, &conflict)
		require.Equal(t, id, conflict.EventID)
		require.Equal(t, outbox.Fingerprint([]byte("add 10 to user-a")), conflict.RecordedFingerprint)
		require.Equal(t, outbox.Fingerprint([]byte("add 99 to user-b")), conflict.GivenFingerprint)
		require.Contains(t, err.Error(), id.String())
		// The transaction is still usable and nothing was written.
		require.NoError(t, tx.Commit(ctx))
		require.Equal(t, 1, b.idempotencyRows(t))
	})

	// The first result stored is what every duplicate returns: a later
	// StoreCommandResult, in a duplicate's transaction or in the recording
	// one, may repeat it but never replace it.
	t.Run("StoredResultIsKept", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		id := uuid.New()
		_, err := execute(t, b, id, "c")
		require.NoError(t, err)
		requireResult := func(want string) {
			t.Helper()
			tx, err := b.pool.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(ctx) //nolint:errcheck
			cmd, err := b.writer.RecordCommand(ctx, tx, id, outbox.Fingerprint([]byte("c")))
			require.NoError(t, err)
			require.True(t, cmd.Duplicate)
			require.Equal(t, want, string(cmd.Result))
		}
		requireConflict := func(err error, stored, given string) {
			t.Helper()
			require.ErrorIs(t, err, outbox.ErrCommandResultConflict)
			var conflict *outbox.CommandResultConflictError
			require.ErrorAs(t, err, &conflict)
			require.Equal(t, id, conflict.EventID)
			require.Equal(t, stored, string(conflict.StoredResult))
			require.Equal(t, given, string(conflict.GivenResult))
			require.Contains(t, err.Error(), id.String())
		}

		// A duplicate's transaction stores its own answer.
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck
		cmd, err := b.writer.RecordCommand(ctx, tx, id, outbox.Fingerprint([]byte("c")))
		require.NoError(t, err)
		require.True(t, cmd.Duplicate)
		require.NoError(t, b.writer.StoreCommandResult(ctx, tx, id, []byte("result of c")), "the same bytes: a retry")
		requireConflict(b.writer.StoreCommandResult(ctx, tx, id, []byte("another result")), "result of c", "another result")
		require.NoError(t, tx.Commit(ctx), "the transaction is still usable")
		requireResult("result of c")

		// Within the recording transaction: the first store is kept too,
		// unless a savepoint rolled it back.
		id = uuid.New()
		tx, err = b.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck
		_, err = b.writer.RecordCommand(ctx, tx, id, outbox.Fingerprint([]byte("c")))
		require.NoError(t, err)
		_, err = tx.Exec(ctx, `SAVEPOINT s`)
		require.NoError(t, err)
		require.NoError(t, b.writer.StoreCommandResult(ctx, tx, id, []byte("undone")))
		_, err = tx.Exec(ctx, `ROLLBACK TO SAVEPOINT s`)
		require.NoError(t, err)
		require.NoError(t, b.writer.StoreCommandResult(ctx, tx, id, []byte("first")))
		require.NoError(t, b.writer.StoreCommandResult(ctx, tx, id, []byte("first")))
		requireConflict(b.writer.StoreCommandResult(ctx, tx, id, []byte("second")), "first", "second")
		require.NoError(t, tx.Commit(ctx))
		requireResult("first")

		// An empty (nil) result is a result: it is kept too, and a
		// duplicate sees it as stored, not as none.
		id = uuid.New()
		tx, err = b.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck
		_, err = b.writer.RecordCommand(ctx, tx, id, outbox.Fingerprint([]byte("c")))
		require.NoError(t, err)
		require.NoError(t, b.writer.StoreCommandResult(ctx, tx, id, nil))
		require.NoError(t, tx.Commit(ctx))
		tx, err = b.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck
		cmd, err = b.writer.RecordCommand(ctx, tx, id, outbox.Fingerprint([]byte("c")))
		require.NoError(t, err)
		require.True(t, cmd.Duplicate)
		require.NotNil(t, cmd.Result, "stored, and empty")
		require.Empty(t, cmd.Result)
		require.NoError(t, b.writer.StoreCommandResult(ctx, tx, id, []byte{}), "the same (empty) bytes")
		requireConflict(b.writer.StoreCommandResult(ctx, tx, id, []byte("another")), "", "another")
	})

	t.Run("RollbackForgetsCommand", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		id := uuid.New()
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		_, err = b.writer.RecordCommand(ctx, tx, id, outbox.Fingerprint([]byte("c")))
		require.NoError(t, err)
		require.NoError(t, tx.Rollback(ctx))
		cmd, err := execute(t, b, id, "c")
		require.NoError(t, err)
		require.False(t, cmd.Duplicate, "a rolled-back attempt leaves no record")
	})

	t.Run("InvalidInput", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck
		_, err = b.writer.RecordCommand(ctx, tx, uuid.Nil, []byte("x"))
		require.ErrorIs(t, err, outbox.ErrInvalidMessage)
		_, err = b.writer.RecordCommand(ctx, tx, uuid.New(), nil)
		require.ErrorIs(t, err, outbox.ErrInvalidMessage)
		err = b.writer.StoreCommandResult(ctx, tx, uuid.New(), []byte("r"))
		require.ErrorIs(t, err, outbox.ErrCommandNotRecorded)
		require.NoError(t, tx.Commit(ctx))
		require.Zero(t, b.idempotencyRows(t))
	})

	// Two transactions race on one id: the second waits in RecordCommand on
	// the first's uncommitted row, then sees the first's outcome.
	concurrent := func(t *testing.T, secondCommand string, firstCommits bool) (*testBundle, outbox.Command, error) {
		b := setup(t)
		id := uuid.New()
		tx1, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx1.Rollback(ctx) //nolint:errcheck
		first, err := b.writer.RecordCommand(ctx, tx1, id, outbox.Fingerprint([]byte("cmd")))
		require.NoError(t, err)
		require.False(t, first.Duplicate)
		require.NoError(t, b.writer.StoreCommandResult(ctx, tx1, id, []byte("first result")))

		type outcome struct {
			cmd outbox.Command
			err error
		}
		done := make(chan outcome, 1)
		tx2, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx2.Rollback(ctx) //nolint:errcheck
		go func() {
			cmd, err := b.writer.RecordCommand(ctx, tx2, id, outbox.Fingerprint([]byte(secondCommand)))
			done <- outcome{cmd, err}
		}()
		// The second transaction must be blocked on the first.
		require.Eventually(t, func() bool {
			var waiting bool
			err := b.pool.QueryRow(ctx, `SELECT COALESCE(bool_or(wait_event_type = 'Lock'), false) FROM pg_stat_activity WHERE pid = $1`,
				tx2.Conn().PgConn().PID()).Scan(&waiting)
			return err == nil && waiting
		}, 5*time.Second, 10*time.Millisecond)
		select {
		case <-done:
			t.Fatal("the twin did not wait for the first transaction")
		default:
		}
		if firstCommits {
			require.NoError(t, tx1.Commit(ctx))
		} else {
			require.NoError(t, tx1.Rollback(ctx))
		}
		res := receive(t, done)
		if res.err == nil {
			require.NoError(t, tx2.Commit(ctx))
		}
		return b, res.cmd, res.err
	}

	t.Run("ConcurrentDuplicate", func(t *testing.T) {
		t.Parallel()
		b, cmd, err := concurrent(t, "cmd", true)
		require.NoError(t, err)
		require.True(t, cmd.Duplicate)
		require.Equal(t, "first result", string(cmd.Result))
		require.Equal(t, 1, b.idempotencyRows(t))
	})

	t.Run("ConcurrentConflict", func(t *testing.T) {
		t.Parallel()
		b, _, err := concurrent(t, "another cmd", true)
		require.ErrorIs(t, err, outbox.ErrIdempotencyConflict)
		require.Equal(t, 1, b.idempotencyRows(t))
	})

	t.Run("ConcurrentAfterRollback", func(t *testing.T) {
		t.Parallel()
		b, cmd, err := concurrent(t, "another cmd", false)
		require.NoError(t, err)
		require.False(t, cmd.Duplicate, "the first attempt rolled back, so the twin runs the command")
		require.Equal(t, 1, b.idempotencyRows(t))
	})

	t.Run("Prune", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		_, err := execute(t, b, uuid.New(), "old")
		require.NoError(t, err)
		_, err = b.pool.Exec(ctx, `UPDATE `+pgx.Identifier{b.cfg.Schema, outbox.TableDefault + "_idempotency"}.Sanitize()+
			` SET created_at = now() - interval '2 days'`)
		require.NoError(t, err)
		// A record 23 hours old is within a retention of 24 hours: kept.
		// The retention is sent in microseconds; read in any coarser unit
		// it would be 1000 times too short and delete this one too.
		recent := uuid.New()
		_, err = execute(t, b, recent, "recent")
		require.NoError(t, err)
		_, err = b.pool.Exec(ctx, `UPDATE `+pgx.Identifier{b.cfg.Schema, outbox.TableDefault + "_idempotency"}.Sanitize()+
			` SET created_at = now() - interval '23 hours' WHERE event_id = $1`, recent)
		require.NoError(t, err)
		_, err = execute(t, b, uuid.New(), "new")
		require.NoError(t, err)
		n, err := b.writer.PruneCommands(ctx, b.pool, 24*time.Hour)
		require.NoError(t, err)
		require.EqualValues(t, 1, n, "only the record older than the retention")
		require.Equal(t, 2, b.idempotencyRows(t))
		cmd, err := execute(t, b, recent, "recent")
		require.NoError(t, err)
		require.True(t, cmd.Duplicate, "the record within the retention still makes its command a duplicate")
		// A retention below a microsecond (sent in microseconds: 0) would
		// delete every record: refused, naming the argument, and nothing is
		// deleted.
		for _, retention := range []time.Duration{0, -time.Hour, time.Microsecond - 1} {
			n, err := b.writer.PruneCommands(ctx, b.pool, retention)
			require.ErrorIs(t, err, outbox.ErrInvalidConfig, "retention %s", retention)
			var cfgErr *outbox.ConfigError
			require.ErrorAs(t, err, &cfgErr, "retention %s", retention)
			require.Equal(t, "retention", cfgErr.Field)
			require.Zero(t, n)
			require.Equal(t, 2, b.idempotencyRows(t), "retention %s deleted a record", retention)
		}
	})

	t.Run("AgeCountsFromTheRecordingTransactionsStart", func(t *testing.T) {
		t.Parallel()
		// As documented: RecordedAt is the recording transaction's
		// start, and a prune measures age from it, so a transaction
		// open longer than the retention commits a record the next
		// prune deletes.
		b := setup(t)
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(ctx) })
		var started time.Time
		require.NoError(t, tx.QueryRow(ctx, `SELECT now()`).Scan(&started))
		time.Sleep(1100 * time.Millisecond)
		cmd, err := b.writer.RecordCommand(ctx, tx, uuid.New(), []byte("f"))
		require.NoError(t, err)
		require.True(t, cmd.RecordedAt.Equal(started.Truncate(time.Microsecond)), "RecordedAt %s, the transaction started %s", cmd.RecordedAt, started)
		require.NoError(t, tx.Commit(ctx))
		n, err := b.writer.PruneCommands(ctx, b.pool, time.Second)
		require.NoError(t, err)
		require.EqualValues(t, 1, n, "the record is older than the retention at its commit")
	})

	// PruneCommands deletes the id's old record after RecordCommand's
	// INSERT found it and before its lookup: in READ COMMITTED the lookup
	// no longer sees it, and RecordCommand inserts again instead of failing.
	t.Run("PrunedBetweenInsertAndLookup", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		id := uuid.New()
		_, err := execute(t, b, id, "old command")
		require.NoError(t, err)
		// Its message was delivered, and its record is past retention.
		_, err = b.pool.Exec(ctx, `DELETE FROM `+b.writer.Table())
		require.NoError(t, err)
		_, err = b.pool.Exec(ctx, `UPDATE `+pgx.Identifier{b.cfg.Schema, outbox.TableDefault + "_idempotency"}.Sanitize()+
			` SET created_at = now() - interval '2 days'`)
		require.NoError(t, err)

		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck
		inserts := 0
		hooked := insertHookTx{Tx: tx, after: func() {
			inserts++
			if inserts == 1 {
				n, err := b.writer.PruneCommands(ctx, b.pool, 24*time.Hour)
				require.NoError(t, err)
				require.EqualValues(t, 1, n)
			}
		}}
		cmd, err := b.writer.RecordCommand(ctx, hooked, id, outbox.Fingerprint([]byte("new command")))
		require.NoError(t, err)
		require.Equal(t, 2, inserts, "the first insert found the old record, the second recorded the command")
		require.False(t, cmd.Duplicate, "the record was pruned: the command runs again")
		require.Nil(t, cmd.Result)
		require.NoError(t, b.writer.StoreCommandResult(ctx, tx, id, []byte("result of new command")))
		require.NoError(t, b.writer.Append(ctx, tx, outbox.Message{EventID: id, Stream: "s", Key: "k", Version: 2, Payload: []byte("new command")}))
		require.NoError(t, tx.Commit(ctx))

		var fingerprint, result []byte
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT fingerprint, result FROM `+
			pgx.Identifier{b.cfg.Schema, outbox.TableDefault + "_idempotency"}.Sanitize()+` WHERE event_id = $1`, id).Scan(&fingerprint, &result))
		require.Equal(t, outbox.Fingerprint([]byte("new command")), fingerprint)
		require.Equal(t, "result of new command", string(result))
		require.Equal(t, 1, b.idempotencyRows(t))
		rows := b.rows(t)
		require.Len(t, rows, 1, "one effect only")
		require.Equal(t, id, rows[0].EventID)
		require.Equal(t, "new command", string(rows[0].Payload))

		again, err := execute(t, b, id, "new command")
		require.NoError(t, err)
		require.True(t, again.Duplicate)
		require.Equal(t, "result of new command", string(again.Result))
	})

	// Under REPEATABLE READ the snapshot still sees a record pruned after
	// the insert found it: the command is a duplicate, as documented.
	t.Run("PrunedBetweenInsertAndLookupRepeatableRead", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		id, tx := executedThenTx(t, b, pgx.RepeatableRead)
		inserts := 0
		hooked := insertHookTx{Tx: tx, after: func() {
			inserts++
			n, err := b.writer.PruneCommands(ctx, b.pool, time.Microsecond)
			require.NoError(t, err)
			require.EqualValues(t, 1, n)
		}}
		cmd, err := b.writer.RecordCommand(ctx, hooked, id, outbox.Fingerprint([]byte("c")))
		require.NoError(t, err)
		require.Equal(t, 1, inserts)
		require.True(t, cmd.Duplicate)
		require.Equal(t, "result of c", string(cmd.Result))
		require.NoError(t, tx.Commit(ctx))
		require.Zero(t, b.idempotencyRows(t))
	})

	// A record pruned after the transaction's snapshot was taken but before
	// RecordCommand's INSERT counts as pruned under REPEATABLE READ and
	// SERIALIZABLE too: ON CONFLICT checks committed rows, not the
	// snapshot, so the INSERT succeeds and the command is recorded anew,
	// although the snapshot still sees the old record.
	t.Run("PrunedAfterSnapshotBeforeInsert", func(t *testing.T) {
		t.Parallel()
		for name, tc := range map[string]struct {
			iso pgx.TxIsoLevel
			// noResult: the pruned record had no result (storing one is
			// optional); tx's snapshot then sees two records without one,
			// and StoreCommandResult used to update both and fail with
			// 40001 on the pruned one.
			noResult bool
		}{
			"RepeatableRead":         {iso: pgx.RepeatableRead},
			"Serializable":           {iso: pgx.Serializable},
			"RepeatableReadNoResult": {iso: pgx.RepeatableRead, noResult: true},
			"SerializableNoResult":   {iso: pgx.Serializable, noResult: true},
		} {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				b := setup(t)
				var id uuid.UUID
				var tx pgx.Tx
				if tc.noResult {
					id = uuid.New()
					first, err := b.pool.Begin(ctx)
					require.NoError(t, err)
					_, err = b.writer.RecordCommand(ctx, first, id, outbox.Fingerprint([]byte("c")))
					require.NoError(t, err)
					require.NoError(t, first.Commit(ctx))
					tx, err = b.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: tc.iso})
					require.NoError(t, err)
					t.Cleanup(func() { _ = tx.Rollback(ctx) })
				} else {
					id, tx = executedThenTx(t, b, tc.iso)
				}
				table := pgx.Identifier{b.cfg.Schema, outbox.TableDefault + "_idempotency"}.Sanitize()
				var seen int
				require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM `+table+` WHERE event_id = $1`, id).Scan(&seen))
				require.Equal(t, 1, seen, "the snapshot sees the record")
				n, err := b.writer.PruneCommands(ctx, b.pool, time.Microsecond)
				require.NoError(t, err)
				require.EqualValues(t, 1, n)

				cmd, err := b.writer.RecordCommand(ctx, tx, id, outbox.Fingerprint([]byte("c")))
				require.NoError(t, err)
				require.False(t, cmd.Duplicate, "pruned before the INSERT: the command runs again")
				require.Nil(t, cmd.Result)
				require.NoError(t, b.writer.StoreCommandResult(ctx, tx, id, []byte("result of c, again")))
				require.NoError(t, tx.Commit(ctx))
				require.Equal(t, 1, b.idempotencyRows(t))

				again, err := execute(t, b, id, "c")
				require.NoError(t, err)
				require.True(t, again.Duplicate)
				require.Equal(t, "result of c, again", string(again.Result))
			})
		}
	})

	// Pruned after tx's snapshot, the id is recorded anew by tx for another
	// command; tx's snapshot now sees both records, and RecordCommand again
	// in tx must find tx's own: a duplicate with tx's result, and a
	// conflict for the pruned record's command.
	t.Run("PrunedAfterSnapshotThenRecordedTwice", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		id, tx := executedThenTx(t, b, pgx.RepeatableRead)
		_, err := tx.Exec(ctx, "SELECT 1") // takes the snapshot
		require.NoError(t, err)
		d := prunedThenRecordedAnew(t, b, tx, id)
		// Stored again, the same result is an idempotent retry; the lookup
		// behind it used to find c's pruned record and its result, and
		// report a conflict.
		require.NoError(t, b.writer.StoreCommandResult(ctx, tx, id, []byte("result of d")))

		cmd, err := b.writer.RecordCommand(ctx, tx, id, d)
		require.NoError(t, err, "tx recorded d itself")
		require.True(t, cmd.Duplicate)
		require.Equal(t, "result of d", string(cmd.Result))

		_, err = b.writer.RecordCommand(ctx, tx, id, outbox.Fingerprint([]byte("c")))
		var conflict *outbox.IdempotencyConflictError
		require.ErrorAs(t, err, &conflict, "c was pruned; the id is d's now")
		require.Equal(t, d, conflict.RecordedFingerprint)
	})

	// The same when c was recorded after tx began but before its snapshot:
	// tx's own record of d carries tx's start as its created_at, older than
	// c's, so the newest-first lookup found c's pruned record, and a false
	// conflict.
	t.Run("RecordedAfterTxBeganThenPruned", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		id, tx := txBeganBeforeC(t, b)
		d := prunedThenRecordedAnew(t, b, tx, id)
		cmd, err := b.writer.RecordCommand(ctx, tx, id, d)
		require.NoError(t, err, "tx recorded d itself")
		require.True(t, cmd.Duplicate)
		require.Equal(t, "result of d", string(cmd.Result))
	})

	// The same with c's record younger than tx's start, after a savepoint
	// of tx stored a result for d and rolled back (a handler's failed
	// attempt): that left the savepoint's id in the xmax of tx's own
	// record, which the lookup took for a deleted record's, and it found
	// c's pruned record instead: a false conflict, and then a false
	// result conflict.
	t.Run("RecordedAnewThenSavepointRolledBack", func(t *testing.T) {
		t.Parallel()
		for _, attempts := range []int{1, 2} {
			t.Run(fmt.Sprintf("Attempts%d", attempts), func(t *testing.T) {
				t.Parallel()
				b := setup(t)
				id, tx := txBeganBeforeC(t, b)
				n, err := b.writer.PruneCommands(ctx, b.pool, time.Microsecond)
				require.NoError(t, err)
				require.EqualValues(t, 1, n)

				d := outbox.Fingerprint([]byte("d"))
				cmd, err := b.writer.RecordCommand(ctx, tx, id, d)
				require.NoError(t, err)
				require.False(t, cmd.Duplicate)
				for range attempts {
					sp, err := tx.Begin(ctx)
					require.NoError(t, err)
					require.NoError(t, b.writer.StoreCommandResult(ctx, sp, id, []byte("attempt")))
					require.NoError(t, sp.Rollback(ctx))
				}
				cmd, err = b.writer.RecordCommand(ctx, tx, id, d)
				require.NoError(t, err, "tx's own record of d, not c's pruned one")
				require.True(t, cmd.Duplicate)
				require.Nil(t, cmd.Result, "the attempts' results were rolled back")
				require.NoError(t, b.writer.StoreCommandResult(ctx, tx, id, []byte("result of d")))
				cmd, err = b.writer.RecordCommand(ctx, tx, id, d)
				require.NoError(t, err)
				require.Equal(t, "result of d", string(cmd.Result))
				require.NoError(t, tx.Commit(ctx))
			})
		}
	})

	// A record that reappears before, and is deleted after, every one of
	// RecordCommand's inserts: it gives up after three, with a typed error,
	// having written nothing, and the transaction stays usable.
	t.Run("DeletedAfterEveryInsert", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		id := uuid.New()
		table := pgx.Identifier{b.cfg.Schema, outbox.TableDefault + "_idempotency"}.Sanitize()
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck
		inserts := 0
		hooked := insertHookTx{Tx: tx,
			before: func() {
				_, err := b.pool.Exec(ctx, `INSERT INTO `+table+` (event_id, fingerprint) VALUES ($1, 'other')`, id)
				require.NoError(t, err)
			},
			after: func() {
				inserts++
				_, err := b.pool.Exec(ctx, `DELETE FROM `+table+` WHERE event_id = $1`, id)
				require.NoError(t, err)
			},
		}
		_, err = b.writer.RecordCommand(ctx, hooked, id, outbox.Fingerprint([]byte("c")))
		require.ErrorIs(t, err, outbox.ErrCommandRecordDeleted)
		require.Contains(t, err.Error(), id.String())
		require.Equal(t, 3, inserts)
		require.NoError(t, tx.Commit(ctx), "the transaction is still usable")
		require.Zero(t, b.idempotencyRows(t))
	})
}

func TestSQLTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	db, err := sql.Open("pgx", b.pg.ConnString)
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })

	id := uuid.New()
	msgs := []outbox.Message{
		{EventID: id, Stream: "s", Key: "a", Version: 1, Payload: []byte("x")},
		{EventID: uuid.New(), Stream: "s", Key: "b", Version: 2},
	}
	run := func(command string) (outbox.Command, error) {
		sqlTx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		defer sqlTx.Rollback() //nolint:errcheck
		tx := outbox.SQLTx(sqlTx)
		cmd, err := b.writer.RecordCommand(ctx, tx, id, outbox.Fingerprint([]byte(command)))
		if err != nil {
			return cmd, err
		}
		if !cmd.Duplicate {
			require.NoError(t, b.writer.StoreCommandResult(ctx, tx, id, []byte("ok")))
			require.NoError(t, b.writer.Append(ctx, tx, msgs...))
		}
		return cmd, sqlTx.Commit()
	}

	cmd, err := run("c")
	require.NoError(t, err)
	require.False(t, cmd.Duplicate)
	cmd, err = run("c")
	require.NoError(t, err)
	require.True(t, cmd.Duplicate)
	require.Equal(t, "ok", string(cmd.Result))
	_, err = run("d")
	require.ErrorIs(t, err, outbox.ErrIdempotencyConflict)

	rows := b.rows(t)
	require.Len(t, rows, 2)
	require.Equal(t, id, rows[0].EventID)
	require.Equal(t, "x", string(rows[0].Payload))

	// Exec reports rows affected; errors and rollback pass through.
	sqlTx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	tag, err := outbox.SQLTx(sqlTx).Exec(ctx, `UPDATE `+b.writer.Table()+` SET attempts = 5`)
	require.NoError(t, err)
	require.EqualValues(t, 2, tag.RowsAffected())
	require.ErrorIs(t, outbox.SQLTx(sqlTx).QueryRow(ctx, `SELECT 1 WHERE false`).Scan(new(int)), pgx.ErrNoRows)
	require.NoError(t, sqlTx.Rollback())
	for _, r := range b.rows(t) {
		require.Zero(t, r.Attempts)
	}
}

// prunedThenRecordedAnew prunes every command record (id's, which tx's
// snapshot still sees, included), then has tx record command "d" anew
// under id and store "result of d"; it returns d's fingerprint.
func prunedThenRecordedAnew(t *testing.T, b *testBundle, tx pgx.Tx, id uuid.UUID) []byte {
	t.Helper()
	ctx := context.Background()
	n, err := b.writer.PruneCommands(ctx, b.pool, time.Microsecond)
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	d := outbox.Fingerprint([]byte("d"))
	cmd, err := b.writer.RecordCommand(ctx, tx, id, d)
	require.NoError(t, err)
	require.False(t, cmd.Duplicate)
	require.NoError(t, b.writer.StoreCommandResult(ctx, tx, id, []byte("result of d")))
	return d
}

// TestRecordCommandComparesTheWholeFingerprint: RecordCommand compares the
// whole fingerprint: two that share a prefix (any stable byte string is
// allowed, not only Fingerprint's SHA-256) are different commands, and the
// second is a conflict, writing nothing. ConflictingFingerprint's two
// SHA-256 values differ in their first byte.
func TestRecordCommandComparesTheWholeFingerprint(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	id := uuid.New()
	recorded := []byte("order:42:add 10")
	given := []byte("order:42:add 99")

	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	cmd, err := b.writer.RecordCommand(ctx, tx, id, recorded)
	require.NoError(t, err)
	require.False(t, cmd.Duplicate)
	require.NoError(t, tx.Commit(ctx))

	tx, err = b.pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	cmd, err = b.writer.RecordCommand(ctx, tx, id, given)
	require.ErrorIs(t, err, outbox.ErrIdempotencyConflict, "reported as %+v", cmd)
	var conflict *outbox.IdempotencyConflictError
	require.ErrorAs(t, err, &conflict)
	require.Equal(t, recorded, conflict.RecordedFingerprint)
	require.Equal(t, given, conflict.GivenFingerprint)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, 1, b.idempotencyRows(t))
}
