package projection

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/verity-go/verity/internal/telemetry/metrictest"
	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
)

func TestProjectorMetrics(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	setup := func(t *testing.T) (*RedisProjector, *metrictest.Recorder) {
		t.Helper()
		rd := testenv.Redis(t)
		rec := metrictest.New(t)
		p, err := NewRedisProjector(rd.Client, testMapper(), &Config{Prefix: rd.Prefix, MeterProvider: rec.Provider})
		require.NoError(t, err)
		return p, rec
	}
	outcome := func(o string) attribute.KeyValue { return attribute.String(AttributeOutcome, o) }
	board := attribute.String(AttributeName, "board")

	t.Run("OutcomesAndLagOfAppliedWrites", func(t *testing.T) {
		t.Parallel()
		p, rec := setup(t)
		// A fixed clock: every record was committed 2s (alice, bob) or 1s
		// (the order document) before the gate applied it.
		now := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
		p.metrics.now = func() time.Time { return now }
		at := func(r outbox.Record, ago time.Duration) outbox.Record { r.CreatedAt = now.Add(-ago); return r }

		results, err := p.Handle(ctx, []outbox.Record{
			at(record("scores", "alice", 2, "10"), 2*time.Second),
			at(record("scores", "bob", 1, "25"), 2*time.Second),
			at(record("orders", "41", 1, `{"total":1}`), time.Second),
			at(record("scores", "carol", 1, "not a number"), time.Second),
		})
		require.NoError(t, err)
		require.Error(t, results[3].Err)
		// The conflict series exists, at 0, before any conflict: an alert
		// on increase() would not see the first conflict of a series born
		// at 1.
		first := rec.Collect(t)
		require.Equal(t, 1, first.Series(metricWrites, board, outcome("conflict"), attribute.String(AttributeMode, "live")))
		require.Zero(t, first.Int(metricWrites, board, outcome("conflict")))

		// Redelivery: alice v2 and bob v1 again (duplicates), alice v1
		// (stale), bob v1 with another score (a conflict).
		_, err = p.Handle(ctx, []outbox.Record{
			at(record("scores", "alice", 2, "10"), 3*time.Second),
			at(record("scores", "bob", 1, "25"), 3*time.Second),
			at(record("scores", "alice", 1, "4"), 3*time.Second),
			at(record("scores", "bob", 1, "26"), 3*time.Second),
		})
		require.NoError(t, err)

		s := rec.Collect(t)
		require.Equal(t, int64(2), s.Int(metricWrites, board, outcome("applied"), attribute.String(AttributeMode, "live"),
			attribute.String(AttributeKind, "sorted-set")))
		require.Equal(t, int64(1), s.Int(metricWrites, attribute.String(AttributeName, ""), outcome("applied"),
			attribute.String(AttributeKind, "document")), "documents report no name: their Name is an id")
		require.Equal(t, int64(2), s.Int(metricWrites, board, outcome("duplicate")))
		require.Equal(t, int64(1), s.Int(metricWrites, board, outcome("stale")))
		require.Equal(t, int64(1), s.Int(metricWrites, board, outcome("conflict")))
		require.Equal(t, int64(1), s.Int(metricFailed, attribute.String(AttributeReason, "map")))

		require.Equal(t, uint64(2), s.Count(metricLag, board), "only applied writes have a lag")
		require.Equal(t, uint64(1), s.Count(metricLag, attribute.String(AttributeName, "")))
		lowest, ok := s.Min(metricLag, board)
		require.True(t, ok)
		require.Equal(t, 2.0, lowest)
		require.Equal(t, uint64(2), s.Count(metricBatchDuration, attribute.String(AttributeMode, "live")))
	})

	// Handle measures each applied record's lag from its own CreatedAt,
	// under its own name, when records its Mapper refused come first.
	t.Run("HandleLagOfEachRecord", func(t *testing.T) {
		t.Parallel()
		p, rec := setup(t)
		now := time.Now()
		p.metrics.now = func() time.Time { return now }
		at := func(r outbox.Record, ago time.Duration) outbox.Record { r.CreatedAt = now.Add(-ago); return r }
		results, err := p.Handle(ctx, []outbox.Record{
			at(record("nowhere", "x", 1, "1"), 5*time.Second),
			at(record("scores", "lou", 1, "1"), 2*time.Second),
			at(record("orders", "8", 1, "{}"), time.Second),
			at(record("scores", "lou", 1, "1"), 4*time.Second), // a duplicate: no lag
		})
		require.NoError(t, err)
		require.ErrorIs(t, results[0].Err, ErrUnmappedStream)
		s := rec.Collect(t)
		require.Equal(t, uint64(1), s.Count(metricLag, board))
		lag, _ := s.Min(metricLag, board)
		require.Equal(t, 2.0, lag)
		require.Equal(t, uint64(1), s.Count(metricLag, attribute.String(AttributeName, "")))
		lag, _ = s.Min(metricLag, attribute.String(AttributeName, ""))
		require.Equal(t, 1.0, lag)
	})

	t.Run("ClockSkewRecordsZeroLag", func(t *testing.T) {
		t.Parallel()
		p, rec := setup(t)
		now := time.Now()
		p.metrics.now = func() time.Time { return now }
		r := record("scores", "dave", 1, "5")
		r.CreatedAt = now.Add(time.Second) // the database clock runs ahead
		_, err := p.Project(ctx, []outbox.Record{r})
		require.NoError(t, err)
		s := rec.Collect(t)
		lowest, ok := s.Min(metricLag, board)
		require.True(t, ok)
		require.Zero(t, lowest)
	})

	t.Run("ShadowWritesAreCountedApart", func(t *testing.T) {
		t.Parallel()
		p, rec := setup(t)
		w := Write{Target: Target{Kind: KindSortedSet, Name: "board", Member: "erin"}, Version: 1, Value: Value{Score: 3}}
		_, err := p.Gate().ApplyShadow(ctx, "", []Write{w})
		require.NoError(t, err)
		// A rebuild's counted copy is a shadow write too.
		require.NoError(t, p.Gate().client.Set(ctx, p.Keyspace().RebuildMarkerKey("board", KindSortedSet), "tok", 0).Err())
		w.Target.Member = "fay"
		_, err = p.Gate().ApplyShadowCopy(ctx, "tok", 1, []Write{w})
		require.NoError(t, err)
		s := rec.Collect(t)
		require.Equal(t, int64(2), s.Int(metricWrites, board, outcome("applied"), attribute.String(AttributeMode, "shadow")))
		require.Equal(t, int64(2), s.Int(metricWrites), "no write under another mode")
		require.Equal(t, uint64(2), s.Count(metricBatchDuration, attribute.String(AttributeMode, "shadow")))
		require.Zero(t, s.Int(metricWrites, attribute.String(AttributeMode, "live")))
		require.Zero(t, s.Count(metricLag), "writes that do not come from the outbox have no commit time")
	})

	reason := func(r string) attribute.KeyValue { return attribute.String(AttributeReason, r) }

	t.Run("ProjectCountsRecordsItsMapperRefused", func(t *testing.T) {
		t.Parallel()
		p, rec := setup(t)
		_, err := p.Project(ctx, []outbox.Record{
			record("scores", "gina", 1, "5"),
			record("scores", "hal", 1, "five"),
			record("nowhere", "x", 1, "1"),
		})
		require.ErrorIs(t, err, ErrInvalidPayload, "the first refused record is the error")
		s := rec.Collect(t)
		require.Equal(t, int64(2), s.Int(metricFailed, reason("map")))
		require.Zero(t, s.Int(metricFailed, reason("redis")))
	})

	t.Run("LayoutMismatchHasItsOwnReason", func(t *testing.T) {
		t.Parallel()
		p, rec := setup(t)
		// Another deployment with 16 buckets created the board.
		bucketed, err := NewRedisProjector(p.Gate().client, testMapper(), &Config{Prefix: p.Keyspace().Prefix(), VersionBuckets: 16})
		require.NoError(t, err)
		_, err = bucketed.Project(ctx, []outbox.Record{record("scores", "ivy", 1, "1")})
		require.NoError(t, err)

		results, err := p.Handle(ctx, []outbox.Record{record("scores", "jo", 1, "2"), record("orders", "7", 1, "{}"), record("scores", "kim", 1, "3")})
		require.NoError(t, err)
		require.ErrorIs(t, results[0].Err, ErrLayoutMismatch)
		require.NoError(t, results[1].Err)
		_, err = p.Project(ctx, []outbox.Record{record("scores", "jo", 1, "2")})
		require.ErrorIs(t, err, ErrLayoutMismatch)

		s := rec.Collect(t)
		require.Equal(t, int64(3), s.Int(metricFailed, reason("layout")), "two records through Handle, one through Project")
		require.Zero(t, s.Int(metricFailed, reason("redis")))
		require.Equal(t, int64(2), s.Int(metricWrites, board, outcome("unknown")), "Handle's refused writes")
		require.Equal(t, int64(1), s.Int(metricWrites, attribute.String(AttributeKind, "document"), outcome("applied")))
	})

	t.Run("CorruptVersionHasItsOwnReason", func(t *testing.T) {
		t.Parallel()
		p, rec := setup(t)
		kim := Target{Kind: KindSortedSet, Name: "board", Member: "kim"}
		require.NoError(t, p.Gate().client.HSet(ctx, p.Keyspace().VersionKey(kim), "kim", "007").Err())
		batch := []outbox.Record{record("scores", "kim", 1, "2"), record("scores", "lee", 1, "3")}
		results, err := p.Handle(ctx, batch)
		require.NoError(t, err)
		require.ErrorIs(t, results[0].Err, ErrCorruptVersion)
		require.NoError(t, results[1].Err)
		_, err = p.Project(ctx, batch)
		require.ErrorIs(t, err, ErrCorruptVersion)

		s := rec.Collect(t)
		require.Equal(t, int64(2), s.Int(metricFailed, reason("corrupt_version")), "one record through Handle, one through Project")
		require.Equal(t, int64(2), s.Int(metricFailed), "no other reason")
		require.Equal(t, int64(2), s.Int(metricWrites, board, outcome("unknown")))
		require.Equal(t, int64(1), s.Int(metricWrites, board, outcome("applied")))
		require.Equal(t, int64(1), s.Int(metricWrites, board, outcome("duplicate")))
	})

	// A slot group sent again write by write to find a key of another type
	// is counted once: each write with its final outcome, one batch.
	t.Run("WrongKeyTypeIsCountedOnce", func(t *testing.T) {
		t.Parallel()
		p, rec := setup(t)
		_, err := p.Project(ctx, []outbox.Record{record("scores", "f", 1, "1")})
		require.NoError(t, err)
		client := p.Gate().client
		require.NoError(t, client.Set(ctx, p.Keyspace().ValueKey(Target{Kind: KindSortedSet, Name: "board"}), "not a sorted set", 0).Err())
		results, err := p.Handle(ctx, []outbox.Record{record("profiles", "a", 1, "{}"), record("scores", "g", 1, "2"), record("profiles", "b", 1, "{}")})
		require.NoError(t, err)
		require.ErrorIs(t, results[1].Err, ErrWrongKeyType)

		s := rec.Collect(t)
		require.Equal(t, int64(4), s.Int(metricWrites), "f, then a, g and b once each")
		require.Equal(t, int64(1), s.Int(metricWrites, board, outcome("unknown")))
		require.Equal(t, int64(1), s.Int(metricFailed, reason("redis")))
		require.Equal(t, uint64(2), s.Count(metricBatchDuration))
	})

	// Redis keeps what a script wrote before a key of another type stopped
	// it: those writes are applied (with their lag), not the duplicates a
	// second try would find, while a record delivered twice is still a
	// duplicate, before or after the bad key in the same slot group.
	t.Run("WrongKeyTypeKeepsTheFailedCallsVerdicts", func(t *testing.T) {
		t.Parallel()
		p, rec := setup(t)
		now := time.Now()
		p.metrics.now = func() time.Time { return now }
		at := func(r outbox.Record) outbox.Record { r.CreatedAt = now.Add(-time.Second); return r }
		// Seeded without metrics: the board's version, and d and e, which
		// the batch below delivers again.
		unmetered := NewGate(p.Gate().client, p.Keyspace())
		_, err := unmetered.Apply(ctx, []Write{
			{Target: Target{Kind: KindSortedSet, Name: "board", Member: "f"}, Version: 1, Value: Value{Score: 1}},
			{Target: Target{Kind: KindHash, Name: "profiles", Member: "d"}, Version: 1, Value: Value{Data: []byte("{}")}},
			{Target: Target{Kind: KindHash, Name: "profiles", Member: "e"}, Version: 1, Value: Value{Data: []byte("{}")}},
		})
		require.NoError(t, err)
		client := p.Gate().client
		require.NoError(t, client.Set(ctx, p.Keyspace().ValueKey(Target{Kind: KindSortedSet, Name: "board"}), "not a sorted set", 0).Err())

		results, err := p.Handle(ctx, []outbox.Record{
			at(record("profiles", "a", 1, "{}")), // applied by the call that fails
			at(record("profiles", "d", 1, "{}")), // delivered twice
			at(record("scores", "g", 1, "2")),    // the bad key stops the script
			at(record("profiles", "b", 1, "{}")), // applied when sent again
			at(record("profiles", "e", 1, "{}")), // delivered twice
		})
		require.NoError(t, err)
		require.ErrorIs(t, results[2].Err, ErrWrongKeyType)
		for _, i := range []int{0, 1, 3, 4} {
			require.NoError(t, results[i].Err, "record %d", i)
		}

		profiles := attribute.String(AttributeName, "profiles")
		s := rec.Collect(t)
		require.Equal(t, int64(2), s.Int(metricWrites, profiles, outcome("applied")), "a and b")
		require.Equal(t, int64(2), s.Int(metricWrites, profiles, outcome("duplicate")), "d and e")
		require.Equal(t, int64(1), s.Int(metricWrites, board, outcome("unknown")))
		require.Equal(t, uint64(2), s.Count(metricLag, profiles), "a and b have a lag")
		lag, _ := s.Min(metricLag, profiles)
		require.Equal(t, 1.0, lag)

		// The outcomes Handle logs are the same.
		outcomes, perWrite, err := unmetered.run(ctx, modeLive, "", []Write{
			{Target: Target{Kind: KindHash, Name: "profiles", Member: "h"}, Version: 1},
			{Target: Target{Kind: KindHash, Name: "profiles", Member: "a"}, Version: 1, Value: Value{Data: []byte("{}")}},
			{Target: Target{Kind: KindSortedSet, Name: "board", Member: "i"}, Version: 1},
			{Target: Target{Kind: KindHash, Name: "profiles", Member: "b"}, Version: 1, Value: Value{Data: []byte("{}")}},
			{Target: Target{Kind: KindHash, Name: "profiles", Member: "j"}, Version: 1},
		}, true)
		require.NoError(t, err)
		require.Equal(t, []Outcome{OutcomeApplied, OutcomeDuplicate, OutcomeUnknown, OutcomeDuplicate, OutcomeApplied}, outcomes)
		require.ErrorIs(t, perWrite[2], ErrWrongKeyType)
		require.Equal(t, 2, perWrite[2].(*WrongKeyTypeError).Index)
	})

	// Two projectors of one collection name under two prefixes (a board
	// per tenant) report apart to one MeterProvider: their writes, lags
	// and failures added up in one series.
	t.Run("EachPrefixReportsApart", func(t *testing.T) {
		t.Parallel()
		rd := testenv.Redis(t)
		rec := metrictest.New(t)
		project := func(prefix string, records ...outbox.Record) {
			p, err := NewRedisProjector(rd.Client, testMapper(), &Config{Prefix: prefix, MeterProvider: rec.Provider})
			require.NoError(t, err)
			for i := range records {
				records[i].CreatedAt = time.Now()
			}
			_, err = p.Handle(ctx, records)
			require.NoError(t, err)
		}
		project(rd.Prefix+"a:", record("scores", "alice", 1, "10"))
		project(rd.Prefix+"b:", record("scores", "alice", 1, "10"), record("scores", "bob", 1, "3"), record("scores", "carol", 1, "x"))
		s := rec.Collect(t)
		a, b := attribute.String(AttributePrefix, rd.Prefix+"a:"), attribute.String(AttributePrefix, rd.Prefix+"b:")
		require.EqualValues(t, 1, s.Int(metricWrites, a, board, outcome("applied")))
		require.EqualValues(t, 2, s.Int(metricWrites, b, board, outcome("applied")))
		require.Equal(t, uint64(1), s.Count(metricLag, a, board))
		require.Equal(t, uint64(2), s.Count(metricLag, b, board))
		require.Zero(t, s.Int(metricFailed, a))
		require.EqualValues(t, 1, s.Int(metricFailed, b, attribute.String(AttributeReason, "map")))
		require.Equal(t, uint64(1), s.Count(metricBatchDuration, a))
	})

	t.Run("NoProviderRecordsNothing", func(t *testing.T) {
		t.Parallel()
		rd := testenv.Redis(t)
		p, err := NewRedisProjector(rd.Client, testMapper(), &Config{Prefix: rd.Prefix})
		require.NoError(t, err)
		require.Nil(t, p.metrics)
		out, err := p.Project(ctx, []outbox.Record{record("scores", "frank", 1, "1")})
		require.NoError(t, err)
		require.Equal(t, []Outcome{OutcomeApplied}, out)
	})
}

func TestConfigDefaultsAreQuiet(t *testing.T) {
	t.Parallel()
	cfg := (*Config)(nil).WithDefaults()
	require.False(t, cfg.Logger.Enabled(context.Background(), slog.LevelError), "the default logger discards everything")
	require.Nil(t, cfg.MeterProvider, "no provider means no-op metrics")

	// A typed-nil provider is no provider either, not a panic in the SDK.
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialled
	t.Cleanup(func() { _ = client.Close() })
	var mp *sdkmetric.MeterProvider
	p, err := NewRedisProjector(client, testMapper(), &Config{MeterProvider: mp})
	require.NoError(t, err)
	require.Nil(t, p.metrics)
}
