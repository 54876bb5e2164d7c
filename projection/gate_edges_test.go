package projection

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"

	"github.com/verity-go/verity/internal/telemetry/metrictest"
	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
)

// TestGateSeveralGroupsFailFirstErrorWins: Apply documents "When several slot
// groups fail, the error is the first's." Two collections in different
// Cluster slots, both refused for a layout mismatch: the error must name
// the collection of the first group (the batch's first write).
func TestGateSeveralGroupsFailFirstErrorWins(t *testing.T) {
	t.Parallel()
	c := testenv.SharedRedisCluster(t)
	client := c.Client(t)
	ks, err := NewKeyspace(c.Prefix(t))
	require.NoError(t, err)
	ctx := context.Background()
	// Two collection names in different slots.
	names := []string{"first"}
	for _, n := range []string{"second", "other", "another", "yet", "more"} {
		if ks.Slot(Target{Kind: KindSortedSet, Name: n}) != ks.Slot(Target{Kind: KindSortedSet, Name: "first"}) {
			names = append(names, n)
			break
		}
	}
	require.Len(t, names, 2)
	eight, err := ks.WithVersionBuckets(8)
	require.NoError(t, err)
	_, err = NewGate(client, eight).Apply(ctx, []Write{zset(names[0], "a", 1, 1), zset(names[1], "a", 1, 1)})
	require.NoError(t, err)

	four, err := ks.WithVersionBuckets(4)
	require.NoError(t, err)
	for _, order := range [][2]string{{names[0], names[1]}, {names[1], names[0]}} {
		out, err := NewGate(client, four).Apply(ctx, []Write{zset(order[0], "b", 1, 1), zset(order[1], "b", 1, 1)})
		require.Nil(t, out)
		var lm *LayoutMismatchError
		require.ErrorAs(t, err, &lm)
		require.Equal(t, order[0], lm.Name, "the error is the first failed group's")
	}
}

// TestGateFailedCallCountsNoVerdict: the writes counter's "unknown"
// outcome means refused by the gate (unreadable stored version, layout
// mismatch); a write whose script call failed (Redis unreachable) was not
// decided and must not be counted at all.
func TestGateFailedCallCountsNoVerdict(t *testing.T) {
	t.Parallel()
	rec := metrictest.New(t)
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
	t.Cleanup(func() { _ = client.Close() })
	p, err := NewRedisProjector(client, testMapper(), &Config{Prefix: "zz-mut2:", MeterProvider: rec.Provider})
	require.NoError(t, err)
	results, err := p.Handle(context.Background(), []outbox.Record{record("scores", "alice", 1, "10"), record("scores", "bob", 1, "5")})
	if err == nil {
		for _, r := range results {
			require.Error(t, r.Err, "Redis is unreachable")
		}
	}
	s := rec.Collect(t)
	require.Equal(t, int64(0), s.Int(metricWrites), "no write was decided")
	require.Equal(t, int64(0), s.Int(metricWrites, attribute.String(AttributeOutcome, "unknown")))
}

// TestLayoutMismatchReportsMaxBuckets: a collection stored with
// VersionBucketsMax buckets is a valid layout; a writer configured
// otherwise is refused with a *LayoutMismatchError naming the stored count,
// not -1 ("not a bucket count").
func TestLayoutMismatchReportsMaxBuckets(t *testing.T) {
	t.Parallel()
	rd := testenv.Redis(t)
	ks, err := NewKeyspace(rd.Prefix)
	require.NoError(t, err)
	maxKS, err := ks.WithVersionBuckets(VersionBucketsMax)
	require.NoError(t, err)
	ctx := context.Background()
	_, err = NewGate(rd.Client, maxKS).Apply(ctx, []Write{zset("board", "a", 1, 1)})
	require.NoError(t, err)
	four, err := ks.WithVersionBuckets(4)
	require.NoError(t, err)
	_, err = NewGate(rd.Client, four).Apply(ctx, []Write{zset("board", "b", 1, 1)})
	var lm *LayoutMismatchError
	require.ErrorAs(t, err, &lm)
	require.Equal(t, LayoutMismatchError{Kind: KindSortedSet, Name: "board", Stored: VersionBucketsMax, Configured: 4}, *lm)
	require.Equal(t, VersionBucketsMax, ParseLayout(strconv.Itoa(VersionBucketsMax)))
}
