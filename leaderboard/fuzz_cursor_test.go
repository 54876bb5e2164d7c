package leaderboard

import (
	"math"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

// cursorOnlyBoard is a Board with only what the cursor code reads.
func cursorOnlyBoard(schema, prefix, name string) *Board {
	return &Board{cursorTag: cursorTagOf(&Config{Schema: schema, KeyPrefix: prefix, Name: name})}
}

// FuzzCursorDecode feeds arbitrary text to decodeCursor: it never panics,
// refuses with ErrInvalidCursor alone, and what it accepts re-encodes to a
// cursor that decodes to the same position, in range.
func FuzzCursorDecode(f *testing.F) {
	b := cursorOnlyBoard("public", "verity:lb:", "weekly")
	f.Add("")
	f.Add("AA")
	f.Add(b.encodeCursor(cursor{score: 5, user: "alice"}))
	f.Add(b.encodeCursor(cursor{score: MinScore, user: ""}))
	f.Add(b.encodeCursor(cursor{score: MaxScore, user: "\xff\x00"}))
	f.Add(b.encodeCursor(cursor{score: 1, user: "x"}) + "\n")
	f.Add(b.encodeCursor(cursor{score: 1, user: "x"})[:10] + "=")
	f.Fuzz(func(t *testing.T, s string) {
		c, err := b.decodeCursor(s)
		if err != nil {
			require.Equal(t, ErrInvalidCursor, err)
			return
		}
		require.True(t, c.score >= MinScore && c.score <= MaxScore)
		again, err := b.decodeCursor(b.encodeCursor(c))
		require.NoError(t, err)
		require.Equal(t, c, again)
		// Another board never accepts it.
		_, err = cursorOnlyBoard("public", "verity:lb:", "weekly2").decodeCursor(s)
		require.ErrorIs(t, err, ErrInvalidCursor)
	})
}

// FuzzCursorRoundTrip: every in-range position round-trips exactly and
// two different positions never share a cursor; the cursor is URL-safe.
func FuzzCursorRoundTrip(f *testing.F) {
	b := cursorOnlyBoard("s", "p:", "n")
	f.Add(int64(0), "a", int64(0), "b")
	f.Add(MaxScore, "\x00", MinScore, "")
	f.Add(int64(-1), "é", int64(-1), "e\u0301")
	f.Fuzz(func(t *testing.T, s1 int64, u1 string, s2 int64, u2 string) {
		c1, c2 := cursor{score: s1, user: u1}, cursor{score: s2, user: u2}
		e1, e2 := b.encodeCursor(c1), b.encodeCursor(c2)
		for _, r := range e1 {
			require.True(t, r == '-' || r == '_' || r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z', "cursor %q not URL-safe", e1)
		}
		if c1 != c2 {
			require.NotEqual(t, e1, e2)
		}
		got, err := b.decodeCursor(e1)
		if s1 < MinScore || s1 > MaxScore {
			require.ErrorIs(t, err, ErrInvalidCursor)
			return
		}
		require.NoError(t, err)
		require.Equal(t, c1, got)
	})
}

// FuzzParseScriptRange builds script replies from arbitrary member and
// score texts: parseScriptRange never panics; it accepts a score only when
// its negation is an integer in [MinScore, MaxScore] and returns exactly it;
// anything else is an error (ErrCorruptScore for a number out of shape).
func FuzzParseScriptRange(f *testing.F) {
	f.Add(int64(0), "a", "-5", "b", "3")
	f.Add(int64(7), "", "inf", "x", "-inf")
	f.Add(int64(-1), "\xff", "nan", "y", "1.5")
	f.Add(int64(0), "a", "-9007199254740993", "b", "9007199254740992")
	f.Add(int64(0), "a", "0x1p3", "b", "1_0")
	f.Add(int64(0), "a", "-0", "b", "1e3")
	f.Fuzz(func(t *testing.T, first int64, m1, t1, m2, t2 string) {
		entries, err := parseScriptRange([]any{first, []any{m1, t1, m2, t2}})
		want := func(text string) (int64, bool) {
			f, err := strconv.ParseFloat(text, 64)
			if err != nil || math.IsNaN(f) || math.IsInf(f, 0) || f != math.Trunc(f) || -f < float64(MinScore) || -f > float64(MaxScore) {
				return 0, false
			}
			return int64(-f), true
		}
		w1, ok1 := want(t1)
		w2, ok2 := want(t2)
		if !ok1 || !ok2 {
			require.Error(t, err)
			return
		}
		require.NoError(t, err)
		require.Equal(t, []Entry{{UserID: m1, Score: w1, Rank: first + 1}, {UserID: m2, Score: w2, Rank: first + 2}}, entries)
	})
}
