package projection

import (
	"fmt"
	"strings"

	"github.com/verity-go/verity/internal/keyenc"
)

// Key suffixes. Every kind has its own value and version keys, so a sorted
// set and a hash that happen to share a Name never share versions.
const (
	suffixSortedSet        = ":z"
	suffixSortedSetVersion = ":zv"
	suffixHash             = ":h"
	suffixHashVersion      = ":hv"
	suffixDocument         = ":d"
	suffixDocumentVersion  = ":dv"
	suffixShadow           = "~r"
	suffixRebuild          = "~rebuild"
)

// Keyspace names the Redis keys of a projection. It is a small value type;
// copy it freely. Reconcile and readers use it to find what the gate wrote.
//
// For a collection (sorted set or hash) named N and prefix P, with
// T = "{" + keyenc.Escape(N) + "}" (empty N is written "{%}"):
//
//	sorted set  values P T:z   ZSET  member → score
//	            versions P T:zv HASH member → decimal int64
//	hash        values P T:h   HASH  field → bytes
//	            versions P T:hv HASH field → decimal int64
//	rebuild     marker P T:z~rebuild / P T:h~rebuild (exists while a rebuild runs)
//	            shadows P T:z~r, P T:zv~r / P T:h~r, P T:hv~r
//
// For a document with id D, T = "{" + keyenc.Escape(D) + "}":
//
//	document    value P T:d   STRING the document bytes
//	            version P T:dv STRING decimal int64
//
// All keys of one collection, and both keys of one document, share the hash
// tag T and therefore one Redis Cluster slot. Escape is injective and never
// emits '{', '}' or ':', so no Name can move a key to another slot or make
// two targets share a key.
type Keyspace struct {
	prefix string
}

// NewKeyspace returns the Keyspace for prefix. The prefix may be empty; it
// must not contain '{' or '}' (it would become the hash tag).
func NewKeyspace(prefix string) (Keyspace, error) {
	if err := keyenc.ValidatePrefix(prefix); err != nil {
		return Keyspace{}, fmt.Errorf("projection: prefix %q: %v", prefix, err)
	}
	return Keyspace{prefix: prefix}, nil
}

// Prefix returns the key prefix.
func (ks Keyspace) Prefix() string { return ks.prefix }

func (ks Keyspace) key(name, suffix string) string { return keyenc.Tagged(ks.prefix, name, suffix) }

// ValueKey returns the key holding t's value: the sorted set, the hash, or
// the document string. It returns "" for an invalid Kind.
func (ks Keyspace) ValueKey(t Target) string {
	switch t.Kind {
	case KindSortedSet:
		return ks.key(t.Name, suffixSortedSet)
	case KindHash:
		return ks.key(t.Name, suffixHash)
	case KindDocument:
		return ks.key(t.Name, suffixDocument)
	}
	return ""
}

// VersionKey returns the key holding t's version: a hash keyed by member for
// collections, a string for documents. It returns "" for an invalid Kind.
func (ks Keyspace) VersionKey(t Target) string {
	switch t.Kind {
	case KindSortedSet:
		return ks.key(t.Name, suffixSortedSetVersion)
	case KindHash:
		return ks.key(t.Name, suffixHashVersion)
	case KindDocument:
		return ks.key(t.Name, suffixDocumentVersion)
	}
	return ""
}

// RebuildMarkerKey returns the key whose existence makes the gate also
// write collection (name, kind) into its shadow keys. A rebuild sets it
// (with a TTL, so a crashed rebuild stops the dual writes), fills the shadow
// keys, and then swaps shadows and live keys atomically. It returns "" for
// kinds other than KindSortedSet and KindHash.
func (ks Keyspace) RebuildMarkerKey(name string, kind Kind) string {
	if !kind.isCollection() {
		return ""
	}
	return ks.ValueKey(Target{Kind: kind, Name: name}) + suffixRebuild
}

// ShadowValueKey returns the shadow of ValueKey for collection (name, kind),
// or "" for kinds other than KindSortedSet and KindHash.
func (ks Keyspace) ShadowValueKey(name string, kind Kind) string {
	if !kind.isCollection() {
		return ""
	}
	return ks.ValueKey(Target{Kind: kind, Name: name}) + suffixShadow
}

// ShadowVersionKey returns the shadow of VersionKey for collection
// (name, kind), or "" for kinds other than KindSortedSet and KindHash.
func (ks Keyspace) ShadowVersionKey(name string, kind Kind) string {
	if !kind.isCollection() {
		return ""
	}
	return ks.VersionKey(Target{Kind: kind, Name: name}) + suffixShadow
}

// HashTag returns the hash tag shared by every key of t's collection or
// document, braces included.
func (ks Keyspace) HashTag(t Target) string { return keyenc.Tagged("", t.Name, "") }

// Slot returns the Redis Cluster slot of every key of t.
func (ks Keyspace) Slot(t Target) int { return KeySlot(ks.HashTag(t)) }

// SlotCount is the number of Redis Cluster hash slots.
const SlotCount = 16384

// KeySlot returns the Redis Cluster hash slot of key, exactly as CLUSTER
// KEYSLOT computes it: CRC16 (XMODEM) of the hash tag — the bytes between
// the first '{' and the next '}' when that span is non-empty — or of the
// whole key otherwise, modulo 16384.
func KeySlot(key string) int {
	if open := strings.IndexByte(key, '{'); open >= 0 {
		if n := strings.IndexByte(key[open+1:], '}'); n > 0 {
			key = key[open+1 : open+1+n]
		}
	}
	return int(crc16(key) % SlotCount)
}

// crc16 is CRC-16/XMODEM (polynomial 0x1021, initial value 0), the checksum
// Redis Cluster uses for key slots.
func crc16(s string) uint16 {
	var crc uint16
	for i := 0; i < len(s); i++ {
		crc ^= uint16(s[i]) << 8
		for b := 0; b < 8; b++ {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc
}
