package services

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"strings"
	"time"
	"unicode"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/redis/go-redis/v9"
)

// Defaults tried after the environment variables.
const (
	DefaultPostgresURL = "postgres://postgres@127.0.0.1:5432/postgres"
	DefaultRedisURL    = "redis://127.0.0.1:6379/0"
)

// Origin says where a resolved server came from.
type Origin string

// The origins, in the order Resolve tries them.
const (
	OriginEnv     Origin = "env"     // the URL in the environment variable
	OriginLocal   Origin = "local"   // a server already answering at the local URL
	OriginPrivate Origin = "private" // a server started from local binaries
	OriginDocker  Origin = "docker"  // a server started in a container
)

var (
	// ErrUnavailable is returned when no step of the resolution yields a server.
	ErrUnavailable = errors.New("services: no server available")

	// errPasswordNotInURLSyntax is why a Redis URL is refused when only its
	// password is (see parseRedacted).
	errPasswordNotInURLSyntax = errors.New("the password is not valid in a URL (percent-encode characters such as / ? # % and spaces)")

	// errURLShape is why a Redis URL is refused, unquoted, when it has an
	// '@' but no "scheme:/" start to find its userinfo from (see
	// parseRedacted).
	errURLShape = errors.New("not a URL of the form redis://[[user]:password@]host[:port][/db]")
)

// Options tune Resolve.
type Options struct {
	// PostgresEnv and RedisEnv name the environment variables consulted
	// first. Defaults to DATABASE_URL and REDIS_URL.
	PostgresEnv, RedisEnv string
	// LocalPostgresURL and LocalRedisURL are the conventional local servers
	// tried after the environment. Defaults to DefaultPostgresURL and
	// DefaultRedisURL.
	LocalPostgresURL, LocalRedisURL string
	// Getenv reads the environment. Defaults to os.Getenv.
	Getenv func(string) string
	// Dir is where private servers keep their files. Defaults to a new
	// directory under os.TempDir(), removed by Close.
	Dir string
	// Logger receives one line per resolved service. Defaults to discarding.
	Logger *slog.Logger
	// SkipPostgres and SkipRedis leave that server out: the caller has one
	// of its own (a URL from a flag, say), so Resolve neither consults the
	// environment for it, nor pings, nor starts anything, and leaves its
	// URL and Origin empty.
	SkipPostgres, SkipRedis bool
}

// Endpoints are resolved servers. Close stops whatever Resolve started.
type Endpoints struct {
	PostgresURL    string
	RedisURL       string
	PostgresOrigin Origin
	RedisOrigin    Origin

	closers []func()
}

// Close stops private servers and containers started by Resolve. It is safe to
// call more than once.
func (e *Endpoints) Close() {
	for i := len(e.closers) - 1; i >= 0; i-- {
		e.closers[i]()
	}
	e.closers = nil
}

// Resolve finds a PostgreSQL and a Redis server as described in the package
// documentation.
func Resolve(ctx context.Context, opts Options) (*Endpoints, error) {
	if opts.PostgresEnv == "" {
		opts.PostgresEnv = "DATABASE_URL"
	}
	if opts.RedisEnv == "" {
		opts.RedisEnv = "REDIS_URL"
	}
	if opts.Getenv == nil {
		opts.Getenv = os.Getenv
	}
	if opts.LocalPostgresURL == "" {
		opts.LocalPostgresURL = DefaultPostgresURL
	}
	if opts.LocalRedisURL == "" {
		opts.LocalRedisURL = DefaultRedisURL
	}
	logger := opts.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	ep := &Endpoints{}
	var err error
	if !opts.SkipPostgres {
		ep.PostgresURL, ep.PostgresOrigin, err = resolveOne(ctx, ep, opts, opts.PostgresEnv, opts.LocalPostgresURL, pingPostgres, pingPostgres, startPrivatePostgres, startDockerPostgres)
		if err != nil {
			ep.Close()
			return nil, fmt.Errorf("postgres: %w", err)
		}
	}
	if !opts.SkipRedis {
		ep.RedisURL, ep.RedisOrigin, err = resolveOne(ctx, ep, opts, opts.RedisEnv, opts.LocalRedisURL, redisAnswers, pingRedis, startPrivateRedis, startDockerRedis)
		if err != nil {
			ep.Close()
			return nil, fmt.Errorf("redis: %w", err)
		}
	}
	logger.Info("services resolved",
		slog.String("postgres", string(ep.PostgresOrigin)), slog.String("redis", string(ep.RedisOrigin)))
	return ep, nil
}

type starter func(ctx context.Context, dir string) (url string, stop func(), err error)

// resolveOne finds one server: answers checks the URL in env, ping the
// local default (which must answer in full: a server its default user may
// not use is no server to test with).
func resolveOne(ctx context.Context, ep *Endpoints, opts Options, env, def string,
	answers, ping func(context.Context, string) error, private, docker starter,
) (string, Origin, error) {
	if u := strings.TrimSpace(opts.Getenv(env)); u != "" {
		// An explicit URL is never second-guessed: if it does not answer,
		// that is an error, not a reason to use something else.
		if err := answers(ctx, u); err != nil {
			return "", "", fmt.Errorf("%s is set but does not answer: %w", env, err)
		}
		return u, OriginEnv, nil
	}
	if ping(ctx, def) == nil {
		return def, OriginLocal, nil
	}
	var errs []error
	for _, s := range []struct {
		origin Origin
		start  starter
	}{{OriginPrivate, private}, {OriginDocker, docker}} {
		u, stop, err := s.start(ctx, opts.Dir)
		if err != nil {
			if ctx.Err() != nil {
				// Interrupted (Ctrl-C, SIGTERM): that is the error, not a
				// missing server, and nothing else is worth starting.
				if cause := context.Cause(ctx); cause != ctx.Err() {
					return "", "", fmt.Errorf("starting a %s server: %w: %w", s.origin, ctx.Err(), cause)
				}
				return "", "", fmt.Errorf("starting a %s server: %w", s.origin, ctx.Err())
			}
			errs = append(errs, fmt.Errorf("%s: %w", s.origin, err))
			continue
		}
		ep.closers = append(ep.closers, stop)
		return u, s.origin, nil
	}
	return "", "", fmt.Errorf("%w (%s unset, %s not answering; %w)", ErrUnavailable, env, redactURL(def), errors.Join(errs...))
}

func pingPostgres(ctx context.Context, url string) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return HidePostgresConnString(err)
	}
	defer conn.Close(context.Background())
	return conn.Ping(ctx)
}

func pingRedis(ctx context.Context, url string) error {
	opt, err := ParseRedisURL(url)
	if err != nil {
		return err
	}
	opt.MaxRetries = -1
	c := redis.NewClient(opt)
	defer c.Close()
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	return c.Ping(ctx).Err()
}

// redisAnswers is pingRedis for a URL the user gave, whose user may lack
// PING: the README's "Redis permissions" lists only the commands a program
// needs, and no PING. Its NOPERM for PING is an answer. A NOPERM for a
// command of the connection's handshake (SELECT for a /db, CLIENT SETNAME
// for client_name=) is none: every command on such a connection fails.
func redisAnswers(ctx context.Context, url string) error {
	err := pingRedis(ctx, url)
	if redis.HasErrorPrefix(err, "NOPERM") && strings.Contains(err.Error(), "'ping' command") {
		return nil
	}
	return err
}

// ParseRedisURL is redis.ParseURL with an error that holds no part of the
// URL's password (see parseRedacted), for a URL a user gave.
func ParseRedisURL(rawURL string) (*redis.Options, error) {
	return parseRedacted(rawURL, redis.ParseURL)
}

// ParseRedisClusterURL is redis.ParseClusterURL with an error that holds no
// part of the URL's password (see parseRedacted).
func ParseRedisClusterURL(rawURL string) (*redis.ClusterOptions, error) {
	return parseRedacted(rawURL, redis.ParseClusterURL)
}

// parseRedacted calls parse and, when it fails, reports the failure without
// the password of rawURL. parse's own error cannot be trusted with it:
// net/url's *url.Error quotes the URL whole, and a password holding a
// reserved character ('/', '?', '#') cuts the authority short, so a piece of
// it comes back as the port (`invalid port ":pa" after host`) or in the path
// go-redis quotes. The error reported is instead the one of parsing the
// redacted URL, which holds nothing secret; when that one parses, the
// password alone was at fault, and the error says so. A URL with no password
// keeps parse's error, and so does one whose last '@' follows a '/', '?' or
// '#' (so may sit in the query rather than end a userinfo), when that error
// quotes no piece of what would be the password.
func parseRedacted[T any](rawURL string, parse func(string) (T, error)) (T, error) {
	opt, err := parse(rawURL)
	if err == nil {
		return opt, nil
	}
	var zero T
	i, j, exact, ok := findPassword(rawURL)
	switch {
	case i < 0 && strings.Contains(rawURL, "@"):
		return zero, &url.Error{Op: "parse", URL: hiddenURL, Err: errURLShape}
	case !ok, !exact && !quotesPiece(err.Error(), rawURL[i:j]):
		return zero, err
	}
	redacted := redactURL(rawURL)
	if _, err := parse(redacted); err != nil {
		return zero, err
	}
	return zero, &url.Error{Op: "parse", URL: redacted, Err: errPasswordNotInURLSyntax}
}

// hiddenConnString stands in pgx's parse error for a keyword/value
// connection string.
const hiddenConnString = "(keyword/value connection string not shown: it may hold a password)"

// HidePostgresConnString hides the connection string pgx put in err (a
// *pgconn.ParseConfigError) when it is a keyword/value string, and returns
// err. pgx masks only "password=value" there, not "password = value"
// (libpq allows spaces around '='), "password= value", the rest of a value
// after an escaped space, nor sslpassword's; and it quotes the word it
// took for a keyword without '=', which after an unquoted password holding
// a space is the rest of the password. A URL keeps pgx's masking, which
// follows the URL's structure.
func HidePostgresConnString(err error) error {
	var pce *pgconn.ParseConfigError
	if errors.As(err, &pce) && !strings.HasPrefix(pce.ConnString, "postgres://") && !strings.HasPrefix(pce.ConnString, "postgresql://") {
		pce.ConnString = hiddenConnString
		// pgx quotes the word it took for a keyword without '=': after an
		// unquoted password holding a space, the rest of the password.
		if inner := errors.Unwrap(pce); inner != nil && strings.HasPrefix(inner.Error(), `missing "=" after `) {
			*pce = *pgconn.NewParseConfigError(hiddenConnString, "failed to parse as keyword/value",
				errors.New(`missing "=" after a word (not shown: it may be part of a password; quote a value holding spaces)`)).(*pgconn.ParseConfigError)
		}
	}
	return err
}

// hiddenURL stands in an error for a URL whose userinfo cannot be told apart
// from the rest, as it has no "scheme:/" to start from.
const hiddenURL = "(URL not shown: it may hold a password)"

// redactURL drops any password from a URL before it goes into an error.
func redactURL(u string) string {
	i, j, _, ok := findPassword(u)
	switch {
	case ok:
		return u[:i] + "xxxxx" + u[j:]
	case i < 0 && strings.Contains(u, "@"):
		return hiddenURL
	}
	return u
}

// findPassword finds the password of u's userinfo, u[i:j], with ok false if
// the userinfo holds none, and i -1 if u does not start with a scheme and a
// slash. The userinfo follows the scheme ("redis:" and any number of
// slashes, as "redis:/" is a typo net/url reads as a path) and ends at the
// last '@'. When a '/', '?' or '#' comes before that '@', the '@' may end a
// userinfo whose password holds the character, or belong to the path, query
// or fragment of a URL with no password: exact is false.
func findPassword(u string) (i, j int, exact, ok bool) {
	start := schemeEnd(u)
	if start < 0 {
		return -1, -1, false, false
	}
	at := strings.LastIndexByte(u[start:], '@')
	if at < 0 {
		return start, start, true, false
	}
	userinfo := u[start : start+at]
	colon := strings.IndexByte(userinfo, ':')
	if colon < 0 {
		return start, start, true, false
	}
	return start + colon + 1, start + at, !strings.ContainsAny(userinfo, "/?#"), true
}

// schemeEnd is the index past u's scheme, its ':' and the slashes after
// it, or -1 if u does not start with a scheme followed by a slash.
func schemeEnd(u string) int {
	colon := strings.IndexByte(u, ':')
	if colon < 1 || !strings.HasPrefix(u[colon+1:], "/") {
		return -1
	}
	for k, c := range u[:colon] {
		letter := 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z'
		if !letter && (k == 0 || !('0' <= c && c <= '9' || c == '+' || c == '-' || c == '.')) {
			return -1
		}
	}
	return colon + 1 + len(u[colon+1:]) - len(strings.TrimLeft(u[colon+1:], "/"))
}

// quotesPiece reports whether msg holds a run of letters or digits of
// secret, as an error quoting any part of it would (percent-decoding one
// still leaves the runs either side of the escape).
func quotesPiece(msg, secret string) bool {
	for _, piece := range strings.FieldsFunc(secret, func(r rune) bool {
		return !unicode.IsLetter(r) && !unicode.IsDigit(r)
	}) {
		if strings.Contains(msg, piece) {
			return true
		}
	}
	return false
}
