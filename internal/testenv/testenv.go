package testenv

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/services"
)

// RequireServicesEnv names the variable that, set to 1, makes a missing server fail tests instead of
// skipping them.
const RequireServicesEnv = "VERITY_TEST_REQUIRE_SERVICES"

// Unavailable skips the test, or fails it when RequireServicesEnv is 1.
func Unavailable(t testing.TB, format string, args ...any) {
	t.Helper()
	if os.Getenv(RequireServicesEnv) == "1" {
		t.Fatalf("required service unavailable ("+RequireServicesEnv+"=1): "+format, args...)
	}
	t.Skipf("skipping, service unavailable: "+format, args...)
}

func endpoints(t testing.TB) *services.Endpoints {
	t.Helper()
	ep, err := services.Shared(context.Background())
	if err != nil {
		Unavailable(t, "%v", err)
	}
	return ep
}

// PG is a PostgreSQL schema of the test's own.
type PG struct {
	// Pool's connections have search_path set to Schema.
	Pool *pgxpool.Pool
	// Schema is created for the test and dropped, with everything in it, at
	// cleanup.
	Schema string
	// ConnString connects with search_path set to Schema (for database/sql,
	// dedicated connections, or a second pool).
	ConnString string
	// ServerURL connects to the same server without a search_path.
	ServerURL string
}

// poolMaxConns keeps many parallel tests within the server's max_connections.
const poolMaxConns = 8

// Postgres creates a fresh schema for the test on the shared server.
func Postgres(t testing.TB) *PG {
	t.Helper()
	ep := endpoints(t)
	ctx := context.Background()
	schema, conn, err := services.CreateSchema(ctx, ep.PostgresURL, "t_"+slug(t.Name(), 24))
	if err != nil {
		t.Fatalf("testenv: create schema: %v", err)
	}
	t.Cleanup(func() {
		if err := services.DropSchema(context.Background(), ep.PostgresURL, schema); err != nil {
			t.Errorf("testenv: drop schema %s: %v", schema, err)
		}
	})
	return &PG{Pool: NewPool(t, conn), Schema: schema, ConnString: conn, ServerURL: ep.PostgresURL}
}

// NewPool opens a small pool on connString, closed at cleanup.
func NewPool(t testing.TB, connString string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(connString)
	if err != nil {
		t.Fatalf("testenv: parse: %v", services.HidePostgresConnString(err)) // the string may hold a password
	}
	cfg.MaxConns = poolMaxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("testenv: pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// RD is a Redis key namespace of the test's own.
type RD struct {
	// Client is a single-node client, closed at cleanup.
	Client redis.UniversalClient
	// Prefix starts every key the test may create; it contains no braces or
	// glob characters. Keys under it are removed at cleanup.
	Prefix string
	// URL is the server's URL.
	URL string
}

// Redis gives the test a key prefix of its own on the shared server.
func Redis(t testing.TB) *RD {
	t.Helper()
	ep := endpoints(t)
	opt, err := redis.ParseURL(ep.RedisURL)
	if err != nil {
		t.Fatalf("testenv: parse redis url: %v", err)
	}
	client := redis.NewClient(opt)
	prefix := "vt:" + slug(t.Name(), 24) + ":" + services.RandomSuffix(8) + ":"
	t.Cleanup(func() {
		defer client.Close()
		if err := DeletePrefix(context.Background(), client, prefix); err != nil {
			t.Errorf("testenv: clean redis prefix %s: %v", prefix, err)
		}
	})
	return &RD{Client: client, Prefix: prefix, URL: ep.RedisURL}
}

// DeletePrefix removes every key starting with prefix (which must contain no
// glob characters), on every master when client is a cluster client.
func DeletePrefix(ctx context.Context, client redis.UniversalClient, prefix string) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	del := func(ctx context.Context, c *redis.Client) error {
		iter := c.Scan(ctx, 0, prefix+"*", 1000).Iterator()
		batch := make([]string, 0, 500)
		for iter.Next(ctx) {
			batch = append(batch, iter.Val())
			if len(batch) == cap(batch) {
				if err := unlinkEach(ctx, c, batch); err != nil {
					return err
				}
				batch = batch[:0]
			}
		}
		if err := iter.Err(); err != nil {
			return err
		}
		return unlinkEach(ctx, c, batch)
	}
	switch c := client.(type) {
	case *redis.ClusterClient:
		return c.ForEachMaster(ctx, del)
	case *redis.Client:
		return del(ctx, c)
	default:
		return nil
	}
}

// unlinkEach unlinks keys one command each, pipelined: keys from one SCAN may
// live in different slots, which a multi-key UNLINK would reject on Cluster.
func unlinkEach(ctx context.Context, c *redis.Client, keys []string) error {
	if len(keys) == 0 {
		return nil
	}
	_, err := c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, k := range keys {
			p.Unlink(ctx, k)
		}
		return nil
	})
	return err
}

// slug makes a test name usable inside identifiers and key prefixes:
// lower-case ASCII letters, digits and underscores, at most n bytes.
func slug(name string, n int) string {
	var b strings.Builder
	for _, r := range strings.ToLower(name) {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9':
			b.WriteRune(r)
		default:
			b.WriteByte('_')
		}
		if b.Len() >= n {
			break
		}
	}
	return b.String()
}
