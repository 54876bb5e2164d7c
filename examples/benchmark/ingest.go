package main

import (
	"context"
	"fmt"
	"math/rand/v2"
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
func runIngest(ctx context.Context, e *env) ([]Figure, error) {
	schema, err := e.schema(ctx, "ingest")
	if err != nil {
		return nil, err
	}
	cfg := &leaderboard.Config{Name: "bench", Schema: schema, KeyPrefix: e.keyPrefix("ingest-lib"), Logger: quiet}
	if err := leaderboard.Migrate(ctx, e.pool, cfg); err != nil {
		return nil, err
	}
	board, err := leaderboard.New(e.pool, e.rdb, cfg)
	if err != nil {
		return nil, err
	}
	defer board.Close()
	ungroupedCfg := *cfg
	ungroupedCfg.Name, ungroupedCfg.MaxSubmitsPerStatement = "bench-ungrouped", 1
	ungrouped, err := leaderboard.New(e.pool, e.rdb, &ungroupedCfg)
	if err != nil {
		return nil, err
	}
	defer ungrouped.Close()
	seed, err := newSeedDesign(ctx, e.pool, e.rdb, schema, "seed_", e.keyPrefix("ingest-seed"))
	if err != nil {
		return nil, err
	}
	user := func() string { return fmt.Sprintf("user-%d", rand.IntN(ingestUsers)) }

	round := e.opts.Sizes.IngestDuration / ingestRounds
	var lib, libUngrouped, base, batched rate
	submitOn := func(b *leaderboard.Board, into *rate, what string) func() error {
		return func() error {
			if err := into.add(closedLoop(ctx, ingestClients, round, func(ctx context.Context) (int, error) {
				_, err := b.Submit(ctx, leaderboard.Command{EventID: uuid.New(), UserID: user(), Delta: 1})
				return 1, err
			})); err != nil {
				return fmt.Errorf("%s: %w", what, err)
			}
			return nil
		}
	}
	submitLib := submitOn(board, &lib, "leaderboard submit")
	submitUngrouped := submitOn(ungrouped, &libUngrouped, "leaderboard submit, ungrouped")
	submitSeed := func() error {
		if err := base.add(closedLoop(ctx, ingestClients, round, func(ctx context.Context) (int, error) {
			_, _, err := seed.submit(ctx, uuid.New(), user(), 1)
			return 1, err
		})); err != nil {
			return fmt.Errorf("seed submit: %w", err)
		}
		return nil
	}
	cmds := make([]leaderboard.Command, submitBatchSize)
	submitBatch := func() error {
		if err := batched.add(closedLoop(ctx, 1, round, func(ctx context.Context) (int, error) {
			for i := range cmds {
				cmds[i] = leaderboard.Command{EventID: uuid.New(), UserID: user(), Delta: 1}
			}
			_, err := board.SubmitBatch(ctx, cmds)
			return len(cmds), err
		})); err != nil {
			return fmt.Errorf("SubmitBatch: %w", err)
		}
		return nil
	}
	// Every other round the seed goes first, and every phase starts after
	// a checkpoint, so that neither side always runs in the other's WAL and
	// dead tuples.
	for r := range ingestRounds {
		phases := []func() error{submitLib, submitSeed, submitUngrouped, submitBatch}
		if r%2 == 1 {
			phases = []func() error{submitSeed, submitUngrouped, submitLib, submitBatch}
		}
		for _, phase := range phases {
			e.checkpoint(ctx)
			if err := phase(); err != nil {
				return nil, err
			}
		}
	}
	e.log("ingest: Submit %.0f/s (ungrouped %.0f/s), seed %.0f/s, SubmitBatch %.0f/s", lib.perSecond(), libUngrouped.perSecond(), base.perSecond(), batched.perSecond())
	return []Figure{
		newFigure("ingest", "commands/s", lib.perSecond(), base.perSecond()),
		newFigure("ingest_ungrouped", "commands/s", libUngrouped.perSecond(), base.perSecond()),
		newFigure("ingest_submit_batch", "commands/s", batched.perSecond(), base.perSecond()),
	}, nil
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
