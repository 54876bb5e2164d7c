package leaderboard

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/reconcile"
)

// readerCommands are the commands README ("Redis permissions") lists for a
// process that only reads a board: the read scripts' EVALSHA_RO and EVAL_RO,
// the commands the scripts call, and the plain reads (Top's ZRANGE, the
// AtLeast wait's MGET, EXISTS and HGET, the GET that reads Verify's
// record).
var readerCommands = []string{"evalsha_ro", "eval_ro", "zrange", "zcount", "zrank", "mget", "exists", "hget", "get"}

// TestReadOnlyKeyPermission reads a board as Redis ACL users with read
// permission only on the board's keys (%R~prefix*), one allowed every
// command and one only readerCommands: every read answers from Redis.
// EVALSHA and EVAL count as writes to every key they name, so read scripts
// sent with them fail with NOPERM, and FallbackToPostgres would hide that
// by answering from PostgreSQL: the reads here fail closed, and must come
// from Redis.
func TestReadOnlyKeyPermission(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.StartRedis(t)
	admin := srv.Client(t)
	pg := testenv.Postgres(t)
	cfg := &Config{Name: "acl", Schema: pg.Schema, KeyPrefix: "acl:", ReadPolicy: FailClosed, RequireVerifiedProjection: true}
	require.NoError(t, Migrate(ctx, pg.Pool, cfg))
	writer, err := New(pg.Pool, admin, cfg)
	require.NoError(t, err)
	t.Cleanup(writer.Close)
	var last Result
	for _, u := range []string{"ada", "bob", "cy"} {
		last, err = writer.Submit(ctx, Command{EventID: uuid.New(), UserID: u, Delta: 3})
		require.NoError(t, err)
	}
	w, err := writer.Worker(nil)
	require.NoError(t, err)
	_, err = w.Drain(ctx)
	require.NoError(t, err)
	_, verified, err := writer.Verify(ctx, nil)
	require.NoError(t, err)
	require.True(t, verified)

	listed := []string{"-@all"}
	for _, c := range readerCommands {
		listed = append(listed, "+"+c)
	}
	for _, user := range []struct {
		name  string
		rules []string
	}{
		// Any command, read permission on the keys: EVALSHA would be
		// refused the keys.
		{"AllCommands", []string{"+@all"}},
		// Exactly the commands README lists for a reader.
		{"ListedCommands", listed},
	} {
		// Not parallel: SCRIPT FLUSH is server-wide.
		t.Run(user.name, func(t *testing.T) {
			acl := []any{"ACL", "SETUSER", user.name, "reset", "on", ">pw", "%R~acl:*"}
			for _, r := range user.rules {
				acl = append(acl, r)
			}
			require.NoError(t, admin.Do(ctx, acl...).Err())
			// Every script's first run then meets NOSCRIPT and falls back
			// to EVAL_RO.
			require.NoError(t, admin.ScriptFlush(ctx).Err())
			ro := redis.NewClient(&redis.Options{Addr: srv.Addr(), Username: user.name, Password: "pw"})
			t.Cleanup(func() { _ = ro.Close() })
			reader, err := New(pg.Pool, ro, cfg)
			require.NoError(t, err)
			t.Cleanup(reader.Close)
			readAll(t, reader, AtLeast("cy", last.Version))
		})
	}
	// A reader deployed without get (README lists it since reads GET
	// Verify's record) cannot read the record: its reads are unverified
	// (refused here, fail-closed), never verified unchecked.
	t.Run("WithoutGetIsUnverified", func(t *testing.T) {
		acl := []any{"ACL", "SETUSER", "noget", "reset", "on", ">pw", "%R~acl:*"}
		for _, r := range listed {
			acl = append(acl, r)
		}
		require.NoError(t, admin.Do(ctx, append(acl, "-get")...).Err())
		ro := redis.NewClient(&redis.Options{Addr: srv.Addr(), Username: "noget", Password: "pw"})
		t.Cleanup(func() { _ = ro.Close() })
		reader, err := New(pg.Pool, ro, cfg)
		require.NoError(t, err)
		t.Cleanup(reader.Close)
		r, err := reader.Top(ctx, 10)
		var stale *StaleError
		require.ErrorAs(t, err, &stale, "served %v as verified without reading the record", r.Entries)
		require.True(t, stale.Unverified)
		require.True(t, reader.Freshness(ctx).Unverified)
	})
	for _, name := range []string{"evalsha_ro", "eval_ro"} {
		require.Positive(t, testenv.CommandCalls(t, admin, name), name)
	}
}

// readAll runs every kind of read of reader, without and with atLeast, and
// fails t unless each answers from Redis.
func readAll(t *testing.T, reader *Board, atLeast ReadOption) {
	t.Helper()
	ctx := context.Background()
	fromRedis := func(t *testing.T, fresh Freshness) {
		t.Helper()
		require.Equal(t, SourceRedis, fresh.Source)
		require.True(t, fresh.AtLeastMet)
	}
	for _, opts := range [][]ReadOption{nil, {atLeast}} {
		top, err := reader.Top(ctx, 10, opts...)
		require.NoError(t, err, "Top")
		require.Len(t, top.Entries, 3)
		fromRedis(t, top.Freshness)
		first, err := reader.Page(ctx, "", 1, opts...)
		require.NoError(t, err, "the first Page")
		fromRedis(t, first.Freshness)
		second, err := reader.Page(ctx, first.Next, 1, opts...)
		require.NoError(t, err, "the second Page")
		require.Equal(t, top.Entries[1:2], second.Entries)
		fromRedis(t, second.Freshness)
		entry, fresh, err := reader.Rank(ctx, "bob", opts...)
		require.NoError(t, err, "Rank")
		require.Equal(t, top.Entries[1], entry)
		fromRedis(t, fresh)
		around, err := reader.Around(ctx, "bob", 1, opts...)
		require.NoError(t, err, "Around")
		require.Equal(t, top.Entries, around.Entries)
		fromRedis(t, around.Freshness)
	}
	_, _, err := reader.Rank(ctx, "nobody")
	require.ErrorIs(t, err, ErrUserNotFound)
}

// writerCommands are the commands README ("Redis permissions") lists for a
// process that writes or repairs a board (Submit, the Worker and its
// eviction check, Verify, the Reconciler, Rebuild).
var writerCommands = []string{"evalsha", "eval", "evalsha_ro", "eval_ro", "get", "set", "mget",
	"exists", "del", "unlink", "type", "hget", "hset", "hmget", "hdel",
	"hlen", "hscan", "hincrby", "hrandfield", "zadd", "zrem", "zscore",
	"zmscore", "zrank", "zrange", "zcard", "zcount", "zscan", "rename", "pexpire", "info"}

// TestWriterCommandList runs a board's writing side as a Redis ACL user
// allowed exactly writerCommands on its prefix: the Worker, Verify, a
// reconcile pass that repairs, and Rebuilds, one of them long enough to
// refresh its marker (rebuild.lua's PEXPIRE), all succeed.
func TestWriterCommandList(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.StartRedis(t)
	admin := srv.Client(t)
	acl := []any{"ACL", "SETUSER", "writer", "reset", "on", ">pw", "~wr:*", "-@all"}
	for _, c := range writerCommands {
		acl = append(acl, "+"+c)
	}
	require.NoError(t, admin.Do(ctx, acl...).Err())
	limited := redis.NewClient(&redis.Options{Addr: srv.Addr(), Username: "writer", Password: "pw"})
	t.Cleanup(func() { _ = limited.Close() })

	pg := testenv.Postgres(t)
	logs := &testenv.LogSink{}
	cfg := &Config{Name: "wr", Schema: pg.Schema, KeyPrefix: "wr:", Logger: logs.Logger()}
	require.NoError(t, Migrate(ctx, pg.Pool, cfg))
	board, err := New(pg.Pool, limited, cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	tb := &testBundle{board: board, pg: pg}
	for i := range 200 {
		tb.submit(t, fmt.Sprintf("user-%03d", i), int64(i+1))
	}
	w, err := board.Worker(nil)
	require.NoError(t, err)
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- w.Run(runCtx) }()
	require.Eventually(t, func() bool {
		stats, err := w.Relay().Stats(ctx)
		return err == nil && stats.Pending == 0
	}, 10*time.Second, 10*time.Millisecond, "the Worker drains")
	require.Eventually(t, func() bool {
		return len(logs.Lines(t, "leaderboard: worker: the Redis eviction policy keeps the projection's version keys")) == 1
	}, 10*time.Second, 10*time.Millisecond, "the eviction check ran (INFO)")
	cancel()
	require.NoError(t, <-done)

	_, verified, err := board.Verify(ctx, nil)
	require.NoError(t, err)
	require.True(t, verified)

	require.NoError(t, admin.ZAdd(ctx, board.SortedSetKey(), redis.Z{Score: 0, Member: "user-007"}).Err())
	rec, err := board.Reconciler(nil)
	require.NoError(t, err)
	rep, err := rec.Run(ctx, reconcile.RunOptions{})
	require.NoError(t, err)
	require.EqualValues(t, 1, rep.Repaired)

	rebuild, err := rec.Rebuild(ctx)
	require.NoError(t, err)
	require.True(t, rebuild.Switched)
	// One row per page and a short marker: the copy of 1,200 rows
	// outlasts RebuildMarkerTTL/4, and refreshes the marker. The marker is
	// refreshed only between pages, so one page held up past 3/4 of its
	// TTL lets it expire: a 400 ms marker failed the rebuild when a page
	// took 450 ms on a loaded machine; 1 s leaves 750 ms.
	cmds := make([]Command, 1000)
	for i := range cmds {
		cmds[i] = Command{EventID: uuid.New(), UserID: fmt.Sprintf("more-%04d", i), Delta: 1}
	}
	_, err = board.SubmitBatch(ctx, cmds)
	require.NoError(t, err)
	rec, err = board.Reconciler(&reconcile.Config{PageSize: 1, RebuildMarkerTTL: time.Second})
	require.NoError(t, err)
	rebuild, err = rec.Rebuild(ctx)
	require.NoError(t, err)
	require.True(t, rebuild.Switched)
}

// readmeCommandList returns the backticked commands of the README bullet
// of "Redis permissions" that starts with start, up to the next bullet.
func readmeCommandList(t *testing.T, start string) []string {
	t.Helper()
	b, err := os.ReadFile("../README.md")
	require.NoError(t, err)
	s := string(b)
	i := strings.Index(s, "### Redis permissions")
	require.Positive(t, i)
	s = s[i:]
	j := strings.Index(s, start)
	require.Positive(t, j, start)
	s = s[j+len(start):]
	if k := strings.Index(s, "\n- **"); k > 0 {
		s = s[:k]
	}
	var out []string
	for _, m := range regexp.MustCompile("`([a-z_|]+)`").FindAllStringSubmatch(s, -1) {
		if !slices.Contains(out, m[1]) {
			out = append(out, m[1])
		}
	}
	return out
}

// TestACLListsAreTheREADMEs: the ACL tests run copies of the README's
// Redis permission lists; the copies must be the lists.
func TestACLListsAreTheREADMEs(t *testing.T) {
	t.Parallel()
	w := readmeCommandList(t, "a process that writes or repairs")
	r := readmeCommandList(t, "a process that only reads")
	require.NotEmpty(t, w)
	require.NotEmpty(t, r)
	require.ElementsMatch(t, writerCommands, w)
	require.ElementsMatch(t, readerCommands, r)
}

// TestPublicPrefixACLLeavesOtherSchemasOut: the public schema's default
// prefix, verity:lb:, begins every other schema's (verity:lb:<schema>:),
// so the README gives a public board's process ~verity:lb:{* rather than
// ~verity:lb:*, which would grant it every schema's boards. That pattern
// must cover everything a public board does (writes, the Worker, reads,
// Verify) and no other schema's board.
func TestPublicPrefixACLLeavesOtherSchemasOut(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.StartRedis(t)
	admin := srv.Client(t)
	pg := testenv.Postgres(t)
	require.NoError(t, Migrate(ctx, pg.Pool, &Config{Schema: pg.Schema}))
	submit := func(b *Board) {
		_, err := b.Submit(ctx, Command{EventID: uuid.New(), UserID: "ada", Delta: 7})
		require.NoError(t, err)
		w, err := b.Worker(nil)
		require.NoError(t, err)
		_, err = w.Drain(ctx)
		require.NoError(t, err)
	}
	other, err := New(pg.Pool, admin, &Config{Name: "weekly", Schema: pg.Schema})
	require.NoError(t, err)
	t.Cleanup(other.Close)
	submit(other)

	public := (&Config{}).WithDefaults().KeyPrefix
	require.Equal(t, KeyPrefixDefault, public)
	require.True(t, strings.HasPrefix(other.SortedSetKey(), public), "setup: the other schema's prefix begins with the public one")
	require.NoError(t, admin.Do(ctx, "ACL", "SETUSER", "publicboard", "reset", "on", ">pw", "~verity:lb:{*", "+@all").Err())
	acl := redis.NewClient(&redis.Options{Addr: srv.Addr(), Username: "publicboard", Password: "pw"})
	t.Cleanup(func() { _ = acl.Close() })

	// A board with the public schema's prefix, under the README's pattern.
	pub, err := New(pg.Pool, acl, &Config{Name: "season", Schema: pg.Schema, KeyPrefix: public, ReadPolicy: FailClosed})
	require.NoError(t, err)
	t.Cleanup(pub.Close)
	submit(pub)
	top, err := pub.Top(ctx, 10)
	require.NoError(t, err)
	require.Len(t, top.Entries, 1)
	_, verified, err := pub.Verify(ctx, nil)
	require.NoError(t, err)
	require.True(t, verified)

	_, err = acl.ZRange(ctx, other.SortedSetKey(), 0, -1).Result()
	require.ErrorContains(t, err, "NOPERM", "the public board's pattern covers %s", other.SortedSetKey())
}
