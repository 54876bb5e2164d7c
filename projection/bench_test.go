package projection

import (
	"context"
	"strconv"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/testenv"
)

// perEventScript is the per-event design the gate replaces, rebuilt here
// only as the benchmark's baseline: one script call per event, a marker key
// per event id, and versions compared as Lua numbers.
// KEYS: marker, sorted set, versions. ARGV: member, score, version, marker TTL.
var perEventScript = redis.NewScript(`
if redis.call('EXISTS', KEYS[1]) == 1 then return 2 end
local stored = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
redis.call('SET', KEYS[1], '1', 'EX', ARGV[4])
if tonumber(ARGV[3]) <= stored then return 3 end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
return 1
`)

const (
	benchBatch   = 100 // events per batch (the relay's default BatchSize is 1000)
	benchMembers = 1000
)

// benchEvents returns batch number n: benchBatch score events for distinct
// members, each with a version above every earlier batch's, so every event
// is applied (the expensive path) in both variants.
func benchEvents(n int) []Write {
	writes := make([]Write, benchBatch)
	for i := range writes {
		member := (n*benchBatch + i) % benchMembers
		version := int64(n*benchBatch+i) + 1
		writes[i] = zset("leaderboard", "user-"+strconv.Itoa(member), version, version%100000)
	}
	return writes
}

// BenchmarkGate compares the batched gate with one script call per event on
// identical data: batches of 100 sorted-set events, a private single Redis
// node.
//
//	go test -run '^$' -bench BenchmarkGate -benchtime 2s ./projection
func BenchmarkGate(b *testing.B) {
	// A private server: the shared one's load from other tests would skew
	// the comparison.
	srv := testenv.StartRedis(b)
	rd := struct {
		Client *redis.Client
		Prefix string
	}{srv.Client(b), "bench:"}
	ctx := context.Background()
	ks, err := NewKeyspace(rd.Prefix)
	if err != nil {
		b.Fatal(err)
	}

	batched := func(ks Keyspace) func(b *testing.B) {
		return func(b *testing.B) {
			gate := NewGate(rd.Client, ks)
			if err := gate.Load(ctx); err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			for n := 0; n < b.N; n++ {
				if _, err := gate.Apply(ctx, benchEvents(n)); err != nil {
					b.Fatal(err)
				}
			}
			reportEventsPerSecond(b)
		}
	}
	b.Run("Batched", batched(ks))
	// The same with version buckets (16 for the 1,000 members, as
	// documented), in a collection of their own.
	bucketedKS, err := NewKeyspace(rd.Prefix + "buckets:")
	if err == nil {
		bucketedKS, err = bucketedKS.WithVersionBuckets(benchMembers / 64)
	}
	if err != nil {
		b.Fatal(err)
	}
	b.Run("BatchedVersionBuckets", batched(bucketedKS))

	perEvent := func(b *testing.B, pipelined bool) {
		name := "perevent"
		if pipelined {
			name += "-pipelined"
		}
		zkey := ks.ValueKey(Target{Kind: KindSortedSet, Name: name}) // tagged: same slot as versions
		vkey := ks.VersionKey(Target{Kind: KindSortedSet, Name: name})
		if err := perEventScript.Load(ctx, rd.Client).Err(); err != nil {
			b.Fatal(err)
		}
		b.ResetTimer()
		for n := 0; n < b.N; n++ {
			events := benchEvents(n)
			var pipe redis.Pipeliner
			var scripter redis.Scripter = rd.Client
			if pipelined {
				pipe = rd.Client.Pipeline()
				scripter = pipe
			}
			for i, w := range events {
				marker := rd.Prefix + "marker:" + strconv.Itoa(n*benchBatch+i)
				cmd := perEventScript.EvalSha(ctx, scripter, []string{marker, zkey, vkey},
					w.Target.Member, w.Value.Score, w.Version, 3600)
				if !pipelined {
					if err := cmd.Err(); err != nil {
						b.Fatal(err)
					}
				}
			}
			if pipelined {
				if _, err := pipe.Exec(ctx); err != nil {
					b.Fatal(err)
				}
			}
		}
		reportEventsPerSecond(b)
	}
	b.Run("PerEvent", func(b *testing.B) { perEvent(b, false) })
	b.Run("PerEventPipelined", func(b *testing.B) { perEvent(b, true) })
}

func reportEventsPerSecond(b *testing.B) {
	b.ReportMetric(float64(b.N*benchBatch)/b.Elapsed().Seconds(), "events/s")
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*benchBatch), "ns/event")
}

// BenchmarkGateCluster measures the gate on the test Redis Cluster (3
// masters): a batch of 100 members of one collection is one script call; a
// batch of 100 documents spreads over about 100 slots, so it is about 100
// script calls, pipelined per master.
//
//	go test -run '^$' -bench BenchmarkGateCluster -benchtime 2s ./projection
func BenchmarkGateCluster(b *testing.B) {
	c := testenv.SharedRedisCluster(b)
	client := c.Client(b)
	ks, err := NewKeyspace(c.Prefix(b))
	if err != nil {
		b.Fatal(err)
	}
	gate := NewGate(client, ks)
	ctx := context.Background()
	if err := gate.Load(ctx); err != nil {
		b.Fatal(err)
	}
	run := func(b *testing.B, batch func(n int) []Write) {
		b.ResetTimer()
		for n := 0; n < b.N; n++ {
			if _, err := gate.Apply(ctx, batch(n)); err != nil {
				b.Fatal(err)
			}
		}
		reportEventsPerSecond(b)
	}
	b.Run("OneCollection", func(b *testing.B) { run(b, benchEvents) })
	b.Run("Documents", func(b *testing.B) {
		run(b, func(n int) []Write {
			writes := benchEvents(n)
			for i, w := range writes {
				writes[i] = doc(w.Target.Member, w.Version, "payload")
			}
			return writes
		})
	})
}
