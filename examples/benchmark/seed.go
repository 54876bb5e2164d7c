package main

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// This file is the baseline: the seed design ("When a Redis Leaderboard
// Lies") rebuilt faithfully in Go, so that the library is compared with the
// design it replaces on the same servers, in the same process.

//go:embed seed_schema.sql
var seedSchemaSQL string

//go:embed seed_gate.lua
var seedGateLua string

// seedGate is the per-event projection script with its marker key.
var seedGate = redis.NewScript(seedGateLua)

// seedMarkerTTL is the seed's marker lifetime: a day.
const seedMarkerTTL = 24 * time.Hour

// seedBatch is the seed worker's claim size (LIMIT 100).
const seedBatch = 100

// seedDesign is one instance of the seed's tables and Redis keys.
type seedDesign struct {
	pool                   *pgxpool.Pool // commands and fills
	workerPool             *pgxpool.Pool // the worker's claims; pool unless set
	rdb                    *redis.Client
	events, scores, outbox string // quoted, schema-qualified
	zset, versions         string // Redis keys
	markerPrefix           string

	claimSQL, publishSQL, insertEventSQL, upsertScoreSQL, insertOutboxSQL string
}

// newSeedKeys returns the Redis half of the seed design alone (enough to
// project), writing under keyPrefix.
func newSeedKeys(rdb *redis.Client, keyPrefix string) *seedDesign {
	return &seedDesign{
		rdb:          rdb,
		zset:         keyPrefix + "seed:{lb}:zset",
		versions:     keyPrefix + "seed:{lb}:versions",
		markerPrefix: keyPrefix + "seed:event:",
	}
}

// newSeedDesign creates the seed tables, named with prefix, in schema and
// returns the design writing under keyPrefix.
func newSeedDesign(ctx context.Context, pool *pgxpool.Pool, rdb *redis.Client, schema, prefix, keyPrefix string) (*seedDesign, error) {
	s := newSeedKeys(rdb, keyPrefix)
	s.pool = pool
	s.events = qualify(schema, prefix+"score_events")
	s.scores = qualify(schema, prefix+"user_scores")
	s.outbox = qualify(schema, prefix+"leaderboard_outbox")
	ddl := strings.NewReplacer(
		"{{events}}", s.events,
		"{{scores}}", s.scores,
		"{{outbox}}", s.outbox,
		"{{pending_index}}", pgx.Identifier{prefix + "leaderboard_outbox_pending_idx"}.Sanitize(),
	).Replace(seedSchemaSQL)
	if _, err := pool.Exec(ctx, ddl); err != nil {
		return nil, fmt.Errorf("creating the seed tables: %w", err)
	}
	s.claimSQL = `SELECT id, event_id, user_id, absolute_score, score_version FROM ` + s.outbox +
		` WHERE published_at IS NULL ORDER BY id FOR UPDATE SKIP LOCKED LIMIT ` + strconv.Itoa(seedBatch)
	s.publishSQL = `UPDATE ` + s.outbox + ` SET published_at = now() WHERE id = ANY($1::bigint[])`
	s.insertEventSQL = `INSERT INTO ` + s.events + ` (event_id, user_id, delta) VALUES ($1, $2, $3)
		ON CONFLICT DO NOTHING RETURNING event_id`
	s.upsertScoreSQL = `INSERT INTO ` + s.scores + ` AS s (user_id, score, version) VALUES ($1, $2, 1)
		ON CONFLICT (user_id) DO UPDATE SET score = s.score + EXCLUDED.score, version = s.version + 1, updated_at = now()
		RETURNING score, version`
	s.insertOutboxSQL = `INSERT INTO ` + s.outbox + ` (event_id, user_id, absolute_score, score_version) VALUES ($1, $2, $3, $4)`
	if err := seedGate.Load(ctx, rdb).Err(); err != nil {
		return nil, fmt.Errorf("loading the seed script: %w", err)
	}
	return s, nil
}

// submit is the seed's command handler: BEGIN; record the event (ON
// CONFLICT DO NOTHING); upsert the score; append the outbox row; COMMIT —
// five statements, five round trips. It returns the new score and version
// (zeros for a duplicate command).
func (s *seedDesign) submit(ctx context.Context, eventID uuid.UUID, user string, delta int) (score, version int64, err error) {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return 0, 0, err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	// The id goes as a pgtype.UUID, in binary, as the library sends its
	// ids: a uuid.UUID costs pgx a failed encode plan per statement.
	id := pgtype.UUID{Bytes: eventID, Valid: true}
	switch err := tx.QueryRow(ctx, s.insertEventSQL, id, user, delta).Scan(&id); {
	case errors.Is(err, pgx.ErrNoRows):
		return 0, 0, tx.Commit(ctx) // duplicate command: no second effect
	case err != nil:
		return 0, 0, err
	}
	if err := tx.QueryRow(ctx, s.upsertScoreSQL, user, delta).Scan(&score, &version); err != nil {
		return 0, 0, err
	}
	if _, err := tx.Exec(ctx, s.insertOutboxSQL, id, user, score, version); err != nil {
		return 0, 0, err
	}
	return score, version, tx.Commit(ctx)
}

// seedRow is one claimed seed outbox row.
type seedRow struct {
	id, score, version int64
	eventID            uuid.UUID
	user               string
}

// drainBatch is one iteration of the seed worker: claim up to 100 rows with
// FOR UPDATE SKIP LOCKED inside a transaction, project every row with its
// own EVALSHA (all pipelined in one round trip), mark the rows published
// and commit. The transaction — and the row locks — stay open while Redis
// is called. onProjected, if set, is called once the Redis writes are
// done (before the commit). It returns the number of rows published.
func (s *seedDesign) drainBatch(ctx context.Context, onProjected func([]seedRow)) (int, error) {
	pool := s.pool
	if s.workerPool != nil {
		pool = s.workerPool
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	rows, err := tx.Query(ctx, s.claimSQL)
	if err != nil {
		return 0, err
	}
	batch, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (seedRow, error) {
		var sr seedRow
		// (*[16]byte): pgx scans a uuid.UUID through its sql.Scanner, via
		// text; the relay reads the 16 bytes, and so does the seed.
		err := r.Scan(&sr.id, (*[16]byte)(&sr.eventID), &sr.user, &sr.score, &sr.version)
		return sr, err
	})
	if err != nil || len(batch) == 0 {
		return 0, err
	}
	if err := s.project(ctx, batch); err != nil {
		return 0, err
	}
	if onProjected != nil {
		onProjected(batch)
	}
	ids := make([]int64, len(batch))
	for i, r := range batch {
		ids[i] = r.id
	}
	if _, err := tx.Exec(ctx, s.publishSQL, ids); err != nil {
		return 0, err
	}
	return len(batch), tx.Commit(ctx)
}

// project sends one EVALSHA per row, pipelined.
func (s *seedDesign) project(ctx context.Context, batch []seedRow) error {
	pipe := s.rdb.Pipeline()
	ttl := int(seedMarkerTTL / time.Second)
	for _, r := range batch {
		seedGate.EvalSha(ctx, pipe, []string{s.markerPrefix + r.eventID.String(), s.zset, s.versions},
			r.user, r.score, r.version, ttl)
	}
	cmds, err := pipe.Exec(ctx)
	if err != nil {
		return fmt.Errorf("seed projection: %w", err)
	}
	for _, c := range cmds {
		if c.Err() != nil {
			return fmt.Errorf("seed projection: %w", c.Err())
		}
	}
	return nil
}

// fill inserts n projection-ready rows into the seed outbox (and the events
// they reference) in one statement: key user-(i mod users), version rising
// per key, as the library's outbox gets in fillOutbox.
func (s *seedDesign) fill(ctx context.Context, n, users int) error {
	_, err := s.pool.Exec(ctx, `WITH src AS MATERIALIZED (
    SELECT gen_random_uuid() AS event_id, g FROM generate_series(0, $1 - 1) AS g
), ev AS (
    INSERT INTO `+s.events+` (event_id, user_id, delta)
    SELECT event_id, 'user-' || (g % $2), 1 FROM src
)
INSERT INTO `+s.outbox+` (event_id, user_id, absolute_score, score_version)
SELECT event_id, 'user-' || (g % $2), g % 1000, g / $2 + 1 FROM src ORDER BY g`, n, users)
	if err != nil {
		return err
	}
	_, err = s.pool.Exec(ctx, `ANALYZE `+s.events+`; ANALYZE `+s.outbox)
	return err
}

// pending counts unpublished rows.
func (s *seedDesign) pending(ctx context.Context) (int64, error) {
	var n int64
	err := s.pool.QueryRow(ctx, `SELECT count(*) FROM `+s.outbox+` WHERE published_at IS NULL`).Scan(&n)
	return n, err
}

// stored counts the events and outbox rows the seed holds.
func (s *seedDesign) stored(ctx context.Context) (stored, error) {
	var n stored
	err := s.pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+s.events+`), (SELECT count(*) FROM `+s.outbox+`)`).Scan(&n.events, &n.queued)
	return n, err
}
