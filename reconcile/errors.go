package reconcile

import (
	"errors"
	"fmt"
	"strings"

	"github.com/verity-go/verity/projection"
)

// Sentinel errors. The typed errors below match them with errors.Is and carry
// details for errors.As.
var (
	// ErrInvalidConfig: a Config, SQLSourceConfig, Target or RunOptions
	// field is out of range, New's source or NewSQLSource's db is nil, or
	// a Reconciler or SQLSource was not made by New or NewSQLSource (a
	// zero value, or nil). The error names the field (or the type).
	ErrInvalidConfig = errors.New("reconcile: invalid configuration")
	// ErrInvalidRow: the source produced a row the projection cannot hold
	// (a version that is not positive, a NULL column, a score outside ±2^53),
	// or an SQLSource over a SQL_ASCII database was asked to look up a key
	// that is not UTF-8, which its session's client_encoding cannot send.
	// The pass stops there rather than guess.
	ErrInvalidRow = errors.New("reconcile: invalid source row")
	// ErrRebuildInProgress: Rebuild found another rebuild's marker on the
	// collection. Wait for it to finish (or for its marker TTL to expire).
	ErrRebuildInProgress = errors.New("reconcile: a rebuild of this collection is already running (or one was killed: its marker expires within Config.RebuildMarkerTTL)")
	// ErrRebuildAborted: the rebuild did not switch because its shadow keys
	// cannot be trusted: it lost its marker before the switch (its TTL
	// expired, or someone deleted it), so the gate may have stopped
	// dual-writing into the shadow keys; or Redis lost some of the copy's
	// writes while keeping the marker (a failover to a replica that had not
	// received them, a restart from a snapshot taken during the copy), so
	// the shadow keys lack rows. The live projection was left untouched;
	// run Rebuild again (after a Redis loss, once Redis is stable).
	ErrRebuildAborted = errors.New("reconcile: rebuild aborted before the switch; live projection untouched")
	// ErrRebuildUncertain: the rebuild's switch was sent but its reply was
	// lost (a timeout, a dropped connection), so it may or may not have
	// happened; RebuildReport.Switched is false either way. The marker and
	// shadow keys were removed, which is harmless after a switch. Either the
	// rebuilt or the old projection is live, whole; run Rebuild again, or Run
	// to see what drift is left.
	ErrRebuildUncertain = errors.New("reconcile: the rebuild's switch reply was lost; the switch may have happened")
	// ErrRebuildUnsupported: Rebuild was asked to rebuild documents. Each
	// document lives in its own slot, so there is no single key set to
	// switch atomically; Run repairs documents one by one instead.
	ErrRebuildUnsupported = errors.New("reconcile: rebuild supports sorted-set and hash targets only")
	// ErrUnexpectedReply: Redis answered a script or command with a reply
	// this package does not understand.
	ErrUnexpectedReply = errors.New("reconcile: unexpected reply from redis")
)

// ConfigError reports an invalid configuration field.
type ConfigError struct {
	Field  string // for example "Config.PageSize"
	Reason string // what is wrong and how to fix it
}

func (e *ConfigError) Error() string {
	return fmt.Sprintf("reconcile: %s: %s", e.Field, e.Reason)
}

// Is matches ErrInvalidConfig.
func (e *ConfigError) Is(target error) bool { return target == ErrInvalidConfig }

// InvalidRowError reports a source row that cannot be projected.
type InvalidRowError struct {
	Key    string
	Reason string
}

func (e *InvalidRowError) Error() string {
	return fmt.Sprintf("reconcile: source row %q: %s", e.Key, e.Reason)
}

// Is matches ErrInvalidRow.
func (e *InvalidRowError) Is(target error) bool { return target == ErrInvalidRow }

// WrongKeyTypeError reports a repair refused because a Redis key it needs
// holds another type than the projection keeps there (a hand edit, or
// another program's key under the projection's prefix). Nothing was
// written for it, its finding is ResultNotAttempted, and the run went on:
// Run and CheckKeys return one such error per refusal, joined, once they
// are done. Delete the key by hand (the next run then repairs the entity
// from the source), or, for a collection, Rebuild. A document's key of
// another type is never replaced either: when the document reads as
// missing or stale, its repair goes through the gate, which refuses such a
// key too (see Keys of another type in the package documentation). It
// matches projection.ErrWrongKeyType.
type WrongKeyTypeError struct {
	Key      string // the entity: sorted-set member, hash field or document id
	RedisKey string // the key holding another type
	Type     string // the type it holds, as Redis's TYPE names it ("hash")
}

func (e *WrongKeyTypeError) Error() string {
	return fmt.Sprintf("reconcile: repair of %q refused: redis key %q holds a %s, not what the projection keeps there; delete it by hand", e.Key, e.RedisKey, e.Type)
}

// Is matches projection.ErrWrongKeyType.
func (e *WrongKeyTypeError) Is(target error) bool { return target == projection.ErrWrongKeyType }

// wrapError is what wrap returns: fmt.Errorf("reconcile: <op>: %w", err),
// except that an err that already starts with "reconcile: " (one of the
// package's own: an SQLSource's, ErrUnexpectedReply...) is not prefixed
// twice.
type wrapError struct {
	op  string
	err error
}

// wrap wraps err, which may be the package's own, as "reconcile: op: "
// and err's text.
func wrap(op string, err error) error { return &wrapError{op: op, err: err} }

func (e *wrapError) Error() string {
	// fmt, not e.err.Error(): a typed-nil error whose Error dereferences
	// its receiver prints "<nil>" rather than panicking.
	return "reconcile: " + e.op + ": " + strings.TrimPrefix(fmt.Sprint(e.err), "reconcile: ")
}

func (e *wrapError) Unwrap() error { return e.err }
