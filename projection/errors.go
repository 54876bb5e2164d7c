package projection

import (
	"errors"
	"fmt"
	"strings"
)

// Sentinel errors. The typed errors below match them with errors.Is and
// carry the details for errors.As.
var (
	// ErrInvalidVersion: a Write's version is zero or negative.
	ErrInvalidVersion = errors.New("projection: version must be positive")
	// ErrScoreOutOfRange: a sorted-set score lies outside [MinScore, MaxScore].
	ErrScoreOutOfRange = errors.New("projection: sorted-set score outside ±2^53")
	// ErrInvalidTarget: a Target has an unknown Kind, or a document target
	// has a Member, or a target is used where its Kind is not allowed.
	ErrInvalidTarget = errors.New("projection: invalid target")
	// ErrCorruptVersion: the version stored in Redis is not a positive
	// int64 in canonical decimal (no sign, no leading zero, at most
	// 9223372036854775807), so the gate cannot order the write against it.
	// The write is refused (never guessed); reconcile repairs such entries.
	ErrCorruptVersion = errors.New("projection: stored version is not a positive int64")
	// ErrUnexpectedReply: Redis answered the gate script (or INFO, for
	// CheckEvictionPolicy) with a reply this package does not understand
	// (a different script under the same SHA, or a proxy rewriting
	// replies).
	ErrUnexpectedReply = errors.New("projection: unexpected reply from gate script")
	// ErrUnmappedStream: a StreamMapper has no Mapper for a record's stream.
	ErrUnmappedStream = errors.New("projection: no mapper for stream")
	// ErrInvalidPayload: a built-in Mapper cannot read a record's payload.
	ErrInvalidPayload = errors.New("projection: invalid payload")
	// ErrInvalidConfig: a dependency or argument cannot be used — a Config
	// field or Keyspace option out of range, a nil client or Mapper, a
	// client that can wait for Redis forever, a Gate made with the zero
	// Keyspace, a shadow token or batch that ApplyShadow refuses — or a
	// method was called on a RedisProjector or Gate not made by its
	// constructor. The *ConfigError names the field.
	ErrInvalidConfig = errors.New("projection: invalid configuration")
	// ErrLayoutMismatch: a collection's stored version layout (its bucket
	// count, see Keyspace) differs from the Keyspace of the writer or
	// reader. Nothing was written to that collection: a version looked up
	// in the wrong bucket would look absent and let a stale write through.
	// Configure every writer and reader with the stored bucket count, or
	// migrate the collection with reconcile's Rebuild.
	ErrLayoutMismatch = errors.New("projection: collection's version layout differs from the keyspace's")
	// ErrShadowNotOwned is returned by ApplyShadow and ApplyShadowCopy when
	// the collection's
	// rebuild marker does not hold the caller's token: its rebuild ended
	// (the marker expired, or it was aborted) and the shadow keys may
	// belong to another rebuild now. Nothing was written to them.
	ErrShadowNotOwned = errors.New("projection: the rebuild that wrote these shadow keys no longer owns them")
	// ErrWrongKeyType: a key a write needs holds another Redis type than
	// the gate writes there (a hand edit, or another program's key under
	// the projection's prefix), and Redis refused the write (WRONGTYPE).
	// The write did not complete (while a rebuild runs, its live value may
	// be written and its shadow write refused); the key must be fixed or
	// removed by hand, after which the record's retry or reconcile
	// restores the target.
	ErrWrongKeyType = errors.New("projection: a key of the target holds another Redis type")
	// ErrEvictionPolicy: CheckEvictionPolicy found a Redis server with a
	// memory limit and an allkeys-* maxmemory-policy, which may evict the
	// gate's version keys. The *EvictionPolicyError names the server.
	ErrEvictionPolicy = errors.New("projection: redis may evict the gate's version keys")
)

// ConfigError reports an invalid configuration field.
type ConfigError struct {
	Field  string // for example "Config.VersionBuckets"
	Reason string // what is wrong and how to fix it
}

func (e *ConfigError) Error() string {
	return fmt.Sprintf("projection: %s: %s", e.Field, e.Reason)
}

// Is matches ErrInvalidConfig.
func (e *ConfigError) Is(target error) bool { return target == ErrInvalidConfig }

// LayoutMismatchError reports a collection whose stored version bucket
// count is not the one its writer or reader was configured with.
type LayoutMismatchError struct {
	Kind Kind
	Name string
	// Shadow is true when the mismatch is in a rebuild's shadow keys
	// (ApplyShadow with another count than the rebuild that owns them).
	Shadow bool
	// Stored is the collection's bucket count (0: one version hash, which
	// is also what a collection without a layout key but with the
	// unbucketed version hash has), or -1 when the layout is unreadable:
	// the layout key holds something else, or it is absent while the
	// collection holds values but no unbucketed version hash — a
	// collection that lost its layout key, whose bucket count is unknown.
	Stored int
	// Configured is the Keyspace's bucket count.
	Configured int
}

func (e *LayoutMismatchError) Error() string {
	which := "collection"
	if e.Shadow {
		which = "rebuild shadow of collection"
	}
	if e.Stored < 0 {
		return fmt.Sprintf("projection: %s %s %q has an unreadable version layout (its layout key holds no bucket count, or is missing while values exist without an unbucketed version hash), the keyspace uses %d buckets; nothing written (set the layout key to the true bucket count, or rebuild with reconcile's Rebuild)",
			which, e.Kind, e.Name, e.Configured)
	}
	return fmt.Sprintf("projection: %s %s %q stores versions in %d buckets, the keyspace in %d; nothing written (configure VersionBuckets = the stored count, or migrate with reconcile's Rebuild)",
		which, e.Kind, e.Name, e.Stored, e.Configured)
}

// Is matches ErrLayoutMismatch.
func (e *LayoutMismatchError) Is(target error) bool { return target == ErrLayoutMismatch }

// InvalidVersionError reports a Write whose Version is not positive.
type InvalidVersionError struct {
	Index   int // position of the write in the batch
	Target  Target
	Version int64
}

func (e *InvalidVersionError) Error() string {
	return fmt.Sprintf("projection: write %d (%s): version %d must be positive", e.Index, e.Target, e.Version)
}

// Is matches ErrInvalidVersion.
func (e *InvalidVersionError) Is(target error) bool { return target == ErrInvalidVersion }

// ScoreOutOfRangeError reports a sorted-set score that a Redis double
// cannot hold exactly.
type ScoreOutOfRangeError struct {
	Index  int // position of the write in the batch
	Target Target
	Score  int64
}

func (e *ScoreOutOfRangeError) Error() string {
	return fmt.Sprintf("projection: write %d (%s): score %d outside [%d, %d]", e.Index, e.Target, e.Score, MinScore, MaxScore)
}

// Is matches ErrScoreOutOfRange.
func (e *ScoreOutOfRangeError) Is(target error) bool { return target == ErrScoreOutOfRange }

// InvalidTargetError reports a malformed or misplaced Target.
type InvalidTargetError struct {
	Index  int // position of the write in the batch
	Target Target
	Reason string
}

func (e *InvalidTargetError) Error() string {
	return fmt.Sprintf("projection: write %d (%s): invalid target: %s", e.Index, e.Target, e.Reason)
}

// Is matches ErrInvalidTarget.
func (e *InvalidTargetError) Is(target error) bool { return target == ErrInvalidTarget }

// CorruptVersionError reports a write refused because the version stored
// for its target is unreadable: not a positive int64 in canonical decimal.
type CorruptVersionError struct {
	Index  int // position of the write in the batch
	Target Target
	Stored string // the stored version, verbatim
}

func (e *CorruptVersionError) Error() string {
	return fmt.Sprintf("projection: write %d (%s): stored version %q is not a positive int64 in canonical decimal", e.Index, e.Target, e.Stored)
}

// Is matches ErrCorruptVersion.
func (e *CorruptVersionError) Is(target error) bool { return target == ErrCorruptVersion }

// WrongKeyTypeError reports a write that Redis refused because a key of
// its target holds another type (WRONGTYPE). Handle reports it for that
// record only (see Gate.Apply for how it is isolated).
type WrongKeyTypeError struct {
	Index  int // position of the write in the batch
	Target Target
	Err    error // Redis's reply
}

func (e *WrongKeyTypeError) Error() string {
	return fmt.Sprintf("projection: write %d (%s): a key of the target holds another Redis type: %v", e.Index, e.Target, e.Err)
}

// Is matches ErrWrongKeyType.
func (e *WrongKeyTypeError) Is(target error) bool { return target == ErrWrongKeyType }

func (e *WrongKeyTypeError) Unwrap() error { return e.Err }

// MapError reports a record its Mapper could not map, or whose Write was
// invalid.
type MapError struct {
	Index    int   // position of the record in the batch
	RecordID int64 // outbox.Record.ID
	Stream   string
	Err      error
}

// Error names the package once: Err, usually one of the package's own
// errors (ErrUnmappedStream, ErrInvalidPayload, *InvalidVersionError...),
// follows without its "projection: ". The text is what a relay logs and
// stores as the row's last error.
func (e *MapError) Error() string {
	return fmt.Sprintf("projection: record %d (outbox id %d, stream %q): %s", e.Index, e.RecordID, e.Stream, unprefixed(e.Err))
}

func (e *MapError) Unwrap() error { return e.Err }

// validateWrite checks w before anything is sent to Redis.
func validateWrite(i int, w *Write) error {
	t := w.Target
	switch t.Kind {
	case KindSortedSet:
		if w.Value.Score < MinScore || w.Value.Score > MaxScore {
			return &ScoreOutOfRangeError{Index: i, Target: t, Score: w.Value.Score}
		}
	case KindHash:
	case KindDocument:
		if t.Member != "" {
			return &InvalidTargetError{Index: i, Target: t, Reason: "a document target must have an empty Member"}
		}
	default:
		return &InvalidTargetError{Index: i, Target: t, Reason: "unknown Kind; use KindSortedSet, KindHash or KindDocument"}
	}
	if w.Version <= 0 {
		return &InvalidVersionError{Index: i, Target: t, Version: w.Version}
	}
	return nil
}

// unprefixed returns err's text without the package's "projection: ", for
// an error that wraps it and says "projection: " itself. fmt formats err,
// not err.Error(): a Mapper's typed-nil error whose Error dereferences its
// receiver prints "<nil>" rather than panicking in the relay.
func unprefixed(err error) string {
	return strings.TrimPrefix(fmt.Sprint(err), "projection: ")
}
