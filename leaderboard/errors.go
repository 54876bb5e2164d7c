package leaderboard

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/puddle/v2"

	"github.com/verity-go/verity/outbox"
)

// Sentinel errors. Every error the package returns for a caller's mistake or
// a refused operation matches one of them with errors.Is; the typed errors
// below carry the details for errors.As. (One exception: a Worker's Run,
// RunOnce and Drain return its outbox.Relay's errors as they are, such as
// outbox.ErrRelayRunning for a second concurrent Run and
// outbox.ErrLeaseLost; Run returns nil after a cancellation.)
var (
	// ErrInvalidConfig matches every *ConfigError: New, Migrate,
	// MigrationSQL, Board.Worker, Board.Reconciler or Board.Verify was given
	// a nil dependency or a configuration it cannot use (Board.Worker's
	// Redis client included), SubmitTx or SubmitBatchTx a nil transaction
	// (nothing was written), or a method was called on a Board that New
	// did not make or a Worker that Board.Worker did not make (a zero
	// value, or a nil pointer), and nothing was created or run.
	ErrInvalidConfig = errors.New("leaderboard: invalid config")
	// ErrInvalidCommand matches every *ValidationError: a Command that was
	// refused before anything was written.
	ErrInvalidCommand = errors.New("leaderboard: invalid command")
	// ErrIdempotencyConflict matches *IdempotencyConflictError: an event id
	// was reused for a different command. Without an
	// *IdempotencyConflictError, it reports an event id that another writer
	// of the board's outbox table (another stream) used for a row still in
	// that table: undelivered, or delivered and kept
	// (outbox.RelayConfig.KeepPublished). Only that row reveals the clash:
	// once a relay deletes it on delivery, or moves it to the dead letters,
	// the same command is accepted. Give each writer's events ids of their
	// own.
	ErrIdempotencyConflict = errors.New("leaderboard: event id already used for a different command")
	// ErrScoreOutOfRange matches *ScoreOutOfRangeError: the resulting score
	// would leave [MinScore, MaxScore].
	ErrScoreOutOfRange = errors.New("leaderboard: resulting score out of range")
	// ErrStale matches *StaleError: the projection is not fresh enough and
	// the read policy is FailClosed, or an unmet AtLeast read found its
	// user missing in Redis.
	ErrStale = errors.New("leaderboard: projection too stale")
	// ErrUserNotFound matches *UserNotFoundError, returned by Rank and
	// Around for a user without a score on the board (in the source the
	// read used).
	ErrUserNotFound = errors.New("leaderboard: user has no score on this board")
	// ErrInvalidCursor is returned by Page for a cursor that this board did
	// not produce, or that a version of the package with another cursor
	// format produced (cursors issued before an upgrade that changed it
	// are refused; start again from the first page).
	ErrInvalidCursor = errors.New("leaderboard: invalid page cursor")
	// ErrConcurrentSubmit matches *ConcurrentSubmitError: SubmitTx or
	// SubmitBatchTx met a twin of a command that committed meanwhile, and the caller's
	// transaction is aborted. Roll back and retry the transaction.
	ErrConcurrentSubmit = errors.New("leaderboard: a concurrent submit of the same event id committed first")
	// ErrInvalidReadOption is returned, before anything is read, for a
	// nil ReadOption, WithPolicy of an unknown policy (the zero value
	// included), AtLeast with a version above 0 and a user id the board
	// would refuse, or AtLeast for more than MaxAtLeast users in one read.
	ErrInvalidReadOption = errors.New("leaderboard: invalid read option")
	// ErrInvalidLimit is returned for a page size outside [1, MaxPageSize]
	// (Around accepts 0 neighbours, and its error, which matches this one,
	// says so).
	ErrInvalidLimit = fmt.Errorf("leaderboard: page size must be between 1 and %d", MaxPageSize)
	// ErrCorruptScore is returned by a read from Redis that met a
	// sorted-set score the projection never writes (±inf, a fraction, a
	// value outside [MinScore, MaxScore]: a hand edit or another writer).
	// Like any failed Redis read it is answered from PostgreSQL under
	// FallbackToPostgres; the reconciler repairs the entry.
	ErrCorruptScore = errors.New("leaderboard: reading Redis: a sorted-set score the projection never writes")
	// ErrNotMigrated matches an error of a statement that found a table of
	// the board missing (PostgreSQL's undefined_table, 42P01): the board
	// was used before Migrate ran for its Schema and OutboxTable. Run
	// leaderboard.Migrate. It is outbox.ErrNotMigrated, which the board's
	// Worker returns for the same mistake, so either sentinel matches both.
	ErrNotMigrated = outbox.ErrNotMigrated
	// ErrVerifyUncertain matches the error of a Verify whose reply to its
	// recording was lost (a dropped connection, a timeout) and asking
	// again failed too: the record may or may not be in Redis. Reads with
	// Config.RequireVerifiedProjection see which; run Verify again to be
	// sure.
	ErrVerifyUncertain = errors.New("leaderboard: verify: whether the result was recorded is unknown")
	// ErrOutcomeUnknown matches the error of a Submit or SubmitBatch whose
	// statement was sent but whose answer never came (the connection
	// broke, the server crashed, or a pooler such as PgBouncer reported
	// its server connection broken, SQLSTATE class 08): the commands may
	// or may not have committed. Retry with the same event ids: a
	// committed command then comes back as a duplicate with its original
	// Result. The driver's
	// error stays reachable. A call whose own context ended returns that
	// context's error instead, whether or not its statement was sent (a
	// grouped Submit's statement goes on without it): once sent, it may
	// have committed all the same, and the same retry is safe (see
	// Submit).
	ErrOutcomeUnknown = errors.New("leaderboard: the statement was sent but its outcome is unknown; retry with the same event id")
)

// outcomeUnknown wraps err, the error of a Submit or SubmitBatch statement
// (dbError's already), in ErrOutcomeUnknown when the statement may have
// reached the server and no answer says how it ended: not a server error,
// nor one pgx reports as raised before anything was sent (SafeToRetry, or
// refusedByDriver's, which no retry gets past), nor a failure to
// connect or to get a connection (a closed pool), nor the caller's context
// error, which Submit's doc covers. A connection exception (SQLSTATE class
// 08) is not the statement's answer: PgBouncer reports a server connection
// that broke under the statement as its own 08P01 ("server conn
// crashed?"), after PostgreSQL may have committed. Not those it sends for
// a statement that never left it: "bad packet header" (larger than its
// max_packet_size, refused again on every retry), query_wait_timeout and
// "server login has been failing" (no server connection to send it on).
// Nor does pgconn.ErrConnClosed mean nothing was sent, though pgconn marks
// it SafeToRetry: every statement judged here ran on a connection the pool
// gave out open, and pgx's MultiResultReader (the simple protocol's
// statements, pipelines in QueryExecModeExec) reports it in place of the
// read error that closed the connection after the statement was sent.
func outcomeUnknown(err error) error {
	var pgErr *pgconn.PgError
	var connectErr *pgconn.ConnectError
	switch {
	case errors.As(err, &pgErr) && strings.HasPrefix(pgErr.Code, "08") && !errors.As(err, &connectErr) &&
		!strings.HasPrefix(pgErr.Message, "bad packet header") && // refused unsent (max_packet_size), for good
		!strings.HasPrefix(pgErr.Message, "query_wait_timeout") && // waited unsent for a server connection
		!strings.HasPrefix(pgErr.Message, "server login has been failing"):
	case errors.Is(err, pgconn.ErrConnClosed):
	case err == nil, errors.As(err, &pgErr), errors.As(err, &connectErr), pgconn.SafeToRetry(err),
		errors.Is(err, puddle.ErrClosedPool), // pgxpool's Acquire: nothing sent
		errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded),
		refusedByDriver(err):
		return err
	}
	return fmt.Errorf("%w: %w", ErrOutcomeUnknown, err)
}

// refusedByDriver reports whether err holds one of the errors pgx returns,
// unmarked, for a query it refuses before sending anything, and refuses
// again on every retry: an exec mode whose cache the pool keeps empty
// (statement_cache_capacity=0 with the default QueryExecModeCacheStatement,
// as pgx v4's advice for PgBouncer had it), or the simple protocol on a
// session whose standard_conforming_strings or client_encoding it cannot
// quote for.
func refusedByDriver(err error) bool {
	switch e := err.(type) {
	case nil:
		return false
	case interface{ Unwrap() []error }:
		return slices.ContainsFunc(e.Unwrap(), refusedByDriver)
	case interface{ Unwrap() error }:
		return refusedByDriver(e.Unwrap())
	}
	msg := err.Error()
	return strings.HasPrefix(msg, "cannot use QueryExecModeCacheStatement with disabled statement cache") ||
		strings.HasPrefix(msg, "cannot use QueryExecModeCacheDescribe with disabled description cache") ||
		strings.HasPrefix(msg, "simple protocol queries must be run with ")
}

// withCallerEnded makes err, the error of a call whose ctx has ended, match
// ctx's error too, as the docs promise whatever ended the statement: a pool
// whose connections answer a cancelled ctx with a cancel request
// (pgconn.CancelRequestContextWatcherHandler) gets the server's
// query_canceled (57014), and a server that ends the session before the
// cancel request goes out, its FATAL error. The driver's error stays
// reachable with errors.As.
func withCallerEnded(ctx context.Context, err error) error {
	cerr := ctx.Err()
	if err == nil || cerr == nil || errors.Is(err, cerr) {
		return err
	}
	return fmt.Errorf("%w: %w", err, cerr)
}

// ConfigError reports a configuration field, or a dependency, that New,
// Migrate, MigrationSQL, Board.Worker, Board.Reconciler or Board.Verify
// refused, or a Board or Worker that was not made by New or Board.Worker.
// It matches ErrInvalidConfig.
type ConfigError struct {
	// Field names what was refused: "Config.Name", "WorkerConfig.Relay",
	// "reconcile.Config.PageSize" (Reconciler's and Verify's cfg), an
	// argument of New ("pool", "rdb", "cfg"; "rdb" also for a Redis client
	// that could wait forever, and from Board.Worker for a Redis client its
	// projector refuses), Migrate's "db", SubmitTx's and SubmitBatchTx's
	// "tx", or "Board" or "Worker" for a zero or nil one.
	Field string
	// Reason says what is wrong and how to fix it.
	Reason string
	// Err is the outbox's own *outbox.ConfigError when the outbox checked
	// the field (Schema, OutboxTable, a WorkerConfig.Relay field), so that
	// errors.Is(err, outbox.ErrInvalidConfig) holds as well, reconcile's
	// *reconcile.ConfigError for a reconcile.Config field, or the
	// projector's *projection.ConfigError for the Redis client Board.Worker
	// refused; nil otherwise.
	Err error
}

func (e *ConfigError) Error() string {
	return fmt.Sprintf("leaderboard: invalid config: %s %s", e.Field, e.Reason)
}

// Is makes a *ConfigError match ErrInvalidConfig.
func (e *ConfigError) Is(target error) bool { return target == ErrInvalidConfig }

// Unwrap returns Err.
func (e *ConfigError) Unwrap() error { return e.Err }

// fromOutboxConfig turns an outbox.ConfigError about a field the board
// passes on (its Schema and OutboxTable, a WorkerConfig.Relay field) into
// the board's own *ConfigError, with the field named as the caller set it
// (prefix + the outbox's field name); other errors are wrapped as they are.
func fromOutboxConfig(prefix string, err error) error {
	var oc *outbox.ConfigError
	if !errors.As(err, &oc) {
		return fmt.Errorf("leaderboard: %w", err)
	}
	field := prefix + oc.Field
	if field == "Config.Table" {
		field = "Config.OutboxTable"
	}
	return &ConfigError{Field: field, Reason: oc.Reason, Err: err}
}

// dbError is the one place that wraps the error of a board statement for
// its caller; op names the operation ("submit", "reading PostgreSQL"). A
// missing table (42P01) means the schema was never migrated: it becomes
// ErrNotMigrated, saying what to run, with the driver's error kept for
// errors.As. Only the error is inspected: no statement checks the tables
// beforehand.
func (b *Board) dbError(op string, err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == pgUndefinedTable {
		fix := "run leaderboard.Migrate with the board's Schema and OutboxTable first"
		// The caller's transaction need not be on the board's database.
		if method := txMethod(op); method != "" {
			fix += ", or, if the board's database has them, give " + method + " a transaction of that database"
		}
		return &notMigratedError{err: err, msg: fmt.Sprintf(
			"leaderboard: %s: a table of the board is missing in schema %q (%s, %s or the outbox table %q); %s: %v",
			op, b.cfg.Schema, ScoreEventsTable, UserScoresTable, b.cfg.OutboxTable, fix, err)}
	}
	return fmt.Errorf("leaderboard: %s: %w", op, err)
}

// pgUndefinedTable is PostgreSQL's undefined_table.
const pgUndefinedTable = "42P01"

// opSubmitTx and opSubmitBatchTx are SubmitTx's and SubmitBatchTx's ops
// for dbError.
const (
	opSubmitTx      = "submit in the caller's transaction"
	opSubmitBatchTx = "submit a batch in the caller's transaction"
)

// txMethod names the method of an op that runs in the caller's
// transaction, "" for other ops.
func txMethod(op string) string {
	switch op {
	case opSubmitTx:
		return "SubmitTx"
	case opSubmitBatchTx:
		return "SubmitBatchTx"
	}
	return ""
}

// notMigratedError is dbError's error for a missing table. It matches
// ErrNotMigrated and the driver's error, without the sentinel's own text,
// which names outbox.Migrate.
type notMigratedError struct {
	msg string
	err error
}

func (e *notMigratedError) Error() string   { return e.msg }
func (e *notMigratedError) Unwrap() []error { return []error{ErrNotMigrated, e.err} }

// invalidNeighboursError is Around's refusal of its n. It matches
// ErrInvalidLimit without that sentinel's text, whose range (from 1)
// would contradict Around's (from 0).
type invalidNeighboursError struct{}

func (invalidNeighboursError) Error() string {
	return fmt.Sprintf("leaderboard: Around's neighbours on each side must be between 0 and %d", MaxPageSize)
}

func (invalidNeighboursError) Is(target error) bool { return target == ErrInvalidLimit }

// ValidationError reports a Command field that was refused. Nothing was
// written. It matches ErrInvalidCommand.
type ValidationError struct {
	// Index is the command's position in a SubmitBatch call (0 for Submit).
	Index int
	// Field is "EventID", "UserID" or "Delta".
	Field string
	// Reason says what is wrong, in words fit for an API response.
	Reason string
}

func (e *ValidationError) Error() string {
	return fmt.Sprintf("leaderboard: invalid command %d: %s %s", e.Index, e.Field, e.Reason)
}

// Unwrap returns ErrInvalidCommand.
func (e *ValidationError) Unwrap() error { return ErrInvalidCommand }

// IdempotencyConflictError reports an event id that is already recorded for
// a different command (another board, user or delta), or that one
// SubmitBatch call uses for two different commands. Nothing was written.
// It matches ErrIdempotencyConflict.
type IdempotencyConflictError struct {
	EventID uuid.UUID
	// Board, UserID and Delta describe the command recorded under EventID,
	// as the database holds it (whichever copy of a batch comes first).
	// With WithinBatch set, none was recorded: they describe the batch's
	// first command with EventID, and Board is the board's own name.
	Board  string
	UserID string
	Delta  int64
	// Attempted is the refused command: in a SubmitBatch, the batch's first
	// command with EventID that differs from the one described above.
	Attempted Command
	// WithinBatch is set when nothing is recorded under EventID and the
	// conflict is between two commands of the same SubmitBatch call.
	WithinBatch bool
}

func (e *IdempotencyConflictError) Error() string {
	if e.WithinBatch {
		return fmt.Sprintf("leaderboard: event %s is used in the batch for board %q user %q delta %d and again for user %q delta %d",
			e.EventID, e.Board, e.UserID, e.Delta, e.Attempted.UserID, e.Attempted.Delta)
	}
	return fmt.Sprintf("leaderboard: event %s was recorded for board %q user %q delta %d; refusing user %q delta %d",
		e.EventID, e.Board, e.UserID, e.Delta, e.Attempted.UserID, e.Attempted.Delta)
}

// Unwrap returns ErrIdempotencyConflict.
func (e *IdempotencyConflictError) Unwrap() error { return ErrIdempotencyConflict }

// ConcurrentSubmitError reports that, while SubmitTx or SubmitBatchTx ran
// in the caller's transaction, another transaction committed a command with
// the same event id (typically a client retry racing its original). The
// unique violation that revealed it aborted the caller's transaction: roll
// it back and retry the whole transaction, whose SubmitTx then returns the
// twin's Result with Duplicate set (or an *IdempotencyConflictError if the
// commands differ). Nothing of the caller's transaction can commit. It
// matches ErrConcurrentSubmit. Under SERIALIZABLE (any twin) and
// REPEATABLE READ (a twin of the same user), PostgreSQL reports the same
// race as a serialization failure (SQLSTATE 40001) instead, which is
// returned as it is, and is retried the same way.
type ConcurrentSubmitError struct {
	// EventID is the command's event id. For SubmitBatchTx it is taken from
	// the server's message, and uuid.Nil if that names none of the batch's
	// ids.
	EventID uuid.UUID
}

func (e *ConcurrentSubmitError) Error() string {
	what := "an event of the batch"
	if e.EventID != uuid.Nil {
		what = "event " + e.EventID.String()
	}
	return "leaderboard: " + what + " was committed by a concurrent transaction; this transaction is aborted: roll it back and retry it (the retry reports the duplicate)"
}

// Unwrap returns ErrConcurrentSubmit.
func (e *ConcurrentSubmitError) Unwrap() error { return ErrConcurrentSubmit }

// ScoreOutOfRangeError reports a command whose resulting score would leave
// [MinScore, MaxScore] (which also keeps it far from int64 overflow).
// Nothing was written. It matches ErrScoreOutOfRange.
type ScoreOutOfRangeError struct {
	// Index is the command's position in a SubmitBatch call (0 for
	// Submit), or -1 when a concurrent change made it impossible to tell
	// (or the caller's context ended first: the error then matches the
	// context's error too), and always for SubmitBatchTx, whose failed
	// statement aborts the transaction it would have to look in.
	Index  int
	UserID string
	Delta  int64
}

func (e *ScoreOutOfRangeError) Error() string {
	if e.Index < 0 {
		return fmt.Sprintf("leaderboard: a command of the batch would leave the score range [%d, %d]", MinScore, MaxScore)
	}
	return fmt.Sprintf("leaderboard: adding %d to the score of user %q would leave [%d, %d]", e.Delta, e.UserID, MinScore, MaxScore)
}

// Unwrap returns ErrScoreOutOfRange.
func (e *ScoreOutOfRangeError) Unwrap() error { return ErrScoreOutOfRange }

// StaleError is returned under the FailClosed policy when the projection
// lags by more than MaxLag, is unverified (Config.RequireVerifiedProjection;
// Unverified is set), or an AtLeast requirement was not met within
// ReadYourWritesTimeout; and under ServeStale when a read with an unmet
// AtLeast requirement finds the user it looks up missing in Redis
// (ServeStale cannot answer that from Redis). It matches ErrStale.
type StaleError struct {
	// Lag is the measured lag (negative when it could not be measured:
	// PostgreSQL could not be asked, or its clock stepped back; see
	// Freshness.Lag).
	Lag time.Duration
	// MaxLag is the configured limit.
	MaxLag time.Duration
	// UserID and Version are set when an AtLeast requirement was not met:
	// the first one unmet, in the order of the read's AtLeast options
	// (with the highest version asked for its user), at the last look
	// Redis answered within ReadYourWritesTimeout (the first requirement
	// when none did). Others may be unmet as well.
	UserID  string
	Version int64
	// Unverified is set, with Lag -1, when Config.RequireVerifiedProjection
	// refused the read: no Verify has found the projection complete since
	// Redis last lost the board's keys, or against the database PostgreSQL
	// is now, or Redis could not be read to look for Verify's record (a
	// Redis outage, reported so rather than as the Redis error: nothing
	// need be lost, and reads are verified again once Redis answers)
	// (Freshness.Unverified). For a lost record Board.Verify is the fix,
	// not waiting for PostgreSQL (though Verify needs it: Unverified is
	// also reported while PostgreSQL cannot be asked, once Redis has lost
	// the record).
	Unverified bool
}

func (e *StaleError) Error() string {
	if e.Unverified && e.Version > 0 {
		return fmt.Sprintf("leaderboard: projection has not reached version %d of user %q, and is not verified (Redis could not be read, or lost the board's keys, or PostgreSQL is not the database Verify checked it against; if it stays so while Redis answers, run Board.Verify)", e.Version, e.UserID)
	}
	if e.Unverified {
		return "leaderboard: projection not verified (Redis could not be read, or lost the board's keys, or PostgreSQL is not the database Verify checked it against; if it stays so while Redis answers, run Board.Verify)"
	}
	if e.Version > 0 {
		return fmt.Sprintf("leaderboard: projection has not reached version %d of user %q", e.Version, e.UserID)
	}
	if e.Lag < 0 {
		return "leaderboard: projection lag could not be measured"
	}
	return fmt.Sprintf("leaderboard: projection lags by %s (max %s)", e.Lag, e.MaxLag)
}

// Unwrap returns ErrStale.
func (e *StaleError) Unwrap() error { return ErrStale }

// UserNotFoundError is Rank's and Around's answer for a user without a
// score in the store that answered. It matches ErrUserNotFound. Freshness
// says how far that answer can be trusted, as it would for an entry: from
// Redis (ServeStale, or a fresh enough projection), a user with no score
// may be one whose first score is not projected yet (Lag), or one Redis
// lost (Unverified). It is the zero Freshness for a user id no board can
// hold (empty, not UTF-8, with a NUL byte, longer than
// MaxUserIDLengthLimit), which is not looked up; an id longer than
// Config.MaxUserIDLength is looked up (it may have been stored under a
// larger limit).
type UserNotFoundError struct {
	UserID    string
	Freshness Freshness
}

func (e *UserNotFoundError) Error() string { return ErrUserNotFound.Error() }

// Unwrap returns ErrUserNotFound.
func (e *UserNotFoundError) Unwrap() error { return ErrUserNotFound }
