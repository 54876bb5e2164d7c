package projection

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/lograte"
	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
)

type projectorBundle struct {
	client    redis.UniversalClient
	projector *RedisProjector
	ks        Keyspace
}

// testMapper routes the three demo streams to the built-in mappers.
func testMapper() Mapper {
	return StreamMapper{
		"scores":   SortedSetMapper("board"),
		"profiles": HashMapper("profiles"),
		"orders":   DocumentMapper("order:"),
	}
}

func setupProjector(t *testing.T, b backend) *projectorBundle {
	t.Helper()
	client, prefix := b.connect(t)
	p, err := NewRedisProjector(client, testMapper(), &Config{Prefix: prefix})
	require.NoError(t, err)
	return &projectorBundle{client: client, projector: p, ks: p.Keyspace()}
}

var recordSeq atomic.Int64

func record(stream, key string, version int64, payload string) outbox.Record {
	return outbox.Record{
		Message: outbox.Message{EventID: uuid.New(), Stream: stream, Key: key, Version: version, Payload: []byte(payload)},
		ID:      recordSeq.Add(1), Attempts: 1,
	}
}

func TestRedisProjector(t *testing.T) {
	t.Parallel()

	forEachBackend(t, func(t *testing.T, b backend) {
		t.Run("ProjectAllKindsAndRedelivery", func(t *testing.T) {
			t.Parallel()
			pb := setupProjector(t, b)
			ctx := context.Background()
			batch := []outbox.Record{
				record("scores", "alice", 1, "10"),
				record("scores", "bob{x}", 1, "25"),
				record("profiles", "alice", 3, `{"name":"Alice"}`),
				record("orders", "41:a", 2, `{"total":4400}`),
				record("scores", "alice", 2, "17"),
			}
			out, err := pb.projector.Project(ctx, batch)
			require.NoError(t, err)
			require.Equal(t, []Outcome{OutcomeApplied, OutcomeApplied, OutcomeApplied, OutcomeApplied, OutcomeApplied}, out)

			board := pb.ks.ValueKey(Target{Kind: KindSortedSet, Name: "board"})
			ranking, err := pb.client.ZRevRangeWithScores(ctx, board, 0, -1).Result()
			require.NoError(t, err)
			require.Equal(t, []redis.Z{{Score: 25, Member: "bob{x}"}, {Score: 17, Member: "alice"}}, ranking)
			require.Equal(t, storedState{true, `{"name":"Alice"}`, "3"},
				readState(t, pb.client, pb.ks, Target{Kind: KindHash, Name: "profiles", Member: "alice"}))
			require.Equal(t, storedState{true, `{"total":4400}`, "2"},
				readState(t, pb.client, pb.ks, Target{Kind: KindDocument, Name: "order:41:a"}))

			// Redelivery of the whole batch: every record whose version is
			// stored again is a duplicate; alice v1 is now stale.
			out, err = pb.projector.Project(ctx, batch)
			require.NoError(t, err)
			require.Equal(t, []Outcome{OutcomeStale, OutcomeDuplicate, OutcomeDuplicate, OutcomeDuplicate, OutcomeDuplicate}, out)
			again, err := pb.client.ZRevRangeWithScores(ctx, board, 0, -1).Result()
			require.NoError(t, err)
			require.Equal(t, ranking, again)

			results, err := pb.projector.Handle(ctx, batch)
			require.NoError(t, err)
			require.Len(t, results, len(batch))
			for _, r := range results {
				require.NoError(t, r.Err)
			}
		})

		t.Run("ProjectRefusesBadBatchAndWritesNothing", func(t *testing.T) {
			t.Parallel()
			pb := setupProjector(t, b)
			ctx := context.Background()
			good := record("scores", "carol", 1, "5")
			for _, tc := range []struct {
				name string
				bad  outbox.Record
				want error
			}{
				{"UnmappedStream", record("unknown", "k", 1, "1"), ErrUnmappedStream},
				{"BadScorePayload", record("scores", "k", 1, "12.5"), ErrInvalidPayload},
				{"ScoreOutOfRange", record("scores", "k", 1, strconv.FormatInt(MaxScore+1, 10)), ErrScoreOutOfRange},
				{"ZeroVersion", record("orders", "k", 0, "{}"), ErrInvalidVersion},
			} {
				out, err := pb.projector.Project(ctx, []outbox.Record{good, tc.bad})
				require.ErrorIs(t, err, tc.want, tc.name)
				require.Nil(t, out)
				var mapErr *MapError
				require.ErrorAs(t, err, &mapErr, tc.name)
				require.Equal(t, 1, mapErr.Index)
				require.Equal(t, tc.bad.ID, mapErr.RecordID)
				require.Equal(t, tc.bad.Stream, mapErr.Stream)
				// The text a relay logs and stores as the row's last error
				// names the package once, though Err is one of its own.
				require.True(t, strings.HasPrefix(err.Error(), fmt.Sprintf("projection: record 1 (outbox id %d, stream %q): ", tc.bad.ID, tc.bad.Stream)), "%s: %q", tc.name, err.Error())
				require.Equal(t, 1, strings.Count(err.Error(), "projection: "), "%s: %q", tc.name, err.Error())
			}
			require.False(t, readState(t, pb.client, pb.ks, Target{Kind: KindSortedSet, Name: "board", Member: "carol"}).exists)
		})

		t.Run("HandleIsolatesBadRecords", func(t *testing.T) {
			t.Parallel()
			pb := setupProjector(t, b)
			ctx := context.Background()
			corrupt := Target{Kind: KindHash, Name: "profiles", Member: "dave"}
			require.NoError(t, pb.client.HSet(ctx, pb.ks.VersionKey(corrupt), "dave", "not-a-number").Err())
			batch := []outbox.Record{
				record("scores", "erin", 1, "7"),
				record("scores", "frank", 1, "seven"),
				record("profiles", "dave", 1, "{}"),
				record("elsewhere", "x", 1, ""),
				record("orders", "9", 1, "{}"),
			}
			results, err := pb.projector.Handle(ctx, batch)
			require.NoError(t, err)
			require.Len(t, results, len(batch))
			require.NoError(t, results[0].Err)
			require.ErrorIs(t, results[1].Err, ErrInvalidPayload)
			require.ErrorIs(t, results[2].Err, ErrCorruptVersion)
			var cerr *CorruptVersionError
			require.ErrorAs(t, results[2].Err, &cerr)
			require.Equal(t, 2, cerr.Index, "the index is the record's position in the batch")
			require.Equal(t, "not-a-number", cerr.Stored)
			require.ErrorIs(t, results[3].Err, ErrUnmappedStream)
			require.NoError(t, results[4].Err)
			require.Equal(t, "7", readState(t, pb.client, pb.ks, Target{Kind: KindSortedSet, Name: "board", Member: "erin"}).value)
			require.True(t, readState(t, pb.client, pb.ks, Target{Kind: KindDocument, Name: "order:9"}).exists)

			out, err := pb.projector.Project(ctx, []outbox.Record{batch[0], batch[2]})
			require.ErrorIs(t, err, ErrCorruptVersion)
			require.Equal(t, []Outcome{OutcomeDuplicate, OutcomeUnknown}, out)
		})

		t.Run("HandleIsolatesLayoutMismatch", func(t *testing.T) {
			t.Parallel()
			pb := setupProjector(t, b)
			ctx := context.Background()
			// A deployment configured with 16 buckets created the board.
			bucketed, err := NewRedisProjector(pb.client, testMapper(), &Config{Prefix: pb.ks.Prefix(), VersionBuckets: 16})
			require.NoError(t, err)
			results, err := bucketed.Handle(ctx, []outbox.Record{record("scores", "alice", 1, "10")})
			require.NoError(t, err)
			require.NoError(t, results[0].Err)

			batch := []outbox.Record{
				record("orders", "41", 1, `{"total":1}`),
				record("scores", "bob", 1, "5"),
				record("profiles", "bob", 1, "{}"),
				record("scores", "alice", 2, "20"),
				record("orders", "42", 1, `{"total":2}`),
			}
			results, err = pb.projector.Handle(ctx, batch)
			require.NoError(t, err, "a layout mismatch fails the collection's records, not the batch")
			require.Len(t, results, len(batch))
			for _, i := range []int{1, 3} {
				require.ErrorIs(t, results[i].Err, ErrLayoutMismatch, "record %d", i)
				var lm *LayoutMismatchError
				require.ErrorAs(t, results[i].Err, &lm)
				require.Equal(t, LayoutMismatchError{Kind: KindSortedSet, Name: "board", Stored: 16, Configured: 0}, *lm)
			}
			for _, i := range []int{0, 2, 4} {
				require.NoError(t, results[i].Err, "record %d", i)
			}
			require.Equal(t, storedState{true, `{"total":1}`, "1"}, readState(t, pb.client, pb.ks, Target{Kind: KindDocument, Name: "order:41"}))
			require.Equal(t, storedState{true, `{"total":2}`, "1"}, readState(t, pb.client, pb.ks, Target{Kind: KindDocument, Name: "order:42"}))
			require.Equal(t, storedState{true, "{}", "1"}, readState(t, pb.client, pb.ks, Target{Kind: KindHash, Name: "profiles", Member: "bob"}))
			bks := bucketed.Keyspace()
			require.Equal(t, storedState{true, "10", "1"}, readState(t, pb.client, bks, Target{Kind: KindSortedSet, Name: "board", Member: "alice"}))
			require.False(t, readState(t, pb.client, bks, Target{Kind: KindSortedSet, Name: "board", Member: "bob"}).exists)

			// Project keeps its batch contract: the mismatch is the call's error.
			out, err := pb.projector.Project(ctx, batch)
			require.ErrorIs(t, err, ErrLayoutMismatch)
			require.Nil(t, out)
		})

		// A foreign value in the layout key is an unreadable layout for the
		// collection's records only, however it would split or trim.
		t.Run("HandleIsolatesUnreadableLayout", func(t *testing.T) {
			t.Parallel()
			for name, stored := range map[string]string{"Empty": "", "TwoFields": "1 2", "TrailingSpace": "0 ", "Letter": "x", "TrailingNewline": "0\n"} {
				t.Run(name, func(t *testing.T) {
					t.Parallel()
					pb := setupProjector(t, b)
					ctx := context.Background()
					layout := pb.ks.LayoutKey("board", KindSortedSet)
					require.NoError(t, pb.client.Set(ctx, layout, stored, 0).Err())
					batch := []outbox.Record{
						record("orders", "41", 1, `{"total":1}`),
						record("scores", "bob", 1, "5"),
						record("profiles", "bob", 1, "{}"),
						record("scores", "carol", 1, "6"),
					}
					results, err := pb.projector.Handle(ctx, batch)
					require.NoError(t, err, "an unreadable layout fails the collection's records, not the batch")
					require.Len(t, results, len(batch))
					for _, i := range []int{1, 3} {
						var lm *LayoutMismatchError
						require.ErrorAs(t, results[i].Err, &lm, "record %d", i)
						require.Equal(t, LayoutMismatchError{Kind: KindSortedSet, Name: "board", Stored: -1, Configured: 0}, *lm)
						require.False(t, readState(t, pb.client, pb.ks, Target{Kind: KindSortedSet, Name: "board", Member: batch[i].Key}).exists)
					}
					require.NoError(t, results[0].Err)
					require.NoError(t, results[2].Err)
					require.Equal(t, storedState{true, `{"total":1}`, "1"}, readState(t, pb.client, pb.ks, Target{Kind: KindDocument, Name: "order:41"}))
					require.Equal(t, storedState{true, "{}", "1"}, readState(t, pb.client, pb.ks, Target{Kind: KindHash, Name: "profiles", Member: "bob"}))
					require.Equal(t, stored, pb.client.Get(ctx, layout).Val(), "the layout key is left for a person to fix")
				})
			}
		})

		t.Run("HandleIsolatesWrongKeyType", func(t *testing.T) {
			t.Parallel()
			pb := setupProjector(t, b)
			ctx := context.Background()
			// The board has versions (else values alone would read as a lost
			// layout key), but its value key holds another type.
			_, err := pb.projector.Project(ctx, []outbox.Record{record("scores", "f", 1, "1")})
			require.NoError(t, err)
			board := pb.ks.ValueKey(Target{Kind: KindSortedSet, Name: "board"})
			require.NoError(t, pb.client.Set(ctx, board, "not a sorted set", 0).Err())
			batch := []outbox.Record{
				record("elsewhere", "x", 1, ""),          // unmapped: the writes' positions are not the records'
				record("orders", "40", 1, `{"total":0}`), // before the bad key: applied when the script failed
				record("scores", "g", 1, "1"),
				record("profiles", "g", 1, "{}"),
				record("scores", "h", 1, "2"),
				record("orders", "41", 1, `{"total":1}`),
			}
			results, err := pb.projector.Handle(ctx, batch)
			require.NoError(t, err, "a key of another type fails its records, not the batch")
			require.Len(t, results, len(batch))
			require.ErrorIs(t, results[0].Err, ErrUnmappedStream)
			for _, i := range []int{2, 4} {
				require.ErrorIs(t, results[i].Err, ErrWrongKeyType, "record %d", i)
				var wt *WrongKeyTypeError
				require.ErrorAs(t, results[i].Err, &wt)
				require.Equal(t, i, wt.Index, "the index is the record's position in the batch")
				require.Equal(t, Target{Kind: KindSortedSet, Name: "board", Member: batch[i].Key}, wt.Target)
				require.Contains(t, wt.Error(), "WRONGTYPE")
			}
			for _, i := range []int{1, 3, 5} {
				require.NoError(t, results[i].Err, "record %d", i)
			}
			require.Equal(t, storedState{true, `{"total":0}`, "1"}, readState(t, pb.client, pb.ks, Target{Kind: KindDocument, Name: "order:40"}))
			require.Equal(t, storedState{true, `{"total":1}`, "1"}, readState(t, pb.client, pb.ks, Target{Kind: KindDocument, Name: "order:41"}))
			require.Equal(t, storedState{true, "{}", "1"}, readState(t, pb.client, pb.ks, Target{Kind: KindHash, Name: "profiles", Member: "g"}))
			require.Equal(t, "not a sorted set", pb.client.Get(ctx, board).Val(), "the bad key is left for a human")

			// Project keeps its batch contract: Redis's error is the call's.
			out, err := pb.projector.Project(ctx, batch[1:])
			require.Error(t, err)
			require.NotErrorIs(t, err, ErrWrongKeyType)
			require.Contains(t, err.Error(), "WRONGTYPE")
			require.Nil(t, out)
		})

		// A document's value key of another type is refused as a
		// collection's is, and kept: SET alone would replace it.
		t.Run("HandleIsolatesDocumentOfAnotherType", func(t *testing.T) {
			t.Parallel()
			pb := setupProjector(t, b)
			ctx := context.Background()
			order := pb.ks.ValueKey(Target{Kind: KindDocument, Name: "order:41"})
			require.NoError(t, pb.client.RPush(ctx, order, "another program's list").Err())
			batch := []outbox.Record{
				record("orders", "40", 1, `{"total":0}`),
				record("orders", "41", 1, `{"total":1}`),
				record("scores", "g", 1, "1"),
			}
			results, err := pb.projector.Handle(ctx, batch)
			require.NoError(t, err)
			require.Len(t, results, len(batch))
			var wt *WrongKeyTypeError
			require.ErrorAs(t, results[1].Err, &wt)
			require.Equal(t, Target{Kind: KindDocument, Name: "order:41"}, wt.Target)
			require.NoError(t, results[0].Err)
			require.NoError(t, results[2].Err)
			require.Equal(t, "list", pb.client.Type(ctx, order).Val(), "the foreign key is kept")
			require.Equal(t, []string{"another program's list"}, pb.client.LRange(ctx, order, 0, -1).Val())
			require.Zero(t, pb.client.Exists(ctx, pb.ks.VersionKey(Target{Kind: KindDocument, Name: "order:41"})).Val(), "no version written")
			require.Equal(t, storedState{true, `{"total":0}`, "1"}, readState(t, pb.client, pb.ks, Target{Kind: KindDocument, Name: "order:40"}))

			_, err = pb.projector.Project(ctx, batch[1:2])
			require.ErrorContains(t, err, "WRONGTYPE", "Project: Redis's error is the call's")
			require.Equal(t, "list", pb.client.Type(ctx, order).Val())
		})

		// A layout key of another type (a hand edit) fails the script
		// before its first write, for the whole slot group: Handle sends
		// the group's writes again one by one, so only the collection's
		// own records fail (*WrongKeyTypeError) and the rest are applied.
		t.Run("HandleIsolatesLayoutKeyOfAnotherType", func(t *testing.T) {
			t.Parallel()
			pb := setupProjector(t, b)
			ctx := context.Background()
			layout := pb.ks.LayoutKey("board", KindSortedSet)
			require.NoError(t, pb.client.HSet(ctx, layout, "buckets", "0").Err())
			batch := []outbox.Record{
				record("orders", "41", 1, `{"total":1}`),
				record("scores", "bob", 1, "5"),
				record("profiles", "bob", 1, "{}"),
				record("scores", "carol", 1, "6"),
				record("orders", "42", 1, `{"total":2}`),
			}
			results, err := pb.projector.Handle(ctx, batch)
			require.NoError(t, err, "a key of another type fails its records, not the batch")
			require.Len(t, results, len(batch))
			for _, i := range []int{1, 3} {
				require.ErrorIs(t, results[i].Err, ErrWrongKeyType, "record %d", i)
				var wt *WrongKeyTypeError
				require.ErrorAs(t, results[i].Err, &wt)
				require.Equal(t, i, wt.Index, "the index is the record's position in the batch")
				require.Equal(t, Target{Kind: KindSortedSet, Name: "board", Member: batch[i].Key}, wt.Target)
				require.False(t, readState(t, pb.client, pb.ks, wt.Target).exists, "record %d: nothing written", i)
			}
			for _, i := range []int{0, 2, 4} {
				require.NoError(t, results[i].Err, "record %d", i)
			}
			require.Equal(t, storedState{true, `{"total":1}`, "1"}, readState(t, pb.client, pb.ks, Target{Kind: KindDocument, Name: "order:41"}))
			require.Equal(t, storedState{true, `{"total":2}`, "1"}, readState(t, pb.client, pb.ks, Target{Kind: KindDocument, Name: "order:42"}))
			require.Equal(t, storedState{true, "{}", "1"}, readState(t, pb.client, pb.ks, Target{Kind: KindHash, Name: "profiles", Member: "bob"}))
			require.Equal(t, "hash", pb.client.Type(ctx, layout).Val(), "the bad key is left for a human")

			// Project keeps its batch contract: Redis's error is the call's.
			out, err := pb.projector.Project(ctx, batch)
			require.ErrorContains(t, err, "WRONGTYPE")
			require.NotErrorIs(t, err, ErrWrongKeyType)
			require.Nil(t, out)
		})

		t.Run("CancelledContextFailsTheBatch", func(t *testing.T) {
			t.Parallel()
			pb := setupProjector(t, b)
			cancelled, cancel := context.WithCancel(context.Background())
			cancel()
			batch := []outbox.Record{record("orders", "h", 1, "{}"), record("scores", "h", 1, "1")}
			_, err := pb.projector.Project(cancelled, batch)
			require.ErrorIs(t, err, context.Canceled)
			// Handle fails every record with its slot group's call.
			results, err := pb.projector.Handle(cancelled, batch)
			require.NoError(t, err)
			require.Len(t, results, len(batch))
			for i := range results {
				require.ErrorIs(t, results[i].Err, context.Canceled, "record %d", i)
			}
		})
	})
}

func TestNewRedisProjector(t *testing.T) {
	t.Parallel()
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialled
	t.Cleanup(func() { _ = client.Close() })

	// Absent dependencies, typed nils included, are refused up front, not
	// met as a nil dereference on the first batch.
	var noClient *redis.Client
	for name, tc := range map[string]struct {
		client redis.UniversalClient
		mapper Mapper
		field  string
	}{
		"NilClient":      {nil, testMapper(), "client"},
		"TypedNilClient": {noClient, testMapper(), "client"},
		"NilMapper":      {client, nil, "mapper"},
		"NilMapperFunc":  {client, MapperFunc(nil), "mapper"},
	} {
		_, err := NewRedisProjector(tc.client, tc.mapper, nil)
		require.ErrorIs(t, err, ErrInvalidConfig, name)
		var cfgErr *ConfigError
		require.ErrorAs(t, err, &cfgErr, name)
		require.Equal(t, tc.field, cfgErr.Field, name)
	}
	_, err := NewRedisProjector(client, StreamMapper(nil), nil)
	require.NoError(t, err, "a nil StreamMapper maps no stream, and is a Mapper")
	// A StreamMapper entry that is absent, typed nils included, would
	// fail every record of its stream; refused up front, naming it.
	// A nested StreamMapper routes by the same stream name: one that
	// routes the stream to nothing, or never stops nesting, is as absent.
	cycle := StreamMapper{}
	cycle["bad"] = cycle
	for name, entry := range map[string]Mapper{
		"NilEntry": nil, "NilMapperFuncEntry": MapperFunc(nil),
		"NestedNilStreamMapper": StreamMapper(nil), "NestedWithoutTheStream": StreamMapper{"good": HashMapper("h")},
		"NestedTypedNil": StreamMapper{"bad": MapperFunc(nil)}, "Cycle": cycle,
	} {
		_, err := NewRedisProjector(client, StreamMapper{"good": HashMapper("h"), "bad": entry}, nil)
		require.ErrorIs(t, err, ErrInvalidConfig, name)
		var cfgErr *ConfigError
		require.ErrorAs(t, err, &cfgErr, name)
		require.Equal(t, "mapper", cfgErr.Field, name)
		require.Contains(t, cfgErr.Reason, `stream "bad"`, name)
	}
	ks, err := NewKeyspace("gate:")
	require.NoError(t, err)
	_, err = NewGate(noClient, ks).Apply(context.Background(), nil)
	require.ErrorIs(t, err, ErrInvalidConfig, "a Gate without a client")
	_, err = NewRedisProjector(client, testMapper(), &Config{Prefix: "bad{"})
	require.ErrorContains(t, err, "Config.Prefix")

	p, err := NewRedisProjector(client, testMapper(), nil)
	require.NoError(t, err)
	require.Equal(t, PrefixDefault, p.Keyspace().Prefix())
	require.Same(t, p.Gate(), p.Gate())

	cfg := &Config{Prefix: "x:"}
	d := cfg.WithDefaults()
	require.Equal(t, "x:", d.Prefix)
	require.NotNil(t, d.Logger)
	require.Nil(t, cfg.Logger, "WithDefaults returns a copy")
	require.Equal(t, MaxValueBytesDefault, d.MaxValueBytes)
	require.Equal(t, 7, (&Config{MaxValueBytes: 7}).WithDefaults().MaxValueBytes)
	_, err = NewRedisProjector(client, testMapper(), &Config{MaxValueBytes: -1})
	var cfgErr *ConfigError
	require.ErrorAs(t, err, &cfgErr)
	require.Equal(t, "Config.MaxValueBytes", cfgErr.Field)
}

// TestNewRedisProjectorNeedsBoundedCommands: go-redis does not abort a
// command in flight when its context is cancelled, so a client without a
// read or write timeout would let a stalled Redis hold Handle, and with it
// the relay's shutdown, forever.
func TestNewRedisProjectorNeedsBoundedCommands(t *testing.T) {
	t.Parallel()
	rd := testenv.Redis(t)
	opt, err := redis.ParseURL(rd.URL)
	require.NoError(t, err)
	single := func(read, write time.Duration, ctxTimeout bool) redis.UniversalClient {
		o := *opt
		o.ReadTimeout, o.WriteTimeout, o.ContextTimeoutEnabled = read, write, ctxTimeout
		c := redis.NewClient(&o)
		t.Cleanup(func() { _ = c.Close() })
		return c
	}
	cluster := func(read, write time.Duration, ctxTimeout bool) redis.UniversalClient {
		c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{opt.Addr}, Username: opt.Username, Password: opt.Password,
			ReadTimeout: read, WriteTimeout: write, ContextTimeoutEnabled: ctxTimeout})
		t.Cleanup(func() { _ = c.Close() })
		return c
	}
	ring := func(read, write time.Duration, ctxTimeout bool) redis.UniversalClient {
		c := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": opt.Addr}, Username: opt.Username, Password: opt.Password, DB: opt.DB,
			HeartbeatFn: func(context.Context, *redis.Client) bool { return true },
			ReadTimeout: read, WriteTimeout: write, ContextTimeoutEnabled: ctxTimeout})
		t.Cleanup(func() { _ = c.Close() })
		return c
	}

	t.Run("NoTimeoutRefused", func(t *testing.T) {
		t.Parallel()
		for name, tc := range map[string]struct {
			client redis.UniversalClient
			field  string
		}{
			"NoReadTimeout":          {single(-1, 0, false), "Options.ReadTimeout"},
			"NoReadDeadline":         {single(-2, time.Second, false), "Options.ReadTimeout"},
			"NoWriteTimeout":         {single(time.Second, -1, false), "Options.WriteTimeout"},
			"ClusterNoReadTimeout":   {cluster(-1, 0, false), "ClusterOptions.ReadTimeout"},
			"ClusterNoWriteDeadline": {cluster(0, -2, false), "ClusterOptions.WriteTimeout"},
			"RingNoReadTimeout":      {ring(-1, 0, false), "RingOptions.ReadTimeout"},
			"RingNoWriteTimeout":     {ring(0, -1, false), "RingOptions.WriteTimeout"},
		} {
			_, err := NewRedisProjector(tc.client, testMapper(), &Config{Prefix: rd.Prefix})
			require.ErrorIs(t, err, ErrInvalidConfig, name)
			var ce *ConfigError
			require.ErrorAs(t, err, &ce, name)
			require.Equal(t, tc.field, ce.Field, name)
			require.Contains(t, ce.Reason, "ContextTimeoutEnabled", name)
		}
	})

	// -2 makes go-redis skip SetReadDeadline / SetWriteDeadline altogether,
	// the context's deadline included, so ContextTimeoutEnabled cannot
	// bound the command either.
	t.Run("NoDeadlineRefusedEvenWithContextTimeout", func(t *testing.T) {
		t.Parallel()
		for name, tc := range map[string]struct {
			client redis.UniversalClient
			field  string
		}{
			"ReadDeadline":         {single(-2, time.Second, true), "Options.ReadTimeout"},
			"WriteDeadline":        {single(-1, -2, true), "Options.WriteTimeout"},
			"ClusterReadDeadline":  {cluster(-2, 0, true), "ClusterOptions.ReadTimeout"},
			"ClusterWriteDeadline": {cluster(-1, -2, true), "ClusterOptions.WriteTimeout"},
			"RingReadDeadline":     {ring(-2, -1, true), "RingOptions.ReadTimeout"},
			"RingWriteDeadline":    {ring(-1, -2, true), "RingOptions.WriteTimeout"},
		} {
			_, err := NewRedisProjector(tc.client, testMapper(), &Config{Prefix: rd.Prefix})
			require.ErrorIs(t, err, ErrInvalidConfig, name)
			var ce *ConfigError
			require.ErrorAs(t, err, &ce, name)
			require.Equal(t, tc.field, ce.Field, name)
			require.Contains(t, ce.Reason, "-2", name)
		}
	})

	// A Ring's shards are made by its NewClient function, which may set
	// other timeouts than the RingOptions: the shards' clients are checked.
	t.Run("RingShardsChecked", func(t *testing.T) {
		t.Parallel()
		hooked := func(read time.Duration) *redis.Ring {
			c := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": opt.Addr},
				HeartbeatFn: func(context.Context, *redis.Client) bool { return true },
				ReadTimeout: -2, ContextTimeoutEnabled: false,
				NewClient: func(o *redis.Options) *redis.Client {
					o.Username, o.Password, o.DB = opt.Username, opt.Password, opt.DB
					o.ReadTimeout = read
					return redis.NewClient(o)
				}})
			t.Cleanup(func() { _ = c.Close() })
			return c
		}
		_, err := NewRedisProjector(hooked(time.Second), testMapper(), &Config{Prefix: rd.Prefix})
		require.NoError(t, err, "the shards' clients have a ReadTimeout")
		_, err = NewRedisProjector(hooked(-1), testMapper(), &Config{Prefix: rd.Prefix})
		var ce *ConfigError
		require.ErrorAs(t, err, &ce, "the shards' clients have no ReadTimeout")
		require.Equal(t, "RingOptions.ReadTimeout", ce.Field)
	})

	// The heartbeat may have marked a shard down when NewRedisProjector
	// runs; ForEachShard skips it, but the Ring gives it the RingOptions'
	// timeouts when it comes back, so they are checked.
	t.Run("RingShardDownChecked", func(t *testing.T) {
		t.Parallel()
		c := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": opt.Addr}, Username: opt.Username, Password: opt.Password, DB: opt.DB,
			HeartbeatFn:        func(context.Context, *redis.Client) bool { return false },
			HeartbeatFrequency: 5 * time.Millisecond,
			ReadTimeout:        -1, ContextTimeoutEnabled: false})
		t.Cleanup(func() { _ = c.Close() })
		require.Eventually(t, func() bool {
			up := 0
			_ = c.ForEachShard(context.Background(), func(context.Context, *redis.Client) error { up++; return nil })
			return up == 0
		}, 10*time.Second, 5*time.Millisecond, "the heartbeat never marked the shard down")
		_, err := NewRedisProjector(c, testMapper(), &Config{Prefix: rd.Prefix})
		var ce *ConfigError
		require.ErrorAs(t, err, &ce, "a down shard's client would have no ReadTimeout")
		require.Equal(t, "RingOptions.ReadTimeout", ce.Field)
	})

	t.Run("BoundedAccepted", func(t *testing.T) {
		t.Parallel()
		for name, client := range map[string]redis.UniversalClient{
			"Defaults":                  single(0, 0, false),
			"Timeouts":                  single(time.Second, 2*time.Second, false),
			"ContextTimeoutEnabled":     single(-1, -1, true),
			"ClusterDefaults":           cluster(0, 0, false),
			"ClusterContextTimeout":     cluster(-1, -1, true),
			"RingDefaults":              ring(0, 0, false),
			"RingContextTimeoutEnabled": ring(-1, -1, true),
			"SharedServerClient":        rd.Client,
		} {
			_, err := NewRedisProjector(client, testMapper(), &Config{Prefix: rd.Prefix})
			require.NoError(t, err, name)
		}
	})

	// With ContextTimeoutEnabled and no ReadTimeout, the context's
	// deadline (the relay's lease, for Handle) ends a command that a
	// stalled Redis never answers.
	t.Run("ContextDeadlineEndsAStalledCall", func(t *testing.T) {
		t.Parallel()
		srv := testenv.StartRedis(t)
		client := redis.NewClient(&redis.Options{Addr: srv.Addr(), ReadTimeout: -1, ContextTimeoutEnabled: true, MaxRetries: -1})
		t.Cleanup(func() { _ = client.Close() })
		p, err := NewRedisProjector(client, testMapper(), nil)
		require.NoError(t, err)
		ctx := context.Background()
		require.NoError(t, client.Ping(ctx).Err())
		require.NoError(t, srv.Client(t).Do(ctx, "CLIENT", "PAUSE", 5000, "ALL").Err())
		hctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		start := time.Now()
		results, err := p.Handle(hctx, []outbox.Record{record("scores", "alice", 1, "10")})
		require.NoError(t, err)
		require.Len(t, results, 1)
		require.Error(t, results[0].Err, "the record's slot group's call timed out")
		require.Less(t, time.Since(start), 3*time.Second, "ended by the deadline, not by the pause")

		// With -2 instead, go-redis sets no deadline at all, and the same
		// call would wait for the pause to end: refused up front.
		noDeadline := redis.NewClient(&redis.Options{Addr: srv.Addr(), ReadTimeout: -2, ContextTimeoutEnabled: true, MaxRetries: -1})
		t.Cleanup(func() { _ = noDeadline.Close() })
		_, err = NewRedisProjector(noDeadline, testMapper(), nil)
		require.ErrorIs(t, err, ErrInvalidConfig)
	})
}

// loggedProjector returns a projector on a single node that logs, from
// Debug up, as text into the returned buffer.
func loggedProjector(t *testing.T) (*RedisProjector, *projectorBundle, *bytes.Buffer) {
	t.Helper()
	pb := setupProjector(t, backends[0])
	var buf bytes.Buffer
	logger := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	p, err := NewRedisProjector(pb.client, testMapper(), &Config{Prefix: pb.ks.Prefix(), Logger: logger})
	require.NoError(t, err)
	return p, pb, &buf
}

func TestProjectorLogs(t *testing.T) {
	t.Parallel()
	p, _, buf := loggedProjector(t)
	_, err := p.Handle(context.Background(), []outbox.Record{record("scores", "a", 1, "1"), record("scores", "a", 1, "1"), record("x", "a", 1, "1")})
	require.NoError(t, err)
	require.Contains(t, buf.String(), "applied=1 duplicate=1 stale=0 conflict=0 failed=1")
	require.NotContains(t, buf.String(), "level=WARN")

	t.Run("ConflictIsAWarning", func(t *testing.T) {
		t.Parallel()
		p, pb, buf := loggedProjector(t)
		warnings := func() []string {
			var out []string
			for _, l := range strings.Split(buf.String(), "\n") {
				if strings.Contains(l, "level=WARN") {
					out = append(out, l)
				}
			}
			return out
		}
		first := record("scores", "a", 3, "10")
		other := record("scores", "a", 3, "11")
		third := record("scores", "b", 1, "2")
		start := time.Now()
		outcomes, err := p.Project(context.Background(), []outbox.Record{first, record("scores", "b", 1, "1"), other, third})
		require.NoError(t, err)
		require.Equal(t, []Outcome{OutcomeApplied, OutcomeApplied, OutcomeConflict, OutcomeConflict}, outcomes)
		require.Contains(t, buf.String(), "applied=2 duplicate=0 stale=0 conflict=2 failed=0")
		lines := warnings()
		require.Len(t, lines, 1, "one line per batch: %s", buf.String())
		for _, attr := range []string{ // the batch's first conflict
			"record_id=" + strconv.FormatInt(other.ID, 10), "event_id=" + other.EventID.String(),
			"stream=scores", "key=a", "version=3", "conflicts_in_batch=2", "suppressed=0",
		} {
			require.Contains(t, lines[0], attr)
		}
		// Another batch of conflicts within the second is not logged, but
		// counted for the next line.
		_, err = p.Project(context.Background(), []outbox.Record{third})
		require.NoError(t, err)
		if time.Since(start) < 900*time.Millisecond {
			require.Len(t, warnings(), 1, "a second line within a second")
		}
		// Batches of conflicts until the next line: it comes a second after
		// the first at the earliest and reports, as suppressed, every batch
		// not logged since.
		batches, ctx := 2, context.Background()
		var projectErr error
		require.Eventually(t, func() bool {
			if _, projectErr = p.Project(ctx, []outbox.Record{third}); projectErr != nil {
				return true
			}
			batches++
			return len(warnings()) > 1
		}, 30*time.Second, 20*time.Millisecond)
		require.NoError(t, projectErr)
		require.GreaterOrEqual(t, time.Since(start), lograte.Interval)
		lines = warnings()
		require.Len(t, lines, 2)
		require.Contains(t, lines[1], "conflicts_in_batch=1")
		require.True(t, strings.HasSuffix(lines[1], fmt.Sprintf(" suppressed=%d", batches-2)), "%d batches of conflicts: %s", batches, lines[1])

		// The relay acknowledges a conflict: sending it again cannot help,
		// and the source keeps the record of what it meant.
		results, err := p.Handle(context.Background(), []outbox.Record{other, record("scores", "c", 1, "1")})
		require.NoError(t, err)
		require.Equal(t, []outbox.Result{{}, {}}, results)
		require.Equal(t, storedState{true, "10", "3"}, readState(t, pb.client, pb.ks, Target{Kind: KindSortedSet, Name: "board", Member: "a"}))
	})
}

// TestProjectorLogsHandleConflict: the relay's path warns about a conflict
// too, naming the record by its place in the batch, records its Mapper
// refused included.
func TestProjectorLogsHandleConflict(t *testing.T) {
	t.Parallel()
	p, _, buf := loggedProjector(t)
	ctx := context.Background()
	results, err := p.Handle(ctx, []outbox.Record{record("x", "a", 1, "1"), record("scores", "a", 1, "1")})
	require.NoError(t, err)
	require.NoError(t, results[1].Err)
	require.NotContains(t, buf.String(), "level=WARN")
	conflict := record("scores", "a", 1, "2")
	results, err = p.Handle(ctx, []outbox.Record{record("x", "b", 1, "1"), conflict})
	require.NoError(t, err)
	require.NoError(t, results[1].Err, "a conflict is acknowledged")
	require.Equal(t, 1, strings.Count(buf.String(), "level=WARN"), buf.String())
	for _, attr := range []string{"record_id=" + strconv.FormatInt(conflict.ID, 10), "key=a", "version=1", "conflicts_in_batch=1"} {
		require.Contains(t, buf.String(), attr)
	}
}

func TestMappers(t *testing.T) {
	t.Parallel()
	rec := record("s", "k{1}", 4, "-3")
	w, err := SortedSetMapper("b").Map(rec)
	require.NoError(t, err)
	require.Equal(t, Write{Target: Target{Kind: KindSortedSet, Name: "b", Member: "k{1}"}, Version: 4, Value: Value{Score: -3}}, w)
	for _, payload := range []string{"", " 1", "1.0", "1e3", "99999999999999999999", `{"score":1}`} {
		_, err := SortedSetMapper("b").Map(record("s", "k", 1, payload))
		require.ErrorIs(t, err, ErrInvalidPayload, payload)
	}
	w, err = HashMapper("h").Map(rec)
	require.NoError(t, err)
	require.Equal(t, Target{Kind: KindHash, Name: "h", Member: "k{1}"}, w.Target)
	require.Equal(t, []byte("-3"), w.Value.Data)
	w, err = DocumentMapper("ns:").Map(rec)
	require.NoError(t, err)
	require.Equal(t, Write{Target: Target{Kind: KindDocument, Name: "ns:k{1}"}, Version: 4, Value: Value{Data: []byte("-3")}}, w)
	_, err = StreamMapper{"s": nil}.Map(rec)
	require.True(t, errors.Is(err, ErrUnmappedStream))

	// SortedSetMapper takes a base-10 int64 only: no base prefixes and
	// no digit separators, which strconv reads with base 0.
	t.Run("SortedSetScoresAreBaseTen", func(t *testing.T) {
		t.Parallel()
		for _, payload := range []string{"0x10", "0b1", "0o7", "1_000"} {
			_, err := SortedSetMapper("b").Map(record("s", "k", 1, payload))
			require.ErrorIs(t, err, ErrInvalidPayload, payload)
		}
	})

	t.Run("NestedStreamMappers", func(t *testing.T) {
		t.Parallel()
		nested := StreamMapper{"s": StreamMapper{"s": StreamMapper{"s": DocumentMapper("n:")}}}
		require.NoError(t, checkStreams(nested))
		w, err := nested.Map(record("s", "1", 1, ""))
		require.NoError(t, err)
		require.Equal(t, "n:1", w.Target.Name)

		// Two document namespaces where one begins the other: the error
		// names the document both streams would write.
		err = checkStreams(StreamMapper{"a": DocumentMapper("u"), "b": DocumentMapper("us")})
		require.ErrorContains(t, err, `key "s1" of stream "a" and key "1" of stream "b" both name document "us1"`)
	})

	t.Run("NilMapperFuncEntryIsUnmapped", func(t *testing.T) {
		t.Parallel()
		_, err := StreamMapper{"s": MapperFunc(nil)}.Map(rec)
		require.ErrorIs(t, err, ErrUnmappedStream)

		// The projector shares the caller's map, which may gain such an
		// entry after NewRedisProjector checked it: its records fail to
		// map instead of panicking. No write reaches Redis, so the client
		// is never dialled.
		client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
		t.Cleanup(func() { _ = client.Close() })
		m := StreamMapper{"good": HashMapper("h")}
		p, err := NewRedisProjector(client, m, nil)
		require.NoError(t, err)
		m["bad"] = MapperFunc(nil)
		batch := []outbox.Record{record("bad", "k", 1, "x")}
		_, err = p.Project(context.Background(), batch)
		require.ErrorIs(t, err, ErrUnmappedStream)
		results, err := p.Handle(context.Background(), batch)
		require.NoError(t, err)
		require.ErrorIs(t, results[0].Err, ErrUnmappedStream)
	})

	t.Run("TypedNilMapperErrorDoesNotPanic", func(t *testing.T) {
		t.Parallel()
		// A Mapper returning a typed nil whose Error dereferences its
		// receiver: the text a relay logs says "<nil>", as fmt would.
		client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
		t.Cleanup(func() { _ = client.Close() })
		p, err := NewRedisProjector(client, StreamMapper{"s": MapperFunc(func(outbox.Record) (Write, error) {
			return Write{}, (*derefError)(nil)
		})}, nil)
		require.NoError(t, err)
		_, err = p.Project(context.Background(), []outbox.Record{rec})
		var mapErr *MapError
		require.ErrorAs(t, err, &mapErr)
		require.NotPanics(t, func() { _ = err.Error() })
		require.Equal(t, fmt.Sprintf("projection: record 0 (outbox id %d, stream %q): <nil>", rec.ID, rec.Stream), err.Error())
	})
}

// derefError is an error whose Error panics on a nil receiver.
type derefError struct{ msg string }

func (e *derefError) Error() string { return e.msg }

// TestRedisProjectorZeroValue: a RedisProjector not made by
// NewRedisProjector refuses every call with *ConfigError, as a zero Gate
// does, instead of panicking on its nil fields.
func TestRedisProjectorZeroValue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	batch := []outbox.Record{record("scores", "k", 1, "1")}
	for name, p := range map[string]*RedisProjector{"Zero": {}, "Nil": nil} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			_, err := p.Project(ctx, batch)
			require.ErrorIs(t, err, ErrInvalidConfig)
			require.ErrorContains(t, err, "NewRedisProjector")
			var ce *ConfigError
			require.ErrorAs(t, err, &ce)
			results, err := p.Handle(ctx, batch)
			require.ErrorIs(t, err, ErrInvalidConfig)
			require.ErrorContains(t, err, "NewRedisProjector")
			require.Nil(t, results)
			_, err = p.Gate().Apply(ctx, []Write{{Target: Target{Kind: KindHash, Name: "n", Member: "m"}, Version: 1}})
			require.ErrorIs(t, err, ErrInvalidConfig, "its Gate is a nil *Gate")
			require.True(t, p.Keyspace().IsZero())
			require.True(t, p.Gate().Keyspace().IsZero(), "a nil *Gate has the zero Keyspace")
		})
	}
}

func TestDocumentNamespacesMustNotOverlap(t *testing.T) {
	t.Parallel()
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialled
	t.Cleanup(func() { _ = client.Close() })

	// Why: ids are namespace + key, so "u" + "s1" and "us" + "1" meet.
	a, err := DocumentMapper("u").Map(record("a", "s1", 1, "{}"))
	require.NoError(t, err)
	b, err := DocumentMapper("us").Map(record("b", "1", 1, "{}"))
	require.NoError(t, err)
	require.Equal(t, a.Target, b.Target)

	for _, tc := range []struct {
		name  string
		m     StreamMapper
		pair  string
		valid bool
	}{
		{"ProperPrefix", StreamMapper{"a": DocumentMapper("u"), "b": DocumentMapper("us")}, `streams "a" and "b"`, false},
		{"EmptyNamespace", StreamMapper{"x": DocumentMapper("order:"), "y": DocumentMapper(""), "z": HashMapper("h")}, `streams "y" and "x"`, false},
		{"SeparatorNotEnough", StreamMapper{"users": DocumentMapper("user:"), "settings": DocumentMapper("user:settings:")}, `streams "users" and "settings"`, false},
		{"InsideANestedStreamMapper", StreamMapper{"a": StreamMapper{"a": DocumentMapper("u")}, "b": DocumentMapper("us")}, `streams "a" and "b"`, false},
		{"Distinct", StreamMapper{"a": DocumentMapper("order:"), "b": DocumentMapper("invoice:"), "c": SortedSetMapper("o")}, "", true},
		{"DistinctNested", StreamMapper{"a": StreamMapper{"a": DocumentMapper("order:")}, "b": DocumentMapper("invoice:")}, "", true},
		{"EqualNamesTheSameDocuments", StreamMapper{"orders": DocumentMapper("order:"), "orders_v2": DocumentMapper("order:")}, "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := NewRedisProjector(client, tc.m, nil)
			if tc.valid {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, ErrInvalidConfig)
			var ce *ConfigError
			require.ErrorAs(t, err, &ce)
			require.Equal(t, "mapper", ce.Field)
			require.Contains(t, ce.Reason, tc.pair)
		})
	}
}

// TestHandleIsolatesAValueRedisWouldRefuse: Redis refuses a bulk string
// longer than its proto-max-bulk-len by closing the connection, which
// failed every record of the script call, on every retry, and so
// dead-lettered the record's batch-mates with it. A write over
// Config.MaxValueBytes now fails alone, before anything is sent. The
// private server's limit is lowered to its 1 MB minimum to keep the test
// small.
func TestHandleIsolatesAValueRedisWouldRefuse(t *testing.T) {
	t.Parallel()
	const limit = 1 << 20
	client := testenv.StartRedis(t, "--proto-max-bulk-len", "1mb").Client(t)
	p, err := NewRedisProjector(client, testMapper(), &Config{Prefix: "size:", MaxValueBytes: limit})
	require.NoError(t, err)
	ctx := context.Background()

	over := strings.Repeat("x", limit+1)
	batch := []outbox.Record{
		record("orders", "small", 1, `{"n":1}`),
		record("orders", "over", 1, over),
		record("orders", "at", 1, strings.Repeat("y", limit)),
		record("profiles", over, 1, "v"), // the member is too long
		record("profiles", "alice", 1, "v"),
		// A name under the limit whose keys are over it: each ':' is
		// escaped to three bytes.
		record("orders", strings.Repeat(":", limit/3), 1, `{}`),
		record("profiles", strings.Repeat("m", 2000), 1, over), // not quoted either
	}
	results, err := p.Handle(ctx, batch)
	require.NoError(t, err)
	require.Len(t, results, len(batch))
	for _, i := range []int{0, 2, 4} {
		require.NoError(t, results[i].Err, "record %d fits Redis's limit", i)
	}
	for _, i := range []int{1, 3, 5, 6} {
		var mapErr *MapError
		require.ErrorAs(t, results[i].Err, &mapErr, "record %d", i)
		require.Equal(t, i, mapErr.Index)
		var targetErr *InvalidTargetError
		require.ErrorAs(t, results[i].Err, &targetErr, "record %d", i)
		require.Contains(t, targetErr.Reason, "Config.MaxValueBytes")
		require.Less(t, len(results[i].Err.Error()), 1000, "record %d: the oversized bytes are not quoted", i)
	}
	for key, want := range map[string]bool{"small": true, "over": false, "at": true} {
		require.Equal(t, want, readState(t, client, p.Keyspace(), Target{Kind: KindDocument, Name: "order:" + key}).exists, key)
	}
	require.True(t, readState(t, client, p.Keyspace(), Target{Kind: KindHash, Name: "profiles", Member: "alice"}).exists)
}
