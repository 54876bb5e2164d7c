package reconcile

import (
	"context"

	"github.com/verity-go/verity/projection"
)

// Row is one entity as the source of truth has it: its key (the sorted-set
// member, hash field or document id), its version and its absolute value.
//
// Value must be in the form the Target's Kind holds: Value.Score for
// KindSortedSet, Value.Data for KindHash and KindDocument. The other field
// is ignored, as by the gate, so a row of the wrong form is compared with,
// and repaired to, score 0 or an empty value, for every entry alike. New
// refuses an *SQLSource of another Kind than its Target; another Source's
// rows cannot be told apart (score 0 and empty bytes are values too).
type Row struct {
	Key     string
	Version int64
	Value   projection.Value
}

// Cursor is a keyset position in a Source: the last key of the previous page.
// The zero Cursor is the start, before every key (the empty string
// included).
type Cursor struct {
	key string
	set bool
}

// After returns the cursor positioned just after key.
func After(key string) Cursor { return Cursor{key: key, set: true} }

// Key returns the last key already returned, and false for the start.
func (c Cursor) Key() (string, bool) { return c.key, c.set }

// Source reads the source of truth. Implementations must be safe for use by
// one Reconciler at a time: a Reconciler calls its Source's methods one at
// a time, even across concurrent runs. Rows must carry the value in the
// form the Target's Kind holds (see Row). SQLSource is the PostgreSQL
// implementation.
type Source interface {
	// Page returns up to limit rows whose key sorts after the cursor, in
	// ascending key order, or no rows at the end. It must use keyset
	// pagination (WHERE key > $after ORDER BY key LIMIT n): pages stay
	// cheap however deep the pass is, and concurrent inserts or deletes
	// never make a pass skip or repeat a row that existed throughout.
	Page(ctx context.Context, after Cursor, limit int) ([]Row, error)
	// Sample returns up to n rows chosen at random, in any order. It should
	// be cheap on large tables (SQLSource documents its method and bias).
	Sample(ctx context.Context, n int) ([]Row, error)
	// Lookup returns the rows, among keys, that exist in the source, in any
	// order. Keys that do not exist are simply absent from the result, and
	// so are keys the source could never hold (a malformed projection
	// member): return no row for them, not an error, or the orphan scan
	// cannot report the very entries it exists to find. A row that exists
	// but cannot be read is an error, not an absent key: left out, its
	// projection entry would be taken for an orphan.
	Lookup(ctx context.Context, keys []string) ([]Row, error)
}

// serialSource makes a Reconciler call its Source one method at a time, as
// the Source contract promises: a full run may look rows up again (ahead
// findings) while its read-ahead walk reads the next page, and a Source
// over a single connection must not see those calls overlap.
type serialSource struct {
	src  Source
	turn chan struct{} // holds a token while a call is running
}

func newSerialSource(src Source) *serialSource {
	return &serialSource{src: src, turn: make(chan struct{}, 1)}
}

func (s *serialSource) acquire(ctx context.Context) error {
	select {
	case s.turn <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (s *serialSource) Page(ctx context.Context, after Cursor, limit int) ([]Row, error) {
	if err := s.acquire(ctx); err != nil {
		return nil, err
	}
	defer func() { <-s.turn }()
	return s.src.Page(ctx, after, limit)
}

func (s *serialSource) Sample(ctx context.Context, n int) ([]Row, error) {
	if err := s.acquire(ctx); err != nil {
		return nil, err
	}
	defer func() { <-s.turn }()
	return s.src.Sample(ctx, n)
}

func (s *serialSource) Lookup(ctx context.Context, keys []string) ([]Row, error) {
	if err := s.acquire(ctx); err != nil {
		return nil, err
	}
	defer func() { <-s.turn }()
	return s.src.Lookup(ctx, keys)
}

// frozenSnapshot asks the Source it wraps, if that can tell (see
// frozenSource); a Source that cannot is taken to read fresh snapshots.
func (s *serialSource) frozenSnapshot(ctx context.Context) (bool, error) {
	fs, ok := s.src.(frozenSource)
	if !ok {
		return false, nil
	}
	if err := s.acquire(ctx); err != nil {
		return false, err
	}
	defer func() { <-s.turn }()
	return fs.frozenSnapshot(ctx)
}
