// Package testenv gives each test real, isolated PostgreSQL and Redis
// resources. It never fakes either server.
//
// Postgres and Redis resolve shared servers once per test process (see
// package services for the order: TEST_DATABASE_URL / TEST_REDIS_URL, the
// local default ports, private servers from local binaries, Docker) and then
// isolate each caller: a fresh schema, dropped at cleanup, and a unique Redis
// key prefix whose keys are removed with SCAN + UNLINK at cleanup — never
// FLUSHALL or FLUSHDB on a server the test did not start.
//
// StartPostgres and StartRedis always start private server processes that a
// test may stop, kill -9 and restart.
//
// When no server can be found the test is skipped with one line, unless
// VERITY_TEST_REQUIRE_SERVICES=1, which turns the skip into a failure (CI
// sets it, so CI can never pass by skipping).
//
// Main is every test binary's TestMain: after the tests it stops the shared
// servers the binary started and fails if any goroutine outlived them.
package testenv
