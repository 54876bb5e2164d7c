package testenv

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// PgBouncer is a private PgBouncer owned by one test.
type PgBouncer struct {
	// Port is where it listens, on 127.0.0.1.
	Port int
}

// URL returns a connection URL through the bouncer to database as user
// postgres, TLS off. PgBouncer ignores a search_path startup parameter:
// give the library its Schema explicitly.
func (b *PgBouncer) URL(database string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", b.Port, database)
}

// StartPgBouncer starts a private PgBouncer in front of the PostgreSQL
// server at target (host:port), trust authentication, with poolMode
// ("transaction", "session") and poolSize server connections per database
// and user; settings are more lines of its [pgbouncer] section
// ("query_wait_timeout = 2"). It is killed and its directory removed at
// cleanup. Without the pgbouncer binary the test is Unavailable.
func StartPgBouncer(t testing.TB, target, poolMode string, poolSize int, settings ...string) *PgBouncer {
	t.Helper()
	bin, err := exec.LookPath("pgbouncer")
	if err != nil {
		bin = "/usr/sbin/pgbouncer" // Debian's, off a user's PATH
		if _, serr := os.Stat(bin); serr != nil {
			Unavailable(t, "pgbouncer: %v", err)
		}
	}
	host, port, err := net.SplitHostPort(target)
	if err != nil {
		t.Fatalf("testenv: pgbouncer target %q: %v", target, err)
	}
	dir, err := os.MkdirTemp("", "verity-pgbouncer-")
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	if os.Geteuid() == 0 { // PgBouncer refuses to run as root
		u, err := user.Lookup("postgres")
		if err != nil {
			Unavailable(t, "pgbouncer as root needs a postgres user to run as: %v", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		if err := os.Chown(dir, uid, -1); err != nil {
			t.Fatalf("testenv: %v", err)
		}
	}
	// The port is free when chosen, but another test may bind it before
	// PgBouncer does: then PgBouncer exits, and it is tried on another.
	for range 5 {
		if b := startPgBouncerOnce(t, bin, dir, host, port, poolMode, poolSize, settings); b != nil {
			return b
		}
	}
	t.Fatalf("testenv: pgbouncer did not start; its logs are in %s", dir)
	return nil
}

// startPgBouncerOnce starts PgBouncer on a free port, or returns nil if it
// exited before it listened there.
func startPgBouncerOnce(t testing.TB, bin, dir, host, port, poolMode string, poolSize int, settings []string) *PgBouncer {
	t.Helper()
	listen, err := freePort()
	if err != nil {
		t.Fatalf("testenv: pgbouncer port: %v", err)
	}
	logFile := filepath.Join(dir, fmt.Sprintf("pgbouncer-%d.log", listen))
	ini := fmt.Sprintf(`[databases]
* = host=%s port=%s
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = %s
default_pool_size = %d
max_client_conn = 200
ignore_startup_parameters = extra_float_digits,search_path
server_reset_query = DISCARD ALL
logfile = %s
`, host, port, listen, filepath.Join(dir, "users.txt"), poolMode, poolSize, logFile)
	for _, s := range settings {
		ini += s + "\n"
	}
	cfg := filepath.Join(dir, "pgbouncer.ini")
	for name, data := range map[string]string{cfg: ini, filepath.Join(dir, "users.txt"): `"postgres" ""` + "\n"} {
		if err := os.WriteFile(name, []byte(data), 0o644); err != nil {
			t.Fatalf("testenv: %v", err)
		}
	}
	args := []string{cfg}
	if os.Geteuid() == 0 {
		args = []string{"-u", "postgres", cfg}
	}
	cmd := exec.Command(bin, args...)
	if err := cmd.Start(); err != nil {
		Unavailable(t, "pgbouncer: %v", err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() { _ = cmd.Process.Kill(); <-exited })
	// Listening on this port by its own log, not by a dial, which a
	// listener of another test's could answer.
	listening := []byte(fmt.Sprintf("listening on 127.0.0.1:%d", listen))
	for range 400 {
		select {
		case <-exited:
			return nil
		default:
		}
		if log, _ := os.ReadFile(logFile); bytes.Contains(log, listening) {
			return &PgBouncer{Port: listen}
		}
		time.Sleep(25 * time.Millisecond)
	}
	log, _ := os.ReadFile(logFile)
	t.Fatalf("testenv: pgbouncer did not start: %s", log)
	return nil
}

// freePort returns a TCP port free on 127.0.0.1 just now.
func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// ReplyDropper forwards TCP connections to a server and, when armed, loses
// the server's next answer: it closes the connection to the server
// instead of passing it on, so the server has run the request (committed
// it) and the client never hears. In front of PostgreSQL, with a pooler
// between the client and the dropper, the pooler sees its server
// connection break after the commit.
type ReplyDropper struct {
	ln     net.Listener
	armed  atomic.Bool
	marker atomic.Pointer[[]byte]
	wg     sync.WaitGroup
	mu     sync.Mutex
	conns  []net.Conn
}

// StartReplyDropper listens on a free port of 127.0.0.1 and forwards to
// target; it stops at cleanup.
func StartReplyDropper(t testing.TB, target string) *ReplyDropper {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	d := &ReplyDropper{ln: ln}
	d.wg.Add(1)
	go d.accept(target)
	t.Cleanup(func() {
		_ = ln.Close()
		d.mu.Lock()
		for _, c := range d.conns {
			_ = c.Close()
		}
		d.mu.Unlock()
		d.wg.Wait()
	})
	return d
}

// Addr is the dropper's host:port.
func (d *ReplyDropper) Addr() string { return d.ln.Addr().String() }

// DropNextReply loses the next answer the server sends.
func (d *ReplyDropper) DropNextReply() { d.armed.Store(true) }

// DropReplyAfter loses the first answer the server sends after a client
// sent bytes that contain marker.
func (d *ReplyDropper) DropReplyAfter(marker string) {
	b := []byte(marker)
	d.marker.Store(&b)
}

func (d *ReplyDropper) accept(target string) {
	defer d.wg.Done()
	for {
		client, err := d.ln.Accept()
		if err != nil {
			return
		}
		server, err := net.Dial("tcp", target)
		if err != nil {
			_ = client.Close()
			continue
		}
		d.mu.Lock()
		d.conns = append(d.conns, client, server)
		d.mu.Unlock()
		d.wg.Add(2)
		go d.pipe(server, client, func(p []byte) bool {
			if m := d.marker.Load(); m != nil && bytes.Contains(p, *m) && d.marker.CompareAndSwap(m, nil) {
				d.armed.Store(true)
			}
			return false
		})
		go d.pipe(client, server, func([]byte) bool { return d.armed.CompareAndSwap(true, false) })
	}
}

// pipe copies from src to dst until either fails, or until drop says to
// lose what was read: then it closes src (and dst, as it returns).
func (d *ReplyDropper) pipe(dst, src net.Conn, drop func([]byte) bool) {
	defer d.wg.Done()
	defer dst.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if drop(buf[:n]) {
				_ = src.Close()
				return
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			if err != io.EOF {
				_ = src.Close()
			}
			return
		}
	}
}

// ServerAddr returns the host:port and database of a PostgreSQL URL (a
// PG's ServerURL, a private server's ConnString), to put a PgBouncer or a
// ReplyDropper in front of it.
func ServerAddr(t testing.TB, url string) (addr, database string) {
	t.Helper()
	cfg, err := pgconn.ParseConfig(url)
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	return net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))), cfg.Database
}
