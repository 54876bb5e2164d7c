package leaderboard

import (
	"context"
	"fmt"
	"math/rand"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// modelRanking is the expected ranking, computed independently in Go.
func modelRanking(scores map[string]int64) []Entry {
	out := make([]Entry, 0, len(scores))
	for u, s := range scores {
		out = append(out, Entry{UserID: u, Score: s})
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Score != out[j].Score {
			return out[i].Score > out[j].Score
		}
		return out[i].UserID < out[j].UserID // bytes
	})
	for i := range out {
		out[i].Rank = int64(i + 1)
	}
	return out
}

var trickyUserIDs = []string{
	"b", "B", "a", "ä", "Z", "z", "é", "e\u0301", "e", "ab", "a b", "🎮", "ω", "A", "a{1}", "a:1", "日本",
	"ａ", "Ä", "a\u00a0", "a\t", "~", "\u007f", "ß", "ss", "İ", "i", "ı", "Å", "Å", "😀😀", "\U0010FFFF",
	" ", "  ", "a ", "a  ", "中", "中文", "ü", "u\u0308", "Ω", "Ω", "ǅ", "ﬁ", "fi",
	strings.Repeat("x", 127), strings.Repeat("x", 128), strings.Repeat("é", 64),
}

// requireEntries compares rankings, an empty one equal to a nil one.
func requireEntries(t *testing.T, want, got []Entry, msg string, args ...any) {
	t.Helper()
	if len(want) == 0 && len(got) == 0 {
		return
	}
	require.Equal(t, want, got, fmt.Sprintf(msg, args...))
}

// TestReadsAgreeAcrossSources builds random boards with many ties and
// extreme scores and checks that every read gives the model's answer from
// Redis and from PostgreSQL, with matching cursors and Freshness.
func TestReadsAgreeAcrossSources(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for seed := int64(1); seed <= 4; seed++ {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			t.Parallel()
			rng := rand.New(rand.NewSource(seed))
			tb := setup(t, func(c *Config) {
				c.MinDelta, c.MaxDelta = MinScore, MaxScore
				c.LagProbeInterval = time.Millisecond
				c.MaxLag = time.Minute
			})
			// A second board over the same data reading PostgreSQL by the
			// real path: unverified projection + FallbackToPostgres.
			pgCfg := tb.board.Config()
			pgCfg.RequireVerifiedProjection = true
			pgCfg.ReadPolicy = FallbackToPostgres
			pgBoard, err := New(tb.pg.Pool, tb.rd.Client, &pgCfg)
			require.NoError(t, err)

			// Boards over the same data through other client modes: pgx's
			// simple protocol and exec mode, and a RESP2 Redis client.
			var alt []*Board
			for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec, pgx.QueryExecModeDescribeExec} {
				pc, err := pgxpool.ParseConfig(tb.pg.ConnString)
				require.NoError(t, err)
				pc.MaxConns = 2
				pc.ConnConfig.DefaultQueryExecMode = mode
				pool, err := pgxpool.NewWithConfig(ctx, pc)
				require.NoError(t, err)
				t.Cleanup(pool.Close)
				cfg := tb.board.Config()
				b, err := New(pool, tb.rd.Client, &cfg)
				require.NoError(t, err)
				alt = append(alt, b)
			}
			opt, err := redis.ParseURL(tb.rd.URL)
			require.NoError(t, err)
			opt.Protocol = 2
			resp2 := redis.NewClient(opt)
			t.Cleanup(func() { resp2.Close() })
			cfg2 := tb.board.Config()
			resp2Board, err := New(tb.pg.Pool, resp2, &cfg2)
			require.NoError(t, err)

			tinyCfg := tb.board.Config()
			tinyCfg.MaxLag, tinyCfg.LagProbeInterval, tinyCfg.ReadPolicy = 2*time.Nanosecond, time.Nanosecond, FallbackToPostgres
			tinyBoard, err := New(tb.pg.Pool, tb.rd.Client, &tinyCfg)
			require.NoError(t, err)

			scores := map[string]int64{}
			if seed != 1 { // seed 1: the empty board
				values := []int64{MaxScore, MaxScore - 1, MinScore, MinScore + 1, 0, -1, 1, 7, -7, 1 << 52, -(1 << 52) - 1}
				ids := []string{}
				seen := map[string]bool{}
				for _, u := range trickyUserIDs {
					if !seen[u] {
						seen[u] = true
						ids = append(ids, u)
					}
				}
				nUsers := 10 + rng.Intn(len(ids))
				perm := rng.Perm(len(ids))
				var cmds []Command
				for _, k := range perm[:min(nUsers, len(ids))] {
					u := ids[k]
					s := values[rng.Intn(len(values))]
					// Two commands for some users, so versions differ.
					if rng.Intn(3) == 0 && s != MinScore && s != MaxScore {
						cmds = append(cmds, Command{EventID: uuid.New(), UserID: u, Delta: s - 1})
						cmds = append(cmds, Command{EventID: uuid.New(), UserID: u, Delta: 1})
					} else {
						cmds = append(cmds, Command{EventID: uuid.New(), UserID: u, Delta: s})
					}
					scores[u] = s
				}
				for i := 0; i < len(cmds); i++ { // mix Submit and SubmitBatch
					if rng.Intn(2) == 0 {
						_, err := tb.board.Submit(ctx, cmds[i])
						require.NoError(t, err)
						continue
					}
					j := min(len(cmds), i+1+rng.Intn(5))
					_, err := tb.board.SubmitBatch(ctx, cmds[i:j])
					require.NoError(t, err)
					i = j - 1
				}
			}
			tb.drain(t)
			want := modelRanking(scores)
			L := len(want)

			type src struct {
				name string
				b    *Board
				opts []ReadOption
				want Source
			}
			srcs := []src{
				{"redis-servestale", tb.board, []ReadOption{WithPolicy(ServeStale)}, SourceRedis},
				{"redis-failclosed", tb.board, []ReadOption{WithPolicy(FailClosed)}, SourceRedis},
				{"redis-fallback-fresh", tb.board, []ReadOption{WithPolicy(FallbackToPostgres)}, SourceRedis},
				{"pg-forced", tb.board, []ReadOption{WithPolicy(FallbackToPostgres), forcePostgres()}, SourcePostgres},
				{"pg-unverified", pgBoard, nil, SourcePostgres},
				{"pg-tiny-maxlag", tinyBoard, nil, SourcePostgres},
				{"redis-resp2", resp2Board, []ReadOption{WithPolicy(ServeStale)}, SourceRedis},
			}
			for i, b := range alt {
				srcs = append(srcs, src{fmt.Sprint("pg-mode-", i), b, []ReadOption{WithPolicy(FallbackToPostgres), forcePostgres()}, SourcePostgres})
			}
			checkFresh := func(t *testing.T, s src, f Freshness, what string) {
				t.Helper()
				require.Equal(t, s.want, f.Source, "%s %s", s.name, what)
				require.True(t, f.AtLeastMet, "%s %s", s.name, what)
				require.False(t, f.Unverified, "%s %s", s.name, what)
				require.False(t, f.ProjectedThrough.IsZero(), "%s %s", s.name, what)
				require.GreaterOrEqual(t, f.Lag, time.Duration(0), "%s %s", s.name, what)
				if s.want == SourcePostgres {
					require.Zero(t, f.Lag, "%s %s", s.name, what)
				}
			}

			// Top for every n, and Authoritative.
			for _, n := range []int{1, 2, 3, L - 1, L, L + 1, MaxPageSize} {
				if n < 1 {
					continue
				}
				exp := want[:min(n, L)]
				var nexts []string
				for _, s := range srcs {
					r, err := s.b.Top(ctx, n, s.opts...)
					require.NoError(t, err, "%s top %d", s.name, n)
					requireEntries(t, exp, r.Entries, "%s top %d", s.name, n)
					checkFresh(t, s, r.Freshness, fmt.Sprintf("top %d", n))
					require.Equal(t, n < L, r.Next != "", "%s top %d next", s.name, n)
					nexts = append(nexts, r.Next)
				}
				for _, nx := range nexts {
					require.Equal(t, nexts[0], nx, "top %d cursors differ", n)
				}
				auth, err := tb.board.Authoritative(ctx, n)
				require.NoError(t, err)
				requireEntries(t, exp, auth, "authoritative %d", n)
			}

			// All pages of every size, cursors exchanged between sources.
			for _, size := range []int{1, 2, 3, 5, L, L + 3} {
				if size < 1 {
					continue
				}
				for si, s := range srcs {
					cur := ""
					var got []Entry
					for steps := 0; ; steps++ {
						// Alternate the source that answers each page.
						use := srcs[(si+steps)%len(srcs)]
						r, err := use.b.Page(ctx, cur, size, use.opts...)
						require.NoError(t, err)
						checkFresh(t, use, r.Freshness, "page")
						got = append(got, r.Entries...)
						if r.Next == "" {
							break
						}
						require.Len(t, r.Entries, size)
						cur = r.Next
					}
					requireEntries(t, want, got, "%s pages of %d", s.name, size)
				}
			}

			// A cursor at the very end, and cursors at positions between
			// entries (a user that is not on the board).
			ends := []cursor{{score: MaxScore, user: ""}, {score: MinScore, user: "\U0010FFFF\U0010FFFF"}, {score: 0, user: "a"}, {score: 7, user: "é"}, {score: MaxScore, user: "a"}, {score: MinScore, user: "A"}, {score: 1, user: "a\xff"}, {score: 0, user: "a\x00"}, {score: 7, user: "\xff"}, {score: MaxScore, user: "\x00"}}
			if L > 0 {
				ends = append(ends, cursor{score: want[L-1].Score, user: want[L-1].UserID})
			}
			for _, c := range ends {
				text := tb.board.encodeCursor(c)
				var exp []Entry
				for _, e := range want {
					if e.Score < c.score || e.Score == c.score && e.UserID > c.user {
						exp = append(exp, e)
					}
				}
				for _, s := range srcs {
					r, err := s.b.Page(ctx, text, 1000, s.opts...)
					require.NoError(t, err, "%s after %v", s.name, c)
					requireEntries(t, exp, r.Entries, "%s after %+v", s.name, c)
					require.Empty(t, r.Next)
				}
			}

			// Rank and Around of every user, absent ones too.
			for i, e := range want {
				for _, s := range srcs {
					got, f, err := s.b.Rank(ctx, e.UserID, s.opts...)
					require.NoError(t, err, "%s rank %q", s.name, e.UserID)
					require.Equal(t, e, got, "%s rank %q", s.name, e.UserID)
					checkFresh(t, s, f, "rank")
					for _, n := range []int{0, 1, 2, L, MaxPageSize} {
						r, err := s.b.Around(ctx, e.UserID, n, s.opts...)
						require.NoError(t, err)
						lo, hi := max(0, i-n), min(L, i+n+1)
						requireEntries(t, want[lo:hi], r.Entries, "%s around %q %d", s.name, e.UserID, n)
						require.Empty(t, r.Next)
						checkFresh(t, s, r.Freshness, "around")
					}
				}
			}
			for _, u := range []string{"nobody", "ｂ", "a\u0301", "A\u030a"} {
				if _, ok := scores[u]; ok {
					continue
				}
				for _, s := range srcs {
					_, f, err := s.b.Rank(ctx, u, s.opts...)
					require.ErrorIs(t, err, ErrUserNotFound, "%s rank %q", s.name, u)
					require.Equal(t, Freshness{}, f)
					_, err = s.b.Around(ctx, u, 3, s.opts...)
					require.ErrorIs(t, err, ErrUserNotFound, "%s around %q", s.name, u)
				}
			}
		})
	}
}

// TestReadYourWritesAgreesAcrossSources: after every change is projected,
// an AtLeast read of each user is met at once under every policy and
// answers from Redis what PostgreSQL answers; with a pending change, each
// policy's answer and Freshness are what the docs say.
func TestReadYourWritesAgreesAcrossSources(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, buckets := range []int{0, 3, 64} {
		t.Run(fmt.Sprint(buckets), func(t *testing.T) {
			t.Parallel()
			tb := setup(t, func(c *Config) {
				c.VersionBuckets = buckets
				c.ReadYourWritesTimeout = 30 * time.Millisecond
				c.MinDelta, c.MaxDelta = MinScore, MaxScore
			})
			rng := rand.New(rand.NewSource(int64(buckets)))
			scores := map[string]int64{}
			versions := map[string]int64{}
			for _, u := range trickyUserIDs {
				if _, ok := scores[u]; ok {
					continue
				}
				for k := 0; k < 1+rng.Intn(3); k++ {
					d := int64(rng.Intn(5) - 2)
					res := tb.submit(t, u, d)
					scores[u] += d
					versions[u] = res.Version
				}
			}
			tb.drain(t)
			want := modelRanking(scores)
			for i, e := range want {
				for _, p := range []ReadPolicy{ServeStale, FallbackToPostgres, FailClosed} {
					// Everything is drained and nothing else writes, so a
					// wait that did not see the version at once never sees
					// it: it would run out (AtLeastMet false, or a fallback
					// to PostgreSQL, or a refusal). No wall-clock bound is
					// needed to tell, and none could hold on a loaded machine.
					got, f, err := tb.board.Rank(ctx, e.UserID, AtLeast(e.UserID, versions[e.UserID]), WithPolicy(p))
					require.NoError(t, err, "%s %q", p, e.UserID)
					require.Equal(t, e, got)
					require.Equal(t, SourceRedis, f.Source, "%s %q", p, e.UserID)
					require.True(t, f.AtLeastMet)
					r, err := tb.board.Around(ctx, e.UserID, 1, AtLeast(e.UserID, versions[e.UserID]), WithPolicy(p))
					require.NoError(t, err)
					require.Equal(t, want[max(0, i-1):min(len(want), i+2)], r.Entries)
				}
			}

			// One more change of the top user, not projected.
			top := want[0].UserID
			res := tb.submit(t, top, 1)
			scores[top]++
			want = modelRanking(scores)
			before := time.Now()

			r, err := tb.board.Top(ctx, 3, AtLeast(top, res.Version), WithPolicy(ServeStale))
			require.NoError(t, err)
			require.Equal(t, SourceRedis, r.Freshness.Source)
			require.False(t, r.Freshness.AtLeastMet)
			require.Equal(t, scores[top]-1, r.Entries[0].Score, "Redis has the old score")
			require.False(t, r.Freshness.ProjectedThrough.After(before), "ProjectedThrough %v is after the unprojected change (%v)", r.Freshness.ProjectedThrough, before)

			r, err = tb.board.Top(ctx, 3, AtLeast(top, res.Version), WithPolicy(FallbackToPostgres))
			require.NoError(t, err)
			require.Equal(t, SourcePostgres, r.Freshness.Source)
			require.True(t, r.Freshness.AtLeastMet)
			require.Zero(t, r.Freshness.Lag)
			require.Equal(t, want[:3], r.Entries)

			_, err = tb.board.Top(ctx, 3, AtLeast(top, res.Version), WithPolicy(FailClosed))
			var stale *StaleError
			require.ErrorAs(t, err, &stale)
			require.Equal(t, top, stale.UserID)
			require.Equal(t, res.Version, stale.Version)

			tb.drain(t)
			r, err = tb.board.Top(ctx, 3, AtLeast(top, res.Version), WithPolicy(FailClosed))
			require.NoError(t, err)
			require.Equal(t, want[:3], r.Entries)
		})
	}
}

// TestLargeBoardAgrees: a board past the listpack encoding (a skiplist
// sorted set), with heavy ties among multibyte ids.
func TestLargeBoardAgrees(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t, func(c *Config) { c.MinDelta, c.MaxDelta = MinScore, MaxScore })
	rng := rand.New(rand.NewSource(99))
	alphabet := []string{"a", "A", "b", "ä", "é", "e\u0301", " ", "~", "日", "🎮", "ß", "z", "Z", "ı", "I", "_", "-", "."}
	values := []int64{MaxScore, 3, 0, -3, MinScore}
	scores := map[string]int64{}
	var cmds []Command
	for len(scores) < 700 {
		var sb strings.Builder
		for k := 0; k < 1+rng.Intn(6); k++ {
			sb.WriteString(alphabet[rng.Intn(len(alphabet))])
		}
		u := sb.String()
		if _, ok := scores[u]; ok {
			continue
		}
		s := values[rng.Intn(len(values))]
		scores[u] = s
		cmds = append(cmds, Command{EventID: uuid.New(), UserID: u, Delta: s})
	}
	_, err := tb.board.SubmitBatch(ctx, cmds)
	require.NoError(t, err)
	tb.drain(t)
	enc, err := tb.rd.Client.ObjectEncoding(ctx, tb.board.SortedSetKey()).Result()
	require.NoError(t, err)
	require.Equal(t, "skiplist", enc)
	want := modelRanking(scores)
	for _, size := range []int{1, 7, 100, MaxPageSize} {
		fromRedis, _ := allPages(t, tb.board, size, WithPolicy(ServeStale))
		require.Equal(t, want, fromRedis, "redis pages of %d", size)
		fromPG, _ := allPages(t, tb.board, size, WithPolicy(FallbackToPostgres), forcePostgres())
		require.Equal(t, want, fromPG, "pg pages of %d", size)
	}
	for i := 0; i < len(want); i += 1 + rng.Intn(20) {
		e := want[i]
		for _, opts := range [][]ReadOption{{WithPolicy(ServeStale)}, {WithPolicy(FallbackToPostgres), forcePostgres()}} {
			got, _, err := tb.board.Rank(ctx, e.UserID, opts...)
			require.NoError(t, err)
			require.Equal(t, e, got)
			r, err := tb.board.Around(ctx, e.UserID, 4, opts...)
			require.NoError(t, err)
			require.Equal(t, want[max(0, i-4):min(len(want), i+5)], r.Entries)
		}
	}
}

// TestStaleErrorLagOfUnmetAtLeast checks that a read whose AtLeast is not
// met reports the measured lag in its StaleError ("negative when it could
// not be measured"), under FailClosed as under ServeStale.
func TestStaleErrorLagOfUnmetAtLeast(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t, func(c *Config) {
		c.ReadYourWritesTimeout = 10 * time.Millisecond
		c.LagProbeInterval = time.Millisecond
	})
	res := tb.submit(t, "ada", 5) // not projected: ada is missing in Redis

	_, _, err := tb.board.Rank(ctx, "ada", AtLeast("ada", res.Version), WithPolicy(ServeStale))
	var served *StaleError
	require.ErrorAs(t, err, &served)
	require.GreaterOrEqual(t, served.Lag, time.Duration(0), "ServeStale's StaleError carries the measured lag")

	require.GreaterOrEqual(t, tb.board.Freshness(ctx).Lag, time.Duration(0), "the lag can be measured")
	_, _, err = tb.board.Rank(ctx, "ada", AtLeast("ada", res.Version), WithPolicy(FailClosed))
	var closed *StaleError
	require.ErrorAs(t, err, &closed)
	require.GreaterOrEqual(t, closed.Lag, time.Duration(0),
		"FailClosed's StaleError says the lag could not be measured (Lag %v) although it was", closed.Lag)
	require.False(t, closed.Unverified)
}
