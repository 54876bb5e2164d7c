package outbox

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/verity-go/verity/internal/deps"
	"github.com/verity-go/verity/internal/lograte"
)

// Defaults applied by NotifierConfig.WithDefaults to zero-valued fields.
const (
	// NotifierIntervalDefault is the default for NotifierConfig.Interval.
	NotifierIntervalDefault = time.Millisecond
	// NotifierIdleTimeoutDefault is the default for
	// NotifierConfig.IdleTimeout.
	NotifierIdleTimeoutDefault = 100 * time.Millisecond
	// NotifierTimeoutDefault is the default for NotifierConfig.Timeout.
	NotifierTimeoutDefault = time.Second
)

// notifySQL wakes the relays listening on channel $1 that serve stream $2
// (all of them when $2 is empty). It runs as its own
// autocommit statement, with synchronous_commit off for that transaction
// only (set_config with is_local): PostgreSQL gives a notifying transaction
// an xid and holds a database-wide lock from PreCommit_Notify until its
// commit record is written, so a synchronous commit would hold that lock
// through a WAL flush. The notification carries no data (its payload only
// says which relays it is for) and is lost in a crash anyway (listeners reconnect and poll), so an unflushed commit of it
// weakens nothing; the data it announces was committed durably before
// Notify was called.
const notifySQL = `SELECT set_config('synchronous_commit', 'off', true), pg_notify($1::text, $2::text)`

// NotifierConfig configures a Notifier. A nil *NotifierConfig means all
// defaults; negative durations are errors.
type NotifierConfig struct {
	// Interval is the shortest time between two notifications: calls to
	// Notify within one Interval are coalesced into one NOTIFY. The first
	// Notify after a quiet Interval is sent at once, and so is a
	// notification still owed when Close is called, however recent the
	// last. Defaults to NotifierIntervalDefault (1 ms).
	Interval time.Duration

	// IdleTimeout is how long the sending goroutine waits for another
	// Notify before it exits; the next Notify starts a new one. It lets a
	// Notifier that is never closed leave no goroutine behind once it is
	// idle. Defaults to NotifierIdleTimeoutDefault (100 ms).
	IdleTimeout time.Duration

	// Timeout bounds one NOTIFY statement (including waiting for a pool
	// connection). A later wake-up is worth little: the relays poll anyway.
	// Defaults to NotifierTimeoutDefault (1 s).
	Timeout time.Duration

	// Stream, when set, is sent as each notification's payload: relays
	// restricted to other streams (RelayConfig.Streams) ignore it, and only
	// those that may claim the rows wake and claim. Set it when every row
	// the Notifier announces is of this one stream (a leaderboard board's
	// Notifier does); with many relays, one per stream, on one table, an
	// empty Stream makes every write wake them all. At most MaxStreamBytes
	// bytes of valid UTF-8 without NUL, as a row's stream. Defaults to ""
	// (every relay of the outbox wakes).
	Stream string

	// Logger receives a warning when a NOTIFY fails, at most one a second
	// (each with the number of failures left out since the one before, under
	// "suppressed"). Defaults to discarding logs.
	Logger *slog.Logger
}

// WithDefaults returns a copy of c with every zero field set to its
// default. A nil c is treated as the zero NotifierConfig.
func (c *NotifierConfig) WithDefaults() *NotifierConfig {
	out := &NotifierConfig{}
	if c != nil {
		*out = *c
	}
	if out.Interval == 0 {
		out.Interval = NotifierIntervalDefault
	}
	if out.IdleTimeout == 0 {
		out.IdleTimeout = NotifierIdleTimeoutDefault
	}
	if out.Timeout == 0 {
		out.Timeout = NotifierTimeoutDefault
	}
	if out.Logger == nil {
		out.Logger = slog.New(slog.DiscardHandler)
	}
	return out
}

func (c *NotifierConfig) validate() error {
	negative := func(field string, d time.Duration) error {
		return &ConfigError{Field: field, Reason: fmt.Sprintf("is %v; use a positive duration or zero for the default", d)}
	}
	switch {
	case c.Interval < 0:
		return negative("Interval", c.Interval)
	case c.IdleTimeout < 0:
		return negative("IdleTimeout", c.IdleTimeout)
	case c.Timeout < 0:
		return negative("Timeout", c.Timeout)
	case len(c.Stream) > MaxStreamBytes:
		return &ConfigError{Field: "Stream", Reason: fmt.Sprintf("is %d bytes; at most %d (MaxStreamBytes) are allowed", len(c.Stream), MaxStreamBytes)}
	}
	if reason := textProblem(c.Stream); reason != "" {
		return &ConfigError{Field: "Stream", Reason: reason}
	}
	return nil
}

// Notifier wakes the relays of one outbox after the writing transaction has
// committed, for writers whose transaction sends no NOTIFY of its own: those
// that insert outbox rows with a composed INSERT written without pg_notify
// (see the package documentation, "Composing your own INSERT"; the
// leaderboard package writes its rows so). It does not change Append, which
// always runs pg_notify inside the caller's transaction: Notify after an
// Append adds a notification and takes none out of the transaction.
//
// Why: PostgreSQL serialises the commits of notifying transactions (it
// holds a database-wide lock from PreCommit_Notify to the end of the
// commit, WAL flush included), so a NOTIFY inside every write transaction
// costs concurrent writers their group commit. With a composed INSERT and a
// Notifier the notification leaves the data transaction: writers call
// Notify after their commit returned, which only marks the Notifier dirty,
// and one goroutine sends at most one NOTIFY per Interval as its own
// statement.
//
// What it costs: nothing in correctness. The outbox row is still committed
// with the state it describes. A process that crashes between the commit
// and the NOTIFY (or a NOTIFY that fails) delays delivery until the relays'
// next poll (RelayConfig.PollInterval) and loses nothing: relays always
// poll as well as listen.
//
// The sending goroutine starts on demand and exits after IdleTimeout
// without calls, so a Notifier that is never closed leaks no goroutine once
// idle. Close stops it for good, sending a pending notification first.
// A Notifier is safe for concurrent use.
type Notifier struct {
	db      Execer
	channel string
	cfg     *NotifierConfig

	dirty atomic.Bool   // a notification is owed
	kick  chan struct{} // capacity 1: dirty went from false to true
	// failures limits the failed-NOTIFY warnings: a database out of
	// connection slots fails every NOTIFY, up to one a millisecond.
	failures lograte.Limiter

	mu      sync.Mutex
	running bool // a sending goroutine exists
	closed  bool
	// lastSent is when the last NOTIFY was sent. It outlives the sending
	// goroutine so that Interval also holds across an idle exit and restart.
	lastSent   time.Time
	stop       chan struct{} // closed by Close
	closedDone chan struct{} // closed when the first Close returns
	wg         sync.WaitGroup
}

// NewNotifier returns a Notifier that sends NOTIFY on channel through db
// (usually a *pgxpool.Pool; each NOTIFY is one autocommit statement).
// channel is the outbox's channel, Writer.Channel. Bad arguments and
// configuration are reported as a *ConfigError (ErrInvalidConfig).
func NewNotifier(db Execer, channel string, cfg *NotifierConfig) (*Notifier, error) {
	if deps.Missing(db) {
		return nil, &ConfigError{Field: "db", Reason: "is nil; pass a database handle (a *pgxpool.Pool)"}
	}
	if reason := deps.Released(db); reason != "" {
		return nil, &ConfigError{Field: "db", Reason: reason}
	}
	// PostgreSQL refuses channel names of NAMEDATALEN (64) bytes or more:
	// every NOTIFY would fail, and only a log would say so.
	if channel == "" || len(channel) >= 64 || !utf8.ValidString(channel) || strings.IndexByte(channel, 0) >= 0 {
		return nil, &ConfigError{Field: "channel", Reason: fmt.Sprintf("is %q; pass the outbox's channel (Writer.Channel)", channel)}
	}
	c := cfg.WithDefaults()
	if err := c.validate(); err != nil {
		return nil, err
	}
	return &Notifier{
		db:         db,
		channel:    channel,
		cfg:        c,
		kick:       make(chan struct{}, 1),
		stop:       make(chan struct{}),
		closedDone: make(chan struct{}),
	}, nil
}

// Notify asks for a wake-up of the relays. Call it after the transaction
// that wrote outbox rows has committed. It never blocks on the database:
// it marks the Notifier dirty and, if no sending goroutine runs, starts
// one. After Close it does nothing, and so it does on a Notifier not made
// by NewNotifier (a zero value, or nil), which has nothing to notify
// through.
func (n *Notifier) Notify() {
	if n.unmade() {
		return
	}
	if n.dirty.Swap(true) {
		return // already owed; the goroutine that owes it is running
	}
	select {
	case n.kick <- struct{}{}:
	default:
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.running || n.closed {
		return
	}
	n.running = true
	n.wg.Add(1)
	go n.run()
}

// Close stops the Notifier: it waits for a NOTIFY already in flight,
// sends the notification still owed (each bounded by Timeout, so against a
// database that stops answering Close can take Timeout more than once),
// waits for the sending goroutine to exit and makes later calls to Notify
// no-ops. It is safe to call more than once, and concurrently:
// every call returns once the notification is sent. On a Notifier not
// made by NewNotifier it does nothing.
func (n *Notifier) Close() {
	if n.unmade() {
		return
	}
	n.mu.Lock()
	first := !n.closed
	if first {
		n.closed = true
		close(n.stop)
	}
	n.mu.Unlock()
	if !first {
		<-n.closedDone
		return
	}
	defer close(n.closedDone)
	n.wg.Wait()
	// A Notify that marked the Notifier dirty but had not started its
	// goroutine when Close ran finds it closed and returns, and a Notify
	// that found it dirty returned trusting that goroutine: the owed
	// notification is sent here.
	if n.dirty.Swap(false) {
		n.send()
	}
}

// unmade reports a Notifier not made by NewNotifier (a zero value, or
// nil): it has no database, configuration or channels.
func (n *Notifier) unmade() bool { return n == nil || n.cfg == nil }

// run sends notifications while they are owed. Invariant: it exits only
// with dirty false observed under mu (or after Close), and Notify checks
// running under mu after setting dirty, so an owed notification always has
// a goroutine to send it.
func (n *Notifier) run() {
	defer n.wg.Done()
	idle := time.NewTimer(n.cfg.IdleTimeout)
	defer idle.Stop()
	pace := time.NewTimer(0)
	defer pace.Stop()
	<-pace.C
	for {
		select {
		case <-n.stop:
			n.flush()
			return
		case <-n.kick:
		case <-idle.C:
			n.mu.Lock()
			if !n.dirty.Load() {
				n.running = false
				n.mu.Unlock()
				return
			}
			n.mu.Unlock()
		}
		// A kick left over from a Notify whose notification an earlier
		// round already sent: nothing is owed, so do not wait out the
		// Interval for nothing (which would also keep the goroutine from
		// going idle).
		if !n.dirty.Load() {
			idle.Reset(n.cfg.IdleTimeout)
			continue
		}
		// Coalesce: at most one NOTIFY per Interval.
		n.mu.Lock()
		last := n.lastSent
		n.mu.Unlock()
		if wait := n.cfg.Interval - time.Since(last); wait > 0 {
			pace.Reset(wait)
			select {
			case <-n.stop:
				n.flush()
				return
			case <-pace.C:
			}
		}
		if n.dirty.Swap(false) {
			n.send()
			n.mu.Lock()
			n.lastSent = time.Now()
			n.mu.Unlock()
		}
		idle.Reset(n.cfg.IdleTimeout)
	}
}

// flush sends a notification that is still owed when the Notifier closes.
func (n *Notifier) flush() {
	if n.dirty.Swap(false) {
		n.send()
	}
	n.mu.Lock()
	n.running = false
	n.mu.Unlock()
}

// send runs one NOTIFY. A failure is logged (at most once a second, with
// the number of failures left out) and otherwise ignored: the relays' poll
// picks the rows up.
func (n *Notifier) send() {
	ctx, cancel := context.WithTimeout(context.Background(), n.cfg.Timeout)
	defer cancel()
	if _, err := n.db.Exec(ctx, notifySQL, n.channel, n.cfg.Stream); err != nil {
		if log, suppressed := n.failures.Allow(); log {
			n.cfg.Logger.Warn("outbox notifier: NOTIFY failed; relays will find the rows at their next poll",
				slog.String("channel", n.channel), slog.String("error", err.Error()), slog.Int64(lograte.Suppressed, suppressed))
		}
	}
}
