package services

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
// Another process may take it before it is used; callers that start servers
// retry on a bind failure.
//
// The port is chosen below the kernel's range for the local ports of
// outgoing connections (where the kernel says what that range is), not by
// listening on port 0, which hands out a port of that range: a server that
// a test kills and starts again on the same port would otherwise find it
// taken, now and then, by some connection made meanwhile (seen in CI: a
// private Redis failed to restart with "Address already in use").
func FreePort() (int, error) { return FreePortPair(0) }

// FreePortPair returns a port p such that p and p+offset were both free a
// moment ago, chosen as FreePort chooses (offset 0: one port), and neither
// returned before by this process. A Redis Cluster node needs its port and
// port+10000, for its bus.
func FreePortPair(offset int) (int, error) {
	handedOut.mu.Lock()
	defer handedOut.mu.Unlock()
	p, err := freePortPair(offset, func(p int) bool { return !handedOut.ports[p] })
	if err == nil {
		handedOut.ports[p], handedOut.ports[p+offset] = true, true
	}
	return p, err
}

// handedOut is every port FreePortPair returned in this process. None is
// returned twice: a test's server that is down for a restart leaves its
// port free, and another test in the same process must not take it then.
// (Process-wide because the ports are.)
var handedOut = struct {
	mu    sync.Mutex
	ports map[int]bool
}{ports: map[int]bool{}}

// freePortPair is FreePortPair's search among the ports ok accepts.
func freePortPair(offset int, ok func(int) bool) (int, error) {
	free := func(p int) bool {
		return ok(p) && ok(p+offset) && portFree(p) && (offset == 0 || portFree(p+offset))
	}
	lo, hi := minFixedPort, ephemeralPortsStart()-1-offset
	for attempt := 0; hi > lo && attempt < 100; attempt++ {
		if p := lo + rand.IntN(hi-lo+1); free(p) {
			return p, nil
		}
	}
	// No room below the ephemeral range (or no luck): any free port.
	for attempt := 0; attempt < 50; attempt++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		p := l.Addr().(*net.TCPAddr).Port
		l.Close()
		if p+offset <= 65535 && free(p) {
			return p, nil
		}
	}
	return 0, fmt.Errorf("services: no free port p with p+%d also free", offset)
}

// minFixedPort is the lowest port FreePort picks: below it lie well-known
// and commonly configured service ports.
const minFixedPort = 10000

// ephemeralPortsStart returns the first port of the kernel's range for
// outgoing connections' local ports: Linux's ip_local_port_range, or the
// IANA range's start (49152, the default of BSDs and macOS) elsewhere.
func ephemeralPortsStart() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if p, err := strconv.Atoi(f[0]); err == nil && p > 0 {
				return p
			}
		}
	}
	return 49152
}

// portFree reports whether 127.0.0.1:p can be listened on.
func portFree(p int) bool {
	l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
	if err != nil {
		return false
	}
	l.Close()
	return true
}

// process is one server child process that can be stopped, killed and
// started again with the same arguments.
type process struct {
	name string
	args []string
	cred *syscall.Credential
	log  string // file receiving stdout and stderr

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
}

func (p *process) start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil {
		return errors.New("already running")
	}
	logFile, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command(p.name, p.args...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{
		// Own process group, so Kill takes the server's children too
		// (PostgreSQL backends would otherwise hold its shared memory).
		Setpgid: true,
		// If the test binary dies, so does the server. Go sets this after
		// switching credentials, so it survives the switch.
		Pdeathsig:  syscall.SIGKILL,
		Credential: p.cred,
	}
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return err
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		logFile.Close()
		close(done)
	}()
	p.cmd, p.done = cmd, done
	return nil
}

// signal sends sig to the whole process group and waits for the leader to
// exit.
func (p *process) signal(sig syscall.Signal, timeout time.Duration) error {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	if cmd == nil {
		return nil
	}
	var children []int
	if sig == syscall.SIGKILL {
		// PostgreSQL backends call setsid(), so they are not in the
		// server's process group: find them before the leader dies and
		// they are re-parented.
		children = descendants(cmd.Process.Pid)
		for _, pid := range children {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	_ = syscall.Kill(-cmd.Process.Pid, sig)
	select {
	case <-done:
	case <-time.After(timeout):
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-done
	}
	if sig == syscall.SIGKILL {
		// Killed children may outlive the leader for a moment, and
		// PostgreSQL refuses to start while an old backend still holds its
		// shared memory: wait until every one has exited.
		waitExited(append(children, cmd.Process.Pid), 10*time.Second)
	}
	p.mu.Lock()
	p.cmd, p.done = nil, nil
	p.mu.Unlock()
	return nil
}

// descendants returns the pids of every process below root, read from /proc.
func descendants(root int) []int {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	children := map[int][]int{}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if ppid, _, ok := procStat(pid); ok {
			children[ppid] = append(children[ppid], pid)
		}
	}
	var out []int
	queue := []int{root}
	for len(queue) > 0 {
		next := children[queue[0]]
		queue = append(queue[1:], next...)
		out = append(out, next...)
	}
	return out
}

// procStat reads the parent pid and state of pid from /proc/<pid>/stat.
func procStat(pid int) (ppid int, state byte, ok bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, 0, false
	}
	// The command name is in parentheses and may contain spaces; the
	// fields after the last ')' are "state ppid ...".
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, false
	}
	fields := strings.Fields(string(b[i+1:]))
	if len(fields) < 2 {
		return 0, 0, false
	}
	ppid, err = strconv.Atoi(fields[1])
	return ppid, fields[0][0], err == nil
}

// waitExited polls until none of pids is alive (gone, or a zombie that no
// longer holds any resources), or timeout.
func waitExited(pids []int, timeout time.Duration) {
	deadline := time.Now().Add(timeout)
	for _, pid := range pids {
		for time.Now().Before(deadline) {
			if _, state, ok := procStat(pid); !ok || state == 'Z' || state == 'X' {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
}

// startAndWait starts the process and polls ready until it succeeds. It
// kills the process and reports its log tail if it exits first, and gives up
// after timeout or when ctx is done.
func (p *process) startAndWait(ctx context.Context, timeout time.Duration, ready func() bool) error {
	if err := p.start(); err != nil {
		return err
	}
	deadline := time.Now().Add(timeout)
	for !ready() {
		select {
		case <-p.exited():
			_ = p.signal(syscall.SIGKILL, time.Second)
			return fmt.Errorf("%s exited during start-up: %s", filepath.Base(p.name), p.logTail())
		default:
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			_ = p.signal(syscall.SIGKILL, time.Second)
			return errors.Join(fmt.Errorf("%s was not ready within %s", filepath.Base(p.name), timeout), ctx.Err())
		}
		time.Sleep(20 * time.Millisecond)
	}
	return nil
}

func (p *process) exited() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.done
}

func (p *process) logTail() string {
	b, err := os.ReadFile(p.log)
	if err != nil {
		return ""
	}
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(b)
}

// unprivilegedCredential returns the credential to run PostgreSQL under when
// this process is root (PostgreSQL refuses to run as root): the "postgres"
// user if it exists, else "nobody". It returns nil when not root.
func unprivilegedCredential() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	for _, name := range []string{"postgres", "nobody"} {
		u, err := user.Lookup(name)
		if err != nil {
			continue
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), NoSetGroups: true}, nil
	}
	return nil, errors.New("running as root and neither user postgres nor nobody exists")
}

// findPostgresBin returns the directory holding initdb and postgres: from
// PATH, else the newest /usr/lib/postgresql/*/bin.
func findPostgresBin() (string, error) {
	if p, err := exec.LookPath("initdb"); err == nil {
		if _, err := exec.LookPath("postgres"); err == nil {
			// The directory the link points into holds the other
			// binaries too (pg_basebackup), where PATH may hold links to
			// a few.
			if target, err := filepath.EvalSymlinks(p); err == nil {
				p = target
			}
			return filepath.Dir(p), nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return versionOf(dirs[i]) > versionOf(dirs[j]) })
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d, nil
		}
	}
	return "", errors.New("initdb/postgres not found in PATH or /usr/lib/postgresql/*/bin")
}

func versionOf(binDir string) float64 {
	v, _ := strconv.ParseFloat(filepath.Base(filepath.Dir(binDir)), 64)
	return v
}

// makeDir creates a fresh directory for a private server. When cred is set,
// the directory is handed to that user; it lives directly under the system
// temp dir because a test's own temp dir is not traversable by others.
func makeDir(parent, pattern string, cred *syscall.Credential) (string, error) {
	if parent == "" {
		parent = os.TempDir()
	}
	dir, err := os.MkdirTemp(parent, pattern)
	if err != nil {
		return "", err
	}
	if cred != nil {
		if err := os.Chmod(dir, 0o755); err != nil {
			return "", err
		}
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			return "", fmt.Errorf("chown %s: %w", dir, err)
		}
	}
	return dir, nil
}
