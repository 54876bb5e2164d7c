package main

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"golang.org/x/sync/errgroup"

	"github.com/verity-go/verity/outbox"
	"github.com/verity-go/verity/projection"
)

// drainStream is the outbox stream the drain figures project.
const drainStream = "bench-drain"

// drainRounds alternates library and seed this many times.
const drainRounds = 2

// oneWorkerShare is the fraction of the backlog (1/oneWorkerShare) the
// drain_1_worker figure drains.
const oneWorkerShare = 4

// drainWarmupShare is the fraction of the backlog (1/drainWarmupShare) each
// side drains, untimed, before the timed rounds.
const drainWarmupShare = 10

// minDrainRows is the smallest backlog (-drain-rows) that leaves every round
// of both figures at least one row; below it drain_1_worker drains nothing.
const minDrainRows = oneWorkerShare * drainRounds

// runDrain measures how fast a pre-filled outbox is projected into a sorted
// set: the library's relays (partition leases: one lease row written per
// partition per batch, the rows read with a plain SELECT; no transaction
// held during the Redis call; one batched gate call per batch; DELETE on
// acknowledgement) against the seed's workers (a transaction per batch
// holding FOR UPDATE SKIP LOCKED while one EVALSHA per event runs,
// pipelined, then UPDATE … SET published_at). Both sides get the same rows
// and the same number of workers; the library claims -batch rows at a time
// (its default, 1000), the seed its LIMIT 100. The clock runs from the
// first claim to the last acknowledgement; filling is not timed. Before
// the timed rounds each side drains a tenth of the backlog, untimed, on
// tables and keys of its own (see drainWarmUp). Each
// side's CPU per row, this process's and the Redis server's (and, when
// PostgreSQL runs on this host, its processes' and how busy the CPUs
// were, from /proc), is logged: on a machine with few cores the drain is bound by the CPU that the
// relays, PostgreSQL and Redis spend per row together.
func runDrain(ctx context.Context, e *env) ([]Figure, error) {
	schema, err := e.schema(ctx, "drain")
	if err != nil {
		return nil, err
	}
	n, users := e.opts.Sizes.DrainRows, e.opts.Sizes.DrainUsers
	seedPool, err := e.seedWorkerPool(ctx)
	if err != nil {
		return nil, err
	}
	if err := drainWarmUp(ctx, e, seedPool, schema, n/drainWarmupShare, users); err != nil {
		return nil, err
	}
	var figs []Figure
	for pass, workers := range []int{e.opts.Relays, 1} {
		rows := n
		name := "drain"
		if pass == 1 {
			if e.opts.Relays == 1 {
				break // the first pass was the one-worker figure
			}
			// One worker each: where the gain comes from without concurrency.
			rows, name = n/oneWorkerShare, "drain_1_worker"
		}
		// Two rounds, alternating sides and which side goes first, so that
		// a change in machine load during the run, or what one side leaves
		// for the next (dead tuples, autovacuum), hits both alike.
		var lib, seed rate
		for round := range drainRounds {
			tag := fmt.Sprintf("w%d_r%d", workers, round)
			part := rows / drainRounds
			runLib := func() error {
				r, err := drainLibrary(ctx, e, schema, tag, part, min(users, part), workers)
				if err := lib.add(int64(part), r, err); err != nil {
					return fmt.Errorf("library: %w", err)
				}
				return nil
			}
			runSeed := func() error {
				r, err := drainSeed(ctx, e, seedPool, schema, tag, part, min(users, part), workers)
				if err := seed.add(int64(part), r, err); err != nil {
					return fmt.Errorf("seed: %w", err)
				}
				return nil
			}
			first, second := runLib, runSeed
			if round%2 == 1 {
				first, second = runSeed, runLib
			}
			if err := first(); err != nil {
				return nil, err
			}
			if err := second(); err != nil {
				return nil, err
			}
		}
		libRate, err := lib.measured()
		if err != nil {
			return nil, fmt.Errorf("%s: library: %w", name, err)
		}
		seedRate, err := seed.measured()
		if err != nil {
			return nil, fmt.Errorf("%s: seed: %w", name, err)
		}
		e.log("drain: %d workers: library %.0f rows/s, seed %.0f rows/s", workers, libRate, seedRate)
		figs = append(figs, newFigure(name, "rows/s", libRate, seedRate))
	}
	return figs, nil
}

// drainWarmUp drains n rows with each side in turn, untimed, on tables and
// keys of its own, so that the timed rounds measure workers that are
// already running. A process's first drain pays once for what a
// long-running worker has behind it: its pool's connections opened, the Go
// heap grown to its working size, its PostgreSQL backends' caches filled.
// Without a warm-up that cost fell on the library's first round, which goes
// first: 30–40 ms a batch against 24–32 in its second, this process's CPU
// per row 4.0–5.3 µs against 3.0–4.3 (2026-12-07); the alternating order of
// the rounds does not cancel a cost paid once. Tables of its own, because a
// warm-up on the timed tables leaves published rows in the seed's table and
// slows its timed rounds (RESULTS.md, 2026-12-01).
func drainWarmUp(ctx context.Context, e *env, seedPool *pgxpool.Pool, schema string, n, users int) error {
	if n == 0 {
		return nil
	}
	if _, err := drainLibrary(ctx, e, schema, "warmup", n, min(users, n), e.opts.Relays); err != nil {
		return fmt.Errorf("drain warm-up: library: %w", err)
	}
	if _, err := drainSeed(ctx, e, seedPool, schema, "warmup", n, min(users, n), e.opts.Relays); err != nil {
		return fmt.Errorf("drain warm-up: seed: %w", err)
	}
	return nil
}

// fillOutbox inserts n rows into the library outbox table: key
// user-(i mod users), version rising per key, payload a base-10 score.
func fillOutbox(ctx context.Context, pool *pgxpool.Pool, table, stream string, n, users int) error {
	const chunk = 100_000
	for lo := 0; lo < n; lo += chunk {
		hi := min(lo+chunk, n)
		_, err := pool.Exec(ctx, `INSERT INTO `+table+` (event_id, stream, key, version, payload)
SELECT gen_random_uuid(), $3, 'user-' || (g % $4), g / $4 + 1, convert_to((g % 1000)::text, 'UTF8')
FROM generate_series($1::bigint, $2::bigint - 1) AS g ORDER BY g`, lo, hi, stream, users)
		if err != nil {
			return err
		}
	}
	_, err := pool.Exec(ctx, `ANALYZE `+table)
	return err
}

// newOutbox migrates an outbox table in schema and returns its quoted name.
func newOutbox(ctx context.Context, pool *pgxpool.Pool, schema, table string) (string, error) {
	cfg := &outbox.Config{Schema: schema, Table: table}
	if err := outbox.Migrate(ctx, pool, cfg); err != nil {
		return "", err
	}
	w, err := outbox.NewWriter(cfg)
	if err != nil {
		return "", err
	}
	return w.Table(), nil
}

// batchTimes splits the relays' time: in RunOnce as a whole, and in the
// projector (the Redis part); the rest is the claim and settle statements.
type batchTimes struct {
	batches             atomic.Int64
	total, inProjection atomic.Int64 // nanoseconds
}

func (t *batchTimes) String() string {
	n := max(t.batches.Load(), 1)
	total, proj := time.Duration(t.total.Load()/n), time.Duration(t.inProjection.Load()/n)
	return fmt.Sprintf("%d batches, %s each: %s claim+settle, %s projecting",
		n, total.Round(time.Microsecond), (total - proj).Round(time.Microsecond), proj.Round(time.Microsecond))
}

// drainRelays runs relays RunOnce loops over one outbox until none finds a
// due row, and returns how many rows they handled. Polling (no LISTEN):
// the backlog is there before they start. times, if not nil, collects
// where the batches spent their time.
func drainRelays(ctx context.Context, pool *pgxpool.Pool, rdb redis.UniversalClient, schema, table, keyPrefix string, relays, batch int, durable bool, times *batchTimes) (int64, time.Duration, error) {
	projector, err := projection.NewRedisProjector(rdb, projection.SortedSetMapper("drain"), &projection.Config{Prefix: keyPrefix, Logger: quiet})
	if err != nil {
		return 0, 0, err
	}
	if err := projector.Gate().Load(ctx); err != nil {
		return 0, 0, err
	}
	var handler outbox.Handler = projector
	if times != nil {
		handler = outbox.HandlerFunc(func(ctx context.Context, b []outbox.Record) ([]outbox.Result, error) {
			start := time.Now()
			defer func() { times.inProjection.Add(int64(time.Since(start))) }()
			return projector.Handle(ctx, b)
		})
	}
	counts := make([]int64, relays)
	made := make([]*outbox.Relay, relays)
	for i := range relays {
		made[i], err = outbox.NewRelay(pool, handler, &outbox.RelayConfig{
			Schema: schema, Table: table, BatchSize: batch, DisableNotify: true, DurableBookkeeping: durable,
			Name: fmt.Sprintf("bench-%d", i), Logger: quiet,
		})
		if err != nil {
			return 0, 0, err
		}
	}
	start := time.Now() // setup above is not timed, as the seed's is not
	g, gctx := errgroup.WithContext(ctx)
	for i, relay := range made {
		g.Go(func() error {
			for {
				start := time.Now()
				n, err := relay.RunOnce(gctx)
				if times != nil && n > 0 {
					times.batches.Add(1)
					times.total.Add(int64(time.Since(start)))
				}
				counts[i] += int64(n)
				if err != nil {
					return err
				}
				if n == 0 {
					return nil
				}
			}
		})
	}
	err = g.Wait()
	elapsed := time.Since(start)
	var total int64
	for _, c := range counts {
		total += c
	}
	return total, elapsed, err
}

// drainLibrary fills a fresh outbox with n rows and drains it with relays
// relays, returning the time taken.
func drainLibrary(ctx context.Context, e *env, schema, tag string, n, users, relays int) (time.Duration, error) {
	table, err := newOutbox(ctx, e.pool, schema, "outbox_"+tag)
	if err != nil {
		return 0, err
	}
	if err := fillOutbox(ctx, e.pool, table, drainStream, n, users); err != nil {
		return 0, err
	}
	kp := e.keyPrefix("drain-lib-" + tag)
	var times batchTimes
	e.checkpoint(ctx) // the fill's WAL flushed, for both sides alike
	cpu0, err := e.sampleCPU(ctx)
	if err != nil {
		return 0, err
	}
	handled, elapsed, err := drainRelays(ctx, e.pool, e.rdb, schema, "outbox_"+tag, kp, relays, e.opts.BatchSize, e.opts.DurableBookkeeping, &times)
	if err != nil {
		return 0, err
	}
	cpu1, err := e.sampleCPU(ctx)
	if err != nil {
		return 0, err
	}
	e.log("drain: library %s: %s; %s", tag, &times, cpu0.per("row", cpu1, int64(n)))
	if handled != int64(n) {
		return 0, fmt.Errorf("library drain incomplete: %d handled of %d", handled, n)
	}
	if err := checkDrained(ctx, e, schema, "outbox_"+tag, kp, n, users); err != nil {
		return 0, fmt.Errorf("library drain: %w", err)
	}
	return elapsed, nil
}

// checkDrained fails unless the library's relays drained a fillOutbox of n
// rows over users members from table into the projector under keyPrefix:
// nothing left in the table, no dead letter, every member holding its last
// row's score and version. Rows handled are not enough: a relay's count
// includes the records its handler refused.
func checkDrained(ctx context.Context, e *env, schema, table, keyPrefix string, n, users int) error {
	// The dead-letter table is Table+"_dead" (outbox.Config.Table).
	var left, dead int64
	if err := e.pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+qualify(schema, table)+`), (SELECT count(*) FROM `+qualify(schema, table+"_dead")+`)`).
		Scan(&left, &dead); err != nil {
		return err
	}
	ks, err := projection.NewKeyspace(keyPrefix)
	if err != nil {
		return err
	}
	target := projection.Target{Kind: projection.KindSortedSet, Name: "drain"}
	card, err := e.rdb.ZCard(ctx, ks.ValueKey(target)).Result()
	if err != nil {
		return err
	}
	if left != 0 || dead != 0 || card != int64(users) {
		return fmt.Errorf("incomplete: %d rows left, %d dead letters, %d members of %d", left, dead, card, users)
	}
	// The projector's Keyspace has no version buckets: one version hash.
	return checkProjected(ctx, e.rdb, ks.ValueKey(target), ks.VersionKey(target), n, users)
}

// drainSeed fills fresh seed tables with n rows and drains them with
// workers seed workers, returning the time taken.
func drainSeed(ctx context.Context, e *env, workPool *pgxpool.Pool, schema, tag string, n, users, workers int) (time.Duration, error) {
	seed, err := newSeedDesign(ctx, e.pool, e.rdb, schema, "seed_"+tag+"_", e.keyPrefix("drain-seed-"+tag))
	if err != nil {
		return 0, err
	}
	if err := seed.fill(ctx, n, users); err != nil {
		return 0, err
	}
	seed.workerPool = workPool
	e.checkpoint(ctx) // the fill's WAL flushed, for both sides alike
	cpu0, err := e.sampleCPU(ctx)
	if err != nil {
		return 0, err
	}
	start := time.Now()
	g, gctx := errgroup.WithContext(ctx)
	for range workers {
		g.Go(func() error {
			for {
				got, err := seed.drainBatch(gctx, nil)
				if err != nil || got == 0 {
					return err
				}
			}
		})
	}
	if err := g.Wait(); err != nil {
		return 0, err
	}
	elapsed := time.Since(start)
	cpu1, err := e.sampleCPU(ctx)
	if err != nil {
		return 0, err
	}
	e.log("drain: seed %s: %s", tag, cpu0.per("row", cpu1, int64(n)))
	// The same check as the library's.
	left, err := seed.pending(ctx)
	if err != nil {
		return 0, err
	}
	card, err := e.rdb.ZCard(ctx, seed.zset).Result()
	if err != nil {
		return 0, err
	}
	if left != 0 || card != int64(users) {
		return 0, fmt.Errorf("seed drain incomplete: %d rows left, %d members of %d", left, card, users)
	}
	if err := checkProjected(ctx, e.rdb, seed.zset, seed.versions, n, users); err != nil {
		return 0, fmt.Errorf("seed drain: %w", err)
	}
	return elapsed, nil
}

// checkProjected fails unless every member user-0 … user-(users-1) holds
// the score and version of its last row in a fill of n rows (fillOutbox and
// seedDesign.fill alike: row g is user-(g mod users), score g mod 1000,
// version g/users + 1, both stored as is): the highest version wins
// whatever order the workers applied the rows in. Counting rows and
// members alone would accept a drain whose every write was refused as
// stale. One pipelined ZMSCORE + HMGET per page of members, after the clock
// stopped.
func checkProjected(ctx context.Context, rdb *redis.Client, zkey, vkey string, n, users int) error {
	const page = 1_000
	wrong, first := 0, ""
	for lo := 0; lo < users; lo += page {
		members := make([]string, 0, page)
		for k := lo; k < min(lo+page, users); k++ {
			members = append(members, "user-"+strconv.Itoa(k))
		}
		pipe := rdb.Pipeline()
		scores := pipe.ZMScore(ctx, zkey, members...)
		versions := pipe.HMGet(ctx, vkey, members...)
		if _, err := pipe.Exec(ctx); err != nil {
			return fmt.Errorf("reading the projected members: %w", err)
		}
		for i, member := range members {
			k := lo + i
			last := (n-1-k)/users*users + k // user-k's last row
			wantScore, wantVersion := float64(last%1000), strconv.Itoa(last/users+1)
			gotVersion, _ := versions.Val()[i].(string) // nil when absent
			if gotScore := scores.Val()[i]; gotScore != wantScore || gotVersion != wantVersion {
				if wrong == 0 {
					first = fmt.Sprintf("%s: score %g version %q, want %g version %s", member, gotScore, gotVersion, wantScore, wantVersion)
				}
				wrong++
			}
		}
	}
	if wrong > 0 {
		return fmt.Errorf("%d of %d members hold a wrong score or version (first %s)", wrong, users, first)
	}
	return nil
}
