// Package keyenc encodes user-supplied identifiers into Redis key material
// that is safe for Redis Cluster.
//
// Redis Cluster routes a key by the CRC16 of its hash tag: the bytes between
// the first '{' and the next '}'. A user id that contains a brace could
// otherwise move a key to another slot (breaking multi-key scripts with
// CROSSSLOT) or make two different ids share a key. Escape is injective and
// its output never contains '{', '}' or ':' so an escaped id can be placed
// inside a hash tag or between separators without changing either.
package keyenc

import (
	"errors"
	"strings"
)

const hexDigits = "0123456789ABCDEF"

// safe reports whether b is copied through unescaped. Everything else,
// including '%' itself, is percent-encoded, which keeps the encoding
// injective.
func safe(b byte) bool {
	return b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z' || b >= '0' && b <= '9' ||
		b == '-' || b == '_' || b == '.'
}

// Escape returns s with every byte outside [A-Za-z0-9._-] written as %XX.
// Distinct inputs give distinct outputs, and the output contains none of
// '{', '}', ':' or any control or non-ASCII byte. Arbitrary (including
// invalid UTF-8) input is accepted.
func Escape(s string) string {
	n := 0
	for i := 0; i < len(s); i++ {
		if !safe(s[i]) {
			n++
		}
	}
	if n == 0 {
		return s
	}
	var b strings.Builder
	b.Grow(len(s) + 2*n)
	for i := 0; i < len(s); i++ {
		c := s[i]
		if safe(c) {
			b.WriteByte(c)
			continue
		}
		b.WriteByte('%')
		b.WriteByte(hexDigits[c>>4])
		b.WriteByte(hexDigits[c&0x0F])
	}
	return b.String()
}

// EscapedLen returns len(Escape(s)) without building it.
func EscapedLen(s string) int {
	n := len(s)
	for i := 0; i < len(s); i++ {
		if !safe(s[i]) {
			n += 2
		}
	}
	return n
}

// ErrMalformed is returned by Unescape for input that Escape cannot produce.
var ErrMalformed = errors.New("keyenc: malformed escaped string")

// Unescape reverses Escape. It rejects any input that Escape could not have
// produced, so Unescape(x) succeeds only if Escape(Unescape(x)) == x.
func Unescape(s string) (string, error) {
	if strings.IndexByte(s, '%') < 0 {
		for i := 0; i < len(s); i++ {
			if !safe(s[i]) {
				return "", ErrMalformed
			}
		}
		return s, nil
	}
	out := make([]byte, 0, len(s))
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case safe(c):
			out = append(out, c)
		case c == '%' && i+2 < len(s):
			hi, lo := unhex(s[i+1]), unhex(s[i+2])
			if hi < 0 || lo < 0 {
				return "", ErrMalformed
			}
			v := byte(hi<<4 | lo)
			if safe(v) {
				return "", ErrMalformed // Escape never encodes a safe byte
			}
			out = append(out, v)
			i += 2
		default:
			return "", ErrMalformed
		}
	}
	return string(out), nil
}

// unhex decodes one upper-case hex digit, the only case Escape emits.
func unhex(c byte) int {
	switch {
	case c >= '0' && c <= '9':
		return int(c - '0')
	case c >= 'A' && c <= 'F':
		return int(c-'A') + 10
	}
	return -1
}

// ValidatePrefix checks a key prefix chosen by configuration. A prefix must
// not contain '{' or '}', or it could become (or break) a hash tag.
func ValidatePrefix(prefix string) error {
	if strings.ContainsAny(prefix, "{}") {
		return errors.New("must not contain '{' or '}' (they would define a Redis Cluster hash tag)")
	}
	return nil
}

// Tagged returns prefix + "{" + Escape(tag) + "}" + suffix: a key whose hash
// slot depends only on tag, never on prefix, suffix or the bytes of tag,
// provided prefix holds no brace (ValidatePrefix; callers check it once).
// Keys built with the same tag land in the same Redis Cluster slot.
//
// Redis ignores an empty hash tag ("{}") and hashes the whole key instead, so
// the empty tag is written as a lone "%", which Escape never produces.
func Tagged(prefix, tag, suffix string) string {
	enc := Escape(tag)
	if enc == "" {
		enc = "%"
	}
	return prefix + "{" + enc + "}" + suffix
}

// TaggedLen returns len(Tagged(prefix, tag, suffix)) without building the
// key.
func TaggedLen(prefix, tag, suffix string) int {
	return len(prefix) + len("{}") + max(EscapedLen(tag), len("%")) + len(suffix)
}
