package outbox

import (
	"context"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// MaxStreamBytes bounds Message.Stream. A dead letter's stream is indexed
// (dead letters are listed by stream), and PostgreSQL refuses an index entry
// over about 2.7 kB: a longer stream could never be moved to the dead
// letters, and its failing row would block its partition. Migration 005
// adds the same bound as a CHECK constraint, for composed INSERTs.
const MaxStreamBytes = 1024

// Message is one unit of projection work appended to the outbox inside the
// caller's transaction.
//
// Payload is the ABSOLUTE state of the entity identified by (Stream, Key) as of
// Version — never a delta. Because every message carries the whole state and a
// version, delivering it twice, or delivering an older message after a newer
// one, can be made harmless by a version gate downstream.
type Message struct {
	// EventID identifies the command that produced this state change. It is
	// unique among the rows still in the outbox: appending an EventID that a
	// pending row holds fails with ErrEventIDExists, but once that row is
	// acknowledged and deleted (without RelayConfig.KeepPublished) the same
	// EventID can be appended, and is
	// delivered, again. The outbox is not an idempotency record: use
	// RecordCommand for that.
	EventID uuid.UUID
	// Stream names the projection the message feeds, for example
	// "leaderboard:weekly". Relays may be restricted to some streams.
	// At most MaxStreamBytes bytes of valid UTF-8 without NUL bytes.
	Stream string
	// Key identifies the entity within the stream (a user id, a product id).
	// Any valid UTF-8 without NUL bytes is allowed (a PostgreSQL text column
	// holds nothing else); Append refuses anything else with a typed error.
	Key string
	// Version is the entity's version after the change. It must be positive
	// and strictly increase with every change of (Stream, Key); take it from
	// the caller's own state row, in the same transaction.
	Version int64
	// Payload is the absolute state as of Version.
	Payload []byte
}

// Record is a message as the relay hands it to a Handler: the appended
// Message plus the bookkeeping the outbox keeps for it.
type Record struct {
	Message
	// ID is the outbox row's id; it increases with commit order only
	// approximately (ids are assigned at insert time, not commit time).
	ID int64
	// CreatedAt is when the row was inserted (the transaction's clock). It
	// is zero when the row's created_at is 'infinity' or '-infinity', which
	// time.Time cannot hold: the row's age is unknown. Only a composed
	// INSERT into an outbox without migration 006 could store such a value.
	CreatedAt time.Time
	// Attempts counts claims of this row, including the current one.
	Attempts int
}

// createdAt scans a timestamptz into *t, leaving it zero for 'infinity'
// and '-infinity', which *time.Time refuses: one such row must not fail the
// whole claim (or dead-letter page) it is read in.
type createdAt struct{ t *time.Time }

func (c createdAt) ScanTimestamptz(v pgtype.Timestamptz) error {
	*c.t = time.Time{}
	if v.Valid && v.InfinityModifier == pgtype.Finite {
		*c.t = v.Time
	}
	return nil
}

// Result is a Handler's verdict on one record of a batch.
type Result struct {
	// Err, when nil, means the record was processed and may be acknowledged.
	// When non-nil, the record is retried after a backoff, or moved to the
	// dead-letter table once it has been attempted MaxAttempts times.
	Err error
}

// Handler processes batches of claimed records. The relay calls Handle with at
// most BatchSize records and acknowledges exactly those whose Result has a nil
// Err. Handle must return len(batch) results, or a non-nil error, which fails
// every record of the batch. Handle must not modify batch or its records:
// the relay settles them by their ID and Attempts once Handle has returned,
// so a record changed in place would settle another row. (It may keep them:
// the relay does not reuse them.)
//
// Delivery is at-least-once: a record may be handed to Handle again after a
// crash, a lost lease or a failed acknowledgement, so Handle must be
// idempotent (the projection package's version gate is).
//
// A panic in Handle fails every record of the batch with ErrHandlerContract,
// and the relay goes on. runtime.Goexit (t.FailNow in a test's handler)
// cannot be caught: RunOnce never returns and its goroutine ends; Run claims
// nothing more and never returns, and its goroutine ends once ctx does, or
// at once when Run has no goroutine of its own to wait for (DisableNotify
// or a shared Listener, and no metrics to refresh). The batch stays leased
// until its lease ends; then another relay delivers it.
type Handler interface {
	Handle(ctx context.Context, batch []Record) ([]Result, error)
}

// HandlerFunc adapts a function to the Handler interface.
type HandlerFunc func(ctx context.Context, batch []Record) ([]Result, error)

// Handle calls f(ctx, batch).
func (f HandlerFunc) Handle(ctx context.Context, batch []Record) ([]Result, error) {
	return f(ctx, batch)
}

// Tx is the narrow view of a database transaction that writes to the outbox
// need. pgx.Tx satisfies it; SQLTx adapts a *sql.Tx.
type Tx interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

var (
	_ Tx                        = (pgx.Tx)(nil)
	_ Handler                   = HandlerFunc(nil)
	_ pgtype.TimestamptzScanner = createdAt{}
)
