package leaderboard

import (
	"context"
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"math"
	"net"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/lograte"
	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/outbox"
	"github.com/verity-go/verity/projection"
)

// submit applies commands and fails the test on error.
func (tb *testBundle) submit(t *testing.T, user string, delta int64) Result {
	t.Helper()
	res, err := tb.board.Submit(context.Background(), Command{EventID: uuid.New(), UserID: user, Delta: delta})
	require.NoError(t, err)
	return res
}

// record submits a command with a new event id on b and returns that id,
// for tests that reuse it.
func record(t *testing.T, b *Board, user string, delta int64) uuid.UUID {
	t.Helper()
	id := uuid.New()
	_, err := b.Submit(context.Background(), Command{EventID: id, UserID: user, Delta: delta})
	require.NoError(t, err)
	return id
}

// drain projects everything pending.
// verify runs a Verify pass on tb's board, which must record the
// projection as verified.
func (tb *testBundle) verify(t *testing.T) {
	t.Helper()
	_, verified, err := tb.board.Verify(context.Background(), nil)
	require.NoError(t, err)
	require.True(t, verified)
}

func (tb *testBundle) drain(t *testing.T) {
	t.Helper()
	w, err := tb.board.Worker(nil)
	require.NoError(t, err)
	_, err = w.Drain(context.Background())
	require.NoError(t, err)
}

// tieUsers are ids whose byte order differs from most locale collations:
// upper case before lower case, accents and emoji after ASCII, a prefix
// before its extensions.
var tieUsers = []string{"b", "B", "a", "ä", "Z", "z", "é", "e", "ab", "a b", "🎮", "ω", "A", "a{1}", "a:1", "日本"}

// allPages walks every page of n entries.
func allPages(t *testing.T, b *Board, n int, opts ...ReadOption) ([]Entry, Source) {
	t.Helper()
	var out []Entry
	var source Source
	cur := ""
	for {
		r, err := b.Page(context.Background(), cur, n, opts...)
		require.NoError(t, err)
		out = append(out, r.Entries...)
		source = r.Freshness.Source
		if r.Next == "" {
			return out, source
		}
		cur = r.Next
	}
}

func TestOrdering(t *testing.T) {
	t.Parallel()

	t.Run("ServerDefault", func(t *testing.T) {
		t.Parallel()
		requireOrdering(t, setup(t))
	})

	// The shared test database sorts like bytes (C.UTF-8): a query that
	// lost its COLLATE "C" would still agree there. Under ICU's en-US,
	// "a" < "B" < "b", and PostgreSQL's order must still be Redis's.
	t.Run("ICUDatabase", func(t *testing.T) {
		t.Parallel()
		requireOrdering(t, setupInICUDatabase(t))
	})
}

// setupInICUDatabase is setup on a database of its own whose default
// collation is ICU's en-US, dropped at cleanup.
func setupInICUDatabase(t *testing.T) *testBundle {
	t.Helper()
	ctx := context.Background()
	pg := testenv.Postgres(t)
	db := "verity_icu_" + strings.ToLower(strings.NewReplacer("-", "_", ".", "_").Replace(pg.Schema))
	_, err := pg.Pool.Exec(ctx, `CREATE DATABASE `+pgx.Identifier{db}.Sanitize()+
		` TEMPLATE template0 ENCODING 'UTF8' LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C.UTF-8'`)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, err := pg.Pool.Exec(context.Background(), `DROP DATABASE `+pgx.Identifier{db}.Sanitize()+` WITH (FORCE)`)
		require.NoError(t, err)
	})
	pc, err := pgxpool.ParseConfig(pg.ServerURL)
	require.NoError(t, err)
	pc.ConnConfig.Database = db
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	var icu bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT 'a' < 'B'`).Scan(&icu))
	require.True(t, icu, "the database sorts like bytes")
	rd := testenv.Redis(t)
	cfg := &Config{Name: "weekly-2026-48", Schema: "public", KeyPrefix: rd.Prefix}
	require.NoError(t, Migrate(ctx, pool, cfg))
	board, err := New(pool, rd.Client, cfg)
	require.NoError(t, err)
	return &testBundle{board: board, pg: &testenv.PG{Pool: pool, Schema: "public", ServerURL: pg.ServerURL}, rd: rd}
}

// requireOrdering checks that every read, from Redis and from PostgreSQL,
// orders tied users by their ids' bytes.
func requireOrdering(t *testing.T, tb *testBundle) {
	t.Helper()
	ctx := context.Background()

	// Half the users tie on 50, the others on 20, one alone at 70 and one
	// negative.
	for i, u := range tieUsers {
		delta := int64(50)
		if i%2 == 1 {
			delta = 20
		}
		tb.submit(t, u, delta)
	}
	tb.submit(t, "solo", 70)
	tb.submit(t, "neg", -5)
	tb.drain(t)

	// The expected order, computed independently: score descending, then
	// user id ascending by bytes (Go compares strings bytewise).
	type su struct {
		user  string
		score int64
	}
	var want []su
	for i, u := range tieUsers {
		s := int64(50)
		if i%2 == 1 {
			s = 20
		}
		want = append(want, su{u, s})
	}
	want = append(want, su{"solo", 70}, su{"neg", -5})
	sort.Slice(want, func(i, j int) bool {
		if want[i].score != want[j].score {
			return want[i].score > want[j].score
		}
		return want[i].user < want[j].user
	})

	redisPolicy := WithPolicy(ServeStale)
	for _, size := range []int{1, 3, 100} {
		fromRedis, src := allPages(t, tb.board, size, redisPolicy)
		require.Equal(t, SourceRedis, src)
		fromPG, _, err := tb.board.pgPage(ctx, tb.pg.Pool, nil, MaxPageSize, nil)
		require.NoError(t, err)
		require.Equal(t, fromPG, fromRedis, "page size %d", size)
		require.Len(t, fromRedis, len(want))
		for i, e := range fromRedis {
			require.Equal(t, want[i].user, e.UserID)
			require.Equal(t, want[i].score, e.Score)
			require.Equal(t, int64(i+1), e.Rank)
		}
		// The PostgreSQL pages, walked with the same cursors, agree too.
		fromPGPages, src := allPages(t, tb.board, size, WithPolicy(FallbackToPostgres), forcePostgres())
		require.Equal(t, SourcePostgres, src)
		require.Equal(t, fromRedis, fromPGPages)
	}

	auth, err := tb.board.Authoritative(ctx, 5)
	require.NoError(t, err)
	require.Equal(t, "solo", auth[0].UserID)
	require.Len(t, auth, 5)

	for i, w := range want {
		e, fr, err := tb.board.Rank(ctx, w.user, redisPolicy)
		require.NoError(t, err)
		require.Equal(t, SourceRedis, fr.Source)
		require.Equal(t, Entry{UserID: w.user, Score: w.score, Rank: int64(i + 1)}, e)
		pe, _, err := tb.board.pgRank(ctx, tb.pg.Pool, w.user, nil)
		require.NoError(t, err)
		require.Equal(t, e, pe)

		ar, err := tb.board.Around(ctx, w.user, 2, redisPolicy)
		require.NoError(t, err)
		pa, _, err := tb.board.pgAround(ctx, tb.pg.Pool, w.user, 2, nil)
		require.NoError(t, err)
		require.Equal(t, pa, ar.Entries)
		lo, hi := max(0, i-2), min(len(want), i+3)
		require.Len(t, ar.Entries, hi-lo)
		require.Equal(t, int64(lo+1), ar.Entries[0].Rank)
	}
	_, _, err = tb.board.Rank(ctx, "nobody", redisPolicy)
	require.ErrorIs(t, err, ErrUserNotFound)
	for _, bad := range []string{"", "bad\xff", "nul\x00"} {
		_, _, err = tb.board.Rank(ctx, bad, WithPolicy(FallbackToPostgres), forcePostgres())
		require.ErrorIs(t, err, ErrUserNotFound)
		_, err = tb.board.Around(ctx, bad, 1, WithPolicy(FallbackToPostgres), forcePostgres())
		require.ErrorIs(t, err, ErrUserNotFound)
	}
	_, _, err = tb.board.pgRank(ctx, tb.pg.Pool, "nobody", nil)
	require.ErrorIs(t, err, ErrUserNotFound)
	_, err = tb.board.Around(ctx, "nobody", 1, redisPolicy)
	require.ErrorIs(t, err, ErrUserNotFound)
	_, _, err = tb.board.pgAround(ctx, tb.pg.Pool, "nobody", 1, nil)
	require.ErrorIs(t, err, ErrUserNotFound)
}

// forcePostgres makes every read look stale, so FallbackToPostgres answers
// from PostgreSQL (test only).
func forcePostgres() ReadOption {
	return func(o *readOptions) { o.forceStale = true }
}

// TestAuthoritativeReadsPostgresOnly: the payout ranking comes from
// PostgreSQL whatever Redis holds: a hand-edited score, a member the
// projection never wrote, a change not projected yet.
func TestAuthoritativeReadsPostgresOnly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	tb.submit(t, "ada", 10)
	tb.submit(t, "bob", 20)
	tb.drain(t)
	key := tb.board.SortedSetKey()
	require.NoError(t, tb.rd.Client.ZAdd(ctx, key, redis.Z{Score: -1000, Member: "ada"}, redis.Z{Score: -500, Member: "mallory"}).Err())
	tb.submit(t, "carol", 30) // not projected

	want := []Entry{{UserID: "carol", Score: 30, Rank: 1}, {UserID: "bob", Score: 20, Rank: 2}, {UserID: "ada", Score: 10, Rank: 3}}
	auth, err := tb.board.Authoritative(ctx, 10)
	require.NoError(t, err)
	require.Equal(t, want, auth)
	auth, err = tb.board.Authoritative(ctx, 1)
	require.NoError(t, err)
	require.Equal(t, want[:1], auth)

	// Redis does answer otherwise: the edit is what a Redis read sees.
	r, err := tb.board.Top(ctx, 10, WithPolicy(ServeStale))
	require.NoError(t, err)
	require.Equal(t, SourceRedis, r.Freshness.Source)
	require.Equal(t, Entry{UserID: "ada", Score: 1000, Rank: 1}, r.Entries[0])
}

func TestPageCursor(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	for i := 0; i < 6; i++ {
		tb.submit(t, string(rune('a'+i)), int64(10*(6-i))) // a 60, b 50, ... f 10
	}
	tb.drain(t)

	first, err := tb.board.Top(ctx, 3)
	require.NoError(t, err)
	require.Equal(t, []string{"a", "b", "c"}, users(first.Entries))
	require.NotEmpty(t, first.Next)

	// An entry of the first page moves up and a new user jumps ahead: the
	// next page still starts right after (40, "c"), where the first ended.
	tb.submit(t, "b", 1000)
	tb.submit(t, "new", 500)
	tb.drain(t)
	second, err := tb.board.Page(ctx, first.Next, 3)
	require.NoError(t, err)
	require.Equal(t, []string{"d", "e", "f"}, users(second.Entries))
	require.Equal(t, int64(5), second.Entries[0].Rank) // behind b, new, a and c
	require.Empty(t, second.Next)
	pgSecond, err := tb.board.Page(ctx, first.Next, 3, WithPolicy(FallbackToPostgres), forcePostgres())
	require.NoError(t, err)
	require.Equal(t, second.Entries, pgSecond.Entries)

	_, err = tb.board.Page(ctx, "not-a-cursor", 3)
	require.ErrorIs(t, err, ErrInvalidCursor)
	other := tb.sibling(t, "other")
	_, err = other.Page(ctx, first.Next, 3)
	require.ErrorIs(t, err, ErrInvalidCursor)
	_, err = tb.board.Top(ctx, 0)
	require.ErrorIs(t, err, ErrInvalidLimit)
}

// A cursor is bound to its board by a hash of the board's Schema, KeyPrefix
// and Name: another board refuses it even when the two share a name or a
// CRC-32 of one (what version 1 of the format bound), and a cursor of that
// older format is refused too.
func TestPageCursorOfAnotherBoard(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// firstPage returns the cursor after the first entry of a board of two
	// users, and checks that the board itself accepts it.
	firstPage := func(t *testing.T, tb *testBundle) string {
		t.Helper()
		tb.submit(t, "ada", 5)
		tb.submit(t, "bob", 3)
		tb.drain(t)
		page, err := tb.board.Top(ctx, 1)
		require.NoError(t, err)
		require.NotEmpty(t, page.Next)
		next, err := tb.board.Page(ctx, page.Next, 10)
		require.NoError(t, err)
		require.Equal(t, []string{"bob"}, users(next.Entries))
		return page.Next
	}
	// beside returns a board of tb's config changed by mutate.
	beside := func(t *testing.T, tb *testBundle, mutate func(*Config)) *Board {
		t.Helper()
		cfg := tb.board.Config()
		mutate(&cfg)
		b, err := New(tb.pg.Pool, tb.rd.Client, &cfg)
		require.NoError(t, err)
		t.Cleanup(b.Close)
		return b
	}

	t.Run("SameCRC32OfName", func(t *testing.T) {
		t.Parallel()
		require.Equal(t, crc32.ChecksumIEEE([]byte("plumless")), crc32.ChecksumIEEE([]byte("buckeroo")))
		tb := setup(t, func(c *Config) { c.Name = "plumless" })
		other := beside(t, tb, func(c *Config) { c.Name = "buckeroo" })
		_, err := other.Page(ctx, firstPage(t, tb), 10)
		require.ErrorIs(t, err, ErrInvalidCursor)
	})

	t.Run("SameNameInAnotherSchema", func(t *testing.T) {
		t.Parallel()
		a := setup(t, func(c *Config) { c.Name = "weekly" })
		b := setup(t, func(c *Config) { c.Name = "weekly" })
		_, err := b.board.Page(ctx, firstPage(t, a), 10)
		require.ErrorIs(t, err, ErrInvalidCursor)
	})

	t.Run("SameNameUnderAnotherKeyPrefix", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		other := beside(t, tb, func(c *Config) { c.KeyPrefix += "tenant-b:" })
		_, err := other.Page(ctx, firstPage(t, tb), 10)
		require.ErrorIs(t, err, ErrInvalidCursor)
	})

	// A cursor of version 1 (version byte, CRC-32 of the name, score, user)
	// that this very board would have issued before the upgrade.
	t.Run("OlderFormat", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		firstPage(t, tb)
		buf := []byte{1}
		buf = binary.BigEndian.AppendUint32(buf, crc32.ChecksumIEEE([]byte(tb.board.Name())))
		buf = binary.BigEndian.AppendUint64(buf, 5)
		buf = append(buf, "ada"...)
		_, err := tb.board.Page(ctx, base64.RawURLEncoding.EncodeToString(buf), 10)
		require.ErrorIs(t, err, ErrInvalidCursor)
	})
}

// The board tag is a hash of public configuration, so a client can forge a
// cursor for the board with any score: one outside [MinScore, MaxScore] is
// refused, not read with.
func TestPageCursorScoreOutOfRange(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	for _, score := range []int64{MaxScore + 1, MinScore - 1, math.MaxInt64, math.MinInt64} {
		text := tb.board.encodeCursor(cursor{score: score, user: "ada"})
		_, err := tb.board.Page(ctx, text, 10)
		require.ErrorIs(t, err, ErrInvalidCursor, "score %d", score)
	}
	// The bounds themselves are scores a cursor can carry.
	for _, score := range []int64{MaxScore, MinScore} {
		_, err := tb.board.Page(ctx, tb.board.encodeCursor(cursor{score: score, user: "ada"}), 10)
		require.NoError(t, err, "score %d", score)
	}
}

// Members no user id can be (invalid UTF-8, NUL bytes, the empty string:
// a buggy writer's, which the reconciler reports as orphans) are served by
// Redis reads like any member, so a page may end with one: its cursor is
// the board's own and must take the next page, from Redis and from
// PostgreSQL alike, never be refused.
func TestPageCursorAfterForeignMember(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	tb.submit(t, "alice", 10)
	tb.submit(t, "bob", 5)
	tb.submit(t, "carol", 1)
	tb.drain(t)
	foreign := map[string]int64{"\x00": 10, "bob\xff": 5, "": 1, "c\xffa\x00": 1}
	for member, score := range foreign {
		require.NoError(t, tb.rd.Client.ZAdd(ctx, tb.board.SortedSetKey(), redis.Z{Score: -float64(score), Member: member}).Err())
	}

	// The ranking Redis holds, computed independently: score descending,
	// then member ascending by bytes.
	want := []Entry{{UserID: "alice", Score: 10}, {UserID: "bob", Score: 5}, {UserID: "carol", Score: 1}}
	for member, score := range foreign {
		want = append(want, Entry{UserID: member, Score: score})
	}
	sort.Slice(want, func(i, j int) bool {
		if want[i].Score != want[j].Score {
			return want[i].Score > want[j].Score
		}
		return want[i].UserID < want[j].UserID
	})
	for i := range want {
		want[i].Rank = int64(i + 1)
	}
	pgAll, err := tb.board.Authoritative(ctx, MaxPageSize)
	require.NoError(t, err)
	require.Equal(t, []string{"alice", "bob", "carol"}, users(pgAll))

	for _, size := range []int{1, 2, 3} {
		got, src := allPages(t, tb.board, size, WithPolicy(ServeStale))
		require.Equal(t, SourceRedis, src)
		require.Equal(t, want, got, "page size %d", size)
	}

	// Every entry ends a page of one; the page after it, from either store,
	// starts right after it.
	cur := ""
	for i, last := range want {
		page, err := tb.board.Page(ctx, cur, 1, WithPolicy(ServeStale))
		require.NoError(t, err, "page %d", i+1)
		require.Equal(t, []Entry{last}, page.Entries)
		if i == len(want)-1 {
			require.Empty(t, page.Next)
			break
		}
		require.NotEmpty(t, page.Next)
		cur = page.Next

		next, err := tb.board.Page(ctx, cur, 10, WithPolicy(ServeStale))
		require.NoError(t, err, "after %q", last.UserID)
		require.Equal(t, SourceRedis, next.Freshness.Source)
		require.Equal(t, want[i+1:], next.Entries, "after %q", last.UserID)

		pgWant := []Entry{}
		for _, e := range pgAll {
			if e.Score < last.Score || e.Score == last.Score && e.UserID > last.UserID {
				pgWant = append(pgWant, e)
			}
		}
		fromPG, err := tb.board.Page(ctx, cur, 10, WithPolicy(FallbackToPostgres), forcePostgres())
		require.NoError(t, err, "after %q", last.UserID)
		require.Equal(t, SourcePostgres, fromPG.Freshness.Source)
		require.Equal(t, pgWant, fromPG.Entries, "after %q", last.UserID)
	}
}

func users(entries []Entry) []string {
	out := make([]string, len(entries))
	for i, e := range entries {
		out[i] = e.UserID
	}
	return out
}

// lagging returns a board with policy whose projection holds user-a 10
// while PostgreSQL holds 17 and an outbox row a minute old, far older than
// MaxLag (5 s), is pending; the lag is measured on every read.
//
// MaxLag stays well above a probe's duration: measuring on every read, a
// read's lag is at least its own probe's round trip, which on a loaded
// machine can take tens or hundreds of milliseconds, and a read the test
// expects Redis to answer would then be refused or fall back.
func lagging(t *testing.T, policy ReadPolicy, mutate ...func(*Config)) *testBundle {
	t.Helper()
	tb := setup(t, append([]func(*Config){func(c *Config) {
		c.ReadPolicy = policy
		c.MaxLag = 5 * time.Second
		c.LagProbeInterval = time.Nanosecond
		c.ReadYourWritesTimeout = 20 * time.Millisecond
	}}, mutate...)...)
	tb.submit(t, "user-a", 10)
	tb.drain(t)
	tb.submit(t, "user-a", 7)
	_, err := tb.pg.Pool.Exec(context.Background(), `UPDATE verity_outbox SET created_at = created_at - interval '1 minute'`)
	require.NoError(t, err)
	return tb
}

// requireUpToDate checks that fr is an answer from Redis whose lag is no
// more than the read that returned it could have missed while it ran (since
// is taken just before the read): with a LagProbeInterval shorter than the
// probe's round trip, as in tests that measure on every read, a fresh
// measurement's own age counts as lag.
func requireUpToDate(t *testing.T, fr Freshness, since time.Time) {
	t.Helper()
	require.Equal(t, SourceRedis, fr.Source)
	require.GreaterOrEqual(t, fr.Lag, time.Duration(0))
	require.LessOrEqual(t, fr.Lag, time.Since(since))
}

// failClosedOnPoolOfOne returns a FailClosed board like tb's, with maxLag
// and probe, reading through a pool of one connection made from pc.
func (tb *testBundle) failClosedOnPoolOfOne(t *testing.T, pc *pgxpool.Config, maxLag, probe time.Duration) (*Board, *pgxpool.Pool) {
	t.Helper()
	pc.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(context.Background(), pc)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	cfg := tb.board.Config()
	cfg.ReadPolicy, cfg.MaxLag, cfg.LagProbeInterval = FailClosed, maxLag, probe
	board, err := New(pool, tb.rd.Client, &cfg)
	require.NoError(t, err)
	return board, pool
}

func TestReadPolicies(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("ServeStale", func(t *testing.T) {
		t.Parallel()
		tb := lagging(t, ServeStale)
		r, err := tb.board.Top(ctx, 10)
		require.NoError(t, err)
		require.Equal(t, SourceRedis, r.Freshness.Source)
		require.Equal(t, int64(10), r.Entries[0].Score)
		require.Greater(t, r.Freshness.Lag, 59*time.Second)
		require.WithinDuration(t, time.Now().Add(-r.Freshness.Lag), r.Freshness.ProjectedThrough, time.Second)
		require.Greater(t, tb.board.Freshness(ctx).Lag, 59*time.Second)
	})

	t.Run("FallbackToPostgres", func(t *testing.T) {
		t.Parallel()
		tb := lagging(t, FallbackToPostgres)
		r, err := tb.board.Top(ctx, 10)
		require.NoError(t, err)
		require.Equal(t, SourcePostgres, r.Freshness.Source)
		require.Equal(t, int64(17), r.Entries[0].Score)
		e, fr, err := tb.board.Rank(ctx, "user-a")
		require.NoError(t, err)
		require.Equal(t, SourcePostgres, fr.Source)
		require.Equal(t, int64(17), e.Score)

		// Once drained, the same board answers from Redis again.
		tb.drain(t)
		before := time.Now()
		r, err = tb.board.Top(ctx, 10)
		require.NoError(t, err)
		requireUpToDate(t, r.Freshness, before)
		require.Equal(t, int64(17), r.Entries[0].Score)
	})

	// A PostgreSQL answer reflects the snapshot its statement took, after
	// it was sent: ProjectedThrough is the sending time, so a change that
	// commits while the reply travels is after it, never claimed.
	t.Run("FallbackProjectedThroughIsWhenTheQueryWasSent", func(t *testing.T) {
		t.Parallel()
		tb := lagging(t, FallbackToPostgres)
		pc, err := pgxpool.ParseConfig(tb.pg.ConnString)
		require.NoError(t, err)
		proxy := testenv.StartDelayProxy(t, net.JoinHostPort(pc.ConnConfig.Host, strconv.Itoa(int(pc.ConnConfig.Port))))
		pc.ConnConfig.Host = "127.0.0.1"
		pc.ConnConfig.Port = uint16(proxy.Port())
		pc.MaxConns = 1
		pool, err := pgxpool.NewWithConfig(ctx, pc)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		cfg := tb.board.Config()
		// The lag of a minute is measured once, by the first read.
		cfg.MaxLag, cfg.LagProbeInterval = 30*time.Second, 20*time.Second
		board, err := New(pool, tb.rd.Client, &cfg)
		require.NoError(t, err)
		// Also prepares the page statement on the pool's connection.
		r, err := board.Top(ctx, 10)
		require.NoError(t, err)
		require.Equal(t, SourcePostgres, r.Freshness.Source)

		proxy.SetDelay(800 * time.Millisecond)
		type answer struct {
			r   Ranking
			err error
		}
		done := make(chan answer, 1)
		go func() {
			r, err := board.Top(ctx, 10)
			done <- answer{r, err}
		}()
		time.Sleep(200 * time.Millisecond) // the statement's snapshot is taken; its reply travels
		tb.submit(t, "late", 500)
		committed := time.Now()
		got := <-done
		proxy.SetDelay(0)
		require.NoError(t, got.err)
		require.Equal(t, SourcePostgres, got.r.Freshness.Source)
		require.Len(t, got.r.Entries, 1, "setup: the answer's snapshot predates \"late\"")
		require.False(t, got.r.Freshness.ProjectedThrough.IsZero())
		require.False(t, got.r.Freshness.ProjectedThrough.After(committed),
			"ProjectedThrough %s claims \"late\", committed %s before it, which the answer lacks",
			got.r.Freshness.ProjectedThrough.Format(time.RFC3339Nano), got.r.Freshness.ProjectedThrough.Sub(committed))
	})

	t.Run("FailClosed", func(t *testing.T) {
		t.Parallel()
		tb := lagging(t, FailClosed, func(c *Config) { c.ReadYourWritesTimeout = 5 * time.Second })
		_, err := tb.board.Top(ctx, 10)
		require.ErrorIs(t, err, ErrStale)
		var stale *StaleError
		require.ErrorAs(t, err, &stale)
		require.Greater(t, stale.Lag, 59*time.Second)
		_, err = tb.board.Around(ctx, "user-a", 1)
		require.ErrorIs(t, err, ErrStale)
	})

	// An AtLeast the wait found unmet, on a board whose lag is also above
	// MaxLag: the StaleError names the requirement (AtLeast's contract),
	// with the lag, rather than only the lag.
	t.Run("UnmetAtLeastOnALaggingBoardNamesIt", func(t *testing.T) {
		t.Parallel()
		tb := lagging(t, FailClosed)
		_, _, err := tb.board.Rank(ctx, "user-a", AtLeast("user-a", 2)) // version 2 is pending
		var stale *StaleError
		require.ErrorAs(t, err, &stale)
		require.Equal(t, "user-a", stale.UserID)
		require.Equal(t, int64(2), stale.Version)
		require.Greater(t, stale.Lag, 59*time.Second)
	})

	// An AtLeast that Redis already meets says nothing of the rest of the
	// board: the lag still decides, as for a read without it.
	t.Run("MetAtLeastDoesNotExcuseLag", func(t *testing.T) {
		t.Parallel()
		tb := lagging(t, FailClosed)
		_, err := tb.board.Top(ctx, 10, AtLeast("user-a", 1)) // projected; version 2 is not
		var stale *StaleError
		require.ErrorAs(t, err, &stale)
		require.Greater(t, stale.Lag, 59*time.Second)
		_, _, err = tb.board.Rank(ctx, "user-a", AtLeast("user-a", 1))
		require.ErrorIs(t, err, ErrStale)

		r, err := tb.board.Top(ctx, 10, AtLeast("user-a", 1), WithPolicy(FallbackToPostgres))
		require.NoError(t, err)
		require.Equal(t, SourcePostgres, r.Freshness.Source)
		require.True(t, r.Freshness.AtLeastMet)
		require.Equal(t, int64(17), r.Entries[0].Score)
	})

	t.Run("FallbackWhenRedisFails", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) { c.ReadPolicy = FallbackToPostgres })
		tb.submit(t, "user-a", 10)
		tb.drain(t)
		// A value of the wrong type makes the Redis read fail.
		require.NoError(t, tb.rd.Client.Del(ctx, tb.board.SortedSetKey()).Err())
		require.NoError(t, tb.rd.Client.Set(ctx, tb.board.SortedSetKey(), "x", 0).Err())
		r, err := tb.board.Top(ctx, 10)
		require.NoError(t, err)
		require.Equal(t, SourcePostgres, r.Freshness.Source)
		require.Equal(t, int64(10), r.Entries[0].Score)

		_, err = tb.board.Top(ctx, 10, WithPolicy(ServeStale))
		require.Error(t, err)
	})

	// Redis failing on every read is one condition, not one per read: the
	// board logs the first at once, then at most one a second, each line
	// counting the reads it left out since the line before.
	t.Run("FallbackWhenRedisFailsLogsAtMostOnceASecond", func(t *testing.T) {
		t.Parallel()
		logs := &testenv.LogSink{}
		tb := setup(t, func(c *Config) { c.ReadPolicy = FallbackToPostgres; c.Logger = logs.Logger() })
		tb.submit(t, "user-a", 10)
		tb.drain(t)
		require.NoError(t, tb.rd.Client.Del(ctx, tb.board.SortedSetKey()).Err())
		require.NoError(t, tb.rd.Client.Set(ctx, tb.board.SortedSetKey(), "x", 0).Err())
		const msg = "leaderboard: Redis read failed; answering from PostgreSQL"
		const reads = 100
		start := time.Now()
		for range reads {
			r, err := tb.board.Top(ctx, 10)
			require.NoError(t, err)
			require.Equal(t, SourcePostgres, r.Freshness.Source)
		}
		elapsed := time.Since(start)
		lines := logs.Lines(t, msg)
		require.NotEmpty(t, lines, "the failure is logged")
		require.LessOrEqual(t, len(lines), 1+int(elapsed/lograte.Interval),
			"%d lines for %d reads in %v", len(lines), reads, elapsed)
		require.Zero(t, lines[0][lograte.Suppressed], "the first failure is logged at once")

		// Once the interval is over, the next failure is logged with the
		// count of those left out.
		time.Sleep(lograte.Interval)
		_, err := tb.board.Top(ctx, 10)
		require.NoError(t, err)
		lines = logs.Lines(t, msg)
		require.Positive(t, lines[len(lines)-1][lograte.Suppressed])
		logged := 0.0
		for _, l := range lines {
			require.Equal(t, "weekly-2026-48", l["board"])
			logged += 1 + l[lograte.Suppressed].(float64)
		}
		require.EqualValues(t, reads+1, logged, "each failure is logged or counted by a line")
	})

	// An AtLeast read whose wait for the versions fails falls back as the
	// Redis read does: logged, unless the caller's own ctx ended.
	t.Run("FallbackWhenTheWaitFailsIsLogged", func(t *testing.T) {
		t.Parallel()
		logs := &testenv.LogSink{}
		tb := setup(t, func(c *Config) { c.ReadPolicy = FallbackToPostgres; c.Logger = logs.Logger() })
		res := tb.submit(t, "user-a", 10)
		tb.drain(t)
		vkey := tb.board.ks.VersionKey(tb.board.target("user-a"))
		require.NoError(t, tb.rd.Client.Del(ctx, vkey).Err())
		require.NoError(t, tb.rd.Client.Set(ctx, vkey, "x", 0).Err()) // WRONGTYPE for HGET

		e, fresh, err := tb.board.Rank(ctx, "user-a", AtLeast("user-a", res.Version))
		require.NoError(t, err)
		require.Equal(t, SourcePostgres, fresh.Source)
		require.Equal(t, int64(10), e.Score)
		require.Len(t, logs.Lines(t, "leaderboard: Redis read failed; answering from PostgreSQL"), 1)

		canceled, cancel := context.WithCancel(ctx)
		cancel()
		_, _, err = tb.board.Rank(canceled, "user-a", AtLeast("user-a", res.Version))
		require.ErrorIs(t, err, context.Canceled)

		// The other policies do not fall back: the failure is the answer.
		for _, p := range []ReadPolicy{ServeStale, FailClosed} {
			_, fresh, err := tb.board.Rank(ctx, "user-a", AtLeast("user-a", res.Version), WithPolicy(p))
			require.Error(t, err, "%s answered from %s", p, fresh.Source)
			require.NotErrorIs(t, err, ErrStale, "%s", p)
		}
	})

	t.Run("CorruptScoreFailsLikeTheScripts", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		tb.submit(t, "alice", 10)
		tb.submit(t, "bob", 5)
		tb.drain(t)
		first, err := tb.board.Top(ctx, 1)
		require.NoError(t, err)
		require.NotEmpty(t, first.Next) // after (10, "alice")

		// Sorted-set scores the projection never writes, by hand.
		key := tb.board.SortedSetKey()
		for _, z := range []float64{
			math.Inf(-1),           // board score +inf: first
			math.Inf(1),            // board score -inf: last
			1.5,                    // board score -1.5: a fraction
			-float64(MaxScore) - 2, // board score MaxScore+2: out of range, first
			-float64(MinScore) + 2, // board score MinScore-2: out of range, last
		} {
			msg := fmt.Sprintf("mallory's sorted-set score %v", z)
			require.NoError(t, tb.rd.Client.ZAdd(ctx, key, redis.Z{Score: z, Member: "mallory"}).Err())

			// The script-based reads refuse the entry...
			_, _, err := tb.board.Rank(ctx, "mallory")
			require.ErrorIs(t, err, ErrCorruptScore, msg)
			_, err = tb.board.Around(ctx, "alice", 2) // mallory is 1 or 2 away
			require.ErrorIs(t, err, ErrCorruptScore, msg)
			// ...and so do Top and the first page, read with ZRANGE,
			// rather than answer a garbage score.
			r, err := tb.board.Top(ctx, 10)
			require.ErrorIs(t, err, ErrCorruptScore, "%s: %+v", msg, r)
			if z < -10 { // mallory comes first
				r, err = tb.board.Top(ctx, 1)
				require.ErrorIs(t, err, ErrCorruptScore, "%s: %+v", msg, r)
			} else { // mallory follows alice: the page after her meets it too
				r, err = tb.board.Page(ctx, first.Next, 10)
				require.ErrorIs(t, err, ErrCorruptScore, "%s: %+v", msg, r)
			}
			r, err = tb.board.Page(ctx, "", 10)
			require.ErrorIs(t, err, ErrCorruptScore, "%s: %+v", msg, r)

			// Like any failed Redis read, FallbackToPostgres answers from
			// PostgreSQL, which has no mallory.
			r, err = tb.board.Top(ctx, 10, WithPolicy(FallbackToPostgres))
			require.NoError(t, err, msg)
			require.Equal(t, SourcePostgres, r.Freshness.Source, msg)
			require.Equal(t, []Entry{{UserID: "alice", Score: 10, Rank: 1}, {UserID: "bob", Score: 5, Rank: 2}}, r.Entries, msg)
			_, _, err = tb.board.Rank(ctx, "mallory", WithPolicy(FallbackToPostgres))
			require.ErrorIs(t, err, ErrUserNotFound, msg)

			require.NoError(t, tb.rd.Client.ZRem(ctx, key, "mallory").Err())
		}

		// Redis refuses a NaN score; the rule refuses it too. The range's
		// bounds are board scores.
		_, err = boardScore("mallory", math.NaN())
		require.ErrorIs(t, err, ErrCorruptScore)
		for _, s := range []int64{MinScore, -1, 0, 1, MaxScore} {
			got, err := boardScore("mallory", -float64(s))
			require.NoError(t, err)
			require.Equal(t, s, got)
		}
	})
}

func TestReadYourWrites(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("WaitsForTheProjection", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) {
			c.ReadPolicy = FailClosed
			c.ReadYourWritesTimeout = 5 * time.Second
		})
		res := tb.submit(t, "user-a", 10)
		worker, err := tb.board.Worker(nil)
		require.NoError(t, err)
		drained := make(chan error, 1)
		go func() {
			time.Sleep(50 * time.Millisecond)
			_, err := worker.Drain(ctx)
			drained <- err
		}()
		e, fr, err := tb.board.Rank(ctx, "user-a", AtLeast("user-a", res.Version))
		require.NoError(t, <-drained)
		require.NoError(t, err)
		require.Equal(t, SourceRedis, fr.Source)
		require.True(t, fr.AtLeastMet)
		require.Equal(t, int64(10), e.Score)
	})

	t.Run("FallsBack", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) {
			c.ReadPolicy = FallbackToPostgres
			c.ReadYourWritesTimeout = 10 * time.Millisecond
		})
		tb.submit(t, "user-a", 10)
		tb.drain(t)
		res := tb.submit(t, "user-a", 5)
		e, fr, err := tb.board.Rank(ctx, "user-a", AtLeast("user-a", res.Version))
		require.NoError(t, err)
		require.Equal(t, SourcePostgres, fr.Source)
		require.Equal(t, int64(15), e.Score)

		// FailClosed refuses; ServeStale answers from Redis and says so.
		_, _, err = tb.board.Rank(ctx, "user-a", AtLeast("user-a", res.Version), WithPolicy(FailClosed))
		require.ErrorIs(t, err, ErrStale)
		e, fr, err = tb.board.Rank(ctx, "user-a", AtLeast("user-a", res.Version), WithPolicy(ServeStale))
		require.NoError(t, err)
		require.Equal(t, SourceRedis, fr.Source)
		require.False(t, fr.AtLeastMet)
		require.Equal(t, int64(10), e.Score)
	})

	// A caller that gives up while its read waits for a version gets its
	// own ctx's error, under FailClosed too: not a *StaleError, which
	// would blame the projection.
	t.Run("CallerGivingUpDuringTheWaitIsNotStale", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) {
			c.ReadPolicy = FailClosed
			c.ReadYourWritesTimeout = time.Minute
		})
		res := tb.submit(t, "user-a", 10) // never projected
		rctx, cancel := context.WithCancel(ctx)
		defer time.AfterFunc(300*time.Millisecond, cancel).Stop()
		_, _, err := tb.board.Rank(rctx, "user-a", AtLeast("user-a", res.Version))
		require.ErrorIs(t, err, context.Canceled)
		require.NotErrorIs(t, err, ErrStale)
	})

	// The same when the wait itself ran out and the caller gives up in the
	// lag probe that follows it: a lag its own cancellation left
	// unmeasured (-1) is no staleness to report.
	t.Run("CallerGivingUpAfterTheWaitIsNotStale", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) {
			c.ReadPolicy = FailClosed
			c.ReadYourWritesTimeout = time.Nanosecond // spent by the first poll
			c.LagProbeInterval = time.Nanosecond      // every read measures
		})
		res := tb.submit(t, "user-a", 10) // never projected
		rctx, cancel := context.WithCancel(ctx)
		defer cancel()
		hook := &afterVersionPoll{run: cancel}
		hook.armed.Store(true)
		tb.rd.Client.AddHook(hook)
		_, _, err := tb.board.Rank(rctx, "user-a", AtLeast("user-a", res.Version))
		require.False(t, hook.armed.Load(), "the wait polled")
		require.ErrorIs(t, err, context.Canceled)
		require.NotErrorIs(t, err, ErrStale)
	})

	t.Run("UnprojectedNewUserIsStaleNotMissing", func(t *testing.T) {
		t.Parallel()
		// A user's first score, not projected yet: with ServeStale the
		// read answers from Redis, where the user does not exist — which
		// must not come back as "no score" for a score just saved.
		tb := setup(t, func(c *Config) {
			c.ReadPolicy = ServeStale
			c.ReadYourWritesTimeout = 10 * time.Millisecond
		})
		res := tb.submit(t, "user-new", 5)
		_, _, err := tb.board.Rank(ctx, "user-new", AtLeast("user-new", res.Version))
		var stale *StaleError
		require.ErrorAs(t, err, &stale)
		require.Equal(t, "user-new", stale.UserID)
		require.Equal(t, res.Version, stale.Version)
		_, err = tb.board.Around(ctx, "user-new", 1, AtLeast("user-new", res.Version))
		require.ErrorIs(t, err, ErrStale)
		// Without AtLeast, Redis's answer stands.
		_, _, err = tb.board.Rank(ctx, "user-new")
		require.ErrorIs(t, err, ErrUserNotFound)
	})

	t.Run("LegacyUnbucketedProjectionIsRefused", func(t *testing.T) {
		t.Parallel()
		// A projection of a release before layout keys: versions in the
		// unbucketed hash, no layout key. The gate reads it as 0 buckets,
		// and so must a bucketed board's AtLeast, instead of waiting.
		tb := setup(t, func(cfg *Config) { cfg.ReadYourWritesTimeout = 5 * time.Second })
		res := tb.submit(t, "ada", 10)
		tb.drain(t)
		require.NoError(t, tb.rd.Client.Del(ctx, tb.board.layoutKey).Err())
		cfg := tb.board.Config()
		cfg.VersionBuckets = 8
		other, err := New(tb.pg.Pool, tb.rd.Client, &cfg)
		require.NoError(t, err)
		t.Cleanup(other.Close)
		start := time.Now()
		_, _, err = other.Rank(ctx, "ada", AtLeast("ada", res.Version), WithPolicy(FailClosed))
		require.ErrorIs(t, err, projection.ErrLayoutMismatch)
		require.Less(t, time.Since(start), 2*time.Second, "refused at once")
		_, _, err = tb.board.Rank(ctx, "ada", AtLeast("ada", res.Version), WithPolicy(FailClosed))
		require.NoError(t, err, "the unbucketed board still reads it")
	})

	t.Run("LostLayoutKeyIsRefused", func(t *testing.T) {
		t.Parallel()
		// A projection that lost its layout key but kept its sorted set
		// (a DEL, an eviction): the gate refuses every writer, so no
		// version can come, and an AtLeast read must fail at once as the
		// gate does instead of waiting out ReadYourWritesTimeout. An
		// unbucketed projection that lost only the layout key still has
		// its version hash, which the gate reads as 0 buckets.
		for _, c := range []struct {
			name     string
			buckets  int
			alsoLost func(tb *testBundle) []string // keys lost with the layout key
			refused  bool
		}{
			{"Bucketed", 8, func(*testBundle) []string { return nil }, true},
			{"UnbucketedWithItsVersions", 0, func(*testBundle) []string { return nil }, false},
			{"UnbucketedWithoutItsVersions", 0, func(tb *testBundle) []string { return []string{tb.board.unbucketedKey} }, true},
		} {
			t.Run(c.name, func(t *testing.T) {
				t.Parallel()
				tb := setup(t, func(cfg *Config) {
					cfg.VersionBuckets = c.buckets
					cfg.ReadYourWritesTimeout = 5 * time.Second
				})
				res := tb.submit(t, "ada", 10)
				tb.drain(t)
				require.NoError(t, tb.rd.Client.Del(ctx, append(c.alsoLost(tb), tb.board.layoutKey)...).Err())
				need := []requirement{{"ada", res.Version}}

				// The script a read runs with its versions, on its own:
				// a layout lost between the wait and the read.
				_, first, err := tb.board.evalWithVersions(ctx, aroundAtLeastScript, need, "ada", 1)
				if !c.refused {
					require.NoError(t, err)
					require.Equal(t, -1, first, "the version is met")
					_, fr, err := tb.board.Rank(ctx, "ada", AtLeast("ada", res.Version), WithPolicy(FailClosed))
					require.NoError(t, err)
					require.True(t, fr.AtLeastMet)
					return
				}
				var mismatch *projection.LayoutMismatchError
				require.ErrorAs(t, err, &mismatch)
				require.Equal(t, -1, mismatch.Stored, "the bucket count is unknown")
				require.Equal(t, c.buckets, mismatch.Configured)

				for _, policy := range []ReadPolicy{ServeStale, FallbackToPostgres, FailClosed} {
					start := time.Now()
					_, _, err := tb.board.Rank(ctx, "ada", AtLeast("ada", res.Version), WithPolicy(policy))
					require.ErrorAs(t, err, &mismatch, "%s", policy)
					require.Equal(t, -1, mismatch.Stored)
					_, err = tb.board.Top(ctx, 10, AtLeast("ada", res.Version), WithPolicy(policy))
					require.ErrorIs(t, err, projection.ErrLayoutMismatch, "%s", policy)
					require.Less(t, time.Since(start), tb.board.Config().ReadYourWritesTimeout, "%s: refused without waiting", policy)
				}
			})
		}
	})

	t.Run("OtherBucketCountIsRefused", func(t *testing.T) {
		t.Parallel()
		// A rolling deploy that changes VersionBuckets: a board with the
		// other count looks the version up in a key that does not hold
		// it, and must be refused at once instead of waiting and
		// reporting a version the projection reached long ago as unmet.
		for _, c := range []struct {
			name           string
			stored, reader int
		}{{"UnbucketedStoredBucketedReader", 0, 8}, {"BucketedStoredUnbucketedReader", 8, 0}, {"OtherBucketedCount", 8, 3}} {
			t.Run(c.name, func(t *testing.T) {
				t.Parallel()
				tb := setup(t, func(cfg *Config) {
					cfg.VersionBuckets = c.stored
					cfg.ReadYourWritesTimeout = 5 * time.Second
				})
				res := tb.submit(t, "ada", 10)
				tb.drain(t)
				_, fr, err := tb.board.Rank(ctx, "ada", AtLeast("ada", res.Version), WithPolicy(FailClosed))
				require.NoError(t, err)
				require.True(t, fr.AtLeastMet, "the board of the stored count sees the version")

				cfg := tb.board.Config()
				cfg.VersionBuckets = c.reader
				other, err := New(tb.pg.Pool, tb.rd.Client, &cfg)
				require.NoError(t, err)
				t.Cleanup(other.Close)
				for _, policy := range []ReadPolicy{ServeStale, FallbackToPostgres, FailClosed} {
					start := time.Now()
					_, _, err := other.Rank(ctx, "ada", AtLeast("ada", res.Version), WithPolicy(policy))
					require.ErrorIs(t, err, projection.ErrLayoutMismatch, "%s", policy)
					var mismatch *projection.LayoutMismatchError
					require.ErrorAs(t, err, &mismatch)
					require.Equal(t, c.stored, mismatch.Stored)
					require.Equal(t, c.reader, mismatch.Configured)
					require.Less(t, time.Since(start), cfg.ReadYourWritesTimeout, "%s: refused without waiting", policy)
				}
				// Reads without AtLeast do not need the versions.
				e, _, err := other.Rank(ctx, "ada", WithPolicy(FailClosed))
				require.NoError(t, err)
				require.Equal(t, int64(10), e.Score)
			})
		}
	})

	t.Run("SeveralAtLeastAllHonoured", func(t *testing.T) {
		t.Parallel()
		// A transaction scores both players of a match (SubmitTx twice),
		// and the read asks for both writes: every AtLeast counts, not the
		// last one given.
		for _, buckets := range []int{0, 8} {
			t.Run(fmt.Sprintf("Buckets%d", buckets), func(t *testing.T) {
				t.Parallel()
				tb := setup(t, func(c *Config) {
					c.VersionBuckets = buckets
					c.ReadYourWritesTimeout = 50 * time.Millisecond
				})
				tb.submit(t, "winner", 1)
				tb.submit(t, "loser", 1)
				tb.drain(t)
				tx, err := tb.pg.Pool.Begin(ctx)
				require.NoError(t, err)
				t.Cleanup(func() { _ = tx.Rollback(ctx) })
				win, err := tb.board.SubmitTx(ctx, tx, Command{EventID: uuid.New(), UserID: "winner", Delta: 3})
				require.NoError(t, err)
				lose, err := tb.board.SubmitTx(ctx, tx, Command{EventID: uuid.New(), UserID: "loser", Delta: -1})
				require.NoError(t, err)
				require.NoError(t, tx.Commit(ctx))
				require.Equal(t, int64(2), win.Version)
				require.Equal(t, int64(2), lose.Version)

				// Redis holds version 1 of both: loser at least 1 is met,
				// winner at least 2 is not, in either order.
				both := [][]ReadOption{
					{AtLeast("winner", win.Version), AtLeast("loser", 1)},
					{AtLeast("loser", 1), AtLeast("winner", win.Version)},
				}
				for _, opts := range both {
					e, fr, err := tb.board.Rank(ctx, "winner", append(opts, WithPolicy(ServeStale))...)
					require.NoError(t, err)
					require.Equal(t, SourceRedis, fr.Source)
					require.False(t, fr.AtLeastMet, "winner's version %d is not in Redis", win.Version)
					require.Equal(t, int64(1), e.Score)

					_, err = tb.board.Top(ctx, 10, append(opts, WithPolicy(FailClosed))...)
					var stale *StaleError
					require.ErrorAs(t, err, &stale)
					require.Equal(t, "winner", stale.UserID)
					require.Equal(t, win.Version, stale.Version)

					e, fr, err = tb.board.Rank(ctx, "winner", append(opts, WithPolicy(FallbackToPostgres))...)
					require.NoError(t, err)
					require.Equal(t, SourcePostgres, fr.Source)
					require.True(t, fr.AtLeastMet)
					require.Equal(t, int64(4), e.Score)
				}

				// The StaleError names the first requirement unmet, in the
				// order given.
				_, err = tb.board.Top(ctx, 10, AtLeast("loser", lose.Version), AtLeast("winner", win.Version), WithPolicy(FailClosed))
				var stale *StaleError
				require.ErrorAs(t, err, &stale)
				require.Equal(t, "loser", stale.UserID)
				require.Equal(t, lose.Version, stale.Version)

				// Two for one user ask for the higher version, whichever
				// comes first.
				for _, opts := range [][]ReadOption{
					{AtLeast("winner", 1), AtLeast("winner", win.Version)},
					{AtLeast("winner", win.Version), AtLeast("winner", 1)},
				} {
					_, err = tb.board.Top(ctx, 10, append(opts, WithPolicy(FailClosed))...)
					require.ErrorAs(t, err, &stale)
					require.Equal(t, "winner", stale.UserID)
					require.Equal(t, win.Version, stale.Version)
				}

				tb.drain(t)
				for _, opts := range both {
					r, err := tb.board.Top(ctx, 10, append(opts, WithPolicy(FailClosed))...)
					require.NoError(t, err)
					require.Equal(t, SourceRedis, r.Freshness.Source)
					require.True(t, r.Freshness.AtLeastMet)
					require.Equal(t, []Entry{{UserID: "winner", Score: 4, Rank: 1}, {UserID: "loser", Score: 0, Rank: 2}}, r.Entries)
				}
			})
		}
	})

	t.Run("RedisWentBackAfterTheWait", func(t *testing.T) {
		t.Parallel()
		// Redis goes back to an older state of the board right after the
		// wait saw every version asked for, as a failover to a replica that
		// missed the newest writes makes it: the answer must be checked
		// against the versions in the step that reads it, and a shortfall
		// handled as an unmet wait, never reported as met.
		for _, buckets := range []int{0, 8} {
			t.Run(fmt.Sprintf("Buckets%d", buckets), func(t *testing.T) {
				t.Parallel()
				tb := setup(t, func(c *Config) {
					c.VersionBuckets = buckets
					c.MaxLag = time.Hour
				})
				opt, err := redis.ParseURL(tb.rd.URL)
				require.NoError(t, err)
				admin := redis.NewClient(opt)
				t.Cleanup(func() { _ = admin.Close() })

				leader := tb.submit(t, "leader", 100)
				before := tb.submit(t, "ada", 10)
				tb.drain(t)
				after := tb.submit(t, "ada", 5)
				newbie := tb.submit(t, "newbie", 3)
				tb.drain(t)

				zset := tb.board.SortedSetKey()
				versionKey := func(user string) string { return tb.board.Keyspace().VersionKey(tb.board.target(user)) }
				set := func(p redis.Pipeliner, user string, res Result) {
					p.ZAdd(ctx, zset, redis.Z{Score: float64(-res.Score), Member: user})
					p.HSet(ctx, versionKey(user), user, res.Version)
				}
				hook := &afterVersionPoll{run: func() {
					// Redis as it was after the first drain.
					_, err := admin.TxPipelined(ctx, func(p redis.Pipeliner) error {
						set(p, "ada", before)
						p.ZRem(ctx, zset, "newbie")
						p.HDel(ctx, versionKey("newbie"), "newbie")
						return nil
					})
					require.NoError(t, err)
				}}
				tb.rd.Client.AddHook(hook)
				goBackAfterTheWait := func() {
					_, err := admin.TxPipelined(ctx, func(p redis.Pipeliner) error {
						set(p, "ada", after)
						set(p, "newbie", newbie)
						return nil
					})
					require.NoError(t, err)
					hook.armed.Store(true)
				}

				afterLeader := tb.board.encodeCursor(cursor{score: leader.Score, user: "leader"})
				reads := []struct {
					name string
					run  func(opts ...ReadOption) ([]Entry, Freshness, error)
				}{
					{"Top", func(opts ...ReadOption) ([]Entry, Freshness, error) {
						r, err := tb.board.Top(ctx, 10, opts...)
						return r.Entries, r.Freshness, err
					}},
					{"Page", func(opts ...ReadOption) ([]Entry, Freshness, error) {
						r, err := tb.board.Page(ctx, afterLeader, 10, opts...)
						return r.Entries, r.Freshness, err
					}},
					{"Rank", func(opts ...ReadOption) ([]Entry, Freshness, error) {
						e, fr, err := tb.board.Rank(ctx, "ada", opts...)
						return []Entry{e}, fr, err
					}},
					{"Around", func(opts ...ReadOption) ([]Entry, Freshness, error) {
						r, err := tb.board.Around(ctx, "ada", 1, opts...)
						return r.Entries, r.Freshness, err
					}},
				}
				scoreOf := func(entries []Entry, user string) int64 {
					t.Helper()
					for _, e := range entries {
						if e.UserID == user {
							return e.Score
						}
					}
					require.Failf(t, "no entry", "%s is not in %v", user, entries)
					return 0
				}
				for _, read := range reads {
					atLeast := []ReadOption{AtLeast("ada", after.Version), AtLeast("leader", leader.Version)}

					goBackAfterTheWait()
					entries, fr, err := read.run(append(atLeast, WithPolicy(ServeStale))...)
					require.False(t, hook.armed.Load(), "%s: setup: Redis went back after the wait", read.name)
					require.NoError(t, err, read.name)
					require.Equal(t, SourceRedis, fr.Source, read.name)
					require.Equal(t, before.Score, scoreOf(entries, "ada"), "%s: setup: the answer is the older state's", read.name)
					require.False(t, fr.AtLeastMet, "%s: Redis answered without version %d of ada", read.name, after.Version)

					goBackAfterTheWait()
					entries, fr, err = read.run(append(atLeast, WithPolicy(FallbackToPostgres))...)
					require.False(t, hook.armed.Load(), "%s: setup: Redis went back after the wait", read.name)
					require.NoError(t, err, read.name)
					require.Equal(t, SourcePostgres, fr.Source, read.name)
					require.True(t, fr.AtLeastMet, read.name)
					require.Equal(t, after.Score, scoreOf(entries, "ada"), read.name)

					goBackAfterTheWait()
					_, _, err = read.run(append(atLeast, WithPolicy(FailClosed))...)
					require.False(t, hook.armed.Load(), "%s: setup: Redis went back after the wait", read.name)
					var stale *StaleError
					require.ErrorAs(t, err, &stale, read.name)
					require.Equal(t, "ada", stale.UserID, read.name)
					require.Equal(t, after.Version, stale.Version, read.name)
				}

				// A first score that Redis lost after the wait saw it is
				// stale, not missing.
				for _, read := range []func(opts ...ReadOption) error{
					func(opts ...ReadOption) error { _, _, err := tb.board.Rank(ctx, "newbie", opts...); return err },
					func(opts ...ReadOption) error { _, err := tb.board.Around(ctx, "newbie", 1, opts...); return err },
				} {
					goBackAfterTheWait()
					err := read(AtLeast("newbie", newbie.Version), WithPolicy(ServeStale))
					require.False(t, hook.armed.Load(), "setup: Redis went back after the wait")
					var stale *StaleError
					require.ErrorAs(t, err, &stale)
					require.Equal(t, "newbie", stale.UserID)
					require.Equal(t, newbie.Version, stale.Version)
				}
				goBackAfterTheWait()
				e, fr, err := tb.board.Rank(ctx, "newbie", AtLeast("newbie", newbie.Version), WithPolicy(FallbackToPostgres))
				require.False(t, hook.armed.Load(), "setup: Redis went back after the wait")
				require.NoError(t, err)
				require.Equal(t, SourcePostgres, fr.Source)
				require.True(t, fr.AtLeastMet)
				require.Equal(t, newbie.Score, e.Score)
			})
		}
	})

	// Pages read with AtLeast run other scripts than those without (under
	// versions.lua): walking the board page by page with them must reach
	// the same entries, Next included.
	t.Run("PagesWithAtLeastWalkTheBoard", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) { c.ReadPolicy = FailClosed })
		var last Result
		for i, u := range []string{"ada", "bob", "cy", "dee", "eve"} {
			last = tb.submit(t, u, int64(10*(i%3)))
		}
		tb.drain(t)
		want, _ := allPages(t, tb.board, 2)
		require.Len(t, want, 5)
		got, source := allPages(t, tb.board, 2, AtLeast("eve", last.Version))
		require.Equal(t, SourceRedis, source)
		require.Equal(t, want, got)
	})

	// The projection's layout changes right after the wait checked it (a
	// rebuild to another VersionBuckets, a projection of a release before
	// layout keys restored): the versions the script reads are then not
	// the projection's, and the read fails with the mismatch, under every
	// policy, rather than answer from them.
	t.Run("LayoutChangedAfterTheWait", func(t *testing.T) {
		t.Parallel()
		for name, c := range map[string]struct {
			buckets int
			change  func(p redis.Pipeliner, tb *testBundle)
		}{
			"OtherCount": {0, func(p redis.Pipeliner, tb *testBundle) {
				p.Set(ctx, tb.board.layoutKey, "8", 0)
			}},
			"UnbucketedHash": {8, func(p redis.Pipeliner, tb *testBundle) {
				p.Del(ctx, tb.board.layoutKey)
				p.HSet(ctx, tb.board.unbucketedKey, "ada", 1)
			}},
		} {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				tb := setup(t, func(cfg *Config) { cfg.VersionBuckets = c.buckets })
				opt, err := redis.ParseURL(tb.rd.URL)
				require.NoError(t, err)
				admin := redis.NewClient(opt)
				t.Cleanup(func() { _ = admin.Close() })
				res := tb.submit(t, "ada", 10)
				tb.drain(t)
				layout, err := admin.Get(ctx, tb.board.layoutKey).Result()
				require.NoError(t, err)
				hook := &afterVersionPoll{run: func() {
					_, err := admin.TxPipelined(ctx, func(p redis.Pipeliner) error {
						c.change(p, tb)
						return nil
					})
					require.NoError(t, err)
				}}
				tb.rd.Client.AddHook(hook)
				for _, policy := range []ReadPolicy{ServeStale, FallbackToPostgres, FailClosed} {
					_, err := admin.TxPipelined(ctx, func(p redis.Pipeliner) error {
						p.Set(ctx, tb.board.layoutKey, layout, 0)
						p.Del(ctx, tb.board.unbucketedKey)
						return nil
					})
					require.NoError(t, err)
					hook.armed.Store(true)
					_, fr, err := tb.board.Rank(ctx, "ada", AtLeast("ada", res.Version), WithPolicy(policy))
					require.False(t, hook.armed.Load(), "%s: setup: the layout changed after the wait", policy)
					require.ErrorIs(t, err, projection.ErrLayoutMismatch, "%s: answered from %s, AtLeastMet %v", policy, fr.Source, fr.AtLeastMet)
				}
			})
		}
	})

	t.Run("MaxAtLeastUsers", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) {
			c.VersionBuckets = 4
			c.ReadYourWritesTimeout = 5 * time.Second
		})
		cmds := make([]Command, MaxAtLeast)
		opts := make([]ReadOption, 0, MaxAtLeast+2)
		for i := range cmds {
			cmds[i] = Command{EventID: uuid.New(), UserID: fmt.Sprintf("user-%02d", i), Delta: int64(i)}
			opts = append(opts, AtLeast(cmds[i].UserID, 1))
		}
		_, err := tb.board.SubmitBatch(ctx, cmds)
		require.NoError(t, err)
		tb.drain(t)
		// A repeated user and a version of 0 do not count.
		opts = append(opts, AtLeast("user-00", 1), AtLeast("someone-else", 0))
		for _, extra := range [][]ReadOption{{WithPolicy(FailClosed)}, {WithPolicy(FallbackToPostgres), forcePostgres()}} {
			r, err := tb.board.Top(ctx, 3, append(opts, extra...)...)
			require.NoError(t, err)
			require.True(t, r.Freshness.AtLeastMet)
			require.Len(t, r.Entries, 3)
		}
		_, err = tb.board.Top(ctx, 3, append(opts, AtLeast("one-too-many", 1))...)
		require.ErrorIs(t, err, ErrInvalidReadOption)
	})

	// A version counts the user's committed commands: a rolled-back
	// SubmitTx's number goes to the user's next command, which then meets
	// AtLeast of it, as the docs say, with its own score.
	t.Run("RolledBackVersionGoesToTheNextCommand", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) {
			c.ReadPolicy = FallbackToPostgres
			c.ReadYourWritesTimeout = 20 * time.Millisecond
		})
		tb.submit(t, "ada", 5)
		tx, err := tb.pg.Pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(ctx) })
		staged, err := tb.board.SubmitTx(ctx, tx, Command{EventID: uuid.New(), UserID: "ada", Delta: 500})
		require.NoError(t, err)
		require.NoError(t, tx.Rollback(ctx))
		next := tb.submit(t, "ada", 1)
		require.Equal(t, staged.Version, next.Version)

		e, fr, err := tb.board.Rank(ctx, "ada", AtLeast("ada", staged.Version))
		require.NoError(t, err)
		require.True(t, fr.AtLeastMet)
		require.Equal(t, int64(6), e.Score, "the next command's score, not the rolled-back one's %d", staged.Score)
	})

	t.Run("FallbackMeetsOnlyCommittedVersions", func(t *testing.T) {
		t.Parallel()
		// FallbackToPostgres answers what PostgreSQL has committed. A
		// version it lacks too (the SubmitTx that returned it rolled back,
		// or has not committed yet) is not in the answer, which must say
		// so, as ServeStale's and FailClosed's answers do.
		tb := setup(t, func(c *Config) {
			c.ReadPolicy = FallbackToPostgres
			c.ReadYourWritesTimeout = 20 * time.Millisecond
		})
		tb.submit(t, "ada", 5)
		tb.drain(t)

		rolledBack, err := tb.pg.Pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = rolledBack.Rollback(ctx) })
		res, err := tb.board.SubmitTx(ctx, rolledBack, Command{EventID: uuid.New(), UserID: "ada", Delta: 7})
		require.NoError(t, err)
		require.Equal(t, Result{Score: 12, Version: 2}, res)
		require.NoError(t, rolledBack.Rollback(ctx))

		e, fr, err := tb.board.Rank(ctx, "ada", AtLeast("ada", res.Version))
		require.NoError(t, err)
		require.Equal(t, SourcePostgres, fr.Source)
		require.Equal(t, int64(5), e.Score)
		require.False(t, fr.AtLeastMet, "PostgreSQL holds version 1 of ada, not %d", res.Version)

		// Read while the writing transaction is open, on every read and
		// with an empty answer (a user with no score yet, the page past
		// the end).
		open, err := tb.pg.Pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = open.Rollback(ctx) })
		res, err = tb.board.SubmitTx(ctx, open, Command{EventID: uuid.New(), UserID: "ada", Delta: 7})
		require.NoError(t, err)
		newcomer, err := tb.board.SubmitTx(ctx, open, Command{EventID: uuid.New(), UserID: "newcomer", Delta: 1})
		require.NoError(t, err)
		check := func(wantMet bool) {
			t.Helper()
			opts := []ReadOption{AtLeast("ada", res.Version), AtLeast("newcomer", newcomer.Version)}
			top, err := tb.board.Top(ctx, 10, opts...)
			require.NoError(t, err)
			require.Equal(t, SourcePostgres, top.Freshness.Source)
			require.Equal(t, wantMet, top.Freshness.AtLeastMet, "Top")
			past, err := tb.board.Page(ctx, tb.board.encodeCursor(cursor{score: -1000, user: "zz"}), 10, opts...)
			require.NoError(t, err)
			require.Empty(t, past.Entries)
			require.Equal(t, SourcePostgres, past.Freshness.Source)
			require.Equal(t, wantMet, past.Freshness.AtLeastMet, "empty page")
			e, fr, err := tb.board.Rank(ctx, "ada", opts...)
			require.NoError(t, err)
			require.Equal(t, wantMet, fr.AtLeastMet, "Rank")
			around, err := tb.board.Around(ctx, "ada", 1, opts...)
			require.NoError(t, err)
			require.Equal(t, wantMet, around.Freshness.AtLeastMet, "Around")
			if wantMet {
				require.Equal(t, Entry{UserID: "ada", Score: 12, Rank: 1}, e)
				require.Equal(t, []Entry{{UserID: "ada", Score: 12, Rank: 1}, {UserID: "newcomer", Score: 1, Rank: 2}}, top.Entries)
			} else {
				require.Equal(t, Entry{UserID: "ada", Score: 5, Rank: 1}, e)
				require.Equal(t, []Entry{{UserID: "ada", Score: 5, Rank: 1}}, top.Entries)
				_, _, err = tb.board.Rank(ctx, "newcomer", opts...)
				require.ErrorIs(t, err, ErrUserNotFound, "PostgreSQL has no score for the newcomer yet")
			}
		}
		check(false)
		require.NoError(t, open.Commit(ctx))
		check(true)
	})

	// The first score of a user, submitted in a transaction that has not
	// committed (or rolled back): PostgreSQL has no row for the user, which
	// meets no version. With only that requirement, nothing else in the
	// answer is unmet to hide it.
	t.Run("FallbackDoesNotMeetAUserWithoutARow", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) {
			c.ReadPolicy = FallbackToPostgres
			c.ReadYourWritesTimeout = 20 * time.Millisecond
		})
		tb.submit(t, "ada", 5)
		tb.drain(t)
		open, err := tb.pg.Pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = open.Rollback(ctx) })
		res, err := tb.board.SubmitTx(ctx, open, Command{EventID: uuid.New(), UserID: "newcomer", Delta: 1})
		require.NoError(t, err)

		need := AtLeast("newcomer", res.Version)
		top, err := tb.board.Top(ctx, 10, need)
		require.NoError(t, err)
		require.Equal(t, SourcePostgres, top.Freshness.Source)
		require.Equal(t, []Entry{{UserID: "ada", Score: 5, Rank: 1}}, top.Entries)
		require.False(t, top.Freshness.AtLeastMet, "Top: the newcomer is not in the answer")
		around, err := tb.board.Around(ctx, "ada", 1, need)
		require.NoError(t, err)
		require.Equal(t, SourcePostgres, around.Freshness.Source)
		require.False(t, around.Freshness.AtLeastMet, "Around")
		_, fr, err := tb.board.Rank(ctx, "ada", need)
		require.NoError(t, err)
		require.False(t, fr.AtLeastMet, "Rank")
	})

	t.Run("InvalidOptionsReadNothing", func(t *testing.T) {
		t.Parallel()
		// A fail-closed board whose projection lags: an option that fell
		// through to ServeStale would answer with the stale score.
		tb := lagging(t, FailClosed, func(c *Config) { c.ReadYourWritesTimeout = 5 * time.Second })
		_, err := tb.board.Top(ctx, 10)
		require.ErrorIs(t, err, ErrStale, "setup: the projection lags")

		for name, opt := range map[string]ReadOption{
			"UnsetPolicy":      WithPolicy(0),
			"UnknownPolicy":    WithPolicy(FailClosed + 1),
			"NilOption":        nil,
			"AtLeastEmptyUser": AtLeast("", 1),
			"AtLeastNULUser":   AtLeast("a\x00b", 1),
			"AtLeastTooManyUsers": func(o *readOptions) {
				for i := range MaxAtLeast + 1 {
					AtLeast(fmt.Sprintf("user-%d", i), 1)(o)
				}
			},
		} {
			start := time.Now()
			r, err := tb.board.Top(ctx, 10, opt)
			require.ErrorIs(t, err, ErrInvalidReadOption, name)
			require.Empty(t, r.Entries, name)
			// The options come before the user id, even one no store can
			// hold.
			_, _, err = tb.board.Rank(ctx, "", opt)
			require.ErrorIs(t, err, ErrInvalidReadOption, "%s: Rank", name)
			_, err = tb.board.Around(ctx, "nul\x00", 1, opt)
			require.ErrorIs(t, err, ErrInvalidReadOption, "%s: Around", name)
			require.Less(t, time.Since(start), tb.board.Config().ReadYourWritesTimeout, "%s: refused without waiting", name)
		}
	})
}

func TestFreshnessProbe(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("AgesWhileAProbeIsStuck", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		// The board under test reads through a pool of one connection, which
		// the test holds to make its lag probe wait.
		pc, err := pgxpool.ParseConfig(tb.pg.ConnString)
		require.NoError(t, err)
		board, small := tb.failClosedOnPoolOfOne(t, pc, 100*time.Millisecond, 10*time.Millisecond)
		cfg := board.Config()

		tb.submit(t, "user-a", 10)
		tb.drain(t)
		// Nothing is pending, so the lag is zero, unless the probe itself
		// took longer than LagProbeInterval (its first query prepares the
		// statement; a loaded machine): then its own duration counts, and
		// may exceed MaxLag. ServeStale answers either way; the lag must
		// still be no more than this read's own duration.
		before := time.Now()
		r, err := board.Top(ctx, 10, WithPolicy(ServeStale))
		require.NoError(t, err)
		require.False(t, r.Freshness.Unverified)
		requireUpToDate(t, r.Freshness, before)
		measuredAt := time.Now()

		// A change arrives and is not projected; the next probe hangs.
		tb.submit(t, "user-a", 7)
		hangNextProbe(t, board, small)

		// Readers reusing the old "nothing pending" measurement must not
		// call Redis fresh: its age is the lag it may hide.
		_, err = board.Top(ctx, 10)
		var stale *StaleError
		require.ErrorAs(t, err, &stale)
		require.Greater(t, stale.Lag, cfg.MaxLag)
		asked := time.Now()
		fr := board.Freshness(ctx)
		require.True(t, fr.AtLeastMet, "false only when a read asked for AtLeast")
		require.GreaterOrEqual(t, fr.Lag, asked.Sub(measuredAt))
		require.False(t, fr.ProjectedThrough.After(measuredAt))
	})

	// As AgesWhileAProbeIsStuck, with a change pending at the reused
	// measurement: its lag keeps growing with the measurement's age too,
	// since the projection may have fallen further behind since.
	t.Run("PendingLagAgesWhileAProbeIsStuck", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		pc, err := pgxpool.ParseConfig(tb.pg.ConnString)
		require.NoError(t, err)
		board, small := tb.failClosedOnPoolOfOne(t, pc, 100*time.Millisecond, 10*time.Millisecond)
		cfg := board.Config()

		tb.submit(t, "user-a", 10) // never projected
		// Measures one change pending. ServeStale: on a loaded machine its
		// lag alone can exceed MaxLag.
		r, err := board.Top(ctx, 10, WithPolicy(ServeStale))
		require.NoError(t, err)
		measuredAt := time.Now()
		pendingLag := r.Freshness.Lag
		require.GreaterOrEqual(t, pendingLag, time.Duration(0))

		// The next probe hangs.
		hangNextProbe(t, board, small)

		asked := time.Now()
		fr := board.Freshness(ctx)
		require.GreaterOrEqual(t, fr.Lag, pendingLag+asked.Sub(measuredAt), "the reused measurement's lag did not grow with its age")
		_, err = board.Top(ctx, 10)
		var stale *StaleError
		require.ErrorAs(t, err, &stale)
		require.Greater(t, stale.Lag, cfg.MaxLag)
	})

	t.Run("SlowReplyCountsAsLag", func(t *testing.T) {
		t.Parallel()
		// The lag query's reply takes 800 ms to reach the board. A change
		// committed after the query's snapshot, while the reply travels,
		// is invisible to it: the measurement must count from when the
		// query was sent, so the reply's travel time shows as lag and a
		// fail-closed read refuses, instead of reporting lag 0.
		tb := setup(t)
		pc, err := pgxpool.ParseConfig(tb.pg.ConnString)
		require.NoError(t, err)
		proxy := testenv.StartDelayProxy(t, net.JoinHostPort(pc.ConnConfig.Host, strconv.Itoa(int(pc.ConnConfig.Port))))
		pc.ConnConfig.Host = "127.0.0.1"
		pc.ConnConfig.Port = uint16(proxy.Port())
		board, _ := tb.failClosedOnPoolOfOne(t, pc, 300*time.Millisecond, 50*time.Millisecond)
		cfg := board.Config()

		tb.submit(t, "user-a", 10)
		tb.drain(t)
		// Also prepares the lag statement on the connection. ServeStale: on a
		// loaded machine this first probe alone can take longer than MaxLag.
		r, err := board.Top(ctx, 10, WithPolicy(ServeStale))
		require.NoError(t, err)
		require.Equal(t, int64(10), r.Entries[0].Score)
		time.Sleep(2 * cfg.LagProbeInterval) // the next read measures again

		proxy.SetDelay(800 * time.Millisecond)
		type answer struct {
			r   Ranking
			err error
		}
		done := make(chan answer, 1)
		go func() {
			r, err := board.Top(ctx, 10)
			done <- answer{r, err}
		}()
		// Usually after the probe's snapshot; if before, the probe sees it
		// pending, and the reply's travel time counts all the same.
		time.Sleep(100 * time.Millisecond)
		tb.submit(t, "user-a", 7) // never projected
		got := <-done
		proxy.SetDelay(0)
		var staleErr *StaleError
		require.ErrorAs(t, got.err, &staleErr, "served %v with lag %s", got.r.Entries, got.r.Freshness.Lag)
		require.GreaterOrEqual(t, staleErr.Lag, 700*time.Millisecond)
	})

	// The path to PostgreSQL goes half-open as a read sends the lag probe,
	// then heals. The probe is bounded: the read that sent it answers from
	// a healthy Redis, with Lag -1, and the next read measures again. It
	// waited on the dead connection for as long as its ctx allowed (for
	// ever here), and while it did no other read measured: FailClosed
	// reads kept failing as stale after PostgreSQL answered again.
	t.Run("StuckOnAHalfOpenConnection", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		tb.submit(t, "user-a", 10)
		tb.drain(t)
		pc, err := pgxpool.ParseConfig(tb.pg.ConnString)
		require.NoError(t, err)
		proxy := testenv.StartDelayProxy(t, net.JoinHostPort(pc.ConnConfig.Host, strconv.Itoa(int(pc.ConnConfig.Port))))
		pc.ConnConfig.Host = "127.0.0.1"
		pc.ConnConfig.Port = uint16(proxy.Port())
		pc.ConnConfig.Fallbacks = nil
		pool, err := pgxpool.NewWithConfig(ctx, pc)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		cfg := tb.board.Config()
		cfg.ReadPolicy, cfg.MaxLag, cfg.LagProbeInterval = FailClosed, time.Second, 50*time.Millisecond
		board, err := New(pool, tb.rd.Client, &cfg)
		require.NoError(t, err)
		t.Cleanup(board.Close)
		t.Cleanup(proxy.Close) // before the pool's Close, which would wait for a held connection
		_, err = board.Top(ctx, 10)
		require.NoError(t, err)

		proxy.Freeze()
		time.Sleep(2 * cfg.LagProbeInterval) // the next read measures again
		type answer struct {
			r   Ranking
			err error
		}
		stuck := make(chan answer, 1)
		go func() {
			r, err := board.Top(ctx, 10, WithPolicy(ServeStale))
			stuck <- answer{r, err}
		}()
		// The probe's reply is held: the connection is dead for good.
		require.Eventually(t, func() bool { return proxy.Held() > 0 }, 10*time.Second, time.Millisecond)
		proxy.Thaw()

		select {
		case got := <-stuck:
			require.NoError(t, got.err)
			require.Equal(t, SourceRedis, got.r.Freshness.Source)
			require.Equal(t, time.Duration(-1), got.r.Freshness.Lag, "the probe did not answer")
			require.Len(t, got.r.Entries, 1)
		case <-time.After(20 * time.Second):
			t.Fatal("a ServeStale read of a healthy Redis still waits on its lag probe's dead connection after 20 s")
		}
		r, err := board.Top(ctx, 10)
		require.NoError(t, err, "PostgreSQL answers again: the next FailClosed read measures the lag")
		require.GreaterOrEqual(t, r.Freshness.Lag, time.Duration(0))
	})

	// Within LagProbeInterval a read reuses a measurement that found nothing
	// pending and reports Lag 0, which the contract allows (Lag understates
	// by less than LagProbeInterval); ProjectedThrough must still be that
	// measurement's time, never the read's: a change committed after the
	// measurement, not projected, is not in the answer.
	t.Run("ReusedMeasurementClaimsNothingAfterIt", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) {
			c.ReadPolicy = FailClosed
			c.MaxLag = 2 * time.Hour
			c.LagProbeInterval = time.Hour // the second read reuses the first's measurement
		})
		tb.submit(t, "user-a", 10)
		tb.drain(t)
		r, err := tb.board.Top(ctx, 10)
		require.NoError(t, err)
		require.Zero(t, r.Freshness.Lag)

		beforeCommit := time.Now()
		tb.submit(t, "user-a", 7) // never projected
		r, err = tb.board.Top(ctx, 10)
		require.NoError(t, err)
		require.Equal(t, SourceRedis, r.Freshness.Source)
		require.Equal(t, int64(10), r.Entries[0].Score, "setup: the answer lacks the change")
		require.False(t, r.Freshness.ProjectedThrough.IsZero())
		require.False(t, r.Freshness.ProjectedThrough.After(beforeCommit),
			"ProjectedThrough %s claims a change committed after %s, which the answer lacks",
			r.Freshness.ProjectedThrough.Format(time.RFC3339Nano), beforeCommit.Format(time.RFC3339Nano))
	})

	// A probe failing on every read (LagProbeInterval 1 ns; the outbox
	// table renamed away) logs at most once a second.
	t.Run("FailingProbeLogsAtMostOnceASecond", func(t *testing.T) {
		t.Parallel()
		logs := &testenv.LogSink{}
		tb := setup(t, func(c *Config) { c.LagProbeInterval = time.Nanosecond; c.Logger = logs.Logger() })
		_, err := tb.pg.Pool.Exec(ctx, `ALTER TABLE "verity_outbox" RENAME TO "verity_outbox_away"`)
		require.NoError(t, err)
		const msg = "leaderboard: measuring projection lag failed"
		const reads = 50
		start := time.Now()
		for range reads {
			_, err := tb.board.Top(ctx, 10)
			require.ErrorIs(t, err, ErrNotMigrated)
		}
		elapsed := time.Since(start)
		lines := logs.Lines(t, msg)
		require.NotEmpty(t, lines, "the failure is logged")
		require.LessOrEqual(t, len(lines), 1+int(elapsed/lograte.Interval),
			"%d lines for %d reads in %v", len(lines), reads, elapsed)
	})

	t.Run("CancelledReaderDoesNotPoisonTheCache", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) {
			c.ReadPolicy = FailClosed
			c.MaxLag = 2 * time.Hour
			c.LagProbeInterval = time.Hour // a cached failure would stick
		})
		tb.submit(t, "user-a", 10)
		tb.drain(t)

		cancelled, cancel := context.WithCancel(ctx)
		cancel()
		_, err := tb.board.Top(cancelled, 10)
		require.ErrorIs(t, err, context.Canceled)
		require.NotErrorIs(t, err, ErrStale)

		r, err := tb.board.Top(ctx, 10)
		require.NoError(t, err)
		require.Equal(t, SourceRedis, r.Freshness.Source)
		require.Zero(t, r.Freshness.Lag)
		require.Equal(t, int64(10), r.Entries[0].Score)
	})

	t.Run("DeadLettersCountAsLag", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) {
			c.ReadPolicy = FailClosed
			c.MaxLag = 5 * time.Second // well above a probe's duration, as in lagging
			c.LagProbeInterval = time.Nanosecond
		})
		tb.submit(t, "user-a", 10)
		tb.drain(t)
		tb.submit(t, "user-a", 7)

		tb.bury(t)
		var dead int
		require.NoError(t, tb.pg.Pool.QueryRow(ctx, `SELECT count(*) FROM verity_outbox_dead`).Scan(&dead))
		require.Equal(t, 1, dead)
		tb.ageDeadLetters(t, time.Minute)

		// Redis still holds 10 while PostgreSQL holds 17.
		_, err := tb.board.Top(ctx, 10)
		var stale *StaleError
		require.ErrorAs(t, err, &stale)
		require.Greater(t, stale.Lag, 59*time.Second)
		r, err := tb.board.Top(ctx, 10, WithPolicy(ServeStale))
		require.NoError(t, err)
		require.Equal(t, int64(10), r.Entries[0].Score)
		require.Greater(t, r.Freshness.Lag, 59*time.Second)

		// Another board's dead letter is not this board's lag. A long
		// LagProbeInterval: a fresh measurement's age, however long its probe
		// took, does not count as lag, so anything but zero is a dead letter.
		other := tb.sibling(t, "other", func(c *Config) { c.MaxLag, c.LagProbeInterval = 2*time.Hour, time.Hour })
		require.Zero(t, other.Freshness(ctx).Lag)

		// Replayed and projected, the board is fresh again.
		w, err := tb.board.Worker(nil)
		require.NoError(t, err)
		n, err := w.Relay().ReplayDead(ctx, outbox.ReplayFilter{})
		require.NoError(t, err)
		require.Equal(t, int64(1), n)
		tb.drain(t)
		before := time.Now()
		r, err = tb.board.Top(ctx, 10)
		require.NoError(t, err)
		requireUpToDate(t, r.Freshness, before)
		require.Equal(t, int64(17), r.Entries[0].Score)
	})

	// A row written late in a long transaction has a newer id than rows
	// written meanwhile, but is as old as the transaction: the oldest dead
	// letter is the one created first, whatever its id.
	t.Run("OldestDeadLetterIsTheFirstCreatedNotTheFirstID", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) {
			c.ReadPolicy = FailClosed
			c.MaxLag = 5 * time.Second
			c.LagProbeInterval = time.Nanosecond
		})
		tb.submit(t, "seed", 1)
		tb.drain(t)
		tb.submit(t, "user-a", 10)
		tb.submit(t, "user-b", 20)
		tb.bury(t)
		// user-b's row, the newer id, stands for one whose transaction
		// began a minute before user-a's.
		_, err := tb.pg.Pool.Exec(ctx, `UPDATE verity_outbox_dead SET created_at = created_at - interval '1 minute' WHERE key = 'user-b'`)
		require.NoError(t, err)
		require.Greater(t, tb.oldestDeadLetterAge(t), 59*time.Second)

		_, err = tb.board.Top(ctx, 10)
		var stale *StaleError
		require.ErrorAs(t, err, &stale, "FailClosed must not serve Redis with a minute-old change missing from it")
		require.Greater(t, stale.Lag, 59*time.Second)
	})

	t.Run("SupersededDeadLetterDoesNotCount", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) {
			c.ReadPolicy = FailClosed
			c.MaxLag = 5 * time.Second // well above a probe's duration, as in lagging
			c.LagProbeInterval = time.Nanosecond
		})
		tb.submit(t, "user-a", 10)
		tb.drain(t)

		// Version 2 is buried, as in DeadLettersCountAsLag.
		tb.submit(t, "user-a", 7)
		tb.bury(t)
		tb.ageDeadLetters(t, time.Minute)

		// Newer versions of another user, or of the same user on another
		// board, supersede nothing.
		other := tb.sibling(t, "other")
		for range 3 {
			_, err := other.Submit(ctx, Command{EventID: uuid.New(), UserID: "user-a", Delta: 1})
			require.NoError(t, err)
			tb.submit(t, "user-b", 1)
		}
		tb.drain(t)
		_, err := tb.board.Top(ctx, 10)
		var stale *StaleError
		require.ErrorAs(t, err, &stale)
		require.Greater(t, stale.Lag, 59*time.Second)

		// Version 3, pending: Redis still lacks version 2's change, so the
		// lag is the dead letter's age, not the younger pending row's.
		require.Equal(t, int64(3), tb.submit(t, "user-a", 1).Version)
		_, err = tb.pg.Pool.Exec(ctx, `UPDATE verity_outbox SET created_at = created_at - interval '30 seconds' WHERE stream = $1`, tb.board.Stream())
		require.NoError(t, err)
		age := tb.oldestDeadLetterAge(t)
		require.Greater(t, age, 59*time.Second)
		require.GreaterOrEqual(t, tb.board.Freshness(ctx).Lag, age)

		// Version 3 projected: Redis is right, and reads are served from
		// it under every policy although the dead letter is still there.
		tb.drain(t)
		var dead int
		require.NoError(t, tb.pg.Pool.QueryRow(ctx, `SELECT count(*) FROM verity_outbox_dead`).Scan(&dead))
		require.Equal(t, 1, dead)
		before := time.Now()
		r, err := tb.board.Top(ctx, 10)
		require.NoError(t, err)
		requireUpToDate(t, r.Freshness, before)
		require.Equal(t, int64(18), r.Entries[0].Score)
		before = time.Now()
		r, err = tb.board.Top(ctx, 10, WithPolicy(FallbackToPostgres))
		require.NoError(t, err)
		requireUpToDate(t, r.Freshness, before)

		// Another user's pending change is that change's lag only.
		tb.submit(t, "user-b", 1)
		fr := tb.board.Freshness(ctx)
		require.Less(t, fr.Lag, 30*time.Second)
	})

	t.Run("DeadLetterCountsWhileNewerVersionIsDead", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) {
			c.ReadPolicy = FailClosed
			c.MaxLag = 5 * time.Second // well above a probe's duration, as in lagging
			c.LagProbeInterval = time.Nanosecond
		})
		tb.submit(t, "user-a", 10)
		tb.drain(t)

		// Versions 2 and 3 are both buried: Redis holds version 1.
		tb.submit(t, "user-a", 7)
		tb.bury(t)
		tb.ageDeadLetters(t, time.Minute)
		require.Equal(t, int64(3), tb.submit(t, "user-a", 1).Version)
		tb.bury(t)
		var dead int
		require.NoError(t, tb.pg.Pool.QueryRow(ctx, `SELECT count(*) FROM verity_outbox_dead`).Scan(&dead))
		require.Equal(t, 2, dead)

		// Version 3 supersedes version 2 in PostgreSQL only: the older dead
		// letter is the lag.
		age := tb.oldestDeadLetterAge(t)
		require.Greater(t, age, 59*time.Second)
		_, err := tb.board.Top(ctx, 10)
		var stale *StaleError
		require.ErrorAs(t, err, &stale)
		require.GreaterOrEqual(t, stale.Lag, age)
		r, err := tb.board.Top(ctx, 10, WithPolicy(ServeStale))
		require.NoError(t, err)
		require.Equal(t, int64(10), r.Entries[0].Score)

		// Version 4 projected supersedes both: Redis is right.
		tb.submit(t, "user-a", 1)
		tb.drain(t)
		before := time.Now()
		r, err = tb.board.Top(ctx, 10)
		require.NoError(t, err)
		requireUpToDate(t, r.Freshness, before)
		require.Equal(t, int64(19), r.Entries[0].Score)
	})
}

// bury runs the board's relay once over every pending row while Redis
// refuses the projection (a value of the wrong type in place of the sorted
// set): each row's only attempt fails and buries it.
func (tb *testBundle) bury(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	key := tb.board.SortedSetKey()
	require.NoError(t, tb.rd.Client.Rename(ctx, key, key+":saved").Err())
	require.NoError(t, tb.rd.Client.Set(ctx, key, "x", 0).Err())
	w, err := tb.board.Worker(&WorkerConfig{Relay: &outbox.RelayConfig{MaxAttempts: 1}})
	require.NoError(t, err)
	_, _ = w.Drain(ctx)
	require.NoError(t, tb.rd.Client.Rename(ctx, key+":saved", key).Err())
	var pending int
	require.NoError(t, tb.pg.Pool.QueryRow(ctx, `SELECT count(*) FROM verity_outbox`).Scan(&pending))
	require.Zero(t, pending)
}

// ageDeadLetters moves the creation time of every dead letter d back.
func (tb *testBundle) ageDeadLetters(t *testing.T, d time.Duration) {
	t.Helper()
	_, err := tb.pg.Pool.Exec(context.Background(),
		`UPDATE verity_outbox_dead SET created_at = created_at - $1::interval`, d)
	require.NoError(t, err)
}

// oldestDeadLetterAge returns the age of the oldest dead letter by the
// database clock.
func (tb *testBundle) oldestDeadLetterAge(t *testing.T) time.Duration {
	t.Helper()
	var age time.Duration
	require.NoError(t, tb.pg.Pool.QueryRow(context.Background(),
		`SELECT clock_timestamp() - min(created_at) FROM verity_outbox_dead`).Scan(&age))
	return age
}

// TestLagProbePlan checks the plan PostgreSQL caches for the lag probe: pgx
// prepares the statement, and from its sixth run PostgreSQL may use a
// generic plan, which cannot see the stream. The dead-letter table holds
// another stream's dead letters only, so its statistics say one stream holds
// them all; the plan must still read this stream's dead letters by the
// (stream, created_at) index (not walk the table filtering on stream),
// once for the oldest that counts and once for one dated after the clock,
// that one filtered on created_at before the superseded check, which looks
// the user up by user_scores' primary key and checks the pending and dead
// sets by hashed subplans (read once, not once per dead letter). The look
// for pending rows dated after the clock must be a range scan of the
// created_at index bounded by the clock reading, which skips the other
// streams' pending rows (all in the past) instead of reading them. The
// custom plan must do the same.
func TestLagProbePlan(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	_, err := tb.pg.Pool.Exec(ctx, `INSERT INTO verity_outbox_dead
		(id, event_id, stream, key, version, payload, created_at, attempts, last_error)
		SELECT i, gen_random_uuid(), 'leaderboard:other', 'user-' || i, 1, '', now(), 1, 'x'
		FROM generate_series(1, 5000) AS i`)
	require.NoError(t, err)
	_, err = tb.pg.Pool.Exec(ctx, `INSERT INTO verity_outbox (event_id, stream, key, version, payload, created_at)
		SELECT gen_random_uuid(), 'leaderboard:other', 'user-' || i, 1, '', now() - i * interval '1 ms'
		FROM generate_series(1, 5000) AS i`)
	require.NoError(t, err)
	_, err = tb.pg.Pool.Exec(ctx, `INSERT INTO user_scores (board, user_id, score, version)
		SELECT $1::text, 'user-' || i, i, 2 FROM generate_series(1, 5000) AS i`, tb.board.Config().Name)
	require.NoError(t, err)
	_, err = tb.pg.Pool.Exec(ctx, `ANALYZE verity_outbox_dead, verity_outbox, user_scores`)
	require.NoError(t, err)
	args := []any{tb.board.Stream(), tb.board.Config().Name}

	generic := func() (*planNode, string) {
		return explainPlan(t, tb.pg.ConnString, tb.board.sql.lag, true, args)
	}
	custom := func() (*planNode, string) {
		return explainPlan(t, tb.pg.ConnString, tb.board.sql.lag, false, args)
	}

	for name, explain := range map[string]func() (*planNode, string){"Generic": generic, "Custom": custom} {
		t.Run(name, func(t *testing.T) {
			plan, doc := explain()

			// The scans of the stream's dead letters, both by the (stream,
			// created_at) index: d for the oldest that counts, d_1 for one
			// dated after the clock, a range bounded by that reading.
			for alias, index := range map[string]string{"d": "_dead_created_idx", "d_1": "_dead_created_idx"} {
				scans := plan.Find(func(n *planNode) bool { return n.Alias == alias })
				require.Len(t, scans, 1, doc)
				require.Equal(t, "Index Scan", scans[0].NodeType, doc)
				require.Equal(t, outbox.TableDefault+index, scans[0].IndexName, doc)
				if alias == "d_1" {
					require.Contains(t, scans[0].IndexCond, "(created_at > c.now)", doc)
				}
			}

			// Each superseded check: a primary-key lookup of the user, and
			// the pending and dead sets each a hashed subplan.
			for _, alias := range []string{"s", "s_1"} {
				scans := plan.Find(func(n *planNode) bool { return n.Alias == alias })
				require.Len(t, scans, 1, doc)
				require.Equal(t, "Index Scan", scans[0].NodeType, doc)
				require.Equal(t, "user_scores_pkey", scans[0].IndexName, doc)
			}
			for _, alias := range []string{"o", "n", "o_1", "n_1"} {
				subplans := plan.Find(func(n *planNode) bool {
					return n.SubplanName != "" && len(n.Find(func(m *planNode) bool { return m.Alias == alias })) > 0
				})
				require.NotEmpty(t, subplans, doc)
				sp := subplans[len(subplans)-1] // the innermost
				require.Contains(t, doc, "hashed "+sp.SubplanName+")", doc)
			}

			// The pending rows dated after the clock reading: a range of the
			// created_at index, bounded by that reading.
			scans := plan.Find(func(n *planNode) bool { return n.Alias == "f" })
			require.Len(t, scans, 1, doc)
			require.Equal(t, "Index Scan", scans[0].NodeType, doc)
			require.Equal(t, outbox.TableDefault+"_created_idx", scans[0].IndexName, doc)
			require.Equal(t, "(created_at > c.now)", scans[0].IndexCond, doc)
		})
	}
}

// afterVersionPoll runs run once, when armed, right after the first
// pipeline that reads a projected version (the wait's HGET) was answered.
type afterVersionPoll struct {
	testenv.PassThroughHook
	armed atomic.Bool
	run   func()
}

func (h *afterVersionPoll) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		if slices.ContainsFunc(cmds, func(c redis.Cmder) bool { return c.Name() == "hget" }) && h.armed.CompareAndSwap(true, false) {
			h.run()
		}
		return err
	}
}

// hangNextProbe holds the only connection of board's pool (small), lets
// the last lag measurement expire, starts a read whose probe then hangs on
// the pool, and waits until that measurement is older than MaxLag: the
// reads after it reuse the old measurement. The hung read ends with t.
func hangNextProbe(t *testing.T, board *Board, small *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	cfg := board.Config()
	conn, err := small.Acquire(ctx)
	require.NoError(t, err)
	time.Sleep(cfg.LagProbeInterval)
	probeCtx, cancelProbe := context.WithCancel(ctx)
	probed := make(chan struct{})
	go func() {
		defer close(probed)
		_, _ = board.Top(probeCtx, 10)
	}()
	t.Cleanup(func() { cancelProbe(); <-probed; conn.Release() })
	require.Eventually(t, func() bool {
		board.lagMu.Lock()
		defer board.lagMu.Unlock()
		return board.lagProbe.running
	}, 5*time.Second, time.Millisecond)
	time.Sleep(cfg.MaxLag + 20*time.Millisecond)
}

// TestUserNotFoundSaysHowFresh: "no score" is an answer like any other,
// and as stale as the projection it came from: a user whose score Redis
// lost (the board unverified) or has not projected yet. Rank and Around
// returned a bare ErrUserNotFound, and a ServeStale caller could not tell
// "no score" from "not projected"; the *UserNotFoundError now carries the
// answer's Freshness.
func TestUserNotFoundSaysHowFresh(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("UnverifiedRedis", func(t *testing.T) {
		t.Parallel()
		tb := verifiedBoard(t, ServeStale)
		keys, err := tb.rd.Client.Keys(ctx, tb.rd.Prefix+"*").Result()
		require.NoError(t, err)
		require.NoError(t, tb.rd.Client.Del(ctx, keys...).Err()) // Redis lost the board

		_, fresh, err := tb.board.Rank(ctx, "ada")
		require.Equal(t, Freshness{}, fresh, "the public reads return a zero Freshness with an error")
		var nf *UserNotFoundError
		require.ErrorAs(t, err, &nf)
		require.ErrorIs(t, err, ErrUserNotFound)
		require.Equal(t, "ada", nf.UserID)
		require.Equal(t, SourceRedis, nf.Freshness.Source)
		require.True(t, nf.Freshness.Unverified, "%+v", nf.Freshness)
		require.Negative(t, nf.Freshness.Lag)

		_, err = tb.board.Around(ctx, "ada", 2)
		require.ErrorAs(t, err, &nf)
		require.Equal(t, "ada", nf.UserID)
		require.True(t, nf.Freshness.Unverified)
	})

	t.Run("CallerEndsAsTheAnswerComes", func(t *testing.T) {
		t.Parallel()
		// The caller's ctx ends right after Redis answered "no such
		// member": the error joins ctx's, and still names the user.
		tb := setup(t)
		opt, err := redis.ParseURL(tb.rd.URL)
		require.NoError(t, err)
		client := redis.NewClient(opt)
		t.Cleanup(func() { _ = client.Close() })
		hook := &cancelAfterReadScript{}
		client.AddHook(hook)
		cfg := tb.board.Config()
		board, err := New(tb.pg.Pool, client, &cfg)
		require.NoError(t, err)
		t.Cleanup(board.Close)
		board.Freshness(ctx) // the lag measured before the reads

		for _, read := range []string{"Rank", "Around"} {
			readCtx, cancel := context.WithCancel(ctx)
			hook.arm(cancel)
			if read == "Rank" {
				_, _, err = board.Rank(readCtx, "ghost")
			} else {
				_, err = board.Around(readCtx, "ghost", 2)
			}
			cancel()
			require.ErrorIs(t, err, context.Canceled, "%s: the caller gave up", read)
			var nf *UserNotFoundError
			require.ErrorAs(t, err, &nf, read)
			require.Equal(t, "ghost", nf.UserID, "%s: %v", read, err)
		}
	})

	t.Run("NotProjectedYet", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) { c.ReadPolicy, c.LagProbeInterval = ServeStale, time.Nanosecond })
		tb.submit(t, "ada", 10) // never projected
		time.Sleep(5 * time.Millisecond)
		_, _, err := tb.board.Rank(ctx, "ada")
		var nf *UserNotFoundError
		require.ErrorAs(t, err, &nf)
		require.Equal(t, SourceRedis, nf.Freshness.Source)
		require.GreaterOrEqual(t, nf.Freshness.Lag, 5*time.Millisecond, "the unprojected score is as old as the lag")
	})

	t.Run("FromPostgres", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) { c.ReadPolicy = FallbackToPostgres })
		before := time.Now()
		_, _, err := tb.board.Rank(ctx, "nobody", forcePostgres())
		var nf *UserNotFoundError
		require.ErrorAs(t, err, &nf)
		require.Equal(t, "nobody", nf.UserID)
		require.Equal(t, SourcePostgres, nf.Freshness.Source)
		require.False(t, nf.Freshness.ProjectedThrough.Before(before), "answered as of the read")
	})

	// A new user's SubmitTx not committed yet: PostgreSQL has no score
	// for them, and says the version asked for is not there either.
	t.Run("FromPostgresBeforeTheCommit", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) { c.ReadPolicy, c.ReadYourWritesTimeout = FallbackToPostgres, time.Millisecond })
		tx, err := tb.pg.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		res, err := tb.board.SubmitTx(ctx, tx, Command{EventID: uuid.New(), UserID: "ada", Delta: 3})
		require.NoError(t, err)
		_, _, err = tb.board.Rank(ctx, "ada", AtLeast("ada", res.Version))
		var nf *UserNotFoundError
		require.ErrorAs(t, err, &nf)
		require.Equal(t, SourcePostgres, nf.Freshness.Source)
		require.False(t, nf.Freshness.AtLeastMet)
	})

	t.Run("UnstorableID", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		_, _, err := tb.board.Rank(ctx, "bad\x00id")
		var nf *UserNotFoundError
		require.ErrorAs(t, err, &nf)
		require.Equal(t, Freshness{}, nf.Freshness, "not looked up")
	})
}

// lagQueryCounter counts the lag probe's queries on a pool; armed, it
// panics on the next one, as an application's tracer (or Logger) may.
type lagQueryCounter struct {
	n     atomic.Int64
	armed atomic.Bool
}

func (c *lagQueryCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "WITH counted AS NOT MATERIALIZED") { // lagSQL
		c.n.Add(1)
		if c.armed.CompareAndSwap(true, false) {
			panic("tracer bug")
		}
	}
	return ctx
}

func (c *lagQueryCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// A new board's first reads, all at once, share one lag measurement: each
// sent its own query (32 readers, 32 queries), where the README promises
// one query per LagProbeInterval at most. A reader that gives up while
// waiting returns at once, and the next read measures.
func TestFreshnessFirstReadsShareOneProbe(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	tb.submit(t, "a", 1)
	var counter lagQueryCounter
	pool := tb.newPool(t, func(c *pgxpool.Config) { c.ConnConfig.Tracer = &counter })
	cfg := tb.board.Config()
	cfg.LagProbeInterval, cfg.MaxLag = time.Hour, 2*time.Hour
	b, err := New(pool, tb.rd.Client, &cfg)
	require.NoError(t, err)
	t.Cleanup(b.Close)

	// Hold the first measurement until every reader is waiting on it.
	lock, err := tb.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = lock.Rollback(ctx) })
	_, err = lock.Exec(ctx, `LOCK TABLE verity_outbox IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	const readers = 32
	var wg sync.WaitGroup
	lags := make([]time.Duration, readers)
	for i := range readers {
		wg.Go(func() { lags[i] = b.Freshness(ctx).Lag })
	}
	require.Eventually(t, func() bool { return counter.n.Load() >= 1 }, 10*time.Second, 5*time.Millisecond)
	// A reader that gives up while the first measurement runs.
	cctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	gaveUp := b.Freshness(cctx)
	cancel()
	require.EqualValues(t, -1, gaveUp.Lag)
	require.NoError(t, lock.Rollback(ctx))
	wg.Wait()
	require.EqualValues(t, 1, counter.n.Load(), "lag queries for %d concurrent first reads", readers)
	for _, lag := range lags {
		require.GreaterOrEqual(t, lag, time.Duration(0), "every reader got the shared measurement")
	}
}

// A panic during a board's first lag measurement (recovered by the caller,
// as net/http recovers a handler's) must not wedge the board: every later
// read waited for a measurement nobody would finish, until its ctx ended
// (for ever without one). The next read measures again.
func TestFreshnessPanicInFirstProbe(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	tb.submit(t, "a", 1)
	var counter lagQueryCounter
	counter.armed.Store(true)
	pool := tb.newPool(t, func(c *pgxpool.Config) { c.ConnConfig.Tracer = &counter })
	cfg := tb.board.Config()
	cfg.LagProbeInterval, cfg.MaxLag = time.Hour, 2*time.Hour
	b, err := New(pool, tb.rd.Client, &cfg)
	require.NoError(t, err)
	t.Cleanup(b.Close)

	func() {
		defer func() { require.NotNil(t, recover(), "the tracer panicked") }()
		b.Freshness(ctx)
	}()
	done := make(chan Freshness, 1)
	go func() { done <- b.Freshness(ctx) }() // no deadline
	select {
	case fr := <-done:
		require.GreaterOrEqual(t, fr.Lag, time.Duration(0))
	case <-time.After(10 * time.Second):
		t.Fatal("a read after the panic is still waiting after 10 s")
	}
	require.EqualValues(t, 2, counter.n.Load(), "the read after the panic measured again")
}

// cancelAfterReadScript is a go-redis hook that, once armed, calls cancel
// right after the next read script's reply: a caller giving up as the
// answer comes.
type cancelAfterReadScript struct {
	testenv.PassThroughHook
	mu     sync.Mutex
	cancel context.CancelFunc
}

func (h *cancelAfterReadScript) arm(cancel context.CancelFunc) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.cancel = cancel
}

func (h *cancelAfterReadScript) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		// Not on NOSCRIPT, which is no answer: go-redis then sends EVAL_RO.
		if name := cmd.Name(); (name == "evalsha_ro" || name == "eval_ro") && !redis.HasErrorPrefix(err, "NOSCRIPT") {
			h.mu.Lock()
			if h.cancel != nil {
				h.cancel()
				h.cancel = nil
			}
			h.mu.Unlock()
		}
		return err
	}
}

// A cursor is bound to its board's Name, Schema and KeyPrefix (doc.go,
// Page): a board of the same name and the same explicit KeyPrefix in
// another schema (another tenant, on its own Redis or sharing this one)
// must refuse it with ErrInvalidCursor. The existing test of another
// schema also changes the key prefix, so a tag that forgot the schema
// passed it.
// (A mutation audit of 2026-12-07 found this untested.)
func TestCursorBoundToSchemaUnderSharedKeyPrefix(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	a := setup(t, func(c *Config) { c.Name = "weekly" })
	a.submit(t, "ada", 5)
	a.submit(t, "bob", 3)
	a.drain(t)
	page, err := a.board.Top(ctx, 1)
	require.NoError(t, err)
	require.NotEmpty(t, page.Next)

	pg := testenv.Postgres(t) // another schema
	cfg := &Config{Name: "weekly", Schema: pg.Schema, KeyPrefix: a.board.Config().KeyPrefix}
	require.NoError(t, Migrate(ctx, pg.Pool, cfg))
	other, err := New(pg.Pool, a.rd.Client, cfg)
	require.NoError(t, err)
	t.Cleanup(other.Close)
	require.NotEqual(t, a.board.Config().Schema, other.Config().Schema)

	_, err = other.Page(ctx, page.Next, 10)
	require.ErrorIs(t, err, ErrInvalidCursor, "a cursor of the board in schema %s served by the board in schema %s", a.board.Config().Schema, other.Config().Schema)
}

// Top and Page take n in [1, MaxPageSize] (ErrInvalidLimit: "page size
// must be between 1 and MaxPageSize"). TestPageSizeLimits checks
// MaxPageSize itself for Authoritative and Around only: a bound of
// n >= MaxPageSize in Page (which Top calls) refused the largest page
// with no test failing.
// (A mutation audit of 2026-12-07 found this untested.)
func TestTopAndPageAcceptMaxPageSize(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t)
	tb.submit(t, "amy", 5)
	tb.submit(t, "bob", 3)
	tb.drain(t)

	top, err := tb.board.Top(ctx, MaxPageSize)
	require.NoError(t, err, "Top(MaxPageSize)")
	require.Equal(t, []string{"amy", "bob"}, users(top.Entries))
	require.Empty(t, top.Next)
	page, err := tb.board.Page(ctx, "", MaxPageSize)
	require.NoError(t, err, "Page(\"\", MaxPageSize)")
	require.Equal(t, []string{"amy", "bob"}, users(page.Entries))
}

// TestFailClosedCancelledBeforeTheProbeIsNotStale: a FailClosed read whose
// ctx ended before the lag was measured reports the cancellation, not
// staleness.
func TestFailClosedCancelledBeforeTheProbeIsNotStale(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t, func(c *Config) {
		c.ReadPolicy = FailClosed
		c.LagProbeInterval = time.Nanosecond
	})
	tb.submit(t, "ada", 10)
	tb.drain(t)
	rctx, cancel := context.WithCancel(ctx)
	cancel()
	_, err := tb.board.Top(rctx, 10)
	require.ErrorIs(t, err, context.Canceled)
	require.NotErrorIs(t, err, ErrStale)
}

// TestReadYourWritesTimeoutBoundsASlowPoll: the wait for an AtLeast
// version ends at ReadYourWritesTimeout even when a poll is still waiting
// for a pool connection or for a slow Redis's answer (a client with
// ContextTimeoutEnabled): the policy then applies. Before, each poll ran
// under the caller's ctx, and a read with a 150 ms timeout fell back after
// well over the second Redis took to answer.
func TestReadYourWritesTimeoutBoundsASlowPoll(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t, func(c *Config) {
		c.ReadPolicy = FallbackToPostgres
		c.ReadYourWritesTimeout = 150 * time.Millisecond
	})
	res := tb.submit(t, "ada", 5)
	tb.drain(t)
	board, proxy := tb.boardBehindDelayProxy(t, func(opts *redis.Options) {
		opts.PoolSize = 2
		opts.ContextTimeoutEnabled = true
		opts.ReadTimeout, opts.PoolTimeout = 30*time.Second, 30*time.Second // only the wait may cut a poll
	})

	const delay = time.Second
	proxy.SetDelay(delay)
	t.Cleanup(func() { proxy.SetDelay(0) })
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 4 { // other readers keep the client's two connections busy
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				_, _ = board.Top(ctx, 10, WithPolicy(ServeStale))
			}
		})
	}
	time.Sleep(100 * time.Millisecond)
	start := time.Now()
	// One past the committed version: never met.
	_, fresh, err := board.Rank(ctx, "ada", AtLeast("ada", res.Version+1))
	took := time.Since(start)
	close(stop)
	wg.Wait()
	require.NoError(t, err)
	require.Equal(t, SourcePostgres, fresh.Source)
	require.False(t, fresh.AtLeastMet)
	require.Less(t, took, board.Config().ReadYourWritesTimeout+delay/2,
		"the wait outlived ReadYourWritesTimeout by a slow poll")
}

// TestReadYourWritesLateAnswerIsRead: a version poll Redis answered after
// the wait's deadline (a client without ContextTimeoutEnabled waits for a
// sent command's answer) is read, not taken for a poll cut off: here its
// absent version (redis.Nil from the pipeline) names "bob", the first
// requirement unmet. It was thrown away, and the StaleError named "ada",
// whose version was met.
func TestReadYourWritesLateAnswerIsRead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t, func(c *Config) {
		c.ReadPolicy = FailClosed
		c.ReadYourWritesTimeout = 150 * time.Millisecond
		c.MaxLag = time.Hour
	})
	ada := tb.submit(t, "ada", 5)
	tb.drain(t)
	bob := tb.submit(t, "bob", 3) // never projected

	board, proxy := tb.boardBehindDelayProxy(t, func(opts *redis.Options) {
		opts.ReadTimeout = 30 * time.Second
	})

	proxy.SetDelay(300 * time.Millisecond)
	t.Cleanup(func() { proxy.SetDelay(0) })
	_, err := board.Top(ctx, 10, AtLeast("ada", ada.Version), AtLeast("bob", bob.Version))
	var stale *StaleError
	require.ErrorAs(t, err, &stale)
	require.Equal(t, "bob", stale.UserID, "the first requirement unmet: %v", stale)
	require.Equal(t, bob.Version, stale.Version)
}

// TestUserIDNoBoardCanHoldIsNotLookedUp: Rank and Around of an id longer
// than MaxUserIDLengthLimit, which no Config allows, answer
// *UserNotFoundError under every policy without sending it to Redis. It
// was sent: one over the server's proto-max-bulk-len made Redis close the
// connection, and ServeStale and FailClosed reads failed with the closed
// connection.
func TestUserIDNoBoardCanHoldIsNotLookedUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client := testenv.StartRedis(t, "--proto-max-bulk-len", "1mb").Client(t)
	pg := testenv.Postgres(t)
	connections := func() string {
		m, err := client.InfoMap(ctx, "stats").Result()
		require.NoError(t, err)
		return m["Stats"]["total_connections_received"]
	}
	for _, policy := range []ReadPolicy{ServeStale, FallbackToPostgres, FailClosed} {
		cfg := &Config{Name: "b", Schema: pg.Schema, KeyPrefix: "lb:", ReadPolicy: policy}
		require.NoError(t, Migrate(ctx, pg.Pool, cfg))
		b, err := New(pg.Pool, client, cfg)
		require.NoError(t, err)
		t.Cleanup(b.Close)
		// The longest id a board may store is looked up.
		_, _, err = b.Rank(ctx, strings.Repeat("u", MaxUserIDLengthLimit))
		require.ErrorIs(t, err, ErrUserNotFound, "%v", policy)
		before := connections()
		for _, n := range []int{MaxUserIDLengthLimit + 1, 1<<20 + 1} {
			user := strings.Repeat("u", n)
			_, _, err := b.Rank(ctx, user)
			require.ErrorIs(t, err, ErrUserNotFound, "%v: Rank of a %d-byte id", policy, n)
			_, err = b.Around(ctx, user, 2)
			require.ErrorIs(t, err, ErrUserNotFound, "%v: Around of a %d-byte id", policy, n)
		}
		require.Equal(t, before, connections(), "%v: Redis closed connections", policy)
	}
}

// TestReadYourWritesWaitEndedByTheConnectionsDeadline: with
// ContextTimeoutEnabled and no retries, a poll cut at the wait's deadline
// may fail with the connection's i/o timeout before the context's timer
// fires; the wait ran out all the same, and FailClosed answers ErrStale.
// It failed with "reading the projected version: i/o timeout" in 5 to 9
// of 40 reads.
func TestReadYourWritesWaitEndedByTheConnectionsDeadline(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t, func(c *Config) {
		c.ReadPolicy = FailClosed
		c.ReadYourWritesTimeout = 30 * time.Millisecond
	})
	res := tb.submit(t, "ada", 5)
	tb.drain(t)
	board, proxy := tb.boardBehindDelayProxy(t, func(opts *redis.Options) {
		opts.ContextTimeoutEnabled = true
		opts.MaxRetries = -1
		opts.ReadTimeout = 30 * time.Second
	})

	proxy.SetDelay(200 * time.Millisecond)
	t.Cleanup(func() { proxy.SetDelay(0) })
	for i := range 40 {
		_, _, err := board.Rank(ctx, "ada", AtLeast("ada", res.Version+1))
		require.ErrorIs(t, err, ErrStale, "read %d", i)
	}
}

// boardBehindDelayProxy opens the bundle's board again on a client whose
// connections go through a delay proxy, its options edited by edit, and
// reads it once (a connection and the lag probe) before the test slows
// Redis.
func (tb *testBundle) boardBehindDelayProxy(t *testing.T, edit func(*redis.Options)) (*Board, *testenv.DelayProxy) {
	t.Helper()
	client, proxy := testenv.RedisBehindDelayProxy(t, tb.rd.Client, edit)
	cfg := tb.board.Config()
	board, err := New(tb.pg.Pool, client, &cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	_, err = board.Top(context.Background(), 10, WithPolicy(ServeStale))
	require.NoError(t, err)
	return board, proxy
}
