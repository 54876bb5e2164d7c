package leaderboard

import (
	"encoding/base64"
	"encoding/binary"
	"hash/crc32"
	"strings"
	"unicode/utf8"
)

// cursorVersion is the first byte of every encoded cursor, so that the
// format can change without misreading old cursors.
const cursorVersion = 1

// cursor is a keyset position: the (score, user) of the last entry of a
// page. It says where the next page starts, not which row it starts with,
// so pages neither skip nor repeat entries that keep their place while
// other scores change.
type cursor struct {
	score int64
	user  string
}

// encodeCursor renders c as an opaque URL-safe string bound to the board:
// version byte, CRC-32 of the board name, score (8 bytes), user id.
func (b *Board) encodeCursor(c cursor) string {
	buf := make([]byte, 0, 13+len(c.user))
	buf = append(buf, cursorVersion)
	buf = binary.BigEndian.AppendUint32(buf, crc32.ChecksumIEEE([]byte(b.cfg.Name)))
	buf = binary.BigEndian.AppendUint64(buf, uint64(c.score))
	buf = append(buf, c.user...)
	return base64.RawURLEncoding.EncodeToString(buf)
}

// decodeCursor parses a cursor produced by encodeCursor of this board.
func (b *Board) decodeCursor(s string) (cursor, error) {
	buf, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil || len(buf) < 14 || buf[0] != cursorVersion ||
		binary.BigEndian.Uint32(buf[1:5]) != crc32.ChecksumIEEE([]byte(b.cfg.Name)) {
		return cursor{}, ErrInvalidCursor
	}
	c := cursor{score: int64(binary.BigEndian.Uint64(buf[5:13])), user: string(buf[13:])}
	if c.score < MinScore || c.score > MaxScore || !utf8.ValidString(c.user) || strings.IndexByte(c.user, 0) >= 0 {
		return cursor{}, ErrInvalidCursor
	}
	return c, nil
}
