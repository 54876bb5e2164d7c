package leaderboard

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/outbox"
	"github.com/verity-go/verity/projection"
)

// Mapper returns the projection.Mapper of the board's outbox stream. It
// projects a record (key = user id, payload = absolute score in base 10,
// version = the user's version) into the board's sorted set with the
// NEGATED score, so that ascending Redis order is the ranking order (see
// the package documentation). Records of other streams are refused.
func (b *Board) Mapper() projection.Mapper {
	return projection.MapperFunc(func(rec outbox.Record) (projection.Write, error) {
		if b.notFromNew() {
			return projection.Write{}, errBoardNotFromNew()
		}
		if rec.Stream != b.stream {
			return projection.Write{}, fmt.Errorf("leaderboard: record of stream %q reached board %q", rec.Stream, b.cfg.Name)
		}
		score, err := strconv.ParseInt(string(rec.Payload), 10, 64)
		if err != nil || score < MinScore || score > MaxScore {
			return projection.Write{}, fmt.Errorf("leaderboard: record %d: payload %.32q is not a score", rec.ID, rec.Payload)
		}
		return b.write(rec.Key, score, rec.Version), nil
	})
}

// write is the gated projection write that sets user's score at version.
func (b *Board) write(user string, score, version int64) projection.Write {
	return projection.Write{Target: b.target(user), Version: version, Value: projection.Value{Score: -score}}
}

// WorkerConfig configures a Worker.
type WorkerConfig struct {
	// Relay tunes the outbox relay (batch size, lease, polling, retries,
	// logger, metrics, a shared Listener...). Its Schema, Table and
	// Streams are set by the board and must be left empty; a Listener
	// must be made for the board's Schema and OutboxTable. Its Logger and MeterProvider default to
	// the board's, and the projector uses the same ones. Its Name, which
	// only labels the relay's logs, defaults to "leaderboard-" + the
	// board's name, so that the logs say which board a worker serves (the
	// workers of one board share it; set Name to tell them apart). Every
	// other field defaults as in the outbox package. A nil Relay means
	// all of these defaults.
	Relay *outbox.RelayConfig
}

// Worker projects the board's outbox stream into Redis: an outbox relay
// restricted to the board's stream, handing batches to a
// projection.RedisProjector with the board's Mapper, which applies them
// through the version gate (one script call per batch). Any number of workers
// may run, in any number of processes; delivery is at-least-once and the
// gate makes redeliveries and out-of-order deliveries harmless. Create it
// with Board.Worker: the methods of a zero Worker or a nil *Worker return a
// *ConfigError (Field "Worker") instead.
//
// While Run runs, the Worker holds one PostgreSQL connection of its own,
// outside the board's pool, in LISTEN (see outbox.Relay); it takes pool
// connections for its statements only (claims, settles, releases, the
// lease and LISTEN probes, Stats). Count one connection per running Worker
// on top of the pool's MaxConns against max_connections and any
// CONNECTION LIMIT; or give the Workers of the boards a process runs one
// outbox.Listener (WorkerConfig.Relay.Listener, made by
// outbox.NewListener with the boards' Schema and OutboxTable and a Logger,
// for its connection failures), so that they share one such connection
// (one Listener per outbox table: boards in different schemas need one
// each); or set WorkerConfig.Relay.DisableNotify (the Worker then finds
// rows by polling every PollInterval). Notifications name the board's stream, so a write on one
// board wakes only that board's Workers, whether they share a Listener or
// not.
type Worker struct {
	projector *projection.RedisProjector
	relay     *outbox.Relay
	rdb       redis.UniversalClient
	logger    *slog.Logger
	// evictionChecked is set by the Run that checks the eviction policy;
	// later and concurrent ones do not, unless the caller's ctx cut that
	// check short.
	evictionChecked atomic.Bool
}

// Worker returns a Worker for the board. It does not start it; call Run.
// A refusal of the board's Redis client by projection.NewRedisProjector
// (New already refuses one that could wait for Redis forever) is a
// *ConfigError naming "rdb" that wraps the projector's
// *projection.ConfigError.
func (b *Board) Worker(cfg *WorkerConfig) (*Worker, error) {
	if b.notFromNew() {
		return nil, errBoardNotFromNew()
	}
	var rc outbox.RelayConfig
	if cfg != nil && cfg.Relay != nil {
		rc = *cfg.Relay
	}
	if rc.Schema != "" || rc.Table != "" || len(rc.Streams) != 0 {
		return nil, &ConfigError{Field: "WorkerConfig.Relay", Reason: "sets Schema, Table or Streams; leave them empty, the board sets them"}
	}
	rc.Schema, rc.Table, rc.Streams = b.cfg.Schema, b.cfg.OutboxTable, []string{b.stream}
	if rc.Name == "" {
		rc.Name = "leaderboard-" + b.cfg.Name
	}
	if rc.Logger == nil {
		rc.Logger = b.cfg.Logger
	}
	if rc.MeterProvider == nil {
		rc.MeterProvider = b.cfg.MeterProvider
	}
	projector, err := projection.NewRedisProjector(b.rdb, b.Mapper(), &projection.Config{
		Prefix: b.cfg.KeyPrefix, VersionBuckets: b.cfg.VersionBuckets,
		Logger: rc.Logger, MeterProvider: rc.MeterProvider,
	})
	var perr *projection.ConfigError
	if errors.As(err, &perr) {
		// The projector checks the board's Redis client (its timeouts)
		// and what New already accepted: KeyPrefix and VersionBuckets,
		// through the same projection functions. So its refusal is the
		// client's, and a leaderboard *ConfigError, as Reconciler's is.
		return nil, &ConfigError{Field: "rdb", Reason: perr.Field + " " + perr.Reason, Err: err}
	}
	if err != nil {
		return nil, fmt.Errorf("leaderboard: worker: %w", err)
	}
	relay, err := outbox.NewRelay(b.pool, projector, &rc)
	if err != nil {
		return nil, fromOutboxConfig("WorkerConfig.Relay.", err)
	}
	return &Worker{projector: projector, relay: relay, rdb: b.rdb, logger: rc.Logger}, nil
}

// evictionCheckTimeout bounds the ctx of the check of the Redis eviction
// policy that Run makes as it starts.
const evictionCheckTimeout = 2 * time.Second

// warnIfEvicting logs a warning when a server of the board's Redis may
// evict the gate's version keys (projection.CheckEvictionPolicy): the
// projection would then apply a redelivered older record, and a reader
// see a score the database has since replaced, until a reconcile pass. A
// server that could not be asked is logged at Debug: that says nothing
// about its policy (managed services often refuse INFO's memory section).
// A check that the caller's ctx cut short leaves the next Run to check
// again: a Run cancelled as it starts must not stand for the check.
func (w *Worker) warnIfEvicting(ctx context.Context) {
	checkCtx, cancel := context.WithTimeout(ctx, evictionCheckTimeout)
	defer cancel()
	switch err := projection.CheckEvictionPolicy(checkCtx, w.rdb); {
	case errors.Is(err, projection.ErrEvictionPolicy):
		w.logger.WarnContext(ctx, "leaderboard: worker: the board's Redis may evict the projection's version keys; run it with maxmemory-policy noeviction", "error", err)
	case err != nil && ctx.Err() != nil:
		w.evictionChecked.Store(false)
		w.logger.DebugContext(ctx, "leaderboard: worker: the eviction check was cut short by Run's ctx; the next Run checks again", "error", err)
	case err != nil:
		w.logger.DebugContext(ctx, "leaderboard: worker: could not check the Redis eviction policy", "error", err)
	default:
		w.logger.DebugContext(ctx, "leaderboard: worker: the Redis eviction policy keeps the projection's version keys")
	}
}

// Run projects until ctx is cancelled, then shuts down gracefully (see
// outbox.Relay.Run). It returns nil after a cancellation. A Worker runs
// once at a time: Run while another Run of it is under way returns
// outbox.ErrRelayRunning at once (run more Workers for more relays). Its
// errors, and RunOnce's and Drain's, are the relay's (package outbox).
// As it starts, the Worker's first Run (or, if the caller's ctx ended
// before the servers answered, the next one) asks the board's Redis servers
// whether they could evict the projection's version keys
// (projection.CheckEvictionPolicy, beside the relay; its ctx allows 2 s,
// and a client that does not apply ctx deadlines to socket reads waits up
// to its ReadTimeout) and logs a warning if one could; it projects either
// way, and once ctx has ended returns without waiting for the check.
func (w *Worker) Run(ctx context.Context) error {
	if w.notFromBoard() {
		return errWorkerNotFromBoard()
	}
	// Beside the relay, not before it: a Redis that does not answer must
	// not hold the projection back for the check's timeout.
	var checked chan struct{}
	if w.evictionChecked.CompareAndSwap(false, true) {
		checked = make(chan struct{})
		go func() {
			defer close(checked)
			w.warnIfEvicting(ctx)
		}()
	}
	err := w.relay.Run(ctx)
	// A Run refused because another is under way returns at once, also
	// when it started the check (it raced the Run that won): the check
	// goes on beside that Run.
	if checked != nil && !errors.Is(err, outbox.ErrRelayRunning) {
		// Once ctx has ended, Run does not wait for a check still under
		// way: a client that does not apply ctx deadlines to socket reads
		// (ContextTimeoutEnabled unset, go-redis's default) waits for a
		// Redis that does not answer until its ReadTimeout, and the check
		// ends by itself then, or when the client is closed.
		select {
		case <-checked:
		case <-ctx.Done():
			// The check has not answered and ctx ended: this Run does
			// not stand for it, and the next Run, which may start
			// before the check gives up, checks again.
			select {
			case <-checked:
			default:
				w.evictionChecked.Store(false)
			}
		}
	}
	if errors.Is(err, context.Canceled) && ctx.Err() != nil {
		return nil
	}
	return err
}

// RunOnce projects one batch and returns how many records it handled,
// failed ones included (they are retried after a backoff, or dead-lettered).
func (w *Worker) RunOnce(ctx context.Context) (int, error) {
	if w.notFromBoard() {
		return 0, errWorkerNotFromBoard()
	}
	return w.relay.RunOnce(ctx)
}

// Drain projects batches until none is due that it may take, and returns
// how many records it handled, failed ones included. Records a claim moves
// to the dead-letter table without another attempt (they reached
// MaxAttempts already) are not counted, and never make Drain stop while
// records are due. Records backing off after a failure are not due and are
// left alone, and records in a partition another worker's batch holds
// (one in flight, or a crashed process's until its lease ends) are not
// its to take: Drain can stop while they are due. Relay().Stats or
// Board.Freshness tells whether anything is still pending.
func (w *Worker) Drain(ctx context.Context) (int, error) {
	if w.notFromBoard() {
		return 0, errWorkerNotFromBoard()
	}
	total := 0
	for {
		n, err := w.relay.RunOnce(ctx)
		total += n
		if err != nil || n == 0 {
			return total, err
		}
	}
}

// Relay returns the underlying relay (for Stats and dead letters): nil for
// a Worker not made by Board.Worker.
func (w *Worker) Relay() *outbox.Relay {
	if w.notFromBoard() {
		return nil
	}
	return w.relay
}

// Projector returns the underlying projector: nil for a Worker not made by
// Board.Worker.
func (w *Worker) Projector() *projection.RedisProjector {
	if w.notFromBoard() {
		return nil
	}
	return w.projector
}

// notFromBoard reports a Worker that Board.Worker did not make: a zero
// Worker, or a nil *Worker.
func (w *Worker) notFromBoard() bool { return w == nil || w.relay == nil }

// errWorkerNotFromBoard is the error of a method called on a Worker that
// Board.Worker did not make.
func errWorkerNotFromBoard() error {
	return &ConfigError{Field: "Worker", Reason: "was not made by Board.Worker: it has no relay or projector; create it with Board.Worker"}
}
