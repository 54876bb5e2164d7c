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
	s := &PostgresServer{dir: dir}
	for attempt := 0; ; attempt++ {
		if s.port, err = FreePort(); err != nil {
			break
		}
		s.proc = &process{
			name: filepath.Join(bin, "postgres"),
			args: []string{"-D", data, "-p", strconv.Itoa(s.port), "-k", dir,
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
