package versioncache

import (
	"context"
	"errors"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// TestClusterSlotMigration runs the Cache against a slot in the middle of a
// migration (MIGRATING on its master, IMPORTING on another), with one id's
// keys moved and another's left behind. Redis then answers TRYAGAIN to a
// script unless one node holds every key it names, and ours name keys that
// rarely all exist (P{id}:a, P{id}:l, P{id}:c on a miss): Invalidate and
// Peek wait for the migration to end, within their ctx, and fail with
// ErrSlotMigrating once it has ended; a FailClosed miss fails with it at
// once; nothing stale is served.
func TestClusterSlotMigration(t *testing.T) {
	t.Parallel()
	cluster := testenv.StartRedisCluster(t, 3, 0)

	for _, readOnly := range []bool{false, true} {
		name := "PlainClient"
		if readOnly {
			name = "ReplicaReadingClient"
		}
		// Not parallel: two MIGRATEs running at once in opposite
		// directions block both masters until MIGRATE's timeout.
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs(), ReadOnly: readOnly})
			t.Cleanup(func() { _ = client.Close() })
			b := setupWith(t, client, cluster.Prefix(t), &Config{FailureMode: FailClosed})
			// A cache on the same keys that waits for replicas: its bump
			// runs in a pipeline with WAIT, on the master's connection.
			// The cluster has no replicas, so a bump that ran reports a
			// *ReplicationError.
			waiting, err := New[product](client, &Config{Prefix: b.prefix, FailureMode: FailClosed,
				InvalidateReplicas: 1, InvalidateWaitTimeout: 10 * time.Millisecond})
			require.NoError(t, err)
			// fallback serves misses from the loader when Redis fails.
			fallback, err := New[product](client, &Config{Prefix: b.prefix})
			require.NoError(t, err)

			// One slot per subtest (ids hash by themselves, not the
			// prefix): "stay" keeps its keys on the old master, "moved"
			// has its version and value moved to the new one, "empty" and
			// "waited" have no keys at all.
			stay := "stay-" + name
			moved := sameSlotID(b.cache, stay, "moved-"+name+"-")
			empty := sameSlotID(b.cache, stay, "empty-"+name+"-")
			waited := sameSlotID(b.cache, stay, "waited-"+name+"-")
			for _, id := range []string{stay, moved} {
				b.truth.write(id, 1)
				_, err := b.cache.Get(ctx, id, b.truth.loader(id))
				require.NoError(t, err)
			}
			b.truth.write(waited, 1)
			mig := startMigration(t, cluster, b.cache.versionKey(moved), b.cache.currentKey(moved))

			t.Run("HitsServedFromEitherNode", func(t *testing.T) {
				for _, id := range []string{stay, moved} {
					require.Equal(t, b.truth.read(id), b.hit(t, id), "%s", id)
				}
			})

			t.Run("FailClosedMissFailsAtOnce", func(t *testing.T) {
				// A Get does not wait for the migration: with a ctx that
				// outlasts go-redis's own retries, it fails before the ctx
				// ends.
				ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				defer cancel()
				before := b.cache.Stats()
				_, err := b.cache.Get(ctx, empty, b.truth.loader(empty))
				require.ErrorIs(t, err, ErrSlotMigrating)
				require.ErrorIs(t, err, ErrRedis)
				require.NotErrorIs(t, err, context.DeadlineExceeded)
				require.Equal(t, before.RedisErrors+1, b.cache.Stats().RedisErrors)
			})

			t.Run("FailOpenMissServesTheLoader", func(t *testing.T) {
				want := b.truth.write(empty, 1)
				got, err := fallback.Get(ctx, empty, b.truth.loader(empty))
				require.NoError(t, err)
				require.Equal(t, want, got)
				require.EqualValues(t, 1, fallback.Stats().FailOpenLoads)
			})

			t.Run("InvalidateFailsWhenCtxEndsFirst", func(t *testing.T) {
				for _, c := range []*Cache[product]{b.cache, waiting} {
					ctx, cancel := context.WithTimeout(ctx, time.Second) // long enough for a TRYAGAIN to come back on a loaded machine
					before := c.Stats()
					err := c.Invalidate(ctx, stay)
					cancel()
					require.ErrorIs(t, err, ErrSlotMigrating)
					require.ErrorIs(t, err, ErrRedis)
					require.ErrorIs(t, err, context.DeadlineExceeded)
					var rerr *RedisError
					require.ErrorAs(t, err, &rerr)
					require.True(t, redis.IsTryAgainError(err), "wraps the last TRYAGAIN: %v", err)
					after := c.Stats()
					require.Equal(t, before.RedisErrors+1, after.RedisErrors, "one error per call, not per retry")
					require.Equal(t, before.Invalidations, after.Invalidations)
				}
				// Not invalidated: the value cached before is still current.
				require.Equal(t, b.truth.read(stay), b.hit(t, stay))
			})

			t.Run("PeekFailsWhenCtxEndsFirst", func(t *testing.T) {
				ctx, cancel := context.WithTimeout(ctx, time.Second) // long enough for a TRYAGAIN to come back on a loaded machine
				defer cancel()
				before := b.cache.Stats()
				_, _, ok, err := b.cache.Peek(ctx, empty)
				require.False(t, ok)
				require.ErrorIs(t, err, ErrSlotMigrating)
				require.ErrorIs(t, err, ErrRedis)
				require.ErrorIs(t, err, context.DeadlineExceeded)
				require.Equal(t, before.RedisErrors+1, b.cache.Stats().RedisErrors)
			})

			t.Run("InvalidateAndPeekWaitForTheMigration", func(t *testing.T) {
				ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
				defer cancel()
				for _, id := range []string{stay, moved, waited} {
					b.truth.write(id, 2)
				}
				var (
					wg                  sync.WaitGroup
					errStay, errMoved   error
					errWaited, errPeek  error
					peeked              bool
					finished, finishErr = make(chan struct{}), error(nil)
				)
				wg.Go(func() { errStay = b.cache.Invalidate(ctx, stay) })
				wg.Go(func() { errMoved = b.cache.Invalidate(ctx, moved) })
				wg.Go(func() { errWaited = waiting.Invalidate(ctx, waited) })
				wg.Go(func() { _, _, peeked, errPeek = b.cache.Peek(ctx, empty) })
				go func() {
					defer close(finished)
					time.Sleep(200 * time.Millisecond)
					finishErr = mig.finish(ctx)
				}()
				wg.Wait()
				<-finished
				require.NoError(t, finishErr)
				require.NoError(t, errStay, "Invalidate of an id whose keys stayed")
				require.NoError(t, errMoved, "Invalidate of an id whose keys moved")
				require.ErrorIs(t, errWaited, ErrNotReplicated, "the bump ran (no replicas to confirm it)")
				require.NoError(t, errPeek, "Peek of an id with nothing cached")
				require.False(t, peeked)

				for _, id := range []string{stay, moved, waited} {
					got, err := b.cache.Get(ctx, id, b.truth.loader(id))
					require.NoError(t, err)
					require.Equal(t, b.truth.read(id), got, "%s after the migration", id)
					require.Equal(t, 2, got.Price)
				}
			})
		})
	}
}

// migration is a slot left in the middle of a migration by startMigration.
type migration struct {
	slot     int
	src, dst *redis.Client // masters' node clients of a plain cluster client
	masters  []*redis.Client
}

// startMigration starts moving the slot of keys to another master and
// moves keys there, leaving the slot MIGRATING on its master and IMPORTING
// on the other. The slot is put back to STABLE when t ends, in case the
// migration was not finished.
func startMigration(t *testing.T, cluster *testenv.RedisCluster, keys ...string) *migration {
	t.Helper()
	ctx := context.Background()
	admin := cluster.Client(t)
	src, err := admin.MasterForKey(ctx, keys[0])
	require.NoError(t, err)
	m := &migration{slot: keySlot(keys[0]), src: src, masters: testenv.Masters(t, admin)}
	dstAddr := cluster.MigrateKey(t, keys[0])
	t.Cleanup(func() {
		for _, n := range m.masters {
			_ = n.Do(context.Background(), "CLUSTER", "SETSLOT", m.slot, "STABLE").Err()
		}
	})
	for _, n := range m.masters {
		if n.Options().Addr == dstAddr {
			m.dst = n
		}
	}
	require.NotNil(t, m.dst, "the importing master %s is one of the masters", dstAddr)
	for _, key := range keys[1:] {
		require.Equal(t, m.slot, keySlot(key))
		require.NoError(t, m.migrate(ctx, key))
	}
	return m
}

// migrate moves key from the migrating master to the importing one.
func (m *migration) migrate(ctx context.Context, key string) error {
	host, port, err := net.SplitHostPort(m.dst.Options().Addr)
	if err != nil {
		return err
	}
	return m.src.Migrate(ctx, host, port, key, 0, 5*time.Second).Err()
}

// finish moves the keys left in the slot and assigns the slot to the
// importing master on every master, as the end of a resharding does.
func (m *migration) finish(ctx context.Context) error {
	for {
		keys, err := m.src.ClusterGetKeysInSlot(ctx, m.slot, 100).Result()
		if err != nil {
			return err
		}
		if len(keys) == 0 {
			break
		}
		for _, key := range keys {
			if err := m.migrate(ctx, key); err != nil {
				return err
			}
		}
	}
	dstID, err := m.dst.Do(ctx, "CLUSTER", "MYID").Text()
	if err != nil {
		return err
	}
	// The new owner first, then the old one, then the rest.
	for _, n := range append([]*redis.Client{m.dst, m.src}, m.masters...) {
		if err := n.Do(ctx, "CLUSTER", "SETSLOT", m.slot, "NODE", dstID).Err(); err != nil {
			return errors.Join(errors.New("CLUSTER SETSLOT NODE on "+n.Options().Addr), err)
		}
	}
	return nil
}

// sameSlotID returns an id starting with prefix whose keys hash to the
// slot of id's.
func sameSlotID(c *Cache[product], id, prefix string) string {
	want := keySlot(c.versionKey(id))
	for i := 0; ; i++ {
		cand := prefix + strconv.Itoa(i)
		if keySlot(c.versionKey(cand)) == want {
			return cand
		}
	}
}

// keySlot is Redis Cluster's HASH_SLOT.
func keySlot(key string) int {
	if s := strings.IndexByte(key, '{'); s >= 0 {
		if e := strings.IndexByte(key[s+1:], '}'); e > 0 {
			key = key[s+1 : s+1+e]
		}
	}
	var crc uint16
	for i := 0; i < len(key); i++ {
		crc ^= uint16(key[i]) << 8
		for j := 0; j < 8; j++ {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return int(crc) % 16384
}
