package testenv

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Cluster start-up bounds.
const (
	clusterNodeTimeoutMillis = 2000
	clusterStartTimeout      = 90 * time.Second
	clusterMaxPort           = 65535 - 10000 // the cluster bus listens on port+10000
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

type clusterNode struct {
	port int
	dir  string

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
// its small directory under os.TempDir() is left behind.
func SharedRedisCluster(t testing.TB) *RedisCluster {
	t.Helper()
	shared.once.Do(func() {
		dir, err := os.MkdirTemp("", "verity-redis-cluster-*")
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
	prefix := b.String()
	t.Cleanup(func() {
		client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
		defer client.Close()
		if err := DeletePrefix(context.Background(), client, prefix); err != nil {
			t.Logf("testenv: delete cluster keys under %q: %v", prefix, err)
		}
	})
	return prefix
}

var prefixSeq atomic.Int64

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
		n := &clusterNode{dir: filepath.Join(dir, "node"+strconv.Itoa(i))}
		if err := os.MkdirAll(n.dir, 0o755); err != nil {
			c.close()
			return nil, err
		}
		c.nodes = append(c.nodes, n)
		if err := c.startFresh(ctx, n); err != nil {
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
// retrying with other ports if another process takes them first.
func (c *RedisCluster) startFresh(ctx context.Context, n *clusterNode) error {
	var err error
	for attempt := 0; attempt < 5; attempt++ {
		if n.port, err = freeClusterPort(); err != nil {
			continue
		}
		if err = c.startNode(ctx, n); err == nil {
			return nil
		}
	}
	return err
}

// freeClusterPort returns a port p such that p and p+10000 were both free.
func freeClusterPort() (int, error) {
	for attempt := 0; attempt < 50; attempt++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		p := l.Addr().(*net.TCPAddr).Port
		if p > clusterMaxPort {
			l.Close()
			continue
		}
		bus, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p+10000))
		l.Close()
		if err != nil {
			continue
		}
		bus.Close()
		return p, nil
	}
	return 0, errors.New("no free port pair (port, port+10000) found")
}

func (n *clusterNode) addr() string { return "127.0.0.1:" + strconv.Itoa(n.port) }

func (c *RedisCluster) startNode(ctx context.Context, n *clusterNode) error {
	n.mu.Lock()
	if n.cmd != nil {
		n.mu.Unlock()
		return errors.New("already running")
	}
	logPath := filepath.Join(n.dir, "redis.log")
	cmd := exec.Command(c.serverBin,
		"--port", strconv.Itoa(n.port),
		"--bind", "127.0.0.1",
		"--dir", n.dir,
		"--logfile", logPath,
		"--daemonize", "no",
		"--save", "",
		"--appendonly", "no",
		"--cluster-enabled", "yes",
		"--cluster-config-file", "nodes.conf",
		"--cluster-node-timeout", strconv.Itoa(clusterNodeTimeoutMillis),
		"--cluster-replica-validity-factor", "0",
	)
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

func (c *RedisCluster) close() {
	var wg sync.WaitGroup
	for _, n := range c.nodes {
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

// Stop shuts node i down with SIGTERM and waits until it has exited.
func (c *RedisCluster) Stop(i int) { c.nodes[i].signal(syscall.SIGTERM) }

// Start starts a stopped or killed node i again on its old port with its
// old nodes.conf, and waits until it answers PING (not until the cluster
// is healthy again; see WaitHealthy).
func (c *RedisCluster) Start(t testing.TB, i int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := c.startNode(ctx, c.nodes[i]); err != nil {
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
