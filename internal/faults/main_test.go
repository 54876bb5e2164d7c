package faults

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/verity-go/verity/internal/testenv"
	"github.com/verity-go/verity/leaderboard"
)

// relayChildEnv, when set in the environment of this test binary, turns it
// into a relay process (see relayChild) instead of running tests: the crash
// suite re-executes its own binary so that the relays it SIGKILLs are real,
// separate OS processes, without a separate build step.
const relayChildEnv = "VERITY_FAULTS_RELAY_CHILD"

// relayChildReady is the line a relay process logs once it handles SIGTERM.
const relayChildReady = "relay child: handling SIGTERM"

// childSpec is what the crash suite passes to a relay process, as JSON.
type childSpec struct {
	PostgresURL string `json:"postgres_url"`
	RedisURL    string `json:"redis_url"`
	Schema      string `json:"schema"`
	Board       string `json:"board"`
	KeyPrefix   string `json:"key_prefix"`
	Name        string `json:"name"`
}

func TestMain(m *testing.M) {
	if spec := os.Getenv(relayChildEnv); spec != "" {
		os.Exit(relayChild(spec))
	}
	testenv.Main(m, toxiproxyPipes)
}

// toxiproxyPipes matches toxiproxy's toxic pipes, which can outlive a
// removed link (a send on a channel nobody reads any more): the test tool's
// goroutines, never the library's.
var toxiproxyPipes = goleak.IgnoreAnyFunction("github.com/Shopify/toxiproxy/v2/toxics.(*ToxicStub).Run")

// relayChild runs one leaderboard worker until SIGTERM (graceful) or SIGKILL
// (the point of the exercise).
func relayChild(specJSON string) int {
	var spec childSpec
	if err := json.Unmarshal([]byte(specJSON), &spec); err != nil {
		fmt.Fprintln(os.Stderr, "relay child: bad spec:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	// From here on SIGTERM is a graceful stop; before, it kills the process
	// (Go's default), so relayProc.stop waits for this line.
	fmt.Fprintln(os.Stderr, relayChildReady)
	pool, err := pgxpool.New(ctx, spec.PostgresURL)
	if err != nil {
		fmt.Fprintln(os.Stderr, "relay child: pool:", err)
		return 1
	}
	defer pool.Close()
	opts, err := redis.ParseURL(spec.RedisURL)
	if err != nil {
		fmt.Fprintln(os.Stderr, "relay child: redis url:", err)
		return 1
	}
	rdb := redis.NewClient(opts)
	defer rdb.Close()
	board, err := leaderboard.New(pool, rdb, &leaderboard.Config{Name: spec.Board, Schema: spec.Schema, KeyPrefix: spec.KeyPrefix})
	if err != nil {
		fmt.Fprintln(os.Stderr, "relay child: board:", err)
		return 1
	}
	cfg := faultRelayConfig(spec.Name)
	cfg.BatchSize = 50 // small batches: more of them in flight when the kill lands
	w, err := board.Worker(&leaderboard.WorkerConfig{Relay: cfg})
	if err != nil {
		fmt.Fprintln(os.Stderr, "relay child: worker:", err)
		return 1
	}
	if err := w.Run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "relay child: run:", err)
		return 1
	}
	return 0
}
