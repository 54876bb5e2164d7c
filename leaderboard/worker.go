package leaderboard

import (
	"context"
	"errors"
	"fmt"
	"strconv"

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
	// logger...). Its Schema, Table and Streams are set by the board and
	// must be left empty. Defaults to the outbox package's defaults.
	Relay *outbox.RelayConfig
}

// Worker projects the board's outbox stream into Redis: an outbox relay
// restricted to the board's stream, whose handler maps each record and
// applies it through the projection's version gate. Any number of workers
// may run, in any number of processes; delivery is at-least-once and the
// gate makes redeliveries and out-of-order deliveries harmless.
type Worker struct {
	board *Board
	gate  *projection.Gate
	relay *outbox.Relay
}

// Worker returns a Worker for the board. It does not start it; call Run.
func (b *Board) Worker(cfg *WorkerConfig) (*Worker, error) {
	var rc outbox.RelayConfig
	if cfg != nil && cfg.Relay != nil {
		rc = *cfg.Relay
	}
	if rc.Schema != "" || rc.Table != "" || len(rc.Streams) != 0 {
		return nil, errors.New("leaderboard: WorkerConfig.Relay: leave Schema, Table and Streams empty; the board sets them")
	}
	rc.Schema, rc.Table, rc.Streams = b.cfg.Schema, b.cfg.OutboxTable, []string{b.stream}
	if rc.Name == "" {
		rc.Name = "leaderboard-" + b.cfg.Name
	}
	if rc.Logger == nil {
		rc.Logger = b.cfg.Logger
	}
	w := &Worker{board: b, gate: projection.NewGate(b.rdb, b.ks)}
	relay, err := outbox.NewRelay(b.pool, outbox.HandlerFunc(w.handle), &rc)
	if err != nil {
		return nil, fmt.Errorf("leaderboard: worker: %w", err)
	}
	w.relay = relay
	return w, nil
}

// Run projects until ctx is cancelled, then shuts down gracefully (see
// outbox.Relay.Run). It returns nil after a cancellation.
func (w *Worker) Run(ctx context.Context) error {
	err := w.relay.Run(ctx)
	if errors.Is(err, context.Canceled) && ctx.Err() != nil {
		return nil
	}
	return err
}

// RunOnce projects one batch and returns how many records it handled.
func (w *Worker) RunOnce(ctx context.Context) (int, error) { return w.relay.RunOnce(ctx) }

// Drain projects batches until none is due, and returns how many records
// it handled. Records backing off after a failure are not due and are left
// alone.
func (w *Worker) Drain(ctx context.Context) (int, error) {
	total := 0
	for {
		n, err := w.relay.RunOnce(ctx)
		total += n
		if err != nil || n == 0 {
			return total, err
		}
	}
}

// Relay returns the underlying relay (for Stats and dead letters).
func (w *Worker) Relay() *outbox.Relay { return w.relay }

// handle maps a batch and applies it through the gate. A record that does
// not map fails alone (the relay retries it, then dead-letters it); a Redis
// error fails the batch.
func (w *Worker) handle(ctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
	results := make([]outbox.Result, len(batch))
	writes := make([]projection.Write, 0, len(batch))
	index := make([]int, 0, len(batch))
	mapper := w.board.Mapper()
	for i, rec := range batch {
		wr, err := mapper.Map(rec)
		if err != nil {
			results[i].Err = err
			continue
		}
		writes = append(writes, wr)
		index = append(index, i)
	}
	if len(writes) == 0 {
		return results, nil
	}
	outcomes, err := w.gate.Apply(ctx, writes)
	if err != nil && (!errors.Is(err, projection.ErrCorruptVersion) || len(outcomes) != len(writes)) {
		return nil, err
	}
	for j, o := range outcomes {
		if o == projection.OutcomeUnknown {
			results[index[j]].Err = fmt.Errorf("leaderboard: projecting %s: %w", writes[j].Target, err)
		}
	}
	return results, nil
}
