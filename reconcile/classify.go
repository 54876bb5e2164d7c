package reconcile

import (
	"bytes"
	"encoding/json"
	"math"
	"strconv"

	"github.com/verity-go/verity/projection"
)

// Class is the verdict on one entity after comparing the source with the
// projection.
type Class uint8

const (
	// ClassCurrent means the projection holds the source's version and value.
	ClassCurrent Class = iota + 1
	// ClassMissing means the projection holds neither value nor version for a
	// source row (a lost key, an expired cache, a write never projected).
	ClassMissing
	// ClassStale means the projected version is lower than the source's (the
	// outbox is lagging, or an update was lost).
	ClassStale
	// ClassAhead means the projected version is higher than the source's.
	// Redis should never know more than the source of truth, so a lagging
	// replica was read, the wrong database was queried, or the projection
	// holds invented state. Alert, investigate, and repair only on purpose.
	ClassAhead
	// ClassCorrupt means the projection holds the source's version with a
	// different value, or with no value at all; or a value without a version;
	// or a version that is not a canonical positive decimal. A version without
	// a value that is lower or higher than the source's is ClassStale or
	// ClassAhead instead: versions are compared before values. Hand edits and
	// buggy writers end up here.
	ClassCorrupt
	// ClassOrphan means the projection holds an entity the source does not
	// have (deleted in the source, or never there).
	ClassOrphan
)

// Classes lists every Class in order, for iterating over Report counts.
var Classes = []Class{ClassCurrent, ClassMissing, ClassStale, ClassAhead, ClassCorrupt, ClassOrphan}

var classNames = [...]string{
	ClassCurrent: "current", ClassMissing: "missing", ClassStale: "stale",
	ClassAhead: "ahead", ClassCorrupt: "corrupt", ClassOrphan: "orphan",
}

// String returns "current", "missing", "stale", "ahead", "corrupt", "orphan"
// or "class(N)".
func (c Class) String() string {
	if int(c) < len(classNames) && classNames[c] != "" {
		return classNames[c]
	}
	return "class(" + strconv.Itoa(int(c)) + ")"
}

// MarshalText makes classes readable as JSON map keys.
func (c Class) MarshalText() ([]byte, error) { return []byte(c.String()), nil }

// Projected is what the projection holds for one entity, as read from Redis.
type Projected struct {
	// HasValue reports whether the value (sorted-set member, hash field or
	// document string) exists.
	HasValue bool
	// Score is the stored sorted-set score (KindSortedSet).
	Score float64
	// Data is the stored hash field or document (KindHash, KindDocument).
	Data []byte
	// HasVersion reports whether a version is stored.
	HasVersion bool
	// RawVersion is the stored version verbatim. Repairs compare against it,
	// so even an unparsable version is matched exactly.
	RawVersion string
	// Version is RawVersion parsed; meaningful only when VersionOK.
	Version int64
	// VersionOK reports that RawVersion is a canonical positive decimal
	// int64, the only form the gate writes.
	VersionOK bool
}

// MarshalJSON writes a Score that is not a finite number (a hand-set +inf,
// just what a pass exists to find) as the string "+Inf", "-Inf" or "NaN":
// JSON has no such numbers, and a report that found one must still encode.
func (p Projected) MarshalJSON() ([]byte, error) {
	type plain Projected // without this method
	out := struct {
		plain
		Score any
	}{plain(p), p.Score}
	if math.IsInf(p.Score, 0) || math.IsNaN(p.Score) {
		out.Score = strconv.FormatFloat(p.Score, 'g', -1, 64)
	}
	return json.Marshal(out)
}

// parseVersion fills the version fields from a stored string.
func (p *Projected) parseVersion(raw string) {
	p.HasVersion = true
	p.RawVersion = raw
	v, err := strconv.ParseInt(raw, 10, 64)
	p.Version = v
	p.VersionOK = err == nil && v > 0 && strconv.FormatInt(v, 10) == raw
}

// Classify compares a source row with what the projection holds for it. A
// nil row means the entity is not in the source: the result is ClassOrphan
// if anything is projected for it, ClassCurrent otherwise.
//
// Versions are compared before values: a projection one version behind is
// stale even if its value happens to match.
func Classify(kind projection.Kind, row *Row, p Projected) Class {
	if row == nil {
		if p.HasValue || p.HasVersion {
			return ClassOrphan
		}
		return ClassCurrent
	}
	switch {
	case !p.HasValue && !p.HasVersion:
		return ClassMissing
	case !p.HasVersion || !p.VersionOK:
		return ClassCorrupt
	case p.Version < row.Version:
		return ClassStale
	case p.Version > row.Version:
		return ClassAhead
	case !p.HasValue || !valueEqual(kind, row.Value, p):
		return ClassCorrupt
	}
	return ClassCurrent
}

func valueEqual(kind projection.Kind, v projection.Value, p Projected) bool {
	if kind == projection.KindSortedSet {
		// |Score| <= 2^53, so the conversion is exact; a fractional or
		// out-of-range stored score can never compare equal.
		return p.Score == float64(v.Score)
	}
	return bytes.Equal(p.Data, v.Data)
}
