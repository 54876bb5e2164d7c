package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/leaderboard"
)

// maxBodyBytes bounds a POST /scores body; a valid one is well under 1 KiB.
const maxBodyBytes = 64 << 10

// defaultLimit is the page size of GET /leaderboard without ?limit=.
const defaultLimit = 10

// submitRequest is the body of POST /scores. Pointers tell a missing field
// from a zero one: a missing delta is an error, not a delta of 0.
type submitRequest struct {
	UserID *string `json:"user_id"`
	Delta  *int64  `json:"delta"`
}

type submitResponse struct {
	EventID   uuid.UUID `json:"event_id"`
	UserID    string    `json:"user_id"`
	Score     int64     `json:"score"`
	Version   int64     `json:"version"`
	Duplicate bool      `json:"duplicate"`
}

// errorResponse is the body of every error the service's handlers answer:
// a message fit for an API client and, for invalid input, the request field
// it concerns. (net/http's own 404 and 405 for unknown paths and methods
// stay plain text.)
type errorResponse struct {
	Error   string `json:"error"`
	Field   string `json:"field,omitempty"`
	EventID string `json:"event_id,omitempty"`
	// Freshness is that of a "no score" answer: from a lagging or
	// unverified projection, the score may exist but not be projected.
	Freshness *freshnessJSON `json:"freshness,omitempty"`
	// bodyKey says Field names a body key, which may be "" (still named).
	bodyKey bool
}

// MarshalJSON writes field even when empty if it names a body key: the
// README says field is absent only when the body is not a JSON object.
func (e errorResponse) MarshalJSON() ([]byte, error) {
	type plain errorResponse
	if !e.bodyKey {
		return json.Marshal(plain(e))
	}
	return json.Marshal(struct {
		plain
		Field string `json:"field"`
	}{plain(e), e.Field})
}

type entryJSON struct {
	Rank   int64  `json:"rank"`
	UserID string `json:"user_id"`
	Score  int64  `json:"score"`
}

type freshnessJSON struct {
	Source string `json:"source"`
	// ProjectedThrough is null when the lag could not be measured.
	ProjectedThrough *time.Time `json:"projected_through"`
	// LagMS is the projection lag in milliseconds, -1 when unknown.
	LagMS      float64 `json:"lag_ms"`
	AtLeastMet bool    `json:"at_least_met"`
	// Unverified says why the lag is unknown when the board requires a
	// verified projection and it is not (--require-verified): Redis lost
	// data, or no full pass has verified it yet.
	Unverified bool `json:"unverified,omitempty"`
}

type leaderboardResponse struct {
	Board      string        `json:"board"`
	Entries    []entryJSON   `json:"entries"`
	NextCursor string        `json:"next_cursor,omitempty"`
	Freshness  freshnessJSON `json:"freshness"`
}

type rankResponse struct {
	entryJSON
	Freshness freshnessJSON `json:"freshness"`
}

func toFreshness(f leaderboard.Freshness) freshnessJSON {
	out := freshnessJSON{
		Source:     string(f.Source),
		LagMS:      lagMS(f.Lag),
		AtLeastMet: f.AtLeastMet,
		Unverified: f.Unverified,
	}
	if !f.ProjectedThrough.IsZero() {
		t := f.ProjectedThrough.UTC()
		out.ProjectedThrough = &t
	}
	return out
}

// lagMS is lag in milliseconds, -1 when unknown (lag -1 ns).
func lagMS(lag time.Duration) float64 {
	if lag < 0 {
		return -1
	}
	return float64(lag) / float64(time.Millisecond)
}

func toEntry(e leaderboard.Entry) entryJSON {
	return entryJSON{Rank: e.Rank, UserID: e.UserID, Score: e.Score}
}

// handleSubmit is POST /scores.
func (s *Service) handleSubmit(w http.ResponseWriter, r *http.Request) {
	if len(r.Header.Values("Idempotency-Key")) > 1 {
		// Ambiguous, as a repeated body key is: which event is this?
		s.metrics.countSubmit(r.Context(), "invalid")
		writeJSON(w, http.StatusUnprocessableEntity, errorResponse{Field: "Idempotency-Key",
			Error: "appears more than once; send exactly one key"})
		return
	}
	key := strings.TrimSpace(r.Header.Get("Idempotency-Key"))
	if key == "" {
		s.metrics.countSubmit(r.Context(), "invalid")
		writeJSON(w, http.StatusUnprocessableEntity, errorResponse{Field: "Idempotency-Key",
			Error: "required: a UUID identifying this score event; send the same key again when retrying"})
		return
	}
	eventID, err := uuid.Parse(key)
	if err != nil {
		s.metrics.countSubmit(r.Context(), "invalid")
		writeJSON(w, http.StatusUnprocessableEntity, errorResponse{Field: "Idempotency-Key",
			Error: "must be a UUID, for example " + uuid.NewString()})
		return
	}
	req, status, errBody := decodeSubmit(w, r)
	if status == http.StatusServiceUnavailable {
		// The body did not arrive within RequestTimeout, whose deadline
		// the read shared: answer as for any request cut off by it.
		s.writeTimeout(w, r, errors.New("the request body did not arrive in time"))
		return
	}
	if errBody != nil {
		s.metrics.countSubmit(r.Context(), "invalid")
		writeJSON(w, status, errBody)
		return
	}
	res, err := s.board.Submit(r.Context(), leaderboard.Command{EventID: eventID, UserID: *req.UserID, Delta: *req.Delta})
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	status = http.StatusCreated
	if res.Duplicate {
		status = http.StatusOK
		s.metrics.countSubmit(r.Context(), "duplicate")
	} else {
		s.metrics.countSubmit(r.Context(), "applied")
	}
	writeJSON(w, status, submitResponse{EventID: eventID, UserID: *req.UserID, Score: res.Score, Version: res.Version, Duplicate: res.Duplicate})
}

// decodeSubmit reads and checks the body of POST /scores. A body that is
// not JSON is a 400; JSON with the wrong shape or values is a 422 naming
// the field. Keys are matched exactly and once each (encoding/json alone
// matches them case-insensitively and lets a repeated key win, so
// {"user_id":"ada","USER_ID":"bob"} would credit bob), and the body must be
// valid UTF-8 with no unpaired surrogate escape (encoding/json alone turns
// bad bytes and such escapes into U+FFFD, which would merge distinct user
// ids).
//
// The body is read within the request's deadline (RequestTimeout) as well
// as the server's ReadTimeout, whichever ends first: a body that has not
// arrived by then gives 503 with a nil body, for the caller to answer as a
// timeout.
func decodeSubmit(w http.ResponseWriter, r *http.Request) (*submitRequest, int, *errorResponse) {
	if deadline, ok := r.Context().Deadline(); ok {
		// The server set ReadTimeout from the request's start, a moment
		// before now; replacing it, keep within it.
		if limit := time.Now().Add(readTimeout); limit.Before(deadline) {
			deadline = limit
		}
		_ = http.NewResponseController(w).SetReadDeadline(deadline)
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBodyBytes))
	var sizeErr *http.MaxBytesError
	switch {
	case errors.Is(err, os.ErrDeadlineExceeded):
		return nil, http.StatusServiceUnavailable, nil
	case errors.As(err, &sizeErr):
		return nil, http.StatusRequestEntityTooLarge, &errorResponse{Error: fmt.Sprintf("body larger than %d bytes", maxBodyBytes)}
	case err != nil:
		return nil, http.StatusBadRequest, &errorResponse{Error: "body could not be read: " + err.Error()}
	case !utf8.Valid(body):
		return nil, http.StatusBadRequest, &errorResponse{Error: "body is not valid UTF-8"}
	}
	notJSON := func(err error) (*submitRequest, int, *errorResponse) {
		return nil, http.StatusBadRequest, &errorResponse{Error: "body is not valid JSON: " + err.Error()}
	}
	// The whole body first: the checks below stop at the first token or
	// key at fault, and would answer 422 for a body that is not JSON at all
	// (`[1,`, or an unknown key and then garbage).
	if err := json.Unmarshal(body, new(json.RawMessage)); err != nil {
		return notJSON(err)
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	tok, err := dec.Token()
	if err != nil {
		return notJSON(err)
	}
	if tok != json.Delim('{') {
		return nil, http.StatusUnprocessableEntity, &errorResponse{Error: "body must be a JSON object {\"user_id\": string, \"delta\": integer}"}
	}
	var req submitRequest
	seen := make(map[string]bool, 2)
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return notJSON(err)
		}
		key, _ := tok.(string) // an object's keys are strings
		var target any
		switch key {
		case "user_id":
			target = &req.UserID
		case "delta":
			target = &req.Delta
		default:
			return nil, http.StatusUnprocessableEntity, &errorResponse{Field: key, bodyKey: true,
				Error: "unknown field; the body has only user_id and delta"}
		}
		if seen[key] {
			return nil, http.StatusUnprocessableEntity, &errorResponse{Field: key, Error: "appears more than once"}
		}
		seen[key] = true
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return notJSON(err)
		}
		if err := json.Unmarshal(raw, target); err != nil {
			var typeErr *json.UnmarshalTypeError
			if errors.As(err, &typeErr) {
				return nil, http.StatusUnprocessableEntity, &errorResponse{Field: key, Error: fmt.Sprintf("must be a JSON %s", jsonKind(key))}
			}
			return notJSON(err)
		}
		if hasLoneSurrogate(raw) {
			return nil, http.StatusUnprocessableEntity, &errorResponse{Field: key,
				Error: `contains an unpaired UTF-16 surrogate escape (\uD800 to \uDFFF not in a high-low pair)`}
		}
	}
	if _, err := dec.Token(); err != nil { // the closing brace
		return notJSON(err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		if err == nil {
			err = errors.New("trailing data after the JSON object")
		}
		return notJSON(err)
	}
	if req.UserID == nil {
		return nil, http.StatusUnprocessableEntity, &errorResponse{Field: "user_id", Error: "required"}
	}
	if req.Delta == nil {
		return nil, http.StatusUnprocessableEntity, &errorResponse{Field: "delta", Error: "required"}
	}
	if isDotSegment(*req.UserID) {
		return nil, http.StatusUnprocessableEntity, &errorResponse{Field: "user_id",
			Error: `must not be "." or "..": GET /users/{id}/rank could never read the score, since browsers and the server resolve such a path segment away`}
	}
	return &req, 0, nil
}

// isDotSegment reports whether user is "." or "..". The board stores both,
// but as the {id} of GET /users/{id}/rank they are dot segments: browsers
// resolve them (escaped as %2E too) before sending, and ServeMux redirects
// the unescaped ones to the cleaned path, so no page could read their
// scores. The service refuses them at submit instead.
func isDotSegment(user string) bool {
	return user == "." || user == ".."
}

// hasLoneSurrogate reports whether the JSON text raw holds a \u escape of a
// UTF-16 surrogate that is not part of a high-low pair. encoding/json
// decodes each such escape to U+FFFD, so "\ud800" and "\udbff" would
// become the same user id, which is also that of a user really named
// "\ufffd".
func hasLoneSurrogate(raw []byte) bool {
	// escape returns the code unit of a \u escape at raw[i:], or -1.
	escape := func(i int) int {
		if i+6 > len(raw) || raw[i] != '\\' || raw[i+1] != 'u' {
			return -1
		}
		v, err := strconv.ParseUint(string(raw[i+2:i+6]), 16, 16)
		if err != nil {
			return -1
		}
		return int(v)
	}
	for i := 0; i < len(raw); i++ {
		if raw[i] != '\\' {
			continue
		}
		u := escape(i)
		switch {
		case u >= 0xD800 && u <= 0xDBFF: // high: a low must follow
			if low := escape(i + 6); low < 0xDC00 || low > 0xDFFF {
				return true
			}
			i += 11 // both escapes
		case u >= 0xDC00 && u <= 0xDFFF: // low without a high before it
			return true
		default:
			i++ // the escaped character: \\ must not start another escape
		}
	}
	return false
}

func jsonKind(field string) string {
	switch field {
	case "delta":
		return "integer between -2^63 and 2^63-1"
	case "user_id":
		return "string"
	}
	return "value of another type"
}

// parseQuery parses r's query string, answering 400 for a malformed one
// (a bad %-escape, a ';' separator): r.URL.Query drops such a pair without
// a word, so a bad at_least, limit or cursor would be served as if never
// sent, at_least_met true included.
func parseQuery(w http.ResponseWriter, r *http.Request) (url.Values, bool) {
	query, err := url.ParseQuery(r.URL.RawQuery)
	if err != nil {
		writeJSON(w, http.StatusBadRequest, errorResponse{Error: "the query string is malformed: " + err.Error()})
		return nil, false
	}
	return query, true
}

// oneQueryValue returns the value of the query parameter name, "" when
// it is absent. A parameter given more than once is answered 422 here
// (ok false): which of its values a proxy or cache in front of the
// service honours is not for the service to guess.
func oneQueryValue(w http.ResponseWriter, query url.Values, name string) (value string, ok bool) {
	values := query[name]
	if len(values) > 1 {
		writeJSON(w, http.StatusUnprocessableEntity, errorResponse{Field: name, Error: "given more than once; give it once"})
		return "", false
	}
	if len(values) == 0 {
		return "", true
	}
	return values[0], true
}

// parseDecimal parses a query number written as the service writes its
// numbers: decimal digits only, without a sign or spaces. ok is false for
// anything else, or a number above 2^63-1.
func parseDecimal(s string) (n int64, ok bool) {
	if s == "" || strings.TrimLeft(s, "0123456789") != "" {
		return 0, false
	}
	n, err := strconv.ParseInt(s, 10, 64)
	return n, err == nil
}

// handleLeaderboard is GET /leaderboard?limit=&cursor=.
func (s *Service) handleLeaderboard(w http.ResponseWriter, r *http.Request) {
	query, ok := parseQuery(w, r)
	if !ok {
		return
	}
	v, ok := oneQueryValue(w, query, "limit")
	if !ok {
		return
	}
	limit := defaultLimit
	if v != "" { // "limit=" means the default, as no limit does (README)
		n, ok := parseDecimal(v)
		if !ok || n < 1 || n > leaderboard.MaxPageSize {
			writeJSON(w, http.StatusUnprocessableEntity, errorResponse{Field: "limit",
				Error: fmt.Sprintf("must be an integer between 1 and %d", leaderboard.MaxPageSize)})
			return
		}
		limit = int(n)
	}
	cursor, ok := oneQueryValue(w, query, "cursor")
	if !ok {
		return
	}
	page, err := s.board.Page(r.Context(), cursor, limit)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	resp := leaderboardResponse{
		Board:      s.board.Name(),
		Entries:    make([]entryJSON, 0, len(page.Entries)),
		NextCursor: page.Next,
		Freshness:  toFreshness(page.Freshness),
	}
	for _, e := range page.Entries {
		resp.Entries = append(resp.Entries, toEntry(e))
	}
	writeJSON(w, http.StatusOK, resp)
}

// handleRank is GET /users/{id}/rank?at_least=<version>. The id is one
// path segment, percent-decoded, so ids with slashes or spaces work when
// escaped.
func (s *Service) handleRank(w http.ResponseWriter, r *http.Request) {
	user := r.PathValue("id")
	var opts []leaderboard.ReadOption
	query, ok := parseQuery(w, r)
	if !ok {
		return
	}
	v, ok := oneQueryValue(w, query, "at_least")
	if !ok {
		return
	}
	if _, given := query["at_least"]; given { // "at_least=" is no version either
		version, ok := parseDecimal(v)
		if !ok || version < 1 {
			writeJSON(w, http.StatusUnprocessableEntity, errorResponse{Field: "at_least",
				Error: "must be a positive version, as returned by POST /scores"})
			return
		}
		// The board refuses AtLeast for an id it would refuse at submit
		// with ErrInvalidReadOption; such an id has no score, so the
		// answer is the 404 the read without at_least gives.
		if s.boardRefusesUserID(user) {
			writeUserNotFound(w)
			return
		}
		opts = append(opts, leaderboard.AtLeast(user, version))
	}
	// The board would read an id longer than it now takes (one stored
	// before MaxUserIDLength was lowered), under the read policy; this
	// service answers 404 for any id the board refuses, without at_least
	// as with it (README), and fail-closed would otherwise answer 503
	// "catching up" while the projection lags, which a client retries for
	// ever.
	if len(user) > s.board.Config().MaxUserIDLength {
		writeUserNotFound(w)
		return
	}
	entry, fresh, err := s.board.Rank(r.Context(), user, opts...)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, rankResponse{entryJSON: toEntry(entry), Freshness: toFreshness(fresh)})
}

type healthResponse struct {
	Status   string `json:"status"`
	Postgres string `json:"postgres"`
	Redis    string `json:"redis"`
}

// handleHealth is GET /healthz: 200 when PostgreSQL and Redis both answer
// a ping, 503 otherwise. The errors go to the log only: pgx's connect
// errors name the host, database and user, which an unauthenticated
// endpoint must not hand out.
func (s *Service) handleHealth(w http.ResponseWriter, r *http.Request) {
	// Both pings at once, each with its own deadline: a slow PostgreSQL
	// must neither use up Redis's time nor get Redis named as down.
	ping := func(name string, f func(context.Context) error) <-chan bool {
		ok := make(chan bool, 1)
		go func() {
			ctx, cancel := context.WithTimeout(r.Context(), pingTimeout)
			defer cancel()
			err := f(ctx)
			if err != nil {
				s.logger.Warn("healthz: "+name+" ping failed", slog.Any("err", err))
			}
			ok <- err == nil
		}()
		return ok
	}
	pgOK := ping("postgres", s.pool.Ping)
	// Redis's ping reads the board's key, as redisUnreachable does: on a
	// Cluster a PING goes to any node, which answers it while the board's
	// slot cannot be served.
	redisOK := ping("redis", func(ctx context.Context) error { return s.rdb.Exists(ctx, s.board.SortedSetKey()).Err() })
	resp := healthResponse{Status: "ok", Postgres: "ok", Redis: "ok"}
	status := http.StatusOK
	if !<-pgOK {
		resp.Status, resp.Postgres, status = "unavailable", "unavailable", http.StatusServiceUnavailable
	}
	if !<-redisOK {
		resp.Status, resp.Redis, status = "unavailable", "unavailable", http.StatusServiceUnavailable
	}
	writeJSON(w, status, resp)
}

// statsJSON is the outbox backlog and projection lag, for /stats and the
// stats subcommand.
type statsJSON struct {
	Board              string        `json:"board"`
	At                 time.Time     `json:"at"`
	Pending            int64         `json:"pending"`
	InFlight           int64         `json:"in_flight"`
	Retrying           int64         `json:"retrying"`
	OldestPendingAgeMS float64       `json:"oldest_pending_age_ms"`
	DeadLetters        int64         `json:"dead_letters"`
	Freshness          freshnessJSON `json:"freshness"`
}

func toStats(board string, snap *statsSnapshot) statsJSON {
	return statsJSON{
		Board:              board,
		At:                 snap.At.UTC(),
		Pending:            snap.Outbox.Pending,
		InFlight:           snap.Outbox.InFlight,
		Retrying:           snap.Outbox.Retrying,
		OldestPendingAgeMS: float64(snap.Outbox.OldestPendingAge) / float64(time.Millisecond),
		DeadLetters:        snap.Outbox.DeadLetters,
		Freshness:          toFreshness(snap.Freshness),
	}
}

// handleStats is GET /stats.
func (s *Service) handleStats(w http.ResponseWriter, r *http.Request) {
	snap := s.snapshot(r.Context())
	if snap.Err != nil {
		s.writeError(w, r, snap.Err)
		return
	}
	writeJSON(w, http.StatusOK, toStats(s.board.Name(), snap))
}

type lastReconcileResponse struct {
	EverySeconds float64           `json:"every_seconds"`
	Sample       int               `json:"sample"`
	NextRun      *time.Time        `json:"next_run"`
	Last         *reconcileSummary `json:"last"`
}

// handleLastReconcile is GET /reconcile/last.
func (s *Service) handleLastReconcile(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, lastReconcileResponse{
		EverySeconds: s.cfg.ReconcileEvery.Seconds(),
		Sample:       s.cfg.ReconcileSample,
		NextRun:      s.nextReconcile.Load(),
		Last:         s.lastReconcile.Load(),
	})
}

// statusClientClosedRequest (nginx's 499) is what the request counter
// records for a request whose client went away before its answer: no one
// received a 503, and hang-ups must not feed the 5xx rate an availability
// alert watches.
const statusClientClosedRequest = 499

// writeTimeout answers a request that RequestTimeout cut off: 503, retry
// shortly. A submit cut off may have committed, so its answer says to
// retry with the same Idempotency-Key: a new key would apply it twice.
// err is what the request met, for the log.
func (s *Service) writeTimeout(w http.ResponseWriter, r *http.Request, err error) {
	s.logger.Warn("request timed out", slog.String("method", r.Method), slog.String("path", r.URL.Path),
		slog.Duration("timeout", s.cfg.RequestTimeout), slog.Any("err", err))
	w.Header().Set("Retry-After", "1")
	if r.URL.Path == "/scores" {
		s.metrics.countSubmit(r.Context(), "error")
		writeJSON(w, http.StatusServiceUnavailable, errorResponse{Error: submitTimedOut})
		return
	}
	writeJSON(w, http.StatusServiceUnavailable, errorResponse{Error: "the request took too long; retry shortly"})
}

const submitTimedOut = "the request took too long, and the score may or may not have been applied; retry with the same Idempotency-Key"

// writeError maps the leaderboard's errors to HTTP answers. It is the one
// place that decides which error is the client's and which is ours.
func (s *Service) writeError(w http.ResponseWriter, r *http.Request, err error) {
	var (
		invalid  *leaderboard.ValidationError
		conflict *leaderboard.IdempotencyConflictError
		rangeErr *leaderboard.ScoreOutOfRangeError
		stale    *leaderboard.StaleError
	)
	switch {
	case errors.As(err, &invalid):
		s.metrics.countSubmit(r.Context(), "invalid")
		writeJSON(w, http.StatusUnprocessableEntity, errorResponse{Field: requestField(invalid.Field), Error: invalid.Reason})
	case errors.As(err, &rangeErr):
		s.metrics.countSubmit(r.Context(), "invalid")
		writeJSON(w, http.StatusUnprocessableEntity, errorResponse{Field: "delta",
			Error: fmt.Sprintf("the resulting score would leave [%d, %d]", leaderboard.MinScore, leaderboard.MaxScore)})
	case errors.As(err, &conflict):
		s.metrics.countSubmit(r.Context(), "conflict")
		writeJSON(w, http.StatusConflict, errorResponse{EventID: conflict.EventID.String(),
			Error: "this Idempotency-Key was already used for a different score event; use a new key for a new event"})
	case errors.Is(err, leaderboard.ErrIdempotencyConflict):
		// Without the typed error: another writer of the outbox has a row
		// with the event id still in the outbox table. Only that row shows
		// the clash (once delivered and deleted, the key is accepted), so
		// the client is told to use a new key, not to retry.
		s.metrics.countSubmit(r.Context(), "conflict")
		writeJSON(w, http.StatusConflict, errorResponse{
			Error: "this Idempotency-Key is used by another writer of the outbox for an event still in its table; use a new key for a new event"})
	case errors.Is(err, leaderboard.ErrInvalidCursor):
		writeJSON(w, http.StatusUnprocessableEntity, errorResponse{Field: "cursor", Error: "not a cursor of this leaderboard; pass next_cursor as returned"})
	case errors.Is(err, leaderboard.ErrInvalidLimit):
		writeJSON(w, http.StatusUnprocessableEntity, errorResponse{Field: "limit", Error: err.Error()})
	case errors.Is(err, leaderboard.ErrUserNotFound), errors.Is(err, leaderboard.ErrInvalidReadOption):
		// The service's only read option that can be invalid is
		// at_least's user id, and handleRank answers the ids the board
		// refuses before reading; should the board's rules outgrow
		// boardRefusesUserID, such an id still has no score.
		var notFound *leaderboard.UserNotFoundError
		if errors.As(err, &notFound) && notFound.Freshness.Source != "" {
			fresh := toFreshness(notFound.Freshness)
			writeJSON(w, http.StatusNotFound, errorResponse{Error: userNotFound, Freshness: &fresh})
			return
		}
		writeUserNotFound(w)
	case errors.Is(context.Cause(r.Context()), errRequestTimeout):
		// Ours, not the client's: it is still waiting for an answer. A
		// submit cut short may or may not have committed; retrying it with
		// the same Idempotency-Key is safe either way. Checked before the
		// stale case: under FailClosed a read that the deadline cut short
		// can fail as stale (the lag or version it waited for was not
		// reached in time), and "catching up" would give the client the
		// wrong reason and keep the timeout out of the log.
		s.writeTimeout(w, r, err)
	case errors.As(err, &stale) && stale.Unverified && s.redisUnreachable(r.Context()) && r.Context().Err() == nil:
		// Unverified because Verify's record could not be read: Redis is
		// down or cannot serve (a replica cut off from its master), which
		// no reconcile can mend. An outage to wait out, as for any read
		// whose store cannot be reached.
		s.logger.Warn("read failed: Redis cannot be reached to check the board is verified", slog.String("path", r.URL.Path))
		w.Header().Set("Retry-After", "1")
		writeJSON(w, http.StatusServiceUnavailable, errorResponse{Error: "the leaderboard's store cannot be reached; retry shortly"})
	case errors.As(err, &stale) && !stale.Unverified && stale.Lag < 0 && s.postgresUnreachable(r.Context()) && r.Context().Err() == nil:
		// The lag could not be measured because PostgreSQL cannot be
		// asked: an outage to wait out, not a projection catching up
		// (nor can the relay run to catch it up).
		s.logger.Warn("read failed: PostgreSQL cannot be reached to measure the projection's lag", slog.String("path", r.URL.Path))
		w.Header().Set("Retry-After", "1")
		writeJSON(w, http.StatusServiceUnavailable, errorResponse{Error: "the leaderboard's store cannot be reached; retry shortly"})
	case r.Context().Err() != nil:
		// The client went away; nobody reads the answer (it may have
		// left during the probe above, or after a stale read). A submit cut
		// short may have committed: counted like a timeout.
		if r.URL.Path == "/scores" {
			s.metrics.countSubmit(r.Context(), "error")
		}
		w.WriteHeader(statusClientClosedRequest)
	case errors.As(err, &stale) && stale.Unverified && s.cfg.ReconcileEvery == 0:
		// Nothing in this process will verify the board: an operator's
		// 'reconcile --verify' will, at a time no Retry-After can name.
		writeJSON(w, http.StatusServiceUnavailable, errorResponse{Error: "the leaderboard is not verified (a new board, Redis lost its data or cannot be read, or PostgreSQL is not the database last verified against) and this service runs no reconcile; if it stays so while Redis answers, an operator must run 'reconcile --verify'"})
	case errors.As(err, &stale) && stale.Unverified:
		// Waiting for a verifying pass, which the scheduled reconcile runs
		// (every ReconcileEvery), not for the worker: retry after it.
		retry := max(1, int(s.cfg.ReconcileEvery.Round(time.Second)/time.Second))
		w.Header().Set("Retry-After", strconv.Itoa(retry))
		writeJSON(w, http.StatusServiceUnavailable, errorResponse{Error: "the leaderboard is not verified (a new board, Redis lost its data or cannot be read, or PostgreSQL is not the database last verified against); retry later"})
	case errors.As(err, &stale):
		w.Header().Set("Retry-After", "1")
		writeJSON(w, http.StatusServiceUnavailable, errorResponse{Error: "the leaderboard is catching up; retry shortly"})
	case errors.Is(err, leaderboard.ErrOutcomeUnknown) && r.Context().Err() == nil:
		// The connection to PostgreSQL broke after the command was sent:
		// it may have been applied. The same Idempotency-Key tells.
		s.metrics.countSubmit(r.Context(), "error")
		s.logger.Warn("submit outcome unknown", slog.Any("err", err))
		w.Header().Set("Retry-After", "1")
		writeJSON(w, http.StatusServiceUnavailable, errorResponse{Error: "the database connection broke after the score was sent, so it may have been applied; retry with the same Idempotency-Key"})
	case r.Method == http.MethodPost && unreachable(err):
		// PostgreSQL refused the connection, had no slot, ended the
		// session (57P01 and the like) or took only reads (25006): an
		// outage to wait out, not a fault. The retry with the same key is safe whatever happened
		// (a break after the command was sent is ErrOutcomeUnknown, above).
		s.metrics.countSubmit(r.Context(), "error")
		s.logger.Warn("submit failed: PostgreSQL cannot be reached, ended the session or takes only reads", slog.Any("err", err))
		w.Header().Set("Retry-After", "1")
		writeJSON(w, http.StatusServiceUnavailable, errorResponse{Error: "the database cannot take the score now (unreachable, restarting or read-only); retry with the same Idempotency-Key"})
	case (r.Method == http.MethodGet || r.Method == http.MethodHead) && s.outage(err):
		// A read under ServeStale or FailClosed whose Redis (or, falling
		// back, PostgreSQL) cannot be reached: an outage the client can
		// wait out, not a fault in this service.
		s.logger.Warn("read failed: a store cannot be reached", slog.String("path", r.URL.Path), slog.Any("err", err))
		w.Header().Set("Retry-After", "1")
		writeJSON(w, http.StatusServiceUnavailable, errorResponse{Error: "the leaderboard's store cannot be reached; retry shortly"})
	default:
		if r.URL.Path == "/scores" {
			s.metrics.countSubmit(r.Context(), "error")
		}
		s.logger.Error("request failed", slog.String("method", r.Method), slog.String("path", r.URL.Path), slog.Any("err", err))
		writeJSON(w, http.StatusInternalServerError, errorResponse{Error: "internal error"})
	}
}

// redisUnreachable reports whether Redis fails a read of the board's key
// (within pingTimeout) with an error unreachable classes as an outage. A
// keyed read, not a PING: a cluster client sends PING to any one node,
// and a node answers PING while the cluster is down for keys
// (CLUSTERDOWN), so neither says whether the node serving the board's
// slot can serve it.
func (s *Service) redisUnreachable(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, pingTimeout)
	defer cancel()
	err := s.rdb.Exists(ctx, s.board.SortedSetKey()).Err()
	return err != nil && s.outage(err)
}

// outage reports whether err, from a read, is an outage to wait out
// (unreachable's classes) for this service's Redis client: a redirect
// (MOVED, ASK) is one only for a cluster client, whose reads pinned to
// masters meet it while a slot is being moved. A single-server client
// pointed at a cluster node (--redis-url without --redis-cluster) is
// redirected for good: a fault to fix.
func (s *Service) outage(err error) bool {
	if !unreachable(err) {
		return false
	}
	if _, cluster := s.rdb.(*redis.ClusterClient); cluster {
		return true
	}
	_, moved := redis.IsMovedError(err)
	_, ask := redis.IsAskError(err)
	return !moved && !ask
}

// postgresUnreachable reports whether PostgreSQL fails a ping (within
// pingTimeout) with an error unreachable classes as an outage.
func (s *Service) postgresUnreachable(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, pingTimeout)
	defer cancel()
	err := s.pool.Ping(ctx)
	return err != nil && unreachable(err)
}

// pgBouncerOutages begin the messages of the 08P01 errors that PgBouncer
// (1.18) answers a new connection with while PostgreSQL cannot take it:
// outages to wait out, unlike its relabelled refusals of a missing
// database or a failed login. They are English: with a translated
// lc_messages on the PostgreSQL behind it, the relabelled ones are not
// recognised, and are answered 500.
var pgBouncerOutages = []string{
	"server login has been failing",
	"query_wait_timeout",
	"pgbouncer cannot connect to server",
	"client_login_timeout (server down)",
	"no more connections allowed",     // its max_client_conn, as 53300
	"the database system is",          // PostgreSQL's 57P03: starting up, shutting down, in recovery
	"sorry, too many clients already", // PostgreSQL's 53300
	"remaining connection slots are reserved",
	"too many connections for",
}

// unreachable reports whether err says a store could not be reached or its
// connection broke: a refused or timed-out dial, a reset, closed or broken
// connection (a system call's errno is a net.Error), a Redis pool that
// found no connection in time, a Ring whose shards are all down, or a
// Redis reply saying it cannot serve the key for now (unavailableReplies).
// A Redis at maxclients closes a new connection after its reply saying
// so: the client reads either, or a broken pipe. Any
// other answer of PostgreSQL's (a missing database, a refused password,
// even while connecting), and a server certificate the client's TLS
// settings refuse, are faults to fix, not outages to wait out.
// A connection exception (class 08, PgBouncer's 08P01) is an outage,
// except while connecting, where only pgBouncerOutages are.
// certificateRefused reports whether err is a TLS handshake that failed
// on the server's certificate: crypto/tls's own check (sslmode=verify-full),
// or pgx's (verify-ca), which returns x509's errors unwrapped.
func certificateRefused(err error) bool {
	var (
		verification *tls.CertificateVerificationError
		authority    x509.UnknownAuthorityError
		hostname     x509.HostnameError
		invalid      x509.CertificateInvalidError
	)
	return errors.As(err, &verification) || errors.As(err, &authority) ||
		errors.As(err, &hostname) || errors.As(err, &invalid)
}

func unreachable(err error) bool {
	var (
		pgErr      *pgconn.PgError
		netErr     net.Error
		connectErr *pgconn.ConnectError
		reply      redis.Error
	)
	switch {
	case errors.As(err, &pgErr):
		// Except a server starting up, shutting down or in recovery
		// (cannot_connect_now), out of connection slots, one that
		// ended the session (an administrator's terminate, a fast
		// shutdown, a crashed sibling backend), or one that takes only
		// reads (a standby, or a primary demoted in a switchover, until
		// the pool's connections reach the new one): outages to wait out,
		// as Redis's LOADING. The pool replaces the connection. So is a
		// connection exception (class 08): behind PgBouncer, a PostgreSQL
		// that cannot be reached is its 08P01 (query_wait_timeout,
		// "server login has been failing", "server conn crashed?").
		switch pgErr.Code {
		case "57P01", "57P02", "57P03", "53300", "25006":
			return true
		}
		if !strings.HasPrefix(pgErr.Code, "08") {
			return false
		}
		// While connecting, PgBouncer relabels PostgreSQL's own refusals
		// 08P01 too: a missing database or a failed login is a fault,
		// while its words for a server it cannot reach, its own client
		// limit, and PostgreSQL's 57P03 and 53300 relabelled are outages.
		if !errors.As(err, &connectErr) {
			return true
		}
		for _, prefix := range pgBouncerOutages {
			if strings.HasPrefix(pgErr.Message, prefix) {
				return true
			}
		}
		return false
	case errors.As(err, &reply) && !errors.Is(err, redis.Nil):
		for _, prefix := range unavailableReplies {
			if strings.HasPrefix(reply.Error(), prefix) {
				return true
			}
		}
		return false
	}
	// A server certificate that the client's TLS settings refuse (an
	// unknown CA, a name not in it) is a fault to fix, as a refused
	// password is: no retry connects.
	if certificateRefused(err) {
		return false
	}
	return errors.As(err, &netErr) || errors.As(err, &connectErr) ||
		errors.Is(err, redis.ErrPoolTimeout) || errors.Is(err, redis.ErrClosed) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, pgconn.ErrConnClosed) || // a connection that broke under a statement
		hasText(err, ringShardsDown)
}

// hasText reports whether err or an error it wraps reads text.
func hasText(err error, text string) bool {
	if err == nil {
		return false
	}
	if err.Error() == text {
		return true
	}
	switch u := err.(type) {
	case interface{ Unwrap() error }:
		return hasText(u.Unwrap(), text)
	case interface{ Unwrap() []error }:
		for _, e := range u.Unwrap() {
			if hasText(e, text) {
				return true
			}
		}
	}
	return false
}

// ringShardsDown is go-redis's error (unexported, so compared by text) of
// a Ring with no shard up.
const ringShardsDown = "redis: all ring shards are down"

// unavailableReplies start the Redis error replies of a server that cannot
// serve a key for now: a cluster that lost a slot's master, a server
// loading its dataset after a restart, a replica cut off from its master,
// a slot being moved, a server held by a long-running script, a server
// with no client slot left (maxclients). A slot being moved also answers
// with the redirect itself (MOVED, ASK) a read pinned to masters cannot
// follow (a cluster client that reads from replicas, during a migration);
// to any other client a redirect is for good (Service.outage).
var unavailableReplies = []string{"CLUSTERDOWN ", "LOADING ", "MASTERDOWN ", "TRYAGAIN ", "MOVED ", "ASK ", "BUSY ", "ERR max number of clients reached"}

// writeUserNotFound is the 404 of GET /users/{id}/rank.
func writeUserNotFound(w http.ResponseWriter) {
	writeJSON(w, http.StatusNotFound, errorResponse{Error: userNotFound})
}

const userNotFound = "user has no score on this leaderboard"

// boardRefusesUserID reports whether the board would refuse user as a
// Command.UserID (empty, longer than Config.MaxUserIDLength, not valid
// UTF-8, or holding a NUL byte): the board has these rules but does not
// export them.
func (s *Service) boardRefusesUserID(user string) bool {
	return user == "" || len(user) > s.board.Config().MaxUserIDLength ||
		!utf8.ValidString(user) || strings.IndexByte(user, 0) >= 0
}

// requestField names a Command field as the request spells it.
func requestField(commandField string) string {
	switch commandField {
	case "EventID":
		return "Idempotency-Key"
	case "UserID":
		return "user_id"
	case "Delta":
		return "delta"
	}
	return commandField
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
