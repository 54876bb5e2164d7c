package projection

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
)

// These tests drive the projector with the real outbox relay on real
// PostgreSQL and Redis, and break delivery on purpose.

type relayBundle struct {
	pg        *testenv.PG
	client    redis.UniversalClient
	projector *RedisProjector
	ks        Keyspace
	writer    *outbox.Writer
	outboxCfg *outbox.Config
}

func setupRelay(t *testing.T, b backend) *relayBundle {
	t.Helper()
	pg := testenv.Postgres(t)
	client, prefix := b.connect(t)
	cfg := &outbox.Config{Schema: pg.Schema}
	require.NoError(t, outbox.Migrate(context.Background(), pg.Pool, cfg))
	writer, err := outbox.NewWriter(cfg)
	require.NoError(t, err)
	p, err := NewRedisProjector(client, testMapper(), &Config{Prefix: prefix})
	require.NoError(t, err)
	return &relayBundle{pg: pg, client: client, projector: p, ks: p.Keyspace(), writer: writer, outboxCfg: cfg}
}

// commit appends msgs in one transaction, as an application's command
// handler would alongside its state change.
func (rb *relayBundle) commit(t *testing.T, msgs ...outbox.Message) {
	t.Helper()
	ctx := context.Background()
	tx, err := rb.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // no-op after Commit
	require.NoError(t, rb.writer.Append(ctx, tx, msgs...))
	require.NoError(t, tx.Commit(ctx))
}

func (rb *relayBundle) relay(t *testing.T, h outbox.Handler, cfg outbox.RelayConfig) *outbox.Relay {
	t.Helper()
	cfg.Schema = rb.outboxCfg.Schema
	if cfg.RetryBackoffMin == 0 {
		cfg.RetryBackoffMin, cfg.RetryBackoffMax = 10*time.Millisecond, 40*time.Millisecond
	}
	r, err := outbox.NewRelay(rb.pg.Pool, h, &cfg)
	require.NoError(t, err)
	return r
}

func (rb *relayBundle) pending(t *testing.T, r *outbox.Relay) int64 {
	t.Helper()
	stats, err := r.Stats(context.Background())
	require.NoError(t, err)
	require.Zero(t, stats.DeadLetters)
	return stats.Pending
}

// boardState is the whole projected leaderboard: member → "score@version".
func (rb *relayBundle) boardState(t *testing.T) map[string]string {
	t.Helper()
	ctx := context.Background()
	tg := Target{Kind: KindSortedSet, Name: "board"}
	scores, err := rb.client.ZRangeWithScores(ctx, rb.ks.ValueKey(tg), 0, -1).Result()
	require.NoError(t, err)
	versions, err := rb.client.HGetAll(ctx, rb.ks.VersionKey(tg)).Result()
	require.NoError(t, err)
	require.Len(t, versions, len(scores), "one version per member")
	state := map[string]string{}
	for _, z := range scores {
		member := z.Member.(string)
		state[member] = formatScore(z.Score) + "@" + versions[member]
	}
	return state
}

func scoreMsg(key string, version, score int64) outbox.Message {
	return outbox.Message{EventID: uuid.New(), Stream: "scores", Key: key, Version: version, Payload: []byte(strconv.FormatInt(score, 10))}
}

// delivery is one record as a handler saw it, with the gate's verdict.
type delivery struct {
	rec     outbox.Record
	outcome Outcome
}

// projectingRecorder projects through Project (to see outcomes) and
// remembers every delivery. fail, when set, fails chosen records before
// they reach Redis, as a transient error would.
type projectingRecorder struct {
	p    *RedisProjector
	fail func(rec outbox.Record) bool

	mu         sync.Mutex
	deliveries []delivery
}

func (h *projectingRecorder) Handle(ctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
	results := make([]outbox.Result, len(batch))
	var pass []outbox.Record
	var at []int
	for i, rec := range batch {
		if h.fail != nil && h.fail(rec) {
			results[i].Err = errors.New("injected transient failure")
			continue
		}
		pass, at = append(pass, rec), append(at, i)
	}
	outcomes, err := h.p.Project(ctx, pass)
	if err != nil {
		return nil, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for j, o := range outcomes {
		h.deliveries = append(h.deliveries, delivery{rec: batch[at[j]], outcome: o})
	}
	return results, nil
}

func (h *projectingRecorder) seen() []delivery {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]delivery(nil), h.deliveries...)
}

func TestCrashSafety(t *testing.T) {
	t.Parallel()

	forEachBackend(t, func(t *testing.T, b backend) {
		// A relay writes Redis and then hangs (or dies) before it can
		// acknowledge. Its lease runs out, another relay re-delivers the
		// batch: every record is a duplicate and Redis is unchanged.
		t.Run("CrashAfterRedisWriteBeforeAck", func(t *testing.T) {
			t.Parallel()
			rb := setupRelay(t, b)
			ctx := context.Background()
			var msgs []outbox.Message
			for i := 0; i < 5; i++ {
				msgs = append(msgs, scoreMsg("user-"+strconv.Itoa(i), 1, int64(10*i)))
			}
			// Two versions of one member in the same batch.
			msgs = append(msgs, scoreMsg("twice", 1, 1), scoreMsg("twice", 2, 2))
			rb.commit(t, msgs...)

			wrote, release := make(chan struct{}), make(chan struct{})
			var releaseOnce sync.Once
			unblock := func() { releaseOnce.Do(func() { close(release) }) }
			t.Cleanup(unblock) // never leave the zombie blocked, even on failure
			zombie := &projectingRecorder{p: rb.projector}
			// The zombie's writes must land: its handler's context ends with
			// the lease, which on a loaded machine can run out before the
			// writes are sent (the claim and a stalled goroutine eat it), and
			// the scenario is writes that landed. What the test checks (the
			// re-delivery is a duplicate, the late ack is refused) does not
			// depend on the lease's length; a longer one than the claim could
			// need only delays the re-delivery.
			zombieRelay := rb.relay(t, outbox.HandlerFunc(func(ctx context.Context, batch []outbox.Record) ([]outbox.Result, error) {
				results, err := zombie.Handle(context.WithoutCancel(ctx), batch)
				close(wrote)
				<-release // hung past its lease: it cannot ack in time
				return results, err
			}), outbox.RelayConfig{LeaseDuration: time.Second})
			zombieDone := make(chan error, 1)
			go func() { _, err := zombieRelay.RunOnce(ctx); zombieDone <- err }()

			select {
			case <-wrote:
			case err := <-zombieDone:
				t.Fatalf("the zombie relay handled nothing: %v", err)
			}
			afterFirst := rb.boardState(t)
			require.Len(t, afterFirst, 6)
			require.Len(t, zombie.seen(), len(msgs))
			for _, d := range zombie.seen() {
				require.Equal(t, OutcomeApplied, d.outcome, "first delivery of %s v%d", d.rec.Key, d.rec.Version)
			}

			healthy := &projectingRecorder{p: rb.projector}
			healthyRelay := rb.relay(t, healthy, outbox.RelayConfig{})
			require.Eventually(t, func() bool {
				n, err := healthyRelay.RunOnce(ctx)
				require.NoError(t, err)
				return n > 0
			}, 10*time.Second, 20*time.Millisecond, "the batch is re-delivered once the lease expires")

			redelivered := healthy.seen()
			require.Len(t, redelivered, len(msgs))
			for _, d := range redelivered {
				want := OutcomeDuplicate // the stored version is this record's
				if d.rec.Key == "twice" && d.rec.Version == 1 {
					want = OutcomeStale // v2 of the same batch is stored
				}
				require.Equal(t, want, d.outcome, "redelivery of %s v%d", d.rec.Key, d.rec.Version)
				require.GreaterOrEqual(t, d.rec.Attempts, 2)
			}
			require.Equal(t, afterFirst, rb.boardState(t), "redelivery leaves Redis identical")

			unblock()
			require.ErrorIs(t, <-zombieDone, outbox.ErrLeaseLost, "the zombie cannot acknowledge rows it lost")
			require.Zero(t, rb.pending(t, healthyRelay))
			for i := 0; i < 5; i++ {
				require.Equal(t, strconv.Itoa(10*i)+"@1", afterFirst["user-"+strconv.Itoa(i)])
			}
			require.Equal(t, "2@2", afterFirst["twice"])
		})

		// v2's first delivery fails, so v3 reaches Redis first; the retried
		// v2 is stale and changes nothing.
		t.Run("OutOfOrderDeliveryV3BeforeV2", func(t *testing.T) {
			t.Parallel()
			rb := setupRelay(t, b)
			ctx := context.Background()
			rb.commit(t, scoreMsg("alice", 1, 10))
			rb.commit(t, scoreMsg("alice", 2, 20))
			rb.commit(t, scoreMsg("alice", 3, 30))

			h := &projectingRecorder{p: rb.projector, fail: func(rec outbox.Record) bool {
				return rec.Version == 2 && rec.Attempts == 1
			}}
			r := rb.relay(t, h, outbox.RelayConfig{})
			require.Eventually(t, func() bool {
				_, err := r.RunOnce(ctx)
				require.NoError(t, err)
				return rb.pending(t, r) == 0
			}, 10*time.Second, 20*time.Millisecond)

			var order []string
			for _, d := range h.seen() {
				order = append(order, fmt.Sprintf("v%d:%s", d.rec.Version, d.outcome))
			}
			require.Equal(t, []string{"v1:applied", "v3:applied", "v2:stale"}, order)
			require.Equal(t, map[string]string{"alice": "30@3"}, rb.boardState(t))
		})

		// Several relays deliver interleaved versions of the same keys at
		// once, with random transient failures reordering them further.
		// Whatever order Redis sees, the highest version wins for every key.
		t.Run("ConcurrentRelaysHighestVersionWins", func(t *testing.T) {
			t.Parallel()
			rb := setupRelay(t, b)
			const keys, versions, relays = 8, 6, 4
			for v := int64(1); v <= versions; v++ {
				for k := 0; k < keys; k++ {
					key := "k" + strconv.Itoa(k)
					rb.commit(t, scoreMsg(key, v, v*100+int64(k)),
						outbox.Message{EventID: uuid.New(), Stream: "orders", Key: key, Version: v, Payload: []byte("v" + strconv.FormatInt(v, 10))})
				}
			}
			var mu sync.Mutex
			var handlers []*projectingRecorder
			ctx, cancel := context.WithCancel(context.Background())
			var wg sync.WaitGroup
			var lastRelay *outbox.Relay
			for i := 0; i < relays; i++ {
				h := &projectingRecorder{p: rb.projector, fail: func(rec outbox.Record) bool {
					// A third of first attempts fail and come back later.
					return rec.Attempts == 1 && rec.ID%3 == int64(i%3)
				}}
				mu.Lock()
				handlers = append(handlers, h)
				mu.Unlock()
				r := rb.relay(t, h, outbox.RelayConfig{BatchSize: 5, PollInterval: 10 * time.Millisecond, Name: "relay-" + strconv.Itoa(i)})
				lastRelay = r
				wg.Add(1)
				go func() {
					defer wg.Done()
					_ = r.Run(ctx)
				}()
			}
			t.Cleanup(func() { cancel(); wg.Wait() })
			require.Eventually(t, func() bool { return rb.pending(t, lastRelay) == 0 }, 30*time.Second, 50*time.Millisecond)
			cancel()
			wg.Wait()

			counts := map[Outcome]int{}
			delivered := map[string]bool{}
			for _, h := range handlers {
				for _, d := range h.seen() {
					counts[d.outcome]++
					delivered[d.rec.EventID.String()] = true
				}
			}
			require.Len(t, delivered, 2*keys*versions, "every event was delivered")
			require.NotZero(t, counts[OutcomeApplied])
			require.NotZero(t, counts[OutcomeStale], "the injected failures reordered deliveries")
			t.Logf("outcomes: applied=%d duplicate=%d stale=%d", counts[OutcomeApplied], counts[OutcomeDuplicate], counts[OutcomeStale])

			want := map[string]string{}
			for k := 0; k < keys; k++ {
				key := "k" + strconv.Itoa(k)
				want[key] = strconv.Itoa(versions*100+k) + "@" + strconv.Itoa(versions)
				require.Equal(t, storedState{true, "v" + strconv.Itoa(versions), strconv.Itoa(versions)},
					readState(t, rb.client, rb.ks, Target{Kind: KindDocument, Name: "order:" + key}))
			}
			require.Equal(t, want, rb.boardState(t))
		})
	})
}

// TestRelayLayoutMismatchDeadLettersOnlyThatCollection runs a projector with
// a stale bucket count under the real relay: the records of the collection
// it may not write are retried, then dead-lettered; the rest are acked.
func TestRelayLayoutMismatchDeadLettersOnlyThatCollection(t *testing.T) {
	t.Parallel()
	rb := setupRelay(t, backends[0])
	ctx := context.Background()
	bucketed, err := NewRedisProjector(rb.client, testMapper(), &Config{Prefix: rb.ks.Prefix(), VersionBuckets: 16})
	require.NoError(t, err)
	_, err = bucketed.Gate().Apply(ctx, []Write{{Target: Target{Kind: KindSortedSet, Name: "board", Member: "alice"}, Version: 1, Value: Value{Score: 1}}})
	require.NoError(t, err)

	rb.commit(t, scoreMsg("bob", 1, 5),
		outbox.Message{EventID: uuid.New(), Stream: "orders", Key: "41", Version: 1, Payload: []byte("{}")})
	r := rb.relay(t, rb.projector, outbox.RelayConfig{MaxAttempts: 2})
	runUntilNonePending(t, r)

	dead, err := r.DeadLetters(ctx, 0, 10)
	require.NoError(t, err)
	require.Len(t, dead, 1)
	require.Equal(t, "bob", dead[0].Key)
	require.Equal(t, 2, dead[0].Attempts, "retried before it was buried")
	require.Contains(t, dead[0].LastError, "16 buckets")
	require.True(t, readState(t, rb.client, rb.ks, Target{Kind: KindDocument, Name: "order:41"}).exists, "the order was not held back")
}

// TestRelayDeadLettersOnlyAValueRedisWouldRefuse: through a real relay,
// a row over Redis's proto-max-bulk-len (lowered to its 1 MB minimum on a
// private server) is retried and buried alone; the rows claimed with it
// reach Redis. Before Config.MaxValueBytes all three were buried.
func TestRelayDeadLettersOnlyAValueRedisWouldRefuse(t *testing.T) {
	t.Parallel()
	const limit = 1 << 20
	client := testenv.StartRedis(t, "--proto-max-bulk-len", "1mb").Client(t)
	rb := setupRelay(t, backend{name: "private", connect: func(t *testing.T) (redis.UniversalClient, string) { return client, "size:" }})
	var err error
	rb.projector, err = NewRedisProjector(client, testMapper(), &Config{Prefix: "size:", MaxValueBytes: limit})
	require.NoError(t, err)
	ctx := context.Background()
	rb.commit(t,
		outbox.Message{EventID: uuid.New(), Stream: "orders", Key: "a", Version: 1, Payload: []byte(`{"n":1}`)},
		outbox.Message{EventID: uuid.New(), Stream: "orders", Key: "b", Version: 1, Payload: bytes.Repeat([]byte("x"), limit+1)},
		outbox.Message{EventID: uuid.New(), Stream: "orders", Key: "c", Version: 1, Payload: []byte(`{"n":2}`)},
	)
	r := rb.relay(t, rb.projector, outbox.RelayConfig{MaxAttempts: 2})
	runUntilNonePending(t, r)

	dead, err := r.DeadLetters(ctx, 0, 10)
	require.NoError(t, err)
	keys := make([]string, len(dead)) // not the records: one holds a megabyte
	for i, d := range dead {
		keys[i] = d.Key
	}
	require.Equal(t, []string{"b"}, keys, "dead letters")
	require.Contains(t, dead[0].LastError, "Config.MaxValueBytes")
	for _, key := range []string{"a", "c"} {
		require.True(t, readState(t, client, rb.ks, Target{Kind: KindDocument, Name: "order:" + key}).exists, key)
	}
}

// runUntilNonePending runs r's batches until no row is pending: each
// delivered, or retried up to its MaxAttempts and dead-lettered.
func runUntilNonePending(t *testing.T, r *outbox.Relay) {
	t.Helper()
	ctx := context.Background()
	require.Eventually(t, func() bool {
		_, err := r.RunOnce(ctx)
		require.NoError(t, err)
		stats, err := r.Stats(ctx)
		require.NoError(t, err)
		return stats.Pending == 0
	}, 10*time.Second, 20*time.Millisecond)
}
