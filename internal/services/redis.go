package services

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"
)

// RedisServer is a private redis-server with persistence off: a restart
// loses every key, which is what fault tests want to provoke.
type RedisServer struct {
	dir  string
	port int
	proc *process
}

// StartRedis starts redis-server on a free port with its files in a new
// directory under parent (os.TempDir() when empty). Extra arguments are
// appended to the command line (for example "--requirepass", "secret").
func StartRedis(ctx context.Context, parent string, extraArgs ...string) (*RedisServer, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, errors.New("redis-server not found in PATH")
	}
	dir, err := makeDir(parent, "verity-redis-*", nil)
	if err != nil {
		return nil, err
	}
	s := &RedisServer{dir: dir}
	for attempt := 0; ; attempt++ {
		if s.port, err = FreePort(); err != nil {
			break
		}
		args := []string{"--port", strconv.Itoa(s.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
			"--dir", dir, "--daemonize", "no"}
		s.proc = &process{name: bin, args: append(args, extraArgs...), log: filepath.Join(dir, "redis.log")}
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

// Addr is host:port of the server; it does not change across restarts.
func (s *RedisServer) Addr() string { return fmt.Sprintf("127.0.0.1:%d", s.port) }

// URL is a redis:// URL for database 0.
func (s *RedisServer) URL() string { return "redis://" + s.Addr() + "/0" }

// Start starts the server (again) and waits until it answers PING. Without
// persistence a restarted server is empty.
func (s *RedisServer) Start(ctx context.Context) error {
	return s.proc.startAndWait(ctx, 10*time.Second, func() bool {
		err := pingRedis(ctx, s.URL())
		return err == nil || isAuthError(err)
	})
}

// isAuthError reports a server that answers but wants a password: it is up.
func isAuthError(err error) bool {
	msg := err.Error()
	return len(msg) >= 7 && (msg[:7] == "NOAUTH " || msg[:7] == "WRONGPA")
}

// Stop shuts the server down with SIGTERM.
func (s *RedisServer) Stop() error { return s.proc.signal(syscall.SIGTERM, 10*time.Second) }

// Kill sends SIGKILL to the server.
func (s *RedisServer) Kill() error { return s.proc.signal(syscall.SIGKILL, 10*time.Second) }

// Close kills the server and removes its files.
func (s *RedisServer) Close() {
	_ = s.Kill()
	_ = os.RemoveAll(s.dir)
}

func startPrivateRedis(ctx context.Context, dir string) (string, func(), error) {
	s, err := StartRedis(ctx, dir)
	if err != nil {
		return "", nil, err
	}
	return s.URL(), s.Close, nil
}
