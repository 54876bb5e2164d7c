package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"
	"golang.org/x/sync/errgroup"

	"github.com/verity-go/verity/leaderboard"
	"github.com/verity-go/verity/outbox"
	"github.com/verity-go/verity/projection"
)

const (
	lagRate       = 1_000 // offered commands per second
	lagSubmitters = 16    // goroutines sending the offered commands
	lagSettle     = 10 * time.Second
)

// runLag measures commit → visible-in-Redis latency at a fixed offered
// load of 1,000 commands/s (open loop: command i is sent at start + i ms
// whatever the previous ones are doing), with one running worker.
//
// Method: each command's commit time is when its submit call returned (the
// earliest moment a client knows it committed). Its visible time is when
// the worker's Redis write of that event returned: the handler handed to the
// relay wraps the library's projector and timestamps every record of a batch
// as soon as the gate call succeeds (the write is readable in Redis from
// that moment on, so this errs late by half a round trip at most). The seed
// worker is timestamped the same way, right after its pipelined EVALSHAs
// return and before its UPDATE … published_at. A write made visible before
// the client even heard of the commit counts as zero lag. Timestamping at
// the projector instead of polling Redis keeps the measurement from adding
// load to the thing it measures.
//
// Each side first offers the same load for Sizes.LagWarmup, untimed, so
// that the figures are the steady state: the pool's connections are open,
// their statements prepared and the worker running. Without it the first
// ~100 ms of a run measured the pool opening connections: the worker's
// claims waited for new connections along with 16 submitters (17 acquires
// on a cold pool took 0.24–0.27 s here, with TLS or without), nothing
// became visible for about 90 ms, and that one stall was most of the 100
// slowest of 10,000 commands: p99 8.8–70 ms in six runs, and 4.3 and
// 5.4 ms in two of them without their first 250 commands.
//
// The library worker is a relay woken by LISTEN/NOTIFY (what
// leaderboard.Worker builds). The seed design has no wake-up: its worker
// claims in a loop and sleeps Options.SeedPoll when a claim comes back
// empty.
func runLag(ctx context.Context, e *env) ([]Figure, error) {
	schema, err := e.schema(ctx, "lag")
	if err != nil {
		return nil, err
	}
	d := e.opts.Sizes.LagDuration

	lib, libRate, err := lagLibrary(ctx, e, schema, d)
	if err != nil {
		return nil, fmt.Errorf("library: %w", err)
	}
	e.log("lag: library p50 %.2fms p99 %.2fms (%d commands at %.0f/s)", ms(percentile(lib, .5)), ms(percentile(lib, .99)), len(lib), libRate)
	e.checkpoint(ctx) // the seed starts as clean as the library did
	seed, seedRate, err := lagSeed(ctx, e, schema, d)
	if err != nil {
		return nil, fmt.Errorf("seed: %w", err)
	}
	e.log("lag: seed p50 %.2fms p99 %.2fms (%d commands at %.0f/s)", ms(percentile(seed, .5)), ms(percentile(seed, .99)), len(seed), seedRate)
	return []Figure{
		newFigure("lag_p50", "ms", ms(percentile(lib, .5)), ms(percentile(seed, .5))),
		newFigure("lag_p99", "ms", ms(percentile(lib, .99)), ms(percentile(seed, .99))),
		// The offered 1,000/s is only met if submits keep up; below it,
		// the lag figures were taken at this lower rate.
		newFigure("lag_load_achieved", "commands/s", libRate, seedRate),
	}, nil
}

// lagClock pairs commit and visible times by event id.
type lagClock struct {
	mu        sync.Mutex
	committed map[uuid.UUID]time.Time
	visible   map[uuid.UUID]time.Time
}

func newLagClock() *lagClock {
	return &lagClock{committed: map[uuid.UUID]time.Time{}, visible: map[uuid.UUID]time.Time{}}
}

func (c *lagClock) commit(id uuid.UUID, at time.Time) {
	c.mu.Lock()
	c.committed[id] = at
	c.mu.Unlock()
}

func (c *lagClock) see(ids []uuid.UUID, at time.Time) {
	c.mu.Lock()
	for _, id := range ids {
		if _, ok := c.visible[id]; !ok {
			c.visible[id] = at
		}
	}
	c.mu.Unlock()
}

// wait blocks until every committed event is visible, or fails after
// lagSettle.
func (c *lagClock) wait(ctx context.Context) error {
	deadline := time.Now().Add(lagSettle)
	for {
		c.mu.Lock()
		missing := 0
		for id := range c.committed {
			if _, ok := c.visible[id]; !ok {
				missing++
			}
		}
		c.mu.Unlock()
		if missing == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d committed events never became visible", missing)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// lags returns the sorted commit → visible latencies.
func (c *lagClock) lags() []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]time.Duration, 0, len(c.committed))
	for id, at := range c.committed {
		out = append(out, max(0, c.visible[id].Sub(at)))
	}
	slices.Sort(out)
	return out
}

// openLoop sends rate commands per second for d: command i is due at
// start + i/rate, dispatched to submitters goroutines. It returns the rate
// actually achieved: below lagRate when the submitters could not keep up,
// in which case commands queued before they were sent (that queueing is
// not part of the commit → visible lag).
func openLoop(ctx context.Context, d time.Duration, submit func(context.Context) error) (float64, error) {
	total := int(d.Seconds() * lagRate)
	due := make(chan struct{}, total)
	g, gctx := errgroup.WithContext(ctx)
	start := time.Now()
	for range lagSubmitters {
		g.Go(func() error {
			for range due {
				if err := submit(gctx); err != nil {
					return err
				}
			}
			return nil
		})
	}
	g.Go(func() error {
		defer close(due)
		for i := range total {
			at := start.Add(time.Duration(i) * time.Second / lagRate)
			if wait := time.Until(at); wait > 0 {
				select {
				case <-gctx.Done():
					return gctx.Err()
				case <-time.After(wait):
				}
			}
			due <- struct{}{}
		}
		return nil
	})
	err := g.Wait()
	return float64(total) / time.Since(start).Seconds(), err
}

func lagLibrary(ctx context.Context, e *env, schema string, d time.Duration) ([]time.Duration, float64, error) {
	cfg := &leaderboard.Config{Name: "bench", Schema: schema, KeyPrefix: e.keyPrefix("lag-lib"), Logger: quiet}
	if err := leaderboard.Migrate(ctx, e.pool, cfg); err != nil {
		return nil, 0, err
	}
	board, err := leaderboard.New(e.pool, e.rdb, cfg)
	if err != nil {
		return nil, 0, err
	}
	defer board.Close()
	// What board.Worker builds, with the projector wrapped to timestamp
	// every record whose write succeeded.
	projector, err := projection.NewRedisProjector(e.rdb, board.Mapper(), &projection.Config{Prefix: board.Config().KeyPrefix, Logger: quiet})
	if err != nil {
		return nil, 0, err
	}
	if err := projector.Gate().Load(ctx); err != nil {
		return nil, 0, err
	}
	clock := newLagClock()
	handler := outbox.HandlerFunc(func(ctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
		results, err := projector.Handle(ctx, batch)
		now := time.Now()
		if err == nil {
			ids := make([]uuid.UUID, 0, len(batch))
			for i, r := range results {
				if r.Err == nil {
					ids = append(ids, batch[i].EventID)
				}
			}
			clock.see(ids, now)
		}
		return results, err
	})
	relay, err := outbox.NewRelay(e.pool, handler, &outbox.RelayConfig{
		Schema: schema, Table: board.Config().OutboxTable, Streams: []string{board.Stream()},
		Name: "bench-lag", Logger: quiet, DurableBookkeeping: e.opts.DurableBookkeeping,
	})
	if err != nil {
		return nil, 0, err
	}
	runCtx, stop := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(runCtx) }()
	defer func() { stop(); <-relayDone }()

	submit := func(ctx context.Context) error {
		id := uuid.New()
		if _, err := board.Submit(ctx, leaderboard.Command{EventID: id, UserID: fmt.Sprintf("user-%d", rand.IntN(ingestUsers)), Delta: 1}); err != nil {
			return err
		}
		clock.commit(id, time.Now())
		return nil
	}
	// Warm up: the relay's LISTEN is in place once a command is seen.
	if err := submit(ctx); err != nil {
		return nil, 0, err
	}
	if err := clock.wait(ctx); err != nil {
		return nil, 0, fmt.Errorf("warm-up: %w", err)
	}
	achieved, err := warmThenMeasure(ctx, clock, e.opts.Sizes.LagWarmup, d, submit)
	if err != nil {
		return nil, 0, err
	}
	return clock.lags(), achieved, nil
}

// warmThenMeasure offers load for warm, waits until all of it is visible,
// forgets it, and then offers the timed load for d, returning once all of
// that is visible too; clock then holds the timed commands only.
func warmThenMeasure(ctx context.Context, clock *lagClock, warm, d time.Duration, submit func(context.Context) error) (float64, error) {
	if warm > 0 {
		if _, err := openLoop(ctx, warm, submit); err != nil {
			return 0, fmt.Errorf("warm-up: %w", err)
		}
		if err := clock.wait(ctx); err != nil {
			return 0, fmt.Errorf("warm-up: %w", err)
		}
	}
	resetClock(clock)
	achieved, err := openLoop(ctx, d, submit)
	if err != nil {
		return 0, err
	}
	return achieved, clock.wait(ctx)
}

// resetClock empties c in place (the handler holds it).
func resetClock(c *lagClock) {
	c.mu.Lock()
	clear(c.committed)
	clear(c.visible)
	c.mu.Unlock()
}

func lagSeed(ctx context.Context, e *env, schema string, d time.Duration) ([]time.Duration, float64, error) {
	seed, err := newSeedDesign(ctx, e.pool, e.rdb, schema, "seed_", e.keyPrefix("lag-seed"))
	if err != nil {
		return nil, 0, err
	}
	if seed.workerPool, err = e.seedWorkerPool(ctx); err != nil {
		return nil, 0, err
	}
	clock := newLagClock()
	onProjected := func(rows []seedRow) {
		now := time.Now()
		ids := make([]uuid.UUID, len(rows))
		for i, r := range rows {
			ids[i] = r.eventID
		}
		clock.see(ids, now)
	}
	runCtx, stop := context.WithCancel(ctx)
	workerDone := make(chan error, 1)
	go func() {
		for {
			n, err := seed.drainBatch(runCtx, onProjected)
			if runCtx.Err() != nil { // stopped; a batch cut short is rolled back
				workerDone <- nil
				return
			}
			if err != nil {
				workerDone <- err
				return
			}
			if n == 0 {
				select {
				case <-runCtx.Done():
				case <-time.After(e.opts.SeedPoll):
				}
			}
		}
	}()
	stopWorker := sync.OnceValue(func() error {
		stop()
		return <-workerDone
	})
	defer stopWorker() //nolint:errcheck // reported below on the success path
	submit := func(ctx context.Context) error {
		id := uuid.New()
		_, version, err := seed.submit(ctx, id, fmt.Sprintf("user-%d", rand.IntN(ingestUsers)), 1)
		if err != nil {
			return err
		}
		if version == 0 { // the seed's duplicate answer: nothing was committed to time
			return fmt.Errorf("seed submit of a fresh event id %s answered as a duplicate", id)
		}
		clock.commit(id, time.Now())
		return nil
	}
	achieved, err := warmThenMeasure(ctx, clock, e.opts.Sizes.LagWarmup, d, submit)
	if err != nil {
		return nil, 0, err
	}
	if err := stopWorker(); err != nil {
		return nil, 0, err
	}
	return clock.lags(), achieved, nil
}
