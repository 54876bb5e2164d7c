package main

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

// FuzzDecodeSubmit feeds arbitrary bodies to decodeSubmit: it never
// panics; a refusal has a 4xx status and a body; an accepted body is a JSON
// object with exactly user_id (string) and delta (int64), each once; its
// user id holds U+FFFD only if the body spelled one (literally or as
// \ufffd), so distinct ids are never merged; and the accepted command,
// written back as JSON, decodes to itself.
func FuzzDecodeSubmit(f *testing.F) {
	for _, s := range []string{
		`{"user_id":"ada","delta":5}`,
		`{"user_id":"ada","USER_ID":"bob","delta":5}`,
		`{"user_id":"\ud800","delta":1}`,
		`{"user_id":"\ud800\udc00","delta":1}`,
		`{"user_id":"\\ud800","delta":1}`,
		`{"user\u005fid":"a","delta":1}`,
		`{"delta":1.0,"user_id":"a"}`,
		`{"user_id":"a","delta":1} x`,
		`{"user_id":null,"delta":1}`,
		`[]`,
		"{\"user_id\":\"\xff\",\"delta\":1}",
		`{"user_id":"\uDBFF\uDFFF","delta":-9223372036854775808}`,
		`{"user_id":"\ufffd","delta":0}`,
		`{"user_id":".","delta":0}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		r := httptest.NewRequest(http.MethodPost, "/scores", bytes.NewReader(body))
		w := httptest.NewRecorder()
		req, status, errBody := decodeSubmit(w, r)
		if req == nil {
			require.NotNil(t, errBody, "refused without a body (status %d)", status)
			require.True(t, status >= 400 && status < 500, "status %d", status)
			return
		}
		require.Nil(t, errBody)
		require.NotNil(t, req.UserID)
		require.NotNil(t, req.Delta)
		require.True(t, utf8.Valid(body))
		// The object, decoded independently: exactly the two keys.
		var m map[string]json.RawMessage
		require.NoError(t, json.Unmarshal(body, &m))
		require.Len(t, m, 2)
		var user string
		var delta int64
		require.NoError(t, json.Unmarshal(m["user_id"], &user))
		require.NoError(t, json.Unmarshal(m["delta"], &delta))
		require.Equal(t, user, *req.UserID)
		require.Equal(t, delta, *req.Delta)
		if strings.ContainsRune(user, utf8.RuneError) {
			lower := strings.ToLower(string(body))
			require.True(t, strings.Contains(lower, `\ufffd`) || strings.ContainsRune(string(body), utf8.RuneError),
				"user id %q holds U+FFFD that body %q did not spell", user, body)
		}
		again, err := json.Marshal(submitRequest{UserID: req.UserID, Delta: req.Delta})
		require.NoError(t, err)
		r2 := httptest.NewRequest(http.MethodPost, "/scores", bytes.NewReader(again))
		req2, _, errBody2 := decodeSubmit(httptest.NewRecorder(), r2)
		require.Nil(t, errBody2, "re-encoded %q refused", again)
		require.Equal(t, *req.UserID, *req2.UserID)
		require.Equal(t, *req.Delta, *req2.Delta)
	})
}
