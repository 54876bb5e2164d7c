package outbox

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/verity-go/verity/internal/pgcancel"
)

// Stats is a snapshot of an outbox's backlog.
type Stats struct {
	// Pending counts rows not yet acknowledged, including InFlight and
	// Retrying ones.
	Pending int64
	// InFlight counts rows handed to a relay whose partition lease has not
	// expired.
	InFlight int64
	// Retrying counts rows waiting out a retry backoff.
	Retrying int64
	// OldestPendingAge is how long the oldest pending row has waited (the
	// "outbox age", the figure to alert on: it grows when relays stop or
	// fail, whatever the volume). Zero when nothing is pending. A row that
	// fails MaxAttempts times leaves it when it moves to the dead-letter
	// table, although its state never reached the projection: the figure
	// drops (to 0 if nothing else is pending). Alert on DeadLetters too, and
	// count a stream's dead letters as unbounded lag in a freshness check
	// (as leaderboard's lag does). Rows whose
	// created_at is not finite (see Record.CreatedAt) have no age and are
	// left out. It is measured on the database clock: after that clock
	// steps back (an NTP step, a failover to a host whose clock lags), rows
	// written before the step look younger by the step, 0 when dated after
	// the clock, until it catches up; leaderboard's lag probe reports such
	// rows as unmeasurable instead. Capped at the largest Duration.
	OldestPendingAge time.Duration
	// DeadLetters counts rows in the dead-letter table.
	DeadLetters int64
}

// statsSQL gathers all figures in one round trip. Pending and Retrying come
// from one pass over the pending rows: O(pending). InFlight adds up the ids
// handed out under the live partition leases (rows stamped by a relay of an
// older version count too): O(partitions). OldestPendingAge is one probe of
// the created_at partial index: O(1); its bounds skip 'infinity' and
// '-infinity', which now() - min(created_at) cannot subtract (and which
// the index sorts at its ends, so the probe stays O(1)). DeadLetters scans
// the dead-letter table: O(dead letters).
const statsSQL = `SELECT p.pending, p.in_flight + l.in_flight, p.retrying, a.age_us, d.dead
FROM (
    SELECT count(*) AS pending,
           count(*) FILTER (WHERE leased_until > now()) AS in_flight,
           count(*) FILTER (WHERE available_at > now()) AS retrying
    FROM %[1]s WHERE published_at IS NULL
) p, (
    SELECT COALESCE(sum(upper(r) - lower(r)), 0)::bigint AS in_flight
    FROM %[3]s, unnest(inflight) AS r WHERE leased_until > now()
) l, (
    SELECT COALESCE((EXTRACT(EPOCH FROM now() - min(created_at)) * 1000000)::bigint, 0) AS age_us
    FROM %[1]s WHERE published_at IS NULL AND created_at > '-infinity' AND created_at < 'infinity'
) a, (
    SELECT count(*) AS dead FROM %[2]s
) d`

// Stats reads the backlog figures in one statement, with index-backed plans
// whose costs are: Pending, InFlight and Retrying, one pass over the pending
// rows of the partial pending index, O(pending); OldestPendingAge, one probe
// of the created_at partial index, O(1); DeadLetters, O(dead letters). The
// counts are exact, so on a backlog of millions of rows a call takes on the
// order of a second (see the package documentation for measured figures):
// poll Stats every few seconds rather than per request, and alert on
// OldestPendingAge. With RelayConfig.MeterProvider set, each successful call
// also refreshes the snapshot the relay's backlog gauges report.
func (r *Relay) Stats(ctx context.Context) (Stats, error) {
	if r.unmade() {
		return Stats{}, errUnmadeRelay()
	}
	return r.statsOn(ctx, r.pool)
}

// statsOn is Stats's statement, run on q (the pool, or a connection taken
// from it).
func (r *Relay) statsOn(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) (Stats, error) {
	var (
		s     Stats
		ageUS int64
	)
	err := q.QueryRow(ctx, fmt.Sprintf(statsSQL, r.names.Outbox, r.names.Dead, r.names.Leases)).
		Scan(&s.Pending, &s.InFlight, &s.Retrying, &ageUS, &s.DeadLetters)
	if err != nil {
		return Stats{}, mapError("stats", err)
	}
	s.OldestPendingAge = ageFromMicroseconds(ageUS)
	if r.metrics.enabled {
		r.lastStats.Store(&statsSample{stats: s, at: time.Now()})
	}
	return s, nil
}

// ageFromMicroseconds converts an age PostgreSQL measured in microseconds
// to a Duration: 0 for a row dated in the future (a clock that stepped
// back), and the largest Duration, not a wrapped figure, for one older
// than that holds (about 292 years: a row dated year 1, which a composed
// INSERT passing an unset time.Time stores).
func ageFromMicroseconds(us int64) time.Duration {
	if us > math.MaxInt64/int64(time.Microsecond) {
		return math.MaxInt64
	}
	return max(time.Duration(us)*time.Microsecond, 0)
}

// DeadLetter is a row that failed MaxAttempts times.
type DeadLetter struct {
	Record
	// LastError is the handler error of the last attempt, or says that the
	// relay handling it stopped without settling it (it crashed, or hung
	// past its lease).
	LastError string
	// FailedAt is when the row was moved to the dead-letter table.
	FailedAt time.Time
}

// pinOutputSQL sets the text output settings pgx parses (hex bytea, ISO
// dates) for the current transaction only, as claims do (claimLockSQL):
// in the text modes a transaction-pooling proxy needs, the session's may
// be anything, another client's plain SET included.
const pinOutputSQL = `SELECT set_config('bytea_output', 'hex', true), set_config('DateStyle', 'ISO', true)`

const deadLettersSQL = `SELECT id, event_id, stream, key, version, payload, created_at, attempts, last_error, failed_at
FROM %s WHERE id > $1 ORDER BY id LIMIT $2`

// DeadLetters lists up to limit dead letters with an id greater than afterID,
// in id order; pass the last id seen to page through them. A limit of 0 or
// less is refused with a *ConfigError naming "limit" (ErrInvalidConfig).
func (r *Relay) DeadLetters(ctx context.Context, afterID int64, limit int) ([]DeadLetter, error) {
	if r.unmade() {
		return nil, errUnmadeRelay()
	}
	if limit <= 0 {
		return nil, &ConfigError{Field: "limit", Reason: fmt.Sprintf("is %d; use a positive page size", limit)}
	}
	// One pipeline, one implicit transaction, which the settings do not
	// outlive.
	batch := &pgx.Batch{}
	batch.Queue(pinOutputSQL)
	batch.Queue(fmt.Sprintf(deadLettersSQL, r.names.Dead), afterID, limit)
	results := r.pool.SendBatch(ctx, batch)
	defer results.Close()
	if _, err := results.Exec(); err != nil {
		return nil, mapError("dead letters", err)
	}
	rows, err := results.Query()
	if err != nil {
		return nil, mapError("dead letters", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (DeadLetter, error) {
		var d DeadLetter
		err := row.Scan(&d.ID, &d.EventID, &d.Stream, &d.Key, &d.Version, &d.Payload, createdAt{&d.CreatedAt}, &d.Attempts, &d.LastError, &d.FailedAt)
		return d, err
	})
	if err != nil {
		return nil, mapError("dead letters", err)
	}
	if err := results.Close(); err != nil {
		return nil, mapError("dead letters", err)
	}
	return out, nil
}

// ReplayFilter selects the dead letters ReplayDead moves back. The zero value
// selects all of them.
type ReplayFilter struct {
	// EventIDs, when not empty, selects only these events.
	EventIDs []uuid.UUID
	// Stream, when not empty, selects only this stream.
	Stream string
	// Limit, when positive, moves at most this many events (lowest ids
	// first); 0 moves all that match. Negative is refused.
	Limit int
}

// validate refuses a filter no dead letter can match, and a negative Limit
// (which would otherwise read as "no limit").
func (f ReplayFilter) validate() error {
	if f.Limit < 0 {
		return &ConfigError{Field: "ReplayFilter.Limit", Reason: fmt.Sprintf("is %d; use 0 for no limit", f.Limit)}
	}
	if reason := textProblem(f.Stream); reason != "" {
		return &ConfigError{Field: "ReplayFilter.Stream", Reason: reason}
	}
	if len(f.Stream) > MaxStreamBytes {
		return &ConfigError{Field: "ReplayFilter.Stream", Reason: fmt.Sprintf("is %d bytes; no stream is longer than %d (MaxStreamBytes)", len(f.Stream), MaxStreamBytes)}
	}
	return nil
}

// replayDeadSQL moves dead letters back to the outbox in one statement, with
// their original id (OVERRIDING SYSTEM VALUE: the id was generated by the
// outbox's identity and is free again), attempts reset and the last error
// kept for reference, and notifies relays.
//
// The dead-letter table may hold several rows of one event (it died, was
// appended again and died again), and the outbox holds each event id once:
// "newest" takes the newest selected row of each event and skips events the
// outbox holds again, so that one such event cannot make the whole replay
// fail on the unique key. "locked" locks those rows, lowest id first, with
// SKIP LOCKED, and only then applies the limit: a row another transaction
// holds (a concurrent replay took its event) neither blocks the replay nor
// uses up the limit, so concurrent replays split the events and a loop
// replaying until 0 does not stop early. Locking the newest row, not every
// copy, makes it the event's token: two replays never move the same event.
// "moved" deletes the older selected rows of a replayed event with it: they
// are copies of what is now back in the outbox, and a later replay would
// deliver the event once more.
// A dead letter whose created_at is not finite (buried before migration
// 006) returns with created_at = now(): 006's constraint refuses it. An
// event whose newest dead letter has a stream longer than MaxStreamBytes
// (%[3]d; buried before migration 005, or moved by 007) is skipped in
// "locked": 005's constraint refuses it, and would fail the whole replay.
const replayDeadSQL = `WITH newest AS (
    SELECT DISTINCT ON (d.event_id) d.id
    FROM %[2]s AS d
    WHERE (cardinality($1::uuid[]) = 0 OR d.event_id = ANY($1::uuid[]))
      AND ($2::text = '' OR d.stream = $2::text)
      AND NOT EXISTS (SELECT 1 FROM %[1]s AS o WHERE o.event_id = d.event_id)
    ORDER BY d.event_id, d.id DESC
),
free AS (
    SELECT n.id FROM newest AS n
    WHERE NOT EXISTS (SELECT 1 FROM %[1]s AS o WHERE o.id = n.id)
),
locked AS MATERIALIZED (
    SELECT id, event_id FROM %[2]s
    WHERE id IN (SELECT id FROM free) AND octet_length(stream) <= %[3]d
    ORDER BY id
    LIMIT $3
    FOR UPDATE SKIP LOCKED
),
moved AS (
    DELETE FROM %[2]s AS d
    USING locked AS l
    WHERE d.event_id = l.event_id AND d.id <= l.id
      AND (cardinality($1::uuid[]) = 0 OR d.event_id = ANY($1::uuid[]))
      AND ($2::text = '' OR d.stream = $2::text)
    RETURNING d.id, d.event_id, d.stream, d.key, d.version, d.payload, d.created_at, d.last_error, d.id = l.id AS newest
),
restored AS (
    INSERT INTO %[1]s (id, event_id, stream, key, version, payload, created_at, last_error)
    OVERRIDING SYSTEM VALUE
    SELECT id, event_id, stream, key, version, payload,
        CASE WHEN isfinite(created_at) THEN created_at ELSE now() END, last_error
    FROM moved WHERE newest
    RETURNING 1
)
SELECT count(*) FROM restored, pg_notify($4, '')`

// ReplayDead moves the dead letters selected by filter back into the outbox,
// due immediately with attempts reset, and wakes the relays. It returns how
// many rows it moved back. Fix the cause first (a handler bug, a bad
// payload), or the rows will fail MaxAttempts times again. A row moved back
// keeps its created_at, so its age counts from its first append: replaying
// a dead letter from hours ago raises Stats.OldestPendingAge (and an alert
// on it) to hours at once, until the row is delivered.
//
// An event with several dead letters is moved back once, from its newest
// dead letter, and its older dead letters are deleted. An event the outbox
// holds again (appended anew since it died) is left in the dead-letter table
// and skipped. If such an event is appended while the replay runs, the
// replay fails, moving nothing, with ErrEventIDExists; calling it again
// skips that event. An event whose newest dead letter has a stream longer
// than MaxStreamBytes (appended before migration 005 bounded the stream)
// is left in the dead-letter table, skipped and not counted: the outbox no
// longer accepts that stream. List it with DeadLetters and deal with it
// outside the outbox. So is an event whose newest dead letter's id the
// outbox holds again (possible only after the outbox's ids were reset).
// A replay that deadlocks with a transaction appending dead events (it
// moved nothing) is run again, up to three times. If ctx ends while the
// replay's statement runs (waiting on such an append, say), the statement
// is cancelled on the server before ReplayDead returns, as for Migrate
// (and with its caveat: a server that does not answer within two seconds),
// and moves nothing; the error then matches ctx's. (A statement that finished
// first has moved its rows, and ReplayDead returns their count.)
func (r *Relay) ReplayDead(ctx context.Context, filter ReplayFilter) (int64, error) {
	if r.unmade() {
		return 0, errUnmadeRelay()
	}
	if err := filter.validate(); err != nil {
		return 0, err
	}
	var limit any // NULL: no limit
	if filter.Limit > 0 {
		limit = filter.Limit
	}
	ids := make([]pgtype.UUID, len(filter.EventIDs)) // see pgUUID
	for i, id := range filter.EventIDs {
		ids[i] = pgUUID(id)
	}
	var (
		n   int64
		err error
	)
	for deadlocks := 0; ; deadlocks++ {
		// A deadlock with a caller's transaction appending dead events
		// rolled the statement back, moving nothing: run it again.
		n, err = r.replayDeadOnce(ctx, ids, filter.Stream, limit)
		var pgErr *pgconn.PgError
		if deadlocks < 3 && ctx.Err() == nil && errors.As(err, &pgErr) && pgErr.Code == pgDeadlockDetected {
			continue
		}
		break
	}
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && isEventIDViolation(pgErr) {
			return 0, fmt.Errorf("%w: replay dead letters: %s (%w)", ErrEventIDExists, pgErr.Detail, err)
		}
		return 0, mapError("replay dead letters", err)
	}
	r.metrics.replayed.Add(ctx, n, r.metrics.attrs)
	return n, nil
}

// replayDeadOnce runs replayDeadSQL once on a connection of its own, so
// that ctx's end stops it on the server before it returns: it may be
// waiting on an append of one of its event ids, and could otherwise move
// the rows once that append rolled back, after ReplayDead had returned an
// error.
func (r *Relay) replayDeadOnce(ctx context.Context, ids []pgtype.UUID, stream string, limit any) (int64, error) {
	c, err := r.pool.Acquire(ctx)
	if err != nil {
		return 0, err
	}
	defer c.Release()
	var n int64
	err = pgcancel.Run(ctx, c.Conn().PgConn(), func(ctx context.Context) error {
		return c.QueryRow(ctx, fmt.Sprintf(replayDeadSQL, r.names.Outbox, r.names.Dead, MaxStreamBytes),
			ids, stream, limit, r.names.Channel).Scan(&n)
	})
	return n, err
}
