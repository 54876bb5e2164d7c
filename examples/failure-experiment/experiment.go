package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"sort"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/services"
	"github.com/verity-go/verity/leaderboard"
	"github.com/verity-go/verity/reconcile"
)

// SourceState is one user as PostgreSQL has it.
type SourceState struct {
	Score   int64 `json:"score"`
	Version int64 `json:"version"`
}

// Stage is one row of the experiment's table.
type Stage struct {
	Name       string                 `json:"name"`
	Source     map[string]SourceState `json:"source"`
	Projection map[string]int64       `json:"projection"`
	Result     string                 `json:"result"`
}

// ReconcileFigures are the repair run's figures.
type ReconcileFigures struct {
	Checked  int64 `json:"checked"`
	Current  int64 `json:"current"`
	Corrupt  int64 `json:"corrupt"`
	Repaired int64 `json:"repaired"`
}

// Report is the experiment's outcome; it marshals to the --json shape.
type Report struct {
	Stages        []Stage          `json:"stages"`
	Reconcile     ReconcileFigures `json:"reconcile"`
	OrderingMatch bool             `json:"ordering_match"`
}

// Options locate the servers and the experiment's isolated namespace.
type Options struct {
	PostgresURL, RedisURL string
	// Schema and KeyPrefix default to fresh random names; both are removed
	// when the experiment ends.
	Schema, KeyPrefix string
	Logger            *slog.Logger
}

// experiment holds the wiring of one run.
type experiment struct {
	pool   *pgxpool.Pool
	rdb    *redis.Client
	board  *leaderboard.Board
	worker *leaderboard.Worker
	report Report
}

// Run performs the seed's failure experiment against real servers and
// returns what each stage observed. It cleans up its schema and keys.
func Run(ctx context.Context, opts Options) (_ *Report, err error) {
	suffix := services.RandomSuffix(8)
	if opts.Schema == "" {
		opts.Schema = "verity_experiment_" + suffix
	}
	if opts.KeyPrefix == "" {
		opts.KeyPrefix = "verity-experiment-" + suffix + ":"
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}

	pool, err := pgxpool.New(ctx, opts.PostgresURL)
	if err != nil {
		return nil, fmt.Errorf("connecting to PostgreSQL: %w", err)
	}
	defer pool.Close()
	redisOpts, err := services.ParseRedisURL(opts.RedisURL)
	if err != nil {
		return nil, fmt.Errorf("parsing the Redis URL: %w", err)
	}
	rdb := redis.NewClient(redisOpts)
	defer rdb.Close()

	defer func() {
		// Clean up even when ctx is done.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		_, derr := pool.Exec(cctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{opts.Schema}.Sanitize()+" CASCADE")
		err = errors.Join(err, derr, deleteKeys(cctx, rdb, opts.KeyPrefix))
	}()

	cfg := &leaderboard.Config{
		Name:       "experiment",
		Schema:     opts.Schema,
		KeyPrefix:  opts.KeyPrefix,
		ReadPolicy: leaderboard.ServeStale,
		Logger:     opts.Logger,
	}
	// An interrupt does not cut the migration short: pgx would give up on
	// the connection at once while the server went on to commit the schema,
	// after the DROP above ran on another connection and found nothing.
	migrateCtx, cancelMigrate := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	err = leaderboard.Migrate(migrateCtx, pool, cfg)
	cancelMigrate()
	if err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	board, err := leaderboard.New(pool, rdb, cfg)
	if err != nil {
		return nil, err
	}
	defer board.Close() // before the pool: its Notifier may still be sending
	worker, err := board.Worker(nil)
	if err != nil {
		return nil, err
	}
	x := &experiment{pool: pool, rdb: rdb, board: board, worker: worker}
	if err := x.run(ctx); err != nil {
		return nil, err
	}
	return &x.report, nil
}

func (x *experiment) run(ctx context.Context) error {
	// 1. The first command is committed with its outbox row and projected.
	first := leaderboard.Command{EventID: uuid.New(), UserID: "user-a", Delta: 10}
	res, err := x.board.Submit(ctx, first)
	if err != nil {
		return err
	}
	if _, err := x.worker.Drain(ctx); err != nil {
		return err
	}
	// Drain's count includes records that failed: look at Redis itself.
	firstScore, err := x.rdb.ZScore(ctx, x.board.SortedSetKey(), first.UserID).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return err
	}
	result := fmt.Sprintf("committed (score %d, version %d) but NOT PROJECTED", res.Score, res.Version)
	if err == nil && -int64(firstScore) == res.Score {
		result = fmt.Sprintf("applied (score %d, version %d)", res.Score, res.Version)
	}
	if err := x.stage(ctx, "first command for user-a", result); err != nil {
		return err
	}

	// 2. A client retry sends the same event id again.
	res, err = x.board.Submit(ctx, first)
	if err != nil {
		return err
	}
	if _, err := x.worker.Drain(ctx); err != nil {
		return err
	}
	result = "applied again: DOUBLE EFFECT"
	if res.Duplicate {
		result = fmt.Sprintf("duplicate detected; no second effect (original result: score %d, version %d)", res.Score, res.Version)
	}
	if err := x.stage(ctx, "same event id again", result); err != nil {
		return err
	}

	// 3. With the worker stopped, commands commit but are not projected.
	for _, cmd := range []leaderboard.Command{
		{EventID: uuid.New(), UserID: "user-a", Delta: 7},
		{EventID: uuid.New(), UserID: "user-b", Delta: 25},
	} {
		if _, err := x.board.Submit(ctx, cmd); err != nil {
			return err
		}
	}
	stats, err := x.worker.Relay().Stats(ctx)
	if err != nil {
		return err
	}
	top, err := x.board.Top(ctx, 10)
	if err != nil {
		return err
	}
	if err := x.stage(ctx, "worker stopped", fmt.Sprintf("projection lags: %d outbox rows pending, oldest %s old",
		stats.Pending, top.Freshness.Lag.Round(time.Millisecond))); err != nil {
		return err
	}

	// 4. The worker restarts, wakes on the pending rows and drains them.
	if err := x.restartWorker(ctx); err != nil {
		return err
	}
	stats, err = x.worker.Relay().Stats(ctx)
	if err != nil {
		return err
	}
	if err := x.stage(ctx, "worker restarted", fmt.Sprintf("outbox drained (%d pending)", stats.Pending)); err != nil {
		return err
	}

	// 5. Someone hand-edits Redis. The sorted set holds negated scores, so
	// showing 999 means storing -999.
	if err := x.rdb.ZAdd(ctx, x.board.SortedSetKey(), redis.Z{Score: -999, Member: "user-a"}).Err(); err != nil {
		return err
	}
	rec, err := x.board.Reconciler(nil)
	if err != nil {
		return err
	}
	check, err := rec.Run(ctx, reconcile.RunOptions{DryRun: true})
	if err != nil {
		return err
	}
	classified := "no drift found"
	if ex := check.Examples[reconcile.ClassCorrupt]; len(ex) > 0 {
		classified = fmt.Sprintf("reconciliation classified %s as corrupt", ex[0].Key)
	}
	if err := x.stage(ctx, "redis user-a changed to 999", classified); err != nil {
		return err
	}

	// 6. Repair, then compare the orderings.
	repair, err := rec.Run(ctx, reconcile.RunOptions{})
	if err != nil {
		return err
	}
	x.report.Reconcile = ReconcileFigures{
		Checked:  repair.Checked,
		Current:  repair.Counts[reconcile.ClassCurrent],
		Corrupt:  repair.Counts[reconcile.ClassCorrupt],
		Repaired: repair.Repaired,
	}
	authoritative, err := x.board.Authoritative(ctx, leaderboard.MaxPageSize)
	if err != nil {
		return err
	}
	projected, err := x.board.Top(ctx, leaderboard.MaxPageSize, leaderboard.WithPolicy(leaderboard.ServeStale))
	if err != nil {
		return err
	}
	x.report.OrderingMatch = len(authoritative) == len(projected.Entries) && projected.Freshness.Source == leaderboard.SourceRedis
	for i := range authoritative {
		if !x.report.OrderingMatch || authoritative[i] != projected.Entries[i] {
			x.report.OrderingMatch = false
			break
		}
	}
	match := "identical ranking"
	if !x.report.OrderingMatch {
		match = "RANKINGS DIFFER"
	}
	return x.stage(ctx, "repair complete", fmt.Sprintf("%d of %d rows repaired; %s", repair.Repaired, repair.Checked, match))
}

// restartWorker runs the worker (LISTEN/NOTIFY and polling, as in
// production) until the projection holds every source version, then stops
// it gracefully.
func (x *experiment) restartWorker(ctx context.Context) error {
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- x.worker.Run(runCtx) }()
	deadline := time.After(30 * time.Second)
	for {
		stats, err := x.worker.Relay().Stats(ctx)
		if err == nil && stats.Pending == 0 && stats.InFlight == 0 {
			break
		}
		select {
		case <-deadline:
			stop()
			<-done
			return errors.New("the restarted worker did not drain the outbox within 30s")
		case err := <-done:
			stop()
			if err == nil {
				// Run returns nil once its context ends: ours was
				// cancelled (an interrupt), which is the error to report.
				if err = ctx.Err(); err == nil {
					return errors.New("the restarted worker stopped before draining the outbox")
				}
			}
			return fmt.Errorf("worker stopped: %w", err)
		case <-time.After(10 * time.Millisecond):
		}
	}
	stop()
	return <-done
}

// stage records the source and projection state under name.
// reference is the seed's outcome of the experiment: each stage's
// PostgreSQL state and Redis projection, and the repair's figures.
var reference = struct {
	stages []Stage
	// results are how each stage's Result begins when it behaved.
	results []string
	repair  ReconcileFigures
}{
	stages: []Stage{
		{Name: "first command for user-a", Source: map[string]SourceState{"user-a": {10, 1}}, Projection: map[string]int64{"user-a": 10}},
		{Name: "same event id again", Source: map[string]SourceState{"user-a": {10, 1}}, Projection: map[string]int64{"user-a": 10}},
		{Name: "worker stopped", Source: map[string]SourceState{"user-a": {17, 2}, "user-b": {25, 1}}, Projection: map[string]int64{"user-a": 10}},
		{Name: "worker restarted", Source: map[string]SourceState{"user-a": {17, 2}, "user-b": {25, 1}}, Projection: map[string]int64{"user-a": 17, "user-b": 25}},
		{Name: "redis user-a changed to 999", Source: map[string]SourceState{"user-a": {17, 2}, "user-b": {25, 1}}, Projection: map[string]int64{"user-a": 999, "user-b": 25}},
		{Name: "repair complete", Source: map[string]SourceState{"user-a": {17, 2}, "user-b": {25, 1}}, Projection: map[string]int64{"user-a": 17, "user-b": 25}},
	},
	results: []string{
		"applied (",
		"duplicate detected; no second effect (original result: score 10, version 1)",
		"projection lags: 2 outbox rows pending",
		"outbox drained (0 pending)",
		"reconciliation classified user-a as corrupt",
		"1 of 2 rows repaired; identical ranking",
	},
	repair: ReconcileFigures{Checked: 2, Current: 1, Corrupt: 1, Repaired: 1},
}

// Check compares r with the seed's outcome of the experiment and returns
// an error naming the first difference: the command exits non-zero then.
func (r *Report) Check() error {
	if len(r.Stages) != len(reference.stages) {
		return fmt.Errorf("%d stages, the experiment has %d", len(r.Stages), len(reference.stages))
	}
	for i, want := range reference.stages {
		got := r.Stages[i]
		switch {
		case got.Name != want.Name:
			return fmt.Errorf("stage %d is %q, want %q", i+1, got.Name, want.Name)
		case !maps.Equal(got.Source, want.Source):
			return fmt.Errorf("stage %q: PostgreSQL holds %v, want %v", got.Name, got.Source, want.Source)
		case !maps.Equal(got.Projection, want.Projection):
			return fmt.Errorf("stage %q: Redis holds %v, want %v", got.Name, got.Projection, want.Projection)
		case !strings.HasPrefix(got.Result, reference.results[i]):
			return fmt.Errorf("stage %q: %s, want %s…", got.Name, got.Result, reference.results[i])
		}
	}
	if r.Reconcile != reference.repair {
		return fmt.Errorf("the repair run found %+v, want %+v", r.Reconcile, reference.repair)
	}
	if !r.OrderingMatch {
		return fmt.Errorf("after the repair, Redis's ranking differs from PostgreSQL's")
	}
	return nil
}

func (x *experiment) stage(ctx context.Context, name, result string) error {
	st := Stage{Name: name, Source: map[string]SourceState{}, Projection: map[string]int64{}, Result: result}
	rows, err := x.pool.Query(ctx, fmt.Sprintf("SELECT user_id, score, version FROM %s WHERE board = $1",
		pgx.Identifier{x.board.Config().Schema, leaderboard.UserScoresTable}.Sanitize()), x.board.Name())
	if err != nil {
		return err
	}
	for rows.Next() {
		var user string
		var s SourceState
		if err := rows.Scan(&user, &s.Score, &s.Version); err != nil {
			rows.Close()
			return err
		}
		st.Source[user] = s
	}
	if err := rows.Err(); err != nil {
		return err
	}
	zs, err := x.rdb.ZRangeWithScores(ctx, x.board.SortedSetKey(), 0, -1).Result()
	if err != nil {
		return err
	}
	for _, z := range zs {
		st.Projection[z.Member.(string)] = -int64(z.Score)
	}
	x.report.Stages = append(x.report.Stages, st)
	return nil
}

// deleteKeys removes every key under prefix (SCAN + UNLINK, never FLUSH).
func deleteKeys(ctx context.Context, rdb *redis.Client, prefix string) error {
	iter := rdb.Scan(ctx, 0, prefix+"*", 500).Iterator()
	var keys []string
	for iter.Next(ctx) {
		keys = append(keys, iter.Val())
	}
	if err := iter.Err(); err != nil {
		return err
	}
	if len(keys) == 0 {
		return nil
	}
	return rdb.Unlink(ctx, keys...).Err()
}

// sortedUsers returns m's keys in order.
func sortedUsers[V any](m map[string]V) []string {
	users := make([]string, 0, len(m))
	for u := range m {
		users = append(users, u)
	}
	sort.Strings(users)
	return users
}
