package main

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/leaderboard"
	"github.com/verity-go/verity/outbox"
	"github.com/verity-go/verity/reconcile"
)

//go:embed web
var webFiles embed.FS

// Service defaults.
const (
	// ShutdownTimeoutDefault bounds how long in-flight requests may take to
	// finish after a shutdown signal.
	ShutdownTimeoutDefault = 10 * time.Second
	// RequestTimeoutDefault bounds one request's work: the server's
	// WriteTimeout does not cancel the request context, and pgx queries have
	// no timeout of their own, so without it a stalled PostgreSQL holds
	// every handler for as long as it stalls.
	RequestTimeoutDefault = 10 * time.Second
	// writeSlack is how much longer than RequestTimeout the server keeps a
	// response writable, so that the timeout's own answer still gets out.
	writeSlack = 5 * time.Second
	// statsTTL is how long an outbox Stats snapshot, or the failure to read
	// one, is reused after its read ends: Stats counts the pending rows, so
	// the page's polling and Prometheus scrapes must not each cost a count,
	// least of all while PostgreSQL is failing.
	statsTTL = time.Second
	// statsTimeout bounds one statsSnapshot read.
	statsTimeout = 5 * time.Second
	// scrapeStatsWait bounds how long a /metrics scrape waits for a stats
	// read. The gauge callback runs under the metrics SDK's lock, which
	// the worker's relay needs to stop: a scrape blocked on a stalled
	// database must not hold up shutdown. The read goes on and fills the
	// cache for the next scrape.
	scrapeStatsWait = 250 * time.Millisecond
	// pingTimeout bounds each dependency ping of /healthz.
	pingTimeout = 2 * time.Second
	// readTimeout bounds reading a whole request, body included (the
	// server's ReadTimeout; a submit's body also within RequestTimeout).
	readTimeout = 30 * time.Second
)

// ServiceConfig tunes a Service.
type ServiceConfig struct {
	// ReconcileEvery is the interval of the scheduled sampled reconcile;
	// the first run starts with the service. Zero disables it.
	ReconcileEvery time.Duration
	// ReconcileSample is the number of random rows each scheduled reconcile
	// checks. Zero means a full pass (only sensible for small boards).
	ReconcileSample int
	// ShutdownTimeout bounds graceful shutdown of the HTTP server.
	// Defaults to ShutdownTimeoutDefault.
	ShutdownTimeout time.Duration
	// RequestTimeout bounds each request: its context is cancelled after
	// it, and a handler cut short answers 503. Defaults to
	// RequestTimeoutDefault.
	RequestTimeout time.Duration
	// Relay tunes the projection worker's outbox relay (leave Schema, Table
	// and Streams empty). Defaults to the outbox package's defaults.
	Relay *outbox.RelayConfig
	// Logger receives the service's logs. Defaults to discarding them.
	Logger *slog.Logger
	// AllowedHosts lists the host names (no port; IPv6 addresses without
	// brackets) that a request's Host header may name, matched without
	// regard to case; a request naming another is answered 421 and reaches
	// no route. It keeps a web page on another site from reaching a service
	// on a loopback address through DNS rebinding (its name made to resolve
	// to 127.0.0.1: the browser then treats the service as that site's own).
	// Defaults to allowing any host.
	AllowedHosts []string
}

// Service is the leaderboard HTTP service: handlers over a Board, the
// board's projection Worker and a scheduled sampled reconcile.
type Service struct {
	board      *leaderboard.Board
	pool       *pgxpool.Pool
	rdb        redis.UniversalClient
	worker     *leaderboard.Worker
	reconciler *reconcile.Reconciler
	metrics    *metrics
	cfg        ServiceConfig
	logger     *slog.Logger
	handler    http.Handler

	lastReconcile atomic.Pointer[reconcileSummary]
	// seenVerifyMarker is the marker of another process's Verify pass
	// that the reconcile loop found at its last run (only that loop
	// reads or writes it).
	seenVerifyMarker string
	// emptyPassFailed is set when the loop's last run was a verifying pass
	// run only because the board was verified empty, and it did not
	// verify: the next run is a sample, so that a pass that never fits in
	// the interval does not starve them (only that loop reads or writes
	// it).
	emptyPassFailed bool
	nextReconcile   atomic.Pointer[time.Time]

	// ran is set by the first Run: a Service runs once (Run stops its
	// stats reads for good as it shuts down).
	ran atomic.Bool

	// ownsBoard is set when wire built board (instrumented), so Close
	// must close it; a board passed in stays the caller's to close.
	ownsBoard bool

	// readStats reads one statsSnapshot; tests replace it to stall or fail
	// the read.
	readStats func(context.Context) *statsSnapshot
	// handlers counts requests in progress, so that Run can wait for
	// those still running after it closed their connections. A counter,
	// not a WaitGroup: a connection can still start a request while Run
	// waits, which a WaitGroup forbids.
	handlers atomic.Int64
	// life is cancelled by Run's shutdown (stopStatsReads) and by Close: a
	// stats read outlives the caller that started it (its result is cached
	// for the others), not the Service.
	life    context.Context
	endLife context.CancelFunc

	statsMu     sync.Mutex
	stats       *statsSnapshot // the last read, ok or failed
	statsUntil  time.Time      // when stats stops being reused
	statsFlight *statsFlight   // the read in flight, shared by its callers
	// statsStopped is set once Run has stopped the stats reads: no read
	// starts after it, so statsReads.Wait sees every read.
	statsStopped bool
	statsReads   sync.WaitGroup
}

// statsFlight is one stats read, shared by every caller that finds no
// fresh cached snapshot while it runs.
type statsFlight struct {
	done chan struct{} // closed once snap is set
	snap *statsSnapshot
}

// errServiceStopped answers a stats read asked for after Run shut down.
var errServiceStopped = errors.New("service stopped")

// errRunTwice refuses a second Run of a Service.
var errRunTwice = errors.New("service: Run was called before on this Service; build a new one with NewService")

// NewService builds a Service for board. It starts nothing; see Run and
// Handler. Close releases its metrics pipeline.
func NewService(pool *pgxpool.Pool, rdb redis.UniversalClient, board *leaderboard.Board, cfg ServiceConfig) (*Service, error) {
	if cfg.ShutdownTimeout == 0 {
		cfg.ShutdownTimeout = ShutdownTimeoutDefault
	}
	if cfg.RequestTimeout == 0 {
		cfg.RequestTimeout = RequestTimeoutDefault
	}
	if cfg.ReconcileEvery < 0 || cfg.ReconcileSample < 0 || cfg.ShutdownTimeout < 0 || cfg.RequestTimeout < 0 {
		return nil, errors.New("ServiceConfig: ReconcileEvery, ReconcileSample, ShutdownTimeout and RequestTimeout must not be negative")
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	s := &Service{board: board, pool: pool, rdb: rdb, cfg: cfg, logger: logger}
	s.life, s.endLife = context.WithCancel(context.Background())
	var err error
	if s.metrics, err = newMetrics(s); err != nil {
		return nil, err
	}
	if err := s.wire(board); err != nil {
		if s.ownsBoard {
			s.board.Close()
		}
		_ = s.metrics.shutdown(context.Background())
		return nil, err
	}
	s.readStats = func(ctx context.Context) *statsSnapshot {
		return readSnapshot(ctx, s.worker.Relay(), s.board)
	}
	return s, nil
}

// wire instruments the board with the service's MeterProvider, so that the
// library's own metrics (verity.leaderboard.*, and through the worker
// verity.outbox.* and verity.projection.*) land on /metrics next to the
// service's, and builds the worker, the reconciler and the routes.
func (s *Service) wire(board *leaderboard.Board) error {
	if bcfg := board.Config(); bcfg.MeterProvider == nil {
		bcfg.MeterProvider = s.metrics.provider
		instrumented, err := leaderboard.New(s.pool, s.rdb, &bcfg)
		if err != nil {
			return err
		}
		s.board, s.ownsBoard = instrumented, true
	}
	relayCfg := &outbox.RelayConfig{Logger: s.logger}
	if s.cfg.Relay != nil {
		relayCfg = s.cfg.Relay
	}
	// The worker's relay and projector inherit the board's MeterProvider
	// unless relayCfg sets one.
	var err error
	if s.worker, err = s.board.Worker(&leaderboard.WorkerConfig{Relay: relayCfg}); err != nil {
		return err
	}
	if s.reconciler, err = s.board.Reconciler(&reconcile.Config{Logger: s.logger}); err != nil {
		return err
	}
	s.handler, err = s.routes()
	return err
}

// Close closes the board NewService built, if it built one (its last
// NOTIFY is sent before Close returns, so the pool may be closed next), and
// shuts the metrics pipeline down. Call it after Run has returned and
// before closing the pool.
func (s *Service) Close() error {
	s.endLife() // ends a stats read that no caller waits for any more
	if s.ownsBoard {
		s.board.Close()
	}
	return s.metrics.shutdown(context.Background())
}

// Handler returns the service's HTTP handler.
func (s *Service) Handler() http.Handler { return s.handler }

// rankRoute is the pattern of GET /users/{id}/rank.
const rankRoute = "GET /users/{id}/rank"

func (s *Service) routes() (http.Handler, error) {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /scores", s.handleSubmit)
	mux.HandleFunc("GET /leaderboard", s.handleLeaderboard)
	mux.HandleFunc(rankRoute, s.handleRank)
	// ServeMux reads a segment that unescapes to "/" as a trailing slash,
	// which no wildcard matches: the id "/" (/users/%2F/rank) would get the
	// mux's 404, so it has a route of its own, counted as the rank route.
	mux.HandleFunc("GET /users/%2F/rank", func(w http.ResponseWriter, r *http.Request) {
		r.SetPathValue("id", "/")
		r.Pattern = rankRoute // instrument's route label
		s.handleRank(w, r)
	})
	mux.HandleFunc("GET /healthz", s.handleHealth)
	mux.HandleFunc("GET /stats", s.handleStats)
	mux.HandleFunc("GET /reconcile/last", s.handleLastReconcile)
	mux.Handle("GET /metrics", s.metrics.handler)
	static, err := fs.Sub(webFiles, "web")
	if err != nil {
		return nil, err
	}
	files := http.FileServerFS(static)
	mux.Handle("GET /{$}", files)
	mux.Handle("GET /app.js", files)
	mux.Handle("GET /app.css", files)
	// withTimeout is outermost but for the header checks: instrument reads
	// the route pattern that the mux sets on the request it is given, so no
	// request copy may come between them.
	return secureHeaders(checkHost(s.cfg.AllowedHosts, s.withTimeout(s.metrics.instrument(mux)))), nil
}

// contentSecurityPolicy lets the page run only its own script and style
// files and talk only to this service: were a server-provided string ever
// written into the page as markup, no script it carried would run. It
// also forbids framing the page, and forms from posting anywhere (the
// page's forms send with fetch).
const contentSecurityPolicy = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

// secureHeaders marks every answer's Content-Type as authoritative, so no
// browser may sniff a JSON answer echoing client text (user ids, body
// keys) as markup or script, and sets the Content-Security-Policy.
func secureHeaders(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Content-Type-Options", "nosniff")
		w.Header().Set("Content-Security-Policy", contentSecurityPolicy)
		next.ServeHTTP(w, r)
	})
}

// checkHost answers 421 Misdirected Request to a request whose Host names
// none of allowed (see ServiceConfig.AllowedHosts); an empty list allows
// any.
func checkHost(allowed []string, next http.Handler) http.Handler {
	if len(allowed) == 0 {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host := r.Host
		if h, _, err := net.SplitHostPort(host); err == nil {
			host = h
		}
		host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
		for _, a := range allowed {
			if strings.EqualFold(host, a) {
				next.ServeHTTP(w, r)
				return
			}
		}
		writeJSON(w, http.StatusMisdirectedRequest, errorResponse{
			Error: fmt.Sprintf("this service does not answer for host %q (see --allowed-hosts)", host)})
	})
}

// errRequestTimeout is the cause of a request context that ran out of
// RequestTimeout, telling it apart from a client that hung up.
var errRequestTimeout = errors.New("request timeout")

// withTimeout gives each request a context cancelled after RequestTimeout.
// No route streams, so every route gets it.
func (s *Service) withTimeout(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.handlers.Add(1)
		defer s.handlers.Add(-1)
		ctx, cancel := context.WithTimeoutCause(r.Context(), s.cfg.RequestTimeout, errRequestTimeout)
		defer cancel()
		next.ServeHTTP(w, r.WithContext(ctx))
	})
}

// Run serves HTTP on ln and runs the projection worker and the scheduled
// reconcile until ctx is cancelled, then shuts down gracefully: the server
// stops accepting connections and waits (up to ShutdownTimeout) for
// in-flight requests, a stats read that a request started and nobody waits
// for any more is cancelled, the worker settles its batch, and the
// reconcile loop stops. Run returns after every goroutine it or its
// requests started has exited, but for three the board started: the
// Worker's Redis eviction check, if Redis has not answered it (it ends at
// the client's ReadTimeout, or when the caller closes the client; see
// leaderboard.Worker.Run), the lag measurement behind a /metrics scrape's
// lag gauge, which Close waits for, and the goroutine that sends the
// relays' wake-up after a submit (it ends once idle for the Notifier's
// IdleTimeout, 100 ms, or at Close). It returns nil after a
// cancellation, or the first error that stopped it. A Service runs once: a
// later Run, also one while the first is under way, returns errRunTwice
// at once and touches nothing (ln included).
func (s *Service) Run(ctx context.Context, ln net.Listener) error {
	if !s.ran.CompareAndSwap(false, true) {
		return errRunTwice
	}
	srv := &http.Server{
		Handler:           s.handler,
		ReadHeaderTimeout: 5 * time.Second,
		// "OPTIONS *" too goes through the host check and the headers.
		DisableGeneralOptionsHandler: true,
		ReadTimeout:                  readTimeout,
		WriteTimeout:                 s.cfg.RequestTimeout + writeSlack,
		IdleTimeout:                  2 * time.Minute,
		ErrorLog:                     slog.NewLogLogger(s.logger.Handler(), slog.LevelWarn),
	}
	// Background work stops when the service stops, whatever the reason,
	// but only after the HTTP server: requests still in flight at shutdown
	// (a read waiting for its at_least version) need the worker to go on
	// projecting until they are done.
	bgCtx, stopBackground := context.WithCancel(context.WithoutCancel(ctx))
	defer stopBackground()

	var wg sync.WaitGroup
	errs := make(chan error, 3)
	wg.Go(func() {
		if err := s.worker.Run(bgCtx); err != nil {
			errs <- fmt.Errorf("worker: %w", err)
		}
	})
	if s.cfg.ReconcileEvery > 0 {
		wg.Go(func() { s.reconcileLoop(bgCtx) })
	}
	serveDone := make(chan struct{})
	go func() {
		defer close(serveDone)
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			errs <- fmt.Errorf("http: %w", err)
		}
	}()
	s.logger.Info("serving", slog.String("addr", ln.Addr().String()), slog.String("board", s.board.Name()))

	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-errs:
	}
	s.logger.Info("shutting down")
	shutdownCtx, cancel := context.WithTimeout(context.Background(), s.cfg.ShutdownTimeout)
	defer cancel()
	if err := srv.Shutdown(shutdownCtx); err != nil {
		// Requests still running past the timeout are cut off: their
		// connections close, and their contexts end, so they return soon.
		s.logger.Warn("http shutdown timed out; closing connections", slog.Any("err", err))
		_ = srv.Close()
		// Their contexts are cancelled now; each returns promptly.
		for deadline := time.Now().Add(s.cfg.RequestTimeout); s.handlers.Load() > 0 && time.Now().Before(deadline); {
			time.Sleep(5 * time.Millisecond)
		}
	}
	<-serveDone
	// A stats read outlives the request that started it (its result is
	// cached for the next); no request is left to use it now.
	s.stopStatsReads()
	stopBackground()
	wg.Wait()
	if runErr == nil {
		select {
		case runErr = <-errs:
		default:
		}
	}
	s.logger.Info("stopped")
	return runErr
}

// reconcileLoop runs a sampled reconcile at once and then every
// ReconcileEvery, keeping the last report for the page and /reconcile/last.
func (s *Service) reconcileLoop(ctx context.Context) {
	every := s.cfg.ReconcileEvery
	slot := time.Now()
	for {
		s.reconcileOnce(ctx)
		// Runs start every ReconcileEvery from the first, whatever each
		// took; one that ran into the next slot (its timeout ends it about
		// there) waits for the slot after. next_run is exactly when the
		// next one starts.
		now := time.Now()
		// Skipped slots are counted, not stepped through: stepping takes
		// longer than a tiny interval covers, and never catches up.
		slot = slot.Add(every)
		if !slot.After(now) {
			slot = slot.Add((now.Sub(slot)/every + 1) * every)
		}
		next := slot
		s.nextReconcile.Store(&next)
		if ctx.Err() != nil {
			return // a select would pick an expired timer half the time
		}
		timer := time.NewTimer(next.Sub(now))
		select {
		case <-ctx.Done():
			timer.Stop()
			return
		case <-timer.C:
		}
	}
}

func (s *Service) reconcileOnce(ctx context.Context) {
	// A run never outlives its slot: the next one would only repeat it.
	runCtx, cancel := context.WithTimeout(ctx, s.cfg.ReconcileEvery)
	defer cancel()
	var (
		report   *reconcile.Report
		err      error
		verified = new(bool)
	)
	required := s.board.Config().RequireVerifiedProjection
	unverified := required && s.board.Freshness(runCtx).Unverified
	onlyEmpty := required && !unverified && !s.emptyPassFailed && s.verifiedEmpty(runCtx)
	s.emptyPassFailed = false
	if unverified || onlyEmpty {
		// Reads refuse (or fall back) until a full pass verifies the
		// projection: a sample cannot, so run that pass instead. Run it
		// again after one that found the board empty (a new board's
		// first), until one finds members, which readers then count. Not
		// while another instance's pass is under way (a marker this loop
		// did not find at its last run): a Verify begun meanwhile would
		// replace its marker, so neither would record, and instances
		// whose schedules keep overlapping would never verify the board.
		// A marker found unchanged a whole interval later is a dead
		// process's (a scheduled pass never outlives its interval), and
		// is replaced.
		marker, merr := s.rdb.Get(runCtx, s.board.SortedSetKey()+"~verifying").Result()
		if merr == nil && marker != s.seenVerifyMarker {
			s.seenVerifyMarker = marker
			s.logger.Info("another process is verifying the board; not starting a verifying pass until the next reconcile")
			return
		}
		s.seenVerifyMarker = ""
		report, *verified, err = s.board.Verify(runCtx, &reconcile.Config{Logger: s.logger})
		s.emptyPassFailed = onlyEmpty && !*verified
	} else {
		verified = nil
		report, err = s.reconciler.Run(runCtx, reconcile.RunOptions{Sample: s.cfg.ReconcileSample})
	}
	if ctx.Err() != nil {
		return // shutting down: a cut-short report is not worth showing
	}
	sum := summarize(report, err, func(error) string { return "the reconcile run failed; see the service log" })
	sum.Verified = verified
	if verified != nil {
		s.logger.Info("verifying reconcile pass", slog.Bool("verified", *verified))
	}
	s.lastReconcile.Store(sum)
	s.metrics.recordReconcile(ctx, report, err)
	if err != nil {
		s.logger.Error("scheduled reconcile failed", slog.Any("err", err))
		return
	}
	level := slog.LevelInfo
	if report.Drift() > 0 {
		level = slog.LevelWarn
	}
	s.logger.Log(ctx, level, "scheduled reconcile",
		slog.Int64("checked", report.Checked), slog.Int64("drift", report.Drift()), slog.Int64("repaired", report.Repaired))
}

// verifiedEmpty reports whether the board's last verifying pass, whoever
// made it (this loop, another instance, 'reconcile --verify', this service
// before a restart), found it empty: the size recorded beside its record
// (leaderboard's verified.lua: "<token> <members>") is 0, so readers see no
// loss of the members the board gained since.
func (s *Service) verifiedEmpty(ctx context.Context) bool {
	held, err := s.rdb.Get(ctx, s.board.SortedSetKey()+"~verified~held").Result()
	_, size, _ := strings.Cut(held, " ")
	return err == nil && size == "0"
}

// statsSnapshot is the outbox backlog and the board's projection lag at one
// moment, shared by /stats, the page and the metrics.
type statsSnapshot struct {
	At        time.Time
	Outbox    outbox.Stats
	Freshness leaderboard.Freshness
	Err       error
}

// snapshot returns the last statsSnapshot, or failure, if its read ended
// less than statsTTL ago, else reads a new one. Concurrent callers share
// one read (single flight), so a stalled PostgreSQL costs one query, not
// one per waiting request. A caller stops waiting when its ctx ends; the
// read goes on without it (bounded by statsTimeout), so one client that
// hangs up does not fail the others sharing the read.
func (s *Service) snapshot(ctx context.Context) *statsSnapshot {
	s.statsMu.Lock()
	if s.statsStopped {
		s.statsMu.Unlock()
		return &statsSnapshot{At: time.Now(), Err: errServiceStopped}
	}
	if s.stats != nil && time.Now().Before(s.statsUntil) {
		snap := s.stats
		s.statsMu.Unlock()
		return snap
	}
	f := s.statsFlight
	if f == nil {
		// Started under statsMu, so stopStatsReads either sees it in
		// statsReads or it never starts.
		f = &statsFlight{done: make(chan struct{})}
		s.statsFlight = f
		s.statsReads.Add(1)
		go s.readFlight(f)
	}
	s.statsMu.Unlock()
	select {
	case <-f.done:
		return f.snap
	case <-ctx.Done():
		return &statsSnapshot{At: time.Now(), Err: ctx.Err()}
	}
}

// readFlight runs f's read and caches its result for statsTTL.
func (s *Service) readFlight(f *statsFlight) {
	defer s.statsReads.Done()
	ctx, cancel := context.WithTimeout(s.life, statsTimeout)
	defer cancel()
	snap := s.readStatsRecovered(ctx)
	// Cached before the flight ends, so a caller arriving after it finds
	// the cache instead of starting another read.
	s.statsMu.Lock()
	s.stats, s.statsUntil, s.statsFlight = snap, time.Now().Add(statsTTL), nil
	s.statsMu.Unlock()
	f.snap = snap
	close(f.done)
}

// stopStatsReads ends the stats reads in flight and waits for them; later
// callers of snapshot get errServiceStopped.
func (s *Service) stopStatsReads() {
	s.statsMu.Lock()
	s.statsStopped = true
	s.statsMu.Unlock()
	s.endLife()
	s.statsReads.Wait()
}

// readStatsRecovered is readStats with a panic turned into a failed
// snapshot (cached and answered like any failed read). It must not escape
// readFlight: that runs on a goroutine of its own, where nothing recovers
// it and the whole process dies.
func (s *Service) readStatsRecovered(ctx context.Context) (snap *statsSnapshot) {
	defer func() {
		if p := recover(); p != nil {
			s.logger.Error("stats read panicked", slog.Any("panic", p), slog.String("stack", string(debug.Stack())))
			snap = &statsSnapshot{At: time.Now(), Err: fmt.Errorf("stats read panicked: %v", p)}
		}
	}()
	return s.readStats(ctx)
}

// readSnapshot reads the outbox backlog (Stats covers the whole outbox
// table, every stream) and the board's freshness. Freshness is the lag
// probe alone, not a read: a read would go through the board's ReadPolicy,
// and under FailClosed the stats would then fail exactly when the lag they
// report is too high, and under FallbackToPostgres report the fallback's
// zero lag instead of the projection's.
func readSnapshot(ctx context.Context, relay *outbox.Relay, board *leaderboard.Board) *statsSnapshot {
	snap := &statsSnapshot{At: time.Now()}
	snap.Outbox, snap.Err = relay.Stats(ctx)
	if snap.Err == nil {
		snap.Freshness = board.Freshness(ctx)
	}
	return snap
}
