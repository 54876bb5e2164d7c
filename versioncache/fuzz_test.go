package versioncache

import (
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

// FuzzSplitVersioned: splitVersioned never panics, accepts only what
// joinVersioned of a canonical version writes (so it round-trips), and the
// hit path's versionedPayload agrees with it on every value it accepts.
func FuzzSplitVersioned(f *testing.F) {
	for _, s := range []string{"1:x", "0:", ":x", "01:x", "-1:x", "+1:x", "9223372036854775807:a:b", "9223372036854775808:a", "1", "", "12345678901234567890:x"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		v, payload, err := splitVersioned(data)
		if err != nil {
			require.Equal(t, errMalformed, err)
			// The hit path serves exactly what Peek and Check can read.
			_, err := versionedPayload(data)
			require.Equal(t, errMalformed, err, "the hit path accepts %q", data)
			return
		}
		require.GreaterOrEqual(t, v, int64(0))
		require.Equal(t, data, joinVersioned(strconv.FormatInt(v, 10), payload))
		hit, err := versionedPayload(data)
		require.NoError(t, err)
		require.Equal(t, payload, hit)
	})
}

// FuzzJSONCodecUnmarshal: JSONCodec.Unmarshal of arbitrary bytes into an
// interface never panics, and what it accepts re-encodes and decodes to the
// same value (json.Number keeps integers exact).
func FuzzJSONCodecUnmarshal(f *testing.F) {
	for _, s := range []string{`1`, `{"a":9007199254740993}`, `[1,2] `, `"\ud800"`, `{} {}`, `1e400`, `-0`, `{"a":1}]`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var v any
		if err := (JSONCodec{}).Unmarshal(data, &v); err != nil {
			return
		}
		again, err := JSONCodec{}.Marshal(v)
		require.NoError(t, err)
		var w any
		require.NoError(t, JSONCodec{}.Unmarshal(again, &w), "re-encoding %q of %q does not decode", again, data)
		require.Equal(t, v, w)
	})
}
