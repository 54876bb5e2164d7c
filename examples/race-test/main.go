package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/services"
)

// writePauseDefault paces each writer so that 4 writers make roughly the
// seed's write rate (about 4,100 writes in 30 s). It is not part of the race
// window; --write-pause=0 runs writers flat out.
const writePauseDefault = 20 * time.Millisecond

func main() {
	if err := mainErr(os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "race-test:", err)
		if errors.As(err, new(usageError)) {
			os.Exit(2)
		}
		os.Exit(1)
	}
}

// usageError is a mistake in the command line (exit 2), found before
// anything connects.
type usageError struct{ error }

func (e usageError) Unwrap() error { return e.error }

func mainErr(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("race-test", flag.ContinueOnError)
	readers := fs.Int("readers", 40, "concurrent readers")
	writers := fs.Int("writers", 4, "concurrent writers")
	seconds := fs.Float64("seconds", 30, "how long each mode runs")
	mode := fs.String("mode", "both", "naive, versioned or both")
	asJSON := fs.Bool("json", false, "print one JSON object per mode")
	window := fs.Duration("window", 0, "artificial pause between database read and cache fill (demonstrations only)")
	writePause := fs.Duration("write-pause", writePauseDefault, "pause between a writer's writes")
	dropVersion := fs.Duration("drop-version-every", 0, "versioned mode: delete the version key at this interval (0: never)")
	if err := fs.Parse(args); errors.Is(err, flag.ErrHelp) {
		return nil // -h: the flags were printed; asked for, not a failure
	} else if err != nil {
		return usageError{err}
	}
	// race-test takes no arguments: one is a flag typed without its
	// dashes ("naive" for --mode=naive), and running on with the defaults
	// would measure something other than what was asked for.
	if fs.NArg() > 0 {
		fs.Usage()
		return usageError{fmt.Errorf("unexpected argument %q", fs.Arg(0))}
	}
	// Checked before the conversion: a value past maxSeconds (or NaN)
	// would overflow time.Duration into a negative or arbitrary length.
	if !(*seconds > 0 && *seconds <= maxSeconds) {
		return usageError{fmt.Errorf("--seconds must be above 0 and at most %d (a week)", maxSeconds)}
	}
	cfg := config{
		Readers:    *readers,
		Writers:    *writers,
		Duration:   time.Duration(math.Ceil(*seconds * float64(time.Second))),
		Window:     *window,
		WritePause: *writePause,

		DropVersionEvery: *dropVersion,
	}
	switch *mode {
	case "both":
		cfg.Modes = []string{modeNaive, modeVersioned}
	default:
		cfg.Modes = []string{*mode}
	}
	if err := cfg.validate(); err != nil {
		return usageError{err}
	}

	// SIGTERM too (timeout(1), CI cancellation, kill): either way the run
	// ends through its cleanup and drops its tables and keys.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// The first signal cancels the run, whose operations each run to
	// completion; stop then restores the signals' default action, so that
	// a second one ends the process at once should one of them wait on a
	// server.
	context.AfterFunc(ctx, stop)
	// DATABASE_URL and REDIS_URL first, then local defaults, then private
	// servers started for this run.
	ep, err := services.Resolve(ctx, services.Options{})
	if err != nil {
		return err
	}
	defer ep.Close()
	poolCfg, err := pgxpool.ParseConfig(ep.PostgresURL)
	if err != nil {
		return err
	}
	poolCfg.MaxConns = int32(min(cfg.Readers+cfg.Writers+2, 50))
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	redisOpt, err := services.ParseRedisURL(ep.RedisURL)
	if err != nil {
		return err
	}
	redisOpt.PoolSize = cfg.Readers + cfg.Writers + 4
	client := redis.NewClient(redisOpt)
	defer client.Close()

	if !*asJSON {
		fmt.Fprintf(out, "$ race-test --readers=%d --writers=%d --seconds=%g --mode=%s",
			cfg.Readers, cfg.Writers, *seconds, *mode)
		if cfg.Window > 0 {
			fmt.Fprintf(out, " --window=%s", cfg.Window)
		}
		if cfg.WritePause != writePauseDefault {
			fmt.Fprintf(out, " --write-pause=%s", cfg.WritePause)
		}
		if cfg.DropVersionEvery > 0 {
			fmt.Fprintf(out, " --drop-version-every=%s", cfg.DropVersionEvery)
		}
		fmt.Fprintln(out)
	}
	results, err := run(ctx, cfg, deps{Pool: pool, Redis: client, Prefix: "verity:race-test:"})
	if *asJSON {
		enc := json.NewEncoder(out)
		for _, r := range results {
			if err := enc.Encode(r); err != nil {
				return err
			}
		}
	} else {
		printHuman(out, results)
	}
	return err
}

// printHuman mirrors the seed's before/after block.
func printHuman(out io.Writer, results []Result) {
	var naive *Result
	for i, r := range results {
		label := "after (versioned: versioncache)"
		if r.Mode == modeNaive {
			label = "before (naive: read-through, delete-on-write)"
			naive = &results[i]
		}
		fmt.Fprintf(out, "\n  %s:\n", label)
		if r.Divergences > 0 {
			fmt.Fprintf(out, "    divergences: %s of %s writes (%.1f%%)\n",
				group(r.Divergences), group(r.Writes), 100*float64(r.Divergences)/float64(max(r.Writes, 1)))
			fmt.Fprintf(out, "    first at:    %.1fs\n", *r.FirstDivergenceS)
		} else {
			fmt.Fprintf(out, "    divergences: 0 of %s writes\n", group(r.Writes))
		}
		fmt.Fprintf(out, "    stale reads after ack: %s of %s reads\n", group(r.StaleReadsAfterAck), group(r.Reads))
		fmt.Fprintf(out, "    read latency: p50 %.0fµs, p99 %.0fµs", r.ReadP50us, r.ReadP99us)
		if naive != nil && r.Mode == modeVersioned {
			fmt.Fprintf(out, " (%+.0fµs p50 vs naive)", r.ReadP50us-naive.ReadP50us)
		}
		fmt.Fprintln(out)
		if st := r.CacheStats; st != nil {
			fmt.Fprintf(out, "    cache:       %s hits, %s loads (%s shared), %s stale fills not stored, %s invalidations\n",
				group(int64(st.Hits)), group(int64(st.Loads)), group(int64(st.SharedLoads)),
				group(int64(st.StaleFillsSkipped)), group(int64(st.Invalidations)))
		}
		if r.VersionKeyDrops > 0 {
			fmt.Fprintf(out, "    version key deleted %s times during the run\n", group(r.VersionKeyDrops))
		}
		fmt.Fprintf(out, "    converged:   %t\n", r.Converged)
	}
}

// group formats n with thousands separators, as the seed does.
func group(n int64) string {
	s := fmt.Sprint(n)
	if n < 0 {
		return "-" + group(-n)
	}
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	return b.String()
}
