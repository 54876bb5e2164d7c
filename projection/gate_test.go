package projection

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// hazardIDs are identifiers that would break naive key building: hash-tag
// braces, separators, control bytes, invalid UTF-8 and very long ids.
var hazardIDs = []string{
	"", "plain", "{", "}", "{}", "}{", "{x}", "a{b}c", "{a}{b}", ":", "a:b", "a:b:", ":z", "}:z",
	"%", "%7B", "%%", "line\nbreak", "\r\n", "\x00", "nul\x00byte", "\xff\xfe\xfd", "日本語",
	"~r", "x~rebuild", strings.Repeat("k", 1024), strings.Repeat("{", 1024), strings.Repeat("}:", 512),
}

type gateBundle struct {
	client redis.UniversalClient
	ks     Keyspace
	gate   *Gate
}

func setupGate(t *testing.T, b backend) *gateBundle {
	t.Helper()
	client, prefix := b.connect(t)
	ks, err := NewKeyspace(prefix)
	require.NoError(t, err)
	return &gateBundle{client: client, ks: ks, gate: NewGate(client, ks)}
}

func (gb *gateBundle) apply(t *testing.T, writes ...Write) []Outcome {
	t.Helper()
	outcomes, err := gb.gate.Apply(context.Background(), writes)
	require.NoError(t, err)
	require.Len(t, outcomes, len(writes))
	return outcomes
}

func zset(name, member string, version, score int64) Write {
	return Write{Target: Target{Kind: KindSortedSet, Name: name, Member: member}, Version: version, Value: Value{Score: score}}
}

func hash(name, field string, version int64, data string) Write {
	return Write{Target: Target{Kind: KindHash, Name: name, Member: field}, Version: version, Value: Value{Data: []byte(data)}}
}

func doc(id string, version int64, data string) Write {
	return Write{Target: Target{Kind: KindDocument, Name: id}, Version: version, Value: Value{Data: []byte(data)}}
}

// valueOf is the value a write stores, as readState renders it.
func valueOf(w Write) string {
	if w.Target.Kind == KindSortedSet {
		return strconv.FormatInt(w.Value.Score, 10)
	}
	return string(w.Value.Data)
}

func TestKeySlot(t *testing.T) {
	t.Parallel()

	t.Run("KnownVectors", func(t *testing.T) {
		t.Parallel()
		require.Equal(t, uint16(0x31C3), crc16("123456789"), "CRC-16/XMODEM check value")
		require.Equal(t, 12182, KeySlot("foo"))
		require.Equal(t, KeySlot("user1000"), KeySlot("{user1000}.following"))
		// An empty tag hashes the whole key: CRC16("{}x") % 16384, not the
		// slot of "" (0) or of "x" (16287).
		require.Equal(t, 10595, KeySlot("{}x"), "an empty tag hashes the whole key")
		require.Equal(t, 16287, KeySlot("x"))
	})

	t.Run("MatchesClusterKeySlot", func(t *testing.T) {
		t.Parallel()
		c := testenv.SharedRedisCluster(t)
		client := c.Client(t)
		ks, err := NewKeyspace("p:")
		require.NoError(t, err)
		ctx := context.Background()
		keys := []string{"{}x", "x{}y", "{{}}"}
		for _, id := range hazardIDs {
			tg := Target{Kind: KindSortedSet, Name: id, Member: id}
			keys = append(keys, id, "{"+id+"}", ks.ValueKey(tg), ks.VersionKey(tg), ks.RebuildMarkerKey(id, KindHash),
				ks.RebuildCopyKey(id, KindSortedSet), ks.ValueKey(Target{Kind: KindDocument, Name: id}))
		}
		for _, key := range keys {
			want, err := client.ClusterKeySlot(ctx, key).Result()
			require.NoError(t, err)
			require.Equal(t, int(want), KeySlot(key), "key %q", key)
		}
	})

	// Random keys over an alphabet of braces and a few other bytes (empty
	// tags, a '{' left open, nested braces, '}' first) hash as Redis does.
	t.Run("MatchesClusterKeySlotOnBraceHeavyKeys", func(t *testing.T) {
		t.Parallel()
		c := testenv.SharedRedisCluster(t)
		client := c.Client(t)
		ctx := context.Background()
		r := rand.New(rand.NewPCG(7, 9))
		const alphabet = "{{}}ab:%\x00\xff"
		keys := []string{"", "{", "}", "{}", "{}{a}", "{{a}}", "a{", "a}b{c}", "{a{b}c}", "}{a}"}
		for len(keys) < 3000 {
			b := make([]byte, r.IntN(10))
			for j := range b {
				b[j] = alphabet[r.IntN(len(alphabet))]
			}
			keys = append(keys, string(b))
		}
		pipe := client.Pipeline()
		slots := make([]*redis.IntCmd, len(keys))
		for i, key := range keys {
			slots[i] = pipe.ClusterKeySlot(ctx, key)
		}
		_, err := pipe.Exec(ctx)
		require.NoError(t, err)
		for i, key := range keys {
			require.Equal(t, int(slots[i].Val()), KeySlot(key), "key %q", key)
		}
	})
}

func TestKeyspace(t *testing.T) {
	t.Parallel()

	t.Run("PrefixWithBraceRejected", func(t *testing.T) {
		t.Parallel()
		for _, prefix := range []string{"a{", "}b", "{x}"} {
			_, err := NewKeyspace(prefix)
			require.Error(t, err, prefix)
		}
		ks, err := NewKeyspace("")
		require.NoError(t, err)
		require.Equal(t, "", ks.Prefix())
		require.False(t, ks.IsZero(), "an empty prefix is still a made Keyspace")
		bucketed, err := ks.WithVersionBuckets(4)
		require.NoError(t, err)
		require.False(t, bucketed.IsZero())
		require.True(t, Keyspace{}.IsZero())
	})

	t.Run("HazardousIDsGiveDistinctKeysInOneSlotPerCollection", func(t *testing.T) {
		t.Parallel()
		ks, err := NewKeyspace("app:")
		require.NoError(t, err)
		seen := map[string]string{}
		add := func(key, what string) {
			prev, dup := seen[key]
			require.False(t, dup, "%s and %s share key %q", prev, what, key)
			seen[key] = what
		}
		for _, id := range hazardIDs {
			var slots []int
			for _, kind := range []Kind{KindSortedSet, KindHash} {
				tg := Target{Kind: kind, Name: id}
				keys := []string{ks.ValueKey(tg), ks.VersionKey(tg), ks.RebuildMarkerKey(id, kind),
					ks.ShadowValueKey(id, kind), ks.ShadowVersionKey(id, kind), ks.RebuildCopyKey(id, kind)}
				for i, key := range keys {
					add(key, fmt.Sprintf("%s %q key %d", kind, id, i))
					slots = append(slots, KeySlot(key))
				}
			}
			d := Target{Kind: KindDocument, Name: id}
			add(ks.ValueKey(d), fmt.Sprintf("document %q", id))
			add(ks.VersionKey(d), fmt.Sprintf("document %q version", id))
			slots = append(slots, KeySlot(ks.ValueKey(d)), KeySlot(ks.VersionKey(d)))
			for _, s := range slots {
				require.Equal(t, ks.Slot(d), s, "every key of %q is in one slot", id)
			}
			require.Equal(t, KeySlot(ks.HashTag(d)), ks.Slot(d))
		}
	})

	// The key names are stored data, documented on Keyspace (and relied on
	// by reconcile and by readers of other releases): renaming any of them
	// orphans every projected key after an upgrade, and a reader of another
	// release sees an empty projection. The distinctness and slot checks
	// above cannot notice a rename, so the documented layout is pinned here.
	t.Run("DocumentedKeyNames", func(t *testing.T) {
		t.Parallel()
		ks, err := NewKeyspace("app:")
		require.NoError(t, err)
		z := Target{Kind: KindSortedSet, Name: "weekly", Member: "alice"}
		h := Target{Kind: KindHash, Name: "weekly", Member: "alice"}
		d := Target{Kind: KindDocument, Name: "weekly"}

		require.Equal(t, "app:{weekly}:z", ks.ValueKey(z))
		require.Equal(t, "app:{weekly}:zv", ks.VersionKey(z))
		require.Equal(t, "app:{weekly}:h", ks.ValueKey(h))
		require.Equal(t, "app:{weekly}:hv", ks.VersionKey(h))
		require.Equal(t, "app:{weekly}:d", ks.ValueKey(d))
		require.Equal(t, "app:{weekly}:dv", ks.VersionKey(d))
		require.Equal(t, []string{"app:{weekly}:zv"}, ks.VersionKeys("weekly", KindSortedSet))
		require.Equal(t, []string{"app:{weekly}:hv"}, ks.VersionKeys("weekly", KindHash))
		require.Equal(t, "app:{weekly}:z~layout", ks.LayoutKey("weekly", KindSortedSet))
		require.Equal(t, "app:{weekly}:h~layout", ks.LayoutKey("weekly", KindHash))
		require.Equal(t, "app:{weekly}:z~layout~r", ks.ShadowLayoutKey("weekly", KindSortedSet))
		require.Equal(t, "app:{weekly}:z~rebuild", ks.RebuildMarkerKey("weekly", KindSortedSet))
		require.Equal(t, "app:{weekly}:h~rebuild", ks.RebuildMarkerKey("weekly", KindHash))
		require.Equal(t, "app:{weekly}:z~rebuild~copied", ks.RebuildCopyKey("weekly", KindSortedSet))
		require.Equal(t, "app:{weekly}:z~r", ks.ShadowValueKey("weekly", KindSortedSet))
		require.Equal(t, "app:{weekly}:h~r", ks.ShadowValueKey("weekly", KindHash))
		require.Equal(t, "app:{weekly}:zv~r", ks.ShadowVersionKey("weekly", KindSortedSet))
		require.Equal(t, "app:{weekly}:hv~r", ks.ShadowVersionKey("weekly", KindHash))
		require.Equal(t, "{weekly}", ks.HashTag(z))
		require.Equal(t, KeySlot("weekly"), ks.Slot(z))

		// The tag is keyenc.Escape of the name: letters, digits and "._-"
		// stay readable, anything else is %XX, and the empty name is "%".
		pass := "azAZ09._-"
		require.Equal(t, "app:{"+pass+"}:z", ks.ValueKey(Target{Kind: KindSortedSet, Name: pass}))
		require.Equal(t, "app:{a%3Ab%7Bc%7D}:z", ks.ValueKey(Target{Kind: KindSortedSet, Name: "a:b{c}"}))
		require.Equal(t, "app:{%}:z", ks.ValueKey(Target{Kind: KindSortedSet, Name: ""}))
	})

	t.Run("NonCollectionKindsHaveNoShadowKeys", func(t *testing.T) {
		t.Parallel()
		ks, err := NewKeyspace("")
		require.NoError(t, err)
		require.Empty(t, ks.RebuildMarkerKey("x", KindDocument))
		require.Empty(t, ks.RebuildCopyKey("x", KindDocument))
		require.Empty(t, ks.ShadowValueKey("x", KindDocument))
		require.Empty(t, ks.ShadowVersionKey("x", Kind(9)))
		require.Empty(t, ks.ValueKey(Target{Kind: Kind(9)}))
		require.Empty(t, ks.VersionKey(Target{Kind: Kind(9), Name: "x"}), "VersionKey is empty for an invalid Kind")
		require.Empty(t, ks.ShadowLayoutKey("x", KindDocument), "a document has no layout key, so no shadow of one")
	})

	// MaxKeyLen, which the projector and reconcile check against
	// MaxValueBytes, bounds every key made for a name, the empty one
	// (written "{%}") included.
	t.Run("MaxKeyLenBoundsEveryKey", func(t *testing.T) {
		t.Parallel()
		base, err := NewKeyspace("p:")
		require.NoError(t, err)
		for _, buckets := range []int{0, 1, 7, VersionBucketsMax} {
			ks, err := base.WithVersionBuckets(buckets)
			require.NoError(t, err)
			for _, name := range []string{"", "a", "weekly{x}:y", "\xff\x00"} {
				longest := 0
				for _, kind := range []Kind{KindSortedSet, KindHash, KindDocument} {
					target := Target{Kind: kind, Name: name}
					if kind != KindDocument {
						target.Member = "m"
					}
					keys := []string{ks.ValueKey(target), ks.VersionKey(target), ks.LayoutKey(name, kind), ks.RebuildCopyKey(name, kind),
						ks.RebuildMarkerKey(name, kind), ks.ShadowLayoutKey(name, kind), ks.ShadowValueKey(name, kind), ks.ShadowVersionKey(name, kind)}
					keys = append(keys, ks.VersionKeys(name, kind)...)
					keys = append(keys, ks.ShadowVersionKeys(name, kind)...)
					for _, key := range keys {
						require.LessOrEqual(t, len(key), ks.MaxKeyLen(name), "buckets %d, %v %q: key %q", buckets, kind, name, key)
						longest = max(longest, len(key))
					}
				}
				require.Equal(t, longest, ks.MaxKeyLen(name), "buckets %d, name %q: the bound is the longest key", buckets, name)
			}
		}
	})

	// Every key any package derives from a Keyspace, its own and the
	// suffixes reconcile ("~switched", "~probe" on the rebuild marker) and
	// leaderboard ("~verified", "~verifying", "~verified~held" on the value
	// key) append, stays distinct across prefixes that begin one another,
	// bucket counts, kinds and names that look like suffixes or escapes;
	// and every key of a collection is in its slot, as the scripts need.
	// Bucket i's key is the same under any bucket count above i, which the
	// layout key tells apart, so bucket keys are told apart by index only.
	t.Run("DistinctAcrossPrefixesBucketCountsAndSuffixes", func(t *testing.T) {
		t.Parallel()
		names := append(slices.Clone(hazardIDs), "z", "zv", "zv:0", "%25", "~layout", "d", "%3Az", "a%", "a%25")
		seen := map[string]string{}
		add := func(key, what string) {
			if prev, dup := seen[key]; dup && prev != what {
				t.Fatalf("%s and %s share key %q", prev, what, key)
			}
			seen[key] = what
		}
		for _, prefix := range []string{"", "a", "a:", "a:b", "%", ":"} {
			base, err := NewKeyspace(prefix)
			require.NoError(t, err)
			for _, buckets := range []int{0, 1, 3} {
				ks, err := base.WithVersionBuckets(buckets)
				require.NoError(t, err)
				bucketed := min(buckets, 1)
				for _, name := range names {
					for _, kind := range []Kind{KindSortedSet, KindHash} {
						id := fmt.Sprintf("%q/%q/%v", prefix, name, kind)
						coll := Target{Kind: kind, Name: name}
						value, marker := ks.ValueKey(coll), ks.RebuildMarkerKey(name, kind)
						keys := map[string]string{
							"value": value, "layout": ks.LayoutKey(name, kind), "shadow layout": ks.ShadowLayoutKey(name, kind),
							"marker": marker, "copy count": ks.RebuildCopyKey(name, kind), "shadow value": ks.ShadowValueKey(name, kind),
							"switched": marker + "~switched", "probe": marker + "~probe",
							"verified": value + "~verified", "verifying": value + "~verifying", "held": value + "~verified~held",
						}
						for i, key := range ks.VersionKeys(name, kind) {
							keys[fmt.Sprintf("version %d/%d", bucketed, i)] = key
						}
						for i, key := range ks.ShadowVersionKeys(name, kind) {
							keys[fmt.Sprintf("shadow version %d/%d", bucketed, i)] = key
						}
						for role, key := range keys {
							require.NotEmpty(t, key, "%s %s", id, role)
							add(key, id+" "+role)
							require.Equal(t, ks.Slot(coll), KeySlot(key), "%s %s %q", id, role, key)
						}
					}
					d := Target{Kind: KindDocument, Name: name}
					add(ks.ValueKey(d), fmt.Sprintf("%q/%q document", prefix, name))
					add(ks.VersionKey(d), fmt.Sprintf("%q/%q document version", prefix, name))
					require.Equal(t, ks.Slot(d), KeySlot(ks.VersionKey(d)))
				}
			}
		}
	})
}

func TestGate(t *testing.T) {
	t.Parallel()

	forEachBackend(t, func(t *testing.T, b backend) {
		t.Run("AppliedDuplicateStale", func(t *testing.T) {
			t.Parallel()
			gb := setupGate(t, b)
			for _, mk := range []func(v int64) Write{
				func(v int64) Write { return zset("board", "alice", v, v*10) },
				func(v int64) Write { return hash("profiles", "alice", v, fmt.Sprintf("state-%d", v)) },
				func(v int64) Write { return doc("order-1", v, fmt.Sprintf(`{"v":%d}`, v)) },
			} {
				v1, v2, v3 := mk(1), mk(2), mk(3)
				kind := v1.Target.Kind
				require.Equal(t, []Outcome{OutcomeApplied}, gb.apply(t, v2), kind)
				require.Equal(t, []Outcome{OutcomeDuplicate}, gb.apply(t, v2), kind)
				require.Equal(t, []Outcome{OutcomeStale}, gb.apply(t, v1), kind)
				require.Equal(t, storedState{true, valueOf(v2), "2"}, readState(t, gb.client, gb.ks, v2.Target), kind)
				require.Equal(t, []Outcome{OutcomeApplied}, gb.apply(t, v3), kind)
				require.Equal(t, storedState{true, valueOf(v3), "3"}, readState(t, gb.client, gb.ks, v3.Target), kind)
			}
		})

		// Same version, same value: a redelivery, nothing written. Same
		// version, another value: a conflict, nothing written either, and
		// the first state stays. Scores compare as numbers (at the range's
		// ends too); a version whose value is gone is a duplicate.
		t.Run("SameVersionOtherValueIsConflict", func(t *testing.T) {
			t.Parallel()
			gb := setupGate(t, b)
			ctx := context.Background()
			type pair struct{ first, same, other Write }
			pairs := func(n string) []pair {
				return []pair{
					{zset("z", n, 5, 7), zset("z", n, 5, 7), zset("z", n, 5, 8)},
					{zset("z", "max"+n, 5, MaxScore), zset("z", "max"+n, 5, MaxScore), zset("z", "max"+n, 5, MaxScore-1)},
					{zset("z", "min"+n, 5, MinScore), zset("z", "min"+n, 5, MinScore), zset("z", "min"+n, 5, MinScore+1)},
					{zset("z", "zero"+n, 5, 0), zset("z", "zero"+n, 5, 0), zset("z", "zero"+n, 5, -1)},
					{hash("h", n, 5, "original"), hash("h", n, 5, "original"), hash("h", n, 5, "other")},
					{hash("h", "empty"+n, 5, ""), hash("h", "empty"+n, 5, ""), hash("h", "empty"+n, 5, " ")},
				}
			}
			// A document in a call sends it through the per-write loop;
			// collection writes alone are decided in bulk.
			for _, mixed := range []bool{true, false} {
				n := strconv.FormatBool(mixed)
				ps := pairs(n)
				if mixed {
					ps = append(ps, pair{doc("d", 5, "{}"), doc("d", 5, "{}"), doc("d", 5, "{ }")})
				}
				var first, same, other []Write
				for _, p := range ps {
					first, same, other = append(first, p.first), append(same, p.same), append(other, p.other)
				}
				gb.apply(t, first...)
				for i, o := range gb.apply(t, same...) {
					require.Equal(t, OutcomeDuplicate, o, "mixed %v: %v", mixed, same[i].Target)
				}
				for i, o := range gb.apply(t, other...) {
					require.Equal(t, OutcomeConflict, o, "mixed %v: %v", mixed, other[i].Target)
				}
				for _, w := range first {
					require.Equal(t, storedState{true, valueOf(w), "5"}, readState(t, gb.client, gb.ks, w.Target), "mixed %v", mixed)
				}
				// The value lost, its version kept: nothing to conflict with.
				lost := zset("z", "lost"+n, 5, 1)
				gb.apply(t, lost)
				require.NoError(t, gb.client.ZRem(ctx, gb.ks.ValueKey(lost.Target), lost.Target.Member).Err())
				call := []Write{zset("z", "lost"+n, 5, 2)}
				if mixed {
					call = append(call, doc("d", 5, "{}"))
				}
				require.Equal(t, OutcomeDuplicate, gb.apply(t, call...)[0], "mixed %v", mixed)
				require.Equal(t, storedState{}, readState(t, gb.client, gb.ks, lost.Target), "mixed %v: a duplicate writes nothing, not even a lost value", mixed)
				// A value key of another type (a hand edit) cannot be read:
				// no conflict, and no error either, as nothing is written.
				typed := []Write{zset("zt"+n, "m", 5, 1), hash("ht"+n, "m", 5, "a")}
				if mixed {
					typed = append(typed, doc("dt"+n, 5, "a"))
				}
				gb.apply(t, typed...)
				var again []Write
				for _, w := range typed {
					key := gb.ks.ValueKey(w.Target)
					require.NoError(t, gb.client.Del(ctx, key).Err())
					require.NoError(t, gb.client.RPush(ctx, key, "not", "a", "value").Err())
					w.Value = Value{Score: 2, Data: []byte("b")}
					again = append(again, w)
				}
				for i, o := range gb.apply(t, again...) {
					require.Equal(t, OutcomeDuplicate, o, "mixed %v: %v", mixed, again[i].Target)
					require.Equal(t, "list", gb.client.Type(ctx, gb.ks.ValueKey(again[i].Target)).Val(), "mixed %v: %v: the duplicate wrote", mixed, again[i].Target)
				}
			}
		})

		t.Run("BatchOrderWithinOneBatch", func(t *testing.T) {
			t.Parallel()
			gb := setupGate(t, b)
			// A write at a version applied earlier in the same batch is
			// judged against that write's value.
			out := gb.apply(t,
				zset("b", "m", 1, 10), zset("b", "m", 3, 30), zset("b", "m", 2, 20), zset("b", "m", 3, 31), zset("b", "m", 3, 30),
				doc("d", 7, "seven"), doc("d", 7, "again"), doc("d", 7, "seven"), doc("d", 8, "eight"))
			require.Equal(t, []Outcome{OutcomeApplied, OutcomeApplied, OutcomeStale, OutcomeConflict, OutcomeDuplicate,
				OutcomeApplied, OutcomeConflict, OutcomeDuplicate, OutcomeApplied}, out)
			require.Equal(t, storedState{true, "30", "3"}, readState(t, gb.client, gb.ks, zset("b", "m", 0, 0).Target))
			require.Equal(t, storedState{true, "eight", "8"}, readState(t, gb.client, gb.ks, doc("d", 0, "").Target))
			// The same in bulk (collections only), and against a value
			// stored before the batch.
			out = gb.apply(t,
				hash("b", "m", 1, "one"), hash("b", "m", 2, "two"), hash("b", "m", 2, "deux"), hash("b", "m", 2, "two"),
				zset("b", "m", 3, 30), zset("b", "m", 3, 33), zset("b", "m", 4, 40), zset("b", "m", 4, 40), zset("b", "m", 4, 44))
			require.Equal(t, []Outcome{OutcomeApplied, OutcomeApplied, OutcomeConflict, OutcomeDuplicate,
				OutcomeDuplicate, OutcomeConflict, OutcomeApplied, OutcomeDuplicate, OutcomeConflict}, out)
			require.Equal(t, storedState{true, "40", "4"}, readState(t, gb.client, gb.ks, zset("b", "m", 0, 0).Target))
			require.Equal(t, storedState{true, "two", "2"}, readState(t, gb.client, gb.ks, hash("b", "m", 0, "").Target))
		})

		t.Run("VersionsNearMaxInt64ComparedExactly", func(t *testing.T) {
			t.Parallel()
			gb := setupGate(t, b)
			// Above 2^53 neighbouring int64s are the same double: a gate
			// comparing Lua numbers would call these duplicates.
			const p53 = int64(1) << 53
			for _, pair := range [][2]int64{{p53, p53 + 1}, {math.MaxInt64 - 1, math.MaxInt64}, {999999999999999999, 1000000000000000000}, {9, 10}} {
				lo, hi := pair[0], pair[1]
				member := strconv.FormatInt(lo, 10)
				require.Equal(t, []Outcome{OutcomeApplied}, gb.apply(t, zset("big", member, lo, 1)))
				require.Equal(t, []Outcome{OutcomeApplied}, gb.apply(t, zset("big", member, hi, 2)), "%d after %d", hi, lo)
				require.Equal(t, []Outcome{OutcomeStale}, gb.apply(t, zset("big", member, lo, 3)), "%d after %d", lo, hi)
				require.Equal(t, []Outcome{OutcomeDuplicate}, gb.apply(t, zset("big", member, hi, 2)))
				require.Equal(t, storedState{true, "2", strconv.FormatInt(hi, 10)},
					readState(t, gb.client, gb.ks, zset("big", member, 0, 0).Target))
			}
			require.Equal(t, []Outcome{OutcomeApplied, OutcomeApplied, OutcomeStale},
				gb.apply(t, doc("max", math.MaxInt64-1, "a"), doc("max", math.MaxInt64, "b"), doc("max", math.MaxInt64-1, "c")))
		})

		t.Run("ScoreRange", func(t *testing.T) {
			t.Parallel()
			gb := setupGate(t, b)
			out := gb.apply(t, zset("s", "max", 1, MaxScore), zset("s", "min", 1, MinScore))
			require.Equal(t, []Outcome{OutcomeApplied, OutcomeApplied}, out)
			require.Equal(t, "9007199254740992", readState(t, gb.client, gb.ks, zset("s", "max", 0, 0).Target).value)
			require.Equal(t, "-9007199254740992", readState(t, gb.client, gb.ks, zset("s", "min", 0, 0).Target).value)

			for _, score := range []int64{MaxScore + 1, MinScore - 1, math.MaxInt64, math.MinInt64} {
				ok := zset("s", "ok", 1, 5)
				bad := zset("s", "bad", 1, score)
				_, err := gb.gate.Apply(context.Background(), []Write{ok, bad})
				require.ErrorIs(t, err, ErrScoreOutOfRange)
				var rangeErr *ScoreOutOfRangeError
				require.ErrorAs(t, err, &rangeErr)
				require.Equal(t, 1, rangeErr.Index)
				require.Equal(t, score, rangeErr.Score)
				require.Equal(t, bad.Target, rangeErr.Target)
				require.False(t, readState(t, gb.client, gb.ks, ok.Target).exists, "nothing is written")
			}
		})

		t.Run("InvalidWritesWriteNothing", func(t *testing.T) {
			t.Parallel()
			gb := setupGate(t, b)
			ok := hash("h", "ok", 1, "x")
			cases := []struct {
				bad  Write
				want error
			}{
				{hash("h", "f", 0, "x"), ErrInvalidVersion},
				{doc("d", -1, "x"), ErrInvalidVersion},
				{zset("z", "m", math.MinInt64, 1), ErrInvalidVersion},
				{Write{Target: Target{Kind: KindDocument, Name: "d", Member: "m"}, Version: 1}, ErrInvalidTarget},
				{Write{Target: Target{Name: "x"}, Version: 1}, ErrInvalidTarget},
				{Write{Target: Target{Kind: Kind(42), Name: "x"}, Version: 1}, ErrInvalidTarget},
			}
			for _, tc := range cases {
				_, err := gb.gate.Apply(context.Background(), []Write{ok, tc.bad})
				require.ErrorIs(t, err, tc.want, "%+v", tc.bad)
				if errors.Is(err, ErrInvalidVersion) {
					var verr *InvalidVersionError
					require.ErrorAs(t, err, &verr)
					require.Equal(t, 1, verr.Index)
					require.Equal(t, tc.bad.Version, verr.Version)
				}
				require.False(t, readState(t, gb.client, gb.ks, ok.Target).exists)
			}
			out, err := gb.gate.Apply(context.Background(), nil)
			require.NoError(t, err)
			require.Empty(t, out)
		})

		t.Run("HazardousIDsInOneBatch", func(t *testing.T) {
			t.Parallel()
			gb := setupGate(t, b)
			var writes []Write
			for i, id := range hazardIDs {
				v := int64(i + 1)
				writes = append(writes,
					zset("b:"+id, id, v, v),                 // many collections, hazardous member
					zset("board", id, v, v*100),             // one collection, every member
					hash(id, id, v, "hash-"+id),             // hazardous collection name
					hash(id, id+"2", v, "hash2-"+id),        // second field, same collection
					doc(id, v, "doc-"+id),                   // hazardous document id
					doc(id+"\x00\x01", v, "doc0-"+id),       // near-identical document id
					zset(id, "member", v, int64(len(id))+1)) // collection name = document id
			}
			out := gb.apply(t, writes...)
			for i, o := range out {
				require.Equal(t, OutcomeApplied, o, "write %d (%s)", i, writes[i].Target)
			}
			for _, w := range writes {
				require.Equal(t, storedState{true, valueOf(w), strconv.FormatInt(w.Version, 10)},
					readState(t, gb.client, gb.ks, w.Target), "%s", w.Target)
			}
			card, err := gb.client.ZCard(context.Background(), gb.ks.ValueKey(zset("board", "", 0, 0).Target)).Result()
			require.NoError(t, err)
			require.Equal(t, int64(len(hazardIDs)), card, "distinct members stay distinct")
			// A redelivery of the whole batch changes nothing.
			for i, o := range gb.apply(t, writes...) {
				require.Equal(t, OutcomeDuplicate, o, "write %d", i)
			}
		})

		t.Run("CorruptStoredVersionRefused", func(t *testing.T) {
			t.Parallel()
			gb := setupGate(t, b)
			ctx := context.Background()
			good := hash("h", "good", 1, "fine")
			bad := hash("h", "bad", 5, "new")
			badDoc := doc("d", 5, "new")
			require.NoError(t, gb.client.HSet(ctx, gb.ks.VersionKey(bad.Target), "bad", "007").Err())
			require.NoError(t, gb.client.Set(ctx, gb.ks.VersionKey(badDoc.Target), "1e3", 0).Err())
			out, err := gb.gate.Apply(ctx, []Write{bad, good, badDoc})
			require.ErrorIs(t, err, ErrCorruptVersion)
			var cerr *CorruptVersionError
			require.ErrorAs(t, err, &cerr)
			require.Equal(t, 0, cerr.Index)
			require.Equal(t, "007", cerr.Stored)
			require.Equal(t, []Outcome{OutcomeUnknown, OutcomeApplied, OutcomeUnknown}, out)
			require.Contains(t, err.Error(), `"1e3"`)
			// One *CorruptVersionError per refused write, each naming the
			// write's position in the batch, not in its slot group (on
			// Cluster and Ring the document is sent in a call of its own).
			joined, ok := err.(interface{ Unwrap() []error })
			require.True(t, ok, "the errors are joined: %v", err)
			got := map[int]CorruptVersionError{}
			for _, e := range joined.Unwrap() {
				var ce *CorruptVersionError
				require.ErrorAs(t, e, &ce)
				got[ce.Index] = *ce
			}
			require.Equal(t, map[int]CorruptVersionError{
				0: {Index: 0, Target: bad.Target, Stored: "007"},
				2: {Index: 2, Target: badDoc.Target, Stored: "1e3"},
			}, got)
			require.False(t, readState(t, gb.client, gb.ks, badDoc.Target).exists == true &&
				readState(t, gb.client, gb.ks, badDoc.Target).value == "new", "refused write stored nothing")
			v, err := gb.client.HGet(ctx, gb.ks.ValueKey(bad.Target), "bad").Result()
			require.ErrorIs(t, err, redis.Nil, "refused write stored nothing: %q", v)
		})

		t.Run("StoredVersionMustBePositiveInt64", func(t *testing.T) {
			t.Parallel()
			gb := setupGate(t, b)
			ctx := context.Background()
			storeVersion := func(w Write, stored string) {
				key := gb.ks.VersionKey(w.Target)
				if w.Target.Kind == KindDocument {
					require.NoError(t, gb.client.Set(ctx, key, stored, 0).Err())
					return
				}
				require.NoError(t, gb.client.HSet(ctx, key, w.Target.Member, stored).Err())
			}
			hasValue := func(w Write) bool {
				key := gb.ks.ValueKey(w.Target)
				switch w.Target.Kind {
				case KindDocument:
					return gb.client.Exists(ctx, key).Val() == 1
				case KindSortedSet:
					return gb.client.ZScore(ctx, key, w.Target.Member).Err() != redis.Nil
				}
				return gb.client.HExists(ctx, key, w.Target.Member).Val()
			}
			// Stored versions the gate could not have written are refused,
			// however they would compare: past int64 they would make every
			// later write stale, zero or negative would let any write in.
			// A document in a call sends it through the per-write loop;
			// collection writes alone are decided in bulk.
			for i, stored := range []string{"99999999999999999999", "9223372036854775808", "-7", "0", "+5", "00"} {
				n := strconv.Itoa(i)
				for _, call := range [][]Write{
					{hash("h", "m"+n, 5, "new"), doc("d"+n, 5, "new")},
					{hash("h", "c"+n, 5, "new"), zset("z", "c"+n, 5, 50)},
				} {
					for _, w := range call {
						storeVersion(w, stored)
					}
					out, err := gb.gate.Apply(ctx, call)
					require.ErrorIs(t, err, ErrCorruptVersion, "stored %q", stored)
					require.Equal(t, []Outcome{OutcomeUnknown, OutcomeUnknown}, out, "stored %q", stored)
					var cerr *CorruptVersionError
					require.ErrorAs(t, err, &cerr)
					require.Equal(t, stored, cerr.Stored)
					require.Equal(t, call[0].Target, cerr.Target)
					for _, w := range call {
						require.False(t, hasValue(w), "stored %q: refused write to %v stored a value", stored, w.Target)
					}
				}
			}
			// The largest int64 is still a version.
			top := zset("z", "top", math.MaxInt64, 1)
			require.NoError(t, gb.client.HSet(ctx, gb.ks.VersionKey(top.Target), "top", "9223372036854775807").Err())
			require.Equal(t, []Outcome{OutcomeDuplicate, OutcomeStale}, gb.apply(t, top, zset("z", "top", math.MaxInt64-1, 2)))
		})

		t.Run("RebuildDualWrite", func(t *testing.T) {
			t.Parallel()
			gb := setupGate(t, b)
			ctx := context.Background()
			before := zset("r", "a", 1, 10)
			gb.apply(t, before)
			require.False(t, readShadowState(t, gb.client, gb.ks, before.Target).exists, "no marker, no shadow write")

			require.NoError(t, gb.client.Set(ctx, gb.ks.RebuildMarkerKey("r", KindSortedSet), "token-1", 0).Err())
			// A copy under another rebuild's token (one that outlived its
			// marker) writes nothing.
			_, err := gb.gate.ApplyShadow(ctx, "token-0", []Write{zset("r", "b", 9, 90)})
			require.ErrorIs(t, err, ErrShadowNotOwned)
			require.False(t, readShadowState(t, gb.client, gb.ks, zset("r", "b", 0, 0).Target).exists)
			_, err = gb.gate.ApplyShadow(ctx, "bad token", []Write{zset("r", "b", 9, 90)})
			require.ErrorIs(t, err, ErrInvalidConfig)
			var ce *ConfigError
			require.ErrorAs(t, err, &ce)
			require.Equal(t, "token", ce.Field)
			// The rebuild has copied a newer version into the shadow already.
			out, err := gb.gate.ApplyShadow(ctx, "token-1", []Write{zset("r", "b", 7, 70)})
			require.NoError(t, err)
			require.Equal(t, []Outcome{OutcomeApplied}, out)
			require.False(t, readState(t, gb.client, gb.ks, zset("r", "b", 0, 0).Target).exists, "ApplyShadow leaves live keys alone")

			out = gb.apply(t, zset("r", "a", 2, 20), zset("r", "b", 6, 60), hash("r", "a", 1, "other kind"))
			require.Equal(t, []Outcome{OutcomeApplied, OutcomeApplied, OutcomeApplied}, out)
			require.Equal(t, storedState{true, "20", "2"}, readShadowState(t, gb.client, gb.ks, zset("r", "a", 0, 0).Target))
			require.Equal(t, storedState{true, "70", "7"}, readShadowState(t, gb.client, gb.ks, zset("r", "b", 0, 0).Target),
				"the shadow keeps its newer version: same rule, independent outcome")
			require.Equal(t, storedState{true, "60", "6"}, readState(t, gb.client, gb.ks, zset("r", "b", 0, 0).Target))
			require.False(t, readShadowState(t, gb.client, gb.ks, hash("r", "a", 0, "").Target).exists,
				"the marker of the sorted set does not affect the hash of the same name")

			out, err = gb.gate.ApplyShadow(ctx, "", []Write{zset("r", "a", 2, 20), zset("r", "a", 1, 10)})
			require.NoError(t, err)
			require.Equal(t, []Outcome{OutcomeDuplicate, OutcomeStale}, out)

			_, err = gb.gate.ApplyShadow(ctx, "", []Write{doc("d", 1, "x")})
			require.ErrorIs(t, err, ErrInvalidTarget)
		})

		// "By the same rule and independently": a write that is a
		// duplicate or stale in the live keys is still applied to a shadow
		// that lacks it or holds an older version.
		t.Run("RebuildDualWriteWhateverTheLiveOutcome", func(t *testing.T) {
			t.Parallel()
			gb := setupGate(t, b)
			ctx := context.Background()
			require.Equal(t, []Outcome{OutcomeApplied, OutcomeApplied}, gb.apply(t, zset("r", "m", 5, 50), zset("r", "n", 7, 70)))
			require.NoError(t, gb.client.Set(ctx, gb.ks.RebuildMarkerKey("r", KindSortedSet), "tok", 0).Err())
			_, err := gb.gate.ApplyShadow(ctx, "tok", []Write{zset("r", "n", 3, 30)}) // an older copy
			require.NoError(t, err)

			require.Equal(t, []Outcome{OutcomeDuplicate, OutcomeStale}, gb.apply(t, zset("r", "m", 5, 50), zset("r", "n", 6, 60)))
			require.Equal(t, storedState{true, "50", "5"}, readShadowState(t, gb.client, gb.ks, zset("r", "m", 0, 0).Target),
				"a live duplicate, new to the shadow")
			require.Equal(t, storedState{true, "60", "6"}, readShadowState(t, gb.client, gb.ks, zset("r", "n", 0, 0).Target),
				"live stale, newer than the shadow's")
		})

		// Every shadow write, copied or dual-written, counts the members
		// and versions it creates there (what the rebuild's switch checks
		// the shadow still holds): a newer version of a member the shadow
		// holds creates neither.
		t.Run("ShadowWritesCountWhatTheyCreate", func(t *testing.T) {
			t.Parallel()
			gb := setupGate(t, b)
			ctx := context.Background()
			require.NoError(t, gb.client.Set(ctx, gb.ks.RebuildMarkerKey("r", KindHash), "tok", 0).Err())
			count := func() map[string]string {
				t.Helper()
				m, err := gb.client.HGetAll(ctx, gb.ks.RebuildCopyKey("r", KindHash)).Result()
				require.NoError(t, err)
				delete(m, "batch") // the last copy batch counted
				return m
			}
			_, err := gb.gate.ApplyShadowCopy(ctx, "tok", 1, []Write{hash("r", "a", 1, "x"), hash("r", "b", 1, "y")})
			require.NoError(t, err)
			require.Equal(t, map[string]string{"rows": "2", "members": "2", "versions": "2"}, count())
			_, err = gb.gate.ApplyShadowCopy(ctx, "tok", 2, []Write{hash("r", "a", 2, "x2")})
			require.NoError(t, err)
			require.Equal(t, []Outcome{OutcomeApplied}, gb.apply(t, hash("r", "b", 2, "y2"))) // dual-written
			require.Equal(t, map[string]string{"rows": "3", "members": "2", "versions": "2"}, count(), "nothing created")
			require.Equal(t, []Outcome{OutcomeApplied}, gb.apply(t, hash("r", "c", 1, "z"))) // dual-written, new
			require.Equal(t, map[string]string{"rows": "3", "members": "3", "versions": "3"}, count())
		})

		// A rebuild's copy counts every write it sends (kept ones too) in
		// the same script, once per batch number; live writes dual-written
		// into the shadow keys, refused calls and uncounted shadow writes
		// leave the count alone.
		t.Run("RebuildCopyCount", func(t *testing.T) {
			t.Parallel()
			for _, n := range []int{0, 4} {
				t.Run(fmt.Sprintf("Buckets%d", n), func(t *testing.T) {
					t.Parallel()
					gb := setupGate(t, b).bucketed(t, n)
					ctx := context.Background()
					count := func(name string, kind Kind) map[string]string {
						t.Helper()
						m, err := gb.client.HGetAll(ctx, gb.ks.RebuildCopyKey(name, kind)).Result()
						require.NoError(t, err)
						delete(m, "members") // what shadow writes created: not rows
						delete(m, "versions")
						return m
					}
					for _, name := range []string{"c", "d"} {
						for _, kind := range []Kind{KindSortedSet, KindHash} {
							require.NoError(t, gb.client.Set(ctx, gb.ks.RebuildMarkerKey(name, kind), "tok", 0).Err())
						}
					}
					// A live write made during the rebuild, newer than the
					// copy's row: dual-written, not counted.
					gb.apply(t, zset("c", "a", 5, 50))
					require.Empty(t, count("c", KindSortedSet))

					// Two collections of two kinds in one batch (two slots
					// on Cluster and a Ring): each counts its own writes.
					batch := []Write{zset("c", "a", 1, 10), zset("c", "b", 1, 10), hash("c", "a", 1, "x"), zset("d", "a", 1, 10)}
					out, err := gb.gate.ApplyShadowCopy(ctx, "tok", 1, batch)
					require.NoError(t, err)
					require.Equal(t, []Outcome{OutcomeStale, OutcomeApplied, OutcomeApplied, OutcomeApplied}, out)
					require.Equal(t, map[string]string{"rows": "2", "batch": "1"}, count("c", KindSortedSet), "the stale row was sent: counted")
					require.Equal(t, map[string]string{"rows": "1", "batch": "1"}, count("c", KindHash))
					require.Equal(t, map[string]string{"rows": "1", "batch": "1"}, count("d", KindSortedSet))

					// The same batch again (a retry of a call that ran) and
					// an older one write, but do not count again.
					out, err = gb.gate.ApplyShadowCopy(ctx, "tok", 1, batch)
					require.NoError(t, err)
					require.Equal(t, []Outcome{OutcomeStale, OutcomeDuplicate, OutcomeDuplicate, OutcomeDuplicate}, out)
					require.Equal(t, "2", count("c", KindSortedSet)["rows"])
					out, err = gb.gate.ApplyShadowCopy(ctx, "tok", 2, []Write{zset("c", "e", 1, 1), zset("c", "f", 1, 1)})
					require.NoError(t, err)
					require.Equal(t, []Outcome{OutcomeApplied, OutcomeApplied}, out)
					require.Equal(t, map[string]string{"rows": "4", "batch": "2"}, count("c", KindSortedSet))
					_, err = gb.gate.ApplyShadowCopy(ctx, "tok", 1, []Write{zset("c", "g", 1, 1)})
					require.NoError(t, err)
					require.True(t, readShadowState(t, gb.client, gb.ks, zset("c", "g", 0, 0).Target).exists, "written all the same")
					require.Equal(t, map[string]string{"rows": "4", "batch": "2"}, count("c", KindSortedSet))
					// Batch numbers compare as numbers, not strings.
					_, err = gb.gate.ApplyShadowCopy(ctx, "tok", 10, []Write{zset("c", "h", 1, 1)})
					require.NoError(t, err)
					require.Equal(t, map[string]string{"rows": "5", "batch": "10"}, count("c", KindSortedSet))

					// Uncounted shadow writes, another rebuild's token and
					// invalid arguments leave the count alone.
					_, err = gb.gate.ApplyShadow(ctx, "tok", []Write{zset("c", "i", 1, 1)})
					require.NoError(t, err)
					_, err = gb.gate.ApplyShadowCopy(ctx, "other", 11, []Write{zset("c", "j", 1, 1)})
					require.ErrorIs(t, err, ErrShadowNotOwned)
					for _, bad := range []struct {
						token string
						batch int64
						field string
					}{{"", 11, "token"}, {"tok", 0, "batch"}, {"tok", -1, "batch"}, {"t k", 11, "token"}} {
						_, err = gb.gate.ApplyShadowCopy(ctx, bad.token, bad.batch, []Write{zset("c", "j", 1, 1)})
						require.ErrorIs(t, err, ErrInvalidConfig, "%+v", bad)
						var ce *ConfigError
						require.ErrorAs(t, err, &ce, "%+v", bad)
						require.Equal(t, bad.field, ce.Field, "%+v", bad)
					}
					_, err = gb.gate.ApplyShadowCopy(ctx, "tok", 11, []Write{doc("d", 1, "x")})
					require.ErrorIs(t, err, ErrInvalidTarget)
					require.Equal(t, map[string]string{"rows": "5", "batch": "10"}, count("c", KindSortedSet))
					require.False(t, readShadowState(t, gb.client, gb.ks, zset("c", "j", 0, 0).Target).exists)
				})
			}
		})

		t.Run("ConcurrentWritersHighestVersionWins", func(t *testing.T) {
			t.Parallel()
			gb := setupGate(t, b)
			const writers, keys, versions = 4, 20, 12
			// Every writer delivers every version of every key, in its own
			// random order, in batches of mixed keys.
			var wg sync.WaitGroup
			errs := make(chan error, writers)
			for w := 0; w < writers; w++ {
				wg.Add(1)
				go func(seed uint64) {
					defer wg.Done()
					var all []Write
					for k := 0; k < keys; k++ {
						for v := int64(1); v <= versions; v++ {
							all = append(all, zset("c"+strconv.Itoa(k%3), strconv.Itoa(k), v, v*7), doc("doc"+strconv.Itoa(k), v, "v"+strconv.FormatInt(v, 10)))
						}
					}
					r := rand.New(rand.NewPCG(seed, seed))
					r.Shuffle(len(all), func(i, j int) { all[i], all[j] = all[j], all[i] })
					for len(all) > 0 {
						n := min(len(all), 1+r.IntN(25))
						if _, err := gb.gate.Apply(context.Background(), all[:n]); err != nil {
							errs <- err
							return
						}
						all = all[n:]
					}
				}(uint64(w + 1))
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				require.NoError(t, err)
			}
			for k := 0; k < keys; k++ {
				require.Equal(t, storedState{true, strconv.Itoa(versions * 7), strconv.Itoa(versions)},
					readState(t, gb.client, gb.ks, zset("c"+strconv.Itoa(k%3), strconv.Itoa(k), 0, 0).Target))
				require.Equal(t, storedState{true, "v" + strconv.Itoa(versions), strconv.Itoa(versions)},
					readState(t, gb.client, gb.ks, doc("doc"+strconv.Itoa(k), 0, "").Target))
			}
		})

		// A batch of distinct members larger than one command's chunk of
		// the script, delivered again: every write, wherever it falls in a
		// chunk, is judged against its own stored version.
		t.Run("LargeBatchRedelivered", func(t *testing.T) {
			t.Parallel()
			gb := setupGate(t, b)
			const members = 2_345
			batch := make([]Write, 0, 2*members)
			for m := range members {
				member := "m" + strconv.Itoa(m)
				batch = append(batch, zset("redelivered", member, 5, int64(m)), hash("redelivered", member, 5, member))
			}
			for round, want := range []Outcome{OutcomeApplied, OutcomeDuplicate} {
				out, err := gb.gate.Apply(context.Background(), batch)
				require.NoError(t, err)
				for i, o := range out {
					require.Equal(t, want, o, "round %d, write %d", round, i)
				}
			}
			// Again with every third write's value changed: those, and only
			// those, are conflicts, wherever they fall in a chunk.
			changed := slices.Clone(batch)
			for i := 0; i < len(changed); i += 3 {
				if changed[i].Target.Kind == KindSortedSet {
					changed[i].Value.Score = -changed[i].Value.Score - 1
				} else {
					changed[i].Value.Data = append([]byte("x"), changed[i].Value.Data...)
				}
			}
			out, err := gb.gate.Apply(context.Background(), changed)
			require.NoError(t, err)
			for i, o := range out {
				want := OutcomeDuplicate
				if i%3 == 0 {
					want = OutcomeConflict
				}
				require.Equal(t, want, o, "write %d", i)
			}
			older := slices.Clone(batch)
			for i := range older {
				older[i].Version = 4
			}
			out, err = gb.gate.Apply(context.Background(), older)
			require.NoError(t, err)
			for i, o := range out {
				require.Equal(t, OutcomeStale, o, "write %d", i)
			}
		})

		// A batch near the relay's BatchSizeMax, every member written in
		// several versions: every outcome and final state right, with one
		// version hash and with buckets. (It also guards the script's bulk
		// form: it fails when a chunk boundary of the bulk writes is broken
		// on purpose; LargeBatchRedelivered, when one of the reads is.)
		t.Run("LargeBatchOfRepeatedMembers", func(t *testing.T) {
			t.Parallel()
			gb := setupGate(t, b)
			bucketed, err := gb.ks.WithVersionBuckets(8)
			require.NoError(t, err)
			for _, ks := range []Keyspace{gb.ks, bucketed} {
				gate := NewGate(gb.client, ks)
				name := fmt.Sprintf("large-%d", ks.buckets)
				const members, rounds = 1_500, 4 // 6,000 writes per kind
				var batch []Write
				for r := 1; r <= rounds; r++ {
					for m := 0; m < members; m++ {
						member := "m" + strconv.Itoa(m)
						batch = append(batch,
							zset(name, member, int64(r), int64(r*members+m)),
							hash(name, member, int64(r), fmt.Sprintf("%d/%d", m, r)))
					}
				}
				batch = append(batch, zset(name, "m0", 1, -1), zset(name, "m1", rounds, -1), zset(name, "m2", rounds, rounds*members+2))
				out, err := gate.Apply(context.Background(), batch)
				require.NoError(t, err)
				for i, o := range out[:len(out)-3] {
					require.Equal(t, OutcomeApplied, o, "write %d", i)
				}
				require.Equal(t, []Outcome{OutcomeStale, OutcomeConflict, OutcomeDuplicate}, out[len(out)-3:])
				for m := 0; m < members; m++ {
					member := "m" + strconv.Itoa(m)
					require.Equal(t, storedState{true, strconv.Itoa(rounds*members + m), strconv.Itoa(rounds)},
						readState(t, gb.client, ks, zset(name, member, 0, 0).Target), member)
					require.Equal(t, storedState{true, fmt.Sprintf("%d/%d", m, rounds), strconv.Itoa(rounds)},
						readState(t, gb.client, ks, hash(name, member, 0, "").Target), member)
				}
				card, err := gb.client.ZCard(context.Background(), ks.ValueKey(zset(name, "", 0, 0).Target)).Result()
				require.NoError(t, err)
				require.Equal(t, int64(members), card)
				// Redelivered whole: the last round is a duplicate, the rest stale.
				out, err = gate.Apply(context.Background(), batch[:len(batch)-3])
				require.NoError(t, err)
				for i, o := range out {
					want := OutcomeStale
					if i >= (rounds-1)*members*2 {
						want = OutcomeDuplicate
					}
					require.Equal(t, want, o, "write %d", i)
				}
			}
		})
	})
}

func TestGateZeroValue(t *testing.T) {
	t.Parallel()
	_, err := (&Gate{}).Apply(context.Background(), []Write{doc("d", 1, "x")})
	require.ErrorContains(t, err, "NewGate")
	var nilGate *Gate
	_, err = nilGate.Apply(context.Background(), nil)
	require.ErrorContains(t, err, "NewGate")
}

// TestGateRefusesZeroKeyspace: a Gate made with the zero Keyspace (no
// projector's; see Keyspace.IsZero) would write unprefixed root keys that
// no reconciler reads. NewGate returns no error, so every call refuses it
// with a *ConfigError naming the keyspace, and nothing is written.
func TestGateRefusesZeroKeyspace(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rd := testenv.Redis(t)
	name := rd.Prefix + "zero-keyspace" // unique: the keys would land outside the test's prefix
	w := Write{Target: Target{Kind: KindSortedSet, Name: name, Member: "m"}, Version: 1, Value: Value{Score: 1}}
	zero := Keyspace{}
	keys := []string{zero.ValueKey(w.Target), zero.VersionKey(w.Target), zero.LayoutKey(name, KindSortedSet)}
	t.Cleanup(func() { rd.Client.Del(context.WithoutCancel(ctx), keys...) })

	gate := NewGate(rd.Client, zero)
	for method, call := range map[string]func() error{
		"Apply":           func() error { _, err := gate.Apply(ctx, []Write{w}); return err },
		"ApplyShadow":     func() error { _, err := gate.ApplyShadow(ctx, "", []Write{w}); return err },
		"ApplyShadowCopy": func() error { _, err := gate.ApplyShadowCopy(ctx, "token", 1, []Write{w}); return err },
		// Even a call that is wrong in other ways too.
		"ApplyShadowOfDocument": func() error {
			_, err := gate.ApplyShadow(ctx, "", []Write{{Target: Target{Kind: KindDocument, Name: name, Member: "d"}, Version: 1}})
			return err
		},
		"ApplyShadowCopyWithoutToken": func() error { _, err := gate.ApplyShadowCopy(ctx, "", 0, []Write{w}); return err },
		"Load":                        func() error { return gate.Load(ctx) },
	} {
		err := call()
		require.ErrorIs(t, err, ErrInvalidConfig, method)
		var cfgErr *ConfigError
		require.ErrorAs(t, err, &cfgErr, method)
		require.Equal(t, "keyspace", cfgErr.Field, method)
	}
	n, err := rd.Client.Exists(ctx, keys...).Result()
	require.NoError(t, err)
	require.Zero(t, n, "a Gate with the zero Keyspace wrote %q", keys)
}

// TestGateOneScriptCallPerBatch counts EVALSHA calls on a private server: a
// batch over many collections and documents costs one call.
func TestGateOneScriptCallPerBatch(t *testing.T) {
	t.Parallel()
	srv := testenv.StartRedis(t)
	client := srv.Client(t)
	ctx := context.Background()
	ks, err := NewKeyspace("one:")
	require.NoError(t, err)
	gate := NewGate(client, ks)
	require.NoError(t, gate.Load(ctx))

	calls := func() int64 { return testenv.CommandCalls(t, client, "evalsha") }
	var writes []Write
	for i := 0; i < 100; i++ {
		writes = append(writes, zset("board"+strconv.Itoa(i%10), strconv.Itoa(i), 1, int64(i)), doc(strconv.Itoa(i), 1, "x"))
	}
	before := calls()
	out, err := gate.Apply(ctx, writes)
	require.NoError(t, err)
	require.Len(t, out, 200)
	require.Equal(t, before+1, calls())
}

// TestGateLoadReachesEveryRingShard: a Ring sends SCRIPT LOAD to one shard
// picked at random, so Load asks each shard itself.
func TestGateLoadReachesEveryRingShard(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	shards := map[string]*testenv.RedisServer{"a": testenv.StartRedis(t), "b": testenv.StartRedis(t), "c": testenv.StartRedis(t)}
	addrs := map[string]string{}
	for name, srv := range shards {
		addrs[name] = srv.Addr()
	}
	ring := redis.NewRing(&redis.RingOptions{Addrs: addrs, HeartbeatFn: func(context.Context, *redis.Client) bool { return true }})
	t.Cleanup(func() { _ = ring.Close() })
	ks, err := NewKeyspace("load:")
	require.NoError(t, err)
	gate := NewGate(ring, ks)
	require.NoError(t, gate.Load(ctx))
	for name, srv := range shards {
		loaded, err := srv.Client(t).ScriptExists(ctx, gate.script.Hash()).Result()
		require.NoError(t, err)
		require.Equal(t, []bool{true}, loaded, "shard %s", name)
	}
}

// TestGateClusterGroupsBySlot checks that a Cluster batch is split into
// exactly one script call per slot touched, and that those calls survive a
// flushed script cache (NOSCRIPT → EVAL fallback, pipelined).
func TestGateClusterGroupsBySlot(t *testing.T) {
	t.Parallel()
	c := testenv.SharedRedisCluster(t)
	client := c.Client(t)
	ks, err := NewKeyspace(c.Prefix(t))
	require.NoError(t, err)
	gate := NewGate(client, ks)
	ctx := context.Background()

	var writes []Write
	slots := map[int]bool{}
	for i := 0; i < 60; i++ {
		w := doc("doc-"+strconv.Itoa(i), 1, "x")
		if i%2 == 0 {
			w = zset("board-"+strconv.Itoa(i%7), strconv.Itoa(i), 1, int64(i))
		}
		writes = append(writes, w)
		slots[ks.Slot(w.Target)] = true
	}
	all := make([]int, len(writes))
	for i := range all {
		all[i] = i
	}
	groups := gate.group(modeLive, "", writes, all)
	require.Len(t, groups, len(slots))
	for _, grp := range groups {
		slot := KeySlot(grp.keys[0])
		for _, key := range grp.keys {
			require.Equal(t, slot, KeySlot(key), "one group, one slot")
		}
	}

	// A flushed script cache on every master: both the single-group path
	// (Script.Run) and the pipelined path must fall back to EVAL.
	require.NoError(t, client.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error {
		return m.ScriptFlush(ctx).Err()
	}))
	out, err := gate.Apply(ctx, writes)
	require.NoError(t, err)
	for i, o := range out {
		require.Equal(t, OutcomeApplied, o, "write %d", i)
	}
	require.NoError(t, client.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error {
		return m.ScriptFlush(ctx).Err()
	}))
	out, err = gate.Apply(ctx, writes[:1])
	require.NoError(t, err)
	require.Equal(t, []Outcome{OutcomeDuplicate}, out)
}
