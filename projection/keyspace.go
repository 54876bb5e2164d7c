package projection

import (
	"fmt"
	"strconv"
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
	suffixRebuildCopied    = "~rebuild~copied"
	suffixLayout           = "~layout"
	// bucketSeparator starts a version bucket's number: P T:zv:17.
	bucketSeparator = ":"
)

// VersionBucketsMax bounds Keyspace.WithVersionBuckets and
// Config.VersionBuckets: at 64 members per bucket it covers about four
// million members. Rebuild passes every bucket key of the old and new
// layouts to one switch script, so the bound also caps that script's size.
const VersionBucketsMax = 1 << 16

// Keyspace names the Redis keys of a projection. It is a small value type;
// copy it freely. Reconcile and readers use it to find what the gate wrote.
//
// For a collection (sorted set or hash) named N and prefix P, with
// T = "{" + keyenc.Escape(N) + "}" (empty N is written "{%}"):
//
//	sorted set  values P T:z   ZSET  member → score
//	            versions P T:zv HASH member → decimal int64
//	            (with B version buckets: P T:zv:0 … P T:zv:<B-1>, one HASH each)
//	hash        values P T:h   HASH  field → bytes
//	            versions P T:hv HASH field → decimal int64
//	            (with B version buckets: P T:hv:0 … P T:hv:<B-1>)
//	layout      P T:z~layout / P T:h~layout  STRING decimal B, 0 included
//	rebuild     marker P T:z~rebuild / P T:h~rebuild (exists while a rebuild runs)
//	            copy count P T:z~rebuild~copied / P T:h~rebuild~copied  HASH
//	            (what the rebuild's copy wrote; see RebuildCopyKey)
//	            shadows: "~r" appended to the value, version (every bucket)
//	            and layout keys: P T:z~r, P T:zv~r or P T:zv:<b>~r, P T:z~layout~r
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
//
// # Version buckets
//
// By default a collection keeps every member's version in one hash. Past
// 128 entries (Redis's hash-max-listpack-entries) Redis converts that hash
// to a hashtable, which costs about 58 bytes per member. WithVersionBuckets
// spreads the versions over B small hashes instead; while each holds at most
// 128 entries of at most 64 bytes (hash-max-listpack-value) Redis keeps it
// as a compact listpack, about 20 bytes per member. Pick B ≈ expected
// members / 64, which leaves room to grow to twice that before buckets
// outgrow the listpack limit (they stay correct then, only larger).
//
// A member's bucket is FNV-1a (32-bit) of its bytes modulo B — stable
// across processes and versions of this package. Buckets share the
// collection's hash tag, so a collection still lives in one Cluster slot
// and the gate still updates it in one script call.
//
// The bucket count is part of the stored data: a version looked up in the
// wrong bucket would look absent and let a stale write through. The gate
// therefore records B, 0 included, in the collection's layout key on its
// first write and checks it in the same script that writes; a Keyspace
// with another B gets a *LayoutMismatchError and writes nothing. A
// collection written before layout keys were recorded (the unbucketed
// version hash, no layout key) has B = 0, which its next write records;
// values with neither are refused as a lost layout key (see the package
// documentation, "Version buckets (memory)"). To change B on a
// live collection, run reconcile's Rebuild with a Keyspace carrying the new
// B: it builds shadow keys in the new layout and switches versions, values
// and layout key in one script.
type Keyspace struct {
	prefix  string
	buckets int
	made    bool // by NewKeyspace: the zero Keyspace is no projector's
}

// IsZero reports whether ks is the zero Keyspace, which no projector writes
// with (even a projector with an empty prefix has one from NewKeyspace):
// code that takes a Keyspace from its caller refuses it.
func (ks Keyspace) IsZero() bool { return !ks.made }

// NewKeyspace returns the Keyspace for prefix, with one version hash per
// collection (no version buckets). The prefix may be empty; it must not
// contain '{' or '}' (it would become the hash tag).
func NewKeyspace(prefix string) (Keyspace, error) {
	if err := keyenc.ValidatePrefix(prefix); err != nil {
		return Keyspace{}, &ConfigError{Field: "prefix", Reason: fmt.Sprintf("%q: %v", prefix, err)}
	}
	return Keyspace{prefix: prefix, made: true}, nil
}

// WithVersionBuckets returns a copy of ks that spreads each collection's
// versions over n hashes (see "Version buckets" above); 0 keeps one hash
// per collection. n must lie within [0, VersionBucketsMax], otherwise a
// *ConfigError is returned. Every writer and reader of a collection must
// use the same n; the gate refuses a mismatch with *LayoutMismatchError.
func (ks Keyspace) WithVersionBuckets(n int) (Keyspace, error) {
	if err := validateBuckets("VersionBuckets", n); err != nil {
		return Keyspace{}, err
	}
	ks.buckets = n
	return ks, nil
}

func validateBuckets(field string, n int) error {
	if n < 0 || n > VersionBucketsMax {
		return &ConfigError{Field: field, Reason: fmt.Sprintf("%d must be between 0 (one version hash per collection) and %d; use about expected members / 64", n, VersionBucketsMax)}
	}
	return nil
}

// VersionBuckets returns the number of version hashes per collection; 0
// means one unbucketed hash.
func (ks Keyspace) VersionBuckets() int { return ks.buckets }

// Prefix returns the key prefix.
func (ks Keyspace) Prefix() string { return ks.prefix }

// MaxKeyLen bounds the length of every Redis key the gate (or a rebuild)
// makes for a collection or document name: the prefix, the name escaped
// inside the hash tag's braces (an empty name as "%"), and the longest
// suffix of any kind (":z~rebuild~copied"; a document's own keys are up to
// 14 bytes shorter). A RedisProjector refuses a record whose MaxKeyLen is over
// Config.MaxValueBytes, which Redis would refuse by closing the connection.
func (ks Keyspace) MaxKeyLen(name string) int {
	return keyenc.TaggedLen(ks.prefix, name, suffixSortedSet+suffixRebuildCopied)
}

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

// VersionKey returns the key holding t's version: for a collection, the
// hash holding t.Member's version (its bucket when the Keyspace has
// version buckets, the collection's one version hash otherwise); for a
// document, a string. It returns "" for an invalid Kind. Use VersionKeys for
// every version key of a collection.
func (ks Keyspace) VersionKey(t Target) string {
	switch t.Kind {
	case KindSortedSet, KindHash:
		return ks.versionKey(t.Name, t.Kind, ks.VersionBucket(t.Member))
	case KindDocument:
		return ks.key(t.Name, suffixDocumentVersion)
	}
	return ""
}

// versionKey returns the version hash of bucket b of a collection (the
// unbucketed hash when ks has no buckets).
func (ks Keyspace) versionKey(name string, kind Kind, b int) string {
	suffix := suffixSortedSetVersion
	if kind == KindHash {
		suffix = suffixHashVersion
	}
	if ks.buckets == 0 {
		return ks.key(name, suffix)
	}
	return ks.key(name, suffix+bucketSeparator+strconv.Itoa(b))
}

// unbucketedVersionKey is the version hash of a collection without
// buckets, whatever ks's bucket count.
func (ks Keyspace) unbucketedVersionKey(name string, kind Kind) string {
	return Keyspace{prefix: ks.prefix}.versionKey(name, kind, 0)
}

// VersionBucket returns the bucket holding member's version: FNV-1a (32-bit)
// of member's bytes modulo VersionBuckets, or 0 without buckets.
func (ks Keyspace) VersionBucket(member string) int {
	if ks.buckets == 0 {
		return 0
	}
	h := uint32(2166136261)
	for i := 0; i < len(member); i++ {
		h ^= uint32(member[i])
		h *= 16777619
	}
	return int(h % uint32(ks.buckets))
}

// VersionKeys returns every version key of collection (name, kind), in
// bucket order: VersionBuckets keys, or the one version hash without
// buckets. It returns nil for kinds other than KindSortedSet and KindHash.
func (ks Keyspace) VersionKeys(name string, kind Kind) []string {
	if !kind.isCollection() {
		return nil
	}
	keys := make([]string, max(ks.buckets, 1))
	for b := range keys {
		keys[b] = ks.versionKey(name, kind, b)
	}
	return keys
}

// ShadowVersionKeys returns the shadows of VersionKeys(name, kind), in the
// same order, or nil for kinds other than KindSortedSet and KindHash.
func (ks Keyspace) ShadowVersionKeys(name string, kind Kind) []string {
	keys := ks.VersionKeys(name, kind)
	for i := range keys {
		keys[i] += suffixShadow
	}
	return keys
}

// LayoutKey returns the key recording collection (name, kind)'s version
// bucket count (see "Version buckets"), or "" for kinds other than
// KindSortedSet and KindHash. The gate writes it, 0 included, on the first
// write into a collection without one.
func (ks Keyspace) LayoutKey(name string, kind Kind) string {
	if !kind.isCollection() {
		return ""
	}
	return ks.ValueKey(Target{Kind: kind, Name: name}) + suffixLayout
}

// ShadowLayoutKey returns the shadow of LayoutKey: the bucket count of a
// running rebuild's shadow keys. Rebuild sets it with the marker.
func (ks Keyspace) ShadowLayoutKey(name string, kind Kind) string {
	if !kind.isCollection() {
		return ""
	}
	return ks.LayoutKey(name, kind) + suffixShadow
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

// RebuildCopyKey returns the key counting what a rebuild's copy wrote into
// collection (name, kind)'s shadow keys, or "" for kinds other than
// KindSortedSet and KindHash: a HASH whose field "rows" counts the writes
// of every batch Gate.ApplyShadowCopy sent, and "batch" the number of the
// last batch counted. The count changes in the script that writes its
// rows, so Redis cannot keep one without the other (a failover to a
// lagging replica, a restart from an older snapshot): the rebuild's switch
// compares it with the rows it sent and refuses a shadow that lost some.
// The rebuild clears it with the marker and removes it at its end.
func (ks Keyspace) RebuildCopyKey(name string, kind Kind) string {
	if !kind.isCollection() {
		return ""
	}
	return ks.ValueKey(Target{Kind: kind, Name: name}) + suffixRebuildCopied
}

// ShadowValueKey returns the shadow of ValueKey for collection (name, kind),
// or "" for kinds other than KindSortedSet and KindHash.
func (ks Keyspace) ShadowValueKey(name string, kind Kind) string {
	if !kind.isCollection() {
		return ""
	}
	return ks.ValueKey(Target{Kind: kind, Name: name}) + suffixShadow
}

// ShadowVersionKey returns the shadow of VersionKey(Target{Kind: kind,
// Name: name}) — the shadow of the one version hash, or with version
// buckets of the bucket holding the empty member — or "" for kinds other
// than KindSortedSet and KindHash. ShadowVersionKeys returns every bucket's.
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
