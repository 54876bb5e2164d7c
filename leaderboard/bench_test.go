package leaderboard

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// benchBoard returns a migrated board for a benchmark. With asyncCommit,
// its pool runs with synchronous_commit off, so commits do not wait for the
// WAL flush and the figures show the cost of round trips and execution.
func benchBoard(b *testing.B, asyncCommit bool) *Board {
	b.Helper()
	tb := setupTB(b)
	if !asyncCommit {
		return tb.board
	}
	cfg, err := pgxpool.ParseConfig(tb.pg.ConnString)
	if err != nil {
		b.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "off"
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	c := tb.board.Config()
	board, err := New(pool, tb.rd.Client, &c)
	if err != nil {
		b.Fatal(err)
	}
	return board
}

// BenchmarkSubmit compares Submit (one statement, one round trip) with the
// seed's handler: BEGIN, INSERT event ON CONFLICT DO NOTHING, upsert score,
// INSERT outbox, COMMIT — five statements, five round trips. Both write the
// same rows into the same tables; users are spread so locks do not contend.
// The AsyncCommit variants take the WAL flush out of the picture.
//
//	go test -run '^$' -bench 'BenchmarkSubmit$' -benchtime 2s ./leaderboard
func BenchmarkSubmit(b *testing.B) {
	ctx := context.Background()
	for _, async := range []bool{false, true} {
		suffix := ""
		if async {
			suffix = "AsyncCommit"
		}
		b.Run("OneStatement"+suffix, func(b *testing.B) {
			board := benchBoard(b, async)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := board.Submit(ctx, Command{EventID: uuid.New(), UserID: fmt.Sprintf("user-%d", i%1000), Delta: 1}); err != nil {
					b.Fatal(err)
				}
			}
			reportRate(b, b.N)
		})
		b.Run("SeedFiveStatements"+suffix, func(b *testing.B) {
			board := benchBoard(b, async)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if err := seedHandler(ctx, board, Command{EventID: uuid.New(), UserID: fmt.Sprintf("user-%d", i%1000), Delta: 1}); err != nil {
					b.Fatal(err)
				}
			}
			reportRate(b, b.N)
		})
	}
}

// seedHandler is the seed's five-statement transaction, for comparison.
func seedHandler(ctx context.Context, board *Board, cmd Command) error {
	schema := board.cfg.Schema
	events, scores := qualify(schema, ScoreEventsTable), qualify(schema, UserScoresTable)
	outboxTable := pgx.Identifier{schema, board.cfg.OutboxTable}.Sanitize()
	tx, err := board.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // after Commit it is a no-op
	tag, err := tx.Exec(ctx, `INSERT INTO `+events+` (event_id, board, user_id, delta, score, version)
		VALUES ($1, $2, $3, $4, 0, 0) ON CONFLICT DO NOTHING`, cmd.EventID, board.cfg.Name, cmd.UserID, cmd.Delta)
	if err != nil {
		return err
	}
	if tag.RowsAffected() == 0 {
		return tx.Commit(ctx)
	}
	var score, version int64
	if err := tx.QueryRow(ctx, `INSERT INTO `+scores+` AS s (board, user_id, score, version) VALUES ($1, $2, $3, 1)
		ON CONFLICT (board, user_id) DO UPDATE SET score = s.score + EXCLUDED.score, version = s.version + 1, updated_at = now()
		RETURNING score, version`, board.cfg.Name, cmd.UserID, cmd.Delta).Scan(&score, &version); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `INSERT INTO `+outboxTable+` (event_id, stream, key, version, payload) VALUES ($1, $2, $3, $4, $5)`,
		cmd.EventID, board.stream, cmd.UserID, version, []byte(fmt.Sprint(score))); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// BenchmarkSubmitBatch measures bulk imports: batches of 1,000 and 5,000
// commands over 10,000 users.
//
//	go test -run '^$' -bench 'SubmitBatch' -benchtime 2s ./leaderboard
func BenchmarkSubmitBatch(b *testing.B) {
	ctx := context.Background()
	for _, size := range []int{1000, 5000} {
		b.Run(fmt.Sprint(size), func(b *testing.B) {
			board := benchBoard(b, false)
			cmds := make([]Command, size)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				for j := range cmds {
					cmds[j] = Command{EventID: uuid.New(), UserID: fmt.Sprintf("user-%d", (i*size+j)%10000), Delta: 1}
				}
				if _, err := board.SubmitBatch(ctx, cmds); err != nil {
					b.Fatal(err)
				}
			}
			reportRate(b, b.N*size)
		})
	}
}

func reportRate(b *testing.B, commands int) {
	b.ReportMetric(float64(commands)/b.Elapsed().Seconds(), "commands/s")
}

// BenchmarkSubmitInterleaved alternates Submit and the seed's handler in
// one loop, so that load from other processes hits both alike, and reports
// each one's median and 90th-percentile latency.
//
//	go test -run '^$' -bench 'SubmitInterleaved' -benchtime 500x ./leaderboard
func BenchmarkSubmitInterleaved(b *testing.B) {
	ctx := context.Background()
	for _, async := range []bool{false, true} {
		name := "Durable"
		if async {
			name = "AsyncCommit"
		}
		b.Run(name, func(b *testing.B) {
			board := benchBoard(b, async)
			one := make([]time.Duration, 0, b.N)
			seed := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				user := fmt.Sprintf("user-%d", i%1000)
				start := time.Now()
				if _, err := board.Submit(ctx, Command{EventID: uuid.New(), UserID: user, Delta: 1}); err != nil {
					b.Fatal(err)
				}
				one = append(one, time.Since(start))
				start = time.Now()
				if err := seedHandler(ctx, board, Command{EventID: uuid.New(), UserID: user, Delta: 1}); err != nil {
					b.Fatal(err)
				}
				seed = append(seed, time.Since(start))
			}
			b.StopTimer()
			for _, m := range []struct {
				name string
				d    []time.Duration
			}{{"one", one}, {"seed", seed}} {
				slices.Sort(m.d)
				b.ReportMetric(float64(m.d[len(m.d)/2].Microseconds()), m.name+"-p50-µs")
				b.ReportMetric(float64(m.d[len(m.d)*9/10].Microseconds()), m.name+"-p90-µs")
			}
		})
	}
}
