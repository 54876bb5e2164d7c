package leaderboard

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/projection"
	"github.com/verity-go/verity/reconcile"
)

// requireNoMarker fails if Redis still holds the board's Verify marker.
func requireNoMarker(t *testing.T, rd *testenv.RD, board *Board) {
	t.Helper()
	n, err := rd.Client.Exists(context.Background(), board.verifyingKey).Result()
	require.NoError(t, err)
	require.Zero(t, n, "the marker of a Verify that recorded nothing outlived it")
}

// TestVerify checks RequireVerifiedProjection: reads see a Redis that lost
// the board's keys, which the outbox lag cannot show, until Verify has
// found the projection complete again.
// verifyMarkerGone is Verify's warning when its pass's marker is gone.
const verifyMarkerGone = "leaderboard: verify: the pass's marker is gone (another Verify of the board began and ended during this pass, Redis lost the key, or a failover), so its repairs may be lost; nothing recorded, run Verify again"

func TestVerify(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	verifying := func(t *testing.T, mutate ...func(*Config)) *testBundle {
		return setup(t, append([]func(*Config){func(c *Config) {
			c.RequireVerifiedProjection = true
			c.ReadPolicy = FailClosed
			c.LagProbeInterval = time.Nanosecond
		}}, mutate...)...)
	}
	// A verifying board whose reads look for the record once an hour, with
	// ada's score projected.
	verifyingHourly := func(t *testing.T) *testBundle {
		tb := setup(t, func(c *Config) {
			c.RequireVerifiedProjection = true
			c.ReadPolicy = FailClosed
			c.LagProbeInterval = time.Hour
			c.MaxLag = 2 * time.Hour
		})
		tb.submit(t, "ada", 10)
		tb.drain(t)
		return tb
	}
	requireUnverified := func(t *testing.T, tb *testBundle) {
		t.Helper()
		_, err := tb.board.Top(ctx, 10)
		var stale *StaleError
		require.ErrorAs(t, err, &stale)
		require.Equal(t, time.Duration(-1), stale.Lag)
		require.True(t, stale.Unverified)
		require.ErrorContains(t, err, "Board.Verify")
		fr := tb.board.Freshness(ctx)
		require.True(t, fr.Unverified)
		require.Equal(t, time.Duration(-1), fr.Lag)
	}

	t.Run("UnverifiedUntilVerify", func(t *testing.T) {
		t.Parallel()
		tb := verifying(t)
		tb.submit(t, "ada", 10)
		tb.drain(t)
		requireUnverified(t, tb)

		rep, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified)
		require.Equal(t, int64(1), rep.Counts[reconcile.ClassCurrent])
		r, err := tb.board.Top(ctx, 10)
		require.NoError(t, err)
		require.False(t, r.Freshness.Unverified)
		require.Equal(t, int64(10), r.Entries[0].Score)
	})

	// A DEL of the sorted set alone (or its eviction) keeps the record,
	// and the board would read empty and verified: the record no longer
	// counts once the sorted set holds fewer members than the pass saw,
	// also after new scores recreated it, and, for a board that saw it
	// smaller, once they made it as large again. A board verified empty
	// stays verified when its first score is projected.
	t.Run("SortedSetLostAloneIsSeen", func(t *testing.T) {
		t.Parallel()
		tb := verifying(t)
		_, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified, "verified empty")
		tb.submit(t, "ada", 10)
		tb.submit(t, "bob", 20)
		tb.drain(t)
		r, err := tb.board.Top(ctx, 10)
		require.NoError(t, err, "the first scores of a board verified empty")
		require.Len(t, r.Entries, 2)

		_, verified, err = tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified)
		require.NoError(t, tb.rd.Client.Del(ctx, tb.board.SortedSetKey()).Err())
		requireUnverified(t, tb)
		// A new score recreates the sorted set, without ada and bob: still
		// fewer members than Verify saw.
		tb.submit(t, "carol", 5)
		tb.drain(t)
		requireUnverified(t, tb)
		// A second makes it as large as Verify saw: this board saw the
		// loss, and does not trust the record again (it did, and read
		// carol and dave as the verified board).
		tb.submit(t, "dave", 6)
		tb.drain(t)
		requireUnverified(t, tb)

		rep, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified)
		require.Equal(t, int64(2), rep.Repaired, "%v", rep.Counts)
		r, err = tb.board.Top(ctx, 10)
		require.NoError(t, err)
		require.Len(t, r.Entries, 4)
		require.False(t, r.Freshness.Unverified)
	})

	// An allkeys-* eviction can take the sorted set and the record's
	// companion (the size Verify saw) and leave the record: without the
	// companion the count could not be checked, and the board read empty
	// and verified. A record without its companion is taken as lost with
	// it, also for a board verified empty (whose companion says 0).
	t.Run("CompanionLostWithTheSortedSetIsSeen", func(t *testing.T) {
		t.Parallel()
		tb := verifying(t)
		_, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified, "verified empty")
		require.NoError(t, tb.rd.Client.Del(ctx, tb.board.heldKey).Err())
		requireUnverified(t, tb)

		for i := range 20 {
			tb.submit(t, fmt.Sprintf("user-%02d", i), int64(i+1))
		}
		tb.drain(t)
		_, verified, err = tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified)
		r, err := tb.board.Top(ctx, 10)
		require.NoError(t, err)
		require.Len(t, r.Entries, 10)
		require.NoError(t, tb.rd.Client.Del(ctx, tb.board.SortedSetKey(), tb.board.heldKey).Err())
		require.Equal(t, int64(1), tb.rd.Client.Exists(ctx, tb.board.verifiedKey).Val(), "the record stays")
		requireUnverified(t, tb)
	})

	// A record of an earlier release names no database and has no
	// companion: it is trusted as before (see "Upgrading") until the next
	// Verify replaces it.
	t.Run("EarlierReleaseRecordIsTrusted", func(t *testing.T) {
		t.Parallel()
		tb := verifying(t)
		for i := range 3 {
			tb.submit(t, fmt.Sprintf("user-%d", i), int64(i+1))
		}
		tb.drain(t)
		record := uuid.NewString() + " " + time.Now().UTC().Format(time.RFC3339Nano)
		require.NoError(t, tb.rd.Client.Set(ctx, tb.board.verifiedKey, record, 0).Err())
		require.Zero(t, tb.rd.Client.Exists(ctx, tb.board.heldKey).Val())
		r, err := tb.board.Top(ctx, 10)
		require.NoError(t, err, "an earlier release's record is trusted as before")
		require.Len(t, r.Entries, 3)
		require.False(t, r.Freshness.Unverified)

		_, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified)
		require.NoError(t, tb.rd.Client.Del(ctx, tb.board.heldKey).Err())
		requireUnverified(t, tb) // this release's record needs its companion
	})

	// The releases just before wrote the companion with a record whose
	// token lacks the prefix: once an eviction takes the sorted set and
	// the companion, such a record is not trusted either.
	t.Run("EarlierReleaseRecordWithItsCompanionLost", func(t *testing.T) {
		t.Parallel()
		tb := verifying(t)
		for i := range 20 {
			tb.submit(t, fmt.Sprintf("user-%02d", i), int64(i+1))
		}
		tb.drain(t)
		_, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified)
		record := tb.rd.Client.Get(ctx, tb.board.verifiedKey).Val()
		held := tb.rd.Client.Get(ctx, tb.board.heldKey).Val()
		require.True(t, strings.HasPrefix(record, heldTokenPrefix), record)
		require.NoError(t, tb.rd.Client.Set(ctx, tb.board.verifiedKey, strings.TrimPrefix(record, heldTokenPrefix), 0).Err())
		require.NoError(t, tb.rd.Client.Set(ctx, tb.board.heldKey, strings.TrimPrefix(held, heldTokenPrefix), 0).Err())
		r, err := tb.board.Top(ctx, 10)
		require.NoError(t, err)
		require.Len(t, r.Entries, 10)

		require.NoError(t, tb.rd.Client.Del(ctx, tb.board.SortedSetKey(), tb.board.heldKey).Err())
		requireUnverified(t, tb)
	})

	// The sorted set lost alone during the pass, after the pass had found
	// its first page current: the pages it read after the loss are
	// repaired, the first is not. Nothing is recorded, and the record of
	// an earlier Verify goes too.
	t.Run("SortedSetLostDuringThePass", func(t *testing.T) {
		t.Parallel()
		logs := &testenv.LogSink{}
		tb := verifying(t, func(c *Config) { c.Logger = logs.Logger() })
		const users = 20
		for i := range users {
			if i == users/2 {
				tb.drain(t)
				_, verified, err := tb.board.Verify(ctx, nil)
				require.NoError(t, err)
				require.True(t, verified, "setup: the earlier Verify, of half the users")
			}
			tb.submit(t, fmt.Sprintf("u%02d", i), int64(i+1))
		}
		tb.drain(t)
		// A drifted first page, so that the pass repairs there, and the
		// loss happens after it found the page's other members current.
		require.NoError(t, tb.rd.Client.ZRem(ctx, tb.board.SortedSetKey(), "u00").Err())
		var lose sync.Once
		cfg := &reconcile.Config{PageSize: 5, ReadAhead: 1, BeforeRepair: func(ctx context.Context, _ reconcile.Finding) bool {
			lose.Do(func() { require.NoError(t, tb.rd.Client.Del(ctx, tb.board.SortedSetKey()).Err()) })
			return true
		}}
		rep, verified, err := tb.board.Verify(ctx, cfg)
		require.NoError(t, err)
		require.False(t, verified, "the pass checked %d users; the sorted set lost some of them: %v", rep.Checked, rep.Counts)
		require.Equal(t, int64(users), rep.Checked)
		require.Len(t, logs.Lines(t, "leaderboard: verify: the sorted set or its version keys lost members during the pass (a DEL of one, its eviction); nothing recorded, run Verify again"), 1)
		held, err := tb.rd.Client.ZCard(ctx, tb.board.SortedSetKey()).Result()
		require.NoError(t, err)
		require.Less(t, held, int64(users), "setup: members lost for good")
		requireUnverified(t, tb)

		_, verified, err = tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified, "the next Verify repairs and records")
		r, err := tb.board.Top(ctx, users)
		require.NoError(t, err)
		require.Len(t, r.Entries, users)
	})

	// The board's version keys lost alone during the pass, after it had
	// found a user current: a user without a version takes any redelivered
	// older score, so nothing is recorded. The ZCARD check alone let it
	// record, and the next pass found the user corrupt.
	t.Run("VersionsLostDuringThePass", func(t *testing.T) {
		t.Parallel()
		for _, buckets := range []int{0, 4} {
			t.Run(fmt.Sprintf("Buckets%d", buckets), func(t *testing.T) {
				t.Parallel()
				logs := &testenv.LogSink{}
				tb := verifying(t, func(c *Config) { c.VersionBuckets = buckets; c.Logger = logs.Logger() })
				tb.submit(t, "ada", 10)
				tb.submit(t, "bob", 20)
				tb.drain(t)
				// ada missing, so that the pass repairs (and the hook runs)
				// once it has found bob current.
				ks := tb.board.Keyspace()
				require.NoError(t, tb.rd.Client.ZRem(ctx, tb.board.SortedSetKey(), "ada").Err())
				require.NoError(t, tb.rd.Client.HDel(ctx, ks.VersionKey(projection.Target{Kind: projection.KindSortedSet, Name: tb.board.Name(), Member: "ada"}), "ada").Err())
				var lose sync.Once
				cfg := &reconcile.Config{PageSize: 5, ReadAhead: 1, BeforeRepair: func(ctx context.Context, _ reconcile.Finding) bool {
					lose.Do(func() {
						require.NoError(t, tb.rd.Client.Del(ctx, ks.VersionKeys(tb.board.Name(), projection.KindSortedSet)...).Err())
					})
					return true
				}}
				rep, verified, err := tb.board.Verify(ctx, cfg)
				require.NoError(t, err)
				require.False(t, verified, "bob's version was lost after the pass found him current: %v", rep.Counts)
				require.Len(t, logs.Lines(t, "leaderboard: verify: the sorted set or its version keys lost members during the pass (a DEL of one, its eviction); nothing recorded, run Verify again"), 1)
				requireUnverified(t, tb)

				_, verified, err = tb.board.Verify(ctx, nil)
				require.NoError(t, err)
				require.True(t, verified, "the next Verify repairs bob's version and records")
			})
		}
	})

	// Between the pass's read and its repair of a missing entry, a foreign
	// write (a hand edit, a buggy writer) puts the user in Redis with a
	// score PostgreSQL never had, at the same version (the gate answers
	// conflict) or a higher one (stale). Both came back raced, which
	// Verify accepted, recording the foreign score as verified; the
	// raced entries are checked again: the conflict is corrupt and
	// repaired, the higher version ahead, only reported and in the report.
	// A writer that writes again before every repair, the rechecks'
	// too, leaves nothing recorded.
	t.Run("ForeignWriteDuringRepair", func(t *testing.T) {
		t.Parallel()
		for _, tc := range []struct {
			name         string
			bump         int64 // added to the source's version by the foreign write
			keepsWriting bool  // another score before every repair
			verified     bool
		}{
			{"SameVersion", 0, false, true},
			{"HigherVersion", 5, false, false},
			{"KeepsWriting", 0, true, false},
		} {
			t.Run(tc.name, func(t *testing.T) {
				t.Parallel()
				logs := &testenv.LogSink{}
				tb := verifying(t, func(c *Config) { c.Logger = logs.Logger() })
				tb.submit(t, "ada", 10)
				tb.drain(t)
				versions := tb.board.Keyspace().VersionKeys(tb.board.Name(), projection.KindSortedSet)[0]
				// ada's entry lost: the pass finds it missing.
				require.NoError(t, tb.rd.Client.ZRem(ctx, tb.board.SortedSetKey(), "ada").Err())
				require.NoError(t, tb.rd.Client.HDel(ctx, versions, "ada").Err())
				foreign := -999.0
				cfg := &reconcile.Config{BeforeRepair: func(ctx context.Context, f reconcile.Finding) bool {
					if tc.keepsWriting {
						foreign--
					}
					require.NoError(t, tb.rd.Client.ZAdd(ctx, tb.board.SortedSetKey(), redis.Z{Score: foreign, Member: "ada"}).Err())
					require.NoError(t, tb.rd.Client.HSet(ctx, versions, "ada", strconv.FormatInt(f.Source.Version+tc.bump, 10)).Err())
					return true
				}}
				rep, verified, err := tb.board.Verify(ctx, cfg)
				require.NoError(t, err)
				require.GreaterOrEqual(t, rep.Results[reconcile.ResultRaced], int64(1), "setup: the gate declined the repair")
				require.Equal(t, tc.verified, verified, "%s", rep)
				switch {
				case tc.keepsWriting:
					require.Len(t, logs.Lines(t, "leaderboard: verify: an entry's repair was declined again in three rechecks (a writer keeps changing it); nothing recorded, run Verify again"), 1)
					requireUnverified(t, tb)
				case !tc.verified:
					require.EqualValues(t, 1, rep.Counts[reconcile.ClassAhead], "the report names what stood in the way: %s", rep)
					requireUnverified(t, tb)
				default:
					top, err := tb.board.Top(ctx, 10)
					require.NoError(t, err)
					require.Equal(t, []Entry{{UserID: "ada", Score: 10, Rank: 1}}, top.Entries, "the verified board holds PostgreSQL's score")
					// The report has the recheck's repair, split by class
					// as Repaired is, with its example.
					require.EqualValues(t, 1, rep.Repaired, "%s", rep)
					require.Equal(t, map[reconcile.Class]int64{reconcile.ClassCorrupt: 1}, rep.RepairedByClass)
					require.Len(t, rep.Examples[reconcile.ClassCorrupt], 1)
				}
			})
		}
	})

	// A Verify that begins during another replaces its marker: the
	// earlier records nothing, and says why, rather than blaming a Redis
	// loss or a failover alone; the later one records.
	t.Run("OverlappedPassSaysSo", func(t *testing.T) {
		t.Parallel()
		logs := &testenv.LogSink{}
		tb := verifying(t, func(c *Config) { c.Logger = logs.Logger() })
		for i := range 10 {
			tb.submit(t, fmt.Sprintf("u%02d", i), int64(i+1))
		}
		tb.drain(t)
		require.NoError(t, tb.rd.Client.ZRem(ctx, tb.board.SortedSetKey(), "u00").Err()) // a repair: the hook below runs
		var later sync.Once
		cfg := &reconcile.Config{BeforeRepair: func(ctx context.Context, _ reconcile.Finding) bool {
			later.Do(func() {
				_, verified, err := tb.board.Verify(ctx, nil)
				require.NoError(t, err)
				require.True(t, verified, "the later pass records")
			})
			return true
		}}
		_, verified, err := tb.board.Verify(ctx, cfg)
		require.NoError(t, err)
		require.False(t, verified)
		require.Len(t, logs.Lines(t, verifyMarkerGone), 1, "the later pass ended before the earlier: its marker is gone")
		r, err := tb.board.Top(ctx, 10)
		require.NoError(t, err, "the later pass's record stands")
		require.Len(t, r.Entries, 10)

		// The later pass still under way when the earlier ends.
		require.NoError(t, tb.rd.Client.ZRem(ctx, tb.board.SortedSetKey(), "u01").Err())
		var begin sync.Once
		cfg = &reconcile.Config{BeforeRepair: func(ctx context.Context, _ reconcile.Finding) bool {
			begin.Do(func() {
				require.NoError(t, verifyBeginScript.Run(ctx, tb.rd.Client, []string{tb.board.verifyingKey}, "a-later-pass").Err())
			})
			return true
		}}
		_, verified, err = tb.board.Verify(ctx, cfg)
		require.NoError(t, err)
		require.False(t, verified)
		require.Len(t, logs.Lines(t, "leaderboard: verify: another Verify of the board began during this pass and replaced its marker; nothing recorded by this pass (the other records if it completes)"), 1)
		require.Len(t, logs.Lines(t, verifyMarkerGone), 1, "no more than before")
	})

	// A pass that skips the orphan check cannot tell that Redis holds a
	// user PostgreSQL lacks: Verify refuses the option, writes nothing,
	// and reads stay unverified.
	t.Run("SkipOrphansIsRefused", func(t *testing.T) {
		t.Parallel()
		tb := verifying(t)
		tb.submit(t, "alice", 5)
		tb.drain(t)
		require.NoError(t, tb.rd.Client.ZAdd(ctx, tb.board.SortedSetKey(), redis.Z{Score: -1000, Member: "mallory"}).Err())

		rep, verified, err := tb.board.Verify(ctx, &reconcile.Config{SkipOrphans: true})
		var cfgErr *ConfigError
		require.ErrorAs(t, err, &cfgErr)
		require.Equal(t, "reconcile.Config.SkipOrphans", cfgErr.Field)
		require.ErrorIs(t, err, ErrInvalidConfig)
		// As for the reconcile.Config fields reconcile checks itself
		// (ConfigError.Err): errors.Is finds reconcile's sentinel too.
		require.ErrorIs(t, err, reconcile.ErrInvalidConfig)
		var reconcileErr *reconcile.ConfigError
		require.ErrorAs(t, err, &reconcileErr)
		require.Equal(t, "Config.SkipOrphans", reconcileErr.Field)
		require.False(t, verified)
		require.Nil(t, rep)
		exists, err := tb.rd.Client.Exists(ctx, tb.board.SortedSetKey()+"~verifying").Result()
		require.NoError(t, err)
		require.Zero(t, exists, "no pass marker was set")
		requireUnverified(t, tb)

		rep, verified, err = tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.False(t, verified, "the default pass finds the orphan")
		require.Equal(t, int64(1), rep.Counts[reconcile.ClassOrphan])
	})

	t.Run("RedisLossIsSeenAndRepaired", func(t *testing.T) {
		t.Parallel()
		tb := verifying(t)
		for _, u := range []string{"ada", "bob", "cy"} {
			tb.submit(t, u, 10)
		}
		tb.drain(t)
		_, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified)

		// Redis loses the board; new writes then recreate part of it.
		require.NoError(t, testenv.DeletePrefix(ctx, tb.rd.Client, tb.rd.Prefix))
		tb.submit(t, "dee", 5)
		tb.drain(t)
		requireUnverified(t, tb)
		r, err := tb.board.Top(ctx, 10, WithPolicy(ServeStale))
		require.NoError(t, err)
		require.Len(t, r.Entries, 1, "setup: only dee is back")
		require.True(t, r.Freshness.Unverified)

		rep, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified)
		require.Equal(t, int64(3), rep.RepairedByClass[reconcile.ClassMissing])
		r, err = tb.board.Top(ctx, 10)
		require.NoError(t, err)
		require.Len(t, r.Entries, 4)
	})

	// A read-your-writes read refused on an unverified board says why: the
	// awaited version may never come back until Verify repairs it.
	t.Run("AtLeastRefusalNamesVerify", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) {
			c.RequireVerifiedProjection = true
			c.ReadPolicy = FailClosed
			c.LagProbeInterval = time.Nanosecond
			c.ReadYourWritesTimeout = 20 * time.Millisecond
		})
		res := tb.submit(t, "ada", 10)
		tb.drain(t)
		_, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified)
		require.NoError(t, testenv.DeletePrefix(ctx, tb.rd.Client, tb.rd.Prefix)) // Redis loses the board
		_, _, err = tb.board.Rank(ctx, "ada", AtLeast("ada", res.Version))
		var stale *StaleError
		require.ErrorAs(t, err, &stale)
		require.True(t, stale.Unverified)
		require.Equal(t, res.Version, stale.Version)
		require.ErrorContains(t, err, "Board.Verify")
	})

	// How soon a loss is seen depends on Redis alone. While a lag probe is
	// stuck on a busy pool, reads reuse its previous measurement, but look
	// for the record on their own once the last look is LagProbeInterval
	// old: a healthy Redis still reads verified, an emptied one unverified.
	t.Run("LossIsSeenWhileALagProbeIsStuck", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) { c.RequireVerifiedProjection = true })
		for _, u := range []string{"ada", "bob", "cy"} {
			tb.submit(t, u, 10)
		}
		tb.drain(t)
		_, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified)
		// MaxLag far above the test's duration: only the verification can
		// refuse a read.
		pc, err := pgxpool.ParseConfig(tb.pg.ConnString)
		require.NoError(t, err)
		board, small := tb.failClosedOnPoolOfOne(t, pc, 5*time.Second, 50*time.Millisecond)
		interval := board.Config().LagProbeInterval
		r, err := board.Top(ctx, 10)
		require.NoError(t, err)
		require.Len(t, r.Entries, 3)

		// PostgreSQL gets busy: the test holds the pool's only connection,
		// and the next lag probe waits for it.
		held, err := small.Acquire(ctx)
		require.NoError(t, err)
		defer held.Release()
		time.Sleep(interval)
		probeCtx, cancelProbe := context.WithCancel(ctx)
		probed := make(chan struct{})
		go func() {
			defer close(probed)
			_, _ = board.Top(probeCtx, 10)
		}()
		t.Cleanup(func() { cancelProbe(); <-probed })
		probing := func() bool {
			board.lagMu.Lock()
			defer board.lagMu.Unlock()
			return board.lagProbe.running
		}
		require.Eventually(t, probing, 5*time.Second, time.Millisecond)
		time.Sleep(interval)
		r, err = board.Top(ctx, 10)
		require.NoError(t, err, "a slow PostgreSQL made a healthy Redis unverified")
		require.Len(t, r.Entries, 3)

		// Redis loses the board's keys.
		require.NoError(t, testenv.DeletePrefix(ctx, tb.rd.Client, tb.rd.Prefix))
		lost := time.Now()
		time.Sleep(interval)
		r, err = board.Top(ctx, 10)
		var stale *StaleError
		require.ErrorAs(t, err, &stale, "served %d entries as verified %s after Redis lost them (lag %s)", len(r.Entries), time.Since(lost), r.Freshness.Lag)
		require.True(t, stale.Unverified)
		require.Equal(t, time.Duration(-1), stale.Lag)
		r, err = board.Top(ctx, 10, WithPolicy(ServeStale))
		require.NoError(t, err)
		require.Empty(t, r.Entries)
		require.True(t, r.Freshness.Unverified)
		require.True(t, board.Freshness(ctx).Unverified)
		require.True(t, probing(), "setup: the lag probe was under way throughout")
	})

	// The look for the record is reused like the lag: reads within
	// LagProbeInterval add no Redis round trip, and concurrent reads share
	// the look under way.
	t.Run("ReadsLookOncePerInterval", func(t *testing.T) {
		t.Parallel()
		tb := verifyingHourly(t)
		_, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified)
		var looks atomic.Int64
		board := boardOnClient(t, tb, nil, getsOfKey{key: tb.board.verifiedKey, n: &looks})

		var wg sync.WaitGroup
		for range 20 {
			wg.Go(func() {
				r, err := board.Top(ctx, 10)
				assert.NoError(t, err)
				assert.Len(t, r.Entries, 1)
			})
		}
		wg.Wait()
		require.Equal(t, int64(1), looks.Load(), "concurrent reads looked for the record apart")
		for range 10 {
			_, err := board.Top(ctx, 10)
			require.NoError(t, err)
		}
		require.Equal(t, int64(1), looks.Load(), "reads within LagProbeInterval looked again")
	})

	// What a Verify finds reaches its own board's reads at once, not once
	// their last look for the record is LagProbeInterval old: the record it
	// made, and the deletion of an earlier one by a pass that found the
	// projection wrong.
	t.Run("OwnVerifyIsSeenAtOnce", func(t *testing.T) {
		t.Parallel()
		tb := verifyingHourly(t)
		requireUnverified(t, tb) // a look that found no record, good for an hour
		_, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified)
		r, err := tb.board.Top(ctx, 10)
		require.NoError(t, err, "the board's own Verify went unseen")
		require.False(t, r.Freshness.Unverified)

		// A member PostgreSQL does not have, which the default policy
		// leaves: the next pass refutes the record.
		require.NoError(t, tb.rd.Client.ZAdd(ctx, tb.board.SortedSetKey(), redis.Z{Score: -5, Member: "ghost"}).Err())
		rep, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.False(t, verified)
		require.Equal(t, int64(1), rep.Counts[reconcile.ClassOrphan])
		requireUnverified(t, tb)
	})

	// A look for the record that Redis answered "verified" just before a
	// Verify of the same board refuted the record, and whose reply reaches
	// the board only after that, is not published: the reads after the
	// refutation look again, instead of trusting the record for the rest of
	// LagProbeInterval.
	t.Run("LookAnsweredBeforeARefutationIsNotReused", func(t *testing.T) {
		t.Parallel()
		tb := verifyingHourly(t)
		_, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified)

		hook := &heldAfterGet{key: tb.board.verifiedKey, answered: make(chan struct{}), release: make(chan struct{})}
		hook.armed.Store(true)
		board := boardOnClient(t, tb, nil, hook)

		first := make(chan error, 1)
		go func() {
			_, err := board.Top(ctx, 10)
			first <- err
		}()
		<-hook.answered // Redis answered the look: the record was there

		// A member PostgreSQL does not have, which the default policy
		// leaves: the pass refutes the record.
		require.NoError(t, tb.rd.Client.ZAdd(ctx, tb.board.SortedSetKey(), redis.Z{Score: -5, Member: "ghost"}).Err())
		rep, verified, err := board.Verify(ctx, nil)
		require.NoError(t, err)
		require.False(t, verified)
		require.Equal(t, int64(1), rep.Counts[reconcile.ClassOrphan])
		close(hook.release)
		require.NoError(t, <-first, "the look was answered before the refutation")

		_, err = board.Top(ctx, 10)
		var stale *StaleError
		require.ErrorAs(t, err, &stale, "served as verified after this board's own Verify refuted the record")
		require.True(t, stale.Unverified)
	})

	t.Run("LossDuringVerifyIsNotRecorded", func(t *testing.T) {
		t.Parallel()
		tb := verifying(t)
		tb.submit(t, "ada", 10)
		tb.submit(t, "bob", 20)
		tb.drain(t)
		require.NoError(t, tb.rd.Client.ZRem(ctx, tb.board.SortedSetKey(), "ada").Err()) // one repair to make
		wiped := false
		_, verified, err := tb.board.Verify(ctx, &reconcile.Config{
			BeforeRepair: func(ctx context.Context, _ reconcile.Finding) bool {
				if !wiped { // Redis restarts empty while the pass runs
					wiped = true
					assert.NoError(t, testenv.DeletePrefix(ctx, tb.rd.Client, tb.rd.Prefix))
				}
				return true
			},
		})
		require.NoError(t, err)
		require.True(t, wiped)
		require.False(t, verified, "bob, checked before the loss, is gone again")
		requireUnverified(t, tb)
	})

	t.Run("IncompletePassIsNotRecorded", func(t *testing.T) {
		t.Parallel()
		tb := verifying(t)
		tb.submit(t, "ada", 10)
		// Not projected: missing, and a policy that only reports it.
		rep, verified, err := tb.board.Verify(ctx, &reconcile.Config{Policy: reconcile.Policy{Missing: reconcile.ActionReport}})
		require.NoError(t, err)
		require.False(t, verified)
		require.Equal(t, int64(1), rep.Counts[reconcile.ClassMissing])
		rep, verified, err = tb.board.Verify(ctx, &reconcile.Config{BeforeRepair: func(context.Context, reconcile.Finding) bool { return false }})
		require.NoError(t, err)
		require.False(t, verified)
		require.Equal(t, int64(1), rep.Results[reconcile.ResultVetoed])
		requireUnverified(t, tb)
		requireNoMarker(t, tb.rd, tb.board)
	})

	// A Verify that records nothing leaves no marker of its pass behind, a
	// refused one included: only the verified record may outlive a pass.
	t.Run("RefusedPassLeavesNoMarker", func(t *testing.T) {
		t.Parallel()
		pg, rd := testenv.Postgres(t), testenv.Redis(t)
		board, err := New(pg.Pool, rd.Client, &Config{Name: "weekly", Schema: pg.Schema, KeyPrefix: rd.Prefix})
		require.NoError(t, err)
		t.Cleanup(board.Close)
		_, verified, err := board.Verify(ctx, nil) // never migrated
		require.ErrorIs(t, err, ErrNotMigrated)
		require.False(t, verified)
		// Like Verify's other errors, the pass's starts "leaderboard:
		// verify: ", and it keeps the reconciler's and the driver's.
		require.True(t, strings.HasPrefix(err.Error(), "leaderboard: verify: reconcile: reading source page: leaderboard: source: "), "%q", err.Error())
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr)
		keys, err := rd.Client.Keys(ctx, rd.Prefix+"*").Result()
		require.NoError(t, err)
		require.Empty(t, keys, "a Verify refused with ErrNotMigrated left keys in Redis")
	})

	t.Run("MarkerOfANewerPassIsKept", func(t *testing.T) {
		t.Parallel()
		tb := verifying(t)
		require.NoError(t, tb.rd.Client.Set(ctx, tb.board.verifyingKey, "another-pass", 0).Err())
		tb.board.abandonVerify(ctx, "this-pass", false)
		v, err := tb.rd.Client.Get(ctx, tb.board.verifyingKey).Result()
		require.NoError(t, err)
		require.Equal(t, "another-pass", v, "a pass deleted the marker of another")
	})

	// go-redis resends a command by itself (MaxRetries) when the connection
	// drops before the reply: the recording script then runs twice, and the
	// second run must not deny the record the first one made.
	t.Run("RecordReplyLostStillVerified", func(t *testing.T) {
		t.Parallel()
		tb := verifying(t)
		tb.submit(t, "ada", 10)
		tb.drain(t)
		// Loaded first, so that the marked EVALSHA runs it (rather than
		// fail with NOSCRIPT and leave the run to an EVAL).
		sha, err := verifiedScript.Load(ctx, tb.rd.Client).Result()
		require.NoError(t, err)
		fired := new(atomic.Bool)
		board := boardOnClient(t, tb, func(opts *redis.Options) { opts.Dialer = replyDropDialer(sha, fired) })

		_, verified, err := board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, fired.Load(), "setup: the script's reply was dropped")
		require.True(t, verified, "the record is in Redis: reads see the board verified")
		r, err := tb.board.Top(ctx, 10)
		require.NoError(t, err)
		require.False(t, r.Freshness.Unverified)

		// The record vouches for its own pass only: another token (a prefix
		// of it included) whose KEYS[1] is gone records nothing.
		record, err := tb.rd.Client.Get(ctx, tb.board.verifiedKey).Result()
		require.NoError(t, err)
		token, _, ok := strings.Cut(record, " ")
		require.True(t, ok, "record %q", record)
		keys := []string{tb.board.verifyingKey, tb.board.verifiedKey}
		for _, other := range []string{token[:len(token)-1], "another-pass"} {
			n, err := verifiedScript.Run(ctx, tb.rd.Client, keys, other, "now").Int()
			require.NoError(t, err)
			require.Zero(t, n, "token %q", other)
		}
	})

	// The reply to the script that begins the pass is lost after Redis ran
	// it (and, MaxRetries -1, not resent): Verify fails, and must not leave
	// its marker behind, which would make an overlapping pass record
	// nothing while waiting for this one to record.
	t.Run("BeginReplyLostLeavesNoMarker", func(t *testing.T) {
		t.Parallel()
		tb := verifying(t)
		tb.submit(t, "ada", 10)
		tb.drain(t)
		sha, err := verifyBeginScript.Load(ctx, tb.rd.Client).Result()
		require.NoError(t, err)
		fired := new(atomic.Bool)
		board := boardOnClient(t, tb, func(opts *redis.Options) {
			opts.MaxRetries = -1
			opts.Dialer = replyDropDialer(sha, fired)
		})

		_, verified, err := board.Verify(ctx, nil)
		require.True(t, fired.Load(), "setup: the begin script's reply was dropped")
		require.Error(t, err)
		require.False(t, verified)
		marker, err := tb.rd.Client.Get(ctx, tb.board.verifyingKey).Result()
		require.ErrorIs(t, err, redis.Nil, "the failed Verify left its marker %q", marker)

		_, verified, err = tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified, "the next pass records")
	})

	// A pass that leaves Redis ahead of PostgreSQL (a version or a member
	// PostgreSQL does not have, as a database restored from a backup
	// leaves) is not recorded under the default policy, which only reports
	// those; repairing them makes the projection verifiable.
	t.Run("AheadAndOrphanLeftInPlaceAreNotRecorded", func(t *testing.T) {
		t.Parallel()
		tb := verifying(t)
		tb.submit(t, "ada", 10)
		tb.submit(t, "ada", 5)
		tb.submit(t, "bob", 1000)
		tb.drain(t)
		_, err := tb.pg.Pool.Exec(ctx, `UPDATE user_scores SET score = 10, version = 1 WHERE user_id = 'ada'`)
		require.NoError(t, err)
		_, err = tb.pg.Pool.Exec(ctx, `DELETE FROM user_scores WHERE user_id = 'bob'`)
		require.NoError(t, err)

		rep, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.Equal(t, int64(1), rep.Counts[reconcile.ClassAhead])
		require.Equal(t, int64(1), rep.Counts[reconcile.ClassOrphan])
		require.False(t, verified, "Redis still shows a score and a member PostgreSQL does not have")
		requireUnverified(t, tb)
		requireNoMarker(t, tb.rd, tb.board)

		rep, verified, err = tb.board.Verify(ctx, &reconcile.Config{Policy: reconcile.Policy{Ahead: reconcile.ActionRepair, Orphan: reconcile.ActionRepair}})
		require.NoError(t, err)
		require.Equal(t, int64(2), rep.Repaired)
		require.True(t, verified)
		r, err := tb.board.Top(ctx, 10)
		require.NoError(t, err)
		require.Equal(t, []Entry{{UserID: "ada", Score: 10, Rank: 1}}, r.Entries)
	})

	// A verified projection whose source then went back (a failover to a
	// standby that missed the last commits, a restore): the next Verify
	// finds Redis ahead of PostgreSQL and leaves it so. The earlier record
	// must not keep vouching for it.
	t.Run("PassLeavingDriftRefutesEarlierRecord", func(t *testing.T) {
		t.Parallel()
		tb := verifying(t)
		tb.submit(t, "ada", 10)
		tb.drain(t)
		_, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified)
		tb.submit(t, "ada", 5)
		tb.submit(t, "cy", 7)
		tb.drain(t)
		_, err = tb.pg.Pool.Exec(ctx, `UPDATE user_scores SET score = 10, version = 1 WHERE user_id = 'ada'`)
		require.NoError(t, err)
		_, err = tb.pg.Pool.Exec(ctx, `DELETE FROM user_scores WHERE user_id = 'cy'`)
		require.NoError(t, err)
		r, err := tb.board.Top(ctx, 10)
		require.NoError(t, err, "still verified: nothing has looked yet")
		require.False(t, r.Freshness.Unverified)

		rep, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.False(t, verified)
		require.Equal(t, int64(1), rep.Counts[reconcile.ClassAhead])
		require.Equal(t, int64(1), rep.Counts[reconcile.ClassOrphan])
		requireUnverified(t, tb)
		requireNoMarker(t, tb.rd, tb.board)
		n, err := tb.rd.Client.Exists(ctx, tb.board.verifiedKey).Result()
		require.NoError(t, err)
		require.Zero(t, n, "the earlier record outlived a pass that found the projection wrong")

		// Another board of the same keys (another process) sees it too.
		other, err := New(tb.pg.Pool, tb.rd.Client, tb.board.cfg)
		require.NoError(t, err)
		t.Cleanup(other.Close)
		_, err = other.Top(ctx, 10)
		var stale *StaleError
		require.ErrorAs(t, err, &stale)
		require.True(t, stale.Unverified)
	})

	// The recording's reply is lost to a client timeout while a busy Redis
	// runs it: Verify asks again and reports what Redis holds, never "not
	// recorded" over a record that is there; ErrVerifyUncertain when the
	// second answer is lost too.
	t.Run("RecordReplyTimedOut", func(t *testing.T) {
		t.Parallel()
		for name, tc := range map[string]struct {
			busy      string // DEBUG SLEEP seconds, starting just before the script is sent
			uncertain bool
		}{
			"SecondAnswerArrives": {busy: "0.5"},                // the first call times out at 0.3 s, the second is answered
			"SecondAnswerLost":    {busy: "2", uncertain: true}, // both calls time out
		} {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				pg := testenv.Postgres(t)
				rs := testenv.StartRedis(t, "--enable-debug-command", "yes")
				admin := rs.Client(t)
				client := redis.NewClient(&redis.Options{Addr: rs.Addr(), ReadTimeout: 300 * time.Millisecond, MaxRetries: -1})
				t.Cleanup(func() { _ = client.Close() })
				cfg := &Config{Name: "slow", Schema: pg.Schema, KeyPrefix: "slow:", RequireVerifiedProjection: true}
				require.NoError(t, Migrate(ctx, pg.Pool, cfg))
				board, err := New(pg.Pool, client, cfg)
				require.NoError(t, err)
				t.Cleanup(board.Close)
				_, err = board.Submit(ctx, Command{EventID: uuid.New(), UserID: "ada", Delta: 5})
				require.NoError(t, err)
				// Loads the scripts; the record is deleted again.
				_, verified, err := board.Verify(ctx, nil)
				require.NoError(t, err)
				require.True(t, verified)
				require.NoError(t, admin.Del(ctx, board.verifiedKey).Err())

				hook := &busyBeforeScript{admin: admin, key: board.verifiedKey, seconds: tc.busy}
				client.AddHook(hook)
				_, verified, err = board.Verify(ctx, nil)
				require.True(t, hook.fired.Load(), "setup: Redis was made busy")
				if tc.uncertain {
					require.ErrorIs(t, err, ErrVerifyUncertain)
					require.False(t, verified)
				} else {
					require.NoError(t, err)
					require.True(t, verified)
				}
				// Either way Redis ran the first call once it woke up.
				require.Eventually(t, func() bool { return admin.Exists(ctx, board.verifiedKey).Val() == 1 },
					5*time.Second, 20*time.Millisecond, "the record is in Redis")
			})
		}
	})

	t.Run("OffByDefault", func(t *testing.T) {
		t.Parallel()
		tb := setup(t, func(c *Config) { c.ReadPolicy = FailClosed })
		tb.submit(t, "ada", 10)
		tb.drain(t)
		r, err := tb.board.Top(ctx, 10)
		require.NoError(t, err)
		require.False(t, r.Freshness.Unverified)
	})

	// The companion holds the size the pass found: a sorted set that new
	// scores recreated with one member fewer than the pass checked no
	// longer counts as verified (verified.lua: held is ZCARD, not less).
	t.Run("RecordStopsCountingOneMemberShort", func(t *testing.T) {
		t.Parallel()
		tb := verifying(t)
		for _, u := range []string{"ada", "bo", "cy"} {
			tb.submit(t, u, 10)
		}
		tb.drain(t)
		_, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified)
		require.False(t, tb.board.Freshness(ctx).Unverified)

		require.NoError(t, tb.rd.Client.Del(ctx, tb.board.zsetKey).Err())
		tb.submit(t, "dee", 1)
		tb.submit(t, "eve", 1)
		tb.drain(t)
		n, err := tb.rd.Client.ZCard(ctx, tb.board.zsetKey).Result()
		require.NoError(t, err)
		require.EqualValues(t, 2, n)
		require.True(t, tb.board.Freshness(ctx).Unverified, "the pass found 3 members; 2 are left")
	})

	// A pass that finds the projection wrong deletes the earlier record and
	// its companion: nothing of the refuted verification is left.
	t.Run("RefutationLeavesNoCompanion", func(t *testing.T) {
		t.Parallel()
		tb := verifying(t)
		tb.submit(t, "ada", 10)
		tb.drain(t)
		_, verified, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, verified)
		// An orphan, which the default policy only reports.
		require.NoError(t, tb.rd.Client.ZAdd(ctx, tb.board.zsetKey, redis.Z{Score: 1, Member: "ghost"}).Err())
		_, verified, err = tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.False(t, verified)
		n, err := tb.rd.Client.Exists(ctx, tb.board.verifiedKey, tb.board.heldKey, tb.board.verifyingKey).Result()
		require.NoError(t, err)
		require.Zero(t, n, "record, companion and marker are all gone")
	})
}

// replyDropConn loses the reply to the first command whose bytes contain
// marker: it reads the reply (so Redis has run the command), then drops
// the connection and reports EOF, as a network failure at that moment
// would.
type replyDropConn struct {
	net.Conn
	marker []byte
	fired  *atomic.Bool // shared by every connection of the client
	armed  atomic.Bool  // this connection sent the marked command
}

// replyDropDialer dials connections that lose the reply to the first
// command (of all of them) whose bytes contain marker.
func replyDropDialer(marker string, fired *atomic.Bool) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		var d net.Dialer
		c, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &replyDropConn{Conn: c, marker: []byte(marker), fired: fired}, nil
	}
}

func (c *replyDropConn) Write(b []byte) (int, error) {
	if bytes.Contains(b, c.marker) && c.fired.CompareAndSwap(false, true) {
		c.armed.Store(true)
	}
	return c.Conn.Write(b)
}

func (c *replyDropConn) Read(b []byte) (int, error) {
	if c.armed.Load() {
		_, _ = c.Conn.Read(b)
		_ = c.Conn.Close()
		return 0, io.EOF
	}
	return c.Conn.Read(b)
}

// getsOfKey counts the GETs of key the client sends, pipelined or not.
type getsOfKey struct {
	testenv.PassThroughHook
	key string
	n   *atomic.Int64
}

func (h getsOfKey) count(cmd redis.Cmder) {
	if args := cmd.Args(); cmd.Name() == "get" && len(args) == 2 && args[1] == any(h.key) {
		h.n.Add(1)
	}
}

func (h getsOfKey) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.count(cmd)
		return next(ctx, cmd)
	}
}

func (h getsOfKey) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			h.count(cmd)
		}
		return next(ctx, cmds)
	}
}

// heldAfterGet, while armed, holds the reply of the first pipeline that
// GETs key (a look for Verify's record): it closes answered once Redis has
// answered, and returns the reply once release is closed.
type heldAfterGet struct {
	testenv.PassThroughHook
	key      string
	armed    atomic.Bool
	answered chan struct{}
	release  chan struct{}
}

func (h *heldAfterGet) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		if slices.ContainsFunc(cmds, func(c redis.Cmder) bool {
			return c.Name() == "get" && slices.Contains(c.Args(), any(h.key))
		}) && h.armed.CompareAndSwap(true, false) {
			close(h.answered)
			<-h.release
		}
		return err
	}
}

// busyBeforeScript keeps Redis busy (DEBUG SLEEP from another connection)
// just before the first script call naming key is sent: Redis runs the
// script after the sleep, when the client may have given up on the reply.
type busyBeforeScript struct {
	testenv.PassThroughHook
	admin   *redis.Client
	key     string
	seconds string
	fired   atomic.Bool
}

func (h *busyBeforeScript) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if name := cmd.Name(); (name == "evalsha" || name == "eval") && slices.Contains(cmd.Args(), any(h.key)) && h.fired.CompareAndSwap(false, true) {
			go func() { _ = h.admin.Do(context.Background(), "DEBUG", "SLEEP", h.seconds).Err() }()
			time.Sleep(100 * time.Millisecond) // the sleep has begun
		}
		return next(ctx, cmd)
	}
}

// TestCallerDeadlineIsNoRedisLoss: with a client that honours ctx
// deadlines (ContextTimeoutEnabled), a read whose own short deadline cuts
// its look for Verify's record short gets an i/o timeout from go-redis,
// possibly before ctx's timer has fired. That says nothing about Redis: it
// must not be published as "no record", which would refuse every read of
// the next LagProbeInterval as unverified.
func TestCallerDeadlineIsNoRedisLoss(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t, func(c *Config) {
		c.RequireVerifiedProjection = true
		c.ReadPolicy = FailClosed
		c.LagProbeInterval = 3 * time.Second
		c.MaxLag = time.Minute
	})
	tb.submit(t, "ada", 10)
	tb.drain(t)
	tb.verify(t)

	var proxy *testenv.DelayProxy
	board := boardOnClient(t, tb, func(opts *redis.Options) {
		proxy = testenv.StartDelayProxy(t, opts.Addr)
		opts.Addr = proxy.Addr()
		opts.ContextTimeoutEnabled = true
		opts.ReadTimeout = 5 * time.Second
		opts.MaxRetries = -1
	})

	spurious := 0
	const trials = 8
	for i := range trials {
		// The last look is made stale, so the next read looks again.
		board.lagMu.Lock()
		board.verification = verification{epoch: board.verification.epoch}
		board.lagMu.Unlock()
		// Warm the lag probe with a generous ctx (no Redis delay).
		proxy.SetDelay(0)
		_, err := board.Top(ctx, 10)
		require.NoError(t, err)
		board.lagMu.Lock()
		board.verification = verification{epoch: board.verification.epoch}
		board.lagMu.Unlock()

		// A client with a 50 ms budget reads while Redis answers in 200 ms.
		proxy.SetDelay(200 * time.Millisecond)
		short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		_, err = board.Top(short, 10)
		cancel()
		require.Error(t, err)
		proxy.SetDelay(0)

		// A healthy Redis that holds the record: the next read must not be
		// refused as unverified.
		r, err := board.Top(ctx, 10)
		if err != nil {
			spurious++
			t.Logf("trial %d: read after a caller's deadline: %v (Unverified=%v)", i, err, r.Freshness.Unverified)
		}
		time.Sleep(250 * time.Millisecond) // the delayed reply drains
	}
	require.Zero(t, spurious, "%d of %d healthy reads were refused as unverified because an earlier caller's own deadline cut its look short", spurious, trials)
}

// boardOnClient returns tb's board, configured alike, on a Redis client of
// its own: tb's client's options as edit (if not nil) changes them, with
// hooks added. Both are closed when the test ends.
func boardOnClient(t *testing.T, tb *testBundle, edit func(*redis.Options), hooks ...redis.Hook) *Board {
	t.Helper()
	opts := *tb.rd.Client.(*redis.Client).Options()
	if edit != nil {
		edit(&opts)
	}
	client := redis.NewClient(&opts)
	t.Cleanup(func() { _ = client.Close() })
	for _, hook := range hooks {
		client.AddHook(hook)
	}
	cfg := tb.board.Config()
	board, err := New(tb.pg.Pool, client, &cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	return board
}

// TestVerifyCancelledBeforeRecording: the caller gives up after the pass,
// as the second identity query ends. go-redis then fails the recording
// script unsent, which Verify took for a lost reply and sent again on a
// detached context: it recorded, and returned verified to a caller who had
// cancelled.
func TestVerifyCancelledBeforeRecording(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	tb.submit(t, "ada", 10)
	tb.drain(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	identity := func(sql string, _ error) bool { return strings.Contains(sql, "pg_control_system") }
	tracer := &cancelAfterQuery{match: identity, nth: 2, cancel: cancel}
	pool := tb.newPool(t, func(c *pgxpool.Config) { c.ConnConfig.Tracer = tracer })
	b, err := New(pool, tb.rd.Client, &Config{Name: tb.board.Name(), Schema: tb.pg.Schema, KeyPrefix: tb.rd.Prefix,
		RequireVerifiedProjection: true})
	require.NoError(t, err)
	t.Cleanup(b.Close)

	_, verified, err := b.Verify(ctx, nil)
	require.EqualValues(t, 2, tracer.seen.Load(), "both identity queries ran")
	require.ErrorIs(t, err, context.Canceled)
	require.False(t, verified)
	require.ErrorIs(t, tb.rd.Client.Get(context.Background(), b.verifiedKey).Err(), redis.Nil, "nothing recorded")
}

// cancelAfterQuery is a pgx tracer that calls cancel when the nth query
// that match accepts (by its SQL and its error) ends.
type cancelAfterQuery struct {
	match  func(sql string, err error) bool
	nth    int32
	cancel context.CancelFunc
	seen   atomic.Int32
}

type querySQLKey struct{}

func (c *cancelAfterQuery) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	return context.WithValue(ctx, querySQLKey{}, data.SQL)
}

func (c *cancelAfterQuery) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryEndData) {
	sql, _ := ctx.Value(querySQLKey{}).(string)
	if c.match(sql, data.Err) && c.seen.Add(1) == c.nth {
		c.cancel()
	}
}

// TestUnverifiedByIdentityDoesNotBlameRedis: a verification record of
// another database (a failover, a restore) makes reads unverified, and
// the refusal said Redis lost the board's keys, which it had not.
func TestUnverifiedByIdentityDoesNotBlameRedis(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := verifiedBoard(t, FailClosed)
	record, err := tb.rd.Client.Get(ctx, tb.board.verifiedKey).Result()
	require.NoError(t, err)
	fields := strings.Fields(record)
	require.GreaterOrEqual(t, len(fields), 2)
	require.NoError(t, tb.rd.Client.Set(ctx, tb.board.verifiedKey, fields[0]+" "+fields[1]+" 1:00000001", 0).Err()) // another database
	tb.board.verificationRecorded()

	_, err = tb.board.Top(ctx, 10)
	var stale *StaleError
	require.ErrorAs(t, err, &stale)
	require.True(t, stale.Unverified)
	require.Contains(t, err.Error(), "PostgreSQL is not the database Verify checked it against")
}

// verifiedBoard returns a board read under policy that requires a verified
// projection and measures the lag on every read, with ada's score
// projected and the projection verified.
func verifiedBoard(t *testing.T, policy ReadPolicy) *testBundle {
	t.Helper()
	tb := setup(t, func(c *Config) {
		c.RequireVerifiedProjection, c.ReadPolicy, c.LagProbeInterval = true, policy, time.Nanosecond
	})
	tb.submit(t, "ada", 10)
	tb.drain(t)
	_, verified, err := tb.board.Verify(context.Background(), nil)
	require.NoError(t, err)
	require.True(t, verified)
	return tb
}

// An earlier release's record (the time alone, no companion of its own)
// is trusted only while the sorted set holds members. A companion that a
// pass of this release left beside it is none of its own: it made the
// record trusted over an emptied sorted set, which FailClosed then served
// as a verified, empty board (a rolling deploy with an earlier release's
// process running Verify).
func TestVerifyEarlierRecordBesideAnotherPassCompanion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t, func(c *Config) {
		c.RequireVerifiedProjection = true
		c.ReadPolicy = FailClosed
		c.LagProbeInterval = time.Millisecond
	})
	for _, u := range []string{"a", "b", "c"} {
		tb.submit(t, u, 3)
	}
	tb.drain(t)
	_, ok, err := tb.board.Verify(ctx, nil)
	require.NoError(t, err)
	require.True(t, ok)
	rdb := tb.rd.Client
	held, err := rdb.Get(ctx, tb.board.heldKey).Result()
	require.NoError(t, err)
	require.Contains(t, held, heldTokenPrefix)
	require.NoError(t, rdb.Set(ctx, tb.board.verifiedKey, time.Now().UTC().Format(time.RFC3339Nano), 0).Err())
	_, err = tb.board.Top(ctx, 10)
	require.NoError(t, err, "the earlier record is trusted while the sorted set holds members")

	require.NoError(t, rdb.Del(ctx, tb.board.zsetKey).Err())
	time.Sleep(5 * time.Millisecond) // past LagProbeInterval
	_, err = tb.board.Top(ctx, 10)
	var stale *StaleError
	require.ErrorAs(t, err, &stale)
	require.True(t, stale.Unverified)
}

// splitHook runs the reader's verification pipeline (GET record, GET
// companion, ZCOUNT) as Redis may: another client's script between its
// commands. Here that script is a real Verify of the board, by another
// process (tb.board), recording its own record and companion.
type splitHook struct {
	key     string
	between func()
	done    bool
}

func (h *splitHook) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (h *splitHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (h *splitHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if h.done || len(cmds) != 3 || len(cmds[0].Args()) < 2 || cmds[0].Args()[1] != h.key {
			return next(ctx, cmds)
		}
		h.done = true
		err1 := next(ctx, cmds[:1])
		h.between()
		err2 := next(ctx, cmds[1:])
		return errors.Join(err1, err2)
	}
}

// Two Verify passes of this release, one after the other, each finding the
// projection complete: a read that looks between them (its record from the
// first, the companion from the second) must see it verified. It failed
// closed when the companion's token was required to match the record's.
func TestVerifyRecordReplacedDuringTheReadersLook(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t, func(c *Config) {
		c.RequireVerifiedProjection = true
		c.ReadPolicy = FailClosed
	})
	for _, u := range []string{"a", "b", "c"} {
		tb.submit(t, u, 3)
	}
	tb.drain(t)
	_, ok, err := tb.board.Verify(ctx, nil)
	require.NoError(t, err)
	require.True(t, ok)

	reader := redis.NewClient(tb.rd.Client.(*redis.Client).Options())
	t.Cleanup(func() { _ = reader.Close() })
	hook := &splitHook{key: tb.board.verifiedKey, between: func() {
		_, ok, err := tb.board.Verify(ctx, nil)
		require.NoError(t, err)
		require.True(t, ok)
	}}
	reader.AddHook(hook)
	cfg := tb.board.Config()
	board, err := New(tb.pg.Pool, reader, &cfg)
	require.NoError(t, err)
	t.Cleanup(board.Close)
	_, err = board.Top(ctx, 10)
	require.True(t, hook.done)
	require.NoError(t, err, "verified before, during and after the look")
}

// TestKeyPrefixMove follows the package doc's move to another KeyPrefix
// ("Upgrading") while a process of the old prefix still runs a Worker: its
// projection of alice's next score reaches the old keys alone, the lag
// reads 0 on both, and the new release's reads, with
// RequireVerifiedProjection as the doc says, stay unverified until a
// Verify made once the old Workers are gone. Without it they served
// alice's replaced score as fresh; the old release does (documented).
func TestKeyPrefixMove(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t, func(c *Config) { c.ReadPolicy = FailClosed; c.MaxLag = time.Minute })
	moved := func(c *Config) {
		c.KeyPrefix = tb.rd.Prefix + "moved:"
		c.ReadPolicy = FailClosed
		c.MaxLag = time.Minute
	}
	newBoard := tb.sibling(t, tb.board.Name(), moved, func(c *Config) { c.RequireVerifiedProjection = true })
	unguarded := tb.sibling(t, tb.board.Name(), moved)
	tb.submit(t, "alice", 10)
	tb.drain(t)
	rec, err := newBoard.Reconciler(nil)
	require.NoError(t, err)
	_, err = rec.Run(ctx, reconcile.RunOptions{}) // fills the new keys
	require.NoError(t, err)

	tb.submit(t, "alice", 5)
	tb.drain(t) // the old release's Worker: the old keys alone

	e, fr, err := unguarded.Rank(ctx, "alice")
	require.NoError(t, err)
	require.Equal(t, int64(10), e.Score, "without RequireVerifiedProjection the replaced score is served")
	require.Zero(t, fr.Lag)
	e, _, err = tb.board.Rank(ctx, "alice")
	require.NoError(t, err)
	require.Equal(t, int64(15), e.Score)

	_, fr, err = newBoard.Rank(ctx, "alice")
	var stale *StaleError
	require.ErrorAs(t, err, &stale, "served %+v", fr)
	require.True(t, stale.Unverified)

	_, verified, err := newBoard.Verify(ctx, nil) // the old Workers are gone
	require.NoError(t, err)
	require.True(t, verified)
	e, fr, err = newBoard.Rank(ctx, "alice")
	require.NoError(t, err, "%+v", fr)
	require.Equal(t, int64(15), e.Score)
}

// TestOutboxTableChange: a release that changes Config.OutboxTable while
// the board's rows wait in the old table neither projects them nor counts
// them in its Lag. Verify's record, made under the old table, vouched for
// the new release's reads all the same: FailClosed served alice's score
// without her last change, as fresh and verified (10 instead of 15). A
// record names its outbox table now, and one naming another does not
// count; Verify with the new table repairs from PostgreSQL and records.
func TestOutboxTableChange(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tb := setup(t, func(c *Config) {
		c.ReadPolicy = FailClosed
		c.RequireVerifiedProjection = true
	})
	tb.submit(t, "alice", 10)
	tb.drain(t)
	tb.verify(t)
	tb.submit(t, "alice", 5) // pending in the old table: its Worker stopped

	moved := tb.board.Config()
	moved.OutboxTable = "lb_outbox_v2"
	require.NoError(t, Migrate(ctx, tb.pg.Pool, &moved))
	next, err := New(tb.pg.Pool, tb.rd.Client, &moved)
	require.NoError(t, err)
	t.Cleanup(next.Close)
	w, err := next.Worker(nil)
	require.NoError(t, err)
	_, err = w.Drain(ctx)
	require.NoError(t, err)

	_, _, err = next.Rank(ctx, "alice")
	var stale *StaleError
	require.ErrorAs(t, err, &stale, "a record made under another outbox table vouches for nothing")
	require.True(t, stale.Unverified)

	_, verified, err := next.Verify(ctx, nil)
	require.NoError(t, err)
	require.True(t, verified)
	e, fr, err := next.Rank(ctx, "alice")
	require.NoError(t, err)
	require.EqualValues(t, 15, e.Score, "Verify repaired the stranded change from PostgreSQL")
	require.False(t, fr.Unverified)

	// A process still on the old table (a rolling deploy) neither projects
	// nor counts the new table's rows: the new record does not vouch for
	// it either.
	_, fr, err = tb.board.Rank(ctx, "alice", WithPolicy(ServeStale))
	require.NoError(t, err)
	require.True(t, fr.Unverified)
}
