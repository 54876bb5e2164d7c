package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/services"
	"github.com/verity-go/verity/leaderboard"
	"github.com/verity-go/verity/projection"
	"github.com/verity-go/verity/reconcile"
)

// Flag defaults.
const (
	addrDefault            = "127.0.0.1:8080"
	boardDefault           = "global"
	reconcileEveryDefault  = 30 * time.Second
	reconcileSampleDefault = 200
)

// options are the flags of every subcommand; each subcommand registers the
// ones it uses.
type options struct {
	// Connection and board (every subcommand).
	databaseURL string
	redisURL    string
	cluster     bool
	board       string
	schema      string
	keyPrefix   string
	logLevel    string
	readPolicy  string
	maxLag      time.Duration

	// serve
	addr            string
	allowedHosts    string
	reconcileEvery  time.Duration
	reconcileSample int

	// getenv reads DATABASE_URL and REDIS_URL; nil means os.Getenv.
	getenv func(string) string

	// ops
	json   bool
	sample int
	dryRun bool
	limit  int

	requireVerified bool // serve, stats
	disableNotify   bool // serve
	verify          bool // reconcile
}

// omittedMeaning returns what a flag whose default is empty stands for
// when omitted, and whether it is one; given empty, such a flag is a
// usage error (parseFlags).
func omittedMeaning(flagName string) (string, bool) {
	switch flagName {
	case "database-url":
		return "$DATABASE_URL, then the local server, then a private one", true
	case "redis-url":
		return "$REDIS_URL, then the local server, then a private one", true
	case "key-prefix":
		return "the board's default prefix", true
	case "allowed-hosts":
		return "the default hosts", true
	}
	return "", false
}

func parseFlags(name string, args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("leaderboard-service "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.databaseURL, "database-url", "", "PostgreSQL URL (default $DATABASE_URL, then the local server, then a private one)")
	fs.StringVar(&o.redisURL, "redis-url", "", "Redis URL (default $REDIS_URL, then the local server, then a private one)")
	fs.BoolVar(&o.cluster, "redis-cluster", false, "--redis-url (else $REDIS_URL) names a Redis Cluster: redis://host:port?addr=host2:port2&addr=...")
	fs.StringVar(&o.board, "board", boardDefault, "leaderboard name")
	fs.StringVar(&o.schema, "schema", leaderboard.SchemaDefault, "PostgreSQL schema of the board and outbox tables")
	// Empty leaves the prefix to the board, which keeps boards of one name
	// in different schemas apart.
	fs.StringVar(&o.keyPrefix, "key-prefix", "", "prefix of the board's Redis keys (default "+leaderboard.KeyPrefixDefault+" in schema public, else "+leaderboard.KeyPrefixDefault+"<schema>:)")
	fs.StringVar(&o.logLevel, "log-level", "info", "debug, info, warn or error (logs go to stderr)")
	switch name {
	case "serve":
		fs.StringVar(&o.addr, "addr", addrDefault, "HTTP listen address")
		fs.StringVar(&o.allowedHosts, "allowed-hosts", "",
			"comma-separated host names a request's Host header may name; others are answered 421 (default: localhost, 127.0.0.1, ::1 and --addr's host when that is a loopback address, else any; '*': any)")
		fs.StringVar(&o.readPolicy, "read-policy", leaderboard.ReadPolicyDefault.String(),
			"what reads do when the projection lags more than --max-lag: serve-stale, fallback-to-postgres or fail-closed")
		fs.DurationVar(&o.maxLag, "max-lag", leaderboard.MaxLagDefault, "largest projection lag at which Redis answers count as fresh; must exceed the lag probe interval (leaderboard.LagProbeIntervalDefault, 100ms)")
		fs.DurationVar(&o.reconcileEvery, "reconcile-every", reconcileEveryDefault, "interval of the sampled reconcile (0 disables it)")
		fs.IntVar(&o.reconcileSample, "reconcile-sample", reconcileSampleDefault, "rows checked by each scheduled reconcile")
		fs.BoolVar(&o.disableNotify, "disable-notify", false,
			"find new outbox rows by polling only, without LISTEN (outbox.RelayConfig.DisableNotify): needed behind a transaction-pooling proxy such as PgBouncer in transaction mode")
		fs.BoolVar(&o.requireVerified, "require-verified", false,
			"treat the projection as stale until a full pass has verified it (leaderboard.Config.RequireVerifiedProjection); the scheduled reconcile then runs that pass while it is unverified, bounded by --reconcile-every (for a board whose pass takes longer, raise it; or set it to 0 on every instance and run 'reconcile --verify': a running instance replaces a pass it finds unchanged an interval later)")
	case "reconcile":
		fs.IntVar(&o.sample, "sample", 0, "check N random rows instead of the whole board (0 = full pass)")
		fs.BoolVar(&o.dryRun, "dry-run", false, "classify and report, repair nothing")
		fs.BoolVar(&o.verify, "verify", false, "run a full pass and, if it repaired everything, record the projection as verified (Board.Verify; for --require-verified); exits 3 if it ran but did not verify")
	case "replay-dead":
		fs.IntVar(&o.limit, "limit", 0, "move at most N dead letters, oldest first (0 = all)")
	case "stats":
		fs.BoolVar(&o.requireVerified, "require-verified", false,
			"measure the lag as a service run with --require-verified does: unknown while the projection is not verified")
	}
	if name != "serve" {
		fs.BoolVar(&o.json, "json", false, "print JSON for scripts instead of text")
	}
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "leaderboard-service %s: unexpected argument %q\n", name, fs.Arg(0))
		fs.Usage()
		return nil, errors.New("unexpected arguments")
	}
	if o.sample < 0 || o.limit < 0 || o.reconcileSample < 0 || o.reconcileEvery < 0 || o.maxLag < 0 {
		fmt.Fprintf(stderr, "leaderboard-service %s: --sample, --limit, --reconcile-sample, --reconcile-every and --max-lag must not be negative\n", name)
		return nil, errors.New("negative flag")
	}
	// As for --schema below: an empty value is an unset variable, not a
	// request for the default (serve-stale, where fail-closed may have
	// been meant). Only serve has the flag.
	if name == "serve" && o.readPolicy == "" {
		fmt.Fprintf(stderr, "leaderboard-service %s: --read-policy must not be empty (omit it for %s)\n", name, leaderboard.ReadPolicyDefault)
		return nil, errors.New("empty --read-policy")
	}
	if _, err := parseReadPolicy(o.readPolicy); err != nil {
		fmt.Fprintf(stderr, "leaderboard-service %s: --read-policy: %v\n", name, err)
		return nil, err
	}
	// Checked here, not when the board is built, so that they are usage
	// errors (exit 2) found before anything connects.
	usage := func(format string, args ...any) (*options, error) {
		err := fmt.Errorf(format, args...)
		fmt.Fprintf(stderr, "leaderboard-service %s: %v\n", name, err)
		return nil, err
	}
	if _, err := o.logger(io.Discard); err != nil {
		return usage("%v", err)
	}
	if o.board == "" {
		return usage("--board must not be empty")
	}
	// leaderboard.New's rules for Config.Name (the library exports no
	// check of it that needs no pool); for Config.Schema, the library's own
	// check through MigrationSQL, which refuses what Migrate and New refuse
	// (a NUL byte, more than PostgreSQL's 63 bytes...); and for
	// Config.KeyPrefix the check New makes through projection.NewKeyspace.
	// The library reads an empty Schema as the default; an empty flag is
	// more likely an unset variable ("--schema=$SCHEMA") than a request
	// for public, whose board the command would then act on.
	if o.schema == "" {
		return usage("--schema must not be empty (omit it for %s)", leaderboard.SchemaDefault)
	}
	// The same for the flags whose default is empty: given empty, the
	// servers would be looked for elsewhere (a server given by its flag
	// never is), the keys would be the board's default ones, not the
	// service's, and the host check would take its default (on a
	// non-loopback --addr, any host).
	var empty, meaning string
	fs.Visit(func(f *flag.Flag) {
		if m, ok := omittedMeaning(f.Name); ok && f.Value.String() == "" && empty == "" {
			empty, meaning = f.Name, m
			if f.Name == "redis-url" && o.cluster {
				meaning = "$REDIS_URL" // a cluster is never looked for locally, nor started
			}
		}
	})
	if empty != "" {
		return usage("--%s must not be empty (omit it for %s)", empty, meaning)
	}
	if len(o.board) > leaderboard.MaxNameLength || !utf8.ValidString(o.board) || strings.IndexByte(o.board, 0) >= 0 {
		return usage("--board must be valid UTF-8 without NUL bytes, at most %d bytes (got %d)", leaderboard.MaxNameLength, len(o.board))
	}
	if _, err := leaderboard.MigrationSQL(&leaderboard.Config{Schema: o.schema}); err != nil {
		var ce *leaderboard.ConfigError
		if errors.As(err, &ce) {
			return usage("--schema %s", ce.Reason)
		}
		return usage("--schema: %v", err)
	}
	if _, err := projection.NewKeyspace(o.keyPrefix); err != nil {
		var ce *projection.ConfigError
		if errors.As(err, &ce) {
			return usage("--key-prefix %s", ce.Reason)
		}
		return usage("--key-prefix: %v", err)
	}
	// A URL that cannot be parsed is a usage error too, found before
	// anything connects (the pool and the client parse them again).
	if o.databaseURL != "" {
		if _, err := pgxpool.ParseConfig(o.databaseURL); err != nil {
			return usage("--database-url: %v", services.HidePostgresConnString(err))
		}
	}
	if o.redisURL != "" {
		// The services parsers: go-redis's errors can quote the password.
		parse := services.ParseRedisURL
		if o.cluster {
			parse = func(url string) (*redis.Options, error) {
				_, err := services.ParseRedisClusterURL(url)
				return nil, err
			}
		}
		if _, err := parse(o.redisURL); err != nil {
			return usage("--redis-url: %v", err)
		}
	}
	if name == "serve" {
		// A malformed address is a usage error, not a failure to listen.
		_, port, err := net.SplitHostPort(o.addr)
		if err != nil {
			return usage("--addr: %v", err)
		}
		if _, err := strconv.ParseUint(port, 10, 16); err != nil {
			return usage("--addr %q: the port must be a number from 0 to 65535 (0: any free port)", o.addr)
		}
		if _, err := o.hostAllowList(); err != nil {
			return usage("--allowed-hosts: %v", err)
		}
	}
	// reconcile.Reconciler.Run refuses a larger sample, after connecting
	// (for serve, at every scheduled run).
	for flagName, n := range map[string]int{"--sample": o.sample, "--reconcile-sample": o.reconcileSample} {
		if n > reconcile.SampleMax {
			return usage("%s %d is above reconcile.SampleMax (%d); use 0 for a full pass", flagName, n, reconcile.SampleMax)
		}
	}
	if o.verify && (o.sample > 0 || o.dryRun) {
		return usage("--verify runs a full pass that repairs: it cannot be combined with --sample or --dry-run")
	}
	if name == "serve" && o.maxLag <= leaderboard.LagProbeIntervalDefault {
		return usage("--max-lag %s must exceed the lag probe interval (%s)", o.maxLag, leaderboard.LagProbeIntervalDefault)
	}
	return o, nil
}

func (o *options) logger(w io.Writer) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(o.logLevel)); err != nil {
		return nil, fmt.Errorf("--log-level: %w", err)
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: level})), nil
}

// usageError is a usage error (exit 2) that only connect can see: one in
// the environment a flag leaves it to.
type usageError struct{ error }

func (e usageError) Unwrap() error { return e.error }

// deps are the connections and the board every subcommand works with.
type deps struct {
	pool  *pgxpool.Pool
	rdb   redis.UniversalClient
	board *leaderboard.Board
	close func()
}

// connect resolves the servers, opens the pool and the Redis client,
// migrates and builds the board. close releases everything, including
// private servers that the resolution started.
func connect(ctx context.Context, o *options, logger *slog.Logger) (*deps, error) {
	var closers []func()
	closeAll := func() {
		for i := len(closers) - 1; i >= 0; i-- {
			closers[i]()
		}
	}
	getenv := o.getenv
	if getenv == nil {
		getenv = os.Getenv
	}
	pgURL, redisURL := o.databaseURL, o.redisURL
	if o.cluster && redisURL == "" {
		// A cluster is never found on a local port or started here: its
		// seed list comes from the flag or the environment, as given.
		if redisURL = strings.TrimSpace(getenv("REDIS_URL")); redisURL == "" {
			return nil, usageError{errors.New("--redis-cluster needs a seed list in --redis-url or REDIS_URL")}
		}
		if _, err := services.ParseRedisClusterURL(redisURL); err != nil {
			return nil, usageError{fmt.Errorf("REDIS_URL: %w", err)}
		}
	}
	// A variable the flag leaves it to is parsed as the flag would be, so a
	// malformed one is a usage error found before anything connects, not a
	// server that "does not answer".
	if pgURL == "" {
		if u := strings.TrimSpace(getenv("DATABASE_URL")); u != "" {
			if _, err := pgxpool.ParseConfig(u); err != nil {
				return nil, usageError{fmt.Errorf("DATABASE_URL: %w", services.HidePostgresConnString(err))}
			}
		}
	}
	if redisURL == "" {
		if u := strings.TrimSpace(getenv("REDIS_URL")); u != "" {
			if _, err := services.ParseRedisURL(u); err != nil {
				return nil, usageError{fmt.Errorf("REDIS_URL: %w", err)}
			}
		}
	}
	if pgURL == "" || redisURL == "" {
		// services.Resolve consults DATABASE_URL / REDIS_URL first, then the
		// local default ports, then starts private servers; a server given
		// by its flag is left out, so an unset or stale variable for it
		// changes nothing.
		ep, err := services.Resolve(ctx, services.Options{Logger: logger, Getenv: getenv,
			SkipPostgres: pgURL != "", SkipRedis: redisURL != ""})
		if err != nil {
			return nil, err
		}
		closers = append(closers, ep.Close)
		if pgURL == "" {
			pgURL = ep.PostgresURL
		}
		if redisURL == "" {
			redisURL = ep.RedisURL
		}
	}
	pool, err := pgxpool.New(ctx, pgURL)
	if err != nil {
		closeAll()
		return nil, fmt.Errorf("postgres: %w", err)
	}
	closers = append(closers, pool.Close)
	rdb, err := newRedisClient(redisURL, o.cluster)
	if err != nil {
		closeAll()
		return nil, fmt.Errorf("redis: %w", err)
	}
	closers = append(closers, func() { _ = rdb.Close() })

	policy, err := parseReadPolicy(o.readPolicy)
	if err != nil {
		closeAll()
		return nil, err
	}
	cfg := &leaderboard.Config{Name: o.board, Schema: o.schema, KeyPrefix: o.keyPrefix,
		ReadPolicy: policy, MaxLag: o.maxLag, RequireVerifiedProjection: o.requireVerified, Logger: logger}
	board, err := leaderboard.New(pool, rdb, cfg)
	if err != nil {
		closeAll()
		return nil, err
	}
	// Closed before the pool (closers run in reverse): its last NOTIFY
	// needs a connection.
	closers = append(closers, board.Close)
	if err := leaderboard.Migrate(ctx, pool, cfg); err != nil {
		closeAll()
		return nil, fmt.Errorf("migrate: %w", err)
	}
	return &deps{pool: pool, rdb: rdb, board: board, close: closeAll}, nil
}

// Unless the Redis URL sets them (read_timeout=, max_retries=), the
// service's client waits redisReadTimeout for a reply and does not resend
// a command. go-redis's defaults, 5 s and three retries, let a Redis that
// stopped answering hold a read for up to 35 s: past the request's
// deadline, so a fallback-to-postgres read answered 503 instead of falling
// back, and past /healthz's pingTimeout. The client also ends a command
// at its context's deadline (ContextTimeoutEnabled) when that comes first,
// so that a request's RequestTimeout bounds a command in flight: without
// it, a read answered its 503 up to twice ReadTimeout past the deadline.
// The Worker retries its own batches, and the board's scripts answer in
// milliseconds.
const (
	redisReadTimeout = pingTimeout
	redisMaxRetries  = -1 // none
)

// newRedisClient opens a single-node client, or a cluster client when
// cluster is set (the board's keys share a hash tag per board, so every
// script call stays on one slot).
func newRedisClient(rawURL string, cluster bool) (redis.UniversalClient, error) {
	if cluster {
		opt, err := services.ParseRedisClusterURL(rawURL)
		if err != nil {
			return nil, err
		}
		// A ClusterClient resends a command that timed out up to
		// MaxRedirects times, whatever MaxRetries says (up to 8 s against
		// a master that stopped answering). That budget also follows MOVED
		// and ASK replies, which the board's plain reads need during a
		// slot migration, so it stays (the README says so).
		setTimeouts(rawURL, &opt.ReadTimeout, &opt.MaxRetries)
		opt.ContextTimeoutEnabled = true
		return redis.NewClusterClient(opt), nil
	}
	opt, err := services.ParseRedisURL(rawURL)
	if err != nil {
		return nil, err
	}
	setTimeouts(rawURL, &opt.ReadTimeout, &opt.MaxRetries)
	opt.ContextTimeoutEnabled = true
	return redis.NewClient(opt), nil
}

// setTimeouts sets the service's read timeout and retries where rawURL,
// which go-redis parsed already, leaves them to go-redis's defaults.
func setTimeouts(rawURL string, readTimeout *time.Duration, maxRetries *int) {
	var q url.Values
	if u, err := url.Parse(rawURL); err == nil {
		q = u.Query()
	}
	if !q.Has("read_timeout") {
		*readTimeout = redisReadTimeout
	}
	if !q.Has("max_retries") {
		*maxRetries = redisMaxRetries
	}
}

// parseReadPolicy reads a leaderboard.ReadPolicy by its String form; ""
// selects the board's default.
func parseReadPolicy(name string) (leaderboard.ReadPolicy, error) {
	if name == "" {
		return 0, nil
	}
	for _, p := range []leaderboard.ReadPolicy{leaderboard.ServeStale, leaderboard.FallbackToPostgres, leaderboard.FailClosed} {
		if p.String() == name {
			return p, nil
		}
	}
	return 0, fmt.Errorf("unknown policy %q (want serve-stale, fallback-to-postgres or fail-closed)", name)
}

// loopbackHosts are the names a browser on this machine uses for a
// service on a loopback address.
var loopbackHosts = []string{"localhost", "127.0.0.1", "::1"}

// hostAllowList is ServiceConfig.AllowedHosts from --allowed-hosts: nil
// (any host) for "*", the listed names, or by default the loopback names
// and --addr's host when that is a loopback address (a service only this
// machine can reach, which DNS rebinding is the way in to), else nil.
func (o *options) hostAllowList() ([]string, error) {
	switch o.allowedHosts {
	case "*":
		return nil, nil
	case "":
		host, _, err := net.SplitHostPort(o.addr)
		if err != nil {
			return nil, err
		}
		if ip := net.ParseIP(host); host == "localhost" || (ip != nil && ip.IsLoopback()) {
			if slices.Contains(loopbackHosts, host) {
				return loopbackHosts, nil
			}
			return append(slices.Clone(loopbackHosts), host), nil // 127.0.0.2, ::ffff:127.0.0.1
		}
		return nil, nil
	}
	var hosts []string
	for _, h := range strings.Split(o.allowedHosts, ",") {
		h = strings.TrimSpace(h)
		switch {
		case h == "":
			continue
		case h == "*":
			return nil, errors.New(`"*" allows any host: give it alone`)
		case strings.ContainsAny(h, "/[]") || (strings.Contains(h, ":") && net.ParseIP(h) == nil):
			return nil, fmt.Errorf("%q: give a host name or IP address, without a port or brackets", h)
		}
		hosts = append(hosts, h)
	}
	if len(hosts) == 0 {
		return nil, errors.New(`no host named: list host names, or "*" for any`)
	}
	return hosts, nil
}
