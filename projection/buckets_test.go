package projection

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// bucketed returns a gate over gb's client and prefix whose keyspace has n
// version buckets.
func (gb *gateBundle) bucketed(t *testing.T, n int) *gateBundle {
	t.Helper()
	ks, err := gb.ks.WithVersionBuckets(n)
	require.NoError(t, err)
	return &gateBundle{client: gb.client, ks: ks, gate: NewGate(gb.client, ks)}
}

// dump returns every key of collection (name, kind) under gb's prefix —
// value, layout, marker, shadows, copy count and the version hashes of the
// unbucketed layout and of layouts 1..64 — with its DUMP, so a test can
// assert that a refused call wrote nothing at all.
func (gb *gateBundle) dump(t *testing.T, name string, kind Kind) map[string]string {
	t.Helper()
	ctx := context.Background()
	keys := []string{gb.ks.ValueKey(Target{Kind: kind, Name: name}), gb.ks.LayoutKey(name, kind), gb.ks.RebuildMarkerKey(name, kind),
		gb.ks.ShadowValueKey(name, kind), gb.ks.ShadowLayoutKey(name, kind), gb.ks.RebuildCopyKey(name, kind)}
	for n := 0; n <= 64; n++ {
		ks, err := gb.ks.WithVersionBuckets(n)
		require.NoError(t, err)
		keys = append(keys, ks.VersionKeys(name, kind)...)
		keys = append(keys, ks.ShadowVersionKeys(name, kind)...)
	}
	out := map[string]string{}
	for _, k := range keys {
		v, err := gb.client.Dump(ctx, k).Result()
		if errors.Is(err, redis.Nil) {
			continue
		}
		require.NoError(t, err)
		out[k] = v
	}
	return out
}

func TestKeyspaceVersionBuckets(t *testing.T) {
	t.Parallel()
	flat, err := NewKeyspace("app:")
	require.NoError(t, err)
	require.Zero(t, flat.VersionBuckets(), "NewKeyspace keeps one version hash")

	t.Run("Bounds", func(t *testing.T) {
		t.Parallel()
		for _, n := range []int{-1, VersionBucketsMax + 1, math.MinInt} {
			_, err := flat.WithVersionBuckets(n)
			require.ErrorIs(t, err, ErrInvalidConfig, "%d", n)
			var ce *ConfigError
			require.ErrorAs(t, err, &ce)
			require.Equal(t, "VersionBuckets", ce.Field)
		}
		for _, n := range []int{0, 1, VersionBucketsMax} {
			ks, err := flat.WithVersionBuckets(n)
			require.NoError(t, err)
			require.Equal(t, n, ks.VersionBuckets())
			require.Equal(t, "app:", ks.Prefix())
		}
	})

	// VersionBucketsMax's doc: at 64 members a bucket it covers about four
	// million members. A bucket count on the zero Keyspace leaves it the
	// zero Keyspace, which Gate and reconcile refuse.
	t.Run("MaxAndZeroKeyspace", func(t *testing.T) {
		t.Parallel()
		require.Equal(t, 65536, VersionBucketsMax)
		zero, err := Keyspace{}.WithVersionBuckets(4)
		require.NoError(t, err)
		require.True(t, zero.IsZero())

		// ShadowVersionKey is the shadow of the bucket holding the empty
		// member, not of bucket 0.
		ks, err := flat.WithVersionBuckets(100)
		require.NoError(t, err)
		require.Equal(t, 61, ks.VersionBucket(""))
		require.Equal(t, "app:{w}:zv:61~r", ks.ShadowVersionKey("w", KindSortedSet))
	})

	t.Run("ProjectorConfigValidated", func(t *testing.T) {
		t.Parallel()
		rd := testenv.Redis(t)
		for _, n := range []int{-1, VersionBucketsMax + 1} {
			_, err := NewRedisProjector(rd.Client, testMapper(), &Config{Prefix: rd.Prefix, VersionBuckets: n})
			require.ErrorIs(t, err, ErrInvalidConfig)
			require.ErrorContains(t, err, "Config.VersionBuckets")
		}
		p, err := NewRedisProjector(rd.Client, testMapper(), &Config{Prefix: rd.Prefix, VersionBuckets: 16})
		require.NoError(t, err)
		require.Equal(t, 16, p.Keyspace().VersionBuckets())
		require.Equal(t, 16, p.Gate().Keyspace().VersionBuckets())
	})

	t.Run("StableFNV1a", func(t *testing.T) {
		t.Parallel()
		ks, err := flat.WithVersionBuckets(100)
		require.NoError(t, err)
		// FNV-1a 32: "" → 2166136261, "a" → 0xE40C292C (3826002220).
		require.Equal(t, 61, ks.VersionBucket(""))
		require.Equal(t, 20, ks.VersionBucket("a"))
		require.Zero(t, flat.VersionBucket("a"))
	})

	t.Run("KeysOfEveryBucketInTheCollectionsSlot", func(t *testing.T) {
		t.Parallel()
		ks, err := flat.WithVersionBuckets(64)
		require.NoError(t, err)
		for _, id := range hazardIDs {
			for _, kind := range []Kind{KindSortedSet, KindHash} {
				coll := Target{Kind: kind, Name: id}
				keys := append(ks.VersionKeys(id, kind), ks.ShadowVersionKeys(id, kind)...)
				keys = append(keys, ks.LayoutKey(id, kind), ks.ShadowLayoutKey(id, kind), ks.ValueKey(coll))
				require.Len(t, keys, 2*64+3)
				seen := map[string]bool{}
				for _, k := range keys {
					require.False(t, seen[k], "key %q twice", k)
					seen[k] = true
					require.Equal(t, ks.Slot(coll), KeySlot(k), "%q", k)
				}
				require.False(t, seen[flat.VersionKey(coll)], "buckets never reuse the unbucketed hash's name")
				for _, m := range hazardIDs {
					tg := Target{Kind: kind, Name: id, Member: m}
					require.Equal(t, ks.VersionKeys(id, kind)[ks.VersionBucket(m)], ks.VersionKey(tg))
				}
			}
		}
		require.Nil(t, ks.VersionKeys("x", KindDocument))
		require.Empty(t, ks.LayoutKey("x", KindDocument))
		d := Target{Kind: KindDocument, Name: "x"}
		require.Equal(t, flat.VersionKey(d), ks.VersionKey(d), "documents are not bucketed")
	})

	// Bucket key names are stored data like every other key name (see
	// TestKeyspace's DocumentedKeyNames): B hashes numbered 0 … B-1 after
	// ":", each with its own "~r" shadow. One bucket is numbered too: it
	// must not reuse the unbucketed hash's name, whose presence is what
	// the gate and the leaderboard probe to recognise a legacy collection.
	t.Run("DocumentedKeyNames", func(t *testing.T) {
		t.Parallel()
		for _, n := range []int{1, 3} {
			ks, err := flat.WithVersionBuckets(n)
			require.NoError(t, err)
			var want, shadows []string
			for b := range n {
				want = append(want, "app:{weekly}:zv:"+strconv.Itoa(b))
				shadows = append(shadows, "app:{weekly}:zv:"+strconv.Itoa(b)+"~r")
			}
			require.Equal(t, want, ks.VersionKeys("weekly", KindSortedSet), "%d buckets", n)
			require.Equal(t, shadows, ks.ShadowVersionKeys("weekly", KindSortedSet), "%d buckets", n)
			require.Equal(t, "app:{weekly}:hv:0", ks.VersionKeys("weekly", KindHash)[0], "%d buckets", n)
			require.Equal(t, "app:{weekly}:zv", ks.unbucketedVersionKey("weekly", KindSortedSet), "%d buckets", n)
		}
	})

	t.Run("Spread", func(t *testing.T) {
		t.Parallel()
		ks, err := flat.WithVersionBuckets(100)
		require.NoError(t, err)
		counts := make([]int, 100)
		for i := range 6400 {
			counts[ks.VersionBucket(fmt.Sprintf("user-%09d", i))]++
		}
		for b, c := range counts {
			require.True(t, c > 32 && c < 128, "bucket %d holds %d of 6400 (mean 64)", b, c)
		}
	})
}

func TestGateVersionBuckets(t *testing.T) {
	t.Parallel()
	forEachBackend(t, func(t *testing.T, b backend) {
		t.Run("AppliedDuplicateStale", func(t *testing.T) {
			t.Parallel()
			gb := setupGate(t, b).bucketed(t, 8)
			ctx := context.Background()
			var writes []Write
			for i := range 200 {
				writes = append(writes, zset("board", "m"+strconv.Itoa(i), 5, int64(i)))
			}
			for _, o := range gb.apply(t, writes...) {
				require.Equal(t, OutcomeApplied, o)
			}
			w := writes[17]
			require.Equal(t, []Outcome{OutcomeDuplicate, OutcomeStale, OutcomeApplied, OutcomeStale},
				gb.apply(t, w, zset("board", w.Target.Member, 4, 1), zset("board", w.Target.Member, 6, 66), zset("board", w.Target.Member, 5, 1)))
			require.Equal(t, storedState{true, "66", "6"}, readState(t, gb.client, gb.ks, w.Target))

			var total int64
			for _, k := range gb.ks.VersionKeys("board", KindSortedSet) {
				n, err := gb.client.HLen(ctx, k).Result()
				require.NoError(t, err)
				require.Positive(t, n, "every bucket used")
				total += n
				enc, err := gb.client.ObjectEncoding(ctx, k).Result()
				require.NoError(t, err)
				require.Equal(t, "listpack", enc, "a bucket of ~25 entries stays compact")
			}
			require.EqualValues(t, 200, total)
			flat, _ := NewKeyspace(gb.ks.Prefix())
			require.Zero(t, gb.client.Exists(ctx, flat.VersionKey(w.Target)).Val(), "no unbucketed hash")
			require.Equal(t, "8", gb.client.Get(ctx, gb.ks.LayoutKey("board", KindSortedSet)).Val())

			// Hashes and documents in the same batch.
			out := gb.apply(t, hash("h", "f", 3, "x"), doc("d", 3, "y"), hash("h", "f", 2, "old"))
			require.Equal(t, []Outcome{OutcomeApplied, OutcomeApplied, OutcomeStale}, out)
			require.Equal(t, storedState{true, "x", "3"}, readState(t, gb.client, gb.ks, hash("h", "f", 0, "").Target))
			require.Equal(t, storedState{true, "y", "3"}, readState(t, gb.client, gb.ks, doc("d", 0, "").Target))
		})

		t.Run("VersionsNearMaxInt64", func(t *testing.T) {
			t.Parallel()
			gb := setupGate(t, b).bucketed(t, 3)
			m := "edge"
			steps := []struct {
				v    int64
				want Outcome
			}{
				{1 << 53, OutcomeApplied}, {1<<53 + 1, OutcomeApplied}, {1 << 53, OutcomeStale},
				{math.MaxInt64 - 1, OutcomeApplied}, {math.MaxInt64, OutcomeApplied},
				{math.MaxInt64 - 1, OutcomeStale}, {math.MaxInt64, OutcomeDuplicate},
			}
			for _, s := range steps {
				require.Equal(t, []Outcome{s.want}, gb.apply(t, hash("h", m, s.v, strconv.FormatInt(s.v, 10))), "version %d", s.v)
			}
			require.Equal(t, storedState{true, strconv.FormatInt(math.MaxInt64, 10), strconv.FormatInt(math.MaxInt64, 10)},
				readState(t, gb.client, gb.ks, hash("h", m, 0, "").Target))
		})

		t.Run("LayoutMismatchRefusedAndWritesNothing", func(t *testing.T) {
			t.Parallel()
			base := setupGate(t, b)
			eight := base.bucketed(t, 8)
			eight.apply(t, zset("board", "a", 1, 10), zset("board", "b", 1, 20))
			before := base.dump(t, "board", KindSortedSet)
			for _, n := range []int{0, 4, 16} {
				other := base.bucketed(t, n)
				_, err := other.gate.Apply(context.Background(), []Write{zset("board", "a", 9, 99), zset("board", "c", 1, 1)})
				require.ErrorIs(t, err, ErrLayoutMismatch, "%d buckets", n)
				var lm *LayoutMismatchError
				require.ErrorAs(t, err, &lm)
				require.Equal(t, LayoutMismatchError{Kind: KindSortedSet, Name: "board", Stored: 8, Configured: n}, *lm)
				require.Equal(t, before, base.dump(t, "board", KindSortedSet), "nothing written with %d buckets", n)
			}
			// The right count still works.
			require.Equal(t, []Outcome{OutcomeApplied}, eight.apply(t, zset("board", "a", 2, 30)))
		})

		t.Run("UnbucketedRecordsLayout0", func(t *testing.T) {
			t.Parallel()
			flat := setupGate(t, b)
			ctx := context.Background()
			flat.apply(t, zset("z", "a", 1, 10), hash("h", "a", 1, "x"))
			for _, w := range []Write{zset("z", "a", 0, 0), hash("h", "a", 0, "")} {
				require.Equal(t, "0", flat.client.Get(ctx, flat.ks.LayoutKey(w.Target.Name, w.Target.Kind)).Val(), "%s", w.Target)
				// So a bucketed writer is refused even once the versions
				// are gone (the last one HDEL'd, or the hash evicted).
				require.NoError(t, flat.client.Del(ctx, flat.ks.VersionKey(w.Target)).Err())
				before := flat.dump(t, w.Target.Name, w.Target.Kind)
				w.Version = 2
				_, err := flat.bucketed(t, 4).gate.Apply(ctx, []Write{w})
				var lm *LayoutMismatchError
				require.ErrorAs(t, err, &lm, "%s", w.Target)
				require.Equal(t, LayoutMismatchError{Kind: w.Target.Kind, Name: w.Target.Name, Stored: 0, Configured: 4}, *lm)
				require.Equal(t, before, flat.dump(t, w.Target.Name, w.Target.Kind))
			}
		})

		// An unbucketed collection whose version hash disappeared keeps its
		// recorded layout "0": a redelivery applies (it self-heals, and
		// reconcile repairs the values left without versions) instead of
		// being refused as a collection that lost its layout key.
		t.Run("UnbucketedLostVersionHash", func(t *testing.T) {
			t.Parallel()
			flat := setupGate(t, b)
			ctx := context.Background()
			flat.apply(t, zset("z", "a", 5, 50), hash("h", "a", 5, "five"))
			for _, w := range []Write{zset("z", "a", 5, 50), hash("h", "a", 5, "five")} {
				// HDEL of the only version removes the hash.
				require.NoError(t, flat.client.HDel(ctx, flat.ks.VersionKey(w.Target), "a").Err())
				require.Zero(t, flat.client.Exists(ctx, flat.ks.VersionKey(w.Target)).Val())
				require.Equal(t, []Outcome{OutcomeApplied}, flat.apply(t, w), "%s", w.Target)
				require.Equal(t, storedState{true, valueOf(w), "5"}, readState(t, flat.client, flat.ks, w.Target))
				require.Equal(t, []Outcome{OutcomeStale}, flat.apply(t, Write{Target: w.Target, Version: 4, Value: w.Value}))
			}
		})

		// Collections written before layouts were recorded have values and
		// the unbucketed version hash, but no layout key: they fit "0",
		// which the next unbucketed write records.
		t.Run("LegacyCollectionAdoptsLayout0", func(t *testing.T) {
			t.Parallel()
			flat := setupGate(t, b)
			four := flat.bucketed(t, 4)
			ctx := context.Background()
			flat.apply(t, zset("old", "a", 1, 10), hash("vals", "a", 1, "x"))
			for _, w := range []Write{zset("old", "a", 1, 10), hash("vals", "a", 1, "x")} {
				name, kind := w.Target.Name, w.Target.Kind
				layout := flat.ks.LayoutKey(name, kind)
				require.NoError(t, flat.client.Del(ctx, layout).Err())
				before := flat.dump(t, name, kind)
				stale := Write{Target: w.Target, Version: 2, Value: w.Value}
				_, err := four.gate.Apply(ctx, []Write{stale})
				var lm *LayoutMismatchError
				require.ErrorAs(t, err, &lm, "%s", w.Target)
				require.Equal(t, LayoutMismatchError{Kind: kind, Name: name, Stored: 0, Configured: 4}, *lm)
				require.Equal(t, before, flat.dump(t, name, kind), "a refused call adopts nothing")

				// Even a write that changes nothing records the layout.
				require.Equal(t, []Outcome{OutcomeDuplicate}, flat.apply(t, w))
				require.Equal(t, "0", flat.client.Get(ctx, layout).Val(), "%s", w.Target)
			}
		})

		t.Run("LostLayoutKeyRefusesUnbucketedWriter", func(t *testing.T) {
			t.Parallel()
			flat := setupGate(t, b)
			eight := flat.bucketed(t, 8)
			ctx := context.Background()
			eight.apply(t, zset("board", "a", 10, 100), hash("vals", "a", 10, "ten"))
			for _, w := range []Write{zset("board", "a", 3, 30), hash("vals", "a", 3, "three")} {
				name, kind := w.Target.Name, w.Target.Kind
				// The layout key is gone (DEL, eviction): v10 sits in a
				// bucket the unbucketed writer never looks at.
				require.NoError(t, flat.client.Del(ctx, flat.ks.LayoutKey(name, kind)).Err())
				before := flat.dump(t, name, kind)
				_, err := flat.gate.Apply(ctx, []Write{w})
				var lm *LayoutMismatchError
				require.ErrorAs(t, err, &lm, "%s", w.Target)
				require.Equal(t, LayoutMismatchError{Kind: kind, Name: name, Stored: -1, Configured: 0}, *lm)
				require.Contains(t, lm.Error(), "unreadable version layout")
				require.Equal(t, before, flat.dump(t, name, kind), "%s: v3 must not overwrite v10", w.Target)
				// Restoring the layout key lets the right writer in again.
				require.NoError(t, flat.client.Set(ctx, flat.ks.LayoutKey(name, kind), "8", 0).Err())
				w.Version = 11
				require.Equal(t, []Outcome{OutcomeApplied}, eight.apply(t, w))
			}
			// A bucketed writer is refused the same way: the bucket count
			// is unknown.
			require.NoError(t, flat.client.Del(ctx, flat.ks.LayoutKey("board", KindSortedSet)).Err())
			_, err := flat.bucketed(t, 4).gate.Apply(ctx, []Write{zset("board", "a", 12, 120)})
			var lm *LayoutMismatchError
			require.ErrorAs(t, err, &lm)
			require.Equal(t, -1, lm.Stored)
			// Unbucketed collections, new and existing, are unaffected.
			require.Equal(t, []Outcome{OutcomeApplied, OutcomeApplied}, flat.apply(t, zset("new", "a", 1, 1), hash("newh", "a", 1, "x")))
			require.Equal(t, []Outcome{OutcomeApplied, OutcomeDuplicate, OutcomeApplied, OutcomeStale},
				flat.apply(t, zset("new", "b", 1, 2), hash("newh", "a", 1, "x"), zset("new", "a", 3, 3), zset("new", "a", 2, 9)))
		})

		// Anything but a canonical bucket count in a layout key is
		// unreadable, whatever the writer's count: spaces and line breaks
		// included, which must neither split the script's error reply
		// into an untyped error nor be trimmed off it ("8 " read as 8).
		t.Run("UnreadableLayout", func(t *testing.T) {
			t.Parallel()
			gb := setupGate(t, b)
			ctx := context.Background()
			for _, stored := range []string{"07", "", "1 2", "8 ", " 8", "x", "8\n", "8\r\n"} {
				require.NoError(t, gb.client.Set(ctx, gb.ks.LayoutKey("x", KindHash), stored, 0).Err())
				require.NoError(t, gb.client.Set(ctx, gb.ks.ShadowLayoutKey("y", KindHash), stored, 0).Err())
				for _, n := range []int{0, 7, 8} {
					g := gb.bucketed(t, n).gate
					_, err := g.Apply(ctx, []Write{hash("x", "f", 1, "v")})
					var lm *LayoutMismatchError
					require.ErrorAs(t, err, &lm, "%q, %d buckets", stored, n)
					require.Equal(t, LayoutMismatchError{Kind: KindHash, Name: "x", Stored: -1, Configured: n}, *lm, "%q", stored)
					_, err = g.ApplyShadow(ctx, "", []Write{hash("y", "f", 1, "v")})
					require.ErrorAs(t, err, &lm, "%q, %d buckets", stored, n)
					require.Equal(t, LayoutMismatchError{Kind: KindHash, Name: "y", Shadow: true, Stored: -1, Configured: n}, *lm, "%q", stored)
				}
			}
			require.Zero(t, gb.client.Exists(ctx, gb.ks.ValueKey(hash("x", "f", 0, "").Target)).Val())
			require.Zero(t, gb.client.Exists(ctx, gb.ks.ShadowValueKey("y", KindHash)).Val())
		})

		t.Run("DualWriteFollowsTheRebuildsLayout", func(t *testing.T) {
			t.Parallel()
			flat := setupGate(t, b)
			ctx := context.Background()
			flat.apply(t, zset("r", "a", 1, 10))
			// A rebuild to 8 buckets has started (what reconcile's start
			// step does): marker and shadow layout.
			eight := flat.bucketed(t, 8)
			require.NoError(t, flat.client.Set(ctx, flat.ks.ShadowLayoutKey("r", KindSortedSet), "8", 0).Err())
			require.NoError(t, flat.client.Set(ctx, flat.ks.RebuildMarkerKey("r", KindSortedSet), "tok", 0).Err())

			_, err := flat.gate.ApplyShadow(ctx, "", []Write{zset("r", "b", 1, 1)})
			var lm *LayoutMismatchError
			require.ErrorAs(t, err, &lm, "a shadow copy in another layout is refused")
			require.Equal(t, LayoutMismatchError{Kind: KindSortedSet, Name: "r", Shadow: true, Stored: 8, Configured: 0}, *lm)

			out, err := eight.gate.ApplyShadow(ctx, "", []Write{zset("r", "b", 7, 70)})
			require.NoError(t, err)
			require.Equal(t, []Outcome{OutcomeApplied}, out)

			// The live (unbucketed) gate dual-writes into the 8-bucket
			// shadow, twice: learning the layout, then from its memory.
			for i, batch := range [][]Write{{zset("r", "a", 2, 20), zset("r", "b", 6, 60)}, {zset("r", "c", 1, 5)}} {
				out := flat.apply(t, batch...)
				for _, o := range out {
					require.Equal(t, OutcomeApplied, o, "batch %d", i)
				}
			}
			require.Equal(t, storedState{true, "20", "2"}, readShadowState(t, flat.client, eight.ks, zset("r", "a", 0, 0).Target))
			require.Equal(t, storedState{true, "70", "7"}, readShadowState(t, flat.client, eight.ks, zset("r", "b", 0, 0).Target))
			require.Equal(t, storedState{true, "5", "1"}, readShadowState(t, flat.client, eight.ks, zset("r", "c", 0, 0).Target))
			require.Equal(t, storedState{true, "60", "6"}, readState(t, flat.client, flat.ks, zset("r", "b", 0, 0).Target))
			require.Zero(t, flat.client.Exists(ctx, flat.ks.ShadowVersionKey("r", KindSortedSet)).Val(), "no unbucketed shadow versions")
		})

		// Shadow layouts follow the live rule: recorded by the first write
		// ("0" included), "missing" when lost with values but no
		// unbucketed shadow hash.
		t.Run("ShadowLayoutRecorded", func(t *testing.T) {
			t.Parallel()
			flat := setupGate(t, b)
			ctx := context.Background()
			layout := flat.ks.ShadowLayoutKey("s", KindHash)
			_, err := flat.gate.ApplyShadow(ctx, "", []Write{hash("s", "a", 1, "x")})
			require.NoError(t, err)
			require.Equal(t, "0", flat.client.Get(ctx, layout).Val())

			require.NoError(t, flat.client.Del(ctx, layout, flat.ks.ShadowVersionKey("s", KindHash)).Err())
			before := flat.dump(t, "s", KindHash)
			_, err = flat.gate.ApplyShadow(ctx, "", []Write{hash("s", "a", 1, "x")})
			var lm *LayoutMismatchError
			require.ErrorAs(t, err, &lm)
			require.Equal(t, LayoutMismatchError{Kind: KindHash, Name: "s", Shadow: true, Stored: -1, Configured: 0}, *lm)
			require.Equal(t, before, flat.dump(t, "s", KindHash))
		})
	})
}

// TestGateBucketsOneCallPerSlot checks on the shared Cluster that bucket
// keys travel with their collection: a batch over many collections and
// buckets makes one script call per slot, every key of which is in it.
func TestGateBucketsOneCallPerSlot(t *testing.T) {
	t.Parallel()
	c := testenv.SharedRedisCluster(t)
	client := c.Client(t)
	flat, err := NewKeyspace(c.Prefix(t))
	require.NoError(t, err)
	ks, err := flat.WithVersionBuckets(16)
	require.NoError(t, err)
	gate := NewGate(client, ks)
	var writes []Write
	slots := map[int]bool{}
	for i := range 300 {
		w := zset("board-"+strconv.Itoa(i%9), "user-"+strconv.Itoa(i), 1, int64(i))
		writes = append(writes, w)
		slots[ks.Slot(w.Target)] = true
	}
	all := make([]int, len(writes))
	for i := range all {
		all[i] = i
	}
	groups := gate.group(modeLive, "", writes, all)
	require.Len(t, groups, len(slots))
	buckets := 0
	for _, grp := range groups {
		for _, key := range grp.keys {
			require.Equal(t, KeySlot(grp.keys[0]), KeySlot(key))
		}
		buckets += len(grp.keys) - 7*len(grp.bases)
	}
	require.Greater(t, buckets, 9*8, "most buckets of every board are used")
	out, err := gate.Apply(context.Background(), writes)
	require.NoError(t, err)
	for _, o := range out {
		require.Equal(t, OutcomeApplied, o)
	}
}

// The mirror of DualWriteFollowsTheRebuildsLayout: a rebuild that takes a
// bucketed collection back to one version hash (Rebuild migrates "from
// one count to another", 0 included). The live gate, configured with 8
// buckets, learns the shadow's stored layout "0" from the script's
// VERITY_LAYOUT reply and dual-writes into the unbucketed shadow hash.
// A relearn condition of stored > 0 instead of >= 0 made every live
// write fail with a LayoutMismatchError for the whole rebuild, and no
// test failed.
// (A mutation audit of 2026-12-07 found this untested.)
func TestDualWriteFollowsARebuildToNoBuckets(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	flat := setupGate(t, backends[0])
	eight := flat.bucketed(t, 8)
	eight.apply(t, zset("r", "a", 1, 10))
	// A rebuild to 0 buckets has started (reconcile's start step):
	// marker and shadow layout "0".
	require.NoError(t, flat.client.Set(ctx, flat.ks.ShadowLayoutKey("r", KindSortedSet), "0", 0).Err())
	require.NoError(t, flat.client.Set(ctx, flat.ks.RebuildMarkerKey("r", KindSortedSet), "tok", 0).Err())

	for i, batch := range [][]Write{{zset("r", "a", 2, 20), zset("r", "b", 6, 60)}, {zset("r", "c", 1, 5)}} {
		out, err := eight.gate.Apply(ctx, batch)
		require.NoError(t, err, "batch %d: the live gate learns the shadow's layout 0", i)
		for _, o := range out {
			require.Equal(t, OutcomeApplied, o, "batch %d", i)
		}
	}
	require.Equal(t, storedState{true, "20", "2"}, readShadowState(t, flat.client, flat.ks, zset("r", "a", 0, 0).Target))
	require.Equal(t, storedState{true, "60", "6"}, readShadowState(t, flat.client, flat.ks, zset("r", "b", 0, 0).Target))
	require.Equal(t, storedState{true, "5", "1"}, readShadowState(t, flat.client, flat.ks, zset("r", "c", 0, 0).Target))
	require.Equal(t, storedState{true, "60", "6"}, readState(t, eight.client, eight.ks, zset("r", "b", 0, 0).Target))
}
