package services

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"
)

// PostgresServer is a private PostgreSQL server: its own data directory, its
// own port, started from local binaries. It survives Stop/Kill and Start:
// the data directory and port are kept, as a real server's would be.
type PostgresServer struct {
	dir  string
	port int
	proc *process
	bin  string              // the directory of the PostgreSQL binaries
	cred *syscall.Credential // the user it runs as; nil for the current one
}

// StartPostgres runs initdb in a new directory under parent (os.TempDir()
// when empty) and starts a server on a free port. fsync is off (the data is
// disposable and only an OS crash could lose it); synchronous_commit stays on
// so a killed server never loses an acknowledged commit.
func StartPostgres(ctx context.Context, parent string) (*PostgresServer, error) {
	bin, err := findPostgresBin()
	if err != nil {
		return nil, err
	}
	cred, err := unprivilegedCredential()
	if err != nil {
		return nil, err
	}
	dir, err := makeDir(parent, "verity-pg-*", cred)
	if err != nil {
		return nil, err
	}
	data := filepath.Join(dir, "data")
	initdb := exec.CommandContext(ctx, filepath.Join(bin, "initdb"),
		"-D", data, "-U", "postgres", "-A", "trust", "-N", "--no-locale", "-E", "UTF8")
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	if out, err := initdb.CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("initdb: %w: %s", err, out)
	}
	return startServer(ctx, bin, dir, cred)
}

// startServer starts a server on the data directory dir/data on a free port,
// and removes dir if it cannot.
func startServer(ctx context.Context, bin, dir string, cred *syscall.Credential) (*PostgresServer, error) {
	s := &PostgresServer{dir: dir, bin: bin, cred: cred}
	var err error
	for attempt := 0; ; attempt++ {
		if s.port, err = FreePort(); err != nil {
			break
		}
		s.proc = &process{
			name: filepath.Join(bin, "postgres"),
			args: []string{"-D", filepath.Join(dir, "data"), "-p", strconv.Itoa(s.port), "-k", dir,
				"-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "full_page_writes=off",
				"-c", "max_connections=300", "-c", "shared_buffers=64MB"},
			cred: cred,
			log:  filepath.Join(dir, "postgres.log"),
		}
		if err = s.Start(ctx); err == nil || attempt == 2 {
			break
		}
	}
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	return s, nil
}

// StartStandby makes a streaming standby of s (pg_basebackup -R, WAL
// streamed; asynchronous, as by default) in a new directory under parent
// (os.TempDir() when empty), starts it on a free port and waits until it
// accepts connections (read-only, as a hot standby). Promote it with
// SELECT pg_promote(); it then starts a new timeline. Close it as any
// server.
func (s *PostgresServer) StartStandby(ctx context.Context, parent string) (*PostgresServer, error) {
	dir, err := makeDir(parent, "verity-pg-standby-*", s.cred)
	if err != nil {
		return nil, err
	}
	backup := exec.CommandContext(ctx, filepath.Join(s.bin, "pg_basebackup"),
		"-h", "127.0.0.1", "-p", strconv.Itoa(s.port), "-U", "postgres",
		"-D", filepath.Join(dir, "data"), "-R", "-X", "stream", "-c", "fast")
	backup.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred}
	if out, err := backup.CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("pg_basebackup: %w: %s", err, out)
	}
	return startServer(ctx, s.bin, dir, s.cred)
}

// ConnString is a URL for the server's "postgres" database.
func (s *PostgresServer) ConnString() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", s.port)
}

// Start starts the server (again) and waits until it accepts connections.
func (s *PostgresServer) Start(ctx context.Context) error {
	return s.proc.startAndWait(ctx, 30*time.Second, func() bool { return pingPostgres(ctx, s.ConnString()) == nil })
}

// Stop shuts the server down cleanly (fast mode: open transactions roll back).
func (s *PostgresServer) Stop() error { return s.proc.signal(syscall.SIGINT, 30*time.Second) }

// Kill sends SIGKILL to the server and all its backends, like a power cut of
// the process (not of the machine: the OS keeps what was written).
func (s *PostgresServer) Kill() error { return s.proc.signal(syscall.SIGKILL, 10*time.Second) }

// Close kills the server and removes its files.
func (s *PostgresServer) Close() {
	_ = s.Kill()
	_ = os.RemoveAll(s.dir)
}

func startPrivatePostgres(ctx context.Context, dir string) (string, func(), error) {
	s, err := StartPostgres(ctx, dir)
	if err != nil {
		return "", nil, err
	}
	return s.ConnString(), s.Close, nil
}
