package leaderboard

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"unicode/utf8"

	"github.com/verity-go/verity/projection"
	"github.com/verity-go/verity/reconcile"
)

// Reconciler returns a reconcile.Reconciler that compares the board's
// user_scores rows (the source of truth) with its Redis sorted set and
// repairs drift: missing, stale and corrupt entries by default (see the
// reconcile package for the policy, hooks, sampling and Rebuild). cfg may
// be nil; its MeterProvider defaults to the board's; a field it refuses is a
// leaderboard *ConfigError (wrapping reconcile's). Run it on a schedule:
// idempotent projection handles duplicates, not lost keys or hand edits.
func (b *Board) Reconciler(cfg *reconcile.Config) (*reconcile.Reconciler, error) {
	if b.notFromNew() {
		return nil, errBoardNotFromNew()
	}
	if b.cfg.MeterProvider != nil && (cfg == nil || cfg.MeterProvider == nil) {
		withMetrics := reconcile.Config{}
		if cfg != nil {
			withMetrics = *cfg
		}
		withMetrics.MeterProvider = b.cfg.MeterProvider
		cfg = &withMetrics
	}
	r, err := reconcile.New(b.Source(), reconcile.Target{
		Client:   b.rdb,
		Keyspace: b.ks,
		Kind:     projection.KindSortedSet,
		Name:     b.cfg.Name,
	}, cfg)
	var cerr *reconcile.ConfigError
	if errors.As(err, &cerr) { // the caller's cfg: a leaderboard *ConfigError too
		return nil, &ConfigError{Field: "reconcile." + cerr.Field, Reason: cerr.Reason, Err: err}
	}
	if err != nil {
		return nil, fmt.Errorf("leaderboard: reconciler: %w", err)
	}
	return r, nil
}

// Source returns the board's rows as a reconcile.Source: key = user id,
// version = the user's version, value = the NEGATED score, exactly what the
// board's Mapper projects.
func (b *Board) Source() reconcile.Source { return (*boardSource)(b) }

// boardSource reads user_scores of one board for reconcile.
type boardSource Board

var _ reconcile.Source = (*boardSource)(nil)

// Source queries: $1 board. Keys are user ids in byte order (C collation),
// served by the primary key (board, user_id). The page size is hidden from
// the planner in a subquery, as for the reads (see sql.go): without
// statistics a page was otherwise planned as a read of every key after the
// cursor and a sort.
const (
	sourceFirstSQL = `
SELECT user_id::text, version, score
FROM {{user_scores}}
WHERE board = $1::text
ORDER BY user_id
LIMIT (SELECT $2::bigint)`

	sourcePageSQL = `
SELECT user_id::text, version, score
FROM {{user_scores}}
WHERE board = $1::text AND user_id > $2::text COLLATE "C"
ORDER BY user_id
LIMIT (SELECT $3::bigint)`

	// ORDER BY random() reads the whole board once per sample: fine for
	// boards of up to a few million users at an hourly cadence. For more,
	// reconcile page by page instead.
	sourceSampleSQL = `
SELECT user_id::text, version, score
FROM {{user_scores}}
WHERE board = $1::text
ORDER BY random()
LIMIT $2::bigint`

	// One primary-key probe per distinct key, for the reason submitBatchSQL
	// gives: user_id = ANY ($2) read the whole board per lookup when the
	// statistics were missing (25 ms for 1,000 keys of 200,000 users
	// against 4-7 ms), and an orphan scan makes one lookup per page.
	sourceLookupSQL = `
SELECT s.user_id::text, s.version, s.score
FROM (SELECT DISTINCT unnest($2::text[]) COLLATE "C") AS k(user_id)
CROSS JOIN LATERAL (
    SELECT u.user_id, u.version, u.score
    FROM {{user_scores}} AS u
    WHERE u.board = $1::text AND u.user_id = k.user_id
    OFFSET 0
) AS s`
)

// rows runs a source query. Rows are scanned into the same three variables
// and appended to a slice sized for the page: a pass allocates the keys and
// the page, not a row at a time (a per-row closure made the scan targets
// escape, three allocations per row).
func (s *boardSource) rows(ctx context.Context, sizeHint int, q string, args ...any) ([]reconcile.Row, error) {
	rows, err := s.pool.Query(ctx, q, args...)
	if err != nil {
		return nil, (*Board)(s).dbError("source", err)
	}
	defer rows.Close()
	out := make([]reconcile.Row, 0, min(sizeHint, 4096))
	var (
		key            string
		version, score int64
	)
	for rows.Next() {
		if err := rows.Scan(&key, &version, &score); err != nil {
			return nil, (*Board)(s).dbError("source", err)
		}
		out = append(out, reconcile.Row{Key: key, Version: version, Value: projection.Value{Score: -score}})
	}
	if err := rows.Err(); err != nil {
		return nil, (*Board)(s).dbError("source", err)
	}
	return out, nil
}

// Page implements reconcile.Source.
func (s *boardSource) Page(ctx context.Context, after reconcile.Cursor, limit int) ([]reconcile.Row, error) {
	if (*Board)(s).notFromNew() {
		return nil, errBoardNotFromNew()
	}
	key, ok := after.Key()
	if !ok {
		return s.rows(ctx, limit, s.sql.sourceFirst, s.cfg.Name, limit)
	}
	return s.rows(ctx, limit, s.sql.sourcePage, s.cfg.Name, key, limit)
}

// Sample implements reconcile.Source.
func (s *boardSource) Sample(ctx context.Context, n int) ([]reconcile.Row, error) {
	if (*Board)(s).notFromNew() {
		return nil, errBoardNotFromNew()
	}
	return s.rows(ctx, n, s.sql.sourceSample, s.cfg.Name, n)
}

// Lookup implements reconcile.Source.
//
// A key that is not valid UTF-8 or holds a NUL byte cannot be a user id
// (Submit refuses it, and PostgreSQL would reject the whole lookup for
// it): it is left out, so that such a member of the projection is reported
// as the orphan it is instead of failing the run.
func (s *boardSource) Lookup(ctx context.Context, keys []string) ([]reconcile.Row, error) {
	if (*Board)(s).notFromNew() {
		return nil, errBoardNotFromNew()
	}
	if slices.ContainsFunc(keys, unstorable) {
		keys = slices.DeleteFunc(slices.Clone(keys), unstorable)
	}
	if len(keys) == 0 {
		return nil, nil
	}
	return s.rows(ctx, len(keys), s.sql.sourceLookup, s.cfg.Name, keys)
}

// unstorable reports a string that a PostgreSQL text column cannot hold.
func unstorable(k string) bool { return !utf8.ValidString(k) || strings.IndexByte(k, 0) >= 0 }
