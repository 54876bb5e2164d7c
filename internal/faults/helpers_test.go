package faults

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/leaderboard"
	"github.com/verity-go/verity/outbox"
	"github.com/verity-go/verity/projection"
	"github.com/verity-go/verity/reconcile"
)

// soakEnv selects the long sizes of every suite.
const soakEnv = "VERITY_SOAK"

// soak reports whether the soak sizes were asked for.
func soak() bool { return os.Getenv(soakEnv) == "1" }

// size returns ci, or soakSize under VERITY_SOAK=1.
func size[T any](ci, soakSize T) T {
	if soak() {
		return soakSize
	}
	return ci
}

// summary logs the one parseable line per scenario that the README's
// Reliability section quotes: "faults-summary suite=… scenario=… k=v …".
func summary(t testing.TB, suite, scenario string, kv ...any) {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "faults-summary suite=%s scenario=%s", suite, scenario)
	for i := 0; i+1 < len(kv); i += 2 {
		fmt.Fprintf(&b, " %v=%v", kv[i], kv[i+1])
	}
	if soak() {
		b.WriteString(" mode=soak")
	} else {
		b.WriteString(" mode=ci")
	}
	t.Log(b.String())
}

// boardBundle is a migrated board with the handles the suites inspect it with.
type boardBundle struct {
	board  *leaderboard.Board
	pool   *pgxpool.Pool
	rdb    redis.UniversalClient
	schema string
}

// newBoard migrates schema and returns the board name in it, projecting
// through rdb under prefix.
func newBoard(t testing.TB, pool *pgxpool.Pool, schema string, rdb redis.UniversalClient, prefix, name string, mutate ...func(*leaderboard.Config)) *boardBundle {
	t.Helper()
	cfg := &leaderboard.Config{Name: name, Schema: schema, KeyPrefix: prefix}
	for _, m := range mutate {
		m(cfg)
	}
	require.NoError(t, leaderboard.Migrate(context.Background(), pool, cfg))
	b, err := leaderboard.New(pool, rdb, cfg)
	require.NoError(t, err)
	return &boardBundle{board: b, pool: pool, rdb: rdb, schema: schema}
}

// table returns the quoted, schema-qualified name of one of the board's tables.
func (bb *boardBundle) table(name string) string {
	return pgx.Identifier{bb.schema, name}.Sanitize()
}

// faultRelayConfig is a relay tuned for fault tests: short leases and
// backoffs so that recovery fits in a CI run, and enough attempts that a
// long outage never dead-letters a row (a dead letter would count as lost).
func faultRelayConfig(name string) *outbox.RelayConfig {
	return &outbox.RelayConfig{
		Name:                name,
		BatchSize:           100,
		LeaseDuration:       2 * time.Second,
		PollInterval:        100 * time.Millisecond,
		MaxAttempts:         1_000_000,
		RetryBackoffMin:     10 * time.Millisecond,
		RetryBackoffMax:     300 * time.Millisecond,
		ShutdownTimeout:     2 * time.Second,
		ReconnectBackoffMax: 300 * time.Millisecond,
	}
}

// worker returns a worker of the board with faultRelayConfig.
func (bb *boardBundle) worker(t testing.TB, name string) *leaderboard.Worker {
	t.Helper()
	w, err := bb.board.Worker(&leaderboard.WorkerConfig{Relay: faultRelayConfig(name)})
	require.NoError(t, err)
	return w
}

// runWorkers runs n workers until the returned stop function is called; stop
// waits for them and fails the test if one returned an error.
func (bb *boardBundle) runWorkers(t testing.TB, n int) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		w := bb.worker(t, fmt.Sprintf("faults-worker-%d", i))
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = w.Run(ctx)
		}()
	}
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			wg.Wait()
			require.NoError(t, errors.Join(errs...))
		})
	}
	t.Cleanup(stop)
	return stop
}

// stats reads the outbox backlog.
func (bb *boardBundle) stats(ctx context.Context) (outbox.Stats, error) {
	w, err := bb.board.Worker(nil)
	if err != nil {
		return outbox.Stats{}, err
	}
	return w.Relay().Stats(ctx)
}

// waitDrained waits until the outbox holds no pending row, or fails.
func (bb *boardBundle) waitDrained(t testing.TB, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var last outbox.Stats
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		st, err := bb.stats(ctx)
		cancel()
		if err == nil {
			last = st
			if st.Pending == 0 {
				return
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("outbox not drained after %s: %+v", timeout, last)
}

// comparison is the result of reading a board from PostgreSQL and Redis.
type comparison struct {
	Rows         int // user rows in PostgreSQL
	Members      int // members of the Redis sorted set
	Missing      int // rows without a member, or without a version
	WrongScore   int // member with another score than -row.score
	WrongVersion int // member with another version than the row's
	Extra        int // members or versions the source does not have
	Examples     []string
}

func (c comparison) diffs() int {
	return c.Missing + c.WrongScore + c.WrongVersion + c.Extra
}

func (c *comparison) note(format string, args ...any) {
	if len(c.Examples) < 10 {
		c.Examples = append(c.Examples, fmt.Sprintf(format, args...))
	}
}

// compare reads every row of the board from PostgreSQL and the whole
// projection (sorted set and version hash) from Redis and compares them
// entry by entry, independently of the reconcile package.
func (bb *boardBundle) compare(ctx context.Context) (comparison, error) {
	var c comparison
	type row struct{ score, version int64 }
	rows := map[string]row{}
	pgRows, err := bb.pool.Query(ctx,
		`SELECT user_id, score, version FROM `+bb.table(leaderboard.UserScoresTable)+` WHERE board = $1`,
		bb.board.Name())
	if err != nil {
		return c, err
	}
	for pgRows.Next() {
		var user string
		var r row
		if err := pgRows.Scan(&user, &r.score, &r.version); err != nil {
			pgRows.Close()
			return c, err
		}
		rows[user] = r
	}
	pgRows.Close()
	if err := pgRows.Err(); err != nil {
		return c, err
	}
	c.Rows = len(rows)

	zkey := bb.board.SortedSetKey()
	vkey := bb.board.Keyspace().VersionKey(projection.Target{Kind: projection.KindSortedSet, Name: bb.board.Name()})
	members, err := bb.rdb.ZRangeWithScores(ctx, zkey, 0, -1).Result()
	if err != nil {
		return c, fmt.Errorf("ZRANGE %s: %w", zkey, err)
	}
	versions, err := bb.rdb.HGetAll(ctx, vkey).Result()
	if err != nil {
		return c, fmt.Errorf("HGETALL %s: %w", vkey, err)
	}
	c.Members = len(members)
	scores := make(map[string]float64, len(members))
	for _, m := range members {
		user := m.Member.(string)
		scores[user] = m.Score
		if _, ok := rows[user]; !ok {
			c.Extra++
			c.note("extra member %q", user)
		}
	}
	for user := range versions {
		if _, ok := rows[user]; !ok {
			c.Extra++
			c.note("extra version %q", user)
		}
	}
	for user, r := range rows {
		score, okScore := scores[user]
		raw, okVersion := versions[user]
		switch {
		case !okScore || !okVersion:
			c.Missing++
			c.note("missing %q (member %v, version %v)", user, okScore, okVersion)
			continue
		case score != float64(-r.score):
			c.WrongScore++
			c.note("%q: redis score %v, postgres %d", user, -score, r.score)
		}
		if v, err := strconv.ParseInt(raw, 10, 64); err != nil || v != r.version {
			c.WrongVersion++
			c.note("%q: redis version %q, postgres %d", user, raw, r.version)
		}
	}
	return c, nil
}

// requireConverged fails unless Redis equals PostgreSQL for every key of
// the board and the outbox holds nothing (pending or dead). It returns the
// number of rows checked.
func (bb *boardBundle) requireConverged(t testing.TB) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := bb.compare(ctx)
	require.NoError(t, err)
	require.Zerof(t, c.diffs(), "redis differs from postgres: %+v", c)
	require.Equal(t, c.Rows, c.Members)
	st, err := bb.stats(ctx)
	require.NoError(t, err)
	require.Zero(t, st.Pending, "outbox rows left")
	require.Zero(t, st.DeadLetters, "dead letters")
	return c.Rows
}

// reconcile runs one full reconcile pass and returns its report.
func (bb *boardBundle) reconcile(t testing.TB) *reconcile.Report {
	t.Helper()
	rec, err := bb.board.Reconciler(nil)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rep, err := rec.Run(ctx, reconcile.RunOptions{})
	require.NoError(t, err)
	return rep
}

// loadGen submits commands to a board and keeps the books of what was
// acknowledged, so a suite can check every acknowledged command was applied
// exactly once: the sum of acknowledged deltas per user must equal the score.
type loadGen struct {
	board *leaderboard.Board
	users []string

	mu    sync.Mutex
	sums  map[string]int64                  // user → sum of acknowledged deltas
	acked int64                             // commands acknowledged (duplicates excluded)
	cmds  map[uuid.UUID]leaderboard.Command // acknowledged commands by event id

	retries    atomic.Int64 // failed attempts that were retried with the same event id
	duplicates atomic.Int64 // retries answered as duplicates: the lost ack was committed
}

func newLoadGen(b *leaderboard.Board, users int) *loadGen {
	g := &loadGen{board: b, sums: map[string]int64{}, cmds: map[uuid.UUID]leaderboard.Command{}}
	for i := range users {
		// Braces, colons and non-ASCII on purpose: user ids never reach key names.
		g.users = append(g.users, fmt.Sprintf("user{%d}:ü", i))
	}
	return g
}

func (g *loadGen) record(cmd leaderboard.Command) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.sums[cmd.UserID] += cmd.Delta
	g.acked++
	g.cmds[cmd.EventID] = cmd
}

func randomDelta(rng *rand.Rand) int64 { return rng.Int64N(201) - 100 }

// preload applies m commands with SubmitBatch, each batch touching distinct
// users so that every command leaves its own outbox row.
func (g *loadGen) preload(t testing.TB, m int) {
	t.Helper()
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(rand.Uint64(), 1))
	batch := min(500, len(g.users))
	for done := 0; done < m; {
		n := min(batch, m-done)
		offset := rng.IntN(len(g.users))
		cmds := make([]leaderboard.Command, n)
		for i := range cmds {
			cmds[i] = leaderboard.Command{EventID: uuid.New(), UserID: g.users[(offset+i)%len(g.users)], Delta: randomDelta(rng)}
		}
		_, err := g.board.SubmitBatch(ctx, cmds)
		require.NoError(t, err)
		for i := range cmds {
			g.record(cmds[i])
		}
		done += n
	}
}

// submit applies one command, retrying with the SAME event id until it is
// acknowledged or giveUp passes. It returns false if it gave up (the
// command's fate is then unknown and the caller must fail).
func (g *loadGen) submit(cmd leaderboard.Command, giveUp time.Time) bool {
	for attempt := 0; ; attempt++ {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		res, err := g.board.Submit(ctx, cmd)
		cancel()
		if err == nil {
			if res.Duplicate {
				g.duplicates.Add(1)
			}
			g.record(cmd)
			return true
		}
		if time.Now().After(giveUp) {
			return false
		}
		g.retries.Add(1)
		time.Sleep(time.Duration(10+attempt*10) * time.Millisecond)
	}
}

// run submits random commands from workers goroutines, pausing pause
// between commands, until ctx is cancelled. The returned wait function
// blocks until every started command is resolved and fails the test if one
// could not be.
func (g *loadGen) run(ctx context.Context, t testing.TB, workers int, pause time.Duration) (wait func()) {
	var wg sync.WaitGroup
	var unresolved atomic.Int64
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(rand.Uint64(), uint64(w)))
			for ctx.Err() == nil {
				cmd := leaderboard.Command{EventID: uuid.New(), UserID: g.users[rng.IntN(len(g.users))], Delta: randomDelta(rng)}
				if !g.submit(cmd, time.Now().Add(60*time.Second)) {
					unresolved.Add(1)
				}
				if pause > 0 {
					time.Sleep(pause)
				}
			}
		}()
	}
	return func() {
		wg.Wait()
		require.Zero(t, unresolved.Load(), "commands whose outcome stayed unknown")
	}
}

// requireExactlyOnce checks PostgreSQL against the books: every user's score
// is the sum of its acknowledged deltas, and score_events holds exactly the
// acknowledged commands.
func (g *loadGen) requireExactlyOnce(t testing.TB, bb *boardBundle) {
	t.Helper()
	ctx := context.Background()
	g.mu.Lock()
	defer g.mu.Unlock()
	rows, err := bb.pool.Query(ctx,
		`SELECT user_id, score FROM `+bb.table(leaderboard.UserScoresTable)+` WHERE board = $1`, bb.board.Name())
	require.NoError(t, err)
	got := map[string]int64{}
	for rows.Next() {
		var u string
		var s int64
		require.NoError(t, rows.Scan(&u, &s))
		got[u] = s
	}
	require.NoError(t, rows.Err())
	mismatched := 0
	for u := range got {
		if _, ok := g.sums[u]; !ok {
			mismatched++ // a user no acknowledged command touched
		}
	}
	for u, want := range g.sums {
		if got[u] != want {
			mismatched++
		}
	}
	require.Zero(t, mismatched, "users whose score is not the sum of their acknowledged deltas")
	evRows, err := bb.pool.Query(ctx,
		`SELECT event_id, user_id, delta FROM `+bb.table(leaderboard.ScoreEventsTable)+` WHERE board = $1`, bb.board.Name())
	require.NoError(t, err)
	var events int64
	wrong := 0
	for evRows.Next() {
		var cmd leaderboard.Command
		require.NoError(t, evRows.Scan(&cmd.EventID, &cmd.UserID, &cmd.Delta))
		events++
		if g.cmds[cmd.EventID] != cmd {
			wrong++ // not an acknowledged command, or not as it was sent
		}
	}
	require.NoError(t, evRows.Err())
	require.Equal(t, g.acked, events, "score events vs acknowledged commands")
	require.Zero(t, wrong, "score events that are not exactly the acknowledged commands")
}

func (g *loadGen) ackedCount() int64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.acked
}
