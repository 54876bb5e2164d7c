package reconcile

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/verity-go/verity/internal/clusterpin"
	"github.com/verity-go/verity/internal/deps"
	"github.com/verity-go/verity/projection"
)

// RunOptions select what one Run does.
type RunOptions struct {
	// Sample, when positive, checks up to Sample source rows chosen by
	// Source.Sample instead of the whole source and, for collections, up to
	// Sample random versioned projection entries (HRANDFIELD) for orphans,
	// instead of scanning the projection. Memory is proportional to
	// Sample; keep samples small. At most SampleMax.
	Sample int
	// DryRun classifies and reports without writing anything; findings the
	// policy would repair get ResultDryRun. Hooks other than OnAlert are not
	// called.
	DryRun bool
}

// validate returns a *ConfigError naming the field of o that no run can
// take.
func (o RunOptions) validate() error {
	switch {
	case o.Sample > SampleMax:
		return &ConfigError{Field: "RunOptions.Sample", Reason: fmt.Sprintf("is %d; use at most %d (SampleMax), or 0 for a full run", o.Sample, SampleMax)}
	case o.Sample < 0:
		return &ConfigError{Field: "RunOptions.Sample", Reason: "must not be negative (0 runs a full pass)"}
	}
	return nil
}

// Reconciler compares a Source with a Redis projection and repairs drift.
// A Reconciler is safe for concurrent use, but two runs over the same
// projection only waste work.
type Reconciler struct {
	source        Source
	target        Target
	cfg           *Config
	gate          *projection.Gate
	repairScript  *redis.Script
	rebuildScript *redis.Script
	logger        *slog.Logger
	metrics       *reconcileMetrics // nil: no MeterProvider

	// The collection's keys (empty for documents): the value key, every
	// version key (one per bucket, or the one version hash), the layout
	// key, the unbucketed version hash (which a layout without buckets
	// uses, and whose presence marks a collection older than layout keys),
	// and the bucket count as the layout key stores it.
	valueKey, layoutKey, unbucketedKey, unbucketedShadowKey, layout string
	versionKeys                                                     []string
	buckets                                                         int

	// primary is set when the client may send read-only commands to
	// replicas (ReadOnly, RouteByLatency or RouteRandomly): the reconciler
	// then reads on the masters explicitly, since a replica's replication
	// lag would show as drift.
	primary *redis.ClusterClient
	// pinnedAddr is the address of the master collection reads were last
	// sent to: the node a MOVED reply came from, for awaitMove.
	pinnedAddr atomic.Pointer[string]
}

// New returns a Reconciler checking target against source. cfg may be nil.
func New(source Source, target Target, cfg *Config) (*Reconciler, error) {
	if deps.Missing(source) {
		return nil, &ConfigError{Field: "source", Reason: "must not be nil; use NewSQLSource"}
	}
	if err := target.validate(); err != nil {
		return nil, err
	}
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	// Rows read for another kind compare unequal (or equal by accident)
	// to every entry, and the repairs would write them: a hash source's
	// rows carry no score, so a sorted set would get 0 for every member.
	// An SQLSource not made by NewSQLSource has no kind; its calls refuse
	// it.
	if s, ok := source.(*SQLSource); ok && !s.unmade() && s.kind != target.Kind {
		return nil, &ConfigError{Field: "SQLSourceConfig.Kind", Reason: fmt.Sprintf("is %s but Target.Kind is %s: every entry would be compared with, and repaired to, a value read for the other kind; make the SQLSource with Kind %s and the ValueColumn holding that kind's value", s.kind, target.Kind, target.Kind)}
	}
	// Rebuild's switch and its clean-up check and move every version
	// bucket within RepairTimeout, however small PageSize is.
	if target.Kind != projection.KindDocument {
		if buckets := target.Keyspace.VersionBuckets(); cfg.RepairTimeout < time.Duration(buckets)*switchPerBucket {
			return nil, &ConfigError{Field: "Config.RepairTimeout", Reason: fmt.Sprintf("is %s, too short for Rebuild's switch of the %d version buckets of Target.Keyspace; use at least %s, or fewer buckets",
				cfg.RepairTimeout, buckets, time.Duration(buckets)*switchPerBucket)}
		}
	}
	// Refused now rather than by every full run, after its whole pass.
	if target.Kind == projection.KindDocument && !cfg.SkipOrphans && !scansDocuments(target.Client) {
		return nil, &ConfigError{Field: "Config.SkipOrphans", Reason: fmt.Sprintf("is false, but the orphan scan of documents SCANs every master, which it can do through a *redis.Client or *redis.ClusterClient, not a %T (Target.Client); set SkipOrphans (CheckKeys still looks for orphans among the keys it is given)", target.Client)}
	}
	metrics, err := newReconcileMetrics(cfg, target)
	if err != nil {
		return nil, fmt.Errorf("reconcile: %w", err)
	}
	r := &Reconciler{
		metrics:       metrics,
		source:        newSerialSource(source),
		target:        target,
		cfg:           cfg,
		gate:          projection.NewGate(target.Client, target.Keyspace),
		repairScript:  redis.NewScript(repairSource),
		rebuildScript: redis.NewScript(rebuildSource),
		// A process may reconcile several collections with one logger:
		// every line names its own.
		logger: cfg.Logger.With(slog.String("kind", target.Kind.String()), slog.String("collection", target.label())),
	}
	if target.Kind != projection.KindDocument {
		t := projection.Target{Kind: target.Kind, Name: target.Name}
		ks := target.Keyspace
		r.valueKey = ks.ValueKey(t)
		r.versionKeys = ks.VersionKeys(t.Name, t.Kind)
		r.layoutKey = ks.LayoutKey(t.Name, t.Kind)
		flat, _ := projection.NewKeyspace(ks.Prefix()) // ks's prefix is valid
		r.unbucketedKey = flat.VersionKeys(t.Name, t.Kind)[0]
		r.unbucketedShadowKey = flat.ShadowVersionKeys(t.Name, t.Kind)[0]
		r.buckets = ks.VersionBuckets()
		r.layout = strconv.Itoa(r.buckets)
	}
	r.primary = clusterpin.Client(target.Client)
	return r, nil
}

// unmade reports a Reconciler not made by New (a zero value, or nil),
// which has no source, target or configuration to run with.
func (r *Reconciler) unmade() bool { return r == nil || r.cfg == nil }

// errUnmade refuses a Reconciler not made by New.
func errUnmade() error {
	return &ConfigError{Field: "Reconciler", Reason: "has no source or target (a zero value, or nil); create it with New(source, target, cfg)"}
}

// collectionPipeline returns a pipeline for reading the collection's keys
// (all in one slot): on their master, after READWRITE (clusterpin.Pipeline),
// when the client could read from a replica; through the target's client
// otherwise.
func (r *Reconciler) collectionPipeline(ctx context.Context) (redis.Pipeliner, error) {
	pipeline, err := r.collectionPipelines(ctx)
	if err != nil {
		return nil, err
	}
	return pipeline(), nil
}

// collectionPipelines returns a function that makes collection pipelines
// (see collectionPipeline) all on the same node: a SCAN cursor means
// nothing on another one.
func (r *Reconciler) collectionPipelines(ctx context.Context) (func() redis.Pipeliner, error) {
	if r.primary == nil {
		return r.target.Client.Pipeline, nil
	}
	node, err := r.primary.MasterForKey(ctx, r.valueKey)
	if err != nil {
		return nil, err
	}
	addr := node.Options().Addr
	r.pinnedAddr.Store(&addr)
	return func() redis.Pipeliner { return clusterpin.Pipeline(ctx, r.primary, node) }, nil
}

// redirectError names a key of the slot a MOVED or ASK reply was about
// (documents span many slots), so that Run can wait for the client's slot
// map to catch up with it.
type redirectError struct {
	key  string
	node string // the address of the node that answered
	err  error
}

func (e *redirectError) Error() string { return e.err.Error() }
func (e *redirectError) Unwrap() error { return e.err }

// awaitMove waits until the client's slot map names, for the slot a MOVED
// reply in err was about, the master the reply named or any master but the
// one that answered (clusterpin.AwaitMaster). It returns an error when it
// cannot: no MOVED reply, no key known for its slot, or a map that does
// not catch up.
func (r *Reconciler) awaitMove(ctx context.Context, err error) error {
	addr, ok := redis.IsMovedError(err)
	if !ok {
		return err
	}
	// The node that answered: any other master the map names will do
	// (go-redis may name nodes differently from the reply).
	key, stale := r.valueKey, ""
	if p := r.pinnedAddr.Load(); p != nil {
		stale = *p
	}
	if re := (*redirectError)(nil); errors.As(err, &re) {
		key, stale = re.key, re.node
	}
	if key == "" {
		return err
	}
	if _, werr := clusterpin.AwaitMaster(ctx, r.primary, key, addr, stale); werr != nil {
		return fmt.Errorf("%w (after %w)", werr, err)
	}
	return nil
}

// Run compares the source with the projection, page by page, repairs what
// the policy allows, and returns a Report.
//
// A full run (opts.Sample == 0) walks the whole source by keyset pagination
// and then, unless Config.SkipOrphans, scans the projection for orphans. A
// sampled run checks opts.Sample random rows.
//
// When ctx is cancelled, or anything fails, Run stops and returns the
// Report so far together with the error. No repair goes unreported (those
// of a pass that met a slot move and was run again included): a
// batch of repairs already sent is allowed to finish (bounded by
// Config.RepairTimeout) and counted; findings whose repair was not sent are
// ResultNotAttempted; a repair that may or may not have been applied is
// ResultUncertain.
//
// A repair refused because a key it needs holds another Redis type (see
// WrongKeyTypeError) does not stop the run: its finding is
// ResultNotAttempted, nothing was written for it, and Run returns the
// refusals, joined, with the whole pass's Report.
func (r *Reconciler) Run(ctx context.Context, opts RunOptions) (*Report, error) {
	if r.unmade() {
		return newReport(opts), errUnmade()
	}
	if err := opts.validate(); err != nil {
		// The caller's mistake, found before anything is read: no run,
		// so nothing logged or counted (runs{outcome=error} is for
		// passes that failed).
		return newReport(opts), err
	}
	rep, err := r.run(ctx, opts)
	// A read pinned to a master met a slot move the client's map had not
	// caught up with (a failover, a resharding): the master's own
	// connection does not follow redirects. Once the reloaded map names
	// another master, run again, still on masters; repairs are
	// compare-and-set, so running again is safe. Again while runs meet
	// MOVED, for clusterpin.AwaitTimeout: a map reloaded mid-move may name
	// a node that does not own the slot either. A slot in the middle of a
	// migration (ASK) fails the run: the next one covers it.
	for deadline := time.Now().Add(clusterpin.AwaitTimeout); r.primary != nil && clusterpin.IsRedirect(err); {
		if werr := r.awaitMove(ctx, err); werr != nil || !time.Now().Before(deadline) {
			err = cmp.Or(werr, err)
			break
		}
		r.logger.Warn("reconcile: a slot moved during the run; running it again on the new master", slog.Any("error", err))
		earlier := rep
		rep, err = r.run(ctx, opts)
		rep.carry(earlier, r.cfg.ExamplesPerClass)
	}
	r.reloadIfUnreachable(ctx, err)
	// Refused repairs did not stop the run; it reports them now.
	err = errors.Join(append([]error{err}, rep.refused...)...)
	r.logFinished(ctx, "reconcile run finished", err,
		slog.Int64("checked", rep.Checked), slog.Int64("drift", rep.Drift()),
		slog.Int64("repaired", rep.Repaired), slog.Int64("skipped", rep.Skipped),
		slog.Int64("uncertain", rep.Uncertain), slog.Duration("duration", rep.Duration))
	mode := modeFull
	if opts.Sample > 0 {
		mode = modeSample
	}
	r.metrics.recordRun(ctx, mode, rep, err)
	return rep, err
}

// frozenSource is a Source that can tell whether it reads one snapshot for
// a whole pass (SQLSource through a REPEATABLE READ or SERIALIZABLE
// transaction), whose lookups cannot confirm a finding.
type frozenSource interface {
	frozenSnapshot(ctx context.Context) (bool, error)
}

// refuseForcedRepairsOfFrozenSource refuses a run that may repair missing,
// corrupt, ahead or orphan entries through a source that reads one
// snapshot for the whole pass: its lookups cannot confirm ahead and orphan
// findings, and a missing entry (a key Redis lost) or a corrupt one (a
// value whose version Redis lost) would be written back at the snapshot's
// version, older than one committed and projected since.
func (r *Reconciler) refuseForcedRepairsOfFrozenSource(ctx context.Context, opts RunOptions) error {
	// Corrupt too: a value whose version Redis lost (an evicted version
	// key) reads as corrupt, and would be written back at the snapshot's
	// older version as a lost key would.
	if opts.DryRun || (r.cfg.Policy.For(ClassMissing) != ActionRepair && r.cfg.Policy.For(ClassCorrupt) != ActionRepair && r.cfg.Policy.For(ClassAhead) != ActionRepair && r.cfg.Policy.For(ClassOrphan) != ActionRepair) {
		return nil
	}
	return r.refuseFrozenSource(ctx, "a run (Run or CheckKeys) cannot repair missing, corrupt, ahead or orphan entries (Config.Policy) through it: a write committed and projected after its snapshot would be taken for drift, and its newer version taken back (a lost key rewritten at the snapshot's older version) or its new entity deleted; give NewSQLSource a pool, run with DryRun, or set Policy.Missing, Policy.Corrupt, Policy.Ahead and Policy.Orphan to report")
}

// refuseFrozenSource returns a *ConfigError saying why (what cannot be
// done) when r's source reads one snapshot for a whole pass.
func (r *Reconciler) refuseFrozenSource(ctx context.Context, why string) error {
	fs, ok := r.source.(frozenSource)
	if !ok {
		return nil
	}
	frozen, err := fs.frozenSnapshot(ctx)
	if err != nil {
		return err
	}
	if frozen {
		return &ConfigError{Field: "source", Reason: "reads through a REPEATABLE READ or SERIALIZABLE transaction, one snapshot for the whole pass; " + why}
	}
	return nil
}

// reloadIfUnreachable has a Redis Cluster client reload its slot map when
// err, which ended a run or a rebuild, says a node could not be reached
// (clusterpin.ReloadIfUnreachable). go-redis reloads it on redirects and
// every ClusterStateReloadInterval only: after a master died and a replica
// took over, every run would otherwise fail until then, up to a minute.
// The failed run is not retried; the next one reaches the new master.
func (r *Reconciler) reloadIfUnreachable(ctx context.Context, err error) {
	clusterpin.ReloadIfUnreachable(ctx, r.target.Client, err)
}

// logFinished logs the line that ends a run or a rebuild: at Info, or at
// Warn with its error when err is not nil.
func (r *Reconciler) logFinished(ctx context.Context, msg string, err error, attrs ...slog.Attr) {
	level := slog.LevelInfo
	if err != nil {
		level = slog.LevelWarn
		attrs = append(attrs, slog.Any("error", err))
	}
	r.logger.LogAttrs(ctx, level, msg, attrs...)
}

// run is one pass of Run.
func (r *Reconciler) run(ctx context.Context, opts RunOptions) (*Report, error) {
	rep := newReport(opts)
	err := r.refuseForcedRepairsOfFrozenSource(ctx, opts)
	switch {
	case err != nil:
	case opts.Sample > 0:
		err = r.runSample(ctx, opts, rep)
	default:
		err = r.runFull(ctx, opts, rep)
	}
	rep.Duration = time.Since(rep.Started)
	return rep, err
}

func (r *Reconciler) runSample(ctx context.Context, opts RunOptions, rep *Report) error {
	rows, err := r.source.Sample(ctx, opts.Sample)
	if err != nil {
		return wrap("sampling source", err)
	}
	// A Source may sample with replacement: each entity is checked (and
	// counted, and repaired) once, from a slice of the run's own (the
	// Source's is left as it returned it).
	seen := make(map[string]struct{}, len(rows))
	unique := make([]Row, 0, len(rows))
	for _, row := range rows {
		if _, dup := seen[row.Key]; !dup {
			seen[row.Key] = struct{}{}
			unique = append(unique, row)
		}
	}
	rows = unique
	for len(rows) > 0 {
		n := min(len(rows), r.cfg.PageSize)
		if err := r.checkRows(ctx, opts, rows[:n], rep); err != nil {
			return err
		}
		rows = rows[n:]
	}
	if r.cfg.SkipOrphans || r.target.Kind == projection.KindDocument {
		return nil
	}
	members, err := r.sampleVersioned(ctx, opts.Sample)
	if err != nil {
		return err
	}
	for len(members) > 0 {
		n := min(len(members), r.cfg.PageSize)
		if err := r.checkCandidates(ctx, opts, members[:n], false, rep); err != nil {
			return err
		}
		members = members[n:]
	}
	return nil
}

// page is one source page, with what the projection held for its rows,
// handed from the read-ahead pipeline to the checker.
type page struct {
	rows      []Row
	projected []Projected
	err       error
}

func (r *Reconciler) runFull(ctx context.Context, opts RunOptions, rep *Report) error {
	pages, stop := r.pages(ctx, true)
	defer stop()
	for p := range pages {
		if p.err != nil {
			return p.err
		}
		if err := r.checkRead(ctx, opts, p.rows, p.projected, rep); err != nil {
			return err
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if r.cfg.SkipOrphans {
		return nil
	}
	if none, err := r.noOrphans(ctx, rep); err != nil || none {
		rep.OrphanScanSkipped = none
		return err
	}
	return r.scanOrphans(ctx, opts, rep)
}

// pages runs the full pass's read-ahead pipeline: one goroutine walks the
// source by keyset pagination, taking one of Config.ReadAhead slots before
// it reads each page and starting the page's projection read as soon as
// the rows arrive, while the caller classifies and repairs an earlier
// page. The page the caller holds keeps its slot until the caller asks for
// the next one, so up to ReadAhead pages are read, counting the one being
// classified, and at most ReadAhead pages are in memory; with ReadAhead 1
// the next page is read only once the previous one is settled.
//
// Taking the slot before the source read keeps each page's source and
// projection reads close together. A page read from the source and then
// left waiting for a slot would be compared with a projection that has
// moved on meanwhile, and every newer write projected in between would
// look ahead (checkRead looks ahead findings up again, but should seldom
// need to).
//
// Pages come out in source order; the sequence ends after the last page or
// after a page carrying an error. It ends without an error only once the
// source has returned an empty page: a walk cut short by ctx ends with a
// page carrying ctx's error, so that no caller can take a cancelled walk
// for a complete one (a rebuild would switch a partial copy over the live
// projection, a pass would scan for orphans against half the source).
// Without readProjection (a rebuild writes
// pages, it does not compare them), pages are delivered as the source
// returns them, one read ahead of the one the caller holds. stop must be
// called; it returns once every goroutine has exited.
//
// Reading a page before the pages ahead of it are repaired is safe: pages
// hold disjoint keys, and a repair touches only its own page's keys.
func (r *Reconciler) pages(ctx context.Context, readProjection bool) (iter.Seq[page], func()) {
	fetchCtx, cancel := context.WithCancel(ctx)
	n := r.cfg.ReadAhead
	if !readProjection {
		n = 2
	}
	slots := make(chan struct{}, n)
	// One future per slot taken, so the walk never blocks on sending one.
	out := make(chan chan page, n)
	var wg sync.WaitGroup
	// cut is written before out is closed and read after: set when the walk
	// stopped for ctx before the source's end, without a page to say so.
	var cut bool
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(out)
		var cursor Cursor
		for {
			select {
			case slots <- struct{}{}:
			case <-fetchCtx.Done():
				cut = true
				return
			}
			p := page{}
			p.rows, p.err = r.source.Page(fetchCtx, cursor, r.cfg.PageSize)
			if p.err != nil {
				p.err = wrap("reading source page", p.err)
			} else if len(p.rows) == 0 {
				return
			} else {
				last := p.rows[len(p.rows)-1].Key
				if k, ok := cursor.Key(); ok && k == last {
					p.err = fmt.Errorf("reconcile: source returned key %q again; Page must return keys after the cursor", last)
				}
				cursor = After(last)
			}
			done := make(chan page, 1) // never blocks the reader below
			out <- done
			if p.err != nil || !readProjection {
				done <- p
				if p.err != nil {
					return
				}
				continue
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				p.projected, p.err = r.readRows(fetchCtx, p.rows)
				done <- p
			}()
		}
	}()
	seq := func(yield func(page) bool) {
		for done := range out {
			if !yield(<-done) {
				return
			}
			<-slots // the caller is done with the page: its slot is free
		}
		if cut {
			yield(page{err: fetchCtx.Err()})
		}
	}
	return seq, func() {
		cancel()
		wg.Wait()
	}
}

// checkRows reads the projection for rows, classifies, repairs and records.
func (r *Reconciler) checkRows(ctx context.Context, opts RunOptions, rows []Row, rep *Report) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	projected, err := r.readRows(ctx, rows)
	if err != nil {
		return err
	}
	return r.checkRead(ctx, opts, rows, projected, rep)
}

// readRows validates rows and reads what the projection holds for them.
func (r *Reconciler) readRows(ctx context.Context, rows []Row) ([]Projected, error) {
	keys := make([]string, len(rows))
	for i := range rows {
		if err := r.validateRow(&rows[i]); err != nil {
			return nil, err
		}
		keys[i] = rows[i].Key
	}
	return r.read(ctx, keys)
}

// checkRead classifies rows against what was read for them, repairs and
// records.
func (r *Reconciler) checkRead(ctx context.Context, opts RunOptions, rows []Row, projected []Projected, rep *Report) error {
	findings, current, err := r.classifyRead(ctx, rows, projected)
	if err != nil {
		// The page is not counted at all: neither its rows as checked
		// nor its current entities.
		return err
	}
	for _, i := range current {
		rep.Counts[ClassCurrent]++
		rep.tally.addAsRead(&projected[i])
	}
	return r.settleFindings(ctx, opts, findings, len(rows), rep)
}

// classifyRead classifies rows against what was read for them and
// rechecks the findings a write racing the read can fake. It returns the
// drift, and the indices of the rows found current.
func (r *Reconciler) classifyRead(ctx context.Context, rows []Row, projected []Projected) (findings []Finding, current []int, err error) {
	if err := ctx.Err(); err != nil {
		return nil, nil, err
	}
	// Current rows, nearly all of them in a healthy pass, are counted
	// by the caller; only drift becomes a Finding (a pass used to
	// allocate one per row).
	for i := range rows {
		class := Classify(r.target.Kind, &rows[i], projected[i])
		if class == ClassCurrent {
			current = append(current, i)
			continue
		}
		findings = append(findings, Finding{Class: class, Key: rows[i].Key, Source: &rows[i], Projected: projected[i]})
	}
	if err := r.recheck(ctx, findings); err != nil {
		return nil, nil, err
	}
	return findings, current, nil
}

// leftAsFound reports a result after which a missing or stale entry holds
// its row's state (repaired) or what the pass read (nothing was sent).
func leftAsFound(res Result) bool {
	return res == ResultRepaired || res == ResultDryRun || res == ResultReported || res == ResultVetoed
}

// settleFindings counts checked source rows as checked, settles findings and
// records them in rep.
func (r *Reconciler) settleFindings(ctx context.Context, opts RunOptions, findings []Finding, checked int, rep *Report) error {
	rep.Checked += int64(checked)
	rep.examined += int64(checked)
	err := r.settle(ctx, opts, findings, rep)
	for i := range findings {
		f := &findings[i]
		rep.tally.add(f)
		if f.Class != ClassMissing && f.Class != ClassStale || !leftAsFound(f.Result) {
			// checkFound must not count it again. (A missing or stale
			// entry repaired holds its row's state, and one left as it
			// was found, in a dry run say, is still missing or stale:
			// checkFound leaves both, so a pass over a whole lost Redis
			// keeps none, and memory stays bounded by the pages.)
			if rep.drifted == nil {
				rep.drifted = make(map[string]struct{})
			}
			rep.drifted[f.Key] = struct{}{}
		}
		// An ahead entry whose row was deleted meanwhile, left as it was
		// read: the orphan scan will meet it again and must not count it
		// twice. One the run removed is the scan's to count if it is
		// there again (a relay may have written the row's last record
		// back).
		if f.Class == ClassOrphan {
			switch f.Result {
			case ResultReported, ResultDryRun, ResultVetoed, ResultNotAttempted, ResultRaced:
				// NotAttempted: its removal was refused (a key of
				// another type) with nothing written. Raced: it changed
				// before its removal, which is left to the next run.
				rep.noteOrphan(f.Key)
			}
		}
	}
	return err
}

// recheckRounds bounds recheck's alternation between re-reading the
// projection and looking rows up in the source again. Two rounds settle an
// entry that one write made look ahead and then corrupt; each further
// change needs yet another write to land inside the re-read.
const recheckRounds = 3

// recheck looks again at the findings a write racing the pass can fake,
// before anyone is alerted or anything is repaired: corrupt findings are
// read from the projection again (recheckTorn) and ahead ones looked up in
// the source again (recheckAhead). Either can turn a finding into the
// other's class — a torn read of a row that was written meanwhile looks
// ahead, and against the row looked up again it looks corrupt — so a
// finding that changes class that way is looked at again, up to
// recheckRounds times.
func (r *Reconciler) recheck(ctx context.Context, findings []Finding) error {
	torn, ahead := indicesOf(findings, ClassCorrupt), indicesOf(findings, ClassAhead)
	for range recheckRounds {
		if len(torn)+len(ahead) == 0 {
			return nil
		}
		becameAhead, err := r.recheckTorn(ctx, findings, torn)
		if err != nil {
			return err
		}
		if torn, err = r.recheckAhead(ctx, findings, append(ahead, becameAhead...)); err != nil {
			return err
		}
		ahead = nil
	}
	return nil
}

// recheckTorn reads the projection again for findings[i], i in idx, all
// corrupt, and returns the indices of those the fresh read found ahead. A
// collection's values and versions are read by two commands of one
// pipeline, not atomically: a gate write landing between them pairs the
// old value with the new version, which looks corrupt or ahead (a
// document's value and version come from one MGET). An entry read the same
// way twice is corrupt; one that changed meanwhile is classified by the
// fresh read, which any repair then insists on. Healthy pages cost nothing
// more.
func (r *Reconciler) recheckTorn(ctx context.Context, findings []Finding, idx []int) (becameAhead []int, err error) {
	if r.target.Kind == projection.KindDocument || len(idx) == 0 {
		return nil, nil
	}
	keys := make([]string, len(idx))
	for j, i := range idx {
		keys[j] = findings[i].Key
	}
	fresh, err := r.read(ctx, keys)
	if err != nil {
		return nil, err
	}
	for j, i := range idx {
		f := &findings[i]
		if p := fresh[j]; !sameProjected(f.Projected, p) {
			f.Projected = p
			if f.Class = Classify(r.target.Kind, f.Source, p); f.Class == ClassAhead {
				becameAhead = append(becameAhead, i)
			}
		}
	}
	return becameAhead, nil
}

// indicesOf returns the indices of the findings of class c, in order.
func indicesOf(findings []Finding, c Class) []int {
	var idx []int
	for i := range findings {
		if findings[i].Class == c {
			idx = append(idx, i)
		}
	}
	return idx
}

// sameProjected reports whether two reads of an entry found the same state.
func sameProjected(a, b Projected) bool {
	return a.HasValue == b.HasValue && a.Score == b.Score && bytes.Equal(a.Data, b.Data) &&
		a.HasVersion == b.HasVersion && a.RawVersion == b.RawVersion
}

// recheckAhead looks the keys of findings[i], i in idx, all ahead, up in
// the source again, classifies them against the fresh rows, and returns the
// indices of those now corrupt. Rows are read from the source before the
// projection, so a write committed and projected in between makes the
// projection look ahead of a row that was merely old. The fresh lookup
// comes after the projection read: a version still ahead of it was
// projected before the source lost it, which is real drift. A finding can
// so become current, stale, corrupt, or an orphan (the row was deleted
// meanwhile; see checkRead); it keeps the projected state that was read,
// which any repair then insists on.
func (r *Reconciler) recheckAhead(ctx context.Context, findings []Finding, idx []int) (becameCorrupt []int, err error) {
	if len(idx) == 0 {
		return nil, nil
	}
	keys := make([]string, len(idx))
	for j, i := range idx {
		keys[j] = findings[i].Key
	}
	rows, err := r.source.Lookup(ctx, keys)
	if err != nil {
		return nil, wrap("looking up ahead entries in the source again", err)
	}
	fresh := make(map[string]*Row, len(rows))
	for i := range rows {
		if err := r.validateRow(&rows[i]); err != nil {
			return nil, err
		}
		fresh[rows[i].Key] = &rows[i]
	}
	for _, i := range idx {
		f := &findings[i]
		f.Source = fresh[f.Key] // nil: deleted from the source since
		if f.Class = Classify(r.target.Kind, f.Source, f.Projected); f.Class == ClassCorrupt {
			becameCorrupt = append(becameCorrupt, i)
		}
	}
	return becameCorrupt, nil
}

// validateRow refuses, before anything is read or written, a row from any
// Source that the projection could not hold.
func (r *Reconciler) validateRow(row *Row) error {
	if row.Version <= 0 {
		return &InvalidRowError{Key: row.Key, Reason: fmt.Sprintf("version %d is not positive", row.Version)}
	}
	if r.target.Kind == projection.KindSortedSet && (row.Value.Score < projection.MinScore || row.Value.Score > projection.MaxScore) {
		return &InvalidRowError{Key: row.Key, Reason: fmt.Sprintf("score %d outside ±2^53", row.Value.Score)}
	}
	if err := r.checkKeySize(row.Key); err != nil {
		return err
	}
	if n := len(row.Value.Data); r.target.Kind != projection.KindSortedSet && n > r.cfg.MaxValueBytes {
		return &InvalidRowError{Key: row.Key, Reason: fmt.Sprintf("value is %d bytes, over Config.MaxValueBytes (%d)", n, r.cfg.MaxValueBytes)}
	}
	return nil
}

// checkKeySize refuses a key longer than Config.MaxValueBytes, or, for a
// document, one whose keys are: Redis receives it as a member, a hash field
// or inside a document's keys, and closes the connection on a string over
// its bulk limit.
func (r *Reconciler) checkKeySize(key string) error {
	if n := len(key); n > r.cfg.MaxValueBytes {
		return &InvalidRowError{Key: key[:min(n, 64)], Reason: fmt.Sprintf("key is %d bytes (quoted up to 64), over Config.MaxValueBytes (%d)", n, r.cfg.MaxValueBytes)}
	}
	if r.target.Kind == projection.KindDocument {
		// Measured as the projection measures a document's name, so that
		// a row it would refuse is refused here too.
		if n := r.target.Keyspace.MaxKeyLen(r.target.Namespace + key); n > r.cfg.MaxValueBytes {
			return &InvalidRowError{Key: key[:min(len(key), 64)], Reason: fmt.Sprintf("document keys are up to %d bytes for a key of %d (quoted up to 64), over Config.MaxValueBytes (%d)", n, len(key), r.cfg.MaxValueBytes)}
		}
	}
	return nil
}

// settle applies the policy and hooks to findings, sends the repairs, and
// records every finding in the report, whatever happens.
func (r *Reconciler) settle(ctx context.Context, opts RunOptions, findings []Finding, rep *Report) error {
	var viaGate, viaCAS []*Finding
	refusedBefore := len(rep.refused)
	defer func() {
		var refusals map[string]error
		for _, err := range rep.refused[refusedBefore:] {
			var wrong *WrongKeyTypeError
			if errors.As(err, &wrong) {
				if refusals == nil {
					refusals = make(map[string]error)
				}
				refusals[wrong.Key] = err
			}
		}
		for i := range findings {
			f := &findings[i]
			rep.record(f, r.cfg.ExamplesPerClass)
			if refusal := refusals[f.Key]; refusal != nil || f.Result == ResultUncertain {
				rep.unsettled = append(rep.unsettled, unsettled{at: rep.examined, class: f.Class, result: f.Result, refusal: refusal})
			}
		}
	}()

	for i := range findings {
		f := &findings[i]
		if f.Class == ClassCurrent {
			continue
		}
		if (f.Class == ClassAhead || f.Class == ClassOrphan) && r.cfg.OnAlert != nil {
			r.cfg.OnAlert(ctx, *f)
		}
		switch {
		case r.cfg.Policy.For(f.Class) != ActionRepair:
			f.Result = ResultReported
		case opts.DryRun:
			f.Result = ResultDryRun
		case r.cfg.BeforeRepair != nil && !r.cfg.BeforeRepair(ctx, *f):
			f.Result = ResultVetoed
		case f.Class == ClassMissing || f.Class == ClassStale:
			f.Result = ResultNotAttempted // until the repair's outcome is known
			viaGate = append(viaGate, f)
		default:
			f.Result = ResultNotAttempted
			viaCAS = append(viaCAS, f)
		}
	}
	if len(viaGate)+len(viaCAS) == 0 {
		return nil
	}
	// Last point at which cancellation stops repairs: after it, the batch
	// is sent on a detached context so its outcome is always learnt.
	if err := ctx.Err(); err != nil {
		return err
	}
	repairCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.RepairTimeout)
	defer cancel()
	refused, errGate := r.gateRepair(repairCtx, viaGate)
	rep.refused = append(rep.refused, refused...)
	// Cancelled while the gate repairs were in flight: the
	// compare-and-set repairs have not been sent, and are not.
	errCAS := ctx.Err()
	if errCAS != nil {
		viaCAS = nil // they stay ResultNotAttempted
	} else {
		refused, errCAS = r.casRepair(repairCtx, viaCAS)
		rep.refused = append(rep.refused, refused...)
		errCAS = errors.Join(errCAS, r.deliverAfterTakingBack(repairCtx, viaCAS))
	}
	if r.cfg.AfterRepair != nil {
		for _, f := range append(viaGate, viaCAS...) {
			r.cfg.AfterRepair(ctx, *f)
		}
	}
	return errors.Join(errGate, errCAS)
}

// deliverAfterTakingBack looks the ahead and orphan entries the repairs
// took back (or removed) up in the source once more, and writes what it
// holds through the gate. A write committed after the confirming lookup
// was delivered against the entry's higher version and refused as stale,
// its outbox record then gone: without this, the repair's older state
// would stand, behind the source with nothing to correct it (after a
// PostgreSQL that went back, every new write of such an entity meets
// this). The gate applies only a version newer than the repair's, so a
// write delivered after the repair wins as always.
func (r *Reconciler) deliverAfterTakingBack(ctx context.Context, fs []*Finding) error {
	var keys []string
	for _, f := range fs {
		if f.Result == ResultRepaired && (f.Class == ClassAhead || f.Class == ClassOrphan) {
			keys = append(keys, f.Key)
		}
	}
	if len(keys) == 0 {
		return nil
	}
	rows, err := r.source.Lookup(ctx, keys)
	if err != nil {
		return fmt.Errorf("reconcile: looking up %d entries taken back, for writes committed meanwhile: %w", len(keys), err)
	}
	var writes []projection.Write
	found, _ := rowsAsked(keys, rows)
	for _, row := range found {
		if err := r.validateRow(&row); err != nil {
			return err
		}
		writes = append(writes, projection.Write{Target: r.target.target(row.Key), Version: row.Version, Value: row.Value})
	}
	if len(writes) == 0 {
		return nil
	}
	if _, err := r.gate.Apply(ctx, writes); err != nil {
		return fmt.Errorf("reconcile: writing %d entries taken back, as the source now holds them: %w", len(writes), err)
	}
	return nil
}

// CheckKeys reconciles only the given keys, with the same policy, hooks and
// report as Run: keys the source has are compared with the projection, and
// keys it lacks are checked for orphans. Use it to verify entities on
// demand (before paying out a leaderboard prize, after an incident report)
// without a full pass. opts.Sample is ignored. A key longer than
// Config.MaxValueBytes (for a document, one whose keys are) is refused with
// *InvalidRowError before anything is read, whether or not the source has
// it: Redis would close the connection on it.
func (r *Reconciler) CheckKeys(ctx context.Context, keys []string, opts RunOptions) (*Report, error) {
	opts.Sample = 0
	rep := newReport(opts)
	if r.unmade() {
		return rep, errUnmade()
	}
	keys = dedupe(append([]string(nil), keys...))
	// Refused as Run refuses it: through one snapshot, a key written and
	// projected since reads as ahead (its new version would be taken back)
	// or, if new, as an orphan (deleted).
	var err error
	for _, k := range keys {
		if err = r.checkKeySize(k); err != nil {
			break
		}
	}
	if err == nil {
		err = r.refuseForcedRepairsOfFrozenSource(ctx, opts)
	}
	if err == nil {
		err = r.checkKeys(ctx, opts, keys, rep)
	}
	// A read pinned to a master met a slot move: as Run does, wait for the
	// reloaded map to name the new master and check the keys again there.
	for deadline := time.Now().Add(clusterpin.AwaitTimeout); r.primary != nil && clusterpin.IsRedirect(err); {
		if werr := r.awaitMove(ctx, err); werr != nil || !time.Now().Before(deadline) {
			err = cmp.Or(werr, err)
			break
		}
		earlier := rep
		rep = newReport(opts)
		err = r.checkKeys(ctx, opts, keys, rep)
		rep.carry(earlier, r.cfg.ExamplesPerClass)
	}
	r.reloadIfUnreachable(ctx, err)
	err = errors.Join(append([]error{err}, rep.refused...)...)
	rep.Duration = time.Since(rep.Started)
	r.logFinished(ctx, "reconcile check of keys finished", err,
		slog.Int("keys", len(keys)), slog.Int64("checked", rep.Checked), slog.Int64("drift", rep.Drift()),
		slog.Int64("repaired", rep.Repaired), slog.Int64("skipped", rep.Skipped),
		slog.Int64("uncertain", rep.Uncertain), slog.Duration("duration", rep.Duration))
	r.metrics.recordRun(ctx, modeKeys, rep, err)
	return rep, err
}

// checkKeys reads the projection for each batch before it looks the batch
// up in the source, for the reason checkCandidates gives.
func (r *Reconciler) checkKeys(ctx context.Context, opts RunOptions, keys []string, rep *Report) error {
	for len(keys) > 0 {
		batch := keys[:min(len(keys), r.cfg.PageSize)]
		keys = keys[len(batch):]
		if err := ctx.Err(); err != nil {
			return err
		}
		projected, err := r.read(ctx, batch)
		if err != nil {
			return err
		}
		found, err := r.source.Lookup(ctx, batch)
		if err != nil {
			return wrap("looking up keys in the source", err)
		}
		index := make(map[string]int, len(batch))
		for i, k := range batch {
			index[k] = i
		}
		var (
			rows     []Row
			rowsRead []Projected
		)
		for _, row := range found {
			// Rows not asked about (or repeated) break the Lookup
			// contract; they are left alone, as in the orphan check.
			if i, ok := index[row.Key]; ok {
				if err := r.validateRow(&row); err != nil {
					return err
				}
				rows = append(rows, row)
				rowsRead = append(rowsRead, projected[i])
				delete(index, row.Key)
			}
		}
		if err := r.checkRead(ctx, opts, rows, rowsRead, rep); err != nil {
			return err
		}
		var (
			absent     []string
			absentRead []Projected
		)
		for _, k := range batch {
			if i, ok := index[k]; ok {
				absent = append(absent, k)
				absentRead = append(absentRead, projected[i])
			}
		}
		if err := r.checkAbsent(ctx, opts, absent, absentRead, rep); err != nil {
			return err
		}
	}
	return nil
}

// sampleVersioned returns up to n random members that have a version.
// Orphans are sampled from the projection's side: HRANDFIELD returns
// distinct entries of one hash, uniformly. With version buckets, n draws of
// a random bucket decide how many entries each bucket gives (pipelined), so
// a member's chance is uniform only as far as buckets are equally full —
// which hashing makes them, roughly.
//
// The collection's layout is checked in the same pipeline: the members'
// reads check it too, but a sample can find no member at all in the
// version keys of a layout the collection is not stored in.
func (r *Reconciler) sampleVersioned(ctx context.Context, n int) ([]string, error) {
	pipe, err := r.collectionPipeline(ctx)
	if err != nil {
		return nil, fmt.Errorf("reconcile: sampling projection: %w", err)
	}
	checkLayout := r.queueLayout(ctx, pipe)
	var cmds []*redis.StringSliceCmd
	if r.buckets == 0 {
		cmds = append(cmds, pipe.HRandField(ctx, r.versionKeys[0], n))
	} else {
		draws := make(map[int]int)
		for range n {
			draws[rand.IntN(r.buckets)]++
		}
		for b, k := range draws {
			cmds = append(cmds, pipe.HRandField(ctx, r.versionKeys[b], k))
		}
	}
	_, _ = pipe.Exec(ctx) // errors are inspected per command below
	if err := checkLayout(); err != nil {
		return nil, err
	}
	var members []string
	for _, c := range cmds {
		got, err := c.Result()
		if err != nil {
			return nil, fmt.Errorf("reconcile: sampling projection: %w", err)
		}
		members = append(members, got...)
	}
	return members, nil
}
