package outbox

import (
	"errors"
	"fmt"
	"strings"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Sentinel errors. Every error the package returns for one of these conditions
// matches the sentinel with errors.Is; the typed errors below carry details
// for errors.As.
var (
	// ErrInvalidConfig reports a Config, RelayConfig, ListenerConfig,
	// NotifierConfig or ReplayFilter field (or a constructor argument)
	// that cannot be used, or a Writer, Relay or Listener not made by
	// NewWriter, NewRelay or NewListener (a zero value, or nil). The error
	// is a *ConfigError naming the field (or the type).
	ErrInvalidConfig = errors.New("outbox: invalid config")

	// ErrInvalidMessage reports a Message that Append refused before writing
	// anything. The error is a *MessageError naming the message and field.
	ErrInvalidMessage = errors.New("outbox: invalid message")

	// ErrEventIDExists reports that Append tried to insert an event id that
	// the outbox already holds. The insert failed as a whole and, as with
	// any failed statement, the caller's transaction is aborted. The error
	// also wraps the driver's unique violation (a *pgconn.PgError, for
	// errors.As), as the package's other statement errors do.
	ErrEventIDExists = errors.New("outbox: event id already in the outbox")

	// ErrIdempotencyConflict reports a command whose event id was already
	// recorded with a different fingerprint: the same id was reused for a
	// different command. The error is an *IdempotencyConflictError.
	ErrIdempotencyConflict = errors.New("outbox: event id reused with a different command fingerprint")

	// ErrCommandRecordDeleted reports RecordCommand giving up on an id whose
	// existing record was deleted (by PruneCommands, say) between the insert
	// that found it and the lookup that reads it, three times in a row.
	// Nothing was written and the transaction remains usable; retry it.
	ErrCommandRecordDeleted = errors.New("outbox: command record deleted concurrently while recording the command")

	// ErrCommandNotRecorded reports StoreCommandResult for an event id that
	// RecordCommand has not recorded in this transaction or before.
	ErrCommandNotRecorded = errors.New("outbox: command not recorded")

	// ErrCommandResultConflict reports StoreCommandResult for a command
	// whose stored result has different bytes: the first result stored is
	// kept, since duplicates of the command return it. Nothing was written.
	// The error is a *CommandResultConflictError.
	ErrCommandResultConflict = errors.New("outbox: command already has a different result stored")

	// ErrLeaseLost reports that a relay could not acknowledge (or retry, or
	// dead-letter) rows because their lease had expired and another relay
	// claimed them again. The other relay now owns them; nothing was changed.
	// The error is a *LeaseLostError.
	ErrLeaseLost = errors.New("outbox: lease lost to another relay")

	// ErrHandlerContract reports a Handler that returned a number of results
	// different from the batch size, or panicked. Every record of the batch
	// is treated as failed.
	ErrHandlerContract = errors.New("outbox: handler broke its contract")

	// ErrRelayRunning reports a second concurrent call of Relay.Run.
	ErrRelayRunning = errors.New("outbox: relay already running")

	// ErrNotMigrated reports that the outbox tables do not exist: run Migrate
	// (or apply MigrationSQL) with the same Schema and Table first.
	ErrNotMigrated = errors.New("outbox: tables not found; run outbox.Migrate first")
)

// ConfigError describes an unusable configuration field.
type ConfigError struct {
	Field  string // name of the field, e.g. "BatchSize"
	Reason string // what is wrong and how to fix it
}

func (e *ConfigError) Error() string {
	return fmt.Sprintf("outbox: invalid config: %s %s", e.Field, e.Reason)
}

// Is makes a *ConfigError match ErrInvalidConfig.
func (e *ConfigError) Is(target error) bool { return target == ErrInvalidConfig }

// missingTx refuses a nil transaction given to a Writer method.
func missingTx() error {
	return &ConfigError{Field: "tx", Reason: "is nil; pass the caller's open transaction (a pgx.Tx, or SQLTx of a *sql.Tx)"}
}

// txNotATransaction refuses a pool or an idle connection given to a Writer
// method as its tx (see deps.NotInTransaction).
func txNotATransaction(why string) error {
	return &ConfigError{Field: "tx", Reason: why + "; pass the caller's open transaction (pool.Begin), so that these writes commit with its own"}
}

// missingDB refuses a nil database handle.
func missingDB() error {
	return &ConfigError{Field: "db", Reason: "is nil; pass a database handle (a *pgxpool.Pool, a connection or a transaction)"}
}

// MessageError describes the first invalid message of an Append call, or
// the invalid input of RecordCommand (Index 0).
type MessageError struct {
	Index   int       // position of the message in the Append call
	EventID uuid.UUID // its event id (possibly uuid.Nil)
	Field   string    // "EventID", "Stream", "Key", "Version" or (RecordCommand) "Fingerprint"
	Reason  string
}

func (e *MessageError) Error() string {
	return fmt.Sprintf("outbox: invalid message %d (event %s): %s %s", e.Index, e.EventID, e.Field, e.Reason)
}

// Is makes a *MessageError match ErrInvalidMessage.
func (e *MessageError) Is(target error) bool { return target == ErrInvalidMessage }

// IdempotencyConflictError is returned when an event id was recorded before
// with a different fingerprint. Nothing was written.
type IdempotencyConflictError struct {
	EventID             uuid.UUID
	RecordedFingerprint []byte // the fingerprint stored first
	GivenFingerprint    []byte // the fingerprint of the refused call
}

func (e *IdempotencyConflictError) Error() string {
	return fmt.Sprintf("outbox: event id %s reused with a different command fingerprint (recorded %x, given %x)",
		e.EventID, e.RecordedFingerprint, e.GivenFingerprint)
}

// Is makes an *IdempotencyConflictError match ErrIdempotencyConflict.
func (e *IdempotencyConflictError) Is(target error) bool { return target == ErrIdempotencyConflict }

// CommandResultConflictError is returned by StoreCommandResult when the
// command already has a different result stored. Nothing was written; the
// stored result stays the one duplicates of the command return.
type CommandResultConflictError struct {
	EventID      uuid.UUID
	StoredResult []byte // the result stored first
	GivenResult  []byte // the result of the refused call
}

func (e *CommandResultConflictError) Error() string {
	return fmt.Sprintf("outbox: command %s already has a different result stored (%d bytes stored, %d given); the first result is kept",
		e.EventID, len(e.StoredResult), len(e.GivenResult))
}

// Is makes a *CommandResultConflictError match ErrCommandResultConflict.
func (e *CommandResultConflictError) Is(target error) bool { return target == ErrCommandResultConflict }

// LeaseLostError lists the rows a relay could not settle because its lease
// on their partition expired and another relay took the partition over.
// The claim that took the partition over counted their attempt as a
// crashed one: a row whose attempts thereby reached MaxAttempts is not
// handed out again (although this relay's Handler may have processed it):
// it was moved to the dead-letter table by that claim when that claim's
// relay serves the row's stream, and otherwise is moved there by the next
// claim of a relay of its stream that takes the partition. The others are
// handed out again by the next such claim (the relay that took it over may
// serve other streams only, or release it unfilled when its batch is
// full).
type LeaseLostError struct {
	IDs []int64 // outbox row ids, ascending
}

func (e *LeaseLostError) Error() string {
	ids := make([]string, 0, len(e.IDs))
	for _, id := range e.IDs {
		ids = append(ids, fmt.Sprint(id))
	}
	return fmt.Sprintf("outbox: lease lost to another relay for %d row(s): ids %s", len(e.IDs), strings.Join(ids, ","))
}

// Is makes a *LeaseLostError match ErrLeaseLost.
func (e *LeaseLostError) Is(target error) bool { return target == ErrLeaseLost }

// PostgreSQL error codes the package interprets.
const (
	pgUniqueViolation      = "23505"
	pgUndefinedTable       = "42P01"
	pgDeadlockDetected     = "40P01"
	pgSerializationFailure = "40001"
	pgLockNotAvailable     = "55P03"
	pgQueryCanceled        = "57014"
)

// isEventIDViolation reports a unique violation of the event id, not of
// the primary key (ids reset): PostgreSQL keeps the "_pkey" suffix when it
// shortens a long table's constraint names.
func isEventIDViolation(pgErr *pgconn.PgError) bool {
	return pgErr.Code == pgUniqueViolation && !strings.HasSuffix(pgErr.ConstraintName, "_pkey")
}

// mapError is the one place that turns driver errors into the package's own.
// op names the operation for the message.
func mapError(op string, err error) error {
	if err == nil {
		return nil
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case pgUndefinedTable:
			return &notMigratedError{op: op, err: err}
		}
	}
	if errors.Is(err, pgx.ErrNoRows) {
		// Callers that expect "no rows" check for it before calling mapError;
		// reaching here means a statement that always returns a row did not.
		return fmt.Errorf("outbox: %s: unexpected empty result: %w", op, err)
	}
	return fmt.Errorf("outbox: %s: %w", op, err)
}

// notMigratedError is mapError's error for a missing table:
// "outbox: <op>: " and ErrNotMigrated's text without its own "outbox: ",
// then the driver's error. It matches ErrNotMigrated and the driver's
// error.
type notMigratedError struct {
	op  string
	err error
}

func (e *notMigratedError) Error() string {
	return fmt.Sprintf("outbox: %s: %s (%v)", e.op, strings.TrimPrefix(ErrNotMigrated.Error(), "outbox: "), e.err)
}

func (e *notMigratedError) Unwrap() []error { return []error{ErrNotMigrated, e.err} }
