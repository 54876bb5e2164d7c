package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

type testBundle struct {
	deps deps
	url  string // the Redis server's
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	pg := testenv.Postgres(t)
	rd := testenv.Redis(t)
	return &testBundle{deps: deps{Pool: pg.Pool, Redis: rd.Client, Prefix: rd.Prefix}, url: rd.URL}
}

func TestRun(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// Redis failing GETs failed the naive run, but the versioned one
	// (versioncache's default FailOpen) served those reads from PostgreSQL
	// and reported "0 stale reads after ack" over reads the cache never
	// served. It fails the run now, as naive does.
	t.Run("VersionedFailsOnRedisErrors", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		opt, err := redis.ParseURL(b.url)
		require.NoError(t, err)
		client := redis.NewClient(opt)
		t.Cleanup(func() { _ = client.Close() })
		var failed atomic.Int64
		client.AddHook(failGets{until: time.Now().Add(700 * time.Millisecond), n: &failed})
		_, err = run(ctx, config{Readers: 4, Writers: 1, Duration: time.Second, Modes: []string{modeVersioned},
			WritePause: time.Millisecond}, deps{Pool: b.deps.Pool, Redis: client, Prefix: b.deps.Prefix})
		require.Positive(t, failed.Load())
		require.Error(t, err, "%d reads failed in Redis", failed.Load())
	})

	t.Run("VersionedNeverStale", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		results, err := run(ctx, config{
			Readers: 8, Writers: 2, Duration: 3 * time.Second, Modes: []string{modeVersioned},
			WritePause: time.Millisecond,
		}, b.deps)
		require.NoError(t, err)
		require.Len(t, results, 1)
		r := results[0]
		t.Logf("%+v", r)
		require.Equal(t, modeVersioned, r.Mode)
		require.Positive(t, r.Writes)
		require.Positive(t, r.Reads)
		require.Zero(t, r.Divergences)
		require.Nil(t, r.FirstDivergenceS)
		require.Zero(t, r.StaleReadsAfterAck)
		require.True(t, r.Converged)
		require.Positive(t, r.ReadP50us)
		require.GreaterOrEqual(t, r.ReadP99us, r.ReadP50us)
	})

	// The version key vanishing mid-run (eviction, FLUSHALL, a restart) must
	// not make any older value readable again.
	t.Run("VersionedSurvivesVersionKeyLoss", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		results, err := run(ctx, config{
			Readers: 8, Writers: 2, Duration: 3 * time.Second, Modes: []string{modeVersioned},
			WritePause: time.Millisecond, DropVersionEvery: 5 * time.Millisecond,
		}, b.deps)
		require.NoError(t, err)
		r := results[0]
		t.Logf("%+v drops=%d", r, r.VersionKeyDrops)
		require.Positive(t, r.VersionKeyDrops)
		require.Positive(t, r.Writes)
		require.Zero(t, r.Divergences)
		require.Zero(t, r.StaleReadsAfterAck)
		require.True(t, r.Converged)
	})

	// The harness must be able to see the bug: with the read→fill window
	// widened, delete-on-write serves stale reads within seconds. The race
	// needs a cache fill in flight when a write lands; on a loaded machine
	// writes slow down and a 3-second run can miss it (seen in CI: 118
	// writes, stale reads but no divergence), so up to three runs are
	// made and one of them must show it.
	t.Run("NaiveIsCaught", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		var r Result
		for attempt := 1; attempt <= 3; attempt++ {
			results, err := run(ctx, config{
				Readers: 8, Writers: 2, Duration: 3 * time.Second, Modes: []string{modeNaive},
				Window: 2 * time.Millisecond, WritePause: time.Millisecond,
			}, b.deps)
			require.NoError(t, err)
			r = results[0]
			t.Logf("attempt %d: %+v", attempt, r)
			if r.Divergences > 0 {
				break
			}
		}
		require.Positive(t, r.StaleReadsAfterAck)
		require.Positive(t, r.Divergences)
		require.NotNil(t, r.FirstDivergenceS)
	})

	t.Run("CleansUp", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		_, err := run(ctx, config{Readers: 2, Writers: 1, Duration: 200 * time.Millisecond,
			Modes: []string{modeNaive, modeVersioned}}, b.deps)
		require.NoError(t, err)
		var tables int
		require.NoError(t, b.deps.Pool.QueryRow(ctx,
			`SELECT count(*) FROM pg_tables WHERE tablename LIKE 'race_products_%'
			 AND schemaname = current_schema()`).Scan(&tables))
		require.Zero(t, tables)
		keys, err := b.deps.Redis.Keys(ctx, b.deps.Prefix+"*").Result()
		require.NoError(t, err)
		require.Empty(t, keys)
	})

	t.Run("BadConfig", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		for _, cfg := range []config{
			{Readers: 0, Writers: 1, Duration: time.Second, Modes: []string{modeNaive}},
			{Readers: 1, Writers: 0, Duration: time.Second, Modes: []string{modeNaive}},
			{Readers: 1, Writers: 1, Duration: 0, Modes: []string{modeNaive}},
			{Readers: 1, Writers: 1, Duration: time.Second, Modes: []string{"bogus"}},
			{Readers: 1, Writers: 1, Duration: time.Second},
		} {
			_, err := run(ctx, cfg, b.deps)
			require.Error(t, err, "%+v", cfg)
		}
	})
}

// TestWritePauseDoesNotOutlastTheRun: a run lasts --seconds, and an
// interrupt ends it at once; a writer resting --write-pause between writes
// holds up neither until its pause is over.
func TestWritePauseDoesNotOutlastTheRun(t *testing.T) {
	t.Parallel()
	b := setup(t)
	t.Run("Duration", func(t *testing.T) {
		start := time.Now()
		_, err := run(context.Background(), config{Readers: 1, Writers: 1, Duration: 300 * time.Millisecond,
			Modes: []string{modeNaive}, WritePause: 20 * time.Second}, b.deps)
		require.NoError(t, err)
		require.Less(t, time.Since(start), 10*time.Second, "a 300ms run lasted the whole write pause")
	})
	t.Run("Interrupt", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		time.AfterFunc(300*time.Millisecond, cancel)
		start := time.Now()
		_, err := run(ctx, config{Readers: 1, Writers: 1, Duration: time.Minute,
			Modes: []string{modeNaive}, WritePause: 20 * time.Second}, b.deps)
		require.ErrorIs(t, err, context.Canceled)
		require.Less(t, time.Since(start), 10*time.Second, "an interrupted run waited out the write pause")
	})
}

func TestJSONKeys(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	require.NoError(t, json.NewEncoder(&buf).Encode(Result{Mode: modeNaive}))
	var obj map[string]any
	require.NoError(t, json.Unmarshal(buf.Bytes(), &obj))
	keys := make([]string, 0, len(obj))
	for k := range obj {
		keys = append(keys, k)
	}
	require.ElementsMatch(t, []string{"mode", "writes", "divergences", "first_divergence_s", "reads",
		"stale_reads_after_ack", "read_p50_us", "read_p99_us", "converged"}, keys)
}

func TestGroup(t *testing.T) {
	t.Parallel()
	for in, want := range map[int64]string{0: "0", 999: "999", 4102: "4,102", 41208: "41,208", 1234567: "1,234,567", -4102: "-4,102"} {
		require.Equal(t, want, group(in))
	}
}

// failGets fails every GET sent before until, as a Redis that times out
// would, counting them in n, and passes everything else through.
type failGets struct {
	testenv.PassThroughHook
	until time.Time
	n     *atomic.Int64
}

func (h failGets) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "get" && time.Now().Before(h.until) {
			h.n.Add(1)
			err := errors.New("i/o timeout (injected)")
			cmd.SetErr(err)
			return err
		}
		return next(ctx, cmd)
	}
}
