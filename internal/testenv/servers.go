package testenv

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/services"
)

// PostgresServer is a private PostgreSQL server owned by one test.
type PostgresServer struct {
	*services.PostgresServer
}

// StartPostgres starts a private PostgreSQL server for the test, killed and
// removed at cleanup. The test may Stop, Kill and Start it at will; data and
// port survive restarts.
func StartPostgres(t testing.TB) *PostgresServer {
	t.Helper()
	s, err := services.StartPostgres(context.Background(), "")
	if err != nil {
		Unavailable(t, "start private postgres: %v", err)
	}
	t.Cleanup(s.Close)
	return &PostgresServer{s}
}

// Start starts the server again after Stop or Kill.
func (s *PostgresServer) Start() error { return s.PostgresServer.Start(context.Background()) }

// StartStandby starts an asynchronous streaming standby of s, killed and
// removed at cleanup (see services.PostgresServer.StartStandby).
func (s *PostgresServer) StartStandby(t testing.TB) *PostgresServer {
	t.Helper()
	sb, err := s.PostgresServer.StartStandby(context.Background(), "")
	if err != nil {
		t.Fatalf("testenv: start a standby: %v", err)
	}
	t.Cleanup(sb.Close)
	return &PostgresServer{sb}
}

// Pool opens a pool on the server's postgres database, closed at cleanup.
func (s *PostgresServer) Pool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	return NewPool(t, s.ConnString())
}

// RedisServer is a private redis-server owned by one test, persistence off.
type RedisServer struct {
	*services.RedisServer
}

// StartRedis starts a private redis-server for the test, killed and removed at
// cleanup. extraArgs are appended to its command line.
func StartRedis(t testing.TB, extraArgs ...string) *RedisServer {
	t.Helper()
	s, err := services.StartRedis(context.Background(), "", extraArgs...)
	if err != nil {
		Unavailable(t, "start private redis: %v", err)
	}
	t.Cleanup(s.Close)
	return &RedisServer{s}
}

// Start starts the server again after Stop or Kill; it comes back empty.
func (s *RedisServer) Start() error { return s.RedisServer.Start(context.Background()) }

// Client returns a client for the server, closed at cleanup.
func (s *RedisServer) Client(t testing.TB) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: s.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// CommandCalls returns how many times the server behind client has run
// command (lower case, as INFO commandstats names it: "evalsha",
// "zmscore"), 0 if never. The count is server-wide, so it means something
// only on a private server (StartRedis).
func CommandCalls(t testing.TB, client *redis.Client, command string) int64 {
	t.Helper()
	info, err := client.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatalf("testenv: INFO commandstats: %v", err)
	}
	for line := range strings.SplitSeq(info, "\n") {
		rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_"+command+":calls=")
		if !ok {
			continue
		}
		calls, _, _ := strings.Cut(rest, ",")
		n, err := strconv.ParseInt(calls, 10, 64)
		if err != nil {
			t.Fatalf("testenv: INFO commandstats: %q: %v", line, err)
		}
		return n
	}
	return 0
}

// FillRedis makes the private server behind client full: it sets maxmemory
// 1 KiB below the memory in use, so that a server started with
// "--maxmemory-policy", "noeviction" refuses writes that may grow it with
// an OOM error (FillRedis checks that a SET is refused). It returns the
// limit set; CONFIG SET maxmemory 0 lifts it.
func FillRedis(t testing.TB, client *redis.Client) (limit int64) {
	t.Helper()
	ctx := context.Background()
	limit = UsedMemory(t, client) - 1024
	if err := client.ConfigSet(ctx, "maxmemory", strconv.FormatInt(limit, 10)).Err(); err != nil {
		t.Fatalf("testenv: CONFIG SET maxmemory: %v", err)
	}
	if err := client.Set(ctx, "testenv:full-probe", "x", 0).Err(); err == nil || !strings.HasPrefix(err.Error(), "OOM ") {
		t.Fatalf("testenv: a SET on the full server answered %v, want an OOM error (is maxmemory-policy noeviction?)", err)
	}
	return limit
}

// UsedMemory returns the used_memory of the server behind client (INFO
// memory).
func UsedMemory(t testing.TB, client *redis.Client) int64 {
	t.Helper()
	info, err := client.Info(context.Background(), "memory").Result()
	if err != nil {
		t.Fatalf("testenv: INFO memory: %v", err)
	}
	for line := range strings.SplitSeq(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "used_memory:"); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				t.Fatalf("testenv: INFO memory: %q: %v", line, err)
			}
			return n
		}
	}
	t.Fatal("testenv: INFO memory has no used_memory")
	return 0
}
