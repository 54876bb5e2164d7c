// Package examples holds runnable programs, one directory each, that show
// verity working against real PostgreSQL and Redis servers. Each finds its
// servers the way the tests do (environment, local default ports, private
// servers from local binaries, Docker). The experiments and the benchmark
// clean up after themselves; leaderboard-service is a service and keeps its
// board's tables and keys (pass --schema and --key-prefix to place them).
//
//	go run ./examples/failure-experiment   # the leaderboard failure experiment
//	go run ./examples/race-test            # the read-through stale-set race
//	go run ./examples/leaderboard-service  # HTTP service, live page, ops commands
//	go run ./examples/benchmark -quick     # library paths vs the seeds' designs
package examples
