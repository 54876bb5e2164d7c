package services

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/url"
	"strings"
	"sync"

	"github.com/jackc/pgx/v5"
)

// TestOptions are the options tests resolve services with: TEST_DATABASE_URL
// and TEST_REDIS_URL first.
var TestOptions = Options{PostgresEnv: "TEST_DATABASE_URL", RedisEnv: "TEST_REDIS_URL"}

var shared struct {
	once sync.Once
	ep   *Endpoints
	err  error
}

// Shared resolves services once per process with TestOptions and returns the
// same Endpoints to every caller. Private servers it starts live until the
// process exits (they are killed with it).
func Shared(ctx context.Context) (*Endpoints, error) {
	shared.once.Do(func() {
		shared.ep, shared.err = Resolve(ctx, TestOptions)
	})
	return shared.ep, shared.err
}

// CloseShared stops the private servers and containers Shared started, if
// any, and reports whether one of them came from Docker (whose client keeps
// idle HTTP connections a goroutine check must allow). Call it once, when the
// process no longer needs them: a test binary's TestMain after m.Run.
func CloseShared() (docker bool) {
	if shared.ep == nil {
		return false
	}
	shared.ep.Close()
	return shared.ep.PostgresOrigin == OriginDocker || shared.ep.RedisOrigin == OriginDocker
}

// RandomSuffix returns n random lower-case hex characters.
func RandomSuffix(n int) string {
	b := make([]byte, (n+1)/2)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)[:n]
}

// CreateSchema creates a schema with a fresh name starting with prefix and
// returns its name and a connection string whose search_path is that schema.
func CreateSchema(ctx context.Context, baseURL, prefix string) (schema, connString string, err error) {
	schema = prefix + "_" + RandomSuffix(10)
	conn, err := pgx.Connect(ctx, baseURL)
	if err != nil {
		return "", "", err
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		return "", "", err
	}
	return schema, WithSearchPath(baseURL, schema), nil
}

// DropSchema drops schema and everything in it.
func DropSchema(ctx context.Context, baseURL, schema string) error {
	conn, err := pgx.Connect(ctx, baseURL)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	return err
}

// WithSearchPath returns a copy of a PostgreSQL connection string (a
// postgres:// URL or keyword/value) that sets search_path.
func WithSearchPath(baseURL, schema string) string {
	for _, prefix := range []string{"postgresql://", "postgres://"} {
		if rest, ok := strings.CutPrefix(baseURL, prefix); ok {
			// Read as pgx and libpq read it, not as net/url does: the
			// userinfo ends at the first '@' before a '/', so a password
			// may hold '#' or '?'; the query starts at the next '?'. A
			// later search_path overrides an earlier one.
			if i := strings.IndexAny(rest, "@/"); i >= 0 && rest[i] == '@' {
				rest = rest[i+1:]
			}
			sep := "?"
			if strings.Contains(rest, "?") {
				sep = "&"
				if strings.HasSuffix(rest, "?") || strings.HasSuffix(rest, "&") {
					sep = "" // pgx refuses an empty parameter
				}
			}
			return baseURL + sep + "search_path=" + url.QueryEscape(schema)
		}
	}
	return strings.TrimSpace(baseURL) + " search_path=" + schema // keyword/value
}

// ResolveForExample serves runnable Example functions, which cannot take a
// *testing.T: it resolves services like tests do, creates a fresh schema and
// returns a PostgreSQL URL whose search_path is that schema, the Redis URL,
// and a cleanup that drops the schema. Examples choose their own key prefix.
func ResolveForExample() (pgURL, redisURL string, cleanup func(), err error) {
	ctx := context.Background()
	ep, err := Shared(ctx)
	if err != nil {
		return "", "", nil, err
	}
	schema, conn, err := CreateSchema(ctx, ep.PostgresURL, "example")
	if err != nil {
		return "", "", nil, fmt.Errorf("create schema: %w", err)
	}
	return conn, ep.RedisURL, func() { _ = DropSchema(context.Background(), ep.PostgresURL, schema) }, nil
}
