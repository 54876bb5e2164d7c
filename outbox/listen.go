package outbox

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
)

// listenCloseTimeout bounds closing the LISTEN connection.
const listenCloseTimeout = 2 * time.Second

// listen keeps a dedicated connection LISTENing on the outbox channel until
// ctx is done, signalling wake on every notification. The connection is
// opened from the pool's configuration, running the pool's BeforeConnect,
// AfterConnect and BeforeClose hooks as the pool does (they may supply credentials, the
// host, or session settings), but is not a pool connection: holding a pooled
// connection forever would shrink the pool, and a pooled connection may be
// reset or closed under the listener. After any error it reconnects with a
// growing pause.
//
// The LISTEN statement (and AfterConnect, which may run statements) runs
// under workCtx, which outlives ctx by the shutdown grace: a statement cut
// off mid-flight makes pgx close the connection in a goroutine of its own,
// which on a TLS connection can wait out pgx's 15 s deadline, whereas
// waiting for a notification is cut off cleanly and the connection is then
// closed in place.
func (r *Relay) listen(ctx, workCtx context.Context, wake chan<- struct{}) {
	pause := newPauser(r.cfg.ReconnectBackoffMax)
	for {
		err := r.listenOnce(ctx, workCtx, wake, pause.reset)
		if ctx.Err() != nil {
			return
		}
		d := pause.next()
		r.logger.Warn("outbox relay LISTEN connection failed; reconnecting",
			slog.String("error", err.Error()), slog.Duration("pause", d))
		if !sleep(ctx, d) {
			return
		}
	}
}

// listenOnce connects, LISTENs and relays notifications until an error. It
// calls connected once LISTEN is in effect and then signals wake, because a
// notification sent while no connection was listening is lost for good.
func (r *Relay) listenOnce(ctx, workCtx context.Context, wake chan<- struct{}, connected func()) error {
	// Config returns a copy, so BeforeConnect may change its ConnConfig.
	poolCfg := r.pool.Config()
	if poolCfg.BeforeConnect != nil {
		if err := poolCfg.BeforeConnect(ctx, poolCfg.ConnConfig); err != nil {
			return fmt.Errorf("connect: BeforeConnect: %w", err)
		}
	}
	conn, err := pgx.ConnectConfig(ctx, poolCfg.ConnConfig)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
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
		// wait for it as pgxpool does, so that Run leaves nothing running.
		select {
		case <-conn.PgConn().CleanupDone():
		case <-closeCtx.Done():
		}
	}()
	// A failure closes the connection in the deferred function above.
	if poolCfg.AfterConnect != nil {
		if err := poolCfg.AfterConnect(workCtx, conn); err != nil {
			return fmt.Errorf("connect: AfterConnect: %w", err)
		}
	}
	hooked = true
	if _, err := conn.Exec(workCtx, "LISTEN "+pgx.Identifier{r.names.Channel}.Sanitize()); err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	connected()
	r.logger.Debug("outbox relay listening", slog.String("channel", r.names.Channel))
	signal(wake)
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return fmt.Errorf("wait for notification: %w", err)
		}
		if r.serves(n.Payload) {
			signal(wake)
		}
	}
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
