package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"golang.org/x/sync/errgroup"

	"github.com/verity-go/verity/leaderboard"
)

const (
	ingestClients   = 8
	ingestUsers     = 10_000
	submitBatchSize = 1_000
	// ingestRounds alternates library and seed this many times, so that a
	// change in machine load during the run hits both sides alike.
	ingestRounds = 2
)

// runIngest measures command throughput: leaderboard.Submit (one
// statement; concurrent calls grouped into shared statements, the
// default) against the seed's five-statement transaction, both with 8
// concurrent clients over 10,000 users; Submit with grouping turned off
// (MaxSubmitsPerStatement 1), to show what grouping adds; and SubmitBatch
// with one client sending batches of 1,000, against the same seed figure.
// Each library side writes tables of its own (ingestBoard says why).
// A command counts only if it was stored: any result marked duplicate fails
// the group, and after each phase, outside its timed window, the side's new
// score_events rows must equal its commands and its new outbox rows what
// those commands queue (one per command; for SubmitBatch one per user of a
// batch).
func runIngest(ctx context.Context, e *env) ([]Figure, error) {
	seedSchema, err := e.schema(ctx, "ingest")
	if err != nil {
		return nil, err
	}
	board, err := ingestBoard(ctx, e, "ingest-lib", 0)
	if err != nil {
		return nil, err
	}
	defer board.Close()
	ungrouped, err := ingestBoard(ctx, e, "ingest-ungrouped", 1)
	if err != nil {
		return nil, err
	}
	defer ungrouped.Close()
	batchBoard, err := ingestBoard(ctx, e, "ingest-batch", 0)
	if err != nil {
		return nil, err
	}
	defer batchBoard.Close()
	seed, err := newSeedDesign(ctx, e.pool, e.rdb, seedSchema, "seed_", e.keyPrefix("ingest-seed"))
	if err != nil {
		return nil, err
	}
	userName := func(k int) string { return fmt.Sprintf("user-%d", k) }
	user := func() string { return userName(rand.IntN(ingestUsers)) }

	round := e.opts.Sizes.IngestDuration / ingestRounds
	var lib, libUngrouped, base, batched rate
	// Every command gets a fresh event id, so a result marked duplicate
	// means a command that changed nothing: the phase fails.
	submitOn := func(b *leaderboard.Board, into *rate, what string) ingestPhase {
		return ingestPhase{what: what, into: into, stored: libStored(e, b), run: func() (int64, time.Duration, int64, error) {
			n, d, err := closedLoop(ctx, ingestClients, round, func(ctx context.Context) (int, error) {
				id := uuid.New()
				res, err := b.Submit(ctx, leaderboard.Command{EventID: id, UserID: user(), Delta: 1})
				if err == nil && res.Duplicate {
					err = fmt.Errorf("event %s answered as a duplicate", id)
				}
				return 1, err
			})
			// Submit queues one outbox row per command.
			return n, d, n, err
		}}
	}
	submitLib := submitOn(board, &lib, "leaderboard submit")
	submitUngrouped := submitOn(ungrouped, &libUngrouped, "leaderboard submit, ungrouped")
	submitSeed := ingestPhase{what: "seed submit", into: &base, stored: seed.stored, run: func() (int64, time.Duration, int64, error) {
		n, d, err := closedLoop(ctx, ingestClients, round, func(ctx context.Context) (int, error) {
			id := uuid.New()
			_, version, err := seed.submit(ctx, id, user(), 1)
			if err == nil && version == 0 { // the seed's answer to a duplicate
				err = fmt.Errorf("event %s answered as a duplicate", id)
			}
			return 1, err
		})
		return n, d, n, err
	}}
	cmds := make([]leaderboard.Command, submitBatchSize)
	// drawn[k] is the number of the last batch that drew user-k: SubmitBatch
	// queues one outbox row per user of a batch (its last state), so the
	// check needs each batch's distinct users. Counting them costs an
	// array store per command, next to the uuid.New and Sprintf already
	// there.
	drawn := make([]int, ingestUsers)
	batches := 0
	submitBatch := ingestPhase{what: "SubmitBatch", into: &batched, stored: libStored(e, batchBoard), run: func() (int64, time.Duration, int64, error) {
		var queued int64
		n, d, err := closedLoop(ctx, 1, round, func(ctx context.Context) (int, error) {
			batches++
			users := 0
			for i := range cmds {
				k := rand.IntN(ingestUsers)
				if drawn[k] != batches {
					drawn[k], users = batches, users+1
				}
				cmds[i] = leaderboard.Command{EventID: uuid.New(), UserID: userName(k), Delta: 1}
			}
			res, err := batchBoard.SubmitBatch(ctx, cmds)
			if err != nil {
				return 0, err
			}
			if len(res) != len(cmds) {
				return 0, fmt.Errorf("%d results for %d commands", len(res), len(cmds))
			}
			for i, r := range res {
				if r.Duplicate {
					return 0, fmt.Errorf("event %s answered as a duplicate", cmds[i].EventID)
				}
			}
			queued += int64(users)
			return len(cmds), nil
		})
		return n, d, queued, err
	}}
	// Every other round the seed goes first, and every phase starts after
	// a checkpoint, so that neither side always runs in the other's WAL and
	// dead tuples.
	for r := range ingestRounds {
		phases := []ingestPhase{submitLib, submitSeed, submitUngrouped, submitBatch}
		if r%2 == 1 {
			phases = []ingestPhase{submitSeed, submitUngrouped, submitLib, submitBatch}
		}
		for _, p := range phases {
			if err := p.runChecked(ctx, e); err != nil {
				return nil, err
			}
		}
	}
	var figs []Figure
	for _, f := range []struct {
		name string
		lib  *rate
	}{{"ingest", &lib}, {"ingest_ungrouped", &libUngrouped}, {"ingest_submit_batch", &batched}} {
		value, err := f.lib.measured()
		if err != nil {
			return nil, fmt.Errorf("%s: library: %w", f.name, err)
		}
		baseline, err := base.measured()
		if err != nil {
			return nil, fmt.Errorf("%s: seed: %w", f.name, err)
		}
		figs = append(figs, newFigure(f.name, "commands/s", value, baseline))
	}
	e.log("ingest: Submit %.0f/s (ungrouped %.0f/s), seed %.0f/s, SubmitBatch %.0f/s", lib.perSecond(), libUngrouped.perSecond(), base.perSecond(), batched.perSecond())
	return figs, nil
}

// stored is what one side of the ingest holds: score_events rows and
// outbox rows.
type stored struct{ events, queued int64 }

// ingestPhase is one timed run of one side of the ingest, and the check
// that its commands were stored: a call that returned without an error is
// not proof of that.
type ingestPhase struct {
	what string
	into *rate
	// stored counts what the side holds so far.
	stored func(context.Context) (stored, error)
	// run is the timed closed loop: commands completed, time taken, and
	// the outbox rows those commands should have queued.
	run func() (cmds int64, elapsed time.Duration, queued int64, err error)
}

// runChecked runs the phase after a checkpoint, logs its CPU and WAL per command,
// and adds it to its rate once the side's new score_events rows (one per
// command) and outbox rows match what the phase counted. The counts are
// taken outside the timed window, before the checkpoint.
func (p ingestPhase) runChecked(ctx context.Context, e *env) error {
	before, err := p.stored(ctx)
	if err != nil {
		return fmt.Errorf("%s: counting stored rows: %w", p.what, err)
	}
	e.checkpoint(ctx)
	cpu0, err := e.sampleCPU(ctx)
	if err != nil {
		return err
	}
	wal0 := e.sampleWAL(ctx)
	cmds, elapsed, queued, err := p.run()
	if err != nil {
		return fmt.Errorf("%s: %w", p.what, err)
	}
	wal1 := e.sampleWAL(ctx)
	cpu1, err := e.sampleCPU(ctx)
	if err != nil {
		return err
	}
	e.log("ingest: %s: %.0f commands/s; %s%s", p.what, float64(cmds)/elapsed.Seconds(), cpu0.per("command", cpu1, cmds), wal0.per("command", wal1, cmds))
	after, err := p.stored(ctx)
	if err != nil {
		return fmt.Errorf("%s: counting stored rows: %w", p.what, err)
	}
	if got := (stored{after.events - before.events, after.queued - before.queued}); got != (stored{cmds, queued}) {
		return fmt.Errorf("%s: %d commands stored %d events and queued %d outbox rows, want %d and %d",
			p.what, cmds, got.events, got.queued, cmds, queued)
	}
	return p.into.add(cmds, elapsed, nil)
}

// ingestBoard returns a board of its own tables for one library side of the
// ingest, in a schema of its own named after prefix. Each side writes only
// its own tables, as the seed does. Sharing them, a side's phases ran on
// indexes holding the other sides' rows too (the SubmitBatch phases add
// over 100,000 events a round): in three alternating pairs of -only ingest
// runs (2026-12-05) SubmitBatch ran 20,296–22,569 commands/s so,
// 24,334–27,570 alone.
func ingestBoard(ctx context.Context, e *env, prefix string, maxPerStatement int) (*leaderboard.Board, error) {
	schema, err := e.schema(ctx, strings.ReplaceAll(prefix, "-", "_"))
	if err != nil {
		return nil, err
	}
	cfg := &leaderboard.Config{Name: "bench", Schema: schema, KeyPrefix: e.keyPrefix(prefix), MaxSubmitsPerStatement: maxPerStatement, Logger: quiet}
	if err := leaderboard.Migrate(ctx, e.pool, cfg); err != nil {
		return nil, err
	}
	return leaderboard.New(e.pool, e.rdb, cfg)
}

// libStored counts board's score_events rows and the outbox rows of its
// stream.
func libStored(e *env, board *leaderboard.Board) func(context.Context) (stored, error) {
	cfg := board.Config()
	query := `SELECT (SELECT count(*) FROM ` + qualify(cfg.Schema, leaderboard.ScoreEventsTable) + ` WHERE board = $1),
	(SELECT count(*) FROM ` + qualify(cfg.Schema, cfg.OutboxTable) + ` WHERE stream = $2)`
	return func(ctx context.Context) (stored, error) {
		var s stored
		err := e.pool.QueryRow(ctx, query, board.Name(), board.Stream()).Scan(&s.events, &s.queued)
		return s, err
	}
}

// rate accumulates operations over time.
type rate struct {
	ops     int64
	elapsed time.Duration
}

func (r *rate) add(ops int64, elapsed time.Duration, err error) error {
	r.ops += ops
	r.elapsed += elapsed
	return err
}

func (r *rate) perSecond() float64 {
	if r.elapsed <= 0 {
		return 0
	}
	return float64(r.ops) / r.elapsed.Seconds()
}

// measured is perSecond for a figure: an error when nothing was counted, so
// that a zero is never reported as a measurement.
func (r *rate) measured() (float64, error) {
	if r.ops <= 0 || r.elapsed <= 0 {
		return 0, fmt.Errorf("nothing to measure: %d operations in %s", r.ops, r.elapsed)
	}
	return r.perSecond(), nil
}

// closedLoop runs op from clients goroutines, each starting its next call
// when the previous returns, for d. It returns the operations completed
// (op reports how many one call completed) and the time taken.
func closedLoop(ctx context.Context, clients int, d time.Duration, op func(context.Context) (int, error)) (int64, time.Duration, error) {
	var done atomic.Int64
	start := time.Now()
	deadline := start.Add(d)
	g, gctx := errgroup.WithContext(ctx)
	for range clients {
		g.Go(func() error {
			for time.Now().Before(deadline) {
				n, err := op(gctx)
				if err != nil {
					return err
				}
				done.Add(int64(n))
			}
			return nil
		})
	}
	err := g.Wait()
	return done.Load(), time.Since(start), err
}
