package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"
)

// listenCloseTimeout bounds closing the LISTEN connection.
const listenCloseTimeout = 2 * time.Second

// probeChannel is the channel on which every LISTEN connection checks,
// after each LISTEN, that notifications reach it: it listens there too,
// and sends one through the pool, with a token of its own as the payload.
// Behind a transaction-pooling proxy (PgBouncer in transaction mode) LISTEN
// lands on whichever server connection the proxy picks and stays there,
// and notifications for it arrive while that connection serves another
// client, or none: the proxy drops them, nothing fails, and the relays
// would fall back to PollInterval without a word. Connections of every
// process listen on the one channel (a name per connection would leave a
// new registration on a proxy's server connections at every attempt) and
// ignore the others' tokens; no relay is woken by a probe.
const probeChannel = "verity_listen_probe"

// probeWaitMin is the least time a LISTEN connection waits for its probe
// to come back (ListenCheckInterval when longer): a delivery is a round
// trip of milliseconds, and a busy server must not make a short
// ListenCheckInterval replace healthy connections.
const probeWaitMin = 5 * time.Second

// errNotificationsLost is the failure of a LISTEN connection whose probe
// did not come back.
var errNotificationsLost = errors.New("a notification sent through the pool did not reach the LISTEN connection: LISTEN needs a session of its own, which a transaction-pooling proxy (PgBouncer in transaction mode) does not give; behind one, set RelayConfig.DisableNotify, and leave RelayConfig.Listener unset (relays poll meanwhile)")

// listenConn is one LISTEN connection: the pool whose configuration opens
// it, the channel it listens on, and how it logs and reconnects. A Relay
// without a Listener runs one of its own; a Listener runs one for the
// relays that share it.
type listenConn struct {
	pool       *pgxpool.Pool
	channel    string
	logger     *slog.Logger
	backoffMax time.Duration
	// checkAfter is how long the connection may receive nothing before a
	// ping checks that it still answers, within the same time.
	checkAfter time.Duration
}

// run keeps a dedicated connection LISTENing on the channel until ctx is
// done, calling connected each time LISTEN is in effect (a notification
// sent while no connection was listening is lost for good, so whoever
// waits for one must then look for itself) and notified with each
// notification's payload. The connection is opened from the pool's
// configuration, running the pool's BeforeConnect, AfterConnect and
// BeforeClose hooks as the pool does (they may supply credentials, the
// host, or session settings), but is not a pool connection: holding a
// pooled connection forever would shrink the pool, and a pooled connection
// may be reset or closed under the listener. After any error it reconnects
// with a growing pause. A connection that has received nothing for
// checkAfter is pinged, and one whose ping does not answer within
// checkAfter counts as failed: waiting for a notification reads from the
// socket and nothing else, so a connection whose peer or a middlebox
// stopped passing traffic without closing it (a half-open connection,
// which still answers TCP keepalives) would otherwise wait for ever, and
// its relays fall back to PollInterval. Opening the connection (with
// BeforeConnect), AfterConnect and LISTEN are bounded by checkAfter each,
// for the same reason.
//
// The LISTEN statement (and AfterConnect, which may run statements) runs
// under stmtCtx, which should outlive ctx by a grace period: a statement
// cut off mid-flight makes pgx close the connection in a goroutine of its
// own, which on a TLS connection can wait out pgx's 15 s deadline, whereas
// waiting for a notification is cut off cleanly and the connection is then
// closed in place.
func (lc listenConn) run(ctx, stmtCtx context.Context, connected func(), notified func(payload string)) {
	pause := newPauser(lc.backoffMax)
	for {
		// The pause resets once the probe came back (or could not be
		// sent and the connection has lived checkAfter since), not at
		// LISTEN: behind a proxy that loses notifications every LISTEN
		// succeeds, and the pause must still grow.
		err := lc.once(ctx, stmtCtx, connected, pause.reset, notified)
		if ctx.Err() != nil {
			return
		}
		d := pause.next()
		lc.logger.Warn("outbox LISTEN connection failed; reconnecting",
			slog.String("error", err.Error()), slog.Duration("pause", d))
		if !sleep(ctx, d) {
			return
		}
	}
}

// once connects, LISTENs and passes notifications on until an error. It
// calls connected once LISTEN is in effect, and proven once the probe came
// back, or could not be sent and the connection has lived checkAfter
// since it was started.
func (lc listenConn) once(ctx, stmtCtx context.Context, connected, proven func(), notified func(string)) error {
	poolCfg := lc.pool.Config()
	// abandon closes every socket the connection dialled (its cancel
	// request's too) once closing it has had listenCloseTimeout: pgx's
	// background close of a connection cut off mid-statement sends a cancel
	// request on a new connection and waits up to 15 s for it, which a
	// frozen path never answers.
	abandonCtx, abandon := context.WithCancel(context.WithoutCancel(ctx))
	defer abandon()
	conn, err := lc.connect(ctx, abandonCtx, poolCfg)
	if err != nil {
		return err
	}
	hooked := false // AfterConnect ran: BeforeClose pairs with it, as in pgxpool
	defer func() {
		if hooked && poolCfg.BeforeClose != nil {
			poolCfg.BeforeClose(conn)
		}
		closeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), listenCloseTimeout)
		defer cancel()
		_ = conn.Close(closeCtx) // the connection is discarded either way
		// If a failure made pgx close the connection in the background,
		// wait for it as pgxpool does, so that nothing is left running.
		select {
		case <-conn.PgConn().CleanupDone():
		case <-closeCtx.Done():
			abandon()
			<-conn.PgConn().CleanupDone()
		}
	}()
	// A failure closes the connection in the deferred function above.
	if poolCfg.AfterConnect != nil {
		hookCtx, cancel := context.WithTimeout(stmtCtx, lc.checkAfter)
		err := poolCfg.AfterConnect(hookCtx, conn)
		cancel()
		if err != nil {
			return fmt.Errorf("connect: AfterConnect: %w", lc.bounded(hookCtx, err))
		}
	}
	hooked = true
	listen := "LISTEN " + pgx.Identifier{lc.channel}.Sanitize()
	// The probe channel first: the session's last statement, which
	// pg_stat_activity shows, stays the outbox channel's LISTEN.
	for _, stmt := range []string{"LISTEN " + probeChannel, listen} {
		listenCtx, cancel := context.WithTimeout(stmtCtx, lc.checkAfter)
		_, err = conn.Exec(listenCtx, stmt)
		cancel()
		if err != nil {
			return fmt.Errorf("listen: %w", lc.bounded(listenCtx, err))
		}
	}
	lc.logger.Debug("outbox listening", slog.String("channel", lc.channel))
	connected()
	probe := lc.startProbe(ctx, stmtCtx, proven)
	defer probe.stop()
	heard := time.Now() // the idle check counts from the last notification or ping
	for {
		probe.poll()
		wait := probe.waitFor(lc.checkAfter - time.Since(heard))
		waitCtx, cancel := context.WithTimeout(ctx, wait)
		n, err := conn.WaitForNotification(waitCtx)
		idle := waitCtx.Err() != nil && ctx.Err() == nil
		cancel()
		// pgx may return one it buffered with an error. The pool's
		// AfterConnect may LISTEN on channels of the application's own.
		if n != nil {
			heard = time.Now()
			switch n.Channel {
			case lc.channel:
				notified(n.Payload)
			case probeChannel:
				probe.received(n.Payload)
			}
		}
		// After the notification: one that came back during the ping,
		// buffered since, is read first (pgx returns those even once the
		// wait's deadline has passed).
		if ctx.Err() == nil && probe.lost() {
			return fmt.Errorf("no probe back within %s of sending it: %w", probe.wait, errNotificationsLost)
		}
		if idle && time.Since(heard) < lc.checkAfter {
			continue // woken for the probe, not idle for checkAfter
		}
		switch {
		case err == nil:
		case !idle:
			return fmt.Errorf("wait for notification: %w", err)
		default:
			// LISTEN again, a no-op on a listening session, as the ping:
			// the session keeps showing LISTEN in pg_stat_activity.
			pingCtx, cancel := context.WithTimeout(stmtCtx, lc.checkAfter)
			_, err := conn.Exec(pingCtx, listen)
			cancel()
			if err != nil {
				return fmt.Errorf("check after %s without a notification: %w", lc.checkAfter, err)
			}
			heard = time.Now()
		}
	}
}

// listenProbe is the probe of one LISTEN connection: sent through the
// pool in a goroutine of its own (a pool with no connection free would
// otherwise hold notifications back for as long as the send may take),
// then awaited on the connection. Only the connection's goroutine calls
// its methods.
type listenProbe struct {
	lc            listenConn
	token         string
	proven        func()
	wait          time.Duration // how long it may take to come back once sent
	cancel        context.CancelFunc
	cancelAcquire context.CancelFunc
	ctx           context.Context // the connection's: ended at shutdown
	sent          chan probeSent  // the send's answer, once
	// sending until the send's answer is read; awaiting until the probe
	// came back or could not be sent, from when it was sent until
	// deadline.
	sending, awaiting bool
	deadline          time.Time
	// unsent: the probe could not be sent, which proves nothing either
	// way. The connection then counts as proven once it has lived
	// checkAfter since started, as when the pool made the send wait that
	// long: a send refused at once (a closed pool) must not reset the
	// pause of a connection that fails right after, at every notification
	// of another connection's probe.
	unsent  bool
	started time.Time
}

// probeSent is sendProbe's answer: whether the probe was sent, and when.
type probeSent struct {
	ok bool
	at time.Time
}

// startProbe sends a probe of a new token through the pool; proven is
// called once it came back or could not be sent. The pool connection is
// acquired under ctx, but the statement, once sent, runs under stmtCtx, as
// the relay's other statements do: cut off, it would leave pgx closing the
// pool connection in the background after Run returned.
func (lc listenConn) startProbe(ctx, stmtCtx context.Context, proven func()) *listenProbe {
	acquireCtx, cancelAcquire := context.WithCancel(ctx)
	sendCtx, cancelSend := context.WithCancel(stmtCtx)
	p := &listenProbe{
		lc: lc, token: uuid.NewString(), proven: proven, wait: max(lc.checkAfter, probeWaitMin),
		cancel: func() { cancelAcquire(); cancelSend() }, cancelAcquire: cancelAcquire, ctx: ctx,
		sent: make(chan probeSent, 1), sending: true, awaiting: true, started: time.Now(),
	}
	go func() { p.sent <- lc.sendProbe(acquireCtx, sendCtx, p.token) }()
	return p
}

// poll reads the send's answer if it has come, and counts a connection
// whose probe was not sent as proven once it has lived checkAfter.
func (p *listenProbe) poll() {
	if p.sending {
		select {
		case r := <-p.sent:
			p.sending = false
			switch {
			case r.ok:
				p.deadline = r.at.Add(p.wait)
			case p.awaiting: // proves nothing either way
				p.awaiting = false
				p.unsent = true
			}
		default:
		}
	}
	if p.unsent && time.Since(p.started) >= p.lc.checkAfter {
		p.unsent = false
		p.proven()
	}
}

// waitFor shortens a wait of d for notifications to end at the deadline,
// or when a connection whose probe was not sent has lived checkAfter.
func (p *listenProbe) waitFor(d time.Duration) time.Duration {
	switch {
	case p.awaiting && !p.sending:
		return min(d, time.Until(p.deadline))
	case p.unsent:
		return min(d, max(0, time.Until(p.started.Add(p.lc.checkAfter))))
	}
	return d
}

// received takes a notification on the probe channel: this connection's
// probe, or another connection's, which is ignored.
func (p *listenProbe) received(payload string) {
	if p.awaiting && payload == p.token {
		p.awaiting = false
		p.lc.logger.Debug("outbox LISTEN probe came back")
		p.proven()
	}
}

// lost reports whether the probe was sent and has not come back by its
// deadline.
func (p *listenProbe) lost() bool {
	return p.awaiting && !p.sending && !time.Now().Before(p.deadline)
}

// stop cancels a send still under way and waits for its goroutine. At
// shutdown (the connection's ctx ended) a send already on its way is let
// finish, within checkAfter and the statements' grace.
func (p *listenProbe) stop() {
	if p.ctx.Err() == nil {
		p.cancel()
	}
	p.cancelAcquire()
	if p.sending {
		<-p.sent
	}
	p.cancel()
}

// sendProbe sends the probe notification with payload token through the
// pool, within checkAfter. A probe that could not be sent (the pool
// exhausted, the database refusing) proves nothing either way, so it is
// only logged at Debug.
func (lc listenConn) sendProbe(acquireCtx, sendCtx context.Context, token string) probeSent {
	start := time.Now()
	acquireCtx, cancelAcquire := context.WithDeadline(acquireCtx, start.Add(lc.checkAfter))
	defer cancelAcquire()
	sendCtx, cancelSend := context.WithDeadline(sendCtx, start.Add(lc.checkAfter))
	defer cancelSend()
	conn, err := lc.pool.Acquire(acquireCtx)
	if err == nil {
		_, err = conn.Exec(sendCtx, `SELECT pg_notify($1::text, $2::text)`, probeChannel, token)
		conn.Release()
	}
	if err != nil {
		lc.logger.Debug("outbox LISTEN probe not sent", slog.String("error", err.Error()))
		return probeSent{}
	}
	return probeSent{ok: true, at: time.Now()}
}

// connect opens the connection from the pool's configuration cfg (a copy),
// running its BeforeConnect hook, within checkAfter.
func (lc listenConn) connect(ctx, abandonCtx context.Context, cfg *pgxpool.Config) (*pgx.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, lc.checkAfter)
	defer cancel()
	// BeforeConnect may change the copy's ConnConfig.
	if cfg.BeforeConnect != nil {
		if err := cfg.BeforeConnect(ctx, cfg.ConnConfig); err != nil {
			return nil, fmt.Errorf("connect: BeforeConnect: %w", lc.bounded(ctx, err))
		}
	}
	// Waits end by a deadline on the socket, which leaves the connection
	// usable (see the idle check), not by a cancel request: a pool
	// configured to send those would open a connection to the server at
	// every idle check.
	cfg.ConnConfig.BuildContextWatcherHandler = func(c *pgconn.PgConn) ctxwatch.Handler {
		return &pgconn.DeadlineContextWatcherHandler{Conn: c.Conn()}
	}
	// pgx queues notifications for WaitForNotification only when no
	// OnNotification callback takes them; the pool's own is for its
	// connections, and here would leave the relays deaf.
	cfg.ConnConfig.OnNotification = nil
	if dial := cfg.ConnConfig.DialFunc; dial != nil {
		cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			ctx, cancel := context.WithCancel(ctx)
			defer cancel()
			defer context.AfterFunc(abandonCtx, cancel)()
			c, err := dial(ctx, network, addr)
			if err == nil {
				context.AfterFunc(abandonCtx, func() { _ = c.Close() })
			}
			return c, err
		}
	}
	conn, err := pgx.ConnectConfig(ctx, cfg.ConnConfig)
	if err != nil {
		return nil, fmt.Errorf("connect: %w", lc.bounded(ctx, err))
	}
	return conn, nil
}

// bounded says, when err comes from ctx's ListenCheckInterval deadline,
// that it was that bound: a setting too short for a slow connection or hook
// fails every attempt, and the log should name it.
func (lc listenConn) bounded(ctx context.Context, err error) error {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return fmt.Errorf("not done within ListenCheckInterval (%s): %w", lc.checkAfter, err)
	}
	return err
}

// listen runs the relay's own LISTEN connection until ctx is done,
// signalling wake on each notification the relay serves and after each
// (re)connection.
func (r *Relay) listen(ctx, workCtx context.Context, wake chan<- struct{}) {
	lc := listenConn{
		pool:       r.pool,
		channel:    r.names.Channel,
		logger:     r.logger,
		backoffMax: r.cfg.ReconnectBackoffMax,
		checkAfter: r.cfg.ListenCheckInterval,
	}
	lc.run(ctx, workCtx, func() { signal(wake) }, func(payload string) {
		if r.serves(payload) {
			signal(wake)
		}
	})
}

// serves reports whether a notification with payload may announce rows this
// relay claims. Writers that know their rows' one stream send it as the
// payload (Append, a Notifier with NotifierConfig.Stream, the leaderboard),
// so that the relays of other streams on the same table stay asleep: every
// wake-up is a claim transaction, and with many relays, one per stream, one
// write would otherwise make every relay claim. An empty payload (several
// streams, or a writer that does not say) wakes every relay.
func (r *Relay) serves(payload string) bool {
	return payload == "" || len(r.cfg.Streams) == 0 || slices.Contains(r.cfg.Streams, payload)
}

// signal records a wake-up without blocking; one pending wake-up is enough.
func signal(wake chan<- struct{}) {
	select {
	case wake <- struct{}{}:
	default:
	}
}
