package leaderboard

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
)

// cursorVersion is the first byte of every encoded cursor, so that the
// format can change without misreading old cursors. Version 1 bound a
// cursor to a CRC-32 of the board's name only, which other boards shared
// (names with the same CRC-32, the same name in another schema or key
// prefix); its cursors are refused with ErrInvalidCursor, and clients start
// again from the first page.
const cursorVersion = 2

// cursorTagSize is the length of the board tag in a cursor.
const cursorTagSize = 8

// cursor is a keyset position: the (score, user) of the last entry of a
// page. It says where the next page starts, not which row it starts with,
// so pages neither skip nor repeat entries that keep their place while
// other scores change. user is any member of the sorted set, which may be
// no user id at all (invalid UTF-8, NUL bytes, empty: a foreign writer's
// member, which Redis reads serve like any other): a page can end with it,
// and its cursor must still take the next page (see pgPage).
type cursor struct {
	score int64
	user  string
}

// cursorTagOf returns the tag that binds cursors to the board of c: the
// first 8 bytes of the SHA-256 of its Schema, KeyPrefix and Name, each
// length-prefixed so that no two triples encode alike. The schema and the
// prefix are part of it because boards of the same name in different
// schemas or key prefixes (one per tenant) are different boards; 64 bits
// make an accidental match between two boards negligible, unlike a CRC-32.
func cursorTagOf(c *Config) [cursorTagSize]byte {
	h := sha256.New()
	for _, s := range []string{c.Schema, c.KeyPrefix, c.Name} {
		_, _ = h.Write(binary.BigEndian.AppendUint32(nil, uint32(len(s))))
		_, _ = h.Write([]byte(s))
	}
	var tag [cursorTagSize]byte
	copy(tag[:], h.Sum(nil))
	return tag
}

// cursorHeader is the length of a cursor before its user id: version byte,
// board tag, score.
const cursorHeader = 1 + cursorTagSize + 8

// encodeCursor renders c as an opaque URL-safe string bound to the board:
// version byte, board tag (cursorTagOf), score (8 bytes), user id.
func (b *Board) encodeCursor(c cursor) string {
	buf := make([]byte, 0, cursorHeader+len(c.user))
	buf = append(buf, cursorVersion)
	buf = append(buf, b.cursorTag[:]...)
	buf = binary.BigEndian.AppendUint64(buf, uint64(c.score))
	buf = append(buf, c.user...)
	return base64.RawURLEncoding.EncodeToString(buf)
}

// decodeCursor parses a cursor produced by encodeCursor of this board. Its
// user may be any bytes, none included: every member of the sorted set can
// end a page.
func (b *Board) decodeCursor(s string) (cursor, error) {
	buf, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil || len(buf) < cursorHeader || buf[0] != cursorVersion ||
		!bytes.Equal(buf[1:1+cursorTagSize], b.cursorTag[:]) {
		return cursor{}, ErrInvalidCursor
	}
	c := cursor{score: int64(binary.BigEndian.Uint64(buf[1+cursorTagSize : cursorHeader])), user: string(buf[cursorHeader:])}
	if c.score < MinScore || c.score > MaxScore {
		return cursor{}, ErrInvalidCursor
	}
	return c, nil
}
