package outbox

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/verity-go/verity/internal/deps"
)

// Writer appends messages to the outbox and records command idempotency keys,
// always inside the caller's transaction. It holds no connection and no
// state beyond its configuration; it is safe for concurrent use.
type Writer struct {
	cfg   Config
	names names

	appendSQL       string
	recordSQL       string
	lookupSQL       string
	storeResultSQL  string
	lookupResultSQL string
}

// NewWriter returns a Writer for the outbox described by cfg (nil means
// defaults). It does not touch the database; run Migrate once beforehand.
func NewWriter(cfg *Config) (*Writer, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	n := newNames(cfg.Schema, cfg.Table)
	return &Writer{
		cfg:             *cfg,
		names:           n,
		appendSQL:       fmt.Sprintf(appendSQL, n.Outbox),
		recordSQL:       fmt.Sprintf(recordCommandSQL, n.Idempotency),
		lookupSQL:       fmt.Sprintf(lookupCommandSQL, n.Idempotency),
		storeResultSQL:  fmt.Sprintf(storeResultSQL, n.Idempotency),
		lookupResultSQL: fmt.Sprintf(lookupResultSQL, n.Idempotency),
	}, nil
}

// unmade reports a Writer not made by NewWriter (a zero value, or nil),
// which has no table to write to.
func (w *Writer) unmade() bool { return w == nil || w.appendSQL == "" }

// errUnmadeWriter refuses a Writer not made by NewWriter.
func errUnmadeWriter() error {
	return &ConfigError{Field: "Writer", Reason: "has no outbox table (a zero value, or nil); create it with NewWriter(cfg)"}
}

// Table returns the quoted, schema-qualified name of the outbox table, ready
// to be placed in SQL text, for callers that compose their own INSERT (see
// the package documentation, "Composing your own INSERT"). It is empty for
// a Writer not made by NewWriter.
func (w *Writer) Table() string {
	if w.unmade() {
		return ""
	}
	return w.names.Outbox
}

// Channel returns the NOTIFY channel relays of this outbox listen on. A
// composed INSERT wakes them by calling pg_notify with this channel (passed
// as a bind parameter); the notification is delivered when the transaction
// commits. Its payload is the rows' stream when they all have one, so that
// relays restricted to other streams (RelayConfig.Streams) are not woken,
// or else empty, which wakes every relay. The name is derived from Schema
// and Table, so outboxes in different schemas do not wake each other. It
// is empty for a Writer not made by NewWriter.
func (w *Writer) Channel() string {
	if w.unmade() {
		return ""
	}
	return w.names.Channel
}

// Config returns the Writer's configuration with defaults applied (only
// the defaults for a Writer not made by NewWriter).
func (w *Writer) Config() Config {
	if w.unmade() {
		return *(*Config)(nil).WithDefaults()
	}
	return w.cfg
}

// appendSQL inserts every message with one statement and wakes relays in the
// same statement. unnest keeps array order, so ids ascend in message order.
// pg_notify appears once in FROM and runs once; PostgreSQL queues the
// notification and delivers it only when (and if) the transaction commits.
// Its payload, $7, is the messages' stream when they share one, else empty
// (see notifyPayload).
const appendSQL = `WITH inserted AS (
    INSERT INTO %s (event_id, stream, key, version, payload)
    SELECT event_id, stream, key, version, payload
    FROM unnest($1::uuid[], $2::text[], $3::text[], $4::bigint[], $5::bytea[])
        AS m(event_id, stream, key, version, payload)
    RETURNING 1
)
SELECT count(*) FROM inserted, pg_notify($6, $7::text)`

// notifyPayload returns the NOTIFY payload for rows of streams: their
// stream if they share one, else "" (every relay wakes).
func notifyPayload(streams []string) string {
	for _, s := range streams[1:] {
		if s != streams[0] {
			return ""
		}
	}
	return streams[0]
}

// pgUUID is id as a query argument. pgx sends a pgtype.UUID in binary; a
// uuid.UUID, a driver.Valuer, fails pgx's binary encode plan on every call
// (an error is built and dropped) before it goes through its text form.
// database/sql, behind SQLTx, takes either through driver.Valuer.
func pgUUID(id uuid.UUID) pgtype.UUID { return pgtype.UUID{Bytes: id, Valid: true} }

// Append inserts msgs into the outbox within tx, in one round trip whatever
// their number, and notifies listening relays; both take effect only if tx
// commits. Append with no messages does nothing.
//
// Every message is validated first: a nil EventID, an empty Stream, a
// Stream longer than MaxStreamBytes, a non-positive Version, a Stream or Key
// that is not valid UTF-8 or contains a NUL byte, or an EventID repeated
// within the call yields a *MessageError
// (errors.Is(err, ErrInvalidMessage)) and nothing is sent to the database.
// An EventID already present in the outbox yields ErrEventIDExists; like any
// failed statement, it aborts tx.
func (w *Writer) Append(ctx context.Context, tx Tx, msgs ...Message) error {
	if len(msgs) == 0 {
		return nil // nothing to write, whatever tx is
	}
	if w.unmade() {
		return errUnmadeWriter()
	}
	if deps.Missing(tx) {
		return missingTx()
	}
	if why := deps.NotInTransaction(tx); why != "" {
		return txNotATransaction(why)
	}
	if err := validateMessages(msgs); err != nil {
		return err
	}
	var (
		eventIDs = make([]pgtype.UUID, len(msgs)) // see pgUUID
		streams  = make([]string, len(msgs))
		keys     = make([]string, len(msgs))
		versions = make([]int64, len(msgs))
		payloads = make([][]byte, len(msgs))
	)
	for i, m := range msgs {
		eventIDs[i] = pgUUID(m.EventID)
		streams[i], keys[i], versions[i] = m.Stream, m.Key, m.Version
		payloads[i] = m.Payload
		if payloads[i] == nil {
			payloads[i] = []byte{} // the column is NOT NULL; an absent payload is an empty one
		}
	}
	var inserted int64
	err := tx.QueryRow(ctx, w.appendSQL, eventIDs, streams, keys, versions, payloads, w.names.Channel, notifyPayload(streams)).Scan(&inserted)
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && isEventIDViolation(pgErr) && pgErr.TableName == w.cfg.Table {
			return fmt.Errorf("%w: %s (%w)", ErrEventIDExists, pgErr.Detail, err)
		}
		return mapError("append", err)
	}
	if inserted != int64(len(msgs)) {
		// Cannot happen with the statement above; checked so that a silent
		// loss would be reported rather than trusted.
		return fmt.Errorf("outbox: append: inserted %d of %d messages", inserted, len(msgs))
	}
	return nil
}

func validateMessages(msgs []Message) error {
	seen := make(map[uuid.UUID]int, len(msgs))
	for i, m := range msgs {
		fail := func(field, reason string) error {
			return &MessageError{Index: i, EventID: m.EventID, Field: field, Reason: reason}
		}
		switch {
		case m.EventID == uuid.Nil:
			return fail("EventID", "is the nil UUID; give every command a stable, unique id")
		case m.Stream == "":
			return fail("Stream", "is empty; name the projection the message feeds")
		case len(m.Stream) > MaxStreamBytes:
			return fail("Stream", fmt.Sprintf("is %d bytes; at most %d (MaxStreamBytes) are allowed", len(m.Stream), MaxStreamBytes))
		case m.Version <= 0:
			return fail("Version", fmt.Sprintf("is %d; versions start at 1 and increase with every change", m.Version))
		}
		if reason := textProblem(m.Stream); reason != "" {
			return fail("Stream", reason)
		}
		if reason := textProblem(m.Key); reason != "" {
			return fail("Key", reason)
		}
		if first, dup := seen[m.EventID]; dup {
			return fail("EventID", fmt.Sprintf("repeats message %d of the same call; every message needs its own event id", first))
		}
		seen[m.EventID] = i
	}
	return nil
}

// textProblem explains why s cannot be stored in a PostgreSQL text column.
func textProblem(s string) string {
	switch {
	case !utf8.ValidString(s):
		return "is not valid UTF-8"
	case strings.IndexByte(s, 0) >= 0:
		return "contains a NUL byte, which PostgreSQL text cannot hold"
	}
	return ""
}
