package main

import (
	"context"
	"fmt"
	"runtime"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/leaderboard"
	"github.com/verity-go/verity/projection"
	"github.com/verity-go/verity/reconcile"
)

const (
	reconcilePage   = 1_000
	reconcileRounds = 2
)

// runReconcile measures a full reconciliation pass over a board of N users
// whose projection is current: the board's reconcile.Reconciler with its
// defaults (keyset pages; up to ReadAhead = 4 pages read at once, counting
// the one being checked; an orphan count check at the end) against a hand-written loop doing the same comparison the plain way
// (keyset pages of 1,000, then one pipelined ZMSCORE + HMGET per page, one
// after the other). Rows per second of wall time; the two run in turn,
// library first, twice.
//
// The board keeps one version hash (the default). A third pass in each
// round reconciles the same source against a copy projected with version
// buckets (projection.Config.VersionBuckets = users / 64, as the memory
// figure uses): it is logged, not reported as a figure, and shows what the
// buckets' memory saving costs a reconciliation (one HMGET per bucket a
// page touches instead of one HMGET per page).
//
// The Redis server's own CPU time (INFO cpu) is read around the timed
// passes and logged: both sides send the same ZMSCORE and HMGET per row, and
// Redis executes them on one thread, so the hand loop's wall time divided
// by that CPU time is a ceiling no reconciler of this projection can pass.
// This process's own CPU time (getrusage) is logged too: on a machine with
// few cores the client's work (pgx and go-redis decoding every row, the
// comparison) competes with Redis and PostgreSQL for the same cores, and
// client plus Redis CPU divided by the cores is a floor under the library's
// pass before PostgreSQL's share is counted.
func runReconcile(ctx context.Context, e *env) ([]Figure, error) {
	schema, err := e.schema(ctx, "reconcile")
	if err != nil {
		return nil, err
	}
	cfg := &leaderboard.Config{Name: "bench", Schema: schema, KeyPrefix: e.keyPrefix("reconcile"), Logger: quiet}
	if err := leaderboard.Migrate(ctx, e.pool, cfg); err != nil {
		return nil, err
	}
	board, err := leaderboard.New(e.pool, e.rdb, cfg)
	if err != nil {
		return nil, err
	}
	defer board.Close()
	n := e.opts.Sizes.ReconcileUsers
	scores := qualify(schema, leaderboard.UserScoresTable)
	if _, err := e.pool.Exec(ctx, `INSERT INTO `+scores+` (board, user_id, score, version)
SELECT 'bench', 'user-' || lpad(g::text, 9, '0'), (g * 7919) % 100000, 1 + g % 5 FROM generate_series(1, $1::int) AS g`, n); err != nil {
		return nil, err
	}
	if _, err := e.pool.Exec(ctx, `ANALYZE `+scores); err != nil {
		return nil, err
	}
	rec, err := board.Reconciler(&reconcile.Config{PageSize: reconcilePage, Logger: quiet})
	if err != nil {
		return nil, err
	}
	// The first pass projects every row (all missing); the timed passes
	// find everything current.
	rep, err := rec.Run(ctx, reconcile.RunOptions{})
	if err != nil {
		return nil, err
	}
	if rep.Repaired != int64(n) {
		return nil, fmt.Errorf("initial pass repaired %d of %d rows", rep.Repaired, n)
	}
	bucketed, err := bucketedReconciler(ctx, e, board, n)
	if err != nil {
		return nil, err
	}
	zkey := board.SortedSetKey()
	vkey := board.Keyspace().VersionKey(projection.Target{Kind: projection.KindSortedSet, Name: board.Name()})

	var lib, hand, buckets rate
	libCPU, handCPU := noCPU(), noCPU() // CPU spent in the timed passes
	for range reconcileRounds {
		cpu0, err := e.sampleCPU(ctx)
		if err != nil {
			return nil, err
		}
		start := time.Now()
		rep, err := rec.Run(ctx, reconcile.RunOptions{})
		elapsed := time.Since(start)
		if err != nil {
			return nil, err
		}
		cpu1, err := e.sampleCPU(ctx)
		if err != nil {
			return nil, err
		}
		if rep.Checked != int64(n) || rep.Counts[reconcile.ClassCurrent] != int64(n) {
			return nil, fmt.Errorf("reconciler checked %d rows, %d current, of %d", rep.Checked, rep.Counts[reconcile.ClassCurrent], n)
		}
		if err := lib.add(rep.Checked, elapsed, nil); err != nil {
			return nil, err
		}
		if err := hand.add(handReconcile(ctx, e, scores, zkey, vkey, n)); err != nil {
			return nil, err
		}
		cpu2, err := e.sampleCPU(ctx)
		if err != nil {
			return nil, err
		}
		libCPU, handCPU = libCPU.plus(cpu1.since(cpu0)), handCPU.plus(cpu2.since(cpu1))
		start = time.Now()
		rep, err = bucketed.Run(ctx, reconcile.RunOptions{})
		if err == nil && rep.Counts[reconcile.ClassCurrent] != int64(n) {
			err = fmt.Errorf("bucketed reconciler found %d of %d rows current", rep.Counts[reconcile.ClassCurrent], n)
		}
		if err := buckets.add(int64(n), time.Since(start), err); err != nil {
			return nil, err
		}
	}
	e.log("reconcile: library %.0f rows/s, hand loop %.0f rows/s; library with %d version buckets %.0f rows/s (%.2fx one version hash)",
		lib.perSecond(), hand.perSecond(), bucketCount(n), buckets.perSecond(), buckets.perSecond()/lib.perSecond())
	// Both sides send Redis the same ZMSCORE and HMGET for every row, and
	// Redis runs commands on one thread: a pass cannot take less wall time
	// than the server CPU those commands cost, whatever the client does.
	perPass := func(d time.Duration) time.Duration { return (d / reconcileRounds).Round(time.Millisecond) }
	e.log("reconcile: Redis CPU per pass: library %s, hand loop %s of its %s wall: Redis alone caps any reconciler that reads every row's score and version at %.2fx the hand loop",
		perPass(libCPU.redis), perPass(handCPU.redis), perPass(hand.elapsed), float64(hand.elapsed)/float64(handCPU.redis))
	// The client's CPU competes for the same cores: the library's pass
	// cannot take less wall time than its client and Redis CPU spread
	// over every core, PostgreSQL's share not even counted.
	cores := runtime.NumCPU()
	floor := (libCPU.client + libCPU.redis) / time.Duration(reconcileRounds*cores)
	e.log("reconcile: this process's CPU per pass: library %s, hand loop %s; with Redis's, %d CPUs cap the library's pass at %.2fx the hand loop (wall %s at least), PostgreSQL's CPU not counted",
		perPass(libCPU.client), perPass(handCPU.client), cores, float64(hand.elapsed)/float64(reconcileRounds)/float64(floor), floor.Round(time.Millisecond))
	if libShare, handShare := libCPU.hostShare(reconcileRounds), handCPU.hostShare(reconcileRounds); libShare != "" && handShare != "" {
		e.log("reconcile: on this host (postgres processes): library %s; hand loop %s", libShare, handShare)
		// PostgreSQL shares the cores too: the three processes' CPU spread
		// over every core is the floor under the library's pass.
		all := (libCPU.client + libCPU.redis + libCPU.host.postgres) / time.Duration(reconcileRounds*cores)
		e.log("reconcile: with PostgreSQL's, %d CPUs cap the library's pass at %.2fx the hand loop (wall %s at least)",
			cores, float64(hand.elapsed)/float64(reconcileRounds)/float64(all), all.Round(time.Millisecond))
	}
	return []Figure{newFigure("reconcile", "rows/s", lib.perSecond(), hand.perSecond())}, nil
}

// handReconcile is the baseline: keyset pages from PostgreSQL, each followed
// by one pipelined ZMSCORE + HMGET round trip, compared row by row. It
// returns the rows checked and the time taken, and fails unless all n rows
// are current.
func handReconcile(ctx context.Context, e *env, scores, zkey, vkey string, want int) (int64, time.Duration, error) {
	start := time.Now()
	firstSQL := `SELECT user_id::text, version, score FROM ` + scores + ` WHERE board = 'bench' ORDER BY user_id LIMIT $1`
	nextSQL := `SELECT user_id::text, version, score FROM ` + scores + ` WHERE board = 'bench' AND user_id > $2::text COLLATE "C" ORDER BY user_id LIMIT $1`
	var checked, current int64
	after := ""
	for {
		var rows pgx.Rows
		var err error
		if checked == 0 {
			rows, err = e.pool.Query(ctx, firstSQL, reconcilePage)
		} else {
			rows, err = e.pool.Query(ctx, nextSQL, reconcilePage, after)
		}
		if err != nil {
			return 0, 0, err
		}
		type row struct {
			user           string
			version, score int64
		}
		page, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (row, error) {
			var x row
			err := r.Scan(&x.user, &x.version, &x.score)
			return x, err
		})
		if err != nil {
			return 0, 0, err
		}
		if len(page) == 0 {
			break
		}
		members := make([]string, len(page))
		for i, r := range page {
			members[i] = r.user
		}
		pipe := e.rdb.Pipeline()
		zs := pipe.ZMScore(ctx, zkey, members...)
		vs := pipe.HMGet(ctx, vkey, members...)
		if _, err := pipe.Exec(ctx); err != nil && err != redis.Nil {
			return 0, 0, err
		}
		gotScores, gotVersions := zs.Val(), vs.Val()
		for i, r := range page {
			v, _ := gotVersions[i].(string)
			// The board projects negated scores (see package leaderboard).
			if v == strconv.FormatInt(r.version, 10) && gotScores[i] == float64(-r.score) {
				current++
			}
		}
		checked += int64(len(page))
		after = page[len(page)-1].user
	}
	elapsed := time.Since(start)
	if checked != int64(want) || current != int64(want) {
		return 0, 0, fmt.Errorf("hand loop checked %d rows, %d current, of %d", checked, current, want)
	}
	return checked, elapsed, nil
}

// bucketCount is the documented VersionBuckets for n members.
func bucketCount(n int) int { return max(1, (n+membersPerBucket/2)/membersPerBucket) }

// bucketedReconciler returns a reconciler of board's source against a
// projection of its own (another key prefix) kept with bucketCount(n)
// version buckets, after a first pass has projected every row into it.
func bucketedReconciler(ctx context.Context, e *env, board *leaderboard.Board, n int) (*reconcile.Reconciler, error) {
	ks, err := projection.NewKeyspace(e.keyPrefix("reconcile-buckets"))
	if err == nil {
		ks, err = ks.WithVersionBuckets(bucketCount(n))
	}
	if err != nil {
		return nil, err
	}
	rec, err := reconcile.New(board.Source(), reconcile.Target{Client: e.rdb, Keyspace: ks, Kind: projection.KindSortedSet, Name: board.Name()},
		&reconcile.Config{PageSize: reconcilePage, Logger: quiet})
	if err != nil {
		return nil, err
	}
	rep, err := rec.Run(ctx, reconcile.RunOptions{})
	if err != nil {
		return nil, err
	}
	if rep.Repaired != int64(n) {
		return nil, fmt.Errorf("initial bucketed pass repaired %d of %d rows", rep.Repaired, n)
	}
	return rec, nil
}
