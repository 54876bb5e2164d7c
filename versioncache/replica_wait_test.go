package versioncache

import (
	"context"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/verity-go/verity/internal/testenv"
)

// replicaAddrs returns the host:port of every replica INFO
// replication of master lists.
func replicaAddrs(t *testing.T, master *redis.Client) []string {
	t.Helper()
	info, err := master.Info(context.Background(), "replication").Result()
	require.NoError(t, err)
	var addrs []string
	for _, line := range strings.Split(info, "\n") {
		if !strings.HasPrefix(line, "slave") || !strings.Contains(line, "ip=") {
			continue
		}
		var ip, port string
		for _, field := range strings.Split(strings.TrimSpace(line[strings.IndexByte(line, ':')+1:]), ",") {
			k, v, _ := strings.Cut(field, "=")
			switch k {
			case "ip":
				ip = v
			case "port":
				port = v
			}
		}
		addrs = append(addrs, net.JoinHostPort(ip, port))
	}
	return addrs
}

// freezeRedis stops the redis-server at addr (a process this test binary
// started) with SIGSTOP, found by its process_id, and thaws it at cleanup
// or when the returned func is called.
func freezeRedis(t *testing.T, addr string) (thaw func()) {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr})
	info, err := c.Info(context.Background(), "server").Result()
	_ = c.Close()
	require.NoError(t, err)
	pid := 0
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "process_id:"); ok {
			pid, err = strconv.Atoi(v)
			require.NoError(t, err)
		}
	}
	require.Positive(t, pid)
	require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
	thawed := false
	thaw = func() {
		if !thawed {
			thawed = true
			_ = syscall.Kill(pid, syscall.SIGCONT)
		}
	}
	t.Cleanup(thaw)
	return thaw
}

// requireUnconfirmedBumps: with the replica of id's master frozen, an
// Invalidate through each of the bundles returns a *ReplicationError
// after about wait (WAIT's timeout, answered up to 1/hz late), with the
// bump and the delete applied on master, and a Get through each bundle
// then serves the new value from the master, not a hang on the replica.
// The bundles share one source of truth (bundles[0].truth).
func requireUnconfirmedBumps(t *testing.T, master *redis.Client, id string, wait time.Duration, bundles ...*testBundle) {
	t.Helper()
	ctx := context.Background()
	truth := bundles[0].truth
	versionKey := bundles[0].cache.versionKey(id)
	before, err := master.Get(ctx, versionKey).Int64()
	require.NoError(t, err)
	for i, c := range bundles {
		truth.write(id, 10+i)
		start := time.Now()
		err := c.cache.Invalidate(ctx, id)
		took := time.Since(start)
		t.Logf("client %d: Invalidate with frozen replica: %v after %v", i, err, took)
		var rerr *ReplicationError
		require.ErrorAs(t, err, &rerr)
		require.ErrorIs(t, err, ErrNotReplicated)
		require.NotErrorIs(t, err, ErrRedis)
		require.Equal(t, 1, rerr.Want)
		require.Equal(t, 0, rerr.Got)
		require.GreaterOrEqual(t, took, wait-10*time.Millisecond, "WAIT waited its timeout")
		require.Less(t, took, wait+2*time.Second, "and returned, not much longer")
		after, err := master.Get(ctx, versionKey).Int64()
		require.NoError(t, err)
		require.Greater(t, after, before, "the master has the bump")
		before = after
		n, err := master.Exists(ctx, c.cache.currentKey(id)).Result()
		require.NoError(t, err)
		require.Zero(t, n, "and the delete")
		for j, g := range bundles {
			// Bounds the test only: a loaded machine (a 6-node cluster
			// under -race beside other suites) took over 2 s once.
			gctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			got, err := g.cache.Get(gctx, id, truth.loader(id))
			cancel()
			require.NoError(t, err, "reader %d", j)
			require.Equal(t, 10+i, got.Price, "reader %d", j)
		}
	}
}

// TestInvalidateReplicasSentinelFrozenReplica runs Invalidate with
// InvalidateReplicas on a Sentinel failover client (*redis.Client: the
// plain Pipelined branch of bumpAndWait) against a real master and
// replica: confirmed while the replica runs, a *ReplicationError after
// about InvalidateWaitTimeout once it is frozen, with the bump applied on
// the master and the next Get, also through a replica-reading client,
// serving the new value.
func TestInvalidateReplicasSentinelFrozenReplica(t *testing.T) {
	ctx := context.Background()
	s := testenv.SharedRedisSentinel(t)
	client := s.Client(t)
	prefix := s.Prefix(t)
	const wait = 300 * time.Millisecond
	b := setupWith(t, client, prefix, &Config{InvalidateReplicas: 1, InvalidateWaitTimeout: wait})
	master := redis.NewClient(&redis.Options{Addr: s.MasterAddr()})
	t.Cleanup(func() { _ = master.Close() })
	replicas := replicaAddrs(t, master)
	require.Len(t, replicas, 1)

	// (A replica-reading client over the same deployment, UniversalOptions
	// with MasterName and RouteRandomly, behaved the same when tried;
	// it is left out because go-redis v9.23.0 leaves its Sentinel
	// listener running after Close, which this package's TestMain reports.)
	rb := b
	id := "frozen"
	b.truth.write(id, 1)
	// A replica freshly synced (diskless) gets the master's stream only
	// after its first REPLCONF ACK, up to a second after the deployment
	// is "online": wait for the first confirmation.
	require.Eventually(t, func() bool { return b.cache.Invalidate(ctx, id) == nil }, 10*time.Second, 50*time.Millisecond)
	for range 5 { // live replica: confirmed, through both clients
		require.NoError(t, b.cache.Invalidate(ctx, id))
		require.NoError(t, rb.cache.Invalidate(ctx, id))
	}
	got, err := b.cache.Get(ctx, id, b.truth.loader(id))
	require.NoError(t, err)
	require.Equal(t, 1, got.Price)

	st0 := b.cache.Stats()
	thaw := freezeRedis(t, replicas[0])
	requireUnconfirmedBumps(t, master, id, wait, b, rb)
	st := b.cache.Stats()
	require.EqualValues(t, 2, st.ReplicationErrors-st0.ReplicationErrors)
	require.Equal(t, st0.Invalidations, st.Invalidations)
	require.Equal(t, st0.RedisErrors, st.RedisErrors)
	thaw()
	require.Eventually(t, func() bool { return b.cache.Invalidate(ctx, id) == nil }, 10*time.Second, 50*time.Millisecond)
}

// TestInvalidateReplicasClusterFrozenReplica is the same on a Cluster shard,
// through a plain and a replica-reading cluster client.
func TestInvalidateReplicasClusterFrozenReplica(t *testing.T) {
	ctx := context.Background()
	cluster := testenv.StartRedisCluster(t, 3, 1)
	plain := cluster.Client(t)
	waitReplicasOnline(t, plain)
	cluster.WaitSlotReplicas(t, 20*time.Second)
	const wait = 300 * time.Millisecond
	prefix := cluster.Prefix(t)
	b := setupWith(t, plain, prefix, &Config{InvalidateReplicas: 1, InvalidateWaitTimeout: wait})
	rb := setupWith(t, cluster.ReadOnlyClient(t), prefix, &Config{InvalidateReplicas: 1, InvalidateWaitTimeout: wait})
	rb.truth = b.truth

	id := "frozen"
	master, err := plain.MasterForKey(ctx, b.cache.versionKey(id))
	require.NoError(t, err)
	replicas := replicaAddrs(t, master)
	require.Len(t, replicas, 1)

	b.truth.write(id, 1)
	for range 5 {
		require.NoError(t, b.cache.Invalidate(ctx, id))
		require.NoError(t, rb.cache.Invalidate(ctx, id))
	}
	_, err = rb.cache.Get(ctx, id, b.truth.loader(id))
	require.NoError(t, err)
	thaw := freezeRedis(t, replicas[0])
	requireUnconfirmedBumps(t, master, id, wait, b, rb)
	thaw()
}

// TestInvalidateReplicasWaitReplyWithinReadTimeout: Redis (7.0, hz 10)
// ends a WAIT that timed out on its event loop's next tick, up to 100 ms
// late, so the client's ReadTimeout must leave room for that beyond
// InvalidateWaitTimeout (waitReplySlack). At the tightest ReadTimeout New
// accepts, a frozen replica gets every Invalidate a *ReplicationError from
// one bump; with the 100 ms slack New used to accept, the client gave up
// on WAIT's reply in 2-3 calls of 10, and go-redis ran the pipeline again
// (a second bump), or with MaxRetries -1 Invalidate returned a *RedisError
// for a bump that happened.
func TestInvalidateReplicasWaitReplyWithinReadTimeout(t *testing.T) {
	ctx := context.Background()
	master := testenv.StartRedis(t)
	_, port, err := net.SplitHostPort(master.Addr())
	require.NoError(t, err)
	replica := testenv.StartRedis(t, "--replicaof", "127.0.0.1", port)
	admin := master.Client(t)

	// The tightest ReadTimeout New accepts for the default
	// InvalidateWaitTimeout.
	readTimeout := InvalidateWaitTimeoutDefault + waitReplySlack
	caches := map[string]*testBundle{}
	for _, retries := range []int{0, -1} { // go-redis's default (3 retries), none
		client := redis.NewClient(&redis.Options{Addr: master.Addr(), ReadTimeout: readTimeout, MaxRetries: retries})
		t.Cleanup(func() { _ = client.Close() })
		// The default InvalidateWaitTimeout: New accepts it.
		b := setupWith(t, client, "wait:", &Config{InvalidateReplicas: 1})
		require.Eventually(t, func() bool { return b.cache.Invalidate(ctx, "x") == nil }, 20*time.Second, 50*time.Millisecond,
			"the replica confirms")
		caches[strconv.Itoa(retries)] = b
	}

	freezeRedis(t, replica.Addr())
	const calls = 10
	for name, b := range caches {
		evals := testenv.CommandCalls(t, admin, "eval")
		before := b.cache.Stats()
		for i := range calls {
			start := time.Now()
			err := b.cache.Invalidate(ctx, "x")
			took := time.Since(start)
			t.Logf("MaxRetries %s, call %d: %v after %v", name, i, err, took)
			var rerr *ReplicationError
			require.ErrorAs(t, err, &rerr, "MaxRetries %s, call %d after %v: no replica confirmed the bump", name, i, took)
		}
		st := b.cache.Stats()
		require.Equal(t, before.RedisErrors, st.RedisErrors)
		require.EqualValues(t, calls, st.ReplicationErrors-before.ReplicationErrors)
		require.EqualValues(t, calls, testenv.CommandCalls(t, admin, "eval")-evals,
			"MaxRetries %s: one bump per Invalidate, not a retried pipeline's second", name)
	}
}

// TestInvalidateReplicasConcurrentFrozen: with a frozen replica, no
// concurrent Invalidate may be reported confirmed, whichever pooled
// connection its WAIT would find (a connection whose last write the
// replica acknowledged before it froze counts it at once).
func TestInvalidateReplicasConcurrentFrozen(t *testing.T) {
	ctx := context.Background()
	master := testenv.StartRedis(t)
	_, port, err := net.SplitHostPort(master.Addr())
	require.NoError(t, err)
	replica := testenv.StartRedis(t, "--replicaof", "127.0.0.1", port)
	const workers = 8
	client := redis.NewClient(&redis.Options{Addr: master.Addr(), PoolSize: workers})
	t.Cleanup(func() { _ = client.Close() })
	b := setupWith(t, client, "conc:", &Config{InvalidateReplicas: 1, InvalidateWaitTimeout: 50 * time.Millisecond})
	require.Eventually(t, func() bool { return b.cache.Invalidate(ctx, "x") == nil }, 20*time.Second, 50*time.Millisecond)

	run := func(rounds int, check func(err error)) {
		var wg sync.WaitGroup
		for w := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for r := range rounds {
					check(b.cache.Invalidate(ctx, "id"+strconv.Itoa(w*100+r)))
				}
			}()
		}
		wg.Wait()
	}
	// Every pooled connection writes, and the replica acknowledges it.
	run(5, func(err error) { assert.NoError(t, err) })
	freezeRedis(t, replica.Addr())
	var confirmed atomic.Int64
	run(3, func(err error) {
		if err == nil {
			confirmed.Add(1)
		} else {
			assert.ErrorIs(t, err, ErrNotReplicated)
		}
	})
	require.Zero(t, confirmed.Load(), "Invalidates reported confirmed while the replica was frozen")
}

// TestCanceledJoinerLeavesTheFlight: a joiner whose ctx
// ends stops waiting, but the load it joined stays in flight for the
// callers that come after it ("Concurrent misses of the same id and
// version in this process share one load").
func TestCanceledJoinerLeavesTheFlight(t *testing.T) {
	ctx := context.Background()
	b := setup(t, nil)
	want := b.truth.write("p1", 1)
	started, release := make(chan struct{}), make(chan struct{})
	leader := make(chan product, 1)
	go func() {
		p, err := b.cache.Get(ctx, "p1", func(ctx context.Context) (product, error) {
			close(started)
			<-release
			return b.truth.loader("p1")(ctx)
		})
		assert.NoError(t, err)
		leader <- p
	}()
	<-started
	joinerCtx, cancel := context.WithCancel(ctx)
	joinerErr := make(chan error, 1)
	go func() {
		_, err := b.cache.Get(joinerCtx, "p1", b.truth.loader("p1"))
		joinerErr <- err
	}()
	require.Eventually(t, func() bool { return b.cache.flights.joiners() == 1 }, 5*time.Second, time.Millisecond)
	cancel()
	require.ErrorIs(t, <-joinerErr, context.Canceled)

	late := make(chan product, 1)
	go func() {
		p, err := b.cache.Get(ctx, "p1", b.truth.loader("p1"))
		assert.NoError(t, err)
		late <- p
	}()
	require.Eventually(t, func() bool { return b.cache.flights.joiners() == 2 || b.cache.Stats().Loads > 1 },
		5*time.Second, time.Millisecond)
	close(release)
	require.Equal(t, want, <-leader)
	require.Equal(t, want, <-late)
	st := b.cache.Stats()
	require.EqualValues(t, 1, st.Loads, "the late caller joined the load in flight")
	require.EqualValues(t, 1, st.SharedLoads)
}
