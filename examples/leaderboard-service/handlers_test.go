package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
)

func TestSubmit(t *testing.T) {
	t.Parallel()

	t.Run("CreatedThenDuplicate", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		key := uuid.NewString()
		first := tb.submit(t, key, `{"user_id":"ada","delta":42}`)
		require.Equal(t, http.StatusCreated, first.status, "%s", first.body)
		body := first.json(t)
		require.Equal(t, map[string]any{"event_id": key, "user_id": "ada", "score": 42.0, "version": 1.0, "duplicate": false}, body)

		again := tb.submit(t, key, `{"user_id":"ada","delta":42}`)
		require.Equal(t, http.StatusOK, again.status, "%s", again.body)
		body["duplicate"] = true
		require.Equal(t, body, again.json(t))

		events, queued := tb.counts(t)
		require.Equal(t, 1, events, "a retried request is applied once")
		require.Equal(t, 1, queued)
	})

	t.Run("ScoresAccumulate", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		require.Equal(t, http.StatusCreated, tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":40}`).status)
		res := tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":-15}`)
		require.Equal(t, http.StatusCreated, res.status, "%s", res.body)
		body := res.json(t)
		require.Equal(t, 25.0, body["score"])
		require.Equal(t, 2.0, body["version"])
	})

	t.Run("ConflictingReuseOfKey", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		key := uuid.NewString()
		require.Equal(t, http.StatusCreated, tb.submit(t, key, `{"user_id":"ada","delta":42}`).status)
		for _, body := range []string{`{"user_id":"ada","delta":43}`, `{"user_id":"bob","delta":42}`} {
			res := tb.submit(t, key, body)
			require.Equal(t, http.StatusConflict, res.status, "%s", res.body)
			got := res.json(t)
			require.Equal(t, key, got["event_id"])
			require.NotEmpty(t, got["error"])
		}
		events, queued := tb.counts(t)
		require.Equal(t, 1, events)
		require.Equal(t, 1, queued)
	})

	t.Run("KeyHeldByAnotherOutboxWriter", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		key := uuid.New()
		_, err := tb.pg.Pool.Exec(context.Background(),
			`INSERT INTO verity_outbox (event_id, stream, key, version, payload) VALUES ($1, 'orders', 'o-1', 1, 'x')`, key)
		require.NoError(t, err)
		res := tb.submit(t, key.String(), `{"user_id":"ada","delta":1}`)
		require.Equal(t, http.StatusConflict, res.status, "%s", res.body)
		require.NotEmpty(t, res.json(t)["error"])
		events, queued := tb.counts(t)
		require.Equal(t, 0, events)
		require.Equal(t, 1, queued, "only the other writer's row")
		require.Regexp(t, `(?m)^verity_service_submits_total\{[^}]*outcome="conflict"[^}]*\} 1$`,
			string(tb.do(t, http.MethodGet, "/metrics", nil, "").body))
	})

	t.Run("InvalidInput", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		for _, tc := range []struct {
			name, key, body string
			status          int
			field           string
		}{
			{"MissingKey", "", `{"user_id":"ada","delta":1}`, 422, "Idempotency-Key"},
			{"KeyNotUUID", "order-17", `{"user_id":"ada","delta":1}`, 422, "Idempotency-Key"},
			{"NilUUIDKey", uuid.Nil.String(), `{"user_id":"ada","delta":1}`, 422, "Idempotency-Key"},
			{"EmptyUser", uuid.NewString(), `{"user_id":"","delta":1}`, 422, "user_id"},
			{"MissingUser", uuid.NewString(), `{"delta":1}`, 422, "user_id"},
			{"NULInUser", uuid.NewString(), `{"user_id":"a\u0000b","delta":1}`, 422, "user_id"},
			{"UserTooLong", uuid.NewString(), fmt.Sprintf(`{"user_id":%q,"delta":1}`, strings.Repeat("x", 129)), 422, "user_id"},
			{"UserNotString", uuid.NewString(), `{"user_id":7,"delta":1}`, 422, "user_id"},
			{"MissingDelta", uuid.NewString(), `{"user_id":"ada"}`, 422, "delta"},
			{"DeltaOutOfRange", uuid.NewString(), `{"user_id":"ada","delta":1001}`, 422, "delta"},
			{"DeltaNotInteger", uuid.NewString(), `{"user_id":"ada","delta":1.5}`, 422, "delta"},
			{"DeltaString", uuid.NewString(), `{"user_id":"ada","delta":"5"}`, 422, "delta"},
			{"DeltaOverflowsInt64", uuid.NewString(), `{"user_id":"ada","delta":9223372036854775808}`, 422, "delta"},
			{"UnknownField", uuid.NewString(), `{"userId":"ada","delta":1}`, 422, "userId"},
			{"NotAnObject", uuid.NewString(), `[1,2]`, 422, ""},
			{"MalformedJSON", uuid.NewString(), `{"user_id":"ada",`, 400, ""},
			{"EmptyBody", uuid.NewString(), ``, 400, ""},
			{"TrailingData", uuid.NewString(), `{"user_id":"ada","delta":1} {}`, 400, ""},
			{"TrailingBrace", uuid.NewString(), `{"user_id":"ada","delta":1}}`, 400, ""},
			{"TrailingBracket", uuid.NewString(), `{"user_id":"ada","delta":1}] not json`, 400, ""},
			{"NullBody", uuid.NewString(), `null`, 422, ""},
			{"InvalidUTF8", uuid.NewString(), "{\"user_id\":\"a\xff\",\"delta\":1}", 400, ""},
			{"KeyOtherCase", uuid.NewString(), `{"user_id":"ada","USER_ID":"bob","delta":5}`, 422, "USER_ID"},
			{"RepeatedKey", uuid.NewString(), `{"user_id":"ada","user_id":"bob","delta":5}`, 422, "user_id"},
			{"NullUser", uuid.NewString(), `{"user_id":null,"delta":5}`, 422, "user_id"},
			{"LoneHighSurrogate", uuid.NewString(), `{"user_id":"a\ud800","delta":1}`, 422, "user_id"},
			{"LoneLowSurrogate", uuid.NewString(), `{"user_id":"\udc00b","delta":1}`, 422, "user_id"},
			{"SurrogatesReversed", uuid.NewString(), `{"user_id":"\udc00\ud800","delta":1}`, 422, "user_id"},
			{"HighSurrogateTwice", uuid.NewString(), `{"user_id":"\ud83d\ud83d","delta":1}`, 422, "user_id"},
			{"DotUser", uuid.NewString(), `{"user_id":".","delta":1}`, 422, "user_id"},
			{"DotDotUser", uuid.NewString(), `{"user_id":"..","delta":1}`, 422, "user_id"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				res := tb.submit(t, tc.key, tc.body)
				require.Equal(t, tc.status, res.status, "%s", res.body)
				got := res.json(t)
				require.NotEmpty(t, got["error"])
				if tc.field == "" {
					require.NotContains(t, got, "field")
				} else {
					require.Equal(t, tc.field, got["field"], "%s", res.body)
				}
			})
		}
		events, queued := tb.counts(t)
		require.Zero(t, events, "a refused request writes nothing")
		require.Zero(t, queued)
	})

	// Two Idempotency-Key lines name two events, as a repeated body key
	// names two users: ambiguous, refused, nothing written. The first line
	// used to win silently.
	t.Run("RepeatedKeyHeader", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, tb.srv.URL+"/scores",
			strings.NewReader(`{"user_id":"ada","delta":5}`))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Add("Idempotency-Key", uuid.NewString())
		req.Header.Add("Idempotency-Key", uuid.NewString())
		resp, err := tb.srv.Client().Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		var got map[string]any
		require.NoError(t, json.NewDecoder(resp.Body).Decode(&got))
		require.Equal(t, http.StatusUnprocessableEntity, resp.StatusCode, "%v", got)
		require.Equal(t, "Idempotency-Key", got["field"])
		events, queued := tb.counts(t)
		require.Zero(t, events)
		require.Zero(t, queued)
	})

	// Escapes that encoding/json decodes exactly are accepted, and name the
	// same user as the characters they stand for.
	t.Run("EscapedUserIDs", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		for _, tc := range []struct{ name, user, want string }{
			{"SurrogatePair", `\ud83d\ude00`, "\U0001F600"},
			{"TheCharacterItself", "\U0001F600", "\U0001F600"},
			{"EscapedBackslashBeforeU", `\\ud800`, `\ud800`},
			{"ReplacementCharacter", `\ufffd`, "\uFFFD"},
		} {
			res := tb.submit(t, uuid.NewString(), `{"user_id":"`+tc.user+`","delta":1}`)
			require.Equal(t, http.StatusCreated, res.status, "%s: %s", tc.name, res.body)
			require.Equal(t, tc.want, res.json(t)["user_id"], tc.name)
		}
		events, _ := tb.counts(t)
		require.Equal(t, 4, events)
	})

	t.Run("ScoreOutOfRange", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *leaderboard.Config) { c.MinDelta, c.MaxDelta = leaderboard.MinScore, leaderboard.MaxScore })
		require.Equal(t, http.StatusCreated, tb.submit(t, uuid.NewString(), fmt.Sprintf(`{"user_id":"ada","delta":%d}`, leaderboard.MaxScore)).status)
		res := tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":1}`)
		require.Equal(t, http.StatusUnprocessableEntity, res.status, "%s", res.body)
		require.Equal(t, "delta", res.json(t)["field"])
		events, _ := tb.counts(t)
		require.Equal(t, 1, events)
	})

	t.Run("BodyTooLarge", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		res := tb.submit(t, uuid.NewString(), `{"user_id":"`+strings.Repeat("x", maxBodyBytes)+`","delta":1}`)
		require.Equal(t, http.StatusRequestEntityTooLarge, res.status, "%s", res.body)
		// Also when a valid object comes first.
		res = tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":1}`+strings.Repeat(" ", maxBodyBytes))
		require.Equal(t, http.StatusRequestEntityTooLarge, res.status, "%s", res.body)
		events, _ := tb.counts(t)
		require.Zero(t, events)
	})

	t.Run("WrongMethod", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		res := tb.do(t, http.MethodGet, "/scores", nil, "")
		require.Equal(t, http.StatusMethodNotAllowed, res.status)
		require.Contains(t, res.header.Get("Allow"), "POST")
	})
}

func TestLeaderboard(t *testing.T) {
	t.Parallel()

	// The README: "an empty limit= means the default, 10".
	t.Run("EmptyLimitMeansTheDefault", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		for i := range 12 {
			require.Equal(t, http.StatusCreated, tb.submit(t, uuid.NewString(), fmt.Sprintf(`{"user_id":"u%02d","delta":%d}`, i, i+1)).status)
		}
		tb.drain(t)
		for _, path := range []string{"/leaderboard?limit=", "/leaderboard"} {
			res := tb.do(t, http.MethodGet, path, nil, "")
			require.Equal(t, http.StatusOK, res.status, "%s: %s", path, res.body)
			require.Len(t, res.json(t)["entries"], 10, path)
		}
	})

	t.Run("PagesWithCursorAndFreshness", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		// Ties order by user id; "amy" and "bob" share 50.
		for _, s := range []struct {
			user  string
			delta int
		}{{"bob", 50}, {"cy", 70}, {"amy", 50}, {"dee", 10}, {"eve", 90}} {
			require.Equal(t, http.StatusCreated, tb.submit(t, uuid.NewString(), fmt.Sprintf(`{"user_id":%q,"delta":%d}`, s.user, s.delta)).status)
		}
		tb.drain(t)

		var seen []string
		path := "/leaderboard?limit=2"
		for pages := 0; ; pages++ {
			require.Less(t, pages, 5, "pagination did not end")
			res := tb.do(t, http.MethodGet, path, nil, "")
			require.Equal(t, http.StatusOK, res.status, "%s", res.body)
			body := res.json(t)
			require.Equal(t, testBoard, body["board"])
			fresh := body["freshness"].(map[string]any)
			require.Equal(t, "redis", fresh["source"])
			require.Equal(t, 0.0, fresh["lag_ms"], "everything was drained")
			require.NotNil(t, fresh["projected_through"])
			for _, e := range body["entries"].([]any) {
				e := e.(map[string]any)
				seen = append(seen, fmt.Sprintf("%v:%v:%v", e["rank"], e["user_id"], e["score"]))
			}
			next, _ := body["next_cursor"].(string)
			if next == "" {
				break
			}
			path = "/leaderboard?limit=2&cursor=" + url.QueryEscape(next)
		}
		require.Equal(t, []string{"1:eve:90", "2:cy:70", "3:amy:50", "4:bob:50", "5:dee:10"}, seen)
	})

	t.Run("DefaultLimitAndEmptyBoard", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		res := tb.do(t, http.MethodGet, "/leaderboard", nil, "")
		require.Equal(t, http.StatusOK, res.status, "%s", res.body)
		body := res.json(t)
		require.Equal(t, []any{}, body["entries"])
		require.NotContains(t, body, "next_cursor")

		for i := range 12 {
			require.Equal(t, http.StatusCreated, tb.submit(t, uuid.NewString(), fmt.Sprintf(`{"user_id":"u%02d","delta":%d}`, i, i+1)).status)
		}
		tb.drain(t)
		body = tb.do(t, http.MethodGet, "/leaderboard", nil, "").json(t)
		require.Len(t, body["entries"], defaultLimit)
		require.NotEmpty(t, body["next_cursor"])
	})

	t.Run("ShowsLagWhileWorkerIsBehind", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *leaderboard.Config) { c.LagProbeInterval = 1 })
		require.Equal(t, http.StatusCreated, tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":5}`).status)
		// Nothing drained: the projection is empty and says it is behind.
		require.Eventually(t, func() bool {
			body := tb.do(t, http.MethodGet, "/leaderboard", nil, "").json(t)
			return len(body["entries"].([]any)) == 0 && body["freshness"].(map[string]any)["lag_ms"].(float64) > 0
		}, 5*time.Second, 20*time.Millisecond)
	})

	t.Run("FailClosedWhileBehind", func(t *testing.T) {
		t.Parallel()
		// MaxLag well above a lag probe's round trip: measuring on every
		// read, a read's lag is at least its own probe's duration, so with a
		// MaxLag of a millisecond the drained board would answer only when a
		// probe happened to take less, which a loaded machine may never do.
		tb := setup(t, func(c *leaderboard.Config) {
			c.ReadPolicy, c.MaxLag, c.LagProbeInterval = leaderboard.FailClosed, 500*time.Millisecond, 1
		})
		require.Equal(t, http.StatusCreated, tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":5}`).status)
		var res response
		require.Eventually(t, func() bool {
			res = tb.do(t, http.MethodGet, "/leaderboard", nil, "")
			return res.status == http.StatusServiceUnavailable
		}, 5*time.Second, 20*time.Millisecond, "last answer: %d %s", res.status, res.body)
		require.Equal(t, "1", res.header.Get("Retry-After"))
		require.NotEmpty(t, res.json(t)["error"])

		tb.drain(t)
		require.Eventually(t, func() bool {
			return tb.do(t, http.MethodGet, "/leaderboard", nil, "").status == http.StatusOK
		}, 5*time.Second, 20*time.Millisecond)
	})

	t.Run("FallbackToPostgresWhileBehind", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *leaderboard.Config) {
			c.ReadPolicy, c.MaxLag, c.LagProbeInterval = leaderboard.FallbackToPostgres, time.Millisecond, 1
		})
		require.Equal(t, http.StatusCreated, tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":5}`).status)
		require.Eventually(t, func() bool {
			body := tb.do(t, http.MethodGet, "/leaderboard", nil, "").json(t)
			entries := body["entries"].([]any)
			return body["freshness"].(map[string]any)["source"] == "postgres" &&
				len(entries) == 1 && entries[0].(map[string]any)["user_id"] == "ada"
		}, 5*time.Second, 20*time.Millisecond, "the exact answer comes from PostgreSQL while Redis is behind")
	})

	t.Run("InvalidParameters", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		for _, tc := range []struct{ query, field string }{
			{"limit=0", "limit"}, {"limit=1001", "limit"}, {"limit=ten", "limit"},
			{"limit=%2B1", "limit"}, {"limit=1%20", "limit"}, {"limit=1&limit=2", "limit"},
			{"cursor=not-a-cursor", "cursor"}, {"cursor=&cursor=", "cursor"},
		} {
			res := tb.do(t, http.MethodGet, "/leaderboard?"+tc.query, nil, "")
			require.Equal(t, http.StatusUnprocessableEntity, res.status, "%s: %s", tc.query, res.body)
			require.Equal(t, tc.field, res.json(t)["field"])
		}
	})
}

func TestRank(t *testing.T) {
	t.Parallel()

	t.Run("FoundMissingAndEscapedIDs", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		odd := "team/a b?c#d {x}:é"
		for _, s := range []struct {
			user  string
			delta int
		}{{"ada", 30}, {odd, 20}, {"bob", 10}} {
			require.Equal(t, http.StatusCreated, tb.submit(t, uuid.NewString(), fmt.Sprintf(`{"user_id":%q,"delta":%d}`, s.user, s.delta)).status)
		}
		tb.drain(t)

		res := tb.do(t, http.MethodGet, "/users/"+url.PathEscape(odd)+"/rank", nil, "")
		require.Equal(t, http.StatusOK, res.status, "%s", res.body)
		body := res.json(t)
		require.Equal(t, odd, body["user_id"])
		require.Equal(t, 2.0, body["rank"])
		require.Equal(t, 20.0, body["score"])
		require.Equal(t, "redis", body["freshness"].(map[string]any)["source"])

		res = tb.do(t, http.MethodGet, "/users/nobody/rank", nil, "")
		require.Equal(t, http.StatusNotFound, res.status, "%s", res.body)
		require.NotEmpty(t, res.json(t)["error"])
	})

	t.Run("SlashIDs", func(t *testing.T) {
		t.Parallel()
		// ServeMux takes a lone %2F segment for a trailing slash; the id
		// "/" is found all the same, and counted under the rank route.
		tb := setup(t)
		for i, user := range []string{"/", "//", "a/"} {
			res := tb.submit(t, uuid.NewString(), fmt.Sprintf(`{"user_id":%q,"delta":%d}`, user, 10-i))
			require.Equal(t, http.StatusCreated, res.status, "%s", res.body)
		}
		tb.drain(t)
		for i, path := range []string{"/users/%2F/rank", "/users/%2f/rank", "/users/%2F%2F/rank", "/users/a%2F/rank"} {
			res := tb.do(t, http.MethodGet, path, nil, "")
			require.Equal(t, http.StatusOK, res.status, "%s: %s", path, res.body)
			body := res.json(t)
			require.Equal(t, []string{"/", "/", "//", "a/"}[i], body["user_id"], path)
			require.Equal(t, []float64{1, 1, 2, 3}[i], body["rank"], path)
		}
		res := tb.do(t, http.MethodGet, "/users/%2F/rank?at_least=0", nil, "")
		require.Equal(t, http.StatusUnprocessableEntity, res.status, "%s", res.body)
		text := string(tb.do(t, http.MethodGet, "/metrics", nil, "").body)
		require.Contains(t, text, `route="GET /users/{id}/rank"`)
		require.NotContains(t, text, "%2F")
	})

	t.Run("DotIDs", func(t *testing.T) {
		t.Parallel()
		// "." and ".." would be stored but never read back: escaped as
		// url.PathEscape or a page's encodeURIComponent escapes them, they
		// are dot segments that the path resolves away. Refused at submit;
		// other ids of dots are ordinary ones.
		tb := setup(t)
		for _, user := range []string{".", ".."} {
			res := tb.submit(t, uuid.NewString(), fmt.Sprintf(`{"user_id":%q,"delta":1}`, user))
			require.Equal(t, http.StatusUnprocessableEntity, res.status, "%q: %s", user, res.body)
			body := res.json(t)
			require.Equal(t, "user_id", body["field"], "%q", user)
			require.Contains(t, body["error"], "GET /users/{id}/rank", "%q: the error says why", user)
		}
		events, _ := tb.counts(t)
		require.Zero(t, events, "a refused id writes nothing")

		for i, user := range []string{"...", ".a", "a.", "./a"} {
			res := tb.submit(t, uuid.NewString(), fmt.Sprintf(`{"user_id":%q,"delta":%d}`, user, 10-i))
			require.Equal(t, http.StatusCreated, res.status, "%q: %s", user, res.body)
		}
		tb.drain(t)
		for i, user := range []string{"...", ".a", "a.", "./a"} {
			path := "/users/" + url.PathEscape(user) + "/rank"
			res := tb.do(t, http.MethodGet, path, nil, "")
			require.Equal(t, http.StatusOK, res.status, "%s: %s", path, res.body)
			require.Equal(t, user, res.json(t)["user_id"], path)
			require.Equal(t, float64(i+1), res.json(t)["rank"], path)
		}
	})

	t.Run("AtLeastWithIDTheBoardRefuses", func(t *testing.T) {
		t.Parallel()
		// No score can have such an id: 404 as without at_least, and no
		// read, so a client cannot drive the library's read-error count
		// (the board refuses AtLeast for such an id as an invalid option).
		tb := setup(t)
		for _, id := range []string{"%00", "a%00b", "%ff", strings.Repeat("x", 129)} {
			for _, q := range []string{"", "?at_least=1"} {
				path := "/users/" + id + "/rank" + q
				res := tb.do(t, http.MethodGet, path, nil, "")
				require.Equal(t, http.StatusNotFound, res.status, "%s: %s", path, res.body)
				require.Equal(t, "user has no score on this leaderboard", res.json(t)["error"], path)
			}
		}
		reads := regexp.MustCompile(`(?m)^verity_leaderboard_reads_total\{.*$`).FindAllString(
			string(tb.do(t, http.MethodGet, "/metrics", nil, "").body), -1)
		require.NotEmpty(t, reads)
		for _, line := range reads {
			require.NotContains(t, line, `verity_leaderboard_outcome="error"`)
		}
	})

	t.Run("ReadYourWrites", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		res := tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":30}`)
		require.Equal(t, http.StatusCreated, res.status)
		res = tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":3}`)
		version := int(res.json(t)["version"].(float64))
		tb.drain(t)
		body := tb.do(t, http.MethodGet, fmt.Sprintf("/users/ada/rank?at_least=%d", version), nil, "").json(t)
		require.Equal(t, 33.0, body["score"])
		require.Equal(t, true, body["freshness"].(map[string]any)["at_least_met"])

		// A version the projection has not reached: ServeStale answers
		// anyway and says so.
		body = tb.do(t, http.MethodGet, fmt.Sprintf("/users/ada/rank?at_least=%d", version+1), nil, "").json(t)
		require.Equal(t, false, body["freshness"].(map[string]any)["at_least_met"])

		// A sign, a space or a second at_least is refused, not read as
		// the number it might mean.
		for _, q := range []string{"0", "-1", "x", "%2B1", "%201", "1&at_least=2", "", "&"} {
			res := tb.do(t, http.MethodGet, "/users/ada/rank?at_least="+q, nil, "")
			require.Equal(t, http.StatusUnprocessableEntity, res.status)
			require.Equal(t, "at_least", res.json(t)["field"])
		}

		// A user id no score can have: 404, with at_least as without.
		long := strings.Repeat("x", 129)
		for _, q := range []string{"", "?at_least=1"} {
			res := tb.do(t, http.MethodGet, "/users/"+long+"/rank"+q, nil, "")
			require.Equal(t, http.StatusNotFound, res.status, "%s: %s", q, res.body)
		}
	})

	t.Run("ReadYourWritesOfANewUser", func(t *testing.T) {
		t.Parallel()
		// The first score of a user, not projected yet: "no score" would
		// deny the score the client was just told was saved.
		tb := setup(t)
		res := tb.submit(t, uuid.NewString(), `{"user_id":"newcomer","delta":3}`)
		require.Equal(t, http.StatusCreated, res.status)
		version := int(res.json(t)["version"].(float64))
		res = tb.do(t, http.MethodGet, fmt.Sprintf("/users/newcomer/rank?at_least=%d", version), nil, "")
		require.Equal(t, http.StatusServiceUnavailable, res.status, "%s", res.body)
		require.Equal(t, "1", res.header.Get("Retry-After"))
		tb.drain(t)
		res = tb.do(t, http.MethodGet, fmt.Sprintf("/users/newcomer/rank?at_least=%d", version), nil, "")
		require.Equal(t, http.StatusOK, res.status, "%s", res.body)
	})
}

func TestHealthz(t *testing.T) {
	t.Parallel()

	t.Run("OK", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		res := tb.do(t, http.MethodGet, "/healthz", nil, "")
		require.Equal(t, http.StatusOK, res.status, "%s", res.body)
		require.Equal(t, map[string]any{"status": "ok", "postgres": "ok", "redis": "ok"}, res.json(t))
	})

	t.Run("RedisDown", func(t *testing.T) {
		t.Parallel()
		pg := testenv.Postgres(t)
		rs := testenv.StartRedis(t)
		rdb := redis.NewClient(&redis.Options{Addr: rs.Addr(), MaxRetries: -1})
		t.Cleanup(func() { _ = rdb.Close() })
		cfg := &leaderboard.Config{Name: testBoard, Schema: pg.Schema}
		require.NoError(t, leaderboard.Migrate(context.Background(), pg.Pool, cfg))
		board, err := leaderboard.New(pg.Pool, rdb, cfg)
		require.NoError(t, err)
		svc, err := NewService(pg.Pool, rdb, board, ServiceConfig{})
		require.NoError(t, err)
		t.Cleanup(func() { _ = svc.Close() })
		tb := &testBundle{srv: newServer(t, svc)}

		require.Equal(t, http.StatusOK, tb.do(t, http.MethodGet, "/healthz", nil, "").status)
		require.NoError(t, rs.Stop())
		res := tb.do(t, http.MethodGet, "/healthz", nil, "")
		require.Equal(t, http.StatusServiceUnavailable, res.status, "%s", res.body)
		body := res.json(t)
		require.Equal(t, "unavailable", body["status"])
		require.Equal(t, "ok", body["postgres"])
		require.Equal(t, "unavailable", body["redis"])
	})

	// A PostgreSQL that does not answer in time is named alone, and does
	// not use up Redis's time: the pings run side by side.
	t.Run("SlowPostgresIsNamedAlone", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		pg := testenv.Postgres(t)
		rd := testenv.Redis(t)
		poolCfg, err := pgxpool.ParseConfig(pg.ConnString)
		require.NoError(t, err)
		poolCfg.MaxConns = 1
		pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		cfg := &leaderboard.Config{Name: testBoard, Schema: pg.Schema, KeyPrefix: rd.Prefix}
		require.NoError(t, leaderboard.Migrate(ctx, pg.Pool, cfg))
		board, err := leaderboard.New(pg.Pool, rd.Client, cfg)
		require.NoError(t, err)
		svc, err := NewService(pool, rd.Client, board, ServiceConfig{})
		require.NoError(t, err)
		t.Cleanup(func() { _ = svc.Close() })
		tb := &testBundle{srv: newServer(t, svc)}
		held, err := pool.Acquire(ctx) // the pool's only connection: a ping waits for it
		require.NoError(t, err)
		defer held.Release()

		start := time.Now()
		res := tb.do(t, http.MethodGet, "/healthz", nil, "")
		require.Less(t, time.Since(start), pingTimeout+time.Second, "the pings ran one after the other")
		require.Equal(t, http.StatusServiceUnavailable, res.status, "%s", res.body)
		require.Equal(t, map[string]any{"status": "unavailable", "postgres": "unavailable", "redis": "ok"}, res.json(t))
	})

	t.Run("PostgresDownHidesDetails", func(t *testing.T) {
		t.Parallel()
		var logs lockedBuffer
		pool, rdb, board, database := boardWithoutDatabase(t)
		svc, err := NewService(pool, rdb, board, ServiceConfig{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
		require.NoError(t, err)
		t.Cleanup(func() { _ = svc.Close() })
		tb := &testBundle{srv: newServer(t, svc)}

		res := tb.do(t, http.MethodGet, "/healthz", nil, "")
		require.Equal(t, http.StatusServiceUnavailable, res.status, "%s", res.body)
		require.Equal(t, map[string]any{"status": "unavailable", "postgres": "unavailable", "redis": "ok"}, res.json(t))
		require.NotContains(t, string(res.body), database)
		// The details are for the operator, in the log.
		require.Contains(t, logs.String(), database)
	})
}

func TestMetrics(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	require.Equal(t, http.StatusCreated, tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":1}`).status)
	require.Equal(t, http.StatusUnprocessableEntity, tb.submit(t, "", `{"user_id":"ada","delta":1}`).status)

	// A scrape waits for the outbox gauges' stats read only briefly (it
	// fills the cache for the next one), so a loaded machine may need a
	// second scrape.
	var text string
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		res := tb.do(t, http.MethodGet, "/metrics", nil, "")
		assert.Equal(c, http.StatusOK, res.status)
		text = string(res.body)
		assert.Contains(c, text, `verity_service_outbox_pending{`)
	}, 10*time.Second, 50*time.Millisecond)
	for _, want := range []string{
		`verity_service_http_requests_total{`,
		`route="POST /scores"`,
		`verity_service_submits_total{`,
		`outcome="applied"`,
		`outcome="invalid"`,
		`verity_service_outbox_pending{`,
		`verity_service_projection_lag_seconds{`,
		"go_goroutines ",
		`service_name="leaderboard-service"`,
	} {
		require.Contains(t, text, want)
	}
	// One queued row, nothing projected yet.
	require.Regexp(t, `(?m)^verity_service_outbox_pending\{[^}]*\} 1$`, text)
	// Route labels are patterns, never raw paths with user ids.
	tb.do(t, http.MethodGet, "/users/secret-user/rank", nil, "")
	text = string(tb.do(t, http.MethodGet, "/metrics", nil, "").body)
	require.Contains(t, text, `route="GET /users/{id}/rank"`)
	require.NotContains(t, text, "secret-user")
}

// TestMetricsClientHangUp: a client that gives up on a read-your-writes
// read is counted as 499, not as a 503 the service never sent: the 5xx
// series is what an availability alert watches.
func TestMetricsClientHangUp(t *testing.T) {
	t.Parallel()
	tb := setup(t, func(c *leaderboard.Config) { c.ReadYourWritesTimeout = 5 * time.Second })
	require.Equal(t, http.StatusCreated, tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":3}`).status)

	// Nothing projects the submit: the read waits for it until the client
	// gives up.
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, tb.srv.URL+"/users/ada/rank?at_least=1", nil)
	require.NoError(t, err)
	_, err = tb.srv.Client().Do(req)
	require.ErrorIs(t, err, context.DeadlineExceeded, "the client gave up")

	counted := func(code string) *regexp.Regexp {
		return regexp.MustCompile(`(?m)^verity_service_http_requests_total\{[^}]*code="` + code + `"[^}]*route="GET /users/\{id\}/rank"[^}]*\} 1$`)
	}
	var text string
	require.Eventually(t, func() bool {
		text = string(tb.do(t, http.MethodGet, "/metrics", nil, "").body)
		return counted("499").MatchString(text)
	}, 10*time.Second, 50*time.Millisecond, "the hang-up is counted once, as 499")
	require.NotRegexp(t, counted("503"), text)
}

func TestPage(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	res := tb.do(t, http.MethodGet, "/", nil, "")
	require.Equal(t, http.StatusOK, res.status)
	require.Contains(t, res.header.Get("Content-Type"), "text/html")
	for _, id := range []string{`id="top"`, `id="submit-form"`, `id="rank-form"`, `id="freshness"`, `id="reconcile"`} {
		require.Contains(t, string(res.body), id)
	}
	require.Equal(t, http.StatusNotFound, tb.do(t, http.MethodGet, "/index.html/x", nil, "").status)
}

// TestMalformedQuery: net/url drops a query pair it cannot parse without
// a word, so a bad at_least, limit or cursor would be served as if never
// sent: an at_least read then claimed at_least_met for a version it does
// not reflect. A malformed query string is a 400 instead.
func TestMalformedQuery(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	require.Equal(t, http.StatusCreated, tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":1}`).status)
	tb.drain(t)
	// Version 2 is committed but not projected.
	res := tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":5}`)
	require.Equal(t, http.StatusCreated, res.status)
	require.EqualValues(t, 2, res.json(t)["version"])

	for _, path := range []string{
		"/users/ada/rank?at_least=2%",   // a stray percent sign
		"/users/ada/rank?at_least=2;",   // a ';' separator, as some clients still send
		"/users/ada/rank?at_least=%32%", // "2" escaped, one escape cut short
		"/leaderboard?limit=5%",         // would be served with the default 10
		"/leaderboard?cursor=AAAA%",     // would be served from the first page
	} {
		res := tb.do(t, http.MethodGet, path, nil, "")
		require.Equal(t, http.StatusBadRequest, res.status, "%s: %s", path, res.body)
		require.Contains(t, res.json(t)["error"], "malformed", path)
	}
}

// A read that cannot reach its store is an outage the client can wait out:
// 503 with Retry-After, not 500 (a fault of the service). FallbackToPostgres
// still answers, from PostgreSQL.
func TestReadsWithRedisDown(t *testing.T) {
	t.Parallel()

	for _, tc := range []struct {
		policy leaderboard.ReadPolicy
		status int
	}{
		{leaderboard.ServeStale, http.StatusServiceUnavailable},
		{leaderboard.FailClosed, http.StatusServiceUnavailable},
		{leaderboard.FallbackToPostgres, http.StatusOK},
	} {
		t.Run(tc.policy.String(), func(t *testing.T) {
			t.Parallel()
			rs := testenv.StartRedis(t)
			rdb := redis.NewClient(&redis.Options{Addr: rs.Addr(), MaxRetries: -1})
			t.Cleanup(func() { _ = rdb.Close() })
			tb := serviceWithAda(t, rdb, tc.policy)

			require.NoError(t, rs.Stop())
			for _, path := range []string{"/leaderboard", "/users/ada/rank"} {
				res := tb.do(t, http.MethodGet, path, nil, "")
				require.Equal(t, tc.status, res.status, "%s: %s", path, res.body)
				if tc.status == http.StatusServiceUnavailable {
					require.Equal(t, "1", res.header.Get("Retry-After"), path)
					require.Contains(t, res.json(t)["error"], "cannot be reached", path)
				} else {
					require.Equal(t, "postgres", res.json(t)["freshness"].(map[string]any)["source"], path)
				}
			}
		})
	}
}

// TestReadsWithRedisFrozen stops a Redis process (SIGSTOP) that the
// service's own client (newRedisClient, as serve builds it) is connected
// to: connections stay open and nothing answers. A fallback-to-postgres
// read must still answer from PostgreSQL well within the request's
// deadline, and /healthz name Redis within about pingTimeout. With
// go-redis's defaults (a 5 s read timeout, three retries) a page read held
// on past the request's 10 s and answered 503, and /healthz took 5 s.
func TestReadsWithRedisFrozen(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rs := testenv.StartRedis(t)
	rdb, err := newRedisClient(rs.URL(), false)
	require.NoError(t, err)
	t.Cleanup(func() { _ = rdb.Close() })
	tb := serviceWithAda(t, rdb, leaderboard.FallbackToPostgres)
	for _, path := range []string{"/leaderboard", "/users/ada/rank"} {
		res := tb.do(t, http.MethodGet, path, nil, "")
		require.Equal(t, http.StatusOK, res.status, path)
		require.Equal(t, "redis", res.json(t)["freshness"].(map[string]any)["source"], path)
	}

	info, err := rdb.InfoMap(ctx, "server").Result()
	require.NoError(t, err)
	pid, err := strconv.Atoi(info["Server"]["process_id"])
	require.NoError(t, err)
	require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
	t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGCONT) })
	// Twice each: the second read of a path dials a new connection (the
	// first one's was closed on its timeout), whose handshake waits too.
	for _, path := range []string{"/leaderboard", "/users/ada/rank", "/leaderboard", "/users/ada/rank"} {
		res, took := tb.doWithin(t, 20*time.Second, http.MethodGet, path, nil, "")
		require.Equal(t, http.StatusOK, res.status, "%s after %s: %s", path, took, res.body)
		require.Equal(t, "postgres", res.json(t)["freshness"].(map[string]any)["source"], path)
	}
	res, took := tb.doWithin(t, 20*time.Second, http.MethodGet, "/healthz", nil, "")
	require.Equal(t, http.StatusServiceUnavailable, res.status, res.body)
	require.Equal(t, "unavailable", res.json(t)["redis"], res.body)
	require.Less(t, took, pingTimeout+time.Second, "the Redis ping outlived pingTimeout")
}

// TestRequestTimeoutWithRedisFrozen: RequestTimeout bounds a request whose
// Redis command is in flight when Redis stops answering: the service's
// client ends a command at its context's deadline too. Without
// ContextTimeoutEnabled it ended only at the client's ReadTimeout (2 s),
// and a read answered its 503 after 4 s against a 3 s RequestTimeout.
func TestRequestTimeoutWithRedisFrozen(t *testing.T) {
	t.Parallel()
	const requestTimeout = 500 * time.Millisecond
	rs := testenv.StartRedis(t)
	rdb, err := newRedisClient(rs.URL(), false)
	require.NoError(t, err)
	t.Cleanup(func() { _ = rdb.Close() })
	require.Less(t, requestTimeout, redisReadTimeout)
	tb := serviceWithAdaConfig(t, rdb, leaderboard.ServeStale, ServiceConfig{RequestTimeout: requestTimeout})

	info, err := rdb.InfoMap(context.Background(), "server").Result()
	require.NoError(t, err)
	pid, err := strconv.Atoi(info["Server"]["process_id"])
	require.NoError(t, err)
	require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
	t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGCONT) })
	for _, path := range []string{"/leaderboard", "/users/ada/rank"} {
		res, took := tb.doWithin(t, 20*time.Second, http.MethodGet, path, nil, "")
		require.Equal(t, http.StatusServiceUnavailable, res.status, "%s: %s", path, res.body)
		require.Less(t, took, requestTimeout+800*time.Millisecond, "%s answered after %s, past RequestTimeout", path, took)
	}
}

// TestRedisClientTimeouts: the service's client waits redisReadTimeout and
// resends nothing, unless the URL says otherwise.
func TestRedisClientTimeouts(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		url         string
		cluster     bool
		readTimeout time.Duration
		maxRetries  int
	}{
		// None: go-redis stores -1 as 0 in a Client's options, as -1 in a
		// ClusterClient's.
		{"redis://127.0.0.1:1/0", false, redisReadTimeout, 0},
		{"redis://127.0.0.1:1/0?read_timeout=7s&max_retries=2", false, 7 * time.Second, 2},
		{"redis://127.0.0.1:1?addr=127.0.0.1:2", true, redisReadTimeout, -1},
		{"redis://127.0.0.1:1?addr=127.0.0.1:2&read_timeout=7s&max_retries=2", true, 7 * time.Second, 2},
	} {
		rdb, err := newRedisClient(tc.url, tc.cluster)
		require.NoError(t, err, tc.url)
		var readTimeout time.Duration
		var maxRetries int
		switch c := rdb.(type) {
		case *redis.Client:
			readTimeout, maxRetries = c.Options().ReadTimeout, c.Options().MaxRetries
		case *redis.ClusterClient:
			readTimeout, maxRetries = c.Options().ReadTimeout, c.Options().MaxRetries
			// go-redis's budget for redirects, which also resends a
			// command that timed out: left as it is (the README says so).
			require.Equal(t, 3, c.Options().MaxRedirects, tc.url)
		}
		require.NoError(t, rdb.Close())
		require.Equal(t, tc.readTimeout, readTimeout, tc.url)
		require.Equal(t, tc.maxRetries, maxRetries, tc.url)
	}
}

// TestUnreachable classifies errors met for real: a Redis that answers
// "not now" (a cluster down, a server loading) and one that cannot be
// reached are outages to wait out (503); PostgreSQL's own answers, even
// while connecting (a missing database), are faults (500).
func TestUnreachable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rd := testenv.Redis(t)
	pg := testenv.Postgres(t)
	reply := func(text string) error {
		t.Helper()
		err := rd.Client.Eval(ctx, "return redis.error_reply(ARGV[1])", nil, text).Err()
		require.Error(t, err)
		return fmt.Errorf("leaderboard: reading Redis: %w", err)
	}
	closed, err := redis.ParseURL(rd.URL)
	require.NoError(t, err)
	closedClient := redis.NewClient(closed)
	require.NoError(t, closedClient.Close())
	refused := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1})
	t.Cleanup(func() { _ = refused.Close() })
	cfg, err := pgx.ParseConfig(pg.ConnString)
	require.NoError(t, err)
	cfg.Database = "verity_no_such_database"
	cfg.TLSConfig, cfg.Fallbacks = nil, nil
	_, noDatabase := pgx.ConnectConfig(ctx, cfg)
	require.Error(t, noDatabase)
	_, syntax := pg.Pool.Exec(ctx, "SELEC 1")
	require.Error(t, syntax)
	// A connection that an administrator (or a fast shutdown) terminated
	// answers its next query with 57P01.
	victim, err := pgx.Connect(ctx, pg.ConnString)
	require.NoError(t, err)
	t.Cleanup(func() { _ = victim.Close(ctx) })
	var terminated bool
	require.NoError(t, pg.Pool.QueryRow(ctx, "SELECT pg_terminate_backend($1)", victim.PgConn().PID()).Scan(&terminated))
	require.True(t, terminated)
	var adminShutdown error
	require.Eventually(t, func() bool {
		_, adminShutdown = victim.Exec(ctx, "SELECT 1")
		return adminShutdown != nil
	}, 5*time.Second, 10*time.Millisecond)

	// pgx's answer on a connection that broke under an earlier statement
	// (in the simple protocol, also under this one, after it was sent).
	broken, err := pgx.Connect(ctx, pg.ConnString)
	require.NoError(t, err)
	require.NoError(t, broken.PgConn().Close(ctx))
	_, connClosed := broken.Exec(ctx, "SELECT 1")
	require.ErrorIs(t, connClosed, pgconn.ErrConnClosed)

	for name, tc := range map[string]struct {
		err  error
		want bool
	}{
		"ClusterDown":    {reply("CLUSTERDOWN The cluster is down"), true},
		"ConnClosed":     {fmt.Errorf("leaderboard: reading PostgreSQL: %w", connClosed), true},
		"Loading":        {reply("LOADING Redis is loading the dataset in memory"), true},
		"MasterDown":     {reply("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'."), true},
		"TryAgain":       {reply("TRYAGAIN Multiple keys request during rehashing of slot"), true},
		"Moved":          {reply("MOVED 9652 127.0.0.1:7001"), true},
		"Ask":            {reply("ASK 9652 127.0.0.1:7001"), true},
		"Busy":           {reply("BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE."), true},
		"MaxClients":     {reply("ERR max number of clients reached"), true},
		"AdminShutdown":  {adminShutdown, true},
		"OtherReply":     {reply("WRONGTYPE Operation against a key holding the wrong kind of value"), false},
		"Refused":        {refused.Ping(ctx).Err(), true},
		"ClosedClient":   {closedClient.Ping(ctx).Err(), true},
		"NoSuchDatabase": {noDatabase, false},
		"PostgresSyntax": {syntax, false},
		"RedisNil":       {fmt.Errorf("wrapped: %w", redis.Nil), false},
		// A store that did not answer within an inner deadline (the
		// request's own is answered before this is asked).
		"InnerDeadline": {fmt.Errorf("leaderboard: reading Redis: %w", context.DeadlineExceeded), true},
		"PlainError":    {errors.New("something else"), false},
	} {
		require.Equal(t, tc.want, unreachable(tc.err), "%s: %v", name, tc.err)
	}
}

// TestUnreachablePostgresShuttingDown: a PostgreSQL shutting down (or
// starting up, or in recovery) answers a new connection with
// cannot_connect_now (57P03): an outage to wait out, not a fault.
func TestUnreachablePostgresShuttingDown(t *testing.T) {
	t.Parallel()
	srv := testenv.StartPostgres(t)
	refused := smartShutdown(t, srv)
	require.ErrorContains(t, refused, "57P03")
	require.True(t, unreachable(refused), "%v", refused)
}

// smartShutdown begins a smart shutdown of srv while a session of its own
// keeps the server up (closed at cleanup, which lets the shutdown finish),
// and returns the error of a new connection, refused (57P03) from then on.
func smartShutdown(t *testing.T, srv *testenv.PostgresServer) (refused error) {
	t.Helper()
	ctx := context.Background()
	held, err := pgx.Connect(ctx, srv.ConnString())
	require.NoError(t, err)
	t.Cleanup(func() { _ = held.Close(ctx) })
	var backend int
	require.NoError(t, held.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&backend))
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", backend))
	require.NoError(t, err)
	var postmaster int
	for line := range strings.SplitSeq(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, "PPid:"); ok {
			postmaster, err = strconv.Atoi(strings.TrimSpace(v))
			require.NoError(t, err)
		}
	}
	require.NotZero(t, postmaster)
	require.NoError(t, syscall.Kill(postmaster, syscall.SIGTERM))
	for deadline := time.Now().Add(10 * time.Second); refused == nil && time.Now().Before(deadline); {
		c, err := pgx.Connect(ctx, srv.ConnString())
		if err != nil {
			return err
		}
		c.Close(ctx)
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatal("the server still takes new connections 10 s after a smart shutdown began")
	return nil
}

// A Redis with no client slot left (maxclients) closes each new
// connection after replying so: the client sees a broken pipe (here), or
// that reply (TestUnreachable). A read that needed a new connection then
// is an outage to wait out (503, Retry-After: 1), not a fault (500); and
// so is a Ring with every shard down.
func TestUnreachableRedisOutOfClients(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("MaxClients", func(t *testing.T) {
		t.Parallel()
		rs := testenv.StartRedis(t)
		rdb := redis.NewClient(&redis.Options{Addr: rs.Addr(), MaxRetries: -1})
		t.Cleanup(func() { _ = rdb.Close() })
		tb := serviceWithAda(t, rdb, leaderboard.ServeStale)

		// One connection (the admin's) is all the server takes; every
		// other client's is closed, so the service must dial anew.
		admin := rs.Client(t)
		require.NoError(t, admin.ConfigSet(ctx, "maxclients", "1").Err())
		require.NoError(t, admin.ClientKillByFilter(ctx, "TYPE", "normal", "SKIPME", "yes").Err())
		for _, path := range []string{"/leaderboard", "/users/ada/rank"} {
			res := tb.do(t, http.MethodGet, path, nil, "")
			require.Equal(t, http.StatusServiceUnavailable, res.status, "%s: %s", path, res.body)
			require.Equal(t, "1", res.header.Get("Retry-After"), path)
			require.Contains(t, res.json(t)["error"], "cannot be reached", path)
		}

		require.NoError(t, admin.ConfigSet(ctx, "maxclients", "10000").Err())
		require.Equal(t, http.StatusOK, tb.do(t, http.MethodGet, "/leaderboard", nil, "").status)
	})

	// Through the service: the board wraps go-redis's Ring error.
	for _, policy := range []leaderboard.ReadPolicy{leaderboard.ServeStale, leaderboard.FailClosed} {
		t.Run("RingShardsDown/"+policy.String(), func(t *testing.T) {
			t.Parallel()
			rs := testenv.StartRedis(t)
			ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": rs.Addr()}, MaxRetries: -1,
				HeartbeatFrequency: 100 * time.Millisecond})
			t.Cleanup(func() { _ = ring.Close() })
			tb := serviceWithAda(t, ring, policy)

			require.NoError(t, rs.Stop())
			require.Eventually(t, func() bool {
				err := ring.Exists(ctx, "k").Err()
				return err != nil && err.Error() == ringShardsDown
			}, 10*time.Second, 10*time.Millisecond)
			for _, path := range []string{"/leaderboard", "/users/ada/rank"} {
				res := tb.do(t, http.MethodGet, path, nil, "")
				require.Equal(t, http.StatusServiceUnavailable, res.status, "%s: %s", path, res.body)
				require.Equal(t, "1", res.header.Get("Retry-After"), path)
				require.Contains(t, res.json(t)["error"], "cannot be reached", path)
			}
		})
	}
}

// serviceWithAda is a service over a board in a new schema and rdb, read
// under policy, whose user ada scored 5, projected and served.
func serviceWithAda(t *testing.T, rdb redis.UniversalClient, policy leaderboard.ReadPolicy) *testBundle {
	t.Helper()
	return serviceWithAdaConfig(t, rdb, policy, ServiceConfig{})
}

// serviceWithAdaConfig is serviceWithAda with the service configured by
// scfg.
func serviceWithAdaConfig(t *testing.T, rdb redis.UniversalClient, policy leaderboard.ReadPolicy, scfg ServiceConfig) *testBundle {
	t.Helper()
	ctx := context.Background()
	pg := testenv.Postgres(t)
	cfg := &leaderboard.Config{Name: testBoard, Schema: pg.Schema, ReadPolicy: policy}
	require.NoError(t, leaderboard.Migrate(ctx, pg.Pool, cfg))
	board, err := leaderboard.New(pg.Pool, rdb, cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	svc, err := NewService(pg.Pool, rdb, board, scfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = svc.Close() })
	tb := &testBundle{svc: svc, srv: newServer(t, svc)}
	require.Equal(t, http.StatusCreated, tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":5}`).status)
	tb.drain(t)
	require.Equal(t, http.StatusOK, tb.do(t, http.MethodGet, "/leaderboard", nil, "").status)
	return tb
}

// ServeMux routes HEAD to the GET patterns: a HEAD read while Redis is
// down is the same outage as a GET (503, Retry-After), not the 500 it
// answered, which a load balancer's HEAD check takes for a fault.
func TestHeadReadsWithRedisDown(t *testing.T) {
	t.Parallel()
	for _, policy := range []leaderboard.ReadPolicy{leaderboard.ServeStale, leaderboard.FailClosed} {
		t.Run(policy.String(), func(t *testing.T) {
			t.Parallel()
			rs := testenv.StartRedis(t)
			rdb := redis.NewClient(&redis.Options{Addr: rs.Addr(), MaxRetries: -1})
			t.Cleanup(func() { _ = rdb.Close() })
			tb := serviceWithAda(t, rdb, policy)
			require.Equal(t, http.StatusOK, tb.do(t, http.MethodHead, "/leaderboard", nil, "").status)
			require.NoError(t, rs.Stop())
			for _, path := range []string{"/leaderboard", "/users/ada/rank"} {
				head := tb.do(t, http.MethodHead, path, nil, "")
				require.Equal(t, http.StatusServiceUnavailable, head.status, "HEAD %s", path)
				require.Equal(t, "1", head.header.Get("Retry-After"), "HEAD %s", path)
			}
		})
	}
}

// An id longer than the board takes has no score: 404 with at_least or
// without. Without, it went through a read under the policy, and
// fail-closed, while the projection lagged, answered 503 "catching up",
// which a client retries for ever.
func TestRankOfTooLongIDUnderFailClosed(t *testing.T) {
	t.Parallel()
	tb := setup(t, func(c *leaderboard.Config) {
		c.ReadPolicy, c.MaxLag, c.LagProbeInterval = leaderboard.FailClosed, time.Millisecond, 1
	})
	require.Equal(t, http.StatusCreated, tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":1}`).status)
	require.Eventually(t, func() bool {
		return tb.do(t, http.MethodGet, "/users/ada/rank", nil, "").status == http.StatusServiceUnavailable
	}, 5*time.Second, 10*time.Millisecond, "the projection lags: fail-closed refuses reads")
	long := strings.Repeat("y", tb.board.Config().MaxUserIDLength+1)
	for _, q := range []string{"?at_least=1", ""} {
		res := tb.do(t, http.MethodGet, "/users/"+long+"/rank"+q, nil, "")
		require.Equal(t, http.StatusNotFound, res.status, "at_least %q: %s", q, res.body)
	}
}

// The empty key is a key: field names it (""), where the README has field
// absent only for a body that is not a JSON object.
func TestSubmitEmptyUnknownKeyIsNamed(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	res := tb.submit(t, uuid.NewString(), `{"":1,"user_id":"ada","delta":1}`)
	require.Equal(t, http.StatusUnprocessableEntity, res.status, "%s", res.body)
	got := res.json(t)
	require.Contains(t, got, "field", "%s", res.body)
	require.Equal(t, "", got["field"])
	events, queued := tb.counts(t)
	require.Zero(t, events+queued, "nothing written")
}

// TestEveryAnswerIsNosniff: every answer of the service, JSON, the page and
// the metrics, carries X-Content-Type-Options: nosniff.
func TestEveryAnswerIsNosniff(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	res := tb.submit(t, uuid.NewString(), `{"user_id":"ada","delta":1}`)
	require.Equal(t, http.StatusCreated, res.status, "%s", res.body)
	var missing []string
	for _, c := range []struct{ method, path, body string }{
		{http.MethodGet, "/", ""},
		{http.MethodGet, "/leaderboard", ""},
		{http.MethodGet, "/leaderboard?limit=x", ""},
		{http.MethodGet, "/users/ada/rank", ""},
		{http.MethodGet, "/users/nobody/rank", ""},
		{http.MethodGet, "/stats", ""},
		{http.MethodGet, "/reconcile/last", ""},
		{http.MethodGet, "/healthz", ""},
		{http.MethodGet, "/metrics", ""},
		{http.MethodPost, "/scores", `{"<b>":1}`},
	} {
		h := map[string]string{"Idempotency-Key": uuid.NewString()}
		r := tb.do(t, c.method, c.path, h, c.body)
		t.Logf("%s %s: %d %q nosniff=%q", c.method, c.path, r.status, r.header.Get("Content-Type"), r.header.Get("X-Content-Type-Options"))
		if r.header.Get("X-Content-Type-Options") != "nosniff" {
			missing = append(missing, c.method+" "+c.path)
		}
	}
	require.Empty(t, missing, "answers without X-Content-Type-Options: nosniff")
}

// TestSubmitBodyNotJSONIs400: the README's "400 body not JSON (or not
// valid UTF-8, or with anything after the object)", with no field. A body
// that is not JSON at all but whose first token is '[' or a scalar, or
// whose broken part comes after an unknown, repeated or mistyped key, was
// answered 422 (naming that key, for the latter): the checks stopped at
// the first token at fault.
func TestSubmitBodyNotJSONIs400(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	for _, body := range []string{
		`[`,                           // an array never closed
		`[1,`,                         // likewise
		`1x`,                          // a number and garbage
		`"ada"x`,                      // a string and garbage
		`{"userId":1,`,                // an unknown key, then the body breaks off
		`{"user_id":"ada","user_id":`, // a repeated key, then nothing
		`{"delta":"5",garbage`,        // a mistyped value, then garbage
	} {
		res := tb.submit(t, uuid.NewString(), body)
		require.Equal(t, http.StatusBadRequest, res.status, "%s: %s", body, res.body)
		require.NotContains(t, res.json(t), "field", "%s: %s", body, res.body)
	}
	events, queued := tb.counts(t)
	require.Zero(t, events+queued, "nothing written")
}

// TestSubmitBodyLimitIs64KiB: the README's "413 body over 64 KiB", in
// figures rather than through maxBodyBytes: a body of exactly 64 KiB is
// taken, one byte more is refused.
func TestSubmitBodyLimitIs64KiB(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	object := `{"user_id":"ada","delta":1}`
	pad := func(n int) string { return object + strings.Repeat(" ", n-len(object)) }
	res := tb.submit(t, uuid.NewString(), pad(64<<10))
	require.Equal(t, http.StatusCreated, res.status, "a body of exactly 64 KiB: %s", res.body)
	res = tb.submit(t, uuid.NewString(), pad(64<<10+1))
	require.Equal(t, http.StatusRequestEntityTooLarge, res.status, "a body one byte over 64 KiB: %s", res.body)
	events, _ := tb.counts(t)
	require.Equal(t, 1, events)
}

// TestSubmitOutcomesCounted: the README's verity.service.submits, by
// outcome (applied, duplicate, conflict, invalid), each request counted
// once under its own, the board's refusals among the invalid.
func TestSubmitOutcomesCounted(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	key := uuid.NewString()
	require.Equal(t, http.StatusCreated, tb.submit(t, key, `{"user_id":"ada","delta":1}`).status)
	require.Equal(t, http.StatusOK, tb.submit(t, key, `{"user_id":"ada","delta":1}`).status)
	require.Equal(t, http.StatusConflict, tb.submit(t, key, `{"user_id":"ada","delta":2}`).status)
	for _, c := range []struct{ key, body string }{
		{"", `{"user_id":"ada","delta":1}`},                  // header
		{uuid.NewString(), `{"user_id":"ada"}`},              // body
		{uuid.NewString(), `{"user_id":"","delta":1}`},       // the board's ValidationError
		{uuid.NewString(), `{"user_id":"ada","delta":5000}`}, // the board's ValidationError (MaxDelta)
	} {
		require.Equal(t, http.StatusUnprocessableEntity, tb.submit(t, c.key, c.body).status, c.body)
	}
	text := string(tb.do(t, http.MethodGet, "/metrics", nil, "").body)
	for outcome, n := range map[string]int{"applied": 1, "duplicate": 1, "conflict": 1, "invalid": 4} {
		require.Regexp(t, fmt.Sprintf(`(?m)^verity_service_submits_total\{[^}]*outcome="%s"[^}]*\} %d$`, outcome, n), text, outcome)
	}
}

// TestSubmitSurrogateRangeEnds: the README's "a \uD800–\uDFFF escape
// outside a surrogate pair is refused" at the range's ends (a high range
// ending at \udbfe would let a lone \udbff through, decoded to U+FFFD),
// and the code points just outside it, and pairs, taken.
func TestSubmitSurrogateRangeEnds(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	for _, user := range []string{`\udbff`, `a\udbffb`, `\udfff`, `\udbff\udbff`, `\uDBFF`} {
		res := tb.submit(t, uuid.NewString(), `{"user_id":"`+user+`","delta":1}`)
		require.Equal(t, http.StatusUnprocessableEntity, res.status, "%s: %s", user, res.body)
		require.Equal(t, "user_id", res.json(t)["field"], user)
	}
	events, _ := tb.counts(t)
	require.Zero(t, events)
	for user, want := range map[string]string{`\ud7ff`: "\ud7ff", `\ue000`: "\ue000", `\udbff\udfff`: "\U0010FFFF", `\ud800\udc00`: "\U00010000"} {
		res := tb.submit(t, uuid.NewString(), `{"user_id":"`+user+`","delta":1}`)
		require.Equal(t, http.StatusCreated, res.status, "%s: %s", user, res.body)
		require.Equal(t, want, res.json(t)["user_id"], user)
	}
}

// TestRankOfTheLongestUserID: the longest id the board takes
// (MaxUserIDLength bytes) has a score GET /users/{id}/rank reads, with
// at_least and without; one byte more has none (404).
func TestRankOfTheLongestUserID(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	maxLen := tb.board.Config().MaxUserIDLength
	longest := strings.Repeat("é", maxLen/2) + strings.Repeat("x", maxLen%2) // multi-byte: the bound is in bytes
	require.Len(t, longest, maxLen)
	res := tb.submit(t, uuid.NewString(), fmt.Sprintf(`{"user_id":%q,"delta":7}`, longest))
	require.Equal(t, http.StatusCreated, res.status, "%s", res.body)
	tb.drain(t)
	for _, q := range []string{"", "?at_least=1"} {
		res := tb.do(t, http.MethodGet, "/users/"+url.PathEscape(longest)+"/rank"+q, nil, "")
		require.Equal(t, http.StatusOK, res.status, "%q: %s", q, res.body)
		require.Equal(t, longest, res.json(t)["user_id"])
		res = tb.do(t, http.MethodGet, "/users/"+url.PathEscape(longest+"x")+"/rank"+q, nil, "")
		require.Equal(t, http.StatusNotFound, res.status, "%q: %s", q, res.body)
	}
}
