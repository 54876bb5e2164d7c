package reconcile

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/metric"

	"github.com/verity-go/verity/internal/deps"
	"github.com/verity-go/verity/projection"
)

// Defaults of Config.
const (
	// PageSizeDefault is the default number of source rows read, compared
	// and repaired per round trip.
	PageSizeDefault = 1000
	// PageSizeMax is the largest Config.PageSize: one page's two Redis
	// reads hold Redis's single thread for about 0.4 µs per entry each.
	PageSizeMax = 100_000
	// ExamplesPerClassDefault is the default number of findings kept per
	// class in Report.Examples.
	ExamplesPerClassDefault = 10
	// RepairTimeoutDefault bounds a repair batch once it has been sent.
	RepairTimeoutDefault = 10 * time.Second
	// RebuildMarkerTTLDefault is the default lifetime of a rebuild marker.
	RebuildMarkerTTLDefault = time.Minute
	// ReadAheadDefault is the default number of pages a full run has read
	// at once, counting the one being classified.
	ReadAheadDefault = 4
	// ReadAheadMax is the largest Config.ReadAhead.
	ReadAheadMax = 64
	// SampleMax is the largest RunOptions.Sample: a sample is held in
	// memory, and a larger one is a full run's work done less well.
	SampleMax = 1_000_000
)

// rebuildMarkerPerRow is the least RebuildMarkerTTL allowed per row of
// Config.PageSize: the marker is refreshed between pages, so it must
// outlast reading and copying one (about 15µs a row on a 2-core VM at
// PageSizeMax).
const rebuildMarkerPerRow = 100 * time.Microsecond

// repairPerRow is the least RepairTimeout allowed per row of
// Config.PageSize: a page of repairs (after a Redis loss, every row of it)
// is one batch bounded by RepairTimeout.
const repairPerRow = 100 * time.Microsecond

// switchPerBucket is the least RepairTimeout allowed per version bucket of
// the target's layout: Rebuild's switch, bounded by RepairTimeout, checks
// and moves every bucket, whatever PageSize is (about 5µs a bucket on a
// 2-core VM; a whole Rebuild at VersionBucketsMax took 0.36–0.52s).
const switchPerBucket = 20 * time.Microsecond

// Action is what a run does about a class of findings.
type Action uint8

const (
	// ActionDefault uses the class's default: repair missing, stale and
	// corrupt; report ahead and orphan.
	ActionDefault Action = iota
	// ActionReport counts and reports findings without writing anything.
	ActionReport
	// ActionRepair repairs findings with a compare-and-set write. For ahead
	// and orphan it is the explicit opt-in to force the source's state
	// onto the projection (ahead is overwritten with the source's older
	// version; orphans are removed).
	ActionRepair
)

// Policy chooses an Action per class. The zero Policy is the default.
type Policy struct {
	Missing Action
	Stale   Action
	Corrupt Action
	Ahead   Action
	Orphan  Action
}

// For returns the resolved action (never ActionDefault) for class c.
func (p Policy) For(c Class) Action {
	var a Action
	switch c {
	case ClassMissing:
		a = p.Missing
	case ClassStale:
		a = p.Stale
	case ClassCorrupt:
		a = p.Corrupt
	case ClassAhead:
		a = p.Ahead
	case ClassOrphan:
		a = p.Orphan
	default:
		return ActionReport
	}
	if a != ActionDefault {
		return a
	}
	if c == ClassAhead || c == ClassOrphan {
		return ActionReport
	}
	return ActionRepair
}

// Config tunes a Reconciler. The zero Config is valid.
type Config struct {
	// PageSize is the number of source rows read per page, and the number
	// of projection entries read (and repaired) per round trip. Memory use
	// is proportional to it, not to the table. At most PageSizeMax.
	// Defaults to PageSizeDefault.
	PageSize int
	// ReadAhead is the number of pages a full run reads at once, counting
	// the one being classified and repaired: up to ReadAhead-1 later pages
	// are read (source, then projection) meanwhile, and 1 reads one page
	// at a time, with no overlap. Redis executes commands on one thread:
	// with several pages in flight it reads one page while the client
	// encodes the next request and decodes the previous reply, so a pass
	// takes about as long as Redis needs for the reads (measured on 2
	// cores, 200,000 rows in pages of 1,000: 1.34x the rows per second of
	// ReadAhead 1 at 2, 1.37x at 4, no more at 6 or 8). The price is Redis
	// time: a pass keeps Redis busier while it lasts, so lower it where a
	// reconciliation must leave more room to live traffic. Memory holds up
	// to ReadAhead pages. Rebuild and sampled runs are not affected.
	// Defaults to ReadAheadDefault.
	ReadAhead int
	// ExamplesPerClass is the number of findings kept per class in
	// Report.Examples; -1 keeps none. Defaults to ExamplesPerClassDefault.
	ExamplesPerClass int
	// MaxValueBytes bounds a source row as the projection's
	// Config.MaxValueBytes does: a hash or document row's value, a row's
	// key, and the keys a document row's key makes (escaped, with the
	// prefix and suffixes: projection.Keyspace.MaxKeyLen). A row over it is
	// refused with *InvalidRowError, like a row with a version that is not
	// positive, where Redis would close the connection on its write and
	// leave the page's repairs uncertain on every run. A value or version
	// read from Redis at or over it (one the projector accepted at the
	// limit, a writer's) is sent back to the repair script as its SHA-1,
	// to compare before writing. Set it to the server's proto-max-bulk-len
	// if that was lowered. Defaults to
	// projection.MaxValueBytesDefault (512 MB).
	MaxValueBytes int
	// Policy chooses what is repaired. Defaults to repairing missing, stale
	// and corrupt entries and only reporting ahead and orphan ones.
	Policy Policy
	// SkipOrphans turns off the orphan check that ends a full run and the
	// orphan sample of a sampled run. Defaults to false: runs look for
	// entries the source does not have. For documents the check SCANs every
	// key of the database (documents have no collection to count or
	// scan), so on a large shared database consider turning it off for
	// frequent runs and running it now and then. That scan needs a
	// Target.Client that SCAN reaches every key through, a *redis.Client
	// (single node, Sentinel) or *redis.ClusterClient: New refuses a
	// KindDocument Target on any other client, a *redis.Ring included,
	// unless SkipOrphans is set.
	SkipOrphans bool
	// BeforeRepair, when set, is called before each repair with the finding
	// (Result is ResultNone); returning false vetoes it (ResultVetoed).
	// Defaults to nil (every repair the policy allows proceeds).
	BeforeRepair func(ctx context.Context, f Finding) bool
	// AfterRepair, when set, is called after each repair attempt with its
	// Result: repaired, raced, uncertain, or not attempted when the repair
	// was refused before anything was written (a layout mismatch, a value
	// the gate refuses, a key of another Redis type: WrongKeyTypeError).
	// Defaults to nil.
	AfterRepair func(ctx context.Context, f Finding)
	// OnAlert, when set, is called for every ahead and orphan finding,
	// before any repair: they mean the projection knows something the
	// source does not, which deserves a human. Defaults to nil.
	OnAlert func(ctx context.Context, f Finding)
	// RepairTimeout bounds a batch of repairs once sent, and Rebuild's
	// switch and clean-up. These run on a context detached from the run's
	// cancellation, so that a cancelled run still learns (and reports) what
	// its last batch did. go-redis ends a command in flight only at its
	// connection's deadline: with the client's ContextTimeoutEnabled this
	// timeout is that deadline; without it, a stalled Redis holds the batch
	// (and a cancelled Run) for the client's ReadTimeout (and WriteTimeout)
	// instead, whatever this timeout says. At least 1ms, at least 100µs
	// per row of PageSize (a page's repairs are one batch), and, checked by
	// New, at least 20µs per version bucket of Target.Keyspace (Rebuild's
	// switch moves every bucket: 1.31s at projection.VersionBucketsMax).
	// These are floors, not margins: a loaded machine needs more (one
	// switch of VersionBucketsMax buckets outlasted 1.31s in a CI run under
	// -race). Defaults to RepairTimeoutDefault.
	RepairTimeout time.Duration
	// RebuildMarkerTTL is the lifetime of a rebuild's marker key, refreshed
	// while the rebuild makes progress. If the rebuilding process dies, the
	// gate stops dual-writing once it expires. Only the marker expires: the
	// dead rebuild's shadow values and versions, copy count and shadow
	// layout have no TTL and stay in Redis until the next Rebuild of the
	// collection starts and clears them, or until deleted by hand (see
	// "Rebuild" in the package documentation for their names). A rebuild
	// refreshes it between pages, so it must outlast reading and copying
	// one page, or every rebuild aborts: at least 100ms, and at least 100µs
	// per row of PageSize (10s at PageSizeMax; a 2-core VM read and copied
	// about 15µs a row); a shorter one is refused with a *ConfigError.
	// These are floors, not margins: the first page dials connections and
	// loads scripts, and a loaded machine is slower. Defaults to
	// RebuildMarkerTTLDefault.
	RebuildMarkerTTL time.Duration
	// Logger receives a line per run (Run and CheckKeys) and per rebuild (and a warning for a
	// rebuild with RebuildReport.Conflicts), with the attributes
	// "kind" and "collection" (the Target's Name, or a document target's
	// Namespace) and, for a failed one, at Warn, "error". Defaults to
	// discarding.
	Logger *slog.Logger
	// MeterProvider receives the reconciler's metrics (verity.reconcile.*:
	// runs, entities by class, what was done about each finding, repairs
	// by class, run durations, rebuilds; see the README's metrics table),
	// recorded once per run from its Report so they add up like it.
	// Defaults to nil (left nil by WithDefaults): nothing is recorded.
	MeterProvider metric.MeterProvider
}

// WithDefaults returns a copy of c (nil allowed) with defaults filled in.
func (c *Config) WithDefaults() *Config {
	var out Config
	if c != nil {
		out = *c
	}
	if out.MaxValueBytes == 0 {
		out.MaxValueBytes = projection.MaxValueBytesDefault
	}
	if out.PageSize == 0 {
		out.PageSize = PageSizeDefault
	}
	if out.ReadAhead == 0 {
		out.ReadAhead = ReadAheadDefault
	}
	if out.ExamplesPerClass == 0 {
		out.ExamplesPerClass = ExamplesPerClassDefault
	}
	if out.RepairTimeout == 0 {
		out.RepairTimeout = RepairTimeoutDefault
	}
	if out.RebuildMarkerTTL == 0 {
		out.RebuildMarkerTTL = RebuildMarkerTTLDefault
	}
	if out.Logger == nil {
		out.Logger = slog.New(slog.DiscardHandler)
	}
	return &out
}

func (c *Config) validate() error {
	switch {
	case c.MaxValueBytes < 0:
		return &ConfigError{Field: "Config.MaxValueBytes", Reason: fmt.Sprintf("is %d; use a positive size, or 0 for the default (%d)", c.MaxValueBytes, projection.MaxValueBytesDefault)}
	case c.PageSize < 1 || c.PageSize > PageSizeMax:
		return &ConfigError{Field: "Config.PageSize", Reason: fmt.Sprintf("must be between 1 and %d (0 uses the default)", PageSizeMax)}
	case c.ReadAhead < 1 || c.ReadAhead > ReadAheadMax:
		return &ConfigError{Field: "Config.ReadAhead", Reason: fmt.Sprintf("must be between 1 and %d (0 uses the default)", ReadAheadMax)}
	case c.ExamplesPerClass < -1:
		return &ConfigError{Field: "Config.ExamplesPerClass", Reason: "must be -1 (none) or more"}
	case c.RepairTimeout < time.Millisecond:
		return &ConfigError{Field: "Config.RepairTimeout", Reason: fmt.Sprintf("is %s; use at least 1ms, enough for a Redis round trip (0 uses the default)", c.RepairTimeout)}
	case c.RepairTimeout < time.Duration(c.PageSize)*repairPerRow:
		return &ConfigError{Field: "Config.RepairTimeout", Reason: fmt.Sprintf("is %s, too short for a batch of repairs of a page of Config.PageSize (%d) rows; use at least %s, or a smaller PageSize",
			c.RepairTimeout, c.PageSize, time.Duration(c.PageSize)*repairPerRow)}
	case c.RebuildMarkerTTL < 0 || (c.RebuildMarkerTTL > 0 && c.RebuildMarkerTTL < 100*time.Millisecond):
		return &ConfigError{Field: "Config.RebuildMarkerTTL", Reason: "must be at least 100ms (0 uses the default)"}
	case c.RebuildMarkerTTL < time.Duration(c.PageSize)*rebuildMarkerPerRow:
		// Refreshed between pages only: it must outlast reading and
		// copying one page.
		return &ConfigError{Field: "Config.RebuildMarkerTTL", Reason: fmt.Sprintf("is %s, too short to outlast reading and copying a page of Config.PageSize (%d) rows; use at least %s, or a smaller PageSize",
			c.RebuildMarkerTTL, c.PageSize, time.Duration(c.PageSize)*rebuildMarkerPerRow)}
	}
	for _, a := range []struct {
		field string
		a     Action
	}{{"Missing", c.Policy.Missing}, {"Stale", c.Policy.Stale}, {"Corrupt", c.Policy.Corrupt}, {"Ahead", c.Policy.Ahead}, {"Orphan", c.Policy.Orphan}} {
		if a.a > ActionRepair {
			return &ConfigError{Field: "Config.Policy." + a.field, Reason: "must be ActionDefault, ActionReport or ActionRepair"}
		}
	}
	return nil
}

// Target says which projection a Reconciler checks.
type Target struct {
	// Client reaches the Redis server, Sentinel group or Cluster holding
	// the projection. Required. It must bound how long a command waits
	// for Redis (see RepairTimeout): a *redis.Client, *redis.ClusterClient
	// or *redis.Ring whose ReadTimeout or WriteTimeout is -2, or -1 without
	// ContextTimeoutEnabled, is refused with *ConfigError, as by
	// projection.NewRedisProjector. With ContextTimeoutEnabled and the
	// timeouts -1, only a context's deadline bounds a command: a Run,
	// CheckKeys or Rebuild whose ctx has none, cancelled while Redis has
	// stopped answering, waits for Redis (repairs and a rebuild's clean-up
	// keep RepairTimeout's bound). For KindDocument it must be a
	// *redis.Client or *redis.ClusterClient unless Config.SkipOrphans is
	// set: the documents' orphan scan cannot cover a *redis.Ring's shards.
	Client redis.UniversalClient
	// Keyspace names the projection's keys; it must be the one the gate
	// writes with (RedisProjector.Keyspace), version bucket count included
	// (a collection stored with another count fails runs with
	// projection.ErrLayoutMismatch, and Rebuild with this Keyspace migrates
	// it to this count). Required: the zero Keyspace is refused, since it
	// would reconcile (and repair into) keys no projector writes.
	Keyspace projection.Keyspace
	// Kind is the projection's data structure. Required.
	Kind projection.Kind
	// Name is the collection (sorted set or hash) whose members are the
	// source's keys. For KindDocument it must be empty (see Namespace).
	Name string
	// Namespace, for KindDocument only, is what the projector puts before
	// each key to name its document: projection.DocumentMapper's
	// namespace. The document of source key k is Namespace + k, and the
	// orphan check looks only at documents whose id starts with Namespace,
	// so streams projected under one Keyspace with their own namespaces
	// ("order:", "invoice:") are each reconciled without calling the
	// other's documents orphans. Defaults to "": source keys are document
	// ids, and every document under the Keyspace's prefix is taken for
	// the source's.
	Namespace string
}

// label names the target in metrics (AttributeName) and log lines
// ("collection"): its Name, or a document target's Namespace (a document's
// own name is an id: unbounded).
func (t Target) label() string {
	if t.Kind == projection.KindDocument {
		return t.Namespace
	}
	return t.Name
}

func (t Target) validate() error {
	if deps.Missing(t.Client) {
		return &ConfigError{Field: "Target.Client", Reason: "must not be nil"}
	}
	if u := deps.UnboundedRedis(t.Client); u != nil {
		return &ConfigError{Field: "Target.Client " + u.Field, Reason: u.Reason}
	}
	if t.Keyspace.IsZero() {
		return &ConfigError{Field: "Target.Keyspace", Reason: "is required: use the projector's Keyspace() (or projection.NewKeyspace with the projector's prefix)"}
	}
	switch t.Kind {
	case projection.KindSortedSet, projection.KindHash:
		if t.Namespace != "" {
			return &ConfigError{Field: "Target.Namespace", Reason: "is for KindDocument only; leave it empty for a collection"}
		}
	case projection.KindDocument:
		if t.Name != "" {
			return &ConfigError{Field: "Target.Name", Reason: "must be empty for KindDocument; a DocumentMapper's namespace goes in Target.Namespace"}
		}
	default:
		return &ConfigError{Field: "Target.Kind", Reason: "must be projection.KindSortedSet, KindHash or KindDocument"}
	}
	return nil
}

// target returns the projection target of the entity key.
func (t Target) target(key string) projection.Target {
	if t.Kind == projection.KindDocument {
		return projection.Target{Kind: t.Kind, Name: t.Namespace + key}
	}
	return projection.Target{Kind: t.Kind, Name: t.Name, Member: key}
}
