// Package services finds, or starts, the PostgreSQL and Redis servers that
// verity's tests and examples run against.
//
// Resolution, per service, stops at the first step that yields a server that
// answers:
//
//  1. an environment variable (TEST_DATABASE_URL / TEST_REDIS_URL for tests,
//     DATABASE_URL / REDIS_URL for examples; see Options);
//  2. the conventional local server: postgres://postgres@127.0.0.1:5432/postgres
//     and redis://127.0.0.1:6379/0;
//  3. a private server started from local binaries (initdb/postgres from PATH
//     or /usr/lib/postgresql/*/bin, run as an unprivileged user when the
//     process is root; redis-server) on a free port in a temporary directory;
//  4. a container started through dockertest when a Docker daemon answers.
//
// When nothing works, Resolve returns an error wrapping ErrUnavailable.
//
// ParseRedisURL and ParseRedisClusterURL parse a Redis URL a user gave (a
// flag, REDIS_URL): go-redis's own errors quote the URL, password included,
// and theirs never hold any part of the password.
//
// The private-server types (PostgresServer, RedisServer) are also what fault
// tests use to stop, kill -9 and restart a server on purpose.
package services
