package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/services"
)

// Figure is one measured result: the library's value, the seed design's
// value on the same servers, and their ratio value/baseline. Whether higher
// or lower is better depends on the unit (rows/s: higher; ms, bytes: lower).
type Figure struct {
	Name     string  `json:"name"`
	Value    float64 `json:"value"`
	Unit     string  `json:"unit"`
	Baseline float64 `json:"baseline"`
	Ratio    float64 `json:"ratio"`
}

func newFigure(name, unit string, value, baseline float64) Figure {
	ratio := 0.0
	if baseline > 0 {
		ratio = value / baseline
	}
	return Figure{Name: name, Value: value, Unit: unit, Baseline: baseline, Ratio: ratio}
}

// Sizes are the workload sizes of one run; quickSizes and fullSizes are
// the two presets.
type Sizes struct {
	DrainRows      int           // outbox rows drained by each side
	DrainUsers     int           // distinct members those rows project
	IngestDuration time.Duration // how long each ingest variant runs
	LagDuration    time.Duration // how long each lag variant offers load (timed)
	LagWarmup      time.Duration // untimed load each lag variant offers first
	LagIdle        time.Duration // idle time before the lag group, after other groups (see run)
	CacheReads     int           // timed reads per cache variant
	ReconcileUsers int           // rows in the reconciled table
	MemoryMembers  int           // members projected for the memory figure
	RSSSmall       int           // backlog of the small relay child
	RSSLarge       int           // backlog of the large relay child
}

var (
	quickSizes = Sizes{
		DrainRows: 3_000, DrainUsers: 1_000,
		IngestDuration: time.Second, LagDuration: time.Second, LagWarmup: 200 * time.Millisecond, LagIdle: 0,
		CacheReads: 2_000, ReconcileUsers: 5_000, MemoryMembers: 2_000,
		RSSSmall: 2_000, RSSLarge: 20_000,
	}
	fullSizes = Sizes{
		DrainRows: 200_000, DrainUsers: 10_000,
		IngestDuration: 10 * time.Second, LagDuration: 10 * time.Second, LagWarmup: time.Second, LagIdle: 30 * time.Second,
		CacheReads: 20_000, ReconcileUsers: 200_000, MemoryMembers: 100_000,
		RSSSmall: 100_000, RSSLarge: 1_000_000,
	}
)

// Options configure a harness run.
type Options struct {
	PostgresURL string // server URL, without a search_path
	RedisURL    string
	Sizes       Sizes
	Relays      int // relays (library) and seed workers (baseline) draining together
	BatchSize   int // rows per relay claim; the seed worker keeps its LIMIT 100
	SeedPoll    time.Duration
	// DurableBookkeeping makes the workers of both sides commit their
	// claims and acknowledgements durably, in the drain and lag figures:
	// the library's relays with outbox.RelayConfig.DurableBookkeeping, the
	// seed's worker with synchronous_commit on. By default neither does
	// (the relays' default, and a seed worker connection with
	// synchronous_commit off): safe for an at-least-once relay, since a
	// claim or acknowledgement lost in a database crash only means a
	// redelivery, which the version gate (and the seed's marker) answers
	// as a duplicate.
	DurableBookkeeping bool
	Only               []string // figure groups to run; empty means all
	Suffix             string   // names this run's schemas and keys; random when empty
	Progress           io.Writer
}

// figure groups, in the order they run.
var groups = []string{"drain", "ingest", "lag", "cache", "reconcile", "memory", "rss"}

// env is what every figure group gets: shared clients and the run's
// namespaces. Every schema and key it hands out is removed by close.
type env struct {
	opts    Options
	pool    *pgxpool.Pool
	rdb     *redis.Client
	suffix  string
	prefix  string // Redis key prefix of the whole run
	schemas []string
	workers *pgxpool.Pool
	log     func(format string, args ...any)

	checkpointRefused bool // logged once
}

// checkGroups refuses a figure group name the harness does not have.
func checkGroups(only []string) error {
	for _, g := range only {
		if !slices.Contains(groups, g) {
			return fmt.Errorf("unknown figure group %q (have %s)", g, strings.Join(groups, ", "))
		}
	}
	return nil
}

// Run executes the selected figure groups one after another and returns
// their figures. It always removes what it created.
func Run(ctx context.Context, opts Options) (figs []Figure, err error) {
	if err := checkGroups(opts.Only); err != nil {
		return nil, err
	}
	poolCfg, err := pgxpool.ParseConfig(opts.PostgresURL)
	if err != nil {
		return nil, fmt.Errorf("parsing the PostgreSQL URL: %w", err)
	}
	poolCfg.MaxConns = int32(max(24, opts.Relays+8)) // every relay (and seed worker under -durable-bookkeeping) its connection
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	if err != nil {
		return nil, fmt.Errorf("connecting to PostgreSQL: %w", err)
	}
	defer pool.Close()
	redisOpts, err := services.ParseRedisURL(opts.RedisURL)
	if err != nil {
		return nil, fmt.Errorf("parsing the Redis URL: %w", err)
	}
	redisOpts.PoolSize = 32
	rdb := redis.NewClient(redisOpts)
	defer rdb.Close()

	suffix := opts.Suffix
	if suffix == "" {
		suffix = services.RandomSuffix(8)
	}
	e := &env{
		opts:   opts,
		pool:   pool,
		rdb:    rdb,
		suffix: suffix,
		prefix: "verity-bench-" + suffix + ":",
		log: func(format string, args ...any) {
			if opts.Progress != nil {
				fmt.Fprintf(opts.Progress, "%s  "+format+"\n", append([]any{time.Now().Format("15:04:05")}, args...)...)
			}
		},
	}
	defer func() { err = errors.Join(err, e.close(ctx)) }()

	runners := map[string]func(context.Context, *env) ([]Figure, error){
		"drain":     runDrain,
		"ingest":    runIngest,
		"lag":       runLag,
		"cache":     runCache,
		"reconcile": runReconcile,
		"memory":    runMemory,
		"rss":       runRSS,
	}
	ran := 0
	for _, g := range groups {
		if len(opts.Only) > 0 && !slices.Contains(opts.Only, g) {
			continue
		}
		// The write-heavy groups disturb the lag figure's tail for longer
		// than the cleanup below reaches: right after the drain and ingest
		// groups its p99 was 6.1–11.5 ms in 14 runs, against 3.2–4.8 ms
		// in 13 runs of the lag group alone, 5.0–5.5 after 10 s of idling
		// and 3.9–4.9 after 30 s (2026-12-05; the seed's p99 moved
		// likewise); in full runs, 2.99–9.54 ms in eighteen with the pause
		// (6.81–9.54 in the six of a slow phase of the VM) against
		// 6.5–10.3 in six without. What takes that long to pass
		// was not found: a garbage collection of this process (with its
		// memory returned to the OS) or new pool connections before the
		// group did not help.
		if g == "lag" && ran > 0 && opts.Sizes.LagIdle > 0 {
			e.log("lag: idling %s first, for the write-heavy groups' aftermath to pass", opts.Sizes.LagIdle)
			select {
			case <-ctx.Done():
				return figs, ctx.Err()
			case <-time.After(opts.Sizes.LagIdle):
			}
		}
		ran++
		e.log("%s: start", g)
		start := time.Now()
		got, err := runners[g](ctx, e)
		if err != nil {
			return figs, fmt.Errorf("%s: %w", g, err)
		}
		// Each group cleans up before the next starts: autovacuum of the
		// ingest group's tables and the checkpoint its WAL triggered ran
		// into the lag group after it (p99 7-9 ms alone, 11-12 ms after
		// ingest).
		if err := e.cleanup(ctx); err != nil {
			return figs, fmt.Errorf("%s: cleaning up: %w", g, err)
		}
		e.log("%s: done in %s", g, time.Since(start).Round(time.Millisecond))
		figs = append(figs, got...)
	}
	return figs, nil
}

// schema creates a fresh schema for one figure group; close drops it.
func (e *env) schema(ctx context.Context, name string) (string, error) {
	s := "verity_bench_" + e.suffix + "_" + name
	if _, err := e.pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{s}.Sanitize()); err != nil {
		return "", err
	}
	e.schemas = append(e.schemas, s)
	return s, nil
}

// seedWorkerPool returns the pool the seed's workers claim and acknowledge
// with: one whose connections commit with synchronous_commit off, as the
// library's relays commit their bookkeeping, unless
// Options.DurableBookkeeping. A connection setting, so that it costs the
// seed no extra round trip.
func (e *env) seedWorkerPool(ctx context.Context) (*pgxpool.Pool, error) {
	if e.opts.DurableBookkeeping {
		return e.pool, nil
	}
	if e.workers != nil {
		return e.workers, nil
	}
	cfg, err := pgxpool.ParseConfig(e.opts.PostgresURL)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "off"
	cfg.MaxConns = int32(max(16, e.opts.Relays)) // a seed worker holds its connection for its whole batch
	e.workers, err = pgxpool.NewWithConfig(ctx, cfg)
	return e.workers, err
}

// keyPrefix returns the Redis key prefix of one figure group.
func (e *env) keyPrefix(name string) string { return e.prefix + name + ":" }

func (e *env) close(ctx context.Context) error {
	if e.workers != nil && e.workers != e.pool {
		e.workers.Close()
	}
	return e.cleanup(ctx)
}

// cleanup drops every schema handed out so far and deletes every key under
// the run's prefix, also when ctx is cancelled.
func (e *env) cleanup(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer cancel()
	var errs []error
	var left []string // kept for the next attempt
	for _, s := range e.schemas {
		if _, err := e.pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{s}.Sanitize()+" CASCADE"); err != nil {
			errs = append(errs, fmt.Errorf("dropping schema %s: %w", s, err))
			left = append(left, s)
		}
	}
	e.schemas = left
	if err := deletePrefix(ctx, e.rdb, e.prefix); err != nil {
		errs = append(errs, fmt.Errorf("deleting keys under %s: %w", e.prefix, err))
	}
	e.checkpoint(ctx)
	return errors.Join(errs...)
}

// checkpoint flushes what was written so far, so that the next
// measurement — the next group, or the other side of the same figure — does
// not run under the checkpoint that WAL triggers. CHECKPOINT needs
// superuser (or pg_checkpoint on PostgreSQL 15+); without it, runs are
// noisier.
func (e *env) checkpoint(ctx context.Context) {
	if e.checkpointRefused {
		return
	}
	if _, err := e.pool.Exec(ctx, "CHECKPOINT"); err != nil {
		e.checkpointRefused = true
		e.log("CHECKPOINT refused (%v); figures after write-heavy phases may be noisier", err)
	}
}

// walSample is PostgreSQL's WAL activity so far (pg_stat_wal, cluster
// wide): flushes to disk and bytes written. ok is false where the server
// does not tell (before PostgreSQL 14, or a role refused the view).
type walSample struct {
	syncs, bytes int64
	ok           bool
}

// sampleWAL reads pg_stat_wal. A failure is not the benchmark's: the
// figure is left out.
func (e *env) sampleWAL(ctx context.Context) walSample {
	var w walSample
	err := e.pool.QueryRow(ctx, `SELECT "wal_sync", "wal_bytes"::bigint FROM "pg_stat_wal"`).Scan(&w.syncs, &w.bytes)
	w.ok = err == nil
	return w
}

// per describes the WAL flushes and bytes between w and later per unit
// (n of them): a commit waits for its WAL to reach the disk, and only one
// flush runs at a time, so on a fast CPU the flushes bound a closed loop
// of small transactions, and commands per flush is what sharing a commit
// buys. "" where PostgreSQL does not tell.
func (w walSample) per(unit string, later walSample, units int64) string {
	if !w.ok || !later.ok {
		return ""
	}
	syncs, n := later.syncs-w.syncs, float64(max(units, 1))
	return fmt.Sprintf("; WAL: %d flushes, %.2f %ss per flush, %.0f B per %s",
		syncs, n/float64(max(syncs, 1)), unit, float64(later.bytes-w.bytes)/n, unit)
}

// deletePrefix removes every key under prefix with SCAN + UNLINK (never
// FLUSHDB: the server may be shared).
func deletePrefix(ctx context.Context, rdb *redis.Client, prefix string) error {
	iter := rdb.Scan(ctx, 0, prefix+"*", 1000).Iterator()
	batch := make([]string, 0, 1000)
	for iter.Next(ctx) {
		batch = append(batch, iter.Val())
		if len(batch) == cap(batch) {
			if err := rdb.Unlink(ctx, batch...).Err(); err != nil {
				return err
			}
			batch = batch[:0]
		}
	}
	if err := iter.Err(); err != nil {
		return err
	}
	if len(batch) > 0 {
		return rdb.Unlink(ctx, batch...).Err()
	}
	return nil
}

// quiet is the logger handed to library components: the benchmark measures
// them, it does not read their logs.
var quiet = slog.New(slog.DiscardHandler)

// percentile returns the p-th percentile (0 < p ≤ 1) of sorted samples,
// nearest-rank.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(p*float64(len(sorted)))) - 1
	return sorted[max(0, min(i, len(sorted)-1))]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// qualify returns the quoted name of table in schema.
func qualify(schema, table string) string { return pgx.Identifier{schema, table}.Sanitize() }

// redisCPU returns the CPU time the Redis server has used since it started
// (INFO cpu: used_cpu_sys + used_cpu_user, system and user time of the
// whole server process).
func redisCPU(ctx context.Context, rdb *redis.Client) (time.Duration, error) {
	info, err := rdb.Info(ctx, "cpu").Result()
	if err != nil {
		return 0, fmt.Errorf("reading Redis CPU time: %w", err)
	}
	var total time.Duration
	found := 0
	for line := range strings.SplitSeq(info, "\r\n") {
		name, value, ok := strings.Cut(line, ":")
		if !ok || (name != "used_cpu_sys" && name != "used_cpu_user") {
			continue
		}
		secs, err := strconv.ParseFloat(value, 64)
		if err != nil {
			return 0, fmt.Errorf("reading Redis CPU time: %s: %w", name, err)
		}
		total += time.Duration(secs * float64(time.Second))
		found++
	}
	if found != 2 {
		return 0, fmt.Errorf("reading Redis CPU time: INFO cpu lacks used_cpu_sys or used_cpu_user")
	}
	return total, nil
}

// processCPU returns the CPU time this process has used so far, user and
// system (getrusage; the harness needs Linux anyway, see memory.go).
func processCPU() (time.Duration, error) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, fmt.Errorf("reading this process's CPU time: %w", err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), nil
}

// cpuSample is this process's and the Redis server's CPU time at one moment
// (or, from since, spent between two moments), and what /proc says where
// PostgreSQL runs on this host.
type cpuSample struct {
	client, redis time.Duration
	host          hostCPU
}

// sampleCPU reads this process's and the Redis server's CPU time so far.
func (e *env) sampleCPU(ctx context.Context) (cpuSample, error) {
	client, err := processCPU()
	if err != nil {
		return cpuSample{}, err
	}
	rd, err := redisCPU(ctx, e.rdb)
	return cpuSample{client: client, redis: rd, host: readHostCPU(e.pool.Config().ConnConfig.Host)}, err
}

// since returns the CPU spent from earlier to s.
func (s cpuSample) since(earlier cpuSample) cpuSample {
	return cpuSample{client: s.client - earlier.client, redis: s.redis - earlier.redis, host: s.host.add(earlier.host, -1)}
}

// noCPU is the sum of no samples, to add samples to with plus.
func noCPU() cpuSample { return cpuSample{host: hostCPU{ok: true}} }

// plus returns s and d added up; the host's part only while both have it.
func (s cpuSample) plus(d cpuSample) cpuSample {
	return cpuSample{client: s.client + d.client, redis: s.redis + d.redis, host: s.host.add(d.host, 1)}
}

// hostShare describes, where /proc tells, PostgreSQL's CPU over n passes
// and how busy the host's CPUs were; "" where it does not.
func (s cpuSample) hostShare(n int) string {
	busy, ok := s.host.busyPercent()
	if !ok {
		return ""
	}
	return fmt.Sprintf("PostgreSQL %s per pass, CPUs %.0f%% busy", (s.host.postgres / time.Duration(max(n, 1))).Round(time.Millisecond), busy)
}

// per describes the CPU spent between s and later per unit (n of them:
// rows, commands), in µs, and, where /proc tells, PostgreSQL's and how
// busy the host's CPUs were: a drain or an ingest is bound by the sides'
// CPU per unit together.
func (s cpuSample) per(unit string, later cpuSample, units int64) string {
	d, n := later.since(s), float64(max(units, 1))
	out := fmt.Sprintf("CPU per %s: this process %.2f µs, Redis %.2f µs", unit, us(d.client)/n, us(d.redis)/n)
	if busy, ok := d.host.busyPercent(); ok {
		out += fmt.Sprintf(", PostgreSQL %.2f µs (postgres processes on this host); CPUs %.0f%% busy", us(d.host.postgres)/n, busy)
	}
	return out
}
