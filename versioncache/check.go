package versioncache

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"reflect"

	"github.com/redis/go-redis/v9"
)

// IDLoader loads the current value of one id from the source of truth, for
// Check. To let Check see a deleted row that is still cached, return a value
// that encodes differently (a tombstone) instead of an error.
type IDLoader[T any] func(ctx context.Context, id string) (T, error)

// CheckReport is the outcome of Check and CheckAt. For CheckAt, Cached
// counts values cached at or above the source's version (which GetAt would
// serve), and NotCached includes values cached under an older one.
//
// Sampled is always Cached + NotCached + Undecodable, also in the partial
// report returned with an error: an id counts once it has been classified.
// The id whose examination failed is left out when the error came before
// that (Check's Peek; CheckAt's read of the cache or its load of the
// source), and counted as Cached when it came while comparing.
type CheckReport[T any] struct {
	Sampled   int // ids classified: Cached + NotCached + Undecodable
	Cached    int // of those, ids with a value under their current version
	NotCached int // ids with nothing cached: nothing to diverge
	// Undecodable counts ids whose cached value the Codec cannot decode
	// (a codec change, a foreign writer). Get never serves such a value: it
	// reloads and overwrites it.
	Undecodable int
	// Moved counts cached ids whose value changed (the version moved, or it
	// was deleted or replaced) while they were being compared: a write was
	// in flight, so the comparison proves nothing either way.
	Moved int
	// Divergent counts cached values that differed from the source of truth
	// twice, with the version unchanged in between.
	Divergent   int
	Divergences []Divergence[T] // one per Divergent id, in the order checked
}

// Divergence is a cached value that disagrees with the source of truth.
type Divergence[T any] struct {
	ID      string
	Version int64 // the version the value is cached under
	Cached  T     // the cached value, as Get (CheckAt: GetAt) would serve it
	Current T     // the source's value, from the loader
}

// Check compares the cached values of up to n ids picked at random from ids
// (all of them when n <= 0 or n is at least the number of distinct ids)
// with the source of truth: the standing, sampled assertion that the cache
// is honest (say 500 ids an hour).
// It reads through Peek, so it neither fills nor disturbs the cache, and it
// sees only what Get caches: an id cached by GetAt alone is NotCached (see
// CheckAt).
//
// Repair a divergence with Invalidate after the write that Check caught has
// committed (for one that skipped Invalidate, that is the missing call). A
// write between its commit and its own Invalidate is Divergent too, if
// Check looks in that moment: run Check again on the ids it reports before
// acting on them.
//
// Values are compared as Get would serve them: by their Codec encoding, and
// when encodings differ, decoded, with reflect.DeepEqual. So a value that
// holds a NaN float and whose encoding varies (a map under a gob Codec)
// compares unequal to itself, and counts as Divergent. A mismatch is confirmed by a
// second Peek and load; if the cached value changed in between (its version
// moved, or it was deleted or no longer decodes), the id counts as Moved, not
// Divergent, because a write was still settling. A cached value
// that does not decode counts as Undecodable; it is not an error. Check
// stops at the first Redis or loader error, or a value the Codec cannot
// encode, and returns the report so far (see CheckReport for how it counts
// the id that failed). During a Redis Cluster slot migration, its Peek of an
// id in that slot waits for the migration to end, within ctx (see Peek).
func (c *Cache[T]) Check(ctx context.Context, ids []string, n int, load IDLoader[T]) (CheckReport[T], error) {
	var report CheckReport[T]
	if c.notFromNew() {
		return report, errNotFromNew()
	}
	if load == nil {
		return report, ErrNilLoader
	}
	for _, id := range sample(ids, n) {
		if err := ctx.Err(); err != nil {
			return report, err
		}
		cached, version, ok, err := c.Peek(ctx, id)
		if err != nil && !errors.Is(err, ErrCodec) { // Peek only decodes
			return report, err
		}
		report.Sampled++
		if err != nil {
			report.Undecodable++
			continue
		}
		if !ok {
			report.NotCached++
			continue
		}
		report.Cached++
		_, same, err := c.compare(ctx, id, cached, load)
		if err != nil {
			return report, err
		}
		if same {
			continue
		}
		// Confirm: a write committed but not yet invalidated looks exactly
		// like a divergence for a moment.
		again, version2, ok, err := c.Peek(ctx, id)
		// A value that does not decode (ok is false) decoded a moment ago:
		// it was replaced, which makes it Moved like any other change.
		if err != nil && !errors.Is(err, ErrCodec) {
			return report, err
		}
		if !ok || version2 != version {
			report.Moved++
			continue
		}
		current, same, err := c.compare(ctx, id, again, load)
		if err != nil {
			return report, err
		}
		if !same {
			report.Divergent++
			report.Divergences = append(report.Divergences,
				Divergence[T]{ID: id, Version: version, Cached: again, Current: current})
		}
	}
	return report, nil
}

func (c *Cache[T]) compare(ctx context.Context, id string, cached T, load IDLoader[T]) (T, bool, error) {
	current, err := load(ctx, id)
	if err != nil {
		return current, false, &LoadError{ID: id, Err: err}
	}
	return c.sameValue(id, cached, current)
}

// sameValue reports whether cached equals current as Get would serve it,
// and returns current so.
func (c *Cache[T]) sameValue(id string, cached, current T) (T, bool, error) {
	a, err := c.marshal(cached)
	if err != nil {
		return current, false, &CodecError{Op: "encode", ID: id, Err: err}
	}
	// current as Get would cache and serve it.
	current, b, err := c.encode(id, current)
	if err != nil {
		return current, false, err
	}
	if bytes.Equal(a, b) {
		return current, true, nil
	}
	// Equal values may encode differently (map order under gob).
	return current, reflect.DeepEqual(cached, current), nil
}

// sample returns n distinct ids of ids in random order, or all of them
// (each once: an id listed twice is still one id).
func sample(ids []string, n int) []string {
	out := make([]string, 0, len(ids))
	seen := make(map[string]struct{}, len(ids))
	for _, id := range ids {
		if _, dup := seen[id]; !dup {
			seen[id] = struct{}{}
			out = append(out, id)
		}
	}
	if n <= 0 || n >= len(out) {
		return out
	}
	for i := 0; i < n; i++ {
		j := i + rand.IntN(len(out)-i)
		out[i], out[j] = out[j], out[i]
	}
	return out[:n]
}

// VersionedIDLoader loads the current value of one id from the source of
// truth together with the version GetAt callers pass for it (a row_version
// column, say), for CheckAt.
type VersionedIDLoader[T any] func(ctx context.Context, id string) (T, int64, error)

// CheckAt is Check for the values GetAt caches, and looks for GetAt's trap:
// a write that changed a row without moving its version, which leaves the
// old value cached under a version that still looks current. For each id
// whose cached version is at or above the source's (GetAt at the source's
// version would serve it) it compares the two values; a mismatch seen
// twice, with neither version moving in between, is Divergent. A cached
// version above the source's is served too: a version that went backwards
// (a row deleted and re-created, a restore, a clock stepped back) is a
// trap of its own.
//
// An id cached under an older version than the source's is NotCached: a
// GetAt at the source's version misses it. One whose versions move during
// the confirmation (a write in flight) is Moved. Cached values that do not
// decode are Undecodable. It reads GetAt's values (P{id}:a) only, without
// filling, like Check, and stops at the first Redis or loader error, or a
// source value the Codec cannot encode, returning the report so far (see
// CheckReport).
//
// Repair a divergence with Invalidate, which deletes the GetAt value; GetAt
// then loads again, even at the same version. A GetAt load that read the
// row before the fix and stores after the Invalidate can still bring the
// old value back under that version (see Invalidate): run CheckAt again to
// confirm, and move the row's version with the fix to rule it out.
func (c *Cache[T]) CheckAt(ctx context.Context, ids []string, n int, load VersionedIDLoader[T]) (CheckReport[T], error) {
	var report CheckReport[T]
	if c.notFromNew() {
		return report, errNotFromNew()
	}
	if load == nil {
		return report, ErrNilLoader
	}
	for _, id := range sample(ids, n) {
		if err := ctx.Err(); err != nil {
			return report, err
		}
		cached, version, state, err := c.peekAt(ctx, id)
		if err != nil {
			return report, err
		}
		if state != atCached {
			report.Sampled++
			if state == atUndecodable {
				report.Undecodable++
			} else {
				report.NotCached++
			}
			continue
		}
		current, currentVersion, err := load(ctx, id)
		if err != nil {
			return report, &LoadError{ID: id, Err: err}
		}
		report.Sampled++
		if version < currentVersion {
			report.NotCached++
			continue
		}
		report.Cached++
		_, same, err := c.sameValue(id, cached, current)
		if err != nil {
			return report, err
		}
		if same {
			continue
		}
		// Confirm, as Check does: a write in flight looks like this too.
		again, version2, state, err := c.peekAt(ctx, id)
		if err != nil {
			return report, err
		}
		current2, currentVersion2, err := load(ctx, id)
		if err != nil {
			return report, &LoadError{ID: id, Err: err}
		}
		if state != atCached || version2 != version || currentVersion2 != currentVersion {
			report.Moved++
			continue
		}
		current2, same, err = c.sameValue(id, again, current2)
		if err != nil {
			return report, err
		}
		if !same {
			report.Divergent++
			report.Divergences = append(report.Divergences,
				Divergence[T]{ID: id, Version: version, Cached: again, Current: current2})
		}
	}
	return report, nil
}

// What peekAt found under an id's GetAt key.
const (
	atNotCached = iota
	atCached
	atUndecodable
)

// peekAt reads the value GetAt cached for id, without filling.
func (c *Cache[T]) peekAt(ctx context.Context, id string) (val T, version int64, state int, err error) {
	data, err := c.getPastLocalCache(ctx, c.atKey(id))
	switch {
	case errors.Is(err, redis.Nil):
		return val, 0, atNotCached, nil
	case err != nil:
		if cerr := c.gaveUp(ctx, err); cerr != nil {
			return val, 0, 0, cerr
		}
		c.redisFailed(ctx, err)
		return val, 0, 0, &RedisError{Op: "peek", ID: id, Err: err}
	}
	version, payload, err := splitVersioned(data)
	if err != nil {
		c.stats.decodeErrors.Add(1) // as Peek counts one
		return val, 0, atUndecodable, nil
	}
	if val, err = c.decode(payload); err != nil {
		c.stats.decodeErrors.Add(1)
		return val, version, atUndecodable, nil
	}
	return val, version, atCached, nil
}
