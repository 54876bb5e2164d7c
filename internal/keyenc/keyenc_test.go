package keyenc

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

func TestEscape(t *testing.T) {
	t.Parallel()

	hazards := []string{
		"", "plain", "a:b", "{a}", "}{", "a{b}c", "line\nbreak", "\xff\xfe invalid",
		"%", "%25", "Ünïcödé", "\x00", strings.Repeat("x{", 512),
	}
	seen := map[string]string{}
	for _, in := range hazards {
		out := Escape(in)
		require.False(t, strings.ContainsAny(out, "{}:\n\x00"), "escaped %q = %q", in, out)
		require.True(t, utf8.ValidString(out))
		if prev, dup := seen[out]; dup {
			t.Fatalf("Escape(%q) == Escape(%q) == %q", in, prev, out)
		}
		seen[out] = in
		back, err := Unescape(out)
		require.NoError(t, err)
		require.Equal(t, in, back)
	}
	require.Equal(t, "plain-id_1.2", Escape("plain-id_1.2"), "safe ids stay readable")
}

// TestEscapeEveryByte pins Escape's exact mapping of each of the 256 byte
// values: [A-Za-z0-9._-] copied through, every other byte as '%' and two
// upper-case hex digits. Escaped ids are stored data (they are part of
// every key name), so the mapping is a compatibility guarantee: a release
// that escaped 'z', or stopped escaping some other byte, would still be
// injective and round-trip (what TestEscape checks) while orphaning every
// key of a board whose name contains that byte after an upgrade.
func TestEscapeEveryByte(t *testing.T) {
	t.Parallel()
	for c := 0; c < 256; c++ {
		in := string([]byte{byte(c)})
		want := fmt.Sprintf("%%%02X", c)
		if strings.IndexByte(passThrough, byte(c)) >= 0 {
			want = in
		}
		require.Equal(t, want, Escape(in), "byte %#02x", c)
		require.Equal(t, len(want), EscapedLen(in), "byte %#02x", c)
		require.Equal(t, "p:{"+want+"}:z", Tagged("p:", in, ":z"), "byte %#02x", c)
	}
}

func TestUnescapeRejectsWhatEscapeCannotProduce(t *testing.T) {
	t.Parallel()
	for _, bad := range []string{"%", "%4", "%zz", "%41" /* 'A' is safe */, "a b", "{x}", "%7b"} {
		_, err := Unescape(bad)
		require.ErrorIs(t, err, ErrMalformed, bad)
	}
}

// TestUnescapeEveryShortString tries every string of up to four bytes
// over the bytes an escape can trip on (the escape byte, hex digits of both
// cases and just past them, braces, the separator, bytes above 0x7f, NUL):
// Unescape refuses each with ErrMalformed or returns the one string whose
// Escape it is. A bad first hex digit let through (the check on the low
// digit alone) decodes "%G0"; the hand-picked cases above miss it.
func TestUnescapeEveryShortString(t *testing.T) {
	t.Parallel()
	alphabet := []byte{'%', '0', '2', '5', '7', 'A', 'F', 'G', 'a', 'b', 'f', '{', '}', ':', '-', '~', 0x80, 0xff, 0}
	var walk func(prefix []byte, depth int)
	walk = func(prefix []byte, depth int) {
		s := string(prefix)
		decoded, err := Unescape(s)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("Unescape(%q): %v, not ErrMalformed", s, err)
			}
		} else if Escape(decoded) != s {
			t.Fatalf("Unescape(%q) = %q, but Escape of that is %q", s, decoded, Escape(decoded))
		}
		if depth == 0 {
			return
		}
		for _, c := range alphabet {
			walk(append(prefix, c), depth-1)
		}
	}
	walk(nil, 4)
}

// TestEscapeRoundTripsRandomBytes: random byte strings, biased towards the
// bytes Escape rewrites, come back from Unescape whole, never share an
// escaped form, and make Tagged keys with exactly one non-empty tag.
func TestEscapeRoundTripsRandomBytes(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(1, 2))
	seen := map[string]string{}
	for range 200_000 {
		b := make([]byte, r.IntN(12))
		for j := range b {
			b[j] = byte(r.IntN(256))
			if r.IntN(3) == 0 {
				b[j] = "%{}:%A7"[r.IntN(7)]
			}
		}
		s := string(b)
		escaped := Escape(s)
		if n := EscapedLen(s); n != len(escaped) {
			t.Fatalf("EscapedLen(%q) = %d, len(Escape) = %d", s, n, len(escaped))
		}
		if strings.ContainsAny(escaped, "{}:") {
			t.Fatalf("Escape(%q) = %q holds a brace or separator", s, escaped)
		}
		back, err := Unescape(escaped)
		if err != nil || back != s {
			t.Fatalf("Unescape(Escape(%q)) = %q, %v", s, back, err)
		}
		if prev, ok := seen[escaped]; ok && prev != s {
			t.Fatalf("Escape(%q) == Escape(%q)", s, prev)
		}
		seen[escaped] = s
		key := Tagged("p:", s, ":z")
		open := strings.IndexByte(key, '{')
		if strings.Count(key, "{") != 1 || strings.Count(key, "}") != 1 || key[open+1] == '}' {
			t.Fatalf("Tagged(%q) = %q, not one non-empty tag", s, key)
		}
	}
}

func TestTagged(t *testing.T) {
	t.Parallel()
	require.Equal(t, "p:{board}:z", Tagged("p:", "board", ":z"))
	require.Equal(t, "p:{%}:z", Tagged("p:", "", ":z"), "an empty tag must still be a tag")
	require.Equal(t, "p:{%7Bx%7D}:z", Tagged("p:", "{x}", ":z"))
	for _, tag := range []string{"", "a", "{x}", "\xff\x00", "%"} {
		require.Equal(t, len(Tagged("p:", tag, ":z")), TaggedLen("p:", tag, ":z"), "tag %q", tag)
	}
	require.Error(t, ValidatePrefix("a{b"))
	require.Error(t, ValidatePrefix("a}b"), "a closing brace could end a hash tag too")
	require.NoError(t, ValidatePrefix("app:v1:"))
}

// passThrough and upperHex spell out Escape's documented output alphabet
// independently of the package's own tables.
const (
	passThrough = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-"
	upperHex    = "0123456789ABCDEF"
)

// FuzzEscape checks that Escape's output has the documented form (no
// separator, only pass-through bytes and %XX), round-trips, and that
// Unescape accepts only canonical encodings.
func FuzzEscape(f *testing.F) {
	for _, s := range []string{"", "a", "{", "}", ":", "%", "\xff", "a%7Bb"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		out := Escape(s)
		if strings.ContainsAny(out, "{}:") {
			t.Fatalf("Escape(%q) = %q contains a separator", s, out)
		}
		// The documented form, checked byte by byte: letters, digits and
		// "._-" pass through; every other byte becomes '%' and two
		// upper-case hex digits.
		want := 0
		for i := 0; i < len(s); i++ {
			if c := s[i]; strings.IndexByte(passThrough, c) >= 0 {
				want++
			} else {
				want += 3
			}
		}
		if len(out) != want || EscapedLen(s) != want {
			t.Fatalf("Escape(%q) = %q: %d bytes (EscapedLen %d), want %d", s, out, len(out), EscapedLen(s), want)
		}
		for i := 0; i < len(out); i++ {
			switch c := out[i]; {
			case strings.IndexByte(passThrough, c) >= 0:
			case c == '%' && i+2 < len(out) &&
				strings.IndexByte(upperHex, out[i+1]) >= 0 && strings.IndexByte(upperHex, out[i+2]) >= 0:
				i += 2
			default:
				t.Fatalf("Escape(%q) = %q: byte %q at %d is outside the documented form", s, out, c, i)
			}
		}
		back, err := Unescape(out)
		if err != nil || back != s {
			t.Fatalf("round trip of %q: %q, %v", s, back, err)
		}
		// Unescape accepts only canonical encodings, so decoding is injective too.
		if dec, err := Unescape(s); err == nil && Escape(dec) != s {
			t.Fatalf("Unescape(%q) = %q but Escape of it is %q", s, dec, Escape(dec))
		}
	})
}
