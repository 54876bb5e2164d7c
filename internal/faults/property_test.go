package faults

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
	"github.com/verity-go/verity/outbox"
	"github.com/verity-go/verity/projection"
	"github.com/verity-go/verity/reconcile"
)

// propertyChecks sets rapid's number of checks unless the caller chose one
// (-rapid.checks or RAPID_CHECKS): each check drives real servers, so the
// default of 100 would dominate the package's CI time.
func propertyChecks() {
	if os.Getenv("RAPID_CHECKS") != "" {
		return
	}
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == "rapid.checks" })
	if !set {
		_ = flag.Set("rapid.checks", strconv.Itoa(size(100, 1000)))
	}
}

// convergenceModel is one rapid run: a fresh board, the acknowledged
// commands and what PostgreSQL must therefore hold.
type convergenceModel struct {
	bb      *boardBundle
	flush   func() error // loses all of Redis
	worker  *leaderboard.Worker
	cmds    []leaderboard.Command
	results []leaderboard.Result
	score   map[string]int64
	version map[string]int64
	faults  map[string]int
}

var users = []string{"ann", "bob", "{cy}", "d:e", "ünï"}

func (m *convergenceModel) submit(t *rapid.T) {
	cmd := leaderboard.Command{
		EventID: uuid.New(),
		UserID:  rapid.SampledFrom(users).Draw(t, "user"),
		Delta:   rapid.Int64Range(-50, 50).Draw(t, "delta"),
	}
	res, err := m.bb.board.Submit(context.Background(), cmd)
	if err != nil {
		t.Fatalf("submit: %v", err)
	}
	m.score[cmd.UserID] += cmd.Delta
	m.version[cmd.UserID]++
	if res != (leaderboard.Result{Score: m.score[cmd.UserID], Version: m.version[cmd.UserID]}) {
		t.Fatalf("submit %+v returned %+v, model says score %d version %d", cmd, res, m.score[cmd.UserID], m.version[cmd.UserID])
	}
	m.cmds, m.results = append(m.cmds, cmd), append(m.results, res)
}

func (m *convergenceModel) duplicate(t *rapid.T) {
	if len(m.cmds) == 0 {
		t.Skip("nothing submitted yet")
	}
	i := rapid.IntRange(0, len(m.cmds)-1).Draw(t, "which")
	res, err := m.bb.board.Submit(context.Background(), m.cmds[i])
	if err != nil {
		t.Fatalf("duplicate submit: %v", err)
	}
	want := m.results[i]
	want.Duplicate = true
	if res != want {
		t.Fatalf("duplicate of %+v returned %+v, want %+v", m.cmds[i], res, want)
	}
	m.faults["duplicate"]++
}

func (m *convergenceModel) conflict(t *rapid.T) {
	if len(m.cmds) == 0 {
		t.Skip("nothing submitted yet")
	}
	cmd := m.cmds[rapid.IntRange(0, len(m.cmds)-1).Draw(t, "which")]
	cmd.Delta++
	_, err := m.bb.board.Submit(context.Background(), cmd)
	if !errors.Is(err, leaderboard.ErrIdempotencyConflict) {
		t.Fatalf("reused event id with another delta: got %v", err)
	}
}

func (m *convergenceModel) drainOne(t *rapid.T) {
	if _, err := m.worker.RunOnce(context.Background()); err != nil {
		t.Fatalf("relay: %v", err)
	}
}

// relayCrash claims a batch with a relay whose handler projects only the
// first k records (k may cover the batch: the crash then falls between the
// Redis write and the acknowledgement) and then dies: its context is
// cancelled and the batch fails, so nothing is acknowledged.
func (m *convergenceModel) relayCrash(t *rapid.T) {
	k := rapid.IntRange(0, 3).Draw(t, "projected before the crash")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	projector := m.worker.Projector()
	var crashed atomic.Bool
	crashing := outbox.HandlerFunc(func(hctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
		if _, err := projector.Handle(hctx, batch[:min(k, len(batch))]); err != nil {
			return nil, err
		}
		crashed.Store(true)
		cancel()
		return nil, errors.New("relay crashed mid-batch")
	})
	cfg := faultRelayConfig("crashing")
	cfg.Schema, cfg.Streams, cfg.BatchSize = m.bb.schema, []string{m.bb.board.Stream()}, 3
	relay, err := outbox.NewRelay(m.bb.pool, crashing, cfg)
	if err != nil {
		t.Fatalf("relay: %v", err)
	}
	// A crashed batch's outcome is whatever the dying relay could still
	// settle (its context is cancelled): only a claim that never reached
	// the handler must have gone cleanly.
	_, err = relay.RunOnce(ctx)
	if !crashed.Load() { // nothing was due: no batch, no crash
		if err != nil {
			t.Fatalf("relay: %v", err)
		}
		return
	}
	m.faults["relay_crash"]++
}

func (m *convergenceModel) flushRedis(t *rapid.T) {
	if err := m.flush(); err != nil {
		t.Fatalf("flushall: %v", err)
	}
	m.faults["redis_flush"]++
}

// loseEntry deletes part of one user's projection: the member, its version,
// or both, as an eviction or a hand edit would.
func (m *convergenceModel) loseEntry(t *rapid.T) {
	user := rapid.SampledFrom(users).Draw(t, "user")
	what := rapid.IntRange(0, 2).Draw(t, "what")
	ctx := context.Background()
	vkey := m.bb.board.Keyspace().VersionKey(projection.Target{Kind: projection.KindSortedSet, Name: m.bb.board.Name()})
	if what != 1 {
		if err := m.bb.rdb.ZRem(ctx, m.bb.board.SortedSetKey(), user).Err(); err != nil {
			t.Fatalf("zrem: %v", err)
		}
	}
	if what != 0 {
		if err := m.bb.rdb.HDel(ctx, vkey, user).Err(); err != nil {
			t.Fatalf("hdel: %v", err)
		}
	}
	m.faults["redis_entry_loss"]++
}

func (m *convergenceModel) reconcile(t *rapid.T) {
	rec, err := m.bb.board.Reconciler(nil)
	if err != nil {
		t.Fatalf("reconciler: %v", err)
	}
	rep, err := rec.Run(context.Background(), reconcile.RunOptions{})
	if err != nil {
		t.Fatalf("reconcile: %v", err)
	}
	m.faults["rows_repaired"] += int(rep.Repaired)
}

// check is the invariant after every step: PostgreSQL holds the model, and
// Redis never knows more than PostgreSQL (a projected version is never
// above the source's, and at the source's version the score is the
// source's).
func (m *convergenceModel) check(t *rapid.T) {
	ctx := context.Background()
	rows, err := m.bb.pool.Query(ctx, `SELECT user_id, score, version FROM `+m.bb.table(leaderboard.UserScoresTable)+` WHERE board = $1`, m.bb.board.Name())
	if err != nil {
		t.Fatalf("read source: %v", err)
	}
	source := map[string][2]int64{}
	for rows.Next() {
		var u string
		var s, v int64
		if err := rows.Scan(&u, &s, &v); err != nil {
			t.Fatalf("scan: %v", err)
		}
		source[u] = [2]int64{s, v}
	}
	rows.Close()
	if len(source) != len(m.version) {
		t.Fatalf("source has %d users, model %d", len(source), len(m.version))
	}
	for u, v := range m.version {
		if source[u] != [2]int64{m.score[u], v} {
			t.Fatalf("source %q = %v, model score %d version %d", u, source[u], m.score[u], v)
		}
	}
	vkey := m.bb.board.Keyspace().VersionKey(projection.Target{Kind: projection.KindSortedSet, Name: m.bb.board.Name()})
	versions, err := m.bb.rdb.HGetAll(ctx, vkey).Result()
	if err != nil {
		t.Fatalf("read versions: %v", err)
	}
	for u, raw := range versions {
		v, err := strconv.ParseInt(raw, 10, 64)
		src, ok := source[u]
		if err != nil || !ok || v > src[1] {
			t.Fatalf("redis holds version %q of %q, source %v: redis knows more than the source", raw, u, src)
		}
		if v == src[1] {
			score, err := m.bb.rdb.ZScore(ctx, m.bb.board.SortedSetKey(), u).Result()
			if err == nil && score != float64(-src[0]) {
				t.Fatalf("redis score of %q at version %d is %v, source %d", u, v, -score, src[0])
			}
		}
	}
}

// TestConvergenceProperty drives random interleavings of submits, duplicate
// and conflicting submits, partial drains, relay crashes mid-batch, Redis
// loss (FLUSHALL of a private server, or single entries deleted) and
// reconcile passes. After every step PostgreSQL must hold exactly the
// acknowledged commands and Redis must never be ahead of it; at the end, a
// full drain plus one reconcile pass must make Redis equal PostgreSQL.
func TestConvergenceProperty(t *testing.T) {
	t.Parallel()
	propertyChecks()
	pg := testenv.Postgres(t)
	rs := testenv.StartRedis(t)
	rdb := rs.Client(t)
	require.NoError(t, leaderboard.Migrate(context.Background(), pg.Pool, &leaderboard.Config{Schema: pg.Schema}))

	var runs atomic.Int64
	totals := map[string]int{}
	var checked int
	rapid.Check(t, func(rt *rapid.T) {
		name := fmt.Sprintf("prop-%d", runs.Add(1))
		board, err := leaderboard.New(pg.Pool, rdb, &leaderboard.Config{Name: name, Schema: pg.Schema, KeyPrefix: "verity:prop:"})
		if err != nil {
			rt.Fatalf("board: %v", err)
		}
		bb := &boardBundle{board: board, pool: pg.Pool, rdb: rdb, schema: pg.Schema}
		wcfg := faultRelayConfig("prop")
		wcfg.BatchSize = 3
		worker, err := board.Worker(&leaderboard.WorkerConfig{Relay: wcfg})
		if err != nil {
			rt.Fatalf("worker: %v", err)
		}
		m := &convergenceModel{
			bb: bb, worker: worker, score: map[string]int64{}, version: map[string]int64{}, faults: map[string]int{},
			flush: func() error { return rdb.FlushAll(context.Background()).Err() }, // a private server: ours to flush
		}
		rt.Repeat(map[string]func(*rapid.T){
			"":           m.check,
			"submit":     m.submit,
			"duplicate":  m.duplicate,
			"conflict":   m.conflict,
			"drainOne":   m.drainOne,
			"relayCrash": m.relayCrash,
			"flushRedis": m.flushRedis,
			"loseEntry":  m.loseEntry,
			"reconcile":  m.reconcile,
		})

		// Converge: drain everything (crashed batches come back once their
		// short backoff passes), then one reconcile pass.
		deadline := time.Now().Add(20 * time.Second)
		for {
			n, err := worker.Drain(context.Background())
			if err != nil {
				rt.Fatalf("drain: %v", err)
			}
			st, err := worker.Relay().Stats(context.Background())
			if err != nil {
				rt.Fatalf("stats: %v", err)
			}
			if n == 0 && st.Pending == 0 {
				break
			}
			if time.Now().After(deadline) {
				rt.Fatalf("outbox not drained: %+v", st)
			}
			time.Sleep(5 * time.Millisecond)
		}
		m.reconcile(rt)
		c, err := bb.compare(context.Background())
		if err != nil {
			rt.Fatalf("compare: %v", err)
		}
		if c.diffs() != 0 || c.Rows != len(m.version) {
			rt.Fatalf("not converged after drain + one reconcile pass: %+v", c)
		}
		m.check(rt)
		checked += c.Rows
		for k, v := range m.faults {
			totals[k] += v
		}
	})
	summary(t, "property", "convergence",
		"runs", runs.Load(), "duplicates", totals["duplicate"], "relay_crashes", totals["relay_crash"],
		"redis_flushes", totals["redis_flush"], "entry_losses", totals["redis_entry_loss"],
		"rows_checked", checked, "rows_repaired", totals["rows_repaired"], "lost", 0)
}
