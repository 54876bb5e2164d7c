package reconcile

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Result says what a run did about one finding.
type Result uint8

const (
	// ResultNone means there was nothing to do (the entity is current).
	ResultNone Result = iota
	// ResultRepaired means the repair was written.
	ResultRepaired
	// ResultReported means the policy for the class is to report only (the
	// default for ahead and orphan).
	ResultReported
	// ResultDryRun means the repair would have been written, but the run was a
	// dry run.
	ResultDryRun
	// ResultVetoed means Config.BeforeRepair returned false.
	ResultVetoed
	// ResultRaced means the projection changed between the read and the repair
	// (typically a newer gate write), so the compare-and-set declined to
	// overwrite it. The newer state is kept; the next run checks it again. A
	// repair the Redis client resent after Redis ran it (its reply lost to a
	// dropped connection) is reported so too: the resend finds the repaired
	// state and declines.
	ResultRaced
	// ResultNotAttempted means nothing was written for this finding. The run
	// stopped (context cancelled or an error) before its repair was sent; or
	// Redis refused the repair whole, with nothing written (an OOM error from
	// a Redis at maxmemory with the noeviction policy, or TRYAGAIN from a
	// Redis Cluster slot being migrated: Run returns it; rarely, a TRYAGAIN
	// answers the client's resend of a repair Redis had run, its reply lost
	// to a connection dropped during the migration, and that one was
	// applied); or the
	// repair was refused because a key it needs holds another Redis type (a
	// hash where a document's value belongs): the run went on, and Run returns
	// a *WrongKeyTypeError naming the key. Delete such a key by hand, or
	// Rebuild a collection (documents cannot be rebuilt).
	ResultNotAttempted
	// ResultUncertain means the repair was sent and may or may not have been
	// applied: its reply was lost (a network error), or Redis answered with
	// an error that does not show the repair refused before any write.
	// READONLY is one: a master demoted by a failover answers it to
	// go-redis's retry of a command whose first reply was lost, and that
	// first attempt may have been applied. Every such finding is counted in
	// Report.Uncertain, never silently dropped.
	ResultUncertain
)

var resultNames = [...]string{
	ResultNone: "none", ResultRepaired: "repaired", ResultReported: "reported", ResultDryRun: "dry-run",
	ResultVetoed: "vetoed", ResultRaced: "raced", ResultNotAttempted: "not-attempted", ResultUncertain: "uncertain",
}

// String returns the result's name, for example "repaired" or "raced".
func (r Result) String() string {
	if int(r) < len(resultNames) {
		return resultNames[r]
	}
	return "result(" + strconv.Itoa(int(r)) + ")"
}

// MarshalText makes results readable as JSON map keys.
func (r Result) MarshalText() ([]byte, error) { return []byte(r.String()), nil }

// Finding is the verdict on one entity, as hooks and Report.Examples see it.
type Finding struct {
	// Class is the verdict.
	Class Class
	// Key is the entity's key: the sorted-set member, hash field or
	// document id.
	Key string
	// Source is the source row; nil for orphans.
	Source *Row
	// Projected is what Redis held when it was read.
	Projected Projected
	// Result is what the run did about it. Hooks called before the repair
	// see ResultNone.
	Result Result
}

// Report summarises a Run. The counters always add up:
// sum of Counts over every class but ClassCurrent = Repaired + Skipped +
// Uncertain.
type Report struct {
	// Started is when the run began; Duration how long it took.
	Started  time.Time
	Duration time.Duration
	// Sampled and DryRun echo the RunOptions.
	Sampled bool
	DryRun  bool
	// Checked counts source rows compared with the projection, but not
	// those the orphan scan settles (see Scanned).
	Checked int64
	// Scanned counts projection entries examined for orphans. Only the
	// orphans among them appear in Counts, and those held ahead of their
	// row or with another value at its version (an entity created again
	// after the walk passed it, or changed by a foreign write), which
	// Checked leaves out: the others are entries of source rows, counted
	// when their row is checked. Redis's cursor scans return every entry
	// at least once, and may return one twice while Redis rehashes the
	// key during the scan: such an entry is counted twice here, and in
	// Counts if it is an orphan left in place (a removed orphan is gone
	// when it comes again, and is not counted again).
	Scanned int64
	// Counts holds the number of entities per Class (current included).
	Counts map[Class]int64
	// Results breaks the findings (every class but current) down by what
	// was done about them.
	Results map[Result]int64
	// Repaired counts repairs written; RepairedByClass splits it by class.
	Repaired        int64
	RepairedByClass map[Class]int64
	// Skipped counts findings left as they were: reported only, dry run,
	// vetoed, raced or not attempted (see Results for which; not attempted
	// includes repairs refused for a key of another Redis type).
	Skipped int64
	// Uncertain counts repairs sent whose outcome is unknown (see
	// ResultUncertain). Run also returns an error in that case.
	Uncertain int64
	// OrphanScanSkipped reports that a full run did not need to scan the
	// projection for orphans: it holds exactly as many values and versions
	// as the pass accounted for with source rows (see Run).
	OrphanScanSkipped bool
	// Examples holds the first Config.ExamplesPerClass findings of each
	// class other than current.
	Examples map[Class][]Finding

	tally tally
	// rewritten counts the repairs that wrote a source row's state (all
	// but removals), after which the entity is current.
	rewritten int64
	// rewrittenAt counts the rewritten repairs by Checked when they were
	// recorded (in order, one entry per distinct Checked: about one per
	// page): a pass run again after a slot move re-checked the entity only
	// if it got that far.
	rewrittenAt []rewrites
	// refused holds a *WrongKeyTypeError per repair refused for a key of
	// another type; Run and CheckKeys return them once they are done.
	refused []error
	// unsettled holds the findings left refused or uncertain, by examined
	// when they were recorded, for a pass run again that fails before it
	// gets that far (see carry). Both are rare.
	unsettled []unsettled
	// examined counts the source rows checked and the keys found absent
	// from the source (orphan candidates, which Checked leaves out): how
	// far a pass got, for unsettled.
	examined int64
	// orphaned holds the keys found ahead that turned out to be orphans
	// (their rows were deleted mid-pass) and were left in place, which an
	// orphan scan meets again and must not count twice. Rare, so usually
	// nil.
	orphaned map[string]struct{}
	// drifted holds the keys checked against their source rows and found
	// drifting (but missing and stale entries repaired or left as found,
	// which checkFound never counts), so that the orphan scan's check of
	// found rows (checkFound) does not count them twice. Usually small.
	drifted map[string]struct{}
}

// noteOrphan remembers that key was counted as an orphan outside the orphan
// scan.
func (r *Report) noteOrphan(key string) {
	if r.orphaned == nil {
		r.orphaned = make(map[string]struct{})
	}
	r.orphaned[key] = struct{}{}
}

// countedOrphan reports whether key was already counted as an orphan.
func (r *Report) countedOrphan(key string) bool {
	_, ok := r.orphaned[key]
	return ok
}

// rewrites counts n rewritten repairs recorded when Checked was at.
type rewrites struct{ at, n int64 }

// tally counts the projection entries a full pass accounted for with source
// rows, as they stand after its repairs.
type tally struct {
	versions, values int64
	// unknown is set when a repair raced or its outcome is unknown: the
	// entry's state is not known, so the counts prove nothing.
	unknown bool
}

func (t *tally) add(f *Finding) {
	switch f.Result {
	case ResultRepaired:
		// A repair writes the source row's state, or removes an entry
		// without one (an ahead entry whose row was deleted mid-pass).
		if f.Source != nil {
			t.versions++
			t.values++
		}
	case ResultRaced, ResultUncertain:
		t.unknown = true
	default:
		t.addAsRead(&f.Projected)
	}
}

// addAsRead counts an entry whose state is as read: current, or drift
// left alone.
func (t *tally) addAsRead(p *Projected) {
	if p.HasVersion {
		t.versions++
	}
	if p.HasValue {
		t.values++
	}
}

// Drift returns the number of findings: entities in any class but current.
func (r *Report) Drift() int64 {
	var n int64
	for c, k := range r.Counts {
		if c != ClassCurrent {
			n += k
		}
	}
	return n
}

// String summarises the report on one line, for logs.
func (r *Report) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "checked %d, scanned %d, drift %d", r.Checked, r.Scanned, r.Drift())
	sep := " ("
	for _, c := range Classes[1:] {
		if n := r.Counts[c]; n > 0 {
			fmt.Fprintf(&b, "%s%s %d", sep, c, n)
			sep = ", "
		}
	}
	if sep == ", " {
		b.WriteString(")")
	}
	fmt.Fprintf(&b, ", repaired %d, skipped %d", r.Repaired, r.Skipped)
	if r.Uncertain > 0 {
		fmt.Fprintf(&b, ", uncertain %d", r.Uncertain)
	}
	if r.DryRun {
		b.WriteString(", dry run")
	}
	fmt.Fprintf(&b, " in %s", r.Duration.Round(time.Millisecond))
	return b.String()
}

func newReport(opts RunOptions) *Report {
	return &Report{
		Started:         time.Now(),
		Sampled:         opts.Sample > 0,
		DryRun:          opts.DryRun,
		Counts:          make(map[Class]int64),
		Results:         make(map[Result]int64),
		RepairedByClass: make(map[Class]int64),
		Examples:        make(map[Class][]Finding),
	}
}

// carry adds to r, a pass that Run ran again after a slot move, what an
// earlier pass of the same run did. The run's start and duration span both
// passes.
//
// A full pass checks every row again: r saw the entities the earlier pass
// repaired as the repairs left them (current, or gone for a removal), so
// those repairs move back to the classes they were repaired from, and what
// the earlier pass only read, or left uncertain, r has checked anew. A
// sampled pass draws a new sample, so the two passes' reports add up.
func (r *Report) carry(earlier *Report, examples int) {
	r.Duration += r.Started.Sub(earlier.Started)
	r.Started = earlier.Started
	if r.Sampled {
		r.Checked += earlier.Checked
		r.Scanned += earlier.Scanned
		for c, n := range earlier.Counts {
			r.Counts[c] += n
		}
		for res, n := range earlier.Results {
			r.Results[res] += n
		}
		for c, n := range earlier.RepairedByClass {
			r.RepairedByClass[c] += n
		}
		r.Repaired += earlier.Repaired
		r.Skipped += earlier.Skipped
		r.Uncertain += earlier.Uncertain
		r.rewritten += earlier.rewritten
		r.refused = slices.Concat(earlier.refused, r.refused)
		r.keepExamples(earlier, examples, func(*Finding) bool { return true })
		return
	}
	// The earlier pass's refused and uncertain repairs: r met those of the
	// pages it checked again anew; the others, past where r failed, it
	// reports as the earlier pass left them (and returns the refusals).
	for _, u := range earlier.unsettled {
		if u.at <= r.examined {
			continue
		}
		r.Counts[u.class]++
		r.Results[u.result]++
		if u.result == ResultUncertain {
			r.Uncertain++
		} else {
			r.Skipped++
		}
		if u.refusal != nil {
			r.refused = append(r.refused, u.refusal)
		}
		r.unsettled = append(r.unsettled, u)
	}
	if earlier.Repaired == 0 {
		return
	}
	// Only the repairs of pages r checked again: a pass that failed
	// partway did not see the others, and its current entities are others.
	var seen int64
	for _, w := range earlier.rewrittenAt {
		if w.at <= r.Checked {
			seen += w.n
		}
	}
	r.Counts[ClassCurrent] -= min(seen, r.Counts[ClassCurrent])
	if r.Counts[ClassCurrent] == 0 {
		delete(r.Counts, ClassCurrent)
	}
	for c, n := range earlier.RepairedByClass {
		r.Counts[c] += n
		r.RepairedByClass[c] += n
	}
	r.Results[ResultRepaired] += earlier.Repaired
	r.Repaired += earlier.Repaired
	r.rewritten += earlier.rewritten
	r.rewrittenAt = append(r.rewrittenAt, earlier.rewrittenAt...)
	r.keepExamples(earlier, examples, func(f *Finding) bool { return f.Result == ResultRepaired })
}

// keepExamples puts the examples of earlier that keep selects before r's
// own, up to examples per class.
func (r *Report) keepExamples(earlier *Report, examples int, keep func(*Finding) bool) {
	for c, fs := range earlier.Examples {
		var kept []Finding
		for i := range fs {
			if keep(&fs[i]) && len(kept)+len(r.Examples[c]) < examples {
				kept = append(kept, fs[i])
			}
		}
		if len(kept) > 0 {
			r.Examples[c] = append(kept, r.Examples[c]...)
		}
	}
}

// unsettled is a finding whose repair was refused (refusal is its
// *WrongKeyTypeError) or left uncertain, recorded when examined was at.
type unsettled struct {
	at      int64
	class   Class
	result  Result
	refusal error
}

// record accounts for one finding whose Result is final.
func (r *Report) record(f *Finding, examples int) {
	r.Counts[f.Class]++
	if f.Class == ClassCurrent {
		return
	}
	r.Results[f.Result]++
	switch f.Result {
	case ResultRepaired:
		r.Repaired++
		r.RepairedByClass[f.Class]++
		if f.Source != nil {
			r.rewritten++
			if n := len(r.rewrittenAt); n > 0 && r.rewrittenAt[n-1].at == r.Checked {
				r.rewrittenAt[n-1].n++
			} else {
				r.rewrittenAt = append(r.rewrittenAt, rewrites{at: r.Checked, n: 1})
			}
		}
	case ResultUncertain:
		r.Uncertain++
	default:
		r.Skipped++
	}
	if len(r.Examples[f.Class]) < examples {
		ex := *f
		if f.Source != nil {
			// Copy, so an example does not pin its whole source page.
			row := *f.Source
			row.Value.Data = append([]byte(nil), row.Value.Data...)
			ex.Source = &row
		}
		r.Examples[f.Class] = append(r.Examples[f.Class], ex)
	}
}
