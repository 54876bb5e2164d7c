package projection

import (
	"context"
	"fmt"

	"github.com/verity-go/verity/outbox"
)

// Kind selects the Redis data structure a Target is projected into.
type Kind uint8

const (
	// KindSortedSet projects an integer score for Target.Member into the
	// sorted set named by Target.Name (a leaderboard, a ranking).
	KindSortedSet Kind = iota + 1
	// KindHash projects bytes for the field Target.Member of the hash named
	// by Target.Name.
	KindHash
	// KindDocument projects bytes into one string key per document; the
	// document id is Target.Name and Target.Member must be empty.
	KindDocument
)

// String returns "sorted-set", "hash", "document" or "kind(N)".
func (k Kind) String() string {
	switch k {
	case KindSortedSet:
		return "sorted-set"
	case KindHash:
		return "hash"
	case KindDocument:
		return "document"
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// isCollection reports whether many targets share the keys of one Name.
func (k Kind) isCollection() bool { return k == KindSortedSet || k == KindHash }

// Target says where one entity is projected. Name and Member are arbitrary
// byte strings (braces, colons, newlines and invalid UTF-8 included); the
// Keyspace encodes them so that they can neither change a key's Redis
// Cluster slot nor collide with another target.
type Target struct {
	// Kind is the data structure. The zero Kind is invalid.
	Kind Kind
	// Name is the collection (sorted set or hash) the member belongs to, or
	// the document id for KindDocument. All keys of one Name share a hash
	// tag, so one collection lives in one Redis Cluster slot.
	Name string
	// Member is the sorted-set member or hash field, stored verbatim. It
	// must be empty for KindDocument.
	Member string
}

// String renders the target for logs and error messages.
func (t Target) String() string {
	if t.Kind == KindDocument {
		return fmt.Sprintf("%s %q", t.Kind, t.Name)
	}
	return fmt.Sprintf("%s %q member %q", t.Kind, t.Name, t.Member)
}

// Value is the absolute state written for a Target.
type Value struct {
	// Score is the sorted-set score (KindSortedSet only). Redis stores
	// scores as IEEE-754 doubles, so it must lie within [MinScore, MaxScore]
	// where every integer is exact; anything else is refused with a
	// *ScoreOutOfRangeError rather than silently rounded.
	Score int64
	// Data is the hash field value or document body (KindHash and
	// KindDocument). It is stored verbatim; nil is stored as empty.
	Data []byte
}

// MaxScore and MinScore bound Value.Score: ±2^53, the range in which a
// double represents every integer exactly.
const (
	MaxScore int64 = 1 << 53
	MinScore int64 = -(1 << 53)
)

// Write is one gated projection write: set Target to Value as of Version.
type Write struct {
	// Target is where the value goes.
	Target Target
	// Version is the entity's version in the source of truth. It must be
	// positive and strictly increase with every change of the entity; the
	// gate applies a write only if Version is above the stored version.
	Version int64
	// Value is the absolute state at Version.
	Value Value
	// Ref is not used by this package; callers may carry their own
	// correlation data through it.
	Ref any
}

// Outcome is the gate's verdict on one Write.
type Outcome uint8

const (
	// OutcomeUnknown is the zero Outcome: the write was not decided (it
	// appears only next to a non-nil error).
	OutcomeUnknown Outcome = iota
	// OutcomeApplied means the stored version was absent or lower; value
	// and version were written.
	OutcomeApplied
	// OutcomeDuplicate means the stored version equals the write's, and
	// the value stored with it too (or none is stored): the same state was
	// applied before (a redelivery). Nothing was written.
	OutcomeDuplicate
	// OutcomeStale means the stored version is higher: a newer state was
	// applied already (out-of-order delivery). Nothing was written.
	OutcomeStale
	// OutcomeConflict means the stored version equals the write's but the
	// value stored with it differs (a score as a number, other values
	// byte for byte): two states claim one version. That breaks the
	// contract a Mapper and its source keep (one version, one state), so
	// it is never a redelivery: a source that reused a version, a Mapper
	// whose output changed for a record already projected, or a value
	// edited in Redis by hand since it was applied. Nothing was written to
	// the live keys (during a rebuild, the shadow keys take the write as
	// they would a duplicate's): the stored state stays until a newer
	// version, or the reconciler, replaces it (a source holding another
	// state at that version makes the entity corrupt, which reconcile
	// repairs by default). Gate callers get the outcome; RedisProjector
	// also logs it and counts it in its metrics. Handle reports no error for it, so the relay
	// acknowledges the record: delivering it again cannot change the
	// verdict. A version stored without a value (the value was lost) is
	// OutcomeDuplicate, as before values were compared.
	OutcomeConflict
)

// String returns "applied", "duplicate", "stale", "conflict" or "unknown".
func (o Outcome) String() string {
	switch o {
	case OutcomeApplied:
		return "applied"
	case OutcomeDuplicate:
		return "duplicate"
	case OutcomeStale:
		return "stale"
	case OutcomeConflict:
		return "conflict"
	}
	return "unknown"
}

// Mapper turns an outbox record into the Write that projects it. It is how
// users project their own streams. A Mapper must be deterministic: a
// redelivered record must map to the same Write.
type Mapper interface {
	Map(rec outbox.Record) (Write, error)
}

// MapperFunc adapts a function to the Mapper interface.
type MapperFunc func(rec outbox.Record) (Write, error)

// Map calls f(rec).
func (f MapperFunc) Map(rec outbox.Record) (Write, error) { return f(rec) }

// Projector projects a batch of outbox records. It returns one Outcome per
// record, in order, or an error that fails the whole batch (nothing may be
// assumed about which records were written; redelivery is harmless).
type Projector interface {
	Project(ctx context.Context, batch []outbox.Record) ([]Outcome, error)
}

var _ Mapper = MapperFunc(nil)
