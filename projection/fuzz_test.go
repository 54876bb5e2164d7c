package projection_test

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
	"github.com/verity-go/verity/projection"
)

// redisHashTag returns the part of key Redis Cluster hashes: the bytes
// between the first '{' and the next '}' when that span is non-empty, else
// the whole key. Written out here, independently of the package.
func redisHashTag(key string) string {
	open := strings.IndexByte(key, '{')
	if open < 0 {
		return key
	}
	end := strings.IndexByte(key[open+1:], '}')
	if end <= 0 {
		return key
	}
	return key[open+1 : open+1+end]
}

// allKeys returns every key the keyspace names for collection or document
// name, with the target they belong to.
func allKeys(ks projection.Keyspace, name, member string) map[string]projection.Target {
	keys := map[string]projection.Target{}
	for _, kind := range []projection.Kind{projection.KindSortedSet, projection.KindHash} {
		t := projection.Target{Kind: kind, Name: name, Member: member}
		for _, k := range []string{
			ks.ValueKey(t), ks.VersionKey(t), ks.RebuildMarkerKey(name, kind),
			ks.ShadowValueKey(name, kind), ks.ShadowVersionKey(name, kind), ks.RebuildCopyKey(name, kind),
		} {
			keys[k] = t
		}
	}
	doc := projection.Target{Kind: projection.KindDocument, Name: name}
	keys[ks.ValueKey(doc)] = doc
	keys[ks.VersionKey(doc)] = doc
	return keys
}

// FuzzKeyspace checks that no name or member can move a key to another
// Cluster slot or make two targets share a key: every key of a collection
// (values, versions, rebuild marker and copy count, shadows) and both keys
// of a document carry the target's hash tag, members never reach key
// names, and two different names never share any key.
func FuzzKeyspace(f *testing.F) {
	f.Add("verity:", "weekly", "alice", "weekly2")
	f.Add("", "", "", "%")
	f.Add("p:", "{", "}", "}")
	f.Add("p:", "a}b{c", "{x}", "a:b")
	f.Add("p{", "n", "m", "o")
	f.Add("p:", "%7B", "", "{")
	f.Fuzz(func(t *testing.T, prefix, name, member, other string) {
		ks, err := projection.NewKeyspace(prefix)
		if strings.ContainsAny(prefix, "{}") {
			require.Error(t, err, "a prefix with braces would become the hash tag")
			return
		}
		require.NoError(t, err)
		keys := allKeys(ks, name, member)
		require.Len(t, keys, 14, "the 14 keys of a name (6 per collection kind, 2 for a document) must be distinct")
		for key, target := range keys {
			require.True(t, strings.HasPrefix(key, prefix+ks.HashTag(target)), "key %q", key)
			require.Equal(t, ks.HashTag(target), "{"+redisHashTag(key)+"}", "key %q", key)
			require.Equal(t, ks.Slot(target), projection.KeySlot(key), "key %q", key)
			require.NotContains(t, redisHashTag(key), ":", "escaped tags never contain ':'")
		}
		// Members are values inside the structures, never part of a key.
		withOther := projection.Target{Kind: projection.KindSortedSet, Name: name, Member: other}
		require.Equal(t, ks.ValueKey(projection.Target{Kind: projection.KindSortedSet, Name: name}), ks.ValueKey(withOther))
		if other != name {
			for key := range allKeys(ks, other, member) {
				_, shared := keys[key]
				require.False(t, shared, "names %q and %q share key %q", name, other, key)
			}
		}
	})
}

// FuzzMappers feeds arbitrary records to the built-in mappers: none may
// panic, the sorted-set mapper accepts exactly the base-10 int64 payloads
// (anything else is ErrInvalidPayload), the others carry the payload
// verbatim, and an unknown stream is ErrUnmappedStream.
func FuzzMappers(f *testing.F) {
	f.Add("scores", "alice", int64(1), []byte("17"))
	f.Add("scores", "bob", int64(2), []byte("-3"))
	f.Add("scores", "", int64(0), []byte(""))
	f.Add("scores", "x", int64(-1), []byte("+5"))
	f.Add("scores", "x", int64(9), []byte("9223372036854775808"))
	f.Add("scores", "x", int64(9), []byte("1e3"))
	f.Add("scores", "x", int64(9), []byte(" 17"))
	f.Add("other", "{k}", int64(3), []byte("\x00\xff{}"))
	f.Fuzz(func(t *testing.T, stream, key string, version int64, payload []byte) {
		rec := outbox.Record{Message: outbox.Message{Stream: stream, Key: key, Version: version, Payload: payload}, ID: 1}
		want, parseErr := strconv.ParseInt(string(payload), 10, 64)
		w, err := projection.SortedSetMapper("board").Map(rec)
		if parseErr != nil {
			require.ErrorIs(t, err, projection.ErrInvalidPayload)
		} else {
			require.NoError(t, err)
			require.Equal(t, projection.Write{
				Target:  projection.Target{Kind: projection.KindSortedSet, Name: "board", Member: key},
				Version: version, Value: projection.Value{Score: want},
			}, w)
		}
		for _, m := range []projection.Mapper{projection.HashMapper("h"), projection.DocumentMapper("doc:")} {
			w, err := m.Map(rec)
			require.NoError(t, err)
			require.Equal(t, payload, w.Value.Data)
			require.Equal(t, version, w.Version)
		}
		sm := projection.StreamMapper{"scores": projection.SortedSetMapper("board")}
		_, err = sm.Map(rec)
		if stream != "scores" {
			require.ErrorIs(t, err, projection.ErrUnmappedStream)
		}
	})
}

// FuzzGateApply sends one arbitrary write through the gate of a real Redis:
// an invalid write (version, score, target) must return its typed error and
// leave the target's keys exactly as they were; a valid one must leave a
// stored version at least as high as its own, with its value when applied.
func FuzzGateApply(f *testing.F) {
	rd := testenv.Redis(f)
	ks, err := projection.NewKeyspace(rd.Prefix)
	require.NoError(f, err)
	gate := projection.NewGate(rd.Client, ks)
	f.Add(uint8(1), "board", "alice", int64(1), int64(10), []byte(nil))
	f.Add(uint8(1), "board", "alice", int64(0), int64(10), []byte(nil))
	f.Add(uint8(1), "board", "bob", int64(5), int64(1<<53+1), []byte(nil))
	f.Add(uint8(2), "h{}", "f:1", int64(3), int64(0), []byte("v"))
	f.Add(uint8(3), "doc{1}", "", int64(7), int64(0), []byte(`{"a":1}`))
	f.Add(uint8(3), "doc", "member-not-allowed", int64(7), int64(0), []byte("x"))
	f.Add(uint8(9), "n", "m", int64(1), int64(1), []byte("x"))
	// Equal versions after the seeds above: a conflict each, then a duplicate.
	f.Add(uint8(1), "board", "alice", int64(1), int64(11), []byte(nil))
	f.Add(uint8(2), "h{}", "f:1", int64(3), int64(0), []byte("w"))
	f.Add(uint8(3), "doc{1}", "", int64(7), int64(0), []byte(`{"a":2}`))
	f.Add(uint8(3), "doc{1}", "", int64(7), int64(0), []byte(`{"a":1}`))
	f.Fuzz(func(t *testing.T, kind uint8, name, member string, version, score int64, data []byte) {
		ctx := context.Background()
		w := projection.Write{
			Target:  projection.Target{Kind: projection.Kind(kind), Name: name, Member: member},
			Version: version, Value: projection.Value{Score: score, Data: data},
		}
		valueKey, versionKey := ks.ValueKey(w.Target), ks.VersionKey(w.Target)
		before := dumpKeys(t, rd.Client, valueKey, versionKey)
		prior := priorVersion(t, rd.Client, ks, w)
		held := heldValue(t, rd.Client, valueKey, w)
		outcomes, err := gate.Apply(ctx, []projection.Write{w})
		switch {
		case errors.Is(err, projection.ErrInvalidVersion), errors.Is(err, projection.ErrScoreOutOfRange),
			errors.Is(err, projection.ErrInvalidTarget):
			require.Equal(t, before, dumpKeys(t, rd.Client, valueKey, versionKey), "a refused write changed Redis")
			return
		case errors.Is(err, projection.ErrCorruptVersion):
			t.Fatalf("only this fuzz target writes these keys, through the gate: %v", err)
		}
		require.NoError(t, err)
		require.Len(t, outcomes, 1)
		require.Positive(t, version, "an accepted write has a positive version")
		if w.Target.Kind == projection.KindSortedSet {
			require.True(t, score >= projection.MinScore && score <= projection.MaxScore, "accepted score %d", score)
		}
		stored := storedVersion(t, rd.Client, ks, w)
		// The gate's whole rule: newer applies, equal is a duplicate (a
		// conflict when another value is held), older is stale, and only an
		// applied write changes Redis.
		switch {
		case version > prior:
			require.Equal(t, projection.OutcomeApplied, outcomes[0], "version %d over stored %d", version, prior)
			require.Equal(t, version, stored)
			requireProjected(t, rd.Client, valueKey, w)
		case version == prior:
			want := projection.OutcomeDuplicate
			if held.ok && held.value != valueString(w) {
				want = projection.OutcomeConflict
			}
			require.Equal(t, want, outcomes[0], "version %d equal to stored, value %q held, %q written", version, held.value, valueString(w))
			require.Equal(t, before, dumpKeys(t, rd.Client, valueKey, versionKey), "a duplicate or conflict changed Redis")
		default:
			require.Equal(t, projection.OutcomeStale, outcomes[0], "version %d under stored %d", version, prior)
			require.Equal(t, before, dumpKeys(t, rd.Client, valueKey, versionKey), "a stale write changed Redis")
		}
	})
}

// priorVersion reads the version the gate keeps for w's target, 0 when it
// keeps none.
func priorVersion(t *testing.T, c redis.UniversalClient, ks projection.Keyspace, w projection.Write) int64 {
	t.Helper()
	key := ks.VersionKey(w.Target)
	if key == "" {
		return 0
	}
	var n int64
	var err error
	if w.Target.Kind == projection.KindDocument {
		n, err = c.Exists(context.Background(), key).Result()
	} else {
		var ok bool
		ok, err = c.HExists(context.Background(), key, w.Target.Member).Result()
		if ok {
			n = 1
		}
	}
	require.NoError(t, err)
	if n == 0 {
		return 0
	}
	return storedVersion(t, c, ks, w)
}

// held is the value Redis holds for a write's target, in valueString's
// form; ok is false when it holds none.
type held struct {
	value string
	ok    bool
}

// heldValue reads the value Redis holds for w's target.
func heldValue(t *testing.T, c redis.UniversalClient, valueKey string, w projection.Write) held {
	t.Helper()
	ctx := context.Background()
	var (
		v   string
		err error
	)
	switch w.Target.Kind {
	case projection.KindSortedSet:
		var score float64
		score, err = c.ZScore(ctx, valueKey, w.Target.Member).Result()
		v = strconv.FormatFloat(score, 'f', -1, 64)
	case projection.KindHash:
		v, err = c.HGet(ctx, valueKey, w.Target.Member).Result()
	case projection.KindDocument:
		v, err = c.Get(ctx, valueKey).Result()
	default:
		return held{}
	}
	if errors.Is(err, redis.Nil) {
		return held{}
	}
	require.NoError(t, err)
	return held{v, true}
}

// valueString is w's value as heldValue reads it back once projected.
func valueString(w projection.Write) string {
	if w.Target.Kind == projection.KindSortedSet {
		return strconv.FormatFloat(float64(w.Value.Score), 'f', -1, 64)
	}
	return string(w.Value.Data)
}

// requireProjected checks that Redis holds w's value for its target.
func requireProjected(t *testing.T, c redis.UniversalClient, valueKey string, w projection.Write) {
	t.Helper()
	ctx := context.Background()
	switch w.Target.Kind {
	case projection.KindSortedSet:
		score, err := c.ZScore(ctx, valueKey, w.Target.Member).Result()
		require.NoError(t, err)
		// Scores within [MinScore, MaxScore] are exact as float64.
		require.Equal(t, w.Value.Score, int64(score), "projected score")
		require.Equal(t, float64(w.Value.Score), score, "projected score")
	case projection.KindHash:
		data, err := c.HGet(ctx, valueKey, w.Target.Member).Result()
		require.NoError(t, err)
		require.Equal(t, string(w.Value.Data), data, "projected field")
	case projection.KindDocument:
		data, err := c.Get(ctx, valueKey).Result()
		require.NoError(t, err)
		require.Equal(t, string(w.Value.Data), data, "projected document")
	default:
		t.Fatalf("kind %v was applied", w.Target.Kind)
	}
}

// dumpKeys returns the contents of keys (type, then entries in a fixed
// order) for before/after comparisons. Not DUMP: a hash or sorted set kept
// as a hash table serialises in the table's order, which Redis changes on
// its own (incremental rehashing, resizing) without any write.
func dumpKeys(t *testing.T, c redis.UniversalClient, keys ...string) []string {
	t.Helper()
	ctx := context.Background()
	out := make([]string, len(keys))
	for i, k := range keys {
		if k == "" {
			continue
		}
		typ, err := c.Type(ctx, k).Result()
		require.NoError(t, err)
		var entries []string
		switch typ {
		case "none":
		case "string":
			v, err := c.Get(ctx, k).Result()
			require.NoError(t, err)
			entries = []string{v}
		case "hash":
			m, err := c.HGetAll(ctx, k).Result()
			require.NoError(t, err)
			for f, v := range m {
				entries = append(entries, strconv.Quote(f)+"="+strconv.Quote(v))
			}
		case "zset":
			zs, err := c.ZRangeWithScores(ctx, k, 0, -1).Result()
			require.NoError(t, err)
			for _, z := range zs {
				entries = append(entries, strconv.Quote(z.Member.(string))+"="+strconv.FormatFloat(z.Score, 'g', -1, 64))
			}
		default:
			t.Fatalf("key %q has type %s, which the gate never writes", k, typ)
		}
		slices.Sort(entries)
		out[i] = typ + ":" + strings.Join(entries, ",")
	}
	return out
}

// storedVersion reads the version the gate keeps for w's target.
func storedVersion(t *testing.T, c redis.UniversalClient, ks projection.Keyspace, w projection.Write) int64 {
	t.Helper()
	var raw string
	var err error
	if w.Target.Kind == projection.KindDocument {
		raw, err = c.Get(context.Background(), ks.VersionKey(w.Target)).Result()
	} else {
		raw, err = c.HGet(context.Background(), ks.VersionKey(w.Target), w.Target.Member).Result()
	}
	require.NoError(t, err)
	v, err := strconv.ParseInt(raw, 10, 64)
	require.NoError(t, err, "stored version %q", raw)
	return v
}
