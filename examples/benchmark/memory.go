package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/services"
	"github.com/verity-go/verity/projection"
)

// membersPerBucket is the library's documented sizing of version buckets
// (projection.Config.VersionBuckets): about expected members / 64, so each
// bucket stays a listpack (at most 128 entries) while the board doubles.
const membersPerBucket = 64

// runMemory measures Redis bytes per projected member at one event per
// member: the library's keys (the sorted set, its version buckets and
// layout key) against the seed's (the sorted set and one version hash plus
// a marker key per event id, kept 24 h). The library is configured as its
// documentation advises for a board of this size: VersionBuckets =
// members / 64 rounded (1,563 buckets for 100,000 members, 31 for the quick
// run's 2,000), so every bucket is a compact listpack hash; with the
// default of 0 (one version hash) the versions cost about 2.7× as much. The
// seed side is unchanged. Sizes come from MEMORY USAGE … SAMPLES 0 (exact)
// on every key involved, markers and every bucket included. MEMORY USAGE
// counts a key's name, value and main dictionary entry but not its entry in
// the expires dictionary, so the seed's figure is, if anything, a little
// low.
func runMemory(ctx context.Context, e *env) (figs []Figure, err error) {
	m := e.opts.Sizes.MemoryMembers
	// Key names count: the seed pays its namespace once per event (one
	// marker key each), the library once per key. Both sides therefore get
	// a namespace as short as a deployment's would be ("lb:"-like), not
	// the run's long isolation prefix, which would inflate the seed's side
	// by about 16 bytes per member.
	kp := memoryPrefix(e.suffix)
	defer func() {
		if cerr := deletePrefix(context.WithoutCancel(ctx), e.rdb, kp); cerr != nil {
			err = errors.Join(err, fmt.Errorf("deleting keys under %s: %w", kp, cerr))
		}
	}()
	member := func(i int) string { return fmt.Sprintf("user-%09d", i) }

	// Library: the gate, one write per member.
	ks, err := projection.NewKeyspace(kp + "lib:")
	if err != nil {
		return nil, err
	}
	buckets := bucketCount(m)
	if ks, err = ks.WithVersionBuckets(buckets); err != nil {
		return nil, err
	}
	gate := projection.NewGate(e.rdb, ks)
	const chunk = 1_000
	for lo := 0; lo < m; lo += chunk {
		writes := make([]projection.Write, 0, chunk)
		for i := lo; i < min(lo+chunk, m); i++ {
			writes = append(writes, projection.Write{
				Target:  projection.Target{Kind: projection.KindSortedSet, Name: "board", Member: member(i)},
				Version: 1, Value: projection.Value{Score: -int64(i % 100_000)},
			})
		}
		outcomes, err := gate.Apply(ctx, writes)
		if err != nil {
			return nil, err
		}
		// Every member must be stored, or the bytes below are divided by
		// members that are not there.
		for i, o := range outcomes {
			if o != projection.OutcomeApplied {
				return nil, fmt.Errorf("library: %s write %s, want applied", writes[i].Target.Member, o)
			}
		}
	}
	target := projection.Target{Kind: projection.KindSortedSet, Name: "board"}
	if err := checkMembers(ctx, e.rdb, "library", ks.ValueKey(target), m); err != nil {
		return nil, err
	}
	libZset, err := memoryUsage(ctx, e.rdb, []string{ks.ValueKey(target)})
	if err != nil {
		return nil, err
	}
	versionKeys := append(ks.VersionKeys(target.Name, target.Kind), ks.LayoutKey(target.Name, target.Kind))
	libVersions, err := memoryUsage(ctx, e.rdb, versionKeys)
	if err != nil {
		return nil, err
	}
	lib := libZset + libVersions

	// Seed: the per-event script, one event (and marker) per member.
	if err := seedGate.Load(ctx, e.rdb).Err(); err != nil {
		return nil, err
	}
	seedKeys := make([]string, 0, m)
	s := newSeedKeys(e.rdb, kp)
	s.markerPrefix = kp + "ev:"
	for lo := 0; lo < m; lo += chunk {
		batch := make([]seedRow, 0, chunk)
		for i := lo; i < min(lo+chunk, m); i++ {
			row := seedRow{eventID: uuid.New(), user: member(i), score: int64(i % 100_000), version: 1}
			batch = append(batch, row)
			seedKeys = append(seedKeys, s.markerPrefix+row.eventID.String())
		}
		if err := s.project(ctx, batch); err != nil {
			return nil, err
		}
	}
	if err := checkMembers(ctx, e.rdb, "seed", s.zset, m); err != nil {
		return nil, err
	}
	markers, err := memoryUsage(ctx, e.rdb, seedKeys)
	if err != nil {
		return nil, err
	}
	seedStructs, err := memoryUsage(ctx, e.rdb, []string{s.zset, s.versions})
	if err != nil {
		return nil, err
	}
	seedBytes := markers + seedStructs
	perLib, perSeed := float64(lib)/float64(m), float64(seedBytes)/float64(m)
	per := func(b int64) float64 { return float64(b) / float64(m) }
	e.log("memory: library %.1f B/member (sorted set %.1f, versions %.1f in %d buckets + layout key); seed %.1f B/member (sorted set + versions %.1f, markers %.1f)",
		perLib, per(libZset), per(libVersions), buckets, perSeed, per(seedStructs), per(markers))
	return []Figure{newFigure("memory", "bytes/member", perLib, perSeed)}, nil
}

// checkMembers fails unless the sorted set zkey holds m members: the
// figure is bytes per member.
func checkMembers(ctx context.Context, rdb *redis.Client, side, zkey string, m int) error {
	card, err := rdb.ZCard(ctx, zkey).Result()
	if err != nil {
		return err
	}
	if card != int64(m) {
		return fmt.Errorf("%s: %d members in the sorted set, want %d", side, card, m)
	}
	return nil
}

// memoryPrefix is the memory figure's short key namespace for the run
// named suffix.
func memoryPrefix(suffix string) string { return "vbm" + suffix[:min(5, len(suffix))] + ":" }

// memoryUsage sums MEMORY USAGE … SAMPLES 0 over keys, pipelined.
func memoryUsage(ctx context.Context, rdb *redis.Client, keys []string) (int64, error) {
	var total int64
	const chunk = 1_000
	for lo := 0; lo < len(keys); lo += chunk {
		pipe := rdb.Pipeline()
		cmds := make([]*redis.IntCmd, 0, chunk)
		for _, k := range keys[lo:min(lo+chunk, len(keys))] {
			cmds = append(cmds, pipe.MemoryUsage(ctx, k, 0))
		}
		if _, err := pipe.Exec(ctx); err != nil {
			return 0, err
		}
		for _, c := range cmds {
			total += c.Val()
		}
	}
	return total, nil
}

// Relay child process. The relay's peak RSS is read from
// /proc/<pid>/status (VmHWM) of a separate process that does nothing but
// drain, so that the harness's own allocations do not count.

// childEnv names the environment variable that turns the benchmark binary
// (or its test binary) into a relay child; its value is "relay".
const childEnv = "VERITY_BENCH_CHILD"

// runRSS drains two backlogs, a small and a 10× larger one, each in a fresh
// child process running the library's relays and projector, and reports
// both peak RSS figures: flat means memory is bounded by the batch size,
// not by the backlog.
func runRSS(ctx context.Context, e *env) ([]Figure, error) {
	schema, err := e.schema(ctx, "rss")
	if err != nil {
		return nil, err
	}
	peaks := map[string]float64{}
	for _, size := range []struct {
		name string
		rows int
	}{{"small", e.opts.Sizes.RSSSmall}, {"large", e.opts.Sizes.RSSLarge}} {
		table, err := newOutbox(ctx, e.pool, schema, "rss_"+size.name)
		if err != nil {
			return nil, err
		}
		start := time.Now()
		if err := fillOutbox(ctx, e.pool, table, drainStream, size.rows, e.opts.Sizes.DrainUsers); err != nil {
			return nil, err
		}
		e.log("rss: %d rows filled in %s", size.rows, time.Since(start).Round(time.Millisecond))
		start = time.Now()
		peak, err := runRelayChild(ctx, e, schema, "rss_"+size.name, size.rows, min(e.opts.Sizes.DrainUsers, size.rows))
		if err != nil {
			return nil, fmt.Errorf("%s backlog: %w", size.name, err)
		}
		e.log("rss: %d rows drained by the child in %s (%.0f rows/s), peak RSS %.1f MiB",
			size.rows, time.Since(start).Round(time.Millisecond), float64(size.rows)/time.Since(start).Seconds(), peak)
		peaks[size.name] = peak
	}
	return []Figure{newFigure("relay_rss_peak", "MiB", peaks["large"], peaks["small"])}, nil
}

// runRelayChild re-executes this binary as a relay child that drains
// table (a fillOutbox of rows rows over users members), waits until it
// reports, reads its VmHWM and lets it exit. The figure counts only if the
// child really projected the backlog (checkDrained): its own count of rows
// handled includes rows its projector refused.
func runRelayChild(ctx context.Context, e *env, schema, table string, rows, users int) (float64, error) {
	self, err := os.Executable()
	if err != nil {
		return 0, err
	}
	cmd := exec.CommandContext(ctx, self)
	cmd.Env = append(os.Environ(),
		childEnv+"=relay",
		"VERITY_BENCH_PG="+e.opts.PostgresURL,
		"VERITY_BENCH_REDIS="+e.opts.RedisURL,
		"VERITY_BENCH_SCHEMA="+schema,
		"VERITY_BENCH_TABLE="+table,
		"VERITY_BENCH_PREFIX="+e.keyPrefix("rss-"+table),
		"VERITY_BENCH_RELAYS="+strconv.Itoa(e.opts.Relays),
		"VERITY_BENCH_BATCH="+strconv.Itoa(e.opts.BatchSize),
	)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return 0, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return 0, err
	}
	if err := cmd.Start(); err != nil {
		return 0, err
	}
	defer cmd.Wait() //nolint:errcheck // waited for below on the success path
	defer stdin.Close()

	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		return 0, fmt.Errorf("relay child said nothing: %w", err)
	}
	drained, err := strconv.Atoi(strings.TrimPrefix(strings.TrimSpace(line), "drained "))
	if err != nil || drained != rows {
		return 0, fmt.Errorf("relay child reported %q, want %d rows drained", strings.TrimSpace(line), rows)
	}
	kib, err := vmHWM(cmd.Process.Pid)
	if err != nil {
		return 0, err
	}
	stdin.Close()
	if err := cmd.Wait(); err != nil {
		return 0, fmt.Errorf("relay child: %w", err)
	}
	if err := checkDrained(ctx, e, schema, table, e.keyPrefix("rss-"+table), rows, users); err != nil {
		return 0, fmt.Errorf("relay child: %w", err)
	}
	return float64(kib) / 1024, nil
}

// vmHWM reads the peak resident set size of pid, in KiB.
func vmHWM(pid int) (int64, error) {
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, fmt.Errorf("reading the relay child's peak RSS (Linux /proc needed): %w", err)
	}
	for _, line := range strings.Split(string(status), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			return strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
		}
	}
	return 0, errors.New("no VmHWM line in /proc/<pid>/status")
}

// relayChild is the child's whole life: drain the table with the library's
// relays, print "drained N", and wait for the parent to close stdin (so the
// parent can read VmHWM of a live process).
func relayChild(ctx context.Context, stdin io.Reader, stdout io.Writer) error {
	relays, err := strconv.Atoi(os.Getenv("VERITY_BENCH_RELAYS"))
	if err != nil {
		return fmt.Errorf("VERITY_BENCH_RELAYS: %w", err)
	}
	batch, err := strconv.Atoi(os.Getenv("VERITY_BENCH_BATCH"))
	if err != nil {
		return fmt.Errorf("VERITY_BENCH_BATCH: %w", err)
	}
	pool, err := pgxpool.New(ctx, os.Getenv("VERITY_BENCH_PG"))
	if err != nil {
		return err
	}
	defer pool.Close()
	opts, err := services.ParseRedisURL(os.Getenv("VERITY_BENCH_REDIS"))
	if err != nil {
		return err
	}
	rdb := redis.NewClient(opts)
	defer rdb.Close()
	n, _, err := drainRelays(ctx, pool, rdb, os.Getenv("VERITY_BENCH_SCHEMA"), os.Getenv("VERITY_BENCH_TABLE"),
		os.Getenv("VERITY_BENCH_PREFIX"), relays, batch, false, nil)
	if err != nil {
		return err
	}
	if _, err := fmt.Fprintf(stdout, "drained %d\n", n); err != nil {
		return err
	}
	_, err = io.Copy(io.Discard, stdin)
	return err
}
