package outbox

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/verity-go/verity/internal/deps"
	"github.com/verity-go/verity/internal/pgcancel"
)

// Command is what RecordCommand knows about a command after recording it.
type Command struct {
	// EventID is the command's id.
	EventID uuid.UUID
	// Duplicate is true when the id had already been recorded (by a
	// committed transaction, or earlier in this one) with the same
	// fingerprint. The caller must not apply the command's effects again.
	Duplicate bool
	// Result is the result stored by StoreCommandResult the first time
	// (non-nil, empty for an empty or nil result), or nil when none was
	// stored; a later StoreCommandResult never replaces it. Only meaningful
	// when Duplicate is true.
	Result []byte
	// RecordedAt is when the id was first recorded: the start of the
	// transaction that recorded it (PostgreSQL's now()), which is what
	// PruneCommands measures a record's age from.
	RecordedAt time.Time
}

// Fingerprint returns the SHA-256 of a command's canonical bytes (for example
// its JSON with sorted keys, or the protobuf encoding of the request), a
// convenient fingerprint for RecordCommand. Any stable byte string works; two
// different commands must not share one.
func Fingerprint(canonical []byte) []byte {
	sum := sha256.Sum256(canonical)
	return sum[:]
}

// These statements run in the caller's transaction, so they cannot pin
// bytea_output and DateStyle for it as a claim does for its own: their
// results are in forms no session setting changes (bytea as hex text, a
// time as microseconds since the epoch), which the text-format exec modes
// of a transaction-pooling proxy parse whatever the session's settings.
//
// The insert and the lookup are two statements on purpose: in READ COMMITTED
// an INSERT … ON CONFLICT DO NOTHING that waited for a concurrent twin sees
// its outcome, but a SELECT in the same statement would use the snapshot
// taken before the wait and miss the twin's row. A second statement takes a
// fresh snapshot, so it also misses a row deleted (pruned) in between; the
// insert is then sent again (recordCommandAttempts in all).
const (
	recordCommandSQL = `INSERT INTO %s (event_id, fingerprint) VALUES ($1, $2)
ON CONFLICT (event_id) DO NOTHING
RETURNING (extract(epoch FROM created_at) * 1000000)::int8`

	// Under REPEATABLE READ or SERIALIZABLE the lookup can see two records
	// of one id: one pruned after tx's snapshot was taken, and the one tx
	// recorded anew since (see RecordCommand). Tx's own has created_at =
	// now(), tx's start (the pruned one's transaction started at another
	// time; tx's may precede it, so created_at DESC alone cannot tell them
	// apart). xmax alone cannot either: the pruned one carries its
	// committed deleter, and tx's own may carry a savepoint of tx that
	// updated it (StoreCommandResult) and rolled back.
	lookupCommandSQL = `SELECT encode(fingerprint, 'hex'), encode(result, 'hex'), (extract(epoch FROM created_at) * 1000000)::int8
FROM %s WHERE event_id = $1
ORDER BY created_at = now() DESC, xmax = '0'::xid DESC, created_at DESC LIMIT 1`

	// storeResultSQL sets only a result not stored yet: the first one is
	// what duplicates return (Command.Result). When it matches no row,
	// lookupResultSQL, with a fresh snapshot, tells an unknown id from a
	// stored result. Like lookupCommandSQL, it picks tx's own record when
	// its snapshot also sees a pruned one: by the record's ctid, since
	// result IS NULL alone would also match a pruned record stored without
	// a result, and updating a row another transaction deleted fails tx
	// with a serialization error (40001) under REPEATABLE READ. (Under
	// READ COMMITTED a result stored concurrently fails the recheck of
	// result IS NULL as before; the row's new ctid fails it too.)
	storeResultSQL = `UPDATE %[1]s SET result = $2 WHERE event_id = $1 AND result IS NULL
AND ctid = (SELECT ctid FROM %[1]s WHERE event_id = $1 ORDER BY created_at = now() DESC, xmax = '0'::xid DESC, created_at DESC LIMIT 1)
RETURNING true`
	lookupResultSQL = `SELECT encode(result, 'hex') FROM %s WHERE event_id = $1
ORDER BY created_at = now() DESC, xmax = '0'::xid DESC, created_at DESC LIMIT 1`

	// recordCommandAttempts bounds RecordCommand's inserts: each retry
	// needs another record of the id to be committed and deleted between
	// two statements, so a third is already far-fetched.
	recordCommandAttempts = 3
)

// RecordCommand records, within tx, that the command eventID with the given
// fingerprint is being executed. Call it first in the transaction that applies
// the command's effects and appends its outbox messages:
//
//   - first time: Duplicate is false; apply the effects, optionally
//     StoreCommandResult, commit. If tx rolls back, the record goes with it.
//   - same id, same fingerprint, committed before: Duplicate is true and
//     Result holds the stored result; apply nothing and return Result.
//   - same id, different fingerprint: an *IdempotencyConflictError
//     (errors.Is(err, ErrIdempotencyConflict)); nothing is written and tx
//     remains usable.
//
// Concurrent transactions with the same id are serialised by the primary key:
// the second one waits in RecordCommand until the first commits (then it sees
// a duplicate) or rolls back (then it records the command itself). This
// relies on READ COMMITTED, PostgreSQL's default; under REPEATABLE READ or
// SERIALIZABLE the waiting transaction fails with a serialization error
// instead, which the caller retries.
//
// A record that PruneCommands (or any DELETE) removed before RecordCommand's
// insert counts as pruned under every isolation level: the insert's
// ON CONFLICT checks committed rows, not tx's snapshot, so RecordCommand
// records the command anew (Duplicate is false), even under REPEATABLE READ
// or SERIALIZABLE when tx's snapshot, taken earlier, still sees the old
// record. A record removed after the insert found it and before it is read
// counts as pruned in READ COMMITTED: the insert is then tried again, up to
// three times in all, after which RecordCommand returns an error matching
// ErrCommandRecordDeleted, having written nothing (tx remains usable). Under
// REPEATABLE READ or SERIALIZABLE the snapshot still sees that record, and
// the command is a duplicate. A command tx recorded anew is then what tx's
// later RecordCommand calls for the id find, not the pruned record its
// snapshot still sees.
func (w *Writer) RecordCommand(ctx context.Context, tx Tx, eventID uuid.UUID, fingerprint []byte) (Command, error) {
	if w.unmade() {
		return Command{}, errUnmadeWriter()
	}
	if deps.Missing(tx) {
		return Command{}, missingTx()
	}
	if why := deps.NotInTransaction(tx); why != "" {
		return Command{}, txNotATransaction(why)
	}
	if eventID == uuid.Nil {
		return Command{}, &MessageError{Field: "EventID", Reason: "is the nil UUID; give every command a stable, unique id"}
	}
	if len(fingerprint) == 0 {
		return Command{}, &MessageError{EventID: eventID, Field: "Fingerprint", Reason: "is empty; use outbox.Fingerprint(canonical command bytes)"}
	}
	for range recordCommandAttempts {
		cmd := Command{EventID: eventID}
		var recordedAt int64
		err := tx.QueryRow(ctx, w.recordSQL, pgUUID(eventID), fingerprint).Scan(&recordedAt)
		if err == nil {
			cmd.RecordedAt = time.UnixMicro(recordedAt)
			return cmd, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			// Under REPEATABLE READ or SERIALIZABLE, a conflicting record
			// committed after the snapshot fails the insert here with a
			// serialization error.
			return Command{}, mapError("record command", err)
		}

		// Conflict: the id exists (committed, or recorded earlier in this tx).
		var (
			recordedHex string
			resultHex   *string
			recorded    []byte
		)
		err = tx.QueryRow(ctx, w.lookupSQL, pgUUID(eventID)).Scan(&recordedHex, &resultHex, &recordedAt)
		if errors.Is(err, pgx.ErrNoRows) {
			// Deleted since the insert saw it, which only READ COMMITTED's
			// fresh snapshot can show: insert again.
			continue
		}
		if err == nil {
			cmd.RecordedAt = time.UnixMicro(recordedAt)
			if recorded, err = decodeHex(recordedHex); err == nil && resultHex != nil {
				cmd.Result, err = decodeHex(*resultHex)
			}
		}
		if err != nil {
			return Command{}, mapError("look up command", err)
		}
		if !bytes.Equal(recorded, fingerprint) {
			return Command{}, &IdempotencyConflictError{EventID: eventID, RecordedFingerprint: recorded, GivenFingerprint: bytes.Clone(fingerprint)}
		}
		cmd.Duplicate = true
		return cmd, nil
	}
	return Command{}, fmt.Errorf("%w: %s: its existing record was deleted after each of %d inserts found it",
		ErrCommandRecordDeleted, eventID, recordCommandAttempts)
}

// StoreCommandResult stores result for the command eventID, recorded by
// RecordCommand, within tx, so that a duplicate of the command can return the
// same answer. Call it in the transaction that recorded the command (before
// or after its effects; a transaction that rolls back takes the result with
// it).
//
// The first result stored is kept: it is what every duplicate's
// Command.Result returns. Storing the same bytes again (a retried handler,
// or one that stores on the duplicate path too) returns nil; storing
// different bytes returns a *CommandResultConflictError
// (errors.Is(err, ErrCommandResultConflict)) and writes nothing. It returns
// ErrCommandNotRecorded when the id is unknown, also when another
// transaction records it only after this one's update began. Neither error
// fails a statement, so tx remains usable. A result is read back as hex text (see
// the statements), twice its size, which PostgreSQL's 1 GB limit on a
// value bounds: keep results small (an id, a status), far below 512 MB.
func (w *Writer) StoreCommandResult(ctx context.Context, tx Tx, eventID uuid.UUID, result []byte) error {
	if w.unmade() {
		return errUnmadeWriter()
	}
	if deps.Missing(tx) {
		return missingTx()
	}
	if why := deps.NotInTransaction(tx); why != "" {
		return txNotATransaction(why)
	}
	var ok bool
	// Never NULL: NULL means "none stored yet", and an empty result stored
	// first must be kept as any other.
	err := tx.QueryRow(ctx, w.storeResultSQL, pgUUID(eventID), nonNil(result)).Scan(&ok)
	if !errors.Is(err, pgx.ErrNoRows) {
		return mapError("store command result", err)
	}
	// Nothing updated: the id is unknown, or a result is stored already.
	var (
		storedHex *string
		stored    []byte
	)
	err = tx.QueryRow(ctx, w.lookupResultSQL, pgUUID(eventID)).Scan(&storedHex)
	if err == nil && storedHex != nil {
		stored, err = decodeHex(*storedHex)
	}
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("%w: %s", ErrCommandNotRecorded, eventID)
	case err != nil:
		return mapError("look up command result", err)
	case stored == nil:
		// The row has no result, yet the UPDATE did not see it: another
		// transaction recorded the command after the UPDATE's snapshot was
		// taken (under READ COMMITTED, between the two statements), so to
		// this transaction it was not recorded.
		return fmt.Errorf("%w: %s: another transaction recorded it after this one's update began; store a result in the transaction that recorded the command, or retry the transaction", ErrCommandNotRecorded, eventID)
	case bytes.Equal(stored, result):
		return nil // the same result again: an idempotent retry
	}
	return &CommandResultConflictError{EventID: eventID, StoredResult: stored, GivenResult: bytes.Clone(result)}
}

// decodeHex decodes a bytea read as encode(…, 'hex'): never nil, since nil
// stands for SQL NULL (no result stored), and an empty result is a result.
func decodeHex(s string) ([]byte, error) {
	b := make([]byte, hex.DecodedLen(len(s)))
	_, err := hex.Decode(b, []byte(s))
	return b, err
}

const pruneCommandsSQL = `DELETE FROM %s WHERE created_at < now() - $1 * interval '1 microsecond'`

// PruneCommands deletes idempotency records older than retention and returns
// how many it deleted. A command retried after its record is pruned is
// executed again (one retried while it is being pruned may be: see
// RecordCommand), unless its outbox row is still there: then the retry's
// Append fails with ErrEventIDExists and its transaction writes nothing.
// Keep records longer than any client retries, with a margin for the
// database clock stepping forward (ages are measured by it, retries by the
// clients' clocks). A record's age counts from
// the start of the transaction that recorded it (Command.RecordedAt), not
// from its commit: a transaction open longer than retention commits a record
// that the next prune deletes, so make retention cover the longest recording
// transaction as well as the retry window. The deletion is index-backed
// (created_at); run it periodically, from any process. If ctx ends while
// the DELETE runs (waiting for a record another transaction holds, say), it
// is cancelled on the server before PruneCommands returns, as for Migrate
// (and with its caveat: a server that does not answer within two seconds),
// and deletes nothing. For a database/sql transaction (SQLTx) ending ctx is
// left to the driver, as for Migrate: pgx's stdlib returns at once and
// cancels the DELETE in the background, so it may still be waiting on the
// server when PruneCommands returns (in the caller's transaction, which can
// no longer commit: it deletes nothing). A
// retention below one
// microsecond (the unit it is sent in), which would delete every record, is
// refused with a *ConfigError naming "retention" (ErrInvalidConfig), and
// nothing is deleted.
func (w *Writer) PruneCommands(ctx context.Context, db Execer, retention time.Duration) (int64, error) {
	if w.unmade() {
		return 0, errUnmadeWriter()
	}
	if deps.Missing(db) {
		return 0, missingDB()
	}
	if reason := deps.Released(db); reason != "" {
		return 0, &ConfigError{Field: "db", Reason: reason}
	}
	if retention < time.Microsecond {
		// Sent in whole microseconds: anything less would be 0.
		return 0, &ConfigError{Field: "retention", Reason: fmt.Sprintf("is %s; it must be at least 1µs, or it would delete every record", retention)}
	}
	// Cancelled on the server before returning if ctx ends: the DELETE may
	// wait for a row another transaction holds, and could otherwise delete
	// it after PruneCommands returned ctx's error.
	tag, err := pgcancel.Exec(ctx, db, fmt.Sprintf(pruneCommandsSQL, w.names.Idempotency), retention.Microseconds())
	if err != nil {
		return 0, mapError("prune commands", err)
	}
	return tag.RowsAffected(), nil
}
