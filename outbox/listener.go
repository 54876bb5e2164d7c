package outbox

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// ListenerConfig configures a Listener.
type ListenerConfig struct {
	// Schema is the schema of the outbox whose notifications the Listener
	// receives, as given to Migrate; the relays that share it must serve
	// that outbox. Defaults to SchemaDefault ("public").
	Schema string

	// Table is the outbox table whose notifications the Listener receives.
	// Defaults to TableDefault.
	Table string

	// ReconnectBackoffMax caps the pause between attempts to reconnect
	// after the connection fails (100ms, doubling). Must be at least 1ms.
	// Defaults to ReconnectBackoffMaxDefault (5s).
	ReconnectBackoffMax time.Duration

	// ListenCheckInterval is how long the connection may receive no
	// notification before the Listener pings it; a ping that does not
	// answer within the same time counts as a failed connection, which is
	// replaced; it also bounds opening the connection, AfterConnect and
	// LISTEN (see RelayConfig.ListenCheckInterval), and is how long, 5 s
	// at least, the connection waits for the probe notification it sends
	// after each LISTEN (see RelayConfig.DisableNotify). Must be at least
	// 1ms. Defaults to ListenCheckIntervalDefault (10s).
	ListenCheckInterval time.Duration

	// Logger receives the Listener's logs (a failed connection, at Warn,
	// including one whose probe did not come back behind a
	// transaction-pooling proxy).
	// Defaults to a logger that discards everything.
	Logger *slog.Logger
}

// WithDefaults returns a copy of c with every zero field set to its default.
// A nil c yields all defaults.
func (c *ListenerConfig) WithDefaults() *ListenerConfig {
	var out ListenerConfig
	if c != nil {
		out = *c
	}
	setDefault(&out.Schema, SchemaDefault)
	setDefault(&out.Table, TableDefault)
	setDefault(&out.ReconnectBackoffMax, ReconnectBackoffMaxDefault)
	setDefault(&out.ListenCheckInterval, ListenCheckIntervalDefault)
	if out.Logger == nil {
		out.Logger = slog.New(slog.DiscardHandler)
	}
	return &out
}

func (c *ListenerConfig) validate() error {
	if err := validateNames(c.Schema, c.Table); err != nil {
		return err
	}
	for _, d := range []struct {
		field string
		v     time.Duration
	}{
		{"ReconnectBackoffMax", c.ReconnectBackoffMax},
		{"ListenCheckInterval", c.ListenCheckInterval},
	} {
		if err := validateInterval(d.field, d.v); err != nil {
			return err
		}
	}
	return nil
}

// Listener is one LISTEN connection shared by the relays of a process that
// serve the same outbox table (RelayConfig.Listener): each relay running
// without one holds a PostgreSQL connection of its own, outside the pool,
// so a process running a relay per stream (a leaderboard Worker per board)
// would otherwise hold one per relay. The Listener passes each
// notification to the running relays it may concern (a payload naming a
// stream wakes only the relays serving it) and, after it (re)connects,
// wakes them all, since notifications sent while it was not listening are
// lost.
//
// The connection is opened, as a relay's own would be, from the
// configuration of the pool given to NewListener, running its BeforeConnect,
// AfterConnect and BeforeClose hooks, and reconnected with a growing pause
// after any error, or when it does not answer a ping after
// ListenCheckInterval without a notification. It is open only while at
// least one relay that shares the Listener runs: the first Relay.Run to
// start opens it, and the last to stop (its context ends) closes it,
// letting a LISTEN statement in flight run for up to that relay's
// ShutdownTimeout, before its Run returns. A Listener is safe for concurrent use and needs no closing;
// give it a Logger to see its connection failures.
type Listener struct {
	conn listenConn
	cfg  ListenerConfig

	mu   sync.Mutex
	subs map[*subscription]struct{}
	// stop ends the running connection; nil while none runs.
	stop func(grace time.Duration)
}

// subscription is a running relay's interest in the Listener's
// notifications.
type subscription struct {
	serves func(payload string) bool
	wake   chan<- struct{}
}

// NewListener returns a Listener for the outbox that cfg names (nil means
// the defaults), connecting with pool's configuration when a relay that
// shares it runs. It opens no connection itself. Bad arguments are a
// *ConfigError.
func NewListener(pool *pgxpool.Pool, cfg *ListenerConfig) (*Listener, error) {
	if pool == nil {
		return nil, &ConfigError{Field: "pool", Reason: "is nil; pass the *pgxpool.Pool of the outbox's database"}
	}
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return &Listener{
		conn: listenConn{
			pool:       pool,
			channel:    channelName(cfg.Schema, cfg.Table),
			logger:     cfg.Logger.With(slog.String("listener", channelName(cfg.Schema, cfg.Table))),
			backoffMax: cfg.ReconnectBackoffMax,
			checkAfter: cfg.ListenCheckInterval,
		},
		cfg:  *cfg,
		subs: make(map[*subscription]struct{}),
	}, nil
}

// Config returns the Listener's configuration with defaults applied.
func (l *Listener) Config() ListenerConfig {
	if l.unmade() {
		return *(*ListenerConfig)(nil).WithDefaults()
	}
	return l.cfg
}

// unmade reports a Listener not made by NewListener.
func (l *Listener) unmade() bool { return l == nil || l.subs == nil }

// subscribe adds a running relay; the returned function removes it and,
// for the last one, closes the connection and waits until it is closed,
// letting a LISTEN (or AfterConnect) statement in flight run for up to
// grace first, as a relay's own connection is given its ShutdownTimeout.
// Rows committed before subscribe returns are the relay's own to find
// (its first claim follows); from then on it is notified, or woken after
// a reconnection.
func (l *Listener) subscribe(serves func(string) bool, wake chan<- struct{}) (unsubscribe func(grace time.Duration)) {
	sub := &subscription{serves: serves, wake: wake}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.subs[sub] = struct{}{}
	if l.stop == nil {
		l.stop = l.start()
	}
	return func(grace time.Duration) {
		l.mu.Lock()
		delete(l.subs, sub)
		var stop func(time.Duration)
		if len(l.subs) == 0 {
			stop, l.stop = l.stop, nil
		}
		l.mu.Unlock()
		if stop != nil {
			stop(grace)
		}
	}
}

// start runs a connection until the returned function is called; that
// function returns once the connection is closed, having let a statement
// in flight run for up to grace (see listenConn.run). A relay that
// subscribes while an earlier connection is still closing starts a new
// one: both then wake the current relays, which costs at most a spare
// claim.
func (l *Listener) start() (stop func(grace time.Duration)) {
	ctx, cancel := context.WithCancel(context.Background())
	stmtCtx, cancelStmts := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer cancelStmts()
		l.conn.run(ctx, stmtCtx, l.wakeAll, l.dispatch)
	}()
	return func(grace time.Duration) {
		cancel()
		timer := time.AfterFunc(grace, cancelStmts)
		defer timer.Stop()
		<-done
	}
}

// wakeAll wakes every running relay: the connection was (re)established.
func (l *Listener) wakeAll() {
	l.mu.Lock()
	defer l.mu.Unlock()
	for sub := range l.subs {
		signal(sub.wake)
	}
}

// dispatch wakes the running relays that serve payload's stream.
func (l *Listener) dispatch(payload string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for sub := range l.subs {
		if sub.serves(payload) {
			signal(sub.wake)
		}
	}
}
