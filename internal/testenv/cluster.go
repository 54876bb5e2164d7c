package testenv

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/services"
)

// Cluster start-up bounds.
const (
	clusterNodeTimeoutMillis = 2000
	clusterStartTimeout      = 90 * time.Second
	clusterBusOffset         = 10000 // the cluster bus listens on port+10000
)

// RedisCluster is a private Redis Cluster made of redis-server processes on
// free ports of 127.0.0.1, each with its own directory. Nodes can be
// stopped, killed and started again (same port, same nodes.conf) for fault
// tests. Persistence is off, so a killed master comes back empty and rejoins
// as whatever the cluster decided meanwhile.
type RedisCluster struct {
	serverBin string
	nodes     []*clusterNode
	masters   int
	replicas  int
}

// clusterNode is one redis-server process (a cluster node, or a Sentinel
// deployment's master, replica or sentinel) that can be stopped and started
// again on the same port with the same directory.
type clusterNode struct {
	port int
	dir  string
	// conf, when set, is a config file passed before the other arguments
	// (Sentinel needs one it can rewrite).
	conf string
	// args follow the common ones (port, bind, dir, log).
	args []string

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
}

// StartRedisCluster starts masters×(1+replicasPerMaster) redis-server
// processes in t.TempDir(), joins them with `redis-cli --cluster create`,
// waits until every node reports cluster_state:ok with all 16384 slots
// assigned, and kills them all when t ends. masters must be at least 3
// (Redis Cluster's minimum).
//
// Without redis-server and redis-cli on PATH the test is skipped, or fails
// when VERITY_TEST_REQUIRE_SERVICES=1.
func StartRedisCluster(t testing.TB, masters, replicasPerMaster int) *RedisCluster {
	t.Helper()
	c, err := startRedisCluster(t.TempDir(), masters, replicasPerMaster)
	if errors.Is(err, errClusterBinaries) {
		skipOrFailCluster(t, err)
	}
	if err != nil {
		t.Fatalf("testenv: start redis cluster: %v", err)
	}
	t.Cleanup(c.close)
	return c
}

var shared struct {
	once    sync.Once
	cluster *RedisCluster
	err     error
}

// SharedRedisCluster returns one 3-master, 1-replica-per-master cluster
// shared by every test of the test binary, started on first use. It is for
// tests that only read and write: isolate them with a unique key prefix
// (Prefix) and never stop or kill its nodes — use StartRedisCluster for
// fault tests. Its processes die with the test binary (parent-death signal);
// its small directory under os.TempDir() is removed by the next test binary
// that starts a shared cluster.
func SharedRedisCluster(t testing.TB) *RedisCluster {
	t.Helper()
	shared.once.Do(func() {
		dir, err := sharedDir("verity-redis-cluster-")
		if err != nil {
			shared.err = err
			return
		}
		shared.cluster, shared.err = startRedisCluster(dir, 3, 1)
	})
	if errors.Is(shared.err, errClusterBinaries) {
		skipOrFailCluster(t, shared.err)
	}
	if shared.err != nil {
		t.Fatalf("testenv: start shared redis cluster: %v", shared.err)
	}
	return shared.cluster
}

// Prefix returns a key prefix unique to t (ASCII letters, digits and '_'
// only: no braces, no glob characters) for tests sharing a cluster. Keys
// under it are deleted from every master when t ends.
func (c *RedisCluster) Prefix(t testing.TB) string {
	t.Helper()
	prefix := uniquePrefix(t)
	t.Cleanup(func() {
		client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
		defer client.Close()
		if err := DeletePrefix(context.Background(), client, prefix); err != nil {
			t.Logf("testenv: delete cluster keys under %q: %v", prefix, err)
		}
	})
	return prefix
}

func uniquePrefix(t testing.TB) string {
	var b strings.Builder
	b.WriteString("t_")
	for i, r := range t.Name() {
		if i >= 40 {
			break
		}
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' {
			b.WriteRune(r)
		} else {
			b.WriteByte('_')
		}
	}
	fmt.Fprintf(&b, "_%d_%d:", time.Now().UnixNano(), prefixSeq.Add(1))
	return b.String()
}

var prefixSeq atomic.Int64

// sharedDir makes the directory of a shared deployment, which outlives
// every test's cleanup. It is named after the test binary's pid, and the
// directories of binaries that have exited are removed first, so runs do
// not accumulate them.
func sharedDir(pattern string) (string, error) {
	stale, _ := filepath.Glob(filepath.Join(os.TempDir(), pattern+"*"))
	for _, d := range stale {
		pid, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(d), pattern))
		if err == nil && pid != os.Getpid() && syscall.Kill(pid, 0) == syscall.ESRCH {
			_ = os.RemoveAll(d)
		}
	}
	dir := filepath.Join(os.TempDir(), pattern+strconv.Itoa(os.Getpid()))
	return dir, os.MkdirAll(dir, 0o755)
}

var errClusterBinaries = errors.New("redis-server or redis-cli not found on PATH")

func skipOrFailCluster(t testing.TB, err error) {
	t.Helper()
	if os.Getenv("VERITY_TEST_REQUIRE_SERVICES") == "1" {
		t.Fatalf("testenv: redis cluster required (VERITY_TEST_REQUIRE_SERVICES=1): %v", err)
	}
	t.Skipf("testenv: redis cluster unavailable: %v", err)
}

func startRedisCluster(dir string, masters, replicasPerMaster int) (*RedisCluster, error) {
	if masters < 3 {
		return nil, fmt.Errorf("masters = %d: Redis Cluster needs at least 3", masters)
	}
	if replicasPerMaster < 0 {
		return nil, fmt.Errorf("replicasPerMaster = %d: must not be negative", replicasPerMaster)
	}
	serverBin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("%w: %v", errClusterBinaries, err)
	}
	cliBin, err := exec.LookPath("redis-cli")
	if err != nil {
		return nil, fmt.Errorf("%w: %v", errClusterBinaries, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), clusterStartTimeout)
	defer cancel()

	c := &RedisCluster{serverBin: serverBin, masters: masters, replicas: replicasPerMaster}
	total := masters * (1 + replicasPerMaster)
	for i := 0; i < total; i++ {
		n := &clusterNode{dir: filepath.Join(dir, "node"+strconv.Itoa(i)), args: []string{
			"--save", "",
			"--appendonly", "no",
			"--cluster-enabled", "yes",
			"--cluster-config-file", "nodes.conf",
			"--cluster-node-timeout", strconv.Itoa(clusterNodeTimeoutMillis),
			"--cluster-replica-validity-factor", "0",
			"--repl-diskless-sync-delay", "0",
		}}
		if err := os.MkdirAll(n.dir, 0o755); err != nil {
			c.close()
			return nil, err
		}
		c.nodes = append(c.nodes, n)
		if err := startFresh(ctx, serverBin, n); err != nil {
			c.close()
			return nil, fmt.Errorf("node %d: %w", i, err)
		}
	}

	args := []string{"--cluster", "create"}
	args = append(args, c.Addrs()...)
	args = append(args, "--cluster-replicas", strconv.Itoa(replicasPerMaster), "--cluster-yes")
	if out, err := exec.CommandContext(ctx, cliBin, args...).CombinedOutput(); err != nil {
		c.close()
		return nil, fmt.Errorf("redis-cli --cluster create: %w: %s", err, out)
	}
	if err := c.waitHealthy(ctx); err != nil {
		c.close()
		return nil, err
	}
	return c, nil
}

// startFresh picks a free port pair (client and bus port) and starts n,
// retrying with other ports if another process takes them first. prepare,
// when not nil, runs once the port is known (to write a config file).
func startFresh(ctx context.Context, bin string, n *clusterNode, prepare ...func() error) error {
	var err error
	for attempt := 0; attempt < 5; attempt++ {
		if n.port, err = freeClusterPort(); err != nil {
			continue
		}
		for _, p := range prepare {
			if err = p(); err != nil {
				return err
			}
		}
		if err = n.start(ctx, bin); err == nil {
			return nil
		}
	}
	return err
}

// freeClusterPort returns a port p such that p and p+10000 were both free.
func freeClusterPort() (int, error) { return services.FreePortPair(clusterBusOffset) }

func (n *clusterNode) addr() string { return "127.0.0.1:" + strconv.Itoa(n.port) }

// start runs the node's redis-server and waits until it answers PING.
func (n *clusterNode) start(ctx context.Context, bin string) error {
	n.mu.Lock()
	if n.cmd != nil {
		n.mu.Unlock()
		return errors.New("already running")
	}
	logPath := filepath.Join(n.dir, "redis.log")
	var args []string
	if n.conf != "" {
		args = append(args, n.conf)
	}
	args = append(args,
		"--port", strconv.Itoa(n.port),
		"--bind", "127.0.0.1",
		"--dir", n.dir,
		"--logfile", logPath,
		"--daemonize", "no",
	)
	cmd := exec.Command(bin, append(args, n.args...)...)
	// The servers must not outlive the test binary, even if it is killed.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if err := cmd.Start(); err != nil {
		n.mu.Unlock()
		return err
	}
	done := make(chan struct{})
	n.cmd, n.done = cmd, done
	n.mu.Unlock()
	go func() {
		_ = cmd.Wait()
		n.mu.Lock()
		if n.cmd == cmd {
			n.cmd = nil
		}
		n.mu.Unlock()
		close(done)
	}()

	client := redis.NewClient(&redis.Options{Addr: n.addr(), MaxRetries: -1, DialTimeout: time.Second})
	defer client.Close()
	for {
		if client.Ping(ctx).Err() == nil {
			return nil
		}
		select {
		case <-done:
			return fmt.Errorf("redis-server exited during start-up: %s", logTail(logPath))
		case <-ctx.Done():
			n.signal(syscall.SIGKILL)
			return fmt.Errorf("redis-server on %s did not answer: %w", n.addr(), ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// signal sends sig to the node and waits for it to exit (SIGKILL after 10s).
// send sends sig to the node's process, if it runs, without waiting.
func (n *clusterNode) send(sig syscall.Signal) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cmd != nil {
		_ = n.cmd.Process.Signal(sig)
	}
}

func (n *clusterNode) signal(sig syscall.Signal) {
	n.mu.Lock()
	cmd, done := n.cmd, n.done
	n.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(sig)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = cmd.Process.Kill()
		<-done
	}
}

func logTail(path string) string {
	b, _ := os.ReadFile(path)
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(b)
}

func (c *RedisCluster) close() { killAll(c.nodes) }

// closeShared kills the processes of the shared cluster and the shared
// Sentinel deployment, if they were started, and waits for them to exit.
func closeShared() {
	if shared.cluster != nil {
		shared.cluster.close()
	}
	if sharedSentinel.sentinel != nil {
		killAll(sharedSentinel.sentinel.nodes())
	}
}

func killAll(nodes []*clusterNode) {
	var wg sync.WaitGroup
	for _, n := range nodes {
		wg.Add(1)
		go func() { defer wg.Done(); n.signal(syscall.SIGKILL) }()
	}
	wg.Wait()
}

// Addrs returns every node's host:port, masters and replicas, in node index
// order.
func (c *RedisCluster) Addrs() []string {
	addrs := make([]string, len(c.nodes))
	for i, n := range c.nodes {
		addrs[i] = n.addr()
	}
	return addrs
}

// Size returns the number of nodes.
func (c *RedisCluster) Size() int { return len(c.nodes) }

// Client returns a cluster client for all nodes, closed when t ends.
func (c *RedisCluster) Client(t testing.TB) *redis.ClusterClient {
	t.Helper()
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	t.Cleanup(func() { _ = client.Close() })
	return client
}

// Kill sends SIGKILL to node i and waits until it has exited.
func (c *RedisCluster) Kill(i int) { c.nodes[i].signal(syscall.SIGKILL) }

// Freeze stops node i with SIGSTOP: like a lost host, it keeps its
// connections open and answers nothing (no reset, no refusal) until Thaw.
// The cluster's cleanup kills it frozen or not.
func (c *RedisCluster) Freeze(i int) { c.nodes[i].send(syscall.SIGSTOP) }

// Thaw resumes node i after Freeze (SIGCONT).
func (c *RedisCluster) Thaw(i int) { c.nodes[i].send(syscall.SIGCONT) }

// Stop shuts node i down with SIGTERM and waits until it has exited.
func (c *RedisCluster) Stop(i int) { c.nodes[i].signal(syscall.SIGTERM) }

// Start starts a stopped or killed node i again on its old port with its
// old nodes.conf, and waits until it answers PING (not until the cluster
// is healthy again; see WaitHealthy).
func (c *RedisCluster) Start(t testing.TB, i int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := c.nodes[i].start(ctx, c.serverBin); err != nil {
		t.Fatalf("testenv: restart cluster node %d: %v", i, err)
	}
}

// WaitHealthy waits until every running node reports cluster_state:ok with
// all slots assigned and knows every node.
func (c *RedisCluster) WaitHealthy(t testing.TB) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), clusterStartTimeout)
	defer cancel()
	if err := c.waitHealthy(ctx); err != nil {
		t.Fatalf("testenv: %v", err)
	}
}

func (c *RedisCluster) waitHealthy(ctx context.Context) error {
	var last string
	for {
		ok := true
		for _, n := range c.nodes {
			n.mu.Lock()
			running := n.cmd != nil
			n.mu.Unlock()
			if !running {
				continue
			}
			if msg := nodeHealth(ctx, n.addr(), len(c.nodes)); msg != "" {
				ok, last = false, msg
				break
			}
		}
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("redis cluster not healthy: %s: %w", last, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// nodeHealth returns "" when the node at addr sees a healthy, complete
// cluster, or what is still wrong.
func nodeHealth(ctx context.Context, addr string, nodes int) string {
	client := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialTimeout: time.Second})
	defer client.Close()
	info, err := client.ClusterInfo(ctx).Result()
	if err != nil {
		return addr + ": " + err.Error()
	}
	fields := map[string]string{}
	for _, line := range strings.Split(info, "\n") {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), ":"); ok {
			fields[k] = v
		}
	}
	switch {
	case fields["cluster_state"] != "ok":
		return addr + ": cluster_state:" + fields["cluster_state"]
	case fields["cluster_slots_assigned"] != "16384":
		return addr + ": cluster_slots_assigned:" + fields["cluster_slots_assigned"]
	case fields["cluster_slots_ok"] != "16384":
		return addr + ": cluster_slots_ok:" + fields["cluster_slots_ok"]
	case fields["cluster_known_nodes"] != strconv.Itoa(nodes):
		return addr + ": cluster_known_nodes:" + fields["cluster_known_nodes"]
	}
	return ""
}

// MasterForSlot returns the index of the node currently serving slot as
// master, as seen by the first node that answers CLUSTER SLOTS.
func (c *RedisCluster) MasterForSlot(t testing.TB, slot int) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var lastErr error
	for _, n := range c.nodes {
		client := redis.NewClient(&redis.Options{Addr: n.addr(), MaxRetries: -1, DialTimeout: time.Second})
		//lint:ignore SA1019 CLUSTER SLOTS answers on every Redis version this helper starts; its shape is simpler than CLUSTER SHARDS for one lookup.
		slots, err := client.ClusterSlots(ctx).Result()
		client.Close()
		if err != nil {
			lastErr = err
			continue
		}
		for _, s := range slots {
			if slot >= int(s.Start) && slot <= int(s.End) && len(s.Nodes) > 0 {
				for i, m := range c.nodes {
					if m.addr() == s.Nodes[0].Addr {
						return i
					}
				}
			}
		}
		lastErr = fmt.Errorf("slot %d not found in CLUSTER SLOTS of %s", slot, n.addr())
	}
	t.Fatalf("testenv: master for slot %d: %v", slot, lastErr)
	return -1
}

// RedisSentinel is a private Sentinel deployment: one master, its replicas
// and one sentinel (quorum 1) monitoring it as SentinelMasterName, each a
// redis-server process on a free port with persistence off.
type RedisSentinel struct {
	serverBin string
	master    *clusterNode
	replicas  []*clusterNode
	sentinel  *clusterNode
}

// SentinelMasterName is the master name the sentinel monitors.
const SentinelMasterName = "verity"

var sharedSentinel struct {
	once     sync.Once
	sentinel *RedisSentinel
	err      error
}

// SharedRedisSentinel returns one Sentinel deployment (a master, one
// replica, one sentinel) shared by every test of the test binary, started on
// first use. Isolate tests with Prefix. Like SharedRedisCluster, it is for
// tests that do not stop its processes, which die with the test binary.
func SharedRedisSentinel(t testing.TB) *RedisSentinel {
	t.Helper()
	sharedSentinel.once.Do(func() {
		dir, err := sharedDir("verity-redis-sentinel-")
		if err != nil {
			sharedSentinel.err = err
			return
		}
		sharedSentinel.sentinel, sharedSentinel.err = startRedisSentinel(dir, 1)
	})
	if errors.Is(sharedSentinel.err, errClusterBinaries) {
		skipOrFailCluster(t, sharedSentinel.err)
	}
	if sharedSentinel.err != nil {
		t.Fatalf("testenv: start shared redis sentinel: %v", sharedSentinel.err)
	}
	return sharedSentinel.sentinel
}

func startRedisSentinel(dir string, replicas int) (*RedisSentinel, error) {
	serverBin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("%w: %v", errClusterBinaries, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), clusterStartTimeout)
	defer cancel()
	persistenceOff := []string{"--save", "", "--appendonly", "no"}
	s := &RedisSentinel{serverBin: serverBin}
	fail := func(err error) (*RedisSentinel, error) {
		killAll(s.nodes())
		return nil, err
	}

	// No diskless-sync delay: replicas sync at once (the default waits 5s
	// for more replicas to share the transfer).
	s.master = &clusterNode{dir: filepath.Join(dir, "master"),
		args: append([]string{"--repl-diskless-sync-delay", "0"}, persistenceOff...)}
	if err := os.MkdirAll(s.master.dir, 0o755); err != nil {
		return fail(err)
	}
	if err := startFresh(ctx, serverBin, s.master); err != nil {
		return fail(fmt.Errorf("master: %w", err))
	}
	for i := 0; i < replicas; i++ {
		n := &clusterNode{dir: filepath.Join(dir, "replica"+strconv.Itoa(i)),
			args: append([]string{"--replicaof", "127.0.0.1", strconv.Itoa(s.master.port)}, persistenceOff...)}
		s.replicas = append(s.replicas, n)
		if err := os.MkdirAll(n.dir, 0o755); err != nil {
			return fail(err)
		}
		if err := startFresh(ctx, serverBin, n); err != nil {
			return fail(fmt.Errorf("replica %d: %w", i, err))
		}
	}
	s.sentinel = &clusterNode{dir: filepath.Join(dir, "sentinel"), args: []string{"--sentinel"}}
	s.sentinel.conf = filepath.Join(s.sentinel.dir, "sentinel.conf")
	if err := os.MkdirAll(s.sentinel.dir, 0o755); err != nil {
		return fail(err)
	}
	writeConf := func() error {
		// Sentinel rewrites this file, so it must be its own and writable.
		conf := fmt.Sprintf("sentinel monitor %s 127.0.0.1 %d 1\n"+
			"sentinel down-after-milliseconds %s %d\n"+
			"sentinel failover-timeout %s 10000\n",
			SentinelMasterName, s.master.port, SentinelMasterName, clusterNodeTimeoutMillis, SentinelMasterName)
		return os.WriteFile(s.sentinel.conf, []byte(conf), 0o644)
	}
	if err := startFresh(ctx, serverBin, s.sentinel, writeConf); err != nil {
		return fail(fmt.Errorf("sentinel: %w", err))
	}

	// Ready when the sentinel names the master and every replica is in sync.
	sc := redis.NewSentinelClient(&redis.Options{Addr: s.sentinel.addr(), MaxRetries: -1})
	defer sc.Close()
	mc := redis.NewClient(&redis.Options{Addr: s.master.addr(), MaxRetries: -1})
	defer mc.Close()
	for {
		addr, err := sc.GetMasterAddrByName(ctx, SentinelMasterName).Result()
		info, _ := mc.Info(ctx, "replication").Result()
		if err == nil && len(addr) == 2 && addr[1] == strconv.Itoa(s.master.port) &&
			strings.Count(info, ",state=online,") == replicas {
			return s, nil
		}
		select {
		case <-ctx.Done():
			return fail(fmt.Errorf("sentinel deployment not ready (master %v, %v): %w", addr, err, ctx.Err()))
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (s *RedisSentinel) nodes() []*clusterNode {
	var nodes []*clusterNode
	for _, n := range append([]*clusterNode{s.master, s.sentinel}, s.replicas...) {
		if n != nil {
			nodes = append(nodes, n)
		}
	}
	return nodes
}

// SentinelAddr returns the sentinel's host:port.
func (s *RedisSentinel) SentinelAddr() string { return s.sentinel.addr() }

// MasterAddr returns the host:port of the master as started.
func (s *RedisSentinel) MasterAddr() string { return s.master.addr() }

// Client returns a Sentinel-backed client (redis.NewFailoverClient) for the
// monitored master, closed when t ends.
func (s *RedisSentinel) Client(t testing.TB) *redis.Client {
	t.Helper()
	client := redis.NewFailoverClient(&redis.FailoverOptions{
		MasterName:    SentinelMasterName,
		SentinelAddrs: []string{s.SentinelAddr()},
	})
	t.Cleanup(func() { _ = client.Close() })
	return client
}

// Prefix returns a key prefix unique to t; keys under it are deleted from
// the master when t ends.
func (s *RedisSentinel) Prefix(t testing.TB) string {
	t.Helper()
	prefix := uniquePrefix(t)
	t.Cleanup(func() {
		client := redis.NewFailoverClient(&redis.FailoverOptions{
			MasterName: SentinelMasterName, SentinelAddrs: []string{s.SentinelAddr()},
		})
		defer client.Close()
		if err := DeletePrefix(context.Background(), client, prefix); err != nil {
			t.Logf("testenv: delete sentinel keys under %q: %v", prefix, err)
		}
	})
	return prefix
}

// slotMove returns the slot of key, the master serving it, and another
// master to move it to.
func slotMove(t testing.TB, client *redis.ClusterClient, key string) (slot int64, src, dst *redis.Client) {
	t.Helper()
	ctx := context.Background()
	slot, err := client.ClusterKeySlot(ctx, key).Result()
	if err != nil {
		t.Fatalf("testenv: slot of %q: %v", key, err)
	}
	src, err = client.MasterForKey(ctx, key)
	if err != nil {
		t.Fatalf("testenv: master of %q: %v", key, err)
	}
	for _, m := range Masters(t, client) {
		if m.Options().Addr != src.Options().Addr {
			return slot, src, m
		}
	}
	t.Fatalf("testenv: no other master to move slot %d to", slot)
	return 0, nil, nil
}

// ReassignSlot assigns the slot of key to a master other than the one that
// serves it now, on every master, behind the back of existing clients, whose
// slot maps still point at the old master. The slot must hold no keys on the
// old master: Redis refuses to reassign one that does.
func (c *RedisCluster) ReassignSlot(t testing.TB, key string) {
	t.Helper()
	ctx := context.Background()
	client := c.Client(t)
	slot, src, dst := slotMove(t, client, key)
	masters := Masters(t, client)
	dstID, err := dst.Do(ctx, "CLUSTER", "MYID").Text()
	if err != nil {
		t.Fatalf("testenv: CLUSTER MYID: %v", err)
	}
	// The new owner first, then the old one, then the rest.
	for _, m := range append([]*redis.Client{dst, src}, masters...) {
		if err := m.Do(ctx, "CLUSTER", "SETSLOT", slot, "NODE", dstID).Err(); err != nil {
			t.Fatalf("testenv: CLUSTER SETSLOT %d NODE %s on %s: %v", slot, dstID, m.Options().Addr, err)
		}
	}
	c.waitSlotOwner(t, key, dst.Options().Addr)
}

// ReadOnlyClient returns a cluster client that sends read-only commands to
// replicas (ClusterOptions.ReadOnly), closed when t ends, once CLUSTER
// SLOTS lists a replica for every slot (WaitSlotReplicas, 30 s).
func (c *RedisCluster) ReadOnlyClient(t testing.TB) *redis.ClusterClient {
	t.Helper()
	c.WaitSlotReplicas(t, 30*time.Second)
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), ReadOnly: true})
	t.Cleanup(func() { _ = client.Close() })
	return client
}

// SlotMigration is a slot being moved from one master to another, as
// redis-cli --cluster reshard moves it: CLUSTER SETSLOT IMPORTING on the
// destination and MIGRATING on the source, MIGRATE key by key, then
// SETSLOT NODE on every master.
type SlotMigration struct {
	Slot                int
	Source, Destination *redis.Client
	destinationID       string
	masters             []*redis.Client
}

// StartSlotMigration puts slot, served by source (a master of client), into
// MIGRATING on source and IMPORTING on another master, moving no key yet.
// client's slot map is left as it was.
func StartSlotMigration(t testing.TB, client *redis.ClusterClient, slot int, source *redis.Client) *SlotMigration {
	t.Helper()
	ctx := context.Background()
	m := &SlotMigration{Slot: slot, Source: source, masters: Masters(t, client)}
	for _, master := range m.masters {
		if master.Options().Addr != source.Options().Addr {
			m.Destination = master
			break
		}
	}
	if m.Destination == nil {
		t.Fatalf("testenv: no master but %s to move slot %d to", source.Options().Addr, slot)
	}
	sourceID, err := source.Do(ctx, "CLUSTER", "MYID").Text()
	if err == nil {
		m.destinationID, err = m.Destination.Do(ctx, "CLUSTER", "MYID").Text()
	}
	if err == nil {
		err = m.Destination.Do(ctx, "CLUSTER", "SETSLOT", slot, "IMPORTING", sourceID).Err()
	}
	if err == nil {
		err = source.Do(ctx, "CLUSTER", "SETSLOT", slot, "MIGRATING", m.destinationID).Err()
	}
	if err != nil {
		t.Fatalf("testenv: starting to move slot %d: %v", slot, err)
	}
	return m
}

// Move moves keys to the destination, key by key (every key of the slot
// still on the source when none are given). It may be called from any
// goroutine.
func (m *SlotMigration) Move(ctx context.Context, keys ...string) error {
	if len(keys) == 0 {
		var err error
		if keys, err = m.Source.ClusterGetKeysInSlot(ctx, m.Slot, 100_000).Result(); err != nil {
			return err
		}
	}
	host, port, err := net.SplitHostPort(m.Destination.Options().Addr)
	if err != nil {
		return err
	}
	for _, key := range keys {
		if err := m.Source.Migrate(ctx, host, port, key, 0, 5*time.Second).Err(); err != nil {
			return fmt.Errorf("testenv: MIGRATE %s: %w", key, err)
		}
	}
	return nil
}

// Finish moves the keys left and assigns the slot to the destination on
// every master, ending the migration. It may be called from any goroutine.
func (m *SlotMigration) Finish(ctx context.Context) error {
	if err := m.Move(ctx); err != nil {
		return err
	}
	for _, master := range append([]*redis.Client{m.Destination, m.Source}, m.masters...) {
		if err := master.Do(ctx, "CLUSTER", "SETSLOT", m.Slot, "NODE", m.destinationID).Err(); err != nil {
			return fmt.Errorf("testenv: SETSLOT %d NODE on %s: %w", m.Slot, master.Options().Addr, err)
		}
	}
	return nil
}

// Masters returns the node clients of client's masters.
func Masters(t testing.TB, client *redis.ClusterClient) []*redis.Client {
	t.Helper()
	var (
		mu      sync.Mutex
		masters []*redis.Client
	)
	if err := client.ForEachMaster(context.Background(), func(_ context.Context, n *redis.Client) error {
		mu.Lock() // called concurrently
		defer mu.Unlock()
		masters = append(masters, n)
		return nil
	}); err != nil {
		t.Fatalf("testenv: listing masters: %v", err)
	}
	return masters
}

// MigrateKey starts moving the slot of key to a master other than the one
// that serves it, moves key alone with MIGRATE, and returns the new
// master's address. The slot stays MIGRATING on the old master and
// IMPORTING on the new one, as in the middle of a resharding: the old
// master answers ASK for key, and clients' slot maps still name it.
func (c *RedisCluster) MigrateKey(t testing.TB, key string) string {
	t.Helper()
	ctx := context.Background()
	client := c.Client(t)
	slot, src, dst := slotMove(t, client, key)
	id := func(n *redis.Client) string {
		v, err := n.Do(ctx, "CLUSTER", "MYID").Text()
		if err != nil {
			t.Fatalf("testenv: CLUSTER MYID on %s: %v", n.Options().Addr, err)
		}
		return v
	}
	srcID, dstID := id(src), id(dst)
	if err := dst.Do(ctx, "CLUSTER", "SETSLOT", slot, "IMPORTING", srcID).Err(); err != nil {
		t.Fatalf("testenv: CLUSTER SETSLOT %d IMPORTING: %v", slot, err)
	}
	if err := src.Do(ctx, "CLUSTER", "SETSLOT", slot, "MIGRATING", dstID).Err(); err != nil {
		t.Fatalf("testenv: CLUSTER SETSLOT %d MIGRATING: %v", slot, err)
	}
	host, port, err := net.SplitHostPort(dst.Options().Addr)
	if err != nil {
		t.Fatalf("testenv: address %q: %v", dst.Options().Addr, err)
	}
	if err := src.Migrate(ctx, host, port, key, 0, 5*time.Second).Err(); err != nil {
		t.Fatalf("testenv: MIGRATE %q: %v", key, err)
	}
	return dst.Options().Addr
}

// masterAndReplica returns the master client's slot map names for key and
// the address of one of its replicas whose link is up, or "" when that node
// is not a master (the map is behind) or has no replica in sync yet.
func masterAndReplica(ctx context.Context, client *redis.ClusterClient, key string) (*redis.Client, string) {
	old, err := client.MasterForKey(ctx, key)
	if err != nil {
		return nil, ""
	}
	id, err := old.Do(ctx, "CLUSTER", "MYID").Text()
	if err != nil {
		return old, ""
	}
	replicas, err := old.Do(ctx, "CLUSTER", "REPLICAS", id).StringSlice()
	if err != nil { // "ERR The specified node is not a master"
		return old, ""
	}
	for _, line := range replicas {
		// "<id> <ip:port@cport[,hostname]> <flags> ..."
		fields := strings.Fields(line)
		if len(fields) < 3 || strings.Contains(fields[2], "fail") {
			continue
		}
		candidate, _, _ := strings.Cut(fields[1], "@")
		replica := redis.NewClient(&redis.Options{Addr: candidate})
		info, err := replica.Info(ctx, "replication").Result()
		_ = replica.Close()
		if err == nil && strings.Contains(info, "master_link_status:up") {
			return old, candidate
		}
	}
	return old, ""
}

// Failover promotes a replica of the master serving key with CLUSTER
// FAILOVER (a manual failover: both nodes stay up, the old master becomes
// a replica of the new one) and waits, up to 20 s, until both report their
// new roles (asking again if a failover times out). It returns the old and the new master's addresses. Existing
// clients' slot maps still name the old master.
func (c *RedisCluster) Failover(t testing.TB, key string) (oldMaster, newMaster string) {
	t.Helper()
	ctx := context.Background()
	client := c.Client(t)
	// The master serving key, and one of its replicas in sync. Right after
	// an earlier failover, the node asked for the slot map may still name
	// the demoted master, and a demoted master that rejoins as a replica
	// is listed, and in sync, a little later: ask again until both are
	// right.
	var old *redis.Client
	var addr string
	deadline := time.Now().Add(20 * time.Second)
	for {
		old, addr = masterAndReplica(ctx, client, key)
		if addr != "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("testenv: no master of %q with a replica in sync after 20 s", key)
		}
		client.ReloadState(ctx)
		time.Sleep(50 * time.Millisecond)
	}
	promoted := redis.NewClient(&redis.Options{Addr: addr})
	defer promoted.Close()
	demoted := redis.NewClient(&redis.Options{Addr: old.Options().Addr})
	defer demoted.Close()
	role := func(n *redis.Client) string {
		r, err := n.Do(ctx, "ROLE").Slice()
		if err != nil || len(r) == 0 {
			return ""
		}
		s, _ := r[0].(string)
		return s
	}
	// A manual failover can time out without a word (one right after
	// another, say): ask again every 5 s.
	deadline = time.Now().Add(30 * time.Second)
	var asked time.Time
	for role(promoted) != "master" || role(demoted) != "slave" {
		if time.Now().After(deadline) {
			t.Fatalf("testenv: failover of %s to %s did not complete in 30 s", old.Options().Addr, addr)
		}
		if time.Since(asked) > 5*time.Second && role(promoted) != "master" {
			// It may have become master since: then Redis refuses ("send
			// CLUSTER FAILOVER to a replica"), and the loop ends.
			if err := promoted.Do(ctx, "CLUSTER", "FAILOVER").Err(); err != nil && role(promoted) != "master" {
				t.Fatalf("testenv: CLUSTER FAILOVER on %s: %v", addr, err)
			}
			asked = time.Now()
		}
		time.Sleep(20 * time.Millisecond)
	}
	c.waitSlotOwner(t, key, addr)
	return old.Options().Addr, addr
}

// KillMaster kills the master serving key (SIGKILL) once one of its
// replicas in sync has every write it acknowledged, and promotes that
// replica with CLUSTER FAILOVER TAKEOVER, which does not wait for the
// cluster to find the master failed (cluster-node-timeout). It returns the
// killed master's and the promoted replica's addresses. Existing clients'
// slot maps still name the dead master.
func (c *RedisCluster) KillMaster(t testing.TB, key string) (killed, promoted string) {
	t.Helper()
	return c.loseMaster(t, key, c.Kill)
}

// FreezeMaster is KillMaster for a lost host: the master serving key is
// frozen (Freeze), so that clients' connections to it stay open and time
// out instead of being refused or reset, and its replica promoted. The
// frozen node is thawed at the test's cleanup (it rejoins as a replica).
func (c *RedisCluster) FreezeMaster(t testing.TB, key string) (frozen, promoted string) {
	t.Helper()
	return c.loseMaster(t, key, func(i int) {
		c.Freeze(i)
		t.Cleanup(func() { c.Thaw(i) })
	})
}

// MasterLoss is one way for a test to lose a Cluster master, with the
// deadline the calls after it carry.
type MasterLoss struct {
	Name string
	// Lose takes the master serving key out and promotes its replica
	// (KillMaster, FreezeMaster).
	Lose func(c *RedisCluster, t testing.TB, key string) (lost, promoted string)
	// Restore brings node i, lost by Lose, back (it rejoins as a replica).
	Restore func(c *RedisCluster, t testing.TB, i int)
	// Timeout bounds each call after the loss; 0 leaves it to the client.
	Timeout time.Duration
}

// MasterLosses returns the two losses a cluster client must recover from
// within seconds: a killed master, which refuses connections, and a lost
// host (frozen), which answers nothing and resets nothing, met by callers
// whose deadline (200 ms) is shorter than their client's ReadTimeout (give
// it a second or more): go-redis reports them only that deadline.
func MasterLosses() []MasterLoss {
	return []MasterLoss{
		{"Killed", (*RedisCluster).KillMaster, (*RedisCluster).Start, 0},
		{"LostWithShortDeadlines", (*RedisCluster).FreezeMaster, func(c *RedisCluster, _ testing.TB, i int) { c.Thaw(i) }, 200 * time.Millisecond},
	}
}

// Call runs call with ctx bounded by l.Timeout.
func (l MasterLoss) Call(ctx context.Context, call func(ctx context.Context) error) error {
	if l.Timeout == 0 {
		return call(ctx)
	}
	short, cancel := context.WithTimeout(ctx, l.Timeout)
	defer cancel()
	return call(short)
}

// loseMaster takes the master serving key out with lose (a kill, a
// freeze) once one of its replicas in sync has every write it
// acknowledged, and promotes that replica.
func (c *RedisCluster) loseMaster(t testing.TB, key string, lose func(i int)) (lost, promoted string) {
	t.Helper()
	ctx := context.Background()
	client := c.Client(t)
	var old *redis.Client
	deadline := time.Now().Add(20 * time.Second)
	for {
		old, promoted = masterAndReplica(ctx, client, key)
		if promoted != "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("testenv: no master of %q with a replica in sync after 20 s", key)
		}
		client.ReloadState(ctx)
		time.Sleep(50 * time.Millisecond)
	}
	lost = old.Options().Addr
	if n, err := old.Wait(ctx, 1, 5*time.Second).Result(); err != nil || n < 1 {
		t.Fatalf("testenv: WAIT on %s before losing it: %d replicas, %v", lost, n, err)
	}
	i := slices.Index(c.Addrs(), lost)
	if i < 0 {
		t.Fatalf("testenv: %s is not a node of the cluster", lost)
	}
	lose(i)
	replica := redis.NewClient(&redis.Options{Addr: promoted})
	defer replica.Close()
	if err := replica.Do(ctx, "CLUSTER", "FAILOVER", "TAKEOVER").Err(); err != nil {
		t.Fatalf("testenv: CLUSTER FAILOVER TAKEOVER on %s: %v", promoted, err)
	}
	return lost, promoted
}

// KillMasterAndRetry kills the master serving key and promotes its replica
// (KillMaster), then calls op until it returns nil, failing the test when
// it still fails after within; it then restarts the killed node, which
// rejoins as a replica, and waits for the cluster to be healthy, so that
// the next call can kill key's master again. It returns how long op kept
// failing. A client whose slot map was loaded before the kill, with no
// periodic reload due (ClusterStateReloadInterval), shows whether op's own
// failures make the client find the promoted replica.
func (c *RedisCluster) KillMasterAndRetry(t testing.TB, key string, within time.Duration, op func() error) time.Duration {
	t.Helper()
	return c.LoseMasterAndRetry(t, MasterLosses()[0], key, within, func(context.Context) error { return op() })
}

// LoseMasterAndRetry is KillMasterAndRetry for any loss: op is called
// with a ctx bounded by loss.Timeout (MasterLoss.Call), and the lost node
// is restored (loss.Restore) once op succeeds.
func (c *RedisCluster) LoseMasterAndRetry(t testing.TB, loss MasterLoss, key string, within time.Duration, op func(ctx context.Context) error) time.Duration {
	t.Helper()
	lost, _ := loss.Lose(c, t, key)
	start := time.Now()
	for {
		err := loss.Call(context.Background(), op)
		if err == nil {
			break
		}
		if time.Since(start) > within {
			t.Fatalf("testenv: still failing %s after the master of %q was lost (%s): %v", within, key, loss.Name, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	failing := time.Since(start)
	loss.Restore(c, t, slices.Index(c.Addrs(), lost))
	c.WaitHealthy(t)
	return failing
}

// waitSlotOwner waits, up to 20 s, until every node of the cluster routes
// key to the master at owner (it answers for key itself, or with MOVED to
// owner): the nodes not involved in a failover or a slot reassignment learn
// of it through gossip, a little later, and a client loading its slot map
// from one of them would otherwise get the old owner.
func (c *RedisCluster) waitSlotOwner(t testing.TB, key, owner string) {
	t.Helper()
	ctx := context.Background()
	deadline := time.Now().Add(20 * time.Second)
	for _, n := range c.nodes {
		node := redis.NewClient(&redis.Options{Addr: n.addr(), MaxRetries: -1})
		for {
			err := node.Exists(ctx, key).Err()
			moved, isMoved := redis.IsMovedError(err)
			if err == nil && n.addr() == owner || isMoved && moved == owner {
				break
			}
			if time.Now().After(deadline) {
				_ = node.Close()
				t.Fatalf("testenv: %s still routes %q elsewhere than %s after 20 s: %v", n.addr(), key, owner, err)
			}
			time.Sleep(20 * time.Millisecond)
		}
		_ = node.Close()
	}
}
