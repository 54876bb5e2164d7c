package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/verity-go/verity/outbox"
	"github.com/verity-go/verity/reconcile"
)

// cmdServe runs the service until ctx is cancelled (SIGINT, SIGTERM).
func cmdServe(ctx context.Context, o *options, _, stderr io.Writer) error {
	logger, err := o.logger(stderr)
	if err != nil {
		return err
	}
	// Bound first, so that an address that cannot be served (in use, an
	// unknown host) fails before the servers are resolved and the board's
	// tables migrated.
	ln, err := (&net.ListenConfig{}).Listen(ctx, "tcp", o.addr)
	if err != nil {
		return err
	}
	defer ln.Close() // for the returns before Run, whose server closes it
	d, err := connect(ctx, o, logger)
	if err != nil {
		return err
	}
	defer d.close()
	allowedHosts, err := o.hostAllowList() // checked by parseFlags
	if err != nil {
		return err
	}
	svc, err := NewService(d.pool, d.rdb, d.board, ServiceConfig{
		AllowedHosts:    allowedHosts,
		ReconcileEvery:  o.reconcileEvery,
		ReconcileSample: o.reconcileSample,
		Relay:           &outbox.RelayConfig{Logger: logger, DisableNotify: o.disableNotify},
		Logger:          logger,
	})
	if err != nil {
		return err
	}
	defer svc.Close()
	return svc.Run(ctx, ln)
}

// opsDeps connects for an ops subcommand, whose logs stay quiet unless
// asked for: its output is the report.
func opsDeps(ctx context.Context, o *options, stderr io.Writer) (*deps, error) {
	if o.logLevel == "info" {
		o.logLevel = "warn"
	}
	logger, err := o.logger(stderr)
	if err != nil {
		return nil, err
	}
	return connect(ctx, o, logger)
}

// cmdStats prints the outbox backlog and the board's projection lag.
func cmdStats(ctx context.Context, o *options, stdout, stderr io.Writer) error {
	d, err := opsDeps(ctx, o, stderr)
	if err != nil {
		return err
	}
	defer d.close()
	w, err := d.board.Worker(nil)
	if err != nil {
		return err
	}
	snap := readSnapshot(ctx, w.Relay(), d.board)
	if snap.Err != nil {
		return snap.Err
	}
	// The lag is the outbox's, which PostgreSQL answers alone: an
	// unreachable Redis must fail the command, not print a lag under
	// which "everything is visible" (nor, with --require-verified, pass
	// for a board that lost its data: Unverified also covers a record
	// that could not be read). A keyed read, not a PING, as in
	// redisUnreachable: a cluster node answers PING while the cluster is
	// down for keys.
	if err := d.rdb.Exists(ctx, d.board.SortedSetKey()).Err(); err != nil {
		return fmt.Errorf("redis: %w", err)
	}
	st := toStats(d.board.Name(), snap)
	if o.json {
		return printJSON(stdout, st)
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "board\t%s\n", st.Board)
	fmt.Fprintf(tw, "outbox pending\t%d\t(in flight %d, retrying %d; all streams)\n", st.Pending, st.InFlight, st.Retrying)
	fmt.Fprintf(tw, "oldest pending\t%s\n", humanDuration(snap.Outbox.OldestPendingAge))
	fmt.Fprintf(tw, "dead letters\t%d\t(all streams)\n", st.DeadLetters)
	lag := lagText(snap.Freshness.Lag)
	if snap.Freshness.Unverified {
		lag = "unknown: the projection is not verified (no full pass yet, Redis lost data, or PostgreSQL is not the database last verified against; run 'reconcile --verify')"
	}
	// The lag is no column cell: the unverified explanation would widen
	// the column of the dead-letter count above it to its own length.
	fmt.Fprintf(tw, "projection lag\t%s  (%s)\n", lag, projectedThroughText(st.Freshness))
	if err := tw.Flush(); err != nil {
		return err
	}
	if st.DeadLetters > 0 {
		// The count is the whole table's; replay-dead moves only this
		// board's stream, so say which, lest other boards' dead letters
		// seem stuck.
		fmt.Fprintf(stdout, "\ndead letters wait for a fix, then 'leaderboard-service replay-dead', which moves back this board's (stream %q); the count includes every board sharing the outbox\n", d.board.Stream())
	}
	return nil
}

// reconcileSummary is a reconcile.Report reduced to what a page, a script
// or a person reads: counts by name, no examples.
type reconcileSummary struct {
	Started    time.Time        `json:"started"`
	DurationMS float64          `json:"duration_ms"`
	Sampled    bool             `json:"sampled"`
	DryRun     bool             `json:"dry_run"`
	Checked    int64            `json:"checked"`
	Scanned    int64            `json:"scanned"`
	Counts     map[string]int64 `json:"counts"`
	Results    map[string]int64 `json:"results"`
	Drift      int64            `json:"drift"`
	Repaired   int64            `json:"repaired"`
	Skipped    int64            `json:"skipped"`
	Uncertain  int64            `json:"uncertain"`
	// Verified is set for a verifying pass: whether it recorded the
	// projection as complete.
	Verified *bool  `json:"verified,omitempty"`
	Error    string `json:"error,omitempty"`
}

// summarize turns a run's report into its JSON summary. errText is what
// the summary says of a failed run: the whole error for the reconcile
// command, a fixed sentence for the service's unauthenticated endpoints
// (a connection error names the host, database and user).
func summarize(r *reconcile.Report, err error, errText func(error) string) *reconcileSummary {
	sum := &reconcileSummary{Counts: map[string]int64{}, Results: map[string]int64{}}
	if err != nil {
		sum.Error = errText(err)
	}
	if r == nil {
		sum.Started = time.Now().UTC()
		return sum
	}
	sum.Started = r.Started.UTC()
	sum.DurationMS = float64(r.Duration) / float64(time.Millisecond)
	sum.Sampled, sum.DryRun = r.Sampled, r.DryRun
	sum.Checked, sum.Scanned = r.Checked, r.Scanned
	for c, n := range r.Counts {
		sum.Counts[c.String()] = n
	}
	for res, n := range r.Results {
		sum.Results[res.String()] = n
	}
	sum.Drift = r.Drift()
	sum.Repaired, sum.Skipped, sum.Uncertain = r.Repaired, r.Skipped, r.Uncertain
	return sum
}

// errNotVerified is what reconcile --verify returns when its pass ran but
// did not record the projection as verified (exit 3): the report, printed
// before, says what stood in the way.
var errNotVerified = errors.New("the projection was not verified")

// cmdReconcile runs one reconcile pass, full or sampled. With --verify, a
// pass that ran but recorded nothing returns errNotVerified.
func cmdReconcile(ctx context.Context, o *options, stdout, stderr io.Writer) error {
	d, err := opsDeps(ctx, o, stderr)
	if err != nil {
		return err
	}
	defer d.close()
	var (
		report   *reconcile.Report
		runErr   error
		verified bool
	)
	if o.verify {
		report, verified, runErr = d.board.Verify(ctx, nil)
	} else {
		rec, err := d.board.Reconciler(nil)
		if err != nil {
			return err
		}
		report, runErr = rec.Run(ctx, reconcile.RunOptions{Sample: o.sample, DryRun: o.dryRun})
	}
	sum := summarize(report, runErr, error.Error)
	if o.verify {
		sum.Verified = &verified
	}
	if runErr == nil && o.verify && !verified {
		runErr = errNotVerified
	}
	if o.json {
		if err := printJSON(stdout, sum); err != nil {
			return err
		}
		return runErr
	}
	mode := "full pass"
	if sum.Sampled {
		mode = fmt.Sprintf("sample of %d", o.sample)
	}
	if sum.DryRun {
		mode += ", dry run"
	}
	fmt.Fprintf(stdout, "reconcile %s (%s): %d checked in %s\n", d.board.Name(), mode, sum.Checked, humanDuration(time.Duration(sum.DurationMS*float64(time.Millisecond))))
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	for _, c := range []reconcile.Class{reconcile.ClassCurrent, reconcile.ClassMissing, reconcile.ClassStale, reconcile.ClassCorrupt, reconcile.ClassAhead, reconcile.ClassOrphan} {
		fmt.Fprintf(tw, "  %s\t%d\n", c, sum.Counts[c.String()])
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "drift %d: repaired %d, skipped %d, uncertain %d\n", sum.Drift, sum.Repaired, sum.Skipped, sum.Uncertain)
	if sum.Verified == nil && sum.Error != "" {
		// Read alone, "drift 0" would pass for a clean board.
		fmt.Fprintln(stdout, "FAILED: the pass did not finish; the counts above cover only what it checked (the error follows on stderr)")
	}
	if sum.Verified != nil {
		if *sum.Verified {
			fmt.Fprintln(stdout, "verified: the projection is recorded as complete")
		} else if sum.Error != "" {
			// The pass itself failed (Ctrl-C, an unreachable store): that,
			// on stderr, is what stood in the way, not its findings.
			fmt.Fprintln(stdout, "NOT verified: the pass failed (the error follows on stderr)")
		} else {
			if sum.Counts[reconcile.ClassAhead.String()]+sum.Counts[reconcile.ClassOrphan.String()] > 0 {
				// Running it again would find them again.
				fmt.Fprintln(stdout, "NOT verified: the pass left ahead or orphan entries in place (below)")
			} else {
				fmt.Fprintln(stdout, "NOT verified: the pass left findings unrepaired, or Redis lost the board's keys during it; run it again")
			}
		}
	}
	if len(sum.Results) > 0 {
		fmt.Fprintf(stdout, "results: %s\n", mapText(sum.Results))
	}
	if sum.Counts[reconcile.ClassAhead.String()]+sum.Counts[reconcile.ClassOrphan.String()] > 0 {
		fmt.Fprintln(stdout, "ahead and orphan entries are reported, not repaired: investigate, then 'leaderboard-service rebuild'")
	}
	return runErr
}

// rebuildJSON is the rebuild subcommand's report.
type rebuildJSON struct {
	Board      string    `json:"board"`
	Started    time.Time `json:"started"`
	DurationMS float64   `json:"duration_ms"`
	Rows       int64     `json:"rows"`
	Applied    int64     `json:"applied"`
	Kept       int64     `json:"kept"`
	Conflicts  int64     `json:"conflicts"`
	Switched   bool      `json:"switched"`
}

// cmdRebuild rebuilds the board's sorted set from PostgreSQL.
func cmdRebuild(ctx context.Context, o *options, stdout, stderr io.Writer) error {
	d, err := opsDeps(ctx, o, stderr)
	if err != nil {
		return err
	}
	defer d.close()
	rec, err := d.board.Reconciler(nil)
	if err != nil {
		return err
	}
	r, err := rec.Rebuild(ctx)
	if err != nil {
		return err
	}
	out := rebuildJSON{Board: d.board.Name(), Started: r.Started.UTC(),
		DurationMS: float64(r.Duration) / float64(time.Millisecond),
		Rows:       r.Rows, Applied: r.Applied, Kept: r.Kept, Conflicts: r.Conflicts, Switched: r.Switched}
	if o.json {
		return printJSON(stdout, out)
	}
	fmt.Fprintf(stdout, "rebuild %s: %d rows copied in %s (%d written, %d kept newer live writes, %d conflicts); switched: %t\n",
		out.Board, out.Rows, humanDuration(r.Duration), out.Applied, out.Kept, out.Conflicts, out.Switched)
	return nil
}

type replayJSON struct {
	Board  string `json:"board"`
	Stream string `json:"stream"`
	Moved  int64  `json:"moved"`
}

// cmdReplayDead moves the board's dead letters back into the outbox.
func cmdReplayDead(ctx context.Context, o *options, stdout, stderr io.Writer) error {
	d, err := opsDeps(ctx, o, stderr)
	if err != nil {
		return err
	}
	defer d.close()
	w, err := d.board.Worker(nil)
	if err != nil {
		return err
	}
	n, err := w.Relay().ReplayDead(ctx, outbox.ReplayFilter{Stream: d.board.Stream(), Limit: o.limit})
	if err != nil {
		return err
	}
	out := replayJSON{Board: d.board.Name(), Stream: d.board.Stream(), Moved: n}
	if o.json {
		return printJSON(stdout, out)
	}
	fmt.Fprintf(stdout, "replay-dead %s: moved %d dead letters of stream %q back to the outbox\n", out.Board, out.Moved, out.Stream)
	return nil
}

func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func humanDuration(d time.Duration) string {
	switch {
	case d == 0:
		return "0s"
	case d < time.Millisecond:
		return d.String()
	case d < time.Second:
		return d.Round(100 * time.Microsecond).String()
	default:
		return d.Round(time.Millisecond).String()
	}
}

func lagText(lag time.Duration) string {
	if lag < 0 {
		return "unknown"
	}
	return humanDuration(lag)
}

func projectedThroughText(f freshnessJSON) string {
	if f.ProjectedThrough == nil {
		return "projected-through unknown"
	}
	return "everything before " + f.ProjectedThrough.Format(time.RFC3339Nano) + " is visible"
}

func mapText(m map[string]int64) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return strings.Join(parts, ", ")
}
